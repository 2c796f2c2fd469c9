//! Load-aware routing against real simulators: token-aware learns which backend is faster
//! (nothing about speed is configured) and an Ollama node with the model loaded is preferred.

mod common;

use std::time::Duration;

use common::*;
use sluice::sim::{SimConfig, SimKind, Timing};

fn timing(decode_base_ms: u64) -> Timing {
    Timing {
        max_num_seqs: 8,
        decode_base: Duration::from_millis(decode_base_ms),
        decode_per_seq: Duration::from_micros(100),
        prefill_per_token: Duration::from_micros(20),
        ..Timing::default()
    }
}

async fn served_by(gw: &TestGateway, body: &serde_json::Value) -> String {
    let r = client()
        .post(gw.url("/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let name = r.headers()["x-sluice-backend"]
        .to_str()
        .unwrap()
        .to_string();
    let _ = r.text().await.unwrap();
    name
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_aware_sends_more_to_the_measured_faster_backend() {
    let fast = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .timing(timing(2))
            .output_tokens(20, 20),
    )
    .await;
    let slow = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .timing(timing(12))
            .output_tokens(20, 20),
    )
    .await;
    let toml = format!(
        "[routing]\npolicy = \"token-aware\"\nexpose_backend_header = true\n{FAST_HEALTH}{}{}",
        backend("slow", "vllm", &slow.url(), &["m"]),
        backend("fast", "vllm", &fast.url(), &["m"]),
    );
    let gw = TestGateway::start_healthy(&toml).await;
    let body = chat_body("m", true, 20);
    // learn: a few requests to each (ties rotate)
    for _ in 0..6 {
        served_by(&gw, &body).await;
    }
    let mut fast_n = 0;
    let n = 24;
    for _ in 0..n {
        if served_by(&gw, &body).await == "fast" {
            fast_n += 1;
        }
    }
    assert!(fast_n * 4 >= n * 3, "fast got {fast_n} of {n}");
    let admin: serde_json::Value = client()
        .get(gw.url("/admin/backends"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let speeds: Vec<f64> = admin["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            b["routing"]["speeds"]["decode_tokens_per_second"]
                .as_f64()
                .unwrap_or(0.0)
        })
        .collect();
    assert!(speeds.iter().any(|s| *s > 0.0), "{admin}");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_ollama_node_is_preferred_over_a_cold_one() {
    let cold = sim_with(
        SimConfig::new(SimKind::Ollama, vec!["llama3.2".into()])
            .speed(0.0)
            .preloaded(false),
    )
    .await;
    let warm = sim_with(
        SimConfig::new(SimKind::Ollama, vec!["llama3.2".into()])
            .speed(0.0)
            .preloaded(true),
    )
    .await;
    let toml = format!(
        "[routing]\npolicy = \"round-robin\"\nexpose_backend_header = true\n{FAST_HEALTH}{}{}",
        backend("cold", "ollama", &cold.url(), &["llama3.2"]),
        backend("warm", "ollama", &warm.url(), &["llama3.2"]),
    );
    let gw = TestGateway::start_healthy(&toml).await;
    let g = &gw.gw;
    eventually(Duration::from_secs(5), "both /api/ps read", || async {
        g.runtime()
            .fleet
            .backends
            .iter()
            .all(|b| b.state.signals.load().loaded.is_some())
    })
    .await;
    let body = chat_body("llama3.2", false, 5);
    for _ in 0..6 {
        assert_eq!(served_by(&gw, &body).await, "warm");
    }
    gw.stop().await;
}
