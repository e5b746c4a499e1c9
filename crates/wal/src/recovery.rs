//! Opening a log directory: lock, validate, recover the tail, salvage on request.
//!
//! Invariants:
//! - Every segment header is checked; every segment with a successor must end in a seal
//!   whose offset is above its own base (the writer never seals an empty segment) and is
//!   its successor's base (or, after a salvage, at most that base). A seal in the tail
//!   at or below its base is damage too, never a tear: a successor created after it
//!   would take the tail's own name.
//! - The tail segment is always scanned; a clean-shutdown marker is believed only where
//!   the scan agrees with it. A damaged frame in the tail is a torn write (cut away, reported) only
//!   if no later frame proves the damaged bytes were already durable; otherwise it is
//!   damage to acknowledged data and an error naming file and byte position.
//! - A writable open removes the clean-shutdown marker, durably, before any append, and
//!   syncs every segment file and the directory first: nothing it found is published
//!   as durable unless it is.
//! - A writable open that creates the log directory (or any of its parents) syncs each
//!   directory it created and the parent of each before anything else: the directory
//!   entry is durable before anything in it is.
//! - Unless a clean-shutdown marker naming the tail (base and length) vouches that every
//!   sync succeeded, and never beside a live writer, the tail is read past the page cache
//!   (its clean pages are dropped first): bytes a failed sync left readable but not on
//!   disk are neither kept nor built on.
//! - A read-only open takes no lock and changes nothing on disk.
//! - Salvage never deletes: damaged files are moved to `damaged/`, and the log resumes
//!   past every offset the damaged bytes could have held.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Location, Result, WalError};
use crate::format::{
    CleanMarker, DurableWatermark, FRAME_HEADER_LEN, FrameHeader, HeaderProblem, SEGMENT_FLAG_GAP_BEFORE,
    SEGMENT_HEADER_LEN, SegmentHeader, parse_segment_file_name,
};
use crate::options::{RecoveryMode, WalOptions};
use crate::scan::{find_proof_of_durable_damage, read_seal, scan_segment};
use crate::shared::{SegmentRef, Shared};
use crate::storage::{OpenMode, Storage, StorageFile, create_dir_all_durably, read_exact_at};
use crate::watermark::{self, Bound};
use crate::writer::{Writer, copy_file_atomically, create_segment, create_segment_copying};
use crate::{CLEAN_MARKER_FILE, DAMAGED_DIR, LOCK_FILE};

/// What opening found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpenReport {
    /// The last writer closed the log cleanly: a marker named the tail's base and length.
    /// The tail is scanned all the same; the marker only makes damage in the bytes it
    /// names count as damage rather than a torn write.
    pub clean_shutdown: bool,
    pub segments: usize,
    pub start_offset: u64,
    pub next_offset: u64,
    /// Bytes of torn tail cut away (a write that never completed its sync).
    pub truncated_bytes: u64,
    /// Where the torn tail began: the first byte cut, the start of the batch whose write
    /// was interrupted (as `verify` reports it).
    pub torn_at: Option<Location>,
    /// The torn tail was only the zeros written ahead of the last write: no write was
    /// interrupted (the trace of a crash or kill between writes).
    pub torn_tail_zeros_only: bool,
    /// Whole records of a batch whose closing record was lost, cut with the torn tail.
    pub dropped_partial_batch_records: u64,
    /// Leftover temporary files of an interrupted segment creation, removed.
    pub removed_temp_files: Vec<String>,
    pub salvage: Option<SalvageReport>,
    /// Offsets the log lacks below its end, each range `from..to`: a salvage (in place,
    /// or by copy) skipped them, and a segment flagged `GAP_BEFORE` starts at `to`.
    /// `from` is its predecessor's seal, or 0 for the log's first segment, below which
    /// released offsets and skipped ones cannot be told apart. Ascending, disjoint.
    pub missing_ranges: Vec<std::ops::Range<u64>>,
    /// The log's identity ([`crate::identity`]): always there after a writable open,
    /// `None` after a read-only one (which neither reads nor writes it).
    pub log_id: Option<u64>,
    /// This open gave the log its identity: it had none (a new log, or one an earlier
    /// build wrote), or one that was not whole ([`OpenReport::log_id_damaged`]).
    pub log_id_created: bool,
    /// What was wrong with the identity this open replaced, when it was damaged.
    pub log_id_damaged: Option<String>,
}

/// What a salvage kept, moved and skipped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SalvageReport {
    /// The damage that made the salvage necessary.
    pub damage: String,
    /// The offset after the last record kept in place.
    pub kept_until_offset: u64,
    /// Files moved into `damaged/`.
    pub moved_files: Vec<PathBuf>,
    /// The offset the log resumes at; offsets in between are never used.
    pub resumed_at_offset: u64,
}

pub(crate) struct Opened {
    pub shared: Arc<Shared>,
    pub writer: Option<Writer>,
    pub report: OpenReport,
}

struct Loaded {
    base: u64,
    path: PathBuf,
    file: Arc<dyn StorageFile>,
    len: u64,
    header: SegmentHeader,
}

fn io_err(path: &Path) -> impl Fn(io::Error) -> WalError + '_ {
    move |e| WalError::io(path, e)
}

pub(crate) fn open(storage: Arc<dyn Storage>, dir: &Path, opts: &WalOptions, read_only: bool) -> Result<Opened> {
    if !read_only {
        return open_bounded(storage, dir, opts, false, Bound::None);
    }
    // Beside a live writer, bound by its durable watermark.
    watermark::read_settled(&*storage, dir, |bound| open_bounded(storage.clone(), dir, opts, true, bound))
}

fn open_bounded(
    storage: Arc<dyn Storage>,
    dir: &Path,
    opts: &WalOptions,
    read_only: bool,
    bound: Bound,
) -> Result<Opened> {
    opts.validate()?;
    let dir = dir.to_path_buf();
    let lock = if read_only {
        None
    } else {
        // On a first start the directory (and its parents) may be new: its entry must be
        // durable before anything in it is promised durable.
        create_dir_all_durably(&*storage, &dir).map_err(io_err(&dir))?;
        match storage.try_lock(&dir.join(LOCK_FILE)) {
            Ok(g) => Some(g),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(WalError::Locked(dir)),
            Err(e) => return Err(WalError::io(dir.join(LOCK_FILE), e)),
        }
    };
    if !read_only {
        // Readers must not bound themselves by a previous process's watermark while
        // this open recovers; the writer publishes its own once it is done.
        watermark::invalidate(&*storage, &dir);
    }
    let bound = match bound {
        Bound::Watermark(w) => Some(w),
        Bound::None => None,
    };
    let mut report = OpenReport::default();
    let names = match storage.list_dir(&dir) {
        Err(e) if read_only && e.kind() == io::ErrorKind::NotFound => {
            return Err(WalError::NotALog(dir));
        }
        r => r.map_err(io_err(&dir))?,
    };
    if names.iter().any(|n| n == crate::SALVAGE_INCOMPLETE_FILE) {
        return Err(WalError::UnfinishedSalvage(dir));
    }
    if !read_only {
        for n in names.iter().filter(|n| n.ends_with(".tmp")) {
            storage.remove_file(&dir.join(n)).map_err(io_err(&dir.join(n)))?;
            report.removed_temp_files.push(n.clone());
        }
        if !report.removed_temp_files.is_empty() {
            storage.sync_dir(&dir).map_err(io_err(&dir))?;
        }
    }
    let mut bases: Vec<u64> = names.iter().filter_map(|n| parse_segment_file_name(n)).collect();
    bases.sort_unstable();
    if let Some(w) = bound {
        // Segments past the watermark's were created after the sync it describes: they
        // hold nothing durable yet.
        bases.retain(|&b| b <= w.segment_base);
        if bases.last() != Some(&w.segment_base) {
            return Err(watermark::unsettled(&dir, "the durable watermark names a segment that is not there"));
        }
    }
    // A running writer removed any marker when it opened; one seen now is stale.
    let has_marker = bound.is_none() && names.iter().any(|n| n == CLEAN_MARKER_FILE);
    let marker = if has_marker { read_marker(&*storage, &dir.join(CLEAN_MARKER_FILE))? } else { None };
    if !read_only {
        report.log_id = Some(match crate::identity::read(&*storage, &dir) {
            Ok(Some(id)) => id,
            Ok(None) => {
                report.log_id_created = true;
                crate::identity::create(&*storage, &dir)?
            }
            Err(damaged @ WalError::BadLogId { .. }) => {
                // Kept aside, not overwritten: the evidence of what was there.
                let (from, to) =
                    (dir.join(crate::identity::LOG_ID_FILE), dir.join(crate::identity::LOG_ID_DAMAGED_FILE));
                storage.rename(&from, &to).map_err(io_err(&to))?;
                tracing::warn!(error = %damaged, kept_as = %to.display(), "the log's identity is damaged: the log is given a new one");
                report.log_id_created = true;
                report.log_id_damaged = Some(damaged.to_string());
                crate::identity::create(&*storage, &dir)?
            }
            Err(e) => return Err(e),
        });
    }

    if bases.is_empty() {
        if read_only {
            return Err(WalError::NotALog(dir));
        }
        if has_marker {
            remove_durably(&*storage, &dir, CLEAN_MARKER_FILE)?;
        }
        let seg = create_segment(&*storage, &dir, opts.initial_offset, 0)?;
        return Ok(finish(storage, dir, opts, vec![seg], opts.initial_offset, lock, report));
    }

    // Read every header first; a bad one is remembered, not trusted.
    let mut loaded = Vec::with_capacity(bases.len());
    let mut bad_headers: Vec<Option<WalError>> = Vec::with_capacity(bases.len());
    for (i, &base) in bases.iter().enumerate() {
        let path = dir.join(crate::format::segment_file_name(base));
        let writable = !read_only && i == bases.len() - 1;
        let mode = if writable { OpenMode::ReadWrite } else { OpenMode::Read };
        let file = storage.open(&path, mode).map_err(|e| match e.kind() {
            // Beside a live writer a listed segment can be released before it is opened.
            io::ErrorKind::NotFound if bound.is_some() => {
                watermark::unsettled(&dir, "a segment was released while the log was being opened")
            }
            _ => WalError::io(&path, e),
        })?;
        let mut len = file.len().map_err(io_err(&path))?;
        // A clean shutdown vouches that every sync of its tail succeeded, but only a
        // marker that names this tail, base and length.
        let vouched = marker.is_some_and(|m| m.tail_base == base && m.tail_len == len);
        if i == bases.len() - 1 && bound.is_none() && !vouched {
            // A writer that failed a sync and then failed to cut back left bytes the
            // kernel holds clean but never wrote (Linux marks pages clean after a
            // writeback error): they read back like records. The tail is read from the
            // disk instead, so the open neither keeps those records nor builds on them
            // (a power loss would then take them from under later, synced appends). Not
            // after a clean shutdown of this tail, and never beside a live writer.
            read_tail_from_disk(&*file, &path);
        }
        if let Some(w) = bound
            && base == w.segment_base
        {
            // Only what the writer's last published sync covered; it never shrinks below
            // that (a failed sync cuts back to the durable length, not under it).
            if len < w.durable_len {
                return Err(watermark::unsettled(&dir, "the durable watermark is beyond its segment's end"));
            }
            len = w.durable_len;
        }
        let (header, bad) = match read_header(&*file, &path, base, len) {
            Ok(h) => (h, None),
            Err(e) => (SegmentHeader { base_offset: base, flags: 0 }, Some(e)),
        };
        loaded.push(Loaded { base, path, file, len, header });
        bad_headers.push(bad);
    }
    // A header that could not be read is no damage, in any mode (FORMAT.md: a read that
    // fails is an error, never damage): the open fails with it and changes nothing, to
    // be tried again once the disk reads. Taken for damage, a salvage whose own read of
    // it then succeeded would move every later segment aside, intact records and all.
    if let Some(e) = bad_headers.iter_mut().find_map(|b| b.take_if(|e| !e.is_corruption() && !is_other_version(e))) {
        return Err(e);
    }
    // The first problem in segment order wins: a bad header, or a segment with a
    // successor that is not sealed at the successor's base.
    let mut damage: Option<(usize, WalError)> = None;
    for i in 0..loaded.len() {
        if let Some(e) = bad_headers[i].take() {
            damage = Some((i, e));
            break;
        }
        let Some(next) = loaded.get(i + 1) else { break };
        let seg = &loaded[i];
        // A salvage is asked for because something is wrong: then every byte of every
        // sealed segment is checked, not only its seal.
        let full_check = opts.recovery == RecoveryMode::Salvage && !read_only;
        let gap_allowed = bad_headers[i + 1].is_none() && next.header.flags & SEGMENT_FLAG_GAP_BEFORE != 0;
        let checked = full_scan_ok(&*seg.file, &seg.path, seg.base, seg.len, full_check)
            .and_then(|()| read_seal(&*seg.file, &seg.path, seg.base, seg.len))
            .and_then(|seal| {
                if seal == next.base || (gap_allowed && seal < next.base) {
                    Ok(())
                } else {
                    Err(WalError::Gap {
                        location: Location { file: next.path.clone(), position: 0 },
                        expected: seal,
                        found: next.base,
                    })
                }
            });
        match checked {
            // As a header's: a failed read of a sealed segment is no damage either.
            Err(e) if !e.is_corruption() => return Err(e),
            Err(e) => {
                damage = Some((i, e));
                break;
            }
            Ok(()) => {}
        }
    }

    // The tail: trust a matching clean marker, otherwise scan.
    let mut next_offset = 0;
    let mut tail_sealed = false;
    if damage.is_none() {
        let tail_index = loaded.len() - 1;
        let tail = loaded.last_mut().ok_or_else(|| WalError::NotALog(dir.clone()))?;
        // The tail is always scanned (at about 1 GB/s, a 64 MiB segment costs tens of
        // milliseconds): a marker is only believed where the scan agrees with it, so
        // a stale or crafted marker can never hide a record or invent one.
        let fits = marker.as_ref().is_some_and(|m| marker_fits(m, tail));
        // Every byte of the tail was synced: a live writer's watermark bounds it, or a
        // clean shutdown's marker names it (base and length; the writer writes the marker
        // only after its last sync, and every writable open removes it durably before
        // writing). Then nothing in it is a torn write: a frame that does not check, or
        // records that end no batch, are damage, and are not cut.
        let tail_vouched =
            bound.is_some() || marker.is_some_and(|m| m.tail_base == tail.base && m.tail_len == tail.len);
        {
            {
                let out = scan_segment(&*tail.file, &tail.path, tail.base, tail.len, &mut |_| {})?;
                if let Some(w) = bound
                    && out.stop.is_none()
                    && out.sealed.unwrap_or(out.next_offset) != w.next_offset
                {
                    return Err(watermark::unsettled(&dir, "the durable watermark and its segment disagree"));
                }
                if let Some((pos, problem)) = out.stop {
                    // Within a live writer's watermark every byte was synced: a frame
                    // that does not check there is damage, not a tear. So is a frame the
                    // writer never writes (a seal not above the tail's base), anywhere.
                    let proof = if tail_vouched || out.stop_is_damage {
                        Some(pos)
                    } else {
                        find_proof_of_durable_damage(&*tail.file, &tail.path, tail.len, pos)?
                    };
                    // Without proof it is a torn write, cut below from where its batch
                    // began (`torn_at` is set there, as `verify` reports it).
                    if proof.is_some() {
                        let location = Location { file: tail.path.clone(), position: pos };
                        damage = Some((tail_index, WalError::Corrupt { location, problem }));
                    }
                } else if tail_vouched && out.valid_end < tail.len {
                    let location = Location { file: tail.path.clone(), position: out.valid_end };
                    let problem = crate::format::FrameProblem::UnfinishedBatch { records: out.partial_batch_records };
                    damage = Some((tail_index, WalError::Corrupt { location, problem }));
                }
                if damage.is_none() {
                    next_offset = out.sealed.unwrap_or(out.next_offset);
                    tail_sealed = out.sealed.is_some();
                    report.clean_shutdown = fits
                        && out.stop.is_none()
                        && marker.is_some_and(|m| m.next_offset == next_offset && m.tail_sealed == tail_sealed);
                    if tail.len > out.valid_end {
                        report.truncated_bytes = tail.len - out.valid_end;
                        report.torn_tail_zeros_only = out.torn_tail_is_zeros_only(&*tail.file, &tail.path, tail.len)?;
                        report.dropped_partial_batch_records = out.partial_batch_records;
                        if report.torn_at.is_none() {
                            report.torn_at = Some(Location { file: tail.path.clone(), position: out.valid_end });
                        }
                        if !read_only {
                            tail.file.set_len(out.valid_end).map_err(io_err(&tail.path))?;
                            tail.file.sync_data().map_err(io_err(&tail.path))?;
                        }
                        tail.len = out.valid_end;
                        if report.torn_tail_zeros_only {
                            tracing::info!(
                                segment = %tail.path.display(),
                                bytes = report.truncated_bytes,
                                "cut the zeros written ahead of the last write"
                            );
                        } else {
                            tracing::warn!(
                                segment = %tail.path.display(),
                                bytes = report.truncated_bytes,
                                records = report.dropped_partial_batch_records,
                                "cut a torn tail left by an interrupted write"
                            );
                        }
                    }
                }
            }
        }
    }

    if let Some((i, e)) = damage {
        // A segment of another format version is not damage: refused, never moved aside,
        // whether it is the first problem or lies past it (a salvage moves every segment
        // from the damage on).
        if read_only || opts.recovery == RecoveryMode::Strict || is_other_version(&e) {
            return Err(e);
        }
        if let Some(later) = bad_headers.iter_mut().skip(i + 1).find_map(|b| b.take_if(|e| is_other_version(e))) {
            return Err(later);
        }
        let (kept, resume, salvage) = salvage(&*storage, &dir, loaded, i, &e)?;
        tracing::error!(damage = %e, resumed_at = resume, "salvaged a damaged log");
        loaded = kept;
        next_offset = resume;
        // The salvage started the tail, at `resume`.
        tail_sealed = false;
        report.salvage = Some(salvage);
    }

    if !read_only {
        // What was found is made durable before anything is published as durable: a
        // previous process may have died (or failed a sync) after writing bytes or
        // creating a file without syncing it, and its page cache outlived it. Syncing
        // clean files is cheap; this happens once per open. (Bytes whose sync failed
        // are not among them: the tail was read past the page cache above.)
        for seg in &loaded {
            seg.file.sync_data().map_err(io_err(&seg.path))?;
        }
        if has_marker {
            remove_durably(&*storage, &dir, CLEAN_MARKER_FILE)?;
        } else {
            storage.sync_dir(&dir).map_err(io_err(&dir))?;
        }
    }

    report.missing_ranges = missing_ranges(&loaded)?;
    let count = loaded.len();
    let mut segs: Vec<Arc<SegmentRef>> = loaded
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            let sealed = i + 1 < count || tail_sealed;
            Arc::new(SegmentRef {
                base: l.base,
                path: l.path,
                file: l.file,
                durable_len: l.len.into(),
                sealed: sealed.into(),
            })
        })
        .collect();
    // A sealed tail gets its successor now. If that fails (a full disk, say), the log
    // opens anyway, waiting for it as after a rotation whose successor failed: the
    // writer tries again every second, and a daemon that could not start could not
    // deliver what the log holds either, which is what frees the disk.
    let mut successor_failed = None;
    if tail_sealed && !read_only {
        match create_segment(&*storage, &dir, next_offset, 0) {
            Ok(seg) => segs.push(seg),
            Err(e) => successor_failed = Some(e),
        }
    }
    let mut opened = finish(storage, dir, opts, segs, next_offset, lock, report);
    if opened.writer.is_some() {
        // A writer that takes appends (a reopen is what ends a stopped log). Its flags
        // start clear, and their gauges move only when a flag changes: gauges a log
        // opened before in this process left set (full, disk full, waiting for a
        // segment) are cleared with them, or they would say so of this one for good.
        metrics::gauge!("iggy_ingest_wal_stopped").set(0.0);
        metrics::gauge!("iggy_ingest_wal_full").set(0.0);
        metrics::gauge!("iggy_ingest_wal_disk_full").set(0.0);
        metrics::gauge!("iggy_ingest_wal_awaiting_segment").set(0.0);
    }
    if let (Some(e), Some(writer)) = (successor_failed, opened.writer.as_mut()) {
        writer.await_segment(&e);
    }
    Ok(opened)
}

/// The offsets below each segment flagged `GAP_BEFORE` that the log does not hold: from
/// the predecessor's seal (which the open checked is at or below the flagged base), or
/// from 0 for the first segment.
fn missing_ranges(loaded: &[Loaded]) -> Result<Vec<std::ops::Range<u64>>> {
    let mut ranges = Vec::new();
    for (i, seg) in loaded.iter().enumerate() {
        if seg.header.flags & SEGMENT_FLAG_GAP_BEFORE == 0 {
            continue;
        }
        let from = match i.checked_sub(1).map(|p| &loaded[p]) {
            None => 0,
            Some(prev) => read_seal(&*prev.file, &prev.path, prev.base, prev.len)?,
        };
        if from < seg.base {
            ranges.push(from..seg.base);
        }
    }
    Ok(ranges)
}

/// A name in `damaged/` for `d`'s file that none of `existing` has (then added to it).
fn damaged_name(existing: &mut Vec<String>, d: &Loaded) -> String {
    let name = d.path.file_name().and_then(|n| n.to_str()).unwrap_or("segment");
    let mut target = name.to_string();
    let mut k = 1;
    while existing.contains(&target) {
        target = format!("{name}.{k}");
        k += 1;
    }
    existing.push(target.clone());
    target
}

/// Renames `d`'s file into `damaged/`, durably (both directories synced); its new path.
fn move_aside(storage: &dyn Storage, dir: &Path, existing: &mut Vec<String>, d: &Loaded) -> Result<PathBuf> {
    let damaged_dir = dir.join(DAMAGED_DIR);
    let to = damaged_dir.join(damaged_name(existing, d));
    storage.rename(&d.path, &to).map_err(io_err(&d.path))?;
    storage.sync_dir(&damaged_dir).map_err(io_err(&damaged_dir))?;
    storage.sync_dir(dir).map_err(io_err(dir))?;
    Ok(to)
}

/// Drops the tail segment's cached pages, so that what follows reads what the disk holds:
/// after a failed sync the kernel can hold pages clean that were never written. For every
/// reader of a log no writer holds and no clean-shutdown marker vouches for (the open,
/// `verify`, `salvage_copy`); it changes no byte on disk.
pub(crate) fn read_tail_from_disk(file: &dyn StorageFile, path: &Path) {
    if let Err(e) = file.drop_cached() {
        tracing::warn!(segment = %path.display(), error = %e, "could not drop the tail's cached pages; reading them as cached");
    }
}

/// A clean-shutdown marker is trusted only if it describes this tail and is consistent
/// with it: the same base and length, records exactly when the file holds more than its
/// header, and, if it says sealed, a seal at the end naming its next offset.
fn marker_fits(m: &CleanMarker, tail: &Loaded) -> bool {
    let same = m.tail_base == tail.base && m.tail_len == tail.len;
    let has_records = tail.len > SEGMENT_HEADER_LEN;
    let offsets_fit = if has_records { m.next_offset > tail.base } else { m.next_offset == tail.base };
    let seal_fits =
        !m.tail_sealed || read_seal(&*tail.file, &tail.path, tail.base, tail.len).is_ok_and(|s| s == m.next_offset);
    same && offsets_fit && (m.tail_sealed || !has_records || m.next_offset > tail.base) && seal_fits
}

fn finish(
    storage: Arc<dyn Storage>,
    dir: PathBuf,
    opts: &WalOptions,
    segs: Vec<Arc<SegmentRef>>,
    next_offset: u64,
    lock: Option<Box<dyn Send + Sync>>,
    mut report: OpenReport,
) -> Opened {
    // Saturating: lengths come from the file system (a crafted one could name huge files).
    let used: u64 =
        segs.iter().map(|s| s.durable_len.load(std::sync::atomic::Ordering::Relaxed)).fold(0, u64::saturating_add);
    let active = segs.last().cloned();
    let shared = Arc::new(Shared::new(dir, storage, segs, next_offset, used, opts.max_bytes, opts.record_max_bytes));
    report.segments = shared.segments().len();
    report.start_offset = shared.start();
    report.next_offset = next_offset;
    metrics::gauge!("iggy_ingest_wal_segments").set(report.segments as f64);
    metrics::gauge!("iggy_ingest_wal_used_bytes").set(used as f64);
    metrics::gauge!("iggy_ingest_wal_capacity_bytes").set(opts.max_bytes as f64);
    let writer = match (lock, active) {
        (Some(lock), Some(active)) => {
            let len = active.durable_len.load(std::sync::atomic::Ordering::Relaxed);
            let watermark = publish_initial_watermark(&*shared.storage, &shared.dir, &active, next_offset);
            Some(Writer {
                shared: shared.clone(),
                active,
                written_len: len,
                durable_len: len,
                next_offset,
                segment_max_bytes: opts.segment_max_bytes,
                group_max_bytes: opts.group_max_bytes,
                preallocate_bytes: opts.preallocate_bytes,
                allocated_len: len,
                sync: opts.sync,
                poisoned: None,
                unsynced_since: None,
                successor_retry_at: None,
                deletion_retry_at: None,
                deletion_failing: false,
                buf: Vec::new(),
                removal_unsynced: false,
                watermark,
                _lock: lock,
            })
        }
        _ => None,
    };
    Opened { shared, writer, report }
}

/// Creates the writer's watermark and publishes what the open found durable (it synced
/// everything before this).
fn publish_initial_watermark(
    storage: &dyn Storage,
    dir: &Path,
    active: &SegmentRef,
    next_offset: u64,
) -> Option<watermark::Publisher> {
    let mut p = watermark::Publisher::create(storage, dir)?;
    p.publish(DurableWatermark {
        segment_base: active.base,
        durable_len: active.durable_len.load(std::sync::atomic::Ordering::Relaxed),
        next_offset,
    });
    Some(p)
}

/// With `full`, checks every frame of a sealed segment; otherwise does nothing.
fn full_scan_ok(file: &dyn StorageFile, path: &Path, base: u64, len: u64, full: bool) -> Result<()> {
    if !full {
        return Ok(());
    }
    let out = scan_segment(file, path, base, len, &mut |_| {})?;
    match out.stop {
        Some((position, problem)) => {
            Err(WalError::Corrupt { location: Location { file: path.to_path_buf(), position }, problem })
        }
        None => Ok(()),
    }
}

fn read_header(file: &dyn StorageFile, path: &Path, base: u64, len: u64) -> Result<SegmentHeader> {
    let location = Location { file: path.to_path_buf(), position: 0 };
    if len < SEGMENT_HEADER_LEN {
        return Err(WalError::BadSegmentHeader { location, problem: HeaderProblem::TooShort });
    }
    let mut b = [0u8; SEGMENT_HEADER_LEN as usize];
    read_exact_at(file, &mut b, 0).map_err(io_err(path))?;
    let h = SegmentHeader::decode(&b)
        .map_err(|problem| WalError::BadSegmentHeader { location: location.clone(), problem })?;
    if h.base_offset != base {
        let problem = HeaderProblem::BaseMismatch { name: base, header: h.base_offset };
        return Err(WalError::BadSegmentHeader { location, problem });
    }
    Ok(h)
}

/// The clean-shutdown marker at `path`: `None` if it is not one (wrong length, bad
/// checksum); an error if it cannot be read, which must not pass for "no marker".
pub(crate) fn read_marker(storage: &dyn Storage, path: &Path) -> Result<Option<CleanMarker>> {
    let f = storage.open(path, OpenMode::Read).map_err(io_err(path))?;
    let len = f.len().map_err(io_err(path))?;
    if len != crate::format::CLEAN_MARKER_LEN as u64 {
        return Ok(None);
    }
    let mut b = [0u8; crate::format::CLEAN_MARKER_LEN];
    read_exact_at(&*f, &mut b, 0).map_err(io_err(path))?;
    Ok(CleanMarker::decode(&b))
}

pub(crate) fn remove_durably(storage: &dyn Storage, dir: &Path, name: &str) -> Result<()> {
    let path = dir.join(name);
    storage.remove_file(&path).map_err(io_err(&path))?;
    storage.sync_dir(dir).map_err(io_err(dir))
}

/// Whether `e` refuses a segment of another format version (not damage, and never moved
/// aside).
fn is_other_version(e: &WalError) -> bool {
    matches!(e, WalError::BadSegmentHeader { problem, .. } if problem.is_other_version())
}

/// Keeps segments before `first_bad` and the valid prefix of `first_bad`, moves it and
/// every later segment into `damaged/`, starts the tail at the offset to resume at (a
/// segment flagged `GAP_BEFORE`), and returns the kept segments with that tail, the
/// offset and the report.
///
/// Crash safety: the steps run in an order after which every crash leaves either the
/// damage in place (the next salvage finds it and starts over, resuming no lower) or the
/// finished result. The tail at `resume` is created first, so no state can resume below
/// it; the later damaged segments leave next, last first; the first damaged segment is
/// copied into `damaged/` and only then replaced by its valid prefix, in one rename (or
/// moved, when nothing of it is kept), as the last step.
fn salvage(
    storage: &dyn Storage,
    dir: &Path,
    mut loaded: Vec<Loaded>,
    first_bad: usize,
    damage: &WalError,
) -> Result<(Vec<Loaded>, u64, SalvageReport)> {
    let damaged: Vec<Loaded> = loaded.split_off(first_bad);
    let bad = &damaged[0];
    // The valid prefix of the first damaged segment (whole batches before the damage).
    let header_ok = !matches!(damage, WalError::BadSegmentHeader { .. });
    let prefix = if header_ok {
        let out = scan_segment(&*bad.file, &bad.path, bad.base, bad.len, &mut |_| {})?;
        Some(out)
    } else {
        None
    };
    let kept_until = match &prefix {
        Some(out) => out.sealed.unwrap_or(out.next_offset),
        None => bad.base,
    };
    // No offset any damaged byte could hold is ever used again: every record takes at
    // least one frame header, so a file of `len` bytes holds fewer than
    // `(len - header) / FRAME_HEADER_LEN + 1` offsets past its base.
    let mut resume = kept_until;
    for d in &damaged {
        let room = d.len.saturating_sub(SEGMENT_HEADER_LEN) / FRAME_HEADER_LEN + 1;
        resume = resume.max(d.base.saturating_add(room));
    }
    // A damaged file named near the top of the range can leave no room at all; the log
    // still opens (and reads), and appends then fail with `OffsetsExhausted`.
    // Never below what was kept, though: a kept record's offset is never reused.
    let resume = resume.min(crate::format::OFFSET_MAX).max(kept_until);
    // The valid prefix: its length in the damaged file, and the seal to close it with
    // if it has none. Copied from the damaged file while its name still holds it (the
    // copy is renamed over it last), in chunks: never a whole segment in memory.
    let prefix_bytes = match &prefix {
        Some(out) if out.next_offset > bad.base => {
            let seal = match out.sealed {
                Some(_) => Vec::new(),
                None => FrameHeader::seal(out.next_offset, out.valid_end).encode().to_vec(),
            };
            Some((out.valid_end, seal))
        }
        _ => None,
    };
    let damaged_dir = dir.join(DAMAGED_DIR);
    create_dir_all_durably(storage, &damaged_dir).map_err(io_err(&damaged_dir))?;
    // Also when an earlier salvage created it and may have died before that sync.
    storage.sync_dir(dir).map_err(io_err(dir))?;
    let mut existing = storage.list_dir(&damaged_dir).map_err(io_err(&damaged_dir))?;
    let mut moved = Vec::new();
    // Only at the very top of the offset range (the resume offset clamped) can a damaged
    // segment bear the tail's name: that one leaves first, the tail cannot be created
    // over it.
    let named_as_tail = |d: &Loaded| d.base == resume;
    for d in damaged.iter().filter(|d| named_as_tail(d)) {
        moved.push(move_aside(storage, dir, &mut existing, d)?);
    }
    let tail = create_segment(storage, dir, resume, SEGMENT_FLAG_GAP_BEFORE)?;
    for d in damaged[1..].iter().rev().filter(|d| !named_as_tail(d)) {
        moved.push(move_aside(storage, dir, &mut existing, d)?);
    }
    if !named_as_tail(bad) {
        match &prefix_bytes {
            Some((valid_end, seal)) => {
                // A copy, so that the damaged file's name goes straight from the damaged
                // bytes to the valid prefix: a rename first would leave a moment with
                // neither.
                let name = damaged_name(&mut existing, bad);
                copy_file_atomically(storage, &damaged_dir, &name, &*bad.file, &bad.path, bad.len, &[])?;
                moved.push(damaged_dir.join(name));
                let seg = create_segment_copying(storage, dir, bad.base, &*bad.file, &bad.path, *valid_end, seal)?;
                loaded.push(Loaded {
                    base: bad.base,
                    path: seg.path.clone(),
                    file: seg.file.clone(),
                    len: valid_end + seal.len() as u64,
                    header: bad.header,
                });
            }
            None => moved.push(move_aside(storage, dir, &mut existing, bad)?),
        }
    }
    moved.sort();
    loaded.push(Loaded {
        base: resume,
        path: tail.path.clone(),
        file: tail.file.clone(),
        len: SEGMENT_HEADER_LEN,
        header: SegmentHeader { base_offset: resume, flags: SEGMENT_FLAG_GAP_BEFORE },
    });
    let report = SalvageReport {
        damage: damage.to_string(),
        kept_until_offset: kept_until,
        moved_files: moved,
        resumed_at_offset: resume,
    };
    Ok((loaded, resume, report))
}
