//! Salvage by copy: every record of a damaged log that still checks, copied into a new
//! log directory under its original offset, the source left untouched.
//!
//! `RecoveryMode::Salvage` keeps a log usable in place and gives up everything after the
//! first damage. This is for the day a disk error hit the middle of a log and the records
//! behind the damage matter too: the source is only read (read-only, bounded by a live
//! writer's durable watermark), and the new directory is a log the daemon can open.
//!
//! Invariants:
//! - A record is copied only if its frame header and payload checksums hold, and only
//!   in increasing offset order: a frame whose offset is not above the last copied one
//!   is skipped (a stale or duplicated frame can never shadow a record).
//! - Every record keeps its offset, so the delivery cursors stored beside the log stay
//!   true for the copy. Missing offsets start a new segment flagged `GAP_BEFORE`, which
//!   the log accepts as a salvage gap.
//! - After damage the walk resynchronises byte by byte on the next frame that checks;
//!   every skipped byte range (a bad segment header included) is reported with its file
//!   and position. Zeros to the end of a file are the zeros the writer writes ahead of
//!   its records, not damage: wherever the walk meets them (at a frame position, or
//!   among bytes it is skipping, which then end where the zeros begin) they end the
//!   file's walk unreported.
//! - Each new segment is written whole (temporary file, sync, rename, directory sync),
//!   so an interrupted copy leaves only whole segments and `*.tmp` garbage.

use std::path::{Path, PathBuf};

use crate::error::{Result, WalError};
use crate::format::{
    FLAG_END_OF_BATCH, FRAME_HEADER_LEN, FrameHeader, OFFSET_MAX, SEGMENT_FLAG_GAP_BEFORE, SEGMENT_HEADER_LEN,
    SegmentHeader, parse_segment_file_name, segment_file_name,
};
use crate::scan::ChunkReader;
use crate::storage::{OpenMode, Storage};
use crate::watermark::Bound;

/// The largest new segment written (a single larger record gets a segment of its own).
const COPY_SEGMENT_BYTES: usize = 64 * 1024 * 1024;

/// Bytes of a source segment that were skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub file: PathBuf,
    /// First and one-past-last byte position skipped.
    pub from: u64,
    pub to: u64,
    pub why: String,
}

/// What a salvage copy did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyReport {
    pub records: u64,
    pub payload_bytes: u64,
    pub segments_written: usize,
    pub first_offset: Option<u64>,
    /// The offset after the last copied record.
    pub next_offset: Option<u64>,
    /// Offsets between the first and last copied record that no valid frame held:
    /// `(first, last)` inclusive.
    pub missing_offsets: Vec<(u64, u64)>,
    pub skipped: Vec<Skipped>,
}

struct Out<'a> {
    storage: &'a dyn Storage,
    dir: &'a Path,
    buf: Vec<u8>,
    base: u64,
    next: u64,
    gap_before: bool,
    written: usize,
}

impl Out<'_> {
    fn start(&mut self, base: u64, gap_before: bool) {
        self.buf.clear();
        let flags = if gap_before { SEGMENT_FLAG_GAP_BEFORE } else { 0 };
        self.buf.extend_from_slice(&SegmentHeader { base_offset: base, flags }.encode());
        self.base = base;
        self.next = base;
        self.gap_before = gap_before;
    }

    fn push(&mut self, offset: u64, payload: &[u8], crc: u32) {
        let h = FrameHeader {
            payload_len: payload.len() as u32,
            offset,
            // Everything before this frame is durable by the time anyone reads it.
            synced_len: self.buf.len() as u64,
            flags: FLAG_END_OF_BATCH,
            payload_crc: crc,
        };
        self.buf.extend_from_slice(&h.encode());
        self.buf.extend_from_slice(payload);
        self.next = offset + 1;
    }

    fn holds_records(&self) -> bool {
        self.buf.len() as u64 > SEGMENT_HEADER_LEN
    }

    /// Writes the segment being built; sealed at `seal_at` when a successor follows.
    fn finish(&mut self, seal_at: Option<u64>) -> Result<()> {
        if !self.holds_records() {
            return Ok(());
        }
        if let Some(next) = seal_at {
            let seal = FrameHeader::seal(next, self.buf.len() as u64).encode();
            self.buf.extend_from_slice(&seal);
        }
        crate::writer::create_segment_with(self.storage, self.dir, self.base, &self.buf)?;
        self.written += 1;
        self.buf.clear();
        Ok(())
    }
}

/// Copies every record of the log in `src` that still checks into a new log in `dst`,
/// which must not hold a log yet. The source is opened read-only and never changed. If a
/// writer took the source's lock while it was copied (the daemon started), the copy does
/// not stand: `Err(Unsettled)`, and `dst` is to be removed and the copy made again.
/// Beside a writer that has not published its watermark yet (it is recovering) it waits
/// for one, as the other read-only openers do, up to 5 s, before writing anything.
pub fn salvage_copy(storage: &dyn Storage, src: &Path, dst: &Path) -> Result<CopyReport> {
    // Only the bound is waited for: once copying began, `dst` holds a log and a second
    // attempt would refuse it.
    let read = crate::watermark::read_settled(storage, src, Ok)?;
    let report = copy_bounded(storage, src, dst, read)?;
    crate::watermark::confirm_unbounded(storage, src, read)?;
    Ok(report)
}

fn copy_bounded(storage: &dyn Storage, src: &Path, dst: &Path, read: Bound) -> Result<CopyReport> {
    let bound = match read {
        Bound::Watermark(w) => Some(w),
        Bound::None => None,
    };
    let names = storage.list_dir(src).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => WalError::NotALog(src.to_path_buf()),
        _ => WalError::io(src, e),
    })?;
    let mut bases: Vec<u64> = names.iter().filter_map(|n| parse_segment_file_name(n)).collect();
    bases.sort_unstable();
    if let Some(w) = bound {
        bases.retain(|&b| b <= w.segment_base);
    }
    if bases.is_empty() {
        return Err(WalError::NotALog(src.to_path_buf()));
    }
    crate::storage::create_dir_all_durably(storage, dst).map_err(|e| WalError::io(dst, e))?;
    let existing = storage.list_dir(dst).map_err(|e| WalError::io(dst, e))?;
    if existing.iter().any(|n| parse_segment_file_name(n).is_some()) {
        return Err(WalError::InvalidOptions(format!(
            "{} already holds a log; salvage needs a new directory",
            dst.display()
        )));
    }
    let mut report = CopyReport::default();
    let mut out = Out { storage, dir: dst, buf: Vec::new(), base: 0, next: 0, gap_before: false, written: 0 };
    // With no writer bounding the read, the tail is read from the disk as the open reads
    // it (a failed sync's bytes are not on it), unless a clean shutdown vouches for it.
    let marker = if bound.is_none() && names.iter().any(|n| n == crate::CLEAN_MARKER_FILE) {
        crate::recovery::read_marker(storage, &src.join(crate::CLEAN_MARKER_FILE))?
    } else {
        None
    };
    let mut last: Option<u64> = None;
    for &base in &bases {
        let path = src.join(segment_file_name(base));
        let file = storage.open(&path, OpenMode::Read).map_err(|e| WalError::io(&path, e))?;
        let mut len = file.len().map_err(|e| WalError::io(&path, e))?;
        let vouched = marker.is_some_and(|m| m.tail_base == base && m.tail_len == len);
        if bound.is_none() && Some(&base) == bases.last() && !vouched {
            crate::recovery::read_tail_from_disk(&*file, &path);
        }
        if let Some(w) = bound
            && w.segment_base == base
        {
            len = len.min(w.durable_len);
        }
        let io = |e| WalError::io(&path, e);
        let mut r = ChunkReader::new(&*file, len);
        // A bad header is reported; the frames behind it are still checked one by one
        // (each carries its own offset and checks).
        let header_problem = match r.get(0, SEGMENT_HEADER_LEN as usize).map_err(io)? {
            None => Some("segment header cut short".to_string()),
            Some(b) => match SegmentHeader::decode(b) {
                Ok(h) if h.base_offset == base => None,
                Ok(h) => Some(format!("header says base {}, name says {base}", h.base_offset)),
                Err(p) => Some(format!("bad segment header: {p}")),
            },
        };
        if let Some(why) = header_problem {
            report.skipped.push(Skipped { file: path.clone(), from: 0, to: SEGMENT_HEADER_LEN.min(len), why });
        }
        let mut pos = SEGMENT_HEADER_LEN.min(len);
        // Where the current run of bytes that did not check began, and why.
        let mut bad: Option<(u64, String)> = None;
        // Zeros to the end of a file are what the writer writes ahead of its records:
        // nothing was there. Looked for wherever the walk meets a zero byte that does not
        // check, at a frame position or among skipped bytes, once per run of zeros (the
        // byte before was not zero), so each byte is looked at a bounded number of times.
        let mut in_zeros = false;
        while pos < len {
            let frame = match r.get(pos, FRAME_HEADER_LEN as usize).map_err(io)? {
                None => Err("truncated frame header".to_string()),
                Some(b) => match FrameHeader::decode(b) {
                    Err(p) => Err(p.to_string()),
                    Ok(h) if h.is_seal() => Ok(None),
                    Ok(h) if h.offset > OFFSET_MAX || last.is_some_and(|l| h.offset <= l) => {
                        Err(format!("frame claims offset {} out of order", h.offset))
                    }
                    Ok(h) => match r.get(pos + FRAME_HEADER_LEN, h.payload_len as usize).map_err(io)? {
                        None => Err("truncated payload".to_string()),
                        Some(p) => match h.check_payload(p) {
                            Ok(()) => Ok(Some(h)),
                            Err(e) => Err(e.to_string()),
                        },
                    },
                },
            };
            match frame {
                Ok(None) => {
                    // A seal carries no record.
                    in_zeros = false;
                    close_bad(&mut report, &path, &mut bad, pos);
                    pos += FRAME_HEADER_LEN;
                }
                Ok(Some(h)) => {
                    in_zeros = false;
                    close_bad(&mut report, &path, &mut bad, pos);
                    let payload = r
                        .get(pos + FRAME_HEADER_LEN, h.payload_len as usize)
                        .map_err(io)?
                        .ok_or_else(|| WalError::io(&path, std::io::ErrorKind::UnexpectedEof.into()))?;
                    let contiguous = last.is_some_and(|l| l + 1 == h.offset);
                    let frame_len = h.frame_len() as usize;
                    if !out.holds_records() {
                        out.start(h.offset, last.is_some() && !contiguous);
                    } else if !contiguous || out.buf.len() + frame_len + FRAME_HEADER_LEN as usize > COPY_SEGMENT_BYTES
                    {
                        out.finish(Some(if contiguous { h.offset } else { out.next }))?;
                        out.start(h.offset, !contiguous);
                    }
                    if let Some(l) = last
                        && !contiguous
                    {
                        report.missing_offsets.push((l + 1, h.offset - 1));
                    }
                    out.push(h.offset, payload, h.payload_crc);
                    report.records += 1;
                    report.payload_bytes += u64::from(h.payload_len);
                    report.first_offset.get_or_insert(h.offset);
                    last = Some(h.offset);
                    pos += h.frame_len();
                }
                Err(why) => {
                    let zero = r.get(pos, 1).map_err(io)?.is_some_and(|b| b[0] == 0);
                    if zero && !in_zeros && r.zeros_to_end(pos).map_err(io)? {
                        // Bytes skipped before the zeros end where they begin.
                        close_bad(&mut report, &path, &mut bad, pos);
                        break;
                    }
                    in_zeros = zero;
                    bad.get_or_insert((pos, why));
                    pos += 1;
                }
            }
        }
        close_bad(&mut report, &path, &mut bad, len);
    }
    // The last segment stays unsealed: it is the new log's tail.
    out.finish(None)?;
    report.segments_written = out.written;
    report.next_offset = last.map(|l| l + 1);
    Ok(report)
}

fn close_bad(report: &mut CopyReport, path: &Path, bad: &mut Option<(u64, String)>, to: u64) {
    if let Some((from, why)) = bad.take() {
        report.skipped.push(Skipped { file: path.to_path_buf(), from, to, why });
    }
}
