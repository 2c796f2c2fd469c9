//! LoRA adapters on the simulators, checked against a real vLLM 0.32's answers
//! (`tests/fixtures/vllm-0.32.0/lora/`): loading and unloading at run time with its errors,
//! `/v1/models` parents, requests naming an adapter, two adapters competing for one GPU slot,
//! KV events and prefix-cache hits kept apart per adapter, and TGI's `adapter_id`.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice::kvevents::{Event, ExtraKey};
use sluice::sim::{spawn, KvEventsConfig, LoraSettings, SimConfig, SimHandle, SimKind, Timing};

use crate::support::kv::{next_within, sources, subscriber};
use crate::support::poll::{eventually, poll};
use crate::support::sim::{fixture_body, keys};

/// A captured body as the engine sent it (the file ends with a newline the body has not).
fn captured(name: &str) -> String {
    fixture_body(name).trim_end_matches('\n').to_string()
}
use crate::support::{client, get_text, metric};

/// The capture's served name, so its error texts match word for word.
const MODEL: &str = "tiny";
const WITHIN: Duration = Duration::from_secs(10);

/// A path that exists wherever the tests run: an adapter by the simulator's rule.
fn adapter_path() -> String {
    env!("CARGO_MANIFEST_DIR").to_string()
}

fn lora(modules: &[&str], runtime: bool) -> LoraSettings {
    LoraSettings {
        enabled: true,
        max_loras: 1,
        max_cpu_loras: Some(2),
        modules: modules
            .iter()
            .map(|m| (m.to_string(), adapter_path()))
            .collect(),
        runtime_updating: runtime,
        load_time: Duration::from_millis(1),
    }
}

/// Steps of 2 ms, 16-token blocks.
fn timing() -> Timing {
    Timing {
        decode_base: Duration::from_millis(2),
        decode_per_seq: Duration::from_micros(10),
        prefill_per_token: Duration::from_micros(1),
        block_size: 16,
        min_output_tokens: 2,
        max_output_tokens: 4,
        ..Timing::default()
    }
}

async fn vllm(settings: LoraSettings) -> SimHandle {
    let c = SimConfig::new(SimKind::Vllm, vec![MODEL.into()])
        .timing(timing())
        .lora(settings);
    spawn(c).await.unwrap()
}

async fn post(url: &str, path: &str, body: Value) -> (u16, Option<String>, String) {
    let r = client()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let ct = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap_or_default().to_string());
    (status, ct, r.text().await.unwrap())
}

async fn chat(url: &str, model: &str, content: &str, max_tokens: u32) -> (u16, Value) {
    let body = json!({"model": model, "max_tokens": max_tokens, "ignore_eos": true,
        "messages": [{"role": "user", "content": content}]});
    let (status, _, text) = post(url, "/v1/chat/completions", body).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

#[tokio::test]
async fn load_and_unload_answer_as_vllm_does() {
    let sim = vllm(lora(&["a0"], true)).await;
    let url = sim.url();
    let load = |name: &str, path: &str| json!({"lora_name": name, "lora_path": path});

    let (s, ct, body) = post(&url, "/v1/load_lora_adapter", load("a1", &adapter_path())).await;
    assert_eq!(
        (s, ct, body.as_str()),
        (200, None, "Success: LoRA adapter 'a1' added successfully.")
    );

    let (s, _, body) = post(&url, "/v1/load_lora_adapter", load("a0", &adapter_path())).await;
    assert_eq!(s, 400);
    assert_eq!(body, captured("lora/load-again.http"));

    let (s, _, body) = post(
        &url,
        "/v1/load_lora_adapter",
        load("bad", "/nonexistent/adapter"),
    )
    .await;
    assert_eq!(s, 404);
    assert_eq!(body, captured("lora/load-bad-path.http"));

    let (s, _, body) = post(&url, "/v1/load_lora_adapter", json!({"lora_name": "x"})).await;
    assert_eq!(s, 400);
    assert!(
        body.contains("'loc': 'body.lora_path', 'msg': 'Field required'"),
        "{body}"
    );

    let (s, _, body) = post(&url, "/v1/load_lora_adapter", load(MODEL, &adapter_path())).await;
    assert_eq!(s, 400);
    assert!(
        body.contains("conflicts with a served base model"),
        "{body}"
    );

    let (s, ct, body) = post(&url, "/v1/unload_lora_adapter", json!({"lora_name": "a1"})).await;
    assert_eq!((s, ct), (200, None));
    assert_eq!(body, captured("lora/unload.http"));

    let (s, _, body) = post(&url, "/v1/unload_lora_adapter", json!({"lora_name": "a1"})).await;
    assert_eq!(s, 404);
    assert_eq!(body, captured("lora/unload-unknown.http"));

    // an unloaded adapter is an unknown model
    let body =
        json!({"model": "a1", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let (s, _, text) = post(&url, "/v1/chat/completions", body).await;
    assert_eq!(s, 404);
    assert_eq!(text, captured("lora/chat-unloaded-adapter.http"));
}

#[tokio::test]
async fn without_runtime_updating_the_routes_do_not_exist() {
    let sim = vllm(lora(&["a0"], false)).await;
    let body = json!({"lora_name": "a1", "lora_path": adapter_path()});
    let (s, _, text) = post(&sim.url(), "/v1/load_lora_adapter", body).await;
    assert_eq!((s, text.as_str()), (404, "{\"detail\":\"Not Found\"}"));
    let (s, _, _) = post(
        &sim.url(),
        "/v1/unload_lora_adapter",
        json!({"lora_name": "a0"}),
    )
    .await;
    assert_eq!(s, 404);
}

#[tokio::test]
async fn models_list_adapters_as_children_of_the_base_model() {
    let sim = vllm(lora(&["a0", "a1"], true)).await;
    let text = client()
        .get(format!("{}/v1/models", sim.url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let captured = captured("lora/models-with-adapters.http");
    assert_eq!(keys(&text), keys(&captured));
    let v: Value = serde_json::from_str(&text).unwrap();
    let data = v["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(ids, [MODEL, "a0", "a1"]);
    assert_eq!(data[0]["parent"], Value::Null);
    for m in &data[1..] {
        assert_eq!(m["parent"], MODEL);
        assert_eq!(m["root"], adapter_path().as_str());
        assert_eq!(m["max_model_len"], Value::Null);
    }
}

#[tokio::test]
async fn a_request_naming_an_adapter_is_served_under_its_name() {
    let sim = vllm(lora(&["a1"], true)).await;
    let body =
        json!({"model": "a1", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    let (s, _, text) = post(&sim.url(), "/v1/chat/completions", body).await;
    assert_eq!(s, 200);
    assert_eq!(keys(&text), keys(&captured("lora/chat-adapter.http")));
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["model"], "a1");
    assert!(v["usage"]["completion_tokens"].as_u64() <= Some(4));
    // the adapter's weights are not the base model's: another answer to the same prompt
    let (_, base) = chat(&sim.url(), MODEL, "hi", 4).await;
    let (_, adapted) = chat(&sim.url(), "a1", "hi", 4).await;
    let content = |v: &Value| v["choices"][0]["message"]["content"].clone();
    assert_ne!(content(&base), content(&adapted));
}

/// The latest `lora_requests_info` series' adapters (vLLM writes the same in both labels).
fn lora_state(metrics: &str) -> Option<String> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("vllm:lora_requests_info{"))
        .filter_map(|l| {
            let (labels, value) = l.rsplit_once("} ")?;
            let running = labels
                .split("running_lora_adapters=\"")
                .nth(1)?
                .split('"')
                .next()?;
            Some((value.parse::<f64>().ok()?, running.to_string()))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, running)| running)
}

async fn metrics(url: &str) -> String {
    get_text(&client(), format!("{url}/metrics")).await
}

#[tokio::test]
async fn a_second_adapter_waits_for_the_only_slot_while_the_base_model_runs() {
    let sim = vllm(lora(&["a0", "a1"], true)).await;
    let url = sim.url();
    // no series before the first step, as in vLLM
    assert_eq!(lora_state(&metrics(&url).await), None);
    // a0 holds the one slot for ~400 steps of 2 ms
    let long = tokio::spawn({
        let url = url.clone();
        async move { (chat(&url, "a0", "a long story", 400).await, Instant::now()) }
    });
    eventually(WITHIN, "a0 running", || async {
        lora_state(&metrics(&url).await).as_deref() == Some("a0")
    })
    .await;
    let waiting = tokio::spawn({
        let url = url.clone();
        async move { (chat(&url, "a1", "a short one", 4).await, Instant::now()) }
    });
    let base = chat(&url, MODEL, "the base model needs no slot", 4).await;
    assert_eq!(base.0, 200);
    let m = poll(WITHIN, "a1 deferred", || async {
        let m = metrics(&url).await;
        let deferred = r#"vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="deferred"}"#;
        (metric(&m, deferred) == 1.0).then_some(m)
    })
    .await;
    assert_eq!(metric(&m, "vllm:num_requests_waiting{"), 1.0);
    // vLLM names an adapter only once its request has produced output
    assert_eq!(lora_state(&m).as_deref(), Some("a0"));
    assert!(!long.is_finished(), "a0 still holds the slot");

    let ((a0, _), a0_done) = long.await.unwrap();
    let ((a1, _), a1_done) = waiting.await.unwrap();
    assert_eq!((a0, a1), (200, 200));
    assert!(a1_done >= a0_done, "a1 ran after a0");
    eventually(WITHIN, "a1 seen running, then idle", || async {
        let m = metrics(&url).await;
        m.contains(r#"running_lora_adapters="a1",waiting_lora_adapters="a1""#)
            && metric(&m, "vllm:num_requests_waiting{") == 0.0
    })
    .await;
}

#[tokio::test]
async fn swapping_an_adapter_into_a_slot_costs_the_load_time() {
    let mut settings = lora(&["a0"], true);
    settings.load_time = Duration::from_millis(300);
    let sim = vllm(settings).await;
    let started = Instant::now();
    assert_eq!(chat(&sim.url(), "a0", "hi", 2).await.0, 200);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn adapters_blocks_are_published_under_their_name_and_never_hit_for_another() {
    let kv = KvEventsConfig::from_json(
        r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","topic":"kv"}"#,
    )
    .unwrap();
    let c = SimConfig::new(SimKind::Vllm, vec![MODEL.into()])
        .timing(timing())
        .prompt_tokens_details(true)
        .kv_events_config(kv)
        .lora(lora(&["a0"], true));
    let sim = spawn(c).await.unwrap();
    let url = sim.url();
    let (ep, _, _) = sources(&client(), &url).await;
    let mut sub = subscriber(&ep, "kv").await;
    let prompt = "the same long question about the sea and the sky, asked twice over by two \
                  models, once by the base model and twice under an adapter, long enough for \
                  several whole blocks of the prefix cache";
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();

    let (_, base) = chat(&url, MODEL, prompt, 2).await;
    assert_eq!(cached(&base), Some(0));
    let (_, first) = chat(&url, "a0", prompt, 2).await;
    assert_eq!(
        cached(&first),
        Some(0),
        "the base model's blocks are no hit for a0"
    );
    let (_, second) = chat(&url, "a0", prompt, 2).await;
    assert!(cached(&second) > Some(0), "a0's own blocks are: {second}");

    let mut stored = Vec::new();
    while stored.len() < 2 {
        let Some(p) = next_within(&mut sub, WITHIN).await else {
            panic!("two stores expected, got {stored:?}");
        };
        for e in p.batch.events {
            if let Event::BlockStored(s) = e {
                stored.push(s);
            }
        }
    }
    assert_eq!(
        (stored[0].lora_name.as_deref(), stored[0].lora_id),
        (None, None)
    );
    assert!(stored[0].extra_keys.iter().flatten().all(Option::is_none));
    assert_eq!(
        (stored[1].lora_name.as_deref(), stored[1].lora_id),
        (Some("a0"), Some(1))
    );
    let keys = stored[1].extra_keys.clone().unwrap_or_default();
    assert_eq!(keys.len(), stored[1].block_hashes.len());
    assert!(keys.iter().all(|k| matches!(k, Some(ExtraKey::Fold(_)))));
    assert!(stored[1]
        .block_hashes
        .iter()
        .all(|h| !stored[0].block_hashes.contains(h)));
}

#[tokio::test]
async fn tgi_serves_its_adapters_by_adapter_id_and_model() {
    let c = SimConfig::new(SimKind::Tgi, vec![MODEL.into()])
        .speed(0.0)
        .tgi_lora_adapters(vec!["a".into()]);
    let sim = spawn(c).await.unwrap();
    let url = sim.url();
    let generate = |adapter: Option<&str>| {
        let mut params = json!({"max_new_tokens": 6, "seed": 7});
        if let Some(a) = adapter {
            params["adapter_id"] = a.into();
        }
        let url = url.clone();
        async move {
            let (s, _, text) = post(
                &url,
                "/generate",
                json!({"inputs": "hi", "parameters": params}),
            )
            .await;
            assert_eq!(s, 200, "{text}");
            serde_json::from_str::<Value>(&text).unwrap()["generated_text"].clone()
        }
    };
    let base = generate(None).await;
    assert_ne!(generate(Some("a")).await, base, "the adapter answers");
    // TGI does not refuse an adapter it was not started with: the base model answers
    assert_eq!(generate(Some("zz")).await, base);

    let chat = |model: &'static str| {
        let url = url.clone();
        async move {
            let body = json!({"model": model, "max_tokens": 6, "seed": 7,
                "messages": [{"role": "user", "content": "hi"}]});
            let (s, _, text) = post(&url, "/v1/chat/completions", body).await;
            assert_eq!(s, 200, "{text}");
            serde_json::from_str::<Value>(&text).unwrap()
        }
    };
    let (base, adapted) = (chat("tgi").await, chat("a").await);
    assert_eq!(adapted["model"], "a");
    assert_ne!(
        adapted["choices"][0]["message"]["content"],
        base["choices"][0]["message"]["content"]
    );
    // /info lists no adapters, as TGI's does not
    let info = get_text(&client(), format!("{url}/info")).await;
    assert!(!info.contains("adapter"), "{info}");
}
