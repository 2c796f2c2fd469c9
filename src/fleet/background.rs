//! How many background requests (batch lines) a backend may hold at once.
//!
//! Whoever runs them (the batch runner's step budget) publishes a bound linear in the
//! interactive requests the backend runs, `max(1, ⌊lines + per_interactive × n⌋)`: the more
//! interactive requests share a step, the longer the step a line's cost hides in. The bound
//! holds while interactive traffic is there. A backend with no interactive request in flight
//! and none routed to it for [`IDLE`] has no interactive time to protect: its allowance is
//! lifted, so a batch alone fills the free slots. The first interactive request routed there
//! afterwards makes the lines over the bound give way ([`super::make_room`]).
//!
//! Invariant: all state is atomic; reading the allowance never blocks a request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How long a backend must have had no interactive request for its allowance to be lifted.
pub const IDLE: Duration = Duration::from_secs(5);

/// A bound on the background requests of a backend: `lines + per_interactive × n`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LineBound {
    pub lines: f64,
    pub per_interactive: f64,
}

impl LineBound {
    /// The allowance with `interactive` requests in flight: at least one line.
    pub fn at(self, interactive: u64) -> u64 {
        let n = (self.lines + self.per_interactive * interactive as f64).floor();
        if n.is_nan() {
            return 1;
        }
        // (`as` saturates: an infinite bound is the largest)
        (n.max(1.0) as u64).min(u64::MAX - 1)
    }
}

/// One backend's published bound and its last interactive request.
#[derive(Debug)]
pub struct Allowance {
    /// `LineBound`'s two fields as f64 bits; `lines` is `u64::MAX` for no bound.
    lines: AtomicU64,
    per_interactive: AtomicU64,
    /// When an interactive request was last routed here (ms, [`super::clock::monotonic_ms`];
    /// 0: never).
    last_interactive_ms: AtomicU64,
}

impl Default for Allowance {
    fn default() -> Self {
        Allowance {
            lines: AtomicU64::new(u64::MAX),
            per_interactive: AtomicU64::new(0),
            last_interactive_ms: AtomicU64::new(0),
        }
    }
}

impl Allowance {
    /// Publish the bound (`None`: none but the slots).
    pub fn set(&self, bound: Option<LineBound>) {
        match bound {
            Some(b) => {
                self.per_interactive
                    .store(b.per_interactive.to_bits(), Ordering::Relaxed);
                self.lines.store(b.lines.to_bits(), Ordering::Relaxed);
            }
            None => self.lines.store(u64::MAX, Ordering::Relaxed),
        }
    }

    /// The published bound.
    pub fn bound(&self) -> Option<LineBound> {
        match self.lines.load(Ordering::Relaxed) {
            u64::MAX => None,
            bits => Some(LineBound {
                lines: f64::from_bits(bits),
                per_interactive: f64::from_bits(self.per_interactive.load(Ordering::Relaxed)),
            }),
        }
    }

    /// An interactive request was routed here at `now_ms`, with `others` interactive
    /// requests in flight besides it. Whether the backend was idle until then (no bound held).
    pub fn interactive_routed(&self, now_ms: u64, others: u64) -> bool {
        let last = self
            .last_interactive_ms
            .fetch_max(now_ms.max(1), Ordering::Relaxed);
        idle(others, last, now_ms)
    }

    /// The allowance with `interactive` requests in flight at `now_ms` (`None`: no bound).
    pub fn allowance(&self, interactive: u64, now_ms: u64) -> Option<u64> {
        let bound = self.bound()?;
        let last = self.last_interactive_ms.load(Ordering::Relaxed);
        (!idle(interactive, last, now_ms)).then(|| bound.at(interactive))
    }
}

/// No interactive request in flight, and none routed (last at `last_ms`, 0: never) for
/// [`IDLE`].
fn idle(interactive: u64, last_ms: u64, now_ms: u64) -> bool {
    let idle_ms = u64::try_from(IDLE.as_millis()).unwrap_or(u64::MAX);
    interactive == 0 && (last_ms == 0 || now_ms.saturating_sub(last_ms) >= idle_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUND: LineBound = LineBound {
        lines: 2.5,
        per_interactive: 0.5,
    };

    #[test]
    fn the_allowance_grows_with_the_interactive_requests_and_is_at_least_one() {
        assert_eq!(BOUND.at(0), 2);
        assert_eq!(BOUND.at(1), 3);
        assert_eq!(BOUND.at(10), 7);
        let none = LineBound {
            lines: 0.0,
            per_interactive: 0.0,
        };
        assert_eq!(none.at(5), 1, "one line may always run");
        let free = LineBound {
            lines: f64::INFINITY,
            per_interactive: 0.0,
        };
        assert_eq!(free.at(0), u64::MAX - 1);
        let nan = LineBound {
            lines: f64::NAN,
            per_interactive: 0.0,
        };
        assert_eq!(nan.at(0), 1);
    }

    #[test]
    fn a_backend_without_interactive_traffic_for_a_while_has_no_bound() {
        let b = Allowance::default();
        assert_eq!(b.allowance(0, 1_000), None, "nothing published");
        b.set(Some(BOUND));
        assert_eq!(b.allowance(0, 1_000), None, "no interactive request ever");
        assert!(b.interactive_routed(10_000, 0), "the first one wakes it");
        assert!(!b.interactive_routed(10_000, 0), "not the second");
        assert_eq!(b.allowance(1, 10_000), Some(3));
        assert_eq!(b.allowance(0, 12_000), Some(2), "idle, but not for long");
        assert_eq!(b.allowance(0, 15_000), None, "idle for IDLE");
        assert_eq!(b.allowance(1, 30_000), Some(3), "one in flight is traffic");
        assert!(!b.interactive_routed(9_000, 0), "the latest routing counts");
        assert_eq!(b.allowance(0, 15_000), None);
        assert!(b.interactive_routed(16_000, 0));
        assert!(
            !b.interactive_routed(30_000, 1),
            "another one in flight: not idle"
        );
        b.set(None);
        assert_eq!(b.allowance(4, 15_000), None);
        assert_eq!(b.bound(), None);
    }
}
