//! Keep-alive HTTP/1.1 connections to the upstream.
//!
//! A connection is a socket and its read buffer ([`Connection`]), used by one request at a
//! time and driven by that request's task. A request takes an idle connection (the most
//! recently used one the upstream has not closed) or opens one; the connection comes back to
//! the pool when its response body has been read to the end (see
//! [`super::http1::client::BodyReader`]). A response dropped before its end takes its connection
//! with it: HTTP/1.1 cannot reuse a connection with a response half-read.
//!
//! The pool holds at most [`MAX_IDLE`] idle connections; an idle connection is closed at the
//! second reaper round after it came back, the rounds half the pool's idle timeout apart, so
//! after between half of that timeout and all of it. Closing ours before the upstream closes
//! its side means a request is never written to a connection the upstream is closing at
//! that moment, which would leave the request's outcome unknown.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use http::header::HeaderValue;
use http::uri::Authority;
use tokio::net::TcpStream;

use super::http1::client::Connection;

/// Most idle connections kept; more are closed as they come back.
pub const MAX_IDLE: usize = 512;

/// Why no connection could be had. Nothing was sent.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The TCP connection failed.
    #[error("cannot connect to the upstream {authority}")]
    Connect {
        /// Where to.
        authority: Authority,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The TCP connection took longer than the connect timeout.
    #[error("connecting to the upstream {authority} took longer than {after:?}")]
    Timeout {
        /// Where to.
        authority: Authority,
        /// The connect timeout.
        after: Duration,
    },
}

/// Idle upstream connections, shared by every request.
pub struct Pool {
    authority: Authority,
    host: String,
    port: u16,
    connect_timeout: Duration,
    idle: Mutex<Vec<Idle>>,
    /// Bumped by the reaper each round.
    round: AtomicU64,
}

struct Idle {
    connection: Box<Connection>,
    round: u64,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("authority", &self.authority)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// A pool of connections to `authority` that gives up connecting after `connect_timeout`
    /// and keeps an idle connection at most `idle_timeout`. Made inside a runtime, it starts
    /// its reaper there; the reaper stops with the pool.
    pub fn new(
        authority: Authority,
        connect_timeout: Duration,
        idle_timeout: Duration,
    ) -> Arc<Self> {
        // `[::1]` names an IPv6 address; the socket wants it bare.
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = authority.port_u16().unwrap_or(80);
        let pool = Arc::new(Self {
            authority,
            host,
            port,
            connect_timeout,
            idle: Mutex::new(Vec::new()),
            round: AtomicU64::new(0),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(reap(Arc::downgrade(&pool), idle_timeout / 2));
        }
        pool
    }

    /// The `Host` of requests sent through this pool.
    pub fn host_header(&self) -> HeaderValue {
        HeaderValue::from_str(self.authority.as_str())
            .unwrap_or_else(|_| HeaderValue::from_static("localhost"))
    }

    /// An idle connection the upstream has not closed, if there is one.
    pub fn take_idle(&self) -> Option<Box<Connection>> {
        // The most recently used first: its socket is the warmest. Closed ones found on the
        // way are closed after the lock is let go.
        let mut closed = Vec::new();
        let mut idle = self.lock();
        let found = loop {
            match idle.pop() {
                Some(entry) if entry.connection.is_usable() => break Some(entry.connection),
                Some(entry) => closed.push(entry),
                None => break None,
            }
        };
        drop(idle);
        drop(closed);
        found
    }

    /// Opens a new connection.
    pub async fn connect(&self) -> Result<Box<Connection>, ConnectError> {
        let connecting = TcpStream::connect((self.host.as_str(), self.port));
        let stream = match tokio::time::timeout(self.connect_timeout, connecting).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(source)) => {
                return Err(ConnectError::Connect {
                    authority: self.authority.clone(),
                    source,
                });
            }
            Err(_) => {
                return Err(ConnectError::Timeout {
                    authority: self.authority.clone(),
                    after: self.connect_timeout,
                });
            }
        };
        let _ = stream.set_nodelay(true);
        Ok(Box::new(Connection::new(stream)))
    }

    /// Takes back a connection whose response was read to its end.
    pub fn put_back(&self, connection: Box<Connection>) {
        let round = self.round.load(Ordering::Relaxed);
        let mut idle = self.lock();
        if idle.len() < MAX_IDLE {
            idle.push(Idle { connection, round });
        }
    }

    /// Idle connections held now.
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.lock().len()
    }

    /// The idle list; changed only by pushes, pops and retains, so a poisoned lock is taken
    /// as it is.
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// One reaper round: closes connections idle since before the previous round, and those
    /// the upstream closed.
    fn reap_round(&self) {
        let round = self.round.fetch_add(1, Ordering::Relaxed) + 1;
        let mut idle = self.lock();
        // Taken out in place: the list keeps its room, and nothing is allocated unless a
        // connection goes.
        let closing: Vec<Idle> = idle
            .extract_if(.., |e| e.round + 2 <= round || !e.connection.is_usable())
            .collect();
        // Closed after the lock is let go: requests take and return connections under it.
        drop(idle);
        drop(closing);
    }
}

/// Runs a reaper round every `every` while the pool lives.
async fn reap(pool: Weak<Pool>, every: Duration) {
    let mut ticks = tokio::time::interval(every);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(pool) = pool.upgrade() else {
            return;
        };
        pool.reap_round();
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use bytes::Bytes;
    use http_body_util::{Empty, Full};
    use hyper_util::rt::TokioIo;

    use super::*;
    use crate::http1::client::tests::{STALL, soon};
    use crate::http1::client::{BodyReader, OwnFields};

    async fn upstream() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(
                    TokioIo::new(stream),
                    hyper::service::service_fn(|_req| async {
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from_static(b"ok"),
                        )))
                    }),
                ));
            }
        });
        (addr, server)
    }

    /// The proxy's default idle timeout: no test waits for it.
    const IDLE: Duration = crate::config::DEFAULT_UPSTREAM_IDLE_TIMEOUT;

    fn authority(addr: std::net::SocketAddr) -> Authority {
        addr.to_string().parse().unwrap()
    }

    #[tokio::test]
    async fn a_connection_comes_back_ready_and_is_reused() {
        let (addr, _server) = upstream().await;
        let pool = Pool::new(authority(addr), Duration::from_secs(1), IDLE);
        assert!(pool.take_idle().is_none());
        let mut connection = pool.connect().await.unwrap();
        let (head, ()) = http::Request::builder()
            .uri("/")
            .header(http::header::HOST, pool.host_header())
            .body(())
            .unwrap()
            .into_parts();
        let response = connection
            .send(
                &head,
                &OwnFields::default(),
                &mut Empty::<Bytes>::new(),
                &mut None,
                soon(),
            )
            .await
            .unwrap();
        let mut reader = BodyReader::new(&response, connection, STALL, None);
        let mut body = Vec::new();
        while let Some(data) = poll_fn(|cx| reader.poll_data(cx)).await {
            body.extend_from_slice(&data.unwrap());
        }
        assert_eq!(body, b"ok");
        // Read to its end, the response frees the connection.
        pool.put_back(reader.take_reusable().expect("reusable"));
        assert_eq!(pool.idle_count(), 1);
        assert!(
            pool.take_idle().is_some(),
            "the idle connection is lent again"
        );
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn idle_connections_are_reaped_after_two_rounds() {
        let (addr, _server) = upstream().await;
        let pool = Pool::new(authority(addr), Duration::from_secs(1), IDLE);
        let connection = pool.connect().await.unwrap();
        pool.put_back(connection);
        pool.reap_round();
        assert_eq!(pool.idle_count(), 1, "idle for less than a round");
        pool.reap_round();
        assert_eq!(pool.idle_count(), 0, "idle for a whole round");
    }

    #[tokio::test]
    async fn the_reaper_closes_a_connection_idle_for_the_idle_timeout() {
        let (addr, _server) = upstream().await;
        let pool = Pool::new(
            authority(addr),
            Duration::from_secs(1),
            Duration::from_millis(200),
        );
        pool.put_back(pool.connect().await.unwrap());
        assert_eq!(pool.idle_count(), 1);
        // Rounds every 100 ms close it after 100 to 200 ms; waited for up to 1.5 s, less
        // than the 2 s of the first round at the default timeout.
        for _ in 0..30 {
            if pool.idle_count() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(pool.idle_count(), 0, "still idle in the pool after 1.5 s");
    }

    #[tokio::test]
    async fn connections_the_upstream_closed_are_not_lent() {
        // An upstream that hangs up on every connection it accepts.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                drop(stream);
            }
        });
        let pool = Pool::new(authority(addr), Duration::from_secs(1), IDLE);
        let connection = pool.connect().await.unwrap();
        pool.put_back(connection);
        // The runtime learns of the close a moment later; from then on the connection is
        // dropped instead of lent.
        for _ in 0..200 {
            if let Some(connection) = pool.take_idle() {
                pool.put_back(connection);
            }
            if pool.idle_count() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            pool.idle_count(),
            0,
            "a closed connection is still held after 2 s"
        );
        assert!(pool.take_idle().is_none());
    }

    #[tokio::test]
    async fn an_unreachable_upstream_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let pool = Pool::new(authority(addr), Duration::from_secs(1), IDLE);
        let error = pool.connect().await.expect_err("nothing listens there");
        assert!(matches!(error, ConnectError::Connect { .. }), "{error:?}");
    }
}
