//! The serving threads (`[server] threads`): connections are spread over them, each thread
//! serves its connections (streamed and whole answers, kept alive) and forwards on its own
//! backend connections, and a connection that closes frees its place. One gateway per process:
//! the per-thread gauge is process-wide, as in a real deployment, and every gateway of the test
//! binary serves on threads, so the test runs in a process of its own.

use crate::support;

use std::time::Duration;

use sluice::sim::SimKind;
use support::process::isolated;
use support::{backend, chat_body, eventually, metric, post_json, sim, sse_data, TestGateway};

const THREADS: usize = 3;

/// Connections per serving thread; -1 for a thread without its gauge.
fn per_thread(metrics: &str) -> Vec<f64> {
    (1..=THREADS)
        .map(|i| {
            let key = format!("sluice_shard_connections_open{{listener=\"client\",shard=\"{i}\"}}");
            if metrics.contains(&key) {
                metric(metrics, &key)
            } else {
                -1.0
            }
        })
        .collect()
}

#[tokio::test]
async fn connections_are_spread_over_the_threads_and_served_there() {
    if !isolated("server_threads::connections_are_spread_over_the_threads_and_served_there") {
        return;
    }
    let s = sim(SimKind::Vllm, &["m"]).await;
    let g = TestGateway::start_healthy(&format!(
        "[server]\nthreads = {THREADS}\n[admin]\nlisten = \"127.0.0.1:0\"\n{}",
        backend("a", "vllm", &s.url(), &["m"])
    ))
    .await;

    // Six clients of one connection each, all kept alive.
    let clients: Vec<reqwest::Client> = (0..2 * THREADS)
        .map(|_| {
            reqwest::Client::builder()
                .pool_max_idle_per_host(1)
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap()
        })
        .collect();
    for c in &clients {
        let r = post_json(c, g.url("/v1/chat/completions"), &chat_body("m", false, 8)).await;
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["object"], "chat.completion");
    }
    let g2 = &g;
    eventually(
        Duration::from_secs(10),
        "two connections per thread",
        || async move { per_thread(&g2.metrics_text().await) == vec![2.0; THREADS] },
    )
    .await;

    // Every connection goes on being served on its thread: streamed, then whole, concurrently.
    let mut tasks = Vec::new();
    for c in clients.clone() {
        let url = g.url("/v1/chat/completions");
        tasks.push(tokio::spawn(async move {
            let r = post_json(&c, &url, &chat_body("m", true, 16)).await;
            assert_eq!(r.status(), 200);
            let events = sse_data(&r.text().await.unwrap());
            assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
            let r = post_json(&c, &url, &chat_body("m", false, 4)).await;
            assert_eq!(r.status(), 200);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // (A client may open a new connection when its idle one was not back in its pool yet: the
    // spread is checked above, with one connection per client.)

    // Closed connections free their places.
    drop(clients);
    eventually(
        Duration::from_secs(10),
        "no connection left",
        || async move { per_thread(&g2.metrics_text().await) == vec![0.0; THREADS] },
    )
    .await;
    g.stop().await;
}
