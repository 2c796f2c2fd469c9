//! The pooling models' paths: `POST /v1/rerank`, `POST /rerank` (Jina/Cohere-style rerank) and
//! `POST /v1/score`, routed by `model` to the backends that serve that model and forwarded as
//! they are ([`EnginePath`]). vLLM serves them for pooling (cross-encoder / embedding) models
//! (its OpenAPI lists them only when such a model is loaded); a generic OpenAI-compatible
//! server may too (it answers 404 itself when it does not). TGI and Ollama have no such path.

use super::engine::EnginePath;
use super::ClientApi;
use crate::config::BackendKind;

const KINDS: &[BackendKind] = &[BackendKind::Vllm, BackendKind::OpenAi];

/// `POST /v1/rerank`.
pub static RERANK_V1: &dyn ClientApi = &EnginePath {
    path: "/v1/rerank",
    label: "rerank",
    kinds: KINDS,
};

/// `POST /rerank` (the same API without the version prefix, as vLLM also serves it).
pub static RERANK: &dyn ClientApi = &EnginePath {
    path: "/rerank",
    label: "rerank",
    kinds: KINDS,
};

/// `POST /v1/score`.
pub static SCORE: &dyn ClientApi = &EnginePath {
    path: "/v1/score",
    label: "score",
    kinds: KINDS,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pooling_paths_route_by_model_to_vllm_and_openai_servers() {
        let f = RERANK_V1
            .parse(br#"{"model":"r","query":"q","documents":["a","b"]}"#)
            .unwrap();
        assert_eq!(
            (f.model.as_str(), RERANK_V1.expected_output(&f, 50)),
            ("r", 0)
        );
        assert!(SCORE.parse(br#"{"text_1":"a","text_2":"b"}"#).is_err());
        for api in [RERANK_V1, RERANK, SCORE] {
            assert!(api.native(BackendKind::Vllm) && api.native(BackendKind::OpenAi));
            assert!(!api.native(BackendKind::Tgi) && !api.native(BackendKind::Ollama));
        }
        let whole = br#"{"id":"score-1","object":"list","data":[{"index":0,"score":0.9}],"usage":{"prompt_tokens":7,"total_tokens":7}}"#;
        assert_eq!(SCORE.whole_usage(whole).unwrap().unwrap().prompt_tokens, 7);
    }
}
