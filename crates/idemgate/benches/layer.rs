//! What the layer adds to a request, measured around a service that does nothing but answer
//! ~200 bytes of JSON: the bare service, then the layer passing a request through, running a
//! new key, and replaying a stored response.
//!
//! `cargo bench --bench layer`

use std::convert::Infallible;
use std::future::{Ready, ready};
use std::hint::black_box;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use idemgate::policy::RoutePolicy;
use idemgate::{IdempotencyLayer, MemoryStore};
use tower::{Layer, Service, ServiceExt};

const JSON: &[u8] = br#"{"id":"pay_8e03978e40d543e8","object":"payment","amount":2000,"currency":"eur","status":"succeeded","customer":"cus_9s6XKzkNRiz8i3","created":1700000000,"livemode":false,"metadata":{"order":"6735"}}"#;
const REQUEST: &[u8] = br#"{"amount":2000,"currency":"eur","customer":"cus_9s6XKzkNRiz8i3"}"#;
/// Keys reused by the replay case, as in the load benchmark.
const REPLAY_KEYS: u64 = 16;

/// Answers every request at once with the same small JSON document, ignoring its body.
#[derive(Clone, Copy)]
struct NoOp;

impl<B> Service<Request<B>> for NoOp {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<B>) -> Self::Future {
        let mut response = Response::new(Full::new(Bytes::from_static(JSON)));
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        ready(Ok(response))
    }
}

fn request(key: Option<HeaderValue>) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::new(Bytes::from_static(REQUEST)));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = http::Uri::from_static("/v1/payments");
    let headers = req.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    if let Some(key) = key {
        headers.insert("idempotency-key", key);
    }
    req
}

/// Sends one request and reads the whole response body, as a server would.
async fn send<S, B>(svc: &mut S, req: Request<Full<Bytes>>) -> Bytes
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>, Error = Infallible>,
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    let Ok(ready) = svc.ready().await;
    let Ok(response) = ready.call(req).await;
    match response.into_body().collect().await {
        Ok(body) => body.to_bytes(),
        Err(error) => panic!("response body failed: {error:?}"),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn layer(c: &mut Criterion) {
    let rt = runtime();
    // Short-lived records keep the new-key case at a steady store size however long it runs.
    let layer = rt.block_on(async {
        IdempotencyLayer::new(Arc::new(MemoryStore::default()))
            .default_route(RoutePolicy::api().ttl(Duration::from_millis(200)))
    });
    let mut group = c.benchmark_group("layer");

    let mut bare = NoOp;
    group.bench_function("bare_service", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for n in 0..iters {
                    let key = HeaderValue::from(n);
                    black_box(send(&mut bare, request(Some(key))).await);
                }
                start.elapsed()
            })
        })
    });

    let mut svc = layer.layer(NoOp);
    group.bench_function("pass_through", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    black_box(send(&mut svc, request(None)).await);
                }
                start.elapsed()
            })
        })
    });

    let mut next = 0u64;
    group.bench_function("new_key", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    next += 1;
                    black_box(send(&mut svc, request(Some(HeaderValue::from(next)))).await);
                }
                start.elapsed()
            })
        })
    });

    // The 16 keys are run once first, so every measured request is a replay.
    let mut svc = rt.block_on(async {
        let mut svc = IdempotencyLayer::new(Arc::new(MemoryStore::default())).layer(NoOp);
        for n in 0..REPLAY_KEYS {
            send(&mut svc, request(Some(HeaderValue::from(n)))).await;
        }
        svc
    });
    let mut n = 0u64;
    group.bench_function("replay", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    n = (n + 1) % REPLAY_KEYS;
                    black_box(send(&mut svc, request(Some(HeaderValue::from(n)))).await);
                }
                start.elapsed()
            })
        })
    });
    group.finish();
}

criterion_group!(benches, layer);
criterion_main!(benches);
