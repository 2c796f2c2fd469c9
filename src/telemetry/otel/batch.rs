//! The span queue between the request path and the OTLP exporter: a bounded channel that a
//! finished span is put into without waiting, and one task on the main runtime that sends
//! the spans in batches.
//!
//! Invariants: a request never waits for export — a span that finds the queue full is
//! dropped and counted (`sluice_otel_spans_dropped_total{reason="queue_full"}`), and so are
//! the spans of a batch the collector did not take (`reason="export_failed"`); a warning is
//! logged at most once per [`WARN_EVERY`] whatever the number of drops. Exports run one at a
//! time, each bounded by the exporter's timeout.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;
use tokio::sync::mpsc;

use crate::telemetry::metrics as m;

/// Most spans sent in one export.
const MAX_BATCH: usize = 512;
/// Fewest seconds between two warnings about dropped spans.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// The processor the tracer provider ends spans into.
#[derive(Debug)]
pub struct Batcher<E> {
    tx: mpsc::Sender<SpanData>,
    shared: Arc<Shared<E>>,
}

/// What the processor and its export task share.
#[derive(Debug)]
struct Shared<E> {
    /// The exporter until the task takes it ([`Batcher::start`]).
    exporter: Mutex<Option<E>>,
    rx: Mutex<Option<mpsc::Receiver<SpanData>>>,
    warned: Warner,
}

impl<E: SpanExporter + 'static> Batcher<E> {
    /// A queue of `capacity` spans in front of `exporter`; nothing is sent before [`start`].
    ///
    /// [`start`]: Batcher::start
    pub fn new(exporter: E, capacity: usize) -> Batcher<E> {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        let shared = Arc::new(Shared {
            exporter: Mutex::new(Some(exporter)),
            rx: Mutex::new(Some(rx)),
            warned: Warner::default(),
        });
        Batcher { tx, shared }
    }

    /// A handle that starts the export task once the provider gave the exporter its resource.
    pub fn starter(&self) -> Starter<E> {
        Starter(self.shared.clone())
    }
}

/// Starts the export task of a [`Batcher`].
pub struct Starter<E>(Arc<Shared<E>>);

impl<E: SpanExporter + 'static> Starter<E> {
    /// Spawn the export task on `runtime`, sending a batch when [`MAX_BATCH`] spans are
    /// queued or `interval` has passed since the first of them. It ends when the provider is
    /// dropped (the queue's sender with it), after sending what was queued.
    pub fn start(self, runtime: &tokio::runtime::Handle, interval: Duration) {
        let (Some(exporter), Some(rx)) = (taken(&self.0.exporter), taken(&self.0.rx)) else {
            return;
        };
        let shared = self.0.clone();
        runtime.spawn(export_loop(exporter, rx, interval, shared));
    }
}

/// What a start-once slot holds, taken out of it.
fn taken<T>(slot: &Mutex<Option<T>>) -> Option<T> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).take()
}

async fn export_loop<E: SpanExporter>(
    exporter: E,
    mut rx: mpsc::Receiver<SpanData>,
    interval: Duration,
    shared: Arc<Shared<E>>,
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        let until = tokio::time::Instant::now() + interval;
        while batch.len() < MAX_BATCH {
            match tokio::time::timeout_at(until, rx.recv()).await {
                Ok(Some(span)) => batch.push(span),
                Ok(None) | Err(_) => break,
            }
        }
        let n = batch.len() as u64;
        let sent = std::mem::replace(&mut batch, Vec::with_capacity(MAX_BATCH));
        match exporter.export(sent).await {
            Ok(()) => metrics::counter!(m::OTEL_SPANS_EXPORTED_TOTAL).increment(n),
            Err(e) => shared.warned.dropped("export_failed", n, &e),
        }
    }
}

impl<E: SpanExporter + 'static> SpanProcessor for Batcher<E> {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if let Err(e) = self.tx.try_send(span) {
            let why = match e {
                mpsc::error::TrySendError::Full(_) => "the span queue is full",
                mpsc::error::TrySendError::Closed(_) => "the exporter stopped",
            };
            self.shared.warned.dropped("queue_full", 1, &why);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }

    fn set_resource(&mut self, resource: &Resource) {
        let mut exporter = self
            .shared
            .exporter
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(e) = exporter.as_mut() {
            e.set_resource(resource);
        }
    }
}

/// Counts dropped spans and warns about them at most once per [`WARN_EVERY`].
#[derive(Debug, Default)]
struct Warner {
    /// Milliseconds since `epoch` of the last warning (0: none yet).
    last_ms: AtomicU64,
    epoch: std::sync::OnceLock<Instant>,
}

impl Warner {
    fn dropped(&self, reason: &'static str, n: u64, why: &dyn std::fmt::Display) {
        metrics::counter!(m::OTEL_SPANS_DROPPED_TOTAL, "reason" => reason).increment(n);
        let epoch = *self.epoch.get_or_init(Instant::now);
        if self.due(epoch.elapsed().as_millis() as u64 + 1) {
            tracing::warn!(
                reason,
                "OpenTelemetry spans dropped ({why}); counted in {} (warned at most once a minute)",
                m::OTEL_SPANS_DROPPED_TOTAL
            );
        }
    }

    /// Whether a warning is due at `now_ms` (milliseconds since `epoch`, from 1), claimed by
    /// the one caller that gets `true` until [`WARN_EVERY`] has passed.
    fn due(&self, now_ms: u64) -> bool {
        let last = self.last_ms.load(Ordering::Relaxed);
        let due = last == 0 || now_ms.saturating_sub(last) >= WARN_EVERY.as_millis() as u64;
        due && self
            .last_ms
            .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use opentelemetry::trace::{Span as _, Tracer as _, TracerProvider as _};
    use opentelemetry_sdk::trace::SdkTracerProvider;

    use super::*;

    /// Counts the spans it was given; fails every export when `failing`.
    #[derive(Debug, Clone, Default)]
    struct Counting {
        spans: Arc<AtomicUsize>,
        failing: bool,
    }

    impl SpanExporter for Counting {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            self.spans.fetch_add(batch.len(), Ordering::Relaxed);
            if self.failing {
                return Err(opentelemetry_sdk::error::OTelSdkError::InternalFailure(
                    "down".into(),
                ));
            }
            Ok(())
        }
    }

    fn provider(exporter: Counting, capacity: usize) -> (SdkTracerProvider, Starter<Counting>) {
        let batcher = Batcher::new(exporter, capacity);
        let starter = batcher.starter();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batcher)
            .build();
        (provider, starter)
    }

    async fn until(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn a_full_queue_drops_without_waiting_and_the_rest_is_sent() {
        let exporter = Counting::default();
        let (provider, starter) = provider(exporter.clone(), 2);
        let tracer = provider.tracer("t");
        // Nothing drains the queue yet: the third span finds it full and is dropped at once.
        for _ in 0..3 {
            tracer.start("s").end();
        }
        starter.start(&tokio::runtime::Handle::current(), Duration::from_millis(5));
        until("two spans exported", || {
            exporter.spans.load(Ordering::Relaxed) == 2
        })
        .await;
        tracer.start("later").end();
        until("a third", || exporter.spans.load(Ordering::Relaxed) == 3).await;
    }

    #[test]
    fn a_warning_is_due_once_per_interval_whoever_asks() {
        let w = Warner::default();
        let every = WARN_EVERY.as_millis() as u64;
        assert!(w.due(1), "the first drop warns");
        assert!(!w.due(2));
        assert!(!w.due(every));
        assert!(w.due(every + 1), "a whole interval later");
        assert!(!w.due(every + 2));
        // Many threads dropping at the same moment: one of them warns.
        let at = 3 * every;
        let warned = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8).map(|_| s.spawn(|| w.due(at))).collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or(false))
                .filter(|&warned| warned)
                .count()
        });
        assert_eq!(warned, 1);
    }

    #[tokio::test]
    async fn a_failing_collector_costs_the_spans_only() {
        let exporter = Counting {
            failing: true,
            ..Counting::default()
        };
        let (provider, starter) = provider(exporter.clone(), 64);
        starter.start(&tokio::runtime::Handle::current(), Duration::from_millis(5));
        let tracer = provider.tracer("t");
        for _ in 0..20 {
            tracer.start("s").end();
        }
        // Every batch was tried and dropped; the loop goes on with the next ones.
        until("twenty spans tried", || {
            exporter.spans.load(Ordering::Relaxed) == 20
        })
        .await;
    }
}
