//! The OpenAI Files and Batches APIs, run on the fleet's idle capacity (`[batch]`).
//!
//! ```text
//! POST /v1/files (multipart, purpose batch) ─► blobs (contents) + store (record)
//! POST /v1/batches ─► store: validating
//! runner ─► input read, bad lines to the error file ─► in_progress
//!        ─► each line, while the fleet has headroom ([`headroom`]): proxy::handle as the key
//!           that created the batch ─► its result recorded once ─► finalizing ─► output and
//!           error files ─► completed (or cancelled, expired)
//! ```
//!
//! Owned here: the job state in an embedded database ([`store`]), file contents on disk
//! ([`blobs`]), the input line format ([`input`]), the records and their states ([`record`]),
//! the HTTP handlers ([`http`]) and the runner ([`runner`]).
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
pub mod headroom;
pub mod http;
pub mod input;
pub mod record;
mod runner;
pub mod store;

use std::sync::Arc;

use thiserror::Error;

use crate::config::BatchConfig;

pub use runner::run;

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
}

/// The Files and Batches service of one `[batch] dir`: shared by the HTTP handlers and the
/// runner.
pub struct Batches {
    config: BatchConfig,
    store: store::Store,
    blobs: blobs::Blobs,
    /// Wakes the runner: a batch was created or cancelled.
    wake: tokio::sync::Notify,
}

impl Batches {
    /// Open `[batch] dir` (created when missing): its database and its files.
    pub fn open(config: &BatchConfig) -> Result<Arc<Batches>, BatchError> {
        std::fs::create_dir_all(&config.dir)?;
        let store = store::Store::open(&config.dir.join("state.redb"))?;
        let blobs = blobs::Blobs::open(&config.dir)?;
        Ok(Arc::new(Batches {
            config: config.clone(),
            store,
            blobs,
            wake: tokio::sync::Notify::new(),
        }))
    }

    pub fn config(&self) -> &BatchConfig {
        &self.config
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
