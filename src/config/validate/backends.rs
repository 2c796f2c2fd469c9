//! `[timeouts]`, `[[models]]` and `[[backends]]`: the static fleet, its model names and the
//! timeouts towards it.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use http::Uri;

use super::{at_least, duration, secret, unique_name, Problems};
use crate::config::env::{expand, Env};
use crate::config::file::{
    AdapterSection, BackendSection, KvEventsSetting, ModelSection, TimeoutsSection,
};
use crate::config::runtime::{
    AdapterConfig, BackendConfig, BackendKind, KvEvents, ModelConfig, PolicyKind, Timeouts,
};
use crate::tokenizer::Tokenizer;

/// A `timeouts` table at `at`; unset entries from `base`.
pub(super) fn timeouts(
    p: &mut Problems,
    at: &str,
    t: &TimeoutsSection,
    base: Timeouts,
) -> Timeouts {
    Timeouts {
        connect: duration(p, &format!("{at}.connect"), &t.connect, base.connect),
        first_byte: duration(
            p,
            &format!("{at}.first_byte"),
            &t.first_byte,
            base.first_byte,
        ),
        response: duration(p, &format!("{at}.response"), &t.response, base.response),
        idle: duration(p, &format!("{at}.idle"), &t.idle, base.idle),
    }
}

/// `[[models]]`: every name and alias used once.
pub(super) fn models(p: &mut Problems, list: &[ModelSection]) -> Vec<ModelConfig> {
    let mut models = Vec::new();
    let mut model_names: HashMap<String, String> = HashMap::new();
    for (i, m) in list.iter().enumerate() {
        let at = format!("models[{i}]");
        if m.name.trim().is_empty() {
            p.push(format!("{at}.name"), "is empty");
        }
        for n in std::iter::once(&m.name).chain(m.aliases.iter()) {
            if let Some(prev) = model_names.insert(n.clone(), at.clone()) {
                p.push(&at, format!("name `{n}` is already used by {prev}"));
            }
        }
        let policy = m.policy.as_deref().and_then(|s| {
            PolicyKind::from_str(s)
                .map_err(|e| p.push(format!("{at}.policy"), e))
                .ok()
        });
        models.push(ModelConfig {
            name: m.name.clone(),
            aliases: m.aliases.clone(),
            policy,
            tokenizer: m
                .tokenizer
                .as_deref()
                .and_then(|dir| tokenizer(p, &at, dir)),
        });
    }
    models
}

/// A backend's `lora_adapters`: TGI only (vLLM lists its adapters itself), and with its
/// `models` named (the base model the adapters adapt).
fn lora_adapters(p: &mut Problems, at: &str, kind: BackendKind, b: &BackendSection) -> Vec<String> {
    if b.lora_adapters.is_empty() {
        return Vec::new();
    }
    if kind != BackendKind::Tgi {
        p.push(
            format!("{at}.lora_adapters"),
            "only for tgi backends (vLLM lists its adapters in /v1/models)",
        );
    } else if b.models.is_empty() {
        p.push(
            format!("{at}.lora_adapters"),
            "needs `models`: the base model the adapters adapt",
        );
    }
    if b.lora_adapters.iter().any(|a| a.trim().is_empty()) {
        p.push(format!("{at}.lora_adapters"), "an adapter name is empty");
    }
    b.lora_adapters.clone()
}

/// `[[adapters]]`: names unique and distinct from every model name and alias; a base (its
/// alias resolved to the model's name) and a path.
pub(super) fn adapters(
    p: &mut Problems,
    list: &[AdapterSection],
    models: &[ModelConfig],
) -> Vec<AdapterConfig> {
    let mut names = HashSet::new();
    let canonical = |n: &str| {
        models
            .iter()
            .find(|m| m.name == n || m.aliases.iter().any(|a| a == n))
            .map_or(n, |m| m.name.as_str())
            .to_string()
    };
    let mut out = Vec::new();
    for (i, a) in list.iter().enumerate() {
        let at = format!("adapters[{i}]");
        unique_name(p, &mut names, &at, &a.name, "adapter");
        if canonical(&a.name) != a.name || models.iter().any(|m| m.name == a.name) {
            p.push(
                format!("{at}.name"),
                format!("`{}` is a model's name", a.name),
            );
        }
        if a.base.trim().is_empty() {
            p.push(
                format!("{at}.base"),
                "must name the model the adapter adapts",
            );
        }
        if a.path.trim().is_empty() {
            p.push(
                format!("{at}.path"),
                "must name where the engines load it from",
            );
        }
        out.push(AdapterConfig {
            name: a.name.clone(),
            base: canonical(&a.base),
            path: a.path.clone(),
        });
    }
    out
}

/// A model's `tokenizer` folder, loaded; a folder that is missing or does not load is a
/// problem naming the folder and what is wrong with it.
fn tokenizer(p: &mut Problems, at: &str, dir: &str) -> Option<Arc<Tokenizer>> {
    if dir.trim().is_empty() {
        p.push(format!("{at}.tokenizer"), "must name a folder");
        return None;
    }
    Tokenizer::load(Path::new(dir))
        .map(Arc::new)
        .map_err(|e| p.push(format!("{at}.tokenizer"), e))
        .ok()
}

/// `[[backends]]`: unique names; timeouts default to `base`.
pub(super) fn backends(
    p: &mut Problems,
    list: &[BackendSection],
    base: Timeouts,
    env: &dyn Env,
) -> Vec<BackendConfig> {
    let mut names = HashSet::new();
    let mut backends = Vec::new();
    for (i, b) in list.iter().enumerate() {
        let at = format!("backends[{i}]");
        unique_name(p, &mut names, &at, &b.name, "backend");
        backends.push(backend(p, &at, b, base, env));
    }
    backends
}

fn backend(
    p: &mut Problems,
    at: &str,
    b: &BackendSection,
    base: Timeouts,
    env: &dyn Env,
) -> BackendConfig {
    let kind = BackendKind::from_str(&b.kind).unwrap_or_else(|e| {
        p.push(format!("{at}.kind"), e);
        BackendKind::OpenAi
    });
    let url = match expand(&b.url, env).and_then(|u| parse_backend_url(&u)) {
        Ok(u) => u,
        Err(e) => {
            p.push(format!("{at}.url"), e);
            Uri::from_static("http://127.0.0.1")
        }
    };
    for client in b.model_names.keys() {
        if !b.models.is_empty() && !b.models.contains(client) {
            p.push(
                format!("{at}.model_names"),
                format!("`{client}` is not in this backend's models"),
            );
        }
    }
    let weight = at_least(p, &format!("{at}.weight"), b.weight.map(u64::from), 1, 1);
    if b.max_concurrent == Some(0) {
        p.push(format!("{at}.max_concurrent"), "must be at least 1");
    }
    if let Some(path) = &b.health_path {
        if !path.starts_with('/') {
            p.push(format!("{at}.health_path"), "must start with /");
        }
    }
    BackendConfig {
        name: b.name.clone(),
        kind,
        url,
        models: b.models.clone(),
        model_names: b.model_names.clone(),
        api_key: secret(p, &format!("{at}.api_key"), &b.api_key, env),
        weight,
        max_concurrent: b.max_concurrent,
        health_path: b.health_path.clone(),
        kv_events: kv_events(p, &format!("{at}.kv_events"), kind, &b.kv_events),
        max_adapters: b.max_adapters,
        lora_adapters: lora_adapters(p, at, kind, b),
        timeouts: timeouts(p, &format!("{at}.timeouts"), &b.timeouts, base),
    }
}

/// `kv_events`: only vLLM publishes them; an endpoint must be `tcp://host:port`.
fn kv_events(
    p: &mut Problems,
    at: &str,
    kind: BackendKind,
    setting: &Option<KvEventsSetting>,
) -> KvEvents {
    let wanted = match setting {
        None | Some(KvEventsSetting::On(true)) => KvEvents::Discover,
        Some(KvEventsSetting::On(false)) => return KvEvents::Off,
        Some(KvEventsSetting::Endpoint(e)) => {
            let port = e
                .strip_prefix("tcp://")
                .and_then(|r| r.rsplit_once(':'))
                .and_then(|(h, port)| (!h.is_empty()).then_some(port))
                .and_then(|port| port.parse::<u16>().ok());
            if port.is_none() {
                p.push(at, format!("`{e}` is not a tcp://host:port endpoint"));
            }
            KvEvents::Endpoint(e.clone())
        }
    };
    match (kind, &wanted) {
        (BackendKind::Vllm, _) => wanted,
        (_, KvEvents::Endpoint(_)) => {
            p.push(at, "only vllm backends publish KV-cache events");
            KvEvents::Off
        }
        _ => KvEvents::Off,
    }
}

/// Parse a backend base URL: http or https, with a host; a trailing `/` is dropped.
pub fn parse_backend_url(s: &str) -> Result<Uri, String> {
    let uri: Uri = s.parse().map_err(|e| format!("`{s}` is not a URL ({e})"))?;
    match uri.scheme_str() {
        Some("http") | Some("https") => {}
        _ => return Err(format!("`{s}` must start with http:// or https://")),
    }
    if uri.authority().is_none() {
        return Err(format!("`{s}` has no host"));
    }
    if uri.query().is_some() {
        return Err(format!("`{s}` must not have a query string"));
    }
    let trimmed = s.trim_end_matches('/');
    trimmed
        .parse()
        .map_err(|e| format!("`{s}` is not a URL ({e})"))
}
