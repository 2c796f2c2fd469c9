//! Hot reload on file change: a backend added and one removed while a stream runs on it (the
//! stream completes: drained, not dropped), keys changed, a bad file rejected while the old
//! config keeps serving, and backend counters surviving a reload.

use crate::support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sha2::Digest;
use sluice::sim::{SimConfig, SimKind};
use support::process::write_atomically;
use support::*;

fn reloads(result: &str) -> f64 {
    let text = sluice::telemetry::metrics::handle().render();
    let prefix = format!("sluice_config_reloads_total{{result=\"{result}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

fn head(extra: &str) -> String {
    format!("[routing]\nexpose_backend_header = true\n[reload]\ninterval = \"50ms\"\n{STEADY_HEALTH}{extra}")
}

/// A gateway started from `head(backends)` written to a file of its own (the directory lives
/// as long as the returned guard).
async fn from_file(backends: &str) -> (tempfile::TempDir, PathBuf, TestGateway) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let v1 = head(backends);
    std::fs::write(&path, &v1).unwrap();
    let g = TestGateway::start_healthy(&v1).await;
    (dir, path, g)
}

async fn served_by(url: &str, key: Option<&str>) -> (u16, String) {
    let mut req = client().post(url).json(&chat_body("m", false, 4));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let b = r
        .headers()
        .get("x-sluice-backend")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let _ = r.text().await;
    (status, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_change_adds_removes_drains_and_rejects_bad_files() {
    // `a` streams slowly (20 ms a token), so a stream is in flight across the reload.
    let a = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .speed(1.0)
            .output_tokens(40, 40),
    )
    .await;
    let b = sim(SimKind::Vllm, &["m"]).await;
    let (_dir, path, g) = from_file(&backend("a", "vllm", &a.url(), &["m"])).await;
    let watch = sluice::app::reload::spawn_file_watch(Arc::downgrade(&g.gw), path.clone());
    let chat_url = g.url("/v1/chat/completions");

    // A stream on `a`, first chunk received.
    let mut stream = post_json(&client(), &chat_url, &chat_body("m", true, 40)).await;
    assert_eq!(stream.status(), 200);
    assert_eq!(stream.headers()["x-sluice-backend"], "a");
    let first = stream.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));

    // v2: `b` added, `a` removed.
    let applied = reloads("applied");
    write_atomically(&path, &head(&backend("b", "vllm", &b.url(), &["m"])));
    let gw = g.gw.clone();
    eventually(Duration::from_secs(15), "reload applied", || {
        let gw = gw.clone();
        async move {
            let rt = gw.runtime();
            rt.fleet.get("b").is_some() && rt.fleet.get("a").is_none()
        }
    })
    .await;
    // (the counter follows the swap a moment later: the new fleet may be read before it moves)
    eventually(Duration::from_secs(5), "reload counted", || async move {
        reloads("applied") > applied
    })
    .await;
    g.wait_state("b", "healthy", Duration::from_secs(15)).await;
    assert_eq!(served_by(&chat_url, None).await, (200, "b".to_string()));

    // The stream that started on `a` runs to its end.
    let mut rest = Vec::new();
    while let Some(c) = stream.chunk().await.unwrap() {
        rest.extend_from_slice(&c);
    }
    let all = String::from_utf8_lossy(&rest);
    assert!(
        all.trim_end().ends_with("data: [DONE]"),
        "in-flight stream dropped by the reload: {all}"
    );
    let deltas = sse_data(&format!("{}{all}", String::from_utf8_lossy(&first)))
        .iter()
        .filter(|d| d.contains("\"content\""))
        .count();
    assert!(deltas >= 40, "only {deltas} content chunks");

    // A broken file is rejected; `b` keeps serving.
    let served_before =
        g.gw.runtime()
            .fleet
            .get("b")
            .unwrap()
            .state
            .requests_total();
    let rejected = reloads("rejected");
    write_atomically(&path, "[[backends]]\nname = \"b\"\nkind = \"warp-drive\"\n");
    eventually(
        Duration::from_secs(15),
        "bad file rejected",
        || async move { reloads("rejected") > rejected },
    )
    .await;
    assert_eq!(served_by(&chat_url, None).await, (200, "b".to_string()));

    // Keys added: the open gateway now wants a key; `b`'s counters survive the reload.
    let key = "sk-reload-key";
    let hash = hex::encode(sha2::Sha256::digest(key.as_bytes()));
    let v3 = head(&format!(
        "[[keys]]\nname = \"k\"\nhash = \"sha256:{hash}\"\n{}",
        backend("b", "vllm", &b.url(), &["m"])
    ));
    write_atomically(&path, &v3);
    let url = chat_url.clone();
    eventually(Duration::from_secs(15), "keys in force", || {
        let url = url.clone();
        async move { served_by(&url, None).await.0 == 401 }
    })
    .await;
    assert_eq!(
        served_by(&chat_url, Some(key)).await,
        (200, "b".to_string())
    );
    let served_after =
        g.gw.runtime()
            .fleet
            .get("b")
            .unwrap()
            .state
            .requests_total();
    assert!(
        served_after > served_before,
        "counters reset by reload: {served_before} -> {served_after}"
    );

    watch.abort();
    g.stop().await;
}

#[tokio::test]
async fn reload_now_reports_problems_and_keeps_the_old_config() {
    let b = sim(SimKind::Vllm, &["m"]).await;
    let (_dir, path, g) = from_file(&backend("b", "vllm", &b.url(), &["m"])).await;
    std::fs::write(&path, "[server]\nlisten = \"nowhere\"\n").unwrap();
    assert!(!sluice::app::reload::reload_now(&g.gw, &path));
    assert!(g.gw.runtime().fleet.get("b").is_some());
    std::fs::remove_file(&path).unwrap();
    assert!(!sluice::app::reload::reload_now(&g.gw, &path));
    assert!(g.gw.runtime().fleet.get("b").is_some());
    g.stop().await;
}

/// The real binary: SIGHUP reloads, and so does a file change once `[reload] watch` is on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_and_file_watch_in_the_binary() {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let a = sim(SimKind::Vllm, &["m"]).await;
    let b = sim(SimKind::Vllm, &["m"]).await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let cfg = |watch: bool, name: &str, url: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n[routing]\nexpose_backend_header = true\n\
             [reload]\nwatch = {watch}\ninterval = \"50ms\"\n{FAST_HEALTH}{}",
            backend(name, "vllm", url, &["m"])
        )
    };
    std::fs::write(&path, cfg(false, "a", &a.url())).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["serve", "--config"])
        .arg(&path)
        .env("SLUICE_LOG_FORMAT", "json")
        .env("SLUICE_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let child = Kill(child);
    let pid = child.0.id().to_string();
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let wait_backend = |want: &'static str| {
        let url = url.clone();
        async move {
            eventually(
                Duration::from_secs(10),
                &format!("served by {want}"),
                || {
                    let url = url.clone();
                    async move {
                        match client()
                            .post(&url)
                            .json(&chat_body("m", false, 4))
                            .send()
                            .await
                        {
                            Ok(r) => r
                                .headers()
                                .get("x-sluice-backend")
                                .is_some_and(|v| v == want),
                            Err(_) => false,
                        }
                    }
                },
            )
            .await
        }
    };
    wait_backend("a").await;

    // watch = false: a file change alone does nothing; SIGHUP applies it.
    write_atomically(&path, &cfg(false, "b", &b.url()));
    let hup = || {
        assert!(Command::new("kill")
            .args(["-HUP", &pid])
            .status()
            .unwrap()
            .success())
    };
    hup();
    wait_backend("b").await;
    // The reader thread may lag behind the process: collect until both lines are in.
    let lines = std::sync::Mutex::new(Vec::<String>::new());
    let shown = Lazy(|| format!("reload logged: {:#?}", lines.lock().unwrap()));
    eventually(Duration::from_secs(15), shown, || {
        let mut lines = lines.lock().unwrap();
        lines.extend(rx.try_iter());
        let logged = lines
            .iter()
            .any(|l| l.contains("SIGHUP") && l.contains("reloading"))
            && lines.iter().any(|l| l.contains("config reloaded"));
        async move { logged }
    })
    .await;

    // Turn the watch on (by SIGHUP), then a file change alone is enough.
    write_atomically(&path, &cfg(true, "b", &b.url()));
    hup();
    eventually(Duration::from_secs(15), "watch on", || {
        let seen = rx.try_iter().any(|l| l.contains("config reloaded"));
        async move { seen }
    })
    .await;
    write_atomically(&path, &cfg(true, "a", &a.url()));
    wait_backend("a").await;
    drop(child);
}
