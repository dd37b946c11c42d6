//! The table a batch reads and writes: the open write transaction's, or, while a checkpoint
//! commits on its own thread (and holds redb's only write transaction), the table as that
//! checkpoint leaves it with the rows changed since held in memory.
//!
//! Every read and every decision goes through [`Records`], so an answer given while a
//! checkpoint runs is the one the open transaction would have given. Rows are numbered in
//! the order they are written and a number is never used twice, so a row's last change in
//! the overlay is its state: the overlay is applied to the table in any order once the
//! checkpoint is over.

use std::collections::BTreeMap;

use redb::{AccessGuard, ReadOnlyTable, ReadableTable, Table};

use super::codec::split_row;
use crate::record::RecordKey;

/// The records table in a write transaction.
pub(super) type RecordsTable<'t> = Table<'t, u64, &'static [u8]>;
/// The records table as a checkpoint commits it.
pub(super) type RecordsView = ReadOnlyTable<u64, &'static [u8]>;

/// Memory an overlay entry costs beyond its value: the map's node share, the row number and
/// the value's own header.
const ENTRY_COST: usize = 64;

/// The rows changed since a checkpoint began: each row's value, or `None` if a row of the
/// checkpoint's was removed.
pub(super) struct Overlay {
    changes: BTreeMap<u64, Option<Vec<u8>>>,
    /// About how much memory the changes hold, to bound it: a replaced or removed value is
    /// freed and no longer counted, so a claim completed during the checkpoint counts once.
    bytes: usize,
    /// The first row written since the checkpoint began: no row from it on is in the
    /// checkpoint's table, so its removal needs no marker.
    first_new: u64,
}

impl Overlay {
    /// An empty overlay of a checkpoint whose table holds the rows below `first_new`.
    pub(super) fn new(first_new: u64) -> Self {
        Self {
            changes: BTreeMap::new(),
            bytes: 0,
            first_new,
        }
    }

    /// About how much memory the overlay holds.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    /// How many rows changed.
    pub(super) fn len(&self) -> usize {
        self.changes.len()
    }

    /// Writes the overlay's changes to `table` (of a write transaction begun once the
    /// checkpoint finished).
    pub(super) fn apply_to(self, table: &mut RecordsTable<'_>) -> Result<(), redb::Error> {
        for (row, value) in self.changes {
            match value {
                Some(value) => drop(table.insert(row, value.as_slice())?),
                None => drop(table.remove(row)?),
            }
        }
        Ok(())
    }

    /// `Some(None)` if `row` was removed, `Some(value)` if written, `None` if unchanged.
    fn get(&self, row: u64) -> Option<Option<&[u8]>> {
        self.changes.get(&row).map(Option::as_deref)
    }

    fn insert(&mut self, row: u64, value: &[u8]) {
        self.set(row, Some(value.to_vec()));
    }

    fn remove(&mut self, row: u64) {
        if row < self.first_new {
            self.set(row, None);
        } else if let Some(old) = self.changes.remove(&row) {
            self.bytes -= cost(&old);
        }
    }

    /// Sets `row`'s change, keeping [`bytes`](Self::bytes) the sum of the entries' costs.
    fn set(&mut self, row: u64, value: Option<Vec<u8>>) {
        self.bytes += cost(&value);
        if let Some(old) = self.changes.insert(row, value) {
            self.bytes -= cost(&old);
        }
    }
}

/// The memory one overlay entry holds.
fn cost(value: &Option<Vec<u8>>) -> usize {
    ENTRY_COST + value.as_ref().map_or(0, Vec::len)
}

/// The records a batch reads and writes.
pub(super) enum Records<'t> {
    /// The open write transaction's table.
    Open(RecordsTable<'t>),
    /// While a checkpoint commits: its table, under the changes made since.
    Overlaid {
        base: &'t RecordsView,
        overlay: &'t mut Overlay,
    },
}

/// A stored row's value, read in place.
pub(super) enum RowValue<'a> {
    Stored(AccessGuard<'a, &'static [u8]>),
    Held(&'a [u8]),
}

impl RowValue<'_> {
    pub(super) fn value(&self) -> &[u8] {
        match self {
            RowValue::Stored(guard) => guard.value(),
            RowValue::Held(bytes) => bytes,
        }
    }
}

impl Records<'_> {
    /// The value of `row`, if there is one.
    pub(super) fn get(&self, row: u64) -> Result<Option<RowValue<'_>>, redb::Error> {
        match self {
            Records::Open(table) => Ok(table.get(row)?.map(RowValue::Stored)),
            Records::Overlaid { base, overlay } => match overlay.get(row) {
                Some(value) => Ok(value.map(RowValue::Held)),
                None => Ok(base.get(row)?.map(RowValue::Stored)),
            },
        }
    }

    /// Writes `value` as `row`.
    pub(super) fn insert(&mut self, row: u64, value: &[u8]) -> Result<(), redb::Error> {
        match self {
            Records::Open(table) => drop(table.insert(row, value)?),
            Records::Overlaid { overlay, .. } => overlay.insert(row, value),
        }
        Ok(())
    }

    /// Removes `row`: `None` if there was no such row, else the record key it held (`None`
    /// if undecodable).
    pub(super) fn remove(&mut self, row: u64) -> Result<Option<Option<RecordKey>>, redb::Error> {
        let key_of = |value: &[u8]| split_row(value).ok().map(|(key, _)| key);
        match self {
            Records::Open(table) => Ok(table.remove(row)?.map(|value| key_of(value.value()))),
            Records::Overlaid { .. } => {
                let Some(key) = self.get(row)?.map(|value| key_of(value.value())) else {
                    return Ok(None);
                };
                if let Records::Overlaid { overlay, .. } = self {
                    overlay.remove(row);
                }
                Ok(Some(key))
            }
        }
    }
}

#[cfg(test)]
mod tests;
