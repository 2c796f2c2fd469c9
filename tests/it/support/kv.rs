//! A KV-event subscriber for tests: a real ZMQ SUB socket and a DEALER for replay, both with
//! deadlines, reading what a simulator (or anything speaking vLLM's protocol) publishes.
#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;
use sluice::kvevents::{self, EventBatch};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// How long one message may take to arrive.
pub const WAIT: Duration = Duration::from_secs(10);

/// One PUB message: topic, sequence number, decoded batch and the raw payload.
#[derive(Debug)]
pub struct Published {
    pub topic: Bytes,
    pub seq: i64,
    pub batch: EventBatch,
    pub payload: Bytes,
}

/// The endpoints of `/kv_event_sources` (rank 0) of the simulator at `url`: (publisher, replay).
pub async fn sources(c: &reqwest::Client, url: &str) -> (String, Option<String>, Value) {
    let v: Value = c
        .get(format!("{url}/kv_event_sources"))
        .send()
        .await
        .expect("kv_event_sources")
        .json()
        .await
        .expect("json");
    let src = v["0"].clone();
    let ep = src["endpoint"].as_str().expect("endpoint").to_string();
    let replay = src["replay_endpoint"].as_str().map(str::to_string);
    (ep, replay, src)
}

/// A SUB socket connected to `endpoint`, subscribed to `topic`.
pub async fn subscriber(endpoint: &str, topic: &str) -> SubSocket {
    let mut sub = SubSocket::new();
    tokio::time::timeout(WAIT, sub.connect(endpoint))
        .await
        .expect("connect in time")
        .expect("connect");
    sub.subscribe(topic).await.expect("subscribe");
    sub
}

/// A message's frames as (topic, seq, payload).
fn split(m: ZmqMessage) -> Published {
    let frames = m.into_vec();
    assert_eq!(frames.len(), 3, "[topic, seq, payload]: {frames:?}");
    let seq = kvevents::parse_seq(&frames[1]).expect("8-byte sequence number");
    let batch = kvevents::decode(&frames[2]).expect("a vLLM event batch");
    Published {
        topic: frames[0].clone(),
        seq,
        batch,
        payload: frames[2].clone(),
    }
}

/// The next published message, or `None` when none comes within `within`.
pub async fn next_within(sub: &mut SubSocket, within: Duration) -> Option<Published> {
    match tokio::time::timeout(within, sub.recv()).await {
        Ok(Ok(m)) => Some(split(m)),
        Ok(Err(e)) => panic!("SUB socket failed: {e}"),
        Err(_) => None,
    }
}

/// The next published message (panics after [`WAIT`]).
pub async fn next(sub: &mut SubSocket) -> Published {
    next_within(sub, WAIT)
        .await
        .expect("a published batch in time")
}

/// A DEALER connected to the replay endpoint.
pub async fn replayer(endpoint: &str) -> DealerSocket {
    let mut d = DealerSocket::new();
    tokio::time::timeout(WAIT, d.connect(endpoint))
        .await
        .expect("connect in time")
        .expect("connect");
    d
}

/// Send the frames `frames` as one message.
pub async fn send_frames(d: &mut DealerSocket, frames: Vec<Bytes>) {
    let m = ZmqMessage::try_from(frames).expect("frames");
    d.send(m).await.expect("send");
}

/// The frames of the next message the DEALER receives (panics after [`WAIT`]).
pub async fn recv_frames(d: &mut DealerSocket) -> Vec<Bytes> {
    tokio::time::timeout(WAIT, d.recv())
        .await
        .expect("a replay answer in time")
        .expect("recv")
        .into_vec()
}

/// Ask for a replay from `start` and read the answer up to its end marker: each buffered
/// batch's (seq, topic, payload), checking vLLM's framing `["", topic, seq, payload]` and
/// `["", "", -1, ""]`.
pub async fn replay(d: &mut DealerSocket, start: i64) -> Vec<(i64, Bytes, Bytes)> {
    let seq = Bytes::copy_from_slice(&kvevents::seq_frame(start));
    send_frames(d, vec![Bytes::new(), seq]).await;
    let mut out = Vec::new();
    for _ in 0..100_000 {
        let f = recv_frames(d).await;
        assert_eq!(f.len(), 4, "[\"\", topic, seq, payload]: {f:?}");
        assert!(f[0].is_empty(), "empty delimiter: {f:?}");
        let seq = kvevents::parse_seq(&f[2]).expect("seq");
        if seq == kvevents::REPLAY_END {
            assert!(f[1].is_empty() && f[3].is_empty(), "end marker: {f:?}");
            return out;
        }
        out.push((seq, f[1].clone(), f[3].clone()));
    }
    panic!("no end marker");
}

/// Each backend's `kv_cache` object in the gateway's `/admin/backends` (at `admin_url`), in
/// config order; `None` while the endpoint does not answer.
pub async fn kv_caches(c: &reqwest::Client, admin_url: &str) -> Option<Vec<Value>> {
    let v: Value = c.get(admin_url).send().await.ok()?.json().await.ok()?;
    let list = v["backends"].as_array()?;
    Some(list.iter().map(|b| b["kv_cache"].clone()).collect())
}

/// The first backend's `kv_cache` object (see [`kv_caches`]).
pub async fn first_kv_cache(c: &reqwest::Client, admin_url: &str) -> Option<Value> {
    kv_caches(c, admin_url).await?.into_iter().next()
}
