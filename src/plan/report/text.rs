//! The plain-text answer for the terminal: the workload and SLO, the self-check, a table of
//! candidates, the cheapest and its N+1 answer, and the weights' load times; before the table,
//! each measured candidate's fitted engine and where the plan goes beyond it.

use std::fmt::Write;

use super::super::profile::FitSummary;
use super::super::roofline::load_times;
use super::super::search::{secs, Stats};
use super::super::selfcheck::{Checked, FleetFrom, SelfCheck};
use super::super::{CandidateReport, Report};
use super::{engine_label, off_by, one_down, p99_interval, pair};

/// The plain-text answer.
pub fn text(r: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}", super::workload_line(r));
    self_check(r, &mut out);
    for c in &r.candidates {
        if let Some(f) = &c.fit {
            fit(&c.name, f, &mut out);
        }
    }
    table(r, &mut out);
    cheapest(r, &mut out);
    for c in &r.candidates {
        if let Ok(Some(w)) = c.engine.as_ref().map(|e| e.weights_bytes) {
            let times: Vec<String> = load_times(w)
                .iter()
                .map(|(p, s)| format!("{p} {s:.1} s"))
                .collect();
            let _ = writeln!(
                out,
                "weights of {} ({:.1} GB) to a new node at line rate: {}",
                c.name,
                w / 1e9,
                times.join(", ")
            );
        }
    }
    out
}

/// A measured candidate's engine: each fitted cost with its standard error, what the fit saw,
/// and a `warning:` line for each place the plan goes beyond it.
fn fit(name: &str, f: &FitSummary, out: &mut String) {
    let params: Vec<String> = f
        .params
        .iter()
        .map(|p| {
            let (v, e, unit) = if p.name == "prefill_per_token" {
                (p.value * 1e6, p.stderr * 1e6, "µs")
            } else {
                (p.value * 1e3, p.stderr * 1e3, "ms")
            };
            format!("{} {v:.3} ± {e:.3} {unit}", p.name)
        })
        .collect();
    let _ = writeln!(
        out,
        "{name}: from the {} of {} ({} windows): {}; batches {:.1}–{:.1}, prompts {:.0}–{:.0} \
         tokens; engine time ×{:.2} the fitted",
        f.source,
        f.backends.join(", "),
        f.samples,
        params.join(", "),
        f.batch_range.0,
        f.batch_range.1,
        f.prompt_range.0,
        f.prompt_range.1,
        f.time_ratio
    );
    for w in &f.warnings {
        let _ = writeln!(out, "warning: {name}: {w}");
    }
}

const HEAD: [&str; 12] = [
    "candidate",
    "engine",
    "servers",
    "TTFT p50/p99",
    "TPOT p50/p99",
    "queue p99",
    "busy",
    "batch",
    "$/hour",
    "$/Mtok",
    "one server down",
    "N+1",
];

/// One candidate's row: its smallest fleet, or why there is none.
fn row(c: &CandidateReport, r: &Report) -> Vec<String> {
    let mut row = vec![c.name.clone(), engine_label(c)];
    match (&c.engine, c.curve.smallest) {
        (Err(why), _) => row.push(why.clone()),
        (Ok(_), None) => row.push(format!("SLO not met with {} servers", r.max_servers)),
        (Ok(_), Some(n)) => {
            let st: Stats = c.curve.points.get(&n).copied().unwrap_or_default();
            row.extend([
                n.to_string(),
                pair(st.ttft_p50, st.ttft_p99),
                pair(st.tpot_p50, st.tpot_p99),
                secs(st.queue_p99),
                format!("{:.0}%", st.busy * 100.0),
                format!("{:.1}", st.mean_batch),
                format!("{:.2}", c.cost_per_hour(n)),
                c.cost_per_million_tokens(n)
                    .map_or("-".into(), |v| format!("{v:.3}")),
                one_down(c, n, r),
                format!("{} (${:.2}/h)", n + 1, c.cost_per_hour(n + 1)),
            ]);
        }
    }
    row
}

/// The candidates' table, columns padded to their widest cell.
fn table(r: &Report, out: &mut String) {
    let mut rows = vec![HEAD.map(String::from).to_vec()];
    rows.extend(r.candidates.iter().map(|c| row(c, r)));
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in &rows {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(i, s)| format!("{s:<w$}", w = widths[i]))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
}

/// The cheapest fleet, its N+1 answer and how far to trust its p99.
fn cheapest(r: &Report, out: &mut String) {
    let Some(c) = r.cheapest.map(|i| &r.candidates[i]) else {
        let _ = writeln!(
            out,
            "no candidate meets the SLO within {} servers",
            r.max_servers
        );
        return;
    };
    let n = c.curve.smallest.unwrap_or(0);
    let _ = writeln!(
        out,
        "cheapest: {} x {n} at ${:.2}/hour; with no single point of failure (N+1): {} at ${:.2}/hour",
        c.name,
        c.cost_per_hour(n),
        n + 1,
        c.cost_per_hour(n + 1)
    );
    let _ = writeln!(out, "{}", p99_interval(c, n, r));
}

/// The self-check in words: what was replayed on what, then per checked candidate how far off
/// the plan is and its four figures; a warning line when any is outside ±20%.
fn self_check(r: &Report, out: &mut String) {
    if let Some(why) = &r.self_check_missing {
        let _ = writeln!(out, "self-check: none: {why}");
    }
    let Some(sc) = &r.self_check else {
        return;
    };
    let _ = writeln!(
        out,
        "self-check: the recorded traffic ({} requests) replayed on the recorded fleet ({} servers, {}); \
         compared with the TTFT measured on {} requests and the TPOT on {}",
        sc.requests,
        sc.servers,
        fleet_from(sc),
        sc.ttft_compared,
        sc.tpot_compared
    );
    for c in &sc.checked {
        let _ = writeln!(out, "  {}", checked_line(c));
    }
    for c in sc.checked.iter().filter(|c| !c.flagged().is_empty()) {
        let off: Vec<String> = c
            .flagged()
            .iter()
            .map(|f| format!("{} ×{:.2}", f.figure, f.ratio))
            .collect();
        let _ = writeln!(
            out,
            "warning: the self-check of {} is outside ±20% ({}): the plan does not reproduce \
             this fleet's past; trust its answer less",
            c.candidate,
            off.join(", ")
        );
    }
}

/// Where the self-check's fleet size comes from, in words.
fn fleet_from(sc: &SelfCheck) -> &'static str {
    match sc.servers_from {
        FleetFrom::Trace => "the backends the trace names",
        FleetFrom::PlanFile => "workload.recorded_servers",
    }
}

/// One checked candidate: "off by ×F (figure)" and every figure planned / measured.
fn checked_line(c: &Checked) -> String {
    let Some(off) = off_by(c) else {
        return format!(
            "{}: nothing to compare: no request in the trace has a measured TTFT or TPOT \
             (only streamed answers have them)",
            c.candidate
        );
    };
    let figures: Vec<String> = c
        .ratios
        .iter()
        .map(|f| {
            format!(
                "{} {} / {} (×{:.2})",
                f.figure,
                secs(f.planned),
                secs(f.measured),
                f.ratio
            )
        })
        .collect();
    format!(
        "{}: {off}\n    planned / measured: {}",
        c.candidate,
        figures.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{point, report, self_check};
    use super::super::json;
    use super::*;

    #[test]
    fn a_count_meeting_the_slo_only_at_its_estimate_is_reported_as_not_sure() {
        let out = text(&report());
        assert!(
            out.contains("p99 TTFT 897 ms (not sure: 95% interval 718 ms to 1542 ms)"),
            "{out}"
        );
        assert!(out.contains("cheapest: sim x 6 at $6.00/hour"), "{out}");
        assert!(
            out.contains(
                "p99 TTFT 315 ms: 95% interval 252 ms to 488 ms from 1063 requests; 5 servers \
                 meet the SLO at the estimate (897 ms) but not across its interval (to 1542 ms)"
            ),
            "{out}"
        );
    }

    #[test]
    fn a_count_missing_across_its_whole_interval_is_a_plain_miss() {
        let mut r = report();
        let c = &mut r.candidates[0].curve;
        c.points.insert(5, point(1.3, 1.6));
        let out = text(&r);
        assert!(out.contains("p99 TTFT 1300 ms (misses)"), "{out}");
        assert!(out.contains("from 1063 requests\n"), "{out}");
    }

    #[test]
    fn a_count_missing_at_its_estimate_but_not_across_its_interval_is_not_sure() {
        let mut r = report();
        let c = &mut r.candidates[0].curve;
        c.points.insert(5, point(1.1, 1.6));
        let out = text(&r);
        assert!(
            out.contains("p99 TTFT 1100 ms (not sure: 95% interval 880 ms to 1600 ms)"),
            "{out}"
        );
        // it does not meet the SLO at the estimate either: nothing to add to the interval
        assert!(out.contains("from 1063 requests\n"), "{out}");
    }

    /// A fleet whose p99 TTFT is well inside the SLO but whose decode is too slow: the cell
    /// shows the TTFT, so the verdict says what it misses.
    #[test]
    fn a_miss_on_another_objective_names_it() {
        let mut r = report();
        r.candidates[0].curve.points.insert(
            5,
            Stats {
                tpot_p99: 1.25,
                queue_max: 61.0,
                ..point(0.4, 0.5)
            },
        );
        let out = text(&r);
        assert!(
            out.contains("p99 TTFT 400 ms (misses: p99 TPOT 1250 ms, queue wait 61.0 s)"),
            "{out}"
        );
        // TTFT in its noise band and TPOT missing is a miss, not "not sure"
        r.candidates[0].curve.points.insert(
            5,
            Stats {
                tpot_p99: 1.25,
                ..point(0.9, 1.5)
            },
        );
        let out = text(&r);
        assert!(
            out.contains("p99 TTFT 900 ms (misses: p99 TPOT 1250 ms)"),
            "{out}"
        );
    }

    #[test]
    fn the_self_check_comes_before_the_recommendations_and_warns_outside_twenty_percent() {
        let mut r = report();
        r.self_check = Some(self_check(0.467));
        let out = text(&r);
        let at = |s: &str| out.find(s).unwrap_or_else(|| panic!("no `{s}` in\n{out}"));
        assert!(at("self-check: the recorded traffic (1063 requests)") < at("candidate  "));
        assert!(
            out.contains(
                "sim: on your own past traffic the plan is off by ×1.07 at most (p99 TTFT, \
                 planned high)"
            ),
            "{out}"
        );
        assert!(out.contains("p99 TTFT 500 ms / 467 ms (×1.07)"), "{out}");
        assert!(!out.contains("warning:"), "{out}");
        assert!(json(&r).contains("\"self_check_flagged\": false"));
        r.self_check = Some(self_check(0.4));
        let out = text(&r);
        assert!(
            out.contains("warning: the self-check of sim is outside ±20% (p99 TTFT ×1.25)"),
            "{out}"
        );
        assert!(json(&r).contains("\"self_check_flagged\": true"));
    }

    #[test]
    fn a_recorded_workload_without_a_fleet_size_says_why_it_has_no_self_check() {
        let mut r = report();
        r.self_check_missing = Some(crate::plan::selfcheck::NoSelfCheck::NoFleetSize.to_string());
        assert!(text(&r).contains("self-check: none: the trace names no backends"));
    }
}
