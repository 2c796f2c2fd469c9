//! The clock and the random draws the fleet's state and routing decide by, replaceable on one
//! thread.
//!
//! Every time-dependent rule (stale speeds, signal freshness, slow start, skips) reads
//! [`monotonic_ms`], and every random routing choice (tie-breaks, two random choices, slow-start
//! admission) draws from [`unit`] or [`below`]. In service these are the process's monotonic
//! clock and the thread's OS-seeded generator. The planner runs the same routing in virtual
//! time: it installs a [`Virtual`] on its thread, so those rules see the planned timeline
//! rather than how fast the planner happens to run, and draws from a seeded generator, so the
//! same plan gives the same answer.
//!
//! Invariant: an override lives exactly as long as its [`Virtual`] guard, on the thread that
//! installed it (the guard is neither `Send` nor `Sync`); other threads never see it.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::OnceLock;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

thread_local! {
    static VIRTUAL_MS: Cell<Option<u64>> = const { Cell::new(None) };
    static SEEDED: RefCell<Option<StdRng>> = const { RefCell::new(None) };
}

/// Milliseconds since this process started (a cheap monotonic clock for atomics), or the
/// virtual time of the thread's [`Virtual`].
pub fn monotonic_ms() -> u64 {
    if let Some(ms) = VIRTUAL_MS.with(Cell::get) {
        return ms;
    }
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A uniform draw in [0, 1).
pub fn unit() -> f64 {
    draw(|r| r.random::<f64>())
}

/// A uniform draw in `0..n` (`n` > 0; 0 when `n` is 0).
pub fn below(n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    draw(|r| r.random_range(0..n))
}

fn draw<T>(f: impl FnOnce(&mut dyn rand::RngCore) -> T) -> T {
    SEEDED.with(|s| match s.borrow_mut().as_mut() {
        Some(seeded) => f(seeded),
        None => f(&mut rand::rng()),
    })
}

/// Virtual time and seeded draws on this thread until dropped.
pub struct Virtual {
    _not_send: PhantomData<*const ()>,
}

impl Virtual {
    /// From now on this thread's clock reads `start_ms` (until [`Virtual::set_ms`]) and its
    /// draws come from a generator seeded with `seed`.
    pub fn install(start_ms: u64, seed: u64) -> Virtual {
        VIRTUAL_MS.with(|v| v.set(Some(start_ms)));
        SEEDED.with(|s| *s.borrow_mut() = Some(StdRng::seed_from_u64(seed)));
        Virtual {
            _not_send: PhantomData,
        }
    }

    /// Move the clock (virtual time only moves forward: an earlier `ms` is ignored).
    pub fn set_ms(&self, ms: u64) {
        VIRTUAL_MS.with(|v| v.set(Some(v.get().map_or(ms, |now| now.max(ms)))));
    }
}

impl Drop for Virtual {
    fn drop(&mut self) {
        VIRTUAL_MS.with(|v| v.set(None));
        SEEDED.with(|s| *s.borrow_mut() = None);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_virtual_clock_moves_only_when_set_and_only_forward() {
        let real = monotonic_ms();
        {
            let v = Virtual::install(5, 1);
            assert_eq!(monotonic_ms(), 5);
            v.set_ms(90_000);
            assert_eq!(monotonic_ms(), 90_000);
            v.set_ms(10);
            assert_eq!(monotonic_ms(), 90_000);
            // other threads keep the real clock
            let other = std::thread::spawn(monotonic_ms).join().unwrap_or(u64::MAX);
            assert!(other < 90_000, "{other}");
        }
        assert!((real..real + 60_000).contains(&monotonic_ms()));
    }

    #[test]
    fn seeded_draws_repeat_and_unseeded_ones_do_not() {
        let run = |seed| {
            let _v = Virtual::install(1, seed);
            (0..32).map(|_| below(1000)).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let free: Vec<usize> = (0..32).map(|_| below(1000)).collect();
        let again: Vec<usize> = (0..32).map(|_| below(1000)).collect();
        assert_ne!(free, again);
        assert_eq!(below(0), 0);
        assert!((0.0..1.0).contains(&unit()));
    }
}
