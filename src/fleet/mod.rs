//! The fleet: every backend Sluice can send a request to, its live state, and the probes that
//! keep that state true.
//!
//! - [`backend`]: one backend: its config, its HTTP client (own connection pool), and its
//!   [`backend::BackendState`] (health, load counters, discovered models).
//! - [`load`]: RAII guards counting in-flight requests and tokens, and pending prefills, per
//!   backend.
//! - [`clock`]: the clock and random draws state and routing decide by, which the planner
//!   replaces with virtual time and a seeded generator on its thread.
//! - [`health`]: per-kind active probes, model discovery and passive ejection.
//! - [`snapshot`]: the fleet of one config snapshot (its set of backends), and model resolution.
//! - [`queue`]: the gateway-side wait queue (per-backend caps, fair by tenant, with a deadline).
//! - [`registration`]: members announced at run time through the admin API, with a TTL.
//! - [`discovery`]: members found by resolving a DNS name, re-resolved periodically.
//! - [`prom`]: a tolerant Prometheus text-format reader.
//! - [`signals`]: engine load signals per kind (vLLM/TGI metrics, Ollama loaded models).
//! - [`speed`]: measured EWMAs per backend (TTFT, prefill and decode speed) and per model.
//! - [`timings`]: what each engine reports of its own timing, as windows between scrapes (the
//!   live profile's input).
//! - [`adapters`]: the LoRA adapters each engine holds and runs, and what a load costs there.
//! - [`kv`]: what each vLLM engine holds in its prefix cache, from its KV-cache events.
//! - [`tokenize`]: exact prompt token counts from a vLLM or TGI backend's tokenizer.
//! - [`view`]: [`BackendView`], one serialisable snapshot of a backend for the operations
//!   surfaces (`/admin/backends`, the dashboard, the per-backend gauges).
//!
//! Invariants: a backend's state outlives config reloads as long as its name, kind and URL stay
//! the same; load counters are only changed through guards, so every exit path releases them
//! (the compiler holds this: [`BackendState`]'s fields are private).

pub mod adapters;
pub mod backend;
pub mod background;
pub mod clock;
pub mod discovery;
pub mod health;
pub mod kv;
pub mod load;
pub mod make_room;
pub mod prom;
pub mod queue;
pub mod registration;
pub mod signals;
pub mod snapshot;
pub mod speed;
pub mod timings;
pub mod tokenize;
pub mod view;

pub use backend::{Backend, BackendState, Health};
pub use load::{Load, LoadGuard, Yielding};
pub use snapshot::{Fleet, Resolved};
pub use view::BackendView;
