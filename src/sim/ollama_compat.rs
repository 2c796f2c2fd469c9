//! Ollama's compatibility APIs on top of its chat: the OpenAI Responses API
//! (`POST /v1/responses`, Ollama 0.13.3 and later) and the Anthropic Messages API
//! (`POST /v1/messages`), as Ollama's `middleware` and `openai`/`anthropic` packages answer them.
//!
//! Invariants (what Ollama does, kept because clients and the gateway see it):
//! - Both are one chat generation converted on the way out: same scheduler, load, queue
//!   (`OLLAMA_MAX_QUEUE`) and keep-alive as `/api/chat`.
//! - Responses: nothing is stored. `store`, `previous_response_id` and `conversation` are not
//!   read (a previous id is silently ignored), `background: true` is echoed but the answer is
//!   generated synchronously with status `completed`; there is no `GET`/`DELETE
//!   /v1/responses/{id}` nor `cancel` (the router's plain-text 404). Ids are `resp_<0..999998>`
//!   and `msg_<0..999998>`; `store` is always `false`; the status is `completed` even when
//!   `max_output_tokens` cut the answer. A whole answer is the Go struct in its field order
//!   (with `completed_at`); stream events are Go maps, so their keys are sorted. The stream
//!   starts (`response.created`, `response.in_progress`) with the first chunk of the chat,
//!   after load and prefill, and ends with `response.completed` carrying usage.
//! - Messages: no `count_tokens`. Ids are `msg_<24 hex>`; `message_start`'s `input_tokens` is
//!   Ollama's estimate (characters of roles and content / 4), `message_delta` carries the real
//!   prompt and output counts; no `ping`, no `stop_sequence` (`omitempty`). Request checks in
//!   the middleware's order: JSON, `model`, `max_tokens` > 0, `messages` non-empty; every error
//!   is Anthropic-shaped with a `request_id`.
//! - Errors of the Responses path are OpenAI-shaped (`{"error":{"message","type",…}}`).

#![allow(clippy::result_large_err)]

use std::sync::Arc;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::anthropic::block_text;
use super::gen::Gen;
use super::ollama::{ensure_loaded, inference_fault, named_model, parse, touch, v1_err, BUSY};
use super::openai_surface::js;
use super::responses::{input_turns, render, Turn};
use super::server::{json, read_body, stream_response, Sim, SimBody};
use super::text::Finish;

/// What the compatibility writers set (not gin's `; charset=utf-8`).
const JSON: &str = "application/json";
const SSE: &str = "text/event-stream";

/// A float as Go's `encoding/json` writes it (`1`, `0.7`).
fn gof(x: f64) -> String {
    if x.is_finite() && x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        format!("{x}")
    }
}

fn raw(v: &Option<Box<RawValue>>) -> Option<&str> {
    v.as_deref().map(RawValue::get).filter(|r| *r != "null")
}

/// `POST /v1/responses` fields Ollama reads (anything else is ignored by its decoder).
#[derive(Deserialize)]
struct ResponsesRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    background: bool,
    #[serde(default)]
    input: Option<Value>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    max_output_tokens: Option<i64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    truncation: Option<String>,
    #[serde(default)]
    tools: Option<Box<RawValue>>,
    #[serde(default)]
    text: Option<Box<RawValue>>,
    #[serde(default)]
    stream: Option<bool>,
}

/// The request's values a response object echoes, as JSON.
struct Echo {
    id: String,
    msg_id: String,
    model: String,
    instructions: String,
    tools: String,
    truncation: String,
    text_format: String,
    top_p: String,
    temperature: String,
    max_output_tokens: String,
    background: bool,
}

impl Echo {
    fn new(r: &ResponsesRequest, model: &str) -> Echo {
        let n: u32 = rand::random::<u32>() % 999_999;
        let m: u32 = rand::random::<u32>() % 999_999;
        let format = r
            .text
            .as_deref()
            .and_then(|t| serde_json::from_str::<Value>(t.get()).ok())
            .and_then(|t| t.get("format").filter(|f| !f.is_null()).cloned())
            .map(|f| f.to_string());
        Echo {
            id: format!("resp_{n}"),
            msg_id: format!("msg_{m}"),
            model: js(model),
            instructions: r
                .instructions
                .as_deref()
                .filter(|i| !i.is_empty())
                .map(js)
                .unwrap_or_else(|| "null".into()),
            tools: raw(&r.tools).unwrap_or("[]").to_string(),
            truncation: js(r.truncation.as_deref().unwrap_or("disabled")),
            text_format: format.unwrap_or_else(|| "{\"type\":\"text\"}".into()),
            top_p: gof(r.top_p.unwrap_or(1.0)),
            temperature: gof(r.temperature.unwrap_or(1.0)),
            max_output_tokens: r
                .max_output_tokens
                .map(|m| m.to_string())
                .unwrap_or_else(|| "null".into()),
            background: r.background,
        }
    }

    /// A whole answer: the Go struct in its field order.
    fn whole(&self, text: &str, input: u32, output: u32) -> String {
        let now = super::unix_now();
        format!(
            "{{\"id\":\"{}\",\"object\":\"response\",\"created_at\":{now},\"completed_at\":{now},\"status\":\"completed\",\"incomplete_details\":null,\"model\":{},\"previous_response_id\":null,\"instructions\":{},\"output\":[{{\"id\":\"{}\",\"type\":\"message\",\"status\":\"completed\",\"role\":\"assistant\",\"content\":[{{\"type\":\"output_text\",\"text\":{},\"annotations\":[],\"logprobs\":[]}}]}}],\"error\":null,\"tools\":{},\"tool_choice\":\"auto\",\"truncation\":{},\"parallel_tool_calls\":true,\"text\":{{\"format\":{}}},\"top_p\":{},\"presence_penalty\":0,\"frequency_penalty\":0,\"top_logprobs\":0,\"temperature\":{},\"reasoning\":null,\"usage\":{{\"input_tokens\":{input},\"output_tokens\":{output},\"total_tokens\":{},\"input_tokens_details\":{{\"cached_tokens\":0}},\"output_tokens_details\":{{\"reasoning_tokens\":0}}}},\"max_output_tokens\":{},\"max_tool_calls\":null,\"store\":false,\"background\":{},\"service_tier\":\"default\",\"metadata\":{{}},\"safety_identifier\":null,\"prompt_cache_key\":null}}\n",
            self.id,
            self.model,
            self.instructions,
            self.msg_id,
            js(text),
            self.tools,
            self.truncation,
            self.text_format,
            self.top_p,
            self.temperature,
            input + output,
            self.max_output_tokens,
            self.background,
        )
    }

    /// The response object of a stream event: a Go map, keys sorted.
    fn streamed(&self, status: &str, output: &str, usage: Option<(u32, u32)>) -> String {
        let now = super::unix_now();
        let completed = if usage.is_some() {
            now.to_string()
        } else {
            "null".into()
        };
        let usage = match usage {
            Some((i, o)) => format!(
                "{{\"input_tokens\":{i},\"input_tokens_details\":{{\"cached_tokens\":0}},\"output_tokens\":{o},\"output_tokens_details\":{{\"reasoning_tokens\":0}},\"total_tokens\":{}}}",
                i + o
            ),
            None => "null".into(),
        };
        format!(
            "{{\"background\":{},\"completed_at\":{completed},\"created_at\":{now},\"error\":null,\"frequency_penalty\":0,\"id\":\"{}\",\"incomplete_details\":null,\"instructions\":{},\"max_output_tokens\":{},\"max_tool_calls\":null,\"metadata\":{{}},\"model\":{},\"object\":\"response\",\"output\":{output},\"parallel_tool_calls\":true,\"presence_penalty\":0,\"previous_response_id\":null,\"prompt_cache_key\":null,\"reasoning\":null,\"safety_identifier\":null,\"service_tier\":\"default\",\"status\":\"{status}\",\"store\":false,\"temperature\":{},\"text\":{{\"format\":{}}},\"tool_choice\":\"auto\",\"tools\":{},\"top_logprobs\":0,\"top_p\":{},\"truncation\":{},\"usage\":{usage}}}",
            self.background,
            self.id,
            self.instructions,
            self.max_output_tokens,
            self.model,
            self.temperature,
            self.text_format,
            self.tools,
            self.top_p,
            self.truncation,
        )
    }

    /// The finished message item (sorted keys, as in the stream).
    fn item_done(&self, text: &str) -> String {
        format!(
            "{{\"content\":[{{\"annotations\":[],\"logprobs\":[],\"text\":{},\"type\":\"output_text\"}}],\"id\":\"{}\",\"role\":\"assistant\",\"status\":\"completed\",\"type\":\"message\"}}",
            js(text),
            self.msg_id
        )
    }
}

/// One event: the data's own fields, sorted, with `sequence_number` and `type` put in their
/// sorted places by the caller (`before` sorts before `sequence_number`, `after` between it
/// and `type`).
fn event(kind: &str, seq: &mut u32, before: &str, after: &str) -> String {
    let s = *seq;
    *seq += 1;
    format!(
        "event: {kind}\ndata: {{{before}\"sequence_number\":{s},{after}\"type\":\"{kind}\"}}\n\n"
    )
}

/// The conversation Ollama's converter builds: instructions as a system turn, then the input.
fn responses_turns(r: &ResponsesRequest) -> Vec<Turn> {
    let mut turns = Vec::new();
    if let Some(i) = r.instructions.as_deref().filter(|i| !i.is_empty()) {
        turns.push(Turn {
            role: "system".into(),
            text: i.to_string(),
        });
    }
    match &r.input {
        Some(Value::String(s)) if s.is_empty() => {}
        Some(v) => turns.extend(input_turns(v)),
        None => {}
    }
    turns
}

/// A generation for `turns` on model `idx`, after loading it: `Err` is Ollama's answer.
async fn generate(
    sim: &Arc<Sim>,
    idx: usize,
    turns: &[Turn],
    max: Option<i64>,
) -> Result<Gen, (StatusCode, &'static str)> {
    if let Some(fault) = inference_fault(sim) {
        return Err(fault);
    }
    let prompt = render(turns);
    let max = max.filter(|m| *m > 0).map(|m| m as u32);
    let plan = sim.plan(sim.config.seed, &sim.models[idx].name, &prompt, max);
    ensure_loaded(sim, idx).await;
    Gen::start(sim, idx, plan, Some(sim.config.max_queue))
        .map_err(|_| (StatusCode::SERVICE_UNAVAILABLE, BUSY))
}

/// `POST /v1/responses`.
pub(super) async fn responses(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let Ok(body) = read_body(req).await else {
        return v1_err(StatusCode::BAD_REQUEST, "http: request body too large");
    };
    let r: ResponsesRequest = match parse(&body, v1_err) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let (name, idx) = match named_model(sim, r.model.clone(), v1_err) {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let turns = responses_turns(&r);
    let echo = Echo::new(&r, &name);
    let stream = r.stream.unwrap_or(false);
    if turns.is_empty() {
        // nothing to say: the chat handler only loads the model and answers empty
        ensure_loaded(sim, idx).await;
        return json(StatusCode::OK, JSON, echo.whole("", 0, 0));
    }
    let mut gen = match generate(sim, idx, &turns, r.max_output_tokens).await {
        Ok(g) => g,
        Err((status, msg)) => return v1_err(status, msg),
    };
    if !stream {
        gen.run_to_end().await;
        touch(sim, idx, Some(sim.config.keep_alive)).await;
        let p = &gen.plan;
        let text = p.text(0, p.words.len());
        let body = echo.whole(&text, p.prompt_tokens(), p.completion_tokens());
        return json(StatusCode::OK, JSON, body);
    }
    let sim2 = sim.clone();
    stream_response(sim, StatusCode::OK, SSE, move |mut sink| async move {
        let mut seq = 0u32;
        let item = echo.msg_id.clone();
        let mut first = true;
        while let Some(range) = gen.next().await {
            let mut out = Vec::new();
            if first {
                first = false;
                for kind in ["response.created", "response.in_progress"] {
                    let resp =
                        format!("\"response\":{},", echo.streamed("in_progress", "[]", None));
                    out.push(event(kind, &mut seq, &resp, ""));
                }
                let added = format!("\"item\":{{\"content\":[],\"id\":\"{item}\",\"role\":\"assistant\",\"status\":\"in_progress\",\"type\":\"message\"}},\"output_index\":0,");
                out.push(event("response.output_item.added", &mut seq, &added, ""));
                let part = format!("\"content_index\":0,\"item_id\":\"{item}\",\"output_index\":0,\"part\":{{\"annotations\":[],\"logprobs\":[],\"text\":\"\",\"type\":\"output_text\"}},");
                out.push(event("response.content_part.added", &mut seq, &part, ""));
            }
            for i in range {
                let d = format!(
                    "\"content_index\":0,\"delta\":{},\"item_id\":\"{item}\",\"logprobs\":[],\"output_index\":0,",
                    js(&gen.plan.text(i, i + 1))
                );
                out.push(event("response.output_text.delta", &mut seq, &d, ""));
            }
            for e in out {
                if !sink.send(e).await {
                    return;
                }
            }
        }
        touch(&sim2, idx, Some(sim2.config.keep_alive)).await;
        let p = &gen.plan;
        let text = p.text(0, p.words.len());
        let t = js(&text);
        let done = [
            event(
                "response.output_text.done",
                &mut seq,
                &format!("\"content_index\":0,\"item_id\":\"{item}\",\"logprobs\":[],\"output_index\":0,"),
                &format!("\"text\":{t},"),
            ),
            event(
                "response.content_part.done",
                &mut seq,
                &format!("\"content_index\":0,\"item_id\":\"{item}\",\"output_index\":0,\"part\":{{\"annotations\":[],\"logprobs\":[],\"text\":{t},\"type\":\"output_text\"}},"),
                "",
            ),
            event(
                "response.output_item.done",
                &mut seq,
                &format!("\"item\":{},\"output_index\":0,", echo.item_done(&text)),
                "",
            ),
            event(
                "response.completed",
                &mut seq,
                &format!(
                    "\"response\":{},",
                    echo.streamed(
                        "completed",
                        &format!("[{}]", echo.item_done(&text)),
                        Some((p.prompt_tokens(), p.completion_tokens()))
                    )
                ),
                "",
            ),
        ];
        for e in done {
            if !sink.send(e).await {
                return;
            }
        }
    })
}

/// `POST /v1/messages` fields Ollama reads.
#[derive(Deserialize)]
struct MessagesRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    messages: Option<Vec<MessageParam>>,
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Deserialize)]
struct MessageParam {
    #[serde(default)]
    role: String,
    #[serde(default)]
    content: Option<Value>,
}

/// Anthropic's error with Ollama's `request_id`.
fn anthropic_err(status: StatusCode, msg: &str) -> Response<SimBody> {
    let ty = match status.as_u16() {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    let rid: [u8; 12] = rand::random();
    json(
        status,
        "application/json; charset=utf-8",
        format!(
            "{{\"type\":\"error\",\"error\":{{\"type\":\"{ty}\",\"message\":{}}},\"request_id\":\"req_{}\"}}",
            js(msg),
            hex::encode(rid)
        ),
    )
}

/// Ollama's estimate of the prompt: characters of system, roles and content, over 4 (at least
/// 1 when there is anything).
fn estimate(r: &MessagesRequest, msgs: &[MessageParam]) -> usize {
    let mut n = r.system.as_ref().map(|s| block_text(s).len()).unwrap_or(0);
    for m in msgs {
        n += m.role.len() + m.content.as_ref().map(|c| block_text(c).len()).unwrap_or(0);
    }
    (n / 4).max(1)
}

fn stop_reason(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "end_turn",
        Finish::Length => "max_tokens",
    }
}

/// `POST /v1/messages`.
pub(super) async fn messages(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let Ok(body) = read_body(req).await else {
        return anthropic_err(StatusCode::BAD_REQUEST, "http: request body too large");
    };
    let r: MessagesRequest = match parse(&body, anthropic_err) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    if r.model.as_deref().unwrap_or("").is_empty() {
        return anthropic_err(StatusCode::BAD_REQUEST, "model is required");
    }
    if r.max_tokens.unwrap_or(0) <= 0 {
        return anthropic_err(
            StatusCode::BAD_REQUEST,
            "max_tokens is required and must be positive",
        );
    }
    let msgs = r.messages.as_deref().unwrap_or(&[]);
    if msgs.is_empty() {
        return anthropic_err(StatusCode::BAD_REQUEST, "messages is required");
    }
    let (name, idx) = match named_model(sim, r.model.clone(), anthropic_err) {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let mut turns = Vec::new();
    if let Some(s) = &r.system {
        turns.push(Turn {
            role: "system".into(),
            text: block_text(s),
        });
    }
    turns.extend(msgs.iter().map(|m| Turn {
        role: m.role.clone(),
        text: m.content.as_ref().map(block_text).unwrap_or_default(),
    }));
    let mut gen = match generate(sim, idx, &turns, r.max_tokens).await {
        Ok(g) => g,
        Err((status, msg)) => return anthropic_err(status, msg),
    };
    let id_bytes: [u8; 12] = rand::random();
    let id = format!("msg_{}", hex::encode(id_bytes));
    let model = js(&name);
    if !r.stream.unwrap_or(false) {
        gen.run_to_end().await;
        touch(sim, idx, Some(sim.config.keep_alive)).await;
        let p = &gen.plan;
        return json(
            StatusCode::OK,
            JSON,
            format!(
                "{{\"id\":\"{id}\",\"type\":\"message\",\"role\":\"assistant\",\"model\":{model},\"content\":[{{\"type\":\"text\",\"text\":{}}}],\"stop_reason\":\"{}\",\"usage\":{{\"input_tokens\":{},\"output_tokens\":{}}}}}\n",
                js(&p.text(0, p.words.len())),
                stop_reason(p.finish),
                p.prompt_tokens(),
                p.completion_tokens()
            ),
        );
    }
    let estimated = estimate(&r, msgs);
    let sim2 = sim.clone();
    stream_response(sim, StatusCode::OK, SSE, move |mut sink| async move {
        let ev = |kind: &str, data: String| format!("event: {kind}\ndata: {data}\n\n");
        let mut first = true;
        while let Some(range) = gen.next().await {
            let mut out = Vec::new();
            if first {
                first = false;
                out.push(ev("message_start", format!(
                    "{{\"type\":\"message_start\",\"message\":{{\"id\":\"{id}\",\"type\":\"message\",\"role\":\"assistant\",\"model\":{model},\"content\":[],\"usage\":{{\"input_tokens\":{estimated},\"output_tokens\":0}}}}}}"
                )));
                out.push(ev(
                    "content_block_start",
                    "{\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}".into(),
                ));
            }
            for i in range {
                out.push(ev("content_block_delta", format!(
                    "{{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":{}}}}}",
                    js(&gen.plan.text(i, i + 1))
                )));
            }
            for e in out {
                if !sink.send(e).await {
                    return;
                }
            }
        }
        touch(&sim2, idx, Some(sim2.config.keep_alive)).await;
        let p = &gen.plan;
        let end = [
            ev(
                "content_block_stop",
                "{\"type\":\"content_block_stop\",\"index\":0}".into(),
            ),
            ev("message_delta", format!(
                "{{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"{}\"}},\"usage\":{{\"input_tokens\":{},\"output_tokens\":{}}}}}",
                stop_reason(p.finish),
                p.prompt_tokens(),
                p.completion_tokens()
            )),
            ev("message_stop", "{\"type\":\"message_stop\"}".into()),
        ];
        for e in end {
            if !sink.send(e).await {
                return;
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_floats() {
        assert_eq!(gof(1.0), "1");
        assert_eq!(gof(0.7), "0.7");
        assert_eq!(gof(0.0), "0");
    }

    #[test]
    fn events_put_sequence_number_and_type_in_sorted_place() {
        let mut seq = 4;
        let e = event(
            "response.output_text.done",
            &mut seq,
            "\"a\":1,",
            "\"text\":\"x\",",
        );
        assert_eq!(seq, 5);
        let data = e.split("data: ").nth(1).unwrap().trim_end();
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["sequence_number"], 4);
        let keys: Vec<&str> = data
            .trim_matches(|c| c == '{' || c == '}')
            .split(',')
            .map(|kv| kv.split(':').next().unwrap().trim_matches('"'))
            .collect();
        let mut sorted = keys.clone();
        sorted.sort_unstable();
        assert_eq!(keys, sorted);
    }
}
