//! Pre-warming the destinations known at start, against the fault-injecting destination
//! double: retried until ready, bounded by the deadline, one dead destination holding
//! only itself.

mod support;

use std::time::Duration;

use router::SendErrorKind;
use router::prewarm::prewarm;
use support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destinations_that_fail_at_first_are_retried_until_ready() {
    let sink = FaultySink::new();
    let (a, b) = (key("shop", "orders"), key("shop", "refunds"));
    sink.client_fault(Some(SendErrorKind::Unavailable));
    let run = tokio::spawn(prewarm(sink.clone(), vec![a.clone(), b.clone()], Duration::from_secs(20)));
    eventually(Duration::from_secs(10), "a few failed tries", || sink.ensured(&a) >= 2 && sink.ensured(&b) >= 2).await;
    sink.client_fault(None);
    let report = run.await.unwrap();
    assert_eq!(report.ready, vec![a, b]);
    assert!(report.not_ready.is_empty(), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_destination_holds_only_itself_and_the_run_ends_at_the_deadline() {
    let sink = FaultySink::new();
    let (dead, failing, fine) = (key("s", "dead"), key("s", "failing"), key("s", "fine"));
    sink.fault(&dead, Some(Fault::BlackHole));
    sink.fault(&failing, Some(Fault::Fail(SendErrorKind::Destination)));
    let started = tokio::time::Instant::now();
    let report =
        prewarm(sink.clone(), vec![dead.clone(), failing.clone(), fine.clone()], Duration::from_millis(800)).await;
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(800) && took < Duration::from_secs(10), "took {took:?}");
    assert_eq!(report.ready, vec![fine]);
    let not_ready: Vec<_> = report.not_ready.iter().map(|(d, _)| d.clone()).collect();
    assert_eq!(not_ready, vec![dead, failing.clone()]);
    assert!(report.not_ready[1].1.contains("injected destination fault"), "{report:?}");
    assert!(sink.ensured(&failing) >= 2, "a failing destination is tried again within the deadline");
}
