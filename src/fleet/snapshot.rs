//! The backends of one config snapshot, and model resolution.
//!
//! Resolution: a client's model name goes through the `[[models]]` aliases to its canonical name;
//! the candidates are the backends that serve that name (configured or discovered), each with the
//! name that backend knows it by. A fleet is rebuilt on every reload, reusing the
//! [`BackendState`] of backends whose name, kind and URL did not change.
//!
//! A LoRA adapter (configured in `[[adapters]]`, or listed by an engine with its base) that no
//! backend serves as a model resolves to the backends of its base model that hold it or can
//! load it (vLLM, with a configured path, unless the engine refused run-time loading), each
//! knowing it by the adapter's name; [`Resolved::adapter`] says what to load where it is
//! missing.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::{Backend, BackendState};
use crate::config::{AdapterConfig, BackendConfig, BackendKind, Config, PolicyKind};
use crate::upstream::BackendTls;

/// The fleet of one config snapshot.
#[derive(Debug, Default)]
pub struct Fleet {
    pub backends: Vec<Arc<Backend>>,
    aliases: HashMap<String, String>,
    policies: HashMap<String, PolicyKind>,
    adapters: HashMap<String, AdapterConfig>,
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
    /// The LoRA adapter the request names, when it names one.
    pub adapter: Option<Adapter>,
}

/// A LoRA adapter a request names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    pub name: String,
    /// The canonical name of its base model.
    pub base: String,
    /// Where engines load it from (`None`: not configured, served only where it is held).
    pub path: Option<String>,
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
    /// The base model of a LoRA adapter.
    pub parent: Option<String>,
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
            adapters: config
                .adapters
                .iter()
                .map(|a| (a.name.clone(), a.clone()))
                .collect(),
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

    /// Whether the allow-list entry `entry` lets a client use `model`: the same model, or
    /// `base:*` for `base` itself and every adapter of it.
    pub fn allowed_by(&self, model: &str, entry: &str) -> bool {
        if self.same_model(model, entry) {
            return true;
        }
        let Some(base) = entry.strip_suffix(":*") else {
            return false;
        };
        self.same_model(model, base)
            || self
                .adapter(model)
                .is_some_and(|a| a.base == self.canonical(base))
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
            return self.resolve_adapter(model);
        }
        Some(Resolved {
            canonical: canonical.to_string(),
            candidates,
            policy: self.policies.get(canonical).copied(),
            adapter: None,
        })
    }

    /// The adapter named `name` (configured, or listed by an engine), when it has one.
    pub fn adapter(&self, name: &str) -> Option<Adapter> {
        if let Some(a) = self.adapters.get(name) {
            return Some(Adapter {
                name: a.name.clone(),
                base: a.base.clone(),
                path: Some(a.path.clone()),
            });
        }
        let base = self
            .backends
            .iter()
            .find_map(|b| b.state.adapters().base_of(name))?;
        Some(Adapter {
            name: name.to_string(),
            base: self.canonical(&base).to_string(),
            path: None,
        })
    }

    /// The backends of an adapter's base that hold it or can load it.
    fn resolve_adapter(&self, name: &str) -> Option<Resolved> {
        let adapter = self.adapter(name)?;
        let candidates: Vec<(Arc<Backend>, String)> = self
            .backends
            .iter()
            .filter(|b| b.serves(&adapter.base).is_some())
            .filter(|b| {
                let held = b.state.adapters();
                held.holds(name)
                    || (adapter.path.is_some()
                        && b.kind() == BackendKind::Vllm
                        && held.loads_at_run_time())
            })
            .map(|b| (b.clone(), name.to_string()))
            .collect();
        if candidates.is_empty() {
            return None;
        }
        Some(Resolved {
            canonical: name.to_string(),
            candidates,
            policy: self.policies.get(&adapter.base).copied(),
            adapter: Some(adapter),
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
                    parent: None,
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
                    parent: None,
                });
            }
        }
        self.list_adapters(&mut by_name);
        by_name.into_values().collect()
    }

    /// Each adapter once, with its base: those held by a routable backend of their base, and
    /// configured ones whose base some routable backend serves and could load them.
    fn list_adapters(&self, by_name: &mut BTreeMap<String, ModelEntry>) {
        let mut names: Vec<String> = self.adapters.keys().cloned().collect();
        for b in &self.backends {
            names.extend(b.state.adapters().held().into_iter().map(|(n, _)| n));
        }
        names.sort();
        names.dedup();
        for name in names {
            if by_name.contains_key(&name) {
                continue;
            }
            let Some(Resolved {
                candidates,
                adapter: Some(adapter),
                ..
            }) = self.resolve_adapter(&name)
            else {
                continue;
            };
            let backends: Vec<String> = candidates
                .iter()
                .filter(|(b, _)| b.state.health().routable())
                .map(|(b, _)| b.name().to_string())
                .collect();
            if backends.is_empty() {
                continue;
            }
            let context_length = by_name.get(&adapter.base).and_then(|e| e.context_length);
            by_name.insert(
                name.clone(),
                ModelEntry {
                    id: name,
                    owned_by: "sluice".to_string(),
                    backends,
                    context_length,
                    parent: Some(adapter.base),
                },
            );
        }
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
