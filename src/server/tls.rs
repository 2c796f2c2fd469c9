//! The client listener's TLS: its certificate and key from PEM files, optional
//! client-certificate verification against a CA bundle (mTLS), ALPN offering `h2` then
//! `http/1.1` (the material is built by [`crate::tls`]). The files are re-read every
//! `[reload] interval`; a changed set that parses is swapped in atomically for new connections,
//! a broken one is logged and the previous certificate keeps serving. Open connections keep the
//! session they negotiated.
//!
//! Backends' TLS is not here: each fleet builds its client configuration from its config
//! snapshot (see [`crate::upstream::BackendTls`]).

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio_rustls::TlsAcceptor;

use crate::config::TlsConfig;
use crate::gateway::Gateway;
use crate::telemetry::metrics as m;
use crate::tls::{Material, ServerFiles};

/// The paths of `[tls]`.
pub fn files(t: &TlsConfig) -> ServerFiles<'_> {
    ServerFiles {
        cert: &t.cert,
        key: &t.key,
        client_ca: t.client_ca.as_deref(),
    }
}

/// The listener's live TLS configuration.
pub struct ServerTls {
    current: ArcSwap<rustls::ServerConfig>,
    /// Digest of the files in force, and of the last set that failed (so it is logged once).
    seen: Mutex<([u8; 32], Option<[u8; 32]>)>,
}

impl ServerTls {
    /// Load the files now.
    pub fn new(t: &TlsConfig) -> Result<Arc<ServerTls>, String> {
        let material = Material::read(files(t))?;
        let config = material.server_config(files(t))?;
        Ok(Arc::new(ServerTls {
            current: ArcSwap::from_pointee(config),
            seen: Mutex::new((material.digest(), None)),
        }))
    }

    /// An acceptor with the configuration in force now.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.load_full())
    }

    /// Re-read the files; swap in a changed set that is valid. Returns `Some(true)` when a new
    /// configuration was applied, `Some(false)` when a changed set was rejected, `None` when
    /// nothing changed.
    pub fn refresh(&self, t: &TlsConfig) -> Option<bool> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let material = match Material::read(files(t)) {
            Ok(m) => m,
            Err(e) => {
                // A file briefly missing mid-rotation is normal; say so once per state.
                if seen.1 != Some([0; 32]) {
                    tracing::error!("TLS reload rejected, keeping the current certificate: {e}");
                    metrics::counter!(m::TLS_RELOADS_TOTAL, "result" => "rejected").increment(1);
                    seen.1 = Some([0; 32]);
                }
                return Some(false);
            }
        };
        let digest = material.digest();
        if digest == seen.0 {
            seen.1 = None;
            return None;
        }
        if seen.1 == Some(digest) {
            return Some(false);
        }
        match material.server_config(files(t)) {
            Ok(config) => {
                self.current.store(Arc::new(config));
                *seen = (digest, None);
                metrics::counter!(m::TLS_RELOADS_TOTAL, "result" => "applied").increment(1);
                tracing::info!(cert = %t.cert.display(), "TLS certificate reloaded");
                Some(true)
            }
            Err(e) => {
                seen.1 = Some(digest);
                metrics::counter!(m::TLS_RELOADS_TOTAL, "result" => "rejected").increment(1);
                tracing::error!("TLS reload rejected, keeping the current certificate: {e}");
                Some(false)
            }
        }
    }

    /// Re-check the files of the gateway's current `[tls]` every `[reload] interval` while
    /// both the gateway and this listener's TLS are alive.
    pub fn spawn_watch(self: &Arc<Self>, gw: Weak<Gateway>) {
        let tls = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut removed_logged = false;
            loop {
                let interval = match gw.upgrade() {
                    Some(g) => g.runtime().config.reload.interval,
                    None => return,
                };
                tokio::time::sleep(interval.max(Duration::from_millis(10))).await;
                let (Some(g), Some(tls)) = (gw.upgrade(), tls.upgrade()) else {
                    return;
                };
                let rt = g.runtime();
                match &rt.config.tls {
                    Some(t) => {
                        removed_logged = false;
                        tls.refresh(t);
                    }
                    None if !removed_logged => {
                        removed_logged = true;
                        tracing::warn!(
                            "[tls] was removed by a reload; the listener keeps TLS until a restart"
                        );
                    }
                    None => {}
                }
            }
        });
    }
}
