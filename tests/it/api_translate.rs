//! The Responses and Messages APIs served by translation to chat completions (TGI, Ollama)
//! next to vLLM's native answers: the same conversations (multi-turn, a tool call and its
//! result, whole and streamed) compared field by field; tool calls made by a TGI sim coming back
//! as `tool_use` blocks and `function_call` items; every untranslatable field refused with a 400
//! naming it; a translated stream cut mid-way ending with the API's error event; usage in
//! /admin/usage and a token limit; and the OpenAI and Anthropic Python SDKs
//! (tests/python/gateway_translate_sdk.py) in front of a mixed fleet, natively and — with the
//! vLLM backend busy — by failover to the translated backends.

use crate::support;

use std::time::Duration;

use serde_json::{json, Value};
use sluice::sim::{Fault, FaultMode, SimConfig, SimHandle, SimKind};
use support::process::{python_checks, python_with};
use support::*;

/// A sim whose answers always run to their limit (so native and translated answers both end
/// at `max_tokens`).
async fn long_sim(kind: SimKind, model: &str) -> SimHandle {
    sim_with(
        SimConfig::new(kind, vec![model.into()])
            .speed(0.0)
            .output_tokens(400, 400),
    )
    .await
}

fn key_block(name: &str, tenant: &str, extra: &str) -> (String, String) {
    let (key, hash) = sluice::auth::mint();
    let block = format!(
        "\n[[keys]]\nname = \"{name}\"\ntenant = \"{tenant}\"\nhash = \"{hash}\"\n{extra}\n"
    );
    (key, block)
}

/// `xl-native` on a vLLM sim, `xl-tgi` on a TGI sim, `xl-cut` on a TGI sim that cuts streams;
/// a key and a key with a small token limit.
struct Fleet {
    g: TestGateway,
    key: String,
    limited: String,
    _sims: Vec<SimHandle>,
}

async fn fleet() -> Fleet {
    let v = long_sim(SimKind::Vllm, "xl-native").await;
    let t = long_sim(SimKind::Tgi, "xl-tgi").await;
    let cut = long_sim(SimKind::Tgi, "xl-cut").await;
    let mut fault = Fault::mode(FaultMode::DropMidstream);
    fault.after_chunks = 3;
    cut.set_fault(fault).unwrap();
    let (key, kb) = key_block("xl-user", "xl-team", "tokens_per_minute = 1000000");
    let (limited, lb) = key_block("xl-limited", "xl-limited-team", "tokens_per_minute = 120");
    let mut toml = String::from(FAST_HEALTH);
    toml.push_str(&backend("xl-vllm", "vllm", &v.url(), &["xl-native"]));
    toml.push_str(&backend("xl-tgi-be", "tgi", &t.url(), &["xl-tgi"]));
    toml.push_str(&backend("xl-cut-be", "tgi", &cut.url(), &["xl-cut"]));
    toml.push_str(&kb);
    toml.push_str(&lb);
    let g = TestGateway::start_healthy(&toml).await;
    Fleet {
        g,
        key,
        limited,
        _sims: vec![v, t, cut],
    }
}

impl Fleet {
    async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.post_as(&self.key, path, body).await
    }

    async fn post_as(&self, key: &str, path: &str, body: &Value) -> reqwest::Response {
        client()
            .post(self.g.url(path))
            .bearer_auth(key)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    async fn whole(&self, path: &str, body: &Value) -> Value {
        let r = self.post(path, body).await;
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{v}");
        v
    }

    /// A streamed answer as its `(event, data)` pairs.
    async fn events(&self, path: &str, body: &Value) -> Vec<(String, Value)> {
        let mut body = body.clone();
        body["stream"] = json!(true);
        let r = self.post(path, &body).await;
        assert_eq!(r.status(), 200);
        events_of(&r.text().await.unwrap())
    }
}

/// The `(event, data)` pairs of a typed SSE body.
fn events_of(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let kind = e
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or("")
                .to_string();
            let data: String = e.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
            let data = serde_json::from_str(&data).unwrap_or_else(|e| panic!("{e}: {data}"));
            (kind, data)
        })
        .collect()
}

fn kinds(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(k, _)| k.as_str()).collect()
}

const WEATHER_SCHEMA: &str = r#"{"type":"object","properties":{"city":{"type":"string"},"days":{"type":"integer"}},"required":["city","days"]}"#;

fn schema() -> Value {
    serde_json::from_str(WEATHER_SCHEMA).unwrap()
}

/// Messages-API conversations: a plain turn; several turns with a tool call and its result.
fn messages_conversations(model: &str) -> Vec<Value> {
    let tools =
        json!([{"name": "get_weather", "description": "Weather", "input_schema": schema()}]);
    vec![
        json!({"model": model, "max_tokens": 6, "system": "You are terse.",
               "messages": [{"role": "user", "content": "Hello there"}]}),
        json!({"model": model, "max_tokens": 7, "system": [{"type": "text", "text": "Be kind."}],
               "tools": tools, "tool_choice": {"type": "auto"}, "temperature": 0.5, "top_p": 0.9,
               "stop_sequences": ["\n\nHuman:"],
               "messages": [
                   {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                   {"role": "assistant", "content": [
                       {"type": "text", "text": "Let me look."},
                       {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                        "input": {"city": "Paris", "days": 1}}]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21C"},
                       {"type": "text", "text": "And tomorrow?"}]}]}),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_translated_match_native_field_by_field() {
    let f = fleet().await;
    let natives = messages_conversations("xl-native");
    let translated = messages_conversations("xl-tgi");
    for (n, t) in natives.iter().zip(&translated) {
        let max = n["max_tokens"].as_u64().unwrap();
        let (a, b) = (
            f.whole("/v1/messages", n).await,
            f.whole("/v1/messages", t).await,
        );
        for v in [&a, &b] {
            assert_eq!(v["type"], "message", "{v}");
            assert_eq!(v["role"], "assistant");
            assert!(!v["id"].as_str().unwrap().is_empty(), "{v}");
            assert_eq!(v["stop_reason"], "max_tokens", "{v}");
            assert_eq!(v["usage"]["output_tokens"], max, "{v}");
            assert!(v["usage"]["input_tokens"].as_u64().unwrap() > 5, "{v}");
            let blocks: Vec<&Value> = v["content"].as_array().unwrap().iter().collect();
            assert_eq!(blocks.len(), 1, "{v}");
            assert_eq!(blocks[0]["type"], "text");
            assert!(!blocks[0]["text"].as_str().unwrap().is_empty());
        }
        assert_eq!(b["model"], "xl-tgi");
        assert!(b["id"].as_str().unwrap().starts_with("msg_"), "{b}");
        // Every field of vLLM's answer, and Anthropic's `stop_sequence` (vLLM leaves it out).
        for key in a.as_object().unwrap().keys() {
            assert!(b.get(key).is_some(), "translated answer lacks `{key}`: {b}");
        }
        assert!(b["stop_sequence"].is_null(), "{b}");

        let (ea, eb) = (
            f.events("/v1/messages", n).await,
            f.events("/v1/messages", t).await,
        );
        assert_eq!(kinds(&ea), kinds(&eb), "{ea:?}\n{eb:?}");
        assert_eq!(
            ea.iter()
                .filter(|(k, _)| k == "content_block_delta")
                .count() as u64,
            max
        );
        for events in [&ea, &eb] {
            for (kind, data) in events.iter() {
                assert_eq!(data["type"], kind.as_str(), "{data}");
            }
            let delta = &events[events.len() - 2].1;
            assert_eq!(delta["delta"]["stop_reason"], "max_tokens");
            assert_eq!(delta["usage"]["output_tokens"], max);
            assert!(
                delta["usage"]["input_tokens"].as_u64().unwrap() > 5,
                "{delta}"
            );
            assert_eq!(events[1].1["content_block"]["type"], "text");
        }
    }
    f.g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tgi_tool_calls_come_back_as_tool_use_blocks() {
    let f = fleet().await;
    let tools = json!([{"name": "get_weather", "input_schema": schema()}]);
    let mut body = json!({"model": "xl-tgi", "max_tokens": 50, "tools": tools,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "Weather in Paris?"}]});
    let v = f.whole("/v1/messages", &body).await;
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    let block = &v["content"][0];
    assert_eq!(block["type"], "tool_use", "{v}");
    assert_eq!(block["name"], "get_weather");
    assert!(
        block["input"]["city"].is_string() && block["input"]["days"].is_u64(),
        "{v}"
    );
    assert_eq!(v["content"].as_array().unwrap().len(), 1);

    let events = f.events("/v1/messages", &body).await;
    let start = events
        .iter()
        .find(|(k, _)| k == "content_block_start")
        .unwrap();
    assert_eq!(start.1["content_block"]["type"], "tool_use");
    assert_eq!(start.1["content_block"]["input"], json!({}));
    let partial: String = events
        .iter()
        .filter(|(k, _)| k == "content_block_delta")
        .map(|(_, d)| {
            assert_eq!(d["delta"]["type"], "input_json_delta");
            d["delta"]["partial_json"].as_str().unwrap().to_string()
        })
        .collect();
    let input: Value = serde_json::from_str(&partial).unwrap();
    assert_eq!(input, block["input"]);
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert_eq!(events.last().unwrap().0, "message_stop");

    // The conversation goes on with the call and its result: a text answer.
    let id = block["id"].as_str().unwrap();
    body["tool_choice"] = json!({"type": "auto"});
    body["messages"] = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [block]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": [{"type": "text", "text": "Sunny"}]}]}]);
    let v = f.whole("/v1/messages", &body).await;
    assert_eq!(v["content"][0]["type"], "text", "{v}");
    assert_eq!(v["stop_reason"], "max_tokens");
    f.g.stop().await;
}

/// Responses-API conversations: a string; items with instructions, several turns, a function
/// call and its output.
fn responses_conversations(model: &str) -> Vec<Value> {
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": schema()}]);
    vec![
        json!({"model": model, "input": "Hello there", "max_output_tokens": 6}),
        json!({"model": model, "instructions": "Be terse.", "max_output_tokens": 7,
               "tools": tools, "tool_choice": "auto", "temperature": 0.5,
               "input": [
                   {"role": "developer", "content": "Answer in English."},
                   {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
                   {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                    "arguments": "{\"city\":\"Paris\",\"days\":1}"},
                   {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21C"},
                   {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
                   {"role": "user", "content": "And tomorrow?"}]}),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_translated_match_native_field_by_field() {
    let f = fleet().await;
    let natives = responses_conversations("xl-native");
    let translated = responses_conversations("xl-tgi");
    for (n, t) in natives.iter().zip(&translated) {
        let max = n["max_output_tokens"].as_u64().unwrap();
        let (a, b) = (
            f.whole("/v1/responses", n).await,
            f.whole("/v1/responses", t).await,
        );
        for v in [&a, &b] {
            assert_eq!(v["object"], "response", "{v}");
            assert_eq!(v["status"], "incomplete", "{v}");
            assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
            assert_eq!(v["usage"]["output_tokens"], max);
            let input = v["usage"]["input_tokens"].as_u64().unwrap();
            assert!(input > 3, "{v}");
            assert_eq!(v["usage"]["total_tokens"], input + max);
            assert_eq!(v["output"].as_array().unwrap().len(), 1, "{v}");
            let item = &v["output"][0];
            assert_eq!(
                (item["type"].as_str(), item["role"].as_str()),
                (Some("message"), Some("assistant"))
            );
            assert_eq!(item["content"][0]["type"], "output_text");
            assert_eq!(v["max_output_tokens"], max);
            assert_eq!(
                v["instructions"],
                n.get("instructions").cloned().unwrap_or(Value::Null)
            );
        }
        assert_eq!(b["model"], "xl-tgi");
        assert!(b["id"].as_str().unwrap().starts_with("resp_"));
        // Every field of vLLM's answer but its own extensions.
        let vllm_only = [
            "kv_transfer_params",
            "ec_transfer_params",
            "input_messages",
            "output_messages",
            "presence_penalty",
            "frequency_penalty",
        ];
        for key in a.as_object().unwrap().keys() {
            if !vllm_only.contains(&key.as_str()) {
                assert!(b.get(key).is_some(), "translated answer lacks `{key}`: {b}");
            }
        }

        let (ea, eb) = (
            f.events("/v1/responses", n).await,
            f.events("/v1/responses", t).await,
        );
        // The same sequence; vLLM puts several tokens in one text delta, TGI sends one each.
        let runs = |e: &[(String, Value)]| {
            let mut k = kinds(e);
            k.dedup();
            k.into_iter().map(String::from).collect::<Vec<_>>()
        };
        assert_eq!(runs(&ea), runs(&eb), "{ea:?}\n{eb:?}");
        for events in [&ea, &eb] {
            for (i, (kind, data)) in events.iter().enumerate() {
                assert_eq!(data["type"], kind.as_str(), "{data}");
                assert_eq!(data["sequence_number"], i, "{data}");
            }
            let last = &events.last().unwrap().1["response"];
            assert_eq!(last["usage"]["output_tokens"], max);
            assert_eq!(last["status"], "incomplete");
            let deltas: String = events
                .iter()
                .filter(|(k, _)| k == "response.output_text.delta")
                .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
                .collect();
            let done = events
                .iter()
                .find(|(k, _)| k == "response.output_text.done")
                .unwrap();
            assert_eq!(done.1["text"], deltas.as_str());
            assert_eq!(last["output"][0]["content"][0]["text"], deltas.as_str());
        }
    }
    f.g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tgi_tool_calls_come_back_as_function_call_items() {
    let f = fleet().await;
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": schema()}]);
    let body = json!({"model": "xl-tgi", "max_output_tokens": 50, "tools": tools,
        "tool_choice": {"type": "function", "name": "get_weather"}, "input": "Weather in Paris?"});
    let v = f.whole("/v1/responses", &body).await;
    assert_eq!(v["status"], "completed", "{v}");
    let item = &v["output"][0];
    assert_eq!(item["type"], "function_call", "{v}");
    assert_eq!(item["name"], "get_weather");
    let args: Value = serde_json::from_str(item["arguments"].as_str().unwrap()).unwrap();
    assert!(args["city"].is_string() && args["days"].is_u64(), "{v}");
    assert!(!item["call_id"].as_str().unwrap().is_empty());

    let events = f.events("/v1/responses", &body).await;
    let expected_head = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
    ];
    assert_eq!(&kinds(&events)[..4], &expected_head, "{events:?}");
    let tail: Vec<&str> = kinds(&events).into_iter().rev().take(3).collect();
    assert_eq!(
        tail,
        [
            "response.completed",
            "response.output_item.done",
            "response.function_call_arguments.done"
        ]
    );
    let deltas: String = events
        .iter()
        .filter(|(k, _)| k == "response.function_call_arguments.delta")
        .map(|(_, d)| d["delta"].as_str().unwrap().to_string())
        .collect();
    let done = &events[events.len() - 3].1;
    assert_eq!(done["arguments"], deltas.as_str());
    assert_eq!(
        events.last().unwrap().1["response"]["output"][0]["arguments"],
        deltas.as_str()
    );

    // The call and its output go back as input: a text answer.
    let call_id = item["call_id"].as_str().unwrap();
    let body = json!({"model": "xl-tgi", "max_output_tokens": 5, "tools": tools,
        "input": [{"role": "user", "content": "Weather in Paris?"}, item,
                  {"type": "function_call_output", "call_id": call_id, "output": "Sunny"}]});
    let v = f.whole("/v1/responses", &body).await;
    assert_eq!(v["output"][0]["type"], "message", "{v}");
    f.g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untranslatable_fields_are_refused_naming_them() {
    let f = fleet().await;
    let say = json!([{"role": "user", "content": "hi"}]);
    let messages: Vec<(&str, Value)> = vec![
        (
            "thinking",
            json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}),
        ),
        ("top_k", json!({"top_k": 5})),
        ("container", json!({"container": "c1"})),
        (
            "mcp_servers",
            json!({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}),
        ),
        (
            "tools[0].type",
            json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
        ),
        ("tool_choice", json!({"tool_choice": {"type": "magic"}})),
        ("frobnicate", json!({"frobnicate": true})),
        (
            "messages[0].content[0].type",
            json!({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}),
        ),
        (
            "messages[0].content[0].is_error",
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": true, "content": "boom"}]}]}),
        ),
        (
            "messages[0].content[0].content",
            json!({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {"type": "url", "url": "http://x/i.png"}}]}]}]}),
        ),
        (
            "messages[0].content[0].type",
            json!({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"}]}]}),
        ),
    ];
    for (param, extra) in messages {
        let mut body = json!({"model": "xl-tgi", "max_tokens": 5, "messages": say});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = f.post("/v1/messages", &body).await;
        assert_eq!(r.status(), 400, "{param}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("`{param}`")),
            "{param}: {message}"
        );
        // The same field to a native backend is not the translation's business.
        body["model"] = json!("xl-native");
        let r = f.post("/v1/messages", &body).await;
        let v: Value = r.json().await.unwrap();
        assert!(!v.to_string().contains("untranslatable"), "{v}");
    }
    let responses: Vec<(&str, Value)> = vec![
        (
            "previous_response_id",
            json!({"previous_response_id": "resp_abc"}),
        ),
        ("conversation", json!({"conversation": "conv_1"})),
        ("background", json!({"background": true})),
        ("store", json!({"store": true})),
        (
            "include",
            json!({"include": ["reasoning.encrypted_content"]}),
        ),
        ("reasoning", json!({"reasoning": {"effort": "high"}})),
        ("prompt", json!({"prompt": {"id": "pmpt_1"}})),
        ("max_tool_calls", json!({"max_tool_calls": 2})),
        ("top_logprobs", json!({"top_logprobs": 3})),
        ("truncation", json!({"truncation": "auto"})),
        (
            "text.format",
            json!({"text": {"format": {"type": "json_object"}}}),
        ),
        ("text.verbosity", json!({"text": {"verbosity": "low"}})),
        ("tools[0].type", json!({"tools": [{"type": "web_search"}]})),
        (
            "tools[1].type",
            json!({"tools": [{"type": "function", "name": "f"}, {"type": "file_search", "vector_store_ids": []}]}),
        ),
        (
            "tool_choice",
            json!({"tool_choice": {"type": "web_search"}}),
        ),
        (
            "input[0].type",
            json!({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}),
        ),
        (
            "input[0].type",
            json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
        ),
        (
            "input[0].content[0].file_id",
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]}),
        ),
        (
            "input[0].content[0].type",
            json!({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]}),
        ),
        ("frobnicate", json!({"frobnicate": 1})),
    ];
    for (param, extra) in responses {
        let mut body = json!({"model": "xl-tgi", "input": "hi", "max_output_tokens": 5});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = f.post("/v1/responses", &body).await;
        assert_eq!(r.status(), 400, "{param}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], param, "{v}");
        assert_eq!(v["error"]["code"], "untranslatable_field", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
    // What has no effect on an answer, or is its default, is accepted.
    let body = json!({"model": "xl-tgi", "input": "hi", "max_output_tokens": 3, "store": false,
        "background": false, "include": [], "metadata": {"a": "b"}, "user": "u",
        "truncation": "disabled", "text": {"format": {"type": "text"}}, "reasoning": null,
        "parallel_tool_calls": true, "service_tier": "auto"});
    let v = f.whole("/v1/responses", &body).await;
    assert_eq!(v["metadata"], json!({"a": "b"}));
    assert_eq!(v["user"], "u");
    let body = json!({"model": "xl-tgi", "max_tokens": 3, "messages": say,
        "metadata": {"user_id": "u1"}, "thinking": {"type": "disabled"}, "service_tier": "auto",
        "tool_choice": {"type": "none"},
        "tools": [{"name": "t", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}]});
    f.whole("/v1/messages", &body).await;
    f.g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn translated_stream_cut_midway_ends_with_the_apis_error_event() {
    let f = fleet().await;
    let body = json!({"model": "xl-cut", "max_tokens": 40, "stream": true,
        "messages": [{"role": "user", "content": "Hello"}]});
    let r = f.post("/v1/messages", &body).await;
    assert_eq!(r.status(), 200);
    let events = events_of(&r.text().await.unwrap());
    let (kind, data) = events.last().unwrap();
    assert_eq!(kind, "error", "{events:?}");
    assert_eq!(data["type"], "error");
    assert_eq!(data["error"]["type"], "api_error");
    assert!(!kinds(&events).contains(&"message_stop"));

    let body =
        json!({"model": "xl-cut", "max_output_tokens": 40, "stream": true, "input": "Hello"});
    let r = f.post("/v1/responses", &body).await;
    let events = events_of(&r.text().await.unwrap());
    let (kind, data) = events.last().unwrap();
    assert_eq!(kind, "error", "{events:?}");
    assert_eq!(
        data["error"]["code"], "backend_stream_interrupted",
        "{data}"
    );
    assert!(!kinds(&events).contains(&"response.completed"));
    f.g.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn translated_usage_is_accounted_and_limited() {
    let f = fleet().await;
    let c = client();
    let usage = |v: &Value| {
        v["tenants"]["xl-team"]["total_tokens"]
            .as_u64()
            .unwrap_or(0)
    };
    let before = usage(&support::request::get_json(&c, f.g.admin_url("/admin/usage")).await);
    let m = f
        .whole(
            "/v1/messages",
            &json!({"model": "xl-tgi", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await;
    let events = f
        .events(
            "/v1/responses",
            &json!({"model": "xl-tgi", "max_output_tokens": 5, "input": "Hi there"}),
        )
        .await;
    let r = &events.last().unwrap().1["response"]["usage"];
    let answered = m["usage"]["input_tokens"].as_u64().unwrap()
        + m["usage"]["output_tokens"].as_u64().unwrap()
        + r["total_tokens"].as_u64().unwrap();
    let gw = &f.g;
    support::eventually(Duration::from_secs(3), "translated usage counted", || {
        let c = c.clone();
        async move {
            let v = support::request::get_json(&c, gw.admin_url("/admin/usage")).await;
            usage(&v) == before + answered
        }
    })
    .await;

    // A key over its token limit is stopped on both APIs, in each API's shape.
    let mut statuses = Vec::new();
    for _ in 0..8 {
        let body = json!({"model": "xl-tgi", "max_tokens": 30, "messages": [{"role": "user", "content": "Hi"}]});
        let r = f.post_as(&f.limited, "/v1/messages", &body).await;
        statuses.push(r.status().as_u16());
        if r.status() == 429 {
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
            break;
        }
    }
    assert_eq!(statuses.last(), Some(&429), "{statuses:?}");
    let body = json!({"model": "xl-tgi", "max_output_tokens": 100, "input": "Hi"});
    let r = f.post_as(&f.limited, "/v1/responses", &body).await;
    assert_eq!(r.status(), 429);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    f.g.stop().await;
}

/// The SDKs in front of one model served by a vLLM, a TGI and an Ollama sim: natively first (vLLM
/// and Ollama speak both APIs), then with the vLLM backend overloaded (each request fails over to
/// Ollama natively or to TGI by translation), then with TGI busy too (Ollama answers them all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdks_in_front_of_a_mixed_fleet() {
    let Some(python) = python_with(&["openai", "anthropic"]) else {
        return;
    };
    let v = long_sim(SimKind::Vllm, "xl-fleet").await;
    let t = long_sim(SimKind::Tgi, "xl-fleet").await;
    let o = long_sim(SimKind::Ollama, "xl-fleet").await;
    let tools = long_sim(SimKind::Tgi, "xl-tools").await;
    let cut = long_sim(SimKind::Tgi, "xl-fleet-cut").await;
    let mut fault = Fault::mode(FaultMode::DropMidstream);
    fault.after_chunks = 3;
    cut.set_fault(fault).unwrap();
    let mut toml = String::from(FAST_HEALTH);
    toml.push_str("\n[routing]\nexpose_backend_header = true\n");
    toml.push_str(&backend("xl-f-vllm", "vllm", &v.url(), &["xl-fleet"]));
    toml.push_str(&backend("xl-f-tgi", "tgi", &t.url(), &["xl-fleet"]));
    toml.push_str(&backend("xl-f-ollama", "ollama", &o.url(), &["xl-fleet"]));
    toml.push_str(&backend("xl-f-tools", "tgi", &tools.url(), &["xl-tools"]));
    toml.push_str(&backend("xl-f-cut", "tgi", &cut.url(), &["xl-fleet-cut"]));
    let g = TestGateway::start_healthy(&toml).await;
    let finished = |s: &SimHandle| {
        s.state()["models"][0]["requests_finished"]
            .as_u64()
            .unwrap_or(0)
    };
    let env = |served: &str| {
        vec![
            ("SLUICE_BASE_URL", g.url("")),
            ("SLUICE_MODEL", "xl-fleet".to_string()),
            ("SLUICE_TOOL_MODEL", "xl-tools".to_string()),
            ("SLUICE_CUT_MODEL", "xl-fleet-cut".to_string()),
            ("SLUICE_SERVED_BY", served.to_string()),
        ]
    };
    python_checks(
        python.clone(),
        "gateway_translate_sdk.py",
        env("xl-f-vllm,xl-f-ollama"),
    )
    .await;
    assert_eq!(finished(&t), 0, "native preferred");

    v.set_fault(Fault::mode(FaultMode::Overloaded)).unwrap();
    python_checks(
        python.clone(),
        "gateway_translate_sdk.py",
        env("xl-f-tgi,xl-f-ollama"),
    )
    .await;
    // The script's four calls of the mixed fleet's model, each failed over from the vLLM.
    assert!(
        finished(&t) + finished(&o) >= 4,
        "{} {}",
        finished(&t),
        finished(&o)
    );

    // With the TGI busy too, the Ollama backend answers them all, natively.
    t.set_fault(Fault::mode(FaultMode::Overloaded)).unwrap();
    let before = finished(&o);
    python_checks(python, "gateway_translate_sdk.py", env("xl-f-ollama")).await;
    assert!(finished(&o) >= before + 4, "{before} {}", finished(&o));
    g.stop().await;
}
