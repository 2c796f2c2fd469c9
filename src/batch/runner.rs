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

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::headroom::Headroom;
use super::input::{Line, Parsed};
use super::line::{self, JobRef, Ran, MAX_HOLD};
use super::record::{now, BatchRecord, FileMeta, Status};
use super::store::LineResult;
use super::{BatchError, Batches};
use crate::gateway::Gateway;
use crate::telemetry::metrics as m;

/// How often waiting lines look for room again.
const TICK: Duration = Duration::from_millis(20);

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

/// Run batches until `stop` turns true; lines in flight then are dropped (they run again at
/// the next start).
pub async fn run(b: Arc<Batches>, gw: Arc<Gateway>, mut stop: watch::Receiver<bool>) {
    let mut jobs: HashMap<String, Job> = HashMap::new();
    let mut tasks: JoinSet<(String, Option<(Line, Duration)>)> = JoinSet::new();
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
fn settle(
    jobs: &mut HashMap<String, Job>,
    done: Result<(String, Option<(Line, Duration)>), tokio::task::JoinError>,
) {
    let Ok((id, ran)) = done else {
        return; // (a panicked line has no result: it runs again at the next start)
    };
    let Some(job) = jobs.get_mut(&id) else {
        return;
    };
    job.running = job.running.saturating_sub(1);
    if let Some((line, after)) = ran {
        if !job.cancelling {
            job.pending.push_front(line);
            let until = Instant::now() + after.min(MAX_HOLD);
            job.held_until = Some(job.held_until.map_or(until, |h| h.max(until)));
        }
    }
}

/// Read the batches from the store: new ones validated and loaded, cancelled ones stopped.
async fn refresh(b: &Arc<Batches>, jobs: &mut HashMap<String, Job>) -> Result<(), BatchError> {
    let records = b.blocking(|b| b.local()?.batches()).await?;
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
    let store = b.local()?;
    let input = match line::read_input(b, rec)? {
        Ok(i) => i,
        Err(failure) => {
            store.update_batch(rec.id(), |r| r.fail(vec![failure], now()))?;
            return Ok(None);
        }
    };
    let refused: Vec<LineResult> = input
        .parsed
        .iter()
        .filter_map(|p| match p {
            Parsed::Refused(r) => Some(line::refused_line(r)),
            Parsed::Run(_) => None,
        })
        .collect();
    let total = input.parsed.len() as u64;
    let rec = match rec.status() {
        Status::Validating => {
            let model = input.model.clone();
            match store.record_lines(rec.id(), &refused, |r| r.start(total, model, now()))? {
                Some(r) => r,
                None => return Ok(None),
            }
        }
        _ => rec.clone(),
    };
    let done = store.done_lines(rec.id())?;
    let cancelling = rec.status() == Status::Cancelling;
    let pending = input
        .parsed
        .into_iter()
        .filter_map(|p| match p {
            Parsed::Run(l) if !cancelling && !done.contains(&l.index) => Some(l),
            _ => None,
        })
        .collect();
    Ok(Some(Job {
        shared: Arc::new(input.job),
        pending,
        running: 0,
        held_until: None,
        cancelling,
        record: rec,
    }))
}

/// Start lines while there is room: one per batch in turn, each only while its model has room.
fn dispatch(
    b: &Arc<Batches>,
    gw: &Arc<Gateway>,
    jobs: &mut HashMap<String, Job>,
    tasks: &mut JoinSet<(String, Option<(Line, Duration)>)>,
) {
    let now = Instant::now();
    let max = b.config.max_in_flight;
    let mut headroom = Headroom::new(b.budget());
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
            if !headroom.take(gw, front.model.as_deref()) {
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

/// Run one line and record its result: `Some` when it was put back.
async fn run_line(
    b: &Arc<Batches>,
    gw: Arc<Gateway>,
    job: &JobRef,
    line: Line,
) -> Option<(Line, Duration)> {
    let result = match line::execute(gw, b, job, line.clone()).await {
        Ran::Done(r) => r,
        Ran::Deferred { line, after } => return Some((line, after)),
    };
    let ok = result.ok;
    let id = job.id.clone();
    match b
        .blocking(move |b| b.local()?.record_lines(&id, &[result], |_| {}))
        .await
    {
        Ok(_) => {
            line::count_recorded(ok);
            None
        }
        Err(e) => {
            tracing::error!(batch = %job.id, error = %e, "cannot record a batch line");
            Some((line, MAX_HOLD))
        }
    }
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
    let store = b.local()?;
    let expired: Vec<LineResult> = unrun.iter().map(line::expired_line).collect();
    store.record_lines(id, &expired, |r| r.finalize(now()))?;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    store.each_line(id, |r| {
        let to = if r.ok { &mut out } else { &mut err };
        to.extend_from_slice(&r.line);
        to.push(b'\n');
        Ok(())
    })?;
    let Some(rec) = store.batch(id)? else {
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
    store.finish(id, &metas, |r| {
        r.finish(ids[0].clone(), ids[1].clone(), at, !unrun.is_empty());
    })?;
    Ok(())
}
