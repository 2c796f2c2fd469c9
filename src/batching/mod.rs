//! The continuous-batching engine model, without a clock: one source of truth for the
//! simulator, which runs it in real time (`sim::engine`), and the planner, which runs it in
//! virtual time (`plan::fleet`).
//!
//! A [`Batch`] holds the *waiting* queue (FIFO) and the *running* batch of one engine. Before
//! every engine step its owner calls [`Batch::admit`], which admits waiting requests while the
//! batch has fewer than `max_num_seqs` sequences and the KV cache can hold the request's
//! reservation (`prompt + output` tokens), looking each prompt up in the [`PrefixCache`] (whole
//! blocks of `block_size` tokens, chained hashes, least recently used evicted, as in vLLM); only
//! uncached tokens are prefilled. As in vLLM, a hit never covers the last prompt token and
//! stays whole blocks, so a prompt cached to its end still computes its last block. One step lasts [`Batch::step_duration`]:
//! `decode_base + decode_per_seq × running + prefill_per_token × uncached tokens admitted`
//! (at speed 1). After a step every running sequence has one more token ([`Batch::advance`]);
//! finished ones leave with [`Batch::take_done`]. An engine that prefills an admitted group in
//! a forward pass of its own (TGI, [`Timing::prefill_pass`]) pays `decode_base` once more for a
//! step that admits beside a running batch, and the group has its first token at the end of
//! that pass ([`Batch::first_token_after`], [`Batch::first_tokens`]), a second after the decode.
//!
//! The owner supplies the clock: it sleeps for the step (real time) or schedules the step's end
//! as an event (virtual time). A stretch of steps without admissions has a constant duration,
//! so a virtual-time owner may advance several steps at once ([`Batch::steps_to_next_finish`]).
//!
//! An owner that serves LoRA adapters gives each request its adapter ([`Queued::lora`], 0 for
//! the base model) and calls [`Batch::limit_loras`]: as in vLLM's scheduler, a waiting request
//! whose adapter would make the running batch use more than `max_loras` distinct adapters is
//! skipped (it keeps its place, *deferred*) and the requests behind it are still considered.
//!
//! An owner that wants vLLM's KV-cache events calls [`Batch::listen`] and gives each request its
//! prompt's token ids ([`Queued::tokens`]); [`Batch::take_cache_events`] then hands it the
//! cache's changes ([`CacheEvent`]). Without a listener nothing is recorded or allocated, so the
//! planner's hot path pays one branch per admission.
//!
//! Invariants:
//! - `running ≤ max_num_seqs`, and the KV reservation never exceeds capacity, except that a
//!   single request larger than the whole cache is admitted alone into an empty batch (so it
//!   cannot wait forever).
//! - With a LoRA limit, the running batch never uses more than `max_loras` distinct adapters
//!   (the base model, adapter 0, takes no slot).
//! - The KV reservation is the sum of the running sequences' reservations: every way out of
//!   the batch ([`Batch::take_done`], [`Batch::retain_running`]) frees it.

pub mod fit;
mod prefix;

use std::collections::VecDeque;
use std::time::Duration;

pub use prefix::{block_hashes, CacheEvent, PrefixCache};

/// The continuous-batching timing model. All durations are at `speed = 1`; the simulator divides
/// them by `speed` (and multiplies them by the `slow` fault factor).
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    /// Maximum number of sequences in the running batch (vLLM `--max-num-seqs`; Ollama's
    /// `OLLAMA_NUM_PARALLEL`).
    pub max_num_seqs: usize,
    /// KV-cache capacity in tokens. A request reserves `prompt + max output` tokens when it is
    /// scheduled; requests wait while the reservation does not fit.
    pub kv_capacity_tokens: u64,
    /// Prefill cost per uncached prompt token.
    pub prefill_per_token: Duration,
    /// Fixed cost of one decode step.
    pub decode_base: Duration,
    /// Extra cost of one decode step per running sequence.
    pub decode_per_seq: Duration,
    /// Prefix-cache block size in tokens (only whole blocks are cached, as in vLLM).
    pub block_size: u32,
    /// Tokens the prefix cache may keep (`None`: the KV capacity). Less than the KV capacity
    /// stands for an engine whose free KV blocks, where vLLM keeps cached prefixes, are few;
    /// admission still uses `kv_capacity_tokens`.
    pub prefix_cache_tokens: Option<u64>,
    /// Range of the "natural" answer length (the model stops by itself) in tokens.
    pub min_output_tokens: u32,
    /// Upper end of the natural answer length.
    pub max_output_tokens: u32,
    /// The engine prefills an admitted group in a forward pass of its own, then decodes the
    /// batch (TGI): a step that admits beside running sequences costs one more `decode_base`.
    pub prefill_pass: bool,
    /// Time to first token a request spends outside the scheduler (the HTTP exchange, the
    /// engine's frontend parsing and tokenizing it): added to its time to first token by the
    /// planner; the simulator's own is what its HTTP server takes.
    pub outside: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            max_num_seqs: 256,
            kv_capacity_tokens: 131_072,
            prefill_per_token: Duration::from_micros(100),
            decode_base: Duration::from_millis(15),
            decode_per_seq: Duration::from_micros(150),
            block_size: 16,
            prefix_cache_tokens: None,
            min_output_tokens: 16,
            max_output_tokens: 128,
            prefill_pass: false,
            outside: Duration::ZERO,
        }
    }
}

impl Timing {
    /// Blocks the prefix cache keeps.
    fn prefix_blocks(&self) -> usize {
        let tokens = self.prefix_cache_tokens.unwrap_or(self.kv_capacity_tokens);
        (tokens / u64::from(self.block_size.max(1))).max(1) as usize
    }
}

/// A request waiting for admission: its prompt as block hashes (see [`block_hashes`]), its
/// length and its planned output length, and whatever its owner tracks it by.
#[derive(Debug)]
pub struct Queued<T> {
    pub prompt_len: u32,
    pub blocks: Vec<u64>,
    /// Whole blocks after `blocks` that no other prompt shares (see
    /// [`PrefixCache::lookup_insert_run`]); 0 when `blocks` covers the whole prompt.
    pub unique_blocks: u32,
    /// The prompt's token ids when a listener wants the stored blocks' tokens (see
    /// [`Batch::listen`]); empty otherwise.
    pub tokens: Vec<u32>,
    pub out_len: u32,
    /// The LoRA adapter it runs under (vLLM's `lora_int_id`); 0 = the base model.
    pub lora: u32,
    pub tag: T,
}

/// A sequence in the running batch.
#[derive(Debug)]
pub struct Running<T> {
    pub prompt_len: u32,
    pub out_len: u32,
    /// KV tokens reserved for it (`prompt + output`).
    pub reserved: u64,
    /// Tokens generated so far.
    pub generated: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached: u32,
    /// The LoRA adapter it runs under; 0 = the base model.
    pub lora: u32,
    pub tag: T,
}

impl<T> Running<T> {
    /// It has produced all its output.
    pub fn done(&self) -> bool {
        self.generated >= self.out_len
    }
}

/// One engine's queue, batch, KV reservation and prefix cache.
#[derive(Debug)]
pub struct Batch<T> {
    timing: Timing,
    pub waiting: VecDeque<Queued<T>>,
    pub running: Vec<Running<T>>,
    kv_reserved: u64,
    prefix: PrefixCache,
    /// Distinct adapters the running batch may use (0: no limit, LoRA off).
    max_loras: usize,
    /// Waiting requests the last admission round skipped for the LoRA limit.
    deferred: usize,
    /// Sequences the last admission round admitted beside running ones (0: none, or nothing
    /// was running): a pass of their own where the timing has `prefill_pass`.
    beside: u32,
}

impl<T> Batch<T> {
    pub fn new(timing: Timing) -> Self {
        Batch {
            prefix: PrefixCache::new(timing.prefix_blocks(), timing.block_size.max(1)),
            timing,
            waiting: VecDeque::new(),
            running: Vec::new(),
            kv_reserved: 0,
            max_loras: 0,
            deferred: 0,
            beside: 0,
        }
    }

    /// Run at most `max` distinct LoRA adapters at once (vLLM's `--max-loras`; 0 = no limit).
    pub fn limit_loras(&mut self, max: usize) {
        self.max_loras = max;
    }

    /// Waiting requests the last admission round deferred because their adapter had no slot
    /// (vLLM's `num_requests_waiting_by_reason{reason="deferred"}`).
    pub fn deferred(&self) -> usize {
        self.deferred
    }

    pub fn timing(&self) -> &Timing {
        &self.timing
    }

    /// KV tokens reserved by the running batch.
    pub fn kv_reserved(&self) -> u64 {
        self.kv_reserved
    }

    /// Record the prefix cache's changes for [`Batch::take_cache_events`] from now on.
    pub fn listen(&mut self) {
        self.prefix.listen();
    }

    /// The prefix cache's changes since the last call, in order (none without a listener).
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.prefix.take_events()
    }

    /// Drop the prefix cache, as vLLM's `reset_prefix_cache` does: only when no sequence runs
    /// (their blocks are in use), unless `force` (vLLM preempts the running ones then; here they
    /// just go on). Returns whether it was dropped.
    pub fn reset_prefix_cache(&mut self, force: bool) -> bool {
        if !force && !self.running.is_empty() {
            return false;
        }
        self.prefix.clear();
        true
    }

    /// Nothing waits and nothing runs.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Admit waiting requests in order while the batch and the KV cache have room; calls
    /// `admitted` with each new sequence. A request whose adapter has no slot is skipped and
    /// keeps its place (vLLM defers it); one whose reservation does not fit stops the round.
    /// Returns the uncached prompt tokens to prefill.
    pub fn admit(&mut self, mut admitted: impl FnMut(&Running<T>)) -> u32 {
        let before = self.running.len();
        let mut prefill = 0u32;
        let cap = self.timing.kv_capacity_tokens;
        let mut loras = self.running_loras();
        let mut skipped = Vec::new();
        while self.running.len() < self.timing.max_num_seqs {
            let Some(front) = self.waiting.front() else {
                break;
            };
            if !self.lora_fits(front.lora, &loras) {
                skipped.extend(self.waiting.pop_front());
                continue;
            }
            let need = u64::from(front.prompt_len) + u64::from(front.out_len);
            if self.kv_reserved + need > cap && !self.running.is_empty() {
                break;
            }
            let Some(q) = self.waiting.pop_front() else {
                break;
            };
            if q.lora != 0 && !loras.contains(&q.lora) {
                loras.push(q.lora);
            }
            prefill = prefill.saturating_add(self.start(q, need));
            if let Some(seq) = self.running.last() {
                admitted(seq);
            }
        }
        self.deferred = skipped.len();
        self.beside = if before > 0 {
            u32::try_from(self.running.len() - before).unwrap_or(u32::MAX)
        } else {
            0
        };
        // the skipped ones go back in front, in their order, as vLLM puts them back
        for q in skipped.into_iter().rev() {
            self.waiting.push_front(q);
        }
        prefill
    }

    /// Move `q` (reserving `need` KV tokens) into the running batch; returns its uncached
    /// prompt tokens.
    fn start(&mut self, q: Queued<T>, need: u64) -> u32 {
        let hit = self.lookup(&q);
        self.kv_reserved += need;
        self.running.push(Running {
            prompt_len: q.prompt_len,
            out_len: q.out_len,
            reserved: need,
            generated: 0,
            cached: hit,
            lora: q.lora,
            tag: q.tag,
        });
        q.prompt_len - hit
    }

    /// The distinct adapters of the running batch.
    fn running_loras(&self) -> Vec<u32> {
        let mut loras = Vec::new();
        if self.max_loras == 0 {
            return loras;
        }
        for s in &self.running {
            if s.lora != 0 && !loras.contains(&s.lora) {
                loras.push(s.lora);
            }
        }
        loras
    }

    /// Whether a request under `lora` may join a batch running the adapters `loras`: the base
    /// model always may, an adapter already running may, another one needs a free slot.
    fn lora_fits(&self, lora: u32, loras: &[u32]) -> bool {
        self.max_loras == 0 || lora == 0 || loras.contains(&lora) || loras.len() < self.max_loras
    }

    /// Look `q`'s prompt up in the prefix cache and cache its blocks; returns the prompt
    /// tokens served from the cache.
    fn lookup(&mut self, q: &Queued<T>) -> u32 {
        let block = self.timing.block_size.max(1);
        // vLLM computes at least the last prompt token and its hits are whole blocks
        let most = q.prompt_len.saturating_sub(1) / block;
        let hit = self.prefix.hit_blocks(&q.blocks).min(most);
        if self.prefix.listening() {
            // a listener hears the evictions the new blocks cause first, as vLLM publishes them
            self.prefix.make_room(&q.blocks, q.unique_blocks);
        }
        // stored before the insertion evicts anything more (only a prompt larger than the
        // cache does), so a listener never sees a block removed before it was stored
        (self.prefix).note_stored(&q.blocks, hit as usize, &q.tokens, q.lora);
        self.prefix.insert_run(&q.blocks, q.unique_blocks);
        hit * block
    }

    /// The next step's duration at speed 1, with `prefill` uncached prompt tokens in it
    /// (capped at an hour).
    pub fn step_duration(&self, prefill: u32) -> Duration {
        let t = &self.timing;
        let passes = if self.separate_pass(prefill) { 2 } else { 1 };
        t.decode_base
            .saturating_mul(passes)
            .saturating_add(t.decode_per_seq.saturating_mul(self.running.len() as u32))
            .saturating_add(t.prefill_per_token.saturating_mul(prefill))
            .min(Duration::from_secs(3600))
    }

    /// Whether the step prefills its admitted sequences in a pass of their own.
    fn separate_pass(&self, prefill: u32) -> bool {
        self.timing.prefill_pass && self.beside > 0 && prefill > 0
    }

    /// How far into the step the sequences admitted for it have their first token: the step's
    /// end, or where they are prefilled in a pass of their own, that pass's end (TGI sends the
    /// first token before it decodes the batch).
    pub fn first_token_after(&self, prefill: u32) -> Duration {
        if !self.separate_pass(prefill) {
            return self.step_duration(prefill);
        }
        let t = &self.timing;
        t.decode_base
            .saturating_add(t.decode_per_seq.saturating_mul(self.beside))
            .saturating_add(t.prefill_per_token.saturating_mul(prefill))
            .min(Duration::from_secs(3600))
    }

    /// The sequences that have no token yet make their first (the end of a separate prefill
    /// pass, before the step's decode); returns the tokens generated.
    pub fn first_tokens(&mut self) -> u64 {
        let mut tokens = 0u64;
        for s in &mut self.running {
            if s.generated == 0 && s.out_len > 0 {
                s.generated = 1;
                tokens += 1;
            }
        }
        tokens
    }

    /// Steps until the first running sequence finishes (at least 1; 0 when nothing runs).
    pub fn steps_to_next_finish(&self) -> u32 {
        self.running
            .iter()
            .map(|s| s.out_len.saturating_sub(s.generated).max(1))
            .min()
            .unwrap_or(0)
    }

    /// `steps` engine steps happened: each running sequence gains that many tokens, up to its
    /// output length. Returns the tokens generated.
    pub fn advance(&mut self, steps: u32) -> u64 {
        let mut tokens = 0u64;
        for s in &mut self.running {
            let add = steps.min(s.out_len.saturating_sub(s.generated));
            s.generated += add;
            tokens += u64::from(add);
        }
        tokens
    }

    /// Remove the finished sequences, freeing their KV reservation, and hand each to `done`.
    pub fn take_done(&mut self, mut done: impl FnMut(Running<T>)) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].done() {
                let seq = self.running.swap_remove(i);
                self.kv_reserved -= seq.reserved;
                done(seq);
            } else {
                i += 1;
            }
        }
    }

    /// Keep only the running sequences `keep` accepts (freeing the others' KV reservation);
    /// returns how many left.
    pub fn retain_running(&mut self, mut keep: impl FnMut(&Running<T>) -> bool) -> usize {
        let before = self.running.len();
        let mut freed = 0;
        self.running.retain(|s| {
            let k = keep(s);
            if !k {
                freed += s.reserved;
            }
            k
        });
        self.kv_reserved -= freed;
        before - self.running.len()
    }
}

#[cfg(test)]
mod tests;
