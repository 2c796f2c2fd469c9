//! `sluice plan` as a command: the worked example's shape, the table on stdout, progress on
//! stderr, the HTML report written (Chromium renders it in `plan_report`), and a clear error
//! for a bad plan file.

use std::process::Command;

const PLAN: &str = r#"
[workload]
duration = "1m"
rate = 15.0
seed = 2
prompt_tokens = { mean = 400, sd = 200, max = 4000 }
output_tokens = { mean = 40, sd = 20, max = 400 }
shared_prefix = { share = 0.5, prefixes = 4, tokens = 256 }

[model]
params_b = 8.03
layers = 32
kv_heads = 8
head_dim = 128

[slo]
ttft_p99 = "500ms"
tpot_p99 = "60ms"
max_queue_wait = "2s"

[search]
max_servers = 16

[[candidate]]
name = "h100"
gpu = "h100-sxm"
price_per_hour = 3.0

[[candidate]]
name = "big"
gpu = "l4"
gpus = 1
price_per_hour = 0.5

[[candidate]]
name = "four-slots"
price_per_hour = 0.4
[candidate.timing]
max_num_seqs = 4
kv_capacity_tokens = 100000
prefill_per_token = "50us"
decode_base = "10ms"
decode_per_seq = "1ms"
"#;

fn sluice() -> Command {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
}

#[test]
fn plan_prints_the_table_progress_and_writes_a_report() {
    let dir = tempfile::tempdir().expect("temp dir");
    let plan = dir.path().join("plan.toml");
    std::fs::write(&plan, PLAN).expect("write");
    let html = dir.path().join("plan.html");
    let out = sluice()
        .args([
            "plan",
            plan.to_str().expect("utf-8"),
            "--html",
            html.to_str().expect("utf-8"),
        ])
        .output()
        .expect("run sluice plan");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("TTFT p50/p99"), "{stdout}");
    assert!(stdout.contains("cheapest: "), "{stdout}");
    assert!(
        stdout.contains("95% interval") && stdout.contains(" requests"),
        "how far to trust the p99: {stdout}"
    );
    assert!(stdout.contains("weights of h100 (16.1 GB)"), "{stdout}");
    assert!(
        stderr.contains("four-slots: 1 servers -> p99 TTFT"),
        "{stderr}"
    );
    let report = std::fs::read_to_string(&html).expect("report written");
    assert!(
        !report.contains("src=\"http") && !report.contains("href=\"http"),
        "self-contained"
    );

    assert!(!report.contains("<script"), "no scripts");
    assert_eq!(report.matches("<svg").count(), 3, "three charts");
    assert!(
        report.contains("class=\"recommended\""),
        "the recommended fleet"
    );
}

#[test]
fn a_model_that_does_not_fit_is_reported_not_planned() {
    let dir = tempfile::tempdir().expect("temp dir");
    let plan = dir.path().join("plan.toml");
    std::fs::write(
        &plan,
        PLAN.replace(
            "params_b = 8.03\nlayers = 32",
            "params_b = 70.6\nlayers = 80",
        ),
    )
    .expect("write");
    let out = sluice()
        .args(["plan", "--quiet"])
        .arg(&plan)
        .output()
        .expect("run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    let big = stdout
        .lines()
        .find(|l| l.starts_with("big "))
        .expect("a row for big");
    assert!(big.contains("does not fit: needs"), "{big}");
}

#[test]
fn a_bad_plan_file_fails_with_the_field_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let plan = dir.path().join("plan.toml");
    std::fs::write(&plan, PLAN.replace("rate = 15.0", "rate = \"lots\"")).expect("write");
    let out = sluice().arg("plan").arg(&plan).output().expect("run");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("rate"), "{stderr}");
    let help = sluice().args(["plan", "--help"]).output().expect("run");
    assert!(String::from_utf8_lossy(&help.stdout).contains("--html"));
}
