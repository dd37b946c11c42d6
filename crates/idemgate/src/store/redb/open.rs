//! Opening the file: its tables and format, bringing it up to date from the journal (only a
//! file as its last checkpoint left it), the checkpoint's marks, and the read view a file
//! that refuses writes is answered from.

use std::path::Path;

use redb::{Database, DatabaseError, ReadableDatabase, ReadableTable, TableDefinition};
use sha2::{Digest, Sha256};

use super::clock::now_ms;
use super::codec::{Header, RECORDS, StateHeader, encode_row, split_row};
use super::disk::{Disk, parent_dir};
use super::index::RowIndex;
use super::journal::{Change, Journal};
use super::migrate::{Migrated, migrate};
use super::{RedbError, unavailable};
use crate::store::StoreError;

/// Page cache redb may use.
pub(super) const CACHE_BYTES: usize = 64 * 1024 * 1024;

/// The journal's id ([`JOURNAL_ID`]) and the sequence number of the last journal frame whose
/// changes the database holds ([`JOURNAL_APPLIED`]), written with every checkpoint, the only
/// commits after the file is opened.
pub(super) const JOURNAL_STATE: TableDefinition<&str, u64> = TableDefinition::new("journal");
pub(super) const JOURNAL_ID: &str = "id";
pub(super) const JOURNAL_APPLIED: &str = "applied";
/// The file's format ([`FORMAT`]), checked at every open.
pub(super) const FORMAT_KEY: &str = "format";
/// The row high-water mark at the last checkpoint: no row at or past it was written yet.
pub(super) const MARK_NEXT_ROW: &str = "next_row";
/// How many rows the file held at the last checkpoint.
pub(super) const MARK_ROWS: &str = "rows";
/// A digest of the file's last row (its number and bytes) at the last checkpoint; 0 if none.
pub(super) const MARK_LAST_ROW: &str = "last_row";
/// The file's format: 1 kept records by key, 2 rows by write with the expiry index on disk,
/// 3 rows by write beside the journal, with the marks of the last checkpoint, 4 as 3 with
/// the journal's frames past the last checkpoint possibly going on in its second file. From
/// 3 on, a binary refuses a file in a newer format than its own.
///
/// The open writes 4 before any frame can reach the second file, so a binary that reads only
/// the first refuses the file after a crash; a clean close, which leaves no frame past its
/// checkpoint, writes [`FORMAT_SETTLED`], so a downgrade after a clean stop still opens it.
pub(super) const FORMAT: u64 = 4;
/// The format of a file whose checkpoint covers every frame in its journal.
pub(super) const FORMAT_SETTLED: u64 = 3;

/// Opens (or creates) the file and its journal, and their folder, each new entry made durable
/// in its directory; repairs the file if it was not closed cleanly; creates the table, so
/// reads never find it missing; brings a file in an older layout over; and reads where each
/// record's row is and when it expires. With `leases_from`, a process starting up: every
/// record in flight is given a whole lease from then (see [`Clock`](super::clock::Clock)).
pub(super) fn open_file(
    disk: &dyn Disk,
    path: &Path,
    leases_from: Option<u64>,
) -> Result<(Database, Journal, RowIndex), StoreError> {
    let dir = parent_dir(path);
    let sync_dir = |dir: &Path| {
        disk.sync_dir(dir).map_err(|source| {
            unavailable(RedbError::SyncDir {
                path: dir.to_path_buf(),
                source,
            })
        })
    };
    let made = disk.create_dir_all(dir).map_err(|source| {
        unavailable(RedbError::CreateDir {
            path: dir.to_path_buf(),
            source,
        })
    })?;
    for made in &made {
        sync_dir(parent_dir(made))?;
    }
    let db = open_database(disk, path)?;
    let opened = attach(disk, db, path, leases_from)?;
    // The file and the journal exist for good before anything is acknowledged.
    sync_dir(dir)?;
    Ok(opened)
}

/// Opens (or creates) the database file, repairing it if it was not closed cleanly, from what
/// the disk holds.
///
/// A failed sync (in this process, or in one that died before it could reopen the file)
/// leaves pages in the system's cache that the disk may never have got, marked clean. Read
/// through them, the file would take a failed checkpoint for done, its journal frames would
/// be skipped, and later commits would build on pages that are not on the disk. So every
/// open first drops both files' cached pages: the file is read as the disk holds it, and the
/// journal, kept whole until a checkpoint's sync succeeds, brings back whatever it lacks.
pub(super) fn open_database(disk: &dyn Disk, path: &Path) -> Result<Database, StoreError> {
    let [journal, journal_2] = Journal::paths_for(path);
    for file in [path, &journal, &journal_2] {
        disk.forget_cached(file).map_err(|source| {
            unavailable(RedbError::Forget {
                path: file.to_path_buf(),
                source,
            })
        })?;
    }
    disk.create_database(Database::builder().set_cache_size(CACHE_BYTES), path)
        .map_err(|e| match e {
            DatabaseError::DatabaseAlreadyOpen => unavailable(RedbError::AlreadyOpen {
                path: path.to_path_buf(),
            }),
            other => unavailable(RedbError::Open {
                path: path.to_path_buf(),
                source: other.into(),
            }),
        })
}

/// Brings an open database up to date: checks its format, migrates an older layout, applies
/// the changes its journal holds past the last checkpoint (once the file is shown to be as
/// that checkpoint left it), records a new checkpoint, and reads the row index.
pub(super) fn attach(
    disk: &dyn Disk,
    db: Database,
    path: &Path,
    leases_from: Option<u64>,
) -> Result<(Database, Journal, RowIndex), StoreError> {
    let open_error = open_error(path);
    let Prepared {
        txn,
        journal,
        frames,
        next_row,
        migrated,
    } = prepare(disk, &db, path, leases_from)?;
    record_checkpoint(&txn, journal.last(), next_row, FORMAT).map_err(&open_error)?;
    txn.commit().map_err(|e| open_error(e.into()))?;
    // Logged once committed.
    match migrated {
        Some(Migrated { moved, unreadable }) if unreadable > 0 => tracing::warn!(
            moved,
            unreadable,
            "redb file migrated; unreadable records were not carried over"
        ),
        Some(Migrated { moved, .. }) => {
            tracing::info!(moved, "redb file migrated to the current layout")
        }
        None => {}
    }
    if frames > 0 {
        tracing::info!(
            frames,
            journal = %journal.path().display(),
            "redb journal applied: changes acknowledged after the last checkpoint are back"
        );
    }
    let rows = db
        .begin_read()
        .map_err(redb::Error::from)
        .and_then(|read| RowIndex::load(&read.open_table(RECORDS)?, next_row))
        .map_err(&open_error)?;
    Ok((db, journal, rows))
}

/// The file as the store answers from it while it takes no writes (see
/// [`Writer::open_read_view`](super::writer::Writer::open_read_view)): opened anew, brought up to date as [`attach`] does, in a
/// write transaction that is never committed.
pub(super) fn read_view(
    disk: &dyn Disk,
    path: &Path,
) -> Result<(Database, redb::WriteTransaction, RowIndex), StoreError> {
    let db = open_database(disk, path)?;
    let prepared = prepare(disk, &db, path, None)?;
    let rows = prepared
        .txn
        .open_table(RECORDS)
        .map_err(redb::Error::from)
        .and_then(|records| RowIndex::load(&records, prepared.next_row))
        .map_err(open_error(path))?;
    Ok((db, prepared.txn, rows))
}

/// The error of a failed open of the file at `path`.
pub(super) fn open_error(path: &Path) -> impl Fn(redb::Error) -> StoreError + '_ {
    move |source| {
        unavailable(RedbError::Open {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// A file brought up to date in a write transaction not yet committed.
pub(super) struct Prepared {
    pub(super) txn: redb::WriteTransaction,
    pub(super) journal: Journal,
    /// How many journal frames were applied.
    pub(super) frames: usize,
    /// The number the next row written will have.
    pub(super) next_row: u64,
    pub(super) migrated: Option<Migrated>,
}

/// Brings `db` up to date in a write transaction it leaves uncommitted: checks the format,
/// migrates an older layout, applies the journal's frames past the last checkpoint to a file
/// that is as that checkpoint left it (each frame must fit it), and with `leases_from` gives
/// every record in flight a whole lease from then.
pub(super) fn prepare(
    disk: &dyn Disk,
    db: &Database,
    path: &Path,
    leases_from: Option<u64>,
) -> Result<Prepared, StoreError> {
    let open_error = open_error(path);
    let txn = db.begin_write().map_err(|e| open_error(e.into()))?;
    refuse_a_newer_format(&txn, path)?;
    let migrated = migrate(&txn).map_err(&open_error)?;
    let state = file_state(&txn).map_err(&open_error)?;
    let journal_path = Journal::path_for(path);
    let journal_error = |source| {
        unavailable(RedbError::Journal {
            path: journal_path.clone(),
            source,
        })
    };
    let mismatch = |why: String| {
        unavailable(RedbError::JournalMismatch {
            path: path.to_path_buf(),
            journal: journal_path.clone(),
            why,
        })
    };
    let (journal, recovered) =
        Journal::open(disk, path, state.id, state.applied).map_err(journal_error)?;
    let next_row = {
        let mut records = txn.open_table(RECORDS).map_err(|e| open_error(e.into()))?;
        let found =
            Mark::of(&records, state.mark.map_or(0, |mark| mark.next_row)).map_err(&open_error)?;
        if !recovered.is_empty() {
            if let Some(mark) = state.mark.filter(|&mark| mark != found) {
                return Err(mismatch(format!(
                    "the file holds {} rows up to the row mark {}, where its last checkpoint \
                     left {} rows up to {}",
                    found.rows, found.next_row, mark.rows, mark.next_row
                )));
            }
            for (frame, seq) in recovered.frames().zip(state.applied + 1..) {
                for change in frame {
                    let change = change.map_err(journal_error)?;
                    let (row, matches) = match change {
                        Change::Put { row, value } => {
                            (row, records.insert(row, value).map(|old| old.is_none()))
                        }
                        Change::Remove { row } => {
                            (row, records.remove(row).map(|old| old.is_some()))
                        }
                    };
                    if !matches.map_err(|e| open_error(e.into()))? {
                        return Err(mismatch(format!(
                            "frame {seq} changes row {row}, which the file holds otherwise"
                        )));
                    }
                }
            }
        }
        if let Some(now) = leases_from {
            renew_leases(&mut records, now).map_err(&open_error)?;
        }
        // Rows are never numbered twice, even after the last ones were removed.
        found
            .next_row
            .max(next_row_of(&records).map_err(&open_error)?)
    };
    Ok(Prepared {
        txn,
        journal,
        frames: recovered.len(),
        next_row,
        migrated,
    })
}

/// The file's format, refused if it is newer than this build's.
fn refuse_a_newer_format(txn: &redb::WriteTransaction, path: &Path) -> Result<(), StoreError> {
    let format = txn
        .open_table(JOURNAL_STATE)
        .and_then(|state| Ok(state.get(FORMAT_KEY)?.map(|v| v.value())))
        .map_err(|e| open_error(path)(e.into()))?;
    match format.filter(|&found| found > FORMAT) {
        Some(found) => Err(unavailable(RedbError::NewerFormat {
            path: path.to_path_buf(),
            found,
            supported: FORMAT,
        })),
        None => Ok(()),
    }
}

/// Gives every record in flight a whole lease from `now` (their owners' process is gone).
fn renew_leases(
    records: &mut redb::Table<'_, u64, &'static [u8]>,
    now: u64,
) -> Result<(), redb::Error> {
    let renewed = lease_from(records, now)?;
    if renewed > 0 {
        tracing::info!(
            renewed,
            "redb records found in flight at open lapse a whole lease from now"
        );
    }
    Ok(())
}

/// What the last checkpoint recorded of the file, to tell at open whether anything else
/// wrote to it since: the journal's frames apply only to the file as that checkpoint left it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Mark {
    /// The row high-water mark: the number the next row written would have had.
    pub(super) next_row: u64,
    pub(super) rows: u64,
    /// A digest of the last row's number and bytes (0 for an empty table).
    pub(super) last_row: u64,
}

impl Mark {
    /// The file's mark now, with the high-water mark `next_row` (at least past its last row).
    pub(super) fn of(
        records: &impl ReadableTable<u64, &'static [u8]>,
        next_row: u64,
    ) -> Result<Self, redb::Error> {
        let last = records.last()?;
        let last_row = last.as_ref().map_or(0, |(row, value)| {
            let digest = Sha256::new()
                .chain_update(row.value().to_le_bytes())
                .chain_update(value.value())
                .finalize();
            u64::from_le_bytes(digest[..8].try_into().expect("a SHA-256 has 8 bytes"))
        });
        let past_last = last.map_or(0, |(row, _)| row.value().saturating_add(1));
        Ok(Self {
            next_row: next_row.max(past_last),
            rows: records.len()?,
            last_row,
        })
    }
}

/// Gives every record in flight whose lease length is known a whole lease from `now`, the
/// open of a process whose clock may not agree with the one that wrote the deadline (a wall
/// clock stepped between the two, or the owner's request still running upstream after its
/// gateway died). Returns how many. Rows written before the lease length was kept keep
/// their deadlines.
pub(super) fn lease_from(
    records: &mut redb::Table<'_, u64, &'static [u8]>,
    now: u64,
) -> Result<usize, redb::Error> {
    let mut renewed = Vec::new();
    for entry in records.iter()? {
        let (row, value) = entry?;
        let Ok((key, record)) = split_row(value.value()) else {
            continue;
        };
        let Ok((mut header, _)) = Header::parse(record) else {
            continue;
        };
        if let StateHeader::InFlight {
            lease_deadline,
            lease,
            ..
        } = &mut header.state
            && *lease > 0
        {
            *lease_deadline = now.saturating_add(*lease);
            header.expires = header.expires.max(*lease_deadline);
            renewed.push((row.value(), encode_row(&key, &header, &[])));
        }
    }
    for (row, value) in &renewed {
        records.insert(row, value.as_slice())?;
    }
    Ok(renewed.len())
}

/// The number after the table's last row (0 for an empty table).
pub(super) fn next_row_of(
    records: &impl ReadableTable<u64, &'static [u8]>,
) -> Result<u64, redb::Error> {
    Ok(records
        .last()?
        .map_or(0, |(row, _)| row.value().saturating_add(1)))
}

/// Records in `txn` a checkpoint: the database holds the changes of journal frames up to
/// `seq`, rows are numbered from `next_row` on, and the file is in `format`. The file's mark
/// is taken from `txn`'s table, so it is the state this commit leaves.
pub(super) fn record_checkpoint(
    txn: &redb::WriteTransaction,
    seq: u64,
    next_row: u64,
    format: u64,
) -> Result<(), redb::Error> {
    let mark = Mark::of(&txn.open_table(RECORDS)?, next_row)?;
    let mut state = txn.open_table(JOURNAL_STATE)?;
    state.insert(FORMAT_KEY, format)?;
    state.insert(JOURNAL_APPLIED, seq)?;
    state.insert(MARK_NEXT_ROW, mark.next_row)?;
    state.insert(MARK_ROWS, mark.rows)?;
    state.insert(MARK_LAST_ROW, mark.last_row)?;
    Ok(())
}

/// The file's journal id, the last journal frame whose changes it holds, and its mark at the
/// last checkpoint.
pub(super) struct FileState {
    pub(super) id: u64,
    pub(super) applied: u64,
    /// `None` for a file no checkpoint of this version has committed yet.
    pub(super) mark: Option<Mark>,
}

/// The file's state, with a journal id made (in `txn`) for a file that has none yet.
pub(super) fn file_state(txn: &redb::WriteTransaction) -> Result<FileState, redb::Error> {
    let mut state = txn.open_table(JOURNAL_STATE)?;
    let id = state.get(JOURNAL_ID)?.map(|v| v.value());
    let id = match id {
        Some(id) => id,
        None => {
            // 64 random bits (std's hasher keys come from the OS): a journal left beside
            // another database file is not applied to this one.
            use std::hash::BuildHasher;
            let id = std::hash::RandomState::new().hash_one((std::process::id(), now_ms()));
            state.insert(JOURNAL_ID, id)?;
            id
        }
    };
    let read = |key| -> Result<Option<u64>, redb::Error> { Ok(state.get(key)?.map(|v| v.value())) };
    let applied = read(JOURNAL_APPLIED)?.unwrap_or(0);
    let mark = match (read(MARK_NEXT_ROW)?, read(MARK_ROWS)?, read(MARK_LAST_ROW)?) {
        (Some(next_row), Some(rows), Some(last_row)) => Some(Mark {
            next_row,
            rows,
            last_row,
        }),
        _ => None,
    };
    Ok(FileState { id, applied, mark })
}
