//! The vLLM simulator's KV-cache event publisher, as vLLM's `ZmqEventPublisher`: the engine
//! hands it one [`EventBatch`] per step that changed the prefix cache; it numbers the batches
//! (from 0, +1 per batch), sends each on a ZMQ PUB socket as `[topic, seq, payload]`, keeps
//! the last `buffer_steps` for replay and answers replay requests on a ROUTER socket.
//!
//! Invariants:
//! - Every batch gets the next sequence number and goes into the replay buffer, whether it is
//!   sent or not (the `kv_skip` fault withholds chosen ones), so a subscriber sees a gap
//!   exactly where a batch was withheld and can fill it from replay.
//! - The sockets that bind are bound before [`KvPublisher::start`] returns, so
//!   `/kv_event_sources` reports the real ports at once. A PUB socket that connects does so in
//!   the publishing task; batches published meanwhile are numbered and buffered, not sent
//!   (a PUB socket drops what no subscriber has asked for).
//! - A slow subscriber never stalls the engine: the PUB socket drops for it (the zeromq crate
//!   queues 100 000 messages per subscriber, vLLM's default `hwm`; `hwm` itself is reported,
//!   not applied), and a replay answer not taken within [`REPLAY_SEND_TIMEOUT`] is abandoned.
//! - Replay frames are vLLM 0.32's: a request `["", seq]` (after the peer's identity) gets one
//!   `["", topic, seq, payload]` per buffered batch numbered `seq` or more, then
//!   `["", "", -1, ""]`; `seq` is read as vLLM reads it, a big-endian unsigned number of any
//!   length. Any other framing is ignored, as vLLM logs and ignores it; under `kv_lost`
//!   nothing is answered.
//! - Dropping the publisher stops its tasks, which closes its sockets.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use super::fault::FaultState;
use super::kv_config::{place, KvEventsConfig, Place};
use super::SimError;
use crate::batching::CacheEvent;
use crate::kvevents::{
    encode, seq_frame, BlockRemoved, BlockStored, EngineHash, Event, EventBatch, ExtraKey,
    REPLAY_END,
};

/// How long one replay answer message may wait for a slow requester.
pub(crate) const REPLAY_SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the engine sends its batches.
pub(crate) type BatchSender = mpsc::Sender<EventBatch>;

/// A running publisher; dropping it stops it.
pub(crate) struct KvPublisher {
    tx: BatchSender,
    sources: String,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for KvPublisher {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A PUB socket's peer: a bound listener, or an endpoint to connect to.
enum Target {
    Listen(std::net::TcpListener),
    Connect(String),
}

impl KvPublisher {
    /// Bind (or prepare to connect) the sockets of `cfg` for a simulator on `host` and start
    /// publishing; must run inside a tokio runtime.
    pub(crate) fn start(
        cfg: &KvEventsConfig,
        host: IpAddr,
        fault: Arc<FaultState>,
    ) -> Result<KvPublisher, SimError> {
        let (target, endpoint) = match place(cfg.endpoint(), true, host)? {
            Place::Connect(e) => (Target::Connect(e.clone()), e),
            p @ Place::Bind { addr, .. } => {
                let l = std::net::TcpListener::bind(addr)?;
                let port = l.local_addr()?.port();
                (Target::Listen(l), p.reported(port))
            }
        };
        let replay = match cfg.replay_endpoint() {
            None => None,
            Some(r) => match place(r, false, host)? {
                Place::Connect(_) => None,
                p @ Place::Bind { addr, .. } => {
                    let l = std::net::TcpListener::bind(addr)?;
                    let port = l.local_addr()?.port();
                    Some((l, p.reported(port)))
                }
            },
        };
        let topic = Bytes::from(cfg.topic().as_bytes().to_vec());
        let buffer = Arc::new(Mutex::new(Buffer::new(cfg.buffer_steps())));
        let (tx, rx) = mpsc::channel(cfg.max_queue_size());
        let sources = cfg.sources_json(&endpoint, replay.as_ref().map(|r| r.1.as_str()));
        let pub_task = Publishing {
            topic: topic.clone(),
            buffer: buffer.clone(),
            fault: fault.clone(),
            seq: 0,
        };
        let mut tasks = vec![tokio::spawn(pub_task.run(rx, target))];
        if let Some((listener, _)) = replay {
            tasks.push(tokio::spawn(serve_replay(listener, topic, buffer, fault)));
        }
        tracing::info!(%endpoint, "publishing KV-cache events");
        Ok(KvPublisher { tx, sources, tasks })
    }

    /// Where the engine sends its batches.
    pub(crate) fn sender(&self) -> BatchSender {
        self.tx.clone()
    }

    /// The `/kv_event_sources` body, with the endpoints as bound.
    pub(crate) fn sources_json(&self) -> &str {
        &self.sources
    }
}

/// The prefix cache's changes of one engine step as vLLM publishes them: block size
/// `block_size`, GPU medium (vLLM's CPU build says GPU too), group 0 of full attention,
/// data-parallel rank 0. Blocks computed under a LoRA adapter carry its id (`lora_id`), its
/// name (`lora_name`, from `name_of`) and, per block, the name as their extra key (`["name"]`,
/// as vLLM publishes the LoRA part of a block's hash); the base model's blocks carry none.
pub(crate) fn wire_batch<'a>(
    events: Vec<CacheEvent>,
    block_size: u32,
    ts: f64,
    name_of: impl Fn(u32) -> Option<&'a str>,
) -> EventBatch {
    let gpu = || Some("GPU".to_string());
    let events = events
        .into_iter()
        .map(|e| match e {
            CacheEvent::Stored {
                parent,
                hashes,
                tokens,
                lora,
            } => {
                let name = (lora != 0).then(|| name_of(lora)).flatten();
                let key = name.map(|n| ExtraKey::Names(vec![n.to_string()]));
                Event::BlockStored(BlockStored {
                    extra_keys: Some(vec![key; hashes.len()]),
                    block_hashes: hashes.into_iter().map(EngineHash).collect(),
                    parent_block_hash: parent.map(EngineHash),
                    token_ids: tokens,
                    block_size,
                    lora_id: name.map(|_| i64::from(lora)),
                    medium: gpu(),
                    lora_name: name.map(str::to_string),
                    group_idx: Some(0),
                    kv_cache_spec_kind: Some("full_attention".into()),
                })
            }
            CacheEvent::Removed(h) => Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash(h)],
                medium: gpu(),
                group_idx: Some(0),
            }),
            CacheEvent::Cleared => Event::AllBlocksCleared {},
        })
        .collect();
    EventBatch {
        ts,
        events,
        data_parallel_rank: Some(0),
    }
}

/// The last batches, for replay.
struct Buffer {
    batches: VecDeque<(i64, Bytes)>,
    cap: usize,
}

impl Buffer {
    fn new(cap: usize) -> Buffer {
        Buffer {
            batches: VecDeque::new(),
            cap,
        }
    }

    fn push(&mut self, seq: i64, payload: Bytes) {
        if self.cap == 0 {
            return;
        }
        if self.batches.len() >= self.cap {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }

    /// The buffered batches numbered `start` or more (cheap copies of the payloads).
    fn since(&self, start: u128) -> Vec<(i64, Bytes)> {
        self.batches
            .iter()
            .filter(|(s, _)| *s as u128 >= start)
            .cloned()
            .collect()
    }
}

/// The publishing task's state.
struct Publishing {
    topic: Bytes,
    buffer: Arc<Mutex<Buffer>>,
    fault: Arc<FaultState>,
    seq: i64,
}

impl Publishing {
    async fn run(mut self, mut rx: mpsc::Receiver<EventBatch>, target: Target) {
        let mut opts = SocketOptions::default();
        // a subscriber that binds may come up after the engine: keep trying, as ZMQ does
        opts.no_connect_timeout();
        let mut socket = PubSocket::with_options(opts);
        let ready = match target {
            Target::Listen(l) => socket.bind_listener(l).await.map(|_| ()),
            Target::Connect(e) => {
                let connect = socket.connect(&e);
                tokio::pin!(connect);
                loop {
                    tokio::select! {
                        r = &mut connect => break r,
                        b = rx.recv() => match b {
                            Some(b) => { self.number(&b); }
                            None => return,
                        },
                    }
                }
            }
        };
        if let Err(e) = &ready {
            tracing::warn!(error = %e, "KV-event socket unusable; batches are only kept for replay");
        }
        while let Some(b) = rx.recv().await {
            let (seq, payload) = self.number(&b);
            if ready.is_err() || self.fault.kv_skips(seq) {
                continue;
            }
            let mut m = ZmqMessage::from(self.topic.clone());
            m.push_back(Bytes::copy_from_slice(&seq_frame(seq)));
            m.push_back(payload);
            if let Err(e) = socket.send(m).await {
                tracing::debug!(error = %e, seq, "KV-event batch not sent");
            }
        }
    }

    /// Give `b` the next sequence number and keep it for replay.
    fn number(&mut self, b: &EventBatch) -> (i64, Bytes) {
        let seq = self.seq;
        self.seq += 1;
        let payload = Bytes::from(encode(b));
        let mut buffer = self.buffer.lock().unwrap_or_else(|e| e.into_inner());
        buffer.push(seq, payload.clone());
        (seq, payload)
    }
}

/// Answer replay requests on `listener` until the task is stopped.
async fn serve_replay(
    listener: std::net::TcpListener,
    topic: Bytes,
    buffer: Arc<Mutex<Buffer>>,
    fault: Arc<FaultState>,
) {
    let mut router = RouterSocket::new();
    if let Err(e) = router.bind_listener(listener).await {
        tracing::warn!(error = %e, "KV-event replay socket unusable");
        return;
    }
    loop {
        let frames = match router.recv().await {
            Ok(m) => m.into_vec(),
            Err(e) => {
                tracing::debug!(error = %e, "KV-event replay socket closed");
                return;
            }
        };
        let [id, _, start] = frames.as_slice() else {
            tracing::debug!(frames = frames.len(), "invalid replay request");
            continue;
        };
        if fault.kv_replay_silent() {
            continue;
        }
        let batches = {
            let b = buffer.lock().unwrap_or_else(|e| e.into_inner());
            b.since(start_seq(start))
        };
        if let Err(e) = answer(&mut router, id, &topic, batches).await {
            tracing::debug!(error = %e, "replay answer abandoned");
        }
    }
}

/// Send `batches` to the peer `id`, then the end marker.
async fn answer(
    router: &mut RouterSocket,
    id: &Bytes,
    topic: &Bytes,
    batches: Vec<(i64, Bytes)>,
) -> Result<(), String> {
    let end = (REPLAY_END, Bytes::new());
    for (i, (seq, payload)) in batches.into_iter().chain([end]).enumerate() {
        let mut m = ZmqMessage::from(id.clone());
        m.push_back(Bytes::new());
        m.push_back(if seq == REPLAY_END {
            Bytes::new()
        } else {
            topic.clone()
        });
        m.push_back(Bytes::copy_from_slice(&seq_frame(seq)));
        m.push_back(payload);
        match tokio::time::timeout(REPLAY_SEND_TIMEOUT, router.send(m)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(format!("message {i}: {e}")),
            Err(_) => return Err(format!("message {i}: timed out")),
        }
    }
    Ok(())
}

/// The first sequence number a replay request asks for, read as vLLM reads it (big-endian,
/// unsigned, any length); a number beyond every sequence number asks for nothing.
fn start_seq(frame: &[u8]) -> u128 {
    let significant = frame.iter().skip_while(|b| **b == 0).count();
    if significant > 16 {
        return u128::MAX;
    }
    frame
        .iter()
        .skip(frame.len() - significant)
        .fold(0u128, |n, b| (n << 8) | u128::from(*b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_requests_read_the_start_as_vllm_does() {
        assert_eq!(start_seq(&seq_frame(5)), 5);
        assert_eq!(start_seq(&[0, 0, 0, 3]), 3, "any length");
        assert_eq!(start_seq(&[]), 0);
        assert_eq!(start_seq(&[1; 40]), u128::MAX);
        // -1 as 8 bytes is a huge unsigned number: nothing is that recent
        assert_eq!(start_seq(&seq_frame(-1)), u128::from(u64::MAX));
    }

    #[test]
    fn the_buffer_keeps_the_last_batches() {
        let mut b = Buffer::new(2);
        for s in 0..5 {
            b.push(s, Bytes::new());
        }
        let seqs: Vec<i64> = b.since(0).iter().map(|x| x.0).collect();
        assert_eq!(seqs, [3, 4]);
        assert_eq!(b.since(4).len(), 1);
        let mut none = Buffer::new(0);
        none.push(0, Bytes::new());
        assert!(none.since(0).is_empty());
    }

    #[test]
    fn cache_events_become_vllms_events() {
        let b = wire_batch(
            vec![
                CacheEvent::Removed(9),
                CacheEvent::Stored {
                    parent: Some(1),
                    hashes: vec![2, 3],
                    tokens: vec![7; 8],
                    lora: 0,
                },
                CacheEvent::Cleared,
            ],
            4,
            1.5,
            |_| None,
        );
        assert_eq!(b.data_parallel_rank, Some(0));
        let Event::BlockStored(s) = &b.events[1] else {
            panic!("{b:?}");
        };
        assert_eq!(s.block_hashes, [EngineHash(2), EngineHash(3)]);
        assert_eq!(s.parent_block_hash, Some(EngineHash(1)));
        assert_eq!(s.extra_keys, Some(vec![None, None]));
        assert_eq!(s.medium.as_deref(), Some("GPU"));
        assert!(matches!(b.events[2], Event::AllBlocksCleared {}));
    }

    #[test]
    fn an_adapters_blocks_carry_its_name_id_and_extra_key_as_vllm_writes_them() {
        let stored = CacheEvent::Stored {
            parent: None,
            hashes: vec![2, 3],
            tokens: vec![7; 8],
            lora: 4,
        };
        let b = wire_batch(vec![stored], 4, 1.5, |id| (id == 4).then_some("a0"));
        // on the wire: "extra_keys": [["a0"], ["a0"]], as a real vLLM 0.32 sends them
        let v: rmpv::Value = rmpv::decode::read_value(&mut &encode(&b)[..]).unwrap();
        let event = &v[1][0];
        let field = |k: &str| {
            event
                .as_map()
                .and_then(|m| m.iter().find(|(key, _)| key.as_str() == Some(k)))
                .map(|(_, v)| v.clone())
        };
        let a0 = rmpv::Value::Array(vec!["a0".into()]);
        assert_eq!(
            field("extra_keys"),
            Some(rmpv::Value::Array(vec![a0.clone(), a0]))
        );
        assert_eq!(field("lora_name"), Some("a0".into()));
        assert_eq!(field("lora_id"), Some(4.into()));
        // and it reads back like a real engine's key
        let Event::BlockStored(s) = &crate::kvevents::decode(&encode(&b)).unwrap().events[0] else {
            panic!("{b:?}");
        };
        assert_eq!(s.lora_name.as_deref(), Some("a0"));
        assert!(matches!(
            s.extra_keys.as_deref(),
            Some([Some(ExtraKey::Fold(_)), Some(_)])
        ));
    }
}
