//! The durable watermark: how a read-only opener beside a live writer knows which bytes
//! are synced.
//!
//! A read-only opener cannot tell, from the files alone, bytes a live writer has written
//! but not yet synced from synced ones: both read back the same and both check. So after
//! every successful sync the writer thread publishes what that sync made durable (the
//! active segment, its durable length, the next offset) into `durable-watermark`, with one
//! positioned write of 40 bytes and no sync. A read-only opener that finds the writer's
//! lock held reads no segment byte past it.
//!
//! Invariants:
//! - The writer publishes a watermark only after the sync it describes succeeded, so a
//!   watermark never names an unsynced byte; it may lag (a failed publish, a torn read),
//!   never lead.
//! - A writable open removes any earlier watermark right after taking the lock (voids it
//!   in place, and later takes the file over, when it cannot be removed), and publishes
//!   its own only once recovery is done: a reader never bounds itself by a previous
//!   process's state while a new writer recovers.
//! - It is advisory. It is never synced and recovery never reads it; a read-only opener
//!   uses it only while the writer's lock is held (tested without taking it,
//!   `Storage::is_locked`). A missing, unreadable or torn record with the lock held makes
//!   the reader wait briefly and then fail, never read unbounded.
//! - A failed publish never fails an append: the log's durability does not depend on it.

use std::path::Path;
use std::sync::Arc;

use crate::error::{Result, WalError};
use crate::format::{DurableWatermark, WATERMARK_LEN};
use crate::storage::{OpenMode, Storage, StorageFile, read_up_to_at};
use crate::{LOCK_FILE, WATERMARK_FILE};

/// The writer's side: one open file, rewritten in place after each sync.
#[derive(Debug)]
pub(crate) struct Publisher {
    file: Arc<dyn StorageFile>,
    warned: bool,
}

impl Publisher {
    /// Creates a fresh watermark file, or takes over one an earlier process left that
    /// [`invalidate`] (run by the open right after taking the lock) could not remove.
    /// `None`, with a warning, if neither can be done: the log works without it, and
    /// readers beside this writer then refuse instead of guessing (they find no whole
    /// watermark).
    pub(crate) fn create(storage: &dyn Storage, dir: &Path) -> Option<Publisher> {
        let path = dir.join(WATERMARK_FILE);
        let opened = match storage.open(&path, OpenMode::CreateNew) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => storage.open(&path, OpenMode::ReadWrite),
            opened => opened,
        };
        match opened {
            Ok(file) => Some(Publisher { file, warned: false }),
            Err(e) => {
                tracing::warn!(error = %e, path = %path.display(), "cannot create the durable watermark; read-only tools will refuse this log while it runs");
                None
            }
        }
    }

    /// Publishes what the last successful sync made durable.
    pub(crate) fn publish(&mut self, w: DurableWatermark) {
        if let Err(e) = self.file.write_all_at(&w.encode(), 0)
            && !self.warned
        {
            self.warned = true;
            tracing::warn!(error = %e, "cannot publish the durable watermark; read-only tools see an older state");
        }
    }
}

/// Removes an earlier process's watermark, or, when it cannot be removed, voids it (its
/// record overwritten with zeros, which never check): a reader beside this writer then
/// finds no whole watermark until this writer publishes its own, and refuses rather
/// than bound itself by the earlier process's state. Best effort: a watermark left
/// whole is only ever read while a writer holds the lock, and never names more than
/// that earlier writer synced.
pub(crate) fn invalidate(storage: &dyn Storage, dir: &Path) {
    let path = dir.join(WATERMARK_FILE);
    match storage.remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            let voided = storage.open(&path, OpenMode::ReadWrite).and_then(|f| f.write_all_at(&[0; WATERMARK_LEN], 0));
            match voided {
                Ok(()) => tracing::warn!(error = %e, "cannot remove an earlier durable watermark; voided it in place"),
                Err(v) => tracing::warn!(
                    error = %e,
                    void_error = %v,
                    "cannot remove or void an earlier durable watermark; read-only tools beside this writer may see \
                     the log as the earlier process left it until this one publishes its own"
                ),
            }
        }
    }
}

/// What a read-only opener must respect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bound {
    /// No writer holds the log: everything that checks may be read.
    None,
    /// A writer holds the log: read nothing past this.
    Watermark(DurableWatermark),
}

/// Reads the bound for a read-only open of `dir`. `Err(Unsettled)` when a writer holds
/// the lock but no whole watermark can be read (the caller retries, then gives up).
pub(crate) fn read_bound(storage: &dyn Storage, dir: &Path) -> Result<Bound> {
    let lock = dir.join(LOCK_FILE);
    let held = storage.is_locked(&lock).map_err(|e| WalError::io(&lock, e))?;
    if !held {
        return Ok(Bound::None);
    }
    let path = dir.join(WATERMARK_FILE);
    let file = match storage.open(&path, OpenMode::Read) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(unsettled(
                dir,
                "the running writer has not published a durable watermark yet (a writer past its start that still \
                 has none could not create the file, as its log says: this log is then read only once it stops)",
            ));
        }
        Err(e) => return Err(WalError::io(&path, e)),
    };
    let mut b = [0u8; WATERMARK_LEN];
    let got = read_up_to_at(&*file, &mut b, 0).map_err(|e| WalError::io(&path, e))?;
    match DurableWatermark::decode(&b[..got]) {
        Some(w) => Ok(Bound::Watermark(w)),
        None => Err(unsettled(dir, "the durable watermark did not check (read during an update)")),
    }
}

/// How long a read-only reader beside a starting or busy writer keeps retrying.
const UNSETTLED_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs `read` under the bound a read-only reader of `dir` must respect (see
/// [`read_bound`]), and voids a read that a writer started during (see
/// [`confirm_unbounded`]), or, with no writer at its start, one that a writer took the
/// log during and let go of again (a daemon started and stopped: it holds the lock at
/// neither check, and shows in the log's [`Footprint`]). While the log is unsettled (the
/// watermark absent for a moment, naming a segment that moved on, or a writer that took
/// the lock during the read), reads again, for up to 5 s, then returns `Err(Unsettled)`.
pub(crate) fn read_settled<T>(
    storage: &dyn Storage,
    dir: &Path,
    mut read: impl FnMut(Bound) -> Result<T>,
) -> Result<T> {
    let deadline = std::time::Instant::now() + UNSETTLED_RETRY_FOR;
    loop {
        let attempt = read_bound(storage, dir).and_then(|bound| {
            // A directory that is not there is for the read to name (not a log); any
            // other failure to take the footprint is the read's failure too (an I/O
            // error, never a read that goes on unchecked).
            let before = match bound {
                Bound::None => match footprint(storage, dir) {
                    Ok(f) => Some(f),
                    Err(WalError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => None,
                    Err(e) => return Err(e),
                },
                Bound::Watermark(_) => None,
            };
            // A read that failed is void too if a writer started under it: the file it
            // could not read may be one the writer's recovery removed (the clean-shutdown
            // marker) or changed, not damage.
            let value = read(bound).map_err(|e| unsettled_or(storage, dir, bound, e));
            if let Some(before) = before
                && footprint(storage, dir).is_ok_and(|now| now != before)
            {
                return Err(unsettled(dir, "a writer took the log and let it go again while it was being read"));
            }
            let value = value?;
            confirm_unbounded(storage, dir, bound)?;
            Ok(value)
        });
        match attempt {
            Err(WalError::Unsettled { .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

/// What a read under `bound` that failed with `e` reports: `Unsettled` if a writer took
/// the lock during it (the failure may be the writer's doing: a file its recovery removed
/// or changed), else `e` itself (also when the lock cannot be checked).
pub(crate) fn unsettled_or(storage: &dyn Storage, dir: &Path, bound: Bound, e: WalError) -> WalError {
    match confirm_unbounded(storage, dir, bound) {
        Err(unsettled @ WalError::Unsettled { .. }) => unsettled,
        _ => e,
    }
}

/// After a read under `bound`: with no writer then (`Bound::None`), one that took the
/// lock since may have recovered, cut or appended unsynced bytes under the read, so the
/// read does not stand; `Err(Unsettled)` (the caller reads again, bounded by the
/// watermark this time, or gives up).
pub(crate) fn confirm_unbounded(storage: &dyn Storage, dir: &Path, bound: Bound) -> Result<()> {
    let lock = dir.join(LOCK_FILE);
    if bound == Bound::None && storage.is_locked(&lock).map_err(|e| WalError::io(&lock, e))? {
        return Err(unsettled(dir, "a writer took the log while it was being read"));
    }
    Ok(())
}

/// What a writer that took the log and let it go again leaves changed, read with no
/// writer holding it: each segment file's name and length, and the bytes of the
/// clean-shutdown marker and of the watermark. Every writable open removes the
/// watermark and makes a new one, which names what it synced; a clean close writes the
/// marker, which names the tail's length. So a writer that appended between two
/// footprints (holding the lock at neither, which [`confirm_unbounded`] alone cannot
/// see) changes one of them; one that appended nothing may change none, and then
/// nothing a read made between them could have missed.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Footprint(Vec<(String, Vec<u8>)>);

/// The largest of the two small files a footprint reads whole (the marker and the
/// watermark are tens of bytes).
const FOOTPRINT_FILE_MAX_BYTES: usize = 4096;

pub(crate) fn footprint(storage: &dyn Storage, dir: &Path) -> Result<Footprint> {
    let mut names = storage.list_dir(dir).map_err(|e| WalError::io(dir, e))?;
    names.sort();
    let mut out = Vec::new();
    for name in names {
        let whole = name == crate::CLEAN_MARKER_FILE || name == WATERMARK_FILE;
        if !whole && crate::format::parse_segment_file_name(&name).is_none() {
            continue;
        }
        let path = dir.join(&name);
        let file = match storage.open(&path, OpenMode::Read) {
            Ok(f) => f,
            // Removed since the listing: the change shows as the name missing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(WalError::io(&path, e)),
        };
        let what = if whole {
            let mut b = vec![0u8; FOOTPRINT_FILE_MAX_BYTES];
            let got = read_up_to_at(&*file, &mut b, 0).map_err(|e| WalError::io(&path, e))?;
            b.truncate(got);
            b
        } else {
            file.len().map_err(|e| WalError::io(&path, e))?.to_le_bytes().to_vec()
        };
        out.push((name, what));
    }
    Ok(Footprint(out))
}

pub(crate) fn unsettled(dir: &Path, why: &str) -> WalError {
    WalError::Unsettled { dir: dir.to_path_buf(), why: why.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::SimStorage;
    use crate::{Wal, WalOptions};

    /// A writer that takes the log and lets it go again (appending) while a read with no
    /// writer runs holds the lock at neither check: the read is void all the same, and
    /// made again, where its result stood (a daemon restarted during a `wal verify`
    /// could have cut and rewritten the tail under it).
    #[test]
    fn a_writer_that_came_and_went_during_a_read_voids_it() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let storage: Arc<dyn Storage> = Arc::new(SimStorage::new());
        let dir = Path::new("/log");
        let run_a_writer = |record: &'static [u8]| {
            rt.block_on(async {
                let wal = Wal::open_with(storage.clone(), dir, WalOptions::default()).unwrap();
                wal.append(vec![bytes::Bytes::from_static(record)]).await.unwrap();
                wal.close().await.unwrap();
            })
        };
        run_a_writer(b"before");
        let mut reads = 0;
        let read = read_settled(&*storage, dir, |bound| {
            reads += 1;
            assert_eq!(bound, Bound::None);
            if reads == 1 {
                run_a_writer(b"during");
            }
            Ok(reads)
        });
        assert_eq!(read.unwrap(), 2, "the read a writer came and went during stood");
    }
}
