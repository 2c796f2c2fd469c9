//! The subscription against a fake engine: a real ZMQ PUB and replay ROUTER on 127.0.0.1,
//! publishing batches the way vLLM frames them.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use super::subscribe::{follow_for_tests as follow, Source};
use super::{index::prompt_hashes, KvCache, Prompt, Status};
use crate::config::{BackendConfig, BackendKind, Timeouts};
use crate::fleet::{Backend, BackendState};
use crate::kvevents::{self, BlockStored, EngineHash, Event, EventBatch};

const BLOCK: u32 = 4;

/// Published batches by sequence number, for replay.
type Buffer = Arc<Mutex<Vec<(i64, Vec<u8>)>>>;

/// A fake vLLM publisher: every batch is buffered for replay; `send = false` drops it from
/// the PUB stream only (a gap replay can fill).
struct Engine {
    publisher: zeromq::PubSocket,
    buffer: Buffer,
    /// Replay answers nothing while set.
    mute: Arc<std::sync::atomic::AtomicBool>,
    seq: i64,
    source: Source,
    router: tokio::task::JoinHandle<()>,
}

impl Engine {
    async fn start() -> Engine {
        let mut publisher = zeromq::PubSocket::new();
        let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
        let mut router = zeromq::RouterSocket::new();
        let replay = router.bind("tcp://127.0.0.1:0").await.unwrap();
        let buffer: Buffer = Arc::default();
        let mute = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (b, m) = (buffer.clone(), mute.clone());
        let router = tokio::spawn(async move {
            while let Ok(msg) = router.recv().await {
                let frames = msg.into_vec();
                let (Some(id), Some(seq)) = (frames.first(), frames.get(2)) else {
                    continue;
                };
                let Ok(from) = kvevents::parse_seq(seq) else {
                    continue;
                };
                if m.load(std::sync::atomic::Ordering::Relaxed) {
                    continue;
                }
                let batches: Vec<(i64, Vec<u8>)> = b
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(s, _)| *s >= from)
                    .cloned()
                    .collect();
                // as vLLM 0.32 answers: ["", topic, seq, payload], then ["", "", -1, ""]
                let end = (kvevents::REPLAY_END, vec![]);
                for (s, p) in batches.into_iter().chain([end]) {
                    let topic = if p.is_empty() { "" } else { "kv" };
                    let out = vec![
                        id.clone(),
                        Bytes::new(),
                        Bytes::from_static(topic.as_bytes()),
                        Bytes::copy_from_slice(&kvevents::seq_frame(s)),
                        Bytes::from(p),
                    ];
                    let _ = router.send(ZmqMessage::try_from(out).unwrap()).await;
                }
            }
        });
        Engine {
            publisher,
            buffer,
            mute,
            seq: 0,
            source: Source {
                endpoint: endpoint.to_string(),
                replay: Some(replay.to_string()),
                topic: "kv".into(),
            },
            router,
        }
    }

    async fn publish_raw(&mut self, payload: Vec<u8>, send: bool) {
        let seq = self.seq;
        self.seq += 1;
        self.buffer.lock().unwrap().push((seq, payload.clone()));
        if send {
            let msg = ZmqMessage::try_from(vec![
                Bytes::from_static(b"kv"),
                Bytes::copy_from_slice(&kvevents::seq_frame(seq)),
                Bytes::from(payload),
            ])
            .unwrap();
            self.publisher.send(msg).await.unwrap();
        }
    }

    async fn publish(&mut self, events: Vec<Event>, send: bool) {
        let batch = EventBatch {
            ts: 1.0e9,
            events,
            data_parallel_rank: None,
        };
        self.publish_raw(kvevents::encode(&batch), send).await;
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.router.abort();
    }
}

/// A prompt's whole blocks stored as one event, engine hashes `first..`.
fn stored(ids: &[u32], parent: Option<u64>, first: u64) -> Event {
    let n = ids.len() / BLOCK as usize;
    Event::BlockStored(BlockStored {
        block_hashes: (0..n as u64).map(|i| EngineHash(first + i)).collect(),
        parent_block_hash: parent.map(EngineHash),
        token_ids: ids[..n * BLOCK as usize].to_vec(),
        block_size: BLOCK,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        extra_keys: None,
        group_idx: None,
        kv_cache_spec_kind: None,
    })
}

fn backend() -> Arc<Backend> {
    let cfg = BackendConfig {
        name: "v".into(),
        kind: BackendKind::Vllm,
        url: "http://127.0.0.1:1".parse().unwrap(),
        models: vec!["m".into()],
        model_names: Default::default(),
        api_key: None,
        weight: 1,
        max_concurrent: None,
        health_path: None,
        kv_events: Default::default(),
        max_adapters: None,
        lora_adapters: Vec::new(),
        timeouts: Timeouts::default(),
    };
    Arc::new(Backend::new(cfg, Arc::new(BackendState::new())))
}

/// A backend following `e`'s publisher, live and past the subscription's join; the
/// subscription stops when this is dropped.
struct Follower {
    backend: Arc<Backend>,
    task: tokio::task::JoinHandle<super::subscribe::SubscribeError>,
}

impl Follower {
    async fn start(e: &mut Engine) -> Follower {
        let f = Follower::connect(e).await;
        until("live", || f.kv().live()).await;
        joined(e, f.kv()).await;
        f
    }

    /// Subscribed, without waiting for anything.
    async fn connect(e: &Engine) -> Follower {
        let backend = backend();
        let task = tokio::spawn(follow(backend.clone(), e.source.clone()));
        Follower { backend, task }
    }

    fn kv(&self) -> &KvCache {
        self.backend.state.kv()
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The cached prefix of a prompt of `ids` followed by one more token (the last token of a
/// prompt is never a hit).
fn cached(kv: &KvCache, ids: &[u32]) -> Option<u64> {
    let mut prompt = ids.to_vec();
    prompt.push(1_000_000);
    kv.cached_tokens(&Prompt::new(prompt, None))
}

fn prompt(n: u32, salt: u32) -> Vec<u32> {
    (0..n).map(|i| i * 3 + salt).collect()
}

/// Publish a marker batch until the subscriber has applied it (the PUB socket drops what it
/// sends before the subscription reaches it; a dropped batch is a gap the replay fills).
async fn joined(e: &mut Engine, kv: &KvCache) {
    let before = kv.view().batches;
    for _ in 0..200 {
        e.publish(vec![], true).await;
        if kv.view().batches > before {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the subscriber never received a batch");
}

#[tokio::test]
async fn a_fresh_engine_is_followed_warm_and_gaps_are_replayed() {
    let mut e = Engine::start().await;
    let f = Follower::start(&mut e).await;
    let kv = f.kv();
    assert_eq!(kv.view().status, Status::Warm);
    let p = prompt(10, 1);
    e.publish(vec![stored(&p, None, 100)], true).await;
    until("stored", || cached(kv, &p) == Some(8)).await;
    // a batch the subscriber never receives: the next one reveals the gap, replay fills it
    let longer = prompt(16, 1);
    e.publish(vec![stored(&longer[8..], Some(101), 200)], false)
        .await;
    e.publish(vec![], true).await;
    until("gap filled", || cached(kv, &longer) == Some(16)).await;
    assert_eq!(kv.view().status, Status::Warm);
    assert_eq!(kv.view().rebuilds, 1, "only the initial build");
    // the engine evicts the tail: the prompt is cached up to it
    e.publish(
        vec![Event::BlockRemoved(kvevents::BlockRemoved {
            block_hashes: vec![EngineHash(201)],
            medium: None,
            group_idx: None,
        })],
        true,
    )
    .await;
    until("removed", || cached(kv, &longer) == Some(12)).await;
}

#[tokio::test]
async fn a_gap_replay_cannot_fill_makes_the_index_cold_then_a_clear_makes_it_warm() {
    let mut e = Engine::start().await;
    let f = Follower::start(&mut e).await;
    let kv = f.kv();
    let p = prompt(8, 2);
    e.publish(vec![stored(&p, None, 1)], true).await;
    until("stored", || cached(kv, &p) == Some(8)).await;
    e.mute.store(true, std::sync::atomic::Ordering::Relaxed);
    e.publish(vec![stored(&prompt(8, 5), None, 10)], false)
        .await;
    e.publish(vec![], true).await;
    until("cold", || kv.view().status == Status::Cold).await;
    assert_eq!(
        cached(kv, &p),
        Some(0),
        "a rebuilt index holds nothing it cannot prove"
    );
    let q = prompt(4, 9);
    e.publish(vec![stored(&q, None, 20)], true).await;
    until("cold index learns", || cached(kv, &q) == Some(4)).await;
    e.publish(vec![Event::AllBlocksCleared {}], true).await;
    until("warm after clear", || kv.view().status == Status::Warm).await;
    assert_eq!(cached(kv, &q), Some(0));
}

#[tokio::test]
async fn a_malformed_batch_rebuilds_cold_and_the_history_is_replayed_on_connect() {
    let mut e = Engine::start().await;
    // history before the subscriber exists: replay from 0 gives all of it
    let p = prompt(12, 4);
    e.publish(vec![stored(&p, None, 1)], false).await;
    let f = Follower::connect(&e).await;
    let kv = f.kv();
    until("replayed", || cached(kv, &p) == Some(12)).await;
    assert_eq!(kv.view().status, Status::Warm);
    joined(&mut e, kv).await;
    e.publish_raw(b"\x93\xff not msgpack".to_vec(), true).await;
    until("cold", || kv.view().status == Status::Cold).await;
    assert_eq!(cached(kv, &p), Some(0));
}

#[tokio::test]
async fn a_lost_publisher_answers_nothing() {
    let mut e = Engine::start().await;
    let f = Follower::start(&mut e).await;
    let kv = f.kv();
    drop(e);
    until("lost", || kv.view().status == Status::Lost).await;
    assert_eq!(cached(kv, &prompt(8, 0)), None);
}

#[test]
fn prompts_memoise_their_hashes_per_block_size() {
    let p = Prompt::new(prompt(9, 0), None);
    assert_eq!(p.hashes(4).len(), 2);
    assert!(Arc::ptr_eq(&p.hashes(4), &p.hashes(4)));
    // the block holding the last token is never a hit: 9 tokens in blocks of 3 give 2
    assert_eq!(&*p.hashes(3), &prompt_hashes(&prompt(8, 0), 3, None)[..]);
    assert_eq!(p.hashes(3).len(), 2);
}
