//! Read-only opening beside a live writer: the durable watermark keeps written but
//! unsynced bytes out of every read-only view, and is ignored once the writer is gone.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use wal::storage::{FsStorage, SimStorage, Storage};
use wal::{SyncPolicy, Wal, WalOptions, inspect};

fn read_only(sim: &SimStorage) -> Wal {
    Wal::open_read_only_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &dir()).expect("read-only open")
}

fn tags(wal: &Wal) -> Vec<u64> {
    read_all(wal, wal.start_offset()).iter().map(|r| tag_of(&r.payload)).collect()
}

/// Under `Interval`, an append resolves once written; the sync comes much later.
fn lazy(segment_max_bytes: u64) -> WalOptions {
    WalOptions { segment_max_bytes, sync: SyncPolicy::Interval(Duration::from_secs(60)), ..small_options() }
}

#[test]
fn a_read_only_open_beside_a_live_writer_never_sees_its_unsynced_group() {
    let sim = SimStorage::new();
    {
        let wal = open(&sim, small_options());
        rt().block_on(wal.append(vec![payload(1, 100), payload(2, 100)])).unwrap();
    }
    let wal = open(&sim, lazy(1 << 16));
    rt().block_on(wal.append(vec![payload(3, 100)])).unwrap();
    let seg = dir().join(&segment_files(&sim, &dir())[0]);
    assert!(sim.read_file(&seg).unwrap().len() > 32 + 2 * 132, "the group was written");

    let ro = read_only(&sim);
    assert_eq!(tags(&ro), vec![1, 2], "a written but unsynced record was visible");
    assert_eq!(ro.next_offset(), 2);
    let segs = inspect::list_segments(Arc::new(sim.clone()), &dir()).unwrap();
    assert_eq!(segs.iter().map(|s| s.records).sum::<u64>(), 2);
    let report = inspect::verify(&sim, &dir(), &mut |_| {}).unwrap();
    assert!(report.is_clean() && report.torn_tail.is_none(), "{report:?}");
    assert_eq!(report.records, 2);

    // A power loss now would lose exactly what the read-only view left out.
    rt().block_on(wal.close()).unwrap();
    drop(wal);
    assert_eq!(tags(&read_only(&sim)), vec![1, 2, 3], "after the sync and close everything is visible");
}

#[test]
fn an_unsynced_write_into_a_new_segment_is_left_out() {
    let sim = SimStorage::new();
    let wal = open(&sim, lazy(4096));
    // Each batch is ~1.2 KiB: the fourth rotates, which syncs and seals the first
    // segment and creates the next (durably: its header synced, its directory entry
    // too), then writes itself, unsynced, into the new one.
    rt().block_on(async {
        for t in 0..4 {
            wal.append(vec![payload(t, 1200)]).await.unwrap();
        }
    });
    assert_eq!(segment_files(&sim, &dir()).len(), 2);
    let ro = read_only(&sim);
    assert_eq!(tags(&ro), vec![0, 1, 2], "the unsynced record is not part of the view");
    assert_eq!(ro.segment_paths().len(), 2, "the new segment is durable and named by the watermark");
    let report = inspect::verify(&sim, &dir(), &mut |_| {}).unwrap();
    assert_eq!((report.segments, report.records), (2, 3), "{report:?}");
    drop(ro);
    drop(wal);
}

#[test]
fn without_a_live_writer_the_watermark_is_ignored() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(wal.append(vec![payload(7, 100), payload(8, 100)])).unwrap();
    drop(wal);
    // A watermark that lags (a process that died before publishing its last sync):
    // with no writer holding the lock, nothing bounds the view.
    let seg = &segment_files(&sim, &dir())[0];
    let base: u64 = seg.trim_end_matches(".seg").parse().unwrap();
    let stale = wal::format::DurableWatermark { segment_base: base, durable_len: 32, next_offset: base };
    sim.write_file_durably(&dir().join(wal::WATERMARK_FILE), &stale.encode()).unwrap();
    assert_eq!(tags(&read_only(&sim)), vec![7, 8]);
    let report = inspect::verify(&sim, &dir(), &mut |_| {}).unwrap();
    assert_eq!(report.records, 2);
    // And a writer that opens replaces it before anyone could bound by it.
    let wal = open(&sim, lazy(1 << 16));
    assert_eq!(tags(&read_only(&sim)), vec![7, 8]);
    drop(wal);
}

#[test]
fn the_real_file_system_reports_a_live_writer_without_taking_its_lock() {
    let tmp = tempfile::tempdir().unwrap();
    let lock = tmp.path().join(wal::LOCK_FILE);
    assert!(!FsStorage.is_locked(&lock).unwrap(), "no file, no lock");
    let wal = Wal::open(tmp.path(), small_options()).unwrap();
    assert!(FsStorage.is_locked(&lock).unwrap());
    assert!(FsStorage.is_locked(&lock).unwrap(), "testing did not take it");
    rt().block_on(wal.append(vec![payload(1, 10)])).unwrap();
    let ro = Wal::open_read_only(tmp.path()).unwrap();
    assert_eq!(tags(&ro), vec![1]);
    assert!(tmp.path().join(wal::WATERMARK_FILE).exists());
    rt().block_on(wal.close()).unwrap();
    drop(wal);
    assert!(!FsStorage.is_locked(&lock).unwrap(), "released with the writer");
    // A second writer can still take it: reading never held it.
    drop(Wal::open(tmp.path(), small_options()).unwrap());
}

/// A rotation names the new segment in the watermark at once: a rotating append refused
/// as Full (no sync after the rotation), then a release of the sealed segment, must not
/// leave the watermark naming a deleted file (read-only tools beside the writer would
/// fail until the next sync).
#[test]
fn a_release_right_after_a_rotation_leaves_read_only_opens_working() {
    let sim = SimStorage::new();
    let opts = WalOptions { segment_max_bytes: 4096, max_bytes: 8192, ..WalOptions::default() };
    let wal = open(&sim, opts);
    rt().block_on(async {
        for t in 0..3 {
            wal.append(vec![payload(t, 1000)]).await.unwrap_or_else(|e| panic!("{e}"));
        }
        let e = wal.append(vec![payload(9, 5000)]).await.unwrap_err();
        assert!(matches!(e, wal::WalError::Full { .. }), "{e}");
        let r = wal.release_below(wal.next_offset()).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.segments_deleted, 1);
    });
    let ro = read_only(&sim);
    assert_eq!(ro.next_offset(), 3);
    drop(wal);
}

/// Hooks for the simulated disk under which a writer starts (it takes the log's
/// lock and removes the previous writer's watermark, as a starting daemon does) the first
/// time a reader opens a segment file, or, `at_marker`, the clean-shutdown marker (and
/// then the writer's recovery takes the marker away before the reader can open it).
struct WriterStartsDuringRead {
    taken: std::sync::Mutex<Option<Box<dyn Send + Sync>>>,
    at_marker: bool,
}

impl std::fmt::Debug for WriterStartsDuringRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriterStartsDuringRead").finish_non_exhaustive()
    }
}

impl wal::storage::Hooks for WriterStartsDuringRead {
    fn open(
        &self,
        inner: &dyn Storage,
        path: &std::path::Path,
        mode: wal::storage::OpenMode,
    ) -> std::io::Result<Arc<dyn wal::storage::StorageFile>> {
        let mut taken = self.taken.lock().unwrap();
        let trigger = match self.at_marker {
            false => path.extension().is_some_and(|e| e == "seg"),
            true => path.file_name().is_some_and(|n| n == wal::CLEAN_MARKER_FILE),
        };
        if taken.is_none() && trigger {
            *taken = Some(inner.try_lock(&dir().join(wal::LOCK_FILE))?);
            match inner.remove_file(&dir().join(wal::WATERMARK_FILE)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            if self.at_marker {
                inner.remove_file(path)?;
            }
        }
        drop(taken);
        inner.open(path, mode)
    }
}

/// A writer that starts while a read-only tool reads a log nobody held may recover, cut
/// or append unsynced bytes under the read: the read does not stand. The tools read
/// again within the watermark, or (none published yet) report the log unsettled; never
/// an unbounded view of a log a writer holds.
#[test]
fn a_writer_that_starts_during_a_read_only_read_makes_it_read_again_or_report_unsettled() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    append_tagged(&wal, 0..3, 100);
    rt().block_on(wal.close()).unwrap();
    drop(wal);
    let marker_path = dir().join(wal::CLEAN_MARKER_FILE);
    let marker = sim.read_file(&marker_path).expect("a clean close leaves the marker");
    for at_marker in [false, true] {
        let racing = || {
            // Each reader finds the log as the clean close left it.
            sim.write_file_durably(&marker_path, &marker).unwrap();
            Arc::new(wal::storage::HookedStorage::new(
                Arc::new(sim.clone()),
                WriterStartsDuringRead { taken: std::sync::Mutex::new(None), at_marker },
            ))
        };
        reads_again_or_report_unsettled(racing, &std::path::PathBuf::from(format!("/sim/copy-{at_marker}")));
    }
}

/// A read-only open, a verify and a salvage copy, each on a fresh `racing()` storage,
/// report the log unsettled (the double's writer never publishes a watermark): not an
/// error of the log, as a file the starting writer removed under the read would be.
fn reads_again_or_report_unsettled(
    racing: impl Fn() -> Arc<wal::storage::HookedStorage<WriterStartsDuringRead>>,
    copy: &std::path::Path,
) {
    // Each double's writer lets go of the lock when the double is dropped, at the end of
    // its block: the next reader starts on a log nobody holds.
    {
        let storage = racing();
        let opened = Wal::open_read_only_with(storage.clone() as Arc<dyn Storage>, &dir());
        assert!(storage.hooks().taken.lock().unwrap().is_some(), "the double did not take the lock");
        assert!(matches!(opened, Err(wal::WalError::Unsettled { .. })), "read-only open: {opened:?}");
    }
    {
        let storage = racing();
        let verified = inspect::verify(&*storage, &dir(), &mut |_| {});
        assert!(storage.hooks().taken.lock().unwrap().is_some(), "the double did not take the lock");
        assert!(matches!(verified, Err(wal::WalError::Unsettled { .. })), "verify: {verified:?}");
    }
    {
        let storage = racing();
        let copied = wal::salvage_copy::salvage_copy(&*storage, &dir(), copy);
        assert!(storage.hooks().taken.lock().unwrap().is_some(), "the double did not take the lock");
        assert!(matches!(copied, Err(wal::WalError::Unsettled { .. })), "salvage_copy: {copied:?}");
    }
}

/// A watermark whose offsets its segment's bytes do not end at (stale, crafted, or a
/// read that raced the writer) bounds no read: `verify` reports the read unsettled, as
/// the open does, rather than a verdict on bytes the watermark does not describe.
#[test]
fn verify_beside_a_writer_refuses_a_watermark_its_segment_disagrees_with() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(wal.append(vec![payload(1, 100), payload(2, 100)])).unwrap();
    let path = dir().join(wal::WATERMARK_FILE);
    let mut w = wal::format::DurableWatermark::decode(&sim.read_file(&path).unwrap()).expect("the writer's watermark");
    assert_eq!(w.next_offset, 2);
    assert_eq!(inspect::verify(&sim, &dir(), &mut |_| {}).unwrap().records, 2);
    w.next_offset = 5;
    sim.write_file_durably(&path, &w.encode()).unwrap();
    match inspect::verify(&sim, &dir(), &mut |_| {}) {
        Err(e @ wal::WalError::Unsettled { .. }) => assert!(e.to_string().contains("disagree"), "{e}"),
        other => panic!("{other:?}"),
    }
    drop(wal);
}

/// Refuses to remove the watermark file, as a file system can (a permission changed).
#[derive(Debug)]
struct WatermarkNotRemovable;

impl wal::storage::Hooks for WatermarkNotRemovable {
    fn remove_file(&self, inner: &dyn Storage, path: &std::path::Path) -> std::io::Result<()> {
        if path.ends_with(wal::WATERMARK_FILE) {
            return Err(std::io::ErrorKind::PermissionDenied.into());
        }
        inner.remove_file(path)
    }
}

/// A watermark an earlier process left that a writable open cannot remove never bounds
/// a read-only open beside the new writer by the earlier process's state: the writer
/// voids it and takes the file over, so what it syncs is what readers see.
#[test]
fn a_watermark_left_behind_that_cannot_be_removed_is_taken_over() {
    let sim = SimStorage::new();
    {
        let wal = open(&sim, small_options());
        rt().block_on(wal.append(vec![payload(7, 100)])).unwrap();
    }
    let seg = &segment_files(&sim, &dir())[0];
    let base: u64 = seg.trim_end_matches(".seg").parse().unwrap();
    let stale = wal::format::DurableWatermark { segment_base: base, durable_len: 32, next_offset: base };
    sim.write_file_durably(&dir().join(wal::WATERMARK_FILE), &stale.encode()).unwrap();

    let hooked = wal::storage::HookedStorage::new(Arc::new(sim.clone()), WatermarkNotRemovable);
    let wal = Wal::open_with(Arc::new(hooked) as Arc<dyn Storage>, &dir(), small_options()).expect("open");
    assert!(sim.read_file(&dir().join(wal::WATERMARK_FILE)).is_ok(), "the file was removed after all");
    rt().block_on(wal.append(vec![payload(8, 100)])).unwrap();
    assert_eq!(tags(&read_only(&sim)), vec![7, 8], "a reader was bounded by the earlier process's watermark");
    drop(wal);
}
