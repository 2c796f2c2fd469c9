//! Job state on the folder every replica mounts, written so that two processes never need a
//! lock to keep it right:
//!
//! ```text
//! <dir>/files/<id>                          contents (super::super::blobs)
//! <dir>/shared/files/<id>.json              a file's record
//! <dir>/shared/batches/<id>/batch.json      the batch as created (never rewritten)
//! <dir>/shared/batches/<id>/<transition>    started, failed, cancelling, finalizing, finished
//! <dir>/shared/batches/<id>/chunks/<n>      the results of chunk n, committed whole
//! ```
//!
//! Invariants:
//! - Nothing is ever rewritten in place: a new file is written whole under a name of its own,
//!   synced, then renamed (a new id) or hard-linked (a transition, a chunk) into place. A
//!   hard link fails when the name exists, so each transition and each chunk is committed
//!   once, by the first replica that gets there; a later one sees it lost and drops its copy.
//! - A batch's state is read, not stored: its creation record with its transitions applied in
//!   time order ([`BatchRecord`]'s own methods, so a batch still moves only forward), and
//!   until it has finished its `request_counts` summed over its committed chunks. Every
//!   replica therefore answers `GET /v1/batches/{id}` alike.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use super::super::record::{now, BatchFailure, BatchRecord, FileMeta};
use super::super::store::LineResult;
use super::super::BatchError;

/// A batch's move to a new status, with its time.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Marker {
    pub at: i64,
    #[serde(flatten)]
    pub transition: Transition,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "transition", rename_all = "snake_case")]
pub enum Transition {
    /// Validated: `total` lines in chunks of `chunk_lines` (fixed here, so replicas with
    /// another setting still agree on the chunks).
    Started {
        total: u64,
        model: Option<String>,
        chunk_lines: u64,
    },
    Failed {
        failures: Vec<BatchFailure>,
    },
    Cancelling,
    Finalizing,
    /// The output and error files are written; the counts are final.
    Finished {
        output: Option<String>,
        errors: Option<String>,
        expired: bool,
        completed: u64,
        failed: u64,
    },
}

impl Transition {
    fn name(&self) -> &'static str {
        match self {
            Transition::Started { .. } => "started",
            Transition::Failed { .. } => "failed",
            Transition::Cancelling => "cancelling",
            Transition::Finalizing => "finalizing",
            Transition::Finished { .. } => "finished",
        }
    }

    /// Applied in this order when two have the same second.
    fn rank(&self) -> u8 {
        match self {
            Transition::Started { .. } => 0,
            Transition::Failed { .. } => 1,
            Transition::Cancelling => 2,
            Transition::Finalizing => 3,
            Transition::Finished { .. } => 4,
        }
    }
}

const TRANSITIONS: &[&str] = &["started", "failed", "cancelling", "finalizing", "finished"];

/// The shared job state of one `[batch] dir`.
pub struct Folder {
    files: PathBuf,
    batches: PathBuf,
    /// Each committed chunk's (completed, failed): a committed chunk never changes.
    counts: Mutex<HashMap<(String, u64), (u64, u64)>>,
}

fn decode<T: serde::de::DeserializeOwned>(raw: &[u8]) -> Result<T, BatchError> {
    serde_json::from_slice(raw).map_err(|e| BatchError::Corrupt(e.to_string()))
}

fn encode<T: Serialize>(v: &T) -> Result<Vec<u8>, BatchError> {
    serde_json::to_vec(v).map_err(|e| BatchError::Corrupt(e.to_string()))
}

/// The contents of `path`, `None` when there is no such file.
fn read_opt(path: &Path) -> Result<Option<Vec<u8>>, BatchError> {
    match fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// `bytes` written and synced under a name no other writer uses, beside `path`.
fn write_temp(path: &Path, bytes: &[u8]) -> Result<PathBuf, BatchError> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("x");
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", super::token()));
    let mut f = fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    Ok(tmp)
}

fn sync_dir(path: &Path) {
    if let Some(d) = path.parent().and_then(|p| fs::File::open(p).ok()) {
        let _ = d.sync_all();
    }
}

/// Put `bytes` at `path` (a fresh name) whole.
fn write_new(path: &Path, bytes: &[u8]) -> Result<(), BatchError> {
    let tmp = write_temp(path, bytes)?;
    fs::rename(&tmp, path)?;
    sync_dir(path);
    Ok(())
}

/// Put `bytes` at `path` unless something is there already: whether this call did.
fn commit_once(path: &Path, bytes: &[u8]) -> Result<bool, BatchError> {
    let tmp = write_temp(path, bytes)?;
    let linked = fs::hard_link(&tmp, path);
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            sync_dir(path);
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Ids as the gateway makes them, checked before they touch a path.
fn plain(id: &str) -> Result<&str, BatchError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(id)
    } else {
        Err(BatchError::NotFound)
    }
}

impl Folder {
    pub fn open(dir: &Path) -> Result<Folder, BatchError> {
        let files = dir.join("shared").join("files");
        let batches = dir.join("shared").join("batches");
        fs::create_dir_all(&files)?;
        fs::create_dir_all(&batches)?;
        Ok(Folder {
            files,
            batches,
            counts: Mutex::new(HashMap::new()),
        })
    }

    fn file_path(&self, id: &str) -> Result<PathBuf, BatchError> {
        Ok(self.files.join(format!("{}.json", plain(id)?)))
    }

    fn batch_dir(&self, id: &str) -> Result<PathBuf, BatchError> {
        Ok(self.batches.join(plain(id)?))
    }

    pub fn put_file(&self, meta: &FileMeta) -> Result<(), BatchError> {
        write_new(&self.file_path(meta.id())?, &encode(meta)?)
    }

    pub fn file(&self, id: &str) -> Result<Option<FileMeta>, BatchError> {
        let Ok(path) = self.file_path(id) else {
            return Ok(None);
        };
        read_opt(&path)?.map(|raw| decode(&raw)).transpose()
    }

    pub fn files(&self) -> Result<Vec<FileMeta>, BatchError> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.files)? {
            let name = entry?.file_name();
            let name = name.to_string_lossy();
            if let Some(id) = name.strip_suffix(".json").filter(|n| !n.starts_with('.')) {
                out.extend(self.file(id)?);
            }
        }
        Ok(out)
    }

    pub fn delete_file(&self, id: &str) -> Result<bool, BatchError> {
        let Ok(path) = self.file_path(id) else {
            return Ok(false);
        };
        match fs::remove_file(path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    pub fn put_batch(&self, b: &BatchRecord) -> Result<(), BatchError> {
        let dir = self.batch_dir(b.id())?;
        fs::create_dir_all(dir.join("chunks"))?;
        write_new(&dir.join("batch.json"), &encode(b)?)
    }

    /// The batch's transitions, in the order they apply.
    pub fn markers(&self, id: &str) -> Result<Vec<Marker>, BatchError> {
        let dir = self.batch_dir(id)?;
        let mut out = Vec::new();
        for name in TRANSITIONS {
            if let Some(raw) = read_opt(&dir.join(name))? {
                out.push(decode::<Marker>(&raw)?);
            }
        }
        out.sort_by_key(|m| (m.at, m.transition.rank()));
        Ok(out)
    }

    /// Commit a transition: whether it is this call's (`false`: it happened already).
    pub fn transition(&self, id: &str, transition: Transition) -> Result<bool, BatchError> {
        let dir = self.batch_dir(id)?;
        let path = dir.join(transition.name());
        let marker = Marker {
            at: now(),
            transition,
        };
        commit_once(&path, &encode(&marker)?)
    }

    /// The batch as it is now (`None`: no such batch).
    pub fn batch(&self, id: &str) -> Result<Option<BatchRecord>, BatchError> {
        let Ok(dir) = self.batch_dir(id) else {
            return Ok(None);
        };
        let Some(raw) = read_opt(&dir.join("batch.json"))? else {
            return Ok(None);
        };
        let mut rec: BatchRecord = decode(&raw)?;
        let mut finished = false;
        for m in self.markers(id)? {
            match m.transition {
                Transition::Started { total, model, .. } => rec.start(total, model, m.at),
                Transition::Failed { failures } => rec.fail(failures, m.at),
                Transition::Cancelling => {
                    rec.cancel(m.at);
                }
                Transition::Finalizing => rec.finalize(m.at),
                Transition::Finished {
                    output,
                    errors,
                    expired,
                    completed,
                    failed,
                } => {
                    rec.set_counts(completed, failed);
                    rec.finish(output, errors, m.at, expired);
                    finished = true;
                }
            }
        }
        if !finished {
            let (c, f) = self
                .committed(id)?
                .into_iter()
                .map(|n| self.chunk_counts(id, n))
                .try_fold((0, 0), |(c, f), r| r.map(|(c2, f2)| (c + c2, f + f2)))?;
            rec.set_counts(c, f);
        }
        Ok(Some(rec))
    }

    pub fn batches(&self) -> Result<Vec<BatchRecord>, BatchError> {
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.batches)? {
            let name = entry?.file_name();
            if let Some(id) = name.to_str().filter(|n| !n.starts_with('.')) {
                out.extend(self.batch(id)?);
            }
        }
        Ok(out)
    }

    /// Ask batch `id` to stop (see [`BatchRecord::cancel`]).
    pub fn cancel(&self, id: &str) -> Result<Option<(BatchRecord, bool)>, BatchError> {
        let Some(mut rec) = self.batch(id)? else {
            return Ok(None);
        };
        let was = rec.status();
        let ok = rec.cancel(now());
        if ok && rec.status() != was {
            self.transition(id, Transition::Cancelling)?;
        }
        Ok(self.batch(id)?.map(|r| (r, ok)))
    }

    fn chunk_path(&self, id: &str, n: u64) -> Result<PathBuf, BatchError> {
        Ok(self.batch_dir(id)?.join("chunks").join(n.to_string()))
    }

    /// The numbers of the batch's committed chunks.
    pub fn committed(&self, id: &str) -> Result<BTreeSet<u64>, BatchError> {
        let dir = self.batch_dir(id)?.join("chunks");
        let mut out = BTreeSet::new();
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(e.into()),
        };
        for entry in entries {
            if let Some(n) = entry?.file_name().to_str().and_then(|n| n.parse().ok()) {
                out.insert(n);
            }
        }
        Ok(out)
    }

    /// Commit chunk `n`'s results (in line order): whether this call did (`false`: another
    /// replica committed it first, and its results stand).
    pub fn commit_chunk(
        &self,
        id: &str,
        n: u64,
        results: &[LineResult],
    ) -> Result<bool, BatchError> {
        let completed = results.iter().filter(|r| r.ok).count();
        let head = serde_json::json!({"completed": completed, "failed": results.len() - completed});
        let mut bytes = head.to_string().into_bytes();
        bytes.push(b'\n');
        for r in results {
            bytes.push(if r.ok { b'o' } else { b'e' });
            bytes.extend_from_slice(&r.line);
            bytes.push(b'\n');
        }
        commit_once(&self.chunk_path(id, n)?, &bytes)
    }

    /// A committed chunk's (completed, failed).
    fn chunk_counts(&self, id: &str, n: u64) -> Result<(u64, u64), BatchError> {
        let key = (id.to_string(), n);
        if let Some(c) = self.counts.lock().ok().and_then(|m| m.get(&key).copied()) {
            return Ok(c);
        }
        let mut head = String::new();
        std::io::BufReader::new(fs::File::open(self.chunk_path(id, n)?)?).read_line(&mut head)?;
        let v: serde_json::Value = decode(head.as_bytes())?;
        let c = (
            v["completed"].as_u64().unwrap_or(0),
            v["failed"].as_u64().unwrap_or(0),
        );
        if let Ok(mut m) = self.counts.lock() {
            m.insert(key, c);
        }
        Ok(c)
    }

    /// A committed chunk's results: (goes to the output file, the line) in line order.
    pub fn chunk_lines(&self, id: &str, n: u64) -> Result<Vec<(bool, Vec<u8>)>, BatchError> {
        let raw = fs::read(self.chunk_path(id, n)?)?;
        Ok(raw
            .split(|b| *b == b'\n')
            .skip(1)
            .filter_map(|l| l.split_first())
            .map(|(kind, line)| (*kind == b'o', line.to_vec()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::record::Status;

    fn result(index: u64, ok: bool) -> LineResult {
        LineResult {
            index,
            ok,
            line: format!("{{\"i\":{index}}}").into_bytes(),
        }
    }

    #[test]
    fn transitions_and_chunks_are_committed_once() {
        let dir = tempfile::tempdir().unwrap();
        let a = Folder::open(dir.path()).unwrap();
        let b = Folder::open(dir.path()).unwrap(); // a second replica on the same folder
        let rec = BatchRecord::new("t", "k", "file-1", "/v1/completions", None);
        let id = rec.id().to_string();
        a.put_batch(&rec).unwrap();
        assert_eq!(b.batch(&id).unwrap().unwrap().status(), Status::Validating);
        let started = || Transition::Started {
            total: 3,
            model: None,
            chunk_lines: 2,
        };
        assert!(a.transition(&id, started()).unwrap());
        assert!(!b.transition(&id, started()).unwrap());
        assert!(a.commit_chunk(&id, 1, &[result(2, false)]).unwrap());
        assert!(!b.commit_chunk(&id, 1, &[result(2, true)]).unwrap());
        assert!(b
            .commit_chunk(&id, 0, &[result(0, true), result(1, true)])
            .unwrap());
        let r = a.batch(&id).unwrap().unwrap();
        assert_eq!(r.status(), Status::InProgress);
        assert_eq!((r.counts().completed, r.counts().failed), (2, 1));
        assert_eq!(
            b.chunk_lines(&id, 1).unwrap(),
            [(false, b"{\"i\":2}".to_vec())]
        );
        let (r, ok) = b.cancel(&id).unwrap().unwrap();
        assert!(ok);
        assert_eq!(r.status(), Status::Cancelling);
        assert_eq!(a.batches().unwrap().len(), 1);
        assert!(a.batch("../x").unwrap().is_none());
    }
}
