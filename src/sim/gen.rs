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
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::engine::{Progress, SeqTimes};
use super::metrics::FinishObs;
use super::server::Sim;
use super::text::{Finish, Plan};

/// How a request's prompt used the prefix cache, as vLLM reports it: tokens read from the cache
/// (whole blocks) and tokens the request wrote to it (its other whole prompt blocks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct CacheUse {
    pub cached: u32,
    pub created: u32,
}

impl std::ops::Add for CacheUse {
    type Output = CacheUse;
    fn add(self, o: CacheUse) -> CacheUse {
        CacheUse {
            cached: self.cached + o.cached,
            created: self.created + o.created,
        }
    }
}

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
    /// The scheduler's instants for this request (with a scheduler, once it is done).
    times: Option<SeqTimes>,
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
                engine.submit(
                    plan.prompt_ids.clone(),
                    plan.completion_tokens(),
                    effective_max_tokens(sim, &plan),
                    plan.adapter.clone(),
                )
            }
            None => None,
        };
        sim.counters.infer_total.fetch_add(1, Relaxed);
        sim.counters
            .tokens_in
            .fetch_add(u64::from(plan.prompt_tokens()), Relaxed);
        if sim.config.kind == super::config::SimKind::Tgi {
            // TGI records the input length when it validates a request
            sim.counters
                .tgi_input_length
                .observe(f64::from(plan.prompt_tokens()));
        }
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
            times: None,
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
            self.record_unscheduled();
        }
        let c = &self.sim.counters;
        c.tokens_out
            .fetch_add(u64::from(self.plan.completion_tokens()), Relaxed);
        c.infer_success.fetch_add(1, Relaxed);
        if self.sim.config.kind == super::config::SimKind::Tgi {
            self.record_tgi(now);
        }
    }

    /// The scheduler did not see this request (speed 0): account for it here, as an engine
    /// that took no time at all.
    fn record_unscheduled(&self) {
        let m = &self.sim.models[self.model.min(self.sim.models.len().saturating_sub(1))];
        let s = &m.stats;
        let p = &self.plan;
        let (prompt, out) = (p.prompt_tokens(), p.completion_tokens());
        s.prompt_tokens.fetch_add(u64::from(prompt), Relaxed);
        s.prefix_queries.fetch_add(u64::from(prompt), Relaxed);
        s.generation_tokens.fetch_add(u64::from(out), Relaxed);
        s.first_token(0.0);
        s.finished(&FinishObs {
            prefill: Some(0.0),
            prompt_tokens: prompt,
            generated: out,
            max_tokens: effective_max_tokens(&self.sim, p),
            ..FinishObs::default()
        });
    }

    /// TGI's per-request histograms, which its router records when the answer is complete.
    fn record_tgi(&self, now: Instant) {
        let c = &self.sim.counters;
        let (queue, inference) = self.queue_inference(now);
        let generated = self.plan.completion_tokens().max(1);
        c.tgi_duration
            .observe(now.saturating_duration_since(self.started).as_secs_f64());
        c.tgi_queue.observe(queue.as_secs_f64());
        c.tgi_inference.observe(inference.as_secs_f64());
        c.tgi_time_per_token
            .observe(inference.as_secs_f64() / f64::from(generated));
        c.tgi_generated_tokens
            .observe(f64::from(self.plan.completion_tokens()));
    }

    /// Queue time (arrival to admission) and inference time (admission to `end`), on the
    /// scheduler's clock where there is one.
    fn queue_inference(&self, end: Instant) -> (Duration, Duration) {
        match &self.times {
            Some(t) => (
                t.admitted.saturating_duration_since(t.enqueued),
                end.saturating_duration_since(t.admitted),
            ),
            None => (Duration::ZERO, end.saturating_duration_since(self.started)),
        }
    }

    /// How the prompt used the prefix cache (meaningful once the first token came): vLLM's
    /// `created_cache_tokens` are the prompt's whole blocks not read from the cache.
    pub(crate) fn cache_use(&self) -> CacheUse {
        let block = self.sim.config.timing.block_size.max(1);
        let whole = self.plan.prompt_tokens() / block * block;
        CacheUse {
            cached: self.cached,
            created: whole.saturating_sub(self.cached),
        }
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
                    if p.times.is_some() {
                        self.times = p.times;
                    }
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

    /// Total duration (start → end), prompt evaluation (the step that admitted the request,
    /// admission → first token) and generation (first → last token), in ns: the scheduler's
    /// instants where there is a scheduler, the handler's otherwise.
    pub(crate) fn durations_ns(&self) -> (u64, u64, u64) {
        let end = self.done_at.unwrap_or_else(Instant::now);
        let ns = |a: Instant, b: Instant| b.saturating_duration_since(a).as_nanos() as u64;
        let total = ns(self.started, end);
        if let Some(t) = &self.times {
            let first = t.first_token.unwrap_or(t.last_token);
            return (total, ns(t.admitted, first), ns(first, t.last_token));
        }
        let first = self.first_at.unwrap_or(end);
        (total, ns(self.started, first), ns(first, end))
    }

    /// Queue and inference durations in ns, as TGI's router reports them (`x-queue-time`,
    /// `x-inference-time`).
    pub(crate) fn queue_inference_ns(&self) -> (u64, u64) {
        let end = self.done_at.unwrap_or_else(Instant::now);
        let (q, i) = self.queue_inference(end);
        (q.as_nanos() as u64, i.as_nanos() as u64)
    }
}

/// The `max_tokens` an engine applies to `plan`: the one asked for, else what the context
/// leaves after the prompt.
fn effective_max_tokens(sim: &Sim, plan: &Plan) -> u32 {
    plan.max_tokens.unwrap_or_else(|| {
        sim.config
            .max_model_len
            .saturating_sub(plan.prompt_tokens())
    })
}
