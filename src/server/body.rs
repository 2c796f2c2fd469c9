//! The two body wrappers of the client side: [`TrackedBody`] (a response body that keeps its
//! request counted in flight) and [`TimedBody`] (a request body under a deadline).
//!
//! Invariants: a `TrackedBody` releases its request's [`InFlight`] exactly once, when it is
//! finished or dropped; a `TimedBody` never yields after its deadline passed (it stays
//! pending and fires its notification once), and marks the request broken when the client
//! broke the body off.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

use super::activity::InFlight;

/// A response body that holds its request's [`InFlight`] until it is finished or dropped.
pub struct TrackedBody {
    inner: Body,
    _flight: InFlight,
}

impl TrackedBody {
    pub(super) fn new(inner: Body, flight: InFlight) -> TrackedBody {
        TrackedBody {
            inner,
            _flight: flight,
        }
    }
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that must arrive within a deadline from its head. When the deadline passes
/// it stops yielding (stays pending) and fires `fired`, so the service answers 408 in place of
/// whatever the handler would have made of a read error. The timer is armed on first poll
/// only: a handler that never reads the body never pays for it.
pub struct TimedBody {
    inner: Incoming,
    deadline: Instant,
    timer: Option<Pin<Box<Sleep>>>,
    fired: Option<Arc<Notify>>,
    /// Set when the client breaks the body off (reset, connection error).
    broken: Arc<AtomicBool>,
    done: bool,
}

impl TimedBody {
    pub(super) fn new(
        inner: Incoming,
        timeout: Duration,
        fired: Arc<Notify>,
        broken: Arc<AtomicBool>,
    ) -> TimedBody {
        TimedBody {
            inner,
            deadline: Instant::now() + timeout,
            timer: None,
            fired: Some(fired),
            broken,
            done: false,
        }
    }
}

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if this.done {
            return Pin::new(&mut this.inner).poll_frame(cx);
        }
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            if matches!(frame, Some(Err(_))) {
                this.broken.store(true, Ordering::Release);
            }
            if frame.is_none() || this.inner.is_end_stream() {
                this.done = true;
                this.timer = None;
            }
            return Poll::Ready(frame);
        }
        let deadline = this.deadline;
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if timer.as_mut().poll(cx).is_ready() {
            if let Some(f) = this.fired.take() {
                f.notify_one();
            }
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
