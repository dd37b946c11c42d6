//! [`LayerStats`]: the counters a layer and its services keep for whoever exports metrics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters the layer keeps for whoever exports metrics.
#[derive(Debug, Default)]
pub struct LayerStats {
    fenced_completions: AtomicU64,
    store_errors: AtomicU64,
    unprotected_passes: AtomicU64,
    signature_rejections: AtomicU64,
    in_flight: AtomicU64,
}

impl LayerStats {
    /// Completions refused because the record had been taken over by a newer owner.
    pub fn fenced_completions(&self) -> u64 {
        self.fenced_completions.load(Ordering::Relaxed)
    }

    /// Store calls that failed or timed out.
    pub fn store_errors(&self) -> u64 {
        self.store_errors.load(Ordering::Relaxed)
    }

    /// Keyed requests forwarded without protection because the store failed
    /// (`on_store_error = "pass"`).
    pub fn unprotected_passes(&self) -> u64 {
        self.unprotected_passes.load(Ordering::Relaxed)
    }

    /// Requests refused `401 invalid-signature` by a route's
    /// [`verifier`](crate::RoutePolicy::verify_with): nothing was claimed or forwarded.
    pub fn signature_rejections(&self) -> u64 {
        self.signature_rejections.load(Ordering::Relaxed)
    }

    /// Keyed requests this layer is running upstream now.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub(crate) fn count_fenced(&self) {
        self.fenced_completions.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_store_error(&self) {
        self.store_errors.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_unprotected(&self) {
        self.unprotected_passes.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn count_signature_rejected(&self) {
        self.signature_rejections.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn enter(self: &Arc<Self>) -> InFlightGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlightGuard(self.clone())
    }
}

/// Counts one keyed request as in flight until dropped.
pub(crate) struct InFlightGuard(Arc<LayerStats>);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}
