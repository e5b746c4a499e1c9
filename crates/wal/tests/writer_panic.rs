//! A writer thread that panics stops the log as a write it could not undo does: appends
//! fail, `accepts_appends` is false, and `iggy_ingest_wal_stopped` says so. A binary of
//! its own: the fail point is armed from the environment once per process, and the
//! Prometheus recorder is installed for the whole process (the writer counts on its
//! own thread).

mod common;

use common::*;
use metrics_exporter_prometheus::PrometheusBuilder;
use wal::storage::SimStorage;

#[test]
fn a_writer_thread_that_panics_stops_the_log_and_its_gauge_says_so() {
    // SAFETY: set before any thread of this process reads the environment (the test's
    // first statement, in a binary with one test).
    unsafe {
        std::env::set_var("IGGY_INGEST_FAIL_POINT", "wal.append.written");
        std::env::set_var("IGGY_INGEST_FAIL_POINT_HIT", "2");
        std::env::set_var("IGGY_INGEST_FAIL_POINT_ACTION", "panic");
    }
    let handle = PrometheusBuilder::new().install_recorder().unwrap();
    let stopped = || {
        handle
            .render()
            .lines()
            .find_map(|l| l.strip_prefix("iggy_ingest_wal_stopped "))
            .map_or(0.0, |v| v.trim().parse::<f64>().unwrap())
    };
    let sim = SimStorage::new();
    let wal = open(&sim, small_options());
    assert_eq!(stopped(), 0.0, "a log just opened takes appends");
    rt().block_on(async {
        wal.append(vec![payload(1, 100)]).await.expect("the first append is not the armed hit");
        assert!(wal.append(vec![payload(2, 100)]).await.is_err(), "the append whose write panicked resolved Ok");
        assert!(wal.append(vec![payload(3, 100)]).await.is_err(), "a stopped log took an append");
    });
    // The appends' answers are dropped as the writer thread unwinds, before the guard at
    // the bottom of its stack marks the log: an append can fail a moment before the log
    // says it stopped. It says so once the thread has unwound.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !wal.writer_panicked() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(wal.writer_panicked() && !wal.accepts_appends());
    assert_eq!(stopped(), 1.0, "the log is stopped and its gauge does not say so");
}
