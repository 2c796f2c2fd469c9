//! What each vLLM engine holds in its prefix cache, from the engine's own KV-cache events.
//!
//! - [`index`]: one engine's blocks, keyed by the gateway's own chained hash of each block's
//!   tokens (so no engine hash setting is needed) and mapped from the engine's hashes (which
//!   `BlockRemoved` names).
//! - [`subscribe`]: the subscription task per backend: the publisher found from
//!   `GET /kv_event_sources` (or configured), the sequence numbers checked, gaps filled from
//!   the replay endpoint.
//!
//! [`KvCache`] is the live state routing reads. Invariants: a lookup answers only while the
//! subscription is live ([`Status::Warm`] or [`Status::Cold`]); a subscription that is lost,
//! not yet connected or off answers nothing, so routing falls back to its estimates and never
//! to a stale certainty. `Warm` means the index has seen every batch since the engine's first
//! (or since the engine cleared its cache); `Cold` means events were missed and could not be
//! replayed, so the index was rebuilt from what followed: it may under-count what is cached,
//! never over-count.

pub mod index;
pub mod subscribe;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use index::{prompt_hashes, Applied, BlockIndex};

/// Blocks one engine's index may hold: 8M tokens at vLLM's GPU block size of 16, more than any
/// one engine's KV cache. An index past it has missed removals and is rebuilt.
pub const MAX_BLOCKS: usize = 1 << 19;

/// Where a backend's subscription stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// No events: not a vLLM backend, `kv_events = false`, or the engine publishes none.
    Off,
    /// Finding or connecting to the publisher.
    Connecting,
    /// Every batch seen: the index is what the engine holds.
    Warm,
    /// Rebuilt after events were lost: a lower bound of what the engine holds.
    Cold,
    /// The connection dropped; waiting to reconnect.
    Lost,
}

impl Status {
    pub const ALL: [Status; 5] = [
        Status::Off,
        Status::Connecting,
        Status::Warm,
        Status::Cold,
        Status::Lost,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Off => "off",
            Status::Connecting => "connecting",
            Status::Warm => "warm",
            Status::Cold => "cold",
            Status::Lost => "lost",
        }
    }

    fn live(self) -> bool {
        matches!(self, Status::Warm | Status::Cold)
    }
}

/// A prompt's token ids, with its chained block hashes computed once per block size.
#[derive(Debug)]
pub struct Prompt {
    ids: Vec<u32>,
    lora: Option<String>,
    hashes: Mutex<Vec<(u32, Arc<[u64]>)>>,
}

impl Prompt {
    pub fn new(ids: Vec<u32>, lora: Option<String>) -> Self {
        Prompt {
            ids,
            lora,
            hashes: Mutex::new(Vec::new()),
        }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    fn hashes(&self, block: u32) -> Arc<[u64]> {
        let mut memo = self.hashes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, h)) = memo.iter().find(|(b, _)| *b == block) {
            return h.clone();
        }
        // An engine recomputes the last prompt token, and a hit is whole blocks: only blocks
        // that end before the last token can be hits (vLLM caps the hit at prompt - 1).
        let usable = &self.ids[..self.ids.len().saturating_sub(1)];
        let h: Arc<[u64]> = prompt_hashes(usable, block, self.lora.as_deref()).into();
        memo.push((block, h.clone()));
        h
    }
}

/// A snapshot of one backend's KV view, for `/admin/backends`, the dashboard and `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct KvView {
    pub status: Status,
    pub blocks: usize,
    pub block_size: Option<u32>,
    /// Seconds between the engine stamping the last batch and the gateway applying it.
    pub lag_seconds: Option<f64>,
    pub batches: u64,
    /// Times the index was rebuilt (gap not replayable, restart, overflow, malformed batch).
    pub rebuilds: u64,
    /// Answers whose engine reported its cached tokens, and those where routing had expected
    /// exactly that many.
    pub predictions: u64,
    pub predictions_exact: u64,
    /// Cached prompt tokens routing expected, and the engine reported, over those answers.
    pub predicted_tokens: u64,
    pub reported_tokens: u64,
}

/// One backend's live KV view: the index and its subscription's status.
#[derive(Debug)]
pub struct KvCache {
    inner: RwLock<Inner>,
    predictions: [AtomicU64; 4],
}

#[derive(Debug)]
struct Inner {
    index: BlockIndex,
    status: Status,
    lag_seconds: Option<f64>,
    batches: u64,
    rebuilds: u64,
}

impl Default for KvCache {
    fn default() -> Self {
        KvCache::new(MAX_BLOCKS)
    }
}

impl KvCache {
    pub fn new(cap: usize) -> Self {
        KvCache {
            inner: RwLock::new(Inner {
                index: BlockIndex::new(cap),
                status: Status::Off,
                lag_seconds: None,
                batches: 0,
                rebuilds: 0,
            }),
            predictions: Default::default(),
        }
    }

    /// One answer's cached prompt tokens: `predicted` by routing, `reported` by the engine.
    pub fn record_prediction(&self, predicted: u64, reported: u64) {
        let [n, exact, p, r] = &self.predictions;
        n.fetch_add(1, Ordering::Relaxed);
        exact.fetch_add(u64::from(predicted == reported), Ordering::Relaxed);
        p.fetch_add(predicted, Ordering::Relaxed);
        r.fetch_add(reported, Ordering::Relaxed);
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Inner> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Inner> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Leading tokens of `prompt` this engine holds; `None` while the subscription is not live.
    pub fn cached_tokens(&self, prompt: &Prompt) -> Option<u64> {
        let g = self.read();
        if !g.status.live() {
            return None;
        }
        let Some(block) = g.index.block_size() else {
            // no block seen yet: an engine that stored nothing holds nothing
            return g.index.is_empty().then_some(0);
        };
        let hashes = prompt.hashes(block);
        Some(g.index.cached_blocks(&hashes) as u64 * u64::from(block))
    }

    /// Whether lookups answer now.
    pub fn live(&self) -> bool {
        self.read().status.live()
    }

    pub fn view(&self) -> KvView {
        let g = self.read();
        KvView {
            status: g.status,
            blocks: g.index.len(),
            block_size: g.index.block_size(),
            lag_seconds: g.lag_seconds,
            batches: g.batches,
            rebuilds: g.rebuilds,
            predictions: self.predictions[0].load(Ordering::Relaxed),
            predictions_exact: self.predictions[1].load(Ordering::Relaxed),
            predicted_tokens: self.predictions[2].load(Ordering::Relaxed),
            reported_tokens: self.predictions[3].load(Ordering::Relaxed),
        }
    }

    pub fn set_status(&self, status: Status) {
        self.write().status = status;
    }

    /// Empty the index and mark it `status` (`Warm` when what follows is complete).
    pub fn rebuild(&self, status: Status) {
        let mut g = self.write();
        g.index.clear();
        g.status = status;
        g.rebuilds += 1;
    }

    /// Apply one batch stamped `ts` (engine seconds since the epoch).
    pub fn apply(&self, batch: &crate::kvevents::EventBatch) -> Applied {
        let mut g = self.write();
        let mut total = Applied::default();
        for e in &batch.events {
            let a = g.index.apply(e);
            total.stored += a.stored;
            total.removed += a.removed;
            total.orphaned += a.orphaned;
            total.cleared |= a.cleared;
            if a.overflowed {
                total.overflowed = true;
                g.status = Status::Cold;
                g.rebuilds += 1;
            }
        }
        if total.cleared && g.status == Status::Cold && !total.overflowed {
            // the engine holds nothing but what follows: complete again
            g.status = Status::Warm;
        }
        g.batches += 1;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        g.lag_seconds = (batch.ts.is_finite() && batch.ts > 0.0).then(|| (now - batch.ts).max(0.0));
        total
    }
}
