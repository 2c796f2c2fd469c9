//! The HTTP surface: the OpenAI-compatible client API and the operations endpoints.
//!
//! Client API: `POST /v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
//! `/v1/responses`, `GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, the
//! engines' paths (`/tokenize`, `/detokenize`, `/v1/chat/completions/batch`, `/v1/rerank`,
//! `/rerank`, `/v1/score`, `/v1/audio/transcriptions`, `/v1/audio/translations`; see `api`),
//! `GET /v1/models`, `GET /v1/models/{id}`. Operations: `GET /healthz`, `/readyz`, `/metrics`,
//! `/admin/backends`, `/admin/usage`, `/admin/summary`, `/admin/profile`, `/dashboard`. When an admin listener is configured the operations other than
//! `/healthz` and `/readyz` are served only there. Unknown paths get an OpenAI-shaped 404, a
//! wrong method a 405.
//!
//! Invariants: every operations handler takes [`AdminAuth`] (see [`super::admin_auth`]), so
//! operations need the admin token when one is configured, and are refused outright (403) when
//! they share a non-loopback client listener with no token at all;
//! CORS is off unless `server.cors_allow_origins` is set (then only the client API answers
//! preflights and carries `Access-Control-*` headers, for the listed origins only; read from
//! the live config, so a reload applies).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use axum::{Json, Router};
use serde_json::json;

use super::admin_auth::{ops_exposed_without_token, AdminAuth, AdminRefusal};
use crate::api::{self as client_api, ClientApi};
use crate::batch::Batches;
use crate::fleet::{BackendView, Health};
use crate::gateway::Gateway;
use crate::openai::ApiError;
use crate::proxy;
use crate::proxy::stored::Call;
use crate::telemetry::metrics as m;

/// The client-facing router (plus operations, unless `with_ops` is false; plus the Files and
/// Batches APIs when `batches` is given).
pub fn api(gw: Arc<Gateway>, with_ops: bool, batches: Option<Arc<Batches>>) -> Router {
    let mut r = Router::new()
        .route(client_api::CHAT.path(), inference(client_api::CHAT))
        .route(
            client_api::COMPLETIONS.path(),
            inference(client_api::COMPLETIONS),
        )
        .route(
            client_api::EMBEDDINGS.path(),
            inference(client_api::EMBEDDINGS),
        )
        .route(
            client_api::RESPONSES.path(),
            inference(client_api::RESPONSES),
        )
        .route(
            "/v1/responses/{id}",
            stored(client_api::RESPONSES, Call::Get)
                .merge(stored(client_api::RESPONSES, Call::Delete)),
        )
        .route(
            "/v1/responses/{id}/cancel",
            stored(client_api::RESPONSES, Call::Cancel),
        )
        .route(client_api::TOKENIZE.path(), inference(client_api::TOKENIZE))
        .route(
            client_api::DETOKENIZE.path(),
            inference(client_api::DETOKENIZE),
        )
        .route(
            client_api::CHAT_BATCH.path(),
            inference(client_api::CHAT_BATCH),
        )
        .route(
            client_api::RERANK_V1.path(),
            inference(client_api::RERANK_V1),
        )
        .route(client_api::RERANK.path(), inference(client_api::RERANK))
        .route(client_api::SCORE.path(), inference(client_api::SCORE))
        .route(
            client_api::AUDIO_TRANSCRIPTIONS.path(),
            inference(client_api::AUDIO_TRANSCRIPTIONS),
        )
        .route(
            client_api::AUDIO_TRANSLATIONS.path(),
            inference(client_api::AUDIO_TRANSLATIONS),
        )
        .route(client_api::MESSAGES.path(), inference(client_api::MESSAGES))
        .route(
            client_api::COUNT_TOKENS.path(),
            inference(client_api::COUNT_TOKENS),
        )
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*id}", get(get_model))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz));
    if let Some(b) = batches {
        r = r.merge(batch_routes(b));
    }
    if with_ops {
        let rt = gw.runtime();
        if ops_exposed_without_token(&rt.config) {
            tracing::warn!(
                listen = %rt.config.server.listen,
                "operations endpoints (/metrics, /admin, /dashboard) are refused: the client \
                 listener is not loopback and no [admin] token is configured"
            );
        }
        r = r.merge(ops_routes());
    }
    let r = r
        .fallback(passthrough_or_not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(gw.clone(), cors));
    finish(r, gw)
}

/// Response headers a browser page may read (request id, rate limits, retry hints).
const CORS_EXPOSE: &str = "x-request-id, retry-after, retry-after-ms, x-ratelimit-limit-requests, \
    x-ratelimit-remaining-requests, x-ratelimit-reset-requests, x-ratelimit-limit-tokens, \
    x-ratelimit-remaining-tokens, x-ratelimit-reset-tokens";

/// CORS for the configured origins only. With none configured this layer does nothing: no
/// `Access-Control-*` header, and a preflight `OPTIONS` gets the router's 405 as any other
/// unsupported method. A preflight from a listed origin is answered here (204) without
/// authentication, as browsers send it without credentials; the actual request is then
/// authenticated as usual. Only `Authorization`-header keys are used, never cookies, so
/// `Access-Control-Allow-Credentials` is never sent.
async fn cors(
    State(gw): State<Arc<Gateway>>,
    req: Request<Body>,
    next: axum::middleware::Next,
) -> Response {
    use http::HeaderValue;
    if !req.uri().path().starts_with("/v1/") {
        return next.run(req).await;
    }
    let allowed = {
        let rt = gw.runtime();
        let origins = &rt.config.server.cors_allow_origins;
        match req.headers().get(header::ORIGIN) {
            _ if origins.is_empty() => None,
            None => None,
            Some(o) if origins.iter().any(|a| a == "*") => {
                Some((HeaderValue::from_static("*"), false)).filter(|_| !o.is_empty())
            }
            Some(o) => o
                .to_str()
                .ok()
                .filter(|o| origins.iter().any(|a| a.eq_ignore_ascii_case(o)))
                .map(|_| (o.clone(), true)),
        }
    };
    let Some((origin, vary)) = allowed else {
        return next.run(req).await;
    };
    let preflight = req.method() == http::Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        let mut resp = StatusCode::NO_CONTENT.into_response();
        let h = resp.headers_mut();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, DELETE, OPTIONS"),
        );
        // SDKs send many headers of their own (x-stainless-*, openai-*): allow what the
        // browser asks for; the origin is what is restricted.
        if let Some(asked) = req.headers().get(header::ACCESS_CONTROL_REQUEST_HEADERS) {
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
        }
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        h.insert(
            header::VARY,
            HeaderValue::from_static(
                "origin, access-control-request-method, access-control-request-headers",
            ),
        );
        return resp;
    }
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static(CORS_EXPOSE),
    );
    if vary {
        h.append(header::VARY, HeaderValue::from_static("origin"));
    }
    resp
}

/// The admin listener's router: operations only.
pub fn admin(gw: Arc<Gateway>) -> Router {
    let r = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .merge(ops_routes());
    finish(fallbacks(r), gw)
}

fn ops_routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/metrics", get(metrics))
        .route(
            "/admin/backends",
            get(admin_backends).post(register_backend),
        )
        .route(
            "/admin/backends/{name}",
            axum::routing::delete(deregister_backend),
        )
        .route("/admin/backends/{name}/heartbeat", post(heartbeat_backend))
        .route("/admin/usage", get(admin_usage))
        .route("/admin/summary", get(admin_summary))
        .route("/admin/profile", get(admin_profile))
        .route("/dashboard", get(dashboard))
}

/// OpenAI-shaped answers for unknown paths (404) and wrong methods (405).
fn fallbacks(r: Router<Arc<Gateway>>) -> Router<Arc<Gateway>> {
    r.fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
}

/// The state every handler reads. The request id, framing check and panic barrier are the
/// connection service's ([`super::guard`]), not layers here.
fn finish(r: Router<Arc<Gateway>>, gw: Arc<Gateway>) -> Router {
    r.with_state(gw)
}

/// The route of one client API: `POST` its path through the request path.
fn inference(api: &'static dyn ClientApi) -> MethodRouter<Arc<Gateway>> {
    post(move |State(gw): State<Arc<Gateway>>, req: Request<Body>| proxy::handle(gw, api, req))
}

/// `/v1/files` and `/v1/batches` ([`crate::batch::http`]).
fn batch_routes(b: Arc<Batches>) -> Router<Arc<Gateway>> {
    use crate::batch::http::{batches, files, Ctx};
    let ctx = move |b: &Arc<Batches>, gw: Arc<Gateway>| Ctx {
        batches: b.clone(),
        gw,
    };
    macro_rules! plain {
        ($f:path) => {{
            let b = b.clone();
            move |State(gw): State<Arc<Gateway>>, req: Request<Body>| $f(ctx(&b, gw), req)
        }};
    }
    macro_rules! with_id {
        ($f:path) => {{
            let b = b.clone();
            move |State(gw): State<Arc<Gateway>>, Path(id): Path<String>, req: Request<Body>| {
                $f(ctx(&b, gw), id, req)
            }
        }};
    }
    Router::new()
        .route(
            "/v1/files",
            post(plain!(files::create)).get(plain!(files::list)),
        )
        .route(
            "/v1/files/{id}",
            get(with_id!(files::retrieve)).delete(with_id!(files::delete)),
        )
        .route("/v1/files/{id}/content", get(with_id!(files::content)))
        .route(
            "/v1/batches",
            post(plain!(batches::create)).get(plain!(batches::list)),
        )
        .route("/v1/batches/{id}", get(with_id!(batches::retrieve)))
        .route("/v1/batches/{id}/cancel", post(with_id!(batches::cancel)))
}

/// One call on a stored object of `api`, sent to the backend its id names.
fn stored(api: &'static dyn ClientApi, call: Call) -> MethodRouter<Arc<Gateway>> {
    let handler = move |State(gw): State<Arc<Gateway>>, Path(id): Path<String>, req| {
        proxy::stored::handle(gw, api, call, id, req)
    };
    match call {
        Call::Get => get(handler),
        Call::Delete => axum::routing::delete(handler),
        Call::Cancel => post(handler),
    }
}

/// A path no route serves: forwarded when a `[[passthrough]]` rule names it, else the 404.
async fn passthrough_or_not_found(State(gw): State<Arc<Gateway>>, req: Request<Body>) -> Response {
    let named = proxy::passthrough::rule_for(&gw.runtime().config, req.uri().path()).is_some();
    if named {
        proxy::passthrough::handle(gw, req).await
    } else {
        ApiError::not_found_path(req.uri().path()).into_response()
    }
}

async fn not_found(uri: Uri) -> Response {
    ApiError::not_found_path(uri.path()).into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::method_not_allowed().into_response()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn list_models(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    let rt = gw.runtime();
    let identity = match rt.keys.authenticate(&headers) {
        Ok(i) => i,
        Err(e) => return e.into_response(),
    };
    let created = unix_now();
    let data: Vec<_> = rt
        .fleet
        .models()
        .into_iter()
        .filter(|m| identity.allows(&rt.fleet, &m.id))
        .map(|m| model_json(&m, created))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn get_model(
    State(gw): State<Arc<Gateway>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let rt = gw.runtime();
    let identity = match rt.keys.authenticate(&headers) {
        Ok(i) => i,
        Err(e) => return e.into_response(),
    };
    let found = rt
        .fleet
        .models()
        .into_iter()
        .find(|m| m.id == id && identity.allows(&rt.fleet, &m.id));
    match found {
        Some(m) => Json(model_json(&m, unix_now())).into_response(),
        None => ApiError::model_not_found(&id).into_response(),
    }
}

/// One model of `/v1/models`: OpenAI's shape, plus vLLM's `max_model_len` when a backend
/// reports the model's context length, and vLLM's `parent` (the base model) for an adapter.
fn model_json(m: &crate::fleet::snapshot::ModelEntry, created: u64) -> serde_json::Value {
    let mut v = json!({"id": m.id, "object": "model", "created": created, "owned_by": m.owned_by});
    if let Some(len) = m.context_length {
        v["max_model_len"] = json!(len);
    }
    if let Some(parent) = &m.parent {
        v["parent"] = json!(parent);
    }
    v
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(gw): State<Arc<Gateway>>) -> Response {
    if gw.is_ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else if !gw.accepting() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no backend available\n").into_response()
    }
}

async fn metrics(State(gw): State<Arc<Gateway>>, _: AdminAuth) -> Response {
    let rt = gw.runtime();
    for b in &rt.fleet.backends {
        backend_gauges(b.view(rt.config.health.slow_start));
    }
    adapter_gauges(&rt.fleet);
    let body = m::handle().render();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

/// The per-backend gauges, set from the backend's view when `/metrics` is scraped.
fn backend_gauges(v: BackendView) {
    let name = v.name;
    metrics::gauge!(m::BACKEND_INFLIGHT_REQUESTS, "backend" => name.clone())
        .set(v.inflight_requests as f64);
    metrics::gauge!(m::BACKEND_INFLIGHT_TOKENS, "backend" => name.clone())
        .set(v.inflight_tokens as f64);
    metrics::gauge!(m::BACKEND_PENDING_PREFILL_REQUESTS, "backend" => name.clone())
        .set(v.pending_prefill_requests as f64);
    metrics::gauge!(m::BACKEND_PENDING_PREFILL_TOKENS, "backend" => name.clone())
        .set(v.pending_prefill_tokens as f64);
    metrics::counter!(m::EJECTIONS_TOTAL, "backend" => name.clone())
        .absolute(u64::from(v.ejections));
    if let Some(cap) = v.max_concurrent {
        metrics::gauge!(m::BACKEND_MAX_CONCURRENT, "backend" => name.clone()).set(cap as f64);
    }
    metrics::gauge!(m::BACKEND_SLOW_START_SHARE, "backend" => name.clone()).set(v.slow_start_share);
    for h in Health::ALL {
        metrics::gauge!(m::BACKEND_STATE, "backend" => name.clone(), "state" => h.as_str())
            .set(if h == v.health { 1.0 } else { 0.0 });
    }
    kv_gauges(&name, &v.kv_cache);
}

/// `sluice_adapter_info{adapter,base} 1` for each adapter the fleet serves now (0 for one it
/// served before and no longer does), so the per-model series of adapters add up per base model
/// in a query (`* on(model) group_left(base)`, after renaming `adapter` to `model`).
fn adapter_gauges(fleet: &crate::fleet::Fleet) {
    // (the metrics registry is the process's, so what was set before is too)
    static SEEN: std::sync::Mutex<Vec<[String; 2]>> = std::sync::Mutex::new(Vec::new());
    let mut now: Vec<[String; 2]> = fleet
        .models()
        .into_iter()
        .filter_map(|e| Some([e.id, e.parent?]))
        .collect();
    now.sort();
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    for [adapter, base] in seen.iter().filter(|p| !now.contains(p)) {
        metrics::gauge!(m::ADAPTER_INFO, "adapter" => adapter.clone(), "base" => base.clone())
            .set(0.0);
    }
    for [adapter, base] in &now {
        metrics::gauge!(m::ADAPTER_INFO, "adapter" => adapter.clone(), "base" => base.clone())
            .set(1.0);
    }
    *seen = now;
}

/// A vLLM backend's KV-index gauges (nothing for backends whose events are off).
fn kv_gauges(name: &str, kv: &crate::fleet::kv::KvView) {
    use crate::fleet::kv::Status;
    if kv.status == Status::Off {
        return;
    }
    metrics::gauge!(m::KV_INDEX_BLOCKS, "backend" => name.to_string()).set(kv.blocks as f64);
    if let Some(lag) = kv.lag_seconds {
        metrics::gauge!(m::KV_EVENT_LAG_SECONDS, "backend" => name.to_string()).set(lag);
    }
    for s in Status::ALL {
        metrics::gauge!(m::KV_STATUS, "backend" => name.to_string(), "status" => s.as_str())
            .set(if s == kv.status { 1.0 } else { 0.0 });
    }
}

/// The fleet, gateway totals and tenants' usage against their limits (the dashboard's data).
async fn admin_summary(State(gw): State<Arc<Gateway>>, _: AdminAuth) -> Response {
    Json(super::dashboard::summary(&gw)).into_response()
}

/// The status page; the admin token may come as a Bearer header or as `?token=`.
async fn dashboard(auth: Result<AdminAuth, AdminRefusal>, uri: Uri) -> Response {
    let presented = super::dashboard::query_token(uri.query());
    match auth.or_else(|refused| refused.or_query_token(&presented)) {
        Ok(_) => super::dashboard::page(),
        Err(refused) => refused.into_response(),
    }
}

/// Usage per key, tenant, model and backend since the process started (survives reloads).
async fn admin_usage(State(gw): State<Arc<Gateway>>, _: AdminAuth) -> Response {
    Json(gw.limits.usage_report()).into_response()
}

/// One entry of `/admin/backends`: the backend's view, and what the gateway knows of it.
#[derive(serde::Serialize)]
struct AdminBackend {
    #[serde(flatten)]
    view: BackendView,
    routing: serde_json::Value,
    source: &'static str,
    registration: Option<serde_json::Value>,
}

async fn admin_backends(State(gw): State<Arc<Gateway>>, _: AdminAuth) -> Response {
    let rt = gw.runtime();
    let backends: Vec<_> = rt
        .fleet
        .backends
        .iter()
        .map(|b| AdminBackend {
            view: b.view(rt.config.health.slow_start),
            routing: crate::routing::score::admin_view(b),
            source: member_source(&gw, &rt, b.name()),
            registration: gw.registrations.info(b.name()).map(|r| {
                json!({
                    "ttl_ms": r.ttl.as_millis() as u64,
                    "expires_in_ms": r.expires_in.as_millis() as u64,
                })
            }),
        })
        .collect();
    // Through a JSON value, as always: its keys come out sorted.
    Json(json!({ "backends": backends, "queue_depth": gw.queue.len() })).into_response()
}

/// `GET /admin/profile`: each measured backend's learned speeds and limits, the profile
/// `sluice plan` reads for measured servers (docs/capacity-planning.md).
async fn admin_profile(State(gw): State<Arc<Gateway>>, _: AdminAuth) -> Response {
    let rt = gw.runtime();
    let backends: Vec<serde_json::Value> = rt
        .fleet
        .backends
        .iter()
        .filter_map(|b| crate::routing::score::profile_view(b))
        .collect();
    Json(json!({ "backends": backends })).into_response()
}

/// Where a fleet member comes from: `config`, `registration` or `dns`.
fn member_source(gw: &Gateway, rt: &crate::gateway::Runtime, name: &str) -> &'static str {
    if rt.config.backends.iter().any(|b| b.name == name) {
        "config"
    } else if gw.registrations.info(name).is_some() {
        "registration"
    } else {
        "dns"
    }
}

/// `POST /admin/backends`: register (or re-register) a backend with a TTL.
async fn register_backend(
    State(gw): State<Arc<Gateway>>,
    _: AdminAuth,
    body: axum::body::Bytes,
) -> Response {
    use crate::fleet::registration::{RegisterError, RegisterRequest};
    let req: RegisterRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return ApiError::bad_request(format!("Invalid registration: {e}")).into_response()
        }
    };
    let rt = gw.runtime();
    let (config, ttl) = match req.validate(&rt.config) {
        Ok(v) => v,
        Err(e @ RegisterError::Conflict(_)) => {
            return ApiError::new(StatusCode::CONFLICT, "invalid_request_error", e.to_string())
                .with_code("backend_name_taken")
                .into_response()
        }
        Err(e) => return ApiError::bad_request(e.to_string()).into_response(),
    };
    let name = config.name.clone();
    let changed = gw.registrations.register(config, ttl);
    if changed {
        metrics::counter!(m::MEMBERSHIP_CHANGES_TOTAL, "source" => "registration").increment(1);
        tracing::info!(backend = %name, ttl_ms = ttl.as_millis() as u64, "backend registered");
        gw.rebuild();
    }
    let status = if changed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    (
        status,
        Json(json!({"name": name, "ttl_ms": ttl.as_millis() as u64})),
    )
        .into_response()
}

/// `POST /admin/backends/{name}/heartbeat`: extend a registration by its TTL.
async fn heartbeat_backend(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    _: AdminAuth,
) -> Response {
    match gw.registrations.heartbeat(&name) {
        Some(ttl) => Json(json!({"name": name, "ttl_ms": ttl.as_millis() as u64})).into_response(),
        None => not_registered(&name),
    }
}

/// `DELETE /admin/backends/{name}`: deregister; the backend drains (in-flight requests finish).
async fn deregister_backend(
    State(gw): State<Arc<Gateway>>,
    Path(name): Path<String>,
    _: AdminAuth,
) -> Response {
    if !gw.registrations.deregister(&name) {
        return not_registered(&name);
    }
    metrics::counter!(m::MEMBERSHIP_CHANGES_TOTAL, "source" => "deregistration").increment(1);
    tracing::info!(backend = %name, "backend deregistered; draining");
    gw.rebuild();
    StatusCode::NO_CONTENT.into_response()
}

fn not_registered(name: &str) -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("No registered backend named `{name}` (it may have expired; register again)."),
    )
    .with_code("backend_not_registered")
    .into_response()
}
