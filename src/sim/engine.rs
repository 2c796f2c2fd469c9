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
//! - Engine metrics come from the scheduler's own instants: a request is scheduled at its
//!   admission round, which starts the step that prefills it; each step's end is the time of
//!   the token every running sequence gets in it. One [`StepObs`] per step and one
//!   [`FinishObs`] per finished request carry them to [`ModelStats`]; the final [`Progress`]
//!   carries them to the request's handler ([`SeqTimes`]).
//! - With a KV-event publisher, the prefix cache's changes of each step go to it as one batch
//!   when the step ends (no batch for a step without changes), as vLLM publishes them after
//!   each scheduler step; a reset's `AllBlocksCleared` therefore waits for the next step, as
//!   in vLLM.
//! - With LoRA on ([`LoraRun`]), admission runs at most `max_loras` distinct adapters at once
//!   (the rest wait, deferred: see [`crate::batching`]); a step whose batch needs an adapter
//!   that is not in a GPU slot ([`Slots`]) lasts `load_time` longer per adapter swapped in.
//!   Each step's end writes `vllm:lora_requests_info` ([`LoraInfo`]). A request's blocks are
//!   keyed by its adapter, so the base model's prefix is never a hit for an adapter's
//!   request, and its stored blocks are announced under the adapter's name and id.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::config::Timing;
use super::fault::FaultState;
use super::kv_publisher::{wire_batch, BatchSender};
use super::lora::{ActiveAdapters, Adapter, LoraInfo, Slots};
use super::metrics::{FinishObs, ModelStats, StepObs};
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
    /// The request's instants, in the final message only.
    pub times: Option<SeqTimes>,
}

/// When a request was queued, admitted (scheduled), got its first and its last token, on the
/// scheduler's clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SeqTimes {
    pub enqueued: Instant,
    pub admitted: Instant,
    /// `None` when it generated nothing.
    pub first_token: Option<Instant>,
    pub last_token: Instant,
}

/// What the scheduler tracks a request by, besides the batch's own fields.
struct Tag {
    events: mpsc::Sender<Progress>,
    enqueued: Instant,
    admitted: Instant,
    first_token: Option<Instant>,
    /// The request's effective `max_tokens`.
    max_tokens: u32,
    /// The LoRA adapter it runs under (none: the base model).
    adapter: Option<Arc<Adapter>>,
}

/// How the engine runs LoRA adapters (vLLM's `--enable-lora`).
pub(crate) struct LoraRun {
    /// `--max-loras`: adapters a batch may run at once, the GPU slots.
    pub max_loras: usize,
    /// What one adapter swapped into a slot adds to its step, at speed 1.
    pub load_time: Duration,
    /// Where each step's active adapters are written.
    pub info: Arc<LoraInfo>,
}

/// The scheduler's LoRA state.
struct LoraState {
    slots: Slots,
    load_time: Duration,
    info: Arc<LoraInfo>,
    active: ActiveAdapters,
}

/// What a handler asks of the scheduler.
enum Msg {
    Submit(Queued<Tag>),
    /// Drop the prefix cache (`force`: even while sequences run); answers whether it did.
    ResetPrefixCache {
        force: bool,
        reply: tokio::sync::oneshot::Sender<bool>,
    },
}

/// Handle to the scheduler of one model; dropping it stops the task.
pub(crate) struct Engine {
    tx: mpsc::UnboundedSender<Msg>,
    pub(crate) stats: Arc<ModelStats>,
    task: JoinHandle<()>,
    /// The prefix cache's block size, to hash prompts in the caller.
    block: u32,
    /// A KV-event publisher listens: requests carry their prompt's token ids.
    listening: bool,
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Engine {
    /// Start the scheduler; with `kv`, the prefix cache's changes are published there; with
    /// `lora`, adapters take GPU slots.
    pub(crate) fn start(
        timing: Timing,
        speed: f64,
        fault: Arc<FaultState>,
        stats: Arc<ModelStats>,
        kv: Option<BatchSender>,
        lora: Option<LoraRun>,
    ) -> Engine {
        let (tx, rx) = mpsc::unbounded_channel();
        let block = timing.block_size.max(1);
        let mut batch = Batch::new(timing);
        if kv.is_some() {
            batch.listen();
        }
        let lora = lora.map(|l| {
            batch.limit_loras(l.max_loras);
            LoraState {
                slots: Slots::new(l.max_loras),
                load_time: l.load_time,
                info: l.info,
                active: ActiveAdapters::default(),
            }
        });
        let listening = kv.is_some();
        let sched = Scheduler {
            batch,
            kv,
            speed,
            fault,
            stats: stats.clone(),
            finishing: Vec::new(),
            step_start: Instant::now(),
            prev_step_end: Instant::now(),
            prefill_share: 0.0,
            prefilled: StepObs::default(),
            lora,
            adapters: HashMap::new(),
        };
        let task = tokio::spawn(sched.run(rx));
        Engine {
            tx,
            stats,
            task,
            block,
            listening,
        }
    }

    /// Queue a request of `out_len` tokens whose effective `max_tokens` is `max_tokens`, under
    /// `adapter` (none: the base model); `None` if the scheduler is gone.
    pub(crate) fn submit(
        &self,
        prompt_ids: Vec<u32>,
        out_len: u32,
        max_tokens: u32,
        adapter: Option<Arc<Adapter>>,
    ) -> Option<mpsc::Receiver<Progress>> {
        let (events, rx) = mpsc::channel(32);
        self.stats.waiting.fetch_add(1, Relaxed);
        let now = Instant::now();
        let mut blocks = block_hashes(&prompt_ids, self.block);
        if let Some(a) = &adapter {
            a.key_blocks(&mut blocks);
        }
        let q = Queued {
            prompt_len: prompt_ids.len() as u32,
            blocks,
            unique_blocks: 0,
            tokens: if self.listening {
                prompt_ids
            } else {
                Vec::new()
            },
            out_len,
            lora: adapter.as_ref().map_or(0, |a| a.id()),
            tag: Tag {
                events,
                enqueued: now,
                admitted: now,
                first_token: None,
                max_tokens,
                adapter,
            },
        };
        if self.tx.send(Msg::Submit(q)).is_err() {
            self.stats.waiting.fetch_sub(1, Relaxed);
            return None;
        }
        Some(rx)
    }

    /// Drop the prefix cache, as vLLM's `POST /reset_prefix_cache` does: refused while
    /// sequences run unless `force`. `false` also when the scheduler is gone.
    pub(crate) async fn reset_prefix_cache(&self, force: bool) -> bool {
        let (reply, answer) = tokio::sync::oneshot::channel();
        if self
            .tx
            .send(Msg::ResetPrefixCache { force, reply })
            .is_err()
        {
            return false;
        }
        answer.await.unwrap_or(false)
    }
}

struct Scheduler {
    batch: Batch<Tag>,
    /// Where the prefix cache's changes are published (none: nobody listens).
    kv: Option<BatchSender>,
    speed: f64,
    fault: Arc<FaultState>,
    stats: Arc<ModelStats>,
    finishing: Vec<(mpsc::Sender<Progress>, Progress)>,
    /// The current step's admission round (its start) and the previous step's end.
    step_start: Instant,
    prev_step_end: Instant,
    /// The share of the current step that prefills the requests admitted in it.
    prefill_share: f64,
    /// What a prefill pass of its own already did in the current step (TGI): the requests it
    /// prefilled and their first tokens.
    prefilled: StepObs,
    /// LoRA slots and bookkeeping (none: LoRA off).
    lora: Option<LoraState>,
    /// Every adapter a request was submitted under, by id: the names its stored blocks are
    /// announced with (ids are never reused, so this holds at most one entry per load).
    adapters: HashMap<u32, Arc<Adapter>>,
}

impl Scheduler {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>) {
        let mut next_step = tokio::time::Instant::now();
        loop {
            if self.batch.is_idle() && self.finishing.is_empty() {
                match rx.recv().await {
                    Some(m) => self.handle(m),
                    None => return,
                }
                next_step = tokio::time::Instant::now();
            }
            while let Ok(m) = rx.try_recv() {
                self.handle(m);
            }
            self.retry_finishing();
            self.drop_cancelled_waiting();
            let prefill_tokens = self.admit();
            let loading = self.load_adapters();
            self.publish();
            if self.batch.running.is_empty() {
                if !self.finishing.is_empty() {
                    // wait a little for slow clients to drain their channel
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                continue;
            }
            let step = self
                .batch
                .step_duration(prefill_tokens)
                .saturating_add(loading);
            let factor = (self.fault.slow_factor() / self.speed).clamp(0.0, 1.0e6);
            let first = (self.batch.first_token_after(prefill_tokens) + loading).mul_f64(factor);
            let step = step.mul_f64(factor);
            let now = tokio::time::Instant::now();
            // keep the average step rate right even when steps are shorter than the timer tick
            next_step = (next_step + step).max(now - Duration::from_millis(5));
            if first < step {
                // a prefill pass of its own: its first tokens go out before the decode pass
                tokio::time::sleep_until(next_step - step + first).await;
                self.prefill_pass_done();
            }
            tokio::time::sleep_until(next_step).await;
            self.step_done();
            self.publish();
            self.publish_cache_events().await;
        }
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Submit(q) => {
                if let Some(a) = &q.tag.adapter {
                    self.adapters.entry(a.id()).or_insert_with(|| a.clone());
                }
                self.batch.waiting.push_back(q)
            }
            Msg::ResetPrefixCache { force, reply } => {
                let _ = reply.send(self.batch.reset_prefix_cache(force));
            }
        }
    }

    /// Hand the step's prefix-cache changes to the KV-event publisher, if any. Waits when its
    /// queue is full (`max_queue_size` batches), as vLLM's engine does.
    async fn publish_cache_events(&mut self) {
        let Some(kv) = &self.kv else {
            return;
        };
        let events = self.batch.take_cache_events();
        if events.is_empty() {
            return;
        }
        let adapters = &self.adapters;
        let batch = wire_batch(
            events,
            self.batch.timing().block_size,
            super::unix_now_f64(),
            |id| adapters.get(&id).map(|a| a.name()),
        );
        if kv.send(batch).await.is_err() {
            tracing::debug!("KV-event publisher gone");
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

    /// Admit waiting requests (the round that starts the next step); returns the number of
    /// uncached prompt tokens to prefill.
    fn admit(&mut self) -> u32 {
        let stats = &self.stats;
        let now = Instant::now();
        let before = self.batch.running.len();
        let prefill = self.batch.admit(|seq| {
            stats.waiting.fetch_sub(1, Relaxed);
            stats
                .prefix_queries
                .fetch_add(u64::from(seq.prompt_len), Relaxed);
            stats.prefix_hits.fetch_add(u64::from(seq.cached), Relaxed);
        });
        let admitted = self.batch.running.len() - before;
        for seq in &mut self.batch.running[before..] {
            seq.tag.admitted = now;
        }
        stats.admitted_group(admitted as u64);
        self.step_start = now;
        self.prefill_share = prefill_share(self.batch.timing(), admitted, before, prefill);
        prefill
    }

    /// Swap the adapters the batch needs into the GPU slots (the ones already running first,
    /// so the one evicted is never in use); returns what the swaps add to the step.
    fn load_adapters(&mut self) -> Duration {
        let Some(lora) = self.lora.as_mut() else {
            return Duration::ZERO;
        };
        let swapped = self
            .batch
            .running
            .iter()
            .filter(|s| lora.slots.bring(s.lora))
            .count();
        lora.load_time.saturating_mul(swapped as u32)
    }

    /// After a step: the adapters whose requests have produced output, written to
    /// `vllm:lora_requests_info` as vLLM's frontend writes them after each step.
    fn record_adapters(&mut self) {
        let Some(lora) = self.lora.as_mut() else {
            return;
        };
        let producing = self
            .batch
            .running
            .iter()
            .filter(|s| s.generated > 0 && !s.done())
            .filter_map(|s| s.tag.adapter.as_ref());
        lora.active.update(producing);
        lora.info
            .record(&lora.active.label(), super::unix_now_f64());
    }

    /// A prefill pass of its own ended: the sequences it prefilled have their first token.
    fn prefill_pass_done(&mut self) {
        let now = Instant::now();
        self.prefilled.generated = self.batch.first_tokens();
        for seq in &mut self.batch.running {
            if seq.tag.first_token.is_none() && seq.generated > 0 {
                self.prefilled.prefilled += 1;
                self.prefilled.prompt_tokens += u64::from(seq.prompt_len);
                self.prefilled.cached_tokens += u64::from(seq.cached);
                seq.tag.first_token = Some(now);
                self.stats.first_token(secs(seq.tag.enqueued, now));
                if !seq.done() {
                    let _ = seq.tag.events.try_send(progress(seq, None));
                }
            }
        }
    }

    /// The step ended: every running sequence has one more token.
    fn step_done(&mut self) {
        let now = Instant::now();
        let aborted = self.batch.retain_running(|s| !s.tag.events.is_closed());
        self.stats.aborted.fetch_add(aborted as u64, Relaxed);
        let early = std::mem::take(&mut self.prefilled);
        let mut obs = StepObs {
            secs: secs(self.step_start, now),
            prefill_share: self.prefill_share,
            itl_secs: secs(self.prev_step_end, now),
            generated: early.generated + self.batch.advance(1),
            prefilled: early.prefilled,
            prompt_tokens: early.prompt_tokens,
            cached_tokens: early.cached_tokens,
            ..StepObs::default()
        };
        for seq in &mut self.batch.running {
            if seq.tag.first_token.is_some() {
                obs.decoding += 1;
            } else {
                obs.prefilled += 1;
                obs.prompt_tokens += u64::from(seq.prompt_len);
                obs.cached_tokens += u64::from(seq.cached);
                if seq.generated > 0 {
                    seq.tag.first_token = Some(now);
                    self.stats.first_token(secs(seq.tag.enqueued, now));
                }
            }
            if !seq.done() {
                let _ = seq.tag.events.try_send(progress(seq, None));
            }
        }
        self.stats.step(&obs);
        self.prev_step_end = now;
        self.record_adapters();
        self.finish(now);
    }

    /// Hand the finished sequences their final message and count them.
    fn finish(&mut self, now: Instant) {
        let stats = &self.stats;
        let finishing = &mut self.finishing;
        self.batch.take_done(|seq| {
            let t = &seq.tag;
            let times = SeqTimes {
                enqueued: t.enqueued,
                admitted: t.admitted,
                first_token: t.first_token,
                last_token: now,
            };
            stats.finished(&finish_obs(&seq, &times));
            let p = progress(&seq, Some(times));
            if let Err(mpsc::error::TrySendError::Full(p)) = seq.tag.events.try_send(p) {
                finishing.push((seq.tag.events, p));
            }
        });
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
        (s.waiting_deferred).store(self.batch.deferred() as u64, Relaxed);
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

/// Seconds from `a` to `b` (0 if `b` is earlier).
fn secs(a: Instant, b: Instant) -> f64 {
    b.saturating_duration_since(a).as_secs_f64()
}

/// The share of a step that the timing model gives to prefilling `admitted` new sequences
/// (`prefill` uncached tokens) next to `running` older ones. TGI runs them as two forward
/// passes, each with the fixed cost: a prefill of the new group (its prompts and sequences) and
/// a decode of the older ones. It only splits a step measured on the clock into those passes.
fn prefill_share(t: &Timing, admitted: usize, running: usize, prefill: u32) -> f64 {
    if admitted == 0 {
        return 0.0;
    }
    if running == 0 {
        return 1.0;
    }
    let base = t.decode_base.as_secs_f64();
    let per_seq = t.decode_per_seq.as_secs_f64();
    let new =
        base + t.prefill_per_token.as_secs_f64() * f64::from(prefill) + per_seq * admitted as f64;
    let old = base + per_seq * running as f64;
    if new + old > 0.0 {
        new / (new + old)
    } else {
        0.5
    }
}

/// A finished sequence's metrics.
fn finish_obs(seq: &Running<Tag>, t: &SeqTimes) -> FinishObs {
    FinishObs {
        queue: secs(t.enqueued, t.admitted),
        prefill: t.first_token.map(|f| secs(t.admitted, f)),
        decode: t.first_token.map_or(0.0, |f| secs(f, t.last_token)),
        inference: secs(t.admitted, t.last_token),
        e2e: secs(t.enqueued, t.last_token),
        prompt_tokens: seq.prompt_len,
        cached_tokens: seq.cached,
        generated: seq.generated,
        max_tokens: seq.tag.max_tokens,
    }
}

/// What a sequence's request is told after a step.
fn progress(seq: &Running<Tag>, times: Option<SeqTimes>) -> Progress {
    Progress {
        generated: seq.generated,
        cached: seq.cached,
        done: seq.done(),
        times,
    }
}
