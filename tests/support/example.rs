//! The examples' binaries, shared by the tests that run them as processes.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// The payments example, (re)built once per run: `cargo test --test payments` alone
/// would otherwise find a stale one, or none.
#[allow(dead_code)] // the orders consumer's test runs only its own example
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

/// The orders consumer example, built as its README line runs it.
#[allow(dead_code)] // only its own test runs it
pub(crate) fn orders_consumer() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| build("orders_consumer", "sqlite,lapin"))
        .clone()
}

/// The operator's tool, `idem` (crate `idem-cli`).
#[allow(dead_code)] // only the fault suite runs it
pub(crate) fn cli() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let profile_dir = profile_dir();
            cargo_build(
                &["-p", "idem-cli", "--bin", "idem"],
                &profile_dir,
                "idem-cli",
            );
            profile_dir.join("idem")
        })
        .clone()
}

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target dir")
        .to_path_buf()
}

fn cargo_build(args: &[&str], profile_dir: &std::path::Path, what: &str) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .arg("build")
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    let status = build.status().expect("run cargo build");
    assert!(status.success(), "building {what} failed");
}

fn build(example: &str, features: &str) -> PathBuf {
    let profile_dir = profile_dir();
    let args = ["--example", example, "--features", features];
    cargo_build(&args, &profile_dir, &format!("the {example} example"));
    profile_dir.join("examples").join(example)
}
