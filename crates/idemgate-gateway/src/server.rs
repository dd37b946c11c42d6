//! The listeners: the proxy (HTTP/1.1 and h2c, hardened) with the layer in front of the
//! forwarder, the admin listener, and the graceful shutdown that lets in-flight requests
//! finish and store their responses.

use std::convert::Infallible;
use std::io;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, watch};
use tower_layer::Layer;
use tower_service::Service;

use super::admin::{self, AdminState};
use super::config::{Limits, Settings, StoreSpec};
use super::forward::Forwarder;
use super::http1::codec::{chunked_alone, list_elements};
use super::http1::limits::RequestHeadLimits;
use super::http1::server::{self as own_loop, End, Prefixed, WholeBody};
use super::metrics::{InstrumentedStore, Metrics, UnroutedReason};
use super::watchdog::{Activity, ActivityIo, ClientStream, InFlight, Verdict, Watchdog};
use idemgate::body::ResponseBody;
use idemgate::response::{Outcome, Problem};
use idemgate::store::{Store, StoreError};
use idemgate::{IdempotencyLayer, LayerStats};

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// A listener could not be bound.
    #[error("cannot listen on {addr} ({what})")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The store could not be opened.
    #[error("cannot open store {spec}")]
    Store {
        /// The store as configured (without secrets).
        spec: String,
        /// Why.
        #[source]
        source: StoreError,
    },
    /// The store's directory could not be created.
    #[error("cannot create the directory for store {spec}")]
    StoreDir {
        /// The store as configured.
        spec: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The store's backend is not part of this build.
    #[error("store {spec} needs the `{feature}` feature, which this build does not have")]
    StoreFeature {
        /// The store as configured.
        spec: String,
        /// The missing Cargo feature.
        feature: &'static str,
    },
}

/// Opens the configured store. A Redis or PostgreSQL store is set up without contacting its
/// server, so that a gateway starts while the server is down; `store_timeout` bounds each of
/// its calls.
pub async fn open_store(settings: &Settings) -> Result<Arc<dyn Store>, RunError> {
    let spec = &settings.store;
    match spec {
        StoreSpec::Memory => Ok(Arc::new(idemgate::store::MemoryStore::default())),
        #[cfg(feature = "redb")]
        StoreSpec::Redb(path) => {
            let path = path.clone();
            let spec_text = spec.to_string();
            // Creating the directory and opening the file are blocking file-system work.
            let opened = tokio::task::spawn_blocking(move || {
                if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::create_dir_all(dir).map_err(|source| RunError::StoreDir {
                        spec: spec_text.clone(),
                        source,
                    })?;
                }
                idemgate::store::RedbStore::open(&path).map_err(|source| RunError::Store {
                    spec: spec_text,
                    source,
                })
            })
            .await;
            match opened {
                Ok(store) => Ok(Arc::new(store?)),
                Err(join) => Err(RunError::StoreDir {
                    spec: spec.to_string(),
                    source: io::Error::other(join),
                }),
            }
        }
        #[cfg(feature = "redis")]
        StoreSpec::Redis(url) => {
            // Start even while Redis is down: requests get 503 (or pass, as configured) and
            // /readyz fails until it answers; it coming back needs no restart.
            // The store's own bound on a call is the configured one (its default is 1 s).
            let mut config = idemgate::store::RedisStoreConfig::new(url.clone());
            config.timeout = settings.store_timeout;
            config.wait_replicas = settings.store_wait_replicas;
            // Not contacted here: `run` pings the store once it listens.
            let store = idemgate::store::RedisStore::connect_lazy(config).map_err(|source| {
                RunError::Store {
                    spec: spec.to_string(),
                    source,
                }
            })?;
            Ok(Arc::new(store))
        }
        #[cfg(feature = "postgres")]
        StoreSpec::Postgres(url) => {
            // As for Redis: start while PostgreSQL is down (503s, /readyz not ready); the
            // tables are created, or their version checked, at the first connection that
            // succeeds, and a table newer than this build fails every call, naming both
            // versions. The password comes from the URL or PGPASSWORD.
            let mut config = idemgate::store::PostgresStoreConfig::new(url.as_str());
            config.timeout = settings.store_timeout;
            if let Some(size) = settings.store_pool_size {
                config.pool_size = size;
            }
            let store = idemgate::store::PostgresStore::connect_lazy(config).map_err(|source| {
                RunError::Store {
                    spec: spec.to_string(),
                    source,
                }
            })?;
            Ok(Arc::new(store))
        }
        #[cfg(not(feature = "redb"))]
        StoreSpec::Redb(_) => Err(RunError::StoreFeature {
            spec: spec.to_string(),
            feature: "redb",
        }),
        #[cfg(not(feature = "redis"))]
        StoreSpec::Redis(_) => Err(RunError::StoreFeature {
            spec: spec.to_string(),
            feature: "redis",
        }),
        #[cfg(not(feature = "postgres"))]
        StoreSpec::Postgres(_) => Err(RunError::StoreFeature {
            spec: spec.to_string(),
            feature: "postgres",
        }),
    }
}

/// Runs the gateway until `shutdown` resolves, then drains: stops accepting, lets open
/// requests finish and store their responses within `shutdown_grace`, and returns.
///
/// Once both listeners are bound it writes one line to standard error,
/// `idemgate listening on ADDR admin ADDR`, with the addresses actually bound (useful with
/// port 0).
pub async fn run(settings: Settings, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
    let metrics = Metrics::with_routes(settings.route_names());
    let raw_store = open_store(&settings).await?;
    let first_ping = Arc::clone(&raw_store);
    let store: Arc<dyn Store> = Arc::new(InstrumentedStore::new(raw_store, Arc::clone(&metrics)));

    let layer = idempotency_layer(&settings, Arc::clone(&store));
    let stats = layer.stats();
    let forwarder = Forwarder::new(
        settings.upstream.clone(),
        settings.upstream_timeout,
        settings.upstream_connect_timeout,
        settings.upstream_idle_timeout,
        Arc::clone(&metrics),
    );
    // One service per client connection: its forwarder knows the client's address.
    let service_for = move |peer| layer.layer(forwarder.for_client(peer));

    let (listener, proxy_addr) = bind("listen", settings.listen).await?;
    let (admin_listener, admin_addr) = bind("admin_listen", settings.admin_listen).await?;
    announce(&settings, proxy_addr, admin_addr);
    // A store down at start (Redis, PostgreSQL) is reported, not fatal: requests get 503 (or
    // pass, as configured) and /readyz fails until it answers, and it coming back needs no
    // restart.
    // Pinged beside serving, so that start-up does not wait for it.
    tokio::spawn(warn_if_unreachable(
        first_ping,
        settings.store.to_string(),
        settings.store_timeout,
    ));

    let draining = Arc::new(AtomicBool::new(false));
    let admin_state = admin_state(&settings, &store, &metrics, &stats, &draining);
    let (stop_tx, stop_rx) = watch::channel(false);
    let admin_task = tokio::spawn(admin_loop(admin_listener, admin_state, stop_rx.clone()));

    let limits = settings.limits;
    let connections = Arc::new(Semaphore::new(limits.max_connections));
    let builder = proxy_builder(&limits);
    let accept = accept_loop(
        listener,
        service_for,
        Arc::clone(&metrics),
        builder,
        Arc::clone(&connections),
        FrontConfig {
            limits,
            underscores_in_headers: settings.underscores_in_headers,
        },
        stop_rx,
    );
    tokio::select! {
        () = accept => {}
        () = shutdown => {}
    }

    // The listener is dropped with the accept loop: no new connections from here on.
    tracing::info!(
        grace_ms = settings.shutdown_grace.as_millis() as u64,
        "shutting down: draining open requests"
    );
    draining.store(true, Ordering::Relaxed);
    let _ = stop_tx.send(true);
    drain(
        settings.shutdown_grace,
        &connections,
        limits.max_connections,
        &stats,
        &metrics,
    )
    .await;
    admin_task.abort();
    Ok(())
}

/// What the admin listener answers from: the store, the counters, the token, and every
/// route's policy (the default first) for the record endpoints.
pub(crate) fn admin_state(
    settings: &Settings,
    store: &Arc<dyn Store>,
    metrics: &Arc<Metrics>,
    stats: &Arc<LayerStats>,
    draining: &Arc<AtomicBool>,
) -> Arc<AdminState> {
    Arc::new(AdminState {
        store: Arc::clone(store),
        store_timeout: settings.store_timeout,
        metrics: Arc::clone(metrics),
        stats: Arc::clone(stats),
        token: settings.admin_token.clone(),
        routes: std::iter::once(settings.default_route.clone())
            .chain(settings.routes.iter().map(|r| r.policy.clone()))
            .collect(),
        draining: Arc::clone(draining),
    })
}

/// Says the gateway is up: a fixed, parseable line for scripts and tests (the log format may
/// be JSON; only messages from opening the store, a redb file's migration, can come before
/// it), then the log line with what it serves.
fn announce(settings: &Settings, proxy_addr: SocketAddr, admin_addr: SocketAddr) {
    super::logging::STDERR.print_line(format_args!(
        "idemgate listening on {proxy_addr} admin {admin_addr}"
    ));
    tracing::info!(
        listen = %proxy_addr,
        admin = %admin_addr,
        upstream = %settings.upstream.uri,
        store = %settings.store,
        routes = settings.routes.len(),
        "idemgate started"
    );
}

/// Waits, up to `grace`, for every client connection to close (each holds one of
/// `max_connections` permits) and for every keyed request still upstream to finish; past it,
/// marks what is still open as cut off by the gateway.
async fn drain(
    grace: Duration,
    connections: &Semaphore,
    max_connections: usize,
    stats: &LayerStats,
    metrics: &Metrics,
) {
    let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
    let drained = tokio::time::timeout(grace, async {
        // Every connection holds a permit: all permits back means all connections closed.
        let _all_closed = connections.acquire_many(all).await;
        // Requests whose clients hung up still run upstream and store their responses.
        while stats.in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    match drained {
        Ok(()) => tracing::info!("drained; exiting"),
        Err(_) => {
            metrics.cut_off_open_requests();
            tracing::warn!(
                open_connections = max_connections - connections.available_permits(),
                in_flight = stats.in_flight(),
                "shutdown grace passed with work still open; exiting anyway"
            );
        }
    }
}

pub(crate) async fn warn_if_unreachable(store: Arc<dyn Store>, spec: String, timeout: Duration) {
    match tokio::time::timeout(timeout, store.ping()).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(
            store = %spec,
            error = %idemgate::ErrorChain(&error),
            "store not reachable yet; serving anyway"
        ),
        Err(_) => tracing::warn!(store = %spec, "store did not answer yet; serving anyway"),
    }
}

/// The listener for `what` (the config field) on `addr`, and the address it got.
pub(crate) async fn bind(
    what: &'static str,
    addr: SocketAddr,
) -> Result<(TcpListener, SocketAddr), RunError> {
    let bound = async {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        Ok((listener, local))
    };
    bound
        .await
        .map_err(|source| RunError::Bind { what, addr, source })
}

/// The layer in front of the forwarder: every configured route, bounds on the store, and the
/// outcome left on each response's body for the request log.
pub(crate) fn idempotency_layer(settings: &Settings, store: Arc<dyn Store>) -> IdempotencyLayer {
    let mut layer = IdempotencyLayer::new(store)
        .default_route(settings.default_route.clone())
        .store_timeout(settings.store_timeout)
        // The forwarder bounds each wait on the upstream itself (see `Forwarder::new`); a
        // bound on the whole run would cut a kept response that is still arriving.
        .upstream_timeout(None)
        // The request log reads each response's outcome from its body.
        .outcome_on_body_only()
        .on_store_error(settings.on_store_error);
    for route in &settings.routes {
        layer = layer.route(route.prefix.clone(), route.policy.clone());
    }
    layer
}

fn proxy_builder(limits: &Limits) -> auto::Builder<TokioExecutor> {
    let head = RequestHeadLimits::new(limits);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        // The watchdog enforces the header timeout (see `watchdog`): hyper's own would set a
        // timer per request.
        .header_read_timeout(None)
        // hyper's own limits sit above the configured ones, which the front service checks
        // and answers with a problem response; only a request past hyper's gets its bare 431.
        .max_buf_size(head.hyper_max_buf_size())
        // Head and body in one buffer, written with one plain write: for the small answers
        // a gateway mostly carries, copying the body costs less than queueing it for a
        // vectored write (about 600 instructions per request less, by callgrind).
        .writev(false)
        // hyper would otherwise read the client's socket while a request is in progress, to
        // notice a hang-up; that read reserves room in the read buffer the request still
        // shares, a fresh 8 KiB buffer per request (about 1 000 instructions of each). The
        // connection task looks for the hang-up itself (`serve_connection`).
        .half_close(true)
        .keep_alive(true);
    if let Some(max_headers) = head.hyper_max_headers() {
        builder.http1().max_headers(max_headers);
    }
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(head.hyper_h2_max_header_list_size())
        .keep_alive_interval(limits.idle_timeout / 2)
        .keep_alive_timeout(limits.header_read_timeout);
    builder
}

/// A client connection's service: it takes requests whose bodies hyper reads, and requests
/// that arrived whole through the gateway's own HTTP/1.1 loop (see `http1::server`).
trait ConnectionService<B>: Service<Request<Incoming>, Response = Response<B>, Error = Infallible, Future: Send + 'static>
    + Service<Request<WholeBody>, Response = Response<B>, Error = Infallible, Future: Send + 'static>
    + Clone
    + Send
    + 'static
{
}

impl<S, B> ConnectionService<B> for S where
    S: Service<
            Request<Incoming>,
            Response = Response<B>,
            Error = Infallible,
            Future: Send + 'static,
        > + Service<
            Request<WholeBody>,
            Response = Response<B>,
            Error = Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

async fn accept_loop<S, B>(
    listener: TcpListener,
    service_for: impl Fn(SocketAddr) -> S,
    metrics: Arc<Metrics>,
    builder: auto::Builder<TokioExecutor>,
    connections: Arc<Semaphore>,
    config: FrontConfig,
    stop: watch::Receiver<bool>,
) where
    S: ConnectionService<B>,
    B: http_body::Body<Data = Bytes> + FrontBody + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let FrontConfig {
        limits,
        underscores_in_headers,
    } = config;
    loop {
        // At the limit, stop accepting until a connection closes; the kernel's backlog holds
        // the rest.
        let Ok(permit) = Arc::clone(&connections).acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let front = Front {
            inner: service_for(peer),
            peer,
            metrics: Arc::clone(&metrics),
            limits,
            underscores_in_headers,
            activity: Arc::new(Activity::default()),
        };
        let builder = builder.clone();
        let stop = stop.clone();
        let metrics = Arc::clone(&metrics);
        tokio::spawn(async move {
            metrics.connection_opened();
            serve_connection(stream, front, &builder, limits, stop).await;
            metrics.connection_closed();
            drop(permit);
        });
    }
}

/// What every client connection's front service is configured with.
#[derive(Clone, Copy)]
struct FrontConfig {
    limits: Limits,
    /// Forward request fields whose names contain `_`.
    underscores_in_headers: bool,
}

/// hyper serving a client connection the gateway's own loop handed over.
type HyperConnection<'a, S> =
    Pin<Box<auto::Connection<'a, TokioIo<Prefixed>, Front<S>, TokioExecutor>>>;

/// Why a client connection ended with an error: hyper's, or its I/O's.
type ConnectionError = Box<dyn std::error::Error + Send + Sync>;

/// Serves one client connection: plain HTTP/1.1 requests through the gateway's own loop
/// (`http1::server`), the rest of the connection through hyper from the first request that
/// is not plain (HTTP/2 included); under the watchdog, the stop signal, and the look for a
/// client's hang-up.
async fn serve_connection<S, B>(
    stream: TcpStream,
    front: Front<S>,
    builder: &auto::Builder<TokioExecutor>,
    limits: Limits,
    mut stop: watch::Receiver<bool>,
) where
    S: ConnectionService<B>,
    B: http_body::Body<Data = Bytes> + FrontBody + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let activity = Arc::clone(&front.activity);
    let metrics = Arc::clone(&front.metrics);
    let stream = ClientStream::new(stream);
    let io = ActivityIo::new(stream.clone(), Arc::clone(&activity));
    // A graceful close of the gateway's own loop: it ends between requests.
    let own_closing = AtomicBool::new(false);
    let own_front = front.clone();
    let own = own_loop::serve(
        io,
        &own_closing,
        RequestHeadLimits::new(&limits).own_max_head(),
        move |req| hyper::service::Service::call(&own_front, req),
    );
    tokio::pin!(own);
    let mut serving = Serving {
        own,
        own_closing: &own_closing,
        hyper: None,
        front: Some(front),
        builder,
        closing: false,
        body: PhantomData,
    };
    // The stop signal and the watchdog are registered with the task once; after that each
    // wake-up of the connection (nearly all of them I/O) only looks at two flags instead of
    // polling both.
    let probe = stop.clone();
    if *stop.borrow_and_update() {
        serving.close_gracefully();
    }
    let changed = stop.changed();
    tokio::pin!(changed);
    let mut stop = StopSignal {
        probe,
        changed,
        registered: false,
    };
    // The watchdog looks at the connection a few times per limit instead of every read and
    // write reading the clock or setting a timer.
    let opened = Instant::now();
    let (watchdog, first_look) = Watchdog::new(limits, opened);
    let check = tokio::time::sleep_until(tokio::time::Instant::from_std(opened) + first_look);
    tokio::pin!(check);
    let mut looks = WatchdogLooks {
        watchdog,
        check,
        registered: false,
    };
    let result = std::future::poll_fn(|cx| {
        poll_connection(cx, &mut serving, &activity, &stream, &mut stop, &mut looks)
    })
    .await;
    if let Err(error) = result {
        count_unrouted(&metrics, &error);
        tracing::debug!(error = %error, "client connection ended with an error");
    }
}

/// One wake-up of a client connection: serve it, then look for a client's hang-up, the stop
/// signal and the watchdog's verdict, until none of them has more to do now.
#[inline]
fn poll_connection<S, B, F, C>(
    cx: &mut Context<'_>,
    serving: &mut Serving<'_, S, B, F>,
    activity: &Activity,
    stream: &ClientStream,
    stop: &mut StopSignal<'_, C>,
    looks: &mut WatchdogLooks<'_>,
) -> Poll<Result<(), ConnectionError>>
where
    S: ConnectionService<B>,
    B: http_body::Body<Data = Bytes> + FrontBody + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    F: Future<Output = End>,
    C: Future,
{
    loop {
        if let Poll::Ready(result) = serving.poll(cx) {
            return Poll::Ready(result);
        }
        // A client that hangs up on its HTTP/1.1 request ends the connection, which drops
        // the request: a pass-through call is cancelled, a keyed request's work goes on
        // and keeps its response for the retry. (hyper, set to allow half-closed
        // connections, does not read until the response is written; an HTTP/2 client
        // resets its stream instead.) Looked for while the response is not ready yet. A
        // client that closes only its sending side after its request counts as gone too,
        // as it did with hyper's own look; so does one that pipelined more requests before
        // closing it, none of which is answered (hyper's look answered the first).
        if activity.awaits_http1_response() && stream.poll_hung_up(cx) {
            tracing::debug!("client hung up with a request in progress");
            return Poll::Ready(Ok(()));
        }
        if !serving.closing && stop.poll_stopped(cx) {
            serving.close_gracefully();
            continue;
        }
        match looks.poll_look(cx, activity) {
            None => return Poll::Pending,
            // An HTTP/1.1 request in progress still gets its response first, as long as
            // it keeps moving: the watchdog goes on looking.
            Some(Verdict::Close(_)) => serving.close_gracefully(),
            Some(Verdict::LookIn(_)) => {}
            Some(Verdict::Cut) => {
                tracing::debug!(
                    "connection cut: no request head in time, or no bytes moving after a close"
                );
                return Poll::Ready(Ok(()));
            }
        }
    }
}

/// Whichever of the two serves a client connection: the gateway's own loop, then hyper once
/// the loop has handed the connection over (at most once).
struct Serving<'a, S, B, F>
where
    S: ConnectionService<B>,
    B: http_body::Body<Data = Bytes> + FrontBody + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    own: Pin<&'a mut F>,
    /// Set to end the own loop between requests.
    own_closing: &'a AtomicBool,
    hyper: Option<HyperConnection<'a, S>>,
    /// Moved to hyper at the hand-over.
    front: Option<Front<S>>,
    builder: &'a auto::Builder<TokioExecutor>,
    /// The connection is closing gracefully.
    closing: bool,
    body: PhantomData<fn() -> B>,
}

impl<S, B, F> Serving<'_, S, B, F>
where
    S: ConnectionService<B>,
    B: http_body::Body<Data = Bytes> + FrontBody + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    F: Future<Output = End>,
{
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ConnectionError>> {
        loop {
            if let Some(conn) = &mut self.hyper {
                return conn.as_mut().poll(cx);
            }
            match std::task::ready!(self.own.as_mut().poll(cx)) {
                End::Closed => return Poll::Ready(Ok(())),
                End::Handover(io) => {
                    let Some(front) = self.front.take() else {
                        return Poll::Ready(Ok(()));
                    };
                    let mut conn = Box::pin(self.builder.serve_connection(TokioIo::new(io), front));
                    if self.closing {
                        conn.as_mut().graceful_shutdown();
                    }
                    self.hyper = Some(conn);
                }
            }
        }
    }

    /// Closes the connection gracefully, once: the own loop between requests, hyper as it
    /// does.
    fn close_gracefully(&mut self) {
        if std::mem::replace(&mut self.closing, true) {
            return;
        }
        match &mut self.hyper {
            Some(conn) => conn.as_mut().graceful_shutdown(),
            None => self.own_closing.store(true, Ordering::Relaxed),
        }
    }
}

/// The gateway's stop signal, as one connection looks at it.
struct StopSignal<'a, F> {
    /// Answers whether the signal changed without polling it.
    probe: watch::Receiver<bool>,
    changed: Pin<&'a mut F>,
    /// `changed` was polled once: the task is woken when the signal changes.
    registered: bool,
}

impl<F: Future> StopSignal<'_, F> {
    fn poll_stopped(&mut self, cx: &mut Context<'_>) -> bool {
        if self.registered {
            return self.probe.has_changed().unwrap_or(true);
        }
        self.registered = true;
        // Outside the task's cooperative budget: a poll refused for want of budget would
        // register nothing, and the connection's loop does not poll it again.
        Pin::new(&mut tokio::task::unconstrained(self.changed.as_mut()))
            .poll(cx)
            .is_ready()
    }
}

/// The watchdog's looks at one connection, each at a timer's deadline.
struct WatchdogLooks<'a> {
    watchdog: Watchdog,
    check: Pin<&'a mut tokio::time::Sleep>,
    /// `check` was polled for its deadline: the task is woken when it fires.
    registered: bool,
}

impl WatchdogLooks<'_> {
    /// The watchdog's verdict once the timer has fired (the timer then set for the next
    /// look), `None` before.
    fn poll_look(&mut self, cx: &mut Context<'_>, activity: &Activity) -> Option<Verdict> {
        if self.registered && !self.check.is_elapsed() {
            return None;
        }
        self.registered = true;
        if Pin::new(&mut tokio::task::unconstrained(self.check.as_mut()))
            .poll(cx)
            .is_pending()
        {
            return None;
        }
        let now = Instant::now();
        let verdict = self.watchdog.look(activity, now);
        if let Verdict::LookIn(wait) | Verdict::Close(wait) = verdict {
            self.check
                .as_mut()
                .reset(tokio::time::Instant::from_std(now) + wait);
            self.registered = false;
        }
        Some(verdict)
    }
}

/// Counts a request hyper has answered by itself, one it could not parse or one past its own
/// limits: no route saw it.
fn count_unrouted(metrics: &Metrics, error: &ConnectionError) {
    if let Some(error) = error.downcast_ref::<hyper::Error>()
        && error.is_parse()
    {
        metrics.count_unrouted_request(if error.is_parse_too_large() {
            UnroutedReason::TooLarge
        } else {
            UnroutedReason::Malformed
        });
    }
}

/// The outermost per-connection service: refuses a request it will not forward (see
/// [`refusal`]), drops request fields whose names contain `_` (unless configured not to),
/// and logs and counts what the layer decided.
#[derive(Clone)]
struct Front<S> {
    inner: S,
    /// The client.
    peer: SocketAddr,
    metrics: Arc<Metrics>,
    limits: Limits,
    /// Forward request fields whose names contain `_` (see [`drop_underscored_fields`]).
    underscores_in_headers: bool,
    /// The connection's activity, for the watchdog.
    activity: Arc<Activity>,
}

/// What the front service needs of a response body: to answer a problem with one, and to
/// find the layer's outcome on it (the proxy's layer leaves it there instead of in the
/// extensions).
trait FrontBody {
    fn problem(body: Bytes) -> Self;
    fn outcome(&self) -> Option<&Outcome>;
}

impl<B> FrontBody for ResponseBody<B> {
    fn problem(body: Bytes) -> Self {
        ResponseBody::full(body)
    }

    fn outcome(&self) -> Option<&Outcome> {
        ResponseBody::outcome(self)
    }
}

/// `431 headers-too-large` for a request with more header fields than `max_headers`, or a
/// larger header block (request line and fields) than `max_header_bytes`.
fn over_header_limits<B>(req: &Request<B>, limits: &Limits) -> Option<Problem> {
    // As sent: `METHOD TARGET HTTP/1.1\r\n`, and `NAME: VALUE\r\n` per field.
    let uri = req.uri();
    let origin = uri.authority().map_or(0, |authority| {
        uri.scheme_str().map_or(0, |scheme| scheme.len() + 3) + authority.as_str().len()
    });
    let target = origin + uri.path_and_query().map_or(1, |p| p.as_str().len());
    let line = req.method().as_str().len() + target + 11;
    let block = req.headers().iter().fold(line, |sum, (name, value)| {
        sum + name.as_str().len() + value.len() + 4
    });
    RequestHeadLimits::new(limits).refuse(req.headers().len(), block)
}

/// Why the front service answers `req` itself, forwarding nothing, if it does: header fields
/// past the limits, a method or target the gateway does not forward, a `Host` that does not
/// name one host, or a body framed with a transfer coding it cannot forward. The same for
/// every request, whether the gateway's own HTTP/1.1 loop or hyper read it.
fn refusal<B: http_body::Body>(
    req: &Request<B>,
    limits: &Limits,
) -> Option<(Problem, UnroutedReason)> {
    if let Some(problem) = over_header_limits(req, limits) {
        return Some((problem, UnroutedReason::TooLarge));
    }
    if req.method() == http::Method::CONNECT {
        return Some((
            Problem::unsupported_method(req.method()),
            UnroutedReason::Unsupported,
        ));
    }
    if let Some(problem) = malformed_target_or_host(req) {
        return Some((problem, UnroutedReason::Malformed));
    }
    // Only a body of unknown length (chunked) can have come with a transfer coding.
    if http_body::Body::size_hint(req.body()).exact().is_none() {
        return unsupported_transfer_coding(req)
            .map(|problem| (problem, UnroutedReason::Unsupported));
    }
    None
}

/// `400 malformed-request` for a request whose target or `Host` does not say what it is for
/// (RFC 9112 §3.2): an HTTP/1.1 request without `Host`, any request with more than one, or
/// with one that is not `host[:port]` (empty is allowed: a target without an authority). Over
/// HTTP/2 the authority comes in `:authority`, so no `Host` is needed; one that is sent must
/// name the same (RFC 9113 §8.3.1). The asterisk target (`*`) is for `OPTIONS` alone.
fn malformed_target_or_host<B>(req: &Request<B>) -> Option<Problem> {
    let uri = req.uri();
    if uri.authority().is_none() && uri.path() == "*" && req.method() != http::Method::OPTIONS {
        return Some(Problem::malformed_request(
            "the asterisk target (*) is for OPTIONS only",
        ));
    }
    let mut hosts = req.headers().get_all(http::header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Some(Problem::malformed_request(
            "the request has more than one Host field",
        ));
    }
    let Some(host) = host else {
        return (req.version() == http::Version::HTTP_11)
            .then(|| Problem::malformed_request("an HTTP/1.1 request must have a Host field"));
    };
    let host = host.as_bytes();
    if host.is_empty() {
        return None;
    }
    // Nearly every Host is a name or an IPv4 address, with or without a port: accepted as
    // such without the full parse, which copies the value into an `Authority` of its own.
    if req.version() != http::Version::HTTP_2 && is_plain_host_and_port(host) {
        return None;
    }
    // An authority without userinfo: `host[:port]`.
    let Some(authority) = (!host.contains(&b'@'))
        .then(|| http::uri::Authority::try_from(host).ok())
        .flatten()
    else {
        return Some(Problem::malformed_request(
            "the Host field is not a host and an optional port",
        ));
    };
    if req.version() == http::Version::HTTP_2
        && uri.authority().is_some_and(|named| named != &authority)
    {
        return Some(Problem::malformed_request(
            "the Host field names another authority than :authority",
        ));
    }
    None
}

/// Whether `host` is a registered name or IPv4 address (letters, digits, `.` and `-`, not
/// empty) with at most one `:` and then a port of one to five digits: a valid `host[:port]`
/// of the kind nearly every request sends. Anything else (an IPv6 literal, percent-encoding,
/// sub-delimiters) goes to the full parse.
fn is_plain_host_and_port(host: &[u8]) -> bool {
    let (name, port) = match host.iter().position(|&b| b == b':') {
        Some(colon) => (&host[..colon], Some(&host[colon + 1..])),
        None => (host, None),
    };
    !name.is_empty()
        && name
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
        && port
            .is_none_or(|port| (1..=5).contains(&port.len()) && port.iter().all(u8::is_ascii_digit))
}

/// Removes the request fields whose names contain `_`, before the layer or the upstream sees
/// them, as nginx does by default (`underscores_in_headers off`). Many upstreams (CGI, and
/// the frameworks that follow its naming: PHP, Rack, WSGI) read `X-Forwarded-For` and
/// `X_Forwarded_For` alike as `HTTP_X_FORWARDED_FOR`, and some take `Transfer_Encoding` or
/// `Content_Length` for the framing fields: a client could pass a field the gateway sets
/// (or frames by) under a name it does not recognise.
fn drop_underscored_fields(headers: &mut http::HeaderMap) {
    // Nearly every request has none: one look at each name.
    let underscored = |name: &http::HeaderName| name.as_str().as_bytes().contains(&b'_');
    if !headers.keys().any(underscored) {
        return;
    }
    let names: Vec<http::HeaderName> = headers.keys().filter(|n| underscored(n)).cloned().collect();
    tracing::debug!(fields = ?names, "request fields with '_' in their names dropped");
    for name in names {
        headers.remove(name);
    }
}

/// `501 unsupported-transfer-coding` for a request whose `Transfer-Encoding` is anything but
/// `chunked` alone (RFC 9112 §6.1). The HTTP layer takes the chunked framing off; a coding
/// under it (`gzip, chunked`) would be left on the body, and the body forwarded as if plain.
fn unsupported_transfer_coding<B>(req: &Request<B>) -> Option<Problem> {
    let mut codings = list_elements(req.headers(), &http::header::TRANSFER_ENCODING);
    codings.next()?;
    (!chunked_alone(req.headers())).then(Problem::unsupported_transfer_coding)
}

impl<S, B, RB> hyper::service::Service<Request<RB>> for Front<S>
where
    S: Service<Request<RB>, Response = Response<B>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: FrontBody + Send + 'static,
    RB: http_body::Body + Send + 'static,
{
    type Response = Response<B>;
    type Error = Infallible;
    type Future = FrontFuture<S::Future, B>;

    fn call(&self, mut req: Request<RB>) -> Self::Future {
        let refused = refusal(&req, &self.limits);
        if !self.underscores_in_headers {
            drop_underscored_fields(req.headers_mut());
        }
        let log = RequestLog {
            method: req.method().clone(),
            // A clone of the URI shares its bytes; the path is cut to length only if logged.
            uri: req.uri().clone(),
            // The clock is read only for a line that can be written (every request's line
            // is `info` or `debug`).
            started: tracing::enabled!(tracing::Level::INFO).then(Instant::now),
            metrics: Arc::clone(&self.metrics),
            peer: self.peer,
            written: false,
            _in_flight: self.activity.request_started(req.version()),
        };
        if let Some((problem, reason)) = refused {
            self.metrics.count_unrouted_request(reason);
            let response = problem.into_response().map(B::problem);
            return FrontFuture {
                call: Call::Refused {
                    answer: std::future::ready(Ok(response)),
                },
                log,
            };
        }
        let mut inner = self.inner.clone();
        // The layer in front of the forwarder is always ready; a service that is not yet gets
        // a task-owned wait.
        let noop = &mut Context::from_waker(std::task::Waker::noop());
        let call = match inner.poll_ready(noop) {
            Poll::Ready(Ok(())) => Call::Called {
                future: inner.call(req),
            },
            Poll::Pending => Call::Waiting {
                future: Box::pin(async move {
                    std::future::poll_fn(|cx| inner.poll_ready(cx)).await?;
                    inner.call(req).await
                }),
            },
        };
        FrontFuture { call, log }
    }
}

type BoxedCall<B> = Pin<Box<dyn Future<Output = Result<Response<B>, Infallible>> + Send>>;

pin_project_lite::pin_project! {
    /// A request in the front service: the layer's future, then its log line.
    struct FrontFuture<F, B> {
        #[pin]
        call: Call<F, B>,
        log: RequestLog,
    }
}

pin_project_lite::pin_project! {
    #[project = CallProj]
    enum Call<F, B> {
        Called { #[pin] future: F },
        Waiting { future: BoxedCall<B> },
        Refused { #[pin] answer: std::future::Ready<Result<Response<B>, Infallible>> },
    }
}

impl<F, B> Future for FrontFuture<F, B>
where
    F: Future<Output = Result<Response<B>, Infallible>>,
    B: FrontBody,
{
    type Output = Result<Response<B>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let Ok(response) = std::task::ready!(match this.call.project() {
            CallProj::Called { future } => future.poll(cx),
            CallProj::Waiting { future } => future.as_mut().poll(cx),
            CallProj::Refused { answer } => answer.poll(cx),
        });
        this.log.write(&response);
        Poll::Ready(Ok(response))
    }
}

/// What a request's log line and counters need from its start.
struct RequestLog {
    method: http::Method,
    uri: http::Uri,
    /// When the request came, if its log line can be written.
    started: Option<Instant>,
    metrics: Arc<Metrics>,
    peer: SocketAddr,
    /// Whether the line was written: a request dropped without one was abandoned.
    written: bool,
    /// Marks the request open for the watchdog until its response is ready.
    _in_flight: InFlight,
}

impl RequestLog {
    fn latency_ms(&self) -> f64 {
        self.started
            .map_or(0.0, |started| started.elapsed().as_micros() as f64 / 1000.0)
    }

    /// Counts the request by route and decision, and writes its log line.
    fn write<B: FrontBody>(&mut self, response: &Response<B>) {
        self.written = true;
        let method = &self.method;
        let path = LoggedPath(self.uri.path());
        let client = self.peer.ip();
        let status = response.status().as_u16();
        let latency_ms = self.latency_ms();
        let Some(outcome) = response.body().outcome() else {
            tracing::info!(%method, %path, status, latency_ms, %client, "request");
            return;
        };
        let decision = outcome.decision.as_str();
        self.metrics.count_request(&outcome.route, outcome.decision);
        let record = LoggedRecord(outcome.record);
        if outcome.decision == idemgate::response::Decision::PassedThrough {
            tracing::debug!(route = %outcome.route, outcome = %decision, status, latency_ms, %method, %path, %client, "request");
        } else {
            tracing::info!(route = %outcome.route, outcome = %decision, status, latency_ms, %record, %method, %path, %client, "request");
        }
    }
}

impl Drop for RequestLog {
    /// A request dropped before its response was ready: its client closed the connection (or
    /// reset the HTTP/2 stream). A keyed request's work goes on without it and its response is
    /// kept for the retry; nothing else will log it. Not when shutdown cut it off (logged
    /// with the open count) or a panic unwinds it (logged by the panic).
    fn drop(&mut self) {
        if self.written || std::thread::panicking() || self.metrics.open_requests_cut_off() {
            return;
        }
        self.metrics.count_abandoned_request();
        tracing::info!(
            method = %self.method,
            path = %LoggedPath(self.uri.path()),
            latency_ms = self.latency_ms(),
            client = %self.peer.ip(),
            "request abandoned: the client went away before the response"
        );
    }
}

/// A request path in a log line, cut to 200 characters. Formatted only when the line is
/// written, so a request whose line is filtered out costs no string.
struct LoggedPath<'a>(&'a str);

impl std::fmt::Display for LoggedPath<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let cut = self
            .0
            .char_indices()
            .nth(200)
            .map_or(self.0, |(at, _)| &self.0[..at]);
        f.write_str(cut)
    }
}

/// A record key in a log line (its short hash, or `-`), formatted only when written.
struct LoggedRecord(Option<idemgate::record::RecordKey>);

impl std::fmt::Display for LoggedRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(record) => f.write_str(&record.short()),
            None => f.write_str("-"),
        }
    }
}

pub(crate) async fn admin_loop(
    listener: TcpListener,
    state: Arc<AdminState>,
    mut stop: watch::Receiver<bool>,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(10))
        .max_buf_size(64 * 1024);
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            // Keep answering /metrics and /readyz while draining; stop only if the sender is
            // gone.
            changed = stop.changed() => {
                if changed.is_err() {
                    return;
                }
                continue;
            }
        };
        let state = Arc::clone(&state);
        let conn = builder.serve_connection(
            TokioIo::new(stream),
            hyper::service::service_fn(move |req| admin::handle(Arc::clone(&state), req)),
        );
        tokio::spawn(async move {
            if let Err(error) = conn.await {
                tracing::debug!(%error, "admin connection ended with an error");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed_with(fields: &[&str]) -> Request<()> {
        let mut req = Request::new(());
        for field in fields {
            req.headers_mut().append(
                http::header::TRANSFER_ENCODING,
                http::HeaderValue::from_str(field).unwrap(),
            );
        }
        req
    }

    fn with_hosts(version: http::Version, target: &str, hosts: &[&str]) -> Request<()> {
        let mut req = Request::builder().version(version).uri(target);
        for host in hosts {
            req = req.header(http::header::HOST, *host);
        }
        req.body(()).unwrap()
    }

    /// The fast path for a plain `host[:port]` never accepts what the full parse refuses.
    #[test]
    fn a_plain_host_is_one_the_full_parse_takes() {
        for host in [
            "api.example",
            "api.example:8080",
            "127.0.0.1:1",
            "a-b.c:65535",
            "x:0",
            "a:99999",
        ] {
            assert!(http::uri::Authority::try_from(host).is_ok(), "{host}");
            assert!(is_plain_host_and_port(host.as_bytes()), "{host}");
        }
        for host in [
            "", ":80", "a:", "a:123456", "a:8o", "a b", "[::1]", "a@b", "a/b", "a:1:2",
        ] {
            assert!(!is_plain_host_and_port(host.as_bytes()), "{host}");
        }
        proptest::proptest!(|(host in "[a-zA-Z0-9.:\\-]{0,12}")| {
            if is_plain_host_and_port(host.as_bytes()) {
                proptest::prop_assert!(
                    http::uri::Authority::try_from(host.as_bytes()).is_ok(),
                    "{}", host
                );
            }
        });
    }

    #[test]
    fn a_request_must_name_one_host_and_http11_must_send_it() {
        use http::Version;
        let fine = [
            (Version::HTTP_11, "/v1", &["api.example"][..]),
            (Version::HTTP_11, "/v1", &["api.example:8080"]),
            (Version::HTTP_11, "/v1", &["[::1]:8080"]),
            (Version::HTTP_11, "/v1", &[""]),
            (
                Version::HTTP_11,
                "http://other.example/v1",
                &["api.example"],
            ),
            (Version::HTTP_10, "/v1", &[]),
            (Version::HTTP_2, "http://api.example/v1", &[]),
            (Version::HTTP_2, "http://api.example/v1", &["API.example"]),
        ];
        for (version, target, hosts) in fine {
            let req = with_hosts(version, target, hosts);
            assert!(
                malformed_target_or_host(&req).is_none(),
                "{version:?} {target} {hosts:?}"
            );
        }
        let malformed = [
            (Version::HTTP_11, "/v1", &[][..]),
            (Version::HTTP_11, "/v1", &["a.example", "a.example"]),
            (Version::HTTP_10, "/v1", &["a.example", "b.example"]),
            (
                Version::HTTP_2,
                "http://api.example/v1",
                &["a.example", "a.example"],
            ),
            (Version::HTTP_11, "/v1", &["user@a.example"]),
            (Version::HTTP_11, "/v1", &["a.example/path"]),
            (Version::HTTP_11, "/v1", &["a example"]),
            (Version::HTTP_2, "http://api.example/v1", &["other.example"]),
        ];
        for (version, target, hosts) in malformed {
            let req = with_hosts(version, target, hosts);
            let problem = malformed_target_or_host(&req);
            assert_eq!(
                problem.map(|p| p.kind()),
                Some(idemgate::response::ProblemKind::MalformedRequest),
                "{version:?} {target} {hosts:?}"
            );
        }
    }

    #[test]
    fn connect_and_an_asterisk_without_options_are_refused_before_anything_else() {
        let limits = Limits {
            max_connections: 16,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            max_headers: 64,
            max_header_bytes: 64 * 1024,
        };
        let req = |method: http::Method, target: &str| {
            Request::builder()
                .method(method)
                .uri(target)
                .header(http::header::HOST, "x")
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap()
        };
        let refused = |req| refusal(&req, &limits).map(|(p, reason)| (p.status().as_u16(), reason));
        assert_eq!(
            refused(req(http::Method::CONNECT, "example.com:443")),
            Some((501, UnroutedReason::Unsupported))
        );
        assert_eq!(
            refused(req(http::Method::GET, "*")),
            Some((400, UnroutedReason::Malformed))
        );
        assert_eq!(refused(req(http::Method::OPTIONS, "*")), None);
        assert_eq!(refused(req(http::Method::POST, "/v1")), None);
    }

    #[test]
    fn fields_with_underscores_are_dropped_and_the_others_kept() {
        let mut headers = http::HeaderMap::new();
        for (name, value) in [
            ("host", "x"),
            ("transfer_encoding", "chunked"),
            ("x-forwarded-for", "10.0.0.1"),
            ("x_forwarded_for", "6.6.6.6"),
            ("x_forwarded_for", "7.7.7.7"),
            ("content_length", "5"),
            ("x-api-key", "k"),
        ] {
            headers.append(
                http::HeaderName::from_static(name),
                http::HeaderValue::from_static(value),
            );
        }
        drop_underscored_fields(&mut headers);
        let mut names: Vec<&str> = headers.keys().map(http::HeaderName::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["host", "x-api-key", "x-forwarded-for"]);
        assert_eq!(headers["x-forwarded-for"], "10.0.0.1");
    }

    #[test]
    fn only_chunked_alone_is_a_transfer_coding_the_proxy_forwards() {
        for fields in [
            &[][..],
            &["chunked"],
            &["Chunked"],
            &[" chunked ,"],
            &["", "chunked"],
        ] {
            assert!(
                unsupported_transfer_coding(&framed_with(fields)).is_none(),
                "{fields:?}"
            );
        }
        for fields in [
            &["gzip, chunked"][..],
            &["gzip", "chunked"],
            &["chunked, chunked"],
            &["identity"],
            &["chunked;ext=1"],
        ] {
            let problem = unsupported_transfer_coding(&framed_with(fields));
            assert_eq!(
                problem.map(|p| p.status()),
                Some(http::StatusCode::NOT_IMPLEMENTED),
                "{fields:?}"
            );
        }
    }
}
