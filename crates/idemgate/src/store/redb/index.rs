//! The writer's in-memory index of the file: each record key's row and each row's expiry.

use std::collections::BTreeSet;

use hashbrown::HashTable;
use redb::ReadableTable;

use super::codec::{row_expiry, split_row};
use crate::record::RecordKey;
use crate::store::key_hash::KeyHasher;

/// Where each record key's row is and when each row expires, kept by the writer and read
/// from the file at open.
pub(super) struct RowIndex {
    /// Each record key with its row number.
    pub(super) rows: HashTable<(RecordKey, u64)>,
    pub(super) hasher: KeyHasher,
    /// Every row's expiry and row number, soonest first: the sweep's order.
    pub(super) expiries: BTreeSet<(u64, u64)>,
    /// The next row number to write.
    pub(super) next: u64,
}

impl RowIndex {
    /// Reads the index of every row; rows written from now on are numbered from `next` on
    /// (or past the last row, if that is later).
    pub(super) fn load(
        table: &impl ReadableTable<u64, &'static [u8]>,
        next: u64,
    ) -> Result<Self, redb::Error> {
        let mut index = Self {
            rows: HashTable::with_capacity(usize::try_from(table.len()?).unwrap_or(0)),
            hasher: KeyHasher::new(),
            expiries: BTreeSet::new(),
            next,
        };
        for entry in table.iter()? {
            let (row, value) = entry?;
            let row = row.value();
            index.next = index.next.max(row.saturating_add(1));
            index.expiries.insert((row_expiry(value.value()), row));
            // An undecodable row keeps no key entry; the sweep removes it when it expires.
            if let Ok((key, _)) = split_row(value.value()) {
                // Rows are read in order: a later row of the same key wins.
                index.set_row(key, row);
            }
        }
        Ok(index)
    }

    /// The row number of `key`'s record, if it has one.
    pub(super) fn row_of(&self, key: &RecordKey) -> Option<u64> {
        let hash = self.hasher.hash(key);
        self.rows.find(hash, |(k, _)| k == key).map(|&(_, row)| row)
    }

    /// Notes that `key`'s record is now in `row`.
    pub(super) fn set_row(&mut self, key: RecordKey, row: u64) {
        let hash = self.hasher.hash(&key);
        match self.rows.find_mut(hash, |(k, _)| *k == key) {
            Some(entry) => entry.1 = row,
            None => {
                let hasher = &self.hasher;
                self.rows
                    .insert_unique(hash, (key, row), |(k, _)| hasher.hash(k));
            }
        }
    }

    /// Forgets `key`'s row; with `only`, only if that is its row.
    pub(super) fn forget(&mut self, key: &RecordKey, only: Option<u64>) {
        let hash = self.hasher.hash(key);
        let matches = |&(k, row): &(RecordKey, u64)| k == *key && only.is_none_or(|r| r == row);
        if let Ok(entry) = self.rows.find_entry(hash, matches) {
            entry.remove();
        }
    }

    pub(super) fn take_next(&mut self) -> u64 {
        let row = self.next;
        self.next += 1;
        row
    }
}
