//! The registration API's state: backends that announced themselves at run time
//! (`POST /admin/backends`, e.g. a Slurm job, a Ray or Kubernetes pod) and keep their place by
//! heartbeating within their TTL.
//!
//! Invariants: a registration lives until its TTL passes without a heartbeat or it is
//! deregistered; registered members survive config reloads (the gateway adds them to every
//! fleet snapshot it builds); a name used by a configured backend, or containing `@` (reserved
//! for DNS-discovered members), cannot be registered.

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use serde::Deserialize;
use tokio::time::Instant;

use crate::config::validate::parse_backend_url;
use crate::config::{BackendConfig, BackendKind, Config};

/// Why a registration was refused.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    #[error("{0}")]
    Invalid(String),
    #[error("`{0}` is a configured backend; registered members need their own names")]
    Conflict(String),
}

/// The body of `POST /admin/backends`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterRequest {
    pub name: String,
    pub kind: String,
    pub url: String,
    #[serde(default)]
    pub models: Vec<String>,
    #[serde(default)]
    pub model_names: BTreeMap<String, String>,
    pub api_key: Option<String>,
    pub weight: Option<u32>,
    pub max_concurrent: Option<u32>,
    pub health_path: Option<String>,
    /// e.g. "30s"; default `registration.ttl`, at most `registration.max_ttl`.
    pub ttl: Option<String>,
}

impl RegisterRequest {
    /// Validate into a backend config and its TTL.
    pub fn validate(self, config: &Config) -> Result<(BackendConfig, Duration), RegisterError> {
        let bad = |s: String| RegisterError::Invalid(s);
        let name = self.name.trim().to_string();
        if name.is_empty() || name.len() > 200 || name.contains('@') {
            return Err(bad("name: must be 1..200 characters without `@`".into()));
        }
        if config.backends.iter().any(|b| b.name == name) {
            return Err(RegisterError::Conflict(name));
        }
        let kind: BackendKind = self
            .kind
            .parse()
            .map_err(|e: String| bad(format!("kind: {e}")))?;
        let url = parse_backend_url(&self.url).map_err(|e| bad(format!("url: {e}")))?;
        if self.weight == Some(0) {
            return Err(bad("weight: must be at least 1".into()));
        }
        if self.max_concurrent == Some(0) {
            return Err(bad("max_concurrent: must be at least 1".into()));
        }
        if let Some(p) = &self.health_path {
            if !p.starts_with('/') {
                return Err(bad("health_path: must start with /".into()));
            }
        }
        for client in self.model_names.keys() {
            if !self.models.is_empty() && !self.models.contains(client) {
                return Err(bad(format!("model_names: `{client}` is not in models")));
            }
        }
        let m = &config.membership;
        let ttl = match &self.ttl {
            None => m.default_ttl,
            Some(s) => humantime::parse_duration(s)
                .map_err(|e| bad(format!("ttl: `{s}` is not a duration like \"30s\" ({e})")))?,
        };
        if ttl.is_zero() {
            return Err(bad("ttl: must be greater than zero".into()));
        }
        let ttl = ttl.min(m.max_ttl);
        Ok((
            BackendConfig {
                name,
                kind,
                url,
                models: self.models,
                model_names: self.model_names,
                api_key: self.api_key.filter(|k| !k.is_empty()),
                weight: self.weight.unwrap_or(1),
                max_concurrent: self.max_concurrent,
                health_path: self.health_path,
                kv_events: Default::default(),
                max_adapters: None,
                lora_adapters: Vec::new(),
                timeouts: config.backend_timeouts,
            },
            ttl,
        ))
    }
}

#[derive(Debug, Clone)]
struct Entry {
    config: BackendConfig,
    ttl: Duration,
    expires: Instant,
}

/// One registration as `/admin/backends` shows it.
#[derive(Debug, Clone)]
pub struct RegistrationInfo {
    pub name: String,
    pub ttl: Duration,
    pub expires_in: Duration,
}

/// The registered members of one gateway (outlive reloads).
#[derive(Debug, Default)]
pub struct Registrations {
    inner: Mutex<BTreeMap<String, Entry>>,
}

impl Registrations {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Entry>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Register or re-register (a re-registration is also a heartbeat). Returns whether the
    /// member set changed (new name or different config).
    pub fn register(&self, config: BackendConfig, ttl: Duration) -> bool {
        let mut map = self.lock();
        let expires = Instant::now() + ttl;
        let changed = map.get(&config.name).is_none_or(|e| e.config != config);
        map.insert(
            config.name.clone(),
            Entry {
                config,
                ttl,
                expires,
            },
        );
        changed
    }

    /// Extend a registration by its TTL. `None` if it is not registered (any more).
    pub fn heartbeat(&self, name: &str) -> Option<Duration> {
        let mut map = self.lock();
        let e = map.get_mut(name)?;
        e.expires = Instant::now() + e.ttl;
        Some(e.ttl)
    }

    pub fn deregister(&self, name: &str) -> bool {
        self.lock().remove(name).is_some()
    }

    /// Drop the registrations whose TTL passed; returns their names.
    pub fn expire(&self) -> Vec<String> {
        let now = Instant::now();
        let mut map = self.lock();
        let gone: Vec<String> = map
            .iter()
            .filter(|(_, e)| e.expires <= now)
            .map(|(n, _)| n.clone())
            .collect();
        for n in &gone {
            map.remove(n);
        }
        gone
    }

    /// Drop registrations whose name a (re)loaded config now uses for a configured backend.
    pub fn drop_shadowed(&self, configured: &HashSet<&str>) {
        self.lock().retain(|n, _| !configured.contains(n.as_str()));
    }

    /// The registered members' configs.
    pub fn configs(&self) -> Vec<BackendConfig> {
        self.lock().values().map(|e| e.config.clone()).collect()
    }

    pub fn info(&self, name: &str) -> Option<RegistrationInfo> {
        let now = Instant::now();
        self.lock().get(name).map(|e| RegistrationInfo {
            name: name.to_string(),
            ttl: e.ttl,
            expires_in: e.expires.saturating_duration_since(now),
        })
    }

    /// The soonest expiry, to know when to check again.
    pub fn next_expiry(&self) -> Option<Instant> {
        self.lock().values().map(|e| e.expires).min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(name: &str, ttl: Option<&str>) -> RegisterRequest {
        RegisterRequest {
            name: name.into(),
            kind: "vllm".into(),
            url: "http://127.0.0.1:9".into(),
            models: vec!["m".into()],
            model_names: BTreeMap::new(),
            api_key: None,
            weight: None,
            max_concurrent: None,
            health_path: None,
            ttl: ttl.map(str::to_string),
        }
    }

    #[test]
    fn validates_and_caps_ttl() {
        let c = crate::config::from_str(
            "[registration]\nttl = \"10s\"\nmax_ttl = \"1m\"\n[[backends]]\nname = \"fixed\"\nkind = \"vllm\"\nurl = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\n",
            "t",
        )
        .unwrap();
        let (_, ttl) = req("a", None).validate(&c).unwrap();
        assert_eq!(ttl, Duration::from_secs(10));
        let (_, ttl) = req("a", Some("2h")).validate(&c).unwrap();
        assert_eq!(ttl, Duration::from_secs(60));
        assert!(matches!(
            req("fixed", None).validate(&c),
            Err(RegisterError::Conflict(_))
        ));
        assert!(req("x@y", None).validate(&c).is_err());
        assert!(req("a", Some("soon")).validate(&c).is_err());
    }

    #[tokio::test]
    async fn heartbeat_extends_and_expiry_removes() {
        let c = Config::empty();
        let r = Registrations::default();
        let (cfg, _) = req("a", None).validate(&c).unwrap();
        assert!(r.register(cfg.clone(), Duration::from_millis(30)));
        assert!(!r.register(cfg, Duration::from_millis(30)));
        assert!(r.heartbeat("a").is_some());
        assert!(r.expire().is_empty());
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert_eq!(r.expire(), vec!["a".to_string()]);
        assert!(r.heartbeat("a").is_none());
    }
}
