//! The streaming observer gives the same result whether the backend's bytes arrive in one
//! chunk, in chunks split where the fuzz input says, or byte by byte: the same bytes to the
//! client, the same usage and the same completeness. It never panics, and what it sends is
//! well-formed: every event's data is JSON or `[DONE]`, the stream ends with `data: [DONE]`,
//! and a pass-through stream is the backend's own events (a prefix of them when it was cut),
//! plus at most the terminal error.
#![no_main]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body::{Body, Frame};
use http_body_util::BodyExt;
use libfuzzer_sys::fuzz_target;
use sluice::config::{BackendConfig, HealthConfig};
use sluice::fleet::{Backend, BackendState};
use sluice::proxy::observe::{Edits, ObservedStream, Settle, Usage};
use sluice::proxy::sse::{event_data, SseScanner};
use sluice::telemetry::access::AccessRecord;

/// A backend body that yields the given chunks, then ends.
struct Chunks(VecDeque<Bytes>);

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

struct Setup {
    rt: tokio::runtime::Runtime,
    backend: BackendConfig,
    health: HealthConfig,
}

fn setup() -> &'static Setup {
    static SETUP: OnceLock<Setup> = OnceLock::new();
    SETUP.get_or_init(|| {
        let config = sluice::config::from_str(
            "[[backends]]\nname = \"b\"\nkind = \"vllm\"\nurl = \"http://127.0.0.1:9\"\nmodels = [\"m\"]\n",
            "fuzz",
        )
        .expect("fuzz config");
        Setup {
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .build()
                .expect("runtime"),
            backend: config.backends[0].clone(),
            health: config.health.clone(),
        }
    })
}

#[derive(Debug, PartialEq)]
struct Observed {
    out: Bytes,
    usage: Option<Usage>,
    complete: bool,
}

fn observe(chunks: Vec<Bytes>, edits: &Edits) -> Observed {
    let s = setup();
    let backend = Arc::new(Backend::new(
        s.backend.clone(),
        Arc::new(BackendState::new()),
    ));
    let outcome = Arc::new(Mutex::new(None));
    let mut settle = Settle::new(AccessRecord::new("r".into(), "chat", Instant::now()));
    settle.prompt_estimate = 7;
    let seen = outcome.clone();
    settle.hooks.push(Box::new(move |o| {
        *seen.lock().unwrap() = Some((o.usage, o.complete));
    }));
    let edits = edits.clone();
    let health = s.health.clone();
    // The idle timer needs the runtime, so the stream is made inside it.
    let out = s.rt.block_on(async move {
        let body = ObservedStream::new(
            sluice::api::CHAT,
            Chunks(chunks.into()),
            edits,
            Duration::from_secs(3600),
            backend,
            health,
            settle,
        );
        match body.collect().await {
            Ok(c) => c.to_bytes(),
            Err(e) => match e {},
        }
    });
    let (usage, complete) = outcome
        .lock()
        .unwrap()
        .take()
        .expect("settled exactly once");
    Observed {
        out,
        usage,
        complete,
    }
}

fn events(bytes: &[u8]) -> (Vec<Bytes>, Bytes) {
    let mut s = SseScanner::new();
    s.feed(bytes).expect("small");
    let mut out = Vec::new();
    while let Some(e) = s.next_event() {
        out.push(e);
    }
    (out, s.take_rest())
}

/// What an SSE client dispatches from `bytes`, read independently of the gateway's scanner,
/// as the WHATWG EventSource algorithm does: lines end at CRLF, LF or a lone CR; `data` fields
/// append their value and a LF; a blank line dispatches the buffer (minus its last LF) when it
/// is not empty. Returns the dispatched data and whether a partial event was left over.
fn client_view(bytes: &[u8]) -> (Vec<Vec<u8>>, bool) {
    let mut out = Vec::new();
    let mut buf: Vec<u8> = Vec::new();
    let mut has_data = false;
    let mut line: Vec<u8> = Vec::new();
    let mut line_open = false;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'\r' || b == b'\n' {
            if b == b'\r' && bytes.get(i + 1) == Some(&b'\n') {
                i += 1;
            }
            if line.is_empty() {
                if has_data {
                    buf.pop();
                    out.push(std::mem::take(&mut buf));
                }
                buf.clear();
                has_data = false;
            } else if line.first() != Some(&b':') {
                let (field, value) = match line.iter().position(|c| *c == b':') {
                    Some(p) => {
                        let v = &line[p + 1..];
                        (&line[..p], v.strip_prefix(b" ").unwrap_or(v))
                    }
                    None => (&line[..], &[][..]),
                };
                if field == b"data" {
                    buf.extend_from_slice(value);
                    buf.push(b'\n');
                    has_data = true;
                }
            }
            line.clear();
            line_open = false;
        } else {
            line.push(b);
            line_open = true;
        }
        i += 1;
    }
    (out, has_data || line_open)
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let flags = data[0];
    let nsplits = usize::from(data[1] % 16);
    let cut = (2 + 2 * nsplits).min(data.len());
    let (cuts, stream) = (&data[2..cut], &data[cut..]);
    let edits = Edits {
        rename_model: (flags & 1 != 0).then(|| "client-\"model\"".to_string()),
        strip_usage: flags & 2 != 0,
        fill_id: (flags & 4 != 0).then(|| "chatcmpl-fuzz".to_string()),
        normalize_finish: flags & 8 != 0,
        redact: None,
        issue_ids: None,
    };
    let stream = Bytes::copy_from_slice(stream);

    let whole = observe(vec![stream.clone()], &edits);

    // Split where the input says.
    let mut points: Vec<usize> = cuts
        .chunks(2)
        .map(|c| {
            let v = usize::from(c[0]) << 8 | usize::from(*c.get(1).unwrap_or(&0));
            if stream.is_empty() {
                0
            } else {
                v % (stream.len() + 1)
            }
        })
        .collect();
    points.sort_unstable();
    points.dedup();
    let mut chunks = Vec::new();
    let mut at = 0;
    for p in points {
        if p > at {
            chunks.push(stream.slice(at..p));
            at = p;
        }
    }
    if at < stream.len() {
        chunks.push(stream.slice(at..));
    }
    let split = observe(chunks, &edits);
    assert_eq!(whole, split, "split at chosen points differs");

    if stream.len() <= 512 {
        let bytewise = (0..stream.len()).map(|i| stream.slice(i..i + 1)).collect();
        assert_eq!(whole, observe(bytewise, &edits), "byte-by-byte differs");
    }

    // What the client gets is well-formed.
    let (out_events, rest) = events(&whole.out);
    // Blank lines after the last event are harmless; anything else would be half an event.
    assert!(
        rest.iter().all(|b| *b == b'\n' || *b == b'\r'),
        "unterminated tail sent: {rest:?}"
    );
    // ... and reads, for a client with its own SSE parser, as JSON events and then [DONE].
    let (dispatched, partial) = client_view(&whole.out);
    assert!(!partial, "a client is left with half an event");
    let mut done = false;
    for d in &dispatched {
        if d == b"[DONE]" {
            done = true;
        } else if !done {
            serde_json::from_slice::<serde::de::IgnoredAny>(d).unwrap_or_else(|err| {
                panic!(
                    "non-JSON data sent ({err}): {:?}",
                    String::from_utf8_lossy(d)
                )
            });
        }
    }
    assert!(
        done,
        "no [DONE] sent: {:?}",
        String::from_utf8_lossy(&whole.out)
    );
    // The gateway reads its own output as the client does.
    let ours: Vec<Vec<u8>> = out_events.iter().filter_map(|e| event_data(e)).collect();
    assert_eq!(
        ours, dispatched,
        "the gateway and a client read the stream differently"
    );

    if edits.is_passthrough() {
        let (in_events, _) = events(&stream);
        let n = in_events
            .iter()
            .zip(&out_events)
            .take_while(|(a, b)| a == b)
            .count();
        let extra = &out_events[n..];
        let interrupted = extra
            .first()
            .and_then(|e| event_data(e))
            .is_some_and(|d| d.windows(26).any(|w| w == b"backend_stream_interrupted"));
        if interrupted {
            assert!(!whole.complete);
            assert_eq!(extra.len(), 2, "interruption is an error and [DONE]");
        } else {
            // All the backend's events, plus at most its cut last event and a [DONE].
            assert!(
                n == in_events.len(),
                "events lost: {:?}",
                String::from_utf8_lossy(&whole.out)
            );
            assert!(extra.len() <= 2);
        }
    }
});
