//! How a log is opened: sizes, limits, sync policy, recovery mode.

use std::time::Duration;

use crate::error::{Result, WalError};
use crate::format::{FRAME_HEADER_LEN, OFFSET_MAX, RECORD_MAX_BYTES, SEAL_LEN, SEGMENT_HEADER_LEN};

/// When an append's bytes are made durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncPolicy {
    /// Every append resolves only after the bytes holding it were written and
    /// `fdatasync`ed. Concurrent appends share one write and one sync. The only policy
    /// under which a resolved append survives a power loss.
    Always,
    /// Appends resolve once written to the operating system; the log syncs at most this
    /// long after the first unsynced write. A process crash loses nothing (the kernel
    /// holds the bytes); a power loss or kernel crash loses up to this window of resolved
    /// appends, and so may a failed sync, after which the log is poisoned until reopened
    /// (it never answers those offsets to other appends). Readers still see only synced
    /// records.
    Interval(Duration),
}

/// What opening does about damage to durable bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryMode {
    /// Damage anywhere but a torn tail is an error naming the file and byte position.
    Strict,
    /// Keep the valid prefix of the log up to the first damage, move every later segment
    /// file into `damaged/` (kept for the operator, never deleted), and continue with
    /// offsets past any the damaged part could have held, so no offset is ever reused.
    Salvage,
}

#[derive(Debug, Clone)]
pub struct WalOptions {
    /// A segment is sealed and a new one started once the next write would take it past
    /// this size. A single batch larger than this gets a segment of its own.
    pub segment_max_bytes: u64,
    /// The total size of all segment files the log may hold. An append that would pass
    /// it fails with [`WalError::Full`]; nothing is ever evicted to make room. A batch
    /// that could not fit even in an empty log fails with [`WalError::BatchTooLarge`]
    /// (see [`WalOptions::batch_max_bytes`]).
    pub max_bytes: u64,
    /// The largest record accepted, at most [`RECORD_MAX_BYTES`].
    pub record_max_bytes: u32,
    pub sync: SyncPolicy,
    pub recovery: RecoveryMode,
    /// The offset of the first record of a brand-new log directory. Ignored when the
    /// directory already holds a log.
    pub initial_offset: u64,
    /// How many appends may wait for the writer at once; more wait for a slot. Bounds
    /// the memory held by queued appends. At most [`QUEUE_MAX_APPENDS_MAX`].
    pub queue_max_appends: usize,
    /// How many bytes of records may wait for the writer at once (counted in KiB; a batch
    /// larger than this waits until nothing else is queued, then goes alone). With the
    /// count alone, appends whose callers went away (a client that disconnected after
    /// sending its body) could queue `queue_max_appends` records of up to
    /// `record_max_bytes` each. 64 MiB; at most [`QUEUE_MAX_BYTES_MAX`].
    pub queue_max_bytes: u64,
    /// The writer stops taking queued appends into a group once the group holds this
    /// many bytes, so one write and sync carries at most this plus one batch (a batch
    /// larger than this goes with whatever was queued before it). Bounds the write
    /// buffer.
    pub group_max_bytes: usize,
    /// When a write would grow the tail segment's file, the writer also writes this many
    /// zero bytes after it (never past `segment_max_bytes`), so the group commits that
    /// follow overwrite bytes the file already has: their `fdatasync` then persists no
    /// change of size (on ext4, one device write fewer per sync). 0 turns it off; at most
    /// [`PREALLOCATE_BYTES_MAX`]. The zeros read as a torn tail after a crash and are cut
    /// by the next open; a seal and a clean close cut them first.
    pub preallocate_bytes: u64,
}

/// The default of [`WalOptions::preallocate_bytes`]: at 1 KiB records, one file-size
/// change per thousand or so records instead of one per group commit, for at most 1 MiB of
/// zeros on disk beyond what the log holds.
pub const PREALLOCATE_BYTES_DEFAULT: u64 = 1024 * 1024;

/// The most [`WalOptions::preallocate_bytes`] may be: the zeros go through the writer's
/// buffer with the group they follow, so this bounds that buffer's growth.
pub const PREALLOCATE_BYTES_MAX: u64 = 64 * 1024 * 1024;

/// The largest `queue_max_bytes`: 64 GiB.
pub const QUEUE_MAX_BYTES_MAX: u64 = 64 * 1024 * 1024 * 1024;

/// The largest `queue_max_appends`: 64 times the default, far above any useful setting,
/// and far below what the slots' semaphore can count (it panics past that).
pub const QUEUE_MAX_APPENDS_MAX: usize = 1024 * 1024;

/// The largest batch (its records plus one frame header each) a log of `max_bytes` can
/// ever take: an empty log holds its active segment's header, and the writer keeps room
/// for a seal and the next segment's header beside every batch.
pub(crate) fn batch_max_bytes(max_bytes: u64) -> u64 {
    max_bytes.saturating_sub(SEAL_LEN + 2 * SEGMENT_HEADER_LEN)
}

impl Default for WalOptions {
    fn default() -> Self {
        WalOptions {
            segment_max_bytes: 64 * 1024 * 1024,
            max_bytes: 8 * 1024 * 1024 * 1024,
            record_max_bytes: RECORD_MAX_BYTES,
            sync: SyncPolicy::Always,
            recovery: RecoveryMode::Strict,
            initial_offset: 0,
            queue_max_appends: 16 * 1024,
            queue_max_bytes: 64 * 1024 * 1024,
            group_max_bytes: 16 * 1024 * 1024,
            preallocate_bytes: PREALLOCATE_BYTES_DEFAULT,
        }
    }
}

impl WalOptions {
    /// The largest batch, in bytes of records plus their 32-byte frame headers, this log
    /// can ever take, however much is released. A larger one is refused with
    /// [`WalError::BatchTooLarge`].
    pub fn batch_max_bytes(&self) -> u64 {
        batch_max_bytes(self.max_bytes)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(WalError::InvalidOptions(m));
        let min_segment = SEGMENT_HEADER_LEN + 2 * FRAME_HEADER_LEN;
        if self.segment_max_bytes < min_segment {
            return bad(format!("segment_max_bytes must be at least {min_segment}"));
        }
        if self.segment_max_bytes.checked_mul(2).is_none_or(|twice| self.max_bytes < twice) {
            return bad(format!(
                "max_bytes ({}) must be at least twice segment_max_bytes ({}): space is freed a whole segment at a time",
                self.max_bytes, self.segment_max_bytes
            ));
        }
        if self.record_max_bytes == 0 || self.record_max_bytes > RECORD_MAX_BYTES {
            return bad(format!("record_max_bytes must be between 1 and {RECORD_MAX_BYTES}"));
        }
        if self.initial_offset > OFFSET_MAX {
            return bad(format!("initial_offset must be at most {OFFSET_MAX}"));
        }
        if self.queue_max_appends == 0 || self.queue_max_appends > QUEUE_MAX_APPENDS_MAX {
            return bad(format!("queue_max_appends must be between 1 and {QUEUE_MAX_APPENDS_MAX}"));
        }
        if self.queue_max_bytes == 0 || self.queue_max_bytes > QUEUE_MAX_BYTES_MAX {
            return bad(format!("queue_max_bytes must be between 1 and {QUEUE_MAX_BYTES_MAX}"));
        }
        if self.group_max_bytes == 0 {
            return bad("group_max_bytes must be at least 1".into());
        }
        if self.preallocate_bytes > PREALLOCATE_BYTES_MAX {
            return bad(format!("preallocate_bytes must be at most {PREALLOCATE_BYTES_MAX}"));
        }
        if let SyncPolicy::Interval(d) = self.sync
            && (d.is_zero() || d > Duration::from_secs(60))
        {
            return bad("sync interval must be between 1 ms and 60 s".into());
        }
        Ok(())
    }
}
