//! The redb store's file I/O behind one seam: the real file system, and in tests a double
//! (`sim_disk`) that fails a sync and loses unsynced writes at a simulated power cut.
//!
//! What the store needs of the file system for its promise, beyond reads and writes:
//!
//! - **A created file stays created.** A new file (and a new directory) is a directory entry,
//!   durable only once its directory is synced: the store syncs the directory after it creates
//!   the database file, the journal and any missing folder, before it acknowledges anything.
//! - **A failed sync is never trusted.** Linux marks the pages of a failed `fdatasync` clean:
//!   they stay in the page cache with data that may never reach the disk, and a later read
//!   (in this process or the next) returns it as if it were there. Every open of the file
//!   (at start, after a failure, for a read view) first drops both files' cached pages
//!   ([`Disk::forget_cached`]), so what it reads is what the disk holds.
//!
//! The file system calls are Linux's where the promise depends on them (dropping cached pages);
//! elsewhere the store builds and runs with what the platform offers: positioned writes
//! through the file's cursor where there are none, no directory sync where a directory cannot
//! be opened (Windows, whose file system journals its entries), and no cache drop where there
//! is no `posix_fadvise`.

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use redb::{Database, DatabaseError};

/// The file system under a store.
pub(super) trait Disk: fmt::Debug + Send + Sync + 'static {
    /// Opens the database file at `path` with `builder`, creating it if missing.
    fn create_database(
        &self,
        builder: &redb::Builder,
        path: &Path,
    ) -> Result<Database, DatabaseError>;

    /// Opens the journal file at `path` for reading and writing, creating it if missing.
    fn open_journal(&self, path: &Path) -> io::Result<Box<dyn JournalFile>>;

    /// Creates `dir` and its missing parents; returns the directories it made, outermost first.
    fn create_dir_all(&self, dir: &Path) -> io::Result<Vec<PathBuf>>;

    /// Makes the entries of directory `dir` durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;

    /// Drops the cached pages of the file at `path` (a missing file is fine), so the next
    /// read of it comes from the disk.
    fn forget_cached(&self, path: &Path) -> io::Result<()>;
}

/// The journal's file.
pub(super) trait JournalFile: Send {
    /// The whole file.
    fn read_all(&mut self) -> io::Result<Vec<u8>>;

    /// Writes `data` at `offset`.
    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()>;

    /// Makes what was written durable.
    fn sync_data(&self) -> io::Result<()>;
}

impl JournalFile for File {
    fn read_all(&mut self) -> io::Result<Vec<u8>> {
        let mut data = Vec::new();
        io::Seek::rewind(self)?;
        self.read_to_end(&mut data)?;
        Ok(data)
    }

    #[cfg(unix)]
    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, data, offset)
    }

    /// Without `pwrite`: through the file's cursor (the journal has one writer).
    #[cfg(not(unix))]
    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        use std::io::{Seek, SeekFrom, Write};
        let mut file = self;
        file.seek(SeekFrom::Start(offset))?;
        file.write_all(data)
    }

    fn sync_data(&self) -> io::Result<()> {
        File::sync_data(self)
    }
}

/// The real file system.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RealDisk;

impl Disk for RealDisk {
    fn create_database(
        &self,
        builder: &redb::Builder,
        path: &Path,
    ) -> Result<Database, DatabaseError> {
        builder.create(path)
    }

    fn open_journal(&self, path: &Path) -> io::Result<Box<dyn JournalFile>> {
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        Ok(Box::new(file))
    }

    fn create_dir_all(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let mut missing: Vec<PathBuf> = dir
            .ancestors()
            .filter(|d| !d.as_os_str().is_empty())
            .take_while(|d| !d.exists())
            .map(Path::to_path_buf)
            .collect();
        missing.reverse();
        std::fs::create_dir_all(dir)?;
        Ok(missing)
    }

    #[cfg(not(windows))]
    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    /// A directory cannot be opened as a file on Windows; NTFS journals its entries itself.
    #[cfg(windows)]
    fn sync_dir(&self, _dir: &Path) -> io::Result<()> {
        Ok(())
    }

    #[cfg(any(target_os = "linux", target_os = "android"))]
    fn forget_cached(&self, path: &Path) -> io::Result<()> {
        let file = match File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        // After a failed sync no page of the file is dirty (the kernel marked them clean), and
        // the store's file backend does not map the file, so every cached page is dropped.
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed)?;
        Ok(())
    }

    /// No `posix_fadvise` to drop cached pages with: the file is read as the cache holds it.
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    fn forget_cached(&self, _path: &Path) -> io::Result<()> {
        Ok(())
    }
}

/// The directory `path` is in (`.` for a bare file name).
pub(super) fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    }
}
