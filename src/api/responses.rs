//! The OpenAI Responses API, `POST /v1/responses`, forwarded natively to the backends that
//! speak it (vLLM). The prompt is `input` (a string or a list of items), the output limit
//! `max_output_tokens`; a stream is typed events (`event: response.created` …
//! `response.completed`/`response.incomplete` carrying `usage.input_tokens`/`output_tokens`),
//! with no `[DONE]`.
//!
//! Stored responses live in one backend's memory, so the ids clients see name that backend
//! ([`ids`]): answers and the events that carry a response object get their `id` (and
//! `previous_response_id`) rewritten on the way out ([`Edits::issue_ids`]); a request's
//! `previous_response_id` is decoded on the way in and pins the request to its holder
//! ([`ClientApi::pin`]). The design is written down in `docs/api-surface.md`.
//!
//! Backend kinds: only `vllm` is native. The `openai` kind is not: it stands for any
//! OpenAI-compatible server, most of which have no `/v1/responses`; routing a Responses request
//! there would answer 404 depending on which backend was picked. The other kinds serve the
//! stateless part by translation to chat completions ([`super::translate::responses`]).
//!
//! Invariants: events are read borrowed, without allocating; an edit only replaces a string
//! with a string; a mid-stream failure ends the stream with an `error` event whose data also
//! carries an `error` object, which is what makes the OpenAI SDKs raise.

pub mod ids;

use std::borrow::Cow;

use bytes::Bytes;
use http::StatusCode;
use serde::Deserialize;
use serde_json::value::RawValue;

use super::{wire, ClientApi, Edits, Pin, Seen, TokenizeForm, Usage, Whole};
use crate::config::BackendKind;
use crate::openai::edit::{self, Splice};
use crate::openai::request::{self, PromptField, MAX_TOKENS_LIMIT};
use crate::openai::{ApiError, RequestFields};

/// The Responses API.
pub struct Responses;

/// The Responses API.
pub static RESPONSES: &dyn ClientApi = &Responses;

/// The answer for a response id that is unknown here: vLLM's own 404 for an unknown id, so an
/// id Sluice did not issue (or another tenant's) looks exactly like one no backend has.
pub fn not_found(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("Response with id '{id}' not found."),
    )
    .with_param("response_id")
    .with_code("response_not_found")
}

/// The answer for an id whose holding backend is no longer in the fleet: the response is gone
/// with it.
pub fn holder_gone(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!(
            "Response with id '{id}' not found: the backend that stored it is no longer in the \
             fleet."
        ),
    )
    .with_param("response_id")
    .with_code("response_backend_gone")
}

/// The answer for an id answered by a backend that stores nothing (Ollama): it cannot be
/// fetched, cancelled or continued.
pub fn not_stored(id: &str, backend: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!(
            "Response with id '{id}' not found: it was answered by backend `{backend}`, which \
             does not store responses."
        ),
    )
    .with_param("response_id")
    .with_code("response_not_stored")
}

/// The answer for an id whose holding backend is in the fleet but cannot be reached now.
pub fn holder_unavailable(id: &str, backend: &str) -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        format!(
            "Response with id '{id}' is stored on backend `{backend}`, which is unavailable \
             right now. Please retry."
        ),
    )
    .with_code("response_backend_unavailable")
    .with_retry_after(std::time::Duration::from_secs(1))
}

/// The routed fields only the Responses API has.
#[derive(Deserialize)]
struct Extra<'a> {
    #[serde(borrow, default)]
    max_output_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    previous_response_id: Option<&'a RawValue>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    background: Option<bool>,
}

/// A response object (a whole answer, or `response` in a lifecycle event), read borrowed.
#[derive(Deserialize)]
struct ResponseLite<'a> {
    #[serde(borrow, default)]
    id: Option<&'a RawValue>,
    #[serde(borrow, default)]
    model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    previous_response_id: Option<&'a RawValue>,
    #[serde(default)]
    usage: Option<UsageLite>,
}

/// The Responses API's usage.
#[derive(Deserialize, Clone, Copy)]
struct UsageLite {
    #[serde(default)]
    input_tokens: u64,
    #[serde(default)]
    output_tokens: u64,
    #[serde(
        default,
        rename = "input_tokens_details",
        deserialize_with = "crate::openai::usage::cached"
    )]
    cached_tokens: Option<u64>,
}

impl From<UsageLite> for Usage {
    fn from(u: UsageLite) -> Usage {
        Usage {
            prompt_tokens: u.input_tokens,
            completion_tokens: u.output_tokens,
            cached_tokens: u.cached_tokens,
        }
    }
}

/// One stream event, read borrowed.
#[derive(Deserialize)]
struct EventLite<'a> {
    #[serde(borrow, default, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    response: Option<&'a RawValue>,
    #[serde(borrow, default)]
    delta: Option<&'a RawValue>,
}

fn parse_extra(body: &[u8]) -> Result<Extra<'_>, ApiError> {
    serde_json::from_slice(body).map_err(ApiError::invalid_json)
}

fn max_output_tokens(raw: Option<&RawValue>) -> Result<Option<u64>, ApiError> {
    let invalid = || {
        ApiError::bad_request(format!(
            "`max_output_tokens` must be an integer between 1 and {MAX_TOKENS_LIMIT}."
        ))
        .with_param("max_output_tokens")
    };
    match raw.map(|r| r.get()) {
        None | Some("null") => Ok(None),
        Some(v) => match v.parse::<u64>() {
            Ok(n) if (1..=MAX_TOKENS_LIMIT).contains(&n) => Ok(Some(n)),
            _ => Err(invalid()),
        },
    }
}

/// The string value of a raw JSON string (`None` for anything else).
fn string_of(raw: &RawValue) -> Option<String> {
    serde_json::from_str::<String>(raw.get()).ok()
}

/// The byte range of `raw` inside `json` (both borrowed from the same buffer).
fn span_in(json: &[u8], raw: &RawValue) -> Option<std::ops::Range<usize>> {
    let start = (raw.get().as_ptr() as usize).checked_sub(json.as_ptr() as usize)?;
    let end = start + raw.get().len();
    (end <= json.len()).then_some(start..end)
}

/// A whole response's final `status` as a finish label (one still queued or running has
/// none yet); any other text is `other`.
fn final_status(raw: &RawValue) -> Option<&'static str> {
    Some(match raw.get() {
        "\"queued\"" | "\"in_progress\"" | "null" => return None,
        "\"completed\"" => "completed",
        "\"incomplete\"" => "incomplete",
        "\"failed\"" => "failed",
        "\"cancelled\"" => "cancelled",
        _ => "other",
    })
}

/// The splices that give a response object the client's ids and model name.
fn response_splices(json: &[u8], obj: &ResponseLite<'_>, edits: &Edits, out: &mut Vec<Splice>) {
    let mut put = |raw: Option<&RawValue>, value: &dyn Fn(&str) -> String| {
        let Some(raw) = raw else { return };
        let (Some(old), Some(span)) = (string_of(raw), span_in(json, raw)) else {
            return;
        };
        out.push(Splice {
            span,
            with: edit::json_string(&value(&old)),
        });
    };
    if let Some(prefix) = &edits.issue_ids {
        put(obj.id, &|old| format!("{prefix}{old}"));
        put(obj.previous_response_id, &|old| format!("{prefix}{old}"));
    }
    if let Some(to) = &edits.rename_model {
        put(obj.model, &|_| to.clone());
    }
}

impl ClientApi for Responses {
    fn path(&self) -> &'static str {
        "/v1/responses"
    }

    fn label(&self) -> &'static str {
        "responses"
    }

    fn parse(&self, body: &[u8]) -> Result<RequestFields, ApiError> {
        let mut fields = request::parse(PromptField::Input, body)?;
        fields.max_tokens = max_output_tokens(parse_extra(body)?.max_output_tokens)?;
        Ok(fields)
    }

    fn expected_output(&self, fields: &RequestFields, default: u64) -> u64 {
        fields.max_tokens.unwrap_or(default)
    }

    fn force_stream_usage(&self, _body: &[u8], _fields: &RequestFields) -> Option<Splice> {
        None // the final lifecycle event always carries the usage
    }

    fn inspect(&self, data: &[u8]) -> Seen {
        let event = match serde_json::from_slice::<EventLite<'_>>(data) {
            Ok(e) => e,
            Err(e) => {
                return Seen {
                    invalid: !wire::is_json(data, &e),
                    ..Seen::default()
                }
            }
        };
        let kind = event.kind.as_deref().unwrap_or("");
        let mut seen = Seen::default();
        match kind {
            "response.completed" => (seen.done, seen.finish) = (true, Some("completed")),
            "response.incomplete" => (seen.done, seen.finish) = (true, Some("incomplete")),
            "response.failed" => (seen.done, seen.error) = (true, true),
            "error" => seen.error = true,
            _ => {}
        }
        seen.text = kind.ends_with(".delta")
            && event
                .delta
                .is_some_and(|d| d.get() != "\"\"" && d.get() != "null");
        if seen.done {
            seen.usage = event
                .response
                .and_then(|r| serde_json::from_str::<ResponseLite<'_>>(r.get()).ok())
                .and_then(|r| r.usage)
                .map(Usage::from);
        }
        seen
    }

    fn whole(&self, json: &[u8]) -> Result<Whole, serde_json::Error> {
        #[derive(Deserialize)]
        struct Answer<'a> {
            #[serde(default)]
            usage: Option<UsageLite>,
            #[serde(borrow, default)]
            status: Option<&'a RawValue>,
        }
        match serde_json::from_slice::<Answer<'_>>(json) {
            Ok(a) => Ok(Whole {
                usage: a.usage.map(Usage::from),
                finish: a.status.and_then(final_status),
            }),
            Err(e) if wire::is_json(json, &e) => Ok(Whole::default()),
            Err(e) => Err(e),
        }
    }

    fn edit(&self, json: &[u8], edits: &Edits) -> Option<Bytes> {
        let mut splices = Vec::new();
        let event: EventLite<'_> = serde_json::from_slice(json).ok()?;
        match (event.kind.as_deref(), event.response) {
            // A lifecycle event: the response object is nested.
            (Some(_), Some(raw)) => {
                if let Ok(obj) = serde_json::from_str::<ResponseLite<'_>>(raw.get()) {
                    response_splices(json, &obj, edits, &mut splices);
                }
            }
            // Another event: nothing in it names the response or the model.
            (Some(_), None) => {}
            // A whole answer (`object: "response"`, no `type`).
            (None, _) => {
                let obj: ResponseLite<'_> = serde_json::from_slice(json).ok()?;
                response_splices(json, &obj, edits, &mut splices);
            }
        }
        Some(edit::apply(&Bytes::copy_from_slice(json), splices))
    }

    fn end_event(&self) -> Option<&'static [u8]> {
        None
    }

    fn stream_error_event(&self, err: &ApiError) -> Bytes {
        stream_error_event(err)
    }

    fn id_prefix(&self) -> &'static str {
        ids::PREFIX
    }

    fn native(&self, kind: BackendKind) -> bool {
        matches!(kind, BackendKind::Vllm | BackendKind::Ollama)
    }

    fn needs_state(&self, body: &[u8]) -> Option<&'static str> {
        let extra = parse_extra(body).ok()?;
        if extra
            .previous_response_id
            .is_some_and(|r| r.get() != "null")
        {
            Some("previous_response_id")
        } else if extra.background == Some(true) {
            Some("background")
        } else if extra.store == Some(true) {
            Some("store")
        } else {
            None
        }
    }

    fn pending(&self, whole: &[u8]) -> Option<String> {
        #[derive(Deserialize)]
        struct Status<'a> {
            #[serde(borrow, default)]
            id: Option<Cow<'a, str>>,
            #[serde(borrow, default)]
            status: Option<Cow<'a, str>>,
            #[serde(default)]
            usage: Option<UsageLite>,
        }
        let s: Status<'_> = serde_json::from_slice(whole).ok()?;
        let running = matches!(s.status.as_deref(), Some("queued" | "in_progress"));
        (running && s.usage.is_none())
            .then(|| s.id.map(Cow::into_owned))
            .flatten()
    }

    fn keeps_state(&self, kind: BackendKind) -> bool {
        kind == BackendKind::Vllm // Ollama answers but stores nothing
    }

    fn continuation(&self) -> Option<&'static dyn super::continuation::Continuation> {
        Some(super::continuation::responses::RESPONSES_CONTINUATION)
    }

    fn translator(&self) -> Option<&'static dyn super::translate::Translator> {
        Some(super::translate::responses::TRANSLATOR)
    }

    fn unserved(&self, model: &str, _kinds: &[BackendKind]) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "The model `{model}` is not served by any backend that speaks the Responses API \
                 (vLLM and Ollama backends do); use /v1/chat/completions for it."
            ),
        )
        .with_param("model")
        .with_code("model_not_found")
    }

    fn tokenize_form(&self, _prompt: &[u8]) -> Option<TokenizeForm> {
        None // input items are not one chat template's messages; the estimate is used
    }

    fn pin(&self, body: &[u8], tenant: &str) -> Result<Option<Pin>, ApiError> {
        let Some(raw) = parse_extra(body)?.previous_response_id else {
            return Ok(None);
        };
        if raw.get() == "null" {
            return Ok(None);
        }
        let id = string_of(raw).ok_or_else(|| {
            ApiError::bad_request("`previous_response_id` must be a string.")
                .with_param("previous_response_id")
        })?;
        let mut pin = self.locate(&id, tenant)?;
        pin.splice = Some(Splice {
            span: span_in(body, raw).ok_or_else(|| not_found(&id))?,
            with: edit::json_string(&pin.backend_id),
        });
        Ok(Some(pin))
    }

    fn locate(&self, id: &str, tenant: &str) -> Result<Pin, ApiError> {
        let decoded = ids::decode(id)
            .filter(|d| d.created_by(tenant))
            .ok_or_else(|| not_found(id))?;
        Ok(Pin {
            id: id.to_string(),
            holder_tag: decoded.backend_tag.to_string(),
            backend_id: decoded.backend_id.to_string(),
            splice: None,
        })
    }

    fn issued_ids(&self, backend: &str, tenant: &str) -> Option<String> {
        Some(ids::issued_prefix(backend, tenant))
    }
}

/// The Responses API's `error` event, whose data also carries OpenAI's `error` object: the
/// OpenAI SDKs' stream reader raises `APIError` on an event whose data has an `error` member
/// (a bare `{"type":"error",…}` would be handed to the application as one more event).
pub fn stream_error_event(err: &ApiError) -> Bytes {
    let body: serde_json::Value =
        serde_json::from_str(&err.body_json()).unwrap_or(serde_json::Value::Null);
    let event = serde_json::json!({
        "type": "error",
        "code": err.code,
        "message": err.message,
        "param": err.param,
        "error": body.get("error"),
    });
    Bytes::from(format!("event: error\ndata: {event}\n\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIFECYCLE: &[u8] = br#"{"response":{"id":"resp_9d18","model":"tiny","previous_response_id":null,"status":"incomplete","usage":{"input_tokens":11,"output_tokens":6,"total_tokens":17}},"sequence_number":9,"type":"response.completed"}"#;

    #[test]
    fn routed_fields_and_output() {
        let body = br#"{"model":"m","input":"hello there","max_output_tokens":9,"stream":true}"#;
        let f = RESPONSES.parse(body).unwrap();
        assert_eq!(f.max_tokens, Some(9));
        assert!(RESPONSES.streams(&f));
        assert_eq!(RESPONSES.expected_output(&f, 100), 9);
        let f = RESPONSES
            .parse(br#"{"model":"m","input":[{"role":"user","content":"hi"}]}"#)
            .unwrap();
        assert_eq!(RESPONSES.expected_output(&f, 100), 100);
        for bad in [
            &br#"{"model":"m"}"#[..],
            br#"{"model":"m","input":"x","max_output_tokens":-1}"#,
            br#"{"model":"m","input":"x","max_output_tokens":"9"}"#,
        ] {
            assert_eq!(RESPONSES.parse(bad).unwrap_err().status, 400);
        }
        assert!(RESPONSES.native(BackendKind::Vllm) && RESPONSES.native(BackendKind::Ollama));
        for kind in [BackendKind::Tgi, BackendKind::OpenAi] {
            assert!(!RESPONSES.native(kind));
        }
        // Ollama answers but stores nothing: what needs a store goes to vLLM only.
        assert!(
            RESPONSES.keeps_state(BackendKind::Vllm) && !RESPONSES.keeps_state(BackendKind::Ollama)
        );
        for (body, field) in [
            (
                &br#"{"model":"m","input":"x","previous_response_id":"resp_1"}"#[..],
                Some("previous_response_id"),
            ),
            (
                br#"{"model":"m","input":"x","background":true}"#,
                Some("background"),
            ),
            (br#"{"model":"m","input":"x","store":true}"#, Some("store")),
            (
                br#"{"model":"m","input":"x","store":false,"background":false}"#,
                None,
            ),
            (
                br#"{"model":"m","input":"x","previous_response_id":null}"#,
                None,
            ),
            (br#"{"model":"m","input":"x"}"#, None),
        ] {
            assert_eq!(RESPONSES.needs_state(body), field);
        }
        let err = RESPONSES.stateless("m", "store", &[BackendKind::Ollama]);
        assert_eq!(
            (err.status.as_u16(), err.param.as_deref()),
            (400, Some("store"))
        );
        assert!(err.message.contains("(ollama)"), "{}", err.message);
        let err = RESPONSES.unserved("m", &[BackendKind::Tgi]);
        assert!(err.status == 404 && err.message.contains("Responses API"));
    }

    #[test]
    fn usage_whole_and_streamed() {
        let whole = br#"{"id":"resp_1","object":"response","usage":{"input_tokens":11,"output_tokens":8,"total_tokens":19}}"#;
        let u = RESPONSES.whole_usage(whole).unwrap().unwrap();
        assert_eq!((u.prompt_tokens, u.completion_tokens), (11, 8));
        assert_eq!(RESPONSES.whole_usage(br#"{"usage":null}"#).unwrap(), None);
        assert!(RESPONSES.whole_usage(b"data: x").is_err());
        let s = RESPONSES.inspect(LIFECYCLE);
        assert!(s.done && !s.error);
        assert_eq!(s.usage.map(|u| u.completion_tokens), Some(6));
        let s = RESPONSES.inspect(br#"{"delta":" under","type":"response.output_text.delta"}"#);
        assert!(s.text && !s.done);
        assert!(
            !RESPONSES
                .inspect(br#"{"type":"response.created","response":{}}"#)
                .done
        );
        assert!(
            RESPONSES
                .inspect(br#"{"type":"error","message":"x"}"#)
                .error
        );
        assert!(RESPONSES.inspect(b"{not json").invalid);
        assert_eq!(RESPONSES.end_event(), None);
    }

    #[test]
    fn a_background_answer_is_pending_until_final() {
        let queued = br#"{"id":"resp_1","status":"queued","usage":null}"#;
        assert_eq!(RESPONSES.pending(queued).as_deref(), Some("resp_1"));
        let running = br#"{"id":"resp_1","status":"in_progress"}"#;
        assert_eq!(RESPONSES.pending(running).as_deref(), Some("resp_1"));
        for done in [
            &br#"{"id":"resp_1","status":"completed","usage":{"input_tokens":1,"output_tokens":2}}"#[..],
            br#"{"id":"resp_1","status":"cancelled","usage":null}"#,
            br#"{"id":"resp_1","status":"failed"}"#,
            br#"not json"#,
        ] {
            assert_eq!(RESPONSES.pending(done), None);
        }
    }

    #[test]
    fn ids_and_model_are_rewritten_whole_and_in_events() {
        let edits = Edits {
            rename_model: Some("client-model".into()),
            issue_ids: Some("resp_0000000011111111_".into()),
            ..Edits::default()
        };
        assert!(!edits.is_passthrough() && edits.edits_whole());
        let out = RESPONSES.edit(LIFECYCLE, &edits).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["response"]["id"], "resp_0000000011111111_resp_9d18");
        assert_eq!(v["response"]["model"], "client-model");
        assert!(v["response"]["previous_response_id"].is_null());
        let whole = br#"{"id":"resp_2","model":"tiny","object":"response","previous_response_id":"resp_1","output":[{"id":"msg_1"}]}"#;
        let v: serde_json::Value =
            serde_json::from_slice(&RESPONSES.edit(whole, &edits).unwrap()).unwrap();
        assert_eq!(v["id"], "resp_0000000011111111_resp_2");
        assert_eq!(v["previous_response_id"], "resp_0000000011111111_resp_1");
        assert_eq!(v["output"][0]["id"], "msg_1");
        let delta = br#"{"delta":"x","item_id":"msg_1","type":"response.output_text.delta"}"#;
        assert_eq!(&RESPONSES.edit(delta, &edits).unwrap()[..], &delta[..]);
    }

    #[test]
    fn previous_response_id_pins_to_its_holder() {
        let id = ids::encode("vllm-b", "team", "resp_abc");
        let body = format!(r#"{{"model":"m","input":"x","previous_response_id":"{id}"}}"#);
        let pin = RESPONSES.pin(body.as_bytes(), "team").unwrap().unwrap();
        assert!(pin.holds("vllm-b") && !pin.holds("vllm-a"));
        let out = edit::apply(&Bytes::from(body.clone()), pin.splice.into_iter().collect());
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["previous_response_id"], "resp_abc");
        // Another tenant, or an id Sluice did not issue: vLLM's unknown-id 404.
        let err = RESPONSES.pin(body.as_bytes(), "other").unwrap_err();
        assert_eq!(
            (err.status.as_u16(), err.param.as_deref()),
            (404, Some("response_id"))
        );
        let foreign = br#"{"model":"m","input":"x","previous_response_id":"resp_doesnotexist"}"#;
        assert_eq!(RESPONSES.pin(foreign, "team").unwrap_err().status, 404);
        let none = br#"{"model":"m","input":"x","previous_response_id":null}"#;
        assert!(RESPONSES.pin(none, "team").unwrap().is_none());
    }

    #[test]
    fn the_stream_error_event_is_typed_and_carries_an_error_object() {
        let event = RESPONSES.stream_error_event(&ApiError::bad_gateway("cut").with_code("x"));
        let text = std::str::from_utf8(&event).unwrap();
        let data = text
            .strip_prefix("event: error\ndata: ")
            .and_then(|t| t.strip_suffix("\n\n"))
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert_eq!(
            (v["type"].as_str(), v["message"].as_str()),
            (Some("error"), Some("cut"))
        );
        assert_eq!(v["error"]["message"], "cut");
        assert_eq!(v["error"]["code"], "x");
    }
}
