//! `/v1/batches`: create, list, retrieve, cancel.

use axum::body::Body;
use axum::extract::Query;
use axum::response::Response;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{after_cursor, answer, caller, internal, json, limit, no_such, owned, Ctx};
use crate::batch::record::BatchRecord;
use crate::openai::ApiError;

/// The endpoints a batch's lines may name.
pub const ENDPOINTS: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
];

/// Largest `POST /v1/batches` body.
const MAX_CREATE_BODY: usize = 256 * 1024;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Create {
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    metadata: Option<Map<String, Value>>,
    /// Accepted for the SDK's sake; output files are kept until deleted.
    #[allow(dead_code)]
    output_expires_after: Option<Value>,
}

/// `POST /v1/batches`.
pub async fn create(ctx: Ctx, req: Request<Body>) -> Response {
    answer(create_inner(ctx, req).await)
}

async fn create_inner(ctx: Ctx, req: Request<Body>) -> Result<Response, ApiError> {
    let who = caller(&ctx.gw, req.headers())?;
    let body = match Limited::new(req.into_body(), MAX_CREATE_BODY)
        .collect()
        .await
    {
        Ok(c) => c.to_bytes(),
        Err(_) => return Err(ApiError::payload_too_large(MAX_CREATE_BODY)),
    };
    let c: Create = serde_json::from_slice(&body).map_err(ApiError::invalid_json)?;
    check(&c)?;
    let file_id = c.input_file_id.clone();
    let file = ctx
        .batches
        .blocking(move |b| b.jobs.file(&file_id))
        .await
        .map_err(internal)?
        .filter(|f| f.tenant() == who.tenant)
        .ok_or_else(|| no_such("File", &c.input_file_id).with_param("input_file_id"))?;
    if file.purpose() != "batch" {
        return Err(ApiError::bad_request(format!(
            "The input file {} was not uploaded with the purpose 'batch'.",
            file.id()
        ))
        .with_param("input_file_id")
        .with_code("invalid_value"));
    }
    let record = BatchRecord::new(
        &who.tenant,
        &who.key,
        file.id(),
        &c.endpoint,
        c.metadata.map(Value::Object),
    );
    let saved = record.clone();
    ctx.batches
        .blocking(move |b| b.jobs.put_batch(&saved))
        .await
        .map_err(internal)?;
    ctx.batches.wake.notify_one();
    metrics::counter!(crate::telemetry::metrics::BATCHES_CREATED_TOTAL).increment(1);
    Ok(json(&record.wire()))
}

/// What OpenAI checks of a new batch before it looks at the file.
fn check(c: &Create) -> Result<(), ApiError> {
    let invalid = |param: &str, message: String| {
        ApiError::bad_request(message)
            .with_param(param)
            .with_code("invalid_value")
    };
    if !ENDPOINTS.contains(&c.endpoint.as_str()) {
        return Err(invalid(
            "endpoint",
            format!(
                "Invalid endpoint '{}': batches here run {}.",
                c.endpoint,
                ENDPOINTS.join(", ")
            ),
        ));
    }
    if c.completion_window != "24h" {
        return Err(invalid(
            "completion_window",
            format!(
                "Invalid completion_window '{}': only '24h' is supported.",
                c.completion_window
            ),
        ));
    }
    if let Some(m) = &c.metadata {
        let bad = m.len() > 16
            || m.iter().any(|(k, v)| {
                k.chars().count() > 64 || v.as_str().is_none_or(|s| s.chars().count() > 512)
            });
        if bad {
            return Err(invalid(
                "metadata",
                "metadata holds at most 16 string values, keys up to 64 characters and values \
                 up to 512."
                    .into(),
            ));
        }
    }
    Ok(())
}

#[derive(Deserialize)]
struct ListQuery {
    after: Option<String>,
    limit: Option<i64>,
}

/// `GET /v1/batches`: the tenant's batches, newest first.
pub async fn list(ctx: Ctx, req: Request<Body>) -> Response {
    answer(
        async move {
            let who = caller(&ctx.gw, req.headers())?;
            let q = Query::<ListQuery>::try_from_uri(req.uri())
                .map_err(|e| ApiError::bad_request(format!("Invalid query: {e}.")))?
                .0;
            let limit = limit(q.limit, 20, 100)?;
            let mut all = ctx
                .batches
                .blocking(|b| b.jobs.batches())
                .await
                .map_err(internal)?;
            all.retain(|b| b.tenant() == who.tenant);
            all.sort_by(|a, b| (b.created_at(), b.id()).cmp(&(a.created_at(), a.id())));
            let (items, more) = after_cursor(all, |b| b.id(), q.after.as_deref(), limit);
            Ok(json(&super::page(
                items.iter().map(BatchRecord::wire).collect(),
                more,
            )))
        }
        .await,
    )
}

/// `GET /v1/batches/{id}`.
pub async fn retrieve(ctx: Ctx, id: String, req: Request<Body>) -> Response {
    super::retrieve::<BatchRecord>(ctx, id, req).await
}

/// `POST /v1/batches/{id}/cancel`: `cancelling` until the lines in flight are done, then
/// `cancelled` with the results so far; 409 for a batch that has finished.
pub async fn cancel(ctx: Ctx, id: String, req: Request<Body>) -> Response {
    answer(
        async move {
            let who = caller(&ctx.gw, req.headers())?;
            owned::<BatchRecord>(&ctx, &who.tenant, &id).await?;
            let key = id.clone();
            let (record, ok) = ctx
                .batches
                .blocking(move |b| b.jobs.cancel(&key))
                .await
                .map_err(internal)?
                .ok_or_else(|| no_such("Batch", &id))?;
            if !ok {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "invalid_request_error",
                    format!(
                        "Cannot cancel a batch with status '{}'.",
                        record.status().name()
                    ),
                ));
            }
            ctx.batches.wake.notify_one();
            Ok(json(&record.wire()))
        }
        .await,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create(endpoint: &str, window: &str, metadata: Option<Value>) -> Create {
        Create {
            input_file_id: "file-1".into(),
            endpoint: endpoint.into(),
            completion_window: window.into(),
            metadata: metadata.and_then(|m| m.as_object().cloned()),
            output_expires_after: None,
        }
    }

    #[test]
    fn endpoints_windows_and_metadata_are_checked() {
        assert!(check(&create("/v1/embeddings", "24h", None)).is_ok());
        let e = check(&create("/v1/moderations", "24h", None)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("endpoint"));
        let e = check(&create("/v1/completions", "1h", None)).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("completion_window"));
        let e = check(&create(
            "/v1/completions",
            "24h",
            Some(serde_json::json!({"k": 1})),
        ))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("metadata"));
        assert!(check(&create(
            "/v1/completions",
            "24h",
            Some(serde_json::json!({"k": "v"}))
        ))
        .is_ok());
    }
}
