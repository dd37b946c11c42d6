//! The writer thread: batches of calls applied in one write transaction (or, while a
//! checkpoint syncs, above it: see [`checkpoint`](super::checkpoint)), made durable by a
//! journal frame (group commit), and the refusal and reopening of a file whose write failed.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redb::{Database, Durability};
use tokio::sync::{mpsc, oneshot};

use super::apply::Tables;
use super::checkpoint::{RunningCheckpoint, SyncThread};
use super::claim::ReadView;
use super::clock::Clock;
use super::codec::RECORDS;
use super::disk::Disk;
use super::index::RowIndex;
use super::journal::{CHECKPOINT_AT, Journal};
use super::open::{FORMAT_SETTLED, open_file, read_view, record_checkpoint};
use super::ops::{Done, Failure, Op};
use super::overlay::Records;
use crate::record::{OwnerToken, RecordKey};
use crate::store::answer_queue::AnswerQueue;

/// Most changes committed together in one write transaction.
pub(super) const MAX_BATCH: usize = 256;
/// A batch at least this large means the writer is under load: it then waits [`GATHER`]
/// before taking the next batch.
pub(super) const GATHER_AFTER: usize = 16;
/// How long a loaded writer waits for more changes before starting a batch.
pub(super) const GATHER: Duration = Duration::from_micros(250);
/// Changes waiting for the writer beyond which callers wait for room.
pub(super) const QUEUE: usize = 4096;
/// Expired records every write transaction also removes, riding on its commit.
pub(super) const PIGGYBACK_SWEEP: usize = 64;
/// Longest time between two checkpoints (durable commits of the database itself) while
/// changes are being journalled. A checkpoint holds the writer for a commit that grows with
/// the pages changed since the last one, so short intervals keep each hold short.
pub(super) const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);
/// Pause between two sweeps when the writer is otherwise idle.
pub(super) const SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// How long after a failed write the writer first tries to reopen the file.
pub(super) const REOPEN_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two tries to reopen a file that keeps failing.
pub(super) const REOPEN_MAX: Duration = Duration::from_secs(30);
/// Most claims of failed commits kept to be released after a reopen; past it, the claims'
/// leases govern them (see [`Writer::unsettled`]).
pub(super) const MAX_UNSETTLED: usize = 4 * MAX_BATCH;

pub(super) struct Writer {
    #[cfg(test)]
    pub(super) commits: Arc<std::sync::atomic::AtomicU64>,
    /// Where a test makes the next checkpoint fail to begin.
    #[cfg(test)]
    pub(super) fail_checkpoint_start: Option<super::checkpoint::FailStart>,
    /// How many threads the checkpoints' durable commits started.
    #[cfg(test)]
    pub(super) sync_threads: usize,
    /// Where each batch's answers go once it is committed (or failed).
    pub(super) answers: Arc<AnswerQueue<Done>>,
    /// The write transaction that holds every change since the last checkpoint. Each batch
    /// is applied to it and made durable by its journal frame; only a checkpoint commits it,
    /// so a page the batches between two checkpoints change again and again is written once.
    /// Every failure once it holds changes poisons the file: the reopen applies the journal.
    /// `None` while a checkpoint runs. Declared before `db`, so it is dropped (aborted)
    /// before the file is closed.
    pub(super) txn: Option<redb::WriteTransaction>,
    /// The checkpoint whose sync is running, with the rows changed since it began; ended
    /// (waited for) before the file is closed.
    pub(super) running: Option<RunningCheckpoint>,
    /// The thread that runs the open file's durable commits; dropped (ended) with the file.
    pub(super) sync_thread: Option<SyncThread>,
    /// The open file, lent to the sync thread for each durable commit; `None` only while
    /// [`Writer::poisoned`] is set and neither reopening it nor opening a read view of it
    /// succeeded.
    pub(super) db: Option<Arc<Database>>,
    /// The open file's journal; `None` while [`Writer::poisoned`] is set (a read view has
    /// none).
    pub(super) journal: Option<Journal>,
    /// When the last checkpoint began.
    pub(super) checkpointed_at: Instant,
    /// What every deadline is judged on.
    pub(super) clock: Clock,
    /// The file system the file and its journal are on.
    pub(super) disk: Arc<dyn Disk>,
    pub(super) path: Arc<Path>,
    /// Set once a write failed: redb then refuses all work on its handle until the file is
    /// reopened.
    pub(super) poisoned: Option<Poisoned>,
    /// How long the next failure waits before reopening: doubled by each failure (up to
    /// [`REOPEN_MAX`]), back to [`REOPEN_FIRST`] once a write commits, so a file that reopens
    /// but still cannot take writes is not reopened every second.
    pub(super) reopen_wait: Duration,
    /// The claims of the batch being applied.
    pub(super) batch_claims: Vec<(RecordKey, OwnerToken)>,
    /// Claims whose commit failed: they may have landed all the same (a commit can fail in
    /// its last sync), though their callers were told they failed and run nothing. They are
    /// released at the head of the next batch that can commit, as the callers' own undo
    /// (refused while the file was failing) would have done.
    pub(super) unsettled: Vec<(RecordKey, OwnerToken)>,
    /// The last sweep stopped at its limit: sweep again as soon as the queue is empty.
    pub(super) more_expired: bool,
    /// Where each record's row is.
    pub(super) rows: RowIndex,
}

/// Whether a batch is committed durably by redb (a checkpoint) only when one is due, or now.
#[derive(Clone, Copy)]
pub(super) enum Checkpoint {
    WhenDue,
    /// At close, so that the next open has no journal to apply.
    Now,
}

/// A file whose handle refuses work, and when to try reopening it.
pub(super) struct Poisoned {
    pub(super) cause: Arc<redb::Error>,
    pub(super) retry_at: Instant,
}

impl Drop for Writer {
    /// A running checkpoint's thread holds the file: it is waited for, so the file is closed
    /// (and can be opened again) once the writer is gone.
    fn drop(&mut self) {
        self.abandon_checkpoint();
    }
}

impl Writer {
    pub(super) fn run(mut self, mut queue: mpsc::Receiver<Op>) {
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
    pub(super) fn checkpoint_on_close(&mut self) {
        self.settle_checkpoint(true);
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
    pub(super) fn run_batch(&mut self, batch: &mut Vec<Op>) {
        self.settle_checkpoint(false);
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
                // A batch kept while its checkpoint failed leaves the file poisoned: the
                // wait before the reopen goes on doubling.
                if committed && self.poisoned.is_none() {
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
    pub(super) fn take_reopen_wait(&mut self) -> Duration {
        let wait = self.reopen_wait;
        self.reopen_wait = (wait * 2).min(REOPEN_MAX);
        wait
    }

    /// Marks the file as refusing work until it is reopened, after the present wait.
    pub(super) fn poison(&mut self, cause: Arc<redb::Error>) {
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

    /// Drops the handles of a file that failed; the file's lock goes with them, so it can be
    /// opened again (which reads what the disk holds: see `open_database`).
    pub(super) fn close(&mut self) {
        self.abandon_checkpoint();
        // A new file gets a new thread, so one that panicked is not kept.
        self.sync_thread = None;
        self.txn = None;
        self.db = None;
        self.journal = None;
    }

    /// Opens a view of the file to answer from while it takes no writes: the file as the
    /// disk holds it, with the journal's frames applied to a write transaction that is never
    /// committed. Its opening writes nothing but redb's own repair of the header. Without
    /// one, every call is refused.
    pub(super) fn open_read_view(&mut self) {
        self.close();
        match read_view(&*self.disk, &self.path) {
            Ok((db, txn, rows)) => {
                self.db = Some(Arc::new(db));
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
    pub(super) fn answer_from_read_view(&mut self, batch: &mut Vec<Op>, failure: &Failure) {
        let now = self.clock.now();
        let records = self.txn.as_ref().map(|txn| txn.open_table(RECORDS));
        let Some(Ok(records)) = records else {
            batch.drain(..).for_each(|op| op.fail(failure));
            return;
        };
        let records = Records::Open(records);
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
    pub(super) fn reopen_if_poisoned(&mut self) -> bool {
        let now = Instant::now();
        match &self.poisoned {
            None => return true,
            Some(poisoned) if now < poisoned.retry_at => return false,
            Some(_) => {}
        }
        self.close();
        // The records in flight are this process's own, with deadlines on its clock.
        match open_file(&*self.disk, &self.path, None) {
            Ok((db, journal, rows)) => {
                self.db = Some(Arc::new(db));
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

    /// Applies one batch to the open write transaction (or above a running checkpoint) and
    /// makes it durable by its journal frame, then begins a checkpoint if one is due; with
    /// [`Checkpoint::Now`], commits it durably instead. `Ok(true)` if the batch changed
    /// anything (or checkpointed); a checkpoint that failed to begin after it poisons the file
    /// but leaves the batch's answers as they are. The error's flag says whether the file is
    /// poisoned: every failure once the transaction holds changes is, since those changes can
    /// come back only from the journal, at the reopen.
    pub(super) fn transact(
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
        if self.running.is_none() && self.txn.is_none() {
            // Nothing is held yet, so nothing is lost if no transaction can be had.
            let txn = db.begin_write().map_err(|e| (Arc::new(e.into()), false))?;
            self.txn = Some(txn);
        }
        let records = match (&mut self.running, &self.txn) {
            (Some(running), _) => Records::Overlaid {
                base: &running.base,
                overlay: &mut running.overlay,
            },
            (None, Some(txn)) => {
                Records::Open(txn.open_table(RECORDS).map_err(|e| lost(e.into()))?)
            }
            (None, None) => return Err(lost(redb::Error::PreviousIo)),
        };
        let mut tables = Tables {
            records,
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
        let dirty = tables.dirty;
        drop(tables);
        self.more_expired = !swept_all;
        self.make_durable(dirty, dones.len(), checkpoint)
            .map_err(lost)
    }

    /// Makes the batch just applied durable, and checkpoints when one is due.
    fn make_durable(
        &mut self,
        dirty: bool,
        changes: usize,
        checkpoint: Checkpoint,
    ) -> Result<bool, redb::Error> {
        let Some(journal) = &mut self.journal else {
            return Err(redb::Error::PreviousIo);
        };
        // One checkpoint runs at a time; its frames' file is the journal's only free one.
        let can_start = self.running.is_none();
        let close = matches!(checkpoint, Checkpoint::Now);
        let checkpoint_due =
            can_start && (close || self.checkpointed_at.elapsed() >= CHECKPOINT_EVERY);
        // The transaction holds changes exactly when the journal has frames. A batch that
        // changed nothing commits only to checkpoint frames a second old: the idle writer's
        // sweep ticks do that, so no change lives in the journal alone for long. The close
        // always commits, so the file it leaves records the older format.
        let idle_checkpoint = checkpoint_due && (close || journal.has_frames());
        if !dirty && !idle_checkpoint {
            return Ok(false);
        }
        #[cfg(test)]
        self.commits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if close {
            tracing::trace!(changes, "redb checkpoint at close");
            let mut txn = self.txn.take().ok_or(redb::Error::PreviousIo)?;
            // The commit holds every frame written so far, and this batch, which has none.
            record_checkpoint(&txn, journal.last(), self.rows.next, FORMAT_SETTLED)?;
            txn.set_durability(Durability::Immediate)?;
            txn.commit()?;
            journal.checkpointed();
            self.checkpointed_at = Instant::now();
            return Ok(true);
        }
        if dirty {
            tracing::trace!(changes, "redb group commit, journalled");
            journal.append().map_err(redb::Error::Io)?;
        }
        if checkpoint_due || (can_start && journal.size_with_pending() > CHECKPOINT_AT) {
            tracing::trace!("redb checkpoint begins");
            // The batch is durable in the journal, which the reopen applies: a checkpoint that
            // cannot begin fails the file, not the batch.
            if let Err(e) = self.start_checkpoint() {
                self.poison(Arc::new(e));
            }
        }
        Ok(true)
    }
}
