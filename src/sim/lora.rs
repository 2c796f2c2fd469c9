//! LoRA adapters as vLLM 0.32 serves them: the settings (`--enable-lora`, `--max-loras`,
//! `--max-cpu-loras`, `--lora-modules`, runtime updating, the simulator's load time), the
//! API server's registry of loaded adapters ([`Registry`], what `/v1/models` lists and
//! `/v1/load_lora_adapter` changes), the GPU slots the engine swaps adapters into ([`Slots`])
//! and the `vllm:lora_requests_info` series ([`LoraInfo`]).
//!
//! Invariants:
//! - Adapter ids are vLLM's `lora_int_id`: 1, 2, … in the order of loading, never reused;
//!   loading in place keeps the name's id. As in vLLM, an attempt that fails after the name
//!   checks (a bad path) and, with runtime updating on, every request naming an unknown model
//!   use up an id.
//! - A path is an adapter when it exists on this machine (a file or a folder): vLLM reads the
//!   folder, the simulator only checks that it is there. Anything else is vLLM's 404
//!   "No adapter found" (`LoraError::NoAdapter`).
//! - Unloading only removes the name from the registry, as in vLLM: requests already running
//!   under it finish under it.
//! - [`Slots`] holds at most `max_loras` adapters; the admission rule (see
//!   [`crate::batching`]) keeps the adapters of running requests within that many, so the one
//!   evicted is never in use.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::metrics::go_float;

/// vLLM's LoRA settings, as `sluice sim` takes them.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSettings {
    /// `--enable-lora`.
    pub enabled: bool,
    /// `--max-loras`: adapters a batch may run at once (GPU slots); vLLM's default is 1.
    pub max_loras: usize,
    /// `--max-cpu-loras`: accepted and checked (at least `max_loras`) as vLLM checks it.
    pub max_cpu_loras: Option<usize>,
    /// `--lora-modules name=path`: adapters loaded at start, in order.
    pub modules: Vec<(String, String)>,
    /// vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`: `/v1/load_lora_adapter` and
    /// `/v1/unload_lora_adapter` exist.
    pub runtime_updating: bool,
    /// What swapping an adapter into a GPU slot adds to the engine step that needs it (at
    /// speed 1).
    pub load_time: Duration,
}

impl Default for LoraSettings {
    fn default() -> Self {
        LoraSettings {
            enabled: false,
            max_loras: 1,
            max_cpu_loras: None,
            modules: Vec::new(),
            runtime_updating: false,
            load_time: Duration::from_millis(25),
        }
    }
}

impl LoraSettings {
    /// Check the settings as vLLM checks its flags at start.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if !self.enabled {
            if !self.modules.is_empty() || self.runtime_updating {
                return Err(
                    "--lora-modules and --allow-runtime-lora-updating need --enable-lora".into(),
                );
            }
            return Ok(());
        }
        if self.max_loras == 0 {
            return Err("--max-loras must be at least 1".into());
        }
        if let Some(cpu) = self.max_cpu_loras {
            if cpu < self.max_loras {
                return Err(format!(
                    "max_cpu_loras ({cpu}) must be >= max_loras ({})",
                    self.max_loras
                ));
            }
        }
        Ok(())
    }
}

/// A `--lora-modules` value: `name=path`.
pub(crate) fn parse_module(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => {
            Ok((name.to_string(), path.to_string()))
        }
        _ => Err(format!("`{s}` is not name=path")),
    }
}

/// Why loading or unloading an adapter failed; each is one of vLLM's answers.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum LoraError {
    #[error("Both 'lora_name' and 'lora_path' must be provided.")]
    MissingNameOrPath,
    #[error("The lora adapter '{0}' conflicts with a served base model.")]
    ConflictsWithBase(String),
    #[error("The lora adapter '{0}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.")]
    AlreadyLoaded(String),
    #[error("Loading lora {name} failed: No adapter found for {path}")]
    NoAdapter { name: String, path: String },
    #[error("'lora_name' needs to be provided to unload a LoRA adapter.")]
    MissingUnloadName,
    #[error("The lora adapter '{0}' cannot be found.")]
    NotLoaded(String),
}

impl LoraError {
    /// vLLM's status code and error `type` for it.
    pub(crate) fn status_and_type(&self) -> (u16, &'static str) {
        match self {
            LoraError::NoAdapter { .. } | LoraError::NotLoaded(_) => (404, "NotFoundError"),
            _ => (400, "InvalidUserInput"),
        }
    }
}

/// One loaded adapter.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Adapter {
    name: String,
    path: String,
    id: u32,
}

impl Adapter {
    /// The name requests use as their `model`.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }
    /// The path it was loaded from (`root` in `/v1/models`).
    pub(crate) fn path(&self) -> &str {
        &self.path
    }
    /// vLLM's `lora_int_id` (the `lora_id` of its KV events).
    pub(crate) fn id(&self) -> u32 {
        self.id
    }

    /// What the adapter adds to its blocks' hashes (vLLM hashes its name and path into every
    /// block): the same prompt under another adapter, or none, never shares a block.
    pub(crate) fn block_key(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.name.bytes().chain([0]).chain(self.path.bytes()) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
        h
    }

    /// `hashes` (chained block hashes of a prompt) keyed by this adapter.
    pub(crate) fn key_blocks(&self, hashes: &mut [u64]) {
        let key = self.block_key();
        for h in hashes {
            *h = (*h ^ key)
                .rotate_left(23)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
}

/// The API server's adapters (vLLM's `OpenAIServingModels.lora_requests`), in loading order.
#[derive(Debug)]
pub(crate) struct Registry {
    adapters: Mutex<Vec<Arc<Adapter>>>,
    /// The last id handed out (vLLM's `lora_id_counter`).
    last_id: AtomicU32,
    base: Vec<String>,
    runtime_updating: bool,
}

impl Registry {
    /// The registry of a server whose base model names are `base`, with the `modules` of
    /// `--lora-modules` loaded; fails as vLLM fails to start when one cannot be loaded.
    pub(crate) fn new(settings: &LoraSettings, base: &[String]) -> Result<Registry, LoraError> {
        let r = Registry {
            adapters: Mutex::new(Vec::new()),
            last_id: AtomicU32::new(0),
            base: base.to_vec(),
            runtime_updating: settings.runtime_updating,
        };
        for (name, path) in &settings.modules {
            r.load(name, path, false)?;
        }
        Ok(r)
    }

    /// Whether `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` exist.
    pub(crate) fn runtime_updating(&self) -> bool {
        self.runtime_updating
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Adapter>>> {
        self.adapters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `POST /v1/load_lora_adapter`: vLLM's checks in its order, then the path; the success
    /// text on success.
    pub(crate) fn load(&self, name: &str, path: &str, inplace: bool) -> Result<String, LoraError> {
        if name.is_empty() || path.is_empty() {
            return Err(LoraError::MissingNameOrPath);
        }
        if self.base.iter().any(|b| b == name) {
            return Err(LoraError::ConflictsWithBase(name.into()));
        }
        let mut adapters = self.lock();
        let existing = adapters.iter().position(|a| a.name == name);
        if existing.is_some() && !inplace {
            return Err(LoraError::AlreadyLoaded(name.into()));
        }
        let id = match existing {
            Some(i) => adapters[i].id,
            None => self.last_id.fetch_add(1, Relaxed) + 1,
        };
        if !Path::new(path).exists() {
            return Err(LoraError::NoAdapter {
                name: name.into(),
                path: path.into(),
            });
        }
        let adapter = Arc::new(Adapter {
            name: name.into(),
            path: path.into(),
            id,
        });
        match existing {
            Some(i) => adapters[i] = adapter,
            None => adapters.push(adapter),
        }
        Ok(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    }

    /// `POST /v1/unload_lora_adapter`; the success text on success.
    pub(crate) fn unload(&self, name: &str) -> Result<String, LoraError> {
        if name.is_empty() {
            return Err(LoraError::MissingUnloadName);
        }
        let mut adapters = self.lock();
        let Some(i) = adapters.iter().position(|a| a.name == name) else {
            return Err(LoraError::NotLoaded(name.into()));
        };
        adapters.remove(i);
        Ok(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        ))
    }

    /// The loaded adapter called `name`.
    pub(crate) fn find(&self, name: &str) -> Option<Arc<Adapter>> {
        self.lock().iter().find(|a| a.name == name).cloned()
    }

    /// Every loaded adapter, in loading order.
    pub(crate) fn all(&self) -> Vec<Arc<Adapter>> {
        self.lock().clone()
    }

    /// A request named a model that is neither served nor loaded: with runtime updating on,
    /// vLLM asks its resolvers for it, which takes an id even when none is found.
    pub(crate) fn note_unknown_model(&self) {
        if self.runtime_updating {
            self.last_id.fetch_add(1, Relaxed);
        }
    }
}

/// The GPU slots of the engine: the adapters resident there, least recently used first.
#[derive(Debug)]
pub(crate) struct Slots {
    resident: VecDeque<u32>,
    capacity: usize,
}

impl Slots {
    pub(crate) fn new(capacity: usize) -> Slots {
        Slots {
            resident: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// The engine runs `lora` in this step: it becomes the most recently used; returns true
    /// when it had to be swapped in (evicting the least recently used one if the slots are
    /// full). The base model (0) needs no slot.
    pub(crate) fn bring(&mut self, lora: u32) -> bool {
        if lora == 0 {
            return false;
        }
        if let Some(i) = self.resident.iter().position(|l| *l == lora) {
            self.resident.remove(i);
            self.resident.push_back(lora);
            return false;
        }
        if self.resident.len() >= self.capacity {
            self.resident.pop_front();
        }
        self.resident.push_back(lora);
        true
    }
}

/// `vllm:lora_requests_info`: one series per label set ever written, in the order first
/// written, each holding the last time it was written (vLLM sets it to the current time after
/// every engine step; the current state is the series with the latest value).
///
/// vLLM 0.32 writes the same names in both labels: the adapters with a request that has
/// produced output and not finished, in the order they got one. A request waiting for a slot
/// produces no output, so its adapter appears only once it runs (the wait shows in
/// `vllm:num_requests_waiting_by_reason{reason="deferred"}`).
#[derive(Debug)]
pub(crate) struct LoraInfo {
    max_loras: usize,
    series: Mutex<Vec<(String, f64)>>,
}

impl LoraInfo {
    pub(crate) fn new(max_loras: usize) -> LoraInfo {
        LoraInfo {
            max_loras,
            series: Mutex::new(Vec::new()),
        }
    }

    /// An engine step ended with the adapters `names` active, at `now` (unix seconds).
    pub(crate) fn record(&self, names: &str, now: f64) {
        let mut series = self.series.lock().unwrap_or_else(|e| e.into_inner());
        match series.iter_mut().find(|(n, _)| n == names) {
            Some(s) => s.1 = now,
            None => series.push((names.to_string(), now)),
        }
    }

    /// The family as vLLM's Prometheus client writes it (labels in alphabetical order).
    pub(crate) fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        let name = "vllm:lora_requests_info";
        let _ = writeln!(
            out,
            "# HELP {name} Running stats on lora requests.\n# TYPE {name} gauge"
        );
        let series = self.series.lock().unwrap_or_else(|e| e.into_inner());
        for (names, at) in series.iter() {
            let _ = writeln!(
                out,
                "{name}{{max_lora=\"{}\",running_lora_adapters=\"{names}\",waiting_lora_adapters=\"{names}\"}} {}",
                self.max_loras,
                go_float(*at)
            );
        }
    }
}

/// The adapters with a request that has produced output, in the order they got one (vLLM's
/// frontend bookkeeping behind [`LoraInfo`]).
#[derive(Debug, Default)]
pub(crate) struct ActiveAdapters {
    order: Vec<Arc<Adapter>>,
}

impl ActiveAdapters {
    /// Keep the adapters of `producing` (those of the requests that have produced output and
    /// not finished): newcomers go last, the ones without such a request leave.
    pub(crate) fn update<'a>(&mut self, producing: impl Iterator<Item = &'a Arc<Adapter>>) {
        let now: Vec<&Arc<Adapter>> = producing.collect();
        self.order.retain(|a| now.iter().any(|n| n.id == a.id));
        for a in now {
            if !self.order.iter().any(|o| o.id == a.id) {
                self.order.push(a.clone());
            }
        }
    }

    /// The names joined by commas, as the metric's labels show them.
    pub(crate) fn label(&self) -> String {
        let names: Vec<&str> = self.order.iter().map(|a| a.name()).collect();
        names.join(",")
    }
}

#[cfg(test)]
mod tests;
