//! The live suite: the router delivering into a real Iggy server, read back with the
//! `iggy` crate. Ignored unless asked for (`-- --include-ignored`), as no package
//! registry serves a real server; asked for, each test needs `IGGY_TEST_ADDR` to name
//! one (`host:port`, user iggy/iggy) and fails without it, so it is never counted as
//! passed without having run.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use e2e::{client, eventually, read_back, record, sim_wal};
use ingest::envelope::Partitioning;
use router::iggy_sink::{IggySink, IggySinkConfig, TopicDefaults};
use router::test_doubles::MemoryCursorStore;
use router::{Policies, Router, RouterPolicy};

/// The real server's address, `IGGY_TEST_ADDR`; the test fails without one.
fn live_addr(test: &str) -> String {
    match std::env::var("IGGY_TEST_ADDR") {
        Ok(a) if !a.is_empty() => a,
        _ => panic!("live test {test}: IGGY_TEST_ADDR is not set (no real Iggy server to test against)"),
    }
}

/// Names unique to this run, so reruns against the same server do not collide.
fn unique(prefix: &str) -> String {
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros());
    format!("{prefix}-{t}")
}

fn router_for(addr: &str, partitions: u32, wal: Arc<wal::Wal>) -> Router {
    let config = IggySinkConfig {
        address: addr.to_string(),
        topic_defaults: TopicDefaults { partitions_count: partitions, ..TopicDefaults::default() },
        ..IggySinkConfig::default()
    };
    let sink = Arc::new(IggySink::new(&config).expect("sink"));
    let mut policy = RouterPolicy::default();
    policy.batch.linger = Duration::from_millis(2);
    Router::start(wal, sink, Arc::new(MemoryCursorStore::new()), Policies::uniform(policy)).expect("router")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real Iggy server: IGGY_TEST_ADDR, and -- --include-ignored"]
async fn live_three_topics_ids_order_and_headers() {
    let addr = live_addr("live_three_topics_ids_order_and_headers");
    let stream = unique("ingest-live");
    let wal = sim_wal();
    let topics = ["orders", "users", "audit"];
    for n in 0..600u64 {
        wal.append(vec![record(&stream, topics[(n % 3) as usize], n, Partitioning::Balanced)]).await.unwrap();
    }
    let router = router_for(&addr, 1, wal);
    let c = client(&addr).await;
    for (k, t) in topics.iter().enumerate() {
        eventually(Duration::from_secs(60), "delivered", || async { read_back(&c, &stream, t).await.len() >= 200 })
            .await;
        let got = read_back(&c, &stream, t).await;
        let want: Vec<u128> = (0..200u64).map(|i| u128::from(i * 3 + k as u64) + 1).collect();
        assert_eq!(got.iter().map(|m| m.id).collect::<Vec<_>>(), want, "topic {t}: ids or order");
        let first = &got[0];
        assert_eq!(first.headers.get("x-n").map(|v| v.to_vec()), Some(k.to_string().into_bytes()));
        assert_eq!(first.headers.get("iggy-ingest-source").map(|v| v.to_vec()), Some(b"e2e".to_vec()));
        assert_eq!(&first.payload[..], format!("{{\"n\":{k}}}").as_bytes());
    }
    assert_eq!(router.destinations().len(), topics.len(), "a lane is missing from the snapshot");
    for d in router.destinations() {
        assert!(!d.not_durable_warning, "{}: the daemon created a topic without fsync", d.destination);
    }
    router.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real Iggy server: IGGY_TEST_ADDR, and -- --include-ignored"]
async fn live_partition_ids_and_keys() {
    let addr = live_addr("live_partition_ids_and_keys");
    let stream = unique("ingest-live-p");
    let wal = sim_wal();
    for n in 0..90u64 {
        let p =
            if n < 60 { Partitioning::PartitionId((n % 3) as u32) } else { Partitioning::Key(b"customer-7".to_vec()) };
        wal.append(vec![record(&stream, "t", n, p)]).await.unwrap();
    }
    let router = router_for(&addr, 3, wal);
    let c = client(&addr).await;
    eventually(Duration::from_secs(60), "delivered", || async { read_back(&c, &stream, "t").await.len() >= 90 }).await;
    let got = read_back(&c, &stream, "t").await;
    for m in got.iter().filter(|m| m.id <= 60) {
        assert_eq!(u128::from(m.partition_id), (m.id - 1) % 3, "message {} in the wrong partition", m.id);
    }
    let keyed: BTreeSet<u32> = got.iter().filter(|m| m.id > 60).map(|m| m.partition_id).collect();
    assert_eq!(keyed.len(), 1, "one key spread over partitions {keyed:?}");
    router.shutdown().await;
}

/// Partitions an operator adds while the daemon runs get balanced messages once the
/// connections that learnt the old count reach `connection_max_age`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real Iggy server: IGGY_TEST_ADDR, and -- --include-ignored"]
async fn live_partitions_added_while_running_get_balanced_messages() {
    use iggy::prelude::{Identifier, PartitionClient};
    let addr = live_addr("live_partitions_added_while_running_get_balanced_messages");
    let stream = unique("ingest-live-grow");
    let max_age = Duration::from_secs(1);
    let config = IggySinkConfig {
        address: addr.clone(),
        connection_max_age: max_age,
        topic_defaults: TopicDefaults { partitions_count: 1, ..TopicDefaults::default() },
        ..IggySinkConfig::default()
    };
    let sink = Arc::new(IggySink::new(&config).expect("sink"));
    let mut policy = RouterPolicy::default();
    policy.batch.linger = Duration::from_millis(2);
    let wal = sim_wal();
    let router = Router::start(wal.clone(), sink, Arc::new(MemoryCursorStore::new()), Policies::uniform(policy))
        .expect("router");
    let c = client(&addr).await;
    for n in 0..10u64 {
        wal.append(vec![record(&stream, "t", n, Partitioning::Balanced)]).await.unwrap();
    }
    eventually(Duration::from_secs(60), "the first ten", || async { read_back(&c, &stream, "t").await.len() >= 10 })
        .await;
    let (s, t) = (Identifier::named(&stream).unwrap(), Identifier::named("t").unwrap());
    c.create_partitions(&s, &t, 2).await.expect("two partitions added");
    tokio::time::sleep(max_age + Duration::from_millis(200)).await;
    // One send each (a balanced send is placed whole), so that the sends spread.
    for n in 10..40u64 {
        wal.append(vec![record(&stream, "t", n, Partitioning::Balanced)]).await.unwrap();
        let want = n as usize + 1;
        eventually(Duration::from_secs(60), "delivered one by one", || async {
            read_back(&c, &stream, "t").await.len() >= want
        })
        .await;
    }
    let got = read_back(&c, &stream, "t").await;
    assert_eq!(got.len(), 40);
    assert!(got.iter().filter(|m| m.id <= 10).all(|m| m.partition_id == 0), "before: one partition");
    let used: BTreeSet<u32> = got.iter().filter(|m| m.id > 10).map(|m| m.partition_id).collect();
    assert_eq!(used, BTreeSet::from([0, 1, 2]), "the partitions added were not used");
    router.shutdown().await;
}
