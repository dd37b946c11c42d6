//! [`RedbStore`]: records in an embedded, crash-safe database file (redb).
//!
//! Every change is durable before the call returns, so a claim is on disk before its request
//! goes upstream and an acknowledged completion survives a `kill -9`. A disk manages on the
//! order of a thousand syncs a second, so all calls go through one writer thread that takes
//! everything queued (up to [`MAX_BATCH`] calls; after a large batch it first waits [`GATHER`]
//! for the callers it just answered to come back), applies it in order in one write
//! transaction — each change still a single atomic step, later ones seeing earlier ones — and
//! makes the whole batch durable at once (group commit). A batch that changed nothing
//! (replays, conflicts, fenced calls) is not synced. Nothing blocks the async runtime, and a
//! batch's answers cost its callers' runtime one wake-up from the writer thread, not one each
//! (see [`Handout`]).
//!
//! A batch is made durable by its journal frame: the batch is applied to the writer's open
//! write transaction, which is not committed, and its row changes are appended to the journal
//! beside the file and synced (one write, where a durable redb commit writes some twenty
//! scattered pages). About once a second, or when the journal passes 16 MiB, that transaction
//! is committed durably (a checkpoint): the pages the batches of a second changed again and
//! again are copied and written once. The journal then starts again; at open, the frames
//! written since the last checkpoint are applied again (see [`journal`]). A clean close ends
//! with a checkpoint, and an idle writer checkpoints its last frames at its next sweep tick
//! once one is due, so a change lives in the journal alone for a second or two at most. Any
//! failure once the transaction holds changes refuses changes until the file is reopened,
//! which applies the journal.
//!
//! Deadlines are stored as wall-clock milliseconds since the Unix epoch, because the file
//! outlives the process that wrote it, but judged on the writer's [`Clock`]: the wall clock
//! read once at open, advanced by the monotonic clock. A step of the wall clock while the
//! store is open moves no lease and no expiry; a record found in flight at open lapses a whole
//! lease after the open (its lease's length is kept in the record); expiries carry over
//! across restarts on the wall clock.
//!
//! # File layout
//!
//! A sync costs in proportion to the pages it writes, so records are laid out to make a
//! batch touch few pages: each write of a record appends it under the next row number and
//! removes its previous row, so a batch's writes land together at the end of the table
//! instead of on one page per record key.
//!
//! - `records_by_write`: row number (u64) → record key (32 bytes), then the record: version,
//!   state tag, fingerprint, expiry, then the state's fields (owner token and lease deadline;
//!   time stored and the [`Completion::encode`] bytes; time it became ambiguous).
//!
//! That table holds every record. The writer keeps two indexes of it in memory, read from the
//! file at open (one pass over the rows) and changed with each write: the row number of every
//! record key (a hash map), and every row's expiry with its row number (an ordered set).
//! Expired records are found in expiry order and removed in bounded batches, without a scan
//! and without a second table to keep on disk: a write changes one table, not two, and redb
//! reuses the freed pages, so a steady stream of short-lived records keeps the file at a
//! steady size. The two cost 80 to 120 bytes of memory a record (measured with a million
//! records: a 40-byte hash-map entry, up to twice that with the map's spare room, and about
//! 36 bytes in the set).
//!
//! The file's other table, `journal`, holds the file's format (a binary refuses a file in a
//! newer format than its own, naming both), the journal's id (so a journal left beside
//! another database is not applied) and, written with each checkpoint, the sequence number of
//! the last journal frame whose changes the database holds and the file's mark: the row
//! high-water mark, the number of rows and a digest of the last one. The journal's frames are
//! applied at open only to the file that checkpoint left, and each frame must fit it (a row it
//! writes is new, a row it removes is there): a file another program wrote since, such as a
//! binary from before the journal started after a crash, refuses to open with an error that
//! names the journal, rather than have stale frames written over newer records. A downgrade
//! therefore needs a clean stop, which leaves the journal empty.
//!
//! Older layouts are brought over when a file is opened: the first (`records` by record key)
//! is rewritten in this one; the second also kept the expiry index on disk
//! (`expiries_by_write`), which is dropped.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use hashbrown::HashTable;
use redb::{
    Database, DatabaseError, Durability, ReadableDatabase, ReadableTable, TableDefinition,
    TableHandle,
};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};

use self::disk::{Disk, RealDisk, parent_dir};
use self::journal::{Change, Journal};
use super::handout::{Answer, Handout};
use super::key_hash::KeyHasher;
use super::{Claim, ClaimOptions, Store, StoreError, Transition, UnknownOutcome};
use crate::record::{
    Completion, DecodeError, FingerprintHash, Hash256, OwnerToken, Record, RecordKey,
    from_unix_millis, unix_millis,
};

mod disk;
mod journal;
#[cfg(test)]
mod sim_disk;

const BACKEND: &str = "redb";

/// Most changes committed together in one write transaction.
const MAX_BATCH: usize = 256;
/// A batch at least this large means the writer is under load: it then waits [`GATHER`]
/// before taking the next batch.
const GATHER_AFTER: usize = 16;
/// How long a loaded writer waits for more changes before starting a batch.
const GATHER: Duration = Duration::from_micros(250);
/// Changes waiting for the writer beyond which callers wait for room.
const QUEUE: usize = 4096;
/// Most expired records removed by one sweep transaction.
const SWEEP_BATCH: usize = 1000;
/// Expired records every write transaction also removes, riding on its commit.
const PIGGYBACK_SWEEP: usize = 64;
/// Longest time between two checkpoints (durable commits of the database itself) while
/// changes are being journalled.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
/// Pause between two sweeps when the writer is otherwise idle.
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// How long after a failed write the writer first tries to reopen the file.
const REOPEN_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two tries to reopen a file that keeps failing.
const REOPEN_MAX: Duration = Duration::from_secs(30);
/// Most claims of failed commits kept to be released after a reopen; past it, the claims'
/// leases govern them (see [`Writer::unsettled`]).
const MAX_UNSETTLED: usize = 4 * MAX_BATCH;
/// Page cache redb may use.
const CACHE_BYTES: usize = 64 * 1024 * 1024;

const RECORDS: TableDefinition<u64, &[u8]> = TableDefinition::new("records_by_write");
/// The journal's id ([`JOURNAL_ID`]) and the sequence number of the last journal frame whose
/// changes the database holds ([`JOURNAL_APPLIED`]), written with every checkpoint, the only
/// commits after the file is opened.
const JOURNAL_STATE: TableDefinition<&str, u64> = TableDefinition::new("journal");
const JOURNAL_ID: &str = "id";
const JOURNAL_APPLIED: &str = "applied";
/// The file's format ([`FORMAT`]), checked at every open.
const FORMAT_KEY: &str = "format";
/// The row high-water mark at the last checkpoint: no row at or past it was written yet.
const MARK_NEXT_ROW: &str = "next_row";
/// How many rows the file held at the last checkpoint.
const MARK_ROWS: &str = "rows";
/// A digest of the file's last row (its number and bytes) at the last checkpoint; 0 if none.
const MARK_LAST_ROW: &str = "last_row";
/// The file's format: 1 kept records by key, 2 rows by write with the expiry index on disk,
/// 3 rows by write beside the journal, with the marks of the last checkpoint. From 3 on, a
/// binary refuses a file in a newer format than its own.
const FORMAT: u64 = 3;
/// The second layout's expiry index on disk: expiry ++ row number. Dropped at open.
const EXPIRIES_V2: TableDefinition<&[u8; 16], ()> = TableDefinition::new("expiries_by_write");
/// The first layout: records by record key. Rewritten in the current one at open.
const RECORDS_V1: TableDefinition<&[u8; 32], &[u8]> = TableDefinition::new("records");
const EXPIRIES_V1: TableDefinition<&[u8; 40], ()> = TableDefinition::new("expiries");

/// Records in an embedded database file that survives restarts and crashes.
///
/// One process (one `RedbStore`) at a time may have a file open; opening it a second time
/// fails with an error that names the file. Clones share the open file; it is closed when
/// the last clone is dropped (the drop waits for the writer thread to finish its current
/// batch, a few milliseconds at most).
///
/// If a write ever fails (the disk is full or failing), redb refuses all further work on that
/// handle: every change answers [`StoreError::Unavailable`] until the file is reopened, which
/// lets redb repair it to its last commit. The store reopens it on its own a second after the
/// failure, so it recovers without a restart once the disk takes writes again; while the file
/// keeps failing (to reopen, or to write once reopened) the wait doubles up to 30 s, and a
/// committed write brings it back to a second.
#[derive(Clone)]
pub struct RedbStore {
    shared: Arc<Shared>,
}

struct Shared {
    /// Write transactions committed, to show that changes are grouped.
    #[cfg(test)]
    commits: Arc<std::sync::atomic::AtomicU64>,
    path: Arc<Path>,
    ops: Option<mpsc::Sender<Op>>,
    /// Where the writer leaves a committed batch's answers.
    answers: Arc<Handout<Done>>,
    writer: Option<JoinHandle<()>>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Closing the queue ends the writer; waiting for it means the file is closed (and can
        // be reopened) once the last handle is gone.
        self.ops.take();
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl fmt::Debug for RedbStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedbStore")
            .field("path", &self.shared.path)
            .finish()
    }
}

/// What went wrong in the redb backend; the source of a [`StoreError`].
#[derive(Debug, thiserror::Error)]
enum RedbError {
    #[error(
        "cannot open {}: the file is already open (in another process, or by another store in this one)",
        path.display()
    )]
    AlreadyOpen { path: PathBuf },
    #[error("cannot open {}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: redb::Error,
    },
    #[error("cannot read the journal {}", path.display())]
    Journal {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot create the directory {}", path.display())]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot sync the directory {}", path.display())]
    SyncDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the writer thread for {}", path.display())]
    Thread {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: storage error", path.display())]
    Storage {
        path: Arc<Path>,
        #[source]
        source: Arc<redb::Error>,
    },
    #[error("{}: a write failed; changes are refused until the file is reopened", path.display())]
    Poisoned {
        path: Arc<Path>,
        #[source]
        source: Arc<redb::Error>,
    },
    #[error("{}: the writer thread has stopped", path.display())]
    WriterGone { path: Arc<Path> },
    #[error(
        "cannot open {}: it is in format {found}, written by a newer idemgate; this binary reads \
         formats up to {supported}. Run the newer binary again",
        path.display()
    )]
    NewerFormat {
        path: PathBuf,
        found: u64,
        supported: u64,
    },
    #[error(
        "cannot open {}: its journal {} does not match it ({why}), so its frames were not \
         applied. The file was changed since its last checkpoint by a program that does not \
         keep the journal (an idemgate from before the journal, started after a crash): \
         applying the frames would write stale records over newer ones. To keep the file as \
         it is, losing the changes only the journal holds, move the journal away: \
         mv '{}' '{}.rejected'. A downgrade needs a clean stop first",
        path.display(),
        journal.display(),
        journal.display(),
        journal.display()
    )]
    JournalMismatch {
        path: PathBuf,
        journal: PathBuf,
        why: String,
    },
}

fn unavailable(error: RedbError) -> StoreError {
    StoreError::Unavailable {
        backend: BACKEND,
        source: Box::new(error),
    }
}

fn corrupt(source: DecodeError) -> StoreError {
    StoreError::Corrupt {
        backend: BACKEND,
        source,
    }
}

impl RedbStore {
    /// Opens the database file at `path`, creating it (and its parent directories) if
    /// needed.
    ///
    /// Blocks while redb opens the file, which includes a repair after a crash, and while the
    /// position and expiry of every record are read into memory (one pass over the records):
    /// call it at start-up, or under `spawn_blocking`. Fails if the file is already open, in
    /// another process or in this one.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open_on(Arc::new(RealDisk), path.as_ref())
    }

    /// [`RedbStore::open`] on the file system `disk`.
    fn open_on(disk: Arc<dyn Disk>, path: &Path) -> Result<Self, StoreError> {
        let clock = Clock::start();
        let (db, journal, rows) = open_file(&*disk, path, Some(clock.now()))?;

        let path: Arc<Path> = Arc::from(path);
        let (ops, queue) = mpsc::channel(QUEUE);
        #[cfg(test)]
        let commits = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let answers = Arc::new(Handout::new());
        let writer = Writer {
            #[cfg(test)]
            commits: Arc::clone(&commits),
            answers: Arc::clone(&answers),
            txn: None,
            db: Some(db),
            journal: Some(journal),
            checkpointed_at: Instant::now(),
            clock,
            disk,
            path: Arc::clone(&path),
            poisoned: None,
            reopen_wait: REOPEN_FIRST,
            batch_claims: Vec::new(),
            unsettled: Vec::new(),
            more_expired: true,
            rows,
        };
        let thread_error = |source| {
            unavailable(RedbError::Thread {
                path: path.to_path_buf(),
                source,
            })
        };
        let writer = std::thread::Builder::new()
            .name("idemgate-redb-writer".into())
            .spawn(move || writer.run(queue))
            .map_err(thread_error)?;
        let shared = Shared {
            #[cfg(test)]
            commits,
            path: Arc::clone(&path),
            ops: Some(ops.clone()),
            answers,
            writer: Some(writer),
        };
        // The ticker holds only a weak sender: it never keeps the writer alive.
        let weak = ops.downgrade();
        drop(ops);
        std::thread::Builder::new()
            .name("idemgate-redb-sweep".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(SWEEP_INTERVAL);
                    let Some(ops) = weak.upgrade() else {
                        return;
                    };
                    // A full queue means the writer is busy; its batches sweep as they go.
                    let _ = ops.try_send(Op::Sweep { reply: None });
                }
            })
            .map_err(thread_error)?;
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.shared.path
    }

    /// The database's journal: the file beside it, named after it with `-journal` added, that
    /// holds the changes made since the database was last committed durably. It belongs with
    /// the database file: a copy of one without the other may miss acknowledged changes.
    pub fn journal_path(&self) -> PathBuf {
        Journal::path_for(&self.shared.path)
    }

    /// Removes every expired record now, in bounded batches; returns how many. The writer
    /// also does this on its own, so this is for tests and operators.
    pub async fn sweep(&self) -> Result<usize, StoreError> {
        let mut total = 0;
        loop {
            let removed = self.call(|reply| Op::Sweep { reply: Some(reply) }).await?;
            total += removed;
            if removed < SWEEP_BATCH {
                return Ok(total);
            }
        }
    }

    /// Sends one change to the writer and waits for its committed answer.
    async fn call<T>(&self, op: impl FnOnce(Reply<T>) -> Op) -> Result<T, StoreError> {
        let gone = || {
            unavailable(RedbError::WriterGone {
                path: Arc::clone(&self.shared.path),
            })
        };
        let ops = self.shared.ops.as_ref().ok_or_else(gone)?;
        let (reply, answer) = oneshot::channel();
        ops.send(op(reply)).await.map_err(|_| gone())?;
        self.shared.answers.wait(answer).await.map_err(|_| gone())?
    }
}

/// Opens (or creates) the file and its journal, and their folder, each new entry made durable
/// in its directory; repairs the file if it was not closed cleanly; creates the table, so
/// reads never find it missing; brings a file in an older layout over; and reads where each
/// record's row is and when it expires. With `leases_from`, a process starting up: every
/// record in flight is given a whole lease from then (see [`Clock`]).
fn open_file(
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

/// Opens (or creates) the database file, repairing it if it was not closed cleanly.
fn open_database(disk: &dyn Disk, path: &Path) -> Result<Database, StoreError> {
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
fn attach(
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
    record_checkpoint(&txn, journal.last(), next_row).map_err(&open_error)?;
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
/// [`Writer::open_read_view`]): opened anew, brought up to date as [`attach`] does, in a
/// write transaction that is never committed.
fn read_view(
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
fn open_error(path: &Path) -> impl Fn(redb::Error) -> StoreError + '_ {
    move |source| {
        unavailable(RedbError::Open {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// A file brought up to date in a write transaction not yet committed.
struct Prepared {
    txn: redb::WriteTransaction,
    journal: Journal,
    /// How many journal frames were applied.
    frames: usize,
    /// The number the next row written will have.
    next_row: u64,
    migrated: Option<Migrated>,
}

/// Brings `db` up to date in a write transaction it leaves uncommitted: checks the format,
/// migrates an older layout, applies the journal's frames past the last checkpoint to a file
/// that is as that checkpoint left it (each frame must fit it), and with `leases_from` gives
/// every record in flight a whole lease from then.
fn prepare(
    disk: &dyn Disk,
    db: &Database,
    path: &Path,
    leases_from: Option<u64>,
) -> Result<Prepared, StoreError> {
    let open_error = open_error(path);
    let txn = db.begin_write().map_err(|e| open_error(e.into()))?;
    let format = txn
        .open_table(JOURNAL_STATE)
        .and_then(|state| Ok(state.get(FORMAT_KEY)?.map(|v| v.value())))
        .map_err(|e| open_error(e.into()))?;
    if let Some(found) = format.filter(|&found| found > FORMAT) {
        return Err(unavailable(RedbError::NewerFormat {
            path: path.to_path_buf(),
            found,
            supported: FORMAT,
        }));
    }
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
            let renewed = lease_from(&mut records, now).map_err(&open_error)?;
            if renewed > 0 {
                tracing::info!(
                    renewed,
                    "redb records found in flight at open lapse a whole lease from now"
                );
            }
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

/// What the last checkpoint recorded of the file, to tell at open whether anything else
/// wrote to it since: the journal's frames apply only to the file as that checkpoint left it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mark {
    /// The row high-water mark: the number the next row written would have had.
    next_row: u64,
    rows: u64,
    /// A digest of the last row's number and bytes (0 for an empty table).
    last_row: u64,
}

impl Mark {
    /// The file's mark now, with the high-water mark `next_row` (at least past its last row).
    fn of(
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
fn lease_from(
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
fn next_row_of(records: &impl ReadableTable<u64, &'static [u8]>) -> Result<u64, redb::Error> {
    Ok(records
        .last()?
        .map_or(0, |(row, _)| row.value().saturating_add(1)))
}

/// Records in `txn` a checkpoint: the database holds the changes of journal frames up to
/// `seq`, and rows are numbered from `next_row` on. The file's mark is taken from `txn`'s
/// table, so it is the state this commit leaves.
fn record_checkpoint(
    txn: &redb::WriteTransaction,
    seq: u64,
    next_row: u64,
) -> Result<(), redb::Error> {
    let mark = Mark::of(&txn.open_table(RECORDS)?, next_row)?;
    let mut state = txn.open_table(JOURNAL_STATE)?;
    state.insert(FORMAT_KEY, FORMAT)?;
    state.insert(JOURNAL_APPLIED, seq)?;
    state.insert(MARK_NEXT_ROW, mark.next_row)?;
    state.insert(MARK_ROWS, mark.rows)?;
    state.insert(MARK_LAST_ROW, mark.last_row)?;
    Ok(())
}

/// The file's journal id, the last journal frame whose changes it holds, and its mark at the
/// last checkpoint.
struct FileState {
    id: u64,
    applied: u64,
    /// `None` for a file no checkpoint of this version has committed yet.
    mark: Option<Mark>,
}

/// The file's state, with a journal id made (in `txn`) for a file that has none yet.
fn file_state(txn: &redb::WriteTransaction) -> Result<FileState, redb::Error> {
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

// -------------------------------------------------------------------------------------------
// Record encoding.

const VERSION: u8 = 1;
const TAG_IN_FLIGHT: u8 = 1;
const TAG_COMPLETED: u8 = 2;
const TAG_AMBIGUOUS: u8 = 3;
/// Version, tag, fingerprint, expiry.
const HEADER_LEN: usize = 1 + 1 + 32 + 8;
/// An in-flight record as first written: the header, the owner token and the lease deadline.
/// Since then the lease's length follows (older binaries read the record without it).
const IN_FLIGHT_LEN_V1: usize = HEADER_LEN + 16 + 8;

/// A stored record without its completion bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    fingerprint: FingerprintHash,
    expires: u64,
    state: StateHeader,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StateHeader {
    InFlight {
        token: OwnerToken,
        lease_deadline: u64,
        /// The lease's length in milliseconds, so a record found in flight at open can be
        /// given a whole lease from then on; 0 in rows written before it was kept.
        lease: u64,
    },
    Completed {
        stored_at: u64,
    },
    Ambiguous {
        since: u64,
    },
}

fn read_u64(bytes: &[u8], at: usize) -> Result<u64, DecodeError> {
    bytes
        .get(at..at + 8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_be_bytes)
        .ok_or(DecodeError("truncated record"))
}

impl Header {
    /// Parses a stored value; for a completed record also returns the completion bytes.
    fn parse(value: &[u8]) -> Result<(Self, &[u8]), DecodeError> {
        if value.len() < HEADER_LEN {
            return Err(DecodeError("truncated record"));
        }
        if value[0] != VERSION {
            return Err(DecodeError("unknown record version"));
        }
        let mut fingerprint = [0u8; 32];
        fingerprint.copy_from_slice(&value[2..34]);
        let expires = read_u64(value, 34)?;
        let (state, rest) = match value[1] {
            TAG_IN_FLIGHT => {
                let token = value
                    .get(HEADER_LEN..HEADER_LEN + 16)
                    .and_then(|b| b.try_into().ok())
                    .map(u128::from_be_bytes)
                    .ok_or(DecodeError("truncated record"))?;
                let lease_deadline = read_u64(value, HEADER_LEN + 16)?;
                let lease = match value.len() {
                    IN_FLIGHT_LEN_V1 => 0,
                    _ => read_u64(value, IN_FLIGHT_LEN_V1)?,
                };
                (
                    StateHeader::InFlight {
                        token: OwnerToken(token),
                        lease_deadline,
                        lease,
                    },
                    &[][..],
                )
            }
            TAG_COMPLETED => (
                StateHeader::Completed {
                    stored_at: read_u64(value, HEADER_LEN)?,
                },
                &value[HEADER_LEN + 8..],
            ),
            TAG_AMBIGUOUS => (
                StateHeader::Ambiguous {
                    since: read_u64(value, HEADER_LEN)?,
                },
                &[][..],
            ),
            _ => return Err(DecodeError("unknown record state")),
        };
        Ok((
            Header {
                fingerprint: Hash256(fingerprint),
                expires,
                state,
            },
            rest,
        ))
    }

    /// Appends the encoded record to `out`, with `completion` after the header of a completed
    /// one.
    fn encode_into(&self, out: &mut Vec<u8>, completion: &[u8]) {
        let tag = match self.state {
            StateHeader::InFlight { .. } => TAG_IN_FLIGHT,
            StateHeader::Completed { .. } => TAG_COMPLETED,
            StateHeader::Ambiguous { .. } => TAG_AMBIGUOUS,
        };
        out.push(VERSION);
        out.push(tag);
        out.extend_from_slice(&self.fingerprint.0);
        out.extend_from_slice(&self.expires.to_be_bytes());
        match self.state {
            StateHeader::InFlight {
                token,
                lease_deadline,
                lease,
            } => {
                out.extend_from_slice(&token.0.to_be_bytes());
                out.extend_from_slice(&lease_deadline.to_be_bytes());
                out.extend_from_slice(&lease.to_be_bytes());
            }
            StateHeader::Completed { stored_at } => {
                out.extend_from_slice(&stored_at.to_be_bytes());
                out.extend_from_slice(completion);
            }
            StateHeader::Ambiguous { since } => out.extend_from_slice(&since.to_be_bytes()),
        }
    }

    fn is_live(&self, now: u64) -> bool {
        self.expires > now
    }

    fn owned_by(&self, token: OwnerToken, now: u64) -> bool {
        self.is_live(now)
            && matches!(self.state, StateHeader::InFlight { token: t, .. } if t == token)
    }

    fn to_record(self, completion: &[u8]) -> Result<Record, StoreError> {
        let fingerprint = self.fingerprint;
        Ok(match self.state {
            StateHeader::InFlight { lease_deadline, .. } => Record::InFlight {
                fingerprint,
                lease_deadline: from_unix_millis(lease_deadline),
            },
            StateHeader::Completed { stored_at } => Record::Completed {
                fingerprint,
                completion: decode_completion(completion)?,
                stored_at: from_unix_millis(stored_at),
            },
            StateHeader::Ambiguous { since } => Record::Ambiguous {
                fingerprint,
                since: from_unix_millis(since),
            },
        })
    }
}

/// Decodes the completion bytes of a stored record (copied out of redb's page).
fn decode_completion(bytes: &[u8]) -> Result<Completion, StoreError> {
    super::decode_completion(BACKEND, Bytes::copy_from_slice(bytes))
}

/// When a stored row expires. A row whose record cannot be read still has its expiry read
/// from its place in the record (after the version, tag and fingerprint); a row too short to
/// hold one is due now.
fn row_expiry(row: &[u8]) -> u64 {
    match parse_row(row) {
        Ok((header, _)) => header.expires,
        Err(_) => row
            .get(32..)
            .and_then(|record| read_u64(record, 34).ok())
            .unwrap_or(0),
    }
}

/// A stored row: the record key, then the record.
fn encode_row(key: &RecordKey, header: &Header, completion: &[u8]) -> Vec<u8> {
    // Key, header, then the largest state fields (an owner token and a lease deadline).
    let mut row = Vec::with_capacity(32 + HEADER_LEN + 24 + completion.len());
    encode_row_into(&mut row, key, header, completion);
    row
}

/// Appends a row (record key, then the record) to `out`.
fn encode_row_into(out: &mut Vec<u8>, key: &RecordKey, header: &Header, completion: &[u8]) {
    out.extend_from_slice(&key.0);
    header.encode_into(out, completion);
}

/// Splits a stored row into its record key and its record.
fn split_row(row: &[u8]) -> Result<(RecordKey, &[u8]), DecodeError> {
    let (key, record) = row
        .split_first_chunk::<32>()
        .ok_or(DecodeError("truncated record"))?;
    Ok((Hash256(*key), record))
}

/// The header of a stored row's record and, for a completed one, its completion bytes.
fn parse_row(row: &[u8]) -> Result<(Header, &[u8]), DecodeError> {
    split_row(row).and_then(|(_, record)| Header::parse(record))
}

/// A record's row number and its header (or why it could not be read).
type Found = (u64, Result<Header, DecodeError>);

/// A stored row, read in place from its page.
type StoredRow<'a> = redb::AccessGuard<'a, &'static [u8]>;

/// Where each record key's row is and when each row expires, kept by the writer and read
/// from the file at open.
struct RowIndex {
    /// Each record key with its row number.
    rows: HashTable<(RecordKey, u64)>,
    hasher: KeyHasher,
    /// Every row's expiry and row number, soonest first: the sweep's order.
    expiries: BTreeSet<(u64, u64)>,
    /// The next row number to write.
    next: u64,
}

impl RowIndex {
    /// Reads the index of every row; rows written from now on are numbered from `next` on
    /// (or past the last row, if that is later).
    fn load(
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
    fn row_of(&self, key: &RecordKey) -> Option<u64> {
        let hash = self.hasher.hash(key);
        self.rows.find(hash, |(k, _)| k == key).map(|&(_, row)| row)
    }

    /// Notes that `key`'s record is now in `row`.
    fn set_row(&mut self, key: RecordKey, row: u64) {
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
    fn forget(&mut self, key: &RecordKey, only: Option<u64>) {
        let hash = self.hasher.hash(key);
        let matches = |&(k, row): &(RecordKey, u64)| k == *key && only.is_none_or(|r| r == row);
        if let Ok(entry) = self.rows.find_entry(hash, matches) {
            entry.remove();
        }
    }

    fn take_next(&mut self) -> u64 {
        let row = self.next;
        self.next += 1;
        row
    }
}

/// How many records [`migrate`] carried over, and how many it could not read.
struct Migrated {
    moved: u64,
    unreadable: u64,
}

/// Creates the table, and brings a file in an older layout over to the current one: the
/// first layout's records (by record key) are rewritten as rows, keeping every record and its
/// expiry, and the second layout's expiry index on disk is dropped (the writer keeps it in
/// memory). A file in the current layout is left as it is (`None`).
fn migrate(txn: &redb::WriteTransaction) -> Result<Option<Migrated>, redb::Error> {
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
            let key = Hash256(*key.value());
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

fn now_ms() -> u64 {
    unix_millis(SystemTime::now())
}

/// The clock the writer judges every deadline on: wall-clock milliseconds read once, when the
/// store opened, advanced from then on by the monotonic clock. A step of the wall clock
/// while the store is open (NTP, a virtual machine resumed) moves no lease or expiry; a
/// record's deadlines outlive the process in the file as wall-clock times, and in-flight
/// records found at open are given a whole lease from then on (see `attach`).
#[derive(Clone, Copy)]
struct Clock {
    wall_at_open: u64,
    opened: Instant,
}

impl Clock {
    fn start() -> Self {
        Self {
            wall_at_open: now_ms(),
            opened: Instant::now(),
        }
    }

    fn now(&self) -> u64 {
        after(self.wall_at_open, self.opened.elapsed())
    }
}

fn millis(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

fn after(now: u64, d: Duration) -> u64 {
    now.saturating_add(millis(d))
}

/// What a claim does about the record it found.
enum ClaimStep {
    /// Answer without a change.
    Answer(Claim),
    /// Answer with the stored completion.
    Replay,
    /// Write a fresh in-flight record, replacing the expired or lapsed one (with its expiry).
    Acquire { replaces: Option<u64> },
    /// Turn the lapsed in-flight record (with its fingerprint and expiry) ambiguous, then
    /// answer.
    MakeAmbiguous {
        fingerprint: FingerprintHash,
        old_expiry: u64,
        answer: Claim,
    },
}

fn decide(
    found: Option<&Header>,
    fingerprint: &FingerprintHash,
    options: &ClaimOptions,
    now: u64,
) -> ClaimStep {
    let Some(found) = found else {
        return ClaimStep::Acquire { replaces: None };
    };
    if !found.is_live(now) {
        return ClaimStep::Acquire {
            replaces: Some(found.expires),
        };
    }
    let same = found.fingerprint == *fingerprint;
    match found.state {
        StateHeader::InFlight { lease_deadline, .. } if lease_deadline > now => {
            ClaimStep::Answer(if same {
                Claim::InFlight {
                    lease_remaining: Duration::from_millis(lease_deadline - now),
                }
            } else {
                Claim::Mismatch
            })
        }
        StateHeader::InFlight { .. } => match options.on_lapse {
            UnknownOutcome::Retry => ClaimStep::Acquire {
                replaces: Some(found.expires),
            },
            UnknownOutcome::Ambiguous => ClaimStep::MakeAmbiguous {
                fingerprint: found.fingerprint,
                old_expiry: found.expires,
                answer: if same {
                    Claim::Ambiguous
                } else {
                    Claim::Mismatch
                },
            },
        },
        _ if !same => ClaimStep::Answer(Claim::Mismatch),
        StateHeader::Completed { .. } => ClaimStep::Replay,
        StateHeader::Ambiguous { .. } => ClaimStep::Answer(Claim::Ambiguous),
    }
}

/// The records as a file that refuses writes still answers them: calls that change nothing.
struct ReadView<'a, T> {
    records: &'a T,
    rows: &'a RowIndex,
}

impl<T: ReadableTable<u64, &'static [u8]>> ReadView<'_, T> {
    /// The header and completion bytes of `key`'s record, read in place, if it has one.
    fn with_record<R>(
        &self,
        key: &RecordKey,
        f: impl FnOnce(Result<(Header, &[u8]), DecodeError>) -> R,
    ) -> Result<Option<R>, redb::Error> {
        let Some(row) = self.rows.row_of(key) else {
            return Ok(None);
        };
        Ok(self
            .records
            .get(row)?
            .map(|value| f(parse_row(value.value()))))
    }

    /// The answer to a claim that changes nothing (a replay, a conflict); `None` for one that
    /// would write (a new or expired key, a lapsed lease) or could not be read.
    fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        options: &ClaimOptions,
        now: u64,
    ) -> Option<Result<Claim, StoreError>> {
        self.with_record(key, |parsed| {
            let (found, completion) = parsed.ok()?;
            match decide(Some(&found), fingerprint, options, now) {
                ClaimStep::Answer(claim) => Some(Ok(claim)),
                ClaimStep::Replay => {
                    Some(decode_completion(completion).map(|c| Claim::Completed(Arc::new(c))))
                }
                ClaimStep::Acquire { .. } | ClaimStep::MakeAmbiguous { .. } => None,
            }
        })
        .ok()
        .flatten()
        .flatten()
    }

    /// The live record of `key`, if there is one.
    fn get(
        &self,
        key: &RecordKey,
        now: u64,
    ) -> Result<Result<Option<Record>, StoreError>, redb::Error> {
        Ok(self
            .with_record(key, |parsed| match parsed {
                Ok((header, _)) if !header.is_live(now) => Ok(None),
                Ok((header, completion)) => header.to_record(completion).map(Some),
                Err(e) => Err(corrupt(e)),
            })?
            .unwrap_or(Ok(None)))
    }
}

// -------------------------------------------------------------------------------------------
// The writer.

type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

enum Op {
    Claim {
        key: RecordKey,
        fingerprint: FingerprintHash,
        token: OwnerToken,
        options: ClaimOptions,
        reply: Reply<Claim>,
    },
    Complete {
        key: RecordKey,
        token: OwnerToken,
        completion: Bytes,
        ttl: Duration,
        reply: Reply<Transition>,
    },
    Release {
        key: RecordKey,
        token: OwnerToken,
        reply: Reply<Transition>,
    },
    Renew {
        key: RecordKey,
        token: OwnerToken,
        lease: Duration,
        reply: Reply<Transition>,
    },
    MarkAmbiguous {
        key: RecordKey,
        token: OwnerToken,
        ttl: Duration,
        reply: Reply<Transition>,
    },
    Delete {
        key: RecordKey,
        reply: Reply<bool>,
    },
    Get {
        key: RecordKey,
        reply: Reply<Option<Record>>,
    },
    Ping {
        reply: Reply<()>,
    },
    Sweep {
        reply: Option<Reply<usize>>,
    },
}

/// Why a batch failed; every change in it answers with this.
struct Failure {
    path: Arc<Path>,
    cause: Arc<redb::Error>,
    poisoned: bool,
}

impl Failure {
    fn error(&self) -> StoreError {
        let path = Arc::clone(&self.path);
        let source = Arc::clone(&self.cause);
        unavailable(if self.poisoned {
            RedbError::Poisoned { path, source }
        } else {
            RedbError::Storage { path, source }
        })
    }
}

/// A change's answer, held until its batch is committed, then sent through the
/// [`Handout`].
type Done = Box<dyn Settle>;

/// An answer of any type, as [`Done`] holds it.
trait Settle: Send {
    /// Replaces the answer with the batch's failure.
    fn fail(&mut self, failure: &Failure);
    /// Sends the answer; `false` if the caller is gone.
    fn send(self: Box<Self>) -> bool;
}

struct Settled<T> {
    reply: Reply<T>,
    /// `None` for a change whose storage error failed the batch: its answer is the failure.
    answer: Option<Result<T, StoreError>>,
}

impl<T: Send> Settle for Settled<T> {
    fn fail(&mut self, failure: &Failure) {
        self.answer = Some(Err(failure.error()));
    }

    fn send(self: Box<Self>) -> bool {
        match self.answer {
            Some(answer) => self.reply.send(answer).is_ok(),
            None => false,
        }
    }
}

/// A change nobody waits for (the writer's own sweep).
struct Unanswered;

impl Settle for Unanswered {
    fn fail(&mut self, _: &Failure) {}

    fn send(self: Box<Self>) -> bool {
        false
    }
}

impl Answer for Done {
    fn send(self) -> bool {
        Settle::send(self)
    }
}

fn done<T: Send + 'static>(reply: Reply<T>, answer: Result<T, StoreError>) -> Done {
    Box::new(Settled {
        reply,
        answer: Some(answer),
    })
}

impl Op {
    /// Answers a change that was never applied with `failure`.
    fn fail(self, failure: &Failure) {
        let error = failure.error();
        match self {
            Op::Claim { reply, .. } => drop(reply.send(Err(error))),
            Op::Complete { reply, .. }
            | Op::Release { reply, .. }
            | Op::Renew { reply, .. }
            | Op::MarkAmbiguous { reply, .. } => drop(reply.send(Err(error))),
            Op::Delete { reply, .. } => drop(reply.send(Err(error))),
            Op::Get { reply, .. } => drop(reply.send(Err(error))),
            Op::Ping { reply } => drop(reply.send(Err(error))),
            Op::Sweep { reply } => {
                if let Some(reply) = reply {
                    drop(reply.send(Err(error)));
                }
            }
        }
    }
}

struct Writer {
    #[cfg(test)]
    commits: Arc<std::sync::atomic::AtomicU64>,
    /// Where each batch's answers go once it is committed (or failed).
    answers: Arc<Handout<Done>>,
    /// The write transaction that holds every change since the last checkpoint. Each batch
    /// is applied to it and made durable by its journal frame; only a checkpoint commits it,
    /// so a page the batches of a second change again and again is copied and written once.
    /// Every failure once it holds changes poisons the file: the reopen applies the journal.
    /// Declared before `db`, so it is dropped (aborted) before the file is closed.
    txn: Option<redb::WriteTransaction>,
    /// The open file; `None` only while [`Writer::poisoned`] is set and neither reopening it
    /// nor opening a read view of it succeeded.
    db: Option<Database>,
    /// The open file's journal; `None` while [`Writer::poisoned`] is set (a read view has
    /// none).
    journal: Option<Journal>,
    /// When the database was last committed durably.
    checkpointed_at: Instant,
    /// What every deadline is judged on.
    clock: Clock,
    /// The file system the file and its journal are on.
    disk: Arc<dyn Disk>,
    path: Arc<Path>,
    /// Set once a write failed: redb then refuses all work on its handle until the file is
    /// reopened.
    poisoned: Option<Poisoned>,
    /// How long the next failure waits before reopening: doubled by each failure (up to
    /// [`REOPEN_MAX`]), back to [`REOPEN_FIRST`] once a write commits, so a file that reopens
    /// but still cannot take writes is not reopened every second.
    reopen_wait: Duration,
    /// The claims of the batch being applied.
    batch_claims: Vec<(RecordKey, OwnerToken)>,
    /// Claims whose commit failed: they may have landed all the same (a commit can fail in
    /// its last sync), though their callers were told they failed and run nothing. They are
    /// released at the head of the next batch that can commit, as the callers' own undo
    /// (refused while the file was failing) would have done.
    unsettled: Vec<(RecordKey, OwnerToken)>,
    /// The last sweep stopped at its limit: sweep again as soon as the queue is empty.
    more_expired: bool,
    /// Where each record's row is.
    rows: RowIndex,
}

/// Whether a batch is committed durably by redb (a checkpoint) only when one is due, or now.
#[derive(Clone, Copy)]
enum Checkpoint {
    WhenDue,
    /// At close, so that the next open has no journal to apply.
    Now,
}

/// A file whose handle refuses work, and when to try reopening it.
struct Poisoned {
    cause: Arc<redb::Error>,
    retry_at: Instant,
}

struct Tables<'t> {
    records: redb::Table<'t, u64, &'static [u8]>,
    rows: &'t mut RowIndex,
    /// Where the batch's row changes are gathered for its journal frame.
    journal: &'t mut Journal,
    /// Whether anything was written, so a batch that changed nothing skips the sync.
    dirty: bool,
}

impl Writer {
    fn run(mut self, mut queue: mpsc::Receiver<Op>) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let mut last_batch = 0;
        loop {
            // A poisoned file takes no sweep: it would only fail, at once, over and over.
            if self.more_expired && self.poisoned.is_none() {
                match queue.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(mpsc::error::TryRecvError::Empty) => {
                        batch.push(Op::Sweep { reply: None });
                    }
                    Err(mpsc::error::TryRecvError::Disconnected) => break,
                }
            } else if queue.blocking_recv_many(&mut batch, MAX_BATCH) == 0 {
                break;
            }
            // Under load, the callers answered by the last commit come back with their next
            // change a moment later: waiting for them makes one commit of two.
            if last_batch >= GATHER_AFTER && batch.len() < MAX_BATCH {
                std::thread::sleep(GATHER);
            }
            while batch.len() < MAX_BATCH {
                match queue.try_recv() {
                    Ok(op) => batch.push(op),
                    Err(_) => break,
                }
            }
            last_batch = batch.len();
            self.run_batch(&mut batch);
        }
        self.checkpoint_on_close();
    }

    /// Commits the database durably at close (a batch of no changes, checkpointing whatever
    /// the journal holds), so the next open has no journal to apply.
    fn checkpoint_on_close(&mut self) {
        if self.poisoned.is_some() {
            return;
        }
        let close = Checkpoint::Now;
        let now = self.clock.now();
        if let Err((e, _)) = self.transact(&mut std::iter::empty(), &mut Vec::new(), now, close) {
            // Nothing is lost: the journal is applied at the next open.
            tracing::warn!(
                path = %self.path.display(),
                error = %e,
                "redb checkpoint at close failed"
            );
        }
    }

    /// Applies `batch` in one write transaction and answers each change once the batch is
    /// durable (or failed).
    fn run_batch(&mut self, batch: &mut Vec<Op>) {
        if !self.reopen_if_poisoned() {
            if let Some(poisoned) = &self.poisoned {
                let failure = Failure {
                    path: Arc::clone(&self.path),
                    cause: Arc::clone(&poisoned.cause),
                    poisoned: true,
                };
                self.answer_from_read_view(batch, &failure);
            }
            return;
        }
        if !self.unsettled.is_empty() {
            // Answers nobody waits for: the callers were answered when the commit failed.
            let releases = self.unsettled.iter().map(|&(key, token)| Op::Release {
                key,
                token,
                reply: oneshot::channel().0,
            });
            batch.splice(0..0, releases);
        }
        self.batch_claims.clear();
        let now = self.clock.now();
        let mut dones: Vec<Done> = Vec::with_capacity(batch.len());
        let mut ops = batch.drain(..);
        let result = self.transact(&mut ops, &mut dones, now, Checkpoint::WhenDue);
        let failure = match result {
            Ok(committed) => {
                if committed {
                    self.reopen_wait = REOPEN_FIRST;
                }
                self.unsettled.clear();
                None
            }
            Err((cause, poisoned)) => {
                if poisoned && self.unsettled.len() < MAX_UNSETTLED {
                    // The commit failed: whether its claims landed is known after a reopen.
                    self.unsettled.append(&mut self.batch_claims);
                }
                // After a failed commit or any I/O error redb refuses all work on its handle.
                let poisoned =
                    poisoned || matches!(*cause, redb::Error::Io(_) | redb::Error::PreviousIo);
                if poisoned {
                    self.poison(Arc::clone(&cause));
                }
                Some(Failure {
                    path: Arc::clone(&self.path),
                    cause,
                    poisoned,
                })
            }
        };
        if let Some(failure) = &failure {
            dones.iter_mut().for_each(|done| done.fail(failure));
        }
        self.answers.deliver(dones);
        if let Some(failure) = &failure {
            ops.for_each(|op| op.fail(failure));
        }
    }

    /// The wait before the next try to reopen; the one after it is twice as long.
    fn take_reopen_wait(&mut self) -> Duration {
        let wait = self.reopen_wait;
        self.reopen_wait = (wait * 2).min(REOPEN_MAX);
        wait
    }

    /// Marks the file as refusing work until it is reopened, after the present wait.
    fn poison(&mut self, cause: Arc<redb::Error>) {
        let wait = self.take_reopen_wait();
        tracing::error!(
            path = %self.path.display(),
            error = %cause,
            retry_in_ms = wait.as_millis() as u64,
            "redb write failed: changes are refused until the file is reopened"
        );
        self.poisoned = Some(Poisoned {
            cause,
            retry_at: Instant::now() + wait,
        });
        self.open_read_view();
    }

    /// Drops the handles of a file that failed, and the pages of both files the system
    /// caches: a failed sync leaves pages there that the disk may never have got, marked clean.
    /// Read through them, a reopened file would take a failed checkpoint for done, skip the
    /// journal frames it holds, and later commits would build on pages that are not on the
    /// disk. Dropped, every read comes from the disk, and the journal (kept whole until a
    /// checkpoint's sync succeeds) brings back what the file lacks.
    fn close_and_forget(&mut self) -> Result<(), StoreError> {
        // The failed handle holds the file's lock: closed before the file is opened again.
        self.txn = None;
        self.db = None;
        self.journal = None;
        let journal = Journal::path_for(&self.path);
        [&*self.path, &journal]
            .into_iter()
            .try_for_each(|path| self.disk.forget_cached(path))
            .map_err(|source| {
                unavailable(RedbError::Journal {
                    path: journal.clone(),
                    source,
                })
            })
    }

    /// Opens a view of the file to answer from while it takes no writes: the file as the
    /// disk holds it, with the journal's frames applied to a write transaction that is never
    /// committed. Its opening writes nothing but redb's own repair of the header. Without
    /// one, every call is refused.
    fn open_read_view(&mut self) {
        match self
            .close_and_forget()
            .and_then(|()| read_view(&*self.disk, &self.path))
        {
            Ok((db, txn, rows)) => {
                self.db = Some(db);
                self.txn = Some(txn);
                self.rows = rows;
                tracing::warn!(
                    path = %self.path.display(),
                    "redb file refuses writes: replays of completed records are answered \
                     from a read view until it is reopened"
                );
            }
            Err(e) => tracing::error!(
                path = %self.path.display(),
                error = %crate::ErrorChain(&e),
                "redb file cannot be read either: every call is refused until it is reopened"
            ),
        }
    }

    /// Answers, while the file refuses writes, each call of `batch` that changes nothing —
    /// a claim that finds a record it does not replace (a replay above all), a read — from
    /// the read view if there is one; every other call gets `failure`.
    fn answer_from_read_view(&mut self, batch: &mut Vec<Op>, failure: &Failure) {
        let now = self.clock.now();
        let records = self.txn.as_ref().map(|txn| txn.open_table(RECORDS));
        let Some(Ok(records)) = records else {
            batch.drain(..).for_each(|op| op.fail(failure));
            return;
        };
        let view = ReadView {
            records: &records,
            rows: &self.rows,
        };
        for op in batch.drain(..) {
            match op {
                Op::Claim {
                    key,
                    fingerprint,
                    options,
                    reply,
                    ..
                } => match view.claim(&key, &fingerprint, &options, now) {
                    Some(answer) => drop(reply.send(answer)),
                    None => drop(reply.send(Err(failure.error()))),
                },
                Op::Get { key, reply } => {
                    let answer = view.get(&key, now).unwrap_or_else(|_| Err(failure.error()));
                    drop(reply.send(answer));
                }
                other => other.fail(failure),
            }
        }
    }

    /// Whether the file takes changes: true unless a write failed and reopening the file
    /// (tried once the wait of [`Writer::reopen_wait`] has passed) has not yet succeeded.
    /// Reopening lets redb repair the file to its last commit, as after a crash; every change
    /// it reported as committed is kept.
    fn reopen_if_poisoned(&mut self) -> bool {
        let now = Instant::now();
        match &self.poisoned {
            None => return true,
            Some(poisoned) if now < poisoned.retry_at => return false,
            Some(_) => {}
        }
        // The records in flight are this process's own, with deadlines on its clock.
        let reopened = self
            .close_and_forget()
            .and_then(|()| open_file(&*self.disk, &self.path, None));
        match reopened {
            Ok((db, journal, rows)) => {
                self.db = Some(db);
                self.journal = Some(journal);
                self.checkpointed_at = now;
                self.rows = rows;
                self.more_expired = true;
                self.poisoned = None;
                tracing::warn!(
                    path = %self.path.display(),
                    "redb file reopened after a failed write: changes are accepted again"
                );
                true
            }
            Err(e) => {
                let wait = self.take_reopen_wait();
                if let Some(poisoned) = &mut self.poisoned {
                    poisoned.retry_at = now + wait;
                }
                tracing::error!(
                    path = %self.path.display(),
                    error = %crate::ErrorChain(&e),
                    retry_in_ms = wait.as_millis() as u64,
                    "redb file could not be reopened"
                );
                self.open_read_view();
                false
            }
        }
    }

    /// Applies one batch to the open write transaction and makes it durable: by its journal
    /// frame, or by committing the transaction when a checkpoint is due. `Ok(true)` if the
    /// batch changed anything (or checkpointed). The error's flag says whether the file is
    /// poisoned: every failure once the transaction holds changes is, since those changes can
    /// come back only from the journal, at the reopen.
    fn transact(
        &mut self,
        ops: &mut impl Iterator<Item = Op>,
        dones: &mut Vec<Done>,
        now: u64,
        checkpoint: Checkpoint,
    ) -> Result<bool, (Arc<redb::Error>, bool)> {
        let lost = |e: redb::Error| (Arc::new(e), true);
        let (Some(db), Some(journal)) = (&self.db, &mut self.journal) else {
            return Err((Arc::new(redb::Error::PreviousIo), true));
        };
        let mut txn = match self.txn.take() {
            Some(txn) => txn,
            // Nothing is held yet, so nothing is lost if no transaction can be had.
            None => db.begin_write().map_err(|e| (Arc::new(e.into()), false))?,
        };
        let (dirty, swept_all) = {
            let mut tables = Tables {
                records: txn.open_table(RECORDS).map_err(|e| lost(e.into()))?,
                rows: &mut self.rows,
                journal,
                dirty: false,
            };
            let mut swept_all = true;
            for op in ops.by_ref() {
                if let Op::Claim { key, token, .. } = &op {
                    self.batch_claims.push((*key, *token));
                }
                let (done, error) = tables.apply(op, now, &mut swept_all);
                dones.push(done);
                if let Some(e) = error {
                    return Err(lost(e));
                }
            }
            if tables.dirty {
                let removed = tables.sweep(now, PIGGYBACK_SWEEP).map_err(lost)?;
                swept_all &= removed < PIGGYBACK_SWEEP;
            }
            (tables.dirty, swept_all)
        };
        self.more_expired = !swept_all;
        let checkpoint_due = matches!(checkpoint, Checkpoint::Now)
            || self.checkpointed_at.elapsed() >= CHECKPOINT_EVERY;
        // The transaction holds changes exactly when the journal has frames. A batch that
        // changed nothing commits only to checkpoint frames a second old: the idle writer's
        // sweep ticks do that, so no change lives in the journal alone for long.
        let idle_checkpoint = checkpoint_due && journal.has_frames();
        if !dirty && !idle_checkpoint {
            self.txn = Some(txn);
            return Ok(false);
        }
        #[cfg(test)]
        self.commits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if checkpoint_due || journal.size_with_pending() > journal::CHECKPOINT_AT {
            tracing::trace!(changes = dones.len(), "redb group commit, checkpoint");
            // The commit holds every frame written so far, and this batch, which has none.
            record_checkpoint(&txn, journal.last(), self.rows.next).map_err(lost)?;
            txn.set_durability(Durability::Immediate)
                .map_err(|e| lost(e.into()))?;
            txn.commit().map_err(|e| lost(e.into()))?;
            journal.checkpointed();
            self.checkpointed_at = Instant::now();
        } else {
            tracing::trace!(changes = dones.len(), "redb group commit, journalled");
            journal.append().map_err(|e| lost(redb::Error::Io(e)))?;
            self.txn = Some(txn);
        }
        Ok(true)
    }
}

impl Tables<'_> {
    /// Applies one change; returns how to answer it and the storage error that aborts the
    /// batch, if any.
    fn apply(&mut self, op: Op, now: u64, swept_all: &mut bool) -> (Done, Option<redb::Error>) {
        fn split<T: Send + 'static>(
            reply: Reply<T>,
            result: Result<Result<T, StoreError>, redb::Error>,
        ) -> (Done, Option<redb::Error>) {
            match result {
                Ok(answer) => (done(reply, answer), None),
                // Answered with the batch's failure, which this error causes.
                Err(e) => (
                    Box::new(Settled {
                        reply,
                        answer: None,
                    }),
                    Some(e),
                ),
            }
        }
        match op {
            Op::Claim {
                key,
                fingerprint,
                token,
                options,
                reply,
            } => split(reply, self.claim(&key, &fingerprint, token, &options, now)),
            Op::Complete {
                key,
                token,
                completion,
                ttl,
                reply,
            } => split(
                reply,
                self.transition(&key, token, now, |header| {
                    header.state = StateHeader::Completed { stored_at: now };
                    header.expires = after(now, ttl);
                    Some(completion)
                }),
            ),
            Op::Release { key, token, reply } => split(reply, self.release(&key, token, now)),
            Op::Renew {
                key,
                token,
                lease,
                reply,
            } => split(
                reply,
                self.transition(&key, token, now, |header| {
                    let lease_deadline = after(now, lease);
                    header.state = StateHeader::InFlight {
                        token,
                        lease_deadline,
                        lease: millis(lease),
                    };
                    header.expires = header.expires.max(lease_deadline);
                    None
                }),
            ),
            Op::MarkAmbiguous {
                key,
                token,
                ttl,
                reply,
            } => split(
                reply,
                self.transition(&key, token, now, |header| {
                    header.state = StateHeader::Ambiguous { since: now };
                    header.expires = after(now, ttl);
                    None
                }),
            ),
            Op::Delete { key, reply } => split(reply, self.delete(&key, now).map(Ok)),
            Op::Get { key, reply } => split(reply, self.get(&key, now)),
            Op::Ping { reply } => (done(reply, Ok(())), None),
            Op::Sweep { reply } => {
                let result = self.sweep(now, SWEEP_BATCH);
                if let Ok(removed) = result {
                    *swept_all &= removed < SWEEP_BATCH;
                }
                match reply {
                    Some(reply) => split(reply, result.map(Ok)),
                    None => (Box::new(Unanswered), result.err()),
                }
            }
        }
    }

    /// The row number and stored row of `key`'s record, if it has one.
    fn stored(&self, key: &RecordKey) -> Result<Option<(u64, StoredRow<'_>)>, redb::Error> {
        let Some(row) = self.rows.row_of(key) else {
            return Ok(None);
        };
        Ok(self.records.get(row)?.map(|value| (row, value)))
    }

    /// The row number and header of `key`'s record, if it has one.
    fn header(&self, key: &RecordKey) -> Result<Option<Found>, redb::Error> {
        Ok(self
            .stored(key)?
            .map(|(row, value)| (row, parse_row(value.value()).map(|(h, _)| h))))
    }

    /// Writes `header` (and `completion`) as `key`'s record in a new row at the end of the
    /// table, removing its previous row (row number and expiry) if it had one.
    fn put(
        &mut self,
        key: &RecordKey,
        header: &Header,
        completion: &[u8],
        previous: Option<(u64, u64)>,
    ) -> Result<(), redb::Error> {
        if let Some((row, expiry)) = previous {
            self.remove_row(row, expiry)?;
        }
        let row = self.rows.take_next();
        // Encoded once, into the journal's frame, and inserted from there.
        let value = self.journal.put(row, |out| {
            encode_row_into(out, key, header, completion);
        });
        self.records.insert(row, value)?;
        self.rows.expiries.insert((header.expires, row));
        self.rows.set_row(*key, row);
        self.dirty = true;
        Ok(())
    }

    fn remove(&mut self, key: &RecordKey, row: u64, expiry: u64) -> Result<(), redb::Error> {
        self.remove_row(row, expiry)?;
        self.rows.forget(key, None);
        self.dirty = true;
        Ok(())
    }

    /// Removes a row from the table and notes it in the batch's journal frame; `None` if
    /// there was no such row, else the record key it held (`None` if undecodable).
    fn take_row(&mut self, row: u64) -> Result<Option<Option<RecordKey>>, redb::Error> {
        let Some(value) = self.records.remove(row)? else {
            return Ok(None);
        };
        let key = split_row(value.value()).ok().map(|(key, _)| key);
        drop(value);
        self.journal.remove(row);
        Ok(Some(key))
    }

    /// Removes a row and its expiry entry (the key's entry is the caller's to update).
    fn remove_row(&mut self, row: u64, expiry: u64) -> Result<(), redb::Error> {
        self.take_row(row)?;
        self.rows.expiries.remove(&(expiry, row));
        Ok(())
    }

    /// The live record of `key`, if there is one.
    fn get(
        &self,
        key: &RecordKey,
        now: u64,
    ) -> Result<Result<Option<Record>, StoreError>, redb::Error> {
        let view = ReadView {
            records: &self.records,
            rows: self.rows,
        };
        view.get(key, now)
    }

    fn claim(
        &mut self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        token: OwnerToken,
        options: &ClaimOptions,
        now: u64,
    ) -> Result<Result<Claim, StoreError>, redb::Error> {
        // One read: a replay decodes the completion from it; a write drops it first.
        let value = self.stored(key)?;
        let row = value.as_ref().map(|(row, _)| *row);
        let (found, completion) = match value.as_ref().map(|(_, v)| parse_row(v.value())) {
            None => (None, &[][..]),
            Some(Ok((header, completion))) => (Some(header), completion),
            Some(Err(e)) => return Ok(Err(corrupt(e))),
        };
        let previous = |expiry: u64| row.map(|row| (row, expiry));
        Ok(Ok(
            match decide(found.as_ref(), fingerprint, options, now) {
                ClaimStep::Answer(claim) => claim,
                ClaimStep::Replay => match decode_completion(completion) {
                    Ok(c) => Claim::Completed(Arc::new(c)),
                    Err(e) => return Ok(Err(e)),
                },
                ClaimStep::Acquire { replaces } => {
                    drop(value);
                    let header = Header {
                        fingerprint: *fingerprint,
                        expires: after(now, options.ttl),
                        state: StateHeader::InFlight {
                            token,
                            lease_deadline: after(now, options.lease),
                            lease: millis(options.lease),
                        },
                    };
                    self.put(key, &header, &[], replaces.and_then(previous))?;
                    Claim::Acquired(token)
                }
                ClaimStep::MakeAmbiguous {
                    fingerprint,
                    old_expiry,
                    answer,
                } => {
                    drop(value);
                    let header = Header {
                        fingerprint,
                        expires: after(now, options.ttl),
                        state: StateHeader::Ambiguous { since: now },
                    };
                    self.put(key, &header, &[], previous(old_expiry))?;
                    answer
                }
            },
        ))
    }

    /// Changes `key`'s record with `change` if it is in flight under `token`; `change` may
    /// return the completion bytes of a completed record.
    fn transition(
        &mut self,
        key: &RecordKey,
        token: OwnerToken,
        now: u64,
        change: impl FnOnce(&mut Header) -> Option<Bytes>,
    ) -> Result<Result<Transition, StoreError>, redb::Error> {
        let (row, mut header) = match self.header(key)? {
            Some((row, Ok(h))) if h.owned_by(token, now) => (row, h),
            Some((_, Ok(_))) | None => return Ok(Ok(Transition::Fenced)),
            Some((_, Err(e))) => return Ok(Err(corrupt(e))),
        };
        let old_expiry = header.expires;
        let completion = change(&mut header).unwrap_or_default();
        self.put(key, &header, &completion, Some((row, old_expiry)))?;
        Ok(Ok(Transition::Applied))
    }

    fn release(
        &mut self,
        key: &RecordKey,
        token: OwnerToken,
        now: u64,
    ) -> Result<Result<Transition, StoreError>, redb::Error> {
        match self.header(key)? {
            Some((row, Ok(h))) if h.owned_by(token, now) => {
                self.remove(key, row, h.expires)?;
                Ok(Ok(Transition::Applied))
            }
            Some((_, Ok(_))) | None => Ok(Ok(Transition::Fenced)),
            Some((_, Err(e))) => Ok(Err(corrupt(e))),
        }
    }

    /// Removes whatever is under `key`, even an undecodable record (an operator's way out);
    /// returns whether a live one was there.
    fn delete(&mut self, key: &RecordKey, now: u64) -> Result<bool, redb::Error> {
        let found = self.header(key)?;
        let Some((row, found)) = found else {
            return Ok(false);
        };
        match found {
            Ok(h) => {
                self.remove(key, row, h.expires)?;
                Ok(h.is_live(now))
            }
            Err(_) => {
                // Through the journal like every removal, or a crash brings the row back. Its
                // expiry entry finds no row when it comes due.
                self.take_row(row)?;
                self.rows.forget(key, None);
                self.dirty = true;
                Ok(true)
            }
        }
    }

    /// Removes up to `limit` records that expired by `now`, oldest first.
    fn sweep(&mut self, now: u64, limit: usize) -> Result<usize, redb::Error> {
        let mut removed = 0;
        while removed < limit {
            let Some(&(expiry, row)) = self.rows.expiries.first() else {
                break;
            };
            if expiry > now {
                break;
            }
            self.rows.expiries.pop_first();
            removed += 1;
            // The index moves with every write, so a due entry is the row's own expiry. An
            // undecodable row is removed when due too.
            if let Some(Some(key)) = self.take_row(row)? {
                self.rows.forget(&key, Some(row));
            }
        }
        if removed > 0 {
            self.dirty = true;
        }
        Ok(removed)
    }
}

// -------------------------------------------------------------------------------------------

#[async_trait]
impl Store for RedbStore {
    async fn claim(
        &self,
        key: &RecordKey,
        fingerprint: &FingerprintHash,
        token: OwnerToken,
        options: &ClaimOptions,
    ) -> Result<Claim, StoreError> {
        // Every claim goes to the writer, which answers one that changes nothing (a replay, a
        // conflict) without a commit: a batch with no change is aborted, not synced. Reading
        // first on another thread would cost a new key two thread hand-offs instead of one.
        self.call(|reply| Op::Claim {
            key: *key,
            fingerprint: *fingerprint,
            token,
            options: *options,
            reply,
        })
        .await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        completion: Completion,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        let completion = completion.encode();
        self.call(|reply| Op::Complete {
            key: *key,
            token,
            completion,
            ttl,
            reply,
        })
        .await
    }

    async fn release(&self, key: &RecordKey, token: OwnerToken) -> Result<Transition, StoreError> {
        self.call(|reply| Op::Release {
            key: *key,
            token,
            reply,
        })
        .await
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        lease: Duration,
    ) -> Result<Transition, StoreError> {
        self.call(|reply| Op::Renew {
            key: *key,
            token,
            lease,
            reply,
        })
        .await
    }

    async fn mark_ambiguous(
        &self,
        key: &RecordKey,
        token: OwnerToken,
        ttl: Duration,
    ) -> Result<Transition, StoreError> {
        self.call(|reply| Op::MarkAmbiguous {
            key: *key,
            token,
            ttl,
            reply,
        })
        .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.call(|reply| Op::Get { key: *key, reply }).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.call(|reply| Op::Delete { key: *key, reply }).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.call(|reply| Op::Ping { reply }).await
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }
}

#[cfg(test)]
mod tests {
    use redb::ReadableTableMetadata;

    use super::*;

    impl Header {
        /// The encoded record alone, without a row's record key.
        fn encode(&self, completion: &[u8]) -> Vec<u8> {
            let mut out = Vec::new();
            self.encode_into(&mut out, completion);
            out
        }
    }

    fn headers() -> Vec<Header> {
        let fingerprint = Hash256::of(b"fp");
        vec![
            Header {
                fingerprint,
                expires: 123_456_789,
                state: StateHeader::InFlight {
                    token: OwnerToken(u128::MAX - 5),
                    lease_deadline: 99,
                    lease: 30_000,
                },
            },
            Header {
                fingerprint,
                expires: u64::MAX,
                state: StateHeader::Completed { stored_at: 7 },
            },
            Header {
                fingerprint,
                expires: 0,
                state: StateHeader::Ambiguous { since: 42 },
            },
        ]
    }

    #[test]
    fn record_headers_round_trip() {
        for header in headers() {
            let encoded = header.encode(b"completion bytes");
            let (decoded, rest) = Header::parse(&encoded).unwrap();
            assert_eq!(decoded, header);
            let expected: &[u8] = match header.state {
                StateHeader::Completed { .. } => b"completion bytes",
                _ => b"",
            };
            assert_eq!(rest, expected);
        }
    }

    #[test]
    fn truncated_or_foreign_records_are_errors_not_panics() {
        for header in headers() {
            let encoded = header.encode(b"");
            for cut in 0..encoded.len() {
                let parsed = Header::parse(&encoded[..cut]);
                if let StateHeader::InFlight {
                    token,
                    lease_deadline,
                    ..
                } = header.state
                    && cut == IN_FLIGHT_LEN_V1
                {
                    // An in-flight record as first written, before the lease length was kept.
                    let legacy = StateHeader::InFlight {
                        token,
                        lease_deadline,
                        lease: 0,
                    };
                    assert!(
                        matches!(parsed, Ok((h, _)) if h.state == legacy),
                        "{parsed:?}"
                    );
                    continue;
                }
                assert!(parsed.is_err(), "cut at {cut}");
            }
            let mut newer = encoded.clone();
            newer[0] = VERSION + 1;
            assert!(Header::parse(&newer).is_err());
            let mut unknown = encoded;
            unknown[1] = 9;
            assert!(Header::parse(&unknown).is_err());
        }
    }

    /// Opens a file as a store starting up does.
    fn open_fresh(path: &Path) -> Result<(Database, Journal, RowIndex), StoreError> {
        open_file(&RealDisk, path, Some(now_ms()))
    }

    /// Removes a test's database file and its journal.
    fn remove_files(path: &Path) {
        let _ = std::fs::remove_file(path);
        let _ = std::fs::remove_file(Journal::path_for(path));
    }

    /// A fresh file path in the tests' directory, which is made if missing (some tests open
    /// the file directly, without the store, which would make it).
    pub(super) fn temp_path(label: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join("idemgate-tests");
        std::fs::create_dir_all(&dir).expect("the tests' directory can be made");
        dir.join(format!(
            "unit-{label}-{}-{}.redb",
            std::process::id(),
            OwnerToken::generate().0
        ))
    }

    /// A file whose `sync_data` fails while `fail` is set: every write before it lands in the
    /// page cache, so the commit it fails may be in the file all the same.
    #[derive(Debug)]
    struct FailingSync {
        file: redb::backends::FileBackend,
        fail: Arc<std::sync::atomic::AtomicBool>,
    }

    impl redb::StorageBackend for FailingSync {
        fn len(&self) -> std::io::Result<u64> {
            self.file.len()
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            self.file.read(offset, out)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.file.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(std::io::Error::other("injected sync failure"));
            }
            self.file.sync_data()
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.file.write(offset, data)
        }
    }

    /// A writer over an opened file, as [`RedbStore::open`] starts it, except that it reopens
    /// a failed file at its next batch and does not sweep.
    fn test_writer(path: &Path, (db, journal, rows): (Database, Journal, RowIndex)) -> Writer {
        Writer {
            commits: Arc::default(),
            answers: Arc::new(Handout::new()),
            txn: None,
            db: Some(db),
            journal: Some(journal),
            checkpointed_at: Instant::now(),
            clock: Clock::start(),
            disk: Arc::new(RealDisk),
            path: Arc::from(path),
            poisoned: None,
            reopen_wait: Duration::ZERO,
            batch_claims: Vec::new(),
            unsettled: Vec::new(),
            more_expired: false,
            rows,
        }
    }

    /// A claim of `key` by `token` with a long lease and ttl, given its reply sender.
    fn claim_op(key: RecordKey, token: OwnerToken) -> impl FnOnce(Reply<Claim>) -> Op {
        move |reply| Op::Claim {
            key,
            fingerprint: Hash256::of(b"fp"),
            token,
            options: ClaimOptions {
                lease: Duration::from_secs(600),
                ttl: Duration::from_secs(600),
                on_lapse: UnknownOutcome::Ambiguous,
            },
            reply,
        }
    }

    /// Runs `op` (given its reply sender) as a batch of its own and returns its answer.
    fn run_one<T>(writer: &mut Writer, op: impl FnOnce(Reply<T>) -> Op) -> Result<T, StoreError> {
        let (reply, mut answer) = oneshot::channel();
        writer.run_batch(&mut vec![op(reply)]);
        answer.try_recv().expect("answered when its batch ran")
    }

    /// A claim whose commit failed in its last sync was answered as failed, so its caller
    /// runs nothing; if it landed all the same, the writer releases it after reopening the
    /// file, and the client's retry can claim the key instead of meeting a record nobody runs.
    #[test]
    fn a_claim_whose_commit_failed_is_released_after_the_reopen() {
        let path = temp_path("unsettled");
        drop(open_fresh(&path).unwrap());
        let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let db = Database::builder()
            .create_with_backend(FailingSync {
                file: redb::backends::FileBackend::new(file).unwrap(),
                fail: Arc::clone(&fail),
            })
            .unwrap();
        let mut writer = test_writer(&path, attach(&RealDisk, db, &path, Some(now_ms())).unwrap());
        // A checkpoint is due: the batch is committed, and so synced, by redb itself.
        writer.checkpointed_at = Instant::now() - CHECKPOINT_EVERY;
        let key = Hash256::of(b"k");
        let claim = |token| claim_op(key, token);

        fail.store(true, std::sync::atomic::Ordering::SeqCst);
        let first = run_one(&mut writer, claim(OwnerToken::generate()));
        assert!(
            matches!(first, Err(StoreError::Unavailable { .. })),
            "{first:?}"
        );
        assert!(writer.poisoned.is_some());
        fail.store(false, std::sync::atomic::Ordering::SeqCst);

        let retry = OwnerToken::generate();
        let second = run_one(&mut writer, claim(retry));
        assert!(writer.poisoned.is_none(), "reopened");
        assert!(
            matches!(second, Ok(Claim::Acquired(t)) if t == retry),
            "{second:?}"
        );
        assert!(writer.unsettled.is_empty());
        drop(writer);
        remove_files(&path);
    }

    /// A journal frame that cannot be written fails its batch like a failed commit: its
    /// callers are told, the file refuses changes until it is reopened, and the reopened file
    /// journals again.
    #[test]
    fn a_journal_write_that_fails_poisons_the_file_until_it_is_reopened() {
        let path = temp_path("journal-fails");
        // No checkpoint due: the batch goes to the journal.
        let mut writer = test_writer(&path, open_fresh(&path).unwrap());
        let claim = claim_op;
        let key = Hash256::of(b"k");

        writer.journal.as_mut().unwrap().fail_writes().unwrap();
        let first = run_one(&mut writer, claim(key, OwnerToken::generate()));
        assert!(
            matches!(first, Err(StoreError::Unavailable { .. })),
            "{first:?}"
        );
        assert!(writer.poisoned.is_some());

        let retry = OwnerToken::generate();
        let second = run_one(&mut writer, claim(key, retry));
        assert!(writer.poisoned.is_none(), "reopened");
        assert!(
            matches!(second, Ok(Claim::Acquired(t)) if t == retry),
            "{second:?}"
        );
        let journalled = writer.journal.as_ref().unwrap().last();
        let other = run_one(
            &mut writer,
            claim(Hash256::of(b"other"), OwnerToken::generate()),
        );
        assert!(matches!(other, Ok(Claim::Acquired(_))), "{other:?}");
        assert_eq!(writer.journal.as_ref().unwrap().last(), journalled + 1);
        drop(writer);
        remove_files(&path);
    }

    /// A batch whose frame could not be written was answered as failed, and it is not
    /// applied: the reopen brings back, from the journal, every batch acknowledged since the
    /// last checkpoint (which redb itself never committed) and nothing of the failed one.
    #[test]
    fn a_batch_whose_frame_failed_is_not_applied_and_those_before_it_are() {
        let path = temp_path("frame-failed");
        let mut writer = test_writer(&path, open_fresh(&path).unwrap());
        let key = Hash256::of(b"k");
        let token = OwnerToken::generate();
        let claimed = run_one(&mut writer, claim_op(key, token));
        assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
        assert!(writer.txn.is_some(), "journalled, not committed");

        writer.journal.as_mut().unwrap().fail_writes().unwrap();
        // The claim's batch set the wait before a reopen back to a second.
        writer.reopen_wait = Duration::ZERO;
        let released = run_one(&mut writer, |reply| Op::Release { key, token, reply });
        assert!(
            matches!(released, Err(StoreError::Unavailable { .. })),
            "{released:?}"
        );
        let found = run_one(&mut writer, |reply| Op::Get { key, reply });
        assert!(writer.poisoned.is_none(), "reopened");
        assert!(
            matches!(found, Ok(Some(Record::InFlight { .. }))),
            "{found:?}"
        );
        // Still the claim's own: its owner renews it.
        let lease = Duration::from_secs(600);
        let renewed = run_one(&mut writer, |reply| Op::Renew {
            key,
            token,
            lease,
            reply,
        });
        assert!(matches!(renewed, Ok(Transition::Applied)), "{renewed:?}");
        drop(writer);
        remove_files(&path);
    }

    /// An operator's delete of a record that cannot be read is journalled like any other
    /// change: after a crash before the next checkpoint, the record stays deleted.
    #[test]
    fn deleting_an_undecodable_record_survives_a_crash() {
        let path = temp_path("delete-undecodable");
        let key = Hash256::of(b"broken");
        {
            let (db, _, _) = open_fresh(&path).unwrap();
            let header = Header {
                fingerprint: Hash256::of(b"fp"),
                expires: now_ms() + 600_000,
                state: StateHeader::Ambiguous { since: 1 },
            };
            let mut row = encode_row(&key, &header, &[]);
            row[32 + 1] = 9; // an unknown state: the record cannot be read
            let txn = db.begin_write().unwrap();
            txn.open_table(RECORDS)
                .unwrap()
                .insert(0, row.as_slice())
                .unwrap();
            txn.commit().unwrap();
        }
        let mut writer = test_writer(&path, open_fresh(&path).unwrap());
        let found = run_one(&mut writer, |reply| Op::Get { key, reply });
        assert!(
            matches!(found, Err(StoreError::Corrupt { .. })),
            "{found:?}"
        );
        let deleted = run_one(&mut writer, |reply| Op::Delete { key, reply });
        assert!(matches!(deleted, Ok(true)), "{deleted:?}");
        assert!(writer.txn.is_some(), "journalled, not committed");
        // A crash: the writer goes without its closing checkpoint.
        drop(writer);

        let mut writer = test_writer(&path, open_fresh(&path).unwrap());
        let found = run_one(&mut writer, |reply| Op::Get { key, reply });
        assert!(
            matches!(found, Ok(None)),
            "the deleted record came back: {found:?}"
        );
        drop(writer);
        remove_files(&path);
    }

    /// A binary from before the journal, started after a crash, does not apply the journal
    /// and writes rows of its own; the frames it left behind must not be applied over those
    /// rows at the next upgrade. The file's marks show another writer changed it: the open
    /// fails, naming the journal, and applies nothing.
    #[test]
    fn a_journal_is_not_applied_over_rows_an_older_binary_wrote() {
        let path = temp_path("downgrade");
        let key = Hash256::of(b"charge");
        let mut writer = test_writer(&path, open_fresh(&path).unwrap());
        let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
        assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
        assert!(writer.txn.is_some(), "journalled, not committed");
        drop(writer); // a crash

        // The older binary: it knows rows but not the journal, so it does not see the claim,
        // runs the request again and keeps its response, in the row after its last one.
        let completed = Header {
            fingerprint: Hash256::of(b"fp"),
            expires: now_ms() + 600_000,
            state: StateHeader::Completed {
                stored_at: now_ms(),
            },
        };
        {
            let db = Database::open(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut records = txn.open_table(RECORDS).unwrap();
                let next = next_row_of(&records).unwrap();
                let row = encode_row(&key, &completed, &charge().encode());
                records.insert(next, row.as_slice()).unwrap();
            }
            txn.commit().unwrap();
        }

        let error = open_fresh(&path).err().expect("the open is refused");
        let message = crate::ErrorChain(&error).to_string();
        let journal = Journal::path_for(&path);
        assert!(
            message.contains(&format!("journal {} does not match", journal.display())),
            "{message}"
        );
        // Nothing was applied: the older binary's response is still the record.
        let db = Database::open(&path).unwrap();
        let txn = db.begin_read().unwrap();
        let records = txn.open_table(RECORDS).unwrap();
        assert_eq!(records.len().unwrap(), 1);
        {
            let (_, value) = records.last().unwrap().unwrap();
            let (header, _) = parse_row(value.value()).unwrap();
            assert!(matches!(header.state, StateHeader::Completed { .. }));
        }
        drop((records, txn, db));

        // The operator moves the journal away: the file opens as the older binary left it.
        std::fs::rename(&journal, journal.with_extension("rejected")).unwrap();
        let mut writer = test_writer(&path, open_fresh(&path).unwrap());
        let found = run_one(&mut writer, |reply| Op::Get { key, reply });
        assert!(
            matches!(found, Ok(Some(Record::Completed { .. }))),
            "{found:?}"
        );
        drop(writer);
        let _ = std::fs::remove_file(journal.with_extension("rejected"));
        remove_files(&path);
    }

    /// A frame that does not fit the file (a row it puts is already there) is refused even
    /// where the marks cannot tell, as in a file no checkpoint of this version wrote.
    #[test]
    fn a_frame_that_does_not_fit_the_file_is_refused() {
        let path = temp_path("frame-misfit");
        let key = Hash256::of(b"k");
        let mut writer = test_writer(&path, open_fresh(&path).unwrap());
        let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
        assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
        drop(writer);
        {
            let db = Database::open(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut state = txn.open_table(JOURNAL_STATE).unwrap();
                for mark in [MARK_NEXT_ROW, MARK_ROWS, MARK_LAST_ROW] {
                    state.remove(mark).unwrap();
                }
                let header = Header {
                    fingerprint: Hash256::of(b"fp"),
                    expires: now_ms() + 600_000,
                    state: StateHeader::Ambiguous { since: 1 },
                };
                let row = encode_row(&Hash256::of(b"other"), &header, &[]);
                txn.open_table(RECORDS)
                    .unwrap()
                    .insert(0, row.as_slice())
                    .unwrap();
            }
            txn.commit().unwrap();
        }
        let error = open_fresh(&path).err().expect("the open is refused");
        let message = crate::ErrorChain(&error).to_string();
        assert!(message.contains("frame 1 changes row 0"), "{message}");
        remove_files(&path);
    }

    /// A file in a newer format than this binary's is refused with both versions named.
    #[test]
    fn a_file_in_a_newer_format_is_refused() {
        let path = temp_path("newer-format");
        drop(open_fresh(&path).unwrap());
        {
            let db = Database::open(&path).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(JOURNAL_STATE)
                .unwrap()
                .insert(FORMAT_KEY, FORMAT + 1)
                .unwrap();
            txn.commit().unwrap();
        }
        let error = open_fresh(&path).err().expect("the open is refused");
        let message = error.to_string() + &crate::ErrorChain(&error).to_string();
        assert!(message.contains(&path.display().to_string()), "{message}");
        assert!(
            message.contains(&format!("format {}", FORMAT + 1))
                && message.contains(&format!("up to {FORMAT}")),
            "{message}"
        );
        remove_files(&path);
    }

    /// A record found in flight at open lapses a whole lease after the open, whatever
    /// deadline the file holds: the clock that wrote it may not agree with this one (a wall
    /// clock stepped between the two), and its request may still be running upstream.
    #[test]
    fn a_record_in_flight_at_open_lapses_a_whole_lease_later() {
        let path = temp_path("lease-at-open");
        let key = Hash256::of(b"running");
        {
            let (db, _, _) = open_fresh(&path).unwrap();
            let header = Header {
                fingerprint: Hash256::of(b"fp"),
                expires: now_ms() + 600_000,
                state: StateHeader::InFlight {
                    token: OwnerToken(7),
                    // Lapsed by this clock: written by a clock two minutes behind it.
                    lease_deadline: now_ms() - 110_000,
                    lease: 60_000,
                },
            };
            let txn = db.begin_write().unwrap();
            let row = encode_row(&key, &header, &[]);
            txn.open_table(RECORDS)
                .unwrap()
                .insert(0, row.as_slice())
                .unwrap();
            txn.commit().unwrap();
        }
        let mut writer = test_writer(&path, open_fresh(&path).unwrap());
        let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
        match claimed {
            Ok(Claim::InFlight { lease_remaining }) => assert!(
                lease_remaining > Duration::from_secs(55),
                "{lease_remaining:?}"
            ),
            other => panic!("the record lapsed at open: {other:?}"),
        }
        // Its owner still owns it.
        let lease = Duration::from_secs(60);
        let renewed = run_one(&mut writer, |reply| Op::Renew {
            key,
            token: OwnerToken(7),
            lease,
            reply,
        });
        assert!(matches!(renewed, Ok(Transition::Applied)), "{renewed:?}");
        drop(writer);
        remove_files(&path);
    }

    /// A writer over the store's file at `path` on the simulated disk, opened as at start-up.
    fn writer_on(disk: &sim_disk::SimDisk, path: &Path) -> Writer {
        let opened = open_file(disk, path, Some(now_ms())).expect("the file opens");
        let mut writer = test_writer(path, opened);
        writer.disk = Arc::new(disk.clone());
        writer
    }

    /// Asserts that each of `keys` is held in flight.
    fn assert_in_flight(writer: &mut Writer, keys: &[RecordKey]) {
        for &key in keys {
            let found = run_one(writer, |reply| Op::Get { key, reply });
            assert!(
                matches!(found, Ok(Some(Record::InFlight { .. }))),
                "{key:?}: {found:?}"
            );
        }
    }

    /// A checkpoint whose sync fails leaves pages in the cache that the disk never got,
    /// marked clean. The store reopens the file with the cache dropped and applies the journal,
    /// which kept every frame since the last good checkpoint; what it acknowledged before and
    /// after the failure survives a power cut, and the file opens.
    #[test]
    fn a_failed_checkpoint_sync_loses_nothing_at_a_power_cut() {
        let disk = sim_disk::SimDisk::default();
        let path = PathBuf::from("/sim/data/records.redb");
        let mut writer = writer_on(&disk, &path);
        let mut acknowledged = Vec::new();
        for name in ["a", "b", "c"] {
            let key = Hash256::of(name.as_bytes());
            let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
            assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
            acknowledged.push(key);
        }

        // The next batch is a checkpoint, and the database's sync fails.
        writer.checkpointed_at = Instant::now() - CHECKPOINT_EVERY;
        disk.fail_next_sync(&path);
        // The claims' batches set the wait before a reopen back to a second.
        writer.reopen_wait = Duration::ZERO;
        let failed = run_one(
            &mut writer,
            claim_op(Hash256::of(b"x"), OwnerToken::generate()),
        );
        assert!(
            matches!(failed, Err(StoreError::Unavailable { .. })),
            "{failed:?}"
        );
        assert!(writer.poisoned.is_some());

        // The writer reopens the file and takes changes again: more acknowledged claims, on
        // both sides of the checkpoint its reopen makes.
        for name in ["d", "e"] {
            let key = Hash256::of(name.as_bytes());
            let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
            assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
            assert!(writer.poisoned.is_none(), "reopened");
            acknowledged.push(key);
        }
        assert_in_flight(&mut writer, &acknowledged);

        disk.power_cut();
        drop(writer);
        let mut writer = writer_on(&disk, &path);
        assert_in_flight(&mut writer, &acknowledged);
    }

    /// A journal frame whose sync fails is not acknowledged, and no later frame is written over
    /// the frames before it: after the reopen and a power cut, every acknowledged change is
    /// there.
    #[test]
    fn a_failed_journal_sync_loses_nothing_at_a_power_cut() {
        let disk = sim_disk::SimDisk::default();
        let path = PathBuf::from("/sim/journal-fails/records.redb");
        let journal = Journal::path_for(&path);
        let mut writer = writer_on(&disk, &path);
        let mut acknowledged = Vec::new();
        for name in ["a", "b"] {
            let key = Hash256::of(name.as_bytes());
            let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
            assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
            acknowledged.push(key);
        }
        disk.fail_next_sync(&journal);
        writer.reopen_wait = Duration::ZERO;
        let failed = run_one(
            &mut writer,
            claim_op(Hash256::of(b"x"), OwnerToken::generate()),
        );
        assert!(
            matches!(failed, Err(StoreError::Unavailable { .. })),
            "{failed:?}"
        );
        for name in ["c", "d"] {
            let key = Hash256::of(name.as_bytes());
            let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
            assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
            acknowledged.push(key);
        }
        disk.power_cut();
        drop(writer);
        let mut writer = writer_on(&disk, &path);
        assert_in_flight(&mut writer, &acknowledged);
    }

    /// The database file, its journal and the folder made for them are entries in their
    /// directories: a change acknowledged right after the store was created survives a power
    /// cut only if those directories were synced.
    #[test]
    fn a_new_store_survives_a_power_cut() {
        let disk = sim_disk::SimDisk::default();
        let path = PathBuf::from("/sim/new/folder/records.redb");
        let mut writer = writer_on(&disk, &path);
        let key = Hash256::of(b"first");
        let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
        assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
        disk.power_cut();
        drop(writer);
        let mut writer = writer_on(&disk, &path);
        assert_in_flight(&mut writer, &[key]);
    }

    /// Frames left in the journal by a writer that then goes idle are checkpointed by the
    /// next batch once a checkpoint is due, even one that changes nothing (a sweep tick).
    #[test]
    fn an_idle_writer_checkpoints_its_journal() {
        let path = temp_path("idle-checkpoint");
        let mut writer = test_writer(&path, open_fresh(&path).unwrap());
        let claimed = run_one(
            &mut writer,
            claim_op(Hash256::of(b"k"), OwnerToken::generate()),
        );
        assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
        let journal = writer.journal.as_ref().unwrap();
        assert!(journal.has_frames());
        let last = journal.last();
        // The claim is durable in the journal and held by the open transaction; the file's
        // committed state does not have it yet.
        let committed_rows = |writer: &Writer| {
            let txn = writer.db.as_ref().unwrap().begin_read().unwrap();
            txn.open_table(RECORDS).unwrap().len().unwrap()
        };
        assert_eq!(committed_rows(&writer), 0);

        // Not yet due: a sweep that removes nothing leaves the journal as it is.
        let sweep = |reply| Op::Sweep { reply: Some(reply) };
        assert_eq!(run_one(&mut writer, sweep).unwrap(), 0);
        assert!(writer.journal.as_ref().unwrap().has_frames());

        writer.checkpointed_at = Instant::now() - CHECKPOINT_EVERY;
        assert_eq!(run_one(&mut writer, sweep).unwrap(), 0);
        assert!(!writer.journal.as_ref().unwrap().has_frames());
        assert_eq!(committed_rows(&writer), 1);
        let db = writer.db.as_ref().unwrap();
        let txn = db.begin_read().unwrap();
        let state = txn.open_table(JOURNAL_STATE).unwrap();
        let applied = state.get(JOURNAL_APPLIED).unwrap().map(|v| v.value());
        assert_eq!(applied, Some(last));
        drop((state, txn));
        drop(writer);
        remove_files(&path);
    }

    /// A batch's answers reach their callers through one of them (see `Handout`): callers
    /// that gave up before their answer came (their store timeout) are passed over, and the
    /// others are all answered. (A caller reached and then dropped is the handout's own test.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_that_give_up_leave_no_answer_waiting() {
        let path = temp_path("give-up");
        let store = RedbStore::open(&path).unwrap();
        remove_files(&path);
        let options = ClaimOptions {
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(60),
            on_lapse: UnknownOutcome::Ambiguous,
        };
        for round in 0..20u32 {
            let calls: Vec<_> = (0..64u32)
                .map(|i| {
                    let store = store.clone();
                    tokio::spawn(async move {
                        let key = Hash256::of(&[round.to_be_bytes(), i.to_be_bytes()].concat());
                        let fp = Hash256::of(b"fp");
                        let claim = store.claim(&key, &fp, OwnerToken::generate(), &options);
                        if i % 3 == 0 {
                            // Gives up at once or part-way, whether or not it was answered.
                            let wait = Duration::from_micros(u64::from(i * 37 % 400));
                            let _ = tokio::time::timeout(wait, claim).await;
                            None
                        } else {
                            Some(claim.await)
                        }
                    })
                })
                .collect();
            for call in calls {
                let answer = tokio::time::timeout(Duration::from_secs(10), call)
                    .await
                    .expect("every caller that waits is answered")
                    .unwrap();
                if let Some(claim) = answer {
                    assert!(matches!(claim, Ok(Claim::Acquired(_))), "{claim:?}");
                }
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_changes_share_commits() {
        let path = temp_path("group-commit");
        let store = RedbStore::open(&path).unwrap();
        remove_files(&path);
        let fp = Hash256::of(b"fp");
        let options = ClaimOptions {
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(60),
            on_lapse: UnknownOutcome::Ambiguous,
        };
        let mut owned = Vec::new();
        for i in 0..256u32 {
            let key = Hash256::of(&i.to_be_bytes());
            match store
                .claim(&key, &fp, OwnerToken::generate(), &options)
                .await
                .unwrap()
            {
                Claim::Acquired(token) => owned.push((key, token)),
                other => panic!("{other:?}"),
            }
        }
        let before = store
            .shared
            .commits
            .load(std::sync::atomic::Ordering::Relaxed);
        let renewals: Vec<_> = owned
            .into_iter()
            .map(|(key, token)| {
                let store = store.clone();
                tokio::spawn(async move { store.renew(&key, token, Duration::from_secs(90)).await })
            })
            .collect();
        for renewal in renewals {
            assert_eq!(renewal.await.unwrap().unwrap(), Transition::Applied);
        }
        let commits = store
            .shared
            .commits
            .load(std::sync::atomic::Ordering::Relaxed)
            - before;
        // 256 queued changes in batches of up to MAX_BATCH: far fewer commits than changes.
        assert!(
            commits < 128,
            "{commits} commits for 256 concurrent renewals"
        );
        assert!(commits >= 1);
    }

    #[tokio::test]
    async fn changes_that_change_nothing_do_not_commit() {
        let path = temp_path("no-commit");
        let store = RedbStore::open(&path).unwrap();
        remove_files(&path);
        let before = store
            .shared
            .commits
            .load(std::sync::atomic::Ordering::Relaxed);
        let key = Hash256::of(b"missing");
        assert_eq!(
            store.release(&key, OwnerToken::generate()).await.unwrap(),
            Transition::Fenced
        );
        store.ping().await.unwrap();
        assert!(!store.delete(&key).await.unwrap());
        let after = store
            .shared
            .commits
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(after, before, "fenced calls and pings synced the disk");
    }

    /// A response to store: `201 {"charge":1}`.
    fn charge() -> Completion {
        Completion::Response(crate::record::StoredResponse {
            status: http::StatusCode::CREATED,
            headers: http::HeaderMap::new(),
            body: Bytes::from_static(b"{\"charge\":1}"),
        })
    }

    /// A minute's lease and ttl.
    fn minute() -> ClaimOptions {
        ClaimOptions {
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(60),
            on_lapse: UnknownOutcome::Ambiguous,
        }
    }

    async fn assert_replays(
        store: &RedbStore,
        key: &RecordKey,
        fp: &FingerprintHash,
        completion: &Completion,
    ) {
        match store
            .claim(key, fp, OwnerToken::generate(), &minute())
            .await
            .unwrap()
        {
            Claim::Completed(c) => assert_eq!(*c, *completion),
            other => panic!("{other:?}"),
        }
    }

    fn table_names(txn: &redb::ReadTransaction) -> Vec<String> {
        txn.list_tables()
            .unwrap()
            .map(|t| t.name().to_owned())
            .collect()
    }

    #[tokio::test]
    async fn a_file_in_the_first_layout_is_rewritten_with_its_records() {
        let path = temp_path("migrate");
        let fp = Hash256::of(b"fp");
        let (done, running, expired) = (
            Hash256::of(b"done"),
            Hash256::of(b"running"),
            Hash256::of(b"gone"),
        );
        let completion = charge();
        let now = now_ms();
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut records = txn.open_table(RECORDS_V1).unwrap();
                let mut expiries = txn.open_table(EXPIRIES_V1).unwrap();
                let rows = [
                    (
                        done,
                        now + 60_000,
                        StateHeader::Completed { stored_at: now },
                    ),
                    (
                        running,
                        now + 60_000,
                        StateHeader::InFlight {
                            token: OwnerToken(7),
                            lease_deadline: now + 60_000,
                            lease: 0,
                        },
                    ),
                    (expired, now - 1, StateHeader::Ambiguous { since: now - 10 }),
                ];
                for (key, expires, state) in rows {
                    let header = Header {
                        fingerprint: fp,
                        expires,
                        state,
                    };
                    let bytes = match state {
                        StateHeader::Completed { .. } => completion.encode(),
                        _ => Bytes::new(),
                    };
                    records
                        .insert(&key.0, header.encode(&bytes).as_slice())
                        .unwrap();
                    let mut index = [0u8; 40];
                    index[..8].copy_from_slice(&expires.to_be_bytes());
                    index[8..].copy_from_slice(&key.0);
                    expiries.insert(&index, ()).unwrap();
                }
            }
            txn.commit().unwrap();
        }
        let store = RedbStore::open(&path).unwrap();
        let options = minute();
        assert_replays(&store, &done, &fp, &completion).await;
        assert!(matches!(
            store
                .claim(&running, &fp, OwnerToken::generate(), &options)
                .await
                .unwrap(),
            Claim::InFlight { .. }
        ));
        assert_eq!(
            store
                .renew(&running, OwnerToken(7), Duration::from_secs(60))
                .await
                .unwrap(),
            Transition::Applied
        );
        assert!(store.get(&expired).await.unwrap().is_none());
        // The expired record goes with the writer's own sweeps, or with this one.
        store.sweep().await.unwrap();
        drop(store);
        let db = Database::open(&path).unwrap();
        let txn = db.begin_read().unwrap();
        assert_eq!(table_names(&txn), [JOURNAL_STATE.name(), RECORDS.name()]);
        assert_eq!(txn.open_table(RECORDS).unwrap().len().unwrap(), 2);
        drop(txn);
        drop(db);
        remove_files(&path);
    }

    /// The second layout kept the expiry index on disk beside the rows. At open it is dropped
    /// and rebuilt in memory from the rows: live records replay, expired ones are swept, and
    /// an undecodable one is kept until the expiry its row still holds.
    #[tokio::test]
    async fn a_file_with_the_expiry_index_on_disk_drops_it_and_keeps_its_records() {
        let path = temp_path("migrate-v2");
        let fp = Hash256::of(b"fp");
        let (done, expired, broken) = (
            Hash256::of(b"done"),
            Hash256::of(b"gone"),
            Hash256::of(b"broken"),
        );
        let completion = charge();
        let now = now_ms();
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut records = txn.open_table(RECORDS).unwrap();
                let mut expiries = txn.open_table(EXPIRIES_V2).unwrap();
                let completed = |expires| Header {
                    fingerprint: fp,
                    expires,
                    state: StateHeader::Completed { stored_at: now },
                };
                let mut unknown_state = encode_row(&broken, &completed(now + 60_000), &[]);
                unknown_state[32 + 1] = 9;
                let rows = [
                    (
                        now + 60_000,
                        encode_row(&done, &completed(now + 60_000), &completion.encode()),
                    ),
                    (now - 1, encode_row(&expired, &completed(now - 1), &[])),
                    (now + 60_000, unknown_state),
                ];
                for (row, (expires, bytes)) in (0u64..).zip(rows) {
                    records.insert(row, bytes.as_slice()).unwrap();
                    let mut index = [0u8; 16];
                    index[..8].copy_from_slice(&expires.to_be_bytes());
                    index[8..].copy_from_slice(&row.to_be_bytes());
                    expiries.insert(&index, ()).unwrap();
                }
            }
            txn.commit().unwrap();
        }
        let store = RedbStore::open(&path).unwrap();
        assert_replays(&store, &done, &fp, &completion).await;
        // The writer sweeps on its own too: whatever this one finds, nothing expired is left.
        store.sweep().await.unwrap();
        assert_eq!(store.sweep().await.unwrap(), 0);
        drop(store);
        let db = Database::open(&path).unwrap();
        let txn = db.begin_read().unwrap();
        assert_eq!(table_names(&txn), [JOURNAL_STATE.name(), RECORDS.name()]);
        let records = txn.open_table(RECORDS).unwrap();
        let left: Vec<u64> = records
            .iter()
            .unwrap()
            .map(|entry| entry.unwrap().0.value())
            .collect();
        assert_eq!(
            left,
            [0, 2],
            "the live records are kept, the expired one swept"
        );
        drop(records);
        drop(txn);
        drop(db);
        remove_files(&path);
    }

    #[test]
    fn a_rows_expiry_is_read_even_when_its_record_is_not() {
        let key = Hash256::of(b"k");
        let header = Header {
            fingerprint: Hash256::of(b"fp"),
            expires: 1234,
            state: StateHeader::Ambiguous { since: 1 },
        };
        let row = encode_row(&key, &header, &[]);
        assert_eq!(row_expiry(&row), 1234);
        let mut newer = row.clone();
        newer[32] = VERSION + 1;
        assert!(parse_row(&newer).is_err());
        assert_eq!(row_expiry(&newer), 1234);
        // Too short to hold an expiry: due now.
        assert_eq!(row_expiry(&row[..32 + 20]), 0);
        assert_eq!(row_expiry(&[]), 0);
    }
}

#[cfg(test)]
mod proptests {
    use proptest::prelude::*;

    use super::*;
    use crate::record::proptests::{apply, config, mutation};

    fn header() -> impl Strategy<Value = Header> {
        let state = prop_oneof![
            (any::<u128>(), any::<u64>(), any::<u64>()).prop_map(
                |(token, lease_deadline, lease)| {
                    StateHeader::InFlight {
                        token: OwnerToken(token),
                        lease_deadline,
                        lease,
                    }
                }
            ),
            any::<u64>().prop_map(|stored_at| StateHeader::Completed { stored_at }),
            any::<u64>().prop_map(|since| StateHeader::Ambiguous { since }),
        ];
        (any::<[u8; 32]>(), any::<u64>(), state).prop_map(|(fingerprint, expires, state)| Header {
            fingerprint: Hash256(fingerprint),
            expires,
            state,
        })
    }

    proptest! {
        #![proptest_config(config())]

        /// decode(encode(x)) = x for a stored row: key, header and completion bytes.
        #[test]
        fn a_row_parses_back_to_what_was_encoded(
            key in any::<[u8; 32]>(),
            header in header(),
            completion in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let completion = match header.state {
                StateHeader::Completed { .. } => completion,
                _ => Vec::new(),
            };
            let row = encode_row(&Hash256(key), &header, &completion);
            let (parsed_key, record) = split_row(&row).unwrap();
            prop_assert_eq!(parsed_key, Hash256(key));
            let (parsed, rest) = Header::parse(record).unwrap();
            prop_assert_eq!(parsed, header);
            prop_assert_eq!(rest, &completion[..]);
            prop_assert_eq!(row_expiry(&row), header.expires);
        }

        /// Damaged rows and arbitrary bytes never panic the row's decoders.
        #[test]
        fn damaged_rows_never_panic(
            key in any::<[u8; 32]>(),
            header in header(),
            mutations in proptest::collection::vec(mutation(), 0..4),
            arbitrary in proptest::collection::vec(any::<u8>(), 0..128),
        ) {
            let mut row = encode_row(&Hash256(key), &header, b"completion");
            for m in &mutations {
                apply(&mut row, m);
            }
            for bytes in [&row[..], &arbitrary[..]] {
                let _ = parse_row(bytes);
                let _ = row_expiry(bytes);
                let _ = Header::parse(bytes);
            }
        }
    }
}
