//! Serving-thread helpers: which serving thread (shard) this thread is, and how many there are
//! by default.
//!
//! The thread machinery itself (starting the threads, handing them connections) is in
//! `server::shards`; this module is what the lower layers need to know about it, so the
//! upstream client can pick a connection pool per serving thread without importing the server.
//!
//! Invariant: [`current`] is 0 outside the serving threads (the control runtime: probes,
//! scraping, reload, the admin listener); serving threads are numbered from 1.

use std::cell::Cell;

thread_local! {
    static SHARD: Cell<usize> = const { Cell::new(0) };
}

/// The serving thread this thread is (1-based), or 0 outside the serving threads.
pub fn current() -> usize {
    SHARD.with(Cell::get)
}

/// Mark this thread as serving thread `i` (0: not one). Done once by each serving thread at
/// its start.
pub fn enter(i: usize) {
    SHARD.with(|s| s.set(i));
}

/// How many serving threads a listener has by default: one per core the process may run on.
pub fn default_count() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}
