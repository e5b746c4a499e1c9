//! A write-ahead log of opaque records: checksummed, group-committed, crash-proven.
//!
//! The log stores byte strings ("records") under dense `u64` offsets in a directory of
//! segment files, and proves what it stored. It knows nothing of HTTP or Iggy.
//!
//! ```text
//!  append(batch) ──▶ queue ──▶ writer thread: one write + one fdatasync per group ──▶ segments
//!                                   │ publishes durable watermark
//!  Reader::read ◀── durable bytes only ◀───────────────────────────────────────────┘
//!  release_below(offset) ──▶ writer thread deletes whole segments below it
//! ```
//!
//! # Invariants (each tested in `tests/`, named after the theme it proves)
//!
//! 1. **Resolved means durable.** Under [`SyncPolicy::Always`] an append's future resolves
//!    `Ok` only after the bytes holding every record of the batch were written and
//!    `fdatasync`ed (and, for a new segment, the segment and its directory entry too).
//! 2. **Batches are atomic.** After any crash, either every record of an appended batch
//!    is in the log or none is.
//! 3. **Offsets are dense and never reused.** Offsets increase by one per record, across
//!    segments, restarts and releases; an offset a reader ever saw, or an append ever
//!    reported durable, never names another record. Within one open of the log, an
//!    offset an append was answered with is never answered to another append (under
//!    [`SyncPolicy::Interval`] a reopen after a power loss, or after a failed sync that
//!    poisoned the log, starts again after the last durable record).
//! 4. **Readers see only synced bytes**, in offset order, each checksum checked.
//! 5. **Nothing is evicted.** A full log fails appends with [`WalError::Full`]; only
//!    [`Wal::release_below`] frees space, and only below the offset its owner names. A
//!    batch that could not fit even in an empty log is refused with
//!    [`WalError::BatchTooLarge`] instead, so `Full` always means "retry after a release".
//! 6. **Recovery is exact.** A torn tail is cut away and reported; damage to bytes that
//!    were durable is an error naming file and byte position, never silently repaired.
//! 7. **A storage error leaves the log consistent.** A failed write or sync fails the
//!    appends it carried and cuts their bytes away (a failed sync: back to the durable
//!    length; a failed write: back to the length before it, so appends answered before it
//!    under `interval` stay); a failed sync is never treated as covered by a later one.
//!    If the cut fails, the bytes are overwritten with zeros and synced instead; only if
//!    that fails too, or the sync of a cut that succeeded fails, is the log poisoned,
//!    and only then can a failed append come back after a reopen (its bytes may be in
//!    the page cache whole, or on the disk beside a cut never made durable): a possible
//!    duplicate, never a loss. Under `Always` the log reopens with everything that was
//!    acknowledged before the fault. Under `interval` a failed sync may lose the appends
//!    answered since the last sync: the log is then poisoned ([`WalError::Poisoned`],
//!    [`Wal::accepts_appends`] false) with a message saying so, and a reopen recovers
//!    exactly what is durable.
//!
//! All I/O goes through [`storage::Storage`], so the simulated disk in
//! [`storage::SimStorage`] (feature `sim`) can crash it at any operation.

pub mod error;
pub mod format;
pub mod identity;
pub mod inspect;
mod observed;
pub mod options;
mod reader;
mod recovery;
pub mod salvage_copy;
mod scan;
mod shared;
pub mod storage;
mod watermark;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use bytes::Bytes;
use tokio::sync::{Semaphore, oneshot};

pub use error::{Location, Result, WalError};
pub use observed::Observed;
pub use options::{RecoveryMode, SyncPolicy, WalOptions};
pub use reader::{Reader, Record, RecordPlace};
pub use recovery::{OpenReport, SalvageReport};
use shared::Shared;
use storage::{FsStorage, Storage};
use writer::Command;

/// The writer's lock file inside a log directory.
pub const LOCK_FILE: &str = "wal.lock";
/// Present only after a clean close, until the next writable open.
pub const CLEAN_MARKER_FILE: &str = "clean-shutdown";
/// The advisory durable watermark a live writer publishes after each sync, for
/// read-only openers beside it (see `FORMAT.md`).
pub const WATERMARK_FILE: &str = "durable-watermark";
/// Where a salvage moves damaged segment files.
pub const DAMAGED_DIR: &str = "damaged";
/// Present in a salvage copy's directory from before its first segment is written until
/// the copy is whole and confirmed; a directory holding it is refused by every open.
pub const SALVAGE_INCOMPLETE_FILE: &str = "salvage-incomplete";

/// Where an appended batch landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    pub first_offset: u64,
    pub last_offset: u64,
}

/// What a release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// The log's start offset after the release.
    pub start: u64,
    pub segments_deleted: usize,
    pub bytes_freed: u64,
}

/// A point-in-time view of the log's size and positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalStats {
    pub start_offset: u64,
    /// The offset after the last durable record.
    pub next_offset: u64,
    pub segments: usize,
    pub used_bytes: u64,
    pub max_bytes: u64,
}

struct WriterHandle {
    tx: Mutex<Option<mpsc::Sender<Command>>>,
    slots: Arc<Semaphore>,
    /// `queue_max_bytes` in KiB: what queued appends may hold.
    queue_kib: Arc<Semaphore>,
    queue_kib_max: u32,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// An open log. Share it behind an `Arc`; every method takes `&self`.
pub struct Wal {
    shared: Arc<Shared>,
    writer: Option<WriterHandle>,
    report: OpenReport,
}

impl std::fmt::Debug for Wal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wal").field("dir", &self.shared.dir).field("read_only", &self.writer.is_none()).finish()
    }
}

impl Wal {
    /// Opens (creating if needed) the log in `dir` on the real file system for writing.
    pub fn open(dir: impl AsRef<Path>, options: WalOptions) -> Result<Wal> {
        Wal::open_with(Arc::new(FsStorage), dir.as_ref(), options)
    }

    /// Opens the log for writing on any storage.
    pub fn open_with(storage: Arc<dyn Storage>, dir: &Path, options: WalOptions) -> Result<Wal> {
        let opened = recovery::open(storage, dir, &options, false)?;
        let writer = opened.writer.ok_or(WalError::ReadOnly)?;
        let (tx, rx) = mpsc::channel();
        let queue_kib_max = u32::try_from(options.queue_max_bytes.div_ceil(1024)).unwrap_or(u32::MAX).max(1);
        let stopped_on_panic = StoppedOnPanic(opened.shared.clone());
        let thread = std::thread::Builder::new()
            .name("wal-writer".into())
            .spawn(move || {
                let _guard = stopped_on_panic;
                writer.run(rx)
            })
            .map_err(|e| WalError::io(dir, e))?;
        Ok(Wal {
            shared: opened.shared,
            writer: Some(WriterHandle {
                tx: Mutex::new(Some(tx)),
                slots: Arc::new(Semaphore::new(options.queue_max_appends)),
                queue_kib: Arc::new(Semaphore::new(queue_kib_max as usize)),
                queue_kib_max,
                thread: Mutex::new(Some(thread)),
            }),
            report: opened.report,
        })
    }

    /// Opens an existing log read-only: no lock, no recovery writes. A torn tail is
    /// hidden, not cut. Works beside a running writer: it sees the log as of opening,
    /// and then only what the writer's last sync made durable (its durable watermark,
    /// see `FORMAT.md`), never bytes written but not yet synced.
    pub fn open_read_only(dir: impl AsRef<Path>) -> Result<Wal> {
        Wal::open_read_only_with(Arc::new(FsStorage), dir.as_ref())
    }

    pub fn open_read_only_with(storage: Arc<dyn Storage>, dir: &Path) -> Result<Wal> {
        let options = WalOptions { max_bytes: u64::MAX, ..WalOptions::default() };
        let opened = recovery::open(storage, dir, &options, true)?;
        // Nothing will become durable through this handle: waiting readers end.
        opened.shared.mark_closed();
        Ok(Wal { shared: opened.shared, writer: None, report: opened.report })
    }

    /// What opening found and did.
    pub fn open_report(&self) -> &OpenReport {
        &self.report
    }

    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// Appends `records` as one atomic batch. Resolves with the batch's offsets once it
    /// is durable (see [`SyncPolicy`]). Fails fast with [`WalError::Full`] when the log
    /// lacks room now, and with [`WalError::BatchTooLarge`] when it could never have room
    /// (more than [`WalOptions::batch_max_bytes`]), with nothing written.
    pub async fn append(&self, records: Vec<Bytes>) -> Result<Appended> {
        let answer = self.queue_append(records).await?;
        answer.await.map_err(|_| WalError::Closed)?
    }

    /// [`Wal::append`], calling `on_durable` with the batch's offsets once it is durable,
    /// also when the future returned is dropped after the batch was queued: the batch is
    /// written all the same, and its outcome is then awaited on a task of the runtime
    /// that dropped it (see [`Observed`]). Not called for a batch refused or failed.
    pub async fn append_observed<F>(&self, records: Vec<Bytes>, on_durable: F) -> Result<Appended>
    where
        F: FnOnce(&Appended) + Send + 'static,
    {
        let answer = self.queue_append(records).await?;
        Observed::new(answer, on_durable).await
    }

    /// Checks `records` and queues them to the writer as one batch; the receiver gets
    /// the batch's answer.
    async fn queue_append(&self, records: Vec<Bytes>) -> Result<oneshot::Receiver<Result<Appended>>> {
        let writer = self.writer.as_ref().ok_or(WalError::ReadOnly)?;
        if records.is_empty() {
            return Err(WalError::EmptyBatch);
        }
        let max = self.shared.record_max_bytes;
        if let Some(r) = records.iter().find(|r| r.len() > max as usize) {
            return Err(WalError::RecordTooLarge { len: r.len(), max });
        }
        let frame_bytes = writer::frame_bytes(&records);
        let max_batch_bytes = options::batch_max_bytes(self.shared.max_bytes);
        if frame_bytes > max_batch_bytes {
            // Not `Full`: no release could ever make room for it.
            return Err(WalError::BatchTooLarge { batch_bytes: frame_bytes, max_batch_bytes });
        }
        // Checksums are computed here, on the appending task, not on the writer thread.
        let crcs = records.iter().map(|r| crc32fast::hash(r)).collect();
        let permit = writer.slots.clone().acquire_owned().await.map_err(|_| WalError::Closed)?;
        // A batch larger than the whole bound takes all of it: it waits for an empty queue.
        let kib = u32::try_from(frame_bytes.div_ceil(1024)).unwrap_or(u32::MAX).min(writer.queue_kib_max);
        let bytes_permit = writer.queue_kib.clone().acquire_many_owned(kib).await.map_err(|_| WalError::Closed)?;
        let (reply, rx) = oneshot::channel();
        let cmd = Command::Append { records, crcs, frame_bytes, reply, _permit: (permit, bytes_permit) };
        writer.send(cmd)?;
        Ok(rx)
    }

    /// Declares every record below `offset` delivered. Whole segments below it are
    /// deleted; readers of offsets below the new start get [`WalError::Released`]. The
    /// start is not persisted: after a reopen the log starts at its first retained
    /// segment, and the owner releases again from its own durable cursors.
    pub async fn release_below(&self, offset: u64) -> Result<Released> {
        let writer = self.writer.as_ref().ok_or(WalError::ReadOnly)?;
        let (reply, rx) = oneshot::channel();
        writer.send(Command::Release { below: offset, reply })?;
        rx.await.map_err(|_| WalError::Closed)?
    }

    /// Makes everything durable, writes the clean-shutdown marker and stops the writer.
    /// Appends after this fail with [`WalError::Closed`]. Under [`SyncPolicy::Interval`] a
    /// final sync that fails is [`WalError::Poisoned`]: appends answered since the last
    /// sync may be lost.
    pub async fn close(&self) -> Result<()> {
        let writer = self.writer.as_ref().ok_or(WalError::ReadOnly)?;
        let (reply, rx) = oneshot::channel();
        writer.send(Command::Close { reply })?;
        let result = rx.await.map_err(|_| WalError::Closed)?;
        writer.shutdown();
        result
    }

    /// A reader positioned at `from`.
    pub fn reader(&self, from: u64) -> Result<Reader> {
        Reader::new(self.shared.clone(), from)
    }

    /// The record at `offset`, read again from its `place` (as a reader returned it):
    /// no walk of its segment, no scan of the records around it. Checked as a reader
    /// checks it (both checksums, and the frame's offset against `offset`).
    pub fn read_placed(&self, offset: u64, place: RecordPlace) -> Result<Record> {
        reader::read_placed(&self.shared, offset, place)
    }

    pub fn stats(&self) -> WalStats {
        WalStats {
            start_offset: self.shared.start(),
            next_offset: self.shared.durable_next(),
            segments: self.shared.segments().len(),
            used_bytes: self.shared.used_bytes.load(Ordering::Acquire),
            max_bytes: self.shared.max_bytes,
        }
    }

    /// True once the writer thread panicked (a defect, never a storage failure): the log
    /// is then poisoned and closed, every append fails, and only a reopen recovers it.
    pub fn writer_panicked(&self) -> bool {
        self.shared.writer_panicked.load(Ordering::Acquire)
    }

    /// False once the log takes no more appends: closed, read-only, or poisoned by a
    /// storage failure it could not undo, or (under [`SyncPolicy::Interval`]) by a failed
    /// sync that may have lost appends already answered. Only a reopen recovers it.
    pub fn accepts_appends(&self) -> bool {
        self.writer.is_some()
            && !self.shared.closed.load(Ordering::Acquire)
            && !self.shared.poisoned.load(Ordering::Acquire)
    }

    /// How long the writer has been in its current piece of work (a group's writes and
    /// sync, an interval sync, a segment change or deletion); `None` while it waits for
    /// appends. A sync takes milliseconds; a figure in seconds that keeps growing is a
    /// disk that stopped answering, with every append waiting behind it.
    pub fn writer_busy_for(&self) -> Option<std::time::Duration> {
        self.shared.writer_busy_for()
    }

    /// True while the active segment is sealed and the writer could not create its
    /// successor (a storage error: a full disk, a directory it cannot write): every
    /// append fails until it can. Unlike [`Wal::accepts_appends`] this clears without a
    /// reopen, once the writer's next try succeeds (before each append, and every second
    /// with none arriving).
    pub fn awaits_segment(&self) -> bool {
        self.shared.awaits_segment.load(Ordering::Acquire)
    }

    /// True from an append refused as [`WalError::Full`] until an append fits again or a
    /// release frees space: the log is full for what it is being given. (Health does not
    /// turn 503 for it: see the daemon's `docs/http.md`, "Health and shutdown".)
    pub fn is_full(&self) -> bool {
        self.shared.full.load(Ordering::Acquire)
    }

    /// True from a write, sync or segment creation the file system refused for want of
    /// space (ENOSPC, EDQUOT) until a write or a segment creation succeeds: what the
    /// last try found, since only a try tells (space freed elsewhere shows at the next
    /// append). Health does not turn 503 for it either (`docs/http.md`).
    pub fn is_disk_full(&self) -> bool {
        self.shared.disk_full.load(Ordering::Acquire)
    }

    /// The first offset readers may ask for.
    pub fn start_offset(&self) -> u64 {
        self.shared.start()
    }

    /// The offset after the last durable record.
    pub fn next_offset(&self) -> u64 {
        self.shared.durable_next()
    }

    /// Paths of the segment files, oldest first.
    pub fn segment_paths(&self) -> Vec<PathBuf> {
        self.shared.segments().iter().map(|s| s.path.clone()).collect()
    }
}

impl WriterHandle {
    fn send(&self, cmd: Command) -> Result<()> {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        tx.as_ref().ok_or(WalError::Closed)?.send(cmd).map_err(|_| WalError::Closed)
    }

    /// Disconnects the queue and waits for the writer thread to finish what it holds.
    fn shutdown(&self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.slots.close();
        self.queue_kib.close();
        let thread = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        if let Some(w) = &self.writer {
            w.shutdown();
        }
    }
}

/// Held by the writer thread: should the thread panic, the log is marked poisoned and
/// closed as it unwinds, so [`Wal::accepts_appends`] (and with it a health check) tells
/// the truth and readers waiting for more wake up, instead of a log that silently takes
/// no append while it looks open.
struct StoppedOnPanic(Arc<shared::Shared>);

impl Drop for StoppedOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            tracing::error!("the log's writer thread panicked: the log takes no more appends until it is reopened");
            self.0.writer_panicked.store(true, Ordering::Release);
            self.0.poisoned.store(true, Ordering::Release);
            // Stopped until a reopen, as a write it could not undo leaves it, and said
            // the same way (`/health` says `log_stopped` from `accepts_appends`).
            metrics::gauge!("iggy_ingest_wal_stopped").set(1.0);
            self.0.mark_closed();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::pin::pin;
    use std::task::Context;

    use super::*;
    use crate::storage::SimStorage;

    /// An append waits for room by bytes as well as by count: with the queue's bytes
    /// taken (by appends whose callers may be long gone), a new one does not queue its
    /// records until they are given back; a batch larger than the whole bound then goes
    /// alone.
    #[tokio::test]
    async fn an_append_waits_for_room_in_the_queue_by_bytes() {
        let options = WalOptions { queue_max_bytes: 4 * 1024, ..WalOptions::default() };
        let wal = Wal::open_with(Arc::new(SimStorage::new()), Path::new("/wal"), options).unwrap();
        let writer = wal.writer.as_ref().unwrap();
        assert_eq!(writer.queue_kib_max, 4);
        let taken = writer.queue_kib.clone().acquire_many_owned(4).await.unwrap();

        let mut append = pin!(wal.append(vec![Bytes::from(vec![7u8; 2000])]));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(append.as_mut().poll(&mut cx).is_pending(), "queued past the byte bound");
        drop(taken);
        assert_eq!(append.await.unwrap().first_offset, 0);

        let larger_than_the_bound = wal.append(vec![Bytes::from(vec![7u8; 64 * 1024])]).await.unwrap();
        assert_eq!(larger_than_the_bound.first_offset, 1);
        assert_eq!(writer.queue_kib.available_permits(), 4, "a permit was not given back");
    }
}
