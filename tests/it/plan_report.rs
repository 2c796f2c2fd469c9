//! The plan's HTML report as a person sees it, rendered by headless Chromium: a plan of a
//! recorded trace (so it has a self-check) with a measured candidate (given a hand-made fit
//! summary, as the engine-metrics fit will fill it), a roofline candidate and an engine
//! timing. The DOM has the axes' labels, the SLO's label, the highlighted recommendation, the
//! self-check and the profile's uncertainty; nothing is wider than the window (measured by a
//! script appended to a test copy only: the report itself has none); and a screenshot of the
//! whole page is saved under target/ with the page, for people to look at. Skips (passes) when Chromium is
//! missing, unless `CI` is set.

use std::path::Path;

use sluice::plan::profile::{FitParam, FitSummary};

use crate::support::chromium::{chromium, run_chromium, target_dir};
use crate::support::process::skip;

const PLAN: &str = r#"
[workload]
trace = "trace.jsonl"

[model]
params_b = 8.03
layers = 32
kv_heads = 8
head_dim = 128

[slo]
ttft_p99 = "1s"
tpot_p99 = "60ms"
max_queue_wait = "5s"

[search]
max_servers = 32

[[candidate]]
name = "like-gpu-a"
profile = "profile.json"
backend = "gpu-a"
price_per_hour = 2.0

[[candidate]]
name = "l4"
gpu = "l4"
price_per_hour = 0.8

[[candidate]]
name = "four-slots"
price_per_hour = 0.4
[candidate.timing]
max_num_seqs = 4
kv_capacity_tokens = 100000
prefill_per_token = "100us"
decode_base = "12ms"
decode_per_seq = "1ms"
"#;

const PROFILE: &str = r#"{"backends":[{"name":"gpu-a","slots":16,"kv_capacity_tokens":200000,
"prefill_tokens_per_second":8000,"decode":[{"batch":1,"tokens_per_second":55},
{"batch":12,"tokens_per_second":38}]}]}"#;

/// 600 requests over two minutes on three backends, with measured latencies; every tenth a
/// whole answer (no TTFT, no TPOT). Deterministic.
fn trace() -> String {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let mut out = String::new();
    for i in 0..600u64 {
        let (prompt, output) = (200 + next(1000), 40 + next(200));
        let measured = if i % 10 == 9 {
            String::new()
        } else {
            format!(
                r#","ttft_ms":{},"tpot_ms":{}"#,
                80 + next(250),
                20.0 + next(100) as f64 / 10.0
            )
        };
        out.push_str(&format!(
            r#"{{"ts":{},"model":"m","api":"/v1/chat/completions","prompt_tokens":{prompt},"completion_tokens":{output},"backend":"gpu-{}","duration_ms":900{measured}}}"#,
            1.7e9 + i as f64 * 0.2,
            ["a", "b", "c"][i as usize % 3]
        ));
        out.push('\n');
    }
    out
}

fn fit() -> FitSummary {
    let param = |name: &str, value: f64, stderr: f64| FitParam {
        name: name.into(),
        value,
        stderr,
    };
    FitSummary {
        backends: vec!["gpu-a".into()],
        source: "engine metrics".into(),
        params: vec![
            param("prefill_per_token", 125e-6, 9e-6),
            param("decode_base", 0.018, 0.0012),
            param("decode_per_seq", 7e-4, 2e-4),
        ],
        batch_range: (1.0, 12.0),
        prompt_range: (40.0, 3100.0),
        samples: 412,
        time_ratio: 1.0,
        warnings: vec!["the plan runs batches of up to 16; the fit saw at most 12".into()],
    }
}

/// The report of the plan in `dir`, with the fit summary on the measured candidate.
fn report(dir: &Path) -> String {
    std::fs::write(dir.join("trace.jsonl"), trace()).expect("write");
    std::fs::write(dir.join("profile.json"), PROFILE).expect("write");
    std::fs::write(dir.join("plan.toml"), PLAN).expect("write");
    let input = sluice::plan::input::load(&dir.join("plan.toml")).expect("valid plan");
    let mut report = sluice::plan::plan(&input, &|_, _, _| {}).expect("planned");
    assert!(report.self_check.is_some(), "a recorded trace is checked");
    report.candidates[0].fit = Some(fit());
    sluice::plan::report::html(&report)
}

/// The page with a script appended that writes its measurements into `<body data-…>`: the
/// document's width against the window's, and how many boxes stick out of the body.
fn with_probe(html: &str) -> String {
    let probe = "<script>const b=document.body,r=b.getBoundingClientRect().right;\
        b.dataset.scroll=document.documentElement.scrollWidth;b.dataset.view=innerWidth;\
        b.dataset.height=document.documentElement.scrollHeight;\
        b.dataset.out=[...document.querySelectorAll('table,svg,figure,p,h1,h2,h3')]\
        .filter(e=>e.getBoundingClientRect().right>r+1).length;</script></body>";
    html.replacen("</body>", probe, 1)
}

/// `data-NAME` of the body in a DOM dump.
fn body_data(dom: &str, name: &str) -> u64 {
    let key = format!("data-{name}=\"");
    let at = dom
        .find(&key)
        .unwrap_or_else(|| panic!("no {key} in the DOM"))
        + key.len();
    let end = at + dom[at..].find('"').unwrap_or(0);
    dom[at..end]
        .parse()
        .unwrap_or_else(|_| panic!("{name}: {}", &dom[at..end]))
}

/// A PNG's width and height, from its header.
fn png_size(bytes: &[u8]) -> (u32, u32) {
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    let be = |i: usize| u32::from_be_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
    (be(16), be(20))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_report_reads_well_in_chromium() {
    let Some(bin) = chromium() else {
        skip("chromium not installed (apt-get install chromium)");
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let html = report(dir.path());
    for banned in ["<script", "src=", "href=", "url("] {
        assert!(
            !html.contains(banned),
            "{banned}: the report must be self-contained"
        );
    }
    let page = dir.path().join("report.html");
    std::fs::write(&page, &html).expect("write");
    let probed = dir.path().join("probed.html");
    std::fs::write(&probed, with_probe(&html)).expect("write");

    let mut height = 0;
    for width in [1280, 1024] {
        let flags = [
            "--dump-dom".to_string(),
            format!("--window-size={width},900"),
        ];
        let (dom, err) = run_chromium(&bin, &format!("file://{}", probed.display()), &flags).await;
        let (scroll, view) = (body_data(&dom, "scroll"), body_data(&dom, "view"));
        assert!(
            scroll <= view,
            "at {width} px the page is {scroll} px wide: {err}"
        );
        assert_eq!(body_data(&dom, "out"), 0, "boxes stick out at {width} px");
        if width == 1280 {
            height = body_data(&dom, "height");
        }
        for text in [
            "\nservers\n</text>",
            "p99 TTFT (log scale)",
            "p99 TPOT (log scale)",
            "p99 TTFT the fleet meets (log scale)",
            "cost ($/hour)",
            "SLO: p99 TTFT ≤ 1 s",
            "SLO: p99 TPOT ≤ 60 ms",
            "<tr class=\"recommended\">",
            "recommended</span>",
            "id=\"self-check\"",
            "Profile uncertainty",
            "± 9.0 µs",
            "the fit saw at most 12",
            "N+1</strong>",
        ] {
            assert!(dom.contains(text), "no `{text}` in the rendered page");
        }
        assert_eq!(dom.matches("<svg").count(), 3, "three charts");
    }

    // the whole page, for people to look at (and the page itself beside it)
    std::fs::create_dir_all(target_dir()).expect("the target directory");
    std::fs::write(target_dir().join("plan-report.html"), &html).expect("write");
    let shot = target_dir().join("plan-report.png");
    let _ = std::fs::remove_file(&shot);
    let flags = [
        format!("--screenshot={}", shot.display()),
        format!("--window-size=1280,{height}"),
        "--hide-scrollbars".to_string(),
    ];
    run_chromium(&bin, &format!("file://{}", page.display()), &flags).await;
    let png = std::fs::read(&shot).expect("a screenshot");
    assert_eq!(png_size(&png), (1280, height as u32));
    // a blank page of that size compresses to a few kilobytes
    assert!(png.len() > 150_000, "{} bytes: blank?", png.len());
    println!("screenshot: {}", shot.display());
}
