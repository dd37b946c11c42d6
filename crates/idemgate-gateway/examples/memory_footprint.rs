//! How much memory the memory store needs per record, and whether it stays flat under a
//! stream of unique keys: the memory rows of `BENCHMARKS.md`.
//!
//! ```text
//! cargo run --release --example memory_footprint -- live 1000000
//! cargo run --release --example memory_footprint -- churn 60
//! ```
//!
//! `live N` keeps N completed records (a typical JSON response: three headers, ~200 bytes of
//! body, each a view into its own 8 KiB read buffer, as a connection delivers it) and compares
//! the process's resident memory with the bytes the records hold (their encoded size).
//! `churn SECONDS` claims and completes unique keys with a one-second ttl for that long and
//! prints the resident memory every few seconds.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use idemgate::record::{Completion, FingerprintHash, OwnerToken, RecordKey, StoredResponse};
use idemgate::store::{Claim, ClaimOptions, MemoryStore, MemoryStoreConfig, Store, UnknownOutcome};

// The allocator the `idemgate` binary runs with, so the figures are the gateway's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const JSON: &[u8] = br#"{"id":"pay_8e03978e40d543e8","object":"payment","amount":2000,"currency":"eur","status":"succeeded","customer":"cus_9s6XKzkNRiz8i3","created":1700000000,"livemode":false,"metadata":{"order":"6735"}}"#;
/// The size of the buffer a connection reads a response into.
const READ_BUFFER: usize = 8 * 1024;

/// A response as the proxy captures it: header values and body are views into the buffer the
/// connection read them into.
fn captured_response() -> Completion {
    let fields: [(HeaderName, &[u8]); 3] = [
        (http::header::CONTENT_TYPE, b"application/json"),
        (http::header::CONTENT_LENGTH, b"198"),
        (http::header::DATE, b"Sat, 21 Nov 2026 13:00:00 GMT"),
    ];
    let mut buffer = BytesMut::with_capacity(READ_BUFFER);
    for (_, value) in &fields {
        buffer.extend_from_slice(value);
    }
    buffer.extend_from_slice(JSON);
    buffer.resize(READ_BUFFER, 0);
    let buffer = buffer.freeze();
    let mut headers = HeaderMap::new();
    let mut at = 0;
    for (name, value) in fields {
        let view = buffer.slice(at..at + value.len());
        at += value.len();
        if let Ok(value) = HeaderValue::from_maybe_shared(view) {
            headers.insert(name, value);
        }
    }
    Completion::Response(StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: buffer.slice(at..at + JSON.len()),
    })
}

fn key(n: u64) -> RecordKey {
    RecordKey::of(&n.to_le_bytes())
}

/// Resident memory of this process, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|kib| kib.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

async fn put(store: &MemoryStore, n: u64, ttl: Duration) -> bool {
    let options = ClaimOptions {
        lease: Duration::from_secs(30),
        ttl,
        on_lapse: UnknownOutcome::Ambiguous,
    };
    let key = key(n);
    let token = OwnerToken::generate();
    match store
        .claim(&key, &FingerprintHash::of(b"request"), token, &options)
        .await
    {
        Ok(Claim::Acquired(token)) => store
            .complete(&key, token, captured_response(), ttl)
            .await
            .is_ok(),
        _ => false,
    }
}

fn out(line: std::fmt::Arguments<'_>) {
    let mut stdout = std::io::stdout().lock();
    let _ = stdout.write_fmt(line);
    let _ = stdout.write_all(b"\n");
}

async fn live(records: u64) -> ExitCode {
    let store = MemoryStore::with_config(MemoryStoreConfig {
        capacity: usize::try_from(records).unwrap_or(usize::MAX),
        ..MemoryStoreConfig::default()
    });
    let stored_bytes = records * captured_response().encode().len() as u64;
    let before = rss();
    for n in 0..records {
        if !put(&store, n, Duration::from_secs(3600)).await {
            eprintln!("memory_footprint: record {n} was not stored");
            return ExitCode::FAILURE;
        }
    }
    let grown = rss().saturating_sub(before);
    out(format_args!(
        "live records: {records}; stored bytes: {stored_bytes} ({} per record); resident growth: {grown} ({} per record); ratio {:.2}",
        stored_bytes / records.max(1),
        grown / records.max(1),
        grown as f64 / stored_bytes.max(1) as f64
    ));
    drop(Arc::new(store));
    ExitCode::SUCCESS
}

async fn churn(seconds: u64) -> ExitCode {
    let store = MemoryStore::default();
    let start = Instant::now();
    let mut n = 0u64;
    let mut next_report = Duration::ZERO;
    let mut samples = Vec::new();
    while start.elapsed() < Duration::from_secs(seconds) {
        for _ in 0..1000 {
            n += 1;
            if !put(&store, n, Duration::from_secs(1)).await {
                eprintln!("memory_footprint: record {n} was not stored");
                return ExitCode::FAILURE;
            }
        }
        // Let the background sweep run, as it would between requests.
        tokio::task::yield_now().await;
        if start.elapsed() >= next_report {
            let rss = rss();
            samples.push(rss);
            out(format_args!(
                "{:>5.1} s: {n} records written, {} live, resident {} KiB",
                start.elapsed().as_secs_f64(),
                store.len(),
                rss / 1024
            ));
            next_report += Duration::from_secs(5);
        }
    }
    let half = &samples[samples.len() / 2..];
    let (low, high) = half
        .iter()
        .fold((u64::MAX, 0), |(lo, hi), &s| (lo.min(s), hi.max(s)));
    out(format_args!(
        "second half: resident between {} and {} KiB ({n} records written in {seconds} s)",
        low / 1024,
        high / 1024
    ));
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("memory_footprint: {error}");
            return ExitCode::FAILURE;
        }
    };
    let number = |default: u64| {
        args.get(1)
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(default)
    };
    match args.first().map(String::as_str) {
        Some("live") => runtime.block_on(live(number(1_000_000))),
        Some("churn") => runtime.block_on(churn(number(60))),
        _ => {
            eprintln!("usage: memory_footprint live [RECORDS] | churn [SECONDS]");
            ExitCode::from(2)
        }
    }
}
