//! A translated stream: the backend's chat-completions events read with the shared SSE
//! scanner and handed one by one to the client API's [`StreamReply`], whose events become the
//! body the observer ([`super::observe::ObservedStream`]) reads, inspects and passes on — so the
//! observer knows nothing of translation and a translated stream is accounted, limited and
//! ended on failure exactly as a native one.
//!
//! Invariants: bytes are yielded only as whole client-API events; after `[DONE]` (or a
//! backend's in-stream error) the rest of the backend's body is read and dropped; a chunk of
//! the backend that yields no event still yields an empty frame, so the observer's idle timer
//! follows the backend, not the translation; a broken backend body is passed on as an error.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};

use super::sse::{event_data_borrowed, SseScanner};
use crate::api::translate::StreamReply;

/// The client-API body of a translated stream (`B`: the backend's chat stream).
pub struct TranslatedBody<B> {
    upstream: B,
    scanner: SseScanner,
    reply: Box<dyn StreamReply>,
    out: BytesMut,
    /// The client's stream is over (`[DONE]`, or a backend's error): the rest is dropped.
    over: bool,
    /// The backend's body has ended.
    ended: bool,
}

impl<B> TranslatedBody<B> {
    pub fn new(upstream: B, reply: Box<dyn StreamReply>) -> Self {
        TranslatedBody {
            upstream,
            scanner: SseScanner::new(),
            reply,
            out: BytesMut::new(),
            over: false,
            ended: false,
        }
    }

    /// Translate the complete events buffered so far.
    fn drain(&mut self) {
        while let Some(event) = self.scanner.next_event() {
            self.one(&event);
        }
    }

    fn one(&mut self, event: &[u8]) {
        if self.over {
            return;
        }
        let Some(data) = event_data_borrowed(event) else {
            return; // a comment or keep-alive
        };
        if data.as_ref() == b"[DONE]" {
            self.reply.end(&mut self.out);
            self.over = true;
        } else if !self.reply.event(&data, &mut self.out) {
            self.over = true;
        }
    }

    fn finish(&mut self) {
        let rest = self.scanner.take_rest();
        if !rest.is_empty() {
            self.one(&rest);
        }
        if !self.over {
            // Ended without `[DONE]`: complete only if the backend said why it stopped.
            self.reply.end(&mut self.out);
            self.over = true;
        }
        self.ended = true;
    }
}

impl<B> Body for TranslatedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Data = Bytes;
    type Error = String;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, String>>> {
        let this = self.get_mut();
        loop {
            if !this.out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(this.out.split().freeze()))));
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if let Err(e) = this.scanner.feed(&data) {
                        return Poll::Ready(Some(Err(e.to_string())));
                    }
                    this.drain();
                    if this.out.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::new()))));
                    }
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.to_string()))),
                Poll::Ready(None) => this.finish(),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.out.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::convert::Infallible;

    const STREAM: &[u8] = b"data:{\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n: keep-alive\n\n\
        data:{\"choices\":[{\"delta\":{\"content\":\" you\"},\"finish_reason\":\"length\"}]}\n\n\
        data:{\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\ndata:[DONE]\n\n";

    async fn translate(chunks: Vec<&'static [u8]>) -> (String, Option<String>) {
        let frames: Vec<Result<Frame<Bytes>, Infallible>> = chunks
            .into_iter()
            .map(|c| Ok(Frame::data(Bytes::from_static(c))))
            .collect();
        let upstream = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
        let translation = crate::api::translate::messages::TRANSLATOR
            .request(br#"{"model":"m","max_tokens":2,"messages":[]}"#, true)
            .unwrap();
        let mut body = TranslatedBody::new(upstream, translation.reply.stream());
        let mut out = Vec::new();
        let mut error = None;
        while let Some(frame) = body.frame().await {
            match frame {
                Ok(f) => out.extend_from_slice(&f.into_data().unwrap()),
                Err(e) => error = Some(e),
            }
        }
        (String::from_utf8(out).unwrap(), error)
    }

    fn kinds(text: &str) -> Vec<String> {
        text.lines()
            .filter_map(|l| l.strip_prefix("event: "))
            .map(String::from)
            .collect()
    }

    #[tokio::test]
    async fn the_same_events_however_the_backend_cuts_its_stream() {
        let (whole, _) = translate(vec![STREAM]).await;
        let expected = [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ];
        assert_eq!(kinds(&whole), expected);
        assert!(whole.contains(r#""stop_reason":"max_tokens""#), "{whole}");
        for cut in [1, 17, 40, 90, STREAM.len() - 3] {
            let (a, b) = STREAM.split_at(cut);
            let (text, _) = translate(vec![a, b]).await;
            assert_eq!(kinds(&text), expected, "cut at {cut}");
        }
    }

    #[tokio::test]
    async fn a_stream_ended_early_gets_no_closing_events() {
        let (text, error) = translate(vec![&STREAM[..60]]).await;
        assert!(error.is_none());
        assert_eq!(
            kinds(&text),
            [
                "message_start",
                "content_block_start",
                "content_block_delta"
            ]
        );
        // Ended without `[DONE]` but after the finish and usage: complete.
        let end = STREAM.len() - b"data:[DONE]\n\n".len();
        let (text, _) = translate(vec![&STREAM[..end]]).await;
        assert_eq!(
            kinds(&text).last().map(String::as_str),
            Some("message_stop")
        );
    }
}
