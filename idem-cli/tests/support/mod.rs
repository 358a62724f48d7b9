//! Runs the `idem` binary as an operator does.

use std::process::Command;

/// What one run printed, and its exit status.
pub(crate) struct Run {
    pub(crate) code: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

/// `idem --database-url <url> <args>`, with no `DATABASE_URL` or `IDEM_SEAL_KEYS`
/// of the caller's.
pub(crate) fn idem(url: &str, args: &[&str]) -> Run {
    idem_with(url, args, &[])
}

/// [`idem`] with these environment variables.
pub(crate) fn idem_with(url: &str, args: &[&str], env: &[(&str, &str)]) -> Run {
    let output = Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("--database-url")
        .arg(url)
        .args(args)
        .env_remove("DATABASE_URL")
        .env_remove("IDEM_SEAL_KEYS")
        .envs(env.iter().copied())
        .output()
        .expect("run idem");
    Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}
