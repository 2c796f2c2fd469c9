//! Incremental Server-Sent Events framing.
//!
//! [`SseScanner`] is fed chunks as they arrive and yields complete events (the bytes up to and
//! including the blank line that ends them). It accepts `\n`, `\r\n` and `\r` line ends, `data:`
//! with or without the space (TGI omits it), and comment lines. Only the unfinished tail of the
//! stream is buffered, and it is capped: a backend that never ends an event cannot grow memory
//! without bound.

use bytes::{Buf, Bytes, BytesMut};

/// Largest event accepted; beyond this the stream is treated as broken.
pub const MAX_EVENT_BYTES: usize = 8 * 1024 * 1024;

#[derive(Debug, Default)]
pub struct SseScanner {
    buf: BytesMut,
    /// Bytes of `buf` already searched for an event end.
    scanned: usize,
}

#[derive(Debug, thiserror::Error)]
#[error("an SSE event exceeded {MAX_EVENT_BYTES} bytes")]
pub struct EventTooLarge;

impl SseScanner {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append a chunk; then call [`next_event`](Self::next_event) until it returns `None`.
    pub fn feed(&mut self, chunk: &[u8]) -> Result<(), EventTooLarge> {
        if self.buf.len() + chunk.len() > MAX_EVENT_BYTES {
            return Err(EventTooLarge);
        }
        self.buf.extend_from_slice(chunk);
        Ok(())
    }

    /// The next complete event, raw (terminator included).
    pub fn next_event(&mut self) -> Option<Bytes> {
        let end = find_event_end(&self.buf, self.scanned.saturating_sub(3))?;
        self.scanned = 0;
        Some(self.buf.split_to(end).freeze())
    }

    /// Bytes of an unfinished event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Take whatever is buffered (at end of stream).
    pub fn take_rest(&mut self) -> Bytes {
        self.scanned = 0;
        let n = self.buf.len();
        let out = self.buf.split_to(n).freeze();
        self.buf.advance(0);
        out
    }

    /// Mark everything buffered as searched (call when `next_event` returned `None`).
    pub fn mark_scanned(&mut self) {
        self.scanned = self.buf.len();
    }
}

/// Offset just past the first blank line (event end) at or after `from`.
fn find_event_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while i < buf.len() {
        match buf[i] {
            b'\n' => {
                // "\n\n" or "\n\r\n"
                if buf.get(i + 1) == Some(&b'\n') {
                    return Some(i + 2);
                }
                if buf.get(i + 1) == Some(&b'\r') && buf.get(i + 2) == Some(&b'\n') {
                    return Some(i + 3);
                }
            }
            // "\r\r" ("\r\n\r\n" is caught at its '\n')
            b'\r' if buf.get(i + 1) == Some(&b'\r') => return Some(i + 2),
            _ => {}
        }
        i += 1;
    }
    None
}

/// The data of an event: its `data:` lines joined with `\n` (one leading space stripped per
/// line, as the SSE spec and the OpenAI SDK do). `None` for events without data (comments).
pub fn event_data(event: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    for line in event.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            match &mut out {
                None => out = Some(rest.to_vec()),
                Some(v) => {
                    v.push(b'\n');
                    v.extend_from_slice(rest);
                }
            }
        }
    }
    out
}

/// The single `data:` payload of the common one-line event, borrowed when possible.
pub fn event_data_borrowed(event: &[u8]) -> Option<std::borrow::Cow<'_, [u8]>> {
    let trimmed = trim_end_newlines(event);
    if let Some(rest) = trimmed.strip_prefix(b"data:") {
        if !rest.contains(&b'\n') && !rest.contains(&b'\r') {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            return Some(std::borrow::Cow::Borrowed(rest));
        }
    }
    event_data(event).map(std::borrow::Cow::Owned)
}

fn trim_end_newlines(b: &[u8]) -> &[u8] {
    let mut end = b.len();
    while end > 0 && (b[end - 1] == b'\n' || b[end - 1] == b'\r') {
        end -= 1;
    }
    &b[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(chunks: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut s = SseScanner::new();
        let mut out = Vec::new();
        for c in chunks {
            s.feed(c).unwrap();
            while let Some(e) = s.next_event() {
                out.push(e.to_vec());
            }
            s.mark_scanned();
        }
        out
    }

    #[test]
    fn splits_across_chunk_boundaries() {
        let got = events(&[b"data: {\"a\"", b":1}\n", b"\ndata: [DONE]\n\n"]);
        assert_eq!(
            got,
            vec![
                b"data: {\"a\":1}\n\n".to_vec(),
                b"data: [DONE]\n\n".to_vec()
            ]
        );
        let got = events(&[b"data:x\r\n\r", b"\ndata:y\r\r"]);
        assert_eq!(got.len(), 2);
    }

    #[test]
    fn data_with_and_without_space_and_comments() {
        assert_eq!(event_data(b"data:{\"x\":1}\n\n").unwrap(), b"{\"x\":1}");
        assert_eq!(event_data(b"data: {\"x\":1}\n\n").unwrap(), b"{\"x\":1}");
        assert_eq!(event_data(b": keep-alive\n\n"), None);
        assert_eq!(
            event_data(b"event: e\ndata: a\ndata: b\n\n").unwrap(),
            b"a\nb"
        );
        assert_eq!(
            &*event_data_borrowed(b"data: [DONE]\n\n").unwrap(),
            b"[DONE]"
        );
    }

    #[test]
    fn caps_an_endless_event() {
        let mut s = SseScanner::new();
        let big = vec![b'a'; 1024 * 1024];
        let mut failed = false;
        for _ in 0..20 {
            if s.feed(&big).is_err() {
                failed = true;
                break;
            }
            assert!(s.next_event().is_none());
            s.mark_scanned();
        }
        assert!(failed);
    }
}
