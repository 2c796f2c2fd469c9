//! The vLLM simulator publishes KV-cache events as vLLM 0.32 does (`--kv-events-config`):
//! read here by a real ZMQ SUB socket and a replay DEALER, as a gateway would read them.

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{json, Value};
use sluice::batching::block_hashes;
use sluice::kvevents::{self, EngineHash, Event, EventBatch};
use sluice::sim::{spawn, Fault, FaultMode, KvEventsConfig, SimConfig, SimHandle, SimKind, Timing};
use zeromq::{Socket, SocketRecv, SubSocket};

use crate::support::kv::*;
use crate::support::sim::{keys, set_fault};
use crate::support::{client, poll};

const MODEL: &str = "m";
const BLOCK: u32 = 16;

/// Fast steps, 16-token blocks and short answers.
fn fast() -> Timing {
    Timing {
        max_num_seqs: 8,
        decode_base: Duration::from_millis(1),
        decode_per_seq: Duration::from_micros(10),
        prefill_per_token: Duration::from_micros(1),
        block_size: BLOCK,
        min_output_tokens: 2,
        max_output_tokens: 4,
        ..Timing::default()
    }
}

/// The flag's JSON with both sockets on free ports, topic `kv`, plus `extra` keys.
fn kv_config(extra: &str) -> KvEventsConfig {
    KvEventsConfig::from_json(&format!(
        r#"{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0","topic":"kv"{extra}}}"#
    ))
    .unwrap()
}

fn vllm() -> SimConfig {
    SimConfig::new(SimKind::Vllm, vec![MODEL.into()])
        .timing(fast())
        .prompt_tokens_details(true)
}

async fn kv_sim(f: impl FnOnce(SimConfig) -> SimConfig) -> SimHandle {
    spawn(f(vllm().kv_events_config(kv_config(""))))
        .await
        .unwrap()
}

/// A question of a few blocks, distinct per `tag`.
fn question(tag: &str) -> String {
    format!(
        "Question {tag}: tell me about the sea, the sky and the sun in a few lines, and then \
         about the old oak by the bay, please."
    )
}

fn messages(system: &str, user: &str) -> Value {
    json!([{"role": "system", "content": system}, {"role": "user", "content": user}])
}

/// A chat's usage.
/// `n` short chats with distinct questions tagged `tag`.
async fn chats(c: &reqwest::Client, url: &str, tag: &str, n: usize) {
    for i in 0..n {
        let q = question(&format!("{tag} {i}"));
        chat(c, url, &messages("Be brief.", &q)).await;
    }
}

async fn chat(c: &reqwest::Client, url: &str, msgs: &Value) -> Value {
    let body = json!({"model": MODEL, "messages": msgs, "max_tokens": 3});
    let r = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json::<Value>().await.unwrap()["usage"].clone()
}

/// The prompt token ids of a chat, as the simulator's `/tokenize` renders it.
async fn prompt_ids(c: &reqwest::Client, url: &str, msgs: &Value) -> Vec<u32> {
    let v: Value = c
        .post(format!("{url}/tokenize"))
        .json(&json!({"model": MODEL, "messages": msgs}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let tokens = v["tokens"].as_array().unwrap();
    tokens.iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// A SUB socket misses what is published before its subscription reaches the publisher (ZMQ's
/// "slow joiner"): publish (a distinct chat each time) until the subscriber hears a batch, and
/// return that batch's sequence number.
async fn sync(c: &reqwest::Client, url: &str, sub: &mut SubSocket) -> i64 {
    for i in 0..100 {
        chat(c, url, &messages("sync", &question(&format!("sync {i}")))).await;
        if let Some(p) = next_within(sub, Duration::from_millis(300)).await {
            return p.seq;
        }
    }
    panic!("the subscriber never heard a batch");
}

/// The stored blocks of a batch: (parent, hashes, tokens) of each `BlockStored`.
fn stored(b: &EventBatch) -> Vec<(Option<u64>, Vec<u64>, Vec<u32>)> {
    b.events
        .iter()
        .filter_map(|e| match e {
            Event::BlockStored(s) => Some((
                s.parent_block_hash.map(|h| h.0),
                s.block_hashes.iter().map(|h| h.0).collect(),
                s.token_ids.clone(),
            )),
            _ => None,
        })
        .collect()
}

/// Every batch the replay buffer holds, decoded, in order.
async fn all_batches(replay_ep: &str) -> Vec<(i64, EventBatch)> {
    let mut d = replayer(replay_ep).await;
    replay(&mut d, 0)
        .await
        .into_iter()
        .map(|(s, _, p)| (s, kvevents::decode(&p).unwrap()))
        .collect()
}

/// Replay until the buffer's last batch is `last` (the engine hands a batch over when its step
/// ends, around when the request's answer goes out).
async fn batches_through(replay_ep: &str, last: i64) -> Vec<(i64, EventBatch)> {
    poll(
        Duration::from_secs(10),
        format!("batch {last} buffered"),
        || async {
            let b = all_batches(replay_ep).await;
            (b.last().map(|x| x.0) == Some(last)).then_some(b)
        },
    )
    .await
}

/// The keys of each event map of a payload, in wire order, and the batch array's length.
fn wire_keys(payload: &[u8]) -> (usize, Vec<Vec<String>>) {
    let v = rmpv::decode::read_value(&mut &payload[..]).unwrap();
    let arr = v.as_array().unwrap();
    let events = arr[1].as_array().unwrap();
    let keys = events
        .iter()
        .map(|e| {
            let m = e.as_map().unwrap();
            m.iter()
                .map(|(k, _)| k.as_str().unwrap().to_string())
                .collect()
        })
        .collect();
    (arr.len(), keys)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_arrive_numbered_in_vllms_frames_with_vllms_keys() {
    let sim = kv_sim(|c| c).await;
    let c = client();
    let url = sim.url();
    // the real ports, bound before the first request, in vLLM's key order
    let raw = c
        .get(format!("{url}/kv_event_sources"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        keys(&raw),
        [
            "0",
            "enable_kv_cache_events",
            "publisher",
            "endpoint",
            "replay_endpoint",
            "buffer_steps",
            "hwm",
            "max_queue_size",
            "topic"
        ]
    );
    let (ep, replay_ep, src) = sources(&c, &url).await;
    let replay_ep = replay_ep.unwrap();
    for e in [&ep, &replay_ep] {
        assert!(
            e.starts_with("tcp://127.0.0.1:") && !e.ends_with(":0"),
            "{e}"
        );
    }
    assert_eq!(src["topic"], "kv");
    assert_eq!(src["buffer_steps"], 10_000);
    let mut sub = subscriber(&ep, "kv").await;
    let first = sync(&c, &url, &mut sub).await;
    let msgs = messages("Check these blocks.", &question("numbered"));
    for i in 1..=3 {
        let m = messages("You are terse.", &question(&format!("numbered {i}")));
        chat(&c, &url, if i == 3 { &msgs } else { &m }).await;
        let p = next(&mut sub).await;
        assert_eq!(p.seq, first + i, "consecutive sequence numbers");
        assert_eq!(&p.topic[..], b"kv");
        assert_eq!(p.batch.data_parallel_rank, Some(0));
        let (len, event_keys) = wire_keys(&p.payload);
        assert_eq!(len, 3, "[ts, events, rank]");
        assert_eq!(
            event_keys[0],
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name",
                "extra_keys",
                "group_idx",
                "kv_cache_spec_kind"
            ]
        );
    }
    // the last chat's blocks: the simulator's chained hashes of its prompt ids, every whole
    // block, the prompt's tokens
    let ids = prompt_ids(&c, &url, &msgs).await;
    let whole = ids.len() / BLOCK as usize;
    let all = batches_through(&replay_ep, first + 3).await;
    let seqs: Vec<i64> = all.iter().map(|b| b.0).collect();
    assert_eq!(
        seqs,
        (0..=first + 3).collect::<Vec<_>>(),
        "replay holds them all"
    );
    let Event::BlockStored(s) = &all[all.len() - 1].1.events[0] else {
        panic!("{:?}", all.last());
    };
    let hashes: Vec<EngineHash> = block_hashes(&ids, BLOCK)
        .into_iter()
        .map(EngineHash)
        .collect();
    assert_eq!(s.block_hashes, hashes);
    assert_eq!(s.parent_block_hash, None);
    assert_eq!(s.token_ids, ids[..whole * BLOCK as usize]);
    assert_eq!(s.block_size, BLOCK);
    assert_eq!(s.medium.as_deref(), Some("GPU"));
    assert_eq!((s.lora_id, s.lora_name.as_deref()), (None, None));
    assert_eq!(s.extra_keys, Some(vec![None; whole]));
    assert_eq!(s.group_idx, Some(0));
    assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_system_prompt_is_stored_once_and_read_back_from_the_cache() {
    let sim = kv_sim(|c| c).await;
    let c = client();
    let url = sim.url();
    let (_, replay_ep, _) = sources(&c, &url).await;
    let replay_ep = replay_ep.unwrap();
    let system = "You are a careful assistant who answers in short sentences. ".repeat(6);
    let (m1, m2) = (
        messages(&system, &question("one")),
        messages(&system, &question("two")),
    );
    let u1 = chat(&c, &url, &m1).await;
    let u2 = chat(&c, &url, &m2).await;
    let (ids1, ids2) = (
        prompt_ids(&c, &url, &m1).await,
        prompt_ids(&c, &url, &m2).await,
    );
    let common = ids1.iter().zip(&ids2).take_while(|(a, b)| a == b).count() as u32;
    let shared = common / BLOCK;
    assert!(
        shared >= 4,
        "the system prompt spans blocks: {common} tokens"
    );
    let whole = |ids: &[u32]| ids.len() as u32 / BLOCK * BLOCK;
    assert_eq!(
        u1["prompt_tokens_details"],
        json!({"cached_tokens": 0, "created_cache_tokens": whole(&ids1), "multimodal_tokens": null})
    );
    let cached = shared * BLOCK;
    assert_eq!(
        u2["prompt_tokens_details"],
        json!({"cached_tokens": cached, "created_cache_tokens": whole(&ids2) - cached, "multimodal_tokens": null})
    );
    // two batches: the first prompt's blocks, then only the second's own, hanging off the
    // last shared block
    let all = batches_through(&replay_ep, 1).await;
    let (h1, h2) = (block_hashes(&ids1, BLOCK), block_hashes(&ids2, BLOCK));
    assert_eq!(
        stored(&all[0].1),
        [(None, h1.clone(), ids1[..h1.len() * 16].to_vec())]
    );
    let s = shared as usize;
    assert_eq!(
        stored(&all[1].1),
        [(
            Some(h1[s - 1]),
            h2[s..].to_vec(),
            ids2[s * 16..h2.len() * 16].to_vec()
        )]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_blocks_are_removed_after_they_were_stored() {
    // room for 4 blocks: every prompt of 3 or more pushes older ones out
    let timing = Timing {
        prefix_cache_tokens: Some(4 * u64::from(BLOCK)),
        ..fast()
    };
    let sim = kv_sim(|c| c.timing(timing)).await;
    let c = client();
    let url = sim.url();
    let (_, replay_ep, _) = sources(&c, &url).await;
    for i in 0..6 {
        chat(&c, &url, &messages("Be brief.", &question(&i.to_string()))).await;
    }
    let all = batches_through(&replay_ep.unwrap(), 5).await;
    let mut held = HashSet::new();
    let mut removed = 0;
    for (seq, b) in &all {
        // the removals a step's allocation caused come before its stores, as in vLLM
        let kinds: Vec<bool> = b
            .events
            .iter()
            .map(|e| matches!(e, Event::BlockStored(_)))
            .collect();
        assert!(kinds.windows(2).all(|w| w[0] <= w[1]), "seq {seq}: {b:?}");
        for e in &b.events {
            match e {
                Event::BlockStored(s) => held.extend(s.block_hashes.iter().copied()),
                Event::BlockRemoved(r) => {
                    assert_eq!(r.block_hashes.len(), 1, "one event per block, as vLLM");
                    assert_eq!((r.medium.as_deref(), r.group_idx), (Some("GPU"), Some(0)));
                    assert!(held.remove(&r.block_hashes[0]), "seq {seq}: never stored");
                    removed += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        assert!(held.len() <= 4, "seq {seq}: the cache holds 4 blocks");
    }
    assert!(removed >= 6, "{removed} removals");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_is_published_as_all_blocks_cleared_with_the_next_step() {
    let sim = kv_sim(|c| c.server_dev_mode(true)).await;
    let c = client();
    let url = sim.url();
    let (_, replay_ep, _) = sources(&c, &url).await;
    let replay_ep = replay_ep.unwrap();
    let msgs = messages("Be brief.", &question("reset"));
    chat(&c, &url, &msgs).await;
    // all of it but the block of its last token
    let again = (prompt_ids(&c, &url, &msgs).await.len() as u32 - 1) / BLOCK * BLOCK;
    let u = chat(&c, &url, &msgs).await;
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], again, "{u}");
    let before = batches_through(&replay_ep, 0).await;
    let reset = |q: &'static str| {
        let c = c.clone();
        let url = url.clone();
        async move {
            let r = c
                .post(format!("{url}/reset_prefix_cache{q}"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.json::<Value>().await.unwrap()
        }
    };
    assert_eq!(reset("").await, json!({"success": true}));
    // nothing is published until the engine's next step, as in vLLM
    assert_eq!(all_batches(&replay_ep).await.len(), before.len());
    let u = chat(&c, &url, &msgs).await;
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0, "{u}");
    let all = batches_through(&replay_ep, 1).await;
    let b = &all[1].1;
    assert!(matches!(b.events[0], Event::AllBlocksCleared {}), "{b:?}");
    assert_eq!(stored(b)[0].0, None, "stored anew from the first block");
    // while a request runs, a reset is refused unless it may preempt
    let long = json!({"model": MODEL, "messages": msgs, "max_tokens": 5000, "ignore_eos": true, "stream": true});
    let mut running = c
        .post(format!("{url}/v1/chat/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    let _first = running.chunk().await.unwrap();
    assert_eq!(reset("").await, json!({"success": false}));
    let forced = reset("?reset_running_requests=true").await;
    assert_eq!(forced, json!({"success": true}));
    // the development route exists only in development mode
    let plain = kv_sim(|c| c).await;
    let r = c
        .post(format!("{}/reset_prefix_cache", plain.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_answers_the_buffered_batches_then_the_end_marker() {
    let sim = spawn(vllm().kv_events_config(kv_config(r#","buffer_steps":3"#)))
        .await
        .unwrap();
    let c = client();
    let url = sim.url();
    let (_, replay_ep, _) = sources(&c, &url).await;
    let replay_ep = replay_ep.unwrap();
    for i in 0..5 {
        chat(&c, &url, &messages("Be brief.", &question(&i.to_string()))).await;
    }
    let kept = batches_through(&replay_ep, 4).await;
    assert_eq!(kept.iter().map(|b| b.0).collect::<Vec<_>>(), [2, 3, 4]);
    let mut d = replayer(&replay_ep).await;
    let from3 = replay(&mut d, 3).await;
    assert_eq!(from3.iter().map(|b| b.0).collect::<Vec<_>>(), [3, 4]);
    assert!(from3.iter().all(|b| &b.1[..] == b"kv"), "the topic frame");
    assert!(replay(&mut d, 99).await.is_empty(), "only the end marker");
    // a start of any length is a big-endian number, as vLLM reads it
    send_frames(
        &mut d,
        vec![Bytes::new(), Bytes::from_static(&[0, 0, 0, 4])],
    )
    .await;
    assert_eq!(
        kvevents::parse_seq(&recv_frames(&mut d).await[2]).unwrap(),
        4
    );
    assert_eq!(
        kvevents::parse_seq(&recv_frames(&mut d).await[2]).unwrap(),
        -1
    );
    // a malformed request gets nothing: the next answer is the next good request's
    let seq0 = Bytes::copy_from_slice(&kvevents::seq_frame(0));
    send_frames(&mut d, vec![Bytes::new(), seq0, Bytes::from_static(b"x")]).await;
    assert_eq!(replay(&mut d, 4).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_withheld_batch_is_a_gap_replay_fills_unless_replay_is_lost_too() {
    let sim = kv_sim(|c| c).await;
    let c = client();
    let url = sim.url();
    let (ep, replay_ep, _) = sources(&c, &url).await;
    let replay_ep = replay_ep.unwrap();
    let mut sub = subscriber(&ep, "kv").await;
    let s = sync(&c, &url, &mut sub).await;
    let fault = |mode: &str, seq: i64| json!({"mode": mode, "seqs": [seq]});
    assert_eq!(
        set_fault(&c, &url, fault("kv_skip", s + 2)).await.status(),
        200
    );
    chats(&c, &url, "gap", 3).await;
    assert_eq!(next(&mut sub).await.seq, s + 1);
    assert_eq!(next(&mut sub).await.seq, s + 3, "s + 2 withheld");
    let mut d = replayer(&replay_ep).await;
    let filled = replay(&mut d, s + 2).await;
    assert_eq!(
        filled.iter().map(|b| b.0).collect::<Vec<_>>(),
        [s + 2, s + 3]
    );
    assert_eq!(stored(&kvevents::decode(&filled[0].2).unwrap()).len(), 1);
    // kv_lost: the same gap, and replay answers nothing
    assert_eq!(
        set_fault(&c, &url, fault("kv_lost", s + 5)).await.status(),
        200
    );
    chats(&c, &url, "lost", 3).await;
    assert_eq!(next(&mut sub).await.seq, s + 4);
    assert_eq!(next(&mut sub).await.seq, s + 6, "s + 5 withheld");
    let start = Bytes::copy_from_slice(&kvevents::seq_frame(s + 5));
    send_frames(&mut d, vec![Bytes::new(), start]).await;
    let silence = tokio::time::timeout(Duration::from_millis(500), d.recv()).await;
    assert!(silence.is_err(), "no answer under kv_lost: {silence:?}");
    // the fault is one of the simulator's: `healthy` lifts it
    set_fault(&c, &url, json!({"mode": "healthy"})).await;
    assert_eq!(replay(&mut d, s + 6).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_simulator_numbers_from_zero_again_on_the_same_ports() {
    let c = client();
    let a = kv_sim(|c| c).await;
    let (ep, replay_ep, _) = sources(&c, &a.url()).await;
    let replay_ep = replay_ep.unwrap();
    chat(&c, &a.url(), &messages("Be brief.", &question("before"))).await;
    chat(&c, &a.url(), &messages("Be brief.", &question("before 2"))).await;
    assert_eq!(batches_through(&replay_ep, 1).await.len(), 2);
    a.shutdown().await;
    let port = |e: &str| e.rsplit(':').next().unwrap().to_string();
    let cfg = KvEventsConfig::from_json(&format!(
        r#"{{"enable_kv_cache_events":true,"endpoint":"tcp://*:{}","replay_endpoint":"tcp://*:{}","topic":"kv"}}"#,
        port(&ep),
        port(&replay_ep)
    ))
    .unwrap();
    // the old sockets close as the stopped simulator's tasks wind down
    let b = poll(Duration::from_secs(10), "the ports free again", || {
        let cfg = vllm().kv_events_config(cfg.clone());
        async move { spawn(cfg).await.ok() }
    })
    .await;
    let (ep_b, _, _) = sources(&c, &b.url()).await;
    assert_eq!(
        ep_b,
        format!("tcp://*:{}", port(&ep)),
        "reported as configured"
    );
    chat(&c, &b.url(), &messages("Be brief.", &question("after"))).await;
    let dial = kvevents::dial_endpoint(&replay_ep, "127.0.0.1");
    let again = batches_through(&dial, 0).await;
    assert_eq!(again.len(), 1);
    assert!(!stored(&again[0].1).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concrete_endpoint_is_connected_to_a_subscriber_that_binds() {
    let mut sub = SubSocket::new();
    let bound = sub.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    sub.subscribe("").await.unwrap();
    let cfg = KvEventsConfig::from_json(&format!(
        r#"{{"enable_kv_cache_events":true,"endpoint":"{bound}"}}"#
    ))
    .unwrap();
    let sim = spawn(vllm().kv_events_config(cfg)).await.unwrap();
    let c = client();
    let (ep, replay, src) = sources(&c, &sim.url()).await;
    assert_eq!((ep.as_str(), replay), (bound.as_str(), None));
    assert_eq!(src["topic"], "");
    let seq = sync(&c, &sim.url(), &mut sub).await;
    assert!(seq >= 0);
}

#[tokio::test]
async fn events_are_a_vllm_flag_of_a_scheduled_simulator() {
    let tgi = SimConfig::new(SimKind::Tgi, vec![MODEL.into()]).kv_events_config(kv_config(""));
    assert!(spawn(tgi).await.is_err());
    assert!(spawn(vllm().speed(0.0).kv_events_config(kv_config("")))
        .await
        .is_err());
    // without the flag vLLM answers an empty map, and has no development routes
    let plain = spawn(vllm()).await.unwrap();
    let c = client();
    let r = c
        .get(format!("{}/kv_event_sources", plain.url()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.text().await.unwrap(), "{}");
    let off = KvEventsConfig::from_json(r#"{"enable_kv_cache_events":false}"#).unwrap();
    let disabled = spawn(vllm().kv_events_config(off)).await.unwrap();
    let v: Value = c
        .get(format!("{}/kv_event_sources", disabled.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v, json!({}));
    // a fault on a simulator without events changes nothing
    plain
        .set_fault(Fault::mode(FaultMode::KvSkip).with_seqs(vec![0]))
        .unwrap();
}

/// The gateway's own subscriber (fleet/kv) follows the simulator's publisher: discovery from
/// `/kv_event_sources`, the replay from 0, live batches, a reset. The endpoints are `tcp://*:N`:
/// the gateway takes a concrete host for a publisher that connects, which is what vLLM (and
/// the simulator) reports for `tcp://*:0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_follows_the_simulators_events() {
    let (p, r) = (crate::support::free_port(), crate::support::free_port());
    let cfg = KvEventsConfig::from_json(&format!(
        r#"{{"enable_kv_cache_events":true,"endpoint":"tcp://*:{p}","replay_endpoint":"tcp://*:{r}","topic":"kv"}}"#
    ))
    .unwrap();
    let sim = spawn(vllm().kv_events_config(cfg).server_dev_mode(true))
        .await
        .unwrap();
    let c = client();
    let url = sim.url();
    let toml = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n{}{}",
        crate::support::STEADY_HEALTH,
        crate::support::backend("v", "vllm", &url, &[MODEL])
    );
    let g = crate::support::TestGateway::start_healthy(&toml).await;
    let admin = g.admin_url("/admin/backends");
    let kv = |_: &crate::support::TestGateway| first_kv_cache(&c, &admin);
    poll(
        Duration::from_secs(10),
        "the gateway subscribed",
        || async { kv(&g).await.filter(|k| k["status"] == "warm") },
    )
    .await;
    let msgs = messages("Followed by the gateway.", &question("gateway"));
    let whole = prompt_ids(&c, &url, &msgs).await.len() / BLOCK as usize;
    chat(&c, &url, &msgs).await;
    poll(Duration::from_secs(10), "the blocks indexed", || async {
        kv(&g).await.filter(|k| k["blocks"] == whole)
    })
    .await;
    let r = c
        .post(format!("{url}/reset_prefix_cache"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let next = messages("Be brief.", &question("after the reset"));
    let whole_next = prompt_ids(&c, &url, &next).await.len() / BLOCK as usize;
    chat(&c, &url, &next).await;
    let after = poll(Duration::from_secs(10), "the reset applied", || async {
        kv(&g).await.filter(|k| k["batches"] == 2)
    })
    .await;
    // the first prompt's blocks are gone with the reset; the index stayed in step
    assert_eq!(after["blocks"], whole_next, "{after}");
    assert_eq!(after["status"], "warm", "{after}");
    assert_eq!(after["rebuilds"], 1, "only the initial build: {after}");
    g.stop().await;
}

/// An engine restart through the gateway: the subscription is `lost` (lookups answer nothing)
/// while the engine is gone, and the index is rebuilt from the new engine alone when it is back
/// on the same ports.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_loses_a_restarted_engines_index_and_rebuilds_it_from_the_new_one() {
    let (p, r) = (crate::support::free_port(), crate::support::free_port());
    let cfg = KvEventsConfig::from_json(&format!(
        r#"{{"enable_kv_cache_events":true,"endpoint":"tcp://*:{p}","replay_endpoint":"tcp://*:{r}","topic":"kv"}}"#
    ))
    .unwrap();
    let a = spawn(vllm().kv_events_config(cfg.clone())).await.unwrap();
    let c = client();
    let url = a.url();
    let toml = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n{}{}",
        crate::support::FAST_HEALTH,
        crate::support::backend("v", "vllm", &url, &[MODEL])
    );
    let g = crate::support::TestGateway::start_healthy(&toml).await;
    let admin = g.admin_url("/admin/backends");
    let kv = || first_kv_cache(&c, &admin);
    let before = messages("Before the restart.", &question("before"));
    let whole = prompt_ids(&c, &url, &before).await.len() / BLOCK as usize;
    poll(Duration::from_secs(10), "subscribed", || async {
        kv().await.filter(|k| k["status"] == "warm")
    })
    .await;
    chat(&c, &url, &before).await;
    poll(Duration::from_secs(10), "indexed", || async {
        kv().await.filter(|k| k["blocks"] == whole)
    })
    .await;
    let http_port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    a.shutdown().await;
    poll(Duration::from_secs(10), "lost", || async {
        kv().await.filter(|k| k["status"] == "lost")
    })
    .await;
    // the same ports, a new engine with an empty cache
    let b = poll(Duration::from_secs(10), "the ports free again", || {
        let cfg = vllm().kv_events_config(cfg.clone()).port(http_port);
        async move { spawn(cfg).await.ok() }
    })
    .await;
    let fresh = poll(Duration::from_secs(20), "followed again", || async {
        kv().await.filter(|k| k["status"] == "warm")
    })
    .await;
    assert_eq!(fresh["blocks"], 0, "nothing of the old engine: {fresh}");
    let after = messages("After the restart.", &question("after"));
    let whole_after = prompt_ids(&c, &b.url(), &after).await.len() / BLOCK as usize;
    chat(&c, &b.url(), &after).await;
    poll(
        Duration::from_secs(10),
        "the new engine indexed",
        || async { kv().await.filter(|k| k["blocks"] == whole_after) },
    )
    .await;
    g.stop().await;
}

/// A backend dropped from the config takes its subscription with it: the engine goes on
/// publishing, and nothing of it is applied any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_removed_from_the_config_is_no_longer_followed() {
    let sim = kv_sim(|c| c).await;
    let c = client();
    let url = sim.url();
    let base = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n{}",
        crate::support::STEADY_HEALTH
    );
    let with = format!(
        "{base}{}",
        crate::support::backend("kv-removed", "vllm", &url, &[MODEL])
    );
    let g = crate::support::TestGateway::start_healthy(&with).await;
    let applied = || {
        let url = g.admin_url("/metrics");
        let c = c.clone();
        async move {
            let text = c.get(url).send().await.ok()?.text().await.ok()?;
            text.lines()
                .find(|l| {
                    l.starts_with("sluice_kv_event_batches_total")
                        && l.contains("backend=\"kv-removed\"")
                })
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        }
    };
    chat(&c, &url, &messages("Followed.", &question("one"))).await;
    poll(Duration::from_secs(10), "a batch applied", || async {
        applied().await.filter(|n| *n >= 1.0)
    })
    .await;
    // the turn's batches all in: the count holds still for a while
    let before = poll(Duration::from_secs(10), "the count settled", || async {
        let a = applied().await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
        (applied().await? == a).then_some(a)
    })
    .await;
    let without = format!(
        "{base}{}",
        crate::support::backend("kv-other", "openai", "http://127.0.0.1:9", &["x"])
    );
    g.gw.reload(sluice::config::from_str(&without, "t").unwrap());
    // the engine publishes on; a subscription still alive would apply these
    for i in 0..3 {
        chat(
            &c,
            &url,
            &messages("After removal.", &question(&format!("r{i}"))),
        )
        .await;
    }
    // a live subscription applies a batch within milliseconds; give it far longer
    let deadline = std::time::Instant::now() + Duration::from_millis(500);
    while std::time::Instant::now() < deadline {
        assert_eq!(
            applied().await,
            Some(before),
            "no batch applied after removal"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    g.stop().await;
}
