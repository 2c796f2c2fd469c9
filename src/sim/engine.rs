//! The continuous-batching timing model: one event-driven scheduler task per model.
//!
//! A request is submitted with its prompt token ids and its planned output length; it joins the
//! *waiting* queue (FIFO). Before every engine step the scheduler admits waiting requests while
//! the running batch has fewer than `max_num_seqs` sequences and the KV cache can hold the
//! request's reservation (`prompt + output` tokens). Admission looks the prompt up in the prefix
//! cache (whole blocks of `block_size` tokens, chained hashes, least recently used evicted, as
//! in vLLM); only uncached tokens are prefilled. One step lasts
//! `decode_base + decode_per_seq × running + prefill_per_token × uncached tokens admitted`,
//! divided by `speed` and multiplied by the `slow` fault factor; after the step every running
//! sequence has one more token, reported to its request through a bounded channel.
//!
//! Invariants:
//! - `running ≤ max_num_seqs`, and the KV reservation never exceeds capacity, except that a
//!   single request larger than the whole cache is admitted alone into an empty batch (so it
//!   cannot wait forever).
//! - The scheduler never blocks on a slow client: progress messages carry the cumulative token
//!   count, so a full channel just skips a message; the final one is retried until delivered.
//! - A request whose receiver is dropped (client gone) leaves the queue or the batch and frees
//!   its KV reservation at the next step.
//! - The gauges in [`ModelStats`] are written only by the scheduler, except `waiting`, which
//!   `submit` increments so admission limits see a request at once.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::config::Timing;
use super::fault::FaultState;
use super::metrics::ModelStats;

/// Progress of one request, as seen by its handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Progress {
    /// Tokens generated so far (cumulative).
    pub generated: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached: u32,
    /// The answer is complete.
    pub done: bool,
}

struct Submit {
    prompt_ids: Vec<u32>,
    out_len: u32,
    events: mpsc::Sender<Progress>,
    enqueued: Instant,
}

struct Seq {
    events: mpsc::Sender<Progress>,
    prompt_len: u32,
    out_len: u32,
    reserved: u64,
    generated: u32,
    cached: u32,
    enqueued: Instant,
    admitted: Instant,
}

/// Handle to the scheduler of one model; dropping it stops the task.
pub(crate) struct Engine {
    tx: mpsc::UnboundedSender<Submit>,
    pub(crate) stats: Arc<ModelStats>,
    task: JoinHandle<()>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Engine {
    pub(crate) fn start(
        timing: Timing,
        speed: f64,
        fault: Arc<FaultState>,
        stats: Arc<ModelStats>,
    ) -> Engine {
        let (tx, rx) = mpsc::unbounded_channel();
        let sched = Scheduler {
            prefix: PrefixCache::new(
                (timing
                    .prefix_cache_tokens
                    .unwrap_or(timing.kv_capacity_tokens)
                    / u64::from(timing.block_size.max(1)))
                .max(1) as usize,
                timing.block_size.max(1),
            ),
            timing,
            speed,
            fault,
            stats: stats.clone(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            finishing: Vec::new(),
            kv_reserved: 0,
        };
        let task = tokio::spawn(sched.run(rx));
        Engine { tx, stats, task }
    }

    /// Queue a request; `None` if the scheduler is gone.
    pub(crate) fn submit(
        &self,
        prompt_ids: Vec<u32>,
        out_len: u32,
    ) -> Option<mpsc::Receiver<Progress>> {
        let (events, rx) = mpsc::channel(32);
        self.stats.waiting.fetch_add(1, Relaxed);
        let s = Submit {
            prompt_ids,
            out_len,
            events,
            enqueued: Instant::now(),
        };
        if self.tx.send(s).is_err() {
            self.stats.waiting.fetch_sub(1, Relaxed);
            return None;
        }
        Some(rx)
    }
}

struct Scheduler {
    timing: Timing,
    speed: f64,
    fault: Arc<FaultState>,
    stats: Arc<ModelStats>,
    waiting: VecDeque<Submit>,
    running: Vec<Seq>,
    finishing: Vec<(mpsc::Sender<Progress>, Progress)>,
    kv_reserved: u64,
    prefix: PrefixCache,
}

impl Scheduler {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Submit>) {
        let mut next_step = tokio::time::Instant::now();
        loop {
            if self.running.is_empty() && self.waiting.is_empty() && self.finishing.is_empty() {
                match rx.recv().await {
                    Some(s) => self.waiting.push_back(s),
                    None => return,
                }
                next_step = tokio::time::Instant::now();
            }
            while let Ok(s) = rx.try_recv() {
                self.waiting.push_back(s);
            }
            self.retry_finishing();
            self.drop_cancelled_waiting();
            let prefill_tokens = self.admit();
            self.publish();
            if self.running.is_empty() {
                if !self.finishing.is_empty() {
                    // wait a little for slow clients to drain their channel
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                continue;
            }
            let t = &self.timing;
            let step = t
                .decode_base
                .saturating_add(t.decode_per_seq.saturating_mul(self.running.len() as u32))
                .saturating_add(t.prefill_per_token.saturating_mul(prefill_tokens))
                .min(Duration::from_secs(3600));
            let factor = self.fault.slow_factor() / self.speed;
            let step = step.mul_f64(factor.clamp(0.0, 1.0e6));
            let now = tokio::time::Instant::now();
            // keep the average step rate right even when steps are shorter than the timer tick
            next_step = (next_step + step).max(now - Duration::from_millis(5));
            tokio::time::sleep_until(next_step).await;
            self.step_done();
            self.publish();
        }
    }

    fn drop_cancelled_waiting(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|s| !s.events.is_closed());
        let dropped = before - self.waiting.len();
        if dropped > 0 {
            self.stats.waiting.fetch_sub(dropped as u64, Relaxed);
            self.stats.aborted.fetch_add(dropped as u64, Relaxed);
        }
    }

    /// Admit waiting requests; returns the number of uncached prompt tokens to prefill.
    fn admit(&mut self) -> u32 {
        let mut prefill = 0u32;
        let cap = self.timing.kv_capacity_tokens;
        while self.running.len() < self.timing.max_num_seqs {
            let Some(front) = self.waiting.front() else {
                break;
            };
            let need = front.prompt_ids.len() as u64 + u64::from(front.out_len);
            let fits = self.kv_reserved + need <= cap;
            if !fits && !self.running.is_empty() {
                break;
            }
            let Some(s) = self.waiting.pop_front() else {
                break;
            };
            self.stats.waiting.fetch_sub(1, Relaxed);
            let prompt_len = s.prompt_ids.len() as u32;
            let hit = self.prefix.lookup_insert(&s.prompt_ids);
            let hit = hit.min(prompt_len.saturating_sub(1));
            prefill += prompt_len - hit;
            self.stats
                .prefix_queries
                .fetch_add(u64::from(prompt_len), Relaxed);
            self.stats.prefix_hits.fetch_add(u64::from(hit), Relaxed);
            self.stats
                .prompt_tokens
                .fetch_add(u64::from(prompt_len), Relaxed);
            let now = Instant::now();
            self.stats
                .queue_time
                .observe(now.saturating_duration_since(s.enqueued).as_secs_f64());
            self.kv_reserved += need;
            self.running.push(Seq {
                events: s.events,
                prompt_len,
                out_len: s.out_len,
                reserved: need,
                generated: 0,
                cached: hit,
                enqueued: s.enqueued,
                admitted: now,
            });
        }
        prefill
    }

    fn step_done(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        let mut tokens = 0u64;
        while i < self.running.len() {
            let seq = &mut self.running[i];
            if seq.events.is_closed() {
                self.kv_reserved -= seq.reserved;
                self.stats.aborted.fetch_add(1, Relaxed);
                self.running.swap_remove(i);
                continue;
            }
            if seq.out_len > 0 {
                seq.generated += 1;
                tokens += 1;
                if seq.generated == 1 {
                    self.stats
                        .ttft
                        .observe(now.saturating_duration_since(seq.enqueued).as_secs_f64());
                }
            }
            let done = seq.generated >= seq.out_len;
            let p = Progress {
                generated: seq.generated,
                cached: seq.cached,
                done,
            };
            let sent = seq.events.try_send(p);
            if done {
                self.stats
                    .e2e
                    .observe(now.saturating_duration_since(seq.enqueued).as_secs_f64());
                self.stats
                    .inference_time
                    .observe(now.saturating_duration_since(seq.admitted).as_secs_f64());
                self.kv_reserved -= seq.reserved;
                let seq = self.running.swap_remove(i);
                if let Err(mpsc::error::TrySendError::Full(p)) = sent {
                    self.finishing.push((seq.events, p));
                }
                continue;
            }
            i += 1;
        }
        self.stats.generation_tokens.fetch_add(tokens, Relaxed);
        self.stats.iterations.fetch_add(1, Relaxed);
    }

    fn retry_finishing(&mut self) {
        self.finishing
            .retain(|(tx, p)| matches!(tx.try_send(*p), Err(mpsc::error::TrySendError::Full(_))));
    }

    fn publish(&self) {
        let s = &self.stats;
        s.running.store(self.running.len() as u64, Relaxed);
        let used: u64 = self
            .running
            .iter()
            .map(|q| u64::from(q.prompt_len) + u64::from(q.generated))
            .sum();
        s.kv_used_tokens.store(used, Relaxed);
        s.kv_reserved_tokens.store(self.kv_reserved, Relaxed);
        s.kv_capacity_tokens
            .store(self.timing.kv_capacity_tokens, Relaxed);
        let max_tokens: u64 = self
            .running
            .iter()
            .map(|q| u64::from(q.prompt_len) + u64::from(q.out_len))
            .sum();
        s.batch_max_tokens.store(max_tokens, Relaxed);
    }
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
struct PrefixCache {
    /// Block hash → its last use (a tick of `clock`).
    blocks: HashMap<u64, u64>,
    /// Last use → block hash: the least recently used first.
    by_use: BTreeMap<u64, u64>,
    clock: u64,
    capacity: usize,
    block: u32,
}

impl PrefixCache {
    fn new(capacity: usize, block: u32) -> Self {
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
    fn lookup_insert(&mut self, ids: &[u32]) -> u32 {
        let mut h: u64 = 0x84222325cbf29ce4;
        let mut hashes = Vec::with_capacity(ids.len() / self.block as usize);
        for chunk in ids.chunks_exact(self.block as usize) {
            for t in chunk {
                h = (h ^ u64::from(*t)).wrapping_mul(0x0000_0100_0000_01b3);
            }
            h = h.rotate_left(5) ^ 0x9e37_79b9_7f4a_7c15;
            hashes.push(h);
        }
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
