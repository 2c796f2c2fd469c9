//! A fleet of engines in virtual time: the [`crate::batching`] model of each engine driven by
//! an event queue instead of a clock, and every arrival routed by [`crate::routing::Router`]
//! over real [`crate::fleet::Backend`]s, whose load counters and learned speeds the planner
//! keeps exactly as the gateway's proxy does.
//!
//! How routing is called: each planned server is a `Backend` (kind vLLM, no connections are
//! ever made) with the batch limit as its learned slots. On arrival the planner builds the
//! [`RouteInput`] the proxy would (prompt, expected output learned per model, shared-prefix
//! fingerprint and length), asks `Router::pick` with the configured policy, and takes a
//! [`LoadGuard`] on the chosen backend; the first token calls `LoadGuard::first_token`, the end
//! drops the guard and feeds `Speeds::observe` and `ModelShapes::observe`, as settlement does
//! (with the proxy's inputs: the expected output is the request's `max_tokens` when it set one,
//! the prefill-speed sample is skipped when `would_queue` said so at the claim, and the busy
//! count is the in-flight requests with the one ending).
//! The scorer therefore reads the same in-flight counters and measured speeds it reads live,
//! and the rules that depend on time (speeds gone stale on an idle backend) or chance
//! (tie-breaks) see virtual time and a seeded generator ([`crate::fleet::clock`]).
//! Engine metrics (running/waiting scrapes) are not simulated: the gateway's own counters, which
//! the scorer takes when no scrape is fresh, are exact here because the planner is the only
//! client.
//!
//! Time is integer nanoseconds. A stretch of steps without admissions has a constant duration,
//! so an engine schedules one event at the end of the stretch (the next sequence to finish); an
//! arrival cuts the stretch at the end of the step in progress, where the real scheduler would
//! admit it.
//!
//! Invariant: every request that arrives finishes (the planner never drops one), so results
//! always cover the whole workload.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::Duration;

use crate::batching::{Batch, Queued, Running, Timing};
use crate::config::{BackendConfig, BackendKind, Config, PolicyKind, Timeouts};
use crate::fleet::clock::Virtual;
use crate::fleet::signals::Signals;
use crate::fleet::speed::Observation;
use crate::fleet::{Backend, BackendState, LoadGuard};
use crate::routing::score::would_queue;
use crate::routing::{RouteInput, Router};

/// The model name every planned request asks for.
const MODEL: &str = "model";

/// One request of a workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Request {
    /// Arrival, in nanoseconds from the start of the workload.
    pub at_ns: u64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// The shared prefix it starts with (fingerprint, tokens), if any.
    pub prefix: Option<(u64, u32)>,
    /// The output the client asked for at most (`max_tokens` × `n`), if it said: routing
    /// expects that much output, as the proxy does; otherwise the learned average.
    pub max_tokens: Option<u32>,
}

/// What happened to one request.
#[derive(Debug, Clone, Copy, Default)]
pub struct Outcome {
    pub queue_ns: u64,
    pub ttft_ns: u64,
    /// Time per output token after the first (`None` with fewer than two tokens).
    pub tpot_ns: Option<u64>,
    pub cached_tokens: u32,
}

/// A whole run: each request's outcome (in workload order) and each engine's busy time.
#[derive(Debug, Clone)]
pub struct Run {
    pub outcomes: Vec<Outcome>,
    /// Per engine: time spent stepping.
    pub busy_ns: Vec<u64>,
    /// Per engine: the integral of the batch size over time (sequence-nanoseconds).
    pub batch_ns: Vec<f64>,
    /// From the first arrival to the last finish.
    pub span_ns: u64,
}

struct Engine {
    batch: Batch<usize>,
    seg_start: u64,
    step_ns: u64,
    /// Into the segment's first step, when the sequences admitted for it have their first
    /// token (before its end where they are prefilled in a pass of their own).
    first_ns: u64,
    steps: u32,
    version: u64,
    busy: bool,
    busy_ns: u64,
    batch_ns: f64,
}

struct Live {
    guard: Option<LoadGuard>,
    /// What the proxy decides when it claims the backend ([`would_queue`]): the request will
    /// wait for a batch slot, so its TTFT is not a prefill-speed sample.
    queued: bool,
    admitted_ns: u64,
    first_ns: Option<u64>,
}

/// The fleet under simulation.
struct Sim<'a> {
    reqs: &'a [Request],
    engines: Vec<Engine>,
    backends: Vec<(Arc<Backend>, String)>,
    router: Router,
    config: Config,
    policy: PolicyKind,
    live: Vec<Live>,
    outcomes: Vec<Outcome>,
    events: BinaryHeap<Reverse<(u64, usize, u64)>>,
    block: u32,
    /// The engines' time to first token outside their scheduler, ns.
    outside_ns: u64,
    last_finish: u64,
}

/// Run `reqs` (sorted by arrival) on `engines` engines of `timing`, routed by `policy`.
/// Deterministic: routing reads the virtual clock and draws from a generator seeded with the
/// engine count, so a fleet size gives the same answer whatever else is planned beside it.
pub fn simulate(reqs: &[Request], engines: usize, timing: &Timing, policy: PolicyKind) -> Run {
    let engines = engines.max(1);
    let clock = Virtual::install(virtual_ms(0), mix(engines as u64));
    let mut sim = Sim::new(reqs, engines, timing, policy);
    let mut next = 0;
    loop {
        let step = sim.events.peek().map(|Reverse((t, _, _))| *t);
        match (reqs.get(next), step) {
            (Some(r), s) if s.is_none_or(|s| r.at_ns < s) => {
                clock.set_ms(virtual_ms(r.at_ns));
                sim.arrive(next, r.at_ns);
                next += 1;
            }
            (_, Some(_)) => {
                if let Some(Reverse((t, e, v))) = sim.events.pop() {
                    clock.set_ms(virtual_ms(t));
                    sim.step_end(e, v, t);
                }
            }
            (None, None) => break,
            (Some(_), None) => unreachable!("covered by the first arm"),
        }
    }
    sim.finish()
}

/// The clock reading at virtual time `ns`: never 0, which state reads as "never".
fn virtual_ms(ns: u64) -> u64 {
    1 + ns / 1_000_000
}

impl<'a> Sim<'a> {
    fn new(reqs: &'a [Request], n: usize, timing: &Timing, policy: PolicyKind) -> Sim<'a> {
        let backends = (0..n).map(|i| (Arc::new(backend(i, timing)), MODEL.to_string()));
        Sim {
            reqs,
            engines: (0..n)
                .map(|_| Engine {
                    batch: Batch::new(timing.clone()),
                    seg_start: 0,
                    step_ns: 0,
                    first_ns: 0,
                    steps: 0,
                    version: 0,
                    busy: false,
                    busy_ns: 0,
                    batch_ns: 0.0,
                })
                .collect(),
            backends: backends.collect(),
            router: Router::new(),
            config: Config::empty(),
            policy,
            live: (0..reqs.len())
                .map(|_| Live {
                    guard: None,
                    queued: false,
                    admitted_ns: 0,
                    first_ns: None,
                })
                .collect(),
            outcomes: vec![Outcome::default(); reqs.len()],
            events: BinaryHeap::new(),
            block: timing.block_size.max(1),
            outside_ns: u64::try_from(timing.outside.as_nanos()).unwrap_or(u64::MAX),
            last_finish: 0,
        }
    }

    fn arrive(&mut self, i: usize, now: u64) {
        let r = self.reqs[i];
        let learned = self
            .router
            .shapes
            .output_tokens(MODEL)
            .unwrap_or(self.config.routing.default_max_tokens);
        let output = r.max_tokens.map_or(learned, u64::from);
        let prompt = u64::from(r.prompt_tokens);
        let input = RouteInput {
            tokens: prompt + output,
            prefix_hash: r.prefix.map(|p| p.0),
            prompt_tokens: prompt,
            prefix_tokens: r.prefix.map_or(0, |p| u64::from(p.1)),
            prompt: None,
            prompt_exact: false,
            adapter: None,
            background: false,
        };
        let e = self
            .router
            .pick(&self.config, self.policy, &self.backends, &[], &input)
            .unwrap_or(i % self.engines.len());
        let state = self.backends[e].0.state.clone();
        self.live[i].queued = would_queue(&self.backends[e].0, MODEL);
        self.live[i].guard = Some(LoadGuard::new(state, input.load()));
        let (blocks, unique_blocks) = prompt_blocks(&r, self.block);
        let q = Queued {
            prompt_len: r.prompt_tokens,
            blocks,
            unique_blocks,
            tokens: Vec::new(),
            out_len: r.output_tokens,
            lora: 0,
            tag: i,
        };
        let eng = &mut self.engines[e];
        eng.batch.waiting.push_back(q);
        if !eng.busy {
            self.start_segment(e, now);
            return;
        }
        // the step in progress ends; the request is admitted there
        let eng = &mut self.engines[e];
        let done = now
            .saturating_sub(eng.seg_start)
            .div_ceil(eng.step_ns)
            .max(1);
        if done < u64::from(eng.steps) {
            eng.steps = done as u32;
            eng.version += 1;
            let end = eng.seg_start + done * eng.step_ns;
            self.events.push(Reverse((end, e, eng.version)));
        }
    }

    fn step_end(&mut self, e: usize, version: u64, now: u64) {
        let eng = &mut self.engines[e];
        if version != eng.version {
            return;
        }
        let first_at = eng.seg_start + eng.first_ns;
        let span = now - eng.seg_start;
        eng.busy_ns += span;
        eng.batch_ns += eng.batch.running.len() as f64 * span as f64;
        for seq in &eng.batch.running {
            if seq.generated == 0 && seq.out_len > 0 {
                let live = &mut self.live[seq.tag];
                live.first_ns = Some(first_at);
                if let Some(g) = live.guard.as_mut() {
                    g.first_token();
                }
            }
        }
        if eng.first_ns < eng.step_ns {
            eng.batch.first_tokens();
        }
        eng.batch.advance(eng.steps);
        let mut done = Vec::new();
        eng.batch.take_done(|seq| done.push(seq));
        for seq in done {
            self.finish_request(seq, now);
        }
        self.start_segment(e, now);
    }

    fn finish_request(&mut self, seq: Running<usize>, now: u64) {
        let i = seq.tag;
        let r = self.reqs[i];
        self.last_finish = self.last_finish.max(now);
        let live = &mut self.live[i];
        let first = live.first_ns.unwrap_or(now);
        let out = &mut self.outcomes[i];
        out.queue_ns = live.admitted_ns - r.at_ns;
        // the time outside the scheduler delays every token the client sees, not their gaps
        let outside = self.outside_ns;
        out.ttft_ns = first - r.at_ns + outside;
        out.tpot_ns = (seq.out_len >= 2).then(|| (now - first) / u64::from(seq.out_len - 1));
        out.cached_tokens = seq.cached;
        if let Some(guard) = live.guard.take() {
            let state = guard.state().clone();
            drop(guard);
            let o = Observation {
                prompt_tokens: u64::from(seq.prompt_len),
                // the modelled engines report no cached tokens to the modelled gateway
                cached_tokens: 0,
                completion_tokens: u64::from(seq.out_len),
                ttft: Some(Duration::from_nanos(first - r.at_ns + outside)),
                total: Duration::from_nanos(now - r.at_ns + outside),
                queued: live.queued,
            };
            // as settlement counts it: the in-flight requests with this one
            state
                .speeds()
                .observe(&o, state.inflight_requests() as f64 + 1.0);
        }
        let prompt = u64::from(seq.prompt_len);
        (self.router.shapes).observe(MODEL, prompt, prompt, u64::from(seq.out_len));
    }

    /// Admit what fits at `now` and schedule the end of the next stretch of steps.
    fn start_segment(&mut self, e: usize, now: u64) {
        let eng = &mut self.engines[e];
        let live = &mut self.live;
        let prefill = eng.batch.admit(|seq| live[seq.tag].admitted_ns = now);
        if eng.batch.running.is_empty() {
            eng.busy = false;
            return;
        }
        let (steps, prefill) = match prefill {
            0 => (eng.batch.steps_to_next_finish(), 0),
            p => (1, p),
        };
        eng.busy = true;
        eng.steps = steps;
        eng.step_ns = (eng.batch.step_duration(prefill).as_nanos() as u64).max(1);
        eng.first_ns =
            (eng.batch.first_token_after(prefill).as_nanos() as u64).clamp(1, eng.step_ns);
        eng.seg_start = now;
        eng.version += 1;
        let end = now + u64::from(steps) * eng.step_ns;
        self.events.push(Reverse((end, e, eng.version)));
    }

    fn finish(self) -> Run {
        let first = self.reqs.first().map_or(0, |r| r.at_ns);
        let last = self.last_finish.max(first);
        Run {
            busy_ns: self.engines.iter().map(|e| e.busy_ns).collect(),
            batch_ns: self.engines.iter().map(|e| e.batch_ns).collect(),
            outcomes: self.outcomes,
            span_ns: last.saturating_sub(first).max(1),
        }
    }
}

/// A backend standing for planned engine `i`: never connected to, its batch limit learned.
fn backend(i: usize, timing: &Timing) -> Backend {
    let config = BackendConfig {
        name: format!("engine-{i}"),
        kind: BackendKind::Vllm,
        url: "http://127.0.0.1:9"
            .parse()
            .unwrap_or_else(|_| unreachable!("a valid URL")),
        models: vec![MODEL.to_string()],
        model_names: Default::default(),
        api_key: None,
        weight: 1,
        max_concurrent: None,
        health_path: None,
        kv_events: Default::default(),
        max_adapters: None,
        lora_adapters: Vec::new(),
        timeouts: Timeouts::default(),
    };
    let state = Arc::new(BackendState::new());
    state.set_signals(Signals {
        learned_slots: Some(timing.max_num_seqs as u64),
        ..Signals::default()
    });
    Backend::new(config, state)
}

/// A planned prompt as the prefix cache sees it: the shared prefix's block hashes (the same
/// for every request with that fingerprint), then the count of whole blocks only this request
/// has.
fn prompt_blocks(r: &Request, block: u32) -> (Vec<u64>, u32) {
    let blocks = r.prompt_tokens / block;
    let Some((fp, tokens)) = r.prefix else {
        return (Vec::new(), blocks);
    };
    let shared = (tokens.min(r.prompt_tokens) / block).min(blocks);
    let hashes = (0..shared)
        .map(|b| mix(fp ^ mix(u64::from(b) + 1)))
        .collect();
    (hashes, blocks - shared)
}

/// splitmix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests;
