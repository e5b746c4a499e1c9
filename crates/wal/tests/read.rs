//! Reading: seeking, bounded batches, tailing, release.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use wal::format::{FRAME_HEADER_LEN, SEGMENT_HEADER_LEN, segment_file_name};
use wal::storage::{FaultOp, SimStorage};
use wal::{RecoveryMode, WalError, WalOptions};

#[test]
fn a_reader_starts_at_any_retained_offset_and_crosses_segments() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..300, 90);
    assert!(wal.segment_paths().len() > 5);
    for from in [0u64, 1, 37, 38, 39, 150, 298, 299, 300] {
        let got = read_all(&wal, from);
        assert_eq!(got.len() as u64, 300 - from, "from {from}");
        for (k, r) in got.iter().enumerate() {
            assert_eq!(r.offset, from + k as u64);
            assert_eq!(tag_of(&r.payload), from + k as u64);
        }
    }
    assert!(matches!(wal.reader(301), Err(WalError::BeyondEnd { offset: 301, end: 300 })));
}

/// A reader finds its position by walking its segment's frames from the start; with
/// `position_some` a caller walks in steps of about the bytes it asks for (at least one
/// frame each), and the reader then reads exactly what a reader positioned in one go
/// reads: from every kind of position (a segment's first record, inside one, its last,
/// the log's end), in steps smaller than a frame, of a few frames, and larger than a
/// segment.
#[test]
fn a_reader_walks_to_its_position_in_steps_and_reads_the_same_records() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..300, 90);
    assert!(wal.segment_paths().len() > 5);
    let frame = FRAME_HEADER_LEN + 90;
    let bases: Vec<u64> = wal
        .segment_paths()
        .iter()
        .map(|p| wal::format::parse_segment_file_name(p.file_name().unwrap().to_str().unwrap()).unwrap())
        .collect();
    let mut walked_in_steps = 0;
    for from in [0u64, 1, 37, 38, 39, 150, 298, 299, 300] {
        let want = read_all(&wal, from);
        for step in [0, 1, 3 * frame, 1 << 20] {
            let mut r = wal.reader(from).unwrap();
            let mut steps = 1u64;
            while !r.position_some(step).unwrap() {
                steps += 1;
                assert!(steps <= 300, "from {from} in steps of {step}: no progress");
            }
            assert!(r.position_some(step).unwrap(), "positioned stays positioned");
            if step == 3 * frame && steps > 1 {
                walked_in_steps += 1;
                // About `step` bytes of frames per call: the frames before `from` in its
                // segment, three at a time.
                let base = bases.iter().copied().filter(|b| *b <= from).max().unwrap();
                assert_eq!(steps, (from - base).div_ceil(3).max(1), "from {from}");
            }
            assert_eq!(r.position(), from);
            let mut got = Vec::new();
            loop {
                let batch = r.try_read(usize::MAX, usize::MAX).unwrap();
                if batch.is_empty() {
                    break;
                }
                got.extend(batch);
            }
            assert_eq!(got, want, "from {from} in steps of {step}");
        }
    }
    assert!(walked_in_steps >= 3, "too few positions needed more than one step");
}

/// A read that fails during a walk in steps is reported, and the walk starts again: the
/// reader then reads the records of a reader that never failed.
#[test]
fn a_failed_read_during_a_walk_in_steps_starts_the_walk_again() {
    let sim = SimStorage::new();
    // 2 MB of records in one segment: the walk reads several chunks.
    let wal = open(&sim, WalOptions { segment_max_bytes: 4 << 20, max_bytes: 16 << 20, ..WalOptions::default() });
    append_tagged(&wal, 0..1000, 2000);
    assert_eq!(wal.segment_paths().len(), 1);
    let from = 990;
    let want = read_all(&wal, from);
    let mut r = wal.reader(from).unwrap();
    assert!(!r.position_some(1).unwrap(), "one frame walked");
    sim.fail_nth(FaultOp::Read, 1, std::io::ErrorKind::Other);
    // Small steps, so that a step needs a new read chunk well before the walk ends.
    let mut failed = false;
    let mut steps = 0;
    loop {
        steps += 1;
        assert!(steps < 100_000, "no progress");
        match r.position_some(4096) {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => {
                assert!(!failed, "failed twice: {e}");
                failed = true;
            }
        }
    }
    assert!(failed, "the injected read failure was never met");
    assert_eq!(r.try_read(usize::MAX, usize::MAX).unwrap(), want);
}

/// Any record the last read returned is given back with those after it, with
/// `unread_from`, and read again next: inside a segment and across a seal. A record of
/// an earlier read, or one given back already, is not.
#[test]
fn records_read_too_many_are_given_back_from_any_of_them() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..300, 90);
    assert!(wal.segment_paths().len() > 5);
    let mut r = wal.reader(0).unwrap();
    let mut seen = Vec::new();
    while r.position() < 300 {
        let got = r.try_read(12, usize::MAX).unwrap();
        let keep = (got.len() / 2).max(1);
        let back = got.get(keep).map(|rec| rec.offset);
        seen.extend(got.iter().take(keep).map(|rec| tag_of(&rec.payload)));
        if let Some(back) = back {
            assert!(r.unread_from(back), "at {back}");
            assert_eq!(r.position(), back);
            assert!(!r.unread_from(back), "given back twice at {back}");
        }
    }
    assert_eq!(seen, (0..300).collect::<Vec<u64>>());
    let earlier = r.try_read(1, usize::MAX).unwrap();
    assert!(earlier.is_empty());
    assert!(!r.unread_from(0), "a record of an earlier read");
}

/// A record read one too many is given back with `unread_from` and read again next, at
/// every position: inside a segment, and for a segment's last record, after which the
/// reader has already crossed the seal into the next segment. Only the last record read
/// can be given back, once.
#[test]
fn the_last_record_read_can_be_given_back_and_is_read_again_next() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..300, 90);
    assert!(wal.segment_paths().len() > 5);
    let mut r = wal.reader(0).unwrap();
    assert!(!r.unread_from(0), "nothing read yet");
    let mut seen = Vec::new();
    // Reads of two or three records, bounded by bytes: each ends by looking at the next
    // record's length, which crosses a seal when the last record read ends a segment.
    let mut bytes = [181, 271].into_iter().cycle();
    while r.position() < 300 {
        let got = r.try_read(usize::MAX, bytes.next().unwrap()).unwrap();
        let last = got.last().unwrap().offset;
        // Give the last back: it comes first in the next read.
        assert!(r.unread_from(last), "at {last}");
        assert_eq!(r.position(), last);
        assert!(!r.unread_from(last), "given back twice at {last}");
        seen.extend(got.iter().filter(|rec| rec.offset != last).map(|rec| tag_of(&rec.payload)));
        let again = r.try_read(1, usize::MAX).unwrap();
        assert_eq!((again[0].offset, tag_of(&again[0].payload)), (last, last));
        seen.push(last);
    }
    assert_eq!(seen, (0..300).collect::<Vec<u64>>());
}

/// The offsets a salvage skipped (between the segment it sealed at the last kept offset
/// and the next one, flagged `GAP_BEFORE`) name no record: a reader asked to start among
/// them starts at the next segment's base, as a reader crossing the gap does, instead of
/// calling the intact seal it meets damage (`wal tail` and `wal dump --from` start there).
#[test]
fn a_reader_started_inside_a_salvage_gap_starts_at_the_next_segment() {
    let sim = SimStorage::new();
    let opts = WalOptions { preallocate_bytes: 0, ..small_options() };
    let wal = open(&sim, opts.clone());
    append_tagged(&wal, 0..10, 100);
    drop(wal);
    // Record 3's payload damaged; the records after it prove it was durable.
    let path = dir().join(segment_file_name(0));
    let mut b = sim.read_file(&path).unwrap();
    b[(SEGMENT_HEADER_LEN + 3 * (FRAME_HEADER_LEN + 100) + FRAME_HEADER_LEN + 5) as usize] ^= 0x40;
    sim.write_file_durably(&path, &b).unwrap();
    let wal = open(&sim, WalOptions { recovery: RecoveryMode::Salvage, ..opts });
    let s = wal.open_report().salvage.clone().expect("salvaged");
    assert_eq!(s.kept_until_offset, 3);
    assert!(s.resumed_at_offset > s.kept_until_offset + 1, "{s:?}");
    // Nothing past the gap yet: an empty read, not an error.
    let mut r = wal.reader(s.kept_until_offset + 1).unwrap();
    assert!(r.try_read(10, 1 << 20).unwrap().is_empty());
    let a = rt().block_on(wal.append(vec![payload(77, 10)])).unwrap();
    assert_eq!(a.first_offset, s.resumed_at_offset);
    assert_eq!(r.try_read(10, 1 << 20).unwrap().len(), 1);
    for from in [s.kept_until_offset, s.kept_until_offset + 1, s.resumed_at_offset - 1, s.resumed_at_offset] {
        let mut r = wal.reader(from).unwrap();
        let got: Vec<(u64, u64)> =
            r.try_read(10, 1 << 20).unwrap().iter().map(|r| (r.offset, tag_of(&r.payload))).collect();
        assert_eq!(got, vec![(s.resumed_at_offset, 77)], "from {from}");
        assert_eq!(r.position(), s.resumed_at_offset + 1);
    }
    assert_eq!(read_all(&wal, 0).len(), 4);
}

/// A read the disk fails is an error (or ends a batch early, the error left for the next
/// call), never records made of what the failed read left in the reader's buffer; the
/// same reader then carries on and returns every record intact. The simulated disk fills
/// half the buffer with garbage when it fails a read, as a failed transfer may.
#[test]
fn a_failed_read_is_an_error_and_the_same_reader_then_reads_every_record_intact() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..120, 90);
    let want = read_all(&wal, 0);
    assert_eq!(want.len(), 120);
    assert!(wal.segment_paths().len() >= 4, "several segments, so several reads");
    let (mut fired, mut errors) = (0, 0);
    for n in 1..=12 {
        sim.fail_nth(FaultOp::Read, n, std::io::ErrorKind::Other);
        let mut r = wal.reader(0).unwrap();
        let mut got = Vec::new();
        loop {
            match r.try_read(7, 1 << 20) {
                Ok(b) if b.is_empty() => break,
                Ok(b) => got.extend(b),
                Err(WalError::Io { .. }) => errors += 1,
                Err(e) => panic!("after the read numbered {n} failed: {e}"),
            }
        }
        fired += usize::from(sim.armed_faults() == 0);
        sim.disarm();
        assert_eq!(got, want, "the read numbered {n} failed");
    }
    assert!(fired >= 4, "the faults reached the reader's reads: {fired} fired");
    assert!(errors >= 1 && errors <= fired, "{errors} errors for {fired} faults");
}

#[test]
fn batches_are_bounded_by_count_and_bytes_but_never_empty_for_a_large_record() {
    let sim = SimStorage::new();
    let wal = open(&sim, WalOptions { segment_max_bytes: 1 << 20, max_bytes: 1 << 24, ..WalOptions::default() });
    rt().block_on(async {
        for i in 0..10 {
            wal.append(vec![payload(i, 1000)]).await.unwrap();
        }
        wal.append(vec![payload(10, 50_000)]).await.unwrap();
    });
    let mut r = wal.reader(0).unwrap();
    assert_eq!(r.try_read(3, 1 << 20).unwrap().len(), 3);
    // 2500 bytes: two 1000-byte records fit, the third would pass the bound.
    assert_eq!(r.try_read(100, 2500).unwrap().len(), 2);
    assert_eq!(r.try_read(100, 5000).unwrap().len(), 5);
    // The large record comes alone even though it exceeds the byte bound.
    let big = r.try_read(100, 10).unwrap();
    assert_eq!(big.len(), 1);
    assert_eq!(big[0].payload.len(), 50_000);
    assert!(r.try_read(100, 10).unwrap().is_empty());
}

#[test]
fn a_tailing_reader_wakes_on_each_append() {
    let sim = SimStorage::new();
    let wal = Arc::new(open(&sim, small_options()));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let mut reader = wal.reader(0).unwrap();
        let tail = tokio::spawn(async move {
            let mut seen = Vec::new();
            while seen.len() < 100 {
                for r in reader.read(7, 1 << 20).await.unwrap() {
                    seen.push(r.offset);
                }
            }
            seen
        });
        for i in 0..100 {
            wal.append(vec![payload(i, 30)]).await.unwrap();
            if i % 10 == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let seen = tokio::time::timeout(Duration::from_secs(10), tail).await.unwrap().unwrap();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
    });
}

/// In lockstep: a reader waiting in `read` is woken by each append on its own, not by a
/// later one (above, a wake-up lost for one append is covered by the next). Each append
/// comes only once the reader is waiting, and its record must come back before the next.
#[test]
fn a_waiting_reader_is_woken_by_every_single_append() {
    let sim = SimStorage::new();
    let wal = Arc::new(open(&sim, small_options()));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let mut reader = wal.reader(0).unwrap();
        for i in 0..50u64 {
            let waiting = tokio::spawn(async move {
                let got = reader.read(10, 1 << 20).await;
                (reader, got)
            });
            // The reader is parked in `read` (nothing durable past it) before the append.
            tokio::time::sleep(Duration::from_millis(2)).await;
            wal.append(vec![payload(i, 30)]).await.unwrap();
            let (back, got) = tokio::time::timeout(Duration::from_secs(5), waiting)
                .await
                .unwrap_or_else(|_| panic!("append {i} did not wake the waiting reader"))
                .unwrap();
            let got = got.unwrap();
            assert_eq!(got.iter().map(|r| r.offset).collect::<Vec<_>>(), vec![i]);
            reader = back;
        }
    });
}

#[test]
fn a_tailing_reader_ends_with_closed_after_the_log_closes() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(async {
        wal.append(vec![payload(1, 10)]).await.unwrap();
        let mut r = wal.reader(0).unwrap();
        wal.close().await.unwrap();
        assert_eq!(r.read(10, 1 << 20).await.unwrap().len(), 1);
        assert!(matches!(r.read(10, 1 << 20).await, Err(WalError::Closed)));
    });
}

#[test]
fn release_deletes_whole_segments_below_and_readers_get_a_clear_error() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(async {
        for i in 0..300 {
            wal.append(vec![payload(i, 90)]).await.unwrap();
        }
        let mut lagging = wal.reader(0).unwrap();
        let segs_before = wal.segment_paths().len();
        let used_before = wal.stats().used_bytes;
        let r = wal.release_below(150).await.unwrap();
        assert_eq!(r.start, 150);
        assert!(r.segments_deleted >= 2);
        assert_eq!(wal.segment_paths().len(), segs_before - r.segments_deleted);
        assert_eq!(wal.stats().used_bytes, used_before - r.bytes_freed);
        assert_eq!(wal.start_offset(), 150);
        assert!(matches!(wal.reader(149), Err(WalError::Released { offset: 149, start: 150 })));
        assert!(matches!(lagging.try_read(1, 100), Err(WalError::Released { offset: 0, start: 150 })));
        assert_eq!(read_all(&wal, 150).len(), 150);
        // Releasing past the end releases only what exists, and never the active segment.
        let r = wal.release_below(u64::MAX).await.unwrap();
        assert_eq!(r.start, 300);
        assert_eq!(wal.segment_paths().len(), 1);
        let a = wal.append(vec![payload(300, 10)]).await.unwrap();
        assert_eq!(a.first_offset, 300, "offsets restarted after a full release");
    });
    drop(wal);
    // After a reopen the log starts at its first retained segment and keeps counting.
    let wal = open(&sim, small_options());
    assert!(wal.start_offset() <= 300);
    assert_eq!(wal.next_offset(), 301);
}

#[test]
fn release_never_moves_backwards() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(async {
        for i in 0..100 {
            wal.append(vec![payload(i, 90)]).await.unwrap();
        }
        wal.release_below(80).await.unwrap();
        let r = wal.release_below(10).await.unwrap();
        assert_eq!(r.start, 80);
    });
}

/// A clean-shutdown marker the disk fails to read is an I/O error for `verify` as for
/// the open, never "no marker" (which would let `verify` call damage in a cleanly closed
/// tail a torn write).
#[test]
fn a_marker_that_cannot_be_read_is_an_error_not_an_absent_marker() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..10, 90);
    rt().block_on(wal.close()).unwrap();
    drop(wal);
    assert!(wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap().is_clean());
    sim.fail_nth(FaultOp::Read, 1, std::io::ErrorKind::Other);
    let err = wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap_err();
    assert!(matches!(err, WalError::Io { ref path, .. } if path.ends_with(wal::CLEAN_MARKER_FILE)), "{err}");
    assert_eq!(sim.armed_faults(), 0);
    sim.fail_nth(FaultOp::Read, 1, std::io::ErrorKind::Other);
    let err = try_open(&sim, small_options()).unwrap_err();
    assert!(matches!(err, WalError::Io { ref path, .. } if path.ends_with(wal::CLEAN_MARKER_FILE)), "{err}");
    assert!(open(&sim, small_options()).open_report().clean_shutdown, "the marker is intact once the disk reads");
}

/// A record read again from the place a reader found it is the record read then, in
/// any segment; a place asked for another offset, a damaged payload, a released record
/// and one not yet durable are each a clear error, never another record's bytes.
#[test]
fn a_record_is_read_again_from_its_place_and_checked_as_a_reader_checks_it() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..300, 90);
    assert!(wal.segment_paths().len() > 5);
    let all = read_all(&wal, 0);
    for r in &all {
        assert_eq!(&wal.read_placed(r.offset, r.place).expect("read placed"), r);
    }
    // The place of record 40 asked for as 41 (same segment), and as 200 (another).
    let forty = all[40].place;
    assert!(matches!(
        wal.read_placed(41, forty),
        Err(WalError::Corrupt { problem: wal::format::FrameProblem::UnexpectedOffset { expected: 41, found: 40 }, .. })
    ));
    assert!(matches!(wal.read_placed(200, forty), Err(WalError::Corrupt { .. })));
    assert!(matches!(wal.read_placed(40, wal::RecordPlace::default()), Err(WalError::Corrupt { .. })));
    // A byte of record 2's payload flipped under the open log.
    let path = dir().join(segment_file_name(0));
    let mut b = sim.read_file(&path).unwrap();
    b[(SEGMENT_HEADER_LEN + 2 * (FRAME_HEADER_LEN + 90) + FRAME_HEADER_LEN + 20) as usize] ^= 0x01;
    sim.write_file_durably(&path, &b).unwrap();
    assert!(matches!(wal.read_placed(2, all[2].place), Err(WalError::Corrupt { .. })));
    assert_eq!(wal.read_placed(1, all[1].place).unwrap(), all[1]);
    assert!(matches!(wal.read_placed(300, all[299].place), Err(WalError::BeyondEnd { offset: 300, end: 300 })));
    rt().block_on(wal.release_below(150)).unwrap();
    assert!(matches!(wal.read_placed(40, forty), Err(WalError::Released { offset: 40, .. })));
    assert_eq!(wal.read_placed(299, all[299].place).unwrap(), all[299]);
}

/// A record is read from its place in one read when its frame fits the first read's
/// 4 KiB, in two when it does not: records around that bound and one of 100 KB, each
/// read whole and checked, and a byte flipped past the first read found.
#[test]
fn a_placed_record_larger_than_the_first_read_is_read_whole_and_checked() {
    let sim = SimStorage::new();
    let wal = open(&sim, WalOptions { segment_max_bytes: 4 << 20, max_bytes: 16 << 20, ..WalOptions::default() });
    let fits = 4096 - FRAME_HEADER_LEN as usize;
    let sizes = [8, fits - 1, fits, fits + 1, 100_000, 8];
    for (tag, &len) in sizes.iter().enumerate() {
        append_tagged(&wal, tag as u64..tag as u64 + 1, len);
    }
    let all = read_all(&wal, 0);
    assert_eq!(all.iter().map(|r| r.payload.len()).collect::<Vec<_>>(), sizes);
    for r in &all {
        assert_eq!(&wal.read_placed(r.offset, r.place).expect("read placed"), r);
    }
    // A byte of the 100 KB record's payload, 50 KB in, flipped under the open log.
    let frame_pos: usize =
        SEGMENT_HEADER_LEN as usize + sizes[..4].iter().map(|l| FRAME_HEADER_LEN as usize + l).sum::<usize>();
    let path = dir().join(segment_file_name(0));
    let mut b = sim.read_file(&path).unwrap();
    b[frame_pos + FRAME_HEADER_LEN as usize + 50_000] ^= 0x01;
    sim.write_file_durably(&path, &b).unwrap();
    assert!(matches!(wal.read_placed(4, all[4].place), Err(WalError::Corrupt { .. })));
    assert_eq!(wal.read_placed(5, all[5].place).unwrap(), all[5]);
    assert_eq!(wal.read_placed(3, all[3].place).unwrap(), all[3]);
}

/// Runs an action once, at the next read of any file: a test's way to land a release
/// between a reader's check of the log's start and its crossing of a seal.
#[derive(Default)]
struct ActOnNextRead {
    action: std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

impl std::fmt::Debug for ActOnNextRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ActOnNextRead")
    }
}

impl wal::storage::Hooks for ActOnNextRead {
    fn read_at(&self, file: &dyn wal::storage::StorageFile, buf: &mut [u8], pos: u64) -> std::io::Result<usize> {
        let act = self.action.lock().unwrap().take();
        if let Some(act) = act {
            act();
        }
        file.read_at(buf, pos)
    }
}

/// A reader that waits (its window let go, `release_buffer`) after reading its segment
/// to the end keeps no file of it open: once every destination delivered past it, the log
/// deletes the segment, and an open file would keep its disk space taken for as long as
/// the reader waits, while the log counts it freed. Before, the reader kept it open
/// until its next read. On the real file system: the kernel says what is still open.
#[test]
fn a_waiting_reader_keeps_no_deleted_segment_open() {
    let tmp = tempfile::tempdir().unwrap();
    let wal = wal::Wal::open(tmp.path(), small_options()).unwrap();
    append_tagged(&wal, 0..300, 90);
    let a = wal::inspect::segments_of(&wal).unwrap()[1].base_offset;
    let mut r = wal.reader(0).unwrap();
    while r.position() < a {
        r.try_read(1, 1).unwrap();
    }
    assert_eq!(r.position(), a);
    r.release_buffer();
    assert_eq!(rt().block_on(wal.release_below(a)).unwrap().segments_deleted, 1);
    let dir = tmp.path().canonicalize().unwrap();
    let deleted_open: Vec<std::path::PathBuf> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter(|target| target.starts_with(&dir) && target.to_string_lossy().ends_with(" (deleted)"))
        .collect();
    assert!(deleted_open.is_empty(), "a deleted segment is kept open: {deleted_open:?}");
    let got = r.try_read(1, 1 << 20).unwrap();
    assert_eq!(got[0].offset, a, "the reader goes on where it was");
}

/// A release past a reader's position that lands while the reader crosses a seal (its
/// start checked, the seal read through its open file, the segments after it deleted)
/// gives the reader `Released`, never the records after the released ones as if the
/// offsets between did not exist. The seal is read from the file where the reader's
/// read window ends right before it: two records fill a segment's first window exactly.
#[test]
fn a_release_during_a_seal_crossing_is_released_never_a_silent_gap() {
    const WINDOW_BYTES: u64 = 256 * 1024;
    let frame_payload_bytes = (WINDOW_BYTES / 2 - FRAME_HEADER_LEN) as usize;
    let options = WalOptions {
        segment_max_bytes: SEGMENT_HEADER_LEN + WINDOW_BYTES + FRAME_HEADER_LEN,
        preallocate_bytes: 0,
        ..small_options()
    };
    let hooked = Arc::new(wal::storage::HookedStorage::new(Arc::new(SimStorage::new()), ActOnNextRead::default()));
    let wal = Arc::new(wal::Wal::open_with(hooked.clone(), &dir(), options).unwrap());
    append_tagged(&wal, 0..5, frame_payload_bytes);
    let segs = wal::inspect::segments_of(&wal).unwrap();
    let bases: Vec<u64> = segs.iter().map(|s| s.base_offset).collect();
    assert_eq!(bases, vec![0, 2, 4], "two records a segment");
    let (a, b) = (segs[1].base_offset, segs[2].base_offset);
    let mut r = wal.reader(0).unwrap();
    // The byte bound stops each read right after its record, before it looks past it:
    // the reader ends at the seal, its window read to the end.
    for offset in 0..a {
        let got = r.try_read(1, 1).unwrap();
        assert_eq!(got[0].offset, offset);
    }
    assert_eq!(r.position(), a);
    let w = wal.clone();
    *hooked.hooks().action.lock().unwrap() = Some(Box::new(move || {
        assert_eq!(rt().block_on(w.release_below(b)).unwrap().segments_deleted, 2);
    }));
    match r.try_read(10, 1 << 20) {
        Err(WalError::Released { offset, start }) => assert_eq!((offset, start), (a, b)),
        other => panic!("expected Released, got {other:?}"),
    }
}
