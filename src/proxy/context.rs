//! Context length as a routing input: a request whose prompt plus `max_tokens` does not fit a
//! backend's context window is not sent there while a candidate with room serves the model.
//!
//! Context lengths are learned per backend and model (vLLM `/v1/models` `max_model_len`, TGI
//! `/info` `max_total_tokens`, Ollama `/api/ps` `context_length` of the loaded runner); a
//! backend that reported none is assumed to fit. When no candidate fits:
//! - Ollama candidates stay: Ollama truncates a prompt to its window rather than refusing it,
//!   and that is what its users get from it directly;
//! - else, when the request exceeds the largest window even allowing for the estimate's error,
//!   the client gets vLLM's 400 at once (shaped by its API);
//! - else the candidates with the largest window stay, and the engine, which counts exactly,
//!   decides.

use crate::config::BackendKind;
use crate::fleet::Resolved;
use crate::openai::ApiError;
use crate::routing::RouteInput;

/// Share of the prompt estimate allowed as its error before a request is refused unsent.
const ESTIMATE_SLACK: f64 = 0.1;

/// Keep the candidates whose context fits the request (see the module docs); `Err` is the
/// client's 400 when none can.
pub(super) fn fit(
    resolved: &mut Resolved,
    max_tokens: Option<u64>,
    input: RouteInput,
) -> Result<(), ApiError> {
    let output = max_tokens.unwrap_or(1).max(1);
    let need = input.prompt_tokens.saturating_add(output);
    let window =
        |(b, m): &(std::sync::Arc<crate::fleet::Backend>, String)| b.state.context_length(m);
    let fits = |c: &_| window(c).is_none_or(|len| need <= len);
    if resolved.candidates.iter().all(fits) {
        return Ok(());
    }
    if resolved.candidates.iter().any(fits) {
        resolved.candidates.retain(fits);
        return Ok(());
    }
    if resolved
        .candidates
        .iter()
        .any(|(b, _)| b.kind() == BackendKind::Ollama)
    {
        resolved
            .candidates
            .retain(|(b, _)| b.kind() == BackendKind::Ollama);
        return Ok(());
    }
    let largest = resolved
        .candidates
        .iter()
        .filter_map(window)
        .max()
        .unwrap_or(0);
    let low = (input.prompt_tokens as f64 * (1.0 - ESTIMATE_SLACK)) as u64;
    if low.saturating_add(output) > largest {
        return Err(too_long(largest, input.prompt_tokens, max_tokens));
    }
    resolved
        .candidates
        .retain(|c| window(c).is_some_and(|len| len == largest));
    Ok(())
}

/// vLLM's answer to a request beyond the context window.
fn too_long(len: u64, prompt: u64, max_tokens: Option<u64>) -> ApiError {
    let message = match max_tokens {
        Some(m) => format!(
            "This model's maximum context length is {len} tokens. However, you requested \
             about {} tokens ({prompt} in the messages, {m} in the completion). Please reduce \
             the length of the messages or completion.",
            prompt.saturating_add(m)
        ),
        None => format!(
            "This model's maximum context length is {len} tokens. However, your request has \
             about {prompt} input tokens. Please reduce the length of the input messages."
        ),
    };
    ApiError::bad_request(message)
        .with_param("messages")
        .with_code("context_length_exceeded")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use crate::fleet::{Backend, BackendState};

    fn candidate(name: &str, kind: &str, len: Option<u64>) -> (Arc<Backend>, String) {
        let config = crate::config::from_str(
            &format!("[[backends]]\nname = \"{name}\"\nkind = \"{kind}\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n"),
            "t",
        )
        .unwrap();
        let b = Backend::new(config.backends[0].clone(), Arc::new(BackendState::new()));
        if let Some(len) = len {
            b.state.set_context_lengths([("m".to_string(), len)].into());
        }
        (Arc::new(b), "m".to_string())
    }

    fn resolved(c: Vec<(Arc<Backend>, String)>) -> Resolved {
        Resolved {
            canonical: "m".into(),
            candidates: c,
            policy: None,
        }
    }

    fn request(prompt: u64, max_tokens: Option<u64>) -> (Option<u64>, RouteInput) {
        let input = RouteInput {
            tokens: prompt + max_tokens.unwrap_or(0),
            prefix_hash: None,
            prompt_tokens: prompt,
            prefix_tokens: 0,
        };
        (max_tokens, input)
    }

    fn names(r: &Resolved) -> Vec<&str> {
        r.candidates.iter().map(|(b, _)| b.name()).collect()
    }

    #[test]
    fn only_the_backends_with_room_stay() {
        let mut r = resolved(vec![
            candidate("small", "vllm", Some(4096)),
            candidate("big", "vllm", Some(32768)),
            candidate("unknown", "openai", None),
        ]);
        let (f, i) = request(5000, Some(100));
        fit(&mut r, f, i).unwrap();
        assert_eq!(names(&r), ["big", "unknown"]);
        // Everything fits: nothing is dropped; no max_tokens needs one token of room.
        let mut r = resolved(vec![candidate("small", "vllm", Some(4096))]);
        let (f, i) = request(4095, None);
        fit(&mut r, f, i).unwrap();
        assert_eq!(names(&r), ["small"]);
        // One token over: within the estimate's error, so the engine, counting exactly, decides.
        let (f, i) = request(4096, None);
        fit(&mut r, f, i).unwrap();
        assert_eq!(names(&r), ["small"]);
        let (f, i) = request(5000, None);
        let err = fit(&mut r, f, i).unwrap_err();
        assert_eq!(err.status.as_u16(), 400);
        assert!(
            err.message.contains("has about 5000 input tokens"),
            "{}",
            err.message
        );
    }

    #[test]
    fn none_fits_is_vllms_400_unless_ollama_truncates_or_the_estimate_may_be_wrong() {
        let mut r = resolved(vec![
            candidate("a", "vllm", Some(4096)),
            candidate("b", "tgi", Some(8192)),
        ]);
        let (f, i) = request(20_000, Some(10));
        let err = fit(&mut r, f, i).unwrap_err();
        assert_eq!(err.code.as_deref(), Some("context_length_exceeded"));
        assert!(
            err.message
                .contains("maximum context length is 8192 tokens"),
            "{}",
            err.message
        );
        assert!(err.message.contains("20010"), "{}", err.message);
        // Within the estimate's error of the largest window: the engine decides.
        let (f, i) = request(8500, Some(10));
        fit(&mut r, f, i).unwrap();
        assert_eq!(names(&r), ["b"]);
        // Ollama truncates to its window: it stays, the others go.
        let mut r = resolved(vec![
            candidate("a", "vllm", Some(4096)),
            candidate("o", "ollama", Some(2048)),
        ]);
        let (f, i) = request(800_000, Some(10));
        fit(&mut r, f, i).unwrap();
        assert_eq!(names(&r), ["o"]);
    }
}
