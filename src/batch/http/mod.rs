//! The HTTP side of the Files and Batches APIs: each handler authenticates the caller as any
//! client request, reads what it needs, and answers in OpenAI's shapes ([`files`],
//! [`batches`]).
//!
//! Invariants: files and batches are seen only by the tenant that created them (another
//! tenant's id is answered as an unknown one); every failure is an OpenAI error body.

pub mod batches;
pub mod files;

use std::sync::Arc;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, Request, StatusCode};
use serde_json::Value;

use super::record::{BatchRecord, FileMeta};
use super::{BatchError, Batches};
use crate::auth::Identity;
use crate::gateway::Gateway;
use crate::openai::ApiError;

/// The caller's identity, as for any client request.
fn caller(gw: &Gateway, headers: &http::HeaderMap) -> Result<Identity, ApiError> {
    gw.runtime().keys.authenticate(headers)
}

/// A JSON answer.
fn json(v: &Value) -> Response {
    let mut r = Response::new(Body::from(v.to_string()));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}

/// The answer of a handler.
fn answer(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(IntoResponse::into_response)
}

/// OpenAI's 404 for an unknown object of `kind` (`File`, `Batch`).
fn no_such(kind: &str, id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        format!("No such {kind} object: {id}"),
    )
    .with_param("id")
}

/// A failure of the store or the disk: a 500 that names no path.
fn internal(e: BatchError) -> ApiError {
    tracing::error!(error = %e, "batch storage");
    ApiError::internal("The batch store failed; please retry.")
}

/// An OpenAI list page of `items` (already in order and after the cursor).
fn page(items: Vec<Value>, has_more: bool) -> Value {
    let first = items.first().and_then(|v| v.get("id")).cloned();
    let last = items.last().and_then(|v| v.get("id")).cloned();
    serde_json::json!({
        "object": "list",
        "data": items,
        "first_id": first,
        "last_id": last,
        "has_more": has_more,
    })
}

/// The items after the one whose id is `after` (all when `None` or unknown), at most `limit`,
/// and whether more follow.
fn after_cursor<T>(
    items: Vec<T>,
    id: impl Fn(&T) -> &str,
    after: Option<&str>,
    limit: usize,
) -> (Vec<T>, bool) {
    let start = after
        .and_then(|a| items.iter().position(|t| id(t) == a).map(|i| i + 1))
        .unwrap_or(0);
    let mut rest: Vec<T> = items.into_iter().skip(start).collect();
    let more = rest.len() > limit;
    rest.truncate(limit);
    (rest, more)
}

/// `limit` of a list query: `default` when absent, else within `1..=max`.
fn limit(v: Option<i64>, default: usize, max: usize) -> Result<usize, ApiError> {
    match v {
        None => Ok(default),
        Some(n) if n >= 1 && n as u64 <= max as u64 => Ok(n as usize),
        Some(n) => Err(ApiError::bad_request(format!(
            "Invalid limit {n}: it must be between 1 and {max}."
        ))
        .with_param("limit")),
    }
}

/// A record that belongs to a tenant, read by id: a file or a batch.
trait Owned: Sized + Send + 'static {
    /// Its name in OpenAI's 404 (`No such File object`).
    const KIND: &'static str;
    fn load(b: &Batches, id: &str) -> Result<Option<Self>, BatchError>;
    fn tenant(&self) -> &str;
    /// OpenAI's object.
    fn wire(&self) -> Value;
}

impl Owned for FileMeta {
    const KIND: &'static str = "File";
    fn load(b: &Batches, id: &str) -> Result<Option<Self>, BatchError> {
        b.jobs.file(id)
    }
    fn tenant(&self) -> &str {
        FileMeta::tenant(self)
    }
    fn wire(&self) -> Value {
        FileMeta::wire(self)
    }
}

impl Owned for BatchRecord {
    const KIND: &'static str = "Batch";
    fn load(b: &Batches, id: &str) -> Result<Option<Self>, BatchError> {
        b.jobs.batch(id)
    }
    fn tenant(&self) -> &str {
        BatchRecord::tenant(self)
    }
    fn wire(&self) -> Value {
        BatchRecord::wire(self)
    }
}

/// The caller's record `id`, or OpenAI's 404 (another tenant's too, as an unknown id).
async fn owned<T: Owned>(ctx: &Ctx, tenant: &str, id: &str) -> Result<T, ApiError> {
    let key = id.to_string();
    ctx.batches
        .blocking(move |b| T::load(b, &key))
        .await
        .map_err(internal)?
        .filter(|r| r.tenant() == tenant)
        .ok_or_else(|| no_such(T::KIND, id))
}

/// `GET /v1/files/{id}`, `GET /v1/batches/{id}`: the caller's record in OpenAI's shape.
async fn retrieve<T: Owned>(ctx: Ctx, id: String, req: Request<Body>) -> Response {
    answer(
        async move {
            let who = caller(&ctx.gw, req.headers())?;
            Ok(json(&owned::<T>(&ctx, &who.tenant, &id).await?.wire()))
        }
        .await,
    )
}

/// Shared state of every handler.
pub struct Ctx {
    pub batches: Arc<Batches>,
    pub gw: Arc<Gateway>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_follow_the_cursor() {
        let ids = vec!["a", "b", "c", "d"];
        let (p, more) = after_cursor(ids.clone(), |s| s, None, 2);
        assert_eq!((p, more), (vec!["a", "b"], true));
        let (p, more) = after_cursor(ids.clone(), |s| s, Some("b"), 2);
        assert_eq!((p, more), (vec!["c", "d"], false));
        let (p, more) = after_cursor(ids, |s| s, Some("d"), 2);
        assert_eq!((p, more), (Vec::<&str>::new(), false));
        assert!(limit(Some(0), 20, 100).is_err());
        assert_eq!(limit(None, 20, 100).unwrap(), 20);
    }
}
