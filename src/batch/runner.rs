//! The runner: one task that takes the batches' lines to the request path while the fleet
//! has room ([`super::headroom`]), at most `[batch] max_in_flight` at once over all batches,
//! one line per batch in turn; then writes each finished batch's output and error files.
//!
//! Invariants:
//! - A line's result is recorded by the task that ran it, once ([`super::store`]); a line
//!   put back (capacity, limits) or cut by a stop has none and runs again.
//! - A batch is finalized only when no line of it runs: its files hold every recorded line,
//!   in input order, each once.
//! - Lines of a cancelled batch that did not start are not run; those of an expired batch go
//!   to its error file as `batch_expired`.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{header, Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::input::{self, Line, Parsed, Refused};
use super::record::{new_id, now, BatchFailure, BatchRecord, FileMeta, Status};
use super::store::LineResult;
use super::{BatchError, Batches};
use crate::api::ClientApi;
use crate::auth::ActingAs;
use crate::gateway::Gateway;
use crate::telemetry::metrics as m;

/// How often waiting lines look for room again.
const TICK: Duration = Duration::from_millis(20);
/// Largest answer body kept for one line.
const MAX_ANSWER: usize = 64 * 1024 * 1024;
/// How long a batch waits after a 503 that named no `Retry-After`.
const DEFAULT_HOLD: Duration = Duration::from_millis(500);
/// Longest wait after a refusal (a budget's `Retry-After` can be a month).
const MAX_HOLD: Duration = Duration::from_secs(60);

/// A batch being run.
struct Job {
    /// What every line of it shares.
    shared: Arc<JobRef>,
    pending: VecDeque<Line>,
    running: usize,
    held_until: Option<Instant>,
    cancelling: bool,
    record: BatchRecord,
}

/// What a line's task needs of its batch.
struct JobRef {
    id: String,
    endpoint: String,
    api: &'static dyn ClientApi,
    key: String,
}

/// How a line's run ended.
enum Ran {
    Recorded,
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

/// Run batches until `stop` turns true; lines in flight then are dropped (they run again at
/// the next start).
pub async fn run(b: Arc<Batches>, gw: Arc<Gateway>, mut stop: watch::Receiver<bool>) {
    let mut jobs: HashMap<String, Job> = HashMap::new();
    let mut tasks: JoinSet<(String, Ran)> = JoinSet::new();
    let mut sync = true;
    loop {
        if sync {
            sync = false;
            if let Err(e) = refresh(&b, &mut jobs).await {
                tracing::error!(error = %e, "batch runner cannot read its jobs");
            }
        }
        dispatch(&b, &gw, &mut jobs, &mut tasks);
        finish_done(&b, &mut jobs).await;
        publish(&jobs);
        let waiting = jobs.values().any(|j| !j.pending.is_empty());
        tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            _ = b.wake.notified() => sync = true,
            Some(done) = tasks.join_next(), if !tasks.is_empty() => settle(&mut jobs, done),
            _ = tokio::time::sleep(TICK), if waiting => {}
        }
    }
    tasks.shutdown().await;
}

/// The gauges of queued and running lines.
fn publish(jobs: &HashMap<String, Job>) {
    let queued: usize = jobs.values().map(|j| j.pending.len()).sum();
    let running: usize = jobs.values().map(|j| j.running).sum();
    metrics::gauge!(m::BATCH_LINES_QUEUED).set(queued as f64);
    metrics::gauge!(m::BATCH_LINES_RUNNING).set(running as f64);
}

/// A line's task ended.
fn settle(jobs: &mut HashMap<String, Job>, done: Result<(String, Ran), tokio::task::JoinError>) {
    let Ok((id, ran)) = done else {
        return; // (a panicked line has no result: it runs again at the next start)
    };
    let Some(job) = jobs.get_mut(&id) else {
        return;
    };
    job.running = job.running.saturating_sub(1);
    if let Ran::Deferred { line, after } = ran {
        if !job.cancelling {
            job.pending.push_front(line);
            let until = Instant::now() + after.min(MAX_HOLD);
            job.held_until = Some(job.held_until.map_or(until, |h| h.max(until)));
        }
    }
}

/// Read the batches from the store: new ones validated and loaded, cancelled ones stopped.
async fn refresh(b: &Arc<Batches>, jobs: &mut HashMap<String, Job>) -> Result<(), BatchError> {
    let records = b.blocking(|b| b.store.batches()).await?;
    for rec in records {
        if rec.status().finished() {
            jobs.remove(rec.id());
            continue;
        }
        if let Some(job) = jobs.get_mut(rec.id()) {
            if rec.status() == Status::Cancelling && !job.cancelling {
                job.cancelling = true;
                job.pending.clear();
            }
            continue;
        }
        let id = rec.id().to_string();
        match b.blocking(move |b| load(b, &rec)).await {
            Ok(Some(job)) => {
                jobs.insert(id, job);
            }
            Ok(None) => {}
            Err(e) => tracing::error!(batch = %id, error = %e, "cannot load a batch"),
        }
    }
    Ok(())
}

/// A batch's job: its input read, refused lines recorded and the batch started when it was
/// validating, the lines that have no result yet pending. `None`: it failed validation.
fn load(b: &Batches, rec: &BatchRecord) -> Result<Option<Job>, BatchError> {
    let fail = |code: &str, message: String| {
        let failure = BatchFailure {
            code: code.into(),
            message,
            param: Some("input_file_id".into()),
            line: None,
        };
        b.store.update_batch(rec.id(), |r| r.fail(vec![failure]))?;
        Ok(None)
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
    let refused: Vec<LineResult> = parsed
        .iter()
        .filter_map(|p| match p {
            Parsed::Refused(r) => Some(refused_line(r)),
            Parsed::Run(_) => None,
        })
        .collect();
    let model = parsed.iter().find_map(|p| match p {
        Parsed::Run(l) => l.model.clone(),
        Parsed::Refused(_) => None,
    });
    let rec = match rec.status() {
        Status::Validating => {
            let started = b
                .store
                .record_lines(rec.id(), &refused, |r| r.start(total as u64, model))?;
            match started {
                Some(r) => r,
                None => return Ok(None),
            }
        }
        _ => rec.clone(),
    };
    let done = b.store.done_lines(rec.id())?;
    let cancelling = rec.status() == Status::Cancelling;
    let pending = parsed
        .into_iter()
        .filter_map(|p| match p {
            Parsed::Run(l) if !cancelling && !done.contains(&l.index) => Some(l),
            _ => None,
        })
        .collect();
    Ok(Some(Job {
        shared: Arc::new(JobRef {
            id: rec.id().to_string(),
            endpoint: rec.endpoint().to_string(),
            api,
            key: rec.key().to_string(),
        }),
        pending,
        running: 0,
        held_until: None,
        cancelling,
        record: rec,
    }))
}

/// A refused line as OpenAI writes it to the error file.
fn refused_line(r: &Refused) -> LineResult {
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

/// Start lines while there is room: one per batch in turn, each only while its model has room.
fn dispatch(
    b: &Arc<Batches>,
    gw: &Arc<Gateway>,
    jobs: &mut HashMap<String, Job>,
    tasks: &mut JoinSet<(String, Ran)>,
) {
    let now = Instant::now();
    let max = b.config.max_in_flight;
    loop {
        let mut started = false;
        for job in jobs.values_mut() {
            if tasks.len() >= max {
                return;
            }
            if job.cancelling || job.held_until.is_some_and(|h| h > now) {
                continue;
            }
            let Some(front) = job.pending.front() else {
                continue;
            };
            if !super::headroom::has_room(gw, front.model.as_deref()) {
                continue;
            }
            let Some(line) = job.pending.pop_front() else {
                continue;
            };
            job.running += 1;
            started = true;
            let (b, gw, shared) = (b.clone(), gw.clone(), job.shared.clone());
            tasks.spawn(async move {
                let ran = run_line(&b, gw, &shared, line).await;
                (shared.id.clone(), ran)
            });
        }
        if !started {
            return;
        }
    }
}

/// Run one line through the request path as the batch's key and record its result.
async fn run_line(b: &Arc<Batches>, gw: Arc<Gateway>, job: &JobRef, line: Line) -> Ran {
    let request_id = new_id("batch_req_");
    let req = Request::post(job.endpoint.as_str())
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-request-id", request_id.as_str())
        .extension(ActingAs::key(&job.key))
        .body(Body::from(line.body.clone()));
    let Ok(req) = req else {
        return Ran::Deferred {
            line,
            after: MAX_HOLD,
        };
    };
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
        return Ran::Deferred { line, after };
    }
    let body = match Limited::new(resp.into_body(), MAX_ANSWER).collect().await {
        Ok(c) => c.to_bytes(),
        Err(_) => {
            return Ran::Deferred {
                line,
                after: DEFAULT_HOLD,
            }
        }
    };
    let body: Value = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    let ok = status.is_success();
    let out = json!({
        "id": request_id,
        "custom_id": line.custom_id,
        "response": {"status_code": status.as_u16(), "request_id": request_id, "body": body},
        "error": null,
    });
    let result = LineResult {
        index: line.index,
        ok,
        line: out.to_string().into_bytes(),
    };
    let id = job.id.clone();
    match b
        .blocking(move |b| b.store.record_lines(&id, &[result], |_| {}))
        .await
    {
        Ok(_) => {
            let outcome = if ok { "completed" } else { "failed" };
            metrics::counter!(m::BATCH_LINES_TOTAL, "outcome" => outcome).increment(1);
            Ran::Recorded
        }
        Err(e) => {
            tracing::error!(batch = %job.id, error = %e, "cannot record a batch line");
            Ran::Deferred {
                line,
                after: MAX_HOLD,
            }
        }
    }
}

/// `Retry-After` in whole seconds.
fn retry_after(h: &http::HeaderMap) -> Option<Duration> {
    let s = h.get(header::RETRY_AFTER)?.to_str().ok()?;
    s.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// Finalize the batches that have nothing left to run: expired ones first give their
/// pending lines to the error file.
async fn finish_done(b: &Arc<Batches>, jobs: &mut HashMap<String, Job>) {
    let at = now();
    let mut done = Vec::new();
    for (id, job) in jobs.iter_mut() {
        if job.running > 0 {
            continue;
        }
        let expired = job.record.expired(at);
        if job.pending.is_empty() || job.cancelling || expired {
            let unrun: Vec<Line> = if expired {
                job.pending.drain(..).collect()
            } else {
                Vec::new()
            };
            done.push((id.clone(), unrun));
        }
    }
    for (id, unrun) in done {
        let key = id.clone();
        match b.blocking(move |b| finalize(b, &key, &unrun)).await {
            Ok(()) => {
                jobs.remove(&id);
            }
            Err(e) => tracing::error!(batch = %id, error = %e, "cannot finalize a batch"),
        }
    }
}

/// Write a batch's output and error files from its recorded lines and finish it.
fn finalize(b: &Batches, id: &str, unrun: &[Line]) -> Result<(), BatchError> {
    let expired: Vec<LineResult> = unrun
        .iter()
        .map(|l| {
            refused_line(&Refused {
                index: l.index,
                custom_id: Some(l.custom_id.clone()),
                code: "batch_expired",
                message: "This line was not run before the batch expired.".into(),
            })
        })
        .collect();
    b.store.record_lines(id, &expired, BatchRecord::finalize)?;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    b.store.each_line(id, |r| {
        let to = if r.ok { &mut out } else { &mut err };
        to.extend_from_slice(&r.line);
        to.push(b'\n');
        Ok(())
    })?;
    let Some(rec) = b.store.batch(id)? else {
        return Ok(());
    };
    let suffix = id.strip_prefix("batch_").unwrap_or(id);
    let mut files = Vec::new();
    for (content, kind) in [(out, "output"), (err, "error")] {
        if content.is_empty() {
            files.push(None);
            continue;
        }
        let file_id = format!("file-{suffix}-{kind}");
        let n = b.blobs.write(&file_id, [content.as_slice()])?;
        let name = format!("{id}_{kind}.jsonl");
        files.push(Some(FileMeta::new(
            file_id,
            n,
            name,
            "batch_output",
            rec.tenant(),
        )));
    }
    let ids: Vec<Option<String>> = files
        .iter()
        .map(|f| f.as_ref().map(|m| m.id().to_string()))
        .collect();
    let metas: Vec<FileMeta> = files.into_iter().flatten().collect();
    let at = now();
    b.store.finish(id, &metas, |r| {
        r.finish(ids[0].clone(), ids[1].clone(), at, !unrun.is_empty());
    })?;
    Ok(())
}
