//! The self-check on the recorded past: before it recommends anything from a recorded trace,
//! the plan replays the trace as recorded (unscaled) on the fleet it was recorded on — one
//! engine per backend the trace names, or `[workload] recorded_servers` — and compares the
//! p50 and p99 TTFT and TPOT it predicts with the ones the gateway measured. A candidate whose
//! source is a live profile is checked; without one, the first candidate is.
//!
//! Both sides are over the same requests: the TTFT percentiles over the requests whose TTFT
//! was measured (streams), the TPOT percentiles over those whose TPOT was (complete streams of
//! two tokens or more). A ratio (planned / measured) outside ±20% on any of the four figures
//! flags the check.
//!
//! Fleet sizes are evaluated by [`super::search::replay`], as the search evaluates them.

use serde::Serialize;

use super::fleet::Run;
use super::input::{PlanInput, ServerSource};
use super::search::{pct, replay, sorted};
use super::workload::Recorded;
use super::EngineInfo;
use crate::batching::Timing;

/// How far planned may be from measured (either way) before the check is flagged.
pub const TOLERANCE: f64 = 0.2;

/// The four figures compared, in seconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Figures {
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    pub tpot_p50: f64,
    pub tpot_p99: f64,
}

/// One figure's comparison.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Ratio {
    /// "p50 TTFT", "p99 TTFT", "p50 TPOT" or "p99 TPOT".
    pub figure: &'static str,
    pub planned: f64,
    pub measured: f64,
    /// Planned / measured.
    pub ratio: f64,
}

impl Ratio {
    /// Outside ±[`TOLERANCE`].
    pub fn flagged(&self) -> bool {
        !((1.0 - TOLERANCE)..=(1.0 + TOLERANCE)).contains(&self.ratio)
    }

    /// How far off, as a factor ≥ 1 either way.
    pub fn factor(&self) -> f64 {
        self.ratio.max(1.0 / self.ratio)
    }
}

/// One checked candidate: what the plan predicts for the recorded traffic on the recorded
/// fleet.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Checked {
    pub candidate: String,
    pub planned: Figures,
    /// The figures with a measured side, planned / measured.
    pub ratios: Vec<Ratio>,
}

impl Checked {
    /// The figure furthest off (the first of equals), if any was compared.
    pub fn worst(&self) -> Option<&Ratio> {
        self.ratios
            .iter()
            .reduce(|a, b| if b.factor() > a.factor() { b } else { a })
    }

    /// The figures outside ±20%.
    pub fn flagged(&self) -> Vec<&Ratio> {
        self.ratios.iter().filter(|r| r.flagged()).collect()
    }
}

/// Where the recorded fleet's size comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FleetFrom {
    /// The distinct backends the trace names.
    Trace,
    /// `[workload] recorded_servers`.
    PlanFile,
}

/// The self-check.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SelfCheck {
    /// Requests replayed (the whole recorded trace).
    pub requests: usize,
    /// Engines replayed on.
    pub servers: usize,
    pub servers_from: FleetFrom,
    /// Requests with a measured TTFT, and with a measured TPOT.
    pub ttft_compared: usize,
    pub tpot_compared: usize,
    pub measured: Figures,
    pub checked: Vec<Checked>,
}

impl SelfCheck {
    /// Whether any checked candidate is outside ±20% on any figure.
    pub fn flagged(&self) -> bool {
        self.checked.iter().any(|c| !c.flagged().is_empty())
    }
}

/// Why a recorded workload has no self-check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoSelfCheck {
    #[error(
        "the trace names no backends: set `[workload] recorded_servers` to the number of \
         engines it was recorded on"
    )]
    NoFleetSize,
    #[error("no candidate to check: {0}")]
    NoEngine(String),
}

/// The candidates to check: every measured one whose profile gave an engine, else the first.
fn chosen<'a>(
    input: &'a PlanInput,
    engines: &'a [&'a Result<EngineInfo, String>],
) -> Result<Vec<(&'a str, &'a Timing)>, NoSelfCheck> {
    let pairs = input.candidates.iter().zip(engines);
    let measured: Vec<_> = pairs
        .clone()
        .filter(|(c, _)| matches!(c.source, ServerSource::Measured { .. }))
        .filter_map(|(c, e)| e.as_ref().ok().map(|e| (c.name.as_str(), &e.timing)))
        .collect();
    if !measured.is_empty() {
        return Ok(measured);
    }
    match pairs.take(1).next() {
        Some((c, Ok(e))) => Ok(vec![(c.name.as_str(), &e.timing)]),
        Some((c, Err(why))) => Err(NoSelfCheck::NoEngine(format!("`{}` {why}", c.name))),
        None => Err(NoSelfCheck::NoEngine("the plan has no candidate".into())),
    }
}

/// The self-check of `recorded` for the plan `input` (`engines`: each candidate's engine, in
/// the plan's order).
pub fn check(
    input: &PlanInput,
    recorded: &Recorded,
    servers_override: Option<usize>,
    engines: &[&Result<EngineInfo, String>],
) -> Result<SelfCheck, NoSelfCheck> {
    let (servers, servers_from) = match (servers_override, recorded.backends()) {
        (Some(n), _) => (n, FleetFrom::PlanFile),
        (None, 0) => return Err(NoSelfCheck::NoFleetSize),
        (None, n) => (n, FleetFrom::Trace),
    };
    let candidates = chosen(input, engines)?;
    let ttft = |i: usize| recorded.measured[i].ttft;
    let tpot = |i: usize| recorded.measured[i].tpot;
    let measured = figures(recorded.measured.len(), ttft, tpot);
    let checked = candidates
        .into_iter()
        .map(|(name, timing)| {
            let run = replay(&recorded.requests, timing, 1, servers, input.policy);
            let planned = planned(&run, recorded);
            Checked {
                candidate: name.to_string(),
                ratios: ratios(&planned, &measured),
                planned,
            }
        })
        .collect();
    let count = |f: &dyn Fn(usize) -> Option<f64>| {
        (0..recorded.measured.len())
            .filter(|i| f(*i).is_some())
            .count()
    };
    Ok(SelfCheck {
        requests: recorded.requests.len(),
        servers,
        servers_from,
        ttft_compared: count(&ttft),
        tpot_compared: count(&tpot),
        measured,
        checked,
    })
}

/// The figures of `n` requests' TTFTs and TPOTs (seconds; `None`: not measured), 0 where none.
fn figures(
    n: usize,
    ttft: impl Fn(usize) -> Option<f64>,
    tpot: impl Fn(usize) -> Option<f64>,
) -> Figures {
    let ttft = sorted((0..n).filter_map(ttft).collect());
    let tpot = sorted((0..n).filter_map(tpot).collect());
    Figures {
        ttft_p50: pct(&ttft, 50.0),
        ttft_p99: pct(&ttft, 99.0),
        tpot_p50: pct(&tpot, 50.0),
        tpot_p99: pct(&tpot, 99.0),
    }
}

/// The planned figures over the requests the gateway measured.
fn planned(run: &Run, recorded: &Recorded) -> Figures {
    let s = |ns: u64| ns as f64 / 1e9;
    let at = |i: usize| recorded.measured.get(i).zip(run.outcomes.get(i));
    figures(
        recorded.measured.len(),
        |i| at(i).and_then(|(m, o)| m.ttft.map(|_| s(o.ttft_ns))),
        |i| at(i).and_then(|(m, o)| m.tpot.and(o.tpot_ns).map(s)),
    )
}

/// Planned / measured for each figure with a measured side above zero.
fn ratios(planned: &Figures, measured: &Figures) -> Vec<Ratio> {
    [
        ("p50 TTFT", planned.ttft_p50, measured.ttft_p50),
        ("p99 TTFT", planned.ttft_p99, measured.ttft_p99),
        ("p50 TPOT", planned.tpot_p50, measured.tpot_p50),
        ("p99 TPOT", planned.tpot_p99, measured.tpot_p99),
    ]
    .into_iter()
    .filter(|(_, _, m)| *m > 0.0)
    .map(|(figure, planned, measured)| Ratio {
        figure,
        planned,
        measured,
        ratio: planned / measured,
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::input::parse;
    use crate::plan::workload::read_recorded;
    use std::path::Path;

    /// A candidate whose engine answers an unqueued 100-token prompt in one 110 ms step (10 ms
    /// base + 100 × 1 ms prefill) and then gives a token every 10 ms.
    const PLAN: &str = r#"
[workload]
trace = "unused.jsonl"
[slo]
ttft_p99 = "1s"
tpot_p99 = "1s"
max_queue_wait = "10s"
[[candidate]]
name = "first"
price_per_hour = 1.0
[candidate.timing]
max_num_seqs = 8
kv_capacity_tokens = 100000
prefill_per_token = "1ms"
decode_base = "10ms"
decode_per_seq = "0ms"
"#;

    /// Four streamed requests 10 s apart (never overlapping) on backends `a` and `b`, with the
    /// given measured TTFTs and TPOTs (ms), and one whole answer (no TTFT, no TPOT).
    fn trace(ttft: [f64; 4], tpot: [f64; 4]) -> Recorded {
        let mut text = String::new();
        for i in 0..4 {
            text.push_str(&format!(
                r#"{{"ts":{},"model":"m","api":"chat","prompt_tokens":100,"completion_tokens":11,"backend":"{}","ttft_ms":{},"tpot_ms":{},"duration_ms":300}}"#,
                10 * i,
                ["a", "b"][i % 2],
                ttft[i],
                tpot[i]
            ));
            text.push('\n');
        }
        text.push_str(r#"{"ts":45,"model":"m","api":"chat","prompt_tokens":100,"completion_tokens":11,"backend":"a","duration_ms":300}"#);
        read_recorded(&text, None).expect("valid trace")
    }

    fn run(rec: &Recorded, over: Option<usize>) -> Result<SelfCheck, NoSelfCheck> {
        let input = parse(PLAN, Path::new(".")).expect("valid plan");
        let engines = input
            .candidates
            .iter()
            .map(|c| match &c.source {
                ServerSource::Timing(t) => Ok(EngineInfo {
                    timing: t.clone(),
                    per_server: 1,
                    tp: None,
                    weights_bytes: None,
                }),
                _ => Err("not a timing candidate".to_string()),
            })
            .collect::<Vec<_>>();
        check(&input, rec, over, &engines.iter().collect::<Vec<_>>())
    }

    fn ratio(c: &Checked, figure: &str) -> f64 {
        c.ratios
            .iter()
            .find(|r| r.figure == figure)
            .map_or(f64::NAN, |r| r.ratio)
    }

    #[test]
    fn planned_and_measured_percentiles_of_the_same_requests_are_compared() {
        let sc = run(&trace([100.0; 4], [10.0; 4]), None).expect("checked");
        assert_eq!((sc.requests, sc.servers), (5, 2));
        assert_eq!(sc.servers_from, FleetFrom::Trace);
        // the whole answer has nothing measured: left out of both sides
        assert_eq!((sc.ttft_compared, sc.tpot_compared), (4, 4));
        assert_eq!(sc.measured.ttft_p99, 0.1);
        let c = &sc.checked[0];
        assert_eq!(c.candidate, "first");
        assert!((c.planned.ttft_p50 - 0.110).abs() < 1e-6, "{:?}", c.planned);
        assert!((c.planned.tpot_p99 - 0.010).abs() < 1e-6, "{:?}", c.planned);
        assert!((ratio(c, "p99 TTFT") - 1.1).abs() < 1e-6);
        assert!((ratio(c, "p50 TPOT") - 1.0).abs() < 1e-6);
        assert!(!sc.flagged(), "within ±20%: {:?}", c.ratios);
        assert_eq!(c.worst().map(|w| w.figure), Some("p50 TTFT"));
    }

    #[test]
    fn a_figure_outside_twenty_percent_flags_the_check() {
        // measured p99 TTFT 200 ms (the largest of four) against 110 ms planned: ×0.55
        let sc = run(&trace([100.0, 100.0, 200.0, 100.0], [10.0; 4]), None).expect("checked");
        let c = &sc.checked[0];
        assert!((ratio(c, "p99 TTFT") - 0.55).abs() < 1e-6);
        let flagged: Vec<&str> = c.flagged().iter().map(|r| r.figure).collect();
        assert_eq!(flagged, ["p99 TTFT"]);
        assert!(sc.flagged());
        let worst = c.worst().expect("compared");
        assert!((worst.factor() - 1.0 / 0.55).abs() < 1e-6);
        // 8.4 ms measured against 10 ms planned is ×1.19: inside; 8.2 ms is ×1.22: outside
        let inside = run(&trace([110.0; 4], [8.4; 4]), None).expect("checked");
        assert!(!inside.flagged(), "{:?}", inside.checked[0].ratios);
        let outside = run(&trace([110.0; 4], [8.2; 4]), None).expect("checked");
        assert!(outside.flagged(), "{:?}", outside.checked[0].ratios);
    }

    #[test]
    fn the_fleet_size_comes_from_the_plan_file_when_the_trace_names_no_backend() {
        let mut rec = trace([100.0; 4], [10.0; 4]);
        for m in &mut rec.measured {
            m.backend = None;
        }
        assert_eq!(run(&rec, None), Err(NoSelfCheck::NoFleetSize));
        let sc = run(&rec, Some(3)).expect("checked");
        assert_eq!((sc.servers, sc.servers_from), (3, FleetFrom::PlanFile));
    }

    #[test]
    fn a_trace_without_measurements_compares_nothing() {
        let mut rec = trace([100.0; 4], [10.0; 4]);
        for m in &mut rec.measured {
            (m.ttft, m.tpot) = (None, None);
        }
        let sc = run(&rec, None).expect("checked");
        assert_eq!((sc.ttft_compared, sc.tpot_compared), (0, 0));
        assert!(sc.checked[0].ratios.is_empty());
        assert!(!sc.flagged());
    }
}
