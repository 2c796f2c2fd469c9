//! Official Python clients (`openai`, `anthropic`, `ollama`, `text-generation`) as oracles
//! against the three personalities (vLLM also through its Responses and Messages APIs): runs
//! tests/python/sim_oracles.py with the interpreter at `SLUICE_PYTHON` or `./.venv/bin/python`.
//! Without an interpreter or the packages it prints a SKIP line and
//! passes, unless `CI` is set, in which case it fails.

use std::time::Duration;

use crate::support::process::{python_script, python_with};
use sluice::sim::{spawn, SimConfig, SimKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_clients_accept_the_simulators() {
    let Some(py) = python_with(&["openai", "anthropic", "ollama", "text_generation"]) else {
        return;
    };
    let vllm = spawn(SimConfig::new(SimKind::Vllm, vec!["tiny".into()]).speed(50.0))
        .await
        .unwrap();
    // the Responses store on, at real speed: a background response is still running when the
    // client cancels it
    let vllm_store = spawn(
        SimConfig::new(SimKind::Vllm, vec!["tiny".into()])
            .responses_store(true)
            .output_tokens(16, 64),
    )
    .await
    .unwrap();
    let tgi = spawn(SimConfig::new(SimKind::Tgi, vec!["bigscience/bloom-560m".into()]).speed(50.0))
        .await
        .unwrap();
    let ollama = spawn(
        SimConfig::new(SimKind::Ollama, vec!["llama3.2".into()])
            .speed(50.0)
            .load_time(Duration::from_millis(200)),
    )
    .await
    .unwrap();
    let script = python_script("sim_oracles.py");
    let run = tokio::process::Command::new(&py)
        .arg(&script)
        .env("SIM_VLLM_URL", vllm.url())
        .env("SIM_VLLM_STORE_URL", vllm_store.url())
        .env("SIM_TGI_URL", tgi.url())
        .env("SIM_OLLAMA_URL", ollama.url())
        .env("NO_PROXY", "127.0.0.1,localhost")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("oracle script timed out")
        .expect("run oracle script");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    assert!(
        out.status.success() && stdout.contains("ALL ORACLE CHECKS PASSED"),
        "oracle checks failed:\n{stdout}\n{stderr}"
    );
}
