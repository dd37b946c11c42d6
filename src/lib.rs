//! idemgate makes retried HTTP requests safe.
//!
//! For every mutating request that carries an idempotency key, the first one runs, its
//! response is kept, and every retry is answered with that same response instead of running
//! the operation again.

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod policy;
pub mod record;
pub mod store;
#[cfg(feature = "proxy")]
pub mod proxy;
