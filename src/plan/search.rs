//! The search: for one candidate, the smallest server count whose predicted percentiles meet
//! the SLO (the p99 TTFT across its 95% interval: [`Stats::violations`]), assuming more servers
//! never make them worse. Counts are tried 1, 2, 4, … until one
//! meets the SLO, then bisected between the last failing and the first passing count, so the
//! answer costs O(log max) runs and the count below it is always among the points evaluated
//! (it is the N+1 check: N servers with one down are N − 1 servers).

use std::collections::BTreeMap;

use super::fleet::{simulate, Request, Run};
use super::input::Slo;
use crate::batching::Timing;
use crate::config::PolicyKind;

/// Predicted figures of one fleet size, in seconds where a time.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Stats {
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    /// A distribution-free 95% confidence interval of the p99 TTFT from the number of requests
    /// (order statistics): how far another trace of the same traffic and length could put it.
    /// Requests in a burst are not independent, so the true spread is if anything wider.
    pub ttft_p99_low: f64,
    pub ttft_p99_high: f64,
    pub tpot_p50: f64,
    pub tpot_p99: f64,
    pub queue_p99: f64,
    pub queue_max: f64,
    /// Share of the time the engines were stepping.
    pub busy: f64,
    /// Mean running batch while stepping.
    pub mean_batch: f64,
    /// Prompt plus completion tokens served per hour.
    pub tokens_per_hour: f64,
    /// Share of prompt tokens served from a prefix cache.
    pub cached_share: f64,
}

/// Nearest-rank percentile of sorted values.
pub(super) fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The nearest ranks bounding a 95% confidence interval of the `p`th percentile of `n`
/// independent samples (normal approximation of the binomial count below it), 1-based.
fn interval_ranks(n: usize, p: f64) -> (usize, usize) {
    let (n, q) = (n as f64, p / 100.0);
    let half = 1.96 * (n * q * (1.0 - q)).sqrt();
    let lo = (n * q - half).floor().max(1.0) as usize;
    let hi = (n * q + half).ceil().max(1.0) as usize;
    (lo, hi)
}

fn at_rank(sorted: &[f64], rank: usize) -> f64 {
    match sorted.len() {
        0 => 0.0,
        n => sorted[rank.clamp(1, n) - 1],
    }
}

/// `v` in ascending order.
pub(super) fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

impl Stats {
    pub fn of(reqs: &[Request], run: &Run) -> Stats {
        let s = |ns: u64| ns as f64 / 1e9;
        let ttft = sorted(run.outcomes.iter().map(|o| s(o.ttft_ns)).collect());
        let tpot = sorted(
            run.outcomes
                .iter()
                .filter_map(|o| o.tpot_ns.map(s))
                .collect(),
        );
        let queue = sorted(run.outcomes.iter().map(|o| s(o.queue_ns)).collect());
        let span = s(run.span_ns);
        let engines = run.busy_ns.len().max(1) as f64;
        let busy: u64 = run.busy_ns.iter().sum();
        let tokens: u64 = reqs
            .iter()
            .map(|r| u64::from(r.prompt_tokens) + u64::from(r.output_tokens))
            .sum();
        let prompt: u64 = reqs.iter().map(|r| u64::from(r.prompt_tokens)).sum();
        let cached: u64 = run
            .outcomes
            .iter()
            .map(|o| u64::from(o.cached_tokens))
            .sum();
        let (lo, hi) = interval_ranks(ttft.len(), 99.0);
        Stats {
            ttft_p50: pct(&ttft, 50.0),
            ttft_p99: pct(&ttft, 99.0),
            ttft_p99_low: at_rank(&ttft, lo),
            ttft_p99_high: at_rank(&ttft, hi),
            tpot_p50: pct(&tpot, 50.0),
            tpot_p99: pct(&tpot, 99.0),
            queue_p99: pct(&queue, 99.0),
            queue_max: queue.last().copied().unwrap_or(0.0),
            busy: s(busy) / (span * engines),
            mean_batch: run.batch_ns.iter().sum::<f64>() / (busy.max(1) as f64),
            tokens_per_hour: tokens as f64 / span * 3600.0,
            cached_share: cached as f64 / prompt.max(1) as f64,
        }
    }

    /// What the SLO is missing, empty when it is met. The p99 TTFT bound is met only when the
    /// upper end of its 95% interval is: a count whose estimate meets the bound while its
    /// interval reaches past it may miss on another trace of the same traffic (or on the
    /// traffic itself, replayed with other timing), and a recommended fleet has to hold.
    pub fn violations(&self, slo: &Slo) -> Vec<String> {
        let mut v = Vec::new();
        if self.ttft_p99 > slo.ttft_p99 {
            v.push(format!("p99 TTFT {}", secs(self.ttft_p99)));
        } else if self.ttft_p99_high > slo.ttft_p99 {
            v.push(format!(
                "p99 TTFT {}, 95% interval to {}",
                secs(self.ttft_p99),
                secs(self.ttft_p99_high)
            ));
        }
        if self.tpot_p99 > slo.tpot_p99 {
            v.push(format!("p99 TPOT {}", secs(self.tpot_p99)));
        }
        if self.queue_max > slo.max_queue_wait {
            v.push(format!("queue wait {}", secs(self.queue_max)));
        }
        v
    }
}

/// A time for people: ms below 10 s.
pub fn secs(s: f64) -> String {
    if s < 10.0 {
        format!("{:.0} ms", s * 1000.0)
    } else {
        format!("{s:.1} s")
    }
}

/// Everything evaluated for one candidate.
#[derive(Debug, Clone, Default)]
pub struct Curve {
    /// Server count → its stats.
    pub points: BTreeMap<usize, Stats>,
    /// The smallest count meeting the SLO (`None`: not even the maximum).
    pub smallest: Option<usize>,
}

/// One fleet-size run: `servers` servers of `per_server` engines each, every request's
/// outcome.
pub fn replay(
    reqs: &[Request],
    timing: &Timing,
    per_server: usize,
    servers: usize,
    policy: PolicyKind,
) -> Run {
    simulate(reqs, servers * per_server.max(1), timing, policy)
}

/// One fleet-size evaluation: `servers` servers of `per_server` engines each.
pub fn evaluate(
    reqs: &[Request],
    timing: &Timing,
    per_server: usize,
    servers: usize,
    policy: PolicyKind,
) -> Stats {
    let run = replay(reqs, timing, per_server, servers, policy);
    Stats::of(reqs, &run)
}

/// The smallest count in `1..=max` meeting `slo`; `progress` hears each evaluated count.
pub fn smallest(
    reqs: &[Request],
    timing: &Timing,
    per_server: usize,
    max: usize,
    slo: &Slo,
    policy: PolicyKind,
    progress: &mut dyn FnMut(usize, &Stats),
) -> Curve {
    let mut curve = Curve::default();
    let mut eval = |n: usize, curve: &mut Curve| -> bool {
        let st = evaluate(reqs, timing, per_server, n, policy);
        progress(n, &st);
        curve.points.insert(n, st);
        st.violations(slo).is_empty()
    };
    let mut lo = 0; // the largest count known to fail
    let mut hi = None; // the smallest count known to pass
    let mut n = 1;
    while n <= max {
        if eval(n, &mut curve) {
            hi = Some(n);
            break;
        }
        lo = n;
        if n == max {
            break;
        }
        n = (n * 2).min(max);
    }
    if let Some(mut h) = hi {
        while h - lo > 1 {
            let mid = lo + (h - lo) / 2;
            if eval(mid, &mut curve) {
                h = mid;
            } else {
                lo = mid;
            }
        }
        curve.smallest = Some(h);
    }
    curve
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(pct(&v, 50.0), 50.0);
        assert_eq!(pct(&v, 99.0), 99.0);
        assert_eq!(pct(&[3.0], 99.0), 3.0);
    }

    #[test]
    fn the_p99_interval_narrows_with_more_requests() {
        // 296 requests: the p99 is the 3rd largest, and could be anywhere from the 8th to the
        // largest; 10,000: ranks 9,880..9,920 around 9,900
        assert_eq!(interval_ranks(296, 99.0), (289, 297));
        assert_eq!(interval_ranks(10_000, 99.0), (9880, 9920));
        let v: Vec<f64> = (1..=296).map(f64::from).collect();
        assert_eq!((at_rank(&v, 289), at_rank(&v, 297)), (289.0, 296.0));
        assert_eq!(at_rank(&[], 3), 0.0);
    }

    #[test]
    fn a_p99_meets_the_slo_only_across_its_interval() {
        let slo = Slo {
            ttft_p99: 1.0,
            tpot_p99: 1.0,
            max_queue_wait: 10.0,
        };
        let st = |p99: f64, high: f64| Stats {
            ttft_p99: p99,
            ttft_p99_low: p99 * 0.8,
            ttft_p99_high: high,
            ..Stats::default()
        };
        assert!(st(0.9, 0.95).violations(&slo).is_empty());
        assert_eq!(
            st(0.897, 1.542).violations(&slo),
            ["p99 TTFT 897 ms, 95% interval to 1542 ms"]
        );
        assert_eq!(st(1.1, 1.6).violations(&slo), ["p99 TTFT 1100 ms"]);
    }

    #[test]
    fn the_search_finds_the_count_below_which_the_slo_fails() {
        let timing = Timing {
            max_num_seqs: 4,
            kv_capacity_tokens: 100_000,
            prefill_per_token: Duration::from_micros(50),
            decode_base: Duration::from_millis(10),
            decode_per_seq: Duration::from_millis(1),
            ..Timing::default()
        };
        // 20 req/s of 20-token answers: one engine of 4 slots serves ~16/s
        let reqs: Vec<Request> = (0..2000)
            .map(|i| Request {
                at_ns: i * 50_000_000,
                prompt_tokens: 200,
                output_tokens: 20,
                prefix: None,
                max_tokens: None,
            })
            .collect();
        let slo = Slo {
            ttft_p99: 0.1,
            tpot_p99: 0.05,
            max_queue_wait: 1.0,
        };
        let mut seen = Vec::new();
        let c = smallest(
            &reqs,
            &timing,
            1,
            64,
            &slo,
            PolicyKind::LeastRequest,
            &mut |n, _| seen.push(n),
        );
        let n = c.smallest.expect("met within 64");
        assert!(c.points[&n].violations(&slo).is_empty());
        assert!(
            !c.points[&(n - 1)].violations(&slo).is_empty(),
            "{:?}",
            c.points
        );
        // every count tried, exhaustively, agrees that n is the first to pass
        for k in 1..n {
            let st = evaluate(&reqs, &timing, 1, k, PolicyKind::LeastRequest);
            assert!(!st.violations(&slo).is_empty(), "{k} servers pass");
        }
        assert!(seen.len() < 10, "{seen:?}");
    }
}
