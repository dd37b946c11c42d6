//! The redb store's unit tests: the writer, the journal and the file under faults.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableHandle};
use tokio::sync::oneshot;

use super::RedbStore;
use super::clock::{Clock, now_ms};
use super::codec::RECORDS;
use super::codec::{
    Header, IN_FLIGHT_LEN_V1, StateHeader, VERSION, encode_row, parse_row, row_expiry,
};
use super::disk::{Disk, JournalFile, RealDisk};
use super::index::RowIndex;
use super::journal::Journal;
use super::migrate::{EXPIRIES_V1, EXPIRIES_V2, RECORDS_V1};
use super::open::{
    FORMAT, FORMAT_KEY, JOURNAL_APPLIED, JOURNAL_STATE, MARK_LAST_ROW, MARK_NEXT_ROW, MARK_ROWS,
    next_row_of, open_file, record_checkpoint,
};
use super::ops::{Op, Reply};
use super::writer::{CHECKPOINT_EVERY, Writer};
use crate::record::{Completion, FingerprintHash, OwnerToken, Record, RecordKey};
use crate::store::answer_queue::AnswerQueue;
use crate::store::{Claim, ClaimOptions, Store, StoreError, Transition, UnknownOutcome};

impl Header {
    /// The encoded record alone, without a row's record key.
    fn encode(&self, completion: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        self.encode_into(&mut out, completion);
        out
    }
}

fn headers() -> Vec<Header> {
    let fingerprint = FingerprintHash::of(b"fp");
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
pub(super) fn open_fresh(path: &Path) -> Result<(Database, Journal, RowIndex), StoreError> {
    open_file(&RealDisk, path, Some(now_ms()))
}

/// Removes a test's database file and its journal.
pub(super) fn remove_files(path: &Path) {
    let _ = std::fs::remove_file(path);
    for journal in Journal::paths_for(path) {
        let _ = std::fs::remove_file(journal);
    }
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

/// The real disk, except that the journal's syncs fail while `fail` is set: the frame is
/// written all the same, so the batch whose sync failed may be in the journal.
#[derive(Debug)]
struct FailingJournalSync {
    fail: Arc<std::sync::atomic::AtomicBool>,
}

/// A journal file of [`FailingJournalSync`].
struct FailingJournalFile {
    file: Box<dyn JournalFile>,
    fail: Arc<std::sync::atomic::AtomicBool>,
}

impl JournalFile for FailingJournalFile {
    fn read_all(&mut self) -> std::io::Result<Vec<u8>> {
        self.file.read_all()
    }
    fn write_all_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        self.file.write_all_at(data, offset)
    }
    fn sync_data(&self) -> std::io::Result<()> {
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(std::io::Error::other("injected sync failure"));
        }
        self.file.sync_data()
    }
}

impl Disk for FailingJournalSync {
    fn create_database(
        &self,
        builder: &redb::Builder,
        path: &Path,
    ) -> Result<Database, redb::DatabaseError> {
        RealDisk.create_database(builder, path)
    }
    fn open_journal(&self, path: &Path) -> std::io::Result<Box<dyn JournalFile>> {
        Ok(Box::new(FailingJournalFile {
            file: RealDisk.open_journal(path)?,
            fail: Arc::clone(&self.fail),
        }))
    }
    fn create_dir_all(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        RealDisk.create_dir_all(dir)
    }
    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        RealDisk.sync_dir(dir)
    }
    fn forget_cached(&self, path: &Path) -> std::io::Result<()> {
        RealDisk.forget_cached(path)
    }
}

/// A writer over an opened file, as [`RedbStore::open`] starts it, except that it reopens
/// a failed file at its next batch and does not sweep.
pub(super) fn test_writer(
    path: &Path,
    (db, journal, rows): (Database, Journal, RowIndex),
) -> Writer {
    Writer {
        commits: Arc::default(),
        fail_checkpoint_start: None,
        sync_threads: 0,
        answers: Arc::new(AnswerQueue::new()),
        txn: None,
        running: None,
        sync_thread: None,
        db: Some(Arc::new(db)),
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
pub(super) fn claim_op(key: RecordKey, token: OwnerToken) -> impl FnOnce(Reply<Claim>) -> Op {
    move |reply| Op::Claim {
        key,
        fingerprint: FingerprintHash::of(b"fp"),
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
pub(super) fn run_one<T>(
    writer: &mut Writer,
    op: impl FnOnce(Reply<T>) -> Op,
) -> Result<T, StoreError> {
    let (reply, mut answer) = oneshot::channel();
    writer.run_batch(&mut vec![op(reply)]);
    answer.try_recv().expect("answered when its batch ran")
}

/// A claim whose frame's sync failed was answered as failed, so its caller runs nothing;
/// if the frame landed all the same, the writer releases the claim after reopening the file
/// (which applies the frame), and the client's retry can claim the key instead of meeting a
/// record nobody runs.
#[test]
fn a_claim_whose_commit_failed_is_released_after_the_reopen() {
    let path = temp_path("unsettled");
    let fail = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let disk = Arc::new(FailingJournalSync {
        fail: Arc::clone(&fail),
    });
    let mut writer = test_writer(&path, open_file(&*disk, &path, Some(now_ms())).unwrap());
    writer.disk = disk;
    let key = RecordKey::of(b"k");
    let claim = |token| claim_op(key, token);

    fail.store(true, std::sync::atomic::Ordering::SeqCst);
    let first = run_one(&mut writer, claim(OwnerToken::generate()));
    assert!(
        matches!(first, Err(StoreError::Unavailable { .. })),
        "{first:?}"
    );
    assert!(writer.poisoned.is_some());
    assert_eq!(writer.unsettled.len(), 1);
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
    let key = RecordKey::of(b"k");

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
        claim(RecordKey::of(b"other"), OwnerToken::generate()),
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
    let key = RecordKey::of(b"k");
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
    let key = RecordKey::of(b"broken");
    {
        let (db, _, _) = open_fresh(&path).unwrap();
        let header = Header {
            fingerprint: FingerprintHash::of(b"fp"),
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
    let key = RecordKey::of(b"charge");
    let mut writer = test_writer(&path, open_fresh(&path).unwrap());
    let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
    assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
    assert!(writer.txn.is_some(), "journalled, not committed");
    drop(writer); // a crash

    // The older binary: it knows rows but not the journal, so it does not see the claim,
    // runs the request again and keeps its response, in the row after its last one.
    let completed = Header {
        fingerprint: FingerprintHash::of(b"fp"),
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
    let key = RecordKey::of(b"k");
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
                fingerprint: FingerprintHash::of(b"fp"),
                expires: now_ms() + 600_000,
                state: StateHeader::Ambiguous { since: 1 },
            };
            let row = encode_row(&RecordKey::of(b"other"), &header, &[]);
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
    let key = RecordKey::of(b"running");
    {
        let (db, _, _) = open_fresh(&path).unwrap();
        let header = Header {
            fingerprint: FingerprintHash::of(b"fp"),
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
pub(super) fn writer_on(disk: &super::sim_disk::SimDisk, path: &Path) -> Writer {
    let opened = open_file(disk, path, Some(now_ms())).expect("the file opens");
    let mut writer = test_writer(path, opened);
    writer.disk = Arc::new(disk.clone());
    writer
}

/// Cuts the power under `writer`, opens the file again as at start-up, and asserts that each
/// of `keys` is still held in flight.
pub(super) fn assert_in_flight_after_power_cut(
    disk: &super::sim_disk::SimDisk,
    path: &Path,
    writer: Writer,
    keys: &[RecordKey],
) {
    disk.power_cut();
    drop(writer);
    let mut writer = writer_on(disk, path);
    assert_in_flight(&mut writer, keys);
}

/// Completes `key`'s claim under `token` with a charge, kept for 600 s.
pub(super) fn complete(writer: &mut Writer, (key, token): (RecordKey, OwnerToken)) {
    let completion = charge().encode();
    let done = run_one(writer, |reply| Op::Complete {
        key,
        token,
        completion,
        ttl: Duration::from_secs(600),
        reply,
    });
    assert!(matches!(done, Ok(Transition::Applied)), "{done:?}");
}

/// Asserts that each of `keys` is held in flight.
pub(super) fn assert_in_flight(writer: &mut Writer, keys: &[RecordKey]) {
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
/// which kept every frame since the last good checkpoint, in both its files; what it
/// acknowledged before, during and after the failed checkpoint survives a power cut, and the
/// file opens.
#[test]
fn a_failed_checkpoint_sync_loses_nothing_at_a_power_cut() {
    let disk = super::sim_disk::SimDisk::default();
    let path = PathBuf::from("/sim/data/records.redb");
    let mut writer = writer_on(&disk, &path);
    let mut acknowledged = Vec::new();
    let mut claim = |writer: &mut Writer, name: &str| {
        let key = RecordKey::of(name.as_bytes());
        let claimed = run_one(writer, claim_op(key, OwnerToken::generate()));
        assert!(
            matches!(claimed, Ok(Claim::Acquired(_))),
            "{name}: {claimed:?}"
        );
        acknowledged.push(key);
    };
    for name in ["a", "b", "c"] {
        claim(&mut writer, name);
    }

    // The next batch begins a checkpoint, whose sync is slow and then fails; the batches
    // that come meanwhile are journalled and acknowledged.
    writer.checkpointed_at = Instant::now() - CHECKPOINT_EVERY;
    let hold = disk.hold_syncs(&path);
    disk.fail_next_sync(&path);
    claim(&mut writer, "x");
    assert!(hold.wait_held(), "the checkpoint's sync is under way");
    claim(&mut writer, "y");
    hold.release();
    writer.settle_checkpoint(true);
    assert!(
        writer.poisoned.is_some(),
        "the failed checkpoint poisons the file"
    );

    // The writer reopens the file and takes changes again: more acknowledged claims, on
    // both sides of the checkpoint its reopen makes.
    writer.reopen_wait = Duration::ZERO;
    if let Some(poisoned) = &mut writer.poisoned {
        poisoned.retry_at = Instant::now();
    }
    for name in ["d", "e"] {
        claim(&mut writer, name);
        assert!(writer.poisoned.is_none(), "reopened");
    }
    let acknowledged = acknowledged.clone();
    assert_in_flight(&mut writer, &acknowledged);

    assert_in_flight_after_power_cut(&disk, &path, writer, &acknowledged);
}

/// A process that dies right after a failed checkpoint sync, before it reopens anything,
/// leaves the failed commit's pages in the system's cache, marked clean. The next process must
/// not read through them: it opens the file as the disk holds it and applies the journal,
/// and what both processes acknowledged survives a later power cut.
#[test]
fn a_process_after_one_that_died_at_a_failed_sync_trusts_nothing_cached() {
    let disk = super::sim_disk::SimDisk::default();
    let path = PathBuf::from("/sim/died/records.redb");
    let mut writer = writer_on(&disk, &path);
    // Enough completed records for many pages, most of which the next process's commits
    // never touch (a record in flight would be written again at the next open).
    let completed: Vec<RecordKey> = (0..400u32)
        .map(|i| RecordKey::of(&i.to_be_bytes()))
        .collect();
    for &key in &completed {
        let token = OwnerToken::generate();
        let claimed = run_one(&mut writer, claim_op(key, token));
        assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
        complete(&mut writer, (key, token));
    }
    // The checkpoint's commit, whose sync fails; the process dies before doing anything else.
    disk.fail_next_sync(&path);
    let mut txn = writer.txn.take().expect("the batches' open transaction");
    let last = writer.journal.as_ref().unwrap().last();
    record_checkpoint(&txn, last, writer.rows.next, super::open::FORMAT).unwrap();
    txn.set_durability(redb::Durability::Immediate).unwrap();
    assert!(txn.commit().is_err(), "the sync failed");
    drop(writer);

    // The next process, with a checkpoint of its own before the power cut.
    let mut writer = writer_on(&disk, &path);
    let mut running = Vec::new();
    for name in ["c", "d"] {
        let key = RecordKey::of(name.as_bytes());
        let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
        assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
        running.push(key);
    }
    writer.checkpointed_at = Instant::now() - CHECKPOINT_EVERY;
    let sweep = |reply| Op::Sweep { reply: Some(reply) };
    run_one(&mut writer, sweep).unwrap();
    assert!(
        !writer.journal.as_ref().unwrap().has_frames(),
        "checkpointed"
    );
    writer.settle_checkpoint(true);
    assert!(writer.poisoned.is_none(), "the checkpoint's sync succeeded");

    disk.power_cut();
    drop(writer);
    let opened = open_file(&disk, &path, Some(now_ms()));
    let mut writer = test_writer(&path, opened.expect("the file opens after the power cut"));
    assert_in_flight(&mut writer, &running);
    for &key in &completed {
        let found = run_one(&mut writer, |reply| Op::Get { key, reply });
        assert!(
            matches!(found, Ok(Some(Record::Completed { .. }))),
            "{key:?}: {found:?}"
        );
    }
}

/// A journal frame whose sync fails is not acknowledged, and no later frame is written over
/// the frames before it: after the reopen and a power cut, every acknowledged change is
/// there.
#[test]
fn a_failed_journal_sync_loses_nothing_at_a_power_cut() {
    let disk = super::sim_disk::SimDisk::default();
    let path = PathBuf::from("/sim/journal-fails/records.redb");
    let journal = Journal::path_for(&path);
    let mut writer = writer_on(&disk, &path);
    let mut acknowledged = Vec::new();
    for name in ["a", "b"] {
        let key = RecordKey::of(name.as_bytes());
        let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
        assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
        acknowledged.push(key);
    }
    disk.fail_next_sync(&journal);
    writer.reopen_wait = Duration::ZERO;
    let failed = run_one(
        &mut writer,
        claim_op(RecordKey::of(b"x"), OwnerToken::generate()),
    );
    assert!(
        matches!(failed, Err(StoreError::Unavailable { .. })),
        "{failed:?}"
    );
    for name in ["c", "d"] {
        let key = RecordKey::of(name.as_bytes());
        let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
        assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
        acknowledged.push(key);
    }
    assert_in_flight_after_power_cut(&disk, &path, writer, &acknowledged);
}

/// The database file, its journal and the folder made for them are entries in their
/// directories: a change acknowledged right after the store was created survives a power
/// cut only if those directories were synced.
#[test]
fn a_new_store_survives_a_power_cut() {
    let disk = super::sim_disk::SimDisk::default();
    let path = PathBuf::from("/sim/new/folder/records.redb");
    let mut writer = writer_on(&disk, &path);
    let key = RecordKey::of(b"first");
    let claimed = run_one(&mut writer, claim_op(key, OwnerToken::generate()));
    assert!(matches!(claimed, Ok(Claim::Acquired(_))), "{claimed:?}");
    assert_in_flight_after_power_cut(&disk, &path, writer, &[key]);
}

/// Frames left in the journal by a writer that then goes idle are checkpointed by the
/// next batch once a checkpoint is due, even one that changes nothing (a sweep tick).
#[test]
fn an_idle_writer_checkpoints_its_journal() {
    let path = temp_path("idle-checkpoint");
    let mut writer = test_writer(&path, open_fresh(&path).unwrap());
    let claimed = run_one(
        &mut writer,
        claim_op(RecordKey::of(b"k"), OwnerToken::generate()),
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

/// A batch's answers reach their callers through one of them (see `AnswerQueue`): callers
/// that gave up before their answer came (their store timeout) are passed over, and the
/// others are all answered. (A caller reached and then dropped is the answer queue's own test.)
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
                    let key = RecordKey::of(&[round.to_be_bytes(), i.to_be_bytes()].concat());
                    let fp = FingerprintHash::of(b"fp");
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
    let fp = FingerprintHash::of(b"fp");
    let options = ClaimOptions {
        lease: Duration::from_secs(60),
        ttl: Duration::from_secs(60),
        on_lapse: UnknownOutcome::Ambiguous,
    };
    let mut owned = Vec::new();
    for i in 0..256u32 {
        let key = RecordKey::of(&i.to_be_bytes());
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
    let key = RecordKey::of(b"missing");
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
pub(super) fn charge() -> Completion {
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
    let fp = FingerprintHash::of(b"fp");
    let (done, running, expired) = (
        RecordKey::of(b"done"),
        RecordKey::of(b"running"),
        RecordKey::of(b"gone"),
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
    let fp = FingerprintHash::of(b"fp");
    let (done, expired, broken) = (
        RecordKey::of(b"done"),
        RecordKey::of(b"gone"),
        RecordKey::of(b"broken"),
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
    let key = RecordKey::of(b"k");
    let header = Header {
        fingerprint: FingerprintHash::of(b"fp"),
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
