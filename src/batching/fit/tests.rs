//! The fit against an engine whose timing is known: the batching model run in virtual time,
//! reporting per window what vLLM reports (iteration steps and tokens, inter-token gaps per
//! step, prefill time and computed tokens per finished request).

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::batching::{Batch, Queued, Timing};

/// What a sequence's owner tracks: when it was scheduled, its last token, its first step's
/// end.
#[derive(Debug, Clone, Copy, Default)]
struct Seq {
    scheduled: f64,
    first: f64,
    last: f64,
    computed: u32,
}

struct Arrival {
    at: f64,
    prompt: u32,
    out: u32,
}

/// Run `arrivals` on one engine; the windows are `window` seconds long.
fn run(timing: Timing, arrivals: &[Arrival], window: f64) -> Vec<Window> {
    let mut b: Batch<Seq> = Batch::new(timing);
    let mut t = 0.0;
    let mut next = 0;
    let mut cur = Window::default();
    let mut out = Vec::new();
    let mut unique = 0u64;
    while next < arrivals.len() || !b.is_idle() {
        if b.is_idle() && next < arrivals.len() {
            t = f64::max(t, arrivals[next].at);
        }
        while next < arrivals.len() && arrivals[next].at <= t {
            let a = &arrivals[next];
            unique += 1;
            b.waiting.push_back(Queued {
                prompt_len: a.prompt,
                blocks: vec![unique],
                unique_blocks: 0,
                tokens: Vec::new(),
                out_len: a.out,
                lora: 0,
                tag: Seq::default(),
            });
            next += 1;
        }
        let before = b.running.len();
        let prefill = b.admit(|_| {});
        for s in &mut b.running[before..] {
            s.tag.scheduled = t;
            s.tag.computed = s.prompt_len - s.cached;
        }
        let end = t + b.step_duration(prefill).as_secs_f64();
        while end >= cur.at + window {
            out.push(cur);
            cur = Window {
                at: cur.at + window,
                ..Window::default()
            };
        }
        cur.steps += 1.0;
        cur.prompt_computed += f64::from(prefill);
        cur.generated += b.running.len() as f64;
        for s in &mut b.running {
            if s.generated == 0 {
                s.tag.first = end;
            } else {
                cur.itl_sum += end - s.tag.last;
                cur.itl_count += 1.0;
            }
            s.tag.last = end;
        }
        b.advance(1);
        b.take_done(|s| {
            cur.prefill_sum += s.tag.first - s.tag.scheduled;
            cur.prefill_count += 1.0;
            cur.prefill_tokens += f64::from(s.tag.computed);
        });
        t = end;
    }
    out.push(cur);
    out
}

fn sim_timing() -> Timing {
    Timing {
        max_num_seqs: 8,
        prefill_per_token: Duration::from_micros(100),
        decode_base: Duration::from_millis(15),
        decode_per_seq: Duration::from_millis(1),
        ..Timing::default()
    }
}

/// Bursty on/off arrivals (20 s at `high`/s, 20 s at `low`/s), 80% short prompts (~200
/// tokens) and 20% long (~3,000), answers of 20–200 tokens with one in ten long (up to 800).
fn bursty(seconds: f64, high: f64, low: f64, seed: u64) -> Vec<Arrival> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0;
    let mut out = Vec::new();
    while t < seconds {
        let rate = if (t / 20.0) as u64 % 2 == 0 {
            high
        } else {
            low
        };
        t += -rng.random::<f64>().max(1e-12).ln() / rate;
        let prompt = if rng.random::<f64>() < 0.2 {
            rng.random_range(2_500..3_500)
        } else {
            rng.random_range(150..250)
        };
        let out_len = if rng.random::<f64>() < 0.1 {
            rng.random_range(300..800)
        } else {
            rng.random_range(20..200)
        };
        out.push(Arrival {
            at: t,
            prompt,
            out: out_len,
        });
    }
    out
}

fn within(name: &str, got: Estimate, want: f64, tol: f64) {
    let err = (got.value - want).abs() / want;
    assert!(
        err <= tol,
        "{name}: fitted {:.6} ± {:.6} s, true {want:.6} s ({:.1}% off)",
        got.value,
        got.stderr,
        err * 100.0
    );
}

fn assert_recovers(fit: &EngineFit, t: &Timing, tol: f64) {
    within(
        "prefill_per_token",
        fit.prefill_per_token,
        t.prefill_per_token.as_secs_f64(),
        tol,
    );
    within(
        "decode_base",
        fit.decode_base,
        t.decode_base.as_secs_f64(),
        tol,
    );
    within(
        "decode_per_seq",
        fit.decode_per_seq,
        t.decode_per_seq.as_secs_f64(),
        tol,
    );
}

#[test]
fn bursty_bimodal_traffic_recovers_the_step_costs() {
    let timing = sim_timing();
    for seed in [1, 2, 3] {
        let windows = run(timing.clone(), &bursty(240.0, 3.0, 0.5, seed), 1.0);
        let fit = fit(&windows).expect("enough windows");
        eprintln!("seed {seed}: {fit:?}");
        assert_recovers(&fit, &timing, 0.10);
        assert!(fit.batch_range.1 > fit.batch_range.0);
        assert!(fit.prompt_range.1 > 1_000.0, "{:?}", fit.prompt_range);
    }
}

#[test]
fn steady_light_traffic_recovers_the_step_costs() {
    let timing = sim_timing();
    let windows = run(timing.clone(), &bursty(240.0, 1.0, 1.0, 7), 1.0);
    let fit = fit(&windows).expect("enough windows");
    eprintln!("{fit:?}");
    assert_recovers(&fit, &timing, 0.10);
}

#[test]
fn outlier_windows_do_not_move_the_fit() {
    let timing = sim_timing();
    let mut windows = run(timing.clone(), &bursty(240.0, 3.0, 0.5, 4), 1.0);
    // a few windows where the engine stalled (a GC pause, a swap): ten times slower
    let clean = fit(&windows).expect("fit");
    assert!(
        (clean.time_ratio - 1.0).abs() < 0.05,
        "{}",
        clean.time_ratio
    );
    for w in windows.iter_mut().step_by(25) {
        w.itl_sum *= 10.0;
        w.prefill_sum *= 10.0;
    }
    let f = fit(&windows).expect("fit");
    assert_recovers(&f, &timing, 0.10);
    // the stalls are time the engine lost: the ratio says how much
    let total = |ws: &[Window]| ws.iter().map(|w| w.itl_sum + w.prefill_sum).sum::<f64>();
    let lost = total(&windows) / total(&run(timing.clone(), &bursty(240.0, 3.0, 0.5, 4), 1.0));
    assert!(
        (f.time_ratio / lost - 1.0).abs() < 0.1,
        "ratio {} for {lost}",
        f.time_ratio
    );
}

#[test]
fn too_little_or_uniform_traffic_is_an_error() {
    assert_eq!(fit(&[]), Err(FitError::TooFew(0)));
    let same = Window {
        steps: 10.0,
        generated: 10.0,
        itl_sum: 0.2,
        itl_count: 10.0,
        ..Window::default()
    };
    assert_eq!(fit(&vec![same; 20]), Err(FitError::Degenerate));
}

#[test]
fn a_batch_that_never_varies_fixes_the_per_sequence_cost_and_says_so() {
    let timing = Timing {
        max_num_seqs: 1,
        ..sim_timing()
    };
    let windows = run(timing.clone(), &bursty(240.0, 3.0, 0.5, 5), 1.0);
    let f = fit(&windows).expect("base and prefill are still known");
    assert_eq!(f.fixed, ["decode_per_seq"]);
    assert_eq!(
        (f.decode_per_seq.value, f.decode_per_seq.stderr),
        (0.0, 0.0)
    );
    // one sequence: the whole step cost at batch 1 is in the base
    let step = timing.decode_base + timing.decode_per_seq;
    within("decode_base", f.decode_base, step.as_secs_f64(), 0.05);
    within("prefill_per_token", f.prefill_per_token, 100e-6, 0.05);
}

#[test]
fn the_inverse_is_an_inverse_across_scales() {
    let m = [[4.0, 2e3, 1e5], [2e3, 2e6, 3e7], [1e5, 3e7, 1e10]];
    let inv = invert(m).expect("invertible");
    for (i, row) in m.iter().enumerate() {
        for (j, want) in [0, 1, 2]
            .map(|j| f64::from(u8::from(i == j)))
            .iter()
            .enumerate()
        {
            let v: f64 = row.iter().zip(&inv).map(|(a, r)| a * r[j]).sum();
            assert!((v - want).abs() < 1e-9, "{i}{j}: {v}");
        }
    }
}

#[test]
fn the_time_outside_the_engine_is_the_gateways_answer_time_over_queue_and_inference() {
    // the gateway timed 40 answers at 580 ms on average; the engine's requests waited 20 ms
    // and took 535 ms from admission to their last token: 25 ms went elsewhere
    let w = |sent: f64| Window {
        steps: 10.0,
        generated: 20.0,
        queue_sum: 0.020 * 4.0,
        queue_count: 4.0,
        inference_sum: 0.535 * 4.0,
        inference_count: 4.0,
        sent_sum: sent * 4.0,
        sent_count: 4.0,
        ..Window::default()
    };
    let windows: Vec<Window> = (0..10)
        .map(|i| w(if i % 2 == 0 { 0.570 } else { 0.590 }))
        .collect();
    let o = outside(&windows).expect("enough answers");
    assert!((o.value - 0.025).abs() < 1e-9, "{o:?}");
    assert!(o.stderr > 0.0 && o.stderr < 0.01, "{o:?}");
    // too few answers: no estimate; a gateway faster than the engine says: 0, not negative
    assert_eq!(outside(&windows[..2]), None);
    let fast: Vec<Window> = (0..10).map(|_| w(0.5)).collect();
    assert_eq!(outside(&fast).map(|o| o.value), Some(0.0));
}

#[test]
fn where_first_tokens_are_timed_the_time_outside_is_that_before_the_first_token() {
    // 40 streamed answers: first token at 45 ms by the gateway, the engine's requests waited
    // 20 ms and prefilled in 13 ms (12 ms before the first token went elsewhere); their last
    // bytes at 580 ms over 535 ms of inference (25 ms: the frontend's work on later tokens too)
    let w = |first: f64| Window {
        steps: 10.0,
        generated: 20.0,
        prefill_sum: 0.013 * 4.0,
        prefill_count: 4.0,
        queue_sum: 0.020 * 4.0,
        queue_count: 4.0,
        inference_sum: 0.535 * 4.0,
        inference_count: 4.0,
        sent_sum: 0.580 * 4.0,
        sent_count: 4.0,
        first_sum: first * 4.0,
        first_count: 4.0,
        ..Window::default()
    };
    let windows: Vec<Window> = (0..10)
        .map(|i| w(if i % 2 == 0 { 0.044 } else { 0.046 }))
        .collect();
    let o = outside(&windows).expect("enough answers");
    assert!((o.value - 0.012).abs() < 1e-9, "{o:?}");
    assert!(o.stderr > 0.0 && o.stderr < 0.01, "{o:?}");
    // prefills counted per pass (TGI), not per request: the answers' ends
    let passes: Vec<Window> = windows
        .iter()
        .map(|w| Window {
            prefill_seqs: 8.0,
            ..*w
        })
        .collect();
    let o = outside(&passes).expect("enough answers");
    assert!((o.value - 0.025).abs() < 1e-9, "{o:?}");
    // too few streamed answers: the answers' ends
    let few: Vec<Window> = windows
        .iter()
        .enumerate()
        .map(|(i, w)| Window {
            first_count: if i == 0 { 4.0 } else { 0.0 },
            first_sum: if i == 0 { w.first_sum } else { 0.0 },
            ..*w
        })
        .collect();
    let o = outside(&few).expect("enough answers");
    assert!((o.value - 0.025).abs() < 1e-9, "{o:?}");
}

#[test]
fn a_few_stalled_answers_do_not_make_the_time_outside() {
    // ten windows at 12 ms outside, two where the frontend stalled answers by half a second:
    // the typical answer's time, not the mean's 95 ms
    let w = |first: f64| Window {
        steps: 10.0,
        generated: 20.0,
        prefill_sum: 0.010 * 4.0,
        prefill_count: 4.0,
        queue_count: 4.0,
        first_sum: first * 4.0,
        first_count: 4.0,
        ..Window::default()
    };
    let windows: Vec<Window> = (0..12)
        .map(|i| w(if i % 6 == 5 { 0.510 } else { 0.022 }))
        .collect();
    let o = outside(&windows).expect("enough answers");
    assert!((o.value - 0.012).abs() < 1e-9, "{o:?}");
}
