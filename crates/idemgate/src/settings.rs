//! The layer's settings as its services read them: the store, the route table and the bounds.

use std::sync::Arc;
use std::time::Duration;

use crate::policy::{OnStoreError, RoutePolicy};
use crate::stats::LayerStats;
use crate::store::Store;

/// A route as the service uses it: its policy and its name, shared cheaply.
#[derive(Debug)]
pub(crate) struct Route {
    pub(crate) name: Arc<str>,
    /// The prefix the route is matched at; empty for the default route.
    pub(crate) prefix: Arc<str>,
    pub(crate) policy: RoutePolicy,
}

impl Route {
    pub(crate) fn new(prefix: &str, policy: RoutePolicy) -> Arc<Self> {
        Arc::new(Self {
            name: Arc::from(policy.route_name()),
            prefix: Arc::from(prefix),
            policy,
        })
    }
}

/// The layer's settings, which every service it makes (and every clone of those) shares.
#[derive(Clone)]
pub(crate) struct LayerSettings {
    pub(crate) store: Arc<dyn Store>,
    /// Longest prefix first.
    pub(crate) routes: Vec<(String, Arc<Route>)>,
    pub(crate) default_route: Arc<Route>,
    pub(crate) store_timeout: Duration,
    /// Bound on a claimed request's run of the inner service, if any.
    pub(crate) upstream_timeout: Option<Duration>,
    pub(crate) on_store_error: OnStoreError,
    pub(crate) stats: Arc<LayerStats>,
    /// Whether each response's [`Outcome`](crate::Outcome) goes into its extensions (the
    /// documented way); the proxy's own layer leaves it on the body, where it reads it.
    pub(crate) outcome_extension: bool,
}

impl LayerSettings {
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
