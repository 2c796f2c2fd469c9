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
        out_len,
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
    // the second prompt hits the first's blocks (but the last token is recomputed)
    let prefill = b.admit(|_| {});
    assert_eq!(prefill, 8 + 1);
    assert_eq!(
        b.step_duration(prefill),
        Duration::from_millis(12) + Duration::from_micros(90)
    );
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
