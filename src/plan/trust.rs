//! Where a measured candidate's plan leaves what its profile knows: prompts longer or batches
//! larger than the fit saw, and a fit uncertainty large enough to change the answer. Each
//! finding is a sentence in the candidate's [`FitSummary::warnings`], printed with the plan.
//!
//! The uncertainty check re-evaluates the recommended count and the one below with every
//! fitted cost moved by [`SIGMAS`] standard errors (slower, then faster): if the slower engine
//! misses at the recommended count, or the faster one meets at one fewer, the verdict rests
//! on the fit's uncertainty and the plan says so instead of one confident number.

use std::time::Duration;

use super::fleet::Request;
use super::input::Slo;
use super::profile::FitSummary;
use super::search::{self, secs, Curve};
use crate::batching::Timing;
use crate::config::PolicyKind;

/// Standard errors the costs are moved by (a two-sided 95% band).
pub const SIGMAS: f64 = 2.0;

/// Extrapolation beyond the fitted ranges tolerated before it is reported.
const SLACK: f64 = 1.2;

/// What a plan needs to re-evaluate one candidate.
pub struct Check<'a> {
    pub reqs: &'a [Request],
    pub timing: &'a Timing,
    pub per_server: usize,
    pub slo: &'a Slo,
    pub policy: PolicyKind,
}

/// Add the findings on `curve` to `fit.warnings`.
pub fn assess(fit: &mut FitSummary, curve: &Curve, c: &Check<'_>) {
    if fit.prompt_range.1 > 0.0 {
        let prompts = c.reqs.iter().map(|r| f64::from(r.prompt_tokens)).collect();
        let p95 = search::pct(&search::sorted(prompts), 95.0);
        if p95 > fit.prompt_range.1 * SLACK {
            fit.warnings.push(format!(
                "the workload's prompts (p95 {p95:.0} tokens) are longer than the profile measured \
                 (mean per window up to {:.0}): prefill cost is extrapolated",
                fit.prompt_range.1
            ));
        }
    }
    let Some(n) = curve.smallest else {
        return;
    };
    if let Some(st) = curve.points.get(&n) {
        if fit.batch_range.1 > 0.0 && st.mean_batch > fit.batch_range.1 * SLACK {
            fit.warnings.push(format!(
                "at {n} servers the engines run batches of {:.1} on average, the profile saw at \
                 most {:.1}: decode cost is extrapolated",
                st.mean_batch, fit.batch_range.1
            ));
        }
    }
    if fit.params.iter().all(|p| p.stderr == 0.0) {
        return;
    }
    let slower = moved(c.timing, fit, SIGMAS);
    let st = search::evaluate(c.reqs, &slower, c.per_server, n, c.policy);
    if !st.violations(c.slo).is_empty() {
        fit.warnings.push(format!(
            "with the fit's uncertainty ({SIGMAS}σ slower) {n} servers miss the SLO ({}): \
             the recommendation rests on the fit",
            st.violations(c.slo).join(", ")
        ));
    }
    if n > 1 {
        let faster = moved(c.timing, fit, -SIGMAS);
        let st = search::evaluate(c.reqs, &faster, c.per_server, n - 1, c.policy);
        if st.violations(c.slo).is_empty() {
            fit.warnings.push(format!(
                "with the fit's uncertainty ({SIGMAS}σ faster) {} servers would meet the SLO \
                 (p99 TTFT {}): one server fewer may do",
                n - 1,
                secs(st.ttft_p99)
            ));
        }
    }
}

/// `t` with every fitted cost moved by `k` standard errors (never below zero).
fn moved(t: &Timing, fit: &FitSummary, k: f64) -> Timing {
    let shift = |d: Duration, name: &str| {
        let se = fit
            .params
            .iter()
            .find(|p| p.name == name)
            .map_or(0.0, |p| p.stderr);
        Duration::from_secs_f64((d.as_secs_f64() + k * se).max(0.0))
    };
    Timing {
        prefill_per_token: shift(t.prefill_per_token, "prefill_per_token"),
        decode_base: shift(t.decode_base, "decode_base"),
        decode_per_seq: shift(t.decode_per_seq, "decode_per_seq"),
        ..t.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::profile::FitParam;

    fn fit(stderr_share: f64) -> FitSummary {
        let t = Timing::default();
        let p = |name: &str, d: Duration| FitParam {
            name: name.into(),
            value: d.as_secs_f64(),
            stderr: d.as_secs_f64() * stderr_share,
        };
        FitSummary {
            backends: vec!["a".into()],
            source: "engine metrics".into(),
            params: vec![
                p("prefill_per_token", t.prefill_per_token),
                p("decode_base", t.decode_base),
                p("decode_per_seq", t.decode_per_seq),
            ],
            batch_range: (1.0, 2.0),
            prompt_range: (100.0, 200.0),
            samples: 50,
            time_ratio: 1.0,
            warnings: Vec::new(),
        }
    }

    fn reqs(n: u64, gap_ms: u64, prompt: u32) -> Vec<Request> {
        (0..n)
            .map(|i| Request {
                at_ns: i * gap_ms * 1_000_000,
                prompt_tokens: prompt,
                output_tokens: 50,
                prefix: None,
                max_tokens: None,
            })
            .collect()
    }

    fn run(fit: &mut FitSummary, reqs: &[Request], slo: Slo) -> Curve {
        let timing = Timing::default();
        let c = Check {
            reqs,
            timing: &timing,
            per_server: 1,
            slo: &slo,
            policy: PolicyKind::LeastRequest,
        };
        let curve = search::smallest(reqs, &timing, 1, 8, &slo, c.policy, &mut |_, _| {});
        assess(fit, &curve, &c);
        curve
    }

    const LOOSE: Slo = Slo {
        ttft_p99: 10.0,
        tpot_p99: 10.0,
        max_queue_wait: 60.0,
    };

    #[test]
    fn prompts_and_batches_beyond_the_fit_are_reported() {
        let mut f = fit(0.0);
        let curve = run(&mut f, &reqs(400, 20, 1_000), LOOSE);
        assert!(curve.smallest.is_some());
        assert!(
            f.warnings.iter().any(|w| w.contains("p95 1000 tokens")),
            "{:?}",
            f.warnings
        );
        assert!(
            f.warnings
                .iter()
                .any(|w| w.contains("decode cost is extrapolated")),
            "{:?}",
            f.warnings
        );
    }

    #[test]
    fn an_uncertainty_that_moves_the_verdict_is_reported_and_a_tight_one_is_not() {
        let r = reqs(400, 20, 150);
        // the SLO just above what the plan predicts at its recommended count
        let probe = search::smallest(
            &r,
            &Timing::default(),
            1,
            8,
            &LOOSE,
            PolicyKind::LeastRequest,
            &mut |_, _| {},
        );
        let n = probe.smallest.expect("meets");
        let ttft = probe.points[&n].ttft_p99_high;
        let slo = Slo {
            ttft_p99: ttft * 1.05,
            ..LOOSE
        };
        let mut tight = fit(0.001);
        run(&mut tight, &r, slo);
        assert!(
            !tight.warnings.iter().any(|w| w.contains("uncertainty")),
            "{:?}",
            tight.warnings
        );
        let mut wide = fit(0.3);
        run(&mut wide, &r, slo);
        assert!(
            wide.warnings.iter().any(|w| w.contains("σ slower")),
            "{:?}",
            wide.warnings
        );
    }
}
