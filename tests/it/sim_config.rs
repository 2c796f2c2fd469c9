//! `sluice sim` arguments and `SimConfig` validation.

use clap::Parser;
use sluice::sim::{FaultMode, SimArgs, SimConfig, SimKind};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: SimArgs,
}

fn parse(args: &[&str]) -> Result<SimConfig, String> {
    let mut v = vec!["sim"];
    v.extend_from_slice(args);
    let cli = Cli::try_parse_from(v).map_err(|e| e.to_string())?;
    cli.args.into_config().map_err(|e| e.to_string())
}

#[test]
fn cli_flags_map_to_the_config() {
    let c = parse(&[
        "--kind",
        "ollama",
        "--port",
        "11434",
        "--model",
        "llama3.2",
        "--model",
        "qwen:0.5b",
        "--speed",
        "0",
        "--parallel",
        "4",
        "--max-queue",
        "8",
        "--load-time",
        "2.5",
        "--fault",
        "error_rate",
        "--fault-rate",
        "0.25",
    ])
    .unwrap();
    assert_eq!(c.kind, SimKind::Ollama);
    assert_eq!(c.port, 11434);
    assert_eq!(c.models, ["llama3.2:latest", "qwen:0.5b"]);
    assert_eq!(c.speed, 0.0);
    assert_eq!(c.timing.max_num_seqs, 4);
    assert_eq!(c.max_queue, 8);
    assert_eq!(c.load_time.as_millis(), 2500);
    assert_eq!(c.fault.mode, FaultMode::ErrorRate);
    assert_eq!(c.fault.rate, 0.25);
    assert_eq!(c.bind_addr().to_string(), "127.0.0.1:11434");
}

#[test]
fn defaults_follow_each_engine() {
    let v = parse(&["--kind", "vllm", "--model", "m"]).unwrap();
    assert_eq!(v.timing.max_num_seqs, 256);
    assert_eq!(v.speed, 1.0);
    let t = parse(&["--kind", "tgi", "--model", "m"]).unwrap();
    assert_eq!(t.max_concurrent_requests, 128);
    let o = parse(&["--kind", "ollama", "--model", "m"]).unwrap();
    assert_eq!(o.timing.max_num_seqs, 1);
    assert_eq!(o.max_queue, 512);
    assert_eq!(o.keep_alive.as_secs(), 300);
}

#[test]
fn bad_values_are_rejected() {
    assert!(parse(&["--kind", "llamafile", "--model", "m"]).is_err());
    assert!(parse(&["--kind", "vllm"]).is_err(), "a model is required");
    assert!(parse(&["--kind", "vllm", "--model", "m", "--speed", "-1"]).is_err());
    assert!(parse(&["--kind", "vllm", "--model", "m", "--fault", "nope"]).is_err());
    assert!(parse(&[
        "--kind",
        "vllm",
        "--model",
        "m",
        "--fault",
        "error_rate",
        "--fault-rate",
        "3"
    ])
    .is_err());
    assert!(parse(&["--kind", "vllm", "--model", "m", "--model", "m"]).is_err());
    assert_eq!("TGI".parse::<SimKind>().unwrap(), SimKind::Tgi);
    assert_eq!(SimKind::Ollama.to_string(), "ollama");
}

async fn run_and_probe(threads: usize) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let cfg = SimConfig::new(SimKind::Vllm, vec!["m".into()])
        .speed(0.0)
        .threads(threads);
    let task = tokio::spawn(sluice::sim::run(listener, cfg, async move {
        let _ = rx.await;
    }));
    let c = reqwest::Client::new();
    for _ in 0..20 {
        let r = c.get(format!("http://{addr}/health")).send().await.unwrap();
        assert_eq!(r.status(), 200);
    }
    tx.send(()).unwrap();
    let r = tokio::time::timeout(std::time::Duration::from_secs(10), task)
        .await
        .expect("run stops on shutdown")
        .unwrap();
    assert!(r.is_ok());
}

#[tokio::test]
async fn run_serves_on_dedicated_threads_and_stops() {
    run_and_probe(2).await;
    run_and_probe(1).await;
    run_and_probe(0).await;
}

#[test]
fn tokenizer_flag_loads_the_folder_or_names_what_is_wrong() {
    let dir = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tokenizer/tiny-tools"
    );
    let c = parse(&["--kind", "vllm", "--model", "m", "--tokenizer", dir]).unwrap();
    assert!(c
        .tokenizer
        .as_ref()
        .is_some_and(|t| t.dir().ends_with("tiny-tools")));
    assert!(parse(&["--kind", "vllm", "--model", "m"])
        .unwrap()
        .tokenizer
        .is_none());
    let err = parse(&[
        "--kind",
        "vllm",
        "--model",
        "m",
        "--tokenizer",
        "/nonexistent/tok",
    ])
    .unwrap_err();
    assert!(
        err.contains("--tokenizer") && err.contains("/nonexistent/tok: not a folder"),
        "{err}"
    );
}
