//! The vLLM personality's wider surface (Responses API with and without the store, Anthropic
//! Messages, count_tokens, chat batch, detokenize) against the captures of a real vLLM 0.32
//! server (tests/fixtures): same headers, JSON keys, event names and order, error bytes.

use std::time::Duration;

use crate::support::sim::*;
use crate::support::{client, poll};
use serde_json::{json, Value};
use sluice::sim::SimKind;

struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: String,
}

impl Answer {
    /// The status and the body are the capture's, byte for byte.
    #[track_caller]
    fn assert_is(&self, status: u16, fixture: &str) {
        assert_eq!(
            (self.status, self.body.as_str()),
            (status, fixture_body(fixture).as_str())
        );
    }
}

async fn post(url: &str, path: &str, body: Value) -> Answer {
    let r = client()
        .post(format!("{url}{path}"))
        .header("x-api-key", "unused")
        .header("anthropic-version", "2023-06-01")
        .json(&body)
        .send()
        .await
        .unwrap();
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    Answer {
        status,
        headers,
        body: r.text().await.unwrap(),
    }
}

async fn get(url: &str, path: &str) -> (u16, String) {
    let r = client().get(format!("{url}{path}")).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

fn v(s: &str) -> Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}"))
}

/// `event: NAME\ndata: JSON\n\n` events as (name, data).
fn typed_events(raw: &str) -> Vec<(String, String)> {
    assert!(raw.ends_with("\n\n"), "stream must end with a blank line");
    raw.trim_end_matches("\n\n")
        .split("\n\n")
        .map(|ev| {
            let (e, d) = ev.split_once('\n').expect("two lines per event");
            let name = e.strip_prefix("event: ").expect("event line");
            let data = d.strip_prefix("data: ").expect("data line");
            assert!(!data.contains('\n'));
            (name.to_string(), data.to_string())
        })
        .collect()
}

/// Event names with runs of the same name collapsed (the number of deltas is timing).
fn collapsed(evs: &[(String, String)]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (n, _) in evs {
        if out.last() != Some(n) {
            out.push(n.clone());
        }
    }
    out
}

fn assert_json_headers(a: &Answer) {
    assert_eq!(a.headers["content-type"], "application/json");
    assert_eq!(a.headers["server"], "uvicorn");
    assert_eq!(a.headers["vary"], "Origin");
    assert!(a.headers.get("content-length").is_some());
}

fn assert_sse_headers(a: &Answer) {
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(
        a.headers["content-type"],
        "text/event-stream; charset=utf-8"
    );
    assert_eq!(a.headers["transfer-encoding"], "chunked");
    assert_eq!(a.headers["server"], "uvicorn");
}

#[tokio::test]
async fn responses_whole_matches_the_capture() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let a = post(
        &sim.url(),
        "/v1/responses",
        json!({"model":"tiny","input":"Hello there","max_output_tokens":8}),
    )
    .await;
    assert_eq!(a.status, 200);
    assert_json_headers(&a);
    assert_eq!(keys(&a.body), keys(&fixture_body("responses.http")));
    let r = v(&a.body);
    assert!(r["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(r["object"], "response");
    assert_eq!(r["status"], "incomplete");
    assert_eq!(
        r["incomplete_details"],
        json!({"reason":"max_output_tokens"})
    );
    assert_eq!(r["max_output_tokens"], 8);
    assert_eq!(r["temperature"], 1.0);
    let item = &r["output"][0];
    assert!(item["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(item["status"], "completed");
    let text = item["content"][0]["text"].as_str().unwrap();
    assert_eq!(text.split_whitespace().count(), 8);
    let u = &r["usage"];
    assert_eq!(u["output_tokens"], 8);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["input_tokens"].as_u64().unwrap() + 8
    );
    // the same prompt through chat has the same prompt tokens
    let c = post(
        &sim.url(),
        "/v1/chat/completions",
        json!({"messages":[{"role":"user","content":"Hello there"}],"max_tokens":1}),
    )
    .await;
    assert_eq!(v(&c.body)["usage"]["prompt_tokens"], u["input_tokens"]);

    // a list of role messages plus instructions; a natural stop is "completed"
    let a = post(
        &sim.url(),
        "/v1/responses",
        json!({"input":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"input_text","text":"Hi"}]}],"max_output_tokens":5}),
    )
    .await;
    assert_eq!(
        keys(&a.body),
        keys(&fixture_body("responses-messages-input.http"))
    );
    let a = post(
        &sim.url(),
        "/v1/responses",
        json!({"input":"Hi","instructions":"Answer in French."}),
    )
    .await;
    let r = v(&a.body);
    assert_eq!(r["status"], "completed");
    assert_eq!(r["incomplete_details"], Value::Null);
    assert_eq!(r["instructions"], "Answer in French.");
    assert_eq!(r["max_output_tokens"], Value::Null);
    // missing input: pydantic's 400 in vLLM's shape
    let a = post(&sim.url(), "/v1/responses", json!({"model":"tiny"})).await;
    assert_eq!(a.status, 400);
    assert_eq!(v(&a.body)["error"]["param"], "body.input");
    let a = post(
        &sim.url(),
        "/v1/responses",
        json!({"model":"nope","input":"x"}),
    )
    .await;
    a.assert_is(404, "error-unknown-model.http");
}

#[tokio::test]
async fn responses_stream_matches_the_capture() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let a = post(
        &sim.url(),
        "/v1/responses",
        json!({"model":"tiny","input":"Hello there","max_output_tokens":6,"stream":true}),
    )
    .await;
    assert_sse_headers(&a);
    assert!(!a.body.contains("[DONE]"));
    let got = typed_events(&a.body);
    let cap = typed_events(&fixture_body("responses-stream.http"));
    assert_eq!(collapsed(&got), collapsed(&cap));
    for (name, data) in &got {
        let (_, c) = cap.iter().find(|(n, _)| n == name).unwrap();
        assert_eq!(keys(data), keys(c), "{name}: {data}");
        assert_eq!(v(data)["type"], name.as_str());
    }
    for (i, (_, data)) in got.iter().enumerate() {
        assert_eq!(v(data)["sequence_number"], i as u64);
    }
    let item = v(&got[2].1)["item"]["id"].as_str().unwrap().to_string();
    let deltas: String = got
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .map(|(_, d)| {
            let d = v(d);
            assert_eq!(d["item_id"], item.as_str());
            d["delta"].as_str().unwrap().to_string()
        })
        .collect();
    let done = got
        .iter()
        .find(|(n, _)| n == "response.output_text.done")
        .unwrap();
    assert_eq!(v(&done.1)["text"], deltas.as_str());
    let last = v(&got.last().unwrap().1);
    assert_eq!(last["type"], "response.completed");
    let r = &last["response"];
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["usage"]["output_tokens"], 6);
    assert_eq!(r["output"][0]["id"], item.as_str());
    assert_eq!(r["output"][0]["content"][0]["text"], deltas.as_str());
    assert_eq!(r["id"], v(&got[0].1)["response"]["id"]);
}

#[tokio::test]
async fn responses_stream_deltas_follow_the_engine() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(20.0)).await;
    let a = post(
        &sim.url(),
        "/v1/responses",
        json!({"input":"Hello","max_output_tokens":12,"stream":true}),
    )
    .await;
    let got = typed_events(&a.body);
    let deltas = got
        .iter()
        .filter(|(n, _)| n == "response.output_text.delta")
        .count();
    assert!(deltas > 1, "tokens arrive step by step: {deltas}");
    let st = state(&client(), &sim.url()).await;
    assert_eq!(st["models"][0]["generation_tokens"], 12);
}

#[tokio::test]
async fn without_the_store_background_is_the_captured_400_and_nothing_is_kept() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let a = post(
        &sim.url(),
        "/v1/responses",
        json!({"model":"tiny","input":"Hello","background":true}),
    )
    .await;
    a.assert_is(400, "responses-background.http");
    // store defaults to true but is silently off: the answer is not kept
    let a = post(&sim.url(), "/v1/responses", json!({"input":"Hello"})).await;
    let id = v(&a.body)["id"].as_str().unwrap().to_string();
    let (s, body) = get(&sim.url(), &format!("/v1/responses/{id}")).await;
    assert_eq!(s, 404);
    assert_eq!(v(&body)["error"]["param"], "response_id");
    let a = post(
        &sim.url(),
        "/v1/responses",
        json!({"input":"more","previous_response_id":id}),
    )
    .await;
    assert_eq!(a.status, 404);
}

#[tokio::test]
async fn the_store_keeps_responses_and_continues_conversations() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| {
        c.speed(0.0).responses_store(true)
    })
    .await;
    let url = sim.url();
    let a = post(
        &url,
        "/v1/responses",
        json!({"model":"tiny","input":"Hello there","max_output_tokens":8}),
    )
    .await;
    assert_eq!(keys(&a.body), keys(&fixture_body("store-responses.http")));
    let first = v(&a.body);
    let id = first["id"].as_str().unwrap();
    let (s, body) = get(&url, &format!("/v1/responses/{id}")).await;
    assert_eq!(s, 200);
    assert_eq!(body, a.body, "GET gives back the stored response");
    assert_eq!(keys(&body), keys(&fixture_body("store-responses-get.http")));

    let b = post(
        &url,
        "/v1/responses",
        json!({"model":"tiny","input":"And then?","max_output_tokens":6,"previous_response_id":id}),
    )
    .await;
    assert_eq!(b.status, 200, "{}", b.body);
    assert_eq!(
        keys(&b.body),
        keys(&fixture_body("store-responses-previous.http"))
    );
    let second = v(&b.body);
    assert_eq!(second["previous_response_id"], id);
    let in1 = first["usage"]["input_tokens"].as_u64().unwrap();
    let out1 = first["usage"]["output_tokens"].as_u64().unwrap();
    let in2 = second["usage"]["input_tokens"].as_u64().unwrap();
    // the previous input and output are the context of the new turn
    assert!(in2 > in1 + out1, "{in2} vs {in1} + {out1}");
    // the same conversation sent by hand costs the same prompt tokens
    let text = first["output"][0]["content"][0]["text"].as_str().unwrap();
    let c = post(
        &url,
        "/v1/responses",
        json!({"input":[{"role":"user","content":"Hello there"},{"role":"assistant","content":text},{"role":"user","content":"And then?"}],"max_output_tokens":1,"store":false}),
    )
    .await;
    assert_eq!(v(&c.body)["usage"]["input_tokens"].as_u64().unwrap(), in2);
    // a third turn grows again
    let id2 = second["id"].as_str().unwrap();
    let d = post(
        &url,
        "/v1/responses",
        json!({"input":"Go on.","max_output_tokens":2,"previous_response_id":id2}),
    )
    .await;
    assert!(v(&d.body)["usage"]["input_tokens"].as_u64().unwrap() > in2);

    let a = post(
        &url,
        "/v1/responses",
        json!({"model":"tiny","input":"x","previous_response_id":"resp_doesnotexist"}),
    )
    .await;
    a.assert_is(404, "store-responses-previous-unknown.http");
    let (s, body) = get(&url, "/v1/responses/resp_doesnotexist").await;
    assert_eq!(
        (s, body.as_str()),
        (
            404,
            fixture_body("store-responses-previous-unknown.http").as_str()
        )
    );
    // background with stream: streamed, then kept
    let s = post(
        &url,
        "/v1/responses",
        json!({"input":"x","max_output_tokens":3,"stream":true,"background":true}),
    )
    .await;
    let evs = typed_events(&s.body);
    let sid = v(&evs[0].1)["response"]["id"].as_str().unwrap().to_string();
    let (_, body) = get(&url, &format!("/v1/responses/{sid}")).await;
    assert_eq!(v(&body)["status"], "incomplete");
    assert_eq!(v(&body)["background"], true);
    // store: false is not kept
    let e = post(&url, "/v1/responses", json!({"input":"x","store":false})).await;
    let eid = v(&e.body)["id"].as_str().unwrap().to_string();
    assert_eq!(get(&url, &format!("/v1/responses/{eid}")).await.0, 404);
    // a synchronous response cannot be cancelled; vLLM 0.32 has no DELETE
    let a = post(&url, &format!("/v1/responses/{id}/cancel"), json!({})).await;
    assert_eq!(a.status, 400);
    assert_eq!(
        v(&a.body)["error"]["message"],
        "Cannot cancel a synchronous response."
    );
    let r = client()
        .delete(format!("{url}/v1/responses/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(
        r.text().await.unwrap(),
        "{\"detail\":\"Method Not Allowed\"}"
    );

    // the store is per process: another replica does not know the id
    let other = start(SimKind::Vllm, &["tiny"], |c| {
        c.speed(0.0).responses_store(true)
    })
    .await;
    assert_eq!(
        get(&other.url(), &format!("/v1/responses/{id}")).await.0,
        404
    );
}

#[tokio::test]
async fn background_responses_are_queued_polled_and_cancelled() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| {
        c.speed(1.0)
            .responses_store(true)
            .max_num_seqs(1)
            .output_tokens(400, 400)
    })
    .await;
    let url = sim.url();
    let c = client();
    // one sequence at a time: a first request keeps the engine busy, the background one queues
    let busy = post(
        &url,
        "/v1/responses",
        json!({"input":"busy","max_output_tokens":30,"background":true}),
    )
    .await;
    let a = post(
        &url,
        "/v1/responses",
        json!({"model":"tiny","input":"Write a long story","max_output_tokens":400,"background":true}),
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(
        keys(&a.body),
        keys(&fixture_body("store-responses-background.http"))
    );
    let r = v(&a.body);
    assert_eq!(r["status"], "queued");
    assert_eq!(r["background"], true);
    assert_eq!(r["output"], json!([]));
    assert_eq!(r["usage"], Value::Null);
    let id = r["id"].as_str().unwrap().to_string();
    let (_, body) = get(&url, &format!("/v1/responses/{id}")).await;
    assert_eq!(v(&body)["status"], "queued");
    assert_eq!(
        keys(&body),
        keys(&fixture_body("store-responses-background-get.http"))
    );
    // the first one completes by itself, then ours runs
    let busy_id = v(&busy.body)["id"].as_str().unwrap().to_string();
    let done = poll(Duration::from_secs(10), "the simulator's state", || {
        let (u, i) = (url.clone(), busy_id.clone());
        async move {
            let (_, b) = get(&u, &format!("/v1/responses/{i}")).await;
            let r = v(&b);
            (r["status"] == "incomplete").then_some(r)
        }
    })
    .await;
    assert_eq!(done["usage"]["output_tokens"], 30);
    assert_eq!(
        done["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .count(),
        30
    );
    poll(Duration::from_secs(10), "the simulator's state", || {
        let (u, i) = (url.clone(), id.clone());
        async move {
            let (_, b) = get(&u, &format!("/v1/responses/{i}")).await;
            (v(&b)["status"] == "in_progress").then_some(())
        }
    })
    .await;
    let running = state(&c, &url).await;
    assert_eq!(running["models"][0]["running"], 1);
    let x = post(&url, &format!("/v1/responses/{id}/cancel"), json!({})).await;
    assert_eq!(x.status, 200);
    assert_eq!(
        keys(&x.body),
        keys(&fixture_body("store-responses-cancel.http"))
    );
    assert_eq!(v(&x.body)["status"], "cancelled");
    let (_, body) = get(&url, &format!("/v1/responses/{id}")).await;
    assert_eq!(v(&body)["status"], "cancelled");
    assert_eq!(
        keys(&body),
        keys(&fixture_body("store-responses-background-get-after.http"))
    );
    // the engine stops generating it
    poll(Duration::from_secs(5), "the simulator's state", || {
        let c = c.clone();
        let u = url.clone();
        async move {
            let s = state(&c, &u).await;
            (s["models"][0]["running"] == 0 && s["models"][0]["requests_aborted"] == 1)
                .then_some(())
        }
    })
    .await;
    let generated = state(&c, &url).await["models"][0]["generation_tokens"].clone();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        state(&c, &url).await["models"][0]["generation_tokens"],
        generated
    );
    // it stays cancelled, and cannot be cancelled twice
    assert_eq!(
        v(&get(&url, &format!("/v1/responses/{id}")).await.1)["status"],
        "cancelled"
    );
    assert_eq!(
        post(&url, &format!("/v1/responses/{id}/cancel"), json!({}))
            .await
            .status,
        400
    );
    assert_eq!(
        post(&url, "/v1/responses/resp_nope/cancel", json!({}))
            .await
            .status,
        404
    );
}

#[tokio::test]
async fn messages_match_the_capture() {
    let sim = start(SimKind::Vllm, &["tiny", "alias"], |c| c.speed(0.0)).await;
    let req = json!({"model":"alias","max_tokens":8,"system":"You are terse.","messages":[
        {"role":"user","content":"Hello"},
        {"role":"assistant","content":[{"type":"text","text":"Hi."}]},
        {"role":"user","content":"How are you?"}],
        "tools":[{"name":"get_weather","description":"w","input_schema":{"type":"object","properties":{}}}]});
    let a = post(&sim.url(), "/v1/messages", req.clone()).await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_json_headers(&a);
    assert_eq!(keys(&a.body), keys(&fixture_body("messages.http")));
    let m = v(&a.body);
    assert!(m["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(m["type"], "message");
    assert_eq!(m["model"], "tiny");
    assert_eq!(m["stop_reason"], "max_tokens");
    assert_eq!(m["content"][0]["type"], "text");
    assert_eq!(m["usage"]["output_tokens"], 8);
    let mut count = req.clone();
    count.as_object_mut().unwrap().remove("max_tokens");
    let n = post(&sim.url(), "/v1/messages/count_tokens", count).await;
    assert_eq!(n.status, 200);
    assert_eq!(
        keys(&n.body),
        keys(&fixture_body("messages-count-tokens.http"))
    );
    let n = v(&n.body);
    assert_eq!(n["input_tokens"], m["usage"]["input_tokens"]);
    assert_eq!(
        n["context_management"]["original_input_tokens"],
        n["input_tokens"]
    );
    // a natural stop is end_turn
    let a = post(
        &sim.url(),
        "/v1/messages",
        json!({"model":"tiny","max_tokens":1000,"messages":[{"role":"user","content":"Hi"}]}),
    )
    .await;
    assert_eq!(v(&a.body)["stop_reason"], "end_turn");
}

#[tokio::test]
async fn messages_stream_matches_the_capture() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let a = post(
        &sim.url(),
        "/v1/messages",
        json!({"model":"tiny","max_tokens":6,"stream":true,"messages":[{"role":"user","content":"Hello"}]}),
    )
    .await;
    assert_sse_headers(&a);
    let got = typed_events(&a.body);
    let cap = typed_events(&fixture_body("messages-stream.http"));
    let names = |e: &[(String, String)]| e.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&got), names(&cap));
    for ((n, g), (_, c)) in got.iter().zip(&cap) {
        assert_eq!(keys(g), keys(c), "{n}: {g}");
        assert_eq!(v(g)["type"], n.as_str());
    }
    let input = v(&got[0].1)["message"]["usage"]["input_tokens"].clone();
    let end = v(&got[got.len() - 2].1);
    assert_eq!(end["delta"]["stop_reason"], "max_tokens");
    assert_eq!(
        end["usage"],
        json!({"input_tokens": input, "output_tokens": 6})
    );
}

#[tokio::test]
async fn messages_errors_keep_vllms_two_shapes() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let a = post(
        &sim.url(),
        "/v1/messages",
        json!({"model":"nope","max_tokens":5,"messages":[{"role":"user","content":"x"}]}),
    )
    .await;
    a.assert_is(404, "messages-error-unknown-model.http");
    let a = post(
        &sim.url(),
        "/v1/messages",
        json!({"model":"tiny","messages":[{"role":"user","content":"x"}]}),
    )
    .await;
    a.assert_is(400, "messages-error-no-max-tokens.http");
    let a = post(
        &sim.url(),
        "/v1/messages/count_tokens",
        json!({"model":"nope","messages":[]}),
    )
    .await;
    a.assert_is(404, "messages-error-unknown-model.http");
}

#[tokio::test]
async fn chat_batch_and_detokenize_match_the_captures() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let a = post(
        &sim.url(),
        "/v1/chat/completions/batch",
        json!({"model":"tiny","max_tokens":3,"messages":[
            [{"role":"user","content":"Hello"}],
            [{"role":"user","content":"Tell me a joke"}]]}),
    )
    .await;
    assert_eq!(a.status, 200);
    assert_json_headers(&a);
    assert_eq!(keys(&a.body), keys(&fixture_body("chat-batch.http")));
    let b = v(&a.body);
    assert_eq!(b["choices"][1]["index"], 1);
    assert_eq!(b["usage"]["completion_tokens"], 6);
    let one = post(
        &sim.url(),
        "/v1/chat/completions",
        json!({"messages":[{"role":"user","content":"Hello"}],"max_tokens":3}),
    )
    .await;
    let two = post(
        &sim.url(),
        "/v1/chat/completions",
        json!({"messages":[{"role":"user","content":"Tell me a joke"}],"max_tokens":3}),
    )
    .await;
    let p = |s: &str| v(s)["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        b["usage"]["prompt_tokens"].as_u64().unwrap(),
        p(&one.body) + p(&two.body)
    );
    // detokenize gives back what tokenize cut
    let t = post(
        &sim.url(),
        "/tokenize",
        json!({"model":"tiny","prompt":"hello world"}),
    )
    .await;
    let tokens = v(&t.body)["tokens"].clone();
    let d = post(
        &sim.url(),
        "/detokenize",
        json!({"model":"tiny","tokens":tokens}),
    )
    .await;
    assert_eq!(d.status, 200);
    assert_json_headers(&d);
    assert_eq!(d.body, fixture_body("detokenize.http"));
}

#[tokio::test]
async fn faults_apply_to_the_new_paths() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let (c, url) = (client(), sim.url());
    let resp = json!({"input":"Hello","max_output_tokens":8,"stream":true});
    let msg = json!({"model":"tiny","max_tokens":8,"stream":true,"messages":[{"role":"user","content":"Hi"}]});
    set_fault(&c, &url, json!({"mode":"overloaded"})).await;
    let a = post(&url, "/v1/responses", resp.clone()).await;
    assert_eq!(a.status, 503);
    assert_eq!(v(&a.body)["error"]["type"], "ServiceUnavailableError");
    let a = post(&url, "/v1/messages", msg.clone()).await;
    assert_eq!(a.status, 503);
    assert_eq!(v(&a.body)["type"], "error");
    assert_eq!(v(&a.body)["error"]["type"], "ServiceUnavailableError");
    set_fault(&c, &url, json!({"mode":"error_rate","rate":1.0})).await;
    let a = post(
        &url,
        "/v1/chat/completions/batch",
        json!({"messages":[[{"role":"user","content":"x"}]]}),
    )
    .await;
    assert_eq!(a.status, 500);
    // a mid-stream drop cuts the connection: no terminating chunk, no final event
    set_fault(&c, &url, json!({"mode":"drop_midstream","after_chunks":3})).await;
    for (path, body, last) in [
        ("/v1/responses", resp, "response.completed"),
        ("/v1/messages", msg, "message_stop"),
    ] {
        let r = post_json(&c, format!("{url}{path}"), &body).await;
        assert_eq!(r.status(), 200);
        let mut r = r;
        let mut got = Vec::new();
        let err = loop {
            match r.chunk().await {
                Ok(Some(b)) => got.extend_from_slice(&b),
                Ok(None) => break false,
                Err(_) => break true,
            }
        };
        assert!(err, "{path}: the body must end in an error");
        let text = String::from_utf8_lossy(&got);
        assert_eq!(text.matches("event: ").count(), 3, "{path}: {text}");
        assert!(!text.contains(last));
    }
    // hang parks the new paths like the others
    set_fault(&c, &url, json!({"mode":"hang"})).await;
    let slow = c
        .post(format!("{url}/v1/messages/count_tokens"))
        .timeout(Duration::from_millis(300))
        .json(&json!({"model":"tiny","messages":[]}))
        .send()
        .await;
    assert!(slow.is_err());
    set_fault(&c, &url, json!({"mode":"healthy"})).await;
}

#[tokio::test]
async fn the_new_paths_count_in_the_engine_metrics() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| c.speed(0.0)).await;
    let url = sim.url();
    post(
        &url,
        "/v1/responses",
        json!({"input":"a","max_output_tokens":3}),
    )
    .await;
    post(
        &url,
        "/v1/messages",
        json!({"model":"tiny","max_tokens":4,"messages":[{"role":"user","content":"b"}]}),
    )
    .await;
    post(&url, "/v1/chat/completions/batch", json!({"max_tokens":2,"messages":[[{"role":"user","content":"c"}],[{"role":"user","content":"d"}]]})).await;
    let (_, m) = get(&url, "/metrics").await;
    let line = m
        .lines()
        .find(|l| l.starts_with("vllm:generation_tokens_total{"))
        .unwrap();
    assert!(line.ends_with(" 11.0"), "{line}");
    let line = m
        .lines()
        .find(|l| l.starts_with("vllm:request_success_total{") && l.contains("length"))
        .unwrap();
    assert!(line.ends_with(" 4.0"), "{line}");
}

#[tokio::test]
async fn a_continued_conversation_hits_the_prefix_cache() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| {
        c.speed(50.0).responses_store(true)
    })
    .await;
    let url = sim.url();
    let long = "Tell me everything about the history of the river and its bridges. ".repeat(8);
    let a = post(
        &url,
        "/v1/responses",
        json!({"input":long,"max_output_tokens":4}),
    )
    .await;
    let first = v(&a.body);
    assert_eq!(first["usage"]["input_tokens_details"]["cached_tokens"], 0);
    let b = post(
        &url,
        "/v1/responses",
        json!({"input":"Go on.","max_output_tokens":4,"previous_response_id":first["id"]}),
    )
    .await;
    let second = v(&b.body);
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let input1 = first["usage"]["input_tokens"].as_u64().unwrap();
    // the first prompt's whole blocks are the second prompt's prefix
    assert!(
        cached >= input1 / 16 * 16 - 16 && cached > 0,
        "{cached} of {input1}"
    );
    let st = state(&client(), &url).await;
    assert_eq!(
        st["models"][0]["prefix_cache_hits"].as_u64().unwrap(),
        cached
    );
}

#[tokio::test]
async fn rerank_and_score_answer_as_vllm_does() {
    let sim = start(SimKind::Vllm, &["bge-rr"], |c| c.speed(0.0)).await;
    let c = client();
    let url = |p: &str| format!("{}{p}", sim.url());
    let body = serde_json::json!({"model":"bge-rr","query":"sky","documents":["the sky","a sea","red"],"top_n":2});
    let raw = post_json(&c, url("/v1/rerank"), &body)
        .await
        .text()
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&raw).unwrap();
    assert!(v["id"].as_str().unwrap().starts_with("rerank-"));
    assert_eq!(keys(&raw)[..4], ["id", "model", "usage", "prompt_tokens"]);
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    assert!(results[0]["relevance_score"].as_f64() >= results[1]["relevance_score"].as_f64());
    assert!(results[0]["document"]["text"].is_string());
    assert_eq!(v["usage"]["prompt_tokens"], v["usage"]["total_tokens"]);
    let again: serde_json::Value = post_for_json(&c, url("/rerank"), &body).await;
    assert_eq!(again["results"], v["results"], "deterministic");
    let s: serde_json::Value = post_for_json(
        &c,
        url("/v1/score"),
        &serde_json::json!({"model":"bge-rr","text_1":"sky","text_2":["the sky","a sea"]}),
    )
    .await;
    assert_eq!(
        (s["object"].as_str(), s["data"][1]["object"].as_str()),
        (Some("list"), Some("score"))
    );
    assert_eq!(s["data"][1]["index"], 1);
    assert_eq!(s["usage"]["completion_tokens"], 0);
    // vLLM's errors: a missing field (pydantic), an unknown model, unequal pair lists.
    for (path, bad, status) in [
        (
            "/v1/rerank",
            serde_json::json!({"model":"bge-rr","query":"x"}),
            400,
        ),
        (
            "/v1/score",
            serde_json::json!({"model":"bge-rr","text_1":"x"}),
            400,
        ),
        (
            "/v1/rerank",
            serde_json::json!({"model":"nope","query":"x","documents":["a"]}),
            404,
        ),
        (
            "/v1/score",
            serde_json::json!({"model":"bge-rr","text_1":["a","b"],"text_2":["a","b","c"]}),
            400,
        ),
    ] {
        let r = post_json(&c, url(path), &bad).await;
        assert_eq!(r.status(), status, "{path} {bad}");
    }
}

#[tokio::test]
async fn speech_to_text_answers_as_vllm_does() {
    let sim = start(SimKind::Vllm, &["whisper"], |c| c.speed(0.0)).await;
    let c = client();
    let form = |fields: &[(&str, &[u8])]| {
        let mut b = Vec::new();
        for (name, value) in fields {
            b.extend_from_slice(
                format!("--XB\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n")
                    .as_bytes(),
            );
            b.extend_from_slice(value);
            b.extend_from_slice(b"\r\n");
        }
        b.extend_from_slice(b"--XB--\r\n");
        b
    };
    let send = |path: &str, ct: &str, body: Vec<u8>| {
        c.post(format!("{}{path}", sim.url()))
            .header("content-type", ct.to_string())
            .body(body)
            .send()
    };
    let ct = "multipart/form-data; boundary=XB";
    let audio = vec![7u8; 70_000]; // a little over 2 s at 16 kHz, 16-bit
    let ok = form(&[("file", &audio), ("model", b"whisper")]);
    let v: Value = send("/v1/audio/transcriptions", ct, ok.clone())
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["usage"], json!({"type":"duration","seconds":3}));
    assert_eq!(v["text"].as_str().unwrap().split(' ').count(), 6);
    let t: Value = send("/v1/audio/translations", ct, ok)
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(t, json!({"text": v["text"]}), "no usage on translations");
    for (body, content_type, status) in [
        (form(&[("model", b"whisper")]), ct, 400),
        (b"{}".to_vec(), "application/json", 400),
        (form(&[("file", &audio), ("model", b"nope")]), ct, 404),
    ] {
        let r = send("/v1/audio/transcriptions", content_type, body)
            .await
            .unwrap();
        assert_eq!(r.status(), status);
    }
}
