//! Files in older layouts, brought over to the current one at open.

use redb::{ReadableTable, TableDefinition, TableHandle};

use super::codec::RECORDS;
use super::codec::{Header, encode_row};
use crate::record::RecordKey;

/// The second layout's expiry index on disk: expiry ++ row number. Dropped at open.
pub(super) const EXPIRIES_V2: TableDefinition<&[u8; 16], ()> =
    TableDefinition::new("expiries_by_write");
/// The first layout: records by record key. Rewritten in the current one at open.
pub(super) const RECORDS_V1: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new("records");
pub(super) const EXPIRIES_V1: TableDefinition<&[u8; 40], ()> = TableDefinition::new("expiries");

/// How many records [`migrate`] carried over, and how many it could not read.
pub(super) struct Migrated {
    pub(super) moved: u64,
    pub(super) unreadable: u64,
}

/// Creates the table, and brings a file in an older layout over to the current one: the
/// first layout's records (by record key) are rewritten as rows, keeping every record and its
/// expiry, and the second layout's expiry index on disk is dropped (the writer keeps it in
/// memory). A file in the current layout is left as it is (`None`).
pub(super) fn migrate(txn: &redb::WriteTransaction) -> Result<Option<Migrated>, redb::Error> {
    let mut records = txn.open_table(RECORDS)?;
    let tables: Vec<String> = txn
        .list_tables()?
        .map(|table| table.name().to_owned())
        .collect();
    let has = |name: &str| tables.iter().any(|table| table == name);
    let (v1, v2) = (has(RECORDS_V1.name()), has(EXPIRIES_V2.name()));
    if v2 {
        txn.delete_table(EXPIRIES_V2)?;
    }
    if !v1 {
        return Ok(v2.then_some(Migrated {
            moved: 0,
            unreadable: 0,
        }));
    }
    let mut next = match records.last()? {
        Some((row, _)) => row.value().saturating_add(1),
        None => 0,
    };
    let (mut moved, mut unreadable) = (0u64, 0u64);
    {
        let old = txn.open_table(RECORDS_V1)?;
        for entry in old.iter()? {
            let (key, value) = entry?;
            let key = RecordKey(*key.value());
            // An undecodable record cannot be given an expiry; it is not carried over.
            let Ok((header, completion)) = Header::parse(value.value()) else {
                unreadable += 1;
                continue;
            };
            records.insert(next, encode_row(&key, &header, completion).as_slice())?;
            next += 1;
            moved += 1;
        }
    }
    txn.delete_table(RECORDS_V1)?;
    txn.delete_table(EXPIRIES_V1)?;
    Ok(Some(Migrated { moved, unreadable }))
}
