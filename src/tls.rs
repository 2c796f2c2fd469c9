//! TLS material from plain inputs (paths, flags, PEM bytes): CA bundles, the server certificate
//! and key, and the rustls client configuration towards `https://` backends and an `https` OTLP
//! collector.
//!
//! This module holds no state and knows no config types: the listener's live certificate and
//! its reload watch are in `server::tls`, the backend client configuration of a fleet is built
//! by `upstream` from the config snapshot, the collector's by `gateway` when tracing starts.
//!
//! Invariants: all crypto is rustls with the ring provider; nothing here panics on file content
//! (every PEM problem is an error string naming the file).

use std::fmt::Display;
use std::path::Path;
use std::sync::Arc;

use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// The certificates of a PEM file, `name` (its path) naming it in errors.
fn certs_from(name: &dyn Display, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(pem).collect();
    let certs = certs.map_err(|e| format!("{name}: not a PEM certificate file: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{name}: no certificate in it"));
    }
    Ok(certs)
}

/// A CA bundle as a root store.
pub fn load_ca(path: &Path) -> Result<RootCertStore, String> {
    let pem = read(path)?;
    roots_from(&path.display(), &pem)
}

/// A CA bundle already read (PEM) as a root store, `name` naming it in errors.
pub fn ca_roots(name: &str, pem: &[u8]) -> Result<RootCertStore, String> {
    roots_from(&name, pem)
}

fn roots_from(name: &dyn Display, pem: &[u8]) -> Result<RootCertStore, String> {
    let mut roots = RootCertStore::empty();
    for cert in certs_from(name, pem)? {
        roots
            .add(cert)
            .map_err(|e| format!("{name}: unusable CA certificate: {e}"))?;
    }
    Ok(roots)
}

/// Where a listener's TLS files are.
#[derive(Debug, Clone, Copy)]
pub struct ServerFiles<'a> {
    pub cert: &'a Path,
    pub key: &'a Path,
    /// Require client certificates signed by this CA bundle (mTLS).
    pub client_ca: Option<&'a Path>,
}

/// The bytes of the server TLS files, read together (so a change is seen as one set).
pub struct Material {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Material {
    pub fn read(f: ServerFiles<'_>) -> Result<Material, String> {
        Ok(Material {
            cert: read(f.cert)?,
            key: read(f.key)?,
            client_ca: f.client_ca.map(read).transpose()?,
        })
    }

    /// A digest of the whole set, to tell whether the files changed.
    pub fn digest(&self) -> [u8; 32] {
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

    /// The server configuration these files make, offering ALPN `h2` then `http/1.1`.
    pub fn server_config(&self, f: ServerFiles<'_>) -> Result<rustls::ServerConfig, String> {
        let certs = certs_from(&f.cert.display(), &self.cert)?;
        let key = PrivateKeyDer::from_pem_slice(&self.key)
            .map_err(|e| format!("{}: not a PEM private key: {e}", f.key.display()))?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS versions: {e}"))?;
        let builder = match (f.client_ca, &self.client_ca) {
            (Some(path), Some(pem)) => {
                let roots = roots_from(&path.display(), pem)?;
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
                f.cert.display(),
                f.key.display()
            )
        })?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(config)
    }
}

/// Check that a listener's TLS files exist and form a usable server configuration.
pub fn check_server_files(f: ServerFiles<'_>) -> Result<(), String> {
    Material::read(f)?.server_config(f).map(|_| ())
}

/// The rustls client configuration towards backends: the system's trust roots when
/// `system_roots`, plus the certificates of the `ca_file` bundle.
pub fn client_config(
    system_roots: bool,
    ca_file: Option<&Path>,
) -> Result<rustls::ClientConfig, String> {
    let extra = ca_file.map(load_ca).transpose()?;
    client_config_with(system_roots, extra)
}

/// The rustls client configuration trusting the system's roots when `system_roots`, plus
/// `extra` (a CA bundle already loaded, [`load_ca`] or [`ca_roots`]); no ALPN (the connector
/// sets its own).
pub fn client_config_with(
    system_roots: bool,
    extra: Option<RootCertStore>,
) -> Result<rustls::ClientConfig, String> {
    let mut roots = RootCertStore::empty();
    if system_roots {
        for cert in rustls_native_certs::load_native_certs().certs {
            let _ = roots.add(cert);
        }
    }
    if let Some(extra) = extra {
        roots.roots.extend(extra.roots);
    }
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS versions: {e}"))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// A client configuration that trusts nothing: the last resort when no other could be built,
/// so a backend over `https://` fails its handshake rather than being reached unverified.
pub fn trust_nothing() -> rustls::ClientConfig {
    rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap_or_else(|_| unreachable!("TLS 1.3 is supported by ring"))
        .with_root_certificates(RootCertStore::empty())
        .with_no_client_auth()
}
