//! The innermost service: sends each request to the configured upstream over a pooled
//! keep-alive connection (see [`super::pool`]) and streams the response back.
//!
//! The upstream comes only from the config. The request's path and query are appended to the
//! upstream's base URL; the client's `Host`, an absolute-form target or `X-Forwarded-Host`
//! never choose where a request goes. Hop-by-hop headers are stripped both ways, then
//! `X-Forwarded-For`, `X-Forwarded-Proto` and `X-Forwarded-Host` are added.
//!
//! When the upstream gives no response the forwarder answers with the layer's problem
//! response and marks it with [`UpstreamFailure`], so the layer knows whether anything was
//! sent (release the key) or not known (the route's `unknown_outcome`).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HOST, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use tower_service::Service;

use super::ErrorChain;
use super::client::{self, BodyReader, ClientError, Connection, ResponseHead};
use super::config::Upstream;
use super::metrics::{Metrics, UpstreamErrorKind};
use super::pool::{ConnectError, Pool};
use crate::headers::strip_hop_by_hop;
use crate::response::{IDEMPOTENT_REPLAYED, Problem, UpstreamFailure};

/// `X-Forwarded-For`.
pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// `X-Forwarded-Proto`.
pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// `X-Forwarded-Host`.
pub const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The client a request came from, put on each request by the server. Its address is rendered
/// once per connection, not once per request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientAddr {
    addr: SocketAddr,
    ip: HeaderValue,
}

impl ClientAddr {
    /// The client at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        let ip = HeaderValue::try_from(addr.ip().to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        Self { addr, ip }
    }

    /// The client's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Sends requests with bodies of type `B` to the upstream. A clone shares everything (one
/// reference count), so the layer may clone it per request.
pub struct Forwarder {
    shared: Arc<ForwarderShared>,
}

struct ForwarderShared {
    pool: Arc<Pool>,
    /// The `Host` sent upstream: the upstream's own authority.
    host: HeaderValue,
    upstream: Upstream,
    timeout: Duration,
    metrics: Arc<Metrics>,
}

impl Clone for Forwarder {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl Forwarder {
    /// A forwarder to `upstream` that waits at most `timeout` for a response head and at most
    /// `connect_timeout` for a new connection.
    pub fn new(
        upstream: Upstream,
        timeout: Duration,
        connect_timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        let pool = Pool::new(upstream.authority.clone(), connect_timeout);
        Self {
            shared: Arc::new(ForwarderShared {
                host: pool.host_header(),
                pool,
                upstream,
                timeout,
                metrics,
            }),
        }
    }
}

impl<B> Service<Request<B>> for Forwarder
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let shared = Arc::clone(&self.shared);
        Box::pin(async move { Ok(forward(&shared, req).await) })
    }
}

async fn forward<B>(shared: &ForwarderShared, req: Request<B>) -> Response<ProxyBody>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (mut parts, body) = req.into_parts();
    let client_ip = parts.extensions.get::<ClientAddr>().map(|a| a.ip.clone());
    let client_version = parts.version;
    let original_host = original_host(&parts.headers, &parts.uri);
    let Some(target) = upstream_target(&shared.upstream, &parts.uri) else {
        // Only a target that cannot be joined to the base path gets here; nothing was sent.
        return upstream_failure(UpstreamErrorKind::Unreachable, shared);
    };
    prepare_request_headers(&mut parts.headers, client_ip, original_host);
    parts.headers.insert(HOST, shared.host.clone());
    parts.uri = Uri::from(target);
    // The upstream connection is HTTP/1.1 whatever the client spoke (h2c included).
    parts.version = Version::HTTP_11;

    let started = Instant::now();
    let result = tokio::time::timeout(shared.timeout, send(&shared.pool, &parts, body)).await;
    match result {
        Ok(Ok((mut head, connection))) => {
            shared.metrics.observe_upstream(started.elapsed());
            prepare_response_headers(&mut head.headers);
            let body = ProxyBody::upstream(BodyReader::new(&head, connection), &shared.pool);
            let mut response = Response::new(body);
            *response.status_mut() = head.status;
            // Answer in the client's protocol version, whatever the upstream spoke (an
            // HTTP/1.0 upstream must not turn the client's HTTP/1.1 response into 1.0).
            *response.version_mut() = client_version;
            *response.headers_mut() = head.headers;
            response
        }
        Ok(Err(SendError::Client(client::SendError::BodyBeforeSent(error)))) => {
            // The client's body broke off (or overran its length) before anything went
            // upstream: not the upstream's failure, and nothing was sent.
            tracing::debug!(error = %ErrorChain(&*error), "request body failed before it was sent");
            problem_response(Problem::request_body_error(), UpstreamFailure::NotSent)
        }
        Ok(Err(SendError::Client(client::SendError::NoResponse(ClientError::RequestBody(
            error,
        ))))) => {
            // The same after part of the request went out: the upstream holds an incomplete
            // message, which is not the upstream's failure either, but what it made of it
            // is not known.
            tracing::debug!(error = %ErrorChain(&*error), "request body failed while it was sent");
            problem_response(Problem::request_body_error(), UpstreamFailure::Unknown)
        }
        Ok(Err(error)) => {
            let kind = match error {
                SendError::Connect(_) | SendError::Client(client::SendError::Unused(_)) => {
                    UpstreamErrorKind::Unreachable
                }
                SendError::Client(_) => UpstreamErrorKind::Reset,
            };
            tracing::warn!(error = %ErrorChain(&error), kind = kind.as_str(), "upstream request failed");
            upstream_failure(kind, shared)
        }
        Err(_) => {
            tracing::warn!(
                after_ms = shared.timeout.as_millis() as u64,
                "upstream timed out"
            );
            upstream_failure(UpstreamErrorKind::Timeout, shared)
        }
    }
}

/// Why the upstream gave no response.
#[derive(Debug, thiserror::Error)]
enum SendError {
    /// No connection could be had: nothing was sent.
    #[error(transparent)]
    Connect(ConnectError),
    /// The connection was had; the exchange on it failed (see [`client::SendError`]).
    #[error(transparent)]
    Client(#[from] client::SendError),
}

/// Sends the request on an idle connection, or on a new one; an idle connection that fails
/// before anything was written to it gets the request sent on a new one. Answers with the
/// response head and the connection it came on.
async fn send<B>(
    pool: &Pool,
    head: &http::request::Parts,
    mut body: B,
) -> Result<(ResponseHead, Connection), SendError>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // A body frame taken by an attempt that wrote nothing, for the next attempt.
    let mut first = None;
    if let Some(mut connection) = pool.take_idle() {
        match connection.send(head, &mut body, &mut first).await {
            Ok(response) => return Ok((response, connection)),
            Err(client::SendError::Unused(error)) => {
                tracing::debug!(error = %ErrorChain(&error), "idle upstream connection failed; trying a new one");
            }
            Err(error) => return Err(error.into()),
        }
    }
    let mut connection = pool.connect().await.map_err(SendError::Connect)?;
    let response = connection.send(head, &mut body, &mut first).await?;
    Ok((response, connection))
}

/// The answer when the upstream gave none: the layer's problem response, marked with what
/// happened to the request.
fn upstream_failure(kind: UpstreamErrorKind, shared: &ForwarderShared) -> Response<ProxyBody> {
    shared.metrics.count_upstream_error(kind);
    let (problem, failure) = match kind {
        UpstreamErrorKind::Unreachable => {
            (Problem::upstream_unreachable(), UpstreamFailure::NotSent)
        }
        UpstreamErrorKind::Timeout => (
            Problem::upstream_timeout(shared.timeout),
            UpstreamFailure::Unknown,
        ),
        UpstreamErrorKind::Reset => (Problem::no_response(), UpstreamFailure::Unknown),
    };
    problem_response(problem, failure)
}

/// A problem answer made here, marked with what happened to the request.
fn problem_response(problem: Problem, failure: UpstreamFailure) -> Response<ProxyBody> {
    let mut response = problem.into_response().map(ProxyBody::full);
    response.extensions_mut().insert(failure);
    response
}

/// The client's `Host` (or, over HTTP/2, the `:authority`), as sent.
fn original_host(headers: &http::HeaderMap, uri: &Uri) -> Option<HeaderValue> {
    headers.get(HOST).cloned().or_else(|| {
        uri.authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    })
}

/// The request target sent upstream (origin-form): the upstream's base path followed by the
/// request's path and query. Nothing of the client's target but its path and query is used.
pub fn upstream_target(upstream: &Upstream, target: &Uri) -> Option<PathAndQuery> {
    match target.path_and_query() {
        // The common case, an upstream at its root: the client's path and query as they are
        // (a clone shares their bytes).
        Some(pq) if upstream.base_path.is_empty() && pq.as_str().starts_with('/') => {
            Some(pq.clone())
        }
        pq => {
            let pq = pq.map_or("/", PathAndQuery::as_str);
            // `*` (OPTIONS) and the like get the `/` a path must start with.
            let slash = if pq.starts_with('/') { "" } else { "/" };
            format!("{}{slash}{pq}", upstream.base_path).parse().ok()
        }
    }
}

/// Makes a client's headers fit to send upstream: hop-by-hop fields, headers only idemgate
/// sets and the client's `Host` are removed (the forwarder sends the upstream's authority),
/// and the `X-Forwarded-*` fields are added.
pub fn prepare_request_headers(
    headers: &mut http::HeaderMap,
    client_ip: Option<HeaderValue>,
    original_host: Option<HeaderValue>,
) {
    strip_hop_by_hop(headers);
    crate::headers::remove(headers, &IDEMPOTENT_REPLAYED);
    headers.remove(HOST);
    if let Some(ip) = client_ip {
        append_forwarded_for(headers, ip);
    }
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    match original_host {
        Some(host) => {
            headers.insert(X_FORWARDED_HOST, host);
        }
        None => crate::headers::remove(headers, &X_FORWARDED_HOST),
    }
}

/// Appends `ip` to the `X-Forwarded-For` chain, joining earlier fields into one.
fn append_forwarded_for(headers: &mut http::HeaderMap, ip: HeaderValue) {
    let mut earlier = match headers.entry(X_FORWARDED_FOR) {
        http::header::Entry::Vacant(slot) => {
            slot.insert(ip);
            return;
        }
        http::header::Entry::Occupied(earlier) => earlier,
    };
    let mut chain = Vec::new();
    for value in earlier.iter() {
        let v = value.as_bytes().trim_ascii();
        if !v.is_empty() {
            chain.extend_from_slice(v);
            chain.extend_from_slice(b", ");
        }
    }
    chain.extend_from_slice(ip.as_bytes());
    match HeaderValue::from_bytes(&chain) {
        Ok(joined) => {
            earlier.insert(joined);
        }
        Err(_) => {
            earlier.remove();
        }
    }
}

/// Makes an upstream's headers fit to send to the client: hop-by-hop fields and a forged
/// `Idempotent-Replayed` are removed.
pub fn prepare_response_headers(headers: &mut http::HeaderMap) {
    strip_hop_by_hop(headers);
    crate::headers::remove(headers, &IDEMPOTENT_REPLAYED);
}

/// A response body: the upstream's, streamed (its connection goes back to the pool once the
/// body has been read to its end), or one the gateway made.
#[derive(Debug)]
pub struct ProxyBody {
    inner: ProxyBodyInner,
}

#[derive(Debug)]
enum ProxyBodyInner {
    Upstream { reader: BodyReader, pool: Arc<Pool> },
    Full(Option<Bytes>),
}

impl ProxyBody {
    fn upstream(mut reader: BodyReader, pool: &Arc<Pool>) -> Self {
        // No body to read (`204`, `Content-Length: 0`): the connection is free now.
        if let Some(connection) = reader.take_reusable() {
            pool.put_back(connection);
        }
        Self {
            inner: ProxyBodyInner::Upstream {
                reader,
                pool: Arc::clone(pool),
            },
        }
    }

    /// A body of `bytes`, sent whole.
    pub fn full(bytes: Bytes) -> Self {
        Self {
            inner: ProxyBodyInner::Full(Some(bytes).filter(|b| !b.is_empty())),
        }
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = ClientError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientError>>> {
        match &mut self.get_mut().inner {
            ProxyBodyInner::Upstream { reader, pool } => {
                let data = std::task::ready!(reader.poll_data(cx));
                // Read to its end, the response frees its connection for the next request.
                if let Some(connection) = reader.take_reusable() {
                    pool.put_back(connection);
                }
                Poll::Ready(data.map(|data| data.map(Frame::data)))
            }
            ProxyBodyInner::Full(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            ProxyBodyInner::Upstream { reader, .. } => reader.is_done(),
            ProxyBodyInner::Full(bytes) => bytes.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            ProxyBodyInner::Upstream { reader, .. } => reader
                .remaining()
                .map_or_else(SizeHint::default, SizeHint::with_exact),
            ProxyBodyInner::Full(bytes) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(s: &str) -> Upstream {
        Upstream::parse(s).unwrap()
    }

    #[test]
    fn target_comes_only_from_the_config() {
        let up = upstream("http://127.0.0.1:3000");
        let cases = [
            ("/pay?x=1", "/pay?x=1"),
            ("http://evil.test:666/pay?x=1", "/pay?x=1"),
            ("*", "/*"),
            ("/", "/"),
        ];
        for (target, want) in cases {
            let got = upstream_target(&up, &target.parse().unwrap()).unwrap();
            assert_eq!(got.as_str(), want, "target {target}");
        }
        let based = upstream("http://127.0.0.1:3000/api/");
        let got = upstream_target(&based, &"/v1/pay".parse().unwrap()).unwrap();
        assert_eq!(got.as_str(), "/api/v1/pay");
        let got = upstream_target(&based, &"*".parse().unwrap()).unwrap();
        assert_eq!(got.as_str(), "/api/*");
    }

    #[test]
    fn request_headers_lose_hop_by_hop_and_gain_forwarded() {
        let mut h = http::HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("close, x-hop"));
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("upgrade", HeaderValue::from_static("websocket"));
        h.insert(
            "proxy-authorization",
            HeaderValue::from_static("Basic eA=="),
        );
        h.insert("idempotent-replayed", HeaderValue::from_static("true"));
        h.insert("host", HeaderValue::from_static("public.example"));
        h.insert(
            "x-forwarded-host",
            HeaderValue::from_static("spoofed.example"),
        );
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.2"));
        h.insert("idempotency-key", HeaderValue::from_static("k1"));
        let host = h.get(HOST).cloned();
        prepare_request_headers(&mut h, Some(HeaderValue::from_static("192.0.2.7")), host);
        for gone in [
            "connection",
            "x-hop",
            "keep-alive",
            "te",
            "upgrade",
            "proxy-authorization",
            "idempotent-replayed",
            "host",
        ] {
            assert!(!h.contains_key(gone), "{gone} should be stripped");
        }
        assert_eq!(h["x-forwarded-for"], "10.0.0.1, 10.0.0.2, 192.0.2.7");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "public.example");
        assert_eq!(
            h["idempotency-key"], "k1",
            "the key is forwarded so the upstream can deduplicate too"
        );
    }

    #[test]
    fn response_headers_lose_hop_by_hop_and_forged_replay_marks() {
        let mut h = http::HeaderMap::new();
        h.insert("connection", HeaderValue::from_static("x-internal"));
        h.insert("x-internal", HeaderValue::from_static("1"));
        h.insert("transfer-encoding", HeaderValue::from_static("chunked"));
        h.insert("proxy-authenticate", HeaderValue::from_static("Basic"));
        h.insert("trailer", HeaderValue::from_static("x-sum"));
        h.insert("idempotent-replayed", HeaderValue::from_static("true"));
        h.insert("content-type", HeaderValue::from_static("application/json"));
        prepare_response_headers(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("content-type"));
    }
}
