//! idemgate makes retried HTTP requests safe.
//!
//! For every mutating request that carries an idempotency key, the first one runs, its
//! response is kept, and every retry is answered with that same response
//! (`Idempotent-Replayed: true`) instead of running the operation again. The semantics follow
//! Stripe's idempotency keys and the IETF `Idempotency-Key` draft.
//!
//! idemgate ships as this library — a tower [`IdempotencyLayer`] for axum and hyper apps,
//! the [`store::Store`] contract and its backends — and as the `idemgate` reverse proxy.
//!
//! ```
//! use std::sync::Arc;
//! use axum::{Router, routing::post};
//! use idemgate::{IdempotencyLayer, MemoryStore};
//!
//! let app: Router = Router::new()
//!     .route("/payments", post(|| async { "charged" }))
//!     .layer(IdempotencyLayer::new(Arc::new(MemoryStore::default())));
//! # let _ = app;
//! ```

pub mod body;
mod error_chain;
pub mod fingerprint;
mod future;
pub mod headers;
pub mod key;
mod layer;
mod lock;
pub mod policy;
pub mod record;
pub mod response;
mod service;
mod settings;
mod stats;
pub mod store;
pub mod webhook;

pub use error_chain::ErrorChain;
pub use future::ResponseFuture;
pub use layer::{DEFAULT_STORE_TIMEOUT, DEFAULT_UPSTREAM_TIMEOUT, IdempotencyLayer};
pub use policy::{OnStoreError, RoutePolicy};
pub use response::{Decision, Outcome};
pub use service::IdempotencyService;
pub use stats::LayerStats;
pub use store::{MemoryStore, Store};
