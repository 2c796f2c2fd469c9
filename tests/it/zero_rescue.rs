//! Requests waiting on a backend that fails are rescued: withdrawn the moment the backend is
//! detected failed (probes, or the hang deadline from live traffic) and answered by another
//! backend, long before their own first-byte timeout (issue 18 items 1 and 2).

use crate::support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use sluice::sim::{Fault, FaultMode, SimConfig, SimKind};
use support::*;

/// Three vLLM sims at realistic speed behind a gateway whose head timeouts are a minute, so
/// only a rescue can answer a request caught on a hung backend in time.
async fn three(names: [&str; 3], extra: &str) -> (Vec<sluice::sim::SimHandle>, TestGateway) {
    let mut sims = Vec::new();
    let mut t = String::from("[routing]\npolicy = \"round-robin\"\nexpose_backend_header = true\n");
    t.push_str("\n[timeouts]\nfirst_byte = \"60s\"\nresponse = \"60s\"\n");
    t.push_str(extra);
    for name in names {
        let s = sim_with(SimConfig::new(SimKind::Vllm, vec!["m".into()]).output_tokens(4, 8)).await;
        t.push_str(&backend(name, "vllm", &s.url(), &["m"]));
        sims.push(s);
    }
    (sims, TestGateway::start_healthy(&t).await)
}

/// What the clients saw.
#[derive(Default)]
struct Seen {
    sent: AtomicU64,
    failed: AtomicU64,
    /// The slowest answer (ms).
    slowest_ms: AtomicU64,
    errors: Mutex<Vec<String>>,
}

struct Load {
    stop: Arc<AtomicBool>,
    seen: Arc<Seen>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// One chat, streamed or not; Ok when it arrived whole.
async fn one(c: &reqwest::Client, url: &str, stream: bool) -> Result<(), String> {
    let r = c
        .post(url)
        .json(&chat_body("m", stream, 8))
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = r.status();
    let body = r.text().await.map_err(|e| format!("body: {e}"))?;
    if !status.is_success() {
        return Err(format!("{status}: {body}"));
    }
    if stream && (body.contains("\"error\"") || !body.trim_end().ends_with("data: [DONE]")) {
        return Err(format!("stream not whole: {body}"));
    }
    Ok(())
}

/// `clients` concurrent clients alternating streamed and whole chats until stopped.
fn start_load(url: String, clients: usize) -> Load {
    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Seen::default());
    let tasks = (0..clients)
        .map(|i| {
            let (stop, seen, url) = (stop.clone(), seen.clone(), url.clone());
            tokio::spawn(async move {
                let c = reqwest::Client::builder()
                    .timeout(Duration::from_secs(40))
                    .build()
                    .unwrap();
                for n in 0..100_000 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    seen.sent.fetch_add(1, Ordering::Relaxed);
                    let t = Instant::now();
                    let r = one(&c, &url, (i + n) % 2 == 0).await;
                    let ms = t.elapsed().as_millis() as u64;
                    seen.slowest_ms.fetch_max(ms, Ordering::Relaxed);
                    if let Err(e) = r {
                        seen.failed.fetch_add(1, Ordering::Relaxed);
                        seen.errors.lock().unwrap().push(e);
                    }
                }
            })
        })
        .collect();
    Load { stop, seen, tasks }
}

impl Load {
    async fn finish(self) -> Arc<Seen> {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(45), t).await;
        }
        self.seen
    }
}

async fn until_serving(g: &TestGateway, name: &str) {
    eventually(Duration::from_secs(10), format!("{name} serves"), || {
        let n = g.attempts(name);
        async move { n > 20 }
    })
    .await;
}

async fn until_out(g: &TestGateway, name: &str, within: Duration) {
    eventually(within, format!("{name} out of the pool"), || {
        let routable = g.gw.runtime().fleet.get(name).unwrap().state.routable();
        async move { !routable }
    })
    .await;
}

async fn counter(g: &TestGateway, name: &str, backend: &str) -> f64 {
    metric(
        &g.metrics_text().await,
        &format!("{name}{{backend=\"{backend}\"}}"),
    )
}

/// The measurement: one of three backends hangs under 16 clients with the default
/// health settings and a one-minute first-byte timeout. The probes mark it down within
/// seconds; every request that was waiting on it is rescued then, so no client sees an error
/// and none waits anywhere near the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_waiting_on_a_hung_backend_are_rescued_when_probes_see_it() {
    // The hang deadline is off: only the probes detect the hang here.
    let (sims, g) = three(
        ["rsc-a0", "rsc-a1", "rsc-a2"],
        "\n[health]\nhang_factor = 0\n",
    )
    .await;
    let load = start_load(g.url("/v1/chat/completions"), 16);
    until_serving(&g, "rsc-a1").await;
    let sent_before = g.attempts("rsc-a1");
    sims[1].set_fault(Fault::mode(FaultMode::Hang)).unwrap();
    let hung = Instant::now();
    until_out(&g, "rsc-a1", Duration::from_secs(6)).await;
    let detected = hung.elapsed();
    // Traffic goes on elsewhere for a while; then everything in flight finishes.
    let others = g.attempts("rsc-a0") + g.attempts("rsc-a2");
    eventually(Duration::from_secs(10), "traffic elsewhere", || {
        let n = g.attempts("rsc-a0") + g.attempts("rsc-a2");
        async move { n > others + 100 }
    })
    .await;
    let seen = load.finish().await;
    let caught = g.attempts("rsc-a1") - sent_before;
    let rescued = counter(&g, "sluice_rescues_total", "rsc-a1").await;
    let slowest = Duration::from_millis(seen.slowest_ms.load(Ordering::Relaxed));
    eprintln!(
        "hang: sent {} failed {} caught {caught} rescued {rescued} detected after {detected:?} slowest {slowest:?}",
        seen.sent.load(Ordering::Relaxed),
        seen.failed.load(Ordering::Relaxed)
    );
    assert_eq!(
        seen.failed.load(Ordering::Relaxed),
        0,
        "{:?}",
        seen.errors.lock().unwrap()
    );
    // (a request sent just before the fault was set may still have been answered by it)
    assert!(rescued >= 1.0, "no request was rescued");
    // (a request sent just before the fault was set can be caught too, so the bound is
    // every request the backend was sent)
    let sent_to_it = g.attempts("rsc-a1") as f64;
    assert!(
        rescued <= sent_to_it,
        "rescued more than sent: {rescued} > {sent_to_it}"
    );
    // Detection (≤ 2 probes of ≤ 1.1 s + 0.8 s) plus the rescue: far below the minute.
    assert!(slowest < detected + Duration::from_secs(2), "{slowest:?}");
    assert!(slowest < Duration::from_secs(6), "{slowest:?}");
    // A rescue is not a new live failure of the backend: the probes took it out.
    let state = g.gw.runtime().fleet.get("rsc-a1").unwrap().state.clone();
    assert_eq!(state.failures_total(), 0);
    assert_eq!(state.health().as_str(), "down");
    sims[1].set_fault(Fault::healthy()).unwrap();
}

/// Probes that would take half a minute to notice: the hang deadline does. Requests on the
/// hung backend wait far past its learned time to first token while the others answer, so
/// each is a live failure of it; three in a row eject it, which rescues all its waiters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hang_deadline_ejects_a_hung_backend_and_rescues_its_waiters() {
    let health = "\n[health]\ninterval = \"30s\"\nhang_factor = 4\nhang_grace = \"1s\"\n";
    let (sims, g) = three(["rsc-b0", "rsc-b1", "rsc-b2"], health).await;
    let load = start_load(g.url("/v1/chat/completions"), 16);
    until_serving(&g, "rsc-b1").await;
    let sent_before = g.attempts("rsc-b1");
    sims[1].set_fault(Fault::mode(FaultMode::Hang)).unwrap();
    let hung = Instant::now();
    until_out(&g, "rsc-b1", Duration::from_secs(5)).await;
    let detected = hung.elapsed();
    let others = g.attempts("rsc-b0") + g.attempts("rsc-b2");
    eventually(Duration::from_secs(10), "traffic elsewhere", || {
        let n = g.attempts("rsc-b0") + g.attempts("rsc-b2");
        async move { n > others + 100 }
    })
    .await;
    let seen = load.finish().await;
    let caught = g.attempts("rsc-b1") - sent_before;
    let signals = counter(&g, "sluice_hang_signals_total", "rsc-b1").await;
    let rescued = counter(&g, "sluice_rescues_total", "rsc-b1").await;
    let slowest = Duration::from_millis(seen.slowest_ms.load(Ordering::Relaxed));
    eprintln!(
        "hang deadline: sent {} failed {} caught {caught} signals {signals} rescued {rescued} detected after {detected:?} slowest {slowest:?}",
        seen.sent.load(Ordering::Relaxed),
        seen.failed.load(Ordering::Relaxed)
    );
    assert_eq!(
        seen.failed.load(Ordering::Relaxed),
        0,
        "{:?}",
        seen.errors.lock().unwrap()
    );
    assert_eq!(g.backend_state("rsc-b1"), "ejected");
    // The third signal ejected it, which rescued every request waiting there (those that
    // signalled included: a signal does not end the wait by itself).
    assert!(signals >= 3.0, "{signals}");
    assert!(rescued >= signals, "{rescued} rescued");
    let sent_to_it = g.attempts("rsc-b1") as f64;
    assert!(
        rescued <= sent_to_it,
        "rescued more than sent: {rescued} > {sent_to_it}"
    );
    assert!(slowest < Duration::from_secs(4), "{slowest:?}");
    sims[1].set_fault(Fault::healthy()).unwrap();
}

/// A slow backend is not a hung one while nobody else answers: with no other traffic, a wait
/// past the hang deadline records nothing and the answer arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_wait_is_no_hang_while_no_other_backend_answers() {
    let health = "\n[health]\ninterval = \"30s\"\nhang_factor = 1\nhang_grace = \"200ms\"\n";
    let (sims, g) = three(["rsc-c0", "rsc-c1", "rsc-c2"], health).await;
    for s in &sims {
        s.set_fault(Fault::from_parts(
            FaultMode::Slow,
            Some(1.0),
            None,
            None,
            None,
            Some(900),
        ))
        .unwrap();
    }
    let t = Instant::now();
    let r = g.chat(&chat_body("m", false, 4)).await;
    assert!(r.status().is_success());
    let served_by = r.headers()["x-sluice-backend"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(t.elapsed() >= Duration::from_millis(900));
    assert_eq!(
        counter(&g, "sluice_hang_signals_total", &served_by).await,
        0.0
    );
    let state = g.gw.runtime().fleet.get(&served_by).unwrap().state.clone();
    assert_eq!(state.failures_total(), 0);
}

/// Passive detection by another request (here a connect failure, which ejects at once)
/// rescues a request already waiting on that backend for its head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_detection_by_another_request_rescues_a_waiting_one() {
    let health = "\n[health]\ninterval = \"30s\"\nhang_factor = 0\n";
    let (sims, g) = three(["rsc-d0", "rsc-d1", "rsc-d2"], health).await;
    sims[1].set_fault(Fault::mode(FaultMode::Hang)).unwrap();
    // Round robin: of three concurrent requests one waits on rsc-d1.
    let c = client();
    let url = g.url("/v1/chat/completions");
    let waiting: Vec<_> = (0..3)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                let t = Instant::now();
                let r = post_json(&c, url, &chat_body("m", true, 4)).await;
                (
                    r.status(),
                    r.headers()["x-sluice-backend"].clone(),
                    t.elapsed(),
                )
            })
        })
        .collect();
    eventually(Duration::from_secs(5), "a request waits on rsc-d1", || {
        let n = g.attempts("rsc-d1");
        async move { n >= 1 }
    })
    .await;
    // Another request's connect failure ejects it at once.
    let rt = g.gw.runtime();
    let state = rt.fleet.get("rsc-d1").unwrap().state.clone();
    let rescued_before = counter(&g, "sluice_rescues_total", "rsc-d1").await;
    state.record_live_failure(&rt.config.health, true, "connect");
    for w in waiting {
        let (status, backend, took) = w.await.unwrap();
        assert!(status.is_success());
        assert_ne!(backend, "rsc-d1");
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
    assert_eq!(
        counter(&g, "sluice_rescues_total", "rsc-d1").await,
        rescued_before + 1.0
    );
    // The rescue added no failure to the one that ejected it.
    assert_eq!(state.failures_total(), 1);
    sims[1].set_fault(Fault::healthy()).unwrap();
}

/// Four concurrent chats for model `rsc-hedge`: (status, backend, seconds) of each.
async fn four_chats(g: &TestGateway) -> Vec<(u16, String, Duration)> {
    let url = g.url("/v1/chat/completions");
    let tasks: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let t = Instant::now();
                let r = post_json(&client(), url, &chat_body("rsc-hedge", false, 4)).await;
                let backend = header(&r, "x-sluice-backend").to_string();
                (r.status().as_u16(), backend, t.elapsed())
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn hedge_config(slow: &str, fast: &str, hedge: bool) -> String {
    let mut t = format!(
        "[routing]\npolicy = \"round-robin\"\nexpose_backend_header = true\nhedge = {hedge}\n"
    );
    // Signals alone must not eject here: the hedge is what answers.
    t.push_str("\n[health]\ninterval = \"30s\"\nhang_factor = 1\nhang_grace = \"300ms\"\neject_after_failures = 50\n");
    t.push_str(&backend("rsc-e0", "vllm", slow, &["rsc-hedge"]));
    t.push_str(&backend("rsc-e1", "vllm", fast, &["rsc-hedge"]));
    t
}

/// With `[routing] hedge`, a request past its hang deadline while others answer also goes to
/// another backend; the first head wins, the slow copy is cancelled, and both slots are freed.
/// Without it (the default) the request waits for its slow backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hedging_sends_a_copy_at_the_hang_deadline_and_keeps_the_first_answer() {
    let slow = sim(SimKind::Vllm, &["rsc-hedge"]).await;
    let fast = sim(SimKind::Vllm, &["rsc-hedge"]).await;
    let delay = Fault::from_parts(FaultMode::Slow, Some(1.0), None, None, None, Some(2500));

    let g = TestGateway::start_healthy(&hedge_config(&slow.url(), &fast.url(), false)).await;
    slow.set_fault(delay.clone()).unwrap();
    let off = four_chats(&g).await;
    assert!(off.iter().all(|(s, _, _)| *s == 200), "{off:?}");
    let waited: Vec<_> = off.iter().filter(|(_, b, _)| b == "rsc-e0").collect();
    assert!(!waited.is_empty(), "{off:?}");
    assert!(
        waited
            .iter()
            .all(|(_, _, d)| *d >= Duration::from_millis(2500)),
        "{off:?}"
    );
    slow.set_fault(Fault::healthy()).unwrap();
    drop(g);

    let g = TestGateway::start_healthy(&hedge_config(&slow.url(), &fast.url(), true)).await;
    slow.set_fault(delay).unwrap();
    let hedges = || async {
        metric(
            &g.metrics_text().await,
            "sluice_hedges_total{model=\"rsc-hedge\"}",
        )
    };
    let before = hedges().await;
    let on = four_chats(&g).await;
    assert!(on.iter().all(|(s, _, _)| *s == 200), "{on:?}");
    assert!(on.iter().all(|(_, b, _)| b == "rsc-e1"), "{on:?}");
    assert!(
        on.iter().all(|(_, _, d)| *d < Duration::from_millis(2000)),
        "{on:?}"
    );
    assert!(hedges().await >= before + 1.0);
    let cancelled = metric(
        &g.metrics_text().await,
        "sluice_backend_requests_total{backend=\"rsc-e0\",outcome=\"cancelled\"}",
    );
    assert!(cancelled >= 1.0, "{cancelled}");
    // Each copy held its own backend's slot; both are free again.
    let rt = g.gw.runtime();
    for name in ["rsc-e0", "rsc-e1"] {
        let state = rt.fleet.get(name).unwrap().state.clone();
        eventually(
            Duration::from_secs(2),
            format!("{name} has no request in flight"),
            || {
                let n = state.inflight_requests();
                async move { n == 0 }
            },
        )
        .await;
    }
    slow.set_fault(Fault::healthy()).unwrap();
}

/// A registered member that stops heartbeating is presumed dead: a request waiting for its
/// answer is rescued by the expiry, not left to its own timeout while the member drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_that_expires_rescues_its_waiters() {
    let fixed = sim(SimKind::Vllm, &["rsc-reg"]).await;
    let member = sim(SimKind::Vllm, &["rsc-reg"]).await;
    let text = format!(
        "[routing]\npolicy = \"round-robin\"\nexpose_backend_header = true\n\
         [timeouts]\nfirst_byte = \"60s\"\nresponse = \"60s\"\n\
         [health]\ninterval = \"30s\"\nhang_factor = 0\n{}",
        backend("rsc-fixed", "vllm", &fixed.url(), &["rsc-reg"])
    );
    let g = TestGateway::start_healthy(&text).await;
    let c = client();
    let reg = json!({"name": "rsc-member", "kind": "vllm", "url": member.url(), "models": ["rsc-reg"], "ttl": "1s"});
    assert_eq!(
        post_json(&c, g.admin_url("/admin/backends"), &reg)
            .await
            .status(),
        201
    );
    g.wait_state("rsc-member", "healthy", Duration::from_secs(5))
        .await;
    member.set_fault(Fault::mode(FaultMode::Hang)).unwrap();
    // Two requests: round robin sends one to the hung member.
    let url = g.url("/v1/chat/completions");
    let tasks: Vec<_> = (0..2)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move {
                let t = Instant::now();
                let r = post_json(&c, url, &chat_body("rsc-reg", false, 4)).await;
                (
                    r.status().as_u16(),
                    header(&r, "x-sluice-backend").to_string(),
                    t.elapsed(),
                )
            })
        })
        .collect();
    for t in tasks {
        let (status, backend, took) = t.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(backend, "rsc-fixed");
        // The TTL (1 s) plus a membership tick, far from the minute of its timeout.
        assert!(took < Duration::from_secs(4), "{took:?}");
    }
    assert!(counter(&g, "sluice_rescues_total", "rsc-member").await >= 1.0);
    member.set_fault(Fault::healthy()).unwrap();
}
