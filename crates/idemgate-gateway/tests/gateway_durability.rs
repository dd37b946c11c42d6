//! End to end, the stores under the real `idemgate` binary: two gateways sharing one Redis
//! (and one Redis Cluster), Redis killed, hung and restarted under traffic, and a redb file
//! surviving `kill -9` of the gateway. Every process here (gateways, `redis-server`) is
//! started by the test and killed by its own pid when dropped.

// Each test needs its store's feature; a build without one leaves some helpers unused.
#![cfg_attr(not(all(feature = "redis", feature = "redb")), allow(unused_imports))]

#[path = "support/shared_store.rs"]
mod shared_store;
#[path = "support/proxy.rs"]
mod support;

use std::time::{Duration, Instant};

use shared_store::{IN_FLIGHT, assert_store_unavailable};
use support::{
    Gateway, Resp, TempDir, TestUpstream, admin_get, eventually, gateway_command_after, key, send,
};

// ---- two gateways, one Redis --------------------------------------------------------------

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn two_gateways_on_one_redis_execute_fifty_concurrent_requests_once() {
    let redis = test_servers::RedisServer::start();
    shared_store::two_gateways_execute_fifty_concurrent_requests_once(&redis.url(), "").await;
}

#[cfg(feature = "redis-cluster")]
#[tokio::test(flavor = "multi_thread")]
async fn two_gateways_on_one_redis_cluster_execute_fifty_concurrent_requests_once() {
    let cluster = tokio::task::block_in_place(test_servers::RedisCluster::start);
    shared_store::two_gateways_execute_fifty_concurrent_requests_once(&cluster.url(), "").await;
}

// ---- Redis killed and restarted under traffic ---------------------------------------------

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn redis_killed_under_traffic_fails_closed_and_recovers_without_a_restart() {
    // With its append-only file, so the restart keeps the records (a restart that loses them
    // is redis_restarted_without_persistence_refuses_claims_until_acknowledged).
    let mut redis = test_servers::RedisServer::start_with(&["--appendonly", "yes"]);
    let url = redis.url();
    shared_store::a_store_stopped_under_traffic_fails_closed_and_recovers(&mut redis, &url).await;
}

// ---- Redis restarted without persistence --------------------------------------------------

/// A Redis restarted without persistence forgets every record: the gateway warned about it at
/// start, finds the loss (its data marker is gone), and refuses new claims with `503` until an
/// operator acknowledges it on the admin listener; the retry of a request that already ran
/// is never forwarded meanwhile.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn redis_restarted_without_persistence_refuses_claims_until_acknowledged() {
    const TOKEN: &str = "admin-token-0123456789";
    let config = format!("store_timeout = \"500ms\"\nadmin_token = \"{TOKEN}\"\n");
    let (mut redis, upstream, _dir, gw) = warm_redis_gateway(&config).await;
    let first = send("POST", &gw.url("/pay"), &[key("k-1")], "x").await;
    assert_eq!(first.status, 201, "{}", first.text());
    gw.logs_with("appendonly is no")
        .await
        .unwrap_or_else(|| panic!("the missing persistence is warned about:\n{}", gw.logs()));

    redis.restart();
    // The gateway reconnects (a few 503s while it does), finds the loss, and refuses.
    let lost = eventually(200, || async {
        let r = send("POST", &gw.url("/pay"), &[key("k-1")], "x").await;
        assert_ne!(r.status, 201, "the retry ran again: {}", r.text());
        let metrics = admin_get(&gw, "/metrics", &[]).await.text();
        metrics
            .contains("idemgate_store_data_lost{backend=\"redis\"} 1\n")
            .then_some(())
    })
    .await;
    assert!(lost.is_some(), "the loss is found:\n{}", gw.logs());
    let refused = send("POST", &gw.url("/pay"), &[key("k-1")], "x").await;
    assert_store_unavailable(&refused);
    assert_eq!(
        upstream.hits("/pay"),
        1,
        "the retry was not run a second time"
    );
    let fresh = send("POST", &gw.url("/other"), &[key("k-2")], "x").await;
    assert_store_unavailable(&fresh);
    assert_eq!(upstream.hits("/other"), 0);
    let logs = gw.logs();
    assert!(logs.contains("redis lost its data"), "{logs}");
    assert_eq!(
        logs.matches("appendonly is no").count(),
        1,
        "warned once, not at every reconnect:\n{logs}"
    );

    let ack_url = format!("http://{}/admin/store/acknowledge-data-loss", gw.admin);
    let denied = send("POST", &ack_url, &[], "").await;
    assert_eq!(denied.status, 401, "{}", denied.text());
    let auth = format!("Bearer {TOKEN}");
    let ack = send("POST", &ack_url, &[("authorization", &auth)], "").await;
    assert_eq!(ack.status, 200, "{}", ack.text());
    assert_eq!(ack.json()["acknowledged"], true, "{}", ack.text());

    let served = send("POST", &gw.url("/other"), &[key("k-2")], "x").await;
    assert_eq!(served.status, 201, "{}", served.text());
    let metrics = admin_get(&gw, "/metrics", &[]).await.text();
    assert!(
        metrics.contains("idemgate_store_data_lost{backend=\"redis\"} 0\n"),
        "{metrics}"
    );
}

// ---- Redis hung (SIGSTOP) -----------------------------------------------------------------

/// A Redis, an upstream and a gateway on that Redis with the config file `config`, after one
/// keyed request has gone through (the connection to Redis is open).
#[cfg(feature = "redis")]
async fn warm_redis_gateway(
    config: &str,
) -> (test_servers::RedisServer, TestUpstream, TempDir, Gateway) {
    let redis = test_servers::RedisServer::start();
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let gw = Gateway::start_configured(&dir, &upstream, &redis.url(), config, &[]);
    let warm = send("POST", &gw.url("/warm"), &[key("k-warm")], "x").await;
    assert_eq!(warm.status, 201, "{}", warm.text());
    (redis, upstream, dir, gw)
}

/// Whether a POST to `path` with `name`'s key is answered `201` within ten seconds of tries.
#[cfg(feature = "redis")]
async fn runs_within_ten_seconds(gw: &Gateway, path: &str, name: &str) -> bool {
    eventually(200, || async {
        let r = send("POST", &gw.url(path), &[key(name)], "x").await;
        (r.status == 201).then_some(())
    })
    .await
    .is_some()
}

/// With `store_wait_replicas = 1`, a request is forwarded only once a replica holds its
/// claim: a frozen replica makes new keys `503` (nothing forwarded, the claim undone), and
/// once it thaws the same key runs, once.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_no_replica_acknowledged_is_503_and_never_forwarded() {
    let primary = test_servers::RedisServer::start();
    let port = primary.port().to_string();
    let replica = test_servers::RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let config = "store_timeout = \"600ms\"\nstore_wait_replicas = 1\n";
    let gw = Gateway::start_configured(&dir, &upstream, &primary.url(), config, &[]);
    // The replica's first sync may take a moment: until then claims are refused too.
    assert!(
        runs_within_ten_seconds(&gw, "/warm", "k-warm").await,
        "never served with a replica:
{}",
        gw.logs()
    );

    replica.pause();
    let refused = send("POST", &gw.url("/pay"), &[key("k-1")], "x").await;
    replica.resume();
    assert_store_unavailable(&refused);
    assert_eq!(
        upstream.hits("/pay"),
        0,
        "forwarded without a replica's acknowledgement"
    );

    assert!(
        runs_within_ten_seconds(&gw, "/pay", "k-1").await,
        "the undone claim's key is free again:
{}",
        gw.logs()
    );
    let replay = send("POST", &gw.url("/pay"), &[key("k-1")], "x").await;
    assert!(replay.replayed(), "{:?}", replay.headers);
    assert_eq!(upstream.hits("/pay"), 1);
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn hung_redis_is_503_within_the_store_timeout_and_nothing_is_forwarded() {
    let (redis, upstream, _dir, gw) = warm_redis_gateway("store_timeout = \"1s\"\n").await;

    redis.pause();
    // Resume Redis even if an assertion below fails, so its drop (SIGKILL) is all that is left.
    struct Resume<'a>(&'a test_servers::RedisServer);
    impl Drop for Resume<'_> {
        fn drop(&mut self) {
            self.0.resume();
        }
    }
    let resume = Resume(&redis);

    let started = Instant::now();
    let hung = send("POST", &gw.url("/hung/pay"), &[key("k-hung")], "x").await;
    let took = started.elapsed();
    assert_store_unavailable(&hung);
    // The store timeout is 1 s; the bound is generous so a loaded machine does not fail it.
    assert!(
        took < Duration::from_secs(10),
        "answered within the store timeout, took {took:?}"
    );
    assert_eq!(upstream.hits("/hung/pay"), 0, "nothing is forwarded");

    drop(resume);
    // A fresh key, not `k-hung`: the claim that timed out may still have run in Redis once it
    // woke up (the reply was lost, not the command), leaving an in-flight record nobody owns
    // until its lease lapses (documented on `RedisStore`).
    let fresh = eventually(200, || async {
        let r = send("POST", &gw.url("/hung/after"), &[key("k-after")], "x").await;
        (r.status == 201).then_some(r)
    })
    .await
    .expect("traffic flows once Redis answers again");
    assert!(!fresh.replayed());
    assert_eq!(upstream.hits("/hung/after"), 1);
    assert_eq!(upstream.hits("/hung/pay"), 0);
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn a_store_timeout_above_one_second_is_the_one_redis_calls_get() {
    let (redis, upstream, _dir, gw) = warm_redis_gateway("store_timeout = \"8s\"\n").await;

    // Redis stops answering for 2 s, well within the 8 s store timeout: the call waits for
    // it instead of failing at a 1 s bound of the store's own.
    redis.pause();
    let resume = async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        redis.resume();
    };
    let (url, headers) = (gw.url("/slow-redis/pay"), [key("k-slow")]);
    let (slow, ()) = tokio::join!(send("POST", &url, &headers, "x"), resume);
    assert_eq!(slow.status, 201, "{}", slow.text());
    assert_eq!(upstream.hits("/slow-redis/pay"), 1);
}

/// With no Redis at start the gateway serves anyway (503s, not ready) and reports it after
/// its listening line, without delaying it.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn a_gateway_starts_while_redis_is_down_and_reports_it_after_listening() {
    let upstream = TestUpstream::start().await;
    // A loopback port nothing listens on.
    let store = format!("redis://{}", support::free_addr());
    let url = upstream.url();
    let gw = Gateway::start_with(&["--upstream", &url, "--store", &store], &[]);
    shared_store::assert_serving_while_the_store_is_down(&gw, &upstream).await;
}

// ---- Redis over TLS --------------------------------------------------------------------------

/// A `rediss://` store talks TLS to a Redis that serves only TLS, and checks its certificate:
/// trusted through `SSL_CERT_FILE`, requests run once and replay; not trusted, the store is
/// unavailable and nothing is forwarded.
#[cfg(feature = "redis-tls")]
#[tokio::test(flavor = "multi_thread")]
async fn a_rediss_store_speaks_tls_and_checks_the_certificate() {
    let redis = test_servers::RedisServer::start_tls();
    let upstream = TestUpstream::start().await;
    let (upstream_url, store) = (upstream.url(), redis.url());
    assert!(store.starts_with("rediss://"), "{store}");
    let args = [
        "--upstream",
        upstream_url.as_str(),
        "--store",
        store.as_str(),
    ];
    let ca = redis.ca_file();
    let ca = ca.to_str().expect("a UTF-8 temp path");

    let trusting = Gateway::start_with(&args, &[("SSL_CERT_FILE", ca)]);
    let first = send("POST", &trusting.url("/tls"), &[key("k-tls")], "x").await;
    assert_eq!(first.status, 201, "{}\n{}", first.text(), trusting.logs());
    let retry = send("POST", &trusting.url("/tls"), &[key("k-tls")], "x").await;
    assert!(retry.replayed(), "{:?}", retry.headers);
    assert_eq!(retry.body, first.body);
    assert_eq!(upstream.hits("/tls"), 1);
    assert_eq!(admin_get(&trusting, "/readyz", &[]).await.status, 200);

    // The system's roots do not include the test CA: the handshake fails.
    let untrusting = Gateway::start_with(&args, &[]);
    let refused = send("POST", &untrusting.url("/tls"), &[key("k-untrusted")], "x").await;
    assert_store_unavailable(&refused);
    assert_eq!(upstream.hits("/tls"), 1, "nothing forwarded");
    assert_eq!(admin_get(&untrusting, "/readyz", &[]).await.status, 503);
    assert!(
        untrusting.logs().contains("certificate"),
        "the refusal names the certificate:\n{}",
        untrusting.logs()
    );
}

// ---- redb: the record outlives kill -9 of the gateway -------------------------------------

#[cfg(feature = "redb")]
#[tokio::test(flavor = "multi_thread")]
async fn redb_records_survive_kill_9_of_the_gateway() {
    use std::os::unix::process::ExitStatusExt;

    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let store = format!("redb:{}", dir.path().join("records.redb").display());
    let mut gw = Gateway::start_configured(&dir, &upstream, &store, "", &[]);

    let first = send(
        "POST",
        &gw.url("/charges"),
        &[key("k-durable"), ("content-type", "application/json")],
        r#"{"amount":100}"#,
    )
    .await;
    assert_eq!(first.status, 201, "{}", first.text());
    assert!(!first.replayed());

    let status = gw.kill9();
    assert_eq!(
        status.signal(),
        Some(9),
        "killed by SIGKILL, no drain: {status:?}"
    );

    let gw = Gateway::start_configured(&dir, &upstream, &store, "", &[]);
    let retry = send(
        "POST",
        &gw.url("/charges"),
        &[key("k-durable"), ("content-type", "application/json")],
        r#"{"amount":100}"#,
    )
    .await;
    assert_eq!(retry.status, first.status, "{}", retry.text());
    assert!(retry.replayed(), "{:?}", retry.headers);
    assert_eq!(retry.body, first.body, "replayed byte for byte");
    assert_eq!(retry.headers["x-upstream-n"], "1");
    assert_eq!(upstream.hits("/charges"), 1, "the retry did not run again");

    // The fingerprint survived too: the same key with another body is still refused.
    let other = send(
        "POST",
        &gw.url("/charges"),
        &[key("k-durable"), ("content-type", "application/json")],
        r#"{"amount":999}"#,
    )
    .await;
    assert_eq!(other.status, 422, "{}", other.text());
    assert_eq!(upstream.hits("/charges"), 1);
}

// ---- redb: a file that stops taking writes, and takes them again -------------------------

/// A keyed `POST /charges`, with `extra` headers.
#[cfg(feature = "redb")]
async fn charge(gw: &Gateway, k: &str, extra: &[(&str, &str)]) -> Resp {
    let mut headers = vec![key(k), ("content-type", "application/json")];
    headers.extend_from_slice(extra);
    send("POST", &gw.url("/charges"), &headers, r#"{"amount":100}"#).await
}

/// Sets the soft file-size limit (`RLIMIT_FSIZE`) of process `pid` with util-linux's
/// `prlimit`: `Some(bytes)`, or `None` for no limit.
#[cfg(feature = "redb")]
fn limit_file_size(pid: u32, bytes: Option<u64>) {
    let soft = bytes.map_or_else(|| "unlimited".to_owned(), |b| b.to_string());
    let status = std::process::Command::new("prlimit")
        .args([
            "--pid",
            &pid.to_string(),
            &format!("--fsize={soft}:unlimited"),
        ])
        .status()
        .expect("run prlimit (util-linux)");
    assert!(status.success(), "prlimit failed: {status:?}");
}

/// A write past the file-size limit fails with `EFBIG`, as a write to a full disk fails with
/// `ENOSPC`: the store must refuse changes (503, nothing forwarded) once a write fails, keep
/// what it had committed, and take changes again once the file can grow, without a restart.
/// (How long it refuses before a reopen is a matter of timing, so it is not asserted.)
#[cfg(feature = "redb")]
#[tokio::test(flavor = "multi_thread")]
async fn a_redb_file_that_cannot_grow_fails_closed_and_recovers_without_a_restart() {
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let path = dir.path().join("records.redb");
    let store = format!("redb:{}", path.display());
    let url = upstream.url();
    // SIGXFSZ ignored (and so ignored after exec too): the write fails instead of killing.
    let gw = Gateway::start_command(
        gateway_command_after("trap '' XFSZ"),
        &["--upstream", &url, "--store", &store],
        &[],
    );
    let before = charge(&gw, "k-before", &[]).await;
    assert_eq!(before.status, 201, "{}", before.text());

    // From here the file cannot grow past its present size.
    let size = std::fs::metadata(&path).expect("the redb file").len();
    limit_file_size(gw.pid(), Some(size));
    let mut refused = None;
    for i in 0..400 {
        let hits = upstream.hits("/charges");
        let r = charge(&gw, &format!("k-growing-{i}"), &[("x-size", "262144")]).await;
        if r.status == 503 {
            assert_eq!(
                upstream.hits("/charges"),
                hits,
                "a refused request is not forwarded"
            );
            refused = Some(r);
            break;
        }
    }
    let refused = refused.unwrap_or_else(|| {
        panic!(
            "the file never stopped taking writes; size {} bytes; logs:\n{}",
            std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0),
            gw.logs()
        )
    });
    assert_store_unavailable(&refused);
    assert!(
        gw.logs().contains("redb write failed"),
        "the failure is logged:\n{}",
        gw.logs()
    );

    // While the file refuses writes, a completed record is still replayed.
    for i in 0..20 {
        let replay = charge(&gw, "k-before", &[]).await;
        assert_eq!(
            replay.status,
            201,
            "replay {i} while the file refuses writes: {}",
            replay.text()
        );
        assert!(replay.replayed(), "{:?}", replay.headers);
        assert_eq!(replay.body, before.body);
    }

    // The disk takes writes again: the store reopens the file on its own.
    limit_file_size(gw.pid(), None);
    let after = eventually(300, || async {
        let r = charge(&gw, "k-after", &[]).await;
        (r.status != 503).then_some(r)
    })
    .await
    .unwrap_or_else(|| panic!("the store never recovered; logs:\n{}", gw.logs()));
    assert_eq!(after.status, 201, "{}", after.text());
    assert!(
        gw.logs().contains("redb file reopened"),
        "the recovery is logged:\n{}",
        gw.logs()
    );
    assert_eq!(admin_get(&gw, "/readyz", &[]).await.status, 200);
    let again = charge(&gw, "k-after", &[]).await;
    assert!(again.replayed(), "{:?}", again.headers);
    assert_eq!(again.body, after.body);

    // What was committed before the failure is still there.
    let kept = charge(&gw, "k-before", &[]).await;
    assert!(kept.replayed(), "{:?}", kept.headers);
    assert_eq!(kept.body, before.body, "replayed byte for byte");
}

// ---- clock steps: leases are judged on the monotonic clock --------------------------------

/// libfaketime, from Debian's `faketime` package (`.ci/install-deps` installs it).
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// A gateway whose wall clock the test can step: libfaketime reads the offset from `offset`
/// (`+0` to start) at every call, and leaves the monotonic clock alone.
fn gateway_with_steppable_clock(
    dir: &TempDir,
    upstream: &TestUpstream,
    store: &str,
    config: &str,
) -> (Gateway, std::path::PathBuf) {
    assert!(
        std::path::Path::new(LIBFAKETIME).exists(),
        "{LIBFAKETIME} is missing: install Debian's faketime package (.ci/install-deps)"
    );
    let offset = dir.write("clock-offset", "+0\n");
    let file = dir.write("clock.toml", config);
    let url = upstream.url();
    let env = [
        ("LD_PRELOAD", LIBFAKETIME),
        ("FAKETIME_TIMESTAMP_FILE", offset.to_str().unwrap()),
        ("FAKETIME_NO_CACHE", "1"),
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ];
    let args = [
        "--upstream",
        &url,
        "--store",
        store,
        "--config",
        file.to_str().unwrap(),
    ];
    (Gateway::start_with(&args, &env), offset)
}

/// A +120 s step of the wall clock (NTP, a virtual machine resumed) while a request runs must
/// not lapse its lease: on a `webhook` route (an unknown outcome lets the next delivery run),
/// the retry would otherwise run the request a second time while the first still runs.
async fn a_wall_clock_step_does_not_lapse_a_running_lease(store: &str) {
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let config = r#"
[[routes]]
prefix = "/hooks"
name = "hooks"
preset = "webhook"
lease = "10s"
"#;
    let (gw, offset) = gateway_with_steppable_clock(&dir, &upstream, store, config);
    let url = gw.url("/hooks/delivery");
    let first = tokio::spawn({
        let url = url.clone();
        async move { send("POST", &url, &[key("evt-1"), ("x-delay-ms", "3000")], "{}").await }
    });
    upstream.wait_for_hit("/hooks/delivery").await;

    std::fs::write(&offset, "+120\n").unwrap();
    let retry = send("POST", &url, &[key("evt-1"), ("x-delay-ms", "3000")], "{}").await;
    assert_eq!(
        retry.status,
        409,
        "{store}: the retry during the step: {}",
        retry.text()
    );
    assert_eq!(retry.problem_type(), IN_FLIGHT);
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{}", first.text());
    assert_eq!(
        upstream.hits("/hooks/delivery"),
        1,
        "{store}: the delivery ran twice"
    );
    let replay = send("POST", &url, &[key("evt-1")], "{}").await;
    assert!(replay.replayed(), "{store}: {}", replay.text());
}

#[cfg(feature = "redb")]
#[tokio::test(flavor = "multi_thread")]
async fn redb_leases_ignore_a_wall_clock_step() {
    let dir = TempDir::new();
    let store = format!("redb:{}", dir.path().join("records.redb").display());
    a_wall_clock_step_does_not_lapse_a_running_lease(&store).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn memory_leases_ignore_a_wall_clock_step() {
    a_wall_clock_step_does_not_lapse_a_running_lease("memory").await;
}

/// The Redis store judges leases on the Redis server's clock: a step of the gateway's does
/// not move them.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn redis_leases_ignore_a_gateway_wall_clock_step() {
    let redis = test_servers::RedisServer::start_with(&["--appendonly", "yes"]);
    a_wall_clock_step_does_not_lapse_a_running_lease(&redis.url()).await;
}
