//! The operations surface: the admin listener keeps `/metrics`, `/admin/*` and `/dashboard`
//! off the API port and requires its token; `/healthz` and `/readyz` answer on both; the
//! metrics the operations docs list are exported; graceful shutdown goes unready first, then
//! closes the listener, and lets an in-flight stream finish within the grace period.

use crate::support;

use std::time::{Duration, Instant};

use sluice::sim::{SimConfig, SimKind};
use support::*;

#[tokio::test]
async fn admin_listener_separates_operations_and_wants_its_token() {
    // A model and a backend name of this test's own: the metrics recorder is process-wide, and
    // the families below must be this gateway's.
    let s = sim(SimKind::Vllm, &["ops-admin-m"]).await;
    let toml = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\ntoken = \"ops-secret\"\n{FAST_HEALTH}{}",
        backend("ops-admin-a", "vllm", &s.url(), &["ops-admin-m"])
    );
    let g = TestGateway::start_healthy(&toml).await;
    assert_ne!(g.admin_addr, Some(g.addr));
    let c = client();
    for path in [
        "/metrics",
        "/admin/backends",
        "/admin/usage",
        "/admin/summary",
        "/dashboard",
    ] {
        let api = c
            .get(g.url(path))
            .bearer_auth("ops-secret")
            .send()
            .await
            .unwrap();
        assert_eq!(api.status(), 404, "{path} must not be on the API port");
        let none = c.get(g.admin_url(path)).send().await.unwrap();
        assert_eq!(none.status(), 401, "{path} without the token");
        let wrong = c
            .get(g.admin_url(path))
            .bearer_auth("nope")
            .send()
            .await
            .unwrap();
        assert_eq!(wrong.status(), 401, "{path} with a wrong token");
        let ok = c
            .get(g.admin_url(path))
            .bearer_auth("ops-secret")
            .send()
            .await
            .unwrap();
        assert_eq!(ok.status(), 200, "{path} with the token");
    }
    for path in ["/healthz", "/readyz"] {
        assert_eq!(c.get(g.url(path)).send().await.unwrap().status(), 200);
        assert_eq!(c.get(g.admin_url(path)).send().await.unwrap().status(), 200);
    }
    // Traffic, then the metric families the docs promise.
    let r = post_json(
        &c,
        g.url("/v1/chat/completions"),
        &chat_body("ops-admin-m", true, 8),
    )
    .await;
    let _ = r.text().await.unwrap();
    let text = c
        .get(g.admin_url("/metrics"))
        .bearer_auth("ops-secret")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "sluice_requests_total",
        "sluice_request_duration_seconds_bucket",
        "sluice_time_to_first_token_seconds_bucket",
        "sluice_completion_tokens_total",
        "sluice_backend_inflight_requests",
        "sluice_backend_state",
        "sluice_backend_probes_total",
        "sluice_build_info",
    ] {
        // Every family but the build's carries this test's model or backend.
        let own = |l: &str| name == "sluice_build_info" || l.contains("=\"ops-admin-");
        assert!(
            text.lines().any(|l| l.starts_with(name) && own(l)),
            "{name} missing from /metrics"
        );
    }
    g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_goes_unready_first_then_closes_then_drains() {
    let s = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .speed(1.0)
            .output_tokens(40, 40),
    )
    .await;
    let delay = Duration::from_millis(400);
    let toml = format!(
        "[server]\nshutdown_grace = \"10s\"\nshutdown_delay = \"{}ms\"\n{FAST_HEALTH}{}",
        delay.as_millis(),
        backend("a", "vllm", &s.url(), &["m"])
    );
    let g = TestGateway::start_healthy(&toml).await;
    let addr = g.addr;
    let mut stream = g.chat(&chat_body("m", true, 40)).await;
    let first = stream.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));

    let t0 = Instant::now();
    let stopping = tokio::spawn(g.stop());
    // Fresh connections each time, so the listener's state is what is measured.
    let fresh = || {
        reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap()
    };
    let mut unready_at = None;
    let mut closed_at = None;
    for _ in 0..2000 {
        match fresh().get(format!("http://{addr}/readyz")).send().await {
            Ok(r) if r.status() == 503 => {
                unready_at.get_or_insert(t0.elapsed());
                assert_eq!(r.text().await.unwrap(), "shutting down\n");
            }
            Ok(r) => assert_eq!(r.status(), 200, "before shutdown"),
            Err(_) => {
                closed_at = Some(t0.elapsed());
                break;
            }
        }
        if t0.elapsed() > Duration::from_secs(5) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let unready_at = unready_at.expect("/readyz never answered 503 during the shutdown delay");
    let closed_at = closed_at.expect("the listener never closed");
    assert!(unready_at < closed_at);
    assert!(
        closed_at >= delay,
        "listener closed {closed_at:?} after SIGTERM, before the {delay:?} delay"
    );

    let mut rest = Vec::new();
    while let Some(c) = stream.chunk().await.unwrap() {
        rest.extend_from_slice(&c);
    }
    let tail = String::from_utf8_lossy(&rest);
    assert!(
        tail.trim_end().ends_with("data: [DONE]"),
        "stream cut: {tail}"
    );
    tokio::time::timeout(Duration::from_secs(10), stopping)
        .await
        .expect("server did not finish within its grace period")
        .unwrap();
    let done = t0.elapsed();
    eprintln!(
        "unready after {unready_at:?}, listener closed after {closed_at:?}, drained after {done:?}"
    );
}
