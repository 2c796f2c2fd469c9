//! Measured servers: the profile a live gateway exports (`GET /admin/profile`) — each
//! backend's learned prefill speed, decode speed at the batch sizes it was seen at, batch slots
//! and KV capacity — and its conversion into an engine [`Timing`].
//!
//! A decode step gives every running sequence one token, so a per-request decode speed `tps`
//! at batch `b` is a step of `1/tps`; the steps at the measured batches are fitted to
//! `decode_base + decode_per_seq × b` (least squares; one batch size: all of it is
//! `decode_base`). Prefill costs `1/prefill_tokens_per_second` per token.

use serde::{Deserialize, Serialize};

use crate::batching::Timing;
use std::time::Duration;

/// A profile document.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub backends: Vec<BackendProfile>,
}

/// One backend's measurements.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackendProfile {
    pub name: String,
    /// Batch slots (learned, configured or the kind's default).
    pub slots: u64,
    /// KV capacity in tokens, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_capacity_tokens: Option<u64>,
    pub prefill_tokens_per_second: f64,
    /// Per-request decode speed at the batch sizes it was measured at.
    pub decode: Vec<DecodePoint>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DecodePoint {
    pub batch: f64,
    pub tokens_per_second: f64,
}

/// How well a measured candidate's engine timing is known: each fitted parameter with its
/// standard error, the ranges the fit saw, and what the plan should not be trusted on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FitSummary {
    /// The backends whose measurements were merged into this candidate's timing.
    pub backends: Vec<String>,
    /// Where the measurements come from (`"engine metrics"` or `"gateway timings"`).
    pub source: String,
    pub params: Vec<FitParam>,
    /// Running-batch sizes the decode fit saw (lowest, highest).
    pub batch_range: (f64, f64),
    /// Uncached prompt tokens per request the prefill fit saw (lowest, highest).
    pub prompt_range: (f64, f64),
    /// Measurement windows behind the fit.
    pub samples: u64,
    /// Where the plan leaves the fitted ranges or the uncertainty moves a verdict.
    pub warnings: Vec<String>,
}

/// One fitted engine parameter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FitParam {
    /// `prefill_per_token`, `decode_base` or `decode_per_seq`.
    pub name: String,
    /// Seconds.
    pub value: f64,
    /// Standard error, seconds.
    pub stderr: f64,
}

/// KV capacity assumed when the profile does not know it (the simulator's default).
const DEFAULT_KV_TOKENS: u64 = 131_072;

impl BackendProfile {
    /// The engine timing these measurements stand for.
    pub fn timing(&self) -> Result<Timing, String> {
        if !(self.prefill_tokens_per_second > 0.0 && self.prefill_tokens_per_second.is_finite()) {
            return Err(format!(
                "backend `{}`: prefill_tokens_per_second must be above zero",
                self.name
            ));
        }
        let points: Vec<(f64, f64)> = self
            .decode
            .iter()
            .filter(|p| p.tokens_per_second > 0.0 && p.tokens_per_second.is_finite())
            .map(|p| (p.batch.max(1.0), 1.0 / p.tokens_per_second))
            .collect();
        if points.is_empty() {
            return Err(format!("backend `{}`: no decode measurement", self.name));
        }
        let (base, per_seq) = fit(&points);
        Ok(Timing {
            max_num_seqs: self.slots.max(1) as usize,
            kv_capacity_tokens: self.kv_capacity_tokens.unwrap_or(DEFAULT_KV_TOKENS).max(1),
            prefill_per_token: Duration::from_secs_f64(1.0 / self.prefill_tokens_per_second),
            decode_base: Duration::from_secs_f64(base),
            decode_per_seq: Duration::from_secs_f64(per_seq),
            ..Timing::default()
        })
    }
}

/// Least-squares `step = base + per_seq × batch`, both ≥ 0.
fn fit(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len() as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx < 1e-9 {
        return (my, 0.0);
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let per_seq = (sxy / sxx).max(0.0);
    ((my - per_seq * mx).max(0.0), per_seq)
}

/// Parse a profile and pick `backend` out of it.
pub fn backend_timing(text: &str, backend: &str) -> Result<Timing, String> {
    let p: Profile = serde_json::from_str(text).map_err(|e| format!("not a profile: {e}"))?;
    let known: Vec<&str> = p.backends.iter().map(|b| b.name.as_str()).collect();
    let b = p
        .backends
        .iter()
        .find(|b| b.name == backend)
        .ok_or_else(|| {
            format!(
                "no backend `{backend}` in the profile (it has: {})",
                known.join(", ")
            )
        })?;
    b.timing()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_steps_are_fitted_to_base_plus_per_sequence() {
        // steps of 15 ms + 0.15 ms × b
        let step = |b: f64| 0.015 + 0.00015 * b;
        let b = BackendProfile {
            name: "gpu-a".into(),
            slots: 64,
            kv_capacity_tokens: Some(50_000),
            prefill_tokens_per_second: 10_000.0,
            decode: [1.0, 16.0, 64.0]
                .iter()
                .map(|b| DecodePoint {
                    batch: *b,
                    tokens_per_second: 1.0 / step(*b),
                })
                .collect(),
        };
        let t = b.timing().expect("valid");
        assert!((t.decode_base.as_secs_f64() - 0.015).abs() < 1e-6);
        assert!((t.decode_per_seq.as_secs_f64() - 0.00015).abs() < 1e-7);
        assert_eq!(t.prefill_per_token, Duration::from_micros(100));
        assert_eq!((t.max_num_seqs, t.kv_capacity_tokens), (64, 50_000));
    }

    #[test]
    fn a_missing_backend_or_measurement_is_an_error() {
        let text =
            r#"{"backends":[{"name":"a","slots":8,"prefill_tokens_per_second":100,"decode":[]}]}"#;
        assert!(backend_timing(text, "b")
            .expect_err("absent")
            .contains("it has: a"));
        assert!(backend_timing(text, "a")
            .expect_err("no decode")
            .contains("no decode"));
    }
}
