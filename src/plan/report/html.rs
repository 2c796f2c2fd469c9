//! The HTML report: one self-contained page (inline CSS and SVG; no scripts, no external
//! resources) in reading order — the workload and SLO, the self-check on the recorded past,
//! the answer (cheapest fleet and its N+1), a table of candidates with the recommended one
//! highlighted, the charts, then per candidate its engine, its profile's uncertainty (measured
//! candidates) and a table of every fleet size evaluated.

use std::fmt::Write;

use super::super::profile::FitSummary;
use super::super::roofline::load_times;
use super::super::search::{secs, Stats};
use super::super::selfcheck::{FleetFrom, SelfCheck};
use super::super::{CandidateReport, Report};
use super::charts::{self, Figure};
use super::{engine_label, off_by, one_down, p99_interval, verdict, workload_line};

const STYLE: &str = "\
body{font:15px/1.45 system-ui,sans-serif;color:#1d1d1f;margin:0 auto;max-width:1120px;padding:1.5em 2em}\
h1{font-size:1.7em;margin:.2em 0}h2{margin-top:1.6em;border-bottom:1px solid #ddd;padding-bottom:.2em}\
table{border-collapse:collapse;width:100%;margin:.6em 0;font-size:13.5px}\
th,td{padding:5px 8px;border-bottom:1px solid #e4e4e4;text-align:right;vertical-align:top}\
th{background:#f4f5f7;font-weight:600}th:first-child,td:first-child{text-align:left}\
th.t,td.t{text-align:left}.fit table{width:auto;min-width:60%}\
tr.smallest td{background:#eef3fb}tr.smallest td:first-child{box-shadow:inset 4px 0 #5b8def}\
tr.recommended td{background:#e6f4ea;font-weight:600}tr.recommended td:first-child{box-shadow:inset 4px 0 #1e8e3e}\
.badge{display:inline-block;background:#1e8e3e;color:#fff;border-radius:3px;padding:0 5px;margin-left:6px;font-size:11px;font-weight:600}\
.flag{color:#b3261e;font-weight:700}.ok{color:#1e8e3e}\
.warning{background:#fff4e5;border-left:4px solid #e8a317;padding:.6em .9em}\
.answer{font-size:1.1em;background:#f4f5f7;padding:.7em 1em;border-radius:4px}\
figure{margin:1.2em 0}figcaption{font-weight:600;margin-bottom:.3em}\
svg{width:100%;height:auto;display:block}\
.legend{margin:.2em 0 0 4.5em;font-size:14px}.legend span{margin-right:1.4em;white-space:nowrap}\
.legend i{display:inline-block;width:22px;height:4px;margin:0 6px 3px 0;vertical-align:middle}\
.legend i.slo{background:repeating-linear-gradient(90deg,#c81e1e 0 8px,transparent 8px 13px)}\
td{white-space:nowrap}td.t{white-space:normal}\
.sub{color:#555;font-size:.92em}small{color:#555}";

/// The self-contained HTML report.
pub fn html(r: &Report) -> String {
    let mut s = String::with_capacity(128 * 1024);
    let _ = write!(
        s,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">\
         <title>Capacity plan</title><style>{STYLE}</style></head><body>\
         <h1>Capacity plan</h1><p class=\"sub\">{}</p>",
        esc(&workload_line(r)).replace("&lt;=", "≤")
    );
    self_check(r, &mut s);
    answer(r, &mut s);
    summary(r, &mut s);
    figures(r, &mut s);
    s.push_str("<h2>Candidates in detail</h2>");
    for c in &r.candidates {
        candidate(r, c, &mut s);
    }
    s.push_str(
        "<p class=\"sub\">Predictions of a discrete-event simulation of the engines' continuous \
         batching, routed by the gateway's own policies; see the capacity-planning guide for the \
         method and how far to trust it.</p></body></html>\n",
    );
    s
}

pub(super) fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The self-check: one row per candidate and figure, flagged outside ±20%.
fn self_check(r: &Report, s: &mut String) {
    if r.self_check.is_none() && r.self_check_missing.is_none() {
        return;
    }
    s.push_str("<section id=\"self-check\"><h2>Self-check on your own past traffic</h2>");
    if let Some(why) = &r.self_check_missing {
        let _ = write!(s, "<p class=\"warning\">No self-check: {}</p>", esc(why));
    }
    if let Some(sc) = &r.self_check {
        self_check_table(sc, s);
    }
    s.push_str("</section>");
}

fn self_check_table(sc: &SelfCheck, s: &mut String) {
    let from = match sc.servers_from {
        FleetFrom::Trace => "the backends the trace names",
        FleetFrom::PlanFile => "<code>recorded_servers</code>",
    };
    let _ = write!(
        s,
        "<p>The recorded traffic ({} requests) replayed on the recorded fleet ({} servers, from \
         {from}) and compared with what the gateway measured: TTFT on {} requests, TPOT on {} \
         (whole answers have neither). A ratio outside 0.80–1.20 is flagged.</p>",
        sc.requests, sc.servers, sc.ttft_compared, sc.tpot_compared
    );
    for c in sc.checked.iter().filter_map(|c| Some((c, off_by(c)?))) {
        let _ = write!(
            s,
            "<p><strong>{}</strong>: {}</p>",
            esc(&c.0.candidate),
            esc(&c.1)
        );
    }
    self_check_rows(sc, s);
    for c in sc.checked.iter().filter(|c| !c.flagged().is_empty()) {
        let _ = write!(
            s,
            "<p class=\"warning\"><strong>{}</strong> is outside ±20% on its own past traffic: \
             the plan does not reproduce this fleet, so trust its answer less.</p>",
            esc(&c.candidate)
        );
    }
}

/// A row per checked candidate and figure, the ratio flagged outside ±20%.
fn self_check_rows(sc: &SelfCheck, s: &mut String) {
    s.push_str(
        "<table><thead><tr><th>candidate</th><th class=\"t\">figure</th><th>planned</th>\
         <th>measured</th><th>planned / measured</th></tr></thead><tbody>",
    );
    for c in &sc.checked {
        for f in &c.ratios {
            let class = if f.flagged() { "flag" } else { "ok" };
            let _ = write!(
                s,
                "<tr><td>{}</td><td class=\"t\">{}</td><td>{}</td><td>{}</td><td class=\"{class}\">×{:.2}</td></tr>",
                esc(&c.candidate),
                f.figure,
                secs(f.planned),
                secs(f.measured),
                f.ratio
            );
        }
        if c.ratios.is_empty() {
            let _ = write!(
                s,
                "<tr><td>{}</td><td class=\"t\" colspan=\"4\">nothing to compare: no request \
                 has a measured TTFT or TPOT</td></tr>",
                esc(&c.candidate)
            );
        }
    }
    s.push_str("</tbody></table>");
}

/// The cheapest fleet, its N+1 answer and how far to trust its p99.
fn answer(r: &Report, s: &mut String) {
    s.push_str("<section id=\"answer\"><h2>Answer</h2>");
    match r.cheapest.map(|i| &r.candidates[i]) {
        Some(c) => {
            let n = c.curve.smallest.unwrap_or(0);
            let _ = write!(
                s,
                "<p class=\"answer\">Recommended: <strong>{} × {n}</strong> at ${:.2}/hour. \
                 With no single point of failure (N+1): <strong>{} × {}</strong> at \
                 ${:.2}/hour.</p><p>{}</p>",
                esc(&c.name),
                c.cost_per_hour(n),
                esc(&c.name),
                n + 1,
                c.cost_per_hour(n + 1),
                esc(&p99_interval(c, n, r))
            );
        }
        None => {
            let _ = write!(
                s,
                "<p class=\"answer\">No candidate meets the SLO within {} servers.</p>",
                r.max_servers
            );
        }
    }
    s.push_str("</section>");
}

/// One row per candidate: its smallest fleet meeting the SLO, the recommended one highlighted.
fn summary(r: &Report, s: &mut String) {
    s.push_str(
        "<h2>Candidates</h2><table id=\"summary\"><thead><tr><th>candidate</th><th class=\"t\">engine</th>\
         <th>servers</th><th>p99 TTFT</th><th>p99 TPOT</th><th>$/hour</th><th>$/Mtok</th>\
         <th class=\"t\">one server down</th><th>N+1</th></tr></thead><tbody>",
    );
    for (i, c) in r.candidates.iter().enumerate() {
        let best = r.cheapest == Some(i);
        let name = if best {
            format!("{}<span class=\"badge\">recommended</span>", esc(&c.name))
        } else {
            esc(&c.name)
        };
        let cells = match (&c.engine, c.curve.smallest) {
            (Err(why), _) => format!("<td class=\"t\" colspan=\"7\">{}</td>", esc(why)),
            (Ok(_), None) => format!(
                "<td class=\"t\" colspan=\"7\">SLO not met with {} servers</td>",
                r.max_servers
            ),
            (Ok(_), Some(n)) => summary_cells(c, n, r),
        };
        let _ = write!(
            s,
            "<tr{}><td>{name}</td><td class=\"t\">{}</td>{cells}</tr>",
            if best { " class=\"recommended\"" } else { "" },
            esc(&engine_label(c))
        );
    }
    s.push_str("</tbody></table>");
}

fn summary_cells(c: &CandidateReport, n: usize, r: &Report) -> String {
    let st: Stats = c.curve.points.get(&n).copied().unwrap_or_default();
    format!(
        "<td>{n}</td><td>{}</td><td>{}</td><td>{:.2}</td><td>{}</td><td class=\"t\">{}</td>\
         <td>{} (${:.2}/h)</td>",
        secs(st.ttft_p99),
        secs(st.tpot_p99),
        c.cost_per_hour(n),
        c.cost_per_million_tokens(n)
            .map_or("–".into(), |v| format!("{v:.3}")),
        esc(&one_down(c, n, r)),
        n + 1,
        c.cost_per_hour(n + 1)
    )
}

/// The charts, each in a figure with a caption; a chart that cannot be drawn says why.
fn figures(r: &Report, s: &mut String) {
    s.push_str("<h2>Charts</h2>");
    let (ttft, tpot) = figures_of(r);
    let charts = [
        (
            "chart-ttft",
            "p99 time to first token against server count (bars: its 95% interval; ringed: the \
             smallest fleet meeting the SLO)",
            charts::by_servers(r, &ttft),
        ),
        (
            "chart-tpot",
            "p99 time per output token against server count",
            charts::by_servers(r, &tpot),
        ),
        (
            "chart-cost",
            "cost against the TTFT objective: each evaluated fleet meeting the TPOT and queue \
             objectives, labelled with its size, its bar the p99's 95% interval; the cheapest \
             fleet meeting an objective is the lowest whose whole bar is left of it",
            charts::cost(r),
        ),
    ];
    for (id, caption, svg) in charts {
        let key = if id == "chart-cost" {
            legend(r, |c| charts::on_cost_chart(r, c))
        } else {
            legend(r, |c| !c.curve.points.is_empty())
        };
        let body = match svg {
            Ok(svg) => format!("{svg}{key}"),
            Err(e) => format!("<p class=\"sub\">{}</p>", esc(&e.to_string())),
        };
        let _ = write!(
            s,
            "<figure id=\"{id}\"><figcaption>{caption}</figcaption>{body}</figure>"
        );
    }
}

/// The figures charted against server count: p99 TTFT (with its interval) and p99 TPOT.
fn figures_of(r: &Report) -> (Figure, Figure) {
    let ttft = Figure {
        name: "p99 TTFT",
        value: |st| st.ttft_p99,
        interval: Some(|st| (st.ttft_p99_low, st.ttft_p99_high)),
        slo: r.slo.ttft_p99,
    };
    let tpot = Figure {
        name: "p99 TPOT",
        value: |st| st.tpot_p99,
        interval: None,
        slo: r.slo.tpot_p99,
    };
    (ttft, tpot)
}

/// A chart's key: the colour of each candidate `shown` on it, and the SLO's dashed line.
fn legend(r: &Report, shown: impl Fn(&CandidateReport) -> bool) -> String {
    let mut s = String::from("<p class=\"legend\">");
    for (i, c) in r.candidates.iter().enumerate() {
        if shown(c) {
            let _ = write!(
                s,
                "<span><i style=\"background:{}\"></i>{}</span>",
                charts::css_colour(i),
                esc(&c.name)
            );
        }
    }
    s.push_str("<span><i class=\"slo\"></i>SLO</span></p>");
    s
}

/// One candidate: its engine, its profile's uncertainty, and every fleet size evaluated.
fn candidate(r: &Report, c: &CandidateReport, s: &mut String) {
    let _ = write!(
        s,
        "<section class=\"candidate\" data-name=\"{}\"><h3>{}</h3><p class=\"sub\">{}</p>",
        esc(&c.name),
        esc(&c.name),
        esc(&engine_text(c))
    );
    if let Some(fit) = &c.fit {
        fit_summary(fit, s);
    }
    if !c.curve.points.is_empty() {
        fleet_table(r, c, s);
    }
    if let Some(n) = c.curve.smallest {
        let _ = write!(
            s,
            "<p><strong>N+1</strong> (no single point of failure): {} servers at ${:.2}/hour — \
             with one of them down, {n} remain and meet the SLO. With one of the {n} down \
             ({} left): {}.</p>",
            n + 1,
            c.cost_per_hour(n + 1),
            n - 1,
            esc(&one_down(c, n, r))
        );
    }
    s.push_str("</section>");
}

/// The engine in words: batch slots, timing, TP, weights and their load times.
fn engine_text(c: &CandidateReport) -> String {
    let e = match &c.engine {
        Ok(e) => e,
        Err(why) => return why.clone(),
    };
    let t = &e.timing;
    let mut out = match e.tp {
        Some(tp) => format!(
            "tensor parallel {tp}, {} engine{} per server; ",
            e.per_server,
            if e.per_server == 1 { "" } else { "s" }
        ),
        None => String::new(),
    };
    let _ = write!(
        out,
        "{} batch slots, {} KV tokens; prefill {} per token, decode step {} + {} per \
         sequence; ${:.2} per server-hour",
        t.max_num_seqs,
        t.kv_capacity_tokens,
        fine(t.prefill_per_token.as_secs_f64()),
        fine(t.decode_base.as_secs_f64()),
        fine(t.decode_per_seq.as_secs_f64()),
        c.server_cost_per_hour
    );
    if let Some(w) = e.weights_bytes {
        let times: Vec<String> = load_times(w)
            .iter()
            .map(|(p, s)| format!("{p} {s:.1} s"))
            .collect();
        let _ = write!(
            out,
            ". Weights {:.1} GB, to a new node at line rate: {}",
            w / 1e9,
            times.join(", ")
        );
    }
    out
}

/// A short time with its unit: µs, ms or s.
fn fine(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.1} µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{s:.2} s")
    }
}

/// How well a measured candidate's engine is known.
fn fit_summary(f: &FitSummary, s: &mut String) {
    let _ = write!(
        s,
        "<div class=\"fit\"><h4>Profile uncertainty</h4><p>Fitted from {} of {} on {} \
         samples; running batch {:.0}–{:.0} and uncached prompts of {:.0}–{:.0} tokens seen; \
         engine time ×{:.2} the fitted typical step's.</p>\
         <table><thead><tr><th>parameter</th><th>value</th><th>± standard error</th>\
         <th>relative</th></tr></thead><tbody>",
        esc(&f.source),
        esc(&f.backends.join(", ")),
        f.samples,
        f.batch_range.0,
        f.batch_range.1,
        f.prompt_range.0,
        f.prompt_range.1,
        f.time_ratio
    );
    for p in &f.params {
        let rel = if p.value > 0.0 {
            format!("{:.0}%", p.stderr / p.value * 100.0)
        } else {
            "–".into()
        };
        let _ = write!(
            s,
            "<tr><td>{}</td><td>{}</td><td>± {}</td><td>{rel}</td></tr>",
            esc(&p.name),
            fine(p.value),
            fine(p.stderr)
        );
    }
    s.push_str("</tbody></table>");
    for w in &f.warnings {
        let _ = write!(s, "<p class=\"warning\">{}</p>", esc(w));
    }
    s.push_str("</div>");
}

/// Every fleet size evaluated, the smallest meeting the SLO highlighted.
fn fleet_table(r: &Report, c: &CandidateReport, s: &mut String) {
    s.push_str(
        "<table class=\"fleets\"><thead><tr><th>servers</th><th>TTFT p50 / p99</th>\
         <th>p99 95% interval</th><th>TPOT p50 / p99</th><th>queue p99 / longest</th>\
         <th>busy</th><th>batch</th><th>$/hour</th><th>$/Mtok</th><th class=\"t\">verdict</th></tr></thead>\
         <tbody>",
    );
    let cheapest = r
        .cheapest
        .is_some_and(|i| std::ptr::eq(&r.candidates[i], c));
    for (n, st) in &c.curve.points {
        let class = match (c.curve.smallest == Some(*n), cheapest) {
            (false, _) => "",
            (true, true) => " class=\"recommended\"",
            (true, false) => " class=\"smallest\"",
        };
        let _ = write!(
            s,
            "<tr{class}><td>{n}</td><td>{} / {}</td><td>{}–{}</td><td>{} / {}</td><td>{} / {}</td>\
             <td>{:.0}%</td><td>{:.1}</td><td>{:.2}</td><td>{}</td><td class=\"t\">{}</td></tr>",
            secs(st.ttft_p50),
            secs(st.ttft_p99),
            secs(st.ttft_p99_low),
            secs(st.ttft_p99_high),
            secs(st.tpot_p50),
            secs(st.tpot_p99),
            secs(st.queue_p99),
            secs(st.queue_max),
            st.busy * 100.0,
            st.mean_batch,
            c.cost_per_hour(*n),
            c.cost_per_million_tokens(*n)
                .map_or("–".into(), |v| format!("{v:.3}")),
            esc(&verdict(st, r))
        );
    }
    s.push_str("</tbody></table>");
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{report, self_check};
    use super::*;
    use crate::plan::profile::FitParam;

    fn fit() -> FitSummary {
        let param = |name: &str, value: f64, stderr: f64| FitParam {
            name: name.into(),
            value,
            stderr,
        };
        FitSummary {
            backends: vec!["gpu-a".into(), "gpu-b".into()],
            source: "engine metrics".into(),
            params: vec![
                param("prefill_per_token", 125e-6, 9e-6),
                param("decode_base", 0.018, 0.0012),
                param("decode_per_seq", 3e-4, 8e-5),
            ],
            batch_range: (1.0, 12.0),
            prompt_range: (40.0, 3100.0),
            samples: 412,
            time_ratio: 1.0,
            warnings: vec!["the plan runs batches of up to 16 <sequences>; the fit saw 12".into()],
        }
    }

    #[test]
    fn a_profile_fit_is_rendered_with_its_uncertainty() {
        let mut r = report();
        assert!(
            !html(&r).contains("Profile uncertainty"),
            "no fit, no section"
        );
        r.candidates[0].fit = Some(fit());
        let page = html(&r);
        assert!(page.contains("Fitted from engine metrics of gpu-a, gpu-b on 412 samples"));
        assert!(page.contains("running batch 1–12 and uncached prompts of 40–3100 tokens"));
        assert!(
            page.contains(
                "<td>prefill_per_token</td><td>125.0 µs</td><td>± 9.0 µs</td><td>7%</td>"
            ),
            "{page}"
        );
        assert!(page.contains("<td>decode_base</td><td>18.00 ms</td><td>± 1.20 ms</td>"));
        assert!(
            page.contains("batches of up to 16 &lt;sequences&gt;"),
            "escaped"
        );
    }

    #[test]
    fn the_page_is_self_contained_with_the_recommendation_highlighted() {
        let mut r = report();
        r.self_check = Some(self_check(0.4));
        let page = html(&r);
        for banned in ["<script", "src=", "href=", "@import", "url("] {
            assert!(!page.contains(banned), "{banned} in the page");
        }
        assert_eq!(
            page.matches("<tr class=\"recommended\">").count(),
            2,
            "summary and fleets"
        );
        assert!(page.contains("<tr class=\"recommended\"><td>6</td><td>32 ms / 315 ms</td>"));
        assert!(page.contains("recommended</span>"));
        assert!(page.contains("Recommended: <strong>sim × 6</strong>"));
        assert!(page.contains(
            "N+1</strong> (no single point of failure): 7 servers at $7.00/hour — with one of \
             them down, 6 remain and meet the SLO. With one of the 6 down (5 left): p99 TTFT \
             897 ms (not sure"
        ));
        let section = &page[page.find("id=\"self-check\"").expect("self-check")..];
        assert!(section.contains(
            "<td class=\"t\">p99 TTFT</td><td>500 ms</td><td>400 ms</td><td class=\"flag\">×1.25</td>"
        ));
        assert!(section.contains(
            "<strong>sim</strong>: on your own past traffic the plan is off by ×1.25 at most \
             (p99 TTFT, planned high)"
        ));
        assert!(section.contains("<td class=\"ok\">×1.00</td>"));
        // the charts: axes labelled with units, the SLO labelled, the recommended fleet named
        assert_eq!(page.matches("<svg").count(), 3);
        assert!(page.contains(">\nservers\n</text>"), "x axis");
        assert!(page.contains("p99 TTFT (log scale)"));
        assert!(page.contains("SLO: p99 TTFT ≤ 1 s"));
        assert!(page.contains("recommended: sim × 6"));
        assert!(page.contains("cost ($/hour)"));
    }

    #[test]
    fn a_chart_that_cannot_be_drawn_says_why() {
        let mut r = report();
        r.candidates[0].curve = Default::default();
        r.cheapest = None;
        let page = html(&r);
        assert!(page.contains("nothing to draw: no fleet size was evaluated"));
        assert!(page.contains("No candidate meets the SLO within 12 servers"));
    }
}
