use std::sync::Arc;

use super::*;
use crate::config::{BackendConfig, BackendKind, Timeouts};
use crate::fleet::kv::{Prompt, Status};
use crate::fleet::load::LoadGuard;
use crate::fleet::{Backend, BackendState};
use crate::kvevents::{BlockStored, EngineHash, Event, EventBatch};
use crate::routing::tests::measure;
use crate::routing::RouteInput;

const BLOCK: u32 = 16;
const PROMPT: u32 = 1_000;

fn backends(names: &[&str]) -> Vec<Backend> {
    names
        .iter()
        .map(|name| {
            let cfg = BackendConfig {
                name: (*name).into(),
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
            Backend::new(cfg, Arc::new(BackendState::new()))
        })
        .collect()
}

/// `b`'s engine reports its cache, holding the first `tokens` of the prompt (whole blocks).
fn holds(b: &Backend, tokens: u32) {
    let kv = b.state.kv();
    kv.rebuild(Status::Warm);
    let n = tokens / BLOCK;
    if n == 0 {
        return;
    }
    kv.apply(&EventBatch {
        ts: 0.0,
        events: vec![Event::BlockStored(BlockStored {
            block_hashes: (0..u64::from(n)).map(EngineHash).collect(),
            parent_block_hash: None,
            token_ids: (0..n * BLOCK).collect(),
            block_size: BLOCK,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        })],
        data_parallel_rank: None,
    });
}

fn input(prefix: u64, with_ids: bool) -> RouteInput {
    RouteInput {
        tokens: u64::from(PROMPT) + 100,
        prefix_hash: Some(prefix),
        prompt_tokens: u64::from(PROMPT),
        prompt_exact: with_ids,
        prefix_tokens: 0,
        prompt: with_ids.then(|| Arc::new(Prompt::new((0..PROMPT).collect(), None))),
        adapter: None,
        background: false,
    }
}

fn choose(bs: &[Backend], input: &RouteInput) -> usize {
    let refs: Vec<&Backend> = bs.iter().collect();
    let models = vec!["m"; bs.len()];
    TokenAware.choose(&Pick {
        backends: &refs,
        models: &models,
        input,
        p2c_above: 16,
    })
}

fn score(b: &Backend, input: &RouteInput, prior: Prior) -> f64 {
    score::breakdown(b, "m", input.request_on(b), prior).score
}

/// A session's cached home keeps it while its expected finish is within [`NOISE`] of the
/// best, then loses it to the idle engine: the estimate decides once it can tell them apart.
#[test]
fn a_cached_home_keeps_its_session_until_the_estimate_tells_them_apart() {
    let bs = backends(&["home", "idle"]);
    holds(&bs[0], 960);
    holds(&bs[1], 0);
    measure(&bs[0], 2000.0, 50.0);
    measure(&bs[1], 2000.0, 50.0);
    let req = input(7, true);
    let mut load = Vec::new();
    let (mut stayed_slower, mut left) = (false, false);
    for _ in 0..400 {
        let prior = Prior::of(&[&bs[0], &bs[1]]);
        let (home, idle) = (score(&bs[0], &req, prior), score(&bs[1], &req, prior));
        let chosen = choose(&bs, &req);
        if home <= idle * (1.0 + NOISE) {
            assert_eq!(chosen, 0, "home {home} idle {idle}");
            stayed_slower |= home > idle;
        } else {
            assert_eq!(chosen, 1, "home {home} idle {idle}");
            left = true;
            break;
        }
        load.push(LoadGuard::new(bs[0].state.clone(), 200));
    }
    assert!(
        stayed_slower,
        "never scored the home slower within the noise"
    );
    assert!(left, "the home kept the session however loaded");
}

/// With the same facts (nothing cached anywhere) and scores within the noise, the choice is
/// the prefix's rendezvous rank, whatever the random start and whichever is a little busier:
/// the choice every replica makes.
#[test]
fn near_equal_scores_without_a_cache_go_by_rank_every_time() {
    let bs = backends(&["a", "b", "c"]);
    for b in &bs {
        holds(b, 0);
    }
    measure(&bs[0], 2000.0, 50.0);
    measure(&bs[1], 1900.0, 50.0);
    measure(&bs[2], 2000.0, 48.0);
    for prefix in 0..20u64 {
        let req = input(prefix, true);
        let by_rank = (0..3)
            .max_by_key(|&i| rendezvous_rank(prefix, bs[i].name()))
            .unwrap();
        for _ in 0..20 {
            assert_eq!(choose(&bs, &req), by_rank, "prefix {prefix}");
        }
    }
}

/// Without token ids (no tokenizer, or no engine reporting its cache) the lowest score wins,
/// as before: a backend measured slower (beyond the speeds' noise, within the scores') is
/// avoided.
#[test]
fn without_kv_facts_the_lowest_score_wins() {
    let bs = backends(&["a", "b"]);
    measure(&bs[0], 1500.0, 50.0);
    measure(&bs[1], 2000.0, 50.0);
    for prefix in 0..20u64 {
        assert_eq!(choose(&bs, &input(prefix, false)), 1, "prefix {prefix}");
    }
}

/// Engines whose subscriptions are not live give no facts: the lowest score wins.
#[test]
fn engines_not_reporting_their_caches_give_no_facts() {
    let bs = backends(&["a", "b"]);
    measure(&bs[0], 1500.0, 50.0);
    measure(&bs[1], 2000.0, 50.0);
    for prefix in 0..20u64 {
        assert_eq!(choose(&bs, &input(prefix, true)), 1, "prefix {prefix}");
    }
}
