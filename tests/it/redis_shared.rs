//! Limits shared across gateway replicas through a real Redis (started here on a free port).
//! Skips, saying so, when `redis-server` is not installed — unless `CI` is set.

use crate::support;

use std::time::{Duration, Instant};

use futures_util::future::join_all;
use sluice::sim::{SimConfig, SimKind};
use support::redis::redis;
use support::{backend, chat_body, client, eventually, TestGateway};

async fn post(c: &reqwest::Client, url: String, key: &str) -> u16 {
    c.post(url)
        .bearer_auth(key)
        .json(&chat_body("m", false, 5))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_exact_limit() {
    let Some(redis) = redis().await else { return };
    let sim = sluice::sim::spawn(SimConfig::new(SimKind::Vllm, vec!["m".into()]).speed(0.0))
        .await
        .unwrap();
    let (key, hash) = sluice::auth::mint();
    let toml = format!(
        "{}\n[[keys]]\nname = \"k\"\nhash = \"{hash}\"\nrequests_per_minute = 25\n[limits]\nredis_url = \"redis://127.0.0.1:{}/\"\nfail_open = false\n",
        backend("b", "vllm", &sim.url(), &["m"]),
        redis.port
    );
    let a = TestGateway::start_healthy(&toml).await;
    let b = TestGateway::start_healthy(&toml).await;
    let c = client();
    let started = Instant::now();
    let codes = join_all((0..100).map(|i| {
        let gw = if i % 2 == 0 { &a } else { &b };
        post(&c, gw.url("/v1/chat/completions"), &key)
    }))
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "burst too slow for the check"
    );
    let ok = codes.iter().filter(|s| **s == 200).count();
    let limited = codes.iter().filter(|s| **s == 429).count();
    assert!(
        (25..=26).contains(&ok),
        "both replicas together admitted {ok}: {codes:?}"
    );
    assert_eq!(ok + limited, 100);

    // Fail-closed: with Redis gone, requests are refused with 503, not let through.
    drop(redis);
    let s = post(&c, a.url("/v1/chat/completions"), &key).await;
    assert_eq!(s, 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_falls_back_to_local_limits() {
    let Some(redis) = redis().await else { return };
    let sim = sluice::sim::spawn(SimConfig::new(SimKind::Vllm, vec!["m".into()]).speed(0.0))
        .await
        .unwrap();
    let (key, hash) = sluice::auth::mint();
    let port = redis.port;
    drop(redis); // unreachable from the start
    let toml = format!(
        "{}\n[[keys]]\nname = \"k\"\nhash = \"{hash}\"\nrequests_per_minute = 5\n[limits]\nredis_url = \"redis://127.0.0.1:{port}/\"\n",
        backend("b", "vllm", &sim.url(), &["m"]),
    );
    let gw = TestGateway::start_healthy(&toml).await;
    let c = client();
    let mut codes = Vec::new();
    for _ in 0..8 {
        codes.push(post(&c, gw.url("/v1/chat/completions"), &key).await);
    }
    assert_eq!(codes.iter().filter(|s| **s == 200).count(), 5, "{codes:?}");
    assert_eq!(codes.iter().filter(|s| **s == 429).count(), 3, "{codes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_longer_than_the_lease_keeps_its_concurrency_slot() {
    let Some(redis) = redis().await else { return };
    // A 3 s stream (150 tokens, 20 ms each) against a 1 s lease: only renewal keeps the slot.
    let sim = sluice::sim::spawn(
        SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .speed(1.0)
            .timing(sluice::sim::Timing {
                decode_base: Duration::from_millis(20),
                decode_per_seq: Duration::ZERO,
                ..Default::default()
            })
            .output_tokens(150, 150),
    )
    .await
    .unwrap();
    let (key, hash) = sluice::auth::mint();
    let toml = format!(
        "{}\n[[keys]]\nname = \"k\"\nhash = \"{hash}\"\nmax_concurrent = 1\n[limits]\nredis_url = \"redis://127.0.0.1:{}/\"\nfail_open = false\nconcurrency_lease = \"1s\"\n",
        backend("b", "vllm", &sim.url(), &["m"]),
        redis.port
    );
    let a = TestGateway::start_healthy(&toml).await;
    let b = TestGateway::start_healthy(&toml).await;
    let c = client();
    let mut stream = c
        .post(a.url("/v1/chat/completions"))
        .bearer_auth(&key)
        .json(&chat_body("m", true, 150))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    assert!(stream.chunk().await.unwrap().is_some());
    let started = Instant::now();
    // Two lease lifetimes and more: the other replica still sees the slot taken.
    let mut checks = 0;
    while started.elapsed() < Duration::from_millis(2200) {
        assert_eq!(
            post(&c, b.url("/v1/chat/completions"), &key).await,
            429,
            "slot lost after {:?}",
            started.elapsed()
        );
        checks += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(checks >= 5);
    // The stream was still running all along, and its end frees the slot.
    let mut rest = 0;
    while let Some(bytes) = stream.chunk().await.unwrap() {
        rest += bytes.len();
    }
    assert!(rest > 0);
    eventually(
        Duration::from_secs(3),
        "slot freed after the stream",
        || async { post(&c, b.url("/v1/chat/completions"), &key).await == 200 },
    )
    .await;
}
