//! `RedisStore` on a real Redis Cluster: six `redis-server --cluster-enabled yes` on loopback,
//! three primaries with a replica each, started by the tests (run `.ci/install-deps` if
//! `redis-server` or `redis-cli` is missing). The whole conformance suite, and what is the
//! cluster's own: slots, scripts on every node, a primary's failover, a node's data loss.
//!
//! A cluster takes seconds to form, so the conformance checks share one (started by the first
//! check that runs): every check uses random keys, so they cannot see each other's records.
//! The tests that kill or empty a node start a cluster of their own.

#![cfg(feature = "redis-cluster")]

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use idemgate::record::{OwnerToken, RecordKey};
use idemgate::store::conformance as checks;
use idemgate::store::{Claim, RedisStore, RedisStoreConfig, Store, StoreError};
use test_servers::RedisCluster;

/// The cluster the conformance checks share; its nodes are killed when the test binary exits
/// (see `test_servers::redis_cluster`).
static SHARED: OnceLock<RedisCluster> = OnceLock::new();

fn shared_cluster() -> &'static RedisCluster {
    // Forming the cluster blocks for seconds; the checks run on multi-threaded runtimes.
    tokio::task::block_in_place(|| SHARED.get_or_init(RedisCluster::start))
}

/// The whole contract, each check with a store of its own on the shared cluster.
mod conformance {
    idemgate::store_conformance_tests!(super::store_on_shared_cluster());
}

async fn store_on_shared_cluster() -> RedisStore {
    connect(config(shared_cluster(), "idemgate-test:")).await
}

/// Short enough that fault tests finish quickly, long enough for a loaded 2-core machine.
const FAULT_TIMEOUT: Duration = Duration::from_millis(500);

fn config(cluster: &RedisCluster, key_prefix: &str) -> RedisStoreConfig {
    let mut config = RedisStoreConfig::new(cluster.url());
    config.key_prefix = key_prefix.to_owned();
    config
}

async fn connect(config: RedisStoreConfig) -> RedisStore {
    RedisStore::connect(config)
        .await
        .unwrap_or_else(|e| panic!("connect to the test cluster: {}", chain(&e)))
}

/// An error and its causes on one line.
fn chain(error: &StoreError) -> String {
    idemgate::ErrorChain(error).to_string()
}

fn key(name: &str) -> RecordKey {
    RecordKey::of(name.as_bytes())
}

/// Claims `name`'s key (a long lease and ttl) under a fresh token.
async fn claim(store: &RedisStore, name: &str) -> Result<Claim, StoreError> {
    let (fingerprint, options) = (checks::fingerprint(name), checks::long_options());
    store
        .claim(&key(name), &fingerprint, OwnerToken::generate(), &options)
        .await
}

/// A plain cluster connection to inspect the cluster.
async fn raw(cluster: &RedisCluster) -> redis::cluster_async::ClusterConnection {
    let nodes: Vec<String> = cluster
        .running_ports()
        .iter()
        .map(|port| format!("redis://127.0.0.1:{port}"))
        .collect();
    redis::cluster::ClusterClient::new(nodes)
        .expect("cluster client")
        .get_async_connection()
        .await
        .expect("raw connection to the test cluster")
}

async fn slot_of(raw: &mut redis::cluster_async::ClusterConnection, key: &[u8]) -> u16 {
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query_async(raw)
        .await
        .expect("CLUSTER KEYSLOT")
}

/// `count` key names whose records the primary on `port` serves, and `count` that another
/// primary serves.
async fn names_by_primary(
    cluster: &RedisCluster,
    store: &RedisStore,
    port: u16,
    count: usize,
) -> (Vec<String>, Vec<String>) {
    let mut raw = raw(cluster).await;
    let owners = cluster.slot_owners();
    let (mut on, mut off) = (Vec::new(), Vec::new());
    for i in 0.. {
        if on.len() >= count && off.len() >= count {
            break;
        }
        assert!(i < 100_000, "no keys spread over the primaries");
        let name = format!("spread-{i}");
        let slot = slot_of(&mut raw, &store.redis_key(&key(&name))).await;
        let list = if owners[usize::from(slot)] == port {
            &mut on
        } else {
            &mut off
        };
        if list.len() < count {
            list.push(name);
        }
    }
    (on, off)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_and_the_markers_they_are_checked_against_share_a_slot() {
    let cluster = shared_cluster();
    let store = connect(config(cluster, "idemgate-slots-test:")).await;
    let mut raw = raw(cluster).await;
    let owners = cluster.slot_owners();
    // One marker per slot, each in the slot it guards, on the primary that serves it.
    let mut markers = 0;
    for port in cluster.primaries() {
        let keys = cluster.cli(
            port,
            &["--raw", "keys", "idemgate-slots-test:data-marker:*"],
        );
        for marker in keys.lines() {
            let slot = slot_of(&mut raw, marker.as_bytes()).await;
            assert_eq!(owners[usize::from(slot)], port, "{marker}");
            markers += 1;
        }
    }
    assert_eq!(markers, 16384, "one marker per slot");
    // Claims on keys all over the cluster acquire (no CROSSSLOT; MOVED followed), each
    // record on the primary of its slot.
    for i in 0..50 {
        let name = format!("slot-{i}");
        assert!(matches!(claim(&store, &name).await, Ok(Claim::Acquired(_))));
        let record = store.redis_key(&key(&name));
        let owner = owners[usize::from(slot_of(&mut raw, &record).await)];
        let exists = cluster.cli(owner, &["exists", &String::from_utf8_lossy(&record)]);
        assert_eq!(exists.trim(), "1", "{name} is on the primary of its slot");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scripts_flushed_on_every_node_are_run_again() {
    let cluster = shared_cluster();
    let store = connect(config(cluster, "idemgate-flush-test:")).await;
    for port in cluster.running_ports() {
        let info = cluster.cli(port, &["info", "memory"]);
        let cached: u64 = info
            .lines()
            .find_map(|l| l.strip_prefix("number_of_cached_scripts:"))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        assert!(cached >= 6, "node {port} has the store's scripts: {cached}");
    }
    for port in cluster.running_ports() {
        assert_eq!(cluster.cli(port, &["script", "flush"]).trim(), "OK");
    }
    // Every primary meets NOSCRIPT once and runs the script with EVAL.
    for i in 0..50 {
        assert!(matches!(
            claim(&store, &format!("flushed-{i}")).await,
            Ok(Claim::Acquired(_))
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_fails_calls_then_serves_them_and_keeps_what_replicas_had() {
    let mut cluster = tokio::task::block_in_place(RedisCluster::start);
    let mut config = config(&cluster, "idemgate-failover-test:");
    config.timeout = FAULT_TIMEOUT;
    config.connect_timeout = FAULT_TIMEOUT;
    let store = connect(config).await;
    let victim = cluster.primaries()[0];
    let (on_victim, elsewhere) = names_by_primary(&cluster, &store, victim, 30).await;

    // Claims the old primary acknowledged and replicated.
    for name in on_victim.iter().chain(&elsewhere) {
        assert!(matches!(claim(&store, name).await, Ok(Claim::Acquired(_))));
    }
    tokio::task::block_in_place(|| cluster.wait_replicated(victim, Duration::from_secs(10)));
    cluster.kill_node(victim);

    // Until a replica takes over, calls on the victim's slots fail as unavailable (within
    // their timeout); then they are served again, by the same store.
    let started = Instant::now();
    let mut failures = 0;
    let served = loop {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the store was not served again within 60 s of the failover ({failures} failures)"
        );
        let call = Instant::now();
        match claim(&store, &on_victim[0]).await {
            Err(StoreError::Unavailable { .. } | StoreError::Timeout { .. }) => {
                assert!(
                    call.elapsed() < FAULT_TIMEOUT * 4,
                    "took {:?}",
                    call.elapsed()
                );
                failures += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(other) => panic!("unexpected error during the failover: {}", chain(&other)),
            Ok(answer) => break answer,
        }
    };
    assert!(failures > 0, "calls failed while the primary was gone");
    assert!(
        matches!(served, Claim::InFlight { .. }),
        "the promoted replica had the claim: {served:?}"
    );
    tokio::task::block_in_place(|| cluster.wait_until_ok(Duration::from_secs(30)));
    // No key the old primary had acknowledged to its replica is acquired a second time.
    for name in on_victim.iter().chain(&elsewhere) {
        let answer = claim(&store, name).await;
        assert!(
            matches!(answer, Ok(Claim::InFlight { .. })),
            "{name}: {answer:?}"
        );
    }
    // And new keys are served on every slot, the promoted primary's included.
    for i in 0..30 {
        assert!(matches!(
            claim(&store, &format!("after-{i}")).await,
            Ok(Claim::Acquired(_))
        ));
    }
    assert_eq!(store.data_loss().unacknowledged, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_loses_its_data_refuses_claims_in_its_slots_until_acknowledged() {
    let cluster = tokio::task::block_in_place(RedisCluster::start);
    let prefix = "idemgate-loss-test:";
    let first = connect(config(&cluster, prefix)).await;
    let second = connect(config(&cluster, prefix)).await;
    // Not slot 0's primary: it keeps the flag that says every slot's marker was written (a
    // loss there is found by a store's first contact instead).
    let slot_0 = cluster.primary_of_slot(0);
    let victim = cluster
        .primaries()
        .into_iter()
        .find(|p| *p != slot_0)
        .unwrap();
    let (on_victim, elsewhere) = names_by_primary(&cluster, &first, victim, 5).await;
    for name in &elsewhere[..2] {
        assert!(matches!(claim(&first, name).await, Ok(Claim::Acquired(_))));
    }

    // The node loses everything (as a restart without persistence would).
    assert_eq!(cluster.cli(victim, &["flushall"]).trim(), "OK");

    for store in [&first, &second] {
        let refused = claim(store, &on_victim[0]).await;
        assert!(
            matches!(&refused, Err(StoreError::Unavailable { .. })),
            "{refused:?}"
        );
        assert!(store.data_loss().unacknowledged.is_some());
        // Slots whose node kept its data are served: records there are still answered, and
        // new keys acquired.
        assert!(matches!(
            claim(store, &elsewhere[0]).await,
            Ok(Claim::InFlight { .. })
        ));
    }
    assert!(matches!(
        claim(&first, &elsewhere[3]).await,
        Ok(Claim::Acquired(_))
    ));

    // A store set up after the loss finds it too, at its first claim there: markers are
    // never filled in once every slot had one.
    let late = connect(config(&cluster, prefix)).await;
    assert!(matches!(
        claim(&late, &on_victim[3]).await,
        Err(StoreError::Unavailable { .. })
    ));
    assert!(late.data_loss().unacknowledged.is_some());

    // Acknowledged on the first gateway: it claims again everywhere; the second, which has
    // not acknowledged, now refuses everywhere (the markers were renewed) until it does.
    assert!(first.acknowledge_data_loss().await.unwrap());
    assert!(matches!(
        claim(&first, &on_victim[1]).await,
        Ok(Claim::Acquired(_))
    ));
    assert!(matches!(
        claim(&second, &elsewhere[4]).await,
        Err(StoreError::Unavailable { .. })
    ));
    assert!(second.acknowledge_data_loss().await.unwrap());
    assert!(matches!(
        claim(&second, &on_victim[2]).await,
        Ok(Claim::Acquired(_))
    ));
    assert!(matches!(
        claim(&second, &elsewhere[4]).await,
        Ok(Claim::Acquired(_))
    ));
    assert!(matches!(
        claim(&first, &on_victim[1]).await,
        Ok(Claim::InFlight { .. })
    ));
}

#[tokio::test]
async fn cluster_urls_are_checked_at_setup() {
    for bad in ["redis-cluster://", "redis-cluster://a:1,,b:2"] {
        let refused = RedisStore::connect_lazy(RedisStoreConfig::new(bad)).unwrap_err();
        assert!(chain(&refused).contains("host:port"), "{}", chain(&refused));
    }
    // Any node is enough to find the others; a wrong one fails clearly, without the password.
    let mut config = RedisStoreConfig::new("redis-cluster://:s3cret@127.0.0.1:1");
    config.timeout = FAULT_TIMEOUT;
    config.connect_timeout = FAULT_TIMEOUT;
    let started = Instant::now();
    let refused = RedisStore::connect(config).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5));
    let message = chain(&refused);
    assert!(!message.contains("s3cret"), "{message}");
    assert!(message.contains("127.0.0.1:1"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_replicas_waits_on_the_primary_that_took_the_claim() {
    // Replicas acknowledge writes only once their first sync is over.
    let cluster = tokio::task::block_in_place(|| {
        let cluster = RedisCluster::start();
        for primary in cluster.primaries() {
            cluster.wait_replicated(primary, Duration::from_secs(10));
        }
        cluster
    });
    let mut config = config(&cluster, "idemgate-wait-test:");
    config.timeout = FAULT_TIMEOUT;
    config.wait_replicas = 1;
    let store = connect(config).await;
    let frozen_primary = cluster.primaries()[0];
    let (on_frozen, elsewhere) = names_by_primary(&cluster, &store, frozen_primary, 2).await;
    for name in [&on_frozen[0], &elsewhere[0]] {
        let answer = claim(&store, name).await;
        assert!(matches!(answer, Ok(Claim::Acquired(_))), "{answer:?}");
    }

    // With one primary's replica frozen (well under the node timeout, so nothing fails
    // over), a claim on that primary fails and a claim on another is answered: WAIT went to
    // the node that wrote each, not to any or every primary.
    let replica = cluster.replicas_of(frozen_primary)[0];
    cluster.pause_node(replica);
    let refused = claim(&store, &on_frozen[1]).await;
    let served = claim(&store, &elsewhere[1]).await;
    cluster.resume_node(replica);
    assert!(
        matches!(refused, Err(StoreError::Unavailable { .. })),
        "{refused:?}"
    );
    assert!(matches!(served, Ok(Claim::Acquired(_))), "{served:?}");
}
