//! A KV-event payload from the network never panics the decoder or the block index: whatever
//! decodes is applied to a small index whose bound holds, lookups stay within the prompt, and a
//! batch of known events written back reads back the same, but for extra keys: those are folds
//! of the engine's values, so they keep only their places (which blocks have one).
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::fleet::kv::index::{prompt_hashes, BlockIndex};
use sluice::kvevents::{decode, encode, Event, EventBatch, ExtraKey};

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = decode(data) else {
        return;
    };
    let mut index = BlockIndex::new(64);
    for e in &batch.events {
        let _ = index.apply(e);
        assert!(index.len() <= 64);
    }
    if let Some(block) = index.block_size() {
        let ids: Vec<u32> = data.iter().map(|b| u32::from(*b)).collect();
        let hashes = prompt_hashes(&ids, block, None);
        assert!(index.cached_blocks(&hashes) <= hashes.len());
    }
    let known = batch.events.iter().all(|e| !matches!(e, Event::Other));
    if known && batch.ts.is_finite() {
        let again = decode(&encode(&batch)).ok().map(|b| extra_key_places(&b));
        assert_eq!(again, Some(extra_key_places(&batch)));
    }
});

/// `batch` with every extra key replaced by one placeholder.
fn extra_key_places(batch: &EventBatch) -> EventBatch {
    let mut batch = batch.clone();
    for e in &mut batch.events {
        if let Event::BlockStored(s) = e {
            for key in s.extra_keys.iter_mut().flatten().flatten() {
                *key = ExtraKey::Fold(0);
            }
        }
    }
    batch
}
