//! `round-robin`: the next candidate in turn.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Pick, Policy};

#[derive(Debug, Default)]
pub struct RoundRobin {
    cursor: AtomicUsize,
}

impl Policy for RoundRobin {
    fn choose(&self, pick: &Pick<'_>) -> usize {
        self.cursor.fetch_add(1, Ordering::Relaxed) % pick.backends.len()
    }
}
