//! Choosing a backend among the candidates for a request.
//!
//! A [`Router`] holds the per-policy state (the round-robin cursor) and the learned
//! [`ModelShapes`], never configuration: each pick reads the request's config snapshot
//! (`health.slow_start`, `routing.p2c_above`), so a reload applies to the next pick. It picks
//! from the candidates that are routable now and not yet tried by this request. Backends in a degraded
//! state (overloaded, loading) are chosen only when no preferred one is left. A backend at its
//! concurrency cap ([`Backend::has_slot_for`]; for an interactive request the slots background
//! requests hold count as free, since they give way to it), or for a background request at
//! its background allowance, is not eligible (the proxy's wait
//! queue covers that case), and a backend in slow start after re-admission takes part in a
//! pick only with the probability of its current share
//! ([`crate::fleet::BackendState::slow_start_share`]), so its traffic ramps up whatever the
//! policy.
//!
//! Policies, one file each under [`policy`] behind the [`policy::Policy`] trait:
//! `round-robin`, `least-request`, `token-aware` (the default: the lowest expected time to
//! finish, with each backend's exact cached prefix where its engine reports its KV cache, see
//! [`RouteInput::cached_on`]) and `prefix-affinity` (weighted rendezvous homes, see
//! [`affinity`]).
//!
//! Whatever the policy, an Ollama node known to have the model loaded is preferred over one
//! known to have it cold (a model load costs seconds), and each decision is counted in
//! `sluice_routing_decisions_total{policy,backend}`.

pub mod affinity;
mod input;
pub mod policy;
pub mod score;

use std::sync::Arc;

use crate::config::{Config, PolicyKind};
use crate::fleet::speed::ModelShapes;
use crate::fleet::{clock, Backend};
pub use affinity::rendezvous_rank;
pub use input::RouteInput;
use policy::{Pick, Policies};

/// Routing state shared by all requests. It holds no configuration: each pick reads the
/// request's config snapshot.
#[derive(Debug)]
pub struct Router {
    policies: Policies,
    /// Learned per-model request shapes (output length, prompt estimate correction).
    pub shapes: Arc<ModelShapes>,
}

impl Default for Router {
    fn default() -> Self {
        Router {
            policies: Policies::default(),
            shapes: Arc::new(ModelShapes::new()),
        }
    }
}

impl Router {
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether some untried candidate is routable but at its concurrency cap: waiting for a
    /// slot may help where routing found nothing.
    pub fn saturated<T>(
        candidates: &[(Arc<Backend>, T)],
        tried: &[usize],
        input: &RouteInput,
    ) -> bool {
        (0..candidates.len()).any(|i| {
            !tried.contains(&i)
                && candidates[i].0.state.routable()
                && !candidates[i].0.has_slot_for(input.background)
        })
    }

    /// Pick a candidate, skipping `tried` (indices into `candidates`). Returns its index.
    /// `config` is the request's snapshot: its `health.slow_start` and `routing.p2c_above`
    /// apply to this pick.
    pub fn pick<T: AsRef<str>>(
        &self,
        config: &Config,
        policy: PolicyKind,
        candidates: &[(Arc<Backend>, T)],
        tried: &[usize],
        input: &RouteInput,
    ) -> Option<usize> {
        let mut eligible: Vec<usize> = (0..candidates.len())
            .filter(|i| {
                !tried.contains(i)
                    && candidates[*i].0.state.routable()
                    && candidates[*i].0.has_slot_for(input.background)
            })
            .collect();
        if eligible.is_empty() {
            return None;
        }
        let slow_start = config.health.slow_start;
        if eligible.len() > 1 && !slow_start.is_zero() {
            let kept: Vec<usize> = eligible
                .iter()
                .copied()
                .filter(|i| {
                    let share = candidates[*i].0.state.slow_start_share(slow_start);
                    share >= 1.0 || clock::unit() < share
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
        let mut pool = if preferred.is_empty() {
            eligible
        } else {
            preferred
        };
        // Never pay a model load when a warm node can serve.
        let warm = |i: &usize| score::warm(&candidates[*i].0, candidates[*i].1.as_ref());
        if pool.iter().any(|i| warm(i) == Some(true)) {
            pool.retain(|i| warm(i) != Some(false));
        }
        let backends: Vec<&Backend> = pool.iter().map(|i| candidates[*i].0.as_ref()).collect();
        let models: Vec<&str> = pool.iter().map(|i| candidates[*i].1.as_ref()).collect();
        let pick = Pick {
            backends: &backends,
            models: &models,
            input,
            // Two at least: power of two choices needs two to compare.
            p2c_above: config.routing.p2c_above.max(2),
        };
        let chosen = self.policies.get(policy).choose(&pick);
        let picked = pool[chosen];
        crate::telemetry::metrics::routing_decision(policy.as_str(), candidates[picked].0.name());
        Some(picked)
    }
}

/// Seconds the request is expected to wait for `candidates[idx]`'s response head: its time
/// to first token for a stream, the whole request otherwise (the score's breakdown, with
/// the candidates' learned speeds as the prior).
pub fn expected_head_seconds<T: AsRef<str>>(
    candidates: &[(Arc<Backend>, T)],
    idx: usize,
    input: &RouteInput,
    streaming: bool,
) -> f64 {
    let Some((backend, model)) = candidates.get(idx) else {
        return 0.0;
    };
    let all: Vec<&Backend> = candidates.iter().map(|(b, _)| b.as_ref()).collect();
    let b = score::breakdown(
        backend,
        model.as_ref(),
        input.request_on(backend),
        score::Prior::of(&all),
    );
    let secs = if streaming {
        b.ttft_seconds
    } else {
        b.expected_seconds
    };
    if secs.is_finite() {
        secs.max(0.0)
    } else {
        f64::MAX
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::{BackendConfig, BackendKind, Timeouts};
    use crate::fleet::signals::Signals;
    use crate::fleet::{BackendState, Health, Load, LoadGuard};
    use std::sync::LazyLock;
    use std::time::Duration;

    /// A snapshot with slow start off and the default `p2c_above`.
    static SNAPSHOT: LazyLock<Config> = LazyLock::new(|| snapshot(Duration::ZERO, 16));

    fn snapshot(slow_start: Duration, p2c_above: usize) -> Config {
        let mut c = Config::empty();
        c.health.slow_start = slow_start;
        c.routing.p2c_above = p2c_above;
        c
    }

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
                    kv_events: Default::default(),
                    max_adapters: None,
                    lora_adapters: Vec::new(),
                    timeouts: Timeouts::default(),
                };
                (
                    Arc::new(Backend::new(cfg, Arc::new(BackendState::new()))),
                    "m".to_string(),
                )
            })
            .collect()
    }

    static INPUT: RouteInput = RouteInput {
        tokens: 100,
        prefix_hash: None,
        prompt_tokens: 50,
        prefix_tokens: 0,
        prompt: None,
        prompt_exact: false,
        adapter: None,
        background: false,
    };

    #[test]
    fn round_robin_cycles_and_skips_tried_and_down() {
        let c = backends(3);
        let r = Router::new();
        let picks: Vec<_> = (0..6)
            .map(|_| {
                r.pick(&SNAPSHOT, PolicyKind::RoundRobin, &c, &[], &INPUT)
                    .unwrap()
            })
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
        c[1].0.state.set_health(Health::Down);
        for _ in 0..4 {
            assert_ne!(
                r.pick(&SNAPSHOT, PolicyKind::RoundRobin, &c, &[0], &INPUT),
                Some(1)
            );
        }
        assert_eq!(
            r.pick(&SNAPSHOT, PolicyKind::RoundRobin, &c, &[0, 2], &INPUT),
            None
        );
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
            assert_eq!(
                r.pick(&SNAPSHOT, PolicyKind::RoundRobin, &c, &[], &INPUT),
                Some(1)
            );
        }
        assert!(Router::saturated(&c, &[1], &RouteInput::default()));
        assert_eq!(
            r.pick(&SNAPSHOT, PolicyKind::RoundRobin, &c, &[1], &INPUT),
            None
        );
        drop(g);
        assert!(!Router::saturated(&c, &[1], &RouteInput::default()));
        assert_eq!(
            r.pick(&SNAPSHOT, PolicyKind::RoundRobin, &c, &[1], &INPUT),
            Some(0)
        );
    }

    #[test]
    fn slow_start_ramps_a_readmitted_backends_share() {
        let c = backends(2);
        let r = Router::new();
        let slow = snapshot(Duration::from_secs(60), 16);
        c[0].0
            .state
            .record_admission(crate::fleet::backend::monotonic_ms());
        let n = 2000;
        let to_new = (0..n)
            .filter(|_| r.pick(&slow, PolicyKind::RoundRobin, &c, &[], &INPUT) == Some(0))
            .count();
        // fair share is 1/2; at the start of its ramp it gets about 10% of that
        let share = to_new as f64 / n as f64;
        assert!(share < 0.15, "share {share}");
        // alone, it still gets everything
        assert_eq!(
            r.pick(&slow, PolicyKind::RoundRobin, &c, &[1], &INPUT),
            Some(0)
        );
    }

    #[test]
    fn each_pick_reads_slow_start_from_the_snapshot_it_is_given() {
        let c = backends(2);
        c[0].0
            .state
            .record_admission(crate::fleet::backend::monotonic_ms());
        let r = Router::new();
        let slow = snapshot(Duration::from_secs(60), 16);
        let share = |cfg: &Config| {
            let n = 2000;
            let to_new = (0..n)
                .filter(|_| r.pick(cfg, PolicyKind::RoundRobin, &c, &[], &INPUT) == Some(0))
                .count();
            to_new as f64 / n as f64
        };
        // the same router, one snapshot after the other: no setter in between
        assert!(share(&slow) < 0.15);
        assert!((0.4..0.6).contains(&share(&SNAPSHOT)));
        assert!(share(&slow) < 0.15);
    }

    #[test]
    fn each_pick_reads_p2c_above_from_the_snapshot_it_is_given() {
        let c = backends(8);
        let _load: Vec<_> = c[1..]
            .iter()
            .map(|(b, _)| LoadGuard::new(b.state.clone(), Load::new(20_000, 20_000)))
            .collect();
        let r = Router::new();
        let picks_of_idle = |cfg: &Config| {
            (0..400)
                .filter(|_| r.pick(cfg, PolicyKind::TokenAware, &c, &[], &INPUT) == Some(0))
                .count()
        };
        // a full scan always finds the idle backend
        assert_eq!(picks_of_idle(&SNAPSHOT), 400);
        // two random ones of eight: the idle one is among them about a quarter of the time
        let p2c = picks_of_idle(&snapshot(Duration::ZERO, 2));
        assert!((40..200).contains(&p2c), "{p2c}");
        assert_eq!(picks_of_idle(&SNAPSHOT), 400);
    }

    #[test]
    fn degraded_used_only_as_last_resort() {
        let c = backends(2);
        c[0].0.state.set_health(Health::Overloaded);
        let r = Router::new();
        for _ in 0..4 {
            assert_eq!(
                r.pick(&SNAPSHOT, PolicyKind::RoundRobin, &c, &[], &INPUT),
                Some(1)
            );
        }
        assert_eq!(
            r.pick(&SNAPSHOT, PolicyKind::RoundRobin, &c, &[1], &INPUT),
            Some(0)
        );
    }

    #[test]
    fn token_aware_avoids_the_backend_with_more_tokens_in_flight() {
        let c = backends(2);
        let _busy = LoadGuard::new(c[0].0.state.clone(), 30_000);
        let _many_small = (0..3)
            .map(|_| LoadGuard::new(c[1].0.state.clone(), 100))
            .collect::<Vec<_>>();
        let r = Router::new();
        assert_eq!(
            r.pick(&SNAPSHOT, PolicyKind::TokenAware, &c, &[], &INPUT),
            Some(1)
        );
        // least-request counts requests, not tokens, and picks the other one
        assert_eq!(
            r.pick(&SNAPSHOT, PolicyKind::LeastRequest, &c, &[], &INPUT),
            Some(0)
        );
    }

    #[test]
    fn affinity_is_sticky_bounded_and_moves_few_keys() {
        // batches of 32 (a configured cap): nothing queues, the backstop load guard bounds
        let c: Vec<_> = backends(4)
            .into_iter()
            .map(|(b, m)| {
                let mut cfg = b.config.clone();
                cfg.max_concurrent = Some(32);
                (Arc::new(Backend::new(cfg, b.state.clone())), m)
            })
            .collect();
        let r = Router::new();
        let input = |h| RouteInput {
            tokens: 10,
            prefix_hash: Some(h),
            prompt_tokens: 5,
            prefix_tokens: 4,
            prompt: None,
            prompt_exact: false,
            adapter: None,
            background: false,
        };
        let first = r
            .pick(&SNAPSHOT, PolicyKind::PrefixAffinity, &c, &[], &input(42))
            .unwrap();
        for _ in 0..5 {
            assert_eq!(
                r.pick(&SNAPSHOT, PolicyKind::PrefixAffinity, &c, &[], &input(42)),
                Some(first)
            );
        }
        // load guard: 20 of 32 busy while the others idle is more than half the batch + 2
        let _g: Vec<_> = (0..20)
            .map(|_| LoadGuard::new(c[first].0.state.clone(), 10))
            .collect();
        assert_ne!(
            r.pick(&SNAPSHOT, PolicyKind::PrefixAffinity, &c, &[], &input(42)),
            Some(first)
        );
        drop(_g);

        // removing one backend of 4 moves only the keys that lived on it (~1/4)
        drop(c);
        let five = backends(5);
        let four: Vec<_> = five[..4].to_vec();
        let keys = 2000u64;
        let mut moved = 0;
        for k in 0..keys {
            let a = r
                .pick(&SNAPSHOT, PolicyKind::PrefixAffinity, &five, &[], &input(k))
                .unwrap();
            let b = r
                .pick(&SNAPSHOT, PolicyKind::PrefixAffinity, &four, &[], &input(k))
                .unwrap();
            if a != b {
                moved += 1;
                assert_eq!(a, 4, "only keys of the removed backend may move");
            }
        }
        let share = moved as f64 / keys as f64;
        assert!((0.12..0.30).contains(&share), "moved share {share}");
    }

    /// Ten requests measured on `b` at the given speeds, as if just now.
    pub(crate) fn measure(b: &Backend, prefill_tps: f64, decode_tps: f64) {
        for _ in 0..10 {
            let ttft = 1000.0 / prefill_tps;
            b.state.speeds().observe(
                &crate::fleet::speed::Observation {
                    prompt_tokens: 1000,
                    cached_tokens: 0,
                    completion_tokens: 101,
                    ttft: Some(Duration::from_secs_f64(ttft)),
                    total: Duration::from_secs_f64(ttft + 100.0 / decode_tps),
                    queued: false,
                },
                1.0,
            );
        }
    }

    /// The candidate the weighted rendezvous order puts first for `prefix` (its home).
    fn affinity_target(c: &[(Arc<Backend>, String)], prefix: u64) -> usize {
        let b: Vec<&Backend> = c.iter().map(|(b, _)| b.as_ref()).collect();
        let names: Vec<&str> = b.iter().map(|b| b.name()).collect();
        affinity::home_order(&names, &affinity::home_weights(&b), prefix)[0]
    }

    fn shared_prompt(prefix: u64) -> RouteInput {
        // a 1500-token system prompt + a short question, a short answer
        RouteInput {
            tokens: 1610,
            prefix_hash: Some(prefix),
            prompt_tokens: 1600,
            prefix_tokens: 1500,
            prompt: None,
            prompt_exact: false,
            adapter: None,
            background: false,
        }
    }

    #[test]
    fn affinity_keeps_a_slower_prefill_backend_whose_prefix_is_warm() {
        let c = backends(2);
        let prefix = 7;
        let target = affinity_target(&c, prefix);
        let other = 1 - target;
        // the target prefills 5x slower; cold, it would take about 2.8x as long
        measure(&c[target].0, 4_000.0, 100.0);
        measure(&c[other].0, 20_000.0, 100.0);
        let r = Router::new();
        let input = shared_prompt(prefix);
        for _ in 0..4 {
            assert_eq!(
                r.pick(&SNAPSHOT, PolicyKind::PrefixAffinity, &c, &[], &input),
                Some(target)
            );
        }
        // without a prefix to reuse (all of the prompt is new) the faster backend wins
        let no_reuse = RouteInput {
            prefix_tokens: 0,
            ..input.clone()
        };
        assert_eq!(
            r.pick(&SNAPSHOT, PolicyKind::PrefixAffinity, &c, &[], &no_reuse),
            Some(other)
        );
    }

    #[test]
    fn affinity_stays_home_through_a_short_queue_and_leaves_a_deep_one() {
        let mut c = backends(3);
        let prefix = 11;
        let target = affinity_target(&c, prefix);
        for (i, (b, _)) in c.iter_mut().enumerate() {
            let mut cfg = b.config.clone();
            cfg.max_concurrent = Some(if i == target { 128 } else { 8 });
            *b = Arc::new(Backend::new(cfg, b.state.clone()));
        }
        // the engine's batch, learned: 32 at the home
        c[target].0.state.set_signals(Signals {
            at_ms: crate::fleet::backend::monotonic_ms().max(1),
            interval_ms: 1000,
            learned_slots: Some(32),
            ..Signals::default()
        });
        let r = Router::new();
        let input = shared_prompt(prefix);
        let mut others: Vec<_> = Vec::new();
        for (i, (b, _)) in c.iter().enumerate() {
            if i != target {
                others.extend((0..2).map(|_| LoadGuard::new(b.state.clone(), 100)));
            }
        }
        // 33 at home on 32 slots: this one would wait behind two short answers; it stays (the
        // others have room, but moving would cost the prefix its cache for a few ms)
        let mut guards: Vec<_> = (0..33)
            .map(|_| LoadGuard::new(c[target].0.state.clone(), 100))
            .collect();
        for _ in 0..4 {
            assert_eq!(
                r.pick(&SNAPSHOT, PolicyKind::PrefixAffinity, &c, &[], &input),
                Some(target)
            );
        }
        // a deep queue of long answers: it leaves
        guards.extend((0..31).map(|_| LoadGuard::new(c[target].0.state.clone(), 2000)));
        assert_ne!(
            r.pick(&SNAPSHOT, PolicyKind::PrefixAffinity, &c, &[], &input),
            Some(target)
        );
    }

    #[test]
    fn affinity_homes_prefixes_in_proportion_to_learned_capacity() {
        let c = backends(2);
        // the same prefill, twice the decode speed at the same batch slots: twice the weight
        measure(&c[0].0, 20_000.0, 100.0);
        measure(&c[1].0, 20_000.0, 50.0);
        let r = Router::new();
        let keys = 4000u64;
        let to_fast = (0..keys)
            .filter(|k| {
                r.pick(
                    &SNAPSHOT,
                    PolicyKind::PrefixAffinity,
                    &c,
                    &[],
                    &shared_prompt(k.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                ) == Some(0)
            })
            .count();
        let share = to_fast as f64 / keys as f64;
        // 2/3 (binomial sd 0.75 percentage points at 4000 keys)
        assert!((share - 2.0 / 3.0).abs() < 0.03, "fast share {share}");
    }
}
