//! Webhook senders' signatures, checked before anything is claimed.
//!
//! A route that fronts a webhook receiver is keyed by the sender's delivery id, and that id
//! is no secret: anyone who can reach the route could send a delivery with a real event's id,
//! take its claim and reach the receiver. A [`Verifier`] on the route
//! ([`RoutePolicy::verify_with`](crate::RoutePolicy::verify_with)) closes that: every request of
//! the route's methods is read, and checked against the sender's signature before the key is
//! looked at or the store is called. A request that fails gets `401 invalid-signature`:
//! nothing is claimed, nothing is forwarded, and the layer counts it
//! ([`LayerStats::signature_rejections`](crate::LayerStats::signature_rejections)).
//!
//! The hook is a small trait, [`Verifier`], with a blanket impl for closures. With the
//! `webhooks` feature (on by default) the providers' own schemes come as types —
//! [`GitHub`], [`Stripe`], [`Shopify`], [`StandardWebhooks`], [`Slack`] and [`Twilio`] — each
//! checking exactly what its provider documents, and each provider's whole route setup comes
//! from [`Provider::policy`] (or a scheme's own `policy()`):
//!
#![cfg_attr(feature = "webhooks", doc = "```")]
#![cfg_attr(not(feature = "webhooks"), doc = "```ignore")]
//! use std::sync::Arc;
//! use axum::{Router, routing::post};
//! use idemgate::{IdempotencyLayer, MemoryStore, webhook::{Secrets, Stripe}};
//!
//! # fn main() -> Result<(), idemgate::webhook::SetupError> {
//! # let secrets = Secrets::new(["whsec_test"])?;
//! // In an app: Stripe::secret_env(["STRIPE_WEBHOOK_SECRET"])?
//! let stripe = Stripe::new(secrets);
//! let app: Router = Router::new()
//!     .route("/webhooks/stripe", post(|| async { "handled" }))
//!     .layer(IdempotencyLayer::new(Arc::new(MemoryStore::default()))
//!         .route("/webhooks/stripe", stripe.policy()));
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! Secrets are held in [`Secret`], whose `Debug` prints no byte of them; errors name the
//! environment variable a secret came from, never its value. Signatures are compared in
//! constant time. docs/webhooks.md has each provider's setup.

mod error;
mod request;
mod verifier;

#[cfg(feature = "webhooks")]
mod github;
#[cfg(feature = "webhooks")]
mod mac;
#[cfg(feature = "webhooks")]
mod provider;
#[cfg(feature = "webhooks")]
mod scheme;
#[cfg(feature = "webhooks")]
mod secret;
#[cfg(feature = "webhooks")]
mod shopify;
#[cfg(feature = "webhooks")]
mod slack;
#[cfg(feature = "webhooks")]
mod standard;
#[cfg(feature = "webhooks")]
mod stripe;
#[cfg(feature = "webhooks")]
mod timestamp;
#[cfg(feature = "webhooks")]
mod twilio;

pub use error::SignatureError;
pub use request::SignedRequest;
pub(crate) use verifier::RouteVerifier;
pub use verifier::Verifier;

#[cfg(feature = "webhooks")]
pub use github::GitHub;
#[cfg(feature = "webhooks")]
pub use provider::Provider;
#[cfg(feature = "webhooks")]
pub use secret::{Secret, Secrets, SetupError};
#[cfg(feature = "webhooks")]
pub use shopify::Shopify;
#[cfg(feature = "webhooks")]
pub use slack::Slack;
#[cfg(feature = "webhooks")]
pub use standard::StandardWebhooks;
#[cfg(feature = "webhooks")]
pub use stripe::Stripe;
#[cfg(feature = "webhooks")]
pub use timestamp::DEFAULT_TOLERANCE;
#[cfg(feature = "webhooks")]
pub use twilio::Twilio;
