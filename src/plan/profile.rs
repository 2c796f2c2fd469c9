//! Measured servers: the profile a live gateway exports (`GET /admin/profile`) and its
//! conversion into an engine [`Timing`] with a [`FitSummary`] of how well it is known.
//!
//! Where the engine reports its own timing (vLLM's step, inter-token and prefill histograms),
//! the profile carries those measurements as windows and the planner fits the step costs to
//! them ([`crate::batching::fit`]); the windows of several backends of one kind are merged
//! into one fit, and a backend whose own fit differs from the merged one is named with how far.
//! Otherwise the gateway's client-side speeds are the fallback: a per-request decode speed
//! `tps` at batch `b` is a step of `1/tps`, fitted to `decode_base + decode_per_seq × b`, and
//! prefill costs `1/prefill_tokens_per_second` per token — queue wait and prefill are not
//! separated there, which the summary says.

use serde::{Deserialize, Serialize};

use crate::batching::fit::{self, EngineFit, Window};
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
    /// The backend kind (`vllm`, `tgi`, …), when the exporting gateway said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Batch slots (learned, configured or the kind's default).
    pub slots: u64,
    /// Where `slots` comes from (`learned`, `configured`, `announced`, `default`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slots_source: Option<String>,
    /// KV capacity in tokens, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_capacity_tokens: Option<u64>,
    /// The gateway's client-side prefill speed (fallback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_tokens_per_second: Option<f64>,
    /// The gateway's client-side per-request decode speed at the batch sizes it was measured
    /// at (fallback).
    #[serde(default)]
    pub decode: Vec<DecodePoint>,
    /// What the engine itself reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<EngineReport>,
}

/// The engine's own timing measurements (the exporter's fit is informative only: the planner
/// refits, so merged backends share one fit).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineReport {
    #[serde(default)]
    pub windows: Vec<Window>,
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
    /// The engine time measured over the time the fitted (typical) costs predict; the plan's
    /// timing is the fitted costs scaled by it when above 1 (see
    /// [`crate::batching::fit::EngineFit::time_ratio`]).
    #[serde(default = "one")]
    pub time_ratio: f64,
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

fn one() -> f64 {
    1.0
}

/// A time ratio above this is worth a sentence.
const STALLS: f64 = 1.1;

/// KV capacity assumed when the profile does not know it (the simulator's default).
const DEFAULT_KV_TOKENS: u64 = 131_072;

impl BackendProfile {
    fn windows(&self) -> &[Window] {
        self.engine.as_ref().map_or(&[], |e| e.windows.as_slice())
    }

    /// The engine timing the gateway's client-side speeds stand for.
    fn gateway_timing(&self) -> Result<Timing, String> {
        let prefill = self.prefill_tokens_per_second.unwrap_or(0.0);
        if !(prefill > 0.0 && prefill.is_finite()) {
            return Err(format!(
                "backend `{}`: no engine timing and no prefill speed measured",
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
        let (base, per_seq) = least_squares(&points);
        Ok(Timing {
            prefill_per_token: Duration::from_secs_f64(1.0 / prefill),
            decode_base: Duration::from_secs_f64(base),
            decode_per_seq: Duration::from_secs_f64(per_seq),
            ..self.limits()
        })
    }

    /// Slots and KV capacity, with the rest of the timing at its defaults.
    /// The engine's limits, and how it schedules: TGI prefills an admitted group in a forward
    /// pass of its own.
    fn limits(&self) -> Timing {
        Timing {
            max_num_seqs: self.slots.max(1) as usize,
            kv_capacity_tokens: self.kv_capacity_tokens.unwrap_or(DEFAULT_KV_TOKENS).max(1),
            prefill_pass: self.kind.as_deref() == Some("tgi"),
            ..Timing::default()
        }
    }
}

/// Least-squares `step = base + per_seq × batch`, both ≥ 0.
fn least_squares(points: &[(f64, f64)]) -> (f64, f64) {
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

/// A backend's fitted parameter differing from the merged fit by more than this share (and
/// by more than twice the two standard errors) is named.
const DIFFERS: f64 = 0.15;

/// Parse a profile and make one engine timing of `backends` (one, or several of one kind to
/// merge), with its summary; `max_num_seqs` overrides the batch slots the profile knows.
pub fn measured(
    text: &str,
    backends: &[String],
    max_num_seqs: Option<usize>,
) -> Result<(Timing, FitSummary), String> {
    let p: Profile = serde_json::from_str(text).map_err(|e| format!("not a profile: {e}"))?;
    let chosen = pick(&p, backends)?;
    let mut warnings = Vec::new();
    let limits = limits(&chosen, max_num_seqs, &mut warnings)?;
    let with_engine: Vec<&BackendProfile> = chosen
        .iter()
        .copied()
        .filter(|b| !b.windows().is_empty())
        .collect();
    if with_engine.is_empty() {
        return from_gateway(&chosen, limits, warnings);
    }
    if with_engine.len() < chosen.len() {
        let left: Vec<&str> = chosen
            .iter()
            .filter(|b| b.windows().is_empty())
            .map(|b| b.name.as_str())
            .collect();
        warnings.push(format!(
            "left out of the fit (their engines reported no timing): {}",
            left.join(", ")
        ));
    }
    from_engine(&with_engine, limits, warnings)
}

/// The named backends of one kind.
fn pick<'a>(p: &'a Profile, backends: &[String]) -> Result<Vec<&'a BackendProfile>, String> {
    let known: Vec<&str> = p.backends.iter().map(|b| b.name.as_str()).collect();
    let chosen = backends
        .iter()
        .map(|name| {
            p.backends.iter().find(|b| &b.name == name).ok_or_else(|| {
                format!(
                    "no backend `{name}` in the profile (it has: {})",
                    known.join(", ")
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let kinds: Vec<&str> = chosen.iter().filter_map(|b| b.kind.as_deref()).collect();
    if kinds.windows(2).any(|k| k[0] != k[1]) {
        return Err(format!(
            "backends of different kinds cannot be merged ({})",
            kinds.join(", ")
        ));
    }
    Ok(chosen)
}

/// The batch slots and KV capacity of the merged backends (the fewest, the smallest), with a
/// warning where they differ or were never observed.
fn limits(
    chosen: &[&BackendProfile],
    max_num_seqs: Option<usize>,
    warnings: &mut Vec<String>,
) -> Result<Timing, String> {
    let first = chosen.first().ok_or("no backend named")?;
    let slots: Vec<u64> = chosen.iter().map(|b| b.slots).collect();
    let fewest = slots.iter().copied().min().unwrap_or(1);
    if slots.windows(2).any(|s| s[0] != s[1]) {
        let all: Vec<String> = slots.iter().map(u64::to_string).collect();
        warnings.push(format!(
            "the merged backends have different batch slots ({}); the plan uses the fewest",
            all.join(", ")
        ));
    }
    let unknown = chosen
        .iter()
        .all(|b| b.slots_source.as_deref() == Some("default"));
    if unknown && max_num_seqs.is_none() {
        warnings.push(format!(
            "the engines' batch limit was never observed (no full batch with requests waiting): \
             the plan assumes the kind's default of {fewest} slots; set `max_num_seqs` on the \
             candidate"
        ));
    }
    Ok(BackendProfile {
        slots: max_num_seqs.map_or(fewest, |n| n as u64),
        kv_capacity_tokens: chosen.iter().filter_map(|b| b.kv_capacity_tokens).min(),
        ..(*first).clone()
    }
    .limits())
}

/// One fit over the merged windows of `bs`, its costs scaled by the time ratio (stalls).
fn from_engine(
    bs: &[&BackendProfile],
    limits: Timing,
    mut warnings: Vec<String>,
) -> Result<(Timing, FitSummary), String> {
    let merged: Vec<Window> = bs.iter().flat_map(|b| b.windows()).copied().collect();
    let f = fit::fit(&merged).map_err(|e| format!("the engine timing of {}: {e}", names(bs)))?;
    if bs.len() > 1 {
        warnings.extend(differences(bs, &f));
    }
    if !f.fixed.is_empty() {
        warnings.push(format!(
            "the running batch never varied in the windows ({:.1}–{:.1}): {} could not be \
             separated and is fixed at 0, so larger batches are extrapolated at the measured \
             step cost",
            f.batch_range.0,
            f.batch_range.1,
            f.fixed.join(", ")
        ));
    }
    let k = f.time_ratio.max(1.0);
    if f.time_ratio > STALLS {
        warnings.push(format!(
            "the engines' steps took {:.2}× the fitted typical step on average (some were far \
             slower: stalls); the plan spreads that time over every step, so it gets the \
             throughput right but not the bursts of queueing a stall causes",
            f.time_ratio
        ));
    }
    let secs = |e: fit::Estimate| Duration::from_secs_f64(e.value * k);
    let timing = Timing {
        prefill_per_token: secs(f.prefill_per_token),
        decode_base: secs(f.decode_base),
        decode_per_seq: secs(f.decode_per_seq),
        outside: f
            .outside
            .map_or(Duration::ZERO, |e| Duration::from_secs_f64(e.value)),
        ..limits
    };
    let summary = FitSummary {
        backends: bs.iter().map(|b| b.name.clone()).collect(),
        source: "engine metrics".into(),
        params: params(&f),
        batch_range: f.batch_range,
        prompt_range: f.prompt_range,
        samples: f.windows,
        time_ratio: f.time_ratio,
        warnings,
    };
    Ok((timing, summary))
}

fn names(bs: &[&BackendProfile]) -> String {
    bs.iter()
        .map(|b| format!("`{}`", b.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The fitted step costs, then the time outside the engine when the profile tells it.
fn params(f: &EngineFit) -> Vec<FitParam> {
    let mut all = costs(f);
    all.extend(f.outside.map(|e| FitParam {
        name: "outside_engine".into(),
        value: e.value,
        stderr: e.stderr,
    }));
    all
}

/// The fitted step costs.
fn costs(f: &EngineFit) -> Vec<FitParam> {
    [
        ("prefill_per_token", f.prefill_per_token),
        ("decode_base", f.decode_base),
        ("decode_per_seq", f.decode_per_seq),
    ]
    .into_iter()
    .map(|(name, e)| FitParam {
        name: name.into(),
        value: e.value,
        stderr: e.stderr,
    })
    .collect()
}

/// The backends whose own fit differs from the merged one, and by how much.
fn differences(bs: &[&BackendProfile], merged: &EngineFit) -> Vec<String> {
    let all = costs(merged);
    let mut out = Vec::new();
    for b in bs {
        let Ok(own) = fit::fit(b.windows()) else {
            continue;
        };
        for (m, o) in all.iter().zip(costs(&own)) {
            let gap = (o.value - m.value).abs();
            if m.value > 0.0 && gap > DIFFERS * m.value && gap > 2.0 * (o.stderr + m.stderr) {
                out.push(format!(
                    "`{}` differs from the merged fit: {} {:.3} ms where the merged fit has {:.3} ms ({:.2}×)",
                    b.name,
                    o.name,
                    o.value * 1e3,
                    m.value * 1e3,
                    o.value / m.value
                ));
            }
        }
    }
    out
}

/// The fallback: the gateway's client-side speeds (of the first backend that has them).
fn from_gateway(
    chosen: &[&BackendProfile],
    limits: Timing,
    mut warnings: Vec<String>,
) -> Result<(Timing, FitSummary), String> {
    let mut first_error = None;
    let found = chosen.iter().find_map(|b| match b.gateway_timing() {
        Ok(t) => Some((b, t)),
        Err(e) => {
            first_error.get_or_insert(e);
            None
        }
    });
    let Some((b, t)) = found else {
        return Err(first_error.unwrap_or_else(|| "no backend named".into()));
    };
    warnings.push(format!(
        "measured from the gateway's side (`{}`'s engine reported no timing): queue wait, \
         prefill and decode are not separated, and no uncertainty is known",
        b.name
    ));
    let timing = Timing {
        max_num_seqs: limits.max_num_seqs,
        kv_capacity_tokens: limits.kv_capacity_tokens,
        ..t
    };
    let p = |name: &str, d: Duration| FitParam {
        name: name.into(),
        value: d.as_secs_f64(),
        stderr: 0.0,
    };
    let batches = b.decode.iter().map(|d| d.batch);
    let summary = FitSummary {
        backends: vec![b.name.clone()],
        source: "gateway timings".into(),
        params: vec![
            p("prefill_per_token", timing.prefill_per_token),
            p("decode_base", timing.decode_base),
            p("decode_per_seq", timing.decode_per_seq),
        ],
        batch_range: (
            batches.clone().fold(f64::MAX, f64::min),
            batches.fold(0.0, f64::max),
        ),
        prompt_range: (0.0, 0.0),
        samples: 0,
        time_ratio: 1.0,
        warnings,
    };
    Ok((timing, summary))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Windows on which an engine of `(base, per_seq, per_token)` seconds reports exactly.
    fn windows(base: f64, per_seq: f64, per_token: f64) -> Vec<Window> {
        (0..20)
            .map(|i| {
                let (steps, batch) = (50.0, 1.0 + f64::from(i % 8));
                let (per_step, per_req) =
                    (f64::from(i % 5) * 40.0, 200.0 + f64::from(i % 4) * 900.0);
                let step = |p: f64| base + per_seq * batch + per_token * p;
                Window {
                    at: f64::from(i),
                    steps,
                    generated: steps * batch,
                    prompt_computed: steps * per_step,
                    itl_sum: 100.0 * step(per_step),
                    itl_count: 100.0,
                    prefill_sum: 4.0 * step(per_req),
                    prefill_count: 4.0,
                    prefill_tokens: 4.0 * per_req,
                    ..Window::default()
                }
            })
            .collect()
    }

    fn backend(name: &str, kind: &str, w: Vec<Window>) -> BackendProfile {
        BackendProfile {
            name: name.into(),
            kind: Some(kind.into()),
            slots: 8,
            slots_source: Some("learned".into()),
            kv_capacity_tokens: Some(50_000),
            prefill_tokens_per_second: None,
            decode: Vec::new(),
            engine: Some(EngineReport { windows: w }),
        }
    }

    fn doc(bs: Vec<BackendProfile>) -> String {
        serde_json::to_string(&Profile { backends: bs }).expect("serialises")
    }

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn engine_windows_of_backends_of_one_kind_merge_into_one_fit() {
        let text = doc(vec![
            backend("a", "vllm", windows(0.015, 0.001, 0.0001)),
            backend("b", "vllm", windows(0.015, 0.001, 0.0001)),
        ]);
        let (t, s) = measured(&text, &names(&["a", "b"]), None).expect("fits");
        assert!((t.prefill_per_token.as_secs_f64() - 0.0001).abs() < 1e-9);
        assert!((t.decode_base.as_secs_f64() - 0.015).abs() < 1e-7);
        assert!((t.decode_per_seq.as_secs_f64() - 0.001).abs() < 1e-8);
        assert_eq!((t.max_num_seqs, t.kv_capacity_tokens), (8, 50_000));
        assert_eq!((s.source.as_str(), s.samples), ("engine metrics", 40));
        assert_eq!(s.backends, names(&["a", "b"]));
        assert_eq!(s.batch_range, (1.0, 8.0));
        assert_eq!(s.prompt_range, (200.0, 2_900.0));
        assert!((s.time_ratio - 1.0).abs() < 1e-9);
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    }

    #[test]
    fn a_backend_unlike_the_others_is_named_with_how_far() {
        let text = doc(vec![
            backend("a", "vllm", windows(0.015, 0.001, 0.0001)),
            backend("b", "vllm", windows(0.015, 0.001, 0.0001)),
            backend("slow", "vllm", windows(0.015, 0.001, 0.0004)),
        ]);
        let (_, s) = measured(&text, &names(&["a", "b", "slow"]), None).expect("fits");
        assert!(
            s.warnings
                .iter()
                .any(|w| w.contains("`slow` differs") && w.contains("prefill_per_token")),
            "{:?}",
            s.warnings
        );
        assert!(
            !s.warnings.iter().any(|w| w.contains("`a` differs")),
            "{:?}",
            s.warnings
        );
    }

    #[test]
    fn kinds_do_not_mix_and_missing_backends_are_listed() {
        let text = doc(vec![
            backend("a", "vllm", windows(0.015, 0.001, 0.0001)),
            backend("t", "tgi", windows(0.015, 0.001, 0.0001)),
        ]);
        let err = measured(&text, &names(&["a", "t"]), None).expect_err("two kinds");
        assert!(err.contains("different kinds"), "{err}");
        let err = measured(&text, &names(&["x"]), None).expect_err("absent");
        assert!(err.contains("it has: a, t"), "{err}");
    }

    #[test]
    fn without_engine_timing_the_gateway_speeds_are_the_fallback_and_say_so() {
        // steps of 15 ms + 0.15 ms × b
        let step = |b: f64| 0.015 + 0.00015 * b;
        let b = BackendProfile {
            prefill_tokens_per_second: Some(10_000.0),
            decode: [1.0, 16.0, 64.0]
                .iter()
                .map(|b| DecodePoint {
                    batch: *b,
                    tokens_per_second: 1.0 / step(*b),
                })
                .collect(),
            engine: None,
            ..backend("gpu-a", "ollama", Vec::new())
        };
        let (t, s) = measured(&doc(vec![b]), &names(&["gpu-a"]), None).expect("valid");
        assert!((t.decode_base.as_secs_f64() - 0.015).abs() < 1e-6);
        assert!((t.decode_per_seq.as_secs_f64() - 0.00015).abs() < 1e-7);
        assert_eq!(t.prefill_per_token, Duration::from_micros(100));
        assert_eq!(s.source, "gateway timings");
        assert_eq!(s.batch_range, (1.0, 64.0));
        assert!(s.warnings[0].contains("not separated"), "{:?}", s.warnings);
    }

    #[test]
    fn a_backend_with_nothing_measured_is_an_error() {
        let text =
            r#"{"backends":[{"name":"a","slots":8,"prefill_tokens_per_second":100,"decode":[]}]}"#;
        let err = measured(text, &names(&["a"]), None).expect_err("no decode");
        assert!(err.contains("no decode"), "{err}");
        let text = doc(vec![backend(
            "a",
            "vllm",
            windows(0.015, 0.001, 0.0001)[..3].to_vec(),
        )]);
        let err = measured(&text, &names(&["a"]), None).expect_err("three windows");
        assert!(err.contains("too few"), "{err}");
    }

    #[test]
    fn an_unobserved_batch_limit_is_said_and_can_be_set() {
        let b = BackendProfile {
            slots: 256,
            slots_source: Some("default".into()),
            ..backend("a", "vllm", windows(0.015, 0.001, 0.0001))
        };
        let text = doc(vec![b]);
        let (t, s) = measured(&text, &names(&["a"]), None).expect("fits");
        assert_eq!(t.max_num_seqs, 256);
        assert!(
            s.warnings.iter().any(|w| w.contains("never observed")),
            "{:?}",
            s.warnings
        );
        let (t, s) = measured(&text, &names(&["a"]), Some(16)).expect("fits");
        assert_eq!(t.max_num_seqs, 16);
        assert!(s.warnings.is_empty(), "{:?}", s.warnings);
    }

    #[test]
    fn stalls_scale_the_costs_to_the_engines_real_time_and_are_said() {
        let mut w = windows(0.015, 0.001, 0.0001);
        for x in w.iter_mut().step_by(5) {
            x.itl_sum *= 8.0;
        }
        let (t, s) =
            measured(&doc(vec![backend("a", "vllm", w)]), &names(&["a"]), None).expect("fits");
        assert!(s.time_ratio > 1.5, "{}", s.time_ratio);
        let typical = s
            .params
            .iter()
            .find(|p| p.name == "decode_base")
            .expect("base");
        let scaled = t.decode_base.as_secs_f64() / typical.value;
        assert!((scaled - s.time_ratio).abs() < 1e-6, "{scaled}");
        assert!(
            s.warnings.iter().any(|w| w.contains("stalls")),
            "{:?}",
            s.warnings
        );
    }

    #[test]
    fn a_batch_that_never_varied_is_said() {
        let w: Vec<Window> = windows(0.015, 0.001, 0.0001)
            .into_iter()
            .map(|w| {
                let step = |p: f64| 0.016 + 0.0001 * p;
                Window {
                    generated: w.steps,
                    itl_sum: w.itl_count * step(w.prompt_computed / w.steps),
                    prefill_sum: w.prefill_count * step(w.prefill_tokens / w.prefill_count),
                    ..w
                }
            })
            .collect();
        let (t, s) = measured(&doc(vec![backend("a", "vllm", w)]), &names(&["a"]), None)
            .expect("base and prefill are known");
        assert_eq!(t.decode_per_seq, Duration::ZERO);
        assert!((t.decode_base.as_secs_f64() - 0.016).abs() < 1e-6, "{t:?}");
        assert!(
            s.warnings.iter().any(|w| w.contains("never varied")),
            "{:?}",
            s.warnings
        );
    }
}
