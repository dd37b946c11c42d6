//! Helpers for `idemgate consume` end to end: a handler on 127.0.0.1 that counts the runs of
//! each event, the consumer as a child process (killed by its own pid on drop), and a
//! producer writing to a real Redis stream.

#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use redis::aio::MultiplexedConnection;
use tokio::net::TcpListener;

/// What the handler answers to one run: a status after a delay.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Reply {
    pub(crate) status: u16,
    pub(crate) delay: Duration,
}

impl Reply {
    pub(crate) fn ok() -> Self {
        Self {
            status: 200,
            delay: Duration::ZERO,
        }
    }

    pub(crate) fn status(status: u16) -> Self {
        Self {
            status,
            delay: Duration::ZERO,
        }
    }

    pub(crate) fn after(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

/// Chooses the reply from the event's key and how many times it has run (this run counted).
pub(crate) type Behaviour = Arc<dyn Fn(&str, u64) -> Reply + Send + Sync>;

/// An HTTP handler on 127.0.0.1 that counts how many times each event ran (by the key in
/// `Idempotency-Key`).
pub(crate) struct Handler {
    pub(crate) addr: SocketAddr,
    runs: Arc<Mutex<HashMap<String, u64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Handler {
    pub(crate) async fn start(
        behaviour: impl Fn(&str, u64) -> Reply + Send + Sync + 'static,
    ) -> Self {
        let behaviour: Behaviour = Arc::new(behaviour);
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the handler");
        let addr = listener.local_addr().unwrap();
        let runs = Arc::new(Mutex::new(HashMap::new()));
        let shared = Arc::clone(&runs);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let runs = Arc::clone(&shared);
                let behaviour = Arc::clone(&behaviour);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        handle(Arc::clone(&runs), Arc::clone(&behaviour), req)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { addr, runs, task }
    }

    /// The handler's URL at `/handle`.
    pub(crate) fn url(&self) -> String {
        format!("http://{}/handle", self.addr)
    }

    /// Runs of each event so far.
    pub(crate) fn runs(&self) -> HashMap<String, u64> {
        self.runs.lock().unwrap().clone()
    }

    pub(crate) fn runs_of(&self, key: &str) -> u64 {
        self.runs.lock().unwrap().get(key).copied().unwrap_or(0)
    }

    pub(crate) fn total_runs(&self) -> u64 {
        self.runs.lock().unwrap().values().sum()
    }
}

impl Drop for Handler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn handle(
    runs: Arc<Mutex<HashMap<String, u64>>>,
    behaviour: Behaviour,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let _body = req.into_body().collect().await?;
    let n = {
        let mut runs = runs.lock().unwrap();
        let n = runs.entry(key.clone()).or_insert(0);
        *n += 1;
        *n
    };
    let reply = behaviour(&key, n);
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    let mut response = Response::new(Full::new(Bytes::from(format!("{{\"run\":{n}}}"))));
    *response.status_mut() = StatusCode::from_u16(reply.status).unwrap();
    Ok(response)
}

/// A directory removed on drop.
pub(crate) struct TempDir(pub(crate) PathBuf);

impl TempDir {
    pub(crate) fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idemgate-consume-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub(crate) fn write(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_owned()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `idemgate consume` child process (or, from [`Consumer::start_proxy`], the proxy).
pub(crate) struct Consumer {
    child: Child,
    pub(crate) admin: SocketAddr,
    /// Where the proxy listens, when this is one.
    proxy: Option<SocketAddr>,
    logs: Arc<Mutex<String>>,
}

/// The `idemgate` command with no `IDEMGATE_*` variable from the host.
pub(crate) fn idemgate() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    for (var, _) in std::env::vars_os() {
        if var.to_string_lossy().starts_with("IDEMGATE_") {
            cmd.env_remove(var);
        }
    }
    cmd
}

impl Consumer {
    /// Starts `idemgate --admin-listen 127.0.0.1:0 ARGS…` and waits for its
    /// `idemgate consuming … admin ADDR` line.
    pub(crate) fn start(args: &[&str]) -> Self {
        Self::start_announcing("idemgate consuming ", args, &[])
    }

    /// [`Consumer::start`] with `env` set for the process.
    pub(crate) fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_announcing("idemgate consuming ", args, env)
    }

    /// Starts the proxy, `idemgate --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 ARGS…`,
    /// and waits for its `idemgate listening on ADDR admin ADDR` line; [`Consumer::proxy`]
    /// is where it listens.
    pub(crate) fn start_proxy(args: &[&str]) -> Self {
        let mut all = vec!["--listen", "127.0.0.1:0"];
        all.extend_from_slice(args);
        Self::start_announcing("idemgate listening on ", &all, &[])
    }

    fn start_announcing(announcement: &'static str, args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut cmd = idemgate();
        cmd.args(["--admin-listen", "127.0.0.1:0"]).args(args);
        cmd.envs(env.iter().copied());
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn idemgate consume");
        let stderr = child.stderr.take().unwrap();
        let logs = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&logs);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix(announcement)
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(rest.to_owned());
                }
                let mut logs = sink.lock().unwrap();
                logs.push_str(&line);
                logs.push('\n');
            }
        });
        let Ok(line) = rx.recv_timeout(Duration::from_secs(30)) else {
            let _ = child.kill();
            let _ = child.wait();
            std::thread::sleep(Duration::from_millis(100));
            panic!("idemgate consume did not start:\n{}", logs.lock().unwrap());
        };
        let (served, admin) = line.rsplit_once(" admin ").expect("ADDR admin ADDR");
        Self {
            child,
            admin: admin.trim().parse().expect("the admin address"),
            proxy: served.trim().parse().ok(),
            logs,
        }
    }

    /// `POST`s `body` (JSON) with `key` to the proxy's `path`: the status and whether the
    /// answer was a replay.
    pub(crate) async fn post(&self, path: &str, key: &str, body: &str) -> (u16, bool) {
        let addr = self.proxy.expect("a proxy");
        let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let req = Request::post(path)
            .header("host", "proxy")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        let response = sender.send_request(req).await.unwrap();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        let status = response.status().as_u16();
        let _ = response.into_body().collect().await;
        (status, replayed)
    }

    pub(crate) fn logs(&self) -> String {
        self.logs.lock().unwrap().clone()
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL, and wait for it.
    pub(crate) fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, by this child's pid.
    pub(crate) fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success());
    }

    pub(crate) fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The admin listener's `/metrics` text.
    pub(crate) async fn metrics(&self) -> String {
        let stream = tokio::net::TcpStream::connect(self.admin).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .unwrap();
        tokio::spawn(conn);
        let req = Request::get("/metrics")
            .header("host", "admin")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let response = sender.send_request(req).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8_lossy(&body).into_owned()
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The value of the series `name` (with its labels, as rendered) in a `/metrics` text.
pub(crate) fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        line.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// A connection to the Redis at `url`.
pub(crate) async fn redis(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the test Redis")
}

/// A connection to the TLS-only Redis at `url` (`rediss://`), trusting the CA in `ca`.
pub(crate) async fn redis_tls(url: &str, ca: &std::path::Path) -> MultiplexedConnection {
    let certificates = redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(std::fs::read(ca).expect("read the test CA")),
    };
    redis::Client::build_with_tls(url, certificates)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the test Redis over TLS")
}

/// Appends one entry with `fields` to `stream`.
pub(crate) async fn produce(
    conn: &mut MultiplexedConnection,
    stream: &str,
    fields: &[(&str, &str)],
) {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (k, v) in fields {
        cmd.arg(*k).arg(*v);
    }
    let _: String = cmd.query_async(conn).await.expect("XADD");
}

/// An event with id `id`: its `event_id` field and a JSON payload.
pub(crate) async fn produce_event(conn: &mut MultiplexedConnection, stream: &str, id: &str) {
    let payload = format!("{{\"id\":\"{id}\",\"amount\":42}}");
    produce(conn, stream, &[("event_id", id), ("payload", &payload)]).await;
}

/// The group's `pending` and `lag` (XINFO GROUPS), once the group exists.
pub(crate) async fn backlog(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
) -> Option<(u64, u64)> {
    let groups: redis::Value = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .query_async(conn)
        .await
        .ok()?;
    let redis::Value::Array(groups) = groups else {
        return None;
    };
    groups.iter().find_map(|g| {
        let fields: HashMap<String, redis::Value> = redis::from_redis_value(g.clone()).ok()?;
        let name: String = redis::from_redis_value(fields.get("name")?.clone()).ok()?;
        if name != group {
            return None;
        }
        let pending: u64 = redis::from_redis_value(fields.get("pending")?.clone()).ok()?;
        let lag: u64 = redis::from_redis_value(fields.get("lag")?.clone()).unwrap_or(u64::MAX);
        Some((pending, lag))
    })
}

/// Entries pending on consumer `consumer` of `group` (none before the group exists).
pub(crate) async fn pending_on(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
    consumer: &str,
) -> u64 {
    let Ok(reply) = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .query_async::<redis::Value>(conn)
        .await
    else {
        return 0;
    };
    let redis::Value::Array(parts) = reply else {
        return 0;
    };
    let Some(redis::Value::Array(consumers)) = parts.get(3) else {
        return 0;
    };
    consumers
        .iter()
        .find_map(|c| {
            let (name, count): (String, String) = redis::from_redis_value(c.clone()).ok()?;
            (name == consumer).then(|| count.parse().unwrap_or(0))
        })
        .unwrap_or(0)
}

/// Waits (at most `limit`) until the group has read every entry and acknowledged it.
pub(crate) async fn wait_settled(
    conn: &mut MultiplexedConnection,
    stream: &str,
    group: &str,
    limit: Duration,
) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if backlog(conn, stream, group).await == Some((0, 0)) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Every entry of `stream` as its fields.
pub(crate) async fn entries(
    conn: &mut MultiplexedConnection,
    stream: &str,
) -> Vec<HashMap<String, String>> {
    let reply: redis::Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(conn)
        .await
        .expect("XRANGE");
    let items: Vec<(String, HashMap<String, String>)> =
        redis::from_redis_value(reply).expect("XRANGE entries");
    items.into_iter().map(|(_, fields)| fields).collect()
}

/// The consumer's `/metrics` once `series` reads `value` (its counters move just after each
/// acknowledgement), or as it is after 5 s.
pub(crate) async fn metrics_once(consumer: &Consumer, series: &str, value: f64) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = consumer.metrics().await;
        if metric(&text, series) == Some(value) || Instant::now() > deadline {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
