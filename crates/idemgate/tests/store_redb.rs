//! [`RedbStore`]: the conformance suite, the single-opener rule, reuse of freed space, and
//! acknowledged records surviving a `kill -9`.
#![cfg(feature = "redb")]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode};
use idemgate::record::{
    Completion, FingerprintHash, OwnerToken, Record, RecordKey, StoredResponse,
};
use idemgate::store::{Claim, ClaimOptions, RedbStore, Store, Transition, UnknownOutcome};

/// A database path no other test (nor another run) uses; removed on drop with redb's files.
struct TempPath(PathBuf);

impl TempPath {
    fn new(label: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let name = format!(
            "idemgate-{label}-{}-{}-{nanos}.redb",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        Self(std::env::temp_dir().join("idemgate-tests").join(name))
    }

    /// The store's journal beside the file (what `RedbStore::journal_path` names).
    fn journal(&self) -> std::path::PathBuf {
        let mut journal = self.0.clone().into_os_string();
        journal.push("-journal");
        journal.into()
    }
}

impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_file(self.journal());
        let mut second = self.journal().into_os_string();
        second.push("-2");
        let _ = std::fs::remove_file(second);
    }
}

/// A fresh store for each conformance check. Its file is unlinked right after opening: the
/// open handle keeps the data reachable until the store is dropped, and nothing is left
/// behind however the test ends.
async fn fresh_store() -> Arc<dyn Store> {
    let path = TempPath::new("conformance");
    let store = RedbStore::open(&path.0).expect("open a fresh redb file");
    drop(path);
    Arc::new(store)
}

idemgate::store_conformance_tests!(fresh_store());

fn options(lease: Duration, ttl: Duration) -> ClaimOptions {
    ClaimOptions {
        lease,
        ttl,
        on_lapse: UnknownOutcome::Ambiguous,
    }
}

fn long() -> ClaimOptions {
    options(Duration::from_secs(600), Duration::from_secs(600))
}

/// Claims `key` for the fingerprint every test here uses, under a fresh token.
async fn claim(store: &RedbStore, key: &RecordKey, options: &ClaimOptions) -> Claim {
    store
        .claim(
            key,
            &FingerprintHash::of(b"fp"),
            OwnerToken::generate(),
            options,
        )
        .await
        .expect("claim")
}

fn response(body: Vec<u8>) -> Completion {
    let mut headers = HeaderMap::new();
    headers.append("x-n", HeaderValue::from_static("1"));
    headers.append("x-n", HeaderValue::from_static("2"));
    Completion::Response(StoredResponse {
        status: StatusCode::CREATED,
        headers,
        body: Bytes::from(body),
    })
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

#[tokio::test]
async fn second_open_of_one_file_is_refused_and_names_the_file() {
    let path = TempPath::new("double-open");
    let first = RedbStore::open(&path.0).expect("first open");
    let err = RedbStore::open(&path.0).expect_err("a second open of the same file succeeded");
    let message = error_chain(&err);
    assert!(
        message.contains(&path.0.display().to_string()),
        "the error does not name the file: {message}"
    );
    assert!(message.contains("already open"), "{message}");

    // A clone shares the open file; the file is free again once every handle is dropped.
    let clone = first.clone();
    drop(first);
    assert!(
        RedbStore::open(&path.0).is_err(),
        "a live clone did not keep the file open"
    );
    drop(clone);
    RedbStore::open(&path.0).expect("reopen after the store was dropped");
}

#[tokio::test]
async fn open_creates_missing_parent_directories() {
    let base = TempPath::new("nested");
    let dir = base.0.with_extension("d");
    let path = dir.join("a").join("b").join("records.redb");
    let store = RedbStore::open(&path).expect("open in a directory that does not exist yet");
    assert_eq!(store.path(), path);
    store.ping().await.expect("ping");
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn records_and_tokens_survive_reopening() {
    let path = TempPath::new("reopen");
    let (done, pending) = (RecordKey::of(b"done"), RecordKey::of(b"pending"));
    let token = {
        let store = RedbStore::open(&path.0).unwrap();
        let Claim::Acquired(t) = claim(&store, &done, &long()).await else {
            panic!("not acquired");
        };
        let stored = store
            .complete(
                &done,
                t,
                response(b"kept".to_vec()),
                Duration::from_secs(600),
            )
            .await
            .unwrap();
        assert_eq!(stored, Transition::Applied);
        let Claim::Acquired(t) = claim(&store, &pending, &long()).await else {
            panic!("not acquired");
        };
        t
    };
    let store = RedbStore::open(&path.0).unwrap();
    match claim(&store, &done, &long()).await {
        Claim::Completed(c) => assert_eq!(*c, response(b"kept".to_vec())),
        other => panic!("after reopening: {other:?}"),
    }
    // An owner from before the restart still holds its record.
    assert!(matches!(
        claim(&store, &pending, &long()).await,
        Claim::InFlight { .. }
    ));
    assert_eq!(
        store
            .complete(&pending, token, response(vec![]), Duration::from_secs(600))
            .await
            .unwrap(),
        Transition::Applied
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn space_of_expired_records_is_reused() {
    let path = TempPath::new("reuse");
    let store = Arc::new(RedbStore::open(&path.0).unwrap());
    let ttl = Duration::from_millis(200);
    let mut sizes = Vec::new();
    for round in 0..6u32 {
        // 2000 unique keys with 1 KiB bodies, written by 32 tasks so batches fill.
        let tasks: Vec<_> = (0..32u32)
            .map(|task| {
                let store = Arc::clone(&store);
                tokio::spawn(async move {
                    for i in 0..63u32 {
                        let key = RecordKey::of(format!("reuse-{round}-{task}-{i}").as_bytes());
                        // A long lease and claim ttl: a slow commit on a busy disk must not
                        // let the claim lapse or its record expire before its completion
                        // lands. The completed record lives `ttl`.
                        let held = Duration::from_secs(60);
                        let Claim::Acquired(token) =
                            claim(&store, &key, &options(held, held)).await
                        else {
                            panic!("fresh key not acquired");
                        };
                        let body = vec![(i % 251) as u8; 4 * 1024];
                        let applied = store.complete(&key, token, response(body), ttl).await;
                        assert_eq!(applied.unwrap(), Transition::Applied);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        tokio::time::sleep(ttl * 2).await;
        let removed = store.sweep().await.unwrap();
        let size = std::fs::metadata(&path.0).unwrap().len();
        eprintln!("round {round}: swept {removed}, file {size} bytes");
        sizes.push(size);
    }
    // The first round finds no free space, so its file size is what one round takes. Without
    // reuse every round adds that much again: six rounds would make a file six times as
    // large. With reuse the file keeps about one round's size; redb's allocator now and then
    // places a round beside the freed pages rather than in them (the file grew by up to
    // two-thirds of a round in such runs) and gives the space back later, so the bound sits
    // halfway between the two.
    let one_round = sizes[0];
    let rounds = sizes.len() as u64;
    for (round, size) in sizes.iter().enumerate() {
        assert!(
            *size < one_round * rounds / 2,
            "the file grew to {size} bytes by round {round}, from {one_round} after the first: freed space is not reused"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_removes_expired_records_in_batches() {
    let path = TempPath::new("sweep");
    let store = Arc::new(RedbStore::open(&path.0).unwrap());
    let short = options(Duration::from_millis(100), Duration::from_millis(100));
    let tasks: Vec<_> = (0..25u32)
        .map(|task| {
            let store = Arc::clone(&store);
            tokio::spawn(async move {
                for i in 0..100u32 {
                    let key = RecordKey::of(format!("sweep-{task}-{i}").as_bytes());
                    claim(&store, &key, &short).await;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    let live = RecordKey::of(b"live");
    claim(&store, &live, &long()).await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    // The writer sweeps on its own too, so count what is left rather than what this removed.
    store.sweep().await.unwrap();
    assert_eq!(
        store.sweep().await.unwrap(),
        0,
        "expired records left after a sweep"
    );
    assert!(
        matches!(
            store.get(&live).await.unwrap(),
            Some(Record::InFlight { .. })
        ),
        "the sweep removed a live record"
    );
}

// ---------------------------------------------------------------------------------------------
// kill -9.

const CRASH_FILE_ENV: &str = "IDEMGATE_TEST_CRASH_FILE";
const CRASH_CHILD: &str = "crash_child_writes_until_killed";

fn crash_key(i: u64) -> RecordKey {
    RecordKey::of(format!("crash-{i}").as_bytes())
}

fn crash_body(i: u64) -> Vec<u8> {
    let mut body = i.to_be_bytes().repeat(64);
    body.extend(0..=255u8);
    body
}

/// The child side of the crash test: claims and completes keys as fast as it can and prints
/// each acknowledged one. Does nothing unless the parent test set the file to use.
#[test]
#[ignore = "run by acknowledged_records_survive_kill_9 in a child process"]
fn crash_child_writes_until_killed() {
    let Some(path) = std::env::var_os(CRASH_FILE_ENV) else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let store = Arc::new(RedbStore::open(PathBuf::from(path)).unwrap());
        let started = Instant::now();
        let (acks, mut acked) = tokio::sync::mpsc::channel::<u64>(1024);
        // 8 writers so commits are grouped, as under real load.
        for writer in 0..8u64 {
            let store = Arc::clone(&store);
            let acks = acks.clone();
            tokio::spawn(async move {
                for n in 0..20_000u64 {
                    if started.elapsed() > Duration::from_secs(60) {
                        return;
                    }
                    let i = n * 8 + writer;
                    let key = crash_key(i);
                    let fp = FingerprintHash::of(b"fp");
                    let Ok(Claim::Acquired(token)) = store
                        .claim(&key, &fp, OwnerToken::generate(), &long())
                        .await
                    else {
                        return;
                    };
                    let completion = response(crash_body(i));
                    let ttl = Duration::from_secs(3600);
                    if store.complete(&key, token, completion, ttl).await.ok()
                        != Some(Transition::Applied)
                    {
                        return;
                    }
                    if acks.send(i).await.is_err() {
                        return;
                    }
                }
            });
        }
        drop(acks);
        let mut out = std::io::stdout().lock();
        while let Some(i) = acked.recv().await {
            // Printed only after the completion was committed.
            if writeln!(out, "acked {i}")
                .and_then(|_| out.flush())
                .is_err()
            {
                return;
            }
        }
    });
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_records_survive_kill_9() {
    let path = TempPath::new("crash");
    let acked = tokio::task::spawn_blocking({
        let path = path.0.clone();
        // Past the first checkpoint (a second in), so the file holds both records committed
        // by checkpoints and records only in the journal.
        move || run_child_until(&path, 300, Duration::from_millis(1500))
    })
    .await
    .unwrap();
    assert!(
        acked.len() >= 300,
        "the child acknowledged only {} records",
        acked.len()
    );
    let journal = path.journal();
    let journalled = std::fs::metadata(&journal).map_or(0, |m| m.len());
    assert!(journalled > 0, "the kill left a journal to apply");

    let store = RedbStore::open(&path.0).expect("the file opens after a kill -9");
    assert_eq!(store.journal_path(), journal);
    for &i in &acked {
        let key = crash_key(i);
        match claim(&store, &key, &long()).await {
            Claim::Completed(c) => assert_eq!(*c, response(crash_body(i)), "record {i} changed"),
            other => panic!("acknowledged record {i} did not survive: {other:?}"),
        }
        assert!(
            matches!(
                store.get(&key).await.unwrap(),
                Some(Record::Completed { .. })
            ),
            "get of acknowledged record {i}"
        );
    }
    // The reopened file takes new writes.
    let key = RecordKey::of(b"after-crash");
    assert!(matches!(
        claim(&store, &key, &long()).await,
        Claim::Acquired(_)
    ));
}

/// Runs the child test against `path`, reads at least `wanted` acknowledgements for at least
/// `running`, then kills it with SIGKILL mid-stream and returns what it acknowledged.
fn run_child_until(path: &Path, wanted: usize, running: Duration) -> Vec<u64> {
    let started = Instant::now();
    let exe = std::env::current_exe().expect("the test binary's path");
    let child = Command::new(exe)
        .args([
            "--exact",
            CRASH_CHILD,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CRASH_FILE_ENV, path)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the child test");
    let mut child = KillOnDrop(child);
    let stdout = child.0.stdout.take().expect("the child's stdout");
    let mut acked = Vec::with_capacity(wanted);
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read the child's output");
        if let Some(i) = line.strip_prefix("acked ") {
            acked.push(i.parse::<u64>().expect("an acknowledged index"));
            if acked.len() >= wanted && started.elapsed() >= running {
                break;
            }
        }
    }
    // SIGKILL while the child is still writing: no destructor, no clean close.
    child.0.kill().expect("kill the child");
    child.0.wait().expect("reap the child");
    acked
}
