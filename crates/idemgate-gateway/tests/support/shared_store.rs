//! What every store shared by several gateways (Redis, PostgreSQL) must do under the real
//! `idemgate` binary: one execution per key across gateways, and failing closed while the
//! store's server is down, then serving again without a restart. Each test file that checks a
//! shared store runs these against its own server.
//!
//! Included beside `support/proxy.rs` (as `mod support`), whose helpers it uses.

#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::support::{Gateway, Resp, TempDir, TestUpstream, admin_get, eventually, key, send};

pub(crate) const STORE_UNAVAILABLE: &str = "urn:idemgate:problem:store-unavailable";
pub(crate) const IN_FLIGHT: &str = "urn:idemgate:problem:request-in-flight";
pub(crate) const OUTCOME_UNKNOWN: &str = "urn:idemgate:problem:outcome-unknown";

/// `Retry-After` as whole seconds; panics if it is missing or not a number.
pub(crate) fn retry_after(r: &Resp) -> u64 {
    r.headers
        .get("retry-after")
        .unwrap_or_else(|| panic!("no Retry-After on {} {}", r.status, r.text()))
        .to_str()
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("Retry-After is not delay-seconds: {:?}", r.headers))
}

/// Asserts `r` is the fail-closed answer: `503`, `Retry-After`, problem `store-unavailable`.
pub(crate) fn assert_store_unavailable(r: &Resp) {
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(r.problem_type(), STORE_UNAVAILABLE);
    assert!(retry_after(r) >= 1, "{:?}", r.headers);
}

/// Asserts what a gateway whose store's server is down at start does: it serves anyway, a
/// keyed request gets the fail-closed `503` and is not forwarded, `/readyz` is not ready,
/// and the unreachable store is logged after the listening line (which it did not delay).
/// Returns the `/readyz` answer.
pub(crate) async fn assert_serving_while_the_store_is_down(
    gw: &Gateway,
    upstream: &TestUpstream,
) -> Resp {
    let refused = send("POST", &gw.url("/down"), &[key("k-down")], "x").await;
    assert_store_unavailable(&refused);
    assert_eq!(upstream.hits("/down"), 0);
    let not_ready = admin_get(gw, "/readyz", &[]).await;
    assert_eq!(not_ready.status, 503, "{}", not_ready.text());
    let logs = gw
        .logs_with("store not reachable yet")
        .await
        .unwrap_or_else(|| panic!("the unreachable store is reported:\n{}", gw.logs()));
    let listening = logs
        .find("idemgate listening on")
        .expect("the listening line");
    let reported = logs.find("store not reachable yet").unwrap();
    assert!(listening < reported, "listening line first:\n{logs}");
    not_ready
}

/// A store's server that a test stops and starts again on the same port and data.
pub(crate) trait StoreServer {
    /// Stops the server (its clients see it gone) and waits for it to exit.
    fn stop(&mut self);
    /// Starts it again after [`stop`](Self::stop), on the same port and data.
    fn restart(&mut self);
}

impl StoreServer for test_servers::RedisServer {
    fn stop(&mut self) {
        test_servers::RedisServer::stop(self);
    }

    fn restart(&mut self) {
        test_servers::RedisServer::restart(self);
    }
}

impl StoreServer for test_servers::PostgresServer {
    fn stop(&mut self) {
        test_servers::PostgresServer::stop(self);
    }

    fn restart(&mut self) {
        test_servers::PostgresServer::restart(self);
    }
}

/// Two gateways on the store `store` (with the config file `config`), 50 requests with one
/// key sent at once through both: exactly one reaches the upstream, every other is answered
/// from the shared record, and afterwards both gateways replay the same bytes.
pub(crate) async fn two_gateways_execute_fifty_concurrent_requests_once(store: &str, config: &str) {
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let gateways = [
        Gateway::start_configured(&dir, &upstream, store, config, &[]),
        Gateway::start_configured(&dir, &upstream, store, config, &[]),
    ];
    // Ready first: a gateway's first contact with a fresh Redis Cluster writes a data marker
    // in every slot, which takes longer than one request may wait.
    for gw in &gateways {
        eventually(100, || async {
            (admin_get(gw, "/readyz", &[]).await.status == 200).then_some(())
        })
        .await
        .expect("the gateway gets ready");
    }
    let urls = gateways.each_ref().map(|gw| gw.url("/race"));

    // All 50 start together; the upstream takes 300 ms, so they overlap on both gateways.
    let start = Arc::new(tokio::sync::Barrier::new(50));
    let mut tasks = Vec::new();
    for i in 0..50 {
        let url = urls[i % 2].clone();
        let start = Arc::clone(&start);
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            let r = send(
                "POST",
                &url,
                &[key("k-shared"), ("x-delay-ms", "300")],
                r#"{"amount":100}"#,
            )
            .await;
            (i % 2, r)
        }));
    }
    let mut executed = Vec::new();
    let mut replayed = Vec::new();
    // Per gateway: requests answered from the shared record (409 or an early replay).
    let mut from_record = [0; 2];
    for task in tasks {
        let (via, r) = task.await.expect("request task");
        match r.status {
            201 if r.replayed() => {
                from_record[via] += 1;
                replayed.push(r);
            }
            201 => executed.push((via, r)),
            409 => {
                assert_eq!(r.problem_type(), IN_FLIGHT);
                assert!(retry_after(&r) >= 1);
                from_record[via] += 1;
            }
            other => panic!("unexpected {other} through gateway {via}: {}", r.text()),
        }
    }
    assert_eq!(
        executed.len(),
        1,
        "exactly one request executes; answered from the record per gateway: {from_record:?}"
    );
    assert_eq!(
        upstream.hits("/race"),
        1,
        "exactly one request reached the upstream"
    );
    let (winner, first) = executed.pop().expect("one execution");
    // The gateway that did not execute answered all of its 25 requests from the claim the
    // other one made in the shared store.
    assert_eq!(from_record[1 - winner], 25);
    assert_eq!(from_record[winner], 24);
    for r in &replayed {
        assert_eq!(r.body, first.body, "an early replay is byte for byte");
    }

    // Afterwards each gateway replays the same bytes.
    for (i, gw) in gateways.iter().enumerate() {
        let again = send(
            "POST",
            &gw.url("/race"),
            &[key("k-shared")],
            r#"{"amount":100}"#,
        )
        .await;
        assert_eq!(again.status, first.status, "gateway {i}: {}", again.text());
        assert!(again.replayed(), "gateway {i}: {:?}", again.headers);
        assert_eq!(again.body, first.body, "gateway {i} replays byte for byte");
        assert_eq!(again.headers["x-upstream-n"], "1", "gateway {i}");
        assert_eq!(
            again.headers.get("content-type"),
            first.headers.get("content-type"),
            "gateway {i}"
        );
    }
    assert_eq!(
        upstream.hits("/race"),
        1,
        "replays never reach the upstream"
    );
}

/// One request of the traffic loop: its index (key `k-{i}`, path `/traffic/{i}`), when it
/// started and ended, and what came back.
struct Sent {
    i: usize,
    started: Instant,
    ended: Instant,
    resp: Resp,
}

/// A gateway on `store` (served by `server`) under a steady stream of fresh keys while the
/// server is stopped for over a second and started again: requests are refused (`503`,
/// `Retry-After`, never forwarded) and `/readyz` fails while it is down, and the same
/// gateway serves again once it is back. Every key ran at most once, and the upstream saw
/// exactly the requests answered `201`.
pub(crate) async fn a_store_stopped_under_traffic_fails_closed_and_recovers(
    server: &mut impl StoreServer,
    store: &str,
) {
    /// The traffic loop's bound: at 20 ms apart this is far longer than the test needs.
    const MAX_REQUESTS: usize = 3000;

    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let mut gw =
        Gateway::start_configured(&dir, &upstream, store, "store_timeout = \"500ms\"\n", &[]);
    let url = gw.url("");

    let log: Arc<std::sync::Mutex<Vec<Sent>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = tokio::spawn({
        let log = Arc::clone(&log);
        let stop = Arc::clone(&stop);
        async move {
            for i in 0..MAX_REQUESTS {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                let started = Instant::now();
                let resp = send(
                    "POST",
                    &format!("{url}/traffic/{i}"),
                    &[key(&format!("k-{i}"))],
                    "payload",
                )
                .await;
                let ended = Instant::now();
                log.lock().unwrap().push(Sent {
                    i,
                    started,
                    ended,
                    resp,
                });
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    let count = |since: Instant, status: u16| {
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.started >= since && s.resp.status == status)
            .count()
    };

    let began = Instant::now();
    eventually(600, || async { (count(began, 201) >= 10).then_some(()) })
        .await
        .expect("traffic flows while the store is up");

    server.stop();
    let stopped = Instant::now();
    // Down for a while (at least a second, ten refusals), so the gateway's reconnects fail
    // more than once before the server comes back.
    eventually(600, || async {
        (count(stopped, 503) >= 10 && stopped.elapsed() >= Duration::from_secs(1)).then_some(())
    })
    .await
    .expect("requests are refused while the store is down");
    let not_ready = eventually(200, || async {
        let r = admin_get(&gw, "/readyz", &[]).await;
        (r.status == 503).then_some(r)
    })
    .await;
    assert!(not_ready.is_some(), "/readyz fails while the store is down");

    let restarting = Instant::now();
    server.restart();
    let restarted = Instant::now();
    eventually(600, || async {
        (count(restarted, 201) >= 10).then_some(())
    })
    .await
    .expect("traffic flows again once the store is back, through the same gateway");
    stop.store(true, Ordering::SeqCst);
    traffic.await.expect("traffic task");
    assert!(gw.running(), "the gateway was never restarted");
    assert_eq!(admin_get(&gw, "/readyz", &[]).await.status, 200);

    let log = log.lock().unwrap();
    let mut refused = 0;
    for sent in log.iter() {
        let path = format!("/traffic/{}", sent.i);
        let hits = upstream.hits(&path);
        assert!(hits <= 1, "key k-{} ran {hits} times", sent.i);
        match sent.resp.status {
            201 => {
                assert!(!sent.resp.replayed(), "k-{} is a fresh key", sent.i);
                assert_eq!(hits, 1, "k-{}: a 201 came from the upstream", sent.i);
            }
            503 => {
                assert_store_unavailable(&sent.resp);
                assert_eq!(hits, 0, "k-{}: refused, so never forwarded", sent.i);
                refused += 1;
            }
            other => panic!("k-{}: unexpected {other}: {}", sent.i, sent.resp.text()),
        }
        // Sent and answered wholly while the store was down: refused.
        if sent.started >= stopped && sent.ended <= restarting {
            assert_eq!(
                sent.resp.status, 503,
                "k-{} while the store was down",
                sent.i
            );
        }
    }
    assert!(refused >= 10);
    assert!(
        log.len() < MAX_REQUESTS,
        "the loop was stopped, not exhausted"
    );
    let forwarded: u64 = log.iter().filter(|s| s.resp.status == 201).map(|_| 1).sum();
    assert_eq!(
        upstream.total_hits(),
        forwarded,
        "the upstream saw exactly the requests answered 201"
    );
}
