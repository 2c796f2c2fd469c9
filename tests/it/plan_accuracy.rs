//! `sluice plan`'s virtual time against the real-time simulator: the same requests, sent to a
//! live `sluice sim` at their arrival times and planned in virtual time with the same timing
//! model, give the same time to first token within a tolerance.
//!
//! The real side is measured in wall-clock time, so these tests only mean something on a
//! machine that is not running two hundred other tests at once: they are `#[ignore]`d in the
//! suite and run alone, one at a time
//! (`cargo test --test it plan_ -- --ignored --test-threads=1`), which CI does after
//! the suite.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice::config::PolicyKind;
use sluice::plan::fleet::{simulate, Request};
use sluice::sim::{SimConfig, SimKind};

use crate::support::sim::*;
use crate::support::{backend, TestGateway, FAST_HEALTH};

/// What the client saw of one request.
struct Seen {
    sent: Duration,
    ttft: Duration,
    prompt_tokens: u32,
    completion_tokens: u32,
    max_tokens: u32,
}

/// Stream a chat completion; the time to the first content token and the usage.
/// Each prompt starts with its own word, so no two share a cached block (the planner is told
/// there is no shared prefix).
async fn one(
    c: reqwest::Client,
    url: String,
    id: usize,
    words: usize,
    max_tokens: u32,
    t0: Instant,
) -> Seen {
    let sent = t0.elapsed();
    let body = json!({
        "model": "m",
        "messages": [{"role": "user", "content": format!("r{id} {}", "the ".repeat(words))}],
        "max_tokens": max_tokens, "stream": true, "stream_options": {"include_usage": true},
    });
    let start = Instant::now();
    let mut r = post_json(&c, format!("{url}/v1/chat/completions"), &body).await;
    assert_eq!(r.status(), 200);
    let (mut text, mut ttft) = (String::new(), None);
    while let Some(chunk) = r.chunk().await.expect("stream") {
        text.push_str(&String::from_utf8_lossy(&chunk));
        if ttft.is_none() && has_content(&text) {
            ttft = Some(start.elapsed());
        }
    }
    let usage: Value = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
        .expect("a usage chunk");
    Seen {
        sent,
        ttft: ttft.expect("a content token"),
        prompt_tokens: usage["prompt_tokens"].as_u64().expect("prompt_tokens") as u32,
        completion_tokens: usage["completion_tokens"]
            .as_u64()
            .expect("completion_tokens") as u32,
        max_tokens,
    }
}

/// Whether a complete SSE event carries a non-empty content delta.
fn has_content(text: &str) -> bool {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .any(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|c| !c.is_empty())
        })
}

fn pct(mut v: Vec<f64>, p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

/// Send `n` requests to `url` at random gaps of up to `max_gap_us`; what each saw.
async fn replay(url: &str, n: usize, max_gap_us: u64) -> Vec<Seen> {
    let c = client();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let t0 = Instant::now();
    let mut at = Duration::ZERO;
    let mut tasks = Vec::new();
    for id in 0..n {
        at += Duration::from_micros(next() % max_gap_us);
        let words = 50 + (next() % 400) as usize;
        let max_tokens = 8 + (next() % 32) as u32;
        // the workload's arrival schedule (not synchronisation)
        tokio::time::sleep_until((t0 + at).into()).await;
        let (c, url) = (c.clone(), url.to_string());
        tasks.push(tokio::spawn(one(c, url, id, words, max_tokens, t0)));
    }
    let mut seen = Vec::new();
    for t in tasks {
        seen.push(t.await.expect("request task"));
    }
    seen.sort_by_key(|s| s.sent);
    seen
}

/// Plan the requests seen on `engines` engines; (planned, real) TTFTs in arrival order, and
/// how many requests queued in the plan.
fn plan(seen: &[Seen], engines: usize) -> (Vec<f64>, Vec<f64>, usize) {
    let reqs: Vec<Request> = seen
        .iter()
        .map(|s| Request {
            at_ns: s.sent.as_nanos() as u64,
            prompt_tokens: s.prompt_tokens,
            output_tokens: s.completion_tokens,
            prefix: None,
            max_tokens: Some(s.max_tokens),
        })
        .collect();
    let run = simulate(&reqs, engines, &comparison_timing(), PolicyKind::TokenAware);
    let planned = run
        .outcomes
        .iter()
        .map(|o| o.ttft_ns as f64 / 1e9)
        .collect();
    let real = seen.iter().map(|s| s.ttft.as_secs_f64()).collect();
    let queued = run.outcomes.iter().filter(|o| o.queue_ns > 0).count();
    (planned, real, queued)
}

/// Why a comparison failed: the real side slower than planned (which a busy machine alone can
/// cause, so the comparison may be taken again) or faster (which it cannot).
enum Miss {
    RealSlower(String),
    RealFaster(String),
}

/// Each percentile within its relative tolerance (+10 ms).
fn compare(planned: &[f64], real: &[f64], tolerances: [(f64, f64); 3]) -> Result<(), Miss> {
    for (p, tol) in tolerances {
        let (v, r) = (pct(planned.to_vec(), p), pct(real.to_vec(), p));
        let why = format!("p{p} TTFT: planned {v:.4} s, real {r:.4} s");
        if v - r > tol * r + 0.01 {
            return Err(Miss::RealFaster(why));
        }
        if r - v > tol * r + 0.01 {
            return Err(Miss::RealSlower(why));
        }
    }
    Ok(())
}

/// Run a wall-clock comparison up to three times. Contention from anything else on the machine
/// only ever makes the real side slower, so a real side slower than planned is measured again
/// on fresh simulators; a real side faster than planned, or slower three times in a row, fails.
async fn with_retries<F, Fut>(what: &str, mut attempt: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), Miss>>,
{
    for n in 1..=3 {
        match attempt().await {
            Ok(()) => return,
            Err(Miss::RealFaster(why)) => panic!("{what}: {why}"),
            Err(Miss::RealSlower(why)) if n == 3 => panic!("{what}, three times: {why}"),
            Err(Miss::RealSlower(why)) => eprintln!("{what}, attempt {n}: {why}; measuring again"),
        }
    }
}

/// One live simulator, the requests planned on one engine.
async fn against_the_simulator() -> Result<(), Miss> {
    let sim = start(SimKind::Vllm, &["m"], |c: SimConfig| {
        c.timing(comparison_timing())
            .output_tokens(1000, 1000)
            .max_model_len(100_000)
    })
    .await;
    // ~6.7 requests/s against about as much capacity: queues form and drain
    let seen = replay(&sim.url(), 60, 300_000).await;
    let (planned, real, queued) = plan(&seen, 1);
    assert!(
        queued >= 10,
        "the workload must queue to test queueing ({queued} queued)"
    );
    compare(&planned, &real, [(50.0, 0.2), (90.0, 0.2), (99.0, 0.2)])?;
    let mean_abs = planned
        .iter()
        .zip(&real)
        .map(|(v, r)| (v - r).abs())
        .sum::<f64>()
        / planned.len() as f64;
    let mean = real.iter().sum::<f64>() / real.len() as f64;
    if mean_abs > 0.2 * mean + 0.01 {
        let why = format!("mean |planned − real| {mean_abs:.4} s of {mean:.4} s");
        let slower = real.iter().sum::<f64>() > planned.iter().sum::<f64>();
        return Err(if slower {
            Miss::RealSlower(why)
        } else {
            Miss::RealFaster(why)
        });
    }
    Ok(())
}

#[tokio::test]
#[ignore = "a timing comparison: run alone (CI runs it after the suite; bench/README.md)"]
async fn virtual_time_matches_the_real_time_simulator() {
    with_retries("one simulator", against_the_simulator).await;
}

/// Three live simulators behind `token-aware` routing, and the same requests planned on three
/// engines routed by the same policy code.
async fn through_the_gateway() -> Result<(), Miss> {
    let mut sims = Vec::new();
    let mut toml = format!("[routing]\npolicy = \"token-aware\"\n{FAST_HEALTH}");
    for i in 0..3 {
        let s = start(SimKind::Vllm, &["m"], |c: SimConfig| {
            c.timing(comparison_timing())
                .output_tokens(1000, 1000)
                .max_model_len(100_000)
        })
        .await;
        toml.push_str(&backend(&format!("s{i}"), "vllm", &s.url(), &["m"]));
        sims.push(s);
    }
    let gw = TestGateway::start_healthy(&toml).await;
    // ~17 requests/s against ~20/s of capacity
    let seen = replay(&gw.url(""), 120, 120_000).await;
    gw.stop().await;
    let (planned, real, _) = plan(&seen, 3);
    eprintln!(
        "gateway replay: p50 {:.4}/{:.4} s, p90 {:.4}/{:.4} s, p99 {:.4}/{:.4} s (planned/real)",
        pct(planned.clone(), 50.0),
        pct(real.clone(), 50.0),
        pct(planned.clone(), 90.0),
        pct(real.clone(), 90.0),
        pct(planned.clone(), 99.0),
        pct(real.clone(), 99.0)
    );
    compare(&planned, &real, [(50.0, 0.2), (90.0, 0.2), (99.0, 0.2)])
}

/// Through the gateway: the plan of the same requests on three engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a timing comparison: run alone (CI runs it after the suite; bench/README.md)"]
async fn virtual_time_matches_a_gateway_in_front_of_a_live_fleet() {
    with_retries("through the gateway", through_the_gateway).await;
}
