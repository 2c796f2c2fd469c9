//! RAII accounting of the load Sluice itself has put on a backend.
//!
//! A [`LoadGuard`] adds one request and its expected tokens to a backend's counters when created
//! and removes exactly that when dropped — on success, error, client disconnect or panic alike.
//! Until the request's first token it also counts as a pending prefill (one request and its
//! estimated prompt tokens in [`BackendState::pending_prefill_requests`] and
//! [`BackendState::pending_prefill_tokens`]): [`LoadGuard::first_token`] or the drop, whichever
//! comes first, removes that exactly once, and the first token also takes the prompt out of the
//! tokens in flight (it is prefilled; what remains is output to decode). A guard may also hold
//! the gateway's [`WaitQueue`]: dropping it then hands the freed slot to the next waiting
//! request. At the first token it also notes whether the engine reported a queue since the
//! claim ([`LoadGuard::queue_seen`]), for settlement to tell queueing from prefill.
//!
//! Invariant: the counters ([`LoadCounters`]) change only here, through a guard; their fields
//! are private to this module. Under a concurrency cap, a guard exists only if it took a slot with
//! [`LoadGuard::claim`], which checks and increments the request count in one atomic step, so
//! concurrent requests can never together exceed the cap.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::queue::WaitQueue;
use super::BackendState;

/// What one request puts on a backend: its tokens (estimated prompt plus expected output) and,
/// of those, the prompt tokens the backend has to prefill before the first token.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    pub tokens: u64,
    pub prompt_tokens: u64,
}

impl Load {
    /// `prompt_tokens` is clamped to `tokens`.
    pub fn new(tokens: u64, prompt_tokens: u64) -> Load {
        Load {
            tokens,
            prompt_tokens: prompt_tokens.min(tokens),
        }
    }
}

impl From<u64> for Load {
    /// Tokens with no prompt to prefill.
    fn from(tokens: u64) -> Load {
        Load::new(tokens, 0)
    }
}

/// One backend's load counters: read through [`BackendState`]'s accessors, changed only by a
/// [`LoadGuard`].
#[derive(Debug, Default)]
pub(super) struct LoadCounters {
    requests: AtomicU64,
    tokens: AtomicU64,
    /// Requests without a first token yet, and their estimated prompt tokens.
    prefill_requests: AtomicU64,
    prefill_tokens: AtomicU64,
    /// Of `requests`, those run in the background (which give their slot to interactive ones),
    /// and their shares of the other counters.
    background: AtomicU64,
    background_tokens: AtomicU64,
    background_prefill_requests: AtomicU64,
    background_prefill_tokens: AtomicU64,
}

/// What the background requests in flight on a backend hold of its counters: for an
/// interactive request they are as if not there (they give way to it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Yielding {
    pub requests: u64,
    pub tokens: u64,
    pub prefill_requests: u64,
    pub prefill_tokens: u64,
}

impl Yielding {
    /// Nothing gives way.
    pub const NONE: Yielding = Yielding {
        requests: 0,
        tokens: 0,
        prefill_requests: 0,
        prefill_tokens: 0,
    };
}

impl LoadCounters {
    pub(super) fn background(&self) -> u64 {
        self.background.load(Ordering::Relaxed)
    }

    pub(super) fn background_load(&self) -> Yielding {
        Yielding {
            requests: self.background(),
            tokens: self.background_tokens.load(Ordering::Relaxed),
            prefill_requests: self.background_prefill_requests.load(Ordering::Relaxed),
            prefill_tokens: self.background_prefill_tokens.load(Ordering::Relaxed),
        }
    }

    pub(super) fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub(super) fn tokens(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }

    pub(super) fn pending_prefill_requests(&self) -> u64 {
        self.prefill_requests.load(Ordering::Relaxed)
    }

    pub(super) fn pending_prefill_tokens(&self) -> u64 {
        self.prefill_tokens.load(Ordering::Relaxed)
    }
}

/// Holds one request's share of a backend's in-flight counters.
#[derive(Debug)]
pub struct LoadGuard {
    state: Arc<BackendState>,
    tokens: u64,
    /// Prompt tokens counted as pending prefill; `None` once the first token came.
    prefill: Option<u64>,
    wake: Option<Arc<WaitQueue>>,
    /// When the request was counted here (ms, [`super::clock::monotonic_ms`]).
    since_ms: u64,
    /// The engine reported requests waiting between `since_ms` and the first token.
    queue_seen: bool,
    /// Counted among the background requests.
    background: bool,
}

impl LoadGuard {
    pub fn new(state: Arc<BackendState>, load: impl Into<Load>) -> Self {
        let load = load.into();
        state.counters().requests.fetch_add(1, Ordering::Relaxed);
        Self::counted(state, load)
    }

    /// Take one of `cap` slots (no cap: always) and count the request, or `None` if all are
    /// taken. The check and the increment are one atomic step; `yielding` more slots count as
    /// free (those background requests hold, for an interactive request they give way to).
    pub fn claim(
        state: Arc<BackendState>,
        load: impl Into<Load>,
        cap: Option<u64>,
        yielding: u64,
    ) -> Option<Self> {
        let load = load.into();
        let Some(cap) = cap else {
            return Some(Self::new(state, load));
        };
        let cap = cap.saturating_add(yielding);
        state
            .counters()
            .requests
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            })
            .ok()?;
        Some(Self::counted(state, load))
    }

    /// Count everything but the request itself (already counted by the caller).
    fn counted(state: Arc<BackendState>, load: Load) -> Self {
        let c = state.counters();
        c.tokens.fetch_add(load.tokens, Ordering::Relaxed);
        c.prefill_requests.fetch_add(1, Ordering::Relaxed);
        c.prefill_tokens
            .fetch_add(load.prompt_tokens, Ordering::Relaxed);
        LoadGuard {
            state,
            tokens: load.tokens,
            prefill: Some(load.prompt_tokens),
            wake: None,
            since_ms: super::clock::monotonic_ms(),
            queue_seen: false,
            background: false,
        }
    }

    /// Wake the next request waiting in `queue` when this guard is dropped.
    pub fn waking(mut self, queue: Arc<WaitQueue>) -> Self {
        self.wake = Some(queue);
        self
    }

    /// Count the request among the background ones (once), with its tokens and pending
    /// prefill.
    pub fn set_background(&mut self) {
        if !self.background {
            self.background = true;
            let c = self.state.counters();
            c.background.fetch_add(1, Ordering::Relaxed);
            c.background_tokens
                .fetch_add(self.tokens, Ordering::Relaxed);
            if let Some(prompt) = self.prefill {
                c.background_prefill_requests
                    .fetch_add(1, Ordering::Relaxed);
                c.background_prefill_tokens
                    .fetch_add(prompt, Ordering::Relaxed);
            }
        }
    }

    /// Tokens of this request still counted as in flight.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Prompt tokens of this request still counted as pending prefill (0 after the first token).
    pub fn pending_prefill(&self) -> u64 {
        self.prefill.unwrap_or(0)
    }

    /// Lower the request's counted tokens as output is produced (never below zero).
    pub fn release_tokens(&mut self, n: u64) {
        let n = n.min(self.tokens);
        self.tokens -= n;
        let c = self.state.counters();
        c.tokens.fetch_sub(n, Ordering::Relaxed);
        if self.background {
            c.background_tokens.fetch_sub(n, Ordering::Relaxed);
        }
    }

    /// The backend produced the request's first token: its prefill is done. Removes it from
    /// the pending prefills and its prompt from the tokens in flight; later calls do nothing.
    pub fn first_token(&mut self) {
        if let Some(prompt) = self.prefill.take() {
            self.queue_seen = self.state.waiting_seen_ms() >= self.since_ms.max(1);
            self.end_prefill(prompt);
            self.release_tokens(prompt);
        }
    }

    /// Whether a metrics read between this request's claim and its first token showed
    /// requests waiting in the engine: then it most likely waited for a batch slot too (the
    /// engine admits first come, first served), and its TTFT is queueing, not prefill. This
    /// catches what [`crate::routing::score::would_queue`] cannot know at the claim, such as a
    /// burst sent before the batch limit was learned.
    pub fn queue_seen(&self) -> bool {
        self.queue_seen
    }

    fn end_prefill(&self, prompt: u64) {
        let c = self.state.counters();
        c.prefill_requests.fetch_sub(1, Ordering::Relaxed);
        c.prefill_tokens.fetch_sub(prompt, Ordering::Relaxed);
        if self.background {
            c.background_prefill_requests
                .fetch_sub(1, Ordering::Relaxed);
            c.background_prefill_tokens
                .fetch_sub(prompt, Ordering::Relaxed);
        }
    }

    pub fn state(&self) -> &Arc<BackendState> {
        &self.state
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        if let Some(prompt) = self.prefill.take() {
            self.end_prefill(prompt);
        }
        let c = self.state.counters();
        c.requests.fetch_sub(1, Ordering::Relaxed);
        c.tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        if self.background {
            c.background.fetch_sub(1, Ordering::Relaxed);
            c.background_tokens
                .fetch_sub(self.tokens, Ordering::Relaxed);
        }
        if let Some(q) = self.wake.take() {
            q.slot_freed();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guard_releases_on_drop_and_partial_release() {
        let s = Arc::new(BackendState::new());
        {
            let mut g = LoadGuard::new(s.clone(), 100);
            let _g2 = LoadGuard::new(s.clone(), 5);
            assert_eq!(s.inflight_requests(), 2);
            g.release_tokens(30);
            assert_eq!(s.inflight_tokens(), 75);
            g.release_tokens(1000);
            assert_eq!(s.inflight_tokens(), 5);
        }
        assert_eq!(s.inflight_requests(), 0);
        assert_eq!(s.inflight_tokens(), 0);
    }

    #[test]
    fn claim_never_exceeds_the_cap_under_contention() {
        let s = Arc::new(BackendState::new());
        let peak = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (s, peak) = (s.clone(), peak.clone());
                std::thread::spawn(move || {
                    let mut taken = 0;
                    for _ in 0..20_000 {
                        if let Some(g) = LoadGuard::claim(s.clone(), 1, Some(2), 0) {
                            taken += 1;
                            let now = g.state().inflight_requests();
                            peak.fetch_max(now, Ordering::Relaxed);
                        }
                    }
                    taken
                })
            })
            .collect();
        let taken: u64 = threads.into_iter().map(|t| t.join().unwrap_or(0)).sum();
        assert!(taken > 0);
        assert!(peak.load(Ordering::Relaxed) <= 2, "cap of 2 exceeded");
        assert_eq!(pending(&s), (0, 0));
        assert_eq!(s.inflight_requests(), 0);
        assert_eq!(s.inflight_tokens(), 0);
        let a = LoadGuard::claim(s.clone(), 1, Some(1), 0);
        assert!(a.is_some());
        assert!(LoadGuard::claim(s.clone(), 1, Some(1), 0).is_none());
        assert!(LoadGuard::claim(s.clone(), 1, None, 0).is_some());
    }

    #[test]
    fn background_slots_count_as_free_only_for_what_they_yield_to() {
        let s = Arc::new(BackendState::new());
        let mut bg = LoadGuard::claim(s.clone(), 1, Some(1), 0).unwrap();
        bg.set_background();
        bg.set_background();
        assert_eq!(s.background_requests(), 1, "counted once");
        assert!(
            LoadGuard::claim(s.clone(), 1, Some(1), 0).is_none(),
            "a background one"
        );
        let interactive = LoadGuard::claim(s.clone(), 1, Some(1), s.background_requests());
        assert!(
            interactive.is_some(),
            "an interactive one takes the yielding slot"
        );
        assert!(
            LoadGuard::claim(s.clone(), 1, Some(1), s.background_requests()).is_none(),
            "one yielding slot, one request"
        );
        drop(bg);
        assert_eq!(s.background_requests(), 0);
        drop(interactive);
        assert_eq!(s.inflight_requests(), 0);
    }

    #[test]
    fn background_shares_follow_the_guard_through_first_token_release_and_drop() {
        let s = Arc::new(BackendState::new());
        let _fg = LoadGuard::new(s.clone(), Load::new(50, 20));
        let mut bg = LoadGuard::new(s.clone(), Load::new(100, 60));
        bg.set_background();
        let y = |requests, tokens, prefill_requests, prefill_tokens| Yielding {
            requests,
            tokens,
            prefill_requests,
            prefill_tokens,
        };
        assert_eq!(s.background_load(), y(1, 100, 1, 60));
        bg.release_tokens(10);
        assert_eq!(s.background_load(), y(1, 90, 1, 60));
        bg.first_token();
        assert_eq!(s.background_load(), y(1, 30, 0, 0));
        let mut late = LoadGuard::new(s.clone(), Load::new(40, 30));
        late.first_token();
        late.set_background();
        assert_eq!(
            s.background_load(),
            y(2, 40, 0, 0),
            "no prefill after the first token"
        );
        drop((bg, late));
        assert_eq!(s.background_load(), Yielding::default());
        assert_eq!(pending(&s), (1, 20), "the interactive one's, untouched");
        assert_eq!(s.inflight_tokens(), 50);
    }

    #[test]
    fn guard_releases_on_panic() {
        let s = Arc::new(BackendState::new());
        let s2 = s.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _g = LoadGuard::new(s2, 7);
            panic!("boom");
        }));
        assert!(r.is_err());
        assert_eq!(s.inflight_requests(), 0);
        assert_eq!(s.inflight_tokens(), 0);
    }

    fn pending(s: &BackendState) -> (u64, u64) {
        (s.pending_prefill_requests(), s.pending_prefill_tokens())
    }

    #[test]
    fn a_queue_reported_between_the_claim_and_the_first_token_is_seen() {
        use crate::fleet::signals::{ModelLoad, Signals};
        let s = Arc::new(BackendState::new());
        let clock = crate::fleet::clock::Virtual::install(1_000, 1);
        let report = |at_ms, waiting| Signals {
            at_ms,
            interval_ms: 500,
            total: Some(ModelLoad {
                running: 8.0,
                waiting,
                kv_usage: None,
            }),
            ..Signals::default()
        };
        // a queue reported before the claim is not this request's
        s.set_signals(report(900, 3.0));
        let mut before = LoadGuard::new(s.clone(), Load::new(100, 50));
        clock.set_ms(1_500);
        before.first_token();
        assert!(!before.queue_seen());
        // one reported while it waited is
        let mut waited = LoadGuard::new(s.clone(), Load::new(100, 50));
        s.set_signals(report(2_000, 0.0));
        s.set_signals(report(2_500, 2.0));
        s.set_signals(report(3_000, 0.0));
        clock.set_ms(3_200);
        waited.first_token();
        assert!(waited.queue_seen());
        // one reported after its first token is not
        let mut after = LoadGuard::new(s.clone(), Load::new(100, 50));
        clock.set_ms(3_300);
        after.first_token();
        s.set_signals(report(3_400, 4.0));
        after.first_token();
        assert!(!after.queue_seen());
        // reads with nothing waiting never count
        let t = Arc::new(BackendState::new());
        let mut idle = LoadGuard::new(t.clone(), Load::new(100, 50));
        t.set_signals(report(3_350, 0.0));
        idle.first_token();
        assert!(!idle.queue_seen());
    }

    #[test]
    fn pending_prefill_ends_once_at_the_first_token() {
        let s = Arc::new(BackendState::new());
        let mut a = LoadGuard::new(s.clone(), Load::new(1000, 600));
        let b = LoadGuard::claim(s.clone(), Load::new(300, 200), Some(4), 0);
        assert!(b.is_some());
        assert_eq!(pending(&s), (2, 800));
        assert_eq!(s.inflight_tokens(), 1300);
        a.first_token();
        // the prompt is prefilled: out of the pending prefills and of the tokens in flight
        assert_eq!(pending(&s), (1, 200));
        assert_eq!(a.pending_prefill(), 0);
        assert_eq!(s.inflight_tokens(), 700);
        a.release_tokens(1);
        a.first_token();
        a.first_token();
        assert_eq!(pending(&s), (1, 200), "released once only");
        assert_eq!(s.inflight_tokens(), 699);
        drop(a);
        assert_eq!(pending(&s), (1, 200));
        // never reached its first token: the drop ends its prefill
        drop(b);
        assert_eq!(pending(&s), (0, 0));
        assert_eq!(s.inflight_requests(), 0);
        assert_eq!(s.inflight_tokens(), 0);
        // the prompt is part of the tokens: never more prompt than tokens
        let c = LoadGuard::new(s.clone(), Load::new(10, 50));
        assert_eq!(pending(&s), (1, 10));
        drop(c);
        // a claim refused at the cap counts nothing
        let _full = LoadGuard::claim(s.clone(), Load::new(5, 5), Some(1), 0);
        assert!(LoadGuard::claim(s.clone(), Load::new(7, 7), Some(1), 0).is_none());
        assert_eq!(pending(&s), (1, 5));
    }

    #[test]
    fn pending_prefill_is_released_on_panic_before_and_after_the_first_token() {
        let s = Arc::new(BackendState::new());
        let s2 = s.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _g = LoadGuard::new(s2, Load::new(100, 80));
            panic!("before the first token");
        }));
        assert!(r.is_err());
        assert_eq!(pending(&s), (0, 0));
        let s2 = s.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let mut g = LoadGuard::new(s2, Load::new(100, 80));
            g.first_token();
            panic!("after the first token");
        }));
        assert!(r.is_err());
        assert_eq!(pending(&s), (0, 0));
        assert_eq!(s.inflight_requests(), 0);
        assert_eq!(s.inflight_tokens(), 0);
    }
}
