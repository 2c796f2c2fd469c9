//! `GET /admin/profile`: a live gateway exports what each engine reports of its own timing,
//! and `sluice plan` fits the engine's step costs to it ("more servers like gpu-a").
//!
//! The accuracy tests drive the workload the fit is hardest on (bursty on/off arrivals, a
//! bimodal prompt mix, some long answers) through two simulated engines of known timing, vLLM
//! (steps, inter-token and prefill histograms) and TGI (forward passes by method), and check
//! the merged fit recovers that timing. It measures wall-clock engines, so it is
//! `#[ignore]`d in the suite and run alone with the other timing comparisons
//! (`cargo test --test it plan_ -- --ignored --test-threads=1`).

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use sluice::sim::{SimConfig, SimKind, Timing};

use crate::support::*;

fn timing() -> Timing {
    Timing {
        max_num_seqs: 8,
        prefill_per_token: Duration::from_micros(100),
        decode_base: Duration::from_millis(15),
        decode_per_seq: Duration::from_millis(1),
        ..Timing::default()
    }
}

async fn engine(kind: SimKind) -> sluice::sim::SimHandle {
    sim_with(
        SimConfig::new(kind, vec!["m".into()])
            .timing(timing())
            .max_model_len(8_192),
    )
    .await
}

/// Two engines of `kind` scraped every 250 ms, behind a gateway.
async fn fleet(kind: SimKind) -> (TestGateway, [sluice::sim::SimHandle; 2]) {
    let (a, b) = (engine(kind).await, engine(kind).await);
    let name = kind.as_str();
    let config = format!(
        "\n[health]\ninterval = \"50ms\"\nsignals_interval = \"250ms\"\ntimeout = \"2s\"\n\
         healthy_threshold = 1\nunhealthy_threshold = 3\n{}{}",
        backend("gpu-a", name, &a.url(), &["m"]),
        backend("gpu-b", name, &b.url(), &["m"])
    );
    (TestGateway::start_healthy(&config).await, [a, b])
}

/// A prompt of about `words` tokens that shares no block with another request's.
fn prompt(id: usize, words: usize) -> String {
    let mut s = String::with_capacity(words * 5);
    for w in 0..words {
        s.push_str(&format!("{:x} ", (id * 7_919 + w) % 0xffff));
    }
    s
}

async fn send(c: reqwest::Client, url: String, id: usize, words: usize, out: u32) {
    let body = json!({
        "model": "m", "max_tokens": out, "ignore_eos": true,
        "messages": [{"role": "user", "content": prompt(id, words)}],
        "stream": true, "stream_options": {"include_usage": true},
    });
    let r = post_json(&c, url, &body).await;
    assert_eq!(r.status(), 200, "request {id}");
    let _ = r.bytes().await;
}

/// `seconds` of on/off traffic: `high`/s and `low`/s in alternating phases of `phase` s; 80%
/// of prompts near 200 tokens and 20% near 3,000; answers of 20–200 tokens, one in ten up to
/// 600.
async fn bursty(gw: &TestGateway, seconds: f64, phase: f64, high: f64, low: f64) -> usize {
    let mut rng = StdRng::seed_from_u64(29);
    let (c, url) = (client(), gw.url("/v1/chat/completions"));
    let t0 = Instant::now();
    let (mut at, mut tasks) = (0.0, Vec::new());
    while at < seconds {
        let rate = if (at / phase) as u64 % 2 == 0 {
            high
        } else {
            low
        };
        at += -rng.random::<f64>().max(1e-9).ln() / rate;
        let words = if rng.random::<f64>() < 0.2 {
            rng.random_range(2_500..3_500)
        } else {
            rng.random_range(150..250)
        };
        let out = if rng.random::<f64>() < 0.1 {
            rng.random_range(300..600)
        } else {
            rng.random_range(20..200)
        };
        let wait = Duration::from_secs_f64(at).saturating_sub(t0.elapsed());
        tokio::time::sleep(wait).await;
        tasks.push(tokio::spawn(send(
            c.clone(),
            url.clone(),
            tasks.len(),
            words,
            out,
        )));
    }
    let n = tasks.len();
    for t in tasks {
        t.await.expect("request task");
    }
    n
}

async fn profile_with_windows(gw: &TestGateway, min: usize) -> String {
    let c = client();
    poll(
        Duration::from_secs(10),
        "engine windows in the profile",
        || {
            let (c, url) = (c.clone(), gw.admin_url("/admin/profile"));
            async move {
                let v = get_json(&c, url).await;
                let enough = v["backends"].as_array().is_some_and(|bs| {
                    bs.len() == 2
                        && bs.iter().all(|b| {
                            b["engine"]["windows"]
                                .as_array()
                                .is_some_and(|w| w.len() >= min)
                        })
                });
                enough.then(|| v.to_string())
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_profile_carries_the_engines_timing_and_becomes_a_plannable_engine() {
    let (gw, _sims) = fleet(SimKind::Vllm).await;
    let c = client();
    let before = get_json(&c, gw.admin_url("/admin/profile")).await;
    assert_eq!(before["backends"], json!([]), "nothing measured yet");
    bursty(&gw, 6.0, 2.0, 4.0, 1.0).await;
    let text = profile_with_windows(&gw, 8).await;
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["backends"][0]["kind"], "vllm");
    let both = ["gpu-a".to_string(), "gpu-b".to_string()];
    let (t, fit) =
        sluice::plan::profile::measured(&text, &both, None).expect("a plannable profile");
    assert_eq!(fit.source, "engine metrics");
    assert_eq!(fit.backends, both);
    // slots are learned from a full batch with requests waiting; until then the kind's default
    assert!(
        [8, 256].contains(&t.max_num_seqs),
        "slots {}",
        t.max_num_seqs
    );
    loosely_right(&t, &fit);
    // the gateway's own answer times over the engine's queue and inference: the HTTP exchange
    // and the simulator's frontend, a few milliseconds
    let outside = fit.params.iter().find(|p| p.name == "outside_engine");
    let outside = outside.expect("the gateway timed answers").value;
    assert!((0.0..0.05).contains(&outside), "{outside} s: {fit:?}");
    assert_eq!(t.outside, Duration::from_secs_f64(outside));
    let err = sluice::plan::profile::measured(&text, &["gpu-c".into()], None).expect_err("absent");
    assert!(err.contains("it has: gpu-a, gpu-b"), "{err}");
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tgi_profile_is_fitted_from_its_forward_passes() {
    let (gw, _sims) = fleet(SimKind::Tgi).await;
    bursty(&gw, 6.0, 2.0, 4.0, 1.0).await;
    let text = profile_with_windows(&gw, 8).await;
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(v["backends"][0]["kind"], "tgi");
    let windows = v["backends"][0]["engine"]["windows"]
        .as_array()
        .expect("windows");
    assert!(
        windows
            .iter()
            .any(|w| w["prefill_seqs"].as_f64() > Some(0.0)),
        "TGI's prefill passes carry their admitted groups: {windows:?}"
    );
    let both = ["gpu-a".to_string(), "gpu-b".to_string()];
    for b in v["backends"].as_array().unwrap() {
        for w in b["engine"]["windows"].as_array().unwrap() {
            if w["prefill_count"].as_f64() > Some(0.0) {}
        }
    }
    let (t, fit) =
        sluice::plan::profile::measured(&text, &both, None).expect("a plannable profile");
    assert_eq!(fit.source, "engine metrics");
    loosely_right(&t, &fit);
    gw.stop().await;
}

/// A loose check for the suite, which shares the cores; the accuracy tests are strict.
fn loosely_right(t: &Timing, fit: &sluice::plan::profile::FitSummary) {
    let step = (t.decode_base + t.decode_per_seq).as_secs_f64();
    assert!(
        (0.008..0.05).contains(&step),
        "decode step {step} s: {fit:?}"
    );
    let per_token = t.prefill_per_token.as_secs_f64();
    assert!(
        (30e-6..300e-6).contains(&per_token),
        "prefill {per_token} s/token: {fit:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a timing comparison: run alone (CI runs it after the suite; bench/README.md)"]
async fn plan_accuracy_the_engine_profile_recovers_the_simulated_timing() {
    recovers(SimKind::Vllm).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a timing comparison: run alone (CI runs it after the suite; bench/README.md)"]
async fn plan_accuracy_the_tgi_profile_recovers_the_simulated_timing() {
    recovers(SimKind::Tgi).await;
}

/// 40 s of bursty traffic through two engines of `kind`: the merged fit lands within 10% of
/// the configured costs.
async fn recovers(kind: SimKind) {
    let (gw, _sims) = fleet(kind).await;
    let n = bursty(&gw, 40.0, 5.0, 5.0, 1.0).await;
    let text = profile_with_windows(&gw, 40).await;
    let both = ["gpu-a".to_string(), "gpu-b".to_string()];
    let (_, fit) =
        sluice::plan::profile::measured(&text, &both, None).expect("a plannable profile");
    let want = timing();
    let mut off_by = Vec::new();
    for (name, truth) in [
        ("prefill_per_token", want.prefill_per_token),
        ("decode_base", want.decode_base),
        ("decode_per_seq", want.decode_per_seq),
    ] {
        let p = fit.params.iter().find(|p| p.name == name).expect("fitted");
        let truth = truth.as_secs_f64();
        eprintln!(
            "{kind:?} {name}: fitted {:.4} ms ± {:.4}, true {:.4} ms ({:+.1}%)",
            p.value * 1e3,
            p.stderr * 1e3,
            truth * 1e3,
            (p.value / truth - 1.0) * 100.0
        );
        off_by.push((name, (p.value - truth).abs() / truth));
    }
    for (name, off) in off_by {
        assert!(
            off <= 0.10,
            "{kind:?} {name} {:.1}% off after {n} requests: {fit:?}",
            off * 100.0
        );
    }
    assert!(fit.prompt_range.1 > 1_000.0, "{fit:?}");
    let outside = fit.params.iter().find(|p| p.name == "outside_engine");
    let outside = outside.expect("the gateway timed answers");
    eprintln!(
        "{kind:?} outside the engine: {:.2} ms ± {:.2}",
        outside.value * 1e3,
        outside.stderr * 1e3
    );
    assert!((0.0..0.05).contains(&outside.value), "{fit:?}");
    gw.stop().await;
}
