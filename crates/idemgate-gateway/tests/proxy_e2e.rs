//! End to end: the real `idemgate` binary in front of a real upstream on 127.0.0.1.

#[path = "support/promtool.rs"]
mod promtool;
#[path = "support/proxy.rs"]
mod support;

use std::time::Duration;

use support::{
    Gateway, TempDir, TestUpstream, admin_get, assert_metrics_show, eventually, free_addr, key,
    raw, send, send_h2c,
};

const TOKEN: &str = "test-admin-token-0123456789";

/// A config with a webhook route, a strict route, a route that waits, one that requires a
/// key, and an admin token; the upstream timeout is short so 504s come quickly.
fn config(dir: &TempDir, upstream: &str, extra: &str) -> String {
    let text = format!(
        r#"
upstream = "{upstream}"
store = "memory"
upstream_timeout = "1500ms"
upstream_connect_timeout = "1s"
admin_token = "{TOKEN}"
shutdown_grace = "10s"
{extra}

[[routes]]
prefix = "/hooks/github"
name = "github"
preset = "webhook"
key_header = "X-GitHub-Delivery"
require_key = true
scope_headers = []

[[routes]]
prefix = "/hooks/stripe"
name = "stripe"
preset = "webhook"
key_json_pointer = "/id"
scope_headers = []

[[routes]]
prefix = "/wait"
name = "wait"
concurrent = "wait"
wait_timeout = "10s"

[[routes]]
prefix = "/required"
name = "required"
require_key = true
"#
    );
    dir.write("idemgate.toml", &text)
        .to_string_lossy()
        .into_owned()
}

struct Setup {
    upstream: TestUpstream,
    gw: Gateway,
    _dir: TempDir,
}

async fn setup() -> Setup {
    setup_with("").await
}

async fn setup_with(extra: &str) -> Setup {
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let path = config(&dir, &upstream.url(), extra);
    let gw = Gateway::start(&["--config", &path]);
    Setup {
        upstream,
        gw,
        _dir: dir,
    }
}

// ---- the decision table -------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn nothing_stored_executes_then_completed_same_replays() {
    let s = setup().await;
    let url = s.gw.url("/charges");
    let hdrs = [key("k-1"), ("content-type", "application/json")];
    let first = send("POST", &url, &hdrs, r#"{"amount":100}"#).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed());
    assert_eq!(s.upstream.hits("/charges"), 1);

    let again = send("POST", &url, &hdrs, r#"{"amount":100}"#).await;
    assert_eq!(again.status, 201);
    assert!(again.replayed(), "a retry is a replay: {:?}", again.headers);
    assert_eq!(again.body, first.body, "replayed byte for byte");
    assert_eq!(again.headers["x-upstream-n"], "1");
    assert_eq!(
        s.upstream.hits("/charges"),
        1,
        "the upstream is not called again"
    );

    // The log line carries the route, outcome and a short record hash, never the raw key.
    let logs =
        s.gw.logs_with("replayed")
            .await
            .expect("a log line for the replay");
    assert!(
        logs.contains("executed") && logs.contains("route=default"),
        "{logs}"
    );
    assert!(
        !logs.contains("k-1"),
        "the raw key never reaches the logs:\n{logs}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn different_request_with_a_used_key_is_422_and_not_forwarded() {
    let s = setup().await;
    let url = s.gw.url("/charges");
    let first = send("POST", &url, &[key("k-2")], "a").await;
    assert_eq!(first.status, 201);
    let other = send("POST", &url, &[key("k-2")], "b").await;
    assert_eq!(other.status, 422);
    assert_eq!(other.problem_type(), "urn:idemgate:problem:key-mismatch");
    let other_path = send("POST", &s.gw.url("/refunds"), &[key("k-2")], "a").await;
    assert_eq!(
        other_path.status, 422,
        "the path is part of the fingerprint"
    );
    assert_eq!(s.upstream.total_hits(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn in_flight_same_is_409_with_retry_after_and_different_is_422() {
    let s = setup().await;
    let url = s.gw.url("/slow");
    let slow = tokio::spawn({
        let url = url.clone();
        async move { send("POST", &url, &[key("k-3"), ("x-delay-ms", "1000")], "x").await }
    });
    s.upstream.wait_for_hit("/slow").await;
    let busy = send("POST", &url, &[key("k-3")], "x").await;
    assert_eq!(busy.status, 409);
    assert_eq!(
        busy.problem_type(),
        "urn:idemgate:problem:request-in-flight"
    );
    assert!(busy.headers.contains_key("retry-after"));
    let mismatch = send("POST", &url, &[key("k-3")], "y").await;
    assert_eq!(mismatch.status, 422);

    let first = slow.await.unwrap();
    assert_eq!(first.status, 201);
    let replay = send("POST", &url, &[key("k-3")], "x").await;
    assert!(replay.replayed());
    assert_eq!(s.upstream.hits("/slow"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn in_flight_same_on_a_wait_route_waits_and_replays() {
    let s = setup().await;
    let url = s.gw.url("/wait/op");
    let slow = tokio::spawn({
        let url = url.clone();
        async move { send("POST", &url, &[key("k-4"), ("x-delay-ms", "800")], "x").await }
    });
    s.upstream.wait_for_hit("/wait/op").await;
    let waited = send("POST", &url, &[key("k-4")], "x").await;
    assert_eq!(waited.status, 201, "{}", waited.text());
    assert!(waited.replayed());
    assert_eq!(slow.await.unwrap().body, waited.body);
    assert_eq!(s.upstream.hits("/wait/op"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn ambiguous_record_answers_502_until_an_operator_deletes_it() {
    let s = setup().await;
    let url = s.gw.url("/transfer");
    // Past upstream_timeout (1.5 s): 504, and on the api preset the record turns ambiguous.
    let timed_out = send("POST", &url, &[key("k-5"), ("x-delay-ms", "3000")], "x").await;
    assert_eq!(timed_out.status, 504);
    assert_eq!(
        timed_out.problem_type(),
        "urn:idemgate:problem:upstream-timeout"
    );

    let unknown = send("POST", &url, &[key("k-5")], "x").await;
    assert_eq!(unknown.status, 502);
    assert_eq!(
        unknown.problem_type(),
        "urn:idemgate:problem:outcome-unknown"
    );
    let mismatch = send("POST", &url, &[key("k-5")], "other").await;
    assert_eq!(mismatch.status, 422);
    assert_eq!(
        s.upstream.hits("/transfer"),
        1,
        "an ambiguous request never runs again on its own"
    );

    // The operator looks the key up and deletes the record.
    let auth = ("authorization", &*format!("Bearer {TOKEN}"));
    let record = admin_get(&s.gw, "/keys?route=default&key=k-5", &[auth]).await;
    assert_eq!(record.status, 200, "{}", record.text());
    assert_eq!(record.json()["state"], "ambiguous");
    let hex = record.json()["record"].as_str().unwrap().to_owned();
    let by_hash = admin_get(&s.gw, &format!("/records/{hex}"), &[auth]).await;
    assert_eq!(by_hash.json()["state"], "ambiguous");
    let deleted = send(
        "DELETE",
        &format!("http://{}/records/{hex}", s.gw.admin),
        &[auth],
        "",
    )
    .await;
    assert_eq!(deleted.status, 204);

    let runs = send("POST", &url, &[key("k-5")], "x").await;
    assert_eq!(runs.status, 201);
    assert!(!runs.replayed());
    assert_eq!(s.upstream.hits("/transfer"), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_that_take_no_part_pass_through() {
    let s = setup().await;
    for (method, k) in [
        ("GET", Some("k-6")),
        ("PUT", Some("k-6")),
        ("POST", None),
        ("DELETE", None),
    ] {
        let headers: Vec<(&str, &str)> = k.map(key).into_iter().collect();
        let a = send(method, &s.gw.url("/things"), &headers, "x").await;
        let b = send(method, &s.gw.url("/things"), &headers, "x").await;
        assert_eq!((a.status, b.status), (201, 201));
        assert!(!a.replayed() && !b.replayed(), "{method} is passed through");
    }
    assert_eq!(s.upstream.hits("/things"), 8);
    // A streamed body arrives whole.
    let big = "z".repeat(3 << 20);
    let r = send("PUT", &s.gw.url("/big"), &[], &big).await;
    assert_eq!(r.json()["body_len"], 3 << 20);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_keys_missing_required_keys_and_large_bodies_are_refused_without_forwarding() {
    let s = setup().await;
    let missing = send("POST", &s.gw.url("/required/x"), &[], "x").await;
    assert_eq!(missing.status, 400);
    assert_eq!(missing.problem_type(), "urn:idemgate:problem:missing-key");
    let long = "a".repeat(256);
    let invalid = send("POST", &s.gw.url("/x"), &[key(&long)], "x").await;
    assert_eq!(invalid.status, 400);
    assert_eq!(invalid.problem_type(), "urn:idemgate:problem:invalid-key");
    // Refused from its Content-Length, before the body is read: the client gets the 413.
    let too_large = raw(
        s.gw.addr,
        b"POST /x HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-7\r\nContent-Length: 10485761\r\n\r\nzz",
    )
    .await;
    assert!(too_large.starts_with("HTTP/1.1 413"), "{too_large}");
    assert!(
        too_large.contains("urn:idemgate:problem:request-too-large"),
        "{too_large}"
    );
    assert_eq!(s.upstream.total_hits(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn statuses_the_preset_does_not_store_release_the_key() {
    let s = setup().await;
    let url = s.gw.url("/status/503");
    assert_eq!(send("POST", &url, &[key("k-8")], "x").await.status, 503);
    let again = send("POST", &url, &[key("k-8")], "x").await;
    assert_eq!(again.status, 503);
    assert!(!again.replayed());
    assert_eq!(
        s.upstream.hits("/status/503"),
        2,
        "a 5xx is not stored on the api preset"
    );
    // A 404 is stored.
    let url = s.gw.url("/status/404");
    assert_eq!(send("POST", &url, &[key("k-9")], "x").await.status, 404);
    assert!(send("POST", &url, &[key("k-9")], "x").await.replayed());
    assert_eq!(s.upstream.hits("/status/404"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn webhook_routes_take_the_delivery_id_from_a_header_or_the_body() {
    let s = setup().await;
    let gh = s.gw.url("/hooks/github");
    let delivery = ("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958");
    assert_eq!(send("POST", &gh, &[delivery], "{}").await.status, 201);
    assert!(send("POST", &gh, &[delivery], "{}").await.replayed());
    assert_eq!(
        send("POST", &gh, &[], "{}").await.status,
        400,
        "a delivery without its id is refused"
    );
    assert_eq!(s.upstream.hits("/hooks/github"), 1);

    let stripe = s.gw.url("/hooks/stripe");
    let event = r#"{"id":"evt_1","type":"charge.succeeded"}"#;
    assert_eq!(send("POST", &stripe, &[], event).await.status, 201);
    assert!(send("POST", &stripe, &[], event).await.replayed());
    assert_eq!(s.upstream.hits("/hooks/stripe"), 1);
    // A webhook's 500 is not stored: the sender's retry runs it again.
    let d2 = ("x-github-delivery", "d-2");
    assert_eq!(
        send("POST", &gh, &[d2, ("x-status", "500")], "{}")
            .await
            .status,
        500
    );
    let retried = send("POST", &gh, &[d2, ("x-status", "500")], "{}").await;
    assert_eq!(retried.status, 500);
    assert!(!retried.replayed());
    assert_eq!(s.upstream.hits("/hooks/github"), 3);
}

// ---- concurrency and faults ---------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn fifty_concurrent_requests_with_one_key_execute_once() {
    let s = setup().await;
    let url = s.gw.url("/race");
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            send(
                "POST",
                &url,
                &[key("k-race"), ("x-delay-ms", "300")],
                "same",
            )
            .await
        }));
    }
    let mut executed = 0;
    for task in tasks {
        let r = task.await.unwrap();
        match r.status {
            201 if !r.replayed() => executed += 1,
            201 | 409 => {}
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert_eq!(executed, 1);
    assert_eq!(
        s.upstream.hits("/race"),
        1,
        "exactly one request reached the upstream"
    );
    let after = send("POST", &url, &[key("k-race")], "same").await;
    assert!(after.replayed());
}

/// Sends a raw request, waits until the upstream has it, and hangs up before the answer.
async fn hang_up_once_forwarded(s: &Setup, request: &str, path: &str) {
    let mut stream = tokio::net::TcpStream::connect(s.gw.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stream, request.as_bytes())
        .await
        .unwrap();
    s.upstream.wait_for_hit(path).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_hangs_up_mid_request_gets_the_replay_on_retry() {
    let s = setup().await;
    let request = "POST /hangup HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-hang\r\nX-Delay-Ms: 500\r\nContent-Length: 4\r\n\r\nbody";
    hang_up_once_forwarded(&s, request, "/hangup").await;
    let replay = eventually(100, || async {
        let r = send("POST", &s.gw.url("/hangup"), &[key("k-hang")], "body").await;
        (r.status != 409).then_some(r)
    })
    .await
    .expect("the first request finishes");
    assert_eq!(replay.status, 201);
    assert!(
        replay.replayed(),
        "the hung-up request's response was stored"
    );
    assert_eq!(s.upstream.hits("/hangup"), 1);
    // The abandoned request is logged and counted, once.
    let metrics = admin_get(&s.gw, "/metrics", &[]).await.text();
    assert!(
        metrics.contains("\nidemgate_requests_abandoned_total 1\n"),
        "{metrics}"
    );
    let logs = s.gw.logs();
    assert_eq!(
        logs.matches("request abandoned: the client went away")
            .count(),
        1,
        "{logs}"
    );
    assert!(
        logs.lines()
            .any(|l| l.contains("request abandoned") && l.contains("path=/hangup")),
        "{logs}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_hangs_up_on_a_pass_through_cancels_its_upstream_call() {
    let s = setup().await;
    // No key: passed through. The upstream would answer after 3 s.
    let request =
        "POST /gone HTTP/1.1\r\nHost: x\r\nX-Delay-Ms: 3000\r\nContent-Length: 4\r\n\r\nbody";
    hang_up_once_forwarded(&s, request, "/gone").await;
    // Noticed when the client goes, not when the upstream answers: counted as abandoned
    // within 2 s of the hang-up.
    let counted = eventually(40, || async {
        let metrics = admin_get(&s.gw, "/metrics", &[]).await.text();
        metrics
            .contains("\nidemgate_requests_abandoned_total 1\n")
            .then_some(())
    })
    .await;
    assert!(counted.is_some(), "{}", s.gw.logs());
    // The upstream call went with it: the upstream never finished that request.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(s.upstream.hits("/gone"), 1);
    assert_eq!(s.upstream.finished(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_down_is_502_and_a_retry_runs_once_it_is_up() {
    let addr = free_addr();
    let dir = TempDir::new();
    let path = config(&dir, &format!("http://{addr}"), "");
    let gw = Gateway::start(&["--config", &path]);
    let down = send("POST", &gw.url("/pay"), &[key("k-down")], "x").await;
    assert_eq!(down.status, 502);
    assert_eq!(
        down.problem_type(),
        "urn:idemgate:problem:upstream-unreachable"
    );
    let metrics = admin_get(&gw, "/metrics", &[]).await.text();
    for needle in [
        "idemgate_requests_total{route=\"default\",outcome=\"upstream_failed\"} 1\n",
        "idemgate_upstream_errors_total{kind=\"unreachable\"} 1\n",
    ] {
        assert!(metrics.contains(needle), "{needle} not in:\n{metrics}");
    }
    assert!(
        metrics.contains("idemgate_requests_total{route=\"default\",outcome=\"executed\"} 0\n"),
        "{metrics}"
    );

    let upstream = TestUpstream::start_on(addr).await;
    let up = send("POST", &gw.url("/pay"), &[key("k-down")], "x").await;
    assert_eq!(
        up.status,
        201,
        "nothing was sent, so the key was released: {}",
        up.text()
    );
    assert!(!up.replayed());
    assert_eq!(upstream.hits("/pay"), 1);
}

/// An upstream that never completes a connection sent nothing, whichever runs out first: the
/// connect limit or the request's own deadline (here the same length). So it is a 502 and the
/// key is released, never an unknown outcome that blocks the key.
#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_that_never_connects_is_502_and_the_key_is_released() {
    // A listener that accepts nothing, with its queue of one filled: the next connect hangs.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let silent = socket.listen(0).unwrap();
    let addr = silent.local_addr().unwrap();
    let filler = std::net::TcpStream::connect(addr).unwrap();
    let dir = TempDir::new();
    let path = dir.write(
        "idemgate.toml",
        &format!(
            "upstream = \"http://{addr}\"\nstore = \"memory\"\n\
             upstream_timeout = \"1s\"\nupstream_connect_timeout = \"1s\"\n"
        ),
    );
    let gw = Gateway::start(&["--config", &path.to_string_lossy()]);
    for attempt in 0..3 {
        let hung = send("POST", &gw.url("/pay"), &[key("k-hung")], "x").await;
        assert_eq!(hung.status, 502, "attempt {attempt}: {}", hung.text());
        assert_eq!(
            hung.problem_type(),
            "urn:idemgate:problem:upstream-unreachable",
            "attempt {attempt}"
        );
    }
    drop((filler, silent));

    let upstream = TestUpstream::start_on(addr).await;
    let up = send("POST", &gw.url("/pay"), &[key("k-hung")], "x").await;
    assert_eq!(up.status, 201, "the key was released: {}", up.text());
    assert_eq!(upstream.hits("/pay"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn upstream_connections_are_kept_alive_and_closed_ones_replaced() {
    let s = setup().await;
    for i in 0..10 {
        let k = format!("k-alive-{i}");
        assert_eq!(
            send("POST", &s.gw.url("/alive"), &[], "x").await.status,
            201
        );
        let first = send("POST", &s.gw.url("/alive-keyed"), &[key(&k)], "x").await;
        assert_eq!(first.status, 201);
        let retry = send("POST", &s.gw.url("/alive-keyed"), &[key(&k)], "x").await;
        assert_eq!(retry.body, first.body);
    }
    assert_eq!(
        s.upstream.hits("/alive") + s.upstream.hits("/alive-keyed"),
        20
    );
    let kept = s.upstream.connections();
    assert!(
        kept <= 2,
        "20 sequential upstream requests opened {kept} connections"
    );
    // An upstream that closes each connection after its response: every request still runs,
    // once; the first on a kept connection, each of the others on a new one.
    for _ in 0..5 {
        assert_eq!(
            send("POST", &s.gw.url("/close"), &[], "x").await.status,
            201
        );
    }
    assert_eq!(s.upstream.hits("/close"), 5);
    assert_eq!(s.upstream.connections(), kept + 4);
}

#[tokio::test(flavor = "multi_thread")]
async fn chunked_and_large_bodies_cross_whole_both_ways() {
    let s = setup().await;
    // An answer chunked on the wire: streamed through, and kept for a keyed request.
    let plain = send("POST", &s.gw.url("/stream/plain"), &[], "x").await;
    assert_eq!(plain.status, 201);
    assert_eq!(plain.json()["path"], "/stream/plain");
    let first = send("POST", &s.gw.url("/stream/keyed"), &[key("chunked-1")], "x").await;
    let again = send("POST", &s.gw.url("/stream/keyed"), &[key("chunked-1")], "x").await;
    assert_eq!(first.status, 201);
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(again.body, first.body);
    assert_eq!(s.upstream.hits("/stream/keyed"), 1);

    // 3 MiB in 64 KiB frames, three times over.
    for round in 0..3 {
        let big = send("GET", &s.gw.url("/big"), &[("x-size", "3145728")], "").await;
        assert_eq!(big.status, 201, "round {round}");
        assert_eq!(big.body.len(), 3 << 20, "round {round}");
        assert!(big.body.iter().all(|&b| b == b'a'));
    }

    // A request body without a length goes upstream whole (chunked).
    let chunked = raw(
        s.gw.addr,
        b"POST /chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    )
    .await;
    assert!(chunked.starts_with("HTTP/1.1 201"), "{chunked}");
    assert!(chunked.contains("\"body_len\":11"), "{chunked}");
    // Upstream connections are used again: at most 3 for these sequential exchanges (slack
    // for one that reaches the pool only just after its response went out).
    assert!(
        s.upstream.connections() <= 3,
        "{} upstream connections for sequential requests",
        s.upstream.connections()
    );
}

/// Splits HTTP/1.1 responses read off one connection into heads and bodies, by their
/// `Content-Length` or their chunked framing.
fn split_responses(mut bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    fn line(bytes: &[u8]) -> (&[u8], &[u8]) {
        let end = bytes.windows(2).position(|w| w == b"\r\n").expect("a line");
        (&bytes[..end], &bytes[end + 2..])
    }
    let mut responses = Vec::new();
    while !bytes.is_empty() {
        let end = bytes
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a head");
        let head = String::from_utf8_lossy(&bytes[..end]).to_lowercase();
        bytes = &bytes[end + 4..];
        let mut body = Vec::new();
        if let Some(length) = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
        {
            let length: usize = length.parse().unwrap();
            body.extend_from_slice(&bytes[..length]);
            bytes = &bytes[length..];
        } else if head.contains("transfer-encoding: chunked") {
            loop {
                let (size, rest) = line(bytes);
                let size = usize::from_str_radix(std::str::from_utf8(size).unwrap(), 16).unwrap();
                body.extend_from_slice(&rest[..size]);
                bytes = &rest[size + 2..];
                if size == 0 {
                    break;
                }
            }
        }
        responses.push((head, body));
    }
    responses
}

#[tokio::test(flavor = "multi_thread")]
async fn one_connection_carries_plain_requests_then_the_rest_through_hyper() {
    let s = setup().await;
    // Pipelined on one connection: three plain requests (served by the gateway's own HTTP/1.1
    // loop: an answer that comes chunked from the upstream, a keyed request and its replay),
    // a chunked request (the connection goes to hyper with what was read), then a plain
    // request that asks to close, which hyper now serves.
    let request = b"POST /stream/own HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc\
POST /own HTTP/1.1\r\nHost: x\r\nIdempotency-Key: own-1\r\nContent-Length: 3\r\n\r\nabc\
POST /own HTTP/1.1\r\nHost: x\r\nIdempotency-Key: own-1\r\nContent-Length: 3\r\n\r\nabc\
POST /chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n\
POST /plain HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi";
    let mut stream = tokio::net::TcpStream::connect(s.gw.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stream, request)
        .await
        .unwrap();
    let mut bytes = Vec::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::AsyncReadExt::read_to_end(&mut stream, &mut bytes),
    )
    .await
    .expect("the connection closed after the last response")
    .unwrap();
    let responses = split_responses(&bytes);
    assert_eq!(responses.len(), 5, "{}", String::from_utf8_lossy(&bytes));
    for (head, _) in &responses {
        assert!(head.starts_with("http/1.1 201 created\r\n"), "{head}");
        assert!(head.contains("\r\ndate: "), "{head}");
    }
    let json = |body: &[u8]| serde_json::from_slice::<serde_json::Value>(body).unwrap();
    let (streamed, streamed_body) = &responses[0];
    assert!(
        streamed.contains("transfer-encoding: chunked"),
        "{streamed}"
    );
    assert_eq!(json(streamed_body)["path"], "/stream/own");
    assert_eq!(json(streamed_body)["body_len"], 3);
    let (first, first_body) = &responses[1];
    assert!(!first.contains("idempotent-replayed"), "{first}");
    assert_eq!(json(first_body)["body_len"], 3);
    let (again, again_body) = &responses[2];
    assert!(again.contains("idempotent-replayed: true"), "{again}");
    assert_eq!(again_body, first_body);
    assert_eq!(json(&responses[3].1)["path"], "/chunked");
    assert_eq!(json(&responses[3].1)["body_len"], 5);
    assert_eq!(json(&responses[4].1)["body_len"], 2);
    assert!(
        responses[4].0.contains("connection: close"),
        "{}",
        responses[4].0
    );
    assert_eq!(s.upstream.hits("/own"), 1);
    assert_eq!(s.upstream.hits("/plain"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_hangs_up_during_an_over_limit_response_still_gets_it_recorded() {
    let s = setup_with(r#"max_response_bytes = "64KiB""#).await;
    // 32 MiB: far more than the loopback socket buffers hold, so the relay is still going
    // when the client, having read only the head, goes away.
    let request = "POST /big-hangup HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-big\r\nX-Size: 33554432\r\nContent-Length: 2\r\n\r\n{}";
    {
        let mut stream = tokio::net::TcpStream::connect(s.gw.addr).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut stream, request.as_bytes())
            .await
            .unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = tokio::io::AsyncReadExt::read(&mut stream, &mut buf)
                .await
                .unwrap();
            assert!(n > 0, "the gateway closed before the response head");
            head.extend_from_slice(&buf[..n]);
        }
        assert!(
            head.starts_with(b"HTTP/1.1 201"),
            "{:?}",
            String::from_utf8_lossy(&head)
        );
        // The client goes away with most of the body unsent.
    }
    // The rest of the body is still read from the upstream and the record completed as run
    // but not replayable: the retry is told so, and the upstream is never called again.
    let retry = eventually(200, || async {
        let r = send(
            "POST",
            &s.gw.url("/big-hangup"),
            &[key("k-big"), ("x-size", "33554432")],
            "{}",
        )
        .await;
        (r.status != 409 || r.problem_type() != "urn:idemgate:problem:request-in-flight")
            .then_some(r)
    })
    .await
    .expect("the relayed request finishes");
    assert_eq!(retry.status, 409);
    assert_eq!(
        retry.problem_type(),
        "urn:idemgate:problem:response-not-replayable"
    );
    assert_eq!(s.upstream.hits("/big-hangup"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_upstream_connections_are_closed_within_seconds() {
    let s = setup().await;
    assert_eq!(send("POST", &s.gw.url("/idle"), &[], "x").await.status, 201);
    assert_eq!(s.upstream.connections(), 1);
    // Idle for longer than the pool keeps a connection (2 to 4 s): the next request needs a
    // new one, so the gateway never writes to a connection the upstream is timing out.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    assert_eq!(send("POST", &s.gw.url("/idle"), &[], "x").await.status, 201);
    assert_eq!(s.upstream.connections(), 2);
    assert_eq!(s.upstream.hits("/idle"), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn slow_upstream_is_504() {
    let s = setup().await;
    let r = send(
        "POST",
        &s.gw.url("/hooks/github"),
        &[("x-github-delivery", "d-slow"), ("x-delay-ms", "3000")],
        "{}",
    )
    .await;
    assert_eq!(r.status, 504);
    assert_eq!(r.problem_type(), "urn:idemgate:problem:upstream-timeout");
    // On the webhook preset the unknown outcome is retried: the next delivery runs.
    let retry = send(
        "POST",
        &s.gw.url("/hooks/github"),
        &[("x-github-delivery", "d-slow")],
        "{}",
    )
    .await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    assert_eq!(s.upstream.hits("/hooks/github"), 2);
    // Passed-through requests time out too.
    let get = send("GET", &s.gw.url("/slow-get"), &[("x-delay-ms", "3000")], "").await;
    assert_eq!(get.status, 504);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_lets_an_open_request_finish_and_store_its_response() {
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let store = format!("redb:{}", dir.path().join("records.redb").display());
    let mut gw = Gateway::start(&["--upstream", &upstream.url(), "--store", &store]);
    let url = gw.url("/drain");
    let slow = tokio::spawn({
        let url = url.clone();
        async move { send("POST", &url, &[key("k-term"), ("x-delay-ms", "1000")], "x").await }
    });
    upstream.wait_for_hit("/drain").await;
    gw.sigterm();
    let first = slow.await.unwrap();
    assert_eq!(first.status, 201, "the open request is answered");
    let status = gw
        .wait_exit(Duration::from_secs(20))
        .expect("the gateway exits");
    assert!(
        status.success(),
        "exit status {status:?}; logs:\n{}",
        gw.logs()
    );

    // Restarted on the same file, the retry is a replay.
    let gw = Gateway::start(&["--upstream", &upstream.url(), "--store", &store]);
    let replay = send("POST", &gw.url("/drain"), &[key("k-term")], "x").await;
    assert!(replay.replayed(), "{} {}", replay.status, replay.text());
    assert_eq!(replay.body, first.body);
    assert_eq!(upstream.hits("/drain"), 1);
}

/// After SIGTERM the gateway also waits for work whose client already hung up: its
/// connection is gone, but the upstream call runs to the end and its response is stored.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_waits_for_the_work_of_a_client_that_hung_up() {
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let store = format!("redb:{}", dir.path().join("records.redb").display());
    let mut gw = Gateway::start(&["--upstream", &upstream.url(), "--store", &store]);
    let url = gw.url("/gone");
    let hung_up = tokio::spawn(async move {
        send("POST", &url, &[key("k-gone"), ("x-delay-ms", "1000")], "x").await
    });
    upstream.wait_for_hit("/gone").await;
    hung_up.abort();
    let _ = hung_up.await;
    gw.sigterm();
    let status = gw
        .wait_exit(Duration::from_secs(20))
        .expect("the gateway exits");
    assert!(status.success(), "exit status {status:?}");
    assert_eq!(
        upstream.finished(),
        1,
        "the gateway exited before the upstream call it owned had finished"
    );

    let gw = Gateway::start(&["--upstream", &upstream.url(), "--store", &store]);
    let replay = send("POST", &gw.url("/gone"), &[key("k-gone")], "x").await;
    assert!(replay.replayed(), "{} {}", replay.status, replay.text());
    assert_eq!(upstream.hits("/gone"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn past_the_shutdown_grace_open_requests_are_cut_and_not_counted_as_abandoned() {
    let upstream = TestUpstream::start().await;
    let dir = TempDir::new();
    let mut gw = Gateway::start_configured(
        &dir,
        &upstream,
        "memory",
        "shutdown_grace = \"300ms\"\n",
        &[],
    );
    let url = gw.url("/cut");
    let slow = tokio::spawn(async move {
        send("POST", &url, &[key("k-cut"), ("x-delay-ms", "5000")], "x").await
    });
    upstream.wait_for_hit("/cut").await;
    gw.sigterm();
    let status = gw
        .wait_exit(Duration::from_secs(20))
        .expect("the gateway exits once the grace has passed");
    assert!(status.success(), "exit status {status:?}");
    slow.abort();
    // Its output is read by a thread of this test: wait for the last lines to come in.
    let logs = gw
        .logs_with("shutdown grace passed")
        .await
        .unwrap_or_else(|| panic!("the grace's end is logged:\n{}", gw.logs()));
    assert!(
        !logs.contains("request abandoned"),
        "cut by the gateway, not abandoned by its client:\n{logs}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_that_is_down_fails_closed_or_passes_as_configured() {
    let upstream = TestUpstream::start().await;
    // Nothing listens there: every store call fails.
    let store = format!("redis://{}", free_addr());
    let dir = TempDir::new();
    let gw = Gateway::start_configured(
        &dir,
        &upstream,
        &store,
        "store_timeout = \"500ms\"\n",
        &["--admin-token", TOKEN],
    );
    let r = send("POST", &gw.url("/pay"), &[key("k-store")], "x").await;
    assert_eq!(r.status, 503);
    assert_eq!(r.problem_type(), "urn:idemgate:problem:store-unavailable");
    assert!(r.headers.contains_key("retry-after"));
    assert_eq!(
        upstream.hits("/pay"),
        0,
        "nothing is forwarded when failing closed"
    );
    let ready = admin_get(&gw, "/readyz", &[]).await;
    assert_eq!(ready.status, 503);
    assert_eq!(ready.problem_type(), "urn:idemgate:problem:not-ready");
    let auth = ("authorization", &*format!("Bearer {TOKEN}"));
    let lookup = admin_get(&gw, "/keys?route=default&key=k-store", &[auth]).await;
    assert_eq!(lookup.status, 503);
    assert_eq!(
        lookup.problem_type(),
        "urn:idemgate:problem:store-unavailable"
    );
    assert!(lookup.headers.contains_key("retry-after"));
    assert!(
        send("GET", &gw.url("/pay"), &[], "").await.status == 201,
        "requests that take no part still pass"
    );
    drop(gw);

    let gw = Gateway::start_configured(
        &dir,
        &upstream,
        &store,
        "store_timeout = \"500ms\"\non_store_error = \"pass\"\n",
        &[],
    );
    let r = send("POST", &gw.url("/pay"), &[key("k-store")], "x").await;
    assert_eq!(r.status, 201, "forwarded unprotected");
    assert_eq!(upstream.hits("/pay"), 2);
    let metrics = admin_get(&gw, "/metrics", &[]).await.text();
    assert!(
        metrics.contains("idemgate_unprotected_passes_total 1\n"),
        "{metrics}"
    );
}

// ---- the wire -----------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn hop_by_hop_and_forged_replay_headers_never_cross() {
    let s = setup().await;
    let request = "POST http://evil.example/echo?q=1 HTTP/1.1\r\n\
        Host: public.example\r\n\
        Connection: close, X-Hop\r\n\
        X-Hop: 1\r\n\
        Keep-Alive: timeout=5\r\n\
        Proxy-Authorization: Basic eA==\r\n\
        TE: trailers\r\n\
        Idempotent-Replayed: true\r\n\
        X-Forwarded-Host: front.example\r\n\
        X-Forwarded-Proto: https\r\n\
        X-Forwarded-For: 10.0.0.1\r\n\
        Idempotency-Key: k-hop\r\n\
        Content-Length: 1\r\n\r\nx";
    let response = raw(s.gw.addr, request.as_bytes()).await;
    assert!(response.starts_with("HTTP/1.1 201"), "{response}");
    let seen = s.upstream.last_headers();
    for gone in [
        "connection",
        "x-hop",
        "keep-alive",
        "proxy-authorization",
        "te",
        "idempotent-replayed",
    ] {
        assert!(
            !seen.contains_key(gone),
            "{gone} reached the upstream: {seen:?}"
        );
    }
    assert_eq!(
        seen["host"],
        s.upstream.addr.to_string(),
        "the upstream comes only from the config"
    );
    // Each X-Forwarded-* chain gets this hop appended.
    assert_eq!(seen["x-forwarded-host"], "front.example, public.example");
    assert_eq!(seen["x-forwarded-proto"], "https, http");
    assert_eq!(seen["x-forwarded-for"], "10.0.0.1, 127.0.0.1");
    assert_eq!(seen["idempotency-key"], "k-hop", "the key is forwarded");
    assert_eq!(
        s.upstream.hits("/echo"),
        1,
        "an absolute-form target goes to the configured upstream"
    );

    // Upstream → client, for an executed, a replayed and a passed-through response.
    for (method, k) in [
        ("POST", Some("k-spoof")),
        ("POST", Some("k-spoof")),
        ("GET", None),
    ] {
        let headers: Vec<(&str, &str)> = k.map(key).into_iter().collect();
        let r = send(method, &s.gw.url("/spoof"), &headers, "").await;
        assert_eq!(r.status, 201);
        for gone in [
            "x-internal",
            "keep-alive",
            "proxy-authenticate",
            "connection",
        ] {
            assert!(
                !r.headers.contains_key(gone),
                "{gone} reached the client: {:?}",
                r.headers
            );
        }
        assert_eq!(r.headers["x-end-to-end"], "kept");
        let replay_mark = r.headers.get("idempotent-replayed");
        if method == "GET" || !r.replayed() {
            assert!(
                replay_mark.is_none(),
                "a forged Idempotent-Replayed crossed: {:?}",
                r.headers
            );
        }
    }
    assert_eq!(
        s.upstream.hits("/spoof"),
        2,
        "one execution and one passed-through GET"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn connect_is_refused_and_options_star_goes_upstream_in_asterisk_form() {
    let s = setup().await;
    // CONNECT asks for a tunnel, which a reverse proxy does not open: refused, whichever
    // target form it comes in, and nothing is forwarded.
    for request in [
        &b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\nConnection: close\r\n\r\n"
            [..],
        b"CONNECT / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    ] {
        let answer = raw(s.gw.addr, request).await;
        assert!(answer.starts_with("HTTP/1.1 501"), "{answer}");
        assert!(
            answer.contains("urn:idemgate:problem:unsupported-method"),
            "{answer}"
        );
    }
    assert_eq!(s.upstream.total_hits(), 0, "a CONNECT was forwarded");
    // OPTIONS * is about the server as a whole: it goes upstream as OPTIONS *, not as a
    // request for the resource /*.
    let answer = raw(
        s.gw.addr,
        b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    assert_eq!(s.upstream.hits("/*"), 0, "OPTIONS * went upstream as /*");
    assert_eq!(s.upstream.hits("*"), 1);
    // An asterisk target with any other method is not a request for anything.
    let answer = raw(
        s.gw.addr,
        b"GET * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_eq!(s.upstream.total_hits(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_without_exactly_one_valid_host_is_a_400_and_not_forwarded() {
    use tokio::io::AsyncWriteExt;
    let s = setup().await;
    let refused: [(&str, &str); 4] = [
        ("/no-host", ""),
        ("/two-hosts", "Host: a.example\r\nHost: b.example\r\n"),
        ("/two-hosts-mixed", "host: a.example\r\nHOST: a.example\r\n"),
        ("/bad-host", "Host: user@a.example\r\n"),
    ];
    for (path, hosts) in refused {
        // Served by the gateway's own HTTP/1.1 loop (a plain keep-alive request) and by hyper
        // (Connection: close hands the connection over).
        let request = format!(
            "POST {path} HTTP/1.1\r\n{hosts}Idempotency-Key: k{path}\r\nContent-Length: 1\r\n\r\nx"
        );
        let mut stream = tokio::net::TcpStream::connect(s.gw.addr).await.unwrap();
        stream.write_all(request.as_bytes()).await.unwrap();
        let head = read_response(&mut stream).await;
        assert!(
            head.starts_with("HTTP/1.1 400"),
            "{path} (own loop): {head}"
        );
        let request = format!(
            "POST {path} HTTP/1.1\r\n{hosts}Idempotency-Key: k{path}\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx"
        );
        let answer = raw(s.gw.addr, request.as_bytes()).await;
        assert!(
            answer.starts_with("HTTP/1.1 400"),
            "{path} (hyper): {answer}"
        );
        assert!(
            answer.contains("urn:idemgate:problem:malformed-request"),
            "{path}: {answer}"
        );
        assert_eq!(s.upstream.hits(path), 0, "{path} was forwarded");
    }
    // HTTP/1.0 needs no Host; an empty one is valid (a target without an authority); h2c
    // carries the authority in :authority.
    let answer = raw(
        s.gw.addr,
        b"POST /http10 HTTP/1.0\r\nContent-Length: 1\r\n\r\nx",
    )
    .await;
    assert!(
        answer.starts_with("HTTP/1.1 201") || answer.starts_with("HTTP/1.0 201"),
        "{answer}"
    );
    let answer = raw(
        s.gw.addr,
        b"POST /empty-host HTTP/1.1\r\nHost:\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    assert_eq!(
        send_h2c("POST", &s.gw.url("/h2-host"), &[], "x")
            .await
            .status,
        201
    );
    assert_metrics_show(
        &s.gw,
        &["idemgate_unrouted_requests_total{reason=\"malformed\"} 8"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn request_fields_with_underscores_are_dropped_unless_configured_to_pass() {
    // Names a CGI-style upstream reads as the framing and forwarding fields.
    let underscored = [
        ("transfer_encoding", "chunked"),
        ("content_length", "999"),
        ("x_forwarded_for", "6.6.6.6"),
        ("x_api_key", "k"),
    ];
    let s = setup().await;
    let mut headers = underscored.to_vec();
    headers.push(("x-kept", "1"));
    // Over HTTP/1.1 (the gateway's own loop) and h2c (hyper).
    for h2 in [false, true] {
        let url = s.gw.url("/underscores");
        let r = if h2 {
            send_h2c("POST", &url, &headers, "x").await
        } else {
            send("POST", &url, &headers, "x").await
        };
        assert_eq!(r.status, 201, "h2c: {h2}");
        let seen = s.upstream.last_headers();
        for (name, _) in underscored {
            assert!(
                !seen.contains_key(name),
                "h2c {h2}: {name} was forwarded: {seen:?}"
            );
        }
        assert_eq!(seen["x-kept"], "1");
        assert_eq!(seen["x-forwarded-for"], "127.0.0.1", "h2c: {h2}");
        assert_eq!(seen["content-length"], "1", "h2c: {h2}");
    }
    // Kept when the file or the flag says so.
    let file = setup_with("underscores_in_headers = true").await;
    let flag_dir = TempDir::new();
    let flag_upstream = TestUpstream::start().await;
    let flag = Gateway::start_configured(
        &flag_dir,
        &flag_upstream,
        "memory",
        "",
        &["--underscores-in-headers"],
    );
    for (gw, upstream) in [(&file.gw, &file.upstream), (&flag, &flag_upstream)] {
        let r = send("POST", &gw.url("/underscores"), &headers, "x").await;
        assert_eq!(r.status, 201);
        let seen = upstream.last_headers();
        for (name, value) in underscored {
            assert_eq!(seen[name], value, "{name}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn responses_use_the_clients_http_version() {
    // An upstream that answers in HTTP/1.0, as some small servers do.
    let (addr, upstream) = pausing_upstream(
        b"HTTP/1.0 201 Created\r\nContent-Length: 2\r\n\r\nok",
        Duration::ZERO,
        b"",
    )
    .await;
    let gw = Gateway::start(&["--upstream", &format!("http://{addr}"), "--store", "memory"]);
    let response = raw(gw.addr, b"POST /v HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-v\r\nConnection: close\r\nContent-Length: 0\r\n\r\n").await;
    assert!(response.starts_with("HTTP/1.1 201"), "{response}");
    upstream.abort();
}

#[tokio::test(flavor = "multi_thread")]
async fn h2c_clients_are_served() {
    let s = setup().await;
    let first = send_h2c("POST", &s.gw.url("/h2"), &[key("k-h2")], "x").await;
    assert_eq!(first.status, 201);
    let again = send_h2c("POST", &s.gw.url("/h2"), &[key("k-h2")], "x").await;
    assert!(again.replayed());
    assert_eq!(s.upstream.hits("/h2"), 1);
    assert_eq!(
        s.upstream.last_headers()["x-forwarded-host"],
        s.gw.addr.to_string()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_idle_h2c_connection_is_closed_even_while_it_pings() {
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    let s = setup_with("[limits]\nidle_timeout = \"1s\"").await;
    let stream = tokio::net::TcpStream::connect(s.gw.addr).await.unwrap();
    // The client pings every 100 ms, idle or not: bytes never stop moving either way.
    let (mut sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_millis(100))
        .keep_alive_while_idle(true)
        .handshake(TokioIo::new(stream))
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    // A request that runs past the idle timeout keeps the connection: it is in use.
    for (path, delay) in [("/h2-slow", "1200"), ("/h2-idle", "0")] {
        let request = hyper::Request::post(s.gw.url(path))
            .header("idempotency-key", path)
            .header("x-delay-ms", delay)
            .body(Full::new(bytes::Bytes::from_static(b"x")))
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.status(), 201, "{path}");
        response.into_body().collect().await.unwrap();
    }

    // No request for the idle timeout: the gateway ends the connection, pings or not.
    let ended = tokio::time::timeout(Duration::from_secs(10), connection).await;
    assert!(
        ended.is_ok(),
        "an idle h2c connection was kept open by its pings"
    );
    assert!(sender.is_closed());
}

#[tokio::test(flavor = "multi_thread")]
async fn slow_or_silent_clients_are_cut_off_and_connections_are_limited() {
    let s = setup_with("[limits]\nheader_read_timeout = \"500ms\"\nmax_connections = 2").await;
    // A header block that never ends, and a connection that never sends: both closed.
    let partial = raw(s.gw.addr, b"POST / HTTP/1.1\r\nHost: x\r\n").await;
    assert!(!partial.contains("201"), "{partial}");
    let silent = tokio::time::timeout(Duration::from_secs(10), raw(s.gw.addr, b"")).await;
    assert!(silent.is_ok(), "a silent connection is closed");

    // Two open connections fill the limit; a third waits until one closes.
    let a = tokio::net::TcpStream::connect(s.gw.addr).await.unwrap();
    let b = tokio::net::TcpStream::connect(s.gw.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let third = tokio::spawn({
        let url = s.gw.url("/third");
        async move { send("GET", &url, &[], "").await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        s.upstream.hits("/third"),
        0,
        "no third connection is served at the limit"
    );
    drop((a, b));
    // The idle ones are also cut after header_read_timeout; either way a slot frees.
    let r = tokio::time::timeout(Duration::from_secs(10), third)
        .await
        .expect("served once a slot frees")
        .unwrap();
    assert_eq!(r.status, 201);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_stuck_mid_body_or_not_reading_loses_its_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = setup_with("[limits]\nidle_timeout = \"1s\"\nmax_connections = 2").await;
    // A keyed request that promises 1 000 bytes of body, sends 10 and goes silent.
    let mut half = tokio::net::TcpStream::connect(s.gw.addr).await.unwrap();
    half.write_all(
        b"POST /half HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-half\r\nContent-Length: 1000\r\n\r\n0123456789",
    )
    .await
    .unwrap();
    // A request for 32 MiB from a client that never reads it: the socket buffers fill and
    // the response stops moving.
    let mut deaf = tokio::net::TcpStream::connect(s.gw.addr).await.unwrap();
    deaf.write_all(b"GET /deaf HTTP/1.1\r\nHost: x\r\nX-Size: 33554432\r\n\r\n")
        .await
        .unwrap();
    // Each is closed within twice the idle timeout (and a quarter more, twice): the
    // graceful close it gets after a quiet second would otherwise wait for ever.
    let ended = tokio::time::timeout(Duration::from_secs(15), async {
        let mut buf = vec![0u8; 64 * 1024];
        while !matches!(half.read(&mut buf).await, Ok(0) | Err(_)) {}
        // Read nothing until the cut, then drain what the buffers held.
        tokio::time::sleep(Duration::from_secs(4)).await;
        while !matches!(deaf.read(&mut buf).await, Ok(0) | Err(_)) {}
    })
    .await;
    assert!(ended.is_ok(), "a stuck connection was kept open");
    assert_eq!(s.upstream.hits("/half"), 0);
    // Both slots are free again: a new connection is served.
    let r = tokio::time::timeout(
        Duration::from_secs(10),
        send("POST", &s.gw.url("/after"), &[], "x"),
    )
    .await
    .expect("served once the stuck connections are gone");
    assert_eq!(r.status, 201);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trickled_head_is_cut_off_but_a_slow_response_keeps_its_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = setup_with("[limits]\nheader_read_timeout = \"300ms\"").await;

    // A head that gains a byte every 50 ms but never ends: closed while bytes still come.
    let stream = tokio::net::TcpStream::connect(s.gw.addr).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let closed = tokio::spawn(async move {
        let mut out = Vec::new();
        let _ = read.read_to_end(&mut out).await;
        out
    });
    write
        .write_all(b"POST /trickle HTTP/1.1\r\nHost: x\r\nX-Long: ")
        .await
        .unwrap();
    let mut trickled = 0;
    while !closed.is_finished() && trickled < 200 {
        if write.write_all(b"v").await.is_err() {
            break;
        }
        trickled += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let answer = tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .expect("the connection was closed")
        .unwrap();
    assert!(trickled < 200, "the trickled head was never cut off");
    assert!(!String::from_utf8_lossy(&answer).contains("201"));
    assert_eq!(s.upstream.hits("/trickle"), 0);

    // A response that takes four times the header timeout neither loses its connection nor
    // closes it: the next request on the same connection is served.
    let mut stream = tokio::net::TcpStream::connect(s.gw.addr).await.unwrap();
    for (n, delay) in [(1, "1200"), (2, "0")] {
        let request = format!(
            "POST /slow-{n} HTTP/1.1\r\nHost: x\r\nX-Delay-Ms: {delay}\r\nContent-Length: 1\r\n\r\nx"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let head = read_response(&mut stream).await;
        assert!(head.starts_with("HTTP/1.1 201"), "request {n}: {head}");
        assert!(
            !head.to_ascii_lowercase().contains("connection: close"),
            "request {n}: {head}"
        );
    }
    // The same connection, having served requests, then trickles a head: closed too.
    stream
        .write_all(b"POST /trickle-2 HTTP/1.1\r\nHost: x\r\nX-Long: ")
        .await
        .unwrap();
    let mut closed = false;
    for _ in 0..200 {
        let mut byte = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(50), stream.read(&mut byte)).await {
            Ok(Ok(0) | Err(_)) => {
                closed = true;
                break;
            }
            Ok(Ok(_)) => panic!("an answer to a head that never ended"),
            Err(_) => {
                let _ = stream.write_all(b"v").await;
            }
        }
    }
    assert!(closed, "the trickled second head was never cut off");
    assert_eq!(s.upstream.hits("/trickle-2"), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_response_body_that_pauses_past_the_header_timeout_arrives_whole() {
    // An upstream that sends half its body, pauses for three header timeouts, then the rest.
    let (addr, upstream) = pausing_upstream(
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nfirst",
        Duration::from_millis(900),
        b"-last",
    )
    .await;
    let dir = TempDir::new();
    let path = config(
        &dir,
        &format!("http://{addr}"),
        "[limits]\nheader_read_timeout = \"300ms\"",
    );
    let gw = Gateway::start(&["--config", &path]);
    let response = raw(
        gw.addr,
        b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.ends_with("\r\n\r\nfirst-last"), "{response}");
    upstream.abort();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_response_body_that_stops_coming_is_cut_after_the_upstream_timeout() {
    // An upstream that sends a head and part of its body, then nothing for 30 s.
    let (addr, upstream) = pausing_upstream(
        b"HTTP/1.1 201 Created\r\nContent-Length: 10\r\n\r\nfirst",
        Duration::from_secs(30),
        b"",
    )
    .await;
    let dir = TempDir::new();
    // upstream_timeout is 1500ms.
    let gw = Gateway::start(&["--config", &config(&dir, &format!("http://{addr}"), "")]);

    // A keyed request is answered within raw's 10 s, not held until the upstream gives up:
    // the outcome is unknown, and so is the record's, so a retry is not told "in flight".
    let request = b"POST /stall HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-stall\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx";
    let first = raw(gw.addr, request).await;
    assert!(first.starts_with("HTTP/1.1 502"), "{first}");
    assert!(first.contains("outcome-unknown"), "{first}");
    let retry = raw(gw.addr, request).await;
    assert!(retry.contains("outcome-unknown"), "{retry}");
    assert!(!retry.contains("request-in-flight"), "{retry}");

    // A streamed response (no key) gets what came, then its connection is closed, well
    // before raw's 10 s limit (the upstream holds it 30 s).
    let started = std::time::Instant::now();
    let streamed = raw(
        gw.addr,
        b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(streamed.starts_with("HTTP/1.1 201"), "{streamed}");
    assert!(streamed.ends_with("\r\n\r\nfirst"), "{streamed}");
    assert!(started.elapsed() < Duration::from_secs(9), "not cut");
    upstream.abort();
}

/// Sends a keyed `POST` twice to a gateway in front of an upstream that answers every request
/// with `first`, then after `pause` with `rest`; answers both of the gateway's answers.
async fn keyed_twice_through(
    first: &'static [u8],
    pause: Duration,
    rest: &'static [u8],
    key: &str,
) -> (String, String) {
    let (addr, upstream) = pausing_upstream(first, pause, rest).await;
    let dir = TempDir::new();
    let gw = Gateway::start(&["--config", &config(&dir, &format!("http://{addr}"), "")]);
    let request = format!(
        "POST /malformed HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx"
    );
    let answer = raw(gw.addr, request.as_bytes()).await;
    let retry = raw(gw.addr, request.as_bytes()).await;
    upstream.abort();
    (answer, retry)
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_head_over_64_kib_is_a_502_and_never_stored_even_when_one_read_completes_it() {
    // The head comes in two writes: 60 000 bytes (under the limit, so reading goes on), then
    // 10 000 more that complete it in one read, at 70 KB in all.
    static FIRST: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
        let mut head = b"HTTP/1.1 201 Created\r\nx-big: ".to_vec();
        head.resize(60_000, b'a');
        head
    });
    static REST: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
        let mut rest = b"\r\nx-more: ".to_vec();
        rest.resize(10_000, b'b');
        rest.extend_from_slice(b"\r\nContent-Length: 6\r\n\r\nstored");
        rest
    });
    let (answer, retry) =
        keyed_twice_through(&FIRST, Duration::from_millis(300), &REST, "k-big-head").await;
    assert!(
        answer.starts_with("HTTP/1.1 502"),
        "{}",
        &answer[..answer.len().min(300)]
    );
    assert!(
        answer.contains("application/problem+json"),
        "{}",
        &answer[..answer.len().min(300)]
    );
    assert!(
        !retry.contains("stored") && !retry.to_ascii_lowercase().contains("idempotent-replayed"),
        "the over-limit response was stored and replayed: {}",
        &retry[..retry.len().min(300)]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_response_with_a_transfer_coding_other_than_chunked_is_a_502_and_never_stored()
{
    for (coded, key) in [
        (
            &b"HTTP/1.1 201 Created\r\nTransfer-Encoding: gzip, chunked\r\n\r\n6\r\nstored\r\n0\r\n\r\n"[..],
            "k-te-gzip-chunked",
        ),
        (
            &b"HTTP/1.1 201 Created\r\nTransfer-Encoding: gzip\r\n\r\nstored"[..],
            "k-te-gzip",
        ),
    ] {
        let (answer, retry) = keyed_twice_through(coded, Duration::ZERO, b"", key).await;
        assert!(answer.starts_with("HTTP/1.1 502"), "{key}: {answer}");
        assert!(answer.contains("application/problem+json"), "{key}: {answer}");
        assert!(
            !retry.contains("stored") && !retry.to_ascii_lowercase().contains("idempotent-replayed"),
            "{key}: the coded response was stored and replayed: {retry}"
        );
    }
}

/// An upstream on 127.0.0.1 that answers each request with `first`, waits `pause`, then
/// writes `rest`. Abort the task to stop it.
async fn pausing_upstream(
    first: &'static [u8],
    pause: Duration,
    rest: &'static [u8],
) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = stream.read(&mut buf).await;
                let _ = stream.write_all(first).await;
                tokio::time::sleep(pause).await;
                let _ = stream.write_all(rest).await;
            });
        }
    });
    (addr, task)
}

/// Reads one response with a `Content-Length` body off `stream` and returns its head.
async fn read_response(stream: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let length: usize = head
                .lines()
                .find_map(|line| {
                    let (name, value) = line.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .expect("a Content-Length");
            if buf.len() >= end + 4 + length {
                return head;
            }
        }
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
            .await
            .expect("a response within 10 s")
            .unwrap();
        assert!(n > 0, "closed before a whole response: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_over_the_header_limits_get_a_431_problem() {
    let s = setup_with("[limits]\nmax_headers = 20\nmax_header_bytes = \"8KiB\"").await;
    let names: Vec<String> = (0..25).map(|i| format!("x-field-{i}")).collect();
    let fields = |n: usize| names[..n].iter().map(|name| (name.as_str(), "1"));
    let big = "v".repeat(10_000);
    let over: [(&str, Vec<(&str, &str)>); 2] = [
        ("/many", fields(25).collect()),
        ("/big", vec![("x-big", big.as_str())]),
    ];
    for (path, mut headers) in over {
        headers.push(key("k-limits"));
        let r = send("POST", &s.gw.url(path), &headers, "x").await;
        assert_eq!(r.status, 431, "{path}");
        assert_eq!(r.headers["content-type"], "application/problem+json");
        assert_eq!(r.json()["type"], "urn:idemgate:problem:headers-too-large");
        assert_eq!(s.upstream.hits(path), 0, "{path} was forwarded");
    }
    // Within the limits the same kind of request goes through, key and all.
    let fits = "v".repeat(6_000);
    let mut headers: Vec<(&str, &str)> = fields(10).collect();
    headers.extend([("x-big", fits.as_str()), key("k-limits")]);
    assert_eq!(
        send("POST", &s.gw.url("/few"), &headers, "x").await.status,
        201
    );
    // Past the HTTP layer's own limit (100 fields) it answers by itself and closes.
    let mut flood = b"GET /flood HTTP/1.1\r\nHost: x\r\n".to_vec();
    for i in 0..120 {
        flood.extend_from_slice(format!("x-f-{i}: 1\r\n").as_bytes());
    }
    flood.extend_from_slice(b"\r\n");
    let answer = raw(s.gw.addr, &flood).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    assert!(!answer.contains("problem+json"), "{answer}");
    assert_eq!(s.upstream.hits("/flood"), 0);
    // So does a request it cannot parse. None of these reaches a route, so none is in
    // requests_total; they are counted apart, by reason.
    let answer = raw(s.gw.addr, b"POST /bad\x01 HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert_metrics_show(
        &s.gw,
        &[
            "idemgate_unrouted_requests_total{reason=\"malformed\"} 1",
            "idemgate_unrouted_requests_total{reason=\"too_large\"} 3",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_body_with_a_transfer_coding_other_than_chunked_gets_a_501_problem() {
    let s = setup().await;
    // The HTTP layer takes the chunked framing off; the gzip coding under it would go
    // upstream unannounced. Keyed or not, nothing is forwarded and no key is claimed.
    for (path, key_field) in [
        ("/te-plain", ""),
        ("/te-keyed", "Idempotency-Key: k-te\r\n"),
    ] {
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\n{key_field}Transfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
        );
        let answer = raw(s.gw.addr, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 501"), "{answer}");
        assert!(answer.contains("application/problem+json"), "{answer}");
        assert!(
            answer.contains("urn:idemgate:problem:unsupported-transfer-coding"),
            "{answer}"
        );
        assert_eq!(s.upstream.hits(path), 0, "{path} was forwarded");
    }
    // The key was never claimed: the same key with a plain body runs.
    let plain = send("POST", &s.gw.url("/te-keyed"), &[key("k-te")], "hello").await;
    assert_eq!(plain.status, 201);
    assert_eq!(s.upstream.hits("/te-keyed"), 1);
    assert_metrics_show(
        &s.gw,
        &["idemgate_unrouted_requests_total{reason=\"unsupported\"} 2"],
    )
    .await;
}

// ---- operating it -------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn admin_health_readiness_metrics_and_token() {
    let s = setup().await;
    assert_eq!(admin_get(&s.gw, "/healthz", &[]).await.status, 200);
    assert_eq!(admin_get(&s.gw, "/readyz", &[]).await.status, 200);
    send("POST", &s.gw.url("/m"), &[key("k-m")], "x").await;
    send("POST", &s.gw.url("/m"), &[key("k-m")], "x").await;
    let m = admin_get(&s.gw, "/metrics", &[]).await;
    assert_eq!(m.status, 200);
    let text = m.text();
    for needle in [
        "idemgate_requests_total{route=\"default\",outcome=\"executed\"} 1\n",
        "idemgate_requests_total{route=\"default\",outcome=\"replayed\"} 1\n",
        "idemgate_upstream_duration_seconds_count 1\n",
        "idemgate_store_duration_seconds_count{backend=\"memory\",op=\"claim\"} 2\n",
        "idemgate_store_errors_total 0\n",
        "idemgate_unrouted_requests_total{reason=\"malformed\"} 0\n",
        "idemgate_unrouted_requests_total{reason=\"too_large\"} 0\n",
        "idemgate_unrouted_requests_total{reason=\"unsupported\"} 0\n",
        "idemgate_fenced_completions_total 0\n",
        "idemgate_records_in_flight 0\n",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in\n{text}");
    }
    assert_eq!(
        m.headers["content-type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    promtool::accepts(&text);
    // Record endpoints: a token is required and checked.
    let none = admin_get(&s.gw, "/keys?route=default&key=k-m", &[]).await;
    assert_eq!(none.status, 401);
    assert_eq!(none.problem_type(), "urn:idemgate:problem:unauthorized");
    assert_eq!(none.headers["www-authenticate"], "Bearer");
    let wrong = admin_get(
        &s.gw,
        "/keys?route=default&key=k-m",
        &[("authorization", "Bearer wrong-token-0123456789")],
    )
    .await;
    assert_eq!(wrong.status, 401);
    assert_eq!(wrong.problem_type(), "urn:idemgate:problem:unauthorized");
    assert_eq!(wrong.headers["www-authenticate"], "Bearer");
    let auth = ("authorization", &*format!("Bearer {TOKEN}"));
    let ok = admin_get(&s.gw, "/keys?route=default&key=k-m", &[auth]).await;
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(ok.json()["state"], "completed");
    assert_eq!(ok.json()["response"]["status"], 201);
    let scoped = admin_get(
        &s.gw,
        "/keys?route=default&key=k-m&authorization=Bearer%20alice",
        &[auth],
    )
    .await;
    assert_eq!(scoped.status, 404, "another caller's scope holds no record");
    assert_eq!(
        scoped.problem_type(),
        "urn:idemgate:problem:record-not-found"
    );
    let unknown_route = admin_get(&s.gw, "/keys?route=nope&key=k-m", &[auth]).await;
    assert_eq!(unknown_route.status, 404);
    assert_eq!(
        unknown_route.problem_type(),
        "urn:idemgate:problem:not-found"
    );
    assert!(
        unknown_route.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("nope")),
        "{}",
        unknown_route.text()
    );

    // Malformed queries, unknown paths and wrong methods: problem responses too.
    for bad in ["/records/not-hex", "/keys?key=k-m", "/keys?route=default"] {
        let r = admin_get(&s.gw, bad, &[auth]).await;
        assert_eq!(r.status, 400, "{bad}");
        assert_eq!(
            r.problem_type(),
            "urn:idemgate:problem:bad-request",
            "{bad}"
        );
    }
    let nowhere = admin_get(&s.gw, "/nowhere", &[]).await;
    assert_eq!(nowhere.status, 404);
    assert_eq!(nowhere.problem_type(), "urn:idemgate:problem:not-found");
    let admin = s.gw.admin;
    let post = send("POST", &format!("http://{admin}/metrics"), &[], "").await;
    assert_eq!(post.status, 405);
    assert_eq!(
        post.problem_type(),
        "urn:idemgate:problem:method-not-allowed"
    );
    assert_eq!(post.headers["allow"], "GET");
    let put = send(
        "PUT",
        &format!("http://{admin}/keys?route=default&key=k-m"),
        &[auth],
        "",
    )
    .await;
    assert_eq!(put.status, 405);
    assert_eq!(put.headers["allow"], "GET, DELETE");

    // The successful answers stay plain.
    let health = admin_get(&s.gw, "/healthz", &[]).await;
    assert_eq!(health.headers["content-type"], "text/plain; charset=utf-8");
    assert_eq!(health.text(), "ok\n");
    assert_eq!(ok.headers["content-type"], "application/json");
}

#[tokio::test(flavor = "multi_thread")]
async fn record_endpoints_are_off_without_a_token() {
    let upstream = TestUpstream::start().await;
    let gw = Gateway::start(&["--upstream", &upstream.url(), "--store", "memory"]);
    let r = admin_get(
        &gw,
        &format!("/records/{}", "0".repeat(64)),
        &[("authorization", "Bearer x")],
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.problem_type(), "urn:idemgate:problem:not-found");
    assert!(
        r.json()["detail"]
            .as_str()
            .is_some_and(|d| d.contains("admin_token")),
        "{}",
        r.text()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn json_logs_are_one_object_per_line() {
    let upstream = TestUpstream::start().await;
    let gw = Gateway::start(&[
        "--upstream",
        &upstream.url(),
        "--store",
        "memory",
        "--log-format",
        "json",
    ]);
    send("POST", &gw.url("/j"), &[key("k-json")], "x").await;
    let line = eventually(40, || async {
        gw.logs()
            .lines()
            .find(|l| l.contains("\"outcome\":\"executed\""))
            .map(str::to_owned)
    })
    .await
    .unwrap_or_else(|| panic!("no JSON request line in\n{}", gw.logs()));
    let v: serde_json::Value = serde_json::from_str(&line).expect("one JSON object per line");
    assert_eq!(v["fields"]["route"], "default");
    assert_eq!(v["fields"]["status"], 201);
    assert!(
        v["fields"]["record"]
            .as_str()
            .is_some_and(|r| r.len() == 16)
    );
}

/// An upstream on 127.0.0.1 that answers each request's head at once (`200`, chunked) and
/// then sends back every body byte as it reads it, ending the response when it has read
/// `Content-Length` bytes: one that answers while it reads. Returns its address.
async fn answering_while_reading() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut piece = vec![0u8; 64 * 1024];
                let end = loop {
                    if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break end + 4;
                    }
                    match stream.read(&mut piece).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&piece[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                let length: usize = head
                    .lines()
                    .find_map(|line| line.strip_prefix("content-length: "))
                    .and_then(|n| n.trim().parse().ok())
                    .unwrap_or(0);
                let mut out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
                let mut echo = buf.split_off(end);
                let mut read = echo.len();
                loop {
                    if !echo.is_empty() {
                        out.extend_from_slice(format!("{:x}\r\n", echo.len()).as_bytes());
                        out.extend_from_slice(&echo);
                        out.extend_from_slice(b"\r\n");
                    }
                    if read >= length {
                        out.extend_from_slice(b"0\r\n\r\n");
                    }
                    if stream.write_all(&out).await.is_err() || read >= length {
                        return;
                    }
                    out.clear();
                    let n = match stream.read(&mut piece).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    read += n;
                    echo = piece[..n].to_vec();
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_upstream_that_answers_while_it_reads_gets_the_whole_body() {
    let upstream = answering_while_reading().await;
    let url = format!("http://{upstream}");
    let gw = Gateway::start(&["--upstream", &url, "--store", "memory"]);
    // 8 MiB: far more than the loopback socket buffers take before the upstream answers.
    let body: String = (0..8 * 1024 * 1024)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    // Streamed through, with no key; then kept, with one (within the 10 MiB limits).
    for headers in [vec![], vec![key("k-echo")]] {
        let r = send("POST", &gw.url("/echo"), &headers, &body).await;
        assert_eq!(r.status, 200, "{headers:?}");
        assert!(r.body == body.as_bytes(), "the upstream had the whole body");
    }
    let replay = send("POST", &gw.url("/echo"), &[key("k-echo")], &body).await;
    assert!(replay.replayed());
    assert!(replay.body == body.as_bytes());
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upstream_connection_idle_past_upstream_idle_timeout_is_not_used_again() {
    let s = setup_with(r#"upstream_idle_timeout = "200ms""#).await;
    for path in ["/a", "/b", "/c", "/d", "/e"] {
        assert_eq!(send("POST", &s.gw.url(path), &[], "x").await.status, 201);
    }
    // Back to back, the connection is used again (slack for one that reaches the pool only
    // just after its response went out).
    let kept = s.upstream.connections();
    assert!(kept <= 2, "{kept} connections for five sequential requests");
    // Closed after 100 to 200 ms idle (well before the 2 s the default keeps it at least).
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(send("POST", &s.gw.url("/f"), &[], "x").await.status, 201);
    assert_eq!(s.upstream.connections(), kept + 1);
}
