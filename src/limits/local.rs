//! The in-process limit store: every check of a request evaluated and taken under one lock, so
//! admission is all or nothing and exact within one process.
//!
//! Rates (requests and tokens per window) are GCRA in its "virtual meter" form: a meter holds
//! the units used and drains continuously at `limit / window`; a request of cost `c` passes when
//! `used + c <= limit`. This is the same rule governor's GCRA applies (a theoretical arrival time
//! is `now + used * window / limit`), kept as units used so that a reservation can be reconciled
//! or refunded afterwards and a limit can change on reload without losing the count — neither of
//! which governor's cells allow. [`super::shared`] runs the identical arithmetic in Lua.
//!
//! Invariant: a check's state changes only when the whole request was admitted, or when a
//! permit settles what it took.

use std::sync::{Arc, Mutex};

use hashbrown::HashMap;

use super::plan::{period, Check, CheckState, Decision, Kind};

/// Retry hint when a concurrency limit refuses (nothing tells when a slot frees up).
pub const CONCURRENCY_RETRY_MS: u64 = 1000;

#[derive(Debug, Clone, Copy)]
enum Slot {
    Rate { used: f64, at: f64 },
    Count(u64),
    Budget { period: i64, used: u64 },
}

/// Limit state of this process.
#[derive(Debug, Default)]
pub struct LocalStore {
    slots: Mutex<HashMap<Arc<str>, Slot>>,
}

/// A rate meter drained to `now`.
pub fn drained(used: f64, at: f64, now: f64, limit: u64, window_ms: f64) -> f64 {
    let elapsed = (now - at).max(0.0);
    (used - elapsed * limit as f64 / window_ms).max(0.0)
}

/// Evaluate a rate check against a drained meter.
pub fn eval_rate(
    used: f64,
    limit: u64,
    cost: u64,
    window_ms: f64,
) -> (CheckState, Option<u64>, bool) {
    let l = limit as f64;
    let per_unit = window_ms / l;
    let allowed = cost <= limit && used + cost as f64 <= l + 1e-9;
    let shown = if allowed { used + cost as f64 } else { used };
    let state = CheckState {
        remaining: (l - shown).max(0.0).floor() as u64,
        reset_ms: (shown * per_unit).ceil().max(0.0) as u64,
        used: used.ceil() as u64,
        period: 0,
    };
    let retry =
        (cost <= limit).then(|| ((used + cost as f64 - l) * per_unit).ceil().max(1.0) as u64);
    (state, retry, allowed)
}

impl LocalStore {
    /// Evaluate every check at `now_ms` (ms since the epoch); take them all if all pass.
    pub fn admit(&self, checks: &[Check], window_ms: f64, now_ms: f64) -> Decision {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let mut decision = Decision::default();
        for (i, c) in checks.iter().enumerate() {
            let (state, retry, allowed) = match c.kind {
                Kind::Requests | Kind::Tokens => {
                    let used = match slots.get(&*c.id) {
                        Some(Slot::Rate { used, at }) => {
                            drained(*used, *at, now_ms, c.limit, window_ms)
                        }
                        _ => 0.0,
                    };
                    eval_rate(used, c.limit, c.cost, window_ms)
                }
                Kind::Concurrency => {
                    let n = match slots.get(&*c.id) {
                        Some(Slot::Count(n)) => *n,
                        _ => 0,
                    };
                    let allowed = n < c.limit;
                    let state = CheckState {
                        remaining: c.limit.saturating_sub(n + u64::from(allowed)),
                        reset_ms: 0,
                        used: n,
                        period: 0,
                    };
                    (state, Some(CONCURRENCY_RETRY_MS), allowed)
                }
                Kind::Daily | Kind::Monthly => {
                    let (id, end) = period(c.kind, now_ms as i64);
                    let used = match slots.get(&*c.id) {
                        Some(Slot::Budget { period, used }) if *period == id => *used,
                        _ => 0,
                    };
                    let allowed = used.saturating_add(c.cost) <= c.limit;
                    let state = CheckState {
                        remaining: c
                            .limit
                            .saturating_sub(used + if allowed { c.cost } else { 0 }),
                        reset_ms: (end - now_ms as i64).max(0) as u64,
                        used,
                        period: id,
                    };
                    let retry = (c.cost <= c.limit).then_some(state.reset_ms.max(1));
                    (state, retry, allowed)
                }
            };
            if !allowed && decision.refused.is_none() {
                decision.refused = Some((i, retry));
            }
            decision.states.push(state);
        }
        if decision.refused.is_some() {
            return decision;
        }
        for (c, s) in checks.iter().zip(&decision.states) {
            let slot = match c.kind {
                Kind::Requests | Kind::Tokens => Slot::Rate {
                    used: match slots.get(&*c.id) {
                        Some(Slot::Rate { used, at }) => {
                            drained(*used, *at, now_ms, c.limit, window_ms)
                        }
                        _ => 0.0,
                    } + c.cost as f64,
                    at: now_ms,
                },
                Kind::Concurrency => Slot::Count(s.used + 1),
                Kind::Daily | Kind::Monthly => Slot::Budget {
                    period: s.period,
                    used: s.used + c.cost,
                },
            };
            slots.insert(c.id.clone(), slot);
        }
        decision
    }

    /// Give back what an admitted request took: `delta` tokens more (or fewer, negative) than
    /// reserved on token checks; the concurrency slots. `periods` are the budget periods the
    /// request was admitted in.
    pub fn settle(
        &self,
        checks: &[Check],
        periods: &[i64],
        delta: i64,
        window_ms: f64,
        now_ms: f64,
    ) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        for (i, c) in checks.iter().enumerate() {
            let Some(slot) = slots.get_mut(&*c.id) else {
                continue;
            };
            match (c.kind, slot) {
                (Kind::Tokens, Slot::Rate { used, at }) if delta != 0 => {
                    let now_used = drained(*used, *at, now_ms, c.limit, window_ms);
                    *used = (now_used + delta as f64).max(0.0);
                    *at = now_ms;
                }
                (Kind::Concurrency, Slot::Count(n)) => *n = n.saturating_sub(1),
                (Kind::Daily | Kind::Monthly, Slot::Budget { period, used })
                    if periods.get(i).copied() == Some(*period) =>
                {
                    *used = used.saturating_add_signed(delta);
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::{checks, Scope};
    use super::*;
    use crate::config::validate::LimitSet;

    fn set(rpm: Option<u32>, tpm: Option<u64>, conc: Option<u32>) -> LimitSet {
        LimitSet {
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
            max_concurrent: conc,
            ..LimitSet::default()
        }
    }

    #[test]
    fn requests_refill_continuously() {
        let s = LocalStore::default();
        let c = checks("k", set(Some(10), None, None), "t", None, 0);
        let w = 60_000.0;
        for i in 0..10 {
            let d = s.admit(&c, w, 1000.0);
            assert!(d.refused.is_none(), "request {i}");
            assert_eq!(d.states[0].remaining, 9 - i);
        }
        let d = s.admit(&c, w, 1000.0);
        let (idx, retry) = d.refused.unwrap();
        assert_eq!(idx, 0);
        assert_eq!(retry, Some(6000));
        assert!(s.admit(&c, w, 7000.0).refused.is_none());
        assert!(s.admit(&c, w, 7000.0).refused.is_some());
    }

    #[test]
    fn all_or_nothing_across_scopes() {
        let s = LocalStore::default();
        let a = checks(
            "a",
            set(Some(5), None, None),
            "team",
            Some(set(Some(1), None, None)),
            0,
        );
        let b = checks(
            "b",
            set(Some(5), None, None),
            "team",
            Some(set(Some(1), None, None)),
            0,
        );
        assert!(s.admit(&a, 60_000.0, 0.0).refused.is_none());
        let d = s.admit(&b, 60_000.0, 0.0);
        assert_eq!(d.refused.map(|r| r.0), Some(1));
        assert_eq!(c_scope(&b, 1), Scope::Tenant);
        // b's own meter was not touched by the refused request.
        assert_eq!(s.admit(&b[..1], 60_000.0, 0.0).states[0].remaining, 4);
    }

    fn c_scope(c: &[Check], i: usize) -> Scope {
        c[i].scope
    }

    #[test]
    fn token_reservation_reconciled_and_refunded() {
        let s = LocalStore::default();
        let w = 60_000.0;
        let c = checks("k", set(None, Some(1000), Some(1)), "t", None, 600);
        let d = s.admit(&c, w, 0.0);
        assert!(d.refused.is_none());
        assert_eq!(d.states[1].remaining, 400);
        // concurrency 1 is taken
        assert!(s.admit(&c, w, 0.0).refused.is_some());
        // used only 100 of 600
        s.settle(&c, &[0, 0], -500, w, 0.0);
        let d = s.admit(&c, w, 0.0);
        assert!(d.refused.is_none());
        assert_eq!(d.states[1].remaining, 300);
        // failure: full refund
        s.settle(&c, &[0, 0], -600, w, 0.0);
        let big = checks("k", set(None, Some(1000), None), "t", None, 1001);
        let d = s.admit(&big, w, 0.0);
        assert_eq!(d.refused, Some((0, None)), "larger than the limit: never");
    }

    #[test]
    fn budgets_per_day() {
        let s = LocalStore::default();
        let l = LimitSet {
            daily_tokens: Some(100),
            ..LimitSet::default()
        };
        let c = checks("k", l, "t", None, 60);
        let now = 5.0 * 86_400_000.0 + 10.0;
        assert!(s.admit(&c, 60_000.0, now).refused.is_none());
        let d = s.admit(&c, 60_000.0, now);
        assert_eq!(d.refused.map(|r| r.0), Some(0));
        // next day
        assert!(s.admit(&c, 60_000.0, now + 86_400_000.0).refused.is_none());
    }
}
