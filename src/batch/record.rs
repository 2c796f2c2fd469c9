//! What is kept of files and batches, and a batch's life as state transitions.
//!
//! Invariants: a batch moves only forward — `validating` → `in_progress` → `finalizing` →
//! `completed`, with `failed` (validation), `expired` (past its window) and `cancelling` →
//! `cancelled` on the side; a finished status is never left ([`Status::finished`]). Each
//! transition stamps its own `*_at` once. The owner (tenant, key) never appears on the wire.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// Seconds since the epoch.
pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// An id of `prefix`, the creation time in nanoseconds (16 hex digits) and 8 random hex
/// digits: ids of one kind sort in the order they were made, which lists page by.
pub fn new_id(prefix: &str) -> String {
    use rand::RngCore;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut bytes = [0u8; 4];
    rand::rng().fill_bytes(&mut bytes);
    format!("{prefix}{nanos:016x}{}", hex::encode(bytes))
}

/// An uploaded or generated file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct FileMeta {
    id: String,
    bytes: u64,
    created_at: i64,
    filename: String,
    /// `batch` for uploads, `batch_output` for what a batch wrote.
    purpose: String,
    tenant: String,
}

impl FileMeta {
    pub fn new(id: String, bytes: u64, filename: String, purpose: &str, tenant: &str) -> Self {
        FileMeta {
            id,
            bytes,
            created_at: now(),
            filename,
            purpose: purpose.to_string(),
            tenant: tenant.to_string(),
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }

    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    pub fn purpose(&self) -> &str {
        &self.purpose
    }

    pub fn created_at(&self) -> i64 {
        self.created_at
    }

    /// OpenAI's `File` object.
    pub fn wire(&self) -> Value {
        json!({
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": null,
            "status_details": null,
        })
    }
}

/// A batch's status, as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Validating,
    InProgress,
    Finalizing,
    Completed,
    Failed,
    Expired,
    Cancelling,
    Cancelled,
}

impl Status {
    /// No line runs any more and nothing will change.
    pub fn finished(self) -> bool {
        matches!(
            self,
            Status::Completed | Status::Failed | Status::Expired | Status::Cancelled
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            Status::Validating => "validating",
            Status::InProgress => "in_progress",
            Status::Finalizing => "finalizing",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Expired => "expired",
            Status::Cancelling => "cancelling",
            Status::Cancelled => "cancelled",
        }
    }
}

/// `request_counts`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub total: u64,
    pub completed: u64,
    pub failed: u64,
}

/// One entry of a batch's `errors.data`: why the batch as a whole failed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct BatchFailure {
    pub code: String,
    pub message: String,
    pub param: Option<String>,
    pub line: Option<u64>,
}

/// The stamps of a batch's transitions (`None` until it happened).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct Stamps {
    in_progress_at: Option<i64>,
    finalizing_at: Option<i64>,
    completed_at: Option<i64>,
    failed_at: Option<i64>,
    expired_at: Option<i64>,
    cancelling_at: Option<i64>,
    cancelled_at: Option<i64>,
}

/// How long a batch may take (`completion_window` `24h`).
pub const WINDOW_SECONDS: i64 = 24 * 3600;

/// A batch job.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchRecord {
    id: String,
    tenant: String,
    /// The name of the key that created it: its lines run as that key.
    key: String,
    input_file_id: String,
    endpoint: String,
    created_at: i64,
    expires_at: i64,
    status: Status,
    metadata: Option<Value>,
    stamps: Stamps,
    counts: Counts,
    output_file_id: Option<String>,
    error_file_id: Option<String>,
    failures: Vec<BatchFailure>,
    /// The most recent model a line named (OpenAI's `model`).
    model: Option<String>,
}

impl BatchRecord {
    pub fn new(
        tenant: &str,
        key: &str,
        input_file_id: &str,
        endpoint: &str,
        metadata: Option<Value>,
    ) -> Self {
        let created_at = now();
        BatchRecord {
            id: new_id("batch_"),
            tenant: tenant.to_string(),
            key: key.to_string(),
            input_file_id: input_file_id.to_string(),
            endpoint: endpoint.to_string(),
            created_at,
            expires_at: created_at + WINDOW_SECONDS,
            status: Status::Validating,
            metadata,
            stamps: Stamps::default(),
            counts: Counts::default(),
            output_file_id: None,
            error_file_id: None,
            failures: Vec::new(),
            model: None,
        }
    }

    pub fn id(&self) -> &str {
        &self.id
    }
    pub fn tenant(&self) -> &str {
        &self.tenant
    }
    pub fn key(&self) -> &str {
        &self.key
    }
    pub fn input_file_id(&self) -> &str {
        &self.input_file_id
    }
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
    pub fn status(&self) -> Status {
        self.status
    }
    pub fn counts(&self) -> Counts {
        self.counts
    }
    pub fn created_at(&self) -> i64 {
        self.created_at
    }
    pub fn expired(&self, at: i64) -> bool {
        at >= self.expires_at
    }

    /// Validation passed: `total` lines to account for.
    pub fn start(&mut self, total: u64, model: Option<String>, at: i64) {
        if self.status == Status::Validating {
            self.status = Status::InProgress;
            self.stamps.in_progress_at = Some(at);
            self.counts.total = total;
            self.model = model;
        }
    }

    /// Validation failed as a whole.
    pub fn fail(&mut self, failures: Vec<BatchFailure>, at: i64) {
        if !self.status.finished() {
            self.status = Status::Failed;
            self.stamps.failed_at = Some(at);
            self.failures = failures;
        }
    }

    /// One line's result was recorded.
    pub fn count(&mut self, ok: bool) {
        if ok {
            self.counts.completed += 1;
        } else {
            self.counts.failed += 1;
        }
    }

    /// Asked to stop: `false` when it is finished already (nothing to cancel).
    pub fn cancel(&mut self, at: i64) -> bool {
        match self.status {
            Status::Validating | Status::InProgress => {
                self.status = Status::Cancelling;
                self.stamps.cancelling_at = Some(at);
                true
            }
            Status::Cancelling | Status::Finalizing => true,
            _ => false,
        }
    }

    /// Every line has its result: the output files are being written.
    pub fn finalize(&mut self, at: i64) {
        if self.status == Status::InProgress {
            self.status = Status::Finalizing;
            self.stamps.finalizing_at = Some(at);
        }
    }

    /// The counts as summed elsewhere (shared mode: from the committed chunks of lines).
    pub fn set_counts(&mut self, completed: u64, failed: u64) {
        self.counts.completed = completed;
        self.counts.failed = failed;
    }

    /// The output files are written: the batch ends as it was heading (`cancelled`,
    /// `expired` when lines were left unrun past its window, else `completed`).
    pub fn finish(
        &mut self,
        output: Option<String>,
        errors: Option<String>,
        at: i64,
        expired: bool,
    ) {
        self.output_file_id = output;
        self.error_file_id = errors;
        match self.status {
            Status::Cancelling => {
                self.status = Status::Cancelled;
                self.stamps.cancelled_at = Some(at);
            }
            _ if expired => {
                self.status = Status::Expired;
                self.stamps.expired_at = Some(at);
            }
            _ => {
                self.status = Status::Completed;
                self.stamps.completed_at = Some(at);
            }
        }
    }

    /// OpenAI's `Batch` object.
    pub fn wire(&self) -> Value {
        let s = &self.stamps;
        let errors =
            (!self.failures.is_empty()).then(|| json!({ "object": "list", "data": self.failures }));
        json!({
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": errors,
            "input_file_id": self.input_file_id,
            "completion_window": "24h",
            "status": self.status.name(),
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": s.in_progress_at,
            "expires_at": self.expires_at,
            "finalizing_at": s.finalizing_at,
            "completed_at": s.completed_at,
            "failed_at": s.failed_at,
            "expired_at": s.expired_at,
            "cancelling_at": s.cancelling_at,
            "cancelled_at": s.cancelled_at,
            "request_counts": self.counts,
            "metadata": self.metadata,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_moves_forward_only() {
        let mut b = BatchRecord::new("t", "k", "file-1", "/v1/chat/completions", None);
        assert_eq!(b.status(), Status::Validating);
        b.start(2, Some("m".into()), now());
        assert_eq!(b.status(), Status::InProgress);
        b.count(true);
        b.count(false);
        b.finalize(now());
        assert_eq!(b.status(), Status::Finalizing);
        b.finish(Some("file-o".into()), Some("file-e".into()), now(), false);
        assert_eq!(b.status(), Status::Completed);
        assert!(!b.cancel(now()), "a completed batch cannot be cancelled");
        b.fail(vec![], now());
        assert_eq!(b.status(), Status::Completed);
        let w = b.wire();
        assert_eq!(
            w["request_counts"],
            json!({"total": 2, "completed": 1, "failed": 1})
        );
        assert_eq!(w["status"], "completed");
        assert!(w.get("tenant").is_none() && w.get("key").is_none());
    }

    #[test]
    fn cancelling_ends_cancelled_and_expiry_ends_expired() {
        let mut b = BatchRecord::new("t", "k", "f", "/v1/embeddings", None);
        b.start(3, None, now());
        assert!(b.cancel(now()));
        assert_eq!(b.wire()["status"], "cancelling");
        b.finish(None, None, now(), false);
        assert_eq!(b.status(), Status::Cancelled);
        let mut b = BatchRecord::new("t", "k", "f", "/v1/embeddings", None);
        b.start(3, None, now());
        b.count(true);
        b.finalize(now());
        assert!(b.expired(now() + WINDOW_SECONDS));
        b.finish(None, None, now() + WINDOW_SECONDS + 1, true);
        assert_eq!(b.status(), Status::Expired);
    }
}
