//! Logs and metrics: the log subscriber's setup ([`logs`]), every metric name in one place
//! ([`metrics`]), metric handles kept per label set for the request path ([`handles`]), and the
//! one access-log line per request ([`access`]), and OpenTelemetry traces ([`otel`]).
//!
//! Invariant: no prompt, completion or key is ever logged or used as a label; labels are
//! low-cardinality (backend, model, tenant, endpoint, status class).

pub mod access;
pub mod handles;
pub mod logs;
pub mod metrics;
pub mod otel;
pub mod trace;
