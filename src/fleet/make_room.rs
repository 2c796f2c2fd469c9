//! Room made for interactive requests by background ones. A request the gateway runs in the
//! background (a batch line, marked [`Background`]) holds a batch slot like any other; when an
//! interactive request finds no free slot, the request path [`MakeRoom::ask`]s for one of its
//! model, and one background request of that model running gives its slot up: it stops (the
//! engine aborts it when its connection drops) and its owner runs it again later. A request
//! waiting in the gateway's queue asks for a slot anywhere (it takes the first one freed); one
//! sent to an engine that will queue it, or over a cap into a slot a background request holds
//! ([`crate::fleet::Backend::has_slot_for`]), asks for a slot on that engine.
//!
//! Invariants: an ask is granted at most once (taken under the lock), so one interactive
//! request never stops two background ones; an ask for a backend is taken only by a background
//! request running there; an ask nobody takes within [`ASK_LIFETIME`] lapses, so a background
//! request routed later is never stopped for an interactive one already served; with no
//! background request running an ask costs one atomic read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// How long an ask waits for a background request to take it.
pub const ASK_LIFETIME: Duration = Duration::from_millis(250);

/// Marks a request the gateway runs in the background, in its `http::Extensions` (which only
/// the gateway's own code can fill), and learns from the request path where it runs.
#[derive(Debug, Clone, Default)]
pub struct Background {
    on: Arc<Mutex<Option<String>>>,
}

impl Background {
    /// The request now runs on `backend` (each attempt, failovers included).
    pub fn routed(&self, backend: &str) {
        *lock(&self.on) = Some(backend.to_string());
    }

    fn backend(&self) -> Option<String> {
        lock(&self.on).clone()
    }
}

/// An open ask: when, and for which backend (`None`: any).
#[derive(Debug)]
struct Ask {
    at: Instant,
    backend: Option<String>,
}

/// The open asks for room, per canonical model.
#[derive(Debug, Default)]
pub struct MakeRoom {
    asks: Mutex<HashMap<String, Vec<Ask>>>,
    asked: Notify,
    /// Background requests listening for asks.
    listening: AtomicUsize,
}

impl MakeRoom {
    /// An interactive request of `model` found no free slot: on `backend`, where it was sent,
    /// or (`None`) on any backend.
    pub fn ask(&self, model: &str, backend: Option<&str>) {
        if self.listening.load(Ordering::Relaxed) == 0 {
            return;
        }
        self.ask_at(model, backend, Instant::now());
        self.asked.notify_waiters();
    }

    fn ask_at(&self, model: &str, backend: Option<&str>, now: Instant) {
        {
            let mut asks = lock(&self.asks);
            let open = asks.entry(model.to_string()).or_default();
            open.retain(|a| now.duration_since(a.at) < ASK_LIFETIME);
            open.push(Ask {
                at: now,
                backend: backend.map(str::to_string),
            });
        }
    }

    /// Resolves when the background request `me` of `model` is to give its slot up (it took
    /// an open ask for the backend it runs on); never otherwise.
    pub async fn asked(&self, model: &str, me: &Background) {
        self.listening.fetch_add(1, Ordering::Relaxed);
        let _listening = Listening(&self.listening);
        loop {
            let next = self.asked.notified();
            if self.take(model, me, Instant::now()) {
                return;
            }
            next.await;
        }
    }

    /// Take the newest open ask of `model` for the backend `me` runs on or for any, if any.
    fn take(&self, model: &str, me: &Background, now: Instant) -> bool {
        let Some(on) = me.backend() else {
            return false;
        };
        let mut asks = lock(&self.asks);
        let Some(open) = asks.get_mut(model) else {
            return false;
        };
        open.retain(|a| now.duration_since(a.at) < ASK_LIFETIME);
        let mine = |a: &Ask| a.backend.as_ref().is_none_or(|b| *b == on);
        let taken = match open.iter().rposition(mine) {
            Some(i) => {
                open.remove(i);
                true
            }
            None => false,
        };
        if open.is_empty() {
            asks.remove(model);
        }
        taken
    }
}

/// One background request listening for asks, until dropped.
struct Listening<'a>(&'a AtomicUsize);

impl Drop for Listening<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(backend: &str) -> Background {
        let b = Background::default();
        b.routed(backend);
        b
    }

    #[test]
    fn one_ask_is_taken_once_by_a_background_request_of_its_model_on_its_backend() {
        let room = MakeRoom::default();
        let t = Instant::now();
        room.ask_at("m", Some("a"), t);
        assert!(!room.take("other", &on("a"), t), "another model");
        assert!(!room.take("m", &on("b"), t), "another backend");
        assert!(!room.take("m", &Background::default(), t), "not routed yet");
        assert!(room.take("m", &on("a"), t));
        assert!(!room.take("m", &on("a"), t), "taken once");
        room.ask_at("m", Some("a"), t);
        room.ask_at("m", Some("b"), t);
        assert!(room.take("m", &on("b"), t));
        assert!(room.take("m", &on("a"), t));
        room.ask_at("m", None, t);
        assert!(room.take("m", &on("c"), t), "any backend");
        assert!(!room.take("m", &on("a"), t));
    }

    #[test]
    fn an_ask_nobody_takes_lapses() {
        let room = MakeRoom::default();
        let t = Instant::now();
        room.ask_at("m", None, t);
        assert!(!room.take("m", &on("a"), t + ASK_LIFETIME));
        room.ask_at("m", None, t + ASK_LIFETIME);
        assert!(room.take("m", &on("a"), t + ASK_LIFETIME));
    }

    #[tokio::test]
    async fn an_ask_wakes_the_background_request_it_names() {
        let room = Arc::new(MakeRoom::default());
        room.ask("m", Some("a"));
        assert!(lock(&room.asks).is_empty(), "nobody listens: nothing kept");
        let me = on("a");
        let (r, m) = (room.clone(), me.clone());
        let waiting = tokio::spawn(async move { r.asked("m", &m).await });
        let deadline = Instant::now() + Duration::from_secs(10);
        while room.listening.load(Ordering::Relaxed) == 0 {
            assert!(Instant::now() < deadline, "the background request listens");
            tokio::task::yield_now().await;
        }
        room.ask("m", Some("a"));
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("woken")
            .expect("no panic");
        assert_eq!(room.listening.load(Ordering::Relaxed), 0);
    }
}
