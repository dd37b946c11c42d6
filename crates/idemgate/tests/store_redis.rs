//! `RedisStore` against a real `redis-server` (run `.ci/install-deps` if it is missing):
//! behaviour specific to Redis, and its faults: a killed, hung or restarted server.

#![cfg(feature = "redis")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use http_body_util::Full;
use idemgate::IdempotencyLayer;
use idemgate::body::RequestBody;
use idemgate::policy::RoutePolicy;
use idemgate::record::{
    Completion, FingerprintHash, OwnerToken, Record, RecordKey, StoredResponse,
};
use idemgate::store::{
    Claim, ClaimOptions, EvictionPolicy, Persistence, RedisStore, RedisStoreConfig, Store,
    StoreError, Transition, UnknownOutcome,
};
use test_servers::RedisServer;
use tower::ServiceExt;

/// The whole contract, each check on its own server (stopped once the check is done).
mod conformance {
    idemgate::store_conformance_tests!(super::store_on_own_server());
}

/// A store on a fresh server, and the server.
async fn store_on_own_server() -> (RedisStore, RedisServer) {
    let server = RedisServer::start();
    let store = connect(config(&server)).await;
    (store, server)
}

/// Short enough that fault tests finish quickly, long enough for a loaded 2-core machine.
const FAULT_TIMEOUT: Duration = Duration::from_millis(500);

fn options() -> ClaimOptions {
    ClaimOptions {
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        on_lapse: UnknownOutcome::Ambiguous,
    }
}

fn key(name: &str) -> RecordKey {
    RecordKey::of(name.as_bytes())
}

fn fingerprint(name: &str) -> FingerprintHash {
    FingerprintHash::of(format!("fingerprint {name}").as_bytes())
}

fn response(body: &[u8]) -> Completion {
    let mut headers = HeaderMap::new();
    headers.insert(
        "content-type",
        HeaderValue::from_static("application/octet-stream"),
    );
    Completion::Response(StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::copy_from_slice(body),
    })
}

fn config(server: &RedisServer) -> RedisStoreConfig {
    let mut config = RedisStoreConfig::new(server.url());
    config.key_prefix = "idemgate-test:".to_owned();
    config
}

fn fault_config(server: &RedisServer) -> RedisStoreConfig {
    let mut config = config(server);
    config.timeout = FAULT_TIMEOUT;
    config.connect_timeout = FAULT_TIMEOUT;
    config
}

async fn connect(config: RedisStoreConfig) -> RedisStore {
    RedisStore::connect(config)
        .await
        .expect("connect to the test redis-server")
}

/// A plain connection to inspect what the store wrote.
async fn raw(server: &RedisServer) -> redis::aio::MultiplexedConnection {
    redis::Client::open(server.url())
        .expect("valid url")
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection to the test redis-server")
}

/// Claims `name`'s key with its fingerprint and [`options`], under a fresh token.
async fn claim(store: &RedisStore, name: &str) -> Result<Claim, StoreError> {
    store
        .claim(
            &key(name),
            &fingerprint(name),
            OwnerToken::generate(),
            &options(),
        )
        .await
}

async fn acquire(store: &RedisStore, name: &str) -> OwnerToken {
    match claim(store, name).await {
        Ok(Claim::Acquired(token)) => token,
        other => panic!("expected Acquired for {name}, got {other:?}"),
    }
}

/// Claims `name` and keeps `response(name)` for it, for a minute.
async fn keep(store: &RedisStore, name: &str) {
    let token = acquire(store, name).await;
    let done = store
        .complete(
            &key(name),
            token,
            response(name.as_bytes()),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(done, Transition::Applied);
}

/// Polls `ping` until it succeeds; a bounded loop, for after a fault is cleared.
async fn until_ping_succeeds(store: &RedisStore) {
    for _ in 0..100 {
        if store.ping().await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the store did not come back within 10 s of the server");
}

/// How many times Redis ran `EVAL` (from `INFO commandstats`).
async fn evals(raw: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(raw)
        .await
        .expect("INFO commandstats");
    info.lines()
        .find_map(|line| line.strip_prefix("cmdstat_eval:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

async fn script_flush(raw: &mut redis::aio::MultiplexedConnection) {
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(raw)
        .await
        .expect("SCRIPT FLUSH");
}

#[tokio::test]
async fn every_transition_survives_script_flush() {
    let server = RedisServer::start();
    let store = connect(config(&server)).await;
    let mut raw = raw(&server).await;

    // Each step runs right after a flush, so its script is sent by SHA, refused with
    // NOSCRIPT and run with EVAL (unless the background reload the first NOSCRIPT started
    // happened to land after the flush). The first one certainly falls back.
    let before = evals(&mut raw).await;
    script_flush(&mut raw).await;
    let token = acquire(&store, "a").await;
    assert_eq!(
        evals(&mut raw).await,
        before + 1,
        "claim ran its script with EVAL after the flush"
    );

    script_flush(&mut raw).await;
    assert_eq!(
        store
            .renew(&key("a"), token, Duration::from_secs(60))
            .await
            .unwrap(),
        Transition::Applied
    );
    script_flush(&mut raw).await;
    assert_eq!(
        store
            .complete(&key("a"), token, response(b"done"), Duration::from_secs(60))
            .await
            .unwrap(),
        Transition::Applied
    );
    let replay = claim(&store, "a").await.unwrap();
    assert_eq!(replay, Claim::Completed(Arc::new(response(b"done"))));

    script_flush(&mut raw).await;
    let token = acquire(&store, "b").await;
    script_flush(&mut raw).await;
    assert_eq!(
        store
            .mark_ambiguous(&key("b"), token, Duration::from_secs(60))
            .await
            .unwrap(),
        Transition::Applied
    );
    script_flush(&mut raw).await;
    let token = acquire(&store, "c").await;
    script_flush(&mut raw).await;
    assert_eq!(
        store.release(&key("c"), token).await.unwrap(),
        Transition::Applied
    );

    assert!(matches!(
        store.get(&key("b")).await.unwrap(),
        Some(Record::Ambiguous { .. })
    ));
    assert_eq!(store.get(&key("c")).await.unwrap(), None);
}

#[tokio::test]
async fn killed_server_fails_every_call_within_the_timeout() {
    let mut server = RedisServer::start();
    let store = connect(fault_config(&server)).await;
    let token = acquire(&store, "held").await;
    server.stop();

    let bound = FAULT_TIMEOUT * 5;
    let k = key("held");
    let fp = fingerprint("held");
    let ttl = Duration::from_secs(60);
    macro_rules! fails_in_time {
        ($call:expr) => {{
            let started = Instant::now();
            let result = $call.await;
            let took = started.elapsed();
            assert!(
                result.is_err(),
                "{} succeeded against a dead server",
                stringify!($call)
            );
            assert!(took < bound, "{} took {took:?}", stringify!($call));
        }};
    }
    fails_in_time!(store.claim(&k, &fp, OwnerToken::generate(), &options()));
    fails_in_time!(store.complete(&k, token, response(b"x"), ttl));
    fails_in_time!(store.release(&k, token));
    fails_in_time!(store.renew(&k, token, ttl));
    fails_in_time!(store.mark_ambiguous(&k, token, ttl));
    fails_in_time!(store.get(&k));
    fails_in_time!(store.delete(&k));
    fails_in_time!(store.ping());
}

#[tokio::test]
async fn hung_server_times_out_and_the_store_recovers_when_it_thaws() {
    let server = RedisServer::start();
    let store = connect(fault_config(&server)).await;
    acquire(&store, "before").await;

    server.pause();
    let started = Instant::now();
    let err = claim(&store, "during")
        .await
        .expect_err("a frozen server cannot answer");
    assert!(started.elapsed() < FAULT_TIMEOUT * 5);
    assert!(
        matches!(err, StoreError::Timeout { backend: "redis", after } if after == FAULT_TIMEOUT),
        "{err:?}"
    );
    assert!(matches!(
        store.ping().await,
        Err(StoreError::Timeout { .. })
    ));

    server.resume();
    until_ping_succeeds(&store).await;
    acquire(&store, "after").await;
    // The claim sent while frozen may have run once Redis thawed, or not; either way the
    // store answers about the key consistently.
    let again = claim(&store, "during").await.unwrap();
    assert!(
        matches!(again, Claim::Acquired(_) | Claim::InFlight { .. }),
        "{again:?}"
    );
}

#[tokio::test]
async fn restarted_server_is_used_again_by_the_same_store() {
    let mut server = RedisServer::start();
    let store = connect(fault_config(&server)).await;
    acquire(&store, "before").await;

    server.stop();
    assert!(store.ping().await.is_err());
    assert!(store.get(&key("before")).await.is_err());

    server.restart();
    until_ping_succeeds(&store).await;
    // The test server keeps nothing across a restart: the store refuses to claim until the
    // loss is acknowledged (see restart_without_persistence_refuses_claims_until_acknowledged),
    // and then the key is free again.
    assert!(claim(&store, "before").await.is_err());
    assert!(store.acknowledge_data_loss().await.unwrap());
    acquire(&store, "before").await;
    acquire(&store, "after").await;
}

#[tokio::test]
async fn unreachable_server_fails_connect_clearly_and_without_the_password() {
    let mut server = RedisServer::start();
    server.stop();
    let mut config = fault_config(&server);
    config.url = format!("redis://:hunter2@127.0.0.1:{}/0", server.port());

    let started = Instant::now();
    let err = RedisStore::connect(config)
        .await
        .expect_err("nothing listens on the port");
    assert!(started.elapsed() < (FAULT_TIMEOUT * 2) * 5);
    assert!(
        matches!(
            err,
            StoreError::Unavailable {
                backend: "redis",
                ..
            }
        ),
        "{err:?}"
    );

    let mut chain = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(cause) = source {
        chain.push_str(": ");
        chain.push_str(&cause.to_string());
        source = cause.source();
    }
    assert!(
        chain.contains(&format!("redis://:***@127.0.0.1:{}/0", server.port())),
        "{chain}"
    );
    assert!(!chain.contains("hunter2"), "{chain}");
    assert!(!format!("{err:?}").contains("hunter2"));
}

#[tokio::test]
async fn invalid_url_is_refused_at_setup() {
    let err = RedisStore::connect(RedisStoreConfig::new("http://:secret@example.invalid"))
        .await
        .expect_err("not a redis url");
    assert!(matches!(
        err,
        StoreError::Unavailable {
            backend: "redis",
            ..
        }
    ));
    let source = std::error::Error::source(&err)
        .expect("names the url")
        .to_string();
    assert!(
        source.contains("invalid url") && !source.contains("secret"),
        "{source}"
    );
}

#[tokio::test]
async fn lazy_store_starts_without_redis_and_works_once_it_appears() {
    let mut server = RedisServer::start();
    server.stop();
    let store = RedisStore::connect_lazy(fault_config(&server)).expect("no network needed");
    assert!(store.ping().await.is_err());
    assert_eq!(store.eviction_policy(), None);

    server.restart();
    until_ping_succeeds(&store).await;
    assert_eq!(store.eviction_policy(), Some(EvictionPolicy::NoEviction));
    acquire(&store, "lazy").await;
}

#[tokio::test]
async fn eviction_policy_is_checked_at_connect() {
    let safe = RedisServer::start();
    assert_eq!(
        connect(config(&safe)).await.eviction_policy(),
        Some(EvictionPolicy::NoEviction)
    );

    let evicting = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    let store = connect(config(&evicting)).await;
    assert_eq!(
        store.eviction_policy(),
        Some(EvictionPolicy::Evicting("allkeys-lru".to_owned()))
    );

    let volatile = RedisServer::start_with(&["--maxmemory-policy", "volatile-ttl"]);
    assert_eq!(
        connect(config(&volatile)).await.eviction_policy(),
        Some(EvictionPolicy::Evicting("volatile-ttl".to_owned()))
    );
}

#[tokio::test]
async fn disabled_config_command_does_not_stop_the_store() {
    let server = RedisServer::start_with(&["--rename-command", "CONFIG", ""]);
    let store = connect(config(&server)).await;
    assert_eq!(store.eviction_policy(), Some(EvictionPolicy::Unknown));
    acquire(&store, "works").await;
}

#[tokio::test]
async fn keys_carry_the_prefix_a_hash_tag_and_a_ttl() {
    let server = RedisServer::start();
    let store = connect(config(&server)).await;
    let mut raw = raw(&server).await;
    acquire(&store, "prefixed").await;

    let mut keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut raw)
        .await
        .unwrap();
    keys.sort();
    let expected = format!("idemgate-test:{{{}}}", key("prefixed").to_hex());
    // The record, and the data marker (without a TTL) beside the records.
    assert_eq!(
        keys,
        ["idemgate-test:data-marker".to_owned(), expected.clone()]
    );
    let marker_ttl: i64 = redis::cmd("PTTL")
        .arg("idemgate-test:data-marker")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(marker_ttl, -1, "the marker never expires");
    assert_eq!(store.redis_key(&key("prefixed")), expected.as_bytes());

    let kind: String = redis::cmd("TYPE")
        .arg(&expected)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(kind, "hash");
    let ttl_ms: i64 = redis::cmd("PTTL")
        .arg(&expected)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(ttl_ms > 3_500_000 && ttl_ms <= 3_600_000, "{ttl_ms}");

    // The default prefix applies when none is configured.
    let plain = connect(RedisStoreConfig::new(server.url())).await;
    acquire(&plain, "default").await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("idemgate:{*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(keys, [format!("idemgate:{{{}}}", key("default").to_hex())]);
}

#[tokio::test]
async fn bodies_are_stored_as_raw_bytes() {
    let server = RedisServer::start();
    let store = connect(config(&server)).await;
    let mut raw = raw(&server).await;
    let body: Vec<u8> = (0..1024 * 1024).map(|i| (i % 251) as u8).collect();
    let token = acquire(&store, "big").await;
    let done = store
        .complete(&key("big"), token, response(&body), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(done, Transition::Applied);

    let stored: usize = redis::cmd("HSTRLEN")
        .arg(store.redis_key(&key("big")))
        .arg("body")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(
        stored >= body.len() && stored < body.len() + 128,
        "{stored}"
    );
    let replay = claim(&store, "big").await.unwrap();
    assert_eq!(replay, Claim::Completed(Arc::new(response(&body))));
}

#[tokio::test]
async fn renew_keeps_a_short_lived_record_alive_for_the_new_lease() {
    let server = RedisServer::start();
    let store = connect(config(&server)).await;
    let mut raw = raw(&server).await;
    let opts = ClaimOptions {
        lease: Duration::from_secs(1),
        ttl: Duration::from_secs(2),
        on_lapse: UnknownOutcome::Ambiguous,
    };
    let token = match store
        .claim(
            &key("short"),
            &fingerprint("short"),
            OwnerToken::generate(),
            &opts,
        )
        .await
        .unwrap()
    {
        Claim::Acquired(token) => token,
        other => panic!("{other:?}"),
    };
    let renewed = store
        .renew(&key("short"), token, Duration::from_secs(600))
        .await
        .unwrap();
    assert_eq!(renewed, Transition::Applied);
    let ttl_ms: i64 = redis::cmd("PTTL")
        .arg(store.redis_key(&key("short")))
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(ttl_ms > 590_000, "{ttl_ms}");
    let Some(Record::InFlight { lease_deadline, .. }) = store.get(&key("short")).await.unwrap()
    else {
        panic!("still in flight");
    };
    let left = lease_deadline
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    // Redis' clock and ours are the same machine's here; allow generous slack anyway.
    assert!(left > Duration::from_secs(500), "{left:?}");
}

#[tokio::test]
async fn gateways_sharing_one_redis_never_both_acquire() {
    let server = RedisServer::start();
    let gateways: Vec<RedisStore> = vec![
        connect(config(&server)).await,
        connect(config(&server)).await,
        connect(config(&server)).await,
    ];
    for round in 0..5 {
        let name = format!("race-{round}");
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..30 {
            let store = gateways[i % gateways.len()].clone();
            let name = name.clone();
            tasks.spawn(async move { claim(&store, &name).await.expect("claim") });
        }
        let mut acquired = 0;
        while let Some(claim) = tasks.join_next().await {
            match claim.expect("task") {
                Claim::Acquired(_) => acquired += 1,
                Claim::InFlight { .. } => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(acquired, 1, "round {round}");
    }
}

#[tokio::test]
async fn records_written_by_something_else_are_errors_not_panics() {
    let server = RedisServer::start();
    let store = connect(config(&server)).await;
    let mut raw = raw(&server).await;

    let odd_state = store.redis_key(&key("odd"));
    let () = redis::cmd("HSET")
        .arg(&odd_state)
        .arg("s")
        .arg("z")
        .arg("fp")
        .arg(&fingerprint("odd").0[..])
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(matches!(
        claim(&store, "odd").await,
        Err(StoreError::Corrupt {
            backend: "redis",
            ..
        })
    ));
    assert!(matches!(
        store.get(&key("odd")).await,
        Err(StoreError::Corrupt {
            backend: "redis",
            ..
        })
    ));

    let bad_body = store.redis_key(&key("bad-body"));
    let () = redis::cmd("HSET")
        .arg(&bad_body)
        .arg("s")
        .arg("c")
        .arg("fp")
        .arg(&fingerprint("bad-body").0[..])
        .arg("body")
        .arg(&b"\x09garbage"[..])
        .arg("at")
        .arg("1")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(matches!(
        claim(&store, "bad-body").await,
        Err(StoreError::Corrupt { .. })
    ));

    // A key of another type: Redis itself refuses (WRONGTYPE), kept as the error's source.
    let string_key = store.redis_key(&key("string"));
    let () = redis::cmd("SET")
        .arg(&string_key)
        .arg("x")
        .query_async(&mut raw)
        .await
        .unwrap();
    let err = claim(&store, "string").await.expect_err("WRONGTYPE");
    let StoreError::Unavailable {
        backend: "redis",
        source,
    } = err
    else {
        panic!("{err:?}");
    };
    assert!(source.downcast_ref::<redis::RedisError>().is_some());

    // The operator's way out works on all of them.
    assert!(store.delete(&key("odd")).await.unwrap());
    assert!(store.delete(&key("bad-body")).await.unwrap());
    assert!(!store.delete(&key("never")).await.unwrap());
}

/// The layer in front of `store`, with `store_timeout` `FAULT_TIMEOUT` and a lease of twice
/// that (the shortest a proxy accepts is 1.5 times), keeping ambiguous records.
fn fault_layer(store: &RedisStore) -> IdempotencyLayer {
    IdempotencyLayer::new(Arc::new(store.clone()))
        .store_timeout(FAULT_TIMEOUT)
        .default_route(
            RoutePolicy::api()
                .lease(FAULT_TIMEOUT * 2)
                .unknown_outcome(UnknownOutcome::Ambiguous),
        )
}

/// Sends one keyed POST through `layer` to an upstream that answers `201` and counts its calls.
async fn send_keyed(layer: &IdempotencyLayer, calls: &Arc<AtomicUsize>, key: &str) -> StatusCode {
    let calls = Arc::clone(calls);
    let upstream = tower::service_fn(move |_req: http::Request<RequestBody<Full<Bytes>>>| {
        calls.fetch_add(1, Ordering::SeqCst);
        async {
            let mut response = http::Response::new(Full::new(Bytes::from_static(b"{}")));
            *response.status_mut() = StatusCode::CREATED;
            Ok::<_, std::convert::Infallible>(response)
        }
    });
    let request = http::Request::post("/payments")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"amount\":1}")))
        .unwrap();
    let response = tower::ServiceBuilder::new()
        .layer(layer.clone())
        .service(upstream)
        .oneshot(request)
        .await
        .unwrap();
    response.status()
}

#[tokio::test]
async fn claim_lost_after_script_flush_is_undone_and_the_retry_runs() {
    let server = RedisServer::start();
    let store = connect(fault_config(&server)).await;
    let mut raw = raw(&server).await;
    // After a flush (as after a restart or a failover) the claim script is cached again by
    // the first claim; the release script that undoes a lost claim is not.
    script_flush(&mut raw).await;
    acquire(&store, "warm-up").await;
    let layer = fault_layer(&store);
    let calls = Arc::new(AtomicUsize::new(0));

    // Redis freezes: the claim is sent, its answer does not come within store_timeout (the
    // client gets 503), and the claim lands once Redis thaws, between the second and the
    // third store timeout: after the first undo attempt has given up, during the second.
    let started = Instant::now();
    server.pause();
    let status = send_keyed(&layer, &calls, "lost-claim").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    tokio::time::sleep_until((started + FAULT_TIMEOUT * 5 / 2).into()).await;
    server.resume();

    // Past the lease the claim would have, had it not been undone.
    tokio::time::sleep(FAULT_TIMEOUT * 2 + FAULT_TIMEOUT / 2).await;
    let retry = send_keyed(&layer, &calls, "lost-claim").await;
    assert_eq!(
        retry,
        StatusCode::CREATED,
        "the retry of a request that never ran must run (502 means the lost claim was never \
         undone and lapsed into an ambiguous record)"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// How many scripts Redis has cached (`number_of_cached_scripts` in `INFO memory`).
async fn cached_scripts(raw: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(raw)
        .await
        .expect("INFO memory");
    info.lines()
        .find_map(|line| line.strip_prefix("number_of_cached_scripts:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn scripts_are_loaded_again_when_the_store_reconnects() {
    let mut server = RedisServer::start();
    let store = connect(fault_config(&server)).await;
    server.restart();
    until_ping_succeeds(&store).await;

    // Every transition script is cached again without waiting for its first use, so the
    // first release after a restart is one round trip, not a NOSCRIPT and a reload.
    let mut raw = raw(&server).await;
    let mut cached = 0;
    for _ in 0..100 {
        cached = cached_scripts(&mut raw).await;
        if cached >= 5 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(cached >= 5, "{cached} scripts cached after the reconnect");
}

/// The chain of `error`'s messages, outermost first.
fn chain(error: &StoreError) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[tokio::test]
async fn restart_without_persistence_refuses_claims_until_acknowledged() {
    let mut server = RedisServer::start();
    let store = connect(fault_config(&server)).await;
    keep(&store, "kept").await;

    // The test server keeps nothing across a restart: the record is forgotten, and a retry
    // of its request would run a second time if the store went on claiming.
    server.restart();
    until_ping_succeeds(&store).await;
    let refused = claim(&store, "kept")
        .await
        .expect_err("a store that lost its records must refuse new claims");
    assert!(
        matches!(
            refused,
            StoreError::Unavailable {
                backend: "redis",
                ..
            }
        ),
        "{refused:?}"
    );
    assert!(
        chain(&refused).contains("lost its data"),
        "{}",
        chain(&refused)
    );
    assert!(
        claim(&store, "new").await.is_err(),
        "every new claim is refused"
    );
    let status = store.data_loss();
    assert!(status.unacknowledged.is_some(), "{status:?}");
    assert_eq!(status.detected, 1, "one loss, counted once");

    // The operator acknowledges: claims are served again, and the loss stays counted.
    assert!(store.acknowledge_data_loss().await.unwrap());
    assert_eq!(store.data_loss().unacknowledged, None);
    assert_eq!(store.data_loss().detected, 1);
    acquire(&store, "kept").await;
    assert!(
        !store.acknowledge_data_loss().await.unwrap(),
        "nothing left to acknowledge"
    );
}

#[tokio::test]
async fn data_loss_is_found_at_reconnect_and_replays_that_survive_are_served() {
    let mut server = RedisServer::start();
    let store = connect(fault_config(&server)).await;
    server.restart();
    until_ping_succeeds(&store).await;
    // Found by the set-up that follows the reconnect, before any claim tries to acquire.
    let mut found = false;
    for _ in 0..100 {
        if store.data_loss().unacknowledged.is_some() {
            found = true;
            break;
        }
        let _ = store.ping().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(found, "the reconnect found the marker gone");

    // A record written after the loss (by another gateway, started after it, which adopts
    // the marker it finds or writes) is still answered: only acquiring is refused.
    let other = connect(config(&server)).await;
    let token = acquire(&other, "after").await;
    assert_eq!(
        other
            .complete(
                &key("after"),
                token,
                response(b"after"),
                Duration::from_secs(60)
            )
            .await
            .unwrap(),
        Transition::Applied
    );
    assert_eq!(
        claim(&store, "after").await.unwrap(),
        Claim::Completed(Arc::new(response(b"after")))
    );
    assert!(claim(&store, "fresh").await.is_err());
    // The marker the other gateway wrote is not the one this store expects.
    assert!(store.data_loss().unacknowledged.is_some());
    assert_eq!(other.data_loss().unacknowledged, None);
    acquire(&other, "fresh").await;
}

#[tokio::test]
async fn restart_with_appendonly_keeps_the_marker_and_serves() {
    let mut server = RedisServer::start_with(&["--appendonly", "yes"]);
    let store = connect(fault_config(&server)).await;
    assert_eq!(
        store.persistence(),
        Some(Persistence::AppendOnly {
            fsync: "everysec".to_owned()
        })
    );
    keep(&store, "kept").await;

    server.restart();
    until_ping_succeeds(&store).await;
    assert_eq!(
        claim(&store, "kept").await.unwrap(),
        Claim::Completed(Arc::new(response(b"kept")))
    );
    acquire(&store, "new").await;
    // Once more after the set-up that follows the reconnect has surely run.
    let _ = store.ping().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    acquire(&store, "newer").await;
    assert_eq!(store.data_loss().unacknowledged, None);
    assert_eq!(store.data_loss().detected, 0);
}

#[tokio::test]
async fn persistence_is_checked_at_connect() {
    let volatile = RedisServer::start();
    assert_eq!(
        connect(config(&volatile)).await.persistence(),
        Some(Persistence::NotAppendOnly)
    );
    let durable = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    assert_eq!(
        connect(config(&durable)).await.persistence(),
        Some(Persistence::AppendOnly {
            fsync: "always".to_owned()
        })
    );
    let managed = RedisServer::start_with(&["--rename-command", "CONFIG", ""]);
    assert_eq!(
        connect(config(&managed)).await.persistence(),
        Some(Persistence::Unknown)
    );
}

/// Waits (at most 10 s) until the Redis behind `raw` has `count` replicas online.
async fn until_replicas_online(raw: &mut redis::aio::MultiplexedConnection, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let info: String = redis::cmd("INFO")
            .arg("replication")
            .query_async(raw)
            .await
            .expect("INFO replication");
        let online = info
            .lines()
            .filter(|l| l.starts_with("slave") && l.contains("state=online"))
            .count();
        if online >= count {
            return;
        }
        assert!(Instant::now() < deadline, "no replica came online:\n{info}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn wait_replicas_answers_a_new_claim_only_once_enough_replicas_hold_it() {
    let primary = RedisServer::start();
    let port = primary.port().to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    until_replicas_online(&mut raw(&primary).await, 1).await;
    // The store waits for replicas half its timeout: 1 s here. The fault tests' 500 ms left
    // 250 ms, which a replica missed once while the whole test suite ran.
    let timeout = Duration::from_secs(2);
    let replicated = |wanted| {
        let mut config = config(&primary);
        config.timeout = timeout;
        config.connect_timeout = FAULT_TIMEOUT;
        config.wait_replicas = wanted;
        config
    };
    let store = connect(replicated(1)).await;
    acquire(&store, "replicated").await;

    // A frozen replica acknowledges nothing: a new claim fails within the store timeout,
    // naming the replicas, while a claim that takes nothing (here, of a key in flight) does
    // not wait for them.
    replica.pause();
    let started = Instant::now();
    let refused = claim(&store, "not replicated").await;
    let waited = started.elapsed();
    let in_flight = claim(&store, "replicated").await;
    replica.resume();
    match refused {
        Err(ref e @ StoreError::Unavailable { .. }) => assert!(
            chain(e).contains("0 of the 1 replicas required acknowledged the claim"),
            "{}",
            chain(e)
        ),
        other => panic!("expected the claim to be refused, got {other:?}"),
    }
    assert!(waited < timeout, "took {waited:?}");
    assert!(
        matches!(in_flight, Ok(Claim::InFlight { .. })),
        "{in_flight:?}"
    );

    // Thawed, the replica acknowledges again; asking for more replicas than there are fails.
    acquire(&store, "after the thaw").await;
    let greedy = connect(replicated(2)).await;
    assert!(matches!(
        claim(&greedy, "two replicas").await,
        Err(StoreError::Unavailable { .. })
    ));
}
