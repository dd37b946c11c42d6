//! [`PostgresStore`]: records kept in a PostgreSQL table, shared by every gateway that points
//! at the database. The table, the statements, the settings a payments user needs and what a
//! failover can lose are documented on the type, where users of the re-export see them.

mod claim;
mod config;
mod reader;
mod schema;
mod sweep;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use deadpool_postgres::{
    Hook, HookError, Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod,
};
use tokio::time::{Instant, timeout_at};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

pub use self::config::PostgresStoreConfig;
use self::config::{connection_config, display_target, server_error, tls_connector};
use super::{
    Claim, ClaimOptions, Store, StoreError, Transition, UnknownOutcome, decode_completion,
};
use crate::record::{Completion, DecodeError, FingerprintHash, OwnerToken, Record, RecordKey};

const BACKEND: &str = "postgres";

/// Durations are sent in whole microseconds, capped at about a hundred years, inside what
/// `timestamptz` holds and what a `float8` carries exactly.
const MAX_MICROS: u64 = 100 * 365 * 24 * 3600 * 1_000_000;
const _: () = assert!(
    MAX_MICROS < 1 << 53,
    "every duration sent is exact in a float8"
);

/// Records kept in a PostgreSQL table, shared by every gateway that points at the same
/// database.
///
/// Cloning is cheap and shares the connection pool.
///
/// ```no_run
/// # async fn example() -> Result<(), idemgate::store::StoreError> {
/// use idemgate::store::{PostgresStore, PostgresStoreConfig};
///
/// let store = PostgresStore::connect(PostgresStoreConfig::new(
///     "postgres://idemgate@db.internal/app?sslmode=require",
/// ))
/// .await?;
/// let layer = idemgate::IdempotencyLayer::new(std::sync::Arc::new(store));
/// # let _ = layer;
/// # Ok(())
/// # }
/// ```
///
/// # How records are kept
///
/// One row per record in `idemgate_records`: `key` (the 32-byte [`RecordKey`], the primary
/// key), `state` (`in_flight`, `completed` or `ambiguous`), `fingerprint` (32 bytes), `owner`
/// (the 16-byte owner token, while in flight), `lease_deadline` (while in flight),
/// `stored_at` (when the record took its state), `expires_at`, and `body` (the completion in
/// [`Completion::encode`]'s binary form, while completed). [`connect`](Self::connect)
/// creates the table (and an index on `expires_at`) when it is missing; `idemgate_schema`
/// holds the version of its layout, [`SCHEMA_VERSION`](Self::SCHEMA_VERSION) for this build
/// ([`connect_lazy`](Self::connect_lazy) does the same at its first successful connection).
/// A table of a newer version is refused with an error naming both versions (at start, or by
/// every call of a lazily connected store), so an older gateway never misreads a newer one's
/// records. Point gateways for different applications at different databases, or schemas
/// (`options=-c search_path=…` in the URL).
///
/// # Statements
///
/// Every transition is one statement, so one round trip and one atomic step in PostgreSQL,
/// prepared once per connection. A claim is a single `INSERT … ON CONFLICT … DO UPDATE …
/// WHERE` the record expired or its lease lapsed, `… RETURNING`, with a read of the record in
/// the same statement that answers when nothing is to change (a replay, a request in flight,
/// a mismatch) without writing or locking anything, so such answers wait for no WAL flush; it
/// translates the decision every store shares (see `src/store/decision.rs`). While retries
/// are common (see below), a claim first reads the record with a plain `SELECT` and answers
/// from it when the claim would change nothing, running the claim statement, which judges
/// the row again itself, only when the record must change. Complete, release, renew and mark-ambiguous are each an
/// `UPDATE` (or `DELETE`) `… WHERE owner = $token AND state = 'in_flight'` on a live record.
/// The gateway never reads a record and then writes it. Every time — leases, expiry, the
/// times [`get`](Store::get) reports — is the database's `now()`, never a gateway's clock, so
/// gateways with skewed clocks still agree.
///
/// Expired rows are never returned, and are deleted in batches of
/// [`sweep_batch`](PostgresStoreConfig::sweep_batch), one after another while they come
/// back full, through the index on `expires_at` by a background task every
/// [`sweep_interval`](PostgresStoreConfig::sweep_interval), by one
/// gateway at a time (`pg_try_advisory_xact_lock`); see
/// [`delete_expired`](Self::delete_expired).
///
/// # Configuring PostgreSQL for payments
///
/// A record lost is a request a retry runs a second time. PostgreSQL acknowledges a commit
/// once its WAL is flushed to disk with `synchronous_commit = on` (its default): keep it so
/// for the gateway's user (`ALTER ROLE idemgate SET synchronous_commit = on` if the database
/// default is lower). With `off`, a server crash can lose the last few hundred milliseconds
/// of acknowledged claims and completions.
///
/// With asynchronous streaming replication, a failover to a replica loses what the old
/// primary had committed and not yet sent. `synchronous_commit = remote_apply` (or `on`)
/// with `synchronous_standby_names` makes each commit wait for a standby, which narrows that
/// window to nothing for the standbys named, at the cost of a network round trip per
/// transition. Read replicas must not serve the gateway: every call writes or must see the
/// latest write. The gateway's record can never commit in the same transaction as the
/// upstream's own writes (they are separate systems): a request whose record is lost is run
/// again, so where a second execution is unacceptable the upstream should also deduplicate
/// on the `Idempotency-Key` header, which idemgate always forwards.
///
/// # Connections and timeouts
///
/// A pool of up to [`pool_size`](PostgresStoreConfig::pool_size) connections
/// (`deadpool-postgres`). Each write has a connection to itself, so commits waiting for
/// their WAL flush share one flush across sessions. Reads (a claim's first read, and
/// [`get`](Store::get)) share one of the pool's connections, pipelined, when the pool has two
/// or more: reading first pays while at least about every other recent claim found a record
/// that answers it without a write (a replay, a request in flight, a mismatch), and claims
/// read first only then; once that connection is open, such answers wait for no other, and
/// keep coming while every write waits. Traffic of mostly new keys goes straight to the claim statement.
/// Each call is bounded by
/// [`timeout`](PostgresStoreConfig::timeout) — waiting for a connection, connecting and
/// running its statement included — and fails with [`StoreError::Timeout`] once it passes;
/// the same value is each session's `statement_timeout`, so the server stops working on a
/// statement the gateway stopped waiting for. Sessions also run with `enable_seqscan = off`:
/// a session keeps a statement's plan for its life, and a plan made while autovacuum had just
/// emptied the table would otherwise read the whole table once it has grown again (every
/// statement of the store has an index to use). Both come as the session's startup
/// `options`; each new session is checked for `enable_seqscan = off` and refused without it,
/// as behind a pooler that drops the options silently (PgBouncer with
/// `ignore_startup_parameters = options`). A connection that timed out is closed, never
/// reused. A connection the server closed is replaced at its next use: the gateway answers
/// `503` while PostgreSQL is away and works again, without a restart, as soon as it is back.
///
/// A call that times out may still commit in PostgreSQL. The layer undoes such a claim with
/// a fenced release under the token it chose for it; that release may run on another
/// connection before the claim commits (at most `timeout` later, when `statement_timeout`
/// stops it), and then the claim stays until its lease lapses, as when a gateway dies.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

/// What every clone of a store shares; the background sweep holds it only while it runs.
struct Inner {
    pool: Pool,
    timeout: Duration,
    /// The server, without its password, for logs and errors.
    server: Arc<str>,
    sweep_batch: u32,
    /// Whether the tables are set up on the server (see [`schema::Check`]).
    schema: schema::Check,
    /// The connection reads share (see [`reader`]); none with a pool of one connection,
    /// where it would leave none for writes.
    reader: Option<reader::Slot>,
    /// Whether claims read first, from what recent claims found.
    read_hits: reader::ReadHits,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("server", &self.inner.server)
            .field("timeout", &self.inner.timeout)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// The version of the records table's layout this build reads and writes, kept in
    /// `idemgate_schema`; [`connect`](Self::connect) refuses a newer one.
    ///
    /// ```
    /// assert_eq!(idemgate::store::PostgresStore::SCHEMA_VERSION, 2);
    /// ```
    pub const SCHEMA_VERSION: i32 = schema::SCHEMA_VERSION;

    /// Connects to PostgreSQL, creates the tables if they are missing (or checks their
    /// schema version), and starts the background deletion of expired records on the current
    /// Tokio runtime.
    ///
    /// Fails, within about three store timeouts, with a [`StoreError::Unavailable`] whose
    /// source names the server (without its password) when the URL is invalid, the server
    /// cannot be reached, or the table's schema is newer than this build's. Use
    /// [`connect_lazy`](Self::connect_lazy) to start without PostgreSQL and let readiness
    /// checks report it.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), idemgate::store::StoreError> {
    /// use idemgate::store::{PostgresStore, PostgresStoreConfig};
    ///
    /// let store = PostgresStore::connect(PostgresStoreConfig::new("postgresql://idemgate@127.0.0.1/app")).await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(config: PostgresStoreConfig) -> Result<Self, StoreError> {
        let store = Self::connect_lazy(config)?;
        let deadline = Instant::now() + store.inner.timeout.saturating_mul(3);
        drop(store.inner.client(deadline).await?);
        Ok(store)
    }

    /// Sets the store up without contacting PostgreSQL, and starts the background deletion
    /// of expired records on the current Tokio runtime. Calls fail with a [`StoreError`]
    /// until the server answers; the first call whose connection succeeds (a request's, a
    /// readiness [`ping`](Store::ping)'s or the background deletion's) creates the tables or
    /// checks their version, as [`connect`](Self::connect) does, before anything else runs
    /// on that server.
    ///
    /// A table whose schema is newer than this build's makes every call fail with a
    /// [`StoreError::Unavailable`] naming both versions; the version is read again at most
    /// once a second, so the store works once the table is one it can read.
    ///
    /// Fails only when the URL is invalid (see [`PostgresStoreConfig::validate`]) or when
    /// called outside a Tokio runtime.
    ///
    /// ```no_run
    /// # async fn example() -> Result<(), idemgate::store::StoreError> {
    /// use idemgate::store::{PostgresStore, PostgresStoreConfig, Store};
    ///
    /// let store = PostgresStore::connect_lazy(PostgresStoreConfig::new("postgres://idemgate@db.internal/app"))?;
    /// let ready = store.ping().await.is_ok();
    /// # let _ = ready;
    /// # Ok(())
    /// # }
    /// ```
    pub fn connect_lazy(config: PostgresStoreConfig) -> Result<Self, StoreError> {
        let pg = connection_config(&config)?;
        let server: Arc<str> = display_target(&pg).into();
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(server_error(
                &server,
                "the store must be set up inside a Tokio runtime",
                None,
            ));
        }
        let tls = tls_connector(&server, pg.get_ssl_mode())?;
        let manager = Manager::from_config(
            pg,
            tls,
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool_size = config.pool_size.max(1);
        let pool = Pool::builder(manager)
            .max_size(pool_size)
            .post_create(Hook::async_fn(|client, _| {
                Box::pin(async move { config::check_session(client).await })
            }))
            .build()
            .map_err(|e| server_error(&server, "cannot build the pool", Some(Box::new(e))))?;
        let inner = Arc::new(Inner {
            pool,
            timeout: config.timeout,
            server,
            sweep_batch: config.sweep_batch.max(1),
            schema: schema::Check::default(),
            reader: (pool_size > 1).then(reader::Slot::default),
            read_hits: reader::ReadHits::default(),
        });
        sweep::spawn_sweeper(Arc::downgrade(&inner), config.sweep_interval);
        Ok(Self { inner })
    }

    /// Deletes one batch of expired records (the oldest first, at most
    /// [`sweep_batch`](PostgresStoreConfig::sweep_batch)) and returns how many it deleted:
    /// `Some(0)` when none had expired, `None` when another gateway is deleting right now
    /// (one gateway at a time holds the advisory lock). The background task calls it every
    /// [`sweep_interval`](PostgresStoreConfig::sweep_interval), again and again while it
    /// deletes a full batch; expired records are never
    /// returned meanwhile, so calling it only frees space sooner.
    ///
    /// ```no_run
    /// # async fn example(store: idemgate::store::PostgresStore) -> Result<(), idemgate::store::StoreError> {
    /// while let Some(deleted) = store.delete_expired().await? {
    ///     if deleted == 0 {
    ///         break;
    ///     }
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn delete_expired(&self) -> Result<Option<u64>, StoreError> {
        self.inner.delete_expired_batch().await
    }

    /// Runs one fenced transition: `Applied` if `sql` returned a row.
    async fn transition(
        &self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Transition, StoreError> {
        let rows = self.inner.query(self.inner.deadline(), sql, params).await?;
        Ok(if rows.is_empty() {
            Transition::Fenced
        } else {
            Transition::Applied
        })
    }
}

impl Inner {
    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    /// Runs `sql` with `params` on a pooled connection, prepared once per connection, and
    /// returns its rows; everything, waiting for the connection included, by `deadline`. A
    /// connection whose statement timed out is closed rather than handed to the next call,
    /// which would otherwise wait behind a statement no one awaits.
    async fn query(
        &self,
        deadline: Instant,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let client = self.client(deadline).await?;
        match timeout_at(deadline, run(&client, sql, params)).await {
            Ok(rows) => rows.map_err(|e| self.pg_error(e)),
            Err(_) => {
                drop(Object::take(client));
                Err(self.timeout_error())
            }
        }
    }

    /// Runs the read-only `sql` with `params` on the shared reader (see [`reader`]), pipelined
    /// with the other calls' reads, by `deadline`; on a pooled connection of its own when
    /// the pool has one connection.
    async fn read(
        &self,
        deadline: Instant,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let Some(slot) = &self.reader else {
            return self.query(deadline, sql, params).await;
        };
        let reader = match timeout_at(deadline, slot.get(self.client(deadline))).await {
            Ok(reader) => reader?,
            Err(_) => return Err(self.timeout_error()),
        };
        match timeout_at(deadline, run(&reader, sql, params)).await {
            Ok(Ok(rows)) => Ok(rows),
            Ok(Err(e)) => {
                if reader.is_closed() {
                    slot.forget(&reader);
                }
                Err(self.pg_error(e))
            }
            Err(_) => {
                // The calls pipelined behind this one would wait for it too: the next reads
                // go to another connection, and this one is closed once its last read ends.
                reader.discard();
                slot.forget(&reader);
                Err(self.timeout_error())
            }
        }
    }

    /// A pooled connection, by `deadline` (opening a new one if none is idle), on a server
    /// whose tables are set up: the first connection to succeed sets them up (see
    /// [`schema::Check`]).
    async fn client(&self, deadline: Instant) -> Result<Object, StoreError> {
        self.schema.recent_refusal(&self.server)?;
        let mut client = match timeout_at(deadline, self.pool.get()).await {
            Ok(Ok(client)) => client,
            Ok(Err(PoolError::Backend(e) | PoolError::PostCreateHook(HookError::Backend(e)))) => {
                return Err(self.pg_error(e));
            }
            Ok(Err(PoolError::PostCreateHook(HookError::Message(why)))) => {
                return Err(server_error(
                    &self.server,
                    "session refused",
                    Some(why.into_owned().into()),
                ));
            }
            Ok(Err(PoolError::Timeout(_))) | Err(_) => return Err(self.timeout_error()),
            Ok(Err(e)) => {
                return Err(server_error(
                    &self.server,
                    "no connection",
                    Some(Box::new(e)),
                ));
            }
        };
        if self.schema.is_ready() {
            return Ok(client);
        }
        let setup = self
            .schema
            .ensure(&mut client, &self.server, |e| self.pg_error(e));
        match timeout_at(deadline, setup).await {
            Ok(Ok(())) => Ok(client),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                drop(Object::take(client));
                Err(self.timeout_error())
            }
        }
    }

    /// One batch of [`PostgresStore::delete_expired`], in a transaction that holds the
    /// sweep's advisory lock.
    async fn delete_expired_batch(&self) -> Result<Option<u64>, StoreError> {
        let deadline = self.deadline();
        let mut client = self.client(deadline).await?;
        let batch = i64::from(self.sweep_batch);
        let run = async {
            let tx = client.transaction().await?;
            let try_lock = tx.prepare_cached(sweep::TRY_LOCK).await?;
            let locked: bool = tx.query_one(&try_lock, &[&sweep::SWEEP_LOCK]).await?.get(0);
            if !locked {
                return Ok(None);
            }
            let delete = tx.prepare_cached(sweep::DELETE_EXPIRED).await?;
            let deleted = tx.execute(&delete, &[&batch]).await?;
            tx.commit().await?;
            Ok(Some(deleted))
        };
        match timeout_at(deadline, run).await {
            Ok(deleted) => deleted.map_err(|e| self.pg_error(e)),
            Err(_) => {
                drop(Object::take(client));
                Err(self.timeout_error())
            }
        }
    }

    /// A statement cancelled by `statement_timeout` is a timeout; anything else means the
    /// server could not be reached or refused the statement.
    fn pg_error(&self, e: tokio_postgres::Error) -> StoreError {
        if e.code() == Some(&SqlState::QUERY_CANCELED) {
            return self.timeout_error();
        }
        server_error(&self.server, "call failed", Some(Box::new(e)))
    }

    fn timeout_error(&self) -> StoreError {
        StoreError::Timeout {
            backend: BACKEND,
            after: self.timeout,
        }
    }
}

/// Runs `sql`, prepared once per connection, with `params` on `client`.
async fn run(
    client: &Object,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<Row>, tokio_postgres::Error> {
    let statement = client.prepare_cached(sql).await?;
    client.query(&statement, params).await
}

/// Whole microseconds, rounded up (a sub-microsecond duration must not become "expire now"),
/// at least 1 and at most [`MAX_MICROS`], as the `float8` the statements multiply.
fn micros(d: Duration) -> f64 {
    let us = d.as_nanos().div_ceil(1_000);
    us.clamp(1, u128::from(MAX_MICROS)) as f64
}

fn corrupt(what: &'static str) -> StoreError {
    StoreError::Corrupt {
        backend: BACKEND,
        source: DecodeError::new(what),
    }
}

/// `$1` key, `$2` token, `$3` completion, `$4` ttl (µs).
const COMPLETE: &str = "
UPDATE idemgate_records
SET state = 'completed', owner = NULL, lease_deadline = NULL, body = $3, stored_at = now(),
    expires_at = now() + $4::float8 * interval '1 microsecond'
WHERE key = $1 AND owner = $2 AND state = 'in_flight' AND expires_at > now()
RETURNING true";

/// `$1` key, `$2` token.
const RELEASE: &str = "
DELETE FROM idemgate_records
WHERE key = $1 AND owner = $2 AND state = 'in_flight' AND expires_at > now()
RETURNING true";

/// `$1` key, `$2` token, `$3` lease (µs). The record lives at least as long as its lease.
const RENEW: &str = "
UPDATE idemgate_records
SET lease_deadline = now() + $3::float8 * interval '1 microsecond',
    expires_at = greatest(expires_at, now() + $3::float8 * interval '1 microsecond')
WHERE key = $1 AND owner = $2 AND state = 'in_flight' AND expires_at > now()
RETURNING true";

/// `$1` key, `$2` token, `$3` ttl (µs).
const MARK_AMBIGUOUS: &str = "
UPDATE idemgate_records
SET state = 'ambiguous', owner = NULL, lease_deadline = NULL, stored_at = now(),
    expires_at = now() + $3::float8 * interval '1 microsecond'
WHERE key = $1 AND owner = $2 AND state = 'in_flight' AND expires_at > now()
RETURNING true";

/// `$1` key.
const GET: &str = "
SELECT state, fingerprint, lease_deadline, stored_at, body
FROM idemgate_records WHERE key = $1 AND expires_at > now()";

/// `$1` key. Whether the row deleted was live (an expired one is no record).
const DELETE: &str = "DELETE FROM idemgate_records WHERE key = $1 RETURNING expires_at > now()";

fn decode_record(row: &Row) -> Result<Record, StoreError> {
    let state: &str = claim::get(row, 0)?;
    let fingerprint: &[u8] = claim::get(row, 1)?;
    let fingerprint = <[u8; 32]>::try_from(fingerprint)
        .map(FingerprintHash)
        .map_err(|_| corrupt("record without a valid fingerprint"))?;
    let stored_at: SystemTime = claim::get(row, 3)?;
    match state {
        "in_flight" => Ok(Record::InFlight {
            fingerprint,
            lease_deadline: claim::get::<Option<SystemTime>>(row, 2)?
                .ok_or_else(|| corrupt("in-flight record without a lease deadline"))?,
        }),
        "completed" => {
            let body: Vec<u8> = claim::get::<Option<Vec<u8>>>(row, 4)?
                .ok_or_else(|| corrupt("completed record without a body"))?;
            Ok(Record::Completed {
                fingerprint,
                completion: decode_completion(BACKEND, Bytes::from(body))?,
                stored_at,
            })
        }
        "ambiguous" => Ok(Record::Ambiguous {
            fingerprint,
            since: stored_at,
        }),
        _ => Err(corrupt("record with an unknown state")),
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        token: OwnerToken,
        options: &ClaimOptions,
    ) -> Result<Claim, StoreError> {
        let deadline = self.inner.deadline();
        let owner = token.0.to_be_bytes();
        let lease = micros(options.lease);
        let ttl = micros(options.ttl);
        let retry = options.on_lapse == UnknownOutcome::Retry;
        let params: [&(dyn ToSql + Sync); 6] = [
            &&key.0[..],
            &&fingerprint.0[..],
            &&owner[..],
            &lease,
            &ttl,
            &retry,
        ];
        // While retries are common, the record as it is, read without a write: when the
        // claim would change nothing (a replay, a request in flight, a mismatch) it answers.
        let read_first = self.inner.read_hits.read_first();
        if read_first {
            let rows = self
                .inner
                .read(deadline, claim::FOUND, &params[..2])
                .await?;
            let answer = claim::read(&rows, token, options.on_lapse)?;
            self.inner
                .read_hits
                .record(matches!(answer, claim::Answer::Found(_)));
            if let claim::Answer::Found(answer) = answer {
                return Ok(answer);
            }
        }
        for attempt in 0..claim::ATTEMPTS {
            let rows = self.inner.query(deadline, claim::CLAIM, &params).await?;
            let (answer, found) = match claim::read(&rows, token, options.on_lapse)? {
                claim::Answer::Written(answer) => (answer, false),
                claim::Answer::Found(answer) => (answer, true),
                claim::Answer::Again => continue,
            };
            if !read_first && attempt == 0 {
                self.inner.read_hits.record(found);
            }
            return Ok(answer);
        }
        Err(server_error(
            &self.inner.server,
            format!(
                "the record changed under each of {} claims in a row; try again",
                claim::ATTEMPTS
            ),
            None,
        ))
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        let body = completion.encode();
        let owner = token.0.to_be_bytes();
        let ttl = micros(ttl);
        self.transition(COMPLETE, &[&&key.0[..], &&owner[..], &&body[..], &ttl])
            .await
    }

    async fn release(&self, key: &RecordKey, token: OwnerToken) -> Result<Transition, StoreError> {
        let owner = token.0.to_be_bytes();
        self.transition(RELEASE, &[&&key.0[..], &&owner[..]]).await
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Transition, StoreError> {
        let owner = token.0.to_be_bytes();
        let lease = micros(lease);
        self.transition(RENEW, &[&&key.0[..], &&owner[..], &lease])
            .await
    }

    async fn mark_ambiguous(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        let owner = token.0.to_be_bytes();
        let ttl = micros(ttl);
        self.transition(MARK_AMBIGUOUS, &[&&key.0[..], &&owner[..], &ttl])
            .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let rows = self
            .inner
            .read(self.inner.deadline(), GET, &[&&key.0[..]])
            .await?;
        rows.first().map(decode_record).transpose()
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let rows = self
            .inner
            .query(self.inner.deadline(), DELETE, &[&&key.0[..]])
            .await?;
        match rows.first() {
            Some(row) => claim::get(row, 0),
            None => Ok(false),
        }
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner
            .query(self.inner.deadline(), "SELECT 1", &[])
            .await
            .map(drop)
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micros_round_up_and_stay_in_range() {
        assert_eq!(micros(Duration::ZERO), 1.0);
        assert_eq!(micros(Duration::from_nanos(1)), 1.0);
        assert_eq!(micros(Duration::from_nanos(1_500)), 2.0);
        assert_eq!(micros(Duration::from_secs(30)), 30_000_000.0);
        assert_eq!(micros(Duration::MAX), MAX_MICROS as f64);
    }
}
