//! [`RedisStore`]: records kept in Redis, shared by every gateway that points at it. The
//! layout, the Redis settings a payments user needs and what a failover can lose are
//! documented on the type, where users of the re-export see them.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, RedisFuture, ServerErrorKind, Value};

use super::{
    BoxError, Claim, ClaimOptions, DataLoss, DataLossStatus, Store, StoreError, Transition,
    UnknownOutcome, decode_completion,
};
use crate::record::{
    Completion, DecodeError, FingerprintHash, OwnerToken, Record, RecordKey, from_unix_millis,
};

#[cfg(feature = "redis-cluster")]
mod cluster;

const BACKEND: &str = "redis";

/// Durations are sent to Redis in whole milliseconds, capped far below where Redis' expiry
/// arithmetic (and the scripts' Lua doubles) would overflow: about 35,000 years.
const MAX_MILLIS: u64 = 1 << 50;

/// Settings for a [`RedisStore`].
#[derive(Clone)]
#[non_exhaustive]
pub struct RedisStoreConfig {
    /// Where Redis is: `redis://[[user]:password@]host[:port][/db]`, `rediss://…` for TLS
    /// (with the `redis-tls` feature, on by default; the server's certificate is checked
    /// against the system's trusted roots, or those in `SSL_CERT_FILE` / `SSL_CERT_DIR` when
    /// set), or `redis+unix:///path/to/socket`. A Redis Cluster (with the `redis-cluster`
    /// feature) is `redis-cluster://[[user]:password@]host:port[,host:port…]`, any of its
    /// nodes (the others are found from them), or `rediss-cluster://…` for TLS. Never logged
    /// with its password.
    pub url: String,
    /// Prepended to every key this store writes, so one Redis can serve several
    /// applications. Default [`DEFAULT_KEY_PREFIX`](Self::DEFAULT_KEY_PREFIX).
    pub key_prefix: String,
    /// How long one store call may take, reconnecting included, before it fails with
    /// [`StoreError::Timeout`]. Default [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT).
    pub timeout: Duration,
    /// How long one attempt to open a connection may take. Default
    /// [`DEFAULT_CONNECT_TIMEOUT`](Self::DEFAULT_CONNECT_TIMEOUT).
    pub connect_timeout: Duration,
    /// Replicas that must hold a claim that took a key before the claim is answered: after
    /// such a claim the store sends `WAIT wait_replicas timeout` to the node that took it,
    /// and a claim fewer replicas acknowledged within half the [`timeout`](Self::timeout)
    /// fails with [`StoreError::Unavailable`] (the layer then undoes it and answers `503`).
    /// It narrows the window in which a failover to a replica loses an acknowledged claim,
    /// at the cost of a replication round trip per new key; it cannot close it (see
    /// [`RedisStore`]'s "What a failover can still lose"). `0`, the default, waits for none.
    pub wait_replicas: u32,
}

impl RedisStoreConfig {
    /// The default [`key_prefix`](Self::key_prefix).
    pub const DEFAULT_KEY_PREFIX: &'static str = "idemgate:";
    /// The default [`timeout`](Self::timeout): long enough for a Redis round trip under
    /// load, short enough that a client waiting behind a dead Redis gets its `503` quickly.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);
    /// The default [`connect_timeout`](Self::connect_timeout).
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

    /// Settings for the Redis at `url`, everything else at its default.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            key_prefix: Self::DEFAULT_KEY_PREFIX.to_owned(),
            timeout: Self::DEFAULT_TIMEOUT,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            wait_replicas: 0,
        }
    }
}

impl fmt::Debug for RedisStoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStoreConfig")
            .field("url", &redact_url(&self.url))
            .field("key_prefix", &self.key_prefix)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("wait_replicas", &self.wait_replicas)
            .finish()
    }
}

/// What Redis does when it reaches `maxmemory`, as read with `CONFIG GET maxmemory-policy`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EvictionPolicy {
    /// `noeviction`: a full Redis refuses writes instead of dropping keys. The only safe
    /// policy for idempotency records.
    NoEviction,
    /// Any other policy, by name. Redis may evict a live record, and a retry of its request
    /// then runs a second time.
    Evicting(String),
    /// Redis refused `CONFIG GET` (a managed service, a renamed command, an ACL), so the
    /// policy could not be checked.
    Unknown,
}

/// Whether Redis keeps its data across a restart, as read with `CONFIG GET appendonly` and
/// `CONFIG GET appendfsync`.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Persistence {
    /// `appendonly yes`, with this `appendfsync` (`always`, `everysec` or `no`).
    AppendOnly {
        /// The `appendfsync` setting.
        fsync: String,
    },
    /// `appendonly no`: a restart loses every record written since the last RDB snapshot
    /// (every record, when snapshots are off), and their retries run again.
    NotAppendOnly,
    /// Redis refused `CONFIG GET` (a managed service, a renamed command, an ACL), or answered
    /// something unexpected, so persistence could not be checked.
    Unknown,
}

impl Persistence {
    /// Reads the answers to `CONFIG GET appendonly` and `CONFIG GET appendfsync`.
    fn from_config(appendonly: Option<&str>, appendfsync: Option<&str>) -> Self {
        match (appendonly, appendfsync) {
            (Some("yes"), Some(fsync)) => Self::AppendOnly {
                fsync: fsync.to_owned(),
            },
            (Some("no"), _) => Self::NotAppendOnly,
            _ => Self::Unknown,
        }
    }

    /// How likely a node with this setting is to lose records, lowest first: of a cluster's
    /// nodes, the one that ranks lowest is reported.
    fn risk_rank(&self) -> u8 {
        match self {
            Self::NotAppendOnly => 0,
            Self::AppendOnly { fsync } if fsync == "no" => 1,
            Self::Unknown => 2,
            Self::AppendOnly { fsync } if fsync == "always" => 4,
            Self::AppendOnly { .. } => 3,
        }
    }

    /// The warning to log for this setting, if it can lose records a restart should keep.
    fn warning(&self) -> Option<&'static str> {
        match self {
            Self::NotAppendOnly => Some(
                "redis does not persist idempotency records (appendonly is no): a restart loses \
                 them and retries of their requests run a second time; set appendonly yes \
                 (the store refuses claims after a loss it detects, until acknowledged)",
            ),
            Self::AppendOnly { fsync } if fsync == "no" => Some(
                "redis leaves fsync of its append-only file to the OS (appendfsync is no): a \
                 machine crash can lose tens of seconds of idempotency records, whose retries \
                 then run a second time; set appendfsync always (or everysec)",
            ),
            Self::AppendOnly { .. } | Self::Unknown => None,
        }
    }
}

/// Records kept in Redis, shared by every gateway that points at the same server.
///
/// Cloning is cheap and shares the connection.
///
/// # How records are kept
///
/// One Redis hash per record, under `{key_prefix}{<hex of the RecordKey>}`. The braces are a
/// Redis Cluster hash tag, so a record is always one key on one slot and every transition can
/// be a single-key script. The fields are short and binary: `s` (state: `f` in flight, `c`
/// completed, `a` ambiguous), `fp` (the 32-byte fingerprint), `tok` (the 16-byte owner token),
/// `ld` (lease deadline, Unix ms), `at` (when it was stored or became ambiguous, Unix ms) and
/// `body` (the completion in [`Completion::encode`]'s binary form, never base64).
///
/// Every transition — claim, complete, release, renew, mark ambiguous — is one Lua script,
/// so one round trip and one atomic step in Redis. The scripts compare the owner token
/// before they change anything, and nothing ever writes a record with a bare `SET`. Leases
/// and expiry use Redis' own clock (`TIME` inside the scripts, relative `PEXPIRE`), never a
/// gateway's, so gateways with skewed clocks still agree. Scripts are loaded at connect and
/// again, in the background, after every reconnect, and sent as `EVALSHA`; one that meets
/// `NOSCRIPT` anyway (a restart, a failover or a `SCRIPT FLUSH` not yet noticed) is run in the
/// same call with `EVAL`, so a call is never cut off between loading its script and running
/// it. Needs Redis 5 or newer (or a compatible server such as Valkey).
///
/// # Configuring Redis for payments
///
/// A record that Redis loses is a request that a retry runs a second time, so:
///
/// - **`maxmemory-policy noeviction`.** Every record has a TTL, so every `volatile-*` policy
///   can evict live records just as the `allkeys-*` ones can. With `noeviction` a full Redis
///   refuses new claims (the gateway answers `503`, nothing runs) instead of forgetting old
///   ones. [`RedisStore::connect`] checks the policy and logs a warning for anything else.
/// - **`appendonly yes`.** Without the append-only file, a Redis restart loses every record
///   written since the last RDB snapshot. With it, `appendfsync everysec` (Redis' default)
///   survives a crash of the Redis process but can lose about the last second of writes (two
///   when the disk is slow) if the machine or its OS dies; `appendfsync always` loses nothing
///   Redis acknowledged, at the cost of an `fsync` per write. For payment endpoints, prefer
///   `always`, or accept that after a machine crash a request acknowledged in its last second
///   may run again. The store checks both settings at connect and after every reconnect
///   ([`persistence`](RedisStore::persistence)) and logs a warning for `appendonly no` or
///   `appendfsync no`.
///
/// # Data loss
///
/// Beside the records the store keeps a marker, `{key_prefix}data-marker`: a key without a
/// TTL holding a random value, written by the first store to use the prefix and adopted by
/// every store at its first contact. Whenever a claim is about to acquire a key, the claim
/// script checks in the same round trip that the marker still holds the value this store
/// adopted; the set-up after a reconnect checks it too. A marker gone or changed means Redis
/// lost its records (a restart without persistence, a `FLUSHALL`, a failover to an empty
/// replica): the store logs an error, reports it in [`data_loss`](RedisStore::data_loss),
/// and refuses new claims with a [`StoreError::Unavailable`] until an operator calls
/// [`acknowledge_data_loss`](RedisStore::acknowledge_data_loss) (the proxy's `POST
/// /admin/store/acknowledge-data-loss`). Replays of records that still exist are served
/// meanwhile. A store set up after the loss cannot tell it from a first start.
///
/// On a Redis Cluster (`redis-cluster://`, the `redis-cluster` feature) a script may touch
/// one slot only, so there is a marker per slot, `{key_prefix}data-marker:{TAG}` with `TAG`
/// chosen to land on it, and a claim checks the one in its record's slot: a node that lost
/// its data has its slots' claims refused while the other slots go on. A flag in slot 0
/// holds the value every marker was written with; the first store writes every slot's
/// marker, then the flag, and later stores adopt the flag's value without filling in
/// missing markers, so a loss is never covered up. An acknowledgement writes a fresh value
/// to every slot. The whole design is in `docs/stores.md`.
///
/// # What a failover can still lose
///
/// Redis replicates asynchronously: a primary acknowledges a claim before its replicas have
/// it. If the primary dies in that window and a replica is promoted, the claim (or the
/// completed response) is gone, and a retry that reaches the new primary runs the request
/// again. [`RedisStoreConfig::wait_replicas`] narrows that window for claims (a claim that
/// takes a key is answered only once that many replicas have it, through `WAIT`), and
/// `min-replicas-to-write` on the server makes a primary that has lost its replicas refuse
/// writes. Neither makes a failover lossless: the promoted replica may still be one that
/// had not received the write, and a completed response is not waited for (its claim,
/// replicated, then lapses under the route's unknown-outcome rule rather than run again).
/// Where a second execution is unacceptable, the upstream should also deduplicate on the
/// `Idempotency-Key` header, which idemgate always forwards.
///
/// # Connections and timeouts
///
/// One multiplexed connection per store, managed by [`redis::aio::ConnectionManager`]: when
/// it breaks, the next call reconnects. Each call is bounded by
/// [`RedisStoreConfig::timeout`] (a [`StoreError::Timeout`] once it passes) and each
/// connection attempt by [`RedisStoreConfig::connect_timeout`]. A reconnection is attempted
/// once per failed call, never on a backoff schedule longer than the call may wait: the
/// gateway answers `503` while Redis is away and works again, without a restart, as soon as
/// Redis is back. [`connect`](Self::connect) insists on reaching Redis at start;
/// [`connect_lazy`](Self::connect_lazy) lets a gateway start without it and report through
/// its readiness check instead.
///
/// A call that times out may still have run in Redis (the reply was lost, not the command).
/// The layer undoes such a claim with a fenced release under the token it chose for it,
/// sent on the same connection and so applied after the claim. Only if that release is lost
/// too does the claim stay until its lease lapses, as when a gateway dies.
///
/// ```no_run
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idemgate::IdempotencyLayer;
/// use idemgate::store::{RedisStore, RedisStoreConfig};
///
/// # #[tokio::main] async fn main() -> Result<(), idemgate::store::StoreError> {
/// let mut config = RedisStoreConfig::new("redis://127.0.0.1:6379");
/// config.key_prefix = "payments:".to_owned();
/// config.timeout = Duration::from_millis(500);
/// let layer = IdempotencyLayer::new(Arc::new(RedisStore::connect(config).await?));
/// # let _ = layer; Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    connection: Connection,
    scripts: Arc<Scripts>,
    key_prefix: Arc<[u8]>,
    timeout: Duration,
    /// [`RedisStoreConfig::wait_replicas`].
    wait_replicas: u32,
    display_url: Arc<str>,
    eviction_policy: Arc<Mutex<Option<EvictionPolicy>>>,
    persistence: Arc<Mutex<Option<Persistence>>>,
    sync: Arc<SyncState>,
    marker: Arc<MarkerState>,
}

/// The connection: to one Redis, or to a Redis Cluster (whose client routes each command to
/// the node serving its key's slot, follows `MOVED` and `ASK`, and sends `SCRIPT LOAD` to every
/// node).
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    #[cfg(feature = "redis-cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl Connection {
    /// `cmd` on every node (one, unless a cluster), each node's answer on its own: a node
    /// that refuses the command (an error reply) does not hide the others' answers.
    async fn on_every_node(
        &mut self,
        cmd: &Cmd,
    ) -> redis::RedisResult<Vec<redis::RedisResult<Value>>> {
        match self {
            Self::Single(connection) => match cmd.query_async(connection).await {
                Err(e) if matches!(e.kind(), ErrorKind::Server(_)) => Ok(vec![Err(e)]),
                answer => Ok(vec![Ok(answer?)]),
            },
            #[cfg(feature = "redis-cluster")]
            Self::Cluster(connection) => {
                use redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
                let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllNodes, None));
                let Value::Map(answers) = connection.route_command(cmd.clone(), routing).await?
                else {
                    return Err((ErrorKind::Parse, "unexpected answer from every node").into());
                };
                Ok(answers
                    .into_iter()
                    .map(|(_node, answer)| match answer {
                        Value::ServerError(e) => Err(e.into()),
                        answer => Ok(answer),
                    })
                    .collect())
            }
        }
    }

    /// `WAIT replicas timeout` on the connection that wrote `key` (on a cluster, the primary
    /// serving its slot, not every primary as the client would route it): how many replicas
    /// have every write this connection made so far.
    async fn wait_for_replicas(
        &mut self,
        key: &[u8],
        replicas: u32,
        timeout: Duration,
    ) -> redis::RedisResult<u64> {
        #[cfg(not(feature = "redis-cluster"))]
        let _ = key;
        let mut cmd = redis::cmd("WAIT");
        cmd.arg(replicas).arg(timeout.as_millis().max(1) as u64);
        match self {
            Self::Single(connection) => cmd.query_async(connection).await,
            #[cfg(feature = "redis-cluster")]
            Self::Cluster(connection) => {
                use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
                let route = Route::new(cluster::slot(key), SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route));
                let answer = connection.route_command(cmd, routing).await?;
                Ok(redis::from_redis_value(answer)?)
            }
        }
    }
}

impl redis::aio::ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(connection) => connection.req_packed_command(cmd),
            #[cfg(feature = "redis-cluster")]
            Self::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(connection) => connection.req_packed_commands(pipeline, offset, count),
            #[cfg(feature = "redis-cluster")]
            Self::Cluster(connection) => connection.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(connection) => connection.get_db(),
            #[cfg(feature = "redis-cluster")]
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}

/// The data marker: a key without a TTL, `{key_prefix}data-marker`, holding a random value.
/// The store adopts its value at first contact (writing one if there is none) and expects
/// it from then on: a marker that vanished or changed means Redis lost the records this
/// store kept (a restart without persistence, a `FLUSHALL`, a failover to an empty replica).
#[derive(Debug)]
struct MarkerState {
    /// One Redis: the marker. A cluster: the key prefix; the markers are one per slot (see
    /// the `cluster` module).
    key: Vec<u8>,
    /// Whether there is a marker per slot (a Redis Cluster) rather than one.
    #[cfg(feature = "redis-cluster")]
    per_slot: bool,
    /// The value this store expects; `None` before its first contact with Redis.
    expected: Mutex<Option<Arc<[u8]>>>,
    /// Held while a first contact adopts the marker, so that calls arriving together make
    /// one first contact (on a cluster it may write a marker in every slot).
    adopting: tokio::sync::Mutex<()>,
    /// The loss found and not yet acknowledged; claims are refused meanwhile.
    lost: Mutex<Option<DataLoss>>,
    /// Losses found since the store was set up.
    detected: AtomicU64,
}

/// The source of the [`StoreError::Unavailable`] a claim gets while a data loss is
/// unacknowledged.
#[derive(Debug, thiserror::Error)]
#[error(
    "redis at {url} lost its data ({what}); new claims are refused until an operator \
     acknowledges the loss (POST /admin/store/acknowledge-data-loss, or \
     RedisStore::acknowledge_data_loss)"
)]
struct DataLossError {
    url: String,
    what: &'static str,
}

/// The source of the [`StoreError::Unavailable`] a claim gets when fewer replicas than
/// [`RedisStoreConfig::wait_replicas`] acknowledged it.
#[derive(Debug, thiserror::Error)]
#[error(
    "redis at {url}: {acknowledged} of the {wanted} replicas required acknowledged the claim \
     within {within:?}"
)]
struct ReplicasBehind {
    url: String,
    wanted: u32,
    acknowledged: u64,
    within: Duration,
}

/// Whether the per-connection set-up ([`RedisStore::sync`]: loading the scripts, checking
/// the server's settings) is due, shared by every clone of a store.
#[derive(Debug)]
struct SyncState {
    /// Set up front and after every failure that may mean a new connection (an I/O error, a
    /// dropped connection, a timeout) or an emptied script cache (`NOSCRIPT`).
    due: AtomicBool,
    /// A background sync is running; at most one at a time.
    running: AtomicBool,
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.display_url)
            .field("key_prefix", &String::from_utf8_lossy(&self.key_prefix))
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Why a [`RedisStore`] could not be set up; the source of the [`StoreError::Unavailable`]
/// that [`RedisStore::connect`] returns, so the message names the server.
#[derive(Debug, thiserror::Error)]
#[error("redis at {url}: {what}")]
struct ConnectError {
    /// The configured URL, password removed.
    url: String,
    what: &'static str,
    #[source]
    source: Option<BoxError>,
}

impl RedisStore {
    /// Connects to Redis and checks its eviction policy (see [`EvictionPolicy`]).
    ///
    /// Fails, within about `connect_timeout + timeout`, with a [`StoreError::Unavailable`]
    /// whose source names the server (without its password) when the URL is invalid or
    /// Redis cannot be reached. Use [`connect_lazy`](Self::connect_lazy) to start without
    /// Redis and let readiness checks report it.
    pub async fn connect(config: RedisStoreConfig) -> Result<Self, StoreError> {
        let bound = config.connect_timeout.saturating_add(config.timeout);
        let store = Self::connect_lazy(config)?;
        let mut connection = store.connection.clone();
        let ping = redis::cmd("PING");
        let fail = |what, source| connect_error(&store.display_url, what, source);
        match tokio::time::timeout(bound, ping.query_async::<()>(&mut connection)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(fail("cannot connect", Some(e.into()))),
            Err(_) => return Err(fail("timed out connecting", None)),
        }
        store.sync().await?;
        Ok(store)
    }

    /// Sets the store up without contacting Redis. Calls fail with a [`StoreError`] until
    /// Redis answers; the eviction policy is checked on the first successful
    /// [`ping`](Store::ping).
    ///
    /// Fails when the URL is invalid or when called outside a Tokio runtime (the connection
    /// runs as a task on it).
    pub fn connect_lazy(config: RedisStoreConfig) -> Result<Self, StoreError> {
        let display_url: Arc<str> = redact_url(&config.url).into();
        let fail = |what, source| connect_error(&display_url, what, source);
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(fail(
                "the store must be set up inside a Tokio runtime",
                None,
            ));
        }
        if config.url.starts_with("rediss:") || config.url.starts_with("rediss-cluster:") {
            #[cfg(feature = "redis-tls")]
            {
                // rustls needs a process-wide cryptography provider; one installed already
                // (by the application) is kept.
                let _ = rustls::crypto::ring::default_provider().install_default();
            }
            #[cfg(not(feature = "redis-tls"))]
            return Err(fail(
                "rediss:// (TLS) needs idemgate built with the redis-tls feature",
                None,
            ));
        }
        let (connection, per_slot) = if config.url.starts_with("redis-cluster:")
            || config.url.starts_with("rediss-cluster:")
        {
            (Self::cluster_connection(&config, &fail)?, true)
        } else {
            let client = redis::Client::open(config.url.as_str())
                .map_err(|e| fail("invalid url", Some(e.into())))?;
            let manager_config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(config.connect_timeout))
                .set_response_timeout(Some(config.timeout))
                // One attempt per reconnection: a failed call triggers the next one, so
                // recovery starts with the first call after Redis is back instead of after a
                // backoff.
                .set_number_of_retries(0);
            let connection = ConnectionManager::new_lazy_with_config(client, manager_config)
                .map_err(|e| fail("invalid connection settings", Some(e.into())))?;
            (Connection::Single(connection), false)
        };
        let marker_key = if per_slot {
            config.key_prefix.as_bytes().to_vec()
        } else {
            [config.key_prefix.as_bytes(), b"data-marker"].concat()
        };
        Ok(Self {
            connection,
            scripts: Arc::new(Scripts::new()),
            key_prefix: config.key_prefix.into_bytes().into(),
            timeout: config.timeout,
            wait_replicas: config.wait_replicas,
            display_url,
            eviction_policy: Arc::new(Mutex::new(None)),
            sync: Arc::new(SyncState {
                due: AtomicBool::new(true),
                running: AtomicBool::new(false),
            }),
            marker: Arc::new(MarkerState {
                key: marker_key,
                #[cfg(feature = "redis-cluster")]
                per_slot,
                expected: Mutex::new(None),
                adopting: tokio::sync::Mutex::new(()),
                lost: Mutex::new(None),
                detected: AtomicU64::new(0),
            }),
            persistence: Arc::new(Mutex::new(None)),
        })
    }

    /// A Redis Cluster client for a `redis-cluster://` URL, connecting on first use. It
    /// follows `MOVED` and `ASK` and retries a call while the cluster fails over, each
    /// attempt bounded by `connect_timeout` and `timeout`, the whole call by `timeout` (as
    /// [`run`](Self::run) bounds it).
    #[cfg(feature = "redis-cluster")]
    fn cluster_connection(
        config: &RedisStoreConfig,
        fail: &impl Fn(&'static str, Option<BoxError>) -> StoreError,
    ) -> Result<Connection, StoreError> {
        let nodes = match cluster::node_urls(&config.url) {
            Some(Ok(nodes)) => nodes,
            Some(Err(why)) => return Err(fail(why, None)),
            None => return Err(fail("invalid url", None)),
        };
        let client = redis::cluster::ClusterClientBuilder::new(nodes)
            .build()
            .map_err(|e| fail("invalid url", Some(e.into())))?;
        let cluster_config = redis::cluster::ClusterConfig::new()
            .set_connection_timeout(config.connect_timeout)
            .set_response_timeout(config.timeout);
        Ok(Connection::Cluster(
            client.get_pending_async_connection_with_config(cluster_config),
        ))
    }

    #[cfg(not(feature = "redis-cluster"))]
    fn cluster_connection(
        _config: &RedisStoreConfig,
        fail: &impl Fn(&'static str, Option<BoxError>) -> StoreError,
    ) -> Result<Connection, StoreError> {
        Err(fail(
            "redis-cluster:// needs idemgate built with the redis-cluster feature",
            None,
        ))
    }

    /// What a (re)connected store does before anything else: loads every script, so the
    /// first call of each after a restart, a failover or a `SCRIPT FLUSH` is one round trip
    /// (a call that still meets `NOSCRIPT` falls back to `EVAL`, see
    /// [`eval`](Self::eval)), and checks the server's eviction policy.
    ///
    /// Runs at [`connect`](Self::connect), on the first successful [`ping`](Store::ping)
    /// of a lazy store, and in the background at the first call after any failure that may
    /// have meant a new connection or an emptied script cache. Marked due again if it fails.
    async fn sync(&self) -> Result<(), StoreError> {
        self.sync.due.store(false, Ordering::Relaxed);
        let result = self.sync_steps().await;
        if result.is_err() {
            self.sync.due.store(true, Ordering::Relaxed);
        }
        result
    }

    async fn sync_steps(&self) -> Result<(), StoreError> {
        // One command each: a cluster client sends each to every node, where a pipeline
        // would go to one.
        let mut connection = self.connection.clone();
        for script in self.scripts.all() {
            let load = redis::cmd("SCRIPT").arg("LOAD").arg(script.code).clone();
            let _: String = self.run(load.query_async(&mut connection)).await?;
        }
        self.check_marker().await?;
        self.check_persistence().await?;
        self.check_eviction_policy().await?;
        Ok(())
    }

    /// The data marker's value this store expects, adopting the one in Redis (or writing
    /// one) at first contact.
    async fn expected_marker(&self) -> Result<Arc<[u8]>, StoreError> {
        if let Some(value) = self.marker_slot().clone() {
            return Ok(value);
        }
        let _adopting = self.marker.adopting.lock().await;
        if let Some(value) = self.marker_slot().clone() {
            return Ok(value);
        }
        self.adopt_marker(false).await
    }

    fn marker_slot(&self) -> std::sync::MutexGuard<'_, Option<Arc<[u8]>>> {
        self.marker
            .expected
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reads the marker, writing a fresh one if there is none, and expects its value from
    /// now on. `acknowledging` says an operator asked for it; otherwise this is the store's
    /// first contact, where a missing marker means a first start with this key prefix (or a
    /// loss before this store started, which it cannot tell apart).
    async fn adopt_marker(&self, acknowledging: bool) -> Result<Arc<[u8]>, StoreError> {
        let fresh = format!("{:032x}", OwnerToken::generate().0);
        let (created, value) = match () {
            #[cfg(feature = "redis-cluster")]
            () if self.marker.per_slot => {
                self.adopt_slot_markers(acknowledging, fresh.as_bytes())
                    .await?
            }
            () => {
                self.ensure_marker(&self.marker.key, fresh.as_bytes())
                    .await?
            }
        };
        let value: Arc<[u8]> = value.into();
        let mut slot = self.marker_slot();
        // A concurrent first contact may have adopted it already: the same value, as the
        // marker is written only where there is none.
        if acknowledging || slot.is_none() {
            *slot = Some(Arc::clone(&value));
            drop(slot);
            if created && !acknowledging {
                tracing::info!(
                    redis = %self.display_url,
                    marker = %String::from_utf8_lossy(&self.marker.key),
                    "wrote the redis data marker: none was there (this key prefix's first use on \
                     this redis, or a loss of data before this gateway started, which cannot be told apart)",
                );
            }
        }
        Ok(value)
    }

    /// Writes `fresh` to the marker `key` if there is none; returns whether it did, and the
    /// marker's value.
    async fn ensure_marker(&self, key: &[u8], fresh: &[u8]) -> Result<(bool, Vec<u8>), StoreError> {
        let answer: Value = self
            .run(self.eval(&self.scripts.ensure_marker, &[key], &[fresh]))
            .await?;
        match answer {
            Value::Array(items) => match items.as_slice() {
                [Value::Int(created), Value::BulkString(value)] => {
                    Ok((*created == 1, value.clone()))
                }
                _ => Err(corrupt("unexpected data marker answer")),
            },
            _ => Err(corrupt("unexpected data marker answer")),
        }
    }

    /// The marker key a claim of the record at `record` (its Redis key) checks.
    fn marker_key_for<'a>(&'a self, record: &[u8]) -> std::borrow::Cow<'a, [u8]> {
        #[cfg(feature = "redis-cluster")]
        if self.marker.per_slot {
            return cluster::marker_key(&self.marker.key, cluster::slot(record)).into();
        }
        #[cfg(not(feature = "redis-cluster"))]
        let _ = record;
        std::borrow::Cow::Borrowed(&self.marker.key)
    }

    /// Compares the marker in Redis with the one expected (adopting it at first contact);
    /// a marker gone or changed is a data loss.
    async fn check_marker(&self) -> Result<(), StoreError> {
        let Some(expected) = self.marker_slot().clone() else {
            let _adopted = self.expected_marker().await?;
            // A cluster's markers are checked slot by slot even at first contact: a node may
            // have lost its slots' markers before this store started.
            #[cfg(feature = "redis-cluster")]
            if self.marker.per_slot {
                return self.check_slot_markers(&_adopted).await;
            }
            return Ok(());
        };
        #[cfg(feature = "redis-cluster")]
        if self.marker.per_slot {
            return self.check_slot_markers(&expected).await;
        }
        let mut connection = self.connection.clone();
        let found: Option<Vec<u8>> = self
            .run(
                redis::cmd("GET")
                    .arg(&self.marker.key)
                    .query_async(&mut connection),
            )
            .await?;
        match found {
            Some(value) if *value == *expected => {}
            Some(_) => self.data_lost_since(&expected, "the data marker key was replaced"),
            None => self.data_lost_since(&expected, "the data marker key is gone"),
        }
        Ok(())
    }

    /// Notes a data loss found by a check made while this store expected `expected`, unless
    /// an acknowledgement has adopted another marker since: the check then read Redis before
    /// the operator's acknowledgement, and what it found is already acknowledged. The
    /// expected value stays locked while the loss is noted, so an acknowledgement comes
    /// wholly before it (and clears it) or wholly after (and the loss is not noted).
    pub(super) fn data_lost_since(&self, expected: &Arc<[u8]>, what: &'static str) {
        let now = self.marker_slot();
        if now.as_ref().is_some_and(|now| Arc::ptr_eq(now, expected)) {
            self.data_lost(what);
        }
        drop(now);
    }

    /// Notes a data loss (logged and counted once until acknowledged).
    fn data_lost(&self, what: &'static str) {
        let mut lost = self
            .marker
            .lost
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if lost.is_some() {
            return;
        }
        *lost = Some(DataLoss {
            detected_at: std::time::SystemTime::now(),
            what,
        });
        drop(lost);
        self.marker.detected.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            redis = %self.display_url,
            marker = %String::from_utf8_lossy(&self.marker.key),
            found = what,
            "redis lost its data (a restart without persistence, a FLUSHALL or a failover to an \
             empty replica): requests it had recorded would run again, so new claims are refused \
             (503) until an operator acknowledges the loss with POST /admin/store/acknowledge-data-loss \
             (or RedisStore::acknowledge_data_loss); replays of records that still exist are served",
        );
    }

    fn data_loss_error(&self) -> StoreError {
        let what = self
            .marker
            .lost
            .lock()
            .ok()
            .and_then(|lost| lost.as_ref().map(|l| l.what))
            .unwrap_or("the data marker key is gone or was replaced");
        StoreError::Unavailable {
            backend: BACKEND,
            source: Box::new(DataLossError {
                url: self.display_url.to_string(),
                what,
            }),
        }
    }

    /// Accepts, as an operator, that Redis lost the records this store kept: adopts the data
    /// marker now in Redis (writing one if there is none) and claims again. Returns whether a
    /// loss was unacknowledged. The proxy calls it for `POST
    /// /admin/store/acknowledge-data-loss`.
    ///
    /// Every gateway that found the loss refuses claims until it is acknowledged on that
    /// gateway: the acknowledgement is the store's, not Redis'.
    pub async fn acknowledge_data_loss(&self) -> Result<bool, StoreError> {
        self.adopt_marker(true).await?;
        let was = self
            .marker
            .lost
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(loss) = &was {
            tracing::warn!(
                redis = %self.display_url,
                found = loss.what,
                "redis data loss acknowledged by an operator: claims are served again",
            );
        }
        Ok(was.is_some())
    }

    /// The data loss this store found and that is not yet acknowledged, and how many it has
    /// found.
    pub fn data_loss(&self) -> DataLossStatus {
        DataLossStatus {
            unacknowledged: self.marker.lost.lock().ok().and_then(|l| l.clone()),
            detected: self.marker.detected.load(Ordering::Relaxed),
        }
    }

    /// Reads `appendonly` and `appendfsync` now, logs a warning for a setting that can lose
    /// records across a restart (see [`Persistence`]; once per answer, as for the eviction
    /// policy), and remembers the answer for [`persistence`](Self::persistence).
    ///
    /// On a Redis Cluster every node is asked (a replica is a primary after a failover), and
    /// the answer is the node least likely to keep its records.
    pub async fn check_persistence(&self) -> Result<Persistence, StoreError> {
        // `append*`: appendonly and appendfsync in one command, on Redis before 7 too.
        let nodes = self.config_get("append*").await?;
        let persistence = nodes
            .into_iter()
            .map(|node| match node {
                Ok(config) => Persistence::from_config(
                    config.get("appendonly").map(String::as_str),
                    config.get("appendfsync").map(String::as_str),
                ),
                Err(()) => Persistence::Unknown,
            })
            .min_by_key(Persistence::risk_rank)
            .unwrap_or(Persistence::Unknown);
        if !remember(&self.persistence, &persistence) {
            return Ok(persistence);
        }
        match (&persistence, persistence.warning()) {
            (_, Some(warning)) => {
                tracing::warn!(redis = %self.display_url, ?persistence, "{warning}")
            }
            (Persistence::Unknown, None) => tracing::info!(
                redis = %self.display_url,
                "cannot read redis appendonly/appendfsync (CONFIG GET refused); make sure \
                 appendonly is yes (a redis restart without persistence loses idempotency \
                 records; the store refuses claims after a loss it detects, until acknowledged)",
            ),
            _ => tracing::debug!(redis = %self.display_url, ?persistence, "redis persistence"),
        }
        Ok(persistence)
    }

    /// The persistence found by the last check, if one has run (when the eviction policy
    /// is checked, see [`eviction_policy`](Self::eviction_policy)).
    pub fn persistence(&self) -> Option<Persistence> {
        self.persistence.lock().ok().and_then(|p| p.clone())
    }

    /// `CONFIG GET pattern` on every node (the one Redis, or each node of a cluster): per
    /// node, the settings that match, or `Err(())` if the node refused the command (often
    /// disabled on managed services); a failure to reach Redis is the outer error.
    async fn config_get(
        &self,
        pattern: &str,
    ) -> Result<Vec<Result<HashMap<String, String>, ()>>, StoreError> {
        let mut connection = self.connection.clone();
        let command = redis::cmd("CONFIG").arg("GET").arg(pattern).clone();
        let answers = tokio::time::timeout(self.timeout, connection.on_every_node(&command))
            .await
            .map_err(|_| self.timeout_error())?
            .map_err(|e| self.error(e))?;
        answers
            .into_iter()
            .map(|answer| match answer {
                Ok(value) => redis::from_redis_value::<HashMap<String, String>>(value)
                    .map(Ok)
                    .map_err(|_| corrupt("unexpected CONFIG GET answer")),
                Err(e) => {
                    tracing::debug!(redis = %self.display_url, error = %e, "redis refused CONFIG GET {pattern}");
                    Ok(Err(()))
                }
            })
            .collect()
    }

    /// Starts a background [`sync`](Self::sync) if one is due and none is running. Costs one
    /// atomic load when none is due, so every call can ask.
    fn sync_if_due(&self) {
        if !self.sync.due.load(Ordering::Relaxed) || self.sync.running.swap(true, Ordering::Acquire)
        {
            return;
        }
        let store = self.clone();
        tokio::spawn(async move {
            if let Err(error) = store.sync().await {
                tracing::debug!(redis = %store.display_url, error = %crate::ErrorChain(&error), "redis set-up after a reconnect failed; retried with the next call");
            }
            store.sync.running.store(false, Ordering::Release);
        });
    }

    /// Reads Redis' `maxmemory-policy` now, logs a warning unless it is `noeviction` (once
    /// per answer: a check after a reconnect logs only if the answer changed), and remembers
    /// the answer for [`eviction_policy`](Self::eviction_policy).
    ///
    /// On a Redis Cluster every node is asked, and the answer is the riskiest policy found.
    pub async fn check_eviction_policy(&self) -> Result<EvictionPolicy, StoreError> {
        let policy = self
            .config_get("maxmemory-policy")
            .await?
            .into_iter()
            .map(
                |node| match node.map(|mut c| c.remove("maxmemory-policy")) {
                    Ok(Some(name)) if name == "noeviction" => EvictionPolicy::NoEviction,
                    Ok(Some(name)) => EvictionPolicy::Evicting(name),
                    // Redis refused (CONFIG is often disabled on managed services) or did not
                    // know it.
                    Ok(None) | Err(()) => EvictionPolicy::Unknown,
                },
            )
            .min_by_key(|policy| match policy {
                EvictionPolicy::Evicting(_) => 0,
                EvictionPolicy::Unknown => 1,
                EvictionPolicy::NoEviction => 2,
            })
            .unwrap_or(EvictionPolicy::Unknown);
        if !remember(&self.eviction_policy, &policy) {
            return Ok(policy);
        }
        match &policy {
            EvictionPolicy::NoEviction => {
                tracing::debug!(redis = %self.display_url, "redis maxmemory-policy is noeviction");
            }
            EvictionPolicy::Evicting(name) => tracing::warn!(
                redis = %self.display_url,
                maxmemory_policy = %name,
                "redis may evict idempotency records (maxmemory-policy is not noeviction): \
                 a retry of a request whose record was evicted runs a second time; \
                 set maxmemory-policy noeviction",
            ),
            EvictionPolicy::Unknown => tracing::info!(
                redis = %self.display_url,
                "cannot read redis maxmemory-policy (CONFIG GET refused); make sure it is noeviction",
            ),
        }
        Ok(policy)
    }

    /// The eviction policy found by the last check, if one has run (at
    /// [`connect`](Self::connect), or on the first successful ping of a
    /// [`connect_lazy`](Self::connect_lazy) store).
    pub fn eviction_policy(&self) -> Option<EvictionPolicy> {
        self.eviction_policy.lock().ok().and_then(|p| p.clone())
    }

    /// The Redis key that holds `key`'s record.
    pub fn redis_key(&self, key: &RecordKey) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.key_prefix.len() + 66);
        out.extend_from_slice(&self.key_prefix);
        out.push(b'{');
        out.extend_from_slice(key.to_hex().as_bytes());
        out.push(b'}');
        out
    }

    /// Waits until [`wait_replicas`](RedisStoreConfig::wait_replicas) replicas hold what
    /// this store wrote to `record`'s node, within the store timeout; fewer is an error.
    async fn replicated(&self, record: &[u8]) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        // WAIT's own timeout is half the call's, so a slow replica is told apart from a dead
        // connection by the answer, not by the call's timeout.
        let wait = self.timeout / 2;
        let acknowledged = self
            .run(connection.wait_for_replicas(record, self.wait_replicas, wait))
            .await?;
        if acknowledged >= u64::from(self.wait_replicas) {
            return Ok(());
        }
        Err(StoreError::Unavailable {
            backend: BACKEND,
            source: Box::new(ReplicasBehind {
                url: self.display_url.to_string(),
                wanted: self.wait_replicas,
                acknowledged,
                within: wait,
            }),
        })
    }

    /// Runs one Redis call under the store timeout. A failure that may mean a new
    /// connection (anything but an error reply from Redis) makes a [`sync`](Self::sync) due.
    async fn run<T>(
        &self,
        call: impl Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, StoreError> {
        self.sync_if_due();
        let result = tokio::time::timeout(self.timeout, call).await;
        match result {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                if !matches!(e.kind(), ErrorKind::Server(_)) {
                    self.sync.due.store(true, Ordering::Relaxed);
                }
                Err(self.error(e))
            }
            Err(_) => {
                self.sync.due.store(true, Ordering::Relaxed);
                Err(self.timeout_error())
            }
        }
    }

    /// Runs `script` with `keys` and `args`: `EVALSHA`, and on `NOSCRIPT` (Redis restarted,
    /// failed over or had its cache flushed) the script itself with `EVAL`, which runs it in
    /// the same step and caches it again. One extra round trip, never a separate load that a
    /// timeout could cut off between loading and running; the other scripts are then
    /// reloaded in the background by a [`sync`](Self::sync).
    async fn eval<T: FromRedisValue>(
        &self,
        script: &LuaScript,
        keys: &[&[u8]],
        args: &[&[u8]],
    ) -> redis::RedisResult<T> {
        let command = |verb: &str, body: &str| {
            let mut cmd = redis::cmd(verb);
            cmd.arg(body).arg(keys.len());
            for key in keys {
                cmd.arg(*key);
            }
            for arg in args {
                cmd.arg(*arg);
            }
            cmd
        };
        let mut connection = self.connection.clone();
        match command("EVALSHA", &script.sha)
            .query_async(&mut connection)
            .await
        {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.sync.due.store(true, Ordering::Relaxed);
                command("EVAL", script.code)
                    .query_async(&mut connection)
                    .await
            }
            answer => answer,
        }
    }

    /// Runs one fenced transition script with ARGV `token`, then `args`; `1` means applied.
    async fn transition(
        &self,
        script: &LuaScript,
        key: &RecordKey,
        token: OwnerToken,
        args: &[&[u8]],
    ) -> Result<Transition, StoreError> {
        let record = self.redis_key(key);
        let token_bytes = token.0.to_be_bytes();
        let mut all: Vec<&[u8]> = Vec::with_capacity(args.len() + 1);
        all.push(&token_bytes[..]);
        all.extend_from_slice(args);
        let applied: i64 = self.run(self.eval(script, &[&record], &all)).await?;
        Ok(if applied == 1 {
            Transition::Applied
        } else {
            Transition::Fenced
        })
    }

    fn error(&self, e: RedisError) -> StoreError {
        // The connection's own response timeout and ours race; both mean "too slow".
        if e.is_timeout() {
            self.timeout_error()
        } else {
            StoreError::Unavailable {
                backend: BACKEND,
                source: Box::new(e),
            }
        }
    }

    fn timeout_error(&self) -> StoreError {
        StoreError::Timeout {
            backend: BACKEND,
            after: self.timeout,
        }
    }
}

/// Stores `value` in `slot`; true if it differs from what was there (so it is worth a log
/// line).
fn remember<T: Clone + PartialEq>(slot: &Mutex<Option<T>>, value: &T) -> bool {
    let mut slot = slot
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let changed = slot.as_ref() != Some(value);
    *slot = Some(value.clone());
    changed
}

/// A [`StoreError::Unavailable`] for a store that could not be set up or reach Redis at
/// `url` (already redacted).
fn connect_error(url: &str, what: &'static str, source: Option<BoxError>) -> StoreError {
    StoreError::Unavailable {
        backend: BACKEND,
        source: Box::new(ConnectError {
            url: url.to_owned(),
            what,
            source,
        }),
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        token: OwnerToken,
        options: &ClaimOptions,
    ) -> Result<Claim, StoreError> {
        let lease = millis(options.lease).to_string();
        let ttl = millis(options.ttl).to_string();
        let on_lapse: &[u8] = match options.on_lapse {
            UnknownOutcome::Ambiguous => b"a",
            UnknownOutcome::Retry => b"r",
        };
        let marker = self.expected_marker().await?;
        let record = self.redis_key(key);
        let token_bytes = token.0.to_be_bytes();
        let args: [&[u8]; 6] = [
            &fingerprint.0[..],
            &token_bytes[..],
            lease.as_bytes(),
            ttl.as_bytes(),
            on_lapse,
            &marker,
        ];
        let marker_key = self.marker_key_for(&record);
        let answer: Value = self
            .run(self.eval(&self.scripts.claim, &[&record, &marker_key], &args))
            .await?;
        match decode_claim(answer, token) {
            Err(ClaimAnswer::DataLost) => {
                // Unless an acknowledgement adopted a new marker while this claim was on its
                // way with the old one.
                self.data_lost_since(&marker, "the data marker key is gone or was replaced");
                Err(self.data_loss_error())
            }
            Err(ClaimAnswer::Error(e)) => Err(e),
            Ok(Claim::Acquired(token)) if self.wait_replicas > 0 => {
                self.replicated(&record).await?;
                Ok(Claim::Acquired(token))
            }
            Ok(claim) => Ok(claim),
        }
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        let body = completion.encode();
        let ttl = millis(ttl).to_string();
        self.transition(&self.scripts.complete, key, token, &[&body, ttl.as_bytes()])
            .await
    }

    async fn release(&self, key: &RecordKey, token: OwnerToken) -> Result<Transition, StoreError> {
        self.transition(&self.scripts.release, key, token, &[])
            .await
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Transition, StoreError> {
        let lease = millis(lease).to_string();
        self.transition(&self.scripts.renew, key, token, &[lease.as_bytes()])
            .await
    }

    async fn mark_ambiguous(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        let ttl = millis(ttl).to_string();
        self.transition(&self.scripts.mark_ambiguous, key, token, &[ttl.as_bytes()])
            .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let mut connection = self.connection.clone();
        let fields: Vec<Option<Vec<u8>>> = self
            .run(
                redis::cmd("HMGET")
                    .arg(self.redis_key(key))
                    .arg(&["s", "fp", "ld", "at", "body"])
                    .query_async(&mut connection),
            )
            .await?;
        decode_record(fields)
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let mut connection = self.connection.clone();
        let removed: i64 = self
            .run(
                redis::cmd("DEL")
                    .arg(self.redis_key(key))
                    .query_async(&mut connection),
            )
            .await?;
        Ok(removed > 0)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        self.run(redis::cmd("PING").query_async::<()>(&mut connection))
            .await?;
        if self.eviction_policy().is_none() {
            // A lazy store's first contact: set up now, so readiness reports its outcome.
            self.sync().await?;
        }
        Ok(())
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn data_loss(&self) -> DataLossStatus {
        RedisStore::data_loss(self)
    }

    async fn acknowledge_data_loss(&self) -> Result<bool, StoreError> {
        RedisStore::acknowledge_data_loss(self).await
    }
}

/// The transition scripts. Each that needs the time reads Redis' clock with `TIME` (see
/// `lua_now!`), and each sets expiry with relative `PEXPIRE`, so no gateway clock is
/// involved.
struct Scripts {
    claim: LuaScript,
    complete: LuaScript,
    release: LuaScript,
    renew: LuaScript,
    mark_ambiguous: LuaScript,
    ensure_marker: LuaScript,
}

/// One script: its text, for `EVAL` and `SCRIPT LOAD`, and its SHA1, for `EVALSHA`.
struct LuaScript {
    code: &'static str,
    sha: String,
}

impl LuaScript {
    fn new(code: &'static str) -> Self {
        Self {
            code,
            sha: redis::Script::new(code).get_hash().to_owned(),
        }
    }
}

/// Lua: Redis' clock now, in Unix ms as a number (`now`) and as a decimal string (`now_s`).
macro_rules! lua_now {
    () => {
        "local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_s = string.format('%.0f', now)
"
    };
}

/// Lua: the fence of every transition but a claim. Names the record `key` and returns `0`
/// (fenced) unless it is in flight under the token in ARGV[1].
macro_rules! lua_fence {
    () => {
        "local key = KEYS[1]
local rec = redis.call('HMGET', key, 's', 'tok')
if rec[1] ~= 'f' or rec[2] ~= ARGV[1] then return 0 end
"
    };
}

/// KEYS[1] record, KEYS[2] data marker. ARGV: fingerprint, token, lease ms, ttl ms, on_lapse
/// (`a` | `r`), the marker value expected.
/// Returns {0} acquired, {1, lease ms left} in flight, {2, completion} completed,
/// {3} ambiguous, {4} mismatch, {5} a record this store cannot read, {6} not acquired because
/// the marker is gone or changed (Redis lost its data). Only acquiring checks the marker: a
/// record that still exists is answered as usual.
const CLAIM: &str = concat!(
    "local key = KEYS[1]\n",
    lua_now!(),
    r"local rec = redis.call('HMGET', key, 's', 'fp', 'ld')
local state, fp = rec[1], rec[2]
if not state then
  if fp or rec[3] then return {5} end
elseif state == 'f' then
  local ld = tonumber(rec[3])
  if not ld then return {5} end
  if ld <= now then
    if ARGV[5] == 'r' then
      state = false
    else
      redis.call('HDEL', key, 'tok', 'ld')
      redis.call('HSET', key, 's', 'a', 'at', now_s)
      redis.call('PEXPIRE', key, ARGV[4])
      state = 'a'
    end
  else
    if fp ~= ARGV[1] then return {4} end
    return {1, ld - now}
  end
end
if not state then
  if redis.call('GET', KEYS[2]) ~= ARGV[6] then return {6} end
  if rec[1] then redis.call('DEL', key) end
  redis.call('HSET', key, 's', 'f', 'fp', ARGV[1], 'tok', ARGV[2], 'ld', string.format('%.0f', now + tonumber(ARGV[3])))
  redis.call('PEXPIRE', key, ARGV[4])
  return {0}
end
if fp ~= ARGV[1] then return {4} end
if state == 'c' then
  local body = redis.call('HGET', key, 'body')
  if not body then return {5} end
  return {2, body}
end
if state == 'a' then return {3} end
return {5}
"
);

/// KEYS[1] data marker. ARGV: a fresh value. Writes it (without a TTL) if there is no marker.
/// Returns {1, value} written, {0, value} the marker that was there.
const ENSURE_MARKER: &str = r"local v = redis.call('GET', KEYS[1])
if v then return {0, v} end
redis.call('SET', KEYS[1], ARGV[1])
return {1, ARGV[1]}
";

/// KEYS[1] record. ARGV: token, completion, ttl ms. Returns 1 applied, 0 fenced.
const COMPLETE: &str = concat!(
    lua_fence!(),
    lua_now!(),
    r"redis.call('HDEL', key, 'tok', 'ld')
redis.call('HSET', key, 's', 'c', 'body', ARGV[2], 'at', now_s)
redis.call('PEXPIRE', key, ARGV[3])
return 1
"
);

/// KEYS[1] record. ARGV: token. Returns 1 applied, 0 fenced.
const RELEASE: &str = concat!(
    lua_fence!(),
    r"redis.call('DEL', key)
return 1
"
);

/// KEYS[1] record. ARGV: token, lease ms. Returns 1 applied, 0 fenced.
const RENEW: &str = concat!(
    lua_fence!(),
    lua_now!(),
    r"local lease = tonumber(ARGV[2])
redis.call('HSET', key, 'ld', string.format('%.0f', now + lease))
local left = redis.call('PTTL', key)
if left >= 0 and left < lease then redis.call('PEXPIRE', key, lease) end
return 1
"
);

/// KEYS[1] record. ARGV: token, ttl ms. Returns 1 applied, 0 fenced.
const MARK_AMBIGUOUS: &str = concat!(
    lua_fence!(),
    lua_now!(),
    r"redis.call('HDEL', key, 'tok', 'ld')
redis.call('HSET', key, 's', 'a', 'at', now_s)
redis.call('PEXPIRE', key, ARGV[2])
return 1
"
);

impl Scripts {
    fn new() -> Self {
        Self {
            claim: LuaScript::new(CLAIM),
            complete: LuaScript::new(COMPLETE),
            release: LuaScript::new(RELEASE),
            renew: LuaScript::new(RENEW),
            mark_ambiguous: LuaScript::new(MARK_AMBIGUOUS),
            ensure_marker: LuaScript::new(ENSURE_MARKER),
        }
    }

    fn all(&self) -> [&LuaScript; 6] {
        [
            &self.claim,
            &self.complete,
            &self.release,
            &self.renew,
            &self.mark_ambiguous,
            &self.ensure_marker,
        ]
    }
}

/// Whole milliseconds, rounded up (a sub-millisecond duration must not become "expire now"),
/// at least 1 and at most [`MAX_MILLIS`].
fn millis(d: Duration) -> u64 {
    let ms = d.as_nanos().div_ceil(1_000_000);
    ms.clamp(1, MAX_MILLIS as u128) as u64
}

fn corrupt(what: &'static str) -> StoreError {
    StoreError::Corrupt {
        backend: BACKEND,
        source: DecodeError::new(what),
    }
}

/// Why a claim answer is not a [`Claim`].
#[derive(Debug)]
enum ClaimAnswer {
    /// The script refused to acquire: the data marker is gone or changed.
    DataLost,
    Error(StoreError),
}

impl From<StoreError> for ClaimAnswer {
    fn from(e: StoreError) -> Self {
        Self::Error(e)
    }
}

fn decode_claim(answer: Value, token: OwnerToken) -> Result<Claim, ClaimAnswer> {
    let Value::Array(items) = answer else {
        return Err(corrupt("unexpected claim answer").into());
    };
    let mut items = items.into_iter();
    let code = match items.next() {
        Some(Value::Int(code)) => code,
        _ => return Err(corrupt("unexpected claim answer").into()),
    };
    match (code, items.next()) {
        (0, None) => Ok(Claim::Acquired(token)),
        (1, Some(Value::Int(left))) => Ok(Claim::InFlight {
            lease_remaining: Duration::from_millis(u64::try_from(left).unwrap_or(0)),
        }),
        (2, Some(Value::BulkString(body))) => Ok(Claim::Completed(Arc::new(decode_completion(
            BACKEND,
            Bytes::from(body),
        )?))),
        (3, None) => Ok(Claim::Ambiguous),
        (4, None) => Ok(Claim::Mismatch),
        (5, None) => Err(corrupt("record with missing or unknown fields").into()),
        (6, None) => Err(ClaimAnswer::DataLost),
        _ => Err(corrupt("unexpected claim answer").into()),
    }
}

/// Decodes HMGET s fp ld at body.
fn decode_record(fields: Vec<Option<Vec<u8>>>) -> Result<Option<Record>, StoreError> {
    let [state, fp, ld, at, body]: [Option<Vec<u8>>; 5] = fields
        .try_into()
        .map_err(|_| corrupt("unexpected HMGET answer"))?;
    let Some(state) = state else {
        return if fp.is_none() && ld.is_none() && at.is_none() && body.is_none() {
            Ok(None)
        } else {
            Err(corrupt("record without a state"))
        };
    };
    let fingerprint = fp
        .and_then(|fp| <[u8; 32]>::try_from(fp).ok())
        .map(FingerprintHash)
        .ok_or_else(|| corrupt("record without a valid fingerprint"))?;
    let time = |field: Option<Vec<u8>>| {
        field
            .and_then(|v| std::str::from_utf8(&v).ok()?.parse::<u64>().ok())
            .map(from_unix_millis)
            .ok_or_else(|| corrupt("record with an invalid time"))
    };
    match state.as_slice() {
        b"f" => Ok(Some(Record::InFlight {
            fingerprint,
            lease_deadline: time(ld)?,
        })),
        b"c" => {
            let body = body.ok_or_else(|| corrupt("completed record without a body"))?;
            let completion = decode_completion(BACKEND, Bytes::from(body))?;
            Ok(Some(Record::Completed {
                fingerprint,
                completion,
                stored_at: time(at)?,
            }))
        }
        b"a" => Ok(Some(Record::Ambiguous {
            fingerprint,
            since: time(at)?,
        })),
        _ => Err(corrupt("record with an unknown state")),
    }
}

/// The URL with its password (and any `password`/`pass` query parameter) replaced by `***`,
/// for logs and error messages.
fn redact_url(url: &str) -> String {
    let (scheme, rest) = match url.find("://") {
        Some(i) => url.split_at(i + 3),
        None => ("", url),
    };
    let (rest, query) = match rest.find('?') {
        Some(i) => rest.split_at(i),
        None => (rest, ""),
    };
    let mut out = String::with_capacity(url.len());
    out.push_str(scheme);
    match rest.rfind('@') {
        Some(at) => {
            let (userinfo, host) = rest.split_at(at);
            match userinfo.split_once(':') {
                Some((user, _password)) => {
                    out.push_str(user);
                    out.push_str(":***");
                }
                None => out.push_str("***"),
            }
            out.push_str(host);
        }
        None => out.push_str(rest),
    }
    if let Some(params) = query.strip_prefix('?') {
        out.push('?');
        for (i, param) in params.split('&').enumerate() {
            if i > 0 {
                out.push('&');
            }
            match param.split_once('=') {
                Some((name, _)) if name == "password" || name == "pass" => {
                    out.push_str(name);
                    out.push_str("=***");
                }
                _ => out.push_str(param),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_the_display_url() {
        assert_eq!(
            redact_url("redis://:s3cret@db.internal:6380/2"),
            "redis://:***@db.internal:6380/2"
        );
        assert_eq!(
            redact_url("redis://app:p@ss:w@rd@db:6379"),
            "redis://app:***@db:6379"
        );
        assert_eq!(redact_url("redis://token@db"), "redis://***@db");
        assert_eq!(
            redact_url("redis+unix:///run/redis.sock?db=1&pass=hunter2"),
            "redis+unix:///run/redis.sock?db=1&pass=***"
        );
        assert_eq!(
            redact_url("redis://127.0.0.1:6379/0"),
            "redis://127.0.0.1:6379/0"
        );
        assert_eq!(redact_url("not a url"), "not a url");
    }

    #[test]
    fn millis_round_up_and_stay_in_range() {
        assert_eq!(millis(Duration::ZERO), 1);
        assert_eq!(millis(Duration::from_micros(1)), 1);
        assert_eq!(millis(Duration::from_micros(1500)), 2);
        assert_eq!(millis(Duration::from_secs(30)), 30_000);
        assert_eq!(millis(Duration::MAX), MAX_MILLIS);
    }

    #[test]
    fn records_missing_fields_are_corrupt_not_panics() {
        let fp = Some(vec![7u8; 32]);
        let ok = decode_record(vec![
            Some(b"a".to_vec()),
            fp.clone(),
            None,
            Some(b"5".to_vec()),
            None,
        ]);
        assert!(matches!(ok, Ok(Some(Record::Ambiguous { .. }))));
        for fields in [
            vec![Some(b"f".to_vec()), fp.clone(), None, None, None],
            vec![
                Some(b"c".to_vec()),
                fp.clone(),
                None,
                Some(b"5".to_vec()),
                None,
            ],
            vec![
                Some(b"a".to_vec()),
                Some(vec![1, 2]),
                None,
                Some(b"5".to_vec()),
                None,
            ],
            vec![Some(b"x".to_vec()), fp.clone(), None, None, None],
            vec![None, fp.clone(), None, None, None],
            vec![None, None],
        ] {
            assert!(
                matches!(
                    decode_record(fields.clone()),
                    Err(StoreError::Corrupt { .. })
                ),
                "{fields:?}"
            );
        }
        assert!(matches!(decode_record(vec![None; 5]), Ok(None)));
    }

    #[test]
    fn persistence_that_can_lose_records_is_warned_about() {
        let read = Persistence::from_config;
        assert_eq!(
            read(Some("no"), Some("everysec")),
            Persistence::NotAppendOnly
        );
        assert_eq!(read(Some("no"), None), Persistence::NotAppendOnly);
        assert_eq!(
            read(Some("yes"), Some("always")),
            Persistence::AppendOnly {
                fsync: "always".to_owned()
            }
        );
        assert_eq!(read(None, None), Persistence::Unknown);
        assert_eq!(read(Some("yes"), None), Persistence::Unknown);
        assert_eq!(read(Some("maybe"), Some("always")), Persistence::Unknown);

        assert!(read(Some("no"), Some("always")).warning().is_some());
        assert!(read(Some("yes"), Some("no")).warning().is_some());
        assert!(read(Some("yes"), Some("everysec")).warning().is_none());
        assert!(read(Some("yes"), Some("always")).warning().is_none());
        assert!(Persistence::Unknown.warning().is_none());
    }

    #[test]
    fn a_refused_acquisition_is_a_data_loss() {
        let token = OwnerToken::generate();
        assert!(matches!(
            decode_claim(Value::Array(vec![Value::Int(6)]), token),
            Err(ClaimAnswer::DataLost)
        ));
    }

    #[test]
    fn unexpected_claim_answers_are_corrupt() {
        let token = OwnerToken::generate();
        assert_eq!(
            decode_claim(Value::Array(vec![Value::Int(0)]), token).ok(),
            Some(Claim::Acquired(token))
        );
        for answer in [
            Value::Nil,
            Value::Array(vec![]),
            Value::Array(vec![Value::Int(9)]),
            Value::Array(vec![Value::Int(2), Value::Int(1)]),
            Value::Array(vec![Value::Int(2), Value::BulkString(vec![0xff])]),
            Value::Array(vec![Value::Int(5)]),
            Value::Array(vec![Value::Int(6), Value::Int(1)]),
        ] {
            assert!(matches!(
                decode_claim(answer, token),
                Err(ClaimAnswer::Error(StoreError::Corrupt { .. }))
            ));
        }
    }
}
