//! The shared reader: one pooled connection taken out of the pool to carry the store's reads
//! for every call at once, and [`ReadHits`], which decides whether claims read first.
//!
//! A read commits nothing, so it waits for no WAL flush and can queue behind other reads
//! without delay. Statements sent together on one connection are pipelined: PostgreSQL reads
//! them in one go and answers them in one write, and the lookup a claim reads first costs the
//! server about a third of what it costs from many connections in turn (BENCHMARKS.md).
//! Writes stay one call per pooled connection: a commit waits for its WAL flush, which would
//! hold up every statement pipelined behind it, while commits from many sessions share one
//! flush.

use std::ops::Deref;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use deadpool_postgres::Object;

/// A pooled connection shared by concurrent reads. Dropped by its last user, it goes back to
/// the pool, or is closed if [`discard`](Self::discard) was called.
pub(super) struct Reader {
    client: Option<Object>,
    discard: AtomicBool,
}

impl Reader {
    fn new(client: Object) -> Self {
        Self {
            client: Some(client),
            discard: false.into(),
        }
    }

    /// Marks the connection to be closed, not pooled again, once its last user is done: a
    /// read on it timed out, and the server may still be working on that statement.
    pub(super) fn discard(&self) {
        self.discard.store(true, Ordering::Relaxed);
    }
}

impl Deref for Reader {
    type Target = Object;

    fn deref(&self) -> &Object {
        self.client
            .as_ref()
            .expect("the connection is only taken when the reader is dropped")
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if let Some(client) = self.client.take()
            && *self.discard.get_mut()
        {
            drop(Object::take(client));
        }
    }
}

/// Where the current shared reader is kept.
#[derive(Default)]
pub(super) struct Slot {
    current: Mutex<Option<Arc<Reader>>>,
    /// Held while a reader is opened, so that concurrent reads finding none open one between
    /// them rather than one connection each.
    opening: tokio::sync::Mutex<()>,
}

impl Slot {
    /// The current reader, or a new one on the connection `open` gives if there is none or
    /// its connection was closed or discarded.
    pub(super) async fn get<E>(
        &self,
        open: impl Future<Output = Result<Object, E>>,
    ) -> Result<Arc<Reader>, E> {
        if let Some(reader) = self.current() {
            return Ok(reader);
        }
        let _opening = self.opening.lock().await;
        if let Some(reader) = self.current() {
            return Ok(reader);
        }
        let reader = Arc::new(Reader::new(open.await?));
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&reader));
        Ok(reader)
    }

    fn current(&self) -> Option<Arc<Reader>> {
        let slot = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        slot.as_ref().filter(|r| usable(r)).cloned()
    }

    /// Takes `reader` out of the slot if it is still there, so the next read opens another.
    pub(super) fn forget(&self, reader: &Arc<Reader>) {
        let mut slot = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.as_ref().is_some_and(|r| Arc::ptr_eq(r, reader)) {
            *slot = None;
        }
    }
}

fn usable(reader: &Reader) -> bool {
    !reader.discard.load(Ordering::Relaxed) && !reader.is_closed()
}

/// How often, of late, a claim found a record that answers it without a write (a replay, a
/// request in flight, a mismatch): claims read first while that is at least every other
/// one. Reading first costs a claim that must write one more round trip, and saves one that
/// need not write its statement's heavier plan and a pooled connection, so it pays for
/// itself at about half; traffic of mostly new keys goes straight to the claim statement,
/// and a burst of retries turns reading first on within a dozen claims.
pub(super) struct ReadHits(AtomicU32);

/// [`ReadHits`] in fixed point: `ALWAYS` is every claim.
const ALWAYS: u32 = 1 << 16;
/// Each claim weighs a sixteenth; older ones fade.
const WEIGHT: u32 = 16;

impl Default for ReadHits {
    fn default() -> Self {
        Self(AtomicU32::new(0))
    }
}

impl ReadHits {
    /// Whether a claim should read first.
    pub(super) fn read_first(&self) -> bool {
        self.0.load(Ordering::Relaxed) >= ALWAYS / 2
    }

    /// Counts one claim, `answered` if its record answered it without a write.
    pub(super) fn record(&self, answered: bool) {
        let add = if answered { ALWAYS / WEIGHT } else { 0 };
        // Never fails: the closure always returns a value.
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| {
                Some(r - r / WEIGHT + add)
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reading_first_follows_what_recent_claims_found() {
        let hits = ReadHits::default();
        assert!(!hits.read_first(), "a new store goes straight to the claim");
        let mut turned_on = None;
        for i in 1..=40 {
            hits.record(true);
            if hits.read_first() && turned_on.is_none() {
                turned_on = Some(i);
            }
        }
        assert_eq!(turned_on, Some(11), "a burst of replays turns it on");
        assert!(hits.0.load(Ordering::Relaxed) <= ALWAYS);
        for _ in 0..200 {
            hits.record(true);
        }
        assert!(hits.0.load(Ordering::Relaxed) <= ALWAYS, "bounded");
        let mut turned_off = None;
        for i in 1..=40 {
            hits.record(false);
            if !hits.read_first() && turned_off.is_none() {
                turned_off = Some(i);
            }
        }
        assert_eq!(turned_off, Some(11), "new keys turn it off");
        // Alternating hits and misses hover around the line, as both ways cost about the same.
        for _ in 0..100 {
            hits.record(true);
            hits.record(false);
        }
        let r = hits.0.load(Ordering::Relaxed);
        assert!(r > ALWAYS / 3 && r < 2 * ALWAYS / 3, "{r}");
    }
}
