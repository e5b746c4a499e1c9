//! Memory the log holds: the writer's group buffer must not stay at the size of the
//! largest batch it ever wrote, and a salvage must not hold a segment it copies.
//! Counted with this test binary's own allocator, on the real file system (the simulated
//! disk keeps its files in memory). The tests take turns: each counts every thread's
//! allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use wal::{RecoveryMode, Wal, WalOptions};

/// The system allocator, counting the bytes live now and the most live since the last
/// reset of `PEAK`.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// Held by each test for its whole run.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

const MIB: usize = 1024 * 1024;
/// What other threads may allocate or free while a test counts: far below the megabytes
/// each test looks for.
const SLACK_BYTES: usize = 64 * 1024;

/// One batch of 96 MiB (six records at most of the default record size, past the
/// default 16 MiB group): once it is durable and the caller dropped it, the log holds
/// about a group's buffer, not the batch's.
#[test]
fn the_writer_does_not_keep_a_buffer_the_size_of_its_largest_batch() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions::default();
    let keep = options.group_max_bytes + options.preallocate_bytes as usize;
    let wal = Wal::open(dir.path().join("wal"), options).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    // A small append first, so that what the writer always keeps is in the baseline.
    rt.block_on(wal.append(vec![Bytes::from_static(b"warm")])).unwrap();
    let before = LIVE.load(Ordering::Relaxed);
    {
        let batch: Vec<Bytes> = (0..6).map(|i| Bytes::from(vec![i as u8; 16 * MIB])).collect();
        rt.block_on(wal.append(batch)).unwrap();
    }
    // The writer thread shrinks its buffer right after the write, before it answers.
    let after = LIVE.load(Ordering::Relaxed);
    let kept = after.saturating_sub(before);
    assert!(kept <= keep * 2, "the log keeps {} MiB after a 96 MiB batch (a group is {} MiB)", kept / MIB, keep / MIB);
    rt.block_on(wal.close()).unwrap();
}

/// A salvage copies the damaged segment into `damaged/` and its valid prefix into place:
/// here 40 MiB of records with the damage at about 30 MiB. It copies in chunks, so it
/// holds a few MiB at most, not the segment twice (70 MiB); and the copies are exact, the
/// kept records read back and the original's bytes are all in `damaged/`.
#[test]
fn a_salvage_copies_a_large_segment_without_holding_it() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("wal");
    let options = WalOptions::default();
    let record = |i: usize| Bytes::from(vec![i as u8; MIB - 64]);
    {
        let wal = Wal::open(&log, options.clone()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        for i in 0..40 {
            rt.block_on(wal.append(vec![record(i)])).unwrap();
        }
        rt.block_on(wal.close()).unwrap();
    }
    let segment = log.join(wal::format::segment_file_name(0));
    let mut bytes = std::fs::read(&segment).unwrap();
    let original = bytes.clone();
    // Inside record 30's payload: its checksum fails, and valid frames follow.
    bytes[30 * MIB + MIB / 2] ^= 0xff;
    std::fs::write(&segment, &bytes).unwrap();
    drop(bytes);

    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let wal = Wal::open(&log, WalOptions { recovery: RecoveryMode::Salvage, ..options }).unwrap();
    let held = PEAK.load(Ordering::Relaxed).saturating_sub(before);
    let report = wal.open_report().salvage.clone().expect("a salvage");
    assert!(held < 8 * MIB, "the salvage held {} MiB for a 40 MiB segment", held / MIB);

    let kept = report.kept_until_offset;
    assert!((29..=30).contains(&kept), "{report:?}");
    let mut reader = wal.reader(0).unwrap();
    let read = reader.try_read(100, usize::MAX).unwrap();
    assert_eq!(read.len() as u64, kept);
    for r in &read {
        assert_eq!(r.payload, record(r.offset as usize), "record {}", r.offset);
    }
    let moved = std::fs::read(log.join(wal::DAMAGED_DIR).join(wal::format::segment_file_name(0))).unwrap();
    assert_eq!(moved.len(), original.len());
    let differing = moved.iter().zip(&original).filter(|(a, b)| a != b).count();
    assert_eq!(differing, 1, "the damaged copy is not the damaged file");
    // The kept prefix is the original's first bytes, byte for byte, then its seal; the
    // salvaged log reopens strictly with the same records.
    let prefix = std::fs::read(&segment).unwrap();
    let end = prefix.len() - wal::format::FRAME_HEADER_LEN as usize;
    assert_eq!(&prefix[..end], &original[..end], "the kept prefix is not the original's");
    drop(wal);
    let wal = Wal::open(&log, WalOptions::default()).unwrap();
    let again = wal.reader(0).unwrap().try_read(100, usize::MAX).unwrap();
    assert_eq!(again.iter().map(|r| r.offset).collect::<Vec<_>>(), read.iter().map(|r| r.offset).collect::<Vec<_>>());
}

/// A reader that read a large record holds a window that size until it is released;
/// released, it holds next to nothing and reads on from the same record, exactly.
#[test]
fn a_released_reader_holds_no_window_and_reads_on_from_its_position() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::open(dir.path().join("wal"), WalOptions::default()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let record = |i: usize, len: usize| Bytes::from(vec![i as u8; len]);
    rt.block_on(wal.append(vec![record(0, 8 * MIB), record(1, 100), record(2, 100)])).unwrap();
    // A second append's answer means the writer has dropped the first batch: the 8 MiB it
    // held is freed before the count below starts.
    rt.block_on(wal.append(vec![record(3, 100)])).unwrap();
    let mut reader = wal.reader(0).unwrap();
    let before = LIVE.load(Ordering::Relaxed);
    let first = reader.try_read(1, usize::MAX).unwrap();
    assert_eq!(first[0].payload, record(0, 8 * MIB));
    drop(first);
    // The count is process-wide: the writer thread may still be freeing its last batch's
    // bookkeeping (a few hundred bytes) while this reads, so the window is checked to
    // within the same slack the released reader is allowed.
    let held = LIVE.load(Ordering::Relaxed).saturating_sub(before);
    assert!(held >= 8 * MIB - SLACK_BYTES, "the window holds the record it read: {held} bytes");
    reader.release_buffer();
    let held = LIVE.load(Ordering::Relaxed).saturating_sub(before);
    assert!(held < SLACK_BYTES, "released, the reader still holds {held} bytes");
    assert_eq!(reader.position(), 1);
    let rest = reader.try_read(10, usize::MAX).unwrap();
    assert_eq!(
        rest.iter().map(|r| (r.offset, r.payload.clone())).collect::<Vec<_>>(),
        vec![(1, record(1, 100)), (2, record(2, 100)), (3, record(3, 100))]
    );
    rt.block_on(wal.close()).unwrap();
}
