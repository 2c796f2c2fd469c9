//! OpenTelemetry traces (issue 32): Sluice's spans received by an OTLP/HTTP receiver and
//! checked field by field — the client's `traceparent` honoured, each phase a span, a
//! failover as two attempts with the reason, a continued stream as a span of its trace, the
//! attempt's context passed to the engine (the simulator records it, as vLLM takes it), a
//! collector that is down or untrusted leaving requests unaffected with the dropped spans
//! counted, and export to gRPC and `https` collectors (OTLP/HTTP and gRPC over TLS, the
//! certificate checked against `ca_file`).

use std::time::Duration;

use serde_json::{json, Value};
use sluice::sim::{Fault, FaultMode, SimConfig, SimKind};

use crate::support;
use support::otlp::{export_extras, named, one, Receiver, Span, COLLECTOR_TOKEN};
use support::*;

const MODEL: &str = "m";
/// What the client asks; it must appear in no span.
const PROMPT: &str = "a secret prompt about otters";

/// A gateway over `backends` (name, url) of vLLM sims serving [`MODEL`], round-robin, with
/// `tracing` (a `[tracing]` section).
async fn gateway(backends: &[(&str, String)], tracing: &str) -> TestGateway {
    let mut t = format!("[routing]\npolicy = \"round-robin\"\n{tracing}\n{FAST_HEALTH}");
    for (name, url) in backends {
        t.push_str(&backend(name, "vllm", url, &[MODEL]));
    }
    TestGateway::start_healthy(&t).await
}

/// A chat request with the client's `traceparent`; the response's status and text.
async fn chat(g: &TestGateway, traceparent: &str, stream: bool) -> (u16, String) {
    let body = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 12,
        "stream": stream,
    });
    let resp = client()
        .post(g.url("/v1/chat/completions"))
        .header("traceparent", traceparent)
        .header("tracestate", "vendor=client")
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.text().await.unwrap())
}

/// A client's trace context: a fresh trace id and parent span id, sampled or not.
fn client_context(sampled: bool) -> (String, String, String) {
    let trace = format!("{:032x}", rand::random::<u128>() | 1);
    let parent = format!("{:016x}", rand::random::<u64>() | 1);
    let flags = if sampled { "01" } else { "00" };
    let header = format!("00-{trace}-{parent}-{flags}");
    (trace, parent, header)
}

/// The `traceparent` headers a simulator received.
fn received(sim: &sluice::sim::SimHandle) -> Vec<String> {
    received_as(sim, "traceparents")
}

/// One of the trace-context lists of a simulator's state (`traceparents`, `tracestates`), a
/// request without the header as an empty string.
fn received_as(sim: &sluice::sim::SimHandle, key: &str) -> Vec<String> {
    let state = sim.state();
    state[key]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// No span carries the prompt's text.
fn no_prompt(spans: &[Span]) {
    for s in spans {
        for (k, v) in &s.attrs {
            assert!(
                !v.contains("otters"),
                "{}.{k} carries the prompt: {v}",
                s.name
            );
        }
    }
}

/// The trace is complete once its server span arrived (it ends last).
fn has_server(spans: &[Span]) -> bool {
    spans.iter().any(|s| s.kind == 2)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_trace_holds_sluices_phases_and_reaches_the_engine() {
    let receiver = Receiver::start().await;
    let a = sim(SimKind::Vllm, &[MODEL]).await;
    let g = gateway(&[("a", a.url())], &receiver.config()).await;
    let (trace, parent, header) = client_context(true);
    let (status, text) = chat(&g, &header, false).await;
    assert_eq!(status, 200, "{text}");
    let spans = receiver.trace(&trace, has_server).await;
    no_prompt(&spans);

    let server = one(&spans, "POST /v1/chat/completions");
    assert_eq!(server.kind, 2, "a server span");
    assert_eq!(
        server.parent_span_id, parent,
        "the client's span is its parent"
    );
    assert_eq!(server.service, "sluice-test");
    receiver.assert_configured(server);
    for (key, want) in [
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.request.model", MODEL),
        ("gen_ai.response.model", MODEL),
        ("sluice.backend", "a"),
        ("sluice.tenant", "anonymous"),
        ("http.response.status_code", "200"),
        ("sluice.attempts", "1"),
    ] {
        assert_eq!(server.attr(key), want, "{key}");
    }
    let output: u64 = server.attr("gen_ai.usage.output_tokens").parse().unwrap();
    assert!(output > 0 && output <= 12, "{output}");
    assert!(
        server
            .attr("gen_ai.usage.input_tokens")
            .parse::<u64>()
            .unwrap()
            > 0
    );

    let admission = one(&spans, "sluice.admission");
    assert_eq!(admission.parent_span_id, server.span_id);
    assert_eq!(admission.attr("gen_ai.request.max_tokens"), "12");
    assert_eq!(admission.attr("sluice.tenant"), "anonymous");
    let routing = one(&spans, "sluice.routing");
    assert_eq!(routing.parent_span_id, server.span_id);
    assert_eq!(routing.attr("sluice.backend"), "a");
    assert_eq!(routing.attr("sluice.routing.candidates"), "1");
    assert_eq!(routing.attr("sluice.routing.policy"), "round-robin");
    assert!(
        routing
            .attr("sluice.routing.expected_seconds")
            .parse::<f64>()
            .unwrap()
            >= 0.0
    );
    let attempt = one(&spans, "sluice.attempt");
    assert_eq!(attempt.parent_span_id, server.span_id);
    assert_eq!(attempt.attr("sluice.backend"), "a");
    assert_eq!(attempt.attr("server.address"), "127.0.0.1");
    assert_eq!(attempt.attr("server.port"), a.addr().port().to_string());
    assert_eq!(attempt.attr("sluice.attempt.outcome"), "answered");
    assert_eq!(attempt.attr("http.response.status_code"), "200");
    let response = one(&spans, "sluice.response");
    assert_eq!(response.parent_span_id, server.span_id);
    assert_eq!(response.attr("sluice.complete"), "true");
    let finish = response.attr("gen_ai.response.finish_reasons");
    assert!(["stop", "length"].contains(&finish), "{finish}");
    // (a whole answer's first byte is its head, where the attempt span ends)
    assert!(named(&spans, "sluice.first_token").is_empty());

    // The engine was given the attempt's context, with the client's trace state: its span
    // joins the trace under the attempt.
    let want = format!("00-{trace}-{}-01", attempt.span_id);
    let at = received(&a).iter().position(|tp| *tp == want);
    let at = at.unwrap_or_else(|| panic!("{want} not in {:?}", received(&a)));
    assert_eq!(received_as(&a, "tracestates")[at], "vendor=client");

    // A client's unsampled trace: no span is exported, and the engine is told "not sampled".
    let (trace, parent, header) = client_context(false);
    let (status, _) = chat(&g, &header, false).await;
    assert_eq!(status, 200);
    let forwarded = received(&a);
    let last = forwarded.last().unwrap();
    assert!(
        last.starts_with(&format!("00-{trace}-")) && last.ends_with("-00"),
        "{last}"
    );
    assert!(
        !last.contains(&parent),
        "the engine's parent is Sluice's span, not the client's"
    );
    // (the sampled trace's spans came in the same batches; none of this one's did)
    let (t2, _, h2) = client_context(true);
    chat(&g, &h2, false).await;
    receiver.trace(&t2, has_server).await;
    assert!(receiver.spans().iter().all(|s| s.trace_id != trace));
}

/// Whole answers of the Anthropic Messages and the Responses APIs say why they ended on their
/// response span, read from the body the usage accounting reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_answers_carry_their_finish_reason() {
    let receiver = Receiver::start().await;
    let a = sim(SimKind::Vllm, &[MODEL]).await;
    let g = gateway(&[("a", a.url())], &receiver.config()).await;
    let asks = [
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 12,
                "messages": [{"role": "user", "content": PROMPT}]}),
            ["end_turn", "max_tokens"],
        ),
        (
            "/v1/responses",
            json!({"model": MODEL, "max_output_tokens": 12, "input": PROMPT}),
            ["completed", "incomplete"],
        ),
    ];
    for (path, body, want) in asks {
        let (trace, _, header) = client_context(true);
        let resp = client()
            .post(g.url(path))
            .header("traceparent", header)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}: {}", resp.text().await.unwrap());
        let spans = receiver.trace(&trace, has_server).await;
        no_prompt(&spans);
        let response = one(&spans, "sluice.response");
        assert_eq!(response.attr("sluice.complete"), "true", "{path}");
        let finish = response.attr("gen_ai.response.finish_reasons");
        assert!(want.contains(&finish), "{path}: {finish}");
        assert!(
            response
                .attr("gen_ai.usage.output_tokens")
                .parse::<u64>()
                .unwrap()
                > 0,
            "{path}"
        );
    }
}

/// A request that waits in the fair queue has a `sluice.queue` span inside its routing span,
/// as long as the wait, and its wait for the first token starts after it; one that finds a
/// free slot has no queue span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_in_the_fair_queue_is_a_queue_span() {
    let receiver = Receiver::start().await;
    // speed 1: a 60-token answer takes about a second, long enough to queue behind
    let a = sim_with(SimConfig::new(SimKind::Vllm, vec![MODEL.into()]).speed(1.0)).await;
    let t = format!(
        "{}{FAST_HEALTH}\n[queue]\ntimeout = \"20s\"\n{}max_concurrent = 1\n",
        receiver.config(),
        backend("a", "vllm", &a.url(), &[MODEL]),
    );
    let g = TestGateway::start_healthy(&t).await;
    let (first_trace, _, first) = client_context(true);
    let long = {
        let (url, body) = (g.url("/v1/chat/completions"), chat_body(MODEL, false, 60));
        tokio::spawn(async move {
            let resp = client().post(url).header("traceparent", first).json(&body);
            resp.send().await.unwrap().status().as_u16()
        })
    };
    let b = g.gw.runtime().fleet.get("a").unwrap().clone();
    eventually(Duration::from_secs(5), "the only slot taken", || {
        let n = b.state.inflight_requests();
        async move { n == 1 }
    })
    .await;
    let (trace, _, header) = client_context(true);
    let (status, text) = chat(&g, &header, true).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(long.await.unwrap(), 200);

    let spans = receiver.trace(&trace, has_server).await;
    let routing = one(&spans, "sluice.routing");
    let queue = one(&spans, "sluice.queue");
    assert_eq!(
        queue.parent_span_id, routing.span_id,
        "inside the routing span"
    );
    assert_eq!(queue.attr("sluice.queue.outcome"), "routed");
    assert_eq!(queue.attr("sluice.queue.depth"), "1");
    let waited: f64 = queue.attr("sluice.queue.wait_ms").parse().unwrap();
    assert!(waited > 0.0, "{waited}");
    assert!(queue.duration_ms() <= routing.duration_ms());
    assert_eq!(routing.attr("sluice.backend"), "a");
    // Its wait for the first token starts when it was sent, after the queue, not on arrival.
    let first_token = one(&spans, "sluice.first_token");
    assert!(first_token.start_ns + 1_000_000 >= queue.end_ns);
    let server = one(&spans, "POST /v1/chat/completions");
    let (attempt, stream) = (one(&spans, "sluice.attempt"), one(&spans, "sluice.stream"));
    first_token_between_send_and_stream(server, attempt, stream, first_token);
    // The first request found the slot free: it did not wait, and has no queue span.
    let first = receiver.trace(&first_trace, has_server).await;
    assert!(named(&first, "sluice.queue").is_empty());
    assert_eq!(named(&first, "sluice.routing").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_is_two_attempts_of_one_trace_with_the_reason() {
    let receiver = Receiver::start().await;
    let (a, b) = (
        sim(SimKind::Vllm, &[MODEL]).await,
        sim(SimKind::Vllm, &[MODEL]).await,
    );
    let g = gateway(&[("a", a.url()), ("b", b.url())], &receiver.config()).await;
    a.set_fault(Fault::mode(FaultMode::Overloaded)).unwrap();
    // Round-robin sends one of the first two requests to `a` first.
    let mut failed_over = None;
    for _ in 0..2 {
        let (trace, _, header) = client_context(true);
        let (status, text) = chat(&g, &header, false).await;
        assert_eq!(status, 200, "{text}");
        let spans = receiver.trace(&trace, has_server).await;
        if named(&spans, "sluice.attempt").len() == 2 {
            failed_over = Some(spans);
        }
    }
    let spans = failed_over.expect("one request was sent to `a` first");
    no_prompt(&spans);
    let server = one(&spans, "POST /v1/chat/completions");
    assert_eq!(server.attr("sluice.attempts"), "2");
    assert_eq!(server.attr("sluice.backend"), "b");
    let attempts = named(&spans, "sluice.attempt");
    let first = attempts
        .iter()
        .find(|s| s.attr("sluice.attempt") == "1")
        .unwrap();
    let second = attempts
        .iter()
        .find(|s| s.attr("sluice.attempt") == "2")
        .unwrap();
    assert_eq!(first.attr("sluice.backend"), "a");
    assert_eq!(first.attr("sluice.attempt.outcome"), "retried");
    assert_eq!(first.attr("http.response.status_code"), "503");
    assert!(!first.attr("sluice.retry.reason").is_empty());
    assert_eq!(first.attr("error.type"), first.attr("sluice.retry.reason"));
    assert_eq!(first.status, 2, "an error status");
    assert_eq!(second.attr("sluice.backend"), "b");
    assert_eq!(second.attr("sluice.attempt.outcome"), "answered");
    // Two routing rounds, one per attempt, under the same server span.
    let routings = named(&spans, "sluice.routing");
    assert_eq!(routings.len(), 2);
    assert!(routings.iter().all(|r| r.parent_span_id == server.span_id));
    // Each engine got its own attempt's context.
    let trace = &server.trace_id;
    assert!(received(&a).contains(&format!("00-{trace}-{}-01", first.span_id)));
    assert!(received(&b).contains(&format!("00-{trace}-{}-01", second.span_id)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continued_stream_is_a_continuation_span_of_its_trace() {
    let receiver = Receiver::start().await;
    let a = sim(SimKind::Vllm, &[MODEL]).await;
    let mut cut = Fault::mode(FaultMode::DropMidstream);
    cut.after_chunks = 3;
    a.set_fault(cut).unwrap();
    let b = sim(SimKind::Vllm, &[MODEL]).await;
    let g = gateway(&[("a", a.url()), ("b", b.url())], &receiver.config()).await;
    let mut continued = None;
    for _ in 0..2 {
        let (trace, _, header) = client_context(true);
        let (status, text) = chat(&g, &header, true).await;
        assert_eq!(status, 200);
        assert!(text.contains("[DONE]"), "one unbroken stream: {text}");
        let spans = receiver.trace(&trace, has_server).await;
        if !named(&spans, "sluice.continuation").is_empty() {
            continued = Some(spans);
        }
    }
    let spans = continued.expect("one stream started on `a`, which cuts it");
    no_prompt(&spans);
    let server = one(&spans, "POST /v1/chat/completions");
    let stream = one(&spans, "sluice.stream");
    assert_eq!(stream.parent_span_id, server.span_id);
    assert_eq!(stream.attr("sluice.continued"), "true");
    let cont = one(&spans, "sluice.continuation");
    assert_eq!(cont.parent_span_id, server.span_id);
    assert_eq!(cont.attr("sluice.backend"), "b");
    assert!(cont.attr("sluice.streamed_tokens").parse::<u64>().unwrap() > 0);
    // why the first backend's stream broke, in Sluice's words
    let reason = cont.attr("sluice.continuation.reason");
    assert!(
        reason.contains("stream") || reason.contains("connection"),
        "{reason}"
    );
    assert_eq!(one(&spans, "sluice.attempt").attr("sluice.backend"), "a");
    assert_eq!(
        one(&spans, "sluice.first_token").parent_span_id,
        server.span_id
    );
    // The continuing engine was given the continuation's context.
    let want = format!("00-{}-{}-01", server.trace_id, cont.span_id);
    assert!(
        received(&b).contains(&want),
        "{want} not in {:?}",
        received(&b)
    );
}

/// `sluice_otel_spans_dropped_total{reason="export_failed"}` in a metrics page.
fn dropped(text: &str) -> u64 {
    text.lines()
        .filter(|l| l.starts_with("sluice_otel_spans_dropped_total{reason=\"export_failed\"}"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_drops_and_counts_spans_and_nothing_else() {
    let nobody = free_port();
    let tracing = format!(
        "[tracing]\notlp_endpoint = \"http://127.0.0.1:{nobody}\"\nexport_interval = \"20ms\"\nexport_timeout = \"1s\"\n"
    );
    let a = sim(SimKind::Vllm, &[MODEL]).await;
    let g = gateway(&[("a", a.url())], &tracing).await;
    let before = dropped(&g.metrics_text().await);
    for _ in 0..5 {
        let (_, _, header) = client_context(true);
        let (status, text) = chat(&g, &header, false).await;
        assert_eq!(status, 200, "{text}");
    }
    // Every phase of each request ended as a span, and none reached anyone.
    eventually(Duration::from_secs(10), "spans counted as dropped", || {
        let g = &g;
        async move { dropped(&g.metrics_text().await) >= before + 5 }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_a_grpc_collector() {
    let receiver = Receiver::start_grpc().await;
    let a = sim(SimKind::Vllm, &[MODEL]).await;
    let tracing = format!(
        "[tracing]\notlp_endpoint = \"http://{}\"\nprotocol = \"grpc\"\nexport_interval = \"50ms\"\n\
         [tracing.headers]\nauthorization = \"{COLLECTOR_TOKEN}\"\n\
         [tracing.resource]\n\"deployment.environment\" = \"ci\"\n",
        receiver.addr
    );
    let g = gateway(&[("a", a.url())], &tracing).await;
    let (trace, parent, header) = client_context(true);
    let (status, text) = chat(&g, &header, true).await;
    assert_eq!(status, 200, "{text}");
    let spans = receiver.trace(&trace, has_server).await;
    let server = one(&spans, "POST /v1/chat/completions");
    assert_eq!(server.parent_span_id, parent);
    assert_eq!(server.service, "sluice");
    // gRPC carries the collector's auth header as metadata.
    receiver.assert_configured(server);
    assert_eq!(server.attr("sluice.stream"), "true");
    let stream = one(&spans, "sluice.stream");
    assert_eq!(stream.attr("sluice.complete"), "true");
    let finish = stream.attr("gen_ai.response.finish_reasons");
    assert!(["stop", "length"].contains(&finish), "{finish}");
    assert!(
        stream
            .attr("gen_ai.usage.output_tokens")
            .parse::<u64>()
            .unwrap()
            > 0
    );
    let attempt = one(&spans, "sluice.attempt");
    assert_eq!(attempt.attr("sluice.attempt.outcome"), "answered");
    first_token_between_send_and_stream(server, attempt, stream, one(&spans, "sluice.first_token"));
}

/// The wait for the first token starts where the answering attempt was sent and ends inside
/// the stream; its `sluice.ttft_ms` is the client's, from the server span's start.
fn first_token_between_send_and_stream(server: &Span, attempt: &Span, stream: &Span, first: &Span) {
    const MS: u64 = 1_000_000;
    assert_eq!(first.parent_span_id, server.span_id);
    assert_eq!(first.kind, 1, "an internal span");
    assert!(
        first.start_ns + MS >= attempt.start_ns && first.start_ns <= attempt.end_ns,
        "sent as the attempt started: {first:?} {attempt:?}"
    );
    assert!(
        first.end_ns + MS >= stream.start_ns && first.end_ns <= stream.end_ns,
        "the first token came inside the stream: {first:?} {stream:?}"
    );
    // (the server span starts at the request's arrival, the origin of the request path's
    // offsets)
    let ttft: f64 = first.attr("sluice.ttft_ms").parse().unwrap();
    let from_server = first.end_ns.saturating_sub(server.start_ns) as f64 / 1e6;
    assert!(
        (ttft - from_server).abs() < 0.01,
        "{ttft} ms against {from_server} ms"
    );
    assert!(
        first.duration_ms() <= ttft,
        "{} > {ttft}",
        first.duration_ms()
    );
}

/// A TLS terminator offering ALPN `alpn` in front of `to`, with a certificate for `localhost`
/// and 127.0.0.1 signed by a CA made here; returns its address and the CA's PEM.
async fn tls_front(to: std::net::SocketAddr, alpn: &[u8]) -> (std::net::SocketAddr, String) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair};
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.distinguished_name
        .push(DnType::CommonName, "collector CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    let leaf = CertificateParams::new(names).unwrap();
    let leaf = leaf.signed_by(&key, &ca, &ca_key).unwrap();
    let der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![CertificateDer::from(leaf.der().to_vec())], der)
        .unwrap();
    cfg.alpn_protocols = vec![alpn.to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(cfg));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let Ok(mut up) = tokio::net::TcpStream::connect(to).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
            });
        }
    });
    (addr, ca.pem())
}

/// `[tracing]` for an `https` collector in front of `to` (TLS with `alpn`), reached as `host`
/// over `protocol`, its CA in `ca_file` in the returned folder; the collector token and
/// resource attribute as [`Receiver::config`] has them.
async fn https_tracing(
    to: std::net::SocketAddr,
    alpn: &[u8],
    host: &str,
    protocol: &str,
) -> (tempfile::TempDir, String) {
    let (front, ca) = tls_front(to, alpn).await;
    let dir = tempfile::tempdir().unwrap();
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca).unwrap();
    let tracing = format!(
        "[tracing]\notlp_endpoint = \"https://{host}:{}\"\nprotocol = \"{protocol}\"\nexport_interval = \"50ms\"\nca_file = \"{}\"\n{}",
        front.port(),
        ca_file.display(),
        export_extras()
    );
    (dir, tracing)
}

/// An `https` collector over gRPC, its certificate checked against `ca_file`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_https_grpc_collector() {
    let receiver = Receiver::start_grpc().await;
    let (_dir, tracing) = https_tracing(receiver.addr, b"h2", "localhost", "grpc").await;
    let a = sim(SimKind::Vllm, &[MODEL]).await;
    let g = gateway(&[("a", a.url())], &tracing).await;
    let (trace, parent, header) = client_context(true);
    let (status, text) = chat(&g, &header, false).await;
    assert_eq!(status, 200, "{text}");
    let spans = receiver.trace(&trace, has_server).await;
    assert_eq!(
        one(&spans, "POST /v1/chat/completions").parent_span_id,
        parent
    );
}

/// An `https` collector over OTLP/HTTP (protobuf), its certificate (for 127.0.0.1) checked
/// against `ca_file`: the spans arrive and decode as over http.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_https_http_collector() {
    let receiver = Receiver::start().await;
    let (_dir, tracing) =
        https_tracing(receiver.addr, b"http/1.1", "127.0.0.1", "http/protobuf").await;
    let a = sim(SimKind::Vllm, &[MODEL]).await;
    let g = gateway(&[("a", a.url())], &tracing).await;
    let (trace, parent, header) = client_context(true);
    let (status, text) = chat(&g, &header, true).await;
    assert_eq!(status, 200, "{text}");
    let spans = receiver.trace(&trace, has_server).await;
    no_prompt(&spans);
    let server = one(&spans, "POST /v1/chat/completions");
    assert_eq!(server.parent_span_id, parent);
    assert_eq!(server.service, "sluice");
    // The collector's auth header, over TLS.
    receiver.assert_configured(server);
    assert_eq!(server.attr("sluice.stream"), "true");
    assert_eq!(
        one(&spans, "sluice.attempt").attr("sluice.attempt.outcome"),
        "answered"
    );
}

/// An `https` collector whose certificate nothing trusted signed (no `ca_file`), over either
/// protocol: requests are unaffected, and the spans are dropped and counted, never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_https_collector_gets_no_spans_and_they_are_counted() {
    let a = sim(SimKind::Vllm, &[MODEL]).await;
    for (protocol, receiver, alpn) in [
        ("http/protobuf", Receiver::start().await, &b"http/1.1"[..]),
        ("grpc", Receiver::start_grpc().await, &b"h2"[..]),
    ] {
        let (front, _ca) = tls_front(receiver.addr, alpn).await;
        let tracing = format!(
            "[tracing]\notlp_endpoint = \"https://127.0.0.1:{}\"\nprotocol = \"{protocol}\"\nexport_interval = \"20ms\"\nexport_timeout = \"2s\"\n",
            front.port()
        );
        let g = gateway(&[("a", a.url())], &tracing).await;
        let before = dropped(&g.metrics_text().await);
        for _ in 0..5 {
            let (_, _, header) = client_context(true);
            let (status, text) = chat(&g, &header, false).await;
            assert_eq!(status, 200, "{protocol}: {text}");
        }
        let what = format!("{protocol}: spans counted as dropped");
        eventually(Duration::from_secs(10), what, || {
            let g = &g;
            async move { dropped(&g.metrics_text().await) >= before + 5 }
        })
        .await;
        // (the front forwards nothing before a handshake the exporter refused to finish)
        assert!(
            receiver.spans().is_empty(),
            "{protocol}: {:?}",
            receiver.spans()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passthrough_request_is_traced_to_its_backend() {
    let receiver = Receiver::start().await;
    let a = ScriptedBackend::start(
        200,
        vec![("content-type", "application/json".into())],
        r#"{"label":"positive"}"#.into(),
    )
    .await;
    let mut t = format!("{}{FAST_HEALTH}", receiver.config());
    t.push_str(&backend("pt", "openai", &a.url(), &["cls"]));
    t.push_str("\n[[passthrough]]\nprefix = \"/v1/classify\"\nmodel_field = \"model\"\n");
    let g = TestGateway::start_healthy(&t).await;
    let (trace, parent, header) = client_context(true);
    let resp = client()
        .post(g.url("/v1/classify/item-7"))
        .header("traceparent", header)
        .json(&json!({"model": "cls", "input": PROMPT}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let spans = receiver.trace(&trace, has_server).await;
    no_prompt(&spans);
    let server = one(&spans, "POST /v1/classify");
    assert_eq!(server.parent_span_id, parent);
    assert_eq!(server.attr("sluice.backend"), "pt");
    let attempt = one(&spans, "sluice.attempt");
    assert_eq!(attempt.parent_span_id, server.span_id);
    assert_eq!(attempt.attr("sluice.attempt.outcome"), "answered");
    let sent: Vec<String> = a
        .seen
        .lock()
        .unwrap()
        .iter()
        .filter(|s| s.path.starts_with("/v1/classify"))
        .filter_map(|s| {
            s.headers
                .get("traceparent")?
                .to_str()
                .ok()
                .map(String::from)
        })
        .collect();
    assert_eq!(sent, vec![format!("00-{trace}-{}-01", attempt.span_id)]);
}

/// A chat request without a trace context of its own; the `traceparent` the engine was sent.
async fn untraced_chat(g: &TestGateway, sim: &sluice::sim::SimHandle) -> String {
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 4});
    let resp = post_json(&client(), g.url("/v1/chat/completions"), &body).await;
    assert_eq!(resp.status(), 200);
    received(sim).last().cloned().unwrap_or_default()
}

/// `[tracing]` follows a reload: off to on (Sluice's own traces sampled at 100%), then a
/// ratio of 0 (its own traces unsampled, a client's sampled one still exported), then off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_turns_tracing_on_changes_its_ratio_and_turns_it_off() {
    let receiver = Receiver::start().await;
    let a = sim(SimKind::Vllm, &[MODEL]).await;
    let toml = |tracing: &str| {
        format!(
            "[routing]\npolicy = \"round-robin\"\n{tracing}\n{FAST_HEALTH}{}",
            backend("a", "vllm", &a.url(), &[MODEL])
        )
    };
    let g = TestGateway::start_healthy(&toml("")).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    let reload = |tracing: String| {
        std::fs::write(&path, toml(&tracing)).unwrap();
        assert!(sluice::app::reload::reload_now(&g.gw, &path), "applied");
    };

    // Off: the client's context goes to the engine untouched, nothing is exported.
    let (off_trace, _, header) = client_context(true);
    assert_eq!(chat(&g, &header, false).await.0, 200);
    assert_eq!(received(&a).last(), Some(&header));

    // On, every trace Sluice starts sampled.
    reload(format!("{}sample_ratio = 1.0\n", receiver.config()));
    let sent = untraced_chat(&g, &a).await;
    assert!(sent.ends_with("-01"), "{sent}");
    let on_trace = sent.split('-').nth(1).unwrap().to_string();
    let spans = receiver.trace(&on_trace, has_server).await;
    assert_eq!(
        one(&spans, "sluice.attempt").attr("sluice.attempt.outcome"),
        "answered"
    );

    // A ratio of 0: Sluice's own traces are propagated unsampled and not exported; a client's
    // sampled trace still is (and comes after, in order, so the other's absence is seen).
    reload(format!("{}sample_ratio = 0.0\n", receiver.config()));
    let sent = untraced_chat(&g, &a).await;
    assert!(sent.ends_with("-00"), "{sent}");
    let unsampled = sent.split('-').nth(1).unwrap().to_string();
    let (client_trace, _, header) = client_context(true);
    assert_eq!(chat(&g, &header, false).await.0, 200);
    receiver.trace(&client_trace, has_server).await;

    // Off again: no context is made for the engine.
    reload(String::new());
    let (late_trace, _, header) = client_context(true);
    assert_eq!(chat(&g, &header, false).await.0, 200);
    assert_eq!(received(&a).last(), Some(&header));
    let before = received(&a).len();
    untraced_chat(&g, &a).await;
    assert_eq!(received(&a).len(), before, "no traceparent is sent");

    let spans = receiver.spans();
    for absent in [&off_trace, &unsampled, &late_trace] {
        assert!(
            spans.iter().all(|s| &s.trace_id != absent),
            "{absent} was exported"
        );
    }
}

/// A stream that started before a reload turned tracing off ends its spans on the provider it
/// started with, and they are exported: the old provider is dropped only after its last span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_across_a_reload_keeps_its_trace() {
    let receiver = Receiver::start().await;
    let a = sim_with(
        SimConfig::new(SimKind::Vllm, vec![MODEL.into()])
            .speed(1.0)
            .output_tokens(30, 30),
    )
    .await;
    let toml = |tracing: &str| {
        format!(
            "{tracing}\n{FAST_HEALTH}{}",
            backend("a", "vllm", &a.url(), &[MODEL])
        )
    };
    let g = TestGateway::start_healthy(&toml(&receiver.config())).await;
    let (trace, _, header) = client_context(true);
    let mut stream = client()
        .post(g.url("/v1/chat/completions"))
        .header("traceparent", header)
        .json(&chat_body(MODEL, true, 30))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    assert!(stream.chunk().await.unwrap().is_some(), "the first chunk");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(&path, toml("")).unwrap();
    assert!(sluice::app::reload::reload_now(&g.gw, &path));
    let mut rest = Vec::new();
    while let Some(chunk) = stream.chunk().await.unwrap() {
        rest.extend_from_slice(&chunk);
    }
    assert!(String::from_utf8_lossy(&rest).contains("[DONE]"));
    let spans = receiver.trace(&trace, has_server).await;
    assert_eq!(one(&spans, "sluice.stream").attr("sluice.complete"), "true");
}

/// `sluice serve` itself, killed when dropped.
struct Served(std::process::Child);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_names_the_trace_and_no_span_names_the_key() {
    use std::process::{Command, Stdio};
    let receiver = Receiver::start().await;
    let a = sim(SimKind::Vllm, &[MODEL]).await;
    let (key, hash) = sluice::auth::mint();
    let port = free_port();
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:{port}\"\n{}{FAST_HEALTH}{}\n[[keys]]\nname = \"alice\"\nhash = \"{hash}\"\n",
        receiver.config(),
        backend("a", "vllm", &a.url(), &[MODEL]),
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sluice.toml");
    std::fs::write(&path, toml).unwrap();
    let mut served = Served(
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["serve", "--config"])
            .arg(&path)
            .env("SLUICE_LOG_FORMAT", "json")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let (c, base) = (client(), format!("http://127.0.0.1:{port}"));
    eventually(Duration::from_secs(20), "sluice serve ready", || {
        let (c, url) = (c.clone(), format!("{base}/readyz"));
        async move { c.get(url).send().await.is_ok_and(|r| r.status() == 200) }
    })
    .await;
    let (trace, _, header) = client_context(true);
    let resp = c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(&key)
        .header("traceparent", header)
        .json(&json!({"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let spans = receiver.trace(&trace, has_server).await;
    no_prompt(&spans);
    for s in &spans {
        assert!(
            s.attrs.values().all(|v| !v.contains(&key)),
            "{} carries the key",
            s.name
        );
    }
    let server = one(&spans, "POST /v1/chat/completions");
    assert_eq!(server.attr("sluice.tenant"), "alice");
    let _ = served.0.kill();
    let _ = served.0.wait();
    let logs = support::process::output_of(&mut served.0);
    let access = logs
        .lines()
        .find(|l| l.contains("\"trace_id\"") && l.contains(&trace))
        .unwrap_or_else(|| panic!("no access line names trace {trace}:\n{logs}"));
    let line: Value = serde_json::from_str(access).unwrap();
    assert_eq!(line["trace_id"], trace.as_str(), "{access}");
    assert_eq!(line["span_id"], server.span_id.as_str(), "{access}");
}
