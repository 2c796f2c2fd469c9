//! `[[passthrough]]` rules end to end: a path under `/v1/` no client API serves is forwarded
//! as it is (path, query, body; the model field renamed for the backend) when a rule names it,
//! routed by the body's model or to a named group of backends, with auth, allow-lists, the
//! body cap, request limits, usage and metrics; without a rule it stays the 404; `sluice
//! check` reports a bad rule with its line.

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use support::*;

fn key_block(name: &str, extra: &str) -> (String, String) {
    let (key, hash) = sluice::auth::mint();
    let block =
        format!("\n[[keys]]\nname = \"{name}\"\ntenant = \"pt\"\nhash = \"{hash}\"\n{extra}\n");
    (key, block)
}

async fn send(
    c: &reqwest::Client,
    method: reqwest::Method,
    url: String,
    key: &str,
    body: Option<Value>,
) -> reqwest::Response {
    let mut r = c.request(method, url).bearer_auth(key);
    if let Some(b) = body {
        r = r.json(&b);
    }
    r.send().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rules_route_by_model_or_to_a_group_with_auth_and_limits() {
    let a = ScriptedBackend::start(
        200,
        vec![("content-type", "application/json".into())],
        r#"{"label":"positive","usage":{"prompt_tokens":7,"completion_tokens":0,"total_tokens":7}}"#
            .into(),
    )
    .await;
    let b = ScriptedBackend::start(
        200,
        vec![("content-type", "text/plain".into())],
        "file contents".into(),
    )
    .await;
    let (key, k1) = key_block("pt-open", "requests_per_minute = 6");
    let (narrow, k2) = key_block("pt-narrow", "models = [\"cls-m\"]");
    let mut t = String::from(FAST_HEALTH);
    t.push_str("[server]\nmax_body_bytes = 4096\n");
    t.push_str(&backend("pt-a", "openai", &a.url(), &["cls-m"]));
    t.push_str("model_names = { \"cls-m\" = \"cls-on-a\" }\n");
    t.push_str(&backend("pt-b", "openai", &b.url(), &["other-m"]));
    t.push_str("\n[[groups]]\nname = \"files\"\nbackends = [\"pt-b\"]\n");
    t.push_str("\n[[passthrough]]\nprefix = \"/v1/classify\"\nmodel_field = \"model\"\n");
    t.push_str(
        "\n[[passthrough]]\nprefix = \"/v1/files\"\ngroup = \"files\"\nmethods = [\"GET\", \"POST\"]\n",
    );
    t.push_str(&k1);
    t.push_str(&k2);
    let g = TestGateway::start_healthy(&t).await;
    let c = client();
    let post = reqwest::Method::POST;

    // Routed by model: path, query and body as sent, the model renamed for the backend, the
    // answer as it came, usage counted.
    let r = send(
        &c,
        post.clone(),
        g.url("/v1/classify/sentiment?top_k=2"),
        &key,
        Some(json!({"model":"cls-m","text":"great"})),
    )
    .await;
    assert_eq!(r.status(), 200);
    assert!(!header(&r, "x-ratelimit-remaining-requests").is_empty());
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["label"], "positive");
    let seen = a.inference_requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        (seen[0].path.as_str(), seen[0].query.as_deref()),
        ("/v1/classify/sentiment", Some("top_k=2"))
    );
    let sent: Value = serde_json::from_slice(&seen[0].body).unwrap();
    assert_eq!(sent, json!({"model":"cls-on-a","text":"great"}));
    assert!(
        seen[0].headers.get("authorization").is_none(),
        "the client's key stays here"
    );

    // To a group: any method the rule lists, no model needed.
    let r = send(&c, reqwest::Method::GET, g.url("/v1/files/f-1"), &key, None).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "file contents");
    assert_eq!(b.inference_requests()[0].path, "/v1/files/f-1");
    assert_eq!(b.inference_requests()[0].method, reqwest::Method::GET);

    // What a rule does not name stays as today.
    let r = send(&c, post.clone(), g.url("/v1/nope"), &key, Some(json!({}))).await;
    assert_eq!(r.status(), 404);
    let r = send(&c, reqwest::Method::GET, g.url("/v1/classify"), &key, None).await;
    assert_eq!(r.status(), 405, "GET is not a method of the classify rule");

    // Bad inputs, each refused before any backend sees it.
    let before = a.inference_requests().len();
    for (body, status, param) in [
        (json!({"text":"x"}), 400, Some("model")),
        (json!({"model":7}), 400, Some("model")),
        (json!({"model":"nope-m"}), 404, None),
        (json!({"model":"cls-m","pad":"x".repeat(5000)}), 413, None),
    ] {
        let r = send(&c, post.clone(), g.url("/v1/classify"), &key, Some(body)).await;
        assert_eq!(r.status(), status);
        let e: Value = r.json().await.unwrap();
        if let Some(p) = param {
            assert_eq!(e["error"]["param"], p, "{e}");
        }
    }
    let r = c
        .post(g.url("/v1/classify"))
        .body("not json")
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = c
        .post(g.url("/v1/classify"))
        .json(&json!({"model":"cls-m"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "auth applies");
    let r = send(
        &c,
        post.clone(),
        g.url("/v1/classify"),
        &narrow,
        Some(json!({"model":"other-m"})),
    )
    .await;
    assert_eq!(r.status(), 403, "the key's allow-list applies");
    let r = send(
        &c,
        reqwest::Method::GET,
        g.url("/v1/files/x"),
        &narrow,
        None,
    )
    .await;
    assert_eq!(
        r.status(),
        403,
        "a key limited to models cannot use a group rule"
    );
    assert_eq!(a.inference_requests().len(), before);

    // The key's request limit (6 a minute) counts pass-through requests like any other: two
    // were admitted above (the refused ones were refused before admission).
    let mut codes = Vec::new();
    for _ in 0..6 {
        let r = send(&c, reqwest::Method::GET, g.url("/v1/files/y"), &key, None).await;
        codes.push(r.status().as_u16());
    }
    assert_eq!(codes, [200, 200, 200, 200, 429, 429]);

    // Usage and metrics under the `passthrough` endpoint.
    eventually(Duration::from_secs(3), "usage counted", || {
        let (c, url) = (c.clone(), g.admin_url("/admin/usage"));
        async move {
            let v: Value = c.get(url).send().await.unwrap().json().await.unwrap();
            v["rows"].as_array().is_some_and(|rows| {
                rows.iter()
                    .any(|r| r["backend"] == "pt-a" && r["prompt_tokens"].as_u64() == Some(7))
            })
        }
    })
    .await;
    let metrics = g.metrics_text().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("sluice_requests_total")
                && l.contains("endpoint=\"passthrough\"")
                && l.contains("backend=\"pt-b\"")),
        "{metrics}"
    );
    g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_backend_is_failed_over_before_the_first_byte() {
    let busy = ScriptedBackend::start(503, vec![], "{\"error\":\"busy\"}".into()).await;
    let ok = ScriptedBackend::start(
        200,
        vec![("content-type", "application/json".into())],
        "{\"ok\":true}".into(),
    )
    .await;
    let mut t = String::from(FAST_HEALTH);
    t.push_str(&backend("fo-busy", "openai", &busy.url(), &["fo-m"]));
    t.push_str(&backend("fo-ok", "openai", &ok.url(), &["fo-m"]));
    t.push_str("\n[routing]\npolicy = \"round-robin\"\n");
    t.push_str("\n[[passthrough]]\nprefix = \"/v1/fo\"\nmodel_field = \"engine\"\n");
    let g = TestGateway::start_healthy(&t).await;
    let c = client();
    for _ in 0..4 {
        let r = request::post_json(&c, g.url("/v1/fo"), &json!({"engine":"fo-m"})).await;
        assert_eq!(r.status(), 200, "a busy backend is failed over");
    }
    assert_eq!(ok.inference_requests().len(), 4);
    let sent: Value = serde_json::from_slice(&ok.inference_requests()[0].body).unwrap();
    assert_eq!(sent["engine"], "fo-m");
    g.stop().await;
}

#[tokio::test]
async fn check_reports_a_bad_rule_with_its_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(
        &path,
        "[[backends]]\nname = \"a\"\nkind = \"openai\"\nurl = \"http://127.0.0.1:1\"\n\n[[passthrough]]\nprefix = \"/api/x\"\ngroup = \"missing\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("passthrough[0].prefix: `/api/x` is not under /v1/"),
        "{text}"
    );
    assert!(text.contains("(line 7)"), "{text}");
    assert!(
        text.contains("passthrough[0].group: no [[groups]] entry is named `missing`"),
        "{text}"
    );
    assert!(text.contains("(line 8)"), "{text}");
}
