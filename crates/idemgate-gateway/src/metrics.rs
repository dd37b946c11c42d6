//! Counters and latency histograms, written out in the Prometheus text format by the admin
//! listener. Label sets are bounded: routes come from the config, outcomes, store operations
//! and upstream error kinds are fixed lists.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use idemgate::record::{Completion, FingerprintHash, OwnerToken, Record, RecordKey};
use idemgate::response::Decision;
use idemgate::store::{Claim, ClaimOptions, DataLossStatus, Store, StoreError, Transition};

/// Upper bounds of the latency histogram buckets, in seconds.
const BUCKETS: [f64; 14] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0,
];

/// A latency histogram with fixed buckets.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|&b| secs <= b) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    /// How many observations were recorded.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn write(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += self.counts[i].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {cumulative}"
            );
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        if labels.is_empty() {
            let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
        } else {
            let _ = writeln!(
                out,
                "{name}_sum{{{labels}}} {sum}\n{name}_count{{{labels}}} {count}"
            );
        }
    }
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

#[derive(Debug, Default)]
struct StoreOpMetrics {
    duration: Histogram,
    errors: AtomicU64,
    cancelled: AtomicU64,
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
    /// Records this gateway holds in flight now.
    pub in_flight: u64,
}

/// Requests by route and decision. The configured routes' counters are plain atomics, found
/// by a scan of a few names; a route not configured (only possible through the library API)
/// is counted under a lock.
#[derive(Debug, Default)]
struct RequestCounters {
    routes: Vec<(Arc<str>, [AtomicU64; Decision::ALL.len()])>,
    others: Mutex<BTreeMap<(Arc<str>, Decision), u64>>,
}

impl RequestCounters {
    fn count(&self, route: &str, decision: Decision) {
        match self.routes.iter().find(|(name, _)| &**name == route) {
            Some((_, counts)) => {
                counts[decision as usize].fetch_add(1, Ordering::Relaxed);
            }
            None => {
                let mut others = self
                    .others
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                *others.entry((Arc::from(route), decision)).or_insert(0) += 1;
            }
        }
    }

    fn get(&self, route: &str, decision: Decision) -> u64 {
        self.snapshot()
            .get(&(Arc::from(route), decision))
            .copied()
            .unwrap_or(0)
    }

    /// Every non-zero count, ordered by route name and then decision.
    fn snapshot(&self) -> BTreeMap<(Arc<str>, Decision), u64> {
        let mut all = self
            .others
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        for (name, counts) in &self.routes {
            for (decision, count) in Decision::ALL.into_iter().zip(counts) {
                let n = count.load(Ordering::Relaxed);
                if n > 0 {
                    *all.entry((Arc::clone(name), decision)).or_insert(0) += n;
                }
            }
        }
        all
    }
}

/// Everything the gateway counts.
#[derive(Debug, Default)]
pub struct Metrics {
    requests: RequestCounters,
    upstream: Histogram,
    upstream_errors: [AtomicU64; UpstreamErrorKind::ALL.len()],
    store_ops: [StoreOpMetrics; StoreOp::ALL.len()],
    open_connections: AtomicU64,
    abandoned_requests: AtomicU64,
    unrouted_requests: [AtomicU64; UnroutedReason::ALL.len()],
    /// Set when shutdown gave up on open requests: those are cut by the gateway, not
    /// abandoned by their clients.
    cut_off: AtomicBool,
}

impl Metrics {
    /// Empty metrics.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Empty metrics with a lock-free request counter for each of `routes` (the configured
    /// route names); requests on other routes are counted too, under a lock.
    pub fn with_routes<'a>(routes: impl IntoIterator<Item = &'a str>) -> Arc<Self> {
        Arc::new(Self {
            requests: RequestCounters {
                routes: routes
                    .into_iter()
                    .map(|name| (Arc::from(name), Default::default()))
                    .collect(),
                others: Mutex::default(),
            },
            ..Self::default()
        })
    }

    /// Counts one handled request.
    pub fn count_request(&self, route: &str, decision: Decision) {
        self.requests.count(route, decision);
    }

    /// How many requests were counted for `route` and `decision`.
    pub fn requests(&self, route: &str, decision: Decision) -> u64 {
        self.requests.get(route, decision)
    }

    /// Records how long the upstream took to answer with a response head.
    pub fn observe_upstream(&self, elapsed: Duration) {
        self.upstream.observe(elapsed);
    }

    /// Counts an upstream call that produced no response.
    pub fn count_upstream_error(&self, kind: UpstreamErrorKind) {
        self.upstream_errors[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request whose client went away before its response was ready.
    pub fn count_abandoned_request(&self) {
        self.abandoned_requests.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request answered before any route saw it.
    pub fn count_unrouted_request(&self, reason: UnroutedReason) {
        self.unrouted_requests[reason as usize].fetch_add(1, Ordering::Relaxed);
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
        self.open_connections.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a client connection closed.
    pub fn connection_closed(&self) {
        self.open_connections.fetch_sub(1, Ordering::Relaxed);
    }

    /// Writes every metric in the Prometheus text exposition format (version 0.0.4); the
    /// store metrics are labelled with `backend` (the store's [`Store::backend`]), and
    /// `data_loss` is the store's [`Store::data_loss`].
    pub fn render(
        &self,
        backend: &str,
        layer: LayerCounters,
        data_loss: &DataLossStatus,
    ) -> String {
        let mut out = String::with_capacity(8 * 1024);
        out.push_str(
            "# HELP idemgate_requests_total Requests handled, by route and the gateway's decision.\n\
             # TYPE idemgate_requests_total counter\n",
        );
        for ((route, decision), n) in self.requests.snapshot() {
            let _ = writeln!(
                out,
                "idemgate_requests_total{{route=\"{}\",outcome=\"{}\"}} {n}",
                escape_label(&route),
                decision.as_str()
            );
        }
        out.push_str(
            "# HELP idemgate_upstream_duration_seconds Time from sending a request upstream to its response head.\n\
             # TYPE idemgate_upstream_duration_seconds histogram\n",
        );
        self.upstream
            .write(&mut out, "idemgate_upstream_duration_seconds", "");
        write_counters(
            &mut out,
            "idemgate_upstream_errors_total",
            "Upstream calls that produced no response, by kind.",
            UpstreamErrorKind::ALL.map(|kind| {
                let n = self.upstream_errors[kind as usize].load(Ordering::Relaxed);
                (("kind", kind.as_str()), n)
            }),
        );
        write_counters(
            &mut out,
            "idemgate_unrouted_requests_total",
            "Requests answered before any route saw them, by reason: malformed (400, not well-formed HTTP), too_large (431, header fields past the limits; 414, a target too long) or unsupported (501, a transfer coding other than chunked alone).",
            UnroutedReason::ALL.map(|reason| {
                let n = self.unrouted_requests[reason as usize].load(Ordering::Relaxed);
                (("reason", reason.as_str()), n)
            }),
        );
        out.push_str(
            "# HELP idemgate_store_duration_seconds Time one store call waited, by operation (0 if answered at once).\n\
             # TYPE idemgate_store_duration_seconds histogram\n",
        );
        for op in StoreOp::ALL {
            let labels = format!("backend=\"{backend}\",op=\"{}\"", op.as_str());
            self.store_ops[op as usize].duration.write(
                &mut out,
                "idemgate_store_duration_seconds",
                &labels,
            );
        }
        out.push_str(
            "# HELP idemgate_store_call_errors_total Store calls that returned an error, by operation.\n\
             # TYPE idemgate_store_call_errors_total counter\n",
        );
        for op in StoreOp::ALL {
            let n = self.store_ops[op as usize].errors.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "idemgate_store_call_errors_total{{backend=\"{backend}\",op=\"{}\"}} {n}",
                op.as_str()
            );
        }
        out.push_str(
            "# HELP idemgate_store_calls_abandoned_total Store calls given up before they answered (store_timeout).\n\
             # TYPE idemgate_store_calls_abandoned_total counter\n",
        );
        for op in StoreOp::ALL {
            let n = self.store_ops[op as usize]
                .cancelled
                .load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "idemgate_store_calls_abandoned_total{{backend=\"{backend}\",op=\"{}\"}} {n}",
                op.as_str()
            );
        }
        let _ = writeln!(
            out,
            "# HELP idemgate_store_data_lost 1 while the store refuses new claims because its backend lost the records it kept (a Redis restarted without persistence, say), until an operator acknowledges it (POST /admin/store/acknowledge-data-loss); 0 otherwise.\n\
             # TYPE idemgate_store_data_lost gauge\n\
             idemgate_store_data_lost{{backend=\"{backend}\"}} {}\n\
             # HELP idemgate_store_data_losses_total Losses of the backend's data the store has found.\n\
             # TYPE idemgate_store_data_losses_total counter\n\
             idemgate_store_data_losses_total{{backend=\"{backend}\"}} {}",
            u8::from(data_loss.unacknowledged.is_some()),
            data_loss.detected,
        );
        let gauges = [
            (
                "idemgate_store_errors_total",
                "counter",
                "Store calls the gateway saw fail or time out.",
                layer.store_errors,
            ),
            (
                "idemgate_requests_abandoned_total",
                "counter",
                "Requests whose client went away before their response was ready (a keyed one already sent upstream still finishes and keeps its response).",
                self.abandoned_requests.load(Ordering::Relaxed),
            ),
            (
                "idemgate_fenced_completions_total",
                "counter",
                "Completions refused because another owner had taken the record over.",
                layer.fenced_completions,
            ),
            (
                "idemgate_unprotected_passes_total",
                "counter",
                "Requests forwarded without protection because the store was down (on_store_error = \"pass\").",
                layer.unprotected_passes,
            ),
            (
                "idemgate_records_in_flight",
                "gauge",
                "Records this gateway holds in flight now.",
                layer.in_flight,
            ),
            (
                "idemgate_open_connections",
                "gauge",
                "Client connections open now.",
                self.open_connections.load(Ordering::Relaxed),
            ),
        ];
        for (name, kind, help, value) in gauges {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        }
        out
    }
}

/// A counter with one label: its help and type lines, then one line per label value.
fn write_counters<const N: usize>(
    out: &mut String,
    name: &str,
    help: &str,
    counts: [((&str, &str), u64); N],
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    for ((label, value), n) in counts {
        let _ = writeln!(out, "{name}{{{label}=\"{value}\"}} {n}");
    }
}

fn escape_label(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A [`Store`] that times every call of the store it wraps and counts its errors.
///
/// A call the layer abandons (its `store_timeout` passed) is counted as abandoned when its
/// future is dropped.
pub struct InstrumentedStore {
    inner: Arc<dyn Store>,
    metrics: Arc<Metrics>,
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
        Self { inner, metrics }
    }

    fn timed<F>(&self, op: StoreOp, call: F) -> Timed<'_, F> {
        Timed::new(&self.metrics.store_ops[op as usize], call)
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
            this.op.duration.observe(waited);
            if !*this.done {
                this.op.cancelled.fetch_add(1, Ordering::Relaxed);
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
                    this.op.errors.fetch_add(1, Ordering::Relaxed);
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
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::default();
        h.observe(Duration::from_millis(3));
        h.observe(Duration::from_millis(30));
        h.observe(Duration::from_secs(100));
        let mut out = String::new();
        h.write(&mut out, "x", "");
        assert!(out.contains("x_bucket{le=\"0.005\"} 1\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"0.05\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"60\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_count 3\n"), "{out}");
    }

    #[test]
    fn requests_render_by_route_and_outcome() {
        let m = Metrics::new();
        let route: Arc<str> = Arc::from("pay\"ments");
        m.count_request(&route, Decision::Executed);
        m.count_request(&route, Decision::Executed);
        m.count_request(&route, Decision::Replayed);
        let text = m.render(
            "memory",
            LayerCounters {
                in_flight: 4,
                ..LayerCounters::default()
            },
            &DataLossStatus::default(),
        );
        assert!(
            text.contains(
                "idemgate_requests_total{route=\"pay\\\"ments\",outcome=\"executed\"} 2\n"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "idemgate_requests_total{route=\"pay\\\"ments\",outcome=\"replayed\"} 1\n"
            ),
            "{text}"
        );
        assert!(text.contains("idemgate_records_in_flight 4\n"), "{text}");
        assert_eq!(m.requests("pay\"ments", Decision::Executed), 2);
        let configured = Metrics::with_routes(["pay\"ments"]);
        configured.count_request("pay\"ments", Decision::Executed);
        configured.count_request("other", Decision::Executed);
        assert_eq!(configured.requests("pay\"ments", Decision::Executed), 1);
        assert_eq!(configured.requests("other", Decision::Executed), 1);
        let text = configured.render(
            "memory",
            LayerCounters::default(),
            &DataLossStatus::default(),
        );
        let other = text
            .find("idemgate_requests_total{route=\"other\",outcome=\"executed\"} 1\n")
            .expect("a route not configured is counted");
        let known = text
            .find("idemgate_requests_total{route=\"pay\\\"ments\",outcome=\"executed\"} 1\n")
            .expect("a configured route is counted");
        assert!(other < known, "routes are listed by name:\n{text}");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let value = line.rsplit(' ').next().unwrap_or("");
            assert!(value.parse::<f64>().is_ok(), "bad sample line {line:?}");
        }
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
        let op = StoreOpMetrics::default();
        let timed = |call| Timed::new(&op, call);
        // Answered at once: no time, and nothing abandoned.
        assert!(timed(call_after(0, Ok(()))).await.is_ok());
        assert_eq!(
            (
                op.duration.count(),
                op.duration.sum_micros.load(Ordering::Relaxed)
            ),
            (1, 0)
        );
        // Waiting, then failing.
        let failed = timed(call_after(
            3,
            Err(StoreError::Timeout {
                backend: "memory",
                after: Duration::from_secs(1),
            }),
        ));
        assert!(failed.await.is_err());
        assert_eq!(op.duration.count(), 2);
        assert_eq!(op.errors.load(Ordering::Relaxed), 1);
        // Dropped while waiting.
        let mut abandoned = Box::pin(timed(call_after(5, Ok(()))));
        let noop = &mut Context::from_waker(std::task::Waker::noop());
        assert!(abandoned.as_mut().poll(noop).is_pending());
        drop(abandoned);
        assert_eq!(op.duration.count(), 3);
        assert_eq!(op.cancelled.load(Ordering::Relaxed), 1);
        assert_eq!(op.errors.load(Ordering::Relaxed), 1);
    }
}
