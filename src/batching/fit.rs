//! The engine's [`Timing`](super::Timing) fitted from what the engine itself reports: its step
//! costs (`prefill_per_token`, `decode_base`, `decode_per_seq`), each with a standard error,
//! and the ranges of batch size and prompt length the measurements covered.
//!
//! # Input
//! An engine exposes cumulative counters and histograms; their change between two scrapes is
//! a [`Window`]: steps taken, tokens generated, prompt tokens computed (uncached), the sum and
//! count of the time between a running sequence's tokens (one step each, vLLM's
//! `inter_token_latency_seconds`), and for requests that finished, the sum and count of the
//! time from scheduling to first token (the step that prefilled them, vLLM's
//! `request_prefill_time_seconds`) with their computed prompt tokens.
//!
//! # Model
//! A step lasts `decode_base + decode_per_seq × b + prefill_per_token × p` for `b` running
//! sequences and `p` prompt tokens computed in it (see [`super::Batch::step_duration`]).
//! Each window gives two equations in the three unknowns, both means over many steps:
//! - the mean inter-token time is a step as decoding sequences see it: `b` is the window's mean
//!   batch (tokens generated per step) and `p` its prompt tokens per step;
//! - the mean prefill time is the step a request was admitted in: `b` as above and `p` the
//!   computed prompt tokens of those requests (a request admitted beside others waits for their
//!   prompts too, which the mean-field `p` leaves out; the robust weights limit the damage).
//!
//! # Fit
//! Weighted least squares (a window's weight is the number of observations behind its mean),
//! made robust with Huber weights by iterative reweighting, with every parameter kept ≥ 0 (a
//! negative one is pinned at 0 and the others refitted). Standard errors come from the
//! weighted residual scale; windows of one engine are not independent, so they are a floor on
//! the true uncertainty, not a guarantee.
//!
//! The robust weights describe the *typical* step. The windows' total time over what the fit
//! predicts for them ([`EngineFit::time_ratio`]) says how much time the atypical ones cost.
//!
//! Invariant: the fit never panics and never returns a non-finite value; too little or
//! degenerate input is a [`FitError`].

use serde::{Deserialize, Serialize};

/// The change of an engine's counters over one scrape window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Window {
    /// Window start, seconds (any epoch; used to order and deduplicate windows).
    pub at: f64,
    /// Engine steps (vLLM: `iteration_tokens_total` count).
    pub steps: f64,
    /// Tokens generated (one per running sequence per step).
    pub generated: f64,
    /// Prompt tokens computed, cached ones excluded.
    pub prompt_computed: f64,
    /// Sum and count of the gaps between a sequence's consecutive tokens.
    pub itl_sum: f64,
    pub itl_count: f64,
    /// Requests that finished: sum and count of their prefill times and their computed prompt
    /// tokens.
    pub prefill_sum: f64,
    pub prefill_count: f64,
    pub prefill_tokens: f64,
    /// Engines that prefill admitted requests in a pass of their own (TGI): the sequences in
    /// those passes, and then `prefill_*` count passes, not requests. 0 where a prefill shares
    /// its step with the running batch (vLLM).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub prefill_seqs: f64,
    /// Requests that finished: sum and count of their wait in the engine's queue.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub queue_sum: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub queue_count: f64,
    /// Requests that finished: sum and count of their time from admission to their last token.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub inference_sum: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub inference_count: f64,
    /// Requests answered: sum and count of their time from the gateway sending them to the
    /// engine to their last byte, as the gateway measured it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub sent_sum: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub sent_count: f64,
    /// Of those, the streamed ones: sum and count of their time from the gateway sending them
    /// to their first token.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub first_sum: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub first_count: f64,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

impl Window {
    /// The sequences in a step that prefilled: the admitted group where it has a pass of its
    /// own, otherwise the running batch.
    fn prefill_batch(&self, running: f64) -> f64 {
        if self.prefill_seqs > 0.0 && self.prefill_count >= 1.0 {
            self.prefill_seqs / self.prefill_count
        } else {
            running
        }
    }

    /// Computed prompt tokens per prefilled request.
    fn prompt_per_request(&self) -> Option<f64> {
        let requests = if self.prefill_seqs > 0.0 {
            self.prefill_seqs
        } else {
            self.prefill_count
        };
        (requests >= 1.0).then(|| self.prefill_tokens / requests)
    }
}

/// One fitted parameter, seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    pub value: f64,
    pub stderr: f64,
}

/// The fitted step costs and what they were fitted on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineFit {
    pub prefill_per_token: Estimate,
    pub decode_base: Estimate,
    pub decode_per_seq: Estimate,
    /// Mean running batch of the windows used (lowest, highest).
    pub batch_range: (f64, f64),
    /// Mean computed prompt tokens per finished request of the windows used (lowest, highest).
    pub prompt_range: (f64, f64),
    /// Windows that contributed.
    pub windows: u64,
    /// The engine time the windows report over the time the fitted costs predict for them.
    /// Above 1, some steps took far longer than the typical step the robust fit describes
    /// (stalls: the fit treats them as outliers, but they are time the engine lost, so a plan
    /// that needs the engine's throughput scales the costs by it).
    pub time_ratio: f64,
    /// Parameters the windows could not separate from the others, fixed at 0 (a batch that
    /// never varied: `decode_per_seq`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fixed: Vec<String>,
    /// Time to first token spent outside the engine's scheduler (see [`outside`]), when the
    /// windows tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outside: Option<Estimate>,
}

/// Why no timing could be fitted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FitError {
    #[error("too few measurement windows with traffic ({0}; at least {MIN_WINDOWS} are needed)")]
    TooFew(usize),
    #[error("the measurements do not separate prefill from decode (all windows alike)")]
    Degenerate,
}

/// Windows with traffic needed before a fit is offered.
pub const MIN_WINDOWS: usize = 8;

/// Huber's tuning constant (95% efficiency under normal errors).
const HUBER_K: f64 = 1.345;
const ITERATIONS: usize = 30;

/// One equation: `y ≈ x · θ` with weight `w`.
#[derive(Debug, Clone, Copy)]
struct Row {
    x: [f64; 3],
    y: f64,
    w: f64,
}

/// The equations a window gives (none when it saw no step).
fn rows(w: &Window) -> impl Iterator<Item = Row> {
    let usable = w.steps >= 1.0 && w.generated > 0.0;
    let batch = if usable { w.generated / w.steps } else { 0.0 };
    let per_step = if usable {
        w.prompt_computed / w.steps
    } else {
        0.0
    };
    let itl = (usable && w.itl_count >= 1.0 && w.itl_sum > 0.0).then(|| Row {
        x: [1.0, batch, per_step],
        y: w.itl_sum / w.itl_count,
        w: w.itl_count,
    });
    let prefill = (usable && w.prefill_count >= 1.0 && w.prefill_sum > 0.0).then(|| Row {
        x: [
            1.0,
            w.prefill_batch(batch),
            w.prefill_tokens / w.prefill_count,
        ],
        y: w.prefill_sum / w.prefill_count,
        w: w.prefill_count,
    });
    itl.into_iter().chain(prefill)
}

/// Fit the step costs to `windows`.
pub fn fit(windows: &[Window]) -> Result<EngineFit, FitError> {
    let rows: Vec<Row> = windows.iter().flat_map(rows).collect();
    let used = windows
        .iter()
        .filter(|w| w.steps >= 1.0 && w.generated > 0.0)
        .count();
    if used < MIN_WINDOWS {
        return Err(FitError::TooFew(used));
    }
    // A batch that never varied leaves the per-sequence cost unknown: it is then fixed at 0
    // (all of a step's decode cost in its base) and named, rather than no fit at all.
    let (theta, se, fixed) = match robust(&rows, [true; 3]) {
        Some((t, e)) => (t, e, Vec::new()),
        None => robust(&rows, [true, false, true])
            .map(|(t, e)| (t, e, vec!["decode_per_seq".to_string()]))
            .ok_or(FitError::Degenerate)?,
    };
    let range = |f: &dyn Fn(&Window) -> Option<f64>| {
        windows.iter().filter_map(f).fold(None, |acc, v| match acc {
            None => Some((v, v)),
            Some((lo, hi)) => Some((f64::min(lo, v), f64::max(hi, v))),
        })
    };
    let batch_range =
        range(&|w| (w.steps >= 1.0 && w.generated > 0.0).then(|| w.generated / w.steps))
            .unwrap_or((0.0, 0.0));
    let prompt_range = range(&|w| w.prompt_per_request()).unwrap_or((0.0, 0.0));
    let est = |i: usize| Estimate {
        value: theta[i],
        stderr: se[i],
    };
    let observed: f64 = rows.iter().map(|r| r.w * r.y).sum();
    let predicted: f64 = rows.iter().map(|r| r.w * dot(&r.x, &theta)).sum();
    let time_ratio = if predicted > 0.0 && observed.is_finite() {
        observed / predicted
    } else {
        1.0
    };
    Ok(EngineFit {
        decode_base: est(0),
        decode_per_seq: est(1),
        prefill_per_token: est(2),
        batch_range,
        prompt_range,
        windows: used as u64,
        time_ratio,
        fixed,
        outside: outside(windows),
    })
}

/// Answers the gateway must have timed before [`outside`] is offered.
pub const MIN_OUTSIDE_SAMPLES: f64 = 10.0;

/// The part of a request's time to first token spent outside the engine's scheduler (the
/// HTTP exchange, the engine's frontend parsing and tokenizing, the network).
///
/// Where the gateway timed streamed answers' first tokens and the engine reports each
/// request's prefill (vLLM): the gateway's time to first token over the engine's queue wait
/// plus prefill. Otherwise the gateway's time to the last byte over the engine's queue wait
/// plus inference, which also holds what the frontend spends on each later token
/// (detokenizing, framing). Per window, means on both sides (the same requests, but not
/// counted in the same windows); the estimate is the median of the windows' differences,
/// weighted by the answers timed: a frontend starved of CPU now and then stalls a few answers
/// by hundreds of milliseconds, which would make a mean several times the typical request's
/// (the fit's `time_ratio` and its stall warning speak for those). The standard error is that
/// of the differences around it (a floor). `None` without [`MIN_OUTSIDE_SAMPLES`] answers on
/// both sides.
pub fn outside(windows: &[Window]) -> Option<Estimate> {
    let total = |f: fn(&Window) -> f64| windows.iter().map(f).sum::<f64>();
    let per_request_prefill = windows.iter().all(|w| w.prefill_seqs == 0.0);
    if per_request_prefill
        && total(|w| w.first_count) >= MIN_OUTSIDE_SAMPLES
        && total(|w| w.prefill_count) >= MIN_OUTSIDE_SAMPLES
    {
        return gap(
            windows,
            |w| (w.first_sum, w.first_count),
            |w| (w.prefill_sum, w.prefill_count),
        );
    }
    gap(
        windows,
        |w| (w.sent_sum, w.sent_count),
        |w| (w.inference_sum, w.inference_count),
    )
}

/// The weighted median, over the windows timed on both sides, of the gateway's mean
/// (`gateway`: sum, count) less the engine's mean queue wait and mean of `engine`; with the
/// standard error of the differences around it.
fn gap(
    windows: &[Window],
    gateway: fn(&Window) -> (f64, f64),
    engine: fn(&Window) -> (f64, f64),
) -> Option<Estimate> {
    let total = |f: &dyn Fn(&Window) -> f64| windows.iter().map(f).sum::<f64>();
    if total(&|w| gateway(w).1) < MIN_OUTSIDE_SAMPLES
        || total(&|w| engine(w).1) < MIN_OUTSIDE_SAMPLES
    {
        return None;
    }
    let mean = |(sum, n): (f64, f64)| if n >= 1.0 { sum / n } else { 0.0 };
    let mut gaps: Vec<(f64, f64)> = windows
        .iter()
        .filter(|w| gateway(w).1 >= 1.0 && engine(w).1 >= 1.0)
        .map(|w| {
            let inside = mean((w.queue_sum, w.queue_count)) + mean(engine(w));
            (mean(gateway(w)) - inside, gateway(w).1)
        })
        .filter(|g| g.0.is_finite())
        .collect();
    let centre = weighted_median(&mut gaps)?;
    let weight: f64 = gaps.iter().map(|g| g.1).sum();
    let spread = gaps
        .iter()
        .map(|g| g.1 * (g.0 - centre).powi(2))
        .sum::<f64>()
        / weight.max(1.0);
    let stderr = (spread / (gaps.len() as f64).max(1.0)).sqrt();
    stderr.is_finite().then_some(Estimate {
        value: centre.max(0.0),
        stderr,
    })
}

/// The median of `(value, weight)` pairs (sorted in place): the value where half the weight
/// lies on each side, the midpoint of the two values around an exact half.
fn weighted_median(pairs: &mut [(f64, f64)]) -> Option<f64> {
    pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let half = pairs.iter().map(|p| p.1).sum::<f64>() / 2.0;
    let mut below = 0.0;
    for (i, &(value, weight)) in pairs.iter().enumerate() {
        below += weight;
        if below > half + 1e-9 {
            return Some(value);
        }
        if below >= half - 1e-9 {
            return Some(
                pairs
                    .get(i + 1)
                    .map_or(value, |next| (value + next.0) / 2.0),
            );
        }
    }
    None
}

/// Huber-weighted least squares with θ ≥ 0: the estimate and its standard errors.
fn robust(rows: &[Row], start: [bool; 3]) -> Option<([f64; 3], [f64; 3])> {
    let mut h = vec![1.0; rows.len()];
    let mut theta = constrained(rows, &h, start)?;
    for _ in 0..ITERATIONS {
        let res: Vec<f64> = rows
            .iter()
            .map(|r| (r.y - dot(&r.x, &theta)) * r.w.sqrt())
            .collect();
        let scale = mad(&res).max(1e-12);
        let next_h: Vec<f64> = res
            .iter()
            .map(|e| (HUBER_K * scale / e.abs().max(1e-300)).min(1.0))
            .collect();
        let next = constrained(rows, &next_h, start)?;
        let moved = theta
            .iter()
            .zip(&next)
            .any(|(a, b)| (a - b).abs() > 1e-9 * (1.0 + a.abs()));
        theta = next;
        h = next_h;
        if !moved {
            break;
        }
    }
    let se = stderrs(rows, &h, &theta, &start)?;
    Some((theta, se))
}

/// Weighted least squares (weights `w × h`) over the `start` parameters, with negative ones
/// pinned at 0.
fn constrained(rows: &[Row], h: &[f64], start: [bool; 3]) -> Option<[f64; 3]> {
    let mut free = start;
    for _ in 0..3 {
        let theta = solve(rows, h, &free)?;
        match (0..3)
            .filter(|&i| free[i] && theta[i] < 0.0)
            .min_by(|&a, &b| theta[a].total_cmp(&theta[b]))
        {
            Some(i) => free[i] = false,
            None => return Some(theta),
        }
    }
    solve(rows, h, &free)
}

/// Normal equations over the `free` parameters (the others are 0).
fn normal(rows: &[Row], h: &[f64], free: &[bool; 3]) -> ([[f64; 3]; 3], [f64; 3]) {
    let mut a = [[0.0; 3]; 3];
    let mut b = [0.0; 3];
    for (r, hi) in rows.iter().zip(h) {
        let w = r.w * hi;
        for i in 0..3 {
            if !free[i] {
                continue;
            }
            b[i] += w * r.x[i] * r.y;
            for j in 0..3 {
                if free[j] {
                    a[i][j] += w * r.x[i] * r.x[j];
                }
            }
        }
    }
    for i in 0..3 {
        if !free[i] {
            a[i][i] = 1.0;
        }
    }
    (a, b)
}

fn solve(rows: &[Row], h: &[f64], free: &[bool; 3]) -> Option<[f64; 3]> {
    let (a, b) = normal(rows, h, free);
    let inv = invert(a)?;
    let mut theta = [0.0; 3];
    for i in 0..3 {
        theta[i] = (0..3).map(|j| inv[i][j] * b[j]).sum();
    }
    theta.iter().all(|t| t.is_finite()).then_some(theta)
}

/// Standard errors from the weighted residual variance and the inverse normal matrix (0 for
/// a parameter outside `free`).
fn stderrs(rows: &[Row], h: &[f64], theta: &[f64; 3], free: &[bool; 3]) -> Option<[f64; 3]> {
    let (a, _) = normal(rows, h, free);
    let inv = invert(a)?;
    let wsum: f64 = rows.iter().zip(h).map(|(r, hi)| r.w * hi).sum();
    let n = rows.len() as f64;
    if n <= 3.0 || wsum <= 0.0 {
        return None;
    }
    let rss: f64 = rows
        .iter()
        .zip(h)
        .map(|(r, hi)| r.w * hi * (r.y - dot(&r.x, theta)).powi(2))
        .sum();
    let sigma2 = rss / (n - 3.0);
    let se = [0, 1, 2].map(|i| {
        if free[i] {
            (sigma2 * inv[i][i]).max(0.0).sqrt()
        } else {
            0.0
        }
    });
    se.iter().all(|s| s.is_finite()).then_some(se)
}

fn dot(x: &[f64; 3], t: &[f64; 3]) -> f64 {
    x[0] * t[0] + x[1] * t[1] + x[2] * t[2]
}

/// Median absolute deviation from zero, scaled to a normal's standard deviation.
fn mad(res: &[f64]) -> f64 {
    let mut abs: Vec<f64> = res.iter().map(|e| e.abs()).collect();
    abs.sort_by(f64::total_cmp);
    let mid = abs.len() / 2;
    let m = match abs.len() {
        0 => 0.0,
        n if n % 2 == 1 => abs[mid],
        _ => (abs[mid - 1] + abs[mid]) / 2.0,
    };
    1.4826 * m
}

/// The inverse of a symmetric positive 3×3 matrix; `None` when it is (nearly) singular. The
/// matrix is first scaled to a unit diagonal, so parameters of very different sizes (seconds
/// per step, per sequence, per token) are judged alike.
fn invert(m: [[f64; 3]; 3]) -> Option<[[f64; 3]; 3]> {
    let d = [0, 1, 2].map(|i| {
        let v = m[i][i].abs().sqrt();
        if v > 0.0 && v.is_finite() {
            v
        } else {
            1.0
        }
    });
    let s: [[f64; 3]; 3] = [0, 1, 2].map(|i| [0, 1, 2].map(|j| m[i][j] / (d[i] * d[j])));
    let c =
        |r0: usize, r1: usize, c0: usize, c1: usize| s[r0][c0] * s[r1][c1] - s[r0][c1] * s[r1][c0];
    let cof = [
        [c(1, 2, 1, 2), -c(1, 2, 0, 2), c(1, 2, 0, 1)],
        [-c(0, 2, 1, 2), c(0, 2, 0, 2), -c(0, 2, 0, 1)],
        [c(0, 1, 1, 2), -c(0, 1, 0, 2), c(0, 1, 0, 1)],
    ];
    let det = s[0][0] * cof[0][0] + s[0][1] * cof[0][1] + s[0][2] * cof[0][2];
    if !det.is_finite() || det.abs() <= 1e-9 {
        return None;
    }
    Some([0, 1, 2].map(|i| [0, 1, 2].map(|j| cof[j][i] / det / (d[i] * d[j]))))
}

#[cfg(test)]
mod tests;
