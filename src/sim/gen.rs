//! One generation as a handler sees it: a planned answer ([`Plan`]) delivered either at once
//! (speed 0, the fast path that bypasses the scheduler) or token by token by the model's
//! scheduler.
//!
//! Invariants: `next()` yields consecutive, non-overlapping ranges of word indices covering
//! exactly `0..plan.words.len()`, then `None`; statistics (finish reason, token counters) are
//! recorded once, when the last range is handed out; dropping a `Gen` early drops its receiver,
//! which makes the scheduler abort the sequence.

use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use super::engine::Progress;
use super::server::Sim;
use super::text::{Finish, Plan};

pub(crate) struct Gen {
    pub plan: Plan,
    sim: Arc<Sim>,
    model: usize,
    rx: Option<mpsc::Receiver<Progress>>,
    seen: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached: u32,
    pub started: Instant,
    pub first_at: Option<Instant>,
    pub done_at: Option<Instant>,
    finished: bool,
}

/// Why a generation could not start.
#[derive(Debug)]
pub(crate) enum StartError {
    /// The waiting queue is full (Ollama's `OLLAMA_MAX_QUEUE`).
    QueueFull,
}

impl Gen {
    /// Start generating `plan` on model `model`; `queue_limit` bounds the waiting queue.
    pub(crate) fn start(
        sim: &Arc<Sim>,
        model: usize,
        plan: Plan,
        queue_limit: Option<usize>,
    ) -> Result<Gen, StartError> {
        let m = &sim.models[model.min(sim.models.len().saturating_sub(1))];
        let rx = match &m.engine {
            Some(engine) => {
                if let Some(limit) = queue_limit {
                    if m.stats.waiting.load(Relaxed) as usize >= limit {
                        return Err(StartError::QueueFull);
                    }
                }
                engine.submit(plan.prompt_ids.clone(), plan.completion_tokens())
            }
            None => None,
        };
        sim.counters.infer_total.fetch_add(1, Relaxed);
        sim.counters
            .tokens_in
            .fetch_add(u64::from(plan.prompt_tokens()), Relaxed);
        Ok(Gen {
            plan,
            sim: sim.clone(),
            model,
            rx,
            seen: 0,
            cached: 0,
            started: Instant::now(),
            first_at: None,
            done_at: None,
            finished: false,
        })
    }

    fn record_end(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let now = Instant::now();
        self.done_at = Some(now);
        if self.first_at.is_none() {
            self.first_at = Some(now);
        }
        let m = &self.sim.models[self.model.min(self.sim.models.len().saturating_sub(1))];
        let s = &m.stats;
        match self.plan.finish {
            Finish::Stop => s.success_stop.fetch_add(1, Relaxed),
            Finish::Length => s.success_length.fetch_add(1, Relaxed),
        };
        if m.engine.is_none() {
            // the scheduler did not see this request: account for it here
            s.prompt_tokens
                .fetch_add(u64::from(self.plan.prompt_tokens()), Relaxed);
            s.prefix_queries
                .fetch_add(u64::from(self.plan.prompt_tokens()), Relaxed);
            s.generation_tokens
                .fetch_add(u64::from(self.plan.completion_tokens()), Relaxed);
            s.ttft.observe(0.0);
            s.e2e.observe(0.0);
        }
        let c = &self.sim.counters;
        c.tokens_out
            .fetch_add(u64::from(self.plan.completion_tokens()), Relaxed);
        c.infer_success.fetch_add(1, Relaxed);
        if self.sim.config.kind != super::config::SimKind::Tgi {
            return;
        }
        c.tgi_duration
            .observe(now.saturating_duration_since(self.started).as_secs_f64());
        c.tgi_input_length
            .observe(f64::from(self.plan.prompt_tokens()));
        c.tgi_generated_tokens
            .observe(f64::from(self.plan.completion_tokens()));
    }

    /// The next range of newly generated words, or `None` when the answer is complete.
    pub(crate) async fn next(&mut self) -> Option<Range<usize>> {
        let total = self.plan.words.len();
        if self.finished {
            return None;
        }
        let Some(rx) = self.rx.as_mut() else {
            // fast path: everything at once
            self.first_at = Some(Instant::now());
            let r = self.seen..total;
            self.seen = total;
            self.record_end();
            return if r.is_empty() { None } else { Some(r) };
        };
        loop {
            match rx.recv().await {
                Some(p) => {
                    self.cached = p.cached;
                    let upto = (p.generated as usize).min(total);
                    if self.first_at.is_none() && (upto > 0 || p.done) {
                        self.first_at = Some(Instant::now());
                    }
                    if p.done {
                        let r = self.seen..total;
                        self.seen = total;
                        self.record_end();
                        return if r.is_empty() { None } else { Some(r) };
                    }
                    if upto > self.seen {
                        let r = self.seen..upto;
                        self.seen = upto;
                        return Some(r);
                    }
                }
                None => {
                    // scheduler gone: hand out the rest at once
                    let r = self.seen..total;
                    self.seen = total;
                    self.record_end();
                    return if r.is_empty() { None } else { Some(r) };
                }
            }
        }
    }

    /// Drive the generation to its end (non-stream answers).
    pub(crate) async fn run_to_end(&mut self) {
        while self.next().await.is_some() {}
        self.record_end();
    }

    /// Prefill duration (start → first token) and decode duration (first → last), in ns.
    pub(crate) fn durations_ns(&self) -> (u64, u64, u64) {
        let end = self.done_at.unwrap_or_else(Instant::now);
        let first = self.first_at.unwrap_or(end);
        let total = end.saturating_duration_since(self.started).as_nanos() as u64;
        let prefill = first.saturating_duration_since(self.started).as_nanos() as u64;
        let decode = end.saturating_duration_since(first).as_nanos() as u64;
        (total, prefill, decode)
    }
}
