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

/// Pre-warming holds at most `PREWARM_MAX_IN_FLIGHT` calls (each a connection of its own
/// to the server) however many destinations are known at start, and a call that never
/// answers is given up after the client's bounded wait, not held to the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_a_bounded_number_of_destinations_are_ensured_at_once() {
    let sink = FaultySink::new();
    let dests: Vec<_> = (0..40).map(|i| key("many", &format!("t{i}"))).collect();
    for d in &dests {
        sink.fault(d, Some(Fault::BlackHole));
    }
    let report = prewarm(sink.clone(), dests.clone(), Duration::from_millis(800)).await;
    let started: u64 = dests.iter().map(|d| sink.ensured(d)).sum();
    assert_eq!(started, router::prewarm::PREWARM_MAX_IN_FLIGHT as u64, "calls started");
    assert_eq!(report.not_ready.len(), 40, "{report:?}");
}

/// Each attempt is bounded by the result timeout's upper bound, so a long deadline does
/// not let one call wait past the `iggy` client's own reply timeout.
#[tokio::test(start_paused = true)]
async fn an_attempt_that_never_answers_is_given_up_and_tried_again_before_the_deadline() {
    let sink = FaultySink::new();
    let dead = key("s", "silent");
    sink.fault(&dead, Some(Fault::BlackHole));
    let report = prewarm(sink.clone(), vec![dead.clone()], Duration::from_secs(120)).await;
    assert!(sink.ensured(&dead) >= 4, "attempts in 120 s: {}", sink.ensured(&dead));
    assert!(report.not_ready[0].1.contains("no answer within"), "{report:?}");
}
