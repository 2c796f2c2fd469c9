//! The KV-event subscription of one vLLM backend: find the publisher, follow its batches in
//! sequence, fill gaps from its replay endpoint, and keep [`KvCache`] honest about what it
//! knows.
//!
//! - Publisher: `kv_events = "tcp://…"`, else the engine's `GET /kv_event_sources` (rank 0; a
//!   wildcard host becomes the backend's host, a concrete one is dialled as given: vLLM reports
//!   its node's address for a `tcp://*:0` endpoint it bound). An engine whose publisher
//!   *connects* (a concrete host in its own setting) expects one subscriber that binds, which
//!   several gateway replicas cannot all be: dialling it fails, and the backend stays without
//!   events (`lost`), retried.
//! - On every (re)connection the index is rebuilt from a replay from sequence 0: complete when
//!   the engine still buffers its first batch (`warm`), a lower bound otherwise (`cold`). A
//!   reconnect may follow an engine restart, whose sequence numbers start again; only a fresh
//!   replay cannot mistake the new engine's batches for the old one's.
//! - While connected: the next sequence number is applied; a gap is replayed, and when the
//!   replay does not cover it the index is rebuilt `cold`; a number lower than expected past
//!   the replay's overlap is an engine restart (the cache starts empty: `warm`).
//! - The connection dropping makes the index `lost` (lookups answer nothing) until the next
//!   connection is made. Every wait is bounded; every retry backs off.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde::Deserialize;
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend, ZmqMessage};

use super::{KvCache, Status};
use crate::config::{BackendKind, KvEvents};
use crate::fleet::Backend;
use crate::kvevents::{self, EventBatch};
use crate::telemetry::metrics as m;

/// How long a connection attempt (and a replay answer) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// First wait before finding or reaching the publisher again.
const RETRY_EVERY: Duration = Duration::from_secs(5);
/// Longest wait between attempts, and between asking an engine that publishes nothing.
const ASK_AGAIN: Duration = Duration::from_secs(60);
/// The most batches one replay answer may bring.
const MAX_REPLAY: usize = 100_000;

/// Why a subscription could not go on.
#[derive(Debug, thiserror::Error)]
pub enum SubscribeError {
    #[error("kv_event_sources: {0}")]
    Sources(String),
    #[error("the engine publishes no KV events")]
    Disabled,
    #[error("zmq: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("the connection dropped")]
    Dropped,
    #[error("the engine has no replay endpoint")]
    NoReplay,
}

/// One engine's publisher, as the subscriber dials it.
#[derive(Debug, Clone, PartialEq)]
pub struct Source {
    pub endpoint: String,
    pub replay: Option<String>,
    pub topic: String,
}

/// A rank's entry of `GET /kv_event_sources`.
#[derive(Debug, Deserialize)]
struct SourceConfig {
    #[serde(default)]
    enable_kv_cache_events: bool,
    #[serde(default)]
    publisher: Option<String>,
    endpoint: Option<String>,
    replay_endpoint: Option<String>,
    #[serde(default)]
    topic: String,
}

/// The source in a `GET /kv_event_sources` answer (rank 0), dialled on `host`.
pub fn parse_sources(body: &[u8], host: &str) -> Result<Source, SubscribeError> {
    let map: std::collections::BTreeMap<String, SourceConfig> =
        serde_json::from_slice(body).map_err(|e| SubscribeError::Sources(e.to_string()))?;
    let Some(c) = map.get("0").or_else(|| map.values().next()) else {
        return Err(SubscribeError::Disabled);
    };
    let zmq = c.publisher.as_deref().is_none_or(|p| p == "zmq");
    let Some(endpoint) = c
        .endpoint
        .as_deref()
        .filter(|_| c.enable_kv_cache_events && zmq)
    else {
        return Err(SubscribeError::Disabled);
    };
    Ok(Source {
        endpoint: kvevents::dial_endpoint(endpoint, host),
        replay: c
            .replay_endpoint
            .as_deref()
            .map(|r| kvevents::dial_endpoint(r, host)),
        topic: c.topic.clone(),
    })
}

/// Follow `backend`'s KV events for as long as the task lives (the health task runs it).
/// A publisher that cannot be reached is tried again after [`RETRY_EVERY`], doubling up to
/// [`ASK_AGAIN`]; an engine that publishes no events is asked again after [`ASK_AGAIN`] (its
/// setting changes only with a restart).
pub async fn run(backend: Arc<Backend>) {
    if backend.kind() != BackendKind::Vllm || backend.config.kv_events == KvEvents::Off {
        return;
    }
    let kv = backend.state.kv();
    kv.set_status(Status::Connecting);
    let mut wait = RETRY_EVERY;
    loop {
        match source(&backend).await {
            Ok(src) => {
                let err = follow(&backend, &src).await;
                tracing::info!(backend = backend.name(), error = %err, "KV events: subscription ended");
                kv.set_status(Status::Lost);
                wait = RETRY_EVERY;
            }
            Err(SubscribeError::Disabled) => {
                kv.set_status(Status::Off);
                wait = ASK_AGAIN;
            }
            Err(e) => {
                tracing::debug!(backend = backend.name(), error = %e, "KV events: no source");
                if kv.view().status == Status::Off {
                    kv.set_status(Status::Connecting);
                }
                wait = (wait * 2).min(ASK_AGAIN);
            }
        }
        tokio::time::sleep(wait).await;
    }
}

async fn source(backend: &Backend) -> Result<Source, SubscribeError> {
    let host = backend.config.url.host().unwrap_or("127.0.0.1").to_string();
    let host = host.trim_matches(|c| c == '[' || c == ']').to_string();
    let discovered = match backend
        .call(http::Method::GET, "/kv_event_sources", None, 64 * 1024)
        .await
    {
        Ok((status, body)) if status.is_success() => parse_sources(&body, &host),
        Ok((status, _)) => Err(SubscribeError::Sources(format!("status {status}"))),
        Err(e) => Err(SubscribeError::Sources(e.to_string())),
    };
    match &backend.config.kv_events {
        KvEvents::Endpoint(e) => Ok(Source {
            endpoint: e.clone(),
            replay: discovered.as_ref().ok().and_then(|s| s.replay.clone()),
            topic: discovered.map(|s| s.topic).unwrap_or_default(),
        }),
        _ => discovered,
    }
}

/// [`follow`] as a task the tests can spawn.
#[cfg(test)]
pub(super) async fn follow_for_tests(backend: Arc<Backend>, src: Source) -> SubscribeError {
    follow(&backend, &src).await
}

/// Subscribe to `src` and apply its batches until the connection drops or fails.
async fn follow(backend: &Backend, src: &Source) -> SubscribeError {
    let kv = backend.state.kv();
    let mut sub = zeromq::SubSocket::new();
    let mut monitor = sub.monitor();
    match tokio::time::timeout(CONNECT_TIMEOUT, sub.connect(&src.endpoint)).await {
        Err(_) => return SubscribeError::Timeout(CONNECT_TIMEOUT),
        Ok(Err(e)) => return e.into(),
        Ok(Ok(())) => {}
    }
    if let Err(e) = sub.subscribe(&src.topic).await {
        return e.into();
    }
    let mut seq = Sequence::start(kv, src, backend.name()).await;
    loop {
        tokio::select! {
            msg = sub.recv() => match msg {
                Ok(msg) => seq.on_message(kv, src, backend.name(), msg).await,
                Err(e) => return e.into(),
            },
            ev = monitor.next() => match ev {
                Some(SocketEvent::Disconnected(_)) | Some(SocketEvent::Closed) | None => {
                    kv.set_status(Status::Lost);
                    return SubscribeError::Dropped;
                }
                Some(_) => {}
            },
        }
    }
}

/// The sequence numbers of one connection.
struct Sequence {
    /// The next number expected.
    next: i64,
    /// Below this, a number is a batch the initial replay already applied (the subscription
    /// queued it while the replay ran), not a restart.
    replayed_below: i64,
}

impl Sequence {
    /// Rebuild the index from a replay from 0: warm when the replay starts at 0, or when the
    /// engine answered that it has published nothing yet.
    async fn start(kv: &KvCache, src: &Source, name: &str) -> Sequence {
        let (batches, answered) = match replay(src, 0).await {
            Ok(b) => (b, true),
            Err(_) => (Vec::new(), false),
        };
        let complete = match batches.first() {
            Some((s, _)) => *s == 0,
            None => answered,
        };
        kv.rebuild(if complete { Status::Warm } else { Status::Cold });
        let mut next = batches.first().map_or(0, |(s, _)| *s);
        for (s, b) in &batches {
            if *s != next {
                // a replay with a hole in it: what follows the hole is a lower bound
                kv.rebuild(Status::Cold);
            }
            apply(kv, b, name);
            next = s + 1;
        }
        Sequence {
            next,
            replayed_below: next,
        }
    }

    async fn on_message(&mut self, kv: &KvCache, src: &Source, name: &str, msg: ZmqMessage) {
        let (s, batch) = match frames(&msg) {
            Ok(x) => x,
            Err(why) => {
                m::kv_event_error(name, why);
                kv.rebuild(Status::Cold);
                self.next = -1;
                return;
            }
        };
        if self.next < 0 {
            // after a malformed batch: count again from here (the index was rebuilt cold)
        } else if s < self.next {
            if s < self.replayed_below {
                return; // queued while the replay ran: already applied
            }
            // the engine restarted: its cache starts empty
            kv.rebuild(if s == 0 { Status::Warm } else { Status::Cold });
            self.replayed_below = 0;
        } else if s > self.next {
            self.fill_gap(kv, src, name, s).await;
        }
        apply(kv, &batch, name);
        self.next = s + 1;
        // in order again: a lower number from now on is a restart, not the replay's overlap
        self.replayed_below = 0;
    }

    /// Replay the batches `self.next .. upto`; rebuild cold when the replay cannot cover them.
    async fn fill_gap(&mut self, kv: &KvCache, src: &Source, name: &str, upto: i64) {
        m::kv_event_error(name, "gap");
        let got = replay(src, self.next).await.unwrap_or_default();
        let wanted: Vec<&(i64, EventBatch)> = got.iter().filter(|(s, _)| *s < upto).collect();
        let covered = wanted.len() as i64 == upto - self.next
            && wanted.iter().zip(self.next..).all(|((s, _), e)| *s == e);
        if covered {
            for (_, b) in wanted {
                apply(kv, b, name);
            }
        } else {
            kv.rebuild(Status::Cold);
        }
    }
}

fn apply(kv: &KvCache, batch: &EventBatch, name: &str) {
    let a = kv.apply(batch);
    m::kv_batch(name, a.stored, a.removed, a.orphaned);
    if a.overflowed {
        m::kv_event_error(name, "overflow");
    }
}

/// The sequence number and batch of a PUB message (`[topic, seq, payload]`).
fn frames(msg: &ZmqMessage) -> Result<(i64, EventBatch), &'static str> {
    let (Some(seq), Some(payload)) = (msg.get(1), msg.get(2)) else {
        return Err("frames");
    };
    let seq = kvevents::parse_seq(seq).map_err(|_| "frames")?;
    let batch = kvevents::decode(payload).map_err(|_| "malformed")?;
    Ok((seq, batch))
}

/// The sequence number and payload of one replay answer: `["", topic, seq, payload]` as vLLM
/// 0.32 sends it (the end: `["", "", -1, ""]`), or `["", seq, payload]` without the topic.
fn replay_frames(msg: &ZmqMessage) -> Option<(i64, &[u8])> {
    let (seq, payload) = match msg.len() {
        4 => (msg.get(2)?, msg.get(3)?),
        3 => (msg.get(1)?, msg.get(2)?),
        _ => return None,
    };
    Some((kvevents::parse_seq(seq).ok()?, payload))
}

/// The batches the engine still buffers from `from` on, in order (a malformed one ends the
/// list); an error without a replay endpoint or an answer in time.
async fn replay(src: &Source, from: i64) -> Result<Vec<(i64, EventBatch)>, SubscribeError> {
    let Some(endpoint) = &src.replay else {
        return Err(SubscribeError::NoReplay);
    };
    let work = async {
        let mut dealer = zeromq::DealerSocket::new();
        dealer.connect(endpoint).await?;
        let mut ask = ZmqMessage::from(bytes::Bytes::new());
        ask.push_back(bytes::Bytes::copy_from_slice(&kvevents::seq_frame(from)));
        dealer.send(ask).await?;
        let mut out = Vec::new();
        while out.len() < MAX_REPLAY {
            let msg = dealer.recv().await?;
            let Some((seq, payload)) = replay_frames(&msg) else {
                break;
            };
            if seq == kvevents::REPLAY_END {
                break;
            }
            match kvevents::decode(payload) {
                Ok(b) => out.push((seq, b)),
                Err(_) => break,
            }
        }
        Ok::<_, SubscribeError>(out)
    };
    tokio::time::timeout(CONNECT_TIMEOUT, work)
        .await
        .map_err(|_| SubscribeError::Timeout(CONNECT_TIMEOUT))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_read_as_vllm_writes_them() {
        let body = br#"{"0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","buffer_steps":10000,"hwm":100000,"max_queue_size":100000,"topic":"kv"}}"#;
        let s = parse_sources(body, "10.0.0.7").unwrap();
        assert_eq!(s.endpoint, "tcp://10.0.0.7:5557");
        assert_eq!(s.replay.as_deref(), Some("tcp://10.0.0.7:5558"));
        assert_eq!(s.topic, "kv");
        let off = br#"{"0":{"enable_kv_cache_events":false,"publisher":"null","endpoint":"tcp://*:5557","topic":""}}"#;
        assert!(matches!(
            parse_sources(off, "h"),
            Err(SubscribeError::Disabled)
        ));
        // vLLM reports its node's address for a `tcp://*:0` it bound: dialled as given
        let bound = br#"{"0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://10.0.0.1:41234"}}"#;
        let s = parse_sources(bound, "h").unwrap();
        assert_eq!(
            (s.endpoint.as_str(), s.replay),
            ("tcp://10.0.0.1:41234", None)
        );
        assert!(matches!(
            parse_sources(b"{}", "h"),
            Err(SubscribeError::Disabled)
        ));
        assert!(matches!(
            parse_sources(b"nope", "h"),
            Err(SubscribeError::Sources(_))
        ));
    }
}
