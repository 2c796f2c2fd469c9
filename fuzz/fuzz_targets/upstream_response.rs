//! The plain-http client's response reader (`upstream::h1::parse`) never panics, and reads the
//! same response whatever pieces the bytes arrive in: the whole input at once, split at points
//! the input chooses, and byte by byte (inputs up to 512 bytes) give the same head, the same
//! body bytes and the same end. A body never has more bytes than the input after its head; a
//! length-framed body never more than its length. Byte 0: bit 0 = the request was HEAD,
//! bits 1–4 = number of split points.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use sluice::upstream::h1::parse::{parse_head, Decoded, Decoder, Framing, ParseError};

/// What the reader made of a response.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// The input ended before a final head.
    NoHead,
    HeadError(ParseError),
    Response {
        status: u16,
        fields: usize,
        framing: Framing,
        keep_alive: bool,
        /// 1xx heads skipped before it.
        informational: usize,
        body: Vec<u8>,
        /// How the body ended: complete, cut by the end of input, or an error.
        end: Result<bool, ParseError>,
        /// Bytes after a complete body.
        after: usize,
    },
}

/// Feed `pieces` as a connection would deliver them.
fn read(pieces: &[&[u8]], head_request: bool) -> Outcome {
    let mut buf = BytesMut::new();
    let mut rest = pieces.iter();
    let mut informational = 0;
    let head = loop {
        match parse_head(&buf, head_request) {
            Err(e) => return Outcome::HeadError(e),
            Ok(Some((head, n))) => {
                let _ = buf.split_to(n);
                if head.is_informational() {
                    informational += 1;
                    continue;
                }
                break head;
            }
            Ok(None) => match rest.next() {
                Some(p) => buf.extend_from_slice(p),
                None => return Outcome::NoHead,
            },
        }
    };
    let body_input = buf.len() + rest.clone().map(|p| p.len()).sum::<usize>();
    let mut decoder = Decoder::new(head.framing);
    let mut body = Vec::new();
    let end = loop {
        match decoder.decode(&mut buf) {
            Err(e) => break Err(e),
            Ok(Decoded::Data(b)) => {
                assert!(!b.is_empty(), "an empty data frame");
                body.extend_from_slice(&b);
            }
            Ok(Decoded::End) => break Ok(true),
            Ok(Decoded::More) => match rest.next() {
                Some(p) => buf.extend_from_slice(p),
                None => break Ok(decoder.at_eof()),
            },
        }
    };
    let after = if end == Ok(true) {
        buf.len() + rest.map(|p| p.len()).sum::<usize>()
    } else {
        0
    };
    assert!(body.len() <= body_input);
    if let Framing::Length(n) = head.framing {
        assert!(body.len() as u64 <= n);
        assert_eq!(end == Ok(true), body.len() as u64 == n);
    }
    if head.framing == Framing::Empty {
        assert!(body.is_empty() && end == Ok(true));
    }
    Outcome::Response {
        status: head.status.as_u16(),
        fields: head.headers.len(),
        framing: head.framing,
        keep_alive: head.keep_alive,
        informational,
        body,
        end,
        after,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, input)) = data.split_first() else {
        return;
    };
    let head_request = flags & 1 == 1;
    let whole = read(&[input], head_request);
    let splits = usize::from((flags >> 1) & 0x0f);
    let mut cuts: Vec<usize> = input
        .iter()
        .take(splits)
        .map(|b| usize::from(*b) * input.len() / 256)
        .collect();
    cuts.sort_unstable();
    let mut pieces = Vec::new();
    let mut from = 0;
    for c in cuts {
        pieces.push(&input[from..c]);
        from = c;
    }
    pieces.push(&input[from..]);
    assert_eq!(read(&pieces, head_request), whole, "split at chosen points");
    if input.len() <= 512 {
        let bytes: Vec<&[u8]> = input.chunks(1).collect();
        assert_eq!(read(&bytes, head_request), whole, "byte by byte");
    }
});
