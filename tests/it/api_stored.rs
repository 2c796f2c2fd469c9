//! Calls on a stored response by its id through the gateway: the query string reaches the
//! holder (`?stream=true` replays a background stream event by event, `starting_after` skips
//! what was seen, a bad value is the holder's own 400), a streamed `GET` streams through while
//! the response is still generating, and each call counts against requests-per-window limits
//! (not token limits).

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use sluice::api::responses::ids;
use sluice::sim::{Fault, FaultMode, SimConfig, SimHandle, SimKind};
use support::*;

async fn store_sim(speed: f64, tokens: u32) -> SimHandle {
    sim_with(
        SimConfig::new(SimKind::Vllm, vec!["st".into()])
            .speed(speed)
            .responses_store(true)
            .output_tokens(tokens, tokens),
    )
    .await
}

fn key_block(name: &str, extra: &str) -> (String, String) {
    let (key, hash) = sluice::auth::mint();
    let block =
        format!("\n[[keys]]\nname = \"{name}\"\ntenant = \"team\"\nhash = \"{hash}\"\n{extra}\n");
    (key, block)
}

/// `(event type, data)` of each event of an SSE text.
fn events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|b| !b.trim().is_empty())
        .map(|b| {
            let kind = b.lines().find_map(|l| l.strip_prefix("event: "));
            let data = b.lines().find_map(|l| l.strip_prefix("data: "));
            (
                kind.unwrap_or_default().to_string(),
                serde_json::from_str(data.unwrap_or("null")).unwrap_or(Value::Null),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_get_replays_a_background_stream_through_the_gateway() {
    let v = store_sim(1.0, 150).await;
    let mut t = String::from(FAST_HEALTH);
    t.push_str(&backend("st-vllm", "vllm", &v.url(), &["st"]));
    let g = TestGateway::start_healthy(&t).await;
    let c = client();

    // A background stream: read its first event only (the id), then leave.
    let mut created = c
        .post(g.url("/v1/responses"))
        .json(&json!({"model":"st","input":"Hello there","background":true,"stream":true}))
        .send()
        .await
        .unwrap();
    assert_eq!(created.status(), 200);
    let mut head = String::new();
    while !head.contains("\n\n") {
        let chunk = created.chunk().await.unwrap().expect("first event");
        head.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(created);
    let first = &events(&head)[0].1;
    let id = first["response"]["id"].as_str().unwrap().to_string();
    assert!(ids::decode(&id).unwrap().held_by("st-vllm"), "{id}");

    // `?stream=true` through the gateway: the first events arrive while it still generates.
    let mut replay = c
        .get(g.url(&format!("/v1/responses/{id}?stream=true")))
        .send()
        .await
        .unwrap();
    assert_eq!(replay.status(), 200);
    assert!(header(&replay, "content-type").starts_with("text/event-stream"));
    let mut seen = String::new();
    while events(&seen).len() < 4 {
        let chunk = replay.chunk().await.unwrap().expect("more events");
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let now: Value = get_json(&c, g.url(&format!("/v1/responses/{id}"))).await;
    assert!(
        now["status"] == "queued" || now["status"] == "in_progress",
        "streamed before the end: {now}"
    );
    while let Some(chunk) = replay.chunk().await.unwrap() {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let all = events(&seen);
    assert_eq!(all[0].0, "response.created");
    assert_eq!(all.last().unwrap().0, "response.completed", "{seen}");
    for (i, (kind, data)) in all.iter().enumerate() {
        assert_eq!(data["sequence_number"], i, "{kind}");
        if let Some(r) = data.get("response") {
            assert_eq!(r["id"], id.as_str(), "the client's id in {kind}");
        }
    }
    assert_eq!(
        all.last().unwrap().1["response"]["usage"]["output_tokens"],
        150
    );

    // `starting_after` is forwarded: the replay resumes after that event.
    let text = c
        .get(g.url(&format!("/v1/responses/{id}?stream=true&starting_after=5")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let rest = events(&text);
    assert_eq!(rest[0].1["sequence_number"], 6, "{text}");
    assert_eq!(rest.len(), all.len() - 6);

    // A bad value is the holder's own validation error, passed on.
    let r = c
        .get(g.url(&format!("/v1/responses/{id}?stream=true&starting_after=x")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().await.unwrap();
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("starting_after"),
        "{e}"
    );

    // A response that was not a background stream cannot be replayed (vLLM's 400); whole, it
    // is fetched as ever (include[] passes through).
    let whole: Value = request::post_for_json(
        &c,
        g.url("/v1/responses"),
        &json!({"model":"st","input":"x","max_output_tokens":2}),
    )
    .await;
    let wid = whole["id"].as_str().unwrap();
    let r = c
        .get(g.url(&format!("/v1/responses/{wid}?stream=true")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let got: Value = get_json(
        &c,
        g.url(&format!(
            "/v1/responses/{wid}?include[]=message.output_text.logprobs"
        )),
    )
    .await;
    assert_eq!(got["id"], wid);

    // The holder cutting the replay mid-way: the stream ends with the Responses API's error
    // event (the SDK raises), not silently.
    let mut fault = Fault::mode(FaultMode::DropMidstream);
    fault.after_chunks = 3;
    v.set_fault(fault).unwrap();
    let text = c
        .get(g.url(&format!("/v1/responses/{id}?stream=true")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let cut = events(&text);
    assert_eq!(cut.len(), 4, "{text}");
    let (kind, data) = cut.last().unwrap();
    assert_eq!(kind, "error", "{text}");
    assert_eq!(data["error"]["code"], "backend_stream_interrupted");
    g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_by_id_count_against_request_limits_not_token_limits() {
    let v = store_sim(0.0, 4).await;
    let (key, block) = key_block("rl", "requests_per_minute = 4\ntokens_per_minute = 1");
    let mut t = String::from(FAST_HEALTH);
    t.push_str(&block);
    t.push_str(&backend("st-vllm", "vllm", &v.url(), &["st"]));
    let g = TestGateway::start_healthy(&t).await;
    let c = client();

    // An id issued for the tenant (no create needed: the holder answers 404 for it, which
    // still is a call that was let through).
    let id = ids::encode("st-vllm", "team", "resp_0123456789abcdef");
    let mut statuses = Vec::new();
    for call in 0..6 {
        let r = match call % 3 {
            0 => c.get(g.url(&format!("/v1/responses/{id}"))),
            1 => c.post(g.url(&format!("/v1/responses/{id}/cancel"))),
            _ => c.get(g.url(&format!("/v1/responses/{id}?stream=true"))),
        }
        .bearer_auth(&key)
        .send()
        .await
        .unwrap();
        if r.status() == 429 {
            let ra = header(&r, "retry-after").to_string();
            let e: Value = r.json().await.unwrap();
            assert_eq!(e["error"]["code"], "rate_limit_exceeded", "{e}");
            assert!(
                e["error"]["message"].as_str().unwrap().contains("requests"),
                "{e}"
            );
            assert!(!ra.is_empty());
            statuses.push(429);
        } else {
            assert!(!header(&r, "x-ratelimit-remaining-requests").is_empty());
            statuses.push(r.status().as_u16());
        }
    }
    // A token limit of 1 refuses no call by id (they reserve nothing); the request limit of 4
    // refuses the fifth and sixth.
    assert_eq!(statuses, [404, 404, 404, 404, 429, 429]);
    // Nothing was counted as usage.
    let usage: Value = get_json(&c, g.admin_url("/admin/usage")).await;
    let rows = usage["rows"].as_array().cloned().unwrap_or_default();
    assert!(
        rows.iter()
            .all(|r| r["prompt_tokens"].as_u64().unwrap_or(0) == 0
                && r["completion_tokens"].as_u64().unwrap_or(0) == 0),
        "{usage}"
    );
    g.stop().await;
}

/// A background create is answered at once without usage; the gateway follows it on its
/// holder and reconciles the reservation and the usage with the real counts once, when it is
/// final.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_response_is_reconciled_when_it_finishes() {
    let v = sim_with(
        SimConfig::new(SimKind::Vllm, vec!["st".into()])
            .speed(1.0)
            .responses_store(true)
            .max_model_len(32_768)
            .output_tokens(30, 30),
    )
    .await;
    let (key, block) = key_block("bg", "tokens_per_minute = 12000");
    let mut t = String::from(FAST_HEALTH);
    t.push_str(&block);
    t.push_str(&backend("bg-vllm", "vllm", &v.url(), &["st"]));
    let g = TestGateway::start_healthy(&t).await;
    let c = client();
    let bg = json!({"model":"st","input":"Hello there","background":true,
                    "max_output_tokens":10000});
    let post = |body: Value| {
        c.post(g.url("/v1/responses"))
            .bearer_auth(&key)
            .json(&body)
            .send()
    };
    let r = post(bg.clone()).await.unwrap();
    assert_eq!(r.status(), 200);
    let created: Value = r.json().await.unwrap();
    assert_eq!(created["status"], "queued");
    assert!(created["usage"].is_null());
    let id = created["id"].as_str().unwrap().to_string();

    // While it runs, its 10000-token reservation holds: a second one does not fit.
    let r = post(bg.clone()).await.unwrap();
    assert_eq!(
        r.status(),
        429,
        "the reservation is held while the response runs"
    );

    // Once it is final, the follower reconciles: the real usage is counted, exactly once, and
    // the reservation is given back, so the same request fits again.
    let done = poll(Duration::from_secs(20), "the response finishes", || {
        let (c, url) = (c.clone(), g.url(&format!("/v1/responses/{id}")));
        let key = key.clone();
        async move {
            let v: Value = c
                .get(url)
                .bearer_auth(key)
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            (v["status"] == "completed").then_some(v)
        }
    })
    .await;
    let real = &done["usage"];
    assert_eq!(real["output_tokens"], 30);
    let rows = poll(Duration::from_secs(10), "usage reconciled", || {
        let (c, url) = (c.clone(), g.admin_url("/admin/usage"));
        async move {
            let v: Value = c.get(url).send().await.ok()?.json().await.ok()?;
            let rows: Vec<Value> = v["rows"]
                .as_array()?
                .iter()
                .filter(|r| r["tenant"] == "team" && r["completion_tokens"].as_u64() > Some(0))
                .cloned()
                .collect();
            (!rows.is_empty()).then_some(rows)
        }
    })
    .await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0]["completion_tokens"], 30);
    assert_eq!(rows[0]["prompt_tokens"], real["input_tokens"]);
    assert_eq!(rows[0]["backend"], "bg-vllm");
    let metrics = g.metrics_text().await;
    let completion = metrics
        .lines()
        .find(|l| {
            l.starts_with("sluice_completion_tokens_total")
                && l.contains("endpoint=\"responses\"")
                && l.contains("model=\"st\"")
                && l.contains("tenant=\"team\"")
        })
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(completion.ends_with(" 30"), "{completion}");
    let r = post(bg.clone()).await.unwrap();
    assert_eq!(
        r.status(),
        200,
        "the reservation was reconciled to the real usage"
    );
    g.stop().await;
}
