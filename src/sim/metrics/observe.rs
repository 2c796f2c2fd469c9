//! When each series is observed, as the real engines do it, from facts the scheduler measured on
//! its own clock ([`StepObs`] once per engine step, [`FinishObs`] once per finished request).
//!
//! vLLM (`vllm/v1/metrics/stats.py`, `loggers.py`): per step (iteration) the prompt tokens of
//! the requests whose prefill completed in it (total, and by source: computed or served from the
//! prefix cache), the generated tokens, `iteration_tokens_total` = prompt + generated, one
//! inter-token latency per request that already had its first token, and TTFT for the others;
//! per finished request the phase durations (queue = scheduled − queued, prefill = first token
//! − scheduled, decode = last − first token, inference = last token − scheduled, e2e = end −
//! arrival), its token counts, its time per output token (only with more than one token), its
//! `max_tokens`, `n` and preemptions.
//!
//! TGI (`backends/v3/src/{backend,queue}.rs`): one forward pass per method per step: a step
//! that admits requests is a prefill forward for them and, if others were running, a decode
//! forward for those; the batch size of each admitted group (`tgi_batch_next_size`).
//!
//! Invariants: every duration comes from the scheduler's instants, so inference = prefill +
//! decode and e2e = queue + inference for each request, and a request's decode time is the sum
//! of its inter-token latencies. The per-step cost is a handful of atomic adds.

use std::sync::atomic::Ordering::Relaxed;

use super::{Dialect, ModelStats};

/// One engine step, measured by the scheduler.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct StepObs {
    /// The step's length on the clock (from its admission round to its end).
    pub secs: f64,
    /// Share of `secs` that belongs to the prefill of the admitted requests (0..1).
    pub prefill_share: f64,
    /// Time since the previous step's end: the inter-token latency of every decoding request.
    pub itl_secs: f64,
    /// Requests that already had their first token and got one more.
    pub decoding: u64,
    /// Requests whose prefill ran in this step.
    pub prefilled: u64,
    /// Their prompt tokens, and how many of those the prefix cache served.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// Tokens generated in this step (one per running request that still had one to make).
    pub generated: u64,
}

/// One finished request, measured by the scheduler (seconds).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FinishObs {
    pub queue: f64,
    /// `None` when no token was generated.
    pub prefill: Option<f64>,
    pub decode: f64,
    pub inference: f64,
    pub e2e: f64,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub generated: u32,
    /// The request's effective `max_tokens`.
    pub max_tokens: u32,
}

impl ModelStats {
    /// Count one engine step.
    pub(crate) fn step(&self, s: &StepObs) {
        self.generation_tokens.fetch_add(s.generated, Relaxed);
        self.iterations.fetch_add(1, Relaxed);
        if s.prefilled > 0 {
            self.prompt_tokens.fetch_add(s.prompt_tokens, Relaxed);
            self.prompt_cached.fetch_add(s.cached_tokens, Relaxed);
        }
        match self.dialect {
            Dialect::Vllm => {
                let v = &self.vllm;
                v.iteration_tokens
                    .observe((s.prompt_tokens + s.generated) as f64);
                v.itl.observe_n(s.itl_secs, s.decoding);
            }
            Dialect::Tgi => {
                let share = s.prefill_share.clamp(0.0, 1.0);
                if s.prefilled > 0 {
                    self.tgi.prefill.observe(s.secs * share);
                }
                if s.decoding > 0 {
                    self.tgi.decode.observe(s.secs * (1.0 - share));
                }
            }
            Dialect::Plain => {}
        }
    }

    /// A request's first token came `secs` after it arrived.
    pub(crate) fn first_token(&self, secs: f64) {
        if self.dialect == Dialect::Vllm {
            self.vllm.ttft.observe(secs);
        }
    }

    /// A group of `n` requests was taken from the queue into the batch.
    pub(crate) fn admitted_group(&self, n: u64) {
        if self.dialect == Dialect::Tgi && n > 0 {
            self.tgi.next_size.observe(n as f64);
        }
    }

    /// Count one finished request.
    pub(crate) fn finished(&self, f: &FinishObs) {
        if self.dialect != Dialect::Vllm {
            return;
        }
        let v = &self.vllm;
        v.e2e.observe(f.e2e);
        v.queue_time.observe(f.queue);
        if let Some(prefill) = f.prefill {
            v.inference_time.observe(f.inference);
            v.prefill_time.observe(prefill);
            v.decode_time.observe(f.decode);
            if f.generated > 1 {
                v.tpot.observe(f.decode / f64::from(f.generated - 1));
            }
        }
        let computed = f.prompt_tokens.saturating_sub(f.cached_tokens);
        v.prefill_kv_computed.observe(f64::from(computed));
        v.prompt_tokens.observe(f64::from(f.prompt_tokens));
        v.generation_tokens.observe(f64::from(f.generated));
        v.max_generation_tokens.observe(f64::from(f.generated));
        v.params_n.observe(1.0);
        if f.max_tokens > 0 {
            v.params_max_tokens.observe(f64::from(f.max_tokens));
        }
        v.preemptions.observe(0.0);
    }
}

#[cfg(test)]
mod tests {
    use super::super::ModelStats;
    use super::{FinishObs, StepObs};
    use crate::sim::SimKind;
    use std::sync::atomic::Ordering::Relaxed;

    #[test]
    fn a_step_counts_prompt_generation_and_itl() {
        let s = ModelStats::new(SimKind::Vllm, 1000, 1024);
        s.step(&StepObs {
            secs: 0.02,
            itl_secs: 0.021,
            decoding: 3,
            prefilled: 1,
            prompt_tokens: 10,
            cached_tokens: 4,
            generated: 4,
            ..Default::default()
        });
        assert_eq!(s.prompt_tokens.load(Relaxed), 10);
        assert_eq!(s.prompt_cached.load(Relaxed), 4);
        assert_eq!(s.generation_tokens.load(Relaxed), 4);
        assert_eq!(s.vllm.iteration_tokens.count(), 1);
        assert_eq!(s.vllm.iteration_tokens.sum(), 14.0);
        assert_eq!(s.vllm.itl.count(), 3);
        assert!((s.vllm.itl.sum() - 0.063).abs() < 1e-12);
    }

    #[test]
    fn a_tgi_step_splits_into_its_forward_passes() {
        let s = ModelStats::new(SimKind::Tgi, 1000, 1024);
        let mut step = StepObs {
            secs: 0.1,
            prefill_share: 0.25,
            decoding: 2,
            prefilled: 1,
            ..Default::default()
        };
        s.step(&step);
        step.prefilled = 0;
        step.prefill_share = 0.0;
        s.step(&step);
        assert_eq!(s.tgi.prefill.count(), 1);
        assert!((s.tgi.prefill.sum() - 0.025).abs() < 1e-12);
        assert_eq!(s.tgi.decode.count(), 2);
        assert!((s.tgi.decode.sum() - 0.175).abs() < 1e-12);
        assert_eq!(s.vllm.iteration_tokens.count(), 0);
    }

    #[test]
    fn a_single_token_answer_has_no_time_per_output_token() {
        let s = ModelStats::new(SimKind::Vllm, 1000, 1024);
        let f = FinishObs {
            prefill: Some(0.1),
            generated: 1,
            prompt_tokens: 5,
            ..Default::default()
        };
        s.finished(&f);
        s.finished(&FinishObs {
            generated: 3,
            decode: 0.2,
            ..f
        });
        assert_eq!(s.vllm.tpot.count(), 1);
        assert!((s.vllm.tpot.sum() - 0.1).abs() < 1e-12);
        assert_eq!(s.vllm.prefill_time.count(), 2);
        assert_eq!(s.vllm.generation_tokens.sum(), 4.0);
    }
}
