//! The router and its Iggy sink over Iggy's wire protocol, against the test broker:
//! the daemon's real `iggy` client, its reconnection and its error mapping, with faults
//! injected on command.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use e2e::{eventually, record, sim_wal};
use ingest::envelope::Partitioning;
use router::iggy_sink::{IggySink, IggySinkConfig, TopicDefaults};
use router::status::Status;
use router::test_doubles::MemoryCursorStore;
use router::{OnAdmissionFailure, Policies, Router, RouterPolicy};
use test_broker::{RequestKind, TestBroker, TestBrokerConfig};

fn sink(addr: std::net::SocketAddr, partitions: u32) -> Arc<IggySink> {
    let config = IggySinkConfig {
        address: addr.to_string(),
        reconnection_interval: Duration::from_millis(100),
        topic_defaults: TopicDefaults { partitions_count: partitions, ..TopicDefaults::default() },
        ..IggySinkConfig::default()
    };
    Arc::new(IggySink::new(&config).expect("sink"))
}

fn policy() -> RouterPolicy {
    let mut p = RouterPolicy::default();
    p.batch.linger = Duration::from_millis(2);
    p.batch.result_timeout = Duration::from_secs(3);
    p.batch.backoff_base = Duration::from_millis(50);
    p.batch.backoff_max = Duration::from_millis(500);
    p.batch.degraded_after_failures = 3;
    p.breaker.failure_threshold = 3;
    p.breaker.cool_down = Duration::from_secs(1);
    p
}

fn ids(broker: &TestBroker, s: &str, t: &str) -> Vec<u128> {
    broker.messages(s, t).iter().map(|m| m.id).collect()
}

/// A router over a fresh log delivering to `broker`, once one record of `stream/topic`
/// was delivered (the destination exists and the client is connected).
async fn start_warm(broker: &TestBroker, stream: &str, topic: &str) -> (Arc<wal::Wal>, Router) {
    start_warm_with(broker, stream, topic, policy()).await
}

async fn start_warm_with(
    broker: &TestBroker,
    stream: &str,
    topic: &str,
    policy: RouterPolicy,
) -> (Arc<wal::Wal>, Router) {
    let wal = sim_wal();
    let router = Router::start(
        wal.clone(),
        sink(broker.addr(), 1),
        Arc::new(MemoryCursorStore::new()),
        Policies::uniform(policy),
    )
    .unwrap();
    wal.append(vec![record(stream, topic, 0, Partitioning::Balanced)]).await.unwrap();
    eventually(Duration::from_secs(20), "warm", || async { ids(broker, stream, topic).len() == 1 }).await;
    (wal, router)
}

/// Appends the records numbered `numbers` to `stream`, one an append, balanced: an even
/// number's to topic `topics.0`, an odd one's to `topics.1`.
async fn append_alternating(wal: &wal::Wal, stream: &str, topics: (&str, &str), numbers: std::ops::Range<u64>) {
    for n in numbers {
        let topic = if n % 2 == 0 { topics.0 } else { topics.1 };
        wal.append(vec![record(stream, topic, n, Partitioning::Balanced)]).await.unwrap();
    }
}

/// Watches every destination's breaker for `hold`, failing the test the moment one is
/// not closed: `cause` (the server's fault) opened it. A router with no lane has no
/// breaker to watch: that fails it too. Returns the most consecutive failures a lane
/// had meanwhile, so a caller can check that the fault was met at all.
async fn no_breaker_opens_for(router: &Router, hold: Duration, cause: &str) -> u32 {
    let until = std::time::Instant::now() + hold;
    let mut most_failures = 0;
    while std::time::Instant::now() < until {
        assert!(!router.destinations().is_empty(), "no lane to watch while {cause}");
        for d in router.destinations() {
            assert_eq!(d.breaker, "closed", "{}: {cause} opened a breaker", d.destination);
            most_failures = most_failures.max(d.consecutive_failures);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    most_failures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_reach_their_topics_with_ids_headers_and_order_and_topics_are_durable() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let wal = sim_wal();
    let topics = ["orders", "users", "audit"];
    for n in 0..300u64 {
        wal.append(vec![record("events", topics[(n % 3) as usize], n, Partitioning::Balanced)]).await.unwrap();
    }
    let router =
        Router::start(wal, sink(broker.addr(), 1), Arc::new(MemoryCursorStore::new()), Policies::uniform(policy()))
            .unwrap();
    eventually(Duration::from_secs(30), "delivered", || async {
        topics.iter().all(|t| ids(&broker, "events", t).len() == 100)
    })
    .await;
    for (k, t) in topics.iter().enumerate() {
        let want: Vec<u128> = (0..100u64).map(|i| u128::from(i * 3 + k as u64) + 1).collect();
        assert_eq!(ids(&broker, "events", t), want, "{t}");
        let opts = broker.topic_options("events", t).expect("options");
        assert_eq!(opts.enforce_fsync, Some(true));
        assert_eq!(opts.messages_required_to_save, Some(1));
    }
    let m = &broker.messages("events", "users")[0];
    let header = |name: &str| {
        m.headers.iter().find(|(k, _)| k.as_bytes() == name.as_bytes()).map(|(_, v)| v.as_bytes().to_vec())
    };
    assert_eq!(header("x-n"), Some(b"1".to_vec()));
    assert_eq!(header("iggy-ingest-source"), Some(b"e2e".to_vec()));
    assert_eq!(header("content-type"), Some(b"application/json".to_vec()));
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_id_lands_in_that_partition() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let wal = sim_wal();
    for n in 0..30u64 {
        wal.append(vec![record("p", "t", n, Partitioning::PartitionId((n % 3) as u32))]).await.unwrap();
    }
    let router =
        Router::start(wal, sink(broker.addr(), 3), Arc::new(MemoryCursorStore::new()), Policies::uniform(policy()))
            .unwrap();
    eventually(Duration::from_secs(30), "delivered", || async { ids(&broker, "p", "t").len() == 30 }).await;
    for m in broker.messages("p", "t") {
        assert_eq!(u128::from(m.partition_id), (m.id - 1) % 3, "message {} in the wrong partition", m.id);
    }
    router.shutdown().await;
}

/// A record whose partition id the topic lacks is held (`on_admission_failure = "error"`)
/// and goes out once an operator adds partitions: the sink asks the server again after
/// each cool-down instead of answering from what it learnt before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_held_for_a_missing_partition_goes_out_once_the_topic_grows() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let wal = sim_wal();
    wal.append(vec![record("g", "t", 0, Partitioning::PartitionId(0))]).await.unwrap();
    wal.append(vec![record("g", "t", 1, Partitioning::PartitionId(2))]).await.unwrap();
    let router =
        Router::start(wal, sink(broker.addr(), 1), Arc::new(MemoryCursorStore::new()), Policies::uniform(policy()))
            .unwrap();
    eventually(Duration::from_secs(30), "the first delivered", || async { ids(&broker, "g", "t") == vec![1] }).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(ids(&broker, "g", "t"), vec![1], "a record for a partition the topic lacks went out");
    assert!(broker.grow_partitions("g", "t", 3));
    eventually(Duration::from_secs(30), "delivered after the topic grew", || async {
        ids(&broker, "g", "t") == vec![1, 2]
    })
    .await;
    assert_eq!(broker.messages("g", "t")[1].partition_id, 2);
    eventually(Duration::from_secs(10), "running", || async { router.status().status == Status::Running }).await;
    router.shutdown().await;
}

/// A partition an operator added after the lane learnt the topic's partition count is
/// used at once, under `on_admission_failure = "drop"` too: the lane asks the server
/// again before it takes a record for out of range, so a record whose partition exists
/// is delivered, never dropped after its 200. A partition that really does not exist
/// is still dropped, as configured.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_added_since_the_count_was_learnt_is_delivered_not_dropped() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let mut p = policy();
    p.on_admission_failure = OnAdmissionFailure::Drop;
    let wal = sim_wal();
    let router =
        Router::start(wal.clone(), sink(broker.addr(), 1), Arc::new(MemoryCursorStore::new()), Policies::uniform(p))
            .unwrap();
    // Delivered to partition 0: the lane now knows the topic as one partition.
    wal.append(vec![record("n", "t", 0, Partitioning::PartitionId(0))]).await.unwrap();
    eventually(Duration::from_secs(20), "the first delivered", || async { ids(&broker, "n", "t") == vec![1] }).await;
    let lane = || router.destinations().into_iter().find(|d| d.destination.topic == "t").expect("the lane");
    assert_eq!(lane().partitions_count, Some(1));
    assert!(broker.grow_partitions("n", "t", 3));
    wal.append(vec![record("n", "t", 1, Partitioning::PartitionId(2))]).await.unwrap();
    // Delivered, or disposed of (the log released past it without a delivery).
    eventually(Duration::from_secs(20), "the record for partition 2 settled", || async {
        ids(&broker, "n", "t").len() == 2 || router.released_below() == 2
    })
    .await;
    assert_eq!(ids(&broker, "n", "t"), vec![1, 2], "a record for a partition the topic has was dropped");
    assert_eq!(broker.messages("n", "t")[1].partition_id, 2);
    assert_eq!((lane().rejected_records, lane().partitions_count), (0, Some(3)));
    // A partition the topic does not have: dropped, counted, and the records after it go on.
    wal.append(vec![record("n", "t", 2, Partitioning::PartitionId(5))]).await.unwrap();
    wal.append(vec![record("n", "t", 3, Partitioning::PartitionId(1))]).await.unwrap();
    eventually(Duration::from_secs(20), "released past the dropped record", || async { router.released_below() == 4 })
        .await;
    assert_eq!(ids(&broker, "n", "t"), vec![1, 2, 4]);
    assert_eq!(lane().rejected_records, 1);
    router.shutdown().await;
}

/// Balanced records use partitions an operator added while the daemon runs, once the
/// partition count the sink places them by reaches `connection_max_age` and is asked
/// again. Without the age, every later record went on landing in the one partition the
/// topic had when the count was first learnt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balanced_records_reach_partitions_added_since_once_the_partition_count_reaches_its_age() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let max_age = Duration::from_secs(1);
    let config = IggySinkConfig {
        address: broker.addr().to_string(),
        reconnection_interval: Duration::from_millis(100),
        connection_max_age: max_age,
        ..IggySinkConfig::default()
    };
    let sink = Arc::new(IggySink::new(&config).expect("sink"));
    let wal = sim_wal();
    let router =
        Router::start(wal.clone(), sink, Arc::new(MemoryCursorStore::new()), Policies::uniform(policy())).unwrap();
    for n in 0..10u64 {
        wal.append(vec![record("a", "t", n, Partitioning::Balanced)]).await.unwrap();
    }
    eventually(Duration::from_secs(20), "the first ten delivered", || async { ids(&broker, "a", "t").len() == 10 })
        .await;
    assert!(broker.messages("a", "t").iter().all(|m| m.partition_id == 0), "a topic of one partition");
    assert!(broker.grow_partitions("a", "t", 3));
    tokio::time::sleep(max_age + Duration::from_millis(200)).await;
    // One send each (a balanced send is placed whole), so that the sends spread.
    for n in 10..40u64 {
        wal.append(vec![record("a", "t", n, Partitioning::Balanced)]).await.unwrap();
        let want = n as usize + 1;
        eventually(Duration::from_secs(20), "delivered one by one", || async { ids(&broker, "a", "t").len() >= want })
            .await;
    }
    assert_eq!(ids(&broker, "a", "t").len(), 40);
    let used: BTreeSet<u32> = broker.messages("a", "t")[10..].iter().map(|m| m.partition_id).collect();
    assert_eq!(used, BTreeSet::from([0, 1, 2]), "the partitions added were not used");
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_is_held_and_everything_arrives_after_it() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let (wal, router) = start_warm(&broker, "o", "a").await;
    broker.stop().await;
    append_alternating(&wal, "o", ("a", "b"), 1..500).await;
    eventually(Duration::from_secs(30), "degraded", || async { router.status().status == Status::Degraded }).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(router.released_below(), 1, "log released during the outage");
    broker.restart().await.unwrap();
    eventually(Duration::from_secs(60), "drained", || async {
        ids(&broker, "o", "a").iter().collect::<BTreeSet<_>>().len() == 250
            && ids(&broker, "o", "b").iter().collect::<BTreeSet<_>>().len() == 250
    })
    .await;
    // At least once: duplicates may only repeat an id already sent, never reorder.
    for (t, parity) in [("a", 0u64), ("b", 1)] {
        let got = ids(&broker, "o", t);
        let mut dedup: Vec<u128> = Vec::new();
        for id in got {
            if !dedup.contains(&id) {
                dedup.push(id);
            }
        }
        let want: Vec<u128> = (0..500u64).filter(|n| n % 2 == parity).map(|n| u128::from(n) + 1).collect();
        assert_eq!(dedup, want, "topic {t}");
    }
    eventually(Duration::from_secs(20), "running", || async { router.status().status == Status::Running }).await;
    eventually(Duration::from_secs(20), "released", || async { router.released_below() == 500 }).await;
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_topic_opens_its_breaker_while_the_others_flow() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let (wal, router) = start_warm(&broker, "f", "bad").await;
    broker.fail_topic("f", "bad", Some(iggy::prelude::IggyError::Error));
    append_alternating(&wal, "f", ("bad", "good"), 1..401).await;
    eventually(Duration::from_secs(30), "good delivered", || async { ids(&broker, "f", "good").len() == 200 }).await;
    eventually(Duration::from_secs(30), "breaker open", || async {
        router.destinations().iter().any(|d| d.destination.topic == "bad" && d.breaker == "open")
    })
    .await;
    assert_eq!(ids(&broker, "f", "bad").len(), 1);
    broker.fail_topic("f", "bad", None);
    eventually(Duration::from_secs(30), "bad delivered", || async { ids(&broker, "f", "bad").len() == 201 }).await;
    let want: Vec<u128> = (0..401u64).filter(|n| n % 2 == 0).map(|n| u128::from(n) + 1).collect();
    assert_eq!(ids(&broker, "f", "bad"), want);
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_starts_while_the_broker_is_unreachable_and_delivers_once_it_appears() {
    // Find a free port, then leave it empty.
    let probe = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let addr = probe.addr();
    probe.stop().await;
    drop(probe);
    let wal = sim_wal();
    let router =
        Router::start(wal.clone(), sink(addr, 1), Arc::new(MemoryCursorStore::new()), Policies::uniform(policy()))
            .unwrap();
    for n in 0..50u64 {
        wal.append(vec![record("late", "t", n, Partitioning::Balanced)]).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(router.released_below(), 0);
    let broker = TestBroker::start_at(TestBrokerConfig::default(), addr).await.unwrap();
    eventually(Duration::from_secs(30), "delivered", || async {
        ids(&broker, "late", "t").iter().collect::<BTreeSet<_>>().len() == 50
    })
    .await;
    router.shutdown().await;
}

/// A connection attempt cut short by the router's result timeout (here: the broker holds
/// every answer, the sign-in's too, longer than the timeout) must not leave the client
/// believing it is connected or connecting: once the broker answers promptly again,
/// delivery resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_attempt_cut_short_by_the_result_timeout_does_not_wedge_the_client() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let (wal, router) = start_warm(&broker, "w", "t").await;
    broker.stop().await;
    for n in 1..100u64 {
        wal.append(vec![record("w", "t", n, Partitioning::Balanced)]).await.unwrap();
    }
    eventually(Duration::from_secs(30), "degraded", || async { router.status().status == Status::Degraded }).await;
    // The broker comes back, but answers nothing within the result timeout (3 s): the
    // reconnection's sign-in is cut short, more than once.
    let accepted = broker.accepted_connections();
    broker.set_delay(Duration::from_secs(8));
    broker.restart().await.unwrap();
    eventually(Duration::from_secs(60), "attempts cut short by the result timeout", || async {
        broker.accepted_connections() > accepted
            && router
                .destinations()
                .iter()
                .any(|d| d.last_error.as_deref().is_some_and(|e| e.contains("result timeout")))
    })
    .await;
    broker.set_delay(Duration::ZERO);
    eventually(Duration::from_secs(60), "drained after the broker answers again", || async {
        ids(&broker, "w", "t").iter().collect::<BTreeSet<_>>().len() == 100
    })
    .await;
    eventually(Duration::from_secs(20), "running", || async { router.status().status == Status::Running }).await;
    router.shutdown().await;
}

/// A server that takes TCP connections but does not answer the sign-in (here: 25 s late)
/// fails every destination alike: the lanes' result timeouts while connecting open no
/// breaker, and delivery resumes once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn result_timeouts_while_connecting_open_no_breaker() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let (wal, router) = start_warm(&broker, "c", "t").await;
    broker.stop().await;
    for n in 1..20u64 {
        wal.append(vec![record("c", "t", n, Partitioning::Balanced)]).await.unwrap();
    }
    eventually(Duration::from_secs(30), "degraded", || async { router.status().status == Status::Degraded }).await;
    broker.set_delay(Duration::from_secs(25));
    broker.restart().await.unwrap();
    // Four result timeouts (3 s each) and more: a breaker counting them would open at three.
    let watched = tokio::time::Instant::now();
    let mut timeouts_seen = false;
    while watched.elapsed() < Duration::from_secs(14) {
        for d in router.destinations() {
            assert_ne!(d.breaker, "open", "a breaker opened while the client was connecting: {d:?}");
            timeouts_seen |= d.last_error.as_deref().is_some_and(|e| e.contains("result timeout"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(timeouts_seen, "no call was cut short by the result timeout");
    broker.set_delay(Duration::ZERO);
    eventually(Duration::from_secs(60), "drained once the server answers", || async {
        ids(&broker, "c", "t").iter().collect::<BTreeSet<_>>().len() == 20
    })
    .await;
    eventually(Duration::from_secs(20), "running", || async { router.status().status == Status::Running }).await;
    router.shutdown().await;
}

/// A reconnection slower than the router's result timeout (here: the broker answers every
/// request 2 s late, so signing in, reading the cluster metadata and the pings take longer
/// than the 7 s timeout, while each send fits within it) must still complete. Connects
/// cut short by the lanes' timeouts one after another never finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnection_slower_than_the_result_timeout_still_completes() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    // Every reply 2 s late: a reconnection (sign-in, cluster metadata, the client's first
    // heartbeat, the sink's pings) takes about 8 s, longer than the result timeout; the
    // first send on a new connection (the topic's partitions, then the send, perhaps
    // behind a heartbeat) at most about 6 s, within it.
    let mut p = policy();
    p.batch.result_timeout = Duration::from_secs(7);
    let (wal, router) = start_warm_with(&broker, "s", "t", p).await;
    broker.stop().await;
    for n in 1..100u64 {
        wal.append(vec![record("s", "t", n, Partitioning::Balanced)]).await.unwrap();
    }
    eventually(Duration::from_secs(30), "degraded", || async { router.status().status == Status::Degraded }).await;
    broker.set_delay(Duration::from_secs(2));
    broker.restart().await.unwrap();
    eventually(Duration::from_secs(90), "drained through the slow broker", || async {
        ids(&broker, "s", "t").iter().collect::<BTreeSet<_>>().len() == 100
    })
    .await;
    eventually(Duration::from_secs(30), "running", || async { router.status().status == Status::Running }).await;
    broker.set_delay(Duration::ZERO);
    router.shutdown().await;
}

/// A destination that never answers holds only itself: the `iggy` client runs one
/// request at a time per connection, so each call takes a connection of its own, and the
/// other destinations' sends neither wait behind it nor count its silence against their
/// breakers. Its own breaker opens (the server answers the others meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_that_never_answers_holds_only_itself() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let (wal, router) = start_warm(&broker, "h", "bad").await;
    broker.black_hole_topic("h", "bad", true);
    append_alternating(&wal, "h", ("bad", "good"), 1..201).await;
    let good_breaker =
        || router.destinations().iter().find(|d| d.destination.topic == "good").map_or("none", |d| d.breaker);
    let deadline = std::time::Instant::now() + Duration::from_secs(8);
    while ids(&broker, "h", "good").len() < 100 {
        assert!(std::time::Instant::now() < deadline, "good delivered only {}", ids(&broker, "h", "good").len());
        assert_eq!(good_breaker(), "closed", "good's breaker counted bad's silence");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eventually(Duration::from_secs(30), "bad's breaker open", || async {
        router.destinations().iter().any(|d| d.destination.topic == "bad" && d.breaker == "open")
    })
    .await;
    assert_eq!(good_breaker(), "closed");
    broker.black_hole_topic("h", "bad", false);
    eventually(Duration::from_secs(30), "bad delivered", || async { ids(&broker, "h", "bad").len() == 101 }).await;
    let want: Vec<u128> = (0..201u64).filter(|n| n % 2 == 0).map(|n| u128::from(n) + 1).collect();
    assert_eq!(ids(&broker, "h", "bad"), want, "in log order, each once");
    router.shutdown().await;
}

/// The server goes silent while a send is waiting, shortly after it answered another
/// destination's send: the waiting send's timeout is the server's (`Unavailable`, no
/// breaker counts it), not its destination's. An answer early in the wait says nothing
/// of the server at its end; only one in the last quarter of the wait, or a ping right
/// after, does. Judged by any answer since the send began, it was counted against its
/// destination.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_gone_silent_after_answering_early_in_a_sends_wait_is_not_the_destinations_fault() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let mut p = policy();
    // The last quarter of a's wait begins at 9 s: b's answer comes well before it, also
    // on a loaded machine.
    p.batch.result_timeout = Duration::from_secs(12);
    let (wal, router) = start_warm_with(&broker, "q", "b", p).await;
    broker.black_hole_topic("q", "a", true);
    let lane = |topic: &str| router.destinations().into_iter().find(|d| d.destination.topic == topic);
    // a's send waits; then b's is answered, at about 0.3 s of a's wait.
    let a_appended = std::time::Instant::now();
    wal.append(vec![record("q", "a", 1, Partitioning::Balanced)]).await.unwrap();
    eventually(Duration::from_secs(10), "a's lane sending", || async { lane("a").is_some() }).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    wal.append(vec![record("q", "b", 2, Partitioning::Balanced)]).await.unwrap();
    eventually(Duration::from_secs(8), "b's answered", || async { ids(&broker, "q", "b").len() == 2 }).await;
    assert!(a_appended.elapsed() < Duration::from_secs(8), "b answered too late in a's wait to tell anything");
    // Then the whole server answers nothing.
    broker.set_delay(Duration::from_secs(60));
    eventually(Duration::from_secs(30), "a's send cut short", || async {
        lane("a").is_some_and(|d| d.last_error.is_some())
    })
    .await;
    let a = lane("a").unwrap();
    let error = a.last_error.clone().unwrap_or_default();
    assert!(error.contains("answered nothing"), "taken for the destination's: {error}");
    assert_eq!(a.breaker, "closed");
    broker.set_delay(Duration::ZERO);
    broker.black_hole_topic("q", "a", false);
    eventually(Duration::from_secs(30), "a delivered", || async { ids(&broker, "q", "a").len() == 1 }).await;
    router.shutdown().await;
}

/// The server stops answering writes (it still answers pings) while two destinations'
/// sends wait, shortly after it acknowledged a third destination's send: their timeouts
/// are the server's, and at most the first of them is counted by its breaker. A write
/// answered early in their wait says nothing of the server at its end; judged by any
/// write answered since a send began, both were counted, and each breaker opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_answered_early_in_a_sends_wait_does_not_make_a_stall_every_destinations_fault() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let mut p = policy();
    // The last quarter of the waits begins at 9 s: b's acknowledgement comes well before,
    // also on a loaded machine.
    p.batch.result_timeout = Duration::from_secs(12);
    p.breaker.failure_threshold = 1;
    p.breaker.cool_down = Duration::from_secs(60);
    let (wal, router) = start_warm_with(&broker, "x", "b", p).await;
    for topic in ["a", "c"] {
        wal.append(vec![record("x", topic, 0, Partitioning::Balanced)]).await.unwrap();
    }
    eventually(Duration::from_secs(20), "a and c warm", || async {
        ids(&broker, "x", "a").len() == 1 && ids(&broker, "x", "c").len() == 1
    })
    .await;
    broker.black_hole_topic("x", "a", true);
    broker.black_hole_topic("x", "c", true);
    let lane = |topic: &str| router.destinations().into_iter().find(|d| d.destination.topic == topic);
    let waits_began = std::time::Instant::now();
    wal.append(vec![record("x", "a", 1, Partitioning::Balanced), record("x", "c", 2, Partitioning::Balanced)])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    wal.append(vec![record("x", "b", 3, Partitioning::Balanced)]).await.unwrap();
    eventually(Duration::from_secs(8), "b's acknowledged", || async { ids(&broker, "x", "b").len() == 2 }).await;
    assert!(waits_began.elapsed() < Duration::from_secs(8), "b answered too late in the waits to tell anything");
    // Then the server writes nothing, anywhere.
    broker.black_hole_topic("x", "b", true);
    eventually(Duration::from_secs(30), "a's and c's sends cut short", || async {
        lane("a").is_some_and(|d| d.last_error.is_some()) && lane("c").is_some_and(|d| d.last_error.is_some())
    })
    .await;
    let open: Vec<String> =
        ["a", "c"].into_iter().filter(|t| lane(t).is_some_and(|d| d.breaker == "open")).map(str::to_string).collect();
    assert!(open.len() <= 1, "a stall of every write opened the breakers of {open:?}");
    for topic in ["a", "b", "c"] {
        broker.black_hole_topic("x", topic, false);
    }
    router.shutdown().await;
}

/// A topic that never answers opens its breaker even where a new connection takes long
/// (here every reply is 150 ms late, so a connect, with its sign-in and pings, takes more
/// than the 250 ms after which a call does not go out on the connection it waited for).
/// The call cut short costs its connection, so the check that the server still answers
/// (a ping) connects anew: that connect succeeding is the server answering. Before, it
/// was read as the server gone, and the timeout was never the topic's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_topic_opens_its_breaker_even_when_connecting_is_slow() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let mut p = policy();
    p.breaker.failure_threshold = 1;
    p.breaker.cool_down = Duration::from_secs(60);
    let (wal, router) = start_warm_with(&broker, "z", "silent", p).await;
    broker.black_hole_topic("z", "silent", true);
    broker.set_delay(Duration::from_millis(150));
    wal.append(vec![record("z", "silent", 1, Partitioning::Balanced)]).await.unwrap();
    eventually(Duration::from_secs(60), "the silent topic's breaker open", || async {
        router.destinations().iter().any(|d| d.destination.topic == "silent" && d.breaker == "open")
    })
    .await;
    broker.set_delay(Duration::ZERO);
    router.shutdown().await;
}

/// A server that answers pings, sign-ins and topic reads but no write (a node that lost
/// its quorum, a server not caught up; the `iggy` client replays its "not ready" answers
/// inside itself, so the router sees only timeouts) is an outage of the server, not of
/// every destination: no breaker opens, and everything arrives once it writes again.
/// Each lane's timeouts are taken for the server's because the other destination's sends
/// go unanswered too while no write is answered. Until the other's first send was cut
/// short, one lane's timeouts count against its breaker (one destination silent alone
/// cannot be told from a stall); on a loaded machine that first send can go out late (its
/// new connection made late, the call given back to its retry), so the breaker here opens
/// at 5 failures in a row, not 3: what is held is that the count stops once both are
/// seen, and no breaker opens while many more timeouts follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_answers_pings_but_no_write_opens_no_breaker() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let mut lenient = policy();
    lenient.breaker.failure_threshold = 5;
    let (wal, router) = start_warm_with(&broker, "w", "a", lenient).await;
    wal.append(vec![record("w", "b", 1, Partitioning::Balanced)]).await.unwrap();
    eventually(Duration::from_secs(20), "b warm", || async { ids(&broker, "w", "b").len() == 1 }).await;
    broker.black_hole_topic("w", "a", true);
    broker.black_hole_topic("w", "b", true);
    append_alternating(&wal, "w", ("a", "b"), 2..42).await;
    // Several result timeouts (3 s each) and a breaker threshold (5) long.
    let failures = no_breaker_opens_for(&router, Duration::from_secs(24), "a server that writes nothing").await;
    // The timeouts happened, as many in a row as would open a breaker that counted them.
    assert!(failures >= 5, "{failures} consecutive failures: the sends were never cut short");
    broker.black_hole_topic("w", "a", false);
    broker.black_hole_topic("w", "b", false);
    let unique = |t: &str| ids(&broker, "w", t).into_iter().collect::<BTreeSet<u128>>();
    let want = |parity: u64| (0..42u64).filter(|n| n % 2 == parity).map(|n| u128::from(n) + 1).collect::<BTreeSet<_>>();
    eventually(Duration::from_secs(60), "everything delivered", || async {
        unique("a") == want(0) && unique("b") == want(1)
    })
    .await;
    router.shutdown().await;
}

/// A server that stalls every write stalls topic creation too: the first record of a new
/// destination waits on a `CreateTopic` that is never answered, beside another
/// destination's unanswered sends. That creation cut short is the server's as a send
/// would be: no breaker opens, and the new topic is made and filled once it writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_stalls_every_write_creates_no_topic_and_opens_no_breaker() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let (wal, router) = start_warm(&broker, "k", "a").await;
    let creations_before = broker.request_count(RequestKind::CreateTopic);
    broker.black_hole_topic("k", "a", true);
    broker.black_hole_topic("k", "new", true);
    append_alternating(&wal, "k", ("a", "new"), 1..41).await;
    // Several result timeouts (3 s each) and breaker thresholds (3) long.
    no_breaker_opens_for(&router, Duration::from_secs(16), "a server that writes nothing").await;
    assert!(broker.topic_options("k", "new").is_none(), "a creation the server never answered made the topic");
    let creations = broker.request_count(RequestKind::CreateTopic) - creations_before;
    assert!(creations >= 2, "the new topic's creation was tried {creations} times only");
    broker.black_hole_topic("k", "a", false);
    broker.black_hole_topic("k", "new", false);
    let unique = |t: &str| ids(&broker, "k", t).into_iter().collect::<BTreeSet<u128>>();
    let want = |parity: u64| (1..41u64).filter(|n| n % 2 == parity).map(|n| u128::from(n) + 1).collect::<BTreeSet<_>>();
    eventually(Duration::from_secs(60), "everything delivered", || async {
        unique("a").is_superset(&want(0)) && unique("new") == want(1)
    })
    .await;
    router.shutdown().await;
}

/// A refusal is not a write: a server that writes nothing may still refuse one
/// destination's sends (it validates before it replicates), and a refusal the client
/// makes itself never reached the server. Such refusals, coming every cool-down, must not
/// end the stall and let the silent destinations' timeouts open their breakers. The
/// breakers open at 5 failures in a row, not 3, for the reason
/// `a_server_that_answers_pings_but_no_write_opens_no_breaker` gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_destination_does_not_end_a_stall_of_every_write() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let mut lenient = policy();
    lenient.breaker.failure_threshold = 5;
    let (wal, router) = start_warm_with(&broker, "v", "a", lenient).await;
    for (n, topic) in [(1u64, "b"), (2, "c")] {
        wal.append(vec![record("v", topic, n, Partitioning::Balanced)]).await.unwrap();
        eventually(Duration::from_secs(20), "warm", || async { ids(&broker, "v", topic).len() == 1 }).await;
    }
    broker.black_hole_topic("v", "a", true);
    broker.black_hole_topic("v", "b", true);
    broker.fail_topic("v", "c", Some(iggy::prelude::IggyError::Error));
    wal.append(vec![record("v", "c", 3, Partitioning::Balanced)]).await.unwrap();
    append_alternating(&wal, "v", ("a", "b"), 4..44).await;
    // Several result timeouts (3 s each), breaker thresholds (5) and cool-downs (1 s) of
    // the refused destination long.
    let until = std::time::Instant::now() + Duration::from_secs(24);
    let mut refusals_seen = 0;
    while std::time::Instant::now() < until {
        for d in router.destinations() {
            if d.destination.topic == "c" {
                refusals_seen = refusals_seen.max(d.consecutive_failures);
            } else {
                assert_eq!(d.breaker, "closed", "{}: a server that writes nothing opened a breaker", d.destination);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(refusals_seen >= 4, "the refused destination was retried {refusals_seen} times only");
    broker.black_hole_topic("v", "a", false);
    broker.black_hole_topic("v", "b", false);
    broker.fail_topic("v", "c", None);
    let unique = |t: &str| ids(&broker, "v", t).into_iter().collect::<BTreeSet<u128>>();
    let want = |parity: u64| (4..44u64).filter(|n| n % 2 == parity).map(|n| u128::from(n) + 1).collect::<BTreeSet<_>>();
    eventually(Duration::from_secs(60), "everything delivered", || async {
        unique("a").is_superset(&want(0)) && unique("b").is_superset(&want(1)) && unique("c").len() == 2
    })
    .await;
    router.shutdown().await;
}

/// A server that stops answering altogether (hung, or the network silently dropping
/// its packets) is an outage, not every destination failing: no breaker opens, the
/// connections that timed out are replaced, and everything arrives once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_stops_answering_opens_no_breaker_and_is_reconnected() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let (wal, router) = start_warm(&broker, "q", "a").await;
    wal.append(vec![record("q", "b", 1, Partitioning::Balanced)]).await.unwrap();
    eventually(Duration::from_secs(20), "b warm", || async { ids(&broker, "q", "b").len() == 1 }).await;
    let connections_before = broker.accepted_connections();
    broker.set_delay(Duration::from_secs(20));
    append_alternating(&wal, "q", ("a", "b"), 2..42).await;
    // Several result timeouts (3 s each) and breaker thresholds (3) long.
    no_breaker_opens_for(&router, Duration::from_secs(14), "a hung server").await;
    assert!(broker.accepted_connections() > connections_before, "timed-out connections were not replaced");
    broker.set_delay(Duration::ZERO);
    // At least once: a send the server took while it did not answer is sent again.
    let unique = |t: &str| ids(&broker, "q", t).into_iter().collect::<BTreeSet<u128>>();
    let want = |parity: u64| (0..42u64).filter(|n| n % 2 == parity).map(|n| u128::from(n) + 1).collect::<BTreeSet<_>>();
    eventually(Duration::from_secs(60), "everything delivered", || async {
        unique("a") == want(0) && unique("b") == want(1)
    })
    .await;
    router.shutdown().await;
}

/// Partitions deleted from a topic while the daemon sends to it: a keyed record is
/// placed against the partition count the sink learnt, so it would go to a partition
/// that is gone until that count reaches its age. The count is forgotten with the
/// failure, and the retry asks the server again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_records_reach_a_topic_whose_partitions_were_deleted() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    // A key that 4 partitions place in partition 3, and 1 partition in 0.
    let key = (0u32..).map(|i| format!("k{i}")).find(|k| iggy_common::calculate_32(k.as_bytes()) % 4 == 3).unwrap();
    let wal = sim_wal();
    let router = Router::start(
        wal.clone(),
        sink(broker.addr(), 4),
        Arc::new(MemoryCursorStore::new()),
        Policies::uniform(policy()),
    )
    .unwrap();
    wal.append(vec![record("p", "t", 0, Partitioning::Key(key.clone().into_bytes()))]).await.unwrap();
    eventually(Duration::from_secs(20), "first record", || async { ids(&broker, "p", "t").len() == 1 }).await;
    assert_eq!(broker.messages("p", "t")[0].partition_id, 3);
    assert!(broker.shrink_partitions("p", "t", 1));
    for n in 1..21u64 {
        wal.append(vec![record("p", "t", n, Partitioning::Key(key.clone().into_bytes()))]).await.unwrap();
    }
    eventually(Duration::from_secs(30), "delivered after the partitions were deleted", || async {
        ids(&broker, "p", "t").len() == 21
    })
    .await;
    assert!(broker.messages("p", "t")[1..].iter().all(|m| m.partition_id == 0));
    router.shutdown().await;
}

/// Records with many forwarded headers are sent in batches Iggy takes: the batch's byte
/// bound counts payloads, and 2,400 such records of 100-byte payloads (about 80 MB of
/// messages, under 1 MiB of payload), held while their topic failed, would otherwise go
/// out as one request over the 64 MiB the server (and the test broker) take in one,
/// which closes the connection: the lane would send it again for good, each time taken
/// for a lost connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_with_many_headers_are_sent_in_requests_the_server_takes() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let mut policy = policy();
    policy.batch.batch_max_records = 10_000;
    policy.batch.batch_max_bytes = router::policy::MAX_BATCH_BYTES;
    let (wal, router) = start_warm_with(&broker, "heavy", "headers", policy).await;
    broker.fail_topic("heavy", "headers", Some(iggy::prelude::IggyError::Error));
    const N: u64 = 2400;
    let name = |i: usize| format!("x-{i:0>253}");
    for chunk in 0..N / 100 {
        let records = (0..100u64)
            .map(|k| {
                let n = 1 + chunk * 100 + k;
                let mut header =
                    ingest::envelope::Envelope::decode(&record("heavy", "headers", n, Partitioning::Balanced))
                        .expect("decodes")
                        .header;
                header.headers = (0..router::FORWARD_HEADERS_MAX).map(|i| (name(i), vec![b'v'; 255])).collect();
                ingest::envelope::Envelope::encode(&header, &[b'p'; 100])
            })
            .collect();
        wal.append(records).await.unwrap();
    }
    eventually(Duration::from_secs(30), "held", || async {
        router.destinations().iter().any(|l| l.held_records == N && l.status == Status::Degraded)
    })
    .await;
    broker.fail_topic("heavy", "headers", None);
    eventually(Duration::from_secs(60), "delivered", || async {
        ids(&broker, "heavy", "headers").len() == 1 + N as usize
    })
    .await;
    assert_eq!(ids(&broker, "heavy", "headers"), (0..=N).map(|n| u128::from(n) + 1).collect::<Vec<_>>());
    let m = &broker.messages("heavy", "headers")[1];
    assert_eq!(m.headers.iter().filter(|(k, _)| k.as_bytes().starts_with(b"x-0")).count(), router::FORWARD_HEADERS_MAX);
    router.shutdown().await;
}

/// A topic the server refuses to create for the daemon's user (`Unauthorized`: a user
/// allowed to send but not to create) holds only its own records: its lane fails and
/// is Degraded, a destination beside it flows, and once the topic can be created every
/// held record arrives, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_the_user_may_not_create_holds_only_its_own_records() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let (wal, router) = start_warm(&broker, "perm", "ok").await;
    broker.refuse_create_topic("perm", "denied", Some(iggy::prelude::IggyError::Unauthorized));
    append_alternating(&wal, "perm", ("ok", "denied"), 1..41).await;
    eventually(Duration::from_secs(30), "the allowed topic delivered", || async {
        ids(&broker, "perm", "ok").len() == 21
    })
    .await;
    eventually(Duration::from_secs(30), "the refused topic's lane degraded", || async {
        router.destinations().iter().any(|l| {
            l.destination.topic == "denied"
                && l.status == Status::Degraded
                && l.held_records == 20
                && l.last_error.as_deref().is_some_and(|e| e.to_lowercase().contains("unauthorized"))
        })
    })
    .await;
    assert!(broker.topic_options("perm", "denied").is_none(), "the refused topic was created");
    broker.refuse_create_topic("perm", "denied", None);
    let want: Vec<u128> = (1..41u64).filter(|n| n % 2 == 1).map(|n| u128::from(n) + 1).collect();
    eventually(Duration::from_secs(60), "the refused topic delivered once creatable", || async {
        ids(&broker, "perm", "denied") == want
    })
    .await;
    router.shutdown().await;
}

/// A stream the server refuses to create for the daemon's user (`Unauthorized`: a user
/// allowed to send to existing streams but not to create one) holds only its own
/// records, as a refused topic does: its lane is Degraded saying why, a destination in
/// another stream flows, and once the stream can be created every held record arrives,
/// in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_user_may_not_create_holds_only_its_own_records() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let (wal, router) = start_warm(&broker, "open", "t").await;
    broker.refuse_create_stream("closed", Some(iggy::prelude::IggyError::Unauthorized));
    for n in 1..41u64 {
        let stream = if n % 2 == 0 { "open" } else { "closed" };
        wal.append(vec![record(stream, "t", n, Partitioning::Balanced)]).await.unwrap();
    }
    // Its 20, after the record that warmed it.
    eventually(Duration::from_secs(30), "the other stream delivered", || async {
        ids(&broker, "open", "t").len() == 21
    })
    .await;
    eventually(Duration::from_secs(30), "the refused stream's lane degraded", || async {
        router.destinations().iter().any(|l| {
            l.destination.stream == "closed"
                && l.status == Status::Degraded
                && l.held_records == 20
                && l.last_error.as_deref().is_some_and(|e| e.to_lowercase().contains("unauthorized"))
        })
    })
    .await;
    assert!(broker.topic_options("closed", "t").is_none(), "the refused stream was created");
    broker.refuse_create_stream("closed", None);
    let want: Vec<u128> = (1..41u64).filter(|n| n % 2 == 1).map(|n| u128::from(n) + 1).collect();
    eventually(Duration::from_secs(60), "the refused stream delivered once creatable", || async {
        ids(&broker, "closed", "t") == want
    })
    .await;
    router.shutdown().await;
}

/// A topic the server answers "not now" (`TransientNotAccepted`: a topic not yet served
/// on this node, a server catching up) for longer than the result timeout is, to the
/// router, a destination that does not answer: the `iggy` client replays that answer on
/// its own, every 50 ms for up to 30 s, so the call is cut short by the result timeout
/// while the server answers the other topic's sends. Its breaker counts those timeouts
/// and opens, only its own records are held, the topic beside it flows, and once the
/// server takes the topic every record arrives, first copies in order (a replay the
/// client was still making when the router gave up may store a record twice, with its
/// id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_answered_not_now_past_the_result_timeout_holds_only_itself_and_is_delivered_after() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let mut p = policy();
    p.batch.result_timeout = Duration::from_millis(500);
    let (wal, router) = start_warm_with(&broker, "tr", "ok", p).await;
    broker.fail_topic("tr", "fresh", Some(iggy::prelude::IggyError::TransientNotAccepted));
    append_alternating(&wal, "tr", ("ok", "fresh"), 1..41).await;
    eventually(Duration::from_secs(30), "the other topic delivered", || async { ids(&broker, "tr", "ok").len() == 21 })
        .await;
    eventually(Duration::from_secs(30), "the answered topic's breaker open", || async {
        router.destinations().iter().any(|l| {
            l.destination.topic == "fresh"
                && l.breaker == "open"
                && l.status == Status::Degraded
                && l.held_records == 20
                && l.last_error.as_deref().is_some_and(|e| e.contains("timeout"))
        })
    })
    .await;
    assert!(ids(&broker, "tr", "fresh").is_empty());
    let ok = router.destinations().into_iter().find(|l| l.destination.topic == "ok").unwrap();
    assert_eq!((ok.breaker, ok.status), ("closed", Status::Running), "{ok:?}");

    broker.fail_topic("tr", "fresh", None);
    let want: Vec<u128> = (1..41u64).filter(|n| n % 2 == 1).map(|n| u128::from(n) + 1).collect();
    eventually(Duration::from_secs(30), "the answered topic delivered", || async {
        let mut seen = std::collections::HashSet::new();
        let firsts: Vec<u128> = ids(&broker, "tr", "fresh").into_iter().filter(|id| seen.insert(*id)).collect();
        firsts == want
    })
    .await;
    eventually(Duration::from_secs(30), "its lane running again", || async {
        router.destinations().iter().any(|l| l.destination.topic == "fresh" && l.status == Status::Running)
    })
    .await;
    router.shutdown().await;
}
