//! The OpenAI-compatible surface shared by the three personalities: the request fields the
//! simulator reads, and the response bodies and stream chunks with each engine's quirks.
//!
//! Quirks kept (see the per-engine modules for the sources):
//! - vLLM: ids `chatcmpl-<16 hex>` / `cmpl-<16 hex>`, usage fields in the order
//!   `prompt_tokens, total_tokens, completion_tokens`, many explicit nulls, `system_fingerprint`
//!   on the last chunk (or on the usage chunk), no `usage` on ordinary chunks, `data: ` framing.
//! - TGI: `id: ""`, the requested `model` echoed, `system_fingerprint "<version>-native"`,
//!   every delta carries `role`, `usage: null` on every chunk, `data:` framing without a space.
//! - Ollama: ids `chatcmpl-<0..998>`, `system_fingerprint "fp_ollama"`, a separate finish chunk
//!   with an empty delta, the usage chunk repeats it with `choices: []`, no `usage` otherwise.
//!
//! Invariant: every string that comes from the request or the configuration is JSON-escaped
//! ([`js`]); generated text is made of plain ASCII words and needs no escaping.

use serde::Deserialize;

use super::gen::CacheUse;
use super::text::{Finish, Render};

/// JSON string literal of `s`.
pub(crate) fn js(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_string())
}

/// `stream_options`.
#[derive(Deserialize, Default, Debug)]
pub(crate) struct StreamOptions {
    pub include_usage: Option<bool>,
}

impl StreamOptions {
    /// Whether a request streams and whether it asks for a usage chunk, both off unless set
    /// (TGI and Ollama; vLLM reads `stream_options` its own way).
    pub(crate) fn flags(stream: Option<bool>, options: &Option<StreamOptions>) -> (bool, bool) {
        let usage = options.as_ref().and_then(|o| o.include_usage);
        (stream.unwrap_or(false), usage.unwrap_or(false))
    }
}

/// Message content: a string or a list of parts.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<Part>),
}

/// One content part (only text is read).
#[derive(Deserialize, Debug)]
pub(crate) struct Part {
    #[serde(default)]
    pub text: Option<String>,
}

/// One chat message.
#[derive(Deserialize, Debug)]
pub(crate) struct Message {
    #[serde(default)]
    pub role: Option<String>,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's tool calls: the engines' chat templates render them into the prompt
    /// (TGI as their JSON text), so they count as prompt tokens.
    #[serde(default)]
    pub tool_calls: Option<serde_json::Value>,
}

impl Message {
    pub(crate) fn text(&self) -> String {
        match &self.content {
            None => self
                .tool_calls
                .as_ref()
                .map(|c| c.to_string())
                .unwrap_or_default(),
            Some(Content::Text(s)) => s.clone(),
            Some(Content::Parts(p)) => p
                .iter()
                .filter_map(|p| p.text.as_deref())
                .collect::<Vec<_>>()
                .join(""),
        }
    }
}

/// `POST /v1/chat/completions` fields the simulator reads.
#[derive(Deserialize, Debug)]
pub(crate) struct ChatRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub seed: Option<i64>,
    /// vLLM's sampling parameter: generate exactly `max_tokens`, whatever the end of text.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// vLLM, TGI: leave the last message open so the model continues it.
    #[serde(default)]
    pub continue_final_message: Option<bool>,
    /// vLLM: append the assistant header (default true).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
}

impl ChatRequest {
    /// The prompt in one of the template's forms.
    pub(crate) fn render(&self, form: Render) -> String {
        let msgs = self.messages.as_deref().unwrap_or(&[]);
        super::text::render_chat_with(
            msgs.iter()
                .map(|m| (m.role.as_deref().unwrap_or("user"), m.text())),
            form,
        )
    }

    /// Whether the last message is the assistant's (Ollama continues such a message).
    pub(crate) fn ends_with_assistant(&self) -> bool {
        self.messages
            .as_deref()
            .and_then(<[Message]>::last)
            .is_some_and(|m| m.role.as_deref() == Some("assistant"))
    }
}

/// A completions prompt.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub(crate) enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

impl Prompt {
    /// The prompt as text (token ids are rendered through the detokenizer).
    pub(crate) fn text(&self) -> String {
        match self {
            Prompt::Text(s) => s.clone(),
            Prompt::Texts(v) => v.first().cloned().unwrap_or_default(),
            Prompt::Tokens(t) => super::text::detokenize(t),
            Prompt::TokenLists(v) => v
                .first()
                .map(|t| super::text::detokenize(t))
                .unwrap_or_default(),
        }
    }
}

/// `POST /v1/completions` fields the simulator reads.
#[derive(Deserialize, Debug)]
pub(crate) struct CompletionRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub prompt: Option<Prompt>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub seed: Option<i64>,
    /// vLLM's sampling parameter: generate exactly `max_tokens`, whatever the end of text.
    #[serde(default)]
    pub ignore_eos: Option<bool>,
    /// vLLM: add the tokenizer's special tokens (its BOS) to the prompt (default true).
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
}

/// Embedding input.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub(crate) enum Input {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

impl Input {
    pub(crate) fn texts(&self) -> Vec<String> {
        match self {
            Input::Text(s) => vec![s.clone()],
            Input::Texts(v) => v.clone(),
            Input::Tokens(t) => vec![super::text::detokenize(t)],
            Input::TokenLists(v) => v.iter().map(|t| super::text::detokenize(t)).collect(),
        }
    }
}

/// `POST /v1/embeddings` fields the simulator reads.
#[derive(Deserialize, Debug)]
pub(crate) struct EmbeddingRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub input: Option<Input>,
    #[serde(default)]
    pub dimensions: Option<usize>,
}

/// Which engine's OpenAI surface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Surface {
    Vllm,
    Tgi,
    Ollama,
}

/// vLLM's `system_fingerprint`.
pub(crate) const VLLM_FINGERPRINT: &str = "vllm-0.32.0-ed4dc49f";
/// TGI's version and `system_fingerprint`.
pub(crate) const TGI_VERSION: &str = "3.3.6-dev0";
pub(crate) const TGI_FINGERPRINT: &str = "3.3.6-dev0-native";

/// What is fixed for one response: id, creation time, echoed model.
pub(crate) struct Ctx {
    pub surface: Surface,
    pub id: String,
    pub created: u64,
    /// The model name, already JSON-escaped.
    pub model_json: String,
    /// vLLM `--enable-prompt-tokens-details`: report `prompt_tokens_details.cached_tokens`.
    pub prompt_details: bool,
}

impl Ctx {
    pub(crate) fn new(surface: Surface, chat: bool, model: &str) -> Ctx {
        let id = match surface {
            Surface::Vllm => {
                let r: u64 = rand::random();
                if chat {
                    format!("chatcmpl-{r:016x}")
                } else {
                    format!("cmpl-{r:016x}")
                }
            }
            Surface::Tgi => String::new(),
            Surface::Ollama => {
                let n = rand::random::<u32>() % 999;
                if chat {
                    format!("chatcmpl-{n}")
                } else {
                    format!("cmpl-{n}")
                }
            }
        };
        Ctx {
            surface,
            id,
            created: super::unix_now(),
            model_json: js(model),
            prompt_details: false,
        }
    }

    /// Report the prefix-cache hit of each request in its usage (vLLM
    /// `--enable-prompt-tokens-details`).
    pub(crate) fn with_prompt_details(mut self, on: bool) -> Ctx {
        self.prompt_details = on && self.surface == Surface::Vllm;
        self
    }

    /// The `usage` object of a chat (`chat`) or completions answer, whole (`full`) or its
    /// usage chunk.
    fn usage(
        &self,
        chat: bool,
        prompt: u32,
        completion: u32,
        cache: CacheUse,
        full: bool,
    ) -> String {
        let total = prompt + completion;
        let details = self.prompt_details(chat, full, cache);
        match self.surface {
            Surface::Vllm if full => format!(
                "{{\"prompt_tokens\":{prompt},\"total_tokens\":{total},\"completion_tokens\":{completion},\"prompt_tokens_details\":{},\"completion_tokens_details\":null}}",
                details.as_deref().unwrap_or("null")
            ),
            Surface::Vllm => match details {
                Some(d) => format!(
                    "{{\"prompt_tokens\":{prompt},\"total_tokens\":{total},\"completion_tokens\":{completion},\"prompt_tokens_details\":{d}}}"
                ),
                None => format!(
                    "{{\"prompt_tokens\":{prompt},\"total_tokens\":{total},\"completion_tokens\":{completion}}}"
                ),
            },
            _ => format!(
                "{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion},\"total_tokens\":{total}}}"
            ),
        }
    }

    /// vLLM's `prompt_tokens_details` with `--enable-prompt-tokens-details` (none without):
    /// chat reports the tokens read from and written to the prefix cache, completions only
    /// those read; a whole answer writes every key, the streamed usage chunk drops the null
    /// ones (vLLM serializes it with `exclude_none`).
    fn prompt_details(&self, chat: bool, full: bool, c: CacheUse) -> Option<String> {
        if !self.prompt_details {
            return None;
        }
        let (cached, created) = (c.cached, c.created);
        Some(match (chat, full) {
            (true, true) => format!(
                "{{\"cached_tokens\":{cached},\"created_cache_tokens\":{created},\"multimodal_tokens\":null}}"
            ),
            (true, false) => {
                format!("{{\"cached_tokens\":{cached},\"created_cache_tokens\":{created}}}")
            }
            (false, true) => format!(
                "{{\"cached_tokens\":{cached},\"created_cache_tokens\":null,\"multimodal_tokens\":null}}"
            ),
            (false, false) => format!("{{\"cached_tokens\":{cached}}}"),
        })
    }

    /// A whole chat completion.
    pub(crate) fn chat_body(
        &self,
        text: &str,
        finish: Finish,
        prompt: u32,
        completion: u32,
        cache: CacheUse,
    ) -> String {
        let (id, created, model) = (&self.id, self.created, &self.model_json);
        let fr = finish.as_openai();
        let usage = self.usage(true, prompt, completion, cache, true);
        match self.surface {
            Surface::Vllm => {
                self.vllm_chat_body(&[(text.to_string(), finish)], prompt, completion, cache)
            }
            Surface::Tgi => format!(
                "{{\"object\":\"chat.completion\",\"id\":\"\",\"created\":{created},\"model\":{model},\"system_fingerprint\":\"{TGI_FINGERPRINT}\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{text}\"}},\"logprobs\":null,\"finish_reason\":\"{fr}\"}}],\"usage\":{usage}}}"
            ),
            Surface::Ollama => format!(
                "{{\"id\":\"{id}\",\"object\":\"chat.completion\",\"created\":{created},\"model\":{model},\"system_fingerprint\":\"fp_ollama\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{text}\"}},\"finish_reason\":\"{fr}\"}}],\"usage\":{usage}}}"
            ),
        }
    }

    /// vLLM's whole chat answer with one choice per `(text, finish)`: one conversation, or the
    /// conversations of `/v1/chat/completions/batch` (usage summed over them).
    pub(crate) fn vllm_chat_body(
        &self,
        choices: &[(String, Finish)],
        prompt: u32,
        completion: u32,
        cache: CacheUse,
    ) -> String {
        let (id, created, model) = (&self.id, self.created, &self.model_json);
        let usage = self.usage(true, prompt, completion, cache, true);
        let choices: Vec<String> = choices
            .iter()
            .enumerate()
            .map(|(i, (text, finish))| format!(
                "{{\"index\":{i},\"message\":{{\"role\":\"assistant\",\"content\":\"{text}\",\"refusal\":null,\"annotations\":null,\"audio\":null,\"function_call\":null,\"reasoning\":null}},\"logprobs\":null,\"finish_reason\":\"{}\",\"stop_reason\":null,\"token_ids\":null,\"routed_experts\":null}}",
                finish.as_openai()
            ))
            .collect();
        format!(
            "{{\"id\":\"{id}\",\"object\":\"chat.completion\",\"created\":{created},\"model\":{model},\"choices\":[{}],\"service_tier\":null,\"system_fingerprint\":\"{VLLM_FINGERPRINT}\",\"usage\":{usage},\"prompt_logprobs\":null,\"prompt_token_ids\":null,\"prompt_text\":null,\"kv_transfer_params\":null,\"ec_transfer_params\":null,\"metrics\":null}}",
            choices.join(",")
        )
    }

    /// A whole text completion.
    pub(crate) fn completion_body(
        &self,
        text: &str,
        finish: Finish,
        prompt: u32,
        completion: u32,
        cache: CacheUse,
    ) -> String {
        let (id, created, model) = (&self.id, self.created, &self.model_json);
        let fr = finish.as_openai();
        let usage = self.usage(false, prompt, completion, cache, true);
        match self.surface {
            Surface::Vllm => format!(
                "{{\"id\":\"{id}\",\"object\":\"text_completion\",\"created\":{created},\"model\":{model},\"choices\":[{{\"index\":0,\"text\":\"{text}\",\"logprobs\":null,\"finish_reason\":\"{fr}\",\"stop_reason\":null,\"token_ids\":null,\"prompt_logprobs\":null,\"prompt_token_ids\":null,\"routed_experts\":null}}],\"service_tier\":null,\"system_fingerprint\":\"{VLLM_FINGERPRINT}\",\"usage\":{usage},\"kv_transfer_params\":null,\"ec_transfer_params\":null,\"metrics\":null}}"
            ),
            Surface::Tgi => format!(
                "{{\"id\":\"\",\"object\":\"text_completion\",\"created\":{created},\"model\":{model},\"system_fingerprint\":\"{TGI_FINGERPRINT}\",\"choices\":[{{\"index\":0,\"text\":\"{text}\",\"logprobs\":null,\"finish_reason\":\"{fr}\"}}],\"usage\":{usage}}}"
            ),
            Surface::Ollama => format!(
                "{{\"id\":\"{id}\",\"object\":\"text_completion\",\"created\":{created},\"model\":{model},\"system_fingerprint\":\"fp_ollama\",\"choices\":[{{\"text\":\"{text}\",\"index\":0,\"finish_reason\":\"{fr}\"}}],\"usage\":{usage}}}"
            ),
        }
    }

    fn frame(&self, json: &str) -> String {
        match self.surface {
            Surface::Tgi => format!("data:{json}\n\n"),
            _ => format!("data: {json}\n\n"),
        }
    }

    /// The `[DONE]` event.
    pub(crate) fn done(&self) -> &'static str {
        match self.surface {
            Surface::Tgi => "data:[DONE]\n\n",
            _ => "data: [DONE]\n\n",
        }
    }

    /// The first chat chunk (vLLM sends a role-only chunk before the first token).
    pub(crate) fn chat_first(&self) -> Option<String> {
        match self.surface {
            Surface::Vllm => Some(self.frame(&format!(
                "{{\"id\":\"{}\",\"object\":\"chat.completion.chunk\",\"created\":{},\"model\":{},\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}],\"prompt_token_ids\":null,\"prompt_text\":null}}",
                self.id, self.created, self.model_json
            ))),
            _ => None,
        }
    }

    /// A chat chunk carrying `text`; `finish` is set on the last token.
    pub(crate) fn chat_token(
        &self,
        text: &str,
        finish: Option<Finish>,
        usage_follows: bool,
    ) -> String {
        let (id, created, model) = (&self.id, self.created, &self.model_json);
        match self.surface {
            Surface::Vllm => match finish {
                None => self.frame(&format!(
                    "{{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":{created},\"model\":{model},\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}},\"logprobs\":null,\"finish_reason\":null,\"token_ids\":null}}]}}"
                )),
                Some(f) => {
                    let fp = if usage_follows {
                        String::new()
                    } else {
                        format!(",\"system_fingerprint\":\"{VLLM_FINGERPRINT}\"")
                    };
                    self.frame(&format!(
                        "{{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":{created},\"model\":{model},\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}},\"logprobs\":null,\"finish_reason\":\"{}\",\"stop_reason\":null,\"token_ids\":null}}]{fp}}}",
                        f.as_openai()
                    ))
                }
            },
            Surface::Tgi => {
                let fr = finish
                    .map(|f| format!("\"{}\"", f.as_openai()))
                    .unwrap_or_else(|| "null".into());
                self.frame(&format!(
                    "{{\"object\":\"chat.completion.chunk\",\"id\":\"\",\"created\":{created},\"model\":{model},\"system_fingerprint\":\"{TGI_FINGERPRINT}\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"{text}\"}},\"logprobs\":null,\"finish_reason\":{fr}}}],\"usage\":null}}"
                ))
            }
            Surface::Ollama => {
                // Ollama sends the finish reason in a separate chunk (see `chat_finish`)
                self.frame(&format!(
                    "{{\"id\":\"{id}\",\"object\":\"chat.completion.chunk\",\"created\":{created},\"model\":{model},\"system_fingerprint\":\"fp_ollama\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"{text}\"}},\"finish_reason\":null}}]}}"
                ))
            }
        }
    }

    /// Ollama's separate finish chunk.
    pub(crate) fn chat_finish(&self, finish: Finish) -> Option<String> {
        match self.surface {
            Surface::Ollama => Some(self.frame(&format!(
                "{{\"id\":\"{}\",\"object\":\"chat.completion.chunk\",\"created\":{},\"model\":{},\"system_fingerprint\":\"fp_ollama\",\"choices\":[{{\"index\":0,\"delta\":{{\"role\":\"assistant\",\"content\":\"\"}},\"finish_reason\":\"{}\"}}]}}",
                self.id, self.created, self.model_json, finish.as_openai()
            ))),
            _ => None,
        }
    }

    /// The usage chunk (`choices: []`).
    pub(crate) fn usage_chunk(
        &self,
        chat: bool,
        prompt: u32,
        completion: u32,
        cache: CacheUse,
    ) -> String {
        let (id, created, model) = (&self.id, self.created, &self.model_json);
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let usage = self.usage(chat, prompt, completion, cache, false);
        match self.surface {
            Surface::Vllm => self.frame(&format!(
                "{{\"id\":\"{id}\",\"object\":\"{object}\",\"created\":{created},\"model\":{model},\"choices\":[],\"usage\":{usage},\"system_fingerprint\":\"{VLLM_FINGERPRINT}\"}}"
            )),
            Surface::Tgi => self.frame(&format!(
                "{{\"object\":\"{object}\",\"id\":\"\",\"created\":{created},\"model\":{model},\"system_fingerprint\":\"{TGI_FINGERPRINT}\",\"choices\":[],\"usage\":{usage}}}"
            )),
            Surface::Ollama => self.frame(&format!(
                "{{\"id\":\"{id}\",\"object\":\"{object}\",\"created\":{created},\"model\":{model},\"system_fingerprint\":\"fp_ollama\",\"choices\":[],\"usage\":{usage}}}"
            )),
        }
    }

    /// A text-completion chunk.
    pub(crate) fn completion_token(
        &self,
        text: &str,
        finish: Option<Finish>,
        usage_follows: bool,
    ) -> String {
        let (id, created, model) = (&self.id, self.created, &self.model_json);
        let fr = finish
            .map(|f| format!("\"{}\"", f.as_openai()))
            .unwrap_or_else(|| "null".into());
        match self.surface {
            Surface::Vllm => {
                let fp = if finish.is_some() && !usage_follows {
                    format!(",\"system_fingerprint\":\"{VLLM_FINGERPRINT}\"")
                } else {
                    String::new()
                };
                self.frame(&format!(
                    "{{\"id\":\"{id}\",\"object\":\"text_completion\",\"created\":{created},\"model\":{model},\"choices\":[{{\"index\":0,\"text\":\"{text}\",\"logprobs\":null,\"finish_reason\":{fr},\"stop_reason\":null,\"token_ids\":null}}]{fp}}}"
                ))
            }
            Surface::Tgi => self.frame(&format!(
                "{{\"id\":\"\",\"object\":\"text_completion\",\"created\":{created},\"choices\":[{{\"index\":0,\"text\":\"{text}\",\"logprobs\":null,\"finish_reason\":{fr}}}],\"model\":{model},\"system_fingerprint\":\"{TGI_FINGERPRINT}\",\"usage\":null}}"
            )),
            Surface::Ollama => self.frame(&format!(
                "{{\"id\":\"{id}\",\"object\":\"text_completion\",\"created\":{created},\"model\":{model},\"system_fingerprint\":\"fp_ollama\",\"choices\":[{{\"text\":\"{text}\",\"index\":0,\"finish_reason\":{fr}}}]}}"
            )),
        }
    }
}

/// An embeddings list body in the OpenAI shape.
pub(crate) fn embeddings_body(
    surface: Surface,
    model_json: &str,
    vectors: &[Vec<f32>],
    prompt_tokens: u32,
) -> String {
    let data: Vec<String> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let emb = serde_json::to_string(v).unwrap_or_else(|_| "[]".into());
            match surface {
                Surface::Vllm => {
                    format!("{{\"index\":{i},\"object\":\"embedding\",\"embedding\":{emb}}}")
                }
                _ => format!("{{\"object\":\"embedding\",\"embedding\":{emb},\"index\":{i}}}"),
            }
        })
        .collect();
    let data = data.join(",");
    match surface {
        Surface::Vllm => {
            let r: u64 = rand::random();
            format!(
                "{{\"id\":\"embd-{r:016x}\",\"object\":\"list\",\"created\":{},\"model\":{model_json},\"data\":[{data}],\"usage\":{{\"prompt_tokens\":{prompt_tokens},\"total_tokens\":{prompt_tokens},\"completion_tokens\":0,\"prompt_tokens_details\":null}}}}",
                super::unix_now()
            )
        }
        _ => format!(
            "{{\"object\":\"list\",\"data\":[{data}],\"model\":{model_json},\"usage\":{{\"prompt_tokens\":{prompt_tokens},\"total_tokens\":{prompt_tokens}}}}}"
        ),
    }
}

/// How to answer one generation request.
pub(crate) struct RespondOpts {
    pub chat: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub model_idx: usize,
    pub queue_limit: Option<usize>,
    pub json_ct: &'static str,
    pub sse_ct: &'static str,
    /// Held until the answer is complete (e.g. TGI's concurrency permit).
    pub guard: Option<Box<dyn std::any::Any + Send>>,
}

/// Generate `plan` and answer in the OpenAI shape of `ctx.surface`, streamed or not.
pub(crate) async fn respond(
    sim: &std::sync::Arc<super::server::Sim>,
    ctx: Ctx,
    plan: super::text::Plan,
    o: RespondOpts,
) -> Result<http::Response<super::server::SimBody>, super::gen::StartError> {
    use super::gen::Gen;
    use http::StatusCode;
    let mut gen = Gen::start(sim, o.model_idx, plan, o.queue_limit)?;
    if !o.stream {
        gen.run_to_end().await;
        let p = &gen.plan;
        let text = p.text(0, p.words.len());
        let body = if o.chat {
            ctx.chat_body(
                &text,
                p.finish,
                p.prompt_tokens(),
                p.completion_tokens(),
                gen.cache_use(),
            )
        } else {
            ctx.completion_body(
                &text,
                p.finish,
                p.prompt_tokens(),
                p.completion_tokens(),
                gen.cache_use(),
            )
        };
        return Ok(super::server::json(StatusCode::OK, o.json_ct, body));
    }
    let (chat, include_usage, guard) = (o.chat, o.include_usage, o.guard);
    Ok(super::server::stream_response(
        sim,
        StatusCode::OK,
        o.sse_ct,
        move |mut sink| async move {
            let _guard = guard;
            // vLLM sends its role-only chunk with the first token, after prefill
            let mut first_pending = chat;
            let total = gen.plan.words.len();
            let finish = gen.plan.finish;
            let separate_finish = ctx.surface == Surface::Ollama;
            while let Some(range) = gen.next().await {
                if first_pending {
                    first_pending = false;
                    if let Some(first) = ctx.chat_first() {
                        if !sink.send(first).await {
                            return;
                        }
                    }
                }
                for i in range {
                    let text = gen.plan.text(i, i + 1);
                    let f = (i + 1 == total && !separate_finish).then_some(finish);
                    let chunk = if chat {
                        ctx.chat_token(&text, f, include_usage)
                    } else {
                        ctx.completion_token(&text, f, include_usage)
                    };
                    if !sink.send(chunk).await {
                        return;
                    }
                }
            }
            if separate_finish {
                let chunk = if chat {
                    ctx.chat_finish(finish).unwrap_or_default()
                } else {
                    ctx.completion_token("", Some(finish), include_usage)
                };
                if !sink.send(chunk).await {
                    return;
                }
            }
            if include_usage {
                let p = &gen.plan;
                let u = ctx.usage_chunk(
                    chat,
                    p.prompt_tokens(),
                    p.completion_tokens(),
                    gen.cache_use(),
                );
                if !sink.send(u).await {
                    return;
                }
            }
            let _ = sink.send(ctx.done()).await;
        },
    ))
}
