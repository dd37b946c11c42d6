//! The overlay read through [`Records::Overlaid`]: removals of the checkpoint's rows kept as
//! markers, of rows written since dropped, and its memory counted to match.

use redb::backends::InMemoryBackend;
use redb::{Database, ReadableDatabase, ReadableTable};

use super::super::codec::RECORDS;
use super::{ENTRY_COST, Overlay, Records, RecordsView};

/// A database whose committed records table holds rows 0 and 1, and that table as a
/// checkpoint leaves it for the batches that read under the overlay.
fn base() -> (Database, RecordsView) {
    let db = Database::builder()
        .create_with_backend(InMemoryBackend::new())
        .unwrap();
    let txn = db.begin_write().unwrap();
    {
        let mut table = txn.open_table(RECORDS).unwrap();
        table.insert(0, b"zero".as_slice()).unwrap();
        table.insert(1, b"one".as_slice()).unwrap();
    }
    txn.commit().unwrap();
    let view = db.begin_read().unwrap().open_table(RECORDS).unwrap();
    (db, view)
}

/// The records a batch reads and writes while a checkpoint runs.
fn overlaid<'t>(base: &'t RecordsView, overlay: &'t mut Overlay) -> Records<'t> {
    Records::Overlaid { base, overlay }
}

fn read(records: &Records<'_>, row: u64) -> Option<Vec<u8>> {
    let value = records.get(row).unwrap();
    value.map(|value| value.value().to_vec())
}

/// A row written during the checkpoint and removed again leaves no entry (the checkpoint's
/// table never had it); a removed row of the checkpoint's keeps a marker that hides it. Reads
/// see both right, the memory count follows, and the changes land in the next transaction.
#[test]
fn removals_keep_a_marker_only_for_the_checkpoints_rows() {
    let (db, view) = base();
    let mut overlay = Overlay::new(2);
    let mut records = overlaid(&view, &mut overlay);
    records.insert(2, b"two").unwrap();
    assert_eq!(read(&records, 2).as_deref(), Some(b"two".as_slice()));
    assert!(records.remove(2).unwrap().is_some(), "row 2 was there");
    assert_eq!(read(&records, 2), None);
    assert!(records.remove(2).unwrap().is_none(), "row 2 is gone");

    assert!(records.remove(0).unwrap().is_some(), "row 0 was there");
    assert_eq!(
        read(&records, 0),
        None,
        "the marker hides the checkpoint's row"
    );
    assert!(records.remove(0).unwrap().is_none(), "row 0 is gone");
    assert!(records.remove(7).unwrap().is_none(), "row 7 never was");
    assert_eq!(read(&records, 1).as_deref(), Some(b"one".as_slice()));
    records.insert(3, b"three").unwrap();
    drop(records);

    assert_eq!(overlay.len(), 2, "row 0's marker and row 3");
    assert_eq!(
        overlay.bytes(),
        2 * ENTRY_COST + b"three".len(),
        "nothing is counted of row 2's entry"
    );

    drop(view);
    let txn = db.begin_write().unwrap();
    overlay
        .apply_to(&mut txn.open_table(RECORDS).unwrap())
        .unwrap();
    txn.commit().unwrap();
    let table = db.begin_read().unwrap().open_table(RECORDS).unwrap();
    let rows: Vec<(u64, Vec<u8>)> = table
        .iter()
        .unwrap()
        .map(|entry| {
            let (row, value) = entry.unwrap();
            (row.value(), value.value().to_vec())
        })
        .collect();
    assert_eq!(rows, [(1, b"one".to_vec()), (3, b"three".to_vec())]);
}

/// The memory count goes back down as entries go, and a replaced value is no longer counted:
/// a claim completed during the checkpoint counts once against the overlay's bound.
#[test]
fn the_memory_count_follows_the_entries() {
    let (_db, view) = base();
    let mut overlay = Overlay::new(2);
    let mut records = overlaid(&view, &mut overlay);
    for row in 2..50 {
        records.insert(row, &[7; 100]).unwrap();
        records.insert(row, &[8; 60]).unwrap();
    }
    drop(records);
    assert_eq!(overlay.bytes(), 48 * (ENTRY_COST + 60));
    let mut records = overlaid(&view, &mut overlay);
    for row in (2..50).rev() {
        records.remove(row).unwrap();
    }
    records.remove(1).unwrap();
    drop(records);
    assert_eq!(overlay.len(), 1);
    assert_eq!(overlay.bytes(), ENTRY_COST, "row 1's marker alone");
}
