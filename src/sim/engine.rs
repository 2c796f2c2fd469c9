//! The continuous-batching timing model in real time: one event-driven scheduler task per
//! model around a [`Batch`] (the model itself, without a clock, shared with the planner).
//!
//! A request is submitted with its prompt token ids and its planned output length; it joins the
//! batch's *waiting* queue. Before every engine step the scheduler admits what fits
//! ([`Batch::admit`]), then sleeps for the step ([`Batch::step_duration`], divided by `speed`
//! and multiplied by the `slow` fault factor); after the step every running sequence has one
//! more token, reported to its request through a bounded channel.
//!
//! Invariants:
//! - The batch's own invariants (batch limit, KV reservation): see [`crate::batching`].
//! - The scheduler never blocks on a slow client: progress messages carry the cumulative token
//!   count, so a full channel just skips a message; the final one is retried until delivered.
//! - A request whose receiver is dropped (client gone) leaves the queue or the batch and frees
//!   its KV reservation at the next step.
//! - The gauges in [`ModelStats`] are written only by the scheduler, except `waiting`, which
//!   `submit` increments so admission limits see a request at once; `waiting_scheduled` is
//!   what the last admission round left waiting (what vLLM reports).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::config::Timing;
use super::fault::FaultState;
use super::metrics::ModelStats;
use crate::batching::{block_hashes, Batch, Queued, Running};

/// Progress of one request, as seen by its handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Progress {
    /// Tokens generated so far (cumulative).
    pub generated: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached: u32,
    /// The answer is complete.
    pub done: bool,
}

/// What the scheduler tracks a request by, besides the batch's own fields.
struct Tag {
    events: mpsc::Sender<Progress>,
    enqueued: Instant,
    admitted: Instant,
}

/// Handle to the scheduler of one model; dropping it stops the task.
pub(crate) struct Engine {
    tx: mpsc::UnboundedSender<Queued<Tag>>,
    pub(crate) stats: Arc<ModelStats>,
    task: JoinHandle<()>,
    /// The prefix cache's block size, to hash prompts in the caller.
    block: u32,
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Engine {
    pub(crate) fn start(
        timing: Timing,
        speed: f64,
        fault: Arc<FaultState>,
        stats: Arc<ModelStats>,
    ) -> Engine {
        let (tx, rx) = mpsc::unbounded_channel();
        let block = timing.block_size.max(1);
        let sched = Scheduler {
            batch: Batch::new(timing),
            speed,
            fault,
            stats: stats.clone(),
            finishing: Vec::new(),
        };
        let task = tokio::spawn(sched.run(rx));
        Engine {
            tx,
            stats,
            task,
            block,
        }
    }

    /// Queue a request; `None` if the scheduler is gone.
    pub(crate) fn submit(
        &self,
        prompt_ids: Vec<u32>,
        out_len: u32,
    ) -> Option<mpsc::Receiver<Progress>> {
        let (events, rx) = mpsc::channel(32);
        self.stats.waiting.fetch_add(1, Relaxed);
        let now = Instant::now();
        let q = Queued {
            prompt_len: prompt_ids.len() as u32,
            blocks: block_hashes(&prompt_ids, self.block),
            unique_blocks: 0,
            out_len,
            tag: Tag {
                events,
                enqueued: now,
                admitted: now,
            },
        };
        if self.tx.send(q).is_err() {
            self.stats.waiting.fetch_sub(1, Relaxed);
            return None;
        }
        Some(rx)
    }
}

struct Scheduler {
    batch: Batch<Tag>,
    speed: f64,
    fault: Arc<FaultState>,
    stats: Arc<ModelStats>,
    finishing: Vec<(mpsc::Sender<Progress>, Progress)>,
}

impl Scheduler {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Queued<Tag>>) {
        let mut next_step = tokio::time::Instant::now();
        loop {
            if self.batch.is_idle() && self.finishing.is_empty() {
                match rx.recv().await {
                    Some(s) => self.batch.waiting.push_back(s),
                    None => return,
                }
                next_step = tokio::time::Instant::now();
            }
            while let Ok(s) = rx.try_recv() {
                self.batch.waiting.push_back(s);
            }
            self.retry_finishing();
            self.drop_cancelled_waiting();
            let prefill_tokens = self.admit();
            self.publish();
            if self.batch.running.is_empty() {
                if !self.finishing.is_empty() {
                    // wait a little for slow clients to drain their channel
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                continue;
            }
            let step = self.batch.step_duration(prefill_tokens);
            let factor = self.fault.slow_factor() / self.speed;
            let step = step.mul_f64(factor.clamp(0.0, 1.0e6));
            let now = tokio::time::Instant::now();
            // keep the average step rate right even when steps are shorter than the timer tick
            next_step = (next_step + step).max(now - Duration::from_millis(5));
            tokio::time::sleep_until(next_step).await;
            self.step_done();
            self.publish();
        }
    }

    fn drop_cancelled_waiting(&mut self) {
        let waiting = &mut self.batch.waiting;
        let before = waiting.len();
        waiting.retain(|s| !s.tag.events.is_closed());
        let dropped = before - waiting.len();
        if dropped > 0 {
            self.stats.waiting.fetch_sub(dropped as u64, Relaxed);
            self.stats.aborted.fetch_add(dropped as u64, Relaxed);
        }
    }

    /// Admit waiting requests; returns the number of uncached prompt tokens to prefill.
    fn admit(&mut self) -> u32 {
        let stats = &self.stats;
        let now = Instant::now();
        let before = self.batch.running.len();
        let prefill = self.batch.admit(|seq| {
            stats.waiting.fetch_sub(1, Relaxed);
            let prompt_len = u64::from(seq.prompt_len);
            stats.prefix_queries.fetch_add(prompt_len, Relaxed);
            stats.prefix_hits.fetch_add(u64::from(seq.cached), Relaxed);
            stats.prompt_tokens.fetch_add(prompt_len, Relaxed);
            stats.queue_time.observe(
                now.saturating_duration_since(seq.tag.enqueued)
                    .as_secs_f64(),
            );
        });
        for seq in &mut self.batch.running[before..] {
            seq.tag.admitted = now;
        }
        prefill
    }

    fn step_done(&mut self) {
        let now = Instant::now();
        let aborted = self.batch.retain_running(|s| !s.tag.events.is_closed());
        self.stats.aborted.fetch_add(aborted as u64, Relaxed);
        let tokens = self.batch.advance(1);
        for seq in &self.batch.running {
            if seq.out_len > 0 && seq.generated == 1 {
                self.stats.ttft.observe(
                    now.saturating_duration_since(seq.tag.enqueued)
                        .as_secs_f64(),
                );
            }
            if !seq.done() {
                let _ = seq.tag.events.try_send(progress(seq));
            }
        }
        let stats = &self.stats;
        let finishing = &mut self.finishing;
        self.batch.take_done(|seq| {
            let p = progress(&seq);
            let sent = seq.tag.events.try_send(p);
            stats.e2e.observe(
                now.saturating_duration_since(seq.tag.enqueued)
                    .as_secs_f64(),
            );
            stats.inference_time.observe(
                now.saturating_duration_since(seq.tag.admitted)
                    .as_secs_f64(),
            );
            if let Err(mpsc::error::TrySendError::Full(p)) = sent {
                finishing.push((seq.tag.events, p));
            }
        });
        self.stats.generation_tokens.fetch_add(tokens, Relaxed);
        self.stats.iterations.fetch_add(1, Relaxed);
    }

    fn retry_finishing(&mut self) {
        self.finishing
            .retain(|(tx, p)| matches!(tx.try_send(*p), Err(mpsc::error::TrySendError::Full(_))));
    }

    fn publish(&self) {
        let s = &self.stats;
        let running = &self.batch.running;
        s.running.store(running.len() as u64, Relaxed);
        (s.waiting_scheduled).store(self.batch.waiting.len() as u64, Relaxed);
        let used: u64 = running
            .iter()
            .map(|q| u64::from(q.prompt_len) + u64::from(q.generated))
            .sum();
        s.kv_used_tokens.store(used, Relaxed);
        s.kv_reserved_tokens
            .store(self.batch.kv_reserved(), Relaxed);
        s.kv_capacity_tokens
            .store(self.batch.timing().kv_capacity_tokens, Relaxed);
        let max_tokens: u64 = running
            .iter()
            .map(|q| u64::from(q.prompt_len) + u64::from(q.out_len))
            .sum();
        s.batch_max_tokens.store(max_tokens, Relaxed);
    }
}

/// What a sequence's request is told after a step.
fn progress(seq: &Running<Tag>) -> Progress {
    Progress {
        generated: seq.generated,
        cached: seq.cached,
        done: seq.done(),
    }
}
