//! `least-request`: fewest in-flight requests per unit of weight.

use super::{argmin, Pick, Policy};

pub struct LeastRequest;

impl Policy for LeastRequest {
    fn choose(&self, pick: &Pick<'_>) -> usize {
        argmin(pick.backends, |i| {
            let b = pick.backends[i];
            b.state.inflight_requests() as f64 / f64::from(b.config.weight)
        })
    }
}
