//! The workload trace: one JSON line per answered request for `sluice plan` — arrival time,
//! model, API, token counts, the shared-prefix fingerprint, the backend that answered and the
//! latencies the gateway measured (for the planner's self-check); never any text.
//!
//! Invariants: the request path only formats a short line and `try_send`s it to a bounded
//! channel (a full channel drops the line and counts it); one writer thread appends to the
//! file, flushing whenever the channel is drained.

use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::time::Duration;

/// Lines waiting for the writer at most.
const BACKLOG: usize = 65_536;

/// One trace record (field names are the trace format, see docs/capacity-planning.md).
#[derive(Debug, Clone, serde::Serialize)]
pub struct TraceLine<'a> {
    /// Arrival, seconds since the Unix epoch.
    pub ts: f64,
    pub model: &'a str,
    pub api: &'a str,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Prompt tokens the backend reported as cached (0 when it did not say).
    pub cached_tokens: u64,
    /// The shared prefix's fingerprint, 16 hex digits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    pub prefix_tokens: u64,
    /// The output the request asked for at most (`max_tokens` × `n`), if it set one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    /// The backend that answered (the one a continued stream started on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<&'a str>,
    /// Milliseconds from arrival at the gateway to the first token (streams only: a whole
    /// answer's first byte is its last).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_ms: Option<f64>,
    /// Milliseconds per output token after the first: (end − first token) / (tokens − 1), for
    /// complete streams of two tokens or more that one backend produced.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpot_ms: Option<f64>,
    /// Milliseconds from arrival to the end of the answer (every answer).
    pub duration_ms: f64,
}

/// Milliseconds per output token after the first, from the time to the first token and to
/// the end (`None` with fewer than two tokens: there is no time between tokens to measure).
pub fn tpot_ms(ttft: Duration, elapsed: Duration, completion_tokens: u64) -> Option<f64> {
    (completion_tokens >= 2).then(|| {
        elapsed.saturating_sub(ttft).as_secs_f64() * 1000.0 / (completion_tokens - 1) as f64
    })
}

/// The handle requests write through.
#[derive(Debug)]
pub struct TraceWriter {
    tx: SyncSender<String>,
    dropped: AtomicU64,
}

impl TraceWriter {
    /// Open (append to) `path` and start the writer thread.
    pub fn open(path: &Path) -> std::io::Result<TraceWriter> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let (tx, rx) = sync_channel::<String>(BACKLOG);
        std::thread::Builder::new()
            .name("sluice-trace".into())
            .spawn(move || {
                let mut out = std::io::BufWriter::new(file);
                while let Ok(line) = rx.recv() {
                    let mut ok = out.write_all(line.as_bytes()).is_ok();
                    while let Ok(line) = rx.try_recv() {
                        ok &= out.write_all(line.as_bytes()).is_ok();
                    }
                    if !(ok && out.flush().is_ok()) {
                        tracing::warn!("cannot write the workload trace");
                    }
                }
            })?;
        Ok(TraceWriter {
            tx,
            dropped: AtomicU64::new(0),
        })
    }

    /// Queue one record; never blocks.
    pub fn record(&self, line: &TraceLine<'_>) {
        let Ok(mut text) = serde_json::to_string(line) else {
            return;
        };
        text.push('\n');
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(text) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Records dropped because the writer fell behind.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tpot_is_the_time_after_the_first_token_per_later_token() {
        let ms = Duration::from_millis;
        assert_eq!(tpot_ms(ms(100), ms(1100), 11), Some(100.0));
        assert_eq!(tpot_ms(ms(100), ms(100), 1), None);
        assert_eq!(tpot_ms(ms(300), ms(200), 3), Some(0.0));
    }
}
