//! The report's charts, drawn by `plotters` into SVG text: a figure (p99 TTFT, p99 TPOT)
//! against server count per candidate, with its 95% interval where it has one, the SLO as a
//! labelled dashed line and each candidate's smallest fleet meeting the SLO ringed (the
//! recommended one labelled); and cost per hour against the TTFT objective each evaluated
//! fleet meets. Times are in milliseconds on log axes with 1–2–5 ticks.

use plotters::chart::MeshStyle;
use plotters::coord::combinators::WithKeyPoints;
use plotters::coord::types::{RangedCoordf64, RangedCoordu32};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::super::search::Stats;
use super::super::{CandidateReport, Report};

/// Width and height of a chart, pixels (the page scales it down on a narrow screen).
const SIZE: (u32, u32) = (780, 420);
const FONT: &str = "sans-serif";
const SLO_COLOUR: RGBColor = RGBColor(200, 30, 30);
const GRID: RGBColor = RGBColor(225, 225, 225);

/// The series colours (a colour-blind-safe palette), by candidate index.
pub const COLOURS: [RGBColor; 6] = [
    RGBColor(0, 114, 178),
    RGBColor(230, 159, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(86, 180, 233),
    RGBColor(213, 94, 0),
];

/// Why a chart was not drawn.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    #[error("nothing to draw: {0}")]
    Empty(&'static str),
    #[error("drawing failed: {0}")]
    Draw(String),
}

fn drawing<E: std::fmt::Display>(e: E) -> ChartError {
    ChartError::Draw(e.to_string())
}

/// A figure's 95% interval (low, high), seconds.
pub type Interval = fn(&Stats) -> (f64, f64);

/// A figure of a fleet size to chart against server count.
pub struct Figure {
    /// "p99 TTFT".
    pub name: &'static str,
    pub value: fn(&Stats) -> f64,
    /// Its 95% interval, when it has one.
    pub interval: Option<Interval>,
    /// The SLO's bound, seconds.
    pub slo: f64,
}

/// Seconds to milliseconds for a log axis (not a number stays one, to be left out).
fn ms(s: f64) -> f64 {
    if s.is_finite() {
        (s * 1000.0).max(1e-3)
    } else {
        f64::NAN
    }
}

/// A tick label for milliseconds, with its unit.
fn time_label(v: f64) -> String {
    if v < 1.0 {
        format!("{v:.2} ms")
    } else if v < 1000.0 {
        format!("{v:.0} ms")
    } else {
        format!("{} s", v / 1000.0)
    }
}

/// 1–2–5 ticks (or 1–3, or powers of ten) inside `lo..hi`, at most nine.
fn log_ticks(lo: f64, hi: f64) -> Vec<f64> {
    let (first, last) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    for mantissas in [&[1.0, 2.0, 5.0][..], &[1.0, 3.0], &[1.0]] {
        let ticks: Vec<f64> = (first..=last)
            .flat_map(|e| mantissas.iter().map(move |m| m * 10f64.powi(e)))
            .filter(|v| (lo..=hi).contains(v))
            .collect();
        if ticks.len() <= 9 {
            return ticks;
        }
    }
    vec![lo, hi]
}

/// A log axis over `values`: from the tick at or below the smallest to the tick at or above
/// the largest (at least a factor of four wide), and its ticks.
fn log_axis(values: impl Iterator<Item = f64>) -> (f64, f64, Vec<f64>) {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::MAX, f64::MIN), |(a, b), v| (a.min(v), b.max(v)));
    let (lo, hi) = if lo > hi { (1.0, 1000.0) } else { (lo, hi) };
    let widen = (4.0 / (hi / lo)).max(1.0).sqrt();
    let (lo, hi) = (lo / widen, hi * widen);
    let outer = (
        10f64.powf(lo.log10().floor()),
        10f64.powf(hi.log10().ceil()),
    );
    let ticks = log_ticks(outer.0, outer.1);
    let lo = ticks
        .iter()
        .copied()
        .filter(|t| *t <= lo)
        .fold(outer.0, f64::max);
    let hi = ticks
        .iter()
        .copied()
        .filter(|t| *t >= hi)
        .fold(outer.1, f64::min);
    let ticks = ticks
        .into_iter()
        .filter(|t| (lo..=hi).contains(t))
        .collect();
    (lo, hi, ticks)
}

/// The colour of candidate `i` (in the plan's order), as CSS.
pub fn css_colour(i: usize) -> String {
    let RGBColor(r, g, b) = COLOURS[i % COLOURS.len()];
    format!("#{r:02x}{g:02x}{b:02x}")
}

/// The candidates with something to draw, with their colour.
fn drawn(r: &Report) -> Vec<(RGBColor, &CandidateReport)> {
    r.candidates
        .iter()
        .enumerate()
        .filter(|(_, c)| !c.curve.points.is_empty())
        .map(|(i, c)| (COLOURS[i % COLOURS.len()], c))
        .collect()
}

/// "recommended: NAME × N" for the cheapest candidate's smallest fleet meeting the SLO.
fn recommended(r: &Report, c: &CandidateReport, n: usize) -> Option<String> {
    let cheapest = r
        .cheapest
        .is_some_and(|i| std::ptr::eq(&r.candidates[i], c));
    cheapest.then(|| format!("recommended: {} × {n}", c.name))
}

/// A ring around a point at `$at`, with `$label` on a white ground above and right of it (a
/// macro: the composed element's type is plotters' to name).
macro_rules! ring {
    ($at:expr, $colour:expr, $label:expr) => {{
        let label: &str = $label;
        let width = if label.is_empty() {
            0
        } else {
            (6.6 * label.chars().count() as f64) as i32 + 8
        };
        EmptyElement::at($at)
            + Circle::new((0, 0), 9, $colour.stroke_width(3))
            + Rectangle::new([(10, -29), (10 + width, -12)], WHITE.mix(0.7).filled())
            + Text::new(label.to_string(), (14, -27), font(15, &$colour))
    }};
}

fn font(size: u32, colour: &RGBColor) -> TextStyle<'static> {
    (FONT, size).into_font().color(colour)
}

/// The SLO's label style: right-aligned, `v` its vertical anchor.
fn slo_font(v: VPos) -> TextStyle<'static> {
    font(15, &SLO_COLOUR).pos(Pos::new(HPos::Right, v))
}

type ServersChart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<RangedCoordu32, WithKeyPoints<LogCoord<f64>>>>;
type CostChart<'a, 'b> =
    ChartContext<'a, SVGBackend<'b>, Cartesian2d<WithKeyPoints<LogCoord<f64>>, RangedCoordf64>>;

/// `figure` against server count, one line per candidate.
pub fn by_servers(r: &Report, figure: &Figure) -> Result<String, ChartError> {
    let series = drawn(r);
    if series.is_empty() {
        return Err(ChartError::Empty("no fleet size was evaluated"));
    }
    let (lo, hi, ticks) = servers_y_axis(&series, figure);
    let x_max = series
        .iter()
        .filter_map(|(_, c)| c.curve.points.keys().last())
        .max()
        .map_or(1, |n| *n as u32);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(drawing)?;
        let y = (lo..hi).log_scale().with_key_points(ticks);
        let mut chart = builder(&root)
            .build_cartesian_2d(0u32..x_max + 1, y)
            .map_err(drawing)?;
        house_style(chart.configure_mesh().x_desc("servers"))
            .y_desc(format!("{} (log scale)", figure.name))
            .x_labels((x_max as usize + 2).min(17))
            .x_label_formatter(&|x| x.to_string())
            .y_label_formatter(&|v| time_label(*v))
            .draw()
            .map_err(drawing)?;
        slo_horizontal(&mut chart, figure, x_max + 1)?;
        for (colour, c) in &series {
            servers_series(&mut chart, c, *colour, figure)?;
        }
        // the rings last, so no line crosses their labels
        for (colour, c) in &series {
            servers_ring(&mut chart, r, c, *colour, figure)?;
        }
        root.present().map_err(drawing)?;
    }
    Ok(svg)
}

/// The time axis of `figure` against server count: every value, interval end and the SLO.
fn servers_y_axis(
    series: &[(RGBColor, &CandidateReport)],
    figure: &Figure,
) -> (f64, f64, Vec<f64>) {
    let values = series
        .iter()
        .flat_map(|(_, c)| c.curve.points.values())
        .flat_map(|st| {
            let (lo, hi) = figure.interval.map_or((f64::NAN, f64::NAN), |f| f(st));
            [(figure.value)(st), lo, hi]
        });
    log_axis(values.chain([figure.slo]).map(ms))
}

/// The SLO's bound as a dashed horizontal line, labelled at its right end (`x_end`).
fn slo_horizontal(
    chart: &mut ServersChart<'_, '_>,
    figure: &Figure,
    x_end: u32,
) -> Result<(), ChartError> {
    let slo = ms(figure.slo);
    let style = SLO_COLOUR.stroke_width(2);
    chart
        .draw_series(DashedLineSeries::new([(0, slo), (x_end, slo)], 8, 5, style))
        .map_err(drawing)?;
    let label = format!("SLO: {} ≤ {}", figure.name, time_label(slo));
    chart
        .draw_series([Text::new(label, (x_end, slo), slo_font(VPos::Bottom))])
        .map_err(drawing)?;
    Ok(())
}

/// The chart's frame: margins and room for the axes' labels.
fn builder<'a, 'b>(
    root: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
) -> ChartBuilder<'a, 'b, SVGBackend<'b>> {
    let mut b = ChartBuilder::on(root);
    b.margin(16)
        .margin_right(30)
        .x_label_area_size(52)
        .y_label_area_size(78);
    b
}

/// One candidate against server count: a line, its points and their intervals.
fn servers_series(
    chart: &mut ServersChart<'_, '_>,
    c: &CandidateReport,
    colour: RGBColor,
    figure: &Figure,
) -> Result<(), ChartError> {
    let at = |(n, st): (&usize, &Stats)| (*n as u32, ms((figure.value)(st)));
    let points: Vec<(u32, f64)> = c.curve.points.iter().map(at).collect();
    chart
        .draw_series(LineSeries::new(points.clone(), colour.stroke_width(2)))
        .map_err(drawing)?;
    chart
        .draw_series(points.iter().map(|p| Circle::new(*p, 4, colour.filled())))
        .map_err(drawing)?;
    if let Some(f) = figure.interval {
        let bars = c.curve.points.iter().map(|(n, st)| {
            let (a, b) = f(st);
            let x = *n as u32;
            PathElement::new([(x, ms(a)), (x, ms(b))], colour.mix(0.45).stroke_width(6))
        });
        chart.draw_series(bars).map_err(drawing)?;
    }
    Ok(())
}

/// A candidate's smallest fleet meeting the SLO, ringed and labelled with its size (the
/// recommended one with its name).
fn servers_ring(
    chart: &mut ServersChart<'_, '_>,
    r: &Report,
    c: &CandidateReport,
    colour: RGBColor,
    figure: &Figure,
) -> Result<(), ChartError> {
    let at = |(n, st): (&usize, &Stats)| (*n as u32, ms((figure.value)(st)));
    let smallest = c
        .curve
        .smallest
        .and_then(|n| c.curve.points.get_key_value(&n));
    if let Some((n, st)) = smallest {
        let label = recommended(r, c, *n).unwrap_or_else(|| n.to_string());
        chart
            .draw_series([ring!(at((n, st)), colour, &label)])
            .map_err(drawing)?;
    }
    Ok(())
}

/// One fleet on the cost chart: the TTFT objective it meets (ms), its cost, its size, and the
/// p99's 95% interval (ms).
type CostPoint = (f64, f64, usize, (f64, f64));

/// Per candidate, its fleets meeting the TPOT and queue objectives, by p99 TTFT.
fn cost_points(r: &Report, c: &CandidateReport) -> Vec<CostPoint> {
    let mut pts: Vec<CostPoint> = c
        .curve
        .points
        .iter()
        .filter(|(_, st)| st.tpot_p99 <= r.slo.tpot_p99 && st.queue_max <= r.slo.max_queue_wait)
        .map(|(n, st)| {
            let interval = (ms(st.ttft_p99_low), ms(st.ttft_p99_high));
            (ms(st.ttft_p99), c.cost_per_hour(*n), *n, interval)
        })
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts
}

/// Whether candidate `c` has a line on the cost chart.
pub fn on_cost_chart(r: &Report, c: &CandidateReport) -> bool {
    !cost_points(r, c).is_empty()
}

/// Cost per hour against the p99 TTFT objective each evaluated fleet meets (those meeting the
/// TPOT and queue objectives): the cheapest fleet for an objective T is the lowest point left
/// of T.
pub fn cost(r: &Report) -> Result<String, ChartError> {
    let series: Vec<(RGBColor, &CandidateReport, Vec<CostPoint>)> = drawn(r)
        .into_iter()
        .map(|(colour, c)| (colour, c, cost_points(r, c)))
        .filter(|s| !s.2.is_empty())
        .collect();
    if series.is_empty() {
        return Err(ChartError::Empty(
            "no fleet evaluated meets the TPOT and queue objectives",
        ));
    }
    let all = || series.iter().flat_map(|s| s.2.iter());
    let xs = all().flat_map(|p| [p.0, p.3 .0, p.3 .1]);
    let (lo, hi, ticks) = log_axis(xs.chain([ms(r.slo.ttft_p99)]));
    let top = all().map(|p| p.1).fold(1e-6, f64::max) * 1.2;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        root.fill(&WHITE).map_err(drawing)?;
        let x = (lo..hi).log_scale().with_key_points(ticks);
        let mut chart = builder(&root)
            .build_cartesian_2d(x, 0.0..top)
            .map_err(drawing)?;
        house_style(
            chart
                .configure_mesh()
                .x_desc("p99 TTFT the fleet meets (log scale)"),
        )
        .y_desc("cost ($/hour)")
        .x_label_formatter(&|v| time_label(*v))
        .y_label_formatter(&|v| format!("{v:.2}"))
        .draw()
        .map_err(drawing)?;
        slo_vertical(&mut chart, ms(r.slo.ttft_p99), top)?;
        for (colour, _, pts) in &series {
            cost_series(&mut chart, *colour, pts)?;
        }
        // the rings last, so no line crosses their labels
        for (colour, c, pts) in &series {
            let found = pts.iter().find(|p| Some(p.2) == c.curve.smallest);
            if let Some((x, y, n, _)) = found {
                let label = recommended(r, c, *n).unwrap_or_default();
                let ring = ring!((*x, *y), *colour, &label);
                chart.draw_series([ring]).map_err(drawing)?;
            }
        }
        root.present().map_err(drawing)?;
    }
    Ok(svg)
}

/// The TTFT objective as a dashed vertical line, labelled at its top.
fn slo_vertical(chart: &mut CostChart<'_, '_>, slo: f64, top: f64) -> Result<(), ChartError> {
    let style = SLO_COLOUR.stroke_width(2);
    chart
        .draw_series(DashedLineSeries::new([(slo, 0.0), (slo, top)], 8, 5, style))
        .map_err(drawing)?;
    let label = format!("SLO: p99 TTFT ≤ {} ", time_label(slo));
    chart
        .draw_series([Text::new(label, (slo, top), slo_font(VPos::Top))])
        .map_err(drawing)?;
    Ok(())
}

/// One candidate's fleets on the cost chart: a line, each point labelled with its size, with
/// its p99's 95% interval as a bar (a fleet meets an objective its whole bar is left of).
fn cost_series(
    chart: &mut CostChart<'_, '_>,
    colour: RGBColor,
    pts: &[CostPoint],
) -> Result<(), ChartError> {
    let xy: Vec<(f64, f64)> = pts.iter().map(|p| (p.0, p.1)).collect();
    chart
        .draw_series(LineSeries::new(xy, colour.stroke_width(2)))
        .map_err(drawing)?;
    let bars = pts.iter().map(|(_, y, _, (a, b))| {
        PathElement::new([(*a, *y), (*b, *y)], colour.mix(0.45).stroke_width(6))
    });
    chart.draw_series(bars).map_err(drawing)?;
    let marks = pts.iter().map(|(x, y, n, _)| {
        EmptyElement::at((*x, *y))
            + Circle::new((0, 0), 4, colour.filled())
            + Text::new(
                n.to_string(),
                (-8, 0),
                font(12, &colour).pos(Pos::new(HPos::Right, VPos::Center)),
            )
    });
    chart.draw_series(marks).map_err(drawing)?;
    Ok(())
}

/// The fonts and grid every chart's axes share.
fn house_style<'m, 'a, 'b, X, Y, DB>(
    mesh: &'m mut MeshStyle<'a, 'b, X, Y, DB>,
) -> &'m mut MeshStyle<'a, 'b, X, Y, DB>
where
    X: Ranged<ValueType: std::fmt::Debug>,
    Y: Ranged<ValueType: std::fmt::Debug>,
    DB: DrawingBackend,
{
    mesh.axis_desc_style((FONT, 16))
        .label_style((FONT, 13))
        .bold_line_style(GRID)
        .light_line_style(WHITE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_ticks_are_one_two_five_inside_the_range() {
        assert_eq!(log_ticks(40.0, 900.0), [50.0, 100.0, 200.0, 500.0]);
        assert_eq!(
            log_ticks(1.0, 100_000.0),
            [1.0, 10.0, 100.0, 1000.0, 10_000.0, 100_000.0]
        );
        // the axis starts and ends on a tick, at least a factor of four wide
        let (lo, hi, ticks) = log_axis([120.0, 130.0, 800.0].into_iter());
        assert_eq!((lo, hi), (100.0, 1000.0));
        assert_eq!(ticks, [100.0, 200.0, 500.0, 1000.0]);
        let (lo, hi, _) = log_axis([100.0, 110.0].into_iter());
        assert!(hi / lo >= 4.0, "{lo}..{hi}");
    }
}
