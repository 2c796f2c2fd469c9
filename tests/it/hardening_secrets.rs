//! Secrets never leave the gateway, on every surface of the real binary.
//!
//! `tenants_secrets.rs` covers the access log of the in-process paths (a key and a prompt at
//! trace level, one near-miss) and the equal treatment of wrong and unknown keys. This test
//! runs `sluice serve` with every kind of secret the config holds — client API keys, the
//! admin token, backend API keys (one through `${ENV}`), a registered backend's key, a Redis
//! URL password, and a rotated admin token after a reload — and drives the whole surface:
//! good requests (JSON and SSE), wrong keys and near-misses of real ones, a backend that fails
//! and one that refuses the gateway's key (both echo the key they were sent, as some servers
//! do), `/metrics`, `/admin/*`, `/dashboard`, registration, a reload (applied and rejected)
//! and `sluice check` on good and broken configs. Then no secret — nor its base64 — may
//! appear in the logs (debug level), a response header, a response body or `check`'s output,
//! and no client key or admin token may reach a backend.

use crate::support;

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::process::{output_of, write_atomically};
use support::{eventually, free_port, poll};
use tokio::net::TcpListener;

/// Standard or URL-safe base64, padded or not.
fn base64(data: &[u8], url_safe: bool, pad: bool) -> String {
    let alphabet: &[u8; 64] = if url_safe {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    } else {
        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    };
    let mut out = String::new();
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..=chunk.len() {
            out.push(alphabet[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
        if pad {
            for _ in chunk.len()..3 {
                out.push('=');
            }
        }
    }
    out
}

/// The strings whose presence means a secret leaked: the secret, its random part when it has
/// the `sk-sluice-` prefix, and its base64 forms (as in a Basic header).
fn forms(secret: &str) -> Vec<String> {
    let mut v = vec![secret.to_string()];
    if let Some(tail) = secret.strip_prefix("sk-sluice-") {
        v.push(tail.to_string());
    }
    for s in [secret.to_string(), format!(":{secret}")] {
        for (url, pad) in [(false, true), (false, false), (true, false)] {
            v.push(base64(s.as_bytes(), url, pad));
        }
    }
    v
}

/// What the test backend saw.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<String>>>);

/// An OpenAI-compatible backend that requires `Authorization: Bearer <key>` and, like some
/// real servers, echoes the credential it was sent in its error messages. `/ping` is its
/// unauthenticated health path. A prompt containing `please-fail` gets a 500.
async fn keyed_backend(key: &'static str, seen: Seen) -> String {
    use axum::extract::Request;
    use axum::response::IntoResponse;
    let handler = move |req: Request| {
        let seen = seen.clone();
        async move {
            let (parts, body) = req.into_parts();
            let body = http_body_util::BodyExt::collect(body)
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            let auth = parts
                .headers
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            seen.0.lock().unwrap().push(format!(
                "{} {:?} {}",
                parts.uri,
                parts.headers,
                String::from_utf8_lossy(&body)
            ));
            let json = |status: u16, v: serde_json::Value| {
                (
                    http::StatusCode::from_u16(status).unwrap(),
                    [("content-type", "application/json")],
                    v.to_string(),
                )
                    .into_response()
            };
            if parts.uri.path() == "/ping" {
                return json(200, serde_json::json!({"ok": true}));
            }
            if auth != format!("Bearer {key}") {
                return json(
                    401,
                    serde_json::json!({"error": {
                        "message": format!("Incorrect API key provided: {auth}"),
                        "type": "invalid_request_error", "param": auth, "code": "invalid_api_key"}}),
                );
            }
            if parts.uri.path() == "/v1/models" {
                return json(
                    200,
                    serde_json::json!({"object": "list", "data": [{"id": "m", "object": "model"}]}),
                );
            }
            let req: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            if req.to_string().contains("please-fail") {
                return json(
                    500,
                    serde_json::json!({"error": {
                        "message": format!("worker crashed serving a request authorised by {auth}"),
                        "type": "server_error", "param": null, "code": null}}),
                );
            }
            let model = model_of(&req);
            if req["stream"] == serde_json::Value::Bool(true)
                && req.to_string().contains("please-break")
            {
                // A 200 stream that fails after its first chunk with an error event echoing
                // the key the gateway sent.
                let sse = format!(
                    "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
                    serde_json::json!({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                        "model": model_of(&req), "choices": [{"index": 0, "delta": {"content": "Hel"},
                        "finish_reason": null}]}),
                    serde_json::json!({"error": {"message": format!("worker lost mid-answer (request authorised by {auth})"),
                        "type": "server_error", "param": null, "code": null}})
                );
                return (
                    http::StatusCode::OK,
                    [("content-type", "text/event-stream")],
                    sse,
                )
                    .into_response();
            }
            if req["stream"] == serde_json::Value::Bool(true) {
                let mut sse = String::new();
                for (i, word) in ["Hello", " there"].iter().enumerate() {
                    sse.push_str(&format!(
                        "data: {}\n\n",
                        serde_json::json!({"id": "c1", "object": "chat.completion.chunk",
                            "created": 1, "model": model, "choices": [{"index": 0,
                            "delta": {"content": word}, "finish_reason": if i == 1 { Some("stop") } else { None }}]})
                    ));
                }
                sse.push_str(&format!(
                    "data: {}\n\ndata: [DONE]\n\n",
                    serde_json::json!({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                        "model": model, "choices": [],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
                ));
                return (
                    http::StatusCode::OK,
                    [("content-type", "text/event-stream")],
                    sse,
                )
                    .into_response();
            }
            json(
                200,
                serde_json::json!({"id": "c1", "object": "chat.completion", "created": 1,
                    "model": model, "choices": [{"index": 0, "message": {"role": "assistant",
                    "content": "Hello there"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}),
            )
        }
    };
    let app = axum::Router::new().fallback(handler);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    format!("http://{addr}")
}

/// Every response, as text: status line, headers, body.
#[derive(Default)]
struct Transcript(Vec<(String, String)>);

impl Transcript {
    async fn record(&mut self, what: &str, resp: reqwest::Response) -> (u16, String) {
        let status = resp.status().as_u16();
        let mut text = format!("{status}\n");
        for (k, v) in resp.headers() {
            text.push_str(&format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes())));
        }
        let body = resp.text().await.unwrap_or_default();
        text.push('\n');
        text.push_str(&body);
        self.0.push((what.to_string(), text));
        (status, body)
    }
}

const ADMIN_TOKEN: &str = "adm-7f3c91e0b2d84a6f9c15e2a7d04b8e31";
const ADMIN_TOKEN_2: &str = "adm-rotated-5d2e8c1f7a9b4036e1c2d3f4a5b6c7d8";
const BACKEND_KEY: &str = "be-key-c4f1a9e27d3b40f58e6a1c9d2b7f3e05";
const WRONG_BACKEND_KEY: &str = "be-stale-91ab3e5f7c2d4a60b8e1f3c5d7a9b2e4";
const REGISTERED_KEY: &str = "be-registered-0e9d8c7b6a5f4e3d2c1b0a9f8e7d6c5b";
const REDIS_PASSWORD: &str = "rds-pw-2b4d6f8a0c1e3a5c7e9b1d3f5a7c9e0b";
const ENV: [(&str, &str); 2] = [
    ("SLUICE_TEST_BACKEND_KEY", BACKEND_KEY),
    ("SLUICE_LOG", "debug"),
];

struct Gateway {
    child: Child,
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn sluice(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sluice"));
    c.args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c
}

/// What the config file is made of.
struct Setup {
    port: u16,
    admin_port: u16,
    dead_redis: u16,
    good: String,
    alice_hash: String,
    bob_hash: String,
}

impl Setup {
    fn config(&self, token: &str) -> String {
        let Setup {
            port,
            admin_port,
            dead_redis,
            good,
            alice_hash,
            bob_hash,
        } = self;
        format!(
            r#"[server]
listen = "127.0.0.1:{port}"

[admin]
listen = "127.0.0.1:{admin_port}"
token = "{token}"

[limits]
redis_url = "redis://:{REDIS_PASSWORD}@127.0.0.1:{dead_redis}/0"
fail_open = true

[health]
interval = "50ms"
timeout = "500ms"
healthy_threshold = 1
unhealthy_threshold = 1
eject_after_failures = 100

[[backends]]
name = "good"
kind = "openai"
url = "{good}"
models = ["m"]
api_key = "${{SLUICE_TEST_BACKEND_KEY}}"
health_path = "/ping"

[[backends]]
name = "stale"
kind = "openai"
url = "{good}"
models = ["m2"]
api_key = "{WRONG_BACKEND_KEY}"
health_path = "/ping"

[[keys]]
name = "alice"
hash = "{alice_hash}"
requests_per_minute = 1000

[[keys]]
name = "bob"
hash = "{bob_hash}"
"#
        )
    }
}

fn chat(model: &str, stream: bool, prompt: &str) -> serde_json::Value {
    serde_json::json!({"model": model, "stream": stream, "max_tokens": 5,
        "messages": [{"role": "user", "content": prompt}]})
}

/// Change one byte of `s` (to `a`, or to `b` where it is an `a`).
fn flip(s: &str, at: usize) -> String {
    let mut b = s.as_bytes().to_vec();
    b[at] = if b[at] == b'a' { b'b' } else { b'a' };
    String::from_utf8(b).unwrap()
}

/// The running binary, its clients' keys and everything it answered.
struct Run {
    gw: Gateway,
    pid: String,
    setup: Setup,
    dir: tempfile::TempDir,
    path: std::path::PathBuf,
    alice: String,
    bob: String,
    c: reqwest::Client,
    t: Transcript,
}

impl Run {
    /// Start `sluice serve` on a config with every kind of secret, in front of a keyed backend
    /// whose requests go to `seen`, and wait until both configured backends are healthy.
    async fn start(seen: &Seen) -> Run {
        let (alice, alice_hash) = sluice::auth::mint();
        let (bob, bob_hash) = sluice::auth::mint();
        let setup = Setup {
            good: keyed_backend(BACKEND_KEY, seen.clone()).await,
            dead_redis: free_port(),
            port: free_port(),
            admin_port: free_port(),
            alice_hash,
            bob_hash,
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sluice.toml");
        write_atomically(&path, &setup.config(ADMIN_TOKEN));
        let child = sluice(&["serve", "--config"], &ENV)
            .arg(&path)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id().to_string();
        let run = Run {
            gw: Gateway { child },
            pid,
            setup,
            dir,
            path,
            alice,
            bob,
            c: support::client(),
            t: Transcript::default(),
        };
        run.wait_ready().await;
        run
    }

    /// Ready: both configured backends probed healthy (their health path needs no key).
    async fn wait_ready(&self) {
        poll(Duration::from_secs(20), "gateway ready", || async {
            let r = self
                .c
                .get(self.adm("/admin/backends"))
                .bearer_auth(ADMIN_TOKEN)
                .send()
                .await
                .ok()?;
            let v: serde_json::Value = r.json().await.unwrap_or_default();
            let healthy = v["backends"]
                .as_array()
                .map(|b| b.iter().filter(|b| b["state"] == "healthy").count())
                .unwrap_or(0);
            (healthy == 2).then_some(())
        })
        .await;
    }

    fn api(&self, p: &str) -> String {
        format!("http://127.0.0.1:{}{p}", self.setup.port)
    }

    fn adm(&self, p: &str) -> String {
        format!("http://127.0.0.1:{}{p}", self.setup.admin_port)
    }

    /// A chat request to the client listener.
    fn chat(&self, model: &str, stream: bool, prompt: &str) -> reqwest::RequestBuilder {
        self.c
            .post(self.api("/v1/chat/completions"))
            .json(&chat(model, stream, prompt))
    }

    /// Send `req` and record its response as `what`.
    async fn send(&mut self, what: &str, req: reqwest::RequestBuilder) -> (u16, String) {
        let resp = req.send().await.unwrap();
        self.t.record(what, resp).await
    }

    /// Good requests: JSON with a Bearer key, SSE with x-api-key, the model list.
    async fn good_requests(&mut self) {
        let req = self.chat("m", false, "hi").bearer_auth(&self.alice);
        let (s, _) = self.send("alice chat", req).await;
        assert_eq!(s, 200);
        let req = self.chat("m", true, "hi").header("x-api-key", &self.bob);
        let (s, body) = self.send("bob stream", req).await;
        assert_eq!(s, 200);
        assert!(body.contains("[DONE]"), "{body}");
        for p in ["/v1/models", "/v1/models/m"] {
            let req = self.c.get(self.api(p)).bearer_auth(&self.alice);
            let (s, _) = self.send(p, req).await;
            assert_eq!(s, 200, "{p}");
        }
    }

    /// Wrong keys: nothing, garbage, near-misses of real keys and of the admin token, in every
    /// place a key may be presented. Returns the near-misses tried.
    async fn wrong_keys(&mut self) -> Vec<String> {
        let (alice, bob) = (self.alice.clone(), self.bob.clone());
        let near_misses = vec![
            flip(&alice, alice.len() - 1),
            flip(&alice, "sk-sluice-".len()),
            alice[..alice.len() - 1].to_string(),
            format!("{alice}x"),
            alice.to_uppercase(),
            format!("{}{}", &bob[..20], &bob[21..]),
            flip(&bob, bob.len() / 2),
            ADMIN_TOKEN.to_string(),
            BACKEND_KEY.to_string(),
        ];
        for k in &near_misses {
            let req = self.chat("m", false, "hi").bearer_auth(k);
            let (s, _) = self.send("near-miss bearer", req).await;
            assert_eq!(s, 401, "a near-miss was accepted: {k:?}");
            let req = self.chat("m", true, "hi").header("x-api-key", k);
            let (s, _) = self.send("near-miss x-api-key", req).await;
            assert_eq!(s, 401);
            let basic = format!("Basic {}", base64(format!(":{k}").as_bytes(), false, true));
            let req = self
                .c
                .get(self.api("/v1/models"))
                .header("authorization", basic);
            let (s, _) = self.send("near-miss basic", req).await;
            assert_eq!(s, 401);
        }
        let (s, _) = self.send("no key", self.chat("m", false, "hi")).await;
        assert_eq!(s, 401);
        let admin_misses = [
            flip(ADMIN_TOKEN, ADMIN_TOKEN.len() - 1),
            ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1].to_string(),
            alice.clone(),
        ];
        for k in &admin_misses {
            for p in ["/metrics", "/admin/backends", "/admin/usage", "/dashboard"] {
                let req = self.c.get(self.adm(p)).bearer_auth(k);
                let (s, _) = self.send("admin near-miss", req).await;
                assert_eq!(s, 401, "{p} with a near-miss admin token");
            }
            let req = self.c.get(self.adm("/dashboard")).query(&[("token", k)]);
            let (s, _) = self.send("dashboard ?token= near-miss", req).await;
            assert_eq!(s, 401);
        }
        near_misses.into_iter().chain(admin_misses).collect()
    }

    /// Backend failures that echo the key the gateway sent: a 500, and a backend that refuses
    /// the gateway's (stale) key with a 401.
    async fn backend_failures(&mut self) {
        let req = self
            .chat("m", false, "please-fail")
            .bearer_auth(&self.alice);
        let (s, body) = self.send("backend 500", req).await;
        assert!(s >= 500, "{s} {body}");
        let req = self.chat("m", true, "please-fail").bearer_auth(&self.bob);
        let (s, body) = self.send("backend 500 stream", req).await;
        assert!(s >= 500, "{s} {body}");
        let req = self.chat("m", true, "please-break").bearer_auth(&self.bob);
        let (s, body) = self
            .send("backend error event inside a 200 stream", req)
            .await;
        assert_eq!(s, 200, "{body}");
        assert!(body.contains("worker lost mid-answer"), "{body}");
        let req = self.chat("m2", false, "hi").bearer_auth(&self.alice);
        let (s, body) = self.send("stale backend key", req).await;
        assert_eq!(s, 401, "{body}");
    }

    /// Registration of a backend with its own key (served by `registered`), then the admin
    /// views and the dashboard, and the client listener's answers to admin paths.
    async fn registration_and_admin_views(&mut self, registered: &str) {
        let req = self
            .c
            .post(self.adm("/admin/backends"))
            .bearer_auth(ADMIN_TOKEN)
            .json(
                &serde_json::json!({"name": "reg", "kind": "openai", "url": registered,
                "models": ["m3"], "api_key": REGISTERED_KEY, "health_path": "/ping", "ttl": "60s"}),
            );
        let (s, body) = self.send("register", req).await;
        assert_eq!(s, 201, "{body}");
        let this = tokio::sync::Mutex::new(&mut *self);
        poll(
            Duration::from_secs(10),
            "registered backend served",
            || async {
                let mut run = this.lock().await;
                let req = run.chat("m3", false, "hi").bearer_auth(&run.bob);
                let (s, _) = run.send("registered chat", req).await;
                (s == 200).then_some(())
            },
        )
        .await;
        let req = self
            .c
            .post(self.adm("/admin/backends/reg/heartbeat"))
            .bearer_auth(ADMIN_TOKEN);
        let (s, _) = self.send("heartbeat", req).await;
        assert_eq!(s, 200);
        for p in ADMIN_PAGES {
            let req = self.c.get(self.adm(p)).bearer_auth(ADMIN_TOKEN);
            let (s, _) = self.send(p, req).await;
            assert_eq!(s, 200, "{p}");
        }
        let req = self
            .c
            .get(self.adm("/dashboard"))
            .query(&[("token", ADMIN_TOKEN)]);
        let (s, _) = self.send("dashboard ?token=", req).await;
        assert_eq!(s, 200);
        let req = self
            .c
            .delete(self.adm("/admin/backends/reg"))
            .bearer_auth(ADMIN_TOKEN);
        let (s, _) = self.send("deregister", req).await;
        assert_eq!(s, 204);
        for p in ["/nowhere", "/v1/nowhere", "/metrics", "/admin/backends"] {
            let req = self.c.get(self.api(p)).bearer_auth(&self.alice);
            self.send("client listener", req).await;
        }
    }

    fn signal(&self, sig: &str) {
        assert!(Command::new("kill")
            .args([sig, &self.pid])
            .status()
            .unwrap()
            .success());
    }

    /// A rejected reload (the broken file holds the secrets too), then an applied one that
    /// rotates the admin token.
    async fn reloads(&mut self) {
        let broken = self
            .setup
            .config(ADMIN_TOKEN_2)
            .replace("kind = \"openai\"", "kind = \"opneai\"")
            + &format!("\n[oops]\nsecret = \"{ADMIN_TOKEN_2}\"\n");
        write_atomically(&self.path, &broken);
        self.signal("-HUP");
        write_atomically(&self.path, &self.setup.config(ADMIN_TOKEN_2));
        let this = tokio::sync::Mutex::new(&mut *self);
        poll(
            Duration::from_secs(10),
            "rotated admin token took",
            || async {
                let mut run = this.lock().await;
                run.signal("-HUP");
                let req = run
                    .c
                    .get(run.adm("/admin/backends"))
                    .bearer_auth(ADMIN_TOKEN_2);
                let (s, _) = run.send("after reload", req).await;
                (s == 200).then_some(())
            },
        )
        .await;
        for p in ADMIN_PAGES {
            let req = self.c.get(self.adm(p)).bearer_auth(ADMIN_TOKEN_2);
            self.send(p, req).await;
        }
        let req = self.c.get(self.adm("/metrics")).bearer_auth(ADMIN_TOKEN);
        let (s, _) = self.send("old admin token after rotation", req).await;
        assert_eq!(s, 401);
        let req = self.chat("m", false, "hi").bearer_auth(&self.alice);
        let (s, _) = self.send("alice after reload", req).await;
        assert_eq!(s, 200);
    }

    /// `sluice check` on the good config and on a broken one: what each printed.
    fn check_outputs(&self) -> Vec<(String, String)> {
        let mut outputs: Vec<(String, String)> = Vec::new();
        let bad_path = self.dir.path().join("broken.toml");
        std::fs::write(
            &bad_path,
            self.setup
                .config(ADMIN_TOKEN)
                .replace("redis://", "rediss+bad://")
                .replace("hash = \"sha256:", "hash = \"sha257:")
                .replace("kind = \"openai\"", "kind = \"opneai\"")
                .replace("[[keys]]\nname = \"bob\"", "[[keys]]\nname = \"alice\""),
        )
        .unwrap();
        for (what, p, ok) in [
            ("check good", &self.path, true),
            ("check broken", &bad_path, false),
        ] {
            let out = sluice(&["check", "--config"], &ENV)
                .arg(p)
                .output()
                .unwrap();
            assert_eq!(out.status.success(), ok, "{what}: {out:?}");
            outputs.push((
                what.to_string(),
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            ));
        }
        let broken_check = &outputs[1].1;
        assert!(
            broken_check.contains("redis_url") && broken_check.contains("kind"),
            "the broken config's problems are reported: {broken_check}"
        );
        outputs
    }

    /// Stop (SIGTERM: the graceful path logs too) and collect the logs.
    async fn stop_and_collect_logs(&mut self) -> String {
        self.signal("-TERM");
        let child = &mut self.gw.child;
        eventually(Duration::from_secs(30), "gateway stopped", || {
            let exited = child.try_wait().unwrap().is_some();
            async move { exited }
        })
        .await;
        let logs = output_of(&mut self.gw.child);
        assert!(
            logs.contains("DEBUG") && logs.contains("request"),
            "no debug access log captured: {logs}"
        );
        assert!(logs.contains("reload"), "reloads not logged: {logs}");
        assert!(
            logs.contains("shared limits"),
            "the Redis URL was never used: {logs}"
        );
        logs
    }
}

const ADMIN_PAGES: [&str; 7] = [
    "/metrics",
    "/admin/backends",
    "/admin/usage",
    "/admin/summary",
    "/dashboard",
    "/healthz",
    "/readyz",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_on_any_surface_of_the_binary() {
    let seen = Seen::default();
    let registered = keyed_backend(REGISTERED_KEY, seen.clone()).await;
    let mut run = Run::start(&seen).await;
    run.good_requests().await;
    let misses = run.wrong_keys().await;
    run.backend_failures().await;
    run.registration_and_admin_views(&registered).await;
    run.reloads().await;
    let outputs = run.check_outputs();
    let logs = run.stop_and_collect_logs().await;

    // The secrets were really used: the backends saw the gateway's keys (never a client's).
    let seen = seen.0.lock().unwrap().join("\n");
    assert!(seen.contains(BACKEND_KEY) && seen.contains(WRONG_BACKEND_KEY));
    assert!(seen.contains(REGISTERED_KEY));

    let mut secrets: BTreeMap<String, Vec<String>> = BTreeMap::new();
    secrets.insert("alice's key".into(), forms(&run.alice));
    secrets.insert("bob's key".into(), forms(&run.bob));
    secrets.insert("admin token".into(), forms(ADMIN_TOKEN));
    secrets.insert("rotated admin token".into(), forms(ADMIN_TOKEN_2));
    secrets.insert("backend key".into(), forms(BACKEND_KEY));
    secrets.insert("stale backend key".into(), forms(WRONG_BACKEND_KEY));
    secrets.insert("registered backend key".into(), forms(REGISTERED_KEY));
    secrets.insert("redis password".into(), forms(REDIS_PASSWORD));
    for (i, k) in misses.iter().enumerate() {
        secrets.insert(format!("near-miss #{i}"), forms(k));
    }

    let mut surfaces: Vec<(String, String)> = vec![("logs".into(), logs)];
    surfaces.extend(std::mem::take(&mut run.t.0));
    surfaces.extend(outputs);
    let leaks = leaks(&surfaces, &secrets);
    assert!(leaks.is_empty(), "secrets leaked:\n{}", leaks.join("\n"));

    let client_secrets = [
        "alice's key",
        "bob's key",
        "admin token",
        "rotated admin token",
    ];
    for label in client_secrets {
        assert!(
            !secrets[label].iter().any(|f| seen.contains(f.as_str())),
            "{label} reached a backend"
        );
    }
}

/// Every secret (in any of its forms) found on a surface, shown in its context.
fn leaks(surfaces: &[(String, String)], secrets: &BTreeMap<String, Vec<String>>) -> Vec<String> {
    let mut leaks = Vec::new();
    for (surface, text) in surfaces {
        for (label, forms) in secrets {
            if let Some(f) = forms.iter().find(|f| text.contains(f.as_str())) {
                let at = text.find(f.as_str()).unwrap_or(0);
                let from = text[..at]
                    .char_indices()
                    .rev()
                    .nth(80)
                    .map_or(0, |(i, _)| i);
                let to = (at + f.len() + 40).min(text.len());
                let to = (to..=text.len())
                    .find(|i| text.is_char_boundary(*i))
                    .unwrap_or(text.len());
                leaks.push(format!("{label} in {surface}: …{}…", &text[from..to]));
            }
        }
    }
    leaks
}

fn model_of(req: &serde_json::Value) -> String {
    req["model"].as_str().unwrap_or("m").to_string()
}
