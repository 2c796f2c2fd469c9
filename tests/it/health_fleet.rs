//! Health, overload and membership: the terminal event of a cut stream, hysteresis against a
//! flapping backend, busy engines avoided, concurrency caps with the wait queue, registration
//! with TTL and drain, DNS discovery.

use crate::support;

use std::time::{Duration, Instant};

use sluice::sim::{Fault, FaultMode, SimConfig, SimKind};
use support::*;

#[tokio::test]
async fn stream_cut_midway_ends_with_an_openai_error_event_then_done() {
    let s = sim(SimKind::Vllm, &["m"]).await;
    let g = TestGateway::one_backend("a", "vllm", &s.url()).await;
    s.set_fault(Fault::from_parts(
        FaultMode::DropMidstream,
        None,
        None,
        Some(2),
        None,
        None,
    ))
    .unwrap();
    let r = g.chat(&chat_body("m", true, 20)).await;
    assert_eq!(r.status(), 200);
    let body = r.bytes().await.unwrap();
    let text = std::str::from_utf8(&body).unwrap();
    // The exact ending: `data: {"error":{…}}\n\ndata: [DONE]\n\n`, nothing after.
    let tail = text
        .strip_suffix("\n\ndata: [DONE]\n\n")
        .expect("ends with [DONE]");
    let last = tail.rsplit("\n\n").next().unwrap();
    let json = last.strip_prefix("data: ").expect("a data event");
    let v: serde_json::Value = serde_json::from_str(json).unwrap();
    let obj = v.as_object().unwrap();
    assert_eq!(obj.len(), 1, "only an error object: {v}");
    let e = &v["error"];
    assert_eq!(e["code"], "backend_stream_interrupted");
    assert!(e["type"].is_string() && e["message"].as_str().unwrap().contains("incomplete"));
    assert!(e.get("param").is_some());
    // Chunks before the cut went through.
    let events = sse_data(text);
    assert!(events.len() >= 3, "{events:?}");
    assert!(events[0].contains("chat.completion.chunk"));
    // The backend was marked.
    let failures =
        g.gw.runtime()
            .fleet
            .get("a")
            .unwrap()
            .state
            .failures_total();
    assert_eq!(failures, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flapping_health_does_not_make_routing_oscillate() {
    let flappy = sim(SimKind::Vllm, &["m"]).await;
    let steady = sim(SimKind::Vllm, &["m"]).await;
    let text = format!(
        "[health]\ninterval = \"50ms\"\ntimeout = \"500ms\"\nhealthy_threshold = 5\nunhealthy_threshold = 5\n{}{}",
        backend("flappy", "vllm", &flappy.url(), &["m"]),
        backend("steady", "vllm", &steady.url(), &["m"])
    );
    let g = TestGateway::start_healthy(&text).await;
    // Health alternates every 60 ms: never 5 probes (≥ 200 ms) in a row of the same kind, even
    // when this loop runs up to 140 ms late on a loaded machine.
    let start = Instant::now();
    let mut transitions = 0;
    let mut last = g.backend_state("flappy");
    let mut bad = false;
    let mut next_flip = start;
    while start.elapsed() < Duration::from_millis(1500) {
        if Instant::now() >= next_flip {
            bad = !bad;
            flappy
                .set_fault(if bad {
                    Fault::mode(FaultMode::HealthFail)
                } else {
                    Fault::healthy()
                })
                .unwrap();
            next_flip += Duration::from_millis(60);
        }
        let now = g.backend_state("flappy");
        if now != last {
            transitions += 1;
            last = now;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        transitions, 0,
        "routing state changed {transitions} times while flapping"
    );
    // A sustained failure still takes it out, after 5 failed probes (4 intervals at least).
    flappy.set_fault(Fault::healthy()).unwrap();
    let b = g.gw.runtime().fleet.get("flappy").unwrap().clone();
    eventually(Duration::from_secs(2), "5 passing probes", || {
        let ok = b.state.track().probe_ok_streak >= 5;
        async move { ok }
    })
    .await;
    flappy
        .set_fault(Fault::mode(FaultMode::HealthFail))
        .unwrap();
    let t = Instant::now();
    g.wait_state("flappy", "down", Duration::from_secs(2)).await;
    assert!(
        t.elapsed() >= Duration::from_millis(180),
        "left faster than 5 probes"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_ollama_503_and_tgi_429_are_avoided_not_hammered() {
    let ollama = sim(SimKind::Ollama, &["m"]).await;
    let tgi = sim(SimKind::Tgi, &["m"]).await;
    let vllm = sim(SimKind::Vllm, &["m"]).await;
    let text = format!(
        "[routing]\npolicy = \"round-robin\"\nexpose_backend_header = true\n{FAST_HEALTH}{}model_names = {{ \"m\" = \"m:latest\" }}\n{}{}",
        backend("ollama", "ollama", &ollama.url(), &["m"]),
        backend("tgi", "tgi", &tgi.url(), &["m"]),
        backend("vllm", "vllm", &vllm.url(), &["m"]),
    );
    let g = TestGateway::start_healthy(&text).await;
    ollama
        .set_fault(Fault::mode(FaultMode::Overloaded))
        .unwrap();
    tgi.set_fault(Fault::mode(FaultMode::Overloaded)).unwrap();
    let c = client();
    let t = Instant::now();
    let mut n = 0;
    while t.elapsed() < Duration::from_millis(1000) {
        let r = post_json(&c, g.url("/v1/chat/completions"), &chat_body("m", false, 4)).await;
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
        assert_eq!(r.headers()["x-sluice-backend"], "vllm");
        n += 1;
    }
    let (o, tg) = (g.attempts("ollama"), g.attempts("tgi"));
    eprintln!("{n} requests; busy ollama got {o}, busy tgi got {tg}");
    assert!(n > 50, "too few requests: {n}");
    // Backoff 250 ms, doubling: a handful of tries each in a second, not a share of n.
    assert!(o <= 5 && tg <= 5, "hammered: ollama {o}, tgi {tg} of {n}");
    let admin = g.admin_backends().await;
    let states: Vec<(String, String)> = admin["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| {
            (
                b["name"].as_str().unwrap().to_string(),
                b["state"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert!(
        states
            .iter()
            .any(|(n, s)| n == "ollama" && s == "overloaded"),
        "{states:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_cap_queues_then_times_out_with_retry_after() {
    // speed 1: a 60-token answer takes about a second
    let s = sim_with(SimConfig::new(SimKind::Vllm, vec!["m".into()]).speed(1.0)).await;
    let text = format!(
        "{FAST_HEALTH}\n[queue]\ntimeout = \"10s\"\n{}max_concurrent = 1\n",
        backend("a", "vllm", &s.url(), &["m"])
    );
    let g = TestGateway::start_healthy(&text).await;
    let c = client();
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (c, url) = (c.clone(), g.url("/v1/chat/completions"));
        tasks.push(tokio::spawn(async move {
            c.post(url)
                .json(&chat_body("m", false, 20))
                .send()
                .await
                .unwrap()
                .status()
        }));
    }
    let b = g.gw.runtime().fleet.get("a").unwrap().clone();
    let mut max_seen = 0;
    let mut queued_seen = 0;
    let t = Instant::now();
    while !tasks.iter().all(|t| t.is_finished()) && t.elapsed() < Duration::from_secs(10) {
        max_seen = max_seen.max(b.state.inflight_requests());
        queued_seen = queued_seen.max(g.gw.queue.len());
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    assert_eq!(max_seen, 1, "the cap was exceeded");
    // Sampling can miss a short wait on a loaded machine; the cap above is the guarantee.
    eprintln!("queue depth seen: {queued_seen}");

    // With a short queue timeout, a request behind a long one gets 503 + Retry-After.
    let text = text.replace("timeout = \"10s\"", "timeout = \"150ms\"");
    g.gw.reload(sluice::config::from_str(&text, "t").unwrap());
    let long = {
        let (c, url) = (c.clone(), g.url("/v1/chat/completions"));
        tokio::spawn(async move {
            c.post(url)
                .json(&chat_body("m", false, 80))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    eventually(Duration::from_secs(2), "slot taken", || {
        let n = b.state.inflight_requests();
        async move { n == 1 }
    })
    .await;
    let r = post_json(&c, g.url("/v1/chat/completions"), &chat_body("m", false, 3)).await;
    assert_eq!(r.status(), 503);
    assert!(r.headers().get("retry-after").is_some());
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "queue_timeout");
    assert_eq!(long.await.unwrap(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_backend_serves_survives_reload_and_leaves_within_its_ttl() {
    let fixed = sim(SimKind::Vllm, &["m"]).await;
    let joiner = sim(SimKind::Vllm, &["m2"]).await;
    let text = format!(
        "[routing]\nexpose_backend_header = true\n{FAST_HEALTH}{}",
        backend("fixed", "vllm", &fixed.url(), &["m"])
    );
    let g = TestGateway::start_healthy(&text).await;
    let c = client();
    let reg = serde_json::json!({"name": "job-42", "kind": "vllm", "url": joiner.url(), "models": ["m2"], "ttl": "600ms"});
    let r = post_json(&c, g.admin_url("/admin/backends"), &reg).await;
    assert_eq!(r.status(), 201);
    // a configured name cannot be taken
    let mut taken = reg.clone();
    taken["name"] = "fixed".into();
    assert_eq!(
        c.post(g.admin_url("/admin/backends"))
            .json(&taken)
            .send()
            .await
            .unwrap()
            .status(),
        409
    );
    g.wait_state("job-42", "healthy", Duration::from_secs(3))
        .await;
    // heartbeats keep it for longer than its TTL, across a reload
    let t = Instant::now();
    let mut beats = 0;
    while t.elapsed() < Duration::from_millis(1200) {
        let r = c
            .post(g.admin_url("/admin/backends/job-42/heartbeat"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        beats += 1;
        if beats == 3 {
            g.gw.reload(sluice::config::from_str(&text, "t").unwrap());
        }
        let r = post_json(
            &c,
            g.url("/v1/chat/completions"),
            &chat_body("m2", false, 4),
        )
        .await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["x-sluice-backend"], "job-42");
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let admin = g.admin_backends().await;
    let entry = admin["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["name"] == "job-42")
        .unwrap()
        .clone();
    assert_eq!(entry["source"], "registration");
    assert!(entry["registration"]["ttl_ms"] == 600);
    // it stops heartbeating: gone within its TTL (plus one membership tick)
    let stopped = Instant::now();
    eventually(Duration::from_millis(900), "job-42 left the pool", || {
        let gone = g.gw.runtime().fleet.get("job-42").is_none();
        async move { gone }
    })
    .await;
    eprintln!("left {:?} after the last heartbeat", stopped.elapsed());
    let r = post_json(
        &c,
        g.url("/v1/chat/completions"),
        &chat_body("m2", false, 4),
    )
    .await;
    assert_eq!(r.status(), 404);
    assert_eq!(
        c.post(g.admin_url("/admin/backends/job-42/heartbeat"))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deregistration_drains_in_flight_streams_complete() {
    let slow = sim_with(SimConfig::new(SimKind::Vllm, vec!["m".into()]).speed(1.0)).await;
    let g = TestGateway::start(FAST_HEALTH).await;
    let c = client();
    let reg =
        serde_json::json!({"name": "pod-a", "kind": "vllm", "url": slow.url(), "models": ["m"]});
    assert_eq!(
        c.post(g.admin_url("/admin/backends"))
            .json(&reg)
            .send()
            .await
            .unwrap()
            .status(),
        201
    );
    g.wait_state("pod-a", "healthy", Duration::from_secs(3))
        .await;
    let state = g.gw.runtime().fleet.get("pod-a").unwrap().state.clone();
    let mut r = post_json(&c, g.url("/v1/chat/completions"), &chat_body("m", true, 40)).await;
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().unwrap();
    assert!(!first.is_empty());
    // leave while the stream runs
    assert_eq!(
        c.delete(g.admin_url("/admin/backends/pod-a"))
            .send()
            .await
            .unwrap()
            .status(),
        204
    );
    assert!(g.gw.runtime().fleet.get("pod-a").is_none());
    assert_eq!(state.health().as_str(), "draining");
    // no new request goes there
    let n = post_json(&c, g.url("/v1/chat/completions"), &chat_body("m", false, 4)).await;
    assert_eq!(n.status(), 404);
    // the in-flight stream completes normally
    let mut rest = Vec::from(&first[..]);
    while let Some(chunk) = r.chunk().await.unwrap() {
        rest.extend_from_slice(&chunk);
    }
    let text = String::from_utf8(rest).unwrap();
    let events = sse_data(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert!(!text.contains("\"error\""), "{text}");
    assert_eq!(state.inflight_requests(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_discovery_adds_each_address_and_reload_removes_them() {
    let s = sim(SimKind::Vllm, &["m"]).await;
    let port = s.addr().port();
    let text = format!(
        "{FAST_HEALTH}\n[[discovery]]\nname = \"pool\"\nkind = \"vllm\"\nhost = \"localhost\"\nport = {port}\nmodels = [\"m\"]\ninterval = \"200ms\"\n"
    );
    let g = TestGateway::start(&text).await;
    let member = format!("pool@127.0.0.1:{port}");
    g.wait_state(&member, "healthy", Duration::from_secs(3))
        .await;
    let names: Vec<String> =
        g.gw.runtime()
            .fleet
            .backends
            .iter()
            .map(|b| b.name().to_string())
            .collect();
    assert!(names.iter().all(|n| n.starts_with("pool@")), "{names:?}");
    let r = g.chat(&chat_body("m", false, 4)).await;
    assert_eq!(r.status(), 200);
    // survives a reload of the same config
    g.gw.reload(sluice::config::from_str(&text, "t").unwrap());
    assert!(g.gw.runtime().fleet.get(&member).is_some());
    // the entry removed from the config: its members leave
    g.gw.reload(sluice::config::from_str(FAST_HEALTH, "t").unwrap());
    assert!(g.gw.runtime().fleet.backends.is_empty());
}
