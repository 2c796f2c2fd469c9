//! The plain-http upstream path on pingora-core's HTTP/1 client (`--features
//! pingora-upstream`): the A/B prototype against [`super::h1`], kept buildable so the
//! comparison can be re-run (bench/README.md, "The plain-http upstream client").
//!
//! As the crate intends it: one [`Connector`] per backend and serving thread (its connection
//! pool), a session taken from it per request ([`Connector::get_http_session`]), the request
//! head and body written and the response read by the request's own task, and the session
//! released back to the connector once its body was read to the end
//! ([`Connector::release_http_session`], which checks keep-alive and spawns the idle watcher
//! of the pooled connection). A body dropped before its end drops the session, which closes
//! the connection.
//!
//! Same contract as [`super::h1`]: a failed write on a reused connection is retried once on
//! another; once a request was written it is never written again here.

use std::fmt;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::Stream;
use http::{header, HeaderValue, Method, Request, Response};
use http_body::{Frame, SizeHint};
use pingora_core::connectors::http::v1::Connector;
use pingora_core::connectors::ConnectorOptions;
use pingora_core::protocols::http::v1::client::HttpSession;
use pingora_core::protocols::l4::ext::TcpKeepalive;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_http::RequestHeader;

use super::h1::Settings;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("could not connect: {0}")]
    Connect(Box<pingora_core::Error>),
    #[error("{0}")]
    Http(Box<pingora_core::Error>),
    #[error("not an http:// URL: {0}")]
    Url(String),
    #[error("could not resolve {0}")]
    Resolve(String),
    #[error("too many informational responses")]
    Informational,
}

impl Error {
    /// Whether no connection was made (nothing was sent).
    pub fn is_connect(&self) -> bool {
        matches!(self, Error::Connect(_) | Error::Resolve(_))
    }
}

fn http(e: Box<pingora_core::Error>) -> Error {
    Error::Http(e)
}

/// One backend's connector (connection pool) on one serving thread, with the resolved peer
/// of the authority it was last used for.
pub struct Pool {
    connector: Connector,
    settings: Settings,
    peer: Mutex<Option<(String, Arc<HttpPeer>)>>,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("settings", &self.settings)
            .finish()
    }
}

impl Pool {
    pub fn new(settings: Settings) -> Pool {
        Pool {
            connector: Connector::new(Some(ConnectorOptions::new(settings.max_idle))),
            settings,
            peer: Mutex::new(None),
        }
    }

    /// The peer for `authority`, resolved on first use (a backend's pool sees one authority).
    async fn peer(&self, host: &str, port: u16, authority: &str) -> Result<Arc<HttpPeer>, Error> {
        if let Some((a, p)) = &*self.peer.lock().unwrap_or_else(|p| p.into_inner()) {
            if a == authority {
                return Ok(p.clone());
            }
        }
        let addr: SocketAddr = tokio::net::lookup_host((host, port))
            .await
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| Error::Resolve(authority.to_string()))?;
        let mut peer = HttpPeer::new(addr, false, String::new());
        peer.options.connection_timeout = Some(self.settings.connect_timeout);
        peer.options.tcp_keepalive = Some(TcpKeepalive {
            idle: self.settings.tcp_keepalive,
            interval: self.settings.tcp_keepalive,
            count: 9,
            user_timeout: Duration::ZERO,
        });
        let peer = Arc::new(peer);
        *self.peer.lock().unwrap_or_else(|p| p.into_inner()) =
            Some((authority.to_string(), peer.clone()));
        Ok(peer)
    }
}

/// Send `req` (an `http://` URL) on a pooled or new connection; returns at the final response
/// head (1xx heads are skipped, at most 8).
pub async fn send(pool: &Arc<Pool>, req: Request<Bytes>) -> Result<Response<Body>, Error> {
    let (parts, body) = req.into_parts();
    let (Some("http"), Some(authority), Some(host)) = (
        parts.uri.scheme_str(),
        parts.uri.authority(),
        parts.uri.host(),
    ) else {
        return Err(Error::Url(parts.uri.to_string()));
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let peer = pool
        .peer(host, parts.uri.port_u16().unwrap_or(80), authority.as_str())
        .await?;
    let head = || request_head(&parts, authority.as_str(), body.len());
    let (mut session, reused) = pool
        .connector
        .get_http_session(&*peer)
        .await
        .map_err(Error::Connect)?;
    if let Err(e) = write(&mut session, head()?, &body).await {
        if !reused {
            return Err(http(e));
        }
        // The backend closed the idle connection before the request reached it: one more try.
        session = pool
            .connector
            .get_http_session(&*peer)
            .await
            .map_err(Error::Connect)?
            .0;
        write(&mut session, head()?, &body).await.map_err(http)?;
    }
    for _ in 0..8 {
        session.read_response().await.map_err(http)?;
        let Some(h) = session.resp_header() else {
            continue;
        };
        if h.status.is_informational() {
            continue;
        }
        let mut resp = Response::new(());
        *resp.status_mut() = h.status;
        *resp.version_mut() = h.version;
        *resp.headers_mut() = h.headers.clone();
        let body = Body::new(session, pool.clone(), peer);
        return Ok(resp.map(|()| body));
    }
    Err(Error::Informational)
}

/// The request head: the caller's fields, `Host` from the URL unless given, the body's length
/// (framing fields are the client's to write, never copied from the caller).
fn request_head(
    parts: &http::request::Parts,
    authority: &str,
    body_len: usize,
) -> Result<Box<RequestHeader>, Error> {
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut req =
        RequestHeader::build_no_case(parts.method.clone(), path.as_bytes(), None).map_err(http)?;
    for (name, value) in &parts.headers {
        if matches!(
            *name,
            header::CONTENT_LENGTH | header::TRANSFER_ENCODING | header::CONNECTION
        ) {
            continue;
        }
        req.append_header(name, value).map_err(http)?;
    }
    if !parts.headers.contains_key(header::HOST) {
        let host = HeaderValue::from_str(authority).map_err(|_| Error::Url(authority.into()))?;
        req.insert_header(header::HOST, host).map_err(http)?;
    }
    let bodiless = matches!(
        parts.method,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS
    );
    if body_len > 0 || !bodiless {
        req.insert_header(header::CONTENT_LENGTH, HeaderValue::from(body_len))
            .map_err(http)?;
    }
    Ok(Box::new(req))
}

async fn write(
    s: &mut HttpSession,
    head: Box<RequestHeader>,
    body: &[u8],
) -> pingora_core::Result<()> {
    s.write_request_header(head).await?;
    if !body.is_empty() {
        s.write_body(body).await?;
    }
    s.finish_body().await?;
    Ok(())
}

type Chunks = Pin<Box<dyn Stream<Item = Result<Bytes, Error>> + Send + Sync>>;

/// A response body read from a pingora session; the session goes back to its connector when
/// the body ended.
pub struct Body {
    chunks: Option<Chunks>,
}

impl fmt::Debug for Body {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Body")
            .field("done", &self.chunks.is_none())
            .finish()
    }
}

impl Body {
    fn new(session: HttpSession, pool: Arc<Pool>, peer: Arc<HttpPeer>) -> Body {
        let state = Some((session, pool, peer));
        let chunks = futures_util::stream::unfold(state, |state| async move {
            let (mut session, pool, peer) = state?;
            match session.read_body_bytes().await {
                Ok(Some(b)) => Some((Ok(b), Some((session, pool, peer)))),
                Ok(None) => {
                    let idle = Some(pool.settings.idle_timeout);
                    pool.connector
                        .release_http_session(session, &*peer, idle)
                        .await;
                    None
                }
                Err(e) => Some((Err(http(e)), None)),
            }
        });
        Body {
            chunks: Some(Box::pin(chunks)),
        }
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = self.get_mut();
        let Some(chunks) = this.chunks.as_mut() else {
            return Poll::Ready(None);
        };
        match chunks.as_mut().poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
            Poll::Ready(Some(Err(e))) => {
                this.chunks = None;
                Poll::Ready(Some(Err(e)))
            }
            Poll::Ready(None) => {
                this.chunks = None;
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
