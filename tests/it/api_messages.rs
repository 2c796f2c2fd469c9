//! The Anthropic Messages API through the gateway, driven by the official `anthropic` Python SDK
//! (tests/python/gateway_anthropic_sdk.py): messages.create, messages.stream,
//! messages.count_tokens, NotFoundError for an unknown model, AuthenticationError for a wrong
//! key, a model only TGI serves answered by translation and BadRequestError naming a field it
//! cannot carry, an error raised for a stream cut
//! mid-way, RateLimitError for a key over its token limit; then the usage in /admin/usage.
//! Plus raw-HTTP checks of the Anthropic error shape on the gateway's own refusals.
//!
//! Without a Python that has `anthropic` the SDK test says SKIP and passes, except under CI.

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};

use sluice::sim::{Fault, FaultMode, SimKind};
use support::process::{python_checks, python_with};
use support::*;

fn key_block(name: &str, tenant: &str, extra: &str) -> (String, String) {
    let (key, hash) = sluice::auth::mint();
    let block = format!(
        "\n[[keys]]\nname = \"{name}\"\ntenant = \"{tenant}\"\nhash = \"{hash}\"\n{extra}\n"
    );
    (key, block)
}

/// A fleet: a vLLM sim for `claude-local` (alias of `msg-model`), a vLLM sim that cuts streams,
/// a TGI sim serving a model only translation serves; two keys, one with a small token limit.
async fn fleet() -> (TestGateway, String, String, Vec<sluice::sim::SimHandle>) {
    let a = sim(SimKind::Vllm, &["msg-model"]).await;
    let cut = sim(SimKind::Vllm, &["msg-cut"]).await;
    let mut fault = Fault::mode(FaultMode::DropMidstream);
    fault.after_chunks = 3;
    cut.set_fault(fault).unwrap();
    let tgi = sim(SimKind::Tgi, &["msg-tgi-only"]).await;
    let (key, kb) = key_block("msg-user", "msg-team", "tokens_per_minute = 100000");
    let (limited, lb) = key_block("msg-limited", "msg-limited-team", "tokens_per_minute = 80");
    let mut t = String::from(FAST_HEALTH);
    t.push_str("\n[server]\nmax_body_bytes = 65536\n");
    t.push_str("\n[[models]]\nname = \"msg-model\"\naliases = [\"claude-local\"]\n");
    t.push_str(&backend("msg-gpu", "vllm", &a.url(), &["msg-model"]));
    t.push_str(&backend("msg-cutter", "vllm", &cut.url(), &["msg-cut"]));
    t.push_str(&backend("msg-tgi", "tgi", &tgi.url(), &["msg-tgi-only"]));
    t.push_str(&kb);
    t.push_str(&lb);
    let g = TestGateway::start_healthy(&t).await;
    (g, key, limited, vec![a, cut, tgi])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_python_sdk_end_to_end() {
    let Some(python) = python_with(&["anthropic"]) else {
        return;
    };
    let (g, key, limited, _sims) = fleet().await;
    let base = g.url("");
    python_checks(
        python,
        "gateway_anthropic_sdk.py",
        vec![
            ("SLUICE_BASE_URL", base),
            ("SLUICE_KEY", key),
            ("SLUICE_LIMITED_KEY", limited),
            ("SLUICE_MODEL", "claude-local".to_string()),
            ("SLUICE_CUT_MODEL", "msg-cut".to_string()),
            ("SLUICE_TGI_MODEL", "msg-tgi-only".to_string()),
        ],
    )
    .await;

    // The Messages requests were counted for the key's tenant, from the backend's usage.
    let c = client();
    let gw = &g;
    support::eventually(Duration::from_secs(3), "messages usage counted", || {
        let c = c.clone();
        async move {
            let v = support::request::get_json(&c, gw.admin_url("/admin/usage")).await;
            let t = &v["tenants"]["msg-team"];
            t["requests"].as_u64().unwrap_or(0) >= 2 && t["total_tokens"].as_u64().unwrap_or(0) > 11
        }
    })
    .await;
    let metrics = support::request::get_text(&c, g.admin_url("/metrics")).await;
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("endpoint=\"messages\"") && l.contains("msg-")),
        "no messages-labelled series"
    );
    g.stop().await;
}

/// Sluice's own refusals on /v1/messages, read raw: status, Anthropic's shape and type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_errors_are_anthropic_shaped() {
    let (g, key, _limited, _sims) = fleet().await;
    let c = client();
    let body = |model: &str| {
        serde_json::json!({"model": model, "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}]})
    };
    let cases: Vec<(Option<&str>, serde_json::Value, u16, &str)> = vec![
        (None, body("claude-local"), 401, "authentication_error"),
        (
            Some("sk-sluice-wrong"),
            body("claude-local"),
            401,
            "authentication_error",
        ),
        (Some(&key), body("no-such-model"), 404, "not_found_error"),
        // Served by translation, except what cannot be translated (named in the message).
        (
            Some(&key),
            {
                let mut b = body("msg-tgi-only");
                b["top_k"] = 5.into();
                b
            },
            400,
            "invalid_request_error",
        ),
        (
            Some(&key),
            serde_json::json!({"model": 5}),
            400,
            "invalid_request_error",
        ),
    ];
    for (k, b, status, kind) in cases {
        let mut req = c
            .post(g.url("/v1/messages"))
            .header("anthropic-version", "2023-06-01")
            .json(&b);
        if let Some(k) = k {
            req = req.header("x-api-key", k);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{b}");
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], kind, "{v}");
    }
    // Too large a body: 413 request_too_large.
    let huge = "x".repeat(100 * 1024);
    let r = c
        .post(g.url("/v1/messages"))
        .header("x-api-key", &key)
        .json(
            &serde_json::json!({"model": "claude-local", "max_tokens": 5,
            "messages": [{"role": "user", "content": huge}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "request_too_large", "{v}");
    // A stream cut mid-way ends with Anthropic's typed error event (what the SDK raises on).
    let text = c
        .post(g.url("/v1/messages"))
        .header("x-api-key", &key)
        .json(
            &serde_json::json!({"model": "msg-cut", "max_tokens": 50, "stream": true,
            "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.starts_with("event: message_start\n"), "{text}");
    let last = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
    let data = last.strip_prefix("event: error\ndata: ").expect(&text);
    let v: serde_json::Value = serde_json::from_str(data).unwrap();
    assert_eq!(
        (v["type"].as_str(), v["error"]["type"].as_str()),
        (Some("error"), Some("api_error"))
    );
    // count_tokens routed by model: the engine's count comes back.
    let r = c
        .post(g.url("/v1/messages/count_tokens"))
        .header("x-api-key", &key)
        .json(&serde_json::json!({"model": "claude-local",
            "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert!(v["input_tokens"].as_u64().unwrap_or(0) > 0, "{v}");
    g.stop().await;
}

/// `count_tokens` for a model only TGI serves (no engine counts Messages there): with the
/// model's tokenizer configured, the gateway counts as vLLM does — the request as the chat it
/// becomes, through the chat template — and answers in vLLM's shape; a request the template
/// or the translation refuses is a 400 naming why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn count_tokens_for_a_model_no_engine_counts_comes_from_its_tokenizer() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer/tiny-tools");
    let tgi = sim(SimKind::Tgi, &["tok-tgi"]).await;
    let mut t = String::from(FAST_HEALTH);
    t.push_str(&format!(
        "\n[[models]]\nname = \"tok-tgi\"\ntokenizer = \"{}\"\n",
        dir.display()
    ));
    t.push_str(&backend("tok-tgi-b", "tgi", &tgi.url(), &["tok-tgi"]));
    let g = TestGateway::start_healthy(&t).await;
    let req = json!({"model": "tok-tgi", "system": "Be brief.",
        "messages": [{"role": "user", "content": "How many tokens is this?"}]});
    let r = client()
        .post(g.url("/v1/messages/count_tokens"))
        .json(&req)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let tokenizer = sluice::tokenizer::Tokenizer::load(&dir).unwrap();
    let chat = json!({"model": "tok-tgi", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "How many tokens is this?"}]});
    let n = tokenizer
        .chat_ids(&serde_json::to_vec(&chat).unwrap())
        .unwrap()
        .len();
    assert_eq!(
        v,
        json!({"input_tokens": n, "context_management": {"original_input_tokens": n}})
    );
    // what cannot be translated is refused, in the Messages API's error shape
    let r = client()
        .post(g.url("/v1/messages/count_tokens"))
        .json(&json!({"model": "tok-tgi", "top_k": 3, "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error", "{v}");
    g.stop().await;
}
