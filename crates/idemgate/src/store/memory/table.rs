//! [`Table`]: one shard's records, found by key and by expiry, with one copy of each key.
//!
//! Rows live in a slab (`Vec` of slots, vacant slots linked into a free list) and are named by
//! their slot number. The key index is a hash table of slot numbers hashed by their row's key,
//! and the expiry index ([`Due`]) holds `(due time, slot number)` filings taken out earliest
//! first: neither repeats the key.
//!
//! The expiry index is lazy. A row is filed under a due time no later than its expiry; a
//! later expiry (the usual change: claim, then complete or renew) changes only the row, and
//! an earlier one files the row again. When a row's filing comes due, the row is removed if
//! it has expired, or filed again under its expiry if not. Filings left behind by an earlier
//! filing or by a removed row are recognised and dropped when they come due (a filing counts
//! only while its row is there and filed under that very time); once the index holds more
//! than twice as many filings as the slab has slots, it is rebuilt from the rows, one filing
//! each, so leftovers never pile up.

use hashbrown::HashTable;

use super::Tick;
use super::due::{Due, Filing};
use crate::record::RecordKey;
use crate::store::key_hash::KeyHasher;

/// The slot number that names no slot: the end of the free list.
const NONE: u32 = u32::MAX;
/// Fewest filings the expiry index may hold before leftovers are cleared out.
const MIN_FILINGS: usize = 64;

/// The records of one shard: the key and expiry of each, and the value the store keeps.
pub(super) struct Table<V> {
    /// Slot numbers of the rows, hashed by their row's key.
    index: HashTable<u32>,
    hasher: KeyHasher,
    slots: Vec<Slot<V>>,
    /// The first vacant slot, or [`NONE`].
    vacant: u32,
    /// When rows come due: the earliest first.
    due: Due,
}

enum Slot<V> {
    Vacant { next: u32 },
    Occupied(Row<V>),
}

/// One record in a [`Table`].
pub(super) struct Row<V> {
    /// The record's key.
    pub(super) key: RecordKey,
    expires: Tick,
    /// The time this row is filed under in the expiry index; never later than `expires`.
    filed: Tick,
    /// What the store keeps for the record.
    pub(super) value: V,
}

impl<V> Row<V> {
    /// When the record expires.
    pub(super) fn expires(&self) -> Tick {
        self.expires
    }
}

/// A row's place in a [`Table`], valid until the row is removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Id(u32);

/// What one [`Table::remove_expired`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Swept {
    /// Rows removed.
    pub(super) removed: usize,
    /// Whether no expired row is left (otherwise the work budget ran out first).
    pub(super) done: bool,
}

impl<V> Default for Table<V> {
    fn default() -> Self {
        Self {
            index: HashTable::new(),
            hasher: KeyHasher::new(),
            slots: Vec::new(),
            vacant: NONE,
            due: Due::default(),
        }
    }
}

/// The hash of the key in slot `slot` (zero for a vacant slot, which the index never holds).
fn slot_hash<V>(hasher: &KeyHasher, slots: &[Slot<V>], slot: u32) -> u64 {
    match slots.get(slot as usize) {
        Some(Slot::Occupied(row)) => hasher.hash(&row.key),
        _ => 0,
    }
}

impl<V> Table<V> {
    /// The row under `key`, if any (expired or not), and its place.
    pub(super) fn find(&self, key: &RecordKey) -> Option<(Id, &Row<V>)> {
        let hash = self.hasher.hash(key);
        let mut found = None;
        self.index
            .find(hash, |&slot| match self.slots.get(slot as usize) {
                Some(Slot::Occupied(row)) if row.key == *key => {
                    found = Some((Id(slot), row));
                    true
                }
                _ => false,
            });
        found
    }

    /// The row at `id`.
    #[cfg(test)]
    pub(super) fn get(&self, id: Id) -> Option<&Row<V>> {
        match self.slots.get(id.0 as usize) {
            Some(Slot::Occupied(row)) => Some(row),
            _ => None,
        }
    }

    /// Changes the row at `id`: `change` gets its expiry and its value, changes the value, and
    /// answers the new expiry.
    pub(super) fn update(&mut self, id: Id, change: impl FnOnce(Tick, &mut V) -> Tick) {
        let Some(Slot::Occupied(row)) = self.slots.get_mut(id.0 as usize) else {
            return;
        };
        let expires = change(row.expires(), &mut row.value);
        self.set_expiry(id, expires);
    }

    /// Adds a row for `key`, which the table must not hold yet. Gives the value back when the
    /// table has no slot number left for it.
    pub(super) fn insert(&mut self, key: RecordKey, expires: Tick, value: V) -> Result<Id, V> {
        let row = Row {
            key,
            expires,
            filed: expires,
            value,
        };
        let slot = match self.slots.get_mut(self.vacant as usize) {
            Some(vacant @ Slot::Vacant { .. }) => {
                let slot = self.vacant;
                if let Slot::Vacant { next } = std::mem::replace(vacant, Slot::Occupied(row)) {
                    self.vacant = next;
                }
                slot
            }
            _ => match u32::try_from(self.slots.len()) {
                Ok(slot) if slot != NONE => {
                    self.slots.push(Slot::Occupied(row));
                    slot
                }
                _ => return Err(row.value),
            },
        };
        let Self {
            index,
            hasher,
            slots,
            ..
        } = self;
        index.insert_unique(hasher.hash(&key), slot, |&s| slot_hash(hasher, slots, s));
        self.file(slot, expires);
        Ok(Id(slot))
    }

    /// Removes the row at `id`; returns it.
    pub(super) fn remove(&mut self, id: Id) -> Option<Row<V>> {
        let slot = id.0;
        let hash = match self.slots.get(slot as usize) {
            Some(Slot::Occupied(row)) => self.hasher.hash(&row.key),
            _ => return None,
        };
        if let Ok(found) = self.index.find_entry(hash, |&s| s == slot) {
            found.remove();
        }
        let vacant = Slot::Vacant { next: self.vacant };
        let Slot::Occupied(row) = std::mem::replace(&mut self.slots[slot as usize], vacant) else {
            return None;
        };
        self.vacant = slot;
        // The row's filings stay in the expiry index until they come due or it is rebuilt.
        Some(row)
    }

    /// Changes when the row at `id` expires.
    pub(super) fn set_expiry(&mut self, id: Id, expires: Tick) {
        let Some(Slot::Occupied(row)) = self.slots.get_mut(id.0 as usize) else {
            return;
        };
        row.expires = expires;
        if expires < row.filed {
            // Filed too late for the new expiry: file it again. A later expiry needs nothing
            // now; the present filing finds the row unexpired and files it again then.
            self.file(id.0, expires);
        }
    }

    /// Files slot `slot` (occupied) under `at`.
    fn file(&mut self, slot: u32, at: Tick) {
        if let Some(Slot::Occupied(row)) = self.slots.get_mut(slot as usize) {
            row.filed = at;
            self.due.push(Filing { at, slot });
        }
        if self.due.len() > 2 * self.slots.len().max(MIN_FILINGS) {
            self.refile_all();
        }
    }

    /// Rebuilds the expiry index with exactly one filing per row, under its expiry: drops every
    /// leftover. Linear in the slab, and needs at least as many filings since the last rebuild.
    fn refile_all(&mut self) {
        let mut filings = Vec::with_capacity(self.index.len());
        for (slot, entry) in self.slots.iter_mut().enumerate() {
            if let Slot::Occupied(row) = entry {
                row.filed = row.expires;
                // Slot numbers fit in a u32: `insert` hands out no others.
                let slot = u32::try_from(slot).unwrap_or(NONE);
                filings.push(Filing {
                    at: row.expires,
                    slot,
                });
            }
        }
        self.due.replace(filings);
    }

    /// Removes rows that expired by `now`, looking at no more than `budget` filings; calls
    /// `removed` with each row taken out.
    pub(super) fn remove_expired(
        &mut self,
        now: Tick,
        budget: usize,
        mut removed: impl FnMut(Row<V>),
    ) -> Swept {
        let mut count = 0;
        for _ in 0..budget {
            let Some(filing) = self.due.pop_due(now) else {
                break;
            };
            let expires = match self.slots.get(filing.slot as usize) {
                Some(Slot::Occupied(row)) if row.filed == filing.at => row.expires,
                // A leftover: the slot's row is gone or filed elsewhere.
                _ => continue,
            };
            if expires <= now {
                if let Some(row) = self.remove(Id(filing.slot)) {
                    removed(row);
                    count += 1;
                }
            } else {
                self.file(filing.slot, expires);
            }
        }
        Swept {
            removed: count,
            done: self.due.peek().is_none_or(|f| f.at > now),
        }
    }
}

#[cfg(test)]
impl<V> Table<V> {
    /// Rows held.
    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    /// Filings in the expiry index, leftovers included.
    pub(super) fn filings(&self) -> usize {
        self.due.len()
    }

    /// Panics unless every structure agrees: each row is indexed under its key and filed no
    /// later than its expiry, the free list holds exactly the vacant slots, and the index stays
    /// within its bound.
    pub(super) fn check(&self) {
        let occupied: Vec<u32> = (0..self.slots.len() as u32)
            .filter(|&s| matches!(self.slots[s as usize], Slot::Occupied(_)))
            .collect();
        assert_eq!(occupied.len(), self.index.len(), "row count");
        for &slot in &occupied {
            let Slot::Occupied(row) = &self.slots[slot as usize] else {
                unreachable!()
            };
            assert_eq!(
                self.find(&row.key).map(|(id, _)| id),
                Some(Id(slot)),
                "row {slot} not indexed"
            );
            assert!(
                row.filed <= row.expires,
                "row {slot} filed after it expires"
            );
            assert!(
                self.due.iter().any(|f| f.slot == slot && f.at == row.filed),
                "row {slot} not filed"
            );
        }
        let mut free = 0;
        let mut next = self.vacant;
        while next != NONE {
            let Slot::Vacant { next: after } = self.slots[next as usize] else {
                panic!("free list reaches occupied slot {next}");
            };
            free += 1;
            assert!(free <= self.slots.len(), "free list loops");
            next = after;
        }
        assert_eq!(
            free + occupied.len(),
            self.slots.len(),
            "free list misses slots"
        );
        assert!(self.due.len() <= 2 * self.slots.len().max(MIN_FILINGS));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> RecordKey {
        RecordKey::of(&i.to_le_bytes())
    }

    fn removed_keys(table: &mut Table<u64>, now: u64, budget: usize) -> (Vec<u64>, Swept) {
        let mut values = Vec::new();
        let swept = table.remove_expired(Tick(now), budget, |row| values.push(row.value));
        values.sort_unstable();
        (values, swept)
    }

    #[test]
    fn a_store_slot_takes_at_most_128_bytes() {
        // The figure the store's docs give; a vacant slot costs no more than an occupied one.
        assert!(std::mem::size_of::<Slot<super::super::Entry>>() <= 128);
        assert_eq!(std::mem::size_of::<Filing>(), 16);
    }

    #[test]
    fn rows_are_found_and_removed_by_key() {
        let mut table = Table::default();
        let ids: Vec<Id> = (0..100)
            .map(|i| table.insert(key(i), Tick(1000 + i), i).unwrap())
            .collect();
        table.check();
        for i in 0..100u64 {
            let id = table.find(&key(i)).unwrap().0;
            assert_eq!(id, ids[i as usize]);
            assert_eq!(table.get(id).unwrap().value, i);
            assert_eq!(table.get(id).unwrap().expires(), Tick(1000 + i));
        }
        assert!(table.find(&key(100)).is_none());
        for i in (0..100u64).step_by(2) {
            let row = table.remove(table.find(&key(i)).unwrap().0).unwrap();
            assert_eq!((row.key, row.value), (key(i), i));
        }
        table.check();
        assert_eq!(table.len(), 50);
        for i in 0..100u64 {
            assert_eq!(table.find(&key(i)).is_some(), i % 2 == 1);
        }
        // Vacant slots are reused before the slab grows.
        for i in 100..150 {
            table.insert(key(i), Tick(5000), i).unwrap();
        }
        assert_eq!(table.slots.len(), 100);
        table.check();
    }

    #[test]
    fn expired_rows_leave_in_expiry_order_within_budget() {
        let mut table = Table::default();
        for i in 0..10u64 {
            // Inserted out of order.
            table.insert(key(i), Tick(100 - i * 10), i).unwrap();
        }
        let (removed, swept) = removed_keys(&mut table, 45, 100);
        assert_eq!(removed, [6, 7, 8, 9]);
        assert!(swept.done);
        let (removed, swept) = removed_keys(&mut table, 100, 2);
        assert_eq!(removed, [4, 5]);
        assert!(!swept.done, "budget ran out with expired rows left");
        let (removed, swept) = removed_keys(&mut table, 100, 100);
        assert_eq!(removed, [0, 1, 2, 3]);
        assert!(swept.done);
        assert_eq!((table.len(), table.filings()), (0, 0));
        table.check();
    }

    #[test]
    fn a_later_expiry_keeps_the_row_until_then() {
        let mut table = Table::default();
        let id = table.insert(key(1), Tick(10), 1u64).unwrap();
        table.set_expiry(id, Tick(50));
        table.set_expiry(id, Tick(30));
        table.check();
        // One filing: moving the expiry later files nothing new.
        assert_eq!(table.filings(), 1);
        // The filing comes due first, finds the row alive and files it under its expiry.
        let (removed, swept) = removed_keys(&mut table, 20, 10);
        assert_eq!((removed.len(), swept.done), (0, true));
        assert_eq!(table.get(id).unwrap().value, 1);
        assert_eq!(table.filings(), 1);
        table.check();
        let (removed, _) = removed_keys(&mut table, 29, 10);
        assert!(removed.is_empty());
        let (removed, _) = removed_keys(&mut table, 30, 10);
        assert_eq!(removed, [1]);
        table.check();
    }

    #[test]
    fn an_earlier_expiry_is_filed_again_and_leftovers_are_dropped() {
        let mut table = Table::default();
        let id = table.insert(key(1), Tick(100), 1u64).unwrap();
        table.set_expiry(id, Tick(40));
        assert_eq!(table.filings(), 2);
        table.check();
        let (removed, _) = removed_keys(&mut table, 40, 10);
        assert_eq!(removed, [1]);
        // The old filing is left behind; when it comes due it removes nothing, not even a new
        // row that took over the slot.
        let reused = table.insert(key(2), Tick(500), 2).unwrap();
        assert_eq!(reused, id);
        let (removed, swept) = removed_keys(&mut table, 100, 10);
        assert_eq!((removed.len(), swept.done), (0, true));
        assert_eq!(table.get(reused).unwrap().value, 2);
        assert_eq!(table.filings(), 1);
        table.check();
    }

    #[test]
    fn leftovers_of_removed_rows_never_remove_a_live_row() {
        let mut table = Table::default();
        // A row removed before it expires leaves its filing; a new row in the same slot with
        // a later expiry must outlive that filing.
        for round in 0..100u64 {
            let id = table.insert(key(round), Tick(round + 1), round).unwrap();
            table.remove(id).unwrap();
        }
        let live = table.insert(key(1000), Tick(10_000), 1000).unwrap();
        table.check();
        let (removed, swept) = removed_keys(&mut table, 9_999, usize::MAX);
        assert!(removed.is_empty() && swept.done);
        assert_eq!(table.get(live).unwrap().value, 1000);
        assert_eq!(table.filings(), 1);
        let (removed, _) = removed_keys(&mut table, 10_000, usize::MAX);
        assert_eq!(removed, [1000]);
    }

    #[test]
    fn leftovers_stay_bounded_without_sweeps() {
        let mut table = Table::default();
        // Rows that come and go long before their expiry, and expiries moved earlier, leave
        // filings behind; the expiry index is rebuilt before they exceed twice the slab.
        let keep = table.insert(key(u64::MAX), Tick(1_000_000), 0).unwrap();
        for i in 0..10_000u64 {
            let id = table.insert(key(i), Tick(1_000_000 + i), i).unwrap();
            table.set_expiry(id, Tick(900_000 - i));
            table.set_expiry(keep, Tick(800_000 - i));
            table.remove(id).unwrap();
            assert!(table.filings() <= 2 * MIN_FILINGS.max(table.slots.len()));
        }
        table.check();
        assert_eq!(table.slots.len(), 2);
        let (removed, _) = removed_keys(&mut table, 790_000, usize::MAX);
        assert!(removed.is_empty());
        let (removed, _) = removed_keys(&mut table, 800_000 - 9_999, usize::MAX);
        assert_eq!(removed, [0]);
        // Leftovers due later go when they come due.
        let (removed, swept) = removed_keys(&mut table, 2_000_000, usize::MAX);
        assert!(removed.is_empty() && swept.done);
        assert_eq!((table.len(), table.filings()), (0, 0));
    }

    /// A random mix of every operation against a plain model: the table removes exactly the
    /// rows the model says expired, and never another.
    #[test]
    fn random_operations_match_a_model() {
        use std::collections::HashMap;
        let mut table: Table<u64> = Table::default();
        let mut model: HashMap<u64, (u64, u64)> = HashMap::new(); // key -> (expires, value)
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |bound: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % bound
        };
        let mut now = 0u64;
        for step in 0..20_000u64 {
            let k = next(300);
            match next(10) {
                0..=3 => {
                    if let std::collections::hash_map::Entry::Vacant(vacant) = model.entry(k) {
                        let expires = now + 1 + next(200);
                        table.insert(key(k), Tick(expires), step).unwrap();
                        vacant.insert((expires, step));
                    }
                }
                4..=5 => {
                    if let Some((id, _)) = table.find(&key(k)) {
                        let expires = now + next(300);
                        table.set_expiry(id, Tick(expires));
                        model.get_mut(&k).unwrap().0 = expires;
                    }
                }
                6 => {
                    if let Some((id, _)) = table.find(&key(k)) {
                        let row = table.remove(id).unwrap();
                        assert_eq!(model.remove(&k).unwrap().1, row.value);
                    }
                }
                _ => {
                    now += next(5);
                    let mut gone = Vec::new();
                    let budget = 1 + next(8) as usize;
                    let swept = table.remove_expired(Tick(now), budget, |row| gone.push(row));
                    for row in gone {
                        let (k, (expires, value)) = model
                            .iter()
                            .find(|(_, (_, v))| *v == row.value)
                            .map(|(k, e)| (*k, *e))
                            .unwrap();
                        assert!(expires <= now, "removed a live row");
                        assert_eq!(row.key, key(k));
                        assert_eq!(row.value, value);
                        model.remove(&k);
                    }
                    if swept.done {
                        assert!(
                            model.values().all(|(expires, _)| *expires > now),
                            "an expired row was left"
                        );
                    }
                }
            }
            if step % 997 == 0 {
                table.check();
            }
        }
        table.check();
        assert_eq!(table.len(), model.len());
        for (k, (expires, value)) in &model {
            let (_, row) = table.find(&key(*k)).unwrap();
            assert_eq!((row.expires(), row.value), (Tick(*expires), *value));
        }
    }
}
