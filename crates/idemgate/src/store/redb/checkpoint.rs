//! Checkpoints off the request path: the database's durable commit runs on a thread of its own
//! while the writer keeps taking batches.
//!
//! A durable commit writes and syncs every page the batches since the last one changed, 5 to
//! 12 ms on the benchmark's disk; a writer that waited for it held every call queued behind it
//! that long. So a checkpoint is two commits. The writer commits its open transaction without a
//! sync (redb keeps its pages in memory, readable at once), with the checkpoint's marks, and
//! hands the sync to the file's sync thread (one for as long as the file is open): a durable
//! commit of an empty transaction makes that state durable. Meanwhile the writer reads the
//! table as the checkpoint leaves it, keeps the rows its batches change in an [`Overlay`]
//! above it, and journals each batch as ever (to the journal's other file, see
//! [`journal`](super::journal)), so an answer is durable and exactly what it would have been.
//! Once the sync returns, the overlay is written to the next write transaction and dropped; if
//! it failed, the file is refused and reopened like any failed write, and the reopen applies
//! both journal files.
//!
//! If a checkpoint takes so long that the overlay passes [`OVERLAY_MAX`], the writer waits for
//! it before taking the next batch: callers then wait for room in the queue, and memory stays
//! bounded.

use std::io;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Instant;

use redb::{Database, Durability, ReadableDatabase};

use super::codec::RECORDS;
use super::open::{FORMAT, record_checkpoint};
use super::overlay::{Overlay, RecordsView};
use super::writer::Writer;

/// Most memory the rows changed during one checkpoint may hold before the writer waits for it.
pub(super) const OVERLAY_MAX: usize = 16 * 1024 * 1024;

/// A checkpoint whose durable commit has not been seen to finish.
pub(super) struct RunningCheckpoint {
    commit: DurableCommit,
    /// The records as the checkpoint commits them: what batches read under the overlay.
    pub(super) base: RecordsView,
    /// The rows changed since the checkpoint began.
    pub(super) overlay: Overlay,
}

/// The thread that runs a file's durable commits, one at a time, started at its first
/// checkpoint and ended when the file is closed (its sender dropped, then joined).
pub(super) struct SyncThread {
    requests: Option<mpsc::Sender<SyncRequest>>,
    thread: Option<JoinHandle<()>>,
}

/// A file to commit durably, and where the result goes.
type SyncRequest = (Arc<Database>, mpsc::SyncSender<Result<(), redb::Error>>);

impl SyncThread {
    /// Starts a thread that runs `commit` for each request.
    pub(super) fn start(commit: fn(&Database) -> Result<(), redb::Error>) -> io::Result<Self> {
        let (requests, queue) = mpsc::channel::<SyncRequest>();
        let thread = std::thread::Builder::new()
            .name("idemgate-redb-checkpoint".into())
            .spawn(move || {
                for (db, reply) in queue {
                    let result = commit(&db);
                    // Not held between checkpoints, so the file closes with the writer's handle.
                    drop(db);
                    let _ = reply.send(result);
                }
            })?;
        Ok(Self {
            requests: Some(requests),
            thread: Some(thread),
        })
    }

    /// Hands the durable commit of `db` to the thread.
    fn request(&self, db: Arc<Database>) -> DurableCommit {
        let (reply, result) = mpsc::sync_channel(1);
        let sent = self
            .requests
            .as_ref()
            .map(|requests| requests.send((db, reply)));
        match sent {
            Some(Ok(())) => DurableCommit::Sent(result),
            _ => DurableCommit::Done(Err(sync_thread_gone())),
        }
    }
}

impl Drop for SyncThread {
    /// Without its sender the thread's loop ends; it holds no file while idle.
    fn drop(&mut self) {
        self.requests = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The error of a durable commit whose thread is gone (it panicked).
fn sync_thread_gone() -> redb::Error {
    redb::Error::Io(io::Error::other(
        "the checkpoint thread ended without syncing",
    ))
}

/// The checkpoint's durable commit: on the sync thread, or done already where no thread could
/// be started.
enum DurableCommit {
    /// Handed to the sync thread, whose result comes on this channel.
    Sent(mpsc::Receiver<Result<(), redb::Error>>),
    Done(Result<(), redb::Error>),
}

impl DurableCommit {
    /// Whether the commit has ended, without waiting for it.
    fn is_finished(&mut self) -> bool {
        let DurableCommit::Sent(result) = self else {
            return true;
        };
        let result = match result.try_recv() {
            Ok(result) => result,
            Err(mpsc::TryRecvError::Empty) => return false,
            Err(mpsc::TryRecvError::Disconnected) => Err(sync_thread_gone()),
        };
        *self = DurableCommit::Done(result);
        true
    }

    fn join(self) -> Result<(), redb::Error> {
        match self {
            DurableCommit::Sent(result) => {
                result.recv().unwrap_or_else(|_| Err(sync_thread_gone()))
            }
            DurableCommit::Done(result) => result,
        }
    }
}

/// Makes every commit before it durable: an empty transaction, committed durably.
fn commit_durably(db: &Database) -> Result<(), redb::Error> {
    let started = Instant::now();
    let mut txn = db.begin_write()?;
    txn.set_durability(Durability::Immediate)?;
    txn.commit()?;
    tracing::debug!(
        sync_us = started.elapsed().as_micros() as u64,
        "redb checkpoint: synced"
    );
    Ok(())
}

impl Writer {
    /// Begins a checkpoint of the open transaction, which holds every frame written so far:
    /// commits it at once without a sync, and starts the durable commit that syncs it. Any
    /// error poisons the file (its changes come back from the journal at the reopen).
    pub(super) fn start_checkpoint(&mut self) -> Result<(), redb::Error> {
        let (Some(db), Some(journal), Some(mut txn)) =
            (&self.db, &mut self.journal, self.txn.take())
        else {
            return Err(redb::Error::PreviousIo);
        };
        let started = Instant::now();
        #[cfg(test)]
        injected(&mut self.fail_checkpoint_start, FailStart::BeforeCommit)?;
        record_checkpoint(&txn, journal.last(), self.rows.next, FORMAT)?;
        txn.set_durability(Durability::None)?;
        txn.commit()?;
        tracing::debug!(
            commit_us = started.elapsed().as_micros() as u64,
            "redb checkpoint: the transaction committed, its sync begins"
        );
        journal.begin_checkpoint();
        #[cfg(test)]
        injected(&mut self.fail_checkpoint_start, FailStart::AfterCommit)?;
        let base = db.begin_read()?.open_table(RECORDS)?;
        let db = Arc::clone(db);
        self.running = Some(RunningCheckpoint {
            commit: self.begin_durable_commit(db),
            base,
            overlay: Overlay::new(self.rows.next),
        });
        self.checkpointed_at = Instant::now();
        Ok(())
    }

    /// Hands the durable commit of `db` to the file's sync thread, started at its first
    /// checkpoint; without one, commits here.
    fn begin_durable_commit(&mut self, db: Arc<Database>) -> DurableCommit {
        if self.sync_thread.is_none() {
            match SyncThread::start(commit_durably) {
                Ok(thread) => {
                    #[cfg(test)]
                    {
                        self.sync_threads += 1;
                    }
                    self.sync_thread = Some(thread);
                }
                Err(e) => tracing::warn!(
                    path = %self.path.display(),
                    error = %e,
                    "redb checkpoint thread could not be started: the writer waits for the sync"
                ),
            }
        }
        match &self.sync_thread {
            Some(thread) => thread.request(db),
            None => DurableCommit::Done(commit_durably(&db)),
        }
    }

    /// Ends the running checkpoint if its sync has returned, or waits for it with `wait` or
    /// once its overlay has reached [`OVERLAY_MAX`]: the overlay goes to a new write
    /// transaction, or, if the checkpoint failed, the file is poisoned.
    pub(super) fn settle_checkpoint(&mut self, wait: bool) {
        let Some(running) = &mut self.running else {
            return;
        };
        let full = running.overlay.bytes() > OVERLAY_MAX;
        if !(wait || full || running.commit.is_finished()) {
            return;
        }
        if full {
            tracing::debug!(
                path = %self.path.display(),
                "redb checkpoint slower than the changes: waiting for its sync"
            );
        }
        let Some(RunningCheckpoint {
            commit,
            base,
            overlay,
        }) = self.running.take()
        else {
            return;
        };
        let synced = commit.join();
        drop(base);
        let started = Instant::now();
        let rows = overlay.len();
        let result = synced.and_then(|()| {
            let db = self.db.as_ref().ok_or(redb::Error::PreviousIo)?;
            let txn = db.begin_write()?;
            overlay.apply_to(&mut txn.open_table(RECORDS)?)?;
            tracing::debug!(
                apply_us = started.elapsed().as_micros() as u64,
                rows,
                "redb checkpoint: the rows changed during its sync applied"
            );
            self.txn = Some(txn);
            Ok(())
        });
        if let Err(cause) = result {
            self.poison(Arc::new(cause));
        }
    }

    /// Waits for the running checkpoint, if any, and drops it with its overlay (the file is
    /// being closed).
    pub(super) fn abandon_checkpoint(&mut self) {
        if let Some(running) = self.running.take() {
            let _ = running.commit.join();
        }
    }
}

/// Where a test makes a checkpoint fail to begin: before its commit without a sync, or after
/// it (the journal has moved to its other file).
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FailStart {
    BeforeCommit,
    AfterCommit,
}

/// Fails once at `step` if the test asked for it there.
#[cfg(test)]
fn injected(hook: &mut Option<FailStart>, step: FailStart) -> Result<(), redb::Error> {
    if *hook != Some(step) {
        return Ok(());
    }
    *hook = None;
    Err(redb::Error::Io(std::io::Error::other(
        "injected checkpoint failure",
    )))
}

#[cfg(test)]
mod tests;
