//! What one connection's task and its requests share: the connection's [`Activity`] (requests
//! started and in flight, when the last one finished, client resets) and each request's
//! [`InFlight`] place in it.
//!
//! Invariants: a request counts as in flight from the service call until its response body is
//! finished or dropped ([`InFlight`] is held by the response body, see [`super::body`]), so
//! the idle deadline never runs while a request is in flight; the connection's task is woken
//! when the last request in flight finishes (to re-arm the idle deadline) and once, at most,
//! when the client resets more than `http2_max_client_resets` requests within
//! [`ConnectionLimits::RESET_WINDOW`].

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::config::validate::ConnectionLimits;

/// One connection's activity, shared by its task and its requests.
pub(super) struct Activity {
    pub(super) started: Instant,
    /// Requests started (the service was called).
    requests: AtomicU64,
    /// Requests whose response is not finished yet.
    inflight: AtomicUsize,
    /// Milliseconds after `started` when the last request finished.
    last_done_ms: AtomicU64,
    /// Client resets in the current window, and the window's start (ms after `started`).
    resets: AtomicU32,
    reset_window_ms: AtomicU64,
    flooded: AtomicBool,
    pub(super) flood: Notify,
    /// Woken when the last request in flight finishes, so the idle deadline is re-armed.
    pub(super) idle: Notify,
}

impl Activity {
    pub(super) fn new() -> Activity {
        Activity {
            started: Instant::now(),
            requests: AtomicU64::new(0),
            inflight: AtomicUsize::new(0),
            last_done_ms: AtomicU64::new(0),
            resets: AtomicU32::new(0),
            reset_window_ms: AtomicU64::new(0),
            flooded: AtomicBool::new(false),
            flood: Notify::new(),
            idle: Notify::new(),
        }
    }

    /// Milliseconds since the connection started.
    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn at(&self, ms: u64) -> Instant {
        self.started + Duration::from_millis(ms)
    }

    /// When this connection becomes too idle, and the metric kind; `None` while a request is
    /// in flight.
    pub(super) fn idle_deadline(&self, l: &ConnectionLimits) -> Option<(Instant, &'static str)> {
        if self.inflight.load(Ordering::Acquire) > 0 {
            return None;
        }
        if self.requests.load(Ordering::Acquire) == 0 {
            return Some((self.started + l.header_read_timeout, "header"));
        }
        let last = self.at(self.last_done_ms.load(Ordering::Acquire));
        Some((last + l.idle_timeout, "idle"))
    }

    /// Count a request the client cancelled; past the limit, wake the connection's task once.
    fn client_reset(&self, l: &ConnectionLimits) {
        let now = self.elapsed_ms();
        let window = u64::try_from(ConnectionLimits::RESET_WINDOW.as_millis()).unwrap_or(10_000);
        let start = self.reset_window_ms.load(Ordering::Acquire);
        let n = if now.saturating_sub(start) >= window {
            self.reset_window_ms.store(now, Ordering::Release);
            self.resets.store(1, Ordering::Release);
            1
        } else {
            self.resets.fetch_add(1, Ordering::AcqRel).saturating_add(1)
        };
        if n > l.http2_max_client_resets && !self.flooded.swap(true, Ordering::AcqRel) {
            self.flood.notify_one();
        }
    }
}

/// Holds one request's place in its connection's in-flight count, from the service call until
/// the response body is finished or dropped.
pub(super) struct InFlight {
    act: Arc<Activity>,
    limits: Arc<ConnectionLimits>,
    h2: bool,
    pub(super) answered: bool,
    /// Set by the request body when the client broke it off (an HTTP/2 stream reset while
    /// the body was read, which the handler answers before hyper notices the reset).
    pub(super) body_broken: Arc<AtomicBool>,
}

impl InFlight {
    pub(super) fn new(act: Arc<Activity>, limits: Arc<ConnectionLimits>, h2: bool) -> InFlight {
        act.requests.fetch_add(1, Ordering::AcqRel);
        act.inflight.fetch_add(1, Ordering::AcqRel);
        InFlight {
            act,
            limits,
            h2,
            answered: false,
            body_broken: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.act
            .last_done_ms
            .store(self.act.elapsed_ms(), Ordering::Release);
        if self.act.inflight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.act.idle.notify_one();
        }
        if self.h2 && (!self.answered || self.body_broken.load(Ordering::Acquire)) {
            // The stream was reset (or the connection lost) before the response head, or
            // while its body was being read.
            self.act.client_reset(&self.limits);
        }
    }
}
