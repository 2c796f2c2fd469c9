//! Validation of a [`FileConfig`] into the runtime [`Config`]: defaults applied, `${ENV}`
//! expanded, addresses and URLs parsed, ranges and cross-references checked. One file per
//! section; [`validate`] calls them one after another and collects what they report.
//!
//! Invariants: every problem is collected with its location (`backends[2].url: …`) so one run
//! of `sluice check` shows them all; a value out of its documented range is a problem, never
//! clamped or replaced silently (the placeholder a checker returns beside a problem is never
//! used, because a config with problems is rejected whole).

mod admin;
mod backends;
mod batch;
mod health;
mod keys;
mod membership;
mod passthrough;
mod routing;
mod server;
mod tls;
mod tracing;

use std::collections::HashSet;
use std::fmt::Display;
use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::PathBuf;
use std::time::Duration;

use super::env::{expand, Env};
use super::file::{FileConfig, ReloadSection};

pub use super::runtime::*;
pub use backends::parse_backend_url;
pub use keys::parse_key_hash;

/// Validate a parsed file.
pub fn validate(f: FileConfig, env: &dyn Env) -> Result<Config, Vec<String>> {
    let mut p = Problems(Vec::new());
    let server = server::server(&mut p, &f.server, env);
    let admin = f.admin.as_ref().and_then(|a| admin::admin(&mut p, a, env));
    let routing = routing::routing(&mut p, &f.routing);
    let health = health::health(&mut p, &f.health);
    let backend_timeouts = backends::timeouts(&mut p, "timeouts", &f.timeouts, Timeouts::default());
    let models = backends::models(&mut p, &f.models);
    let adapters = backends::adapters(&mut p, &f.adapters, &models);
    let backends = backends::backends(&mut p, &f.backends, backend_timeouts, env);
    let keys = keys::keys(&mut p, &f.keys);
    let tenants = keys::tenants(&mut p, &f.tenants);
    let limits = keys::limits(&mut p, &f.limits);
    let redis_url = keys::redis_url(&mut p, &f.limits, env);
    let membership = membership::membership(&mut p, &f, env);
    let queue = membership::queue(&mut p, &f.queue);
    let (tls, backend_tls) = tls::tls(&mut p, &f, env);
    let reload = reload(&mut p, &f.reload);
    let trace = f.trace.as_ref().map(|t| PathBuf::from(t.path.trim()));
    if trace.as_ref().is_some_and(|t| t.as_os_str().is_empty()) {
        p.push("trace.path", "must name a file");
    }
    let passthrough = passthrough::rules(&mut p, &f);
    let batch = f
        .batch
        .as_ref()
        .map(|b| batch::batch(&mut p, b, &passthrough, redis_url.as_deref()));
    let tracing = tracing::tracing(&mut p, &f.tracing, env);
    if !p.0.is_empty() {
        return Err(p.0);
    }
    Ok(Config {
        server,
        admin,
        routing,
        health,
        backends,
        models,
        adapters,
        keys,
        redis_url,
        tenants,
        limits,
        hide_disallowed_models: f.auth.hide_disallowed_models.unwrap_or(false),
        backend_timeouts,
        membership,
        queue,
        tls,
        backend_tls,
        reload,
        passthrough,
        source: None,
        trace,
        batch,
        tracing,
    })
}

/// The paths under `/v1/` Sluice serves itself, which no `[[passthrough]]` rule may take.
pub fn passthrough_served() -> &'static [&'static str] {
    passthrough::SERVED
}

/// The smallest `[reload] interval`: the watcher does not poll more often.
const MIN_RELOAD_INTERVAL: Duration = Duration::from_millis(10);

/// `[reload]`.
fn reload(p: &mut Problems, r: &ReloadSection) -> ReloadConfig {
    ReloadConfig {
        watch: r.watch.unwrap_or(true),
        interval: duration_at_least(
            p,
            "reload.interval",
            &r.interval,
            Duration::from_secs(1),
            MIN_RELOAD_INTERVAL,
        ),
    }
}

/// Every problem found so far, each `location: what is wrong`.
struct Problems(Vec<String>);

impl Problems {
    fn push(&mut self, at: impl Display, what: impl Display) {
        self.0.push(format!("{at}: {what}"));
    }
}

/// The `name` at `at` is not empty and is not taken yet by another `what` (kept in `names`).
fn unique_name(p: &mut Problems, names: &mut HashSet<String>, at: &str, name: &str, what: &str) {
    if name.trim().is_empty() {
        p.push(format!("{at}.name"), "is empty");
    } else if !names.insert(name.to_string()) {
        p.push(
            format!("{at}.name"),
            format!("`{name}` is used by another {what}"),
        );
    }
}

/// A duration greater than zero, `default` when unset.
fn duration(p: &mut Problems, at: &str, v: &Option<String>, default: Duration) -> Duration {
    match v {
        None => default,
        Some(s) => match humantime::parse_duration(s) {
            Ok(d) if !d.is_zero() => d,
            Ok(_) => {
                p.push(at, "must be greater than zero");
                default
            }
            Err(e) => {
                p.push(
                    at,
                    format!("`{s}` is not a duration like \"500ms\" or \"30s\" ({e})"),
                );
                default
            }
        },
    }
}

/// A duration of at least `min`, `default` when unset.
fn duration_at_least(
    p: &mut Problems,
    at: &str,
    v: &Option<String>,
    default: Duration,
    min: Duration,
) -> Duration {
    let d = duration(p, at, v, default);
    if d < min {
        p.push(
            at,
            format!("must be at least {}", humantime::format_duration(min)),
        );
    }
    d
}

/// A duration where `"0s"` means "off".
fn zero_ok_duration(p: &mut Problems, at: &str, v: &Option<String>, default: Duration) -> Duration {
    match v.as_deref().map(str::trim) {
        Some("0") | Some("0s") | Some("0ms") => Duration::ZERO,
        _ => duration(p, at, v, default),
    }
}

/// `v` (or `default` when unset) when it lies in `range`; else a problem at `at`.
fn in_range<T: TryFrom<u64>>(
    p: &mut Problems,
    at: &str,
    v: Option<u64>,
    default: T,
    range: RangeInclusive<u64>,
) -> T {
    match v {
        None => default,
        Some(n) if range.contains(&n) => fits(p, at, n, default),
        Some(_) => {
            p.push(
                at,
                format!("must be between {} and {}", range.start(), range.end()),
            );
            default
        }
    }
}

/// `v` (or `default` when unset) when it is at least `min`; else a problem at `at`.
fn at_least<T: TryFrom<u64>>(
    p: &mut Problems,
    at: &str,
    v: Option<u64>,
    default: T,
    min: u64,
) -> T {
    match v {
        None => default,
        Some(n) if n >= min => fits(p, at, n, default),
        Some(_) => {
            p.push(at, format!("must be at least {min}"));
            default
        }
    }
}

/// `n` as a `T` (a `usize` on a 32-bit platform may not hold it); else a problem at `at`.
fn fits<T: TryFrom<u64>>(p: &mut Problems, at: &str, n: u64, default: T) -> T {
    T::try_from(n).unwrap_or_else(|_| {
        p.push(at, format!("{n} is too large for this platform"));
        default
    })
}

fn addr(p: &mut Problems, at: &str, v: &str, env: &dyn Env) -> Option<SocketAddr> {
    let v = match expand(v, env) {
        Ok(v) => v,
        Err(e) => {
            p.push(at, e);
            return None;
        }
    };
    match v.parse::<SocketAddr>() {
        Ok(a) => Some(a),
        Err(_) => {
            p.push(
                at,
                format!("`{v}` is not an address like \"127.0.0.1:8080\""),
            );
            None
        }
    }
}

/// A `${ENV}`-expanded secret; empty is a problem.
fn secret(p: &mut Problems, at: &str, v: &Option<String>, env: &dyn Env) -> Option<String> {
    let v = v.as_ref()?;
    match expand(v, env) {
        Ok(s) if s.is_empty() => {
            p.push(at, "is empty");
            None
        }
        Ok(s) => Some(s),
        Err(e) => {
            p.push(at, e);
            None
        }
    }
}

#[cfg(test)]
mod tests;
