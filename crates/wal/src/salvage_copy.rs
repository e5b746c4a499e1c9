//! Salvage by copy: every whole batch of a damaged log that still checks, copied into a
//! new log directory under its original offsets, the source left untouched.
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
//! - Batches are copied whole or not at all, as recovery keeps them: a batch is copied
//!   only when its every record checked, in offset order, from a frame where a batch is
//!   known to begin (the first frame of a file, or the frame right after one whose
//!   checked header ends a batch) through the one flagged `END_OF_BATCH`, each copied
//!   frame keeping its flag. The records of a batch whose closing record was lost (a
//!   write that never finished, damage, a seal or an offset out of sequence, the end of
//!   the file) or that may have lost its first records (damage just before them) are
//!   left out and reported as skipped, with their count: copied, they would pass for a
//!   whole batch that was never stored whole.
//! - Every record keeps its offset, so the delivery cursors stored beside the log stay
//!   true for the copy. Missing offsets start a new segment flagged `GAP_BEFORE`, which
//!   the log accepts as a salvage gap, and the copy reports (`OpenReport::missing_ranges`,
//!   which the daemon's idempotency index forgets keys by). That includes offsets missing
//!   before the first record copied: the copy's first segment is flagged when the source's
//!   first offset was not copied, or the source's first segment was itself flagged (or
//!   its header does not check, and so cannot say it was not).
//! - A frame whose header checks where the walk arrived by following lengths, but whose
//!   payload (or offset) does not, is skipped whole, as recovery skips it: its payload
//!   is a sender's bytes, and is never read as frames. After damage to a header the walk
//!   resynchronises byte by byte on the next frame that checks and claims an offset its
//!   position can hold (offsets are dense, and each record takes a frame header at
//!   least); every skipped byte range (a bad segment header included) is reported with
//!   its file and position. Zeros to the end of a file are the zeros the writer writes ahead of
//!   its records, not damage: wherever the walk meets them (at a frame position, or
//!   among bytes it is skipping, which then end where the zeros begin) they end the
//!   file's walk unreported.
//! - Each new segment is written whole (temporary file, sync, rename, directory sync),
//!   so an interrupted copy leaves only whole segments and `*.tmp` garbage.
//! - A copy that did not finish is never taken for a log: a `salvage-incomplete` file
//!   is made durable in the new directory before its first segment, and removed
//!   (durably) only once the copy is whole and confirmed: no writer took the log while
//!   it was copied, whether it still holds it (the lock) or let it go again (what it
//!   would leave changed, `watermark::footprint`, is the same before and after).
//!   Every open, `verify` included, refuses a directory holding it
//!   (`WalError::UnfinishedSalvage`), and so does a second copy into it.

use std::path::{Path, PathBuf};

use crate::error::{Result, WalError};
use crate::format::{
    FLAG_END_OF_BATCH, FRAME_HEADER_LEN, FrameHeader, OFFSET_MAX, SEGMENT_FLAG_GAP_BEFORE, SEGMENT_HEADER_LEN,
    SegmentHeader, parse_segment_file_name, segment_file_name,
};
use crate::inspect::VerifyProgress;
use crate::scan::ChunkReader;
use crate::storage::{OpenMode, Storage};
use crate::watermark::Bound;

/// The largest new segment written (a single larger batch gets a segment of its own).
const COPY_SEGMENT_BYTES: usize = 64 * 1024 * 1024;

/// Bytes of a source segment that were skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub file: PathBuf,
    /// First and one-past-last byte position skipped.
    pub from: u64,
    pub to: u64,
    /// Records in the range that checked but were left out because their batch is not
    /// whole in the source; 0 for bytes that do not check.
    pub records: u64,
    pub why: String,
    /// At the end of the source's tail, with nothing after it but the zeros written
    /// ahead, not vouched for by a clean shutdown or a live writer's watermark, and with
    /// no later frame proving it durable: what a write cut short by a crash leaves, a
    /// torn tail as recovery calls it (and cuts), whose events were never answered 200.
    /// Left out all the same, but no damage.
    pub torn_tail: bool,
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
    /// Where the copy's log continues (its `next_offset` once opened): past every offset
    /// a record of the source may have had, copied or not, so that no offset that named
    /// a record is given to another (see FORMAT.md, "Salvage"). Above `next_offset` when
    /// records or damaged bytes were left out after the last copied one, or the source's
    /// newest segment starts above it; the offsets in between are
    /// [`reserved_offsets`](Self::reserved_offsets).
    pub end_offset: u64,
    /// Offsets from the source's first segment's base to the last copied record that the
    /// copy does not hold (no frame that checks held them, or their batch was not whole):
    /// `(first, last)` inclusive. Each named a record that is lost.
    pub missing_offsets: Vec<(u64, u64)>,
    /// Offsets past the last copied record up to `end_offset`, `(first, last)` inclusive,
    /// which the copy gives to no new record. An upper bound, not a count: they may have
    /// named records of what was skipped after the last copied one (damaged bytes are
    /// counted at the most records they could hold), or none at all (the source's own
    /// newest segment started above them).
    pub reserved_offsets: Option<(u64, u64)>,
    /// Offsets between two of the source's segments that the source itself does not
    /// hold, as its later segment's header says (`GAP_BEFORE`: an earlier salvage skipped
    /// them, and reported them then), where the earlier segment ended clean: nothing is
    /// lost now. The copy keeps the gap. `(first, last)` inclusive.
    pub source_gaps: Vec<(u64, u64)>,
    pub skipped: Vec<Skipped>,
    /// The identity the copy carries: its source's ([`crate::identity`]; the copy holds
    /// the same records at the same offsets). `None` when the source had none that reads
    /// whole: the copy's first writable open gives it a new one.
    pub log_id: Option<u64>,
}

impl CopyReport {
    /// Records that checked but were left out because their batch is not whole in the
    /// source.
    pub fn partial_batch_records(&self) -> u64 {
        self.skipped.iter().map(|s| s.records).sum()
    }

    /// Whether anything was left out but a torn tail: damage, records of a batch not
    /// whole elsewhere than at the tail's end, or offsets missing.
    pub fn left_out_more_than_a_torn_tail(&self) -> bool {
        self.skipped.iter().any(|s| !s.torn_tail) || !self.missing_offsets.is_empty()
    }
}

struct Out<'a> {
    storage: &'a dyn Storage,
    dir: &'a Path,
    buf: Vec<u8>,
    base: u64,
    next: u64,
    gap_before: bool,
    written: usize,
    /// The base of the source's first segment, and whether offsets may be missing below
    /// it (its header is flagged `GAP_BEFORE`, or does not check).
    source_first: u64,
    source_gap_before: bool,
    /// The source's own gap before the segment being walked: from where the segment
    /// before it ended clean (its last record checked, nothing after it) to its base.
    source_gap: Option<(u64, u64)>,
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

    fn push(&mut self, offset: u64, payload: &[u8], crc: u32, ends_batch: bool) {
        let h = FrameHeader {
            payload_len: payload.len() as u32,
            offset,
            // Everything before this frame is durable by the time anyone reads it.
            synced_len: self.buf.len() as u64,
            flags: if ends_batch { FLAG_END_OF_BATCH } else { 0 },
            payload_crc: crc,
        };
        self.buf.extend_from_slice(&h.encode());
        self.buf.extend_from_slice(payload);
        self.next = offset + 1;
    }

    fn holds_records(&self) -> bool {
        self.buf.len() as u64 > SEGMENT_HEADER_LEN
    }

    /// Adds a whole batch after the last copied record `last`, in a new segment when the
    /// offsets do not continue or the current one has no room for all of it.
    fn push_batch(&mut self, report: &mut CopyReport, last: &mut Option<u64>, batch: &Batch) -> Result<()> {
        let first = batch.first;
        let contiguous = last.is_some_and(|l| l + 1 == first);
        if last.is_none() && first > self.source_first {
            report.missing_offsets.push((self.source_first, first - 1));
        }
        if !self.holds_records() {
            let gap = match last {
                Some(_) => !contiguous,
                None => first > self.source_first || self.source_gap_before,
            };
            self.start(first, gap);
        } else if !contiguous
            || self.buf.len() as u64 + batch.frame_bytes() + FRAME_HEADER_LEN > COPY_SEGMENT_BYTES as u64
        {
            self.finish(Some(if contiguous { first } else { self.next }))?;
            self.start(first, !contiguous);
        }
        if let Some(l) = *last
            && !contiguous
        {
            if self.source_gap == Some((l + 1, first - 1)) {
                report.source_gaps.push((l + 1, first - 1));
            } else {
                report.missing_offsets.push((l + 1, first - 1));
            }
        }
        let mut at = 0;
        for (i, h) in batch.headers.iter().enumerate() {
            let payload = &batch.payloads[at..at + h.payload_len as usize];
            at += payload.len();
            self.push(h.offset, payload, h.payload_crc, i + 1 == batch.headers.len());
            report.payload_bytes += u64::from(h.payload_len);
        }
        report.records += batch.headers.len() as u64;
        report.first_offset.get_or_insert(first);
        *last = Some(batch.next - 1);
        Ok(())
    }

    /// Writes the segment being built as the copy's tail, unsealed, even with no record.
    fn write_tail(&mut self) -> Result<()> {
        crate::writer::create_segment_with(self.storage, self.dir, self.base, &self.buf)?;
        self.written += 1;
        self.buf.clear();
        Ok(())
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

/// The records of the batch the walk is in, held until its closing record checks.
struct Batch {
    /// Byte positions of its first frame and just past its last.
    from: u64,
    to: u64,
    /// It began where a batch is known to begin: once it closes, it is whole.
    known_start: bool,
    first: u64,
    /// The offset after its last record.
    next: u64,
    headers: Vec<FrameHeader>,
    payloads: Vec<u8>,
}

impl Batch {
    fn frame_bytes(&self) -> u64 {
        self.headers.iter().map(FrameHeader::frame_len).sum()
    }

    /// Reports the batch as left out; `closed`: its closing record checked. Its records'
    /// offsets named records: `named_until` is raised past them.
    fn leave_out(self, report: &mut CopyReport, path: &Path, closed: bool, named_until: &mut u64) {
        *named_until = (*named_until).max(self.next);
        let n = self.headers.len() as u64;
        let why = match (self.known_start, closed) {
            (true, _) => "whose closing record was lost",
            (false, true) => "whose first records may have been lost before them",
            (false, false) => "whose first records may have been lost before them, and its closing record after them",
        };
        let (first, last) = (self.first, self.next - 1);
        let why = format!("{n} record(s) of a batch {why} (offsets {first}..={last})");
        let (from, to) = (self.from, self.to);
        report.skipped.push(Skipped { file: path.to_path_buf(), from, to, records: n, why, torn_tail: false });
    }
}

/// What the walk found at a position.
enum Found {
    Seal,
    Record(FrameHeader),
    /// Bytes that do not hold a frame that checks. `batch_after`: the frame's header
    /// checked and ends a batch (only its payload did not), so a batch begins where it
    /// ends. `frame_end`: the frame's header checked (its payload, or its offset, did
    /// not), so its extent is known: where it ends.
    Bad {
        why: String,
        batch_after: Option<u64>,
        frame_end: Option<u64>,
    },
}

/// Copies every whole batch of the log in `src` that still checks into a new log in
/// `dst`, which must not hold a log yet. The source is opened read-only and never changed. If a
/// writer took the source's lock while it was copied (the daemon started), the copy does
/// not stand: `Err(Unsettled)`, and `dst` is to be removed and the copy made again.
/// Beside a writer that has not published its watermark yet (it is recovering) it waits
/// for one, as the other read-only openers do, up to 5 s, before writing anything.
pub fn salvage_copy(storage: &dyn Storage, src: &Path, dst: &Path) -> Result<CopyReport> {
    salvage_copy_with_progress(storage, src, dst, &mut |_| {})
}

/// [`salvage_copy`], telling `progress` how many of the source's bytes were walked, at
/// least once per [`PROGRESS_EVERY_BYTES`] and at the end of each segment. The total is
/// the segments' lengths when the copy began (a segment that cannot be opened then counts
/// nothing), so `bytes_done` may pass it beside a live writer; a progress bar, not a bound.
pub fn salvage_copy_with_progress(
    storage: &dyn Storage,
    src: &Path,
    dst: &Path,
    progress: &mut dyn FnMut(VerifyProgress),
) -> Result<CopyReport> {
    copy_checked(storage, src, dst, false, progress)
}

/// [`salvage_copy_with_progress`] for a copy that is to replace the log: refused with
/// `Err(WriterRunning)`, before anything is written, when a writer holds the source. The
/// check is the read of the bound the copy is made to, so a writer that takes the log
/// just before cannot slip between them; one that takes it while the copy is made voids
/// the copy (`Err(Unsettled)`), as for [`salvage_copy`].
pub fn salvage_copy_of_a_stopped_log(
    storage: &dyn Storage,
    src: &Path,
    dst: &Path,
    progress: &mut dyn FnMut(VerifyProgress),
) -> Result<CopyReport> {
    copy_checked(storage, src, dst, true, progress)
}

fn copy_checked(
    storage: &dyn Storage,
    src: &Path,
    dst: &Path,
    refuse_a_writer: bool,
    progress: &mut dyn FnMut(VerifyProgress),
) -> Result<CopyReport> {
    // Only the bound is waited for: once copying began, `dst` holds a log and a second
    // attempt would refuse it.
    let read = crate::watermark::read_settled(storage, src, Ok)?;
    if refuse_a_writer && matches!(read, Bound::Watermark(_)) {
        return Err(WalError::WriterRunning(src.to_path_buf()));
    }
    // With no writer, what one that came and went while the copy was made would leave
    // changed (it may have appended records the copy lacks).
    let before = match read {
        Bound::None => Some(crate::watermark::footprint(storage, src)?),
        Bound::Watermark(_) => None,
    };
    // A copy that failed is void too if a writer started under it (its recovery removes
    // or changes files the copy reads): unsettled, to be made again.
    let report = copy_bounded(storage, src, dst, read, progress)
        .map_err(|e| crate::watermark::unsettled_or(storage, src, read, e))?;
    crate::watermark::confirm_unbounded(storage, src, read)?;
    if let Some(before) = before
        && crate::watermark::footprint(storage, src)? != before
    {
        return Err(crate::watermark::unsettled(src, "a writer took the log and let it go again while it was copied"));
    }
    crate::recovery::remove_durably(storage, dst, crate::SALVAGE_INCOMPLETE_FILE)?;
    Ok(report)
}

/// How often, in bytes walked, the copy tells its progress: often enough for a bar to
/// move several times a second at disk speed, rarely enough to cost nothing.
pub const PROGRESS_EVERY_BYTES: u64 = 1 << 20;

/// Refuses a log with a segment another format version wrote (a newer build's), before
/// anything is made at the copy's directory: its frames are not this version's to read,
/// and a copy begun would be left unfinished, to be removed by hand, for a log that no
/// salvage of this build can copy. A segment that cannot be opened or read here is left
/// to the copy, which reports it as it finds it.
fn refuse_other_versions(storage: &dyn Storage, src: &Path, bases: &[u64]) -> Result<()> {
    for &base in bases {
        let path = src.join(segment_file_name(base));
        let Ok(file) = storage.open(&path, OpenMode::Read) else { continue };
        let Ok(len) = file.len() else { continue };
        let mut r = ChunkReader::new(&*file, len);
        if let Ok(Some(b)) = r.get(0, SEGMENT_HEADER_LEN as usize)
            && let Err(p) = SegmentHeader::decode(b)
            && p.is_other_version()
        {
            return Err(WalError::BadSegmentHeader {
                location: crate::error::Location { file: path, position: 0 },
                problem: p,
            });
        }
    }
    Ok(())
}

fn copy_bounded(
    storage: &dyn Storage,
    src: &Path,
    dst: &Path,
    read: Bound,
    progress: &mut dyn FnMut(VerifyProgress),
) -> Result<CopyReport> {
    let bound = match read {
        Bound::Watermark(w) => Some(w),
        Bound::None => None,
    };
    let names = storage.list_dir(src).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => WalError::NotALog(src.to_path_buf()),
        _ => WalError::io(src, e),
    })?;
    // A copy cut short holds a prefix of its source: copied again, the marker would be
    // gone and the prefix taken for the log.
    if names.iter().any(|n| n == crate::SALVAGE_INCOMPLETE_FILE) {
        return Err(WalError::UnfinishedSalvage(src.to_path_buf()));
    }
    let mut bases: Vec<u64> = names.iter().filter_map(|n| parse_segment_file_name(n)).collect();
    bases.sort_unstable();
    if let Some(w) = bound {
        bases.retain(|&b| b <= w.segment_base);
        // Beside a live writer, the watermark's segment released since it was read: the
        // read does not stand (as for the open), rather than "not a log".
        if bases.last() != Some(&w.segment_base) {
            return Err(crate::watermark::unsettled(src, "the durable watermark's segment was released"));
        }
    }
    if bases.is_empty() {
        return Err(WalError::NotALog(src.to_path_buf()));
    }
    refuse_other_versions(storage, src, &bases)?;
    crate::storage::create_dir_all_durably(storage, dst).map_err(|e| WalError::io(dst, e))?;
    let existing = storage.list_dir(dst).map_err(|e| WalError::io(dst, e))?;
    if existing.iter().any(|n| n == crate::SALVAGE_INCOMPLETE_FILE) {
        return Err(WalError::InvalidOptions(format!(
            "{} holds a salvage copy that did not finish; remove the directory and salvage again",
            dst.display()
        )));
    }
    if existing.iter().any(|n| parse_segment_file_name(n).is_some()) {
        return Err(WalError::InvalidOptions(format!(
            "{} already holds a log; salvage needs a new directory",
            dst.display()
        )));
    }
    // Durable before the first segment: a copy cut short is never taken for a log.
    crate::writer::write_file_atomically(
        storage,
        dst,
        crate::SALVAGE_INCOMPLETE_FILE,
        b"a salvage copy is being made\n",
    )?;
    let mut report = CopyReport::default();
    // A damaged identity is not copied: the copy has none, as a source without one (its
    // first writable open gives it one). Any other failure to read it fails the copy.
    match crate::identity::read(storage, src) {
        Ok(Some(id)) => {
            crate::identity::write(storage, dst, id)?;
            report.log_id = Some(id);
        }
        Ok(None) | Err(WalError::BadLogId { .. }) => {}
        Err(e) => return Err(e),
    }
    let mut out = Out {
        storage,
        dir: dst,
        buf: Vec::new(),
        base: 0,
        next: 0,
        gap_before: false,
        written: 0,
        source_first: bases[0],
        source_gap_before: false,
        source_gap: None,
    };
    // With no writer bounding the read, the tail is read from the disk as the open reads
    // it (a failed sync's bytes are not on it), unless a clean shutdown vouches for it.
    let marker = if bound.is_none() && names.iter().any(|n| n == crate::CLEAN_MARKER_FILE) {
        crate::recovery::read_marker(storage, &src.join(crate::CLEAN_MARKER_FILE))?
    } else {
        None
    };
    let bytes_total: u64 = bases
        .iter()
        .map(|&base| {
            let len = storage.open(&src.join(segment_file_name(base)), OpenMode::Read).and_then(|f| f.len());
            let len = len.unwrap_or(0);
            bound.filter(|w| w.segment_base == base).map_or(len, |w| len.min(w.durable_len))
        })
        .sum();
    // Bytes of the segments before the one being walked.
    let mut bytes_before = 0u64;
    let mut last: Option<u64> = None;
    // Past every offset a left-out record or a damaged byte range may have named.
    let mut named_until = bases[0];
    // Where the segment walked before ended, if it ended clean: its last record checked
    // and no bytes that do not check came after it.
    let mut previous_clean_end: Option<u64> = None;
    for (i, &base) in bases.iter().enumerate() {
        // The source's log continues at least at its newest segment's base (a tail an
        // in-place salvage started past damaged offsets, say), even with no record in it.
        named_until = named_until.max(base);
        let skipped_before = report.skipped.len();
        let path = src.join(segment_file_name(base));
        let file = storage.open(&path, OpenMode::Read).map_err(|e| match e.kind() {
            // Beside a live writer a listed segment can be released before it is opened.
            std::io::ErrorKind::NotFound if bound.is_some() => {
                crate::watermark::unsettled(src, "a segment was released while the log was being copied")
            }
            _ => WalError::io(&path, e),
        })?;
        let mut len = file.len().map_err(|e| WalError::io(&path, e))?;
        let vouched = marker.is_some_and(|m| m.tail_base == base && m.tail_len == len);
        if bound.is_none() && Some(&base) == bases.last() && !vouched {
            crate::recovery::read_tail_from_disk(&*file, &path);
        }
        if let Some(w) = bound
            && w.segment_base == base
        {
            if len < w.durable_len {
                return Err(crate::watermark::unsettled(src, "the durable watermark is beyond its segment's end"));
            }
            len = w.durable_len;
        }
        let io = |e| WalError::io(&path, e);
        let mut r = ChunkReader::new(&*file, len);
        // A bad header is reported; the frames behind it are still checked one by one
        // (each carries its own offset and checks).
        let header_problem = match r.get(0, SEGMENT_HEADER_LEN as usize).map_err(io)? {
            None => Some("segment header cut short".to_string()),
            Some(b) => match SegmentHeader::decode(b) {
                Ok(h) if h.base_offset == base => {
                    let gap_before = h.flags & SEGMENT_FLAG_GAP_BEFORE != 0;
                    if base == out.source_first {
                        out.source_gap_before = gap_before;
                    }
                    out.source_gap =
                        previous_clean_end.filter(|&end| gap_before && end < base).map(|end| (end, base - 1));
                    None
                }
                Ok(h) => Some(format!("header says base {}, name says {base}", h.base_offset)),
                // Another format version wrote it (a newer build): its frames are not
                // this version's to read, so the copy is refused, not made without them.
                Err(p) if p.is_other_version() => {
                    return Err(WalError::BadSegmentHeader {
                        location: crate::error::Location { file: path.clone(), position: 0 },
                        problem: p,
                    });
                }
                Err(p) => Some(format!("bad segment header: {p}")),
            },
        };
        let header_problem_seen = header_problem.is_some();
        if header_problem_seen {
            out.source_gap = None;
        }
        if let Some(why) = header_problem {
            // A first segment whose header does not check cannot say no offsets are
            // missing below it.
            out.source_gap_before |= base == out.source_first;
            let to = SEGMENT_HEADER_LEN.min(len);
            report.skipped.push(Skipped { file: path.clone(), from: 0, to, records: 0, why, torn_tail: false });
        }
        let mut pos = SEGMENT_HEADER_LEN.min(len);
        // Where the current run of bytes that did not check began, and why.
        let mut bad: Option<(u64, String)> = None;
        // The offset after the last record that checked in this file, and whether bytes
        // that do not check came after it: such bytes may have held later records.
        let mut seen_next = base;
        let mut damage_after_last_record = header_problem_seen;
        // Where a batch is known to begin: a batch never spans files, so at the first frame
        // of each, and then right after each frame whose checked header ends a batch.
        let mut batch_start = Some(pos);
        // The batch the walk is in, copied once its closing record checks.
        let mut batch: Option<Batch> = None;
        // Zeros to the end of a file are what the writer writes ahead of its records:
        // nothing was there. Looked for wherever the walk meets a zero byte that does not
        // check, at a frame position or among skipped bytes, once per run of zeros (the
        // byte before was not zero), so each byte is looked at a bounded number of times.
        let mut in_zeros = false;
        let mut told = pos;
        while pos < len {
            if pos - told >= PROGRESS_EVERY_BYTES {
                progress(VerifyProgress { bytes_done: bytes_before + pos, bytes_total });
                told = pos;
            }
            // A frame must be above the last record copied, and continue the batch the
            // walk is in.
            let floor = batch.as_ref().map_or(last, |b| Some(b.next - 1));
            let found = find(&mut r, &path, base, pos, floor)?;
            match found {
                Found::Seal => {
                    // A seal carries no record, and the writer seals only between batches.
                    in_zeros = false;
                    close_bad(&mut report, &path, &mut bad, pos);
                    let inside =
                        batch.take().map(|b| b.leave_out(&mut report, &path, false, &mut named_until)).is_some();
                    pos += FRAME_HEADER_LEN;
                    batch_start = if inside { None } else { Some(pos) };
                }
                Found::Record(h) => {
                    in_zeros = false;
                    seen_next = h.offset + 1;
                    damage_after_last_record = false;
                    close_bad(&mut report, &path, &mut bad, pos);
                    if let Some(b) = batch.take_if(|b| b.next != h.offset) {
                        // Not the record the batch needs next: it never closed here.
                        b.leave_out(&mut report, &path, false, &mut named_until);
                    }
                    let b = batch.get_or_insert_with(|| Batch {
                        from: pos,
                        to: pos,
                        known_start: batch_start == Some(pos),
                        first: h.offset,
                        next: h.offset,
                        headers: Vec::new(),
                        payloads: Vec::new(),
                    });
                    let payload = r
                        .get(pos + FRAME_HEADER_LEN, h.payload_len as usize)
                        .map_err(io)?
                        .ok_or_else(|| WalError::io(&path, std::io::ErrorKind::UnexpectedEof.into()))?;
                    b.payloads.extend_from_slice(payload);
                    b.headers.push(h);
                    b.next = h.offset + 1;
                    pos += h.frame_len();
                    b.to = pos;
                    if h.ends_batch() {
                        batch_start = Some(pos);
                        if let Some(b) = batch.take() {
                            if b.known_start {
                                out.push_batch(&mut report, &mut last, &b)?;
                            } else {
                                b.leave_out(&mut report, &path, true, &mut named_until);
                            }
                        }
                    }
                }
                Found::Bad { why, batch_after, frame_end } => {
                    if let Some(b) = batch.take() {
                        b.leave_out(&mut report, &path, false, &mut named_until);
                    }
                    let zero = r.get(pos, 1).map_err(io)?.is_some_and(|b| b[0] == 0);
                    if zero && !in_zeros && r.zeros_to_end(pos).map_err(io)? {
                        // Bytes skipped before the zeros end where they begin.
                        close_bad(&mut report, &path, &mut bad, pos);
                        break;
                    }
                    if batch_after.is_some() {
                        batch_start = batch_after;
                    }
                    damage_after_last_record = true;
                    // A frame the walk reached by following lengths, whose header checks:
                    // skipped whole, as recovery skips it. Its payload is a sender's bytes,
                    // and frames a sender wrote into it would check. Only while already
                    // skipping bytes (a header that checks may then be such a frame
                    // itself) does the walk go on byte by byte.
                    let next = match frame_end {
                        Some(end) if bad.is_none() => end,
                        _ => pos + 1,
                    };
                    // In a run of zeros only if the next byte looked at follows this one:
                    // after a frame skipped whole (whose header may begin with a zero
                    // byte), zeros at its end start a run, and are looked at.
                    in_zeros = zero && next == pos + 1;
                    bad.get_or_insert((pos, why));
                    pos = next;
                }
            }
        }
        // A batch never spans files: one still open here never closed.
        if let Some(b) = batch.take() {
            b.leave_out(&mut report, &path, false, &mut named_until);
        }
        close_bad(&mut report, &path, &mut bad, len);
        if i + 1 == bases.len() && bound.is_none() && !vouched {
            mark_torn_tail(&mut report.skipped[skipped_before..], &mut r, &*file, &path, len)?;
        }
        previous_clean_end = (!damage_after_last_record).then_some(seen_next);
        bytes_before += len;
        progress(VerifyProgress { bytes_done: bytes_before, bytes_total });
        if damage_after_last_record
            && let Some(damaged) = report.skipped[skipped_before..].iter().rev().find(|s| s.records == 0)
        {
            // Bytes that do not check after the file's last record may have held records
            // after it (before a record that checks, they could only hold lower offsets):
            // each takes at least one frame header, so `n` bytes hold fewer than
            // `n / 32 + 1` offsets, and none at or past the successor's base.
            let room = (damaged.to - damaged.from) / FRAME_HEADER_LEN + 1;
            let bound = bases.get(i + 1).map_or(u64::MAX, |&next| next);
            named_until = named_until.max(seen_next.saturating_add(room).min(bound));
        }
    }
    let copied_end = last.map_or(out.source_first, |l| l + 1);
    // Never below what was copied; at the very top of the range the log still opens,
    // and appends fail with `OffsetsExhausted`, as after an in-place salvage.
    let end = named_until.min(OFFSET_MAX).max(copied_end);
    if end > copied_end {
        // The last copied record's segment is sealed, and the tail starts past the
        // offsets left out, flagged as a gap.
        report.reserved_offsets = Some((copied_end, end - 1));
        out.finish(Some(copied_end))?;
        out.start(end, true);
        out.write_tail()?;
    } else if out.holds_records() {
        // The last segment stays unsealed: it is the new log's tail.
        out.finish(None)?;
    } else {
        // Nothing to copy: the copy is an empty log at the source's first offset.
        out.start(copied_end, out.source_gap_before);
        out.write_tail()?;
    }
    report.segments_written = out.written;
    report.next_offset = last.map(|l| l + 1);
    report.end_offset = end;
    Ok(report)
}

/// What stands at `pos` of the segment based at `base`: a seal, a record that checks and
/// whose offset is above `floor` and within what its position can hold, or bytes to skip.
fn find(r: &mut ChunkReader<'_>, path: &Path, base: u64, pos: u64, floor: Option<u64>) -> Result<Found> {
    let io = |e| WalError::io(path, e);
    let bad = |why: String| Ok(Found::Bad { why, batch_after: None, frame_end: None });
    let h = match r.get(pos, FRAME_HEADER_LEN as usize).map_err(io)? {
        None => return bad("truncated frame header".to_string()),
        Some(b) => match FrameHeader::decode(b) {
            Err(p) => return bad(p.to_string()),
            Ok(h) => h,
        },
    };
    if h.is_seal() {
        return Ok(Found::Seal);
    }
    // From here on the header checked: its frame's extent is known.
    let frame_end = Some(pos + h.frame_len());
    let bad_frame = |why: String| Ok(Found::Bad { why, batch_after: None, frame_end });
    if h.offset > OFFSET_MAX || floor.is_some_and(|l| h.offset <= l) {
        return bad_frame(format!("frame claims offset {} out of order", h.offset));
    }
    // Offsets are dense and every record takes a frame header at least: a record at
    // `pos` holds an offset no higher than this. A frame that claims more was never
    // written here by the writer (a sender's bytes inside a payload, found while
    // skipping damage), and copied, it would push the records after it out of order.
    let highest = base.saturating_add((pos.saturating_sub(SEGMENT_HEADER_LEN)) / FRAME_HEADER_LEN);
    if h.offset > highest {
        return bad_frame(format!("frame claims offset {}, past the {highest} its position can hold", h.offset));
    }
    match r.get(pos + FRAME_HEADER_LEN, h.payload_len as usize).map_err(io)? {
        None => bad_frame("truncated payload".to_string()),
        Some(p) => match h.check_payload(p) {
            Ok(()) => Ok(Found::Record(h)),
            Err(e) => {
                Ok(Found::Bad { why: e.to_string(), batch_after: frame_end.filter(|_| h.ends_batch()), frame_end })
            }
        },
    }
}

/// Marks as a torn tail ([`Skipped::torn_tail`]) the ranges skipped at the end of the
/// source's tail (`skipped`, in file order): the last one and those right before it,
/// each ending where the next begins, when nothing but zeros follows them and no later
/// frame proves them durable, as recovery decides before it cuts a torn tail.
fn mark_torn_tail(
    skipped: &mut [Skipped],
    r: &mut ChunkReader<'_>,
    file: &dyn crate::storage::StorageFile,
    path: &Path,
    len: u64,
) -> Result<()> {
    let Some(last) = skipped.last() else { return Ok(()) };
    if !r.zeros_to_end(last.to).map_err(|e| WalError::io(path, e))? {
        return Ok(());
    }
    let mut first = skipped.len() - 1;
    while first > 0 && skipped[first - 1].to == skipped[first].from && skipped[first - 1].from > 0 {
        first -= 1;
    }
    // A header that does not check (from 0) is never a torn write: segments are created
    // whole.
    if skipped[first].from == 0 {
        return Ok(());
    }
    if crate::scan::find_proof_of_durable_damage(file, path, len, skipped[first].from)?.is_none() {
        for s in &mut skipped[first..] {
            s.torn_tail = true;
        }
    }
    Ok(())
}

fn close_bad(report: &mut CopyReport, path: &Path, bad: &mut Option<(u64, String)>, to: u64) {
    if let Some((from, why)) = bad.take() {
        report.skipped.push(Skipped { file: path.to_path_buf(), from, to, records: 0, why, torn_tail: false });
    }
}
