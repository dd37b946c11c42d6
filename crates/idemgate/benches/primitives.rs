//! The per-request pure work of a keyed request: hashing the request, reading its key, and
//! encoding and decoding what a store keeps.
//!
//! `cargo bench --bench primitives`

use std::hint::black_box;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri};
use idemgate::fingerprint;
use idemgate::key;
use idemgate::record::{Completion, StoredResponse};

fn request_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(
        AUTHORIZATION,
        HeaderValue::from_static("Bearer sk_test_4eC39HqLyjWDarjtT1zdp7dc"),
    );
    headers.insert(
        "idempotency-key",
        HeaderValue::from_static("8e03978e-40d5-43e8-bc93-6894a57f9324"),
    );
    headers.insert("user-agent", HeaderValue::from_static("bench/1.0"));
    headers.insert("accept", HeaderValue::from_static("*/*"));
    headers
}

fn fingerprints(c: &mut Criterion) {
    let headers = request_headers();
    let uri: Uri = "/v1/payments?expand=customer".parse().expect("static uri");
    let mut group = c.benchmark_group("fingerprint");
    for (name, len) in [("1KiB", 1024), ("64KiB", 64 * 1024)] {
        let body = vec![b'x'; len];
        group.throughput(Throughput::Bytes(len as u64));
        group.bench_function(name, |b| {
            b.iter(|| {
                fingerprint::fingerprint(
                    black_box(&Method::POST),
                    black_box(&uri),
                    black_box(&headers),
                    &[CONTENT_TYPE],
                    black_box(&body),
                )
            })
        });
    }
    group.finish();

    c.bench_function("record_key", |b| {
        b.iter(|| {
            fingerprint::record_key(
                black_box("default"),
                &[AUTHORIZATION],
                black_box(&headers),
                black_box("8e03978e-40d5-43e8-bc93-6894a57f9324"),
            )
        })
    });
}

fn keys(c: &mut Criterion) {
    let headers = request_headers();
    let name = HeaderName::from_static("idempotency-key");
    let mut group = c.benchmark_group("key");
    group.bench_function("from_header", |b| {
        b.iter(|| key::from_header(black_box(&headers), &name))
    });
    group.bench_function("parse_sf_string", |b| {
        b.iter(|| key::parse_value(black_box(br#""8e03978e-40d5-43e8-bc93-6894a57f9324""#)))
    });
    group.finish();
}

/// A typical stored JSON response: a few end-to-end headers and ~200 bytes of body.
fn completion() -> Completion {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert("content-length", HeaderValue::from_static("200"));
    headers.insert(
        "date",
        HeaderValue::from_static("Sat, 21 Nov 2026 13:00:00 GMT"),
    );
    headers.insert(
        "x-request-id",
        HeaderValue::from_static("req_8e03978e40d543e8"),
    );
    Completion::Response(StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from(vec![b'j'; 200]),
    })
}

fn records(c: &mut Criterion) {
    let completion = completion();
    let encoded = completion.encode();
    let mut group = c.benchmark_group("completion");
    group.bench_function("encode", |b| b.iter(|| black_box(&completion).encode()));
    group.bench_function("decode", |b| {
        b.iter(|| Completion::decode(black_box(encoded.clone())))
    });
    group.finish();
}

criterion_group!(benches, fingerprints, keys, records);
criterion_main!(benches);
