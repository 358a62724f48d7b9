//! The examples' binaries, shared by the tests that run them as processes.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// The payments example, (re)built once per run: `cargo test --test payments` alone
/// would otherwise find a stale one, or none.
pub(crate) fn binary() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| build("payments", "mysql,postgres,sqlite"))
        .clone()
}

/// The quick-start example, built as a user runs it (SQLite alone).
#[allow(dead_code)] // the fault suite runs only the payments example
pub(crate) fn quickstart() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(|| build("quickstart", "sqlite")).clone()
}

fn build(example: &str, features: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .args(["build", "--example", example, "--features", features])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    let status = build.status().expect("run cargo build");
    assert!(status.success(), "building the {example} example failed");
    profile_dir.join("examples").join(example)
}
