//! `[tls]` and `[backend_tls]`: paths expanded, PEM files read and parsed now, so a bad
//! certificate is a config error (at start, in `sluice check` and on reload).

use std::path::PathBuf;

use super::Problems;
use crate::config::env::{expand, Env};
use crate::config::file::FileConfig;
use crate::config::runtime::{BackendTlsConfig, TlsConfig};

pub(super) fn tls(
    p: &mut Problems,
    f: &FileConfig,
    env: &dyn Env,
) -> (Option<TlsConfig>, BackendTlsConfig) {
    let mut path = |at: &str, v: &str| match expand(v, env) {
        Ok(s) if s.trim().is_empty() => {
            p.push(at, "is empty");
            None
        }
        Ok(s) => Some(PathBuf::from(s)),
        Err(e) => {
            p.push(at, e);
            None
        }
    };
    let tls = f.tls.as_ref().and_then(|t| {
        let cert = path("tls.cert", &t.cert);
        let key = path("tls.key", &t.key);
        let client_ca = t.client_ca.as_deref().map(|c| path("tls.client_ca", c));
        let client_ca = match client_ca {
            Some(None) => return None,
            Some(Some(c)) => Some(c),
            None => None,
        };
        Some(TlsConfig {
            cert: cert?,
            key: key?,
            client_ca,
        })
    });
    let backend_ca = f
        .backend_tls
        .ca_file
        .as_deref()
        .and_then(|c| path("backend_tls.ca_file", c));
    if let Some(t) = &tls {
        if let Err(e) = crate::tls::check_server_files(crate::tls::ServerFiles {
            cert: &t.cert,
            key: &t.key,
            client_ca: t.client_ca.as_deref(),
        }) {
            p.push("tls", e);
        }
    }
    if let Some(c) = &backend_ca {
        if let Err(e) = crate::tls::load_ca(c) {
            p.push("backend_tls.ca_file", e);
        }
    }
    let backend_tls = BackendTlsConfig {
        ca_file: backend_ca,
        system_roots: f.backend_tls.system_roots.unwrap_or(true),
    };
    (tls, backend_tls)
}
