//! The HTTP/1.1 client side of an upstream connection, driven by the task of the request that
//! uses it: no task per connection and no channel between a request and its connection.
//!
//! [`Connection::send`] writes a request (head and body) and reads the response head;
//! [`BodyReader`] then reads the response body from the same connection (writing the rest
//! of the request body as it goes, if the upstream answered before it had all of it) and,
//! once the body has been read to its end, hands the connection back for the next request
//! if the response allows it.
//!
//! Parsing is strict: anything this module does not understand for certain (a malformed head
//! or chunk, conflicting lengths, a transfer coding other than `chunked` alone, more than 128
//! fields, a head over 64 KiB: the limits are the `http1::limits` module's) is an error, and
//! the connection is closed rather than reused. Interim `1xx` responses are skipped. Chunked
//! trailers are read and dropped.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, HeaderName, HeaderValue, TRANSFER_ENCODING};
use http::{HeaderMap, Method, StatusCode, Version, request};
use http_body::Body;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use super::chunked::{CHUNK_END, ChunkedDecoder, Decoded, LAST_CHUNK};
use super::codec::{
    Framing, Malformed, ONE_WRITE, Span, asks_to_close, chunked_alone, content_length_of,
    poll_read_more, write_fields, write_request_line,
};
use super::limits::{MAX_RESPONSE_FIELDS, MAX_RESPONSE_HEAD};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What went wrong on an upstream connection.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Reading or writing the socket failed.
    #[error("upstream connection failed")]
    Io(#[from] io::Error),
    /// The upstream closed the connection before the response was complete.
    #[error("the upstream closed the connection before the response was complete")]
    Closed,
    /// The upstream's response was not HTTP/1.1 this client accepts.
    #[error("malformed upstream response: {0}")]
    Malformed(&'static str),
    /// The request body could not be read.
    #[error("the request body failed")]
    RequestBody(#[source] BoxError),
    /// The upstream sent nothing more of its response body for this long.
    #[error("the upstream sent nothing more of its response for {} ms", .0.as_millis())]
    Stalled(Duration),
}

impl From<Malformed> for ClientError {
    fn from(Malformed(what): Malformed) -> Self {
        ClientError::Malformed(what)
    }
}

/// Why [`Connection::send`] gave no response head.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// The connection failed before any of the request was written to it; the request may
    /// go on another connection.
    #[error("the upstream connection was closed before the request was written")]
    Unused(#[source] io::Error),
    /// The request body failed before any of the request was written.
    #[error("the request body failed before it was sent")]
    BodyBeforeSent(#[source] BoxError),
    /// The request was (or may have been) written, and no usable response head came.
    #[error("the upstream gave no response")]
    NoResponse(#[source] ClientError),
    /// No response head came by the deadline; the request may have been written.
    #[error("the upstream gave no response in time")]
    TimedOut,
}

/// A response head as read, with what the client needs to read its body.
#[derive(Debug)]
pub struct ResponseHead {
    /// Status.
    pub status: StatusCode,
    /// Fields, in order.
    pub headers: HeaderMap,
    framing: Framing,
    keep_alive: bool,
    /// What the exchange had not written of the request body when this head came.
    unsent: Option<BodyWriter>,
}

/// One keep-alive HTTP/1.1 connection to the upstream. Held boxed everywhere (the pool, the
/// exchange, the body reader): it goes from one to the next with every request, and each
/// response the proxy relays carries it, so moving it is moving a pointer, not 120 bytes.
#[derive(Debug)]
pub struct Connection {
    io: TcpStream,
    /// Bytes read and not yet used: the rest of a head or a body.
    read: BytesMut,
    /// Where each field of the head being parsed lies (kept to save an allocation per head).
    spans: Vec<(HeaderName, Span)>,
    /// The request head being written (kept, like `spans`).
    out: Vec<u8>,
    /// The deadline of the request in progress. Kept from request to request: moving a
    /// registered timer to a later deadline is one atomic store, where a new timer per
    /// request costs a trip to the runtime's timer wheel to register and one to cancel.
    timer: Option<Pin<Box<Sleep>>>,
}

impl Connection {
    /// Wraps a connected socket.
    pub fn new(io: TcpStream) -> Self {
        Self {
            io,
            read: BytesMut::new(),
            spans: Vec::new(),
            out: Vec::new(),
            timer: None,
        }
    }

    /// Whether an idle connection can take a request: the upstream has not closed it nor
    /// sent anything unasked. Answered from the runtime's readiness state; a syscall is made
    /// only if the socket turned readable while idle.
    pub fn is_usable(&self) -> bool {
        if !self.read.is_empty() {
            return false;
        }
        // `try_read` looks at the runtime's readiness first: on a socket not known to be
        // readable it makes no syscall. Readable while idle means closed (0 bytes) or bytes
        // nobody asked for; a stale readiness left by the last read gives `WouldBlock`.
        let mut probe = [0u8; 1];
        matches!(self.io.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Writes `head` (with `own` in place of the fields it names) and `body`, and reads the
    /// response head, all by `deadline`. `first` carries a body frame
    /// taken from `body` by an attempt whose connection failed before anything was written:
    /// it is sent first, and left in place if this attempt fails the same way.
    ///
    /// A body that does not go out with the head is written while the response is awaited:
    /// an upstream may answer before it has read the whole body (a `413`, or a response it
    /// streams as it reads). Such an early answer stands, on a connection not used again,
    /// and what was not yet written of the body is left in the head for
    /// [`UnsentBody::take`].
    pub async fn send<B>(
        &mut self,
        head: &request::Parts,
        own: &OwnFields<'_>,
        body: &mut B,
        first: &mut Option<Bytes>,
        deadline: Instant,
    ) -> Result<ResponseHead, SendError>
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        let mut timer = set_for(self.timer.take(), deadline);
        let answer = {
            let mut exchange = std::pin::pin!(self.exchange(head, own, body, first));
            poll_fn(|cx| {
                if let Poll::Ready(answer) = exchange.as_mut().poll(cx) {
                    return Poll::Ready(answer);
                }
                ready!(timer.as_mut().poll(cx));
                Poll::Ready(Err(SendError::TimedOut))
            })
            .await
        };
        self.timer = Some(timer);
        answer
    }

    /// The request out and the response head in: the request's framing and its first frame
    /// checked, the head written (with that frame when it is small), then the response head
    /// read, while the rest of the body is written if there is any.
    async fn exchange<B>(
        &mut self,
        head: &request::Parts,
        own: &OwnFields<'_>,
        body: &mut B,
        first: &mut Option<Bytes>,
    ) -> Result<ResponseHead, SendError>
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        let (framing, ended) = take_first_frame(head, body, first)?;
        let coalesced = self.write_head(head, own, framing, first.as_ref()).await?;
        // From here on the request is the upstream's: nothing of it can be sent again.
        let taken = first.as_ref().map_or(0, |data| data.len() as u64);
        let pending = first.take().filter(|_| !coalesced);
        if ended && pending.is_none() && framing != Framing::Chunked {
            // The whole request is out: only the answer is left.
            return read_head(&mut self.io, &mut self.read, &mut self.spans, &head.method)
                .await
                .map_err(SendError::NoResponse);
        }
        let mut writer = BodyWriter::new(framing, if coalesced { taken } else { 0 });
        if let Some(data) = pending {
            writer.push(data).map_err(SendError::NoResponse)?;
        }
        writer.ended = ended;
        self.read_head_while_writing(writer, body, &head.method)
            .await
    }

    /// Writes the request head for `framing`, with `first` after it when that is small:
    /// whether `first` went out. A connection that fails before any of it is written is
    /// [`SendError::Unused`], so the request may go on another one.
    async fn write_head(
        &mut self,
        head: &request::Parts,
        own: &OwnFields<'_>,
        framing: Framing,
        first: Option<&Bytes>,
    ) -> Result<bool, SendError> {
        let out = &mut self.out;
        out.clear();
        encode_head(head, own, framing, out);
        let coalesced = first
            .filter(|data| data.len() <= ONE_WRITE)
            .map(|data| framing.encode_data(data, out))
            .is_some();
        let mut sent = 0;
        while sent < self.out.len() {
            let error = match self.io.write(&self.out[sent..]).await {
                Ok(0) => io::ErrorKind::WriteZero.into(),
                Ok(n) => {
                    sent += n;
                    continue;
                }
                Err(error) => error,
            };
            // Nothing written: the request may go on another connection. Part of it
            // written: the upstream holds a beginning it may act on, so it is not sent again.
            return Err(if sent == 0 {
                SendError::Unused(error)
            } else {
                SendError::NoResponse(ClientError::Io(error))
            });
        }
        Ok(coalesced)
    }

    /// Reads the response head while `writer` writes the rest of `body`. An upstream may
    /// answer before it has the whole body: the answer stands, on a connection not used
    /// again, with what was not written left in it for [`UnsentBody::take`].
    async fn read_head_while_writing<B>(
        &mut self,
        mut writer: BodyWriter,
        body: &mut B,
        method: &Method,
    ) -> Result<ResponseHead, SendError>
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        let (mut reader, mut write_half) = self.io.split();
        let read = read_head(&mut reader, &mut self.read, &mut self.spans, method);
        let mut read = std::pin::pin!(read);
        // `Some(true)`: all written; `Some(false)`: the socket failed, nothing more goes out.
        let mut written_all = None;
        let answer = poll_fn(|cx| {
            if written_all.is_none()
                && let Poll::Ready(result) = writer.poll_write(&mut write_half, body, cx)
            {
                match result {
                    Ok(()) => written_all = Some(true),
                    // The client's body failed or lied about its length: the request is
                    // broken, whatever the upstream does with its part.
                    Err(error @ ClientError::RequestBody(_)) => return Poll::Ready(Err(error)),
                    // The socket failed: the upstream may have answered early and closed.
                    Err(_) => written_all = Some(false),
                }
            }
            read.as_mut().poll(cx)
        })
        .await;
        let mut answer = answer.map_err(SendError::NoResponse)?;
        if written_all != Some(true) {
            // Even once the rest is written, the upstream may not read it: the connection
            // is not used again.
            answer.keep_alive = false;
        }
        if written_all.is_none() {
            answer.unsent = Some(writer);
        }
        Ok(answer)
    }

    /// Up to `left` bytes of body (reading more if none are buffered), taken off `left`.
    fn poll_take(
        &mut self,
        cx: &mut Context<'_>,
        left: &mut u64,
    ) -> Poll<Result<Bytes, ClientError>> {
        if self.read.is_empty() {
            ready!(self.poll_fill(cx))?;
        }
        let n = (*left).min(self.read.len() as u64) as usize;
        *left -= n as u64;
        Poll::Ready(Ok(self.read.split_to(n).freeze()))
    }

    /// Reads what the socket has into the buffer; the upstream closing is [`ClientError::Closed`].
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ClientError>> {
        let n = ready!(poll_read_more(&mut self.io, cx, &mut self.read))?;
        if n == 0 {
            return Poll::Ready(Err(ClientError::Closed));
        }
        Poll::Ready(Ok(()))
    }
}

/// A connection's timer set to fire at `deadline`: the one it had, moved, or a new one.
fn set_for(timer: Option<Pin<Box<Sleep>>>, deadline: Instant) -> Pin<Box<Sleep>> {
    match timer {
        Some(mut timer) => {
            timer.as_mut().reset(deadline);
            timer
        }
        None => Box::pin(tokio::time::sleep_until(deadline)),
    }
}

/// What a body that yields more than its length said is refused with.
const LONGER_THAN_DECLARED: &str = "the request body is longer than its declared length";
const SHORTER_THAN_DECLARED: &str = "the request body is shorter than its declared length";

/// How the request body goes on the wire: with its length when the body knows it (counting
/// `first`, a frame already taken from it), chunked otherwise.
fn request_framing<B: Body>(head: &request::Parts, body: &B, first: Option<&Bytes>) -> Framing {
    let taken = first.map_or(0, |b| b.len() as u64);
    match body.size_hint().exact().map(|n| n.checked_add(taken)) {
        Some(Some(0)) => {
            // Methods that define a body say it is empty; the others send no length.
            if matches!(head.method, Method::POST | Method::PUT | Method::PATCH) {
                Framing::Length(0)
            } else {
                Framing::None
            }
        }
        Some(Some(n)) => Framing::Length(n),
        Some(None) | None => Framing::Chunked,
    }
}

/// The request's framing, and whether its body has ended, with its first frame in `first`
/// when that is at hand without waiting (also when it was taken by an earlier attempt, on a
/// connection that turned out unusable). A body that already says more or less than its
/// length is refused before anything is sent.
fn take_first_frame<B>(
    head: &request::Parts,
    body: &mut B,
    first: &mut Option<Bytes>,
) -> Result<(Framing, bool), SendError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    let framing = request_framing(head, body, first.as_ref());
    // A small first frame goes out with the head: one write for the common request.
    let mut ended = false;
    if first.is_none() {
        match next_data_now(body).map_err(SendError::BodyBeforeSent)? {
            Ready::Data(data) => *first = Some(data),
            Ready::End => ended = true,
            Ready::NotYet => {}
        }
    }
    let ended = ended || body.is_end_stream();
    let taken = first.as_ref().map_or(0, |data| data.len() as u64);
    if taken > framing.most() {
        return Err(SendError::BodyBeforeSent(LONGER_THAN_DECLARED.into()));
    }
    if ended && matches!(framing, Framing::Length(n) if n != taken) {
        return Err(SendError::BodyBeforeSent(SHORTER_THAN_DECLARED.into()));
    }
    Ok((framing, ended))
}

/// Writes a request body after its head, as the socket takes it: each frame checked against
/// the declared length and framed for it. Polled by the exchange until the response head
/// comes and, if the upstream answered before it had the whole body, by the response's
/// [`BodyReader`] after that (see [`UnsentBody`]).
#[derive(Debug)]
pub struct BodyWriter {
    /// Bytes framed and not yet written, front first: a chunk's size line, its data, its CRLF.
    queue: VecDeque<Bytes>,
    framing: Framing,
    /// Body bytes taken so far (framing not counted).
    taken: u64,
    /// The body has no more frames.
    ended: bool,
    /// The end of the framing is queued: once the queue is out, the request is complete.
    closed: bool,
    /// Bytes went out since the last look.
    progressed: bool,
}

impl BodyWriter {
    /// A writer for a body framed as `framing`, of which `taken` bytes went out with the head.
    fn new(framing: Framing, taken: u64) -> Self {
        Self {
            queue: VecDeque::new(),
            framing,
            taken,
            ended: false,
            closed: false,
            progressed: false,
        }
    }

    /// Queues one frame's data, framed; more than the declared length is an error.
    fn push(&mut self, data: Bytes) -> Result<(), ClientError> {
        self.taken = self.taken.saturating_add(data.len() as u64);
        if self.taken > self.framing.most() {
            return Err(ClientError::RequestBody(LONGER_THAN_DECLARED.into()));
        }
        if self.framing == Framing::Chunked {
            let mut size = Vec::with_capacity(18);
            self.framing.write_data_start(data.len(), &mut size);
            self.queue.push_back(Bytes::from(size));
            self.queue.push_back(data);
            self.queue.push_back(Bytes::from_static(CHUNK_END));
        } else {
            self.queue.push_back(data);
        }
        Ok(())
    }

    /// Whether a pending [`BodyWriter::poll_write`] waits for the body rather than the socket:
    /// everything taken so far is written.
    fn awaits_body(&self) -> bool {
        self.queue.is_empty() && !self.ended
    }

    /// Writes what is queued, then takes the body's next frame, until the body and its
    /// framing are all written (`Ready(Ok)`), the socket or the body waits, or either fails.
    fn poll_write<W, B>(
        &mut self,
        io: &mut W,
        body: &mut B,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), ClientError>>
    where
        W: AsyncWrite + Unpin,
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        loop {
            if let Some(front) = self.queue.front_mut() {
                let n = ready!(Pin::new(&mut *io).poll_write(cx, front))?;
                if n == 0 {
                    return Poll::Ready(Err(io::Error::from(io::ErrorKind::WriteZero).into()));
                }
                self.progressed = true;
                front.advance(n);
                if front.is_empty() {
                    self.queue.pop_front();
                }
                continue;
            }
            if self.closed {
                return Poll::Ready(Ok(()));
            }
            if self.ended {
                match self.framing {
                    Framing::Chunked => self.queue.push_back(Bytes::from_static(LAST_CHUNK)),
                    Framing::Length(n) if self.taken != n => {
                        return Poll::Ready(Err(ClientError::RequestBody(
                            SHORTER_THAN_DECLARED.into(),
                        )));
                    }
                    _ => {}
                }
                self.closed = true;
                continue;
            }
            match ready!(poll_next_data(body, cx)) {
                Ok(Some(data)) => self.push(data)?,
                Ok(None) => self.ended = true,
                Err(error) => return Poll::Ready(Err(ClientError::RequestBody(error))),
            }
        }
    }
}

/// The rest of a request body the upstream answered before it had: written by the
/// response's [`BodyReader`] as it reads, for an upstream that answers while it reads (one
/// that streams back what it is sent, or sends its head first) would otherwise wait for the
/// rest forever.
pub struct UnsentBody {
    writer: BodyWriter,
    body: Pin<Box<dyn Body<Data = Bytes, Error = BoxError> + Send>>,
}

impl std::fmt::Debug for UnsentBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnsentBody")
            .field("writer", &self.writer)
            .finish_non_exhaustive()
    }
}

impl UnsentBody {
    /// What is left of `body` to write, if the exchange that gave `head` did not write it all.
    pub fn take<B>(head: &mut ResponseHead, body: B) -> Option<Self>
    where
        B: Body<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError>,
    {
        let writer = head.unsent.take()?;
        Some(Self {
            writer,
            body: Box::pin(http_body_util::BodyExt::map_err(body, Into::into)),
        })
    }
}

/// Reads until a final (non-`1xx`) response head is complete, and parses it.
async fn read_head<R>(
    io: &mut R,
    buf: &mut BytesMut,
    spans: &mut Vec<(HeaderName, Span)>,
    method: &Method,
) -> Result<ResponseHead, ClientError>
where
    R: tokio::io::AsyncRead + Unpin,
{
    loop {
        // An empty buffer (the usual start) has nothing to parse yet.
        let parsed = if buf.is_empty() {
            None
        } else {
            parse_head(buf, spans, method)?
        };
        if let Some(head) = parsed {
            if head.status.is_informational() {
                if head.status == StatusCode::SWITCHING_PROTOCOLS {
                    return Err(ClientError::Malformed("an unrequested protocol switch"));
                }
                continue;
            }
            return Ok(head);
        }
        if poll_fn(|cx| poll_read_more(io, cx, buf)).await? == 0 {
            return Err(ClientError::Closed);
        }
    }
}

/// Fields a sender sets itself on every request, written at the start of the head. The
/// request's own fields of these names are not sent.
#[derive(Clone, Copy, Debug, Default)]
pub struct OwnFields<'a> {
    /// The fields written.
    pub set: &'a [(&'a HeaderName, &'a HeaderValue)],
    /// Names whose request fields are left out: those of `set`, and any others to drop.
    pub replaced: &'a [HeaderName],
}

/// The request line and fields, with `own` in place of the fields it replaces and the framing
/// field for `framing` in place of the request's `Content-Length` and `Transfer-Encoding`.
pub(crate) fn encode_head(
    head: &request::Parts,
    own: &OwnFields<'_>,
    framing: Framing,
    out: &mut Vec<u8>,
) {
    let target = head.uri.path_and_query().map_or("/", |pq| pq.as_str());
    write_request_line(&head.method, target, out);
    for (name, value) in own.set {
        super::codec::encode_field(name, value, out);
    }
    write_fields(&head.headers, out, |name, _| !own.replaced.contains(name));
    framing.write_field(out);
    out.extend_from_slice(b"\r\n");
}

/// What a body has without waiting.
enum Ready {
    Data(Bytes),
    End,
    NotYet,
}

/// The body's next non-empty data frame if it is there without waiting.
fn next_data_now<B>(body: &mut B) -> Result<Ready, BoxError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    if body.is_end_stream() {
        return Ok(Ready::End);
    }
    let mut noop = Context::from_waker(std::task::Waker::noop());
    Ok(match poll_next_data(body, &mut noop) {
        Poll::Ready(next) => next?.map_or(Ready::End, Ready::Data),
        Poll::Pending => Ready::NotYet,
    })
}

/// Polls for the body's next non-empty data frame. Empty frames and trailers are skipped:
/// they have nothing to send upstream.
fn poll_next_data<B>(body: &mut B, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, BoxError>>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    loop {
        match ready!(Pin::new(&mut *body).poll_frame(cx)) {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if !data.is_empty() => return Poll::Ready(Ok(Some(data))),
                _ => continue,
            },
            Some(Err(error)) => return Poll::Ready(Err(error.into())),
            None => return Poll::Ready(Ok(None)),
        }
    }
}

/// Parses a complete response head off the front of `buf`, or `None` if more is needed.
fn parse_head(
    buf: &mut BytesMut,
    spans: &mut Vec<(HeaderName, Span)>,
    method: &Method,
) -> Result<Option<ResponseHead>, ClientError> {
    // Left uninitialised: httparse fills only as many as the head has.
    let mut fields =
        [const { std::mem::MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_RESPONSE_FIELDS];
    let mut response = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut response,
        buf,
        &mut fields,
    );
    // The limit holds for a head however it arrived: one that the last read completed past it
    // is refused like one still growing past it.
    let len = match parsed {
        Ok(httparse::Status::Complete(len)) if len <= MAX_RESPONSE_HEAD => len,
        Ok(httparse::Status::Partial) if buf.len() < MAX_RESPONSE_HEAD => return Ok(None),
        Ok(_) => return Err(ClientError::Malformed("response head too large")),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(ClientError::Malformed("too many header fields"));
        }
        Err(_) => return Err(ClientError::Malformed("not an HTTP/1.x response head")),
    };
    let status = response
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or(ClientError::Malformed("bad status code"))?;
    let version = match response.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    // Where each field lies in the head, so the values can share its bytes.
    spans.clear();
    let mut present = FramingFields::default();
    for field in response.headers.iter() {
        let name = idemgate::headers::field_name(field.name.as_bytes())
            .ok_or(ClientError::Malformed("bad header name"))?;
        present.note(&name);
        spans.push((name, Span::of(field.value, buf)));
    }
    let head = buf.split_to(len).freeze();
    // Room for the response's own fields only. (hyper parses a connection's next request
    // into the map of the response it wrote, and would grow a small one; but the proxy's own
    // HTTP/1.1 loop, which serves nearly every client connection, builds each request's map
    // afresh, and a map of 16 fields or more takes the allocator's slower path for blocks
    // over 1 KiB.)
    let mut headers = HeaderMap::with_capacity(spans.len());
    for (name, value) in spans.drain(..) {
        let value = HeaderValue::from_maybe_shared(head.slice(value.range()))
            .map_err(|_| ClientError::Malformed("bad header value"))?;
        headers.append(name, value);
    }
    let framing = framing(&headers, present, status, method)?;
    // A response with both length fields is suspect (RFC 9112 §6.3): it is read by its
    // Transfer-Encoding, its Content-Length is not passed on, and the connection is closed
    // after it.
    let both_lengths = present.transfer_encoding && present.content_length;
    if both_lengths {
        headers.remove(CONTENT_LENGTH);
    }
    let keep_alive = version == Version::HTTP_11
        && framing != Framing::UntilClose
        && !both_lengths
        && !(present.connection && asks_to_close(&headers));
    Ok(Some(ResponseHead {
        status,
        headers,
        framing,
        keep_alive,
        unsent: None,
    }))
}

/// Which of the fields that frame a response it has, noted while its head is parsed so the
/// usual response (no `Transfer-Encoding`, no `Connection`) costs no lookup for them.
#[derive(Clone, Copy, Debug, Default)]
struct FramingFields {
    transfer_encoding: bool,
    content_length: bool,
    connection: bool,
}

impl FramingFields {
    fn note(&mut self, name: &HeaderName) {
        if name == TRANSFER_ENCODING {
            self.transfer_encoding = true;
        } else if name == CONTENT_LENGTH {
            self.content_length = true;
        } else if name == CONNECTION {
            self.connection = true;
        }
    }
}

/// How the body of a response to `method` with `status` and `headers` (which has the framing
/// fields in `present`) is delimited (RFC 9112 §6.3).
fn framing(
    headers: &HeaderMap,
    present: FramingFields,
    status: StatusCode,
    method: &Method,
) -> Result<Framing, ClientError> {
    if method == Method::CONNECT && status.is_success() {
        return Err(ClientError::Malformed(
            "a tunnel, which the gateway does not relay",
        ));
    }
    if method == Method::HEAD
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::None);
    }
    if present.transfer_encoding {
        // Any other coding (`gzip, chunked`, `gzip`) would be passed on, and kept, as if the
        // body were plain: the response is refused like any head this client cannot read.
        if !chunked_alone(headers) {
            return Err(ClientError::Malformed(
                "a transfer coding other than chunked alone",
            ));
        }
        return Ok(Framing::Chunked);
    }
    // Looked up only when the head has one.
    if !present.content_length {
        return Ok(Framing::UntilClose);
    }
    Ok(match content_length_of(headers)? {
        Some(0) => Framing::None,
        Some(n) => Framing::Length(n),
        None => Framing::UntilClose,
    })
}

/// Reads a response body off its connection. A wait for more of the body that lasts
/// `stall` fails it with [`ClientError::Stalled`] (the time between two reads is bounded,
/// not the whole body: a long stream that keeps sending is never cut).
#[derive(Debug)]
pub struct BodyReader {
    connection: Option<Box<Connection>>,
    state: BodyState,
    keep_alive: bool,
    stall: Duration,
    /// The connection's timer is set for the wait in progress.
    waiting: bool,
    /// The rest of the request body, written as the response is read (boxed: it is rare,
    /// and the reader moves with every response).
    unsent: Option<Box<UnsentBody>>,
}

#[derive(Debug)]
enum BodyState {
    /// So many bytes left (`Content-Length`).
    Length(u64),
    /// `Transfer-Encoding: chunked`, decoded so far.
    Chunked(ChunkedDecoder),
    /// Until the connection closes.
    UntilClose,
    /// Read to its end.
    Done,
}

impl BodyReader {
    /// A reader for the body of `head`, which was read from `connection`, that waits at most
    /// `stall` for each read, and writes `unsent` to the upstream as it reads.
    pub fn new(
        head: &ResponseHead,
        connection: Box<Connection>,
        stall: Duration,
        unsent: Option<UnsentBody>,
    ) -> Self {
        let state = match head.framing {
            Framing::None => BodyState::Done,
            Framing::Length(n) => BodyState::Length(n),
            Framing::Chunked => BodyState::Chunked(ChunkedDecoder::Size),
            Framing::UntilClose => BodyState::UntilClose,
        };
        Self {
            connection: Some(connection),
            state,
            keep_alive: head.keep_alive,
            stall,
            waiting: false,
            unsent: unsent.map(Box::new),
        }
    }

    /// Whether the body has been read to its end.
    pub fn is_done(&self) -> bool {
        matches!(self.state, BodyState::Done)
    }

    /// Bytes of body left, when known.
    pub fn remaining(&self) -> Option<u64> {
        match self.state {
            BodyState::Length(n) => Some(n),
            BodyState::Done => Some(0),
            _ => None,
        }
    }

    /// The connection, once the body has been read to its end, if it can take another
    /// request. Taken once.
    pub fn take_reusable(&mut self) -> Option<Box<Connection>> {
        if !self.is_done() || !self.keep_alive {
            return None;
        }
        self.connection
            .take()
            // Bytes after the response that nobody asked for: the connection is out of step.
            .filter(|connection| connection.read.is_empty())
    }

    /// The next piece of the body, `None` at its end.
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, ClientError>>> {
        let (mut result, client_owes) = match self.poll_unsent(cx) {
            Ok(client_owes) => (self.poll_step(cx), client_owes),
            Err(error) => (Poll::Ready(Some(Err(error))), false),
        };
        if result.is_pending() {
            if client_owes {
                // The upstream waits for the client's body, not the other way round: no
                // stall of the upstream's (the client's own pace is the server's to bound).
                self.waiting = false;
            } else if self.poll_stalled(cx).is_ready() {
                result = Poll::Ready(Some(Err(ClientError::Stalled(self.stall))));
            }
        } else {
            self.waiting = false;
        }
        if let Poll::Ready(Some(Err(_))) = &result {
            // A broken body leaves its connection unusable.
            self.connection = None;
            self.state = BodyState::Done;
            self.keep_alive = false;
        }
        result
    }

    /// Writes what it can of the rest of the request body; answers whether the writing now
    /// waits for more of the client's body. Only the client's body failing is an error (the
    /// upstream holds a broken request, so its answer is not whole either); the socket
    /// failing ends the writing, for an upstream may stop reading and still answer.
    fn poll_unsent(&mut self, cx: &mut Context<'_>) -> Result<bool, ClientError> {
        let (Some(unsent), Some(connection)) = (self.unsent.as_mut(), self.connection.as_mut())
        else {
            return Ok(false);
        };
        let result = unsent
            .writer
            .poll_write(&mut connection.io, &mut unsent.body, cx);
        if std::mem::take(&mut unsent.writer.progressed) {
            // An upstream taking the body is not stalled: the wait starts again.
            self.waiting = false;
        }
        match result {
            Poll::Pending => Ok(unsent.writer.awaits_body()),
            Poll::Ready(result) => {
                self.unsent = None;
                match result {
                    Err(error @ ClientError::RequestBody(_)) => Err(error),
                    _ => Ok(false),
                }
            }
        }
    }

    /// Ready once the wait for more of the body has lasted `stall`. The clock is read only
    /// when a read has to wait (a body that came with its head never does), and the
    /// connection's own timer is reused.
    fn poll_stalled(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(connection) = self.connection.as_mut() else {
            return Poll::Pending;
        };
        if !self.waiting {
            self.waiting = true;
            let deadline = Instant::now() + self.stall;
            connection.timer = Some(set_for(connection.timer.take(), deadline));
        }
        match connection.timer.as_mut() {
            Some(timer) => timer.as_mut().poll(cx),
            None => Poll::Pending,
        }
    }

    fn poll_step(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, ClientError>>> {
        let Some(connection) = self.connection.as_mut() else {
            return Poll::Ready(None);
        };
        loop {
            match &mut self.state {
                BodyState::Done => return Poll::Ready(None),
                BodyState::Length(left) => {
                    let data = ready!(connection.poll_take(cx, left));
                    if *left == 0 {
                        self.state = BodyState::Done;
                    }
                    return Poll::Ready(Some(data));
                }
                BodyState::UntilClose => {
                    if connection.read.is_empty() {
                        match ready!(connection.poll_fill(cx)) {
                            Ok(()) => {}
                            // The end of this body; `keep_alive` is already off for it.
                            Err(ClientError::Closed) => {
                                self.state = BodyState::Done;
                                return Poll::Ready(None);
                            }
                            Err(error) => return Poll::Ready(Some(Err(error))),
                        }
                    }
                    let all = connection.read.len();
                    return Poll::Ready(Some(Ok(connection.read.split_to(all).freeze())));
                }
                BodyState::Chunked(decoder) => match decoder.step(&mut connection.read) {
                    Ok(Decoded::Data(data)) => return Poll::Ready(Some(Ok(data))),
                    Ok(Decoded::Next) => {
                        if *decoder == ChunkedDecoder::Done {
                            self.state = BodyState::Done;
                        }
                    }
                    Ok(Decoded::More) => {
                        if let Err(error) = ready!(connection.poll_fill(cx)) {
                            return Poll::Ready(Some(Err(error)));
                        }
                    }
                    Err(error) => return Poll::Ready(Some(Err(error.into()))),
                },
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::VecDeque;
    use std::net::SocketAddr;
    use std::time::Duration;

    use http_body_util::{Empty, Full};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// How a scripted upstream writes its answer.
    #[derive(Clone, Copy)]
    enum Pace {
        Whole,
        ByteByByte,
    }

    /// An upstream on 127.0.0.1 that answers each request on one connection with the next of
    /// `answers` (written as `pace` says), then closes. Returns what it was sent.
    async fn scripted(
        answers: Vec<&'static [u8]>,
        pace: Pace,
    ) -> (SocketAddr, tokio::task::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut received = Vec::new();
            for answer in answers {
                // A request is in when the client goes quiet for a moment.
                let mut buf = [0u8; 4096];
                loop {
                    match tokio::time::timeout(Duration::from_millis(100), stream.read(&mut buf))
                        .await
                    {
                        Ok(Ok(0)) => return received,
                        Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
                        Ok(Err(_)) => return received,
                        Err(_) => break,
                    }
                }
                match pace {
                    Pace::Whole => stream.write_all(answer).await.unwrap(),
                    Pace::ByteByByte => {
                        for byte in answer {
                            stream.write_all(&[*byte]).await.unwrap();
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                }
            }
            received
        });
        (addr, server)
    }

    /// An upstream on 127.0.0.1 that reads one request head, writes `pieces` (each after its
    /// pause), then reads until the client closes the connection, answering nothing more.
    async fn answers_then_listens(
        pieces: Vec<(Duration, &'static [u8])>,
    ) -> (SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let n = stream.read(&mut buf).await.unwrap();
            assert!(
                buf[..n].ends_with(b"\r\n\r\n"),
                "the request head came whole"
            );
            for (pause, piece) in pieces {
                if !pause.is_zero() {
                    tokio::time::sleep(pause).await;
                }
                stream.write_all(piece).await.unwrap();
            }
            while stream.read(&mut buf).await.is_ok_and(|n| n > 0) {}
        });
        (addr, server)
    }

    async fn connect(addr: SocketAddr) -> Box<Connection> {
        let stream = TcpStream::connect(addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        Box::new(Connection::new(stream))
    }

    fn head(method: Method, target: &str) -> request::Parts {
        http::Request::builder()
            .method(method)
            .uri(target)
            .header("host", "upstream.test")
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    async fn read_all(reader: &mut BodyReader) -> Result<Vec<u8>, ClientError> {
        let mut out = Vec::new();
        while let Some(data) = poll_fn(|cx| reader.poll_data(cx)).await {
            out.extend_from_slice(&data?);
        }
        Ok(out)
    }

    async fn get(connection: &mut Connection, method: Method) -> Result<ResponseHead, SendError> {
        connection
            .send(
                &head(method, "/x"),
                &OwnFields::default(),
                &mut Empty::<Bytes>::new(),
                &mut None,
                soon(),
            )
            .await
    }

    /// Sends a `POST` to `target` with `body` on `connection`.
    async fn send_post<B>(
        connection: &mut Connection,
        target: &str,
        body: &mut B,
    ) -> Result<ResponseHead, SendError>
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        let post = head(Method::POST, target);
        connection
            .send(&post, &OwnFields::default(), body, &mut None, soon())
            .await
    }

    /// One request with `method` to an upstream that answers `answer`: the response's body
    /// reader, or why there was none.
    async fn exchange(answer: &'static [u8], method: Method) -> Result<BodyReader, SendError> {
        let (addr, _server) = scripted(vec![answer], Pace::Whole).await;
        let mut connection = connect(addr).await;
        let response = get(&mut connection, method).await?;
        Ok(BodyReader::new(&response, connection, STALL, None))
    }

    /// A wait for body bytes no test reaches.
    pub(crate) const STALL: Duration = Duration::from_secs(30);

    /// A deadline no test reaches.
    pub(crate) fn soon() -> tokio::time::Instant {
        tokio::time::Instant::now() + Duration::from_secs(30)
    }

    #[tokio::test]
    async fn no_answer_by_the_deadline_is_a_timeout_on_a_reused_connection_too() {
        // Answers the first request, then reads and never answers again.
        let (addr, server) = answers_then_listens(vec![(
            Duration::ZERO,
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
        )])
        .await;
        let mut connection = connect(addr).await;
        // Far off: the connection's timer is registered for that deadline.
        let first = get(&mut connection, Method::GET).await.unwrap();
        let mut reader = BodyReader::new(&first, connection, STALL, None);
        assert_eq!(read_all(&mut reader).await.unwrap(), b"ok");
        let mut connection = reader.take_reusable().expect("read to its end: reusable");
        // An earlier deadline than the timer's: it must fire then, not at the first's.
        let deadline = tokio::time::Instant::now() + Duration::from_millis(200);
        let (request, own, mut body, mut first) = (
            head(Method::GET, "/x"),
            OwnFields::default(),
            Empty::<Bytes>::new(),
            None,
        );
        let sent = connection.send(&request, &own, &mut body, &mut first, deadline);
        let answer = tokio::time::timeout(Duration::from_secs(10), sent)
            .await
            .expect("the deadline fired, not the 30 s one before it");
        assert!(matches!(answer, Err(SendError::TimedOut)), "{answer:?}");
        drop(connection);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_keep_alive_connection_serves_one_response_after_another() {
        let (addr, server) = scripted(
            vec![
                b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\nx-a: 2\r\n\r\nhello",
                b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok",
            ],
            Pace::Whole,
        )
        .await;
        let mut connection = connect(addr).await;
        let first = get(&mut connection, Method::GET).await.unwrap();
        assert_eq!(first.status, StatusCode::OK);
        let values: Vec<_> = first.headers.get_all("x-a").iter().collect();
        assert_eq!(values, ["1", "2"], "repeated fields keep their order");
        let mut reader = BodyReader::new(&first, connection, STALL, None);
        assert_eq!(reader.remaining(), Some(5));
        assert_eq!(read_all(&mut reader).await.unwrap(), b"hello");
        let mut connection = reader.take_reusable().expect("read to its end: reusable");
        assert!(connection.is_usable());
        let second = get(&mut connection, Method::GET).await.unwrap();
        assert_eq!(second.status, StatusCode::CREATED);
        let mut reader = BodyReader::new(&second, connection, STALL, None);
        assert_eq!(read_all(&mut reader).await.unwrap(), b"ok");
        drop(reader);
        let sent = String::from_utf8(server.await.unwrap()).unwrap();
        assert_eq!(sent.matches("GET /x HTTP/1.1\r\n").count(), 2, "{sent}");
        assert!(
            !sent.contains("content-length"),
            "a GET without a body: {sent}"
        );
    }

    #[tokio::test]
    async fn a_body_that_stops_coming_is_cut_after_the_stall_time() {
        // Most of a body at once, more 100 ms later, then nothing (the socket stays open
        // until the test ends).
        let (addr, server) = answers_then_listens(vec![
            (
                Duration::ZERO,
                b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\n\r\nfirst-",
            ),
            (Duration::from_millis(100), b"more"),
        ])
        .await;
        let mut connection = connect(addr).await;
        let response = get(&mut connection, Method::GET).await.unwrap();
        // Each wait may last 1 s: the 100 ms pause passes, the endless one does not.
        let stall = Duration::from_secs(1);
        let mut reader = BodyReader::new(&response, connection, stall, None);
        let mut got = Vec::new();
        let end = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match poll_fn(|cx| reader.poll_data(cx)).await {
                    Some(Ok(data)) => got.extend_from_slice(&data),
                    Some(Err(error)) => return Some(error),
                    None => return None,
                }
            }
        })
        .await
        .expect("cut well before 10 s");
        assert_eq!(got, b"first-more");
        assert!(
            matches!(end, Some(ClientError::Stalled(d)) if d == stall),
            "{end:?}"
        );
        assert!(reader.is_done() && reader.take_reusable().is_none());
        server.abort();
    }

    #[tokio::test]
    async fn a_chunked_body_arriving_byte_by_byte_is_reassembled() {
        let (addr, _server) = scripted(
            vec![
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n",
            ],
            Pace::ByteByByte,
        )
        .await;
        let mut connection = connect(addr).await;
        let response = get(&mut connection, Method::GET).await.unwrap();
        assert_eq!(
            response.status,
            StatusCode::OK,
            "the interim 100 is skipped"
        );
        let mut reader = BodyReader::new(&response, connection, STALL, None);
        assert_eq!(reader.remaining(), None);
        assert_eq!(read_all(&mut reader).await.unwrap(), b"hello world");
        assert!(
            reader.take_reusable().is_some(),
            "trailers read, message complete"
        );
    }

    #[tokio::test]
    async fn responses_without_a_body_end_at_their_head() {
        for (method, answer) in [
            (
                Method::HEAD,
                &b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n"[..],
            ),
            (Method::POST, &b"HTTP/1.1 204 No Content\r\n\r\n"[..]),
            (
                Method::GET,
                &b"HTTP/1.1 304 Not Modified\r\nContent-Length: 3\r\n\r\n"[..],
            ),
        ] {
            let mut reader = exchange(answer, method.clone()).await.unwrap();
            assert!(reader.is_done(), "{method}");
            assert!(reader.take_reusable().is_some(), "{method}");
        }
    }

    #[tokio::test]
    async fn a_body_delimited_by_close_is_read_to_the_end_and_not_reused() {
        let mut reader = exchange(b"HTTP/1.1 200 OK\r\n\r\nall of it", Method::GET)
            .await
            .unwrap();
        assert_eq!(read_all(&mut reader).await.unwrap(), b"all of it");
        assert!(reader.take_reusable().is_none());
    }

    #[tokio::test]
    async fn responses_that_forbid_reuse_are_not_reused() {
        for answer in [
            &b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"[..],
            &b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"[..],
            &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA"[..],
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 9\r\n\r\n2\r\nok\r\n0\r\n\r\n"[..],
        ] {
            let mut reader = exchange(answer, Method::GET).await.unwrap();
            assert_eq!(read_all(&mut reader).await.unwrap(), b"ok");
            assert!(
                reader.take_reusable().is_none(),
                "{}",
                String::from_utf8_lossy(answer)
            );
        }
    }

    #[tokio::test]
    async fn malformed_heads_are_errors() {
        let many = {
            let mut head = b"HTTP/1.1 200 OK\r\n".to_vec();
            for i in 0..=MAX_RESPONSE_FIELDS {
                head.extend_from_slice(format!("x-{i}: 1\r\n").as_bytes());
            }
            head.extend_from_slice(b"\r\n");
            Box::leak(head.into_boxed_slice()) as &'static [u8]
        };
        let huge = {
            let mut head = b"HTTP/1.1 200 OK\r\nx-big: ".to_vec();
            head.resize(MAX_RESPONSE_HEAD + 10_000, b'a');
            Box::leak(head.into_boxed_slice()) as &'static [u8]
        };
        for answer in [
            &b"NOT HTTP AT ALL\r\n\r\n"[..],
            &b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok"[..],
            &b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n"[..],
            &b"HTTP/1.1 101 Switching Protocols\r\n\r\n"[..],
            // Transfer codings other than chunked alone: the body would pass as plain.
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nall of it"[..],
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"[..],
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"[..],
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"[..],
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\nok"[..],
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: ,\r\n\r\nok"[..],
            many,
            huge,
        ] {
            let error = exchange(answer, Method::GET).await.unwrap_err();
            assert!(
                matches!(error, SendError::NoResponse(ClientError::Malformed(_))),
                "{error:?} for {}",
                String::from_utf8_lossy(&answer[..answer.len().min(60)])
            );
        }
    }

    #[test]
    fn a_head_over_the_limit_is_refused_when_complete_too() {
        // As when the read that completes a head takes it past the limit: 60 000 bytes in
        // the buffer, then 10 000 more with its end.
        let mut head = b"HTTP/1.1 200 OK\r\nx-big: ".to_vec();
        head.resize(MAX_RESPONSE_HEAD + 5_000, b'a');
        head.extend_from_slice(b"\r\nContent-Length: 2\r\n\r\nok");
        let mut buf = BytesMut::from(&head[..]);
        let parsed = parse_head(&mut buf, &mut Vec::new(), &Method::GET);
        assert!(
            matches!(
                parsed,
                Err(ClientError::Malformed("response head too large"))
            ),
            "{parsed:?}"
        );
        // Exactly at the limit is still a head.
        let mut head = b"HTTP/1.1 200 OK\r\nx-big: ".to_vec();
        head.resize(MAX_RESPONSE_HEAD - 4, b'a');
        head.extend_from_slice(b"\r\n\r\n");
        assert_eq!(head.len(), MAX_RESPONSE_HEAD);
        let mut buf = BytesMut::from(&head[..]);
        let parsed = parse_head(&mut buf, &mut Vec::new(), &Method::GET);
        assert!(matches!(parsed, Ok(Some(_))), "{parsed:?}");
        // One byte short of the end at the limit cannot become a head within it.
        let mut buf = BytesMut::from(&head[..MAX_RESPONSE_HEAD - 1]);
        assert!(parse_head(&mut buf, &mut Vec::new(), &Method::GET).is_ok());
        let mut over = head[..MAX_RESPONSE_HEAD - 2].to_vec();
        over.extend_from_slice(b"aa");
        let mut buf = BytesMut::from(&over[..]);
        assert!(parse_head(&mut buf, &mut Vec::new(), &Method::GET).is_err());
    }

    #[tokio::test]
    async fn broken_bodies_are_errors_and_close_the_connection() {
        for answer in [
            // Closed three bytes into ten.
            &b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"[..],
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"[..],
            &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY"[..],
        ] {
            let mut reader = exchange(answer, Method::GET).await.unwrap();
            assert!(read_all(&mut reader).await.is_err());
            assert!(reader.take_reusable().is_none());
        }
    }

    #[tokio::test]
    async fn no_answer_at_all_is_an_error_after_sending() {
        let error = exchange(b"", Method::POST).await.unwrap_err();
        assert!(
            matches!(error, SendError::NoResponse(ClientError::Closed)),
            "{error:?}"
        );
    }

    /// A request body as a test scripts it: `frames`, each ready when asked for, then what
    /// `then` says; it declares the length `declared`, if any, whatever it gives.
    struct TestBody {
        frames: VecDeque<Bytes>,
        then: Then,
        declared: Option<u64>,
    }

    /// What a [`TestBody`] does once its frames are out.
    enum Then {
        End,
        /// Nothing more, ever.
        Wait,
        Fail,
        /// The frames a test sends through the channel, then the end when it closes.
        Channel(tokio::sync::mpsc::Receiver<Bytes>),
    }

    impl TestBody {
        fn new(frames: impl IntoIterator<Item = Bytes>, then: Then, declared: Option<u64>) -> Self {
            Self {
                frames: frames.into_iter().collect(),
                then,
                declared,
            }
        }
    }

    impl Body for TestBody {
        type Data = Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            if let Some(data) = self.frames.pop_front() {
                return Poll::Ready(Some(Ok(http_body::Frame::data(data))));
            }
            match &mut self.then {
                Then::End => Poll::Ready(None),
                Then::Wait => Poll::Pending,
                Then::Fail => Poll::Ready(Some(Err(std::io::Error::other("the client went away")))),
                Then::Channel(frames) => frames
                    .poll_recv(cx)
                    .map(|frame| frame.map(|data| Ok(http_body::Frame::data(data)))),
            }
        }

        fn is_end_stream(&self) -> bool {
            self.frames.is_empty() && matches!(self.then, Then::End)
        }

        fn size_hint(&self) -> http_body::SizeHint {
            self.declared.map_or_else(
                http_body::SizeHint::default,
                http_body::SizeHint::with_exact,
            )
        }
    }

    /// Frames of `data`, with no length declared.
    fn frames(data: &[&'static [u8]]) -> TestBody {
        TestBody::new(data.iter().map(|d| Bytes::from_static(d)), Then::End, None)
    }

    #[tokio::test]
    async fn request_bodies_go_with_their_length_or_chunked() {
        let ok: &'static [u8] = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n";
        let (addr, server) = scripted(vec![ok, ok, ok], Pace::Whole).await;
        let mut connection = connect(addr).await;
        let mut post = head(Method::POST, "/pay?x=1");
        // The client's own length field is replaced by the body's.
        post.headers
            .insert(CONTENT_LENGTH, HeaderValue::from_static("999"));
        let mut full = Full::new(Bytes::from_static(b"{\"a\":1}"));
        connection
            .send(&post, &OwnFields::default(), &mut full, &mut None, soon())
            .await
            .unwrap();
        send_post(&mut connection, "/stream", &mut frames(&[b"abc", b"defgh"]))
            .await
            .unwrap();
        // An empty frame is not a chunk: `0` would end the body early.
        let mut empty = frames(&[b""]);
        send_post(&mut connection, "/empty", &mut empty)
            .await
            .unwrap();
        drop(connection);
        let sent = String::from_utf8(server.await.unwrap()).unwrap();
        assert!(
            sent.starts_with("POST /pay?x=1 HTTP/1.1\r\nhost: upstream.test\r\ncontent-length: 7\r\n\r\n{\"a\":1}"),
            "{sent}"
        );
        assert!(!sent.contains("999"), "{sent}");
        assert!(
            sent.contains("POST /stream HTTP/1.1\r\nhost: upstream.test\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n5\r\ndefgh\r\n0\r\n\r\nPOST /empty"),
            "{sent}"
        );
        assert!(
            sent.ends_with("POST /empty HTTP/1.1\r\nhost: upstream.test\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"),
            "{sent}"
        );
    }

    #[tokio::test]
    async fn a_body_that_breaks_its_length_is_refused_before_sending() {
        let five = || Bytes::from_static(b"12345");
        // (method, the frame in the body or already taken by an attempt on a connection that
        // turned out unusable (the retry on a fresh one must check the same), what happens
        // after it, the length declared)
        let cases = [
            // Longer than declared.
            (Method::PUT, Some(five()), None, Then::End, 2),
            (Method::GET, Some(five()), None, Then::End, 0),
            // Ends short of its length.
            (Method::PUT, Some(five()), None, Then::End, 10),
            (Method::PUT, None, Some(five()), Then::End, 10),
        ];
        for (method, in_body, mut first, then, declared) in cases {
            let (addr, server) = scripted(vec![b"HTTP/1.1 200 OK\r\n\r\n"], Pace::Whole).await;
            let mut connection = connect(addr).await;
            let mut body = TestBody::new(in_body, then, Some(declared));
            let error = connection
                .send(
                    &head(method.clone(), "/"),
                    &OwnFields::default(),
                    &mut body,
                    &mut first,
                    soon(),
                )
                .await
                .unwrap_err();
            assert!(
                matches!(error, SendError::BodyBeforeSent(_)),
                "{method} {declared}: {error:?}"
            );
            drop(connection);
            assert!(
                server.await.unwrap().is_empty(),
                "nothing of a body that breaks its length goes out"
            );
        }
    }

    #[tokio::test]
    async fn an_answer_before_the_whole_body_stands_and_ends_the_connection() {
        let (addr, _server) = scripted(
            vec![b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n"],
            Pace::Whole,
        )
        .await;
        let mut connection = connect(addr).await;
        // One frame of a body that says it is longer, then nothing more, ever.
        let mut body = TestBody::new([Bytes::from_static(b"first ten.")], Then::Wait, Some(1_000));
        let response = tokio::time::timeout(
            Duration::from_secs(5),
            send_post(&mut connection, "/upload", &mut body),
        )
        .await
        .expect("the early answer is read while the body waits")
        .unwrap();
        assert_eq!(response.status, StatusCode::PAYLOAD_TOO_LARGE);
        let mut reader = BodyReader::new(&response, connection, STALL, None);
        assert!(reader.is_done());
        assert!(
            reader.take_reusable().is_none(),
            "the rest of the body was never sent: the connection is not reused"
        );
    }

    /// An upstream on 127.0.0.1 that, for one request, answers its head as soon as it has
    /// the request head, then sends back every body byte it reads as a chunk, and ends the
    /// response once it has read `Content-Length` bytes. Returns how many it read.
    async fn echoing() -> (SocketAddr, tokio::task::JoinHandle<u64>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            let mut piece = vec![0u8; 64 * 1024];
            let end = loop {
                if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break end + 4;
                }
                let n = stream.read(&mut piece).await.unwrap();
                assert_ne!(n, 0, "the request head came whole");
                buf.extend_from_slice(&piece[..n]);
            };
            let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
            let length: u64 = head
                .lines()
                .find_map(|line| line.strip_prefix("content-length: "))
                .unwrap()
                .trim()
                .parse()
                .unwrap();
            stream
                .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                .await
                .unwrap();
            let echo = |stream_out: &mut Vec<u8>, data: &[u8]| {
                stream_out.extend_from_slice(format!("{:x}\r\n", data.len()).as_bytes());
                stream_out.extend_from_slice(data);
                stream_out.extend_from_slice(b"\r\n");
            };
            let mut read = (buf.len() - end) as u64;
            let mut out = Vec::new();
            if read > 0 {
                echo(&mut out, &buf[end..]);
                stream.write_all(&out).await.unwrap();
            }
            while read < length {
                // A client that breaks off its request ends the exchange.
                let n = match stream.read(&mut piece).await {
                    Ok(0) | Err(_) => return read,
                    Ok(n) => n,
                };
                read += n as u64;
                out.clear();
                echo(&mut out, &piece[..n]);
                if stream.write_all(&out).await.is_err() {
                    return read;
                }
            }
            stream.write_all(b"0\r\n\r\n").await.unwrap();
            read
        });
        (addr, server)
    }

    const UPLOAD_FRAME: usize = 64 * 1024;

    /// Sends a `POST` of `frames` frames (failing after them if `fail`) to an echoing
    /// upstream; answers the response head's reader, and the upstream's task.
    async fn post_to_echo(frames: usize, fail: bool) -> (BodyReader, tokio::task::JoinHandle<u64>) {
        let (addr, server) = echoing().await;
        let mut connection = connect(addr).await;
        // Frames of 64 KiB, each ready when asked for, then the end, or an error if `fail`
        // (the length declared stays the whole).
        let data = (0..frames)
            .rev()
            .map(|left| Bytes::from(vec![b'a' + (left % 26) as u8; UPLOAD_FRAME]));
        let then = if fail { Then::Fail } else { Then::End };
        let declared = ((frames + usize::from(fail)) * UPLOAD_FRAME) as u64;
        let mut body = TestBody::new(data, then, Some(declared));
        let mut response = send_post(&mut connection, "/echo", &mut body)
            .await
            .unwrap();
        assert_eq!(response.status, StatusCode::OK);
        let unsent = UnsentBody::take(&mut response, body);
        assert!(
            unsent.is_some(),
            "the head came long before 16 MiB of body could be written"
        );
        (
            BodyReader::new(&response, connection, STALL, unsent),
            server,
        )
    }

    #[tokio::test]
    async fn the_rest_of_the_body_goes_out_while_an_early_answer_is_read() {
        let frames = 256;
        let (mut reader, server) = post_to_echo(frames, false).await;
        let echoed = tokio::time::timeout(Duration::from_secs(20), read_all(&mut reader))
            .await
            .expect("the upstream gets the whole body and ends its answer")
            .unwrap();
        assert_eq!(echoed.len(), frames * UPLOAD_FRAME);
        let mut expected = Vec::with_capacity(frames * UPLOAD_FRAME);
        for left in (0..frames).rev() {
            expected.resize(expected.len() + UPLOAD_FRAME, b'a' + (left % 26) as u8);
        }
        assert!(echoed == expected, "the body comes back whole and in order");
        assert_eq!(server.await.unwrap(), (frames * UPLOAD_FRAME) as u64);
        assert!(
            reader.take_reusable().is_none(),
            "an upstream that answered early is not sent another request"
        );
    }

    #[tokio::test]
    async fn a_slow_client_body_after_an_early_answer_is_not_an_upstream_stall() {
        let (addr, server) = echoing().await;
        let mut connection = connect(addr).await;
        let (frames, rx) = tokio::sync::mpsc::channel(1);
        // A body of 10 bytes whose frames come through a channel, as the test sends them.
        let mut body = TestBody::new([], Then::Channel(rx), Some(10));
        frames.send(Bytes::from_static(b"first")).await.unwrap();
        let mut response = send_post(&mut connection, "/echo", &mut body)
            .await
            .unwrap();
        let unsent = UnsentBody::take(&mut response, body);
        assert!(unsent.is_some(), "half the body is still to come");
        let stall = Duration::from_millis(200);
        let mut reader = BodyReader::new(&response, connection, stall, unsent);
        let reading = tokio::spawn(async move { read_all(&mut reader).await });
        // The client takes three stall times to send the rest: the upstream, waiting for it,
        // is not the one stalling.
        tokio::time::sleep(3 * stall).await;
        frames.send(Bytes::from_static(b"-last")).await.unwrap();
        drop(frames);
        let echoed = tokio::time::timeout(Duration::from_secs(10), reading)
            .await
            .expect("the response ends once the body is whole")
            .unwrap()
            .expect("no stall");
        assert_eq!(echoed, b"first-last");
        assert_eq!(server.await.unwrap(), 10);
    }

    #[tokio::test]
    async fn a_client_body_that_fails_after_an_early_answer_breaks_the_response() {
        let (mut reader, server) = post_to_echo(256, true).await;
        let result = tokio::time::timeout(Duration::from_secs(20), read_all(&mut reader))
            .await
            .expect("the failure ends the response");
        assert!(
            matches!(result, Err(ClientError::RequestBody(_))),
            "{result:?}"
        );
        drop(reader);
        // The connection is closed, with the request short of its length: the upstream is not
        // left waiting for the rest.
        tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("the upstream sees the connection close")
            .unwrap();
    }

    #[tokio::test]
    async fn chunked_wins_over_a_content_length_that_is_not_passed_on() {
        let (addr, _server) = scripted(
            vec![b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nTransfer-Encoding: chunked\r\n\r\n0005 ;x=1\r\nhello\r\n0\r\n\r\n"],
            Pace::Whole,
        )
        .await;
        let mut connection = connect(addr).await;
        let response = get(&mut connection, Method::GET).await.unwrap();
        assert!(!response.headers.contains_key(CONTENT_LENGTH));
        let mut reader = BodyReader::new(&response, connection, STALL, None);
        assert_eq!(read_all(&mut reader).await.unwrap(), b"hello");
        assert!(reader.take_reusable().is_none());
    }

    #[tokio::test]
    async fn a_tunnel_is_not_relayed() {
        let error = exchange(
            b"HTTP/1.1 200 Connection Established\r\n\r\n",
            Method::CONNECT,
        )
        .await
        .unwrap_err();
        assert!(
            matches!(error, SendError::NoResponse(ClientError::Malformed(_))),
            "{error:?}"
        );
    }

    #[tokio::test]
    async fn an_idle_connection_the_upstream_closed_is_not_usable() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            drop(stream);
        });
        let connection = connect(addr).await;
        let mut closed = false;
        for _ in 0..200 {
            // The runtime learns of the close from its next look at the sockets.
            tokio::time::sleep(Duration::from_millis(10)).await;
            if !connection.is_usable() {
                closed = true;
                break;
            }
        }
        assert!(closed, "a closed connection still looks usable after 2 s");
    }

    /// Property tests of the response head parser, which reads the upstream's bytes (the
    /// chunked decoder's are in `chunked`).
    mod properties {
        use proptest::prelude::*;
        use proptest::sample::select;

        use super::*;

        /// The framing RFC 9112 §6.3 gives a response with `fields` to a GET, as this client
        /// reads it (strict: any transfer coding but chunked alone, or lengths that are not
        /// all the same number, are malformed); `None` for malformed.
        fn expected_framing(status: u16, fields: &[(&str, &str)]) -> Option<Framing> {
            let values = |name: &'static str| {
                fields
                    .iter()
                    .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
                    .map(|(_, v)| *v)
            };
            if (100..200).contains(&status) || status == 204 || status == 304 {
                return Some(Framing::None);
            }
            if values("transfer-encoding").next().is_some() {
                let codings: Vec<String> = values("transfer-encoding")
                    .flat_map(|v| v.split(','))
                    .map(|c| c.trim().to_ascii_lowercase())
                    .filter(|c| !c.is_empty())
                    .collect();
                return (codings == ["chunked"]).then_some(Framing::Chunked);
            }
            let mut length = None;
            for part in values("content-length").flat_map(|v| v.split(',')) {
                let part = part.trim();
                if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                let n: u64 = part.parse().ok()?;
                if length.is_some_and(|seen| seen != n) {
                    return None;
                }
                length = Some(n);
            }
            Some(match length {
                Some(0) => Framing::None,
                Some(n) => Framing::Length(n),
                None => Framing::UntilClose,
            })
        }

        fn field() -> impl Strategy<Value = (&'static str, &'static str)> {
            (
                select(vec![
                    "Content-Length",
                    "content-length",
                    "Transfer-Encoding",
                    "transfer-encoding",
                    "Connection",
                    "X-A",
                ]),
                select(vec![
                    "0",
                    "5",
                    "05",
                    "+5",
                    " 5",
                    "5, 5",
                    "5, 6",
                    "-1",
                    "",
                    "99999999999999999999",
                    "chunked",
                    "Chunked",
                    "gzip, chunked",
                    "chunked, gzip",
                    "identity",
                    ",",
                    "close",
                    "keep-alive",
                ]),
            )
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

            #[test]
            fn a_response_head_frames_its_body_as_the_rfc_says_or_is_refused(
                status in select(vec![200u16, 201, 204, 304, 404, 502]),
                fields in prop::collection::vec(field(), 0..5),
                after in prop::collection::vec(any::<u8>(), 0..20),
                cut in any::<prop::sample::Index>(),
            ) {
                let mut head = format!("HTTP/1.1 {status} X\r\n");
                for (name, value) in &fields {
                    head.push_str(&format!("{name}: {value}\r\n"));
                }
                head.push_str("\r\n");
                let mut bytes = head.clone().into_bytes();
                bytes.extend_from_slice(&after);
                // Any part of the head is not a head yet.
                let short = cut.index(head.len());
                let mut partial = BytesMut::from(&head.as_bytes()[..short]);
                prop_assert!(matches!(parse_head(&mut partial, &mut Vec::new(), &Method::GET), Ok(None)));
                let mut buf = BytesMut::from(&bytes[..]);
                let parsed = parse_head(&mut buf, &mut Vec::new(), &Method::GET);
                match (parsed, expected_framing(status, &fields)) {
                    (Ok(Some(parsed)), Some(framing)) => {
                        prop_assert_eq!(parsed.framing, framing);
                        prop_assert_eq!(parsed.status.as_u16(), status);
                        // Exactly the head is taken: the body and what follows stay.
                        prop_assert_eq!(&buf[..], &after[..]);
                    }
                    (Err(ClientError::Malformed(_)), None) => {}
                    (parsed, expected) => prop_assert!(false, "{head:?}: {parsed:?}, expected {expected:?}"),
                }
            }

            #[test]
            fn random_bytes_never_panic_the_head_parser(
                bytes in prop::collection::vec(any::<u8>(), 0..300),
                prefix in select(vec![&b""[..], b"HTTP/1.1 200 OK\r\n", b"HTTP/1.0 1"]),
            ) {
                let mut input = prefix.to_vec();
                input.extend_from_slice(&bytes);
                let mut buf = BytesMut::from(&input[..]);
                if let Ok(Some(_)) = parse_head(&mut buf, &mut Vec::new(), &Method::GET) {
                    prop_assert!(buf.len() < input.len());
                }
            }
        }
    }
}
