//! RAII accounting of the load Sluice itself has put on a backend.
//!
//! A [`LoadGuard`] adds one request and its expected tokens to a backend's counters when created
//! and removes exactly that when dropped — on success, error, client disconnect or panic alike.
//! A guard may also hold the gateway's [`WaitQueue`]: dropping it then hands the freed slot to
//! the next waiting request.
//!
//! Invariant: under a concurrency cap, a guard exists only if it took a slot with
//! [`LoadGuard::claim`], which checks and increments the request count in one atomic step, so
//! concurrent requests can never together exceed the cap.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::queue::WaitQueue;
use super::BackendState;

/// Holds one request's share of a backend's in-flight counters.
#[derive(Debug)]
pub struct LoadGuard {
    state: Arc<BackendState>,
    tokens: u64,
    wake: Option<Arc<WaitQueue>>,
}

impl LoadGuard {
    pub fn new(state: Arc<BackendState>, tokens: u64) -> Self {
        state.inflight_requests.fetch_add(1, Ordering::Relaxed);
        state.inflight_tokens.fetch_add(tokens, Ordering::Relaxed);
        LoadGuard {
            state,
            tokens,
            wake: None,
        }
    }

    /// Take one of `cap` slots (no cap: always) and count the request, or `None` if all are
    /// taken. The check and the increment are one atomic step.
    pub fn claim(state: Arc<BackendState>, tokens: u64, cap: Option<u64>) -> Option<Self> {
        let Some(cap) = cap else {
            return Some(Self::new(state, tokens));
        };
        state
            .inflight_requests
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < cap).then_some(n + 1)
            })
            .ok()?;
        state.inflight_tokens.fetch_add(tokens, Ordering::Relaxed);
        Some(LoadGuard {
            state,
            tokens,
            wake: None,
        })
    }

    /// Wake the next request waiting in `queue` when this guard is dropped.
    pub fn waking(mut self, queue: Arc<WaitQueue>) -> Self {
        self.wake = Some(queue);
        self
    }

    /// Tokens of this request still counted as in flight.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Lower the request's counted tokens as output is produced (never below zero).
    pub fn release_tokens(&mut self, n: u64) {
        let n = n.min(self.tokens);
        self.tokens -= n;
        self.state.inflight_tokens.fetch_sub(n, Ordering::Relaxed);
    }

    pub fn state(&self) -> &Arc<BackendState> {
        &self.state
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.state.inflight_requests.fetch_sub(1, Ordering::Relaxed);
        self.state
            .inflight_tokens
            .fetch_sub(self.tokens, Ordering::Relaxed);
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
            assert_eq!(s.inflight_requests.load(Ordering::Relaxed), 2);
            g.release_tokens(30);
            assert_eq!(s.inflight_tokens.load(Ordering::Relaxed), 75);
            g.release_tokens(1000);
            assert_eq!(s.inflight_tokens.load(Ordering::Relaxed), 5);
        }
        assert_eq!(s.inflight_requests.load(Ordering::Relaxed), 0);
        assert_eq!(s.inflight_tokens.load(Ordering::Relaxed), 0);
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
                        if let Some(g) = LoadGuard::claim(s.clone(), 1, Some(2)) {
                            taken += 1;
                            let now = g.state().inflight_requests.load(Ordering::Acquire);
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
        assert_eq!(s.inflight_requests.load(Ordering::Relaxed), 0);
        assert_eq!(s.inflight_tokens.load(Ordering::Relaxed), 0);
        let a = LoadGuard::claim(s.clone(), 1, Some(1));
        assert!(a.is_some());
        assert!(LoadGuard::claim(s.clone(), 1, Some(1)).is_none());
        assert!(LoadGuard::claim(s.clone(), 1, None).is_some());
    }

    #[test]
    fn guard_releases_on_panic() {
        let s = Arc::new(BackendState::new());
        let s2 = s.clone();
        let r = std::panic::catch_unwind(move || {
            let _g = LoadGuard::new(s2, 7);
            panic!("boom");
        });
        assert!(r.is_err());
        assert_eq!(s.inflight_requests.load(Ordering::Relaxed), 0);
        assert_eq!(s.inflight_tokens.load(Ordering::Relaxed), 0);
    }
}
