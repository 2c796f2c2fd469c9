//! `token-aware` (the default): the lowest expected time to finish this request, from the
//! engine's queue, the gateway's tokens in flight, the measured speeds and, where the engine
//! reports its cache, the exact prefix it holds (see [`crate::routing::score`]). A full scan
//! up to `p2c_above` backends, power of two choices above.
//!
//! A busy backend holding the prompt's prefix and an idle one without it are weighed by the
//! same expected time: the prefill the cache saves against the wait the queue costs.
//!
//! Where engines report their caches, scores within [`NOISE`] of the best are not told apart
//! by their estimates but by facts: the longest cached prefix, then the rendezvous rank of the
//! request's prefix. An expected finish rests on speeds each gateway replica measures from its
//! own requests and on in-flight counts it sees only for its own; the KV index and the rank
//! are the same on every replica. So replicas choose alike, and a session stays with its cache
//! while the cost of staying is within what the estimate can resolve. Without KV facts, scores
//! equal within [`TIE`] are broken by the same rank, and a new prefix lands in one place.

use super::{Pick, Policy};
use crate::fleet::clock;
use crate::routing::affinity::rendezvous_rank;
use crate::routing::score::{self, Prior};

/// Relative difference under which two scores count as equal.
const TIE: f64 = 1e-6;

/// Relative difference under which two scores cannot be told apart where KV facts exist: an
/// EWMA of speeds moves by about this much between replicas and between like engines (see
/// [`score::SPEED_NOISE`]).
pub const NOISE: f64 = 0.1;

pub struct TokenAware;

impl Policy for TokenAware {
    fn choose(&self, pick: &Pick<'_>) -> usize {
        let backends = pick.backends;
        let prior = Prior::of(backends);
        let score_of = |i: usize| {
            let req = pick.input.request_on(backends[i]);
            score::breakdown(backends[i], pick.models[i], req, prior).score
        };
        let n = backends.len();
        if n > pick.p2c_above {
            let a = clock::below(n);
            let b = (a + 1 + clock::below(n - 1)) % n;
            return if score_of(b) < score_of(a) { b } else { a };
        }
        // each backend's cached prefix, looked up once for the facts and the scores
        let cached: Option<Vec<Option<u64>>> = pick
            .input
            .prompt
            .as_ref()
            .map(|_| backends.iter().map(|b| pick.input.cached_on(b)).collect())
            .filter(|c: &Vec<Option<u64>>| c.iter().any(Option::is_some));
        let Some(cached) = cached else {
            return lowest(pick, score_of);
        };
        by_facts(pick, &cached, |i| {
            let req = pick.input.request_given(backends[i], cached[i]);
            score::breakdown(backends[i], pick.models[i], req, prior).score
        })
    }
}

/// The rendezvous rank of backend `i` for the request's prefix (0 without one).
fn rank(pick: &Pick<'_>, i: usize) -> u64 {
    pick.input
        .prefix_hash
        .map_or(0, |k| rendezvous_rank(k, pick.backends[i].name()))
}

/// The lowest score; equal scores (within [`TIE`]) by rank, from a random start.
fn lowest(pick: &Pick<'_>, score_of: impl Fn(usize) -> f64) -> usize {
    let n = pick.backends.len();
    let keyed = pick.input.prefix_hash.is_some();
    let offset = clock::below(n);
    let mut best = offset;
    let mut best_score = f64::INFINITY;
    for k in 0..n {
        let i = (offset + k) % n;
        let s = score_of(i);
        let better = if k == 0 || !best_score.is_finite() {
            s < best_score || k == 0
        } else {
            let tied = keyed && (s - best_score).abs() <= TIE * best_score.abs();
            (s < best_score && !tied) || (tied && rank(pick, i) > rank(pick, best))
        };
        if better {
            best = i;
            best_score = if k == 0 { s } else { best_score.min(s) };
        }
    }
    best
}

/// Among the backends scoring within [`NOISE`] of the best, the one holding the longest
/// prefix of the prompt (`cached[i]` tokens; `None` counts as none), then the highest rank.
fn by_facts(pick: &Pick<'_>, cached: &[Option<u64>], score_of: impl Fn(usize) -> f64) -> usize {
    let scores: Vec<f64> = (0..pick.backends.len()).map(score_of).collect();
    let best = scores.iter().copied().fold(f64::INFINITY, f64::min);
    if !best.is_finite() {
        return lowest(pick, |i| scores[i]);
    }
    let within = best + NOISE * best.abs();
    (0..scores.len())
        .filter(|&i| scores[i] <= within)
        .max_by_key(|&i| (cached[i].unwrap_or(0), rank(pick, i)))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests;
