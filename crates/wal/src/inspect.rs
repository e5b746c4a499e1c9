//! Inspection for operators' tools: list segments, iterate records, verify every byte.
//!
//! Everything here opens the log read-only: it takes no lock, writes nothing, and works
//! beside a running writer (seeing the log as of the moment it looked).
//!
//! Invariants:
//! - `verify` reads every segment once and reports every problem it can reach, each
//!   with a file and byte position: a segment's walk ends at its first frame that does
//!   not check (what follows cannot be told from a payload), but every other segment is
//!   walked, and a damaged segment's seal still says where its successor must begin.
//! - A torn tail (what the next writable open would cut) is reported apart from damage:
//!   it is the normal trace of a crash, not a loss.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Location, Result, WalError};
use crate::format::{
    SEGMENT_FLAG_GAP_BEFORE, SEGMENT_HEADER_LEN, SegmentHeader, parse_segment_file_name, segment_file_name,
};
use crate::reader::Record;
use crate::scan::{find_proof_of_durable_damage, scan_segment};
use crate::storage::{OpenMode, Storage, read_up_to_at};
use crate::{Reader, Wal};

/// One segment as the inspection sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentInfo {
    pub path: PathBuf,
    pub base_offset: u64,
    /// The offset after its last record.
    pub next_offset: u64,
    pub records: u64,
    pub bytes: u64,
    pub sealed: bool,
    /// Offsets before this segment may be missing (a salvage happened).
    pub gap_before: bool,
}

/// Lists the segments of an intact log, oldest first. Sealed segments cost one small
/// read each; the tail is scanned.
pub fn list_segments(storage: Arc<dyn Storage>, dir: &Path) -> Result<Vec<SegmentInfo>> {
    let wal = Wal::open_read_only_with(storage.clone(), dir)?;
    segments_of(&wal)
}

/// The segments of an open log as that handle sees them (so a caller that also reads
/// records through it gets one consistent view), oldest first.
pub fn segments_of(wal: &Wal) -> Result<Vec<SegmentInfo>> {
    let segs: Vec<_> = wal.shared.segments().iter().cloned().collect();
    let mut out = Vec::with_capacity(segs.len());
    for (i, s) in segs.iter().enumerate() {
        let bytes = s.durable_len.load(std::sync::atomic::Ordering::Acquire);
        let mut header = [0u8; SEGMENT_HEADER_LEN as usize];
        read_up_to_at(&*s.file, &mut header, 0).map_err(|e| WalError::io(&s.path, e))?;
        let gap_before = SegmentHeader::decode(&header).is_ok_and(|h| h.flags & SEGMENT_FLAG_GAP_BEFORE != 0);
        let next_offset = if i + 1 < segs.len() {
            crate::scan::read_seal(&*s.file, &s.path, s.base, bytes)?
        } else {
            let out = scan_segment(&*s.file, &s.path, s.base, bytes, &mut |_| {})?;
            out.sealed.unwrap_or(out.next_offset)
        };
        let sealed = s.sealed.load(std::sync::atomic::Ordering::Acquire);
        out.push(SegmentInfo {
            path: s.path.clone(),
            base_offset: s.base,
            next_offset,
            // The open checked every seal against its base; never underflow all the same.
            records: next_offset.saturating_sub(s.base),
            bytes,
            sealed,
            gap_before,
        });
    }
    Ok(out)
}

/// Iterates the records of a log from `from`, in order, with their offsets.
pub struct Records {
    reader: Reader,
    buffered: VecDeque<Record>,
    done: bool,
}

impl Records {
    pub fn new(wal: &Wal, from: u64) -> Result<Records> {
        Ok(Records { reader: wal.reader(from)?, buffered: VecDeque::new(), done: false })
    }
}

impl Iterator for Records {
    type Item = Result<Record>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.buffered.is_empty() && !self.done {
            match self.reader.try_read(1024, 4 * 1024 * 1024) {
                Ok(batch) if batch.is_empty() => self.done = true,
                Ok(batch) => self.buffered.extend(batch),
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
        self.buffered.pop_front().map(Ok)
    }
}

/// Progress of a verification, in bytes of segment files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VerifyProgress {
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// One problem `verify` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub location: Location,
    pub what: String,
}

/// What `verify` found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyReport {
    pub segments: usize,
    pub records: u64,
    pub bytes: u64,
    /// Damage: checksum failures, gaps, missing seals, bad headers.
    pub problems: Vec<Problem>,
    /// Where a torn tail begins (cut by the next writable open; not damage).
    pub torn_tail: Option<Location>,
    /// The torn tail is only the zeros written ahead of the last write: no write was
    /// interrupted.
    pub torn_tail_zeros_only: bool,
}

impl VerifyReport {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks every segment header, every frame checksum and the offset sequence across
/// segments. Returns `Err` when a read fails (never taken for damage), and for a
/// segment of another format version (refused by name, as the open does).
///
/// Beside a running writer it checks only what the writer's durable watermark covers
/// (see `watermark.rs`): bytes written but not yet synced are neither read nor reported.
pub fn verify(storage: &dyn Storage, dir: &Path, progress: &mut dyn FnMut(VerifyProgress)) -> Result<VerifyReport> {
    crate::watermark::read_settled(storage, dir, |bound| verify_bounded(storage, dir, bound, progress))
}

fn verify_bounded(
    storage: &dyn Storage,
    dir: &Path,
    bound: crate::watermark::Bound,
    progress: &mut dyn FnMut(VerifyProgress),
) -> Result<VerifyReport> {
    let names = storage.list_dir(dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => WalError::NotALog(dir.to_path_buf()),
        _ => WalError::io(dir, e),
    })?;
    if names.iter().any(|n| n == crate::SALVAGE_INCOMPLETE_FILE) {
        return Err(WalError::UnfinishedSalvage(dir.to_path_buf()));
    }
    let mut bases: Vec<u64> = names.iter().filter_map(|n| parse_segment_file_name(n)).collect();
    bases.sort_unstable();
    if bases.is_empty() {
        return Err(WalError::NotALog(dir.to_path_buf()));
    }
    let bound = match bound {
        crate::watermark::Bound::Watermark(w) => Some(w),
        crate::watermark::Bound::None => None,
    };
    if let Some(w) = bound {
        bases.retain(|&b| b <= w.segment_base);
        if bases.last() != Some(&w.segment_base) {
            return Err(crate::watermark::unsettled(dir, "the durable watermark names a segment that is not there"));
        }
    }
    let mut files = Vec::with_capacity(bases.len());
    let mut total: u64 = 0;
    for &b in &bases {
        let path = dir.join(segment_file_name(b));
        let file = storage.open(&path, OpenMode::Read).map_err(|e| match e.kind() {
            // Beside a live writer a listed segment can be released before it is opened.
            std::io::ErrorKind::NotFound if bound.is_some() => {
                crate::watermark::unsettled(dir, "a segment was released while the log was being read")
            }
            _ => WalError::io(&path, e),
        })?;
        let mut len = file.len().map_err(|e| WalError::io(&path, e))?;
        if let Some(w) = bound
            && w.segment_base == b
        {
            if len < w.durable_len {
                return Err(crate::watermark::unsettled(dir, "the durable watermark is beyond its segment's end"));
            }
            len = w.durable_len;
        }
        total = total.saturating_add(len);
        files.push((b, path, file, len));
    }
    // After a clean close the whole tail was durable: damage in it is damage, not a tear.
    // Beside a running writer, the whole bounded tail was durable too.
    let marker = if bound.is_none() && names.iter().any(|n| n == crate::CLEAN_MARKER_FILE) {
        crate::recovery::read_marker(storage, &dir.join(crate::CLEAN_MARKER_FILE))?
    } else {
        None
    };
    let tail_closed_cleanly = match (files.last(), marker) {
        (Some((base, _, _, len)), Some(m)) => m.tail_base == *base && m.tail_len == *len,
        _ => bound.is_some(),
    };
    if !tail_closed_cleanly && let Some((_, path, file, _)) = files.last() {
        // Read as the open would: a failed sync's bytes are not on the disk.
        crate::recovery::read_tail_from_disk(&**file, path);
    }
    let mut report = VerifyReport { segments: files.len(), ..VerifyReport::default() };
    let mut done = 0u64;
    // The offset the next segment must start at (from the previous seal), if known.
    let mut expected_base: Option<u64> = None;
    let last = files.len() - 1;
    for (i, (base, path, file, len)) in files.iter().enumerate() {
        let problem =
            |position: u64, what: String| Problem { location: Location { file: path.clone(), position }, what };
        let mut header = [0u8; SEGMENT_HEADER_LEN as usize];
        let got = read_up_to_at(&**file, &mut header, 0).map_err(|e| WalError::io(path, e))?;
        let h = match SegmentHeader::decode(&header[..got]) {
            Ok(h) if h.base_offset == *base => h,
            Ok(h) => {
                report.problems.push(problem(0, format!("header says base {}, name says {base}", h.base_offset)));
                expected_base = None;
                done += len;
                continue;
            }
            // Another format version wrote it (a newer build): not damage, and its
            // frames are not this version's to check. Refused by name, as the open does.
            Err(p) if p.is_other_version() => {
                return Err(WalError::BadSegmentHeader {
                    location: Location { file: path.clone(), position: 0 },
                    problem: p,
                });
            }
            Err(p) => {
                report.problems.push(problem(0, format!("bad segment header: {p}")));
                expected_base = None;
                done += len;
                continue;
            }
        };
        if let Some(exp) = expected_base {
            let gap_ok = h.flags & SEGMENT_FLAG_GAP_BEFORE != 0 && exp < *base;
            if exp != *base && !gap_ok {
                report
                    .problems
                    .push(problem(0, format!("offsets do not continue: expected {exp}, segment starts at {base}")));
            }
        } else if i > 0 && report.problems.is_empty() {
            report.problems.push(problem(0, "previous segment has no seal".into()));
        }
        let start_done = done;
        let out = scan_segment(&**file, path, *base, *len, &mut |pos| {
            progress(VerifyProgress { bytes_done: start_done + pos, bytes_total: total })
        })?;
        // As for the open: a watermark whose offsets the scan of its bytes does not end at
        // is not the writer's for these bytes (stale, or raced), and the read is made again.
        if let Some(w) = bound
            && i == last
            && out.stop.is_none()
            && out.sealed.unwrap_or(out.next_offset) != w.next_offset
        {
            return Err(crate::watermark::unsettled(dir, "the durable watermark and its segment disagree"));
        }
        report.records += out.records;
        report.bytes = report.bytes.saturating_add(*len);
        done = done.saturating_add(*len);
        expected_base = out.sealed;
        if out.stop.is_some() && i < last {
            // The walk ended at damage before the seal: the seal, at the segment's end,
            // may still check and say where the successor must begin (a segment missing
            // after the damaged one is then reported too).
            expected_base = match crate::scan::read_seal(&**file, path, *base, *len) {
                Ok(seal) => Some(seal),
                Err(e) if e.is_corruption() => None,
                Err(e) => return Err(e),
            };
        }
        let why = if bound.is_some() { "in bytes the running writer synced" } else { "in a tail closed cleanly" };
        match out.stop {
            // A frame the writer never writes (a seal not above its segment's base: an
            // empty segment is never sealed) is damage in the tail too, as for the open.
            Some((pos, p)) if i == last && !out.stop_is_damage => {
                if tail_closed_cleanly {
                    report.problems.push(problem(pos, format!("{p} ({why})")));
                } else if find_proof_of_durable_damage(&**file, path, *len, pos)?.is_some() {
                    report.problems.push(problem(pos, format!("{p} (bytes that were durable)")));
                } else {
                    report.torn_tail = Some(Location { file: path.clone(), position: out.valid_end });
                    report.torn_tail_zeros_only = out.torn_tail_is_zeros_only(&**file, path, *len)?;
                }
            }
            Some((pos, p)) => report.problems.push(problem(pos, p.to_string())),
            None if i < last && out.sealed.is_none() => {
                report.problems.push(problem(*len, "segment has a successor but no seal".into()));
            }
            // Records that check but end no batch: torn, unless those bytes were durable
            // (a clean close, or a live writer's watermark, ends only whole batches).
            None if i == last && out.valid_end < *len && tail_closed_cleanly => {
                report.problems.push(problem(out.valid_end, format!("a batch without its last record ({why})")));
            }
            None if i == last && out.valid_end < *len => {
                report.torn_tail = Some(Location { file: path.clone(), position: out.valid_end });
                report.torn_tail_zeros_only = out.torn_tail_is_zeros_only(&**file, path, *len)?;
            }
            None => {}
        }
        progress(VerifyProgress { bytes_done: done, bytes_total: total });
    }
    Ok(report)
}
