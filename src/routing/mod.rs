//! Choosing a backend among the candidates for a request.
//!
//! A [`Router`] holds the per-policy state (the round-robin cursor) and picks from the
//! candidates that are routable now and not yet tried by this request. Backends in a degraded
//! state (overloaded, loading) are chosen only when no preferred one is left. A backend at its
//! concurrency cap ([`Backend::has_slot`]) is not eligible (the proxy's wait queue covers that
//! case), and a backend in slow start after re-admission takes part in a pick only with the
//! probability of its current share ([`crate::fleet::BackendState::slow_start_share`]), so its
//! traffic ramps up whatever the policy.
//!
//! Policies:
//! - `round-robin`: the next candidate in turn.
//! - `least-request`: fewest in-flight requests per unit of weight.
//! - `token-aware` (default): the lowest expected work ahead of this request — tokens in flight
//!   at that backend plus this request's own tokens — per unit of weight.
//! - `prefix-affinity`: rendezvous hashing of the conversation prefix, so repeated prefixes land
//!   where their KV cache is warm; bounded by a load guard so a hot prefix cannot swamp a backend.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::config::PolicyKind;
use crate::fleet::Backend;
use crate::openai::request::Fnv64;

/// What routing knows about the request.
#[derive(Debug, Clone, Copy)]
pub struct RouteInput {
    /// Prompt plus expected output tokens.
    pub tokens: u64,
    pub prefix_hash: Option<u64>,
}

/// How much more loaded than the average a prefix-affinity choice may be before the load guard
/// sends the request elsewhere.
const AFFINITY_LOAD_FACTOR: f64 = 1.5;
/// Slack (in requests) added to the affinity guard, so a lightly loaded fleet keeps affinity.
const AFFINITY_SLACK: f64 = 2.0;

/// Per-policy routing state, shared by all requests.
#[derive(Debug, Default)]
pub struct Router {
    cursor: AtomicUsize,
    /// `health.slow_start` in milliseconds (0: off).
    slow_start_ms: AtomicU64,
}

impl Router {
    pub fn new() -> Self {
        Self::default()
    }

    /// Set the slow-start window (from `health.slow_start`; zero turns it off).
    pub fn set_slow_start(&self, d: Duration) {
        self.slow_start_ms.store(
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Whether some untried candidate is routable but at its concurrency cap: waiting for a
    /// slot may help where routing found nothing.
    pub fn saturated<T>(candidates: &[(Arc<Backend>, T)], tried: &[usize]) -> bool {
        (0..candidates.len()).any(|i| {
            !tried.contains(&i) && candidates[i].0.state.routable() && !candidates[i].0.has_slot()
        })
    }

    /// Pick a candidate, skipping `tried` (indices into `candidates`). Returns its index.
    pub fn pick<T>(
        &self,
        policy: PolicyKind,
        candidates: &[(Arc<Backend>, T)],
        tried: &[usize],
        input: RouteInput,
    ) -> Option<usize> {
        let mut eligible: Vec<usize> = (0..candidates.len())
            .filter(|i| {
                !tried.contains(i)
                    && candidates[*i].0.state.routable()
                    && candidates[*i].0.has_slot()
            })
            .collect();
        if eligible.is_empty() {
            return None;
        }
        let slow_start = Duration::from_millis(self.slow_start_ms.load(Ordering::Relaxed));
        if eligible.len() > 1 && !slow_start.is_zero() {
            let kept: Vec<usize> = eligible
                .iter()
                .copied()
                .filter(|i| {
                    let share = candidates[*i].0.state.slow_start_share(slow_start);
                    share >= 1.0 || rand::random::<f64>() < share
                })
                .collect();
            if !kept.is_empty() {
                eligible = kept;
            }
        }
        let preferred: Vec<usize> = eligible
            .iter()
            .copied()
            .filter(|i| candidates[*i].0.state.health().preferred())
            .collect();
        let pool = if preferred.is_empty() {
            eligible
        } else {
            preferred
        };
        let backends: Vec<&Backend> = pool.iter().map(|i| candidates[*i].0.as_ref()).collect();
        let chosen = match policy {
            PolicyKind::RoundRobin => self.cursor.fetch_add(1, Ordering::Relaxed) % pool.len(),
            PolicyKind::LeastRequest => {
                argmin(&backends, |b| load_of(b) / f64::from(b.config.weight))
            }
            PolicyKind::TokenAware => argmin(&backends, |b| {
                let tokens = b.state.inflight_tokens.load(Ordering::Relaxed) as f64;
                (tokens + input.tokens as f64) / f64::from(b.config.weight)
            }),
            PolicyKind::PrefixAffinity => match input.prefix_hash {
                Some(h) => affinity(&backends, h, input),
                None => argmin(&backends, |b| {
                    let tokens = b.state.inflight_tokens.load(Ordering::Relaxed) as f64;
                    (tokens + input.tokens as f64) / f64::from(b.config.weight)
                }),
            },
        };
        Some(pool[chosen])
    }
}

fn load_of(b: &Backend) -> f64 {
    b.state.inflight_requests.load(Ordering::Relaxed) as f64
}

/// Index of the smallest score; ties go to the earliest, rotated by a cheap per-call offset so
/// equal backends share the load.
fn argmin(backends: &[&Backend], score: impl Fn(&Backend) -> f64) -> usize {
    static TIE: AtomicUsize = AtomicUsize::new(0);
    let n = backends.len();
    let offset = TIE.fetch_add(1, Ordering::Relaxed) % n;
    let mut best = offset;
    let mut best_score = f64::INFINITY;
    for k in 0..n {
        let i = (offset + k) % n;
        let s = score(backends[i]);
        if s < best_score {
            best = i;
            best_score = s;
        }
    }
    best
}

/// Rendezvous (highest random weight) hash of `prefix` with each backend's name.
pub fn rendezvous_rank(prefix: u64, name: &str) -> u64 {
    let mut h = Fnv64::new();
    h.write(&prefix.to_le_bytes());
    h.write(name.as_bytes());
    // FNV's low bits are weak for short inputs; finish with a 64-bit mix (splitmix64).
    let mut z = h.finish().wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn affinity(backends: &[&Backend], prefix: u64, input: RouteInput) -> usize {
    let mut order: Vec<usize> = (0..backends.len()).collect();
    order.sort_by_key(|i| std::cmp::Reverse(rendezvous_rank(prefix, backends[*i].name())));
    let mean = backends.iter().map(|b| load_of(b)).sum::<f64>() / backends.len() as f64;
    let bound = mean * AFFINITY_LOAD_FACTOR + AFFINITY_SLACK;
    for i in &order {
        if load_of(backends[*i]) <= bound {
            return *i;
        }
    }
    argmin(backends, |b| {
        let tokens = b.state.inflight_tokens.load(Ordering::Relaxed) as f64;
        tokens + input.tokens as f64
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{BackendConfig, BackendKind, Timeouts};
    use crate::fleet::{BackendState, Health, LoadGuard};

    fn backends(n: usize) -> Vec<(Arc<Backend>, String)> {
        (0..n)
            .map(|i| {
                let cfg = BackendConfig {
                    name: format!("b{i}"),
                    kind: BackendKind::Vllm,
                    url: "http://127.0.0.1:1".parse().unwrap(),
                    models: vec!["m".into()],
                    model_names: Default::default(),
                    api_key: None,
                    weight: 1,
                    max_concurrent: None,
                    health_path: None,
                    timeouts: Timeouts::default(),
                };
                (
                    Arc::new(Backend::new(cfg, Arc::new(BackendState::new()))),
                    "m".to_string(),
                )
            })
            .collect()
    }

    const INPUT: RouteInput = RouteInput {
        tokens: 100,
        prefix_hash: None,
    };

    #[test]
    fn round_robin_cycles_and_skips_tried_and_down() {
        let c = backends(3);
        let r = Router::new();
        let picks: Vec<_> = (0..6)
            .map(|_| r.pick(PolicyKind::RoundRobin, &c, &[], INPUT).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        c[1].0.state.set_health(Health::Down);
        for _ in 0..4 {
            assert_ne!(r.pick(PolicyKind::RoundRobin, &c, &[0], INPUT), Some(1));
        }
        assert_eq!(r.pick(PolicyKind::RoundRobin, &c, &[0, 2], INPUT), None);
    }

    #[test]
    fn capped_backend_is_skipped_until_a_slot_frees() {
        let mut c = backends(2);
        let mut cfg = c[0].0.config.clone();
        cfg.max_concurrent = Some(1);
        c[0].0 = Arc::new(Backend::new(cfg, c[0].0.state.clone()));
        let r = Router::new();
        let g = LoadGuard::new(c[0].0.state.clone(), 1);
        for _ in 0..4 {
            assert_eq!(r.pick(PolicyKind::RoundRobin, &c, &[], INPUT), Some(1));
        }
        assert!(Router::saturated(&c, &[1]));
        assert_eq!(r.pick(PolicyKind::RoundRobin, &c, &[1], INPUT), None);
        drop(g);
        assert!(!Router::saturated(&c, &[1]));
        assert_eq!(r.pick(PolicyKind::RoundRobin, &c, &[1], INPUT), Some(0));
    }

    #[test]
    fn slow_start_ramps_a_readmitted_backends_share() {
        let c = backends(2);
        let r = Router::new();
        r.set_slow_start(Duration::from_secs(60));
        c[0].0
            .state
            .admitted_at_ms
            .store(crate::fleet::backend::now_ms().max(1), Ordering::Relaxed);
        let n = 2000;
        let to_new = (0..n)
            .filter(|_| r.pick(PolicyKind::RoundRobin, &c, &[], INPUT) == Some(0))
            .count();
        // fair share is 1/2; at the start of its ramp it gets about 10% of that
        let share = to_new as f64 / n as f64;
        assert!(share < 0.15, "share {share}");
        // alone, it still gets everything
        assert_eq!(r.pick(PolicyKind::RoundRobin, &c, &[1], INPUT), Some(0));
    }

    #[test]
    fn degraded_used_only_as_last_resort() {
        let c = backends(2);
        c[0].0.state.set_health(Health::Overloaded);
        let r = Router::new();
        for _ in 0..4 {
            assert_eq!(r.pick(PolicyKind::RoundRobin, &c, &[], INPUT), Some(1));
        }
        assert_eq!(r.pick(PolicyKind::RoundRobin, &c, &[1], INPUT), Some(0));
    }

    #[test]
    fn token_aware_avoids_the_backend_with_more_tokens_in_flight() {
        let c = backends(2);
        let _busy = LoadGuard::new(c[0].0.state.clone(), 30_000);
        let _many_small = (0..3)
            .map(|_| LoadGuard::new(c[1].0.state.clone(), 100))
            .collect::<Vec<_>>();
        let r = Router::new();
        assert_eq!(r.pick(PolicyKind::TokenAware, &c, &[], INPUT), Some(1));
        // least-request counts requests, not tokens, and picks the other one
        assert_eq!(r.pick(PolicyKind::LeastRequest, &c, &[], INPUT), Some(0));
    }

    #[test]
    fn affinity_is_sticky_bounded_and_moves_few_keys() {
        let c = backends(4);
        let r = Router::new();
        let input = |h| RouteInput {
            tokens: 10,
            prefix_hash: Some(h),
        };
        let first = r
            .pick(PolicyKind::PrefixAffinity, &c, &[], input(42))
            .unwrap();
        for _ in 0..5 {
            assert_eq!(
                r.pick(PolicyKind::PrefixAffinity, &c, &[], input(42)),
                Some(first)
            );
        }
        // load guard: swamp the sticky backend
        let _g: Vec<_> = (0..20)
            .map(|_| LoadGuard::new(c[first].0.state.clone(), 10))
            .collect();
        assert_ne!(
            r.pick(PolicyKind::PrefixAffinity, &c, &[], input(42)),
            Some(first)
        );
        drop(_g);

        // removing one backend of 4 moves only the keys that lived on it (~1/4)
        let five = backends(5);
        let four: Vec<_> = five[..4].to_vec();
        let keys = 2000u64;
        let mut moved = 0;
        for k in 0..keys {
            let a = r
                .pick(PolicyKind::PrefixAffinity, &five, &[], input(k))
                .unwrap();
            let b = r
                .pick(PolicyKind::PrefixAffinity, &four, &[], input(k))
                .unwrap();
            if a != b {
                moved += 1;
                assert_eq!(a, 4, "only keys of the removed backend may move");
            }
        }
        let share = moved as f64 / keys as f64;
        assert!((0.12..0.30).contains(&share), "moved share {share}");
    }
}
