//! The proxy's own HTTP/1.1 loop for plain requests, in front of hyper for everything else.
//!
//! A client connection starts here. A request is served here when it is plain: its head
//! parses, comes from an HTTP/1.1 client and fits [`OWN_MAX_FIELDS`] fields and the head
//! limit; its method is not `HEAD` or `CONNECT` and its target is a path; its body, framed by a
//! single `Content-Length` (or absent) and at most [`OWN_MAX_BODY`] bytes, has already arrived
//! with it; and it has no field that changes how the connection carries it
//! (`Transfer-Encoding`, `Expect`, `Upgrade`, or a `Connection` other than `keep-alive`). It
//! goes to the front service as an [`http::Request`] like the one hyper would have made, and
//! its response is written here.
//!
//! The first request that is not plain, and anything that does not parse (an HTTP/2 preface
//! among them), hands the connection to hyper for the rest of its life ([`End::Handover`]),
//! with the bytes already read in front of the stream ([`Prefixed`]). So hyper keeps every
//! answer it gave before: to malformed requests, requests past its limits, `100 Continue`,
//! chunked and slow request bodies, `HEAD`, HTTP/1.0 and h2c.
//!
//! Why: hyper's server side costs more per request than the rest of a replay outside the
//! layer; this loop does the same work for the plain requests that are nearly all of a
//! gateway's traffic in fewer instructions (see BENCHMARKS.md).
//!
//! Responses: the status line, the response's fields (its own `Content-Length` and
//! `Transfer-Encoding` are replaced by the framing written here), `date` when the response
//! has none, then the body: no body for `1xx`, `204` and `304`; a `Content-Length` when the
//! response declares one or its body's length is known; chunked otherwise. Trailers are not
//! sent. A small response goes out in one write. A body that fails, or that ends short of or
//! runs past its declared length, ends the connection, which is all a client can be told.

use std::cell::RefCell;
use std::convert::Infallible;
use std::io;
use std::mem::MaybeUninit;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, DATE};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use http_body_util::Full;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::codec::{
    Framing, ONE_WRITE, Span, asks_to_close, content_length, poll_read_more, write_content_length,
    write_fields, write_status_line,
};
use super::limits::{OWN_MAX_BODY, OWN_MAX_FIELDS};
use crate::watchdog::ActivityIo;

/// The body of a request served here: it arrived whole with its head.
pub(crate) type WholeBody = Full<Bytes>;

/// How the loop ended.
pub(crate) enum End {
    /// The connection is done: the client closed it or reset it, a write failed, a response
    /// asked to close it, or the connection was closing and is between requests.
    Closed,
    /// hyper serves the connection from here: the stream, and what was read from it and not
    /// served.
    Handover(Prefixed),
}

/// Serves plain requests on `io` through `call` until the connection ends or a request
/// that is not plain arrives. `closing` set (a graceful close) ends the loop between
/// requests; a request in progress gets its response first. `head_limit` caps the head read
/// here (see [`super::limits::RequestHeadLimits::own_max_head`]).
pub(crate) async fn serve<C, F, B>(
    mut io: ActivityIo,
    closing: &AtomicBool,
    head_limit: usize,
    mut call: C,
) -> End
where
    C: FnMut(Request<WholeBody>) -> F,
    F: Future<Output = Result<Response<B>, Infallible>>,
    B: Body<Data = Bytes>,
{
    let mut read = BytesMut::new();
    let mut out = Vec::new();
    let mut spans = Vec::new();
    loop {
        let request = loop {
            if closing.load(Ordering::Relaxed) {
                return End::Closed;
            }
            match parse(&mut read, head_limit, &mut spans) {
                Ok(Some(request)) => break request,
                Ok(None) => {}
                Err(NotPlain) => return End::Handover(Prefixed { read, io }),
            }
            if !fill(&mut io, &mut read, closing).await {
                return End::Closed;
            }
        };
        let Ok(response) = call(request).await;
        let closing = closing.load(Ordering::Relaxed);
        match write_response(&mut io, &mut out, response, closing).await {
            Ok(true) => {}
            Ok(false) | Err(_) => return End::Closed,
        }
    }
}

/// Reads what the client sent into `read`: `false` when it closed or reset the connection,
/// or when the connection is closing.
async fn fill(io: &mut ActivityIo, read: &mut BytesMut, closing: &AtomicBool) -> bool {
    std::future::poll_fn(|cx| {
        if closing.load(Ordering::Relaxed) {
            return Poll::Ready(false);
        }
        match poll_read_more(io, cx, read) {
            Poll::Ready(Ok(n)) => Poll::Ready(n > 0),
            Poll::Ready(Err(_)) => Poll::Ready(false),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// What the read buffer holds when it is not a plain request: something hyper serves. The
/// buffer is then as it was.
#[derive(Debug)]
struct NotPlain;

/// What [`parse`] found: a plain request (taken out of the buffer), nothing whole yet
/// (`Ok(None)`: part of a head that may still become a plain request), or [`NotPlain`].
type Parsed = Result<Option<Request<WholeBody>>, NotPlain>;

/// Takes a plain request out of the front of `read`, if one is there (see the module's
/// documentation). `spans` is room for where the fields lie, kept between requests.
fn parse(read: &mut BytesMut, head_limit: usize, spans: &mut Vec<(Span, Span)>) -> Parsed {
    if read.is_empty() {
        return Ok(None);
    }
    let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; OWN_MAX_FIELDS];
    let mut head = httparse::Request::new(&mut []);
    let head_len = match head.parse_with_uninit_headers(read, &mut fields) {
        Ok(httparse::Status::Complete(len)) if len <= head_limit => len,
        Ok(httparse::Status::Partial) if read.len() < head_limit => return Ok(None),
        _ => return Err(NotPlain),
    };
    let (Some(1), Some(method), Some(target)) = (head.version, head.method, head.path) else {
        return Err(NotPlain);
    };
    let Ok(method) = Method::from_bytes(method.as_bytes()) else {
        return Err(NotPlain);
    };
    if method == Method::HEAD || method == Method::CONNECT || !target.starts_with('/') {
        return Err(NotPlain);
    }
    let target = Span::of(target.as_bytes(), read);
    spans.clear();
    let mut body_len = None;
    for field in head.headers.iter() {
        let name = field.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            match (body_len, content_length(field.value)) {
                (None, Some(len)) if len <= OWN_MAX_BODY as u64 => body_len = Some(len as usize),
                _ => return Err(NotPlain),
            }
        } else if name.eq_ignore_ascii_case(b"connection") {
            if !field.value.eq_ignore_ascii_case(b"keep-alive") {
                return Err(NotPlain);
            }
        } else if name.eq_ignore_ascii_case(b"transfer-encoding")
            || name.eq_ignore_ascii_case(b"expect")
            || name.eq_ignore_ascii_case(b"upgrade")
        {
            return Err(NotPlain);
        }
        spans.push((Span::of(name, read), Span::of(field.value, read)));
    }
    let body_len = body_len.unwrap_or(0);
    if read.len() - head_len < body_len {
        // The rest of the body is still on its way: hyper streams it.
        return Err(NotPlain);
    }
    let head_bytes = read.split_to(head_len).freeze();
    let body = read.split_to(body_len).freeze();
    match request(&head_bytes, method, target, spans, body.clone()) {
        Some(request) => Ok(Some(request)),
        None => {
            // A target or field that http's types refuse though httparse took it: hyper
            // answers it, from the bytes as they came.
            let mut restored = BytesMut::with_capacity(head_len + body_len + read.len());
            restored.extend_from_slice(&head_bytes);
            restored.extend_from_slice(&body);
            restored.extend_from_slice(&read[..]);
            *read = restored;
            Err(NotPlain)
        }
    }
}

/// The request whose head is `head` (the parts found by [`parse`]) and whose body is `body`.
fn request(
    head: &Bytes,
    method: Method,
    target: Span,
    fields: &[(Span, Span)],
    body: Bytes,
) -> Option<Request<WholeBody>> {
    let uri = Uri::from_maybe_shared(head.slice(target.range())).ok()?;
    let mut headers = HeaderMap::with_capacity(fields.len());
    for &(name, value) in fields {
        let name = idemgate::headers::field_name(&head[name.range()])?;
        let value = HeaderValue::from_maybe_shared(head.slice(value.range())).ok()?;
        headers.append(name, value);
    }
    let mut request = Request::new(Full::new(body));
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = headers;
    Some(request)
}

/// Writes `response`; `Ok(true)` if the connection can carry another request. `closing`
/// marks the response as the connection's last (`connection: close`).
async fn write_response<B>(
    io: &mut ActivityIo,
    out: &mut Vec<u8>,
    response: Response<B>,
    closing: bool,
) -> io::Result<bool>
where
    B: Body<Data = Bytes>,
{
    let (parts, body) = response.into_parts();
    let mut body = pin!(body);
    out.clear();
    let (framing, keep_alive) = head(out, parts.status, &parts.headers, &*body, closing);
    if framing == Framing::None {
        io.write_all(out).await?;
        return Ok(keep_alive);
    }
    let mut left = match framing {
        Framing::Length(len) => len,
        _ => u64::MAX,
    };
    loop {
        // Polled once first: a body that has its next frame at hand (a stored response, a
        // small one from the upstream) goes out with the head in one write.
        let frame =
            match std::future::poll_fn(|cx| Poll::Ready(poll_frame(body.as_mut(), cx))).await {
                Poll::Ready(frame) => frame,
                Poll::Pending => {
                    if !out.is_empty() {
                        io.write_all(out).await?;
                        out.clear();
                    }
                    std::future::poll_fn(|cx| poll_frame(body.as_mut(), cx)).await
                }
            };
        let data = match frame {
            None => break,
            Some(Err(_)) => return Err(io::Error::other("the response body failed")),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) if !data.is_empty() => data,
                // Trailers are not sent; an empty frame carries nothing.
                _ => continue,
            },
        };
        if data.len() as u64 > left {
            return Err(io::Error::other("the response body ran past its length"));
        }
        if framing == Framing::Chunked {
            framing.write_data_start(data.len(), out);
        } else {
            left -= data.len() as u64;
        }
        if out.len() + data.len() <= ONE_WRITE {
            out.extend_from_slice(&data);
        } else {
            if !out.is_empty() {
                io.write_all(out).await?;
                out.clear();
            }
            io.write_all(&data).await?;
        }
        framing.write_data_end(out);
    }
    framing.write_end(out);
    if !out.is_empty() {
        io.write_all(out).await?;
    }
    Ok(keep_alive && (framing == Framing::Chunked || left == 0))
}

/// The body's next frame; its error is not kept (it only ends the connection).
fn poll_frame<B: Body<Data = Bytes>>(
    body: Pin<&mut B>,
    cx: &mut Context<'_>,
) -> Poll<Option<Result<http_body::Frame<Bytes>, ()>>> {
    body.poll_frame(cx)
        .map(|frame| frame.map(|frame| frame.map_err(drop)))
}

/// Appends the response head to `out`; returns how its body is framed, and whether the
/// connection can carry another request after it (not when `closing`, nor when the response
/// asks to close it).
fn head<B: Body>(
    out: &mut Vec<u8>,
    status: StatusCode,
    headers: &HeaderMap,
    body: &B,
    closing: bool,
) -> (Framing, bool) {
    write_status_line(status, out);
    // The fields this head looks at, noted in the one pass that writes the others.
    let (mut date, mut connection) = (false, false);
    let mut lengths = (None, 0);
    write_fields(headers, out, |name, value| {
        if name == CONTENT_LENGTH {
            lengths = (Some(value), lengths.1 + 1);
            return false;
        }
        date |= name == DATE;
        connection |= name == CONNECTION;
        true
    });
    let asks_to_close = connection && asks_to_close(headers);
    let keep_alive = !closing && !asks_to_close;
    if !date {
        out.extend_from_slice(b"date: ");
        append_date(out);
        out.extend_from_slice(b"\r\n");
    }
    if !keep_alive && !connection {
        out.extend_from_slice(b"connection: close\r\n");
    }
    // The response's own `Content-Length`, when it has exactly one and it is a number.
    let declared = match lengths {
        (Some(value), 1) => content_length(value.as_bytes()),
        _ => None,
    };
    let framing = if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        // A 304 keeps the length of what it stands for; it is sent, and no body.
        if let (StatusCode::NOT_MODIFIED, Some(len)) = (status, declared) {
            write_content_length(len, out);
        }
        Framing::None
    } else {
        let framing = declared
            .or_else(|| body.size_hint().exact())
            .map_or(Framing::Chunked, Framing::Length);
        framing.write_field(out);
        framing
    };
    out.extend_from_slice(b"\r\n");
    (framing, keep_alive)
}

/// Appends the current time as an HTTP date (`Thu, 26 Nov 2026 06:00:00 GMT`), formatted
/// once a second per thread.
fn append_date(out: &mut Vec<u8>) {
    thread_local! {
        static DATE: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let now = SystemTime::now();
    let second = now
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    DATE.with(|date| {
        let mut date = date.borrow_mut();
        if date.0 != second {
            *date = (second, httpdate::fmt_http_date(now));
        }
        out.extend_from_slice(date.1.as_bytes());
    });
}

/// A client stream with bytes already read from it in front: what hyper reads first when it
/// takes a connection over.
pub(crate) struct Prefixed {
    read: BytesMut,
    io: ActivityIo,
}

impl AsyncRead for Prefixed {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.read.is_empty() {
            return Pin::new(&mut self.io).poll_read(cx, buf);
        }
        let n = self.read.len().min(buf.remaining());
        buf.put_slice(&self.read[..n]);
        self.read.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Prefixed {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http1::limits::OWN_MAX_HEAD;

    fn buffer(bytes: &[u8]) -> BytesMut {
        BytesMut::from(bytes)
    }

    fn parsed(bytes: &[u8]) -> (Parsed, BytesMut) {
        let mut read = buffer(bytes);
        let parsed = parse(&mut read, OWN_MAX_HEAD, &mut Vec::new());
        (parsed, read)
    }

    #[test]
    fn a_plain_request_is_taken_with_its_body_and_the_next_one_stays() {
        let next = b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n";
        let mut bytes = b"POST /v1/pay?x=1 HTTP/1.1\r\nHost: gw\r\nIdempotency-Key: k-1\r\nX-Two: a\r\nX-Two: b\r\nContent-Length: 5\r\nConnection: keep-alive\r\n\r\nhello".to_vec();
        bytes.extend_from_slice(next);
        let (Ok(Some(request)), rest) = parsed(&bytes) else {
            panic!("a plain request");
        };
        assert_eq!(request.method(), Method::POST);
        assert_eq!(request.uri(), "/v1/pay?x=1");
        assert_eq!(request.version(), Version::HTTP_11);
        assert_eq!(request.headers()["host"], "gw");
        assert_eq!(request.headers()["idempotency-key"], "k-1");
        let twos: Vec<_> = request.headers().get_all("x-two").iter().collect();
        assert_eq!(twos, ["a", "b"]);
        assert_eq!(Body::size_hint(request.body()).exact(), Some(5));
        assert_eq!(
            &rest[..],
            next,
            "the pipelined request is left for the next turn"
        );
        let (Ok(Some(request)), rest) = parsed(&rest) else {
            panic!("the next request");
        };
        assert_eq!(request.uri(), "/next");
        assert_eq!(Body::size_hint(request.body()).exact(), Some(0));
        assert!(rest.is_empty());
    }

    #[test]
    fn an_unfinished_head_waits_and_an_empty_buffer_waits() {
        for bytes in [&b""[..], b"POST /v1 HTTP/1.1\r\nHost: x\r\nContent-Le"] {
            let (parsed, rest) = parsed(bytes);
            assert!(matches!(parsed, Ok(None)), "{bytes:?}: {parsed:?}");
            assert_eq!(&rest[..], bytes);
        }
    }

    #[test]
    fn anything_but_a_plain_request_goes_to_hyper_with_the_bytes_untouched() {
        let many_fields: String = (0..=OWN_MAX_FIELDS)
            .map(|i| format!("X-F{i}: v\r\n"))
            .collect();
        let many_fields = format!("GET / HTTP/1.1\r\n{many_fields}\r\n");
        let long_head = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(OWN_MAX_HEAD));
        let cases: [&[u8]; 16] = [
            b"POST /v1 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            b"POST /v1 HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n",
            b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
            b"GET /v1 HTTP/1.1\r\nConnection: close\r\n\r\n",
            b"GET /v1 HTTP/1.0\r\n\r\n",
            b"HEAD /v1 HTTP/1.1\r\n\r\n",
            b"CONNECT example.com:443 HTTP/1.1\r\n\r\n",
            b"GET http://example.com/v1 HTTP/1.1\r\n\r\n",
            b"OPTIONS * HTTP/1.1\r\n\r\n",
            b"POST /v1 HTTP/1.1\r\nContent-Length: 10\r\n\r\nonly part",
            b"POST /v1 HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab",
            b"POST /v1 HTTP/1.1\r\nContent-Length: +2\r\n\r\nab",
            b"POST /v1 HTTP/1.1\r\nContent-Length: 70000\r\n\r\n",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            b"BLAH\r\n\r\n",
            many_fields.as_bytes(),
        ];
        for bytes in cases.iter().copied().chain([long_head.as_bytes()]) {
            let (parsed, rest) = parsed(bytes);
            assert!(
                matches!(parsed, Err(NotPlain)),
                "{}: {parsed:?}",
                String::from_utf8_lossy(bytes)
            );
            assert_eq!(&rest[..], bytes);
        }
    }

    #[test]
    fn a_target_http_refuses_goes_to_hyper_with_the_bytes_restored() {
        // httparse takes bytes above 0x7f in a target; http's URI wants them to be UTF-8.
        let bytes = b"POST /caf\xe9 HTTP/1.1\r\nContent-Length: 2\r\n\r\nabGET / HTTP/1.1\r\n\r\n";
        let (parsed, rest) = parsed(bytes);
        assert!(matches!(parsed, Err(NotPlain)), "{parsed:?}");
        assert_eq!(&rest[..], bytes);
    }

    #[test]
    fn a_head_over_the_limit_goes_to_hyper_even_unfinished() {
        let bytes = b"GET /v1 HTTP/1.1\r\nHost: example\r\n";
        let mut read = buffer(bytes);
        let parsed = parse(&mut read, 16, &mut Vec::new());
        assert!(matches!(parsed, Err(NotPlain)), "{parsed:?}");
        assert_eq!(&read[..], bytes);
    }

    /// A body whose length is not known ahead.
    struct Unsized;

    impl Body for Unsized {
        type Data = Bytes;
        type Error = Infallible;

        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
            Poll::Ready(None)
        }
    }

    fn head_of<B: Body>(
        status: u16,
        fields: &[(&str, &str)],
        body: &B,
        keep_alive: bool,
    ) -> (String, Framing) {
        let mut headers = HeaderMap::new();
        for &(name, value) in fields {
            headers.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        let mut out = Vec::new();
        let status = StatusCode::from_u16(status).unwrap();
        let (framing, _) = head(&mut out, status, &headers, body, !keep_alive);
        (String::from_utf8(out).unwrap(), framing)
    }

    #[test]
    fn a_response_head_frames_its_body_by_length_when_known_and_chunked_otherwise() {
        let full = Full::new(Bytes::from_static(b"12345"));
        let (text, framing) = head_of(201, &[("content-type", "application/json")], &full, true);
        assert_eq!(framing, Framing::Length(5));
        assert!(
            text.starts_with("HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ndate: "),
            "{text}"
        );
        assert!(
            text.ends_with(" GMT\r\ncontent-length: 5\r\n\r\n"),
            "{text}"
        );

        // The response's own length is kept; its own framing fields are replaced.
        let (text, framing) = head_of(
            200,
            &[
                ("content-length", "7"),
                ("transfer-encoding", "chunked"),
                ("date", "Thu, 01 Jan 2026 00:00:00 GMT"),
            ],
            &Unsized,
            true,
        );
        assert_eq!(framing, Framing::Length(7));
        assert_eq!(
            text,
            "HTTP/1.1 200 OK\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\ncontent-length: 7\r\n\r\n"
        );

        let (text, framing) = head_of(200, &[("date", "d")], &Unsized, false);
        assert_eq!(framing, Framing::Chunked);
        assert_eq!(
            text,
            "HTTP/1.1 200 OK\r\ndate: d\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n"
        );
    }

    #[test]
    fn statuses_without_a_body_get_none() {
        let full = Full::new(Bytes::from_static(b"ignored"));
        let (text, framing) = head_of(204, &[("date", "d"), ("content-length", "7")], &full, true);
        assert_eq!(framing, Framing::None);
        assert_eq!(text, "HTTP/1.1 204 No Content\r\ndate: d\r\n\r\n");
        // A 304 keeps the length of what it stands for.
        let (text, framing) = head_of(304, &[("date", "d"), ("content-length", "7")], &full, true);
        assert_eq!(framing, Framing::None);
        assert_eq!(
            text,
            "HTTP/1.1 304 Not Modified\r\ndate: d\r\ncontent-length: 7\r\n\r\n"
        );
    }

    /// The own request-head parser against httparse read independently: a request it takes
    /// is the one the bytes say (method, target, version, body framed by its one
    /// `Content-Length` or none); anything else is left to hyper untouched or awaits more.
    mod properties {
        use proptest::prelude::*;
        use proptest::sample::select;

        use super::*;

        /// How RFC 9112 §6.3 frames the body of the request httparse reads in `bytes`:
        /// `Some(length)` for a request this loop may serve (no transfer coding, at most one
        /// `Content-Length` of digits only), `None` for one it must not.
        fn reference(bytes: &[u8]) -> Option<(String, String, usize, usize)> {
            let mut fields = [httparse::EMPTY_HEADER; OWN_MAX_FIELDS];
            let mut head = httparse::Request::new(&mut fields);
            let httparse::Status::Complete(len) = head.parse(bytes).ok()? else {
                return None;
            };
            if head.version != Some(1) {
                return None;
            }
            let mut length = None;
            for field in head.headers.iter() {
                if field.name.eq_ignore_ascii_case("transfer-encoding") {
                    return None;
                }
                if field.name.eq_ignore_ascii_case("content-length") {
                    let value = std::str::from_utf8(field.value).ok()?;
                    if length.is_some()
                        || value.is_empty()
                        || !value.bytes().all(|b| b.is_ascii_digit())
                    {
                        return None;
                    }
                    length = Some(value.parse::<usize>().ok()?);
                }
            }
            Some((
                head.method?.to_owned(),
                head.path?.to_owned(),
                len,
                length.unwrap_or(0),
            ))
        }

        fn field() -> impl Strategy<Value = (&'static str, &'static str)> {
            (
                select(vec![
                    "Host",
                    "Content-Length",
                    "content-length",
                    "CONTENT-LENGTH",
                    "Transfer-Encoding",
                    "Connection",
                    "Expect",
                    "Upgrade",
                    "X-A",
                    "Content-Length ",
                    "Transfer_Encoding",
                ]),
                select(vec![
                    "0",
                    "3",
                    "5",
                    "05",
                    "+5",
                    " 5 ",
                    "5, 5",
                    "-1",
                    "",
                    "99999999999999999999",
                    "chunked",
                    "keep-alive",
                    "close",
                    "x y",
                ]),
            )
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 1024, failure_persistence: None, ..ProptestConfig::default() })]

            #[test]
            fn a_request_taken_is_the_one_the_bytes_say_and_anything_else_is_left_as_it_came(
                method in select(vec!["GET", "POST", "PUT", "HEAD", "CONNECT", "OPTIONS", "get", "X-M", "G T", ""]),
                target in select(vec!["/", "/a?b=1", "*", "http://h/x", "/caf\u{e9}", "//x", "example.com:443", "/a b"]),
                version in select(vec!["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "http/1.1", "HTTP/1.1 "]),
                fields in prop::collection::vec(field(), 0..6),
                newline in select(vec!["\r\n", "\n"]),
                body in prop::collection::vec(any::<u8>(), 0..8),
                cut in any::<prop::sample::Index>(),
            ) {
                let mut bytes = format!("{method} {target} {version}{newline}");
                for (name, value) in &fields {
                    bytes.push_str(&format!("{name}: {value}{newline}"));
                }
                bytes.push_str(newline);
                let mut bytes = bytes.into_bytes();
                bytes.extend_from_slice(&body);
                // Whole, and cut short anywhere (the rest still on its way).
                for bytes in [&bytes[..], &bytes[..cut.index(bytes.len())]] {
                    let (parsed, rest) = parsed(bytes);
                    match parsed {
                        Ok(Some(request)) => {
                            let (method, target, head_len, body_len) = reference(bytes)
                                .unwrap_or_else(|| panic!("served a request the reference refuses: {bytes:?}"));
                            prop_assert_eq!(request.method().as_str(), method);
                            prop_assert_eq!(request.uri().to_string(), target);
                            prop_assert_eq!(request.version(), Version::HTTP_11);
                            let taken = Body::size_hint(request.body()).exact();
                            prop_assert_eq!(taken, Some(body_len as u64));
                            prop_assert_eq!(&rest[..], &bytes[head_len + body_len..]);
                        }
                        Ok(None) => {
                            prop_assert!(matches!(
                                httparse::Request::new(&mut [httparse::EMPTY_HEADER; OWN_MAX_FIELDS]).parse(bytes),
                                Ok(httparse::Status::Partial)
                            ));
                            prop_assert_eq!(&rest[..], bytes);
                        }
                        Err(NotPlain) => prop_assert_eq!(&rest[..], bytes),
                    }
                }
            }

            #[test]
            fn random_bytes_never_panic_the_request_parser(
                prefix in select(vec![&b""[..], b"GET / HTTP/1.1\r\n", b"POST /x HTTP/1.1\r\nContent-Length: 3\r\n"]),
                bytes in prop::collection::vec(any::<u8>(), 0..200),
            ) {
                let mut input = prefix.to_vec();
                input.extend_from_slice(&bytes);
                let (parsed, rest) = parsed(&input);
                if !matches!(parsed, Ok(Some(_))) {
                    prop_assert_eq!(&rest[..], &input[..]);
                }
            }
        }
    }
}
