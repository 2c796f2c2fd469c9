//! `token-aware` (the default): the lowest expected time to finish this request, from the
//! engine's queue, the gateway's tokens in flight, the measured speeds and, where the engine
//! reports its cache, the exact prefix it holds (see [`crate::routing::score`]). A full scan
//! up to `p2c_above` backends, power of two choices above.
//!
//! A busy backend holding the prompt's prefix and an idle one without it are weighed by the
//! same expected time: the prefill the cache saves against the wait the queue costs. Scores
//! equal within [`TIE`] are broken by rendezvous rank of the request's prefix, not at random,
//! so gateway replicas that see the same fleet choose the same backend and a new prefix lands
//! in one place.

use super::{Pick, Policy};
use crate::fleet::clock;
use crate::routing::affinity::rendezvous_rank;
use crate::routing::score::{self, Prior};

/// Relative difference under which two scores count as equal.
const TIE: f64 = 1e-6;

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
        let key = pick.input.prefix_hash;
        let rank = |i: usize| key.map_or(0, |k| rendezvous_rank(k, backends[i].name()));
        let offset = clock::below(n);
        let mut best = offset;
        let mut best_score = f64::INFINITY;
        for k in 0..n {
            let i = (offset + k) % n;
            let s = score_of(i);
            let better = if k == 0 || !best_score.is_finite() {
                s < best_score || k == 0
            } else {
                let tied = key.is_some() && (s - best_score).abs() <= TIE * best_score.abs();
                (s < best_score && !tied) || (tied && rank(i) > rank(best))
            };
            if better {
                best = i;
                best_score = if k == 0 { s } else { best_score.min(s) };
            }
        }
        best
    }
}
