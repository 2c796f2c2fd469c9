//! The gateway driven by the official OpenAI Python SDK (tests/python/gateway_openai_sdk.py):
//! chat, streaming with include_usage, completions, embeddings, models, NotFoundError for an
//! unknown model, and an APIError for a stream the backend cut mid-way.
//!
//! The interpreter is `$SLUICE_PYTHON` or `.venv/bin/python` (`.ci/run` creates it with the
//! `openai` package). Without it the test says SKIP and passes, except under CI, where it fails.

use crate::support;

use sluice::sim::{Fault, FaultMode, SimKind};
use support::process::{python_checks, python_with};
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_end_to_end() {
    let Some(python) = python_with(&["openai"]) else {
        return;
    };
    let a = sim(SimKind::Vllm, &["llama-3.1-8b"]).await;
    let b = sim(SimKind::Ollama, &["llama3.1:8b"]).await;
    let cut = sim(SimKind::Vllm, &["cut-model"]).await;
    let mut fault = Fault::mode(FaultMode::DropMidstream);
    fault.after_chunks = 3;
    cut.set_fault(fault).unwrap();
    let mut t = String::from(FAST_HEALTH);
    t.push_str("\n[[models]]\nname = \"llama-3.1-8b\"\naliases = [\"llama3\"]\n");
    t.push_str(&backend("gpu-a", "vllm", &a.url(), &["llama-3.1-8b"]));
    t.push_str(&backend("laptop", "ollama", &b.url(), &["llama-3.1-8b"]));
    t.push_str("model_names = { \"llama-3.1-8b\" = \"llama3.1:8b\" }\n");
    t.push_str(&backend("cutter", "vllm", &cut.url(), &["cut-model"]));
    let g = TestGateway::start_healthy(&t).await;

    let base = g.url("/v1");
    python_checks(
        python,
        "gateway_openai_sdk.py",
        vec![
            ("SLUICE_BASE_URL", base),
            ("SLUICE_MODEL", "llama3".to_string()),
            ("SLUICE_CUT_MODEL", "cut-model".to_string()),
        ],
    )
    .await;
    g.stop().await;
}
