//! [`RedbStore`]: records in an embedded, crash-safe database file (redb).
//!
//! Every change is durable before the call returns, so a claim is on disk before its request
//! goes upstream and an acknowledged completion survives a `kill -9`. A disk manages on the
//! order of a thousand syncs a second, so all calls go through one writer thread that takes
//! everything queued (up to [`MAX_BATCH`](writer::MAX_BATCH) calls; after a large batch it first waits [`GATHER`](writer::GATHER)
//! for the callers it just answered to come back), applies it in order in one write
//! transaction — each change still a single atomic step, later ones seeing earlier ones — and
//! makes the whole batch durable at once (group commit). A batch that changed nothing
//! (replays, conflicts, fenced calls) is not synced. Nothing blocks the async runtime, and a
//! batch's answers cost its callers' runtime one wake-up from the writer thread, not one each
//! (see [`AnswerQueue`]).
//!
//! A batch is made durable by its journal frame: the batch is applied to the writer's open
//! write transaction, which is not committed, and its row changes are appended to the journal
//! beside the file and synced (one write, where a durable redb commit writes some twenty
//! scattered pages). Every tenth of a second, or when the journal passes 16 MiB, the database
//! is checkpointed: the pages the batches since the last one changed again and again are
//! written once. The checkpoint's sync takes milliseconds and runs on a thread of its
//! own (see [`checkpoint`]): the transaction is committed without a sync, an empty durable
//! commit on that thread makes it durable, and meanwhile the writer keeps taking batches,
//! journals them to the journal's other file and holds their row changes in memory above the
//! table the checkpoint commits, which every read and decision consults; once the sync
//! returns, they go to the next write transaction. At open, the frames written since the last
//! checkpoint are applied again (see [`journal`]). A clean close ends with a checkpoint, and
//! an idle writer checkpoints its last frames at its next sweep tick once one is due, so a
//! change lives in the journal alone for a second or two at most. Any failure once the
//! transaction holds changes, and a checkpoint whose sync fails, refuses changes until the
//! file is reopened, which applies the journal.
//!
//! Deadlines are stored as wall-clock milliseconds since the Unix epoch, because the file
//! outlives the process that wrote it, but judged on the writer's [`Clock`]: the wall clock
//! read once at open, advanced by the monotonic clock. A step of the wall clock while the
//! store is open moves no lease and no expiry; a record found in flight at open lapses a whole
//! lease after the open (its lease's length is kept in the record); expiries carry over
//! across restarts on the wall clock.
//!
//! # Where things are
//!
//! | file | what |
//! | --- | --- |
//! | `redb.rs` | [`RedbStore`]: opening, the writer's queue, the [`Store`] methods |
//! | `writer.rs` | the writer thread: batches, group commit, a failed file's refusal, read view and reopening |
//! | `checkpoint.rs` | checkpoints: the durable commit on its own thread, the batches taken meanwhile |
//! | `overlay.rs` | the table a batch reads and writes: the open transaction's, or a checkpoint's under the rows changed since |
//! | `apply.rs` | one batch's calls applied to the open write transaction |
//! | `claim.rs` | what a claim does about the record it finds; the answers a read view gives |
//! | `ops.rs` | the calls the writer takes and how their answers reach the callers |
//! | `codec.rs` | a stored row: record key, then the record |
//! | `index.rs` | the in-memory index of rows and expiries |
//! | `open.rs` | opening the file: format, journal recovery and its checks, checkpoint marks |
//! | `migrate.rs` | older layouts brought over |
//! | `journal.rs` | the journal's frames, in two files used in turn |
//! | `clock.rs` | the clock deadlines are judged on |
//! | `disk.rs` | the file I/O seam (and `sim_disk.rs`, its faulty double for tests) |
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
//! newer format than its own, naming both; a running store's file is in format 4, whose
//! journal may go on in its second file, and a clean close leaves format 3, which a binary
//! reading only the first can open), the journal's id (so a journal left beside
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

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};

use self::apply::SWEEP_BATCH;
use self::clock::Clock;
use self::disk::{Disk, RealDisk};
use self::journal::Journal;
use self::open::open_file;
use self::ops::{Done, Op, Reply};
use self::writer::{QUEUE, REOPEN_FIRST, SWEEP_INTERVAL, Writer};
use super::answer_queue::AnswerQueue;
use super::{Claim, ClaimOptions, Store, StoreError, Transition};
use crate::record::{Completion, DecodeError, FingerprintHash, OwnerToken, Record, RecordKey};

mod apply;
mod checkpoint;
mod claim;
mod clock;
mod codec;
mod disk;
mod index;
mod journal;
mod migrate;
mod open;
mod ops;
mod overlay;
#[cfg(test)]
mod sim_disk;
mod writer;

const BACKEND: &str = "redb";

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
    shared: Arc<WriterHandle>,
}

/// What every clone of the store shares: the file's path and its writer thread, with the
/// queue to it and the answers it leaves. The writer stops when the last clone is dropped.
struct WriterHandle {
    /// Write transactions committed, to show that changes are grouped.
    #[cfg(test)]
    commits: Arc<std::sync::atomic::AtomicU64>,
    path: Arc<Path>,
    ops: Option<mpsc::Sender<Op>>,
    /// Where the writer leaves a committed batch's answers.
    answers: Arc<AnswerQueue<Done>>,
    writer: Option<JoinHandle<()>>,
}

impl Drop for WriterHandle {
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
    #[error("cannot drop the cached pages of {}", path.display())]
    Forget {
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
         it is, losing the changes only the journal holds, move the journal's two files \
         away: mv '{}' '{}.rejected'; mv '{}-2' '{}-2.rejected'. A downgrade needs a clean \
         stop first",
        path.display(),
        journal.display(),
        journal.display(),
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
        let answers = Arc::new(AnswerQueue::new());
        let writer = Writer {
            #[cfg(test)]
            commits: Arc::clone(&commits),
            #[cfg(test)]
            fail_checkpoint_start: None,
            #[cfg(test)]
            sync_threads: 0,
            answers: Arc::clone(&answers),
            txn: None,
            running: None,
            sync_thread: None,
            db: Some(Arc::new(db)),
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
        let shared = WriterHandle {
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
    /// holds the changes made since the database was last committed durably, with its second
    /// file (this name with `-2` added), which takes the changes made while a checkpoint
    /// syncs. They belong with the database file: a copy of it without them may miss
    /// acknowledged changes.
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
mod tests;
