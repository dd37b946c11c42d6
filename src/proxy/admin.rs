//! The admin listener: health, readiness, metrics, and — behind a bearer token — reading and
//! deleting one record (the way out of an ambiguous record).
//!
//! | path | method | answer |
//! | --- | --- | --- |
//! | `/healthz` | GET | `200` while the process runs |
//! | `/readyz` | GET | `200` when the store answers a ping within `store_timeout`; `503` otherwise or while shutting down |
//! | `/metrics` | GET | Prometheus text |
//! | `/records/{hex}` | GET, DELETE | the record under that record key (64 hex digits, as `/keys` returns it; logs show its first 16) |
//! | `/keys?route=NAME&key=KEY[&HEADER=VALUE…]` | GET, DELETE | the record a client's key maps to; every other query parameter is the value of one of the route's scope headers (`authorization=Bearer%20…`) |
//!
//! The record endpoints need `Authorization: Bearer <admin_token>`; with no token configured
//! they answer `404` and say how to enable them.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use serde_json::json;

use super::metrics::{LayerCounters, Metrics};
use crate::LayerStats;
use crate::policy::RoutePolicy;
use crate::record::{Completion, Hash256, Record, RecordKey, unix_millis};
use crate::store::Store;

/// What the admin endpoints read.
pub struct AdminState {
    /// The store (instrumented).
    pub store: Arc<dyn Store>,
    /// Bound on the readiness ping and on record calls.
    pub store_timeout: Duration,
    /// The gateway's counters.
    pub metrics: Arc<Metrics>,
    /// The layer's counters.
    pub stats: Arc<LayerStats>,
    /// Bearer token for the record endpoints.
    pub token: Option<String>,
    /// Every route's policy, the default one first, to derive record keys from raw keys.
    pub routes: Vec<RoutePolicy>,
    /// Set once shutdown has begun; readiness then fails so balancers stop sending traffic.
    pub draining: Arc<AtomicBool>,
}

/// The admin response body.
pub type AdminBody = Full<Bytes>;

/// Answers one admin request.
pub async fn handle<B>(
    state: Arc<AdminState>,
    req: Request<B>,
) -> Result<Response<AdminBody>, Infallible> {
    let path = req.uri().path().to_owned();
    let response = match (req.method(), path.as_str()) {
        (&Method::GET, "/healthz") => text(StatusCode::OK, "ok\n"),
        (&Method::GET, "/readyz") => readyz(&state).await,
        (&Method::GET, "/metrics") => metrics(&state),
        (method, "/keys") if is_record_method(method) => match refusal(&state, req.headers()) {
            None => by_key(&state, method, req.uri().query().unwrap_or("")).await,
            Some(denied) => denied,
        },
        (method, p) if p.starts_with("/records/") && is_record_method(method) => {
            match refusal(&state, req.headers()) {
                None => match Hash256::from_hex(&p["/records/".len()..]) {
                    Some(key) => record(&state, method, key).await,
                    None => text(
                        StatusCode::BAD_REQUEST,
                        "the record key must be 64 hex digits (the `record` field /keys returns)\n",
                    ),
                },
                Some(denied) => denied,
            }
        }
        (_, "/healthz" | "/readyz" | "/metrics" | "/keys") => {
            text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n")
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found; see /healthz, /readyz, /metrics, /records/{hex}, /keys\n",
        ),
    };
    Ok(response)
}

fn is_record_method(method: &Method) -> bool {
    *method == Method::GET || *method == Method::DELETE
}

async fn readyz(state: &AdminState) -> Response<AdminBody> {
    if state.draining.load(Ordering::Relaxed) {
        return text(StatusCode::SERVICE_UNAVAILABLE, "shutting down\n");
    }
    match tokio::time::timeout(state.store_timeout, state.store.ping()).await {
        Ok(Ok(())) => text(StatusCode::OK, "ready\n"),
        Ok(Err(error)) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("store unavailable: {error}\n"),
        ),
        Err(_) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "store did not answer within {} ms\n",
                state.store_timeout.as_millis()
            ),
        ),
    }
}

fn metrics(state: &AdminState) -> Response<AdminBody> {
    let body = state.metrics.render(LayerCounters {
        store_errors: state.stats.store_errors(),
        fenced_completions: state.stats.fenced_completions(),
        unprotected_passes: state.stats.unprotected_passes(),
        in_flight: state.stats.in_flight(),
    });
    let mut response = Response::new(Full::new(Bytes::from(body)));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

/// The answer for a request that may not use the record endpoints, or `None` when it may.
fn refusal(state: &AdminState, headers: &HeaderMap) -> Option<Response<AdminBody>> {
    let Some(token) = &state.token else {
        return Some(text(
            StatusCode::NOT_FOUND,
            "the record endpoints are disabled: set admin_token (or admin_token_env) in the config to enable them\n",
        ));
    };
    let presented = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        Some(p) if constant_time_eq(p.as_bytes(), token.as_bytes()) => None,
        _ => {
            let mut response = text(
                StatusCode::UNAUTHORIZED,
                "a valid `Authorization: Bearer <admin_token>` is required\n",
            );
            response
                .headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            Some(response)
        }
    }
}

/// Compares without an early exit, so the time taken does not tell how much of a guess was
/// right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn by_key(state: &AdminState, method: &Method, query: &str) -> Response<AdminBody> {
    let mut route = None;
    let mut key = None;
    let mut scope: Vec<(HeaderName, HeaderValue)> = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let (Some(name), Some(value)) = (percent_decode(name), percent_decode(value)) else {
            return text(
                StatusCode::BAD_REQUEST,
                "the query is not valid percent-encoding\n",
            );
        };
        match name.as_str() {
            "route" => route = Some(value),
            "key" => key = Some(value),
            header => {
                let parsed = (
                    HeaderName::from_bytes(header.as_bytes()),
                    HeaderValue::from_str(&value),
                );
                let (Ok(header), Ok(value)) = parsed else {
                    return text(
                        StatusCode::BAD_REQUEST,
                        format!("{header:?} is not a header name and value\n"),
                    );
                };
                scope.push((header, value));
            }
        }
    }
    let Some(route_name) = route else {
        return text(
            StatusCode::BAD_REQUEST,
            "missing `route` (the route's name, `default` for unmatched paths)\n",
        );
    };
    let Some(key) = key else {
        return text(
            StatusCode::BAD_REQUEST,
            "missing `key` (the client's idempotency key)\n",
        );
    };
    let Some(policy) = state.routes.iter().find(|p| p.route_name() == route_name) else {
        let names: Vec<&str> = state.routes.iter().map(RoutePolicy::route_name).collect();
        return text(
            StatusCode::NOT_FOUND,
            format!("no route named {route_name:?}; routes: {names:?}\n"),
        );
    };
    if let Some((extra, _)) = scope
        .iter()
        .find(|(h, _)| !policy.scope_headers.contains(h))
    {
        return text(
            StatusCode::BAD_REQUEST,
            format!(
                "{extra} is not one of route {route_name:?}'s scope headers {:?}\n",
                policy.scope_headers
            ),
        );
    }
    let mut scope_headers = HeaderMap::new();
    for (name, value) in scope {
        scope_headers.append(name, value);
    }
    match record_key_for(policy, &scope_headers, &key) {
        Some(record_key) => record(state, method, record_key).await,
        None => text(
            StatusCode::BAD_REQUEST,
            "the key is not a valid idempotency key\n",
        ),
    }
}

/// The record key the layer files a request with this route, scope headers and key under.
fn record_key_for(policy: &RoutePolicy, scope_headers: &HeaderMap, key: &str) -> Option<RecordKey> {
    let key = crate::key::parse_value(key.as_bytes()).ok()?;
    Some(crate::fingerprint::record_key(
        policy.route_name(),
        &policy.scope_headers,
        scope_headers,
        &key,
    ))
}

async fn record(state: &AdminState, method: &Method, key: RecordKey) -> Response<AdminBody> {
    let deleting = *method == Method::DELETE;
    let call = async {
        if deleting {
            state
                .store
                .delete(&key)
                .await
                .map(|found| found.then_some(None))
        } else {
            state.store.get(&key).await.map(|record| record.map(Some))
        }
    };
    match tokio::time::timeout(state.store_timeout, call).await {
        Err(_) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "store did not answer within {} ms\n",
                state.store_timeout.as_millis()
            ),
        ),
        Ok(Err(error)) => text(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("store unavailable: {error}\n"),
        ),
        Ok(Ok(None)) => text(
            StatusCode::NOT_FOUND,
            format!("no record {}\n", key.to_hex()),
        ),
        Ok(Ok(Some(None))) => {
            tracing::info!(record = %key.short(), "record deleted by operator");
            let mut response = Response::new(Full::new(Bytes::new()));
            *response.status_mut() = StatusCode::NO_CONTENT;
            response
        }
        Ok(Ok(Some(Some(record)))) => json_response(record_json(&key, &record)),
    }
}

fn record_json(key: &RecordKey, record: &Record) -> serde_json::Value {
    match record {
        Record::InFlight {
            fingerprint,
            lease_deadline,
        } => json!({
            "record": key.to_hex(),
            "state": "in_flight",
            "fingerprint": fingerprint.to_hex(),
            "lease_deadline_unix_ms": unix_millis(*lease_deadline),
        }),
        Record::Ambiguous { fingerprint, since } => json!({
            "record": key.to_hex(),
            "state": "ambiguous",
            "fingerprint": fingerprint.to_hex(),
            "since_unix_ms": unix_millis(*since),
        }),
        Record::Completed {
            fingerprint,
            completion,
            stored_at,
        } => {
            let response = match completion {
                Completion::Response(r) => json!({
                    "replayable": true,
                    "status": r.status.as_u16(),
                    "headers": r.headers.iter()
                        .map(|(n, v)| json!([n.as_str(), String::from_utf8_lossy(v.as_bytes())]))
                        .collect::<Vec<_>>(),
                    "body_bytes": r.body.len(),
                    "body_sha256": Hash256::of(&r.body).to_hex(),
                }),
                Completion::TooLarge {
                    status,
                    body_digest,
                    body_len,
                } => json!({
                    "replayable": false,
                    "status": status.as_u16(),
                    "body_bytes": body_len,
                    "body_sha256": body_digest.to_hex(),
                }),
            };
            json!({
                "record": key.to_hex(),
                "state": "completed",
                "fingerprint": fingerprint.to_hex(),
                "stored_at_unix_ms": unix_millis(*stored_at),
                "response": response,
            })
        }
    }
}

fn json_response(value: serde_json::Value) -> Response<AdminBody> {
    let body = serde_json::to_vec_pretty(&value).unwrap_or_default();
    let mut response = Response::new(Full::new(Bytes::from(body)));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn text(status: StatusCode, body: impl Into<String>) -> Response<AdminBody> {
    let mut response = Response::new(Full::new(Bytes::from(body.into())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Decodes `%XX` escapes and `+` (as a space) in a query component.
fn percent_decode(s: &str) -> Option<String> {
    let mut out = Vec::with_capacity(s.len());
    let mut bytes = s.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'%' => {
                let hi = (bytes.next()? as char).to_digit(16)?;
                let lo = (bytes.next()? as char).to_digit(16)?;
                out.push((hi * 16 + lo) as u8);
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(
            percent_decode("Bearer%20sk_1").as_deref(),
            Some("Bearer sk_1")
        );
        assert_eq!(percent_decode("a+b%2Fc").as_deref(), Some("a b/c"));
        assert_eq!(percent_decode("%zz"), None);
        assert_eq!(percent_decode("%4"), None);
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abcdef", b"abcdef"));
        assert!(!constant_time_eq(b"abcdef", b"abcdeg"));
        assert!(!constant_time_eq(b"abc", b"abcdef"));
    }
}
