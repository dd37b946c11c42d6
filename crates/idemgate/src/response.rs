//! Every answer idemgate makes up itself, decided here: RFC 9457 problem responses, replays of
//! stored responses, and the extensions that tell the application what was decided.
//!
//! # Problem types
//!
//! Each problem body is `application/problem+json` with `type`, `title`, `status` and
//! `detail`. The `type` is `urn:idemgate:problem:<slug>`:
//!
//! | slug | status | when |
//! | --- | --- | --- |
//! | `invalid-key` | 400 | the key is empty, longer than 255, not visible ASCII, a malformed sf-string, or sent twice |
//! | `missing-key` | 400 | the route requires a key and the request has none |
//! | `invalid-signature` | 401 + `WWW-Authenticate: Webhook-Signature` | the route verifies its sender's signature (a webhook provider's) and it is missing, does not match, or signs a timestamp outside the tolerance; nothing was claimed or forwarded |
//! | `request-body-error` | 400 | the request body could not be read |
//! | `request-too-large` | 413 | the body of a keyed request is over `max_request_bytes` |
//! | `headers-too-large` | 431 | (proxy) more header fields than `max_headers`, or a header block over `max_header_bytes` |
//! | `unsupported-transfer-coding` | 501 | (proxy) a request body sent with a transfer coding other than `chunked` alone (`Transfer-Encoding: gzip, chunked`); nothing forwarded |
//! | `malformed-request` | 400 | (proxy) an HTTP/1.1 request without a `Host` field, any request with more than one or with one that is not `host[:port]`, an HTTP/2 request whose `Host` differs from its `:authority`, or a `*` target with a method other than `OPTIONS`; nothing forwarded |
//! | `unsupported-method` | 501 | (proxy) `CONNECT`: the gateway is a reverse proxy and opens no tunnels; nothing forwarded |
//! | `key-mismatch` | 422 (configurable) | the key was used before with a different request |
//! | `request-in-flight` | 409 + `Retry-After` | the same request is running now |
//! | `response-not-replayable` | 409 | the request ran, but its response was over `max_response_bytes` and was not kept |
//! | `outcome-unknown` | 502 | the request was sent upstream before and no answer was captured; an operator resolves it |
//! | `upstream-unreachable` | 502 | the upstream could not be reached; nothing was sent |
//! | `upstream-timeout` | 504 | the upstream did not answer within `upstream_timeout` |
//! | `store-unavailable` | 503 + `Retry-After` | the record store failed or did not answer in time; nothing was forwarded |
//! | `internal-error` | 500 | idemgate reached a state it should never reach (a bug) |
//!
//! The proxy's admin listener answers its own errors with these, `store-unavailable` above
//! included (a record lookup or deletion whose store call failed):
//!
//! | slug | status | when |
//! | --- | --- | --- |
//! | `unauthorized` | 401 + `WWW-Authenticate: Bearer` | a record endpoint was called without the right `Authorization: Bearer <admin_token>` |
//! | `bad-request` | 400 | a malformed admin query: a record key that is not 64 hex digits, bad percent-encoding, a missing `route` or `key`, a parameter that is not one of the route's scope headers, an invalid key |
//! | `not-found` | 404 | no such admin path, no route of that name, or the record endpoints are disabled (no `admin_token`) |
//! | `record-not-found` | 404 | the store holds no record under that key (never claimed, expired, or deleted) |
//! | `method-not-allowed` | 405 + `Allow` | an admin path called with a method it does not serve |
//! | `not-ready` | 503 | `/readyz`: the store did not answer its ping within `store_timeout`, or shutdown has begun |

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ALLOW, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderName, HeaderValue, Method, Response, StatusCode};

use crate::record::{RecordKey, StoredResponse};

/// The header idemgate sets on every replayed response. idemgate owns it: it is removed from
/// client requests and from upstream responses.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");

/// The kinds of problem idemgate answers with. See the module docs for the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProblemKind {
    /// `400 invalid-key`.
    InvalidKey,
    /// `400 missing-key`.
    MissingKey,
    /// `401 invalid-signature`.
    InvalidSignature,
    /// `400 request-body-error`.
    RequestBodyError,
    /// `413 request-too-large`.
    RequestTooLarge,
    /// `431 headers-too-large` (proxy).
    HeadersTooLarge,
    /// `501 unsupported-transfer-coding` (proxy).
    UnsupportedTransferCoding,
    /// `400 malformed-request` (proxy).
    MalformedRequest,
    /// `501 unsupported-method` (proxy).
    UnsupportedMethod,
    /// `422 key-mismatch` (status configurable per route).
    KeyMismatch,
    /// `409 request-in-flight`.
    RequestInFlight,
    /// `409 response-not-replayable`.
    ResponseNotReplayable,
    /// `502 outcome-unknown`.
    OutcomeUnknown,
    /// `502 upstream-unreachable`.
    UpstreamUnreachable,
    /// `504 upstream-timeout`.
    UpstreamTimeout,
    /// `503 store-unavailable`.
    StoreUnavailable,
    /// `500 internal-error`.
    Internal,
    /// `401 unauthorized` (admin listener).
    Unauthorized,
    /// `400 bad-request` (admin listener).
    BadRequest,
    /// `404 not-found` (admin listener).
    NotFound,
    /// `404 record-not-found` (admin listener).
    RecordNotFound,
    /// `405 method-not-allowed` (admin listener).
    MethodNotAllowed,
    /// `503 not-ready` (admin listener).
    NotReady,
}

impl ProblemKind {
    /// The slug after `urn:idemgate:problem:`.
    pub fn slug(self) -> &'static str {
        match self {
            ProblemKind::InvalidKey => "invalid-key",
            ProblemKind::MissingKey => "missing-key",
            ProblemKind::InvalidSignature => "invalid-signature",
            ProblemKind::RequestBodyError => "request-body-error",
            ProblemKind::RequestTooLarge => "request-too-large",
            ProblemKind::HeadersTooLarge => "headers-too-large",
            ProblemKind::UnsupportedTransferCoding => "unsupported-transfer-coding",
            ProblemKind::MalformedRequest => "malformed-request",
            ProblemKind::UnsupportedMethod => "unsupported-method",
            ProblemKind::KeyMismatch => "key-mismatch",
            ProblemKind::RequestInFlight => "request-in-flight",
            ProblemKind::ResponseNotReplayable => "response-not-replayable",
            ProblemKind::OutcomeUnknown => "outcome-unknown",
            ProblemKind::UpstreamUnreachable => "upstream-unreachable",
            ProblemKind::UpstreamTimeout => "upstream-timeout",
            ProblemKind::StoreUnavailable => "store-unavailable",
            ProblemKind::Internal => "internal-error",
            ProblemKind::Unauthorized => "unauthorized",
            ProblemKind::BadRequest => "bad-request",
            ProblemKind::NotFound => "not-found",
            ProblemKind::RecordNotFound => "record-not-found",
            ProblemKind::MethodNotAllowed => "method-not-allowed",
            ProblemKind::NotReady => "not-ready",
        }
    }

    /// The problem's short, fixed title.
    pub fn title(self) -> &'static str {
        match self {
            ProblemKind::InvalidKey => "Invalid idempotency key",
            ProblemKind::MissingKey => "Idempotency key required",
            ProblemKind::InvalidSignature => "Webhook signature missing, wrong or expired",
            ProblemKind::RequestBodyError => "Request body could not be read",
            ProblemKind::RequestTooLarge => "Request body too large for an idempotent request",
            ProblemKind::HeadersTooLarge => "Request header fields too large",
            ProblemKind::UnsupportedTransferCoding => "Transfer coding not supported",
            ProblemKind::MalformedRequest => "Malformed request",
            ProblemKind::UnsupportedMethod => "Method not supported",
            ProblemKind::KeyMismatch => "Idempotency key reused with a different request",
            ProblemKind::RequestInFlight => "A request with this idempotency key is in progress",
            ProblemKind::ResponseNotReplayable => "Original response too large to replay",
            ProblemKind::OutcomeUnknown => "Outcome of the original request is unknown",
            ProblemKind::UpstreamUnreachable => "Upstream unreachable",
            ProblemKind::UpstreamTimeout => "Upstream timed out",
            ProblemKind::StoreUnavailable => "Idempotency store unavailable",
            ProblemKind::Internal => "Internal gateway error",
            ProblemKind::Unauthorized => "Admin token required",
            ProblemKind::BadRequest => "Malformed admin request",
            ProblemKind::NotFound => "Not found",
            ProblemKind::RecordNotFound => "No record under this key",
            ProblemKind::MethodNotAllowed => "Method not allowed",
            ProblemKind::NotReady => "Gateway not ready",
        }
    }

    /// The default status.
    pub fn status(self) -> StatusCode {
        match self {
            ProblemKind::InvalidKey
            | ProblemKind::MissingKey
            | ProblemKind::RequestBodyError
            | ProblemKind::MalformedRequest
            | ProblemKind::BadRequest => StatusCode::BAD_REQUEST,
            ProblemKind::Unauthorized | ProblemKind::InvalidSignature => StatusCode::UNAUTHORIZED,
            ProblemKind::NotFound | ProblemKind::RecordNotFound => StatusCode::NOT_FOUND,
            ProblemKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ProblemKind::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProblemKind::HeadersTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProblemKind::KeyMismatch => StatusCode::UNPROCESSABLE_ENTITY,
            ProblemKind::RequestInFlight | ProblemKind::ResponseNotReplayable => {
                StatusCode::CONFLICT
            }
            ProblemKind::OutcomeUnknown | ProblemKind::UpstreamUnreachable => {
                StatusCode::BAD_GATEWAY
            }
            ProblemKind::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            ProblemKind::StoreUnavailable | ProblemKind::NotReady => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProblemKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
            ProblemKind::UnsupportedTransferCoding | ProblemKind::UnsupportedMethod => {
                StatusCode::NOT_IMPLEMENTED
            }
        }
    }
}

/// One problem response, ready to render.
#[derive(Clone, Debug)]
pub struct Problem {
    kind: ProblemKind,
    status: StatusCode,
    detail: Cow<'static, str>,
    retry_after: Option<Duration>,
    /// One more header the kind calls for (`WWW-Authenticate`, `Allow`).
    header: Option<(HeaderName, HeaderValue)>,
}

impl Problem {
    fn new(kind: ProblemKind, detail: impl Into<Cow<'static, str>>) -> Self {
        Self {
            kind,
            status: kind.status(),
            detail: detail.into(),
            retry_after: None,
            header: None,
        }
    }

    /// `400 invalid-key`, with why.
    pub fn invalid_key(why: crate::key::KeyError) -> Self {
        Self::new(ProblemKind::InvalidKey, why.to_string())
    }

    /// `400 missing-key`.
    pub fn missing_key(source: &crate::policy::KeySource) -> Self {
        let detail = match source {
            crate::policy::KeySource::Header(name) => {
                format!("this route requires an idempotency key in the {name} header")
            }
            crate::policy::KeySource::JsonPointer(p) => {
                format!("this route requires an idempotency key at {p} in a JSON body")
            }
        };
        Self::new(ProblemKind::MissingKey, detail)
    }

    /// `401 invalid-signature` with why. RFC 9110 asks a `401` for a challenge; the scheme is
    /// named `Webhook-Signature`, as no registered one describes a sender's signature.
    pub fn invalid_signature(why: &crate::webhook::SignatureError) -> Self {
        let mut p = Self::new(
            ProblemKind::InvalidSignature,
            format!("{why}; nothing was claimed or forwarded"),
        );
        p.header = Some((
            WWW_AUTHENTICATE,
            HeaderValue::from_static("Webhook-Signature"),
        ));
        p
    }

    /// `400 request-body-error`.
    pub fn request_body_error() -> Self {
        Self::new(
            ProblemKind::RequestBodyError,
            "the request body ended with an error before it was complete; nothing was forwarded",
        )
    }

    /// `413 request-too-large`.
    pub fn request_too_large(limit: usize) -> Self {
        Self::new(
            ProblemKind::RequestTooLarge,
            format!(
                "an idempotent request body may be at most {limit} bytes; nothing was forwarded"
            ),
        )
    }

    /// `431 headers-too-large`: more header fields than the proxy accepts.
    pub fn too_many_headers(fields: usize, limit: usize) -> Self {
        Self::new(
            ProblemKind::HeadersTooLarge,
            format!("the request has {fields} header fields; at most {limit} are accepted"),
        )
    }

    /// `431 headers-too-large`: a header block larger than the proxy accepts.
    pub fn header_block_too_large(bytes: usize, limit: usize) -> Self {
        Self::new(
            ProblemKind::HeadersTooLarge,
            format!(
                "the request's header block is about {bytes} bytes; at most {limit} are accepted"
            ),
        )
    }

    /// `501 unsupported-transfer-coding`: a request body sent with a transfer coding other
    /// than `chunked` alone.
    pub fn unsupported_transfer_coding() -> Self {
        Self::new(
            ProblemKind::UnsupportedTransferCoding,
            "only the chunked transfer coding is accepted; nothing was forwarded",
        )
    }

    /// `400 malformed-request`: a request the proxy will not forward as it came (RFC 9112
    /// §3.2: no `Host` in an HTTP/1.1 request, more than one, or one that is not
    /// `host[:port]`), with what is wrong.
    pub fn malformed_request(detail: &'static str) -> Self {
        Self::new(
            ProblemKind::MalformedRequest,
            format!("{detail}; nothing was forwarded"),
        )
    }

    /// `501 unsupported-method`: `CONNECT`, a tunnel, which a reverse proxy does not open.
    pub fn unsupported_method(method: &Method) -> Self {
        Self::new(
            ProblemKind::UnsupportedMethod,
            format!(
                "{method} asks for a tunnel, which this reverse proxy does not open; nothing was forwarded"
            ),
        )
    }

    /// `422 key-mismatch`, or the route's configured status.
    pub fn key_mismatch(status: StatusCode) -> Self {
        let mut p = Self::new(
            ProblemKind::KeyMismatch,
            "this idempotency key was already used with a different method, path, body or \
             fingerprinted header; use a new key for a new request",
        );
        p.status = status;
        p
    }

    /// `409 request-in-flight` with `Retry-After`.
    pub fn request_in_flight(retry_after: Duration) -> Self {
        let mut p = Self::new(
            ProblemKind::RequestInFlight,
            "the first request with this idempotency key is still running; retry later to get its response",
        );
        p.retry_after = Some(retry_after);
        p
    }

    /// `409 response-not-replayable`.
    pub fn response_not_replayable(status: StatusCode, body_len: u64) -> Self {
        Self::new(
            ProblemKind::ResponseNotReplayable,
            format!(
                "the request already ran and was answered {} with a {body_len}-byte body, larger \
                 than the gateway keeps; it will not run again",
                status.as_u16()
            ),
        )
    }

    /// `502 outcome-unknown`.
    pub fn outcome_unknown() -> Self {
        Self::new(
            ProblemKind::OutcomeUnknown,
            "this request was sent upstream before and no answer was captured, so it may or may \
             not have taken effect; it will not run again until an operator resolves the key or \
             it expires",
        )
    }

    /// `502 outcome-unknown` for a response that broke off mid-body.
    pub fn response_interrupted() -> Self {
        Self::new(
            ProblemKind::OutcomeUnknown,
            "the upstream's response broke off before it was complete, so the outcome is unknown",
        )
    }

    /// `502 outcome-unknown` for a request that was sent and got no response at all (the
    /// connection closed before a response head came).
    pub fn no_response() -> Self {
        Self::new(
            ProblemKind::OutcomeUnknown,
            "the request was sent and the upstream's connection closed before any response, so the outcome is unknown",
        )
    }

    /// `502 upstream-unreachable`: nothing was sent.
    pub fn upstream_unreachable() -> Self {
        Self::new(
            ProblemKind::UpstreamUnreachable,
            "the upstream could not be reached; the request was not sent and may be retried",
        )
    }

    /// `504 upstream-timeout`.
    pub fn upstream_timeout(after: Duration) -> Self {
        Self::new(
            ProblemKind::UpstreamTimeout,
            format!(
                "the upstream did not answer within {} ms; the request may have taken effect",
                after.as_millis()
            ),
        )
    }

    /// `503 store-unavailable` with `Retry-After`.
    pub fn store_unavailable(retry_after: Duration) -> Self {
        let mut p = Self::new(
            ProblemKind::StoreUnavailable,
            "the idempotency store is unavailable; the request was not forwarded",
        );
        p.retry_after = Some(retry_after);
        p
    }

    /// `500 internal-error`.
    pub fn internal() -> Self {
        Self::new(
            ProblemKind::Internal,
            "the gateway reached a state it should never reach for this request",
        )
    }

    /// `503 store-unavailable` with `Retry-After`, for an admin record call: `why` says how
    /// the store failed.
    pub fn admin_store_unavailable(
        why: impl Into<Cow<'static, str>>,
        retry_after: Duration,
    ) -> Self {
        let mut p = Self::new(ProblemKind::StoreUnavailable, why);
        p.retry_after = Some(retry_after);
        p
    }

    /// `401 unauthorized` with `WWW-Authenticate: Bearer`: a record endpoint was called
    /// without the admin token.
    pub fn unauthorized() -> Self {
        let mut p = Self::new(
            ProblemKind::Unauthorized,
            "a valid `Authorization: Bearer <admin_token>` is required",
        );
        p.header = Some((WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")));
        p
    }

    /// `400 bad-request`: a malformed admin request, with what is wrong.
    pub fn bad_request(detail: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ProblemKind::BadRequest, detail)
    }

    /// `404 not-found`: no such admin resource, with what was looked for.
    pub fn not_found(detail: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ProblemKind::NotFound, detail)
    }

    /// `404 record-not-found`: the store holds nothing under `key`.
    pub fn record_not_found(key: &RecordKey) -> Self {
        Self::new(
            ProblemKind::RecordNotFound,
            format!(
                "no record {} (never claimed, expired, or deleted)",
                key.to_hex()
            ),
        )
    }

    /// `405 method-not-allowed` with `Allow` listing the methods the resource serves.
    pub fn method_not_allowed(allowed: &[Method]) -> Self {
        let list = allowed
            .iter()
            .map(Method::as_str)
            .collect::<Vec<_>>()
            .join(", ");
        let mut p = Self::new(
            ProblemKind::MethodNotAllowed,
            format!("this resource answers {list} only"),
        );
        // Method names are tokens, always valid in a header value.
        p.header = HeaderValue::from_str(&list).ok().map(|v| (ALLOW, v));
        p
    }

    /// `503 not-ready`: readiness fails, with why.
    pub fn not_ready(why: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ProblemKind::NotReady, why)
    }

    /// The problem's kind.
    pub fn kind(&self) -> ProblemKind {
        self.kind
    }

    /// The status it answers with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Renders the problem as `application/problem+json`.
    pub fn into_response(self) -> Response<Bytes> {
        let body = serde_json::json!({
            "type": format!("urn:idemgate:problem:{}", self.kind.slug()),
            "title": self.kind.title(),
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        // Serialising a `Value` of plain strings and numbers cannot fail.
        let body = serde_json::to_vec(&body).unwrap_or_default();
        let mut response = Response::new(Bytes::from(body));
        *response.status_mut() = self.status;
        response.headers_mut().insert(CONTENT_TYPE, PROBLEM_JSON);
        if let Some((name, value)) = self.header {
            response.headers_mut().insert(name, value);
        }
        if let Some(after) = self.retry_after {
            // Retry-After counts whole seconds; round up so a client never comes back early.
            let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from(secs.max(1)));
        }
        response
    }
}

/// A replay of a stored response: its status, headers and body, plus
/// `Idempotent-Replayed: true`. Taken by value: its header map becomes the response's as it
/// is, with no copy (a store that decodes each record hands out a fresh one).
pub fn into_replay(stored: StoredResponse) -> Response<Bytes> {
    let mut response = Response::new(stored.body);
    *response.status_mut() = stored.status;
    *response.headers_mut() = stored.headers;
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// What the layer decided about a request. Found on every response the layer returns, inside
/// [`Outcome`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Decision {
    /// The request was not one the route handles (method or no key); it streamed through.
    PassedThrough,
    /// The request ran upstream under a fresh claim.
    Executed,
    /// The request was claimed and forwarded, and the inner service answered for an
    /// upstream that gave no response (a response marked with [`UpstreamFailure`]): the key
    /// was released if nothing was sent, or else left to the route's `unknown_outcome`.
    UpstreamFailed,
    /// The stored response was replayed; the upstream was not called.
    Replayed,
    /// The same request was in flight: `409` (or it still was after waiting).
    InFlight,
    /// The key was used with a different request.
    Mismatch,
    /// The earlier attempt's outcome is unknown.
    OutcomeUnknown,
    /// The request ran before but its response was too large to keep.
    NotReplayable,
    /// The key was malformed.
    InvalidKey,
    /// The route requires a key and none was sent.
    MissingKey,
    /// The route verifies its sender's signature and the request's failed: `401`, nothing
    /// claimed or forwarded.
    SignatureRejected,
    /// The request body was over the limit or could not be read.
    RequestRejected,
    /// The store failed and the request was refused (`on_store_error = "reject"`).
    StoreUnavailable,
    /// The store failed and the request was forwarded without protection
    /// (`on_store_error = "pass"`).
    Unprotected,
}

impl Decision {
    /// Every decision, in declaration order (`ALL[d as usize] == d`).
    pub const ALL: [Decision; 14] = [
        Decision::PassedThrough,
        Decision::Executed,
        Decision::UpstreamFailed,
        Decision::Replayed,
        Decision::InFlight,
        Decision::Mismatch,
        Decision::OutcomeUnknown,
        Decision::NotReplayable,
        Decision::InvalidKey,
        Decision::MissingKey,
        Decision::SignatureRejected,
        Decision::RequestRejected,
        Decision::StoreUnavailable,
        Decision::Unprotected,
    ];

    /// A snake_case label for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::PassedThrough => "passed_through",
            Decision::Executed => "executed",
            Decision::UpstreamFailed => "upstream_failed",
            Decision::Replayed => "replayed",
            Decision::InFlight => "in_flight",
            Decision::Mismatch => "mismatch",
            Decision::OutcomeUnknown => "outcome_unknown",
            Decision::NotReplayable => "not_replayable",
            Decision::InvalidKey => "invalid_key",
            Decision::MissingKey => "missing_key",
            Decision::SignatureRejected => "signature_rejected",
            Decision::RequestRejected => "request_rejected",
            Decision::StoreUnavailable => "store_unavailable",
            Decision::Unprotected => "unprotected",
        }
    }
}

/// The response extension the layer adds to every response: what it decided, on which route,
/// for which record.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// What was decided.
    pub decision: Decision,
    /// The route's name.
    pub route: Arc<str>,
    /// The record key, when the request had a key (log its [`RecordKey::short`], never the raw
    /// key).
    pub record: Option<RecordKey>,
}

/// Set by the inner service (the proxy's forwarder) on a response it made up because the
/// upstream failed, so the layer knows what happened to the record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamFailure {
    /// Nothing reached the upstream (connection refused, unreachable): the key is released.
    NotSent,
    /// The request was sent and no answer came (timeout, reset): the route's
    /// `unknown_outcome` applies.
    Unknown,
}

/// Removes the headers only idemgate may set from an inner service's response.
pub(crate) fn without_owned_headers<B>(mut response: Response<B>) -> Response<B> {
    crate::headers::remove(response.headers_mut(), &IDEMPOTENT_REPLAYED);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_decision_is_listed_once_at_its_index() {
        let mut labels = std::collections::BTreeSet::new();
        for (at, decision) in Decision::ALL.into_iter().enumerate() {
            assert_eq!(decision as usize, at, "{decision:?}");
            assert!(labels.insert(decision.as_str()), "{decision:?}");
        }
    }

    fn parse(r: &Response<Bytes>) -> serde_json::Value {
        serde_json::from_slice(r.body()).unwrap()
    }

    #[test]
    fn problems_are_rfc9457_json() {
        let r = Problem::request_in_flight(Duration::from_millis(1500)).into_response();
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
        assert_eq!(r.headers()[RETRY_AFTER], "2");
        let body = parse(&r);
        assert_eq!(body["type"], "urn:idemgate:problem:request-in-flight");
        assert_eq!(body["status"], 409);
        assert!(body["title"].is_string() && body["detail"].is_string());
    }

    #[test]
    fn mismatch_status_is_configurable() {
        let r = Problem::key_mismatch(StatusCode::CONFLICT).into_response();
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(parse(&r)["status"], 409);
    }

    fn assert_problem(r: &Response<Bytes>, status: u16, slug: &str) -> serde_json::Value {
        assert_eq!(r.status().as_u16(), status);
        assert_eq!(r.headers()[CONTENT_TYPE], "application/problem+json");
        let body = parse(r);
        assert_eq!(body["type"], format!("urn:idemgate:problem:{slug}"));
        assert_eq!(body["status"], status);
        assert!(body["title"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
        body
    }

    #[test]
    fn an_invalid_signature_says_why_and_challenges() {
        let why = crate::webhook::SignatureError::Mismatch;
        let r = Problem::invalid_signature(&why).into_response();
        let body = assert_problem(&r, 401, "invalid-signature");
        assert!(
            body["detail"]
                .as_str()
                .unwrap()
                .starts_with(&why.to_string())
        );
        assert_eq!(r.headers()[WWW_AUTHENTICATE], "Webhook-Signature");
    }

    #[test]
    fn admin_problems() {
        let r = Problem::unauthorized().into_response();
        assert_problem(&r, 401, "unauthorized");
        assert_eq!(r.headers()[WWW_AUTHENTICATE], "Bearer");

        let r = Problem::bad_request("missing `route`").into_response();
        assert_eq!(
            assert_problem(&r, 400, "bad-request")["detail"],
            "missing `route`"
        );

        let r = Problem::not_found("no route named \"x\"").into_response();
        assert_problem(&r, 404, "not-found");

        let key = RecordKey::of(b"k");
        let r = Problem::record_not_found(&key).into_response();
        let body = assert_problem(&r, 404, "record-not-found");
        assert!(body["detail"].as_str().unwrap().contains(&key.to_hex()));

        let r = Problem::method_not_allowed(&[Method::GET, Method::DELETE]).into_response();
        assert_problem(&r, 405, "method-not-allowed");
        assert_eq!(r.headers()[ALLOW], "GET, DELETE");

        let r = Problem::not_ready("shutting down").into_response();
        assert_problem(&r, 503, "not-ready");
        assert!(!r.headers().contains_key(RETRY_AFTER));

        let r =
            Problem::admin_store_unavailable("store down", Duration::from_secs(2)).into_response();
        assert_eq!(
            assert_problem(&r, 503, "store-unavailable")["detail"],
            "store down"
        );
        assert_eq!(r.headers()[RETRY_AFTER], "2");
    }

    #[test]
    fn every_kind_has_a_distinct_slug_a_title_and_an_error_status() {
        let kinds = [
            ProblemKind::InvalidKey,
            ProblemKind::MissingKey,
            ProblemKind::InvalidSignature,
            ProblemKind::RequestBodyError,
            ProblemKind::RequestTooLarge,
            ProblemKind::HeadersTooLarge,
            ProblemKind::UnsupportedTransferCoding,
            ProblemKind::MalformedRequest,
            ProblemKind::UnsupportedMethod,
            ProblemKind::KeyMismatch,
            ProblemKind::RequestInFlight,
            ProblemKind::ResponseNotReplayable,
            ProblemKind::OutcomeUnknown,
            ProblemKind::UpstreamUnreachable,
            ProblemKind::UpstreamTimeout,
            ProblemKind::StoreUnavailable,
            ProblemKind::Internal,
            ProblemKind::Unauthorized,
            ProblemKind::BadRequest,
            ProblemKind::NotFound,
            ProblemKind::RecordNotFound,
            ProblemKind::MethodNotAllowed,
            ProblemKind::NotReady,
        ];
        let slugs: std::collections::HashSet<_> = kinds.iter().map(|k| k.slug()).collect();
        assert_eq!(slugs.len(), kinds.len());
        for kind in kinds {
            assert!(!kind.title().is_empty(), "{kind:?}");
            let status = kind.status();
            assert!(
                status.is_client_error() || status.is_server_error(),
                "{kind:?}"
            );
            // The module docs and docs/behaviour.md list every slug.
            let row = format!("| `{}` |", kind.slug());
            assert!(
                include_str!("response.rs").contains(&row),
                "{kind:?} is missing from the module docs"
            );
            assert!(
                include_str!("../../../docs/behaviour.md").contains(&row),
                "{kind:?} is missing from docs/behaviour.md"
            );
        }
    }

    #[test]
    fn replay_marks_and_keeps_repeated_headers() {
        let mut headers = http::HeaderMap::new();
        headers.append("x-a", HeaderValue::from_static("1"));
        headers.append("x-a", HeaderValue::from_static("2"));
        let stored = StoredResponse {
            status: StatusCode::CREATED,
            headers,
            body: Bytes::from_static(b"hi"),
        };
        let r = into_replay(stored);
        assert_eq!(r.status(), StatusCode::CREATED);
        assert_eq!(r.headers()[IDEMPOTENT_REPLAYED], "true");
        assert_eq!(
            r.headers().get_all("x-a").iter().collect::<Vec<_>>(),
            ["1", "2"]
        );
        assert_eq!(r.body().as_ref(), b"hi");
    }
}
