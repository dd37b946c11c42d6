//! A file system double for the redb store's fault tests: it keeps, for every file, what the
//! page cache holds and what the disk holds, and behaves as Linux does where the store's
//! promise depends on it.
//!
//! - A write lands in the cache and marks its pages dirty; a sync writes the dirty pages to
//!   the disk (and only those).
//! - Syncs of a file can be held ([`SimDisk::hold_syncs`]) until the test releases them: a
//!   slow disk, to act while a sync is under way.
//! - A sync armed to fail ([`SimDisk::fail_next_sync`]) writes nothing to the disk and marks
//!   the dirty pages clean, as Linux does: the cache keeps data the disk never got, and a later
//!   read returns it unless the cache is dropped ([`Disk::forget_cached`] drops clean pages).
//! - A new file or directory is an entry in its directory, durable once that directory is
//!   synced.
//! - A power cut ([`SimDisk::power_cut`]) leaves what the disk holds: entries never synced are
//!   gone, every file is what its syncs wrote, and files opened before the cut take no more
//!   reads or writes (their process is gone).
//!
//! Paths are under `/sim`, which exists; directories under it exist once made through the
//! double.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use redb::{Database, DatabaseError, StorageBackend};

use super::disk::{Disk, JournalFile};

const PAGE: usize = 4096;

#[derive(Debug, Clone, Default)]
pub(super) struct SimDisk {
    state: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    files: HashMap<PathBuf, SimFile>,
    /// Directories made through the double, with whether their entry is durable. Any other
    /// directory is taken to exist, durably.
    dirs: HashMap<PathBuf, bool>,
    /// Files whose next sync fails.
    failing: HashSet<PathBuf>,
    /// Files whose syncs wait until their hold is released.
    held: HashMap<PathBuf, SyncHold>,
    /// Power cuts so far: a file opened before the last one is dead.
    generation: u64,
}

#[derive(Debug, Default)]
struct SimFile {
    cached: Vec<u8>,
    durable: Vec<u8>,
    /// Pages of `cached` not yet synced.
    dirty: BTreeSet<usize>,
    /// Whether the file's entry in its directory is durable.
    linked: bool,
}

impl SimFile {
    fn write(&mut self, offset: usize, data: &[u8]) {
        let end = offset + data.len();
        if self.cached.len() < end {
            self.set_len(end);
        }
        self.cached[offset..end].copy_from_slice(data);
        self.mark_dirty(offset, end);
    }

    fn set_len(&mut self, len: usize) {
        let old = self.cached.len();
        self.cached.resize(len, 0);
        self.mark_dirty(old.min(len), old.max(len));
    }

    fn mark_dirty(&mut self, from: usize, to: usize) {
        if to > from {
            self.dirty.extend(from / PAGE..=(to - 1) / PAGE);
        }
    }
}

/// Holds the syncs of one file until released (or, so a test of a store that waits for the
/// sync does not hang, for [`SyncHold::LIMIT`]).
#[derive(Debug, Clone, Default)]
pub(super) struct SyncHold {
    inner: Arc<(Mutex<Held>, Condvar)>,
}

#[derive(Debug, Default)]
struct Held {
    released: bool,
    /// Syncs waiting now.
    waiting: usize,
}

impl SyncHold {
    /// Longest a sync is held.
    const LIMIT: Duration = Duration::from_secs(5);

    /// Lets the held syncs, and every later one, go on.
    pub(super) fn release(&self) {
        let (held, changed) = &*self.inner;
        held.lock().expect("the hold's lock").released = true;
        changed.notify_all();
    }

    /// Whether a sync is waiting now.
    pub(super) fn holding(&self) -> bool {
        self.inner.0.lock().expect("the hold's lock").waiting > 0
    }

    /// Waits (up to the hold's limit) until a sync is held; whether one is.
    pub(super) fn wait_held(&self) -> bool {
        let (held, changed) = &*self.inner;
        let held = held.lock().expect("the hold's lock");
        let (held, _) = changed
            .wait_timeout_while(held, Self::LIMIT, |held| held.waiting == 0)
            .expect("the hold's lock");
        held.waiting > 0
    }

    fn hold(&self) {
        let (held, changed) = &*self.inner;
        let mut guard = held.lock().expect("the hold's lock");
        guard.waiting += 1;
        changed.notify_all();
        let (mut guard, _) = changed
            .wait_timeout_while(guard, Self::LIMIT, |held| !held.released)
            .expect("the hold's lock");
        guard.waiting -= 1;
    }
}

impl SimDisk {
    /// Holds every sync of the file at `path` until the returned hold is released.
    pub(super) fn hold_syncs(&self, path: &Path) -> SyncHold {
        let hold = SyncHold::default();
        self.state().held.insert(path.to_path_buf(), hold.clone());
        hold
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("the simulated disk's lock")
    }

    /// Makes the next sync of the file at `path` fail.
    pub(super) fn fail_next_sync(&self, path: &Path) {
        self.state().failing.insert(path.to_path_buf());
    }

    /// Cuts the power: only what reached the disk is left.
    pub(super) fn power_cut(&self) {
        let mut state = self.state();
        state.dirs.retain(|_, durable| *durable);
        let dirs: HashSet<PathBuf> = state.dirs.keys().cloned().collect();
        let vanished = |path: &Path| {
            path.ancestors().skip(1).any(|dir| {
                !dirs.contains(dir) && dir.starts_with("/sim") && dir != Path::new("/sim")
            })
        };
        state
            .files
            .retain(|path, file| file.linked && !vanished(path));
        for file in state.files.values_mut() {
            file.cached = file.durable.clone();
            file.dirty.clear();
        }
        state.failing.clear();
        state.generation += 1;
    }

    fn with_file<T>(
        &self,
        generation: u64,
        path: &Path,
        f: impl FnOnce(&mut SimFile) -> T,
    ) -> io::Result<T> {
        let mut state = self.state();
        if generation != state.generation {
            return Err(io::Error::other("the power was cut"));
        }
        let file = state
            .files
            .get_mut(path)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such simulated file"))?;
        Ok(f(file))
    }

    /// Opens the file at `path`, creating it if missing.
    fn open(&self, path: &Path) -> SimBackend {
        let mut state = self.state();
        state.files.entry(path.to_path_buf()).or_default();
        SimBackend {
            disk: self.clone(),
            path: path.to_path_buf(),
            generation: state.generation,
        }
    }

    fn sync(&self, generation: u64, path: &Path) -> io::Result<()> {
        let hold = self.state().held.get(path).cloned();
        if let Some(hold) = hold {
            hold.hold();
        }
        let mut state = self.state();
        if generation != state.generation {
            return Err(io::Error::other("the power was cut"));
        }
        let failing = state.failing.remove(path);
        let file = state
            .files
            .get_mut(path)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no such simulated file"))?;
        if failing {
            // Linux marks the pages of a failed writeback clean: the disk has none of them.
            file.dirty.clear();
            return Err(io::Error::other("injected sync failure"));
        }
        // Clean pages are taken to be on the disk already: a page whose write a failed sync
        // lost is not written again.
        file.durable.resize(file.cached.len(), 0);
        for page in std::mem::take(&mut file.dirty) {
            let range = page * PAGE..((page + 1) * PAGE).min(file.cached.len());
            if range.start < range.end {
                file.durable[range.clone()].copy_from_slice(&file.cached[range]);
            }
        }
        Ok(())
    }
}

impl Disk for SimDisk {
    fn create_database(
        &self,
        builder: &redb::Builder,
        path: &Path,
    ) -> Result<Database, DatabaseError> {
        builder.create_with_backend(self.open(path))
    }

    fn open_journal(&self, path: &Path) -> io::Result<Box<dyn JournalFile>> {
        Ok(Box::new(self.open(path)))
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let mut state = self.state();
        let mut made: Vec<PathBuf> = dir
            .ancestors()
            .filter(|d| d.starts_with("/sim") && *d != Path::new("/sim"))
            .filter(|d| !state.dirs.contains_key(*d))
            .map(Path::to_path_buf)
            .collect();
        made.reverse();
        for d in &made {
            state.dirs.insert(d.clone(), false);
        }
        Ok(made)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.state();
        for (path, file) in state.files.iter_mut() {
            if path.parent() == Some(dir) {
                file.linked = true;
            }
        }
        for (path, durable) in state.dirs.iter_mut() {
            if path.parent() == Some(dir) {
                *durable = true;
            }
        }
        Ok(())
    }

    fn forget_cached(&self, path: &Path) -> io::Result<()> {
        let mut state = self.state();
        let Some(file) = state.files.get_mut(path) else {
            return Ok(());
        };
        let mut cached = file.durable.clone();
        let len = file
            .dirty
            .last()
            .map_or(0, |&page| ((page + 1) * PAGE).min(file.cached.len()));
        if cached.len() < len {
            cached.resize(len, 0);
        }
        for &page in &file.dirty {
            let range = page * PAGE..((page + 1) * PAGE).min(file.cached.len());
            if range.start < range.end {
                cached[range.clone()].copy_from_slice(&file.cached[range]);
            }
        }
        file.cached = cached;
        Ok(())
    }
}

/// One open simulated file: a redb backend or the journal's file.
#[derive(Debug)]
struct SimBackend {
    disk: SimDisk,
    path: PathBuf,
    generation: u64,
}

impl SimBackend {
    fn with_file<T>(&self, f: impl FnOnce(&mut SimFile) -> T) -> io::Result<T> {
        self.disk.with_file(self.generation, &self.path, f)
    }
}

impl StorageBackend for SimBackend {
    fn len(&self) -> io::Result<u64> {
        self.with_file(|f| f.cached.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        let offset = offset as usize;
        self.with_file(|f| {
            let end = offset + out.len();
            match f.cached.get(offset..end) {
                Some(bytes) => {
                    out.copy_from_slice(bytes);
                    Ok(())
                }
                None => Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "read past the simulated file's end",
                )),
            }
        })?
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.with_file(|f| f.set_len(len as usize))
    }

    fn sync_data(&self) -> io::Result<()> {
        self.disk.sync(self.generation, &self.path)
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.with_file(|f| f.write(offset as usize, data))
    }
}

impl JournalFile for SimBackend {
    fn read_all(&mut self) -> io::Result<Vec<u8>> {
        self.with_file(|f| f.cached.clone())
    }

    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        StorageBackend::write(self, offset, data)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.disk.sync(self.generation, &self.path)
    }
}
