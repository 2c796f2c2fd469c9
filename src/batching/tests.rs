use std::time::Duration;

use super::*;

fn timing(max_num_seqs: usize, kv: u64) -> Timing {
    Timing {
        max_num_seqs,
        kv_capacity_tokens: kv,
        prefill_per_token: Duration::from_micros(10),
        decode_base: Duration::from_millis(10),
        decode_per_seq: Duration::from_millis(1),
        block_size: 4,
        ..Timing::default()
    }
}

fn queued(id: u32, prompt: Vec<u32>, out_len: u32) -> Queued<u32> {
    Queued {
        prompt_len: prompt.len() as u32,
        blocks: block_hashes(&prompt, 4),
        unique_blocks: 0,
        tokens: Vec::new(),
        out_len,
        lora: 0,
        tag: id,
    }
}

#[test]
fn admission_stops_at_the_batch_limit_and_at_kv_capacity() {
    let mut b = Batch::new(timing(2, 1000));
    for i in 0..3 {
        b.waiting.push_back(queued(i, vec![i; 8], 4));
    }
    assert_eq!(b.admit(|_| {}), 16);
    assert_eq!(b.running.len(), 2);
    assert_eq!(b.kv_reserved(), 24);

    let mut b = Batch::new(timing(8, 30));
    for i in 0..3 {
        b.waiting.push_back(queued(i, vec![i; 8], 4));
    }
    b.admit(|_| {});
    assert_eq!(
        b.running.len(),
        2,
        "a third 12-token reservation does not fit in 30"
    );
}

#[test]
fn a_request_larger_than_the_cache_runs_alone() {
    let mut b = Batch::new(timing(8, 10));
    b.waiting.push_back(queued(0, vec![1; 40], 4));
    b.waiting.push_back(queued(1, vec![2; 4], 1));
    b.admit(|_| {});
    assert_eq!(b.running.len(), 1);
}

#[test]
fn steps_cost_base_per_sequence_and_uncached_prefill() {
    let mut b = Batch::new(timing(8, 1000));
    b.waiting.push_back(queued(0, vec![1; 8], 2));
    b.waiting.push_back(queued(1, vec![1; 8], 2));
    // the second prompt hits the first's blocks, but its last block is computed again (the
    // last token always is, and hits are whole blocks)
    let prefill = b.admit(|_| {});
    assert_eq!(prefill, 8 + 4);
    assert_eq!(b.running[1].cached, 4);
    assert_eq!(
        b.step_duration(prefill),
        Duration::from_millis(12) + Duration::from_micros(120)
    );
}

#[test]
fn a_separate_prefill_pass_costs_one_more_base_only_beside_a_running_batch() {
    let mut b = Batch::new(Timing {
        prefill_pass: true,
        ..timing(8, 1000)
    });
    b.waiting.push_back(queued(0, vec![1; 8], 4));
    // alone: one pass
    let prefill = b.admit(|_| {});
    assert_eq!(
        b.step_duration(prefill),
        Duration::from_millis(11) + Duration::from_micros(80)
    );
    b.advance(1);
    // beside the running one: a prefill pass and a decode pass, each with the base; the new
    // one's first token comes at the end of its own pass, and the decode gives it a second
    b.waiting.push_back(queued(1, vec![2; 8], 4));
    let prefill = b.admit(|_| {});
    assert_eq!(
        b.step_duration(prefill),
        Duration::from_millis(22) + Duration::from_micros(80)
    );
    assert_eq!(
        b.first_token_after(prefill),
        Duration::from_millis(11) + Duration::from_micros(80)
    );
    assert_eq!(b.first_tokens(), 1);
    assert_eq!(b.advance(1), 2);
    assert_eq!(b.running[1].generated, 2);
    // nothing admitted: a decode pass
    let prefill = b.admit(|_| {});
    assert_eq!(b.step_duration(prefill), Duration::from_millis(12));
}

#[test]
fn advancing_finishes_sequences_and_frees_their_reservation() {
    let mut b = Batch::new(timing(8, 1000));
    b.waiting.push_back(queued(0, vec![1; 4], 2));
    b.waiting.push_back(queued(1, vec![2; 4], 5));
    b.waiting.push_back(queued(2, vec![3; 4], 0));
    b.admit(|_| {});
    assert_eq!(
        b.steps_to_next_finish(),
        1,
        "an empty answer finishes at the first step"
    );
    assert_eq!(b.advance(2), 4);
    let mut done = Vec::new();
    b.take_done(|s| done.push(s.tag));
    done.sort();
    assert_eq!(done, [0, 2]);
    assert_eq!(b.kv_reserved(), 9);
    assert_eq!(b.steps_to_next_finish(), 3);
    assert_eq!(b.retain_running(|_| false), 1);
    assert_eq!(b.kv_reserved(), 0);
    assert!(b.is_idle());
}

/// A queued request whose prompt is `prompt`, with its tokens for a listener.
fn listened(id: u32, prompt: Vec<u32>) -> Queued<u32> {
    Queued {
        tokens: prompt.clone(),
        ..queued(id, prompt, 1)
    }
}

/// `blocks` whole blocks of 4 tokens, distinct per `seed`.
fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * 4).map(|i| seed * 1000 + i).collect()
}

/// Admit everything waiting and finish it.
fn run(b: &mut Batch<u32>, q: Queued<u32>) -> u32 {
    b.waiting.push_back(q);
    b.admit(|_| {});
    let cached = b.running.last().map_or(0, |s| s.cached);
    b.advance(1);
    b.take_done(|_| {});
    cached
}

#[test]
fn a_listener_hears_each_block_stored_once_with_its_parent_and_tokens() {
    let mut b = Batch::new(timing(8, 1000));
    b.listen();
    let shared = prompt(1, 2);
    let mut first = shared.clone();
    first.extend(prompt(2, 1));
    first.push(7); // a partial block is never stored
    assert_eq!(run(&mut b, listened(0, first.clone())), 0);
    let h = block_hashes(&first, 4);
    assert_eq!(
        b.take_cache_events(),
        [CacheEvent::Stored {
            parent: None,
            hashes: h.clone(),
            tokens: first[..12].to_vec(),
            lora: 0,
        }]
    );
    // the shared prefix is found; only the new block is announced, hanging off it
    let mut second = shared.clone();
    second.extend(prompt(3, 1));
    assert_eq!(run(&mut b, listened(1, second.clone())), 8);
    let h2 = block_hashes(&second, 4);
    assert_eq!(
        b.take_cache_events(),
        [CacheEvent::Stored {
            parent: Some(h[1]),
            hashes: vec![h2[2]],
            tokens: second[8..12].to_vec(),
            lora: 0,
        }]
    );
    // cached to its last token: the last block is computed and stored again, as vLLM does
    assert_eq!(run(&mut b, listened(2, shared.clone())), 4);
    let [CacheEvent::Stored { parent, hashes, .. }] = &b.take_cache_events()[..] else {
        panic!("one store");
    };
    assert_eq!((*parent, &hashes[..]), (Some(h[0]), &h[1..2]));
}

#[test]
fn a_listener_that_applies_the_events_holds_what_the_cache_holds() {
    // room for 6 blocks of 4 tokens; prompts of 1-3 blocks over a few shared prefixes
    let t = Timing {
        prefix_cache_tokens: Some(24),
        ..timing(8, 1000)
    };
    let mut b = Batch::new(t);
    b.listen();
    let mut held = std::collections::HashSet::new();
    let mut removed = 0;
    for i in 0..200u32 {
        let mut p = prompt(i % 3, 1);
        p.extend(prompt(100 + i % 7, 1 + i % 2));
        let ids = p.clone();
        run(&mut b, listened(i, p));
        let events = b.take_cache_events();
        // as vLLM publishes them: the evictions the new blocks caused, then the store
        let first_store = events
            .iter()
            .position(|e| matches!(e, CacheEvent::Stored { .. }));
        let last_removal = events
            .iter()
            .rposition(|e| matches!(e, CacheEvent::Removed(_)));
        if let (Some(s), Some(r)) = (first_store, last_removal) {
            assert!(r < s, "prompt {i}: {events:?}");
        }
        for e in events {
            match e {
                CacheEvent::Stored { hashes, .. } => held.extend(hashes),
                CacheEvent::Removed(h) => {
                    assert!(held.remove(&h), "{h} removed but never stored");
                    removed += 1;
                }
                CacheEvent::Cleared => held.clear(),
            }
        }
        // every block of the prompt just admitted is cached (it fits)
        for h in block_hashes(&ids, 4) {
            assert!(held.contains(&h));
        }
        assert_eq!(held.len(), b.prefix.len(), "after prompt {i}");
    }
    assert!(removed > 100, "evictions happened: {removed}");
}

#[test]
fn a_reset_waits_for_running_sequences_unless_forced_and_is_heard() {
    let mut b = Batch::new(timing(8, 1000));
    b.listen();
    b.waiting.push_back(listened(0, prompt(1, 2)));
    b.admit(|_| {});
    b.take_cache_events();
    assert!(!b.reset_prefix_cache(false), "blocks in use");
    assert!(b.take_cache_events().is_empty());
    assert!(b.reset_prefix_cache(true));
    assert_eq!(b.take_cache_events(), [CacheEvent::Cleared]);
    b.advance(1);
    b.take_done(|_| {});
    assert!(b.reset_prefix_cache(false));
    assert_eq!(run(&mut b, listened(1, prompt(1, 2))), 0, "nothing cached");
}

#[test]
fn a_prompt_larger_than_the_cache_is_stored_then_trimmed() {
    let t = Timing {
        prefix_cache_tokens: Some(8),
        ..timing(8, 1000)
    };
    let mut b = Batch::new(t);
    b.listen();
    let p = prompt(1, 3);
    let h = block_hashes(&p, 4);
    run(&mut b, listened(0, p));
    let events = b.take_cache_events();
    assert!(matches!(&events[0], CacheEvent::Stored { hashes, .. } if *hashes == h));
    // the cache keeps the prompt's first two blocks; the listener hears the third go after
    // it was stored
    assert_eq!(events[1..], [CacheEvent::Removed(h[2])]);
}

#[test]
fn without_a_listener_nothing_is_recorded() {
    let mut b = Batch::new(timing(8, 1000));
    run(&mut b, listened(0, prompt(1, 2)));
    b.reset_prefix_cache(false);
    assert!(b.take_cache_events().is_empty());
}

/// A queued request under the adapter `lora`.
fn adapted(id: u32, lora: u32) -> Queued<u32> {
    Queued {
        lora,
        ..queued(id, vec![id; 8], 4)
    }
}

#[test]
fn a_request_whose_adapter_has_no_slot_is_deferred_and_others_pass_it() {
    let mut b = Batch::new(timing(8, 1000));
    b.limit_loras(1);
    b.waiting.push_back(adapted(0, 1));
    b.waiting.push_back(adapted(1, 2));
    b.waiting.push_back(adapted(2, 0));
    b.waiting.push_back(adapted(3, 1));
    b.admit(|_| {});
    let running: Vec<u32> = b.running.iter().map(|s| s.tag).collect();
    assert_eq!(
        running,
        [0, 2, 3],
        "adapter 2 waits; the base model and adapter 1 pass it"
    );
    assert_eq!(b.deferred(), 1);
    assert_eq!(b.waiting.front().map(|q| q.tag), Some(1));
    // still no slot while adapter 1 runs
    b.admit(|_| {});
    assert_eq!(b.deferred(), 1);
    // adapter 1's requests finish: adapter 2 gets the slot
    b.advance(4);
    b.take_done(|_| {});
    b.admit(|_| {});
    assert_eq!(b.running.iter().map(|s| s.lora).collect::<Vec<_>>(), [2]);
    assert_eq!(b.deferred(), 0);
}

#[test]
fn without_a_lora_limit_adapters_do_not_wait() {
    let mut b = Batch::new(timing(8, 1000));
    for (i, lora) in [1, 2, 3].into_iter().enumerate() {
        b.waiting.push_back(adapted(i as u32, lora));
    }
    b.admit(|_| {});
    assert_eq!(b.running.len(), 3);
    assert_eq!(b.deferred(), 0);
}
