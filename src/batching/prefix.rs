//! The prefix cache of whole prompt blocks (see [`PrefixCache`]) and what it tells a listener
//! ([`CacheEvent`]: the blocks it stored, evicted or dropped, vLLM's KV-cache events without
//! their wire form).
//!
//! Invariant: a listener that applies the events in order holds exactly the cache's hashed
//! blocks. Runs of unshareable blocks ([`PrefixCache::lookup_insert_run`]) have no hashes and
//! are never announced, so a listening owner gives every block its hash (no runs).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

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

/// One change of the prefix cache, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    /// Whole blocks of one prompt were stored (or stored again: a prompt whose every block was
    /// cached still computes its last block, as vLLM does): `hashes` in prompt order, the first
    /// one's parent `parent` (`None`: the prompt's first block), `tokens` the blocks' tokens.
    Stored {
        parent: Option<u64>,
        hashes: Vec<u64>,
        tokens: Vec<u32>,
        /// The LoRA adapter the blocks were computed under (0: the base model).
        lora: u32,
    },
    /// A block was evicted.
    Removed(u64),
    /// Every block was dropped (a reset).
    Cleared,
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
///
/// The recency order is a doubly linked list threaded through a slab of nodes (most recent at
/// `head`), so a lookup costs O(1) per block. A node is one block, or a *run* of blocks no
/// other prompt can share ([`PrefixCache::lookup_insert_run`]): such blocks are inserted
/// together and never touched again, so they stay adjacent in the recency order and one node
/// with a weight stands for all of them (eviction trims it block by block). The planner's
/// prompts are mostly such blocks, millions per run.
#[derive(Debug)]
pub struct PrefixCache {
    /// Block hash → its node.
    blocks: HashMap<u64, u32, BuildHasherDefault<BlockHasher>>,
    /// Blocks held (the nodes' weights).
    held: usize,
    nodes: Vec<Node>,
    /// Unused slots of `nodes`.
    free: Vec<u32>,
    /// The most and the least recently used node (`NONE` when empty).
    head: u32,
    tail: u32,
    capacity: usize,
    block: u32,
    /// What happened since the listener last looked (`None`: nobody listens, nothing is
    /// recorded or allocated).
    log: Option<Vec<CacheEvent>>,
}

const NONE: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Node {
    /// The block's hash (`None`: a run of unshareable blocks).
    hash: Option<u64>,
    /// Blocks it stands for.
    weight: u32,
    prev: u32,
    next: u32,
}

/// Block hashes are already hashes: a cheap finaliser spreads them over every bit instead of
/// SipHash.
#[derive(Debug, Default)]
struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z ^ (z >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

impl PrefixCache {
    /// Room for `capacity` blocks of `block` tokens.
    pub fn new(capacity: usize, block: u32) -> Self {
        PrefixCache {
            blocks: HashMap::default(),
            held: 0,
            nodes: Vec::new(),
            free: Vec::new(),
            head: NONE,
            tail: NONE,
            capacity: capacity.clamp(1, NONE as usize - 1),
            block: block.max(1),
            log: None,
        }
    }

    /// Record [`CacheEvent`]s from now on.
    pub fn listen(&mut self) {
        self.log.get_or_insert_with(Vec::new);
    }

    /// The events since the last call (none when nobody listens).
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Leading blocks of `hashes` already cached (nothing changes).
    pub fn hit_blocks(&self, hashes: &[u64]) -> u32 {
        hashes
            .iter()
            .take_while(|h| self.blocks.contains_key(h))
            .count() as u32
    }

    /// For a listener: blocks `from..` of the prompt `hashes` (tokens `ids`, computed under
    /// the adapter `lora`, 0 for none) are being stored. Costs nothing when nobody listens.
    pub fn note_stored(&mut self, hashes: &[u64], from: usize, ids: &[u32], lora: u32) {
        let Some(log) = self.log.as_mut() else {
            return;
        };
        if from >= hashes.len() {
            return;
        }
        let b = self.block as usize;
        let tokens = ids.get(from * b..hashes.len() * b).unwrap_or_default();
        log.push(CacheEvent::Stored {
            parent: from.checked_sub(1).map(|i| hashes[i]),
            hashes: hashes[from..].to_vec(),
            tokens: tokens.to_vec(),
            lora,
        });
    }

    /// Whether a listener is recording events.
    pub fn listening(&self) -> bool {
        self.log.is_some()
    }

    /// Before the prompt `hashes` (and `unique` unshareable blocks) is inserted, evict what
    /// its new blocks will need, as vLLM's allocation evicts before the blocks are stored (so
    /// a listener hears the removals first). Evicts exactly what the insertion would: the
    /// prompt's cached blocks are refreshed first and never chosen.
    pub fn make_room(&mut self, hashes: &[u64], unique: u32) {
        let mut kept = 0;
        let mut new = unique as usize;
        for h in hashes.iter().rev() {
            match self.blocks.get(h) {
                Some(&n) => {
                    self.unlink(n);
                    self.push_front(n);
                    kept += 1;
                }
                None => new += 1,
            }
        }
        self.evict_to(self.capacity.saturating_sub(new).max(kept));
    }

    /// Drop every block (vLLM's prefix-cache reset).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.nodes.clear();
        self.free.clear();
        self.held = 0;
        self.head = NONE;
        self.tail = NONE;
        if let Some(log) = self.log.as_mut() {
            log.push(CacheEvent::Cleared);
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
        self.lookup_insert_run(hashes, 0)
    }

    /// A prompt of the blocks `hashes` followed by `unique` blocks no other prompt shares
    /// (their hashes are irrelevant: they can never hit); returns the cached leading tokens.
    pub fn lookup_insert_run(&mut self, hashes: &[u64], unique: u32) -> u32 {
        let hit_blocks = self.hit_blocks(hashes);
        self.insert_run(hashes, unique);
        hit_blocks * self.block
    }

    /// Cache the blocks `hashes` followed by a run of `unique` unshareable blocks, mark them
    /// all used now (the first ones last) and evict what no longer fits.
    pub fn insert_run(&mut self, hashes: &[u64], unique: u32) {
        debug_assert!(
            unique == 0 || self.log.is_none(),
            "a run's blocks cannot be announced"
        );
        if unique > 0 {
            let n = self.alloc(None, unique);
            self.push_front(n);
        }
        for h in hashes.iter().rev() {
            match self.blocks.get(h) {
                Some(&n) => {
                    self.unlink(n);
                    self.push_front(n);
                }
                None => {
                    let n = self.alloc(Some(*h), 1);
                    self.blocks.insert(*h, n);
                    self.push_front(n);
                }
            }
        }
        self.evict();
    }

    /// Drop least recently used blocks until the cache holds at most its capacity.
    fn evict(&mut self) {
        self.evict_to(self.capacity);
    }

    /// Drop least recently used blocks until the cache holds at most `limit`.
    fn evict_to(&mut self, limit: usize) {
        while self.held > limit && self.tail != NONE {
            let old = self.tail;
            let excess = (self.held - limit) as u32;
            let node = &mut self.nodes[old as usize];
            if node.weight > excess {
                node.weight -= excess;
                self.held -= excess as usize;
                break;
            }
            self.held -= node.weight as usize;
            let hash = node.hash;
            self.unlink(old);
            if let Some(h) = hash {
                self.blocks.remove(&h);
                if let Some(log) = self.log.as_mut() {
                    log.push(CacheEvent::Removed(h));
                }
            }
            self.free.push(old);
        }
    }

    fn alloc(&mut self, hash: Option<u64>, weight: u32) -> u32 {
        self.held += weight as usize;
        let node = Node {
            hash,
            weight,
            prev: NONE,
            next: NONE,
        };
        match self.free.pop() {
            Some(n) => {
                self.nodes[n as usize] = node;
                n
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn unlink(&mut self, n: u32) {
        let Node { prev, next, .. } = self.nodes[n as usize];
        match prev {
            NONE => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NONE => self.tail = prev,
            x => self.nodes[x as usize].prev = prev,
        }
    }

    fn push_front(&mut self, n: u32) {
        self.nodes[n as usize].prev = NONE;
        self.nodes[n as usize].next = self.head;
        match self.head {
            NONE => self.tail = n,
            h => self.nodes[h as usize].prev = n,
        }
        self.head = n;
    }

    /// Blocks held now.
    pub fn len(&self) -> usize {
        self.held
    }

    pub fn is_empty(&self) -> bool {
        self.held == 0
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
        assert_eq!(c.blocks.len() + c.free.len(), c.nodes.len());
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

    #[test]
    fn a_run_of_unshared_blocks_takes_room_and_is_trimmed_from_its_tail() {
        let mut c = PrefixCache::new(6, 4);
        let shared = super::block_hashes(&prompt(1, 2), 4);
        // 2 shared blocks and a run of 3: 5 held
        assert_eq!(c.lookup_insert_run(&shared, 3), 0);
        assert_eq!(c.len(), 5);
        // the same prefix with another run of 3: the first run loses 2 of its blocks
        assert_eq!(c.lookup_insert_run(&shared, 3), 8);
        assert_eq!(c.len(), 6);
        // a run larger than the cache pushes out everything but... itself, trimmed
        c.lookup_insert_run(&[], 10);
        assert_eq!(c.len(), 6);
        assert_eq!(c.lookup_insert_run(&shared, 0), 0, "the prefix was evicted");
    }
}
