//! vLLM's KV-cache events on the wire: the batches an engine publishes when it stores or
//! evicts prompt blocks, their msgpack payload, the ZMQ frames around it and the replay
//! protocol (facts: `tests/fixtures/vllm-0.32.0/kv-events/README.md`).
//!
//! Shared by the gateway (which subscribes) and the simulator (which publishes as vLLM does),
//! so both read and write one vocabulary; the decoder is checked against a real engine's
//! bytes, so the simulator cannot teach the gateway a format of its own.
//!
//! - A PUB message is three frames: the topic, the batch's sequence number (8 bytes, big
//!   endian, from 0, +1 per batch) and the payload.
//! - The payload is an [`EventBatch`]: a msgpack *array* `[ts, events, data_parallel_rank?]`
//!   whose events are *maps* tagged by `"type"`. Unknown keys are ignored, unknown event types
//!   are kept as [`Event::Other`] so a newer engine does not break an older gateway.
//! - Replay: a DEALER sends `["", seq]`; the engine answers one `["", topic, seq, payload]` per
//!   buffered batch from `seq` on, then `["", "", -1, ""]`.
//!
//! Invariants: decoding never panics and never allocates more than the input justifies (serde
//! caps preallocation by the bytes present; rmp-serde bounds nesting depth).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

#[cfg(test)]
mod tests;

/// The sequence number that ends a replay answer.
pub const REPLAY_END: i64 = -1;

/// One published batch of events (an array on the wire, see [`EventBatch::serialize`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct EventBatch {
    /// Engine wall-clock time of the batch, seconds since the epoch.
    pub ts: f64,
    pub events: Vec<Event>,
    /// The data-parallel rank that published it (absent on engines without data parallelism).
    #[serde(default)]
    pub data_parallel_rank: Option<i64>,
}

/// An engine's own hash of a block: an integer or bytes depending on its hash setting. Bytes
/// are folded to 64 bits here (FNV-1a); a subscriber only compares them with each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EngineHash(pub u64);

/// One event of a batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum Event {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared {},
    /// An event type this version does not know; ignored by subscribers.
    #[serde(other, skip_serializing)]
    Other,
}

/// Full blocks the engine now holds: `token_ids` are the tokens of all of `block_hashes`, in
/// order, `block_size` each; the first block's parent is `parent_block_hash` (none: the
/// prompt's first block).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockStored {
    pub block_hashes: Vec<EngineHash>,
    pub parent_block_hash: Option<EngineHash>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    #[serde(default)]
    pub lora_id: Option<i64>,
    #[serde(default)]
    pub medium: Option<String>,
    /// The LoRA adapter the blocks were computed under (their keys differ from the base
    /// model's).
    #[serde(default)]
    pub lora_name: Option<String>,
    /// What else went into each block's hash besides its tokens (LoRA name, multimodal inputs,
    /// cache salt), one entry per block, `None` for a block keyed by its tokens alone.
    #[serde(default)]
    pub extra_keys: Option<Vec<Option<ExtraKey>>>,
    /// The KV-cache group of the blocks (0 for a model with one kind of attention).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_idx: Option<i64>,
    /// The group's kind of cache, e.g. `full_attention`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_spec_kind: Option<String>,
}

/// One block's extra hash inputs. Read from the wire, any value is folded to 64 bits (FNV-1a
/// over its msgpack value) as [`EngineHash`] folds bytes: a subscriber only compares them, and
/// a fold is written back as an integer, not the engine's original value. A publisher names
/// the values it means: [`ExtraKey::Names`] is written as vLLM writes a LoRA block's key, an
/// array of strings (`["adapter"]`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    /// A value read from the wire, folded.
    Fold(u64),
    /// Strings to publish (a LoRA adapter's name), written as an array.
    Names(Vec<String>),
}

/// Blocks the engine evicted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockRemoved {
    pub block_hashes: Vec<EngineHash>,
    #[serde(default)]
    pub medium: Option<String>,
    /// The KV-cache group the blocks belonged to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_idx: Option<i64>,
}

/// Why a payload or frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("msgpack: {0}")]
    Msgpack(#[from] rmp_serde::decode::Error),
    #[error("a sequence number must be 8 bytes, got {0}")]
    SeqLength(usize),
}

/// The batch in `payload`.
pub fn decode(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    Ok(rmp_serde::from_slice(payload)?)
}

/// `batch` as vLLM writes it (events as maps, the batch as an array).
pub fn encode(batch: &EventBatch) -> Vec<u8> {
    // Serializing plain structs, strings and numbers into a Vec cannot fail.
    rmp_serde::to_vec_named(batch).unwrap_or_default()
}

/// A sequence number frame.
pub fn seq_frame(seq: i64) -> [u8; 8] {
    seq.to_be_bytes()
}

/// The sequence number in `frame`.
pub fn parse_seq(frame: &[u8]) -> Result<i64, DecodeError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::SeqLength(frame.len()))?;
    Ok(i64::from_be_bytes(bytes))
}

/// The endpoint a subscriber dials for an engine's `endpoint` setting: a wildcard host (`*`,
/// `0.0.0.0`, `::`) means "this engine's host", so it becomes `host`.
pub fn dial_endpoint(endpoint: &str, host: &str) -> String {
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return endpoint.to_string();
    };
    let (h, port) = match rest.rsplit_once(':') {
        Some((h, p)) => (h, p),
        None => return endpoint.to_string(),
    };
    let wildcard = matches!(h, "*" | "0.0.0.0" | "[::]" | "::" | "[*]");
    let host = if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    if wildcard {
        format!("tcp://{host}:{port}")
    } else {
        endpoint.to_string()
    }
}

impl Serialize for EventBatch {
    /// As an array, `[ts, events]` or `[ts, events, rank]`, as vLLM's encoder writes it
    /// (serde's struct encoding in `to_vec_named` would make it a map).
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        let n = 2 + usize::from(self.data_parallel_rank.is_some());
        let mut t = s.serialize_tuple(n)?;
        t.serialize_element(&self.ts)?;
        t.serialize_element(&self.events)?;
        if let Some(rank) = self.data_parallel_rank {
            t.serialize_element(&rank)?;
        }
        t.end()
    }
}

impl Serialize for EngineHash {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for EngineHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(HashVisitor)
    }
}

struct HashVisitor;

impl<'de> serde::de::Visitor<'de> for HashVisitor {
    type Value = EngineHash;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a block hash (integer or bytes)")
    }
    fn visit_u64<E>(self, v: u64) -> Result<EngineHash, E> {
        Ok(EngineHash(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<EngineHash, E> {
        Ok(EngineHash(v as u64))
    }
    fn visit_bytes<E>(self, v: &[u8]) -> Result<EngineHash, E> {
        Ok(EngineHash(fnv1a(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<EngineHash, E> {
        Ok(EngineHash(fnv1a(v.as_bytes())))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<EngineHash, A::Error> {
        // bytes sent as an array of small integers
        let mut h = Fnv::new();
        while let Some(b) = seq.next_element::<u8>()? {
            h.byte(b);
        }
        Ok(EngineHash(h.0))
    }
}

impl Serialize for ExtraKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ExtraKey::Fold(v) => s.serialize_u64(*v),
            ExtraKey::Names(names) => names.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for ExtraKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut h = Fnv::new();
        d.deserialize_any(FoldVisitor(&mut h))?;
        Ok(ExtraKey::Fold(h.0))
    }
}

/// Folds any msgpack value into a running FNV-1a hash, each scalar after a tag byte for its
/// kind so `1` and `"1"` fold apart. Nesting is bounded by rmp-serde's depth limit.
struct FoldVisitor<'a>(&'a mut Fnv);

impl FoldVisitor<'_> {
    fn fold(self, tag: u8, bytes: &[u8]) {
        self.0.byte(tag);
        for b in bytes {
            self.0.byte(*b);
        }
    }
}

impl<'de> serde::de::DeserializeSeed<'de> for FoldVisitor<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for FoldVisitor<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any msgpack value")
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        self.fold(0, &[]);
        Ok(())
    }
    fn visit_none<E>(self) -> Result<(), E> {
        self.fold(0, &[]);
        Ok(())
    }
    fn visit_bool<E>(self, v: bool) -> Result<(), E> {
        self.fold(1, &[u8::from(v)]);
        Ok(())
    }
    fn visit_i64<E>(self, v: i64) -> Result<(), E> {
        self.fold(2, &v.to_be_bytes());
        Ok(())
    }
    fn visit_u64<E>(self, v: u64) -> Result<(), E> {
        // the same number folds the same whether it came signed or not
        self.fold(2, &v.to_be_bytes());
        Ok(())
    }
    fn visit_f64<E>(self, v: f64) -> Result<(), E> {
        self.fold(3, &v.to_be_bytes());
        Ok(())
    }
    fn visit_str<E>(self, v: &str) -> Result<(), E> {
        self.fold(4, v.as_bytes());
        Ok(())
    }
    fn visit_bytes<E>(self, v: &[u8]) -> Result<(), E> {
        self.fold(5, v);
        Ok(())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.0.byte(6);
        while seq.next_element_seed(FoldVisitor(&mut *self.0))?.is_some() {}
        self.0.byte(7);
        Ok(())
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.0.byte(8);
        while map.next_key_seed(FoldVisitor(&mut *self.0))?.is_some() {
            map.next_value_seed(FoldVisitor(&mut *self.0))?;
        }
        self.0.byte(9);
        Ok(())
    }
}

struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn byte(&mut self, b: u8) {
        self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h = Fnv::new();
    for b in bytes {
        h.byte(*b);
    }
    h.0
}
