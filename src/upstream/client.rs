//! One backend's HTTP client: a connection pool per serving thread, over the TLS client
//! configuration of the fleet the backend belongs to. Plain-http backends go through the
//! purpose-built HTTP/1.1 client ([`super::h1`]), TLS backends through hyper's.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use super::body::{Body, ClientError, UpstreamResponse};
use super::h1;
use crate::config::BackendTlsConfig;

pub type HttpsConnector = hyper_rustls::HttpsConnector<HttpConnector>;
/// hyper's client, for TLS backends: one per backend and serving thread (see [`Pools`]), so
/// each has its own pool and connect timeout.
pub type HttpClient = Client<HttpsConnector, Full<Bytes>>;

/// The rustls client configuration of one fleet's backends, with the `[backend_tls]` settings
/// it was built from.
#[derive(Debug, Clone)]
pub struct BackendTls {
    settings: BackendTlsConfig,
    client: Arc<rustls::ClientConfig>,
}

impl Default for BackendTls {
    /// The default settings (the system's trust roots), built once per process: they depend on
    /// nothing a config can change.
    fn default() -> Self {
        static DEFAULT: OnceLock<BackendTls> = OnceLock::new();
        DEFAULT
            .get_or_init(|| {
                let settings = BackendTlsConfig::default();
                let client =
                    crate::tls::client_config(settings.system_roots, None).unwrap_or_else(|e| {
                        tracing::error!("default backend TLS unusable, trusting nothing: {e}");
                        crate::tls::trust_nothing()
                    });
                BackendTls {
                    settings,
                    client: Arc::new(client),
                }
            })
            .clone()
    }
}

impl BackendTls {
    /// The configuration for `settings`. Reuses `previous` when its settings are the same; a CA
    /// file that cannot be read (it changed since the config was validated) leaves `previous`
    /// in force, or the defaults when there is none.
    pub fn build(settings: &BackendTlsConfig, previous: Option<&BackendTls>) -> BackendTls {
        if let Some(p) = previous.filter(|p| &p.settings == settings) {
            return p.clone();
        }
        if *settings == BackendTlsConfig::default() {
            return BackendTls::default();
        }
        match crate::tls::client_config(settings.system_roots, settings.ca_file.as_deref()) {
            Ok(c) => BackendTls {
                settings: settings.clone(),
                client: Arc::new(c),
            },
            Err(e) => {
                tracing::error!("[backend_tls] not applied: {e}");
                previous.cloned().unwrap_or_default()
            }
        }
    }

    /// The `[backend_tls]` settings in force.
    pub fn settings(&self) -> &BackendTlsConfig {
        &self.settings
    }

    /// The rustls configuration, shared by every client built from it.
    pub fn client_config(&self) -> &Arc<rustls::ClientConfig> {
        &self.client
    }
}

/// One backend's clients: slot 0 for the control runtime (probes, scraping, discovery), then
/// one per serving thread, each made on first use.
#[derive(Debug)]
pub struct Pools {
    pools: Box<[OnceLock<ThreadClient>]>,
    tls: Arc<rustls::ClientConfig>,
    connect_timeout: Duration,
}

impl Pools {
    pub fn new(tls: &BackendTls, connect_timeout: Duration) -> Pools {
        Pools {
            pools: (0..=crate::rt::default_count())
                .map(|_| OnceLock::new())
                .collect(),
            tls: tls.client.clone(),
            connect_timeout,
        }
    }

    /// Whether `other` builds its clients from the same TLS configuration.
    pub fn same_tls(&self, other: &Pools) -> bool {
        Arc::ptr_eq(&self.tls, &other.tls)
    }

    /// The client for this thread: a serving thread's own pool, so the connections its
    /// requests use are driven by that thread and no request wakes another; the control
    /// runtime's pool elsewhere. Serving threads beyond the cores (`[server] threads` above
    /// them) share pools, which is correct, only less local.
    pub fn client(&self) -> &ThreadClient {
        let n = self.pools.len();
        let i = match crate::rt::current() {
            0 => 0,
            s => 1 + (s - 1) % n.saturating_sub(1).max(1),
        };
        self.pools[i.min(n - 1)].get_or_init(|| ThreadClient {
            lean: Arc::new(h1::Pool::new(h1_settings(self.connect_timeout))),
            hyper: OnceLock::new(),
            tls: self.tls.clone(),
            connect_timeout: self.connect_timeout,
        })
    }
}

/// One backend's client on one thread: the plain-http pool, and hyper's client for TLS made
/// on first use.
#[derive(Debug)]
pub struct ThreadClient {
    lean: Arc<h1::Pool>,
    hyper: OnceLock<HttpClient>,
    tls: Arc<rustls::ClientConfig>,
    connect_timeout: Duration,
}

impl ThreadClient {
    /// Send `req`; returns at the response head. `http://` goes through [`h1`], anything else
    /// through hyper.
    pub async fn request(&self, req: Request<Bytes>) -> Result<UpstreamResponse, ClientError> {
        if req.uri().scheme_str() == Some("http") {
            let resp = h1::send(&self.lean, req).await?;
            return Ok(resp.map(Body::Lean));
        }
        let client = self
            .hyper
            .get_or_init(|| build_client(&self.tls, self.connect_timeout));
        let resp = client.request(req.map(Full::new)).await?;
        Ok(resp.map(Body::Hyper))
    }

    /// The plain-http pool.
    pub fn lean(&self) -> &Arc<h1::Pool> {
        &self.lean
    }
}

/// The plain-http client's settings: those hyper's client had.
fn h1_settings(connect_timeout: Duration) -> h1::Settings {
    h1::Settings {
        connect_timeout,
        tcp_keepalive: Duration::from_secs(30),
        idle_timeout: Duration::from_secs(60),
        max_idle: 4096,
    }
}

fn build_client(tls: &rustls::ClientConfig, connect_timeout: Duration) -> HttpClient {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(connect_timeout));
    http.set_nodelay(true);
    http.enforce_http(false);
    http.set_keepalive(Some(Duration::from_secs(30)));
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls.clone())
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(4096)
        .build(connector)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_ca(path: &str) -> BackendTlsConfig {
        BackendTlsConfig {
            ca_file: Some(path.into()),
            system_roots: false,
        }
    }

    #[test]
    fn unchanged_settings_keep_the_configuration_changed_ones_do_not() {
        let default = BackendTls::build(&BackendTlsConfig::default(), None);
        assert!(Arc::ptr_eq(
            default.client_config(),
            BackendTls::default().client_config()
        ));
        let no_roots = BackendTlsConfig {
            ca_file: None,
            system_roots: false,
        };
        let a = BackendTls::build(&no_roots, Some(&default));
        assert_eq!(a.settings(), &no_roots);
        assert!(!Arc::ptr_eq(a.client_config(), default.client_config()));
        let again = BackendTls::build(&no_roots, Some(&a));
        assert!(Arc::ptr_eq(again.client_config(), a.client_config()));
        let pools = |t: &BackendTls| Pools::new(t, Duration::from_secs(1));
        assert!(pools(&a).same_tls(&pools(&again)));
        assert!(!pools(&a).same_tls(&pools(&default)));
    }

    #[test]
    fn an_unreadable_ca_keeps_the_previous_configuration() {
        let dir = std::env::temp_dir().join(format!("sluice-no-such-dir-{}", std::process::id()));
        let missing = dir.join("ca.pem");
        let previous = BackendTls::build(
            &BackendTlsConfig {
                ca_file: None,
                system_roots: false,
            },
            None,
        );
        let next = BackendTls::build(&with_ca(&missing.to_string_lossy()), Some(&previous));
        assert!(Arc::ptr_eq(next.client_config(), previous.client_config()));
        assert_eq!(next.settings(), previous.settings());
        let first = BackendTls::build(&with_ca(&missing.to_string_lossy()), None);
        assert_eq!(first.settings(), &BackendTlsConfig::default());
    }
}
