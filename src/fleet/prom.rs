//! A small Prometheus text-format (0.0.4 / OpenMetrics-ish) reader, enough for load signals.
//!
//! It owns one thing: turning an exposition into samples (`name`, labels, value). It is
//! tolerant by design, because it reads what engines emit: `# HELP` / `# TYPE` and other
//! comments are skipped, label values may contain escaped quotes, backslashes and newlines,
//! `NaN` / `+Inf` / `-Inf` are values, a trailing timestamp is ignored, an OpenMetrics exemplar
//! (`# {...} v`) after the value is ignored, and a line that cannot be read is skipped rather
//! than failing the whole scrape. Invariant: it never panics and never allocates more than
//! the input's size in labels.

/// One sample of an exposition.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    /// The value of label `key`, if present.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// Every readable sample of `text`, in order; unreadable lines are skipped.
pub fn parse(text: &str) -> Vec<Sample> {
    text.lines().filter_map(parse_line).collect()
}

/// Read one line; `None` for comments, blanks and garbage.
pub fn parse_line(line: &str) -> Option<Sample> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if rest.starts_with('{') {
        let (parsed, after) = parse_labels(&rest[1..])?;
        labels = parsed;
        rest = after;
    }
    // Value, then an optional timestamp and an optional exemplar: only the value matters.
    let rest = rest.trim_start();
    let value_str = rest.split_whitespace().next()?;
    let value = parse_value(value_str)?;
    Some(Sample {
        name: name.to_string(),
        labels,
        value,
    })
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" | "nan" => Some(f64::NAN),
        "+Inf" | "Inf" | "inf" | "+inf" => Some(f64::INFINITY),
        "-Inf" | "-inf" => Some(f64::NEG_INFINITY),
        _ => s.parse::<f64>().ok(),
    }
}

/// Parse `k="v",k2="v2"}` (the opening brace already consumed). Returns the labels and the
/// text after the closing brace.
fn parse_labels(s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut labels = Vec::new();
    let mut rest = s;
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = rest.find('=')?;
        let key = rest[..eq].trim();
        if key.is_empty()
            || !key
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
        {
            return None;
        }
        rest = rest[eq + 1..].trim_start();
        rest = rest.strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()? {
                    (_, 'n') => value.push('\n'),
                    (_, other) => value.push(other),
                },
                c => value.push(c),
            }
        };
        labels.push((key.to_string(), value));
        rest = rest[end + 1..].trim_start();
        if let Some(after) = rest.strip_prefix(',') {
            rest = after;
        } else if !rest.starts_with('}') {
            return None;
        }
    }
}

/// Sum of the finite samples named exactly `name` whose labels match `filter`
/// (`None` when no sample matched).
pub fn sum(samples: &[Sample], name: &str, filter: impl Fn(&Sample) -> bool) -> Option<f64> {
    let mut found = false;
    let mut total = 0.0;
    for s in samples
        .iter()
        .filter(|s| s.name == name && s.value.is_finite())
    {
        if filter(s) {
            found = true;
            total += s.value;
        }
    }
    found.then_some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_plain_labelled_and_special_values() {
        let text = "# HELP x A metric\n# TYPE x gauge\nx 1.5\n\
                    y{a=\"1\",b=\"two\"} 3 1700000000000\n\
                    z{} NaN\nup +Inf\ndown -Inf\n";
        let s = parse(text);
        assert_eq!(s.len(), 5);
        assert_eq!(s[0].name, "x");
        assert_eq!(s[0].value, 1.5);
        assert_eq!(s[1].label("b"), Some("two"));
        assert_eq!(s[1].value, 3.0);
        assert!(s[2].value.is_nan());
        assert_eq!(s[3].value, f64::INFINITY);
        assert_eq!(s[4].value, f64::NEG_INFINITY);
    }

    #[test]
    fn escapes_exemplars_and_garbage() {
        let text = "m{path=\"a\\\"b\\\\c\\nd\",x=\"},{\"} 7\n\
                    h_bucket{le=\"0.1\"} 12 # {trace_id=\"abc\"} 0.05 1.0\n\
                    this is not a metric\n{nolabel=\"1\"} 3\n9bad 1\n\
                    broken{a=\"1\" 3\nnovalue\nq{a=\"1\",} 4\n";
        let s = parse(text);
        let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, vec!["m", "h_bucket", "q"]);
        assert_eq!(s[0].label("path"), Some("a\"b\\c\nd"));
        assert_eq!(s[0].label("x"), Some("},{"));
        assert_eq!(s[1].value, 12.0);
        assert_eq!(s[2].value, 4.0);
    }

    #[test]
    fn never_panics_on_odd_input() {
        for t in [
            "",
            "{",
            "a{",
            "a{b",
            "a{b=",
            "a{b=\"",
            "a{b=\"\\",
            "a{b=\"é\"} 1",
            "ü 1",
            "a 1e400",
            "a{b=\"x\"}",
        ] {
            let _ = parse(t);
        }
        assert_eq!(parse("a 1e400")[0].value, f64::INFINITY);
    }

    #[test]
    fn real_vllm_capture() {
        let text = include_str!("../../tests/fixtures/vllm-0.32.0/metrics-under-load.txt");
        let s = parse(text);
        assert!(s.len() > 50);
        let m = |x: &Sample| x.label("model_name") == Some("tiny");
        assert_eq!(sum(&s, "vllm:num_requests_running", m), Some(4.0));
        assert_eq!(sum(&s, "vllm:num_requests_waiting", m), Some(12.0));
        let kv = sum(&s, "vllm:kv_cache_usage_perc", m).unwrap();
        assert!((kv - 0.2667).abs() < 1e-3);
        assert_eq!(sum(&s, "vllm:prefix_cache_queries_total", m), Some(428.0));
        let idle = include_str!("../../tests/fixtures/vllm-0.32.0/metrics-idle.http");
        let s = parse(idle);
        assert_eq!(sum(&s, "vllm:num_requests_waiting", |_| true), Some(0.0));
    }
}
