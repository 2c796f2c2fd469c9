//! vLLM's scoring paths for cross-encoder (pooling) models: `POST /v1/rerank` and `/rerank`
//! (Jina/Cohere style), `POST /v1/score` and `/score` (pairs `text_1` × `text_2`).
//!
//! Invariants:
//! - Bodies follow vLLM's protocol models: rerank `{id, model, usage: {prompt_tokens,
//!   total_tokens}, results: [{index, document: {text, multi_modal}, relevance_score}]}`, best
//!   first, cut to `top_n` when it is above 0; score `{id, object: "list", created, model,
//!   data: [{index, object: "score", score}], usage}` in input order.
//! - A score is deterministic in (query, document) and in [0, 1); a pair's tokens are the
//!   simulator's tokenizer's count of both texts, summed into `prompt_tokens`.
//! - Checks in vLLM's order: the body (pydantic: `query`/`documents`, `text_1`/`text_2`
//!   required), then the model (404). The simulator serves these paths for whatever model it
//!   is configured with: it does not model vLLM's per-task route registration (vLLM adds them
//!   only when it loads a pooling model).

#![allow(clippy::result_large_err)]

use std::sync::Arc;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::Value;

use super::openai_surface::js;
use super::server::{json, Sim, SimBody};
use super::text;
use super::vllm::{self, JSON};

#[derive(Deserialize)]
struct RerankRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    query: Option<Value>,
    #[serde(default)]
    documents: Option<Value>,
    #[serde(default)]
    top_n: Option<i64>,
}

#[derive(Deserialize)]
struct ScoreRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    text_1: Option<Value>,
    #[serde(default)]
    text_2: Option<Value>,
}

/// The texts of a string or a list of strings.
fn texts(v: &Value) -> Vec<String> {
    match v {
        Value::Array(items) => items
            .iter()
            .map(|i| {
                i.as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| i.to_string())
            })
            .collect(),
        Value::String(s) => vec![s.clone()],
        other => vec![other.to_string()],
    }
}

/// A deterministic relevance in [0, 1) and the pair's token count.
fn score(query: &str, doc: &str) -> (f64, u32) {
    let h = text::fnv1a(format!("{query}\u{0}{doc}").as_bytes());
    let s = (h >> 11) as f64 / (1u64 << 53) as f64;
    let tokens = text::count_tokens(query) + text::count_tokens(doc);
    (s, tokens as u32)
}

fn uuid_hex() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// `POST /v1/rerank`, `/rerank`.
pub(super) async fn rerank(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let (body, r) = match vllm::read_request::<RerankRequest>(req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let (Some(query), Some(docs)) = (&r.query, &r.documents) else {
        let field = if r.query.is_none() {
            "query"
        } else {
            "documents"
        };
        return vllm::missing(&body, field);
    };
    if let Some(resp) = vllm::check_model(sim, r.model.as_deref()) {
        return resp;
    }
    if let Some(resp) = vllm::inference_fault(sim) {
        return resp;
    }
    let query = texts(query).concat();
    let docs = texts(docs);
    let mut scored: Vec<(usize, f64, &str)> = Vec::new();
    let mut tokens = 0;
    for (i, d) in docs.iter().enumerate() {
        let (s, t) = score(&query, d);
        tokens += t;
        scored.push((i, s, d));
    }
    scored.sort_by(|a, b| b.1.total_cmp(&a.1));
    if let Some(n) = r.top_n.filter(|n| *n > 0) {
        scored.truncate(n as usize);
    }
    let results: Vec<String> = scored
        .iter()
        .map(|(i, s, d)| {
            format!(
                "{{\"index\":{i},\"document\":{{\"text\":{},\"multi_modal\":null}},\"relevance_score\":{s}}}",
                js(d)
            )
        })
        .collect();
    json(
        StatusCode::OK,
        JSON,
        format!(
            "{{\"id\":\"rerank-{}\",\"model\":{},\"usage\":{{\"prompt_tokens\":{tokens},\"total_tokens\":{tokens}}},\"results\":[{}]}}",
            uuid_hex(),
            js(&sim.config.models[0]),
            results.join(",")
        ),
    )
}

/// `POST /v1/score`, `/score`: one `text_1` against each `text_2`, or pairwise when both are
/// lists of the same length.
pub(super) async fn score_pairs(sim: &Arc<Sim>, req: Request<Incoming>) -> Response<SimBody> {
    let (body, r) = match vllm::read_request::<ScoreRequest>(req).await {
        Ok(x) => x,
        Err(resp) => return resp,
    };
    let (Some(t1), Some(t2)) = (&r.text_1, &r.text_2) else {
        let field = if r.text_1.is_none() {
            "text_1"
        } else {
            "text_2"
        };
        return vllm::missing(&body, field);
    };
    if let Some(resp) = vllm::check_model(sim, r.model.as_deref()) {
        return resp;
    }
    let (left, right) = (texts(t1), texts(t2));
    if left.len() != 1 && left.len() != right.len() {
        return vllm::error(
            StatusCode::BAD_REQUEST,
            "text_1 and text_2 lists must have the same length",
            "BadRequestError",
            None,
        );
    }
    if let Some(resp) = vllm::inference_fault(sim) {
        return resp;
    }
    let mut data = Vec::new();
    let mut tokens = 0;
    for (i, d) in right.iter().enumerate() {
        let q = if left.len() == 1 { &left[0] } else { &left[i] };
        let (s, t) = score(q, d);
        tokens += t;
        data.push(format!(
            "{{\"index\":{i},\"object\":\"score\",\"score\":{s}}}"
        ));
    }
    json(
        StatusCode::OK,
        JSON,
        format!(
            "{{\"id\":\"score-{}\",\"object\":\"list\",\"created\":{},\"model\":{},\"data\":[{}],\"usage\":{{\"prompt_tokens\":{tokens},\"total_tokens\":{tokens},\"completion_tokens\":0,\"prompt_tokens_details\":null}}}}",
            uuid_hex(),
            super::unix_now(),
            js(&sim.config.models[0]),
            data.join(",")
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_are_deterministic_and_in_range() {
        let (a, t) = score("what is the sky", "the sky is blue");
        assert_eq!(score("what is the sky", "the sky is blue").0, a);
        assert!((0.0..1.0).contains(&a));
        assert!(t > 0);
        assert_ne!(score("q", "a").0, score("q", "b").0);
    }
}
