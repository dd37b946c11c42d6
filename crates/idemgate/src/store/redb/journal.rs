//! The redb store's journal: each batch's row changes since the last checkpoint, appended to a
//! file beside the database and synced before the batch's callers are answered.
//!
//! A durable redb commit writes every page the batch touched (the table's leaves and branches,
//! the allocator's and the free list's pages) where each lives in the file, about twenty
//! scattered writes, then syncs. Appending the same batch's row changes to the journal is one
//! write at the journal's end. So the writer applies the batches to one open write
//! transaction and makes each durable here; every tenth of a second, or when the journal has
//! grown past [`CHECKPOINT_AT`], the database is committed durably (a checkpoint) with the
//! sequence number of the last frame it holds.
//!
//! The checkpoint's sync takes milliseconds and the writer does not wait for it: the
//! frames written meanwhile are past the checkpoint and must outlive it. So the journal is two
//! files used in turn (`PATH-journal` and `PATH-journal-2`): a checkpoint covers every frame of
//! the file in use when it starts, and the frames written while it runs go to the other file,
//! from its start. That file is free: its frames were covered by the checkpoint before, which
//! had finished (one checkpoint runs at a time). A checkpoint made while nothing else is
//! written (at open and at close) covers both files, and the next frame goes at the start of
//! the file in use.
//!
//! After a crash, redb returns to its last checkpoint and the frames written since are applied
//! again ([`Recovered`]): they start one file, and go on at the start of the other if a
//! checkpoint was running when they were written. Every change the store acknowledged is back.
//!
//! # Frame layout
//!
//! Integers are little-endian.
//!
//! | field | bytes |
//! | --- | --- |
//! | magic `IGJ1` | 4 |
//! | the database's journal id | 8 |
//! | sequence number | 8 |
//! | payload length | 4 |
//! | payload: changes, each a tag then its fields | as given |
//! | first 8 bytes of the SHA-256 of the id, sequence, length and payload | 8 |
//!
//! A change is a put (tag 1, row number, value length as 4 bytes, value) or a removal (tag 2,
//! row number). Recovery reads frames from the start of the file whose first frame follows the
//! database's, for as long as each one is whole, carries this database's id and has the
//! sequence number after the previous one; then from the start of the other file if its first
//! frame follows the last one read. A torn last frame, zeros, or frames of an earlier round
//! (their numbers are at or below the database's) end it. A whole frame of this database
//! numbered past the last one read, found anywhere after that point in either file, means a
//! frame in the middle was damaged: the open then fails with an error naming the journal file
//! and the frame, rather than dropping the acknowledged changes of every frame after it. The
//! operator may accept that loss by cutting the journal at the damaged frame, as the error
//! says.
//!
//! Each file is overwritten in place from its start and never shrinks, so once it has reached
//! its working size a sync has only the frames' pages to write, not the file's size.

use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::disk::{Disk, JournalFile};

const MAGIC: &[u8; 4] = b"IGJ1";
const HEAD_LEN: usize = 4 + 8 + 8 + 4;
const CHECKSUM_LEN: usize = 8;
const TAG_PUT: u8 = 1;
const TAG_REMOVE: u8 = 2;
/// Journal size past which the next batch is a checkpoint, so replay after a crash reads at
/// most about this much.
pub(super) const CHECKPOINT_AT: u64 = 16 * 1024 * 1024;

/// The journal of one open database.
pub(super) struct Journal {
    files: [JournalSide; 2],
    paths: [PathBuf; 2],
    /// The file frames are written to: the other one holds the frames of the checkpoint
    /// running, if one is.
    active: usize,
    id: u64,
    /// The sequence number of the last frame written.
    last: u64,
    /// The frame being gathered: its head (filled in when written), then its changes.
    frame: Vec<u8>,
}

/// One of the journal's two files.
struct JournalSide {
    file: Box<dyn JournalFile>,
    /// Where its next frame goes.
    end: u64,
}

/// One row change.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Change<'a> {
    Put { row: u64, value: &'a [u8] },
    Remove { row: u64 },
}

/// The frames a crash left to apply again.
pub(super) struct Recovered {
    data: [Vec<u8>; 2],
    /// Each frame's file and where its payload is in it.
    payloads: Vec<(usize, Range<usize>)>,
}

impl Recovered {
    /// Each frame's changes, oldest first.
    pub(super) fn frames(&self) -> impl Iterator<Item = Changes<'_>> {
        self.payloads.iter().map(|(file, range)| Changes {
            rest: &self.data[*file][range.clone()],
        })
    }

    /// How many frames there are to apply.
    pub(super) fn len(&self) -> usize {
        self.payloads.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.payloads.is_empty()
    }
}

/// The changes of one frame, in order. A payload whose checksum matched yet does not parse
/// (which only a bug could write) is an error.
pub(super) struct Changes<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Changes<'a> {
    type Item = io::Result<Change<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        let (&tag, rest) = self.rest.split_first()?;
        let parsed = (|| {
            let row = u64::from_le_bytes(rest.get(..8)?.try_into().ok()?);
            let rest = &rest[8..];
            match tag {
                TAG_PUT => {
                    let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
                    let value = rest.get(4..4 + len)?;
                    Some((Change::Put { row, value }, &rest[4 + len..]))
                }
                TAG_REMOVE => Some((Change::Remove { row }, rest)),
                _ => None,
            }
        })();
        match parsed {
            Some((change, rest)) => {
                self.rest = rest;
                Some(Ok(change))
            }
            None => {
                self.rest = &[];
                Some(Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "a journal frame's changes do not parse",
                )))
            }
        }
    }
}

impl Journal {
    /// The journal's first file for the database at `db`: the same name with `-journal`
    /// added. The second has `-journal-2`.
    pub(super) fn path_for(db: &Path) -> PathBuf {
        Self::paths_for(db)[0].clone()
    }

    /// Both of the journal's files for the database at `db`.
    pub(super) fn paths_for(db: &Path) -> [PathBuf; 2] {
        ["-journal", "-journal-2"].map(|suffix| {
            let mut name = db.as_os_str().to_owned();
            name.push(suffix);
            PathBuf::from(name)
        })
    }

    /// Opens (or creates) the journal of the database at `db`, whose id is `id` and which holds
    /// the changes of frames up to `applied`; returns it with the frames written since. The
    /// journal's next frame goes at the start of its first file: the caller checkpoints the
    /// recovered frames before writing any.
    pub(super) fn open(
        disk: &dyn Disk,
        db: &Path,
        id: u64,
        applied: u64,
    ) -> io::Result<(Self, Recovered)> {
        let paths = Self::paths_for(db);
        let mut files = [disk.open_journal(&paths[0])?, disk.open_journal(&paths[1])?];
        let data = [files[0].read_all()?, files[1].read_all()?];
        let mut payloads = Vec::new();
        // Where each file's run of frames ended, for a file that had one.
        let mut ends = [None; 2];
        let mut last = applied;
        let starts_next = |data: &[u8], last: u64| {
            read_frame(data, 0, id).is_some_and(|(seq, _, _)| seq == last.wrapping_add(1))
        };
        while let Some(side) = (0..2).find(|&s| ends[s].is_none() && starts_next(&data[s], last)) {
            let mut at = 0;
            while let Some((seq, payload, next)) = read_frame(&data[side], at, id) {
                if seq != last.wrapping_add(1) {
                    break;
                }
                payloads.push((side, payload));
                last = seq;
                at = next;
            }
            ends[side] = Some(at);
        }
        for side in 0..2 {
            let at = ends[side].unwrap_or(0);
            if let Some((later, found_at)) = later_frame(&data[side], at, id, last) {
                return Err(damaged(
                    &paths[side],
                    last.wrapping_add(1),
                    at,
                    later,
                    found_at,
                ));
            }
        }
        let [first, second] = files;
        let journal = Self {
            files: [first, second].map(|file| JournalSide { file, end: 0 }),
            paths,
            active: 0,
            id,
            last,
            frame: Self::empty_frame(),
        };
        Ok((journal, Recovered { data, payloads }))
    }

    fn empty_frame() -> Vec<u8> {
        let mut frame = Vec::with_capacity(64 * 1024);
        frame.resize(HEAD_LEN, 0);
        frame
    }

    /// The journal's first file.
    pub(super) fn path(&self) -> &Path {
        &self.paths[0]
    }

    /// The sequence number of the last frame written.
    pub(super) fn last(&self) -> u64 {
        self.last
    }

    /// The sequence number the next frame will have.
    fn next(&self) -> u64 {
        self.last.wrapping_add(1)
    }

    /// Whether frames were written since the last checkpoint began.
    pub(super) fn has_frames(&self) -> bool {
        self.files[self.active].end > 0
    }

    /// The size of the file in use if the gathered changes were written now.
    pub(super) fn size_with_pending(&self) -> u64 {
        self.files[self.active].end + (self.frame.len() + CHECKSUM_LEN) as u64
    }

    /// Notes that `row` now holds the value `encode` appends to the buffer it is given, and
    /// returns that value as the frame holds it.
    pub(super) fn put(&mut self, row: u64, encode: impl FnOnce(&mut Vec<u8>)) -> &[u8] {
        self.frame.push(TAG_PUT);
        self.frame.extend_from_slice(&row.to_le_bytes());
        let len_at = self.frame.len();
        self.frame.extend_from_slice(&[0; 4]);
        encode(&mut self.frame);
        let value = len_at + 4;
        // A row is far below 4 GiB: the proxy bounds the responses it keeps.
        let len = (self.frame.len() - value) as u32;
        self.frame[len_at..value].copy_from_slice(&len.to_le_bytes());
        &self.frame[value..]
    }

    /// Notes that `row` was removed.
    pub(super) fn remove(&mut self, row: u64) {
        self.frame.push(TAG_REMOVE);
        self.frame.extend_from_slice(&row.to_le_bytes());
    }

    /// Drops the gathered changes.
    fn discard(&mut self) {
        self.frame.truncate(HEAD_LEN);
    }

    /// Writes the gathered changes as the next frame and syncs it.
    pub(super) fn append(&mut self) -> io::Result<()> {
        let seq = self.next();
        let payload_len = self.frame.len() - HEAD_LEN;
        let len = u32::try_from(payload_len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "journal frame too large"))?;
        self.frame[..4].copy_from_slice(MAGIC);
        self.frame[4..12].copy_from_slice(&self.id.to_le_bytes());
        self.frame[12..20].copy_from_slice(&seq.to_le_bytes());
        self.frame[20..24].copy_from_slice(&len.to_le_bytes());
        let checksum = checksum(&self.frame[4..]);
        self.frame.extend_from_slice(&checksum);
        let side = &mut self.files[self.active];
        let written = side
            .file
            .write_all_at(&self.frame, side.end)
            .and_then(|()| side.file.sync_data());
        let end = side.end + self.frame.len() as u64;
        self.discard();
        written?;
        self.files[self.active].end = end;
        self.last = seq;
        Ok(())
    }

    /// Swaps the file in use for a read-only handle of it, so the next frame fails to be
    /// written.
    #[cfg(test)]
    pub(super) fn fail_writes(&mut self) -> io::Result<()> {
        let path = &self.paths[self.active];
        self.files[self.active].file = Box::new(std::fs::File::open(path)?);
        Ok(())
    }

    /// A checkpoint of every frame written so far begins, and runs while the next frames are
    /// written: they go to the other file, from its start. Its frames are covered by the
    /// checkpoint before this one, which the caller saw finish.
    pub(super) fn begin_checkpoint(&mut self) {
        self.active ^= 1;
        self.files[self.active].end = 0;
    }

    /// Starts the journal again from the beginning of the file in use: every frame so far, in
    /// both files, and the changes gathered since, are in a durable commit.
    pub(super) fn checkpointed(&mut self) {
        self.files[self.active].end = 0;
        self.discard();
    }
}

/// The error of a journal file with a damaged frame (`missing`, expected at byte `at`) before
/// a whole one (`later`, at byte `found_at`).
fn damaged(path: &Path, missing: u64, at: usize, later: u64, found_at: usize) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!(
            "frame {missing} at byte {at} of {} is damaged or missing, yet frame {later} at \
             byte {found_at} after it is whole: applying the frames before it would silently \
             drop acknowledged changes. To start anyway, accepting the loss of frame {missing} \
             and every frame after it, cut the journal there: truncate -s {at} '{}'",
            path.display(),
            path.display(),
        ),
    )
}

/// A whole frame of database `id` at or after `from` whose sequence number is past `last`,
/// the last frame recovery read: its number and where it starts. Recovery stops at the first
/// frame that is not whole or does not follow; after a torn last frame there are only zeros or
/// frames of earlier rounds (numbered at or below the checkpoint's), so a later frame means a
/// frame in the middle was damaged.
fn later_frame(data: &[u8], from: usize, id: u64, last: u64) -> Option<(u64, usize)> {
    let rest = data.get(from..)?;
    rest.windows(MAGIC.len())
        .enumerate()
        .filter(|(_, window)| window == MAGIC)
        .find_map(|(offset, _)| {
            let at = from + offset;
            read_frame(data, at, id)
                .filter(|&(seq, _, _)| seq > last)
                .map(|(seq, _, _)| (seq, at))
        })
}

fn checksum(bytes: &[u8]) -> [u8; CHECKSUM_LEN] {
    let digest = Sha256::digest(bytes);
    let mut out = [0; CHECKSUM_LEN];
    out.copy_from_slice(&digest[..CHECKSUM_LEN]);
    out
}

/// The whole frame of database `id` at `at`, if there is one: its sequence number, where its
/// payload is, and where the next frame starts.
fn read_frame(data: &[u8], at: usize, id: u64) -> Option<(u64, Range<usize>, usize)> {
    let head = data.get(at..at.checked_add(HEAD_LEN)?)?;
    if &head[..4] != MAGIC || u64::from_le_bytes(head[4..12].try_into().ok()?) != id {
        return None;
    }
    let seq = u64::from_le_bytes(head[12..20].try_into().ok()?);
    let len = u32::from_le_bytes(head[20..24].try_into().ok()?) as usize;
    let payload_start = at + HEAD_LEN;
    let payload_end = payload_start.checked_add(len)?;
    let end = payload_end.checked_add(CHECKSUM_LEN)?;
    let stored = data.get(payload_end..end)?;
    if checksum(&data[at + 4..payload_end]) != stored {
        return None;
    }
    Some((seq, payload_start..payload_end, end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::redb::disk::RealDisk;

    /// A fresh database path in the tests' directory; its journal is removed at drop.
    struct Db(std::path::PathBuf);

    impl Db {
        fn new(label: &str) -> Self {
            Self(super::super::tests::temp_path(label))
        }
    }

    impl Drop for Db {
        fn drop(&mut self) {
            for path in Journal::paths_for(&self.0) {
                let _ = std::fs::remove_file(path);
            }
        }
    }

    fn changes(recovered: &Recovered) -> Vec<Vec<(u64, Option<Vec<u8>>)>> {
        recovered
            .frames()
            .map(|frame| {
                frame
                    .map(|change| match change.unwrap() {
                        Change::Put { row, value } => (row, Some(value.to_vec())),
                        Change::Remove { row } => (row, None),
                    })
                    .collect()
            })
            .collect()
    }

    #[test]
    fn frames_written_since_the_checkpoint_are_recovered_in_order() {
        let db = Db::new("journal-order");
        let db = &db.0;
        let (mut journal, recovered) = Journal::open(&RealDisk, db, 7, 0).unwrap();
        assert!(recovered.is_empty());
        let mut expected = db.clone().into_os_string();
        expected.push("-journal");
        assert_eq!(journal.path().as_os_str(), expected);
        journal.put(1, |out| out.extend_from_slice(b"one"));
        journal.remove(0);
        journal.append().unwrap();
        journal.put(2, |out| out.extend_from_slice(b""));
        journal.append().unwrap();
        assert_eq!(journal.last(), 2);
        drop(journal);

        let (journal, recovered) = Journal::open(&RealDisk, db, 7, 0).unwrap();
        assert_eq!(
            changes(&recovered),
            vec![
                vec![(1, Some(b"one".to_vec())), (0, None)],
                vec![(2, Some(Vec::new()))]
            ]
        );
        assert_eq!(journal.last(), 2);

        // A checkpoint covers every frame written before it, and frames after it start at the
        // journal's beginning: a first frame that does not follow the checkpoint is of an
        // earlier round. A frame past the checkpoint behind it cannot be of one, so that
        // journal does not match the file. Another database's id: nothing to apply.
        assert!(Journal::open(&RealDisk, db, 7, 1).is_err());
        assert!(Journal::open(&RealDisk, db, 7, 2).unwrap().1.is_empty());
        assert!(Journal::open(&RealDisk, db, 8, 0).unwrap().1.is_empty());
    }

    #[test]
    fn a_torn_or_stale_frame_ends_recovery() {
        let db = Db::new("journal-torn");
        let db = &db.0;
        let (mut journal, _) = Journal::open(&RealDisk, db, 1, 0).unwrap();
        for row in 0..3 {
            journal.put(row, |out| out.extend_from_slice(b"value"));
            journal.append().unwrap();
        }
        // A checkpoint, then one new frame over the first old one: the old second and third
        // frames after it are whole but belong to the previous round.
        journal.checkpointed();
        journal.put(9, |out| out.extend_from_slice(b"new"));
        journal.append().unwrap();
        drop(journal);
        let (journal, recovered) = Journal::open(&RealDisk, db, 1, 3).unwrap();
        assert_eq!(changes(&recovered), vec![vec![(9, Some(b"new".to_vec()))]]);
        assert_eq!(journal.last(), 4);

        // Any byte of that frame changed, or the frame cut short: nothing is applied.
        let path = Journal::path_for(db);
        let whole = std::fs::read(&path).unwrap();
        let frame_len = HEAD_LEN + 1 + 8 + 4 + 3 + CHECKSUM_LEN;
        for at in 0..frame_len {
            let mut torn = whole.clone();
            torn[at] ^= 0x40;
            std::fs::write(&path, &torn).unwrap();
            assert!(
                Journal::open(&RealDisk, db, 1, 3).unwrap().1.is_empty(),
                "byte {at}"
            );
        }
        std::fs::write(&path, &whole[..frame_len - 1]).unwrap();
        assert!(Journal::open(&RealDisk, db, 1, 3).unwrap().1.is_empty());
    }

    /// Frames written while a checkpoint ran go to the other file; both files' frames past
    /// the database's are recovered in order, whichever file they start in, and a file whose
    /// frames a finished checkpoint covers is written over from its start.
    #[test]
    fn frames_written_during_a_checkpoint_are_recovered_from_the_other_file() {
        let db = Db::new("journal-two-files");
        let db = &db.0;
        let put = |journal: &mut Journal, row: u64| {
            journal.put(row, |out| out.extend_from_slice(b"v"));
            journal.append().unwrap();
        };
        let (mut journal, _) = Journal::open(&RealDisk, db, 3, 0).unwrap();
        put(&mut journal, 1);
        put(&mut journal, 2);
        journal.begin_checkpoint(); // covers frames 1 and 2
        put(&mut journal, 3);
        let rows = |applied| {
            let (journal, recovered) = Journal::open(&RealDisk, db, 3, applied).unwrap();
            let rows: Vec<u64> = changes(&recovered).iter().map(|frame| frame[0].0).collect();
            (rows, journal.last())
        };
        // A crash before that checkpoint's sync: every frame; after it: the third alone.
        assert_eq!(rows(0), (vec![1, 2, 3], 3));
        assert_eq!(rows(2), (vec![3], 3));
        assert_eq!(rows(3), (vec![], 3));

        // The next checkpoint (covering frame 3) writes over the first file's old frames.
        journal.begin_checkpoint();
        put(&mut journal, 4);
        assert_eq!(rows(2), (vec![3, 4], 4));
        assert_eq!(rows(3), (vec![4], 4));
        drop(journal);

        // A damaged frame at the start of the second file, with a whole frame after it.
        let second = Journal::paths_for(db)[1].clone();
        std::fs::remove_file(&second).unwrap();
        let (mut journal, _) = Journal::open(&RealDisk, db, 9, 0).unwrap();
        put(&mut journal, 1);
        journal.begin_checkpoint();
        put(&mut journal, 2);
        put(&mut journal, 3);
        drop(journal);
        let mut bytes = std::fs::read(&second).unwrap();
        bytes[HEAD_LEN + 2] ^= 1;
        std::fs::write(&second, &bytes).unwrap();
        let error = Journal::open(&RealDisk, db, 9, 0)
            .err()
            .expect("the open fails");
        let message = error.to_string();
        assert!(message.contains("frame 2 at byte 0"), "{message}");
        assert!(message.contains(&second.display().to_string()), "{message}");
        let _ = std::fs::remove_file(&second);
    }

    /// One damaged frame followed by whole frames of the same round: the open fails, naming
    /// the journal and the damaged frame, instead of applying the frames before it alone.
    /// Cutting the journal where the error says accepts the loss.
    #[test]
    fn a_damaged_frame_before_whole_ones_stops_the_open() {
        let db = Db::new("journal-damaged-middle");
        let db = &db.0;
        let (mut journal, _) = Journal::open(&RealDisk, db, 5, 0).unwrap();
        let mut starts = Vec::new();
        for row in 0..3 {
            starts.push(journal.files[journal.active].end);
            journal.put(row, |out| out.extend_from_slice(b"value"));
            journal.append().unwrap();
        }
        drop(journal);
        let path = Journal::path_for(db);
        let whole = std::fs::read(&path).unwrap();
        // A byte of the second frame's payload, and then its magic: each damages frame 2.
        for at in [starts[1] as usize + HEAD_LEN + 2, starts[1] as usize] {
            let mut damaged = whole.clone();
            damaged[at] ^= 0x01;
            std::fs::write(&path, &damaged).unwrap();
            let error = Journal::open(&RealDisk, db, 5, 0)
                .err()
                .expect("the open fails");
            assert_eq!(error.kind(), io::ErrorKind::InvalidData);
            let message = error.to_string();
            assert!(message.contains("frame 2 at byte"), "{message}");
            assert!(message.contains("frame 3"), "{message}");
            assert!(message.contains(&path.display().to_string()), "{message}");
        }
        // A frame missing from the sequence is the same damage.
        let (mut journal, recovered) = Journal::open(&RealDisk, db, 6, 0).unwrap();
        assert!(recovered.is_empty());
        journal.put(0, |out| out.extend_from_slice(b"a"));
        journal.append().unwrap();
        journal.last = 2; // the next frame is numbered 3: frame 2 is missing
        journal.put(1, |out| out.extend_from_slice(b"b"));
        journal.append().unwrap();
        drop(journal);
        let error = Journal::open(&RealDisk, db, 6, 0)
            .err()
            .expect("the open fails");
        assert!(error.to_string().contains("frame 2 at byte"), "{error}");

        // The operator cuts the journal at the damaged frame: the frames before it apply.
        let mut damaged = whole.clone();
        damaged[starts[1] as usize + HEAD_LEN + 2] ^= 0x01;
        damaged.truncate(starts[1] as usize);
        std::fs::write(&path, &damaged).unwrap();
        let (_, recovered) = Journal::open(&RealDisk, db, 5, 0).unwrap();
        assert_eq!(
            changes(&recovered),
            vec![vec![(0, Some(b"value".to_vec()))]]
        );
    }

    #[test]
    fn a_payload_that_does_not_parse_is_an_error() {
        let mut changes = Changes {
            rest: &[TAG_PUT, 1, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, b'x'],
        };
        assert!(changes.next().unwrap().is_err());
        assert!(changes.next().is_none());
        let mut changes = Changes { rest: &[3] };
        assert!(changes.next().unwrap().is_err());
    }
}

#[cfg(test)]
mod proptests {
    use proptest::prelude::*;

    use super::*;
    use crate::record::proptests::{apply, config, mutation};
    use crate::store::redb::sim_disk::SimDisk;

    /// One row change, owned.
    #[derive(Clone, Debug, PartialEq, Eq)]
    enum Owned {
        Put(u64, Vec<u8>),
        Remove(u64),
    }

    fn change() -> impl Strategy<Value = Owned> {
        prop_oneof![
            (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..64))
                .prop_map(|(row, value)| Owned::Put(row, value)),
            any::<u64>().prop_map(Owned::Remove),
        ]
    }

    fn frames() -> impl Strategy<Value = Vec<Vec<Owned>>> {
        proptest::collection::vec(proptest::collection::vec(change(), 0..8), 0..6)
    }

    fn recovered_changes(recovered: &Recovered) -> Vec<Vec<Owned>> {
        recovered
            .frames()
            .map(|frame| {
                frame
                    .map(
                        |change| match change.expect("a whole frame's changes parse") {
                            Change::Put { row, value } => Owned::Put(row, value.to_vec()),
                            Change::Remove { row } => Owned::Remove(row),
                        },
                    )
                    .collect()
            })
            .collect()
    }

    /// The journal file's bytes after `frames` were appended to a fresh journal of `id`.
    fn written(disk: &SimDisk, db: &Path, id: u64, frames: &[Vec<Owned>]) -> Vec<u8> {
        let (mut journal, _) = Journal::open(disk, db, id, 0).unwrap();
        for frame in frames {
            for change in frame {
                match change {
                    Owned::Put(row, value) => {
                        journal.put(*row, |out| out.extend_from_slice(value));
                    }
                    Owned::Remove(row) => journal.remove(*row),
                }
            }
            journal.append().unwrap();
        }
        drop(journal);
        disk.open_journal(&Journal::path_for(db))
            .unwrap()
            .read_all()
            .unwrap()
    }

    /// Opens a journal whose file holds `bytes`.
    fn open_bytes(disk: &SimDisk, db: &Path, id: u64, bytes: &[u8]) -> io::Result<Recovered> {
        disk.open_journal(&Journal::path_for(db))
            .unwrap()
            .write_all_at(bytes, 0)
            .unwrap();
        Journal::open(disk, db, id, 0).map(|(_, recovered)| recovered)
    }

    proptest! {
        #![proptest_config(config())]

        /// decode(encode(x)) = x: every frame written is recovered, in order, change by change.
        #[test]
        fn every_frame_written_is_recovered(frames in frames(), id in any::<u64>()) {
            let disk = SimDisk::default();
            let db = Path::new("/sim/journal/db.redb");
            written(&disk, db, id, &frames);
            let (journal, recovered) = Journal::open(&disk, db, id, 0).unwrap();
            prop_assert_eq!(journal.last(), frames.len() as u64);
            prop_assert_eq!(recovered_changes(&recovered), frames);
        }

        /// A damaged journal never panics the open; what it recovers is a prefix of the frames
        /// written (a damaged frame is never read as another), or the open fails.
        #[test]
        fn a_damaged_journal_recovers_a_prefix_or_fails(
            frames in frames(),
            mutations in proptest::collection::vec(mutation(), 1..4),
        ) {
            let disk = SimDisk::default();
            let written_bytes = written(&disk, Path::new("/sim/journal/a.redb"), 9, &frames);
            let mut damaged = written_bytes;
            for m in &mutations {
                apply(&mut damaged, m);
            }
            if let Ok(recovered) = open_bytes(&disk, Path::new("/sim/journal/b.redb"), 9, &damaged) {
                let got = recovered_changes(&recovered);
                prop_assert!(got.len() <= frames.len());
                prop_assert_eq!(&got[..], &frames[..got.len()]);
            }
        }

        /// Arbitrary bytes as a journal never panic the open.
        #[test]
        fn arbitrary_bytes_never_panic_the_open(
            bytes in proptest::collection::vec(any::<u8>(), 0..512),
            id in any::<u64>(),
        ) {
            let disk = SimDisk::default();
            if let Ok(recovered) = open_bytes(&disk, Path::new("/sim/journal/c.redb"), id, &bytes) {
                for frame in recovered.frames() {
                    frame.for_each(drop);
                }
            }
        }
    }
}
