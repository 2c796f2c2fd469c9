//! What each engine reports of its own timing, kept as windows for the profile that
//! `sluice plan` reads (`GET /admin/profile`).
//!
//! Every signals scrape of a vLLM or TGI backend reads its cumulative counters ([`Counters`]);
//! the change since the previous scrape is one [`Window`] of steps, tokens, inter-token gaps
//! and prefill times. [`crate::batching::fit`] turns the windows into the engine's step costs.
//!
//! vLLM reports steps, tokens and per-request prefill times ([`Counters::from_vllm`]): one
//! window per scrape. TGI reports its prefill and decode forward passes apart
//! ([`Counters::from_tgi`]): a decode window per scrape and a prefill window per chunk of
//! scrapes that ends with its queue empty (see `tgi`).
//!
//! Invariants:
//! - a window is only ever the difference of two scrapes of the same engine process: a counter
//!   that went down (the engine restarted) starts over from the new reading;
//! - idle windows (no step) are not kept, and at most [`KEPT`] windows are, oldest dropped
//!   first, so memory per backend is bounded whatever the uptime;
//! - an engine that does not report its step or forward-pass histograms (an older vLLM, Ollama,
//!   a plain OpenAI-compatible server) has no windows, and its profile falls back to the
//!   gateway's own timings.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::batching::fit::Window;

use super::prom::{self, Sample};

mod tgi;

pub use tgi::TgiTotals;

/// Windows kept per backend (an hour at the default one-second scrape: 72 bytes each, about
/// 260 KB per backend).
pub const KEPT: usize = 3_600;

/// An engine's cumulative timing counters at one scrape: the totals since it started, read
/// at `at`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Counters {
    /// vLLM's, in the shape of a [`Window`].
    Vllm(Window),
    Tgi(TgiTotals),
}

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
        Some(Counters::Vllm(Window {
            at,
            steps,
            generated: total("vllm:generation_tokens_total"),
            prompt_computed: computed.max(0.0),
            itl_sum: total("vllm:inter_token_latency_seconds_sum"),
            itl_count: total("vllm:inter_token_latency_seconds_count"),
            prefill_sum: total("vllm:request_prefill_time_seconds_sum"),
            prefill_count: total("vllm:request_prefill_time_seconds_count"),
            prefill_tokens: total("vllm:request_prefill_kv_computed_tokens_sum"),
            queue_sum: total("vllm:request_queue_time_seconds_sum"),
            queue_count: total("vllm:request_queue_time_seconds_count"),
            inference_sum: total("vllm:request_inference_time_seconds_sum"),
            inference_count: total("vllm:request_inference_time_seconds_count"),
            ..Window::default()
        }))
    }

    /// TGI's counters; `None` when the exposition has no forward-pass histogram
    /// (`tgi_batch_forward_duration`).
    pub fn from_tgi(samples: &[Sample], at: f64) -> Option<Counters> {
        TgiTotals::read(samples, at).map(Counters::Tgi)
    }
}

/// `a - b` of a counter that must not go down.
fn delta(a: f64, b: f64) -> Option<f64> {
    (a >= b).then_some(a - b)
}

/// The change of vLLM's totals from `prev` to `now`; `None` when a counter went down (a
/// restart).
fn vllm_window(now: &Window, prev: &Window) -> Option<Window> {
    let d = delta;
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
        queue_sum: d(now.queue_sum, prev.queue_sum)?,
        queue_count: d(now.queue_count, prev.queue_count)?,
        inference_sum: d(now.inference_sum, prev.inference_sum)?,
        inference_count: d(now.inference_count, prev.inference_count)?,
        ..Window::default()
    })
}

/// One backend's windows.
#[derive(Debug, Default)]
pub struct Timings {
    inner: Mutex<Inner>,
    /// The gateway's own times from sending a request here to its last byte: total
    /// nanoseconds, count.
    answers: (AtomicU64, AtomicU64),
    /// Of those, the streamed ones' times to their first token: total nanoseconds, count.
    firsts: (AtomicU64, AtomicU64),
}

#[derive(Debug, Default)]
struct Inner {
    last: Option<Counters>,
    /// TGI's scrapes since its last prefill window.
    chunk: tgi::Chunk,
    /// The gateway's answer totals (to the last byte, to the first token) already put in a
    /// window.
    answers_kept: [(u64, u64); 2],
    windows: VecDeque<Window>,
}

impl Inner {
    fn keep(&mut self, w: Window) {
        if self.windows.len() >= KEPT {
            self.windows.pop_front();
        }
        self.windows.push_back(w);
    }
}

impl Timings {
    /// Take one scrape's counters: the window since the previous one is kept if the engine
    /// stepped in it.
    pub fn observe(&self, now: Counters) {
        let Ok(mut g) = self.inner.lock() else {
            return;
        };
        let windows = match (g.last, now) {
            (Some(Counters::Vllm(prev)), Counters::Vllm(cur)) => [vllm_window(&cur, &prev), None],
            (Some(Counters::Tgi(prev)), Counters::Tgi(cur)) => g.chunk.observe(&prev, &cur),
            _ => [None, None],
        };
        g.last = Some(now);
        let mut first = true;
        for mut w in windows.into_iter().flatten().filter(|w| w.steps > 0.0) {
            if std::mem::take(&mut first) {
                self.add_answers(&mut g, &mut w);
            }
            g.keep(w);
        }
    }

    /// A request's answer ended `took` after it was sent to this backend, its first token
    /// `first` after (streamed answers).
    pub fn answered(&self, took: Duration, first: Option<Duration>) {
        let add = |(sum, n): &(AtomicU64, AtomicU64), d: Duration| {
            sum.fetch_add(
                u64::try_from(d.as_nanos()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
            n.fetch_add(1, Ordering::Relaxed);
        };
        add(&self.answers, took);
        if let Some(first) = first {
            add(&self.firsts, first);
        }
    }

    /// Put the answers timed since the last window that got them into `w`.
    fn add_answers(&self, g: &mut Inner, w: &mut Window) {
        let mut since = |i: usize, (sum, n): &(AtomicU64, AtomicU64)| {
            let now = (sum.load(Ordering::Relaxed), n.load(Ordering::Relaxed));
            let kept = std::mem::replace(&mut g.answers_kept[i], now);
            (
                now.0.saturating_sub(kept.0) as f64 / 1e9,
                now.1.saturating_sub(kept.1) as f64,
            )
        };
        (w.sent_sum, w.sent_count) = since(0, &self.answers);
        (w.first_sum, w.first_count) = since(1, &self.firsts);
    }

    /// The kept windows, oldest first.
    pub fn windows(&self) -> Vec<Window> {
        self.recent(KEPT)
    }

    /// The newest `n` windows, oldest first.
    pub fn recent(&self, n: usize) -> Vec<Window> {
        self.inner
            .lock()
            .map(|g| {
                let skip = g.windows.len().saturating_sub(n);
                g.windows.iter().skip(skip).copied().collect()
            })
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
    fn a_window_holds_the_answers_timed_since_the_one_before() {
        let t = Timings::default();
        t.observe(read(&vllm(10.0, 40.0, (0.5, 30.0), (0.2, 2.0, 400.0)), 1.0));
        let ms = Duration::from_millis;
        t.answered(ms(500), Some(ms(40)));
        t.answered(ms(300), None);
        t.observe(read(&vllm(20.0, 80.0, (1.0, 60.0), (0.4, 4.0, 800.0)), 2.0));
        t.answered(ms(100), Some(ms(20)));
        t.observe(read(
            &vllm(30.0, 120.0, (1.5, 90.0), (0.6, 6.0, 1200.0)),
            3.0,
        ));
        let w = t.windows();
        let got = |w: &Window| (w.sent_sum, w.sent_count, w.first_sum, w.first_count);
        assert_eq!(
            got(&w[0]),
            (0.8, 2.0, 0.04, 1.0),
            "a non-streamed answer has no first"
        );
        assert_eq!(
            got(&w[1]),
            (0.1, 1.0, 0.02, 1.0),
            "each answer in one window only"
        );
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

    /// A TGI exposition: (seconds, passes) of prefill and decode, requests admitted, (prompt
    /// tokens, requests) arrived, and the gauges (running, waiting); one group formed per
    /// prefill pass timed (none in flight).
    fn tgi(
        passes: [(f64, f64); 2],
        admitted: f64,
        input: (f64, f64),
        gauges: (f64, f64),
    ) -> Counters {
        tgi_in_flight(passes, admitted, input, gauges, 0.0)
    }

    fn tgi_in_flight(
        passes: [(f64, f64); 2],
        admitted: f64,
        input: (f64, f64),
        gauges: (f64, f64),
        in_flight: f64,
    ) -> Counters {
        let [(ps, pc), (ds, dc)] = passes;
        let groups = pc + in_flight;
        let text = format!(
            "# TYPE tgi_batch_forward_duration histogram\n\
             tgi_batch_forward_duration_sum{{method=\"prefill\"}} {ps}\n\
             tgi_batch_forward_duration_count{{method=\"prefill\"}} {pc}\n\
             tgi_batch_forward_duration_sum{{method=\"decode\"}} {ds}\n\
             tgi_batch_forward_duration_count{{method=\"decode\"}} {dc}\n\
             tgi_batch_next_size_sum {admitted}\n\
             tgi_batch_next_size_count {groups}\n\
             tgi_request_input_length_sum {}\n\
             tgi_request_input_length_count {}\n\
             tgi_batch_current_size {}\n\
             tgi_queue_size {}\n",
            input.0, input.1, gauges.0, gauges.1
        );
        Counters::from_tgi(&prom::parse(&text), ds).expect("has the forward histogram")
    }

    #[test]
    fn tgi_decode_passes_make_a_window_per_scrape_and_prefill_one_per_drained_chunk() {
        let t = Timings::default();
        t.observe(tgi(
            [(0.5, 4.0), (2.0, 100.0)],
            6.0,
            (1200.0, 6.0),
            (3.0, 0.0),
        ));
        // two requests arrived (1,000 tokens) and one is still waiting: no prefill window yet
        t.observe(tgi(
            [(0.6, 5.0), (2.9, 140.0)],
            7.0,
            (2200.0, 8.0),
            (5.0, 1.0),
        ));
        let w = t.windows();
        assert_eq!(w.len(), 1, "{w:?}");
        // 40 decode passes at a batch of 4 (the gauge's mean), 0.9 s of them, no prefill
        assert_eq!(
            (w[0].steps, w[0].generated, w[0].itl_count),
            (40.0, 160.0, 40.0)
        );
        assert!((w[0].itl_sum - 0.9).abs() < 1e-12);
        assert_eq!((w[0].prefill_count, w[0].prompt_computed), (0.0, 0.0));
        // the queue drained, but the last group's prefill pass is not timed yet
        t.observe(tgi_in_flight(
            [(0.6, 5.0), (3.0, 145.0)],
            8.0,
            (2200.0, 8.0),
            (5.0, 0.0),
            1.0,
        ));
        assert_eq!(t.windows().len(), 2, "only the scrape's decode window");
        // settled: the chunk's 2 prefill passes admitted its 2 arrivals
        t.observe(tgi(
            [(0.8, 6.0), (3.4, 160.0)],
            8.0,
            (2200.0, 8.0),
            (5.0, 0.0),
        ));
        let w = t.windows();
        assert_eq!(w.len(), 4, "{w:?}");
        let p = w[3];
        assert!((p.prefill_sum - 0.3).abs() < 1e-12, "{p:?}");
        assert_eq!(
            (p.prefill_count, p.prefill_seqs, p.prefill_tokens),
            (2.0, 2.0, 1000.0)
        );
        assert_eq!(
            (p.itl_count, p.steps),
            (0.0, 60.0),
            "only the prefill equation"
        );
    }

    #[test]
    fn tgi_restarts_start_over_and_a_busy_engine_still_gets_prefill_windows() {
        let t = Timings::default();
        t.observe(tgi(
            [(0.5, 4.0), (2.0, 100.0)],
            6.0,
            (1200.0, 6.0),
            (0.0, 0.0),
        ));
        // a restart: counters went down
        t.observe(tgi([(0.1, 1.0), (0.1, 5.0)], 1.0, (50.0, 1.0), (1.0, 0.0)));
        assert!(t.windows().is_empty());
        // a vLLM reading after TGI's (another engine at the same address) is no window
        t.observe(read(&vllm(10.0, 40.0, (0.5, 30.0), (0.2, 2.0, 400.0)), 4.0));
        assert!(t.windows().is_empty());
        let t = Timings::default();
        let mut n = 0.0;
        for _ in 0..=tgi::MAX_CHUNK {
            n += 1.0;
            t.observe(tgi([(n, n), (n, 10.0 * n)], n, (100.0 * n, n), (4.0, 2.0)));
        }
        let prefills = t.windows().iter().filter(|w| w.prefill_count > 0.0).count();
        assert_eq!(
            prefills, 1,
            "a queue that never drains is cut every MAX_CHUNK scrapes"
        );
    }

    #[test]
    fn tgi_without_forward_passes_reports_nothing() {
        let s = prom::parse("tgi_queue_size 0\ntgi_batch_current_size 1\n");
        assert_eq!(Counters::from_tgi(&s, 0.0), None);
    }

    #[test]
    fn the_real_vllm_capture_reads() {
        let text = include_str!("../../tests/fixtures/vllm-0.32.0/metrics-under-load.txt");
        let c = Counters::from_vllm(&prom::parse(text), 0.0).expect("0.32 reports steps");
        let Counters::Vllm(t) = c else {
            panic!("read as vLLM: {c:?}");
        };
        assert!(
            t.steps > 0.0 && t.generated > 0.0 && t.prompt_computed > 0.0,
            "{c:?}"
        );
    }
}
