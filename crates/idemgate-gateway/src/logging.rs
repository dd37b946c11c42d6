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
//!
//! Text lines not bound for a terminal are formatted by `UtcMicros` and `PlainFields`:
//! the same text as tracing-subscriber's defaults, for about a tenth less of a replay's CPU
//! time at `info` (BENCHMARKS.md).

use std::cell::RefCell;
use std::fmt::{self, Write as _};
use std::io::{self, IsTerminal, Write};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::field::RecordFields;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::fmt::format::{FormatFields, Writer};
use tracing_subscriber::fmt::time::FormatTime;

use super::LogFormat;

/// A batch is written once it holds this many bytes (a few hundred lines).
pub const BATCH_BYTES: usize = 32 * 1024;
/// The longest a line waits in a batch while the runtime is busy.
pub const BATCH_AGE: Duration = Duration::from_millis(100);

/// Standard error, with log lines batched.
pub static STDERR: LogBatch = LogBatch::empty();

/// Log lines not written yet; see the module documentation.
#[derive(Debug)]
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

    /// Writes the lines gathered so far and then `message` as a line of its own, all in one
    /// `write`: for what the binary prints beside its log (the listening line, a fatal
    /// error), which must come after the log lines before it, and which a script reading the
    /// output as it grows must never see half-written (`eprintln!` writes each formatted
    /// piece with a `write` of its own).
    pub fn print_line(&self, message: fmt::Arguments<'_>) {
        let mut lines = self.lock();
        // Writing into a `Vec` cannot fail.
        let _ = writeln!(&mut *lines, "{message}");
        write_out(&mut lines);
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
        self.lines
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
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
#[derive(Debug)]
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
    let ansi = io::stderr().is_terminal();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(&STDERR)
        .with_timer(UtcMicros)
        .with_ansi(ansi);
    match format {
        // A terminal gets the default fields, with their colours.
        LogFormat::Text if ansi => logs.init(),
        LogFormat::Text => logs.fmt_fields(PlainFields).init(),
        LogFormat::Json => logs.json().init(),
    }
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |panic| {
        STDERR.try_flush();
        report(panic);
    }));
}

/// The time of an event as tracing-subscriber's default timer writes it, UTC to the
/// microsecond (`2026-11-25T11:01:16.712268Z`), with the date and time of day formatted once
/// a second per thread rather than for every line. A clock before 1970 reads as 1970.
struct UtcMicros;

impl FormatTime for UtcMicros {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        write_utc_micros(w, now)
    }
}

thread_local! {
    /// The last second formatted on this thread: seconds since the epoch, and its text.
    static SECOND: RefCell<(u64, String)> = const { RefCell::new((0, String::new())) };
}

/// Writes `YYYY-MM-DDTHH:MM:SS.uuuuuuZ` for a time since the epoch.
fn write_utc_micros(w: &mut impl fmt::Write, since_epoch: Duration) -> fmt::Result {
    let secs = since_epoch.as_secs();
    SECOND.with_borrow_mut(|(at, text)| {
        if *at != secs || text.is_empty() {
            *at = secs;
            *text = format_second(secs);
        }
        w.write_str(text)
    })?;
    write!(w, ".{:06}Z", since_epoch.subsec_micros())
}

/// `YYYY-MM-DDTHH:MM:SS` (UTC) for seconds since the epoch.
fn format_second(secs: u64) -> String {
    let (days, in_day) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (in_day / 3600, in_day / 60 % 60, in_day % 60);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}")
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`, for days on or after the epoch).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// Event fields as tracing-subscriber's default writes them without colours (`message`
/// first as written, then `name=value` with the value's `Debug`, control characters in the
/// message and in errors escaped), but without the styling calls that cost a log line as
/// much as its values even when there is no colour. Used when standard error is not a
/// terminal; a terminal gets the default, coloured.
struct PlainFields;

impl<'w> FormatFields<'w> for PlainFields {
    fn format_fields<R: RecordFields>(&self, writer: Writer<'w>, fields: R) -> fmt::Result {
        let mut visitor = PlainVisitor {
            writer,
            first: true,
            result: Ok(()),
        };
        fields.record(&mut visitor);
        visitor.result
    }
}

struct PlainVisitor<'w> {
    writer: Writer<'w>,
    first: bool,
    result: fmt::Result,
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.record_debug(field, &format_args!("{value}"));
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        let error = Escaped(format_args!("{value}"));
        match value.source() {
            Some(source) => self.record_debug(
                field,
                &format_args!("{error} {}.sources={}", field.name(), Sources(source)),
            ),
            None => self.record_debug(field, &format_args!("{error}")),
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.result.is_err() {
            return;
        }
        let separator = if std::mem::replace(&mut self.first, false) {
            ""
        } else {
            " "
        };
        self.result = match field.name() {
            "message" => write!(self.writer, "{separator}{:?}", Escaped(value)),
            name => {
                let name = name.strip_prefix("r#").unwrap_or(name);
                write!(self.writer, "{separator}{name}={value:?}")
            }
        };
    }
}

/// An error and its sources, `[first, second, …]`, each escaped.
struct Sources<'a>(&'a (dyn std::error::Error + 'static));

impl fmt::Display for Sources<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut list = f.debug_list();
        let mut next = Some(self.0);
        while let Some(error) = next {
            list.entry(&Escaped(format_args!("{error}")));
            next = error.source();
        }
        list.finish()
    }
}

/// A value written with the control characters a terminal acts on escaped, as
/// tracing-subscriber does for messages and errors.
struct Escaped<T>(T);

impl<T: fmt::Debug> fmt::Debug for Escaped<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(Escaping(f), "{:?}", self.0)
    }
}

impl<T: fmt::Display> fmt::Display for Escaped<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(Escaping(f), "{}", self.0)
    }
}

struct Escaping<'a, 'b>(&'a mut fmt::Formatter<'b>);

impl fmt::Write for Escaping<'_, '_> {
    fn write_str(&mut self, text: &str) -> fmt::Result {
        let mut rest = text;
        while let Some(at) = rest.find(|c: char| {
            matches!(
                c,
                '\x1b' | '\x07' | '\x08' | '\x0c' | '\x7f' | '\u{80}'..='\u{9f}'
            )
        }) {
            self.0.write_str(&rest[..at])?;
            let c = rest[at..].chars().next().unwrap_or_default();
            match c {
                '\u{80}'..='\u{9f}' => write!(self.0, "\\u{{{:x}}}", c as u32)?,
                c => write!(self.0, "\\x{:02x}", c as u32)?,
            }
            rest = &rest[at + c.len_utf8()..];
        }
        self.0.write_str(rest)
    }
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

    #[test]
    fn times_read_as_the_default_timer_writes_them() {
        let at = |secs: u64, micros: u32| {
            let mut text = String::new();
            write_utc_micros(&mut text, Duration::new(secs, micros * 1000)).unwrap();
            text
        };
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000000Z");
        assert_eq!(at(951_782_400, 5), "2000-02-29T00:00:00.000005Z");
        assert_eq!(at(1_764_070_876, 712_268), "2025-11-25T11:41:16.712268Z");
        assert_eq!(at(4_107_542_399, 999_999), "2100-02-28T23:59:59.999999Z");
        assert_eq!(at(253_402_300_799, 1), "9999-12-31T23:59:59.000001Z");
        // The second's text is kept per thread: a later second is not read from it.
        assert_eq!(at(1_764_070_877, 0), "2025-11-25T11:41:17.000000Z");
        assert_eq!(at(1_764_070_876, 0), "2025-11-25T11:41:16.000000Z");
    }

    #[derive(Debug)]
    struct Failure(&'static str, Option<Box<Failure>>);

    impl fmt::Display for Failure {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Failure {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as _)
        }
    }

    /// The lines an event gives with tracing-subscriber's own fields, and with these.
    fn both_ways(event: impl Fn()) -> (String, String) {
        let run = |plain: bool| {
            let out = std::sync::Arc::new(Mutex::new(Vec::new()));
            let sink = std::sync::Arc::clone(&out);
            let make = move || Sink(std::sync::Arc::clone(&sink));
            let logs = tracing_subscriber::fmt()
                .with_writer(make)
                .with_ansi(false)
                .without_time();
            if plain {
                tracing::subscriber::with_default(logs.fmt_fields(PlainFields).finish(), &event);
            } else {
                tracing::subscriber::with_default(logs.finish(), &event);
            }
            String::from_utf8(out.lock().unwrap().clone()).unwrap()
        };
        (run(false), run(true))
    }

    struct Sink(std::sync::Arc<Mutex<Vec<u8>>>);

    impl Write for Sink {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn plain_fields_write_what_the_default_writes_without_colour() {
        let chained = Failure("outer", Some(Box::new(Failure("in\x1bner", None))));
        let lone = Failure("lone", None);
        let (default, plain) = both_ways(|| {
            tracing::info!(
                route = %"default",
                status = 200u16,
                latency_ms = 0.125,
                negative = -3i64,
                flag = true,
                quoted = "a \"str\"",
                debug = ?Some(1),
                r#type = "raw",
                chained = &chained as &(dyn std::error::Error + 'static),
                lone = &lone as &(dyn std::error::Error + 'static),
                "request \x1b[31m{}\u{9b} done",
                7
            );
            tracing::warn!("only a message");
            tracing::warn!(alone = 1);
        });
        assert!(default.contains("route=default status=200"), "{default}");
        assert!(default.contains("\\x1b[31m7\\u{9b}"), "{default}");
        assert_eq!(plain, default);
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
