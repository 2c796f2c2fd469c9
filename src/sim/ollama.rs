//! The Ollama personality (in progress).
use std::sync::Arc;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;

use super::server::{json, Sim, SimBody};

pub(crate) async fn route(_sim: &Arc<Sim>, _req: Request<Incoming>) -> Response<SimBody> {
    json(StatusCode::NOT_FOUND, "application/json", "{}")
}

pub(crate) async fn unload_all(_sim: &Sim) {}
