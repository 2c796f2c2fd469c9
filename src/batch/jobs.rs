//! Where file records and batches are kept, behind one API for the HTTP handlers: one
//! replica's embedded database ([`super::store`]), or with `[batch] shared` the folder every
//! replica mounts ([`super::shared::Folder`]), which two processes can both write (redb takes
//! an exclusive lock on its file, so two replicas cannot open one database).

use super::record::{now, BatchRecord, FileMeta};
use super::shared::Folder;
use super::store::Store;
use super::BatchError;

/// The job state of one `[batch] dir`.
pub enum Jobs {
    Local(Store),
    Shared(Folder),
}

impl Jobs {
    pub fn put_file(&self, meta: &FileMeta) -> Result<(), BatchError> {
        match self {
            Jobs::Local(s) => s.put_file(meta),
            Jobs::Shared(f) => f.put_file(meta),
        }
    }

    pub fn file(&self, id: &str) -> Result<Option<FileMeta>, BatchError> {
        match self {
            Jobs::Local(s) => s.file(id),
            Jobs::Shared(f) => f.file(id),
        }
    }

    pub fn files(&self) -> Result<Vec<FileMeta>, BatchError> {
        match self {
            Jobs::Local(s) => s.files(),
            Jobs::Shared(f) => f.files(),
        }
    }

    /// Remove a file record; whether there was one.
    pub fn delete_file(&self, id: &str) -> Result<bool, BatchError> {
        match self {
            Jobs::Local(s) => s.delete_file(id),
            Jobs::Shared(f) => f.delete_file(id),
        }
    }

    pub fn put_batch(&self, b: &BatchRecord) -> Result<(), BatchError> {
        match self {
            Jobs::Local(s) => s.put_batch(b),
            Jobs::Shared(f) => f.put_batch(b),
        }
    }

    pub fn batch(&self, id: &str) -> Result<Option<BatchRecord>, BatchError> {
        match self {
            Jobs::Local(s) => s.batch(id),
            Jobs::Shared(f) => f.batch(id),
        }
    }

    pub fn batches(&self) -> Result<Vec<BatchRecord>, BatchError> {
        match self {
            Jobs::Local(s) => s.batches(),
            Jobs::Shared(f) => f.batches(),
        }
    }

    /// Ask batch `id` to stop: the batch as it is now and whether it could be cancelled
    /// (`None`: no such batch).
    pub fn cancel(&self, id: &str) -> Result<Option<(BatchRecord, bool)>, BatchError> {
        match self {
            Jobs::Local(s) => {
                let mut ok = false;
                let r = s.update_batch(id, |r| ok = r.cancel(now()))?;
                Ok(r.map(|r| (r, ok)))
            }
            Jobs::Shared(f) => f.cancel(id),
        }
    }
}
