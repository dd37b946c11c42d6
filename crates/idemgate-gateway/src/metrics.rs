//! Counters and latency histograms, exposed in the Prometheus text format by the admin
//! listener through `prometheus-client`. Label sets are bounded: routes come from the config,
//! outcomes, store operations and upstream error kinds are fixed lists. The hot path holds a
//! handle on each series it counts (an atomic, or a histogram under a short lock), so counting
//! never looks a label set up; only a route the config does not name (possible through the
//! library API alone) is found by its labels.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use prometheus_client::encoding::{EncodeLabelSet, prometheus_text};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use idemgate::record::{Completion, FingerprintHash, OwnerToken, Record, RecordKey};
use idemgate::response::Decision;
use idemgate::store::{Claim, ClaimOptions, DataLossStatus, Store, StoreError, Transition};

/// The `Content-Type` of what [`Metrics::render`] writes.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Upper bounds of the latency histogram buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

fn latency_histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// Why an upstream call produced no response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpstreamErrorKind {
    /// Connection refused, unreachable or connect timeout: nothing was sent.
    Unreachable,
    /// No response head within `upstream_timeout`.
    Timeout,
    /// The connection failed after the request was sent.
    Reset,
}

impl UpstreamErrorKind {
    const ALL: [Self; 3] = [Self::Unreachable, Self::Timeout, Self::Reset];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unreachable => "unreachable",
            Self::Timeout => "timeout",
            Self::Reset => "reset",
        }
    }
}

/// Why a request was answered before any route saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnroutedReason {
    /// Not well-formed HTTP: the HTTP layer answered `400`; or `400 malformed-request` (no
    /// single valid `Host`, an asterisk target without `OPTIONS`).
    Malformed,
    /// Header fields past the limits (`431`), or a request target too long for the HTTP
    /// layer (`414`).
    TooLarge,
    /// A body sent with a transfer coding other than `chunked` alone, or a `CONNECT` (`501`).
    Unsupported,
}

impl UnroutedReason {
    const ALL: [Self; 3] = [Self::Malformed, Self::TooLarge, Self::Unsupported];

    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Malformed => "malformed",
            Self::TooLarge => "too_large",
            Self::Unsupported => "unsupported",
        }
    }
}

/// The store operations that are timed.
#[derive(Clone, Copy, Debug)]
enum StoreOp {
    Claim,
    Complete,
    Release,
    Renew,
    MarkAmbiguous,
    Get,
    Delete,
    Ping,
}

impl StoreOp {
    const ALL: [Self; 8] = [
        Self::Claim,
        Self::Complete,
        Self::Release,
        Self::Renew,
        Self::MarkAmbiguous,
        Self::Get,
        Self::Delete,
        Self::Ping,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Self::Claim => "claim",
            Self::Complete => "complete",
            Self::Release => "release",
            Self::Renew => "renew",
            Self::MarkAmbiguous => "mark_ambiguous",
            Self::Get => "get",
            Self::Delete => "delete",
            Self::Ping => "ping",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreLabels {
    backend: &'static str,
    op: &'static str,
}

/// One store operation's series: how long its calls waited, how many failed, how many were
/// given up.
#[derive(Clone, Debug)]
struct StoreOpMetrics {
    duration: Histogram,
    errors: Counter,
    abandoned: Counter,
}

/// Values read from the layer at scrape time.
#[derive(Clone, Copy, Debug, Default)]
pub struct LayerCounters {
    /// Store calls the layer saw fail or time out.
    pub store_errors: u64,
    /// Completions refused because another owner had taken the record over.
    pub fenced_completions: u64,
    /// Requests forwarded without protection (`on_store_error = "pass"`).
    pub unprotected_passes: u64,
    /// Requests refused `401 invalid-signature` by a route's verifier, on every route.
    pub signature_rejections: u64,
    /// Records this gateway holds in flight now.
    pub in_flight: u64,
}

type StoreHistograms = Family<StoreLabels, Histogram, fn() -> Histogram>;

/// Everything the gateway counts.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    /// Handles on the configured routes' request counters, by decision.
    routes: RouteCounters,
    upstream: Histogram,
    upstream_errors: [Counter; UpstreamErrorKind::ALL.len()],
    unrouted_requests: [Counter; UnroutedReason::ALL.len()],
    store: StoreSeries,
    open_connections: Gauge,
    abandoned_requests: Counter,
    /// Set when shutdown gave up on open requests: those are cut by the gateway, not
    /// abandoned by their clients.
    cut_off: AtomicBool,
}

/// The configured routes' request counters, by decision.
type RouteCounters = Vec<(Arc<str>, [Counter; Decision::ALL.len()])>;

/// The store calls' series, by backend and operation.
#[derive(Debug)]
struct StoreSeries {
    durations: StoreHistograms,
    errors: Family<StoreLabels, Counter>,
    abandoned: Family<StoreLabels, Counter>,
}

impl StoreSeries {
    fn register(registry: &mut Registry) -> Self {
        let durations: StoreHistograms = Family::new_with_constructor(latency_histogram);
        registry.register(
            "idemgate_store_duration_seconds",
            "Time one store call waited, by operation (0 if answered at once)",
            durations.clone(),
        );
        let errors = Family::<StoreLabels, Counter>::default();
        registry.register(
            "idemgate_store_call_errors",
            "Store calls that returned an error, by operation",
            errors.clone(),
        );
        let abandoned = Family::<StoreLabels, Counter>::default();
        registry.register(
            "idemgate_store_calls_abandoned",
            "Store calls given up before they answered (store_timeout)",
            abandoned.clone(),
        );
        Self {
            durations,
            errors,
            abandoned,
        }
    }
}

/// Each configured route's counter for every decision, made up front so that counting a
/// request needs no lookup.
fn route_counters<'a>(
    requests: &Family<RequestLabels, Counter>,
    routes: impl IntoIterator<Item = &'a str>,
) -> RouteCounters {
    routes
        .into_iter()
        .map(|route| {
            let counters = Decision::ALL.map(|decision| {
                requests
                    .get_or_create(&RequestLabels {
                        route: route.to_owned(),
                        outcome: decision.as_str(),
                    })
                    .clone()
            });
            (Arc::from(route), counters)
        })
        .collect()
}

impl Metrics {
    /// Empty metrics.
    pub fn new() -> Arc<Self> {
        Self::with_routes([])
    }

    /// Empty metrics with a series for each decision on each of `routes` (the configured
    /// route names), counted without a lookup; requests on other routes are counted too.
    pub fn with_routes<'a>(routes: impl IntoIterator<Item = &'a str>) -> Arc<Self> {
        Self::with_routes_and(routes, |_| {})
    }

    /// [`Metrics::with_routes`], with the series `more` registers rendered before the
    /// gateway's own (the consumer's per-source series, say).
    pub fn with_routes_and<'a>(
        routes: impl IntoIterator<Item = &'a str>,
        more: impl FnOnce(&mut Registry),
    ) -> Arc<Self> {
        let mut registry = Registry::default();
        more(&mut registry);
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "idemgate_requests",
            "Requests handled, by route and the gateway's decision",
            requests.clone(),
        );
        let upstream = latency_histogram();
        registry.register(
            "idemgate_upstream_duration_seconds",
            "Time from sending a request upstream to its response head",
            upstream.clone(),
        );
        let upstream_errors = Family::<KindLabels, Counter>::default();
        registry.register(
            "idemgate_upstream_errors",
            "Upstream calls that produced no response, by kind",
            upstream_errors.clone(),
        );
        let unrouted = Family::<ReasonLabels, Counter>::default();
        registry.register(
            "idemgate_unrouted_requests",
            "Requests answered before any route saw them, by reason: malformed (400, not well-formed HTTP), too_large (431, header fields past the limits; 414, a target too long) or unsupported (501, a transfer coding other than chunked alone)",
            unrouted.clone(),
        );
        let store = StoreSeries::register(&mut registry);
        let abandoned_requests = Counter::default();
        registry.register(
            "idemgate_requests_abandoned",
            "Requests whose client went away before their response was ready (a keyed one already sent upstream still finishes and keeps its response)",
            abandoned_requests.clone(),
        );
        let open_connections = Gauge::default();
        registry.register(
            "idemgate_open_connections",
            "Client connections open now",
            open_connections.clone(),
        );
        let routes = route_counters(&requests, routes);
        Arc::new(Self {
            upstream_errors: UpstreamErrorKind::ALL.map(|kind| {
                let labels = KindLabels {
                    kind: kind.as_str(),
                };
                upstream_errors.get_or_create(&labels).clone()
            }),
            unrouted_requests: UnroutedReason::ALL.map(|reason| {
                let labels = ReasonLabels {
                    reason: reason.as_str(),
                };
                unrouted.get_or_create(&labels).clone()
            }),
            registry,
            requests,
            routes,
            upstream,
            store,
            open_connections,
            abandoned_requests,
            cut_off: AtomicBool::new(false),
        })
    }

    /// Handles on every store operation's series for `backend`.
    fn store_ops(&self, backend: &'static str) -> [StoreOpMetrics; StoreOp::ALL.len()] {
        StoreOp::ALL.map(|op| {
            let labels = StoreLabels {
                backend,
                op: op.as_str(),
            };
            StoreOpMetrics {
                duration: self.store.durations.get_or_create(&labels).clone(),
                errors: self.store.errors.get_or_create(&labels).clone(),
                abandoned: self.store.abandoned.get_or_create(&labels).clone(),
            }
        })
    }

    /// Counts one handled request.
    pub fn count_request(&self, route: &str, decision: Decision) {
        match self.routes.iter().find(|(name, _)| &**name == route) {
            Some((_, counters)) => {
                counters[decision as usize].inc();
            }
            None => {
                let labels = RequestLabels {
                    route: route.to_owned(),
                    outcome: decision.as_str(),
                };
                self.requests.get_or_create(&labels).inc();
            }
        }
    }

    /// How many requests were counted for `route` and `decision`.
    pub fn requests(&self, route: &str, decision: Decision) -> u64 {
        let labels = RequestLabels {
            route: route.to_owned(),
            outcome: decision.as_str(),
        };
        self.requests
            .get(&labels)
            .map_or(0, |counter| counter.get())
    }

    /// Records how long the upstream took to answer with a response head.
    pub fn observe_upstream(&self, elapsed: Duration) {
        self.upstream.observe(elapsed.as_secs_f64());
    }

    /// Counts an upstream call that produced no response.
    pub fn count_upstream_error(&self, kind: UpstreamErrorKind) {
        self.upstream_errors[kind as usize].inc();
    }

    /// Counts a request whose client went away before its response was ready.
    pub fn count_abandoned_request(&self) {
        self.abandoned_requests.inc();
    }

    /// Counts a request answered before any route saw it.
    pub fn count_unrouted_request(&self, reason: UnroutedReason) {
        self.unrouted_requests[reason as usize].inc();
    }

    /// Marks the requests still open as cut off by shutdown (its grace passed).
    pub fn cut_off_open_requests(&self) {
        self.cut_off.store(true, Ordering::Relaxed);
    }

    /// Whether shutdown has cut off the requests still open.
    pub fn open_requests_cut_off(&self) -> bool {
        self.cut_off.load(Ordering::Relaxed)
    }

    /// Counts a client connection opened.
    pub fn connection_opened(&self) {
        self.open_connections.inc();
    }

    /// Counts a client connection closed.
    pub fn connection_closed(&self) {
        self.open_connections.dec();
    }

    /// Writes every metric in the Prometheus text exposition format (version 0.0.4,
    /// [`CONTENT_TYPE`]): the gateway's own, then the values read at scrape time (the
    /// layer's counters, and `data_loss`, the store's [`Store::data_loss`], labelled with
    /// `backend`, the store's [`Store::backend`]).
    pub fn render(
        &self,
        backend: &'static str,
        layer: LayerCounters,
        data_loss: &DataLossStatus,
    ) -> String {
        let mut out = String::with_capacity(16 * 1024);
        // Writing to a String cannot fail.
        let _ = prometheus_text::encode(&mut out, &self.registry);
        let _ = prometheus_text::encode(&mut out, &scrape_time(backend, layer, data_loss));
        out
    }
}

/// The values read at scrape time, as a registry of constants.
fn scrape_time(
    backend: &'static str,
    layer: LayerCounters,
    data_loss: &DataLossStatus,
) -> Registry {
    let mut registry = Registry::default();
    let counters = [
        (
            "idemgate_store_errors",
            "Store calls the gateway saw fail or time out",
            layer.store_errors,
        ),
        (
            "idemgate_fenced_completions",
            "Completions refused because another owner had taken the record over",
            layer.fenced_completions,
        ),
        (
            "idemgate_unprotected_passes",
            "Requests forwarded without protection because the store was down (on_store_error = \"pass\")",
            layer.unprotected_passes,
        ),
        (
            "idemgate_signature_rejections",
            "Requests refused 401 invalid-signature by a webhook route's signature check, on every route (per route: idemgate_requests_total{outcome=\"signature_rejected\"}); nothing was claimed or forwarded",
            layer.signature_rejections,
        ),
    ];
    for (name, help, value) in counters {
        registry.register(name, help, ConstCounter::new(value));
    }
    registry.register(
        "idemgate_records_in_flight",
        "Records this gateway holds in flight now",
        ConstGauge::new(i64::try_from(layer.in_flight).unwrap_or(i64::MAX)),
    );
    let store = registry.sub_registry_with_label(("backend".into(), backend.into()));
    store.register(
        "idemgate_store_data_lost",
        "1 while the store refuses new claims because its backend lost the records it kept (a Redis restarted without persistence, say), until an operator acknowledges it (POST /admin/store/acknowledge-data-loss); 0 otherwise",
        ConstGauge::new(i64::from(data_loss.unacknowledged.is_some())),
    );
    store.register(
        "idemgate_store_data_losses",
        "Losses of the backend's data the store has found",
        ConstCounter::new(data_loss.detected),
    );
    registry
}

/// A [`Store`] that times every call of the store it wraps and counts its errors.
///
/// A call the layer abandons (its `store_timeout` passed) is counted as abandoned when its
/// future is dropped.
pub struct InstrumentedStore {
    inner: Arc<dyn Store>,
    ops: [StoreOpMetrics; StoreOp::ALL.len()],
}

impl std::fmt::Debug for InstrumentedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InstrumentedStore")
            .field("backend", &self.inner.backend())
            .finish_non_exhaustive()
    }
}

impl InstrumentedStore {
    /// Wraps `inner`, reporting into `metrics`.
    pub fn new(inner: Arc<dyn Store>, metrics: Arc<Metrics>) -> Self {
        let ops = metrics.store_ops(inner.backend());
        Self { inner, ops }
    }

    fn timed<F>(&self, op: StoreOp, call: F) -> Timed<'_, F> {
        Timed::new(&self.ops[op as usize], call)
    }
}

pin_project_lite::pin_project! {
    /// One store call, timed, its error counted, and counted as abandoned if dropped before
    /// it answers. The clock is read only once the call has to wait: a call answered at its
    /// first poll (every memory-store call) is recorded as taking no time, and a call that
    /// waits is timed from the end of its first poll until it is dropped (right after its
    /// answer, or when abandoned).
    struct Timed<'a, F> {
        #[pin]
        call: F,
        op: &'a StoreOpMetrics,
        waiting_since: Option<Instant>,
        done: bool,
    }

    impl<F> PinnedDrop for Timed<'_, F> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            let waited = this
                .waiting_since
                .map_or(Duration::ZERO, |since| since.elapsed());
            this.op.duration.observe(waited.as_secs_f64());
            if !*this.done {
                this.op.abandoned.inc();
            }
        }
    }
}

impl<'a, F> Timed<'a, F> {
    fn new(op: &'a StoreOpMetrics, call: F) -> Self {
        Self {
            call,
            op,
            waiting_since: None,
            done: false,
        }
    }
}

impl<T, F> Future for Timed<'_, F>
where
    F: Future<Output = Result<T, StoreError>>,
{
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        match this.call.poll(cx) {
            Poll::Ready(result) => {
                *this.done = true;
                if result.is_err() {
                    this.op.errors.inc();
                }
                Poll::Ready(result)
            }
            Poll::Pending => {
                this.waiting_since.get_or_insert_with(Instant::now);
                Poll::Pending
            }
        }
    }
}

#[async_trait]
impl Store for InstrumentedStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        token: OwnerToken,
        options: &ClaimOptions,
    ) -> Result<Claim, StoreError> {
        self.timed(
            StoreOp::Claim,
            self.inner.claim(key, fingerprint, token, options),
        )
        .await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        self.timed(
            StoreOp::Complete,
            self.inner.complete(key, token, completion, ttl),
        )
        .await
    }

    async fn release(&self, key: &RecordKey, token: OwnerToken) -> Result<Transition, StoreError> {
        self.timed(StoreOp::Release, self.inner.release(key, token))
            .await
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Transition, StoreError> {
        self.timed(StoreOp::Renew, self.inner.renew(key, token, lease))
            .await
    }

    async fn mark_ambiguous(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        self.timed(
            StoreOp::MarkAmbiguous,
            self.inner.mark_ambiguous(key, token, ttl),
        )
        .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.timed(StoreOp::Get, self.inner.get(key)).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.timed(StoreOp::Delete, self.inner.delete(key)).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.timed(StoreOp::Ping, self.inner.ping()).await
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn data_loss(&self) -> DataLossStatus {
        self.inner.data_loss()
    }

    async fn acknowledge_data_loss(&self) -> Result<bool, StoreError> {
        self.inner.acknowledge_data_loss().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_render_by_route_and_outcome() {
        let m = Metrics::new();
        let route: Arc<str> = Arc::from("pay\"ments");
        m.count_request(&route, Decision::Executed);
        m.count_request(&route, Decision::Executed);
        m.count_request(&route, Decision::Replayed);
        m.observe_upstream(Duration::from_millis(3));
        m.observe_upstream(Duration::from_secs(100));
        let text = m.render(
            "memory",
            LayerCounters {
                in_flight: 4,
                signature_rejections: 3,
                ..LayerCounters::default()
            },
            &DataLossStatus::default(),
        );
        for line in [
            "idemgate_requests_total{route=\"pay\\\"ments\",outcome=\"executed\"} 2\n",
            "idemgate_requests_total{route=\"pay\\\"ments\",outcome=\"replayed\"} 1\n",
            "idemgate_records_in_flight 4\n",
            "idemgate_signature_rejections_total 3\n",
            "idemgate_store_data_lost{backend=\"memory\"} 0\n",
            "idemgate_upstream_duration_seconds_bucket{le=\"0.005\"} 1\n",
            "idemgate_upstream_duration_seconds_bucket{le=\"+Inf\"} 2\n",
            "idemgate_upstream_duration_seconds_count 2\n",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
        assert_eq!(m.requests("pay\"ments", Decision::Executed), 2);
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap_or("");
            assert!(value.parse::<f64>().is_ok(), "bad sample line {line:?}");
        }
    }

    #[test]
    fn configured_routes_have_every_series_from_the_start() {
        let configured = Metrics::with_routes(["payments"]);
        configured.count_request("payments", Decision::Executed);
        configured.count_request("other", Decision::Executed);
        assert_eq!(configured.requests("payments", Decision::Executed), 1);
        assert_eq!(configured.requests("other", Decision::Executed), 1);
        let text = configured.render(
            "memory",
            LayerCounters::default(),
            &DataLossStatus::default(),
        );
        for line in [
            "idemgate_requests_total{route=\"payments\",outcome=\"executed\"} 1\n",
            "idemgate_requests_total{route=\"payments\",outcome=\"replayed\"} 0\n",
            "idemgate_requests_total{route=\"other\",outcome=\"executed\"} 1\n",
        ] {
            assert!(text.contains(line), "{line} not in:\n{text}");
        }
        assert!(
            !text.contains("route=\"other\",outcome=\"replayed\""),
            "{text}"
        );
    }

    /// A histogram's count and sum, as exposed.
    fn count_and_sum(histogram: &Histogram) -> (String, String) {
        let mut registry = Registry::default();
        registry.register("d", "d", histogram.clone());
        let mut text = String::new();
        prometheus_text::encode(&mut text, &registry).unwrap();
        let value = |name: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(name))
                .unwrap_or_else(|| panic!("no {name} in {text}"))
                .to_owned()
        };
        (value("d_count "), value("d_sum "))
    }

    /// A store call that is pending `waits` times before it answers `result`.
    fn call_after(
        waits: usize,
        result: Result<(), StoreError>,
    ) -> impl Future<Output = Result<(), StoreError>> {
        let mut left = waits;
        let mut result = Some(result);
        std::future::poll_fn(move |cx| {
            if left == 0 {
                return Poll::Ready(result.take().expect("polled after it answered"));
            }
            left -= 1;
            cx.waker().wake_by_ref();
            Poll::Pending
        })
    }

    #[tokio::test]
    async fn store_calls_are_timed_counted_and_abandonment_noted() {
        let op = StoreOpMetrics {
            duration: latency_histogram(),
            errors: Counter::default(),
            abandoned: Counter::default(),
        };
        let timed = |call| Timed::new(&op, call);
        // Answered at once: no time, and nothing abandoned.
        assert!(timed(call_after(0, Ok(()))).await.is_ok());
        assert_eq!(count_and_sum(&op.duration), ("1".into(), "0.0".into()));
        // Waiting, then failing.
        let failed = timed(call_after(
            3,
            Err(StoreError::Timeout {
                backend: "memory",
                after: Duration::from_secs(1),
            }),
        ));
        assert!(failed.await.is_err());
        assert_eq!(count_and_sum(&op.duration).0, "2");
        assert_eq!(op.errors.get(), 1);
        // Dropped while waiting.
        let mut abandoned = Box::pin(timed(call_after(5, Ok(()))));
        let noop = &mut Context::from_waker(std::task::Waker::noop());
        assert!(abandoned.as_mut().poll(noop).is_pending());
        drop(abandoned);
        assert_eq!(count_and_sum(&op.duration).0, "3");
        assert_eq!(op.abandoned.get(), 1);
        assert_eq!(op.errors.get(), 1);
    }
}
