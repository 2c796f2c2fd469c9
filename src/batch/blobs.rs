//! File contents on disk: one file per id under `<dir>/files/`, written whole to a temporary
//! name, synced, then renamed into place.
//!
//! Invariants: a file under its id is complete (a crash leaves at most a `.tmp` file, removed
//! at the next start; in a folder other replicas write too, only once it is an hour old);
//! ids are checked to be plain names before they touch a path.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::BatchError;

/// The contents folder of one `[batch] dir`.
pub struct Blobs {
    dir: PathBuf,
}

/// An id as this module writes them: letters, digits, `-` and `_`, nothing that walks a path.
fn plain(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl Blobs {
    /// The folder, created when missing; leftovers of an interrupted write removed (`shared`:
    /// those an hour old, a younger one may be another replica's write in progress).
    pub fn open(dir: &Path, shared: bool) -> Result<Blobs, BatchError> {
        let dir = dir.join("files");
        fs::create_dir_all(&dir)?;
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        for entry in fs::read_dir(&dir)? {
            let entry = entry?;
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "tmp") {
                continue;
            }
            let young = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t > old);
            if !(shared && young) {
                let _ = fs::remove_file(&path);
            }
        }
        Ok(Blobs { dir })
    }

    fn path(&self, id: &str) -> Result<PathBuf, BatchError> {
        if !plain(id) {
            return Err(BatchError::NotFound);
        }
        Ok(self.dir.join(id))
    }

    /// Write `parts` one after another as the contents of `id`, durably.
    pub fn write<'a>(
        &self,
        id: &str,
        parts: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<u64, BatchError> {
        let path = self.path(id)?;
        // A name of its own: two replicas may write the same id (an upload is never written
        // twice, but a tmp name must not be shared with anyone).
        let tmp = self
            .dir
            .join(format!(".{id}.{}.tmp", super::shared::token()));
        let mut f = std::io::BufWriter::new(fs::File::create(&tmp)?);
        let mut n = 0u64;
        for p in parts {
            f.write_all(p)?;
            n += p.len() as u64;
        }
        let f = f.into_inner().map_err(|e| e.into_error())?;
        f.sync_all()?;
        fs::rename(&tmp, &path)?;
        if let Ok(d) = fs::File::open(&self.dir) {
            let _ = d.sync_all();
        }
        Ok(n)
    }

    pub fn read(&self, id: &str) -> Result<Vec<u8>, BatchError> {
        match fs::read(self.path(id)?) {
            Ok(b) => Ok(b),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(BatchError::NotFound),
            Err(e) => Err(e.into()),
        }
    }

    pub fn remove(&self, id: &str) -> Result<(), BatchError> {
        match fs::remove_file(self.path(id)?) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.into()),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_whole_and_paths_stay_inside() {
        let dir = tempfile::tempdir().unwrap();
        let b = Blobs::open(dir.path(), false).unwrap();
        assert_eq!(b.write("file-1", [&b"ab"[..], b"c"]).unwrap(), 3);
        assert_eq!(b.read("file-1").unwrap(), b"abc");
        for bad in ["../x", "a/b", "", ".."] {
            assert!(matches!(b.read(bad), Err(BatchError::NotFound)), "{bad}");
        }
        b.remove("file-1").unwrap();
        b.remove("file-1").unwrap();
        assert!(matches!(b.read("file-1"), Err(BatchError::NotFound)));
    }
}
