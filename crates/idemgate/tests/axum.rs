//! The layer inside a real axum `Router`, served on a loopback port.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::extract::State;
use axum::routing::post;
use axum::{Extension, Router};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemgate::{Decision, IdempotencyLayer, MemoryStore, Outcome};

async fn serve(app: Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

#[tokio::test]
async fn axum_router_replays_and_exposes_the_decision() {
    let calls = Arc::new(AtomicUsize::new(0));
    let decisions = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = decisions.clone();
    let app = Router::new()
        .route(
            "/orders",
            post(
                |State(calls): State<Arc<AtomicUsize>>, body: Bytes| async move {
                    let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
                    (
                        StatusCode::CREATED,
                        format!("order {n} of {} bytes", body.len()),
                    )
                },
            ),
        )
        .with_state(calls.clone())
        .layer(IdempotencyLayer::new(Arc::new(MemoryStore::default())))
        // An outer layer reads what idemgate decided, as an app would to log or count it.
        .layer(axum::middleware::map_response(
            move |r: axum::response::Response| {
                let seen = seen.clone();
                async move {
                    if let Some(o) = r.extensions().get::<Outcome>() {
                        seen.lock().unwrap().push(o.decision);
                    }
                    r
                }
            },
        ))
        .layer(Extension(()));
    let addr = serve(app).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let send = || {
        client.request(
            Request::post(format!("http://{addr}/orders"))
                .header("idempotency-key", "order-1")
                .body(Full::new(Bytes::from_static(b"{\"item\":1}")))
                .unwrap(),
        )
    };
    let first = send().await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let first_body = first.into_body().collect().await.unwrap().to_bytes();
    let retry = send().await.unwrap();
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(
        retry.into_body().collect().await.unwrap().to_bytes(),
        first_body
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        *decisions.lock().unwrap(),
        [Decision::Executed, Decision::Replayed]
    );
}
