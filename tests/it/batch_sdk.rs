//! The Files and Batches APIs driven by the official OpenAI Python SDK
//! (tests/python/gateway_batch_sdk.py): upload, list, content, create, poll, output and error
//! files, an embeddings batch, cancel, pagination, delete, and the SDK's errors for a wrong
//! purpose, an endpoint not allowed and an unknown file.
//!
//! The interpreter is `$SLUICE_PYTHON` or `.venv/bin/python`; without it the test says SKIP
//! and passes, except under CI, where it fails.

use crate::support;

use sluice::sim::{SimConfig, SimKind};
use support::process::{python_checks, python_with};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_files_and_batches() {
    let Some(python) = python_with(&["openai"]) else {
        return;
    };
    let fast = sim(SimKind::Vllm, &["m"]).await;
    let slow = sim_with(SimConfig::new(SimKind::Vllm, vec!["slow".into()]).speed(1.0)).await;
    let dir = tempfile::tempdir().unwrap();
    let t = format!(
        "{FAST_HEALTH}{}{}\n[batch]\ndir = \"{}\"\nmax_in_flight = 2\n",
        backend("fast", "vllm", &fast.url(), &["m"]),
        backend("slow", "vllm", &slow.url(), &["slow"]),
        dir.path().display()
    );
    let g = TestGateway::start_healthy(&t).await;
    python_checks(
        python,
        "gateway_batch_sdk.py",
        vec![
            ("SLUICE_BASE_URL", g.url("/v1")),
            ("SLUICE_MODEL", "m".to_string()),
            ("SLUICE_SLOW_MODEL", "slow".to_string()),
        ],
    )
    .await;
    g.stop().await;
}
