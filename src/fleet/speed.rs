//! What the gateway has measured about its backends and models, as exponentially weighted
//! moving averages (EWMAs) updated when a request settles:
//!
//! - per backend ([`Speeds`], in [`super::BackendState::speeds`]): time to first token, prefill
//!   speed (prompt tokens it did not have cached / TTFT), decode speed (completion tokens / (end − first token)) and
//!   the whole request's duration;
//! - per model ([`ModelShapes`]): the average output length (used when a request sets no
//!   `max_tokens`) and the ratio of reported prompt tokens to the gateway's estimate (so the
//!   tokenizer-free estimate is corrected by what responses report).
//!
//! Invariant: every value is an `f64` stored as bits in an atomic, 0 meaning "no sample yet";
//! updates are lock-free and a lost race only drops one sample's weight.
//!
//! Beside them, [`Speeds::home_level`] holds the backend's prefix-affinity weight as a
//! quantised [`Level`] (see `routing::affinity`): a step changes only when what it stands for
//! moves well past the step, so the homes it decides do not churn as the EWMAs wiggle.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dashmap::DashMap;

use crate::telemetry::metrics as m;

/// Weight of a new sample.
const ALPHA: f64 = 0.2;

/// One EWMA (0 = no sample yet).
#[derive(Debug, Default)]
pub struct Ewma(AtomicU64);

impl Ewma {
    /// Nothing observed yet.
    pub const fn new() -> Ewma {
        Ewma(AtomicU64::new(0))
    }

    pub fn get(&self) -> Option<f64> {
        let v = f64::from_bits(self.0.load(Ordering::Relaxed));
        (v > 0.0 && v.is_finite()).then_some(v)
    }

    pub fn observe(&self, sample: f64) {
        if !(sample.is_finite() && sample > 0.0) {
            return;
        }
        let next = match self.get() {
            None => sample,
            Some(prev) => prev + ALPHA * (sample - prev),
        };
        self.0.store(next.to_bits(), Ordering::Relaxed);
    }
}

/// A quantised value with hysteresis: an integer level that follows a real-valued input only
/// when the input is more than a band away from it (0 stored = unset).
#[derive(Debug, Default)]
pub struct Level(AtomicU64);

impl Level {
    /// Stored as `level + BIAS`, so 0 can mean "unset" and negative levels fit.
    const BIAS: i64 = 1 << 40;

    pub fn get(&self) -> Option<i64> {
        match self.0.load(Ordering::Relaxed) {
            0 => None,
            v => Some(v as i64 - Self::BIAS),
        }
    }

    /// The level after seeing `raw` (in level units): unchanged while `|raw − level| ≤ band`,
    /// else `raw` rounded. The first finite input sets it. A lost race between two callers
    /// stores one of two levels computed from nearly the same input.
    pub fn follow(&self, raw: f64, band: f64) -> Option<i64> {
        let current = self.get();
        if !raw.is_finite() {
            return current;
        }
        let raw = raw.clamp(-(Self::BIAS as f64) / 2.0, Self::BIAS as f64 / 2.0);
        match current {
            Some(l) if (raw - l as f64).abs() <= band => Some(l),
            _ => {
                let l = raw.round() as i64;
                self.0.store((l + Self::BIAS) as u64, Ordering::Relaxed);
                Some(l)
            }
        }
    }
}

/// Measured speeds of one backend.
#[derive(Debug, Default)]
pub struct Speeds {
    pub ttft_seconds: Ewma,
    /// Prompt tokens prefilled per second, per request: the tokens the engine did not have in
    /// its prefix cache over the time to first token (includes the queueing inside the engine).
    pub prefill_tps: Ewma,
    /// Completion tokens per second, per request, at the batch sizes it ran with.
    pub decode_tps: Ewma,
    /// Whole request duration.
    pub service_seconds: Ewma,
    /// Requests in flight at the backend when samples were taken, plus one (so 0 is valid).
    busy_plus_one: Ewma,
    pub samples: AtomicU64,
    /// When the last sample arrived (ms since process start; 0 = never).
    pub last_sample_ms: AtomicU64,
    /// The prefix-affinity weight of the backend, quantised (set by routing once the backend
    /// has a measured decode speed).
    pub home_level: Level,
    /// The largest batch the engine was seen to hold (learned slots or requests running; 0 =
    /// none seen). Unlike the learned slots, which read low for a while whenever a full KV
    /// cache rather than the batch limit holds requests back, it does not move with load.
    pub batch_seen: AtomicU64,
}

/// One finished request, as settlement saw it.
#[derive(Debug, Clone, Copy)]
pub struct Observation {
    pub prompt_tokens: u64,
    /// Of those, the tokens the engine served from its prefix cache (reported in the usage, else
    /// what routing expected from its KV events; 0 when neither is known): not prefilled, so
    /// not part of the prefill speed.
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// Until the first token (streams only).
    pub ttft: Option<Duration>,
    /// Until the end.
    pub total: Duration,
    /// It waited for a batch slot inside the engine: its TTFT is queueing, not prefill.
    pub queued: bool,
}

/// Below this many tokens the decode-speed sample is mostly noise.
const MIN_DECODE_TOKENS: u64 = 4;

impl Speeds {
    /// The typical number of requests in flight when the speeds were measured.
    pub fn busy_seen(&self) -> Option<f64> {
        self.busy_plus_one.get().map(|v| (v - 1.0).max(0.0))
    }

    /// Record one finished request; `busy` is the backend's in-flight count as it ended.
    pub fn observe(&self, o: &Observation, busy: f64) {
        self.busy_plus_one.observe(busy.max(0.0) + 1.0);
        let total = o.total.as_secs_f64();
        self.service_seconds.observe(total);
        self.samples.fetch_add(1, Ordering::Relaxed);
        self.last_sample_ms
            .store(super::backend::monotonic_ms().max(1), Ordering::Relaxed);
        match o.ttft {
            Some(ttft) => {
                let ttft = ttft.as_secs_f64().max(1e-4);
                self.ttft_seconds.observe(ttft);
                // A cache hit's TTFT is the time of the rest of the prompt: counting the
                // whole prompt would make a backend that serves hits look many times faster
                // at prefill than it is, and cold prompts would be priced as nearly free there.
                let prefilled = o.prompt_tokens.saturating_sub(o.cached_tokens);
                if prefilled > 0 && !o.queued {
                    self.prefill_tps.observe(prefilled as f64 / ttft);
                }
                let decode = (total - ttft).max(1e-4);
                if o.completion_tokens >= MIN_DECODE_TOKENS {
                    // the first token came with the prefill
                    self.decode_tps
                        .observe((o.completion_tokens - 1) as f64 / decode);
                }
            }
            None => {
                // Not streamed: no split; attribute the whole time to decoding when there is
                // output (it dominates), which keeps relative speeds right.
                if o.completion_tokens >= MIN_DECODE_TOKENS {
                    self.decode_tps
                        .observe(o.completion_tokens as f64 / total.max(1e-4));
                }
            }
        }
    }
}

/// Per-model learned request shape.
#[derive(Debug, Default)]
pub struct ModelShape {
    pub output_tokens: Ewma,
    /// Reported prompt tokens / estimated prompt tokens.
    pub prompt_ratio: Ewma,
}

/// Learned shapes of all models (client-facing canonical names).
#[derive(Debug, Default)]
pub struct ModelShapes {
    by_model: DashMap<String, ModelShape>,
}

/// Bounds on the prompt correction, so one odd response cannot distort routing.
const RATIO_BOUNDS: (f64, f64) = (0.25, 4.0);
/// At most this many models are tracked (names come from config, but be safe).
const MAX_MODELS: usize = 4096;

impl ModelShapes {
    pub fn new() -> Self {
        Self::default()
    }

    /// Record what a finished request reported.
    pub fn observe(&self, model: &str, estimated_prompt: u64, prompt: u64, completion: u64) {
        if !self.by_model.contains_key(model) && self.by_model.len() >= MAX_MODELS {
            return;
        }
        let shape = self.by_model.entry(model.to_string()).or_default();
        shape.output_tokens.observe(completion as f64);
        if estimated_prompt > 0 && prompt > 0 {
            let r = (prompt as f64 / estimated_prompt as f64).clamp(RATIO_BOUNDS.0, RATIO_BOUNDS.1);
            shape.prompt_ratio.observe(r);
        }
    }

    /// Average output tokens of `model`, once learned.
    pub fn output_tokens(&self, model: &str) -> Option<u64> {
        let v = self.by_model.get(model)?.output_tokens.get()?;
        Some(v.round().max(1.0) as u64)
    }

    /// `estimate` corrected by what responses of `model` reported.
    pub fn corrected_prompt(&self, model: &str, estimate: u64) -> u64 {
        match self.by_model.get(model).and_then(|s| s.prompt_ratio.get()) {
            Some(r) => (estimate as f64 * r).round() as u64,
            None => estimate,
        }
    }
}

/// Publish a backend's measured speeds.
pub fn backend_speeds(backend: &str, s: &Speeds) {
    if let Some(v) = s.ttft_seconds.get() {
        metrics::gauge!(m::BACKEND_TTFT_EWMA_SECONDS, "backend" => backend.to_string()).set(v);
    }
    if let Some(v) = s.decode_tps.get() {
        metrics::gauge!(m::BACKEND_DECODE_TOKENS_PER_SECOND, "backend" => backend.to_string())
            .set(v);
    }
    if let Some(v) = s.prefill_tps.get() {
        metrics::gauge!(m::BACKEND_PREFILL_TOKENS_PER_SECOND, "backend" => backend.to_string())
            .set(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ewma_starts_at_first_sample_and_moves_by_alpha() {
        let e = Ewma::default();
        assert_eq!(e.get(), None);
        e.observe(10.0);
        assert_eq!(e.get(), Some(10.0));
        e.observe(20.0);
        assert!((e.get().unwrap() - 12.0).abs() < 1e-9);
        e.observe(f64::NAN);
        e.observe(-1.0);
        assert!((e.get().unwrap() - 12.0).abs() < 1e-9);
    }

    #[test]
    fn level_follows_only_moves_beyond_its_band() {
        let l = Level::default();
        assert_eq!(l.get(), None);
        assert_eq!(l.follow(f64::NAN, 1.0), None);
        assert_eq!(l.follow(-3.4, 1.0), Some(-3));
        assert_eq!(l.follow(-2.1, 1.0), Some(-3));
        assert_eq!(l.follow(-3.9, 1.0), Some(-3));
        assert_eq!(l.follow(-1.8, 1.0), Some(-2));
        assert_eq!(l.get(), Some(-2));
        assert_eq!(l.follow(40.0, 1.0), Some(40));
    }

    #[test]
    fn speeds_split_prefill_and_decode() {
        let s = Speeds::default();
        s.observe(
            &Observation {
                prompt_tokens: 1000,
                cached_tokens: 0,
                completion_tokens: 101,
                ttft: Some(Duration::from_millis(500)),
                total: Duration::from_millis(2500),
                queued: false,
            },
            0.0,
        );
        assert!((s.prefill_tps.get().unwrap() - 2000.0).abs() < 1e-6);
        assert!((s.decode_tps.get().unwrap() - 50.0).abs() < 1e-6);
        assert!((s.ttft_seconds.get().unwrap() - 0.5).abs() < 1e-9);
        // tiny outputs do not move the decode speed
        s.observe(
            &Observation {
                prompt_tokens: 10,
                cached_tokens: 0,
                completion_tokens: 1,
                ttft: Some(Duration::from_millis(10)),
                total: Duration::from_millis(11),
                queued: true,
            },
            2.0,
        );
        assert!((s.busy_seen().unwrap() - 0.4).abs() < 1e-9);
        assert!((s.decode_tps.get().unwrap() - 50.0).abs() < 1e-6);
    }

    /// A request served mostly from the prefix cache prefilled only the rest of its prompt in
    /// its time to first token: that rest is the sample, not the whole prompt.
    #[test]
    fn prefill_speed_counts_only_the_uncached_prompt() {
        let s = Speeds::default();
        let o = |cached_tokens| Observation {
            prompt_tokens: 10_000,
            cached_tokens,
            completion_tokens: 101,
            ttft: Some(Duration::from_millis(100)),
            total: Duration::from_millis(2100),
            queued: false,
        };
        // 9,000 of 10,000 cached: 1,000 tokens in 0.1 s
        s.observe(&o(9_000), 0.0);
        assert!((s.prefill_tps.get().unwrap() - 10_000.0).abs() < 1e-6);
        // the whole prompt cached (reported so): nothing was prefilled, no sample
        s.observe(&o(10_000), 0.0);
        assert!((s.prefill_tps.get().unwrap() - 10_000.0).abs() < 1e-6);
        // nothing cached: the whole prompt
        s.observe(&o(0), 0.0);
        assert!((s.prefill_tps.get().unwrap() - 10_000.0 - 0.2 * 90_000.0).abs() < 1e-6);
    }

    #[test]
    fn model_stats_learn_output_and_correct_estimates() {
        let m = ModelShapes::new();
        assert_eq!(m.output_tokens("a"), None);
        assert_eq!(m.corrected_prompt("a", 100), 100);
        m.observe("a", 100, 150, 40);
        assert_eq!(m.output_tokens("a"), Some(40));
        assert_eq!(m.corrected_prompt("a", 100), 150);
        m.observe("a", 100, 100_000, 40);
        // clamped to 4x, then averaged
        let c = m.corrected_prompt("a", 100);
        assert!((150..=200).contains(&c), "{c}");
    }
}
