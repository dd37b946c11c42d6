//! The body types the layer hands to the inner service and back to its caller, and the one
//! place a body is buffered (always under an explicit cap).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::mpsc;

use crate::response::Outcome;
use crate::store::BoxError;

pin_project_lite::pin_project! {
    /// The request body the inner service receives: the caller's own body, streamed, for
    /// requests the layer passes through; the buffered bytes for keyed requests (which had to be
    /// read to take their fingerprint).
    pub struct RequestBody<B> {
        #[pin]
        kind: RequestKind<B>,
    }
}

pin_project_lite::pin_project! {
    #[project = RequestKindProj]
    enum RequestKind<B> {
        Streaming { #[pin] inner: B },
        Buffered { data: Option<Bytes> },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn streaming(inner: B) -> Self {
        Self {
            kind: RequestKind::Streaming { inner },
        }
    }

    pub(crate) fn buffered(data: Bytes) -> Self {
        Self {
            kind: RequestKind::Buffered {
                data: (!data.is_empty()).then_some(data),
            },
        }
    }

    /// Whether the layer read this body whole before calling the inner service (a keyed
    /// request's, read to take its fingerprint) rather than handing on the caller's stream.
    pub fn is_buffered(&self) -> bool {
        matches!(self.kind, RequestKind::Buffered { .. })
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            RequestKindProj::Streaming { inner } => inner.poll_frame(cx),
            RequestKindProj::Buffered { data } => {
                Poll::Ready(data.take().map(|d| Ok(Frame::data(d))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            RequestKind::Streaming { inner } => inner.is_end_stream(),
            RequestKind::Buffered { data } => data.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            RequestKind::Streaming { inner } => inner.size_hint(),
            RequestKind::Buffered { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The response body the layer returns: the inner service's own, streamed; a body the layer
    /// holds whole (a captured response, a replay, a problem); or a response too large to keep,
    /// whose start was read and whose rest is being relayed.
    pub struct ResponseBody<B> {
        #[pin]
        kind: ResponseKind<B>,
        // What the layer decided, carried here on its way out: [`ResponseFuture`] moves it
        // into the response's extensions, unless the layer was built for the proxy, which
        // reads it here (an extension costs a map and two boxes per response).
        //
        // [`ResponseFuture`]: crate::ResponseFuture
        outcome: Option<Outcome>,
    }
}

pin_project_lite::pin_project! {
    #[project = ResponseKindProj]
    enum ResponseKind<B> {
        Inner { #[pin] inner: B },
        Full { data: Option<Bytes> },
        Relayed { head: Option<Bytes>, rest: mpsc::Receiver<Result<Bytes, BoxError>> },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(inner: B) -> Self {
        Self {
            kind: ResponseKind::Inner { inner },
            outcome: None,
        }
    }

    /// A body held whole: `data`, then the end of the body.
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http_body::Body;
    /// use idemgate::body::ResponseBody;
    ///
    /// let body: ResponseBody<String> = ResponseBody::full(Bytes::from_static(b"done"));
    /// assert_eq!(body.size_hint().exact(), Some(4));
    /// ```
    pub fn full(data: Bytes) -> Self {
        Self {
            kind: ResponseKind::Full {
                data: (!data.is_empty()).then_some(data),
            },
            outcome: None,
        }
    }

    pub(crate) fn relayed(head: Bytes, rest: mpsc::Receiver<Result<Bytes, BoxError>>) -> Self {
        Self {
            kind: ResponseKind::Relayed {
                head: Some(head),
                rest,
            },
            outcome: None,
        }
    }

    /// What the layer decided about this response, while the body carries it: always for a
    /// layer built with [`IdempotencyLayer::outcome_on_body_only`], which leaves it here;
    /// otherwise `None` once the response is out of the layer (the outcome has moved into
    /// the response's extensions).
    ///
    /// [`IdempotencyLayer::outcome_on_body_only`]: crate::IdempotencyLayer::outcome_on_body_only
    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    pub(crate) fn set_outcome(&mut self, outcome: Outcome) {
        self.outcome = Some(outcome);
    }

    pub(crate) fn take_outcome(&mut self) -> Option<Outcome> {
        self.outcome.take()
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.project().kind.project() {
            ResponseKindProj::Inner { inner } => inner.poll_frame(cx).map_err(Into::into),
            ResponseKindProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            ResponseKindProj::Relayed { head, rest } => {
                if let Some(head) = head.take() {
                    return Poll::Ready(Some(Ok(Frame::data(head))));
                }
                Poll::Ready(ready!(rest.poll_recv(cx)).map(|r| r.map(Frame::data)))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            ResponseKind::Inner { inner } => inner.is_end_stream(),
            ResponseKind::Full { data } => data.is_none(),
            ResponseKind::Relayed { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            ResponseKind::Inner { inner } => inner.size_hint(),
            ResponseKind::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            ResponseKind::Relayed { .. } => SizeHint::default(),
        }
    }
}

/// Why [`read_capped`] stopped.
#[derive(Debug)]
pub(crate) enum Capped<B, E> {
    /// The body went past the cap. Holds what was read and the unread rest.
    Over { head: Bytes, rest: B },
    /// The body failed.
    Failed(E),
}

/// Reads `body` in full if it is at most `cap` bytes. A body whose declared length is over the
/// cap is refused before anything is read. Trailers are dropped.
///
/// Not an `async fn`: its state would hold the body twice (the argument, and the local it is
/// moved into as it starts), and an inner service's response body may be large.
#[allow(
    clippy::manual_async_fn,
    reason = "an async fn would hold the body twice (above)"
)]
pub(crate) fn read_capped<B>(
    mut body: B,
    cap: usize,
) -> impl Future<Output = Result<Bytes, Capped<B, B::Error>>>
where
    B: Body<Data = Bytes> + Unpin,
{
    async move {
        if body.size_hint().lower() > cap as u64 {
            return Err(Capped::Over {
                head: Bytes::new(),
                rest: body,
            });
        }
        // Most bodies arrive as one frame: keep it as it is, copy only when a second one comes.
        let mut first: Option<Bytes> = None;
        let mut joined: Option<BytesMut> = None;
        let mut len = 0usize;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(Capped::Failed)?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            if data.is_empty() {
                continue;
            }
            len += data.len();
            let over = len > cap;
            match (&mut first, &mut joined) {
                (None, None) => first = Some(data),
                (Some(f), None) => {
                    let mut buf = BytesMut::with_capacity((len).min(cap.saturating_add(1)));
                    buf.extend_from_slice(f);
                    buf.extend_from_slice(&data);
                    first = None;
                    joined = Some(buf);
                }
                (_, Some(buf)) => buf.extend_from_slice(&data),
            }
            if over {
                let head = joined.map_or_else(|| first.unwrap_or_default(), BytesMut::freeze);
                return Err(Capped::Over { head, rest: body });
            }
        }
        Ok(joined.map_or_else(|| first.unwrap_or_default(), BytesMut::freeze))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;

    /// A body that yields the given chunks one frame at a time, with no size hint.
    #[derive(Debug)]
    struct Chunks(std::collections::VecDeque<&'static [u8]>);

    impl Body for Chunks {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(
                self.0
                    .pop_front()
                    .map(|c| Ok(Frame::data(Bytes::from_static(c)))),
            )
        }
    }

    fn chunks(parts: &[&'static [u8]]) -> Chunks {
        Chunks(parts.iter().copied().collect())
    }

    #[tokio::test]
    async fn reads_whole_bodies_under_the_cap() {
        let b = read_capped(chunks(&[b"ab", b"cd", b"e"]), 5).await.unwrap();
        assert_eq!(b.as_ref(), b"abcde");
        let b = read_capped(Full::new(Bytes::from_static(b"xyz")), 3)
            .await
            .unwrap();
        assert_eq!(b.as_ref(), b"xyz");
    }

    #[tokio::test]
    async fn stops_past_the_cap_and_keeps_the_rest() {
        let Err(Capped::Over { head, mut rest }) =
            read_capped(chunks(&[b"ab", b"cd", b"ef"]), 3).await
        else {
            panic!("expected over");
        };
        assert_eq!(head.as_ref(), b"abcd");
        let tail = rest.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(tail.as_ref(), b"ef");
    }

    #[tokio::test]
    async fn declared_length_over_the_cap_is_refused_unread() {
        let Err(Capped::Over { head, .. }) =
            read_capped(Full::new(Bytes::from_static(b"12345")), 4).await
        else {
            panic!("expected over");
        };
        assert!(head.is_empty());
    }

    #[tokio::test]
    async fn a_request_body_says_whether_it_was_read_whole() {
        let streamed = RequestBody::streaming(Full::new(Bytes::from_static(b"abc")));
        assert!(!streamed.is_buffered());
        for data in [&b"abc"[..], b""] {
            let mut held = RequestBody::<Full<Bytes>>::buffered(Bytes::from_static(data));
            assert!(held.is_buffered());
            while held.frame().await.is_some() {}
            assert!(held.is_buffered(), "still held once read");
        }
    }

    #[tokio::test]
    async fn response_body_relays_head_then_rest() {
        let (tx, rx) = mpsc::channel(2);
        let body: ResponseBody<Full<Bytes>> =
            ResponseBody::relayed(Bytes::from_static(b"head"), rx);
        tx.send(Ok(Bytes::from_static(b"-tail"))).await.unwrap();
        drop(tx);
        let all = body.collect().await.unwrap().to_bytes();
        assert_eq!(all.as_ref(), b"head-tail");
    }
}
