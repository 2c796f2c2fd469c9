//! `[[keys]]`, `[[tenants]]` and `[limits]`: who may call, and the limits of a key, of a
//! tenant (the sum of its keys) and the defaults for keys without their own. One check,
//! [`check_limits`], covers every [`LimitSet`].

use std::collections::HashSet;
use std::time::Duration;

use super::{duration_at_least, secret, unique_name, Problems};
use crate::config::env::Env;
use crate::config::file::{KeySection, LimitsSection, TenantSection};
use crate::config::runtime::{KeyConfig, LimitSet, LimitsConfig, TenantConfig};

/// The smallest `limits.window`: rates are counted in whole milliseconds.
const MIN_WINDOW: Duration = Duration::from_millis(1);
/// The shortest `limits.concurrency_lease`.
const MIN_LEASE: Duration = Duration::from_secs(1);

/// The five limit fields of a file section, as a [`LimitSet`].
macro_rules! limit_set {
    ($s:expr) => {
        LimitSet {
            requests_per_minute: $s.requests_per_minute,
            tokens_per_minute: $s.tokens_per_minute,
            max_concurrent: $s.max_concurrent,
            daily_tokens: $s.daily_tokens,
            monthly_tokens: $s.monthly_tokens,
        }
    };
}

/// A limit that is set is at least 1 (absent means unlimited; zero would refuse everything).
fn check_limits(p: &mut Problems, at: &str, l: LimitSet) {
    let set = [
        ("requests_per_minute", l.requests_per_minute.map(u64::from)),
        ("tokens_per_minute", l.tokens_per_minute),
        ("max_concurrent", l.max_concurrent.map(u64::from)),
        ("daily_tokens", l.daily_tokens),
        ("monthly_tokens", l.monthly_tokens),
    ];
    for (field, v) in set {
        if v == Some(0) {
            p.push(format!("{at}.{field}"), "must be at least 1 (or absent)");
        }
    }
}

/// `[[keys]]`: unique names and hashes.
pub(super) fn keys(p: &mut Problems, list: &[KeySection]) -> Vec<KeyConfig> {
    let mut keys = Vec::new();
    let mut names = HashSet::new();
    let mut hashes = HashSet::new();
    for (i, k) in list.iter().enumerate() {
        let at = format!("keys[{i}]");
        if !names.insert(k.name.clone()) {
            p.push(
                format!("{at}.name"),
                format!("`{}` is used by another key", k.name),
            );
        }
        let hash = match parse_key_hash(&k.hash) {
            Ok(h) => {
                if !hashes.insert(h) {
                    p.push(format!("{at}.hash"), "the same key is configured twice");
                }
                h
            }
            Err(e) => {
                p.push(format!("{at}.hash"), e);
                [0; 32]
            }
        };
        let expires_at = k.expires_at.as_ref().and_then(|s| {
            humantime::parse_rfc3339_weak(s)
                .map_err(|e| p.push(format!("{at}.expires_at"), format!("`{s}`: {e}")))
                .ok()
        });
        let limits = limit_set!(k);
        check_limits(p, &at, limits);
        keys.push(KeyConfig {
            name: k.name.clone(),
            tenant: k.tenant.clone().unwrap_or_else(|| k.name.clone()),
            hash,
            models: k.models.clone(),
            limits,
            disabled: k.disabled,
            expires_at,
        });
    }
    keys
}

/// `[[tenants]]`: unique, non-empty names.
pub(super) fn tenants(p: &mut Problems, list: &[TenantSection]) -> Vec<TenantConfig> {
    let mut tenants = Vec::new();
    let mut names = HashSet::new();
    for (i, t) in list.iter().enumerate() {
        let at = format!("tenants[{i}]");
        unique_name(p, &mut names, &at, &t.name, "tenant");
        let limits = limit_set!(t);
        check_limits(p, &at, limits);
        tenants.push(TenantConfig {
            name: t.name.clone(),
            limits,
        });
    }
    tenants
}

/// `[limits]` beyond the Redis URL.
pub(super) fn limits(p: &mut Problems, l: &LimitsSection) -> LimitsConfig {
    let defaults = limit_set!(l);
    check_limits(p, "limits", defaults);
    LimitsConfig {
        fail_open: l.fail_open.unwrap_or(true),
        window: duration_at_least(
            p,
            "limits.window",
            &l.window,
            Duration::from_secs(60),
            MIN_WINDOW,
        ),
        defaults,
        concurrency_lease: duration_at_least(
            p,
            "limits.concurrency_lease",
            &l.concurrency_lease,
            Duration::from_secs(5 * 60),
            MIN_LEASE,
        ),
    }
}

/// `limits.redis_url`: a Redis URL or a Unix socket.
pub(super) fn redis_url(p: &mut Problems, l: &LimitsSection, env: &dyn Env) -> Option<String> {
    let url = secret(p, "limits.redis_url", &l.redis_url, env)?;
    let redis = ["redis://", "redis+unix://", "unix://"];
    if !redis.iter().any(|s| url.starts_with(s)) {
        p.push(
            "limits.redis_url",
            "must start with redis:// (or unix:// for a socket)",
        );
    }
    Some(url)
}

/// Parse `sha256:<64 hex digits>`.
pub fn parse_key_hash(s: &str) -> Result<[u8; 32], String> {
    let hex_part = s.strip_prefix("sha256:").ok_or_else(|| {
        "must look like sha256:<64 hex digits> (from `sluice key new`)".to_string()
    })?;
    let bytes =
        hex::decode(hex_part).map_err(|_| "the part after sha256: is not hex".to_string())?;
    bytes
        .try_into()
        .map_err(|_| "a SHA-256 hash has 64 hex digits".to_string())
}
