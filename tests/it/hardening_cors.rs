//! Browser-facing exposure: CORS is off unless `server.cors_allow_origins` lists origins (then
//! only those get `Access-Control-*` headers, preflights are answered without a key, and the
//! real request is still authenticated); operations endpoints sharing a non-loopback client
//! listener without an admin token are refused rather than left open.

use crate::support;

use sluice::sim::SimKind;
use support::*;

fn keyed(extra_server: &str, url: &str) -> (String, String) {
    let (key, hash) = sluice::auth::mint();
    let toml = format!(
        "[server]\n{extra_server}\n{FAST_HEALTH}{}\n[[keys]]\nname = \"web\"\nhash = \"{hash}\"\n",
        backend("a", "vllm", url, &["m"])
    );
    (key, toml)
}

async fn preflight(g: &TestGateway, origin: &str) -> reqwest::Response {
    client()
        .request(reqwest::Method::OPTIONS, g.url("/v1/chat/completions"))
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization, content-type, x-stainless-os",
        )
        .send()
        .await
        .unwrap()
}

fn cors_headers(r: &reqwest::Response) -> Vec<String> {
    r.headers()
        .keys()
        .map(|k| k.as_str().to_string())
        .filter(|k| k.starts_with("access-control-"))
        .collect()
}

#[tokio::test]
async fn cors_is_off_by_default() {
    let s = sim(SimKind::Vllm, &["m"]).await;
    let (key, toml) = keyed("", &s.url());
    let g = TestGateway::start_healthy(&toml).await;

    let pre = preflight(&g, "https://app.example.com").await;
    assert_eq!(pre.status(), 405, "no CORS: a preflight is just an OPTIONS");
    assert!(cors_headers(&pre).is_empty(), "{:?}", pre.headers());

    let r = client()
        .post(g.url("/v1/chat/completions"))
        .header("origin", "https://app.example.com")
        .bearer_auth(&key)
        .json(&chat_body("m", false, 4))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(cors_headers(&r).is_empty(), "{:?}", r.headers());
    g.stop().await;
}

#[tokio::test]
async fn listed_origins_only_and_requests_stay_authenticated() {
    let s = sim(SimKind::Vllm, &["m"]).await;
    let (key, toml) = keyed(
        "cors_allow_origins = [\"https://App.Example.com\", \"http://localhost:3000\"]",
        &s.url(),
    );
    let g = TestGateway::start_healthy(&toml).await;

    // A listed origin (compared case-insensitively): the preflight is answered without a key.
    let pre = preflight(&g, "https://app.example.com").await;
    assert_eq!(pre.status(), 204);
    let h = pre.headers();
    assert_eq!(
        h["access-control-allow-origin"], "https://app.example.com",
        "{h:?}"
    );
    assert!(h["access-control-allow-methods"]
        .to_str()
        .unwrap()
        .contains("POST"));
    assert_eq!(
        h["access-control-allow-headers"],
        "authorization, content-type, x-stainless-os"
    );
    assert!(h.get("access-control-allow-credentials").is_none());
    assert!(h["vary"].to_str().unwrap().contains("origin"));

    // An origin not listed: no CORS headers, so the browser blocks it.
    let other = preflight(&g, "https://evil.example.net").await;
    assert_eq!(other.status(), 405);
    assert!(cors_headers(&other).is_empty(), "{:?}", other.headers());
    // A prefix or suffix of a listed origin is not that origin.
    for near in [
        "https://app.example.com.evil.net",
        "https://app.example.co",
        "http://app.example.com",
    ] {
        let r = preflight(&g, near).await;
        assert!(cors_headers(&r).is_empty(), "{near}: {:?}", r.headers());
    }

    // The real request from a listed origin: headers the page may read are exposed.
    let ok = client()
        .post(g.url("/v1/chat/completions"))
        .header("origin", "http://localhost:3000")
        .bearer_auth(&key)
        .json(&chat_body("m", false, 4))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    assert_eq!(
        ok.headers()["access-control-allow-origin"],
        "http://localhost:3000"
    );
    let exposed = header(&ok, "access-control-expose-headers").to_string();
    assert!(exposed.contains("x-request-id"), "{exposed}");
    assert!(
        exposed.contains("x-ratelimit-remaining-requests"),
        "{exposed}"
    );

    // Without a key, a listed origin is still refused; the error carries CORS headers so the
    // page can read why.
    let no_key = client()
        .post(g.url("/v1/chat/completions"))
        .header("origin", "http://localhost:3000")
        .json(&chat_body("m", false, 4))
        .send()
        .await
        .unwrap();
    assert_eq!(no_key.status(), 401);
    assert_eq!(
        no_key.headers()["access-control-allow-origin"],
        "http://localhost:3000"
    );

    // A reload that drops the setting turns CORS off for new requests.
    let (_, plain) = keyed("", &s.url());
    g.gw.reload(sluice::config::from_str(&plain, "test").unwrap());
    let after = preflight(&g, "https://app.example.com").await;
    assert_eq!(after.status(), 405);
    assert!(cors_headers(&after).is_empty());
    g.stop().await;
}

#[tokio::test]
async fn wildcard_origin_answers_any_origin_without_credentials() {
    let s = sim(SimKind::Vllm, &["m"]).await;
    let (_key, toml) = keyed("cors_allow_origins = [\"*\"]", &s.url());
    let g = TestGateway::start_healthy(&toml).await;
    let pre = preflight(&g, "https://anything.example").await;
    assert_eq!(pre.status(), 204);
    assert_eq!(pre.headers()["access-control-allow-origin"], "*");
    assert!(pre
        .headers()
        .get("access-control-allow-credentials")
        .is_none());
    // No Origin header: not a CORS request, nothing added.
    let r = client().get(g.url("/v1/models")).send().await.unwrap();
    assert!(cors_headers(&r).is_empty(), "{:?}", r.headers());
    g.stop().await;
}

#[test]
fn bad_origins_are_config_errors() {
    for (list, want) in [
        ("[\"*\", \"https://a.example\"]", "must be the only entry"),
        ("[\"https://a.example/path\"]", "cors_allow_origins[0]"),
        ("[\"a.example\"]", "cors_allow_origins[0]"),
        ("[\"https://\"]", "cors_allow_origins[0]"),
        (
            "[\"https://a.example\", \"ftp://b\"]",
            "cors_allow_origins[1]",
        ),
    ] {
        let toml = format!(
            "[server]\ncors_allow_origins = {list}\n{}",
            backend("a", "vllm", "http://127.0.0.1:1", &["m"])
        );
        let err = sluice::config::from_str(&toml, "test")
            .err()
            .unwrap_or_else(|| panic!("{list} must be refused"))
            .to_string();
        assert!(err.contains(want), "{list}: {err}");
    }
}

#[tokio::test]
async fn operations_on_a_public_client_listener_need_an_admin_token() {
    let s = sim(SimKind::Vllm, &["m"]).await;
    // The harness binds loopback, but the configured address is what decides exposure.
    let toml = format!(
        "[server]\nlisten = \"0.0.0.0:8080\"\n{FAST_HEALTH}{}",
        backend("a", "vllm", &s.url(), &["m"])
    );
    let g = TestGateway::start_healthy(&toml).await;
    let c = client();
    for path in [
        "/metrics",
        "/admin/backends",
        "/admin/summary",
        "/dashboard",
        "/dashboard?token=x",
    ] {
        let r = c.get(g.url(path)).send().await.unwrap();
        assert_eq!(r.status(), 403, "{path}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(
            body["error"]["code"], "admin_token_not_configured",
            "{path}"
        );
    }
    // Health stays open: orchestrators probe it.
    assert_eq!(c.get(g.url("/healthz")).send().await.unwrap().status(), 200);
    assert_eq!(c.get(g.url("/readyz")).send().await.unwrap().status(), 200);
    g.stop().await;

    // The same on a loopback listener: open, as a developer's laptop expects.
    let local = format!(
        "[server]\nlisten = \"127.0.0.1:8080\"\n{FAST_HEALTH}{}",
        backend("a", "vllm", &s.url(), &["m"])
    );
    let g = TestGateway::start_healthy(&local).await;
    assert_eq!(c.get(g.url("/metrics")).send().await.unwrap().status(), 200);
    g.stop().await;
}
