//! Cache-exact routing end to end: vLLM simulators that tokenize with the model's tokenizer and
//! publish their KV-cache events, a gateway with the same tokenizer, and multi-turn sessions.
//! The cached prefix the gateway expects on the backend it chose is what that engine reports,
//! and every turn of a session lands where its history is cached.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use sluice::sim::{spawn, KvEventsConfig, SimConfig, SimHandle, SimKind, Timing};
use sluice::tokenizer::Tokenizer;

use crate::support::kv::kv_caches;
use crate::support::{backend, client, poll, TestGateway, STEADY_HEALTH};

const MODEL: &str = "m";
const BLOCK: u32 = 16;

fn fixture() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer/tiny-tools")
}

fn timing() -> Timing {
    Timing {
        max_num_seqs: 8,
        decode_base: Duration::from_millis(1),
        decode_per_seq: Duration::from_micros(10),
        prefill_per_token: Duration::from_micros(20),
        block_size: BLOCK,
        min_output_tokens: 4,
        max_output_tokens: 8,
        ..Timing::default()
    }
}

async fn engine(tokenizer: &Arc<Tokenizer>) -> SimHandle {
    let events = KvEventsConfig::from_json(
        r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0","topic":"kv"}"#,
    )
    .unwrap();
    spawn(
        SimConfig::new(SimKind::Vllm, vec![MODEL.into()])
            .timing(timing())
            .prompt_tokens_details(true)
            .tokenizer(tokenizer.clone())
            .kv_events_config(events),
    )
    .await
    .unwrap()
}

/// A gateway in front of `sims` with the model's tokenizer; every backend's index live.
async fn gateway(sims: &[SimHandle]) -> TestGateway {
    let mut toml = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n[routing]\nexpose_backend_header = true\n{STEADY_HEALTH}\n[[models]]\nname = \"{MODEL}\"\ntokenizer = \"{}\"\n",
        fixture().display()
    );
    for (i, s) in sims.iter().enumerate() {
        toml.push_str(&backend(&format!("e{i}"), "vllm", &s.url(), &[MODEL]));
    }
    let g = TestGateway::start_healthy(&toml).await;
    let (c, url) = (client(), g.admin_url("/admin/backends"));
    poll(Duration::from_secs(10), "every index live", || async {
        let all = kv_caches(&c, &url).await?;
        all.iter().all(|k| k["status"] == "warm").then_some(())
    })
    .await;
    g
}

/// KV-event batches the gateway applied per backend.
async fn batches(g: &TestGateway) -> Vec<u64> {
    let all = kv_caches(&client(), &g.admin_url("/admin/backends")).await;
    all.unwrap_or_default()
        .iter()
        .map(|k| k["batches"].as_u64().unwrap_or(0))
        .collect()
}

/// One turn: (backend, predicted cached prefix, engine-reported cached tokens, answer).
async fn turn(g: &TestGateway, messages: &Value) -> (String, Option<u64>, u64, String) {
    let r = client()
        .post(g.url("/v1/chat/completions"))
        .json(&json!({"model": MODEL, "messages": messages, "max_tokens": 6}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let header = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let backend = header("x-sluice-backend").unwrap();
    let predicted = header("x-sluice-cached-prefix").and_then(|v| v.parse().ok());
    let v: Value = r.json().await.unwrap();
    let reported = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    (backend, predicted, reported, answer)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_land_where_their_history_is_cached_and_the_gateway_knows_how_much() {
    let tokenizer = Arc::new(Tokenizer::load(&fixture()).unwrap());
    let sims = [
        engine(&tokenizer).await,
        engine(&tokenizer).await,
        engine(&tokenizer).await,
    ];
    let g = gateway(&sims).await;
    let system = "You are the build assistant of a large repository. ".repeat(12);
    let (mut exact, mut total, mut stayed, mut later_turns) = (0, 0, 0, 0);
    for s in 0..6 {
        let mut msgs = vec![json!({"role": "system", "content": system})];
        let mut home: Option<String> = None;
        for t in 0..4 {
            msgs.push(json!({"role": "user", "content": format!("Session {s}, step {t}: run the tests of module {t} and report what failed, with the log lines.")}));
            let before: u64 = batches(&g).await.iter().sum();
            let (backend, predicted, reported, answer) = turn(&g, &json!(msgs)).await;
            // An agent reads the answer before its next turn; by then the engine's event for
            // this turn's new blocks has reached the gateway (each turn adds whole blocks).
            poll(
                Duration::from_secs(10),
                "this turn's blocks indexed",
                || async { (batches(&g).await.iter().sum::<u64>() > before).then_some(()) },
            )
            .await;
            total += 1;
            let predicted = predicted.expect("every backend's index is live");
            exact += usize::from(predicted == reported);
            if t > 0 {
                later_turns += 1;
                stayed += usize::from(home.as_deref() == Some(backend.as_str()));
                assert!(
                    reported > 0,
                    "turn {t} of session {s} found its history cached"
                );
            }
            home = Some(backend);
            msgs.push(json!({"role": "assistant", "content": answer}));
        }
    }
    assert_eq!(
        exact, total,
        "predicted cached prefix = reported, every request"
    );
    assert_eq!(
        stayed, later_turns,
        "every later turn where its history was"
    );
    g.stop().await;
}

/// A gateway without a tokenizer for the model has no token ids to look up: nothing is
/// predicted, though the engine's events are followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_tokenizer_nothing_is_predicted() {
    let tokenizer = Arc::new(Tokenizer::load(&fixture()).unwrap());
    let sims = [engine(&tokenizer).await];
    let toml = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n[routing]\nexpose_backend_header = true\n{STEADY_HEALTH}{}",
        backend("e0", "vllm", &sims[0].url(), &[MODEL])
    );
    let g = TestGateway::start_healthy(&toml).await;
    let msgs = json!([{"role": "user", "content": "hello there, how are you today?"}]);
    let (_, predicted, _, _) = turn(&g, &msgs).await;
    assert_eq!(predicted, None);
    g.stop().await;
}

/// An engine's refusal is passed on naming the backend that gave it, and the cached prefix
/// routing expected there, as its answers are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_refusal_names_its_backend() {
    let tokenizer = Arc::new(Tokenizer::load(&fixture()).unwrap());
    let sims = [engine(&tokenizer).await];
    let g = gateway(&sims).await;
    let r = client()
        .post(g.url("/v1/chat/completions"))
        .json(&json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello there, how are you today?"}],
            "max_tokens": 4,
            "ignore_eos": "not a boolean",
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["x-sluice-backend"], "e0");
    assert_eq!(r.headers()["x-sluice-cached-prefix"], "0");
    g.stop().await;
}
