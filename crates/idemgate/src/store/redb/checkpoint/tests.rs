//! Checkpoints under a slow disk: batches answered while the sync runs, reads that see their
//! changes, and every acknowledged change kept through a crash or a power cut at any point.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redb::ReadableDatabase;

use super::super::open::{FORMAT, FORMAT_KEY, FORMAT_SETTLED, JOURNAL_STATE};
use super::super::ops::Op;
use super::super::sim_disk::{SimDisk, SyncHold};
use super::super::tests::{
    assert_in_flight, assert_in_flight_after_power_cut, claim_op, complete, open_fresh,
    remove_files, run_one, temp_path, test_writer, writer_on,
};
use super::super::writer::{CHECKPOINT_EVERY, Writer};
use super::{FailStart, SyncThread};
use crate::record::{Completion, OwnerToken, Record, RecordKey, StoredResponse};
use crate::store::{Claim, Transition};

/// The format the file's last commit records.
fn format(writer: &Writer) -> u64 {
    let txn = writer.db.as_ref().unwrap().begin_read().unwrap();
    let state = txn.open_table(JOURNAL_STATE).unwrap();
    state.get(FORMAT_KEY).unwrap().map(|v| v.value()).unwrap()
}

/// Claims `name`'s key for a new owner, which must get it; returns the key and the owner.
fn acquire(writer: &mut Writer, name: &str) -> (RecordKey, OwnerToken) {
    let key = RecordKey::of(name.as_bytes());
    let token = OwnerToken::generate();
    let claimed = run_one(writer, claim_op(key, token));
    assert!(
        matches!(claimed, Ok(Claim::Acquired(_))),
        "{name}: {claimed:?}"
    );
    (key, token)
}

fn get(writer: &mut Writer, key: RecordKey) -> Option<Record> {
    run_one(writer, |reply| Op::Get { key, reply }).expect("the get is answered")
}

/// Makes the next batch begin a checkpoint whose sync is held, runs `name`'s claim as that
/// batch, and returns the hold once the checkpoint's sync is under way.
fn checkpoint_held_by(
    writer: &mut Writer,
    disk: &SimDisk,
    path: &Path,
    name: &str,
) -> ((RecordKey, OwnerToken), SyncHold) {
    writer.checkpointed_at = Instant::now() - CHECKPOINT_EVERY;
    let hold = disk.hold_syncs(path);
    let claimed = acquire(writer, name);
    assert!(
        hold.wait_held(),
        "the claim was answered only after the checkpoint's sync"
    );
    assert!(writer.running.is_some(), "a checkpoint runs");
    (claimed, hold)
}

/// The state the test leaves: `done` completed, `released` gone, `held` in flight.
fn assert_state(writer: &mut Writer, done: &[RecordKey], released: RecordKey, held: &[RecordKey]) {
    for &key in done {
        let found = get(writer, key);
        assert!(matches!(found, Some(Record::Completed { .. })), "{found:?}");
    }
    assert!(get(writer, released).is_none(), "the released record");
    assert_in_flight(writer, held);
}

/// While a checkpoint's sync runs, claims are answered (journalled, not waiting for it) and
/// every answer sees both the rows the checkpoint holds and the changes made since: a replay
/// of a record completed before it, a conflict with one claimed during it, a removal of a row
/// it holds. Once the sync returns the changes move to the file, and the answers stay.
#[test]
fn claims_during_a_checkpoint_are_answered_before_its_sync_and_read_right() {
    let disk = SimDisk::default();
    let path = PathBuf::from("/sim/slow-checkpoint/records.redb");
    let mut writer = writer_on(&disk, &path);
    let before = acquire(&mut writer, "completed before");
    complete(&mut writer, before);
    let released = acquire(&mut writer, "released during");

    let (started, hold) = checkpoint_held_by(&mut writer, &disk, &path, "begins it");
    let during = acquire(&mut writer, "claimed during");
    // A replay from the checkpoint's rows, a conflict with the overlay's.
    let replay = run_one(&mut writer, claim_op(before.0, OwnerToken::generate()));
    assert!(matches!(replay, Ok(Claim::Completed(_))), "{replay:?}");
    let conflict = run_one(&mut writer, claim_op(during.0, OwnerToken::generate()));
    assert!(
        matches!(conflict, Ok(Claim::InFlight { .. })),
        "{conflict:?}"
    );
    complete(&mut writer, during);
    let (key, token) = released;
    let release = run_one(&mut writer, |reply| Op::Release { key, token, reply });
    assert!(matches!(release, Ok(Transition::Applied)), "{release:?}");
    let done = [before.0, during.0];
    assert_state(&mut writer, &done, released.0, &[started.0]);
    assert!(
        hold.holding(),
        "all of it while the checkpoint's sync was held"
    );

    hold.release();
    writer.settle_checkpoint(true);
    assert!(writer.running.is_none() && writer.poisoned.is_none());
    assert!(
        writer.txn.is_some(),
        "the overlay went to the next transaction"
    );
    assert_state(&mut writer, &done, released.0, &[started.0]);
    let replay = run_one(&mut writer, claim_op(during.0, OwnerToken::generate()));
    assert!(matches!(replay, Ok(Claim::Completed(_))), "{replay:?}");

    // A crash after it: the checkpoint and the journal's frames since bring it all back.
    disk.power_cut();
    drop(writer);
    let mut writer = writer_on(&disk, &path);
    assert_state(&mut writer, &done, released.0, &[started.0]);
}

/// A power cut while a checkpoint's sync runs: whether or not the checkpoint landed, every
/// change acknowledged before and during it is back at the next open, in order (a record
/// claimed and then completed during it is completed).
#[test]
fn a_power_cut_during_a_checkpoint_loses_nothing_acknowledged() {
    let disk = SimDisk::default();
    let path = PathBuf::from("/sim/cut-in-checkpoint/records.redb");
    let mut writer = writer_on(&disk, &path);
    let before = acquire(&mut writer, "before");
    let released = acquire(&mut writer, "released");
    let (started, hold) = checkpoint_held_by(&mut writer, &disk, &path, "begins it");
    let during = acquire(&mut writer, "during");
    complete(&mut writer, during);
    complete(&mut writer, before);
    let (key, token) = released;
    let release = run_one(&mut writer, |reply| Op::Release { key, token, reply });
    assert!(matches!(release, Ok(Transition::Applied)), "{release:?}");
    let in_flight = acquire(&mut writer, "in flight");
    assert!(hold.holding());

    disk.power_cut();
    hold.release();
    drop(writer);
    let mut writer = writer_on(&disk, &path);
    let done = [before.0, during.0];
    assert_state(&mut writer, &done, released.0, &[started.0, in_flight.0]);
}

/// A writer that stops (the store dropped) while a checkpoint's sync runs waits for it and
/// closes with a checkpoint of its own: the next open has the changes, and no frame to apply.
#[test]
fn a_close_during_a_checkpoint_waits_for_it_and_keeps_everything() {
    let disk = SimDisk::default();
    let path = PathBuf::from("/sim/close-in-checkpoint/records.redb");
    let mut writer = writer_on(&disk, &path);
    // Open, the file's journal may go on in its second file: a binary reading only the
    // first must refuse it after a crash.
    assert_eq!(format(&writer), FORMAT);
    let before = acquire(&mut writer, "before");
    let (started, hold) = checkpoint_held_by(&mut writer, &disk, &path, "begins it");
    let during = acquire(&mut writer, "during");
    hold.release();
    writer.checkpoint_on_close();
    assert!(writer.running.is_none() && writer.poisoned.is_none());
    assert!(!writer.journal.as_ref().unwrap().has_frames());
    assert_eq!(
        format(&writer),
        FORMAT_SETTLED,
        "a clean close leaves the older format"
    );
    drop(writer);

    disk.power_cut();
    let mut writer = writer_on(&disk, &path);
    assert_in_flight(&mut writer, &[before.0, started.0, during.0]);
}

/// A checkpoint whose sync takes so long that the changes made meanwhile pass the overlay's
/// bound holds the next batch until it returns: memory stays bounded, and the changes are
/// all kept.
#[test]
fn a_slow_checkpoint_holds_the_writer_once_its_overlay_is_full() {
    let disk = SimDisk::default();
    let path = PathBuf::from("/sim/full-overlay/records.redb");
    let mut writer = writer_on(&disk, &path);
    let (started, hold) = checkpoint_held_by(&mut writer, &disk, &path, "begins it");
    let body = bytes::Bytes::from(vec![7u8; 1024 * 1024]);
    let mut done = Vec::new();
    let overlay = |writer: &Writer| writer.running.as_ref().map_or(0, |r| r.overlay.bytes());
    while overlay(&writer) <= super::OVERLAY_MAX {
        let (key, token) = acquire(&mut writer, &format!("large {}", done.len()));
        let completion = Completion::Response(StoredResponse {
            status: http::StatusCode::OK,
            headers: http::HeaderMap::new(),
            body: body.clone(),
        })
        .encode();
        let ttl = Duration::from_secs(600);
        let completed = run_one(&mut writer, |reply| Op::Complete {
            key,
            token,
            completion,
            ttl,
            reply,
        });
        assert!(
            matches!(completed, Ok(Transition::Applied)),
            "{completed:?}"
        );
        done.push(key);
    }
    assert!(hold.holding(), "the overlay filled while the sync was held");

    let release = std::thread::spawn({
        let hold = hold.clone();
        move || {
            std::thread::sleep(Duration::from_millis(300));
            hold.release();
        }
    });
    let waited = Instant::now();
    let next = acquire(&mut writer, "after");
    assert!(
        waited.elapsed() >= Duration::from_millis(250),
        "the batch did not wait for the checkpoint"
    );
    // The full overlay went to the file; a new checkpoint (of a journal past its size) may
    // have begun with an empty one.
    assert!(
        overlay(&writer) < super::OVERLAY_MAX,
        "the checkpoint was ended first"
    );
    release.join().unwrap();
    assert_state(
        &mut writer,
        &done,
        RecordKey::of(b"never"),
        &[started.0, next.0],
    );
}

/// A store closed with nothing in its journal (opened and closed with no change, or idle
/// since its last checkpoint) also leaves the older format: a downgrade after any clean stop
/// opens the file.
#[test]
fn a_clean_close_without_frames_leaves_the_older_format() {
    let disk = SimDisk::default();
    let path = PathBuf::from("/sim/idle-close/records.redb");
    let mut writer = writer_on(&disk, &path);
    assert_eq!(format(&writer), FORMAT);
    assert!(!writer.journal.as_ref().unwrap().has_frames());
    writer.checkpoint_on_close();
    assert_eq!(
        format(&writer),
        FORMAT_SETTLED,
        "a clean close leaves the older format"
    );
}

/// A checkpoint that cannot begin after the batch's frame is synced (its commit without a sync
/// fails, or what comes after it) poisons the file, but the batch is durable in the journal:
/// its callers get what it did, the read view answers from it, and the reopen and a power cut
/// after it keep it.
#[test]
fn a_checkpoint_that_cannot_begin_fails_the_file_not_the_batch() {
    for step in [FailStart::BeforeCommit, FailStart::AfterCommit] {
        let disk = SimDisk::default();
        let path = PathBuf::from(format!("/sim/checkpoint-start-{step:?}/records.redb"));
        let mut writer = writer_on(&disk, &path);
        let before = acquire(&mut writer, "before");
        writer.checkpointed_at = Instant::now() - CHECKPOINT_EVERY;
        writer.fail_checkpoint_start = Some(step);
        let kept = acquire(&mut writer, "begins it");
        assert!(writer.poisoned.is_some(), "{step:?}: the file is poisoned");
        assert!(writer.unsettled.is_empty(), "{step:?}: no claim to undo");

        // Until the reopen, the read view has the batch.
        let later = Instant::now() + Duration::from_secs(3600);
        writer.poisoned.as_mut().unwrap().retry_at = later;
        let other = run_one(&mut writer, claim_op(kept.0, OwnerToken::generate()));
        assert!(matches!(other, Ok(Claim::InFlight { .. })), "{other:?}");

        writer.poisoned.as_mut().unwrap().retry_at = Instant::now();
        let after = acquire(&mut writer, "after");
        assert!(writer.poisoned.is_none(), "{step:?}: reopened");
        let held = [before.0, kept.0, after.0];
        assert_in_flight(&mut writer, &held);

        assert_in_flight_after_power_cut(&disk, &path, writer, &held);
    }
}

/// Checkpoint after checkpoint, the durable commits run on one thread, started at the first.
#[test]
fn checkpoints_share_one_sync_thread() {
    let disk = SimDisk::default();
    let path = PathBuf::from("/sim/one-sync-thread/records.redb");
    let mut writer = writer_on(&disk, &path);
    for i in 0..5 {
        writer.checkpointed_at = Instant::now() - CHECKPOINT_EVERY;
        acquire(&mut writer, &format!("claim {i}"));
        assert!(writer.running.is_some(), "checkpoint {i} runs");
        writer.settle_checkpoint(true);
        assert!(writer.poisoned.is_none(), "checkpoint {i} synced");
    }
    assert_eq!(writer.sync_threads, 1);
}

/// The sync thread does not hold the file between checkpoints: a real file (which redb
/// refuses to open twice) opens again after a failure closes it in the same writer, after a
/// writer dropped while a checkpoint runs, and after a clean close.
#[test]
fn a_file_closed_after_checkpoints_opens_again() {
    let path = temp_path("sync-thread-close");
    let mut writer = test_writer(&path, open_fresh(&path).unwrap());
    let checkpoint = |writer: &mut Writer, name: &str| {
        writer.checkpointed_at = Instant::now() - CHECKPOINT_EVERY;
        let claimed = acquire(writer, name);
        assert!(writer.running.is_some(), "{name}: a checkpoint runs");
        claimed.0
    };
    let settled = checkpoint(&mut writer, "settled");
    writer.settle_checkpoint(true);
    writer.poison(Arc::new(redb::Error::PreviousIo));
    assert!(writer.txn.is_some(), "the read view opened the file again");
    writer.poisoned.as_mut().unwrap().retry_at = Instant::now();
    let reopens = acquire(&mut writer, "reopens").0;
    assert!(writer.poisoned.is_none(), "reopened");
    let running = checkpoint(&mut writer, "running");
    drop(writer);

    let opened = open_fresh(&path).expect("the file opens after a drop");
    let mut writer = test_writer(&path, opened);
    assert_in_flight(&mut writer, &[settled, reopens, running]);
    writer.checkpoint_on_close();
    drop(writer);
    drop(open_fresh(&path).expect("the file opens after a clean close"));
    remove_files(&path);
}

/// A sync thread that dies (panics) in a durable commit fails that checkpoint instead of
/// leaving the writer waiting: the file is poisoned, the batch that began it stands, and the
/// reopened file starts a new thread whose checkpoints sync.
#[test]
fn a_sync_thread_that_died_fails_its_checkpoint_and_the_reopen_starts_another() {
    let disk = SimDisk::default();
    let path = PathBuf::from("/sim/dead-sync-thread/records.redb");
    let mut writer = writer_on(&disk, &path);
    let dies = |_: &redb::Database| panic!("an injected panic in the checkpoint thread");
    writer.sync_thread = Some(SyncThread::start(dies).unwrap());
    writer.checkpointed_at = Instant::now() - CHECKPOINT_EVERY;
    let kept = acquire(&mut writer, "begins it");
    writer.settle_checkpoint(true);
    assert!(
        writer.poisoned.is_some(),
        "the failed checkpoint poisons the file"
    );
    assert!(
        writer.sync_thread.is_none(),
        "the dead thread went with the file"
    );

    writer.poisoned.as_mut().unwrap().retry_at = Instant::now();
    let reopens = acquire(&mut writer, "reopens");
    assert!(writer.poisoned.is_none(), "reopened");
    writer.checkpointed_at = Instant::now() - CHECKPOINT_EVERY;
    let after = acquire(&mut writer, "after");
    writer.settle_checkpoint(true);
    assert!(writer.poisoned.is_none(), "the new thread synced it");
    assert_eq!(writer.sync_threads, 1);
    assert_in_flight(&mut writer, &[kept.0, reopens.0, after.0]);
}
