//! An axum app protected by idemgate in one line.
//!
//! ```text
//! cargo run --example axum
//! curl -si -X POST localhost:3000/payments -H 'Idempotency-Key: order-42' -d '{"amount":10}'
//! curl -si -X POST localhost:3000/payments -H 'Idempotency-Key: order-42' -d '{"amount":10}'
//! ```
//! The second answer is the first one again, with `Idempotent-Replayed: true`, and the
//! handler's counter does not move.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use idemgate::{IdempotencyLayer, MemoryStore};

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let charges = Arc::new(AtomicU64::new(0));
    let app = Router::new()
        .route("/payments", post(charge))
        .with_state(charges)
        .layer(IdempotencyLayer::new(Arc::new(MemoryStore::default())));

    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    eprintln!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await
}

/// Runs once per idempotency key, however often the client retries.
async fn charge(State(charges): State<Arc<AtomicU64>>) -> Json<serde_json::Value> {
    let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
    Json(serde_json::json!({ "charge": n, "status": "succeeded" }))
}
