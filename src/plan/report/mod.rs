//! The answer as people and programs read it: [`text`] for the terminal, [`json`] for
//! programs and [`html`], a report in one self-contained file (inline CSS and SVG; no scripts,
//! no external resources) viewable offline.
//!
//! The report's charts are drawn by `plotters` (widely used, MIT-licensed, maintained) with
//! its SVG backend alone: default features off, so no bitmap backend, no image codecs and no
//! font loading — it writes text as SVG `<text>` elements (sized by its built-in estimate),
//! which the browser sets in its own sans-serif. Axes, ticks, log scales and dashed lines come
//! from it rather than from hand-placed SVG; each chart's key is HTML under it.
//!
//! - `text`: the plain-text answer.
//! - `json`: the JSON answer.
//! - `html`: the page; `charts` its SVG charts.
//! - `fixtures` (tests): hand-made reports.

mod charts;
mod html;
mod json;
mod text;

pub use html::html;
pub use json::json;
pub use text::text;

use std::fmt::Write;

use super::search::{secs, Stats};
use super::selfcheck::Checked;
use super::{CandidateReport, Report};

/// "workload: N requests over T s (R req/s); SLO: …".
fn workload_line(r: &Report) -> String {
    let rate = r.requests as f64 / r.duration_s.max(1e-9);
    format!(
        "workload: {} requests over {:.0} s ({rate:.1} req/s); SLO: p99 TTFT <= {}, p99 TPOT <= {}, queue wait <= {}",
        r.requests,
        r.duration_s,
        secs(r.slo.ttft_p99),
        secs(r.slo.tpot_p99),
        secs(r.slo.max_queue_wait)
    )
}

/// "on your own past traffic the plan is off by ×F at most (figure, planned high)", when any
/// figure was compared.
fn off_by(c: &Checked) -> Option<String> {
    let worst = c.worst()?;
    let way = if worst.ratio >= 1.0 { "high" } else { "low" };
    Some(format!(
        "on your own past traffic the plan is off by ×{:.2} at most ({}, planned {way})",
        worst.factor(),
        worst.figure
    ))
}

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

#[cfg(test)]
mod fixtures;
