//! `prefix-affinity`: weighted rendezvous hashing of the conversation prefix (weights: the
//! backends' learned capacity), so repeated prefixes land where their KV cache is warm; a
//! request leaves its home only when staying would really hurt (see
//! [`crate::routing::affinity`]). Without a prefix, token-aware.

use super::token_aware::TokenAware;
use super::{Pick, Policy};
use crate::routing::affinity;
use crate::routing::score::{self, Prior};

pub struct PrefixAffinity;

impl Policy for PrefixAffinity {
    /// The first backend in the prefix's weighted rendezvous order that passes the guards
    /// ([`affinity::overloaded`], [`affinity::too_slow`]: scored with its prefix warm against
    /// every candidate scored cold), else token-aware. Scoring the home cold as well would
    /// reject it whenever another backend prefills faster, and the choice would flip with
    /// load, scattering the prefix.
    fn choose(&self, pick: &Pick<'_>) -> usize {
        let Some(prefix) = pick.input.prefix_hash else {
            return TokenAware.choose(pick);
        };
        let (backends, models) = (pick.backends, pick.models);
        let weights = affinity::home_weights(backends);
        let names: Vec<&str> = backends.iter().map(|b| b.name()).collect();
        let order = affinity::home_order(&names, &weights, prefix);
        let prior = Prior::of(backends);
        let cold: Vec<score::Breakdown> = (0..backends.len())
            .map(|i| {
                let cold = pick.input.score_request(backends[i]);
                score::breakdown(backends[i], models[i], cold, prior)
            })
            .collect();
        for i in order {
            if affinity::overloaded(&cold, i) {
                continue;
            }
            let warm = pick.input.warm_request(backends[i]);
            let warm = score::breakdown(backends[i], models[i], warm, prior);
            if !affinity::too_slow(&warm, &cold) {
                return i;
            }
        }
        TokenAware.choose(pick)
    }
}
