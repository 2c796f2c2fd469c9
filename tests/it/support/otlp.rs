//! An OTLP/HTTP trace receiver on 127.0.0.1:0: `POST /v1/traces` with an
//! `ExportTraceServiceRequest` in protobuf, decoded with the official `opentelemetry-proto`
//! types and kept as flat [`Span`]s to check field by field.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

use super::poll;

/// The `authorization` header [`Receiver::config`] has every export carry.
pub const COLLECTOR_TOKEN: &str = "Bearer collector-token";

/// `[tracing]` keys every test collector checks for ([`Receiver::assert_configured`]): a
/// collector token ([`COLLECTOR_TOKEN`]) and a resource attribute
/// (`deployment.environment = "ci"`), as inline tables so keys can still be appended.
pub fn export_extras() -> String {
    format!(
        "headers = {{ authorization = \"{COLLECTOR_TOKEN}\" }}\n\
         resource = {{ \"deployment.environment\" = \"ci\" }}\n"
    )
}

/// One received span, its ids in lowercase hex (an empty parent: a root span).
#[derive(Debug, Clone)]
pub struct Span {
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    /// OTLP's `SpanKind` number (2: server, 1: internal).
    pub kind: i32,
    /// Attributes, each value as text (`true`, `42`, `chat`).
    pub attrs: BTreeMap<String, String>,
    /// OTLP's status code (0 unset, 1 ok, 2 error).
    pub status: i32,
    /// The resource's `service.name`.
    pub service: String,
    /// Every resource attribute, as text.
    pub resource: BTreeMap<String, String>,
    /// Start and end, nanoseconds since the Unix epoch.
    pub start_ns: u64,
    pub end_ns: u64,
}

impl Span {
    /// How long the span lasted, in milliseconds.
    pub fn duration_ms(&self) -> f64 {
        self.end_ns.saturating_sub(self.start_ns) as f64 / 1e6
    }

    /// The attribute `key` as text; panics naming the span when it is missing.
    pub fn attr(&self, key: &str) -> &str {
        self.attrs
            .get(key)
            .unwrap_or_else(|| panic!("span {} has no {key}: {:?}", self.name, self.attrs))
    }
}

/// The receiver: its address, the spans it was sent and the headers (gRPC: metadata) of the
/// exports that brought them.
pub struct Receiver {
    pub addr: SocketAddr,
    kept: Kept,
}

/// What the receiver keeps: the spans, and each export's headers.
#[derive(Clone, Default)]
struct Kept {
    spans: Arc<Mutex<Vec<Span>>>,
    headers: Arc<Mutex<Vec<http::HeaderMap>>>,
}

impl Kept {
    fn export(&self, headers: http::HeaderMap, req: ExportTraceServiceRequest) {
        self.headers.lock().unwrap().push(headers);
        self.spans.lock().unwrap().extend(flatten(req));
    }
}

impl Receiver {
    pub async fn start() -> Receiver {
        let kept = Kept::default();
        let receiver = kept.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            post(move |headers: http::HeaderMap, body: Bytes| {
                let kept = receiver.clone();
                async move {
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(req) => {
                            kept.export(headers, req);
                            (
                                http::StatusCode::OK,
                                [("content-type", "application/x-protobuf")],
                                Vec::new(),
                            )
                        }
                        Err(_) => (
                            http::StatusCode::BAD_REQUEST,
                            [("content-type", "text/plain")],
                            b"bad protobuf".to_vec(),
                        ),
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Receiver { addr, kept }
    }

    /// An OTLP/gRPC receiver: `TraceService/Export` over HTTP/2 without TLS, its one message
    /// framed as gRPC frames it (a flag byte, a 4-byte length, the protobuf).
    pub async fn start_grpc() -> Receiver {
        let kept = Kept::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let receiver = kept.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                tokio::spawn(grpc_connection(tcp, receiver.clone()));
            }
        });
        Receiver { addr, kept }
    }

    /// The `[tracing]` section sending to this receiver, exporting every 50 ms, with
    /// [`export_extras`].
    pub fn config(&self) -> String {
        format!(
            "[tracing]\notlp_endpoint = \"http://{}\"\nexport_interval = \"50ms\"\n\
             service_name = \"sluice-test\"\n{}",
            self.addr,
            export_extras()
        )
    }

    /// What [`export_extras`] asks of every export that reached this receiver: the resource
    /// attribute on `server` (a server span), and the collector's auth header on each export.
    pub fn assert_configured(&self, server: &Span) {
        assert_eq!(server.resource["deployment.environment"], "ci");
        let tokens = self.header_values("authorization");
        assert!(
            !tokens.is_empty() && tokens.iter().all(|t| t == COLLECTOR_TOKEN),
            "{tokens:?}"
        );
    }

    /// The values of header `name` on every export received so far.
    pub fn header_values(&self, name: &str) -> Vec<String> {
        let exports = self.kept.headers.lock().unwrap();
        exports
            .iter()
            .flat_map(|h| h.get_all(name).iter())
            .map(|v| v.to_str().unwrap_or_default().to_string())
            .collect()
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.kept.spans.lock().unwrap().clone()
    }

    /// The spans of trace `trace_id` once `done` says they are all there (within 10 s).
    pub async fn trace(&self, trace_id: &str, done: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let what = format!("the spans of trace {trace_id}");
        poll::poll(Duration::from_secs(10), what, || {
            let spans: Vec<Span> = self
                .spans()
                .into_iter()
                .filter(|s| s.trace_id == trace_id)
                .collect();
            let ready = done(&spans).then_some(spans);
            async move { ready }
        })
        .await
    }
}

/// The spans named `name`.
pub fn named<'a>(spans: &'a [Span], name: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.name == name).collect()
}

/// The one span named `name`; panics when there is not exactly one.
pub fn one<'a>(spans: &'a [Span], name: &str) -> &'a Span {
    match named(spans, name).as_slice() {
        [s] => s,
        other => panic!("{} spans named {name} in {spans:#?}", other.len()),
    }
}

async fn grpc_connection(tcp: tokio::net::TcpStream, kept: Kept) {
    let Ok(mut conn) = h2::server::handshake(tcp).await else {
        return;
    };
    while let Some(Ok((req, mut respond))) = conn.accept().await {
        let kept = kept.clone();
        tokio::spawn(async move {
            let path = req.uri().path().to_string();
            let headers = req.headers().clone();
            let mut body = req.into_body();
            let mut buf = Vec::new();
            while let Some(Ok(chunk)) = body.data().await {
                let _ = body.flow_control().release_capacity(chunk.len());
                buf.extend_from_slice(&chunk);
            }
            let ok = path == "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
                && buf.len() >= 5
                && buf[0] == 0;
            let decoded = ok
                .then(|| ExportTraceServiceRequest::decode(&buf[5..]).ok())
                .flatten();
            let status = match decoded {
                Some(req) => {
                    kept.export(headers, req);
                    "0"
                }
                None => "3", // INVALID_ARGUMENT
            };
            let head = http::Response::builder()
                .status(200)
                .header("content-type", "application/grpc")
                .body(())
                .unwrap();
            let Ok(mut send) = respond.send_response(head, false) else {
                return;
            };
            // an empty ExportTraceServiceResponse, framed
            let _ = send.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), false);
            let mut trailers = http::HeaderMap::new();
            trailers.insert("grpc-status", http::HeaderValue::from_static(status));
            let _ = send.send_trailers(trailers);
        });
    }
}

fn flatten(req: ExportTraceServiceRequest) -> Vec<Span> {
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let resource: BTreeMap<String, String> = rs
            .resource
            .iter()
            .flat_map(|r| r.attributes.iter())
            .filter_map(|kv| Some((kv.key.clone(), text(kv.value.as_ref()?.value.as_ref()?))))
            .collect();
        let service = resource.get("service.name").cloned().unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                let attrs = s
                    .attributes
                    .iter()
                    .filter_map(|kv| {
                        let v = kv.value.as_ref()?.value.as_ref()?;
                        Some((kv.key.clone(), text(v)))
                    })
                    .collect();
                out.push(Span {
                    name: s.name,
                    trace_id: hex::encode(&s.trace_id),
                    span_id: hex::encode(&s.span_id),
                    parent_span_id: hex::encode(&s.parent_span_id),
                    kind: s.kind,
                    attrs,
                    status: s.status.map(|st| st.code).unwrap_or(0),
                    service: service.clone(),
                    resource: resource.clone(),
                    start_ns: s.start_time_unix_nano,
                    end_ns: s.end_time_unix_nano,
                });
            }
        }
    }
    out
}

fn text(v: &Value) -> String {
    match v {
        Value::StringValue(s) => s.clone(),
        Value::BoolValue(b) => b.to_string(),
        Value::IntValue(i) => i.to_string(),
        Value::DoubleValue(d) => d.to_string(),
        Value::ArrayValue(a) => a
            .values
            .iter()
            .filter_map(|v| v.value.as_ref())
            .map(text)
            .collect::<Vec<_>>()
            .join(","),
        other => format!("{other:?}"),
    }
}
