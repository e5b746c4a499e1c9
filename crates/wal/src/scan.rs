//! Sequential scanning of one segment file: the single place that walks frames on disk.
//! Recovery, read-only opening, verification and salvage are all built on it.
//!
//! Invariants:
//! - A frame is counted only if its header and payload checksums hold and its offset is
//!   the next in sequence.
//! - A batch counts only once its closing frame (`END_OF_BATCH`) checked: `valid_end` and
//!   `next_offset` always describe whole batches.
//! - A seal counts only above the segment's base (the writer never seals an empty
//!   segment); one at or below it stops the scan as damage (`stop_is_damage`), in the tail
//!   too, never as a torn write.
//! - A scan reads each byte at most once and holds at most one chunk (or one record, if
//!   larger) in memory.

use std::path::Path;

use crate::error::{Location, Result, WalError};
use crate::format::{FRAME_HEADER_LEN, FrameHeader, FrameProblem, SEGMENT_HEADER_LEN};
use crate::storage::{ReadBuffer, StorageFile};

const CHUNK_BYTES: usize = 1024 * 1024;

/// A buffered sequential reader over a file of known length.
pub(crate) struct ChunkReader<'a> {
    file: &'a dyn StorageFile,
    len: u64,
    buf: ReadBuffer,
}

impl<'a> ChunkReader<'a> {
    pub(crate) fn new(file: &'a dyn StorageFile, len: u64) -> ChunkReader<'a> {
        ChunkReader { file, len, buf: ReadBuffer::new(CHUNK_BYTES) }
    }

    /// True if every byte from `pos` to the end is zero: what the writer writes ahead of
    /// its records (`WalOptions::preallocate_bytes`), not damage.
    pub(crate) fn zeros_to_end(&mut self, mut pos: u64) -> std::io::Result<bool> {
        const STEP: u64 = 64 * 1024;
        while pos < self.len {
            let n = STEP.min(self.len - pos) as usize;
            match self.get(pos, n)? {
                Some(b) if b.iter().all(|&x| x == 0) => pos += n as u64,
                _ => return Ok(false),
            }
        }
        Ok(true)
    }

    /// The `n` bytes at `pos`, or `None` if the file ends first.
    pub(crate) fn get(&mut self, pos: u64, n: usize) -> std::io::Result<Option<&[u8]>> {
        self.buf.get(self.file, pos, n, self.len)
    }
}

/// What a scan of one segment found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScanOutcome {
    /// Records in whole batches.
    pub records: u64,
    /// Byte position just past the last whole batch (or the seal).
    pub valid_end: u64,
    /// The offset after the last record of the last whole batch.
    pub next_offset: u64,
    /// The seal's offset, if the segment ends in a valid seal.
    pub sealed: Option<u64>,
    /// The first frame that did not check, and why; `None` if the scan reached the end
    /// of the file on a frame boundary.
    pub stop: Option<(u64, FrameProblem)>,
    /// Checked records after `valid_end` whose batch never closed.
    pub partial_batch_records: u64,
    /// The frame at `stop` checked and is one the writer never writes (a seal at or
    /// below the segment's base): damage wherever it stands, never a torn write, whatever
    /// follows it.
    pub stop_is_damage: bool,
}

/// Scans the segment whose first record is `base`, from its header to `len`, checking
/// every frame. `on_progress` gets the byte position reached after each chunk's worth of
/// frames.
pub(crate) fn scan_segment(
    file: &dyn StorageFile,
    path: &Path,
    base: u64,
    len: u64,
    on_progress: &mut dyn FnMut(u64),
) -> Result<ScanOutcome> {
    let io = |e| WalError::io(path, e);
    let mut r = ChunkReader::new(file, len);
    let mut pos = SEGMENT_HEADER_LEN;
    let mut expected = base;
    let mut out = ScanOutcome {
        records: 0,
        valid_end: SEGMENT_HEADER_LEN,
        next_offset: base,
        sealed: None,
        stop: None,
        partial_batch_records: 0,
        stop_is_damage: false,
    };
    // Records of the batch being read, counted once its closing frame checks.
    let mut batch_records = 0u64;
    let mut last_progress = pos;
    while pos < len {
        if out.sealed.is_some() {
            out.stop = Some((pos, FrameProblem::DataAfterSeal));
            break;
        }
        let header = match r.get(pos, FRAME_HEADER_LEN as usize).map_err(io)? {
            None => {
                out.stop = Some((pos, FrameProblem::Truncated));
                break;
            }
            Some(b) => match FrameHeader::decode(b) {
                Ok(h) => h,
                Err(p) => {
                    out.stop = Some((pos, p));
                    break;
                }
            },
        };
        if header.is_seal() && header.offset <= base {
            // The writer never seals an empty segment: a sealed segment holds at least one
            // record, so its seal names at least `base + 1`. Taken for a seal, this one
            // would make the segment's successor take its own name.
            let problem = FrameProblem::UnexpectedOffset { expected: base.saturating_add(1), found: header.offset };
            out.stop = Some((pos, problem));
            out.stop_is_damage = true;
            break;
        }
        if header.offset != expected {
            out.stop = Some((pos, FrameProblem::UnexpectedOffset { expected, found: header.offset }));
            break;
        }
        if header.is_seal() {
            if batch_records > 0 {
                out.stop = Some((pos, FrameProblem::SealInsideBatch { records: batch_records }));
                break;
            }
            pos += FRAME_HEADER_LEN;
            out.sealed = Some(header.offset);
            out.valid_end = pos;
            continue;
        }
        if header.offset > crate::format::OFFSET_MAX {
            // No record carries u64::MAX (it is kept free for "the offset after the last").
            out.stop = Some((pos, FrameProblem::UnexpectedOffset { expected, found: header.offset }));
            break;
        }
        let payload = match r.get(pos + FRAME_HEADER_LEN, header.payload_len as usize).map_err(io)? {
            None => {
                out.stop = Some((pos, FrameProblem::PayloadTruncated));
                break;
            }
            Some(p) => p,
        };
        if let Err(p) = header.check_payload(payload) {
            out.stop = Some((pos, p));
            break;
        }
        batch_records += 1;
        pos += header.frame_len();
        expected += 1;
        if header.ends_batch() {
            batch_records = 0;
            out.records += expected - out.next_offset;
            out.next_offset = expected;
            out.valid_end = pos;
        }
        if pos - last_progress >= CHUNK_BYTES as u64 {
            on_progress(pos);
            last_progress = pos;
        }
    }
    out.partial_batch_records = batch_records;
    on_progress(pos.min(len));
    Ok(out)
}

/// Looks past a damaged spot at `damage_pos` for a frame that proves the damage hit bytes
/// that were already durable: a checked frame whose `synced_len` lies beyond the damage
/// (it was written when the segment was known durable past that point). Returns its
/// position. Finding none means the damage is a torn write of the unsynced tail.
///
/// When the frame at `damage_pos` has a header that checks (its payload is what failed,
/// or its offset), the frame's extent is known, and the search starts at its end: a
/// sync point (`synced_len`) is always the end of a batch, never inside a frame, and so
/// is every frame written after it. The damaged frame's payload is a sender's bytes,
/// which may hold anything that decodes as a frame header; searching inside it let a
/// crafted body, torn by a crash, pose as proof and refuse the open.
pub(crate) fn find_proof_of_durable_damage(
    file: &dyn StorageFile,
    path: &Path,
    len: u64,
    damage_pos: u64,
) -> Result<Option<u64>> {
    let mut r = ChunkReader::new(file, len);
    let damaged_frame_end = match r.get(damage_pos, FRAME_HEADER_LEN as usize).map_err(|e| WalError::io(path, e))? {
        Some(b) => FrameHeader::decode(b).ok().map(|h| damage_pos.saturating_add(h.frame_len())),
        None => None,
    };
    // The earliest position of a frame written after a sync beyond the damage, and the
    // least such a sync point can be.
    let (mut p, synced_at_least) = match damaged_frame_end {
        Some(end) => (end, end),
        None => (damage_pos + 1, damage_pos + 1),
    };
    while p.saturating_add(FRAME_HEADER_LEN) <= len {
        let b = r.get(p, FRAME_HEADER_LEN as usize).map_err(|e| WalError::io(path, e))?;
        if let Some(b) = b
            && let Ok(h) = FrameHeader::decode(b)
            && h.synced_len >= synced_at_least
            && h.synced_len <= p
        {
            return Ok(Some(p));
        }
        p += 1;
    }
    Ok(None)
}

impl ScanOutcome {
    /// True if what follows the last whole batch of a `len`-byte tail is only the zeros
    /// written ahead of its writes (`WalOptions::preallocate_bytes`): no record of an
    /// unfinished batch, and nothing but zeros to the end, so no write was interrupted.
    pub(crate) fn torn_tail_is_zeros_only(&self, file: &dyn StorageFile, path: &Path, len: u64) -> Result<bool> {
        if self.partial_batch_records > 0 {
            return Ok(false);
        }
        ChunkReader::new(file, len).zeros_to_end(self.valid_end).map_err(|e| WalError::io(path, e))
    }
}

/// Reads and checks the seal at the end of a sealed segment whose first offset is `base`,
/// returning its offset. The writer never seals an empty segment, so a seal at or below
/// `base` is damage.
pub(crate) fn read_seal(file: &dyn StorageFile, path: &Path, base: u64, len: u64) -> Result<u64> {
    let at = len.saturating_sub(FRAME_HEADER_LEN);
    let location = Location { file: path.to_path_buf(), position: at };
    if len < SEGMENT_HEADER_LEN + FRAME_HEADER_LEN {
        return Err(WalError::Corrupt { location, problem: FrameProblem::Truncated });
    }
    let mut b = [0u8; FRAME_HEADER_LEN as usize];
    crate::storage::read_exact_at(file, &mut b, at).map_err(|e| WalError::io(path, e))?;
    match FrameHeader::decode(&b) {
        Ok(h) if h.is_seal() && h.offset > base => Ok(h.offset),
        Ok(h) if h.is_seal() => {
            // A sealed segment holds at least one record: its seal names at least `base + 1`.
            let problem = FrameProblem::UnexpectedOffset { expected: base.saturating_add(1), found: h.offset };
            Err(WalError::Corrupt { location, problem })
        }
        Ok(_) | Err(FrameProblem::BadHeaderChecksum) => {
            Err(WalError::Corrupt { location, problem: FrameProblem::MissingSeal })
        }
        Err(problem) => Err(WalError::Corrupt { location, problem }),
    }
}
