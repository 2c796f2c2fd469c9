//! TGI's forward passes as [`Window`]s.
//!
//! TGI runs a prefill forward pass for each group it admits and a decode pass for the running
//! batch, and reports each pass's duration by method (`tgi_batch_forward_duration{method}`),
//! the size of each admitted group (`tgi_batch_next_size`), every arriving request's prompt
//! length (`tgi_request_input_length`, at validation) and the running batch now
//! (`tgi_batch_current_size`, a gauge). Two kinds of window come out of that:
//! - a **decode window** per scrape: its decode passes, each making one token per running
//!   sequence (the batch: the gauge's mean over the scrape, at least one), and the queue wait
//!   and inference time of the requests that finished (`tgi_request_queue_duration`,
//!   `tgi_request_inference_duration`);
//! - a **prefill window** per chunk of scrapes that ends *settled*: nobody waiting
//!   (`tgi_queue_size` 0), every request that arrived in the chunk admitted, and no prefill pass
//!   in flight (as many groups formed, `tgi_batch_next_size_count`, as prefill passes timed).
//!   Its prefill passes, their admitted requests, and as their prompt tokens the chunk's
//!   arrivals'. Prompt lengths come at arrival and a group's size before its pass is timed, so
//!   only a settled chunk pairs each pass's time with its own prompts; an engine that never
//!   settles still gets a prefill window every [`MAX_CHUNK`] scrapes.
//!
//! Invariant: a window is the difference of readings of one engine process; a counter that
//! went down (a restart) starts the chunk over from the new reading.

use crate::batching::fit::Window;
use crate::fleet::prom::{self, Sample};

/// Scrapes after which a prefill window is cut even though requests were waiting.
pub const MAX_CHUNK: u32 = 20;

/// TGI's totals at one scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TgiTotals {
    at: f64,
    /// (seconds, passes) of each method.
    prefill: (f64, f64),
    decode: (f64, f64),
    /// Requests taken into prefill passes, and the groups they were taken in.
    admitted: f64,
    groups: f64,
    /// (prompt tokens, requests) of arrived requests.
    input: (f64, f64),
    /// (seconds, requests) of the queue wait and of the inference (admission to last token) of
    /// finished requests.
    queued: (f64, f64),
    inference: (f64, f64),
    /// The gauges: running batch and waiting requests.
    batch: f64,
    queue: f64,
}

impl TgiTotals {
    /// TGI's totals; `None` when the exposition has no forward-pass histogram.
    pub fn read(samples: &[Sample], at: f64) -> Option<TgiTotals> {
        let by_method = |name: &str, method: &str| {
            prom::sum(samples, name, |s| s.label("method") == Some(method))
        };
        let pass = |method: &str| {
            Some((
                by_method("tgi_batch_forward_duration_sum", method)?,
                by_method("tgi_batch_forward_duration_count", method)?,
            ))
        };
        let total = |name: &str| prom::sum(samples, name, |_| true).unwrap_or(0.0);
        Some(TgiTotals {
            at,
            prefill: pass("prefill")?,
            decode: pass("decode")?,
            admitted: total("tgi_batch_next_size_sum"),
            groups: total("tgi_batch_next_size_count"),
            input: (
                total("tgi_request_input_length_sum"),
                total("tgi_request_input_length_count"),
            ),
            queued: (
                total("tgi_request_queue_duration_sum"),
                total("tgi_request_queue_duration_count"),
            ),
            inference: (
                total("tgi_request_inference_duration_sum"),
                total("tgi_request_inference_duration_count"),
            ),
            batch: total("tgi_batch_current_size").max(0.0),
            queue: total("tgi_queue_size").max(0.0),
        })
    }

    /// Whether every counter of `self` is at least `prev`'s (the same engine process).
    fn follows(&self, prev: &TgiTotals) -> bool {
        self.prefill.0 >= prev.prefill.0
            && self.prefill.1 >= prev.prefill.1
            && self.decode.0 >= prev.decode.0
            && self.decode.1 >= prev.decode.1
            && self.admitted >= prev.admitted
            && self.groups >= prev.groups
            && self.input.0 >= prev.input.0
            && self.input.1 >= prev.input.1
            && self.queued.0 >= prev.queued.0
            && self.queued.1 >= prev.queued.1
            && self.inference.0 >= prev.inference.0
            && self.inference.1 >= prev.inference.1
    }
}

/// The scrapes since the last prefill window: where it started, and the decode tokens seen
/// since (each scrape's passes times its batch).
#[derive(Debug, Default)]
pub struct Chunk {
    start: Option<TgiTotals>,
    generated: f64,
    scrapes: u32,
}

impl Chunk {
    /// Take the reading `now` that follows `prev`: the scrape's decode window, and the
    /// chunk's prefill window when the chunk ends here.
    pub fn observe(&mut self, prev: &TgiTotals, now: &TgiTotals) -> [Option<Window>; 2] {
        let start = *self.start.get_or_insert(*prev);
        if !now.follows(prev) || !now.follows(&start) {
            *self = Chunk {
                start: Some(*now),
                ..Chunk::default()
            };
            return [None, None];
        }
        let decode = decode_window(prev, now);
        self.generated += decode.as_ref().map_or(0.0, |w| w.generated);
        self.scrapes += 1;
        if !settled(&start, now) && self.scrapes < MAX_CHUNK {
            return [decode, None];
        }
        let prefill = prefill_window(&start, now, self.generated);
        *self = Chunk {
            start: Some(*now),
            ..Chunk::default()
        };
        [decode, prefill]
    }
}

/// Whether the chunk from `start` to `now` ends with nothing between arrival and a timed
/// prefill pass: nobody waiting, every arrival admitted, every group's pass timed.
fn settled(start: &TgiTotals, now: &TgiTotals) -> bool {
    let arrived = now.input.1 - start.input.1;
    let admitted = now.admitted - start.admitted;
    now.queue == 0.0 && arrived == admitted && now.groups == now.prefill.1
}

/// One scrape's decode passes (`None` without any).
fn decode_window(prev: &TgiTotals, now: &TgiTotals) -> Option<Window> {
    let passes = now.decode.1 - prev.decode.1;
    let batch = ((now.batch + prev.batch) / 2.0).max(1.0);
    (passes >= 1.0).then(|| Window {
        at: prev.at,
        steps: passes,
        generated: passes * batch,
        itl_sum: now.decode.0 - prev.decode.0,
        itl_count: passes,
        queue_sum: now.queued.0 - prev.queued.0,
        queue_count: now.queued.1 - prev.queued.1,
        inference_sum: now.inference.0 - prev.inference.0,
        inference_count: now.inference.1 - prev.inference.1,
        ..Window::default()
    })
}

/// A chunk's prefill passes (`None` without any, or without a decode pass to make it usable):
/// its steps and tokens are the chunk's decode passes, so its only equation is the prefill.
fn prefill_window(start: &TgiTotals, now: &TgiTotals, generated: f64) -> Option<Window> {
    let passes = now.prefill.1 - start.prefill.1;
    let decodes = now.decode.1 - start.decode.1;
    let admitted = now.admitted - start.admitted;
    let (input, arrived) = (now.input.0 - start.input.0, now.input.1 - start.input.1);
    let mean_prompt = if arrived >= 1.0 {
        input / arrived
    } else if now.input.1 >= 1.0 {
        now.input.0 / now.input.1
    } else {
        0.0
    };
    (passes >= 1.0 && decodes >= 1.0 && admitted >= 1.0).then(|| Window {
        at: start.at,
        steps: decodes,
        generated: generated.max(decodes),
        prefill_sum: now.prefill.0 - start.prefill.0,
        prefill_count: passes,
        prefill_tokens: admitted * mean_prompt,
        prefill_seqs: admitted,
        ..Window::default()
    })
}
