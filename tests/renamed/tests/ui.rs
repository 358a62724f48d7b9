//! `idem-axum` renamed to `pay` in this crate's Cargo.toml: the handlers of
//! `ui/pass` compile, told the name with `crate = "…"` or reading it from
//! Cargo.toml, and `ui/fail` holds the errors that remain. Regenerate them with
//! `TRYBUILD=overwrite cargo test -p idem-renamed-dependency`.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("ui/pass/*.rs");
    cases.compile_fail("ui/fail/*.rs");
}
