//! `[routing]`: the default policy, failover and token-aware tuning.

use std::str::FromStr;
use std::time::Duration;

use super::{at_least, duration, in_range, Problems};
use crate::config::file::RoutingSection;
use crate::config::runtime::{PolicyKind, RoutingConfig};

/// Most attempts a request may make across backends.
const MAX_ATTEMPTS: u64 = 16;

pub(super) fn routing(p: &mut Problems, r: &RoutingSection) -> RoutingConfig {
    let policy = match r.policy.as_deref() {
        None => PolicyKind::TokenAware,
        Some(s) => PolicyKind::from_str(s).unwrap_or_else(|e| {
            p.push("routing.policy", e);
            PolicyKind::TokenAware
        }),
    };
    RoutingConfig {
        policy,
        max_attempts: in_range(
            p,
            "routing.max_attempts",
            r.max_attempts.map(u64::from),
            3,
            1..=MAX_ATTEMPTS,
        ),
        failover_deadline: duration(
            p,
            "routing.failover_deadline",
            &r.failover_deadline,
            Duration::from_secs(15),
        ),
        default_max_tokens: r.default_max_tokens.unwrap_or(256),
        expose_backend_header: r.expose_backend_header.unwrap_or(false),
        // Two choices among two backends is a full scan, so 2 is the smallest meaningful value.
        p2c_above: at_least(p, "routing.p2c_above", r.p2c_above.map(|n| n as u64), 16, 2),
        tokenize_above: r.tokenize_above.unwrap_or(0),
        tokenize_timeout: duration(
            p,
            "routing.tokenize_timeout",
            &r.tokenize_timeout,
            Duration::from_millis(250),
        ),
        hedge: r.hedge.unwrap_or(false),
        continue_streams: r.continue_streams.unwrap_or(true),
    }
}
