//! The memory store on its two hot paths: a new key (claim, then complete) and a replay (a
//! claim that finds the completed record).
//!
//! `cargo bench --bench memory_store`

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderValue, StatusCode};
use idemgate::record::{Completion, FingerprintHash, OwnerToken, RecordKey, StoredResponse};
use idemgate::store::{Claim, ClaimOptions, MemoryStore, Store, UnknownOutcome};

/// Records live this long, so a run of millions of new keys keeps a bounded, steady-state
/// store (expired records are swept as the benchmark goes, as in a gateway under load).
const TTL: Duration = Duration::from_millis(200);

fn options() -> ClaimOptions {
    ClaimOptions {
        lease: Duration::from_secs(30),
        ttl: TTL,
        on_lapse: UnknownOutcome::Ambiguous,
    }
}

/// A distinct, well-spread record key per counter value (stores shard on the first bytes).
fn key(n: u64) -> RecordKey {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&n.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    bytes[8..16].copy_from_slice(&n.to_le_bytes());
    RecordKey(bytes)
}

fn completion() -> Completion {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    Completion::Response(StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from(vec![b'j'; 200]),
    })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn memory_store(c: &mut Criterion) {
    let rt = runtime();
    let store = rt.block_on(async { Arc::new(MemoryStore::default()) });
    let fingerprint = FingerprintHash::of(b"fingerprint");
    let options = options();
    let stored = completion();
    let mut group = c.benchmark_group("memory_store");

    let mut next = 0u64;
    group.bench_function("claim_complete", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    next += 1;
                    let key = key(next);
                    let Ok(Claim::Acquired(token)) = store
                        .claim(&key, &fingerprint, OwnerToken::generate(), &options)
                        .await
                    else {
                        panic!("a new key must be acquired");
                    };
                    let done = store.complete(&key, token, stored.clone(), TTL).await;
                    black_box(done.ok());
                }
                start.elapsed()
            })
        })
    });

    let replayed = key(u64::MAX);
    let long = ClaimOptions {
        ttl: Duration::from_secs(3600),
        ..options
    };
    rt.block_on(async {
        let Ok(Claim::Acquired(token)) = store
            .claim(&replayed, &fingerprint, OwnerToken::generate(), &long)
            .await
        else {
            panic!("a new key must be acquired");
        };
        let _ = store
            .complete(&replayed, token, stored.clone(), long.ttl)
            .await;
    });
    group.bench_function("replay_lookup", |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    let claim = store
                        .claim(
                            black_box(&replayed),
                            &fingerprint,
                            OwnerToken::generate(),
                            &long,
                        )
                        .await;
                    assert!(matches!(claim, Ok(Claim::Completed(_))));
                }
                start.elapsed()
            })
        })
    });
    group.finish();
}

criterion_group!(benches, memory_store);
criterion_main!(benches);
