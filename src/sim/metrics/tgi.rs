//! TGI's `/metrics` text as its router's metrics-exporter-prometheus writes it: a `# TYPE` line
//! per family, Rust `Display` numbers, `le` after the family's own labels, a blank line after
//! each family. The series with a `method` label come per forward pass (`prefill`, `decode`).

use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;

use super::{Counters, Histogram, ModelStats};

/// One histogram series: `labels` is `""` or `method="…"`.
fn series(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    let sep = if labels.is_empty() { "" } else { "," };
    for (b, c) in h.cumulative() {
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
    }
    let n = h.count();
    let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {n}");
    let braces = |s: &str| {
        if s.is_empty() {
            String::new()
        } else {
            format!("{{{s}}}")
        }
    };
    let _ = writeln!(out, "{name}_sum{} {}", braces(labels), h.sum());
    let _ = writeln!(out, "{name}_count{} {n}", braces(labels));
}

fn histogram(out: &mut String, name: &str, h: &Histogram) {
    let _ = writeln!(out, "# TYPE {name} histogram");
    series(out, name, "", h);
    out.push('\n');
}

/// A histogram family with one series per forward method.
fn by_method(out: &mut String, name: &str, prefill: &Histogram, decode: &Histogram) {
    let _ = writeln!(out, "# TYPE {name} histogram");
    series(out, name, "method=\"prefill\"", prefill);
    series(out, name, "method=\"decode\"", decode);
    out.push('\n');
}

/// One TGI series without labels, and its blank line.
fn plain(out: &mut String, name: &str, kind: &str, v: u64) {
    let _ = writeln!(out, "# TYPE {name} {kind}\n{name} {v}\n");
}

/// TGI's `/metrics` text.
pub(crate) fn render_tgi(s: &ModelStats, c: &Counters) -> String {
    let mut out = String::with_capacity(64 * 1024);
    let ok = c.infer_success.load(Relaxed);
    plain(
        &mut out,
        "tgi_request_count",
        "counter",
        c.infer_total.load(Relaxed),
    );
    plain(&mut out, "tgi_request_success", "counter", ok);
    let _ = writeln!(
        out,
        "# TYPE tgi_request_failure counter\ntgi_request_failure{{err=\"overloaded\"}} {}\ntgi_request_failure{{err=\"validation\"}} {}\n",
        c.overloaded.load(Relaxed),
        c.validation.load(Relaxed)
    );
    let (prefills, decodes) = (s.tgi.prefill.count(), s.tgi.decode.count());
    for name in ["tgi_batch_inference_count", "tgi_batch_inference_success"] {
        let _ = writeln!(
            out,
            "# TYPE {name} counter\n{name}{{method=\"prefill\"}} {prefills}\n{name}{{method=\"decode\"}} {decodes}\n"
        );
    }
    for (name, v) in [
        ("tgi_queue_size", &s.waiting),
        ("tgi_batch_current_size", &s.running),
        ("tgi_batch_current_max_tokens", &s.batch_max_tokens),
    ] {
        plain(&mut out, name, "gauge", v.load(Relaxed));
    }
    by_method(
        &mut out,
        "tgi_batch_forward_duration",
        &s.tgi.prefill,
        &s.tgi.decode,
    );
    for (name, h) in [
        ("tgi_batch_next_size", &s.tgi.next_size),
        ("tgi_request_duration", &c.tgi_duration),
        ("tgi_request_queue_duration", &c.tgi_queue),
        ("tgi_request_inference_duration", &c.tgi_inference),
        (
            "tgi_request_mean_time_per_token_duration",
            &c.tgi_time_per_token,
        ),
        ("tgi_request_input_length", &c.tgi_input_length),
        ("tgi_request_generated_tokens", &c.tgi_generated_tokens),
    ] {
        histogram(&mut out, name, h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::render_tgi;
    use crate::sim::metrics::{Counters, ModelStats, StepObs};
    use crate::sim::SimKind;

    fn text() -> String {
        let s = ModelStats::new(SimKind::Tgi, 1000, 4096);
        s.admitted_group(3);
        s.step(&StepObs {
            secs: 0.02,
            prefill_share: 0.5,
            prefilled: 3,
            decoding: 1,
            ..Default::default()
        });
        render_tgi(&s, &Counters::new(1000, 4096))
    }

    #[test]
    fn forward_durations_per_method_with_tgis_buckets() {
        let t = text();
        let prefill = t
            .lines()
            .filter(|l| l.starts_with("tgi_batch_forward_duration_bucket{method=\"prefill\",le=\""))
            .count();
        assert_eq!(prefill, 36, "35 bounds and +Inf");
        for line in [
            "# TYPE tgi_batch_forward_duration histogram",
            "tgi_batch_forward_duration_bucket{method=\"prefill\",le=\"0.00015000000000000001\"} 0",
            "tgi_batch_forward_duration_bucket{method=\"decode\",le=\"+Inf\"} 1",
            "tgi_batch_forward_duration_sum{method=\"prefill\"} 0.01",
            "tgi_batch_forward_duration_count{method=\"decode\"} 1",
            "tgi_batch_inference_count{method=\"prefill\"} 1",
            "tgi_batch_next_size_bucket{le=\"3\"} 1",
            "tgi_batch_next_size_bucket{le=\"1024\"} 1",
            "tgi_request_input_length_bucket{le=\"10\"} 0",
            "tgi_request_input_length_bucket{le=\"1000\"} 0",
            "tgi_request_generated_tokens_bucket{le=\"40.96\"} 0",
            "tgi_request_mean_time_per_token_duration_count 0",
            "tgi_request_queue_duration_sum 0",
        ] {
            assert!(t.lines().any(|l| l == line), "missing {line}");
        }
        assert!(t.ends_with("\n\n"));
    }
}
