//! The Responses API through the gateway: `POST /v1/responses` whole and streamed in front of
//! vLLM sims, stored responses reached through any replica (ids name their backend), the
//! clear errors for a holder that is down or gone, limits, usage, and the OpenAI Python SDK
//! (tests/python/gateway_responses_sdk.py) driving it all, mid-stream failure included.

use crate::support;

use std::time::Duration;

use sluice::api::responses::ids;
use sluice::sim::{Fault, FaultMode, SimConfig, SimHandle, SimKind};
use support::process::{python_checks, python_with};
use support::*;

fn body(model: &str, stream: bool, max: u32) -> serde_json::Value {
    serde_json::json!({"model": model, "input": "Hello there, how are you?", "stream": stream,
        "max_output_tokens": max})
}

async fn post(c: &reqwest::Client, url: String, body: &serde_json::Value) -> reqwest::Response {
    c.post(url).json(body).send().await.unwrap()
}

/// A vLLM sim with the response store on; `speed` 1.0 is real timing (background responses
/// are still running when cancelled).
async fn store_sim(model: &str, speed: f64) -> SimHandle {
    sim_with(
        SimConfig::new(SimKind::Vllm, vec![model.into()])
            .speed(speed)
            .responses_store(true)
            .output_tokens(400, 400),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_and_streamed_natively_with_ids_usage_and_metrics() {
    let v = store_sim("resp-m", 0.0).await;
    let tgi = sim(SimKind::Tgi, &["resp-tgi-only"]).await;
    let mut t = String::from(FAST_HEALTH);
    t.push_str(&backend("resp-vllm", "vllm", &v.url(), &["resp-m"]));
    t.push_str("model_names = { \"resp-m\" = \"resp-m\" }\n");
    t.push_str(&backend(
        "resp-tgi",
        "tgi",
        &tgi.url(),
        &["resp-m", "resp-tgi-only"],
    ));
    let g = TestGateway::start_healthy(&t).await;
    let c = client();

    // Whole: the id names the vLLM backend (native is preferred over the translating TGI),
    // usage is read.
    for _ in 0..4 {
        let r = post(&c, g.url("/v1/responses"), &body("resp-m", false, 5)).await;
        assert_eq!(r.status(), 200);
        let v: serde_json::Value = r.json().await.unwrap();
        let id = v["id"].as_str().unwrap();
        let d = ids::decode(id).unwrap_or_else(|| panic!("{id}"));
        assert!(d.held_by("resp-vllm") && d.created_by("anonymous"), "{id}");
        assert_eq!(v["model"], "resp-m");
        assert_eq!(v["usage"]["output_tokens"], 5);
    }

    // Streamed: typed events kept, the response id rewritten in every lifecycle event, no
    // `[DONE]`.
    let r = post(&c, g.url("/v1/responses"), &body("resp-m", true, 6)).await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(
        text.starts_with("event: response.created\ndata: "),
        "{text}"
    );
    assert!(
        text.contains("event: response.output_text.delta\n"),
        "{text}"
    );
    assert!(!text.contains("[DONE]"), "{text}");
    let lifecycle: Vec<serde_json::Value> = sse_data(&text)
        .iter()
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter(|e| e.get("response").is_some())
        .collect();
    assert!(lifecycle.len() >= 3, "{text}");
    let first = lifecycle[0]["response"]["id"].as_str().unwrap().to_string();
    assert!(ids::decode(&first).unwrap().held_by("resp-vllm"));
    for e in &lifecycle {
        assert_eq!(e["response"]["id"], first.as_str(), "{e}");
    }
    let last = lifecycle.last().unwrap();
    assert_eq!(last["response"]["usage"]["output_tokens"], 6);

    // A model only backends without the API serve is answered by translation: not stored, so
    // its id names no backend.
    let r = post(&c, g.url("/v1/responses"), &body("resp-tgi-only", false, 5)).await;
    assert_eq!(r.status(), 200);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["usage"]["output_tokens"], 5, "{v}");
    assert!(ids::decode(v["id"].as_str().unwrap()).is_none(), "{v}");

    // An id Sluice did not issue: vLLM's unknown-id shape, from no backend.
    let r = c
        .get(g.url("/v1/responses/resp_doesnotexist"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["param"], "response_id");
    assert_eq!(v["error"]["type"], "invalid_request_error");

    // Usage and metrics under the `responses` endpoint.
    eventually(Duration::from_secs(3), "usage counted", || {
        let (c, url) = (c.clone(), g.url("/admin/usage"));
        async move {
            let v: serde_json::Value = c.get(url).send().await.unwrap().json().await.unwrap();
            v["rows"].as_array().is_some_and(|rows| {
                rows.iter().any(|r| {
                    r["backend"] == "resp-vllm" && r["completion_tokens"].as_u64() >= Some(26)
                })
            })
        }
    })
    .await;
    let metrics = g.metrics_text().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("sluice_requests_total")
                && l.contains("endpoint=\"responses\"")
                && l.contains("backend=\"resp-vllm\"")),
        "{metrics}"
    );
    g.stop().await;
}

/// Three store sims, two gateway replicas with the same config: everything created through
/// one is reached through the other; then the holder is killed, then removed from the fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_responses_on_any_replica_then_holder_down_and_gone() {
    let sims = [
        store_sim("store-m", 1.0).await,
        store_sim("store-m", 1.0).await,
        store_sim("store-m", 1.0).await,
    ];
    let mut t = String::from(FAST_HEALTH);
    for (i, s) in sims.iter().enumerate() {
        t.push_str(&backend(
            &format!("store-{i}"),
            "vllm",
            &s.url(),
            &["store-m"],
        ));
    }
    t.push_str("\n[routing]\npolicy = \"round-robin\"\n");
    let g1 = TestGateway::start_healthy(&t).await;
    let g2 = TestGateway::start_healthy(&t).await;
    let c = client();
    let mut holders = std::collections::HashSet::new();
    let mut last_id = String::new();
    for i in 0..50 {
        let r = post(&c, g1.url("/v1/responses"), &body("store-m", false, 2)).await;
        assert_eq!(r.status(), 200, "create {i}");
        let v: serde_json::Value = r.json().await.unwrap();
        let id = v["id"].as_str().unwrap().to_string();
        let r = c
            .get(g2.url(&format!("/v1/responses/{id}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "retrieve {i}");
        let got: serde_json::Value = r.json().await.unwrap();
        assert_eq!(got["id"], id.as_str());
        let mut next = body("store-m", false, 2);
        next["previous_response_id"] = id.clone().into();
        let r = post(&c, g2.url("/v1/responses"), &next).await;
        assert_eq!(r.status(), 200, "continue {i}");
        let cont: serde_json::Value = r.json().await.unwrap();
        assert_eq!(cont["previous_response_id"], id.as_str());
        let cont_id = cont["id"].as_str().unwrap();
        let holder = |id: &str| ids::decode(id).unwrap().backend_tag.to_string();
        assert_eq!(holder(cont_id), holder(&id), "continued on its holder");
        holders.insert(holder(&id));
        let mut bg = body("store-m", false, 400);
        bg["background"] = true.into();
        let r = post(&c, g1.url("/v1/responses"), &bg).await;
        assert_eq!(r.status(), 200, "background {i}");
        let bg: serde_json::Value = r.json().await.unwrap();
        let bg_id = bg["id"].as_str().unwrap();
        let r = c
            .post(g2.url(&format!("/v1/responses/{bg_id}/cancel")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "cancel {i}");
        let cancelled: serde_json::Value = r.json().await.unwrap();
        assert_eq!(cancelled["status"], "cancelled");
        assert_eq!(cancelled["id"], bg_id);
        last_id = id;
    }
    assert_eq!(holders.len(), 3, "round robin spread the responses");

    // vLLM 0.32 has no DELETE: its own 405 is passed on.
    let r = c
        .delete(g2.url(&format!("/v1/responses/{last_id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);

    // The holder is killed: 503, naming that its backend is unavailable, on both replicas.
    let holder_idx = (0..3)
        .find(|i| {
            ids::decode(&last_id)
                .unwrap()
                .held_by(&format!("store-{i}"))
        })
        .unwrap();
    let [a, b, c3] = sims;
    let mut remaining = Vec::new();
    for (i, s) in [a, b, c3].into_iter().enumerate() {
        if i == holder_idx {
            s.shutdown().await;
        } else {
            remaining.push(s);
        }
    }
    for g in [&g1, &g2] {
        let r = c
            .get(g.url(&format!("/v1/responses/{last_id}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 503);
        assert!(r.headers().contains_key("retry-after"));
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "response_backend_unavailable", "{v}");
        let mut next = body("store-m", false, 2);
        next["previous_response_id"] = last_id.clone().into();
        let r = post(&c, g.url("/v1/responses"), &next).await;
        assert_eq!(r.status(), 503, "a pinned request does not fail over");
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "response_backend_unavailable", "{v}");
    }

    // A replica whose config no longer has that backend: the response is gone with it.
    let mut t = String::from(FAST_HEALTH);
    for (i, s) in (0..3).filter(|i| *i != holder_idx).zip(&remaining) {
        t.push_str(&backend(
            &format!("store-{i}"),
            "vllm",
            &s.url(),
            &["store-m"],
        ));
    }
    let g3 = TestGateway::start_healthy(&t).await;
    let r = c
        .get(g3.url(&format!("/v1/responses/{last_id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "response_backend_gone", "{v}");
    assert_eq!(v["error"]["param"], "response_id");
    for g in [g1, g2, g3] {
        g.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated_and_token_limits_stop_responses_clients() {
    let v = store_sim("tenant-m", 0.0).await;
    let (key_a, hash_a) = sluice::auth::mint();
    let (key_b, hash_b) = sluice::auth::mint();
    let mut t = backend("tenant-vllm", "vllm", &v.url(), &["tenant-m"]);
    t.push_str(&format!(
        "\n[[keys]]\nname = \"a\"\ntenant = \"ta\"\nhash = \"{hash_a}\"\ntokens_per_minute = 200\n"
    ));
    t.push_str(&format!(
        "\n[[keys]]\nname = \"b\"\ntenant = \"tb\"\nhash = \"{hash_b}\"\n"
    ));
    let g = TestGateway::start_healthy(&t).await;
    let c = client();
    let send = |key: &str, b: serde_json::Value| {
        c.post(g.url("/v1/responses"))
            .bearer_auth(key)
            .json(&b)
            .send()
    };
    let r = send(&key_b, body("tenant-m", false, 3)).await.unwrap();
    assert_eq!(r.status(), 200);
    let id = r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    // Tenant A cannot read or continue tenant B's response: the unknown-id 404.
    let r = c
        .get(g.url(&format!("/v1/responses/{id}")))
        .bearer_auth(&key_a)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let mut next = body("tenant-m", false, 3);
    next["previous_response_id"] = id.clone().into();
    assert_eq!(send(&key_a, next.clone()).await.unwrap().status(), 404);
    assert_eq!(send(&key_b, next).await.unwrap().status(), 200);
    let r = c
        .get(g.url(&format!("/v1/responses/{id}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "no key, no answer");

    // A token limit: the reservation is the input estimate + max_output_tokens.
    let r = send(&key_a, body("tenant-m", false, 150)).await.unwrap();
    assert_eq!(r.status(), 200);
    let r = send(&key_a, body("tenant-m", true, 150)).await.unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "tokens", "{v}");
    g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_responses_end_to_end() {
    let Some(python) = python_with(&["openai"]) else {
        return;
    };
    let sims = [store_sim("sdk-m", 1.0).await, store_sim("sdk-m", 1.0).await];
    let cut = store_sim("sdk-cut", 1.0).await;
    let mut fault = Fault::mode(FaultMode::DropMidstream);
    fault.after_chunks = 3;
    cut.set_fault(fault).unwrap();
    let mut t = String::from(FAST_HEALTH);
    for (i, s) in sims.iter().enumerate() {
        t.push_str(&backend(&format!("sdk-{i}"), "vllm", &s.url(), &["sdk-m"]));
    }
    t.push_str(&backend("sdk-cut", "vllm", &cut.url(), &["sdk-cut"]));
    let g1 = TestGateway::start_healthy(&t).await;
    let g2 = TestGateway::start_healthy(&t).await;
    let (base1, base2) = (g1.url("/v1"), g2.url("/v1"));
    python_checks(
        python,
        "gateway_responses_sdk.py",
        vec![
            ("SLUICE_BASE_URL", base1),
            ("SLUICE_BASE_URL_2", base2),
            ("SLUICE_MODEL", "sdk-m".to_string()),
            ("SLUICE_CUT_MODEL", "sdk-cut".to_string()),
        ],
    )
    .await;
    g1.stop().await;
    g2.stop().await;
}

/// A backend that answers busy before the first byte: the Responses request goes to the
/// other one, as a chat request would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_before_the_first_byte() {
    let busy = store_sim("fo-m", 0.0).await;
    busy.set_fault(Fault::mode(FaultMode::Overloaded)).unwrap();
    let good = store_sim("fo-m", 0.0).await;
    let mut t = backend("fo-busy", "vllm", &busy.url(), &["fo-m"]);
    t.push_str(&backend("fo-good", "vllm", &good.url(), &["fo-m"]));
    t.push_str("\n[routing]\npolicy = \"round-robin\"\nmax_attempts = 2\n");
    let g = TestGateway::start(&t).await;
    let c = client();
    for stream in [false, true, false, true] {
        let r = post(&c, g.url("/v1/responses"), &body("fo-m", stream, 3)).await;
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        assert!(text.contains("\"output_tokens\":3"), "{text}");
        let id_at = text.find("\"id\":\"resp_").unwrap() + 6;
        let id: String = text[id_at..].chars().take_while(|c| *c != '"').collect();
        assert!(ids::decode(&id).unwrap().held_by("fo-good"), "{id}");
    }
    let failovers = metric(
        &g.metrics_text().await,
        "sluice_failovers_total{model=\"fo-m\"}",
    );
    assert!(
        failovers >= 1.0,
        "round robin picked the busy backend once at least"
    );
    g.stop().await;
}
