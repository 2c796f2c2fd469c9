//! One connection, its response head and its response body, read by the request's task.
//!
//! Invariants: the read buffer exists only while bytes are in it or a read is under way (a
//! connection waiting for the next event of a stream holds none); the connection returns to
//! its pool only from [`Body`] reaching its end with no byte left over on a keep-alive answer.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::Response;
use http_body::{Frame, SizeHint};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

use super::parse::{self, Decoded, Decoder, Framing};
use super::{reserve, Error, Pool, MAX_READ_SIZE, READ_SIZE};

/// A connection to one backend.
#[derive(Debug)]
pub(crate) struct Conn {
    pub(super) io: TcpStream,
    /// The pool's key.
    pub(super) authority: String,
    /// Taken from the pool (it carried an earlier request).
    pub(super) reused: bool,
}

impl Conn {
    pub(super) fn new(io: TcpStream, authority: String) -> Conn {
        Conn {
            io,
            authority,
            reused: false,
        }
    }
}

/// Read the final response head (skipping 1xx heads) and hand the rest to the [`Body`].
pub(super) async fn read_head(
    mut conn: Conn,
    pool: &Arc<Pool>,
    head_request: bool,
) -> Result<Response<Body>, Error> {
    let mut buf = BytesMut::new();
    loop {
        if !buf.is_empty() {
            if let Some((head, n)) = parse::parse_head(&buf, head_request)? {
                buf.advance(n);
                if head.is_informational() {
                    continue;
                }
                let mut resp = Response::new(Body::new(conn, buf, pool, &head));
                *resp.status_mut() = head.status;
                *resp.version_mut() = head.version;
                *resp.headers_mut() = head.headers;
                return Ok(resp);
            }
        }
        reserve(&mut buf, READ_SIZE);
        if conn.io.read_buf(&mut buf).await? == 0 {
            return Err(Error::Closed);
        }
    }
}

/// A response body from the plain-http client.
#[derive(Debug)]
pub struct Body {
    /// `None` once the body ended (or failed).
    reading: Option<Reading>,
}

#[derive(Debug)]
struct Reading {
    conn: Conn,
    buf: BytesMut,
    decoder: Decoder,
    pool: Arc<Pool>,
    keep_alive: bool,
    read_size: usize,
}

impl Body {
    fn new(conn: Conn, buf: BytesMut, pool: &Arc<Pool>, head: &parse::Head) -> Body {
        let reading = Reading {
            conn,
            buf,
            decoder: Decoder::new(head.framing),
            pool: pool.clone(),
            keep_alive: head.keep_alive,
            read_size: READ_SIZE,
        };
        let mut body = Body {
            reading: Some(reading),
        };
        if head.framing == Framing::Empty {
            body.finish();
        }
        body
    }

    /// The body is over: the connection goes back to its pool when it can carry another
    /// request, and is closed otherwise.
    fn finish(&mut self) {
        if let Some(r) = self.reading.take() {
            if r.keep_alive && r.buf.is_empty() && r.decoder.is_done() {
                r.pool.give_back(r.conn);
            }
        }
    }

    fn fail(&mut self, e: Error) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        self.reading = None;
        Poll::Ready(Some(Err(e)))
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
        loop {
            let Some(r) = this.reading.as_mut() else {
                return Poll::Ready(None);
            };
            match r.decoder.decode(&mut r.buf) {
                Err(e) => return this.fail(e.into()),
                Ok(Decoded::Data(b)) => {
                    if r.decoder.is_done() {
                        this.finish();
                    }
                    return Poll::Ready(Some(Ok(Frame::data(b))));
                }
                Ok(Decoded::End) => {
                    this.finish();
                    return Poll::Ready(None);
                }
                Ok(Decoded::More) => {}
            }
            match r.read(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return this.fail(e.into()),
                Poll::Ready(Ok(0)) if r.decoder.at_eof() => {
                    this.reading = None;
                    return Poll::Ready(None);
                }
                Poll::Ready(Ok(0)) => return this.fail(Error::Closed),
                Poll::Ready(Ok(_)) => {}
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.reading.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.reading {
            None => SizeHint::with_exact(0),
            Some(r) => match r.decoder.remaining() {
                Some(n) => SizeHint::with_exact(n),
                None => SizeHint::default(),
            },
        }
    }
}

impl Reading {
    /// Read what the socket has into the buffer. While nothing is buffered the buffer is
    /// released before waiting, so an idle stream holds no memory for it.
    fn read(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        loop {
            if self.buf.is_empty() && self.buf.capacity() > 0 {
                self.buf = BytesMut::new();
            }
            ready!(self.conn.io.poll_read_ready(cx))?;
            reserve(&mut self.buf, self.read_size);
            let room = self.buf.capacity() - self.buf.len();
            match self.conn.io.try_read_buf(&mut self.buf) {
                Ok(n) => {
                    if n == room {
                        self.read_size = (self.read_size * 2).min(MAX_READ_SIZE);
                    }
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}
