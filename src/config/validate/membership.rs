//! `[registration]`, `[[discovery]]` and `[queue]`: run-time fleet membership and the wait
//! queue for saturated backends.

use std::collections::HashSet;
use std::str::FromStr;
use std::time::Duration;

use super::{at_least, duration, fits, secret, Problems};
use crate::config::env::Env;
use crate::config::file::{DiscoverySection, FileConfig, QueueSection};
use crate::config::runtime::{BackendKind, DiscoveryConfig, MembershipConfig, QueueConfig};

/// `[registration]` and `[[discovery]]` (whose names must not clash with `[[backends]]`).
pub(super) fn membership(p: &mut Problems, f: &FileConfig, env: &dyn Env) -> MembershipConfig {
    let r = &f.registration;
    let default_ttl = duration(p, "registration.ttl", &r.ttl, Duration::from_secs(30));
    let max_ttl = duration(
        p,
        "registration.max_ttl",
        &r.max_ttl,
        Duration::from_secs(3600),
    );
    // A registration's TTL is capped at max_ttl: a default above it would be cut silently.
    if default_ttl > max_ttl {
        p.push(
            "registration.ttl",
            format!(
                "must not exceed registration.max_ttl ({})",
                humantime::format_duration(max_ttl)
            ),
        );
    }
    let mut discovery = Vec::new();
    let mut names = HashSet::new();
    for (i, d) in f.discovery.iter().enumerate() {
        let at = format!("discovery[{i}]");
        if d.name.trim().is_empty() || d.name.contains('@') {
            p.push(format!("{at}.name"), "must be non-empty and without `@`");
        } else if !names.insert(d.name.clone()) || f.backends.iter().any(|b| b.name == d.name) {
            p.push(format!("{at}.name"), format!("`{}` is used twice", d.name));
        }
        discovery.push(discovered(p, &at, d, env));
    }
    MembershipConfig {
        default_ttl,
        max_ttl,
        discovery,
    }
}

/// One `[[discovery]]` entry, checked.
fn discovered(p: &mut Problems, at: &str, d: &DiscoverySection, env: &dyn Env) -> DiscoveryConfig {
    let kind = BackendKind::from_str(&d.kind).unwrap_or_else(|e| {
        p.push(format!("{at}.kind"), e);
        BackendKind::OpenAi
    });
    let scheme = d.scheme.clone().unwrap_or_else(|| "http".into());
    if scheme != "http" && scheme != "https" {
        p.push(format!("{at}.scheme"), "must be http or https");
    }
    if d.host.trim().is_empty() {
        p.push(format!("{at}.host"), "is empty");
    }
    if d.port == 0 {
        p.push(format!("{at}.port"), "must be 1..65535");
    }
    let weight = at_least(p, &format!("{at}.weight"), d.weight.map(u64::from), 1, 1);
    if d.max_concurrent == Some(0) {
        p.push(format!("{at}.max_concurrent"), "must be at least 1");
    }
    DiscoveryConfig {
        name: d.name.clone(),
        kind,
        scheme,
        host: d.host.clone(),
        port: d.port,
        models: d.models.clone(),
        model_names: d.model_names.clone(),
        api_key: secret(p, &format!("{at}.api_key"), &d.api_key, env),
        weight,
        max_concurrent: d.max_concurrent,
        interval: duration(
            p,
            &format!("{at}.interval"),
            &d.interval,
            Duration::from_secs(5),
        ),
    }
}

/// `[queue]`.
pub(super) fn queue(p: &mut Problems, q: &QueueSection) -> QueueConfig {
    QueueConfig {
        size: q.size.map_or(1024, |n| fits(p, "queue.size", n, 1024)),
        timeout: duration(p, "queue.timeout", &q.timeout, Duration::from_secs(5)),
    }
}
