//! `idemgate consume`: the idempotent consumer. Reads queued messages (a Redis stream,
//! through a consumer group) and delivers each to an HTTP handler through the proxy's own
//! layer, store and forwarder, so a message delivered twice — a producer's retry, a
//! redelivery after a crash, a consumer taking over a dead one's entries — runs the handler
//! once. docs/consume.md is the user's page.
//!
//! - [`config`]: `[[sources]]` and the `consume` flags.
//! - [`source`]: the [`Source`] trait a broker implements.
//! - `redis_stream`: the Redis Streams source.
//! - [`message`]: an entry's key and body.
//! - [`deliver`]: one try, and what its outcome means for the entry.
//! - `keys`, `runner`: per-key order, bounded concurrency, retries, drain.
//! - [`metrics`]: the per-source series.

pub mod config;
pub mod deliver;
mod keys;
pub mod message;
pub mod metrics;
#[cfg(feature = "redis")]
mod redis_stream;
mod runner;
pub mod source;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use http::{HeaderName, Method, Uri};
use tokio::sync::watch;
use tower_layer::Layer;

use self::config::{ConsumeSettings, SourceSettings};
use self::deliver::Deliverer;
use self::message::Reading;
use self::metrics::ConsumerMetrics;
use self::runner::Runner;
use self::source::{Source, SourceError};
use crate::config::Upstream;
use crate::forward::Forwarder;
use crate::metrics::{InstrumentedStore, Metrics};
use crate::server::{self, RunError};
use idemgate::policy::KeySource;
use idemgate::store::Store;
use idemgate::{IdempotencyLayer, RoutePolicy};

/// Why the consumer could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumeError {
    /// The store or the admin listener could not be set up, as for the proxy.
    #[error(transparent)]
    Start(#[from] RunError),
    /// The route the handler's path falls on cannot protect queued messages.
    #[error("source {source_name}: the handler's route {route:?} {why}")]
    Route {
        /// The source, without credentials.
        source_name: String,
        /// The route's name.
        route: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A source could not be set up.
    #[error("cannot open source {source_name}")]
    Source {
        /// The source, without credentials.
        source_name: String,
        /// Why.
        #[source]
        source: SourceError,
    },
}

/// Runs every source until `shutdown` resolves, then drains: stops reading, lets the tries in
/// flight finish and settles what they settled, within `shutdown_grace`.
///
/// Once the admin listener is bound it writes one line to standard error,
/// `idemgate consuming SOURCE[, SOURCE…] admin ADDR`.
pub async fn run(
    settings: ConsumeSettings,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ConsumeError> {
    let gateway = &settings.gateway;
    let consumer_metrics = ConsumerMetrics::default();
    let metrics = Metrics::with_routes_and(gateway.route_names(), |registry| {
        consumer_metrics.register(registry);
    });
    let raw_store = server::open_store(gateway).await?;
    let first_ping = Arc::clone(&raw_store);
    let store: Arc<dyn Store> = Arc::new(InstrumentedStore::new(raw_store, Arc::clone(&metrics)));
    let layer = server::idempotency_layer(gateway, Arc::clone(&store));

    let (stop_tx, stop_rx) = watch::channel(false);
    let mut runners = Vec::with_capacity(settings.sources.len());
    for source in &settings.sources {
        let runner = runner_for(source, &settings, &layer, &metrics, &consumer_metrics)?;
        runners.push(runner);
    }

    let (admin_listener, admin_addr) = server::bind("admin_listen", gateway.admin_listen).await?;
    announce(&settings, admin_addr);
    tokio::spawn(server::warn_if_unreachable(
        first_ping,
        gateway.store.to_string(),
        gateway.store_timeout,
    ));
    let draining = Arc::new(AtomicBool::new(false));
    let admin_state = server::admin_state(gateway, &store, &metrics, &layer.stats(), &draining);
    let admin_task = tokio::spawn(server::admin_loop(
        admin_listener,
        admin_state,
        stop_rx.clone(),
    ));

    let grace = gateway.shutdown_grace;
    let tasks: Vec<_> = runners
        .into_iter()
        .map(|runner| tokio::spawn(runner.run(stop_rx.clone(), grace)))
        .collect();
    shutdown.await;
    tracing::info!(
        grace_ms = grace.as_millis() as u64,
        "shutting down: finishing the messages in flight"
    );
    draining.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = stop_tx.send(true);
    for task in tasks {
        let _ = task.await;
    }
    admin_task.abort();
    Ok(())
}

/// The runner of one source: its broker, and a deliverer to its handler through `layer`.
fn runner_for(
    source: &SourceSettings,
    settings: &ConsumeSettings,
    layer: &IdempotencyLayer,
    metrics: &Arc<Metrics>,
    consumer_metrics: &ConsumerMetrics,
) -> Result<Runner, ConsumeError> {
    let gateway = &settings.gateway;
    let broker = open_source(source)?;
    // The handler's path goes in each request, so the route the layer picks is the route a
    // request the proxy forwarded to the same path would fall on.
    let path = if source.upstream.base_path.is_empty() {
        "/".to_owned()
    } else {
        source.upstream.base_path.clone()
    };
    let server_only = Upstream {
        base_path: String::new(),
        ..source.upstream.clone()
    };
    let forwarder = Forwarder::new(
        server_only,
        gateway.upstream_timeout,
        gateway.upstream_connect_timeout,
        gateway.upstream_idle_timeout,
        Arc::clone(metrics),
    );
    let policy = layer.route_policy(&path).clone();
    let key_header = key_header(&policy).map_err(|why| ConsumeError::Route {
        source_name: source.stream.to_string(),
        route: policy.route_name().to_owned(),
        why,
    })?;
    // A base path of a parsed upstream URL is a valid request path.
    let uri: Uri = path.parse().unwrap_or_else(|_| Uri::from_static("/"));
    let claim_idle = source.claim_idle.unwrap_or_else(|| policy.lease_duration());
    Ok(Runner {
        metrics: consumer_metrics.source(broker.name()),
        source: broker,
        deliverer: Deliverer::new(
            layer.layer(forwarder),
            uri,
            key_header,
            policy,
            Arc::clone(metrics),
        ),
        reading: Reading {
            key_field: source.key_field.clone(),
            entry_id_fallback: source.entry_id_fallback,
            payload_field: source.payload_field.clone(),
        },
        max_in_flight: source.max_in_flight,
        max_attempts: source.max_attempts,
        retry_backoff: source.retry_backoff,
        claim_idle,
    })
}

/// The header the route reads keys from, where each message's key goes. A route that would
/// let a queued message through unprotected, or refuse every one, is refused at start.
fn key_header(policy: &RoutePolicy) -> Result<HeaderName, &'static str> {
    if !policy.takes_part(&Method::POST) {
        return Err("does not take POST requests: messages would reach the handler unprotected");
    }
    if policy.verifies_signatures() {
        return Err("verifies a webhook sender's signature, which a queued message does not carry");
    }
    match policy.key_source() {
        KeySource::Header(name) => Ok(name.clone()),
        _ => Err("reads its keys from the body; the consumer sends each message's key in a header"),
    }
}

#[cfg(feature = "redis")]
fn open_source(source: &SourceSettings) -> Result<Arc<dyn Source>, ConsumeError> {
    let opened = redis_stream::RedisStreamSource::connect_lazy(
        source.stream.clone(),
        source.dead_letter_stream.clone(),
        runner::READ_BLOCK,
    );
    match opened {
        Ok(opened) => Ok(Arc::new(opened)),
        Err(error) => Err(ConsumeError::Source {
            source_name: source.stream.to_string(),
            source: error,
        }),
    }
}

#[cfg(not(feature = "redis"))]
fn open_source(source: &SourceSettings) -> Result<Arc<dyn Source>, ConsumeError> {
    let name = source.stream.to_string();
    Err(ConsumeError::Source {
        source: SourceError {
            source_name: name.clone(),
            what: "open",
            cause: "redis-stream:// needs idemgate built with the redis feature".into(),
        },
        source_name: name,
    })
}

/// A fixed, parseable line for scripts and tests, then the log line.
fn announce(settings: &ConsumeSettings, admin_addr: SocketAddr) {
    let sources: Vec<String> = settings
        .sources
        .iter()
        .map(|s| s.stream.to_string())
        .collect();
    crate::logging::STDERR.print_line(format_args!(
        "idemgate consuming {} admin {admin_addr}",
        sources.join(", ")
    ));
    tracing::info!(
        sources = %sources.join(", "),
        admin = %admin_addr,
        store = %settings.gateway.store,
        "idemgate consumer started"
    );
}
