//! `PostgresStore` against a real PostgreSQL server (run `.ci/install-deps` if it is missing):
//! the whole conformance suite, and what is PostgreSQL's own — the schema version, a stopped
//! and restarted server, the deletion of expired rows, the database's clock.

#![cfg(feature = "postgres")]

use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, StatusCode};
use idemgate::record::{
    Completion, FingerprintHash, OwnerToken, Record, RecordKey, StoredResponse,
};
use idemgate::store::{
    Claim, ClaimOptions, PostgresStore, PostgresStoreConfig, Store, StoreError, Transition,
    UnknownOutcome,
};
use test_servers::PostgresServer;

/// The whole contract, each check on its own server (stopped once the check is done).
mod conformance {
    idemgate::store_conformance_tests!(super::store_on_own_server());
}

/// A store on a fresh server, and the server.
async fn store_on_own_server() -> (PostgresStore, PostgresServer) {
    let server = PostgresServer::start();
    let store = connect(config(&server)).await;
    (store, server)
}

/// Short enough that fault tests finish quickly, long enough for a loaded 2-core machine.
const FAULT_TIMEOUT: Duration = Duration::from_millis(500);

/// The lock the background deletion of expired rows holds while it deletes (see
/// `crates/idemgate/src/store/postgres/sweep.rs`).
const SWEEP_LOCK: i64 = 0x6964_656d_6761_7466;

fn config(server: &PostgresServer) -> PostgresStoreConfig {
    let mut config = PostgresStoreConfig::new(server.url());
    config.password = None;
    // Slow enough for a loaded CI machine running several servers.
    config.timeout = Duration::from_secs(5);
    config
}

async fn connect(config: PostgresStoreConfig) -> PostgresStore {
    PostgresStore::connect(config)
        .await
        .unwrap_or_else(|e| panic!("connect to the test postgres: {}", chain(&e)))
}

/// A plain connection to inspect and change what the store wrote.
async fn raw(server: &PostgresServer) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .expect("raw connection to the test postgres");
    tokio::spawn(connection);
    client
}

async fn row_count(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM idemgate_records", &[])
        .await
        .expect("count the records")
        .get(0)
}

/// An error and its causes on one line.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

fn options(lease: Duration, ttl: Duration) -> ClaimOptions {
    ClaimOptions {
        lease,
        ttl,
        on_lapse: UnknownOutcome::Ambiguous,
    }
}

fn key(name: &str) -> RecordKey {
    RecordKey::of(name.as_bytes())
}

fn fingerprint(name: &str) -> FingerprintHash {
    FingerprintHash::of(format!("fingerprint {name}").as_bytes())
}

fn response(body: &'static [u8]) -> Completion {
    Completion::Response(StoredResponse {
        status: StatusCode::CREATED,
        headers: HeaderMap::new(),
        body: Bytes::from_static(body),
    })
}

async fn claim(
    store: &PostgresStore,
    name: &str,
    options: &ClaimOptions,
) -> Result<Claim, StoreError> {
    store
        .claim(
            &key(name),
            &fingerprint(name),
            OwnerToken::generate(),
            options,
        )
        .await
}

async fn acquire(store: &PostgresStore, name: &str, options: &ClaimOptions) -> OwnerToken {
    match claim(store, name, options).await {
        Ok(Claim::Acquired(token)) => token,
        other => panic!("expected Acquired for {name}, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_newer_than_the_build_is_refused_naming_both_versions() {
    let server = PostgresServer::start();
    let first = connect(config(&server)).await;
    drop(first);
    // Setting up again on the same database finds the table and keeps it.
    let again = connect(config(&server)).await;
    acquire(
        &again,
        "kept",
        &options(Duration::from_secs(30), Duration::from_secs(60)),
    )
    .await;
    drop(again);

    let newer = PostgresStore::SCHEMA_VERSION + 1;
    raw(&server)
        .await
        .execute("UPDATE idemgate_schema SET version = $1", &[&newer])
        .await
        .expect("raise the schema version");
    let refused = PostgresStore::connect(config(&server))
        .await
        .expect_err("a newer schema must be refused");
    let message = chain(&refused);
    assert!(
        matches!(
            refused,
            StoreError::Unavailable {
                backend: "postgres",
                ..
            }
        ),
        "{message}"
    );
    assert!(
        message.contains(&format!("schema version {newer}"))
            && message.contains(&format!(
                "version {} that this idemgate",
                PostgresStore::SCHEMA_VERSION
            )),
        "the message must name both versions: {message}"
    );
}

/// The layout version 1 wrote, with its three `CHECK` constraints.
const SCHEMA_V1: &str = "
CREATE TABLE idemgate_schema (
    id boolean PRIMARY KEY DEFAULT true CHECK (id),
    version integer NOT NULL
);
CREATE TABLE idemgate_records (
    key bytea PRIMARY KEY,
    state text NOT NULL CHECK (state IN ('in_flight', 'completed', 'ambiguous')),
    fingerprint bytea NOT NULL,
    owner bytea,
    lease_deadline timestamptz,
    stored_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    body bytea,
    CHECK ((state = 'in_flight') = (owner IS NOT NULL AND lease_deadline IS NOT NULL)),
    CHECK ((state = 'completed') = (body IS NOT NULL))
) WITH (autovacuum_vacuum_scale_factor = 0.01, autovacuum_analyze_scale_factor = 0.02);
CREATE INDEX idemgate_records_expires_at ON idemgate_records (expires_at);
INSERT INTO idemgate_schema (version) VALUES (1);
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_table_is_migrated_and_keeps_its_records() {
    let server = PostgresServer::start();
    let client = raw(&server).await;
    client
        .batch_execute(SCHEMA_V1)
        .await
        .expect("lay out version 1");
    client
        .execute(
            "INSERT INTO idemgate_records (key, state, fingerprint, owner, lease_deadline, \
             stored_at, expires_at) VALUES ($1, 'in_flight', $2, $3, now() + interval '1 hour', \
             now(), now() + interval '1 hour')",
            &[
                &&key("held").0[..],
                &&fingerprint("held").0[..],
                &&[7u8; 16][..],
            ],
        )
        .await
        .expect("a version 1 record");

    let store = connect(config(&server)).await;
    let version: i32 = client
        .query_one("SELECT version FROM idemgate_schema", &[])
        .await
        .expect("the version")
        .get(0);
    assert_eq!(version, PostgresStore::SCHEMA_VERSION);
    let checks: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_constraint \
             WHERE conrelid = 'idemgate_records'::regclass AND contype = 'c'",
            &[],
        )
        .await
        .expect("count the constraints")
        .get(0);
    assert_eq!(checks, 0, "the CHECK constraints are gone");
    let long = options(Duration::from_secs(30), Duration::from_secs(3600));
    let held = claim(&store, "held", &long).await;
    assert!(matches!(held, Ok(Claim::InFlight { .. })), "{held:?}");
    acquire(&store, "new", &long).await;
    // A second gateway finds version 2 and changes nothing.
    connect(config(&server)).await;
    assert_eq!(row_count(&client).await, 2);
}

/// A lazily connected store is made while the server is down, fails every call meanwhile,
/// and sets the tables up at its first successful connection; one that finds a newer table
/// fails every call naming both versions, and works again once the table is one it reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lazy_store_starts_without_the_server_and_sets_up_at_its_first_connection() {
    let mut server = PostgresServer::start();
    server.stop();
    let mut config = config(&server);
    config.timeout = FAULT_TIMEOUT;
    let store = PostgresStore::connect_lazy(config.clone()).expect("made without the server");
    let long = options(Duration::from_secs(30), Duration::from_secs(3600));
    assert!(store.ping().await.is_err(), "ping while postgres is down");
    assert!(claim(&store, "early", &long).await.is_err());

    server.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(e) = store.ping().await {
        assert!(Instant::now() < deadline, "never ready: {}", chain(&e));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    acquire(&store, "first", &long).await;
    let client = raw(&server).await;
    assert_eq!(row_count(&client).await, 1, "the table was created");

    let newer = PostgresStore::SCHEMA_VERSION + 1;
    client
        .execute("UPDATE idemgate_schema SET version = $1", &[&newer])
        .await
        .expect("raise the schema version");
    let refusing = PostgresStore::connect_lazy(config).expect("made without contacting it");
    for call in 0..3 {
        let message = match call {
            0 => chain(
                &refusing
                    .ping()
                    .await
                    .expect_err("a newer schema is refused"),
            ),
            _ => chain(
                &claim(&refusing, "refused", &long)
                    .await
                    .expect_err("refused"),
            ),
        };
        assert!(
            message.contains(&format!("schema version {newer}"))
                && message.contains(&format!(
                    "version {} that this idemgate",
                    PostgresStore::SCHEMA_VERSION
                )),
            "call {call} must name both versions: {message}"
        );
    }
    client
        .execute(
            "UPDATE idemgate_schema SET version = $1",
            &[&PostgresStore::SCHEMA_VERSION],
        )
        .await
        .expect("restore the schema version");
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(e) = refusing.ping().await {
        assert!(Instant::now() < deadline, "still refused: {}", chain(&e));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(matches!(
        claim(&refusing, "first", &long).await,
        Ok(Claim::InFlight { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_is_unavailable_quickly_and_served_again_once_back() {
    stopped_and_restarted(false).await;
}

/// The same with claims reading first: the shared reader's connection dies with the server,
/// and the next read after the restart opens another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_is_served_again_once_back_while_claims_read_first() {
    stopped_and_restarted(true).await;
}

/// Reads held up on the server (here by a lock on the whole table) time out within the
/// store timeout, and once the server answers again the next reads are served, on a
/// connection other than the one left running the timed-out statements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_that_time_out_are_served_again_afterwards() {
    let server = PostgresServer::start();
    let mut config = config(&server);
    config.timeout = FAULT_TIMEOUT;
    let store = connect(config).await;
    let long = options(Duration::from_secs(30), Duration::from_secs(3600));
    completed(&store, "kept", &long).await;
    retries(&store, "kept", &long, 12).await;

    let mut locker = raw(&server).await;
    let lock = locker.transaction().await.expect("begin");
    lock.batch_execute("LOCK TABLE idemgate_records IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock the table");
    for call in 0..3 {
        let started = Instant::now();
        let result = claim(&store, "kept", &long).await;
        assert!(
            matches!(result, Err(StoreError::Timeout { .. })),
            "call {call} while the table is locked: {result:?}"
        );
        assert!(
            started.elapsed() < FAULT_TIMEOUT * 3,
            "call {call} took {:?}",
            started.elapsed()
        );
    }
    lock.rollback().await.expect("unlock the table");
    for _ in 0..20 {
        let replay = claim(&store, "kept", &long).await;
        assert!(matches!(replay, Ok(Claim::Completed(_))), "{replay:?}");
    }
}

/// A server stopped under a store: calls fail within the store timeout, and the same store
/// serves again once the server is back. `reading_first`: after a run of replays.
async fn stopped_and_restarted(reading_first: bool) {
    let mut server = PostgresServer::start();
    let mut config = config(&server);
    config.timeout = FAULT_TIMEOUT;
    let store = connect(config).await;
    let long = options(Duration::from_secs(30), Duration::from_secs(3600));
    let token = acquire(&store, "kept", &long).await;
    assert_eq!(
        store
            .complete(
                &key("kept"),
                token,
                response(b"kept"),
                Duration::from_secs(3600)
            )
            .await
            .expect("complete"),
        Transition::Applied
    );
    if reading_first {
        retries(&store, "kept", &long, 12).await;
    }

    server.stop();
    for call in 0..3 {
        let started = Instant::now();
        let result = claim(&store, "while-down", &long).await;
        let took = started.elapsed();
        assert!(
            matches!(
                result,
                Err(StoreError::Unavailable {
                    backend: "postgres",
                    ..
                } | StoreError::Timeout {
                    backend: "postgres",
                    ..
                })
            ),
            "call {call} while postgres is stopped: {result:?}"
        );
        assert!(
            took < FAULT_TIMEOUT * 3,
            "call {call} took {took:?} to fail, more than the store timeout allows"
        );
    }
    assert!(
        store.ping().await.is_err(),
        "ping while postgres is stopped"
    );

    server.restart();
    // The same store, without re-creating it: the pool replaces its dead connections.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match claim(&store, "kept", &long).await {
            Ok(Claim::Completed(c)) => {
                assert_eq!(*c, response(b"kept"), "the replay after the restart");
                break;
            }
            other if Instant::now() < deadline => {
                let _ = other;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("postgres is back, yet the store answers {other:?}"),
        }
    }
    acquire(&store, "after-restart", &long).await;
    store.ping().await.expect("ping once postgres is back");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_rows_are_never_returned_and_deleted_in_bounded_batches() {
    let server = PostgresServer::start();
    let mut config = config(&server);
    config.sweep_batch = 10;
    // No background run during the test: the test calls each batch itself.
    config.sweep_interval = Duration::from_secs(3600);
    let store = connect(config).await;
    let raw = raw(&server).await;

    let short = options(Duration::from_millis(100), Duration::from_millis(200));
    let long = options(Duration::from_secs(30), Duration::from_secs(3600));
    for i in 0..35 {
        acquire(&store, &format!("short-{i}"), &short).await;
    }
    for i in 0..5 {
        acquire(&store, &format!("long-{i}"), &long).await;
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        row_count(&raw).await,
        40,
        "nothing is deleted before a sweep"
    );

    // Expired rows are never returned, though still in the table.
    assert_eq!(store.get(&key("short-0")).await.expect("get"), None);
    assert!(
        !store.delete(&key("short-1")).await.expect("delete"),
        "an expired row is no record"
    );
    assert_eq!(row_count(&raw).await, 39);
    // A claim takes an expired row over.
    acquire(&store, "short-2", &long).await;

    // Held by another gateway: this one leaves the table alone.
    let mut other = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .expect("a second connection");
    tokio::spawn(other.1);
    let other_tx = other.0.transaction().await.expect("begin");
    let held: bool = other_tx
        .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&SWEEP_LOCK])
        .await
        .expect("take the sweep lock")
        .get(0);
    assert!(held);
    assert_eq!(store.delete_expired().await.expect("delete_expired"), None);
    assert_eq!(
        row_count(&raw).await,
        39,
        "deleted while another gateway sweeps"
    );
    other_tx.rollback().await.expect("rollback");

    // 33 expired rows left, in batches of at most 10.
    let mut batches = Vec::new();
    for _ in 0..10 {
        let deleted = store
            .delete_expired()
            .await
            .expect("delete_expired")
            .expect("the sweep lock is free");
        batches.push(deleted);
        if deleted == 0 {
            break;
        }
    }
    assert_eq!(
        batches,
        [10, 10, 10, 3, 0],
        "batches of expired rows deleted"
    );
    assert_eq!(row_count(&raw).await, 6, "the live records are left");
    for i in 0..5 {
        assert!(matches!(
            store.get(&key(&format!("long-{i}"))).await.expect("get"),
            Some(Record::InFlight { .. })
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_background_task_deletes_expired_rows() {
    let server = PostgresServer::start();
    let mut config = config(&server);
    config.sweep_interval = Duration::from_millis(100);
    config.sweep_batch = 7;
    let store = connect(config).await;
    let raw = raw(&server).await;
    let short = options(Duration::from_millis(50), Duration::from_millis(100));
    for i in 0..40 {
        acquire(&store, &format!("short-{i}"), &short).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while row_count(&raw).await > 0 {
        assert!(
            Instant::now() < deadline,
            "{} expired rows still in the table",
            row_count(&raw).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One background run deletes the whole backlog, batch after batch while they come back full:
/// a cap on a run's batches would cap how many rows a second the table can lose, and past it
/// the table would grow without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_background_run_deletes_the_whole_backlog() {
    let server = PostgresServer::start();
    let raw = raw(&server).await;
    let mut config = config(&server);
    config.sweep_batch = 100;
    config.sweep_interval = Duration::from_secs(4);
    // The table set up by a store closed again, so the backlog is there before the measured
    // store starts.
    close(connect(config.clone()).await, &raw).await;
    expired_backlog(&raw, 3_000).await;
    let store = connect(config).await;
    let started = Instant::now();
    // The first run starts one interval after the store, the second two intervals after it:
    // the whole backlog must be gone before then.
    let mut left = row_count(&raw).await;
    while left > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(7),
            "{left} of 3000 expired rows left before the second run"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = row_count(&raw).await;
    }
    drop(store);
}

/// libfaketime, from Debian's `faketime` package (`.ci/install-deps` installs it).
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_are_on_the_database_clock() {
    assert!(
        std::path::Path::new(LIBFAKETIME).exists(),
        "{LIBFAKETIME} is missing: install Debian's faketime package (.ci/install-deps)"
    );
    // The server's clock runs a day ahead of this process's. No shared memory: as root,
    // `setpriv` (preloaded too) would create it as root before it becomes `nobody`.
    let server = PostgresServer::start_with_env(&[
        ("LD_PRELOAD", LIBFAKETIME),
        ("FAKETIME", "+1d"),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ("FAKETIME_DISABLE_SHM", "1"),
    ]);
    let store = connect(config(&server)).await;
    let server_now: SystemTime = raw(&server)
        .await
        .query_one("SELECT now()", &[])
        .await
        .expect("the server's now()")
        .get(0);
    let ahead = server_now
        .duration_since(SystemTime::now())
        .expect("the server's clock is ahead");
    assert!(
        ahead > Duration::from_secs(23 * 3600),
        "libfaketime did not move the server's clock ({ahead:?} ahead)"
    );

    let lease = Duration::from_secs(30);
    let ttl = Duration::from_secs(60);
    acquire(&store, "clocked", &options(lease, ttl)).await;
    let Some(Record::InFlight { lease_deadline, .. }) =
        store.get(&key("clocked")).await.expect("get")
    else {
        panic!("the claimed record is not in flight");
    };
    let from_server = lease_deadline
        .duration_since(server_now)
        .expect("the lease ends after the server's now()");
    assert!(
        from_server <= lease + Duration::from_secs(5),
        "the lease deadline is {from_server:?} after the server's now(), for a {lease:?} lease"
    );
    // A second claim measures the time left on the server's clock too: a lease measured on
    // this process's clock would have a day and more left.
    match claim(&store, "clocked", &options(lease, ttl)).await {
        Ok(Claim::InFlight { lease_remaining }) => assert!(
            lease_remaining <= lease && lease_remaining > lease - Duration::from_secs(5),
            "{lease_remaining:?} left of a {lease:?} lease"
        ),
        other => panic!("a second claim of a live lease: {other:?}"),
    }
}

/// Two gateways (two stores, two pools) racing for the same keys: one winner per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_stores_on_one_database_have_one_winner_per_key() {
    let server = PostgresServer::start();
    let stores = [
        connect(config(&server)).await,
        connect(config(&server)).await,
    ];
    let long = options(Duration::from_secs(30), Duration::from_secs(60));
    for round in 0..20 {
        let name = format!("shared-{round}");
        let tasks: Vec<_> = (0..32)
            .map(|i| {
                let store = stores[i % 2].clone();
                let name = name.clone();
                tokio::spawn(async move { claim(&store, &name, &long).await })
            })
            .collect();
        let mut winners = 0;
        for task in tasks {
            match task.await.expect("claim task") {
                Ok(Claim::Acquired(_)) => winners += 1,
                Ok(Claim::InFlight { .. }) => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(winners, 1, "round {round}: {winners} claims acquired");
    }
}

/// The store is shared by reference counting: dropping it (and its clones) ends the
/// background task and closes the pool's connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_store_closes_its_connections() {
    let server = PostgresServer::start();
    let raw = raw(&server).await;
    let store = connect(config(&server)).await;
    let clone = store.clone();
    store.ping().await.expect("ping");
    assert!(sessions(&raw).await >= 1);
    drop(clone);
    close(store, &raw).await;
}

/// A claim that changes nothing (a replay, an answer of in flight) takes no lock and no
/// transaction id, so it waits for no WAL flush: the server's transaction ids do not advance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_that_change_nothing_write_nothing() {
    let server = PostgresServer::start();
    let store = connect(config(&server)).await;
    let raw = raw(&server).await;
    let long = options(Duration::from_secs(30), Duration::from_secs(3600));
    completed(&store, "replayed", &long).await;
    acquire(&store, "running", &long).await;

    let next_xid = || async {
        let xid: i64 = raw
            .query_one("SELECT txid_current()", &[])
            .await
            .expect("txid_current")
            .get(0);
        xid
    };
    let before = next_xid().await;
    for _ in 0..50 {
        assert!(matches!(
            claim(&store, "replayed", &long).await,
            Ok(Claim::Completed(_))
        ));
        assert!(matches!(
            claim(&store, "running", &long).await,
            Ok(Claim::InFlight { .. })
        ));
    }
    let after = next_xid().await;
    // One id for the second txid_current(), and a few for autovacuum's analyze, if it ran.
    assert!(
        after - before <= 5,
        "100 claims that changed nothing used {} transaction ids",
        after - before - 1
    );
}

/// Claims `name` and completes it with a response kept an hour.
async fn completed(store: &PostgresStore, name: &str, options: &ClaimOptions) {
    let token = acquire(store, name, options).await;
    let applied = store
        .complete(
            &key(name),
            token,
            response(b"once"),
            Duration::from_secs(3600),
        )
        .await
        .expect("complete");
    assert_eq!(applied, Transition::Applied);
}

/// Claims a store sees answered without a write, one after another.
async fn retries(store: &PostgresStore, name: &str, options: &ClaimOptions, count: usize) {
    for _ in 0..count {
        let answer = claim(store, name, options).await;
        assert!(
            matches!(answer, Ok(Claim::Completed(_) | Claim::InFlight { .. })),
            "{answer:?}"
        );
    }
}

/// Once retries are common, claims that change nothing share one connection, whatever their
/// number: 64 concurrent replays leave the session the store's set-up and first claims used
/// and one for the reads, where each would otherwise take a pooled connection of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_replays_share_one_connection() {
    let server = PostgresServer::start();
    let raw = raw(&server).await;
    let store = connect(config(&server)).await;
    let long = options(Duration::from_secs(30), Duration::from_secs(3600));
    completed(&store, "replayed", &long).await;
    retries(&store, "replayed", &long, 12).await;
    assert_eq!(sessions(&raw).await, 1, "one session before the replays");

    for round in 0..3 {
        let replays: Vec<_> = (0..64)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move { claim(&store, "replayed", &long).await })
            })
            .collect();
        for replay in replays {
            let replay = replay.await;
            let answer = replay.expect("the replay's task");
            assert!(
                matches!(answer, Ok(Claim::Completed(_))),
                "round {round}: {answer:?}"
            );
        }
    }
    let open = sessions(&raw).await;
    assert!(open <= 2, "192 replays left {open} sessions open");
    close(store, &raw).await;
}

/// Once retries are common, reads do not wait for a pooled connection: with every connection
/// for writes held by a statement waiting on a row lock, a replay and an answer of in flight
/// still come at once (as while a disk stall holds every commit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_are_answered_while_every_write_waits() {
    let server = PostgresServer::start();
    let mut config = config(&server);
    config.pool_size = 2;
    let store = connect(config).await;
    let long = options(Duration::from_secs(30), Duration::from_secs(3600));
    completed(&store, "replayed", &long).await;
    let held: Vec<(String, OwnerToken)> = {
        let mut held = Vec::new();
        for i in 0..2 {
            let name = format!("held-{i}");
            let token = acquire(&store, &name, &long).await;
            held.push((name, token));
        }
        held
    };
    retries(&store, "replayed", &long, 12).await;

    // A transaction of its own locks the held records' rows; their completions wait for it.
    let mut locker = raw(&server).await;
    let lock = locker.transaction().await.expect("begin");
    lock.execute(
        "SELECT 1 FROM idemgate_records WHERE key = ANY($1) FOR UPDATE",
        &[&held
            .iter()
            .map(|(name, _)| key(name).0.to_vec())
            .collect::<Vec<_>>()],
    )
    .await
    .expect("lock the held rows");
    let completions: Vec<_> = held
        .iter()
        .map(|(name, token)| {
            let (store, name, token) = (store.clone(), name.clone(), *token);
            tokio::spawn(async move {
                store
                    .complete(
                        &key(&name),
                        token,
                        response(b"late"),
                        Duration::from_secs(3600),
                    )
                    .await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        completions.iter().all(|c| !c.is_finished()),
        "the completions must be waiting on the lock"
    );

    let started = Instant::now();
    let replay = tokio::time::timeout(Duration::from_secs(2), claim(&store, "replayed", &long))
        .await
        .expect("a replay must not wait for the writes");
    assert!(matches!(replay, Ok(Claim::Completed(_))), "{replay:?}");
    let running = tokio::time::timeout(Duration::from_secs(2), claim(&store, "held-0", &long))
        .await
        .expect("an answer of in flight must not wait for the writes");
    assert!(matches!(running, Ok(Claim::InFlight { .. })), "{running:?}");
    let record = tokio::time::timeout(Duration::from_secs(2), store.get(&key("replayed")))
        .await
        .expect("a read of a record must not wait for the writes");
    assert!(
        matches!(record, Ok(Some(Record::Completed { .. }))),
        "{record:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));

    lock.commit().await.expect("release the rows");
    for completion in completions {
        let applied = completion
            .await
            .expect("the completion's task")
            .expect("complete once the lock is gone");
        assert_eq!(applied, Transition::Applied);
    }
}

/// A claim that read first and found a record that must change still changes it, through the
/// claim statement: an expired record is taken over, a lapsed lease turns ambiguous (under
/// `Ambiguous`), and a different fingerprint is a mismatch, answered from the read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_first_still_changes_what_must_change() {
    let server = PostgresServer::start();
    let store = connect(config(&server)).await;
    let long = options(Duration::from_secs(30), Duration::from_secs(3600));
    completed(&store, "replayed", &long).await;
    let brief = options(Duration::from_millis(300), Duration::from_millis(300));
    acquire(&store, "expiring", &brief).await;
    let lapsing = options(Duration::from_millis(300), Duration::from_secs(3600));
    acquire(&store, "lapsing", &lapsing).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    // Enough that the two claims below that must write leave reading first on.
    retries(&store, "replayed", &long, 20).await;

    let mismatch = store
        .claim(
            &key("replayed"),
            &fingerprint("another request"),
            OwnerToken::generate(),
            &long,
        )
        .await;
    assert!(matches!(mismatch, Ok(Claim::Mismatch)), "{mismatch:?}");
    assert!(
        matches!(
            claim(&store, "expiring", &long).await,
            Ok(Claim::Acquired(_))
        ),
        "an expired record is taken over"
    );
    let lapsed = claim(&store, "lapsing", &lapsing).await;
    assert!(matches!(lapsed, Ok(Claim::Ambiguous)), "{lapsed:?}");
    let after = claim(&store, "lapsing", &lapsing).await;
    assert!(matches!(after, Ok(Claim::Ambiguous)), "{after:?}");
}

/// The table's scan counters: how many times it was read whole, and how many rows were read
/// through its indexes. A session's reads are counted once it flushes its statistics, at the
/// latest as it exits (see [`close`]).
async fn scans(raw: &tokio_postgres::Client) -> (i64, i64) {
    let row = raw
        .query_one(
            "SELECT seq_scan, coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables \
             WHERE relname = 'idemgate_records'",
            &[],
        )
        .await
        .expect("read the table's scan counters");
    (row.get(0), row.get(1))
}

/// Writes `rows` records that expired an hour ago straight into the table.
async fn expired_backlog(raw: &tokio_postgres::Client, rows: i32) {
    raw.execute(
        "INSERT INTO idemgate_records (key, state, fingerprint, stored_at, expires_at) \
         SELECT sha256(i::text::bytea), 'ambiguous', sha256(i::text::bytea), \
                now() - interval '2 hours', now() - interval '1 hour' \
         FROM generate_series(1, $1) AS i",
        &[&rows],
    )
    .await
    .expect("a backlog of expired rows");
}

/// How many sessions the gateway's stores have open on the server.
async fn sessions(raw: &tokio_postgres::Client) -> i64 {
    raw.query_one(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idemgate'",
        &[],
    )
    .await
    .expect("count sessions")
    .get(0)
}

/// Drops `store`, the last handle to its pool, and waits until its sessions have ended.
async fn close(store: PostgresStore, raw: &tokio_postgres::Client) {
    drop(store);
    let deadline = Instant::now() + Duration::from_secs(5);
    while sessions(raw).await > 0 {
        assert!(
            Instant::now() < deadline,
            "the store's sessions outlived it"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Autovacuum empties and analyzes the table when traffic stops; a connection then plans its
/// statements for a table of one page, and a plan is kept for the connection's life. Those
/// plans must still find a record through the key's index, or every claim reads the whole
/// table once traffic resumes and it has grown (one connection here, so it reuses its plans).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_planned_on_a_nearly_empty_table_use_its_indexes() {
    let server = PostgresServer::start();
    let mut config = config(&server);
    config.pool_size = 1;
    config.sweep_interval = Duration::from_millis(100);
    let raw = raw(&server).await;
    let long = options(Duration::from_secs(30), Duration::from_secs(3600));
    let short = options(Duration::from_millis(50), Duration::from_millis(100));
    // The table set up, its index built and one record in it, by a store closed again so
    // that its reads are counted before the measure starts.
    let setup = connect(config.clone()).await;
    acquire(&setup, "first", &long).await;
    close(setup, &raw).await;
    raw.batch_execute("ANALYZE idemgate_records")
        .await
        .expect("analyze the one-row table");
    let store = connect(config).await;
    let (whole_before, _) = scans(&raw).await;

    // More runs of each statement than PostgreSQL makes before it keeps a generic plan.
    for i in 0..12 {
        let name = format!("key-{i}");
        let token = acquire(&store, &name, &long).await;
        assert!(matches!(
            claim(&store, &name, &long).await,
            Ok(Claim::InFlight { .. })
        ));
        let renewed = store
            .renew(&key(&name), token, Duration::from_secs(30))
            .await
            .expect("renew");
        assert_eq!(renewed, Transition::Applied);
        let applied = store
            .complete(
                &key(&name),
                token,
                response(b"done"),
                Duration::from_secs(3600),
            )
            .await
            .expect("complete");
        assert_eq!(applied, Transition::Applied);
        assert!(matches!(
            claim(&store, &name, &long).await,
            Ok(Claim::Completed(_))
        ));
        assert!(store.get(&key(&name)).await.expect("get").is_some());
        let released = acquire(&store, &format!("released-{i}"), &long).await;
        let released = store
            .release(&key(&format!("released-{i}")), released)
            .await
            .expect("release");
        assert_eq!(released, Transition::Applied);
        let marking = acquire(&store, &format!("ambiguous-{i}"), &long).await;
        let marked = store
            .mark_ambiguous(
                &key(&format!("ambiguous-{i}")),
                marking,
                Duration::from_secs(3600),
            )
            .await
            .expect("mark ambiguous");
        assert_eq!(marked, Transition::Applied);
        assert!(store.delete(&key(&name)).await.expect("delete"));
    }
    // Expired rows for the background deletion, which runs every 100 ms.
    for i in 0..12 {
        acquire(&store, &format!("expiring-{i}"), &short).await;
    }
    tokio::time::sleep(Duration::from_millis(1_500)).await;

    close(store, &raw).await;
    let (whole_after, _) = scans(&raw).await;
    assert_eq!(
        whole_after - whole_before,
        0,
        "the store's statements read the whole table"
    );
}

/// A deletion batch reads the rows it deletes, not every expired row: a backlog left by a
/// long pause does not make each batch slower.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_batch_reads_only_the_rows_it_deletes() {
    let server = PostgresServer::start();
    let mut config = config(&server);
    config.pool_size = 1;
    config.sweep_batch = 50;
    config.sweep_interval = Duration::from_secs(3600);
    let raw = raw(&server).await;
    // The table set up and its index built by a store closed again, so that its reads are
    // counted before the measure starts.
    close(connect(config.clone()).await, &raw).await;
    let store = connect(config).await;
    expired_backlog(&raw, 5_000).await;
    raw.batch_execute("ANALYZE idemgate_records")
        .await
        .expect("analyze the table");
    let (whole_before, fetched_before) = scans(&raw).await;
    for _ in 0..4 {
        assert_eq!(
            store.delete_expired().await.expect("delete_expired"),
            Some(50)
        );
    }
    close(store, &raw).await;
    let (whole_after, fetched_after) = scans(&raw).await;
    assert_eq!(
        whole_after - whole_before,
        0,
        "a deletion batch read the whole table"
    );
    assert_eq!(row_count(&raw).await, 4_800);
    // Each batch reads its 50 rows through the expiry index and again through the key's:
    // 400 for four batches, and nothing like the 5 000 expired rows.
    let fetched = fetched_after - fetched_before;
    assert!(
        fetched <= 4 * 2 * 50,
        "four batches of 50 read {fetched} rows through indexes"
    );
}

/// Behind PgBouncer, which refuses the `options` startup parameter (and drops it, with
/// `ignore_startup_parameters = options`), the store does not run: its sessions would have no
/// statement timeout and plans that read the whole table. Either way the error says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooler_that_drops_the_sessions_options_is_refused() {
    let server = PostgresServer::start();
    for (ignore, why) in [
        ("", "unsupported startup parameter: options"),
        (
            "options",
            "a pooler between the gateway and PostgreSQL dropped them",
        ),
    ] {
        let bouncer = server.pgbouncer("transaction", ignore);
        let mut config = PostgresStoreConfig::new(bouncer.url());
        config.password = None;
        config.timeout = Duration::from_secs(5);
        match PostgresStore::connect(config.clone()).await {
            Ok(_) => panic!(
                "connected through pgbouncer with ignore_startup_parameters = '{ignore}'; its log:\n{}",
                bouncer.log()
            ),
            Err(e) => assert!(chain(&e).contains(why), "{}", chain(&e)),
        }
        // Many sessions opened at once, as under traffic: PgBouncer then spreads each one's
        // statements over its server connections, and every refusal still says why.
        let lazy = PostgresStore::connect_lazy(config).expect("a lazily connected store");
        let calls = (0..20).map(|_| {
            let store = lazy.clone();
            tokio::spawn(async move { store.ping().await })
        });
        for call in calls.collect::<Vec<_>>() {
            match call.await.expect("ping task") {
                Ok(()) => panic!("a session through pgbouncer was used ('{ignore}')"),
                Err(e) => assert!(chain(&e).contains(why), "{}", chain(&e)),
            }
        }
    }
}
