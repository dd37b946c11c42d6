//! End-to-end helpers for the `idemgate` binary: a real upstream on 127.0.0.1, the gateway as
//! a child process (killed on drop), an HTTP client and raw-socket requests.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Environment variables the gateway reads; removed from every child so the host's
/// environment cannot change a test.
const GATEWAY_ENV: [&str; 10] = [
    "IDEMGATE_CONFIG",
    "IDEMGATE_UNDERSCORES_IN_HEADERS",
    "IDEMGATE_LISTEN",
    "IDEMGATE_UPSTREAM",
    "IDEMGATE_STORE",
    "IDEMGATE_TTL",
    "IDEMGATE_ADMIN_LISTEN",
    "IDEMGATE_ADMIN_TOKEN",
    "IDEMGATE_LOG_FORMAT",
    "IDEMGATE_LOG",
];

/// A directory under the system temp dir, removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idemgate-proxy-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        Self(dir)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }

    pub(crate) fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, contents).expect("write temp file");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What the test upstream saw.
#[derive(Default)]
pub(crate) struct UpstreamState {
    /// Requests that reached the handler, by path.
    hits: Mutex<HashMap<String, u64>>,
    /// Requests that finished (their response was written to hyper).
    finished: AtomicU64,
    /// Headers of the last request.
    last_headers: Mutex<Option<HeaderMap>>,
    /// Connections accepted.
    connections: AtomicU64,
    /// Request bodies that reached the handler, those of up to 64 KiB.
    bodies: Mutex<Vec<Bytes>>,
}

/// An HTTP/1.1 upstream on 127.0.0.1 that counts executions and echoes what it received.
///
/// - `x-delay-ms: N` makes it wait N ms before answering (not part of any fingerprint).
/// - `/status/NNN` or `x-status: NNN` answers with status NNN; everything else answers `201`.
/// - `/spoof…` adds hop-by-hop headers and a forged `Idempotent-Replayed: true`.
/// - `/stream…` answers its JSON in 3 chunks with no length (chunked on the wire).
/// - `x-size: N` answers N bytes of `a` instead of the JSON, in 64 KiB frames.
/// - `/close…` answers with `Connection: close` (the connection ends after the response).
/// - The body is JSON: `{"path", "n" (hits on this path so far), "body_len", "headers"}`.
pub(crate) struct TestUpstream {
    pub(crate) addr: SocketAddr,
    pub(crate) state: Arc<UpstreamState>,
    task: tokio::task::JoinHandle<()>,
}

impl TestUpstream {
    pub(crate) async fn start() -> Self {
        Self::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    pub(crate) async fn start_on(addr: SocketAddr) -> Self {
        let listener = TcpListener::bind(addr).await.expect("bind upstream");
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(UpstreamState::default());
        let shared = Arc::clone(&state);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                shared.connections.fetch_add(1, Ordering::SeqCst);
                let state = Arc::clone(&shared);
                tokio::spawn(async move {
                    let service =
                        hyper::service::service_fn(move |req| handle(Arc::clone(&state), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { addr, state, task }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Connections the upstream accepted.
    pub(crate) fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// Requests that reached the handler on `path`.
    pub(crate) fn hits(&self, path: &str) -> u64 {
        self.state
            .hits
            .lock()
            .unwrap()
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    /// Waits (polling, at most 5 s) until one request has reached the handler on `path`;
    /// panics if none does.
    pub(crate) async fn wait_for_hit(&self, path: &str) {
        eventually(100, || async { (self.hits(path) == 1).then_some(()) })
            .await
            .unwrap_or_else(|| panic!("no request on {path} reached the upstream"));
    }

    /// Requests that reached the handler on any path.
    pub(crate) fn total_hits(&self) -> u64 {
        self.state.hits.lock().unwrap().values().sum()
    }

    /// How many requests that reached the handler had exactly this body (of up to 64 KiB).
    pub(crate) fn times_seen(&self, body: &[u8]) -> usize {
        self.state
            .bodies
            .lock()
            .unwrap()
            .iter()
            .filter(|seen| seen.as_ref() == body)
            .count()
    }

    pub(crate) fn finished(&self) -> u64 {
        self.state.finished.load(Ordering::SeqCst)
    }

    pub(crate) fn last_headers(&self) -> HeaderMap {
        self.state
            .last_headers
            .lock()
            .unwrap()
            .clone()
            .expect("the upstream saw a request")
    }

    pub(crate) fn stop(self) {
        self.task.abort();
    }
}

impl Drop for TestUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(
    state: Arc<UpstreamState>,
    req: Request<Incoming>,
) -> Result<Response<Frames>, hyper::Error> {
    let path = req.uri().path().to_owned();
    let n = {
        let mut hits = state.hits.lock().unwrap();
        let n = hits.entry(path.clone()).or_insert(0);
        *n += 1;
        *n
    };
    *state.last_headers.lock().unwrap() = Some(req.headers().clone());
    let delay = req
        .headers()
        .get("x-delay-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let size = req
        .headers()
        .get("x-size")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let req_status = req
        .headers()
        .get("x-status")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let headers: serde_json::Map<String, serde_json::Value> = req
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("?").into()))
        .collect();
    let body = req.into_body().collect().await?.to_bytes();
    if body.len() <= 64 * 1024 {
        state.bodies.lock().unwrap().push(body.clone());
    }
    if let Some(ms) = delay {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let wanted = req_status.or_else(|| path.strip_prefix("/status/").map(str::to_owned));
    let status = wanted
        .as_deref()
        .and_then(|s| s.parse::<u16>().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED);
    let json =
        serde_json::json!({ "path": path, "n": n, "body_len": body.len(), "headers": headers });
    let json = Bytes::from(json.to_string());
    let frames = if let Some(size) = size {
        let all = Bytes::from(vec![b'a'; size]);
        let frames = (0..size)
            .step_by(64 * 1024)
            .map(|at| all.slice(at..size.min(at + 64 * 1024)));
        Frames::sized(frames.collect())
    } else if path.starts_with("/stream") {
        let third = json.len() / 3;
        Frames::unknown_length(vec![
            json.slice(..third),
            json.slice(third..2 * third),
            json.slice(2 * third..),
        ])
    } else {
        Frames::sized(vec![json])
    };
    let mut response = Response::new(frames);
    *response.status_mut() = status;
    let h = response.headers_mut();
    h.insert("content-type", HeaderValue::from_static("application/json"));
    h.insert("x-upstream-n", HeaderValue::from(n));
    if path.starts_with("/close") {
        h.insert("connection", HeaderValue::from_static("close"));
    }
    if path.starts_with("/spoof") {
        h.insert("idempotent-replayed", HeaderValue::from_static("true"));
        h.insert("connection", HeaderValue::from_static("x-internal"));
        h.insert("x-internal", HeaderValue::from_static("secret"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("proxy-authenticate", HeaderValue::from_static("Basic"));
        h.insert("x-end-to-end", HeaderValue::from_static("kept"));
    }
    state.finished.fetch_add(1, Ordering::SeqCst);
    Ok(response)
}

/// A response body sent frame by frame, with its length (a `Content-Length`) or without
/// (chunked on the wire).
pub(crate) struct Frames {
    frames: std::collections::VecDeque<Bytes>,
    sized: bool,
}

impl Frames {
    fn sized(frames: Vec<Bytes>) -> Self {
        Self {
            frames: frames.into(),
            sized: true,
        }
    }

    fn unknown_length(frames: Vec<Bytes>) -> Self {
        Self {
            frames: frames.into(),
            sized: false,
        }
    }
}

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(
            self.frames
                .pop_front()
                .map(|b| Ok(http_body::Frame::data(b))),
        )
    }

    fn size_hint(&self) -> http_body::SizeHint {
        if self.sized {
            http_body::SizeHint::with_exact(self.frames.iter().map(|b| b.len() as u64).sum())
        } else {
            http_body::SizeHint::default()
        }
    }
}

/// A free port on 127.0.0.1 with nothing listening (bound, then released).
pub(crate) fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// The gateway binary running as a child process; killed on drop.
pub(crate) struct Gateway {
    child: Child,
    pub(crate) addr: SocketAddr,
    pub(crate) admin: SocketAddr,
    logs: Arc<Mutex<String>>,
}

impl Gateway {
    /// Starts `idemgate` with `args`, listening on free ports, and waits for its first line.
    pub(crate) fn start(args: &[&str]) -> Self {
        Self::start_with(args, &[])
    }

    /// Starts `idemgate` in front of `upstream` on the store `store`, with `config` as its TOML
    /// file (written into `dir`), then `extra` arguments.
    pub(crate) fn start_configured(
        dir: &TempDir,
        upstream: &TestUpstream,
        store: &str,
        config: &str,
        extra: &[&str],
    ) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let file = dir.write(
            &format!("gateway-{}.toml", N.fetch_add(1, Ordering::Relaxed)),
            config,
        );
        let url = upstream.url();
        let mut args = vec![
            "--upstream",
            &url,
            "--store",
            store,
            "--config",
            file.to_str().expect("a UTF-8 temp path"),
        ];
        args.extend_from_slice(extra);
        Self::start(&args)
    }

    /// As [`Gateway::start`], with environment variables set on the child.
    pub(crate) fn start_with(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_command(gateway_command(), args, env)
    }

    /// Starts `cmd` (a [`gateway_command`] or [`gateway_command_after`]) as
    /// [`Gateway::start_with`] does.
    pub(crate) fn start_command(mut cmd: Command, args: &[&str], env: &[(&str, &str)]) -> Self {
        if !args.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        if !args.contains(&"--admin-listen") {
            cmd.args(["--admin-listen", "127.0.0.1:0"]);
        }
        cmd.args(args).envs(env.iter().copied());
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn idemgate");
        let stderr = child.stderr.take().unwrap();
        let logs = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let sink = Arc::clone(&logs);
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix("idemgate listening on ")
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(rest.to_owned());
                }
                let mut logs = sink.lock().unwrap();
                logs.push_str(&line);
                logs.push('\n');
            }
        });
        let line = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                std::thread::sleep(Duration::from_millis(100));
                panic!(
                    "idemgate did not start; its output:\n{}",
                    logs.lock().unwrap()
                );
            }
        };
        // "ADDR admin ADDR"
        let mut parts = line.split(" admin ");
        let addr = parts
            .next()
            .and_then(|a| a.trim().parse().ok())
            .expect("proxy address");
        let admin = parts
            .next()
            .and_then(|a| a.trim().parse().ok())
            .expect("admin address");
        Self {
            child,
            addr,
            admin,
            logs,
        }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The logs once they hold `needle`, waiting up to 5 s (they are read by a thread of the
    /// test, so the last lines come in a moment after they are written).
    pub(crate) async fn logs_with(&self, needle: &str) -> Option<String> {
        eventually(100, || async {
            let logs = self.logs();
            logs.contains(needle).then_some(logs)
        })
        .await
    }

    pub(crate) fn logs(&self) -> String {
        self.logs.lock().unwrap().clone()
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM to this child (by its pid).
    pub(crate) fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    /// Kills this child with SIGKILL (`kill -9`: no drain, no clean close) and waits for it.
    pub(crate) fn kill9(&mut self) -> ExitStatus {
        let _ = self.child.kill();
        self.child.wait().expect("wait for the killed idemgate")
    }

    /// Whether the child is still running.
    pub(crate) fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for the child to exit, at most `limit`.
    pub(crate) fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The gateway command with a clean `IDEMGATE_*` environment.
pub(crate) fn gateway_command() -> Command {
    without_gateway_env(Command::new(env!("CARGO_BIN_EXE_idemgate")))
}

fn without_gateway_env(mut cmd: Command) -> Command {
    for var in GATEWAY_ENV {
        cmd.env_remove(var);
    }
    cmd
}

/// The gateway command run by `bash`, which first runs the shell line `setup` and then execs
/// the gateway in its own process: the child's pid is the gateway's.
pub(crate) fn gateway_command_after(setup: &str) -> Command {
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(format!("{setup}; exec \"$0\" \"$@\""))
        .arg(env!("CARGO_BIN_EXE_idemgate"));
    without_gateway_env(cmd)
}

/// A response, read whole.
#[derive(Debug)]
pub(crate) struct Resp {
    pub(crate) status: u16,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Resp {
    pub(crate) fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub(crate) fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }

    /// The `type` of a problem+json body.
    pub(crate) fn problem_type(&self) -> String {
        assert_eq!(
            self.headers
                .get("content-type")
                .map(|v| v.to_str().unwrap()),
            Some("application/problem+json"),
            "not a problem response: {} {}",
            self.status,
            self.text()
        );
        self.json()["type"].as_str().unwrap_or_default().to_owned()
    }
}

/// The `Idempotency-Key` header with value `k`, for `send`'s header list.
pub(crate) fn key(k: &str) -> (&'static str, &str) {
    ("idempotency-key", k)
}

/// Sends one HTTP/1.1 request and reads the whole response.
pub(crate) async fn send(method: &str, url: &str, headers: &[(&str, &str)], body: &str) -> Resp {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    send_with(&client, method, url, headers, body).await
}

/// Sends one request over prior-knowledge HTTP/2 (h2c).
pub(crate) async fn send_h2c(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Resp {
    let client = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    send_with(&client, method, url, headers, body).await
}

/// As [`send`], but a request that fails (the connection refused or cut, as when the gateway
/// is killed) is an `Err` rather than a panic.
pub(crate) async fn try_send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Resp, String> {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    try_send_with(&client, method, url, headers, body).await
}

async fn send_with(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Resp {
    try_send_with(client, method, url, headers, body)
        .await
        .expect("request succeeds")
}

async fn try_send_with(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Result<Resp, String> {
    let mut req = Request::builder()
        .method(Method::from_bytes(method.as_bytes()).unwrap())
        .uri(url);
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(Full::new(Bytes::from(body.to_owned()))).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(30), client.request(req))
        .await
        .expect("response within 30s")
        .map_err(|e| format!("request failed: {e:?}"))?;
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map_err(|e| format!("reading the body failed: {e:?}"))?
        .to_bytes();
    Ok(Resp {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    })
}

/// Writes `request` on a fresh connection and reads until the server closes it (at most
/// 10 s). Returns everything read.
pub(crate) async fn raw(addr: SocketAddr, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads `GET` from the admin listener.
pub(crate) async fn admin_get(gw: &Gateway, path: &str, headers: &[(&str, &str)]) -> Resp {
    send("GET", &format!("http://{}{path}", gw.admin), headers, "").await
}

/// Waits (up to 5 s) until `/metrics` shows each of `lines` as a whole line; panics with the
/// metrics otherwise.
pub(crate) async fn assert_metrics_show(gw: &Gateway, lines: &[&str]) {
    let shown = eventually(100, || async {
        let text = admin_get(gw, "/metrics", &[]).await.text();
        lines
            .iter()
            .all(|line| text.lines().any(|l| l == *line))
            .then_some(())
    })
    .await;
    assert!(
        shown.is_some(),
        "expected {lines:?} in:\n{}",
        admin_get(gw, "/metrics", &[]).await.text()
    );
}

/// Polls `f` every 50 ms until it returns `Some`, at most `tries` times.
pub(crate) async fn eventually<T, F, Fut>(tries: usize, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    for _ in 0..tries {
        if let Some(v) = f().await {
            return Some(v);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}
