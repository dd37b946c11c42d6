//! [`MemoryStore`]: records in this process's memory, for a single gateway and for tests.

use std::collections::{BTreeSet, HashMap};
use std::ops::{Add, Sub};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use super::{
    Claim, ClaimOptions, Store, StoreError, Transition, UnknownOutcome, decode_completion,
};
use crate::record::{Completion, FingerprintHash, OwnerToken, Record, RecordKey};

/// Most expired records removed under one shard lock by the background sweep, so no lock is
/// held long.
const SWEEP_BATCH: usize = 1024;
/// Expired records every call removes from the shard it touches, so a store without a
/// background sweeper (made outside a runtime) still reclaims its space.
const INLINE_SWEEP: usize = 4;

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

#[derive(Default)]
struct Shard {
    entries: HashMap<RecordKey, Entry>,
    /// Every entry's expiry, so expired entries are found without a scan.
    expiries: BTreeSet<(Tick, RecordKey)>,
}

struct Entry {
    fingerprint: FingerprintHash,
    expires: Tick,
    state: State,
}

enum State {
    InFlight {
        token: Owner,
        lease_deadline: Tick,
    },
    Completed {
        /// [`Completion::encode`]d: one allocation holding exactly the record's bytes. A
        /// decoded response would hold a header map (several allocations) and, for a response
        /// read from a connection, views that keep the whole read buffer alive.
        completion: Bytes,
        stored_at: Tick,
    },
    Ambiguous {
        since: Tick,
    },
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
                    let removed = store.sweep_batch(i, SWEEP_BATCH);
                    drop(store);
                    if removed < SWEEP_BATCH {
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

    fn sweep_batch(&self, shard: usize, limit: usize) -> usize {
        let removed = lock(&self.shards[shard]).remove_expired(self.anchor.tick(), limit);
        self.len.fetch_sub(removed, Ordering::Relaxed);
        removed
    }

    fn sweep_shard(&self, shard: usize) -> usize {
        let mut total = 0;
        loop {
            let removed = self.sweep_batch(shard, SWEEP_BATCH);
            total += removed;
            if removed < SWEEP_BATCH {
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
        let removed = shard.remove_expired(now, INLINE_SWEEP);
        let out = f(&mut shard, now);
        drop(shard);
        if removed > 0 {
            self.len.fetch_sub(removed, Ordering::Relaxed);
        }
        out
    }

    /// One attempt at a claim; `None` when it needs a new record and the store is full. A
    /// completed record's encoded completion is returned as is, to be decoded outside the
    /// shard's lock.
    fn try_claim(
        &self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        token: OwnerToken,
        options: &ClaimOptions,
    ) -> Option<Result<Claim, Bytes>> {
        self.with_shard(key, |shard, now| {
            let fresh = |now: Tick| {
                let entry = Entry {
                    fingerprint: *fingerprint,
                    expires: now + options.ttl,
                    state: State::InFlight {
                        token: Owner::from(token),
                        lease_deadline: now + options.lease,
                    },
                };
                (entry, Claim::Acquired(token))
            };
            let Shard { entries, expiries } = shard;
            match entries.get_mut(key) {
                Some(entry) if entry.expires > now => {
                    let same = entry.fingerprint == *fingerprint;
                    match &entry.state {
                        State::InFlight { lease_deadline, .. } if *lease_deadline > now => {
                            Some(Ok(if same {
                                Claim::InFlight {
                                    lease_remaining: *lease_deadline - now,
                                }
                            } else {
                                Claim::Mismatch
                            }))
                        }
                        State::InFlight { .. } => match options.on_lapse {
                            UnknownOutcome::Retry => {
                                let (new, claim) = fresh(now);
                                set_expiry(expiries, key, entry.expires, new.expires);
                                *entry = new;
                                Some(Ok(claim))
                            }
                            UnknownOutcome::Ambiguous => {
                                let expires = now + options.ttl;
                                set_expiry(expiries, key, entry.expires, expires);
                                entry.expires = expires;
                                entry.state = State::Ambiguous { since: now };
                                Some(Ok(if same {
                                    Claim::Ambiguous
                                } else {
                                    Claim::Mismatch
                                }))
                            }
                        },
                        _ if !same => Some(Ok(Claim::Mismatch)),
                        State::Completed { completion, .. } => Some(Err(completion.clone())),
                        State::Ambiguous { .. } => Some(Ok(Claim::Ambiguous)),
                    }
                }
                Some(expired) => {
                    // Reuse the expired record's slot: the count does not change.
                    let (new, claim) = fresh(now);
                    set_expiry(expiries, key, expired.expires, new.expires);
                    *expired = new;
                    Some(Ok(claim))
                }
                None => {
                    if !self.reserve() {
                        return None;
                    }
                    let (new, claim) = fresh(now);
                    expiries.insert((new.expires, *key));
                    entries.insert(*key, new);
                    Some(Ok(claim))
                }
            }
        })
    }

    /// Applies `f` to `key`'s record if it is live and in flight under `token`.
    fn fenced(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        f: impl FnOnce(&mut Shard, Tick),
    ) -> Transition {
        self.with_shard(key, |shard, now| {
            let owned = shard.entries.get(key).is_some_and(|e| {
                e.expires > now && matches!(e.state, State::InFlight { token: t, .. } if t == Owner::from(token))
            });
            if owned {
                f(shard, now);
                Transition::Applied
            } else {
                Transition::Fenced
            }
        })
    }
}

impl Shard {
    /// Removes up to `limit` records that expired by `now`; returns how many.
    fn remove_expired(&mut self, now: Tick, limit: usize) -> usize {
        let mut removed = 0;
        while removed < limit {
            match self.expiries.first() {
                Some(&(expires, key)) if expires <= now => {
                    self.expiries.pop_first();
                    self.entries.remove(&key);
                    removed += 1;
                }
                _ => break,
            }
        }
        removed
    }

    /// Replaces `key`'s record's expiry (the entry itself is updated by the caller).
    fn reschedule(&mut self, key: &RecordKey, expires: Tick) {
        if let Some(entry) = self.entries.get_mut(key) {
            set_expiry(&mut self.expiries, key, entry.expires, expires);
            entry.expires = expires;
        }
    }
}

fn set_expiry(expiries: &mut BTreeSet<(Tick, RecordKey)>, key: &RecordKey, old: Tick, new: Tick) {
    if old != new {
        expiries.remove(&(old, *key));
        expiries.insert((new, *key));
    }
}

/// Locks a shard. A panic while a shard was locked cannot leave it half-changed (every change
/// under the lock is a few infallible map operations), so a poisoned lock is taken as is.
fn lock(shard: &Mutex<Shard>) -> MutexGuard<'_, Shard> {
    shard
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
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
        Ok(self.inner.fenced(key, token, |shard, now| {
            shard.reschedule(key, now + ttl);
            if let Some(entry) = shard.entries.get_mut(key) {
                entry.state = State::Completed {
                    completion,
                    stored_at: now,
                };
            }
        }))
    }

    async fn release(&self, key: &RecordKey, token: OwnerToken) -> Result<Transition, StoreError> {
        let transition = self.inner.fenced(key, token, |shard, _| {
            if let Some(entry) = shard.entries.remove(key) {
                shard.expiries.remove(&(entry.expires, *key));
            }
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
        Ok(self.inner.fenced(key, token, |shard, now| {
            let deadline = now + lease;
            let expires = match shard.entries.get_mut(key) {
                Some(entry) => {
                    entry.state = State::InFlight {
                        token: Owner::from(token),
                        lease_deadline: deadline,
                    };
                    entry.expires.max(deadline)
                }
                None => return,
            };
            shard.reschedule(key, expires);
        }))
    }

    async fn mark_ambiguous(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        Ok(self.inner.fenced(key, token, |shard, now| {
            shard.reschedule(key, now + ttl);
            if let Some(entry) = shard.entries.get_mut(key) {
                entry.state = State::Ambiguous { since: now };
            }
        }))
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let record = self.inner.with_shard(key, |shard, now| {
            let entry = shard.entries.get(key).filter(|e| e.expires > now)?;
            let fingerprint = entry.fingerprint;
            Some(match &entry.state {
                State::InFlight { lease_deadline, .. } => Ok(Record::InFlight {
                    fingerprint,
                    lease_deadline: self.inner.anchor.wall_clock(*lease_deadline),
                }),
                State::Completed {
                    completion,
                    stored_at,
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
            // Decoded outside the shard's lock.
            Some(Err((fingerprint, encoded, stored_at))) => Ok(Some(Record::Completed {
                fingerprint,
                completion: decode_completion("memory", encoded)?,
                stored_at,
            })),
        }
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let (removed, live) =
            self.inner
                .with_shard(key, |shard, now| match shard.entries.remove(key) {
                    Some(entry) => {
                        shard.expiries.remove(&(entry.expires, *key));
                        (true, entry.expires > now)
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

    fn key(i: usize) -> RecordKey {
        Hash256::of(format!("memory-test-{i}").as_bytes())
    }

    fn fp() -> FingerprintHash {
        Hash256::of(b"fp")
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
                assert!(shard.entries.is_empty() && shard.expiries.is_empty());
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
        let shard = store.inner.shard(&k);
        assert_eq!(shard.expiries.len(), 1, "stale expiry entries left behind");
        let (expires, indexed) = *shard.expiries.first().unwrap();
        assert_eq!(indexed, k);
        assert_eq!(expires, shard.entries[&k].expires);
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
}
