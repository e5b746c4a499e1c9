//! Limits at their real values: offsets and segment names near the top of the range,
//! records at the maximum size, rotation at the default segment size.

mod common;

use bytes::Bytes;
use common::*;
use wal::format::{OFFSET_MAX, RECORD_MAX_BYTES, segment_file_name};
use wal::options::{PREALLOCATE_BYTES_MAX, QUEUE_MAX_APPENDS_MAX};
use wal::storage::{CrashMode, SimStorage};
use wal::{WalError, WalOptions};

#[test]
fn offsets_run_to_the_last_representable_one_and_then_refuse() {
    let sim = SimStorage::new();
    let opts = WalOptions { initial_offset: OFFSET_MAX - 9, ..small_options() };
    let wal = open(&sim, opts.clone());
    rt().block_on(async {
        // Rotate a few times on the way, so segment names near the top are used.
        for i in 0..9 {
            let a = wal.append(vec![payload(i, 1500)]).await.unwrap();
            assert_eq!(a.first_offset, OFFSET_MAX - 9 + i);
        }
        let a = wal.append(vec![payload(9, 10)]).await.unwrap();
        assert_eq!(a.last_offset, OFFSET_MAX);
        let e = wal.append(vec![payload(10, 10)]).await.unwrap_err();
        assert!(matches!(e, WalError::OffsetsExhausted { next, needed: 1 } if next == OFFSET_MAX + 1), "{e}");
    });
    let names = segment_files(&sim, &dir());
    assert!(names.len() >= 3, "{names:?}");
    assert!(names.contains(&segment_file_name(OFFSET_MAX - 9)));
    sim.crash(CrashMode::LoseUnsynced);
    drop(wal);
    let wal = open(&sim, opts);
    assert_eq!(wal.next_offset(), u64::MAX);
    let all = read_all(&wal, OFFSET_MAX - 9);
    assert_eq!(all.len(), 10);
    assert_eq!(all.last().map(|r| r.offset), Some(OFFSET_MAX));
}

#[test]
fn a_batch_that_would_pass_the_last_offset_is_refused_whole() {
    let sim = SimStorage::new();
    let wal = open(&sim, WalOptions { initial_offset: OFFSET_MAX - 1, ..small_options() });
    rt().block_on(async {
        let e = wal.append(vec![payload(0, 8), payload(1, 8), payload(2, 8)]).await.unwrap_err();
        assert!(matches!(e, WalError::OffsetsExhausted { needed: 3, .. }), "{e}");
        assert_eq!(wal.append(vec![payload(0, 8), payload(1, 8)]).await.unwrap().last_offset, OFFSET_MAX);
    });
}

#[test]
fn a_record_of_the_maximum_size_round_trips_and_one_byte_more_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let wal = wal::Wal::open(tmp.path(), WalOptions::default()).unwrap();
    let max = RECORD_MAX_BYTES as usize;
    let mut big = vec![0u8; max];
    for (i, b) in big.iter_mut().enumerate().step_by(4096) {
        *b = (i / 4096) as u8;
    }
    let big = Bytes::from(big);
    rt().block_on(async {
        let e = wal.append(vec![Bytes::from(vec![0u8; max + 1])]).await.unwrap_err();
        assert!(matches!(e, WalError::RecordTooLarge { .. }), "{e}");
        wal.append(vec![payload(1, 10)]).await.unwrap();
        wal.append(vec![big.clone()]).await.unwrap();
        wal.append(vec![payload(2, 10)]).await.unwrap();
    });
    drop(wal);
    let wal = wal::Wal::open(tmp.path(), WalOptions::default()).unwrap();
    let mut r = wal.reader(1).unwrap();
    let got = r.try_read(10, 1).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].payload, big);
    assert_eq!(read_all(&wal, 0).len(), 3);
}

#[test]
fn rotation_and_recovery_at_the_default_segment_size() {
    let sim = SimStorage::new();
    let opts = WalOptions::default();
    let wal = open(&sim, opts.clone());
    let record = 1024 * 1024 - 32;
    rt().block_on(async {
        // 64 one-MiB frames fill a 64 MiB segment exactly; go past it.
        for i in 0..70 {
            wal.append(vec![payload(i, record)]).await.unwrap();
        }
    });
    let names = segment_files(&sim, &dir());
    assert_eq!(names.len(), 2, "{names:?}");
    let first = sim.read_file(&dir().join(&names[0])).unwrap();
    assert!(first.len() as u64 <= opts.segment_max_bytes);
    sim.crash(CrashMode::Adversarial { seed: 1 });
    drop(wal);
    let wal = open(&sim, opts);
    let all = read_all(&wal, 0);
    assert_eq!(all.len(), 70);
    assert!(all.iter().enumerate().all(|(i, r)| tag_of(&r.payload) == i as u64));
}

/// A batch larger than what even an empty log has room for is refused at once, as too
/// large for good: `Full` would tell its sender to retry later, forever. One byte less
/// fits an empty log exactly.
#[test]
fn a_batch_no_release_could_make_room_for_is_refused_as_too_large_not_full() {
    let sim = SimStorage::new();
    let opts = WalOptions { segment_max_bytes: 4096, max_bytes: 8192, ..WalOptions::default() };
    assert_eq!(opts.batch_max_bytes(), 8192 - 3 * 32, "a segment header, a seal, the next segment's header");
    let wal = open(&sim, opts.clone());
    // One record: 32 bytes of frame header plus its payload.
    let payload_len = (opts.batch_max_bytes() - 32) as usize;
    rt().block_on(async {
        let e = wal.append(vec![payload(1, payload_len + 1)]).await.unwrap_err();
        assert!(
            matches!(e, WalError::BatchTooLarge { batch_bytes: 8097, max_batch_bytes: 8096 }),
            "a batch that can never fit got {e}"
        );
        let split = vec![payload(2, payload_len / 2), payload(3, payload_len / 2)];
        let e = wal.append(split).await.unwrap_err();
        assert!(matches!(e, WalError::BatchTooLarge { .. }), "the frame headers count: {e}");
        assert_eq!(wal.next_offset(), 0, "nothing was written");
        let a = wal.append(vec![payload(4, payload_len)]).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.first_offset, 0, "the largest batch fits an empty log");
        // The log is full now; the same batch again is a matter of releasing.
        let e = wal.append(vec![payload(5, payload_len)]).await.unwrap_err();
        assert!(matches!(e, WalError::Full { .. }), "{e}");
    });
}

/// Options whose arithmetic would overflow, or whose zeros written ahead would make the
/// writer's buffer grow without bound, are refused at open.
#[test]
fn options_that_overflow_or_overgrow_are_refused() {
    let refused = |opts: WalOptions| match try_open(&SimStorage::new(), opts) {
        Err(WalError::InvalidOptions(m)) => m,
        other => panic!("accepted: {:?}", other.map(|_| ())),
    };
    let huge_segments = WalOptions { segment_max_bytes: u64::MAX / 2 + 1, max_bytes: u64::MAX, ..small_options() };
    assert!(refused(huge_segments).contains("twice segment_max_bytes"));
    let zeros = WalOptions { preallocate_bytes: PREALLOCATE_BYTES_MAX + 1, ..small_options() };
    assert!(refused(zeros).contains("preallocate_bytes"));
    let opts = WalOptions { preallocate_bytes: PREALLOCATE_BYTES_MAX, ..small_options() };
    try_open(&SimStorage::new(), opts).unwrap_or_else(|e| panic!("the largest preallocation was refused: {e}"));
    // Past what the append slots' semaphore can count, it would panic at open.
    let queue = WalOptions { queue_max_appends: usize::MAX, ..small_options() };
    assert!(refused(queue).contains("queue_max_appends"));
    let opts = WalOptions { queue_max_appends: QUEUE_MAX_APPENDS_MAX, ..small_options() };
    try_open(&SimStorage::new(), opts).unwrap_or_else(|e| panic!("the largest queue was refused: {e}"));
}

/// A segment whose records were all released while it was the active one is freed once
/// a rotation seals it, without waiting for another release: the releaser only asks
/// again when delivery moves on, and until then `Full` would be answered with nothing
/// undelivered in the log.
#[test]
fn a_segment_sealed_after_its_release_is_freed_without_another_release() {
    let sim = SimStorage::new();
    let opts = WalOptions { segment_max_bytes: 4096, max_bytes: 8192, ..small_options() };
    let wal = open(&sim, opts);
    rt().block_on(async {
        let a = wal.append(vec![payload(0, 3000)]).await.unwrap();
        let released = wal.release_below(a.last_offset + 1).await.unwrap();
        assert_eq!(released.segments_deleted, 0, "the active segment is never deleted");
        // Does not fit beside the first record: the first segment is sealed, and with it
        // the log would be full, though everything in it was released.
        let b = wal.append(vec![payload(1, 5068)]).await;
        assert!(b.is_ok(), "the second append was refused: {b:?}");
    });
    assert_eq!(segment_files(&sim, &dir()), vec![segment_file_name(1)]);
}

/// Refuses the first removal of a segment file, as a file system can once (an I/O
/// error, a permission changed and changed back).
#[derive(Debug, Default)]
struct FirstSegmentRemovalFails {
    failed: std::sync::atomic::AtomicBool,
}

impl wal::storage::Hooks for FirstSegmentRemovalFails {
    fn remove_file(&self, inner: &dyn wal::storage::Storage, path: &std::path::Path) -> std::io::Result<()> {
        let segment = path.extension().is_some_and(|e| e == "seg");
        if segment && !self.failed.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return Err(std::io::Error::other("removal refused once"));
        }
        inner.remove_file(path)
    }
}

/// A released segment whose deletion failed after a rotation is deleted again by the
/// writer, with no release asked: the releaser asks only when delivery moves on, and
/// with the log full of released records nothing can be appended to move it on.
#[test]
fn a_released_segment_whose_deletion_failed_is_deleted_again_without_a_release() {
    let sim = SimStorage::new();
    let hooked =
        wal::storage::HookedStorage::new(std::sync::Arc::new(sim.clone()), FirstSegmentRemovalFails::default());
    let opts = WalOptions { segment_max_bytes: 4096, max_bytes: 8192, ..small_options() };
    let wal =
        wal::Wal::open_with(std::sync::Arc::new(hooked) as std::sync::Arc<dyn wal::storage::Storage>, &dir(), opts)
            .expect("open");
    rt().block_on(async {
        let a = wal.append(vec![payload(0, 3000)]).await.unwrap();
        let released = wal.release_below(a.last_offset + 1).await.unwrap();
        assert_eq!(released.segments_deleted, 0, "the active segment is never deleted");
        // The rotation seals the first segment and its deletion fails: no room.
        match wal.append(vec![payload(1, 5068)]).await {
            Err(WalError::Full { .. }) => {}
            other => panic!("expected the log to be full while the released segment stays: {other:?}"),
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match wal.append(vec![payload(1, 5068)]).await {
                Ok(_) => break,
                Err(WalError::Full { .. }) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                other => panic!("the released segment was never deleted: {other:?}"),
            }
        }
    });
    assert_eq!(segment_files(&sim, &dir()), vec![segment_file_name(1)]);
}
