//! The HTTP/1.1 client for plain-http backends, built for this one proxy path.
//!
//! A request is written, its response head read and its body decoded by whoever polls the
//! future and then the [`Body`]: the request's own task. There is no connection task, no
//! dispatch channel and no buffer held while a connection waits (a held stream costs its
//! socket and a few hundred bytes of state). The head parser is `httparse`, the one hyper uses;
//! framing and limits are in [`parse`].
//!
//! - [`Pool`]: the idle connections of one backend on one serving thread (see
//!   [`super::Pools`]), newest first.
//! - [`send`]: one request on a pooled or new connection.
//! - [`Body`]: the response body; it gives its connection back to the pool when the body was
//!   read to its end and the connection may be reused.
//!
//! Invariants: a connection goes back to the pool only after its response was read to the
//! end with nothing after it, on HTTP/1.1 without `Connection: close`; otherwise it is closed.
//! An idle connection is checked before reuse: one the backend closed (or sent anything on)
//! is dropped without writing to it. A reused connection whose write fails is replaced once by
//! a fresh one (the backend's side was gone, so it never read the request); once a request was
//! written, it is never written again here (the backend may have received it): a connection
//! that ends without a response byte is a transport error, which the proxy's failover handles.

mod body;
pub mod parse;
mod pool;

use std::io::{self, IoSlice};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, Method, Request, Response, Uri};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

pub use body::Body;
use body::Conn;
pub use parse::ParseError;
pub use pool::Pool;

/// What the first read of a response reserves (one SSE token event of an inference engine is
/// 150–400 bytes; a non-streamed chat answer's head and body fit in one read).
pub const READ_SIZE: usize = 4 * 1024;
/// The largest read, reached by doubling while reads fill the buffer (large bodies).
pub const MAX_READ_SIZE: usize = 64 * 1024;

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("could not connect to {addr}: {source}")]
    Connect { addr: String, source: io::Error },
    #[error("connect to {0} timed out")]
    ConnectTimeout(String),
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("connection closed before the response was complete")]
    Closed,
    #[error("{0}")]
    Parse(#[from] ParseError),
    #[error("not an http:// URL: {0}")]
    Url(String),
}

impl Error {
    /// Whether no connection was made (nothing was sent).
    pub fn is_connect(&self) -> bool {
        matches!(self, Error::Connect { .. } | Error::ConnectTimeout(_))
    }
}

/// Connection settings (as the hyper client had them).
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    pub connect_timeout: Duration,
    pub tcp_keepalive: Duration,
    /// An idle connection older than this is closed instead of reused.
    pub idle_timeout: Duration,
    /// The most idle connections kept per backend and thread.
    pub max_idle: usize,
}

/// Send `req` (an `http://` URL) on a connection from `pool` or a new one; returns once the
/// final response head arrived (1xx heads are skipped).
pub async fn send(pool: &Arc<Pool>, req: Request<Bytes>) -> Result<Response<Body>, Error> {
    let (parts, body) = req.into_parts();
    let target = Addr::of(&parts.uri)?;
    let head = encode_head(
        &parts.method,
        &parts.uri,
        target.authority,
        &parts.headers,
        &body,
    );
    let head_request = parts.method == Method::HEAD;
    let mut conn = match pool.checkout(target.authority) {
        Some(c) => c,
        None => connect(&target, pool.settings()).await?,
    };
    if let Err(e) = write_request(&mut conn.io, &head, &body).await {
        if !conn.reused {
            return Err(Error::Io(e));
        }
        // The backend closed its side before the request reached it: one fresh try.
        conn = connect(&target, pool.settings()).await?;
        write_request(&mut conn.io, &head, &body).await?;
    }
    body::read_head(conn, pool, head_request).await
}

/// Where a request goes: host and port to connect to, the authority as the pool's key.
struct Addr<'a> {
    host: &'a str,
    port: u16,
    authority: &'a str,
}

impl<'a> Addr<'a> {
    fn of(uri: &'a Uri) -> Result<Addr<'a>, Error> {
        let (Some("http"), Some(authority), Some(host)) =
            (uri.scheme_str(), uri.authority(), uri.host())
        else {
            return Err(Error::Url(uri.to_string()));
        };
        Ok(Addr {
            host: host.trim_start_matches('[').trim_end_matches(']'),
            port: uri.port_u16().unwrap_or(80),
            authority: authority.as_str(),
        })
    }
}

async fn connect(to: &Addr<'_>, s: Settings) -> Result<Conn, Error> {
    let name = || format!("{}:{}", to.host, to.port);
    let io = match tokio::time::timeout(s.connect_timeout, TcpStream::connect((to.host, to.port)))
        .await
    {
        Err(_) => return Err(Error::ConnectTimeout(name())),
        Ok(Err(source)) => {
            return Err(Error::Connect {
                addr: name(),
                source,
            })
        }
        Ok(Ok(io)) => io,
    };
    tracing::debug!(backend = to.authority, "new backend connection");
    io.set_nodelay(true)?;
    let ka = socket2::TcpKeepalive::new().with_time(s.tcp_keepalive);
    socket2::SockRef::from(&io).set_tcp_keepalive(&ka)?;
    Ok(Conn::new(io, to.authority.to_string()))
}

/// The request line and fields. `Host` from the URL unless given; the body's length always
/// (fields that frame the message are the client's to write, never copied from `headers`).
fn encode_head(
    method: &Method,
    uri: &Uri,
    authority: &str,
    h: &HeaderMap,
    body: &Bytes,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(256 + h.len() * 48);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    if !h.contains_key(header::HOST) {
        field(&mut out, b"host", authority.as_bytes());
    }
    for (name, value) in h {
        if matches!(
            *name,
            header::CONTENT_LENGTH | header::TRANSFER_ENCODING | header::CONNECTION
        ) {
            continue;
        }
        field(&mut out, name.as_str().as_bytes(), value.as_bytes());
    }
    let bodiless = matches!(
        *method,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS
    );
    if !body.is_empty() || !bodiless {
        field(
            &mut out,
            b"content-length",
            body.len().to_string().as_bytes(),
        );
    }
    out.extend_from_slice(b"\r\n");
    out
}

fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Head and body in one vectored write where the socket takes it (one system call).
async fn write_request(io: &mut TcpStream, head: &[u8], body: &[u8]) -> io::Result<()> {
    let (mut h, mut b) = (head, body);
    while !h.is_empty() {
        let n = io
            .write_vectored(&[IoSlice::new(h), IoSlice::new(b)])
            .await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        let from_head = n.min(h.len());
        h = &h[from_head..];
        b = &b[n - from_head..];
    }
    io.write_all(b).await
}

/// A fresh read buffer (its size adapts per response: [`READ_SIZE`] doubling to
/// [`MAX_READ_SIZE`]).
fn reserve(buf: &mut BytesMut, size: usize) {
    if buf.capacity() - buf.len() < size / 2 {
        buf.reserve(size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    /// A backend that answers every request on every connection with `ok`, counting
    /// connections and requests.
    async fn counting_backend() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/x", listener.local_addr().unwrap());
        let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = requests.clone();
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    // One small request per read: enough for this test's requests.
                    while let Ok(n) = sock.read(&mut buf).await {
                        if n == 0 {
                            return;
                        }
                        seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if sock.write_all(ok).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (url, requests)
    }

    fn pool() -> Arc<Pool> {
        Arc::new(Pool::new(Settings {
            connect_timeout: Duration::from_secs(2),
            tcp_keepalive: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_idle: 4,
        }))
    }

    async fn get(p: &Arc<Pool>, url: &str) -> Result<u16, Error> {
        let resp = send(p, Request::get(url).body(Bytes::new()).unwrap()).await?;
        let status = resp.status().as_u16();
        http_body_util::BodyExt::collect(resp.into_body()).await?;
        Ok(status)
    }

    #[tokio::test]
    async fn a_reused_connection_whose_write_fails_is_replaced_once() {
        let (url, requests) = counting_backend().await;
        let p = pool();
        assert_eq!(get(&p, &url).await.unwrap(), 200);
        // The idle connection passes the liveness check but can no longer be written to.
        let uri: Uri = url.parse().unwrap();
        let conn = p.checkout(Addr::of(&uri).unwrap().authority).unwrap();
        socket2::SockRef::from(&conn.io)
            .shutdown(std::net::Shutdown::Write)
            .unwrap();
        p.give_back(conn);
        assert_eq!(get(&p, &url).await.unwrap(), 200);
        assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 2);
        assert_eq!(
            p.idle_count(),
            1,
            "the fresh connection went back, the broken one did not"
        );
    }

    #[test]
    fn request_head_frames_the_body_itself() {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, "999".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert(header::CONNECTION, "close".parse().unwrap());
        h.insert("x-request-id", "r1".parse().unwrap());
        let uri: Uri = "http://b:8000/v1/chat/completions?x=1".parse().unwrap();
        let head = encode_head(
            &Method::POST,
            &uri,
            "b:8000",
            &h,
            &Bytes::from_static(b"{}"),
        );
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: b:8000\r\nx-request-id: r1\r\ncontent-length: 2\r\n\r\n"
        );
        let get = encode_head(
            &Method::GET,
            &uri,
            "b:8000",
            &HeaderMap::new(),
            &Bytes::new(),
        );
        assert!(!String::from_utf8(get).unwrap().contains("content-length"));
        let https: Uri = "https://b/".parse().unwrap();
        assert!(Addr::of(&https).is_err());
        let v6: Uri = "http://[::1]:9/".parse().unwrap();
        let v6 = Addr::of(&v6).unwrap();
        assert_eq!((v6.host, v6.port, v6.authority), ("::1", 9, "[::1]:9"));
    }
}
