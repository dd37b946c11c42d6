//! The client-connection watchdog: closes a connection that is too slow to send a request
//! head, or quiet for too long; and the client's stream, which also tells when a client has
//! hung up on a request in progress.
//!
//! I/O and the front service only set flags and counters on a connection's [`Activity`]; the
//! watchdog reads the clock a few times per allowed period and decides ([`Watchdog::look`]).
//! This replaces a timer per request (hyper's header-read timer cost about 1 300 instructions
//! of each request by callgrind: a boxed sleep, its clock read and its timer-wheel entry).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::config::Limits;

/// How many times per allowed period the watchdog looks at a connection: a limit is enforced
/// within a quarter of it.
const CHECKS_PER_PERIOD: u32 = 4;

/// What a client connection did since the watchdog last looked.
#[derive(Debug, Default)]
pub(super) struct Activity {
    /// Bytes moved either way.
    moved: AtomicBool,
    /// Bytes written to the client.
    wrote: AtomicBool,
    /// Requests whose head has arrived and whose response is not ready yet.
    open: AtomicUsize,
    /// A request's head arrived since the watchdog last looked.
    began: AtomicBool,
    /// A request has come on this connection.
    served: AtomicBool,
    /// A request came over HTTP/2: requests are streams, and there is no head to wait for
    /// between them.
    http2: AtomicBool,
}

impl Activity {
    /// A request's head arrived; the returned guard marks it finished when dropped.
    pub(super) fn request_started(self: &Arc<Self>, version: http::Version) -> InFlight {
        self.open.fetch_add(1, Ordering::Relaxed);
        self.began.store(true, Ordering::Relaxed);
        self.served.store(true, Ordering::Relaxed);
        if version == http::Version::HTTP_2 {
            self.http2.store(true, Ordering::Relaxed);
        }
        InFlight(Arc::clone(self))
    }

    /// Whether an HTTP/1.1 request waits for its response: the time a client's hang-up is
    /// looked for (see `server::serve_connection`).
    pub(super) fn awaits_http1_response(&self) -> bool {
        self.open.load(Ordering::Relaxed) > 0 && !self.http2.load(Ordering::Relaxed)
    }

    /// What happened since the last look; clears the flags of what happened.
    fn take(&self) -> Seen {
        let wrote = self.wrote.swap(false, Ordering::Relaxed);
        let began = self.began.swap(false, Ordering::Relaxed);
        let open = self.open.load(Ordering::Relaxed) > 0;
        Seen {
            moved: self.moved.swap(false, Ordering::Relaxed),
            busy: wrote || open,
            requested: began || open,
            served: self.served.load(Ordering::Relaxed),
            http2: self.http2.load(Ordering::Relaxed),
        }
    }
}

/// A request between its head and its response; see [`Activity::request_started`].
#[derive(Debug)]
pub(super) struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One look's worth of [`Activity`].
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    /// Bytes moved either way.
    moved: bool,
    /// A request was open, or response bytes went out: the connection was not waiting for a
    /// request head.
    busy: bool,
    /// A request began or was open.
    requested: bool,
    /// A request has come on the connection.
    served: bool,
    /// The connection is known to be HTTP/2.
    http2: bool,
}

/// What the watchdog decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Look again after this long.
    LookIn(Duration),
    /// Close the connection gracefully: an HTTP/1.1 response in progress is finished first.
    /// Look again after the given time: a closing connection that stays quiet is cut.
    Close(Duration),
    /// Drop the connection at once: no first request head in time (a graceful close would
    /// wait for that head to complete), or no bytes moving for `idle_timeout` after a
    /// graceful close (a client that stopped reading its response or sending its request
    /// body would hold the connection for ever).
    Cut,
}

/// The clock side of the watchdog for one connection.
///
/// - No bytes either way for `idle_timeout` → close gracefully.
/// - HTTP/2: no request begun or open for `idle_timeout` → close gracefully (a GOAWAY; a
///   response still streaming finishes). Control frames do not count: the gateway's own
///   keep-alive pings, which find a dead peer, keep bytes moving on every live connection.
/// - HTTP/1.1 (and a connection whose protocol is not known yet): from the moment it opens,
///   and again once each response has gone out, the next request head must arrive within
///   `header_read_timeout`. Bytes that trickle in without completing a head do not extend
///   that time. A connection that has had no request yet is then cut; one that has is closed
///   gracefully, which closes an idle keep-alive connection (or one part way through its
///   next head) at once.
///
/// A waiting period is counted from the first look that finds the connection neither
/// handling a request nor writing, so it is never cut short; it may run up to a quarter over.
/// A response body that stalls (no bytes out) for `header_read_timeout` counts as waiting
/// too: the graceful close then lets that response finish and closes the connection after
/// it.
///
/// - After a graceful close, a connection that moves no bytes either way for `idle_timeout`
///   is cut.
#[derive(Debug)]
pub(super) struct Watchdog {
    header_read_timeout: Duration,
    idle_timeout: Duration,
    /// When bytes last moved, as of the last look.
    last_moved: Instant,
    /// When the connection last was busy, as of the last look: the start of its wait for a
    /// request head.
    waiting_since: Instant,
    /// When a request was last seen begun or open.
    last_request: Instant,
    /// When the watchdog closed the connection gracefully.
    closed_at: Option<Instant>,
}

impl Watchdog {
    /// The watchdog of a connection opened at `now`, and when it first looks.
    pub(super) fn new(limits: Limits, now: Instant) -> (Self, Duration) {
        let watchdog = Self {
            header_read_timeout: limits.header_read_timeout,
            idle_timeout: limits.idle_timeout,
            last_moved: now,
            waiting_since: now,
            last_request: now,
            closed_at: None,
        };
        let first = watchdog.look_in(false);
        (watchdog, first)
    }

    /// Looks at what the connection did since the last look.
    pub(super) fn look(&mut self, activity: &Activity, now: Instant) -> Verdict {
        self.judge(activity.take(), now)
    }

    fn judge(&mut self, seen: Seen, now: Instant) -> Verdict {
        if seen.moved {
            self.last_moved = now;
        }
        if seen.busy {
            self.waiting_since = now;
        }
        if seen.requested {
            self.last_request = now;
        }
        if let Some(closed_at) = self.closed_at {
            // Closing: only what is in progress may finish, and it must keep moving.
            let quiet_since = self.last_moved.max(closed_at);
            return if now.saturating_duration_since(quiet_since) >= self.idle_timeout {
                Verdict::Cut
            } else {
                Verdict::LookIn(self.idle_timeout / CHECKS_PER_PERIOD)
            };
        }
        let quiet = now.saturating_duration_since(self.last_moved) >= self.idle_timeout;
        let unused =
            seen.http2 && now.saturating_duration_since(self.last_request) >= self.idle_timeout;
        let idle = quiet || unused;
        let head_late = !seen.http2
            && now.saturating_duration_since(self.waiting_since) >= self.header_read_timeout;
        if head_late && !seen.served {
            Verdict::Cut
        } else if idle || head_late {
            self.closed_at = Some(now);
            Verdict::Close(self.idle_timeout / CHECKS_PER_PERIOD)
        } else {
            Verdict::LookIn(self.look_in(seen.http2))
        }
    }

    /// How long until the next look: a fraction of the shortest limit that applies.
    fn look_in(&self, http2: bool) -> Duration {
        let period = if http2 {
            self.idle_timeout
        } else {
            self.idle_timeout.min(self.header_read_timeout)
        };
        period / CHECKS_PER_PERIOD
    }
}

/// A client's TCP stream, shared by hyper's reads and writes (through [`ActivityIo`]) and the
/// connection task's hang-up check ([`ClientStream::poll_hung_up`]). Both run in that one
/// task, one after the other, so the lock is never contended.
#[derive(Clone)]
pub(super) struct ClientStream(Arc<Mutex<TcpStream>>);

impl ClientStream {
    pub(super) fn new(stream: TcpStream) -> Self {
        Self(Arc::new(Mutex::new(stream)))
    }

    fn lock(&self) -> MutexGuard<'_, TcpStream> {
        // Only socket calls run under the lock; a panic there leaves nothing half-changed.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the client has gone: it closed its side of the connection, or reset it.
    /// `false` while nothing has come from it (the task is then woken when something does),
    /// and while bytes wait to be read (the rest of a request body, or a pipelined request:
    /// hyper reads those in its own time, and nothing can be told until it has).
    pub(super) fn poll_hung_up(&self, cx: &mut Context<'_>) -> bool {
        let mut byte = [0u8; 1];
        let mut peeked = ReadBuf::new(&mut byte);
        match self.lock().poll_peek(cx, &mut peeked) {
            Poll::Ready(Ok(0) | Err(_)) => true,
            Poll::Ready(Ok(_)) | Poll::Pending => false,
        }
    }
}

/// A client TCP stream that records its traffic on the connection's [`Activity`].
pub(super) struct ActivityIo {
    stream: ClientStream,
    activity: Arc<Activity>,
}

impl ActivityIo {
    pub(super) fn new(stream: ClientStream, activity: Arc<Activity>) -> Self {
        Self { stream, activity }
    }

    fn wrote(&self, result: &Poll<io::Result<usize>>) {
        if matches!(result, Poll::Ready(Ok(n)) if *n > 0) {
            self.activity.moved.store(true, Ordering::Relaxed);
            self.activity.wrote.store(true, Ordering::Relaxed);
        }
    }
}

impl AsyncRead for ActivityIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut *self.stream.lock()).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.moved.store(true, Ordering::Relaxed);
        }
        result
    }
}

impl AsyncWrite for ActivityIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut *self.stream.lock()).poll_write(cx, buf);
        self.wrote(&result);
        result
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut *self.stream.lock()).poll_write_vectored(cx, bufs);
        self.wrote(&result);
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.lock().is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.stream.lock()).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.stream.lock()).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(header_read_ms: u64, idle_ms: u64) -> Limits {
        Limits {
            max_connections: 1,
            header_read_timeout: Duration::from_millis(header_read_ms),
            idle_timeout: Duration::from_millis(idle_ms),
            max_headers: 64,
            max_header_bytes: 64 * 1024,
        }
    }

    const MS: Duration = Duration::from_millis(1);

    /// Looks every `step` ms with what `seen(ms)` says, and returns the first look that did
    /// not just schedule the next: its ms and verdict (or `None` within `until` ms).
    fn first_verdict(
        limits: Limits,
        step: u64,
        until: u64,
        seen: impl Fn(u64) -> Seen,
    ) -> Option<(u64, Verdict)> {
        verdicts(limits, step, until, seen).into_iter().next()
    }

    #[test]
    fn looks_a_quarter_of_the_shortest_limit_apart() {
        let (_, first) = Watchdog::new(limits(1000, 60_000), Instant::now());
        assert_eq!(first, 250 * MS);
        let (mut http2, _) = Watchdog::new(limits(1000, 60_000), Instant::now());
        let seen = Seen {
            http2: true,
            ..Seen::default()
        };
        assert_eq!(
            http2.judge(seen, Instant::now()),
            Verdict::LookIn(15_000 * MS)
        );
    }

    #[test]
    fn a_silent_connection_gets_the_header_timeout() {
        let verdict = first_verdict(limits(1000, 60_000), 250, 5000, |_| Seen::default());
        assert_eq!(verdict, Some((1000, Verdict::Cut)));
    }

    #[test]
    fn trickled_bytes_do_not_extend_the_header_timeout() {
        let trickle = |_| Seen {
            moved: true,
            ..Seen::default()
        };
        assert_eq!(
            first_verdict(limits(1000, 60_000), 250, 5000, trickle),
            Some((1000, Verdict::Cut))
        );
    }

    #[test]
    fn a_request_in_progress_is_never_cut_and_the_wait_restarts_after_it() {
        // A request open from 100 ms to 3 000 ms, its response written until 3 200 ms.
        let seen = |ms| Seen {
            moved: ms <= 3250,
            busy: (100..=3250).contains(&ms),
            requested: (100..=3000).contains(&ms),
            served: ms >= 100,
            http2: false,
        };
        // The last busy look is at 3 250 ms; the head wait runs a full second from there,
        // and ends in a graceful close: the connection has served a request, so a response
        // may still be going out (a body that paused), and hyper finishes it first.
        assert_eq!(
            first_verdict(limits(1000, 60_000), 250, 10_000, seen),
            Some((4250, Verdict::Close(15_000 * MS)))
        );
    }

    #[test]
    fn http2_connections_are_closed_only_when_idle() {
        // Requests (streams) until 2 000 ms, and bytes moving until then; no head timeout.
        let seen = |ms| Seen {
            moved: ms <= 2000,
            requested: ms <= 2000,
            served: true,
            http2: true,
            ..Seen::default()
        };
        assert_eq!(
            first_verdict(limits(1000, 5000), 250, 20_000, seen),
            Some((7000, Verdict::Close(1250 * MS)))
        );
    }

    #[test]
    fn pings_do_not_keep_an_unused_http2_connection_open() {
        // Ping frames keep bytes moving every look; the last request ends at 2 000 ms.
        let seen = |ms| Seen {
            moved: true,
            busy: ms <= 2000,
            requested: ms <= 2000,
            served: true,
            http2: true,
        };
        assert_eq!(
            first_verdict(limits(1000, 5000), 250, 20_000, seen),
            Some((7000, Verdict::Close(1250 * MS)))
        );
        // The same bytes with a request open throughout: never closed.
        let busy = |_| Seen {
            moved: true,
            busy: true,
            requested: true,
            served: true,
            http2: true,
        };
        assert_eq!(first_verdict(limits(1000, 5000), 250, 20_000, busy), None);
    }

    #[test]
    fn a_request_that_moves_no_bytes_for_the_idle_timeout_is_closed() {
        // Open the whole time (an upstream that never answers), nothing moving.
        let seen = |_| Seen {
            busy: true,
            ..Seen::default()
        };
        assert_eq!(
            first_verdict(limits(10_000, 3000), 250, 20_000, seen),
            Some((3000, Verdict::Close(750 * MS)))
        );
    }

    /// Every verdict but `LookIn` from looks every `step` ms up to `until`, stopping at a cut.
    fn verdicts(
        limits: Limits,
        step: u64,
        until: u64,
        seen: impl Fn(u64) -> Seen,
    ) -> Vec<(u64, Verdict)> {
        let start = Instant::now();
        let (mut watchdog, _) = Watchdog::new(limits, start);
        let mut out = Vec::new();
        for ms in (1..=until / step).map(|k| k * step) {
            match watchdog.judge(seen(ms), start + MS * ms as u32) {
                Verdict::LookIn(_) => {}
                verdict => {
                    out.push((ms, verdict));
                    if verdict == Verdict::Cut {
                        break;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn a_closed_connection_that_stays_quiet_is_cut() {
        // A request open throughout with nothing moving: a client that sent part of a body
        // and went silent, or one that stopped reading its response. Closed gracefully after
        // the idle timeout, and cut after as long again.
        let stuck = |_| Seen {
            busy: true,
            requested: true,
            served: true,
            ..Seen::default()
        };
        assert_eq!(
            verdicts(limits(10_000, 3000), 250, 20_000, stuck),
            [(3000, Verdict::Close(750 * MS)), (6000, Verdict::Cut)]
        );
        // A response still moving after the close is left to finish: bytes every look until
        // 9 000 ms, then nothing. The cut comes an idle timeout after the last bytes.
        let finishing = |ms| Seen {
            moved: ms > 3000 && ms <= 9000,
            ..stuck(ms)
        };
        assert_eq!(
            verdicts(limits(10_000, 3000), 250, 20_000, finishing),
            [(3000, Verdict::Close(750 * MS)), (12_000, Verdict::Cut)]
        );
    }

    #[test]
    fn the_in_flight_guard_counts_open_requests() {
        let activity = Arc::new(Activity::default());
        assert!(!activity.take().served);
        let first = activity.request_started(http::Version::HTTP_11);
        let second = activity.request_started(http::Version::HTTP_11);
        assert!(activity.take().busy);
        drop(first);
        let seen = activity.take();
        assert!(seen.busy && seen.requested);
        drop(second);
        let seen = activity.take();
        assert!(!seen.busy && !seen.requested && seen.served && !seen.http2);
        // A request that began and ended between two looks is seen by the next one.
        drop(activity.request_started(http::Version::HTTP_2));
        let seen = activity.take();
        assert!(seen.http2 && seen.requested && !seen.busy);
        assert!(!activity.take().requested);
    }
}
