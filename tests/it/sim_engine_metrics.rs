//! What the simulated engines report about their own timing — vLLM's `/metrics` phase and
//! per-step series, TGI's forward passes, Ollama's eval fields — agrees with the timing model
//! the simulator was started with. Sums are compared with what the model implies, within
//! 25 %; identities between series (inference = prefill + decode, …) are exact. Every wait
//! polls a condition with a deadline.

use std::time::Duration;

use crate::support::poll::poll;
use crate::support::sim::*;
use crate::support::{header, metric};
use serde_json::{json, Value};
use sluice::sim::{SimKind, Timing};

const BASE_MS: f64 = 20.0;
const PER_SEQ_MS: f64 = 2.0;
const PER_TOKEN_US: f64 = 100.0;
/// Tokens in every answer.
const OUT: u32 = 5;

fn timing() -> Timing {
    Timing {
        prefill_per_token: Duration::from_micros(PER_TOKEN_US as u64),
        decode_base: Duration::from_millis(BASE_MS as u64),
        decode_per_seq: Duration::from_millis(PER_SEQ_MS as u64),
        // no whole block of any prompt: nothing is served from the prefix cache
        block_size: 4096,
        ..Timing::default()
    }
}

/// The step that prefills `prompt` tokens for a request running alone, in seconds.
fn prefill_alone(prompt: f64) -> f64 {
    (BASE_MS + PER_SEQ_MS) / 1e3 + PER_TOKEN_US * prompt / 1e6
}

/// The decode steps of a request running alone, in seconds.
fn decode_alone() -> f64 {
    f64::from(OUT - 1) * (BASE_MS + PER_SEQ_MS) / 1e3
}

fn prompt(i: usize, words: usize) -> String {
    format!("request {i}: {}", "the ".repeat(words))
}

fn assert_near(what: &str, got: f64, want: f64) {
    assert!(
        got > want * 0.9 && got < want * 1.25,
        "{what}: got {got}, the timing implies {want}"
    );
}

/// The `/metrics` text once `ready` holds for it.
async fn metrics_when(
    c: &reqwest::Client,
    url: &str,
    what: &str,
    ready: impl Fn(&str) -> bool,
) -> String {
    poll(Duration::from_secs(10), what, || async {
        let m = get_text(c, format!("{url}/metrics")).await;
        ready(&m).then_some(m)
    })
    .await
}

/// One vLLM chat completion; its (prompt, completion) token counts.
async fn vllm_chat(c: &reqwest::Client, url: &str, text: &str) -> (f64, f64) {
    let v: Value = post_for_json(
        c,
        format!("{url}/v1/chat/completions"),
        &json!({"messages":[{"role":"user","content":text}],"max_tokens":50}),
    )
    .await;
    let u = &v["usage"];
    let n = |k: &str| u[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"));
    (n("prompt_tokens"), n("completion_tokens"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_phase_times_follow_the_timing_model() {
    let sim = start(SimKind::Vllm, &["tiny"], |c| {
        c.timing(timing()).output_tokens(OUT, OUT)
    })
    .await;
    let (c, url) = (client(), sim.url());
    let v = |m: &str, k: &str| metric(m, &format!("vllm:{k}{{"));
    let mut prompts = Vec::new();
    let mut implied = 0.0;
    for i in 0..3 {
        let (p, n) = vllm_chat(&c, &url, &prompt(i, 100 + 100 * i)).await;
        assert_eq!(n, f64::from(OUT));
        implied += prefill_alone(p);
        prompts.push(p);
    }
    let m = metrics_when(&c, &url, "3 prefill times", |m| {
        v(m, "request_prefill_time_seconds_count") == 3.0
    })
    .await;
    assert_near(
        "Σ prefill, alone",
        v(&m, "request_prefill_time_seconds_sum"),
        implied,
    );
    let decode = v(&m, "request_decode_time_seconds_sum");
    assert_near("Σ decode, alone", decode, 3.0 * decode_alone());
    let together: Vec<_> = (3..6)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move { vllm_chat(&c, &url, &prompt(i, 150)).await })
        })
        .collect();
    for h in together {
        prompts.push(h.await.unwrap().0);
    }
    let m = metrics_when(&c, &url, "6 finished requests", |m| {
        v(m, "e2e_request_latency_seconds_count") == 6.0
    })
    .await;
    check_vllm_identities(&m, &prompts);
}

/// What must hold between vLLM's series after `prompts.len()` requests of `OUT` tokens each.
fn check_vllm_identities(m: &str, prompts: &[f64]) {
    let v = |k: &str| metric(m, &format!("vllm:{k}{{"));
    let n = prompts.len() as f64;
    let (prompt, generated) = (prompts.iter().sum::<f64>(), n * f64::from(OUT));
    for k in [
        "time_to_first_token_seconds_count",
        "request_queue_time_seconds_count",
        "request_inference_time_seconds_count",
        "request_prefill_time_seconds_count",
        "request_decode_time_seconds_count",
        "request_time_per_output_token_seconds_count",
        "request_prompt_tokens_count",
        "request_generation_tokens_count",
        "request_prefill_kv_computed_tokens_count",
        "request_params_max_tokens_count",
    ] {
        assert_eq!(v(k), n, "{k}");
    }
    let close = |what: &str, a: f64, b: f64| assert!((a - b).abs() < 1e-6, "{what}: {a} vs {b}");
    let (prefill, decode) = (
        v("request_prefill_time_seconds_sum"),
        v("request_decode_time_seconds_sum"),
    );
    close(
        "inference = prefill + decode",
        v("request_inference_time_seconds_sum"),
        prefill + decode,
    );
    close(
        "e2e = queue + inference",
        v("e2e_request_latency_seconds_sum"),
        v("request_queue_time_seconds_sum") + v("request_inference_time_seconds_sum"),
    );
    close(
        "Σ ITL = Σ decode",
        v("inter_token_latency_seconds_sum"),
        decode,
    );
    close(
        "TPOT = decode / (tokens - 1)",
        v("request_time_per_output_token_seconds_sum"),
        decode / f64::from(OUT - 1),
    );
    assert_eq!(v("inter_token_latency_seconds_count"), generated - n);
    assert_eq!(v("prompt_tokens_total"), prompt);
    assert_eq!(v("generation_tokens_total"), generated);
    assert_eq!(v("request_prompt_tokens_sum"), prompt);
    assert_eq!(v("request_generation_tokens_sum"), generated);
    assert_eq!(v("iteration_tokens_total_sum"), prompt + generated);
    let source = |s: &str| {
        metric(m, &format!("vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"tiny\",source=\"{s}\"}}"))
    };
    assert_eq!(source("local_compute"), prompt);
    assert_eq!(source("local_cache_hit"), 0.0);
    assert_eq!(v("prompt_tokens_cached_total"), 0.0);
    assert_eq!(v("request_prefill_kv_computed_tokens_sum"), prompt);
}

/// One TGI `/generate`; its prompt token count.
async fn tgi_generate(c: &reqwest::Client, url: &str, text: &str) -> f64 {
    let r = post_json(
        c,
        format!("{url}/generate"),
        &json!({"inputs":text,"parameters":{"max_new_tokens":50}}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let prompt = header(&r, "x-prompt-tokens").parse().unwrap();
    assert_eq!(header(&r, "x-generated-tokens"), OUT.to_string());
    prompt
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tgi_forward_passes_follow_the_timing_model() {
    let sim = start(SimKind::Tgi, &["m"], |c| {
        c.timing(timing()).output_tokens(OUT, OUT)
    })
    .await;
    let (c, url) = (client(), sim.url());
    let fwd = |m: &str, method: &str, k: &str| {
        metric(
            m,
            &format!("tgi_batch_forward_duration_{k}{{method=\"{method}\"}}"),
        )
    };
    let mut implied = 0.0;
    for i in 0..3 {
        implied += prefill_alone(tgi_generate(&c, &url, &prompt(i, 100 + 100 * i)).await);
    }
    let steps = 3.0 * f64::from(OUT - 1);
    let m = metrics_when(&c, &url, "3 prefills and their decodes", |m| {
        fwd(m, "prefill", "count") == 3.0 && fwd(m, "decode", "count") == steps
    })
    .await;
    // alone, a request's prefill forward is its whole admission step, then it decodes alone
    assert_near("Σ prefill forward", fwd(&m, "prefill", "sum"), implied);
    assert_near(
        "Σ decode forward",
        fwd(&m, "decode", "sum"),
        3.0 * decode_alone(),
    );
    assert_eq!(
        metric(&m, "tgi_batch_inference_count{method=\"prefill\"}"),
        3.0
    );
    assert_eq!(metric(&m, "tgi_batch_next_size_sum "), 3.0);
    let together: Vec<_> = (3..6)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move { tgi_generate(&c, &url, &prompt(i, 150)).await })
        })
        .collect();
    for h in together {
        h.await.unwrap();
    }
    let m = metrics_when(&c, &url, "6 answers", |m| {
        metric(m, "tgi_request_mean_time_per_token_duration_count ") == 6.0
    })
    .await;
    for k in [
        "tgi_request_queue_duration_count ",
        "tgi_request_inference_duration_count ",
        "tgi_request_duration_count ",
        "tgi_request_input_length_count ",
        "tgi_request_generated_tokens_count ",
    ] {
        assert_eq!(metric(&m, k), 6.0, "{k}");
    }
    assert_eq!(metric(&m, "tgi_batch_next_size_sum "), 6.0);
    assert_eq!(
        metric(&m, "tgi_request_generated_tokens_sum "),
        6.0 * f64::from(OUT)
    );
    // every prefill and decode forward of the run: more forwards than steps alone, none lost
    assert!(fwd(&m, "prefill", "count") >= 4.0);
    assert!(fwd(&m, "decode", "count") >= steps + f64::from(OUT - 1));
}

/// One Ollama answer (`/api/chat` or `/api/generate`, not streamed): its final object.
async fn ollama_answer(c: &reqwest::Client, url: &str, chat: bool, text: &str) -> Value {
    let (path, body) = if chat {
        (
            "chat",
            json!({"model":"m","stream":false,"messages":[{"role":"user","content":text}]}),
        )
    } else {
        (
            "generate",
            json!({"model":"m","stream":false,"prompt":text}),
        )
    };
    post_for_json(c, format!("{url}/api/{path}"), &body).await
}

/// Its prompt evaluation and evaluation, checked against the timing of a request running alone.
fn check_ollama_eval(v: &Value) {
    let n = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"));
    assert_eq!(n("eval_count"), f64::from(OUT), "{v}");
    let prompt_eval = n("prompt_eval_duration") / 1e9;
    assert_near(
        "prompt_eval_duration",
        prompt_eval,
        prefill_alone(n("prompt_eval_count")),
    );
    assert_near("eval_duration", n("eval_duration") / 1e9, decode_alone());
    assert!(n("total_duration") >= n("prompt_eval_duration") + n("eval_duration"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_eval_fields_follow_the_timing_model() {
    let sim = start(SimKind::Ollama, &["m"], |c| {
        c.timing(timing())
            .parallel(1)
            .preloaded(true)
            .output_tokens(OUT, OUT)
    })
    .await;
    let (c, url) = (client(), sim.url());
    check_ollama_eval(&ollama_answer(&c, &url, true, &prompt(0, 200)).await);
    check_ollama_eval(&ollama_answer(&c, &url, false, &prompt(1, 300)).await);
    // one slot: the second of two requests waits for the first, and that wait is neither
    // prompt evaluation nor evaluation
    let both: Vec<_> = (2..4)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move { ollama_answer(&c, &url, i == 2, &prompt(i, 200)).await })
        })
        .collect();
    for h in both {
        check_ollama_eval(&h.await.unwrap());
    }
}
