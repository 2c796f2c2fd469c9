//! What routing knows about a request ([`RouteInput`]): its size, its prefix fingerprint and,
//! when the model has a tokenizer and some engine reports its cache, its token ids, so each
//! backend's exact cached prefix can be looked up.

use std::sync::Arc;

use super::score;
use crate::fleet::adapters::Setup;
use crate::fleet::kv::Prompt;
use crate::fleet::Backend;

/// What routing knows about the request.
#[derive(Debug, Clone, Default)]
pub struct RouteInput {
    /// Prompt plus expected output tokens.
    pub tokens: u64,
    pub prefix_hash: Option<u64>,
    /// The prompt's share of `tokens` (the rest is expected output).
    pub prompt_tokens: u64,
    /// Whether `prompt_tokens` was counted by the model's tokenizer (else it is an estimate).
    pub prompt_exact: bool,
    /// The share of `prompt_tokens` that `prefix_hash` stands for (what a backend holding the
    /// prefix in its cache does not prefill again).
    pub prefix_tokens: u64,
    /// The prompt's token ids as the engine will compute them (`None`: no tokenizer, or no
    /// engine of the model reports its cache).
    pub prompt: Option<Arc<Prompt>>,
    /// The LoRA adapter the request names: a backend that must load it first pays for that.
    pub adapter: Option<String>,
    /// Run by the gateway in the background: the slots of other background requests are not
    /// free for it (they are for an interactive request, which they give way to).
    pub background: bool,
}

impl RouteInput {
    /// What the request puts on the backend it is sent to (see [`crate::fleet::LoadGuard`]),
    /// given what that backend holds of its prompt ([`RouteInput::cached_on`]): the prompt
    /// tokens it must still prefill.
    pub fn load_given(&self, cached: Option<u64>) -> crate::fleet::Load {
        let cached = cached.unwrap_or(0);
        crate::fleet::Load::new(
            self.tokens.saturating_sub(cached),
            self.prompt_tokens.saturating_sub(cached),
        )
    }

    /// What the request puts on a backend, its whole prompt counted as prefill.
    pub fn load(&self) -> crate::fleet::Load {
        crate::fleet::Load::new(self.tokens, self.prompt_tokens)
    }

    /// Prompt tokens `b` holds in its cache by its KV events (at most the prompt less one
    /// token: engines recompute the last one); `None` when it reports nothing live or the
    /// request has no token ids.
    pub fn cached_on(&self, b: &Backend) -> Option<u64> {
        let prompt = self.prompt.as_ref()?;
        let cached = b.state.kv().cached_tokens(prompt)?;
        Some(cached.min(self.prompt_tokens.saturating_sub(1)))
    }

    /// The request as `b` sees it without its prefix cached, the requests there that give way
    /// to it left out of its busy.
    pub(super) fn score_request(&self, b: &Backend) -> score::Request {
        score::Request {
            prompt_tokens: self.prompt_tokens.min(self.tokens),
            output_tokens: self.tokens.saturating_sub(self.prompt_tokens),
            setup: Setup::Ready,
            yielding: b.yielding_to(self.background),
        }
    }

    /// The request as `b` sees it: only what it has not cached is prefilled (exact from its
    /// KV events; otherwise the whole prompt), after its adapter is loaded or swapped in.
    pub(super) fn request_on(&self, b: &Backend) -> score::Request {
        self.request_given(b, self.cached_on(b))
    }

    /// [`RouteInput::request_on`] with `b`'s cached prefix already looked up.
    pub(super) fn request_given(&self, b: &Backend, cached: Option<u64>) -> score::Request {
        let cold = self.score_request(b);
        let setup = self
            .adapter
            .as_deref()
            .map_or(Setup::Ready, |a| b.state.adapters().setup(a));
        let cached = cached.unwrap_or(0);
        score::Request {
            prompt_tokens: cold.prompt_tokens - cached.min(cold.prompt_tokens),
            setup,
            ..cold
        }
    }

    /// The request as `b` sees it with its prefix cached: only the rest of the prompt (at
    /// least one token, as engines recompute the last one) is prefilled.
    pub(super) fn warm_request(&self, b: &Backend) -> score::Request {
        let cold = self.score_request(b);
        let prefix = self.prefix_tokens.min(cold.prompt_tokens.saturating_sub(1));
        score::Request {
            prompt_tokens: cold.prompt_tokens - prefix,
            ..cold
        }
    }
}
