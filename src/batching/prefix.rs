//! The prefix cache of whole prompt blocks (see [`PrefixCache`]).

use std::collections::{BTreeMap, HashMap};

/// The chained hashes of the whole `block`-token blocks of `ids` (a partial last block is not
/// cached, as in vLLM): each block's hash covers every token before it, so equal hashes mean
/// equal prefixes.
pub fn block_hashes(ids: &[u32], block: u32) -> Vec<u64> {
    let block = block.max(1) as usize;
    let mut h: u64 = 0x84222325cbf29ce4;
    let mut hashes = Vec::with_capacity(ids.len() / block);
    for chunk in ids.chunks_exact(block) {
        for t in chunk {
            h = (h ^ u64::from(*t)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        h = h.rotate_left(5) ^ 0x9e37_79b9_7f4a_7c15;
        hashes.push(h);
    }
    hashes
}

/// Prefix cache of whole prompt blocks, keyed by chained block hashes; evicts the least
/// recently used block, as vLLM evicts its free blocks. A lookup refreshes every block of the
/// prompt, its first blocks last: within one prompt the tail is evicted first (vLLM frees a
/// request's blocks in reverse order), so a shared prefix outlives the suffixes hanging off it
/// (a chained hash makes a block useless once a block before it is gone).
///
/// Simplification: by default the whole KV capacity is cache; vLLM caches only in blocks no
/// running request holds, so under load its cache is smaller than this one
/// (`--prefix-cache-tokens` sets a smaller one).
#[derive(Debug)]
pub struct PrefixCache {
    /// Block hash → its last use (a tick of `clock`).
    blocks: HashMap<u64, u64>,
    /// Last use → block hash: the least recently used first.
    by_use: BTreeMap<u64, u64>,
    clock: u64,
    capacity: usize,
    block: u32,
}

impl PrefixCache {
    /// Room for `capacity` blocks of `block` tokens.
    pub fn new(capacity: usize, block: u32) -> Self {
        PrefixCache {
            blocks: HashMap::new(),
            by_use: BTreeMap::new(),
            clock: 0,
            capacity: capacity.max(1),
            block: block.max(1),
        }
    }

    /// Number of leading prompt tokens already cached; caches every whole block of `ids` and
    /// marks them all used now.
    pub fn lookup_insert(&mut self, ids: &[u32]) -> u32 {
        let hashes = block_hashes(ids, self.block);
        self.lookup_insert_blocks(&hashes)
    }

    /// [`PrefixCache::lookup_insert`] for a prompt given by its block hashes.
    pub fn lookup_insert_blocks(&mut self, hashes: &[u64]) -> u32 {
        let hit_blocks = hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count() as u32;
        for h in hashes.iter().rev() {
            self.clock += 1;
            if let Some(used) = self.blocks.insert(*h, self.clock) {
                self.by_use.remove(&used);
            }
            self.by_use.insert(self.clock, *h);
        }
        while self.blocks.len() > self.capacity {
            let Some((_, old)) = self.by_use.pop_first() else {
                break;
            };
            self.blocks.remove(&old);
        }
        hit_blocks * self.block
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::PrefixCache;

    /// `blocks` whole blocks of 4 tokens, distinct per `seed`.
    fn prompt(seed: u32, blocks: u32) -> Vec<u32> {
        (0..blocks * 4).map(|i| seed * 10_000 + i).collect()
    }

    #[test]
    fn prefix_cache_hits_whole_leading_blocks() {
        let mut c = PrefixCache::new(100, 4);
        let a = prompt(1, 3);
        assert_eq!(c.lookup_insert(&a), 0);
        assert_eq!(c.lookup_insert(&a), 12);
        // the same first two blocks, then different tokens (and a partial block)
        let mut b = a[..8].to_vec();
        b.extend([7, 7, 7, 7, 7, 7]);
        assert_eq!(c.lookup_insert(&b), 8);
        assert_eq!(c.lookup_insert(&prompt(2, 3)), 0);
    }

    #[test]
    fn prefix_cache_evicts_the_least_recently_used() {
        // room for 4 blocks: a hot prefix of 2 and one other prompt of 2
        let mut c = PrefixCache::new(4, 4);
        let hot = prompt(1, 2);
        assert_eq!(c.lookup_insert(&hot), 0);
        for seed in 2..10 {
            // the hot prefix is used between every two others: it stays
            assert_eq!(c.lookup_insert(&prompt(seed, 2)), 0);
            assert_eq!(c.lookup_insert(&hot), 8, "evicted before prompt {seed}");
            assert!(c.blocks.len() <= 4);
        }
        // in insertion order it would have gone with the first other prompt; unused, it goes
        c.lookup_insert(&prompt(20, 2));
        c.lookup_insert(&prompt(21, 2));
        assert_eq!(c.lookup_insert(&hot), 0);
        assert_eq!(c.blocks.len(), c.by_use.len());
    }

    #[test]
    fn prefix_cache_evicts_a_prompts_tail_before_its_head() {
        let mut c = PrefixCache::new(4, 4);
        let long = prompt(1, 4);
        c.lookup_insert(&long);
        // one new block pushes out one block of the long prompt: its last, not its first
        c.lookup_insert(&prompt(2, 1));
        assert_eq!(c.lookup_insert(&long[..12]), 12);
    }
}
