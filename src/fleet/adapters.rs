//! The LoRA adapters of one backend: which it holds, how many it runs at once, which of them
//! run and wait now, which the gateway's requests are using, and what loading one costs there.
//!
//! Sources: the engine's model list (vLLM lists each loaded adapter with its base in
//! `parent`; TGI's adapters are fixed at start), `vllm:lora_requests_info` (the engine's
//! adapter slots, `max_lora`, and the adapters running and waiting; a gauge whose value is
//! the time the state was seen, so the latest series is the current one), and the gateway's
//! own loads and unloads, applied at once. Invariants: a list replaces the held set, keeping
//! the last use of adapters still held; in-flight counts are changed only by [`AdapterUse`],
//! which undoes its count on drop; the load cost is learned only from loads that succeeded.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use super::backend::monotonic_ms;
use super::prom::Sample;
use super::speed::Ewma;

/// What a load costs before any was measured on the candidates: vLLM reads the adapter's
/// weights from disk and moves them to its device, typically well under a second for small
/// ranks.
pub const PRIOR_LOAD_SECONDS: f64 = 1.0;

/// What a request for an adapter must wait for on one engine before it can start.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Setup {
    /// Nothing: the adapter runs, or a slot is free for it (or no adapter).
    Ready,
    /// A load or a swap, at this engine's measured load time when it has one.
    Load { measured: Option<f64> },
}

/// The adapter slots assumed before an engine reports its own (vLLM's `--max-loras` default).
pub const DEFAULT_SLOTS: u32 = 1;

/// How long an engine that answered as one without run-time loading is not asked again.
pub const NO_LOADS_FOR: Duration = Duration::from_secs(300);

/// The adapters of one backend.
#[derive(Debug, Default)]
pub struct Adapters {
    inner: Mutex<Inner>,
    load_seconds: Ewma,
    /// One lock per adapter being loaded, so concurrent requests share one load.
    loading: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Held adapter → its base model and when a request last used it here (ms).
    held: BTreeMap<String, Held>,
    /// The engine's adapter slots (`max_lora`): `None` until it reports them.
    max_lora: Option<u32>,
    running: Vec<String>,
    waiting: Vec<String>,
    /// Requests of the gateway in flight here, per adapter.
    inflight: HashMap<String, u32>,
    /// Until then (ms), the engine is taken not to load adapters at run time: it answered a
    /// load as an engine without run-time loading does.
    no_loads_until_ms: u64,
}

#[derive(Debug, Clone)]
struct Held {
    base: String,
    last_used_ms: u64,
}

/// One adapter as `/admin/backends` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct HeldView {
    pub name: String,
    pub base: String,
    pub inflight: u32,
    pub running: bool,
}

impl Adapters {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The adapters the engine lists now (`(name, base)`), replacing what was held.
    pub fn set_listed(&self, listed: impl IntoIterator<Item = (String, String)>) {
        let mut g = self.lock();
        let now = monotonic_ms();
        let old = std::mem::take(&mut g.held);
        for (name, base) in listed {
            let last_used_ms = old.get(&name).map_or(now, |h| h.last_used_ms);
            g.held.insert(name, Held { base, last_used_ms });
        }
    }

    /// The engine's adapter state from its `/metrics` (vLLM's `vllm:lora_requests_info`: the
    /// series with the latest value is the current state). Nothing changes when it has none.
    pub fn observe_metrics(&self, samples: &[Sample]) {
        let latest = samples
            .iter()
            .filter(|s| s.name == "vllm:lora_requests_info" && s.value.is_finite())
            .max_by(|a, b| a.value.total_cmp(&b.value));
        let Some(s) = latest else {
            return;
        };
        let names = |key| -> Vec<String> {
            s.label(key)
                .unwrap_or_default()
                .split(',')
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .collect()
        };
        let mut g = self.lock();
        g.max_lora = s.label("max_lora").and_then(|v| v.parse().ok());
        g.running = names("running_lora_adapters");
        g.waiting = names("waiting_lora_adapters");
    }

    /// Whether a load may be asked of the engine: not for [`NO_LOADS_FOR`] after it answered
    /// as an engine without run-time loading (it may be restarted with it on).
    pub fn loads_at_run_time(&self) -> bool {
        monotonic_ms() >= self.lock().no_loads_until_ms
    }

    /// The engine does not load adapters at run time (its load route is missing or off).
    pub fn refuse_run_time_loading(&self) {
        let until = monotonic_ms().saturating_add(NO_LOADS_FOR.as_millis() as u64);
        self.lock().no_loads_until_ms = until;
    }

    pub fn holds(&self, name: &str) -> bool {
        self.lock().held.contains_key(name)
    }

    /// The base model of `name` when the engine holds it.
    pub fn base_of(&self, name: &str) -> Option<String> {
        self.lock().held.get(name).map(|h| h.base.clone())
    }

    /// Every held adapter with its base.
    pub fn held(&self) -> Vec<(String, String)> {
        let g = self.lock();
        g.held
            .iter()
            .map(|(n, h)| (n.clone(), h.base.clone()))
            .collect()
    }

    /// The engine's adapter slots, when reported.
    pub fn max_lora(&self) -> Option<u32> {
        self.lock().max_lora
    }

    /// What a request for `name` waits for here before the engine can start it: nothing when
    /// the adapter runs or a slot is free for it; a load when the engine does not hold it; a
    /// swap (priced as a load) when it is held but every slot runs another adapter.
    pub fn setup(&self, name: &str) -> Setup {
        let load = Setup::Load {
            measured: self.load_seconds.get(),
        };
        let g = self.lock();
        if !g.held.contains_key(name) {
            return load;
        }
        if g.running.iter().any(|r| r == name) {
            return Setup::Ready;
        }
        let busy = g.running.iter().filter(|r| *r != name).count();
        match g.max_lora {
            Some(slots) if busy >= slots as usize => load,
            _ => Setup::Ready,
        }
    }

    /// Record a load of `name` (for `base`) that took `took`.
    pub fn loaded(&self, name: &str, base: &str, took: Duration) {
        self.load_seconds.observe(took.as_secs_f64().max(1e-3));
        self.lock().held.insert(
            name.to_string(),
            Held {
                base: base.to_string(),
                last_used_ms: monotonic_ms(),
            },
        );
    }

    /// The engine holds `name` (for `base`), though no load of the gateway's put it there.
    pub fn listed_now(&self, name: &str, base: &str) {
        self.lock().held.entry(name.to_string()).or_insert(Held {
            base: base.to_string(),
            last_used_ms: monotonic_ms(),
        });
    }

    /// The adapters to unload so that one more fits in `budget`: the least recently used ones
    /// with no request of the gateway in flight, no longer counted as held from this moment
    /// (under the lock that counts requests in, so none can start on a victim from here:
    /// such a request finds the adapter missing and loads it again). Fewer than needed when
    /// the others are in use: the engine then holds more than the budget until they are idle.
    pub fn take_victims(&self, budget: usize) -> Vec<String> {
        let mut g = self.lock();
        let excess = (g.held.len() + 1).saturating_sub(budget.max(1));
        let mut idle: Vec<(u64, String)> = g
            .held
            .iter()
            .filter(|(n, _)| g.inflight.get(*n).copied().unwrap_or(0) == 0)
            .map(|(n, h)| (h.last_used_ms, n.clone()))
            .collect();
        idle.sort();
        idle.truncate(excess);
        for (_, n) in &idle {
            g.held.remove(n);
        }
        idle.into_iter().map(|(_, n)| n).collect()
    }

    /// The adapter budget: `configured` (the backend's `max_adapters`), else the engine's
    /// slots, else [`DEFAULT_SLOTS`].
    pub fn budget(&self, configured: Option<u32>) -> usize {
        configured.or(self.max_lora()).unwrap_or(DEFAULT_SLOTS) as usize
    }

    /// The lock a load of `name` is made under: whoever holds it loads, the others wait and
    /// find the adapter held.
    pub fn load_lock(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut m = self.loading.lock().unwrap_or_else(|e| e.into_inner());
        m.retain(|_, l| Arc::strong_count(l) > 1);
        m.entry(name.to_string()).or_default().clone()
    }

    /// Count one request for `name` in flight here until the returned guard drops.
    pub fn begin(self: &Arc<Self>, name: &str) -> AdapterUse {
        let mut g = self.lock();
        *g.inflight.entry(name.to_string()).or_insert(0) += 1;
        if let Some(h) = g.held.get_mut(name) {
            h.last_used_ms = monotonic_ms();
        }
        AdapterUse {
            adapters: self.clone(),
            name: name.to_string(),
        }
    }

    pub fn view(&self) -> Vec<HeldView> {
        let g = self.lock();
        g.held
            .iter()
            .map(|(n, h)| HeldView {
                name: n.clone(),
                base: h.base.clone(),
                inflight: g.inflight.get(n).copied().unwrap_or(0),
                running: g.running.iter().any(|r| r == n),
            })
            .collect()
    }

    /// The learned load time, when measured.
    pub fn load_seconds(&self) -> Option<f64> {
        self.load_seconds.get()
    }
}

/// One request's use of an adapter on a backend; the count is undone on drop.
#[derive(Debug)]
pub struct AdapterUse {
    adapters: Arc<Adapters>,
    name: String,
}

impl Drop for AdapterUse {
    fn drop(&mut self) {
        let mut g = self.adapters.lock();
        if let Some(n) = g.inflight.get_mut(&self.name) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                g.inflight.remove(&self.name);
            }
        }
        if let Some(h) = g.held.get_mut(&self.name) {
            h.last_used_ms = monotonic_ms();
        }
    }
}

/// The adapters of an OpenAI-shaped model list (vLLM's `/v1/models`): `(name, base)` of each
/// entry with a `parent`.
pub fn parse_listed(body: &[u8]) -> Option<Vec<(String, String)>> {
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<Entry>,
    }
    #[derive(serde::Deserialize)]
    struct Entry {
        id: String,
        #[serde(default)]
        parent: Option<String>,
    }
    let list: List = serde_json::from_slice(body).ok()?;
    Some(
        list.data
            .into_iter()
            .filter_map(|e| Some((e.id, e.parent?)))
            .collect(),
    )
}

#[cfg(test)]
mod tests;
