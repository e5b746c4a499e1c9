//! State shared by the writer thread, readers and the handle: the segment table and the
//! durable watermarks.
//!
//! Invariants:
//! - Only the writer thread adds or removes segments and moves watermarks.
//! - A segment's `durable_len` and the log's `durable_next` only grow, and are published
//!   (Release) only after the sync that made those bytes durable succeeded; readers load
//!   them (Acquire) before reading, so a reader never sees a byte that was not synced.
//! - The table is ordered by base offset; bases strictly increase.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tokio::sync::watch;

use crate::storage::{Storage, StorageFile};

#[derive(Debug)]
pub(crate) struct SegmentRef {
    pub base: u64,
    pub path: PathBuf,
    pub file: Arc<dyn StorageFile>,
    /// Bytes of this file a reader may read.
    pub durable_len: AtomicU64,
    /// Set once the seal frame is durable.
    pub sealed: AtomicBool,
}

#[derive(Debug)]
pub(crate) struct Shared {
    pub dir: PathBuf,
    pub storage: Arc<dyn Storage>,
    segments: RwLock<Vec<Arc<SegmentRef>>>,
    /// The offset after the last durable record.
    pub durable_next: watch::Sender<u64>,
    /// Readers of offsets below this get `Released`.
    pub start: AtomicU64,
    /// Bytes held by all segment files.
    pub used_bytes: AtomicU64,
    pub max_bytes: u64,
    pub record_max_bytes: u32,
    /// Set when the writer has stopped: nothing more will become durable.
    pub closed: AtomicBool,
    /// Set when the writer was poisoned (a failure it could not undo, or under `Interval`
    /// a failed sync that may have lost answered appends): it takes no more appends
    /// until the log is reopened.
    pub poisoned: AtomicBool,
    /// Set when the writer thread panicked (a defect): the log is then poisoned and
    /// closed as well.
    pub writer_panicked: AtomicBool,
    /// Set while the active segment is sealed and the writer could not create its
    /// successor: no append can be taken until it does.
    pub awaits_segment: AtomicBool,
    /// Set when an append was refused as `Full`, cleared when an append fits again or a
    /// release frees space: the log is full for what it is being given.
    pub full: AtomicBool,
    /// Set when a write, sync or segment creation failed for want of space on the file
    /// system (ENOSPC, EDQUOT), cleared when a write or a segment creation succeeds.
    pub disk_full: AtomicBool,
    /// When the writer began the work it is in (a group's writes and sync, an interval
    /// sync, a segment change or deletion), in nanoseconds past `origin` plus one; 0
    /// while it waits for commands. What tells a disk that stopped answering (a sync
    /// that never returns) from a quiet log: nothing else moves then.
    busy_since_nanos: AtomicU64,
    origin: std::time::Instant,
}

impl Shared {
    pub(crate) fn new(
        dir: PathBuf,
        storage: Arc<dyn Storage>,
        segments: Vec<Arc<SegmentRef>>,
        durable_next: u64,
        used_bytes: u64,
        max_bytes: u64,
        record_max_bytes: u32,
    ) -> Shared {
        let start = segments.first().map_or(durable_next, |s| s.base);
        Shared {
            dir,
            storage,
            segments: RwLock::new(segments),
            durable_next: watch::Sender::new(durable_next),
            start: AtomicU64::new(start),
            used_bytes: AtomicU64::new(used_bytes),
            max_bytes,
            record_max_bytes,
            closed: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            writer_panicked: AtomicBool::new(false),
            awaits_segment: AtomicBool::new(false),
            full: AtomicBool::new(false),
            disk_full: AtomicBool::new(false),
            busy_since_nanos: AtomicU64::new(0),
            origin: std::time::Instant::now(),
        }
    }

    /// The writer begins a piece of work (see `busy_since_nanos`).
    pub(crate) fn writer_busy(&self) {
        let since = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX - 1);
        self.busy_since_nanos.store(since.saturating_add(1), Ordering::Release);
    }

    /// The writer is done with it and waits for commands again.
    pub(crate) fn writer_idle(&self) {
        self.busy_since_nanos.store(0, Ordering::Release);
    }

    /// How long the writer has been in its current piece of work; `None` while it waits.
    pub(crate) fn writer_busy_for(&self) -> Option<std::time::Duration> {
        let since = self.busy_since_nanos.load(Ordering::Acquire).checked_sub(1)?;
        Some(self.origin.elapsed().saturating_sub(std::time::Duration::from_nanos(since)))
    }

    pub(crate) fn segments(&self) -> RwLockReadGuard<'_, Vec<Arc<SegmentRef>>> {
        self.segments.read().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn segments_mut(&self) -> RwLockWriteGuard<'_, Vec<Arc<SegmentRef>>> {
        self.segments.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The segment holding `offset` (the last whose base is at or below it).
    pub(crate) fn segment_for(&self, offset: u64) -> Option<Arc<SegmentRef>> {
        let segs = self.segments();
        let i = segs.partition_point(|s| s.base <= offset);
        if i == 0 { None } else { Some(segs[i - 1].clone()) }
    }

    /// The segment that follows the one starting at `base`.
    pub(crate) fn segment_after(&self, base: u64) -> Option<Arc<SegmentRef>> {
        let segs = self.segments();
        let i = segs.partition_point(|s| s.base <= base);
        segs.get(i).cloned()
    }

    pub(crate) fn durable_next(&self) -> u64 {
        *self.durable_next.borrow()
    }

    /// Marks the log closed and wakes every waiting reader.
    pub(crate) fn mark_closed(&self) {
        self.closed.store(true, Ordering::Release);
        self.durable_next.send_modify(|_| {});
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub(crate) fn start(&self) -> u64 {
        self.start.load(Ordering::Acquire)
    }
}
