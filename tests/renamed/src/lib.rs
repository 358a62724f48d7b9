//! Nothing to use: `tests/ui.rs` compiles handlers against `idem-axum` renamed to
//! `pay` in this crate's `Cargo.toml`.
