//! The answer as people read it: a plain-text table for the terminal and a self-contained HTML
//! report (inline SVG charts, no scripts, no external resources) viewable offline.

use std::fmt::Write;

use super::roofline::load_times;
use super::search::{secs, Stats};
use super::selfcheck::{Checked, SelfCheck};
use super::{CandidateReport, Report};

fn engine_label(c: &CandidateReport) -> String {
    match &c.engine {
        Ok(e) => match e.tp {
            Some(tp) => format!("TP{tp} x{}/server", e.per_server),
            None => format!("{} slots", e.timing.max_num_seqs),
        },
        Err(_) => "does not fit".into(),
    }
}

fn pair(a: f64, b: f64) -> String {
    format!("{}/{}", secs(a), secs(b))
}

/// The verdict on `st` in words: "meets", "misses", or "not sure" when the p99 TTFT is all
/// that could miss and the SLO lies inside its 95% interval (the search counts that as
/// missing). A miss names the objectives other than TTFT that it misses, because the cell it
/// goes in shows the p99 TTFT alone.
fn verdict(st: &Stats, r: &Report) -> String {
    let without_ttft = Stats {
        ttft_p99: 0.0,
        ttft_p99_high: 0.0,
        ..*st
    };
    let others = without_ttft.violations(&r.slo);
    let inside = (st.ttft_p99_low..=st.ttft_p99_high).contains(&r.slo.ttft_p99);
    if st.violations(&r.slo).is_empty() {
        "meets".into()
    } else if inside && others.is_empty() {
        format!(
            "not sure: 95% interval {} to {}",
            secs(st.ttft_p99_low),
            secs(st.ttft_p99_high)
        )
    } else if others.is_empty() {
        "misses".into()
    } else {
        format!("misses: {}", others.join(", "))
    }
}

/// `st` meets the SLO at its p99 TTFT estimate, not across the estimate's interval.
fn meets_at_estimate_only(st: &Stats, r: &Report) -> bool {
    let relaxed = Stats {
        ttft_p99_high: st.ttft_p99,
        ..*st
    };
    !st.violations(&r.slo).is_empty() && relaxed.violations(&r.slo).is_empty()
}

/// The verdict on `n` servers with one down (= `n − 1` servers).
fn one_down(c: &CandidateReport, n: usize, r: &Report) -> String {
    if n <= 1 {
        return "no server left".into();
    }
    match c.curve.points.get(&(n - 1)) {
        Some(st) => format!("p99 TTFT {} ({})", secs(st.ttft_p99), verdict(st, r)),
        None => "-".into(),
    }
}

/// How far to trust the cheapest fleet (`n` servers of `c`): its p99 TTFT's 95% interval from
/// the trace's length, and whether one server fewer meets the SLO at its estimate only.
fn p99_interval(c: &CandidateReport, n: usize, r: &Report) -> String {
    let st = c.curve.points.get(&n).copied().unwrap_or_default();
    let mut line = format!(
        "p99 TTFT {}: 95% interval {} to {} from {} requests",
        secs(st.ttft_p99),
        secs(st.ttft_p99_low),
        secs(st.ttft_p99_high),
        r.requests
    );
    let below = n.checked_sub(1).and_then(|m| c.curve.points.get(&m));
    if let Some(below) = below.filter(|b| meets_at_estimate_only(b, r)) {
        let _ = write!(
            line,
            "; {} servers meet the SLO at the estimate ({}) but not across its interval \
             (to {}): a longer trace would show whether they are enough",
            n - 1,
            secs(below.ttft_p99),
            secs(below.ttft_p99_high)
        );
    }
    line
}

/// The answer as JSON: the workload's size, the SLO, and per candidate the smallest count
/// meeting it (`null`: none within the limit), its cost per server-hour, its engine or why it
/// does not fit, and the figures of every fleet size evaluated (keyed by server count).
pub fn json(r: &Report) -> String {
    let candidates: Vec<serde_json::Value> = r
        .candidates
        .iter()
        .map(|c| {
            let engine = match &c.engine {
                Ok(e) => serde_json::json!({
                    "per_server": e.per_server,
                    "tp": e.tp,
                    "max_num_seqs": e.timing.max_num_seqs,
                    "kv_capacity_tokens": e.timing.kv_capacity_tokens,
                    "prefill_per_token_s": e.timing.prefill_per_token.as_secs_f64(),
                    "decode_base_s": e.timing.decode_base.as_secs_f64(),
                    "decode_per_seq_s": e.timing.decode_per_seq.as_secs_f64(),
                }),
                Err(why) => serde_json::json!({ "does_not_fit": why }),
            };
            serde_json::json!({
                "name": c.name,
                "engine": engine,
                "smallest": c.curve.smallest,
                "server_cost_per_hour": c.server_cost_per_hour,
                "points": c.curve.points,
            })
        })
        .collect();
    let doc = serde_json::json!({
        "requests": r.requests,
        "duration_s": r.duration_s,
        "slo": {
            "ttft_p99_s": r.slo.ttft_p99,
            "tpot_p99_s": r.slo.tpot_p99,
            "max_queue_wait_s": r.slo.max_queue_wait,
        },
        "cheapest": r.cheapest.map(|i| r.candidates[i].name.clone()),
        "candidates": candidates,
        "self_check": r.self_check,
        "self_check_flagged": r.self_check.as_ref().is_some_and(SelfCheck::flagged),
        "self_check_missing": r.self_check_missing,
    });
    let mut text = serde_json::to_string_pretty(&doc).unwrap_or_default();
    text.push('\n');
    text
}

/// The plain-text answer.
pub fn text(r: &Report) -> String {
    let mut out = String::new();
    let rate = r.requests as f64 / r.duration_s.max(1e-9);
    let _ = writeln!(
        out,
        "workload: {} requests over {:.0} s ({rate:.1} req/s); SLO: p99 TTFT <= {}, p99 TPOT <= {}, queue wait <= {}",
        r.requests,
        r.duration_s,
        secs(r.slo.ttft_p99),
        secs(r.slo.tpot_p99),
        secs(r.slo.max_queue_wait)
    );
    self_check(r, &mut out);
    let head = [
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
    let mut rows = vec![head.map(String::from).to_vec()];
    for c in &r.candidates {
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
        rows.push(row);
    }
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
    match r.cheapest {
        Some(i) => {
            let c = &r.candidates[i];
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
        None => {
            let _ = writeln!(
                out,
                "no candidate meets the SLO within {} servers",
                r.max_servers
            );
        }
    }
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
        super::selfcheck::FleetFrom::Trace => "the backends the trace names",
        super::selfcheck::FleetFrom::PlanFile => "workload.recorded_servers",
    }
}

/// One checked candidate: "off by ×F (figure)" and every figure planned / measured.
fn checked_line(c: &Checked) -> String {
    let Some(worst) = c.worst() else {
        return format!(
            "{}: nothing to compare: no request in the trace has a measured TTFT or TPOT \
             (only streamed answers have them)",
            c.candidate
        );
    };
    let way = if worst.ratio >= 1.0 { "high" } else { "low" };
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
        "{}: on your own past traffic the plan is off by ×{:.2} at most ({}, planned {way})\n    \
         planned / measured: {}",
        c.candidate,
        worst.factor(),
        worst.figure,
        figures.join(", ")
    )
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

const COLOURS: [&str; 6] = [
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf",
];

/// A line chart: one series per candidate of (x, y) points; `hline`: a dashed reference.
fn chart(
    title: &str,
    xlabel: &str,
    ylabel: &str,
    series: &[(String, Vec<(f64, f64)>)],
    hline: Option<f64>,
    log_y: bool,
) -> String {
    let (w, h, l, b) = (640.0, 320.0, 70.0, 40.0);
    let pts = series.iter().flat_map(|s| s.1.iter());
    let fy = |y: f64| if log_y { y.max(1e-4).log10() } else { y };
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for (x, y) in pts.clone().copied().chain(hline.map(|v| (f64::NAN, v))) {
        if x.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
        }
        y0 = y0.min(fy(y));
        y1 = y1.max(fy(y));
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if !log_y {
        y0 = y0.min(0.0);
    }
    let (x1, y1) = (x1.max(x0 + 1e-9), y1.max(y0 + 1e-9));
    let px = |x: f64| l + (x - x0) / (x1 - x0) * (w - l - 20.0);
    let py = |y: f64| h - b - (fy(y) - y0) / (y1 - y0) * (h - b - 20.0);
    let mut s = format!(
        "<figure><figcaption>{}</figcaption><svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\">",
        esc(title)
    );
    let _ = write!(
        s,
        "<line x1=\"{l}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"#333\"/><line x1=\"{l}\" y1=\"20\" x2=\"{l}\" y2=\"{}\" stroke=\"#333\"/>",
        h - b, w - 20.0, h - b, h - b
    );
    let _ = write!(
        s,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
        w / 2.0,
        h - 8.0,
        esc(xlabel)
    );
    let _ = write!(
        s,
        "<text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">{}</text>",
        h / 2.0,
        h / 2.0,
        esc(ylabel)
    );
    for (tx, label) in [(x0, x0), (x1, x1)] {
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"11\">{label:.0}</text>",
            px(tx),
            h - b + 14.0
        );
    }
    for ty in [y0, y1] {
        let v = if log_y { 10f64.powf(ty) } else { ty };
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\" font-size=\"11\">{}</text>",
            l - 4.0,
            py(v) + 4.0,
            esc(&fmt_num(v))
        );
    }
    if let Some(v) = hline {
        let _ = write!(s, "<line class=\"slo\" x1=\"{l}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#888\" stroke-dasharray=\"6 4\"/>", w - 20.0, y = py(v));
    }
    for (i, (name, points)) in series.iter().enumerate() {
        let c = COLOURS[i % COLOURS.len()];
        let path: Vec<String> = points
            .iter()
            .map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
            .collect();
        let _ = write!(s, "<polyline class=\"series\" data-name=\"{}\" fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>", esc(name), path.join(" "));
        for (x, y) in points {
            let _ = write!(s, "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{c}\"><title>{}: {} at {}</title></circle>", px(*x), py(*y), esc(name), fmt_num(*y), fmt_num(*x));
        }
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\" font-size=\"12\">{}</text>",
            w - 150.0,
            34.0 + 16.0 * i as f64,
            esc(name)
        );
    }
    s.push_str("</svg></figure>");
    s
}

fn fmt_num(v: f64) -> String {
    if v.abs() >= 100.0 || v == 0.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// The self-contained HTML report: the table, p99 TTFT against server count per candidate,
/// and cost against the TTFT objective.
pub fn html(r: &Report) -> String {
    let ttft: Vec<(String, Vec<(f64, f64)>)> = r
        .candidates
        .iter()
        .filter(|c| !c.curve.points.is_empty())
        .map(|c| {
            let pts = c
                .curve
                .points
                .iter()
                .map(|(n, st)| (*n as f64, st.ttft_p99))
                .collect();
            (c.name.clone(), pts)
        })
        .collect();
    // for each evaluated fleet meeting the other objectives: the TTFT objective it would meet
    // and what it costs; the cheapest fleet for an objective T is the lowest point left of T
    let cost: Vec<(String, Vec<(f64, f64)>)> = r
        .candidates
        .iter()
        .map(|c| {
            let mut pts: Vec<(f64, f64)> = c
                .curve
                .points
                .iter()
                .filter(|(_, st)| {
                    st.tpot_p99 <= r.slo.tpot_p99 && st.queue_max <= r.slo.max_queue_wait
                })
                .map(|(n, st)| (st.ttft_p99, c.cost_per_hour(*n)))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            (c.name.clone(), pts)
        })
        .filter(|s| !s.1.is_empty())
        .collect();
    let mut s = String::from("<!doctype html><html><head><meta charset=\"utf-8\"><title>sluice plan</title><style>body{font:14px system-ui,sans-serif;margin:2em;max-width:1100px}pre{background:#f6f6f6;padding:1em;overflow:auto}figure{margin:1em 0}figcaption{font-weight:600}</style></head><body><h1>Capacity plan</h1>");
    let _ = write!(s, "<pre id=\"table\">{}</pre>", esc(&text(r)));
    s.push_str(&chart(
        "p99 time to first token against server count",
        "servers",
        "p99 TTFT (s, log)",
        &ttft,
        Some(r.slo.ttft_p99),
        true,
    ));
    s.push_str(&chart(
        "cost against the TTFT objective (fleets meeting the TPOT and queue objectives)",
        "p99 TTFT objective (s)",
        "$/hour",
        &cost,
        None,
        false,
    ));
    s.push_str("<p>Predictions of a discrete-event simulation of the engines' continuous batching, routed by the gateway's own policies; see the capacity-planning guide for the method and how far to trust it.</p></body></html>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batching::Timing;
    use crate::plan::input::Slo;
    use crate::plan::search::Curve;
    use crate::plan::EngineInfo;

    fn point(p99: f64, high: f64) -> Stats {
        Stats {
            ttft_p50: p99 / 10.0,
            ttft_p99: p99,
            ttft_p99_low: p99 * 0.8,
            ttft_p99_high: high,
            ..Stats::default()
        }
    }

    /// Five servers meet a 1 s p99 TTFT at the estimate (897 ms) but their interval reaches
    /// 1.54 s; six meet it across theirs.
    fn report() -> Report {
        let mut curve = Curve::default();
        curve.points.insert(4, point(1.3, 2.1));
        curve.points.insert(5, point(0.897, 1.542));
        curve.points.insert(6, point(0.315, 0.488));
        curve.smallest = Some(6);
        Report {
            requests: 1063,
            duration_s: 300.0,
            slo: Slo {
                ttft_p99: 1.0,
                tpot_p99: 1.0,
                max_queue_wait: 60.0,
            },
            max_servers: 12,
            candidates: vec![CandidateReport {
                fit: None,
                name: "sim".into(),
                engine: Ok(EngineInfo {
                    timing: Timing::default(),
                    per_server: 1,
                    tp: None,
                    weights_bytes: None,
                }),
                curve,
                server_cost_per_hour: 1.0,
                power_watts: 0.0,
            }],
            cheapest: Some(0),
            self_check: None,
            self_check_missing: None,
        }
    }

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

    fn self_check(p99_ttft_measured: f64) -> crate::plan::selfcheck::SelfCheck {
        use crate::plan::selfcheck::{Checked, Figures, FleetFrom, Ratio, SelfCheck};
        let planned = Figures {
            ttft_p50: 0.1,
            ttft_p99: 0.5,
            tpot_p50: 0.02,
            tpot_p99: 0.03,
        };
        let measured = Figures {
            ttft_p99: p99_ttft_measured,
            ..planned
        };
        let ratios = [
            ("p50 TTFT", 0.1, 0.1),
            ("p99 TTFT", 0.5, p99_ttft_measured),
            ("p50 TPOT", 0.02, 0.02),
            ("p99 TPOT", 0.03, 0.03),
        ]
        .map(|(figure, planned, measured)| Ratio {
            figure,
            planned,
            measured,
            ratio: planned / measured,
        })
        .to_vec();
        SelfCheck {
            requests: 1063,
            servers: 3,
            servers_from: FleetFrom::Trace,
            ttft_compared: 1000,
            tpot_compared: 990,
            measured,
            checked: vec![Checked {
                candidate: "sim".into(),
                planned,
                ratios,
            }],
        }
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
