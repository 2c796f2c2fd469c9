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
