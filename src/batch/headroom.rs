//! Whether the fleet has room for one more batch line now, by the signals routing already
//! has: no interactive request waits in the gateway's queue, and some candidate of the line's
//! model is routable, below its concurrency cap, and would not queue the request inside its
//! engine ([`would_queue`]: the batch is full by the gateway's count or the engine's, or the
//! engine reports requests waiting).
//!
//! Invariant: a line that leaves a model with no free batch slot is never dispatched, so an
//! interactive request that arrives next finds a slot; a line the request path will refuse at
//! once (no model, an unknown one) has nothing to wait for.

use crate::gateway::Gateway;
use crate::routing::score::would_queue;

/// Room for one line of `model` now.
pub fn has_room(gw: &Gateway, model: Option<&str>) -> bool {
    if !gw.queue.is_empty() {
        return false;
    }
    let Some(model) = model else {
        return true;
    };
    let rt = gw.runtime();
    let Some(resolved) = rt.fleet.resolve(model) else {
        return true;
    };
    resolved
        .candidates
        .iter()
        .any(|(b, served)| b.state.routable() && b.has_slot() && !would_queue(b, served))
}
