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
use http::{Method, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use tower_service::Service;

use super::config::Upstream;
use super::http1::client::{
    self, BodyReader, ClientError, Connection, OwnFields, ResponseHead, UnsentBody,
};
use super::metrics::{Metrics, UpstreamErrorKind};
use super::pool::{ConnectError, Pool};
use idemgate::ErrorChain;
use idemgate::body::RequestBody;
use idemgate::headers::strip_hop_by_hop;
use idemgate::response::{IDEMPOTENT_REPLAYED, Problem, UpstreamFailure};

/// `X-Forwarded-For`.
pub const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// `X-Forwarded-Proto`.
pub const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
/// `X-Forwarded-Host`.
pub const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Sends requests to the upstream. A clone shares everything (reference counts), so the layer
/// may clone it per request.
#[derive(Clone)]
pub struct Forwarder {
    shared: Arc<ForwarderShared>,
    /// The address of the client whose requests this forwarder sends, as `X-Forwarded-For`
    /// gets it (see [`Forwarder::for_client`]).
    client_ip: Option<HeaderValue>,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder")
            .field("host", &self.shared.host)
            .field("client_ip", &self.client_ip)
            .finish_non_exhaustive()
    }
}

struct ForwarderShared {
    pool: Arc<Pool>,
    /// The `Host` sent upstream: the upstream's own authority.
    host: HeaderValue,
    upstream: Upstream,
    timeout: Duration,
    metrics: Arc<Metrics>,
}

impl Forwarder {
    /// A forwarder to `upstream` that waits at most `timeout` for a response head and at most
    /// `connect_timeout` for a new connection, and keeps a connection idle for at most
    /// `idle_timeout`.
    pub fn new(
        upstream: Upstream,
        timeout: Duration,
        connect_timeout: Duration,
        idle_timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        let pool = Pool::new(upstream.authority.clone(), connect_timeout, idle_timeout);
        Self {
            shared: Arc::new(ForwarderShared {
                host: pool.host_header(),
                pool,
                upstream,
                timeout,
                metrics,
            }),
            client_ip: None,
        }
    }

    /// This forwarder for the requests of one client connection: each gets the client's
    /// address appended to `X-Forwarded-For`. The address is rendered here, once per
    /// connection.
    pub fn for_client(&self, client: SocketAddr) -> Self {
        let ip = HeaderValue::try_from(client.ip().to_string())
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        Self {
            shared: Arc::clone(&self.shared),
            client_ip: Some(ip),
        }
    }
}

impl<B> Service<Request<RequestBody<B>>> for Forwarder
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

    fn call(&mut self, req: Request<RequestBody<B>>) -> Self::Future {
        // Split here, so the future holds the head once rather than the request and its head.
        let (parts, body) = req.into_parts();
        Box::pin(forward(
            Arc::clone(&self.shared),
            self.client_ip.clone(),
            parts,
            body,
        ))
    }
}

/// Sends the request upstream and answers with the upstream's response head and a body that
/// streams the rest, or with a problem response marked with what happened to the request.
///
/// A plain function returning an `async move` block, not an `async fn`, that awaits the
/// exchange itself rather than through another `async fn` around it: an `async fn` keeps each
/// argument in its state for its whole life and copies it into a local as it starts, so each
/// level would hold the request head again and move the next level's future (hundreds of
/// bytes) once more, on every forwarded request.
#[allow(
    clippy::manual_async_fn,
    reason = "an async fn would hold its arguments twice (above)"
)]
fn forward<B>(
    shared: Arc<ForwarderShared>,
    client_ip: Option<HeaderValue>,
    mut parts: http::request::Parts,
    mut body: RequestBody<B>,
) -> impl Future<Output = Result<Response<ProxyBody>, Infallible>>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    async move {
        let shared = &*shared;
        let client_ip = client_ip.as_ref();
        let client_version = parts.version;
        let Some(target) = upstream_target(&shared.upstream, &parts.method, &parts.uri) else {
            // Only a target that cannot be joined to the base path gets here; nothing was sent.
            return Ok(upstream_failure(UpstreamErrorKind::Unreachable, shared));
        };
        strip_hop_by_hop(&mut parts.headers);
        let forwarded = ForwardedFields::new(&parts.headers, &parts.uri, client_ip);
        let set = forwarded.set(&shared.host);
        let own = OwnFields {
            set: set.as_slice(),
            replaced: &FORWARDER_FIELDS,
        };
        parts.uri = Uri::from(target);

        if body.is_buffered() {
            // A request the layer held (read whole, hashed, claimed) goes upstream at the end of
            // the runtime's turn, after the other requests that are ready have had their turn:
            // under load their upstream writes leave together, so an upstream on the same host
            // reads several per wake-up instead of being woken (and taking the core) for each.
            // A streamed request goes at once: deferring those too measured worse (the upstream
            // woke more often per request).
            tokio::task::yield_now().await;
        }
        let started = Instant::now();
        let deadline = tokio::time::Instant::from_std(started) + shared.timeout;
        let sent = exchange(&shared.pool, &parts, &own, &mut body, deadline).await;
        Ok(answer(shared, client_version, body, sent, started))
    }
}

/// The client's response to what [`exchange`] returned: the upstream's response, its body
/// read as the client reads it, or the problem that stands for its failure.
fn answer<B>(
    shared: &ForwarderShared,
    client_version: http::Version,
    body: RequestBody<B>,
    sent: Result<(ResponseHead, Box<Connection>), ForwardError>,
    started: Instant,
) -> Response<ProxyBody>
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    match sent {
        Ok((mut head, connection)) => {
            let unsent = UnsentBody::take(&mut head, body);
            shared.metrics.observe_upstream(started.elapsed());
            prepare_response_headers(&mut head.headers);
            let body = ProxyBody::upstream(
                BodyReader::new(&head, connection, shared.timeout, unsent),
                &shared.pool,
            );
            let mut response = Response::new(body);
            *response.status_mut() = head.status;
            // Answer in the client's protocol version, whatever the upstream spoke (an
            // HTTP/1.0 upstream must not turn the client's HTTP/1.1 response into 1.0).
            *response.version_mut() = client_version;
            *response.headers_mut() = head.headers;
            response
        }
        Err(ForwardError::Client(client::SendError::BodyBeforeSent(error))) => {
            // The client's body broke off (or overran its length) before anything went
            // upstream: not the upstream's failure, and nothing was sent.
            tracing::debug!(error = %ErrorChain(&*error), "request body failed before it was sent");
            problem_response(Problem::request_body_error(), UpstreamFailure::NotSent)
        }
        Err(ForwardError::Client(client::SendError::NoResponse(ClientError::RequestBody(
            error,
        )))) => {
            // The same after part of the request went out: the upstream holds an incomplete
            // message, which is not the upstream's failure either, but what it made of it
            // is not known.
            tracing::debug!(error = %ErrorChain(&*error), "request body failed while it was sent");
            problem_response(Problem::request_body_error(), UpstreamFailure::Unknown)
        }
        Err(error) => {
            let kind = error.kind();
            if kind == UpstreamErrorKind::Timeout {
                tracing::warn!(
                    after_ms = shared.timeout.as_millis() as u64,
                    "upstream timed out"
                );
            } else {
                tracing::warn!(error = %ErrorChain(&error), kind = kind.as_str(), "upstream request failed");
            }
            upstream_failure(kind, shared)
        }
    }
}

/// Why the upstream gave no response.
#[derive(Debug, thiserror::Error)]
enum ForwardError {
    /// No connection could be had: nothing was sent.
    #[error(transparent)]
    Connect(ConnectError),
    /// The request's deadline passed before a new connection was made.
    #[error("the upstream did not connect in time")]
    ConnectTimedOut,
    /// The connection was had; the exchange on it failed (see [`client::SendError`]).
    #[error(transparent)]
    Client(#[from] client::SendError),
}

impl ForwardError {
    /// What kind of upstream failure this is. Only a failure after the request may have been
    /// written is a timeout or a reset, whose outcome is unknown: a connection that was never
    /// made, even one cut short by the request's deadline, sent nothing.
    fn kind(&self) -> UpstreamErrorKind {
        match self {
            ForwardError::Connect(_)
            | ForwardError::ConnectTimedOut
            | ForwardError::Client(client::SendError::Unused(_)) => UpstreamErrorKind::Unreachable,
            ForwardError::Client(client::SendError::TimedOut) => UpstreamErrorKind::Timeout,
            ForwardError::Client(_) => UpstreamErrorKind::Reset,
        }
    }
}

/// Sends the request on an idle connection, or on a new one; an idle connection that fails
/// before anything was written to it gets the request sent on a new one. Answers with the
/// response head and the connection it came on.
async fn exchange<B>(
    pool: &Pool,
    head: &http::request::Parts,
    own: &OwnFields<'_>,
    body: &mut B,
    deadline: tokio::time::Instant,
) -> Result<(ResponseHead, Box<Connection>), ForwardError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    // A body frame taken by an attempt that wrote nothing, for the next attempt.
    let mut first = None;
    if let Some(mut connection) = pool.take_idle() {
        match connection.send(head, own, body, &mut first, deadline).await {
            Ok(response) => return Ok((response, connection)),
            Err(client::SendError::Unused(error)) => {
                tracing::debug!(error = %ErrorChain(&error), "idle upstream connection failed; trying a new one");
            }
            Err(error) => return Err(error.into()),
        }
    }
    let mut connection = tokio::time::timeout_at(deadline, pool.connect())
        .await
        .map_err(|_| ForwardError::ConnectTimedOut)?
        .map_err(ForwardError::Connect)?;
    let response = connection
        .send(head, own, body, &mut first, deadline)
        .await?;
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

/// The request target sent upstream (origin-form): the upstream's base path followed by the
/// request's path and query. Nothing of the client's target but its path and query is used.
/// `OPTIONS *` asks about the server as a whole, not a resource: it goes as `OPTIONS *`
/// (asterisk-form), whatever the base path. (The front service refuses `*` with any other
/// method.)
pub fn upstream_target(upstream: &Upstream, method: &Method, target: &Uri) -> Option<PathAndQuery> {
    match target.path_and_query() {
        Some(pq)
            if pq.as_str() == "*" && method == Method::OPTIONS && target.authority().is_none() =>
        {
            Some(pq.clone())
        }
        // The common case, an upstream at its root: the client's path and query as they are
        // (a clone shares their bytes).
        Some(pq) if upstream.base_path.is_empty() && pq.as_str().starts_with('/') => {
            Some(pq.clone())
        }
        pq => {
            let pq = pq.map_or("/", PathAndQuery::as_str);
            // Anything else without a leading `/` gets the `/` a path must start with.
            let slash = if pq.starts_with('/') { "" } else { "/" };
            format!("{}{slash}{pq}", upstream.base_path).parse().ok()
        }
    }
}

/// The request fields the forwarder sets itself: `Host` (the upstream's authority) and the
/// `X-Forwarded-*` fields, and `Idempotent-Replayed`, which only idemgate sets and is never
/// sent upstream. The client's fields of these names are not sent as they came.
static FORWARDER_FIELDS: [HeaderName; 5] = [
    HOST,
    X_FORWARDED_FOR,
    X_FORWARDED_PROTO,
    X_FORWARDED_HOST,
    IDEMPOTENT_REPLAYED,
];

/// `X-Forwarded-Proto`'s value: the gateway listens on plain HTTP.
static PROTO_HTTP: HeaderValue = HeaderValue::from_static("http");

/// The values of the fields in [`FORWARDER_FIELDS`] that a request gets upstream. Each
/// `X-Forwarded-*` field is the chain the client sent (a proxy in front of the gateway may
/// have started it; its fields joined into one), with this hop's value appended.
#[derive(Debug)]
struct ForwardedFields {
    /// `X-Forwarded-For`: then the client's address.
    forwarded_for: Option<HeaderValue>,
    /// `X-Forwarded-Proto`: then `http`.
    forwarded_proto: Option<HeaderValue>,
    /// `X-Forwarded-Host`: then the client's `Host` (or, over HTTP/2, the `:authority`).
    forwarded_host: Option<HeaderValue>,
}

impl ForwardedFields {
    /// The values for a request with `headers` and `target` from the client at `client_ip`.
    fn new(headers: &http::HeaderMap, target: &Uri, client_ip: Option<&HeaderValue>) -> Self {
        let host = headers.get(HOST).cloned().or_else(|| {
            target
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        // One pass over the names finds which chains came (most requests bring none): the
        // three `X-Forwarded-*` names of [`FORWARDER_FIELDS`].
        let mut came = [false; 3];
        for name in headers.keys() {
            for (came, chain) in came.iter_mut().zip(&FORWARDER_FIELDS[1..4]) {
                *came |= name == chain;
            }
        }
        let field = |came: bool, name: &HeaderName, own: Option<&HeaderValue>| {
            if came {
                appended(headers, name, own)
            } else {
                own.cloned()
            }
        };
        let [came_for, came_proto, came_host] = came;
        Self {
            forwarded_for: field(came_for, &X_FORWARDED_FOR, client_ip),
            forwarded_proto: field(came_proto, &X_FORWARDED_PROTO, Some(&PROTO_HTTP)),
            forwarded_host: field(came_host, &X_FORWARDED_HOST, host.as_ref()),
        }
    }

    /// The fields to write, with `host` as `Host`.
    fn set<'a>(&'a self, host: &'a HeaderValue) -> FieldList<'a> {
        // The names are lent out of the static list.
        let [host_name, for_name, proto_name, host_forwarded_name, _] = &FORWARDER_FIELDS;
        let mut list = FieldList {
            fields: [(host_name, host); 4],
            len: 1,
        };
        if let Some(chain) = &self.forwarded_for {
            list.push(for_name, chain);
        }
        if let Some(chain) = &self.forwarded_proto {
            list.push(proto_name, chain);
        }
        if let Some(chain) = &self.forwarded_host {
            list.push(host_forwarded_name, chain);
        }
        list
    }
}

/// Up to four fields, kept on the stack.
struct FieldList<'a> {
    fields: [(&'a HeaderName, &'a HeaderValue); 4],
    len: usize,
}

impl<'a> FieldList<'a> {
    fn push(&mut self, name: &'a HeaderName, value: &'a HeaderValue) {
        self.fields[self.len] = (name, value);
        self.len += 1;
    }

    /// The fields, in order.
    fn as_slice(&self) -> &[(&'a HeaderName, &'a HeaderValue)] {
        &self.fields[..self.len]
    }
}

/// The field `name` sent upstream: the client's chain, its fields joined into one, with
/// this hop's value `own` appended.
fn appended(
    headers: &http::HeaderMap,
    name: &HeaderName,
    own: Option<&HeaderValue>,
) -> Option<HeaderValue> {
    let mut chain = Vec::new();
    for value in headers.get_all(name) {
        let v = value.as_bytes().trim_ascii();
        if !v.is_empty() {
            chain.extend_from_slice(v);
            chain.extend_from_slice(b", ");
        }
    }
    match own {
        Some(value) => chain.extend_from_slice(value.as_bytes()),
        None => chain.truncate(chain.len().saturating_sub(2)),
    }
    HeaderValue::from_bytes(&chain)
        .ok()
        .filter(|v| !v.is_empty())
}

/// Makes an upstream's headers fit to send to the client: hop-by-hop fields and a forged
/// `Idempotent-Replayed` are removed.
pub fn prepare_response_headers(headers: &mut http::HeaderMap) {
    strip_hop_by_hop(headers);
    idemgate::headers::remove(headers, &IDEMPOTENT_REPLAYED);
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
            (Method::POST, "/pay?x=1", "/pay?x=1"),
            (Method::POST, "http://evil.test:666/pay?x=1", "/pay?x=1"),
            (Method::OPTIONS, "*", "*"),
            (Method::GET, "/", "/"),
        ];
        for (method, target, want) in cases {
            let got = upstream_target(&up, &method, &target.parse().unwrap()).unwrap();
            assert_eq!(got.as_str(), want, "target {target}");
        }
        let based = upstream("http://127.0.0.1:3000/api/");
        let got = upstream_target(&based, &Method::POST, &"/v1/pay".parse().unwrap()).unwrap();
        assert_eq!(got.as_str(), "/api/v1/pay");
        // The server as a whole, whatever the base path.
        let got = upstream_target(&based, &Method::OPTIONS, &"*".parse().unwrap()).unwrap();
        assert_eq!(got.as_str(), "*");
    }

    /// The head `forward` writes upstream for a request with `headers` from 192.0.2.7.
    fn head_sent(headers: http::HeaderMap) -> String {
        let (mut parts, ()) = Request::post("/pay").body(()).unwrap().into_parts();
        parts.headers = headers;
        strip_hop_by_hop(&mut parts.headers);
        let ip = HeaderValue::from_static("192.0.2.7");
        let forwarded = ForwardedFields::new(&parts.headers, &parts.uri, Some(&ip));
        let upstream_host = HeaderValue::from_static("127.0.0.1:3000");
        let set = forwarded.set(&upstream_host);
        let own = OwnFields {
            set: set.as_slice(),
            replaced: &FORWARDER_FIELDS,
        };
        let mut out = Vec::new();
        client::encode_head(
            &parts,
            &own,
            crate::http1::codec::Framing::Length(2),
            &mut out,
        );
        String::from_utf8(out).unwrap()
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
            HeaderValue::from_static("front.example"),
        );
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.2"));
        h.insert("idempotency-key", HeaderValue::from_static("k1"));
        h.insert("content-length", HeaderValue::from_static("2"));
        assert_eq!(
            head_sent(h),
            "POST /pay HTTP/1.1\r\n\
             host: 127.0.0.1:3000\r\n\
             x-forwarded-for: 10.0.0.1, 10.0.0.2, 192.0.2.7\r\n\
             x-forwarded-proto: https, http\r\n\
             x-forwarded-host: front.example, public.example\r\n\
             idempotency-key: k1\r\n\
             content-length: 2\r\n\r\n",
            "hop-by-hop fields, a forged replay mark and the client's own Host are not sent; \
             each X-Forwarded-* chain gets this hop appended; the key is sent, so the upstream \
             can deduplicate too"
        );
    }

    #[test]
    fn request_without_host_or_chains_gets_this_hop_alone() {
        let mut h = http::HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static("  "));
        assert_eq!(
            head_sent(h),
            "POST /pay HTTP/1.1\r\n\
             host: 127.0.0.1:3000\r\n\
             x-forwarded-for: 192.0.2.7\r\n\
             x-forwarded-proto: http\r\n\
             content-length: 2\r\n\r\n"
        );
        // Without a Host of its own, the request's X-Forwarded-Host chain passes as it came.
        let mut h = http::HeaderMap::new();
        h.insert(
            "x-forwarded-host",
            HeaderValue::from_static("front.example"),
        );
        assert_eq!(
            head_sent(h),
            "POST /pay HTTP/1.1\r\n\
             host: 127.0.0.1:3000\r\n\
             x-forwarded-for: 192.0.2.7\r\n\
             x-forwarded-proto: http\r\n\
             x-forwarded-host: front.example\r\n\
             content-length: 2\r\n\r\n"
        );
    }

    #[test]
    fn without_a_client_address_the_chain_passes_as_it_came() {
        let mut h = http::HeaderMap::new();
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.1"));
        h.append("x-forwarded-for", HeaderValue::from_static("10.0.0.2 "));
        assert_eq!(
            appended(&h, &X_FORWARDED_FOR, None).unwrap(),
            "10.0.0.1, 10.0.0.2",
            "fields joined into one"
        );
        assert_eq!(
            appended(&http::HeaderMap::new(), &X_FORWARDED_FOR, None),
            None
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

    /// A connection still being made when the request's deadline passes (before the pool's
    /// own connect limit) sent nothing: the key is released, not left to an unknown outcome.
    #[tokio::test]
    async fn a_connect_cut_by_the_deadline_sent_nothing() {
        // A listener that accepts nothing, with its queue of one filled: the next connect hangs.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let silent = socket.listen(0).unwrap();
        let addr = silent.local_addr().unwrap();
        let _filler = std::net::TcpStream::connect(addr).unwrap();

        let forwarder = Forwarder::new(
            upstream(&format!("http://{addr}")),
            Duration::from_millis(200),
            Duration::from_secs(30),
            crate::config::DEFAULT_UPSTREAM_IDLE_TIMEOUT,
            Metrics::new(),
        );
        let shared = &forwarder.shared;
        let (head, ()) = Request::post("/pay").body(()).unwrap().into_parts();
        let own = OwnFields {
            set: &[],
            replaced: &[],
        };
        let deadline = tokio::time::Instant::now() + shared.timeout;
        let mut body = http_body_util::Empty::<Bytes>::new();
        let error = exchange(&shared.pool, &head, &own, &mut body, deadline)
            .await
            .unwrap_err();
        assert!(matches!(error, ForwardError::ConnectTimedOut), "{error:?}");
        assert_eq!(error.kind(), UpstreamErrorKind::Unreachable);

        let answer = upstream_failure(error.kind(), shared);
        assert_eq!(answer.status(), http::StatusCode::BAD_GATEWAY);
        assert_eq!(
            answer.extensions().get::<UpstreamFailure>(),
            Some(&UpstreamFailure::NotSent)
        );
    }
}
