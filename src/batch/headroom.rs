//! How many batch lines the fleet has room for now, by the signals routing already has.
//!
//! Room for a model is the free batch slots of its routable candidates
//! ([`free_slots`]: by the gateway's count or the engine's, none while the engine reports a
//! request waiting) less one kept for the next interactive request, at most what their step
//! budgets still allow ([`StepBudget`]), and none at all while an interactive request waits
//! in the gateway's queue. It is read once per model and dispatch round.
//!
//! Invariants: a line that would leave a model without a free slot is never started; lines
//! started in one dispatch round are taken off that round's room, because a line holds no
//! slot in the gateway's count until its task is routed; a line the request path will refuse
//! at once (no model, an unknown one) has nothing to wait for.
//!
//! [`free_slots`]: crate::routing::score::free_slots

use std::collections::HashMap;

use super::budget::StepBudget;
use crate::gateway::Gateway;
use crate::routing::score::free_slots;

/// Batch slots of a model kept free for the next interactive request.
const KEEP_FREE: usize = 1;

/// One dispatch round's room: made afresh for each round, it counts the lines started in
/// this one, per model (those of earlier rounds count in the gateway's own count once their
/// tasks have routed them, normally long before the next round).
pub struct Headroom<'a> {
    budget: &'a StepBudget,
    /// Per model: its room at its first line of the round, and the lines started since.
    this_round: HashMap<String, (usize, usize)>,
}

impl<'a> Headroom<'a> {
    pub fn new(budget: &'a StepBudget) -> Headroom<'a> {
        Headroom {
            budget,
            this_round: HashMap::new(),
        }
    }

    /// Whether one more line of `model` may start now; if so it is counted in this round.
    pub fn take(&mut self, gw: &Gateway, model: Option<&str>) -> bool {
        if !gw.queue.is_empty() {
            return false;
        }
        let Some(model) = model else {
            return true;
        };
        if !self.this_round.contains_key(model) {
            let Some(room) = room_for(gw, model, self.budget) else {
                return true;
            };
            self.this_round.insert(model.to_string(), (room, 0));
        }
        let Some((room, started)) = self.this_round.get_mut(model) else {
            return false;
        };
        if *room <= *started {
            return false;
        }
        *started += 1;
        true
    }
}

/// Lines `model` has room for: the free batch slots of its routable candidates less the one
/// kept free, and at most what their step budgets still allow; `None`: no such model.
fn room_for(gw: &Gateway, model: &str, budget: &StepBudget) -> Option<usize> {
    let rt = gw.runtime();
    let resolved = rt.fleet.resolve(model)?;
    let (free, allowed) = resolved
        .candidates
        .iter()
        .filter(|(b, _)| b.state.routable())
        .map(|(b, served)| {
            let slots = free_slots(b, served).floor();
            let allowed = match budget.allow(b) {
                Some(a) => slots.min(a.saturating_sub(b.state.background_requests()) as f64),
                None => slots,
            };
            (slots, allowed)
        })
        .fold((0.0, 0.0), |(f, a), (s, l)| (f + s, a + l));
    Some(
        (free as usize)
            .saturating_sub(KEEP_FREE)
            .min(allowed as usize),
    )
}
