//! The log's errors. Each variant is one thing a caller can act on differently.

use std::io;
use std::path::PathBuf;

use crate::format::{FrameProblem, HeaderProblem};

/// Where in the log a problem is: a file and a byte position in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub file: PathBuf,
    pub position: u64,
}

impl std::fmt::Display for Location {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at byte {}", self.file.display(), self.position)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WalError {
    /// The append would take the log past its `max_bytes`. Nothing was written and
    /// nothing was evicted; retry after the owner released space.
    #[error("log is full: {used_bytes} of {max_bytes} bytes used, the append needs {needed_bytes}")]
    Full { used_bytes: u64, max_bytes: u64, needed_bytes: u64 },

    #[error("record of {len} bytes exceeds the limit of {max} bytes")]
    RecordTooLarge { len: usize, max: u32 },

    /// The batch could never fit in this log, however much is released: its records and
    /// their frame headers take more than an empty log has room for
    /// ([`crate::WalOptions::batch_max_bytes`]). Permanent: nothing was written, and a
    /// retry of the same batch fails the same way.
    #[error(
        "batch of {batch_bytes} bytes (records and frame headers) can never fit in the log, which takes at most {max_batch_bytes} in one batch"
    )]
    BatchTooLarge { batch_bytes: u64, max_batch_bytes: u64 },

    #[error("an append needs at least one record")]
    EmptyBatch,

    #[error("offsets exhausted: the log cannot assign {needed} more offsets after {next}")]
    OffsetsExhausted { next: u64, needed: u64 },

    /// The offset was released and its segment may be gone.
    #[error("offset {offset} was released; the log starts at {start}")]
    Released { offset: u64, start: u64 },

    #[error("offset {offset} is beyond the end of the log ({end})")]
    BeyondEnd { offset: u64, end: u64 },

    #[error("log directory {0} is locked by another writer")]
    Locked(PathBuf),

    #[error("{0} holds no log (no segment files)")]
    NotALog(PathBuf),
    /// The directory holds a salvage copy that never finished (its
    /// `salvage-incomplete` file is there): its segments are a part of a copy, not a log.
    #[error("{0} holds a salvage copy that did not finish, not a log: remove the directory and salvage again")]
    UnfinishedSalvage(PathBuf),

    /// A copy meant to replace the log was asked for while a writer holds it
    /// ([`crate::salvage_copy::salvage_copy_of_a_stopped_log`]): made now, it would lack
    /// everything the writer appends after it. Nothing was written.
    #[error(
        "a running writer holds the log in {0}: stop it first (a copy made beside it would lack everything it appends after the copy)"
    )]
    WriterRunning(PathBuf),

    /// A read-only open beside a running writer could not read the writer's durable
    /// watermark consistently (the writer is starting, or kept moving); retrying later
    /// usually succeeds.
    #[error("{dir}: a running writer holds this log and its durable state could not be read consistently: {why}")]
    Unsettled { dir: PathBuf, why: String },

    /// The log's `log-id` is not whole ([`crate::identity`]); a writable open replaces it
    /// ([`crate::OpenReport::log_id_damaged`]).
    #[error("{path}: the log's identity is damaged ({problem})")]
    BadLogId { path: PathBuf, problem: &'static str },

    #[error("log is open read-only")]
    ReadOnly,

    #[error("log is closed")]
    Closed,

    /// A write or sync failed and the log could not return to a state it can vouch for,
    /// or (under `SyncPolicy::Interval`) a failed sync may have lost appends already
    /// answered. Nothing more will be appended through this handle; reopen the log, which
    /// recovers exactly what is durable.
    #[error("log stopped accepting appends after a storage failure: {0}")]
    Poisoned(String),

    #[error("{location}: bad segment header: {problem}")]
    BadSegmentHeader { location: Location, problem: HeaderProblem },

    /// Damage to bytes that were durable: never repaired silently.
    #[error("{location}: corrupt record: {problem}")]
    Corrupt { location: Location, problem: FrameProblem },

    /// A segment is missing or does not continue its predecessor.
    #[error("{location}: offsets do not continue: expected {expected}, found {found}")]
    Gap { location: Location, expected: u64, found: u64 },

    /// A sealed segment names where its successor starts, but no segment follows it.
    #[error("{location}: the segment is sealed at offset {next_offset}, but no segment follows it")]
    MissingSuccessor { location: Location, next_offset: u64 },

    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error("invalid options: {0}")]
    InvalidOptions(String),
}

/// ENOSPC or EDQUOT: the file system, not the log, is out of room.
pub fn is_out_of_space(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded)
}

impl WalError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> WalError {
        WalError::Io { path: path.into(), source }
    }

    /// True for damage that only an operator can deal with (salvage, restore). A segment
    /// of another format version whose header checks is not damage: a build that reads
    /// that version can read it, and no salvage of this one may copy or move it.
    pub fn is_corruption(&self) -> bool {
        match self {
            WalError::BadSegmentHeader { problem, .. } => !problem.is_other_version(),
            WalError::Corrupt { .. } | WalError::Gap { .. } | WalError::MissingSuccessor { .. } => true,
            _ => false,
        }
    }
}

pub type Result<T, E = WalError> = std::result::Result<T, E>;
