//! A real PostgreSQL server for tests: one per test, in a temporary directory, on a free
//! loopback port with a private socket directory, stopped (by its own pid) when dropped, and
//! able to be stopped and started again on the same port for fault tests.
//!
//! `initdb` takes a few seconds, starting a server a tenth of one; so `initdb` runs once,
//! into a template data directory kept in the system's temporary directory (reused by later
//! runs of the same PostgreSQL version), and each server starts on a copy of it. A server per test,
//! rather than a database per test on one shared server, because a shared server would
//! outlive the test binary (nothing drops a static), and the fault tests stop theirs anyway.
//!
//! PostgreSQL refuses to run as root: as root, the data directory is handed to `nobody` and
//! the binaries run under `setpriv` as `nobody`, which (through `env`) `exec`s them, so the pid
//! we hold is the server's own. Binaries are found on `PATH` or in `/usr/lib/postgresql/*/bin` (where
//! Debian puts `initdb`).

use crate::free_port;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How long a freshly started server may take to accept connections.
const READY_WITHIN: Duration = Duration::from_secs(20);
/// How long a stopped server may take to exit before it is killed.
const STOP_WITHIN: Duration = Duration::from_secs(10);
/// The unprivileged account the server runs as when the tests run as root.
const UNPRIVILEGED: (&str, &str) = ("nobody", "nogroup");

/// A `postgres` child process owned by one test.
#[derive(Debug)]
pub struct PostgresServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    env: Vec<(String, String)>,
}

impl PostgresServer {
    /// Starts a server with the test defaults.
    pub fn start() -> Self {
        Self::start_with_env(&[])
    }

    /// Starts a server whose processes get `env` (e.g. libfaketime's variables).
    pub fn start_with_env(env: &[(&str, &str)]) -> Self {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idemgate-pg-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("socket")).expect("create a temp dir for postgres");
        copy_dir(template(), &dir.join("data"));
        hand_over(&dir);
        let mut server = Self {
            child: None,
            port: 0,
            dir,
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        };
        // Another process can take the port between our probe and the server's bind; try a
        // few fresh ports before giving up.
        for _ in 0..5 {
            server.port = free_port();
            if server.spawn() {
                return server;
            }
        }
        panic!(
            "postgres did not start; its log:\n{}",
            std::fs::read_to_string(server.dir.join("postgres.log")).unwrap_or_default()
        );
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres?sslmode=disable`.
    pub fn url(&self) -> String {
        self.url_for("postgres")
    }

    /// The URL of database `dbname` on this server.
    pub fn url_for(&self, dbname: &str) -> String {
        local_url(self.port, dbname)
    }

    /// The port the server listens on (kept across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server's (the postmaster's) process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the server with a fast shutdown (SIGINT: sessions are ended, nothing is lost)
    /// and waits for it to exit, killing it if it takes too long.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .arg("-INT")
            .arg(child.id().to_string())
            .status();
        let deadline = Instant::now() + STOP_WITHIN;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// Starts the server again on the same port and data after [`stop`](Self::stop).
    pub fn restart(&mut self) {
        self.stop();
        assert!(
            self.spawn(),
            "postgres did not restart on port {}; its log is {}",
            self.port,
            self.dir.join("postgres.log").display()
        );
    }

    /// Runs `postgres` on `self.port`; true once it accepts connections, false if it exited.
    fn spawn(&mut self) -> bool {
        let log_path = self.dir.join("postgres.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .expect("open the postgres log");
        let logged_before = std::fs::metadata(&log_path).map_or(0, |m| m.len());
        let mut command = unprivileged(&binary("postgres"), &self.env);
        command
            .arg("-D")
            .arg(self.dir.join("data"))
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(self.dir.join("socket"))
            .args(["-c", "listen_addresses=127.0.0.1"])
            // A test server: no durability needed, little memory, room for the race checks'
            // pools.
            .args(["-c", "fsync=off", "-c", "synchronous_commit=off"])
            .args(["-c", "full_page_writes=off", "-c", "shared_buffers=16MB"])
            .args(["-c", "max_connections=100"])
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run postgres: {e}"));
        self.child = Some(child);
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let ready = crate::wait_until_ready(&mut self.child, READY_WITHIN, || {
            std::fs::read(&log_path).is_ok_and(|l| {
                String::from_utf8_lossy(&l[logged_before.min(l.len() as u64) as usize..])
                    .contains("ready to accept connections")
            }) && TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
        });
        if !ready {
            self.stop();
        }
        ready
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The template data directory, made by `initdb` once (per PostgreSQL version, kept across
/// runs in the system's temporary directory), owned by the account the servers run as.
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let initdb = binary("initdb");
        let version = Command::new(&initdb)
            .arg("--version")
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", initdb.display()));
        let version = String::from_utf8_lossy(&version.stdout);
        let version: String = version
            .trim()
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let cache = std::env::temp_dir().join("idemgate-test-servers");
        let template = cache.join(format!("idemgate-pg-template-{version}-{}", whoami()));
        if template.join("PG_VERSION").exists() {
            return template;
        }
        // initdb writes as the server's account, into a directory that account can reach.
        let scratch =
            std::env::temp_dir().join(format!("idemgate-pg-initdb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&scratch);
        std::fs::create_dir_all(&scratch).expect("create a scratch dir for initdb");
        hand_over(&scratch);
        let output = unprivileged(&initdb, &[])
            .arg("-D")
            .arg(scratch.join("data"))
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C"])
            .args(["--no-sync", "--no-instructions"])
            .current_dir(&scratch)
            .output()
            .unwrap_or_else(|e| panic!("cannot run initdb: {e}"));
        assert!(
            output.status.success(),
            "initdb failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        // Another test binary may be making the same template: each copies its own under a
        // unique name and renames it into place; the first rename wins.
        std::fs::create_dir_all(&cache).expect("create the template's directory");
        let unique = cache.join(format!(
            "idemgate-pg-template-{}.partial",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&unique);
        copy_dir(&scratch.join("data"), &unique);
        let _ = std::fs::remove_dir_all(&scratch);
        if std::fs::rename(&unique, &template).is_err() {
            let _ = std::fs::remove_dir_all(&unique);
        }
        assert!(
            template.join("PG_VERSION").exists(),
            "no template data directory at {}",
            template.display()
        );
        template
    })
}

/// `cp -a`: keeps modes and (as root) owners, which PostgreSQL checks on its data directory.
fn copy_dir(from: &Path, to: &Path) {
    let status = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .expect("run cp");
    assert!(
        status.success(),
        "cp -a {} {} failed",
        from.display(),
        to.display()
    );
}

fn is_root() -> bool {
    whoami() == "0"
}

/// This process's user id, from `id -u` (the tests forbid `unsafe`, so no `getuid`).
fn whoami() -> &'static str {
    static UID: OnceLock<String> = OnceLock::new();
    UID.get_or_init(|| {
        let out = Command::new("id").arg("-u").output().expect("run id -u");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    })
}

/// Gives `dir` (recursively) to the account the server runs as, when that is not us.
fn hand_over(dir: &Path) {
    if !is_root() {
        return;
    }
    let status = Command::new("chown")
        .arg("-R")
        .arg(format!("{}:{}", UNPRIVILEGED.0, UNPRIVILEGED.1))
        .arg(dir)
        .status()
        .expect("run chown");
    assert!(status.success(), "chown -R {} failed", dir.display());
}

/// A command that runs `program` as this user, or as `nobody` when this user is root, with
/// `env` added to its environment by `env(1)` after the change of user (so that a preloaded
/// library, libfaketime say, starts in the server's own account, not in root's `setpriv`).
/// `setpriv` and `env` both `exec`, so the child's pid is `program`'s.
fn unprivileged(program: &Path, env: &[(String, String)]) -> Command {
    let mut command = if is_root() {
        let mut command = Command::new("setpriv");
        command
            .arg(format!("--reuid={}", UNPRIVILEGED.0))
            .arg(format!("--regid={}", UNPRIVILEGED.1))
            .arg("--clear-groups")
            .arg("env");
        command
    } else {
        Command::new("env")
    };
    command
        .args(env.iter().map(|(k, v)| format!("{k}={v}")))
        .arg(program);
    command
}

/// `name` on `PATH`, or else in the newest `/usr/lib/postgresql/*/bin` (Debian's place).
fn binary(name: &str) -> PathBuf {
    if let Some(found) = on_path(name) {
        return found;
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse().ok()?;
            let path = entry.path().join("bin").join(name);
            path.is_file().then_some((version, path))
        })
        .collect();
    versions.sort();
    match versions.pop() {
        Some((_, path)) => path,
        None if std::env::var_os("CI").is_some() => panic!(
            "{name} is not on PATH nor in /usr/lib/postgresql/*/bin in CI: the PostgreSQL store \
             tests need it; the CI job must run .ci/install-deps before the tests"
        ),
        None => panic!(
            "{name} is not on PATH nor in /usr/lib/postgresql/*/bin: run .ci/install-deps \
             (installs Debian's postgresql)"
        ),
    }
}

/// PgBouncer (Debian's `pgbouncer`) in front of one [`PostgresServer`], in a temporary
/// directory, on a free loopback port, stopped (by its own pid) when dropped. As root it runs
/// as `nobody`, as the server does.
#[derive(Debug)]
pub struct PgBouncer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

impl PostgresServer {
    /// Starts PgBouncer in front of this server with `pool_mode` (`session`, `transaction`)
    /// and `ignore_startup_parameters` set to `ignore` (empty: none).
    pub fn pgbouncer(&self, pool_mode: &str, ignore: &str) -> PgBouncer {
        let dir = self.dir.join("pgbouncer");
        std::fs::create_dir_all(&dir).expect("create pgbouncer's directory");
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").expect("write users.txt");
        for _ in 0..5 {
            let port = free_port();
            let ini = format!(
                "[databases]\n* = host=127.0.0.1 port={server}\n\
                 [pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
                 unix_socket_dir =\nauth_type = trust\nauth_file = {users}\n\
                 pool_mode = {pool_mode}\nignore_startup_parameters = {ignore}\n\
                 logfile = {log}\n",
                server = self.port,
                users = dir.join("users.txt").display(),
                log = dir.join("pgbouncer.log").display(),
            );
            std::fs::write(dir.join("pgbouncer.ini"), ini).expect("write pgbouncer.ini");
            hand_over(&dir);
            let child = unprivileged(&pgbouncer_binary(), &[])
                .arg(dir.join("pgbouncer.ini"))
                .current_dir(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("cannot run pgbouncer: {e}"));
            let mut bouncer = PgBouncer {
                child: Some(child),
                port,
                dir: dir.clone(),
            };
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            if crate::wait_until_ready(&mut bouncer.child, READY_WITHIN, || {
                TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
            }) {
                return bouncer;
            }
        }
        panic!(
            "pgbouncer did not start; its log:\n{}",
            std::fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default()
        );
    }
}

impl PgBouncer {
    /// `postgres://postgres@127.0.0.1:PORT/postgres?sslmode=disable`, through PgBouncer.
    pub fn url(&self) -> String {
        local_url(self.port, "postgres")
    }

    /// What PgBouncer logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `pgbouncer` on `PATH`, or in `/usr/sbin` (Debian's place, off a user's `PATH`).
fn pgbouncer_binary() -> PathBuf {
    let found = on_path("pgbouncer").unwrap_or_else(|| PathBuf::from("/usr/sbin/pgbouncer"));
    assert!(
        found.is_file(),
        "pgbouncer is not on PATH nor in /usr/sbin: run .ci/install-deps (installs Debian's \
         pgbouncer)"
    );
    found
}

/// `name` in a directory of `PATH`, if there.
fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    })
}

/// The URL of database `dbname` as `postgres`, without TLS, on loopback port `port`.
fn local_url(port: u16, dbname: &str) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/{dbname}?sslmode=disable")
}
