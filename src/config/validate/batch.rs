//! `[batch]`: the folder of files and job state, and the bounds of uploads and batches.

use std::path::PathBuf;

use std::time::Duration;

use super::{duration_at_least, in_range, Problems};
use crate::config::file::BatchSection;
use crate::config::runtime::{BatchConfig, PassthroughRule};

/// OpenAI's own limit on a batch's input file is 200 MB; the default keeps an upload, which is
/// held in memory while it is stored, smaller.
const DEFAULT_MAX_FILE_BYTES: u64 = 100 * 1024 * 1024;
const MAX_FILE_BYTES: u64 = 1024 * 1024 * 1024;
/// OpenAI's limit of requests in one batch.
const DEFAULT_MAX_LINES: u64 = 50_000;

/// The paths `[batch]` serves, which a `[[passthrough]]` rule may not take while it is on.
const PATHS: &[&str] = &["/v1/files", "/v1/batches"];

/// How much longer batch lines may make an engine's step, by default: under what
/// bench/batch/idle.py can tell from run-to-run noise.
const DEFAULT_MAX_TTFT_RISE: f64 = 0.05;

/// How long a chunk's lease outlives a replica that stopped renewing it, by default.
const DEFAULT_LEASE: Duration = Duration::from_secs(30);

pub(super) fn batch(
    p: &mut Problems,
    b: &BatchSection,
    rules: &[PassthroughRule],
    redis_url: Option<&str>,
) -> BatchConfig {
    let dir = b.dir.trim();
    if dir.is_empty() {
        p.push("batch.dir", "must name a folder");
    }
    let shared = b.shared.unwrap_or(false);
    if shared && redis_url.is_none() {
        p.push(
            "batch.shared",
            "needs [limits] redis_url: replicas share batches through that Redis",
        );
    }
    for r in rules {
        if let Some(path) = PATHS
            .iter()
            .find(|s| r.prefix == **s || r.prefix.starts_with(&format!("{s}/")))
        {
            p.push(
                "batch",
                format!(
                    "serves {path}, which the [[passthrough]] rule `{}` takes",
                    r.prefix
                ),
            );
        }
    }
    BatchConfig {
        dir: PathBuf::from(dir),
        max_file_bytes: in_range(
            p,
            "batch.max_file_bytes",
            b.max_file_bytes,
            DEFAULT_MAX_FILE_BYTES as usize,
            1..=MAX_FILE_BYTES,
        ),
        max_lines: in_range(
            p,
            "batch.max_lines",
            b.max_lines,
            DEFAULT_MAX_LINES as usize,
            1..=1_000_000,
        ),
        max_in_flight: in_range(p, "batch.max_in_flight", b.max_in_flight, 4, 1..=1024),
        max_ttft_rise: max_ttft_rise(p, b.max_ttft_rise),
        shared,
        chunk_lines: in_range(p, "batch.chunk_lines", b.chunk_lines, 100, 1..=100_000),
        lease: duration_at_least(
            p,
            "batch.lease",
            &b.lease,
            DEFAULT_LEASE,
            Duration::from_millis(300),
        ),
    }
}

/// A fraction from 0 (one line per engine at a time) to 100 (the slots alone decide).
fn max_ttft_rise(p: &mut Problems, v: Option<f64>) -> f64 {
    match v {
        None => DEFAULT_MAX_TTFT_RISE,
        Some(r) if r.is_finite() && (0.0..=100.0).contains(&r) => r,
        Some(_) => {
            p.push(
                "batch.max_ttft_rise",
                "must be a fraction between 0 and 100 (0.05: 5%)",
            );
            DEFAULT_MAX_TTFT_RISE
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::from_str;

    #[test]
    fn off_without_the_section_and_defaults_with_it() {
        assert!(from_str("", "t").unwrap().batch.is_none());
        let c = from_str("[batch]\ndir = \"jobs\"\n", "t").unwrap();
        let b = c.batch.unwrap();
        assert_eq!(b.dir, std::path::PathBuf::from("jobs"));
        assert_eq!(b.max_file_bytes, 100 * 1024 * 1024);
        assert_eq!(b.max_lines, 50_000);
        assert_eq!(b.max_in_flight, 4);
        assert_eq!(b.max_ttft_rise, 0.05);
        assert!(!b.shared);
        assert_eq!(
            (b.chunk_lines, b.lease),
            (100, std::time::Duration::from_secs(30))
        );
        let c = from_str(
            "[limits]\nredis_url = \"redis://127.0.0.1:1/\"\n[batch]\ndir = \"jobs\"\nshared = true\nchunk_lines = 5\nlease = \"2s\"\n",
            "t",
        )
        .unwrap();
        let b = c.batch.unwrap();
        assert!(b.shared);
        assert_eq!(
            (b.chunk_lines, b.lease),
            (5, std::time::Duration::from_secs(2))
        );
    }

    #[test]
    fn every_mistake_is_located() {
        let cases = [
            ("[batch]\ndir = \" \"\n", "batch.dir: must name a folder"),
            (
                "[batch]\ndir = \"d\"\nmax_file_bytes = 0\n",
                "batch.max_file_bytes: must be between 1 and",
            ),
            (
                "[batch]\ndir = \"d\"\nmax_in_flight = 0\n",
                "batch.max_in_flight: must be between 1 and 1024",
            ),
            ("[batch]\ndir = \"d\"\nmax_lines = 0\n", "batch.max_lines: must be between"),
            (
                "[batch]\ndir = \"d\"\nmax_ttft_rise = -0.1\n",
                "batch.max_ttft_rise: must be a fraction between 0 and 100",
            ),
            ("[batch]\ndri = \"d\"\n", "unknown field `dri`"),
            (
                "[batch]\ndir = \"d\"\nshared = true\n",
                "batch.shared: needs [limits] redis_url",
            ),
            (
                "[batch]\ndir = \"d\"\nchunk_lines = 0\n",
                "batch.chunk_lines: must be between 1 and 100000",
            ),
            (
                "[batch]\ndir = \"d\"\nlease = \"10ms\"\n",
                "batch.lease: must be at least 300ms",
            ),
            (
                "[batch]\ndir = \"d\"\n[[passthrough]]\nprefix = \"/v1/files\"\nmodel_field = \"model\"\n",
                "batch: serves /v1/files, which the [[passthrough]] rule `/v1/files` takes",
            ),
        ];
        for (toml, want) in cases {
            let err = from_str(toml, "t").unwrap_err().to_string();
            assert!(err.contains(want), "{toml}: {err}");
        }
    }
}
