//! Salvage by copy: every whole batch that still checks, under its own offsets, in a new
//! log; the source untouched, a live writer's unsynced bytes and batches that are not
//! whole left out.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use wal::format::{
    FLAG_END_OF_BATCH, FRAME_HEADER_LEN, FrameHeader, SEGMENT_FLAG_GAP_BEFORE, SEGMENT_HEADER_LEN, SegmentHeader,
    segment_file_name,
};
use wal::salvage_copy::{
    PROGRESS_EVERY_BYTES, salvage_copy, salvage_copy_of_a_stopped_log, salvage_copy_with_progress,
};
use wal::storage::{CrashMode, SimStorage, Storage};
use wal::{SyncPolicy, Wal, WalOptions, inspect};

fn out_dir() -> PathBuf {
    PathBuf::from("/sim/copy")
}

fn copied(sim: &SimStorage) -> Vec<(u64, u64)> {
    let wal = Wal::open_read_only_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &out_dir()).expect("copy opens");
    read_all(&wal, wal.start_offset()).iter().map(|r| (r.offset, tag_of(&r.payload))).collect()
}

/// Every record frame of the copy, in file order, with whether it ends its batch.
fn copied_frames(sim: &SimStorage) -> Vec<(u64, bool)> {
    let mut out = Vec::new();
    for name in segment_files(sim, &out_dir()) {
        let b = sim.read_file(&out_dir().join(name)).unwrap();
        let mut pos = SEGMENT_HEADER_LEN as usize;
        while pos < b.len() {
            let h = FrameHeader::decode(&b[pos..]).expect("the copy's frames check");
            if !h.is_seal() {
                out.push((h.offset, h.ends_batch()));
            }
            pos += h.frame_len() as usize;
        }
    }
    out
}

/// A record frame written by hand, as the writer writes it: `synced_len` is where the
/// write holding its batch began.
fn frame(offset: u64, ends_batch: bool, synced_len: u64) -> Vec<u8> {
    let payload = payload(offset, 50);
    let h = FrameHeader {
        payload_len: payload.len() as u32,
        offset,
        synced_len,
        flags: if ends_batch { FLAG_END_OF_BATCH } else { 0 },
        payload_crc: crc32fast::hash(&payload),
    };
    let mut b = h.encode().to_vec();
    b.extend_from_slice(&payload);
    b
}

fn write_source(sim: &SimStorage, bytes: &[u8]) {
    sim.create_dir_all(&dir()).unwrap();
    sim.write_file_durably(&dir().join(segment_file_name(0)), bytes).unwrap();
}

fn source_end(sim: &SimStorage) -> u64 {
    Wal::open_read_only_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &dir()).expect("the source opens").next_offset()
}

/// A batch of three records (offsets 1 to 3) whose write never finished: the power
/// failed before its sync, so no one was told it was stored. Its first two records
/// survived whole, the third did not (torn, or never written). The copy must not hold
/// the two as if they were a batch: it holds what recovery would keep, and reports the
/// two as left out.
#[test]
fn a_batch_that_never_closed_is_not_copied() {
    for torn in [&[][..], &[0xAB; 40][..]] {
        let sim = SimStorage::new();
        let mut b = SegmentHeader { base_offset: 0, flags: 0 }.encode().to_vec();
        b.extend(frame(0, true, SEGMENT_HEADER_LEN));
        let batch_at = b.len() as u64;
        b.extend(frame(1, false, batch_at));
        b.extend(frame(2, false, batch_at));
        let batch_end = b.len() as u64;
        b.extend_from_slice(torn);
        write_source(&sim, &b);

        let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
        assert_eq!(source_end(&sim), 1, "recovery keeps only the first batch");
        assert_eq!(report.next_offset, Some(source_end(&sim)), "{report:?}");
        assert_eq!(report.records, 1, "{report:?}");
        assert_eq!(report.partial_batch_records(), 2, "{report:?}");
        assert_eq!(copied(&sim), vec![(0, 0)]);
        assert_eq!(copied_frames(&sim), vec![(0, true)]);
        let s = &report.skipped[0];
        assert_eq!((s.from, s.to), (batch_at, batch_end), "{report:?}");
        assert!(s.why.contains("closing record was lost") && s.why.contains("1..=2"), "{}", s.why);
        assert_eq!(s.records, 2);
        if torn.is_empty() {
            assert_eq!(report.skipped.len(), 1, "{report:?}");
        } else {
            assert_eq!(report.skipped.len(), 2, "{report:?}");
            assert_eq!((report.skipped[1].from, report.skipped[1].to), (batch_end, batch_end + 40));
        }
        // At the tail's end, nothing proving it durable: a torn tail, as recovery cuts
        // it, no damage. Called damage, it ended the copy 1 where `verify` says clean.
        assert!(report.skipped.iter().all(|s| s.torn_tail), "{report:?}");
        assert!(!report.left_out_more_than_a_torn_tail(), "{report:?}");
        assert!(inspect::verify(&sim, &out_dir(), &mut |_| {}).unwrap().is_clean());
    }
}

/// After damage the walk picks up at the next frame that checks, but a record found there
/// may belong to a batch whose first records were in the damaged bytes: the records up to
/// the end of that batch are left out, and the next batch is copied.
#[test]
fn records_after_damage_whose_batch_may_have_begun_before_it_are_not_copied() {
    let sim = SimStorage::new();
    let mut b = SegmentHeader { base_offset: 0, flags: 0 }.encode().to_vec();
    b.extend(frame(0, true, SEGMENT_HEADER_LEN));
    let batch_at = b.len() as u64;
    b.extend(frame(1, false, batch_at));
    let damaged_at = b.len() as u64;
    b.extend_from_slice(&[0xAB; 40]);
    let resync_at = b.len() as u64;
    b.extend(frame(2, false, batch_at));
    b.extend(frame(3, true, batch_at));
    let next_batch_at = b.len() as u64;
    b.extend(frame(4, true, next_batch_at));
    write_source(&sim, &b);

    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(copied(&sim), vec![(0, 0), (4, 4)]);
    assert_eq!(copied_frames(&sim), vec![(0, true), (4, true)]);
    assert_eq!(report.records, 2);
    assert_eq!(report.partial_batch_records(), 3, "{report:?}");
    assert_eq!(report.next_offset, Some(5));
    assert_eq!(report.missing_offsets, vec![(1, 3)]);
    let ranges: Vec<(u64, u64)> = report.skipped.iter().map(|s| (s.from, s.to)).collect();
    assert_eq!(ranges, vec![(batch_at, damaged_at), (damaged_at, resync_at), (resync_at, next_batch_at)]);
    assert!(inspect::verify(&sim, &out_dir(), &mut |_| {}).unwrap().is_clean());
}

/// Offsets missing before the first record copied are missing from the copy as they are
/// from the source, and the copy's open reports them (the daemon forgets the delivery
/// ids of missing records by that report, so that the retry of a lost event is taken
/// again): the copy's first segment is flagged `GAP_BEFORE` when the source's first
/// record was lost, and when the source's first segment was itself flagged.
#[test]
fn offsets_missing_before_the_first_record_copied_stay_missing_in_the_copy() {
    let copy_report = |sim: &SimStorage| {
        let copy = Wal::open_read_only_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &out_dir()).unwrap();
        copy.open_report().missing_ranges.clone()
    };
    // The source's first record is damaged.
    let sim = SimStorage::new();
    let mut b = SegmentHeader { base_offset: 0, flags: 0 }.encode().to_vec();
    let damaged_at = b.len() as u64;
    b.extend(frame(0, true, SEGMENT_HEADER_LEN));
    b[(damaged_at + FRAME_HEADER_LEN + 3) as usize] ^= 0x40;
    let next_at = b.len() as u64;
    b.extend(frame(1, true, next_at));
    b.extend(frame(2, true, b.len() as u64));
    write_source(&sim, &b);
    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(copied(&sim), vec![(1, 1), (2, 2)]);
    assert_eq!(report.missing_offsets, vec![(0, 0)], "{report:?}");
    assert_eq!(copy_report(&sim), vec![0..1], "the lost first record is not reported by the copy");

    // The source's first segment says offsets below it are missing (an earlier salvage).
    let sim = SimStorage::new();
    let mut b = SegmentHeader { base_offset: 5, flags: SEGMENT_FLAG_GAP_BEFORE }.encode().to_vec();
    b.extend(frame(5, true, SEGMENT_HEADER_LEN));
    sim.create_dir_all(&dir()).unwrap();
    sim.write_file_durably(&dir().join(segment_file_name(5)), &b).unwrap();
    let source = Wal::open_read_only_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &dir()).unwrap();
    assert_eq!(source.open_report().missing_ranges, vec![0..5]);
    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(copied(&sim), vec![(5, 5)]);
    assert!(report.missing_offsets.is_empty(), "{report:?}");
    assert_eq!(copy_report(&sim), vec![0..5], "the copy dropped the source's gap");
}

/// Whole batches are copied as batches: only the last record of each ends it, so the
/// copy's recovery keeps or drops each whole, as the source's would.
#[test]
fn a_whole_batch_is_copied_with_its_flags() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(async {
        wal.append(vec![payload(0, 50)]).await.unwrap();
        wal.append(vec![payload(1, 50), payload(2, 50), payload(3, 50)]).await.unwrap();
        wal.append(vec![payload(4, 50)]).await.unwrap();
    });
    drop(wal);

    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert!(report.skipped.is_empty(), "{report:?}");
    assert_eq!((report.records, report.partial_batch_records()), (5, 0));
    assert_eq!(copied(&sim), (0..5).map(|o| (o, o)).collect::<Vec<_>>());
    assert_eq!(copied_frames(&sim), vec![(0, true), (1, false), (2, false), (3, true), (4, true)]);
}

/// A record whose payload alone was damaged still tells, by its checked header, that it
/// ended its batch: the batch after it is known to begin where it ends, and is copied
/// whole.
#[test]
fn the_batch_after_a_record_whose_payload_alone_was_damaged_is_copied_whole() {
    let sim = SimStorage::new();
    let mut b = SegmentHeader { base_offset: 0, flags: 0 }.encode().to_vec();
    b.extend(frame(0, true, SEGMENT_HEADER_LEN));
    let damaged_at = b.len() as u64;
    b.extend(frame(1, true, damaged_at));
    let batch_at = b.len() as u64;
    b[(damaged_at + FRAME_HEADER_LEN + 3) as usize] ^= 0x40;
    b.extend(frame(2, false, batch_at));
    b.extend(frame(3, true, batch_at));
    write_source(&sim, &b);

    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(copied(&sim), vec![(0, 0), (2, 2), (3, 3)]);
    assert_eq!(copied_frames(&sim), vec![(0, true), (2, false), (3, true)]);
    assert_eq!(report.partial_batch_records(), 0, "{report:?}");
    assert_eq!(report.missing_offsets, vec![(1, 1)]);
    let ranges: Vec<(u64, u64)> = report.skipped.iter().map(|s| (s.from, s.to)).collect();
    assert_eq!(ranges, vec![(damaged_at, batch_at)]);
}

#[test]
fn damage_in_headers_and_payloads_loses_only_the_damaged_records_and_keeps_offsets() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..30, 500);
    drop(wal);
    let segs = segment_files(&sim, &dir());
    assert!(segs.len() >= 3, "{segs:?}");
    // A flipped bit in the second segment's header, and in a payload of the third.
    let second = dir().join(&segs[1]);
    let mut b = sim.read_file(&second).unwrap();
    b[9] ^= 1;
    sim.write_file_durably(&second, &b).unwrap();
    let third = dir().join(&segs[2]);
    let mut b = sim.read_file(&third).unwrap();
    b[32 + 32 + 100] ^= 1;
    sim.write_file_durably(&third, &b).unwrap();
    let before: Vec<Vec<u8>> = segs.iter().map(|s| sim.read_file(&dir().join(s)).unwrap()).collect();

    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    let third_base: u64 = segs[2].trim_end_matches(".seg").parse().unwrap();
    assert_eq!(report.records, 29, "{report:?}");
    assert_eq!(report.missing_offsets, vec![(third_base, third_base)]);
    assert_eq!(report.skipped.len(), 2, "{report:?}");
    assert_eq!((report.skipped[1].file.clone(), report.skipped[1].from), (third.clone(), 32));
    let got = copied(&sim);
    let want: Vec<(u64, u64)> = (0..30).filter(|&o| o != third_base).map(|o| (o, o)).collect();
    assert_eq!(got, want);
    assert!(inspect::verify(&sim, &out_dir(), &mut |_| {}).unwrap().is_clean());
    let copy = Wal::open_read_only_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &out_dir()).unwrap();
    assert_eq!(copy.open_report().missing_ranges, vec![third_base..third_base + 1]);
    drop(copy);
    let after: Vec<Vec<u8>> = segs.iter().map(|s| sim.read_file(&dir().join(s)).unwrap()).collect();
    assert_eq!(before, after, "the source was changed");
    // A second copy into the same directory is refused.
    assert!(salvage_copy(&sim, &dir(), &out_dir()).is_err());
}

#[test]
fn beside_a_live_writer_only_synced_records_are_copied() {
    let sim = SimStorage::new();
    {
        let wal = open(&sim, small_options());
        rt().block_on(wal.append(vec![payload(1, 100), payload(2, 100)])).unwrap();
    }
    let lazy = WalOptions { sync: SyncPolicy::Interval(Duration::from_secs(60)), ..small_options() };
    let wal = open(&sim, lazy);
    rt().block_on(wal.append(vec![payload(3, 100)])).unwrap();
    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(report.records, 2);
    assert!(report.skipped.is_empty(), "unsynced bytes are not damage: {report:?}");
    assert_eq!(copied(&sim), vec![(0, 1), (1, 2)]);
    drop(wal);
}

/// A copy meant to replace the log is refused while a writer holds it, before anything
/// is written, in the same read as the bound it would be made to: made, it would lack
/// everything the writer appends after it.
#[test]
fn a_copy_of_a_stopped_log_is_refused_beside_a_live_writer() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(wal.append(vec![payload(1, 100)])).unwrap();
    let refused = salvage_copy_of_a_stopped_log(&sim, &dir(), &out_dir(), &mut |_| {});
    assert!(matches!(refused, Err(wal::WalError::WriterRunning(_))), "{refused:?}");
    assert!(sim.list_dir(&out_dir()).is_err(), "nothing is written");
    drop(wal);
    let report = salvage_copy_of_a_stopped_log(&sim, &dir(), &out_dir(), &mut |_| {}).unwrap();
    assert_eq!(report.records, 1);
}

/// The zeros the writer wrote ahead of its records are not damage wherever the walk meets
/// them: damage earlier in the file is one skipped range, and the zeros after the last
/// record are not a second one.
/// Ten records of 100 bytes with zeros written ahead of them (checked), after a power
/// loss; the byte at `at` flipped.
fn ten_records_with_zeros_ahead_damaged_at(at: u64) -> SimStorage {
    let sim = SimStorage::new();
    let opts =
        WalOptions { preallocate_bytes: 64 * 1024, segment_max_bytes: 1 << 20, max_bytes: 8 << 20, ..small_options() };
    let wal = open(&sim, opts);
    append_tagged(&wal, 0..10, 100);
    sim.crash(CrashMode::LoseUnsynced);
    drop(wal);
    let path = dir().join(segment_file_name(0));
    let mut b = sim.read_file(&path).unwrap();
    let records_end = (SEGMENT_HEADER_LEN + 10 * (FRAME_HEADER_LEN + 100)) as usize;
    assert!(b.len() > records_end + 1024 && b[records_end..].iter().all(|&x| x == 0), "zeros written ahead");
    b[at as usize] ^= 0x40;
    sim.write_file_durably(&path, &b).unwrap();
    sim
}

#[test]
fn zeros_written_ahead_after_damage_are_not_reported_as_skipped() {
    let damaged = SEGMENT_HEADER_LEN + 3 * (FRAME_HEADER_LEN + 100);
    let sim = ten_records_with_zeros_ahead_damaged_at(damaged + FRAME_HEADER_LEN + 5);

    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(report.skipped.len(), 1, "{:?}", report.skipped);
    assert_eq!((report.skipped[0].from, report.skipped[0].to), (damaged, damaged + FRAME_HEADER_LEN + 100));
    assert_eq!(report.records, 9);
    assert_eq!(report.missing_offsets, vec![(3, 3)]);
    let want: Vec<(u64, u64)> = (0..10).filter(|&o| o != 3).map(|o| (o, o)).collect();
    assert_eq!(copied(&sim), want);
}

/// Zeros to the end of the file right after bytes that do not check (a write torn before
/// the zeros written ahead of it) end the skipped range where they begin.
#[test]
fn a_skipped_range_ends_where_the_zeros_to_the_end_of_the_file_begin() {
    // The last record's header damaged: its bytes are skipped, the zeros after it are not.
    let last = SEGMENT_HEADER_LEN + 9 * (FRAME_HEADER_LEN + 100);
    let sim = ten_records_with_zeros_ahead_damaged_at(last + 10);

    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(report.records, 9);
    assert_eq!(report.skipped.len(), 1, "{:?}", report.skipped);
    assert_eq!((report.skipped[0].from, report.skipped[0].to), (last, last + FRAME_HEADER_LEN + 100));
}

/// A frame skipped whole (its header checks, its payload does not) whose header begins
/// with a zero byte, followed by zeros to the end of the file: the skipped range ends
/// where the zeros begin. The walk took the frame's first byte for the start of a run of
/// zeros and never looked for zeros to the end at the frame's end, so the range ran on
/// to the end of the file.
#[test]
fn zeros_after_a_frame_skipped_whole_that_begins_with_a_zero_byte_are_not_skipped() {
    let sim = SimStorage::new();
    let mut b = SegmentHeader { base_offset: 0, flags: 0 }.encode().to_vec();
    for offset in 0..2 {
        let at = b.len() as u64;
        b.extend_from_slice(&frame(offset, true, at));
    }
    let damaged_at = b.len() as u64;
    let payload = payload(2, 50);
    // A header that checks, with a payload checksum the payload does not have, and a
    // first byte (the header's own checksum's lowest) of zero.
    let header = (0u32..)
        .map(|wrong| FrameHeader {
            payload_len: payload.len() as u32,
            offset: 2,
            synced_len: damaged_at,
            flags: FLAG_END_OF_BATCH,
            payload_crc: crc32fast::hash(&payload) ^ (wrong + 1),
        })
        .find(|h| h.encode()[0] == 0)
        .unwrap();
    b.extend_from_slice(&header.encode());
    b.extend_from_slice(&payload);
    let zeros_at = b.len() as u64;
    b.extend_from_slice(&[0; 4096]);
    write_source(&sim, &b);

    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(report.records, 2, "{report:?}");
    assert_eq!(report.skipped.len(), 1, "{:?}", report.skipped);
    assert_eq!((report.skipped[0].from, report.skipped[0].to), (damaged_at, zeros_at));
}

/// A writer that holds the lock but has published no watermark yet (it is still
/// recovering) is waited for, as the other read-only openers wait, not answered at once
/// with "unsettled": here it goes away after a moment, and the copy is made.
#[test]
fn a_writer_without_a_watermark_yet_is_waited_for() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..3, 10);
    drop(wal);
    let lock = sim.try_lock(&dir().join(wal::LOCK_FILE)).unwrap();
    let _ = sim.remove_file(&dir().join(wal::WATERMARK_FILE));
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(lock);
    });
    let report = salvage_copy(&sim, &dir(), &out_dir()).expect("the copy waited for the writer to settle");
    release.join().unwrap();
    assert_eq!(report.records, 3);
    assert_eq!(copied(&sim), vec![(0, 0), (1, 1), (2, 2)]);
}

/// Hooks for the simulated disk under which every open of `released` finds it gone: the
/// live writer released it between the copy's listing and its opens.
#[derive(Debug)]
struct ReleasedBeforeOpen {
    released: PathBuf,
}

impl wal::storage::Hooks for ReleasedBeforeOpen {
    fn open(
        &self,
        inner: &dyn Storage,
        path: &std::path::Path,
        mode: wal::storage::OpenMode,
    ) -> std::io::Result<Arc<dyn wal::storage::StorageFile>> {
        if path == self.released {
            return Err(std::io::Error::from(std::io::ErrorKind::NotFound));
        }
        inner.open(path, mode)
    }
}

/// Beside a live writer whose release removes a segment the copy listed, the copy is
/// unsettled (made again), as an open would be, not an I/O error.
#[test]
fn a_segment_released_under_a_copy_beside_a_live_writer_makes_it_unsettled() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..40, 300);
    let bases = segment_files(&sim, &dir());
    assert!(bases.len() >= 3, "{bases:?}");
    let storage =
        wal::storage::HookedStorage::new(Arc::new(sim.clone()), ReleasedBeforeOpen { released: dir().join(&bases[0]) });
    match salvage_copy(&storage, &dir(), &out_dir()) {
        Err(e @ wal::WalError::Unsettled { .. }) => assert!(e.to_string().contains("released"), "{e}"),
        other => panic!("{other:?}"),
    }
    drop(wal);
}

/// A copy cut short (here the disk fills while its second segment is written) leaves
/// whole segments behind, the first one sealed. They must never pass for a log: not for
/// `verify`, which the runbook runs on the copy before it replaces the log, nor for an
/// open, nor for a second copy into the same directory, which is told to start afresh.
#[test]
fn a_copy_that_did_not_finish_is_never_taken_for_a_log() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..30, 500);
    drop(wal);
    let segs = segment_files(&sim, &dir());
    let third = dir().join(&segs[2]);
    let mut b = sim.read_file(&third).unwrap();
    b[32 + 32 + 100] ^= 1;
    sim.write_file_durably(&third, &b).unwrap();

    // Writes: the unfinished-copy file, the source's identity, the first segment, the
    // second (after the gap).
    sim.fail_nth(wal::storage::FaultOp::Write, 4, std::io::ErrorKind::StorageFull);
    assert!(salvage_copy(&sim, &dir(), &out_dir()).is_err());
    let left = segment_files(&sim, &out_dir());
    assert_eq!(left.len(), 1, "the first segment was written whole: {left:?}");
    let open = Wal::open_read_only_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &out_dir());
    assert!(matches!(open, Err(wal::WalError::UnfinishedSalvage(_))), "{open:?}");
    let verified = inspect::verify(&sim, &out_dir(), &mut |_| {});
    assert!(matches!(verified, Err(wal::WalError::UnfinishedSalvage(_))), "{verified:?}");
    let writable = Wal::open_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &out_dir(), small_options());
    assert!(matches!(writable, Err(wal::WalError::UnfinishedSalvage(_))), "{writable:?}");
    match salvage_copy(&sim, &dir(), &out_dir()) {
        Err(wal::WalError::InvalidOptions(m)) => assert!(m.contains("did not finish"), "{m}"),
        other => panic!("a second copy into the unfinished one: {other:?}"),
    }
    // Nor is it copied: the copy of a prefix would open as a log.
    let other = PathBuf::from("/other");
    let again = salvage_copy(&sim, &out_dir(), &other);
    assert!(matches!(again, Err(wal::WalError::UnfinishedSalvage(_))), "{again:?}");
    let written = sim.list_dir(&other).unwrap_or_default();
    assert!(written.is_empty(), "{written:?}");

    // Removed, the copy is made again, whole, and opens.
    for name in sim.list_dir(&out_dir()).unwrap() {
        sim.remove_file(&out_dir().join(name)).unwrap();
    }
    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(report.records, 29, "{report:?}");
    assert!(!sim.list_dir(&out_dir()).unwrap().iter().any(|n| n == wal::SALVAGE_INCOMPLETE_FILE));
    assert_eq!(copied(&sim).len(), 29);
    assert!(inspect::verify(&sim, &out_dir(), &mut |_| {}).unwrap().is_clean());
}

/// A source with no whole batch to copy (here a tail segment holding only its header, at
/// base 100) still gives a log, which continues where the source does: an empty copy at
/// offset 0 would give the offsets the delivery cursors beside the log passed to new
/// records.
#[test]
fn a_source_without_a_whole_batch_still_gives_a_log_that_continues_where_it_did() {
    let sim = SimStorage::new();
    sim.create_dir_all(&dir()).unwrap();
    let header = SegmentHeader { base_offset: 100, flags: 0 }.encode();
    sim.write_file_durably(&dir().join(segment_file_name(100)), &header).unwrap();
    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!((report.records, report.next_offset, report.end_offset), (0, None, 100), "{report:?}");
    assert!(report.missing_offsets.is_empty(), "{report:?}");
    let copy = Wal::open_read_only_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &out_dir()).unwrap();
    assert_eq!((copy.start_offset(), copy.next_offset()), (100, 100));
    assert!(copy.open_report().missing_ranges.is_empty());
}

/// Damage in the last record of the log: the copy holds the records before it, and its
/// log continues past every offset the damaged bytes could have held, never at the
/// damaged record's own offset, which named an event that was answered and may have
/// been delivered. The offsets in between are reported missing.
#[test]
fn damage_at_the_end_of_the_log_never_gives_its_offsets_to_new_records() {
    let sim = SimStorage::new();
    let mut b = SegmentHeader { base_offset: 0, flags: 0 }.encode().to_vec();
    for offset in 0..10 {
        let at = b.len() as u64;
        b.extend_from_slice(&frame(offset, true, at));
    }
    let last = b.len() - 10;
    b[last] ^= 1;
    write_source(&sim, &b);
    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!((report.records, report.next_offset), (9, Some(9)), "{report:?}");
    assert!(report.end_offset > 9, "{report:?}");
    assert!(report.missing_offsets.is_empty(), "{report:?}");
    assert_eq!(report.reserved_offsets, Some((9, report.end_offset - 1)));
    let copy = Wal::open_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &out_dir(), WalOptions::default()).unwrap();
    assert_eq!(copy.next_offset(), report.end_offset);
    assert_eq!(copy.open_report().missing_ranges, vec![9..report.end_offset]);
    let appended = rt().block_on(copy.append(vec![payload(99, 50)])).unwrap();
    assert!(appended.first_offset > 9, "{appended:?}");
    assert_eq!(copied(&sim).into_iter().take(9).map(|(o, _)| o).collect::<Vec<_>>(), (0..9).collect::<Vec<_>>());
}

/// A source whose newest segment starts past offsets nothing holds any more (an in-place
/// salvage resumed there, moving the damaged records aside) and holds no record yet:
/// the copy continues there too, never at the offsets the salvage kept from reuse.
#[test]
fn the_copy_continues_at_the_sources_newest_segment_even_when_it_is_empty() {
    let sim = SimStorage::new();
    let mut b = SegmentHeader { base_offset: 0, flags: 0 }.encode().to_vec();
    for offset in 0..3 {
        let at = b.len() as u64;
        b.extend_from_slice(&frame(offset, true, at));
    }
    let at = b.len() as u64;
    b.extend_from_slice(&FrameHeader::seal(3, at).encode());
    write_source(&sim, &b);
    let tail = SegmentHeader { base_offset: 10, flags: SEGMENT_FLAG_GAP_BEFORE }.encode();
    sim.write_file_durably(&dir().join(segment_file_name(10)), &tail).unwrap();
    assert_eq!(source_end(&sim), 10);

    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!((report.records, report.next_offset, report.end_offset), (3, Some(3), 10), "{report:?}");
    assert!(report.missing_offsets.is_empty(), "the source lost nothing: {report:?}");
    assert_eq!(report.reserved_offsets, Some((3, 9)));
    let copy = Wal::open_read_only_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &out_dir()).unwrap();
    assert_eq!(copy.next_offset(), 10);
}

/// A source salvaged before holds a gap between two segments (the later one's header
/// says so), and records after it. Nothing is lost now: the gap is the source's own, kept
/// in the copy and reported apart, not as missing offsets (which the CLI makes exit 1,
/// "each named a record that is lost"). A gap whose segment before it ended in damage
/// stays missing: what that damage held is lost now.
#[test]
fn a_gap_the_source_already_had_is_kept_and_not_reported_missing() {
    let source = |damaged_end: bool| {
        let sim = SimStorage::new();
        let mut b = SegmentHeader { base_offset: 0, flags: 0 }.encode().to_vec();
        for offset in 0..3 {
            let at = b.len() as u64;
            b.extend_from_slice(&frame(offset, true, at));
        }
        if damaged_end {
            b.extend_from_slice(&[0xA5; 64]);
        }
        let at = b.len() as u64;
        b.extend_from_slice(&FrameHeader::seal(3, at).encode());
        write_source(&sim, &b);
        let mut tail = SegmentHeader { base_offset: 10, flags: SEGMENT_FLAG_GAP_BEFORE }.encode().to_vec();
        for offset in 10..13 {
            let at = tail.len() as u64;
            tail.extend_from_slice(&frame(offset, true, at));
        }
        sim.write_file_durably(&dir().join(segment_file_name(10)), &tail).unwrap();
        assert_eq!(source_end(&sim), 13);
        sim
    };
    let sim = source(false);
    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!((report.records, report.end_offset), (6, 13), "{report:?}");
    assert!(report.missing_offsets.is_empty() && report.skipped.is_empty(), "{report:?}");
    assert_eq!(report.source_gaps, vec![(3, 9)]);
    let copy = Wal::open_read_only_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &out_dir()).unwrap();
    assert_eq!(copy.open_report().missing_ranges, vec![3..10], "the copy keeps the gap");
    drop(copy);
    assert_eq!(copied(&sim).iter().map(|(o, _)| *o).collect::<Vec<_>>(), [0, 1, 2, 10, 11, 12]);

    let sim = source(true);
    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(report.missing_offsets, vec![(3, 9)], "{report:?}");
    assert!(report.source_gaps.is_empty(), "{report:?}");
}

/// The copy tells its progress in bytes of the source walked: never backwards, within a
/// segment at least every `PROGRESS_EVERY_BYTES`, and at the end every byte of every
/// segment, the total it announced from the start.
#[test]
fn the_copy_tells_its_progress_through_every_byte_of_the_source() {
    let sim = SimStorage::new();
    let opts = WalOptions { segment_max_bytes: 3 << 20, max_bytes: 64 << 20, ..small_options() };
    let wal = open(&sim, opts);
    append_tagged(&wal, 0..700, 10_000);
    drop(wal);
    let segments = segment_files(&sim, &dir());
    assert!(segments.len() >= 2, "{segments:?}");
    let source_bytes: u64 = segments.iter().map(|n| sim.read_file(&dir().join(n)).unwrap().len() as u64).sum();

    let mut told = Vec::new();
    let report = salvage_copy_with_progress(&sim, &dir(), &out_dir(), &mut |p| told.push(p)).unwrap();
    assert_eq!(report.records, 700);
    assert!(told.iter().all(|p| p.bytes_total == source_bytes), "{told:?}");
    assert!(told.windows(2).all(|w| w[0].bytes_done <= w[1].bytes_done), "{told:?}");
    assert_eq!(told.last().map(|p| p.bytes_done), Some(source_bytes));
    let steps: Vec<u64> = told.windows(2).map(|w| w[1].bytes_done - w[0].bytes_done).collect();
    // A step is at most a whole frame past the mark (the walk moves a frame at a time),
    // and the next segment's header with the first step in it.
    let largest_step = SEGMENT_HEADER_LEN + PROGRESS_EVERY_BYTES + FRAME_HEADER_LEN + 10_000;
    assert!(steps.iter().all(|&s| s <= largest_step), "{steps:?}");
    assert!(told.len() as u64 >= source_bytes / largest_step, "{} reports for {source_bytes} bytes", told.len());
}

/// A record frame with `payload`, written by hand (its checksums hold).
fn frame_with(offset: u64, ends_batch: bool, synced_len: u64, payload: &[u8]) -> Vec<u8> {
    let h = FrameHeader {
        payload_len: payload.len() as u32,
        offset,
        synced_len,
        flags: if ends_batch { FLAG_END_OF_BATCH } else { 0 },
        payload_crc: crc32fast::hash(payload),
    };
    let mut b = h.encode().to_vec();
    b.extend_from_slice(payload);
    b
}

/// A record whose header checks and whose payload was damaged is skipped whole, as
/// recovery skips it: frames a sender wrote into its payload (they check, as the writer's
/// would) are never copied, never take the place of a record, and never push the records
/// after them out of order. Forged at the next offset, they would replace record 2; at a
/// far one, every record after them would be skipped as out of order.
#[test]
fn frames_a_sender_wrote_inside_a_damaged_payload_are_never_copied() {
    const FORGED_TAG: u64 = 777;
    for forged_offset in [2, 1_000_000] {
        let sim = SimStorage::new();
        let mut b = SegmentHeader { base_offset: 0, flags: 0 }.encode().to_vec();
        b.extend(frame(0, true, SEGMENT_HEADER_LEN));
        let damaged_at = b.len() as u64;
        let mut inside = vec![0x55u8; 8];
        inside.extend(frame_with(forged_offset, true, 0, &payload(FORGED_TAG, 50)));
        inside.extend(frame_with(forged_offset + 1, true, 0, &payload(FORGED_TAG, 50)));
        b.extend(frame_with(1, true, damaged_at, &inside));
        let batch_at = b.len() as u64;
        // One bit of the filler before the forged frames.
        b[(damaged_at + FRAME_HEADER_LEN + 2) as usize] ^= 0x01;
        b.extend(frame(2, false, batch_at));
        b.extend(frame(3, true, batch_at));
        write_source(&sim, &b);

        let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
        assert_eq!(copied(&sim), vec![(0, 0), (2, 2), (3, 3)], "forged at {forged_offset}: {report:?}");
        assert_eq!(report.missing_offsets, vec![(1, 1)], "forged at {forged_offset}");
        assert!(
            report.end_offset < 1_000_000,
            "forged at {forged_offset}: the copy continues at {}",
            report.end_offset
        );
        let ranges: Vec<(u64, u64)> = report.skipped.iter().map(|s| (s.from, s.to)).collect();
        assert_eq!(ranges, vec![(damaged_at, batch_at)], "forged at {forged_offset}");
    }
}

/// While skipping damage to a header, a frame that checks but claims an offset past what
/// its position can hold (a sender's bytes, the next real header lost) is passed over:
/// it reserves no offsets, and does not vouch for where the next batch begins (record 2,
/// right after the damage, may have lost the start of its batch, and is left out).
#[test]
fn a_frame_found_after_damage_claiming_an_offset_its_position_cannot_hold_is_passed_over() {
    let sim = SimStorage::new();
    let mut b = SegmentHeader { base_offset: 0, flags: 0 }.encode().to_vec();
    b.extend(frame(0, true, SEGMENT_HEADER_LEN));
    let damaged_at = b.len() as u64;
    let mut inside = vec![0x55u8; 8];
    inside.extend(frame_with(1_000_000, true, 0, &payload(777, 50)));
    b.extend(frame_with(1, true, damaged_at, &inside));
    let batch_at = b.len() as u64;
    // The header of record 1 is damaged: the walk skips byte by byte through its payload.
    b[(damaged_at + 10) as usize] ^= 0x01;
    b.extend(frame(2, true, batch_at));
    let next_batch_at = b.len() as u64;
    b.extend(frame(3, true, next_batch_at));
    write_source(&sim, &b);

    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(copied(&sim), vec![(0, 0), (3, 3)], "{report:?}");
    assert!(report.end_offset < 1_000_000, "the copy continues at {}", report.end_offset);
}

/// A writer that takes the log and lets it go again while the copy is made (a daemon
/// started and stopped: the lock is held neither when the copy begins nor when it ends)
/// voids the copy: it may have appended records the copy lacks, and a copy swapped in
/// for the log would lose them. Checked only for the lock at the end, the copy stood,
/// without the record appended under it.
#[test]
fn a_writer_that_came_and_went_during_the_copy_voids_it() {
    for stop in ["clean", "crash"] {
        let sim = SimStorage::new();
        let opts = WalOptions { segment_max_bytes: 3 << 20, max_bytes: 64 << 20, ..small_options() };
        let wal = open(&sim, opts.clone());
        append_tagged(&wal, 0..300, 10_000);
        rt().block_on(wal.close()).unwrap();
        drop(wal);
        let out = PathBuf::from(format!("/sim/copy-{stop}"));
        let mut came = false;
        let copied = salvage_copy_with_progress(&sim, &dir(), &out, &mut |_| {
            if std::mem::replace(&mut came, true) {
                return;
            }
            let wal = open(&sim, opts.clone());
            append_tagged(&wal, 300..301, 100);
            if stop == "clean" {
                rt().block_on(wal.close()).unwrap();
            }
        });
        assert!(came, "{stop}: no progress told");
        match copied {
            Err(e @ wal::WalError::Unsettled { .. }) => assert!(e.to_string().contains("let it go again"), "{e}"),
            other => panic!("{stop}: the copy stood: {other:?}"),
        }
        // Made again, the copy holds the record.
        let again = PathBuf::from(format!("/sim/again-{stop}"));
        assert_eq!(salvage_copy(&sim, &dir(), &again).unwrap().records, 301, "{stop}");
    }
}

/// Bytes that do not check at the tail's end are a torn tail only when nothing proves
/// them durable: a later frame written after a sync past them (its synced length beyond
/// the damage) makes them damage, as recovery judges it, and the copy says so.
#[test]
fn damage_a_later_frame_proves_durable_is_no_torn_tail() {
    let sim = SimStorage::new();
    let mut b = SegmentHeader { base_offset: 0, flags: 0 }.encode().to_vec();
    b.extend(frame(0, true, SEGMENT_HEADER_LEN));
    let damaged_at = b.len();
    b.extend(frame(1, true, damaged_at as u64));
    let after = b.len() as u64;
    b.extend(frame(2, true, after));
    // Frame 1's payload flipped: its bytes were synced (frame 2 says so), then damaged.
    b[damaged_at + FRAME_HEADER_LEN as usize + 3] ^= 0x40;
    write_source(&sim, &b);
    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(copied(&sim), vec![(0, 0), (2, 2)], "{report:?}");
    assert_eq!(report.skipped.len(), 1, "{report:?}");
    assert!(!report.skipped[0].torn_tail, "proven durable, taken for a torn tail: {report:?}");
    assert!(report.left_out_more_than_a_torn_tail());

    // Without the later frame, the same bytes at the end are a torn write.
    let sim = SimStorage::new();
    write_source(&sim, &b[..after as usize]);
    let report = salvage_copy(&sim, &dir(), &out_dir()).unwrap();
    assert_eq!(report.skipped.len(), 1, "{report:?}");
    assert!(report.skipped[0].torn_tail, "{report:?}");
}
