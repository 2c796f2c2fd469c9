//! TLS material, both directions.
//!
//! - Server side ([`ServerTls`]): the client listener's certificate and key from PEM files,
//!   optional client-certificate verification against a CA bundle (mTLS), ALPN offering `h2`
//!   then `http/1.1`. The files are re-read every `[reload] interval`; a changed set that
//!   parses is swapped in atomically for new connections, a broken one is logged and the
//!   previous certificate keeps serving. Open connections keep the session they negotiated.
//! - Client side ([`client_config`]): the rustls config towards `https://` backends: the
//!   system's trust roots and/or the `[backend_tls] ca_file` bundle ([`configure_backends`]).
//!
//! Invariants: all crypto is rustls with the ring provider; nothing here panics on file
//! content (every PEM problem is an error string naming the file).

use std::path::Path;
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use tokio_rustls::TlsAcceptor;

use crate::config::{BackendTlsConfig, TlsConfig};
use crate::gateway::Gateway;
use crate::telemetry::metrics as m;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn certs_from(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    let certs =
        certs.map_err(|e| format!("{}: not a PEM certificate file: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no certificate in it", path.display()));
    }
    Ok(certs)
}

/// A CA bundle as a root store.
pub fn load_ca(path: &Path) -> Result<RootCertStore, String> {
    let pem = read(path)?;
    roots_from(path, &pem)
}

fn roots_from(path: &Path, pem: &[u8]) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in certs_from(path, pem)? {
        roots
            .add(cert)
            .map_err(|e| format!("{}: unusable CA certificate: {e}", path.display()))?;
    }
    Ok(roots)
}

/// The bytes of the server TLS files, read together (so a change is seen as one set).
struct Material {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Material {
    fn read(t: &TlsConfig) -> Result<Material, String> {
        Ok(Material {
            cert: read(&t.cert)?,
            key: read(&t.key)?,
            client_ca: t.client_ca.as_deref().map(read).transpose()?,
        })
    }

    fn digest(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        h.update(&self.cert);
        h.update([0]);
        h.update(&self.key);
        h.update([0]);
        if let Some(ca) = &self.client_ca {
            h.update(ca);
        }
        h.finalize().into()
    }

    fn server_config(&self, t: &TlsConfig) -> Result<rustls::ServerConfig, String> {
        let certs = certs_from(&t.cert, &self.cert)?;
        let key = PrivateKeyDer::from_pem_slice(&self.key)
            .map_err(|e| format!("{}: not a PEM private key: {e}", t.key.display()))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS versions: {e}"))?;
        let builder = match (&t.client_ca, &self.client_ca) {
            (Some(path), Some(pem)) => {
                let roots = roots_from(path, pem)?;
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                        .build()
                        .map_err(|e| format!("{}: {e}", path.display()))?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(certs, key).map_err(|e| {
            format!(
                "{} and {} do not make a usable certificate and key: {e}",
                t.cert.display(),
                t.key.display()
            )
        })?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// Check that the `[tls]` files exist and form a usable server configuration.
pub fn check_server_files(t: &TlsConfig) -> Result<(), String> {
    Material::read(t)?.server_config(t).map(|_| ())
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
        let material = Material::read(t)?;
        let config = material.server_config(t)?;
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
        let material = match Material::read(t) {
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
        match material.server_config(t) {
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

static BACKEND_TLS: RwLock<Option<(BackendTlsConfig, Arc<rustls::ClientConfig>)>> =
    RwLock::new(None);

fn build_client(c: &BackendTlsConfig) -> Result<rustls::ClientConfig, String> {
    let mut roots = RootCertStore::empty();
    if c.system_roots {
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
    }
    if let Some(path) = &c.ca_file {
        for cert in load_ca(path)?.roots {
            roots.roots.push(cert);
        }
    }
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS versions: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Use `c` for backends built from now on (a backend keeps the client it was built with; a
/// reload that changes `[backend_tls]` applies to backends added or changed by it). A CA file
/// that cannot be read leaves the previous settings in force.
pub fn configure_backends(c: &BackendTlsConfig) {
    let mut slot = BACKEND_TLS.write().unwrap_or_else(|p| p.into_inner());
    if slot.as_ref().is_some_and(|(old, _)| old == c) {
        return;
    }
    match build_client(c) {
        Ok(cfg) => *slot = Some((c.clone(), Arc::new(cfg))),
        Err(e) => tracing::error!("[backend_tls] not applied: {e}"),
    }
}

/// The rustls client config for backends.
pub fn client_config() -> rustls::ClientConfig {
    if let Some((_, cfg)) = BACKEND_TLS
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
    {
        return (**cfg).clone();
    }
    configure_backends(&BackendTlsConfig::default());
    match BACKEND_TLS
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
    {
        Some((_, cfg)) => (**cfg).clone(),
        None => rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap_or_else(|_| unreachable!("TLS 1.3 is supported by ring"))
            .with_root_certificates(RootCertStore::empty())
            .with_no_client_auth(),
    }
}
