//! TLS on the client listener and towards backends, with certificates generated here (rcgen):
//! HTTPS with HTTP/2 and HTTP/1.1 chosen by ALPN, mTLS refusing a client without a
//! certificate, the certificate re-read when its files change, and an `https://` backend
//! trusted through `[backend_tls] ca_file`.

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use sluice::sim::SimKind;
use support::*;
use tokio::net::{TcpListener, TcpStream};

struct Ca {
    cert: Certificate,
    key: KeyPair,
}

fn ca(name: &str) -> Ca {
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key).unwrap();
    Ca { cert, key }
}

/// A leaf certificate signed by `ca`: (cert PEM, key PEM, cert DER).
fn leaf(ca: &Ca, cn: &str, client: bool) -> (String, String, CertificateDer<'static>) {
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, cn);
    params.extended_key_usages = vec![if client {
        ExtendedKeyUsagePurpose::ClientAuth
    } else {
        ExtendedKeyUsagePurpose::ServerAuth
    }];
    let cert = params.signed_by(&key, &ca.cert, &ca.key).unwrap();
    (cert.pem(), key.serialize_pem(), cert.der().clone())
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn client_tls(ca: &Ca, alpn: &[&[u8]], client_cert: Option<(&str, &str)>) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert.der().clone()).unwrap();
    let b = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut cfg = match client_cert {
        Some((cert, key)) => {
            let certs: Vec<_> = CertificateDer::pem_slice_iter(cert.as_bytes())
                .collect::<Result<_, _>>()
                .unwrap();
            let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
            b.with_client_auth_cert(certs, key).unwrap()
        }
        None => b.with_no_client_auth(),
    };
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    cfg
}

/// What one HTTPS request saw.
struct Answer {
    alpn: Option<Vec<u8>>,
    version: http::Version,
    status: u16,
    peer_cert: CertificateDer<'static>,
}

/// Connect over TLS to `addr`, send `GET path` with HTTP/2 or HTTP/1.1 as ALPN decided.
async fn https_get(
    addr: std::net::SocketAddr,
    cfg: rustls::ClientConfig,
    path: &str,
) -> Result<Answer, String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let name = ServerName::try_from("localhost").unwrap();
    let tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let (_, session) = tls.get_ref();
    let alpn = session.alpn_protocol().map(|p| p.to_vec());
    let peer_cert = session.peer_certificates().unwrap()[0].clone();
    let req = http::Request::get(format!("https://localhost{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = if alpn.as_deref() == Some(b"h2") {
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .map_err(|e| format!("h2: {e}"))?;
        tokio::spawn(conn);
        send.send_request(req)
            .await
            .map_err(|e| format!("h2 request: {e}"))?
    } else {
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| format!("h1: {e}"))?;
        tokio::spawn(conn);
        let mut req = req;
        req.headers_mut()
            .insert(http::header::HOST, "localhost".parse().unwrap());
        send.send_request(req)
            .await
            .map_err(|e| format!("h1 request: {e}"))?
    };
    let version = resp.version();
    let status = resp.status().as_u16();
    let _ = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(Answer {
        alpn,
        version,
        status,
        peer_cert,
    })
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    // Write beside, then rename: what a certificate rotation does.
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, &p).unwrap();
    p.display().to_string()
}

fn toml_tls(cert: &str, key: &str, client_ca: Option<&str>, sim_url: &str) -> String {
    let ca_line = client_ca.map_or(String::new(), |c| format!("client_ca = \"{c}\"\n"));
    format!(
        "[tls]\ncert = \"{cert}\"\nkey = \"{key}\"\n{ca_line}\n[reload]\ninterval = \"50ms\"\n{FAST_HEALTH}{}",
        backend("a", "vllm", sim_url, &["m"])
    )
}

#[tokio::test]
async fn https_with_alpn_h2_and_http1_and_cert_reload() {
    let dir = tempfile::tempdir().unwrap();
    let ca = ca("test ca");
    let (cert, key, der1) = leaf(&ca, "first", false);
    let cert_p = write(dir.path(), "tls.crt", &cert);
    let key_p = write(dir.path(), "tls.key", &key);
    let sim = sim(SimKind::Vllm, &["m"]).await;
    let g = TestGateway::start_healthy(&toml_tls(&cert_p, &key_p, None, &sim.url())).await;

    let h2 = https_get(
        g.addr,
        client_tls(&ca, &[b"h2", b"http/1.1"], None),
        "/v1/models",
    )
    .await
    .unwrap();
    assert_eq!(h2.alpn.as_deref(), Some(&b"h2"[..]));
    assert_eq!(h2.version, http::Version::HTTP_2);
    assert_eq!(h2.status, 200);
    assert_eq!(h2.peer_cert, der1);

    let h1 = https_get(g.addr, client_tls(&ca, &[b"http/1.1"], None), "/readyz")
        .await
        .unwrap();
    assert_eq!(h1.alpn.as_deref(), Some(&b"http/1.1"[..]));
    assert_eq!(h1.version, http::Version::HTTP_11);
    assert_eq!(h1.status, 200);

    // Plain HTTP on the TLS port gets no HTTP answer.
    let plain = client().get(g.url("/healthz")).send().await;
    assert!(
        plain.is_err(),
        "plain HTTP must not be served on the TLS port"
    );

    // A key that does not match the certificate is rejected; the old certificate serves.
    let (_, other_key, _) = leaf(&ca, "other", false);
    write(dir.path(), "tls.key", &other_key);
    eventually(
        Duration::from_secs(5),
        "mismatched key rejected",
        || async {
            let text = sluice::telemetry::metrics::handle().render();
            text.lines()
                .any(|l| l.starts_with("sluice_tls_reloads_total{result=\"rejected\"}"))
        },
    )
    .await;
    let still = https_get(g.addr, client_tls(&ca, &[b"h2"], None), "/healthz")
        .await
        .unwrap();
    assert_eq!(still.peer_cert, der1);

    // Rotate: a new certificate and key; new connections get it without a restart.
    let (cert2, key2, der2) = leaf(&ca, "second", false);
    write(dir.path(), "tls.key", &key2);
    write(dir.path(), "tls.crt", &cert2);
    let addr = g.addr;
    let ca_ref = &ca;
    eventually(Duration::from_secs(5), "new certificate served", || {
        let der2 = der2.clone();
        async move {
            match https_get(addr, client_tls(ca_ref, &[b"h2"], None), "/healthz").await {
                Ok(a) => a.peer_cert == der2 && a.status == 200,
                Err(_) => false,
            }
        }
    })
    .await;
    g.stop().await;
}

#[tokio::test]
async fn mtls_refuses_a_client_without_a_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let server_ca = ca("server ca");
    let client_ca = ca("client ca");
    let stranger_ca = ca("stranger ca");
    let (cert, key, _) = leaf(&server_ca, "gateway", false);
    let cert_p = write(dir.path(), "tls.crt", &cert);
    let key_p = write(dir.path(), "tls.key", &key);
    let ca_p = write(dir.path(), "clients.pem", &client_ca.cert.pem());
    let sim = sim(SimKind::Vllm, &["m"]).await;
    let g = TestGateway::start_healthy(&toml_tls(&cert_p, &key_p, Some(&ca_p), &sim.url())).await;

    let none = https_get(g.addr, client_tls(&server_ca, &[b"h2"], None), "/healthz").await;
    assert!(
        none.is_err(),
        "a client without a certificate must be refused"
    );

    let (sc, sk, _) = leaf(&stranger_ca, "stranger", true);
    let stranger = https_get(
        g.addr,
        client_tls(&server_ca, &[b"h2"], Some((&sc, &sk))),
        "/healthz",
    )
    .await;
    assert!(
        stranger.is_err(),
        "a certificate from another CA must be refused"
    );

    let (cc, ck, _) = leaf(&client_ca, "app", true);
    let ok = https_get(
        g.addr,
        client_tls(&server_ca, &[b"h2"], Some((&cc, &ck))),
        "/v1/models",
    )
    .await
    .unwrap();
    assert_eq!(ok.status, 200);
    assert_eq!(ok.version, http::Version::HTTP_2);
    g.stop().await;
}

#[test]
fn bad_tls_files_are_config_errors() {
    let dir = tempfile::tempdir().unwrap();
    let ca = ca("ca");
    let (cert, _, _) = leaf(&ca, "x", false);
    let cert_p = write(dir.path(), "tls.crt", &cert);
    let junk = write(dir.path(), "junk.key", "not a key\n");
    let text = format!("[tls]\ncert = \"{cert_p}\"\nkey = \"{junk}\"\n");
    let err = sluice::config::from_str(&text, "t.toml")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("t.toml: tls") && err.contains("junk.key"),
        "{err}"
    );
    let missing = "[tls]\ncert = \"/nonexistent/c.pem\"\nkey = \"/nonexistent/k.pem\"\n";
    let err = sluice::config::from_str(missing, "t.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot read"), "{err}");
}

/// A TLS terminator in front of a plain backend: what an `https://` inference server looks like.
async fn tls_front(cert: &str, key: &str, to: std::net::SocketAddr) -> std::net::SocketAddr {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(cert.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap();
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(s).await else {
                    return;
                };
                let Ok(mut up) = TcpStream::connect(to).await else {
                    return;
                };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
            });
        }
    });
    addr
}

/// The test gateway is built like `sluice serve`: the fleet takes `[backend_tls]` from the
/// config it is built with, nothing else has to be set.
#[tokio::test]
async fn https_backend_trusted_through_backend_tls_ca_file() {
    let dir = tempfile::tempdir().unwrap();
    let ca = ca("backend ca");
    let (cert, key, _) = leaf(&ca, "backend", false);
    let sim = sim(SimKind::Vllm, &["m"]).await;
    let sim_addr: std::net::SocketAddr = sim.url().trim_start_matches("http://").parse().unwrap();
    let front = tls_front(&cert, &key, sim_addr).await;
    let ca_p = write(dir.path(), "backend-ca.pem", &ca.cert.pem());
    let text = format!(
        "[backend_tls]\nca_file = \"{ca_p}\"\nsystem_roots = false\n{FAST_HEALTH}{}",
        backend(
            "tls",
            "vllm",
            &format!("https://127.0.0.1:{}", front.port()),
            &["m"]
        )
    );
    let g = TestGateway::start_healthy(&text).await;
    let r = g.chat(&chat_body("m", false, 8)).await;
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
    g.stop().await;
}

/// `[backend_tls]` is part of the config snapshot: a reload that switches the CA applies to the
/// backends at once (their clients are rebuilt from the new fleet's TLS configuration).
#[tokio::test]
async fn reload_switching_the_backend_ca_takes_effect() {
    let dir = tempfile::tempdir().unwrap();
    let (wrong, right) = (ca("another ca"), ca("backend ca"));
    let (cert, key, _) = leaf(&right, "backend", false);
    let sim = sim(SimKind::Vllm, &["m"]).await;
    let sim_addr: std::net::SocketAddr = sim.url().trim_start_matches("http://").parse().unwrap();
    let front = tls_front(&cert, &key, sim_addr).await;
    let text = |ca_p: &str| {
        format!(
            "[backend_tls]\nca_file = \"{ca_p}\"\nsystem_roots = false\n{FAST_HEALTH}{}",
            backend(
                "tls",
                "vllm",
                &format!("https://127.0.0.1:{}", front.port()),
                &["m"]
            )
        )
    };
    let wrong_p = write(dir.path(), "wrong-ca.pem", &wrong.cert.pem());
    let right_p = write(dir.path(), "right-ca.pem", &right.cert.pem());
    let g = TestGateway::start(&text(&wrong_p)).await;
    let chat = || async { g.chat(&chat_body("m", false, 8)).await.status() };
    let last_error = || async {
        let v = g.admin_backends().await;
        v["backends"][0]["last_error"]
            .as_str()
            .unwrap_or("")
            .to_string()
    };
    // Probes over TLS fail while the backend's certificate is not trusted.
    eventually(
        Duration::from_secs(10),
        "a probe refused the certificate",
        || async { last_error().await.contains("UnknownIssuer") },
    )
    .await;
    assert_eq!(g.backend_state("tls"), "starting");
    assert_ne!(chat().await, 200);

    g.gw.reload(sluice::config::from_str(&text(&right_p), "t").unwrap());
    let rt = g.gw.runtime();
    let ca_file = rt.fleet.tls().settings().ca_file.as_deref();
    assert_eq!(ca_file, Some(Path::new(&right_p)));
    g.wait_all_healthy().await;
    assert_eq!(chat().await, 200);

    // And back: the old CA is in force again for new connections.
    g.gw.reload(sluice::config::from_str(&text(&wrong_p), "t").unwrap());
    let fleet_ca = g.gw.runtime().fleet.tls().settings().ca_file.clone();
    assert_eq!(fleet_ca.as_deref(), Some(Path::new(&wrong_p)));
    eventually(
        Duration::from_secs(10),
        "the backend fails over TLS again",
        || async { g.backend_state("tls") != "healthy" },
    )
    .await;
    g.stop().await;
}
