//! One batch line's run and the lines written for it, shared by both runners (one replica:
//! [`super::runner`]; several: [`super::shared`]): a batch's input checked as a whole, a
//! line taken through the request path as the batch's key, a refused or expired line as
//! OpenAI writes it to the error file.
//!
//! Invariant: a line's result is produced here and recorded by the caller; a line answered
//! 429 or 503 (limits, capacity), whose answer cannot be read, or that gave its slot to an
//! interactive request ([`MakeRoom`]) has no result and comes back to the caller to run again.
//!
//! [`MakeRoom`]: crate::fleet::make_room::MakeRoom

use std::time::Duration;

use axum::body::Body;
use http::{header, Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde_json::{json, Value};

use super::input::{self, Line, Parsed, Refused};
use super::record::{new_id, BatchFailure, BatchRecord};
use super::store::LineResult;
use super::{BatchError, Batches};
use crate::api::ClientApi;
use crate::auth::ActingAs;
use crate::fleet::make_room::Background;
use crate::gateway::Gateway;
use crate::telemetry::metrics as m;

/// Largest answer body kept for one line.
const MAX_ANSWER: usize = 64 * 1024 * 1024;
/// How long a batch waits after a 503 that named no `Retry-After`.
pub const DEFAULT_HOLD: Duration = Duration::from_millis(500);
/// Longest wait after a refusal (a budget's `Retry-After` can be a month).
pub const MAX_HOLD: Duration = Duration::from_secs(60);

/// What a line's run needs of its batch.
pub struct JobRef {
    pub id: String,
    pub endpoint: String,
    pub api: &'static dyn ClientApi,
    pub key: String,
}

/// How a line's run ended.
pub enum Ran {
    Done(LineResult),
    /// Put back: run it again after `after`.
    Deferred {
        line: Line,
        after: Duration,
    },
}

fn api_of(endpoint: &str) -> Option<&'static dyn ClientApi> {
    Some(match endpoint {
        "/v1/chat/completions" => crate::api::CHAT,
        "/v1/completions" => crate::api::COMPLETIONS,
        "/v1/embeddings" => crate::api::EMBEDDINGS,
        "/v1/responses" => crate::api::RESPONSES,
        _ => return None,
    })
}

/// A batch's input, checked as a whole.
pub struct Input {
    pub job: JobRef,
    /// Its non-blank lines in order.
    pub parsed: Vec<Parsed>,
    /// The model the first line to run names (OpenAI's `model`).
    pub model: Option<String>,
}

/// Read and parse a batch's input file: `Err(failure)` when the batch fails as a whole
/// (unknown endpoint, no file, no lines, too many).
pub fn read_input(
    b: &Batches,
    rec: &BatchRecord,
) -> Result<Result<Input, BatchFailure>, BatchError> {
    let fail = |code: &str, message: String| {
        Ok(Err(BatchFailure {
            code: code.into(),
            message,
            param: Some("input_file_id".into()),
            line: None,
        }))
    };
    let Some(api) = api_of(rec.endpoint()) else {
        return fail(
            "invalid_value",
            format!("Unknown endpoint {}.", rec.endpoint()),
        );
    };
    let file = match b.blobs.read(rec.input_file_id()) {
        Ok(f) => f,
        Err(BatchError::NotFound) => {
            return fail("invalid_file", "The input file no longer exists.".into())
        }
        Err(e) => return Err(e),
    };
    let total = input::count(&file);
    if total == 0 {
        return fail("empty_file", "The input file has no request lines.".into());
    }
    if total > b.config.max_lines {
        return fail(
            "too_many_requests",
            format!(
                "The input file has {total} request lines; a batch holds at most {}.",
                b.config.max_lines
            ),
        );
    }
    let parsed = input::parse(&file, rec.endpoint());
    let model = parsed.iter().find_map(|p| match p {
        Parsed::Run(l) => l.model.clone(),
        Parsed::Refused(_) => None,
    });
    Ok(Ok(Input {
        job: JobRef {
            id: rec.id().to_string(),
            endpoint: rec.endpoint().to_string(),
            api,
            key: rec.key().to_string(),
        },
        parsed,
        model,
    }))
}

/// A refused line as OpenAI writes it to the error file.
pub fn refused_line(r: &Refused) -> LineResult {
    let line = json!({
        "id": new_id("batch_req_"),
        "custom_id": r.custom_id,
        "response": null,
        "error": {"code": r.code, "message": r.message},
    });
    LineResult {
        index: r.index,
        ok: false,
        line: line.to_string().into_bytes(),
    }
}

/// A line not run before its batch expired.
pub fn expired_line(l: &Line) -> LineResult {
    refused_line(&Refused {
        index: l.index,
        custom_id: Some(l.custom_id.clone()),
        code: "batch_expired",
        message: "This line was not run before the batch expired.".into(),
    })
}

/// Run one line through the request path as the batch's key, in the background: its result,
/// or the line back (refused for now, or stopped to give its slot to an interactive request).
pub async fn execute(gw: std::sync::Arc<Gateway>, b: &Batches, job: &JobRef, line: Line) -> Ran {
    let model = line
        .model
        .as_deref()
        .map(|m| gw.runtime().fleet.canonical(m).to_string());
    let me = Background::default();
    let run = answer(gw.clone(), job, line.body.clone(), me.clone());
    let answer = match &model {
        Some(model) => tokio::select! {
            a = run => a,
            () = gw.make_room.asked(model, &me) => {
                metrics::counter!(m::BATCH_LINES_DEFERRED_TOTAL, "reason" => "interactive")
                    .increment(1);
                return Ran::Deferred { line, after: Duration::ZERO };
            }
        },
        None => run.await,
    };
    let (request_id, status, body) = match answer {
        Answer::Whole(id, status, body) => (id, status, body),
        Answer::Later(after) => return Ran::Deferred { line, after },
    };
    let body: Value = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    if status.is_success() {
        b.budget().observe(&body);
    }
    let out = json!({
        "id": request_id,
        "custom_id": line.custom_id,
        "response": {"status_code": status.as_u16(), "request_id": request_id, "body": body},
        "error": null,
    });
    Ran::Done(LineResult {
        index: line.index,
        ok: status.is_success(),
        line: out.to_string().into_bytes(),
    })
}

/// A line's answer from the request path.
enum Answer {
    /// Its request id, status and whole body.
    Whole(String, StatusCode, bytes::Bytes),
    /// Refused for now (429, 503) or unreadable: run it again after this long.
    Later(Duration),
}

/// The line's request through the request path, as the batch's key, marked `me` (background).
async fn answer(
    gw: std::sync::Arc<Gateway>,
    job: &JobRef,
    body: bytes::Bytes,
    me: Background,
) -> Answer {
    let request_id = new_id("batch_req_");
    let req = Request::post(job.endpoint.as_str())
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-request-id", request_id.as_str())
        .extension(ActingAs::key(&job.key))
        .extension(me)
        .body(Body::from(body));
    let Ok(req) = req else {
        return Answer::Later(MAX_HOLD);
    };
    let started = std::time::Instant::now();
    let resp = crate::proxy::handle(gw, job.api, req).await;
    let status = resp.status();
    if status == StatusCode::TOO_MANY_REQUESTS || status == StatusCode::SERVICE_UNAVAILABLE {
        let after = retry_after(resp.headers()).unwrap_or(DEFAULT_HOLD);
        let reason = if status == StatusCode::TOO_MANY_REQUESTS {
            "limits"
        } else {
            "capacity"
        };
        metrics::counter!(m::BATCH_LINES_DEFERRED_TOTAL, "reason" => reason).increment(1);
        return Answer::Later(after);
    }
    let Ok(body) = Limited::new(resp.into_body(), MAX_ANSWER).collect().await else {
        return Answer::Later(DEFAULT_HOLD);
    };
    metrics::histogram!(m::BATCH_LINE_SECONDS).record(started.elapsed().as_secs_f64());
    Answer::Whole(request_id, status, body.to_bytes())
}

/// Count a recorded line in the metrics.
pub fn count_recorded(ok: bool) {
    let outcome = if ok { "completed" } else { "failed" };
    metrics::counter!(m::BATCH_LINES_TOTAL, "outcome" => outcome).increment(1);
}

/// `Retry-After` in whole seconds.
fn retry_after(h: &http::HeaderMap) -> Option<Duration> {
    let s = h.get(header::RETRY_AFTER)?.to_str().ok()?;
    s.trim().parse::<u64>().ok().map(Duration::from_secs)
}
