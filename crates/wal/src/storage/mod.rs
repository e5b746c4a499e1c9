//! The storage layer: every byte the log reads or writes goes through [`Storage`].
//!
//! Two implementations: [`FsStorage`], the real file system, and (with the `sim` feature
//! or in this crate's tests) [`SimStorage`], a simulated disk that keeps, per file, what
//! was written and what was made durable, and can lose power, tear unsynced writes and
//! fail any chosen operation. The log is written against the trait only, so every crash
//! and fault the simulation can produce is one the log has been tested against.
//! [`HookedStorage`] (same feature) wraps either with a test's own change to some calls
//! (a slow write, a held sync, a counted read).
//!
//! The contract the log relies on (and that the simulation enforces, see `sim.rs`):
//! - `StorageFile::sync_data` makes the file's written bytes and length durable. Until
//!   then a power loss may keep, drop, zero or garble any unsynced sector.
//! - A directory entry (create, rename, remove) is durable only after `sync_dir` on its
//!   directory; until then a power loss may undo it. That holds for directories too: a
//!   directory `create_dir_all` made survives a power loss only once its parent was
//!   synced, and [`create_dir_all_durably`] is how the log creates one (or opens one
//!   that exists: an earlier run may have stopped before that sync).
//! - A failed `sync_data` says nothing about what is durable: the caller must not treat a
//!   later successful sync as covering the earlier writes.

mod fs;
#[cfg(any(test, feature = "sim"))]
pub mod hooked;
#[cfg(any(test, feature = "sim"))]
pub mod sim;

use std::fmt::Debug;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use fs::FsStorage;
#[cfg(any(test, feature = "sim"))]
pub use hooked::{HoldSyncs, HookedStorage, Hooks, SyncsHeld};
#[cfg(any(test, feature = "sim"))]
pub use sim::{CrashMode, FaultOp, SimStorage};

/// How a file is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpenMode {
    /// Existing file, reads only.
    Read,
    /// Existing file, reads and writes.
    ReadWrite,
    /// A new file for reads and writes; fails if the name exists.
    CreateNew,
}

/// A directory of files, as the log needs it.
pub trait Storage: Send + Sync + Debug {
    /// Creates `dir` and its missing parents; returns the directories it created,
    /// outermost first. Each is durable only after `sync_dir` of its parent (see
    /// [`create_dir_all_durably`]).
    fn create_dir_all(&self, dir: &Path) -> io::Result<Vec<PathBuf>>;
    /// Names (not paths) of the plain files in `dir`, in no particular order. An entry
    /// named as a segment that is not a plain file (a symbolic link, a directory) is an
    /// error (`InvalidData`), never left out: the log would take that segment for
    /// missing.
    fn list_dir(&self, dir: &Path) -> io::Result<Vec<String>>;
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Arc<dyn StorageFile>>;
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Makes the creations, renames and removals of entries in `dir` durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Takes an exclusive, advisory lock named by `path` without waiting; fails with
    /// `ErrorKind::WouldBlock` while another holder has it. Dropping the guard releases it.
    fn try_lock(&self, path: &Path) -> io::Result<Box<dyn Send + Sync>>;
    /// Whether a holder (in any process) has the lock named by `path` now, found out
    /// without taking it, creating the file or changing anything. `false` when the file
    /// does not exist.
    fn is_locked(&self, path: &Path) -> io::Result<bool>;
}

/// One open file.
#[allow(clippy::len_without_is_empty)] // a file's length is a size, not a collection's
pub trait StorageFile: Send + Sync + Debug {
    /// Reads up to `buf.len()` bytes at `pos`; fewer only at the end of the file.
    fn read_at(&self, buf: &mut [u8], pos: u64) -> io::Result<usize>;
    fn write_all_at(&self, buf: &[u8], pos: u64) -> io::Result<()>;
    /// `fdatasync`: the written bytes and the length become durable.
    fn sync_data(&self) -> io::Result<()>;
    fn len(&self) -> io::Result<u64>;
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// Drops what the page cache holds of this file that is clean, so that the next
    /// reads of it come from the disk. After a failed sync the kernel marks the pages it
    /// could not write clean: they read back, but the disk never got them. Dirty pages
    /// (written, not yet synced, never failed) are kept. Advisory: an error changes no
    /// byte of the file.
    fn drop_cached(&self) -> io::Result<()>;
}

/// Creates `dir` and its missing parents so that they survive a power loss: `dir` and
/// every ancestor, innermost first, is synced (its entries: the next one down among
/// them), whether or not this call created it. Without this, a power loss after the
/// first writes could take a new log directory away whole, with everything synced
/// inside it; and a directory that already exists may be one an earlier run created and
/// stopped (killed, or failed) before syncing its parent, so existing is no proof that
/// its entry is durable. A directory this call did not create whose sync is refused for
/// want of permission (it can be written and searched without being readable) is
/// passed over; `dir` itself, every directory created now, and any other error fail.
pub fn create_dir_all_durably(storage: &dyn Storage, dir: &Path) -> io::Result<()> {
    let created = storage.create_dir_all(dir)?;
    // A relative path's outermost directory has the empty path as its parent.
    let chain = dir.ancestors().map(|p| if p.as_os_str().is_empty() { Path::new(".") } else { p });
    for p in chain {
        match storage.sync_dir(p) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied && p != dir && !created.iter().any(|c| c == p) => {}
            Err(e) => return Err(io::Error::new(e.kind(), format!("syncing directory {}: {e}", p.display()))),
        }
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes at `pos`, or fails with `UnexpectedEof`.
pub fn read_exact_at(file: &dyn StorageFile, mut buf: &mut [u8], mut pos: u64) -> io::Result<()> {
    while !buf.is_empty() {
        let n = file.read_at(buf, pos)?;
        if n == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        buf = &mut buf[n..];
        pos += n as u64;
    }
    Ok(())
}

/// Reads as many bytes as exist at `pos`, up to `buf.len()`; returns how many.
pub fn read_up_to_at(file: &dyn StorageFile, buf: &mut [u8], pos: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let n = file.read_at(&mut buf[done..], pos + done as u64)?;
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(done)
}

/// A read buffer over one file: a window of its bytes, loaded a chunk at a time, so that
/// many small reads (frame headers, payloads) cost one `read_at` per chunk.
///
/// Invariants: the window holds exactly the bytes read from the file at its position;
/// a read that fails leaves the window empty (what a failed transfer wrote into the
/// buffer is never served); the buffer only grows, so it is zeroed once, not per read.
#[derive(Debug)]
pub(crate) struct ReadBuffer {
    chunk_bytes: usize,
    buf: Vec<u8>,
    /// Bytes of `buf` that hold the file's bytes from `pos`.
    len: usize,
    pos: u64,
}

impl ReadBuffer {
    pub(crate) fn new(chunk_bytes: usize) -> ReadBuffer {
        ReadBuffer { chunk_bytes, buf: Vec::new(), len: 0, pos: 0 }
    }

    /// Frees the window's memory; the next [`ReadBuffer::get`] reads a chunk again.
    pub(crate) fn release(&mut self) {
        self.buf = Vec::new();
        self.len = 0;
    }

    /// The `n` bytes of `file` at `pos`, reading a chunk (but nothing at or past `end`)
    /// when the window does not hold them; `None` if they do not all lie before `end`,
    /// or the file ends first.
    pub(crate) fn get(&mut self, file: &dyn StorageFile, pos: u64, n: usize, end: u64) -> io::Result<Option<&[u8]>> {
        let held = pos >= self.pos && pos + n as u64 <= self.pos + self.len as u64;
        if !held {
            if pos.checked_add(n as u64).is_none_or(|last| last > end) {
                return Ok(None);
            }
            let want = n.max(self.chunk_bytes).min((end - pos) as usize);
            if self.buf.len() < want {
                self.buf.resize(want, 0);
            }
            self.len = 0;
            self.len = read_up_to_at(file, &mut self.buf[..want], pos)?;
            self.pos = pos;
            if self.len < n {
                return Ok(None);
            }
        }
        let at = (pos - self.pos) as usize;
        Ok(Some(&self.buf[at..at + n]))
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::storage::sim::{FaultOp, SimStorage};

    /// After a read that failed (the simulated disk fills half the buffer with garbage),
    /// the window serves nothing of it: the same bytes are read again, intact.
    #[test]
    fn a_failed_read_leaves_nothing_in_the_window() {
        let s = SimStorage::new();
        s.create_dir_all(Path::new("/d")).unwrap();
        let f = s.open(Path::new("/d/f"), OpenMode::CreateNew).unwrap();
        let bytes: Vec<u8> = (0..200u8).collect();
        f.write_all_at(&bytes, 0).unwrap();
        let mut w = ReadBuffer::new(64);
        assert_eq!(w.get(&*f, 10, 4, 200).unwrap(), Some(&bytes[10..14]));
        s.fail_nth(FaultOp::Read, 1, io::ErrorKind::Other);
        assert!(w.get(&*f, 100, 8, 200).is_err());
        // Bytes the window held before the failed read, now overwritten in its buffer.
        assert_eq!(w.get(&*f, 20, 4, 200).unwrap(), Some(&bytes[20..24]));
        assert_eq!(w.get(&*f, 100, 8, 200).unwrap(), Some(&bytes[100..108]));
        assert_eq!(w.get(&*f, 104, 2, 200).unwrap(), Some(&bytes[104..106]), "served from the window");
        assert_eq!(w.get(&*f, 196, 8, 200).unwrap(), None, "past the end");
    }
}
