//! What each engine reports of its own timing, kept as windows for the profile that
//! `sluice plan` reads (`GET /admin/profile`).
//!
//! Every signals scrape of a vLLM backend reads its cumulative counters ([`Counters`]); the
//! change since the previous scrape is one [`Window`] of steps, tokens, inter-token gaps and
//! prefill times. [`crate::batching::fit`] turns the windows into the engine's step costs.
//!
//! Invariants:
//! - a window is only ever the difference of two scrapes of the same engine process: a counter
//!   that went down (the engine restarted) starts over from the new reading;
//! - idle windows (no step) are not kept, and at most [`KEPT`] windows are, oldest dropped
//!   first, so memory per backend is bounded whatever the uptime;
//! - an engine that does not report the step histogram (older vLLM, other kinds) has no
//!   windows, and its profile falls back to the gateway's own timings.

use std::collections::VecDeque;
use std::sync::Mutex;

use crate::batching::fit::Window;

use super::prom::{self, Sample};

/// Windows kept per backend (an hour at the default one-second scrape: 72 bytes each, about
/// 260 KB per backend).
pub const KEPT: usize = 3_600;

/// An engine's cumulative timing counters at one scrape: the totals since it started, in the
/// shape of a [`Window`] whose `at` is when they were read.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters(Window);

impl Counters {
    /// vLLM's counters, summed over engines and models; `None` when the exposition has no
    /// step histogram (`vllm:iteration_tokens_total`).
    pub fn from_vllm(samples: &[Sample], at: f64) -> Option<Counters> {
        let all = |name: &str| prom::sum(samples, name, |_| true);
        let total = |name: &str| all(name).unwrap_or(0.0);
        let steps = all("vllm:iteration_tokens_total_count")?;
        let computed = prom::sum(samples, "vllm:prompt_tokens_by_source_total", |s| {
            s.label("source") == Some("local_compute")
        })
        .unwrap_or_else(|| {
            total("vllm:prompt_tokens_total") - total("vllm:prefix_cache_hits_total")
        });
        Some(Counters(Window {
            at,
            steps,
            generated: total("vllm:generation_tokens_total"),
            prompt_computed: computed.max(0.0),
            itl_sum: total("vllm:inter_token_latency_seconds_sum"),
            itl_count: total("vllm:inter_token_latency_seconds_count"),
            prefill_sum: total("vllm:request_prefill_time_seconds_sum"),
            prefill_count: total("vllm:request_prefill_time_seconds_count"),
            prefill_tokens: total("vllm:request_prefill_kv_computed_tokens_sum"),
        }))
    }

    /// The totals read.
    pub fn totals(&self) -> &Window {
        &self.0
    }

    /// The change from `prev` to `self`; `None` when a counter went down (a restart).
    fn since(&self, prev: &Counters) -> Option<Window> {
        let (now, prev) = (&self.0, &prev.0);
        let d = |a: f64, b: f64| (a >= b).then_some(a - b);
        Some(Window {
            at: prev.at,
            steps: d(now.steps, prev.steps)?,
            generated: d(now.generated, prev.generated)?,
            prompt_computed: d(now.prompt_computed, prev.prompt_computed)?,
            itl_sum: d(now.itl_sum, prev.itl_sum)?,
            itl_count: d(now.itl_count, prev.itl_count)?,
            prefill_sum: d(now.prefill_sum, prev.prefill_sum)?,
            prefill_count: d(now.prefill_count, prev.prefill_count)?,
            prefill_tokens: d(now.prefill_tokens, prev.prefill_tokens)?,
        })
    }
}

/// One backend's windows.
#[derive(Debug, Default)]
pub struct Timings {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    last: Option<Counters>,
    windows: VecDeque<Window>,
}

impl Timings {
    /// Take one scrape's counters: the window since the previous one is kept if the engine
    /// stepped in it.
    pub fn observe(&self, now: Counters) {
        let Ok(mut g) = self.inner.lock() else {
            return;
        };
        let window = g.last.as_ref().and_then(|prev| now.since(prev));
        g.last = Some(now);
        if let Some(w) = window.filter(|w| w.steps > 0.0) {
            if g.windows.len() >= KEPT {
                g.windows.pop_front();
            }
            g.windows.push_back(w);
        }
    }

    /// The kept windows, oldest first.
    pub fn windows(&self) -> Vec<Window> {
        self.inner
            .lock()
            .map(|g| g.windows.iter().copied().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vllm(steps: f64, generated: f64, itl: (f64, f64), prefill: (f64, f64, f64)) -> String {
        format!(
            "vllm:iteration_tokens_total_count{{engine=\"0\",model_name=\"m\"}} {steps}\n\
             vllm:generation_tokens_total{{engine=\"0\",model_name=\"m\"}} {generated}\n\
             vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"local_compute\"}} 500.0\n\
             vllm:prompt_tokens_by_source_total{{engine=\"0\",model_name=\"m\",source=\"local_cache_hit\"}} 99.0\n\
             vllm:inter_token_latency_seconds_sum{{engine=\"0\",model_name=\"m\"}} {}\n\
             vllm:inter_token_latency_seconds_count{{engine=\"0\",model_name=\"m\"}} {}\n\
             vllm:request_prefill_time_seconds_sum{{engine=\"0\",model_name=\"m\"}} {}\n\
             vllm:request_prefill_time_seconds_count{{engine=\"0\",model_name=\"m\"}} {}\n\
             vllm:request_prefill_kv_computed_tokens_sum{{engine=\"0\",model_name=\"m\"}} {}\n",
            itl.0, itl.1, prefill.0, prefill.1, prefill.2
        )
    }

    fn read(text: &str, at: f64) -> Counters {
        Counters::from_vllm(&prom::parse(text), at).expect("has the step histogram")
    }

    #[test]
    fn a_window_is_the_change_between_two_scrapes() {
        let t = Timings::default();
        t.observe(read(&vllm(10.0, 40.0, (0.5, 30.0), (0.2, 2.0, 400.0)), 1.0));
        t.observe(read(
            &vllm(25.0, 100.0, (1.4, 80.0), (0.5, 5.0, 1000.0)),
            2.0,
        ));
        let w = t.windows();
        assert_eq!(w.len(), 1);
        let w = w[0];
        assert_eq!((w.at, w.steps, w.generated), (1.0, 15.0, 60.0));
        assert!((w.itl_sum - 0.9).abs() < 1e-12 && w.itl_count == 50.0);
        assert_eq!((w.prefill_count, w.prefill_tokens), (3.0, 600.0));
        assert_eq!(w.prompt_computed, 0.0, "only local_compute counts");
    }

    #[test]
    fn idle_windows_and_restarts_keep_nothing() {
        let t = Timings::default();
        t.observe(read(&vllm(10.0, 40.0, (0.5, 30.0), (0.2, 2.0, 400.0)), 1.0));
        t.observe(read(&vllm(10.0, 40.0, (0.5, 30.0), (0.2, 2.0, 400.0)), 2.0));
        // the engine restarted: its counters start again from zero
        t.observe(read(&vllm(3.0, 6.0, (0.1, 3.0), (0.0, 0.0, 0.0)), 3.0));
        assert!(t.windows().is_empty());
        t.observe(read(&vllm(5.0, 10.0, (0.2, 5.0), (0.0, 0.0, 0.0)), 4.0));
        assert_eq!(t.windows().len(), 1, "the restart is the new baseline");
    }

    #[test]
    fn memory_is_bounded() {
        let t = Timings::default();
        for i in 0..(KEPT + 50) {
            let n = i as f64;
            t.observe(read(&vllm(n, n, (n, n), (0.0, 0.0, 0.0)), n));
        }
        let w = t.windows();
        assert_eq!(w.len(), KEPT);
        assert_eq!(w[0].at, 49.0, "oldest dropped first");
    }

    #[test]
    fn an_engine_without_the_step_histogram_reports_nothing() {
        let s = prom::parse("vllm:num_requests_running{model_name=\"m\"} 1\n");
        assert_eq!(Counters::from_vllm(&s, 0.0), None);
    }

    #[test]
    fn the_real_vllm_capture_reads() {
        let text = include_str!("../../tests/fixtures/vllm-0.32.0/metrics-under-load.txt");
        let c = Counters::from_vllm(&prom::parse(text), 0.0).expect("0.32 reports steps");
        let t = c.totals();
        assert!(
            t.steps > 0.0 && t.generated > 0.0 && t.prompt_computed > 0.0,
            "{c:?}"
        );
    }
}
