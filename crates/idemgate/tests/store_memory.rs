//! The store conformance suite against [`MemoryStore`].

use std::sync::Arc;

use idemgate::store::{MemoryStore, Store};

idemgate::store_conformance_tests!(async { Arc::new(MemoryStore::new()) as Arc<dyn Store> });

/// A concrete store (not yet behind `Arc<dyn Store>`) is accepted by the macro too.
mod concrete {
    idemgate::store_conformance_tests!(async { idemgate::store::MemoryStore::new() });
}
