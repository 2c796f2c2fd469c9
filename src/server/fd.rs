//! The open-file probe: at start, a warning when the process's open-file limit cannot hold a
//! listener's `max_connections`.
//!
//! Invariant: it only warns, never changes a limit or refuses to start. Linux only (it reads
//! `/proc/self/limits`); elsewhere nothing is checked.

use super::ListenerLimits;

/// Descriptors the process needs beside its client connections (backends, files, logs).
const SPARE_FDS: u64 = 128;

/// Warn when the process's open-file limit cannot hold `max_connections` (each connection is
/// a descriptor; a request in flight takes a second one towards its backend).
pub(super) fn warn_if_fd_limit_low(limits: &ListenerLimits) {
    let Some(soft) = open_files_soft_limit() else {
        return;
    };
    let wanted = limits.max_connections as u64 + SPARE_FDS;
    if soft < wanted {
        tracing::warn!(
            listener = limits.name,
            max_connections = limits.max_connections,
            open_files_limit = soft,
            "the open-file limit is below max_connections: beyond it connections fail at accept \
             instead of being refused cleanly; raise it (ulimit -n, systemd LimitNOFILE=, \
             container nofile ulimit) to at least twice max_connections, or lower max_connections"
        );
    }
}

/// The soft `RLIMIT_NOFILE`, from `/proc/self/limits`.
fn open_files_soft_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}
