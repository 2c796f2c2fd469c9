//! Job state in an embedded database (redb): file records, batch records and each line's
//! result, every change one ACID transaction made durable (fsync) before it returns.
//!
//! Invariants:
//! - A line's result is written at most once: [`Store::record_lines`] inserts it only when the
//!   line has none, in the same transaction that counts it on its batch, so a line that ran
//!   twice (in flight at a crash, run again after) is counted and kept once.
//! - What a committed transaction wrote survives a crash of the process at any point
//!   (redb's copy-on-write commit); what an unfinished one wrote is not seen.
//!
//! Every method blocks on the disk: callers run them off the async threads.

use std::path::Path;

use redb::{Database, ReadableTable, TableDefinition};

use super::record::{BatchRecord, FileMeta};
use super::BatchError;

/// A table of JSON records by id.
type Records = TableDefinition<'static, &'static str, &'static [u8]>;

const FILES: Records = TableDefinition::new("files");
const BATCHES: Records = TableDefinition::new("batches");
/// (batch id, line index) → the line's output line, after one byte: `o` (output file) or
/// `e` (error file).
const LINES: TableDefinition<(&str, u64), &[u8]> = TableDefinition::new("lines");

/// How long [`Store::open`] waits for another holder of the database to let it go.
const OPEN_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// A line's recorded result.
pub struct LineResult {
    pub index: u64,
    /// Goes to the output file (else the error file).
    pub ok: bool,
    pub line: Vec<u8>,
}

impl LineResult {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.line.len() + 1);
        v.push(if self.ok { b'o' } else { b'e' });
        v.extend_from_slice(&self.line);
        v
    }

    fn decode(index: u64, raw: &[u8]) -> LineResult {
        let (ok, line) = match raw.split_first() {
            Some((b'o', rest)) => (true, rest),
            Some((_, rest)) => (false, rest),
            None => (false, raw),
        };
        LineResult {
            index,
            ok,
            line: line.to_vec(),
        }
    }
}

/// The database of one `[batch] dir`.
pub struct Store {
    db: Database,
}

fn decode<T: serde::de::DeserializeOwned>(raw: &[u8]) -> Result<T, BatchError> {
    serde_json::from_slice(raw).map_err(|e| BatchError::Corrupt(e.to_string()))
}

fn encode<T: serde::Serialize>(v: &T) -> Result<Vec<u8>, BatchError> {
    serde_json::to_vec(v).map_err(|e| BatchError::Corrupt(e.to_string()))
}

impl Store {
    /// Open (or create) the database at `path`, with its tables. redb locks the file for one
    /// process; a gateway that is still shutting down (the previous one in this process, or a
    /// process still exiting) holds it a little longer, so a locked file is tried again for
    /// up to [`OPEN_WAIT`].
    pub fn open(path: &Path) -> Result<Store, BatchError> {
        let deadline = std::time::Instant::now() + OPEN_WAIT;
        let db = loop {
            match Database::create(path) {
                Err(redb::DatabaseError::DatabaseAlreadyOpen)
                    if std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                other => break other.map_err(redb::Error::from)?,
            }
        };
        let txn = db.begin_write().map_err(redb::Error::from)?;
        {
            txn.open_table(FILES).map_err(redb::Error::from)?;
            txn.open_table(BATCHES).map_err(redb::Error::from)?;
            txn.open_table(LINES).map_err(redb::Error::from)?;
        }
        txn.commit().map_err(redb::Error::from)?;
        Ok(Store { db })
    }

    /// Run `f` in one write transaction and commit it.
    fn write<T>(
        &self,
        f: impl FnOnce(&redb::WriteTransaction) -> Result<T, BatchError>,
    ) -> Result<T, BatchError> {
        let txn = self.db.begin_write().map_err(redb::Error::from)?;
        let out = f(&txn)?;
        txn.commit().map_err(redb::Error::from)?;
        Ok(out)
    }

    pub fn put_file(&self, meta: &FileMeta) -> Result<(), BatchError> {
        self.put(FILES, meta.id(), meta)
    }

    pub fn file(&self, id: &str) -> Result<Option<FileMeta>, BatchError> {
        self.get(FILES, id)
    }

    /// Every file record.
    pub fn files(&self) -> Result<Vec<FileMeta>, BatchError> {
        self.all(FILES)
    }

    /// Remove a file record; whether there was one.
    pub fn delete_file(&self, id: &str) -> Result<bool, BatchError> {
        self.write(|txn| {
            let mut t = txn.open_table(FILES).map_err(redb::Error::from)?;
            let removed = t.remove(id).map_err(redb::Error::from)?.is_some();
            Ok(removed)
        })
    }

    pub fn put_batch(&self, b: &BatchRecord) -> Result<(), BatchError> {
        self.put(BATCHES, b.id(), b)
    }

    pub fn batch(&self, id: &str) -> Result<Option<BatchRecord>, BatchError> {
        self.get(BATCHES, id)
    }

    /// Every batch record.
    pub fn batches(&self) -> Result<Vec<BatchRecord>, BatchError> {
        self.all(BATCHES)
    }

    /// Write record `v` under `id` in `table` (replacing what was there).
    fn put<T: serde::Serialize>(&self, table: Records, id: &str, v: &T) -> Result<(), BatchError> {
        let raw = encode(v)?;
        self.write(|txn| {
            let mut t = txn.open_table(table).map_err(redb::Error::from)?;
            t.insert(id, raw.as_slice()).map_err(redb::Error::from)?;
            Ok(())
        })
    }

    /// The record under `id` in `table`.
    fn get<T: serde::de::DeserializeOwned>(
        &self,
        table: Records,
        id: &str,
    ) -> Result<Option<T>, BatchError> {
        let txn = self.db.begin_read().map_err(redb::Error::from)?;
        let t = txn.open_table(table).map_err(redb::Error::from)?;
        match t.get(id).map_err(redb::Error::from)? {
            Some(raw) => Ok(Some(decode(raw.value())?)),
            None => Ok(None),
        }
    }

    /// Every record of `table`.
    fn all<T: serde::de::DeserializeOwned>(&self, table: Records) -> Result<Vec<T>, BatchError> {
        let txn = self.db.begin_read().map_err(redb::Error::from)?;
        let t = txn.open_table(table).map_err(redb::Error::from)?;
        let mut out = Vec::new();
        for row in t.iter().map_err(redb::Error::from)? {
            let (_, raw) = row.map_err(redb::Error::from)?;
            out.push(decode(raw.value())?);
        }
        Ok(out)
    }

    /// Change a batch in one transaction (`None`: no such batch).
    pub fn update_batch(
        &self,
        id: &str,
        f: impl FnOnce(&mut BatchRecord),
    ) -> Result<Option<BatchRecord>, BatchError> {
        self.write(|txn| update(txn, id, f))
    }

    /// Record `results` of a batch's lines and apply `f` to the batch, in one transaction. A
    /// line that has a result already keeps it and is not counted again; each new one is
    /// counted ([`BatchRecord::count`]). `None`: no such batch (nothing written).
    pub fn record_lines(
        &self,
        id: &str,
        results: &[LineResult],
        f: impl FnOnce(&mut BatchRecord),
    ) -> Result<Option<BatchRecord>, BatchError> {
        self.write(|txn| {
            let known = txn.open_table(BATCHES).map_err(redb::Error::from)?;
            if known.get(id).map_err(redb::Error::from)?.is_none() {
                return Ok(None);
            }
            drop(known);
            let mut fresh = Vec::new();
            {
                let mut t = txn.open_table(LINES).map_err(redb::Error::from)?;
                for r in results {
                    if t.get((id, r.index)).map_err(redb::Error::from)?.is_some() {
                        continue;
                    }
                    t.insert((id, r.index), r.encode().as_slice())
                        .map_err(redb::Error::from)?;
                    fresh.push(r.ok);
                }
            }
            update(txn, id, |b| {
                for ok in fresh {
                    b.count(ok);
                }
                f(b);
            })
        })
    }

    /// The indexes of a batch's lines that have a result.
    pub fn done_lines(&self, id: &str) -> Result<std::collections::HashSet<u64>, BatchError> {
        let mut done = std::collections::HashSet::new();
        self.each_line(id, |r| {
            done.insert(r.index);
            Ok(())
        })?;
        Ok(done)
    }

    /// Each recorded line of a batch, in line order.
    pub fn each_line(
        &self,
        id: &str,
        mut f: impl FnMut(LineResult) -> Result<(), BatchError>,
    ) -> Result<(), BatchError> {
        let txn = self.db.begin_read().map_err(redb::Error::from)?;
        let t = txn.open_table(LINES).map_err(redb::Error::from)?;
        for row in t
            .range((id, 0u64)..=(id, u64::MAX))
            .map_err(redb::Error::from)?
        {
            let (k, v) = row.map_err(redb::Error::from)?;
            f(LineResult::decode(k.value().1, v.value()))?;
        }
        Ok(())
    }

    /// The files a batch wrote and the change `f` to the batch, in one transaction.
    pub fn finish(
        &self,
        id: &str,
        files: &[FileMeta],
        f: impl FnOnce(&mut BatchRecord),
    ) -> Result<Option<BatchRecord>, BatchError> {
        let metas: Vec<_> = files
            .iter()
            .map(|m| Ok((m.id().to_string(), encode(m)?)))
            .collect::<Result<_, BatchError>>()?;
        self.write(|txn| {
            let mut t = txn.open_table(FILES).map_err(redb::Error::from)?;
            for (id, raw) in &metas {
                t.insert(id.as_str(), raw.as_slice())
                    .map_err(redb::Error::from)?;
            }
            drop(t);
            update(txn, id, f)
        })
    }
}

fn update(
    txn: &redb::WriteTransaction,
    id: &str,
    f: impl FnOnce(&mut BatchRecord),
) -> Result<Option<BatchRecord>, BatchError> {
    let mut t = txn.open_table(BATCHES).map_err(redb::Error::from)?;
    let mut b: BatchRecord = match t.get(id).map_err(redb::Error::from)? {
        Some(raw) => decode(raw.value())?,
        None => return Ok(None),
    };
    f(&mut b);
    let raw = encode(&b)?;
    t.insert(id, raw.as_slice()).map_err(redb::Error::from)?;
    Ok(Some(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(index: u64, ok: bool) -> LineResult {
        LineResult {
            index,
            ok,
            line: format!("{{\"i\":{index}}}").into_bytes(),
        }
    }

    #[test]
    fn a_line_is_recorded_and_counted_once() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("state.redb")).unwrap();
        let mut b = BatchRecord::new("t", "k", "file-1", "/v1/completions", None);
        b.start(3, None, super::super::record::now());
        s.put_batch(&b).unwrap();
        let id = b.id().to_string();
        s.record_lines(&id, &[line(2, true)], |_| {}).unwrap();
        s.record_lines(&id, &[line(0, false), line(2, false)], |_| {})
            .unwrap();
        let b = s.batch(&id).unwrap().unwrap();
        assert_eq!((b.counts().completed, b.counts().failed), (1, 1));
        let mut seen = Vec::new();
        s.each_line(&id, |r| {
            seen.push((r.index, r.ok));
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, [(0, false), (2, true)]);
        drop(s);
        // reopened: the same state
        let s = Store::open(&dir.path().join("state.redb")).unwrap();
        assert_eq!(s.done_lines(&id).unwrap().len(), 2);
        assert!(s.record_lines("nope", &[], |_| {}).unwrap().is_none());
    }
}
