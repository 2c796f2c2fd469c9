//! Helpers shared by the simulator tests: raw HTTP, SSE parsing, fixtures.
#![allow(dead_code)]

use sluice::sim::{spawn, SimConfig, SimHandle, SimKind, Timing};

/// Start a simulator of `kind` serving `models`, customised by `f`.
pub async fn start(
    kind: SimKind,
    models: &[&str],
    f: impl FnOnce(SimConfig) -> SimConfig,
) -> SimHandle {
    let cfg = f(SimConfig::new(
        kind,
        models.iter().map(|m| m.to_string()).collect(),
    ));
    spawn(cfg).await.expect("spawn simulator")
}

/// The tests' one HTTP client.
pub use super::client;
pub use super::request::{get_json, get_status, get_text, post_for_json, post_json};

/// The body of a captured HTTP response in tests/fixtures.
pub fn fixture_body(name: &str) -> String {
    let path = format!(
        "{}/tests/fixtures/vllm-0.32.0/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let raw = std::fs::read_to_string(&path).expect("fixture");
    match raw.split_once("\r\n\r\n") {
        Some((_, body)) => body.to_string(),
        None => raw,
    }
}

/// Every object key of a JSON text, in document order (the "shape" of a body).
pub fn keys(json: &str) -> Vec<String> {
    let b = json.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'"' {
            let start = i + 1;
            let mut j = start;
            while j < b.len() && b[j] != b'"' {
                if b[j] == b'\\' {
                    j += 1;
                }
                j += 1;
            }
            let s = &json[start..j.min(b.len())];
            let mut k = j + 1;
            while k < b.len() && b[k] == b' ' {
                k += 1;
            }
            if k < b.len() && b[k] == b':' {
                out.push(s.to_string());
            }
            i = j + 1;
        } else {
            i += 1;
        }
    }
    out
}

/// Split an SSE body into its `data` payloads, checking the framing `prefix…\n\n`.
pub fn sse_payloads(raw: &str, prefix: &str) -> Vec<String> {
    assert!(
        raw.ends_with("\n\n"),
        "stream must end with a blank line: {raw:?}"
    );
    raw.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|ev| {
            assert!(
                ev.starts_with(prefix),
                "event {ev:?} must start with {prefix:?}"
            );
            assert!(!ev.contains('\n'), "one line per event: {ev:?}");
            ev[prefix.len()..].to_string()
        })
        .collect()
}

/// GET /sim/state as JSON.
pub async fn state(c: &reqwest::Client, url: &str) -> serde_json::Value {
    c.get(format!("{url}/sim/state"))
        .send()
        .await
        .expect("state")
        .json()
        .await
        .expect("state json")
}

/// POST /sim/fault.
pub async fn set_fault(
    c: &reqwest::Client,
    url: &str,
    body: serde_json::Value,
) -> reqwest::Response {
    c.post(format!("{url}/sim/fault"))
        .json(&body)
        .send()
        .await
        .expect("fault")
}

/// The engine the timing comparisons of `sluice plan` against a live simulator run: four
/// slots, so a modest load batches and queues.
pub fn comparison_timing() -> Timing {
    Timing {
        max_num_seqs: 4,
        kv_capacity_tokens: 1_000_000,
        prefill_per_token: std::time::Duration::from_micros(200),
        decode_base: std::time::Duration::from_millis(15),
        decode_per_seq: std::time::Duration::from_millis(2),
        ..Timing::default()
    }
}
