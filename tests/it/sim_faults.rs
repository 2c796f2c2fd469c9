//! Run-time faults through the `/sim/fault` control endpoint: one test per mode.

use std::time::{Duration, Instant};

use crate::support::poll;
use crate::support::sim::*;
use serde_json::{json, Value};
use sluice::sim::{Fault, FaultMode, SimKind};

fn chat_body(max_tokens: u32, stream: bool) -> Value {
    json!({"messages":[{"role":"user","content":"hi"}],"max_tokens":max_tokens,"stream":stream})
}

async fn chat(c: &reqwest::Client, url: &str, max_tokens: u32) -> (u16, String) {
    let r = post_json(
        c,
        format!("{url}/v1/chat/completions"),
        &chat_body(max_tokens, false),
    )
    .await;
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn health(c: &reqwest::Client, url: &str) -> u16 {
    get_status(c, format!("{url}/health")).await.as_u16()
}

#[tokio::test]
async fn control_endpoint_validates_and_reports_state() {
    let sim = start(SimKind::Vllm, &["m"], |c| c.speed(0.0)).await;
    let c = client();
    let url = sim.url();
    let r = set_fault(&c, &url, json!({"mode":"bogus"})).await;
    assert_eq!(r.status(), 400);
    let r = set_fault(&c, &url, json!({"mode":"error_rate","rate":2.0})).await;
    assert_eq!(r.status(), 400);
    let r = set_fault(&c, &url, json!({"mode":"slow","speed":2})).await;
    assert_eq!(r.status(), 400, "unknown parameters are rejected");
    chat(&c, &url, 2).await;
    let r = set_fault(&c, &url, json!({"mode":"slow","factor":3.0})).await;
    assert_eq!(r.status(), 200);
    let s: Value = r.json().await.unwrap();
    assert_eq!(s["mode"], "slow");
    assert_eq!(s["fault"]["factor"], 3.0);
    for k in ["waiting", "running", "models", "counters", "kind", "speed"] {
        assert!(s.get(k).is_some(), "{k} in {s}");
    }
    assert_eq!(s["counters"]["by_status"]["200"], 1);
    assert!(s["counters"]["tokens_out"].as_u64().unwrap() >= 2);
    assert!(s["counters"]["tokens_in"].as_u64().unwrap() > 0);
    let f: Value = get_json(&c, format!("{url}/sim/fault")).await;
    assert_eq!(f["mode"], "slow");
    let r = set_fault(&c, &url, json!({"mode":"healthy"})).await;
    assert_eq!(r.json::<Value>().await.unwrap()["mode"], "healthy");
}

#[tokio::test]
async fn hang_parks_inference_and_health_until_healthy() {
    let sim = start(SimKind::Vllm, &["m"], |c| c.speed(0.0)).await;
    let c = client();
    let url = sim.url();
    set_fault(&c, &url, json!({"mode":"hang"})).await;
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let r = quick.get(format!("{url}/health")).send().await;
    assert!(r.unwrap_err().is_timeout());
    let r = quick
        .post(format!("{url}/v1/chat/completions"))
        .json(&chat_body(2, false))
        .send()
        .await;
    assert!(r.unwrap_err().is_timeout());
    // a parked request resumes when the fault is cleared
    let parked = {
        let c = c.clone();
        let url = url.clone();
        tokio::spawn(async move { chat(&c, &url, 2).await.0 })
    };
    assert_eq!(
        state(&c, &url).await["mode"],
        "hang",
        "control still answers"
    );
    set_fault(&c, &url, json!({"mode":"healthy"})).await;
    assert_eq!(parked.await.unwrap(), 200);
}

#[tokio::test]
async fn slow_multiplies_latency_and_delay_ms_works_at_speed_zero() {
    let sim = start(SimKind::Vllm, &["m"], |c| {
        c.timing(sluice::sim::Timing {
            decode_base: Duration::from_millis(2),
            ..Default::default()
        })
    })
    .await;
    let c = client();
    let url = sim.url();
    let t = Instant::now();
    chat(&c, &url, 10).await;
    let base = t.elapsed();
    set_fault(&c, &url, json!({"mode":"slow","factor":10.0})).await;
    let t = Instant::now();
    chat(&c, &url, 10).await;
    let slow = t.elapsed();
    assert!(
        slow > base * 3 && slow >= Duration::from_millis(150),
        "base {base:?} slow {slow:?}"
    );

    let fast = start(SimKind::Vllm, &["m"], |c| c.speed(0.0)).await;
    set_fault(&c, &fast.url(), json!({"mode":"slow","delay_ms":200})).await;
    let t = Instant::now();
    assert_eq!(chat(&c, &fast.url(), 2).await.0, 200);
    assert!(t.elapsed() >= Duration::from_millis(200));
}

#[tokio::test]
async fn error_rate_fails_inference_while_health_passes() {
    let sim = start(SimKind::Vllm, &["m"], |c| c.speed(0.0)).await;
    let c = client();
    let url = sim.url();
    set_fault(&c, &url, json!({"mode":"error_rate","rate":1.0})).await;
    let (s, b) = chat(&c, &url, 2).await;
    assert_eq!(s, 500);
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["error"]["type"], "InternalServerError");
    assert_eq!(v["error"]["code"], 500);
    assert_eq!(health(&c, &url).await, 200);
    set_fault(&c, &url, json!({"mode":"error_rate","rate":0.5})).await;
    let mut codes = std::collections::BTreeSet::new();
    for _ in 0..200 {
        codes.insert(chat(&c, &url, 1).await.0);
        if codes.len() == 2 {
            break;
        }
    }
    assert_eq!(codes.into_iter().collect::<Vec<_>>(), [200, 500]);
}

#[tokio::test]
async fn error_rate_per_engine() {
    let c = client();
    let tgi = start(SimKind::Tgi, &["m"], |c| c.speed(0.0)).await;
    set_fault(&c, &tgi.url(), json!({"mode":"error_rate"})).await;
    let r = post_json(
        &c,
        format!("{}/generate", tgi.url()),
        &json!({"inputs":"x"}),
    )
    .await;
    assert_eq!(r.status(), 500);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error_type"],
        "incomplete_generation"
    );
    let ol = start(SimKind::Ollama, &["m"], |c| c.speed(0.0)).await;
    set_fault(&c, &ol.url(), json!({"mode":"error_rate"})).await;
    let r = post_json(
        &c,
        format!("{}/api/chat", ol.url()),
        &json!({"model":"m","messages":[{"role":"user","content":"x"}]}),
    )
    .await;
    assert_eq!(r.status(), 500);
    assert!(r.json::<Value>().await.unwrap()["error"].is_string());
}

#[tokio::test]
async fn drop_midstream_cuts_the_connection_after_n_chunks() {
    let sim = start(SimKind::Vllm, &["m"], |c| c.speed(0.0)).await;
    let c = client();
    let url = sim.url();
    set_fault(&c, &url, json!({"mode":"drop_midstream","after_chunks":2})).await;
    let mut r = post_json(
        &c,
        format!("{url}/v1/chat/completions"),
        &chat_body(10, true),
    )
    .await;
    assert_eq!(r.status(), 200);
    let mut got = Vec::new();
    let err = loop {
        match r.chunk().await {
            Ok(Some(b)) => got.extend_from_slice(&b),
            Ok(None) => panic!("stream ended cleanly: {}", String::from_utf8_lossy(&got)),
            Err(e) => break e,
        }
    };
    assert!(
        err.is_body() || err.is_decode() || err.is_request(),
        "{err:?}"
    );
    let text = String::from_utf8(got).unwrap();
    assert_eq!(text.matches("data: ").count(), 2, "{text}");
    assert!(!text.contains("[DONE]"));
    // non-stream answers are unaffected
    assert_eq!(chat(&c, &url, 2).await.0, 200);
}

#[tokio::test]
async fn overloaded_gives_each_engines_own_answer() {
    let c = client();
    let v = start(SimKind::Vllm, &["m"], |c| c.speed(0.0)).await;
    set_fault(&c, &v.url(), json!({"mode":"overloaded"})).await;
    let (s, b) = chat(&c, &v.url(), 2).await;
    assert_eq!(s, 503);
    assert_eq!(
        serde_json::from_str::<Value>(&b).unwrap()["error"]["type"],
        "ServiceUnavailableError"
    );
    let t = start(SimKind::Tgi, &["m"], |c| c.speed(0.0)).await;
    set_fault(&c, &t.url(), json!({"mode":"overloaded"})).await;
    let (s, b) = chat(&c, &t.url(), 2).await;
    assert_eq!(
        (s, b.as_str()),
        (
            429,
            r#"{"error":"Model is overloaded","error_type":"overloaded"}"#
        )
    );
    let o = start(SimKind::Ollama, &["m"], |c| c.speed(0.0)).await;
    set_fault(&c, &o.url(), json!({"mode":"overloaded"})).await;
    let r = post_json(
        &c,
        format!("{}/api/generate", o.url()),
        &json!({"model":"m","prompt":"x"}),
    )
    .await;
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"error":"server busy, please try again.  maximum pending requests exceeded"}"#
    );
}

#[tokio::test]
async fn health_fail_keeps_inference_working() {
    let c = client();
    let v = start(SimKind::Vllm, &["m"], |c| c.speed(0.0)).await;
    set_fault(&c, &v.url(), json!({"mode":"health_fail"})).await;
    assert_eq!(health(&c, &v.url()).await, 503);
    assert_eq!(chat(&c, &v.url(), 2).await.0, 200);
    let t = start(SimKind::Tgi, &["m"], |c| c.speed(0.0)).await;
    set_fault(&c, &t.url(), json!({"mode":"health_fail"})).await;
    let r = c.get(format!("{}/health", t.url())).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"error":"unhealthy","error_type":"healthcheck"}"#
    );
    assert_eq!(chat(&c, &t.url(), 2).await.0, 200);
    let o = start(SimKind::Ollama, &["m"], |c| c.speed(0.0)).await;
    set_fault(&c, &o.url(), json!({"mode":"health_fail"})).await;
    assert_eq!(get_status(&c, format!("{}/", o.url())).await, 503);
}

#[tokio::test]
async fn loading_fails_then_recovers_by_itself() {
    let c = client();
    let v = start(SimKind::Vllm, &["m"], |c| c.speed(0.0)).await;
    set_fault(&c, &v.url(), json!({"mode":"loading","seconds":0.3})).await;
    assert_eq!(health(&c, &v.url()).await, 503);
    assert_eq!(chat(&c, &v.url(), 2).await.0, 503);
    let url = v.url();
    poll(Duration::from_secs(5), "healthy again", || {
        let c = c.clone();
        let url = url.clone();
        async move { (health(&c, &url).await == 200).then_some(()) }
    })
    .await;
    assert_eq!(chat(&c, &url, 2).await.0, 200);
    assert_eq!(state(&c, &url).await["mode"], "healthy");
}

#[tokio::test]
async fn loading_on_ollama_unloads_and_the_next_request_pays_the_load() {
    let c = client();
    let o = start(SimKind::Ollama, &["m"], |c| c.speed(0.0).preloaded(true)).await;
    let ps: Value = get_json(&c, format!("{}/api/ps", o.url())).await;
    assert_eq!(ps["models"].as_array().unwrap().len(), 1);
    set_fault(&c, &o.url(), json!({"mode":"loading","seconds":0.4})).await;
    let ps: Value = get_json(&c, format!("{}/api/ps", o.url())).await;
    assert_eq!(ps["models"], json!([]));
    let v: Value = post_for_json(
        &c,
        format!("{}/api/chat", o.url()),
        &json!({"model":"m","messages":[{"role":"user","content":"x"}],"stream":false}),
    )
    .await;
    assert!(v["load_duration"].as_u64().unwrap() >= 200_000_000, "{v}");
}

#[tokio::test]
async fn refuse_resets_new_connections_but_not_control() {
    let sim = start(SimKind::Vllm, &["m"], |c| c.speed(0.0)).await;
    let url = sim.url();
    let fresh = || {
        reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap()
    };
    let kept = client();
    assert_eq!(health(&kept, &url).await, 200);
    set_fault(&fresh(), &url, json!({"mode":"refuse"})).await;
    assert!(fresh().get(format!("{url}/health")).send().await.is_err());
    assert!(
        kept.get(format!("{url}/health")).send().await.is_err(),
        "kept-alive connections are closed too"
    );
    assert_eq!(state(&fresh(), &url).await["mode"], "refuse");
    set_fault(&fresh(), &url, json!({"mode":"healthy"})).await;
    assert_eq!(health(&fresh(), &url).await, 200);
}

#[tokio::test]
async fn faults_can_be_set_in_process() {
    let sim = start(SimKind::Vllm, &["m"], |c| c.speed(0.0)).await;
    sim.set_fault(Fault::mode(FaultMode::HealthFail)).unwrap();
    assert_eq!(health(&client(), &sim.url()).await, 503);
    assert_eq!(sim.state()["mode"], "health_fail");
    sim.set_fault(Fault::healthy()).unwrap();
    assert_eq!(health(&client(), &sim.url()).await, 200);
}
