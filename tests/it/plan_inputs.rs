//! `sluice plan`'s plan file: every bad input gets an error naming its field, and the search
//! finds the smallest fleet meeting the SLO.

use std::path::Path;

use sluice::plan::input::parse;
use sluice::plan::PlanError;

/// A valid plan: described workload, one engine given by its timing.
const GOOD: &str = r#"
[workload]
duration = "2m"
rate = 20.0
prompt_tokens = { mean = 300, sd = 100, max = 2000 }
output_tokens = { mean = 30, sd = 10, max = 200 }

[slo]
ttft_p99 = "300ms"
tpot_p99 = "40ms"
max_queue_wait = "1s"

[search]
max_servers = 32
policy = "least-request"

[[candidate]]
name = "small"
price_per_hour = 1.0
[candidate.timing]
max_num_seqs = 4
kv_capacity_tokens = 100000
prefill_per_token = "100us"
decode_base = "10ms"
decode_per_seq = "1ms"
"#;

fn error_of(text: &str) -> String {
    match parse(text, Path::new(".")) {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn the_good_plan_is_accepted() {
    let p = parse(GOOD, Path::new(".")).expect("valid");
    assert_eq!(p.candidates.len(), 1);
    assert_eq!(p.max_servers, 32);
}

#[test]
fn each_bad_input_names_what_is_wrong() {
    let cases: &[(&str, &str, &str)] = &[
        ("rate = 20.0", "rate = -1.0", "`workload.rate`"),
        ("rate = 20.0", "", "needs a `trace` or a `rate`"),
        (
            "ttft_p99 = \"300ms\"",
            "ttft_p99 = \"soon\"",
            "`slo.ttft_p99`",
        ),
        (
            "ttft_p99 = \"300ms\"",
            "ttft_p99 = \"0s\"",
            "more than zero",
        ),
        ("max_queue_wait = \"1s\"\n", "", "max_queue_wait"),
        (
            "mean = 300, sd = 100, max = 2000",
            "mean = 300, sd = 100, max = 20",
            "`workload.prompt_tokens.max`",
        ),
        (
            "mean = 30, sd = 10",
            "mean = 30, sd = -1",
            "`workload.output_tokens.sd`",
        ),
        (
            "policy = \"least-request\"",
            "policy = \"fastest\"",
            "`search.policy`",
        ),
        (
            "max_servers = 32",
            "max_servers = 0",
            "`search.max_servers`",
        ),
        ("price_per_hour = 1.0", "", "candidate `small`: price"),
        (
            "price_per_hour = 1.0",
            "price_per_hour = 1.0\npurchase_price = 5.0",
            "candidate `small`: price",
        ),
        ("max_num_seqs = 4", "max_num_seqs = 0", "max_num_seqs"),
        (
            "decode_base = \"10ms\"",
            "decode_base = \"fast\"",
            "timing.decode_base",
        ),
        (
            "name = \"small\"",
            "name = \"small\"\ngpu = \"h100-sxm\"",
            "exactly one of",
        ),
        (
            "[workload]",
            "[workload]\nflavour = 1",
            "unknown field `flavour`",
        ),
        (
            "rate = 20.0",
            "rate = 20.0\nscale = 2.0",
            "`workload.scale`",
        ),
        (
            "rate = 20.0",
            "rate = 20.0\nrecorded_servers = 3",
            "`workload.recorded_servers`",
        ),
        (
            "rate = 20.0",
            "rate = 20.0\ndaily_shape = [1.0, 2.0]",
            "`workload.daily_shape`",
        ),
        (
            "rate = 20.0",
            "rate = 20.0\nshared_prefix = { share = 1.5, prefixes = 2, tokens = 10 }",
            "`workload.shared_prefix.share`",
        ),
    ];
    for (from, to, expect) in cases {
        assert!(GOOD.contains(from), "case base `{from}`");
        let err = error_of(&GOOD.replacen(from, to, 1));
        assert!(err.contains(expect), "`{from}` -> `{to}`: {err}");
    }
}

#[test]
fn specified_servers_need_a_known_gpu_and_the_model() {
    let gpu = GOOD.replace(
        "[candidate.timing]\nmax_num_seqs = 4\nkv_capacity_tokens = 100000\nprefill_per_token = \"100us\"\ndecode_base = \"10ms\"\ndecode_per_seq = \"1ms\"\n",
        "gpu = \"GPU-9000\"\n",
    );
    assert!(error_of(&gpu).contains("unknown accelerator `GPU-9000` (known: h100-sxm"));
    let no_model = gpu.replace("GPU-9000", "h100-sxm");
    assert!(error_of(&no_model).contains("needs the [model] section"));
    let model = "[model]\nparams_b = 8.03\nlayers = 32\nkv_heads = 8\nhead_dim = 128\n";
    let bad_dtype = format!("{model}dtype = \"fp7\"\n{no_model}");
    assert!(error_of(&bad_dtype).contains("unknown dtype `fp7`"));
    let bad_tp = format!(
        "{model}{}",
        no_model.replace("gpu = ", "gpus = 2\ntp = 3\ngpu = ")
    );
    assert!(error_of(&bad_tp).contains("`candidate `small`: tp`"));
    assert!(parse(&format!("{model}{no_model}"), Path::new(".")).is_ok());
}

#[test]
fn a_missing_trace_or_profile_is_a_read_error_naming_the_file() {
    let trace = GOOD
        .replace("rate = 20.0\n", "trace = \"nowhere.jsonl\"\n")
        .replace("prompt_tokens = { mean = 300, sd = 100, max = 2000 }\n", "")
        .replace("output_tokens = { mean = 30, sd = 10, max = 200 }\n", "");
    let input = parse(&trace, Path::new("/nonexistent-dir")).expect("valid file");
    match sluice::plan::plan(&input, &|_, _, _| {}) {
        Err(PlanError::Read { path, .. }) => assert!(path.ends_with("nowhere.jsonl"), "{path}"),
        other => panic!("expected a read error, got {other:?}"),
    }
}

#[test]
fn the_plan_finds_the_smallest_fleet_and_its_n_plus_one() {
    let input = parse(GOOD, Path::new(".")).expect("valid");
    let report = sluice::plan::plan(&input, &|_, _, _| {}).expect("planned");
    let c = &report.candidates[0];
    let n = c.curve.smallest.expect("met within 32 servers");
    assert!(n > 1, "20 req/s does not fit one 4-slot engine");
    assert!(c.curve.points[&n].violations(&input.slo).is_empty());
    // the count below is evaluated (it is the fleet with one server down) and fails
    assert!(!c.curve.points[&(n - 1)].violations(&input.slo).is_empty());
    assert_eq!(report.cheapest, Some(0));
    let text = sluice::plan::report::text(&report);
    assert!(
        text.contains(&format!("cheapest: small x {n} at ${:.2}/hour", n as f64)),
        "{text}"
    );
    assert!(text.contains(&format!("(N+1): {}", n + 1)), "{text}");
}
