//! Waiting for a backend's response head, and leaving that wait early.
//!
//! A request that has sent nothing to its client is withdrawn from its backend the moment the
//! backend enters a failed state ([`Health::failed`]: ejected by live traffic, down by probes,
//! refusing connections), whoever noticed: the prober, another request's passive detection,
//! or a hang signal. The attempt loop then sends it to the next-best backend within the usual
//! `routing.max_attempts` and `routing.failover_deadline`, instead of letting it sit until its
//! own first-byte timeout.
//!
//! The hang deadline: a wait for the head longer than `health.hang_factor` × the backend's
//! expected time to it (its learned TTFT and queue, from the routing score) plus
//! `health.hang_grace`, while another candidate answered since the request was sent, is a live
//! failure of that backend ("hang"): enough of them eject it, which rescues its other waiters.
//!
//! Invariants:
//! - No polling: a wait selects on the send, the backend's withdrawal channel
//!   ([`crate::fleet::BackendState::withdrawals`]) and at most one timer.
//! - A withdrawn attempt is counted once (`sluice_backend_requests_total{outcome="rescued"}`,
//!   `sluice_rescues_total`) and is not a new live failure of the backend: its state already
//!   says it failed.
//! - A hang signal is recorded at most once per attempt.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::upstream::Body as Incoming;
use http::header;

use super::attempt::{attempt_span, end_attempt_span, rewrite, Answer};
use super::headers;
use super::pick::Claimed;
use super::prepare::Prepared;
use crate::api::translate::{self, Reply};
use crate::api::BodyForm;
use crate::config::Config;
use crate::fleet::backend::monotonic_ms;
use crate::fleet::{Backend, Health};
use crate::openai::ApiError;
use crate::routing::RouteInput;
use crate::telemetry::access::AccessRecord;
use crate::telemetry::metrics as m;
use crate::telemetry::otel::Phase;
use crate::upstream::{self as forward, AttemptError};

/// What a send ends with: a response head, or the failure that left none.
pub(super) type Sent = Result<http::Response<Incoming>, AttemptError>;

/// One copy of the request on its way to one backend.
pub(super) struct Copy<'a> {
    /// The backend (an index into the request's candidates) with its slot.
    pub(super) claimed: Claimed,
    send: Pin<Box<dyn Future<Output = Sent> + Send + 'a>>,
    hang: Option<HangWatch>,
    /// Since the request arrived, when this copy was sent.
    sent_after: Duration,
    /// A non-streamed answer (or an error body) must be complete by then.
    pub(super) body_deadline: tokio::time::Instant,
    strip_usage: bool,
    /// The copy went to a backend that serves the API by translation: its chat completion is
    /// put back into the client API's shape.
    reply: Option<Arc<dyn Reply>>,
    /// The attempt's span, when tracing is on: ended by the attempt with its outcome.
    pub(super) span: Option<Phase>,
}

impl<'a> Copy<'a> {
    /// Rewrite the body for the claimed backend and send it. Only the first copy of an
    /// attempt watches for a hang (a hedge is sent at most once).
    pub(super) fn launch(
        config: &Config,
        p: &'a Prepared,
        claimed: Claimed,
        record: &AccessRecord,
        watch_hang: bool,
    ) -> Copy<'a> {
        let (backend, backend_model) = &p.resolved.candidates[claimed.idx];
        let translated = p
            .translation
            .as_ref()
            .filter(|_| !p.api.native(backend.kind()));
        let (upstream_body, strip_usage, path) = match translated {
            Some(t) => (t.body(backend_model), false, translate::CHAT_PATH),
            None => {
                let (body, strip) = rewrite(p, backend_model);
                (body, strip, p.api.path())
            }
        };
        let mut headers = headers::upstream_headers(
            &p.client_headers,
            &record.request_id,
            backend.config.api_key.as_deref(),
        );
        if p.api.body_form() == BodyForm::Multipart {
            // The boundary is in the content type: the body is only readable with it.
            if let Some(ct) = p.client_headers.get(header::CONTENT_TYPE) {
                headers.insert(header::CONTENT_TYPE, ct.clone());
            }
        }
        let span = record.trace.as_ref().map(|t| {
            let span = attempt_span(t, backend, backend_model, !watch_hang);
            // the engine's own span (vLLM's) becomes this attempt's child
            span.inject(&mut headers);
            span
        });
        let timeouts = backend.config.timeouts;
        let head_timeout = if p.streaming {
            timeouts.first_byte
        } else {
            timeouts.response
        };
        let hang = watch_hang
            .then(|| {
                HangWatch::new(
                    config,
                    &p.resolved.candidates,
                    claimed.idx,
                    &p.input,
                    p.streaming,
                )
            })
            .flatten();
        backend.state.count_request();
        Copy {
            claimed,
            send: Box::pin(forward::send(
                backend,
                path,
                headers,
                upstream_body,
                head_timeout,
            )),
            hang,
            sent_after: record.started.elapsed(),
            // A non-streamed answer (or an error body) must be complete within
            // `timeouts.response` of the send, so a backend trickling bytes just faster than
            // `idle` cannot hold it.
            body_deadline: tokio::time::Instant::now() + timeouts.response,
            strip_usage,
            reply: translated.map(|t| t.reply.clone()),
            span,
        }
    }

    /// End this copy's span (when tracing): see [`end_attempt_span`].
    pub(super) fn end_span(
        &self,
        attempt: usize,
        outcome: &'static str,
        status: Option<u16>,
        why: Option<&str>,
    ) {
        if let Some(span) = &self.span {
            end_attempt_span(span, attempt, outcome, status, why);
        }
    }

    /// The answer this copy's head makes.
    pub(super) fn answer(self, resp: http::Response<Incoming>) -> Answer {
        Answer {
            resp,
            claimed: self.claimed,
            sent_after: self.sent_after,
            body_deadline: self.body_deadline,
            strip_usage: self.strip_usage,
            reply: self.reply,
        }
    }

    async fn wait(&mut self, config: &Config, p: &Prepared) -> Waited<Sent> {
        let backend = &p.resolved.candidates[self.claimed.idx].0;
        await_head(config, backend, self.send.as_mut(), &mut self.hang).await
    }
}

/// Wait for the first of (at most two) copies to finish its wait; its index and how.
pub(super) async fn await_any(
    config: &Config,
    p: &Prepared,
    copies: &mut [Copy<'_>],
) -> (usize, Waited<Sent>) {
    match copies {
        [] => std::future::pending().await,
        [a] => (0, a.wait(config, p).await),
        [a, b, ..] => tokio::select! {
            w = a.wait(config, p) => (0, w),
            w = b.wait(config, p) => (1, w),
        },
    }
}

/// The copies left when another answered: dropped by the caller (their connections close,
/// their engines abort, their slots are freed); counted here.
pub(super) fn cancel(p: &Prepared, copies: &[Copy<'_>]) {
    for c in copies {
        let backend = &p.resolved.candidates[c.claimed.idx].0;
        m::backend_request(backend.name(), "cancelled");
        c.end_span(0, "cancelled", None, None);
    }
}

/// How long to look again for other backends answering when none had at the hang deadline.
const HANG_RECHECK: Duration = Duration::from_secs(1);

/// How a wait for a response head ended.
pub(super) enum Waited<T> {
    /// The send finished: a head, or a failure without one.
    Head(T),
    /// The backend entered this failed state first.
    Withdrawn(Health),
    /// The hang deadline passed while other backends answered (a signal was recorded).
    Hung,
}

/// The hang deadline of one attempt.
pub(super) struct HangWatch {
    at: tokio::time::Instant,
    /// When the request was sent (ms since process start).
    sent_ms: u64,
    /// The other candidates, whose answers make a long wait here a hang.
    others: Vec<Arc<Backend>>,
}

impl HangWatch {
    /// The deadline of a request sent now to `candidates[idx]` (none when
    /// `health.hang_factor` is 0).
    pub(super) fn new<T: AsRef<str>>(
        config: &Config,
        candidates: &[(Arc<Backend>, T)],
        idx: usize,
        input: &RouteInput,
        streaming: bool,
    ) -> Option<HangWatch> {
        let h = &config.health;
        if h.hang_factor <= 0.0 {
            return None;
        }
        let expected = crate::routing::expected_head_seconds(candidates, idx, input, streaming);
        let after = Duration::try_from_secs_f64(expected * h.hang_factor)
            .unwrap_or(Duration::MAX)
            .saturating_add(h.hang_grace);
        let at = tokio::time::Instant::now().checked_add(after)?;
        let others = (0..candidates.len())
            .filter(|i| *i != idx)
            .map(|i| candidates[i].0.clone())
            .collect();
        Some(HangWatch {
            at,
            sent_ms: monotonic_ms(),
            others,
        })
    }

    /// Whether another candidate answered a request since this one was sent.
    fn others_answering(&self) -> bool {
        self.others
            .iter()
            .any(|b| b.state.last_answer_ms() >= self.sent_ms)
    }
}

/// Wait for `send` to finish, unless `backend` fails first or the hang deadline passes while
/// other backends answer (then a hang signal is recorded and the watch disarmed; the caller
/// may wait again).
pub(super) async fn await_head<F: Future + ?Sized>(
    config: &Config,
    backend: &Backend,
    mut send: Pin<&mut F>,
    hang: &mut Option<HangWatch>,
) -> Waited<F::Output> {
    let mut withdrawals = backend.state.withdrawals();
    // Subscribed first: a failure after this check wakes the receiver. (The health as set, not
    // as routing sees it: a failed member that also left the fleet shows `draining`.)
    let health = backend.state.health_as_set();
    if health.failed() {
        return Waited::Withdrawn(health);
    }
    loop {
        let hang_at = hang.as_ref().map(|h| h.at);
        tokio::select! {
            biased;
            out = send.as_mut() => return Waited::Head(out),
            changed = withdrawals.changed() => {
                if changed.is_err() {
                    // The state is gone with its sender: nothing can withdraw the request.
                    return Waited::Head(send.as_mut().await);
                }
                // A change is always an entry into a failed state.
                return Waited::Withdrawn(backend.state.health_as_set());
            }
            () = sleep_until_some(hang_at) => {
                let Some(watch) = hang.as_mut() else { continue };
                if watch.others_answering() {
                    *hang = None;
                    hang_signal(config, backend);
                    return Waited::Hung;
                }
                watch.at = tokio::time::Instant::now() + HANG_RECHECK;
            }
        }
    }
}

async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A request waited far longer than `backend` explains while others answered: a live failure.
fn hang_signal(config: &Config, backend: &Backend) {
    tracing::warn!(
        backend = backend.name(),
        "no response head long past the expected time while other backends answer: hang"
    );
    metrics::counter!(m::HANG_SIGNALS_TOTAL, "backend" => backend.name().to_string()).increment(1);
    backend
        .state
        .record_live_failure(&config.health, false, "hang");
}

/// The failure a withdrawn attempt leaves (the client sees it only if no attempt is left).
pub(super) fn withdrawn(backend: &Backend, health: Health, request_id: &str) -> ApiError {
    tracing::info!(
        request_id,
        backend = backend.name(),
        state = health.as_str(),
        "backend failed while the request waited for it; rescuing it elsewhere"
    );
    m::backend_request(backend.name(), "rescued");
    metrics::counter!(m::RESCUES_TOTAL, "backend" => backend.name().to_string()).increment(1);
    ApiError::bad_gateway(format!(
        "Backend `{}` became {} while the request waited for its answer.",
        backend.name(),
        health.as_str()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::speed::Observation;
    use crate::fleet::BackendState;

    fn candidates(config: &Config) -> Vec<(Arc<Backend>, String)> {
        config
            .backends
            .iter()
            .map(|c| {
                let b = Backend::new(c.clone(), Arc::new(BackendState::new()));
                (Arc::new(b), "m".to_string())
            })
            .collect()
    }

    fn config(health: &str) -> Config {
        let mut t = format!("[health]\n{health}\n");
        for name in ["slow", "fast"] {
            t.push_str(&format!("[[backends]]\nname = \"{name}\"\nkind = \"vllm\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n"));
        }
        crate::config::from_str(&t, "t").unwrap()
    }

    /// `b` measured at `prefill_tps` on 1000-token prompts and 50 output tokens a second.
    fn measure(b: &Backend, prefill_tps: f64) {
        let ttft = 1000.0 / prefill_tps;
        for _ in 0..10 {
            let o = Observation {
                prompt_tokens: 1000,
                cached_tokens: 0,
                completion_tokens: 100,
                ttft: Some(Duration::from_secs_f64(ttft)),
                total: Duration::from_secs_f64(ttft + 2.0),
                queued: false,
            };
            b.state.speeds().observe(&o, 1.0);
        }
    }

    fn input() -> RouteInput {
        RouteInput {
            tokens: 1100,
            prefix_hash: None,
            prompt_tokens: 1000,
            prefix_tokens: 0,
            prompt: None,
            prompt_exact: false,
            adapter: None,
            background: false,
        }
    }

    /// Seconds from now to the hang deadline of `candidates[idx]`.
    fn after(config: &Config, c: &[(Arc<Backend>, String)], idx: usize, stream: bool) -> f64 {
        let w = HangWatch::new(config, c, idx, &input(), stream).unwrap();
        (w.at - tokio::time::Instant::now()).as_secs_f64()
    }

    #[tokio::test]
    async fn the_hang_deadline_follows_each_backends_learned_speed() {
        let config = config("hang_factor = 4\nhang_grace = \"5s\"");
        let c = candidates(&config);
        measure(&c[0].0, 100.0); // 10 s to the first token of 1000 prompt tokens
        measure(&c[1].0, 10_000.0); // 0.1 s
                                    // 4 × 10 s + 5 s against 4 × 0.1 s + 5 s (a stream waits for its first token).
        let slow = after(&config, &c, 0, true);
        let fast = after(&config, &c, 1, true);
        assert!((44.0..46.0).contains(&slow), "{slow}");
        assert!((5.3..5.5).contains(&fast), "{fast}");
        // A non-streamed request waits for its whole answer: the decode is expected too.
        assert!(after(&config, &c, 1, false) > fast + 1.0);
        // A queue at the backend is time the request is expected to wait.
        let _busy: Vec<_> = (0..300)
            .map(|_| {
                crate::fleet::LoadGuard::new(
                    c[1].0.state.clone(),
                    crate::fleet::Load::new(1100, 1000),
                )
            })
            .collect();
        assert!(after(&config, &c, 1, true) > fast + 10.0);
    }

    #[tokio::test]
    async fn no_deadline_when_off_and_others_count_only_after_the_send() {
        let off = config("hang_factor = 0");
        let c = candidates(&off);
        assert!(HangWatch::new(&off, &c, 0, &input(), true).is_none());
        let on = config("");
        let c = candidates(&on);
        c[1].0.state.record_live_success();
        // (the clock has millisecond steps: the answer must be at a later millisecond)
        std::thread::sleep(Duration::from_millis(2));
        let w = HangWatch::new(&on, &c, 0, &input(), true).unwrap();
        assert!(
            !w.others_answering(),
            "an answer before the send does not count"
        );
        std::thread::sleep(Duration::from_millis(2));
        c[0].0.state.record_live_success();
        assert!(
            !w.others_answering(),
            "its own backend's answers do not count"
        );
        c[1].0.state.record_live_success();
        assert!(w.others_answering());
    }
}
