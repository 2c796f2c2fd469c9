//! The routing policies, one file each, behind one trait ([`Policy`]): the next policy is one
//! file and one `PolicyKind`.
//!
//! A policy sees only the pool the router left it (routable, with a slot, slow start and
//! warm-model preference applied; never empty) and returns an index into it. Policies keep
//! no configuration; the little state one needs (round-robin's cursor) lives in its value.

mod least_request;
mod prefix_affinity;
mod round_robin;
mod token_aware;

use std::sync::atomic::{AtomicUsize, Ordering};

use super::input::RouteInput;
use crate::config::PolicyKind;
use crate::fleet::Backend;

pub use round_robin::RoundRobin;

/// The pool one pick chooses from.
pub struct Pick<'a> {
    /// Never empty.
    pub backends: &'a [&'a Backend],
    /// The backend's name of the model, per backend.
    pub models: &'a [&'a str],
    pub input: &'a RouteInput,
    /// Above this many backends, power of two choices instead of a full scan (at least 2).
    pub p2c_above: usize,
}

/// A way of choosing a backend.
pub trait Policy: Send + Sync {
    /// The index into `pick.backends` of the chosen backend.
    fn choose(&self, pick: &Pick<'_>) -> usize;
}

/// The policies of one router.
#[derive(Debug, Default)]
pub struct Policies {
    round_robin: RoundRobin,
}

impl Policies {
    pub fn get(&self, kind: PolicyKind) -> &dyn Policy {
        match kind {
            PolicyKind::RoundRobin => &self.round_robin,
            PolicyKind::LeastRequest => &least_request::LeastRequest,
            PolicyKind::TokenAware => &token_aware::TokenAware,
            PolicyKind::PrefixAffinity => &prefix_affinity::PrefixAffinity,
        }
    }
}

/// Index of the smallest score; ties go to the earliest, rotated by a cheap per-call offset so
/// equal backends share the load.
fn argmin(backends: &[&Backend], score: impl Fn(usize) -> f64) -> usize {
    static TIE: AtomicUsize = AtomicUsize::new(0);
    let n = backends.len();
    let offset = TIE.fetch_add(1, Ordering::Relaxed) % n;
    let mut best = offset;
    let mut best_score = f64::INFINITY;
    for k in 0..n {
        let i = (offset + k) % n;
        let s = score(i);
        if s < best_score {
            best = i;
            best_score = s;
        }
    }
    best
}
