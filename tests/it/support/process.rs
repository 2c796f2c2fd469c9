//! Processes the tests start: a test alone in a child process of this binary, the Python
//! clients, and what a missing tool means (a SKIP on a developer machine, a failure in CI).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

/// Set in the child process [`isolated`] starts.
const ISOLATED: &str = "SLUICE_IT_ISOLATED";

/// Whether the calling test should run its body in this process. In the test binary's usual
/// run it starts a child process of the binary that runs only `test` (its path as printed by
/// `--list`, e.g. `server_threads::spread`), waits for it to pass, and returns false; in that
/// child it returns true. For the few tests whose assertions read process-wide state that every
/// gateway changes (a metric without a label the test could make its own).
pub fn isolated(test: &str) -> bool {
    if std::env::var_os(ISOLATED).is_some() {
        return true;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([test, "--exact", "--test-threads=1", "--nocapture"])
        .env(ISOLATED, "1")
        .output()
        .expect("run the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{test} in its own process:\n{stdout}\n{stderr}"
    );
    false
}

/// A tool the test needs is missing: fail under CI (`.ci/run` installs everything), print a
/// SKIP line elsewhere.
pub fn skip(why: &str) {
    if std::env::var_os("CI").is_some() {
        panic!("required in CI: {why}");
    }
    eprintln!("SKIP: {why}");
}

/// The Python interpreter with the given modules: `$SLUICE_PYTHON` or `.venv/bin/python`
/// (`.ci/run` creates it from tests/python/requirements.txt); `None` after [`skip`] without it.
pub fn python_with(modules: &[&str]) -> Option<PathBuf> {
    let candidate = std::env::var_os("SLUICE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python"));
    let import = format!("import {}", modules.join(", "));
    let ok = Command::new(&candidate)
        .args(["-c", &import])
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return Some(candidate);
    }
    skip(&format!(
        "no Python with {modules:?} at {} (run `bash .ci/run` or set SLUICE_PYTHON)",
        candidate.display()
    ));
    None
}

/// A script in tests/python.
pub fn python_script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(name)
}

/// Run the check script `name` of tests/python with `python` and `env` (off the async
/// runtime), print what it printed, and assert that it exited 0 with every check passed.
pub async fn python_checks(python: PathBuf, name: &str, env: Vec<(&'static str, String)>) {
    let script = python_script(name);
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python).arg(script).envs(env).output().unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{name} checks failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("passed, 0 failed"), "{stdout}");
}

/// Write a file in one step, so a reload never sees half of it.
pub fn write_atomically(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Everything an exited child wrote: its stdout, then its stderr.
pub fn output_of(child: &mut Child) -> String {
    let mut out = String::new();
    let (mut stdout, mut stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    stdout.read_to_string(&mut out).unwrap();
    stderr.read_to_string(&mut out).unwrap();
    out
}
