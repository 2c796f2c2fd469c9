//! Settlement: what is released and recorded when a request is over.
//!
//! A request carries one [`Settle`] from the moment a backend is chosen. It holds the load
//! guard, the access record and the hooks other layers registered (limits reconcile their
//! reservations, the fleet learns speeds); the proxy fills in the usage and whether the answer
//! was complete.
//!
//! Invariant: [`Settle`] runs exactly once, on [`Settle::finish`] or on drop (the client left):
//! the load guard is released before the hooks run, the access line is written last.

use std::time::Duration;

use crate::fleet::LoadGuard;
use crate::openai::usage::Usage;
use crate::telemetry::access::AccessRecord;

/// How a request ended, for settlement hooks (limits reconcile with it).
#[derive(Debug, Clone)]
pub struct Outcome {
    pub usage: Option<Usage>,
    /// The backend produced the whole answer.
    pub complete: bool,
    /// Since the request arrived: until the first token (streams), until the end.
    pub ttft: Option<Duration>,
    pub elapsed: Duration,
    /// The answer is not final: the backend goes on producing it under this id (a background
    /// response), so its usage comes later.
    pub pending: Option<String>,
    /// The answer was finished by another backend than the one it started on (a broken
    /// stream continued): its timings and usage are not the first backend's.
    pub continued: bool,
    /// The engine reported requests waiting while this one awaited its first token
    /// ([`LoadGuard::queue_seen`]): its TTFT is no prefill-speed sample.
    pub queue_seen: bool,
    /// Why the answer ended, as a stream's last event or a whole answer said (see
    /// [`crate::api::Seen::finish`]).
    pub finish: Option<&'static str>,
}

/// Work to do when a request is over.
pub type SettleHook = Box<dyn FnOnce(&Outcome) + Send>;

/// Everything released when a request is over; runs once, on completion or drop.
pub struct Settle {
    pub record: AccessRecord,
    pub guard: Option<LoadGuard>,
    pub hooks: Vec<SettleHook>,
    pub usage: Option<Usage>,
    pub complete: bool,
    /// The gateway's estimate of the prompt's tokens (charged when a stream ends without a
    /// usage report after output was produced: a cut stream is not free).
    pub prompt_estimate: u64,
    /// Text-bearing events streamed to the client (≈ tokens).
    pub streamed_tokens: u64,
    /// See [`Outcome::pending`].
    pub pending: Option<String>,
    /// A broken stream was continued on another backend.
    pub continued: bool,
    /// Why the answer ended, by a stream's events or the whole answer.
    pub finish: Option<&'static str>,
    done: bool,
}

impl Settle {
    pub fn new(record: AccessRecord) -> Settle {
        Settle {
            record,
            guard: None,
            hooks: Vec::new(),
            usage: None,
            complete: false,
            prompt_estimate: 0,
            streamed_tokens: 0,
            pending: None,
            continued: false,
            finish: None,
            done: false,
        }
    }

    /// Settle now unless it already ran (the streamed body calls this when its last byte is
    /// sent).
    pub fn run(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        if self.usage.is_none() && self.streamed_tokens > 0 {
            // Output was produced but no usage came (cut, or the client left): charge the
            // estimate, so interrupting a stream is not a way around token limits.
            self.usage = Some(Usage {
                prompt_tokens: self.prompt_estimate,
                completion_tokens: self.streamed_tokens,
                cached_tokens: None,
            });
            self.record.usage_estimated = true;
        }
        if let Some(u) = self.usage {
            self.record.prompt_tokens = Some(u.prompt_tokens);
            self.record.completion_tokens = Some(u.completion_tokens);
        }
        let queue_seen = self.guard.as_ref().is_some_and(LoadGuard::queue_seen);
        self.guard = None;
        let outcome = Outcome {
            usage: self.usage,
            complete: self.complete,
            ttft: self.record.ttft,
            elapsed: self.record.started.elapsed(),
            pending: self.pending.take(),
            continued: self.continued,
            queue_seen,
            finish: self.finish,
        };
        for hook in self.hooks.drain(..) {
            hook(&outcome);
        }
        self.record.finish();
    }

    /// Settle now (for responses that are not streamed).
    pub fn finish(mut self) {
        self.run();
    }
}

impl Drop for Settle {
    fn drop(&mut self) {
        if !self.done && !self.complete && self.record.error.is_none() {
            self.record.cancelled = true;
        }
        self.run();
    }
}
