//! Opening a log: torn tails, damage to durable bytes, salvage, locks, markers.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::*;
use wal::format::{
    FRAME_HEADER_LEN, FrameHeader, SEGMENT_FLAG_GAP_BEFORE, SEGMENT_HEADER_LEN, SegmentHeader, segment_file_name,
};
use wal::storage::{CrashMode, FaultOp, SimStorage, Storage};
use wal::{RecoveryMode, Wal, WalError, WalOptions};

/// These tests build crash images by hand, so a file must end where its records end: no
/// zeros written ahead (those are tested in `append.rs` and by every crash sweep).
fn small_options() -> WalOptions {
    WalOptions { preallocate_bytes: 0, ..common::small_options() }
}

fn seg_path(base: u64) -> std::path::PathBuf {
    dir().join(segment_file_name(base))
}

fn flip(sim: &SimStorage, path: &Path, at: usize) {
    let mut b = sim.read_file(path).unwrap();
    b[at] ^= 0x40;
    sim.write_file_durably(path, &b).unwrap();
}

/// Edits the segment header's first 28 bytes and writes a checksum that holds over them,
/// as a build writing other header fields would; returns the file's new bytes.
fn rewrite_header(sim: &SimStorage, path: &Path, edit: impl FnOnce(&mut [u8])) -> Vec<u8> {
    let mut b = sim.read_file(path).unwrap();
    edit(&mut b[0..28]);
    let crc = crc32(&b[0..28]);
    b[28..32].copy_from_slice(&crc.to_le_bytes());
    sim.write_file_durably(path, &b).unwrap();
    b
}

fn set_version(version: u32) -> impl FnOnce(&mut [u8]) {
    move |h| h[8..12].copy_from_slice(&version.to_le_bytes())
}

/// Appends `n` single-record batches of `len` bytes, tags 0..n.
fn fill(sim: &SimStorage, opts: &WalOptions, n: u64, len: usize) {
    let wal = open(sim, opts.clone());
    append_tagged(&wal, 0..n, len);
}

#[test]
fn a_torn_tail_is_cut_and_reported_and_acknowledged_records_stay() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 3, 100);
    // Append half a frame by hand, as a crash in the middle of a write leaves it.
    let path = seg_path(0);
    let mut b = sim.read_file(&path).unwrap();
    let len_before = b.len();
    b.extend_from_slice(&[0xAB; 50]);
    sim.write_file_durably(&path, &b).unwrap();
    let wal = open(&sim, small_options());
    let r = wal.open_report();
    assert_eq!(r.truncated_bytes, 50);
    assert!(!r.torn_tail_zeros_only, "a torn write is not zeros written ahead");
    assert_eq!(r.torn_at.as_ref().map(|l| l.position), Some(len_before as u64));
    assert_eq!(read_all(&wal, 0).len(), 3);
    assert_eq!(sim.read_file(&path).unwrap().len(), len_before);
}

/// A log of one record (tag 0) and then a batch of three (tags 1 to 3), 50 bytes each.
fn one_record_then_a_batch_of_three() -> SimStorage {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(async {
        wal.append(vec![payload(0, 50)]).await.unwrap();
        wal.append(vec![payload(1, 50), payload(2, 50), payload(3, 50)]).await.unwrap();
    });
    sim
}

#[test]
fn a_batch_missing_its_closing_record_is_dropped_whole() {
    let sim = one_record_then_a_batch_of_three();
    // Cut the file inside the last record of the second batch.
    let path = seg_path(0);
    let b = sim.read_file(&path).unwrap();
    let found_len = b.len() as u64 - 10;
    sim.write_file_durably(&path, &b[..found_len as usize]).unwrap();
    // The torn write begins where the batch does, after the one-record batch: the open,
    // `verify` and the bytes cut all say so.
    let batch_at = SEGMENT_HEADER_LEN + FRAME_HEADER_LEN + 50;
    let v = wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap();
    assert_eq!(v.torn_tail.map(|l| l.position), Some(batch_at));
    let wal = open(&sim, small_options());
    let r = wal.open_report();
    assert_eq!(r.dropped_partial_batch_records, 2);
    assert_eq!(r.torn_at.as_ref().map(|l| l.position), Some(batch_at), "{r:?}");
    assert_eq!(batch_at + r.truncated_bytes, found_len, "{r:?}");
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![0], "a partial batch survived");
}

/// A sender's payload may hold bytes that decode as a frame header claiming the segment
/// was synced past the damage. When a torn write damages that very record, those bytes
/// are no proof that durable data was hit (a proof frame is a frame of its own, and no
/// frame starts inside another): the open cuts the torn write. Before, it refused to
/// start with "damage hit acknowledged data".
#[test]
fn a_frame_header_inside_a_torn_records_payload_is_no_proof_of_durable_damage() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 2, 100);
    let path = seg_path(0);
    let third = SEGMENT_HEADER_LEN + 2 * (FRAME_HEADER_LEN + 100);
    let fake = FrameHeader { payload_len: 0, offset: 3, synced_len: third + 1, flags: 0, payload_crc: 0 };
    let mut body = vec![0x55u8; 100];
    body[40..40 + FRAME_HEADER_LEN as usize].copy_from_slice(&fake.encode());
    {
        let wal = open(&sim, small_options());
        rt().block_on(wal.append(vec![bytes::Bytes::from(body)])).unwrap();
    }
    // The write is torn before the fake header: the record's payload does not check.
    flip(&sim, &path, (third + FRAME_HEADER_LEN + 5) as usize);
    let wal = try_open(&sim, small_options()).unwrap_or_else(|e| panic!("the torn write was taken for damage: {e}"));
    let r = wal.open_report();
    assert_eq!(r.torn_at.as_ref().map(|l| l.position), Some(third), "{r:?}");
    assert_eq!(read_all(&wal, 0).len(), 2);
    assert_eq!(sim.read_file(&path).unwrap().len() as u64, third);
}

#[test]
fn damage_in_the_middle_of_the_tail_is_an_error_naming_file_and_position() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 5, 100);
    let path = seg_path(0);
    // Flip a payload byte of the second record: later records prove it was durable.
    let second = SEGMENT_HEADER_LEN + (FRAME_HEADER_LEN + 100);
    flip(&sim, &path, (second + FRAME_HEADER_LEN + 10) as usize);
    let e = try_open(&sim, small_options()).unwrap_err();
    match &e {
        WalError::Corrupt { location, .. } => {
            assert_eq!(location.file, path);
            assert_eq!(location.position, second);
        }
        other => panic!("expected Corrupt, got {other}"),
    }
    assert!(e.to_string().contains("00000000000000000000.seg at byte 164"), "{e}");
    // Nothing was changed by the refused open.
    assert_eq!(sim.read_file(&path).unwrap().len() as u64, SEGMENT_HEADER_LEN + 5 * (FRAME_HEADER_LEN + 100));
}

#[test]
fn damage_in_a_sealed_segment_is_found_by_readers_and_verify() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 100, 100);
    flip(&sim, &seg_path(0), 500);
    // Opening checks headers and seals, not every byte of sealed segments.
    let wal = open(&sim, small_options());
    let mut r = wal.reader(0).unwrap();
    let e = loop {
        match r.try_read(1000, 1 << 20) {
            Ok(b) if b.is_empty() => panic!("damage not seen"),
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert!(e.is_corruption(), "{e}");
    drop(wal);
    let report = wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert_eq!(report.problems[0].location.file, seg_path(0));
}

/// Damage in a sealed segment ends the walk of that segment, not the check of what
/// follows: its seal still says where the successor must begin, so a segment missing
/// right after it is reported too. Without the seal read, verify said the log had one
/// problem, and a script that salvaged by it would not know records were gone.
#[test]
fn verify_reports_a_segment_missing_after_a_damaged_one() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 200, 100);
    let names = segment_files(&sim, &dir());
    assert!(names.len() >= 4, "{names:?}");
    flip(&sim, &seg_path(0), 500);
    sim.remove_file(&dir().join(&names[1])).unwrap();
    let report = wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap();
    let found: Vec<(&Path, &str)> =
        report.problems.iter().map(|p| (p.location.file.as_path(), p.what.as_str())).collect();
    assert_eq!(found.len(), 2, "{found:?}");
    assert_eq!(found[0].0, seg_path(0));
    assert_eq!(found[1].0, dir().join(&names[2]));
    assert!(found[1].1.starts_with("offsets do not continue"), "{found:?}");
}

/// A seal the writer could not have written (inside a batch whose last record is missing)
/// is named as such, not as an offset that was expected where it stands.
#[test]
fn a_seal_inside_an_unfinished_batch_is_named_as_one() {
    let sim = one_record_then_a_batch_of_three();
    // The batch's last record replaced by a seal at the offset after the two before it,
    // and a successor starting there.
    let path = seg_path(0);
    let b = sim.read_file(&path).unwrap();
    let kept = b.len() - (FRAME_HEADER_LEN as usize + 50);
    let mut damaged = b[..kept].to_vec();
    damaged.extend_from_slice(&FrameHeader::seal(3, kept as u64).encode());
    sim.write_file_durably(&path, &damaged).unwrap();
    sim.write_file_durably(&seg_path(3), &SegmentHeader { base_offset: 3, flags: 0 }.encode()).unwrap();
    let report = wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap();
    assert_eq!(report.problems.len(), 1, "{:?}", report.problems);
    assert_eq!(report.problems[0].what, "a seal inside an unfinished batch (after 2 of its records)");
}

#[test]
fn a_missing_segment_is_a_gap_error() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 200, 100);
    let names = segment_files(&sim, &dir());
    assert!(names.len() >= 4);
    sim.remove_file(&dir().join(&names[1])).unwrap();
    let e = try_open(&sim, small_options()).unwrap_err();
    assert!(matches!(e, WalError::Gap { .. }), "{e}");
}

/// The writer never seals an empty segment: a seal at or below its own segment's base is
/// damage, even when the next segment may start past it (`GAP_BEFORE`), and never a
/// segment of "negative" records for the inspection.
#[test]
fn a_seal_not_above_its_segments_base_is_damage_even_before_a_gap() {
    for seal in [50, 100] {
        let sim = SimStorage::new();
        sim.create_dir_all(&dir()).unwrap();
        let mut a = SegmentHeader { base_offset: 100, flags: 0 }.encode().to_vec();
        a.extend_from_slice(&FrameHeader::seal(seal, SEGMENT_HEADER_LEN).encode());
        sim.write_file_durably(&seg_path(100), &a).unwrap();
        let b = SegmentHeader { base_offset: 200, flags: SEGMENT_FLAG_GAP_BEFORE }.encode();
        sim.write_file_durably(&seg_path(200), &b).unwrap();
        assert_readers_refuse_the_seal_of_segment_100(&sim, seal);
        assert!(try_open(&sim, small_options()).unwrap_err().is_corruption());
        let v = wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap();
        assert_eq!(v.problems.len(), 1, "seal {seal}: {:?}", v.problems);
        assert_eq!(v.problems[0].location.file, seg_path(100));
    }
}

/// A read-only open and the segment listing both refuse segment 100's seal at `seal`
/// (not above the base) as damage at its first frame.
fn assert_readers_refuse_the_seal_of_segment_100(sim: &SimStorage, seal: u64) {
    let storage: Arc<dyn Storage> = Arc::new(sim.clone());
    let e = Wal::open_read_only_with(storage.clone(), &dir()).unwrap_err();
    assert!(
        matches!(e, WalError::Corrupt { ref location, .. } if location.file == seg_path(100) && location.position == SEGMENT_HEADER_LEN),
        "seal {seal}: {e}"
    );
    assert!(e.to_string().contains(&format!("offset {seal} where 101 was expected")), "{e}");
    let e = wal::inspect::list_segments(storage, &dir()).unwrap_err();
    assert!(e.is_corruption(), "seal {seal}: {e}");
}

/// The same holds for the tail: a tail whose seal names its own base (or one below it) is
/// damage, for every opener, never a sealed tail to start a successor after (that
/// successor would take the tail's own name, and the first release would then delete the
/// live segment's directory entry) nor a torn write to cut. A salvage moves it aside.
#[test]
fn a_tail_sealed_at_or_below_its_own_base_is_damage() {
    for seal in [100, 50] {
        let sim = SimStorage::new();
        sim.create_dir_all(&dir()).unwrap();
        let mut tail = SegmentHeader { base_offset: 100, flags: 0 }.encode().to_vec();
        tail.extend_from_slice(&FrameHeader::seal(seal, SEGMENT_HEADER_LEN).encode());
        sim.write_file_durably(&seg_path(100), &tail).unwrap();
        assert_readers_refuse_the_seal_of_segment_100(&sim, seal);
        let e = try_open(&sim, small_options()).unwrap_err();
        assert!(
            matches!(e, WalError::Corrupt { ref location, .. } if location.file == seg_path(100)),
            "seal {seal}: {e}"
        );
        assert_eq!(segment_files(&sim, &dir()), vec![segment_file_name(100)], "seal {seal}");
        assert_eq!(sim.read_file(&seg_path(100)).unwrap(), tail, "seal {seal}: a refused open changed the tail");
        let v = wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap();
        assert_eq!(v.problems.len(), 1, "seal {seal}: {:?}", v.problems);
        assert_eq!(v.problems[0].location, wal::Location { file: seg_path(100), position: SEGMENT_HEADER_LEN });
        assert_eq!(v.torn_tail, None, "seal {seal}");

        let wal = open(&sim, WalOptions { recovery: RecoveryMode::Salvage, ..small_options() });
        let s = wal.open_report().salvage.clone().expect("a salvage report");
        assert!(s.resumed_at_offset > 100, "seal {seal}: {s:?}");
        assert_eq!(wal.segment_paths(), vec![seg_path(s.resumed_at_offset)], "seal {seal}");
        // Nothing below the new tail is left: released offsets and skipped ones cannot be
        // told apart there.
        assert_eq!(wal.open_report().missing_ranges, vec![0..s.resumed_at_offset], "seal {seal}");
        assert_eq!(s.moved_files, vec![dir().join(wal::DAMAGED_DIR).join(segment_file_name(100))]);
        let a = rt().block_on(wal.append(vec![payload(1, 10)])).unwrap();
        assert_eq!(a.first_offset, s.resumed_at_offset);
        drop(wal);
        let wal = open(&sim, small_options());
        let offsets: Vec<u64> = read_all(&wal, wal.start_offset()).iter().map(|r| r.offset).collect();
        assert_eq!(offsets, vec![s.resumed_at_offset], "seal {seal}");
    }
}

#[test]
fn a_bad_segment_header_is_refused() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 10, 100);
    flip(&sim, &seg_path(0), 3);
    let e = try_open(&sim, small_options()).unwrap_err();
    assert!(matches!(e, WalError::BadSegmentHeader { .. }), "{e}");
}

#[test]
fn a_future_format_version_is_refused_by_name() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 1, 10);
    let path = seg_path(0);
    let b = rewrite_header(&sim, &path, set_version(2));
    let e = try_open(&sim, small_options()).unwrap_err();
    assert!(e.to_string().contains("format version 2"), "{e}");
    // Not damage: no salvage may move it aside, nor copy it as this version's frames.
    assert!(!e.is_corruption(), "{e}");
    let salvaging = WalOptions { recovery: RecoveryMode::Salvage, ..small_options() };
    let e = try_open(&sim, salvaging).unwrap_err();
    assert!(e.to_string().contains("format version 2"), "{e}");
    assert_eq!(sim.read_file(&path).unwrap(), b, "the segment was changed");
    let e = wal::salvage_copy::salvage_copy(&sim, &dir(), std::path::Path::new("/sim/copy")).unwrap_err();
    assert!(e.to_string().contains("format version 2"), "{e}");
    // Refused before the copy was begun: nothing to remove by hand.
    assert!(sim.list_dir(std::path::Path::new("/sim/copy")).is_err(), "a copy was begun");
    // Nor may `wal verify` call it damaged (and send the operator to salvage it).
    let e = wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("format version 2") && !e.is_corruption(), "{e}");
}

/// A salvage moves every segment from the damage on: a later segment of another format
/// version among them would be moved aside as damage. The open refuses by its version
/// instead, and changes nothing.
#[test]
fn a_salvage_refuses_when_a_later_segment_is_of_another_format_version() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 120, 100);
    let files = segment_files(&sim, &dir());
    assert!(files.len() >= 3, "{files:?}");
    // Damage in the first segment's header, another version in the last one's.
    flip(&sim, &seg_path(0), 3);
    let last = dir().join(files.last().unwrap());
    rewrite_header(&sim, &last, set_version(2));
    let before: Vec<Vec<u8>> = files.iter().map(|f| sim.read_file(&dir().join(f)).unwrap()).collect();
    let salvaging = WalOptions { recovery: RecoveryMode::Salvage, ..small_options() };
    let e = try_open(&sim, salvaging).unwrap_err();
    assert!(e.to_string().contains("format version 2"), "{e}");
    assert_eq!(segment_files(&sim, &dir()), files, "a segment was moved");
    let after: Vec<Vec<u8>> = files.iter().map(|f| sim.read_file(&dir().join(f)).unwrap()).collect();
    assert!(before == after, "a segment was changed");
    // A salvage copy is refused before it is begun, the other version found behind the
    // damage.
    let copy = std::path::Path::new("/sim/copy");
    let e = wal::salvage_copy::salvage_copy(&sim, &dir(), copy).unwrap_err();
    assert!(e.to_string().contains("format version 2"), "{e}");
    assert!(sim.list_dir(copy).is_err(), "a copy was begun");
}

/// The header's reserved bytes are zero in every segment this build writes; a header
/// whose checksum holds over other reserved bytes was not written by it.
#[test]
fn a_segment_header_with_reserved_bytes_set_is_refused() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 1, 10);
    let path = seg_path(0);
    rewrite_header(&sim, &path, |h| h[24] = 1);
    let e = try_open(&sim, small_options()).unwrap_err();
    assert!(e.to_string().contains("reserved bytes are 0x1, not zero"), "{e}");
}

fn crc32(b: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(b);
    h.finalize()
}

#[test]
fn salvage_keeps_the_valid_prefix_moves_the_rest_and_never_reuses_an_offset() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 200, 100);
    let names = segment_files(&sim, &dir());
    let total_before: u64 = 200;
    // Damage the second segment's third record.
    let second = &names[1];
    let second_base: u64 = second.trim_end_matches(".seg").parse().unwrap();
    let pos = SEGMENT_HEADER_LEN + 2 * (FRAME_HEADER_LEN + 100) + FRAME_HEADER_LEN + 5;
    flip(&sim, &dir().join(second), pos as usize);
    // A strict open checks seals, not every byte of sealed segments; readers find it.
    let wal = open(&sim, small_options());
    let mut r = wal.reader(second_base).unwrap();
    // The records before the damage come back first; the damage is the next answer, and
    // the reader stays at it.
    assert_eq!(r.try_read(10, 1 << 20).unwrap().len(), 2);
    assert!(r.try_read(10, 1 << 20).unwrap_err().is_corruption());
    assert!(r.try_read(10, 1 << 20).unwrap_err().is_corruption());
    assert_eq!(r.position(), second_base + 2);
    drop(wal);

    let opts = WalOptions { recovery: RecoveryMode::Salvage, ..small_options() };
    let wal = open(&sim, opts);
    let s = wal.open_report().salvage.clone().expect("salvage report");
    assert_eq!(s.kept_until_offset, second_base + 2);
    assert!(s.resumed_at_offset >= total_before, "resumed at {} below the old end", s.resumed_at_offset);
    // The offsets the salvage skipped, from the kept prefix's seal to the new tail.
    assert_eq!(wal.open_report().missing_ranges, vec![second_base + 2..s.resumed_at_offset]);
    assert_eq!(s.moved_files.len(), names.len() - 1);
    let kept: Vec<u64> = read_all(&wal, 0).iter().map(|r| r.offset).collect();
    assert_eq!(kept, (0..second_base + 2).collect::<Vec<_>>());
    let a = rt().block_on(wal.append(vec![payload(7777, 10)])).unwrap();
    assert_eq!(a.first_offset, s.resumed_at_offset);
    // The damaged files are kept for the operator.
    let damaged = sim.list_dir(&dir().join(wal::DAMAGED_DIR)).unwrap();
    assert_eq!(damaged.len(), names.len() - 1);
    drop(wal);
    // The salvaged log reopens strictly, gap and all, and reads across the gap.
    let wal = open(&sim, small_options());
    let all = read_all(&wal, 0);
    assert_eq!(all.last().map(|r| r.offset), Some(s.resumed_at_offset));
    assert_eq!(all.len() as u64, second_base + 3);
    assert!(wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap().is_clean());
    assert_eq!(wal.open_report().missing_ranges, vec![second_base + 2..s.resumed_at_offset], "after a reopen");
}

/// Opens the log with `opts`, the power lost at its `k`th mutation (in `mode`); whether
/// the power was lost (false once the open makes fewer than `k` mutations). The fault is
/// disarmed either way.
fn opened_losing_power_at(sim: &SimStorage, opts: &WalOptions, k: u64, mode: CrashMode) -> bool {
    sim.crash_at_nth(FaultOp::AnyMutation, k, mode);
    drop(try_open(sim, opts.clone()));
    sim.disarm();
    sim.crashes() > 0
}

/// A power loss at any step of a salvage in place: opening again (strictly or with
/// salvage) never resumes below an offset the damaged log held, and a salvage then keeps
/// exactly the valid prefix. The salvage moves files and rewrites the damaged segment's
/// name; each crash point below is one more of its mutations.
#[test]
fn a_power_loss_at_any_step_of_a_salvage_loses_no_kept_record_and_reuses_no_offset() {
    let salvage = WalOptions { recovery: RecoveryMode::Salvage, ..small_options() };
    let mut crash_points = 0;
    for k in 1.. {
        let sim = SimStorage::new();
        fill(&sim, &small_options(), 200, 100);
        let names = segment_files(&sim, &dir());
        assert!(names.len() >= 4, "the damage must have segments after it: {names:?}");
        let second_base: u64 = names[1].trim_end_matches(".seg").parse().unwrap();
        let pos = SEGMENT_HEADER_LEN + 2 * (FRAME_HEADER_LEN + 100) + FRAME_HEADER_LEN + 5;
        flip(&sim, &dir().join(&names[1]), pos as usize);

        if !opened_losing_power_at(&sim, &salvage, k, CrashMode::LoseUnsynced) {
            break;
        }
        crash_points += 1;
        // A strict open may refuse (the damage is still there) or open the finished
        // salvage; either way no offset the damaged log held is handed out again.
        if let Ok(wal) = try_open(&sim, small_options()) {
            let a = rt().block_on(wal.append(vec![payload(9999, 10)])).unwrap();
            assert!(a.first_offset >= 200, "crash point {k}: a strict open resumed at {}", a.first_offset);
            drop(wal);
        }
        let wal = try_open(&sim, salvage.clone()).unwrap_or_else(|e| panic!("crash point {k}: {e}"));
        let kept: Vec<u64> = read_all(&wal, wal.start_offset()).iter().map(|r| r.offset).collect();
        let prefix: Vec<u64> = (0..second_base + 2).collect();
        assert!(kept.starts_with(&prefix), "crash point {k}: kept {kept:?}");
        assert!(
            kept[prefix.len()..].iter().all(|o| *o >= 200),
            "crash point {k}: records after the prefix below the old end: {kept:?}"
        );
        let a = rt().block_on(wal.append(vec![payload(7777, 10)])).unwrap();
        assert!(a.first_offset >= 200, "crash point {k}: resumed at {}", a.first_offset);
    }
    assert!(crash_points > 8, "the salvage made only {crash_points} mutations");
}

#[test]
fn only_one_writer_at_a_time_but_any_number_of_readers() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(wal.append(vec![payload(1, 10)])).unwrap();
    let e = try_open(&sim, small_options()).unwrap_err();
    assert!(matches!(e, WalError::Locked(_)), "{e}");
    let storage: Arc<dyn Storage> = Arc::new(sim.clone());
    let r1 = Wal::open_read_only_with(storage.clone(), &dir()).unwrap();
    let r2 = Wal::open_read_only_with(storage, &dir()).unwrap();
    assert_eq!(read_all(&r1, 0).len(), 1);
    assert_eq!(read_all(&r2, 0).len(), 1);
    assert!(matches!(rt().block_on(r1.append(vec![payload(2, 1)])), Err(WalError::ReadOnly)));
    drop(wal);
    assert!(try_open(&sim, small_options()).is_ok());
}

#[test]
fn the_real_file_system_lock_refuses_a_second_writer() {
    let tmp = tempfile::tempdir().unwrap();
    let first = Wal::open(tmp.path(), small_options()).unwrap();
    let e = Wal::open(tmp.path(), small_options()).unwrap_err();
    assert!(e.to_string().contains("locked by another writer"), "{e}");
    drop(first);
    Wal::open(tmp.path(), small_options()).unwrap();
}

/// A segment moved to another disk and linked back is refused, by name, never passed
/// over: left out, the tail's records were taken for missing, the previous segment
/// became the tail, and their offsets were given to new records.
#[test]
fn a_segment_that_is_not_a_regular_file_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, elsewhere) = (tmp.path().join("wal"), tmp.path().join("elsewhere"));
    let wal = Wal::open(&dir, small_options()).unwrap();
    append_tagged(&wal, 0..30, 500);
    let next = wal.next_offset();
    drop(wal);
    let mut segments: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".seg"))
        .collect();
    segments.sort();
    assert!(segments.len() > 2, "{segments:?}");
    let tail = segments.last().unwrap().clone();
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::rename(dir.join(&tail), elsewhere.join(&tail)).unwrap();
    std::os::unix::fs::symlink(elsewhere.join(&tail), dir.join(&tail)).unwrap();
    for e in [Wal::open(&dir, small_options()).unwrap_err(), Wal::open_read_only(&dir).unwrap_err()] {
        let m = e.to_string();
        assert!(m.contains(&tail) && m.contains("not a regular file"), "{m}");
    }
    // Nothing was changed: put back, the log opens whole.
    std::fs::remove_file(dir.join(&tail)).unwrap();
    std::fs::rename(elsewhere.join(&tail), dir.join(&tail)).unwrap();
    assert_eq!(Wal::open(&dir, small_options()).unwrap().next_offset(), next);
}

#[test]
fn read_only_open_of_something_that_is_not_a_log_says_so() {
    let sim = SimStorage::new();
    let storage: Arc<dyn Storage> = Arc::new(sim.clone());
    let e = Wal::open_read_only_with(storage.clone(), Path::new("/nowhere")).unwrap_err();
    assert!(matches!(e, WalError::NotALog(_)), "{e}");
    sim.create_dir_all(Path::new("/empty")).unwrap();
    let e = Wal::open_read_only_with(storage, Path::new("/empty")).unwrap_err();
    assert!(matches!(e, WalError::NotALog(_)), "{e}");
}

#[test]
fn read_only_open_hides_a_torn_tail_without_cutting_it() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 2, 100);
    let path = seg_path(0);
    let mut b = sim.read_file(&path).unwrap();
    b.extend_from_slice(&[7; 40]);
    sim.write_file_durably(&path, &b).unwrap();
    let storage: Arc<dyn Storage> = Arc::new(sim.clone());
    let ro = Wal::open_read_only_with(storage, &dir()).unwrap();
    assert_eq!(read_all(&ro, 0).len(), 2);
    assert_eq!(ro.open_report().truncated_bytes, 40);
    assert_eq!(sim.read_file(&path).unwrap().len(), b.len(), "a read-only open changed the file");
}

/// A power loss at each step of a rotation (sealing the full segment, then creating its
/// successor: the temporary file made, written, synced, renamed into place, the
/// directory synced), under seeded mixes of what was not synced: each run did lose
/// power, and the next open holds a dense log, no temporary file, and takes appends.
/// The dead writer cannot clean up after the loss (its view of the simulated disk is
/// fenced), so some runs leave a temporary file for the open to remove, and the sweep
/// requires that some did. The open's removal is also checked on its own at the end,
/// with the file a creation cut short while it was written leaves.
#[test]
fn an_interrupted_segment_creation_leaves_nothing_behind() {
    let opts = small_options();
    let mut temp_files_removed_by_an_open = 0;
    for n in 1..=8 {
        for k in 1..=8u64 {
            let seed = k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let sim = SimStorage::new();
            let wal = open(&sim, opts.clone());
            rt().block_on(async {
                let mut i = 0;
                let mut armed = false;
                loop {
                    if !armed && segment_files(&sim, &dir()).len() == 1 && wal.stats().used_bytes > 3500 {
                        sim.crash_at_nth(FaultOp::Metadata, n, CrashMode::Adversarial { seed });
                        armed = true;
                    }
                    if wal.append(vec![payload(i, 200)]).await.is_err() {
                        break;
                    }
                    i += 1;
                }
            });
            assert_eq!(sim.crashes(), 1, "metadata operation {n}, seed {seed}: no power loss");
            drop(wal);
            let wal = open(&sim, opts.clone());
            let names = sim.list_dir(&dir()).unwrap();
            assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
            temp_files_removed_by_an_open += wal.open_report().removed_temp_files.len();
            let records = read_all(&wal, 0).len() as u64;
            assert_eq!(wal.next_offset(), records, "metadata operation {n}, seed {seed}");
            rt().block_on(wal.append(vec![payload(9999, 200)])).unwrap();
        }
    }
    assert!(temp_files_removed_by_an_open > 0, "no power loss left a temporary file behind");

    // The successor's temporary file as a process that died while writing it leaves it:
    // named, half a header, its name in the directory. The open removes it and says so.
    let sim = SimStorage::new();
    let wal = open(&sim, opts.clone());
    rt().block_on(wal.append(vec![payload(1, 200)])).unwrap();
    let next = wal.next_offset();
    drop(wal);
    let tmp = format!("{}.tmp", wal::format::segment_file_name(next));
    sim.write_file_durably(&dir().join(&tmp), &[0x49; 16]).unwrap();
    let wal = open(&sim, opts);
    assert_eq!(wal.open_report().removed_temp_files, vec![tmp]);
    assert!(sim.list_dir(&dir()).unwrap().iter().all(|n| !n.ends_with(".tmp")));
    assert_eq!(wal.next_offset(), next);
    rt().block_on(wal.append(vec![payload(2, 200)])).unwrap();
}

#[test]
fn a_clean_marker_that_does_not_match_the_tail_is_ignored() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(async {
        wal.append(vec![payload(1, 10)]).await.unwrap();
        wal.close().await.unwrap();
    });
    drop(wal);
    // The tail grew after the marker was written (a marker never removed): scan wins.
    let path = seg_path(0);
    let mut b = sim.read_file(&path).unwrap();
    b.extend_from_slice(&[0; 32]);
    sim.write_file_durably(&path, &b).unwrap();
    let wal = open(&sim, small_options());
    assert!(!wal.open_report().clean_shutdown);
    assert_eq!(wal.open_report().truncated_bytes, 32);
    assert_eq!(wal.next_offset(), 1);
}

/// Arms the faults that leave a failed sync's bytes in place: the sync fails, then the cut
/// back meant to undo it, then the zeros meant to undo it instead (the write after the
/// append's own).
///
/// The failed sync writes none of its sectors: what these tests check is that the next
/// open reads the tail from the disk, not from the page cache, and a sector the disk did
/// get reads the same either way (that case, a failed append that comes back whole, is
/// `a_failed_sync_that_partly_reached_the_disk_loses_no_answered_record`).
fn fail_the_sync_and_its_undo(sim: &SimStorage) {
    sim.set_failed_syncs_write_nothing(true);
    sim.fail_nth(FaultOp::Sync, 1, std::io::ErrorKind::Other);
    sim.fail_nth(FaultOp::Metadata, 1, std::io::ErrorKind::Other);
    sim.fail_nth(FaultOp::Write, 2, std::io::ErrorKind::Other);
}

/// Appends records tagged `0..good`, then one more whose write's sync fails and whose
/// undo fails too: the writer stops, poisoned, with that write in the page cache (clean,
/// as Linux leaves pages after a failed sync) but not on disk.
fn poison_by_a_failed_sync(sim: &SimStorage, good: u64) {
    let wal = open(sim, small_options());
    append_tagged(&wal, 0..good, 1000);
    fail_the_sync_and_its_undo(sim);
    assert!(rt().block_on(wal.append(vec![payload(good, 1000)])).is_err());
    assert!(!wal.accepts_appends());
    // What the failure did not need stays unfired; the next process starts clean.
    sim.disarm();
}

/// The tags of every record after a power loss that keeps only synced bytes.
fn tags_after_a_power_loss(sim: &SimStorage) -> Vec<u64> {
    sim.crash(CrashMode::LoseUnsynced);
    let wal = try_open(sim, small_options()).expect("the log opens after the power loss");
    read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect()
}

/// A failed sync may have written any of its sectors before it failed, and its undo
/// failing too leaves the log poisoned: the next open keeps the failed append if the
/// disk got all of it (whole and checksummed: a duplicate of what its sender was told
/// failed and sends again, never a loss), and cuts it as a torn tail otherwise. Either
/// way every answered record survives the next power loss, offsets dense.
#[test]
fn a_failed_sync_that_partly_reached_the_disk_loses_no_answered_record() {
    let mut cut = 0;
    for ops_before in 0..48u64 {
        let sim = SimStorage::new();
        let wal = open(&sim, small_options());
        append_tagged(&wal, 0..2, 1000);
        // Operations that change nothing the log holds, to vary what the sync wrote.
        let other = sim.open(Path::new("/sim/other"), wal::storage::OpenMode::CreateNew).unwrap();
        for _ in 0..ops_before {
            other.write_all_at(b"x", 0).unwrap();
        }
        sim.fail_nth(FaultOp::Sync, 1, std::io::ErrorKind::Other);
        sim.fail_nth(FaultOp::Metadata, 1, std::io::ErrorKind::Other);
        sim.fail_nth(FaultOp::Write, 2, std::io::ErrorKind::Other);
        assert!(rt().block_on(wal.append(vec![payload(2, 1000)])).is_err());
        assert!(!wal.accepts_appends());
        sim.disarm();
        drop(wal);
        let wal = open(&sim, small_options());
        let next = wal.next_offset();
        match next {
            3 => {}
            2 => cut += 1,
            n => panic!("ops before {ops_before}: next offset {n}"),
        }
        append_tagged(&wal, 3..4, 1000);
        drop(wal);
        let expected: Vec<u64> = if next == 3 { vec![0, 1, 2, 3] } else { vec![0, 1, 3] };
        assert_eq!(tags_after_a_power_loss(&sim), expected, "ops before {ops_before}");
    }
    // Here the undo's zeroing fails half-way, so part of the frame is zeros in the page
    // cache (dirty, read as such) and the next open cuts it every time; what the draws
    // vary is which of its sectors, and of the log's tail, the disk holds under it.
    assert!(cut > 0, "never cut");
}

#[test]
fn records_whose_sync_failed_are_not_kept_by_the_next_open() {
    let sim = SimStorage::new();
    // The third record fits the segment: its frame is what the failed sync lost.
    poison_by_a_failed_sync(&sim, 2);
    // The next start reads the tail from the disk: the failed record is not there.
    let wal = open(&sim, small_options());
    assert_eq!(wal.next_offset(), 2);
    rt().block_on(async {
        let a = wal.append(vec![payload(3, 1000)]).await.unwrap();
        assert_eq!(a.first_offset, 2);
    });
    drop(wal);
    // A power loss keeps every record answered durable.
    assert_eq!(tags_after_a_power_loss(&sim), vec![0, 1, 3]);
}

/// `verify` and salvage by copy read a log no writer holds as the open does: the record
/// whose sync failed (its sender was answered with an error and will send it again) is
/// neither counted nor copied into the salvaged log, where it would come back as a
/// duplicate.
#[test]
fn verify_and_salvage_by_copy_leave_out_records_whose_sync_failed() {
    let sim = SimStorage::new();
    poison_by_a_failed_sync(&sim, 2);
    let v = wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap();
    assert_eq!(v.records, 2, "verify counted the failed append");
    let copy = Path::new("/sim/salvaged");
    let report = wal::salvage_copy::salvage_copy(&sim, &dir(), copy).unwrap();
    assert_eq!(report.records, 2, "salvage copied the failed append");
    let st: Arc<dyn Storage> = Arc::new(sim.clone());
    let salvaged = Wal::open_read_only_with(st, copy).unwrap();
    let tags: Vec<u64> = read_all(&salvaged, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![0, 1]);
}

#[test]
fn a_seal_whose_sync_failed_is_not_built_on_by_the_next_open() {
    let sim = SimStorage::new();
    // The fourth record needs a new segment: the seal is what the failed sync lost.
    poison_by_a_failed_sync(&sim, 3);
    // The next start must not build a successor on a seal that is not on disk.
    let wal = open(&sim, small_options());
    assert_eq!(wal.next_offset(), 3);
    drop(wal);
    // A power loss must not take the seal from under a successor.
    assert_eq!(tags_after_a_power_loss(&sim), vec![0, 1, 2]);
}

#[test]
fn a_stale_clean_marker_does_not_spare_a_poisoned_tail_from_the_disk_read() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..2, 1000);
    rt().block_on(wal.close()).unwrap();
    drop(wal);
    let marker_path = dir().join(wal::CLEAN_MARKER_FILE);
    let stale = sim.read_file(&marker_path).unwrap();
    // The next start removes the marker; its writer then fails a sync and the cut back.
    let wal = open(&sim, small_options());
    fail_the_sync_and_its_undo(&sim);
    assert!(rt().block_on(wal.append(vec![payload(2, 1000)])).is_err());
    assert!(!wal.accepts_appends());
    sim.disarm();
    drop(wal);
    // A marker that names an older length of the tail vouches for nothing.
    sim.write_file_durably(&marker_path, &stale).unwrap();
    let wal = open(&sim, small_options());
    assert_eq!(wal.next_offset(), 2, "the record whose sync failed was read back");
    assert!(!wal.open_report().clean_shutdown);
    append_tagged(&wal, 3..4, 1000);
    drop(wal);
    assert_eq!(tags_after_a_power_loss(&sim), vec![0, 1, 3]);
}

/// On a first start the log's directory, and directories above it, may not exist yet. A
/// power loss must not take them away, and with them every record answered durable: the
/// open syncs each directory it creates and the parent of each.
#[test]
fn a_new_log_directory_survives_a_power_loss_with_its_records() {
    let sim = SimStorage::new();
    let fresh = Path::new("/fresh/data/wal");
    let wal = Wal::open_with(Arc::new(sim.clone()), fresh, small_options()).unwrap();
    rt().block_on(async {
        for t in 0..3 {
            wal.append(vec![payload(t, 100)]).await.unwrap_or_else(|e| panic!("{e}"));
        }
    });
    sim.crash(CrashMode::LoseUnsynced);
    drop(wal);
    // A new process, with its own view of the disk.
    let wal = Wal::open_with(Arc::new(sim.clone()), fresh, small_options()).unwrap();
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![0, 1, 2], "the power loss took the new directory, or records in it");
}

/// A log directory that already exists may be one an earlier run created and stopped
/// before syncing its parent (killed, or a failed sync): its entry, and with it every
/// record synced inside it, is not yet durable. An open makes it so whether or not it
/// created the directory, before it accepts an append.
#[test]
fn an_existing_log_directory_whose_entry_never_reached_the_disk_is_made_durable_at_open() {
    // The directories exist, their entries never synced: an installer's `mkdir -p`, or
    // an earlier open that stopped at its first directory sync.
    for earlier_open_fails in [false, true] {
        let sim = SimStorage::new();
        if earlier_open_fails {
            sim.fail_nth(FaultOp::SyncDir, 1, std::io::ErrorKind::Other);
            assert!(try_open(&sim, small_options()).is_err(), "the first open's directory sync fails");
            sim.disarm();
        } else {
            sim.create_dir_all(&dir()).unwrap();
        }
        let wal = open(&sim, small_options());
        rt().block_on(wal.append(vec![payload(0, 100)])).unwrap();
        drop(wal);
        sim.crash(CrashMode::LoseUnsynced);
        let wal = open(&sim, small_options());
        let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
        assert_eq!(tags, vec![0], "earlier open failed: {earlier_open_fails}");
    }
}

/// A clean shutdown's marker names the tail it closed, every byte of it synced: damage
/// in its last batch is not a torn write, and the open refuses (a salvage keeps what
/// checks) rather than cut records that were acknowledged. `verify` says the same.
#[test]
fn damage_in_the_last_batch_of_a_cleanly_closed_tail_refuses_the_open() {
    for flip_at in [Flip::LastPayloadByte, Flip::EndOfBatchFlag] {
        let sim = SimStorage::new();
        let wal = open(&sim, small_options());
        rt().block_on(async {
            wal.append(vec![payload(1, 100)]).await.unwrap();
            wal.append(vec![payload(2, 100), payload(3, 100)]).await.unwrap();
            wal.close().await.unwrap();
        });
        drop(wal);
        let path = seg_path(0);
        let mut b = sim.read_file(&path).unwrap();
        match flip_at {
            Flip::LastPayloadByte => {
                let n = b.len() - 1;
                b[n] ^= 1;
            }
            Flip::EndOfBatchFlag => {
                // The batch's last frame is cut away whole: the bytes left check, but end
                // no batch (the marker is rewritten to name the shorter tail).
                let last_frame = FRAME_HEADER_LEN as usize + 100;
                b.truncate(b.len() - last_frame);
                let marker_path = dir().join(wal::CLEAN_MARKER_FILE);
                let mut m = sim.read_file(&marker_path).unwrap();
                rewrite_marker_tail_len(&mut m, b.len() as u64);
                sim.write_file_durably(&marker_path, &m).unwrap();
            }
        }
        sim.write_file_durably(&path, &b).unwrap();
        assert!(!wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap().is_clean(), "{flip_at:?}");
        match try_open(&sim, small_options()) {
            Err(e) => assert!(e.is_corruption(), "{flip_at:?}: {e}"),
            Ok(w) => panic!("{flip_at:?}: opened, next offset {}, {:?}", w.next_offset(), w.open_report()),
        }
        assert_eq!(sim.read_file(&path).unwrap(), b, "{flip_at:?}: the refused open changed the tail");
    }
}

#[derive(Debug, Clone, Copy)]
enum Flip {
    LastPayloadByte,
    EndOfBatchFlag,
}

fn rewrite_marker_tail_len(m: &mut Vec<u8>, tail_len: u64) {
    let mut marker = wal::format::CleanMarker::decode(m).expect("a clean marker");
    marker.tail_len = tail_len;
    *m = marker.encode().to_vec();
}

/// Every salvage above copies segments of a few KiB, one chunk each. The salvage copies
/// in chunks of 1 MiB (the real size, not one shrunk for tests); here the damaged
/// segment is 1.3 MiB and its valid prefix 1.2 MiB, so each of its two copies (the
/// damaged file into `damaged/`, then the prefix over the damaged file's name) takes
/// two chunk writes before its sync, split inside a record. A power loss after any mutation, keeping only
/// what was synced or a seeded mix of the rest: the next salvage keeps every record of
/// the prefix with its bytes, resumes no lower than the old end, and every copy of the
/// damaged segment in `damaged/` is that segment byte for byte.
#[test]
fn a_power_loss_inside_a_multi_chunk_salvage_copy_loses_no_kept_record() {
    const LEN: usize = 64 * 1024;
    const RECORDS: u64 = 20;
    const DAMAGED_RECORD: u64 = 18;
    let opts = WalOptions { segment_max_bytes: 8 << 20, max_bytes: 64 << 20, ..small_options() };
    let salvage = WalOptions { recovery: RecoveryMode::Salvage, ..opts.clone() };
    // The damaged log, built once; each crash point starts from a copy of its files.
    let image = {
        let sim = SimStorage::new();
        fill(&sim, &opts, RECORDS, LEN);
        let names = segment_files(&sim, &dir());
        assert_eq!(names.len(), 1, "the records must share one segment: {names:?}");
        let pos = SEGMENT_HEADER_LEN + DAMAGED_RECORD * (FRAME_HEADER_LEN + LEN as u64) + FRAME_HEADER_LEN + 5;
        flip(&sim, &dir().join(&names[0]), pos as usize);
        let files = sim.list_dir(&dir()).unwrap();
        files.into_iter().map(|n| (dir().join(&n), sim.read_file(&dir().join(&n)).unwrap())).collect::<Vec<_>>()
    };
    let damaged_log = || {
        let sim = SimStorage::new();
        for (path, bytes) in &image {
            sim.write_file_durably(path, bytes).unwrap();
        }
        sim
    };
    let original = &image.iter().find(|(p, _)| p.ends_with(segment_file_name(0))).expect("segment 0").1;
    assert!(original.len() > 1 << 20, "the damaged segment must take two chunks: {} bytes", original.len());
    let modes = [CrashMode::LoseUnsynced, CrashMode::Adversarial { seed: 7 }, CrashMode::Reordered { seed: 11 }];
    let mut crash_points = 0;
    let mut damaged_copies_checked = 0;
    for mode in modes {
        for k in 1.. {
            let sim = damaged_log();
            if !opened_losing_power_at(&sim, &salvage, k, mode) {
                break;
            }
            crash_points += 1;
            let wal = try_open(&sim, salvage.clone()).unwrap_or_else(|e| panic!("{mode:?} at {k}: {e}"));
            let kept = read_all(&wal, wal.start_offset());
            let prefix = kept.iter().take_while(|r| r.offset < DAMAGED_RECORD).count() as u64;
            assert_eq!(prefix, DAMAGED_RECORD, "{mode:?} at {k}: kept {prefix} records of the prefix");
            for r in &kept[..prefix as usize] {
                assert_eq!(r.payload, payload(r.offset, LEN), "{mode:?} at {k}: record {} changed", r.offset);
            }
            assert!(
                kept[prefix as usize..].iter().all(|r| r.offset >= RECORDS),
                "{mode:?} at {k}: a record after the prefix below the old end"
            );
            // A crash after the first salvage created its tail leaves that (empty) tail
            // for the next salvage to move aside too; the copies of the damaged segment
            // bear its name.
            let copies = sim.list_dir(&dir().join(wal::DAMAGED_DIR)).unwrap();
            for name in copies.into_iter().filter(|n| n.starts_with(&segment_file_name(0))) {
                let copy = sim.read_file(&dir().join(wal::DAMAGED_DIR).join(&name)).unwrap();
                assert!(&copy == original, "{mode:?} at {k}: damaged/{name} is not the damaged segment");
                damaged_copies_checked += 1;
            }
            let a = rt().block_on(wal.append(vec![payload(7777, 10)])).unwrap();
            assert!(a.first_offset >= RECORDS, "{mode:?} at {k}: resumed at {}", a.first_offset);
            drop(wal);
            // And the salvaged log opens strictly, with the same records.
            let wal = try_open(&sim, opts.clone()).unwrap_or_else(|e| panic!("{mode:?} at {k}, strict: {e}"));
            assert_eq!(read_all(&wal, wal.start_offset()).len(), kept.len() + 1, "{mode:?} at {k}");
        }
    }
    // Two copies of two chunk writes each, a sync and a rename per copy, the tail's
    // creation and the directories' syncs: more than 12 points in each mode.
    assert!(crash_points > 3 * 12, "the salvage made only {crash_points} mutations in three modes");
    assert!(damaged_copies_checked > 0, "no crash left a copy in damaged/ to compare");
}

/// A lookup that fails (a directory listing, the open of a file that exists, a file's
/// length: `EIO` on a directory block, a mount gone) at any point of an open, strict or
/// salvaging, of a log a power loss left: the open fails with an I/O error, never taken
/// for damage or for a directory with no log, or it opens the whole log; either way
/// nothing is moved, cut or created, and the next open finds every record.
#[test]
fn a_failed_lookup_at_any_point_of_an_open_changes_nothing_and_loses_nothing() {
    let built = SimStorage::new();
    fill(&built, &small_options(), 120, 100);
    built.crash(CrashMode::LoseUnsynced);
    let files = segment_files(&built, &dir());
    assert!(files.len() >= 3, "{files:?}");
    let bytes: Vec<Vec<u8>> = files.iter().map(|f| built.read_file(&dir().join(f)).unwrap()).collect();
    let salvaging = WalOptions { recovery: RecoveryMode::Salvage, ..small_options() };
    for options in [small_options(), salvaging] {
        let mut failed = 0;
        for n in 1.. {
            let sim = built.fork();
            sim.fail_nth(FaultOp::Lookup, n, std::io::ErrorKind::Other);
            let context = format!("{:?}, lookup {n}", options.recovery);
            match try_open(&sim, options.clone()) {
                Err(e) => {
                    assert!(matches!(e, WalError::Io { .. }), "{context}: {e}");
                    failed += 1;
                }
                Ok(wal) => {
                    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
                    assert_eq!(tags, (0..120).collect::<Vec<_>>(), "{context}: opened without them");
                    drop(wal);
                }
            }
            let fired = sim.armed_faults() == 0;
            sim.disarm();
            assert_eq!(segment_files(&sim, &dir()), files, "{context}: the segments changed");
            let moved = sim.list_dir(&dir().join(wal::DAMAGED_DIR)).unwrap_or_default();
            assert_eq!(moved, Vec::<String>::new(), "{context}: moved aside");
            let wal = open(&sim, small_options());
            let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
            assert_eq!(tags, (0..120).collect::<Vec<_>>(), "{context}: lost by the next open");
            if !fired {
                break;
            }
        }
        assert!(failed >= files.len(), "{:?}: only {failed} lookups failed the open", options.recovery);
    }
    // The sweep forked what was built: its segments are as they were.
    let after: Vec<Vec<u8>> = files.iter().map(|f| built.read_file(&dir().join(f)).unwrap()).collect();
    assert!(after == bytes);
}

/// A read that fails while a salvage opens the log is an error, never damage, whichever
/// read it is (a segment's header, its frames, its seal, the tail): the open fails and
/// moves nothing aside, and once the disk reads every record is there. Taken for damage,
/// a failed read of a sealed segment's header or seal had the salvage move every later
/// segment into `damaged/`, intact records and all.
#[test]
fn a_read_that_fails_during_a_salvage_moves_nothing_aside() {
    let sim = SimStorage::new();
    fill(&sim, &small_options(), 120, 100);
    let files = segment_files(&sim, &dir());
    assert!(files.len() >= 3, "{files:?}");
    let salvaging = WalOptions { recovery: RecoveryMode::Salvage, ..small_options() };
    let mut failed = 0;
    for n in 1.. {
        sim.fail_nth(FaultOp::Read, n, std::io::ErrorKind::Other);
        match try_open(&sim, salvaging.clone()) {
            Err(e) => {
                assert!(matches!(e, WalError::Io { .. }), "read {n}: {e}");
                failed += 1;
            }
            Ok(wal) => {
                assert!(wal.open_report().salvage.is_none(), "read {n}: salvaged");
                rt().block_on(wal.close()).unwrap();
            }
        }
        let fired = sim.armed_faults() == 0;
        sim.disarm();
        assert_eq!(segment_files(&sim, &dir()), files, "read {n}: a segment was moved");
        let moved = sim.list_dir(&dir().join(wal::DAMAGED_DIR)).unwrap_or_default();
        assert_eq!(moved, Vec::<String>::new(), "read {n}: moved aside");
        if !fired {
            break;
        }
    }
    assert!(failed >= files.len(), "only {failed} reads failed the open");
    let wal = open(&sim, small_options());
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, (0..120).collect::<Vec<_>>());
}

/// A log's identity is written by its first writable open and kept by every later one; a
/// directory emptied and written again is another log, with another identity; a salvage
/// copy carries its source's.
#[test]
fn a_log_keeps_its_identity_and_a_log_begun_again_has_another() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    let first = wal.open_report().log_id.expect("a writable open has an identity");
    assert!(wal.open_report().log_id_created);
    append_tagged(&wal, 0..10, 90);
    rt().block_on(wal.close()).unwrap();
    drop(wal);
    let wal = open(&sim, small_options());
    assert_eq!((wal.open_report().log_id, wal.open_report().log_id_created), (Some(first), false));
    rt().block_on(wal.close()).unwrap();
    drop(wal);
    let read_only = Wal::open_read_only_with(Arc::new(sim.clone()), &dir()).unwrap();
    assert_eq!(read_only.open_report().log_id, None, "a read-only open reads no identity");
    drop(read_only);

    let out = std::path::PathBuf::from("/sim/copy");
    let copy = wal::salvage_copy::salvage_copy(&sim, &dir(), &out).unwrap();
    assert_eq!(copy.log_id, Some(first));
    let copied = Wal::open_with(Arc::new(sim.clone()), &out, small_options()).unwrap();
    assert_eq!((copied.open_report().log_id, copied.open_report().log_id_created), (Some(first), false));
    drop(copied);

    for name in sim.list_dir(&dir()).unwrap() {
        sim.remove_file(&dir().join(name)).unwrap();
    }
    let again = open(&sim, small_options());
    let second = again.open_report().log_id.unwrap();
    assert!(again.open_report().log_id_created);
    assert_ne!(second, first, "a log begun again took the old one's identity");
}

/// An identity that is not whole is damage: the writable open gives the log a new one and
/// says what was wrong, the records kept; the keeper of the log's offsets then finds an
/// identity other than the one it recorded. Removed, the log gets a new one too.
#[test]
fn a_damaged_identity_is_replaced_and_said() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    let first = wal.open_report().log_id.unwrap();
    append_tagged(&wal, 0..3, 90);
    rt().block_on(wal.close()).unwrap();
    drop(wal);
    let path = dir().join(wal::identity::LOG_ID_FILE);
    let mut bytes = sim.read_file(&path).unwrap();
    assert_eq!(bytes.len(), wal::identity::LOG_ID_LEN);
    bytes[9] ^= 0x01;
    sim.write_file_durably(&path, &bytes).unwrap();
    // Read-only tools read the log without it.
    assert!(wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap().is_clean());
    let wal = open(&sim, small_options());
    let report = wal.open_report().clone();
    assert!(report.log_id_created);
    assert!(report.log_id_damaged.as_deref().is_some_and(|d| d.contains("checksum")), "{report:?}");
    let second = report.log_id.unwrap();
    assert_ne!(second, first);
    let kept = sim.read_file(&dir().join(wal::identity::LOG_ID_DAMAGED_FILE)).unwrap();
    assert_eq!(kept, bytes, "the damaged identity was not kept aside as it was");
    assert_eq!(read_all(&wal, 0).len(), 3, "the records are kept");
    rt().block_on(wal.close()).unwrap();
    drop(wal);
    let wal = open(&sim, small_options());
    assert_eq!((wal.open_report().log_id, wal.open_report().log_id_damaged.as_ref()), (Some(second), None));
    drop(wal);

    sim.remove_file(&path).unwrap();
    let wal = open(&sim, small_options());
    assert!(wal.open_report().log_id_created);
    assert_ne!(wal.open_report().log_id, Some(second));
}

/// A power loss at any step of writing the identity leaves a log that opens, with an
/// identity that reads back whole at every later open.
#[test]
fn a_power_loss_while_the_identity_is_written_leaves_a_log_that_opens() {
    // At each mutation of the first open (the directory, the lock, the identity's file,
    // write, sync, rename and the directory's sync, then the first segment's), until the
    // open makes no more.
    let mut crashed_at = 0;
    for n in 1.. {
        let sim = SimStorage::new();
        sim.crash_at_nth(FaultOp::AnyMutation, n, CrashMode::LoseUnsynced);
        let _ = try_open(&sim, small_options());
        if sim.armed_faults() > 0 {
            break;
        }
        crashed_at = n;
        let wal = open(&sim, small_options());
        assert_eq!(wal.open_report().log_id_damaged, None, "mutation {n}: a torn identity was found");
        let id = wal.open_report().log_id.unwrap();
        append_tagged(&wal, 0..2, 90);
        rt().block_on(wal.close()).unwrap();
        drop(wal);
        let wal = open(&sim, small_options());
        assert_eq!(wal.open_report().log_id, Some(id), "mutation {n}: the identity changed after it was used");
        assert_eq!(read_all(&wal, 0).len(), 2);
    }
    assert!(crashed_at >= 8, "the first open made {crashed_at} mutations");
}
