//! `idemgate consume` end to end: the real binary reading a real Redis stream and delivering
//! to a handler on 127.0.0.1 that counts how many times each event ran.

#[path = "support/promtool.rs"]
mod promtool;
#[path = "support/consume.rs"]
mod support;

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use support::{
    Consumer, Handler, Reply, TempDir, backlog, entries, idemgate, metric, pending_on, produce,
    produce_event, redis, wait_settled,
};
use test_servers::RedisServer;

const STREAM: &str = "events";
const GROUP: &str = "billing";

/// The config every test starts from: short store bounds and a `/handle` route with a 1 s
/// lease, so takeovers happen within a test's time.
fn config(dir: &TempDir, extra: &str) -> String {
    dir.write(
        "consume.toml",
        &format!(
            "store_timeout = \"500ms\"\nupstream_timeout = \"2s\"\nshutdown_grace = \"10s\"\n{extra}\n\
             [[routes]]\nprefix = \"/handle\"\nname = \"handle\"\nlease = \"1s\"\n"
        ),
    )
}

fn source(redis: &RedisServer, query: &str) -> String {
    format!(
        "redis-stream://127.0.0.1:{}/{STREAM}?group={GROUP}{query}",
        redis.port()
    )
}

/// Starts a consumer of `STREAM` delivering to `handler` with the store `store`, then `extra`
/// arguments (after `consume`).
fn consumer(
    config: &str,
    redis: &RedisServer,
    query: &str,
    store: &str,
    handler: &Handler,
    extra: &[&str],
) -> Consumer {
    let source = source(redis, query);
    let url = handler.url();
    let mut args = vec![
        "--config",
        config,
        "--store",
        store,
        "--upstream",
        &url,
        "consume",
        "--source",
        &source,
        "--key-field",
        "event_id",
        "--retry-backoff",
        "50ms",
    ];
    args.extend_from_slice(extra);
    Consumer::start(&args)
}

/// The dead letters of `STREAM`.
async fn dead_letters(
    conn: &mut redis::aio::MultiplexedConnection,
) -> Vec<HashMap<String, String>> {
    entries(conn, &format!("{STREAM}.dead")).await
}

/// Asserts that every entry of the test stream settles within 20 s, showing `consumer`'s logs
/// if not.
async fn settles(conn: &mut redis::aio::MultiplexedConnection, consumer: &Consumer) {
    assert!(
        wait_settled(conn, STREAM, GROUP, Duration::from_secs(20)).await,
        "{}",
        consumer.logs()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producer_duplicates_run_the_handler_once_per_event() {
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    let handler = Handler::start(|_, _| Reply::ok()).await;
    // 1,000 events, and 5 % of them written again by the producer: a new entry, same id.
    let ids: Vec<String> = (0..1000).map(|i| format!("evt-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        produce_event(&mut conn, STREAM, id).await;
        if i % 20 == 7 {
            produce_event(&mut conn, STREAM, id).await;
        }
    }
    let dir = TempDir::new();
    let config = config(&dir, "");
    let consumer = consumer(&config, &server, "", "memory", &handler, &[]);
    assert!(
        wait_settled(&mut conn, STREAM, GROUP, Duration::from_secs(60)).await,
        "not every entry was acknowledged: {:?}\n{}",
        backlog(&mut conn, STREAM, GROUP).await,
        consumer.logs()
    );
    let runs = handler.runs();
    assert_eq!(runs.len(), 1000, "every event ran");
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "events not run exactly once: {twice:?}");
    assert!(dead_letters(&mut conn).await.is_empty());

    // The counters move just after each acknowledgement: wait for the last to be counted.
    let settled = format!(
        "{{source=\"redis-stream://127.0.0.1:{}/{STREAM}?group={GROUP}\"}}",
        server.port()
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        let text = consumer.metrics().await;
        let counted = ["delivered", "replayed"]
            .iter()
            .filter_map(|c| metric(&text, &format!("idemgate_consumer_{c}_total{settled}")))
            .sum::<f64>();
        if counted >= 1050.0 || Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let series = |name: &str| {
        let labels = format!(
            "{name}{{source=\"redis-stream://127.0.0.1:{}/{STREAM}?group={GROUP}\"}}",
            server.port()
        );
        metric(&text, &labels).unwrap_or_else(|| panic!("no {labels} in\n{text}"))
    };
    assert_eq!(series("idemgate_consumer_delivered_total"), 1000.0);
    assert_eq!(series("idemgate_consumer_replayed_total"), 50.0);
    // Each try is counted by the layer's decision, as a proxied request is.
    let requests = |outcome: &str| {
        let labels = format!("idemgate_requests_total{{route=\"handle\",outcome=\"{outcome}\"}}");
        metric(&text, &labels).unwrap_or_else(|| panic!("no {labels} in\n{text}"))
    };
    assert_eq!(requests("executed"), 1000.0);
    assert_eq!(requests("replayed"), 50.0);
    // A duplicate read beside its event waited for it in the consumer rather than meet it
    // in flight in the store.
    assert_eq!(requests("in_flight"), 0.0);
    promtool::accepts(&text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_and_the_same_event_off_the_queue_run_once_between_them() {
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    let handler = Handler::start(|_, _| Reply::ok()).await;
    let dir = TempDir::new();
    let config = config(&dir, "");
    let store = server.url();
    let root = format!("http://{}", handler.addr);
    // The proxy in front of the handler and the consumer share the store and the route.
    let proxy =
        Consumer::start_proxy(&["--config", &config, "--store", &store, "--upstream", &root]);
    let consumer = consumer(&config, &server, "", &store, &handler, &[]);
    let body = |id: &str| format!("{{\"id\":\"{id}\",\"amount\":42}}");
    // By webhook first, then off the queue.
    assert_eq!(proxy.post("/handle", "w1", &body("w1")).await, (200, false));
    produce_event(&mut conn, STREAM, "w1").await;
    // Off the queue first, then by webhook: answered from the consumer's record.
    produce_event(&mut conn, STREAM, "q1").await;
    settles(&mut conn, &consumer).await;
    assert_eq!(proxy.post("/handle", "q1", &body("q1")).await, (200, true));
    assert_eq!(
        handler.runs_of("w1"),
        1,
        "the webhook ran it; the queue's copy replayed"
    );
    assert_eq!(
        handler.runs_of("q1"),
        1,
        "the queue ran it; the webhook replayed"
    );
    assert!(dead_letters(&mut conn).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_fails_then_succeeds_is_retried_and_settled() {
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    // 500 to the first run of each event, 200 after.
    let handler = Handler::start(|_, n| {
        if n == 1 {
            Reply::status(500)
        } else {
            Reply::ok()
        }
    })
    .await;
    for i in 0..5 {
        produce_event(&mut conn, STREAM, &format!("e{i}")).await;
    }
    let dir = TempDir::new();
    let config = config(&dir, "");
    let consumer = consumer(&config, &server, "", "memory", &handler, &[]);
    settles(&mut conn, &consumer).await;
    for i in 0..5 {
        assert_eq!(
            handler.runs_of(&format!("e{i}")),
            2,
            "e{i}: one refusal, one success"
        );
    }
    assert!(dead_letters(&mut conn).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_always_fails_gets_the_message_dead_lettered_after_max_attempts() {
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    let handler = Handler::start(|_, _| Reply::status(500)).await;
    produce_event(&mut conn, STREAM, "doomed").await;
    let dir = TempDir::new();
    let config = config(&dir, "");
    let consumer = consumer(
        &config,
        &server,
        "",
        "memory",
        &handler,
        &["--max-attempts", "3"],
    );
    settles(&mut conn, &consumer).await;
    assert_eq!(handler.runs_of("doomed"), 3, "tried max_attempts times");
    let dead = dead_letters(&mut conn).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    let letter = &dead[0];
    assert_eq!(letter["reason"], "rejected");
    assert_eq!(letter["status"], "500");
    assert_eq!(letter["attempts"], "3");
    assert_eq!(letter["ambiguous"], "false");
    assert_eq!(letter["key"], "doomed");
    assert!(
        letter["fields"].contains("\"event_id\":\"doomed\""),
        "{letter:?}"
    );
    let source = format!(
        "source=\"redis-stream://127.0.0.1:{}/{STREAM}?group={GROUP}\"",
        server.port()
    );
    let dead = format!("idemgate_consumer_dead_lettered_total{{{source},reason=\"rejected\"}}");
    let retries = format!("idemgate_consumer_retries_total{{{source}}}");
    let text = support::metrics_once(&consumer, &dead, 1.0).await;
    assert_eq!(metric(&text, &dead), Some(1.0), "{text}");
    assert_eq!(metric(&text, &retries), Some(2.0), "{text}");
    promtool::accepts(&text);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_hangs_past_the_upstream_timeout_is_ambiguous_and_never_run_again() {
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    let handler = Handler::start(|key, _| {
        if key == "slow" {
            Reply::ok().after(Duration::from_secs(3))
        } else {
            Reply::ok()
        }
    })
    .await;
    produce_event(&mut conn, STREAM, "slow").await;
    produce_event(&mut conn, STREAM, "fast").await;
    let dir = TempDir::new();
    let config = config(&dir, "");
    let consumer = consumer(
        &config,
        &server,
        "",
        "memory",
        &handler,
        // Plenty of tries: an ambiguous outcome must not use any of them.
        &["--max-attempts", "10"],
    );
    settles(&mut conn, &consumer).await;
    // The producer sends it again: the record is ambiguous, so it is not run again either.
    produce_event(&mut conn, STREAM, "slow").await;
    settles(&mut conn, &consumer).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        handler.runs_of("slow"),
        1,
        "an ambiguous message is never run again"
    );
    assert_eq!(handler.runs_of("fast"), 1);
    let dead = dead_letters(&mut conn).await;
    assert_eq!(dead.len(), 2, "both entries of the slow event: {dead:?}");
    for letter in &dead {
        assert_eq!(letter["reason"], "ambiguous");
        assert_eq!(letter["ambiguous"], "true");
        assert_eq!(letter["key"], "slow");
        assert_eq!(letter["attempts"], "1", "never retried: {letter:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_its_key_field_is_dead_lettered_with_the_reason() {
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    let handler = Handler::start(|_, _| Reply::ok()).await;
    produce(&mut conn, STREAM, &[("payload", "{\"amount\":1}")]).await;
    produce_event(&mut conn, STREAM, "keyed").await;
    let dir = TempDir::new();
    let config = config(&dir, "");
    let consumer = consumer(&config, &server, "", "memory", &handler, &[]);
    settles(&mut conn, &consumer).await;
    assert_eq!(handler.runs(), HashMap::from([("keyed".to_owned(), 1)]));
    let dead = dead_letters(&mut conn).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0]["reason"], "missing_key");
    assert!(
        dead[0]["detail"].contains("no field \"event_id\""),
        "{:?}",
        dead[0]
    );
    assert_eq!(dead[0]["fields"], "{\"payload\":\"{\\\"amount\\\":1}\"}");
}

/// Events with `ids` that are neither run exactly once nor dead-lettered as ambiguous (run at
/// most once); and how many were dead-lettered as ambiguous.
fn not_exactly_once(
    handler: &Handler,
    ids: &[String],
    dead: &[HashMap<String, String>],
) -> (Vec<(String, u64)>, usize) {
    let ambiguous: HashSet<&str> = dead
        .iter()
        .filter(|l| l["ambiguous"] == "true")
        .map(|l| l["key"].as_str())
        .collect();
    let runs = handler.runs();
    let wrong = ids
        .iter()
        .map(|id| (id.clone(), runs.get(id).copied().unwrap_or(0)))
        .filter(|(id, n)| {
            if ambiguous.contains(id.as_str()) {
                *n > 1
            } else {
                *n != 1
            }
        })
        .collect();
    (wrong, ambiguous.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumers_killed_at_random_points_run_every_event_once() {
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    let handler = Handler::start(|_, _| Reply::ok().after(Duration::from_millis(2))).await;
    let dir = TempDir::new();
    let config = config(&dir, "");
    let store = server.url();
    let ids: Vec<String> = (0..600).map(|i| format!("k{i}")).collect();
    // The producer writes throughout, duplicating one event in twenty.
    let producer = {
        let ids = ids.clone();
        let mut conn = redis(&server.url()).await;
        tokio::spawn(async move {
            for (i, id) in ids.iter().enumerate() {
                produce_event(&mut conn, STREAM, id).await;
                if i % 20 == 3 {
                    produce_event(&mut conn, STREAM, id).await;
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        })
    };
    // Kill -9 at pseudo-random points (a fixed sequence, so a failure can be run again).
    let mut kills = 0;
    for pause_ms in [350u64, 120, 610, 230, 480, 90, 300] {
        let mut c = consumer(
            &config,
            &server,
            "",
            &store,
            &handler,
            &["--max-in-flight", "16"],
        );
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        c.kill9();
        kills += 1;
    }
    producer.await.unwrap();
    let last = consumer(
        &config,
        &server,
        "",
        &store,
        &handler,
        &["--max-in-flight", "16"],
    );
    assert!(
        wait_settled(&mut conn, STREAM, GROUP, Duration::from_secs(60)).await,
        "entries left pending: {:?}\n{}",
        backlog(&mut conn, STREAM, GROUP).await,
        last.logs()
    );
    let dead = dead_letters(&mut conn).await;
    let (wrong, ambiguous) = not_exactly_once(&handler, &ids, &dead);
    assert!(wrong.is_empty(), "events run other than once: {wrong:?}");
    assert!(
        dead.iter().all(|l| l["ambiguous"] == "true"),
        "only ambiguous dead letters expected: {dead:?}"
    );
    let once = ids.len() - ambiguous;
    eprintln!(
        "kill loop: {kills} kills, {} events, {once} run exactly once and acknowledged, \
         {ambiguous} dead-lettered as ambiguous (run at most once), 0 run twice, 0 pending",
        ids.len()
    );
    // Kills land while messages are in flight, so the loop must have produced some, and most
    // events must still have settled plainly.
    assert!(once > ids.len() * 9 / 10, "{once} of {}", ids.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_consumers_pending_entries_are_taken_over_after_the_lease() {
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    let handler = Handler::start(|_, _| Reply::ok().after(Duration::from_millis(400))).await;
    let dir = TempDir::new();
    let config = config(&dir, "");
    let store = server.url();
    for i in 0..40 {
        produce_event(&mut conn, STREAM, &format!("t{i}")).await;
    }
    let mut a = consumer(
        &config,
        &server,
        "&consumer=a",
        &store,
        &handler,
        &["--max-in-flight", "4"],
    );
    let b = consumer(
        &config,
        &server,
        "&consumer=b",
        &store,
        &handler,
        &["--max-in-flight", "4"],
    );
    // Wait until `a` holds entries, then kill it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while pending_on(&mut conn, STREAM, GROUP, "a").await == 0 {
        assert!(
            Instant::now() < deadline,
            "a never read anything:\n{}",
            a.logs()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    a.kill9();
    let killed = Instant::now();
    let held = pending_on(&mut conn, STREAM, GROUP, "a").await;
    assert!(held > 0);
    // Not before the lease (1 s, the claim idle time) has passed.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        pending_on(&mut conn, STREAM, GROUP, "a").await,
        held,
        "taken over too early"
    );
    assert!(
        wait_settled(&mut conn, STREAM, GROUP, Duration::from_secs(30)).await,
        "{}",
        b.logs()
    );
    assert!(killed.elapsed() >= Duration::from_secs(1));
    assert_eq!(pending_on(&mut conn, STREAM, GROUP, "a").await, 0);
    let ids: Vec<String> = (0..40).map(|i| format!("t{i}")).collect();
    let dead = dead_letters(&mut conn).await;
    let (wrong, ambiguous) = not_exactly_once(&handler, &ids, &dead);
    assert!(wrong.is_empty(), "events run other than once: {wrong:?}");
    assert!(
        ambiguous as u64 <= held,
        "only what `a` held can be ambiguous"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_restarted_under_its_name_takes_its_pending_entries_back_at_once() {
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    let handler = Handler::start(|_, _| Reply::ok().after(Duration::from_millis(300))).await;
    let dir = TempDir::new();
    let config = config(&dir, "");
    let store = server.url();
    let ids: Vec<String> = (0..6).map(|i| format!("n{i}")).collect();
    for id in &ids {
        produce_event(&mut conn, STREAM, id).await;
    }
    // No other consumer would take its entries over within the test.
    let args = ["--max-in-flight", "2", "--claim-idle", "60s"];
    let mut first = consumer(&config, &server, "&consumer=c", &store, &handler, &args);
    let deadline = Instant::now() + Duration::from_secs(10);
    while pending_on(&mut conn, STREAM, GROUP, "c").await == 0 {
        assert!(Instant::now() < deadline, "c never read:\n{}", first.logs());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    first.kill9();
    let again = consumer(&config, &server, "&consumer=c", &store, &handler, &args);
    assert!(
        wait_settled(&mut conn, STREAM, GROUP, Duration::from_secs(20)).await,
        "{:?}\n{}",
        backlog(&mut conn, STREAM, GROUP).await,
        again.logs()
    );
    let dead = dead_letters(&mut conn).await;
    let (wrong, ambiguous) = not_exactly_once(&handler, &ids, &dead);
    assert!(wrong.is_empty(), "events run other than once: {wrong:?}");
    assert!(
        ambiguous <= 2,
        "only the two in flight at the kill: {dead:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_waiting_for_its_next_try_is_not_taken_over_by_another_consumer() {
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    let handler = Handler::start(|_, _| Reply::status(500)).await;
    let dir = TempDir::new();
    let config = config(&dir, "");
    let store = server.url();
    // `a` makes ten tries, 50 ms apart and doubling up to 500 ms (half its claim idle
    // time), about 3.5 s of waits, and takes nothing over itself; `b` takes over entries
    // idle for 700 ms. Only `a` reads: `b` starts once `a` holds the entry.
    let a = consumer(
        &config,
        &server,
        "&consumer=a",
        &store,
        &handler,
        &["--max-attempts", "10", "--claim-idle", "1s"],
    );
    produce_event(&mut conn, STREAM, "refused").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while pending_on(&mut conn, STREAM, GROUP, "a").await == 0 {
        assert!(Instant::now() < deadline, "a never read it:\n{}", a.logs());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let b = consumer(
        &config,
        &server,
        "&consumer=b",
        &store,
        &handler,
        &["--max-attempts", "10", "--claim-idle", "700ms"],
    );
    assert!(
        wait_settled(&mut conn, STREAM, GROUP, Duration::from_secs(20)).await,
        "{}\n{}",
        a.logs(),
        b.logs()
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        handler.runs_of("refused"),
        10,
        "one consumer's tries, no more"
    );
    let dead = dead_letters(&mut conn).await;
    assert_eq!(dead.len(), 1, "one dead letter: {dead:?}");
    assert_eq!(dead[0]["attempts"], "10");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumption_resumes_after_redis_restarts_and_runs_nothing_twice() {
    // The stream and the group survive the restart (an append-only file synced on each
    // write); records are in the consumer's memory store, which outlives Redis here.
    let mut server = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let mut conn = redis(&server.url()).await;
    let handler = Handler::start(|_, _| Reply::ok().after(Duration::from_millis(1))).await;
    let dir = TempDir::new();
    let config = config(&dir, "");
    let consumer = consumer(&config, &server, "", "memory", &handler, &[]);
    let ids: Vec<String> = (0..300).map(|i| format!("r{i}")).collect();
    for id in &ids[..150] {
        produce_event(&mut conn, STREAM, id).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.restart();
    let mut conn = redis(&server.url()).await;
    for id in &ids[150..] {
        produce_event(&mut conn, STREAM, id).await;
    }
    assert!(
        wait_settled(&mut conn, STREAM, GROUP, Duration::from_secs(60)).await,
        "{:?}\n{}",
        backlog(&mut conn, STREAM, GROUP).await,
        consumer.logs()
    );
    let runs = handler.runs();
    let wrong: Vec<_> = ids
        .iter()
        .filter(|id| runs.get(*id).copied() != Some(1))
        .collect();
    assert!(wrong.is_empty(), "not run exactly once: {wrong:?}");
    assert!(dead_letters(&mut conn).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_the_messages_in_flight_acknowledges_them_and_exits_0() {
    let server = RedisServer::start();
    let mut conn = redis(&server.url()).await;
    let handler = Handler::start(|_, _| Reply::ok().after(Duration::from_millis(800))).await;
    let dir = TempDir::new();
    let config = config(&dir, "");
    for i in 0..4 {
        produce_event(&mut conn, STREAM, &format!("d{i}")).await;
    }
    let mut consumer = consumer(&config, &server, "", "memory", &handler, &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while handler.total_runs() < 4 {
        assert!(Instant::now() < deadline, "{}", consumer.logs());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    consumer.sigterm();
    let status = consumer
        .wait_exit(Duration::from_secs(10))
        .expect("the consumer exits after SIGTERM");
    assert!(status.success(), "{status:?}\n{}", consumer.logs());
    // Everything in flight finished and was acknowledged before the exit.
    assert_eq!(backlog(&mut conn, STREAM, GROUP).await, Some((0, 0)));
    assert_eq!(handler.total_runs(), 4);
}

/// A `rediss-stream://` source reads over TLS and checks Redis's certificate: trusted through
/// `SSL_CERT_FILE`, a producer's duplicate runs the handler once and both entries settle; not
/// trusted, nothing is read and the log names the certificate.
#[cfg(feature = "redis-tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rediss_stream_source_reads_over_tls_and_checks_the_certificate() {
    let server = RedisServer::start_tls();
    let ca = server.ca_file();
    let mut conn = support::redis_tls(&server.url(), &ca).await;
    let handler = Handler::start(|_, _| Reply::ok()).await;
    produce_event(&mut conn, STREAM, "evt-tls").await;
    produce_event(&mut conn, STREAM, "evt-tls").await;
    let dir = TempDir::new();
    let config = config(&dir, "");
    let source = format!(
        "rediss-stream://127.0.0.1:{}/{STREAM}?group={GROUP}",
        server.port()
    );
    let url = handler.url();
    let args = [
        "--config",
        config.as_str(),
        "--store",
        "memory",
        "--upstream",
        url.as_str(),
        "consume",
        "--source",
        source.as_str(),
        "--key-field",
        "event_id",
    ];

    // The system's roots do not include the test CA: the handshake fails, nothing is read.
    let untrusting = Consumer::start(&args);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !untrusting.logs().contains("certificate") && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        untrusting.logs().contains("certificate"),
        "the failure names the certificate:\n{}",
        untrusting.logs()
    );
    assert_eq!(handler.total_runs(), 0);
    drop(untrusting);

    let ca = ca.to_str().expect("a UTF-8 temp path");
    let trusting = Consumer::start_with_env(&args, &[("SSL_CERT_FILE", ca)]);
    settles(&mut conn, &trusting).await;
    assert_eq!(
        handler.runs().get("evt-tls"),
        Some(&1),
        "{:?}",
        handler.runs()
    );
    assert_eq!(handler.total_runs(), 1);
    assert!(dead_letters(&mut conn).await.is_empty());
}

#[test]
fn bad_consume_input_is_refused_with_a_clear_error() {
    for (args, says) in [
        (
            vec!["consume", "--upstream", "http://127.0.0.1:1/h"],
            "no source to consume",
        ),
        (
            vec![
                "consume",
                "--key-field",
                "id",
                "--upstream",
                "http://127.0.0.1:1/h",
            ],
            "required arguments were not provided:\n  --source <URL>",
        ),
        (
            vec![
                "consume",
                "--source",
                "redis-stream://127.0.0.1:6379/s",
                "--key-field",
                "id",
                "--upstream",
                "http://127.0.0.1:1/h",
            ],
            "--source: names no group",
        ),
        (
            vec![
                "consume",
                "--source",
                "redis-stream://127.0.0.1:6379/s?group=g",
                "--upstream",
                "http://127.0.0.1:1/h",
            ],
            "--key-field: required",
        ),
        (
            vec![
                "consume",
                "--source",
                "redis-stream://127.0.0.1:6379/s?group=g",
                "--key-field",
                "id",
            ],
            "upstream: required",
        ),
        (
            vec![
                "consume",
                "--source",
                "redis-stream://127.0.0.1:6379/s?group=g",
                "--key-field",
                "id",
                "--upstream",
                "http://127.0.0.1:1/h",
                "--max-in-flight",
                "0",
            ],
            "--max-in-flight: 0 is out of range",
        ),
    ] {
        let output = idemgate().args(&args).output().expect("run idemgate");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    // A source's flag beside a file's sources, without --source, is refused: it describes
    // the --source beside it, and the file's sources would not take it.
    let dir = TempDir::new();
    let with_source = dir.write(
        "with-source.toml",
        "store = \"memory\"\nupstream = \"http://127.0.0.1:1/h\"\n[[sources]]\n\
         url = \"redis-stream://127.0.0.1:6379/s?group=g\"\nkey_field = \"id\"\n",
    );
    let output = idemgate()
        .args(["--config", &with_source, "--check-config", "consume"])
        .args(["--max-in-flight", "3"])
        .output()
        .expect("run idemgate");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("required arguments were not provided:\n  --source <URL>"),
        "{stderr}"
    );
    // A route that would let messages through unprotected is refused at start.
    for (route, says) in [
        ("key_json_pointer = \"/id\"", "reads its keys from the body"),
        ("methods = [\"PUT\"]", "does not take POST requests"),
    ] {
        let config = dir.write(
            "route.toml",
            &format!("[[routes]]\nprefix = \"/handle\"\nname = \"handle\"\n{route}\n"),
        );
        let output = idemgate()
            .args([
                "--config",
                &config,
                "--store",
                "memory",
                "--admin-listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1/handle",
                "consume",
                "--source",
                "redis-stream://127.0.0.1:1/s?group=g",
                "--key-field",
                "id",
            ])
            .output()
            .expect("run idemgate");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{route}: {stderr}");
        assert!(
            stderr.contains(&format!("the handler's route \"handle\" {says}")),
            "{route}: {stderr}"
        );
    }
    let ok = idemgate()
        .args([
            "--check-config",
            "--store",
            "memory",
            "consume",
            "--source",
            "redis-stream://127.0.0.1:6379/s?group=g",
            "--key-field",
            "payload:/id",
            "--upstream",
            "http://127.0.0.1:3000/handle",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(
        stdout.trim(),
        "ok: source redis-stream://127.0.0.1:6379/s?group=g key payload:/id -> 127.0.0.1:3000/handle, store memory"
    );
}
