//! The response side of HTTP/1.1 as bytes: the head (`httparse`), the body's framing
//! (RFC 9112 §6.3) and the chunked decoder. Pure functions over buffers, no I/O, so every rule
//! is tested and fuzzed without a socket.
//!
//! Invariants: a head is at most [`MAX_HEAD`] bytes with at most [`MAX_HEADERS`] fields; a
//! response that announces both `Content-Length` and `Transfer-Encoding`, two different
//! lengths, a length that is not a decimal number, or `chunked` anywhere but last is rejected
//! (RFC 9112 §6.3 calls the first a smuggling attempt that ought to be an error); a chunk size
//! never overflows (at most 16 hex digits, checked arithmetic); chunk lines end in CRLF; trailer
//! fields are read to their end, bounded, and dropped.

use bytes::{Buf, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Version};

/// The most bytes a response head may take (status line, fields, the blank line).
pub const MAX_HEAD: usize = 64 * 1024;
/// The most header fields a response head may have (hyper's default as well).
pub const MAX_HEADERS: usize = 100;
/// The most bytes of a chunk-size line (size, extensions) or of all trailer fields.
pub const MAX_CHUNK_LINE: usize = 4 * 1024;
pub const MAX_TRAILERS: usize = 16 * 1024;

/// Why a response cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("invalid response head: {0}")]
    Head(&'static str),
    #[error("response head larger than {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("more than {MAX_HEADERS} header fields")]
    TooManyHeaders,
    #[error("invalid header field")]
    HeaderField,
    #[error("both Content-Length and Transfer-Encoding")]
    LengthAndChunked,
    #[error("invalid Content-Length")]
    ContentLength,
    #[error("invalid Transfer-Encoding")]
    TransferEncoding,
    #[error("unexpected 101 Switching Protocols")]
    Upgrade,
    #[error("invalid chunk size line")]
    ChunkSize,
    #[error("chunk size overflows")]
    ChunkOverflow,
    #[error("chunk data not followed by CRLF")]
    ChunkEnd,
    #[error("trailer section too large or invalid")]
    Trailers,
}

/// How the body of a response is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body: HEAD, 204, 304, or a zero Content-Length.
    Empty,
    Length(u64),
    Chunked,
    /// Until the backend closes the connection (no length, no chunking; not reusable).
    Close,
}

/// A parsed final response head.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub framing: Framing,
    /// Whether the connection may carry another request once this body is read to its end.
    pub keep_alive: bool,
}

/// Parse one response head at the start of `buf`. `Ok(None)`: not complete yet (read more).
/// `Ok(Some((head, n)))`: the head took `n` bytes; 1xx informational heads are returned as
/// well (the caller skips them: [`Head::is_informational`]). `head_request`: the request was
/// `HEAD`, so the answer has no body whatever it says.
pub fn parse_head(buf: &[u8], head_request: bool) -> Result<Option<(Head, usize)>, ParseError> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut fields);
    let n = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD => {
            return Err(ParseError::HeadTooLarge)
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(ParseError::TooManyHeaders),
        Err(httparse::Error::HeaderName | httparse::Error::HeaderValue) => {
            return Err(ParseError::HeaderField)
        }
        Err(e) => return Err(ParseError::Head(error_name(e))),
    };
    if n > MAX_HEAD {
        return Err(ParseError::HeadTooLarge);
    }
    let code = resp.code.ok_or(ParseError::Head("status"))?;
    let status = StatusCode::from_u16(code).map_err(|_| ParseError::Head("status"))?;
    let version = match resp.version {
        Some(1) => Version::HTTP_11,
        _ => Version::HTTP_10,
    };
    let mut headers = HeaderMap::with_capacity(resp.headers.len());
    for f in resp.headers.iter() {
        let name =
            HeaderName::from_bytes(f.name.as_bytes()).map_err(|_| ParseError::HeaderField)?;
        let value = HeaderValue::from_bytes(f.value).map_err(|_| ParseError::HeaderField)?;
        headers.append(name, value);
    }
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(ParseError::Upgrade);
    }
    let framing = framing(status, &headers, head_request)?;
    let keep_alive = keep_alive(version, &headers) && framing != Framing::Close;
    let head = Head {
        status,
        version,
        headers,
        framing,
        keep_alive,
    };
    Ok(Some((head, n)))
}

impl Head {
    /// A 1xx answer other than 101: skipped, the final answer follows on the same connection.
    pub fn is_informational(&self) -> bool {
        self.status.is_informational()
    }
}

fn error_name(e: httparse::Error) -> &'static str {
    match e {
        httparse::Error::Status => "status",
        httparse::Error::Version => "version",
        httparse::Error::NewLine => "line ending",
        httparse::Error::Token => "token",
        _ => "syntax",
    }
}

/// RFC 9112 §6.3, in its order.
fn framing(status: StatusCode, h: &HeaderMap, head_request: bool) -> Result<Framing, ParseError> {
    if head_request
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Empty);
    }
    let te = h.get_all(http::header::TRANSFER_ENCODING);
    let has_length = h.contains_key(http::header::CONTENT_LENGTH);
    if te.iter().next().is_some() {
        if has_length {
            return Err(ParseError::LengthAndChunked);
        }
        return transfer_coding(te.iter());
    }
    if !has_length {
        return Ok(Framing::Close);
    }
    match content_length(h)? {
        0 => Ok(Framing::Empty),
        n => Ok(Framing::Length(n)),
    }
}

/// `chunked` last (and once) frames the body; other codings without it read until close.
fn transfer_coding<'a>(
    values: impl Iterator<Item = &'a HeaderValue>,
) -> Result<Framing, ParseError> {
    let mut chunked_seen = false;
    let mut last_chunked = false;
    for v in values {
        let s = v.to_str().map_err(|_| ParseError::TransferEncoding)?;
        for coding in s.split(',').map(str::trim) {
            if coding.is_empty() {
                continue;
            }
            if chunked_seen {
                // `chunked` must be the final coding, applied once.
                return Err(ParseError::TransferEncoding);
            }
            last_chunked = coding.eq_ignore_ascii_case("chunked");
            chunked_seen = last_chunked;
        }
    }
    Ok(if last_chunked {
        Framing::Chunked
    } else {
        Framing::Close
    })
}

/// One length for every `Content-Length` value (a list of equal values is one length).
fn content_length(h: &HeaderMap) -> Result<u64, ParseError> {
    let mut length = None;
    for v in h.get_all(http::header::CONTENT_LENGTH) {
        for part in v.as_bytes().split(|b| *b == b',') {
            let n = decimal(trim(part)).ok_or(ParseError::ContentLength)?;
            if length.is_some_and(|l| l != n) {
                return Err(ParseError::ContentLength);
            }
            length = Some(n);
        }
    }
    length.ok_or(ParseError::ContentLength)
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b.iter().position(|c| !matches!(c, b' ' | b'\t'));
    let Some(start) = start else { return &[] };
    let end = b
        .iter()
        .rposition(|c| !matches!(c, b' ' | b'\t'))
        .unwrap_or(start);
    &b[start..=end]
}

fn decimal(b: &[u8]) -> Option<u64> {
    if b.is_empty() || b.len() > 19 || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    b.iter().try_fold(0u64, |n, d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

fn keep_alive(version: Version, h: &HeaderMap) -> bool {
    let close = h.get_all(http::header::CONNECTION).iter().any(|v| {
        v.as_bytes()
            .split(|b| *b == b',')
            .any(|t| trim(t).eq_ignore_ascii_case(b"close"))
    });
    // HTTP/1.0 connections are never reused: few backends speak it, and its keep-alive is an
    // extension this client does not need.
    !close && version == Version::HTTP_11
}

/// What one step of body decoding produced.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    Data(Bytes),
    /// The body is complete; any bytes left in the buffer follow it.
    End,
    /// More bytes are needed.
    More,
}

/// The body decoder for one response.
#[derive(Debug)]
pub struct Decoder {
    state: State,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Length(u64),
    Close,
    /// Reading a chunk-size line.
    Size,
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    Trailers {
        seen: usize,
    },
    Done,
}

impl Decoder {
    pub fn new(framing: Framing) -> Decoder {
        let state = match framing {
            Framing::Empty => State::Done,
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::Size,
            Framing::Close => State::Close,
        };
        Decoder { state }
    }

    /// Whether the body is complete.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// The bytes still expected when the length is known.
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            State::Length(n) => Some(n),
            State::Done => Some(0),
            _ => None,
        }
    }

    /// The end of input (the backend closed): complete only for a close-delimited body.
    pub fn at_eof(&mut self) -> bool {
        if matches!(self.state, State::Close | State::Done) {
            self.state = State::Done;
            return true;
        }
        false
    }

    /// Take the next piece of body from `buf`, consuming what it used.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, ParseError> {
        loop {
            match self.state {
                State::Done => return Ok(Decoded::End),
                State::Close if buf.is_empty() => return Ok(Decoded::More),
                State::Close => return Ok(Decoded::Data(buf.split().freeze())),
                State::Length(_) | State::Data(_) if buf.is_empty() => return Ok(Decoded::More),
                State::Length(n) => {
                    let take = usize::try_from(n).unwrap_or(usize::MAX).min(buf.len());
                    let left = n - take as u64;
                    self.state = if left == 0 {
                        State::Done
                    } else {
                        State::Length(left)
                    };
                    return Ok(Decoded::Data(buf.split_to(take).freeze()));
                }
                State::Data(n) => {
                    let take = usize::try_from(n).unwrap_or(usize::MAX).min(buf.len());
                    let left = n - take as u64;
                    self.state = if left == 0 {
                        State::DataEnd
                    } else {
                        State::Data(left)
                    };
                    return Ok(Decoded::Data(buf.split_to(take).freeze()));
                }
                State::Size => match chunk_size(buf)? {
                    None => return Ok(Decoded::More),
                    Some(0) => self.state = State::Trailers { seen: 0 },
                    Some(n) => self.state = State::Data(n),
                },
                State::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Decoded::More);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(ParseError::ChunkEnd);
                    }
                    buf.advance(2);
                    self.state = State::Size;
                }
                State::Trailers { seen } => {
                    let Some(end) = find_crlf(buf) else {
                        if seen + buf.len() > MAX_TRAILERS {
                            return Err(ParseError::Trailers);
                        }
                        return Ok(Decoded::More);
                    };
                    if seen + end + 2 > MAX_TRAILERS {
                        return Err(ParseError::Trailers);
                    }
                    let blank = end == 0;
                    buf.advance(end + 2);
                    self.state = if blank {
                        State::Done
                    } else {
                        State::Trailers {
                            seen: seen + end + 2,
                        }
                    };
                }
            }
        }
    }
}

fn find_crlf(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\r\n")
}

/// Parse a complete chunk-size line at the start of `buf` (hex size, optional whitespace and
/// extensions, CRLF), consuming it. `None`: the line is not complete yet.
fn chunk_size(buf: &mut BytesMut) -> Result<Option<u64>, ParseError> {
    let Some(end) = find_crlf(buf) else {
        // + 1: the line's CR may be here without its LF.
        if buf.len() > MAX_CHUNK_LINE + 1 {
            return Err(ParseError::ChunkSize);
        }
        // A bare LF or a non-hex byte where the size belongs is an error at once.
        let digits = buf.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        if digits > 16 {
            return Err(ParseError::ChunkOverflow);
        }
        if buf[..buf.len().min(digits + 1)].contains(&b'\n') {
            return Err(ParseError::ChunkSize);
        }
        return Ok(None);
    };
    if end > MAX_CHUNK_LINE {
        return Err(ParseError::ChunkSize);
    }
    let line = &buf[..end];
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 {
        return Err(ParseError::ChunkSize);
    }
    if digits > 16 {
        return Err(ParseError::ChunkOverflow);
    }
    let mut size = 0u64;
    for d in &line[..digits] {
        let v = (*d as char).to_digit(16).ok_or(ParseError::ChunkSize)?;
        size = size
            .checked_mul(16)
            .and_then(|s| s.checked_add(u64::from(v)))
            .ok_or(ParseError::ChunkOverflow)?;
    }
    let rest = &line[digits..];
    let rest = &rest[rest
        .iter()
        .take_while(|b| matches!(b, b' ' | b'\t'))
        .count()..];
    if !(rest.is_empty() || rest[0] == b';') || rest.iter().any(|b| matches!(b, b'\n' | b'\r')) {
        return Err(ParseError::ChunkSize);
    }
    buf.advance(end + 2);
    Ok(Some(size))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(s: &str) -> Result<Option<(Head, usize)>, ParseError> {
        parse_head(s.as_bytes(), false)
    }

    fn framing_of(s: &str) -> Result<Framing, ParseError> {
        head(s).map(|h| h.expect("complete").0.framing)
    }

    #[test]
    fn framing_follows_rfc_9112() {
        let ok = "HTTP/1.1 200 OK\r\n";
        assert_eq!(
            framing_of(&format!("{ok}content-length: 5\r\n\r\n")),
            Ok(Framing::Length(5))
        );
        assert_eq!(
            framing_of(&format!("{ok}content-length: 5, 5\r\n\r\n")),
            Ok(Framing::Length(5))
        );
        assert_eq!(
            framing_of(&format!("{ok}content-length: 0\r\n\r\n")),
            Ok(Framing::Empty)
        );
        assert_eq!(
            framing_of(&format!(
                "{ok}content-length: 5\r\ncontent-length: 6\r\n\r\n"
            )),
            Err(ParseError::ContentLength)
        );
        for bad in ["-1", "+5", "5a", "", "99999999999999999999"] {
            assert_eq!(
                framing_of(&format!("{ok}content-length: {bad}\r\n\r\n")),
                Err(ParseError::ContentLength),
                "{bad:?}"
            );
        }
        assert_eq!(
            framing_of(&format!("{ok}transfer-encoding: chunked\r\n\r\n")),
            Ok(Framing::Chunked)
        );
        assert_eq!(
            framing_of(&format!("{ok}transfer-encoding: gzip, chunked\r\n\r\n")),
            Ok(Framing::Chunked)
        );
        assert_eq!(
            framing_of(&format!("{ok}transfer-encoding: chunked, gzip\r\n\r\n")),
            Err(ParseError::TransferEncoding)
        );
        assert_eq!(
            framing_of(&format!(
                "{ok}transfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n"
            )),
            Err(ParseError::TransferEncoding)
        );
        assert_eq!(
            framing_of(&format!("{ok}transfer-encoding: gzip\r\n\r\n")),
            Ok(Framing::Close)
        );
        assert_eq!(
            framing_of(&format!(
                "{ok}transfer-encoding: chunked\r\ncontent-length: 5\r\n\r\n"
            )),
            Err(ParseError::LengthAndChunked)
        );
        assert_eq!(framing_of(&format!("{ok}\r\n")), Ok(Framing::Close));
        for s in [
            "204 No Content",
            "304 Not Modified",
            "100 Continue",
            "103 Early Hints",
        ] {
            assert_eq!(
                framing_of(&format!("HTTP/1.1 {s}\r\ncontent-length: 5\r\n\r\n")),
                Ok(Framing::Empty)
            );
        }
        let (h, _) = parse_head(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", true)
            .unwrap()
            .unwrap();
        assert_eq!(h.framing, Framing::Empty, "HEAD");
        assert_eq!(
            head("HTTP/1.1 101 Switching Protocols\r\n\r\n").err(),
            Some(ParseError::Upgrade)
        );
    }

    #[test]
    fn keep_alive_rules() {
        let ka = |s: &str| head(s).unwrap().unwrap().0.keep_alive;
        assert!(ka("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"));
        assert!(!ka(
            "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
        ));
        assert!(!ka(
            "HTTP/1.1 200 OK\r\nconnection: keep-alive, Close\r\ncontent-length: 0\r\n\r\n"
        ));
        assert!(!ka("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n"));
        assert!(!ka("HTTP/1.1 200 OK\r\n\r\n"), "close-delimited");
    }

    #[test]
    fn head_limits_and_bad_bytes() {
        assert!(head("HTTP/1.1 200 OK\r\ncontent-le").unwrap().is_none());
        let many: String = (0..=MAX_HEADERS).map(|i| format!("x-{i}: v\r\n")).collect();
        assert_eq!(
            head(&format!("HTTP/1.1 200 OK\r\n{many}\r\n")).err(),
            Some(ParseError::TooManyHeaders)
        );
        let big = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_HEAD));
        assert_eq!(head(&big).err(), Some(ParseError::HeadTooLarge));
        assert_eq!(
            head("HTTP/1.1 200 OK\r\nx: a\x01b\r\n\r\n").err(),
            Some(ParseError::HeaderField)
        );
        assert_eq!(
            head("HTTP/1.1 200 OK\r\nx y: a\r\n\r\n").err(),
            Some(ParseError::HeaderField)
        );
        assert!(head("SSH-2.0-OpenSSH\r\n\r\n").is_err());
        assert!(head("HTTP/1.1 999999 OK\r\n\r\n").is_err());
    }

    fn decode_all(
        framing: Framing,
        input: &[u8],
        step: usize,
    ) -> Result<(Vec<u8>, bool), ParseError> {
        let mut d = Decoder::new(framing);
        let mut buf = BytesMut::new();
        let mut out = Vec::new();
        for piece in input.chunks(step.max(1)) {
            buf.extend_from_slice(piece);
            loop {
                match d.decode(&mut buf)? {
                    Decoded::Data(b) => out.extend_from_slice(&b),
                    Decoded::End => return Ok((out, true)),
                    Decoded::More => break,
                }
            }
        }
        Ok((out, d.is_done()))
    }

    #[test]
    fn chunked_bodies_in_any_pieces() {
        let body = b"5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nx-trailer: t\r\n\r\n";
        for step in 1..body.len() {
            assert_eq!(
                decode_all(Framing::Chunked, body, step),
                Ok((b"hello world".to_vec(), true)),
                "{step}"
            );
        }
        assert_eq!(
            decode_all(Framing::Chunked, b"5 \r\nhello\r\n0\r\n\r\n", 64),
            Ok((b"hello".to_vec(), true))
        );
    }

    #[test]
    fn chunked_errors() {
        let err = |b: &[u8]| decode_all(Framing::Chunked, b, 3).err();
        assert_eq!(
            err(b"fffffffffffffffff\r\n"),
            Some(ParseError::ChunkOverflow)
        );
        assert_eq!(
            err(b"ffffffffffffffffffffffff"),
            Some(ParseError::ChunkOverflow)
        );
        assert_eq!(err(b"zz\r\n"), Some(ParseError::ChunkSize));
        assert_eq!(err(b"5\nhello"), Some(ParseError::ChunkSize));
        assert_eq!(err(b"5\r\nhelloXX0\r\n\r\n"), Some(ParseError::ChunkEnd));
        assert_eq!(err(b"5 x\r\nhello\r\n"), Some(ParseError::ChunkSize));
        let long = [b"5;".as_slice(), &[b'a'; MAX_CHUNK_LINE]].concat();
        assert_eq!(err(&long), Some(ParseError::ChunkSize));
        let trailers = [
            b"0\r\n".as_slice(),
            &b"x: y\r\n".repeat(MAX_TRAILERS / 6 + 1),
        ]
        .concat();
        assert_eq!(err(&trailers), Some(ParseError::Trailers));
    }

    /// Head, body bytes and end of a response fed in `pieces` (the fuzz target's property,
    /// here over random responses built from fragments, so a plain test run checks it too).
    fn read(pieces: &[&[u8]], head_request: bool) -> String {
        let mut buf = BytesMut::new();
        let mut rest = pieces.iter();
        let head = loop {
            match parse_head(&buf, head_request) {
                Err(e) => return format!("head error {e:?}"),
                Ok(Some((h, n))) => {
                    buf.advance(n);
                    if !h.is_informational() {
                        break h;
                    }
                }
                Ok(None) => match rest.next() {
                    Some(p) => buf.extend_from_slice(p),
                    None => return "no head".into(),
                },
            }
        };
        let mut d = Decoder::new(head.framing);
        let mut body = Vec::new();
        let end = loop {
            match d.decode(&mut buf) {
                Err(e) => break format!("{e:?}"),
                Ok(Decoded::Data(b)) => body.extend_from_slice(&b),
                Ok(Decoded::End) => break "end".into(),
                Ok(Decoded::More) => match rest.next() {
                    Some(p) => buf.extend_from_slice(p),
                    None => break format!("eof complete={}", d.at_eof()),
                },
            }
        };
        format!(
            "{} {:?} {} {body:?} {end}",
            head.status, head.framing, head.keep_alive
        )
    }

    #[test]
    fn any_split_reads_the_same_response() {
        let fragments: [&[u8]; 14] = [
            b"HTTP/1.1 200 OK\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\n",
            b"HTTP/1.0 204 No Content\r\n",
            b"content-length: 5\r\n",
            b"transfer-encoding: chunked\r\n",
            b"connection: close\r\n",
            b"\r\n",
            b"5\r\nhello\r\n",
            b"0\r\n\r\n",
            b"3;x=1\r\nabc\r\n",
            b"x-t: 1\r\n",
            b"fffffffffffffffff\r\n",
            b"\n",
            b"hello",
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        for _ in 0..3000 {
            let input: Vec<u8> = (0..1 + next(9))
                .flat_map(|_| fragments[next(14)].to_vec())
                .collect();
            let head_request = next(2) == 1;
            let whole = read(&[&input], head_request);
            let mut cuts: Vec<usize> = (0..next(6)).map(|_| next(input.len() + 1)).collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut from = 0;
            for c in cuts {
                pieces.push(&input[from..c]);
                from = c;
            }
            pieces.push(&input[from..]);
            assert_eq!(
                read(&pieces, head_request),
                whole,
                "{:?}",
                String::from_utf8_lossy(&input)
            );
            let bytes: Vec<&[u8]> = input.chunks(1).collect();
            assert_eq!(
                read(&bytes, head_request),
                whole,
                "{:?}",
                String::from_utf8_lossy(&input)
            );
        }
    }

    #[test]
    fn length_and_close_bodies() {
        assert_eq!(
            decode_all(Framing::Length(5), b"hel", 2),
            Ok((b"hel".to_vec(), false))
        );
        let mut d = Decoder::new(Framing::Length(3));
        let mut buf = BytesMut::from(&b"abcNEXT"[..]);
        assert_eq!(
            d.decode(&mut buf),
            Ok(Decoded::Data(Bytes::from_static(b"abc")))
        );
        assert_eq!(d.decode(&mut buf), Ok(Decoded::End));
        assert_eq!(&buf[..], b"NEXT", "bytes after the body stay in the buffer");
        let mut d = Decoder::new(Framing::Close);
        assert!(!d.is_done());
        assert!(d.at_eof());
        assert!(!Decoder::new(Framing::Length(1)).at_eof());
    }
}
