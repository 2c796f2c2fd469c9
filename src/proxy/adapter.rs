//! A LoRA adapter loaded on the chosen backend before a request naming it is sent there.
//!
//! Routing already priced the load (see [`crate::fleet::adapters`]); this makes it happen:
//! `POST /v1/load_lora_adapter` on a vLLM engine that does not hold the adapter, after
//! unloading its least recently used adapters not in use while the engine's adapter budget
//! (`max_adapters`, else its slots, else vLLM's default of one) is full. A victim stops
//! counting as held before its unload is sent, atomically with the in-flight count, so no
//! request is sent to an adapter being unloaded. Invariants: concurrent requests for one adapter on
//! one engine share one load (the first loads under the adapter's lock, the others find it
//! held); an engine that answers as one without run-time loading is not asked again for a
//! while and the request goes elsewhere; an engine that refuses the adapter itself (a path
//! with no adapter) makes the request fail with an error naming the adapter, and the engine
//! stays healthy; a transport failure or a server error is the engine's, so the request is
//! retried elsewhere like any failed attempt.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, StatusCode};

use crate::fleet::snapshot::Adapter;
use crate::fleet::Backend;
use crate::openai::ApiError;
use crate::telemetry::metrics as m;

/// The longest a load may take before the attempt goes elsewhere.
const LOAD_TIMEOUT: Duration = Duration::from_secs(120);
/// The largest answer read from a load or unload.
const MAX_ANSWER: usize = 64 * 1024;

/// Why the adapter is not on the backend.
#[derive(Debug)]
pub(super) enum Missing {
    /// This backend cannot load it now; another may.
    Elsewhere(ApiError),
    /// The adapter cannot be loaded anywhere: the client's answer.
    Refused(ApiError),
}

/// Make sure `backend` holds `adapter`, loading it when it does not.
pub(super) async fn ensure(backend: &Backend, adapter: &Adapter) -> Result<(), Missing> {
    let held = backend.state.adapters();
    if held.holds(&adapter.name) {
        return Ok(());
    }
    let Some(path) = adapter.path.as_deref() else {
        return Err(Missing::Elsewhere(not_held(backend, adapter)));
    };
    let lock = held.load_lock(&adapter.name);
    let _loading = lock.lock().await;
    if held.holds(&adapter.name) {
        return Ok(());
    }
    make_room(backend).await;
    let started = Instant::now();
    let body = serde_json::json!({ "lora_name": adapter.name, "lora_path": path });
    let answer = tokio::time::timeout(
        LOAD_TIMEOUT,
        backend.call(
            Method::POST,
            "/v1/load_lora_adapter",
            Some(Bytes::from(body.to_string())),
            MAX_ANSWER,
        ),
    )
    .await;
    let outcome = match answer {
        Err(_) => Err(Missing::Elsewhere(failed(backend, adapter, "timed out"))),
        Ok(Err(e)) => Err(Missing::Elsewhere(failed(backend, adapter, &e.to_string()))),
        Ok(Ok((status, body))) => judge(backend, adapter, status, &body, started.elapsed()),
    };
    let label = match &outcome {
        Ok(()) => "loaded",
        Err(Missing::Elsewhere(_)) => "failed",
        Err(Missing::Refused(_)) => "refused",
    };
    m::adapter_load(backend.name(), label, started.elapsed());
    outcome
}

/// What the engine's answer to a load means.
fn judge(
    backend: &Backend,
    adapter: &Adapter,
    status: StatusCode,
    body: &[u8],
    took: Duration,
) -> Result<(), Missing> {
    let held = backend.state.adapters();
    let message = engine_message(body);
    if status.is_success() {
        held.loaded(&adapter.name, &adapter.base, took);
        return Ok(());
    }
    if status == StatusCode::BAD_REQUEST && message.contains("already been loaded") {
        // another gateway replica loaded it meanwhile: held, but this took no load's time
        held.listed_now(&adapter.name, &adapter.base);
        return Ok(());
    }
    if is_route_missing(status, body) {
        held.refuse_run_time_loading();
        return Err(Missing::Elsewhere(failed(
            backend,
            adapter,
            "the engine does not load adapters at run time",
        )));
    }
    if status.is_client_error() {
        return Err(Missing::Refused(
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                format!(
                    "The LoRA adapter `{}` could not be loaded on backend `{}`: {message}",
                    adapter.name,
                    backend.name()
                ),
            )
            .with_code("adapter_load_failed"),
        ));
    }
    Err(Missing::Elsewhere(failed(
        backend,
        adapter,
        &format!("{status}: {message}"),
    )))
}

/// Unload the engine's least recently used adapters not in use until one more fits its budget.
/// Best effort: an engine that keeps one only holds more than the budget (and a request for
/// it finds it missing and loads it, which the engine answers "already loaded").
async fn make_room(backend: &Backend) {
    let held = backend.state.adapters();
    let budget = held.budget(backend.config.max_adapters);
    for victim in held.take_victims(budget) {
        unload(backend, &victim).await;
    }
}

async fn unload(backend: &Backend, victim: &str) {
    let body = serde_json::json!({ "lora_name": victim });
    let answer = tokio::time::timeout(
        LOAD_TIMEOUT,
        backend.call(
            Method::POST,
            "/v1/unload_lora_adapter",
            Some(Bytes::from(body.to_string())),
            MAX_ANSWER,
        ),
    )
    .await;
    if let Ok(Ok((status, _))) = answer {
        if status.is_success() {
            m::adapter_unload(backend.name());
        }
    }
}

/// A load route that does not exist (vLLM without run-time updating answers 404 with
/// FastAPI's `{"detail":"Not Found"}`, or 405).
fn is_route_missing(status: StatusCode, body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Detail {
        detail: String,
    }
    status == StatusCode::METHOD_NOT_ALLOWED
        || (status == StatusCode::NOT_FOUND
            && serde_json::from_slice::<Detail>(body).is_ok_and(|d| d.detail == "Not Found"))
}

/// The message of an engine's error answer (`{"error":{"message"}}`, `{"message"}`,
/// `{"detail"}`), else its text.
fn engine_message(body: &[u8]) -> String {
    let v: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let found = [
        v.pointer("/error/message"),
        v.get("message"),
        v.get("detail"),
    ]
    .into_iter()
    .flatten()
    .find_map(|m| m.as_str());
    match found {
        Some(m) => m.to_string(),
        None => String::from_utf8_lossy(&body[..body.len().min(512)])
            .trim()
            .to_string(),
    }
}

fn failed(backend: &Backend, adapter: &Adapter, why: &str) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "server_error",
        format!(
            "Backend `{}` could not load the LoRA adapter `{}`: {why}",
            backend.name(),
            adapter.name
        ),
    )
    .with_code("adapter_load_failed")
}

fn not_held(backend: &Backend, adapter: &Adapter) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "server_error",
        format!(
            "Backend `{}` no longer holds the LoRA adapter `{}`, and no path is configured \
             to load it from",
            backend.name(),
            adapter.name
        ),
    )
    .with_code("adapter_unavailable")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_messages_and_missing_routes_are_read_from_real_shapes() {
        let bad = br#"{"error":{"message":"Loading lora bad failed: No adapter found for /nonexistent/adapter","type":"NotFoundError","param":null,"code":404}}"#;
        assert_eq!(
            engine_message(bad),
            "Loading lora bad failed: No adapter found for /nonexistent/adapter"
        );
        assert!(!is_route_missing(StatusCode::NOT_FOUND, bad));
        assert!(is_route_missing(
            StatusCode::NOT_FOUND,
            br#"{"detail":"Not Found"}"#
        ));
        assert!(is_route_missing(StatusCode::METHOD_NOT_ALLOWED, b""));
        assert_eq!(engine_message(b"plain words\n"), "plain words");
    }
}
