//! `GET /admin/profile`: a live gateway exports each measured backend's speeds and limits, and
//! `sluice plan` turns the export into an engine timing ("more servers like gpu-a").

use std::time::Duration;

use sluice::sim::{SimConfig, SimKind, Timing};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_profile_becomes_a_plannable_engine() {
    let sim = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .timing(Timing {
                max_num_seqs: 8,
                prefill_per_token: Duration::from_micros(50),
                decode_base: Duration::from_millis(5),
                decode_per_seq: Duration::from_micros(100),
                ..Timing::default()
            })
            .output_tokens(20, 20),
    )
    .await;
    let toml = format!(
        "{FAST_HEALTH}{}",
        backend("gpu-a", "vllm", &sim.url(), &["m"])
    );
    let gw = TestGateway::start_healthy(&toml).await;
    let c = client();
    let before: serde_json::Value = get_json(&c, gw.admin_url("/admin/profile")).await;
    assert_eq!(
        before["backends"],
        serde_json::json!([]),
        "nothing measured yet"
    );
    for _ in 0..6 {
        let r = gw.chat(&chat_body("m", true, 20)).await;
        assert_eq!(r.status(), 200);
        let _ = r.text().await;
    }
    let profile = poll(Duration::from_secs(10), "a measured profile", || {
        let c = c.clone();
        let url = gw.admin_url("/admin/profile");
        async move {
            let v: serde_json::Value = get_json(&c, url).await;
            (v["backends"].as_array().is_some_and(|b| !b.is_empty())).then_some(v)
        }
    })
    .await;
    let text = profile.to_string();
    let timing = sluice::plan::profile::backend_timing(&text, "gpu-a").expect("a valid profile");
    // 20 tokens at ~5.1 ms steps: decode near 200 tokens/s per request
    let step = timing.decode_base + timing.decode_per_seq;
    assert!(
        step > Duration::from_millis(3) && step < Duration::from_millis(15),
        "decode step {step:?} from {text}"
    );
    assert!(timing.max_num_seqs >= 1);
    let err = sluice::plan::profile::backend_timing(&text, "gpu-b").expect_err("absent");
    assert!(err.contains("it has: gpu-a"), "{err}");
    gw.stop().await;
}
