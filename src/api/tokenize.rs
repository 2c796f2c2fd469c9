//! vLLM's tokenizer endpoints, `POST /tokenize` and `POST /detokenize`, routed by `model` and
//! forwarded as they are ([`EnginePath`]). Only vLLM serves them in this shape: TGI's
//! `/tokenize` takes `{"inputs": ...}` and answers a list of token objects (Sluice's own
//! exact count uses it, `fleet::tokenize`, but clients are not sent there), and Ollama has no
//! tokenizer endpoint.

use super::engine::EnginePath;
use super::ClientApi;
use crate::config::BackendKind;

/// `POST /tokenize`.
pub static TOKENIZE: &dyn ClientApi = &EnginePath {
    path: "/tokenize",
    label: "tokenize",
    kinds: &[BackendKind::Vllm],
};

/// `POST /detokenize`.
pub static DETOKENIZE: &dyn ClientApi = &EnginePath {
    path: "/detokenize",
    label: "detokenize",
    kinds: &[BackendKind::Vllm],
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_by_model_and_nothing_else() {
        let f = TOKENIZE
            .parse(br#"{"model":"m","prompt":"hello world"}"#)
            .unwrap();
        assert_eq!((f.model.as_str(), f.stream), ("m", false));
        assert_eq!(f.model_span, 9..12);
        assert_eq!(TOKENIZE.expected_output(&f, 100), 0);
        assert!(f.prompt_tokens_estimate > 0);
        assert!(DETOKENIZE.parse(br#"{"tokens":[1]}"#).is_err());
        assert!(DETOKENIZE.parse(br#"{"model":""}"#).is_err());
        assert!(DETOKENIZE.parse(br#"[1]"#).is_err());
        assert!(TOKENIZE.native(BackendKind::Vllm));
        assert!(!TOKENIZE.native(BackendKind::Tgi));
        assert!(!DETOKENIZE.native(BackendKind::Ollama));
        assert_eq!(
            (DETOKENIZE.path(), DETOKENIZE.label()),
            ("/detokenize", "detokenize")
        );
        let u = TOKENIZE
            .whole_usage(br#"{"count":4,"max_model_len":1024,"tokens":[1,2,3,4]}"#)
            .unwrap();
        assert!(u.is_none());
    }
}
