//! Real servers for idemgate's tests (a Redis, a Redis Cluster, PostgreSQL), started on free
//! loopback ports and stopped by their own pid when dropped: nothing a test did not start is
//! ever touched.

pub mod postgres;
pub mod redis;
pub mod redis_cluster;

pub use postgres::{PgBouncer, PostgresServer};
pub use redis::RedisServer;
pub use redis_cluster::RedisCluster;

/// Waits until `ready` says the server `child` runs is, at most `within`: false if the child
/// exited first (then `child` is `None`) or the time ran out (the caller stops it).
pub(crate) fn wait_until_ready(
    child: &mut Option<std::process::Child>,
    within: std::time::Duration,
    mut ready: impl FnMut() -> bool,
) -> bool {
    let deadline = std::time::Instant::now() + within;
    while std::time::Instant::now() < deadline {
        if let Some(running) = child.as_mut()
            && let Ok(Some(_)) = running.try_wait()
        {
            *child = None;
            return false;
        }
        if ready() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}

/// Sends `signal` (`-STOP`, `-CONT`) to `pid`, a server this crate started.
pub(crate) fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .arg(signal)
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {signal} {pid} failed");
}

/// A loopback port free when asked (the listener is dropped at once; the server binds it next).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("bind a loopback port")
        .port()
}
