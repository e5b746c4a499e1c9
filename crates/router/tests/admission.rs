//! Admission at run time: the destination cap and partition ids out of range, each
//! under `error` (hold), `drop` and `dead_letter`.

mod support;

use std::sync::Arc;
use std::time::Duration;

use ingest::envelope::Partitioning;
use router::status::Status;
use router::test_doubles::MemoryCursorStore;
use router::{OnAdmissionFailure, Policies, Router, RouterPolicy, SendErrorKind};
use support::*;
use wal::storage::SimStorage;

fn policy(on: OnAdmissionFailure) -> RouterPolicy {
    let mut p = fast_policy();
    p.max_destinations = 2;
    p.on_admission_failure = on;
    p.dead_letter = Some(key("dlq", "rejected"));
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_cap_with_error_the_records_are_held_and_the_log_pinned() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests = [key("s", "a"), key("s", "b"), key("s", "c")];
    fill(&wal, &dests, 0, 30).await;
    let router = Router::start(
        wal.clone(),
        sink.clone(),
        Arc::new(MemoryCursorStore::new()),
        Policies::uniform(policy(OnAdmissionFailure::Error)),
    )
    .unwrap();
    eventually(Duration::from_secs(10), "admitted delivered", || {
        sink.ids(&dests[0]).len() == 10 && sink.ids(&dests[1]).len() == 10
    })
    .await;
    eventually(Duration::from_secs(20), "released up to the held record", || router.released_below() == 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(sink.ids(&dests[2]).is_empty());
    assert_eq!(router.held_from(), Some(2), "the first record of the third destination holds the log");
    assert_eq!(router.released_below(), 2);
    // The dead-letter destination is configured but unused under `error`: no lane shows
    // for it, as if it were a destination that never sends.
    let shown: Vec<_> = router.destinations().into_iter().map(|l| l.destination).collect();
    assert_eq!(shown.len(), 2, "{shown:?}");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_cap_with_drop_the_records_are_dropped_and_the_log_released() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests = [key("s", "a"), key("s", "b"), key("s", "c")];
    fill(&wal, &dests, 0, 30).await;
    let router = Router::start(
        wal.clone(),
        sink.clone(),
        Arc::new(MemoryCursorStore::new()),
        Policies::uniform(policy(OnAdmissionFailure::Drop)),
    )
    .unwrap();
    eventually(Duration::from_secs(10), "released", || router.released_below() == 30).await;
    assert!(sink.ids(&dests[2]).is_empty());
    assert_eq!(router.held_from(), None);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_cap_with_dead_letter_the_records_go_there_with_the_reason() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests = [key("s", "a"), key("s", "b"), key("s", "c")];
    let want = fill(&wal, &dests, 0, 30).await;
    let mut p = policy(OnAdmissionFailure::DeadLetter);
    p.lane_queue_max_records = 2; // the dead-letter lane overflows and re-reads the log
    let router = start_router(&wal, &sink, p);
    let dlq = key("dlq", "rejected");
    eventually(Duration::from_secs(10), "dead-lettered", || sink.ids(&dlq).len() == 10).await;
    assert_eq!(sink.ids(&dlq), want[&dests[2]]);
    let m = &sink.delivered(&dlq)[0];
    assert!(m.headers.iter().any(|(k, v)| k == "iggy-ingest-rejected-reason" && &v[..] == b"cap"));
    assert!(m.headers.iter().any(|(k, v)| k == "iggy-ingest-destination" && &v[..] == b"s/c"));
    assert!(m.headers.iter().any(|(k, v)| k == "iggy-ingest-destination-stream" && &v[..] == b"s"));
    assert!(m.headers.iter().any(|(k, v)| k == "iggy-ingest-destination-topic" && &v[..] == b"c"));
    eventually(Duration::from_secs(10), "released", || router.released_below() == 30).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_lettered_record_is_balanced_over_the_dead_letter_topic_not_sent_to_its_partition_id() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests = [key("s", "a"), key("s", "b"), key("s", "c")];
    let dlq = key("dlq", "rejected");
    // The refused destination has 8 partitions, the dead-letter topic one.
    sink.set_partitions(&dests[2], 8);
    sink.set_partitions(&dlq, 1);
    let mut want = Vec::new();
    for i in 0..30u64 {
        let d = &dests[(i as usize) % 3];
        wal.append(vec![record(d, i, Partitioning::PartitionId(5))]).await.unwrap_or_else(|e| panic!("{e}"));
        if d == &dests[2] {
            want.push(u128::from(i) + 1);
        }
    }
    sink.set_partitions(&dests[0], 8);
    sink.set_partitions(&dests[1], 8);
    let router = Router::start(
        wal.clone(),
        sink.clone(),
        Arc::new(MemoryCursorStore::new()),
        Policies::uniform(policy(OnAdmissionFailure::DeadLetter)),
    )
    .unwrap();
    eventually(Duration::from_secs(10), "dead-lettered", || sink.ids(&dlq).len() == 10).await;
    assert_eq!(sink.ids(&dlq), want);
    assert!(sink.delivered(&dlq).iter().all(|m| m.partitioning == Partitioning::Balanced));
    // The admitted destinations keep their partition id.
    assert!(sink.delivered(&dests[0]).iter().all(|m| m.partitioning == Partitioning::PartitionId(5)));
    eventually(Duration::from_secs(10), "released", || router.released_below() == 30).await;
    router.shutdown().await;
}

async fn out_of_range(on: OnAdmissionFailure) -> (Arc<FaultySink>, Router) {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("p", "t");
    sink.set_partitions(&d, 3);
    for (i, p) in [0u32, 1, 7, 2].into_iter().enumerate() {
        wal.append(vec![record(&d, i as u64, Partitioning::PartitionId(p))]).await.unwrap();
    }
    let mut p = policy(on);
    p.breaker.cool_down = Duration::from_millis(500);
    let router = Router::start(wal, sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(p)).unwrap();
    (sink, router)
}

fn lane_status(router: &Router, d: &router::DestinationKey) -> Status {
    router.destinations().into_iter().find(|s| &s.destination == d).map_or(Status::Starting, |s| s.status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_id_out_of_range_with_drop_is_dropped_and_feeds_no_breaker() {
    let (sink, router) = out_of_range(OnAdmissionFailure::Drop).await;
    let d = key("p", "t");
    eventually(Duration::from_secs(10), "delivered", || sink.ids(&d).len() == 3).await;
    assert_eq!(sink.ids(&d), vec![1, 2, 4]);
    let snap = router.destinations().into_iter().find(|s| s.destination == d).unwrap();
    assert_eq!((snap.breaker, snap.rejected_records), ("closed", 1));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_id_out_of_range_with_dead_letter_goes_there() {
    let (sink, router) = out_of_range(OnAdmissionFailure::DeadLetter).await;
    let d = key("p", "t");
    eventually(Duration::from_secs(10), "delivered", || sink.ids(&d).len() == 3).await;
    let dlq = sink.delivered(&key("dlq", "rejected"));
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].id, 3);
    assert!(
        dlq[0]
            .headers
            .iter()
            .any(|(k, v)| k == "iggy-ingest-rejected-reason" && &v[..] == b"partition_id_out_of_range")
    );
    // The dead-letter destination's row shows what it took, though its own lane sent
    // none of it.
    let dl = key("dlq", "rejected");
    eventually(Duration::from_secs(10), "the dead-letter row running", || lane_status(&router, &dl) == Status::Running)
        .await;
    let row = router.destinations().into_iter().find(|s| s.destination == dl).unwrap();
    assert_eq!(row.sent_records, 1, "{row:?}");
    router.shutdown().await;
}

/// Only a dead-letter send cut short by the result timeout makes the next ones carry
/// fewer records, as for a lane's own sends: an ensure of the dead-letter topic that is
/// not answered in time sent nothing, and its size is not what failed. (It halved the
/// run's next send, and every one after, until 16 were answered in a row.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_topic_slow_to_ensure_does_not_shrink_the_dead_letter_sends() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let (d, dlq) = (key("p", "t"), key("dlq", "rejected"));
    sink.set_partitions(&d, 3);
    // Its ensure never answers: cut short at the result timeout.
    sink.fault(&dlq, Some(Fault::BlackHole));
    let batch = (0..8u64).map(|i| record(&d, i, Partitioning::PartitionId(7))).collect();
    wal.append(batch).await.unwrap();
    let mut p = policy(OnAdmissionFailure::DeadLetter);
    p.batch.result_timeout = Duration::from_millis(200);
    // The eight records make one batch, and so one run to dead-letter.
    p.batch.linger = Duration::from_millis(200);
    let router = Router::start(wal, sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(p)).unwrap();
    eventually(Duration::from_secs(10), "the dead-letter topic ensured", || sink.ensured(&dlq) >= 1).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    sink.fault(&dlq, None);
    eventually(Duration::from_secs(20), "dead-lettered", || sink.delivered(&dlq).len() == 8).await;
    let sizes: Vec<usize> = sink.send_sizes(&dlq).iter().map(|&(n, _)| n).collect();
    assert_eq!(sizes, [8], "the dead-letter sends after an ensure cut short");
    router.shutdown().await;
}

/// The sends to the dead-letter topic of records beyond the topic's partitions are
/// counted as every send is: their failures by reason (what the runbook reads to tell a
/// failing destination from a failing server), and the records once delivered there.
#[test]
fn sends_to_the_dead_letter_topic_for_out_of_range_records_are_counted() {
    with_metrics(false, |snap| async move {
        let dlq = key("dlq", "rejected");
        let (sink, router) = {
            // `out_of_range`, with the dead-letter topic failing from the start.
            let sim = SimStorage::new();
            let wal = open_wal(&sim);
            let sink = FaultySink::new();
            let d = key("p", "t");
            sink.set_partitions(&d, 3);
            sink.fault(&dlq, Some(Fault::Fail(SendErrorKind::Destination)));
            for (i, p) in [0u32, 1, 7, 2].into_iter().enumerate() {
                wal.append(vec![record(&d, i as u64, Partitioning::PartitionId(p))]).await.unwrap();
            }
            let mut p = policy(OnAdmissionFailure::DeadLetter);
            p.breaker.cool_down = Duration::from_millis(500);
            let router =
                Router::start(wal, sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(p)).unwrap();
            (sink, router)
        };
        let failures = || metric(&snap, "iggy_connector_send_failures_total", "reason=\"destination\"");
        eventually(Duration::from_secs(10), "a dead-letter send failed", || failures() > 0.0).await;
        let routed = || metric(&snap, "iggy_connector_messages_routed_total", "");
        // The two before it; the one after waits for it, in order.
        assert_eq!(routed(), 2.0);
        sink.fault(&dlq, None);
        eventually(Duration::from_secs(20), "dead-lettered", || sink.delivered(&dlq).len() == 1).await;
        eventually(Duration::from_secs(5), "all delivered", || sink.ids(&key("p", "t")).len() == 3).await;
        eventually(Duration::from_secs(5), "counted", || routed() == 4.0).await;
        router.shutdown().await;
    });
}

/// Lanes holding records beyond their topic's partitions ask the topic again after each
/// cool-down; those calls take the source's send slots as sends do, so a source's
/// connections stay within `max_concurrent_destinations` however many lanes hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_holding_out_of_range_records_ask_their_topics_within_the_send_slots() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests = [key("p", "t1"), key("p", "t2"), key("p", "t3")];
    for (i, d) in dests.iter().enumerate() {
        sink.set_partitions(d, 3);
        wal.append(vec![record(d, i as u64, Partitioning::PartitionId(7))]).await.unwrap();
    }
    let mut p = policy(OnAdmissionFailure::Error);
    p.max_destinations = 3;
    p.max_concurrent_destinations = 1;
    p.breaker.cool_down = Duration::from_millis(50);
    let router = Router::start(wal, sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(p)).unwrap();
    eventually(Duration::from_secs(10), "every lane holds", || {
        dests.iter().all(|d| lane_status(&router, d) == Status::Degraded)
    })
    .await;
    sink.set_ensure_delay(Some(Duration::from_millis(150)));
    eventually(Duration::from_secs(10), "each lane asked again", || dests.iter().all(|d| sink.ensured(d) >= 4)).await;
    assert_eq!(sink.ensures_peak(), 1, "more calls in flight than the source's one send slot");
    router.shutdown().await;
}

/// A destination whose sends failed until its breaker opened, and that then answers with
/// fewer partitions than its records name: the records are held (out of range, never a
/// breaker failure), and the breaker is closed and the failures forgotten for the hold,
/// so neither the gauge nor the lane says the destination fails.
#[test]
fn a_hold_for_out_of_range_records_closes_a_breaker_that_failures_opened() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("p", "gone");
        sink.fault(&d, Some(Fault::Fail(SendErrorKind::Destination)));
        wal.append(vec![record(&d, 0, Partitioning::PartitionId(2))]).await.unwrap();
        let mut p = policy(OnAdmissionFailure::Error);
        p.breaker.failure_threshold = 2;
        p.breaker.cool_down = Duration::from_millis(300);
        let router =
            Router::start(wal, sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(p)).unwrap();
        let lane = || router.destinations().into_iter().find(|s| s.destination == d);
        eventually(Duration::from_secs(10), "breaker open", || {
            gauge(&snap, "iggy_connector_destination_circuit_open") == 1.0
        })
        .await;
        // The topic is back, with one partition.
        sink.set_partitions(&d, 1);
        sink.fault(&d, None);
        eventually(Duration::from_secs(10), "held as out of range", || {
            lane().is_some_and(|l| l.status_reason.contains("partition id 2 is beyond"))
        })
        .await;
        let l = lane().unwrap();
        assert_eq!((l.breaker, l.consecutive_failures, l.status), ("closed", 0, Status::Degraded), "{l:?}");
        assert_eq!(gauge(&snap, "iggy_connector_destination_circuit_open"), 0.0);
        assert!(sink.ids(&d).is_empty());
        router.shutdown().await;
    });
}

/// Failures that did not open the breaker, then records the destination answered for
/// and that were dropped as out of range: the lane counts its failures from zero again,
/// and so must its breaker. Before, the breaker kept its count, and the next single
/// failure opened it, shown as "open" with one failure in a row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_dropped_as_out_of_range_start_the_breakers_count_again() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("p", "t");
    sink.fault(&d, Some(Fault::Fail(SendErrorKind::Destination)));
    wal.append(vec![record(&d, 0, Partitioning::PartitionId(5))]).await.unwrap();
    let mut p = policy(OnAdmissionFailure::Drop);
    p.batch.backoff_base = Duration::from_millis(400);
    p.batch.degraded_after_failures = 10;
    let threshold = p.breaker.failure_threshold;
    assert_eq!(threshold, 3);
    let router =
        Router::start(wal.clone(), sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(p)).unwrap();
    let lane = || router.destinations().into_iter().find(|s| s.destination == d);
    eventually(Duration::from_secs(10), "two failures", || lane().is_some_and(|l| l.consecutive_failures == 2)).await;
    // The topic answers, with one partition: the record is dropped, the failures over.
    sink.set_partitions(&d, 1);
    sink.fault(&d, Some(Fault::FailSends(SendErrorKind::Destination)));
    eventually(Duration::from_secs(10), "dropped", || lane().is_some_and(|l| l.rejected_records == 1)).await;
    let l = lane().unwrap();
    assert_eq!((l.breaker, l.consecutive_failures), ("closed", 0), "{l:?}");

    // One more record, whose send fails once: one failure, the breaker still closed.
    wal.append(vec![record(&d, 1, Partitioning::Balanced)]).await.unwrap();
    eventually(Duration::from_secs(10), "a failed send", || lane().is_some_and(|l| l.consecutive_failures >= 1)).await;
    // The failure is counted before the breaker's state is shown: watch it until the
    // next try, a backoff of 400 ms away, for the breaker to open.
    for _ in 0..15 {
        let l = lane().unwrap();
        assert!(l.consecutive_failures < threshold, "the test's backoff let the failures reach the threshold: {l:?}");
        assert_eq!(l.breaker, "closed", "one failure opened the breaker: {l:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_id_out_of_range_with_error_is_held_until_the_topic_grows() {
    let (sink, router) = out_of_range(OnAdmissionFailure::Error).await;
    let d = key("p", "t");
    eventually(Duration::from_secs(10), "the records before it", || sink.ids(&d).len() == 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sink.ids(&d), vec![1, 2], "a held record was skipped");
    let snap = router.destinations().into_iter().find(|s| s.destination == d).unwrap();
    assert_eq!((snap.breaker, snap.rejected_records), ("closed", 1));
    // What holds it is shown, though no send failed: the last error and when it came,
    // and the status's reason.
    assert!(snap.last_error.as_deref().is_some_and(|e| e.contains("beyond the topic's 3 partitions")), "{snap:?}");
    assert!(snap.last_error_at.is_some(), "{snap:?}");
    assert!(snap.status_reason.contains("beyond the topic's 3 partitions"), "{snap:?}");
    // Held across several cool-downs (each asks the topic again): Degraded throughout,
    // the router too, and counted once; the held records wait in the log, not in memory.
    for _ in 0..4 {
        assert_eq!(lane_status(&router, &d), Status::Degraded);
        assert_eq!(router.status().status, Status::Degraded);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    eventually(Duration::from_secs(10), "held records parked", || {
        router.destinations().iter().any(|s| s.destination == d && s.batch_bytes == 0 && s.held_records == 2)
    })
    .await;
    assert!(sink.ensured(&d) >= 3, "the topic was not asked again: {}", sink.ensured(&d));
    let snap = router.destinations().into_iter().find(|s| s.destination == d).unwrap();
    assert_eq!(snap.rejected_records, 1);
    // The operator adds partitions: after the next cool-down the record goes out.
    sink.set_partitions(&d, 8);
    eventually(Duration::from_secs(20), "delivered after growth", || sink.ids(&d).len() == 4).await;
    assert_eq!(sink.ids(&d), vec![1, 2, 3, 4]);
    eventually(Duration::from_secs(30), "running again", || {
        lane_status(&router, &d) == Status::Running && router.status().status == Status::Running
    })
    .await;
    router.shutdown().await;
}

/// A log of four records for `p/t` with partition id 7, and a sink whose `p/t` has
/// three partitions.
async fn four_records_beyond_three_partitions() -> (Arc<wal::Wal>, Arc<FaultySink>, router::DestinationKey) {
    let wal = open_wal(&SimStorage::new());
    let sink = FaultySink::new();
    let d = key("p", "t");
    sink.set_partitions(&d, 3);
    for i in 0..4u64 {
        wal.append(vec![record(&d, i, Partitioning::PartitionId(7))]).await.unwrap_or_else(|e| panic!("{e}"));
    }
    (wal, sink, d)
}

/// A lane Degraded by failures whose records then all turn out to be out of range (and
/// are dropped or dead-lettered, as configured) made progress: it is Running again,
/// though it never sent to its own topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_degraded_lane_whose_records_are_all_disposed_of_is_running_again() {
    for on in [OnAdmissionFailure::Drop, OnAdmissionFailure::DeadLetter] {
        let (wal, sink, d) = four_records_beyond_three_partitions().await;
        sink.client_fault(Some(SendErrorKind::Unavailable));
        let router =
            Router::start(wal, sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(policy(on)))
                .unwrap();
        eventually(Duration::from_secs(10), "degraded", || lane_status(&router, &d) == Status::Degraded).await;
        sink.client_fault(None);
        eventually(Duration::from_secs(10), "released", || router.released_below() == 4).await;
        eventually(Duration::from_secs(30), "running", || {
            lane_status(&router, &d) == Status::Running && router.status().status == Status::Running
        })
        .await;
        assert!(sink.ids(&d).is_empty(), "{on:?}: an out-of-range record reached its topic");
        router.shutdown().await;
    }
}

/// A breaker opened by a failing destination closes once the destination answers and the
/// held records all turn out to be out of range and are disposed of: with nothing left
/// to send, no probe would ever close it, and its gauge (and the breaker alert) would say
/// "open" for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_breaker_whose_held_records_are_all_disposed_of_closes() {
    for on in [OnAdmissionFailure::Drop, OnAdmissionFailure::DeadLetter] {
        let (wal, sink, d) = four_records_beyond_three_partitions().await;
        sink.fault(&d, Some(Fault::Fail(SendErrorKind::Destination)));
        let mut p = policy(on);
        p.breaker.cool_down = Duration::from_millis(300);
        let router =
            Router::start(wal, sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(p)).unwrap();
        let breaker = |router: &Router| {
            router.destinations().into_iter().find(|s| s.destination == d).map_or("none", |s| s.breaker)
        };
        eventually(Duration::from_secs(10), "the breaker opened", || breaker(&router) == "open").await;
        sink.fault(&d, None);
        eventually(Duration::from_secs(10), "released", || router.released_below() == 4).await;
        eventually(Duration::from_secs(30), "running", || lane_status(&router, &d) == Status::Running).await;
        // Nothing more arrives for this destination: the breaker must not stay open.
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert_eq!(breaker(&router), "closed", "{on:?}: the breaker stayed open with nothing to send");
        assert!(sink.ids(&d).is_empty(), "{on:?}: an out-of-range record reached its topic");
        router.shutdown().await;
    }
}

/// The cap's admitted set is built again at each start, in log order from the oldest
/// record kept: a destination admitted before a restart (here A, whose backlog the log
/// holds while A is down) can be refused after it, its records then dead-lettered. They
/// lie below the dead-letter lane's stored cursor (B's records went there before), yet
/// that topic never had them: they must go there (or to A), never be skipped as
/// "delivered before the restart" and released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_records_refused_by_the_cap_are_dead_lettered_even_below_its_cursor() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let cursors = Arc::new(MemoryCursorStore::new());
    let (a, b, dlq) = (key("s", "a"), key("s", "b"), key("dlq", "rejected"));
    let mut p = policy(OnAdmissionFailure::DeadLetter);
    p.max_destinations = 1;
    let policies = Policies::uniform(p);

    // Run 1: A comes first and is admitted; one record reaches it, then it fails. B is
    // over the cap: dead-lettered, and the log released below A's backlog.
    wal.append(vec![record(&a, 0, Partitioning::Balanced)]).await.unwrap_or_else(|e| panic!("{e}"));
    let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), policies.clone()).unwrap();
    eventually(Duration::from_secs(10), "A's first record", || sink.ids(&a).len() == 1).await;
    sink.fault(&a, Some(Fault::Fail(SendErrorKind::Destination)));
    let mut n = 1u64;
    let mut append = |d: &router::DestinationKey, count: u64, owed: &mut Vec<u128>| {
        let batch: Vec<_> = (n..n + count).map(|i| record(d, i, Partitioning::Balanced)).collect();
        owed.extend((n..n + count).map(|i| u128::from(i) + 1));
        n += count;
        batch
    };
    let (mut b_ids, mut a_owed) = (Vec::new(), Vec::new());
    for batch in [append(&b, 200, &mut b_ids), append(&a, 10, &mut a_owed), append(&b, 10, &mut b_ids)] {
        for r in batch {
            wal.append(vec![r]).await.unwrap_or_else(|e| panic!("{e}"));
        }
    }
    eventually(Duration::from_secs(20), "B dead-lettered and the log released", || {
        sink.ids(&dlq).len() == 210 && wal.start_offset() > 0
    })
    .await;
    router.shutdown().await;
    wal.close().await.unwrap_or_else(|e| panic!("{e}"));
    drop(wal);

    // Run 2, the same configuration: the log now starts with B's records, so B takes the
    // slot and A's backlog is over the cap.
    let wal = open_wal(&sim);
    assert!(wal.start_offset() > 1, "the test needs the log to start past A's first record");
    sink.fault(&a, None);
    let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), policies).unwrap();
    eventually(Duration::from_secs(20), "released to the end", || router.released_below() == n).await;
    let (to_a, to_dlq) = (sink.ids(&a), sink.ids(&dlq));
    let lost: Vec<u128> = a_owed.iter().copied().filter(|id| !to_a.contains(id) && !to_dlq.contains(id)).collect();
    router.shutdown().await;
    assert!(lost.is_empty(), "released from the log and sent nowhere: {lost:?}");
    let dlq_missing: Vec<u128> = b_ids.iter().copied().filter(|id| !to_dlq.contains(id)).collect();
    assert!(dlq_missing.is_empty(), "B's records missing from the dead-letter topic: {dlq_missing:?}");
}

/// The cap's admitted set is built again at each start, in log order from the oldest
/// record kept, so a destination admitted before a restart (here B) can be refused after
/// it when the log now starts with a record of another (A). B's records below its stored
/// cursor were delivered before the restart: whatever `on_admission_failure` says, the
/// cap refuses nothing there. They are not counted as rejected or dropped, not
/// dead-lettered, and under `error` they hold nothing: the log is released to its end.
#[test]
fn after_a_restart_records_delivered_before_it_are_not_refused_by_the_cap() {
    for on in [OnAdmissionFailure::Drop, OnAdmissionFailure::Error, OnAdmissionFailure::DeadLetter] {
        with_metrics(false, |snap| async move {
            let sim = SimStorage::new();
            let wal = open_wal(&sim);
            let sink = FaultySink::new();
            let cursors = Arc::new(MemoryCursorStore::new());
            let (a, b, x, y, dlq) =
                (key("s", "a"), key("s", "b"), key("t", "x"), key("u", "y"), key("dlq", "rejected"));
            let mut p = policy(on);
            p.max_destinations = 1;
            let policies = Policies::uniform(p);
            let cap = |name: &str| metric(&snap, name, "reason=\"cap\"");
            // The log: B (source s) first; records of another source filling segments;
            // one record of a third source whose destination fails, pinning the log there;
            // A (source s, refused by the cap in run 1); B's other records; then another
            // record of the failing destination, the log's last.
            let n = 400u64;
            let mut log = vec![record_from("s", &b, 0, Partitioning::Balanced)];
            log.extend((1..n).map(|i| record_from("u", &y, i, Partitioning::Balanced)));
            log.push(record_from("t", &x, n, Partitioning::Balanced));
            log.push(record_from("s", &a, n + 1, Partitioning::Balanced));
            log.extend((n + 2..n + 12).map(|i| record_from("s", &b, i, Partitioning::Balanced)));
            log.push(record_from("t", &x, n + 12, Partitioning::Balanced));
            for r in log {
                wal.append(vec![r]).await.unwrap_or_else(|e| panic!("{e}"));
            }
            let end = n + 13;
            sink.fault(&x, Some(Fault::Fail(SendErrorKind::Destination)));

            // Run 1: B is admitted, A refused; the log is released below x's record.
            let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), policies.clone()).unwrap();
            let lane_b = router::LaneKey { source: "s".into(), destination: b.clone() };
            eventually(Duration::from_secs(10), "B delivered, its cursor stored and the log released", || {
                sink.ids(&b).len() == 11
                    && cursors.get(&lane_b) == Some(n + 12)
                    && router.released_below() == n
                    && wal.start_offset() > 0
            })
            .await;
            assert_eq!(router.held_from(), (on == OnAdmissionFailure::Error).then_some(n + 1), "{on:?}");
            router.shutdown().await;
            let rejected_1 = cap("iggy_connector_destinations_rejected_total");
            let dropped_1 = cap("iggy_connector_messages_dropped_total");
            assert_eq!(rejected_1, 1.0, "{on:?}: A's record, the only one refused in run 1");
            assert_eq!(dropped_1, if on == OnAdmissionFailure::Drop { 1.0 } else { 0.0 }, "{on:?}");
            let dead_lettered_1 = sink.ids(&dlq);
            wal.close().await.unwrap_or_else(|e| panic!("{e}"));
            drop(wal);

            // Run 2: the log starts past B's first record, so A takes the slot and B's
            // records, all delivered, are over the cap.
            let wal = open_wal(&sim);
            assert!(wal.start_offset() > 0 && wal.start_offset() <= n, "log starts at {}", wal.start_offset());
            sink.fault(&x, None);
            let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), policies).unwrap();
            // x's last record is the log's last: once it is delivered, every record of B
            // was routed.
            eventually(Duration::from_secs(10), "A and x delivered", || {
                sink.ids(&a).len() == 1 && sink.ids(&x).len() == 2
            })
            .await;
            assert_eq!(router.held_from(), None, "{on:?}: the log is held at a record delivered before the restart");
            assert_eq!(gauge(&snap, "iggy_connector_admission_held"), 0.0, "{on:?}: a hold shown");
            let rejected_2 = cap("iggy_connector_destinations_rejected_total") - rejected_1;
            let dropped_2 = cap("iggy_connector_messages_dropped_total") - dropped_1;
            assert_eq!(rejected_2, 0.0, "{on:?}: records delivered before the restart counted as rejected");
            assert_eq!(dropped_2, 0.0, "{on:?}: records delivered before the restart counted as dropped");
            eventually(Duration::from_secs(10), "released to the end", || router.released_below() == end).await;
            router.shutdown().await;
            assert_eq!(sink.ids(&b).len(), 11, "{on:?}: B's records sent again");
            assert_eq!(sink.ids(&dlq), dead_lettered_1, "{on:?}: B's records dead-lettered");
        });
    }
}

/// A dead-letter topic that fails is a held lane like any other: Degraded after
/// `degraded_after_failures`, with the result timeout applied, and Running once the
/// records reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_dead_letter_topic_degrades_the_lane_until_it_takes_the_records() {
    let (sink, router) = {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("p", "t");
        sink.set_partitions(&d, 3);
        sink.fault(&key("dlq", "rejected"), Some(Fault::BlackHole));
        wal.append(vec![record(&d, 0, Partitioning::PartitionId(7))]).await.unwrap_or_else(|e| panic!("{e}"));
        let mut p = policy(OnAdmissionFailure::DeadLetter);
        p.batch.result_timeout = Duration::from_millis(200);
        let router =
            Router::start(wal, sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(p)).unwrap();
        (sink, router)
    };
    let d = key("p", "t");
    eventually(Duration::from_secs(10), "degraded", || {
        lane_status(&router, &d) == Status::Degraded && router.status().status == Status::Degraded
    })
    .await;
    let snap = router.destinations().into_iter().find(|s| s.destination == d).unwrap();
    assert!(snap.last_error.as_deref().is_some_and(|e| e.contains("result timeout")), "{:?}", snap.last_error);
    assert_eq!(router.released_below(), 0);
    // The record waits in the log between tries, and is counted rejected once however
    // often it is read back.
    eventually(Duration::from_secs(10), "parked", || {
        router.destinations().iter().any(|s| s.destination == d && s.batch_bytes == 0 && s.held_records == 1)
    })
    .await;
    let tries = sink.ensured(&key("dlq", "rejected"));
    eventually(Duration::from_secs(10), "tried again", || sink.ensured(&key("dlq", "rejected")) >= tries + 2).await;
    let snap = router.destinations().into_iter().find(|s| s.destination == d).unwrap();
    assert_eq!(snap.rejected_records, 1, "{snap:?}");
    // The topic gains the partition meanwhile: a record on its way to the dead-letter
    // topic (a send cut short there may have stored it) still goes there, not to both.
    sink.set_partitions(&d, 8);
    let tries = sink.ensured(&key("dlq", "rejected"));
    eventually(Duration::from_secs(10), "tried again", || sink.ensured(&key("dlq", "rejected")) >= tries + 2).await;
    assert!(sink.ids(&d).is_empty(), "sent to its topic too: {:?}", sink.ids(&d));
    sink.fault(&key("dlq", "rejected"), None);
    eventually(Duration::from_secs(10), "dead-lettered", || sink.ids(&key("dlq", "rejected")) == vec![1]).await;
    assert!(sink.ids(&d).is_empty(), "sent to its topic too: {:?}", sink.ids(&d));
    eventually(Duration::from_secs(30), "running", || lane_status(&router, &d) == Status::Running).await;
    eventually(Duration::from_secs(30), "released", || router.released_below() == 1).await;
    router.shutdown().await;
}

/// A router under `on` whose lane to `p/t` (`partitions` partitions) has delivered one
/// record to partition 0, so it has learnt the count; records appended together then go
/// out as one batch (300 ms linger), and a record held for a cool-down would show (30 s).
/// Returns the log, the sink, the router, the destination, the dead-letter destination
/// and how often the topic was asked about so far.
async fn one_record_delivered_to_partition_0(
    on: OnAdmissionFailure,
    partitions: u32,
) -> (Arc<wal::Wal>, Arc<FaultySink>, Router, router::DestinationKey, router::DestinationKey, u64) {
    let wal = open_wal(&SimStorage::new());
    let sink = FaultySink::new();
    let (d, dlq) = (key("p", "t"), key("dlq", "rejected"));
    sink.set_partitions(&d, partitions);
    let mut p = policy(on);
    p.breaker.cool_down = Duration::from_secs(30);
    p.batch.linger = Duration::from_millis(300);
    let router = start_router(&wal, &sink, p);
    wal.append(vec![record(&d, 0, Partitioning::PartitionId(0))]).await.unwrap_or_else(|e| panic!("{e}"));
    eventually(Duration::from_secs(10), "the first delivered", || sink.ids(&d) == vec![1]).await;
    let ensured = sink.ensured(&d);
    (wal, sink, router, d, dlq, ensured)
}

/// A topic that gained partitions after the lane learnt its partition count: a record
/// for one of the new partitions is delivered there, under every policy, and at once
/// (never dropped, dead-lettered or held for a cool-down on a count that is out of
/// date). The lane asks the topic again once per decision, not once per record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_added_since_the_count_was_learnt_is_used_under_every_policy() {
    for on in [OnAdmissionFailure::Drop, OnAdmissionFailure::DeadLetter, OnAdmissionFailure::Error] {
        let (wal, sink, router, d, dlq, ensured) = one_record_delivered_to_partition_0(on, 1).await;
        sink.set_partitions(&d, 3);
        let batch = (1..5u64).map(|i| record(&d, i, Partitioning::PartitionId(2))).collect();
        wal.append(batch).await.unwrap_or_else(|e| panic!("{e}"));
        eventually(Duration::from_secs(30), "settled", || sink.ids(&d).len() == 5 || router.released_below() == 5)
            .await;
        assert_eq!(sink.ids(&d), vec![1, 2, 3, 4, 5], "{on:?}: records for a partition the topic has not delivered");
        assert!(sink.ids(&dlq).is_empty(), "{on:?}: dead-lettered");
        let snap = router.destinations().into_iter().find(|s| s.destination == d).unwrap();
        assert_eq!((snap.rejected_records, snap.partitions_count), (0, Some(3)), "{on:?}");
        assert_eq!(sink.ensured(&d) - ensured, 1, "{on:?}: the topic asked once for the batch");
        eventually(Duration::from_secs(30), "running", || lane_status(&router, &d) == Status::Running).await;
        router.shutdown().await;
    }
}

/// A partition that really is beyond the topic's is still disposed of as configured,
/// after one question to the server per batch (the answer is trusted for the batch's
/// every run), however many records the batch holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_the_topic_lacks_is_asked_about_once_per_batch_then_disposed_of() {
    for on in [OnAdmissionFailure::Drop, OnAdmissionFailure::DeadLetter] {
        let (wal, sink, router, d, dlq, ensured) = one_record_delivered_to_partition_0(on, 3).await;
        // Two runs out of range, one in range between them.
        let batch = [7u32, 7, 7, 1, 9, 9]
            .into_iter()
            .zip(1u64..)
            .map(|(partition, i)| record(&d, i, Partitioning::PartitionId(partition)))
            .collect();
        wal.append(batch).await.unwrap_or_else(|e| panic!("{e}"));
        eventually(Duration::from_secs(10), "released", || router.released_below() == 7).await;
        assert_eq!(sink.ids(&d), vec![1, 5], "{on:?}");
        let want_dlq: Vec<u128> = if on == OnAdmissionFailure::DeadLetter { vec![2, 3, 4, 6, 7] } else { vec![] };
        assert_eq!(sink.ids(&dlq), want_dlq, "{on:?}");
        let snap = router.destinations().into_iter().find(|s| s.destination == d).unwrap();
        assert_eq!(snap.rejected_records, 5, "{on:?}");
        assert_eq!(sink.ensured(&d) - ensured, 1, "{on:?}: the topic asked once for the batch");
        router.shutdown().await;
    }
}

/// A destination given up after part of it was delivered: the records below its stored
/// cursor, still in the log, were delivered and are not counted as dropped (nor named as
/// the first dropped); the rest are, once each per run.
#[test]
fn giving_up_counts_only_the_records_not_delivered() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let cursors = Arc::new(MemoryCursorStore::new());
        let d = key("s", "given-up");
        let lane = router::LaneKey { source: "test".into(), destination: d.clone() };
        fill(&wal, std::slice::from_ref(&d), 0, 20).await;
        router::CursorStore::store(&*cursors, vec![(lane.clone(), 12)]).await.unwrap();
        let mut policies = Policies::uniform(fast_policy());
        policies.given_up = Arc::new([lane].into_iter().collect());
        let router = Router::start(wal.clone(), sink.clone(), cursors, policies).unwrap();
        eventually(Duration::from_secs(10), "released past every record", || router.released_below() == 20).await;
        router.shutdown().await;
        assert_eq!(metric(&snap, "iggy_connector_messages_dropped_total", "reason=\"given_up\""), 8.0);
        assert!(sink.ids(&d).is_empty());
    });
}

/// A dead-letter destination that can never take records (the user may not write to
/// it) is given up like any other: what would go there (refused by the cap, or out of
/// its topic's partitions) is dropped and counted as given up, holds no lane and pins
/// nothing, and the destination it came from goes on. Before, the cap's refusals kept
/// going to a dead-letter lane that pinned the log, and an out-of-range record held its
/// own destination's lane in the dead-letter retry for good.
#[test]
fn a_given_up_dead_letter_destination_takes_nothing_and_pins_nothing() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let dlq = key("dlq", "rejected");
        sink.fault(&dlq, Some(Fault::Fail(SendErrorKind::Destination)));
        let (a, b, c, p) = (key("s", "a"), key("s", "b"), key("s", "c"), key("s", "p"));
        sink.set_partitions(&p, 3);
        // p (one record beyond its topic's 3 partitions, one within), a and b are
        // admitted (cap 3); c is refused.
        wal.append(vec![record(&p, 0, Partitioning::PartitionId(7))]).await.unwrap();
        wal.append(vec![record(&p, 1, Partitioning::PartitionId(1))]).await.unwrap();
        let want = fill(&wal, &[a.clone(), b.clone(), c.clone()], 0, 30).await;
        let mut policy = policy(OnAdmissionFailure::DeadLetter);
        policy.max_destinations = 3;
        let mut policies = Policies::uniform(policy);
        let dlq_lane = router::LaneKey { source: "test".into(), destination: dlq.clone() };
        policies.given_up = Arc::new([dlq_lane.clone()].into_iter().collect());
        // The dead-letter destination took records in an earlier run, past every offset
        // here: its cursor says nothing of the records refused in this one.
        let cursors = Arc::new(MemoryCursorStore::new());
        router::CursorStore::store(&*cursors, vec![(dlq_lane, 1000)]).await.unwrap();
        let router = Router::start(wal.clone(), sink.clone(), cursors, policies).unwrap();
        eventually(Duration::from_secs(20), "released past every record", || router.released_below() == 32).await;
        assert_eq!(sink.ids(&a), want[&a]);
        assert_eq!(sink.ids(&b), want[&b]);
        assert_eq!(sink.ids(&p), vec![2], "the out-of-range record held its destination");
        assert_eq!(sink.calls(&dlq), 0, "a send was made to the given-up dead-letter destination");
        assert!(router.destinations().iter().all(|l| l.destination != dlq), "a lane for it");
        // c's 10 records refused by the cap, and p's record out of range.
        assert_eq!(metric(&snap, "iggy_connector_messages_dropped_total", "reason=\"given_up\""), 11.0);
        router.shutdown().await;
    });
}

/// A lane holding a record for a partition its topic lacks asks the topic again every
/// cool-down: those calls are counted as a send's are, so an outage while it holds shows
/// in `send_failures_total`, and the ones answered are timed.
#[test]
fn a_lane_holding_an_out_of_range_record_counts_and_times_its_calls() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("p", "few");
        sink.set_partitions(&d, 3);
        wal.append(vec![record(&d, 0, Partitioning::PartitionId(7))]).await.unwrap();
        let mut p = policy(OnAdmissionFailure::Error);
        p.breaker.cool_down = Duration::from_millis(50);
        let router =
            Router::start(wal, sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(p)).unwrap();
        eventually(Duration::from_secs(10), "the lane holds", || lane_status(&router, &d) == Status::Degraded).await;
        let timed = || metric(&snap, "iggy_connector_destination_create_latency_seconds_count", "");
        let asked = sink.ensured(&d);
        let timed_before = timed();
        eventually(Duration::from_secs(10), "asked again", || sink.ensured(&d) >= asked + 3).await;
        assert!(
            timed() >= timed_before + 2.0,
            "the hold's answered calls are not timed: {} then {}",
            timed_before,
            timed()
        );
        let unavailable = || metric(&snap, "iggy_connector_send_failures_total", "reason=\"unavailable\"");
        assert_eq!(unavailable(), 0.0);
        sink.fault(&d, Some(Fault::Fail(SendErrorKind::Unavailable)));
        eventually(Duration::from_secs(10), "the hold's failed calls counted", || unavailable() >= 2.0).await;
        router.shutdown().await;
    });
}

/// A run of records beyond their topic's partitions too slow to be dead-lettered whole
/// (here 60 ms a record, 40 records, a 500 ms timeout) is sent there in halves until a
/// send is answered in time: sent whole at every retry, it was cut short for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_too_slow_to_dead_letter_whole_is_sent_in_halves() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("p", "few");
    let dlq = key("dlq", "rejected");
    sink.set_partitions(&d, 3);
    sink.fault(&dlq, Some(Fault::SlowPerMessage(Duration::from_millis(60))));
    let records: Vec<_> = (0..40u64).map(|i| record(&d, i, Partitioning::PartitionId(7))).collect();
    wal.append(records).await.unwrap();
    let mut p = policy(OnAdmissionFailure::DeadLetter);
    p.batch.result_timeout = Duration::from_millis(500);
    p.batch.batch_max_records = 40;
    let router = Router::start(wal, sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(p)).unwrap();
    eventually(Duration::from_secs(30), "dead-lettered", || sink.ids(&dlq).len() >= 40).await;
    let want: Vec<u128> = (0..40u64).map(|i| u128::from(i) + 1).collect();
    assert_eq!(sink.ids(&dlq), want, "lost, reordered or duplicated records");
    let sizes: Vec<usize> = sink.send_sizes(&dlq).iter().map(|(n, _)| *n).collect();
    assert_eq!(&sizes[..4], &[40, 20, 10, 5], "sends: {sizes:?}");
    router.shutdown().await;
}

/// Records beyond their topic's partitions are dead-lettered in sends Iggy takes: their
/// batch was bounded by the bytes of their own messages, and each gains the dead-letter
/// headers (with names of 255 bytes, about 600 bytes more), so a batch of 50,000 small
/// records went out as one send of 41.5 MB, past the 32 MiB a send carries (past 64 MiB
/// the server closes the connection, and the same send went out again for good, each
/// time taken for a lost connection). Now: two sends of 20.4 MB and a short one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_out_of_range_are_dead_lettered_in_sends_within_the_send_bound() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key(&"s".repeat(255), &"t".repeat(255));
    let dlq = key("dlq", "rejected");
    sink.set_partitions(&d, 1);
    const N: u64 = 50_000;
    for chunk in 0..N / 1000 {
        let records = (0..1000u64).map(|k| record(&d, chunk * 1000 + k, Partitioning::PartitionId(5))).collect();
        wal.append(records).await.unwrap();
    }
    let mut p = policy(OnAdmissionFailure::DeadLetter);
    p.batch.batch_max_records = N as usize;
    p.batch.batch_max_bytes = router::policy::MAX_BATCH_BYTES;
    // The whole run in one batch: queued whole (the linger waits for it).
    p.batch.linger = Duration::from_secs(10);
    p.lane_queue_max_records = N as usize;
    p.lane_queue_max_bytes = 128 << 20;
    let router = Router::start(wal, sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(p)).unwrap();
    eventually(Duration::from_secs(60), "dead-lettered", || sink.ids(&dlq).len() >= N as usize).await;
    assert_eq!(sink.ids(&dlq), (1..=u128::from(N)).collect::<Vec<_>>(), "lost, reordered or duplicated records");
    let wire = sink.wire_sizes(&dlq);
    assert!(wire.len() >= 2, "one send carried them all: {wire:?}");
    assert!(wire.iter().all(|&w| w <= router::SEND_MESSAGES_MAX_BYTES), "sends of {wire:?} bytes");
    router.shutdown().await;
}
