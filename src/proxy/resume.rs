//! Mid-stream continuation (chat completions, completions, and the Messages and Responses
//! APIs through a chat completions endpoint): a stream that breaks after it was committed (reset,
//! the backend killed, idle timeout, an oversized or invalid event, an engine error event, an
//! early end) is continued on another backend serving the model, and the client reads one
//! unbroken answer.
//!
//! ```text
//! observer (observe.rs)          records what each event sent to the client says (Transcript)
//!   └─ the stream breaks         ─► Resume::start: the broken connection is closed at once
//!      └─ Continuer::run          the request can be continued? (api::continuation) → pick a
//!                                 backend that can continue (not one tried, its kind able to
//!                                 continue this API) → the continuation request (the partial
//!                                 answer to continue, limits less what was streamed) → send
//!                                 (first_byte bound) → a 2xx event stream, or it failed
//!   └─ joined                     the continuation's events, rewritten (first id, created,
//!                                 model; no second role delta; the answer's usage) follow
//! ```
//!
//! Invariants:
//! - At most one continuation per request, and only of a stream (`routing.continue_streams`,
//!   default on); anything that keeps a request from being continued faithfully
//!   ([`crate::api::continuation`]) — or a continuation that fails itself — ends the stream
//!   with the API's terminal error event, as without continuation.
//! - Nothing is sent to the client while the continuation is being set up; the first backend
//!   is marked as failed (as for any broken stream) and its load released when the
//!   continuation's backend takes over; usage is the answer's, counted once.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::upstream::Body as Incoming;
use bytes::Bytes;
use http::HeaderMap;

use super::prepare::Prepared;
use crate::api::continuation::{Continuation, Transcript};
use crate::api::{ClientApi, Edits};
use crate::config::{BackendKind, Config, PolicyKind};
use crate::fleet::{Backend, LoadGuard};
use crate::gateway::Gateway;
use crate::openai::RequestFields;
use crate::routing::RouteInput;
use crate::telemetry::access::AccessRecord;
use crate::telemetry::otel::{Phase, RequestTrace};
use crate::upstream as forward;
use opentelemetry::KeyValue;

/// The continuation being set up: the backend answered, or why it did not.
pub type Started<B> = Pin<Box<dyn Future<Output = Result<Switch<B>, String>> + Send>>;

/// What starts a continuation of the transcript it is given, after the stream broke for the
/// reason it is given.
pub type Starter<B> = Box<dyn FnOnce(Transcript, String) -> Started<B> + Send>;

/// A backend that took over a broken stream: its body, its share of the load, and the edits
/// its events need (its model name, key, TGI's quirks).
pub struct Switch<B> {
    pub body: B,
    pub backend: Arc<Backend>,
    pub guard: LoadGuard,
    pub edits: Edits,
}

/// The observer's continuation state.
pub struct Resume<B> {
    pub api: &'static dyn Continuation,
    /// The client's request, and whether it can be continued (read at the first break).
    request: Bytes,
    continuable: Option<bool>,
    /// What the client has received.
    pub transcript: Transcript,
    starter: Option<Starter<B>>,
    pub pending: Option<Started<B>>,
    /// The continuation's events are being streamed.
    pub joined: bool,
    /// Why the first backend's stream broke (for the terminal error if continuing fails).
    pub broke: String,
    /// The engine's error event that broke the stream (sent after all if continuing fails).
    pub held_error: Option<Bytes>,
    /// Some candidate not tried yet can continue this API's answers.
    alternative: bool,
}

impl<B> Resume<B> {
    pub fn new(
        api: &'static dyn Continuation,
        request: Bytes,
        alternative: bool,
        starter: Starter<B>,
    ) -> Self {
        Resume {
            held_error: None,
            alternative,
            api,
            request,
            continuable: None,
            transcript: Transcript::default(),
            starter: Some(starter),
            pending: None,
            joined: false,
            broke: String::new(),
        }
    }

    /// Record one event sent to the client (only before the continuation joins).
    pub fn record(&mut self, data: &[u8]) {
        if !self.joined {
            self.api.record(data, &mut self.transcript);
        }
    }

    /// Whether a break now would be continued.
    pub fn can_start(&mut self) -> bool {
        if !self.alternative
            || self.joined
            || self.starter.is_none()
            || self.transcript.blocked.is_some()
        {
            return false;
        }
        let (api, request) = (self.api, &self.request);
        *self
            .continuable
            .get_or_insert_with(|| api.continuable(request).is_ok())
    }

    /// Start continuing after the stream broke with `why`; `false` when it cannot be.
    pub fn start(&mut self, why: &str) -> bool {
        if !self.can_start() {
            return false;
        }
        let Some(starter) = self.starter.take() else {
            return false;
        };
        self.broke = why.to_string();
        self.pending = Some(starter(self.transcript.clone(), self.broke.clone()));
        true
    }
}

/// Everything a continuation of one request needs, taken from the request path when the
/// answer is committed.
pub(super) struct Continuer {
    pub gw: Arc<Gateway>,
    pub api: &'static dyn ClientApi,
    pub body: Bytes,
    pub fields: RequestFields,
    pub candidates: Vec<(Arc<Backend>, String)>,
    pub policy: PolicyKind,
    pub input: RouteInput,
    pub tenant: String,
    pub client_headers: HeaderMap,
    pub request_id: String,
    /// Candidates already tried (the broken one among them).
    pub tried: Vec<usize>,
    /// Sluice forced the stream's usage report: the client does not get it.
    pub strip_usage: bool,
    /// The request's server span, when tracing: the continuation is a span under it.
    pub trace: Option<RequestTrace>,
}

impl Continuer {
    /// What continues this request's stream on another backend if it breaks after it was
    /// committed (`routing.continue_streams`); `None` for an answer that is not
    /// streamed, an API that cannot be continued, or a request pinned to one backend.
    pub(super) fn for_request(
        gw: &Arc<Gateway>,
        config: &Config,
        p: &Prepared,
        tried: &[usize],
        strip_usage: bool,
        record: &AccessRecord,
    ) -> Option<Continuer> {
        if !config.routing.continue_streams || !p.streaming || p.pin.is_some() {
            return None;
        }
        p.api.continuation()?;
        // an adapter's stream continues only where the adapter is held: nothing is loaded mid-answer
        let mut tried = tried.to_vec();
        if let Some(a) = &p.resolved.adapter {
            let candidates = &p.resolved.candidates;
            let elsewhere: Vec<usize> = (0..candidates.len())
                .filter(|&i| {
                    !tried.contains(&i) && !candidates[i].0.state.adapters().holds(&a.name)
                })
                .collect();
            tried.extend(elsewhere);
        }
        Some(Continuer {
            gw: gw.clone(),
            api: p.api,
            body: p.body.clone(),
            fields: p.fields.clone(),
            candidates: p.resolved.candidates.clone(),
            policy: p.policy,
            input: p.input.clone(),
            tenant: p.identity.tenant.clone(),
            client_headers: p.client_headers.clone(),
            request_id: record.request_id.clone(),
            tried,
            strip_usage,
            trace: record.trace.clone(),
        })
    }

    /// The observer's state for a stream of this request.
    pub(super) fn into_resume(self) -> Option<Resume<Incoming>> {
        let api = self.api.continuation()?;
        let alternative = self
            .candidates
            .iter()
            .enumerate()
            .any(|(i, (b, _))| !self.tried.contains(&i) && api.continues_on(b.kind()));
        Some(Resume::new(
            api,
            self.body.clone(),
            alternative,
            Box::new(move |t: Transcript, why: String| Box::pin(self.run(api, t, why))),
        ))
    }

    /// Continue on another backend after the stream broke with `why`; with tracing, as a
    /// `sluice.continuation` span (why the stream broke, the tokens streamed before, the
    /// backend, why it could not be continued).
    async fn run(
        self,
        cont: &'static dyn Continuation,
        t: Transcript,
        why: String,
    ) -> Result<Switch<Incoming>, String> {
        let Some(span) = self.trace.as_ref().map(|t| t.phase("sluice.continuation")) else {
            return self.switch(cont, t, None).await;
        };
        span.set(|| {
            [
                KeyValue::new("sluice.continuation.reason", why),
                KeyValue::new("sluice.streamed_tokens", t.tokens as i64),
            ]
        });
        let switched = self.switch(cont, t, Some(&span)).await;
        match &switched {
            Ok(s) => span.set(|| {
                [KeyValue::new(
                    "sluice.backend",
                    s.backend.name().to_string(),
                )]
            }),
            Err(why) => {
                span.set(|| [KeyValue::new("sluice.continuation.error", why.clone())]);
                span.fail("continuation_failed");
            }
        }
        span.end();
        switched
    }

    async fn switch(
        self,
        cont: &'static dyn Continuation,
        t: Transcript,
        span: Option<&Phase>,
    ) -> Result<Switch<Incoming>, String> {
        let rt = self.gw.runtime();
        let config = &rt.config;
        let mut tried = self.tried.clone();
        for (i, (b, _)) in self.candidates.iter().enumerate() {
            if !cont.continues_on(b.kind()) {
                tried.push(i);
            }
        }
        let claimed = super::pick::pick_or_wait(
            &self.gw,
            config,
            self.policy,
            &self.candidates,
            &tried,
            &self.input,
            super::pick::Waiter {
                tenant: &self.tenant,
                span,
                asks: None,
            },
        )
        .await
        .map_err(|e| e.message)?
        .ok_or("no other backend that can continue it is available")?;
        let (backend, model) = &self.candidates[claimed.idx];
        let body = cont
            .body(&self.body, &t, backend.kind(), model)
            .ok_or("nothing is left to generate, or the answer so far cannot be continued")?;
        let mut headers = super::headers::upstream_headers(
            &self.client_headers,
            &self.request_id,
            backend.config.api_key.as_deref(),
        );
        if let Some(span) = span {
            span.set(|| [KeyValue::new("sluice.backend", backend.name().to_string())]);
            span.inject(&mut headers);
        }
        let timeouts = backend.config.timeouts;
        let deadline = tokio::time::Instant::now() + timeouts.response;
        backend.state.count_request();
        let sent = forward::send(
            backend.as_ref(),
            cont.path().unwrap_or(self.api.path()),
            headers,
            body,
            timeouts.first_byte,
        )
        .await;
        let mut record = AccessRecord::new(
            self.request_id.clone(),
            self.api.label(),
            std::time::Instant::now(),
        );
        record.attempts = self.tried.len() as u32 + 1;
        let resp = super::attempt::classify(config, backend, sent, false, deadline, &record)
            .await
            .map_err(|e| e.message)?;
        if !resp.status().is_success() || !super::headers::is_sse(resp.headers()) {
            return Err(format!(
                "backend `{}` answered the continuation with status {}",
                backend.name(),
                resp.status().as_u16()
            ));
        }
        tracing::info!(
            request_id = %self.request_id,
            backend = backend.name(),
            streamed_tokens = t.tokens,
            "continuing a broken stream"
        );
        Ok(Switch {
            body: resp.into_body(),
            backend: backend.clone(),
            guard: claimed.guard,
            edits: self.edits(backend, model),
        })
    }

    /// The edits the continuing backend's events need (as the first answer's had).
    fn edits(&self, backend: &Backend, model: &str) -> Edits {
        let tgi = backend.kind() == BackendKind::Tgi;
        Edits {
            rename_model: (model != self.fields.model).then(|| self.fields.model.clone()),
            strip_usage: self.strip_usage,
            fill_id: tgi.then(|| format!("{}{}", self.api.id_prefix(), self.request_id)),
            normalize_finish: tgi,
            redact: backend.config.api_key.as_deref().map(Arc::from),
            issue_ids: None,
        }
    }
}
