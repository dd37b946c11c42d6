//! [`IdempotencyLayer`]: the builder that configures the middleware.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tower_layer::Layer;

use crate::policy::{OnStoreError, RoutePolicy};
use crate::service::IdempotencyService;
use crate::store::Store;

/// Default bound on every store call; past it a keyed request gets `503`.
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(2);
/// Default bound on a keyed request's run of the inner service; past it → `504`.
pub const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(60);

/// Adds idempotency-key handling to a service.
///
/// ```
/// use std::sync::Arc;
/// use idemgate::{IdempotencyLayer, MemoryStore, policy::RoutePolicy};
///
/// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::default()))
///     .route("/webhooks/github", RoutePolicy::webhook()
///         .name("github")
///         .key_header(http::HeaderName::from_static("x-github-delivery")));
/// # let _ = layer;
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.shared.store.backend())
            .finish_non_exhaustive()
    }
}

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

/// A route as the service uses it: its policy and its name, shared cheaply.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) name: Arc<str>,
    /// The prefix the route is matched at; empty for the default route.
    pub(crate) prefix: Arc<str>,
    pub(crate) policy: RoutePolicy,
}

impl Route {
    fn new(prefix: &str, policy: RoutePolicy) -> Arc<Self> {
        Arc::new(Self {
            name: Arc::from(policy.route_name()),
            prefix: Arc::from(prefix),
            policy,
        })
    }
}

/// What every clone of the service shares.
#[derive(Clone)]
pub(crate) struct Shared {
    pub(crate) store: Arc<dyn Store>,
    /// Longest prefix first.
    routes: Vec<(String, Arc<Route>)>,
    default_route: Arc<Route>,
    pub(crate) store_timeout: Duration,
    /// Bound on a claimed request's run of the inner service, if any.
    pub(crate) upstream_timeout: Option<Duration>,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) stats: Arc<LayerStats>,
    /// Whether each response's [`Outcome`](crate::Outcome) goes into its extensions (the
    /// documented way); the proxy's own layer leaves it on the body, where it reads it.
    pub(crate) outcome_extension: bool,
}

impl Shared {
    /// The route for `path`: the longest configured prefix that matches at a segment boundary
    /// (`/hooks` matches `/hooks` and `/hooks/x`, not `/hooksx`), else the default route.
    pub(crate) fn route_for(&self, path: &str) -> &Arc<Route> {
        self.routes
            .iter()
            .find(|(prefix, _)| {
                path.strip_prefix(prefix.as_str()).is_some_and(|rest| {
                    rest.is_empty() || rest.starts_with('/') || prefix.ends_with('/')
                })
            })
            .map_or(&self.default_route, |(_, route)| route)
    }
}

impl IdempotencyLayer {
    /// A layer over `store` with the `api` preset on every path.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            shared: Arc::new(Shared {
                store,
                routes: Vec::new(),
                default_route: Route::new("", RoutePolicy::api()),
                store_timeout: DEFAULT_STORE_TIMEOUT,
                upstream_timeout: Some(DEFAULT_UPSTREAM_TIMEOUT),
                on_store_error: OnStoreError::Reject,
                stats: Arc::default(),
                outcome_extension: true,
            }),
        }
    }

    fn shared_mut(&mut self) -> &mut Shared {
        Arc::make_mut(&mut self.shared)
    }

    /// The policy for paths no route matches (default: `api`, named `default`).
    #[must_use]
    pub fn default_route(mut self, policy: RoutePolicy) -> Self {
        self.shared_mut().default_route = Route::new("", policy);
        self
    }

    /// Applies `policy` to paths under `prefix` (matched at a segment boundary; the longest
    /// matching prefix wins). Give the policy its own [`RoutePolicy::name`]: routes with the
    /// same name share records.
    #[must_use]
    pub fn route(mut self, prefix: impl Into<String>, policy: RoutePolicy) -> Self {
        let shared = self.shared_mut();
        let prefix = prefix.into();
        shared.routes.retain(|(p, _)| *p != prefix);
        let route = Route::new(&prefix, policy);
        shared.routes.push((prefix, route));
        shared
            .routes
            .sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
        self
    }

    /// Bound on every store call (default 2 s). Past it the request is answered as the store
    /// being unavailable.
    #[must_use]
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.shared_mut().store_timeout = timeout;
        self
    }

    /// Bound on a keyed request's run of the inner service, from the call until the response
    /// the route keeps has been read whole (default 60 s). Past it the call is dropped, the
    /// client gets `504 upstream-timeout` and the route's `unknown_outcome` applies, so a
    /// service that never answers cannot hold a key for ever. `None` leaves the run unbounded,
    /// for an inner service that bounds its own waits (the proxy's forwarder does). Requests
    /// that pass through are never bounded here.
    #[must_use]
    pub fn upstream_timeout(mut self, timeout: impl Into<Option<Duration>>) -> Self {
        self.shared_mut().upstream_timeout = timeout.into();
        self
    }

    /// For the proxy, which reads each response's outcome from the body: no extension.
    #[cfg(feature = "proxy")]
    #[must_use]
    pub(crate) fn outcome_on_body_only(mut self) -> Self {
        self.shared_mut().outcome_extension = false;
        self
    }

    /// What to do when the store fails (default: reject with `503`).
    #[must_use]
    pub fn on_store_error(mut self, mode: OnStoreError) -> Self {
        self.shared_mut().on_store_error = mode;
        self
    }

    /// The counters this layer (and every service it makes) updates.
    pub fn stats(&self) -> Arc<LayerStats> {
        self.shared.stats.clone()
    }

    /// The store this layer uses.
    pub fn store(&self) -> Arc<dyn Store> {
        self.shared.store.clone()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.shared.clone())
    }
}
