//! OpenTelemetry traces (`[tracing]`): a span per request and per phase, exported over OTLP
//! (HTTP/protobuf or gRPC), with the W3C trace context taken from the client and passed to
//! every backend attempt, so an engine's own span (vLLM's) joins the client's trace.
//!
//! ```text
//! Tracing::start(settings, tls, runtime)    provider: parent-based ratio sampler, resource,
//!                                           the span queue (batch) → OTLP exporter (for an
//!                                           https collector, hyper-rustls's connector with
//!                                           the caller's rustls config, under either protocol)
//! Tracing::request(headers, arrived, name)  the sampling decision first ([`sampling`]), then
//!                                           the server span from `arrived`, child of the
//!                                           client's `traceparent` when it sent one
//!                                           ([`RequestTrace`]); an unsampled request gets ids
//!                                           only
//! RequestTrace::phase(name)                 a phase's span under it ([`Phase`]);
//! RequestTrace::past_phase(name, from..to)  a phase known only once over (a stream's wait
//!                                           for its first token), placed by its offsets
//!                                           from the request's arrival;
//! Phase::child(name)                        a span inside a phase (the fair-queue wait);
//! Phase::inject(headers)                    `traceparent`/`tracestate` for a backend
//! ```
//!
//! Each gateway owns its provider (built from its config), so several gateways in one process
//! (the tests) trace apart, and spans are made with the OpenTelemetry API directly rather than
//! through the process-wide `tracing` subscriber.
//!
//! Invariants: with tracing off nothing here runs — the request path holds `None` and makes
//! no span, no allocation; a span never carries a key or prompt text, only the attribute
//! names of the OpenTelemetry GenAI conventions and Sluice's own (`sluice.*`); exporting
//! never blocks a request ([`batch`]); an `https` collector, over either protocol, is reached
//! only with the rustls client config `Tracing::start` is given (its trust is the caller's:
//! the system's roots and `ca_pem`), never unverified.

mod batch;
mod sampling;
mod span;

use std::time::Duration;

use hyper_util::client::legacy::connect::HttpConnector;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry::KeyValue;
use opentelemetry_otlp::tonic_types::metadata::MetadataMap;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

pub use span::{Phase, RequestTrace};

/// How spans reach the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `http/protobuf`: `POST {endpoint}/v1/traces` (OTLP/HTTP, port 4318 by convention).
    HttpProtobuf,
    /// `grpc`: OTLP/gRPC (port 4317 by convention).
    Grpc,
}

/// What export needs, checked (from `[tracing]` and the `OTEL_*` environment, by `config`).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// The URL spans are sent to: for `http/protobuf` the full traces URL (`…/v1/traces`).
    pub endpoint: String,
    pub protocol: Protocol,
    /// Share of new traces sampled (0.0–1.0); a client's sampled flag decides for its own.
    pub sample_ratio: f64,
    pub service_name: String,
    /// Extra headers (or gRPC metadata) on every export, e.g. a collector's auth.
    pub headers: Vec<(String, String)>,
    /// Resource attributes beside `service.name`.
    pub resource: Vec<(String, String)>,
    /// Most spans waiting for export; more are dropped and counted.
    pub queue_size: usize,
    /// Longest a finished span waits before its batch is sent.
    pub export_interval: Duration,
    /// Bound on one export.
    pub export_timeout: Duration,
    /// Extra roots (PEM) for an `https` collector, beside the system's (turned into the rustls
    /// config [`Tracing::start`] is given by its caller).
    pub ca_pem: Option<Vec<u8>>,
}

/// Why tracing could not be started.
#[derive(Debug, thiserror::Error)]
pub enum OtelError {
    #[error("cannot build the OTLP exporter: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("`{0}` is not a collector URL: {1}")]
    Endpoint(String, String),
    #[error("an https collector needs a TLS configuration")]
    NoTls,
}

/// A gateway's tracing: its tracer (which keeps its provider, and so the span queue, alive
/// until the gateway and its last span are gone).
#[derive(Debug)]
pub struct Tracing {
    tracer: SdkTracer,
    sampler: sampling::Sampler,
}

impl Tracing {
    /// Build the exporter and the provider, and start the export task on `runtime`. `tls` is
    /// how an `https` collector is trusted (required for one, unused over `http`).
    pub fn start(
        settings: &Settings,
        tls: Option<rustls::ClientConfig>,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Tracing, OtelError> {
        // gRPC's channel and the HTTP client are made inside the runtime that runs them.
        let _entered = runtime.enter();
        let exporter = exporter(settings, tls)?;
        let batcher = batch::Batcher::new(exporter, settings.queue_size);
        let starter = batcher.starter();
        let mut resource =
            Resource::builder_empty().with_service_name(settings.service_name.clone());
        for (k, v) in &settings.resource {
            resource = resource.with_attribute(KeyValue::new(k.clone(), v.clone()));
        }
        // (the server span's decision is taken before it is built, by `sampling`, and handed
        // to the SDK; this sampler decides for the phases, which follow their parent)
        let ratio = Sampler::TraceIdRatioBased(settings.sample_ratio);
        let provider = SdkTracerProvider::builder()
            .with_span_processor(batcher)
            .with_sampler(Sampler::ParentBased(Box::new(ratio)))
            .with_resource(resource.build())
            .build();
        starter.start(runtime, settings.export_interval);
        let tracer = provider.tracer("sluice");
        Ok(Tracing {
            tracer,
            sampler: sampling::Sampler::new(settings.sample_ratio),
        })
    }

    /// The server span of one request that `arrived` then, named `name()` (`POST
    /// /v1/chat/completions`), a child of the client's `traceparent` when it sent a valid one;
    /// for an unsampled request no span, and `name` is not called.
    pub fn request(
        &self,
        headers: &http::HeaderMap,
        arrived: std::time::Instant,
        name: impl FnOnce() -> String,
    ) -> RequestTrace {
        RequestTrace::start(&self.tracer, self.sampler.decide(headers), arrived, name)
    }
}

fn exporter(
    s: &Settings,
    tls: Option<rustls::ClientConfig>,
) -> Result<opentelemetry_otlp::SpanExporter, OtelError> {
    let tls = if s.endpoint.starts_with("https://") {
        Some(tls.ok_or(OtelError::NoTls)?)
    } else {
        None
    };
    let builder = opentelemetry_otlp::SpanExporter::builder();
    Ok(match s.protocol {
        Protocol::HttpProtobuf => {
            let builder = builder
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint(s.endpoint.clone())
                .with_timeout(s.export_timeout)
                .with_headers(s.headers.iter().cloned().collect());
            let Some(tls) = tls else {
                return Ok(builder.build()?);
            };
            // The client the exporter would make (HTTP/1.1, each export bounded by the
            // timeout), over TLS with `tls`.
            let connector = https_connector(tls)
                .https_only()
                .enable_http1()
                .wrap_connector(http_connector(s));
            let client =
                opentelemetry_http::hyper::HyperClient::new(connector, s.export_timeout, None);
            builder.with_http_client(client).build()?
        }
        Protocol::Grpc => {
            let mut headers = http::HeaderMap::new();
            for (k, v) in &s.headers {
                // (config checked that each is a valid header name and value)
                if let (Ok(k), Ok(v)) = (
                    http::HeaderName::from_bytes(k.as_bytes()),
                    http::HeaderValue::from_str(v),
                ) {
                    headers.insert(k, v);
                }
            }
            let builder = builder
                .with_tonic()
                .with_endpoint(s.endpoint.clone())
                .with_timeout(s.export_timeout)
                .with_metadata(MetadataMap::from_headers(headers));
            let Some(tls) = tls else {
                return Ok(builder.build()?);
            };
            builder.with_channel(tls_channel(s, tls)?).build()?
        }
    })
}

/// A gRPC channel to an `https` collector: HTTP/2 (ALPN `h2`) over rustls with `tls`, connected
/// on first export, each export bounded as the exporter's own channel bounds it.
fn tls_channel(
    s: &Settings,
    tls: rustls::ClientConfig,
) -> Result<tonic::transport::Channel, OtelError> {
    let endpoint = tonic::transport::Endpoint::from_shared(s.endpoint.clone())
        .map_err(|e| OtelError::Endpoint(s.endpoint.clone(), e.to_string()))?
        .timeout(s.export_timeout);
    let connector = https_connector(tls)
        .https_only()
        .enable_http2()
        .wrap_connector(http_connector(s));
    Ok(endpoint.connect_with_connector_lazy(connector))
}

/// hyper-rustls's connector over `tls`, its ALPN still to be chosen by the protocol.
fn https_connector(
    mut tls: rustls::ClientConfig,
) -> hyper_rustls::HttpsConnectorBuilder<hyper_rustls::builderstates::WantsSchemes> {
    // (the connector sets ALPN itself, and will not take a config that already has it)
    tls.alpn_protocols.clear();
    hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls)
}

/// The TCP connector under TLS: `https` URLs allowed, no Nagle delay, a connection attempt
/// bounded by the export timeout.
fn http_connector(s: &Settings) -> HttpConnector {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(s.export_timeout));
    http
}
