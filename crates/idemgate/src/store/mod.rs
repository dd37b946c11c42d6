//! The store contract every backend implements, and the backends.
//!
//! A [`Store`] keeps one [`Record`] per [`RecordKey`]. Each method is one atomic step in the
//! backend; the layer never reads a record and then writes it, so two gateways sharing a
//! store can never both run a request.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::record::{Completion, FingerprintHash, OwnerToken, Record, RecordKey};

#[cfg(feature = "redb")]
mod answer_queue;
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
mod decision;
mod key_hash;
mod memory;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redb")]
mod redb;
#[cfg(feature = "redis")]
mod redis;

#[cfg(feature = "postgres")]
pub use self::postgres::{PostgresStore, PostgresStoreConfig};
#[cfg(feature = "redb")]
pub use self::redb::RedbStore;
#[cfg(feature = "redis")]
pub use self::redis::{EvictionPolicy, Persistence, RedisStore, RedisStoreConfig};
pub use memory::{MemoryStore, MemoryStoreConfig};

/// A boxed error, the cause a backend keeps inside a [`StoreError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What the route decided to do when an in-flight record's outcome is unknown (the upstream
/// timed out after the request was sent, or the owning gateway died and its lease lapsed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnknownOutcome {
    /// Keep an ambiguous record: the request is never run again on its own (at most once).
    Ambiguous,
    /// Forget the attempt: the next retry runs the request again (at least once).
    Retry,
}

/// Parameters of one [`Store::claim`].
#[derive(Clone, Copy, Debug)]
pub struct ClaimOptions {
    /// How long the claim holds without renewal.
    pub lease: Duration,
    /// How long the record may live at all (in-flight, completed or ambiguous), from now.
    pub ttl: Duration,
    /// What a lapsed lease found by this claim turns into.
    pub on_lapse: UnknownOutcome,
}

/// The answer to [`Store::claim`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// No live record existed (or a lapsed one was reclaimable): the caller owns the key now
    /// under the token it passed, and must complete, release or mark it ambiguous with it.
    Acquired(OwnerToken),
    /// Another owner holds a live lease for the same fingerprint.
    InFlight {
        /// Time left on that owner's lease.
        lease_remaining: Duration,
    },
    /// The request already ran and this is what was kept. Shared, so a hot replay copies
    /// nothing.
    Completed(Arc<Completion>),
    /// The same request was sent upstream before and its outcome is unknown.
    Ambiguous,
    /// A live record exists under this key for a different fingerprint.
    Mismatch,
}

/// The answer to a fenced transition (complete, release, renew, mark ambiguous).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[must_use]
pub enum Transition {
    /// The caller's token was current and the change is made.
    Applied,
    /// The caller no longer owns the record (its lease was taken over, or the record is gone
    /// or no longer in flight); nothing was changed.
    Fenced,
}

/// Why a store call failed. Keeps the backend's own error as its source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend could not be reached or answered with an error.
    #[error("{backend} store unavailable")]
    Unavailable {
        /// Which backend.
        backend: &'static str,
        /// The backend's error.
        #[source]
        source: BoxError,
    },
    /// The call did not finish within the store timeout.
    #[error("{backend} store did not answer within {after:?}")]
    Timeout {
        /// Which backend.
        backend: &'static str,
        /// The timeout that passed.
        after: Duration,
    },
    /// The store is full; it refuses new claims rather than evict a live record (evicting one
    /// would let a retry run a second time).
    #[error("{backend} store is at capacity ({capacity} records)")]
    AtCapacity {
        /// Which backend.
        backend: &'static str,
        /// The configured capacity.
        capacity: usize,
    },
    /// A record could not be decoded.
    #[error("{backend} store holds an undecodable record")]
    Corrupt {
        /// Which backend.
        backend: &'static str,
        /// What was wrong with it.
        #[source]
        source: crate::record::DecodeError,
    },
}

/// What a store knows about records its backend lost behind its back (see
/// [`Store::data_loss`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DataLossStatus {
    /// Set from the moment a loss is found until an operator acknowledges it
    /// ([`Store::acknowledge_data_loss`]); meanwhile the store refuses new claims.
    pub unacknowledged: Option<DataLoss>,
    /// How many losses this store has found since it was set up.
    pub detected: u64,
}

/// One loss of data a store found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DataLoss {
    /// When the store found it.
    pub detected_at: std::time::SystemTime,
    /// What it found, e.g. that its marker key vanished.
    pub what: &'static str,
}

/// Decodes a completion `backend` stored in [`Completion::encode`]'s form; a failure is
/// [`StoreError::Corrupt`].
fn decode_completion(
    backend: &'static str,
    encoded: bytes::Bytes,
) -> Result<Completion, StoreError> {
    Completion::decode(encoded).map_err(|source| StoreError::Corrupt { backend, source })
}

/// The idempotency record store.
///
/// # Contract
///
/// - **Atomicity.** Every method is one atomic step in the backend: no caller ever observes
///   or acts on a half-made change, and two concurrent [`claim`](Store::claim)s of one key,
///   from one process or from many sharing the backend, never both return
///   [`Claim::Acquired`].
/// - **Fingerprints.** A claim that finds a live record with a different fingerprint returns
///   [`Claim::Mismatch`] whatever the record's state.
/// - **Leases.** A claim's lease ends at `now + lease` unless [`renew`](Store::renew)ed. A
///   claim that finds an in-flight record whose lease has ended applies its own
///   `on_lapse`: [`UnknownOutcome::Ambiguous`] turns the record ambiguous (and answers as for
///   an ambiguous record); [`UnknownOutcome::Retry`] replaces it with a new claim, whatever
///   its fingerprint (the old attempt is forgotten, as if released).
/// - **Fencing.** [`complete`](Store::complete), [`release`](Store::release),
///   [`renew`](Store::renew) and [`mark_ambiguous`](Store::mark_ambiguous) change the record
///   only while it is in flight under the caller's token; otherwise they return
///   [`Transition::Fenced`] and change nothing. An owner whose lease lapsed keeps its token
///   valid until another claim takes the record over.
/// - **TTL.** A record vanishes `ttl` after the call that set it (claim, complete, mark
///   ambiguous); renewing extends an in-flight record's life to at least its new lease.
///   Expired records are never returned, and backends reclaim their space.
/// - **Time.** Deadlines are measured by one clock per backend (the backend's own where it
///   has one), never compared across gateways' clocks.
/// - **Clone.** Backends are used behind `Arc<dyn Store>`; a backend's handle types that are
///   `Clone` share one underlying store.
/// - **Errors.** A failed call changes nothing it did not report as changed; callers treat a
///   [`StoreError`] from `claim` as "not claimed".
///
/// # Example
///
/// The layer makes these calls; a consumer of another kind (a queue worker) can make them
/// itself: claim, do the work, complete; a second claim then finds the kept response.
///
/// ```
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http::{HeaderMap, StatusCode};
/// use idemgate::record::{Completion, FingerprintHash, OwnerToken, RecordKey, StoredResponse};
/// use idemgate::store::{Claim, ClaimOptions, MemoryStore, Store, Transition, UnknownOutcome};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), idemgate::store::StoreError> {
/// let store = MemoryStore::new();
/// let (key, fingerprint) = (RecordKey::of(b"order-42"), FingerprintHash::of(b"body"));
/// let options = ClaimOptions {
///     lease: Duration::from_secs(30),
///     ttl: Duration::from_secs(3600),
///     on_lapse: UnknownOutcome::Ambiguous,
/// };
/// let Claim::Acquired(token) = store
///     .claim(&key, &fingerprint, OwnerToken::generate(), &options)
///     .await?
/// else {
///     unreachable!("a new key is acquired");
/// };
/// // ... do the work once ...
/// let done = Completion::Response(StoredResponse {
///     status: StatusCode::CREATED,
///     headers: HeaderMap::new(),
///     body: Bytes::from_static(b"shipped"),
/// });
/// let kept = store.complete(&key, token, done, options.ttl).await?;
/// assert_eq!(kept, Transition::Applied);
/// let again = store.claim(&key, &fingerprint, OwnerToken::generate(), &options).await?;
/// assert!(matches!(again, Claim::Completed(_)));
/// # Ok(()) }
/// ```
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claims `key` for a request with `fingerprint`, or reports what holds it.
    ///
    /// `token` is the owner token the caller holds if the claim is acquired (a fresh
    /// [`OwnerToken::generate`] per call). The caller chooses it so that a claim whose answer
    /// never arrived (a timeout, a dropped connection) can still be undone: a
    /// [`release`](Store::release) with the same token removes it if it landed and changes
    /// nothing if it did not.
    ///
    /// `key` and `fingerprint` are both SHA-256 digests but of distinct types
    /// ([`RecordKey`], [`FingerprintHash`]): a call that passes one in the other's place
    /// does not compile.
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        token: OwnerToken,
        options: &ClaimOptions,
    ) -> Result<Claim, StoreError>;

    /// Turns the caller's in-flight record into a completed one that lives `ttl` from now.
    async fn complete(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<Transition, StoreError>;

    /// Removes the caller's in-flight record, so the next request with the key runs.
    async fn release(&self, key: &RecordKey, token: OwnerToken) -> Result<Transition, StoreError>;

    /// Extends the caller's lease to `now + lease`.
    async fn renew(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Transition, StoreError>;

    /// Turns the caller's in-flight record ambiguous, to live `ttl` from now.
    async fn mark_ambiguous(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        ttl: Duration,
    ) -> Result<Transition, StoreError>;

    /// Reads the live record under `key`, if any.
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError>;

    /// Removes whatever record is under `key` (an operator's way out of an ambiguous record).
    /// Returns whether there was one.
    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError>;

    /// Checks that the backend answers.
    async fn ping(&self) -> Result<(), StoreError>;

    /// Whether the backend has lost records this store kept (a Redis restarted without
    /// persistence, say), as far as the store can tell. While a loss is unacknowledged the
    /// store refuses new claims (a retry of a forgotten request would run again); replays of
    /// records that still exist are served. Backends that cannot lose records behind the
    /// store's back (memory, redb) report nothing, the default.
    fn data_loss(&self) -> DataLossStatus {
        DataLossStatus::default()
    }

    /// An operator's acknowledgement of a data loss: the store accepts that the records it
    /// lost are gone and claims again. Returns whether a loss was unacknowledged. The
    /// default, for backends that report none, does nothing and returns `false`.
    async fn acknowledge_data_loss(&self) -> Result<bool, StoreError> {
        Ok(false)
    }

    /// The backend's name for logs and metrics: `memory`, `redb`, `redis`.
    fn backend(&self) -> &'static str;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::proptests::{completion, config, damaged_encoding};
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(config())]

        /// What the Redis and redb stores read back goes through `decode_completion`: it
        /// answers as the record codec does, and every failure is `Corrupt` under the
        /// backend's name (never a panic, never another kind of error).
        #[test]
        fn stored_completions_decode_as_the_codec_does_or_are_corrupt(
            bytes in prop_oneof![
                damaged_encoding(),
                proptest::collection::vec(any::<u8>(), 0..64),
            ],
        ) {
            let bytes = bytes::Bytes::from(bytes);
            match (decode_completion("redis", bytes.clone()), Completion::decode(bytes)) {
                (Ok(got), Ok(want)) => prop_assert_eq!(got, want),
                (Err(StoreError::Corrupt { backend, .. }), Err(_)) => {
                    prop_assert_eq!(backend, "redis")
                }
                (got, want) => prop_assert!(false, "{:?} where the codec gives {:?}", got, want),
            }
        }

        #[test]
        fn stored_completions_read_back_as_written(original in completion()) {
            let got = decode_completion("redis", original.encode());
            prop_assert_eq!(got.ok(), Some(original));
        }
    }
}
