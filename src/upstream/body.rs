//! A backend's response as the proxy reads it, whichever client carried it.
//!
//! Plain-http backends are served by the purpose-built HTTP/1.1 client ([`super::h1`]); TLS
//! backends by hyper's client. [`Body`] is either one's body behind one type, so the proxy
//! has one code path.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;

use super::h1;

/// A backend's response.
pub type UpstreamResponse = http::Response<Body>;

/// A backend's response body.
#[derive(Debug)]
pub enum Body {
    Lean(h1::Body),
    Hyper(Incoming),
}

/// Why a body or a request failed, from either client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Lean(#[from] h1::Error),
    #[error(transparent)]
    Hyper(#[from] hyper::Error),
    #[error(transparent)]
    HyperClient(#[from] hyper_util::client::legacy::Error),
}

impl ClientError {
    /// Whether no connection was made (nothing was sent).
    pub fn is_connect(&self) -> bool {
        match self {
            ClientError::Lean(e) => e.is_connect(),
            ClientError::Hyper(_) => false,
            ClientError::HyperClient(e) => e.is_connect(),
        }
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = ClientError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientError>>> {
        match self.get_mut() {
            Body::Lean(b) => Pin::new(b).poll_frame(cx).map_err(ClientError::from),
            Body::Hyper(b) => Pin::new(b).poll_frame(cx).map_err(ClientError::from),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Lean(b) => b.is_end_stream(),
            Body::Hyper(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Lean(b) => b.size_hint(),
            Body::Hyper(b) => b.size_hint(),
        }
    }
}
