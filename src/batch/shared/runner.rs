//! The runner of a replica that shares its batches with others: it looks over the folder's
//! batches, validates the new ones (first replica wins, [`Folder::transition`]), takes the
//! lease of one chunk of lines nobody holds, runs its lines on the fleet's idle capacity as
//! the local runner does, and commits the chunk's results whole; a batch with every chunk
//! committed (or cancelled, or expired) is finalized under its own lease.
//!
//! [`Folder::transition`]: super::folder::Folder::transition
//!
//! Invariants:
//! - A chunk is committed only with a result for every one of its lines; a chunk given up
//!   (lease lost, batch cancelled, a line's task failed, the replica stopped) commits
//!   nothing and runs again whole, so a line in flight then is run twice and recorded once.
//! - The finalizer builds the output and error files from the committed chunks only, in
//!   chunk order (so input order); its files become the batch's only if its `finished`
//!   transition is the first, else it removes them.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::folder::Transition;
use super::lease::{self, Leases};
use crate::batch::headroom::Headroom;
use crate::batch::input::Parsed;
use crate::batch::line::{self, Input, Ran, MAX_HOLD};
use crate::batch::record::{now, BatchRecord, FileMeta, Status};
use crate::batch::store::LineResult;
use crate::batch::{BatchError, Batches};
use crate::gateway::Gateway;
use crate::telemetry::metrics as m;

/// How often waiting lines look for room again.
const TICK: Duration = Duration::from_millis(20);
/// How often an idle replica looks for work (new batches, expired leases).
const IDLE: Duration = Duration::from_millis(250);
/// How often a running chunk checks that its batch was not cancelled.
const CHECK: Duration = Duration::from_millis(500);

/// A piece of work this replica holds the lease of.
enum Work {
    Chunk {
        input: Arc<Input>,
        n: u64,
        key: String,
    },
    Finalize {
        input: Arc<Input>,
        key: String,
    },
}

/// A batch's input with its chunking.
struct Chunked {
    input: Arc<Input>,
    chunk_lines: u64,
}

/// Run shared batches until `stop` turns true; the leases held then are let go.
pub async fn run(
    b: Arc<Batches>,
    gw: Arc<Gateway>,
    leases: Arc<Leases>,
    mut stop: watch::Receiver<bool>,
) {
    let mut inputs: HashMap<String, Chunked> = HashMap::new();
    loop {
        let work = match next_work(&b, &leases, &mut inputs).await {
            Ok(w) => w,
            Err(e) => {
                tracing::error!(error = %e, "shared batch runner cannot read its jobs");
                None
            }
        };
        if let Some(work) = work {
            let key = match &work {
                Work::Chunk { key, .. } | Work::Finalize { key, .. } => key.clone(),
            };
            let done = tokio::select! {
                _ = stop.wait_for(|s| *s) => true,
                r = run_work(&b, &gw, &leases, &inputs, work) => {
                    if let Err(e) = r {
                        tracing::error!(error = %e, "a shared batch chunk failed");
                    }
                    false
                }
            };
            let _ = leases.release(&key).await;
            publish(0, 0);
            if done {
                return;
            }
            continue;
        }
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = b.wake.notified() => {}
            _ = tokio::time::sleep(IDLE) => {}
        }
    }
}

async fn run_work(
    b: &Arc<Batches>,
    gw: &Arc<Gateway>,
    leases: &Leases,
    inputs: &HashMap<String, Chunked>,
    work: Work,
) -> Result<(), BatchError> {
    match work {
        Work::Chunk { input, n, key } => {
            let cl = inputs.get(&input.job.id).map_or(1, |c| c.chunk_lines);
            run_chunk(b, gw, leases, &input, n, cl, &key).await
        }
        Work::Finalize { input, .. } => {
            let cl = inputs.get(&input.job.id).map_or(1, |c| c.chunk_lines);
            let token = b.token().to_string();
            b.blocking(move |b| finalize(b, &input, cl, &token)).await
        }
    }
}

fn publish(queued: usize, running: usize) {
    metrics::gauge!(m::BATCH_LINES_QUEUED).set(queued as f64);
    metrics::gauge!(m::BATCH_LINES_RUNNING).set(running as f64);
}

/// The first piece of work whose lease this replica could take, oldest batch first.
async fn next_work(
    b: &Arc<Batches>,
    leases: &Leases,
    inputs: &mut HashMap<String, Chunked>,
) -> Result<Option<Work>, BatchError> {
    let mut records = b.blocking(|b| b.folder()?.batches()).await?;
    records.sort_by(|x, y| (x.created_at(), x.id()).cmp(&(y.created_at(), y.id())));
    inputs.retain(|id, _| {
        records
            .iter()
            .any(|r| r.id() == id && !r.status().finished())
    });
    for rec in records {
        if rec.status().finished() {
            continue;
        }
        if !inputs.contains_key(rec.id()) {
            let r = rec.clone();
            let Some(c) = b.blocking(move |b| load(b, &r)).await? else {
                continue;
            };
            inputs.insert(rec.id().to_string(), c);
        }
        let Some(c) = inputs.get(rec.id()) else {
            continue;
        };
        if let Some(w) = pick(b, leases, &rec, c).await? {
            return Ok(Some(w));
        }
    }
    Ok(None)
}

/// A batch's input, the batch started (or failed) when it was validating. `None`: failed.
fn load(b: &Batches, rec: &BatchRecord) -> Result<Option<Chunked>, BatchError> {
    let folder = b.folder()?;
    let input = match line::read_input(b, rec)? {
        Ok(i) => i,
        Err(failure) => {
            folder.transition(
                rec.id(),
                Transition::Failed {
                    failures: vec![failure],
                },
            )?;
            return Ok(None);
        }
    };
    if rec.status() == Status::Validating {
        folder.transition(
            rec.id(),
            Transition::Started {
                total: input.parsed.len() as u64,
                model: input.model.clone(),
                chunk_lines: b.config().chunk_lines as u64,
            },
        )?;
    }
    // The chunking of the replica that started it, whatever this one's setting.
    let chunk_lines = folder
        .markers(rec.id())?
        .into_iter()
        .find_map(|m| match m.transition {
            Transition::Started { chunk_lines, .. } => Some(chunk_lines.max(1)),
            _ => None,
        })
        .unwrap_or(b.config().chunk_lines as u64);
    Ok(Some(Chunked {
        input: Arc::new(input),
        chunk_lines,
    }))
}

/// The work of one batch this replica can take now.
async fn pick(
    b: &Arc<Batches>,
    leases: &Leases,
    rec: &BatchRecord,
    c: &Chunked,
) -> Result<Option<Work>, BatchError> {
    let id = rec.id().to_string();
    let committed = {
        let id = id.clone();
        b.blocking(move |b| b.folder()?.committed(&id)).await?
    };
    let chunks = chunk_count(c.input.parsed.len(), c.chunk_lines);
    let ending = matches!(rec.status(), Status::Cancelling | Status::Finalizing)
        || rec.expired(now())
        || committed.len() as u64 >= chunks;
    let pieces: Vec<(String, Option<u64>)> = if ending {
        vec![("final".into(), None)]
    } else {
        (0..chunks)
            .filter(|n| !committed.contains(n))
            .map(|n| (n.to_string(), Some(n)))
            .collect()
    };
    let keys: Vec<String> = pieces.iter().map(|(p, _)| lease::key(&id, p)).collect();
    // A Redis failure ends the look: nothing runs until Redis answers again.
    let Some(i) = leases.take_first(&keys).await? else {
        return Ok(None);
    };
    let (key, input) = (keys[i].clone(), c.input.clone());
    Ok(Some(match pieces[i].1 {
        Some(n) => Work::Chunk { input, n, key },
        None => Work::Finalize { input, key },
    }))
}

fn chunk_count(lines: usize, chunk_lines: u64) -> u64 {
    (lines as u64).div_ceil(chunk_lines.max(1))
}

/// The parsed lines of chunk `n`.
fn chunk_of(input: &Input, n: u64, chunk_lines: u64) -> &[Parsed] {
    let len = input.parsed.len();
    let start = (n.saturating_mul(chunk_lines) as usize).min(len);
    let end = (start + chunk_lines as usize).min(len);
    &input.parsed[start..end]
}

/// Run chunk `n`'s lines while the fleet has room and commit their results whole.
async fn run_chunk(
    b: &Arc<Batches>,
    gw: &Arc<Gateway>,
    leases: &Leases,
    input: &Arc<Input>,
    n: u64,
    chunk_lines: u64,
    key: &str,
) -> Result<(), BatchError> {
    let mut results: Vec<LineResult> = Vec::new();
    let mut pending = VecDeque::new();
    for p in chunk_of(input, n, chunk_lines) {
        match p {
            Parsed::Refused(r) => results.push(line::refused_line(r)),
            Parsed::Run(l) => pending.push_back(l.clone()),
        }
    }
    let mut tasks: JoinSet<Ran> = JoinSet::new();
    let mut held_until: Option<Instant> = None;
    let mut renew_at = Instant::now() + leases.ttl() / 3;
    let mut check_at = Instant::now() + CHECK;
    while !(pending.is_empty() && tasks.is_empty()) {
        let now = Instant::now();
        let mut headroom = Headroom::new(b.budget());
        while tasks.len() < b.config().max_in_flight && held_until.is_none_or(|h| h <= now) {
            let Some(front) = pending.front() else { break };
            if !headroom.take(gw, front.model.as_deref()) {
                break;
            }
            let Some(l) = pending.pop_front() else { break };
            let (gw, b, input) = (gw.clone(), b.clone(), input.clone());
            tasks.spawn(async move { line::execute(gw, &b, &input.job, l).await });
        }
        publish(pending.len(), tasks.len());
        tokio::select! {
            Some(done) = tasks.join_next(), if !tasks.is_empty() => match done {
                Ok(Ran::Done(r)) => results.push(r),
                Ok(Ran::Deferred { line, after }) => {
                    pending.push_front(line);
                    held_until = Some(Instant::now() + after.min(MAX_HOLD));
                }
                // Which line it was is unknown: give the chunk up, it runs again whole.
                Err(_) => return Ok(()),
            },
            _ = tokio::time::sleep(TICK) => {}
        }
        if Instant::now() >= renew_at {
            match leases.renew(key).await {
                Ok(true) => renew_at = Instant::now() + leases.ttl() / 3,
                Ok(false) => return Ok(()), // taken over: the other replica runs it
                Err(e) => {
                    tracing::warn!(error = %e, "cannot renew a batch lease");
                    renew_at = Instant::now() + Duration::from_secs(1);
                }
            }
        }
        if Instant::now() >= check_at {
            check_at = Instant::now() + CHECK;
            let id = input.job.id.clone();
            let rec = b.blocking(move |b| b.folder()?.batch(&id)).await?;
            if rec.is_none_or(|r| r.status() != Status::InProgress) {
                return Ok(());
            }
        }
    }
    results.sort_by_key(|r| r.index);
    let id = input.job.id.clone();
    let oks: Vec<bool> = results.iter().map(|r| r.ok).collect();
    let won = b
        .blocking(move |b| b.folder()?.commit_chunk(&id, n, &results))
        .await?;
    if won {
        oks.into_iter().for_each(line::count_recorded);
    }
    Ok(())
}

/// Write the batch's output and error files from its committed chunks and finish it.
fn finalize(b: &Batches, input: &Input, chunk_lines: u64, token: &str) -> Result<(), BatchError> {
    let folder = b.folder()?;
    let id = input.job.id.as_str();
    let Some(rec) = folder.batch(id)? else {
        return Ok(());
    };
    if rec.status().finished() {
        return Ok(());
    }
    folder.transition(id, Transition::Finalizing)?;
    let committed = folder.committed(id)?;
    let chunks = chunk_count(input.parsed.len(), chunk_lines);
    let expired = rec.expired(now()) && (committed.len() as u64) < chunks;
    // A batch cancelled before it started ran nothing and refused nothing yet.
    let started = rec.counts().total > 0;
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let (mut completed, mut failed) = (0u64, 0u64);
    let mut put = |ok: bool, line: &[u8]| {
        let to = if ok { &mut out } else { &mut err };
        to.extend_from_slice(line);
        to.push(b'\n');
        if ok {
            completed += 1;
        } else {
            failed += 1;
        }
    };
    for n in 0..chunks {
        if committed.contains(&n) {
            for (ok, l) in folder.chunk_lines(id, n)? {
                put(ok, &l);
            }
            continue;
        }
        for p in chunk_of(input, n, chunk_lines) {
            match p {
                Parsed::Refused(r) if started => put(false, &line::refused_line(r).line),
                Parsed::Run(l) if expired => put(false, &line::expired_line(l).line),
                Parsed::Refused(_) | Parsed::Run(_) => {}
            }
        }
    }
    let suffix = id.strip_prefix("batch_").unwrap_or(id);
    let mut written = Vec::new();
    for (content, kind) in [(out, "output"), (err, "error")] {
        if content.is_empty() {
            written.push(None);
            continue;
        }
        let file_id = format!("file-{suffix}-{token}-{kind}");
        let n = b.blobs.write(&file_id, [content.as_slice()])?;
        let meta = FileMeta::new(
            file_id,
            n,
            format!("{id}_{kind}.jsonl"),
            "batch_output",
            rec.tenant(),
        );
        folder.put_file(&meta)?;
        written.push(Some(meta.id().to_string()));
    }
    let won = folder.transition(
        id,
        Transition::Finished {
            output: written[0].clone(),
            errors: written[1].clone(),
            expired,
            completed,
            failed,
        },
    )?;
    if !won {
        for f in written.into_iter().flatten() {
            folder.delete_file(&f)?;
            b.blobs.remove(&f)?;
        }
    }
    Ok(())
}
