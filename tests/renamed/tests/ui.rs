//! `#[idempotent(crate = "…")]` with `idem-axum` renamed to `pay`: the handlers of
//! `ui/pass` compile, and without the option the error names the crate it looked
//! for (`ui/fail`). Regenerate the expected errors with
//! `TRYBUILD=overwrite cargo test -p idem-renamed-dependency`.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("ui/pass/*.rs");
    cases.compile_fail("ui/fail/*.rs");
}
