//! A real Redis Cluster for tests: six `redis-server --cluster-enabled yes` on free loopback
//! ports in a temporary directory, joined by `redis-cli --cluster create … --cluster-replicas
//! 1` into three primaries with a replica each. Nodes can be killed (by their own pid) to make
//! a replica take over; every node still running is killed when the cluster is dropped.
//!
//! A cluster takes seconds to form, so a test binary may keep one in a static and share it
//! between tests. Nothing drops a static, so each cluster also starts a watchdog: a `sh` that
//! waits for its standard input, a pipe only this process holds, to close (the test binary
//! exited, however it ended), then kills the nodes it was given that still run as this
//! cluster's `redis-server` on their port (a pid reused by something else is left alone).

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::redis::answers_ping;

/// How many nodes: three primaries, one replica each.
const NODES: usize = 6;
/// How long a node may take to answer PING, and the cluster to say `cluster_state:ok`.
const READY_WITHIN: Duration = Duration::from_secs(30);
/// `cluster-node-timeout`: how long a primary may be unreachable before its replica takes
/// over. Short, so that failover tests are quick; long enough for a loaded 2-core machine.
pub const NODE_TIMEOUT: Duration = Duration::from_millis(2000);

/// A Redis Cluster of six `redis-server` child processes owned by one test (or test binary).
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<Node>,
    dir: PathBuf,
    /// Kills the nodes if this process ends without dropping the cluster; stopped first on
    /// drop.
    watchdog: Option<(Child, ChildStdin)>,
}

#[derive(Debug)]
struct Node {
    port: u16,
    child: Option<Child>,
}

impl RedisCluster {
    /// Starts six nodes and forms the cluster; returns once every node reports
    /// `cluster_state:ok`. Panics (after stopping what it started) if that takes longer than
    /// 30 seconds.
    pub fn start() -> Self {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "idemgate-redis-cluster-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create a temp dir for the cluster");
        let mut cluster = Self {
            nodes: Vec::with_capacity(NODES),
            dir,
            watchdog: None,
        };
        for _ in 0..NODES {
            let node = cluster.spawn_node();
            cluster.nodes.push(node);
        }
        cluster.start_watchdog();
        let addresses: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| match e.kind() {
                ErrorKind::NotFound => panic!(
                    "redis-cli is not on PATH: run .ci/install-deps (installs Debian's redis-tools)"
                ),
                _ => panic!("cannot run redis-cli: {e}"),
            });
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        cluster.wait_until_ok(READY_WITHIN);
        cluster
    }

    /// `redis-cluster://127.0.0.1:P1,127.0.0.1:P2,…`: every node, as the store takes it.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis-cluster://{}", nodes.join(","))
    }

    /// The ports of the nodes still running.
    pub fn running_ports(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| n.port)
            .collect()
    }

    /// The port of the primary that serves `slot` now, as a running node sees it.
    pub fn primary_of_slot(&self, slot: u16) -> u16 {
        self.slot_owners()[usize::from(slot)]
    }

    /// For each of the 16,384 slots, the port of the primary that serves it now (0 for a
    /// slot no running primary serves), from one `CLUSTER NODES`.
    pub fn slot_owners(&self) -> Vec<u16> {
        let mut owners = vec![0; 16384];
        for line in self.cluster_nodes().lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 9 || !fields[2].contains("master") || fields[2].contains("fail") {
                continue;
            }
            let port = address_port(fields[1]);
            for range in &fields[8..] {
                let (first, last) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(first), Ok(last)) = (first.parse::<usize>(), last.parse::<usize>()) {
                    owners[first..=last.min(16383)].fill(port);
                }
            }
        }
        owners
    }

    /// The ports of the primaries serving slots now.
    pub fn primaries(&self) -> Vec<u16> {
        self.cluster_nodes()
            .lines()
            .map(|line| line.split_whitespace().collect::<Vec<_>>())
            .filter(|f| f.len() > 8 && f[2].contains("master") && !f[2].contains("fail"))
            .map(|f| address_port(f[1]))
            .collect()
    }

    /// Waits until every replica of the primary on `port` is online and has received
    /// everything the primary has written (replication offsets equal), at most `within`.
    pub fn wait_replicated(&self, port: u16, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let info = self.cli(port, &["info", "replication"]);
            let field = |name: &str| {
                info.lines()
                    .find_map(|l| l.strip_prefix(name))
                    .map(|v| v.trim().to_owned())
            };
            let offset = field("master_repl_offset:");
            // A replica still in its first full sync shows the primary's offset too, but
            // acknowledges nothing until it is online.
            let replicas: Vec<String> = info
                .lines()
                .filter(|l| l.starts_with("slave") && l.contains("offset="))
                .filter(|l| l.contains("state=online"))
                .filter_map(|l| {
                    l.split(',')
                        .find_map(|kv| kv.strip_prefix("offset="))
                        .map(str::to_owned)
                })
                .collect();
            if !replicas.is_empty() && replicas.iter().all(|r| Some(r) == offset.as_ref()) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the replicas of 127.0.0.1:{port} did not catch up within {within:?}:\n{info}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills (SIGKILL) the node on `port` and waits for it to exit. Its replica (if it was a
    /// primary) takes over after [`NODE_TIMEOUT`]; see [`wait_until_ok`](Self::wait_until_ok).
    pub fn kill_node(&mut self, port: u16) {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.port == port)
            .unwrap_or_else(|| panic!("no node on port {port}"));
        if let Some(mut child) = node.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The ports of the replicas of the primary on `port`, as a running node sees them.
    pub fn replicas_of(&self, port: u16) -> Vec<u16> {
        let nodes = self.cluster_nodes();
        let lines: Vec<Vec<&str>> = nodes
            .lines()
            .map(|line| line.split_whitespace().collect())
            .filter(|f: &Vec<&str>| f.len() > 3)
            .collect();
        let Some(primary_id) = lines
            .iter()
            .find(|f| address_port(f[1]) == port)
            .map(|f| f[0])
        else {
            return Vec::new();
        };
        lines
            .iter()
            .filter(|f| f[2].contains("slave") && f[3] == primary_id)
            .map(|f| address_port(f[1]))
            .collect()
    }

    /// Freezes the node on `port` (SIGSTOP): its connections stay open, it answers nothing
    /// and takes no replication stream. Thawed by [`resume_node`](Self::resume_node); a node
    /// frozen past [`NODE_TIMEOUT`] is taken for failed by the others.
    pub fn pause_node(&self, port: u16) {
        self.signal_node(port, "-STOP");
    }

    /// Thaws a node [`pause_node`](Self::pause_node) froze (SIGCONT).
    pub fn resume_node(&self, port: u16) {
        self.signal_node(port, "-CONT");
    }

    fn signal_node(&self, port: u16, signal: &str) {
        let pid = self
            .nodes
            .iter()
            .find(|n| n.port == port)
            .and_then(|n| n.child.as_ref())
            .map(Child::id)
            .unwrap_or_else(|| panic!("no running node on port {port}"));
        crate::signal(pid, signal);
    }

    /// Runs `redis-cli -p PORT ARGS…` against a running node and returns its output.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        let output = Command::new("redis-cli")
            .arg("-p")
            .arg(port.to_string())
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Waits until every running node reports `cluster_state:ok` and agrees that every
    /// primary it lists is running (a failed-over primary replaced), at most `within`.
    pub fn wait_until_ok(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if self.is_ok() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the redis cluster was not ok within {within:?}; logs in {}:\n{}",
                self.dir.display(),
                self.cluster_nodes()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn is_ok(&self) -> bool {
        let running = self.running_ports();
        running.iter().all(|port| {
            if !self
                .cli(*port, &["cluster", "info"])
                .contains("cluster_state:ok")
            {
                return false;
            }
            // Every primary serving slots is one of ours that runs.
            self.cli(*port, &["cluster", "nodes"])
                .lines()
                .filter(|line| line.contains("master") && line.split_whitespace().count() > 8)
                .all(|line| {
                    let fields: Vec<&str> = line.split_whitespace().collect();
                    !fields[2].contains("fail") && running.contains(&address_port(fields[1]))
                })
        })
    }

    fn cluster_nodes(&self) -> String {
        self.running_ports()
            .first()
            .map(|port| self.cli(*port, &["cluster", "nodes"]))
            .unwrap_or_default()
    }

    /// Spawns one node on a free port whose cluster bus port (+10000) is free too.
    fn spawn_node(&mut self) -> Node {
        // Another process can take the port between our probe and redis-server's bind; try a
        // few fresh ports before giving up.
        for _ in 0..10 {
            let port = (0..1000)
                .find_map(|_| free_cluster_port())
                .expect("a free loopback port with a free cluster bus port");
            let dir = self.dir.join(port.to_string());
            std::fs::create_dir_all(&dir).expect("create a node's temp dir");
            let child = Command::new("redis-server")
                .arg("--port")
                .arg(port.to_string())
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout"])
                .arg(NODE_TIMEOUT.as_millis().to_string())
                .arg("--cluster-config-file")
                .arg(dir.join("nodes.conf"))
                .arg("--dir")
                .arg(&dir)
                .arg("--logfile")
                .arg(dir.join("redis.log"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn();
            let mut child = match child {
                Ok(child) => Some(child),
                Err(e) if e.kind() == ErrorKind::NotFound => {
                    panic!("redis-server is not on PATH: run .ci/install-deps")
                }
                Err(e) => panic!("cannot run redis-server: {e}"),
            };
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            if crate::wait_until_ready(&mut child, READY_WITHIN, || answers_ping(addr)) {
                return Node { port, child };
            }
            if let Some(mut child) = child {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        panic!(
            "redis-server (cluster node) did not start; logs in {}",
            self.dir.display()
        );
    }

    /// See the module docs: a `sh` that kills the nodes once this process lets go of its
    /// standard input.
    fn start_watchdog(&mut self) {
        let mut command = Command::new("sh");
        command.arg("-c").arg(
            r#"read _
for node in "$@"; do
  pid=${node%:*}; port=${node#*:}
  if tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null | grep -q "127.0.0.1:$port"; then
    kill -9 "$pid" 2>/dev/null
  fi
done"#,
        );
        command.arg("watchdog");
        for node in &self.nodes {
            if let Some(child) = &node.child {
                command.arg(format!("{}:{}", child.id(), node.port));
            }
        }
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run sh for the cluster's watchdog");
        let stdin = child.stdin.take().expect("the watchdog's stdin");
        self.watchdog = Some((child, stdin));
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        if let Some((mut watchdog, stdin)) = self.watchdog.take() {
            let _ = watchdog.kill();
            let _ = watchdog.wait();
            drop(stdin);
        }
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The port in `127.0.0.1:PORT@BUSPORT` (as `CLUSTER NODES` writes a node's address).
fn address_port(address: &str) -> u16 {
    address
        .split('@')
        .next()
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("unexpected node address {address:?}"))
}

/// A free loopback port below 55536 whose cluster bus port (port + 10000) is free too.
fn free_cluster_port() -> Option<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").ok()?;
    let port = listener.local_addr().ok()?.port();
    if port > 55535 {
        return None;
    }
    TcpListener::bind(("127.0.0.1", port + 10000)).ok()?;
    Some(port)
}
