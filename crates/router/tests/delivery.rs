//! Delivery through the router with a fault-injecting destination double: routing by
//! destination, NACKs held through outages, breakers, overflow to the log, restarts.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use ingest::envelope::Partitioning;
use router::status::Status;
use router::test_doubles::MemoryCursorStore;
use router::{Policies, Router, SendErrorKind};
use support::*;
use wal::storage::SimStorage;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_destinations_each_get_their_records_in_log_order() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests = [key("app", "orders"), key("app", "users"), key("audit", "events")];
    let want = fill(&wal, &dests, 0, 300).await;
    let router = start_router(&wal, &sink, fast_policy());
    eventually(Duration::from_secs(20), "all delivered", || dests.iter().all(|d| sink.ids(d).len() == 100)).await;
    for d in &dests {
        assert_eq!(sink.ids(d), want[d], "{d}");
    }
    eventually(Duration::from_secs(20), "log released", || router.released_below() == 300).await;
    // Headers carry the envelope's details.
    let first = &sink.delivered(&dests[0])[0];
    assert!(first.headers.iter().any(|(k, v)| k == "iggy-ingest-source" && &v[..] == b"test"));
    assert!(first.headers.iter().any(|(k, v)| k == "x-n" && &v[..] == b"0"));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_black_holed_destination_opens_its_breaker_and_stalls_no_one_else() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let (good, bad) = (key("s", "good"), key("s", "bad"));
    let mut policy = fast_policy();
    policy.batch.result_timeout = Duration::from_millis(100);
    policy.lane_queue_max_records = 16; // the stuck lane overflows to the log quickly
    let router = start_router(&wal, &sink, policy);
    // Both destinations exist first, then the bad one goes dark.
    let mut want = fill(&wal, &[good.clone(), bad.clone()], 0, 2).await;
    eventually(Duration::from_secs(10), "warm", || sink.ids(&bad).len() == 1).await;
    sink.fault(&bad, Some(Fault::BlackHole));
    let more = fill(&wal, &[good.clone(), bad.clone()], 2, 2000).await;
    for (k, v) in more {
        want.get_mut(&k).unwrap().extend(v);
    }
    eventually(Duration::from_secs(30), "good destination fully delivered", || sink.ids(&good).len() == 1001).await;
    eventually(Duration::from_secs(30), "breaker open", || {
        router.destinations().iter().any(|d| d.destination == bad && d.breaker == "open")
    })
    .await;
    let snap = router.destinations().into_iter().find(|d| d.destination == bad).unwrap();
    assert_eq!(snap.held_records, 1000, "{snap:?}");
    assert!(snap.overflowed, "the stuck lane kept its records in memory");
    assert_eq!(snap.status, Status::Degraded);
    assert_eq!(router.status().status, Status::Degraded);
    // The log stays pinned at the bad destination's oldest record.
    assert!(router.released_below() <= 3);
    // It comes back: the probe after the cool-down succeeds and everything arrives in order.
    sink.fault(&bad, None);
    eventually(Duration::from_secs(60), "bad destination recovered", || sink.ids(&bad).len() >= 1001).await;
    assert_eq!(sink.ids(&bad), want[&bad], "lost, reordered or duplicated records");
    assert_eq!(sink.ids(&good), want[&good]);
    eventually(Duration::from_secs(10), "released", || router.released_below() == 2002).await;
    eventually(Duration::from_secs(10), "running", || router.status().status == Status::Running).await;
    let snap = router.destinations().into_iter().find(|d| d.destination == bad).unwrap();
    assert_eq!((snap.breaker, snap.status, snap.held_records), ("closed", Status::Running, 0));
    router.shutdown().await;
}

/// A server that stalls every write: one destination's sends and a new destination's
/// topic creation go unanswered alike. Each creation cut short is judged while the sink
/// is connecting (lanes cut short in step reconnect in step), which takes it for the
/// server's, not its destination's; it is still a write unanswered, and the two
/// together are a stall: no breaker opens. Unheard by the write watch, the sends'
/// destination looked silent alone and its breaker opened within three timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_whose_cut_calls_meet_a_reconnect_opens_no_breaker() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let (old, new) = (key("s", "old"), key("s", "new"));
    let mut policy = fast_policy();
    policy.batch.result_timeout = Duration::from_millis(300);
    policy.breaker.cool_down = Duration::from_secs(30);
    let router = start_router(&wal, &sink, policy);
    fill(&wal, std::slice::from_ref(&old), 0, 1).await;
    eventually(Duration::from_secs(10), "warm", || sink.ids(&old).len() == 1).await;
    sink.set_connecting_when_an_ensure_is_cut_short(true);
    sink.fault(&old, Some(Fault::BlackHole));
    sink.fault(&new, Some(Fault::BlackHole));
    fill(&wal, &[old.clone(), new.clone()], 1, 20).await;
    // Ten timeouts and more of each, three times the breaker's threshold.
    let until = std::time::Instant::now() + Duration::from_secs(4);
    let mut most_failures = 0;
    while std::time::Instant::now() < until {
        for d in router.destinations() {
            assert_eq!(d.breaker, "closed", "{}: a server stalling every write opened a breaker", d.destination);
            most_failures = most_failures.max(d.consecutive_failures);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(most_failures >= 3, "the stall was never met: {most_failures} failures at most");
    assert!(sink.ensured(&new) >= 3, "the new destination's creation was tried {} times", sink.ensured(&new));
    sink.fault(&old, None);
    sink.fault(&new, None);
    eventually(Duration::from_secs(30), "everything delivered", || {
        sink.ids(&old).len() == 11 && sink.ids(&new).len() == 10
    })
    .await;
    router.shutdown().await;
}

/// What a stuck lane keeps in memory is bounded by payload bytes as well as by records:
/// past `lane_queue_max_bytes` it re-reads the log instead, however few records that is,
/// and delivers everything in order once its destination answers. Stuck, not failing:
/// its send is in flight (a lane whose send failed keeps nothing queued at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_lane_overflows_to_the_log_at_its_byte_bound_before_its_record_bound() {
    for (max_bytes, overflows) in [(100, true), (8 << 20, false)] {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("s", "stuck");
        sink.fault(&d, Some(Fault::Slow(Duration::from_secs(3))));
        let mut policy = fast_policy();
        policy.batch.result_timeout = Duration::from_secs(20);
        policy.lane_queue_max_records = 4096;
        policy.lane_queue_max_bytes = max_bytes;
        let router = start_router(&wal, &sink, policy);
        let want = fill_fast(&wal, std::slice::from_ref(&d), 0, 300).await;
        eventually(Duration::from_secs(30), "all held", || {
            router.destinations().iter().any(|l| l.destination == d && l.held_records == 300)
        })
        .await;
        let lane = router.destinations().into_iter().find(|l| l.destination == d).unwrap();
        assert_eq!(lane.consecutive_failures, 0, "{lane:?}");
        assert_eq!(lane.overflowed, overflows, "{max_bytes} bytes: {lane:?}");
        sink.fault(&d, None);
        eventually(Duration::from_secs(60), "delivered", || sink.ids(&d).len() >= 300).await;
        assert_eq!(sink.ids(&d), want[&d], "lost, reordered or duplicated records");
        router.shutdown().await;
    }
}

/// A Degraded lane cannot say when it will send again: it gives what it queued back to
/// the log and queues nothing more until it delivers, whatever its queue's bounds, so
/// an outage of many destinations costs disk, not memory. A failure or two before that
/// (a blip) keeps its queue. Once its destination answers, it re-reads the records and
/// delivers each once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_degraded_lane_gives_its_queue_back_to_the_log() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "failing");
    // Answered after the result timeout: records queue behind the send until it fails.
    sink.fault(&d, Some(Fault::Slow(Duration::from_secs(30))));
    let mut policy = fast_policy();
    policy.batch.result_timeout = Duration::from_secs(2);
    policy.batch.degraded_after_failures = 3;
    policy.breaker.failure_threshold = 100;
    let router = start_router(&wal, &sink, policy);
    let lane = || router.destinations().into_iter().find(|l| l.destination == d).unwrap();
    let mut want = fill(&wal, std::slice::from_ref(&d), 0, 300).await;
    eventually(Duration::from_secs(10), "all held", || {
        router.destinations().iter().any(|l| l.destination == d && l.held_records == 300)
    })
    .await;
    let queued = lane();
    assert!(queued.queued_bytes > 0 && !queued.overflowed, "nothing queued behind the send: {queued:?}");
    // The batch in flight was taken from the queue: it counts until its delivery ends.
    assert_eq!(router.queued_bytes().0, queued.queued_bytes + queued.batch_bytes);
    // One failure or two (a loaded machine may look late): fewer than make it Degraded.
    eventually(Duration::from_secs(10), "the send failed", || (1..3).contains(&lane().consecutive_failures)).await;
    let blip = lane();
    assert_ne!(blip.status, Status::Degraded, "{blip:?}");
    assert_eq!((blip.queued_bytes, blip.overflowed), (queued.queued_bytes, false), "{blip:?}");
    sink.fault(&d, Some(Fault::Fail(SendErrorKind::Destination)));
    eventually(Duration::from_secs(10), "degraded", || lane().status == Status::Degraded).await;
    let failed = lane();
    assert_eq!((failed.queued_bytes, failed.overflowed, failed.held_records), (0, true, 300), "{failed:?}");
    // Its batch is counted out as it parks, just after the lane turned Degraded.
    eventually(Duration::from_secs(10), "nothing counted", || router.queued_bytes().0 == 0).await;
    // Records that arrive while it fails are not queued either.
    want.get_mut(&d).unwrap().extend(fill(&wal, std::slice::from_ref(&d), 300, 100).await.remove(&d).unwrap());
    eventually(Duration::from_secs(10), "all held", || lane().held_records == 400).await;
    assert_eq!(lane().queued_bytes, 0, "{:?}", lane());
    sink.fault(&d, None);
    eventually(Duration::from_secs(60), "delivered", || sink.ids(&d).len() >= 400).await;
    assert_eq!(sink.ids(&d), want[&d], "lost, reordered or duplicated records");
    // Delivering again, it queues again.
    want.get_mut(&d).unwrap().extend(fill(&wal, std::slice::from_ref(&d), 400, 100).await.remove(&d).unwrap());
    eventually(Duration::from_secs(30), "delivered", || sink.ids(&d).len() >= 500).await;
    assert_eq!(sink.ids(&d), want[&d], "lost, reordered or duplicated records");
    eventually(Duration::from_secs(10), "queueing again", || !lane().overflowed).await;
    router.shutdown().await;
}

/// A lane that re-reads the log (here after it was Degraded) queues again once its
/// re-read caught up with the dispatcher, while its destination goes on receiving: its
/// traffic need not stop first. Waiting for a re-read that found nothing, a lane whose
/// sends take longer than its records take to come kept re-reading the log (and
/// summarising every other destination's records again) for as long as they came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_re_reading_the_log_queues_again_under_steady_traffic() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "busy");
    sink.fault(&d, Some(Fault::Fail(SendErrorKind::Destination)));
    let mut policy = fast_policy();
    policy.breaker.failure_threshold = 100;
    let router = start_router(&wal, &sink, policy);
    let lane = || router.destinations().into_iter().find(|l| l.destination == d);
    let mut want = fill(&wal, std::slice::from_ref(&d), 0, 50).await.remove(&d).unwrap();
    eventually(Duration::from_secs(10), "degraded", || lane().is_some_and(|l| l.status == Status::Degraded)).await;
    // Records that come while it is Degraded are left in the log, re-read once it sends.
    want.extend(fill(&wal, std::slice::from_ref(&d), 50, 50).await.remove(&d).unwrap());
    eventually(Duration::from_secs(10), "re-reading the log", || lane().is_some_and(|l| l.overflowed)).await;
    // It answers again, each send taking far longer than the records take to come (a
    // record every 5 ms, a send 300 ms): only a stall of the appends longer than a send
    // would let a re-read find nothing.
    sink.fault(&d, Some(Fault::Slow(Duration::from_millis(300))));
    let mut next = 100u64;
    let mut queueing_again_at = None;
    let until = tokio::time::Instant::now() + Duration::from_secs(8);
    while tokio::time::Instant::now() < until {
        want.extend(fill(&wal, std::slice::from_ref(&d), next, 1).await.remove(&d).unwrap());
        next += 1;
        if queueing_again_at.is_none() && lane().is_some_and(|l| !l.overflowed && l.status != Status::Degraded) {
            queueing_again_at = Some(next);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let at = queueing_again_at;
    assert!(at.is_some(), "the lane never queued again while records came ({next} appended): {:?}", lane());
    eventually(Duration::from_secs(30), "delivered", || sink.ids(&d).len() >= want.len()).await;
    assert_eq!(sink.ids(&d), want, "lost, reordered or duplicated records");
    router.shutdown().await;
}

/// What all lanes of a router keep queued is bounded as a whole (`queues_max_bytes`),
/// not only lane by lane: with twenty destinations whose sends are in flight, each
/// lane's own 32 KiB would let them queue twenty times the router's 32 KiB (every
/// record of this test, which needs over 1 MB queued); under the router's bound the
/// rest stays in the log, re-read by each lane, and all of it is delivered in order
/// once they answer, the budget given back in full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_lanes_of_a_router_keep_no_more_queued_than_its_bound() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests: Vec<_> = (0..20).map(|i| key("s", &format!("d{i}"))).collect();
    for d in &dests {
        sink.fault(d, Some(Fault::Slow(Duration::from_secs(3))));
    }
    let mut policy = fast_policy();
    policy.batch.result_timeout = Duration::from_secs(20);
    policy.max_concurrent_destinations = 20;
    policy.lane_queue_max_bytes = 32 * 1024;
    let mut policies = Policies::uniform(policy);
    policies.queues_max_bytes = 32 * 1024;
    let router = start_router_with(&wal, &sink, policies);
    let mut most_queued = 0;
    let want = fill_fast(&wal, &dests, 0, 4000).await;
    eventually(Duration::from_secs(30), "all held", || {
        most_queued = most_queued.max(router.queued_bytes().0);
        router.destinations().iter().map(|l| l.held_records).sum::<u64>() == 4000
    })
    .await;
    let lanes = router.destinations();
    let (queued, max) = router.queued_bytes();
    assert_eq!(max, 32 * 1024);
    assert!(most_queued > 0 && queued <= max, "{most_queued} bytes queued at most, {queued} now");
    // The budget counts the queues, and the batches taken from them until their
    // deliveries end (not those a lane read from the log).
    let queues: usize = lanes.iter().map(|l| l.queued_bytes).sum();
    let batches: usize = lanes.iter().map(|l| l.batch_bytes).sum();
    assert!(queues <= queued && queued <= queues + batches, "{queued}: {lanes:?}");
    assert!(lanes.iter().any(|l| l.overflowed), "no lane re-reads the log: {lanes:?}");
    for d in &dests {
        sink.fault(d, None);
    }
    eventually(Duration::from_secs(60), "delivered", || dests.iter().all(|d| sink.ids(d).len() >= 200)).await;
    assert_delivered_in_order(&sink, &dests, &want);
    eventually(Duration::from_secs(10), "the budget given back", || router.queued_bytes().0 == 0).await;
    router.shutdown().await;
}

/// An open breaker sends nothing for its cool-down: the destination is Degraded (and the
/// router with it) from the moment it opens, even when that is before
/// `degraded_after_failures` failures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_whose_breaker_opened_is_degraded_whatever_the_failure_count() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "opens-early");
    sink.fault(&d, Some(Fault::Fail(SendErrorKind::Destination)));
    let mut policy = fast_policy();
    policy.breaker.failure_threshold = 1;
    policy.batch.degraded_after_failures = 5;
    policy.breaker.cool_down = Duration::from_secs(60);
    let router = start_router(&wal, &sink, policy);
    fill(&wal, std::slice::from_ref(&d), 0, 1).await;
    eventually(Duration::from_secs(30), "breaker open", || {
        router.destinations().iter().any(|l| l.destination == d && l.breaker == "open")
    })
    .await;
    let lane = router.destinations().into_iter().find(|l| l.destination == d).unwrap();
    assert_eq!((lane.consecutive_failures, lane.status), (1, Status::Degraded), "{lane:?}");
    assert_eq!(router.status().status, Status::Degraded);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_wide_outage_holds_everything_and_opens_no_breaker() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests = [key("a", "1"), key("a", "2"), key("b", "1")];
    let mut policy = fast_policy();
    policy.lane_queue_max_records = 32;
    let router = start_router(&wal, &sink, policy);
    sink.client_fault(Some(SendErrorKind::Unavailable));
    let want = fill(&wal, &dests, 0, 600).await;
    eventually(Duration::from_secs(30), "degraded", || router.status().status == Status::Degraded).await;
    // Hold for a while: retries continue, nothing is dropped, no breaker opens.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(router.destinations().len(), dests.len(), "a lane is missing from the snapshot");
    for d in router.destinations() {
        assert_eq!(d.breaker, "closed", "{}", d.destination);
        assert_eq!(d.held_records, 200);
    }
    assert_eq!(router.released_below(), 0);
    sink.client_fault(None);
    eventually(Duration::from_secs(30), "all delivered", || dests.iter().all(|d| sink.ids(d).len() == 200)).await;
    for d in &dests {
        assert_eq!(sink.ids(d), want[d]);
    }
    eventually(Duration::from_secs(10), "running", || router.status().status == Status::Running).await;
    router.shutdown().await;
}

/// An outage keeps no batch in memory once its lanes are Degraded, however many
/// destinations it hits: each lane's batch (and the one prepared after it) waits in the
/// log, 40 bytes a record kept to read it back from its place at the next try. Every
/// try still sends (the batch read back each time), and once the outage ends every
/// record is delivered in log order, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_keeps_the_batches_of_degraded_lanes_in_the_log_not_in_memory() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests: Vec<_> = (0..24).map(|i| key("s", &format!("d{i}"))).collect();
    let mut policy = fast_policy();
    policy.batch.batch_max_records = 40;
    policy.batch.backoff_max = Duration::from_millis(400);
    let router = start_router(&wal, &sink, policy);
    // Records queue behind a first send that is slow to fail: every lane has a batch
    // in flight, full ones queued after it.
    sink.client_fault(Some(SendErrorKind::Unavailable));
    let want = fill(&wal, &dests, 0, 24 * 100).await;
    let lanes = || router.destinations();
    eventually(Duration::from_secs(30), "every lane degraded", || {
        let l = lanes();
        l.len() == dests.len() && l.iter().all(|l| l.status == Status::Degraded && l.held_records == 100)
    })
    .await;
    eventually(Duration::from_secs(10), "no batch in memory", || {
        lanes().iter().all(|l| l.batch_bytes == 0 && l.queued_bytes == 0)
    })
    .await;
    // The tries go on, each batch read back from the log for its try, and given back
    // again: sampled while they do, no lane keeps a batch.
    let tries = || dests.iter().map(|d| sink.calls(d) + sink.ensured(d)).sum::<u64>();
    let calls = tries();
    let mut kept = Vec::new();
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        kept.extend(lanes().into_iter().filter(|l| l.batch_bytes > 0 || l.queued_bytes > 0).map(|l| l.destination));
    }
    let later = tries();
    assert!(later >= calls + dests.len() as u64, "tries stopped while parked: {calls} then {later} calls");
    // A lane is seen with its batch only for the moment of a try.
    assert!(kept.len() <= dests.len(), "batches kept in memory between tries: {kept:?}");
    assert_eq!(router.queued_bytes().0, 0);
    sink.client_fault(None);
    eventually(Duration::from_secs(30), "all delivered", || dests.iter().all(|d| sink.ids(d).len() >= 100)).await;
    assert_delivered_in_order(&sink, &dests, &want);
    eventually(Duration::from_secs(10), "log released", || router.released_below() == 2400).await;
    for l in lanes() {
        assert_eq!((l.held_records, l.batch_bytes, l.queued_bytes), (0, 0, 0), "{l:?}");
    }
    router.shutdown().await;
}

/// Parked batches are read back no faster than their tries can go out: a source's
/// failing lanes send one at a time per failing slot (here one), and through a server
/// that does not answer each try takes a whole result timeout. Read back at the end of
/// each backoff, every lane would wait its turn with its batch in memory again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_batches_are_read_back_only_as_fast_as_their_tries_go_out() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests: Vec<_> = (0..12).map(|i| key("s", &format!("silent{i}"))).collect();
    let mut policy = fast_policy();
    policy.max_concurrent_destinations = 2;
    policy.batch.result_timeout = Duration::from_millis(300);
    policy.batch.backoff_max = Duration::from_millis(200);
    policy.breaker.failure_threshold = 1000;
    let router = start_router(&wal, &sink, policy);
    for d in &dests {
        sink.fault(d, Some(Fault::BlackHole));
    }
    let want = fill(&wal, &dests, 0, 12 * 30).await;
    eventually(Duration::from_secs(60), "every lane degraded", || {
        let l = router.destinations();
        l.len() == dests.len() && l.iter().all(|l| l.status == Status::Degraded)
    })
    .await;
    let mut most_in_memory = 0;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let in_memory = router.destinations().iter().filter(|l| l.batch_bytes > 0).count();
        most_in_memory = most_in_memory.max(in_memory);
    }
    assert!(most_in_memory <= 1, "{most_in_memory} batches in memory with one failing slot");
    for d in &dests {
        sink.fault(d, None);
    }
    eventually(Duration::from_secs(60), "all delivered", || dests.iter().all(|d| sink.ids(d).len() >= 30)).await;
    assert_delivered_in_order(&sink, &dests, &want);
    router.shutdown().await;
}

/// Lanes re-reading the log read their batches no faster than their source's send
/// slots take them (twice as many as it has slots, so that reads overlap sends): after
/// an outage, a thousand lanes catching up would otherwise each read a batch and wait
/// for a slot with it in memory. Here every record goes to the
/// log (a router budget of one byte queues none), twelve destinations answer slowly,
/// and their source has two send slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_catching_up_read_their_batches_only_as_fast_as_the_send_slots_take_them() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests: Vec<_> = (0..12).map(|i| key("s", &format!("slow{i}"))).collect();
    for d in &dests {
        sink.fault(d, Some(Fault::Slow(Duration::from_millis(150))));
    }
    let mut policy = fast_policy();
    policy.max_concurrent_destinations = 2;
    policy.batch.batch_max_records = 10;
    policy.lane_queue_max_bytes = 1;
    let mut policies = Policies::uniform(policy);
    policies.queues_max_bytes = 1;
    let router = start_router_with(&wal, &sink, policies);
    let want = fill(&wal, &dests, 0, 12 * 40).await;
    let mut most_in_memory = 0;
    while !dests.iter().all(|d| sink.ids(d).len() >= 40) {
        let lanes = router.destinations();
        assert!(lanes.iter().all(|l| l.queued_bytes == 0), "{lanes:?}");
        most_in_memory = most_in_memory.max(lanes.iter().filter(|l| l.batch_bytes > 0).count());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(most_in_memory >= 1, "no batch was ever seen");
    // Twice the slots: a batch is read while another's send is in flight.
    assert!(most_in_memory <= 4, "{most_in_memory} batches in memory with two send slots");
    assert_delivered_in_order(&sink, &dests, &want);
    router.shutdown().await;
}

/// A batch a lane took from its own queue stays counted in the router's queue budget
/// until its delivery ends: forty destinations with a batch each queued behind their
/// source's two slots keep in memory what `queues_max_bytes` allows and what the
/// catch-up leaves hold, not a batch per destination. Each destination's records are appended together, so
/// its queue fills a whole batch (or two: the second is the one a lane prepares ahead)
/// before the next destination's records come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_waiting_for_a_send_slot_are_counted_in_the_routers_queue_budget() {
    for batches_per_destination in [1, 2] {
        batches_waiting_for_a_send_slot_within_the_budget(batches_per_destination).await;
    }
}

async fn batches_waiting_for_a_send_slot_within_the_budget(batches_per_destination: u64) {
    let dests: Vec<_> = (0..40).map(|i| key("s", &format!("slow{i:02}"))).collect();
    let mut policy = fast_policy();
    policy.max_concurrent_destinations = 2;
    policy.batch.batch_max_records = 10;
    // One record's size as a lane counts it (a record of the same shape: the same
    // stream, a topic name of the same length, a number of at most two digits more, in
    // its payload and, counted twice, its header).
    let record_bytes = {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        sink.fault(&dests[0], Some(Fault::Slow(Duration::from_millis(300))));
        let router = start_router(&wal, &sink, policy.clone());
        fill(&wal, std::slice::from_ref(&dests[0]), 0, 1).await;
        let mut bytes = 0;
        eventually(Duration::from_secs(10), "a batch of one record in flight", || {
            bytes = router.destinations().iter().map(|l| l.batch_bytes).max().unwrap_or(0);
            bytes > 0
        })
        .await;
        router.shutdown().await;
        bytes + 6
    };
    let full_batch_bytes = 10 * record_bytes;
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    for d in &dests {
        sink.fault(d, Some(Fault::Slow(Duration::from_millis(100))));
    }
    let mut want = BTreeMap::new();
    let per_destination = 10 * batches_per_destination;
    for (i, d) in dests.iter().enumerate() {
        want.extend(fill(&wal, std::slice::from_ref(d), per_destination * i as u64, per_destination).await);
    }
    policy.lane_queue_max_bytes = 8 * full_batch_bytes;
    let mut policies = Policies::uniform(policy);
    policies.queues_max_bytes = 8 * full_batch_bytes;
    let router = start_router_with(&wal, &sink, policies);
    // In memory at most: what the budget counts (queued, or in a batch taken from a
    // queue), and the batches of the four lanes holding a catch-up leave; and one more
    // per slot, of a lane whose send just ended and whose figure is not yet updated.
    // (Given back to the budget as they were taken, batches waiting for a slot reached
    // 19 to 40 here.)
    let bound = (8 + 4 + 2) * full_batch_bytes;
    let mut most_in_batches = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !dests.iter().all(|d| sink.ids(d).len() >= per_destination as usize) {
        assert!(tokio::time::Instant::now() < deadline, "not delivered within a minute");
        let in_batches: usize = router.destinations().iter().map(|l| l.batch_bytes).sum();
        most_in_batches = most_in_batches.max(in_batches);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(most_in_batches >= full_batch_bytes, "no full batch was ever seen: {most_in_batches}");
    assert!(
        most_in_batches <= bound,
        "{batches_per_destination} batches a destination: {most_in_batches} bytes in batches, {} batches of {full_batch_bytes}; at most {bound}",
        most_in_batches as f64 / full_batch_bytes as f64
    );
    assert_delivered_in_order(&sink, &dests, &want);
    router.shutdown().await;
}

/// Batches a lane took from its queue count in the router's budget until their
/// deliveries end: the one waiting for a send slot, the one it prepared after it
/// meanwhile, and one in flight, as the records they were while queued. Here one
/// destination holds its source's only slot with a slow send while another, idle until
/// then, gets two batches' worth of records at once; once all is delivered, nothing is
/// counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_taken_from_a_queue_count_in_the_routers_budget_until_their_deliveries_end() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let (slow, waiting) = (key("s", "slow"), key("s", "waits"));
    sink.fault(&slow, Some(Fault::Slow(Duration::from_millis(1_500))));
    let mut policy = fast_policy();
    policy.max_concurrent_destinations = 1;
    policy.batch.batch_max_records = 10;
    // A lane woken by the first of the twenty fills its batch from the queue within this.
    policy.batch.linger = Duration::from_millis(50);
    let router = start_router(&wal, &sink, policy);
    let lane = |d: &router::DestinationKey| router.destinations().into_iter().find(|l| l.destination == *d);
    let mut want = fill(&wal, std::slice::from_ref(&waiting), 0, 1).await;
    eventually(Duration::from_secs(10), "the idle lane's first record", || sink.ids(&waiting).len() == 1).await;
    fill(&wal, std::slice::from_ref(&slow), 1, 1).await;
    eventually(Duration::from_secs(10), "the slow send in flight", || sink.calls(&slow) >= 1).await;
    // One append: the log's reader routes all twenty at once.
    wal.append((2..22).map(|n| record(&waiting, n, Partitioning::Balanced)).collect()).await.unwrap();
    want.get_mut(&waiting).unwrap().extend((2..22u64).map(|n| u128::from(n) + 1));
    eventually(Duration::from_secs(10), "a batch taken, waiting for the slot", || {
        lane(&waiting).is_some_and(|l| l.held_records == 20 && l.batch_bytes > 0)
    })
    .await;
    let (w, s) = (lane(&waiting).unwrap(), lane(&slow).unwrap());
    assert!(sink.ids(&slow).is_empty(), "the slow send ended before the look");
    assert!(s.batch_bytes > 0, "{s:?}");
    // The waiting batch (and the one prepared after it, if taken), what is still queued,
    // and the batch in flight.
    assert_eq!(router.queued_bytes().0, w.queued_bytes + w.batch_bytes + s.batch_bytes, "{w:?} {s:?}");
    eventually(Duration::from_secs(20), "delivered", || sink.ids(&waiting).len() == 21).await;
    assert_eq!(sink.ids(&waiting), want[&waiting], "lost, reordered or duplicated records");
    eventually(Duration::from_secs(10), "nothing counted", || router.queued_bytes().0 == 0).await;
    router.shutdown().await;
}

/// A batch the lane read from the log waits out a failed try there from the first
/// failure, not only once the lane is Degraded: it costs no memory there and no scan to
/// read back. (A batch from the lane's queue rides out a blip in memory.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_read_from_the_log_waits_there_from_its_first_failed_try() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "refusing");
    sink.fault(&d, Some(Fault::FailSends(SendErrorKind::Unavailable)));
    let mut policy = fast_policy();
    policy.batch.degraded_after_failures = 1_000;
    policy.breaker.failure_threshold = 1_000;
    policy.lane_queue_max_bytes = 1;
    let mut policies = Policies::uniform(policy);
    policies.queues_max_bytes = 1;
    let router = start_router_with(&wal, &sink, policies);
    let want = fill(&wal, std::slice::from_ref(&d), 0, 50).await;
    let lane = || router.destinations().into_iter().find(|l| l.destination == d).unwrap();
    eventually(Duration::from_secs(20), "failing", || lane().consecutive_failures >= 4).await;
    let mut seen_in_memory = 0;
    for _ in 0..20 {
        let l = lane();
        assert_ne!(l.status, Status::Degraded, "{l:?}");
        seen_in_memory += usize::from(l.batch_bytes > 0);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(seen_in_memory <= 2, "the batch stayed in memory between tries: {seen_in_memory} of 20 samples");
    sink.fault(&d, None);
    eventually(Duration::from_secs(20), "delivered", || sink.ids(&d).len() >= 50).await;
    assert_eq!(sink.ids(&d), want[&d], "lost, reordered or duplicated records");
    router.shutdown().await;
}

/// A batch parked before its lane is Degraded leaves the lane queueing; what it queued
/// meanwhile lies after the parked batch and after the one prepared ahead of it, and if
/// that try fails too, both go to the log in that order: nothing queued is sent before
/// them (its acknowledgement would pass over them, and their re-read skip them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_lane_queues_while_its_batch_is_parked_goes_after_that_batch() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "three-partitions");
    let mut policy = fast_policy();
    policy.batch.batch_max_records = 20;
    policy.batch.linger = Duration::from_millis(200);
    policy.batch.backoff_base = Duration::from_secs(1);
    policy.batch.backoff_max = Duration::from_secs(2);
    policy.batch.degraded_after_failures = 3;
    policy.breaker.failure_threshold = 1_000;
    let router = start_router(&wal, &sink, policy);
    let lane = || router.destinations().into_iter().find(|l| l.destination == d);
    let ids = |range: std::ops::Range<u64>| range.map(|n| u128::from(n) + 1).collect::<Vec<_>>();
    // One batch, five records for partition 0 then five for partition 1, parked once
    // the lane is Degraded.
    sink.fault(&d, Some(Fault::FailSends(SendErrorKind::Unavailable)));
    let first: Vec<_> =
        (0..10u64).map(|n| record(&d, n, Partitioning::PartitionId(if n < 5 { 0 } else { 1 }))).collect();
    wal.append(first).await.unwrap();
    eventually(Duration::from_secs(20), "parked, degraded", || {
        lane().is_some_and(|l| l.status == Status::Degraded && l.batch_bytes == 0)
    })
    .await;
    // Read back, its first run goes out (the lane Running again) and its second fails:
    // parked again, one failure in, not Degraded.
    sink.fault(&d, Some(Fault::FailSendsToPartition(1, SendErrorKind::Unavailable)));
    eventually(Duration::from_secs(20), "the first run sent", || sink.ids(&d).len() == 5).await;
    // Meanwhile the lane queues: more than a batch.
    let more: Vec<_> = (10..40u64).map(|n| record(&d, n, Partitioning::PartitionId(2))).collect();
    wal.append(more).await.unwrap();
    // The next try takes a batch of those ahead, and fails again: parked, not Degraded.
    eventually(Duration::from_secs(20), "failed again", || lane().is_some_and(|l| l.consecutive_failures >= 2)).await;
    assert_ne!(lane().map(|l| l.status), Some(Status::Degraded));
    sink.fault(&d, None);
    eventually(Duration::from_secs(20), "all delivered", || sink.ids(&d).len() >= 40).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sink.ids(&d), ids(0..40), "lost, reordered or duplicated records");
    router.shutdown().await;
}

/// A batch whose first run of messages was acknowledged and whose next one fails until
/// the lane is Degraded is parked from the failing run: what was acknowledged counts as
/// delivered (the cursor moves past it, the lane holds only the rest), and it is not
/// sent again when the rest goes out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_parked_halfway_counts_its_acknowledged_run_delivered_and_sends_it_once() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "two-partitions");
    let mut policy = fast_policy();
    policy.batch.linger = Duration::from_millis(200);
    let router = start_router(&wal, &sink, policy);
    sink.fault(&d, Some(Fault::FailSendsToPartition(1, SendErrorKind::Unavailable)));
    // One batch: ten records for partition 0, then ten for partition 1, in one append
    // (twenty appends may not all come within one linger on a loaded machine).
    let records = (0..20u64).map(|n| record(&d, n, Partitioning::PartitionId(if n < 10 { 0 } else { 1 }))).collect();
    wal.append(records).await.unwrap();
    let want: Vec<u128> = (1..=20).collect();
    let lane = || router.destinations().into_iter().find(|l| l.destination == d);
    eventually(Duration::from_secs(30), "parked from the failing run", || {
        lane().is_some_and(|l| {
            l.status == Status::Degraded && l.held_records == 10 && l.batch_bytes == 0 && l.delivered_below == 10
        })
    })
    .await;
    assert_eq!(sink.ids(&d), want[..10], "the acknowledged run");
    assert_eq!(sink.send_sizes(&d)[0].0, 10, "one batch, its first run sent alone");
    sink.fault(&d, None);
    eventually(Duration::from_secs(30), "all delivered", || sink.ids(&d).len() >= 20).await;
    assert_eq!(sink.ids(&d), want, "the first run sent again, or a record lost");
    eventually(Duration::from_secs(10), "log released", || router.released_below() == 20).await;
    router.shutdown().await;
}

/// Destinations that never answer cannot take every send slot of their source: while
/// they fail, they hold at most half of them, so a healthy destination of the same
/// source is never queued behind their result timeouts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_destinations_leave_a_healthy_one_of_their_source_a_send_slot() {
    a_healthy_destination_waits_for_no_failing_one(false).await;
}

/// The same with every record re-read from the log (a router budget of one byte queues
/// none): a failing lane gives back its leave to read from the log at its first failure,
/// so failing lanes waiting out their retries never hold a healthy lane's read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_destinations_re_reading_the_log_leave_a_healthy_one_its_reads() {
    a_healthy_destination_waits_for_no_failing_one(true).await;
}

/// Four destinations of one source that never answer and a healthy one beside them, on
/// two send slots, a 2 s result timeout and a short backoff: the log (on `sim`), the sink,
/// the silent ones, the healthy one and the policy.
fn silent_ones_beside_a_good_one(
    sim: &SimStorage,
) -> (Arc<wal::Wal>, Arc<FaultySink>, Vec<router::DestinationKey>, router::DestinationKey, router::RouterPolicy) {
    let wal = open_wal(sim);
    let sink = FaultySink::new();
    let bad: Vec<_> = (0..4).map(|i| key("slots", &format!("silent-{i}"))).collect();
    let good = key("slots", "good");
    for d in &bad {
        sink.fault(d, Some(Fault::BlackHole));
    }
    let mut policy = fast_policy();
    policy.max_concurrent_destinations = 2;
    // Long beside the bounds the tests hold the good destination to (2.5 s), so that a
    // loaded machine does not blur the two.
    policy.batch.result_timeout = Duration::from_secs(5);
    policy.batch.backoff_base = Duration::from_millis(10);
    policy.batch.backoff_max = Duration::from_millis(50);
    (wal, sink, bad, good, policy)
}

async fn a_healthy_destination_waits_for_no_failing_one(all_in_log: bool) {
    let sim = SimStorage::new();
    let (wal, sink, bad, good, mut policy) = silent_ones_beside_a_good_one(&sim);
    // The bad ones keep retrying in memory, not degraded, instead of resting behind an
    // open breaker or parked.
    policy.breaker.failure_threshold = 1_000;
    policy.batch.degraded_after_failures = 1_000;
    if all_in_log {
        policy.lane_queue_max_bytes = 1;
    }
    let mut policies = Policies::uniform(policy);
    if all_in_log {
        policies.queues_max_bytes = 1;
    }
    fill(&wal, &bad, 0, 4).await;
    let router = start_router_with(&wal, &sink, policies);
    // Every bad destination has timed out at least once (its second call has begun).
    eventually(Duration::from_secs(60), "every bad destination failed once", || {
        bad.iter().all(|d| sink.calls(d) + sink.ensured(d) >= 2)
    })
    .await;
    let mut slowest = Duration::ZERO;
    for n in 0..5u64 {
        let appended = std::time::Instant::now();
        wal.append(vec![record(&good, 100 + n, Partitioning::Balanced)]).await.unwrap();
        eventually(Duration::from_secs(10), "good delivered", || sink.ids(&good).len() == n as usize + 1).await;
        slowest = slowest.max(appended.elapsed());
    }
    // Well below the bad destinations' 5 s result timeout.
    assert!(slowest < Duration::from_millis(2500), "a record for the healthy destination waited {slowest:?}");
    router.shutdown().await;
}

/// A server restart fails every lane's call at once (a dropped connection), the healthy
/// destination's and the silent ones' alike. That says nothing of how long the healthy
/// one's next try holds a send slot: after the restart it is not queued behind the silent
/// destinations' result timeouts, neither for a slot nor, its batch parked meanwhile, for
/// the leave to read it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_destination_that_shared_an_outage_waits_for_no_silent_one_after_it() {
    a_healthy_destination_that_shared_an_outage_waits_for_no_silent_one(false).await;
}

/// The same with every lane parked at its first failure (Degraded at once): the healthy
/// destination's batch is read back without waiting for the silent ones' read-backs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_destination_parked_in_an_outage_reads_back_without_waiting_for_silent_ones() {
    a_healthy_destination_that_shared_an_outage_waits_for_no_silent_one(true).await;
}

async fn a_healthy_destination_that_shared_an_outage_waits_for_no_silent_one(parked: bool) {
    let sim = SimStorage::new();
    let (wal, sink, bad, good, mut policy) = silent_ones_beside_a_good_one(&sim);
    policy.breaker.failure_threshold = 1_000;
    policy.batch.degraded_after_failures = if parked { 1 } else { 1_000 };
    fill(&wal, &bad, 0, 4).await;
    let router = start_router(&wal, &sink, policy);
    eventually(Duration::from_secs(60), "every silent destination failed once", || {
        bad.iter().all(|d| sink.calls(d) + sink.ensured(d) >= 2)
    })
    .await;
    wal.append(vec![record(&good, 100, Partitioning::Balanced)]).await.unwrap();
    eventually(Duration::from_secs(10), "good delivered", || sink.ids(&good).len() == 1).await;
    // The restart: every call fails at once, the good destination's included.
    sink.client_fault(Some(SendErrorKind::Disconnected));
    let calls_before = sink.calls(&good) + sink.ensured(&good);
    wal.append(vec![record(&good, 101, Partitioning::Balanced)]).await.unwrap();
    eventually(Duration::from_secs(10), "the good destination failed in the outage", || {
        sink.calls(&good) + sink.ensured(&good) > calls_before
    })
    .await;
    if parked {
        let lane = || router.destinations().into_iter().find(|l| l.destination == good);
        eventually(Duration::from_secs(10), "the good destination parked", || {
            lane().is_some_and(|l| l.status == Status::Degraded && l.batch_bytes == 0)
        })
        .await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let back = std::time::Instant::now();
    sink.client_fault(None);
    eventually(Duration::from_secs(20), "good delivered after the outage", || sink.ids(&good).len() == 2).await;
    let waited = back.elapsed();
    // Well below the silent destinations' 5 s result timeout: behind them, it waits for
    // at least one of their tries to end.
    assert!(waited < Duration::from_millis(2500), "after the outage, the healthy destination waited {waited:?}");
    router.shutdown().await;
}

/// A destination that answers every send, only slowly, must not pace the log's single
/// reader, and with it every other destination. Each of its waits for room in its full
/// queue is short (it takes a batch every 50 ms), but together they last: once its
/// queue has stayed full past `overflow_after`, it re-reads the log at its own pace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_but_healthy_destination_does_not_pace_the_others() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let (slow, fast) = (key("pace", "slow"), key("pace", "fast"));
    sink.fault(&slow, Some(Fault::Slow(Duration::from_millis(100))));
    let mut policy = fast_policy();
    policy.batch.batch_max_records = 8;
    policy.lane_queue_max_records = 32;
    policy.overflow_after = Duration::from_millis(100);
    // 1000 records each, alternating: the slow one takes 80 a second.
    fill(&wal, &[slow.clone(), fast.clone()], 0, 2000).await;
    let started = std::time::Instant::now();
    let router = start_router(&wal, &sink, policy);
    eventually(Duration::from_secs(30), "fast delivered", || sink.ids(&fast).len() == 1000).await;
    let took = started.elapsed();
    let slow_done = sink.ids(&slow).len();
    // Paced by the slow one, the fast one would take about as long: over 12 s. Unpaced it
    // takes well under a second; the bound leaves room for a loaded machine.
    assert!(took < Duration::from_secs(6), "the fast destination took {took:?} (the slow one had {slow_done})");
    assert!(slow_done < 1000, "the slow destination was not slower: {slow_done} in {took:?}");
    eventually(Duration::from_secs(60), "slow delivered", || sink.ids(&slow).len() == 1000).await;
    let want: Vec<u128> = (0..1000u128).map(|i| 2 * i + 1).collect();
    assert_eq!(sink.ids(&slow), want, "the slow destination's records, in order, once each");
    router.shutdown().await;
}

/// The log's reader waiting for room in a slow lane's full queue (`overflow_after` may be
/// up to a day) stops waiting when the router stops: the lane ends and would never make
/// room, and the router's stop, which waits for the reader, would outlast any grace
/// period. A new router delivers every record from the start, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_stops_at_once_while_its_reader_waits_for_room_in_a_lane() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("wait", "slow");
    sink.fault(&d, Some(Fault::Slow(Duration::from_millis(200))));
    let mut policy = fast_policy();
    policy.batch.batch_max_records = 1;
    policy.lane_queue_max_records = 2;
    policy.overflow_after = Duration::from_secs(3600);
    let want = fill(&wal, std::slice::from_ref(&d), 0, 50).await;
    let router = start_router(&wal, &sink, policy.clone());
    // The queue is full and the reader waits on it: the lane takes a record every 200 ms.
    eventually(Duration::from_secs(10), "two delivered", || sink.ids(&d).len() >= 2).await;
    let stop = tokio::time::timeout(Duration::from_secs(20), router.shutdown()).await;
    assert!(stop.is_ok(), "the router did not stop while its reader waited for a full lane");
    let delivered = sink.ids(&d).len();
    assert!(delivered < 50, "every record was delivered before the stop ({delivered}): nothing waited");
    sink.fault(&d, None);
    let router = start_router(&wal, &sink, policy);
    // It delivers from the log's start (what the first released, it had delivered).
    eventually(Duration::from_secs(20), "the rest delivered", || sink.ids(&d).last() == want[&d].last()).await;
    let ids = sink.ids(&d);
    assert!(want[&d].iter().all(|id| ids.contains(id)), "a record was lost: {ids:?}");
    let again = &ids[delivered..];
    let from = want[&d].iter().position(|id| *id == again[0]).expect("a record of the log");
    assert_eq!(again, &want[&d][from..], "the new router's deliveries, in order, once each");
    router.shutdown().await;
}

/// A destination that can never be delivered pins the log at its first record, however
/// well the others go. Given up by the operator, its records are dropped, no send is
/// made for them, and the log is released past them; the others are delivered as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_up_destination_stops_pinning_the_log_and_the_others_are_delivered() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let (good, bad) = (key("give", "good"), key("give", "bad"));
    sink.fault(&bad, Some(Fault::Fail(SendErrorKind::Destination)));
    let want = fill(&wal, &[good.clone(), bad.clone()], 0, 200).await;
    let cursors = Arc::new(MemoryCursorStore::new());

    let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
    eventually(Duration::from_secs(20), "good delivered", || sink.ids(&good).len() == 100).await;
    eventually(Duration::from_secs(20), "released up to the failing destination", || router.released_below() == 1)
        .await;
    // Two release rounds more (one a second, and one per delivery): it stays there.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(router.released_below(), 1, "the failing destination's first record (offset 1) pins the log");
    router.shutdown().await;

    let mut policies = Policies::uniform(fast_policy());
    policies.given_up =
        Arc::new([router::LaneKey { source: "test".into(), destination: bad.clone() }].into_iter().collect());
    let calls_before = sink.calls(&bad);
    let router = Router::start(wal.clone(), sink.clone(), cursors, policies).unwrap();
    eventually(Duration::from_secs(20), "the log released past every record", || router.released_below() == 200).await;
    assert_eq!(sink.calls(&bad), calls_before, "a send was made for a given-up destination");
    assert!(sink.ids(&bad).is_empty());
    let mut got = sink.ids(&good);
    got.dedup();
    assert_eq!(got, want[&good]);
    router.shutdown().await;
}

/// A lane that re-reads its records from the log (it overflowed) keeps to the batch
/// limits a batch from its queue keeps to: an operator may have sized them to what the
/// server takes, and a batch it refuses would be retried for ever. Its records are
/// spread unevenly among another destination's, so each read of the log brings a
/// different number of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_re_read_from_the_log_keeps_to_the_batch_limits() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let (a, other) = (key("reread", "a"), key("reread", "other"));
    sink.fault(&a, Some(Fault::Fail(SendErrorKind::Destination)));
    // One of A's, nine others, ten of A's; again and again.
    let mut n = 0;
    let mut want = Vec::new();
    for _ in 0..15 {
        for (d, count) in [(&a, 1), (&other, 9), (&a, 10)] {
            let appended = fill(&wal, std::slice::from_ref(d), n, count).await;
            if d == &a {
                want.extend(appended[d].iter().copied());
            }
            n += count;
        }
    }
    let mut policy = fast_policy();
    policy.batch.batch_max_records = 10;
    // Payloads are 7 to 9 bytes ({"n":N}): at most five of them.
    policy.batch.batch_max_bytes = 45;
    policy.lane_queue_max_records = 4;
    policy.breaker.failure_threshold = 1_000;
    let router = start_router(&wal, &sink, policy);
    eventually(Duration::from_secs(20), "the other destination delivered", || sink.ids(&other).len() == 135).await;
    sink.fault(&a, None);
    eventually(Duration::from_secs(30), "A delivered", || sink.ids(&a).len() >= want.len()).await;
    let mut got = sink.ids(&a);
    got.dedup();
    assert_eq!(got, want, "A's records, in order");
    for (messages, bytes) in sink.send_sizes(&a) {
        assert!(messages <= 10, "a send of {messages} messages, the limit is 10");
        assert!(
            bytes <= 45 || messages == 1,
            "a send of {bytes} payload bytes in {messages} messages, the limit is 45"
        );
    }
    router.shutdown().await;
}

/// The cursor store's owner can hold the log below its release ceiling (the daemon: the
/// idempotency checkpoint), however far the cursors got; it goes once the ceiling rises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_is_not_released_past_the_cursor_stores_ceiling() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let cursors = Arc::new(MemoryCursorStore::new());
    cursors.set_release_ceiling(10);
    let dests = [key("c", "x")];
    fill(&wal, &dests, 0, 400).await;
    let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
    eventually(Duration::from_secs(20), "all delivered", || sink.ids(&dests[0]).len() == 400).await;
    let lane = router::LaneKey { source: "test".into(), destination: dests[0].clone() };
    eventually(Duration::from_secs(10), "cursor stored", || cursors.get(&lane) == Some(400)).await;
    eventually(Duration::from_secs(20), "released up to the ceiling", || router.released_below() == 10).await;
    // Two release rounds more (one a second, and one per delivery): it stays there.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(router.released_below(), 10);
    assert!(wal.start_offset() <= 10, "the log starts at {}", wal.start_offset());
    cursors.set_release_ceiling(u64::MAX);
    eventually(Duration::from_secs(10), "released", || router.released_below() == 400).await;
    assert!(wal.start_offset() > 10, "the log starts at {}", wal.start_offset());
    router.shutdown().await;
}

/// A stored cursor the log's start has passed says nothing of any record the log holds:
/// the router forgets it at start, durably, and keeps every other, so the store does not
/// grow by every destination ever written to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursors_the_logs_start_has_passed_are_forgotten_at_start() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let cursors = Arc::new(MemoryCursorStore::new());
    let lane = |t: &str| router::LaneKey { source: "test".into(), destination: key("f", t) };
    let (gone, kept) = (lane("gone"), lane("kept"));
    let d = key("f", "x");
    fill(&wal, std::slice::from_ref(&d), 0, 400).await;
    let released = wal.release_below(300).await.unwrap();
    assert!(released.segments_deleted > 0, "the test needs a log that starts above 0");
    let start = wal.start_offset();
    router::CursorStore::store(&*cursors, vec![(gone.clone(), start), (kept.clone(), start + 1)]).await.unwrap();
    let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
    assert_eq!(cursors.get(&gone), None, "a cursor at the log's start was kept");
    assert_eq!(cursors.get(&kept), Some(start + 1));
    eventually(Duration::from_secs(20), "the log's records delivered", || sink.ids(&d).len() as u64 == 400 - start)
        .await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resumes_from_the_cursors_without_loss_and_with_the_same_ids() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let cursors = Arc::new(MemoryCursorStore::new());
    let dests = [key("r", "x"), key("r", "y")];
    let want = fill(&wal, &dests, 0, 400).await;
    // y is down during the first run; x delivers.
    sink.fault(&dests[1], Some(Fault::Fail(SendErrorKind::Destination)));
    let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
    eventually(Duration::from_secs(20), "x delivered", || sink.ids(&dests[0]).len() == 200).await;
    router.shutdown().await;
    sink.fault(&dests[1], None);
    let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
    eventually(Duration::from_secs(20), "y delivered", || sink.ids(&dests[1]).len() >= 200).await;
    assert_eq!(sink.ids(&dests[1]), want[&dests[1]]);
    // x was not sent again: its cursor was stored.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(sink.ids(&dests[0]), want[&dests[0]]);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_source_has_its_own_lane_to_a_shared_destination_and_keeps_its_order() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("shared", "t");
    for n in 0..200u64 {
        let source = if n % 2 == 0 { "github" } else { "stripe" };
        wal.append(vec![record_from(source, &d, n, ingest::envelope::Partitioning::Balanced)]).await.unwrap();
    }
    let router = start_router(&wal, &sink, fast_policy());
    eventually(Duration::from_secs(20), "delivered", || sink.ids(&d).len() == 200).await;
    let lanes = router.destinations();
    assert_eq!(lanes.iter().map(|l| l.source.as_str()).collect::<Vec<_>>(), vec!["github", "stripe"]);
    assert_eq!(router.destinations_of("stripe").len(), 1);
    let ids = sink.ids(&d);
    for parity in [0u128, 1] {
        let per_source: Vec<u128> = ids.iter().copied().filter(|id| (id - 1) % 2 == parity).collect();
        let want: Vec<u128> = (0..200u128).filter(|n| n % 2 == parity).map(|n| n + 1).collect();
        assert_eq!(per_source, want, "source order broken");
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cursors_in_the_state_database_survive_a_reopen() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.redb");
    let d = key("c", "t");
    let want = fill(&wal, std::slice::from_ref(&d), 0, 300).await;
    {
        let state = Arc::new(ingest::StateDb::open(&path).unwrap());
        let cursors = Arc::new(router::StateCursorStore::new(state));
        let router = Router::start(wal.clone(), sink.clone(), cursors, Policies::uniform(fast_policy())).unwrap();
        eventually(Duration::from_secs(20), "delivered", || sink.ids(&d).len() == 300).await;
        eventually(Duration::from_secs(20), "released", || router.released_below() == 300).await;
        router.shutdown().await;
    }
    // A new process: the cursors come back from disk and nothing is sent again. (The
    // cursor committer lets go of the database once its last lane is gone.)
    let mut reopened = None;
    for _ in 0..100 {
        if let Ok(db) = ingest::StateDb::open(&path) {
            reopened = Some(db);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let state = Arc::new(reopened.expect("state database still held after shutdown"));
    let cursors = Arc::new(router::StateCursorStore::new(state));
    let router = Router::start(wal.clone(), sink.clone(), cursors, Policies::uniform(fast_policy())).unwrap();
    let more = fill(&wal, std::slice::from_ref(&d), 300, 10).await;
    eventually(Duration::from_secs(20), "new records delivered", || sink.ids(&d).len() == 310).await;
    let mut all = want[&d].clone();
    all.extend(&more[&d]);
    assert_eq!(sink.ids(&d), all, "records sent again after a restart");
    router.shutdown().await;
}

/// Waits until the lane of `d` holds `n` records: it has them, and what follows about
/// whether it sent them is not merely too early to tell.
async fn held(router: &Router, d: &router::DestinationKey, n: u64) {
    eventually(Duration::from_secs(30), "the lane holds the records", || {
        router.destinations().iter().any(|l| &l.destination == d && l.held_records == n)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lingering_batch_goes_out_as_soon_as_it_is_full() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "t");
    let mut policy = fast_policy();
    policy.batch.linger = Duration::from_secs(60);
    policy.batch.batch_max_records = 10;
    let router = start_router(&wal, &sink, policy);
    let mut want = fill(&wal, std::slice::from_ref(&d), 0, 4).await;
    held(&router, &d, 4).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(sink.ids(&d).is_empty(), "a short batch waits for its linger");
    want.get_mut(&d).unwrap().extend(&fill(&wal, std::slice::from_ref(&d), 4, 6).await[&d]);
    // Well before the 60 s linger: the batch is full, so it goes.
    eventually(Duration::from_secs(10), "the full batch sent", || sink.ids(&d).len() == 10).await;
    assert_eq!(sink.ids(&d), want[&d]);
    assert_eq!(sink.calls(&d), 1, "one send of the full batch");
    router.shutdown().await;
}

/// A stop does not wait for a lingering batch's linger (which may be set up to a day).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_does_not_wait_out_a_linger() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "lingering");
    let mut policy = fast_policy();
    policy.batch.linger = Duration::from_secs(60);
    let router = start_router(&wal, &sink, policy);
    fill(&wal, std::slice::from_ref(&d), 0, 1).await;
    held(&router, &d, 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(sink.ids(&d).is_empty(), "a short batch waits for its linger");
    let stopped = tokio::time::timeout(Duration::from_secs(10), router.shutdown()).await;
    assert!(stopped.is_ok(), "the stop waited for the 60 s linger");
}

/// A lingering batch that fills by bytes goes at once too, and so does one whose record
/// limit is above what the lane's queue holds (the lane is woken as the queue fills and
/// tops its batch up, rather than at a count the queue can never reach).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lingering_batch_full_by_bytes_or_larger_than_the_queue_goes_at_once() {
    // Full by bytes: payloads of 7 to 9 bytes, at most 40 per send.
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "bytes");
    let mut policy = fast_policy();
    policy.batch.linger = Duration::from_secs(60);
    policy.batch.batch_max_records = 1000;
    policy.batch.batch_max_bytes = 40;
    let router = start_router(&wal, &sink, policy);
    fill(&wal, std::slice::from_ref(&d), 0, 1).await;
    held(&router, &d, 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(sink.ids(&d).is_empty(), "a short batch waits for its linger");
    fill(&wal, std::slice::from_ref(&d), 1, 9).await;
    eventually(Duration::from_secs(10), "the batch full by bytes sent", || !sink.ids(&d).is_empty()).await;
    router.shutdown().await;

    // A batch of 100 with a queue of 4.
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "deep");
    let mut policy = fast_policy();
    policy.batch.linger = Duration::from_secs(60);
    policy.batch.batch_max_records = 100;
    policy.lane_queue_max_records = 4;
    let router = start_router(&wal, &sink, policy);
    fill(&wal, std::slice::from_ref(&d), 0, 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    fill(&wal, std::slice::from_ref(&d), 1, 120).await;
    eventually(Duration::from_secs(10), "the full batch of 100 sent", || sink.ids(&d).len() >= 100).await;
    assert_eq!(sink.send_sizes(&d)[0].0, 100, "the first send is the full batch");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_goes_out_in_full_batches_in_order() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "backlog");
    let mut policy = fast_policy();
    policy.batch.batch_max_records = 50;
    // Every batch fills (1000 is 20 × 50) and goes as soon as it is full; with a short
    // linger a reader slowed by a busy machine would let a short batch go.
    policy.batch.linger = Duration::from_secs(60);
    // The whole backlog is in the log before the router (and its lane) starts.
    let want = fill(&wal, std::slice::from_ref(&d), 0, 1000).await;
    let router = start_router(&wal, &sink, policy);
    eventually(Duration::from_secs(20), "all delivered", || sink.ids(&d).len() == 1000).await;
    assert_eq!(sink.ids(&d), want[&d], "log order, each once");
    assert_eq!(sink.calls(&d), 20, "twenty full batches, nothing sent twice");
    eventually(Duration::from_secs(20), "log released", || router.released_below() == 1000).await;
    let lane = router.destinations().into_iter().find(|l| l.destination == d).unwrap();
    assert_eq!((lane.held_records, lane.held_bytes, lane.oldest_held_age_ms), (0, 0, None));
    router.shutdown().await;
}

/// While a lane works through records it re-reads from the log, the age of its oldest
/// held record follows the records it reaches; it does not stay at the first record it
/// held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oldest_held_age_follows_a_lane_re_reading_the_log() {
    const HOUR_MS: u64 = 3_600_000;
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "aging");
    sink.fault(&d, Some(Fault::BlackHole));
    let now_ms = ingest::time::now_unix_ms();
    // Records 0..50 received an hour apart, 100 h to 51 h ago; record 50, 50 h ago, names a
    // partition the topic lacks and is held (`on_admission_failure = "error"`).
    for n in 0..=50u64 {
        let partitioning = if n == 50 { Partitioning::PartitionId(7) } else { Partitioning::PartitionId(0) };
        let received = now_ms - (100 - n) * HOUR_MS;
        wal.append(vec![record_received_at("test", &d, n, partitioning, received)])
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let mut policy = fast_policy();
    policy.lane_queue_max_records = 4;
    policy.batch.batch_max_records = 5;
    policy.batch.result_timeout = Duration::from_millis(300);
    let router = start_router(&wal, &sink, policy);
    let lane = |router: &Router| router.destinations().into_iter().find(|l| l.destination == d).unwrap();
    eventually(Duration::from_secs(10), "overflowed", || {
        router.destinations().iter().any(|l| l.destination == d && l.overflowed)
    })
    .await;
    let age_h = lane(&router).oldest_held_age_ms.unwrap_or(0) / HOUR_MS;
    assert!((99..=100).contains(&age_h), "at the start the oldest held is record 0: {age_h} h");
    sink.fault(&d, None);
    eventually(Duration::from_secs(20), "up to the held record", || sink.ids(&d).len() == 50).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let snap = lane(&router);
    // Held: record 50, and 49 until the batch they share is done.
    assert!((1..=2).contains(&snap.held_records), "{snap:?}");
    // The held record is in the last batch read (records 49 and 50): at most 52 h old.
    let age_h = snap.oldest_held_age_ms.unwrap_or(0) / HOUR_MS;
    assert!((49..=52).contains(&age_h), "the oldest held age stayed behind: {age_h} h");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_sends_with_the_next_batch_prepared_lose_nothing_and_repeat_nothing() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "flaky");
    let mut policy = fast_policy();
    policy.batch.batch_max_records = 20;
    let router = start_router(&wal, &sink, policy);
    let mut want = fill(&wal, std::slice::from_ref(&d), 0, 1).await;
    eventually(Duration::from_secs(10), "warm", || sink.ids(&d).len() == 1).await;
    // Sends fail while a backlog builds: the first batch is retried while the next ones
    // are queued (and one is prepared ahead).
    sink.client_fault(Some(SendErrorKind::Unavailable));
    want.get_mut(&d).unwrap().extend(&fill(&wal, std::slice::from_ref(&d), 1, 300).await[&d]);
    eventually(Duration::from_secs(10), "retrying", || sink.calls(&d) >= 4).await;
    eventually(Duration::from_secs(20), "every record held while the sends fail", || {
        router.destinations().into_iter().any(|l| l.destination == d && l.held_records == 300)
    })
    .await;
    assert!(router.released_below() <= 1);
    sink.client_fault(None);
    eventually(Duration::from_secs(20), "all delivered", || sink.ids(&d).len() == 301).await;
    assert_eq!(sink.ids(&d), want[&d], "log order, each once");
    eventually(Duration::from_secs(20), "log released", || router.released_below() == 301).await;
    let lane = router.destinations().into_iter().find(|l| l.destination == d).unwrap();
    assert_eq!((lane.held_records, lane.held_bytes), (0, 0));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_ahead_of_the_log_is_lowered_to_its_end_and_new_records_are_delivered_before_release() {
    // The state database kept a cursor the log does not reach: a power loss took the log's
    // tail under `interval`, or the log directory was replaced by an empty one.
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("ahead", "t");
    let lane = router::LaneKey { source: "test".into(), destination: d.clone() };
    let cursors = Arc::new(MemoryCursorStore::new());
    router::CursorStore::store(&*cursors, vec![(lane.clone(), 500)]).await.unwrap();

    let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
    assert_eq!(cursors.get(&lane), Some(0), "the stored cursor is lowered to the log's end before anything runs");

    // The new records reuse offsets 0..10, below the old cursor. The destination is down
    // at first: none of them may be released while it is.
    sink.fault(&d, Some(Fault::Fail(SendErrorKind::Destination)));
    let want = fill(&wal, std::slice::from_ref(&d), 0, 10).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(router.released_below(), 0, "records released before they were delivered");
    eventually(Duration::from_secs(10), "the lane tried its destination", || sink.ensured(&d) + sink.calls(&d) > 0)
        .await;
    assert_eq!(router.released_below(), 0, "records released before they were delivered");
    sink.fault(&d, None);
    eventually(Duration::from_secs(20), "delivered", || sink.ids(&d).len() == 10).await;
    assert_eq!(sink.ids(&d), want[&d]);
    eventually(Duration::from_secs(20), "released after delivery", || router.released_below() == 10).await;
    router.shutdown().await;
    assert_eq!(cursors.get(&lane), Some(10));
}

/// A limit of sends in flight beyond what the router can run refuses the start, naming
/// the key: accepted, it would panic the log reader at the first record (tokio's semaphore
/// has a maximum), and nothing would be delivered while the router reported Running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_of_sends_in_flight_beyond_the_bound_refuses_the_start() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "a");
    fill(&wal, std::slice::from_ref(&d), 0, 3).await;
    let mut policy = fast_policy();
    policy.max_concurrent_destinations = usize::MAX;
    let refused =
        Router::start(wal.clone(), sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(policy));
    let e = refused.map(drop).unwrap_err();
    assert!(e.contains("max_concurrent_destinations must be at most"), "{e}");
    // At the bound it delivers.
    let mut policy = fast_policy();
    policy.max_concurrent_destinations = router::policy::MAX_CONCURRENT_DESTINATIONS;
    let router = start_router(&wal, &sink, policy);
    eventually(Duration::from_secs(10), "delivered", || sink.ids(&d).len() == 3).await;
    assert_eq!(router.status().status, Status::Running);
    router.shutdown().await;
}

/// A task that runs each time the runtime lets it, noting how many bytes the log's files
/// were read since its last turn: what one task read while holding the worker.
struct ReadsBetweenTurns {
    stop: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<(u64, u64)>,
}

impl ReadsBetweenTurns {
    fn watch(storage: &CountingReads) -> ReadsBetweenTurns {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (storage, stopped) = (storage.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let (mut last, mut most) = (storage.bytes_read(), 0u64);
            let start = last;
            while !stopped.load(std::sync::atomic::Ordering::SeqCst) {
                let now = storage.bytes_read();
                most = most.max(now - last);
                last = now;
                tokio::task::yield_now().await;
            }
            (most, last - start)
        });
        ReadsBetweenTurns { stop, task }
    }

    /// The most bytes read between two turns, and the bytes read in all.
    async fn stop(self) -> (u64, u64) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.task.await.unwrap()
    }
}

/// A lane catching up on a long backlog in which it has few records scans it in bounded
/// steps and lets the other tasks run between them: one unbounded call would scan the
/// whole backlog without yielding and hold the worker that the door and every other lane
/// share (the only one, on a 2-core host). Measured on a single-threaded runtime by a
/// task that notes, each time it runs, how many bytes the log's files were read since its
/// last turn.
#[tokio::test]
async fn a_lane_catching_up_on_a_long_backlog_lets_the_other_tasks_run() {
    let storage = CountingReads::new(&SimStorage::new());
    let wal = storage.open_wal();
    let sink = FaultySink::new();
    let (rare, busy) = (key("s", "rare"), key("s", "busy"));
    sink.fault(&rare, Some(Fault::Fail(SendErrorKind::Destination)));
    let mut policy = fast_policy();
    // The rare lane holds a few records (a batch in flight, one prepared, a short queue)
    // and overflows: it re-reads the rest from the log once its destination is back.
    policy.lane_queue_max_records = 4;
    policy.batch.batch_max_records = 2;
    policy.batch.backoff_max = Duration::from_millis(200);
    let router = start_router(&wal, &sink, policy);
    wal.append((0..100).map(|n| record(&rare, n, Partitioning::Balanced)).collect()).await.unwrap();
    const BUSY: u64 = 60_000;
    for chunk in 0..BUSY / 1000 {
        let first = 100 + chunk * 1000;
        wal.append((first..first + 1000).map(|n| record(&busy, n, Partitioning::Balanced)).collect()).await.unwrap();
    }
    eventually(Duration::from_secs(120), "the busy destination delivered", || sink.ids(&busy).len() == BUSY as usize)
        .await;
    let lanes = router.destinations();
    assert!(
        lanes.iter().any(|l| l.destination == rare && l.overflowed),
        "the rare destination's lane did not overflow: {lanes:?}"
    );

    let watcher = ReadsBetweenTurns::watch(&storage);
    sink.fault(&rare, None);
    eventually(Duration::from_secs(120), "the rare destination delivered", || sink.ids(&rare).len() == 100).await;
    eventually(Duration::from_secs(120), "the rare lane caught up", || {
        router.destinations().iter().any(|l| l.destination == rare && !l.overflowed)
    })
    .await;
    let (most, total) = watcher.stop().await;
    assert!(total > 3 << 20, "the catch-up read only {total} bytes: the test no longer scans a long backlog");
    assert!(most < 2 << 20, "{most} bytes were read between two turns of another task (of {total} in all)");
    router.shutdown().await;
}

/// A lane whose re-read starts deep inside a large segment finds its position in bounded
/// steps too: a new reader walks the segment's frames from its start (up to 64 MiB with
/// the default segments), and one walk in a single call would hold the worker the door
/// and every other lane share for all of it. Here the rare lane's first record not kept
/// in memory lies behind about 6 MiB of another destination's records in one 64 MiB
/// segment; measured as in the test above.
#[tokio::test]
async fn a_lane_re_reading_from_deep_inside_a_large_segment_lets_the_other_tasks_run() {
    let storage = CountingReads::new(&SimStorage::new());
    let wal = storage.open_wal_with_segments_of(64 << 20);
    let sink = FaultySink::new();
    let (rare, busy) = (key("s", "rare"), key("s", "busy"));
    sink.fault(&rare, Some(Fault::Fail(SendErrorKind::Destination)));
    let mut policy = fast_policy();
    policy.lane_queue_max_records = 4;
    policy.batch.batch_max_records = 2;
    policy.batch.backoff_max = Duration::from_millis(200);
    let router = start_router(&wal, &sink, policy);
    const BUSY: u64 = 60_000;
    for chunk in 0..BUSY / 1000 {
        let first = chunk * 1000;
        wal.append((first..first + 1000).map(|n| record(&busy, n, Partitioning::Balanced)).collect()).await.unwrap();
    }
    wal.append((BUSY..BUSY + 100).map(|n| record(&rare, n, Partitioning::Balanced)).collect()).await.unwrap();
    eventually(Duration::from_secs(120), "the busy destination delivered", || sink.ids(&busy).len() == BUSY as usize)
        .await;
    eventually(Duration::from_secs(60), "the rare lane overflowed", || {
        router.destinations().iter().any(|l| l.destination == rare && l.overflowed)
    })
    .await;
    assert_eq!(wal.stats().segments, 1, "the test needs every record in one segment");

    let watcher = ReadsBetweenTurns::watch(&storage);
    sink.fault(&rare, None);
    eventually(Duration::from_secs(120), "the rare destination delivered", || sink.ids(&rare).len() == 100).await;
    let (most, total) = watcher.stop().await;
    assert!(total > 4 << 20, "the re-read walked only {total} bytes: the test no longer starts deep in a segment");
    assert!(most < 2 << 20, "{most} bytes were read between two turns of another task (of {total} in all)");
    router.shutdown().await;
}

/// A lane catching up in batches bounded by bytes reads the backlog about once: the
/// record that does not fit a batch is given back to the reader, not found again by a
/// new reader walking its segment from the start (with 4 MiB segments, a walk of half a
/// segment per batch, hundreds of times the backlog).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_catching_up_in_batches_bounded_by_bytes_reads_the_backlog_about_once() {
    let storage = CountingReads::new(&SimStorage::new());
    let wal = storage.open_wal_with_segments_of(4 << 20);
    let sink = FaultySink::new();
    let d = key("s", "bytes");
    sink.fault(&d, Some(Fault::Fail(SendErrorKind::Destination)));
    let mut policy = fast_policy();
    policy.lane_queue_max_records = 4;
    policy.batch.batch_max_bytes = 100; // about ten of these records' payloads
    policy.batch.backoff_max = Duration::from_millis(200);
    let router = start_router(&wal, &sink, policy);
    const N: u64 = 10_000;
    for chunk in 0..N / 1000 {
        let first = chunk * 1000;
        wal.append((first..first + 1000).map(|n| record(&d, n, Partitioning::Balanced)).collect()).await.unwrap();
    }
    eventually(Duration::from_secs(30), "the lane overflowed", || {
        router.destinations().iter().any(|l| l.destination == d && l.overflowed)
    })
    .await;
    let log_bytes = wal.stats().used_bytes;
    let before = storage.bytes_read();
    sink.fault(&d, None);
    eventually(Duration::from_secs(120), "delivered", || sink.ids(&d).len() == N as usize).await;
    let read = storage.bytes_read() - before;
    assert!(read <= 4 * log_bytes, "catching up on a {log_bytes}-byte log read {read} bytes");
    router.shutdown().await;
}

/// A record this build cannot decode (a newer build wrote it, say, before a rollback)
/// names no destination, so it may be any lane's: no lane's stored cursor passes it.
/// Else the build that can read it, once back, would find it below its lane's cursor
/// and skip it as delivered, an event answered 200 and never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_stored_cursor_passes_a_record_held_as_undecodable() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let d = key("app", "orders");
    wal.append(vec![record(&d, 0, Partitioning::Balanced)]).await.unwrap();
    wal.append(vec![bytes::Bytes::from_static(&[9, 0])]).await.unwrap();
    wal.append(vec![record(&d, 2, Partitioning::Balanced)]).await.unwrap();
    let sink = FaultySink::new();
    let cursors = Arc::new(MemoryCursorStore::new());
    let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
    eventually(Duration::from_secs(20), "both records delivered", || sink.ids(&d).len() == 2).await;
    let lane = router::LaneKey { source: "test".into(), destination: d.clone() };
    eventually(Duration::from_secs(20), "a cursor stored", || cursors.get(&lane).is_some()).await;
    assert_eq!(router.held_from(), Some(1));
    router.shutdown().await;
    assert_eq!(router.held_from(), None, "a stopped router holds nothing");
    assert_eq!(cursors.get(&lane), Some(1), "the cursor passed the undecodable record");
    assert_eq!(router.released_below(), 1);
}

/// Lanes waiting for one of their source's send slots, behind calls that never answer,
/// start no new call once a stop is asked: each would take a slot in turn and wait out
/// its own result timeout, a few at a time, long past the daemon's grace period. Only
/// the calls already in flight are waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_starts_no_call_for_lanes_waiting_for_a_send_slot() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests: Vec<_> = (0..8).map(|i| key("s", &format!("t{i}"))).collect();
    for d in &dests {
        sink.fault(d, Some(Fault::BlackHole));
    }
    let mut policy = fast_policy();
    policy.max_concurrent_destinations = 2;
    policy.batch.result_timeout = Duration::from_secs(1);
    policy.breaker.failure_threshold = 1000;
    fill(&wal, &dests, 0, 8).await;
    let router =
        Router::start(wal.clone(), sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(policy))
            .unwrap();
    eventually(Duration::from_secs(20), "two calls in flight", || {
        dests.iter().map(|d| sink.calls(d) + sink.ensured(d)).sum::<u64>() >= 2
    })
    .await;
    let started = std::time::Instant::now();
    router.shutdown().await;
    let calls: u64 = dests.iter().map(|d| sink.calls(d) + sink.ensured(d)).sum();
    assert!(started.elapsed() < Duration::from_secs(5), "the stop took {:?} ({calls} calls)", started.elapsed());
    assert!(calls <= 4, "{calls} calls were made, most of them after the stop");
}

/// A router dropped without a shutdown (a daemon whose start failed after delivery
/// began) stops its tasks: none is left running, idle or waking, holding the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_dropped_without_a_shutdown_stops_its_tasks() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("app", "orders");
    fill(&wal, std::slice::from_ref(&d), 0, 3).await;
    let router = start_router(&wal, &sink, fast_policy());
    eventually(Duration::from_secs(20), "delivered", || sink.ids(&d).len() == 3).await;
    drop(router);
    eventually(Duration::from_secs(5), "every task let go of the log", || Arc::strong_count(&wal) == 1).await;
}

/// A stop abandoned part way (the daemon's grace period over while a send still waits
/// for its destination) leaves no task of the router running: the send in flight is
/// dropped, not finished behind the daemon's back while its log closes, and the status
/// says the stop was cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_stop_leaves_no_send_running() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "slow");
    // Answered within the result timeout (2 s): a stop that waited would see it through.
    sink.fault(&d, Some(Fault::Slow(Duration::from_millis(1500))));
    let router = start_router(&wal, &sink, fast_policy());
    fill(&wal, std::slice::from_ref(&d), 0, 10).await;
    eventually(Duration::from_secs(10), "a send is out", || sink.calls(&d) >= 1).await;
    let stop = tokio::time::timeout(Duration::from_millis(100), router.shutdown()).await;
    assert!(stop.is_err(), "the stop did not wait for the send in flight");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(sink.ids(&d), Vec::<u128>::new(), "a send went on after its router's stop was abandoned");
    let status = router.status();
    assert_eq!(status.status, Status::Stopped, "{status:?}");
    assert!(status.reason.contains("stop abandoned"), "{status:?}");
}

/// A batch the destination cannot take within the result timeout whole (a slow link, a
/// server slow to store: here 60 ms a record, 40 records, a 500 ms timeout) is sent in
/// halves until a send is answered in time, and the lane moves on: sent again whole at
/// every retry, it was cut short for ever (and on a real server perhaps stored each time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_too_slow_to_send_whole_is_sent_in_halves_and_the_lane_moves_on() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("s", "slow-link");
    let want = fill(&wal, std::slice::from_ref(&d), 0, 40).await;
    sink.fault(&d, Some(Fault::SlowPerMessage(Duration::from_millis(60))));
    let mut policy = fast_policy();
    policy.batch.result_timeout = Duration::from_millis(500);
    policy.batch.batch_max_records = 40;
    policy.breaker.failure_threshold = 100;
    let router = start_router(&wal, &sink, policy);
    eventually(Duration::from_secs(30), "delivered", || sink.ids(&d).len() >= 40).await;
    assert_eq!(sink.ids(&d), want[&d], "lost, reordered or duplicated records");
    let lane = router.destinations().into_iter().find(|l| l.destination == d).unwrap();
    assert_eq!(lane.send_records_max, Some(5), "the status does not show the cap: {lane:?}");
    let sizes: Vec<usize> = sink.send_sizes(&d).iter().map(|(n, _)| *n).collect();
    assert_eq!(&sizes[..4], &[40, 20, 10, 5], "sends: {sizes:?}");
    assert!(sizes[3..].iter().all(|&n| n <= 5), "a send past the cap before 16 were answered: {sizes:?}");
    router.shutdown().await;
}
