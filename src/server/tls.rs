//! TLS material: the client configuration used towards `https://` backends (the system's
//! trust roots), and the server side (see the operations issue).

use std::sync::{Arc, OnceLock};

/// The rustls client config for backends, built once.
pub fn client_config() -> rustls::ClientConfig {
    static CONFIG: OnceLock<Arc<rustls::ClientConfig>> = OnceLock::new();
    let cfg = CONFIG.get_or_init(|| {
        let mut roots = rustls::RootCertStore::empty();
        let native = rustls_native_certs::load_native_certs();
        for cert in native.certs {
            let _ = roots.add(cert);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map(|b| b.with_root_certificates(roots).with_no_client_auth())
            .unwrap_or_else(|_| {
                rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .unwrap_or_else(|_| unreachable!("TLS 1.3 is supported by ring"))
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth()
            });
        Arc::new(config)
    });
    (**cfg).clone()
}
