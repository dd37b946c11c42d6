//! A real `redis-server` for tests: started on a free loopback port with no persistence,
//! killed (by its own pid) when dropped, and able to be stopped, paused and restarted on the
//! same port for fault tests. [`RedisServer::start_tls`] starts one that speaks only TLS, with
//! a certificate from a test CA made by the `openssl` command.

use crate::free_port;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How long a freshly spawned server may take to answer PING.
const READY_WITHIN: Duration = Duration::from_secs(10);

/// A `redis-server` child process owned by one test.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra_args: Vec<String>,
    /// Serves TLS only, with the certificates in `dir`.
    tls: bool,
}

impl RedisServer {
    /// Starts a server with the test defaults.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Starts a server with extra command-line options, e.g.
    /// `["--maxmemory-policy", "allkeys-lru"]`.
    pub fn start_with(extra_args: &[&str]) -> Self {
        Self::start_serving(extra_args, false)
    }

    /// Starts a server that accepts only TLS connections, with a certificate for 127.0.0.1
    /// signed by a CA of its own ([`ca_file`](Self::ca_file)); clients need no certificate.
    pub fn start_tls() -> Self {
        Self::start_serving(&[], true)
    }

    fn start_serving(extra_args: &[&str], tls: bool) -> Self {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idemgate-redis-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create a temp dir for redis-server");
        let mut server = Self {
            child: None,
            port: 0,
            dir,
            extra_args: extra_args.iter().map(|s| (*s).to_owned()).collect(),
            tls,
        };
        if tls {
            make_certificates(&server.dir);
        }
        // Another process can take the port between our probe and redis-server's bind; try a
        // few fresh ports before giving up.
        for _ in 0..5 {
            server.port = free_port();
            if server.spawn() {
                return server;
            }
        }
        panic!(
            "redis-server did not start; its log is in {}",
            server.dir.display()
        );
    }

    /// `redis://127.0.0.1:PORT`, or `rediss://127.0.0.1:PORT` for a TLS server.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "rediss" } else { "redis" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// The PEM file of the CA that signed a TLS server's certificate.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// The port the server listens on (kept across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server (SIGKILL) and waits for it to exit; the port stays reserved in name
    /// only, for [`restart`](Self::restart).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port after [`stop`](Self::stop).
    pub fn restart(&mut self) {
        self.stop();
        assert!(
            self.spawn(),
            "redis-server did not restart on port {}; its log is in {}",
            self.port,
            self.dir.display()
        );
    }

    /// Freezes the server (SIGSTOP): connections stay open and nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws a [`pause`](Self::pause)d server (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.pid().expect("redis-server is not running");
        crate::signal(pid, signal);
    }

    /// Spawns redis-server on `self.port`; true once it answers PING, false if it exited.
    fn spawn(&mut self) -> bool {
        let log = self.dir.join("redis.log");
        let mut command = Command::new("redis-server");
        if self.tls {
            command
                .args(["--port", "0", "--tls-port"])
                .arg(self.port.to_string())
                .arg("--tls-cert-file")
                .arg(self.dir.join("server.crt"))
                .arg("--tls-key-file")
                .arg(self.dir.join("server.key"))
                .arg("--tls-ca-cert-file")
                .arg(self.ca_file())
                .args(["--tls-auth-clients", "no"]);
        } else {
            command.arg("--port").arg(self.port.to_string());
        }
        command
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(&log)
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = match command.spawn() {
            Ok(child) => child,
            Err(e) if e.kind() == ErrorKind::NotFound => missing_redis_server(),
            Err(e) => panic!("cannot run redis-server: {e}"),
        };
        self.child = Some(child);
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let tls = self.tls;
        let ready = crate::wait_until_ready(&mut self.child, READY_WITHIN, || {
            // A TLS server would need a handshake to PING: it is ready once it accepts and its
            // log says so (the log is new with each server).
            if tls {
                TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
                    && std::fs::read_to_string(&log)
                        .is_ok_and(|l| l.contains("Ready to accept connections"))
            } else {
                answers_ping(addr)
            }
        });
        if !ready {
            self.stop();
        }
        ready
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn missing_redis_server() -> ! {
    if std::env::var_os("CI").is_some() {
        panic!(
            "redis-server is not on PATH in CI: the Redis store tests need it; \
             the CI job must run .ci/install-deps before the tests"
        );
    }
    panic!("redis-server is not on PATH: run .ci/install-deps (installs Debian's redis-server)");
}

/// Writes `ca.crt`, and `server.crt` with `server.key` for 127.0.0.1 signed by it, into `dir`
/// with the `openssl` command (P-256 keys, valid for two days).
fn make_certificates(dir: &std::path::Path) {
    let openssl = |args: &[&str]| {
        let output = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run openssl ({e}): run .ci/install-deps (installs Debian's openssl)")
            });
        assert!(
            output.status.success(),
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    let key = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    let mut ca = vec![
        "req",
        "-x509",
        "-days",
        "2",
        "-subj",
        "/CN=idemgate test CA",
    ];
    ca.extend_from_slice(&key);
    ca.extend_from_slice(&["-keyout", "ca.key", "-out", "ca.crt"]);
    openssl(&ca);
    let mut request = vec!["req", "-subj", "/CN=127.0.0.1"];
    request.extend_from_slice(&key);
    request.extend_from_slice(&["-keyout", "server.key", "-out", "server.csr"]);
    openssl(&request);
    std::fs::write(dir.join("server.ext"), "subjectAltName=IP:127.0.0.1\n")
        .expect("write the certificate extensions");
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        "server.ext",
        "-out",
        "server.crt",
    ]);
}

pub(crate) fn answers_ping(addr: SocketAddr) -> bool {
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut reply = [0u8; 7];
    stream.read_exact(&mut reply).is_ok() && &reply == b"+PONG\r\n"
}
