//! How many batch lines each engine may hold at once: few enough that, by the engine's own
//! step costs, they make the steps an interactive request waits through at most
//! `[batch] max_ttft_rise` longer.
//!
//! ```text
//! step(n)    = decode_base + decode_per_seq × n + prefill_per_token × prompt per step
//!              the engine's mean step with n interactive requests
//! line cost  = decode_per_seq + prefill_per_token × line prompt / line output
//!              what one batch line adds to each step: its own decode, and its prefill
//!              spread over the steps of its answer
//! allowance  = max(1, ⌊ max_ttft_rise × step(n) / line cost ⌋)
//! ```
//!
//! An interactive request's first token comes at the end of the step that holds its prefill,
//! after the steps it waited through for it: each made at most `max_ttft_rise` longer, its
//! TTFT rises by at most as much, as long as it does not wait for a slot (the slot headroom
//! and [`MakeRoom`] keep that away). `prompt per step` is what the engine computed of prompts
//! per step over the same windows, batch lines included: the mean step, not one that holds a
//! whole typical prompt: a few long prompts make the mean prompt, and a step sized on it would
//! allow several times what the steps of a short request hide. A step that holds a long
//! prefill rises less than the bound, one with none more: the bound holds on average over
//! steps, as does a line's own prefill, which lands whole in one step.
//!
//! Step costs are fitted ([`crate::batching::fit`]) to the engine's newest timing windows
//! ([`crate::fleet::timings`]), again at most every [`REFIT`], and taken one standard error
//! towards fewer lines (a shorter base, dearer sequences and prompt tokens), so a young or
//! noisy fit allows less; the lines' prompt (computed, not cached) and output sizes are
//! averages of their answers' usage. An engine without a fit yet, or one that reports no step
//! timing, has no allowance beyond its free slots. One line per engine may always run, so a
//! batch moves wherever there is a free slot. The allowance is linear in `n`, so it is
//! published as a bound ([`LineBound`]) each backend applies to its own count at each pick;
//! a backend without interactive traffic for a while has no interactive time to protect and
//! lifts it, and the first interactive request routed there makes the lines over it give way
//! ([`crate::fleet::background`]).
//!
//! [`MakeRoom`]: crate::fleet::make_room::MakeRoom

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::batching::fit;
use crate::fleet::background::LineBound;
use crate::fleet::speed::Ewma;
use crate::fleet::Backend;
use crate::telemetry::metrics as m;

/// How long a backend's fitted step costs are used before they are fitted again.
pub const REFIT: Duration = Duration::from_secs(5);
/// Timing windows a fit reads: the newest five minutes at the default one-second scrape.
const WINDOWS: usize = 300;

/// An engine's step costs, in seconds, and the prompt tokens it computes per step.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Costs {
    decode_base: f64,
    decode_per_seq: f64,
    prefill_per_token: f64,
    prompt_per_step: f64,
}

/// One backend's costs and when they were fitted (`None`: no fit then).
struct Fitted {
    at: Instant,
    costs: Option<Costs>,
}

/// The allowances of one runner's backends.
pub struct StepBudget {
    max_rise: f64,
    fitted: Mutex<HashMap<String, Fitted>>,
    /// Per line: prompt tokens computed (not cached) and output tokens.
    prompt: Ewma,
    output: Ewma,
}

impl StepBudget {
    pub fn new(max_rise: f64) -> StepBudget {
        StepBudget {
            max_rise,
            fitted: Mutex::new(HashMap::new()),
            prompt: Ewma::new(),
            output: Ewma::new(),
        }
    }

    /// Learn a line's size from its answer body's `usage` (chat and text completions' or the
    /// Responses API's names); an answer without output (embeddings) teaches nothing.
    pub fn observe(&self, answer: &Value) {
        let Some(usage) = answer.get("usage") else {
            return;
        };
        let count = |names: [&str; 2]| {
            names
                .iter()
                .find_map(|n| usage.get(*n).and_then(Value::as_u64))
        };
        let (Some(prompt), Some(output)) = (
            count(["prompt_tokens", "input_tokens"]),
            count(["completion_tokens", "output_tokens"]),
        ) else {
            return;
        };
        if output == 0 {
            return;
        }
        let cached = ["prompt_tokens_details", "input_tokens_details"]
            .iter()
            .find_map(|d| usage.get(*d)?.get("cached_tokens")?.as_u64())
            .unwrap_or(0);
        // An EWMA keeps no zero: a prompt all cached counts as one token computed.
        self.prompt
            .observe(prompt.saturating_sub(cached).max(1) as f64);
        self.output.observe(output as f64);
    }

    /// The most batch lines `b` may hold now (`None`: no bound but its slots): its bound
    /// (none without fitted costs) is published on the backend for routing, and the
    /// allowance shown in `/metrics` (`+Inf` without a bound, or while the backend has no
    /// interactive traffic: [`crate::fleet::background`]).
    pub fn allow(&self, b: &Backend) -> Option<u64> {
        let bound = self
            .costs(b)
            .and_then(|c| bound(c, self.max_rise, self.line_shape()));
        b.state.set_background_bound(bound);
        let allowance = b.state.background_allowance();
        metrics::gauge!(m::BATCH_ALLOWANCE, "backend" => b.name().to_string())
            .set(allowance.map_or(f64::INFINITY, |a| a as f64));
        allowance
    }

    /// Prompt tokens computed per output token of a line (0 until a line has answered).
    fn line_shape(&self) -> f64 {
        match (self.prompt.get(), self.output.get()) {
            (Some(p), Some(o)) if o >= 1.0 => p / o,
            _ => 0.0,
        }
    }

    /// `b`'s step costs, fitted again when older than [`REFIT`].
    fn costs(&self, b: &Backend) -> Option<Costs> {
        let Ok(mut fitted) = self.fitted.lock() else {
            return None;
        };
        let now = Instant::now();
        if let Some(f) = fitted.get(b.name()) {
            if now.duration_since(f.at) < REFIT {
                return f.costs;
            }
        }
        let windows = b.state.timings().recent(WINDOWS);
        let costs = fit::fit(&windows).ok().and_then(|f| {
            // One standard error towards fewer lines: a young or noisy fit allows less.
            let c = Costs {
                decode_base: f.decode_base.value - f.decode_base.stderr,
                decode_per_seq: (f.decode_per_seq.value + f.decode_per_seq.stderr).max(0.0),
                prefill_per_token: (f.prefill_per_token.value + f.prefill_per_token.stderr)
                    .max(0.0),
                prompt_per_step: prompt_per_step(&windows),
            };
            (c.decode_base.is_finite() && c.decode_base > 0.0).then_some(c)
        });
        fitted.insert(b.name().to_string(), Fitted { at: now, costs });
        costs
    }
}

/// Prompt tokens computed per step over `windows` (0 without a step).
fn prompt_per_step(windows: &[fit::Window]) -> f64 {
    let (tokens, steps) = windows
        .iter()
        .fold((0.0, 0.0), |(t, s), w| (t + w.prompt_computed, s + w.steps));
    if steps >= 1.0 {
        tokens / steps
    } else {
        0.0
    }
}

/// The bound by the formula of the module doc: `lines + per_interactive × n`; `None` when a
/// line costs nothing by the fit (its windows did not tell the cost of a sequence, and no line
/// has answered yet): then nothing bounds the lines but the slots, as without a fit.
fn bound(c: Costs, max_rise: f64, prompt_per_output: f64) -> Option<LineBound> {
    let line = c.decode_per_seq + c.prefill_per_token * prompt_per_output;
    (line > 0.0).then(|| LineBound {
        lines: max_rise * (c.decode_base + c.prefill_per_token * c.prompt_per_step) / line,
        per_interactive: max_rise * c.decode_per_seq / line,
    })
}

/// The allowance with `interactive` requests in flight (`u64::MAX`: no bound).
#[cfg(test)]
fn allowance(c: Costs, max_rise: f64, interactive: f64, prompt_per_output: f64) -> u64 {
    bound(c, max_rise, prompt_per_output).map_or(u64::MAX, |b| b.at(interactive as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const FAST: Costs = Costs {
        decode_base: 0.010,
        decode_per_seq: 0.0001,
        prefill_per_token: 0.00005,
        prompt_per_step: 0.0,
    };

    #[test]
    fn lines_make_steps_at_most_the_bound_longer() {
        // 10 ms + 0.1 ms per sequence, 10 interactive: an 11 ms step; 5% of it is 0.55 ms,
        // five lines' decode.
        assert_eq!(allowance(FAST, 0.05, 10.0, 0.0), 5);
        let step = |n: f64| FAST.decode_base + FAST.decode_per_seq * n;
        assert!(step(15.0) / step(10.0) - 1.0 <= 0.05);
        assert!(step(16.0) / step(10.0) - 1.0 > 0.05, "one more passes it");
        // A wider bound, more lines; more interactive ones, a longer step to hide them in.
        assert_eq!(allowance(FAST, 0.25, 10.0, 0.0), 27);
        assert_eq!(allowance(FAST, 0.05, 30.0, 0.0), 6);
    }

    #[test]
    fn the_prefill_of_a_mean_step_hides_more_lines() {
        // 10 ms + 1 ms + 200 tokens at 50 us: a 21 ms step, 5% of it 1.05 ms.
        let c = Costs {
            prompt_per_step: 200.0,
            ..FAST
        };
        assert_eq!(allowance(c, 0.05, 10.0, 0.0), 10);
    }

    #[test]
    fn a_line_pays_for_its_prefill_over_its_answer() {
        // 10 prompt tokens computed per output token: 0.5 ms of prefill per step on top of
        // 0.1 ms of decode.
        assert_eq!(allowance(FAST, 0.25, 10.0, 10.0), 4);
    }

    #[test]
    fn the_prefill_per_step_is_over_every_step_not_per_request() {
        // 4 requests of 1,000 tokens over 80 steps: 50 tokens a step, where a step holding a
        // mean prompt would be priced at 1,000
        let w = |tokens: f64, steps: f64| fit::Window {
            prompt_computed: tokens,
            steps,
            prefill_count: 2.0,
            ..Default::default()
        };
        assert_eq!(prompt_per_step(&[]), 0.0);
        assert_eq!(prompt_per_step(&[w(3000.0, 40.0), w(1000.0, 40.0)]), 50.0);
    }

    #[test]
    fn one_line_may_always_run_and_free_decode_is_unbounded() {
        assert_eq!(allowance(FAST, 0.0, 0.0, 100.0), 1);
        let flat = Costs {
            decode_per_seq: 0.0,
            prefill_per_token: 0.0,
            ..FAST
        };
        assert_eq!(allowance(flat, 0.05, 3.0, 1.0), u64::MAX, "no bound");
    }

    #[test]
    fn line_sizes_come_from_usage_less_the_cache() {
        let b = StepBudget::new(0.05);
        assert_eq!(b.line_shape(), 0.0, "nothing answered yet");
        b.observe(&json!({"data": [], "usage": {"prompt_tokens": 9, "total_tokens": 9}}));
        assert_eq!(b.line_shape(), 0.0, "an embedding has no output");
        b.observe(
            &json!({"usage": {"prompt_tokens": 300, "completion_tokens": 50,
            "prompt_tokens_details": {"cached_tokens": 100}}}),
        );
        assert_eq!(b.line_shape(), 4.0);
        let r = StepBudget::new(0.05);
        r.observe(&json!({"usage": {"input_tokens": 80, "output_tokens": 20}}));
        assert_eq!(r.line_shape(), 4.0, "the Responses API's names");
    }
}
