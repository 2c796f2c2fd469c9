//! Incremental Server-Sent Events framing.
//!
//! [`SseScanner`] is fed chunks as they arrive and yields complete events (the bytes up to and
//! including the blank line that ends them). Lines end as the SSE spec says: `\r\n`, `\n` or
//! a lone `\r`, so the gateway reads an event exactly as an SDK client would (a `\r` ending a
//! line at the end of a chunk waits for the next byte: it may be the first half of `\r\n`). `data:` with or
//! without the space (TGI omits it) and comment lines are accepted. Only the unfinished tail of
//! the stream is buffered, and it is capped: a backend that never ends an event cannot grow
//! memory without bound. Each byte is searched once, however the stream is split.

use bytes::{Bytes, BytesMut};

/// Largest event accepted; beyond this the stream is treated as broken.
pub const MAX_EVENT_BYTES: usize = 8 * 1024 * 1024;

#[derive(Debug, Default)]
pub struct SseScanner {
    buf: BytesMut,
    /// Where the unfinished line of the buffered event starts.
    line_start: usize,
    /// Bytes of `buf` before this hold no line end not accounted for.
    search_from: usize,
    /// Lines of the buffered event ended so far.
    lines: usize,
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
        let end = self.find_event_end()?;
        self.line_start = 0;
        self.search_from = 0;
        self.lines = 0;
        Some(self.buf.split_to(end).freeze())
    }

    /// Bytes of an unfinished event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }

    /// Take whatever is buffered (at end of stream).
    pub fn take_rest(&mut self) -> Bytes {
        self.line_start = 0;
        self.search_from = 0;
        self.lines = 0;
        let n = self.buf.len();
        self.buf.split_to(n).freeze()
    }

    /// Offset just past the blank line that ends the buffered event, if it has arrived.
    /// A blank line before any other line of an event starts it (it dispatches nothing, as
    /// for a client), so stray line ends travel with the event that follows them.
    fn find_event_end(&mut self) -> Option<usize> {
        loop {
            let rel = memchr::memchr2(b'\r', b'\n', &self.buf[self.search_from..]);
            let Some(rel) = rel else {
                self.search_from = self.buf.len();
                return None;
            };
            let at = self.search_from + rel;
            if at == self.line_start && self.lines > 0 {
                // A blank line ends the event at its first byte. The `\n` of a `\r\n` then
                // leads the next event (a blank line there, which dispatches nothing), so the
                // cut does not depend on where the stream was split.
                return Some(at + 1);
            }
            let len = if self.buf[at] == b'\n' {
                1
            } else {
                match self.buf.get(at + 1) {
                    Some(b'\n') => 2,
                    Some(_) => 1,
                    // The line's `\r` may be the first half of a `\r\n`: wait for the next byte.
                    None => {
                        self.search_from = at;
                        return None;
                    }
                }
            };
            self.lines += 1;
            self.line_start = at + len;
            self.search_from = at + len;
        }
    }
}

/// The lines of `event` without their line ends (`\r\n`, `\n` or `\r`).
pub fn lines(event: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(event);
    std::iter::from_fn(move || {
        let cur = rest?;
        match memchr::memchr2(b'\r', b'\n', cur) {
            None => {
                rest = None;
                (!cur.is_empty()).then_some(cur)
            }
            Some(i) => {
                let len = if cur[i] == b'\r' && cur.get(i + 1) == Some(&b'\n') {
                    2
                } else {
                    1
                };
                rest = Some(&cur[i + len..]);
                Some(&cur[..i])
            }
        }
    })
}

/// The value of a `data` field line (`data:value`, `data: value` or a bare `data`).
fn data_value(line: &[u8]) -> Option<&[u8]> {
    if line == b"data" {
        return Some(b"");
    }
    let rest = line.strip_prefix(b"data:")?;
    Some(rest.strip_prefix(b" ").unwrap_or(rest))
}

/// The data of an event: its `data` lines joined with `\n` (one leading space stripped per
/// line, as the SSE spec and the OpenAI SDK do). `None` for events without data (comments).
pub fn event_data(event: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    for value in lines(event).filter_map(data_value) {
        match &mut out {
            None => out = Some(value.to_vec()),
            Some(v) => {
                v.push(b'\n');
                v.extend_from_slice(value);
            }
        }
    }
    out
}

/// The single `data:` payload of the common one-line event, borrowed when possible.
pub fn event_data_borrowed(event: &[u8]) -> Option<std::borrow::Cow<'_, [u8]>> {
    let trimmed = trim_newlines(event);
    if let Some(rest) = trimmed.strip_prefix(b"data:") {
        if memchr::memchr2(b'\n', b'\r', rest).is_none() {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            return Some(std::borrow::Cow::Borrowed(rest));
        }
    }
    event_data(event).map(std::borrow::Cow::Owned)
}

/// `b` without the line ends around it (an event ends with them; after a `\r\n` blank line
/// the next event starts with the `\n`).
fn trim_newlines(b: &[u8]) -> &[u8] {
    let is_end = |c: &u8| *c == b'\n' || *c == b'\r';
    let start = b.iter().position(|c| !is_end(c)).unwrap_or(b.len());
    let end = b.iter().rposition(|c| !is_end(c)).map_or(start, |i| i + 1);
    &b[start..end]
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

    /// Every way of splitting `stream` into two chunks yields the same events.
    fn same_split_anywhere(stream: &[u8]) -> Vec<Vec<u8>> {
        let whole = events(&[stream]);
        for cut in 0..=stream.len() {
            assert_eq!(
                events(&[&stream[..cut], &stream[cut..]]),
                whole,
                "cut at {cut}"
            );
        }
        let bytewise: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(events(&bytewise), whole, "byte by byte");
        whole
    }

    #[test]
    fn a_lone_cr_ends_a_line_as_it_does_for_clients() {
        // One event, two data lines, joined by a lone CR.
        let got = same_split_anywhere(b"data: {\"a\":1}\rdata: 2\n\n");
        assert_eq!(got.len(), 1);
        assert_eq!(event_data(&got[0]).unwrap(), b"{\"a\":1}\n2");
        assert_eq!(&*event_data_borrowed(&got[0]).unwrap(), b"{\"a\":1}\n2");
        // LF then a lone CR is a blank line: two events.
        let got = same_split_anywhere(b"data: 1\n\rdata: 2\r\n\r\n");
        assert_eq!(got.len(), 2);
        assert_eq!(event_data(&got[0]).unwrap(), b"1");
        assert_eq!(event_data(&got[1]).unwrap(), b"2");
        // CRLF is one line end, also split across chunks: not a blank line.
        let got = same_split_anywhere(b"data: 1\r\ndata: 2\r\n\r\ndata: 3\n\n");
        assert_eq!(got.len(), 2);
        assert_eq!(event_data(&got[0]).unwrap(), b"1\n2");
        assert_eq!(got[1], b"\ndata: 3\n\n".to_vec());
        assert!(matches!(
            event_data_borrowed(&got[1]),
            Some(std::borrow::Cow::Borrowed(b"3"))
        ));
        // Mixed line ends: CR CR, LF LF, CRLF LF.
        let got = same_split_anywhere(b"data: a\r\rdata: b\n\ndata: c\r\n\n");
        assert_eq!(got.len(), 3);
        // A bare `data` line is an empty data line.
        assert_eq!(event_data(b"data\ndata: x\n\n").unwrap(), b"\nx");
    }

    #[test]
    fn stray_blank_lines_dispatch_nothing() {
        let got = same_split_anywhere(b"data: 1\n\n\n\rdata: 2\n\n\n");
        let data: Vec<Vec<u8>> = got.iter().filter_map(|e| event_data(e)).collect();
        assert_eq!(data, vec![b"1".to_vec(), b"2".to_vec()]);
        assert_eq!(got.concat(), b"data: 1\n\n\n\rdata: 2\n\n".to_vec());
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
        }
        assert!(failed);
    }
}
