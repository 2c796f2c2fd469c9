//! LoRA adapters through the gateway, against vLLM simulators that serve them as vLLM 0.32
//! does (`--enable-lora --max-loras 1`, run-time loading): adapters configured in Sluice and
//! loaded nowhere all answer, loads happen on demand and concurrent requests share one, a
//! loaded adapter keeps its requests where it is held, an unloadable path is a 400 naming the
//! adapter with the engine left healthy, `/v1/models` lists each adapter once with its base,
//! and allow-lists name adapters or `base:*`.

use std::time::Duration;

use serde_json::{json, Value};
use sha2::Digest;
use sluice::sim::{spawn, LoraSettings, SimConfig, SimHandle, SimKind, Timing};

use crate::support::{backend, client, metric, TestGateway, STEADY_HEALTH};

const MODEL: &str = "tiny";
const ADAPTERS: [&str; 4] = ["a0", "a1", "a2", "a3"];

/// A folder that exists wherever the tests run: an adapter by the simulator's rule.
fn adapter_path() -> String {
    env!("CARGO_MANIFEST_DIR").to_string()
}

async fn engine() -> SimHandle {
    let lora = LoraSettings {
        enabled: true,
        max_loras: 1,
        max_cpu_loras: Some(2),
        modules: Vec::new(),
        runtime_updating: true,
        load_time: Duration::from_millis(2),
    };
    let timing = Timing {
        decode_base: Duration::from_millis(2),
        decode_per_seq: Duration::from_micros(10),
        prefill_per_token: Duration::from_micros(1),
        min_output_tokens: 2,
        max_output_tokens: 4,
        ..Timing::default()
    };
    spawn(
        SimConfig::new(SimKind::Vllm, vec![MODEL.into()])
            .timing(timing)
            .lora(lora),
    )
    .await
    .unwrap()
}

/// Two engines, the four adapters and a bad one configured, and two keys: one allowed
/// `tiny:*`, one allowed only `a1`. The engines are named `{test}-0`, `{test}-1` (metrics are
/// process-wide, and the tests run side by side).
async fn gateway(test: &str, sims: &[SimHandle]) -> TestGateway {
    let hash = |k: &str| hex::encode(sha2::Sha256::digest(k.as_bytes()));
    let mut toml = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n[routing]\nexpose_backend_header = true\n{STEADY_HEALTH}\n\
         [[keys]]\nname = \"all\"\nhash = \"sha256:{}\"\nmodels = [\"{MODEL}:*\"]\n\
         [[keys]]\nname = \"one\"\nhash = \"sha256:{}\"\nmodels = [\"a1\"]\n",
        hash("sk-all"),
        hash("sk-one"),
    );
    for name in ADAPTERS {
        toml.push_str(&format!(
            "\n[[adapters]]\nname = \"{name}\"\nbase = \"{MODEL}\"\npath = \"{}\"\n",
            adapter_path()
        ));
    }
    toml.push_str(&format!(
        "\n[[adapters]]\nname = \"broken\"\nbase = \"{MODEL}\"\npath = \"/nonexistent/adapter\"\n"
    ));
    for (i, s) in sims.iter().enumerate() {
        toml.push_str(&backend(&format!("{test}-{i}"), "vllm", &s.url(), &[MODEL]));
        // the engines' one adapter slot, before their metrics tell it
        toml.push_str("max_adapters = 1\n");
    }
    TestGateway::start_healthy(&toml).await
}

/// A chat naming `model` with key `key`: status, the backend that answered, the body.
async fn chat(g: &TestGateway, key: &str, model: &str) -> (u16, Option<String>, Value) {
    let r = client()
        .post(g.url("/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"model": model, "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let backend = r
        .headers()
        .get("x-sluice-backend")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    (status, backend, r.json().await.unwrap_or(Value::Null))
}

/// Sluice's `/v1/models` as key `key` sees it.
async fn models(g: &TestGateway, key: &str) -> Value {
    let r = client().get(g.url("/v1/models")).bearer_auth(key).send();
    r.await.unwrap().json().await.unwrap()
}

/// Loads the gateway made on the test's backends, by outcome.
async fn loads(g: &TestGateway, test: &str, outcome: &str) -> f64 {
    let text = g.metrics_text().await;
    (0..2)
        .map(|i| {
            metric(
                &text,
                &format!(
                    "sluice_adapter_loads_total{{backend=\"{test}-{i}\",outcome=\"{outcome}\"}}"
                ),
            )
        })
        .sum()
}

/// What an engine itself lists as loaded adapters.
async fn engine_adapters(s: &SimHandle) -> Vec<String> {
    let v: Value = client()
        .get(format!("{}/v1/models", s.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| !m["parent"].is_null())
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

#[tokio::test]
async fn adapters_loaded_nowhere_all_answer_and_stay_where_they_are_held() {
    let sims = [engine().await, engine().await];
    let t = "held";
    let g = gateway(t, &sims).await;
    for s in &sims {
        assert!(engine_adapters(s).await.is_empty());
    }
    for name in ADAPTERS {
        let (status, backend, body) = chat(&g, "sk-all", name).await;
        assert_eq!(status, 200, "{name}: {body}");
        assert_eq!(body["model"], name);
        let backend = backend.unwrap();
        // held now: the next request for it goes where it is, and loads nothing more
        let before = loads(&g, t, "loaded").await;
        let (status, again, _) = chat(&g, "sk-all", name).await;
        assert_eq!(status, 200);
        assert_eq!(again.as_deref(), Some(backend.as_str()), "{name}");
        assert_eq!(loads(&g, t, "loaded").await, before);
    }
    assert_eq!(loads(&g, t, "loaded").await, 4.0);
    // each engine's budget is one adapter: the least recently used went to make room
    let mut held = 0;
    for s in &sims {
        let on = engine_adapters(s).await;
        assert!(on.len() <= 1, "{on:?}");
        held += on.len();
    }
    let text = g.metrics_text().await;
    let unloads: f64 = (0..2)
        .map(|i| {
            metric(
                &text,
                &format!("sluice_adapter_unloads_total{{backend=\"{t}-{i}\"}}"),
            )
        })
        .sum();
    assert_eq!(unloads, 4.0 - held as f64);
}

#[tokio::test]
async fn concurrent_requests_for_a_missing_adapter_share_one_load() {
    let sims = [engine().await, engine().await];
    let t = "shared";
    let g = gateway(t, &sims).await;
    let answers = futures_util::future::join_all((0..8).map(|_| chat(&g, "sk-all", "a2"))).await;
    for (status, _, body) in &answers {
        assert_eq!(*status, 200, "{body}");
    }
    // routing prices the load, so the first request's engine is where the rest go; a second
    // load may happen only on the other engine, never twice on one
    let loaded = loads(&g, t, "loaded").await;
    assert!((1.0..=2.0).contains(&loaded), "{loaded} loads");
    let held: usize = {
        let mut n = 0;
        for s in &sims {
            n += engine_adapters(s)
                .await
                .iter()
                .filter(|a| *a == "a2")
                .count();
        }
        n
    };
    assert_eq!(held as f64, loaded);
}

#[tokio::test]
async fn an_adapter_that_cannot_load_is_a_400_naming_it_and_the_engine_stays_healthy() {
    let sims = [engine().await, engine().await];
    let t = "refused";
    let g = gateway(t, &sims).await;
    let (status, _, body) = chat(&g, "sk-all", "broken").await;
    assert_eq!(status, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("`broken`"), "{message}");
    assert!(message.contains("No adapter found"), "{message}");
    assert_eq!(body["error"]["code"], "adapter_load_failed");
    assert_eq!(
        loads(&g, t, "refused").await,
        1.0,
        "tried once, not on every engine"
    );
    for i in 0..2 {
        assert_eq!(g.backend_state(&format!("{t}-{i}")), "healthy");
    }
    // and the engines still serve
    let (status, _, _) = chat(&g, "sk-all", "a0").await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn models_list_each_adapter_once_with_its_base_and_allow_lists_name_them() {
    let sims = [engine().await, engine().await];
    let t = "listed";
    let g = gateway(t, &sims).await;
    let (status, _, _) = chat(&g, "sk-all", "a0").await;
    assert_eq!(status, 200);
    let list = models(&g, "sk-all").await;
    let data = list["data"].as_array().unwrap();
    for name in ADAPTERS.iter().chain(["broken"].iter()) {
        let entries: Vec<&Value> = data.iter().filter(|m| m["id"] == *name).collect();
        assert_eq!(entries.len(), 1, "{name} in {list}");
        assert_eq!(entries[0]["parent"], MODEL);
    }
    let base = data.iter().find(|m| m["id"] == MODEL).unwrap();
    assert!(base.get("parent").is_none());
    // the join from an adapter's per-model series to its base
    let text = g.metrics_text().await;
    for name in ADAPTERS {
        let series = format!("sluice_adapter_info{{adapter=\"{name}\",base=\"{MODEL}\"}}");
        assert_eq!(metric(&text, &series), 1.0, "{series}");
    }

    // a key allowed only a1: a1 answers, a0 and the base are refused, and its list shows a1
    let (status, _, _) = chat(&g, "sk-one", "a1").await;
    assert_eq!(status, 200);
    for other in ["a0", MODEL] {
        let (status, _, body) = chat(&g, "sk-one", other).await;
        assert_eq!(status, 403, "{other}: {body}");
    }
    let list = models(&g, "sk-one").await;
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["a1"]);
    // a name that is neither the base nor one of its adapters is outside `tiny:*`
    let (status, _, _) = chat(&g, "sk-all", "nowhere").await;
    assert_eq!(status, 403);
}

/// TGI's adapters are the ones it was started with (`lora_adapters` on the backend, as TGI
/// lists none): a request for one goes to that TGI; a configured adapter TGI was not started
/// with never goes there (TGI would answer it with its base model), it is loaded on vLLM.
#[tokio::test]
async fn tgi_serves_the_adapters_it_was_started_with_and_no_others() {
    let t = "tgi";
    let vllm = engine().await;
    let tgi = spawn(
        SimConfig::new(SimKind::Tgi, vec![MODEL.into()])
            .speed(50.0)
            .tgi_lora_adapters(vec!["t0".into()]),
    )
    .await
    .unwrap();
    let toml = format!(
        "[routing]\nexpose_backend_header = true\n{STEADY_HEALTH}\n\
         [[adapters]]\nname = \"a0\"\nbase = \"{MODEL}\"\npath = \"{}\"\n{}{}lora_adapters = [\"t0\"]\n",
        adapter_path(),
        backend(&format!("{t}-0"), "vllm", &vllm.url(), &[MODEL]),
        backend(&format!("{t}-1"), "tgi", &tgi.url(), &[MODEL]),
    );
    let g = TestGateway::start_healthy(&toml).await;
    for _ in 0..4 {
        let (status, backend, body) = chat(&g, "", "t0").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(backend.as_deref(), Some("tgi-1"));
        assert_eq!(body["model"], "t0");
        let (status, backend, body) = chat(&g, "", "a0").await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(backend.as_deref(), Some("tgi-0"));
    }
}
