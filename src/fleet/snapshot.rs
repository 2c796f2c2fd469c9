//! The backends of one config snapshot, and model resolution.
//!
//! Resolution: a client's model name goes through the `[[models]]` aliases to its canonical name;
//! the candidates are the backends that serve that name (configured or discovered), each with the
//! name that backend knows it by. A fleet is rebuilt on every reload, reusing the
//! [`BackendState`] of backends whose name, kind and URL did not change.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::{Backend, BackendState};
use crate::config::{BackendConfig, BackendKind, Config, PolicyKind};
use crate::upstream::BackendTls;

/// The fleet of one config snapshot.
#[derive(Debug, Default)]
pub struct Fleet {
    pub backends: Vec<Arc<Backend>>,
    aliases: HashMap<String, String>,
    policies: HashMap<String, PolicyKind>,
    /// The backends' TLS client configuration, from this snapshot's `[backend_tls]`.
    tls: BackendTls,
}

/// The candidates for one request.
#[derive(Debug)]
pub struct Resolved {
    pub canonical: String,
    /// Each backend serving the model, with the model's name on that backend.
    pub candidates: Vec<(Arc<Backend>, String)>,
    pub policy: Option<PolicyKind>,
}

/// One entry of `/v1/models`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelEntry {
    pub id: String,
    pub owned_by: String,
    /// Backends serving it now.
    pub backends: Vec<String>,
    /// The smallest context length its backends report (what every one of them can take);
    /// `None` when none reports one.
    pub context_length: Option<u64>,
}

impl Fleet {
    /// Build the fleet for `config`, keeping the state of unchanged backends of `previous`.
    pub fn build(config: &Config, previous: Option<&Fleet>) -> Fleet {
        Fleet::build_with(config, &[], previous)
    }

    /// Like [`Fleet::build`], plus run-time members (registered, DNS-discovered) after the
    /// configured backends; a member whose name is already taken is left out.
    pub fn build_with(
        config: &Config,
        members: &[BackendConfig],
        previous: Option<&Fleet>,
    ) -> Fleet {
        let tls = BackendTls::build(&config.backend_tls, previous.map(|p| &p.tls));
        let mut backends: Vec<Arc<Backend>> =
            Vec::with_capacity(config.backends.len() + members.len());
        for bc in config.backends.iter().chain(members.iter()) {
            if backends.iter().any(|b| b.name() == bc.name) {
                continue;
            }
            let state = previous
                .and_then(|p| p.get(&bc.name))
                .filter(|old| old.config.kind == bc.kind && old.config.url == bc.url)
                .map(|old| old.state.clone())
                .unwrap_or_else(|| Arc::new(BackendState::new()));
            backends.push(Arc::new(Backend::with_tls(bc.clone(), state, &tls)));
        }
        let mut policies = HashMap::new();
        for m in &config.models {
            if let Some(p) = m.policy {
                policies.insert(m.name.clone(), p);
            }
        }
        Fleet {
            backends,
            aliases: config.alias_map(),
            policies,
            tls,
        }
    }

    /// The backend TLS configuration this fleet's clients use.
    pub fn tls(&self) -> &BackendTls {
        &self.tls
    }

    /// Every backend, configured ones first.
    pub fn backends(&self) -> &[Arc<Backend>] {
        &self.backends
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Backend>> {
        self.backends.iter().find(|b| b.name() == name)
    }

    /// The canonical name for a client's model name.
    pub fn canonical<'a>(&'a self, model: &'a str) -> &'a str {
        self.aliases.get(model).map(String::as_str).unwrap_or(model)
    }

    /// Whether `model` (canonical or alias) equals `allowed` (canonical or alias).
    pub fn same_model(&self, model: &str, allowed: &str) -> bool {
        self.canonical(model) == self.canonical(allowed)
    }

    /// Backends serving `model`, healthy or not; `None` if no backend serves it at all.
    pub fn resolve(&self, model: &str) -> Option<Resolved> {
        let canonical = self.canonical(model);
        let mut candidates = Vec::new();
        for b in &self.backends {
            if let Some(name) = b.serves(canonical).or_else(|| b.serves(model)) {
                candidates.push((b.clone(), name));
            }
        }
        if candidates.is_empty() {
            return None;
        }
        Some(Resolved {
            canonical: canonical.to_string(),
            candidates,
            policy: self.policies.get(canonical).copied(),
        })
    }

    /// The models at least one routable backend serves, with their aliases, sorted by name.
    pub fn models(&self) -> Vec<ModelEntry> {
        let mut by_name: BTreeMap<String, ModelEntry> = BTreeMap::new();
        for b in &self.backends {
            if !b.state.health().routable() {
                continue;
            }
            for name in b.model_names() {
                let entry = by_name.entry(name.clone()).or_insert_with(|| ModelEntry {
                    id: name.clone(),
                    owned_by: "sluice".to_string(),
                    backends: Vec::new(),
                    context_length: None,
                });
                entry.backends.push(b.name().to_string());
                // (what a model list reports: TGI's and Ollama's windows, learned for
                // routing, are not `max_model_len`)
                let listed = matches!(b.kind(), BackendKind::Vllm | BackendKind::OpenAi);
                let reported = b
                    .serves(&name)
                    .filter(|_| listed)
                    .and_then(|m| b.state.context_length(&m));
                entry.context_length = match (entry.context_length, reported) {
                    (Some(a), Some(r)) => Some(a.min(r)),
                    (a, r) => a.or(r),
                };
            }
        }
        // Aliases of served models are models too, as far as clients can tell.
        let served: Vec<(String, Vec<String>, Option<u64>)> = by_name
            .values()
            .map(|e| (e.id.clone(), e.backends.clone(), e.context_length))
            .collect();
        for (alias, canonical) in &self.aliases {
            if let Some((_, backends, context)) = served.iter().find(|(id, ..)| id == canonical) {
                by_name.entry(alias.clone()).or_insert_with(|| ModelEntry {
                    id: alias.clone(),
                    owned_by: "sluice".to_string(),
                    backends: backends.clone(),
                    context_length: *context,
                });
            }
        }
        by_name.into_values().collect()
    }

    /// Whether any backend can take a request now (for `/readyz`).
    pub fn any_routable(&self) -> bool {
        self.backends.iter().any(|b| b.state.routable())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::from_str;
    use crate::fleet::Health;

    const CFG: &str = r#"
[[models]]
name = "llama-3.1-8b"
aliases = ["llama3"]

[[backends]]
name = "gpu-a"
kind = "vllm"
url = "http://127.0.0.1:1"
models = ["llama-3.1-8b"]

[[backends]]
name = "laptop"
kind = "ollama"
url = "http://127.0.0.1:2"
models = ["llama-3.1-8b"]
model_names = { "llama-3.1-8b" = "llama3.1:8b" }
"#;

    #[test]
    fn resolve_alias_and_backend_names() {
        let f = Fleet::build(&from_str(CFG, "t").unwrap(), None);
        let r = f.resolve("llama3").unwrap();
        assert_eq!(r.canonical, "llama-3.1-8b");
        let names: Vec<_> = r
            .candidates
            .iter()
            .map(|(b, n)| (b.name().to_string(), n.clone()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("gpu-a".to_string(), "llama-3.1-8b".to_string()),
                ("laptop".to_string(), "llama3.1:8b".to_string())
            ]
        );
        assert!(f.resolve("gpt-4").is_none());
    }

    #[test]
    fn models_lists_served_and_aliases_skipping_down_backends() {
        let f = Fleet::build(&from_str(CFG, "t").unwrap(), None);
        let ids: Vec<_> = f.models().into_iter().map(|m| m.id).collect();
        assert_eq!(ids, vec!["llama-3.1-8b", "llama3"]);
        for b in &f.backends {
            b.state.set_health(Health::Down);
        }
        assert!(f.models().is_empty());
    }

    #[test]
    fn state_survives_rebuild_when_unchanged() {
        let c = from_str(CFG, "t").unwrap();
        let f1 = Fleet::build(&c, None);
        f1.backends[0].state.set_health(Health::Down);
        let f2 = Fleet::build(&c, Some(&f1));
        assert!(Arc::ptr_eq(&f1.backends[0].state, &f2.backends[0].state));
        let changed = CFG.replace("127.0.0.1:1", "127.0.0.1:3");
        let f3 = Fleet::build(&from_str(&changed, "t").unwrap(), Some(&f2));
        assert!(!Arc::ptr_eq(&f1.backends[0].state, &f3.backends[0].state));
    }
}
