//! The admin listener over a real `redis-server`: a Redis that restarted empty is reported on
//! `/metrics` and refuses claims until an operator acknowledges the loss.

#![cfg(feature = "redis")]

use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use http_body_util::BodyExt;
use idemgate::RoutePolicy;
use idemgate::record::{FingerprintHash, OwnerToken, RecordKey};
use idemgate::store::{
    Claim, ClaimOptions, RedisStore, RedisStoreConfig, Store, StoreError, UnknownOutcome,
};
use idemgate_gateway::admin::{AdminState, handle};
use idemgate_gateway::metrics::{InstrumentedStore, Metrics};
use test_servers::RedisServer;

/// Short, so a call to a server that lost its data answers quickly.
const FAULT_TIMEOUT: Duration = Duration::from_millis(500);

async fn connect(server: &RedisServer) -> RedisStore {
    let mut config = RedisStoreConfig::new(server.url());
    config.key_prefix = "idemgate-test:".to_owned();
    config.timeout = FAULT_TIMEOUT;
    config.connect_timeout = FAULT_TIMEOUT;
    RedisStore::connect(config)
        .await
        .expect("connect to the test redis-server")
}

async fn claim(store: &RedisStore, name: &str) -> Result<Claim, StoreError> {
    let options = ClaimOptions {
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(3600),
        on_lapse: UnknownOutcome::Ambiguous,
    };
    let key = RecordKey::of(name.as_bytes());
    let fingerprint = FingerprintHash::of(name.as_bytes());
    store
        .claim(&key, &fingerprint, OwnerToken::generate(), &options)
        .await
}

async fn until_ping_succeeds(store: &RedisStore) {
    for _ in 0..100 {
        if store.ping().await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the store did not come back within 10 s of the server");
}

#[tokio::test]
async fn data_loss_is_acknowledged_through_the_admin_listener() {
    let mut server = RedisServer::start();
    let redis = connect(&server).await;
    let metrics = Metrics::new();
    let store: Arc<dyn Store> = Arc::new(InstrumentedStore::new(
        Arc::new(redis.clone()),
        Arc::clone(&metrics),
    ));
    let state = Arc::new(AdminState {
        store: Arc::clone(&store),
        store_timeout: FAULT_TIMEOUT,
        metrics,
        stats: Arc::new(idemgate::LayerStats::default()),
        token: Some("admin-token-0123456789".to_owned()),
        routes: vec![RoutePolicy::default()],
        draining: Arc::new(std::sync::atomic::AtomicBool::new(false)),
    });
    let admin = |method: &str, uri: &str| {
        let state = Arc::clone(&state);
        let request = http::Request::builder()
            .method(method)
            .uri(uri)
            .header("authorization", "Bearer admin-token-0123456789")
            .body(())
            .unwrap();
        async move {
            let Ok(response) = handle(state, request).await;
            let status = response.status();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            (status, String::from_utf8(body.to_vec()).unwrap())
        }
    };

    server.restart();
    until_ping_succeeds(&redis).await;
    assert!(claim(&redis, "x").await.is_err());
    let (_, text) = admin("GET", "/metrics").await;
    assert!(
        text.contains("idemgate_store_data_lost{backend=\"redis\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("idemgate_store_data_losses_total{backend=\"redis\"} 1\n"),
        "{text}"
    );

    let (status, body) = admin("POST", "/admin/store/acknowledge-data-loss").await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert!(body.contains("\"acknowledged\": true"), "{body}");
    let (_, text) = admin("GET", "/metrics").await;
    assert!(
        text.contains("idemgate_store_data_lost{backend=\"redis\"} 0\n"),
        "{text}"
    );
    assert!(matches!(claim(&redis, "x").await, Ok(Claim::Acquired(_))));
}
