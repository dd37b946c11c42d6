//! [`MemoryStore`]: records in this process's memory, for a single gateway and for tests.

use std::ops::{Add, Sub};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use super::decision::{ClaimStep, Found, Held, Moment, decide};
use super::{Claim, ClaimOptions, Store, StoreError, Transition, decode_completion};
// A shard's lock is taken as it is when poisoned: every change under it is a few infallible
// map operations, so a panic cannot leave a shard half-changed.
use crate::lock::lock;
use crate::record::{Completion, FingerprintHash, OwnerToken, Record, RecordKey};

use self::table::{Id, Swept, Table};

mod due;
mod table;

/// Most expiry filings the background sweep looks at under one shard lock (each removes an
/// expired record or is set aside), so no lock is held long.
const SWEEP_BATCH: usize = 1024;
/// Expiry filings every call looks at in the shard it touches, so a store without a
/// background sweeper (made outside a runtime) still reclaims its space: at least as many as
/// one call can add.
const INLINE_SWEEP: usize = 4;
/// Replays of a record that each decode it: the next one keeps its decoded response with the
/// record, for every later replay to share. Most keys are retried once or twice, and their
/// records keep only their encoded bytes; a key replayed more often (a redelivery storm, a
/// client retrying in a loop) is answered without a decode each time.
const DECODES_BEFORE_KEEPING: u8 = 2;

/// How a [`MemoryStore`] is sized.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryStoreConfig {
    /// Most records held at once. A claim that would need a new record beyond it fails with
    /// [`StoreError::AtCapacity`]; live records are never evicted to make room.
    pub capacity: usize,
    /// Number of shards, each with its own lock. Rounded up to at least one.
    pub shards: usize,
    /// Pause between two background sweeps of expired records.
    pub sweep_interval: Duration,
}

impl MemoryStoreConfig {
    /// Default most records held at once (live, or expired and not yet swept).
    pub const DEFAULT_CAPACITY: usize = 1_000_000;
    /// Default number of independently locked shards.
    pub const DEFAULT_SHARDS: usize = 64;
    /// Default pause between two background sweeps of expired records.
    pub const DEFAULT_SWEEP_INTERVAL: Duration = Duration::from_secs(1);
}

impl Default for MemoryStoreConfig {
    fn default() -> Self {
        Self {
            capacity: Self::DEFAULT_CAPACITY,
            shards: Self::DEFAULT_SHARDS,
            sweep_interval: Self::DEFAULT_SWEEP_INTERVAL,
        }
    }
}

/// Records kept in this process's memory.
///
/// Fast and simple, but records die with the process and are not shared between gateways:
/// use it for one gateway that can afford to forget its records on restart, and in tests.
///
/// The records are spread over shards by key, each behind its own lock held only for a map
/// operation (never across an `.await`). Deadlines use the monotonic clock. Expired records
/// are never returned; a background task, started when the store is made inside a Tokio
/// runtime and stopped when the store is dropped, removes them in small batches, and every
/// call also removes a few from the shard it touches. `Clone` shares the records.
///
/// Each record is held once, in a slot of its shard's slab (key, fingerprint, state, times:
/// 128 bytes) plus its encoded completion; the key and expiry indexes name the slot by number
/// and never repeat the key. A record replayed more than twice also keeps its decoded
/// response (a header map whose values are views into the encoded bytes), so later replays
/// share it instead of decoding the record each time.
///
/// ```
/// use std::time::Duration;
/// use idemgate::store::{MemoryStore, MemoryStoreConfig};
///
/// # #[tokio::main(flavor = "current_thread")] async fn main() {
/// // Made inside a Tokio runtime, it sweeps expired records in the background.
/// let store = MemoryStore::with_config(MemoryStoreConfig {
///     capacity: 100_000,
///     sweep_interval: Duration::from_secs(5),
///     ..MemoryStoreConfig::default()
/// });
/// assert!(store.is_empty());
/// # }
/// ```
#[derive(Clone)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("len", &self.len())
            .field("capacity", &self.inner.capacity)
            .field("shards", &self.inner.shards.len())
            .finish()
    }
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    /// Records held in all shards, expired ones included until removed.
    len: AtomicUsize,
    capacity: usize,
    anchor: Anchor,
}

/// One shard's records, each with its key and expiry (see [`Table`]).
type Shard = Table<Entry>;

struct Entry {
    fingerprint: FingerprintHash,
    state: State,
}

enum State {
    InFlight {
        token: Owner,
        lease_deadline: Tick,
    },
    Completed {
        completion: StoredCompletion,
        stored_at: Tick,
        /// The replays that decoded an encoded `completion`, up to [`DECODES_BEFORE_KEEPING`].
        decodes: u8,
    },
    Ambiguous {
        since: Tick,
    },
}

/// A completed record's response as the store keeps it.
#[derive(Clone)]
enum StoredCompletion {
    /// [`Completion::encode`]d: one allocation holding exactly the record's bytes. A decoded
    /// response would hold a header map (several allocations) and, for a response read from
    /// a connection, views that keep the whole read buffer alive.
    Encoded(Bytes),
    /// Decoded, once the record has been replayed often (see [`DECODES_BEFORE_KEEPING`]), and
    /// shared with every later replay. Its header values and body are views into the encoded
    /// bytes, which it keeps alive in their place.
    Decoded(Arc<Completion>),
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store with the default capacity, shards and sweep interval.
    pub fn new() -> Self {
        Self::with_config(MemoryStoreConfig::default())
    }

    /// A store sized by `config`.
    pub fn with_config(config: MemoryStoreConfig) -> Self {
        let shards = (0..config.shards.max(1))
            .map(|_| Mutex::new(Shard::default()))
            .collect();
        let inner = Arc::new(Inner {
            shards,
            len: AtomicUsize::new(0),
            capacity: config.capacity,
            anchor: Anchor::new(),
        });
        spawn_sweeper(Arc::downgrade(&inner), config.sweep_interval);
        Self { inner }
    }

    /// Records held now, including expired ones not yet removed.
    pub fn len(&self) -> usize {
        self.inner.len.load(Ordering::Relaxed)
    }

    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Removes every expired record now, shard by shard in bounded batches; returns how many.
    pub fn sweep(&self) -> usize {
        (0..self.inner.shards.len())
            .map(|i| self.inner.sweep_shard(i))
            .sum()
    }
}

/// Starts the background sweep on the current Tokio runtime, if there is one. It holds only a
/// weak reference, so it ends once the last handle to the store is dropped.
fn spawn_sweeper(inner: Weak<Inner>, interval: Duration) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let interval = interval.max(Duration::from_millis(1));
    runtime.spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            ticks.tick().await;
            let shards = match inner.upgrade() {
                Some(store) => store.shards.len(),
                None => return,
            };
            for i in 0..shards {
                loop {
                    let Some(store) = inner.upgrade() else {
                        return;
                    };
                    let swept = store.sweep_batch(i, SWEEP_BATCH);
                    drop(store);
                    if swept.done {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
            }
        }
    });
}

impl Inner {
    fn shard(&self, key: &RecordKey) -> MutexGuard<'_, Shard> {
        let mut prefix = [0u8; 8];
        prefix.copy_from_slice(&key.0[..8]);
        let i = (u64::from_le_bytes(prefix) % self.shards.len() as u64) as usize;
        lock(&self.shards[i])
    }

    fn sweep_batch(&self, shard: usize, budget: usize) -> Swept {
        let swept = lock(&self.shards[shard]).remove_expired(self.anchor.tick(), budget, |_| {});
        self.len.fetch_sub(swept.removed, Ordering::Relaxed);
        swept
    }

    fn sweep_shard(&self, shard: usize) -> usize {
        let mut total = 0;
        loop {
            let swept = self.sweep_batch(shard, SWEEP_BATCH);
            total += swept.removed;
            if swept.done {
                return total;
            }
        }
    }

    /// Takes a slot for a new record, if the store is below capacity.
    fn reserve(&self) -> bool {
        self.len
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.capacity).then_some(n + 1)
            })
            .is_ok()
    }

    /// Runs `f` on `key`'s shard after removing a few expired records from it.
    fn with_shard<T>(&self, key: &RecordKey, f: impl FnOnce(&mut Shard, Tick) -> T) -> T {
        let now = self.anchor.tick();
        let mut shard = self.shard(key);
        let removed = shard.remove_expired(now, INLINE_SWEEP, |_| {}).removed;
        let out = f(&mut shard, now);
        drop(shard);
        if removed > 0 {
            self.len.fetch_sub(removed, Ordering::Relaxed);
        }
        out
    }

    /// One attempt at a claim; `None` when it needs a new record and the store is full. A
    /// completed record's encoded completion is returned as is, to be decoded outside the
    /// shard's lock, until the record keeps its decoded response (see [`replay`]).
    fn try_claim(
        &self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        token: OwnerToken,
        options: &ClaimOptions,
    ) -> Option<Result<Claim, Bytes>> {
        self.with_shard(key, |shard, now| {
            let fresh = || Entry {
                fingerprint: *fingerprint,
                state: State::InFlight {
                    token: Owner::from(token),
                    lease_deadline: now + options.lease,
                },
            };
            let found = shard.find(key).map(|(id, row)| Found {
                record: id,
                expires: row.expires(),
                same_fingerprint: row.value.fingerprint == *fingerprint,
                state: match &row.value.state {
                    State::InFlight { lease_deadline, .. } => Held::InFlight {
                        lease_deadline: *lease_deadline,
                    },
                    State::Completed { completion, .. } => Held::Completed(completion),
                    State::Ambiguous { .. } => Held::Ambiguous,
                },
            });
            Some(Ok(match decide(found, options.on_lapse, now) {
                ClaimStep::Answer(claim) => claim,
                ClaimStep::Replay {
                    completion: StoredCompletion::Decoded(decoded),
                    ..
                } => Claim::Completed(Arc::clone(decoded)),
                ClaimStep::Replay {
                    record: id,
                    completion: StoredCompletion::Encoded(encoded),
                } => {
                    let encoded = encoded.clone();
                    return Some(replay(shard, id, encoded));
                }
                ClaimStep::Acquire { replaces: None } => {
                    if !self.reserve() {
                        return None;
                    }
                    if shard.insert(*key, now + options.ttl, fresh()).is_err() {
                        // The shard has no slot number left: as full as it can be.
                        self.len.fetch_sub(1, Ordering::Relaxed);
                        return None;
                    }
                    Claim::Acquired(token)
                }
                ClaimStep::Acquire { replaces: Some(id) } => {
                    // Reuse the expired or lapsed record's slot: the count does not change.
                    replace(shard, id, now + options.ttl, fresh());
                    Claim::Acquired(token)
                }
                ClaimStep::MakeAmbiguous { record: id, answer } => {
                    // The lease lapsed: the outcome is unknown.
                    set_state(
                        shard,
                        id,
                        now + options.ttl,
                        State::Ambiguous { since: now },
                    );
                    answer
                }
            }))
        })
    }

    /// Applies `f` to `key`'s record if it is live and in flight under `token`.
    fn fenced(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        f: impl FnOnce(&mut Shard, Id, Tick),
    ) -> Transition {
        self.with_shard(key, |shard, now| {
            let owned = shard.find(key).filter(|(_, row)| {
                row.expires() > now
                    && matches!(row.value.state, State::InFlight { token: t, .. } if t == Owner::from(token))
            });
            match owned {
                Some((id, _)) => {
                    f(shard, id, now);
                    Transition::Applied
                }
                None => Transition::Fenced,
            }
        })
    }
}

/// A replay of `id`'s completed record, `encoded`, whose decoded response is not kept:
/// counts it, and answers with `encoded` to decode outside the lock; the replay that finds
/// [`DECODES_BEFORE_KEEPING`] counted decodes it here and keeps it in the record's place.
fn replay(shard: &mut Shard, id: Id, encoded: Bytes) -> Result<Claim, Bytes> {
    let mut kept = None;
    shard.update(id, |expires, entry| {
        if let State::Completed {
            completion,
            decodes,
            ..
        } = &mut entry.state
        {
            if *decodes < DECODES_BEFORE_KEEPING {
                *decodes += 1;
            } else if let Ok(decoded) = Completion::decode(encoded.clone()) {
                // A record that does not decode stays as it is: the caller's decode reports it.
                let decoded = Arc::new(decoded);
                kept = Some(Arc::clone(&decoded));
                *completion = StoredCompletion::Decoded(decoded);
            }
        }
        expires
    });
    kept.map(Claim::Completed).ok_or(encoded)
}

/// Puts a new record in `id`'s place, to expire at `expires`.
fn replace(shard: &mut Shard, id: Id, expires: Tick, fresh: Entry) {
    shard.update(id, |_, entry| {
        *entry = fresh;
        expires
    });
}

/// Puts `id`'s record in `state`, to expire at `expires`.
fn set_state(shard: &mut Shard, id: Id, expires: Tick, state: State) {
    shard.update(id, |_, entry| {
        entry.state = state;
        expires
    });
}

/// Ties the monotonic clock to the wall clock once, so a deadline reads the same time on
/// every [`get`](Store::get).
#[derive(Clone, Copy)]
struct Anchor {
    instant: Instant,
    wall: SystemTime,
}

impl Anchor {
    fn new() -> Self {
        Self {
            instant: Instant::now(),
            wall: SystemTime::now(),
        }
    }

    /// Now, on the store's clock.
    fn tick(&self) -> Tick {
        Tick(u64::try_from(self.instant.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// The wall-clock time of a point on the store's clock, for [`Record`]s.
    fn wall_clock(&self, at: Tick) -> SystemTime {
        self.wall + Duration::from_nanos(at.0)
    }
}

/// A point on a store's monotonic clock: nanoseconds since the store was made (584 years of
/// range). Eight bytes where an `Instant` takes sixteen, in every record and in the expiry
/// index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Tick(u64);

impl Add<Duration> for Tick {
    type Output = Tick;

    fn add(self, duration: Duration) -> Tick {
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        Tick(self.0.saturating_add(nanos))
    }
}

impl Sub for Tick {
    type Output = Duration;

    fn sub(self, earlier: Tick) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Moment for Tick {
    fn until(self, later: Tick) -> Duration {
        later - self
    }
}

/// An [`OwnerToken`] as two words: the same bits without the 16-byte alignment of a `u128`,
/// which would pad every record.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Owner([u64; 2]);

impl From<OwnerToken> for Owner {
    fn from(token: OwnerToken) -> Self {
        Owner([(token.0 >> 64) as u64, token.0 as u64])
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        token: OwnerToken,
        options: &ClaimOptions,
    ) -> Result<Claim, StoreError> {
        let attempt = match self.inner.try_claim(key, fingerprint, token, options) {
            Some(attempt) => attempt,
            None => {
                // Full: expired records do not count, so remove them all and try once more.
                self.sweep();
                self.inner
                    .try_claim(key, fingerprint, token, options)
                    .ok_or(StoreError::AtCapacity {
                        backend: "memory",
                        capacity: self.inner.capacity,
                    })?
            }
        };
        match attempt {
            Ok(claim) => Ok(claim),
            Err(encoded) => Ok(Claim::Completed(Arc::new(decode_completion(
                "memory", encoded,
            )?))),
        }
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        // Encoded before the shard is locked: one copy of exactly the bytes kept.
        let completion = completion.encode();
        Ok(self.inner.fenced(key, token, |shard, id, now| {
            let state = State::Completed {
                completion: StoredCompletion::Encoded(completion),
                stored_at: now,
                decodes: 0,
            };
            set_state(shard, id, now + ttl, state);
        }))
    }

    async fn release(&self, key: &RecordKey, token: OwnerToken) -> Result<Transition, StoreError> {
        let transition = self.inner.fenced(key, token, |shard, id, _| {
            shard.remove(id);
        });
        if transition == Transition::Applied {
            self.inner.len.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(transition)
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Transition, StoreError> {
        Ok(self.inner.fenced(key, token, |shard, id, now| {
            let deadline = now + lease;
            // A lease past the record's expiry extends it; the expiry is never shortened.
            shard.update(id, |expires, entry| {
                entry.state = State::InFlight {
                    token: Owner::from(token),
                    lease_deadline: deadline,
                };
                expires.max(deadline)
            });
        }))
    }

    async fn mark_ambiguous(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        Ok(self.inner.fenced(key, token, |shard, id, now| {
            set_state(shard, id, now + ttl, State::Ambiguous { since: now });
        }))
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let record = self.inner.with_shard(key, |shard, now| {
            let (_, row) = shard.find(key).filter(|(_, row)| row.expires() > now)?;
            let entry = &row.value;
            let fingerprint = entry.fingerprint;
            Some(match &entry.state {
                State::InFlight { lease_deadline, .. } => Ok(Record::InFlight {
                    fingerprint,
                    lease_deadline: self.inner.anchor.wall_clock(*lease_deadline),
                }),
                State::Completed {
                    completion,
                    stored_at,
                    ..
                } => Err((
                    fingerprint,
                    completion.clone(),
                    self.inner.anchor.wall_clock(*stored_at),
                )),
                State::Ambiguous { since } => Ok(Record::Ambiguous {
                    fingerprint,
                    since: self.inner.anchor.wall_clock(*since),
                }),
            })
        });
        match record {
            None => Ok(None),
            Some(Ok(record)) => Ok(Some(record)),
            // Decoded (or copied) outside the shard's lock.
            Some(Err((fingerprint, kept, stored_at))) => Ok(Some(Record::Completed {
                fingerprint,
                completion: match kept {
                    StoredCompletion::Encoded(encoded) => decode_completion("memory", encoded)?,
                    StoredCompletion::Decoded(decoded) => Arc::unwrap_or_clone(decoded),
                },
                stored_at,
            })),
        }
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let (removed, live) = self
            .inner
            .with_shard(key, |shard, now| match shard.find(key) {
                Some((id, row)) => {
                    let live = row.expires() > now;
                    shard.remove(id);
                    (true, live)
                }
                None => (false, false),
            });
        if removed {
            self.inner.len.fetch_sub(1, Ordering::Relaxed);
        }
        Ok(live)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    fn backend(&self) -> &'static str {
        "memory"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Hash256;
    use crate::store::UnknownOutcome;

    fn key(i: usize) -> RecordKey {
        RecordKey::of(format!("memory-test-{i}").as_bytes())
    }

    fn fp() -> FingerprintHash {
        FingerprintHash::of(b"fp")
    }

    fn opts(ttl: Duration) -> ClaimOptions {
        ClaimOptions {
            lease: ttl,
            ttl,
            on_lapse: UnknownOutcome::Ambiguous,
        }
    }

    /// Claims `key` with [`fp`] and `options` under a fresh token.
    async fn claim(
        store: &MemoryStore,
        key: &RecordKey,
        options: &ClaimOptions,
    ) -> Result<Claim, StoreError> {
        store
            .claim(key, &fp(), OwnerToken::generate(), options)
            .await
    }

    fn config(capacity: usize, sweep_interval: Duration) -> MemoryStoreConfig {
        MemoryStoreConfig {
            capacity,
            shards: 8,
            sweep_interval,
        }
    }

    #[tokio::test]
    async fn full_store_refuses_new_keys_and_keeps_live_ones() {
        let store = MemoryStore::with_config(config(10, Duration::from_secs(3600)));
        let long = opts(Duration::from_secs(60));
        let mut tokens = Vec::new();
        for i in 0..10 {
            match claim(&store, &key(i), &long).await.unwrap() {
                Claim::Acquired(t) => tokens.push(t),
                other => panic!("claim {i}: {other:?}"),
            }
        }
        let err = claim(&store, &key(10), &long).await.unwrap_err();
        assert!(
            matches!(
                err,
                StoreError::AtCapacity {
                    backend: "memory",
                    capacity: 10
                }
            ),
            "{err:?}"
        );
        assert_eq!(store.len(), 10);
        // Every live record is still there and answers.
        for i in 0..10 {
            assert!(matches!(
                claim(&store, &key(i), &long).await.unwrap(),
                Claim::InFlight { .. }
            ));
        }
        // A released record frees its slot.
        assert_eq!(
            store.release(&key(3), tokens[3]).await.unwrap(),
            Transition::Applied
        );
        assert!(matches!(
            claim(&store, &key(10), &long).await.unwrap(),
            Claim::Acquired(_)
        ));
        assert!(claim(&store, &key(11), &long).await.is_err());
        // So does a deleted one.
        assert!(store.delete(&key(0)).await.unwrap());
        assert!(matches!(
            claim(&store, &key(11), &long).await.unwrap(),
            Claim::Acquired(_)
        ));
        assert_eq!(store.len(), 10);
    }

    #[tokio::test]
    async fn expired_records_do_not_count_against_capacity() {
        // No background sweep during the test: the claim itself must make room.
        let store = MemoryStore::with_config(config(100, Duration::from_secs(3600)));
        for i in 0..100 {
            claim(&store, &key(i), &opts(Duration::from_millis(500)))
                .await
                .unwrap();
        }
        assert!(
            claim(&store, &key(100), &opts(Duration::from_secs(60)))
                .await
                .is_err()
        );
        tokio::time::sleep(Duration::from_millis(600)).await;
        for i in 100..200 {
            assert!(
                matches!(
                    claim(&store, &key(i), &opts(Duration::from_secs(60)))
                        .await
                        .unwrap(),
                    Claim::Acquired(_)
                ),
                "claim {i} after the earlier records expired"
            );
        }
        assert_eq!(store.len(), 100);
        assert!(
            claim(&store, &key(200), &opts(Duration::from_secs(60)))
                .await
                .is_err()
        );
    }

    #[tokio::test]
    async fn background_sweep_removes_expired_records() {
        let store = MemoryStore::with_config(MemoryStoreConfig {
            capacity: MemoryStoreConfig::DEFAULT_CAPACITY,
            shards: 16,
            sweep_interval: Duration::from_millis(50),
        });
        let short = opts(Duration::from_millis(300));
        for round in 0..3 {
            for i in 0..10_000 {
                let k = key(round * 10_000 + i);
                assert!(matches!(
                    claim(&store, &k, &short).await.unwrap(),
                    Claim::Acquired(_)
                ));
            }
            // At least the records just made are alive; from here on nothing but the
            // background task can remove any.
            assert!(!store.is_empty(), "round {round}: no record held");
            let mut waited = 0;
            while !store.is_empty() && waited < 100 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                waited += 1;
            }
            assert_eq!(
                store.len(),
                0,
                "round {round}: expired records were not swept"
            );
            for shard in store.inner.shards.iter() {
                let shard = lock(shard);
                shard.check();
                assert_eq!((shard.len(), shard.filings()), (0, 0));
            }
        }
    }

    #[tokio::test]
    async fn sweeper_stops_when_store_is_dropped() {
        let store = MemoryStore::with_config(config(10, Duration::from_millis(10)));
        let weak = Arc::downgrade(&store.inner);
        drop(store);
        assert!(weak.upgrade().is_none(), "the sweeper kept the store alive");
    }

    #[test]
    fn made_outside_a_runtime_sweeps_lazily() {
        let store = MemoryStore::with_config(config(1000, Duration::from_millis(10)));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(async {
            for i in 0..50 {
                claim(&store, &key(i), &opts(Duration::from_millis(300)))
                    .await
                    .unwrap();
            }
            assert_eq!(store.len(), 50);
            tokio::time::sleep(Duration::from_millis(400)).await;
            // Touching each key's shard removes expired records from it.
            for i in 0..50 {
                assert_eq!(store.get(&key(i)).await.unwrap(), None);
            }
        });
        assert!(store.len() < 50, "calls did not reclaim expired records");
        store.sweep();
        assert!(store.is_empty());
    }

    #[tokio::test]
    async fn index_tracks_every_expiry_change() {
        let store = MemoryStore::with_config(config(100, Duration::from_secs(3600)));
        let k = key(1);
        let Claim::Acquired(t) = claim(&store, &k, &opts(Duration::from_secs(5)))
            .await
            .unwrap()
        else {
            panic!("not acquired");
        };
        assert_eq!(
            store.renew(&k, t, Duration::from_secs(50)).await.unwrap(),
            Transition::Applied
        );
        let completion = Completion::TooLarge {
            status: http::StatusCode::OK,
            body_digest: Hash256::of(b""),
            body_len: 0,
        };
        assert_eq!(
            store
                .complete(&k, t, completion, Duration::from_secs(7))
                .await
                .unwrap(),
            Transition::Applied
        );
        {
            let shard = store.inner.shard(&k);
            shard.check();
            // Moving the expiry later files nothing new.
            assert_eq!(shard.filings(), 1, "stale expiry entries left behind");
        }
        // Filed under the claim's 5 s, the record lives to the completion's 7 s.
        let later = store.inner.anchor.tick() + Duration::from_secs(6);
        assert_eq!(
            store
                .inner
                .shard(&k)
                .remove_expired(later, 100, |_| {})
                .removed,
            0
        );
        assert!(matches!(
            store.get(&k).await.unwrap(),
            Some(Record::Completed { .. })
        ));
        let after = store.inner.anchor.tick() + Duration::from_secs(8);
        let mut shard = store.inner.shard(&k);
        assert_eq!(shard.remove_expired(after, 100, |_| {}).removed, 1);
        assert_eq!((shard.len(), shard.filings()), (0, 0));
    }

    #[tokio::test]
    async fn a_lapsed_lease_reschedules_the_record() {
        let store = MemoryStore::with_config(config(100, Duration::from_secs(3600)));
        let lapsing = ClaimOptions {
            lease: Duration::from_millis(50),
            ttl: Duration::from_secs(1),
            on_lapse: UnknownOutcome::Ambiguous,
        };
        let (ambiguous, retried) = (key(1), key(2));
        for k in [&ambiguous, &retried] {
            assert!(matches!(
                claim(&store, k, &lapsing).await.unwrap(),
                Claim::Acquired(_)
            ));
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
        let longer = ClaimOptions {
            ttl: Duration::from_secs(3),
            ..lapsing
        };
        assert_eq!(
            claim(&store, &ambiguous, &longer).await.unwrap(),
            Claim::Ambiguous
        );
        let retry = ClaimOptions {
            on_lapse: UnknownOutcome::Retry,
            ..longer
        };
        assert!(matches!(
            claim(&store, &retried, &retry).await.unwrap(),
            Claim::Acquired(_)
        ));
        // Past the first claims' ttl, before the second ones': both records stay.
        let now = store.inner.anchor.tick();
        let sweep_all = |at: Tick| {
            let mut removed = 0;
            for shard in store.inner.shards.iter() {
                let mut shard = lock(shard);
                let swept = shard.remove_expired(at, usize::MAX, |_| {});
                assert!(swept.done);
                shard.check();
                removed += swept.removed;
            }
            removed
        };
        assert_eq!(sweep_all(now + Duration::from_millis(1500)), 0);
        assert!(matches!(
            store.get(&ambiguous).await.unwrap(),
            Some(Record::Ambiguous { .. })
        ));
        assert!(matches!(
            store.get(&retried).await.unwrap(),
            Some(Record::InFlight { .. })
        ));
        // Past the second claims' ttl: both go.
        assert_eq!(sweep_all(now + Duration::from_secs(4)), 2);
        for shard in store.inner.shards.iter() {
            let shard = lock(shard);
            assert_eq!((shard.len(), shard.filings()), (0, 0));
        }
    }

    #[tokio::test]
    async fn kept_responses_own_exactly_their_bytes() {
        use http::{HeaderMap, HeaderValue};
        // A response as a connection delivers it: every part a view into one large buffer.
        let wire =
            Bytes::from(b"aa|two|second|{\"ok\":true}|and the rest of the read buffer".to_vec());
        let view = |range: std::ops::Range<usize>| {
            HeaderValue::from_maybe_shared(wire.slice(range)).unwrap()
        };
        let mut headers = HeaderMap::new();
        headers.append("x-one", view(0..2));
        headers.append("x-two", view(3..6));
        headers.append("x-two", view(7..13));
        let original = Completion::Response(crate::record::StoredResponse {
            status: http::StatusCode::CREATED,
            headers,
            body: wire.slice(14..25),
        });
        let store = MemoryStore::with_config(config(10, Duration::from_secs(3600)));
        let long = opts(Duration::from_secs(60));
        let token = OwnerToken::generate();
        store.claim(&key(1), &fp(), token, &long).await.unwrap();
        let done = store
            .complete(&key(1), token, original.clone(), Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(done, Transition::Applied);
        let replayed = claim(&store, &key(1), &long).await.unwrap();
        assert_eq!(replayed, Claim::Completed(Arc::new(original.clone())));
        // Nothing of the large buffer is kept: once the caller's views are gone, it is unique.
        drop(original);
        assert!(
            wire.try_into_mut().is_ok(),
            "the record still holds the read buffer"
        );
        // What is kept replays whole, repeated fields in order.
        let Claim::Completed(completion) = replayed else {
            panic!("not a replay: {replayed:?}")
        };
        let Completion::Response(kept) = &*completion else {
            panic!("not a response")
        };
        assert_eq!(
            kept.headers.get_all("x-two").iter().collect::<Vec<_>>(),
            ["two", "second"]
        );
        assert_eq!(kept.body.as_ref(), br#"{"ok":true}"#);
    }

    #[tokio::test]
    async fn a_record_replayed_often_keeps_its_decoded_response() {
        let store = MemoryStore::with_config(config(10, Duration::from_secs(3600)));
        let long = opts(Duration::from_secs(60));
        let response = |body: &'static str| {
            Completion::Response(crate::record::StoredResponse {
                status: http::StatusCode::OK,
                headers: http::HeaderMap::new(),
                body: Bytes::from_static(body.as_bytes()),
            })
        };
        let complete = async |completion: Completion| {
            let token = OwnerToken::generate();
            store.claim(&key(1), &fp(), token, &long).await.unwrap();
            let done = store
                .complete(&key(1), token, completion, Duration::from_secs(60))
                .await
                .unwrap();
            assert_eq!(done, Transition::Applied);
        };
        let replay = async || match claim(&store, &key(1), &long).await.unwrap() {
            Claim::Completed(completion) => completion,
            other => panic!("not a replay: {other:?}"),
        };

        complete(response("first")).await;
        // The first replays each decode a copy of their own.
        for _ in 0..DECODES_BEFORE_KEEPING {
            let decoded = replay().await;
            assert_eq!(*decoded, response("first"));
            assert_eq!(
                Arc::strong_count(&decoded),
                1,
                "a fresh decode is the caller's alone"
            );
        }
        // The next keeps its decoded response with the record, and every later one shares it.
        let kept = replay().await;
        assert_eq!(*kept, response("first"));
        assert_eq!(Arc::strong_count(&kept), 2, "kept with the record");
        let again = replay().await;
        assert!(Arc::ptr_eq(&kept, &again), "a later replay decodes again");
        match store.get(&key(1)).await.unwrap() {
            Some(Record::Completed { completion, .. }) => {
                assert_eq!(completion, response("first"));
            }
            other => panic!("not the completed record: {other:?}"),
        }

        // The kept copy goes with its record: a new record under the key replays its own.
        assert!(store.delete(&key(1)).await.unwrap());
        assert_eq!(
            Arc::strong_count(&kept),
            2,
            "the callers' copies outlive the record"
        );
        drop(again);
        assert_eq!(Arc::strong_count(&kept), 1);
        complete(response("second")).await;
        for _ in 0..=DECODES_BEFORE_KEEPING + 1 {
            assert_eq!(*replay().await, response("second"));
        }
    }
}
