//! The OpenAI Files and Batches APIs, run on the fleet's idle capacity (`[batch]`).
//!
//! ```text
//! POST /v1/files (multipart, purpose batch) ─► blobs (contents) + store (record)
//! POST /v1/batches ─► store: validating
//! runner ─► input read, bad lines to the error file ─► in_progress
//!        ─► each line, while the fleet has headroom ([`headroom`], within each engine's
//!           step budget, [`budget`]): proxy::handle as the key
//!           that created the batch ─► its result recorded once ─► finalizing ─► output and
//!           error files ─► completed (or cancelled, expired)
//! ```
//!
//! Owned here: the job state in an embedded database ([`store`]) or, with `[batch] shared`,
//! on the folder several replicas mount ([`shared`], which also shares the work out through
//! Redis leases on chunks of lines), behind one API ([`jobs`]); file contents on disk
//! ([`blobs`]), the input line format ([`input`]), the records and their states ([`record`]),
//! one line's run ([`line`]), the HTTP handlers ([`http`]) and the runners ([`runner`], and
//! [`shared::runner`] for shared batches).
//!
//! Invariants:
//! - Uploaded files, batches and every line's result are durable before they are
//!   acknowledged: a restart or a crash (`kill -9`) loses nothing acknowledged.
//! - Each line's result is written once ([`store::Store::record_lines`]); a line in flight at a
//!   crash has no result and runs again; the output and error files are built from the
//!   recorded results only, so a duplicate never reaches them.
//! - A line runs through the same request path as an interactive request
//!   ([`crate::proxy::handle`]), authenticated as the batch's key without its secret
//!   ([`crate::auth::ActingAs`]): routing, failover, limits and usage apply unchanged.
//! - A line is dispatched only while the fleet has room for it without queueing and no
//!   interactive request waits; a line refused for capacity or the tenant's limits (429,
//!   503) is put back and the batch waits, it does not fail.

mod blobs;
pub mod budget;
pub mod headroom;
pub mod http;
pub mod input;
pub mod jobs;
mod line;
pub mod record;
mod runner;
pub mod shared;
pub mod store;

use std::sync::Arc;

use thiserror::Error;

use crate::config::BatchConfig;
use crate::gateway::Gateway;
use jobs::Jobs;

/// What can go wrong below the HTTP handlers.
#[derive(Debug, Error)]
pub enum BatchError {
    #[error("job state: {0}")]
    Store(#[from] redb::Error),
    #[error("file storage: {0}")]
    Io(#[from] std::io::Error),
    #[error("a stored record cannot be read: {0}")]
    Corrupt(String),
    #[error("not found")]
    NotFound,
    #[error("a blocking task failed: {0}")]
    Task(String),
    #[error("the job state is kept {0}")]
    Mode(&'static str),
    #[error("chunk leases: {0}")]
    Lease(#[from] shared::lease::LeaseError),
}

/// The Files and Batches service of one `[batch] dir`: shared by the HTTP handlers and the
/// runner.
pub struct Batches {
    config: BatchConfig,
    jobs: Jobs,
    blobs: blobs::Blobs,
    /// This process's name in shared leases and files.
    token: String,
    /// Wakes the runner: a batch was created or cancelled.
    wake: tokio::sync::Notify,
    /// How many lines each engine may hold ([`budget`]).
    budget: budget::StepBudget,
}

impl Batches {
    /// Open `[batch] dir` (created when missing): its database (or shared folder) and its
    /// files.
    pub fn open(config: &BatchConfig) -> Result<Arc<Batches>, BatchError> {
        std::fs::create_dir_all(&config.dir)?;
        let jobs = if config.shared {
            Jobs::Shared(shared::Folder::open(&config.dir)?)
        } else {
            Jobs::Local(store::Store::open(&config.dir.join("state.redb"))?)
        };
        // Other replicas may be writing files in a shared folder: only old leftovers go.
        let blobs = blobs::Blobs::open(&config.dir, config.shared)?;
        Ok(Arc::new(Batches {
            config: config.clone(),
            jobs,
            blobs,
            token: shared::token(),
            wake: tokio::sync::Notify::new(),
            budget: budget::StepBudget::new(config.max_ttft_rise),
        }))
    }

    pub fn config(&self) -> &BatchConfig {
        &self.config
    }

    /// The engines' allowances of batch lines.
    pub fn budget(&self) -> &budget::StepBudget {
        &self.budget
    }

    fn token(&self) -> &str {
        &self.token
    }

    /// The one replica's database.
    fn local(&self) -> Result<&store::Store, BatchError> {
        match &self.jobs {
            Jobs::Local(s) => Ok(s),
            Jobs::Shared(_) => Err(BatchError::Mode("on a shared folder")),
        }
    }

    /// The shared folder's job state.
    fn folder(&self) -> Result<&shared::Folder, BatchError> {
        match &self.jobs {
            Jobs::Shared(f) => Ok(f),
            Jobs::Local(_) => Err(BatchError::Mode("in one replica's database")),
        }
    }

    /// Run `f` on the blocking pool (the store and the blobs wait on the disk).
    async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Batches) -> Result<T, BatchError> + Send + 'static,
    ) -> Result<T, BatchError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || f(&this))
            .await
            .map_err(|e| BatchError::Task(e.to_string()))?
    }
}

/// Run the batches of `b` until `stop` turns true: the one replica's runner, or with
/// `[batch] shared` the runner that shares the work through the Redis of `[limits]`.
pub async fn run(b: Arc<Batches>, gw: Arc<Gateway>, stop: tokio::sync::watch::Receiver<bool>) {
    if !b.config.shared {
        return runner::run(b, gw, stop).await;
    }
    let url = gw.runtime().config.redis_url.clone().unwrap_or_default();
    match shared::lease::Leases::new(&url, b.token.clone(), b.config.lease) {
        Ok(leases) => shared::runner::run(b, gw, Arc::new(leases), stop).await,
        Err(e) => tracing::error!(error = %e, "shared batches cannot run: no Redis"),
    }
}
