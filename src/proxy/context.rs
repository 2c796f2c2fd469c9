//! Context length as a routing input: a request whose prompt plus `max_tokens` does not fit a
//! backend's context window is not sent there while a candidate with room serves the model.
//!
//! Context lengths are learned per backend and model (vLLM `/v1/models` `max_model_len`, TGI
//! `/info` `max_total_tokens`, Ollama `/api/ps` `context_length` of the loaded runner); a
//! backend that reported none is assumed to fit. When no candidate fits:
//! - Ollama candidates stay: Ollama truncates a prompt to its window rather than refusing it,
//!   and that is what its users get from it directly;
//! - else, when the request exceeds the largest window — counted exactly (the model's
//!   tokenizer, or a backend's), or estimated at more than twice what would fit — the client
//!   gets vLLM's 400 at once (shaped by its API);
//! - else the candidates with the largest window stay, and the engine, which counts exactly,
//!   decides: an estimate can overshoot by far more than a tight slack (a real prompt of 836
//!   tokens was estimated at over 1,100), and refusing a request that fits is worse than
//!   letting the engine refuse one that does not.

use http::StatusCode;

use crate::config::BackendKind;
use crate::fleet::Resolved;
use crate::openai::ApiError;
use crate::routing::RouteInput;

/// How many times too large a prompt estimate may be before it is refused unsent.
const ESTIMATE_FACTOR: u64 = 2;

/// Keep the candidates whose context fits the request (see the module docs); `Err` is the
/// client's 400 when none can.
pub(super) fn fit(
    resolved: &mut Resolved,
    max_tokens: Option<u64>,
    input: &RouteInput,
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
    let low = if input.prompt_exact {
        input.prompt_tokens
    } else {
        input.prompt_tokens / ESTIMATE_FACTOR
    };
    if low.saturating_add(output) > largest {
        return Err(too_long(largest, input.prompt_tokens, max_tokens));
    }
    resolved
        .candidates
        .retain(|c| window(c).is_some_and(|len| len == largest));
    Ok(())
}

/// vLLM's answer to a request beyond the context window, in its words, its error type and
/// its code (an integer 400 in vLLM's body, a string once normalised for OpenAI clients), so a
/// client sees the same answer whether the engine or the gateway refused. The prompt count is
/// the gateway's estimate (or exact count), hence "about".
fn too_long(len: u64, prompt: u64, max_tokens: Option<u64>) -> ApiError {
    let (message, param) = match max_tokens {
        _ if prompt >= len => (
            format!(
                "This model's maximum context length is {len} tokens. However, your request \
                 has about {prompt} input tokens. Please reduce the length of the input messages."
            ),
            None,
        ),
        Some(m) if m > len => (
            format!(
                "max_tokens={m} cannot be greater than max_model_len={len}. Please request \
                 fewer output tokens."
            ),
            Some("max_tokens"),
        ),
        m => {
            let m = m.unwrap_or(1);
            (
                format!(
                    "'max_tokens' or 'max_completion_tokens' is too large: {m}. This model's \
                     maximum context length is {len} tokens and your request has about {prompt} \
                     input tokens ({m} > {len} - {prompt})."
                ),
                Some("max_tokens"),
            )
        }
    };
    let err = ApiError::new(StatusCode::BAD_REQUEST, "BadRequestError", message).with_code("400");
    match param {
        Some(p) => err.with_param(p),
        None => err,
    }
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
            adapter: None,
        }
    }

    /// A request whose prompt was counted exactly.
    fn request(prompt: u64, max_tokens: Option<u64>) -> (Option<u64>, RouteInput) {
        let input = RouteInput {
            tokens: prompt + max_tokens.unwrap_or(0),
            prefix_hash: None,
            prompt_tokens: prompt,
            prefix_tokens: 0,
            prompt: None,
            prompt_exact: true,
            adapter: None,
            background: false,
        };
        (max_tokens, input)
    }

    /// A request whose prompt was only estimated.
    fn estimated(prompt: u64, max_tokens: Option<u64>) -> (Option<u64>, RouteInput) {
        let (m, mut input) = request(prompt, max_tokens);
        input.prompt_exact = false;
        (m, input)
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
        fit(&mut r, f, &i).unwrap();
        assert_eq!(names(&r), ["big", "unknown"]);
        // Everything fits: nothing is dropped; no max_tokens needs one token of room.
        let mut r = resolved(vec![candidate("small", "vllm", Some(4096))]);
        let (f, i) = request(4095, None);
        fit(&mut r, f, &i).unwrap();
        assert_eq!(names(&r), ["small"]);
        // One token over, counted exactly: refused unsent.
        let (f, i) = request(4096, None);
        assert!(fit(&mut r, f, &i).is_err());
        // Over, but only estimated: the engine, counting exactly, decides (an estimate of a
        // real 836-token prompt came out above 1,100) ...
        let (f, i) = estimated(8000, None);
        fit(&mut r, f, &i).unwrap();
        assert_eq!(names(&r), ["small"]);
        // ... unless even half the estimate does not fit
        let (f, i) = estimated(8200, None);
        assert!(fit(&mut r, f, &i).is_err());
        let (f, i) = request(5000, None);
        let err = fit(&mut r, f, &i).unwrap_err();
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
        let err = fit(&mut r, f, &i).unwrap_err();
        assert_eq!(err.code.as_deref(), Some("400"));
        assert_eq!(err.kind, "BadRequestError");
        assert_eq!(
            err.message,
            "This model's maximum context length is 8192 tokens. However, your request has \
             about 20000 input tokens. Please reduce the length of the input messages."
        );
        // Output beyond the window, and output beyond what the prompt leaves: vLLM's words.
        let (f, i) = request(10, Some(9000));
        let err = fit(&mut r, f, &i).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("max_tokens"));
        let want = "max_tokens=9000 cannot be greater than max_model_len=8192.";
        assert!(err.message.starts_with(want), "{}", err.message);
        let (f, i) = request(4000, Some(6000));
        let err = fit(&mut r, f, &i).unwrap_err();
        let want = "is too large: 6000. This model's maximum context length is 8192 tokens and \
                    your request has about 4000 input tokens (6000 > 8192 - 4000).";
        assert!(err.message.contains(want), "{}", err.message);
        // An estimate beyond the largest window: the engine decides.
        let (f, i) = estimated(8500, Some(10));
        fit(&mut r, f, &i).unwrap();
        assert_eq!(names(&r), ["b"]);
        // Ollama truncates to its window: it stays, the others go.
        let mut r = resolved(vec![
            candidate("a", "vllm", Some(4096)),
            candidate("o", "ollama", Some(2048)),
        ]);
        let (f, i) = request(800_000, Some(10));
        fit(&mut r, f, &i).unwrap();
        assert_eq!(names(&r), ["o"]);
    }
}
