//! DNS discovery: a `[[discovery]]` name that resolves to many addresses (a Kubernetes headless
//! Service, a round-robin record) becomes one backend per address, re-resolved every
//! `interval`.
//!
//! Members are named `<entry>@<ip>:<port>`, so a member keeps its state (health, ejections)
//! for as long as its address stays in the answer. Invariants: a failed or empty resolution
//! keeps the previous members (a DNS blip must not empty the pool); an address that leaves the
//! answer leaves the fleet and drains (no new requests, in-flight ones finish).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Mutex;

use crate::config::validate::{parse_backend_url, DiscoveryConfig};
use crate::config::{BackendConfig, Timeouts};

/// Resolve `host:port` to its addresses, sorted and without duplicates.
pub async fn resolve(host: &str, port: u16) -> std::io::Result<Vec<SocketAddr>> {
    let mut addrs: Vec<SocketAddr> = tokio::net::lookup_host((host, port)).await?.collect();
    addrs.sort();
    addrs.dedup();
    Ok(addrs)
}

/// The backends of one entry for the given addresses.
pub fn members(
    d: &DiscoveryConfig,
    addrs: &[SocketAddr],
    timeouts: Timeouts,
) -> Vec<BackendConfig> {
    addrs
        .iter()
        .filter_map(|a| {
            let url = parse_backend_url(&format!("{}://{a}", d.scheme)).ok()?;
            Some(BackendConfig {
                name: format!("{}@{a}", d.name),
                kind: d.kind,
                url,
                models: d.models.clone(),
                model_names: d.model_names.clone(),
                api_key: d.api_key.clone(),
                weight: d.weight,
                max_concurrent: d.max_concurrent,
                health_path: None,
                kv_events: Default::default(),
                max_adapters: None,
                lora_adapters: Vec::new(),
                timeouts,
            })
        })
        .collect()
}

/// The latest resolution of every discovery entry (outlives reloads; entries no longer
/// configured are forgotten by [`Discovered::retain`]).
#[derive(Debug, Default)]
pub struct Discovered {
    inner: Mutex<BTreeMap<String, Vec<SocketAddr>>>,
}

impl Discovered {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<SocketAddr>>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record a resolution of `entry`; returns whether its address set changed. An empty
    /// answer is ignored (kept as before).
    pub fn update(&self, entry: &str, addrs: Vec<SocketAddr>) -> bool {
        if addrs.is_empty() {
            return false;
        }
        let mut map = self.lock();
        if map.get(entry) == Some(&addrs) {
            return false;
        }
        map.insert(entry.to_string(), addrs);
        true
    }

    /// Forget entries that are no longer configured; returns whether any was dropped.
    pub fn retain(&self, entries: &[DiscoveryConfig]) -> bool {
        let mut map = self.lock();
        let before = map.len();
        map.retain(|k, _| entries.iter().any(|d| &d.name == k));
        map.len() != before
    }

    /// The members of every configured entry.
    pub fn configs(&self, entries: &[DiscoveryConfig], timeouts: Timeouts) -> Vec<BackendConfig> {
        let map = self.lock();
        entries
            .iter()
            .flat_map(|d| members(d, map.get(&d.name).map_or(&[][..], Vec::as_slice), timeouts))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::BackendKind;
    use std::time::Duration;

    fn entry() -> DiscoveryConfig {
        DiscoveryConfig {
            name: "pool".into(),
            kind: BackendKind::Vllm,
            scheme: "http".into(),
            host: "localhost".into(),
            port: 8000,
            models: vec!["m".into()],
            model_names: BTreeMap::new(),
            api_key: None,
            weight: 1,
            max_concurrent: None,
            interval: Duration::from_secs(5),
        }
    }

    #[test]
    fn members_named_by_address_and_blips_ignored() {
        let d = Discovered::default();
        let a: SocketAddr = "127.0.0.1:8000".parse().unwrap();
        let b: SocketAddr = "[::1]:8000".parse().unwrap();
        assert!(d.update("pool", vec![a, b]));
        assert!(!d.update("pool", vec![a, b]));
        let names: Vec<_> = d
            .configs(&[entry()], Timeouts::default())
            .into_iter()
            .map(|c| (c.name, c.url.to_string()))
            .collect();
        assert_eq!(
            names,
            vec![
                (
                    "pool@127.0.0.1:8000".to_string(),
                    "http://127.0.0.1:8000/".to_string()
                ),
                (
                    "pool@[::1]:8000".to_string(),
                    "http://[::1]:8000/".to_string()
                )
            ]
        );
        assert!(!d.update("pool", vec![])); // a blip keeps the members
        assert_eq!(d.configs(&[entry()], Timeouts::default()).len(), 2);
        assert!(d.update("pool", vec![a])); // one address left the answer
        assert_eq!(d.configs(&[entry()], Timeouts::default()).len(), 1);
        assert!(d.retain(&[]));
        assert!(d.configs(&[entry()], Timeouts::default()).is_empty());
    }

    #[tokio::test]
    async fn localhost_resolves_on_loopback() {
        let addrs = resolve("localhost", 8000).await.unwrap();
        assert!(addrs
            .iter()
            .all(|a| a.ip().is_loopback() && a.port() == 8000));
        assert!(!addrs.is_empty());
    }
}
