//! The binary's log: `tracing` events formatted as text or JSON lines on standard error,
//! written in batches.
//!
//! At the default `info` level every keyed request writes a line, and a `write` of its own
//! per line cost replays about a tenth of their throughput (see BENCHMARKS.md). Lines gather
//! in [`STDERR`] instead and go out in one `write` when the batch reaches
//! [`BATCH_BYTES`], when a runtime thread runs out of work, every [`BATCH_AGE`] on a
//! runtime too busy to run out, before anything else is printed to standard error, at exit
//! and on a panic. A process killed outright (`kill -9`) loses at most the lines of the
//! last [`BATCH_AGE`].

use std::io::{self, IsTerminal, Write};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

use super::LogFormat;

/// A batch is written once it holds this many bytes (a few hundred lines).
pub const BATCH_BYTES: usize = 32 * 1024;
/// The longest a line waits in a batch while the runtime is busy.
pub const BATCH_AGE: Duration = Duration::from_millis(100);

/// Standard error, with log lines batched.
pub static STDERR: LogBatch = LogBatch::empty();

/// Log lines not written yet; see the module documentation.
pub struct LogBatch {
    lines: Mutex<Vec<u8>>,
}

impl LogBatch {
    const fn empty() -> Self {
        Self {
            lines: Mutex::new(Vec::new()),
        }
    }

    /// Writes the lines gathered so far.
    pub fn flush(&self) {
        write_out(&mut self.lock());
    }

    /// As [`LogBatch::flush`], but gives up if another thread is writing (for a panic hook,
    /// which may run on a thread that holds the lock).
    fn try_flush(&self) {
        if let Ok(mut lines) = self.lines.try_lock() {
            write_out(&mut lines);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<u8>> {
        // The lock only ever guards appending bytes and writing them out: a panic there
        // leaves whole lines or none.
        crate::lock::lock(&self.lines)
    }
}

fn write_out(lines: &mut Vec<u8>) {
    if lines.is_empty() {
        return;
    }
    // As before batching: a log that cannot be written (standard error closed) is dropped.
    let _ = io::stderr().lock().write_all(lines);
    lines.clear();
}

/// One event's writer: appends to the batch, and writes the batch out when it is full.
pub struct LineWriter<'a>(&'a LogBatch);

impl Write for LineWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let mut lines = self.0.lock();
        lines.extend_from_slice(bytes);
        if lines.len() >= BATCH_BYTES {
            write_out(&mut lines);
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl MakeWriter<'_> for &'static LogBatch {
    type Writer = LineWriter<'static>;

    fn make_writer(&self) -> Self::Writer {
        LineWriter(self)
    }
}

/// Sets up the log: the filter from `IDEMGATE_LOG` (`info` by default; the usual syntax,
/// `idemgate=debug,hyper=warn`), lines in `format`, batched on standard error, and the batch
/// written out before a panic's message.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_env("IDEMGATE_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(&STDERR)
        .with_ansi(io::stderr().is_terminal());
    match format {
        LogFormat::Text => logs.init(),
        LogFormat::Json => logs.json().init(),
    }
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |panic| {
        STDERR.try_flush();
        report(panic);
    }));
}

/// Writes `batch` out every [`BATCH_AGE`], for a runtime too busy to run out of work.
pub async fn flush_periodically(batch: &'static LogBatch) {
    let mut every = tokio::time::interval(BATCH_AGE);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        batch.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_gather_until_the_batch_is_full() {
        let batch = LogBatch::empty();
        let line = [b'x'; 100];
        LineWriter(&batch).write_all(&line).unwrap();
        assert_eq!(batch.lock().len(), 100, "a line waits in the batch");
        for _ in 0..BATCH_BYTES / 100 {
            LineWriter(&batch).write_all(&line).unwrap();
        }
        // The write that filled the batch sent it out (to this test's standard error).
        assert!(batch.lock().len() < BATCH_BYTES);
        batch.flush();
        assert!(batch.lock().is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_line_waits_at_most_the_batch_age() {
        static BATCH: LogBatch = LogBatch::empty();
        let flusher = tokio::spawn(flush_periodically(&BATCH));
        // The interval's first tick is at once; the line comes after it.
        tokio::task::yield_now().await;
        LineWriter(&BATCH).write_all(b"a line\n").unwrap();
        tokio::time::sleep(BATCH_AGE / 2).await;
        assert!(!BATCH.lock().is_empty(), "not written before its time");
        tokio::time::sleep(BATCH_AGE).await;
        assert!(BATCH.lock().is_empty(), "written within the batch age");
        flusher.abort();
    }
}
