//! End to end, the PostgreSQL store under the real `idemgate` binary: two gateways sharing one
//! database, PostgreSQL stopped and restarted under traffic and while a request runs
//! upstream, gateways killed with `kill -9` mid-flight, a start while PostgreSQL is down, a
//! table newer than the binary, and `--check-config`. Every process here (gateways,
//! `postgres`) is started by the test, on loopback, and killed by its own pid when dropped.

#![cfg(feature = "postgres")]

#[path = "support/shared_store.rs"]
mod shared_store;
#[path = "support/proxy.rs"]
mod support;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shared_store::{IN_FLIGHT, OUTCOME_UNKNOWN, assert_store_unavailable};
use support::{
    Gateway, Resp, TempDir, TestUpstream, admin_get, eventually, gateway_command, key, send,
    try_send,
};
use test_servers::PostgresServer;

/// Bounds each store call; short so that faults are seen quickly, long enough for a loaded
/// two-core machine.
const STORE_TIMEOUT: &str = "store_timeout = \"500ms\"\n";

/// A plain connection to the test server, to change what the store wrote.
async fn raw(server: &PostgresServer) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(&server.url(), tokio_postgres::NoTls)
        .await
        .expect("raw connection to the test postgres");
    tokio::spawn(connection);
    client
}

/// `url` with `password` in it (the test servers trust every local connection, so any
/// password is accepted, and must never be shown).
fn with_password(url: &str, password: &str) -> String {
    url.replacen("postgres@", &format!("postgres:{password}@"), 1)
}

// ---- two gateways, one database ------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn two_gateways_on_one_database_execute_fifty_concurrent_requests_once() {
    let pg = PostgresServer::start();
    // Both gateways open their pools and one creates the table during the race itself.
    let config = "store_timeout = \"5s\"\n";
    shared_store::two_gateways_execute_fifty_concurrent_requests_once(&pg.url(), config).await;
}

// ---- PostgreSQL stopped and restarted under traffic ---------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn postgres_stopped_under_traffic_fails_closed_and_recovers_without_a_restart() {
    let mut pg = PostgresServer::start();
    let url = pg.url();
    shared_store::a_store_stopped_under_traffic_fails_closed_and_recovers(&mut pg, &url).await;
}

// ---- PostgreSQL restarted while a request runs upstream -----------------------------------

/// A fast shutdown of PostgreSQL (its sessions ended, nothing committed lost) and a start
/// again while a request is at the upstream.
///
/// Expected: the claim was committed before the request was forwarded, so it survives the
/// restart, in flight under the first request's lease (30 s, far from lapsing). A retry
/// after the restart finds it and gets `409 request-in-flight`, and is not forwarded (a few
/// `503`s are allowed while the gateway's pool replaces the connections the shutdown cut).
/// The upstream answers after PostgreSQL is back, so the first request's completion is
/// stored on a new connection under its own token: the client gets `201`, and a retry then
/// replays it byte for byte. One execution.
#[tokio::test(flavor = "multi_thread")]
async fn a_fast_restart_of_postgres_while_a_request_runs_upstream_keeps_one_execution() {
    /// Long enough for PostgreSQL to restart (a tenth of a second to a second) well before
    /// the upstream answers.
    const UPSTREAM_MS: u64 = 5000;

    let mut pg = PostgresServer::start();
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let gw = Gateway::start_configured(&dir, &upstream, &pg.url(), STORE_TIMEOUT, &[]);
    let url = gw.url("/restart/pay");
    let delay = UPSTREAM_MS.to_string();
    let sent = Instant::now();
    let first = tokio::spawn({
        let (url, delay) = (url.clone(), delay.clone());
        async move {
            send(
                "POST",
                &url,
                &[key("k-restart"), ("x-delay-ms", &delay)],
                "x",
            )
            .await
        }
    });
    upstream.wait_for_hit("/restart/pay").await;

    pg.restart();
    assert!(
        sent.elapsed() < Duration::from_millis(UPSTREAM_MS - 1000),
        "postgres took {:?} to restart: the upstream answers too soon for this test",
        sent.elapsed()
    );
    let retry = eventually(100, || async {
        let r = send("POST", &url, &[key("k-restart")], "x").await;
        (r.status != 503).then_some(r)
    })
    .await
    .expect("the gateway reaches postgres again after its restart");
    assert_eq!(retry.status, 409, "{}", retry.text());
    assert_eq!(retry.problem_type(), IN_FLIGHT);
    assert_eq!(
        upstream.hits("/restart/pay"),
        1,
        "the retry was not forwarded"
    );

    let first = first.await.expect("the first request");
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed());
    let replay = send("POST", &url, &[key("k-restart")], "x").await;
    assert!(
        replay.replayed(),
        "{} {}\n{}",
        replay.status,
        replay.text(),
        gw.logs()
    );
    assert_eq!(replay.body, first.body, "replayed byte for byte");
    assert_eq!(upstream.hits("/restart/pay"), 1, "one execution");
}

/// PostgreSQL down from while a request is at the upstream until after it answered.
///
/// Expected: the client still gets the upstream's `201` (the response is not held back for
/// the store), but the completion cannot be stored and the renewals fail, so the record stays
/// in flight under the dead lease; nothing undoes the claim, since the request did run. Once
/// PostgreSQL is back a retry gets `409 request-in-flight` until the 2 s lease lapses, then
/// `502 outcome-unknown` (the route's `unknown_outcome = "ambiguous"`), and is never run a
/// second time.
#[tokio::test(flavor = "multi_thread")]
async fn a_completion_lost_to_a_stopped_postgres_is_never_run_again() {
    let config = format!(
        "{STORE_TIMEOUT}[[routes]]\nprefix = \"/lapse\"\nlease = \"2s\"\nunknown_outcome = \"ambiguous\"\n"
    );
    let mut pg = PostgresServer::start();
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let gw = Gateway::start_configured(&dir, &upstream, &pg.url(), &config, &[]);
    let url = gw.url("/lapse/pay");
    let first = tokio::spawn({
        let url = url.clone();
        async move { send("POST", &url, &[key("k-lapse"), ("x-delay-ms", "1500")], "x").await }
    });
    upstream.wait_for_hit("/lapse/pay").await;
    pg.stop();
    let first = first.await.expect("the first request");
    assert_eq!(first.status, 201, "{}", first.text());
    gw.logs_with("complete failed")
        .await
        .unwrap_or_else(|| panic!("the lost completion is logged:\n{}", gw.logs()));

    pg.restart();
    let seen = std::cell::RefCell::new(Vec::new());
    let lapsed = eventually(200, || async {
        let r = send("POST", &url, &[key("k-lapse")], "x").await;
        let status = r.status;
        seen.borrow_mut().push(status);
        match status {
            503 => assert_store_unavailable(&r),
            409 => assert_eq!(r.problem_type(), IN_FLIGHT),
            502 => {
                assert_eq!(r.problem_type(), OUTCOME_UNKNOWN);
                return Some(());
            }
            other => panic!("the retry got {other}: {}", r.text()),
        }
        None
    })
    .await;
    let seen = seen.into_inner();
    assert!(
        lapsed.is_some(),
        "the lease never lapsed into ambiguous: {seen:?}"
    );
    assert_eq!(upstream.hits("/lapse/pay"), 1, "one execution: {seen:?}");
}

// ---- kill -9 of gateways sharing the database ---------------------------------------------

/// What came back for one key, over every request sent with it.
#[derive(Default)]
struct KeyLog {
    /// Bodies of the `201`s, fresh or replayed.
    bodies: Vec<bytes::Bytes>,
    /// Every status, in the order the answers came.
    statuses: Vec<u16>,
}

impl KeyLog {
    fn record(&mut self, r: &Resp) {
        self.statuses.push(r.status);
        match r.status {
            201 => self.bodies.push(r.body.clone()),
            409 => assert_eq!(r.problem_type(), IN_FLIGHT),
            502 => assert_eq!(r.problem_type(), OUTCOME_UNKNOWN),
            503 => assert_store_unavailable(r),
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
}

/// Sends one keyed request for each of `keys` (path `/kill/{k}`, the upstream taking
/// `delay_ms`) to each of `gateways`, all at once but the first gateway's `lead` ahead of the
/// others'. Returns, per key, each gateway's answer: `None` where the gateway died first.
async fn fire(
    gateways: &[String],
    keys: &[String],
    delay_ms: u64,
    lead: Duration,
) -> Vec<(String, Vec<Option<Resp>>)> {
    let mut tasks = Vec::new();
    for k in keys {
        for (n, base) in gateways.iter().enumerate() {
            let (url, k) = (format!("{base}/kill/{k}"), k.clone());
            tasks.push(tokio::spawn(async move {
                if n > 0 {
                    tokio::time::sleep(lead).await;
                }
                let delay = delay_ms.to_string();
                try_send("POST", &url, &[key(&k), ("x-delay-ms", &delay)], "x")
                    .await
                    .ok()
            }));
        }
    }
    let mut answers = Vec::new();
    for task in tasks {
        answers.push(task.await.expect("request task"));
    }
    let mut answers = answers.into_iter();
    keys.iter()
        .map(|k| (k.clone(), answers.by_ref().take(gateways.len()).collect()))
        .collect()
}

/// Five rounds of: two gateways on one database, keyed requests through both at once, one
/// gateway killed with `kill -9` while requests it claimed run upstream, a new gateway in its
/// place, and every key of every round retried through both.
///
/// Expected: a key whose claim died with its gateway stays in flight under a lease nobody
/// renews (retries get `409`), then lapses into ambiguous (`502 outcome-unknown`); a key
/// completed replays the same bytes; a key never claimed before the kill may run on a retry,
/// once. So every key reaches the upstream at most once, and all its `201`s are one body.
#[tokio::test(flavor = "multi_thread")]
async fn a_kill_9_loop_of_gateways_sharing_the_database_never_runs_a_key_twice() {
    const ROUNDS: usize = 5;
    const KEYS: usize = 6;
    let config = format!(
        "{STORE_TIMEOUT}[[routes]]\nprefix = \"/kill\"\nlease = \"2s\"\nunknown_outcome = \"ambiguous\"\n"
    );
    let pg = PostgresServer::start();
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let start = || Gateway::start_configured(&dir, &upstream, &pg.url(), &config, &[]);
    let mut log: HashMap<String, KeyLog> = HashMap::new();
    let mut orphaned = std::collections::HashSet::new();

    for round in 0..ROUNDS {
        let mut victim = start();
        let survivor = start();
        let bases = [victim.url(""), survivor.url("")];
        let keys: Vec<String> = (0..KEYS).map(|i| format!("r{round}-{i}")).collect();
        let round_hits = |upstream: &TestUpstream| -> u64 {
            keys.iter()
                .map(|k| upstream.hits(&format!("/kill/{k}")))
                .sum()
        };

        // The victim gets each key 50 ms ahead, so it claims most of them; the upstream
        // takes 1.5 s, so they are still running when it is killed.
        let traffic = {
            let keys = keys.clone();
            tokio::spawn(async move { fire(&bases, &keys, 1500, Duration::from_millis(50)).await })
        };
        eventually(200, || async { (round_hits(&upstream) >= 2).then_some(()) })
            .await
            .expect("requests reach the upstream");
        let status = victim.kill9();
        assert!(!status.success(), "killed: {status:?}");
        let at_kill = round_hits(&upstream);

        for (k, answers) in traffic.await.expect("traffic") {
            let entry = log.entry(k).or_default();
            for r in answers.iter().flatten() {
                entry.record(r);
            }
            // Through the victim a request dies with it; through the survivor it is answered.
            assert!(answers[1].is_some(), "the survivor answered");
        }

        // A new gateway in the victim's place; every key so far retried through both. A key
        // still in flight (409) or lapsed (502) now had its claim die with the victim.
        let replacement = start();
        for gw in [&replacement, &survivor] {
            for k in log.keys().cloned().collect::<Vec<_>>() {
                let r = send("POST", &gw.url(&format!("/kill/{k}")), &[key(&k)], "x").await;
                if matches!(r.status, 409 | 502) {
                    orphaned.insert(k.clone());
                }
                log.get_mut(&k).unwrap().record(&r);
            }
        }
        assert!(at_kill >= 2, "round {round}: the kill came mid-flight");
        drop((replacement, survivor));
    }

    // Every lease has lapsed by now: a last retry of every key through a fresh gateway.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let last = start();
    for (k, entry) in &mut log {
        let r = send("POST", &last.url(&format!("/kill/{k}")), &[key(k)], "x").await;
        entry.record(&r);
    }
    for (k, entry) in &log {
        let hits = upstream.hits(&format!("/kill/{k}"));
        assert!(hits <= 1, "key {k} ran {hits} times: {:?}", entry.statuses);
        if let Some(first) = entry.bodies.first() {
            assert_eq!(hits, 1, "key {k}: a 201 came from the upstream");
            assert!(
                entry.bodies.iter().all(|b| b == first),
                "key {k}: every 201 is the same bytes"
            );
        }
    }
    assert!(
        !orphaned.is_empty(),
        "no claim ever died with its gateway; the loop tested nothing"
    );
}

// ---- connections ---------------------------------------------------------------------------

/// Sends 24 requests with distinct keys at once through `gw` (each held 200 ms upstream) and
/// returns how many sessions the gateway then has open on `pg`: a pool keeps the connections
/// it opened.
async fn sessions_after_a_burst(gw: &Gateway, pg: &PostgresServer, path: &str) -> i64 {
    let start = Arc::new(tokio::sync::Barrier::new(24));
    let mut tasks = Vec::new();
    for i in 0..24 {
        let url = gw.url(path);
        let start = Arc::clone(&start);
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let k = format!("k-burst-{i}");
            send("POST", &url, &[key(&k), ("x-delay-ms", "200")], "x").await
        }));
    }
    for task in tasks {
        let r = task.await.expect("request task");
        assert_eq!(r.status, 201, "{}", r.text());
    }
    raw(pg)
        .await
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'idemgate'",
            &[],
        )
        .await
        .expect("count the gateway's sessions")
        .get(0)
}

/// `store_pool_size` caps the connections one gateway opens, so that the gateways sharing a
/// database stay under its `max_connections`; requests beyond it wait for a connection.
#[tokio::test(flavor = "multi_thread")]
async fn store_pool_size_caps_the_connections_a_gateway_opens() {
    let pg = PostgresServer::start();
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let config = "store_timeout = \"5s\"\n";
    let gw = Gateway::start_configured(&dir, &upstream, &pg.url(), config, &[]);
    let by_default = sessions_after_a_burst(&gw, &pg, "/default").await;
    assert!(
        by_default > 2,
        "the burst opens more than two connections by default: {by_default}"
    );
    drop(gw);

    let pg = PostgresServer::start();
    let capped = format!("{config}store_pool_size = 2\n");
    let gw = Gateway::start_configured(&dir, &upstream, &pg.url(), &capped, &[]);
    let with_two = sessions_after_a_burst(&gw, &pg, "/capped").await;
    assert!(
        (1..=2).contains(&with_two),
        "store_pool_size = 2 opened {with_two} connections"
    );
    assert_eq!(upstream.hits("/capped"), 24, "each request ran once");
}

// ---- start-up -------------------------------------------------------------------------------

/// With PostgreSQL down at start the gateway serves anyway (`503`, not ready) and reports it
/// after its listening line; once the server is up it creates the table and serves, without
/// a restart. The URL's password appears nowhere in its output.
#[tokio::test(flavor = "multi_thread")]
async fn a_gateway_starts_while_postgres_is_down_and_serves_once_it_is_up() {
    let mut pg = PostgresServer::start();
    pg.stop();
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let store = with_password(&pg.url(), "s3cret-pw");
    let gw = Gateway::start_configured(&dir, &upstream, &store, STORE_TIMEOUT, &[]);
    let not_ready = shared_store::assert_serving_while_the_store_is_down(&gw, &upstream).await;

    pg.restart();
    let served = eventually(200, || async {
        let r = send("POST", &gw.url("/up"), &[key("k-up")], "x").await;
        (r.status == 201).then_some(r)
    })
    .await
    .unwrap_or_else(|| panic!("never served once postgres was up:\n{}", gw.logs()));
    assert!(!served.replayed());
    assert_eq!(admin_get(&gw, "/readyz", &[]).await.status, 200);
    let replay = send("POST", &gw.url("/up"), &[key("k-up")], "x").await;
    assert!(replay.replayed(), "{}", replay.text());
    let rows = raw(&pg)
        .await
        .query_one("SELECT count(*) FROM idemgate_records", &[])
        .await
        .expect("the table exists")
        .get::<_, i64>(0);
    assert_eq!(rows, 1, "the table was created, with the one record");
    assert!(!not_ready.text().contains("s3cret"), "{}", not_ready.text());
    assert!(!gw.logs().contains("s3cret"), "{}", gw.logs());
}

/// A table of a newer schema than the binary's: every request is refused (`503`, nothing
/// forwarded) and `/readyz` says why, naming both versions.
#[tokio::test(flavor = "multi_thread")]
async fn a_newer_table_is_refused_naming_both_versions() {
    let pg = PostgresServer::start();
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let gw = Gateway::start_configured(&dir, &upstream, &pg.url(), STORE_TIMEOUT, &[]);
    let ok = send("POST", &gw.url("/v"), &[key("k-v")], "x").await;
    assert_eq!(ok.status, 201, "{}", ok.text());
    drop(gw);
    raw(&pg)
        .await
        .execute("UPDATE idemgate_schema SET version = version + 1", &[])
        .await
        .expect("raise the schema version");

    let gw = Gateway::start_configured(&dir, &upstream, &pg.url(), STORE_TIMEOUT, &[]);
    for k in ["k-v", "k-new"] {
        let refused = send("POST", &gw.url("/v"), &[key(k)], "x").await;
        assert_store_unavailable(&refused);
    }
    assert_eq!(upstream.hits("/v"), 1, "nothing forwarded");
    let ready = admin_get(&gw, "/readyz", &[]).await;
    assert_eq!(ready.status, 503);
    let why = ready.text();
    let ours = idemgate::store::PostgresStore::SCHEMA_VERSION;
    assert!(
        why.contains(&format!("schema version {}", ours + 1))
            && why.contains(&format!("version {ours} that this idemgate")),
        "/readyz names both versions: {why}"
    );
}

// ---- --check-config -------------------------------------------------------------------------

/// Runs `idemgate --check-config --upstream … --store STORE` and returns its exit code and
/// output (stdout, then stderr).
fn check_config(store: &str, env: &[(&str, &str)]) -> (i32, String) {
    let out = gateway_command()
        .args(["--check-config", "--upstream", "http://127.0.0.1:3000"])
        .args(["--store", store])
        .envs(env.iter().copied())
        .output()
        .expect("run idemgate --check-config");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn check_config_takes_postgres_urls_and_never_shows_the_password() {
    for (store, shown) in [
        (
            "postgres://gw:s3cret@db.internal:5433/app?sslmode=require",
            "store postgres://gw@db.internal:5433/app,",
        ),
        (
            "postgresql://gw@db.internal/app",
            "store postgres://gw@db.internal:5432/app,",
        ),
    ] {
        let (code, out) = check_config(store, &[("PGPASSWORD", "s3cret")]);
        assert_eq!(code, 0, "{out}");
        assert!(out.contains(shown), "{out}");
        assert!(!out.contains("s3cret"), "{out}");
    }
    for (store, why) in [
        ("postgres://gw:s3cret@db/app?sslmode=sometimes", "sslmode"),
        ("postgres://gw:s3cret@db:port/app", "port"),
        ("postgres://gw:s3cret@/app", "no host"),
    ] {
        let (code, out) = check_config(store, &[]);
        assert_eq!(code, 2, "{store}: {out}");
        assert!(
            out.contains("invalid configuration: store: invalid postgres url"),
            "{store}: {out}"
        );
        assert!(out.contains(why), "{store}: {out}");
        assert!(out.contains("expected postgres://USER"), "{store}: {out}");
        assert!(!out.contains("s3cret"), "{store}: {out}");
    }
}
