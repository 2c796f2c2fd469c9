//! Ollama's Responses and Messages APIs: the Ollama sim answers `/v1/responses` and
//! `/v1/messages` as Ollama does (nothing stored, `previous_response_id` ignored, no calls by id,
//! no `count_tokens`), and the gateway forwards both natively to `ollama` backends, while a
//! request that needs a stored response never goes there (a clear error when nothing else
//! serves the model).

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use sluice::api::responses::ids;
use sluice::sim::{SimConfig, SimKind};
use support::*;

fn events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|b| !b.trim().is_empty())
        .map(|b| {
            let kind = b
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or_default()
                .to_string();
            let data = b
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .unwrap_or("null");
            (kind, serde_json::from_str(data).unwrap_or(Value::Null))
        })
        .collect()
}

fn is_sorted(keys: &[String]) -> bool {
    keys.windows(2).all(|w| w[0] <= w[1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ollama_sim_answers_responses_and_messages_as_ollama() {
    let sim = sim(SimKind::Ollama, &["olla"]).await;
    let c = client();
    let url = |p: &str| format!("{}{p}", sim.url());

    // Whole: Ollama's ids, store off, completed, usage; a previous id is ignored.
    let r = request::post_json(
        &c,
        url("/v1/responses"),
        &json!({"model":"olla","input":"Hello there","max_output_tokens":4,
                "previous_response_id":"resp_1","store":true,"background":true}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let id = v["id"].as_str().unwrap();
    assert!(
        id.strip_prefix("resp_").unwrap().parse::<u32>().is_ok(),
        "{v}"
    );
    assert_eq!(
        (
            &v["status"],
            &v["store"],
            &v["background"],
            &v["previous_response_id"]
        ),
        (
            &json!("completed"),
            &json!(false),
            &json!(true),
            &Value::Null
        )
    );
    assert_eq!(v["output"][0]["content"][0]["type"], "output_text");
    assert_eq!(v["usage"]["output_tokens"], 4);
    assert!(v["usage"]["input_tokens"].as_u64() > Some(0));
    assert!(v["completed_at"].is_u64());

    // Streamed: Go maps (sorted keys), the event sequence, usage on response.completed.
    let r = request::post_json(
        &c,
        url("/v1/responses"),
        &json!({"model":"olla","input":"Hello there","max_output_tokens":3,"stream":true}),
    )
    .await;
    assert_eq!(request::header(&r, "content-type"), "text/event-stream");
    let text = r.text().await.unwrap();
    let evs = events(&text);
    let kinds: Vec<&str> = evs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    for (i, (kind, data)) in evs.iter().enumerate() {
        assert_eq!(data["sequence_number"], i, "{kind}");
        assert_eq!(data["type"], kind.as_str());
    }
    for block in text.split("\n\n").filter(|b| !b.is_empty()) {
        let data = block.split_once("data: ").unwrap().1;
        let top: Vec<String> = serde_json::from_str::<serde_json::Map<String, Value>>(data)
            .unwrap()
            .keys()
            .cloned()
            .collect();
        assert!(is_sorted(&top), "{data}");
    }
    let done = &evs.last().unwrap().1["response"];
    assert_eq!(done["usage"]["output_tokens"], 3);
    assert_eq!(done["status"], "completed");
    assert!(sim::keys(&done.to_string()).len() > 20);

    // Nothing is stored: no calls by id at all (the router's 404); errors in OpenAI's shape.
    for (method, path) in [
        (reqwest::Method::GET, format!("/v1/responses/{id}")),
        (reqwest::Method::POST, format!("/v1/responses/{id}/cancel")),
        (reqwest::Method::DELETE, format!("/v1/responses/{id}")),
        (reqwest::Method::POST, "/v1/messages/count_tokens".into()),
    ] {
        let r = c.request(method, url(&path)).send().await.unwrap();
        assert_eq!(r.status(), 404, "{path}");
        assert_eq!(r.text().await.unwrap(), "404 page not found");
    }
    let r = request::post_json(
        &c,
        url("/v1/responses"),
        &json!({"model":"nope","input":"x"}),
    )
    .await;
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["message"], "model 'nope' not found");

    // Messages whole and streamed: estimate first, real counts in message_delta.
    let m = json!({"model":"olla","max_tokens":5,"system":"be brief",
                   "messages":[{"role":"user","content":"Hello there, how are you today?"}]});
    let v: Value = request::post_for_json(&c, url("/v1/messages"), &m).await;
    assert!(v["id"].as_str().unwrap().starts_with("msg_") && v["id"].as_str().unwrap().len() == 28);
    assert_eq!(
        (&v["type"], &v["stop_reason"]),
        (&json!("message"), &json!("max_tokens"))
    );
    assert_eq!(v["usage"]["output_tokens"], 5);
    assert!(v.get("stop_sequence").is_none());
    let real_input = v["usage"]["input_tokens"].as_u64().unwrap();
    let mut s = m.clone();
    s["stream"] = true.into();
    let text = request::post_json(&c, url("/v1/messages"), &s)
        .await
        .text()
        .await
        .unwrap();
    let evs = events(&text);
    let kinds: Vec<&str> = evs.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds.first(), Some(&"message_start"));
    assert_eq!(
        &kinds[kinds.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    assert!(!kinds.contains(&"ping"));
    let estimate = evs[0].1["message"]["usage"]["input_tokens"]
        .as_u64()
        .unwrap();
    // (len("be brief") + len("user") + len("Hello there, how are you today?")) / 4
    assert_eq!(estimate, (8 + 4 + 31) / 4);
    let delta = &evs[evs.len() - 2].1;
    assert_eq!(delta["usage"]["input_tokens"], real_input);
    assert_eq!(delta["usage"]["output_tokens"], 5);
    assert_eq!(delta["delta"], json!({"stop_reason":"max_tokens"}));

    // Messages errors: Anthropic's shape with a request id, in the middleware's order.
    for (body, status, message) in [
        (
            json!({"model":"olla","messages":[{"role":"user","content":"x"}]}),
            400,
            "max_tokens is required and must be positive",
        ),
        (
            json!({"max_tokens":3,"messages":[]}),
            400,
            "model is required",
        ),
        (
            json!({"model":"olla","max_tokens":3,"messages":[]}),
            400,
            "messages is required",
        ),
        (
            json!({"model":"nope","max_tokens":3,"messages":[{"role":"user","content":"x"}]}),
            404,
            "model 'nope' not found",
        ),
    ] {
        let r = request::post_json(&c, url("/v1/messages"), &body).await;
        assert_eq!(r.status(), status, "{body}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["message"], message);
        assert!(v["request_id"].as_str().unwrap().starts_with("req_"));
    }
}

/// An Ollama-only model, and a model served by Ollama and by a vLLM with the store on.
async fn fleet() -> (TestGateway, sluice::sim::SimHandle, sluice::sim::SimHandle) {
    let o = sim(SimKind::Ollama, &["olla", "both"]).await;
    let v = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["both".into()])
            .speed(0.0)
            .responses_store(true),
    )
    .await;
    let mut t = String::from(FAST_HEALTH);
    t.push_str(&backend("oll", "ollama", &o.url(), &["olla", "both"]));
    t.push_str(&backend("vll", "vllm", &v.url(), &["both"]));
    t.push_str("\n[routing]\npolicy = \"round-robin\"\n");
    (TestGateway::start_healthy(&t).await, o, v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_forwards_responses_and_messages_to_ollama_natively() {
    let (g, _o, _v) = fleet().await;
    let c = client();

    // Responses whole and streamed on the Ollama-only model: ids name the Ollama backend.
    let v: Value = request::post_for_json(
        &c,
        g.url("/v1/responses"),
        &json!({"model":"olla","input":"Hello there","max_output_tokens":4}),
    )
    .await;
    let id = v["id"].as_str().unwrap().to_string();
    assert!(ids::decode(&id).unwrap().held_by("oll"), "{id}");
    assert_eq!(v["usage"]["output_tokens"], 4);
    let text = request::post_json(
        &c,
        g.url("/v1/responses"),
        &json!({"model":"olla","input":"Hello there","max_output_tokens":3,"stream":true}),
    )
    .await
    .text()
    .await
    .unwrap();
    let evs = events(&text);
    assert_eq!(evs.last().unwrap().0, "response.completed", "{text}");
    let done = &evs.last().unwrap().1["response"];
    assert!(ids::decode(done["id"].as_str().unwrap())
        .unwrap()
        .held_by("oll"));
    assert_eq!(done["usage"]["output_tokens"], 3);

    // Messages whole and streamed through Ollama.
    let m =
        json!({"model":"olla","max_tokens":5,"messages":[{"role":"user","content":"Hi there"}]});
    let v: Value = request::post_for_json(&c, g.url("/v1/messages"), &m).await;
    assert_eq!(
        (&v["model"], &v["usage"]["output_tokens"]),
        (&json!("olla"), &json!(5))
    );
    let mut s = m.clone();
    s["stream"] = true.into();
    let text = request::post_json(&c, g.url("/v1/messages"), &s)
        .await
        .text()
        .await
        .unwrap();
    assert!(
        text.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
        "{text}"
    );

    // What Ollama lacks, answered by the gateway, never sent there.
    let before = g.attempts("oll");
    for (body, param) in [
        (json!({"model":"olla","input":"x","store":true}), "store"),
        (
            json!({"model":"olla","input":"x","background":true}),
            "background",
        ),
    ] {
        let r = request::post_json(&c, g.url("/v1/responses"), &body).await;
        assert_eq!(r.status(), 400, "{body}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(
            (&e["error"]["param"], &e["error"]["code"]),
            (&json!(param), &json!("store_not_supported"))
        );
        assert!(
            e["error"]["message"].as_str().unwrap().contains("(ollama)"),
            "{e}"
        );
    }
    let mut cont = json!({"model":"olla","input":"more"});
    cont["previous_response_id"] = id.clone().into();
    let r = request::post_json(&c, g.url("/v1/responses"), &cont).await;
    assert_eq!(r.status(), 404);
    let e: Value = r.json().await.unwrap();
    assert_eq!(e["error"]["code"], "response_not_stored", "{e}");
    for (method, path) in [
        (reqwest::Method::GET, format!("/v1/responses/{id}")),
        (reqwest::Method::POST, format!("/v1/responses/{id}/cancel")),
        (reqwest::Method::DELETE, format!("/v1/responses/{id}")),
    ] {
        let r = c.request(method, g.url(&path)).send().await.unwrap();
        assert_eq!(r.status(), 404, "{path}");
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], "response_not_stored", "{path}: {e}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains("`oll`"),
            "{e}"
        );
    }
    let r = request::post_json(
        &c,
        g.url("/v1/messages/count_tokens"),
        &json!({"model":"olla","messages":[{"role":"user","content":"x"}]}),
    )
    .await;
    assert_eq!(r.status(), 400, "Ollama has no count_tokens");
    assert_eq!(g.attempts("oll"), before, "nothing of this reached Ollama");

    // On the mixed model, what needs a store goes to the vLLM every time (round-robin would
    // alternate), and is then fetched there.
    for _ in 0..4 {
        let v: Value = request::post_for_json(
            &c,
            g.url("/v1/responses"),
            &json!({"model":"both","input":"x","store":true,"max_output_tokens":2}),
        )
        .await;
        let id = v["id"].as_str().unwrap();
        assert!(ids::decode(id).unwrap().held_by("vll"), "{id}");
        let r = c
            .get(g.url(&format!("/v1/responses/{id}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    // A plain request may go to either.
    let mut holders = std::collections::HashSet::new();
    for _ in 0..4 {
        let v: Value = request::post_for_json(
            &c,
            g.url("/v1/responses"),
            &json!({"model":"both","input":"x","max_output_tokens":2}),
        )
        .await;
        let d = ids::decode(v["id"].as_str().unwrap()).unwrap();
        holders.insert(if d.held_by("oll") { "oll" } else { "vll" });
    }
    assert_eq!(holders.len(), 2, "{holders:?}");

    // Usage from Ollama's answers is counted under both endpoints.
    eventually(Duration::from_secs(3), "ollama usage counted", || {
        let (c, url) = (c.clone(), g.admin_url("/metrics"));
        async move {
            let text = c.get(url).send().await.unwrap().text().await.unwrap();
            ["responses", "messages"].iter().all(|e| {
                text.lines().any(|l| {
                    l.starts_with("sluice_requests_total")
                        && l.contains(&format!("endpoint=\"{e}\""))
                        && l.contains("backend=\"oll\"")
                })
            })
        }
    })
    .await;
    g.stop().await;
}
