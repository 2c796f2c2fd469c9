//! One engine's cached prompt blocks, as its KV events describe them (see [`BlockIndex`]).

use hashbrown::HashMap;

use crate::kvevents::{BlockStored, EngineHash, Event};

/// The hash of the empty prefix; a LoRA adapter's blocks start from its own root, so a base
/// model's prefix never counts as cached for an adapter's request.
const ROOT: u64 = 0x6a09_e667_f3bc_c908;

/// The gateway's own hash of a block: its parent's hash and its tokens. Deterministic (no
/// random seed), so every replica and every request computes the same keys.
pub fn chain(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = parent ^ 0x9e37_79b9_7f4a_7c15;
    for t in tokens {
        h = (h ^ u64::from(*t)).wrapping_mul(0x0000_0100_0000_01b3);
        h ^= h >> 29;
    }
    // splitmix64's finaliser: FNV's low bits are weak
    h = (h ^ (h >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The root a prompt's chain starts from under `lora` (none: the base model).
pub fn root(lora: Option<&str>) -> u64 {
    match lora {
        None => ROOT,
        Some(name) => {
            let ids: Vec<u32> = name.bytes().map(u32::from).collect();
            chain(ROOT ^ 0x5a5a_5a5a, &ids)
        }
    }
}

/// The chained hashes of the whole `block`-token blocks of `ids` under `lora`.
pub fn prompt_hashes(ids: &[u32], block: u32, lora: Option<&str>) -> Vec<u64> {
    let block = block.max(1) as usize;
    let mut h = root(lora);
    ids.chunks_exact(block)
        .map(|c| {
            h = chain(h, c);
            h
        })
        .collect()
}

/// What applying one event did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub stored: u32,
    pub removed: u32,
    /// Stored blocks whose parent the index does not hold (stored before the subscription, or
    /// its event lost): they cannot be keyed, so they are not counted as cached.
    pub orphaned: u32,
    pub cleared: bool,
    /// The index passed its bound and was cleared.
    pub overflowed: bool,
}

/// The blocks one engine holds: the gateway's own chained hash of each block's tokens (what a
/// prompt is looked up by) and the engine's hash of it (what `BlockRemoved` names).
///
/// Invariants: the two maps hold the same blocks; at most `cap` blocks are held (an index past
/// its bound has missed removals, so it is cleared rather than trusted); the block size is the
/// one the engine's events carry (the first seen; blocks of another size are not keyed).
#[derive(Debug)]
pub struct BlockIndex {
    /// Own hash → engine hash.
    blocks: HashMap<u64, EngineHash>,
    /// Engine hash → own hash.
    by_engine: HashMap<EngineHash, u64>,
    block_size: Option<u32>,
    cap: usize,
}

impl BlockIndex {
    /// An empty index holding at most `cap` blocks.
    pub fn new(cap: usize) -> Self {
        BlockIndex {
            blocks: HashMap::new(),
            by_engine: HashMap::new(),
            block_size: None,
            cap: cap.max(1),
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Tokens per block, once an event told it.
    pub fn block_size(&self) -> Option<u32> {
        self.block_size
    }

    pub fn clear(&mut self) {
        self.blocks.clear();
        self.by_engine.clear();
    }

    pub fn apply(&mut self, event: &Event) -> Applied {
        match event {
            Event::BlockStored(s) => self.store(s),
            Event::BlockRemoved(r) => {
                let mut applied = Applied::default();
                for e in &r.block_hashes {
                    if let Some(own) = self.by_engine.remove(e) {
                        self.blocks.remove(&own);
                        applied.removed += 1;
                    }
                }
                applied
            }
            Event::AllBlocksCleared {} => {
                self.clear();
                Applied {
                    cleared: true,
                    ..Applied::default()
                }
            }
            Event::Other => Applied::default(),
        }
    }

    fn store(&mut self, s: &BlockStored) -> Applied {
        let mut applied = Applied::default();
        let size = *self.block_size.get_or_insert(s.block_size);
        let n = s.block_hashes.len();
        if size == 0 || s.block_size != size || s.token_ids.len() != n * size as usize {
            applied.orphaned = n as u32;
            return applied;
        }
        let parent = match s.parent_block_hash {
            None => Some(root(s.lora_name.as_deref())),
            Some(p) => self.by_engine.get(&p).copied(),
        };
        let Some(mut h) = parent else {
            applied.orphaned = n as u32;
            return applied;
        };
        for (engine, tokens) in s
            .block_hashes
            .iter()
            .zip(s.token_ids.chunks_exact(size as usize))
        {
            h = chain(h, tokens);
            if let Some(old) = self.blocks.insert(h, *engine) {
                self.by_engine.remove(&old);
            }
            self.by_engine.insert(*engine, h);
            applied.stored += 1;
        }
        if self.blocks.len() > self.cap {
            self.clear();
            applied.overflowed = true;
        }
        applied
    }

    /// Leading tokens of a prompt with chained block hashes `hashes` that the engine holds.
    pub fn cached_blocks(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(*h))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvevents::BlockRemoved;

    fn stored(engine: &[u64], parent: Option<u64>, ids: &[u32], size: u32) -> Event {
        Event::BlockStored(BlockStored {
            block_hashes: engine.iter().map(|h| EngineHash(*h)).collect(),
            parent_block_hash: parent.map(EngineHash),
            token_ids: ids.to_vec(),
            block_size: size,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
        })
    }

    fn ids(n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| i * 7 + salt).collect()
    }

    #[test]
    fn a_stored_chain_is_found_by_the_prompts_own_hashes() {
        let mut x = BlockIndex::new(100);
        let prompt = ids(10, 1);
        x.apply(&stored(&[11, 12], None, &prompt[..8], 4));
        // a later event continues the chain from the engine's hash of block 2
        x.apply(&stored(&[13], Some(12), &ids(12, 1)[8..12], 4));
        let h = prompt_hashes(&ids(13, 1), 4, None);
        assert_eq!(h.len(), 3);
        assert_eq!(x.cached_blocks(&h), 3);
        // a prompt that differs in its second block hits one block
        let mut other = ids(12, 1);
        other[5] = 999;
        assert_eq!(x.cached_blocks(&prompt_hashes(&other, 4, None)), 1);
        // the same tokens under an adapter are not the base model's blocks
        assert_eq!(
            x.cached_blocks(&prompt_hashes(&ids(12, 1), 4, Some("a"))),
            0
        );
    }

    #[test]
    fn removal_by_engine_hash_and_clear() {
        let mut x = BlockIndex::new(100);
        x.apply(&stored(&[1, 2, 3], None, &ids(6, 0), 2));
        let h = prompt_hashes(&ids(6, 0), 2, None);
        let r = x.apply(&Event::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(2), EngineHash(99)],
            medium: None,
            group_idx: None,
        }));
        assert_eq!(r.removed, 1);
        assert_eq!(
            x.cached_blocks(&h),
            1,
            "a chain is cached up to its first gap"
        );
        assert!(x.apply(&Event::AllBlocksCleared {}).cleared);
        assert!(x.is_empty());
    }

    #[test]
    fn orphans_and_wrong_shapes_are_not_keyed() {
        let mut x = BlockIndex::new(100);
        // parent never seen
        let a = x.apply(&stored(&[5], Some(77), &ids(2, 0), 2));
        assert_eq!((a.stored, a.orphaned), (0, 1));
        // token count does not match the hashes
        let b = x.apply(&stored(&[6, 7], None, &ids(3, 0), 2));
        assert_eq!(b.orphaned, 2);
        // another block size than the first seen
        x.apply(&stored(&[8], None, &ids(2, 0), 2));
        let c = x.apply(&stored(&[9], None, &ids(4, 0), 4));
        assert_eq!(c.orphaned, 1);
        assert_eq!(x.len(), 1);
        assert_eq!(x.block_size(), Some(2));
    }

    #[test]
    fn an_index_past_its_bound_is_cleared_not_trusted() {
        let mut x = BlockIndex::new(3);
        assert!(!x.apply(&stored(&[1, 2, 3], None, &ids(3, 0), 1)).overflowed);
        let a = x.apply(&stored(&[4], Some(3), &[9], 1));
        assert!(a.overflowed);
        assert!(x.is_empty());
    }

    #[test]
    fn a_block_stored_again_under_a_new_engine_hash_is_removed_by_the_new_one() {
        let mut x = BlockIndex::new(10);
        x.apply(&stored(&[1], None, &[4, 5], 2));
        x.apply(&stored(&[2], None, &[4, 5], 2));
        x.apply(&Event::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(1)],
            medium: None,
            group_idx: None,
        }));
        assert_eq!(x.len(), 1, "the stale engine hash names nothing now");
        x.apply(&Event::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(2)],
            medium: None,
            group_idx: None,
        }));
        assert!(x.is_empty());
    }
}
