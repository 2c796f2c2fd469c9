//! Two real `sluice serve` replicas sharing one `[batch] dir` and one redis-server
//! (`[batch] shared`): one batch's chunks are leased by both, any replica answers its state,
//! and after a `kill -9` of one replica mid-batch the other takes its chunks over and
//! finishes: every `custom_id` exactly once in the output.

use std::time::Duration;

use serde_json::Value;
use sluice::sim::{SimConfig, SimKind};

use crate::batch_api::{each_line_once, many_lines, serve, Api};
use crate::support;
use support::net::free_port;
use support::redis::redis;
use support::*;

/// A replica's config: one slow sim, the shared folder, Redis, small chunks, short leases.
fn replica(sim_url: &str, dir: &std::path::Path, redis_url: &str, port: u16) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\n{FAST_HEALTH}{}\n[limits]\nredis_url = \"{redis_url}\"\n\
         [batch]\ndir = \"{}\"\nmax_in_flight = 2\nshared = true\nchunk_lines = 4\nlease = \"1s\"\n",
        backend("a", "vllm", sim_url, &["m"]),
        dir.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_a_batch_and_one_survives_a_kill_9() {
    let Some(redis) = redis().await else { return };
    // Tokens every 20 ms: each line takes ~0.1 s.
    let s = sim_with(SimConfig::new(SimKind::Vllm, vec!["m".into()]).speed(1.0)).await;
    let dir = tempfile::tempdir().unwrap();
    let jobs = dir.path().join("jobs");
    let (pa, pb) = (free_port(), free_port());
    let (ca, cb) = (dir.path().join("a.toml"), dir.path().join("b.toml"));
    std::fs::write(&ca, replica(&s.url(), &jobs, &redis.url(), pa)).unwrap();
    std::fs::write(&cb, replica(&s.url(), &jobs, &redis.url(), pb)).unwrap();
    let mut a = serve(&ca, pa).await;
    let mut b = serve(&cb, pb).await;
    let api = |port: u16| Api {
        base: format!("http://127.0.0.1:{port}"),
        key: None,
    };
    let (on_a, on_b) = (api(pa), api(pb));

    let n = 120;
    let id = on_a.submit(&many_lines(n)).await;
    on_b.completed_at_least(&id, 12).await;
    // Both replicas answer the same state, read from the shared folder.
    let path = format!("/v1/batches/{id}");
    let (st, seen_by_b) = on_b.get(&path).await;
    assert_eq!(
        (st, seen_by_b["status"].as_str()),
        (200, Some("in_progress"))
    );
    assert_eq!(seen_by_b["request_counts"]["total"], n);

    // kill -9 one replica while both hold chunks.
    a.kill().unwrap();
    a.wait().unwrap();

    let done = on_b.finished(&id, Duration::from_secs(90)).await;
    each_line_once(&on_b, &done, n).await;
    // The file the replica that died made is there on the other one.
    let (st, file) = on_b
        .get(&format!(
            "/v1/files/{}",
            done["input_file_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!((st, file["purpose"].as_str()), (200, Some("batch")));
    let (_, list) = on_b.get("/v1/batches").await;
    assert_eq!(list["data"][0]["id"], Value::String(id));
    b.kill().unwrap();
    b.wait().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_cancelled_on_one_replica_stops_on_both() {
    let Some(redis) = redis().await else { return };
    let s = sim_with(SimConfig::new(SimKind::Vllm, vec!["m".into()]).speed(1.0)).await;
    let dir = tempfile::tempdir().unwrap();
    let t = replica(&s.url(), dir.path(), &redis.url(), 0);
    let a = TestGateway::start_healthy(&t).await;
    let b = TestGateway::start_healthy(&t).await;
    let (on_a, on_b) = (
        Api {
            base: a.url(""),
            key: None,
        },
        Api {
            base: b.url(""),
            key: None,
        },
    );
    let n = 200;
    let id = on_a.submit(&many_lines(n)).await;
    on_a.completed_at_least(&id, 4).await;
    let r = on_b
        .req(reqwest::Method::POST, &format!("/v1/batches/{id}/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let cancelling: Value = r.json().await.unwrap();
    assert_eq!(cancelling["status"], "cancelling");
    let done = on_a.finished(&id, Duration::from_secs(30)).await;
    assert_eq!(done["status"], "cancelled", "{done}");
    let counts = &done["request_counts"];
    let ran = counts["completed"].as_u64().unwrap();
    assert!(ran < n as u64, "{done}");
    // The output holds what the counts say, each line once, on either replica.
    let out = on_b.lines_by_id(&done["output_file_id"]).await;
    assert_eq!(out.len() as u64, ran);
    assert_eq!(on_b.get(&format!("/v1/batches/{id}")).await.1, done);
    a.stop().await;
    b.stop().await;
}
