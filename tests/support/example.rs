//! The payments example's binary, shared by the tests that run it as a process.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// The example binary, (re)built once per run: `cargo test --test payments` alone
/// would otherwise find a stale one, or none.
pub(crate) fn binary() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = std::env::current_exe().expect("test exe");
            let profile_dir = exe
                .parent()
                .and_then(|deps| deps.parent())
                .expect("target dir");
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            let mut build = Command::new(cargo);
            build
                .args(["build", "--example", "payments"])
                .args(["--features", "mysql,postgres,sqlite"])
                .current_dir(env!("CARGO_MANIFEST_DIR"));
            if profile_dir.ends_with("release") {
                build.arg("--release");
            }
            let status = build.status().expect("run cargo build");
            assert!(status.success(), "building the payments example failed");
            profile_dir.join("examples").join("payments")
        })
        .clone()
}
