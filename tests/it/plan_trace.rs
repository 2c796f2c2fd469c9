//! The workload trace (`[trace]`): one line per answered request with counts and the
//! shared-prefix fingerprint and never any text, readable by `sluice plan` (optionally scaled).

use std::time::Duration;

use serde_json::json;
use sluice::sim::SimKind;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_has_counts_and_fingerprints_and_no_text() {
    let sim = sim(SimKind::Vllm, &["m"]).await;
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("trace.jsonl");
    let toml = format!(
        "[trace]\npath = {:?}\n{FAST_HEALTH}{}",
        path.to_str().expect("utf-8"),
        backend("a", "vllm", &sim.url(), &["m"])
    );
    let gw = TestGateway::start_healthy(&toml).await;
    let system = "You are Zanzibar, the secret keeper. ".repeat(40);
    let mut answers = Vec::new();
    for i in 0..3 {
        let body = json!({"model": "m", "max_tokens": 12, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": format!("quokka question number {i}")}]});
        let r = gw.chat(&body).await;
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.expect("json");
        answers.push(
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or("")
                .to_string(),
        );
    }
    let text = poll(Duration::from_secs(10), "three trace lines", || {
        let path = path.clone();
        async move {
            let t = std::fs::read_to_string(&path).unwrap_or_default();
            (t.lines().count() >= 3).then_some(t)
        }
    })
    .await;
    for secret in ["Zanzibar", "secret", "quokka", "question"] {
        assert!(!text.contains(secret), "prompt text in the trace: {text}");
    }
    for a in answers.iter().filter(|a| a.len() > 8) {
        assert!(
            !text.contains(a.as_str()),
            "answer text in the trace: {text}"
        );
    }
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    for l in &lines {
        assert_eq!(l["model"], "m");
        assert_eq!(l["api"], "/v1/chat/completions");
        assert!(l["prompt_tokens"].as_u64().unwrap_or(0) > 100, "{l}");
        assert!(l["completion_tokens"].as_u64().unwrap_or(0) > 0, "{l}");
        assert!(l["ts"].as_f64().unwrap_or(0.0) > 1.6e9, "{l}");
    }
    let prefixes: Vec<&serde_json::Value> = lines.iter().map(|l| &l["prefix"]).collect();
    assert!(
        prefixes[0].is_string(),
        "the shared system prompt has a fingerprint: {text}"
    );
    assert!(
        prefixes.iter().all(|p| *p == prefixes[0]),
        "the same one: {text}"
    );

    let reqs = sluice::plan::workload::read_trace(&text, Some("m")).expect("the planner reads it");
    assert_eq!(reqs.len(), 3);
    assert!(reqs.iter().all(|r| r.prefix.is_some_and(|p| p.1 > 0)));
    assert_eq!(sluice::plan::workload::scale(&reqs, 3.0, 1).len(), 9);
    gw.stop().await;
}

#[test]
fn an_empty_trace_path_is_a_config_error() {
    let toml = "[trace]\npath = \"\"\n";
    let err = sluice::config::from_str(toml, "test")
        .map(|_| ())
        .expect_err("rejected");
    assert!(format!("{err:?}").contains("trace.path"), "{err:?}");
}
