//! Headless Chromium for the tests that look at a page as a person would: where it is, one
//! run with a fresh profile and no network chatter, and where screenshots go.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

/// The installed Chromium, if any.
pub fn chromium() -> Option<PathBuf> {
    ["/usr/bin/chromium", "/usr/bin/chromium-browser"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// Where screenshots are saved: the cargo target directory.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"))
}

/// Run headless Chromium on `url` with `extra` flags; returns (stdout, stderr).
pub async fn run_chromium(bin: &Path, url: &str, extra: &[String]) -> (String, String) {
    let profile = tempfile::tempdir().unwrap();
    let mut cmd = tokio::process::Command::new(bin);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--enable-logging=stderr",
        "--v=0",
    ])
    .arg(format!("--user-data-dir={}", profile.path().display()))
    .args(extra)
    .arg(url)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(90), cmd.output())
        .await
        .expect("chromium did not finish within 90 s")
        .expect("chromium could not be started");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
