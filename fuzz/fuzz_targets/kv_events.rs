//! A KV-event payload from the network never panics the decoder or the block index: whatever
//! decodes is applied to a small index whose bound holds, lookups stay within the prompt, and a
//! batch of known events written back reads back the same.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice::fleet::kv::index::{prompt_hashes, BlockIndex};
use sluice::kvevents::{decode, encode, Event};

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
        assert_eq!(decode(&encode(&batch)).ok().as_ref(), Some(&batch));
    }
});
