//! The writer thread: group commit, rotation, release, capacity, clean shutdown.
//!
//! One thread owns every write to the log. It blocks until at least one command is
//! queued, then takes everything queued (up to `group_max_bytes`), writes all the appends
//! with one `write` and makes them durable with one `fdatasync`, then resolves every
//! append that sync covered. It never waits on purpose to grow a group: the group is
//! whatever arrived while the previous sync ran.
//!
//! Invariants:
//! - An append resolves `Ok` only after the sync covering its bytes succeeded (under
//!   `SyncPolicy::Always`), and every record of a batch is in one write to one segment.
//! - Under `SyncPolicy::Interval(d)` the written bytes are synced at most `d` after the
//!   first unsynced write, plus the time of the group in progress then: a due sync is
//!   taken before the next command, however many are queued.
//! - A segment is sealed (seal frame written and synced) before its successor exists; a
//!   successor is created as a temporary file, synced, renamed and the directory synced,
//!   so a segment name on disk always carries a whole, durable header.
//! - After a failed sync the writer cuts the segment back to its last durable length and
//!   syncs that; a later sync is never taken to cover the failed one. After a failed
//!   write it cuts back only that write (appends answered before it under `Interval`
//!   stay, their offsets are not handed out again) and syncs that. If the cut fails, the
//!   writer overwrites everything past that length with zeros and syncs instead (a zero
//!   frame header never checks, so the undone frames are never found again); if that
//!   fails too, the log is poisoned: no further append is accepted, and the failed
//!   bytes may still be in the page cache, whole, for the next open to keep.
//! - An offset answered `Ok` is never handed out again by this writer. Under `Interval`
//!   a failed sync (an interval sync, the sync before a seal, the sync of a close) may
//!   have dropped appends already answered, and the cut back to the durable length
//!   drops them for certain: the log is then poisoned, saying those offsets may be lost,
//!   and a reopen recovers exactly what is durable (the state a power loss leaves).
//!   Under `Always` nothing answered is ever unsynced, so a failed sync only fails the
//!   appends it carried and the log goes on.
//! - The zeros written ahead are an optimisation: a write refused for space (`ENOSPC`,
//!   `EDQUOT`) is tried again without them. Zeros written by an undo whose cut failed
//!   are zeros written ahead like any others.
//! - A rotation publishes the new segment in the durable watermark at once (it is
//!   durable when created), so releasing the sealed one never leaves the watermark
//!   naming a deleted file.
//! - A sealed segment whose successor could not be created takes no append until the
//!   successor exists. The writer says so ([`crate::Wal::awaits_segment`], which health
//!   reports) and creates it again before every append and, with none arriving, every
//!   [`SUCCESSOR_RETRY_INTERVAL`]: a load balancer that stopped sending on that health
//!   gets it back once the cause is gone, with no restart.
//! - A write that grows the active segment's file also writes zeros after itself
//!   (`preallocate_bytes`), so the group commits that follow sync no size change. Zeros
//!   are only ever written past `written_len`; the file is cut back to its frames before
//!   a seal and before the clean-shutdown marker (FORMAT.md, "Zeros written ahead").
//! - Capacity is checked before a byte is written; nothing is ever evicted.
//! - Segments are deleted oldest first, one directory sync each, and never past a
//!   removal whose directory sync failed until a later one succeeds, so a crash during
//!   or after a release leaves a contiguous run of segments.
//! - A failed deletion of released segments is tried again every
//!   [`DELETION_RETRY_INTERVAL`] until it succeeds, with no release asked: the releaser
//!   asks again only when delivery moves on, and a segment freed by a rotation (its
//!   records released while it was active) may be all that stands between a full log
//!   and the appends that would move delivery on.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{OwnedSemaphorePermit, oneshot};

use crate::error::{Result, WalError, is_out_of_space};
use crate::format::{
    CleanMarker, FLAG_END_OF_BATCH, FRAME_HEADER_LEN, FrameHeader, OFFSET_MAX, SEAL_LEN, SEGMENT_HEADER_LEN,
    SegmentHeader, segment_file_name,
};
use crate::options::SyncPolicy;
use crate::shared::{SegmentRef, Shared};
use crate::storage::{OpenMode, Storage, StorageFile};
use crate::{Appended, CLEAN_MARKER_FILE, Released};

/// How often the writer tries again to create a sealed segment's successor while no
/// append arrives to try it (each append tries it too). Once a second: a retry is one
/// small file created and synced, and a load balancer's health probe is rarely faster.
pub(crate) const SUCCESSOR_RETRY_INTERVAL: Duration = Duration::from_secs(1);

/// How often the writer tries again to delete released segments after a deletion
/// failed. Once a second, as for a successor: a try is one `remove_file` and one
/// directory sync, and until it succeeds the space may be what the door answers 503 for.
pub(crate) const DELETION_RETRY_INTERVAL: Duration = Duration::from_secs(1);

pub(crate) enum Command {
    Append {
        records: Vec<Bytes>,
        crcs: Vec<u32>,
        frame_bytes: u64,
        reply: oneshot::Sender<Result<Appended>>,
        /// Its place in the queue, by count and by bytes, given back once staged.
        _permit: (OwnedSemaphorePermit, OwnedSemaphorePermit),
    },
    Release {
        below: u64,
        reply: oneshot::Sender<Result<Released>>,
    },
    Close {
        reply: oneshot::Sender<Result<()>>,
    },
}

struct Pending {
    reply: oneshot::Sender<Result<Appended>>,
    appended: Appended,
}

pub(crate) struct Writer {
    pub shared: Arc<Shared>,
    pub active: Arc<SegmentRef>,
    /// Bytes written to the active segment (durable or not).
    pub written_len: u64,
    /// Bytes of the active segment known durable.
    pub durable_len: u64,
    /// The offset the next appended record gets.
    pub next_offset: u64,
    pub segment_max_bytes: u64,
    pub group_max_bytes: usize,
    /// Zeros written ahead of the data when a write grows the file (see
    /// `WalOptions::preallocate_bytes`).
    pub preallocate_bytes: u64,
    /// The active segment file's length as the writer last made it: `written_len` plus
    /// the zeros written ahead. Always at least `written_len`.
    pub allocated_len: u64,
    pub sync: SyncPolicy,
    /// Set when a failure could not be undone.
    pub poisoned: Option<String>,
    /// Under `SyncPolicy::Interval`: when the oldest unsynced write happened.
    pub unsynced_since: Option<Instant>,
    /// Set while the active segment is sealed and creating its successor failed: when
    /// to try again with no append waiting.
    pub successor_retry_at: Option<Instant>,
    /// Set while deleting released segments last failed: when to try again.
    pub deletion_retry_at: Option<Instant>,
    /// The last deletion of released segments failed: a storage error is counted once
    /// for a run of failures, as for a segment creation, not at every try (each release
    /// and the retry every second would count one removal that keeps failing many
    /// times a second).
    pub deletion_failing: bool,
    pub buf: Vec<u8>,
    /// Set when a segment was removed but the directory sync after it failed: until a
    /// directory sync succeeds, that removal may be undone by a power loss, so no later
    /// segment may be removed (a crash would otherwise leave a hole in the middle).
    pub removal_unsynced: bool,
    /// Publishes each sync's result for read-only openers (`watermark.rs`).
    pub watermark: Option<crate::watermark::Publisher>,
    /// Held for as long as the writer lives: releases the directory on exit.
    pub _lock: Box<dyn Send + Sync>,
}

impl Writer {
    pub(crate) fn run(mut self, rx: Receiver<Command>) {
        loop {
            // Due work runs before more commands are taken: `recv_timeout` returns a
            // queued command even when its deadline has passed, so a queue that never
            // empties would otherwise hold a due interval sync off for as long as the
            // load lasts (and with it readers and the power-loss window).
            let now = Instant::now();
            let sync_due = self.sync_deadline().is_some_and(|deadline| deadline <= now);
            let successor_due = self.successor_retry_at.is_some_and(|at| at <= now);
            let deletion_due = self.deletion_retry_at.is_some_and(|at| at <= now);
            // Marked busy only when there is work: a pass with none costs nothing more.
            if sync_due || successor_due || deletion_due {
                self.shared.writer_busy();
                if sync_due {
                    self.sync_interval_writes();
                }
                if successor_due {
                    self.retry_successor();
                }
                if deletion_due {
                    self.retry_deletion();
                }
                self.shared.writer_idle();
            }
            let deadline =
                [self.sync_deadline(), self.successor_retry_at, self.deletion_retry_at].into_iter().flatten().min();
            let first = match deadline {
                None => match rx.recv() {
                    Ok(c) => c,
                    Err(_) => break,
                },
                Some(deadline) => match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(c) => c,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => break,
                },
            };
            let mut group = vec![first];
            let mut group_bytes = command_bytes(&group[0]);
            while group_bytes < self.group_max_bytes as u64 {
                match rx.try_recv() {
                    Ok(c) => {
                        group_bytes += command_bytes(&c);
                        group.push(c);
                    }
                    Err(_) => break,
                }
            }
            self.shared.writer_busy();
            let closed = self.handle(group);
            self.shared.writer_idle();
            if closed {
                self.shared.mark_closed();
                return;
            }
        }
        // Every handle is gone: make what was written durable, without a clean marker.
        self.sync_interval_writes();
        self.shared.mark_closed();
    }

    fn sync_deadline(&self) -> Option<Instant> {
        match (self.sync, self.unsynced_since) {
            (SyncPolicy::Interval(d), Some(t)) => Some(t + d),
            _ => None,
        }
    }

    /// Seals the full active segment (if a seal failed) and creates its successor, with
    /// no append waiting for it.
    fn retry_successor(&mut self) {
        self.successor_retry_at = None;
        if self.poisoned.is_some() {
            return;
        }
        // A failure is logged and counted, and sets the next retry, in `rotate`.
        if self.rotate().is_ok() {
            self.delete_sealed_if_released();
        }
    }

    /// After a rotation: the segment just sealed may hold only released records (they
    /// were released while it was active, which is never deleted): it is freed now. The
    /// releaser asks again only when delivery moves on, and until then appends would be
    /// refused as `Full` with nothing undelivered in the log. A failure is retried every
    /// [`DELETION_RETRY_INTERVAL`] (`delete_released`).
    fn delete_sealed_if_released(&mut self) {
        if let Err(e) = self.delete_released() {
            tracing::warn!(error = %e, "could not delete a released segment after a rotation; trying again every second");
        }
    }

    /// Deletes released segments again after a deletion failed.
    fn retry_deletion(&mut self) {
        self.deletion_retry_at = None;
        if self.poisoned.is_some() {
            return;
        }
        // A failure sets the next retry, in `delete_released`; the first was logged
        // where it happened.
        match self.delete_released() {
            Ok(released) if released.segments_deleted > 0 => tracing::info!(
                segments_deleted = released.segments_deleted,
                bytes_freed = released.bytes_freed,
                "deleted released log segments that an earlier try could not"
            ),
            Ok(_) => {}
            Err(e) => tracing::debug!(error = %e, "could not delete a released segment yet"),
        }
    }

    /// Handles one group. Returns true when the log was closed.
    fn handle(&mut self, group: Vec<Command>) -> bool {
        let mut pending: Vec<Pending> = Vec::new();
        for cmd in group {
            match cmd {
                Command::Append { records, crcs, frame_bytes, reply, _permit } => {
                    self.stage(records, crcs, frame_bytes, reply, &mut pending);
                }
                Command::Release { below, reply } => {
                    self.flush(&mut pending);
                    let _ = reply.send(self.release(below));
                }
                Command::Close { reply } => {
                    self.flush(&mut pending);
                    fail_points::fail_point!("wal.close");
                    let _ = reply.send(self.close());
                    return true;
                }
            }
        }
        self.flush(&mut pending);
        false
    }

    fn stage(
        &mut self,
        records: Vec<Bytes>,
        crcs: Vec<u32>,
        frame_bytes: u64,
        reply: oneshot::Sender<Result<Appended>>,
        pending: &mut Vec<Pending>,
    ) {
        if let Some(why) = &self.poisoned {
            let _ = reply.send(Err(WalError::Poisoned(why.clone())));
            return;
        }
        let count = records.len() as u64;
        // Start a new segment first if this batch would not fit beside what the active
        // one holds (a batch larger than a whole segment gets a segment of its own).
        let staged = self.written_len + self.buf.len() as u64;
        let sealed = self.active.sealed.load(Ordering::Acquire);
        if sealed || (staged > SEGMENT_HEADER_LEN && staged + frame_bytes + SEAL_LEN > self.segment_max_bytes) {
            self.flush(pending);
            if let Some(why) = &self.poisoned {
                let _ = reply.send(Err(WalError::Poisoned(why.clone())));
                return;
            }
            // A failed flush may have emptied the active segment again: an empty
            // segment is never sealed (its successor would take its name).
            let holds_records = self.written_len > SEGMENT_HEADER_LEN;
            if (holds_records || self.active.sealed.load(Ordering::Acquire))
                && let Err(e) = self.rotate()
            {
                let _ = reply.send(Err(e));
                return;
            }
            self.delete_sealed_if_released();
        }
        // Offsets are taken only now: a failed flush above gives back the offsets it held.
        let last = self.next_offset.checked_add(count - 1).filter(|&l| l <= OFFSET_MAX);
        let Some(last) = last else {
            let _ = reply.send(Err(WalError::OffsetsExhausted { next: self.next_offset, needed: count }));
            return;
        };
        // Capacity, with room kept for the seal and the next segment's header so that a
        // rotation can never be the write that fails for space.
        let used = self.shared.used_bytes.load(Ordering::Acquire) + self.buf.len() as u64;
        let needed = frame_bytes + SEAL_LEN + SEGMENT_HEADER_LEN;
        if used.saturating_add(needed) > self.shared.max_bytes {
            metrics::counter!("iggy_ingest_wal_full_rejections_total").increment(1);
            self.set_full(true);
            let _ = reply.send(Err(WalError::Full {
                used_bytes: used,
                max_bytes: self.shared.max_bytes,
                needed_bytes: needed,
            }));
            return;
        }
        self.set_full(false);
        let synced_len = self.durable_len;
        for (i, (payload, crc)) in records.iter().zip(crcs).enumerate() {
            let h = FrameHeader {
                payload_len: payload.len() as u32,
                offset: self.next_offset + i as u64,
                synced_len,
                flags: if i as u64 == count - 1 { FLAG_END_OF_BATCH } else { 0 },
                payload_crc: crc,
            };
            self.buf.extend_from_slice(&h.encode());
            self.buf.extend_from_slice(payload);
        }
        pending.push(Pending { reply, appended: Appended { first_offset: self.next_offset, last_offset: last } });
        self.next_offset = last + 1;
    }

    /// Writes the staged bytes and, under `Always`, syncs them; resolves `pending`.
    fn flush(&mut self, pending: &mut Vec<Pending>) {
        if self.buf.is_empty() {
            debug_assert!(pending.is_empty());
            return;
        }
        let n = self.buf.len() as u64;
        let records: u64 = pending.iter().map(|p| p.appended.last_offset - p.appended.first_offset + 1).sum();
        // A write that grows the file also writes zeros after itself, so that the
        // writes (and syncs) that follow change no file size.
        let end = self.written_len + n;
        let zeros_to = if end > self.allocated_len && self.preallocate_bytes > 0 {
            (end + self.preallocate_bytes).min(self.segment_max_bytes).max(end)
        } else {
            end
        };
        self.buf.resize((zeros_to - self.written_len) as usize, 0);
        let mut result = self.active.file.write_all_at(&self.buf, self.written_len);
        let mut zeros_to = zeros_to;
        // The zeros are an optimisation: a disk with room for the group but not for
        // them takes the group alone (and the next write that grows the file tries
        // the zeros again).
        if let Err(e) = &result
            && zeros_to > end
            && is_out_of_space(e)
        {
            result = self.active.file.write_all_at(&self.buf[..n as usize], self.written_len);
            // The failed write may have grown the file part of the way: what it holds
            // now is what a cut before the seal must reach (at worst, all of it).
            zeros_to = self.active.file.len().map_or(zeros_to, |len| len.clamp(end, zeros_to));
        }
        self.buf.clear();
        // A group is at most `group_max_bytes` plus one batch plus the zeros written
        // ahead: keep that much, not the largest batch there ever was for the rest of
        // the run.
        let keep = self.group_max_bytes.saturating_add(self.preallocate_bytes as usize);
        if self.buf.capacity() > keep.saturating_mul(2) {
            self.buf.shrink_to(keep);
        }
        if let Err(e) = result {
            // Only this group's write failed: what was written before it stays (under
            // `Interval` that is appends already answered), the group's offsets are
            // handed out again.
            let first = pending.first().map_or(self.next_offset, |p| p.appended.first_offset);
            self.fail_to(pending, e, "write", self.written_len, first);
            return;
        }
        fail_points::fail_point!("wal.append.written");
        self.set_disk_full(false);
        self.allocated_len = self.allocated_len.max(zeros_to);
        self.written_len += n;
        self.shared.used_bytes.fetch_add(n, Ordering::AcqRel);
        match self.sync {
            SyncPolicy::Always => {
                if let Err(e) = self.sync_active() {
                    self.fail(pending, e, "sync");
                    return;
                }
            }
            SyncPolicy::Interval(_) => {
                self.unsynced_since.get_or_insert_with(Instant::now);
            }
        }
        metrics::counter!("iggy_ingest_wal_appends_total").increment(pending.len() as u64);
        metrics::counter!("iggy_ingest_wal_records_total").increment(records);
        metrics::counter!("iggy_ingest_wal_bytes_written_total").increment(n);
        metrics::histogram!("iggy_ingest_wal_group_commit_appends").record(pending.len() as f64);
        publish_used_bytes(&self.shared);
        for p in pending.drain(..) {
            let _ = p.reply.send(Ok(p.appended));
        }
    }

    /// Syncs the active segment and publishes everything written as durable.
    fn sync_active(&mut self) -> std::io::Result<()> {
        let t = Instant::now();
        self.active.file.sync_data()?;
        metrics::histogram!("iggy_ingest_wal_fsync_seconds").record(t.elapsed().as_secs_f64());
        self.durable_len = self.written_len;
        self.unsynced_since = None;
        self.active.durable_len.store(self.durable_len, Ordering::Release);
        self.shared.durable_next.send_replace(self.next_offset);
        self.publish_watermark();
        Ok(())
    }

    /// Tells read-only openers beside this writer what is durable: the active segment up
    /// to `durable_len`, and `next_offset`.
    fn publish_watermark(&mut self) {
        if let Some(w) = &mut self.watermark {
            w.publish(crate::format::DurableWatermark {
                segment_base: self.active.base,
                durable_len: self.durable_len,
                next_offset: self.next_offset,
            });
        }
    }

    fn sync_interval_writes(&mut self) {
        if self.written_len == self.durable_len || self.poisoned.is_some() {
            self.unsynced_since = None;
            return;
        }
        if let Err(e) = self.sync_active() {
            self.fail(&mut Vec::new(), e, "sync");
        }
    }

    /// A sync (or a seal) failed: cut the segment back to its last durable length so the
    /// log is again exactly what it vouched for (no later sync is trusted to cover bytes
    /// a failed one may have dropped), then fail the appends it carried. Under
    /// `Interval` that cut takes appends already answered: the log is then poisoned (see
    /// [`Writer::fail_to`]).
    fn fail(&mut self, pending: &mut Vec<Pending>, e: std::io::Error, what: &str) {
        let (keep_len, next) = (self.durable_len, self.shared.durable_next());
        self.fail_to(pending, e, what, keep_len, next);
    }

    /// Cuts the active segment back to `keep_len` (which `next` follows) and syncs that,
    /// then fails the appends in `pending`. The cut comes first so that a caller told
    /// "failed" (and a sender that retries) finds the failed bytes already gone, unless
    /// the cut failed too and the log is poisoned.
    ///
    /// The log is poisoned (no more appends until reopened) when the undo fails, and when
    /// the cut goes below appends already answered `Ok` (under `Interval`, after a failed
    /// sync: the pages it carried may never reach the disk). Going on would hand their
    /// offsets out again, to other records, while their senders hold them; a reopen
    /// recovers exactly what is durable, as after a power loss.
    fn fail_to(&mut self, pending: &mut Vec<Pending>, e: std::io::Error, what: &str, keep_len: u64, next: u64) {
        // A seal retried every second while it keeps failing is counted and logged once,
        // as a successor that cannot be created is (`await_segment`).
        let retried_seal = what == "seal" && self.shared.awaits_segment.load(Ordering::Acquire);
        if retried_seal {
            tracing::debug!(error = %e, segment = %self.active.path.display(), "log seal failed again");
        } else {
            metrics::counter!("iggy_ingest_wal_storage_errors_total").increment(1);
            tracing::error!(error = %e, segment = %self.active.path.display(), "log {what} failed");
        }
        if is_out_of_space(&e) {
            self.set_disk_full(true);
        }
        // Offsets answered `Ok` that no sync covered yet: under `Interval`, the appends
        // answered since the last sync; under `Always`, none.
        let first_unanswered = pending.first().map_or(self.next_offset, |p| p.appended.first_offset);
        let answered_unsynced = self.shared.durable_next()..first_unanswered;
        let undone = self.undo_to(keep_len, next);
        let cut_answered = next < first_unanswered;
        if undone.is_err() || cut_answered {
            let mut why = format!("{what} failed ({e})");
            if let Err(undo_err) = &undone {
                why.push_str(&format!(", and undoing it failed ({undo_err})"));
            }
            if !answered_unsynced.is_empty() {
                why.push_str(&format!(
                    "; the records answered since the last sync (offsets {} to {}) may be lost",
                    answered_unsynced.start,
                    answered_unsynced.end - 1
                ));
            }
            why.push_str("; the log must be reopened, which recovers exactly what is durable");
            tracing::error!("{why}; the log accepts no more appends until reopened");
            self.set_poisoned(why);
        }
        for p in pending.drain(..) {
            let err = std::io::Error::new(e.kind(), format!("log {what} failed: {e}"));
            let _ = p.reply.send(Err(WalError::io(&self.active.path, err)));
        }
    }

    /// Cuts the active segment back to `keep_len` and syncs it, after which everything up
    /// to `keep_len` is durable and `next` is the next offset. `keep_len` is at least the
    /// durable length: after a failed sync it is the durable length, after a failed write
    /// the length before that write. An error says which step failed; the caller poisons
    /// the log.
    ///
    /// If the cut fails, the bytes from `keep_len` to the end of the file are overwritten
    /// with zeros instead (tried once): a failed write may have left whole frames in the
    /// page cache (a short write, or dirty pages dropping the cache keeps), which a later
    /// open would find and keep, bringing back appends answered "failed". A zero frame
    /// header never checks, so a scan stops at `keep_len`, as it does at the zeros
    /// written ahead; the file then is exactly a tail followed by such zeros.
    fn undo_to(&mut self, keep_len: u64, next: u64) -> std::io::Result<()> {
        debug_assert!(keep_len >= self.durable_len && keep_len <= self.written_len);
        match self.active.file.set_len(keep_len) {
            Ok(()) => self.allocated_len = keep_len,
            Err(cut_err) => {
                let file_len = self.zero_from(keep_len).map_err(|zero_err| {
                    let why = format!("cutting the segment back: {cut_err}; overwriting it with zeros: {zero_err}");
                    std::io::Error::new(zero_err.kind(), why)
                })?;
                self.allocated_len = file_len.max(keep_len);
            }
        }
        // The bytes are undone: account for it even if the sync below fails.
        self.shared.used_bytes.fetch_sub(self.written_len - keep_len, Ordering::AcqRel);
        publish_used_bytes(&self.shared);
        self.written_len = keep_len;
        self.next_offset = next;
        self.sync_active().map_err(|e| std::io::Error::new(e.kind(), format!("syncing the undo: {e}")))
    }

    /// Overwrites the active segment's bytes from `from` to the end of the file with
    /// zeros (growing nothing); returns the file's length.
    fn zero_from(&self, from: u64) -> std::io::Result<u64> {
        const CHUNK_BYTES: u64 = 64 * 1024;
        let file_len = self.active.file.len()?;
        let zeros = vec![0u8; file_len.saturating_sub(from).min(CHUNK_BYTES) as usize];
        let mut pos = from;
        while pos < file_len {
            let n = (file_len - pos).min(CHUNK_BYTES);
            self.active.file.write_all_at(&zeros[..n as usize], pos)?;
            pos += n;
        }
        Ok(file_len)
    }

    /// From now on every append fails with `why`, and [`crate::Wal::accepts_appends`] says
    /// so to whoever asks (the daemon's health).
    fn set_poisoned(&mut self, why: String) {
        self.poisoned = Some(why);
        self.shared.poisoned.store(true, Ordering::Release);
        // Refused appends are not counted one by one: this says the log is stopped for as
        // long as it is (an alert on a counter's increase would clear after its window).
        metrics::gauge!("iggy_ingest_wal_stopped").set(1.0);
    }

    /// Seals the active segment (if not sealed yet) and starts its successor.
    fn rotate(&mut self) -> Result<()> {
        if self.next_offset <= self.active.base {
            // Its successor would take its name. The writer never seals an empty
            // segment, so this is a log whose recovered state is inconsistent.
            let why = format!(
                "segment {} holds bytes but no records; refusing to rotate into its own name",
                self.active.path.display()
            );
            tracing::error!("{why}");
            self.set_poisoned(why.clone());
            return Err(WalError::Poisoned(why));
        }
        if !self.active.sealed.load(Ordering::Acquire) {
            if self.written_len != self.durable_len {
                self.sync_active().map_err(|e| self.fail_rotation(e))?;
            }
            // Zeros written ahead go first: a segment with a successor ends at its seal.
            // The seal's sync below makes the shorter length durable with the seal.
            if self.allocated_len > self.written_len {
                self.active.file.set_len(self.written_len).map_err(|e| self.fail_rotation(e))?;
                self.allocated_len = self.written_len;
            }
            let seal = FrameHeader::seal(self.next_offset, self.durable_len).encode();
            self.active.file.write_all_at(&seal, self.written_len).map_err(|e| self.fail_rotation(e))?;
            self.allocated_len = self.written_len + SEAL_LEN;
            self.written_len += SEAL_LEN;
            self.shared.used_bytes.fetch_add(SEAL_LEN, Ordering::AcqRel);
            self.sync_active().map_err(|e| self.fail_rotation(e))?;
            self.active.sealed.store(true, Ordering::Release);
        }
        let seg = match create_segment(&*self.shared.storage, &self.shared.dir, self.next_offset, 0) {
            Ok(seg) => seg,
            Err(e) => {
                self.await_segment(&e);
                return Err(e);
            }
        };
        self.set_disk_full(false);
        if self.shared.awaits_segment.swap(false, Ordering::AcqRel) {
            metrics::gauge!("iggy_ingest_wal_awaiting_segment").set(0.0);
            tracing::info!(segment = %seg.path.display(), "rolled over to the next log segment; appends are taken again");
        }
        self.successor_retry_at = None;
        self.shared.used_bytes.fetch_add(SEGMENT_HEADER_LEN, Ordering::AcqRel);
        self.shared.segments_mut().push(seg.clone());
        metrics::gauge!("iggy_ingest_wal_segments").set(self.shared.segments().len() as f64);
        publish_used_bytes(&self.shared);
        self.active = seg;
        self.written_len = SEGMENT_HEADER_LEN;
        self.durable_len = SEGMENT_HEADER_LEN;
        self.allocated_len = SEGMENT_HEADER_LEN;
        // The new segment is durable (created, synced, its directory entry synced): the
        // watermark names it at once, so that releasing the sealed one never leaves the
        // watermark naming a deleted file until the next sync.
        self.publish_watermark();
        Ok(())
    }

    /// Creating the sealed active segment's successor failed with `e`: no append can be
    /// taken until it exists. The first failure is logged and counted as a storage error;
    /// the tries after it (every second, and for every append) only at debug level, the
    /// waiting itself being in health and in `iggy_ingest_wal_awaiting_segment`.
    pub(crate) fn await_segment(&mut self, e: &WalError) {
        if let WalError::Io { source, .. } = e
            && is_out_of_space(source)
        {
            self.set_disk_full(true);
        }
        if !self.shared.awaits_segment.swap(true, Ordering::AcqRel) {
            metrics::counter!("iggy_ingest_wal_storage_errors_total").increment(1);
            metrics::gauge!("iggy_ingest_wal_awaiting_segment").set(1.0);
            tracing::error!(error = %e, "could not create the next log segment; no append is taken until it exists, trying again every second");
        } else {
            tracing::debug!(error = %e, "could not create the next log segment yet");
        }
        self.successor_retry_at = Some(Instant::now() + SUCCESSOR_RETRY_INTERVAL);
    }

    /// Sealing the full active segment failed with `e` (undone as any failed write): no
    /// append can be taken until the rotation succeeds, as while a successor cannot be
    /// created, and the log says so the same way (health, the gauge) and tries again
    /// every second, appends or not. Counted once, by the undo.
    fn fail_rotation(&mut self, e: std::io::Error) -> WalError {
        let err = WalError::io(&self.active.path, std::io::Error::new(e.kind(), e.to_string()));
        self.fail(&mut Vec::new(), e, "seal");
        if self.poisoned.is_none() {
            if !self.shared.awaits_segment.swap(true, Ordering::AcqRel) {
                metrics::gauge!("iggy_ingest_wal_awaiting_segment").set(1.0);
                tracing::error!(error = %err, "could not seal the full log segment; no append is taken until it is, trying again every second");
            }
            self.successor_retry_at = Some(Instant::now() + SUCCESSOR_RETRY_INTERVAL);
        }
        err
    }

    fn release(&mut self, below: u64) -> Result<Released> {
        let below = below.min(self.shared.durable_next());
        self.shared.start.fetch_max(below, Ordering::AcqRel);
        self.delete_released()
    }

    /// Deletes, oldest first, every segment below the log's start that is not the active
    /// one (whole segments only: one whose successor begins at or below the start). A
    /// failure is counted as a storage error (space the log cannot free fills it) and
    /// sets a retry [`DELETION_RETRY_INTERVAL`] from now; a success clears it.
    fn delete_released(&mut self) -> Result<Released> {
        let used_before = self.shared.used_bytes.load(Ordering::Acquire);
        let deleted = self.try_delete_released();
        if deleted.is_err() {
            if !std::mem::replace(&mut self.deletion_failing, true) {
                metrics::counter!("iggy_ingest_wal_storage_errors_total").increment(1);
            }
            self.deletion_retry_at = Some(Instant::now() + DELETION_RETRY_INTERVAL);
        } else {
            self.deletion_failing = false;
            self.deletion_retry_at = None;
        }
        // Also after a removal that failed part of the way: what was removed before it
        // is gone, and the gauges say so.
        metrics::gauge!("iggy_ingest_wal_segments").set(self.shared.segments().len() as f64);
        publish_used_bytes(&self.shared);
        // Space freed, also by a removal that failed part of the way: the log may take
        // what it refused.
        if self.shared.used_bytes.load(Ordering::Acquire) < used_before {
            self.set_full(false);
        }
        deleted
    }

    /// Says whether the log is full for what it is being given ([`crate::Wal::is_full`]),
    /// in the flag and its gauge together.
    fn set_full(&self, full: bool) {
        set_flag(&self.shared.full, full, || metrics::gauge!("iggy_ingest_wal_full"));
    }

    /// Says whether the file system refused the last write, sync or segment creation
    /// for want of space ([`crate::Wal::is_disk_full`]), in the flag and its gauge
    /// together.
    fn set_disk_full(&self, disk_full: bool) {
        set_flag(&self.shared.disk_full, disk_full, || metrics::gauge!("iggy_ingest_wal_disk_full"));
    }

    fn try_delete_released(&mut self) -> Result<Released> {
        let start = self.shared.start();
        let mut out = Released { start, segments_deleted: 0, bytes_freed: 0 };
        if self.removal_unsynced {
            // An earlier removal is not durable yet: make it so before removing more.
            self.shared.storage.sync_dir(&self.shared.dir).map_err(|e| WalError::io(&self.shared.dir, e))?;
            self.removal_unsynced = false;
        }
        loop {
            let victim = {
                let segs = self.shared.segments();
                match (segs.first(), segs.get(1)) {
                    (Some(first), Some(second)) if second.base <= start && !Arc::ptr_eq(first, &self.active) => {
                        first.clone()
                    }
                    _ => break,
                }
            };
            let size = victim.file.len().map_err(|e| WalError::io(&victim.path, e))?;
            self.shared.storage.remove_file(&victim.path).map_err(|e| WalError::io(&victim.path, e))?;
            fail_points::fail_point!("wal.release.removed");
            self.shared.segments_mut().remove(0);
            self.shared.used_bytes.fetch_sub(size, Ordering::AcqRel);
            self.removal_unsynced = true;
            self.shared.storage.sync_dir(&self.shared.dir).map_err(|e| WalError::io(&self.shared.dir, e))?;
            self.removal_unsynced = false;
            out.segments_deleted += 1;
            out.bytes_freed += size;
        }
        Ok(out)
    }

    /// Makes everything durable and writes the clean-shutdown marker.
    fn close(&mut self) -> Result<()> {
        if let Some(why) = &self.poisoned {
            return Err(WalError::Poisoned(why.clone()));
        }
        if self.written_len != self.durable_len
            && let Err(e) = self.sync_active()
        {
            // Under `Interval`: what was answered since the last sync may be lost.
            self.fail(&mut Vec::new(), e, "sync");
            let why = self.poisoned.clone().unwrap_or_else(|| "the final sync failed".into());
            return Err(WalError::Poisoned(why));
        }
        // The marker states the tail's length: the zeros written ahead go first.
        if self.allocated_len > self.durable_len {
            let cut = self.active.file.set_len(self.durable_len).and_then(|()| self.active.file.sync_data());
            cut.map_err(|e| WalError::io(&self.active.path, e))?;
            self.allocated_len = self.durable_len;
        }
        let marker = CleanMarker {
            tail_base: self.active.base,
            tail_len: self.durable_len,
            next_offset: self.next_offset,
            tail_sealed: self.active.sealed.load(Ordering::Acquire),
        };
        write_file_atomically(&*self.shared.storage, &self.shared.dir, CLEAN_MARKER_FILE, &marker.encode())
    }
}

fn command_bytes(c: &Command) -> u64 {
    match c {
        Command::Append { frame_bytes, .. } => *frame_bytes,
        _ => 0,
    }
}

/// Publishes the log's used bytes: after writes, and after every other change of them
/// that no write may follow (an undo, which a stopped log ends with; a rotation).
fn publish_used_bytes(shared: &Shared) {
    metrics::gauge!("iggy_ingest_wal_used_bytes").set(shared.used_bytes.load(Ordering::Relaxed) as f64);
}

/// Bytes a batch occupies on disk.
pub(crate) fn frame_bytes(records: &[Bytes]) -> u64 {
    records.iter().map(|r| FRAME_HEADER_LEN + r.len() as u64).sum()
}

/// Creates a durable, empty segment: header into a temporary file, sync, rename, sync
/// the directory.
pub(crate) fn create_segment(storage: &dyn Storage, dir: &Path, base: u64, flags: u32) -> Result<Arc<SegmentRef>> {
    let header = SegmentHeader { base_offset: base, flags }.encode();
    create_segment_with(storage, dir, base, &header)
}

/// Creates a durable segment file holding exactly `bytes` (a header and whole frames).
pub(crate) fn create_segment_with(
    storage: &dyn Storage,
    dir: &Path,
    base: u64,
    bytes: &[u8],
) -> Result<Arc<SegmentRef>> {
    let name = segment_file_name(base);
    write_file_atomically(storage, dir, &name, bytes)?;
    open_created_segment(storage, dir, base, bytes.len() as u64)
}

/// Opens the segment starting at `base` that was just made durable in `dir`, holding
/// `durable_len` bytes, for the writer.
fn open_created_segment(storage: &dyn Storage, dir: &Path, base: u64, durable_len: u64) -> Result<Arc<SegmentRef>> {
    let path = dir.join(segment_file_name(base));
    let file = storage.open(&path, OpenMode::ReadWrite).map_err(|e| WalError::io(&path, e))?;
    Ok(Arc::new(SegmentRef { base, path, file, durable_len: durable_len.into(), sealed: false.into() }))
}

/// Writes `bytes` as the file `name` in `dir` so that after a crash the name either does
/// not exist or holds exactly `bytes`.
pub(crate) fn write_file_atomically(storage: &dyn Storage, dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    write_file_atomically_with(storage, dir, name, &mut |f: &dyn StorageFile, tmp: &Path| {
        f.write_all_at(bytes, 0).map_err(|e| WalError::io(tmp, e))
    })
}

/// Bytes copied per read and write by [`copy_file_atomically`]: what a copy holds in
/// memory, whatever the size of the file it copies.
const COPY_CHUNK_BYTES: usize = 1024 * 1024;

/// Writes the first `len` bytes of `src` (at `src_path`), then `trailer`, as the file
/// `name` in `dir`, as [`write_file_atomically`] does, in chunks of
/// [`COPY_CHUNK_BYTES`]: a salvage copies whole segments (of up to
/// `segment_max_bytes`), and must not hold one in memory. Returns the bytes written.
pub(crate) fn copy_file_atomically(
    storage: &dyn Storage,
    dir: &Path,
    name: &str,
    src: &dyn StorageFile,
    src_path: &Path,
    len: u64,
    trailer: &[u8],
) -> Result<u64> {
    let mut chunk = vec![0u8; COPY_CHUNK_BYTES.min(usize::try_from(len).unwrap_or(usize::MAX))];
    write_file_atomically_with(storage, dir, name, &mut |f: &dyn StorageFile, tmp: &Path| {
        let mut pos = 0u64;
        while pos < len {
            let n = chunk.len().min(usize::try_from(len - pos).unwrap_or(usize::MAX));
            crate::storage::read_exact_at(src, &mut chunk[..n], pos).map_err(|e| WalError::io(src_path, e))?;
            f.write_all_at(&chunk[..n], pos).map_err(|e| WalError::io(tmp, e))?;
            pos += n as u64;
        }
        f.write_all_at(trailer, len).map_err(|e| WalError::io(tmp, e))
    })?;
    Ok(len + trailer.len() as u64)
}

/// Creates a durable segment file holding the first `len` bytes of `src` then `trailer`
/// (a header and whole frames, then a seal if the copy needs one), copied in chunks.
pub(crate) fn create_segment_copying(
    storage: &dyn Storage,
    dir: &Path,
    base: u64,
    src: &dyn StorageFile,
    src_path: &Path,
    len: u64,
    trailer: &[u8],
) -> Result<Arc<SegmentRef>> {
    let written = copy_file_atomically(storage, dir, &segment_file_name(base), src, src_path, len, trailer)?;
    open_created_segment(storage, dir, base, written)
}

/// Creates the file `name` in `dir` through a temporary file that `write` fills, synced,
/// renamed into place and the directory synced: after a crash the name either does not
/// exist or holds all that `write` wrote.
fn write_file_atomically_with(
    storage: &dyn Storage,
    dir: &Path,
    name: &str,
    write: &mut dyn FnMut(&dyn StorageFile, &Path) -> Result<()>,
) -> Result<()> {
    let tmp: PathBuf = dir.join(format!("{name}.tmp"));
    let path = dir.join(name);
    let s = storage;
    let io = |p: &PathBuf| {
        let p = p.clone();
        move |e| WalError::io(p, e)
    };
    let result = (|| {
        // A leftover from an earlier failed attempt is garbage by construction; any
        // failure other than its absence (a dead disk, a power loss) stops here.
        match s.remove_file(&tmp) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(WalError::io(&tmp, e)),
        }
        let f = s.open(&tmp, OpenMode::CreateNew).map_err(io(&tmp))?;
        write(&*f, &tmp)?;
        f.sync_data().map_err(io(&tmp))?;
        s.rename(&tmp, &path).map_err(io(&path))?;
        let d = dir.to_path_buf();
        s.sync_dir(dir).map_err(io(&d))
    })();
    if result.is_err() {
        let _ = s.remove_file(&tmp);
    }
    result
}

/// Sets `flag` to `on` and its gauge to 1 or 0 with it, when it changes: only the
/// writer thread sets them, so the two never disagree for long. (The gauge is named
/// where it is called: the daemon's metric catalog test reads literal names.)
fn set_flag(flag: &std::sync::atomic::AtomicBool, on: bool, gauge: impl FnOnce() -> metrics::Gauge) {
    if flag.load(Ordering::Relaxed) != on {
        flag.store(on, Ordering::Release);
        gauge().set(if on { 1.0 } else { 0.0 });
    }
}
