//! The response path: streams passed through chunk by chunk while usage and time to first token
//! are observed on the side, and the settlement that runs when a request is over.
//!
//! Invariants:
//! - Complete events are handed to the client as soon as they arrive (the chunk itself, when it
//!   holds whole events). The unfinished tail of an event is held until its end arrives: a
//!   client cannot act on half an event, and a terminal error event must never land inside a
//!   half-sent one. Complete events are never held.
//! - An event whose data is not JSON (nor `[DONE]`) ends the stream with the terminal error
//!   below, before that event reaches the client: SDKs would fail on it with a parse error.
//! - Once a stream has started it is never retried; if the backend fails mid-way (reset, idle
//!   timeout, oversized or invalid event, early end, an engine error event while a
//!   continuation is possible) the answer is continued on another backend when the request
//!   can be ([`super::resume`]: at most once; the events that went out are recorded for it,
//!   the continuation's rewritten to read as the same answer). Otherwise the client gets the
//!   request's API's terminal error event ([`ClientApi::stream_error_event`]; for OpenAI's
//!   APIs an error object, then `data: [DONE]`), so SDKs raise instead of returning a
//!   silently truncated answer.
//! - What an event means (usage, output, an error, the end) and how it is edited is the
//!   request's [`ClientApi`]'s answer; this module knows no API by name.
//! - [`Settle`] runs exactly once, on completion or on drop (client gone), releasing the load
//!   guard and writing the access line.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use memchr::memmem;
use tokio::time::Sleep;

use super::resume::{Resume, Switch};
use super::sse::{event_data_borrowed, SseScanner};
use crate::api::continuation::Rewritten;
pub use crate::api::Edits;
use crate::api::{ClientApi, Seen};
use crate::config::HealthConfig;
use crate::fleet::Backend;
pub use crate::openai::usage::Usage;
use crate::openai::ApiError;
pub use crate::settle::{Outcome, Settle, SettleHook};
use crate::telemetry::metrics as m;
use crate::upstream::Body as Incoming;

/// A settlement hook that feeds what a finished request taught: the backend's speed EWMAs
/// (TTFT, prefill and decode speed, from the moment it was sent there) and the model's output
/// length and prompt-estimate correction. Only complete answers with a usage report count. The
/// prefill speed counts the prompt tokens the engine did not have cached: those its usage
/// reports cached, else `predicted_cached` (routing's expectation from its KV events).
pub fn learn_hook(
    backend: Arc<Backend>,
    shapes: Arc<crate::fleet::speed::ModelShapes>,
    model: String,
    prompt_estimate: u64,
    sent_after: Duration,
    queued: bool,
    predicted_cached: Option<u64>,
) -> SettleHook {
    Box::new(move |o: &Outcome| {
        let (true, false, Some(u)) = (o.complete, o.continued, o.usage) else {
            return;
        };
        shapes.observe(
            &model,
            prompt_estimate,
            u.prompt_tokens,
            u.completion_tokens,
        );
        // this request's guard is already released
        let busy = backend.state.inflight_requests() as f64 + 1.0;
        let total = o.elapsed.saturating_sub(sent_after);
        let ttft = o.ttft.map(|t| t.saturating_sub(sent_after));
        backend.state.timings().answered(total, ttft);
        backend.state.speeds().observe(
            &crate::fleet::speed::Observation {
                prompt_tokens: u.prompt_tokens,
                cached_tokens: u.cached_tokens.or(predicted_cached).unwrap_or(0),
                completion_tokens: u.completion_tokens,
                ttft,
                total,
                queued: queued || o.queue_seen,
            },
            busy,
        );
        crate::fleet::speed::backend_speeds(backend.name(), backend.state.speeds());
    })
}

/// Replaces a secret by `[redacted]` in what goes to the client; built once per answer, so
/// the searcher is not rebuilt per chunk.
#[derive(Debug)]
pub struct Redactor(Option<memmem::Finder<'static>>);

impl Redactor {
    /// Redacts `secret` (nothing when it is absent or empty).
    pub fn new(secret: Option<&str>) -> Redactor {
        Redactor(
            secret
                .filter(|s| !s.is_empty())
                .map(|s| memmem::Finder::new(s.as_bytes()).into_owned()),
        )
    }

    /// `bytes` with every occurrence of the secret replaced (copied only when it is there).
    pub fn apply(&self, bytes: Bytes) -> Bytes {
        let Some(finder) = &self.0 else {
            return bytes;
        };
        if finder.find(&bytes).is_none() {
            return bytes;
        }
        let mut out = Vec::with_capacity(bytes.len());
        let mut at = 0;
        for i in finder.find_iter(&bytes) {
            out.extend_from_slice(&bytes[at..i]);
            out.extend_from_slice(b"[redacted]");
            at = i + finder.needle().len();
        }
        out.extend_from_slice(&bytes[at..]);
        Bytes::from(out)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Streaming,
    /// The stream broke; its continuation on another backend is being set up
    /// ([`super::resume`]).
    Continuing,
    Done,
}

/// A streamed backend response on its way to the client (`B`: the backend's body; generic so
/// the observer can be driven without a connection).
pub struct ObservedStream<B = Incoming> {
    api: &'static dyn ClientApi,
    /// `None` once a broken stream's connection is closed.
    upstream: Option<B>,
    /// Continues the answer on another backend if the stream breaks.
    resume: Option<Box<Resume<B>>>,
    scanner: SseScanner,
    edits: Edits,
    idle: Duration,
    idle_timer: Pin<Box<Sleep>>,
    out: VecDeque<Bytes>,
    redactor: Redactor,
    phase: Phase,
    saw_done: bool,
    saw_text: bool,
    saw_error: bool,
    head_at: Instant,
    backend: Arc<Backend>,
    health: HealthConfig,
    settle: Settle,
}

impl<B> ObservedStream<B> {
    pub fn new(
        api: &'static dyn ClientApi,
        upstream: B,
        edits: Edits,
        idle: Duration,
        backend: Arc<Backend>,
        health: HealthConfig,
        settle: Settle,
    ) -> Self {
        ObservedStream {
            api,
            upstream: Some(upstream),
            resume: None,
            scanner: SseScanner::new(),
            redactor: Redactor::new(edits.redact.as_deref()),
            edits,
            idle,
            idle_timer: Box::pin(tokio::time::sleep(idle)),
            out: VecDeque::new(),
            phase: Phase::Streaming,
            saw_done: false,
            saw_text: false,
            saw_error: false,
            head_at: Instant::now(),
            backend,
            health,
            settle,
        }
    }

    /// Continue the answer with `resume` if the stream breaks.
    pub fn resuming(mut self, resume: Option<Resume<B>>) -> Self {
        self.resume = resume.map(Box::new);
        self
    }

    /// The API whose events the stream carries: the request's, or the continuation's wire.
    fn reader(&self) -> &'static dyn ClientApi {
        self.resume
            .as_ref()
            .filter(|r| r.joined)
            .and_then(|r| r.api.wire())
            .unwrap_or(self.api)
    }

    /// Whether the stream's events come from a continuation.
    fn joined(&self) -> bool {
        self.resume.as_ref().is_some_and(|r| r.joined)
    }

    /// Whether a break now would be continued (an engine's error event is then a break).
    fn would_continue(&mut self) -> bool {
        self.resume.as_mut().is_some_and(|r| r.can_start())
    }

    /// Record an event the client is sent, for a continuation.
    fn record(&mut self, data: &[u8]) {
        if let Some(r) = self.resume.as_mut() {
            r.record(data);
        }
    }

    fn observe(&mut self, seen: Seen) {
        if seen.done {
            self.saw_done = true;
        }
        if seen.finish.is_some() {
            self.settle.finish = seen.finish;
        }
        if seen.error {
            self.saw_error = true;
            self.settle.record.error = Some("backend_stream_error".into());
        }
        if seen.text {
            if !self.saw_text {
                self.saw_text = true;
                self.settle.record.ttft = Some(self.settle.record.started.elapsed());
                if let Some(g) = self.settle.guard.as_mut() {
                    g.first_token();
                }
            }
            self.settle.streamed_tokens += 1;
            if let Some(g) = self.settle.guard.as_mut() {
                g.release_tokens(1);
            }
        }
        if let Some(mut u) = seen.usage {
            if let Some(r) = self.resume.as_ref().filter(|r| r.joined) {
                u = crate::api::continuation::joined_usage(&r.transcript, u);
            }
            // An API may report the prompt at the start and the output at the end (Anthropic's
            // message_start / message_delta): a later report without a prompt count keeps it.
            if let (0, Some(earlier)) = (u.prompt_tokens, self.settle.usage) {
                u.prompt_tokens = earlier.prompt_tokens;
            }
            self.settle.usage = Some(u);
        }
    }

    /// Queue bytes that came from the backend (whole events only, so a secret cannot be split
    /// between two calls) for the client.
    fn send(&mut self, bytes: Bytes) {
        let bytes = self.redactor.apply(bytes);
        self.out.push_back(bytes);
    }

    fn on_data(&mut self, data: Bytes) {
        // Bytes of an unfinished event held from earlier chunks (not sent yet).
        let held = self.scanner.pending();
        if let Err(e) = self.scanner.feed(&data) {
            self.interrupt(&e.to_string());
            return;
        }
        if self.edits.is_passthrough() && !self.joined() {
            // Send the complete events, zero-copy: they are `data` minus the held tail, plus
            // (when an event was held) the first event, which starts with the held bytes.
            let (mut first, mut complete, mut invalid, mut failed) = (None, 0usize, false, None);
            while let Some(event) = self.scanner.next_event() {
                if let Some(payload) = event_data_borrowed(&event) {
                    let seen = self.api.inspect(&payload);
                    if seen.invalid {
                        invalid = true;
                        break;
                    }
                    if seen.error && self.would_continue() {
                        failed = Some(event.clone());
                        break;
                    }
                    self.observe(seen);
                    self.record(&payload);
                }
                complete += event.len();
                if held > 0 && first.is_none() {
                    first = Some(event);
                }
            }
            let from_data = match first {
                Some(f) => {
                    let skip = f.len().saturating_sub(held);
                    self.send(f);
                    skip..complete.saturating_sub(held).max(skip)
                }
                None => 0..complete.saturating_sub(held),
            };
            if !from_data.is_empty() {
                self.send(data.slice(from_data.start..from_data.end.min(data.len())));
            }
            if invalid {
                self.interrupt("the backend sent an event that is not JSON");
            } else if let Some(event) = failed {
                self.error_event(event);
            }
            return;
        }
        let mut batch = BytesMut::new();
        while let Some(event) = self.scanner.next_event() {
            let Some(payload) = event_data_borrowed(&event) else {
                batch.extend_from_slice(&event); // a comment or keep-alive: as it came
                continue;
            };
            let seen = self.reader().inspect(&payload);
            let failed = seen.error && self.would_continue();
            if seen.invalid || failed {
                if !batch.is_empty() {
                    self.send(batch.freeze());
                }
                if failed {
                    self.error_event(event);
                } else {
                    self.interrupt("the backend sent an event that is not JSON");
                }
                return;
            }
            self.observe(seen);
            if seen.usage_only && self.edits.strip_usage {
                continue;
            }
            if let (true, Some(end)) = (seen.done, self.api.end_event()) {
                batch.extend_from_slice(end);
                continue;
            }
            // (a continuation's events are edited as its wire API's, then rewritten)
            let edited = self
                .reader()
                .edit(&payload, &self.edits)
                .unwrap_or_else(|| Bytes::copy_from_slice(&payload));
            let usage = seen.usage.and(self.settle.usage);
            let edited = match self.resume.as_deref_mut() {
                Some(r) if r.joined => match r.api.rewrite(&edited, &mut r.transcript, usage) {
                    Rewritten::Drop => continue,
                    Rewritten::Send(b) => b,
                    Rewritten::Events(b) => {
                        batch.extend_from_slice(&b);
                        continue;
                    }
                },
                _ => {
                    self.record(&edited);
                    edited
                }
            };
            // The event's other fields (`event:` of a typed stream, `id:`) go first, as they
            // came: only the data is edited.
            for line in super::sse::lines(&event).filter(|l| !l.is_empty() && !is_data(l)) {
                batch.extend_from_slice(line);
                batch.extend_from_slice(b"\n");
            }
            // One `data:` line per line of the payload: data sent on several lines (valid JSON
            // with line breaks as whitespace) must not lose its later lines (found by fuzzing).
            for (i, line) in edited.split(|b| *b == b'\n' || *b == b'\r').enumerate() {
                batch.extend_from_slice(if i == 0 { b"data: " } else { b"\ndata: " });
                batch.extend_from_slice(line);
            }
            batch.extend_from_slice(b"\n\n");
        }
        if !batch.is_empty() {
            self.send(batch.freeze());
        }
    }

    fn on_end(&mut self) {
        // An event cut by the end of the body (no blank line after it) still counts when it is
        // whole otherwise (e.g. a final `data: [DONE]\n`); it is sent only if the stream is not
        // interrupted below, so the terminal error never lands inside half an event.
        // A cut event is ended with a blank line when sent, so the `[DONE]` below does not
        // become part of its data; one whose data is not JSON is not sent at all.
        let rest = self.scanner.take_rest();
        let mut rest_invalid = false;
        if let Some(payload) = event_data_borrowed(&rest) {
            let seen = self.reader().inspect(&payload);
            rest_invalid = seen.invalid;
            if !seen.invalid {
                self.observe(seen);
            }
        }
        if (self.saw_done || self.saw_error) && !rest.is_empty() && !rest_invalid {
            self.send(rest);
            self.out.push_back(Bytes::from_static(b"\n\n"));
        }
        if !self.saw_done {
            if self.saw_error {
                if let Some(end) = self.api.end_event() {
                    self.out.push_back(Bytes::from_static(end));
                }
            } else {
                self.interrupt("the backend ended the stream before it was complete");
                return;
            }
        }
        self.settle.complete = !self.saw_error;
        if !self.saw_error {
            self.backend.state.record_live_success();
        }
        self.phase = Phase::Done;
    }

    fn interrupt(&mut self, why: &str) {
        tracing::warn!(
            request_id = %self.settle.record.request_id,
            backend = self.backend.name(),
            after_ms = self.head_at.elapsed().as_millis() as u64,
            "stream interrupted: {why}"
        );
        metrics::counter!(m::STREAM_INTERRUPTIONS_TOTAL, "backend" => self.backend.name().to_string())
            .increment(1);
        self.backend
            .state
            .record_live_failure(&self.health, false, why);
        if self.resume.as_mut().is_some_and(|r| r.start(why)) {
            // The broken connection is closed now, its unfinished event dropped.
            self.upstream = None;
            self.scanner = SseScanner::new();
            self.phase = Phase::Continuing;
            return;
        }
        self.terminal(&format!(
            "The backend stopped in the middle of the answer ({why}). The answer is incomplete."
        ));
    }

    /// The engine reported an error inside the stream while a continuation is possible: the
    /// event is held back and the answer continued; should that fail, the client gets the
    /// engine's event after all (as without continuation).
    fn error_event(&mut self, event: Bytes) {
        if let Some(r) = self.resume.as_mut() {
            r.held_error = Some(event);
        }
        self.interrupt("the backend sent an error event");
    }

    /// End the stream with the API's terminal error event.
    fn terminal(&mut self, message: &str) {
        let err = ApiError::bad_gateway(message).with_code("backend_stream_interrupted");
        self.out.push_back(self.api.stream_error_event(&err));
        self.settle.record.error = Some("stream_interrupted".into());
        self.phase = Phase::Done;
    }

    /// The continuation is set up (`Ok`: its backend took over) or failed.
    fn continued(&mut self, started: Result<Switch<B>, String>) {
        let broke = self
            .resume
            .as_ref()
            .map(|r| r.broke.clone())
            .unwrap_or_default();
        // (labelled by the backend whose stream broke)
        let broken = self.backend.name().to_string();
        let switch = match started {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(request_id = %self.settle.record.request_id, "continuation failed: {e}");
                metrics::counter!(m::STREAM_CONTINUATIONS_TOTAL, "backend" => broken, "outcome" => "failed")
                    .increment(1);
                if let Some(event) = self.resume.as_mut().and_then(|r| r.held_error.take()) {
                    // The engine's own error event, then the API's end, as without continuation.
                    self.send(event);
                    self.out
                        .extend(self.api.end_event().map(Bytes::from_static));
                    self.settle.record.error = Some("backend_stream_error".into());
                    self.phase = Phase::Done;
                    return;
                }
                return self.terminal(&format!(
                    "The backend stopped in the middle of the answer ({broke}) and continuing \
                     it on another backend failed ({e}). The answer is incomplete."
                ));
            }
        };
        metrics::counter!(m::STREAM_CONTINUATIONS_TOTAL, "backend" => broken, "outcome" => "continued")
            .increment(1);
        if let Some(r) = self.resume.as_mut() {
            r.joined = true;
            r.pending = None;
        }
        self.upstream = Some(switch.body);
        self.backend = switch.backend;
        // The first backend's share of the load is released here.
        self.settle.guard = Some(switch.guard);
        self.settle.continued = true;
        self.settle.record.backend = Some(self.backend.name().to_string());
        self.settle.record.attempts += 1;
        self.redactor = Redactor::new(switch.edits.redact.as_deref());
        self.edits = switch.edits;
        self.scanner = SseScanner::new();
        self.saw_done = false;
        self.saw_error = false;
        self.head_at = Instant::now();
        let deadline = tokio::time::Instant::now() + self.idle;
        self.idle_timer.as_mut().reset(deadline);
        self.phase = Phase::Streaming;
    }
}

/// Whether an SSE line is a `data` field line.
fn is_data(line: &[u8]) -> bool {
    line == b"data" || line.starts_with(b"data:")
}

impl<B> Body for ObservedStream<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        loop {
            if let Some(b) = this.out.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if this.phase == Phase::Done {
                this.settle.run();
                return Poll::Ready(None);
            }
            if this.phase == Phase::Continuing {
                let Some(pending) = this.resume.as_mut().and_then(|r| r.pending.as_mut()) else {
                    this.terminal("The answer could not be continued.");
                    continue;
                };
                match pending.as_mut().poll(cx) {
                    Poll::Ready(started) => this.continued(started),
                    Poll::Pending => return Poll::Pending,
                }
                continue;
            }
            let Some(upstream) = this.upstream.as_mut() else {
                this.terminal("The answer could not be continued.");
                continue;
            };
            match Pin::new(upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        let deadline = tokio::time::Instant::now() + this.idle;
                        this.idle_timer.as_mut().reset(deadline);
                        if !data.is_empty() {
                            this.on_data(data);
                        }
                    }
                }
                Poll::Ready(Some(Err(e))) => this.interrupt(&format!("connection lost: {e}")),
                Poll::Ready(None) => this.on_end(),
                Poll::Pending => {
                    if this.idle_timer.as_mut().poll(cx).is_ready() {
                        let idle = this.idle;
                        this.interrupt(&format!("no data for {idle:?}"));
                        continue;
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.phase == Phase::Done && self.out.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::access::AccessRecord;

    /// A config with one vLLM backend, and that backend.
    fn one_backend() -> (crate::config::Config, Arc<Backend>) {
        let config = crate::config::from_str(
            "[[backends]]\nname = \"b\"\nkind = \"vllm\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n",
            "t",
        )
        .unwrap();
        let backend = Arc::new(Backend::new(
            config.backends[0].clone(),
            Arc::new(crate::fleet::BackendState::new()),
        ));
        (config, backend)
    }

    /// A request that waited behind a queue the engine reported teaches the decode speed,
    /// not the prefill speed: its time to first token was mostly waiting.
    #[test]
    fn a_request_that_saw_an_engine_queue_is_no_prefill_sample() {
        let (_, backend) = one_backend();
        let shapes = Arc::new(crate::fleet::speed::ModelShapes::default());
        let outcome = |queue_seen| crate::settle::Outcome {
            usage: Some(Usage {
                prompt_tokens: 50,
                completion_tokens: 49,
                cached_tokens: None,
            }),
            complete: true,
            ttft: Some(Duration::from_secs(7)),
            elapsed: Duration::from_secs(9),
            pending: None,
            continued: false,
            queue_seen,
            finish: None,
        };
        let learn = |queued, seen| {
            learn_hook(
                backend.clone(),
                shapes.clone(),
                "m".into(),
                50,
                Duration::ZERO,
                queued,
                None,
            )(&outcome(seen))
        };
        learn(false, true);
        learn(true, false);
        let sp = backend.state.speeds();
        assert_eq!(sp.prefill_tps.get(), None);
        assert!(sp.decode_tps.get().is_some_and(|v| (v - 24.0).abs() < 1e-6));
        // without either sign of a queue, 50 tokens in 7 s are what it learns
        learn(false, false);
        assert!(sp
            .prefill_tps
            .get()
            .is_some_and(|v| (v - 50.0 / 7.0).abs() < 1e-6));
    }

    /// The prefill speed is learned from the tokens the engine did not have cached: the
    /// reported `cached_tokens` when the usage has them, else what routing expected.
    #[test]
    fn a_cache_hit_teaches_the_prefill_speed_of_its_uncached_tokens() {
        let learned = |reported: Option<u64>, predicted: Option<u64>| {
            let (_, backend) = one_backend();
            let shapes = Arc::new(crate::fleet::speed::ModelShapes::default());
            let outcome = crate::settle::Outcome {
                usage: Some(Usage {
                    prompt_tokens: 8000,
                    completion_tokens: 50,
                    cached_tokens: reported,
                }),
                complete: true,
                ttft: Some(Duration::from_millis(100)),
                elapsed: Duration::from_secs(1),
                pending: None,
                continued: false,
                queue_seen: false,
                finish: None,
            };
            learn_hook(
                backend.clone(),
                shapes,
                "m".into(),
                8000,
                Duration::ZERO,
                false,
                predicted,
            )(&outcome);
            backend.state.speeds().prefill_tps.get().unwrap()
        };
        // 7,000 reported cached: 1,000 tokens in 0.1 s, whatever routing expected
        assert!((learned(Some(7000), Some(6000)) - 10_000.0).abs() < 1e-6);
        // nothing reported: routing's expectation
        assert!((learned(None, Some(6000)) - 20_000.0).abs() < 1e-6);
        // neither: the whole prompt, as before
        assert!((learned(None, None) - 80_000.0).abs() < 1e-6);
    }

    /// A backend that echoes the key Sluice sent it inside a 200 stream (an error event, a
    /// chunk): the client sees `[redacted]`, whether the stream is edited or passed through
    /// and however the backend's chunks cut the events.
    #[tokio::test]
    async fn backend_key_echoed_in_a_stream_is_redacted() {
        use http_body_util::BodyExt;
        let (config, backend) = one_backend();
        let stream: &[u8] = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n\
            data: {\"error\":{\"message\":\"worker lost (auth Bearer sk-be-1; again sk-be-1)\"}}\n\n\
            data: [DONE]\n\n";
        for rename in [None, Some("client-m".to_string())] {
            for cut in [0, 20, 70, 95, stream.len()] {
                let chunks: Vec<Result<http_body::Frame<Bytes>, Infallible>> =
                    [&stream[..cut], &stream[cut..]]
                        .into_iter()
                        .filter(|c| !c.is_empty())
                        .map(|c| Ok(http_body::Frame::data(Bytes::copy_from_slice(c))))
                        .collect();
                let body = http_body_util::StreamBody::new(futures_util::stream::iter(chunks));
                let observed = ObservedStream::new(
                    crate::api::CHAT,
                    body,
                    Edits {
                        rename_model: rename.clone(),
                        redact: Some(Arc::from("sk-be-1")),
                        ..Edits::default()
                    },
                    Duration::from_secs(60),
                    backend.clone(),
                    config.health.clone(),
                    Settle::new(AccessRecord::new("r".into(), "chat", Instant::now())),
                );
                let out = observed.collect().await.unwrap().to_bytes();
                let text = String::from_utf8_lossy(&out);
                assert!(!text.contains("sk-be-1"), "{rename:?} cut {cut}: {text}");
                assert!(
                    text.contains("auth Bearer [redacted]; again [redacted]"),
                    "{text}"
                );
                assert!(text.contains("\"hi\"") && text.ends_with("data: [DONE]\n\n"));
            }
        }
        assert_eq!(
            &Redactor::new(None).apply(Bytes::from_static(b"a sk-1 b"))[..],
            b"a sk-1 b"
        );
        assert_eq!(
            &Redactor::new(Some("")).apply(Bytes::from_static(b"a sk-1 b"))[..],
            b"a sk-1 b"
        );
    }

    /// Found by fuzzing (fuzz/, target sse_observer): an error event cut by the end of the
    /// body was sent without its blank line, so the `[DONE]` after it joined its data.
    #[tokio::test]
    async fn cut_last_event_is_terminated_before_done() {
        use http_body_util::BodyExt;
        let (config, backend) = one_backend();
        let run = |body: &'static [u8]| {
            let stream = ObservedStream::new(
                crate::api::CHAT,
                http_body_util::Full::new(Bytes::from_static(body)),
                Edits::default(),
                Duration::from_secs(60),
                backend.clone(),
                config.health.clone(),
                Settle::new(AccessRecord::new("r".into(), "chat", Instant::now())),
            );
            async move { stream.collect().await.unwrap().to_bytes() }
        };
        let out = run(b"data: {\"error\":{\"message\":\"overloaded\"}}").await;
        assert_eq!(
            &out[..],
            b"data: {\"error\":{\"message\":\"overloaded\"}}\n\ndata: [DONE]\n\n"
        );
        // A cut tail that is not JSON is not sent after [DONE].
        let out = run(b"data: [DONE]\n\ndata: {\"cho").await;
        assert_eq!(&out[..], b"data: [DONE]\n\n");
        // Edited, data on two lines: both stay data lines (found by fuzzing).
        let stream = ObservedStream::new(
            crate::api::CHAT,
            http_body_util::Full::new(Bytes::from_static(
                b"data: {\"usage\":\ndata: null}\n\ndata: [DONE]\n\n",
            )),
            Edits {
                normalize_finish: true,
                ..Edits::default()
            },
            Duration::from_secs(60),
            backend.clone(),
            config.health.clone(),
            Settle::new(AccessRecord::new("r".into(), "chat", Instant::now())),
        );
        let out = stream.collect().await.unwrap().to_bytes();
        assert_eq!(
            &out[..],
            b"data: {\"usage\":\ndata: null}\n\ndata: [DONE]\n\n"
        );
    }
}

#[cfg(test)]
mod seam_tests {
    use super::*;
    use crate::api::{wire, TokenizeForm, CHAT};
    use crate::openai::edit::Splice;
    use crate::openai::RequestFields;
    use crate::telemetry::access::AccessRecord;
    use axum::response::Response;

    /// An API whose stream has no end marker and whose terminal error is a typed event (as the
    /// next APIs have): the observer follows it without knowing it.
    struct Typed;

    impl ClientApi for Typed {
        fn path(&self) -> &'static str {
            "/typed"
        }
        fn label(&self) -> &'static str {
            "typed"
        }
        fn parse(&self, body: &[u8]) -> Result<RequestFields, ApiError> {
            CHAT.parse(body)
        }
        fn streams(&self, fields: &RequestFields) -> bool {
            fields.stream
        }
        fn expected_output(&self, _: &RequestFields, default: u64) -> u64 {
            default
        }
        fn rename_model(&self, fields: &RequestFields, to: &str) -> Splice {
            CHAT.rename_model(fields, to)
        }
        fn force_stream_usage(&self, _: &[u8], _: &RequestFields) -> Option<Splice> {
            None
        }
        fn inspect(&self, data: &[u8]) -> Seen {
            let mut seen = wire::inspect(data);
            seen.done = data.starts_with(br#"{"type":"done""#);
            seen
        }
        fn whole(&self, json: &[u8]) -> Result<crate::api::Whole, serde_json::Error> {
            wire::whole(json)
        }
        fn edit(&self, json: &[u8], edits: &Edits) -> Option<Bytes> {
            wire::edit_json(json, edits)
        }
        fn end_event(&self) -> Option<&'static [u8]> {
            None
        }
        fn stream_error_event(&self, err: &ApiError) -> Bytes {
            Bytes::from(format!("event: error\ndata: {}\n\n", err.body_json()))
        }
        fn error_response(&self, err: ApiError) -> Response {
            wire::error_response(err)
        }
        fn id_prefix(&self) -> &'static str {
            "typed-"
        }
        fn native(&self, _: crate::config::BackendKind) -> bool {
            true
        }
        fn tokenize_form(&self, _: &[u8]) -> Option<TokenizeForm> {
            None
        }
    }

    static TYPED: &dyn ClientApi = &Typed;

    async fn observe(stream: &'static [u8], edits: Edits) -> String {
        observe_settled(
            stream,
            edits,
            Settle::new(AccessRecord::new("r".into(), "typed", Instant::now())),
        )
        .await
    }

    async fn observe_settled(stream: &'static [u8], edits: Edits, settle: Settle) -> String {
        use http_body_util::BodyExt;
        let config = crate::config::from_str(
            "[[backends]]\nname = \"b\"\nkind = \"vllm\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n",
            "t",
        )
        .unwrap();
        let backend = Arc::new(Backend::new(
            config.backends[0].clone(),
            Arc::new(crate::fleet::BackendState::new()),
        ));
        let observed = ObservedStream::new(
            TYPED,
            http_body_util::Full::new(Bytes::from_static(stream)),
            edits,
            Duration::from_secs(60),
            backend,
            config.health.clone(),
            settle,
        );
        let out = observed.collect().await.unwrap().to_bytes();
        String::from_utf8(out.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn the_observer_follows_the_api_it_is_given() {
        let whole = b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"type\":\"done\"}\n\n";
        // Its own end event ends the stream; no `[DONE]` is added, edited or not.
        for edits in [
            Edits::default(),
            Edits {
                rename_model: Some("x".into()),
                ..Edits::default()
            },
        ] {
            let out = observe(whole, edits).await;
            assert!(out.ends_with("data: {\"type\":\"done\"}\n\n"), "{out}");
            assert!(!out.contains("[DONE]"), "{out}");
        }
        // Cut before its end: its own terminal error event, nothing after it.
        let out = observe(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n",
            Edits::default(),
        )
        .await;
        assert!(out.contains("\"hi\""), "{out}");
        assert!(out.ends_with("\n\n") && out.contains("event: error\ndata: {\"error\":"));
        assert!(!out.contains("[DONE]"), "{out}");
    }

    #[tokio::test]
    async fn a_later_usage_report_without_a_prompt_count_keeps_the_earlier_one() {
        let seen = Arc::new(std::sync::Mutex::new(None));
        let mut settle = Settle::new(AccessRecord::new("r".into(), "typed", Instant::now()));
        let into = seen.clone();
        settle.hooks.push(Box::new(move |o: &Outcome| {
            *into.lock().unwrap() = o.usage;
        }));
        let stream = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":0}}\n\ndata: {\"choices\":[],\"usage\":{\"completion_tokens\":6}}\n\ndata: {\"type\":\"done\"}\n\n";
        observe_settled(stream, Edits::default(), settle).await;
        let usage = *seen.lock().unwrap();
        assert_eq!(
            usage,
            Some(Usage {
                prompt_tokens: 10,
                cached_tokens: None,
                completion_tokens: 6
            })
        );
    }

    #[tokio::test]
    async fn an_edited_event_keeps_its_own_fields() {
        let typed = b"event: delta\nid: 7\ndata: {\"model\":\"m\",\"choices\":[]}\n\n: ping\n\nevent: done\ndata: {\"type\":\"done\"}\n\n";
        let edits = Edits {
            rename_model: Some("x".into()),
            ..Edits::default()
        };
        let out = observe(typed, edits).await;
        assert_eq!(
            out,
            "event: delta\nid: 7\ndata: {\"model\":\"x\",\"choices\":[]}\n\n: ping\n\nevent: done\ndata: {\"type\":\"done\"}\n\n"
        );
    }
}
