//! Compile-time behaviour of `#[idempotent]`: what it accepts (`tests/ui/pass`)
//! and the spanned error for each misuse (`tests/ui/fail`, one mistake a file).
//! Regenerate the expected errors with `TRYBUILD=overwrite cargo test --all-features --test ui`.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("tests/ui/pass/*.rs");
    cases.compile_fail("tests/ui/fail/*.rs");
}
