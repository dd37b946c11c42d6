//! [`IdempotencyLayer`]: the builder that configures the middleware.

use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use crate::policy::{OnStoreError, RoutePolicy};
use crate::service::IdempotencyService;
use crate::settings::{LayerSettings, Route};
use crate::stats::LayerStats;
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
    settings: Arc<LayerSettings>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.settings.store.backend())
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// A layer over `store` with the `api` preset on every path.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idemgate::{IdempotencyLayer, MemoryStore};
    ///
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::new()));
    /// # let _ = layer; }
    /// ```
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            settings: Arc::new(LayerSettings {
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

    fn settings_mut(&mut self) -> &mut LayerSettings {
        Arc::make_mut(&mut self.settings)
    }

    /// The policy for paths no route matches (default: `api`, named `default`).
    #[must_use]
    pub fn default_route(mut self, policy: RoutePolicy) -> Self {
        self.settings_mut().default_route = Route::new("", policy);
        self
    }

    /// Applies `policy` to paths under `prefix` (matched at a segment boundary; the longest
    /// matching prefix wins). Give the policy its own [`RoutePolicy::name`]: routes with the
    /// same name share records.
    #[must_use]
    pub fn route(mut self, prefix: impl Into<String>, policy: RoutePolicy) -> Self {
        let settings = self.settings_mut();
        let prefix = prefix.into();
        settings.routes.retain(|(p, _)| *p != prefix);
        let route = Route::new(&prefix, policy);
        settings.routes.push((prefix, route));
        settings
            .routes
            .sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
        self
    }

    /// Bound on every store call (default 2 s). Past it the request is answered as the store
    /// being unavailable.
    #[must_use]
    pub fn store_timeout(mut self, timeout: Duration) -> Self {
        self.settings_mut().store_timeout = timeout;
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
        self.settings_mut().upstream_timeout = timeout.into();
        self
    }

    /// Leaves each response's [`Outcome`](crate::Outcome) on its body
    /// ([`ResponseBody::outcome`](crate::body::ResponseBody::outcome)) instead of moving it
    /// into the response's extensions, which costs a map and two boxes per response. For a
    /// server that reads the outcome from the body as it writes the response, as the
    /// `idemgate` gateway does; an app whose middleware reads the extension leaves it off.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idemgate::{IdempotencyLayer, MemoryStore};
    ///
    /// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::default())).outcome_on_body_only();
    /// # let _ = layer;
    /// ```
    #[must_use]
    pub fn outcome_on_body_only(mut self) -> Self {
        self.settings_mut().outcome_extension = false;
        self
    }

    /// What to do when the store fails (default: reject with `503`).
    #[must_use]
    pub fn on_store_error(mut self, mode: OnStoreError) -> Self {
        self.settings_mut().on_store_error = mode;
        self
    }

    /// The counters this layer (and every service it makes) updates.
    pub fn stats(&self) -> Arc<LayerStats> {
        self.settings.stats.clone()
    }

    /// The policy a request on `path` is handled under: the route with the longest prefix
    /// that matches `path` at a segment boundary, else the default route.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idemgate::{IdempotencyLayer, MemoryStore, RoutePolicy};
    ///
    /// let layer = IdempotencyLayer::new(Arc::new(MemoryStore::default()))
    ///     .route("/hooks", RoutePolicy::webhook().name("hooks"));
    /// assert_eq!(layer.route_policy("/hooks/github").route_name(), "hooks");
    /// assert_eq!(layer.route_policy("/hooksx").route_name(), "default");
    /// ```
    pub fn route_policy(&self, path: &str) -> &RoutePolicy {
        &self.settings.route_for(path).policy
    }

    /// The store this layer uses.
    pub fn store(&self) -> Arc<dyn Store> {
        self.settings.store.clone()
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(inner, self.settings.clone())
    }
}
