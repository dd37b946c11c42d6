//! The layer's behaviour through `ServiceBuilder` + `oneshot`, one rule of the behaviour
//! contract (docs/behaviour.md) per test.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idemgate::body::RequestBody;
use idemgate::policy::{Concurrent, RoutePolicy, StatusSet, UnknownOutcome};
use idemgate::record::{OwnerToken, Record, RecordKey};
use idemgate::response::UpstreamFailure;
use idemgate::store::{Claim, ClaimOptions, StoreError, Transition};
use idemgate::{Decision, IdempotencyLayer, MemoryStore, OnStoreError, Outcome, Store};
use tokio::sync::Notify;
use tower::{Service, ServiceBuilder, ServiceExt, service_fn};

type Req = Request<RequestBody<Full<Bytes>>>;

/// What the inner service saw and how it answers.
#[derive(Default)]
struct Upstream {
    calls: AtomicUsize,
    /// Status to answer (default 201).
    status: std::sync::Mutex<Option<StatusCode>>,
    /// When set, each call waits for a notification before answering.
    gate: Option<Arc<Notify>>,
    /// When set, calls answer with this failure marker (as the proxy's forwarder does).
    failure: std::sync::Mutex<Option<UpstreamFailure>>,
    /// Body length to answer with (default: a short JSON).
    body_len: std::sync::Mutex<Option<usize>>,
    saw_replayed_header: AtomicUsize,
}

impl Upstream {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

fn upstream_service(
    up: Arc<Upstream>,
) -> impl Service<Req, Response = Response<Full<Bytes>>, Error = Infallible, Future: Send>
+ Clone
+ Send
+ 'static {
    service_fn(move |req: Req| {
        let up = up.clone();
        async move {
            let n = up.calls.fetch_add(1, Ordering::SeqCst) + 1;
            if req.headers().contains_key("idempotent-replayed") {
                up.saw_replayed_header.fetch_add(1, Ordering::SeqCst);
            }
            let body = req.into_body().collect().await.unwrap().to_bytes();
            if let Some(gate) = &up.gate {
                gate.notified().await;
            }
            let status = up.status.lock().unwrap().unwrap_or(StatusCode::CREATED);
            let payload = match *up.body_len.lock().unwrap() {
                Some(len) => Bytes::from(vec![b'x'; len]),
                None => Bytes::from(format!("{{\"call\":{n},\"echo_len\":{}}}", body.len())),
            };
            let mut response = Response::new(Full::new(payload));
            *response.status_mut() = status;
            let h = response.headers_mut();
            h.append("x-multi", HeaderValue::from_static("one"));
            h.append("x-multi", HeaderValue::from_static("two"));
            h.insert("set-cookie", HeaderValue::from_static("session=abc"));
            h.insert("idempotent-replayed", HeaderValue::from_static("spoofed"));
            // Hop-by-hop fields, as an inner service that is not the proxy's may leave them.
            h.insert("connection", HeaderValue::from_static("x-hop"));
            h.insert("x-hop", HeaderValue::from_static("1"));
            h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
            if let Some(failure) = *up.failure.lock().unwrap() {
                response.extensions_mut().insert(failure);
            }
            Ok::<_, Infallible>(response)
        }
    })
}

fn post(key: Option<&str>, body: &'static str) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method(Method::POST)
        .uri("/payments")
        .header("content-type", "application/json");
    if let Some(key) = key {
        b = b.header("idempotency-key", key);
    }
    b.body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    body: Bytes,
    decision: Decision,
}

impl Answer {
    fn problem_type(&self) -> String {
        let v: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        v["type"].as_str().unwrap().to_owned()
    }
}

async fn send(layer: &IdempotencyLayer, up: &Arc<Upstream>, req: Request<Full<Bytes>>) -> Answer {
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(upstream_service(up.clone()));
    let response = svc.oneshot(req).await.unwrap();
    let decision = response
        .extensions()
        .get::<Outcome>()
        .expect("outcome extension")
        .decision;
    let (parts, body) = response.into_parts();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body: body.collect().await.unwrap().to_bytes(),
        decision,
    }
}

fn memory_layer() -> IdempotencyLayer {
    IdempotencyLayer::new(Arc::new(MemoryStore::default()))
}

#[tokio::test]
async fn first_request_runs_and_retry_replays_byte_for_byte() {
    let layer = memory_layer();
    let up = Arc::new(Upstream::default());
    let first = send(&layer, &up, post(Some("k1"), r#"{"amount":10}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.decision, Decision::Executed);
    assert!(
        first.headers.get("idempotent-replayed").is_none(),
        "upstream's spoofed header must not cross"
    );
    assert_eq!(
        first.headers["set-cookie"], "session=abc",
        "the first client gets its cookie"
    );

    let retry = send(&layer, &up, post(Some("k1"), r#"{"amount":10}"#)).await;
    assert_eq!(up.calls(), 1, "the retry must not reach the upstream");
    assert_eq!(retry.decision, Decision::Replayed);
    assert_eq!(retry.status, first.status);
    assert_eq!(retry.body, first.body);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    let multi: Vec<_> = retry.headers.get_all("x-multi").iter().collect();
    assert_eq!(multi, ["one", "two"]);
    assert!(
        retry.headers.get("set-cookie").is_none(),
        "Set-Cookie is not stored by default"
    );
    for hop in ["connection", "x-hop", "keep-alive"] {
        assert!(
            retry.headers.get(hop).is_none(),
            "hop-by-hop {hop} was stored"
        );
    }
}

#[tokio::test]
async fn set_cookie_is_stored_when_the_route_says_so() {
    let layer = memory_layer().default_route(RoutePolicy::api().store_set_cookie(true));
    let up = Arc::new(Upstream::default());
    send(&layer, &up, post(Some("k1"), "{}")).await;
    let retry = send(&layer, &up, post(Some("k1"), "{}")).await;
    assert_eq!(retry.decision, Decision::Replayed);
    assert_eq!(retry.headers["set-cookie"], "session=abc");
}

#[tokio::test]
async fn sf_string_key_is_the_same_key_as_bare() {
    let layer = memory_layer();
    let up = Arc::new(Upstream::default());
    send(&layer, &up, post(Some("abc"), "{}")).await;
    let retry = send(&layer, &up, post(Some("\"abc\""), "{}")).await;
    assert_eq!(retry.decision, Decision::Replayed);
    assert_eq!(up.calls(), 1);
}

#[tokio::test]
async fn different_fingerprint_is_a_mismatch_with_configurable_status() {
    let layer = memory_layer();
    let up = Arc::new(Upstream::default());
    send(&layer, &up, post(Some("k"), r#"{"amount":10}"#)).await;
    let other = send(&layer, &up, post(Some("k"), r#"{"amount":99}"#)).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(other.problem_type(), "urn:idemgate:problem:key-mismatch");
    assert_eq!(other.decision, Decision::Mismatch);
    assert_eq!(up.calls(), 1);

    let layer =
        memory_layer().default_route(RoutePolicy::api().mismatch_status(StatusCode::CONFLICT));
    send(&layer, &up, post(Some("k"), "a")).await;
    assert_eq!(
        send(&layer, &up, post(Some("k"), "b")).await.status,
        StatusCode::CONFLICT
    );
}

#[tokio::test]
async fn in_flight_same_request_is_409_with_retry_after() {
    let layer = memory_layer();
    let gate = Arc::new(Notify::new());
    let up = Arc::new(Upstream {
        gate: Some(gate.clone()),
        ..Default::default()
    });
    let first = spawn_send(&layer, &up);
    wait_for_calls(&up, 1).await;
    let second = send(&layer, &up, post(Some("k"), "{}")).await;
    assert_eq!(second.status, StatusCode::CONFLICT);
    assert_eq!(
        second.problem_type(),
        "urn:idemgate:problem:request-in-flight"
    );
    assert!(second.headers.contains_key("retry-after"));
    assert_eq!(second.decision, Decision::InFlight);
    // In flight with a different body is still a mismatch.
    let other = send(&layer, &up, post(Some("k"), "{\"x\":1}")).await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    gate.notify_one();
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(up.calls(), 1);
}

/// A layer whose default route waits `limit` for a request with the same key in flight, and
/// an upstream that holds each call until `gate` is notified.
fn gated_waiting_layer(limit: Duration) -> (IdempotencyLayer, Arc<Notify>, Arc<Upstream>) {
    let layer =
        memory_layer().default_route(RoutePolicy::api().concurrent(Concurrent::Wait(limit)));
    let gate = Arc::new(Notify::new());
    let up = Arc::new(Upstream {
        gate: Some(gate.clone()),
        ..Default::default()
    });
    (layer, gate, up)
}

/// Sends `POST {}` with key `k` in a task of its own.
fn spawn_send(layer: &IdempotencyLayer, up: &Arc<Upstream>) -> tokio::task::JoinHandle<Answer> {
    let (layer, up) = (layer.clone(), up.clone());
    tokio::spawn(async move { send(&layer, &up, post(Some("k"), "{}")).await })
}

#[tokio::test]
async fn concurrent_wait_replays_the_first_response() {
    let (layer, gate, up) = gated_waiting_layer(Duration::from_secs(10));
    let first = spawn_send(&layer, &up);
    wait_for_calls(&up, 1).await;
    let second = spawn_send(&layer, &up);
    tokio::time::sleep(Duration::from_millis(50)).await;
    gate.notify_one();
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(second.decision, Decision::Replayed);
    assert_eq!(second.body, first.body);
    assert_eq!(up.calls(), 1);
}

/// The waiter looks at the store once more at its deadline, not only at its last pause
/// before it: a first request that finishes in that last stretch is replayed. (On paused
/// time: the pauses double from 5 ms to 200 ms, so the last one before 2 s ends at 1 915 ms.)
#[tokio::test(start_paused = true)]
async fn concurrent_wait_looks_again_at_its_deadline() {
    let (layer, gate, up) = gated_waiting_layer(Duration::from_secs(2));
    let first = spawn_send(&layer, &up);
    wait_for_calls(&up, 1).await;
    let second = spawn_send(&layer, &up);
    tokio::time::sleep(Duration::from_millis(1950)).await;
    gate.notify_one();
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!(second.decision, Decision::Replayed, "{:?}", second.status);
    assert_eq!(second.body, first.body);
    assert_eq!(up.calls(), 1);
}

#[tokio::test]
async fn concurrent_wait_runs_the_waiter_when_the_first_response_is_not_kept() {
    let (layer, gate, up) = gated_waiting_layer(Duration::from_secs(10));
    // A 503 is outside the api preset's kept statuses: the first leaves nothing to replay.
    *up.status.lock().unwrap() = Some(StatusCode::SERVICE_UNAVAILABLE);
    let first = spawn_send(&layer, &up);
    wait_for_calls(&up, 1).await;
    let second = spawn_send(&layer, &up);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(up.calls(), 1, "the second waits while the first runs");
    gate.notify_one();
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(first.decision, Decision::Executed);
    wait_for_calls(&up, 2).await;
    gate.notify_one();
    let second = second.await.unwrap();
    assert_eq!(second.decision, Decision::Executed, "run, not replayed");
    assert_eq!(second.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(up.calls(), 2);
}

#[tokio::test]
async fn concurrent_wait_gives_up_with_409_after_its_timeout() {
    let (layer, gate, up) = gated_waiting_layer(Duration::from_millis(100));
    let first = spawn_send(&layer, &up);
    wait_for_calls(&up, 1).await;
    let second = send(&layer, &up, post(Some("k"), "{}")).await;
    assert_eq!(second.status, StatusCode::CONFLICT);
    gate.notify_one();
    first.await.unwrap();
}

#[tokio::test]
async fn unknown_outcome_is_ambiguous_on_api_and_retried_on_webhook() {
    let up = Arc::new(Upstream::default());
    *up.failure.lock().unwrap() = Some(UpstreamFailure::Unknown);
    *up.status.lock().unwrap() = Some(StatusCode::GATEWAY_TIMEOUT);

    let api = memory_layer();
    let first = send(&api, &up, post(Some("k"), "{}")).await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(first.decision, Decision::UpstreamFailed);
    let retry = send(&api, &up, post(Some("k"), "{}")).await;
    assert_eq!(retry.status, StatusCode::BAD_GATEWAY);
    assert_eq!(retry.problem_type(), "urn:idemgate:problem:outcome-unknown");
    assert_eq!(retry.decision, Decision::OutcomeUnknown);
    assert_eq!(
        up.calls(),
        1,
        "an ambiguous request never runs again on its own"
    );
    // A different request under the same key is still a mismatch.
    assert_eq!(
        send(&api, &up, post(Some("k"), "x")).await.status,
        StatusCode::UNPROCESSABLE_ENTITY
    );

    let hooks = memory_layer().default_route(RoutePolicy::webhook());
    send(&hooks, &up, post(Some("k"), "{}")).await;
    send(&hooks, &up, post(Some("k"), "{}")).await;
    assert_eq!(up.calls(), 3, "webhook routes run an unknown outcome again");
}

#[tokio::test]
async fn nothing_sent_releases_the_key() {
    let up = Arc::new(Upstream::default());
    *up.failure.lock().unwrap() = Some(UpstreamFailure::NotSent);
    *up.status.lock().unwrap() = Some(StatusCode::BAD_GATEWAY);
    let layer = memory_layer();
    let failed = send(&layer, &up, post(Some("k"), "{}")).await;
    assert_eq!(failed.decision, Decision::UpstreamFailed);
    *up.failure.lock().unwrap() = None;
    *up.status.lock().unwrap() = None;
    let retry = send(&layer, &up, post(Some("k"), "{}")).await;
    assert_eq!(retry.decision, Decision::Executed);
    assert_eq!(up.calls(), 2);
}

#[tokio::test]
async fn presets_decide_which_statuses_are_kept() {
    async fn runs_twice(policy: RoutePolicy, status: u16) -> bool {
        let up = Arc::new(Upstream::default());
        *up.status.lock().unwrap() = Some(StatusCode::from_u16(status).unwrap());
        let layer = memory_layer().default_route(policy);
        send(&layer, &up, post(Some("k"), "{}")).await;
        send(&layer, &up, post(Some("k"), "{}")).await;
        up.calls() == 2
    }
    for status in [500, 503, 401, 403, 408, 425, 429] {
        assert!(
            runs_twice(RoutePolicy::api(), status).await,
            "api must not keep {status}"
        );
    }
    for status in [200, 201, 400, 404, 409] {
        assert!(
            !runs_twice(RoutePolicy::api(), status).await,
            "api must keep {status}"
        );
    }
    assert!(runs_twice(RoutePolicy::webhook(), 404).await);
    assert!(runs_twice(RoutePolicy::webhook(), 500).await);
    assert!(!runs_twice(RoutePolicy::webhook(), 202).await);
    assert!(!runs_twice(RoutePolicy::strict(), 500).await);
    let custom = RoutePolicy::api().store_statuses(StatusSet::parse(&["2xx", "500"]).unwrap());
    assert!(!runs_twice(custom.clone(), 500).await);
    assert!(runs_twice(custom, 404).await);
}

#[tokio::test]
async fn bad_keys_are_400_and_nothing_is_forwarded() {
    let layer = memory_layer();
    let up = Arc::new(Upstream::default());
    for key in ["", "has space", "\"unterminated", &"a".repeat(256)] {
        let r = send(&layer, &up, post(Some(key), "{}")).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "key {key:?}");
        assert_eq!(r.problem_type(), "urn:idemgate:problem:invalid-key");
        assert_eq!(r.decision, Decision::InvalidKey);
    }
    let mut twice = post(Some("a"), "{}");
    twice
        .headers_mut()
        .append("idempotency-key", HeaderValue::from_static("b"));
    assert_eq!(
        send(&layer, &up, twice).await.status,
        StatusCode::BAD_REQUEST
    );
    let mut non_ascii = post(None, "{}");
    non_ascii.headers_mut().insert(
        "idempotency-key",
        HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
    );
    assert_eq!(
        send(&layer, &up, non_ascii).await.status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(up.calls(), 0);
}

#[tokio::test]
async fn missing_key_passes_through_unless_required() {
    let up = Arc::new(Upstream::default());
    let open = memory_layer();
    let a = send(&open, &up, post(None, "{}")).await;
    let b = send(&open, &up, post(None, "{}")).await;
    assert_eq!(
        (a.decision, b.decision),
        (Decision::PassedThrough, Decision::PassedThrough)
    );
    assert_eq!(up.calls(), 2);

    let strict = memory_layer().default_route(RoutePolicy::api().require_key(true));
    let r = send(&strict, &up, post(None, "{}")).await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(r.problem_type(), "urn:idemgate:problem:missing-key");
    assert_eq!(up.calls(), 2);
}

#[tokio::test]
async fn other_methods_stream_through_unbuffered() {
    let layer = memory_layer().default_route(RoutePolicy::api().max_request_bytes(4));
    let up = Arc::new(Upstream::default());
    let req = Request::builder()
        .method(Method::PUT)
        .uri("/x")
        .header("idempotency-key", "k")
        .header("idempotent-replayed", "true")
        .body(Full::new(Bytes::from_static(b"far more than four bytes")))
        .unwrap();
    let r = send(&layer, &up, req).await;
    assert_eq!(
        r.decision,
        Decision::PassedThrough,
        "PUT is not in the default method set"
    );
    assert_eq!(
        r.status,
        StatusCode::CREATED,
        "a passed-through body is never capped"
    );
    assert_eq!(
        up.saw_replayed_header.load(Ordering::SeqCst),
        0,
        "clients cannot spoof the replay header"
    );
    assert!(r.headers.get("idempotent-replayed").is_none());
}

#[tokio::test]
async fn scope_keeps_callers_apart() {
    let layer = memory_layer();
    let up = Arc::new(Upstream::default());
    let as_user = |user: &'static str| {
        let mut r = post(Some("shared-key"), "{}");
        r.headers_mut()
            .insert("authorization", HeaderValue::from_static(user));
        r
    };
    send(&layer, &up, as_user("Bearer alice")).await;
    let bob = send(&layer, &up, as_user("Bearer bob")).await;
    assert_eq!(bob.decision, Decision::Executed);
    assert_eq!(up.calls(), 2);
    assert_eq!(
        send(&layer, &up, as_user("Bearer alice")).await.decision,
        Decision::Replayed
    );
}

#[tokio::test]
async fn key_from_a_json_body_field() {
    let layer = memory_layer().default_route(RoutePolicy::webhook().key_json_pointer("/id"));
    let up = Arc::new(Upstream::default());
    let event = r#"{"id":"evt_1","type":"charge.succeeded"}"#;
    send(&layer, &up, post(None, event)).await;
    let again = send(&layer, &up, post(None, event)).await;
    assert_eq!(again.decision, Decision::Replayed);
    assert_eq!(up.calls(), 1);
    let no_id = send(&layer, &up, post(None, r#"{"type":"ping"}"#)).await;
    assert_eq!(no_id.decision, Decision::PassedThrough);
    let bad = send(&layer, &up, post(None, r#"{"id":{"nested":true}}"#)).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn routes_pick_their_own_policy_by_prefix() {
    let layer = memory_layer().route(
        "/hooks/github",
        RoutePolicy::webhook()
            .name("github")
            .key_header(http::HeaderName::from_static("x-github-delivery")),
    );
    let up = Arc::new(Upstream::default());
    let delivery = || {
        Request::post("/hooks/github/push")
            .header("x-github-delivery", "d-1")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    send(&layer, &up, delivery()).await;
    let again = send(&layer, &up, delivery()).await;
    assert_eq!(again.decision, Decision::Replayed);
    assert_eq!(up.calls(), 1);
    // `/hooks/githubx` is not under the route: no Idempotency-Key, so it passes through.
    let other = Request::post("/hooks/githubx")
        .header("x-github-delivery", "d-1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(
        send(&layer, &up, other).await.decision,
        Decision::PassedThrough
    );
}

#[tokio::test]
async fn request_over_the_limit_is_413_before_any_claim() {
    let layer = memory_layer().default_route(RoutePolicy::api().max_request_bytes(8));
    let up = Arc::new(Upstream::default());
    let r = send(&layer, &up, post(Some("k"), "0123456789")).await;
    assert_eq!(r.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(r.problem_type(), "urn:idemgate:problem:request-too-large");
    assert_eq!(up.calls(), 0);
    // Nothing was claimed: the same key with a small body runs.
    assert_eq!(
        send(&layer, &up, post(Some("k"), "{}")).await.decision,
        Decision::Executed
    );
}

#[tokio::test]
async fn response_over_the_limit_is_delivered_whole_and_never_run_again() {
    let layer = memory_layer().default_route(RoutePolicy::api().max_response_bytes(1024));
    let up = Arc::new(Upstream::default());
    *up.body_len.lock().unwrap() = Some(100_000);
    let first = send(&layer, &up, post(Some("big"), "{}")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), 100_000);
    let retry = send(&layer, &up, post(Some("big"), "{}")).await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(
        retry.problem_type(),
        "urn:idemgate:problem:response-not-replayable"
    );
    assert_eq!(retry.decision, Decision::NotReplayable);
    assert_eq!(up.calls(), 1);
}

#[tokio::test]
async fn client_hanging_up_does_not_cancel_the_upstream_call() {
    let layer = memory_layer();
    let gate = Arc::new(Notify::new());
    let up = Arc::new(Upstream {
        gate: Some(gate.clone()),
        ..Default::default()
    });
    let svc = ServiceBuilder::new()
        .layer(layer.clone())
        .service(upstream_service(up.clone()));
    let pending = tokio::spawn(svc.oneshot(post(Some("k"), "{}")));
    wait_for_calls(&up, 1).await;
    pending.abort(); // the client hangs up
    let _ = pending.await;
    gate.notify_one();
    // The upstream call finishes in its own task; the retry gets its response.
    let mut retry = None;
    for _ in 0..200 {
        let r = send(&layer, &up, post(Some("k"), "{}")).await;
        if r.decision == Decision::Replayed {
            retry = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let retry = retry.expect("the retry should replay the stored response");
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(up.calls(), 1);
}

#[tokio::test]
async fn a_fenced_owner_still_answers_its_client_and_is_counted() {
    let store = Arc::new(MemoryStore::default());
    let layer = IdempotencyLayer::new(store.clone());
    let gate = Arc::new(Notify::new());
    let up = Arc::new(Upstream {
        gate: Some(gate.clone()),
        ..Default::default()
    });
    let first = spawn_send(&layer, &up);
    wait_for_calls(&up, 1).await;
    // An operator deletes the record and a new request takes the key over.
    let record = idemgate::fingerprint::record_key(
        "default",
        &[http::header::AUTHORIZATION],
        &http::HeaderMap::new(),
        "k",
    );
    assert!(store.delete(&record).await.unwrap());
    let second = spawn_send(&layer, &up);
    wait_for_calls(&up, 2).await;
    gate.notify_one();
    gate.notify_one();
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    // Both clients get their own response; exactly one completion (the old owner's) is refused.
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(second.status, StatusCode::CREATED);
    assert_eq!(layer.stats().fenced_completions(), 1);
    assert_eq!(up.calls(), 2);
}

/// A store whose every call fails, or never answers.
struct BrokenStore {
    hang: bool,
}

#[async_trait]
impl Store for BrokenStore {
    async fn claim(
        &self,
        _: &RecordKey,
        _: &idemgate::record::FingerprintHash,
        _: OwnerToken,
        _: &ClaimOptions,
    ) -> Result<Claim, StoreError> {
        self.fail().await
    }
    async fn complete(
        &self,
        _: &RecordKey,
        _: OwnerToken,
        _: idemgate::record::Completion,
        _: Duration,
    ) -> Result<Transition, StoreError> {
        self.fail().await
    }
    async fn release(&self, _: &RecordKey, _: OwnerToken) -> Result<Transition, StoreError> {
        self.fail().await
    }
    async fn renew(
        &self,
        _: &RecordKey,
        _: OwnerToken,
        _: Duration,
    ) -> Result<Transition, StoreError> {
        self.fail().await
    }
    async fn mark_ambiguous(
        &self,
        _: &RecordKey,
        _: OwnerToken,
        _: Duration,
    ) -> Result<Transition, StoreError> {
        self.fail().await
    }
    async fn get(&self, _: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.fail().await
    }
    async fn delete(&self, _: &RecordKey) -> Result<bool, StoreError> {
        self.fail().await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.fail().await
    }
    fn backend(&self) -> &'static str {
        "broken"
    }
}

impl BrokenStore {
    async fn fail<T>(&self) -> Result<T, StoreError> {
        if self.hang {
            std::future::pending::<()>().await;
        }
        Err(StoreError::AtCapacity {
            backend: "broken",
            capacity: 0,
        })
    }
}

#[tokio::test]
async fn store_failure_is_503_and_nothing_is_forwarded() {
    for hang in [false, true] {
        let layer = IdempotencyLayer::new(Arc::new(BrokenStore { hang }))
            .store_timeout(Duration::from_millis(100));
        let up = Arc::new(Upstream::default());
        let started = std::time::Instant::now();
        let r = send(&layer, &up, post(Some("k"), "{}")).await;
        assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE, "hang={hang}");
        assert_eq!(r.problem_type(), "urn:idemgate:problem:store-unavailable");
        assert!(r.headers.contains_key("retry-after"));
        assert_eq!(r.decision, Decision::StoreUnavailable);
        assert_eq!(up.calls(), 0);
        assert!(layer.stats().store_errors() >= 1);
        // Generous bound: the answer comes from the store timeout, not from hanging forever.
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}

#[tokio::test]
async fn store_failure_in_pass_mode_forwards_and_counts() {
    let layer = IdempotencyLayer::new(Arc::new(BrokenStore { hang: false }))
        .on_store_error(OnStoreError::Pass);
    let up = Arc::new(Upstream::default());
    let r = send(&layer, &up, post(Some("k"), "{}")).await;
    assert_eq!(r.status, StatusCode::CREATED);
    assert_eq!(r.decision, Decision::Unprotected);
    assert!(
        r.headers.get("idempotent-replayed").is_none(),
        "the upstream's spoofed header must not cross, protected or not"
    );
    assert_eq!(up.calls(), 1);
    assert_eq!(layer.stats().unprotected_passes(), 1);
}

#[tokio::test]
async fn lapsed_lease_under_api_becomes_ambiguous() {
    // A claim made by a gateway that then died: nobody renews it.
    let store = Arc::new(MemoryStore::default());
    let record = idemgate::fingerprint::record_key(
        "default",
        &[http::header::AUTHORIZATION],
        &http::HeaderMap::new(),
        "k",
    );
    let req = post(Some("k"), "{}");
    let fp = idemgate::fingerprint::fingerprint(
        req.method(),
        req.uri(),
        req.headers(),
        &[http::header::CONTENT_TYPE],
        b"{}",
    );
    let options = ClaimOptions {
        lease: Duration::from_millis(50),
        ttl: Duration::from_secs(60),
        on_lapse: UnknownOutcome::Ambiguous,
    };
    assert!(matches!(
        store
            .claim(&record, &fp, OwnerToken::generate(), &options)
            .await
            .unwrap(),
        Claim::Acquired(_)
    ));
    tokio::time::sleep(Duration::from_millis(120)).await;
    let layer = IdempotencyLayer::new(store);
    let up = Arc::new(Upstream::default());
    let r = send(&layer, &up, req).await;
    assert_eq!(r.status, StatusCode::BAD_GATEWAY);
    assert_eq!(r.decision, Decision::OutcomeUnknown);
    assert_eq!(up.calls(), 0);
}

/// Holds a request with a `lease` for `held` (longer than the lease), checks that a retry
/// meanwhile finds it still in flight, then lets it finish and checks the retry's replay.
async fn lease_outlives_a_slow_request(lease: Duration, held: Duration) {
    let layer = memory_layer().default_route(RoutePolicy::api().lease(lease));
    let gate = Arc::new(Notify::new());
    let up = Arc::new(Upstream {
        gate: Some(gate.clone()),
        ..Default::default()
    });
    let first = spawn_send(&layer, &up);
    wait_for_calls(&up, 1).await;
    tokio::time::sleep(held).await;
    let during = send(&layer, &up, post(Some("k"), "{}")).await;
    assert_eq!(
        during.decision,
        Decision::InFlight,
        "a renewed lease must not lapse"
    );
    gate.notify_one();
    first.await.unwrap();
    assert_eq!(
        send(&layer, &up, post(Some("k"), "{}")).await.decision,
        Decision::Replayed
    );
}

#[tokio::test]
async fn lease_is_renewed_while_a_slow_request_runs() {
    // Renewed every 100 ms by the runtime's timer; held several leases long.
    lease_outlives_a_slow_request(Duration::from_millis(300), Duration::from_millis(1200)).await;
}

#[tokio::test]
async fn a_service_that_never_answers_is_cut_at_the_upstream_timeout() {
    // The gate is never opened: the inner service hangs.
    let up = Arc::new(Upstream {
        gate: Some(Arc::new(Notify::new())),
        ..Default::default()
    });
    let api = memory_layer().upstream_timeout(Duration::from_millis(200));
    let first = tokio::time::timeout(
        Duration::from_secs(10),
        send(&api, &up, post(Some("k"), "{}")),
    )
    .await
    .expect("cut at the upstream timeout");
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(
        first.problem_type(),
        "urn:idemgate:problem:upstream-timeout"
    );
    assert_eq!(first.decision, Decision::UpstreamFailed);
    // The outcome is unknown: under `api` the key is ambiguous, never run again on its own.
    let retry = send(&api, &up, post(Some("k"), "{}")).await;
    assert_eq!(retry.problem_type(), "urn:idemgate:problem:outcome-unknown");
    assert_eq!(up.calls(), 1);
    // Under `webhook` the retry runs it again.
    let hooks = memory_layer()
        .default_route(RoutePolicy::webhook())
        .upstream_timeout(Duration::from_millis(200));
    send(&hooks, &up, post(Some("k"), "{}")).await;
    send(&hooks, &up, post(Some("k"), "{}")).await;
    assert_eq!(up.calls(), 3);
}

/// A response body that sends one frame, then nothing more, for ever.
struct StallingBody {
    sent: bool,
}

impl http_body::Body for StallingBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        if std::mem::replace(&mut self.sent, true) {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(Some(Ok(http_body::Frame::data(Bytes::from_static(
                b"{\"partial\":",
            )))))
        }
    }
}

#[tokio::test]
async fn a_kept_response_that_stops_arriving_is_cut_at_the_upstream_timeout() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let stalling = service_fn(move |_: Req| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, Infallible>(Response::new(StallingBody { sent: false })) }
    });
    let layer = memory_layer().upstream_timeout(Duration::from_millis(200));
    let svc = ServiceBuilder::new().layer(layer.clone()).service(stalling);
    let first = tokio::time::timeout(
        Duration::from_secs(10),
        svc.clone().oneshot(post(Some("k"), "{}")),
    )
    .await
    .expect("cut at the upstream timeout")
    .unwrap();
    assert_eq!(first.status(), StatusCode::GATEWAY_TIMEOUT);
    let retry = svc.oneshot(post(Some("k"), "{}")).await.unwrap();
    assert_eq!(
        retry.status(),
        StatusCode::BAD_GATEWAY,
        "ambiguous under api"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn without_an_upstream_timeout_a_slow_service_runs_to_its_end() {
    let gate = Arc::new(Notify::new());
    let up = Arc::new(Upstream {
        gate: Some(gate.clone()),
        ..Default::default()
    });
    let layer = memory_layer().upstream_timeout(None);
    let first = spawn_send(&layer, &up);
    wait_for_calls(&up, 1).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        send(&layer, &up, post(Some("k"), "{}")).await.decision,
        Decision::InFlight
    );
    gate.notify_one();
    assert_eq!(first.await.unwrap().decision, Decision::Executed);
}

#[tokio::test]
async fn sixty_four_concurrent_requests_run_once() {
    let layer = memory_layer();
    let gate = Arc::new(Notify::new());
    let up = Arc::new(Upstream {
        gate: Some(gate.clone()),
        ..Default::default()
    });
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (layer, up) = (layer.clone(), up.clone());
        tasks.push(tokio::spawn(async move {
            send(&layer, &up, post(Some("race"), "{}")).await.decision
        }));
    }
    wait_for_calls(&up, 1).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    gate.notify_one();
    let mut executed = 0;
    for t in tasks {
        let d = t.await.unwrap();
        assert!(
            matches!(
                d,
                Decision::Executed | Decision::InFlight | Decision::Replayed
            ),
            "{d:?}"
        );
        executed += usize::from(d == Decision::Executed);
    }
    assert_eq!(executed, 1);
    assert_eq!(up.calls(), 1);
}

async fn wait_for_calls(up: &Upstream, n: usize) {
    for _ in 0..500 {
        if up.calls() >= n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("upstream never reached {n} calls");
}

/// A store whose claims land but whose answers are lost while `lose_answers` is set, as when
/// a store times out after applying the command.
struct LostAnswerStore {
    inner: MemoryStore,
    lose_answers: std::sync::atomic::AtomicBool,
    /// While set, releases fail, as from a store that is down.
    fail_releases: std::sync::atomic::AtomicBool,
}

impl LostAnswerStore {
    fn new(lose_answers: bool, fail_releases: bool) -> Self {
        Self {
            inner: MemoryStore::default(),
            lose_answers: lose_answers.into(),
            fail_releases: fail_releases.into(),
        }
    }
}

#[async_trait]
impl Store for LostAnswerStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fp: &idemgate::record::FingerprintHash,
        token: OwnerToken,
        options: &ClaimOptions,
    ) -> Result<Claim, StoreError> {
        let claim = self.inner.claim(key, fp, token, options).await;
        if self.lose_answers.load(Ordering::SeqCst) {
            return Err(StoreError::Timeout {
                backend: "lost",
                after: Duration::from_millis(1),
            });
        }
        claim
    }
    async fn complete(
        &self,
        k: &RecordKey,
        t: OwnerToken,
        c: idemgate::record::Completion,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        self.inner.complete(k, t, c, ttl).await
    }
    async fn release(&self, k: &RecordKey, t: OwnerToken) -> Result<Transition, StoreError> {
        if self.fail_releases.load(Ordering::SeqCst) {
            return Err(StoreError::Timeout {
                backend: "lost",
                after: Duration::from_millis(1),
            });
        }
        self.inner.release(k, t).await
    }
    async fn renew(
        &self,
        k: &RecordKey,
        t: OwnerToken,
        lease: Duration,
    ) -> Result<Transition, StoreError> {
        self.inner.renew(k, t, lease).await
    }
    async fn mark_ambiguous(
        &self,
        k: &RecordKey,
        t: OwnerToken,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        self.inner.mark_ambiguous(k, t, ttl).await
    }
    async fn get(&self, k: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(k).await
    }
    async fn delete(&self, k: &RecordKey) -> Result<bool, StoreError> {
        self.inner.delete(k).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }
    fn backend(&self) -> &'static str {
        "lost"
    }
}

/// Sends `POST {}` with key `k` until the answer is not `409 request-in-flight`.
async fn send_until_not_in_flight(
    layer: &IdempotencyLayer,
    up: &Arc<Upstream>,
    tries: usize,
) -> Option<Answer> {
    for _ in 0..tries {
        let r = send(layer, up, post(Some("k"), "{}")).await;
        if r.decision != Decision::InFlight {
            return Some(r);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

#[tokio::test]
async fn a_lost_claim_is_undone_once_the_store_is_back_within_the_lease() {
    let store = Arc::new(LostAnswerStore::new(true, true));
    let layer = IdempotencyLayer::new(store.clone())
        .store_timeout(Duration::from_millis(50))
        .default_route(RoutePolicy::api().lease(Duration::from_secs(3)));
    let up = Arc::new(Upstream::default());
    let refused = send(&layer, &up, post(Some("k"), "{}")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    store.lose_answers.store(false, Ordering::SeqCst);
    // Releases keep failing for many store timeouts, then the store is back, long before
    // the lease ends: the claim is undone and the retry runs, rather than lapsing into an
    // ambiguous record for a request that never ran.
    tokio::time::sleep(Duration::from_millis(800)).await;
    store.fail_releases.store(false, Ordering::SeqCst);
    let retry = send_until_not_in_flight(&layer, &up, 100)
        .await
        .expect("the lost claim was not undone within the lease");
    assert_eq!(retry.decision, Decision::Executed);
    assert_eq!(up.calls(), 1);
}

#[tokio::test]
async fn a_claim_whose_answer_was_lost_is_undone_so_the_retry_runs() {
    let store = Arc::new(LostAnswerStore::new(true, false));
    let layer = IdempotencyLayer::new(store.clone());
    let up = Arc::new(Upstream::default());
    let refused = send(&layer, &up, post(Some("k"), "{}")).await;
    assert_eq!(refused.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(up.calls(), 0);
    store.lose_answers.store(false, Ordering::SeqCst);
    // The 503 said nothing was forwarded; the retry must run, not find a phantom claim.
    let retry = send_until_not_in_flight(&layer, &up, 100)
        .await
        .expect("the lost claim was never undone");
    assert_eq!(retry.decision, Decision::Executed);
    assert_eq!(up.calls(), 1);
}

/// The layer and its service show what they wrap, and the service hands its inner service
/// back, as tower-http's middlewares do.
#[test]
fn the_layer_and_its_service_are_debug_and_give_back_the_inner_service() {
    #[derive(Debug, Clone, PartialEq)]
    struct Inner(u8);

    let layer = IdempotencyLayer::new(Arc::new(MemoryStore::default()));
    assert!(format!("{layer:?}").contains("memory"), "{layer:?}");
    let mut service = tower::Layer::layer(&layer, Inner(7));
    assert!(format!("{service:?}").contains("Inner(7)"), "{service:?}");
    service.get_mut().0 = 8;
    assert_eq!(service.get_ref(), &Inner(8));
    assert_eq!(service.into_inner(), Inner(8));
}
