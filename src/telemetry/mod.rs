//! Logs and metrics: the log subscriber's setup ([`logs`]), every metric name in one place
//! ([`metrics`]), and the one access-log line per request ([`access`]).
//!
//! Invariant: no prompt, completion or key is ever logged or used as a label; labels are
//! low-cardinality (backend, model, tenant, endpoint, status class).

pub mod access;
pub mod logs;
pub mod metrics;
