//! What the log counts, read through a Prometheus recorder installed for this binary
//! alone (the writer runs on a thread of its own, so a recorder local to the test's
//! thread would not see it): one test, so that nothing else counts meanwhile.

mod common;

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use common::*;
use metrics_exporter_prometheus::PrometheusBuilder;
use wal::WalOptions;
use wal::storage::{FaultOp, SimStorage};

/// The value of a label-less series in the exporter's rendering (0 when absent).
fn value(rendered: &str, name: &str) -> f64 {
    rendered
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// While the log waits for a segment it cannot create, only the failure that started
/// the wait is a storage error: the tries after it (every second, and for every
/// append) are not, or the storage-error alert's count would grow by one a second. The
/// gauge says the log waits, and says it no longer does once the segment exists.
#[test]
fn waiting_for_a_segment_counts_one_storage_error_and_is_a_gauge_and_a_failed_release_counts_one() {
    let handle = PrometheusBuilder::new().install_recorder().unwrap();
    let sim = SimStorage::new();
    let wal = open(&sim, WalOptions { preallocate_bytes: 0, ..small_options() });
    append_tagged(&wal, 0..3, 1000);
    for _ in 0..100 {
        sim.fail_nth(FaultOp::Metadata, 1, ErrorKind::PermissionDenied);
    }
    rt().block_on(async {
        for tag in 3..6 {
            assert!(wal.append(vec![payload(tag, 1000)]).await.is_err());
        }
    });
    let armed = sim.armed_faults();
    let deadline = Instant::now() + Duration::from_secs(10);
    while sim.armed_faults() == armed && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(sim.armed_faults() < armed, "the writer did not try again by itself");
    let r = handle.render();
    assert_eq!(value(&r, "iggy_ingest_wal_storage_errors_total"), 1.0, "{r}");
    assert_eq!(value(&r, "iggy_ingest_wal_awaiting_segment"), 1.0, "{r}");
    sim.disarm();
    let deadline = Instant::now() + Duration::from_secs(10);
    while wal.awaits_segment() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = handle.render();
    assert_eq!(value(&r, "iggy_ingest_wal_awaiting_segment"), 0.0, "{r}");
    assert_eq!(value(&r, "iggy_ingest_wal_storage_errors_total"), 1.0, "{r}");

    // A released segment whose removal fails is a storage error too: space the log
    // cannot free fills it. Once for a run of failures (each release, and the writer's
    // retry every second, tries again), as for a segment; the release that succeeds
    // then counts nothing.
    append_tagged(&wal, 6..12, 1000);
    let (segments, below) = (wal.stats().segments, wal.next_offset());
    assert!(segments > 1, "{:?}", wal.stats());
    for _ in 0..3 {
        sim.fail_nth(FaultOp::Metadata, 1, ErrorKind::PermissionDenied);
        assert!(rt().block_on(wal.release_below(below)).is_err());
    }
    assert_eq!(value(&handle.render(), "iggy_ingest_wal_storage_errors_total"), 2.0);
    let released = rt().block_on(wal.release_below(below)).unwrap();
    assert!(released.segments_deleted > 0);
    assert_eq!(value(&handle.render(), "iggy_ingest_wal_storage_errors_total"), 2.0);
    assert_eq!(value(&handle.render(), "iggy_ingest_wal_used_bytes"), wal.stats().used_bytes as f64);

    // A log that stops (a write failed, and both ways of undoing it did too) says so for
    // as long as it is stopped, not only by the one storage error that stopped it; its
    // used bytes are those after the undo. A reopen takes appends again, and says so.
    assert_eq!(value(&handle.render(), "iggy_ingest_wal_stopped"), 0.0);
    sim.fail_nth(FaultOp::Write, 1, ErrorKind::Other);
    sim.fail_nth(FaultOp::Metadata, 1, ErrorKind::Other);
    sim.fail_nth(FaultOp::Write, 2, ErrorKind::Other);
    assert!(rt().block_on(wal.append(vec![payload(99, 1000)])).is_err());
    assert!(!wal.accepts_appends());
    let r = handle.render();
    assert_eq!(value(&r, "iggy_ingest_wal_stopped"), 1.0, "{r}");
    assert_eq!(value(&r, "iggy_ingest_wal_used_bytes"), wal.stats().used_bytes as f64, "{r}");
    assert!(rt().block_on(wal.append(vec![payload(100, 1000)])).is_err());
    assert_eq!(value(&handle.render(), "iggy_ingest_wal_stopped"), 1.0, "still stopped");
    drop(wal);
    let wal = open(&sim, WalOptions { preallocate_bytes: 0, ..small_options() });
    assert!(wal.accepts_appends());
    assert_eq!(value(&handle.render(), "iggy_ingest_wal_stopped"), 0.0);

    // A log full (by its bound) says so; reopened with room it does not (its flags
    // start clear, and so must their gauges). Likewise a log on a full disk.
    let small = WalOptions { preallocate_bytes: 0, max_bytes: 16 * 1024, ..small_options() };
    drop(wal);
    let wal = open(&sim, small.clone());
    rt().block_on(async {
        let mut tag = 200;
        while !wal.is_full() {
            let _ = wal.append(vec![payload(tag, 1000)]).await;
            tag += 1;
            assert!(tag < 300, "the log never filled: {:?}", wal.stats());
        }
    });
    assert_eq!(value(&handle.render(), "iggy_ingest_wal_full"), 1.0);
    drop(wal);
    let roomy = WalOptions { max_bytes: 1 << 20, ..small };
    let wal = open(&sim, roomy.clone());
    assert!(wal.accepts_appends() && !wal.is_full());
    assert_eq!(value(&handle.render(), "iggy_ingest_wal_full"), 0.0, "full after a reopen with room");
    sim.fail_nth(FaultOp::Write, 1, ErrorKind::StorageFull);
    assert!(rt().block_on(wal.append(vec![payload(300, 10)])).is_err());
    assert!(wal.is_disk_full());
    assert_eq!(value(&handle.render(), "iggy_ingest_wal_disk_full"), 1.0);
    drop(wal);
    let wal = open(&sim, roomy);
    assert!(wal.accepts_appends() && !wal.is_disk_full());
    let r = handle.render();
    for gauge in ["iggy_ingest_wal_full", "iggy_ingest_wal_disk_full", "iggy_ingest_wal_awaiting_segment"] {
        assert_eq!(value(&r, gauge), 0.0, "{gauge} after a reopen: {r}");
    }

    // A seal that keeps failing (its write refused, and undone) is waited out as a
    // successor is: one storage error for the run of retries, and the gauge while it lasts.
    drop(wal);
    let sim = SimStorage::new();
    let wal = open(&sim, WalOptions { preallocate_bytes: 0, ..small_options() });
    append_tagged(&wal, 0..3, 1000);
    let errors_before = value(&handle.render(), "iggy_ingest_wal_storage_errors_total");
    for _ in 0..100 {
        sim.fail_nth(FaultOp::Write, 1, ErrorKind::Other);
    }
    assert!(rt().block_on(wal.append(vec![payload(3, 1000)])).is_err());
    assert!(wal.accepts_appends() && wal.awaits_segment());
    let armed = sim.armed_faults();
    let deadline = Instant::now() + Duration::from_secs(10);
    while sim.armed_faults() + 2 > armed && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(sim.armed_faults() + 2 <= armed, "the writer did not retry the seal twice by itself");
    let r = handle.render();
    assert_eq!(value(&r, "iggy_ingest_wal_storage_errors_total"), errors_before + 1.0, "{r}");
    assert_eq!(value(&r, "iggy_ingest_wal_awaiting_segment"), 1.0, "{r}");
    sim.disarm();
    let deadline = Instant::now() + Duration::from_secs(10);
    while wal.awaits_segment() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(value(&handle.render(), "iggy_ingest_wal_awaiting_segment"), 0.0);
    assert_eq!(rt().block_on(wal.append(vec![payload(4, 1000)])).unwrap().first_offset, 3);
}
