//! Messages per second through `idemgate consume` (memory store) against a bare
//! `XREADGROUP` + `POST` + `XACK` loop written here, on one Redis and one handler, in one run.
//! Ignored by `cargo test`; `scripts/bench-consume.sh` runs it in release.
//!
//! Settings (environment): `CONSUME_BENCH_MESSAGES` (default 20000), `CONSUME_BENCH_ROUNDS`
//! (default 3; each round measures both, one after the other), `CONSUME_BENCH_IN_FLIGHT`
//! (default 64, for both).

#[path = "support/consume.rs"]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::{Consumer, Handler, Reply, TempDir, redis, wait_settled};
use test_servers::RedisServer;
use tokio::sync::Semaphore;

const STREAM: &str = "bench";

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Writes `n` events, pipelined in batches.
async fn produce(conn: &mut redis::aio::MultiplexedConnection, n: usize) {
    for start in (0..n).step_by(1000) {
        let mut pipe = redis::pipe();
        for i in start..n.min(start + 1000) {
            pipe.cmd("XADD")
                .arg(STREAM)
                .arg("*")
                .arg("event_id")
                .arg(format!("ev-{i}"))
                .arg("payload")
                .arg(format!("{{\"id\":\"ev-{i}\",\"amount\":42}}"))
                .ignore();
        }
        let () = pipe.query_async(conn).await.expect("XADD batch");
    }
}

/// Seconds `idemgate consume` takes to settle every entry for the group `group`.
async fn through_consumer(
    redis_server: &RedisServer,
    handler: &Handler,
    group: &str,
    in_flight: usize,
) -> f64 {
    let dir = TempDir::new();
    let config = dir.write(
        "bench.toml",
        "[[routes]]\nprefix = \"/handle\"\nname = \"handle\"\n",
    );
    let source = format!(
        "redis-stream://127.0.0.1:{}/{STREAM}?group={group}",
        redis_server.port()
    );
    let url = handler.url();
    let in_flight = in_flight.to_string();
    let started = Instant::now();
    let consumer = Consumer::start(&[
        "--config",
        &config,
        "--store",
        "memory",
        "--upstream",
        &url,
        "consume",
        "--source",
        &source,
        "--key-field",
        "event_id",
        "--max-in-flight",
        &in_flight,
    ]);
    let mut conn = redis(&redis_server.url()).await;
    assert!(
        wait_settled(&mut conn, STREAM, group, Duration::from_secs(600)).await,
        "{}",
        consumer.logs()
    );
    started.elapsed().as_secs_f64()
}

/// Seconds a bare loop takes: read a batch, POST each entry (at most `in_flight` at once),
/// acknowledge each once answered.
async fn through_bare_loop(
    redis_url: &str,
    handler: &Handler,
    group: &str,
    in_flight: usize,
) -> f64 {
    let mut reads = redis(redis_url).await;
    let acks = redis(redis_url).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let permits = Arc::new(Semaphore::new(in_flight));
    let url: http::Uri = handler.url().parse().unwrap();
    let started = Instant::now();
    let () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(STREAM)
        .arg(group)
        .arg("0")
        .query_async(&mut reads)
        .await
        .expect("XGROUP CREATE");
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let free = permits.available_permits().max(1);
        let reply: redis::streams::StreamReadReply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(group)
            .arg("bare")
            .arg("COUNT")
            .arg(free)
            .arg("BLOCK")
            .arg(100)
            .arg("STREAMS")
            .arg(STREAM)
            .arg(">")
            .query_async(&mut reads)
            .await
            .unwrap_or(redis::streams::StreamReadReply { keys: Vec::new() });
        let ids: Vec<_> = reply.keys.into_iter().flat_map(|k| k.ids).collect();
        if ids.is_empty() {
            break;
        }
        for entry in ids {
            let permit = Arc::clone(&permits).acquire_owned().await.unwrap();
            let key: String = entry.get("event_id").unwrap();
            let payload: String = entry.get("payload").unwrap();
            let request = Request::post(url.clone())
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(payload)))
                .unwrap();
            let client = client.clone();
            let mut acks = acks.clone();
            let group = group.to_owned();
            tasks.spawn(async move {
                let response = client.request(request).await.expect("POST");
                let _ = response.into_body().collect().await;
                let _: i64 = redis::cmd("XACK")
                    .arg(STREAM)
                    .arg(&group)
                    .arg(&entry.id)
                    .query_async(&mut acks)
                    .await
                    .expect("XACK");
                drop(permit);
            });
        }
    }
    while tasks.join_next().await.is_some() {}
    started.elapsed().as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark: scripts/bench-consume.sh runs it in release"]
async fn consumer_throughput_against_a_bare_loop() {
    let messages = setting("CONSUME_BENCH_MESSAGES", 20_000);
    let rounds = setting("CONSUME_BENCH_ROUNDS", 3);
    let in_flight = setting("CONSUME_BENCH_IN_FLIGHT", 64);
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    produce(&mut conn, messages).await;
    let handler = Handler::start(|_, _| Reply::ok()).await;
    let (mut consumer, mut bare, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        // Each run reads the whole stream through a group of its own.
        let c = messages as f64
            / through_consumer(&server, &handler, &format!("c{round}"), in_flight).await;
        let b = messages as f64
            / through_bare_loop(&server.url(), &handler, &format!("b{round}"), in_flight).await;
        eprintln!(
            "round {round}: consumer {c:.0} msg/s, bare loop {b:.0} msg/s, ratio {:.2}",
            c / b
        );
        consumer.push(c);
        bare.push(b);
        ratios.push(c / b);
    }
    let (c, b, r) = (median(consumer), median(bare), median(ratios));
    eprintln!(
        "consume bench: {messages} messages, {in_flight} in flight, {rounds} rounds: \
         idemgate consume (memory store) {c:.0} msg/s, bare XREADGROUP+POST+XACK loop {b:.0} msg/s, \
         median ratio {r:.2}x (target >= 0.8x)"
    );
    // Every run must have delivered every message to the handler.
    assert_eq!(handler.total_runs(), (messages * rounds * 2) as u64);
}
