//! What the vLLM simulator reports about prefix-cache use in each API's usage, as vLLM 0.32
//! reports it with `--enable-prompt-tokens-details` (and without): tokens read from the cache
//! (whole blocks) and tokens written to it.

use std::time::Duration;

use serde_json::{json, Value};
use sluice::sim::{SimConfig, SimHandle, SimKind, Timing};

use crate::support::sim::keys;
use crate::support::{client, post_json, sim_with, sse_data};

const MODEL: &str = "m";

/// 128-token blocks, as vLLM's CPU build caches them.
const BLOCK: u64 = 128;

fn timing() -> Timing {
    Timing {
        decode_base: Duration::from_millis(1),
        decode_per_seq: Duration::from_micros(10),
        prefill_per_token: Duration::from_micros(1),
        block_size: BLOCK as u32,
        min_output_tokens: 4,
        max_output_tokens: 8,
        ..Timing::default()
    }
}

async fn sim(details: bool) -> SimHandle {
    sim_with(
        SimConfig::new(SimKind::Vllm, vec![MODEL.into()])
            .timing(timing())
            .prompt_tokens_details(details),
    )
    .await
}

/// A system prompt of several blocks.
fn system() -> String {
    "You are a careful assistant who answers in short sentences and checks every fact. ".repeat(30)
}

async fn post(c: &reqwest::Client, url: &str, body: &Value) -> String {
    let r = post_json(c, url, body).await;
    assert_eq!(r.status(), 200);
    r.text().await.unwrap()
}

/// The usage of the chunk (or event) that carries one.
fn streamed_usage(sse: &str) -> Value {
    sse_data(sse)
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .find_map(|v| v.get("usage").filter(|u| u.is_object()).cloned())
        .unwrap_or_else(|| panic!("no usage in {sse}"))
}

/// The raw text of each object that is the value of `key` in the JSON text `text`, in
/// document order (key order is what is compared: parsed values forget it).
fn raw_objects<'a>(text: &'a str, key: &str) -> Vec<&'a str> {
    let needle = format!("\"{key}\":");
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(i) = text[from..].find(&needle) {
        let start = from + i + needle.len();
        let open = start + text[start..].find('{').unwrap();
        let mut depth = 0;
        let mut end = open;
        for (j, ch) in text[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                end = open + j + 1;
                break;
            }
        }
        out.push(&text[open..end]);
        from = end;
    }
    out
}

/// The real engine's turns' usage, raw
/// (tests/fixtures/vllm-0.32.0/kv-events/agent-four-turns.json).
fn captured_usages() -> Vec<String> {
    let path = format!(
        "{}/tests/fixtures/vllm-0.32.0/kv-events/agent-four-turns.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(path).unwrap();
    raw_objects(&text, "usage")
        .into_iter()
        .map(String::from)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_turns_report_cached_and_written_blocks_as_the_real_engine_does() {
    let s = sim(true).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", s.url());
    let real = captured_usages();
    assert_eq!(real.len(), 4);
    let mut history = vec![json!({"role": "system", "content": system()})];
    for (turn, captured) in real.iter().enumerate() {
        history
            .push(json!({"role": "user", "content": format!("Step {turn}: run the next tool.")}));
        let body =
            json!({"model": MODEL, "messages": history, "max_tokens": 16, "ignore_eos": true});
        let text = post(&c, &url, &body).await;
        let v: Value = serde_json::from_str(&text).unwrap();
        let u = &v["usage"];
        assert_eq!(
            keys(raw_objects(&text, "usage")[0]),
            keys(captured),
            "turn {turn}"
        );
        let d = &u["prompt_tokens_details"];
        assert!(d["multimodal_tokens"].is_null());
        let (cached, created) = (
            d["cached_tokens"].as_u64().unwrap(),
            d["created_cache_tokens"].as_u64().unwrap(),
        );
        let prompt = u["prompt_tokens"].as_u64().unwrap();
        assert_eq!(cached % BLOCK, 0, "turn {turn}: {u}");
        assert_eq!(cached + created, prompt / BLOCK * BLOCK, "turn {turn}: {u}");
        if turn == 0 {
            assert_eq!(cached, 0);
        } else {
            // the history before this turn was cached by the turn before
            assert!(cached >= BLOCK, "turn {turn}: {u}");
        }
        let answer = v["choices"][0]["message"]["content"].clone();
        history.push(json!({"role": "assistant", "content": answer}));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_api_reports_the_cache_in_vllms_shape() {
    let s = sim(true).await;
    let c = client();
    let base = s.url();
    let chat = |stream: bool| {
        json!({"model": MODEL, "max_tokens": 4, "stream": stream,
            "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
            "messages": [{"role": "system", "content": system()}, {"role": "user", "content": "hi"}]})
    };
    let chat_url = format!("{base}/v1/chat/completions");
    post(&c, &chat_url, &chat(false)).await; // cache the system prompt
    let whole: Value = serde_json::from_str(&post(&c, &chat_url, &chat(false)).await).unwrap();
    let d = &whole["usage"]["prompt_tokens_details"];
    let cached = d["cached_tokens"].as_u64().unwrap();
    assert!(cached >= BLOCK && cached % BLOCK == 0, "{d}");
    // the streamed usage chunk leaves out what is null
    let sse = post(&c, &chat_url, &chat(true)).await;
    let u = streamed_usage(&sse);
    assert_eq!(
        u["prompt_tokens_details"],
        json!({"cached_tokens": cached, "created_cache_tokens": d["created_cache_tokens"]})
    );
    // completions report only what was read
    let comp_url = format!("{base}/v1/completions");
    let comp = |stream: bool| {
        json!({"model": MODEL, "prompt": system(), "max_tokens": 4, "stream": stream,
            "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null }})
    };
    post(&c, &comp_url, &comp(false)).await;
    let text = post(&c, &comp_url, &comp(false)).await;
    let v: Value = serde_json::from_str(&text).unwrap();
    let d = &v["usage"]["prompt_tokens_details"];
    let c_cached = d["cached_tokens"].as_u64().unwrap();
    assert!(c_cached >= BLOCK, "{d}");
    assert_eq!(
        keys(raw_objects(&text, "prompt_tokens_details")[0]),
        ["cached_tokens", "created_cache_tokens", "multimodal_tokens"]
    );
    assert!(d["created_cache_tokens"].is_null() && d["multimodal_tokens"].is_null());
    let u = streamed_usage(&post(&c, &comp_url, &comp(true)).await);
    assert_eq!(
        u["prompt_tokens_details"],
        json!({"cached_tokens": c_cached})
    );
    // Messages: read and written tokens apart, and out of input_tokens
    let msg = |stream: bool| {
        json!({"model": MODEL, "max_tokens": 4, "stream": stream, "system": system(),
            "messages": [{"role": "user", "content": "hi"}]})
    };
    let msg_url = format!("{base}/v1/messages");
    post(&c, &msg_url, &msg(false)).await;
    let text = post(&c, &msg_url, &msg(false)).await;
    let v: Value = serde_json::from_str(&text).unwrap();
    let u = &v["usage"];
    assert_eq!(
        keys(raw_objects(&text, "usage")[0]),
        [
            "input_tokens",
            "output_tokens",
            "cache_creation_input_tokens",
            "cache_read_input_tokens"
        ]
    );
    let read = u["cache_read_input_tokens"].as_u64().unwrap();
    assert!(read >= BLOCK && read % BLOCK == 0, "{u}");
    let sse = post(&c, &msg_url, &msg(true)).await;
    assert_eq!(
        keys(raw_objects(&sse, "usage")[0]),
        ["input_tokens", "output_tokens"],
        "the start has no cache fields"
    );
    let events: Vec<Value> = sse_data(&sse)
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let start = &events[0]["message"]["usage"];
    let delta = events
        .iter()
        .find(|e| e["type"] == "message_delta")
        .unwrap();
    let total = start["input_tokens"].as_u64().unwrap();
    assert_eq!(start["output_tokens"], 0, "{start}");
    let du = &delta["usage"];
    let parts = du["input_tokens"].as_u64().unwrap()
        + du["cache_creation_input_tokens"].as_u64().unwrap()
        + du["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(parts, total, "{du}");
    // Responses: always, with or without the flag
    let resp =
        json!({"model": MODEL, "max_output_tokens": 4, "instructions": system(), "input": "hi"});
    let resp_url = format!("{base}/v1/responses");
    post(&c, &resp_url, &resp).await;
    let v: Value = serde_json::from_str(&post(&c, &resp_url, &resp).await).unwrap();
    let d = &v["usage"]["input_tokens_details"];
    let input = v["usage"]["input_tokens"].as_u64().unwrap();
    let (r_cached, written) = (
        d["cached_tokens"].as_u64().unwrap(),
        d["cache_write_tokens"].as_u64().unwrap(),
    );
    assert!(r_cached >= BLOCK, "{d}");
    assert_eq!(r_cached + written, input / BLOCK * BLOCK, "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_flag_chat_and_messages_report_no_cache() {
    let s = sim(false).await;
    let c = client();
    let body = json!({"model": MODEL, "max_tokens": 4,
        "messages": [{"role": "system", "content": system()}, {"role": "user", "content": "hi"}]});
    let url = format!("{}/v1/chat/completions", s.url());
    post(&c, &url, &body).await;
    let v: Value = serde_json::from_str(&post(&c, &url, &body).await).unwrap();
    assert!(v["usage"]["prompt_tokens_details"].is_null(), "{v}");
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    stream["stream_options"] = json!({"include_usage": true});
    let u = streamed_usage(&post(&c, &url, &stream).await);
    assert!(u.get("prompt_tokens_details").is_none(), "{u}");
    let msg = json!({"model": MODEL, "max_tokens": 4, "system": system(),
        "messages": [{"role": "user", "content": "hi"}]});
    let text = post(&c, &format!("{}/v1/messages", s.url()), &msg).await;
    assert_eq!(
        keys(raw_objects(&text, "usage")[0]),
        ["input_tokens", "output_tokens"]
    );
}
