//! Live reload: on SIGHUP (and, see the operations issue, on file change) the file is read and
//! validated again; a valid one is swapped in atomically, an invalid one is rejected with every
//! problem logged while the old config keeps serving.

use std::path::PathBuf;
use std::sync::Arc;

use crate::gateway::Gateway;

/// Reload `path` into `gw` now. Returns whether the new config was applied.
pub fn reload_now(gw: &Gateway, path: &std::path::Path) -> bool {
    match super::load(path) {
        Ok(config) => {
            let backends = config.backends.len();
            let keys = config.keys.len();
            gw.reload(config);
            tracing::info!(path = %path.display(), backends, keys, "config reloaded");
            true
        }
        Err(e) => {
            for p in e.problems() {
                tracing::error!("config reload rejected: {p}");
            }
            false
        }
    }
}

/// Reload on every SIGHUP for as long as the process runs.
pub fn spawn_watcher(gw: Arc<Gateway>, path: PathBuf) {
    #[cfg(unix)]
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            tracing::warn!("cannot listen for SIGHUP; reload by restart only");
            return;
        };
        while hup.recv().await.is_some() {
            reload_now(&gw, &path);
        }
    });
    #[cfg(not(unix))]
    let _ = (gw, path);
}
