//! Status and its gauges: Degraded entered and left, the gauges agreeing with the
//! statuses at every step, through a ten-minute outage on a simulated clock.

mod support;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ingest::envelope::Partitioning;
use metrics_exporter_prometheus::PrometheusHandle;
use router::status::Status;
use router::test_doubles::MemoryCursorStore;
use router::{Policies, Router, SendErrorKind};
use support::*;
use wal::storage::{FaultOp, HoldSyncs, HookedStorage, SimStorage};
use wal::{Wal, WalOptions};

/// Every destination's status is counted in exactly its own gauge.
fn assert_gauges_agree(snap: &PrometheusHandle, router: &Router) {
    let lanes = router.destinations();
    for s in Status::ALL {
        let want = lanes.iter().filter(|l| l.status == s).count() as f64;
        let got = gauge(snap, &format!("iggy_connector_destinations_{}", s.as_str()));
        assert_eq!(got, want, "gauge for {} says {got}, statuses say {want}", s.as_str());
        let router_want = if router.status().status == s { 1.0 } else { 0.0 };
        assert_eq!(gauge(snap, &format!("iggy_connector_router_{}", s.as_str())), router_want, "router {}", s.as_str());
    }
}

#[test]
fn a_ten_minute_outage_is_held_and_then_delivered_in_order_with_truthful_status() {
    with_metrics(true, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let dests = [key("o", "1"), key("o", "2")];
        let mut want = fill(&wal, &dests, 0, 10).await;
        let router = start_router(&wal, &sink, fast_policy());
        eventually(Duration::from_secs(30), "warm", || dests.iter().all(|d| sink.ids(d).len() == 5)).await;
        assert_eq!(router.status().status, Status::Running);
        assert_gauges_agree(&snap, &router);

        sink.client_fault(Some(SendErrorKind::Disconnected));
        let more = fill(&wal, &dests, 10, 1000).await;
        for (k, v) in more {
            want.get_mut(&k).unwrap().extend(v);
        }
        eventually(Duration::from_secs(60), "degraded", || router.status().status == Status::Degraded).await;
        assert_gauges_agree(&snap, &router);
        // Ten minutes of simulated time, checking the status every few seconds.
        for _ in 0..120 {
            tokio::time::sleep(Duration::from_secs(5)).await;
            assert_eq!(router.status().status, Status::Degraded);
            assert_gauges_agree(&snap, &router);
        }
        assert_eq!(router.destinations().len(), dests.len(), "a lane is missing from the snapshot");
        for d in router.destinations() {
            assert_eq!(d.breaker, "closed", "a client-wide outage opened a breaker");
            assert_eq!(d.held_records, 500);
        }
        assert_eq!(router.released_below(), 10);

        sink.client_fault(None);
        eventually(Duration::from_secs(120), "drained", || dests.iter().all(|d| sink.ids(d).len() == 505)).await;
        assert_delivered_in_order(&sink, &dests, &want);
        eventually(Duration::from_secs(10), "running", || router.status().status == Status::Running).await;
        assert_gauges_agree(&snap, &router);
        eventually(Duration::from_secs(10), "released", || router.released_below() == 1010).await;
        router.shutdown().await;
        // A stopped router counts as running nowhere (and, once gone, as nothing).
        assert_eq!(gauge(&snap, "iggy_connector_router_running"), 0.0);
        assert_eq!(gauge(&snap, "iggy_connector_destinations_running"), 0.0);
    });
}

/// The router's gauges of lanes, breakers and held records say nothing of a router that
/// stopped: a breaker open at shutdown, a lane, held bytes and their age, a record held
/// by the cap. A router started again in the same process counts only its own.
#[test]
fn a_stopped_router_leaves_no_lane_active_no_breaker_open_and_nothing_held() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        // A fails at its topic (its breaker opens); B is over the cap and held.
        let (a, b) = (key("s", "a"), key("s", "b"));
        sink.fault(&a, Some(Fault::Fail(SendErrorKind::Destination)));
        fill(&wal, &[a.clone(), b.clone()], 0, 3).await;
        let mut policy = fast_policy();
        policy.max_destinations = 1;
        let policies = Policies::uniform(policy);
        let cursors = Arc::new(MemoryCursorStore::new());
        let gauges = |snap: &PrometheusHandle| {
            [
                "iggy_connector_destinations_active",
                "iggy_connector_destination_circuit_open",
                "iggy_connector_held_bytes",
                "iggy_connector_oldest_held_age_seconds",
                "iggy_connector_admission_held",
            ]
            .map(|name| (name, gauge(snap, name)))
        };
        let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), policies.clone()).unwrap();
        eventually(Duration::from_secs(10), "A's breaker open, its records and B's held", || {
            gauges(&snap).iter().all(|(_, v)| *v > 0.0)
        })
        .await;
        assert_eq!(gauge(&snap, "iggy_connector_destination_circuit_open"), 1.0);
        router.shutdown().await;
        let after = gauges(&snap);
        assert!(after.iter().all(|(_, v)| *v == 0.0), "after the router stopped: {after:?}");

        // Started again, A answering: only the new router's lane is counted, and no breaker.
        sink.fault(&a, None);
        let router = Router::start(wal.clone(), sink.clone(), cursors, policies).unwrap();
        eventually(Duration::from_secs(10), "A delivered", || sink.ids(&a).len() == 2).await;
        assert_eq!(gauge(&snap, "iggy_connector_destinations_active"), 1.0);
        assert_eq!(gauge(&snap, "iggy_connector_destination_circuit_open"), 0.0);
        router.shutdown().await;
        let after = gauges(&snap);
        assert!(after.iter().all(|(_, v)| *v == 0.0), "after the router stopped again: {after:?}");
    });
}

/// A stop empties the router's lanes; the sources they belonged to are still its
/// sources, stopped. A source the configuration no longer names is known only by its
/// lanes: without them its delivery status would stay what it was before the stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_router_still_names_the_sources_it_had_stopped() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let (a, b) = (key("one", "x"), key("two", "y"));
    sink.fault(&b, Some(Fault::Fail(SendErrorKind::Destination)));
    for (n, source, d) in [(0, "one", &a), (1, "two", &b)] {
        wal.append(vec![record_from(source, d, n, Partitioning::Balanced)]).await.unwrap();
    }
    let router = start_router(&wal, &sink, fast_policy());
    eventually(Duration::from_secs(10), "both lanes", || router.destinations().len() == 2).await;
    eventually(Duration::from_secs(10), "two degraded", || router.connector_status("two") == Status::Degraded).await;
    router.shutdown().await;
    assert!(router.destinations().is_empty(), "a stop empties the lanes");
    assert_eq!(router.sources(), ["one", "two"]);
    assert_eq!(router.connector_status("two"), Status::Stopped);
}

/// A wall clock stepped back since the door stamped a record (here: one received an
/// hour from now) puts its age by the wall clock at 0 for the size of the step. The age
/// a lane and the gauge show still grows while the record is held, so an alert on a
/// destination that takes nothing is not kept quiet for as long.
#[test]
fn the_oldest_held_age_grows_after_the_wall_clock_stepped_back() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("s", "stepped");
        sink.fault(&d, Some(Fault::BlackHole));
        let ahead = ingest::time::now_unix_ms() + 3_600_000;
        wal.append(vec![record_received_at("test", &d, 0, Partitioning::Balanced, ahead)]).await.unwrap();
        let router = start_router(&wal, &sink, fast_policy());
        let age = |router: &Router| {
            router.destinations().into_iter().find(|l| l.destination == d).and_then(|l| l.oldest_held_age_ms)
        };
        eventually(Duration::from_secs(10), "held", || age(&router).is_some()).await;
        router.publish_held_gauges();
        let (first, first_gauge) = (age(&router).unwrap_or(0), gauge(&snap, "iggy_connector_oldest_held_age_seconds"));
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        router.publish_held_gauges();
        let (later, later_gauge) = (age(&router).unwrap_or(0), gauge(&snap, "iggy_connector_oldest_held_age_seconds"));
        assert!(later >= first + 1_000, "the lane's oldest held age stood still: {first} ms, then {later} ms");
        assert!(later_gauge >= first_gauge + 1.0, "the gauge stood still: {first_gauge} s, then {later_gauge} s");
        // Not an hour either: it is the time held, not a guess.
        assert!(later_gauge < 60.0, "{later_gauge} s");
        router.shutdown().await;
    });
}

/// While the log's writer is stuck in a sync (a disk that stopped answering), the
/// releaser waits on it, and the gauges of what is held are still measured at every
/// scrape: the oldest held record's age goes on growing, so an alert on it can fire.
#[test]
fn the_oldest_held_age_goes_on_growing_while_the_releaser_waits_on_a_stuck_log() {
    with_metrics(false, |snap| async move {
        let storage = HookedStorage::new(Arc::new(SimStorage::new()), HoldSyncs::default());
        let opts = WalOptions { segment_max_bytes: 16 * 1024, max_bytes: 64 << 20, ..WalOptions::default() };
        let wal = Arc::new(Wal::open_with(Arc::new(storage.clone()), &PathBuf::from("/sim/log"), opts).unwrap());
        let sink = FaultySink::new();
        let (a, b) = (key("s", "a"), key("s", "b"));
        sink.fault(&b, Some(Fault::Fail(SendErrorKind::Destination)));
        fill(&wal, std::slice::from_ref(&a), 0, 1000).await;
        fill(&wal, std::slice::from_ref(&b), 1000, 5).await;
        assert!(wal.segment_paths().len() > 2, "A's records span segments the release would remove");
        // The writer is stuck in the sync of one more append; a release waits behind it.
        let held = storage.hold_syncs();
        let stuck = tokio::spawn({
            let (wal, b) = (wal.clone(), b.clone());
            async move { wal.append(vec![record(&b, 1005, Partitioning::Balanced)]).await }
        });
        eventually(Duration::from_secs(10), "the writer in a held sync", || storage.hooks().waiting() == 1).await;
        let router = start_router(&wal, &sink, fast_policy());
        eventually(Duration::from_secs(10), "A delivered", || sink.ids(&a).len() == 1000).await;
        eventually(Duration::from_secs(10), "B held", || router.destinations().iter().any(|d| d.held_records > 0))
            .await;
        // A releaser round has come and waits for the writer: nothing is released.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert_eq!(router.released_below(), 0, "the release went through a stuck writer");
        router.publish_held_gauges();
        let first = gauge(&snap, "iggy_connector_oldest_held_age_seconds");
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        router.publish_held_gauges();
        let later = gauge(&snap, "iggy_connector_oldest_held_age_seconds");
        assert!(later >= first + 1.0, "the oldest held age stood still: {first} then {later}");
        assert!(gauge(&snap, "iggy_connector_held_bytes") > 0.0);
        drop(held);
        stuck.await.unwrap().unwrap();
        eventually(Duration::from_secs(10), "released once the writer went on", || router.released_below() == 1000)
            .await;
        router.shutdown().await;
        assert_eq!(gauge(&snap, "iggy_connector_oldest_held_age_seconds"), 0.0);
    });
}

/// While a stop waits for its lanes (one in a slow send), the router still holds their
/// records and says so; the gauges go to zero once the lanes have ended, not when the
/// stop begins.
#[test]
fn held_records_are_shown_until_the_lanes_have_stopped() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("s", "slow");
        sink.fault(&d, Some(Fault::Slow(Duration::from_secs(3))));
        fill(&wal, std::slice::from_ref(&d), 0, 5).await;
        let router = Arc::new(start_router(&wal, &sink, fast_policy()));
        eventually(Duration::from_secs(10), "held", || gauge(&snap, "iggy_connector_held_bytes") > 0.0).await;
        eventually(Duration::from_secs(10), "a send in flight", || sink.calls(&d) > 0).await;
        let stopping = tokio::spawn({
            let router = router.clone();
            async move { router.shutdown().await }
        });
        eventually(Duration::from_secs(10), "stopping", || router.status().status == Status::Stopping).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!stopping.is_finished(), "the stop did not wait for the lane's send");
        assert!(gauge(&snap, "iggy_connector_held_bytes") > 0.0, "nothing held while the lane still sends");
        assert!(gauge(&snap, "iggy_connector_queues_max_bytes") > 0.0);
        stopping.await.unwrap();
        assert_eq!(gauge(&snap, "iggy_connector_held_bytes"), 0.0, "held after the router stopped");
        assert_eq!(gauge(&snap, "iggy_connector_queues_max_bytes"), 0.0);
    });
}

/// A stop cut short (its future dropped at the end of the daemon's grace period, a send
/// still in flight) leaves the status and the gauges as a stop that ended: stopped, no
/// lane, nothing held or queued, no hold.
#[test]
fn a_stop_cut_short_leaves_nothing_held_in_the_status_or_the_gauges() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("s", "slow");
        sink.fault(&d, Some(Fault::Slow(Duration::from_secs(3600))));
        fill(&wal, std::slice::from_ref(&d), 0, 5).await;
        let router = start_router(&wal, &sink, fast_policy());
        eventually(Duration::from_secs(10), "held", || gauge(&snap, "iggy_connector_held_bytes") > 0.0).await;
        eventually(Duration::from_secs(10), "a send in flight", || sink.calls(&d) > 0).await;
        assert_eq!(router.destinations().len(), 1);
        assert!(tokio::time::timeout(Duration::from_millis(300), router.shutdown()).await.is_err(), "the stop ended");
        assert_eq!(router.status().status, Status::Stopped);
        assert!(router.destinations().is_empty(), "lanes listed after the stop: {:?}", router.destinations());
        assert_eq!(router.held_from(), None);
        assert_eq!(router.queued_bytes(), (0, 0), "the status's queue bound after the stop");
        for name in [
            "iggy_connector_held_bytes",
            "iggy_connector_queued_bytes",
            "iggy_connector_queues_max_bytes",
            "iggy_connector_oldest_held_age_seconds",
            "iggy_connector_admission_held",
        ] {
            assert_eq!(gauge(&snap, name), 0.0, "{name} after the stop");
        }
        // The lanes' counts are taken back as their aborted tasks let go of them.
        eventually(Duration::from_secs(10), "no lane counted", || {
            Status::ALL.iter().all(|s| gauge(&snap, &format!("iggy_connector_destinations_{}", s.as_str())) == 0.0)
        })
        .await;
        assert_gauges_agree(&snap, &router);
    });
}

/// A lane that overflows to the log after two records and retries within half a
/// second: the setup of the tests whose log reads fail.
fn overflowing_policy() -> router::RouterPolicy {
    let mut policy = fast_policy();
    policy.batch.backoff_max = Duration::from_millis(500);
    policy.lane_queue_max_records = 2;
    policy.batch.batch_max_records = 2;
    policy
}

/// A log read that fails is an Error, for the lane and for the router, left as soon as the
/// log reads again: first the dispatcher's read, then an overflowed lane's re-read.
#[test]
fn a_failed_log_read_is_an_error_until_the_log_reads_again() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("r", "1");
        let mut want = fill(&wal, std::slice::from_ref(&d), 0, 4).await;
        let policy = overflowing_policy();
        // The dispatcher's first read fails.
        sim.fail_nth(FaultOp::Read, 1, std::io::ErrorKind::Other);
        let router = start_router(&wal, &sink, policy);
        eventually(Duration::from_secs(30), "router error", || router.status().status == Status::Error).await;
        assert!(router.status().reason.contains("cannot read the log"), "{:?}", router.status());
        assert_gauges_agree(&snap, &router);
        eventually(Duration::from_secs(10), "delivered", || sink.ids(&d).len() == 4).await;
        eventually(Duration::from_secs(30), "running", || router.status().status == Status::Running).await;
        assert_gauges_agree(&snap, &router);

        // The lane overflows to the log while its sends fail; then its re-read fails.
        sink.client_fault(Some(SendErrorKind::Disconnected));
        for (k, v) in fill(&wal, std::slice::from_ref(&d), 4, 20).await {
            want.get_mut(&k).unwrap().extend(v);
        }
        // Every record routed (the dispatcher waits for more), the lane re-reading.
        eventually(Duration::from_secs(10), "overflowed", || {
            let lane = &router.destinations()[0];
            lane.overflowed && lane.held_records == 20
        })
        .await;
        sim.fail_nth(FaultOp::Read, 1, std::io::ErrorKind::Other);
        sink.client_fault(None);
        eventually(Duration::from_secs(10), "lane error", || {
            router.destinations()[0].status == Status::Error && router.status().status == Status::Error
        })
        .await;
        assert!(router.status().reason.contains("r/1 cannot read the log"), "{:?}", router.status());
        assert_gauges_agree(&snap, &router);
        eventually(Duration::from_secs(10), "drained", || sink.ids(&d).len() == 24).await;
        assert_eq!(sink.ids(&d), want[&d], "lost, reordered or duplicated");
        eventually(Duration::from_secs(30), "running", || {
            router.destinations()[0].status == Status::Running && router.status().status == Status::Running
        })
        .await;
        assert_gauges_agree(&snap, &router);
        router.shutdown().await;
    });
}

/// A Degraded lane whose re-read of the log fails, and then reads again, is Degraded
/// for the reason it was before, not for "the log reads again", which said nothing of why
/// its sends fail.
#[test]
fn a_degraded_lane_that_reads_the_log_again_keeps_its_reason() {
    with_metrics(false, |_snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("r", "1");
        let want = fill(&wal, std::slice::from_ref(&d), 0, 20).await;
        sink.client_fault(Some(SendErrorKind::Disconnected));
        let router = start_router(&wal, &sink, overflowing_policy());
        eventually(Duration::from_secs(10), "degraded and re-reading", || {
            router.destinations().first().is_some_and(|lane| lane.status == Status::Degraded && lane.overflowed)
        })
        .await;
        let degraded_for = router.destinations()[0].status_reason.clone();
        assert!(degraded_for.contains("consecutive failures"), "{degraded_for}");
        // From here a send is never answered: the try after the read waits out its whole
        // result timeout (2 s), so nothing else sets the reason meanwhile.
        sink.fault(&d, Some(Fault::BlackHole));
        sink.client_fault(None);
        sim.fail_nth(FaultOp::Read, 1, std::io::ErrorKind::Other);
        eventually(Duration::from_secs(10), "lane error", || router.destinations()[0].status == Status::Error).await;
        eventually(Duration::from_secs(10), "degraded again", || router.destinations()[0].status == Status::Degraded)
            .await;
        let reason = router.destinations()[0].status_reason.clone();
        assert!(reason.contains("consecutive failures"), "degraded for {reason:?}");
        sink.fault(&d, None);
        eventually(Duration::from_secs(10), "drained", || sink.ids(&d).len() == 20).await;
        assert_eq!(sink.ids(&d), want[&d], "lost, reordered or duplicated");
        router.shutdown().await;
    });
}

/// A connector's delivery status shows the troubles that affect it, never another's: a
/// lane of connector x that cannot read the log puts the router and x in Error, while y,
/// whose destination is fine, keeps Running. The dispatcher's own read failure affects
/// every connector, even one without a lane yet.
#[test]
fn a_connector_is_in_error_only_for_a_log_read_that_affects_it() {
    with_metrics(false, |_snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let (x, y) = (key("x", "1"), key("y", "1"));
        for i in 0..4u64 {
            wal.append(vec![record_from("x", &x, i, Partitioning::Balanced)]).await.unwrap();
            wal.append(vec![record_from("y", &y, 100 + i, Partitioning::Balanced)]).await.unwrap();
        }
        let policy = overflowing_policy();
        // The dispatcher's first read fails: the router and every connector are in Error.
        sim.fail_nth(FaultOp::Read, 1, std::io::ErrorKind::Other);
        let router = start_router(&wal, &sink, policy);
        eventually(Duration::from_secs(30), "router error", || router.status().status == Status::Error).await;
        for c in ["x", "y", "z"] {
            assert_eq!(router.connector_status(c), Status::Error, "{c}: the log reader serves every connector");
        }
        eventually(Duration::from_secs(10), "delivered", || sink.ids(&x).len() == 4 && sink.ids(&y).len() == 4).await;
        eventually(Duration::from_secs(30), "running", || router.status().status == Status::Running).await;
        assert_eq!((router.connector_status("x"), router.connector_status("y")), (Status::Running, Status::Running));

        // x's lane overflows to the log while its sends fail (y has nothing to send), then
        // its re-read fails.
        sink.client_fault(Some(SendErrorKind::Disconnected));
        for i in 4..24u64 {
            wal.append(vec![record_from("x", &x, i, Partitioning::Balanced)]).await.unwrap();
        }
        let lane_x = |router: &Router| router.destinations_of("x").into_iter().next();
        eventually(Duration::from_secs(10), "x overflowed", || {
            lane_x(&router).is_some_and(|l| l.overflowed && l.held_records == 20 && l.status == Status::Degraded)
        })
        .await;
        assert_eq!(router.connector_status("x"), Status::Degraded);
        assert_eq!(router.connector_status("y"), Status::Running, "y shows x's degraded destination");
        sim.fail_nth(FaultOp::Read, 1, std::io::ErrorKind::Other);
        sink.client_fault(None);
        eventually(Duration::from_secs(10), "x's lane in error", || {
            lane_x(&router).is_some_and(|l| l.status == Status::Error) && router.status().status == Status::Error
        })
        .await;
        assert_eq!(router.connector_status("x"), Status::Error);
        assert_eq!(router.connector_status("y"), Status::Running, "y shows x's destination that cannot read the log");
        eventually(Duration::from_secs(10), "x drained", || sink.ids(&x).len() == 24).await;
        eventually(Duration::from_secs(30), "running", || router.status().status == Status::Running).await;
        assert_eq!((router.connector_status("x"), router.connector_status("y")), (Status::Running, Status::Running));
        router.shutdown().await;
    });
}

/// A cursor store that fails (or panics) on command: a test double of the state database.
#[derive(Default)]
struct FailingCursorStore {
    inner: MemoryCursorStore,
    failing: std::sync::atomic::AtomicBool,
    panicking: std::sync::atomic::AtomicBool,
    /// Stores refused.
    refused: std::sync::atomic::AtomicU64,
}

impl router::CursorStore for FailingCursorStore {
    fn load(&self) -> Result<std::collections::HashMap<router::LaneKey, u64>, String> {
        self.inner.load()
    }

    async fn store(&self, cursors: Vec<(router::LaneKey, u64)>) -> Result<(), String> {
        if self.panicking.load(std::sync::atomic::Ordering::Acquire) {
            panic!("injected panic in a cursor store");
        }
        if self.failing.load(std::sync::atomic::Ordering::Acquire) {
            self.refused.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            return Err("injected cursor store failure".into());
        }
        self.inner.store(cursors).await
    }

    fn lower(&self, cursors: Vec<(router::LaneKey, u64)>) -> Result<(), String> {
        if self.failing.load(std::sync::atomic::Ordering::Acquire) {
            return Err("injected cursor store failure".into());
        }
        self.inner.lower(cursors)
    }

    fn forget(&self, cursors: Vec<(router::LaneKey, u64)>) -> Result<(), String> {
        if self.failing.load(std::sync::atomic::Ordering::Acquire) {
            return Err("injected cursor store failure".into());
        }
        self.inner.forget(cursors)
    }
}

/// A cursor ahead of the log that cannot be lowered in the store refuses the start: run
/// with it in memory only, a later store (which only raises) would keep the old value, and
/// the next start would pass over the records that reuse its offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cursor_ahead_of_the_log_that_cannot_be_lowered_refuses_the_start() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let lane = router::LaneKey { source: "test".into(), destination: key("c", "1") };
    let cursors = Arc::new(FailingCursorStore::default());
    router::CursorStore::store(&*cursors, vec![(lane.clone(), 500)]).await.unwrap();
    cursors.failing.store(true, std::sync::atomic::Ordering::Release);
    let refused = Router::start(wal.clone(), FaultySink::new(), cursors.clone(), Policies::uniform(fast_policy()));
    assert!(refused.unwrap_err().contains("injected cursor store failure"));
    cursors.failing.store(false, std::sync::atomic::Ordering::Release);
    let router =
        Router::start(wal.clone(), FaultySink::new(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
    assert_eq!(cursors.inner.get(&lane), Some(0));
    router.shutdown().await;
}

/// A cursor the log's start has passed that the store cannot delete does not stop the
/// start: forgetting it is housekeeping, and it stays until a later start can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passed_cursor_that_cannot_be_forgotten_does_not_stop_the_start() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let lane = router::LaneKey { source: "test".into(), destination: key("c", "passed") };
    let cursors = Arc::new(FailingCursorStore::default());
    router::CursorStore::store(&*cursors, vec![(lane.clone(), 0)]).await.unwrap();
    cursors.failing.store(true, std::sync::atomic::Ordering::Release);
    let router =
        Router::start(wal.clone(), FaultySink::new(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
    assert_eq!(cursors.inner.get(&lane), Some(0), "kept, as the store refused");
    router.shutdown().await;
    cursors.failing.store(false, std::sync::atomic::Ordering::Release);
    let router = Router::start(wal, FaultySink::new(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
    assert_eq!(cursors.inner.get(&lane), None, "forgotten at the next start");
    router.shutdown().await;
}

/// Cursors that cannot be stored pin the log although every send succeeds: the router
/// says so (Degraded, with the error, and counted) until a store succeeds again.
#[test]
fn cursors_that_cannot_be_stored_degrade_the_router_until_they_can() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("c", "1");
        let cursors = Arc::new(FailingCursorStore::default());
        cursors.failing.store(true, std::sync::atomic::Ordering::Release);
        fill(&wal, std::slice::from_ref(&d), 0, 10).await;
        let router =
            Router::start(wal.clone(), sink.clone(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
        eventually(Duration::from_secs(30), "sent", || sink.ids(&d).len() == 10).await;
        eventually(Duration::from_secs(30), "degraded", || router.status().status == Status::Degraded).await;
        assert!(router.status().reason.contains("cursors cannot be stored"), "{:?}", router.status());
        // No connector's log is released: each is Degraded, with a lane or without.
        for c in ["test", "other"] {
            assert_eq!(router.connector_status(c), Status::Degraded, "{c}: cursors that cannot be stored");
        }
        assert!(router.status().last_error.is_some());
        assert!(gauge(&snap, "iggy_connector_cursor_store_failures_total") >= 1.0);
        assert_gauges_agree(&snap, &router);
        assert_eq!(router.released_below(), 0, "released below cursors that are not stored");
        cursors.failing.store(false, std::sync::atomic::Ordering::Release);
        eventually(Duration::from_secs(10), "released", || router.released_below() == 10).await;
        eventually(Duration::from_secs(30), "running", || router.status().status == Status::Running).await;
        assert_eq!(router.connector_status("test"), Status::Running);
        assert_gauges_agree(&snap, &router);
        router.shutdown().await;
    });
}

/// Delivered log space that cannot be freed (a segment's removal fails) fills the log
/// though every destination delivers: the router says so (Degraded, with the error)
/// until a release succeeds, and then frees it. (The log counts the failure as a storage
/// error: `wal/tests/metrics.rs`.)
#[test]
fn released_space_that_cannot_be_freed_degrades_the_router_until_it_can() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("r", "1");
        fill(&wal, std::slice::from_ref(&d), 0, 600).await;
        assert!(wal.stats().segments > 2, "the records must span segments to release: {:?}", wal.stats());
        // The next three removals fail (nothing else changes the namespace meanwhile).
        for n in 1..=3 {
            sim.fail_nth(FaultOp::Metadata, n, std::io::ErrorKind::PermissionDenied);
        }
        let router = start_router(&wal, &sink, fast_policy());
        eventually(Duration::from_secs(30), "sent", || sink.ids(&d).len() == 600).await;
        eventually(Duration::from_secs(30), "degraded", || router.status().status == Status::Degraded).await;
        assert!(router.status().reason.contains("cannot be freed"), "{:?}", router.status());
        assert_eq!(router.connector_status("test"), Status::Degraded);
        assert!(router.status().last_error.is_some());
        assert_gauges_agree(&snap, &router);
        eventually(Duration::from_secs(30), "freed", || wal.stats().segments == 1).await;
        eventually(Duration::from_secs(30), "running", || router.status().status == Status::Running).await;
        assert_eq!(sim.armed_faults(), 0);
        assert_eq!(router.released_below(), 600);
        assert_gauges_agree(&snap, &router);
        router.shutdown().await;
    });
}

/// A destination is `starting` until its first send succeeds: one whose sends fail is
/// never shown running, before it turns degraded, whether its topic cannot be made or
/// exists and refuses the sends.
#[test]
fn a_destination_is_starting_until_a_send_succeeds() {
    for fault in [Fault::Fail(SendErrorKind::Destination), Fault::FailSends(SendErrorKind::Destination)] {
        starting_until_a_send_succeeds(fault);
    }
}

fn starting_until_a_send_succeeds(fault: Fault) {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let a = key("s", "a");
        sink.fault(&a, Some(fault));
        fill(&wal, std::slice::from_ref(&a), 0, 2).await;
        // Tries half a second apart at least: the look after the first is not raced by
        // the third, which degrades the lane.
        let mut policy = fast_policy();
        policy.batch.backoff_base = Duration::from_millis(500);
        let router = start_router(&wal, &sink, policy);
        let status_of_a = || router.destinations().iter().find(|l| l.destination == a).map(|l| l.status);
        // A failed try: the ensure (its topic cannot be made), or the send after it.
        let failed_try = || sink.ensured(&a) >= 1 && (matches!(fault, Fault::Fail(_)) || sink.calls(&a) >= 1);
        eventually(Duration::from_secs(30), "a failed try", failed_try).await;
        assert_eq!(status_of_a(), Some(Status::Starting), "{fault:?}: a failure, nothing sent yet");
        assert_eq!(gauge(&snap, "iggy_connector_destinations_starting"), 1.0);
        eventually(Duration::from_secs(30), "degraded", || status_of_a() == Some(Status::Degraded)).await;
        sink.fault(&a, None);
        eventually(Duration::from_secs(30), "running", || status_of_a() == Some(Status::Running)).await;
        assert_eq!(sink.ids(&a).len(), 2);
        assert_gauges_agree(&snap, &router);
        router.shutdown().await;
    });
}

/// A running destination that retries, not yet Degraded, says so in its reason (the
/// count, the threshold and the last failure), not what held at its last success; a
/// send that succeeds again gives the reason back.
#[test]
fn a_destination_retrying_before_it_is_degraded_says_so_in_its_reason() {
    with_metrics(false, |_snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let a = key("s", "a");
        fill(&wal, std::slice::from_ref(&a), 0, 2).await;
        let mut policy = fast_policy();
        policy.batch.degraded_after_failures = 1_000;
        let router = start_router(&wal, &sink, policy);
        let lane = || router.destinations().into_iter().find(|l| l.destination == a);
        eventually(Duration::from_secs(30), "the first sends", || sink.ids(&a).len() == 2).await;
        eventually(Duration::from_secs(30), "running", || lane().is_some_and(|l| l.status == Status::Running)).await;
        assert_eq!(lane().map(|l| l.status_reason), Some("send succeeded".to_string()));

        sink.client_fault(Some(SendErrorKind::Disconnected));
        fill(&wal, std::slice::from_ref(&a), 2, 2).await;
        eventually(Duration::from_secs(30), "two failed tries", || lane().is_some_and(|l| l.consecutive_failures >= 2))
            .await;
        let l = lane().unwrap();
        assert_eq!(l.status, Status::Running, "{l:?}");
        assert!(l.status_reason.starts_with("retrying: "), "{l:?}");
        assert!(l.status_reason.contains("consecutive failures (degraded at 1000)"), "{l:?}");
        assert!(l.status_reason.contains("disconnected"), "{l:?}");

        sink.client_fault(None);
        eventually(Duration::from_secs(30), "delivered", || sink.ids(&a).len() == 4).await;
        eventually(Duration::from_secs(30), "the reason given back", || {
            lane().is_some_and(|l| l.status_reason == "send succeeded")
        })
        .await;
        router.shutdown().await;
    });
}

/// The router's reason is what holds now: with two destinations degraded it names one;
/// once that one recovers it names the other, though the router stays Degraded.
#[test]
fn the_routers_reason_follows_its_troubles_while_its_status_stays() {
    with_metrics(false, |_snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let (a, b) = (key("s", "a"), key("s", "b"));
        sink.fault(&a, Some(Fault::Fail(SendErrorKind::Destination)));
        sink.fault(&b, Some(Fault::Fail(SendErrorKind::Destination)));
        fill(&wal, &[a.clone(), b.clone()], 0, 4).await;
        let router = start_router(&wal, &sink, fast_policy());
        let lane_is = |d: &router::DestinationKey, status: Status| {
            router.destinations().iter().any(|l| l.destination == *d && l.status == status)
        };
        eventually(Duration::from_secs(30), "both degraded", || {
            lane_is(&a, Status::Degraded) && lane_is(&b, Status::Degraded)
        })
        .await;
        let reason = router.status().reason;
        assert!(reason.contains("s/a") && reason.contains("degraded"), "{reason}");
        sink.fault(&a, None);
        eventually(Duration::from_secs(30), "a delivered", || sink.ids(&a).len() == 2).await;
        eventually(Duration::from_secs(30), "a running", || lane_is(&a, Status::Running)).await;
        let now = router.status();
        assert_eq!(now.status, Status::Degraded);
        assert!(now.reason.contains("s/b") && !now.reason.contains("s/a"), "{now:?}");
        router.shutdown().await;
    });
}

/// A release ceiling held back by a failure (the daemon's idempotency checkpoints
/// failing) keeps delivered records in the log, which fills though every destination
/// delivers: the router says so, naming the ceiling and the failure, until the store
/// lets go, and then releases.
#[test]
fn a_release_ceiling_held_by_a_failure_degrades_the_router_until_it_moves() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("r", "1");
        fill(&wal, std::slice::from_ref(&d), 0, 600).await;
        let cursors = Arc::new(MemoryCursorStore::new());
        cursors.set_release_ceiling(0);
        cursors.set_release_held_by(Some("idempotency checkpoints fail: disk I/O error"));
        let router =
            Router::start(wal.clone(), sink.clone(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
        eventually(Duration::from_secs(30), "sent", || sink.ids(&d).len() == 600).await;
        eventually(Duration::from_secs(30), "degraded", || router.status().status == Status::Degraded).await;
        let reason = router.status().reason;
        assert!(reason.contains("not released past offset 0") && reason.contains("disk I/O error"), "{reason}");
        assert_eq!(router.connector_status("test"), Status::Degraded);
        assert_eq!(router.released_below(), 0);
        assert_gauges_agree(&snap, &router);
        cursors.set_release_held_by(None);
        cursors.set_release_ceiling(u64::MAX);
        eventually(Duration::from_secs(30), "running", || router.status().status == Status::Running).await;
        eventually(Duration::from_secs(30), "released", || router.released_below() == 600).await;
        assert_gauges_agree(&snap, &router);
        // A failure the store reports while its ceiling holds nothing back (delivery is
        // behind it) is no trouble of the router's: more records, held at their
        // destination, below a ceiling far above them.
        sink.fault(&d, Some(Fault::Fail(SendErrorKind::Unavailable)));
        cursors.set_release_held_by(Some("idempotency checkpoints fail: disk I/O error"));
        fill(&wal, std::slice::from_ref(&d), 600, 10).await;
        tokio::time::sleep(Duration::from_millis(2500)).await; // two rounds of the releaser
        assert!(!router.status().reason.contains("not released"), "{:?}", router.status());
        router.shutdown().await;
    });
}

/// A record the destination cap refuses under `error` holds the log; no lane counts it as
/// held, so the admission gauge is what says so. Under `drop` nothing is held.
#[test]
fn a_record_held_by_admission_shows_in_its_gauge_and_the_status() {
    for (on, held) in [(router::OnAdmissionFailure::Error, 1.0), (router::OnAdmissionFailure::Drop, 0.0)] {
        with_metrics(false, |snap| async move {
            let sim = SimStorage::new();
            let wal = open_wal(&sim);
            let sink = FaultySink::new();
            // Source "test" (`fill`'s): one destination admitted, the other refused.
            let dests = [key("a", "1"), key("a", "2")];
            let other = key("b", "1");
            fill(&wal, &dests, 0, 4).await;
            wal.append(vec![record_from("b", &other, 100, Partitioning::Balanced)]).await.unwrap();
            let mut policy = fast_policy();
            policy.max_destinations = 1;
            policy.on_admission_failure = on;
            let router =
                Router::start(wal.clone(), sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(policy))
                    .unwrap();
            eventually(Duration::from_secs(30), "admitted delivered", || {
                sink.ids(&dests[0]).len() == 2 && sink.ids(&other).len() == 1
            })
            .await;
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert_eq!(gauge(&snap, "iggy_connector_admission_held"), held, "{on:?}");
            assert_eq!(router.held_from().is_some(), held == 1.0, "{on:?}");
            // Held, the log fills from there though every destination delivers: the
            // router and the refused records' source say so, naming the offset; the
            // other source is not held up by it. Dropped, nothing is held.
            let status = router.status();
            if held == 1.0 {
                assert_eq!(status.status, Status::Degraded, "{on:?}: {status:?}");
                let offset = router.held_from().unwrap();
                assert!(status.reason.contains(&format!("held from offset {offset}")), "{status:?}");
                assert!(status.reason.contains("max_destinations = 1"), "{status:?}");
                assert_eq!(router.connector_status("test"), Status::Degraded);
            } else {
                assert_eq!(status.status, Status::Running, "{on:?}: {status:?}");
                assert_eq!(router.connector_status("test"), Status::Running);
            }
            assert_eq!(router.connector_status("b"), Status::Running, "{on:?}");
            assert_gauges_agree(&snap, &router);
            // A stop waits for a send in flight (to a destination that never answers,
            // until the result timeout): meanwhile the gauge and the status agree, and
            // once the router stopped neither shows a hold.
            sink.fault(&other, Some(Fault::BlackHole));
            wal.append(vec![record_from("b", &other, 101, Partitioning::Balanced)]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(300)).await;
            let during = async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                assert_eq!(router.status().status, Status::Stopping, "{on:?}: the stop waits for the send");
                (gauge(&snap, "iggy_connector_admission_held"), router.held_from().is_some())
            };
            let ((), (gauge_during, held_during)) = tokio::join!(router.shutdown(), during);
            assert_eq!((gauge_during, held_during), (held, held == 1.0), "{on:?}: while stopping");
            assert_eq!(gauge(&snap, "iggy_connector_admission_held"), 0.0, "{on:?}: stopped");
            assert_eq!(router.held_from(), None, "{on:?}: stopped");
        });
    }
}

/// A log closed under a running router (its writer stopped) ends the dispatcher's
/// reading: the router says so (Error, naming the closed log), and a hold the dispatcher
/// kept is still shown by its gauge as by the status, which agree.
#[test]
fn a_log_closed_under_the_router_puts_it_in_error_and_keeps_its_hold_shown() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let dests = [key("a", "1"), key("a", "2")];
        fill(&wal, &dests, 0, 4).await;
        let mut policy = fast_policy();
        policy.max_destinations = 1;
        policy.on_admission_failure = router::OnAdmissionFailure::Error;
        let router =
            Router::start(wal.clone(), sink.clone(), Arc::new(MemoryCursorStore::new()), Policies::uniform(policy))
                .unwrap();
        eventually(Duration::from_secs(30), "admitted delivered", || sink.ids(&dests[0]).len() == 2).await;
        eventually(Duration::from_secs(10), "held", || router.held_from().is_some()).await;
        assert_eq!(gauge(&snap, "iggy_connector_admission_held"), 1.0);
        wal.close().await.unwrap();
        eventually(Duration::from_secs(10), "the router in error", || router.status().status == Status::Error).await;
        let status = router.status();
        assert!(status.reason.contains("log is closed"), "{status:?}");
        assert!(router.held_from().is_some());
        assert_eq!(gauge(&snap, "iggy_connector_admission_held"), 1.0, "the gauge and the status disagree");
        assert_gauges_agree(&snap, &router);
        router.shutdown().await;
        assert_eq!(gauge(&snap, "iggy_connector_admission_held"), 0.0, "stopped");
    });
}

/// A task of the router that ends by a panic is gone until a restart, and the router says
/// so instead of reporting Running over work nobody does: a lane's panic puts that
/// destination, its connector and the router in Error (another connector keeps Running);
/// the cursor flusher's puts every connector in Error.
#[test]
fn a_router_task_that_panics_puts_the_router_in_error() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let (x, y) = (key("x", "1"), key("y", "1"));
        sink.fault(&x, Some(Fault::Panic));
        for i in 0..4u64 {
            wal.append(vec![record_from("x", &x, i, Partitioning::Balanced)]).await.unwrap();
            wal.append(vec![record_from("y", &y, 100 + i, Partitioning::Balanced)]).await.unwrap();
        }
        let cursors = Arc::new(FailingCursorStore::default());
        let router =
            Router::start(wal.clone(), sink.clone(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
        eventually(Duration::from_secs(10), "y delivered", || sink.ids(&y).len() == 4).await;
        eventually(Duration::from_secs(30), "router error", || router.status().status == Status::Error).await;
        assert!(router.status().reason.contains("x -> x/1"), "{:?}", router.status());
        let lane_x = router.destinations_of("x").into_iter().next().map(|l| l.status);
        assert_eq!(lane_x, Some(Status::Error));
        assert_eq!(router.connector_status("x"), Status::Error);
        assert_eq!(router.connector_status("y"), Status::Running, "y shows x's lane");
        assert_gauges_agree(&snap, &router);
        assert_eq!(router.released_below(), 0, "x's records are held");

        // The cursor flusher panics at its next store: every connector is in Error.
        cursors.panicking.store(true, std::sync::atomic::Ordering::Release);
        wal.append(vec![record_from("y", &y, 104, Partitioning::Balanced)]).await.unwrap();
        eventually(Duration::from_secs(10), "y's last delivered", || sink.ids(&y).len() == 5).await;
        eventually(Duration::from_secs(30), "y in error", || router.connector_status("y") == Status::Error).await;
        let last_error = router.status().last_error.map(|(e, _)| e);
        assert!(last_error.as_deref().is_some_and(|e| e.contains("cursor flusher")), "{:?}", router.status());
        assert_eq!(router.status().status, Status::Error);
        assert_gauges_agree(&snap, &router);
        router.shutdown().await;
    });
}

/// A lane whose task panics while its breaker is open or half-open takes its breaker with
/// it: the destination's breaker in the status agrees with the gauge of open breakers.
#[test]
fn a_lane_that_panics_with_its_breaker_open_shows_the_breaker_as_the_gauge_counts_it() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("p", "1");
        sink.fault(&d, Some(Fault::Fail(SendErrorKind::Destination)));
        fill(&wal, std::slice::from_ref(&d), 0, 3).await;
        let router = Router::start(wal.clone(), sink.clone(), Arc::new(MemoryCursorStore::new()), {
            Policies::uniform(fast_policy())
        })
        .unwrap();
        let breaker = |router: &Router| router.destinations().first().map(|l| l.breaker);
        eventually(Duration::from_secs(10), "the breaker open", || breaker(&router) == Some("open")).await;
        assert_eq!(gauge(&snap, "iggy_connector_destination_circuit_open"), 1.0);
        // Its probe, once the cool-down ends, panics.
        sink.fault(&d, Some(Fault::Panic));
        eventually(Duration::from_secs(30), "the lane in error", || {
            router.destinations().first().is_some_and(|l| l.status == Status::Error)
        })
        .await;
        let open = gauge(&snap, "iggy_connector_destination_circuit_open");
        assert_eq!(open, 0.0, "a breaker counted open with no lane to hold it");
        assert_eq!(breaker(&router), Some("closed"), "the status shows a breaker the gauge does not count");
        router.shutdown().await;
    });
}

/// A lane whose task panics in a send lets go of its batches with it: neither its
/// destination's `batch_bytes` nor the router's queued bytes count memory that was freed.
#[test]
fn a_lane_that_panics_in_a_send_keeps_no_batch_bytes_counted() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("p", "1");
        sink.fault(&d, Some(Fault::Panic));
        fill(&wal, std::slice::from_ref(&d), 0, 3).await;
        let router = start_router(&wal, &sink, fast_policy());
        eventually(Duration::from_secs(30), "the lane in error", || {
            router.destinations().first().is_some_and(|l| l.status == Status::Error)
        })
        .await;
        let lane = router.destinations().remove(0);
        assert_eq!(lane.batch_bytes, 0, "a batch counted that went with the task");
        assert_eq!(router.queued_bytes().0, lane.queued_bytes, "the budget counts more than the lane's queue");
        router.publish_held_gauges();
        assert_eq!(gauge(&snap, "iggy_connector_queued_bytes"), lane.queued_bytes as f64);
        router.shutdown().await;
    });
}

/// Storing cursors that keeps failing backs off, up to 25.6 s between tries. A stop
/// does not wait that out (the daemon's grace period would abandon the router): the
/// flusher tries once more and ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_does_not_wait_out_the_cursor_stores_backoff() {
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let d = key("c", "1");
    let cursors = Arc::new(FailingCursorStore::default());
    cursors.failing.store(true, std::sync::atomic::Ordering::Release);
    let router = Router::start(wal.clone(), sink.clone(), cursors.clone(), Policies::uniform(fast_policy())).unwrap();
    wal.append(vec![record(&d, 0, Partitioning::Balanced)]).await.unwrap();
    // The fifth refusal starts a backoff of 3.2 s.
    eventually(Duration::from_secs(20), "five stores refused", || {
        cursors.refused.load(std::sync::atomic::Ordering::Acquire) >= 5
    })
    .await;
    let asked = std::time::Instant::now();
    router.shutdown().await;
    // Well under the backoff, with room for a busy machine.
    assert!(asked.elapsed() < Duration::from_secs(2), "the stop took {:?}", asked.elapsed());
    assert_eq!(sink.ids(&d).len(), 1);
}

/// The latency histograms time calls that succeeded: a failed ensure or send (refused
/// at once, or timed out) is counted in `send_failures_total` and would read as a fast,
/// or a slow, server. Calls fail first at the client (the ensure too), then only sends.
#[test]
fn failed_calls_are_counted_as_failures_and_not_timed() {
    with_metrics(false, |snap| async move {
        let sim = SimStorage::new();
        let wal = open_wal(&sim);
        let sink = FaultySink::new();
        let d = key("t", "1");
        fill(&wal, std::slice::from_ref(&d), 0, 4).await;
        let count = |name: &str| metric(&snap, &format!("{name}_count"), "");
        let (sends, creates) =
            ("iggy_connector_send_latency_seconds", "iggy_connector_destination_create_latency_seconds");
        let failures = || metric(&snap, "iggy_connector_send_failures_total", "");
        sink.client_fault(Some(SendErrorKind::Disconnected));
        let router = start_router(&wal, &sink, overflowing_policy());
        eventually(Duration::from_secs(30), "failed ensures", || failures() >= 2.0).await;
        assert_eq!((count(creates), count(sends)), (0.0, 0.0), "failed ensures timed");

        sink.client_fault(None);
        sink.fault(&d, Some(Fault::FailSends(SendErrorKind::Disconnected)));
        let before = failures();
        eventually(Duration::from_secs(30), "failed sends", || failures() >= before + 2.0).await;
        assert!(count(creates) >= 1.0, "the ensure that succeeded is timed");
        assert_eq!(count(sends), 0.0, "failed sends timed");

        sink.fault(&d, None);
        eventually(Duration::from_secs(30), "delivered", || sink.ids(&d).len() == 4).await;
        assert!(count(sends) >= 1.0, "the sends that succeeded are timed");
        router.shutdown().await;
    });
}
