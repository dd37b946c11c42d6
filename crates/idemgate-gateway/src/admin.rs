//! The admin listener: health, readiness, metrics, and — behind a bearer token — reading and
//! deleting one record (the way out of an ambiguous record).
//!
//! | path | method | answer |
//! | --- | --- | --- |
//! | `/healthz` | GET | `200` while the process runs |
//! | `/readyz` | GET | `200` when the store answers a ping within `store_timeout`; `503 not-ready` otherwise or while shutting down |
//! | `/metrics` | GET | Prometheus text |
//! | `/records/{hex}` | GET, DELETE | the record under that record key (64 hex digits, as `/keys` returns it; logs show its first 16) |
//! | `/keys?route=NAME&key=KEY[&HEADER=VALUE…]` | GET, DELETE | the record a client's key maps to; every other query parameter is the value of one of the route's scope headers (`authorization=Bearer%20…`) |
//! | `/admin/store/acknowledge-data-loss` | POST | accepts that the store's backend lost its records (see [`Store::data_loss`]), so it claims again; JSON `{"acknowledged": bool, …}` |
//!
//! The record endpoints and the acknowledgement need `Authorization: Bearer <admin_token>`;
//! with no token configured they answer `404` and say how to enable them.
//!
//! Every error the listener answers is a problem response from [`idemgate::response`]
//! (`unauthorized`, `bad-request`, `not-found`, `record-not-found`, `method-not-allowed`,
//! `not-ready`, `store-unavailable`); the successful answers are plain text or JSON.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use serde_json::json;

use super::metrics::{LayerCounters, Metrics};
use idemgate::LayerStats;
use idemgate::policy::RoutePolicy;
use idemgate::record::{Completion, Hash256, Record, RecordKey, unix_millis};
use idemgate::response::Problem;
use idemgate::store::{Store, StoreError};

/// The methods the read-only endpoints serve.
const READ_ONLY: &[Method] = &[Method::GET];
/// The methods the record endpoints serve.
const RECORD_METHODS: &[Method] = &[Method::GET, Method::DELETE];
/// The path of the data-loss acknowledgement.
const ACKNOWLEDGE_DATA_LOSS: &str = "/admin/store/acknowledge-data-loss";

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

impl std::fmt::Debug for AdminState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminState")
            .field("store", &self.store.backend())
            .field("store_timeout", &self.store_timeout)
            .finish_non_exhaustive()
    }
}

/// The admin response body.
pub type AdminBody = Full<Bytes>;

/// Answers one admin request.
pub async fn handle<B>(
    state: Arc<AdminState>,
    req: Request<B>,
) -> Result<Response<AdminBody>, Infallible> {
    let response = match (req.method(), req.uri().path()) {
        (&Method::GET, "/healthz") => text("ok\n"),
        (&Method::GET, "/readyz") => readyz(&state).await,
        (&Method::GET, "/metrics") => metrics(&state),
        (method, "/keys") if RECORD_METHODS.contains(method) => {
            match refusal(&state, req.headers()) {
                None => by_key(&state, method, req.uri().query().unwrap_or("")).await,
                Some(denied) => denied,
            }
        }
        (method, p) if p.starts_with("/records/") && RECORD_METHODS.contains(method) => {
            match refusal(&state, req.headers()) {
                None => match RecordKey::from_hex(&p["/records/".len()..]) {
                    Some(key) => record(&state, method, key).await,
                    None => problem(Problem::bad_request(
                        "the record key must be 64 hex digits (the `record` field /keys returns)",
                    )),
                },
                Some(denied) => denied,
            }
        }
        (&Method::POST, ACKNOWLEDGE_DATA_LOSS) => match refusal(&state, req.headers()) {
            None => acknowledge_data_loss(&state).await,
            Some(denied) => denied,
        },
        (_, ACKNOWLEDGE_DATA_LOSS) => problem(Problem::method_not_allowed(&[Method::POST])),
        (_, "/healthz" | "/readyz" | "/metrics") => problem(Problem::method_not_allowed(READ_ONLY)),
        (_, p) if p == "/keys" || p.starts_with("/records/") => {
            problem(Problem::method_not_allowed(RECORD_METHODS))
        }
        _ => problem(Problem::not_found(
            "no such admin resource; see /healthz, /readyz, /metrics, /records/{hex}, /keys, \
             /admin/store/acknowledge-data-loss",
        )),
    };
    Ok(response)
}

async fn readyz(state: &AdminState) -> Response<AdminBody> {
    if state.draining.load(Ordering::Relaxed) {
        return problem(Problem::not_ready(
            "shutting down: open requests are draining and no new ones should be sent here",
        ));
    }
    let why = match tokio::time::timeout(state.store_timeout, state.store.ping()).await {
        Ok(Ok(())) => return text("ready\n"),
        Ok(Err(error)) => store_failure(state, Some(&error)),
        Err(_) => store_failure(state, None),
    };
    problem(Problem::not_ready(why))
}

fn metrics(state: &AdminState) -> Response<AdminBody> {
    let body = state.metrics.render(
        state.store.backend(),
        LayerCounters {
            store_errors: state.stats.store_errors(),
            fenced_completions: state.stats.fenced_completions(),
            unprotected_passes: state.stats.unprotected_passes(),
            signature_rejections: state.stats.signature_rejections(),
            in_flight: state.stats.in_flight(),
        },
        &state.store.data_loss(),
    );
    let mut response = Response::new(Full::new(Bytes::from(body)));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static(super::metrics::CONTENT_TYPE),
    );
    response
}

/// `POST /admin/store/acknowledge-data-loss`: the operator accepts that the records the
/// store's backend lost are gone; a store that refused claims for it claims again.
async fn acknowledge_data_loss(state: &AdminState) -> Response<AdminBody> {
    let loss = state.store.data_loss().unacknowledged;
    let acknowledged =
        tokio::time::timeout(state.store_timeout, state.store.acknowledge_data_loss()).await;
    match acknowledged {
        Err(_) => store_unavailable(state, None),
        Ok(Err(error)) => store_unavailable(state, Some(&error)),
        Ok(Ok(true)) => {
            tracing::warn!(
                found = loss.as_ref().map_or("", |l| l.what),
                "store data loss acknowledged by operator"
            );
            json_response(json!({
                "acknowledged": true,
                "found": loss.as_ref().map(|l| l.what),
                "detected_at_unix_ms": loss.as_ref().map(|l| unix_millis(l.detected_at)),
                "detail": "the records the store lost are accepted as gone; new claims are served again",
            }))
        }
        Ok(Ok(false)) => json_response(json!({
            "acknowledged": false,
            "detail": "the store had no data loss to acknowledge",
        })),
    }
}

/// The answer for a request that may not use the record endpoints, or `None` when it may.
fn refusal(state: &AdminState, headers: &HeaderMap) -> Option<Response<AdminBody>> {
    let Some(token) = &state.token else {
        return Some(problem(Problem::not_found(
            "the record endpoints are disabled: set admin_token (or admin_token_env) in the config to enable them",
        )));
    };
    let presented = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    match presented {
        Some(p) if constant_time_eq(p.as_bytes(), token.as_bytes()) => None,
        _ => Some(problem(Problem::unauthorized())),
    }
}

/// The token of an `Authorization: Bearer <token>` value; the scheme's case does not matter
/// (RFC 9110 §11.1).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
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
            return problem(Problem::bad_request(
                "the query is not valid percent-encoding",
            ));
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
                    return problem(Problem::bad_request(format!(
                        "{header:?} is not a header name and value"
                    )));
                };
                scope.push((header, value));
            }
        }
    }
    let Some(route_name) = route else {
        return problem(Problem::bad_request(
            "missing `route` (the route's name, `default` for unmatched paths)",
        ));
    };
    let Some(key) = key else {
        return problem(Problem::bad_request(
            "missing `key` (the client's idempotency key)",
        ));
    };
    let Some(policy) = state.routes.iter().find(|p| p.route_name() == route_name) else {
        let names: Vec<&str> = state.routes.iter().map(RoutePolicy::route_name).collect();
        return problem(Problem::not_found(format!(
            "no route named {route_name:?}; routes: {names:?}"
        )));
    };
    if let Some((extra, _)) = scope
        .iter()
        .find(|(h, _)| !policy.scope_header_names().contains(h))
    {
        return problem(Problem::bad_request(format!(
            "{extra} is not one of route {route_name:?}'s scope headers {:?}",
            policy.scope_header_names()
        )));
    }
    let mut scope_headers = HeaderMap::new();
    for (name, value) in scope {
        scope_headers.append(name, value);
    }
    match record_key_for(policy, &scope_headers, &key) {
        Some(record_key) => record(state, method, record_key).await,
        None => problem(Problem::bad_request(
            "the key is not a valid idempotency key (1 to 255 visible ASCII characters)",
        )),
    }
}

/// The record key the layer files a request with this route, scope headers and key under.
fn record_key_for(policy: &RoutePolicy, scope_headers: &HeaderMap, key: &str) -> Option<RecordKey> {
    let key = idemgate::key::parse_value(key.as_bytes()).ok()?;
    Some(idemgate::fingerprint::record_key(
        policy.route_name(),
        policy.scope_header_names(),
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
        Err(_) => store_unavailable(state, None),
        Ok(Err(error)) => store_unavailable(state, Some(&error)),
        Ok(Ok(None)) => problem(Problem::record_not_found(&key)),
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

/// A `200` plain-text answer.
fn text(body: &'static str) -> Response<AdminBody> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

fn problem(problem: Problem) -> Response<AdminBody> {
    problem.into_response().map(Full::new)
}

/// `503` for a store call that failed (`Some` error) or did not answer in time (`None`).
fn store_unavailable(state: &AdminState, error: Option<&StoreError>) -> Response<AdminBody> {
    problem(Problem::admin_store_unavailable(
        store_failure(state, error),
        state.store_timeout,
    ))
}

/// Why a store call failed: its error, or `None` when it did not answer in time.
fn store_failure(state: &AdminState, error: Option<&StoreError>) -> String {
    match error {
        Some(error) => format!("the store failed: {}", idemgate::ErrorChain(error)),
        None => format!(
            "the store did not answer within {} ms",
            state.store_timeout.as_millis()
        ),
    }
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
    fn bearer_scheme_in_any_case() {
        for value in ["Bearer t0k", "bearer t0k", "BEARER  t0k ", " Bearer t0k"] {
            assert_eq!(bearer_token(value), Some("t0k"), "{value:?}");
        }
        for value in ["Basic t0k", "Bearer", "Bearert0k", "t0k", ""] {
            assert_eq!(bearer_token(value), None, "{value:?}");
        }
    }

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

    const TOKEN: &str = "admin-token-0123456789";

    fn state(token: Option<&str>, draining: bool) -> Arc<AdminState> {
        Arc::new(AdminState {
            store: Arc::new(idemgate::store::MemoryStore::default()),
            store_timeout: Duration::from_secs(1),
            metrics: Metrics::new(),
            stats: Arc::new(LayerStats::default()),
            token: token.map(str::to_owned),
            routes: vec![RoutePolicy::default()],
            draining: Arc::new(AtomicBool::new(draining)),
        })
    }

    async fn call(
        state: &Arc<AdminState>,
        method: Method,
        uri: &str,
        token: Option<&str>,
    ) -> Response<AdminBody> {
        let mut req = Request::builder().method(method).uri(uri);
        if let Some(token) = token {
            req = req.header(AUTHORIZATION, format!("Bearer {token}"));
        }
        let Ok(response) = handle(Arc::clone(state), req.body(()).unwrap()).await;
        response
    }

    /// The problem's `type` slug, after checking the response is a problem response.
    async fn slug(response: Response<AdminBody>) -> String {
        use http_body_util::BodyExt;
        assert_eq!(response.headers()[CONTENT_TYPE], "application/problem+json");
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["status"], status);
        body["type"]
            .as_str()
            .and_then(|t| t.strip_prefix("urn:idemgate:problem:"))
            .unwrap()
            .to_owned()
    }

    #[tokio::test]
    async fn admin_errors_are_problem_responses() {
        let s = state(Some(TOKEN), false);
        let t = Some(TOKEN);

        let ok = call(&s, Method::GET, "/healthz", None).await;
        assert_eq!(ok.status(), StatusCode::OK);
        assert_eq!(ok.headers()[CONTENT_TYPE], "text/plain; charset=utf-8");

        let r = call(&s, Method::GET, "/nowhere", None).await;
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        assert_eq!(slug(r).await, "not-found");

        let r = call(&s, Method::POST, "/healthz", None).await;
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(r.headers()[http::header::ALLOW], "GET");
        assert_eq!(slug(r).await, "method-not-allowed");

        let r = call(&s, Method::PUT, &format!("/records/{}", "0".repeat(64)), t).await;
        assert_eq!(r.headers()[http::header::ALLOW], "GET, DELETE");
        assert_eq!(slug(r).await, "method-not-allowed");

        let r = call(&s, Method::GET, "/records/zz", None).await;
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(r.headers()[http::header::WWW_AUTHENTICATE], "Bearer");
        assert_eq!(slug(r).await, "unauthorized");

        let r = call(
            &s,
            Method::GET,
            "/records/zz",
            Some("wrong-token-0123456789"),
        )
        .await;
        assert_eq!(slug(r).await, "unauthorized");

        for bad in [
            "/records/zz",
            "/keys?route=default",
            "/keys?key=k",
            "/keys?route=default&key=%zz",
            "/keys?route=default&key=k&x-not-scope=1",
            "/keys?route=default&key=%20",
        ] {
            let r = call(&s, Method::GET, bad, t).await;
            assert_eq!(r.status(), StatusCode::BAD_REQUEST, "{bad}");
            assert_eq!(slug(r).await, "bad-request", "{bad}");
        }

        let r = call(&s, Method::GET, "/keys?route=nope&key=k", t).await;
        assert_eq!(slug(r).await, "not-found");

        for (method, uri) in [
            (Method::GET, "/keys?route=default&key=k".to_owned()),
            (Method::DELETE, format!("/records/{}", "ab".repeat(32))),
        ] {
            let r = call(&s, method, &uri, t).await;
            assert_eq!(r.status(), StatusCode::NOT_FOUND, "{uri}");
            assert_eq!(slug(r).await, "record-not-found", "{uri}");
        }
    }

    #[tokio::test]
    async fn record_endpoints_without_a_token_are_not_found() {
        let s = state(None, false);
        let r = call(&s, Method::GET, "/keys?route=default&key=k", Some(TOKEN)).await;
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        assert_eq!(slug(r).await, "not-found");
    }

    #[tokio::test]
    async fn readiness_fails_while_draining() {
        let ready = call(&state(None, false), Method::GET, "/readyz", None).await;
        assert_eq!(ready.status(), StatusCode::OK);
        let r = call(&state(None, true), Method::GET, "/readyz", None).await;
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(slug(r).await, "not-ready");
    }

    #[tokio::test]
    async fn data_loss_acknowledgement_needs_the_token_and_a_post() {
        use http_body_util::BodyExt;
        let s = state(Some(TOKEN), false);
        let uri = "/admin/store/acknowledge-data-loss";
        let r = call(&s, Method::POST, uri, None).await;
        assert_eq!(slug(r).await, "unauthorized");
        let r = call(&s, Method::GET, uri, Some(TOKEN)).await;
        assert_eq!(r.headers()[http::header::ALLOW], "POST");
        assert_eq!(slug(r).await, "method-not-allowed");
        let r = call(&state(None, false), Method::POST, uri, Some(TOKEN)).await;
        assert_eq!(slug(r).await, "not-found");

        let r = call(&s, Method::POST, uri, Some(TOKEN)).await;
        assert_eq!(r.status(), StatusCode::OK);
        let body = r.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(body["acknowledged"], false, "{body}");

        let r = call(&s, Method::GET, "/metrics", None).await;
        let text = r.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8(text.to_vec()).unwrap();
        assert!(
            text.contains("idemgate_store_data_lost{backend=\"memory\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("idemgate_store_data_losses_total{backend=\"memory\"} 0\n"),
            "{text}"
        );
    }

    #[test]
    fn token_comparison() {
        assert!(constant_time_eq(b"abcdef", b"abcdef"));
        assert!(!constant_time_eq(b"abcdef", b"abcdeg"));
        assert!(!constant_time_eq(b"abc", b"abcdef"));
    }
}
