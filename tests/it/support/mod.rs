//! What the integration tests share: a real gateway on 127.0.0.1:0 built from TOML text
//! ([`TestGateway`]), real simulators ([`sim`], [`sim_with`] and the [`sim`](mod@sim) helpers),
//! backends that misbehave at the byte level ([`raw`]), a hand-written recording backend
//! ([`ScriptedBackend`]), the built binary and the Python clients ([`process`]), one poll
//! helper with a deadline ([`poll()`], [`eventually`]), one free-port helper ([`free_port`]),
//! one-call requests ([`request`]) and a KV-event subscriber ([`kv`]).
#![allow(dead_code)]

pub mod chromium;
pub mod kv;
pub mod net;
pub mod otlp;
pub mod poll;
pub mod process;
pub mod raw;
pub mod redis;
pub mod request;
pub mod sim;

pub use net::free_port;
pub use poll::{eventually, poll, Lazy};
pub use request::{get_json, get_status, get_text, header, post_json};

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use sluice::sim::{SimConfig, SimHandle, SimKind};
use sluice::Gateway;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A gateway serving on a loopback port.
pub struct TestGateway {
    pub addr: SocketAddr,
    pub admin_addr: Option<SocketAddr>,
    pub gw: Arc<Gateway>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl TestGateway {
    /// Start a gateway from config text (`server.listen` is ignored: port 0 is used). If the
    /// text has an `[admin]` section, an admin listener is bound on port 0 too.
    pub async fn start(toml: &str) -> TestGateway {
        let config =
            sluice::config::from_str(toml, "test").unwrap_or_else(|e| panic!("config: {e}"));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let admin = match &config.admin {
            Some(_) => Some(TcpListener::bind("127.0.0.1:0").await.unwrap()),
            None => None,
        };
        let admin_addr = admin.as_ref().map(|l| l.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let (gw, serving) = sluice::app::start(
            config,
            sluice::app::Listeners {
                client: listener,
                admin,
            },
            None,
            async move {
                let _ = rx.await;
            },
        );
        let task = tokio::spawn(serving);
        TestGateway {
            addr,
            admin_addr,
            gw,
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// Start, then wait until every backend has been probed healthy.
    pub async fn start_healthy(toml: &str) -> TestGateway {
        let g = Self::start(toml).await;
        g.wait_all_healthy().await;
        g
    }

    /// A gateway with [`FAST_HEALTH`] and one backend serving model `m`, once it is healthy.
    pub async fn one_backend(name: &str, kind: &str, url: &str) -> TestGateway {
        TestGateway::start_healthy(&format!(
            "{FAST_HEALTH}{}",
            backend(name, kind, url, &["m"])
        ))
        .await
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin_addr.unwrap_or(self.addr))
    }

    pub fn backend_state(&self, name: &str) -> String {
        let rt = self.gw.runtime();
        rt.fleet
            .get(name)
            .map(|b| b.state.health().as_str().to_string())
            .unwrap_or_else(|| "absent".into())
    }

    pub async fn wait_all_healthy(&self) {
        let rt = || self.gw.runtime();
        let states = || {
            let states: Vec<String> = rt()
                .fleet
                .backends
                .iter()
                .map(|b| {
                    format!(
                        "{}={} ({:?})",
                        b.name(),
                        b.state.health().as_str(),
                        b.state.track().last_error
                    )
                })
                .collect();
            format!("backends healthy, now {states:?}")
        };
        eventually(Duration::from_secs(15), Lazy(states), || {
            let ok = rt()
                .fleet
                .backends
                .iter()
                .all(|b| b.state.health() == sluice::fleet::Health::Healthy);
            async move { ok }
        })
        .await;
    }

    pub async fn wait_state(&self, backend: &str, state: &str, within: Duration) {
        let gw = self.gw.clone();
        let (b, s) = (backend.to_string(), state.to_string());
        eventually(within, &format!("backend {backend} {state}"), move || {
            let rt = gw.runtime();
            let ok = rt
                .fleet
                .get(&b)
                .is_some_and(|x| x.state.health().as_str() == s);
            async move { ok }
        })
        .await;
    }

    /// Requests the gateway has sent to backend `name` (0 when there is none).
    pub fn attempts(&self, name: &str) -> u64 {
        self.gw
            .runtime()
            .fleet
            .get(name)
            .map(|b| b.state.requests_total())
            .unwrap_or(0)
    }

    /// `POST /v1/chat/completions` with `body`, from a new client.
    pub async fn chat<B: serde::Serialize + ?Sized>(&self, body: &B) -> reqwest::Response {
        post_json(&client(), self.url("/v1/chat/completions"), body).await
    }

    /// `GET /admin/backends` (on the admin listener when there is one), as JSON.
    pub async fn admin_backends(&self) -> serde_json::Value {
        get_json(&client(), self.admin_url("/admin/backends")).await
    }

    /// `GET /metrics` (on the admin listener when there is one), as text.
    pub async fn metrics_text(&self) -> String {
        get_text(&client(), self.admin_url("/metrics")).await
    }

    /// Stop accepting, drain, and wait for the server to finish.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(40), t).await;
        }
    }
}

impl Drop for TestGateway {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// Start a simulator with no delays.
pub async fn sim(kind: SimKind, models: &[&str]) -> SimHandle {
    sim_with(SimConfig::new(kind, models.iter().map(|s| s.to_string()).collect()).speed(0.0)).await
}

pub async fn sim_with(config: SimConfig) -> SimHandle {
    sluice::sim::spawn(config).await.unwrap()
}

/// A `[[backends]]` block.
pub fn backend(name: &str, kind: &str, url: &str, models: &[&str]) -> String {
    let models = models
        .iter()
        .map(|m| format!("\"{m}\""))
        .collect::<Vec<_>>()
        .join(", ");
    format!("\n[[backends]]\nname = \"{name}\"\nkind = \"{kind}\"\nurl = \"{url}\"\nmodels = [{models}]\n")
}

/// A fast health configuration for tests.
pub const FAST_HEALTH: &str = "\n[health]\ninterval = \"50ms\"\ntimeout = \"500ms\"\nhealthy_threshold = 1\nunhealthy_threshold = 1\nbase_ejection = \"200ms\"\n";

/// Health that sees a backend come up as fast as [`FAST_HEALTH`] but ejects it only after three
/// probes in a row miss a 2 s deadline: for tests about something other than failure, so a
/// loaded machine's one late probe does not take their only backend out.
pub const STEADY_HEALTH: &str = "\n[health]\ninterval = \"50ms\"\ntimeout = \"2s\"\nhealthy_threshold = 1\nunhealthy_threshold = 3\nbase_ejection = \"200ms\"\n";

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// The value of the first series in a Prometheus exposition whose line starts with
/// `name_and_labels`; 0 when there is none.
pub fn metric(text: &str, name_and_labels: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(name_and_labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// A chat body.
pub fn chat_body(model: &str, stream: bool, max_tokens: u32) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Hello there, how are you?"}]
    })
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| {
            let lines: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|l| l.strip_prefix(' ').unwrap_or(l))
                .collect();
            (!lines.is_empty()).then(|| lines.join("\n"))
        })
        .collect()
}

/// What a [`ScriptedBackend`] saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub query: Option<String>,
    pub method: http::Method,
    pub headers: http::HeaderMap,
    pub body: bytes::Bytes,
}

/// A hand-written HTTP backend on a real socket: it records every request and answers with a
/// fixed status, headers and body. For tests that need to see what the gateway sends, or to
/// answer what no simulator would.
pub struct ScriptedBackend {
    pub addr: SocketAddr,
    pub seen: Arc<std::sync::Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

impl ScriptedBackend {
    pub async fn start(
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: String,
    ) -> ScriptedBackend {
        use axum::extract::Request;
        use axum::response::IntoResponse;
        let seen: Arc<std::sync::Mutex<Vec<Seen>>> = Arc::default();
        let log = seen.clone();
        let handler = move |req: Request| {
            let log = log.clone();
            let headers = headers.clone();
            let body = body.clone();
            async move {
                let path = req.uri().path().to_string();
                let query = req.uri().query().map(str::to_string);
                let method = req.method().clone();
                let (parts, b) = req.into_parts();
                let bytes = http_body_util::BodyExt::collect(b)
                    .await
                    .map(|c| c.to_bytes())
                    .unwrap_or_default();
                log.lock().unwrap().push(Seen {
                    path: path.clone(),
                    query,
                    method,
                    headers: parts.headers,
                    body: bytes,
                });
                if path == "/health" || path == "/v1/models" {
                    return (
                        http::StatusCode::OK,
                        r#"{"object":"list","data":[]}"#.to_string(),
                    )
                        .into_response();
                }
                let mut resp = (http::StatusCode::from_u16(status).unwrap(), body).into_response();
                for (k, v) in headers {
                    resp.headers_mut().insert(k, v.parse().unwrap());
                }
                resp
            }
        };
        let app = axum::Router::new().fallback(handler);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        ScriptedBackend { addr, seen, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests other than probes.
    pub fn inference_requests(&self) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.path != "/health" && s.path != "/v1/models")
            .cloned()
            .collect()
    }
}

impl Drop for ScriptedBackend {
    fn drop(&mut self) {
        self.task.abort();
    }
}
