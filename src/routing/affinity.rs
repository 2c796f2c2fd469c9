//! Prefix affinity: where a conversation prefix lives (its *home*) and when a request leaves it.
//!
//! Homes come from weighted rendezvous hashing. Each candidate gets, for a prefix, the score
//! `−w / ln(h)` with `h` uniform in (0, 1) from a hash of the prefix and the backend's name; the
//! highest score is the home, the next the second home, and so on. A backend then homes a
//! share `w / Σw` of all prefixes, and a backend joining or leaving moves only the prefixes it
//! gains or loses: about its own share.
//!
//! The weight is the backend's capacity as measured, never as configured: the largest batch
//! the engine was seen to hold (its learned slots or the requests it reported running, else
//! [`score::slots`]) times its measured decode speed brought to a full batch (`decode_tps × (1 + busy_seen/slots) / 2`, the score's batching model), times the
//! static `weight` of its config. That capacity is quantised to quarter octaves (steps of
//! about 19%) with hysteresis: a backend's step moves only when its capacity is more than
//! 1.25 steps (about 24%) away from it, so EWMA noise does not move homes, while a real change
//! (a slower GPU, a smaller batch) does. Identical servers can still land one step apart
//! (their capacities straddle a step boundary), so a step next to the fleet's most common one
//! weighs as that one: weights tell apart capacities two steps (about 41%) or more apart.
//! Before a backend is measured it takes the mean step of the measured candidates; with
//! nothing measured, all weights are equal (times the static weights).
//!
//! Gateway replicas agree without sharing state as far as their measurements do: the hash is
//! the same everywhere, the slots come from the engine, but each replica measures decode
//! speeds on its own traffic. Two replicas can therefore be one step apart for a backend whose
//! capacity sits near a step boundary; a step is ~19% of that backend's weight, so about 19% of
//! its share of prefixes (a few percent of all of them) have a different home on the two
//! replicas, and those prefixes are warm on two backends instead of one.
//!
//! Guards (a request leaves its home for the next one in rendezvous order, else token-aware,
//! only when staying would really hurt):
//! - time-to-first-token: scored with the prefix warm, its expected TTFT (queue wait, pending
//!   prefill, the rest of its prompt) may exceed the best candidate's (scored cold) by at most
//!   half of the best expected time of the whole request. A home that would queue the request
//!   fails it once the queue is deep enough to matter, not at the first request waiting (an
//!   engine near its batch limit queues for a step now and then, and moving the prefix for a
//!   few milliseconds costs its cache);
//! - total time: scored warm, at most 3 × the best candidate's score cold (a backend much
//!   slower than the rest — slowed down, swapping — is left even with a warm prefix);
//! - load, a backstop: its busy count may be at most `2 × the other candidates' utilisation ×
//!   its slots + slots / 2 + 2`, so a hot prefix cannot swamp a backend even where the batch
//!   limit is not known (a per-kind default of 256 slots).

use super::score::{self, Breakdown};
use crate::fleet::Backend;
use crate::openai::request::Fnv64;

/// Rendezvous (highest random weight) hash of `prefix` with each backend's name: the same on
/// every replica, as it depends on nothing but the two.
pub fn rendezvous_rank(prefix: u64, name: &str) -> u64 {
    let mut h = Fnv64::new();
    h.write(&prefix.to_le_bytes());
    h.write(name.as_bytes());
    // FNV's low bits are weak for short inputs; finish with a 64-bit mix (splitmix64).
    let mut z = h.finish().wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Weight steps per doubling of capacity.
pub const STEPS_PER_OCTAVE: f64 = 4.0;
/// How far (in steps) a backend's measured capacity must move before its weight step follows.
pub const LEVEL_BAND: f64 = 1.25;

/// Backstop load guard: the factor on the other candidates' utilisation.
const LOAD_FACTOR: f64 = 2.0;
/// Backstop load guard: requests always allowed on top, besides half the slots.
const LOAD_SLACK: f64 = 2.0;
/// Time-to-first-token guard: extra TTFT allowed, as a share of the best expected time.
const TTFT_SLACK: f64 = 0.5;
/// Total-time guard: the home's warm score may be this many times the best cold score.
const SCORE_FACTOR: f64 = 3.0;

/// What `b` delivers at a full batch, in output tokens per second, from measurements (times
/// its static weight); `None` before its decode speed is measured.
pub fn learned_capacity(b: &Backend) -> Option<f64> {
    let sp = b.state.speeds();
    let decode = sp.decode_tps.get()?;
    let sig = b.state.signals();
    if sig.fresh() {
        let running = sig.total.map_or(0.0, |t| t.running).max(0.0) as u64;
        sp.batch_seen.fetch_max(
            sig.learned_slots.unwrap_or(0).max(running),
            std::sync::atomic::Ordering::Relaxed,
        );
    }
    let slots = match sp.batch_seen.load(std::sync::atomic::Ordering::Relaxed) {
        0 => score::slots(b),
        n => n as f64,
    }
    .max(1.0);
    let seen = b.state.speeds().busy_seen().unwrap_or(slots).min(slots);
    let full = decode * (1.0 + seen / slots) / 2.0;
    let cap = slots * full * f64::from(b.config.weight.max(1));
    (cap.is_finite() && cap > 0.0).then_some(cap)
}

/// The backend's weight step (log2 of its learned capacity, in [`STEPS_PER_OCTAVE`]), updated
/// with hysteresis; `None` before it is measured.
pub fn home_level(b: &Backend) -> Option<i64> {
    let level = &b.state.speeds().home_level;
    match learned_capacity(b) {
        Some(cap) => level.follow(cap.log2() * STEPS_PER_OCTAVE, LEVEL_BAND),
        None => level.get(),
    }
}

/// The weights of `levels` (one per candidate, `None` = not measured): `2^(level/steps)`,
/// relative to the highest; unmeasured candidates take the mean level of the measured ones,
/// and with none measured all weigh 1. `static_weights` multiply the unmeasured ones (the
/// measured levels include them already). Levels one step from the fleet's [`reference`]
/// level weigh as much as it does: see [`snap`].
pub fn weights_of(levels: &[Option<i64>], static_weights: &[f64]) -> Vec<f64> {
    let measured: Vec<i64> = levels.iter().flatten().copied().collect();
    let Some(reference) = reference(&measured) else {
        return static_weights.iter().map(|w| w.max(1.0)).collect();
    };
    let mean = measured.iter().map(|l| *l as f64).sum::<f64>() / measured.len() as f64;
    let level = |i: usize| match levels[i] {
        Some(l) => snap(l as f64, reference),
        None => {
            snap(mean.round(), reference)
                + static_weights.get(i).map_or(0.0, |w| w.max(1.0).log2()) * STEPS_PER_OCTAVE
        }
    };
    let top = (0..levels.len())
        .map(level)
        .fold(f64::NEG_INFINITY, f64::max);
    (0..levels.len())
        .map(|i| ((level(i) - top) / STEPS_PER_OCTAVE).exp2())
        .collect()
}

/// The level most measured levels sit within one step of (ties: the lowest); `None` when
/// nothing is measured.
fn reference(measured: &[i64]) -> Option<i64> {
    let near = |l: i64| measured.iter().filter(|m| (**m - l).abs() <= 1).count();
    let mut candidates = measured.to_vec();
    candidates.sort_unstable();
    candidates.into_iter().rev().max_by_key(|l| near(*l))
}

/// A level one step from the reference is taken as the reference. Identical servers measure
/// within the hysteresis band of each other (±12% EWMA noise is ±0.65 steps), which can still
/// round to two neighbouring levels; weighting them 19% apart would give each side of a
/// rounding boundary different homes, and two gateway replicas (or the planner and a live
/// gateway) would disagree about where prefixes live for no real difference. Two steps
/// (41%) and more is a difference the weights keep.
fn snap(level: f64, reference: i64) -> f64 {
    if (level - reference as f64).abs() <= 1.0 {
        reference as f64
    } else {
        level
    }
}

/// The candidates' prefix-affinity weights (updating their stored steps).
pub fn home_weights(backends: &[&Backend]) -> Vec<f64> {
    let levels: Vec<Option<i64>> = backends.iter().map(|b| home_level(b)).collect();
    let statics: Vec<f64> = backends
        .iter()
        .map(|b| f64::from(b.config.weight.max(1)))
        .collect();
    weights_of(&levels, &statics)
}

/// Weighted rendezvous score of `prefix` on the backend `name` of `weight`: `−w / ln(h)`, `h`
/// uniform in (0, 1) from [`rendezvous_rank`]. Positive and finite for a positive weight.
pub fn weighted_rank(prefix: u64, name: &str, weight: f64) -> f64 {
    let h = ((rendezvous_rank(prefix, name) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    -weight.max(f64::MIN_POSITIVE) / h.ln()
}

/// Candidate indices in `prefix`'s home order (its home first).
pub fn home_order(names: &[&str], weights: &[f64], prefix: u64) -> Vec<usize> {
    let ranks: Vec<f64> = names
        .iter()
        .zip(weights)
        .map(|(n, w)| weighted_rank(prefix, n, *w))
        .collect();
    let mut order: Vec<usize> = (0..names.len()).collect();
    order.sort_by(|a, b| ranks[*b].total_cmp(&ranks[*a]));
    order
}

/// The load guard (a backstop): whether candidate `i` (of `cold`, every candidate scored for
/// this request without its prefix cached) carries far more than the rest, relative to slots.
pub fn overloaded(cold: &[Breakdown], i: usize) -> bool {
    let me = &cold[i];
    let busy: f64 = cold.iter().map(|b| b.busy).sum();
    let slots: f64 = cold.iter().map(|b| b.slots).sum();
    let other_slots = slots - me.slots;
    if other_slots <= 0.0 {
        return false;
    }
    let others = (busy - me.busy).max(0.0) / other_slots;
    me.busy > LOAD_FACTOR * others * me.slots + me.slots / 2.0 + LOAD_SLACK
}

/// The time guards: whether `warm` (candidate scored with the prefix cached) would really hurt
/// the request against the best candidate scored cold.
pub fn too_slow(warm: &Breakdown, cold: &[Breakdown]) -> bool {
    let best_ttft = cold
        .iter()
        .map(|b| b.ttft_seconds)
        .fold(f64::INFINITY, f64::min);
    let best_expected = cold
        .iter()
        .map(|b| b.expected_seconds)
        .fold(f64::INFINITY, f64::min);
    let best_score = cold.iter().map(|b| b.score).fold(f64::INFINITY, f64::min);
    warm.ttft_seconds > best_ttft + TTFT_SLACK * best_expected
        || warm.score > SCORE_FACTOR * best_score
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("gpu-{i}")).collect()
    }

    fn home(names: &[String], weights: &[f64], prefix: u64) -> usize {
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        home_order(&refs, weights, prefix)[0]
    }

    #[test]
    fn weighted_rank_is_positive_and_finite() {
        for p in [0u64, 1, u64::MAX, 0xdead_beef] {
            for w in [1e-9, 1.0, 1e9] {
                let r = weighted_rank(p, "b", w);
                assert!(r.is_finite() && r > 0.0, "{p} {w} {r}");
            }
        }
    }

    #[test]
    fn homes_are_shared_in_proportion_to_weight() {
        let n = names(4);
        let w = [1.0, 2.0, 3.0, 4.0];
        let keys = 40_000u64;
        let mut counts = [0usize; 4];
        for k in 0..keys {
            counts[home(&n, &w, k.wrapping_mul(0x9e37_79b9_7f4a_7c15))] += 1;
        }
        for (i, c) in counts.iter().enumerate() {
            let share = *c as f64 / keys as f64;
            let want = w[i] / 10.0;
            // binomial sd at 40k keys is under 0.25 percentage points: 1 point is > 4 sd
            assert!(
                (share - want).abs() < 0.01,
                "backend {i}: {share} vs {want}"
            );
        }
    }

    #[test]
    fn a_backend_joining_or_leaving_moves_only_its_share() {
        let n = names(5);
        let w5 = [4.0, 4.0, 1.0, 1.0, 1.2];
        let keys = 20_000u64;
        let total: f64 = w5.iter().sum();
        // leaving: drop gpu-2 (weight 1 of 11.2)
        let n4: Vec<String> = n
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 2)
            .map(|(_, s)| s.clone())
            .collect();
        let w4: Vec<f64> = w5
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 2)
            .map(|(_, w)| *w)
            .collect();
        let mut moved = 0;
        for k in 0..keys {
            let before = &n[home(&n, &w5, k)];
            let after = &n4[home(&n4, &w4, k)];
            if before != after {
                assert_eq!(before, "gpu-2", "only the leaving backend's prefixes move");
                moved += 1;
            }
        }
        let share = moved as f64 / keys as f64;
        assert!((share - 1.0 / total).abs() < 0.015, "moved {share}");
        // joining: a backend of weight 4 comes to the 5: it takes ~4/15.2, all from others
        let mut n6 = n.clone();
        n6.push("gpu-new".into());
        let mut w6 = w5.to_vec();
        w6.push(4.0);
        let mut moved = 0;
        for k in 0..keys {
            let before = &n[home(&n, &w5, k)];
            let after = &n6[home(&n6, &w6, k)];
            if before != after {
                assert_eq!(after, "gpu-new", "prefixes move only to the new backend");
                moved += 1;
            }
        }
        let share = moved as f64 / keys as f64;
        assert!((share - 4.0 / (total + 4.0)).abs() < 0.015, "moved {share}");
    }

    #[test]
    fn weights_before_measurements_are_equal_then_follow_levels() {
        assert_eq!(
            weights_of(&[None, None, None], &[1.0, 1.0, 1.0]),
            vec![1.0; 3]
        );
        assert_eq!(weights_of(&[None, None], &[1.0, 3.0]), vec![1.0, 3.0]);
        // two octaves apart: a quarter of the weight; the unmeasured one takes the mean
        let w = weights_of(&[Some(40), Some(32), None], &[1.0; 3]);
        assert!(
            (w[0] - 1.0).abs() < 1e-12 && (w[1] - 0.25).abs() < 1e-12,
            "{w:?}"
        );
        assert!((w[2] - 0.5).abs() < 1e-12, "{w:?}");
    }

    #[test]
    fn neighbouring_levels_weigh_as_the_common_one() {
        let m = |l: &[i64]| weights_of(&l.iter().map(|l| Some(*l)).collect::<Vec<_>>(), &[1.0; 4]);
        // identical servers either side of a step boundary
        assert_eq!(m(&[30, 30, 31, 30]), vec![1.0; 4]);
        assert_eq!(m(&[29, 30, 31]), vec![1.0; 3]);
        assert_eq!(m(&[31, 30]), vec![1.0; 2]);
        // two steps apart is a difference the weights keep
        let w = m(&[28, 30]);
        assert!((w[0] - 0.5f64.sqrt()).abs() < 1e-12 && w[1] == 1.0, "{w:?}");
        // a double-weight server beside three snapped ones
        let w = m(&[30, 31, 29, 34]);
        assert!(
            w[..3].iter().all(|x| (x - 0.5).abs() < 1e-12) && w[3] == 1.0,
            "{w:?}"
        );
    }

    #[test]
    fn small_capacity_jitter_moves_no_home() {
        use crate::fleet::speed::Level;
        // deterministic jitter of ±12% around capacities where a level boundary is near
        let mut seed = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let capacities = [3_840.0, 975.0, 1_100.0, 4_000.0 * 2f64.powf(0.125)];
        let levels: Vec<Level> = capacities.iter().map(|_| Level::default()).collect();
        let n = names(4);
        let level_of = |l: &Level, cap: f64| l.follow(cap.log2() * STEPS_PER_OCTAVE, LEVEL_BAND);
        let first: Vec<Option<i64>> = levels
            .iter()
            .zip(capacities)
            .map(|(l, c)| level_of(l, c))
            .collect();
        let w0 = weights_of(&first, &[1.0; 4]);
        let homes0: Vec<usize> = (0..2000u64).map(|k| home(&n, &w0, k)).collect();
        for _ in 0..500 {
            let now: Vec<Option<i64>> = levels
                .iter()
                .zip(capacities)
                .map(|(l, c)| level_of(l, c * (0.88 + 0.24 * next())))
                .collect();
            assert_eq!(now, first, "a level moved under ±12% jitter");
        }
        let w1 = weights_of(
            &levels.iter().map(Level::get).collect::<Vec<_>>(),
            &[1.0; 4],
        );
        let homes1: Vec<usize> = (0..2000u64).map(|k| home(&n, &w1, k)).collect();
        assert_eq!(homes0, homes1);
        // a real change (the first backend halves) moves its level by 4 steps
        let l = level_of(&levels[0], capacities[0] / 2.0).unwrap();
        assert_eq!(l, first[0].unwrap() - 4);
    }

    fn bd(busy: f64, slots: f64, ttft: f64, expected: f64) -> Breakdown {
        Breakdown {
            busy,
            slots,
            queued_ahead: (busy + 1.0 - slots).max(0.0),
            ttft_seconds: ttft,
            expected_seconds: expected,
            score: expected,
            ..Breakdown::default()
        }
    }

    #[test]
    fn load_guard_is_a_backstop_relative_to_slots() {
        // a full batch at home, another backend with room: the load guard lets it be (the
        // TTFT guard prices the queue)
        let cold = vec![bd(32.0, 32.0, 0.1, 1.0), bd(10.0, 16.0, 0.1, 1.0)];
        assert!(!overloaded(&cold, 0));
        // many more requests than the rest, relative to slots
        let cold = vec![bd(140.0, 256.0, 0.1, 1.0), bd(2.0, 256.0, 0.1, 1.0)];
        assert!(overloaded(&cold, 0));
        let cold = vec![bd(100.0, 256.0, 0.1, 1.0), bd(2.0, 256.0, 0.1, 1.0)];
        assert!(!overloaded(&cold, 0));
        // alone: nowhere to go
        assert!(!overloaded(&[bd(500.0, 8.0, 0.1, 1.0)], 0));
    }

    #[test]
    fn time_guards_allow_a_warm_home_unless_it_really_hurts() {
        let cold = vec![bd(0.0, 32.0, 0.05, 1.0), bd(0.0, 16.0, 0.15, 1.8)];
        // a slower engine, warm: TTFT within the slack, 1.8x the time: stays
        assert!(!too_slow(&bd(0.0, 16.0, 0.05, 1.8), &cold));
        // a long prompt pending at home: TTFT 0.5 s over the best + 0.5 x 1 s: leaves
        assert!(too_slow(&bd(0.0, 16.0, 0.6, 2.0), &cold));
        // much slower in all (a slowed-down engine): leaves
        assert!(too_slow(&bd(0.0, 16.0, 0.05, 3.1), &cold));
        // queued behind a few at home: a small wait, stays; a deep queue: leaves
        assert!(!too_slow(&bd(34.0, 32.0, 0.05 + 0.2, 1.2), &cold));
        assert!(too_slow(&bd(60.0, 32.0, 0.05 + 1.5, 2.5), &cold));
    }
}
