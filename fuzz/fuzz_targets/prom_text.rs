//! The Prometheus text reader never panics, and what it reads is consistent: names and label
//! keys are well-formed, there are no more samples than lines, and the samples written back in
//! the exposition format read back as the same samples.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::fleet::prom::{parse, parse_line, sum, Sample};

fn render(s: &Sample) -> String {
    let mut line = s.name.clone();
    if !s.labels.is_empty() {
        line.push('{');
        for (i, (k, v)) in s.labels.iter().enumerate() {
            if i > 0 {
                line.push(',');
            }
            line.push_str(k);
            line.push_str("=\"");
            for c in v.chars() {
                match c {
                    '\\' => line.push_str("\\\\"),
                    '"' => line.push_str("\\\""),
                    '\n' => line.push_str("\\n"),
                    c => line.push(c),
                }
            }
            line.push('"');
        }
        line.push('}');
    }
    line.push(' ');
    line.push_str(&format!("{:?}", s.value));
    line
}

fn same(a: &Sample, b: &Sample) -> bool {
    a.name == b.name
        && a.labels == b.labels
        && (a.value == b.value || (a.value.is_nan() && b.value.is_nan()))
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let samples = parse(text);
    assert!(samples.len() <= text.lines().count());
    for s in &samples {
        assert!(!s.name.is_empty());
        assert!(!s.name.starts_with(|c: char| c.is_ascii_digit()));
        assert!(s
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'));
        assert!(text.contains(s.name.as_str()));
        for (k, _) in &s.labels {
            assert!(!k.is_empty());
            assert!(k
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.'));
        }
        let line = render(s);
        let back =
            parse_line(&line).unwrap_or_else(|| panic!("rendered sample unreadable: {line:?}"));
        assert!(same(s, &back), "{s:?} -> {line:?} -> {back:?}");
        let _ = s.label("le");
    }
    let rendered: String = samples.iter().map(|s| render(s) + "\n").collect();
    let again = parse(&rendered);
    assert_eq!(again.len(), samples.len());
    if let Some(first) = samples.first() {
        let total = sum(&samples, &first.name, |_| true);
        assert_eq!(
            total.is_some(),
            samples
                .iter()
                .any(|s| s.name == first.name && s.value.is_finite())
        );
    }
});
