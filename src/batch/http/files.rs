//! `/v1/files`: upload (multipart, purpose `batch`), list, retrieve, content, delete.

use axum::body::Body;
use axum::extract::Query;
use axum::response::Response;
use http::{header, HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde::Deserialize;

use super::{after_cursor, answer, caller, internal, json, limit, no_such, owned, page, Ctx};
use crate::api::multipart;
use crate::batch::record::{new_id, FileMeta};
use crate::batch::BatchError;
use crate::openai::ApiError;

/// The purposes OpenAI knows; only `batch` is stored here.
const PURPOSES: &[&str] = &[
    "assistants",
    "batch",
    "fine-tune",
    "vision",
    "user_data",
    "evals",
];

/// Room for the multipart framing and the other fields around the file.
const FORM_OVERHEAD: usize = 64 * 1024;

/// `POST /v1/files`.
pub async fn create(ctx: Ctx, req: Request<Body>) -> Response {
    answer(create_inner(ctx, req).await)
}

async fn create_inner(ctx: Ctx, req: Request<Body>) -> Result<Response, ApiError> {
    let who = caller(&ctx.gw, req.headers())?;
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let boundary = multipart::boundary(ct).map(str::to_string).map_err(|e| {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            format!("Expected a multipart/form-data body: {e}."),
        )
        .with_code("unsupported_media_type")
    })?;
    let max = ctx.batches.config().max_file_bytes;
    let body = read_capped(req.into_body(), max.saturating_add(FORM_OVERHEAD), max).await?;
    let malformed =
        |e: multipart::FormError| ApiError::bad_request(format!("Malformed form: {e}."));
    let purpose = multipart::field_span(&body, &boundary, "purpose")
        .map_err(malformed)?
        .and_then(|r| body.get(r))
        .map(|v| String::from_utf8_lossy(v).trim().to_string());
    check_purpose(purpose.as_deref())?;
    let span = multipart::field_span(&body, &boundary, "file")
        .map_err(malformed)?
        .ok_or_else(|| {
            ApiError::bad_request("Missing required parameter: 'file'.").with_param("file")
        })?;
    if span.len() > max {
        return Err(ApiError::payload_too_large(max));
    }
    let filename = multipart::field_filename(&body, &boundary, "file")
        .map_err(malformed)?
        .unwrap_or_else(|| "upload.jsonl".into());
    let id = new_id("file-");
    let meta = FileMeta::new(
        id.clone(),
        span.len() as u64,
        filename,
        "batch",
        &who.tenant,
    );
    let saved = meta.clone();
    ctx.batches
        .blocking(move |b| {
            let content = body.get(span).unwrap_or_default();
            b.blobs.write(&id, [content])?;
            b.jobs.put_file(&saved)
        })
        .await
        .map_err(internal)?;
    Ok(json(&meta.wire()))
}

/// The body, at most `cap` bytes (413 naming `limit`, the file's own limit, beyond).
async fn read_capped(body: Body, cap: usize, limit: usize) -> Result<bytes::Bytes, ApiError> {
    match Limited::new(body, cap).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e)
            if e.downcast_ref::<http_body_util::LengthLimitError>()
                .is_some() =>
        {
            Err(ApiError::payload_too_large(limit))
        }
        Err(e) => Err(ApiError::bad_request(format!(
            "Could not read the request body: {e}"
        ))),
    }
}

/// `batch` passes; another purpose OpenAI knows is refused as not served here, an unknown one
/// as OpenAI refuses it.
fn check_purpose(purpose: Option<&str>) -> Result<(), ApiError> {
    match purpose {
        Some("batch") => Ok(()),
        None => Err(
            ApiError::bad_request("Missing required parameter: 'purpose'.").with_param("purpose"),
        ),
        Some(p) if PURPOSES.contains(&p) => Err(ApiError::bad_request(format!(
            "This server stores files for the purpose 'batch' only, not '{p}'."
        ))
        .with_param("purpose")
        .with_code("invalid_value")),
        Some(p) => Err(ApiError::bad_request(format!(
            "'{p}' is not one of {PURPOSES:?} - 'purpose'"
        ))
        .with_param("purpose")
        .with_code("invalid_value")),
    }
}

#[derive(Deserialize)]
struct ListQuery {
    after: Option<String>,
    limit: Option<i64>,
    order: Option<String>,
    purpose: Option<String>,
}

/// `GET /v1/files`: the tenant's files, newest first unless `order=asc`.
pub async fn list(ctx: Ctx, req: Request<Body>) -> Response {
    answer(list_inner(ctx, req).await)
}

async fn list_inner(ctx: Ctx, req: Request<Body>) -> Result<Response, ApiError> {
    let who = caller(&ctx.gw, req.headers())?;
    let q = Query::<ListQuery>::try_from_uri(req.uri())
        .map_err(|e| ApiError::bad_request(format!("Invalid query: {e}.")))?
        .0;
    let limit = limit(q.limit, 10_000, 10_000)?;
    let asc = match q.order.as_deref() {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(o) => {
            return Err(ApiError::bad_request(format!(
                "Invalid order '{o}': expected 'asc' or 'desc'."
            ))
            .with_param("order"))
        }
    };
    let mut files = ctx
        .batches
        .blocking(|b| b.jobs.files())
        .await
        .map_err(internal)?;
    files.retain(|f| {
        f.tenant() == who.tenant && q.purpose.as_deref().is_none_or(|p| p == f.purpose())
    });
    files.sort_by(|a, b| (a.created_at(), a.id()).cmp(&(b.created_at(), b.id())));
    if !asc {
        files.reverse();
    }
    let (files, more) = after_cursor(files, |f| f.id(), q.after.as_deref(), limit);
    Ok(json(&page(
        files.iter().map(FileMeta::wire).collect(),
        more,
    )))
}

/// `GET /v1/files/{id}`.
pub async fn retrieve(ctx: Ctx, id: String, req: Request<Body>) -> Response {
    super::retrieve::<FileMeta>(ctx, id, req).await
}

/// `GET /v1/files/{id}/content`: the bytes as uploaded or written.
pub async fn content(ctx: Ctx, id: String, req: Request<Body>) -> Response {
    answer(
        async move {
            let who = caller(&ctx.gw, req.headers())?;
            let meta: FileMeta = owned(&ctx, &who.tenant, &id).await?;
            let key = meta.id().to_string();
            let bytes = match ctx.batches.blocking(move |b| b.blobs.read(&key)).await {
                Ok(b) => b,
                Err(BatchError::NotFound) => return Err(no_such("File", &id)),
                Err(e) => return Err(internal(e)),
            };
            let mut r = Response::new(Body::from(bytes));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            );
            Ok(r)
        }
        .await,
    )
}

/// `DELETE /v1/files/{id}`.
pub async fn delete(ctx: Ctx, id: String, req: Request<Body>) -> Response {
    answer(
        async move {
            let who = caller(&ctx.gw, req.headers())?;
            let meta: FileMeta = owned(&ctx, &who.tenant, &id).await?;
            let key = meta.id().to_string();
            ctx.batches
                .blocking(move |b| {
                    b.jobs.delete_file(&key)?;
                    b.blobs.remove(&key)
                })
                .await
                .map_err(internal)?;
            Ok(json(
                &serde_json::json!({"id": id, "object": "file", "deleted": true}),
            ))
        }
        .await,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_batch_purpose_is_stored() {
        assert!(check_purpose(Some("batch")).is_ok());
        let e = check_purpose(Some("fine-tune")).unwrap_err();
        assert_eq!(
            (e.status, e.param.as_deref()),
            (StatusCode::BAD_REQUEST, Some("purpose"))
        );
        let e = check_purpose(Some("nonsense")).unwrap_err();
        assert!(
            e.message.starts_with("'nonsense' is not one of"),
            "{}",
            e.message
        );
        assert!(check_purpose(None).is_err());
    }
}
