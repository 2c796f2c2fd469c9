//! Live reload: on SIGHUP and when the file changes on disk, the file is read and validated
//! again; a valid one is swapped in atomically ([`Gateway::reload`]), an invalid one is
//! rejected with every problem logged while the old config keeps serving.
//!
//! The file watch is a cheap content poll every `[reload] interval` (default 1 s): the file's
//! SHA-256 is compared with the last one seen, and a change is applied only once the content
//! has stayed the same for one whole interval (debounce: an editor or a ConfigMap update that
//! writes in several steps is read once, complete). Polling the content rather than watching
//! inodes also follows Kubernetes' symlink swaps of mounted ConfigMaps.
//!
//! Invariants: a rejected file is not retried until its content changes again; requests in
//! flight finish on the snapshot they started with (a removed backend drains, its streams run
//! to the end); backend state, tenant usage and the wait queue survive a reload. Everything a
//! reload changes, `[backend_tls]` included, is applied by [`Gateway::reload`]: nothing is set
//! beside it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use crate::gateway::Gateway;
use crate::telemetry::metrics as m;

/// Reload `path` into `gw` now. Returns whether the new config was applied.
pub fn reload_now(gw: &Gateway, path: &Path) -> bool {
    match crate::config::load(path) {
        Ok(config) => {
            let old = gw.runtime();
            let old_names: Vec<&str> = old
                .config
                .backends
                .iter()
                .map(|b| b.name.as_str())
                .collect();
            let added: Vec<&str> = config
                .backends
                .iter()
                .map(|b| b.name.as_str())
                .filter(|n| !old_names.contains(n))
                .collect();
            let removed: Vec<&str> = old_names
                .iter()
                .copied()
                .filter(|n| !config.backends.iter().any(|b| b.name == *n))
                .collect();
            let changed: Vec<&str> = config
                .backends
                .iter()
                .filter(|b| {
                    old.config
                        .backends
                        .iter()
                        .any(|o| o.name == b.name && o != *b)
                })
                .map(|b| b.name.as_str())
                .collect();
            let (backends, keys) = (config.backends.len(), config.keys.len());
            let tracing_changed = config.tracing != old.config.tracing;
            tracing::info!(
                path = %path.display(),
                backends,
                keys,
                tracing_changed,
                added = ?added,
                removed = ?removed,
                changed = ?changed,
                "config reloaded"
            );
            gw.reload(config);
            metrics::counter!(m::CONFIG_RELOADS_TOTAL, "result" => "applied").increment(1);
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            metrics::gauge!(m::CONFIG_LAST_RELOAD_SECONDS).set(now);
            true
        }
        Err(e) => {
            for p in e.problems() {
                tracing::error!("config reload rejected (the previous config keeps serving): {p}");
            }
            metrics::counter!(m::CONFIG_RELOADS_TOTAL, "result" => "rejected").increment(1);
            false
        }
    }
}

/// Reload on every SIGHUP for as long as the process runs, and on file change while the
/// gateway lives (when `[reload] watch` is on).
pub fn spawn_watcher(gw: Arc<Gateway>, path: PathBuf) {
    spawn_file_watch(Arc::downgrade(&gw), path.clone());
    #[cfg(unix)]
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            tracing::warn!("cannot listen for SIGHUP; reload by file change or restart only");
            return;
        };
        while hup.recv().await.is_some() {
            tracing::info!(path = %path.display(), "SIGHUP: reloading the config");
            reload_now(&gw, &path);
        }
    });
    #[cfg(not(unix))]
    let _ = (gw, path);
}

fn digest(path: &Path) -> Option<[u8; 32]> {
    std::fs::read(path).ok().map(|b| Sha256::digest(&b).into())
}

/// Poll `path` and reload it when its content changed and then held still for one interval.
/// Ends when the gateway is dropped.
pub fn spawn_file_watch(gw: Weak<Gateway>, path: PathBuf) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut seen = digest(&path);
        let mut pending: Option<[u8; 32]> = None;
        let mut missing_logged = false;
        loop {
            let (interval, watch) = match gw.upgrade() {
                Some(g) => {
                    let r = g.runtime().config.reload;
                    (r.interval, r.watch)
                }
                None => return,
            };
            tokio::time::sleep(interval.max(Duration::from_millis(10))).await;
            if !watch {
                continue;
            }
            let Some(now) = digest(&path) else {
                if !missing_logged {
                    tracing::warn!(path = %path.display(), "config file unreadable; keeping the current config");
                    missing_logged = true;
                }
                continue;
            };
            missing_logged = false;
            if Some(now) == seen {
                pending = None;
                continue;
            }
            if pending != Some(now) {
                pending = Some(now);
                continue;
            }
            pending = None;
            seen = Some(now);
            let Some(g) = gw.upgrade() else { return };
            tracing::info!(path = %path.display(), "config file changed; reloading");
            reload_now(&g, &path);
        }
    })
}
