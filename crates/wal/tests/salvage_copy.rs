//! Salvage by copy: every record that still checks, under its own offset, in a new log;
//! the source untouched, a live writer's unsynced bytes left out.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use wal::format::{FRAME_HEADER_LEN, SEGMENT_HEADER_LEN, segment_file_name};
use wal::salvage_copy::salvage_copy;
use wal::storage::{CrashMode, SimStorage, Storage};
use wal::{SyncPolicy, Wal, WalOptions, inspect};

fn out_dir() -> PathBuf {
    PathBuf::from("/sim/copy")
}

fn copied(sim: &SimStorage) -> Vec<(u64, u64)> {
    let wal = Wal::open_read_only_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &out_dir()).expect("copy opens");
    read_all(&wal, wal.start_offset()).iter().map(|r| (r.offset, tag_of(&r.payload))).collect()
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
