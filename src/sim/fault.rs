//! Run-time faults: the [`Fault`] value, its validation, and the shared [`FaultState`] every
//! request consults; plus the `POST /sim/fault` body parser.
//!
//! Invariants: the active fault is swapped atomically (readers never see a half-written fault);
//! a fault with `seconds > 0` in mode `loading` or `refuse` reverts to `healthy` by itself once
//! the time is up; every change wakes the requests parked by `hang`, so they re-check the mode.
//! The `/sim/*` control routes are never subject to a fault. The KV-event faults (`kv_skip`,
//! `kv_lost`) touch only the vLLM simulator's event publisher; requests are served normally.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// The fault modes of the control contract.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultMode {
    /// Normal behaviour.
    Healthy,
    /// Accept requests (inference and health) and never answer them while the mode lasts.
    Hang,
    /// Multiply every delay of the timing model by `factor` (plus an optional fixed `delay_ms`).
    Slow,
    /// Answer a fraction `rate` of inference requests with the engine's own 5xx; health passes.
    ErrorRate,
    /// Cut the connection abruptly after `after_chunks` chunks of a stream.
    DropMidstream,
    /// Answer inference with the engine's own overload response.
    Overloaded,
    /// Health checks fail while inference works.
    HealthFail,
    /// The model is loading: health fails and inference is unavailable (vLLM, TGI); Ollama
    /// unloads its models and the next request pays `seconds` of load time.
    Loading,
    /// Reset every new connection (except control requests) and close kept-alive ones.
    Refuse,
    /// The KV-event publisher does not send the batches numbered `seqs` (they are still kept
    /// for replay, so a subscriber can fill the gap).
    KvSkip,
    /// As `kv_skip`, and replay answers nothing at all: the gap cannot be filled.
    KvLost,
}

impl FaultMode {
    /// The contract name of the mode.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultMode::Healthy => "healthy",
            FaultMode::Hang => "hang",
            FaultMode::Slow => "slow",
            FaultMode::ErrorRate => "error_rate",
            FaultMode::DropMidstream => "drop_midstream",
            FaultMode::Overloaded => "overloaded",
            FaultMode::HealthFail => "health_fail",
            FaultMode::Loading => "loading",
            FaultMode::Refuse => "refuse",
            FaultMode::KvSkip => "kv_skip",
            FaultMode::KvLost => "kv_lost",
        }
    }
}

impl fmt::Display for FaultMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FaultMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        serde_json::from_value(serde_json::Value::String(s.to_string())).map_err(|_| {
            format!(
                "unknown fault mode `{s}` (expected healthy, hang, slow, error_rate, \
                 drop_midstream, overloaded, health_fail, loading, refuse, kv_skip or kv_lost)"
            )
        })
    }
}

/// A fault and its parameters.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fault {
    /// The mode.
    pub mode: FaultMode,
    /// `slow`: latency multiplier (default 10).
    pub factor: f64,
    /// `error_rate`: fraction of inference requests answered with a 5xx (default 1.0).
    pub rate: f64,
    /// `drop_midstream`: chunks sent before the cut (default 1).
    pub after_chunks: u32,
    /// `loading`: load duration (default 5 s); `refuse`: duration, 0 = until set healthy.
    pub seconds: f64,
    /// `slow`: fixed delay in milliseconds added before answering (works even at speed 0).
    pub delay_ms: u64,
    /// `kv_skip`, `kv_lost`: the sequence numbers of the event batches not sent.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub seqs: Vec<i64>,
}

/// Most sequence numbers a KV-event fault may list.
const MAX_SEQS: usize = 10_000;

impl Fault {
    /// No fault.
    pub fn healthy() -> Fault {
        Fault::from_parts(FaultMode::Healthy, None, None, None, None, None)
    }

    /// A fault of `mode` with the given parameters (absent = default).
    pub fn from_parts(
        mode: FaultMode,
        factor: Option<f64>,
        rate: Option<f64>,
        after_chunks: Option<u32>,
        seconds: Option<f64>,
        delay_ms: Option<u64>,
    ) -> Fault {
        Fault {
            mode,
            factor: factor.unwrap_or(10.0),
            rate: rate.unwrap_or(1.0),
            after_chunks: after_chunks.unwrap_or(1),
            seconds: seconds.unwrap_or(if mode == FaultMode::Loading { 5.0 } else { 0.0 }),
            delay_ms: delay_ms.unwrap_or(0),
            seqs: Vec::new(),
        }
    }

    /// This fault with the KV-event batches `seqs` left unsent (`kv_skip`, `kv_lost`).
    pub fn with_seqs(mut self, seqs: Vec<i64>) -> Fault {
        self.seqs = seqs;
        self
    }

    /// Shorthand for `Fault::from_parts(mode, None, …)`.
    pub fn mode(mode: FaultMode) -> Fault {
        Fault::from_parts(mode, None, None, None, None, None)
    }

    /// Check the parameter ranges.
    pub fn validate(&self) -> Result<(), String> {
        if !self.factor.is_finite() || self.factor < 0.0 {
            return Err(format!(
                "factor must be a finite number >= 0, got {}",
                self.factor
            ));
        }
        if !(0.0..=1.0).contains(&self.rate) {
            return Err(format!("rate must be between 0 and 1, got {}", self.rate));
        }
        if !self.seconds.is_finite() || self.seconds < 0.0 || self.seconds > 1.0e6 {
            return Err(format!(
                "seconds must be between 0 and 1e6, got {}",
                self.seconds
            ));
        }
        if self.seqs.len() > MAX_SEQS || self.seqs.iter().any(|s| *s < 0) {
            return Err(format!(
                "seqs must be at most {MAX_SEQS} sequence numbers >= 0"
            ));
        }
        Ok(())
    }
}

/// The body of `POST /sim/fault`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FaultRequest {
    mode: FaultMode,
    factor: Option<f64>,
    rate: Option<f64>,
    after_chunks: Option<u32>,
    seconds: Option<f64>,
    delay_ms: Option<u64>,
    seqs: Option<Vec<i64>>,
}

impl FaultRequest {
    pub(crate) fn into_fault(self) -> Result<Fault, String> {
        let f = Fault::from_parts(
            self.mode,
            self.factor,
            self.rate,
            self.after_chunks,
            self.seconds,
            self.delay_ms,
        )
        .with_seqs(self.seqs.unwrap_or_default());
        f.validate()?;
        Ok(f)
    }
}

struct Active {
    fault: Fault,
    until: Option<Instant>,
    since: Instant,
}

/// The active fault, shared by every connection of one simulator.
pub(crate) struct FaultState {
    active: ArcSwap<Active>,
    changed: Notify,
}

impl FaultState {
    pub(crate) fn new(fault: Fault) -> FaultState {
        FaultState {
            active: ArcSwap::from_pointee(Self::activate(fault)),
            changed: Notify::new(),
        }
    }

    fn activate(fault: Fault) -> Active {
        let now = Instant::now();
        let until = match fault.mode {
            FaultMode::Loading | FaultMode::Refuse if fault.seconds > 0.0 => {
                Some(now + Duration::from_secs_f64(fault.seconds))
            }
            _ => None,
        };
        Active {
            fault,
            until,
            since: now,
        }
    }

    /// Replace the active fault and wake parked requests.
    pub(crate) fn set(&self, fault: Fault) {
        self.active.store(Arc::new(Self::activate(fault)));
        self.changed.notify_waiters();
    }

    /// The active fault (an expired `loading`/`refuse` reads as healthy).
    pub(crate) fn current(&self) -> Fault {
        let a = self.active.load();
        if a.fault.mode == FaultMode::Healthy {
            return a.fault.clone();
        }
        match a.until {
            Some(t) if Instant::now() >= t => Fault::healthy(),
            _ => a.fault.clone(),
        }
    }

    /// The active mode, cheaply (hot path).
    pub(crate) fn mode(&self) -> FaultMode {
        let a = self.active.load();
        match (a.fault.mode, a.until) {
            (FaultMode::Healthy, _) => FaultMode::Healthy,
            (m, Some(t)) => {
                if Instant::now() >= t {
                    FaultMode::Healthy
                } else {
                    m
                }
            }
            (m, None) => m,
        }
    }

    /// When the active fault was set, and how long a `loading` fault has left.
    pub(crate) fn since_and_remaining(&self) -> (Duration, Option<Duration>) {
        let a = self.active.load();
        let now = Instant::now();
        (
            now.saturating_duration_since(a.since),
            a.until.map(|t| t.saturating_duration_since(now)),
        )
    }

    /// The latency multiplier of the `slow` fault (1 otherwise).
    pub(crate) fn slow_factor(&self) -> f64 {
        let a = self.active.load();
        if a.fault.mode == FaultMode::Slow {
            a.fault.factor
        } else {
            1.0
        }
    }

    /// Park while the mode is `hang`; returns when the mode changes.
    pub(crate) async fn wait_while_hang(&self) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.mode() != FaultMode::Hang {
                return;
            }
            notified.await;
        }
    }

    /// Whether the KV-event publisher leaves batch `seq` unsent (`kv_skip`, `kv_lost`).
    pub(crate) fn kv_skips(&self, seq: i64) -> bool {
        let a = self.active.load();
        matches!(a.fault.mode, FaultMode::KvSkip | FaultMode::KvLost) && a.fault.seqs.contains(&seq)
    }

    /// Whether replay requests go unanswered (`kv_lost`).
    pub(crate) fn kv_replay_silent(&self) -> bool {
        self.active.load().fault.mode == FaultMode::KvLost
    }

    /// Whether this inference request should fail under `error_rate`.
    pub(crate) fn roll_error(&self) -> bool {
        let a = self.active.load();
        a.fault.mode == FaultMode::ErrorRate && rand::random::<f64>() < a.fault.rate
    }
}
