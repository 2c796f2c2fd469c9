//! The `sluice` binary as operators use it: `check`, `key new`, `serve` with a bad or good
//! config, JSON logs without secrets or prompts, and graceful shutdown on SIGTERM.

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sha2::Digest;
use sluice::sim::{SimConfig, SimKind};
use support::*;

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

/// `sluice check --config path`, which must exit with 1.
#[track_caller]
fn check_fails(path: &std::path::Path) -> std::process::Output {
    let out = sluice()
        .args(["check", "--config"])
        .arg(path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    out
}

/// What `sluice check` prints for `toml` written to a file named `name`, which must fail.
#[track_caller]
fn check_error(name: &str, toml: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, toml).unwrap();
    String::from_utf8_lossy(&check_fails(&path).stderr).into_owned()
}

#[test]
fn shipped_configs_are_valid() {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut files = vec![format!("{root}/config/sluice.toml")];
    for e in std::fs::read_dir(format!("{root}/config/examples")).unwrap() {
        files.push(e.unwrap().path().display().to_string());
    }
    assert!(files.len() >= 3);
    for f in files {
        let out = sluice()
            .args(["check", "--config", &f])
            .env("SLUICE_ADMIN_TOKEN", "t")
            .env("SLUICE_REDIS_URL", "redis://127.0.0.1:6379")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{f}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn check_names_a_broken_tokenizer_folder() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("tok");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("tokenizer.json"), "{ not json").unwrap();
    let toml = format!(
        "[[models]]\nname = \"m\"\ntokenizer = \"{}\"\n",
        folder.display()
    );
    let err = check_error("tok.toml", &toml);
    let file = folder.join("tokenizer.json");
    assert!(
        err.contains("models[0].tokenizer")
            && err.contains(&format!("{}: not JSON", file.display())),
        "{err}"
    );
}

#[test]
fn check_prints_every_problem_with_its_location() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(
        &path,
        "[routing]\npolicy = \"fastest\"\n[[backends]]\nname = \"a\"\nkind = \"vllm\"\nurl = \"nope\"\n[admin]\nlisten = \"0.0.0.0:1\"\ntoken = \"${UNSET_FOR_SURE}\"\n",
    )
    .unwrap();
    let out = check_fails(&path);
    let err = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "routing.policy",
        "backends[0].url",
        "admin.token",
        "UNSET_FOR_SURE",
        "bad.toml",
    ] {
        assert!(err.contains(needle), "missing {needle} in:\n{err}");
    }
    // A syntax error names the line.
    std::fs::write(&path, "[server]\nlisten = \n").unwrap();
    let out = check_fails(&path);
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
    // `serve` refuses it the same way and starts nothing.
    let out = sluice()
        .args(["serve", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("line 2"));
}

#[test]
fn key_new_prints_key_and_its_hash() {
    let out = sluice()
        .args(["key", "new", "--name", "alice"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let key = stdout
        .lines()
        .find_map(|l| l.strip_prefix("key: "))
        .unwrap();
    let hash = stdout
        .lines()
        .find_map(|l| l.strip_prefix("hash: "))
        .unwrap();
    assert!(key.starts_with("sk-sluice-"));
    assert_eq!(
        hash,
        format!(
            "sha256:{}",
            hex::encode(sha2::Sha256::digest(key.as_bytes()))
        )
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("name = \"alice\""));
}

struct Serve {
    child: Child,
    addr: String,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Start `sluice serve` with JSON logs and wait for its listening line.
#[allow(clippy::zombie_processes)] // `Serve`'s Drop kills and waits for it
fn serve(config: &str, dir: &std::path::Path) -> Serve {
    let path = dir.join("sluice.toml");
    std::fs::write(&path, config).unwrap();
    let mut child = sluice()
        .args(["serve", "--config"])
        .arg(&path)
        .env("SLUICE_LOG_FORMAT", "json")
        .env("SLUICE_LOG", "info")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let line = rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("no listening line");
        let v: serde_json::Value =
            serde_json::from_str(&line).unwrap_or_else(|_| panic!("not JSON: {line}"));
        if v["message"] == "sluice listening" {
            let addr = v["addr"].as_str().unwrap().to_string();
            return Serve {
                child,
                addr,
                lines: rx,
            };
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_access_log_without_prompts_and_graceful_sigterm() {
    // Tokens every 20 ms (speed 1): a 60-token stream takes over a second.
    let s = sim_with(SimConfig::new(SimKind::Vllm, vec!["m".into()]).speed(1.0)).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cfg = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\nshutdown_grace = \"10s\"\n{FAST_HEALTH}{}",
        backend("b", "vllm", &s.url(), &["m"])
    );
    let mut srv = serve(&cfg, dir.path());
    let base = format!("http://{}", srv.addr);
    eventually(Duration::from_secs(10), "ready", || {
        let url = format!("{base}/readyz");
        async move {
            client()
                .get(url)
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        }
    })
    .await;

    let secret_prompt = "PURPLE-ELEPHANT-7781";
    let body = serde_json::json!({"model": "m", "stream": true, "max_tokens": 60,
        "messages": [{"role": "user", "content": secret_prompt}]});
    let mut resp = client()
        .post(format!("{base}/v1/chat/completions"))
        .header("authorization", "Bearer sk-client-secret-should-not-appear")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));

    // SIGTERM while the stream is in flight: readiness goes first, the stream still finishes.
    let pid = srv.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let sent = Instant::now();
    let mut rest = Vec::new();
    while let Some(c) = resp.chunk().await.unwrap() {
        rest.extend_from_slice(&c);
    }
    let tail = String::from_utf8_lossy(&rest);
    assert!(
        tail.trim_end().ends_with("data: [DONE]"),
        "stream cut by shutdown: {tail}"
    );
    let status = poll(Duration::from_secs(15), "exit after SIGTERM", || {
        let exited = srv.child.try_wait().unwrap();
        let lines = exited.map(|st| (st, srv.lines.try_iter().collect::<Vec<String>>()));
        async move { lines }
    })
    .await;
    let (exit, lines) = status;
    assert!(exit.success(), "exit status {exit:?}");
    eprintln!(
        "stream finished and process exited {:?} after SIGTERM",
        sent.elapsed()
    );
    // New connections are refused once draining started.
    assert!(client()
        .get(format!("{base}/healthz"))
        .send()
        .await
        .is_err());

    let access: Vec<serde_json::Value> = lines
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "request")
        .collect();
    assert_eq!(access.len(), 1, "{lines:?}");
    let a = &access[0];
    assert_eq!(a["status"], 200);
    assert_eq!(a["model"], "m");
    assert_eq!(a["backend"], "b");
    assert_eq!(a["stream"], true);
    assert!(
        a["completion_tokens"]
            .as_u64()
            .is_some_and(|n| n > 0 && n <= 60),
        "{a}"
    );
    assert!(a["ttft_ms"].as_f64().unwrap() > 0.0);
    assert!(a["request_id"].as_str().unwrap().len() == 32);
    let all = lines.join("\n");
    assert!(!all.contains(secret_prompt), "prompt leaked into logs");
    assert!(!all.contains("sk-client-secret"), "key leaked into logs");
}

/// A non-streamed chat request from `from` with `x-request-id: id` and these
/// `X-Forwarded-For` fields.
async fn chat_from(base: &str, from: &str, id: &str, forwarded_for: &[&str]) {
    let c = reqwest::Client::builder()
        .local_address(from.parse::<std::net::IpAddr>().unwrap())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut req = c
        .post(format!("{base}/v1/chat/completions"))
        .header("x-request-id", id)
        .json(&chat_body("m", false, 5));
    for v in forwarded_for {
        req = req.header("x-forwarded-for", *v);
    }
    assert_eq!(req.send().await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn access_log_names_the_forwarded_client_only_behind_a_trusted_proxy() {
    let s = sim(SimKind::Vllm, &["m"]).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cfg = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\ntrusted_proxies = [\"127.0.0.2/32\", \"10.0.0.0/8\"]\n{FAST_HEALTH}{}",
        backend("b", "vllm", &s.url(), &["m"])
    );
    let srv = serve(&cfg, dir.path());
    let base = format!("http://{}", srv.addr);
    eventually(Duration::from_secs(10), "ready", || {
        let url = format!("{base}/readyz");
        async move {
            client()
                .get(url)
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        }
    })
    .await;
    // Through the trusted proxy (and a trusted hop before it): the client wrote the leftmost
    // entry itself, the proxies appended the rest.
    chat_from(
        &base,
        "127.0.0.2",
        "via-proxy",
        &["6.6.6.6, 203.0.113.9", "10.1.1.1"],
    )
    .await;
    // Directly from an address that is no proxy: its X-Forwarded-For is the client's to invent.
    chat_from(&base, "127.0.0.3", "spoofer", &["203.0.113.50"]).await;
    chat_from(&base, "127.0.0.2", "proxy-itself", &[]).await;

    let want = [
        ("via-proxy", "203.0.113.9"),
        ("spoofer", "127.0.0.3"),
        ("proxy-itself", "127.0.0.2"),
    ];
    let mut clients = std::collections::HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while clients.len() < want.len() {
        let line = srv
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .unwrap_or_else(|_| panic!("access lines missing; seen {clients:?}"));
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if v["message"] == "request" {
            let id = v["request_id"].as_str().unwrap_or("").to_string();
            clients.insert(id, v["client"].as_str().unwrap_or("").to_string());
        }
    }
    for (id, client) in want {
        assert_eq!(
            clients.get(id).map(String::as_str),
            Some(client),
            "{clients:?}"
        );
    }
}

#[test]
fn check_reports_an_out_of_range_value_with_its_line() {
    let err = check_error(
        "range.toml",
        "[server]\nthreads = 2\n[routing]\nmax_attempts = 40\n",
    );
    assert!(
        err.contains("range.toml: routing.max_attempts: must be between 1 and 16 (line 4)"),
        "{err}"
    );
}

#[test]
fn check_reports_a_bad_trusted_proxy_range_with_its_line() {
    let err = check_error(
        "proxies.toml",
        "[server]\nthreads = 2\ntrusted_proxies = [\"10.0.0.0/8\", \"10.0.0.0/40\"]\n",
    );
    assert!(
        err.contains("proxies.toml: server.trusted_proxies[1]: `10.0.0.0/40` is not an address range like \"10.0.0.0/8\" or \"fd00::/8\", nor an address (line 3)"),
        "{err}"
    );
}
