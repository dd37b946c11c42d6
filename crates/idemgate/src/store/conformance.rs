//! The conformance suite every [`Store`] backend passes (the `conformance` feature).
//!
//! Each check is a plain `async fn` that takes a fresh, empty store and panics with a message
//! naming what went wrong. [`store_conformance_tests!`](crate::store_conformance_tests)
//! expands to one `#[tokio::test]` per check, so a failing backend shows which rule of the
//! [`Store`] contract it broke:
//!
//! ```ignore
//! // tests/store_memory.rs, with idemgate's `conformance` feature on for the tests
//! idemgate::store_conformance_tests!(async {
//!     std::sync::Arc::new(idemgate::store::MemoryStore::new())
//!         as std::sync::Arc<dyn idemgate::store::Store>
//! });
//! ```
//!
//! The checks use real time with short leases and ttls (hundreds of milliseconds), so a
//! backend is measured by its own clock; every sleep is bounded. Keys are random per check,
//! so a backend shared between checks (one Redis database) does not mix them up.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};

use super::{Claim, ClaimOptions, Store, Transition, UnknownOutcome};
use crate::record::{
    Completion, FingerprintHash, Hash256, OwnerToken, Record, RecordKey, StoredResponse,
};

/// A short lease, for checks that wait for one to lapse.
pub const SHORT_LEASE: Duration = Duration::from_millis(200);
/// A short ttl, for checks that wait for a record to expire.
pub const SHORT_TTL: Duration = Duration::from_millis(500);
/// A lease or ttl no check outlives.
pub const LONG: Duration = Duration::from_secs(60);
/// How far a backend's wall clock may be from this process's in a reported time.
const CLOCK_SLACK: Duration = Duration::from_secs(5);

/// What a store factory in [`store_conformance_tests!`](crate::store_conformance_tests) may
/// produce: a store; a store with what must outlive it, as a pair (`(store, server)`: the
/// server the store talks to, dropped, and so stopped, once the check is done); or `None` to
/// skip the checks (a backend whose server is not available on this machine).
pub trait ConformanceStore {
    /// The store to check, if there is one, and what must live as long as the check.
    fn into_store(self) -> Option<(Arc<dyn Store>, Box<dyn Any>)>;
}

impl ConformanceStore for Arc<dyn Store> {
    fn into_store(self) -> Option<(Arc<dyn Store>, Box<dyn Any>)> {
        Some((self, Box::new(())))
    }
}

impl ConformanceStore for Option<Arc<dyn Store>> {
    fn into_store(self) -> Option<(Arc<dyn Store>, Box<dyn Any>)> {
        self.map(|store| (store, Box::new(()) as Box<dyn Any>))
    }
}

impl<S: Store> ConformanceStore for S {
    fn into_store(self) -> Option<(Arc<dyn Store>, Box<dyn Any>)> {
        Some((Arc::new(self), Box::new(())))
    }
}

impl<S: Store, G: 'static> ConformanceStore for (S, G) {
    fn into_store(self) -> Option<(Arc<dyn Store>, Box<dyn Any>)> {
        let (store, guard) = self;
        Some((Arc::new(store), Box::new(guard)))
    }
}

/// Runs one check on what `store` produced, or says why it was skipped.
pub async fn run<C, F>(name: &str, store: C, check: impl FnOnce(Arc<dyn Store>) -> F)
where
    C: ConformanceStore,
    F: std::future::Future<Output = ()>,
{
    match store.into_store() {
        // The guard (a server the store talks to) is dropped after the check, and after the
        // store the check was given.
        Some((store, _guard)) => check(store).await,
        None => eprintln!("conformance check {name} skipped: no store"),
    }
}

/// Expands to one `#[tokio::test]` per conformance check, each on a fresh store.
///
/// The argument is an expression that evaluates to a future whose output is an
/// `Arc<dyn Store>`, a concrete [`Store`](crate::store::Store), a pair of a store and what
/// must outlive it (`(store, server)`), or an `Option<Arc<dyn Store>>` (`None` skips the
/// check). It is evaluated once per test, so it
/// must make a new, empty store each time: an `async { ... }` block or a call to an
/// `async fn`. Invoke the macro once per module (the tests have fixed names).
#[macro_export]
macro_rules! store_conformance_tests {
    ($make:expr) => {
        $crate::store_conformance_tests!(@tests $make;
            claim_complete_replays_identical_response,
            replay_keeps_repeated_headers_in_order,
            replay_keeps_every_byte_value,
            large_body_round_trips,
            empty_response_round_trips,
            too_large_completion_round_trips,
            mismatch_on_in_flight_record,
            mismatch_on_completed_record,
            mismatch_on_ambiguous_record,
            in_flight_same_fingerprint_reports_lease,
            wrong_token_is_fenced_and_changes_nothing,
            finished_owner_is_fenced,
            release_lets_next_claim_acquire,
            renew_keeps_record_past_original_lease,
            renew_extends_life_past_ttl,
            lapsed_owner_keeps_token_until_taken_over,
            lapse_with_ambiguous_turns_record_ambiguous,
            lapse_with_ambiguous_and_other_fingerprint_is_mismatch,
            lapse_with_retry_hands_record_to_new_owner,
            lapse_with_retry_ignores_fingerprint,
            mark_ambiguous_blocks_reruns,
            completed_record_expires_after_ttl,
            ambiguous_record_expires_after_ttl,
            in_flight_record_expires_after_ttl,
            complete_sets_ttl_from_completion,
            get_and_delete,
            keys_are_independent,
            ping_answers,
            racing_claims_have_one_winner,
            racing_claims_with_mixed_fingerprints_have_one_winner,
            racing_takeovers_of_lapsed_lease_have_one_winner,
        );
    };
    (@tests $make:expr; $($check:ident),+ $(,)?) => {
        $(
            #[::tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $check() {
                $crate::store::conformance::run(
                    stringify!($check),
                    $make.await,
                    $crate::store::conformance::$check,
                )
                .await;
            }
        )+
    };
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// A key no other check (nor an earlier run against a shared backend) uses.
pub fn unique_key(label: &str) -> RecordKey {
    let token = OwnerToken::generate();
    RecordKey::of(format!("{label}/{:032x}", token.0).as_bytes())
}

/// A fingerprint for `label`.
pub fn fingerprint(label: &str) -> FingerprintHash {
    FingerprintHash::of(format!("fingerprint/{label}").as_bytes())
}

/// Claim options.
pub fn options(lease: Duration, ttl: Duration, on_lapse: UnknownOutcome) -> ClaimOptions {
    ClaimOptions {
        lease,
        ttl,
        on_lapse,
    }
}

/// A long lease and ttl, lapses made ambiguous.
pub fn long_options() -> ClaimOptions {
    options(LONG, LONG, UnknownOutcome::Ambiguous)
}

/// A `201` with repeated headers interleaved with others, and a body holding every byte value
/// (NUL, invalid UTF-8, CR LF) twice.
pub fn sample_completion() -> Completion {
    let mut headers = HeaderMap::new();
    headers.append(
        "content-type",
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.append("x-thing", HeaderValue::from_static("first"));
    headers.append("location", HeaderValue::from_static("/orders/42"));
    headers.append("x-thing", HeaderValue::from_static("second"));
    headers.append("x-thing", HeaderValue::from_static("third"));
    headers.append(
        "x-opaque",
        HeaderValue::from_bytes(b"\xfe\xffbytes").expect("obs-text is a valid header value"),
    );
    let mut body: Vec<u8> = (0..=255u8).collect();
    body.extend((0..=255u8).rev());
    Completion::Response(StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from(body),
    })
}

/// Claims `key` with long options and expects to own it.
pub async fn acquire(store: &dyn Store, key: &RecordKey, fp: &FingerprintHash) -> OwnerToken {
    acquire_with(store, key, fp, &long_options()).await
}

/// Claims `key` and expects to own it.
pub async fn acquire_with(
    store: &dyn Store,
    key: &RecordKey,
    fp: &FingerprintHash,
    options: &ClaimOptions,
) -> OwnerToken {
    match store.claim(key, fp, OwnerToken::generate(), options).await {
        Ok(Claim::Acquired(token)) => token,
        other => panic!("claim of a free key: expected Acquired, got {other:?}"),
    }
}

async fn claim(
    store: &dyn Store,
    key: &RecordKey,
    fp: &FingerprintHash,
    options: &ClaimOptions,
) -> Claim {
    store
        .claim(key, fp, OwnerToken::generate(), options)
        .await
        .unwrap_or_else(|e| panic!("claim failed: {e}"))
}

async fn get(store: &dyn Store, key: &RecordKey) -> Option<Record> {
    store
        .get(key)
        .await
        .unwrap_or_else(|e| panic!("get failed: {e}"))
}

async fn complete(
    store: &dyn Store,
    key: &RecordKey,
    token: OwnerToken,
    completion: Completion,
    ttl: Duration,
) -> Transition {
    store
        .complete(key, token, completion, ttl)
        .await
        .unwrap_or_else(|e| panic!("complete failed: {e}"))
}

async fn release(store: &dyn Store, key: &RecordKey, token: OwnerToken) -> Transition {
    store
        .release(key, token)
        .await
        .unwrap_or_else(|e| panic!("release failed: {e}"))
}

async fn renew(
    store: &dyn Store,
    key: &RecordKey,
    token: OwnerToken,
    lease: Duration,
) -> Transition {
    store
        .renew(key, token, lease)
        .await
        .unwrap_or_else(|e| panic!("renew failed: {e}"))
}

async fn mark_ambiguous(
    store: &dyn Store,
    key: &RecordKey,
    token: OwnerToken,
    ttl: Duration,
) -> Transition {
    store
        .mark_ambiguous(key, token, ttl)
        .await
        .unwrap_or_else(|e| panic!("mark_ambiguous failed: {e}"))
}

/// Asserts that `token` changes nothing of `key`'s record: complete, release, renew and
/// mark_ambiguous each answer [`Transition::Fenced`]. `situation` ends each failure message
/// ("with a wrong token").
async fn assert_fenced(store: &dyn Store, key: &RecordKey, token: OwnerToken, situation: &str) {
    assert_eq!(
        complete(store, key, token, sample_completion(), LONG).await,
        Transition::Fenced,
        "complete {situation}"
    );
    assert_eq!(
        release(store, key, token).await,
        Transition::Fenced,
        "release {situation}"
    );
    assert_eq!(
        renew(store, key, token, LONG).await,
        Transition::Fenced,
        "renew {situation}"
    );
    assert_eq!(
        mark_ambiguous(store, key, token, LONG).await,
        Transition::Fenced,
        "mark_ambiguous {situation}"
    );
}

fn assert_near(what: &str, actual: SystemTime, expected: SystemTime) {
    let off = actual
        .duration_since(expected)
        .or_else(|e| Ok::<_, ()>(e.duration()))
        .unwrap_or_default();
    assert!(
        off <= CLOCK_SLACK,
        "{what}: {actual:?} is {off:?} away from the expected {expected:?}"
    );
}

/// Asserts `key` replays `expected` to a claim with `fp`, and that `get` shows it.
async fn assert_replays(
    store: &dyn Store,
    key: &RecordKey,
    fp: &FingerprintHash,
    expected: &Completion,
) {
    match claim(store, key, fp, &long_options()).await {
        Claim::Completed(c) => assert_eq!(
            *c, *expected,
            "replayed completion differs from the stored one"
        ),
        other => panic!("claim of a completed key: expected Completed, got {other:?}"),
    }
    match get(store, key).await {
        Some(Record::Completed {
            fingerprint,
            completion,
            stored_at,
        }) => {
            assert_eq!(fingerprint, *fp, "get: fingerprint of the completed record");
            assert_eq!(
                completion, *expected,
                "get: completion differs from the stored one"
            );
            assert_near("get: stored_at", stored_at, SystemTime::now());
        }
        other => panic!("get of a completed key: expected Completed, got {other:?}"),
    }
}

/// Claims, completes with `completion` and checks the replay.
async fn round_trip(store: &dyn Store, completion: Completion) {
    let key = unique_key("round-trip");
    let fp = fingerprint("round-trip");
    let token = acquire(store, &key, &fp).await;
    assert_eq!(
        complete(store, &key, token, completion.clone(), LONG).await,
        Transition::Applied,
        "complete by the owner"
    );
    assert_replays(store, &key, &fp, &completion).await;
}

// ---------------------------------------------------------------------------------------------
// Round trips.

/// Claim → complete → claim replays exactly what was completed, to every later claim.
pub async fn claim_complete_replays_identical_response(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("replay");
    let fp = fingerprint("replay");
    let token = acquire(store, &key, &fp).await;
    let completion = sample_completion();
    assert_eq!(
        complete(store, &key, token, completion.clone(), LONG).await,
        Transition::Applied
    );
    for _ in 0..3 {
        assert_replays(store, &key, &fp, &completion).await;
    }
}

/// Repeated header fields come back in the order they were stored.
pub async fn replay_keeps_repeated_headers_in_order(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("headers");
    let fp = fingerprint("headers");
    let token = acquire(store, &key, &fp).await;
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Applied
    );
    let Claim::Completed(c) = claim(store, &key, &fp, &long_options()).await else {
        panic!("expected a replay");
    };
    let Completion::Response(r) = &*c else {
        panic!("expected a stored response, got {c:?}");
    };
    let values: Vec<&[u8]> = r
        .headers
        .get_all("x-thing")
        .iter()
        .map(|v| v.as_bytes())
        .collect();
    assert_eq!(
        values,
        [&b"first"[..], b"second", b"third"],
        "repeated header order"
    );
    assert_eq!(r.headers.len(), 6, "header count");
    assert_eq!(
        r.headers.get("x-opaque").map(|v| v.as_bytes()),
        Some(&b"\xfe\xffbytes"[..]),
        "non-ASCII header value"
    );
}

/// A body holding every byte value comes back byte for byte.
pub async fn replay_keeps_every_byte_value(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("binary");
    let fp = fingerprint("binary");
    let token = acquire(store, &key, &fp).await;
    let body: Vec<u8> = (0..=255u8).chain(0..=255u8).collect();
    let completion = Completion::Response(StoredResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from(body.clone()),
    });
    assert_eq!(
        complete(store, &key, token, completion, LONG).await,
        Transition::Applied
    );
    let Claim::Completed(c) = claim(store, &key, &fp, &long_options()).await else {
        panic!("expected a replay");
    };
    let Completion::Response(r) = &*c else {
        panic!("expected a stored response, got {c:?}");
    };
    assert_eq!(r.body.len(), 512, "body length");
    assert_eq!(&r.body[..], &body[..], "body bytes");
}

/// A 1 MiB body of varied bytes round-trips.
pub async fn large_body_round_trips(store: Arc<dyn Store>) {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let body: Vec<u8> = (0..1024 * 1024)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect();
    let completion = Completion::Response(StoredResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from(body),
    });
    round_trip(&*store, completion).await;
}

/// A response with no headers and no body round-trips.
pub async fn empty_response_round_trips(store: Arc<dyn Store>) {
    let completion = Completion::Response(StoredResponse {
        status: StatusCode::NO_CONTENT,
        headers: HeaderMap::new(),
        body: Bytes::new(),
    });
    round_trip(&*store, completion).await;
}

/// A response that was too large to keep is completed as such and replays as such.
pub async fn too_large_completion_round_trips(store: Arc<dyn Store>) {
    let completion = Completion::TooLarge {
        status: StatusCode::ACCEPTED,
        body_digest: Hash256::of(b"the body the first client got"),
        body_len: 50 * 1024 * 1024 + 7,
    };
    round_trip(&*store, completion).await;
}

// ---------------------------------------------------------------------------------------------
// Fingerprints.

/// A different fingerprint on an in-flight record is a mismatch, and takes nothing over.
pub async fn mismatch_on_in_flight_record(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("mismatch-in-flight");
    let fp = fingerprint("a");
    let token = acquire(store, &key, &fp).await;
    for on_lapse in [UnknownOutcome::Ambiguous, UnknownOutcome::Retry] {
        assert_eq!(
            claim(
                store,
                &key,
                &fingerprint("b"),
                &options(LONG, LONG, on_lapse)
            )
            .await,
            Claim::Mismatch,
            "other fingerprint on an in-flight record ({on_lapse:?})"
        );
    }
    assert!(
        matches!(get(store, &key).await, Some(Record::InFlight { fingerprint, .. }) if fingerprint == fp),
        "the mismatched claim changed the in-flight record"
    );
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Applied,
        "the owner lost its record to a mismatched claim"
    );
}

/// A different fingerprint on a completed record is a mismatch, not a replay.
pub async fn mismatch_on_completed_record(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("mismatch-completed");
    let fp = fingerprint("a");
    let token = acquire(store, &key, &fp).await;
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Applied
    );
    assert_eq!(
        claim(store, &key, &fingerprint("b"), &long_options()).await,
        Claim::Mismatch,
        "other fingerprint on a completed record"
    );
    assert_replays(store, &key, &fp, &sample_completion()).await;
}

/// A different fingerprint on an ambiguous record is a mismatch.
pub async fn mismatch_on_ambiguous_record(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("mismatch-ambiguous");
    let fp = fingerprint("a");
    let token = acquire(store, &key, &fp).await;
    assert_eq!(
        mark_ambiguous(store, &key, token, LONG).await,
        Transition::Applied
    );
    for on_lapse in [UnknownOutcome::Ambiguous, UnknownOutcome::Retry] {
        assert_eq!(
            claim(
                store,
                &key,
                &fingerprint("b"),
                &options(LONG, LONG, on_lapse)
            )
            .await,
            Claim::Mismatch,
            "other fingerprint on an ambiguous record ({on_lapse:?})"
        );
    }
    assert_eq!(
        claim(store, &key, &fp, &long_options()).await,
        Claim::Ambiguous,
        "same fingerprint on an ambiguous record"
    );
}

// ---------------------------------------------------------------------------------------------
// Leases and fencing.

/// The same fingerprint on a live in-flight record reports the owner's lease, at most the
/// lease that was taken.
pub async fn in_flight_same_fingerprint_reports_lease(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("in-flight");
    let fp = fingerprint("a");
    let lease = Duration::from_secs(20);
    let before = SystemTime::now();
    acquire_with(
        store,
        &key,
        &fp,
        &options(lease, LONG, UnknownOutcome::Ambiguous),
    )
    .await;
    match claim(store, &key, &fp, &long_options()).await {
        Claim::InFlight { lease_remaining } => {
            assert!(
                lease_remaining <= lease,
                "lease_remaining {lease_remaining:?} exceeds the lease {lease:?}"
            );
            assert!(
                lease_remaining > lease / 2,
                "lease_remaining {lease_remaining:?} is far below the fresh lease {lease:?}"
            );
        }
        other => {
            panic!("same fingerprint on an in-flight record: expected InFlight, got {other:?}")
        }
    }
    match get(store, &key).await {
        Some(Record::InFlight {
            fingerprint,
            lease_deadline,
        }) => {
            assert_eq!(fingerprint, fp);
            assert_near("get: lease_deadline", lease_deadline, before + lease);
        }
        other => panic!("get of an in-flight key: expected InFlight, got {other:?}"),
    }
}

/// Every fenced transition with a token that never owned the record is refused and leaves
/// the record as it was.
pub async fn wrong_token_is_fenced_and_changes_nothing(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("fenced");
    let fp = fingerprint("a");
    let token = acquire_with(
        store,
        &key,
        &fp,
        &options(Duration::from_secs(20), LONG, UnknownOutcome::Ambiguous),
    )
    .await;
    let before = get(store, &key).await;
    let stranger = OwnerToken::generate();
    assert_ne!(stranger, token);
    assert_fenced(store, &key, stranger, "with a wrong token").await;
    assert_eq!(
        get(store, &key).await,
        before,
        "a fenced call changed the record"
    );
    match claim(store, &key, &fp, &long_options()).await {
        Claim::InFlight { lease_remaining } => assert!(
            lease_remaining <= Duration::from_secs(20),
            "a fenced renew extended the lease to {lease_remaining:?}"
        ),
        other => panic!("expected the record still in flight, got {other:?}"),
    }
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Applied,
        "the real owner after fenced calls"
    );

    let missing = unique_key("fenced-missing");
    assert_fenced(store, &missing, token, "of a missing key").await;
    assert_eq!(
        get(store, &missing).await,
        None,
        "a fenced call created a record"
    );
}

/// Once a record is completed or ambiguous, its former owner's token changes nothing.
pub async fn finished_owner_is_fenced(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("finished");
    let fp = fingerprint("a");
    let token = acquire(store, &key, &fp).await;
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Applied
    );
    let other = Completion::TooLarge {
        status: StatusCode::OK,
        body_digest: Hash256::of(b"other"),
        body_len: 1,
    };
    assert_eq!(
        complete(store, &key, token, other, LONG).await,
        Transition::Fenced,
        "a second complete overwrote a completed record"
    );
    assert_fenced(store, &key, token, "of a completed record").await;
    assert_replays(store, &key, &fp, &sample_completion()).await;

    let key = unique_key("finished-ambiguous");
    let token = acquire(store, &key, &fp).await;
    assert_eq!(
        mark_ambiguous(store, &key, token, LONG).await,
        Transition::Applied
    );
    assert_fenced(store, &key, token, "of an ambiguous record").await;
    assert_eq!(
        claim(store, &key, &fp, &long_options()).await,
        Claim::Ambiguous
    );
}

/// Release removes the record: the next claim acquires with a new token and the old one is
/// fenced.
pub async fn release_lets_next_claim_acquire(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("release");
    let fp = fingerprint("a");
    let first = acquire(store, &key, &fp).await;
    assert_eq!(
        release(store, &key, first).await,
        Transition::Applied,
        "release by the owner"
    );
    assert_eq!(
        get(store, &key).await,
        None,
        "a released record is still there"
    );
    assert_eq!(
        release(store, &key, first).await,
        Transition::Fenced,
        "a second release"
    );
    let second = acquire(store, &key, &fp).await;
    assert_ne!(first, second, "a new claim reused the old token");
    assert_eq!(
        complete(store, &key, first, sample_completion(), LONG).await,
        Transition::Fenced,
        "the released owner completed the new owner's record"
    );
    assert_eq!(
        complete(store, &key, second, sample_completion(), LONG).await,
        Transition::Applied
    );
}

/// Renewing moves the lease forward: after the original lease, the record is still in
/// flight and a claim that would take over a lapsed lease does not.
pub async fn renew_keeps_record_past_original_lease(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("renew");
    let fp = fingerprint("a");
    let token = acquire_with(
        store,
        &key,
        &fp,
        &options(SHORT_LEASE, LONG, UnknownOutcome::Retry),
    )
    .await;
    assert_eq!(
        renew(store, &key, token, Duration::from_secs(20)).await,
        Transition::Applied,
        "renew by the owner"
    );
    tokio::time::sleep(SHORT_LEASE * 3).await;
    for on_lapse in [UnknownOutcome::Retry, UnknownOutcome::Ambiguous] {
        match claim(store, &key, &fp, &options(LONG, LONG, on_lapse)).await {
            Claim::InFlight { lease_remaining } => assert!(
                lease_remaining > Duration::from_secs(10)
                    && lease_remaining <= Duration::from_secs(20),
                "lease_remaining {lease_remaining:?} after renewing to 20 s"
            ),
            other => panic!(
                "claim after the original lease of a renewed record: expected InFlight, got {other:?}"
            ),
        }
    }
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Applied,
        "the renewed owner completes"
    );
}

/// Renewing extends an in-flight record's life to at least the new lease, past its ttl.
pub async fn renew_extends_life_past_ttl(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("renew-ttl");
    let fp = fingerprint("a");
    let ttl = Duration::from_millis(800);
    let token = acquire_with(
        store,
        &key,
        &fp,
        &options(SHORT_LEASE, ttl, UnknownOutcome::Retry),
    )
    .await;
    assert_eq!(
        renew(store, &key, token, Duration::from_secs(20)).await,
        Transition::Applied
    );
    tokio::time::sleep(ttl * 2).await;
    assert!(
        matches!(get(store, &key).await, Some(Record::InFlight { .. })),
        "a renewed record vanished at its original ttl"
    );
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Applied
    );
}

/// An owner whose lease lapsed, with no claim since, can still finish.
pub async fn lapsed_owner_keeps_token_until_taken_over(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("lapsed-owner");
    let fp = fingerprint("a");
    let token = acquire_with(
        store,
        &key,
        &fp,
        &options(SHORT_LEASE, LONG, UnknownOutcome::Retry),
    )
    .await;
    tokio::time::sleep(SHORT_LEASE * 2).await;
    assert_eq!(
        renew(store, &key, token, Duration::from_secs(20)).await,
        Transition::Applied,
        "renew after a lapse that nobody took over"
    );
    assert!(
        matches!(
            claim(
                store,
                &key,
                &fp,
                &options(LONG, LONG, UnknownOutcome::Retry)
            )
            .await,
            Claim::InFlight { .. }
        ),
        "the renewed lease was taken over"
    );
    let key = unique_key("lapsed-owner-complete");
    let token = acquire_with(
        store,
        &key,
        &fp,
        &options(SHORT_LEASE, LONG, UnknownOutcome::Retry),
    )
    .await;
    tokio::time::sleep(SHORT_LEASE * 2).await;
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Applied,
        "complete after a lapse that nobody took over"
    );
    assert_replays(store, &key, &fp, &sample_completion()).await;
}

/// A claim finding a lapsed lease with `on_lapse = Ambiguous` turns the record ambiguous,
/// and the old owner is fenced from then on.
pub async fn lapse_with_ambiguous_turns_record_ambiguous(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("lapse-ambiguous");
    let fp = fingerprint("a");
    let token = acquire_with(
        store,
        &key,
        &fp,
        &options(SHORT_LEASE, LONG, UnknownOutcome::Ambiguous),
    )
    .await;
    tokio::time::sleep(SHORT_LEASE * 2).await;
    let before = SystemTime::now();
    assert_eq!(
        claim(
            store,
            &key,
            &fp,
            &options(LONG, LONG, UnknownOutcome::Ambiguous)
        )
        .await,
        Claim::Ambiguous,
        "claim of a lapsed lease with on_lapse = Ambiguous"
    );
    match get(store, &key).await {
        Some(Record::Ambiguous { fingerprint, since }) => {
            assert_eq!(fingerprint, fp);
            assert_near("get: ambiguous since", since, before);
        }
        other => panic!("get after a lapse made ambiguous: expected Ambiguous, got {other:?}"),
    }
    assert_fenced(
        store,
        &key,
        token,
        "by the lapsed owner of a record made ambiguous",
    )
    .await;
    assert_eq!(
        claim(
            store,
            &key,
            &fp,
            &options(LONG, LONG, UnknownOutcome::Retry)
        )
        .await,
        Claim::Ambiguous,
        "an ambiguous record is not retried even by a claim with on_lapse = Retry"
    );
}

/// A claim with another fingerprint finding a lapsed lease with `on_lapse = Ambiguous` is a
/// mismatch, and the record turns ambiguous under its own fingerprint.
pub async fn lapse_with_ambiguous_and_other_fingerprint_is_mismatch(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("lapse-ambiguous-mismatch");
    let fp = fingerprint("a");
    let token = acquire_with(
        store,
        &key,
        &fp,
        &options(SHORT_LEASE, LONG, UnknownOutcome::Ambiguous),
    )
    .await;
    tokio::time::sleep(SHORT_LEASE * 2).await;
    assert_eq!(
        claim(
            store,
            &key,
            &fingerprint("b"),
            &options(LONG, LONG, UnknownOutcome::Ambiguous)
        )
        .await,
        Claim::Mismatch,
        "other fingerprint on a lapsed lease with on_lapse = Ambiguous"
    );
    assert!(
        matches!(get(store, &key).await, Some(Record::Ambiguous { fingerprint, .. }) if fingerprint == fp),
        "the lapsed record should be ambiguous under its own fingerprint"
    );
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Fenced
    );
}

/// A claim finding a lapsed lease with `on_lapse = Retry` takes the record over with a new
/// token; the old owner is fenced.
pub async fn lapse_with_retry_hands_record_to_new_owner(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("lapse-retry");
    let fp = fingerprint("a");
    let old = acquire_with(
        store,
        &key,
        &fp,
        &options(SHORT_LEASE, LONG, UnknownOutcome::Retry),
    )
    .await;
    tokio::time::sleep(SHORT_LEASE * 2).await;
    let new = acquire_with(
        store,
        &key,
        &fp,
        &options(LONG, LONG, UnknownOutcome::Retry),
    )
    .await;
    assert_ne!(old, new, "the takeover reused the old token");
    assert_fenced(store, &key, old, "by the old owner after a takeover").await;
    assert!(
        matches!(
            claim(store, &key, &fp, &long_options()).await,
            Claim::InFlight { .. }
        ),
        "the new owner's record should be in flight"
    );
    let completion = Completion::Response(StoredResponse {
        status: StatusCode::OK,
        headers: HeaderMap::new(),
        body: Bytes::from_static(b"second run"),
    });
    assert_eq!(
        complete(store, &key, new, completion.clone(), LONG).await,
        Transition::Applied
    );
    assert_replays(store, &key, &fp, &completion).await;
}

/// `on_lapse = Retry` replaces a lapsed record whatever its fingerprint.
pub async fn lapse_with_retry_ignores_fingerprint(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("lapse-retry-other");
    let old = acquire_with(
        store,
        &key,
        &fingerprint("a"),
        &options(SHORT_LEASE, LONG, UnknownOutcome::Retry),
    )
    .await;
    tokio::time::sleep(SHORT_LEASE * 2).await;
    let new = acquire_with(
        store,
        &key,
        &fingerprint("b"),
        &options(LONG, LONG, UnknownOutcome::Retry),
    )
    .await;
    assert_ne!(old, new);
    assert!(
        matches!(get(store, &key).await, Some(Record::InFlight { fingerprint: f, .. }) if f == fingerprint("b")),
        "the new claim's fingerprint should be kept"
    );
    assert_eq!(release(store, &key, old).await, Transition::Fenced);
    assert_eq!(
        claim(store, &key, &fingerprint("a"), &long_options()).await,
        Claim::Mismatch
    );
}

/// An owner marking its record ambiguous stops every later run of the same request.
pub async fn mark_ambiguous_blocks_reruns(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("mark-ambiguous");
    let fp = fingerprint("a");
    let token = acquire(store, &key, &fp).await;
    let before = SystemTime::now();
    assert_eq!(
        mark_ambiguous(store, &key, token, LONG).await,
        Transition::Applied
    );
    match get(store, &key).await {
        Some(Record::Ambiguous { fingerprint, since }) => {
            assert_eq!(fingerprint, fp);
            assert_near("get: ambiguous since", since, before);
        }
        other => panic!("get of a key marked ambiguous: expected Ambiguous, got {other:?}"),
    }
    for on_lapse in [UnknownOutcome::Ambiguous, UnknownOutcome::Retry] {
        assert_eq!(
            claim(store, &key, &fp, &options(LONG, LONG, on_lapse)).await,
            Claim::Ambiguous,
            "claim of an ambiguous key ({on_lapse:?})"
        );
    }
    assert_eq!(
        mark_ambiguous(store, &key, token, LONG).await,
        Transition::Fenced
    );
}

// ---------------------------------------------------------------------------------------------
// TTL.

/// Waits twice [`SHORT_TTL`], then asserts `key`'s record (set with that ttl) has vanished
/// and the next claim acquires.
async fn assert_expires(store: &dyn Store, key: &RecordKey, fp: &FingerprintHash, what: &str) {
    tokio::time::sleep(SHORT_TTL * 2).await;
    assert_eq!(
        get(store, key).await,
        None,
        "{what} still there after its ttl"
    );
    acquire(store, key, fp).await;
}

/// A completed record vanishes `ttl` after completion; the next claim runs again.
pub async fn completed_record_expires_after_ttl(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("ttl-completed");
    let fp = fingerprint("a");
    let token = acquire(store, &key, &fp).await;
    assert_eq!(
        complete(store, &key, token, sample_completion(), SHORT_TTL).await,
        Transition::Applied
    );
    assert!(matches!(
        get(store, &key).await,
        Some(Record::Completed { .. })
    ));
    assert_expires(store, &key, &fp, "completed record").await;
}

/// An ambiguous record vanishes `ttl` after it was marked.
pub async fn ambiguous_record_expires_after_ttl(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("ttl-ambiguous");
    let fp = fingerprint("a");
    let token = acquire(store, &key, &fp).await;
    assert_eq!(
        mark_ambiguous(store, &key, token, SHORT_TTL).await,
        Transition::Applied
    );
    assert_eq!(
        claim(store, &key, &fp, &long_options()).await,
        Claim::Ambiguous
    );
    assert_expires(store, &key, &fp, "ambiguous record").await;
}

/// An in-flight record vanishes at its ttl; its owner is fenced afterwards.
pub async fn in_flight_record_expires_after_ttl(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("ttl-in-flight");
    let fp = fingerprint("a");
    let token = acquire_with(
        store,
        &key,
        &fp,
        &options(SHORT_LEASE, SHORT_TTL, UnknownOutcome::Ambiguous),
    )
    .await;
    tokio::time::sleep(SHORT_TTL * 2).await;
    assert_eq!(
        get(store, &key).await,
        None,
        "in-flight record still there after its ttl"
    );
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Fenced,
        "the owner of an expired record completed it"
    );
    acquire(store, &key, &fp).await;
}

/// Completing sets the record's life from the completion, not from the claim.
pub async fn complete_sets_ttl_from_completion(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("ttl-from-complete");
    let fp = fingerprint("a");
    let token = acquire_with(
        store,
        &key,
        &fp,
        &options(SHORT_TTL, SHORT_TTL, UnknownOutcome::Ambiguous),
    )
    .await;
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Applied
    );
    tokio::time::sleep(SHORT_TTL * 2).await;
    assert_replays(store, &key, &fp, &sample_completion()).await;
}

// ---------------------------------------------------------------------------------------------
// Get, delete, ping, independence.

/// `get` shows each state; `delete` removes any record and tells whether there was one.
pub async fn get_and_delete(store: Arc<dyn Store>) {
    let store = &*store;
    let key = unique_key("get-delete");
    let fp = fingerprint("a");
    assert_eq!(get(store, &key).await, None, "get of a fresh key");
    assert!(
        !store.delete(&key).await.expect("delete"),
        "delete of a fresh key reported a record"
    );

    let token = acquire(store, &key, &fp).await;
    assert!(matches!(
        get(store, &key).await,
        Some(Record::InFlight { .. })
    ));
    assert!(
        store.delete(&key).await.expect("delete"),
        "delete of an in-flight record"
    );
    assert_eq!(get(store, &key).await, None, "get after delete");
    assert!(
        !store.delete(&key).await.expect("delete"),
        "second delete reported a record"
    );
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Fenced,
        "the owner of a deleted record completed it"
    );

    let token = acquire(store, &key, &fp).await;
    assert_eq!(
        mark_ambiguous(store, &key, token, LONG).await,
        Transition::Applied
    );
    assert!(
        store.delete(&key).await.expect("delete"),
        "delete of an ambiguous record"
    );
    let token = acquire(store, &key, &fp).await;
    assert_eq!(
        complete(store, &key, token, sample_completion(), LONG).await,
        Transition::Applied
    );
    assert!(
        store.delete(&key).await.expect("delete"),
        "delete of a completed record"
    );
    acquire(store, &key, &fp).await;
}

/// Records under different keys do not affect each other.
pub async fn keys_are_independent(store: Arc<dyn Store>) {
    let store = &*store;
    let fp = fingerprint("a");
    let keys: Vec<RecordKey> = (0..3)
        .map(|i| unique_key(&format!("independent-{i}")))
        .collect();
    let tokens = [
        acquire(store, &keys[0], &fp).await,
        acquire(store, &keys[1], &fp).await,
        acquire(store, &keys[2], &fp).await,
    ];
    assert_eq!(
        complete(store, &keys[0], tokens[0], sample_completion(), LONG).await,
        Transition::Applied
    );
    assert_eq!(
        mark_ambiguous(store, &keys[1], tokens[1], LONG).await,
        Transition::Applied
    );
    assert_eq!(
        complete(store, &keys[2], tokens[0], sample_completion(), LONG).await,
        Transition::Fenced,
        "one key's token completed another key"
    );
    assert!(matches!(
        claim(store, &keys[0], &fp, &long_options()).await,
        Claim::Completed(_)
    ));
    assert_eq!(
        claim(store, &keys[1], &fp, &long_options()).await,
        Claim::Ambiguous
    );
    assert!(matches!(
        claim(store, &keys[2], &fp, &long_options()).await,
        Claim::InFlight { .. }
    ));
}

/// `ping` answers and the backend has a name.
pub async fn ping_answers(store: Arc<dyn Store>) {
    store
        .ping()
        .await
        .unwrap_or_else(|e| panic!("ping failed: {e}"));
    assert!(!store.backend().is_empty(), "backend name is empty");
}

// ---------------------------------------------------------------------------------------------
// Races.

/// Racers per key in the race checks.
pub const RACERS: usize = 64;

/// Runs `RACERS` claims of `key` at once (released together by a barrier) and returns what
/// each got.
async fn race(
    store: &Arc<dyn Store>,
    key: RecordKey,
    fingerprints: impl Fn(usize) -> FingerprintHash,
    options: ClaimOptions,
) -> Vec<(FingerprintHash, Claim)> {
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
    let tasks: Vec<_> = (0..RACERS)
        .map(|i| {
            let store = Arc::clone(store);
            let barrier = Arc::clone(&barrier);
            let fp = fingerprints(i);
            tokio::spawn(async move {
                barrier.wait().await;
                let claim = store
                    .claim(&key, &fp, OwnerToken::generate(), &options)
                    .await;
                (fp, claim)
            })
        })
        .collect();
    let mut out = Vec::with_capacity(RACERS);
    for task in tasks {
        let (fp, claim) = task.await.expect("racing claim task panicked");
        out.push((
            fp,
            claim.unwrap_or_else(|e| panic!("racing claim failed: {e}")),
        ));
    }
    out
}

/// 64 tasks claim one key at once, for 200 keys: each time exactly one acquires and every
/// other one sees it in flight.
pub async fn racing_claims_have_one_winner(store: Arc<dyn Store>) {
    let fp = fingerprint("race");
    for round in 0..200 {
        let key = unique_key(&format!("race-{round}"));
        let results = race(&store, key, |_| fp, long_options()).await;
        let winners = results
            .iter()
            .filter(|(_, c)| matches!(c, Claim::Acquired(_)))
            .count();
        assert_eq!(
            winners, 1,
            "round {round}: {winners} of {RACERS} racing claims acquired"
        );
        for (_, c) in &results {
            assert!(
                matches!(c, Claim::Acquired(_) | Claim::InFlight { .. }),
                "round {round}: a losing claim got {c:?}"
            );
        }
    }
}

/// As [`racing_claims_have_one_winner`], with every other racer sending a different request:
/// one acquires, racers with the winner's fingerprint see it in flight, the others mismatch.
pub async fn racing_claims_with_mixed_fingerprints_have_one_winner(store: Arc<dyn Store>) {
    let fps = [fingerprint("race-a"), fingerprint("race-b")];
    for round in 0..50 {
        let key = unique_key(&format!("race-mixed-{round}"));
        let results = race(&store, key, |i| fps[i % 2], long_options()).await;
        let winners: Vec<_> = results
            .iter()
            .filter(|(_, c)| matches!(c, Claim::Acquired(_)))
            .map(|(fp, _)| *fp)
            .collect();
        assert_eq!(
            winners.len(),
            1,
            "round {round}: {} racing claims acquired",
            winners.len()
        );
        for (fp, c) in &results {
            match c {
                Claim::Acquired(_) => {}
                Claim::InFlight { .. } => assert_eq!(
                    *fp, winners[0],
                    "round {round}: in flight for a loser with another fingerprint"
                ),
                Claim::Mismatch => assert_ne!(
                    *fp, winners[0],
                    "round {round}: mismatch for the winner's fingerprint"
                ),
                other => panic!("round {round}: a losing claim got {other:?}"),
            }
        }
    }
}

/// 64 tasks find the same lapsed lease at once with `on_lapse = Retry`: exactly one takes it
/// over.
pub async fn racing_takeovers_of_lapsed_lease_have_one_winner(store: Arc<dyn Store>) {
    let fp = fingerprint("takeover");
    let keys: Vec<RecordKey> = (0..20)
        .map(|i| unique_key(&format!("takeover-{i}")))
        .collect();
    let lapsing = options(SHORT_LEASE, LONG, UnknownOutcome::Retry);
    let mut old_tokens = Vec::with_capacity(keys.len());
    for key in &keys {
        old_tokens.push(acquire_with(&*store, key, &fp, &lapsing).await);
    }
    tokio::time::sleep(SHORT_LEASE * 2).await;
    for (round, (key, old)) in keys.iter().zip(old_tokens).enumerate() {
        let results = race(
            &store,
            *key,
            |_| fp,
            options(LONG, LONG, UnknownOutcome::Retry),
        )
        .await;
        let winners: Vec<OwnerToken> = results
            .iter()
            .filter_map(|(_, c)| match c {
                Claim::Acquired(t) => Some(*t),
                _ => None,
            })
            .collect();
        assert_eq!(
            winners.len(),
            1,
            "key {round}: {} racing takeovers acquired",
            winners.len()
        );
        assert_ne!(
            winners[0], old,
            "key {round}: the takeover reused the old token"
        );
        assert_eq!(
            complete(&*store, key, old, sample_completion(), LONG).await,
            Transition::Fenced,
            "key {round}: the lapsed owner completed after a takeover"
        );
        assert_eq!(
            complete(&*store, key, winners[0], sample_completion(), LONG).await,
            Transition::Applied,
            "key {round}: the winner could not complete"
        );
    }
}
