//! Appending: offsets, batches, group commit, rotation, capacity, sync policies.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use wal::format::segment_file_name;
use wal::storage::{CrashMode, FaultOp, HookedStorage, SimStorage};
use wal::{SyncPolicy, WalError, WalOptions};

#[test]
fn offsets_are_dense_across_batches_and_segments() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(async {
        let mut next = 0;
        for i in 0..200u64 {
            let n = (i % 5 + 1) as usize;
            let batch = (0..n).map(|k| payload(i * 10 + k as u64, 100)).collect();
            let a = wal.append(batch).await.unwrap();
            assert_eq!(a.first_offset, next);
            assert_eq!(a.last_offset, next + n as u64 - 1);
            next += n as u64;
        }
        let all = read_all(&wal, 0);
        assert_eq!(all.len() as u64, next);
        for (i, r) in all.iter().enumerate() {
            assert_eq!(r.offset, i as u64);
        }
    });
    assert!(segment_files(&sim, &dir()).len() > 5, "rotation never happened");
}

#[test]
fn a_resolved_append_survives_power_loss_immediately_after() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    let a = rt().block_on(wal.append(vec![payload(1, 300), payload(2, 300)])).unwrap();
    sim.crash(CrashMode::LoseUnsynced);
    drop(wal);
    let wal = open(&sim, small_options());
    let all = read_all(&wal, 0);
    assert_eq!(all.len(), 2);
    assert_eq!(all[1].offset, a.last_offset);
    assert_eq!(tag_of(&all[1].payload), 2);
}

#[test]
fn concurrent_appenders_share_syncs() {
    let sim = SimStorage::new();
    let wal =
        Arc::new(open(&sim, WalOptions { segment_max_bytes: 1 << 20, max_bytes: 1 << 26, ..WalOptions::default() }));
    let ops_before = sim.ops();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let appends = 2000u64;
    runtime.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..appends {
            let wal = wal.clone();
            tasks.push(tokio::spawn(async move { wal.append(vec![payload(t, 64)]).await.unwrap() }));
        }
        let mut offsets: Vec<u64> = Vec::new();
        for t in tasks {
            offsets.push(t.await.unwrap().first_offset);
        }
        offsets.sort();
        assert_eq!(offsets, (0..appends).collect::<Vec<_>>());
    });
    // One write and one sync per group: far fewer operations than appends.
    let ops = sim.ops() - ops_before;
    assert!(ops < appends, "{ops} storage operations for {appends} appends: no group commit");
}

#[test]
fn full_log_refuses_with_full_and_evicts_nothing() {
    let sim = SimStorage::new();
    let opts = WalOptions { segment_max_bytes: 4096, max_bytes: 8192, ..WalOptions::default() };
    let wal = open(&sim, opts.clone());
    rt().block_on(async {
        let mut accepted = 0u64;
        let err = loop {
            match wal.append(vec![payload(accepted, 500)]).await {
                Ok(_) => accepted += 1,
                Err(e) => break e,
            }
        };
        assert!(matches!(err, WalError::Full { .. }), "{err}");
        assert!(wal.is_full(), "the log says it is full");
        assert!(wal.stats().used_bytes <= 8192);
        let all = read_all(&wal, 0);
        assert_eq!(all.len() as u64, accepted, "a record was evicted");
        // A smaller append that still fits is taken, and the log is no longer full for it.
        wal.append(vec![payload(998, 1)]).await.expect("a small one fits");
        assert!(!wal.is_full());
        let err = wal.append(vec![payload(997, 500)]).await.unwrap_err();
        assert!(matches!(err, WalError::Full { .. }) && wal.is_full(), "{err}");
        // Releasing frees whole segments and makes room again: no longer full, before any
        // append.
        let r = wal.release_below(accepted).await.unwrap();
        assert!(r.segments_deleted >= 1);
        assert!(!wal.is_full(), "space was freed");
        wal.append(vec![payload(999, 500)]).await.expect("room after release");
    });
}

#[test]
fn oversized_and_empty_batches_are_refused_before_the_queue() {
    let sim = SimStorage::new();
    let wal = open(&sim, WalOptions { record_max_bytes: 1000, ..small_options() });
    rt().block_on(async {
        assert!(matches!(wal.append(vec![]).await, Err(WalError::EmptyBatch)));
        let e = wal.append(vec![payload(1, 10), Bytes::from(vec![0u8; 1001])]).await.unwrap_err();
        assert!(matches!(e, WalError::RecordTooLarge { len: 1001, max: 1000 }));
        assert_eq!(wal.next_offset(), 0);
    });
}

#[test]
fn a_batch_larger_than_a_segment_gets_a_segment_of_its_own() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(async {
        wal.append(vec![payload(1, 100)]).await.unwrap();
        let big: Vec<Bytes> = (0..10).map(|i| payload(10 + i, 1000)).collect();
        let a = wal.append(big).await.unwrap();
        assert_eq!((a.first_offset, a.last_offset), (1, 10));
        wal.append(vec![payload(2, 100)]).await.unwrap();
        assert_eq!(read_all(&wal, 0).len(), 12);
    });
    assert_eq!(segment_files(&sim, &dir()).len(), 3);
}

#[test]
fn interval_policy_resolves_before_sync_but_readers_wait_for_the_sync() {
    let sim = SimStorage::new();
    let opts = WalOptions { sync: SyncPolicy::Interval(Duration::from_millis(50)), ..small_options() };
    let wal = open(&sim, opts);
    rt().block_on(async {
        let mut reader = wal.reader(0).unwrap();
        wal.append(vec![payload(1, 10)]).await.unwrap();
        // Resolved, but not yet synced: not visible.
        assert!(reader.try_read(10, 1 << 20).unwrap().is_empty());
        let got = tokio::time::timeout(Duration::from_secs(5), reader.read(10, 1 << 20)).await.unwrap().unwrap();
        assert_eq!(got.len(), 1);
    });
}

/// Under `interval` the sync comes on time however busy the log is. Here every write
/// takes longer than the interval and more appends are always queued (one append a
/// group): the writer must still sync between groups, or readers (the router) would see
/// nothing, and a power loss could take every answered append, for as long as the load
/// lasts.
#[test]
fn interval_policy_syncs_on_time_under_steady_load() {
    let sim = SimStorage::new();
    let storage = Arc::new(HookedStorage::new(Arc::new(sim), SlowWrites { write_delay: Duration::from_millis(2) }));
    let opts = WalOptions {
        sync: SyncPolicy::Interval(Duration::from_millis(1)),
        group_max_bytes: 1,
        segment_max_bytes: 1 << 20,
        max_bytes: 1 << 22,
        ..WalOptions::default()
    };
    let wal = Arc::new(wal::Wal::open_with(storage, &dir(), opts).unwrap());
    let appends = 40u64;
    // For each append: how many answered offsets were not yet durable when it resolved.
    let lags = rt().block_on(async {
        let mut tasks = tokio::task::JoinSet::new();
        for t in 0..appends {
            let wal = wal.clone();
            tasks.spawn(async move {
                let a = wal.append(vec![payload(t, 64)]).await.unwrap_or_else(|e| panic!("{e}"));
                (a.last_offset + 1).saturating_sub(wal.next_offset())
            });
        }
        tasks.join_all().await
    });
    assert_eq!(lags.len() as u64, appends);
    // One write (2 ms) is more than the interval (1 ms): at most two groups go unsynced.
    let worst = lags.iter().copied().max().unwrap_or(0);
    assert!(
        worst <= 3,
        "an append resolved with {worst} answered records not yet synced: the interval sync was held off"
    );
}

#[test]
fn interval_policy_can_lose_resolved_appends_on_power_loss() {
    // What the docs say `interval` costs: a power loss inside the window loses appends
    // that resolved.
    let sim = SimStorage::new();
    let opts = WalOptions { sync: SyncPolicy::Interval(Duration::from_secs(30)), ..small_options() };
    let wal = open(&sim, opts.clone());
    rt().block_on(wal.append(vec![payload(1, 10)])).unwrap();
    sim.crash(CrashMode::LoseUnsynced);
    drop(wal);
    let wal = open(&sim, opts);
    assert_eq!(wal.next_offset(), 0);
}

#[test]
fn close_syncs_and_marks_a_clean_shutdown() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(async {
        wal.append(vec![payload(1, 10)]).await.unwrap();
        wal.close().await.unwrap();
        assert!(matches!(wal.append(vec![payload(2, 10)]).await, Err(WalError::Closed)));
    });
    drop(wal);
    let wal = open(&sim, small_options());
    assert!(wal.open_report().clean_shutdown);
    assert_eq!(wal.next_offset(), 1);
    drop(wal);
    // The marker is consumed by the writable open: a crash now means a scan next time.
    sim.crash(CrashMode::LoseUnsynced);
    let wal = open(&sim, small_options());
    assert!(!wal.open_report().clean_shutdown);
}

#[test]
fn a_disk_with_room_for_a_group_but_not_its_zeros_takes_the_group() {
    let sim = SimStorage::new();
    let opts =
        WalOptions { preallocate_bytes: 1024, segment_max_bytes: 1 << 16, max_bytes: 1 << 20, ..WalOptions::default() };
    let wal = open(&sim, opts.clone());
    rt().block_on(async {
        // Up to the end of the zeros the first append wrote ahead.
        for t in 1..9 {
            wal.append(vec![payload(t, 100)]).await.unwrap_or_else(|e| panic!("{e}"));
        }
        // Room for the next group (332 bytes framed) but not for 1 KiB of zeros after it.
        sim.set_space_limit(Some(sim.used_bytes() + 500));
        wal.append(vec![payload(20, 300)]).await.unwrap_or_else(|e| panic!("refused though it fits: {e}"));
        // The zeros were written only as far as the disk had room (168 bytes), so the
        // next append, longer than that, grows the file again, and writes zeros after
        // itself again, as any write that grows the file does.
        sim.set_space_limit(None);
        wal.append(vec![payload(21, 300)]).await.unwrap_or_else(|e| panic!("{e}"));
        let file_len = sim.read_file(&dir().join(segment_file_name(0))).unwrap().len() as u64;
        assert_eq!(file_len, wal.stats().used_bytes + 1024, "no zeros after the append that grew the file");
        wal.close().await.unwrap_or_else(|e| panic!("{e}"));
    });
    drop(wal);
    let wal = open(&sim, opts);
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![1, 2, 3, 4, 5, 6, 7, 8, 20, 21]);
}

#[test]
fn storage_full_fails_the_append_and_the_log_continues_when_space_returns() {
    let sim = SimStorage::new();
    // Without zeros written ahead, so that the second append needs new space.
    let wal = open(&sim, WalOptions { preallocate_bytes: 0, ..small_options() });
    rt().block_on(async {
        wal.append(vec![payload(1, 100)]).await.unwrap();
        sim.set_space_limit(Some(sim.used_bytes() + 50));
        let e = wal.append(vec![payload(2, 100)]).await.unwrap_err();
        assert!(matches!(&e, WalError::Io { source, .. } if source.kind() == std::io::ErrorKind::StorageFull), "{e}");
        assert!(wal.is_disk_full() && !wal.is_full(), "the file system is full, not the log");
        sim.set_space_limit(None);
        assert!(wal.is_disk_full(), "only a write tells that space came back");
        let a = wal.append(vec![payload(3, 100)]).await.unwrap();
        assert!(!wal.is_disk_full());
        assert_eq!(a.first_offset, 1, "the failed append's offset was not given back");
        let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
        assert_eq!(tags, vec![1, 3]);
    });
}

#[test]
fn appends_into_the_zeros_written_ahead_need_no_new_space() {
    let sim = SimStorage::new();
    let opts = WalOptions { preallocate_bytes: 1024, ..small_options() };
    let wal = open(&sim, opts.clone());
    let path = wal.segment_paths()[0].clone();
    rt().block_on(async {
        wal.append(vec![payload(1, 100)]).await.unwrap();
        // The write that grew the file wrote 1 KiB of zeros after its record.
        let frame = 32 + 100;
        assert_eq!(sim.read_file(&path).unwrap().len(), 32 + frame + 1024);
        sim.set_space_limit(Some(sim.used_bytes()));
        wal.append(vec![payload(2, 100)]).await.expect("written over the zeros: no new space");
        sim.set_space_limit(None);
    });
    drop(wal);
    // A crash leaves the zeros behind the records: the open cuts them as a torn tail and
    // keeps every record.
    sim.crash(CrashMode::LoseUnsynced);
    let verified = wal::inspect::verify(&sim, &dir(), &mut |_| {}).unwrap();
    assert!(verified.is_clean() && verified.torn_tail.is_some() && verified.torn_tail_zeros_only, "{verified:?}");
    let wal = open(&sim, opts);
    assert_eq!(wal.open_report().truncated_bytes, 1024 - (32 + 100));
    assert!(wal.open_report().torn_tail_zeros_only, "nothing was interrupted");
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![1, 2]);
    assert_eq!(sim.read_file(&path).unwrap().len(), 32 + 2 * (32 + 100));
}

#[test]
fn a_failed_sync_fails_its_appends_and_is_never_taken_as_covered() {
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    rt().block_on(async {
        wal.append(vec![payload(1, 100)]).await.unwrap();
        sim.fail_nth(FaultOp::Sync, 1, std::io::ErrorKind::Other);
        assert!(wal.append(vec![payload(2, 100)]).await.is_err());
        wal.append(vec![payload(3, 100)]).await.unwrap();
    });
    sim.crash(CrashMode::LoseUnsynced);
    drop(wal);
    let wal = open(&sim, small_options());
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![1, 3]);
}

/// `append_observed` calls its observer once a batch is durable: before the answer when
/// the caller waits for it, and on a task of its own when the caller's future was
/// dropped while the batch waited for its sync (the batch is written all the same, so
/// what the observer counts is what the log holds); never for a batch that failed.
#[test]
fn an_observed_append_is_seen_once_durable_also_when_its_caller_stopped_waiting() {
    use std::sync::Mutex;
    use wal::storage::HoldSyncs;
    let sim = SimStorage::new();
    let storage = HookedStorage::new(Arc::new(sim.clone()), HoldSyncs::default());
    let wal = wal::Wal::open_with(Arc::new(storage.clone()), &dir(), small_options()).unwrap();
    let seen: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let observer = || {
        let seen = seen.clone();
        move |a: &wal::Appended| seen.lock().unwrap().push((a.first_offset, a.last_offset))
    };
    let seen_now = || seen.lock().unwrap().clone();
    rt().block_on(async {
        let a = wal.append_observed(vec![payload(1, 100)], observer()).await.unwrap();
        assert_eq!((a.first_offset, a.last_offset), (0, 0));
        assert_eq!(seen_now(), [(0, 0)], "seen before the answer");

        // Dropped while its sync is held: seen once the sync is let go.
        let held = storage.hold_syncs();
        let batch = vec![payload(2, 100), payload(3, 100)];
        let dropped = tokio::time::timeout(Duration::from_millis(200), wal.append_observed(batch, observer())).await;
        assert!(dropped.is_err(), "the append resolved with its sync held");
        assert_eq!(seen_now(), [(0, 0)], "seen before it was durable");
        drop(held);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while seen_now().len() < 2 {
            assert!(std::time::Instant::now() < deadline, "the dropped append was never seen: {:?}", seen_now());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(seen_now(), [(0, 0), (1, 2)]);

        // Failed, awaited or dropped: never seen.
        sim.fail_nth(FaultOp::Sync, 1, std::io::ErrorKind::Other);
        assert!(wal.append_observed(vec![payload(4, 100)], observer()).await.is_err());
        let held = storage.hold_syncs();
        sim.fail_nth(FaultOp::Sync, 1, std::io::ErrorKind::Other);
        let dropped =
            tokio::time::timeout(Duration::from_millis(200), wal.append_observed(vec![payload(5, 100)], observer()))
                .await;
        assert!(dropped.is_err(), "the append resolved with its sync held");
        drop(held);
        let after = wal.append_observed(vec![payload(6, 100)], observer()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(seen_now(), [(0, 0), (1, 2), (after.first_offset, after.first_offset)]);
        assert_eq!(after.first_offset, 3, "a failed append took an offset");
    });
}

/// The log says how long its writer has been in its current piece of work while it is
/// in it, and nothing once it waits again: a write the disk takes long to finish shows,
/// and grows, before it returns (a stuck sync records no latency, no error, nothing
/// else). Timed from the moment the write began, as the hook says it.
#[test]
fn the_writer_says_how_long_it_has_been_in_a_write_while_it_is_in_it() {
    /// Every write after `armed` says it began, then takes `delay`.
    #[derive(Debug)]
    struct SaysWhenAWriteBegins {
        armed: std::sync::atomic::AtomicBool,
        began: std::sync::Mutex<std::sync::mpsc::Sender<()>>,
        delay: Duration,
    }
    impl wal::storage::Hooks for SaysWhenAWriteBegins {
        fn write_all_at(&self, file: &dyn wal::storage::StorageFile, buf: &[u8], pos: u64) -> std::io::Result<()> {
            if self.armed.load(std::sync::atomic::Ordering::Acquire) {
                let _ = self.began.lock().unwrap().send(());
                std::thread::sleep(self.delay);
            }
            file.write_all_at(buf, pos)
        }
    }
    let (began, begun) = std::sync::mpsc::channel();
    let hooks = SaysWhenAWriteBegins {
        armed: false.into(),
        began: std::sync::Mutex::new(began),
        delay: Duration::from_millis(1500),
    };
    let storage = Arc::new(HookedStorage::new(Arc::new(SimStorage::new()), hooks));
    let wal = Arc::new(wal::Wal::open_with(storage.clone(), &dir(), common::small_options()).unwrap());
    let idle_by = |what: &str| {
        let by = std::time::Instant::now() + Duration::from_secs(10);
        while wal.writer_busy_for().is_some() {
            assert!(std::time::Instant::now() < by, "busy {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    idle_by("with no append to write");
    storage.hooks().armed.store(true, std::sync::atomic::Ordering::Release);
    let appending = {
        let wal = wal.clone();
        std::thread::spawn(move || rt().block_on(wal.append(vec![payload(1, 64)])))
    };
    begun.recv_timeout(Duration::from_secs(10)).expect("the write began");
    let early = wal.writer_busy_for().expect("not busy inside a write");
    std::thread::sleep(Duration::from_millis(300));
    let later = wal.writer_busy_for().expect("not busy inside a write");
    assert!(later >= early + Duration::from_millis(300), "{early:?} then {later:?}");
    appending.join().unwrap().unwrap();
    // The answer goes out just before the writer is done with its group.
    idle_by("after the append was answered");
}
