//! Failover under load: a backend killed (refusing) or hung mid-run is taken out within a
//! second, clients see no error while nothing was streamed, and the backend rejoins.

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::sim::{Fault, FaultMode, SimKind};
use support::*;

fn three_vllm_config(urls: &[String], extra: &str) -> String {
    let mut t = String::from("[routing]\npolicy = \"round-robin\"\nexpose_backend_header = true\n");
    t.push_str(FAST_HEALTH);
    t.push_str(extra);
    for (i, u) in urls.iter().enumerate() {
        t.push_str(&backend(&format!("s{i}"), "vllm", u, &["m"]));
    }
    t
}

struct Load {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// `clients` concurrent clients sending non-stream chats in a loop until stopped.
fn start_load(url: String, clients: usize) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let (stop, sent, failed, url) = (stop.clone(), sent.clone(), failed.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let c = client();
            // bounded: at most 100k requests per client
            for _ in 0..100_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                sent.fetch_add(1, Ordering::Relaxed);
                let r = c.post(&url).json(&chat_body("m", false, 4)).send().await;
                let ok = match r {
                    Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                    Err(_) => false,
                };
                if !ok {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    Load {
        stop,
        sent,
        failed,
        tasks,
    }
}

impl Load {
    async fn finish(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
        (
            self.sent.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }
}

/// Until `name` has been sent more than 20 requests.
async fn until_serving(g: &TestGateway, name: &str) {
    eventually(
        Duration::from_secs(5),
        format!("{name} serves traffic"),
        || {
            let n = g.attempts(name);
            async move { n > 20 }
        },
    )
    .await;
}

/// Until `name` is no longer routable, for at most `within`.
async fn until_out(g: &TestGateway, name: &str, within: Duration) {
    eventually(within, format!("{name} out of the pool"), || {
        let routable = g.gw.runtime().fleet.get(name).unwrap().state.routable();
        async move { !routable }
    })
    .await;
}

/// While s0 and s2 serve 100 more requests, s1 is sent none.
async fn s1_gets_no_new_request(g: &TestGateway) {
    let at_start = g.attempts("s1");
    let before = g.attempts("s0") + g.attempts("s2");
    eventually(
        Duration::from_secs(5),
        "traffic continues elsewhere",
        || {
            let n = g.attempts("s0") + g.attempts("s2");
            async move { n > before + 100 }
        },
    )
    .await;
    assert_eq!(
        g.attempts("s1"),
        at_start,
        "the dead backend got new requests"
    );
}

/// Until `name` has been sent 10 more requests.
async fn until_serving_again(g: &TestGateway, name: &str) {
    let n = g.attempts(name);
    eventually(
        Duration::from_secs(5),
        format!("{name} serves again"),
        || {
            let m = g.attempts(name);
            async move { m > n + 10 }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_backend_is_out_within_a_second_no_client_error_and_rejoins() {
    let sims = [
        sim(SimKind::Vllm, &["m"]).await,
        sim(SimKind::Vllm, &["m"]).await,
        sim(SimKind::Vllm, &["m"]).await,
    ];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    let g = TestGateway::start_healthy(&three_vllm_config(&urls, "")).await;
    let load = start_load(g.url("/v1/chat/completions"), 16);

    until_serving(&g, "s1").await;
    // Kill s1: its port stops accepting (connections reset, kept-alive ones closed).
    sims[1].set_fault(Fault::mode(FaultMode::Refuse)).unwrap();
    let died = Instant::now();
    until_out(&g, "s1", Duration::from_secs(1)).await;
    let ejected_after = died.elapsed();
    // From 1 s after its death on, it gets no new request.
    tokio::time::sleep_until((died + Duration::from_secs(1)).into()).await;
    s1_gets_no_new_request(&g).await;

    // Restart: it rejoins and serves again.
    sims[1].set_fault(Fault::healthy()).unwrap();
    let back = Instant::now();
    g.wait_state("s1", "healthy", Duration::from_secs(5)).await;
    let rejoined_after = back.elapsed();
    until_serving_again(&g, "s1").await;
    let (sent, failed) = load.finish().await;
    eprintln!("refuse: sent {sent} failed {failed} ejected after {ejected_after:?} rejoined after {rejoined_after:?}");
    assert!(sent > 200, "too little load: {sent}");
    assert_eq!(failed, 0, "client requests failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_gone_and_restarted_on_the_same_port() {
    let s0 = sim(SimKind::Vllm, &["m"]).await;
    let s1 = sim(SimKind::Vllm, &["m"]).await;
    let s2 = sim(SimKind::Vllm, &["m"]).await;
    let port = s1.addr().port();
    let urls = vec![s0.url(), s1.url(), s2.url()];
    let g = TestGateway::start_healthy(&three_vllm_config(&urls, "")).await;
    let load = start_load(g.url("/v1/chat/completions"), 12);
    until_serving(&g, "s1").await;
    s1.shutdown().await; // the process is gone: connection refused
    let died = Instant::now();
    until_out(&g, "s1", Duration::from_secs(1)).await;
    tokio::time::sleep_until((died + Duration::from_secs(1)).into()).await;
    s1_gets_no_new_request(&g).await;
    let _s1 = sim_with(
        sluice::sim::SimConfig::new(SimKind::Vllm, vec!["m".into()])
            .speed(0.0)
            .port(port),
    )
    .await;
    g.wait_state("s1", "healthy", Duration::from_secs(5)).await;
    until_serving_again(&g, "s1").await;
    let (sent, failed) = load.finish().await;
    eprintln!("kill: sent {sent} failed {failed}");
    assert_eq!(failed, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_backend_costs_at_most_the_ttfb_timeout_then_nothing() {
    let sims = [
        sim(SimKind::Vllm, &["m"]).await,
        sim(SimKind::Vllm, &["m"]).await,
        sim(SimKind::Vllm, &["m"]).await,
    ];
    let urls: Vec<String> = sims.iter().map(|s| s.url()).collect();
    // The response head timeout is the non-stream TTFB bound.
    let extra = "\n[timeouts]\nresponse = \"700ms\"\nfirst_byte = \"700ms\"\n";
    let g = TestGateway::start_healthy(&three_vllm_config(&urls, extra)).await;
    let c = client();
    let load = start_load(g.url("/v1/chat/completions"), 12);
    until_serving(&g, "s1").await;
    sims[1].set_fault(Fault::mode(FaultMode::Hang)).unwrap();
    let hung = Instant::now();
    until_out(&g, "s1", Duration::from_secs(2)).await;
    let detected = hung.elapsed();
    // After detection, a request is answered promptly, never by s1.
    let t = Instant::now();
    let r = post_json(&c, g.url("/v1/chat/completions"), &chat_body("m", false, 4)).await;
    assert!(r.status().is_success());
    assert_ne!(r.headers()["x-sluice-backend"], "s1");
    assert!(t.elapsed() < Duration::from_millis(700));
    s1_gets_no_new_request(&g).await;
    sims[1].set_fault(Fault::healthy()).unwrap();
    g.wait_state("s1", "healthy", Duration::from_secs(5)).await;
    let (sent, failed) = load.finish().await;
    eprintln!("hang: sent {sent} failed {failed} detected after {detected:?}");
    // Requests caught on s1 failed over after the timeout; none failed.
    assert_eq!(failed, 0);
}
