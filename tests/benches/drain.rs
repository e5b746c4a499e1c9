//! Drain benchmark: records/s from a pre-filled log into the destination through the
//! router (log read, envelope decode, lanes, sends, durable cursors, release), beside
//! the same messages sent directly with the `iggy` crate, in the same run.
//!
//! Against a real server when `IGGY_TEST_ADDR` is set (user iggy/iggy), otherwise
//! against the test broker (which shares this machine's CPU with the sender, so its
//! absolute figures say little; the ratio is the figure).
//!
//! `cargo bench -p iggy-ingest-tests --bench drain` (DRAIN_RECORDS, DRAIN_ROUNDS).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use e2e::{record, sim_wal};
use iggy::prelude::*;
use ingest::envelope::{Envelope, Partitioning as EnvPartitioning};
use router::iggy_sink::{IggySink, IggySinkConfig, TopicDefaults};
use router::sink::{DestinationKey, Sink};
use router::{Policies, Router, RouterPolicy, StateCursorStore};
use test_broker::{TestBroker, TestBrokerConfig};

const BATCH: usize = 1000;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn unique(prefix: &str) -> String {
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros());
    format!("{prefix}-{t}")
}

/// The message the router would send for `record`: same id, payload and headers.
fn direct_message(rec: &Bytes) -> IggyMessage {
    let e = Envelope::decode(rec).expect("envelope");
    let h = &e.header;
    let mut headers = std::collections::BTreeMap::new();
    let mut put = |k: &str, v: &[u8]| {
        headers.insert(HeaderKey::try_from(k).expect("key"), HeaderValue::from_raw(HeaderKind::Raw, v).expect("value"));
    };
    put("iggy-ingest-source", h.source_key.as_bytes());
    if let Some(ct) = &h.content_type {
        put("content-type", ct.as_bytes());
    }
    for (k, v) in &h.metadata {
        put(k, v.as_bytes());
    }
    for (k, v) in &h.headers {
        put(k, v);
    }
    IggyMessage::builder().id(h.message_id).payload(e.payload.clone()).user_headers(headers).build().expect("message")
}

async fn connect(addr: &str) -> IggyClient {
    e2e::client(addr).await
}

async fn ensure(c: &IggyClient, stream: &str, topics: &[String]) {
    c.create_stream(stream).await.expect("stream");
    let opts = TopicCreateOptions {
        partitions_count: Some(1),
        enforce_fsync: Some(true),
        messages_required_to_save: Some(1),
        ..TopicCreateOptions::default()
    };
    for t in topics {
        c.create_topic(&Identifier::named(stream).expect("id"), t, &opts).await.expect("topic");
    }
}

/// Sends every destination's messages in batches, destinations concurrently.
async fn direct(addr: &str, stream: &str, topics: &[String], records: &[Bytes]) -> Duration {
    let c = Arc::new(connect(addr).await);
    ensure(&c, stream, topics).await;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (k, t) in topics.iter().enumerate() {
        let c = c.clone();
        let (s, t) = (stream.to_string(), t.clone());
        // Building the messages counts, as it does for the router.
        let mine: Vec<Bytes> = records.iter().skip(k).step_by(topics.len()).cloned().collect();
        tasks.push(tokio::spawn(async move {
            let sid = Identifier::named(&s).expect("id");
            let tid = Identifier::named(&t).expect("id");
            for chunk in mine.chunks(BATCH) {
                let mut msgs: Vec<IggyMessage> = chunk.iter().map(direct_message).collect();
                c.send_messages(&sid, &tid, &Partitioning::balanced(), &mut msgs).await.expect("send");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    started.elapsed()
}

/// Drains a pre-filled log through the router until every record is released.
async fn through_router(addr: &str, stream: &str, topics: &[String], n: usize) -> Duration {
    let wal = sim_wal();
    for i in 0..n {
        let t = &topics[i % topics.len()];
        wal.append(vec![record(stream, t, i as u64, EnvPartitioning::Balanced)]).await.expect("append");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let state = Arc::new(ingest::StateDb::open(dir.path().join("state.redb")).expect("state"));
    let config = IggySinkConfig {
        address: addr.to_string(),
        topic_defaults: TopicDefaults { partitions_count: 1, ..TopicDefaults::default() },
        ..IggySinkConfig::default()
    };
    let sink = Arc::new(IggySink::new(&config).expect("sink"));
    // The direct sender is connected and its topics exist before its clock starts; the
    // router gets the same: its client connects and learns the topics here, as the
    // daemon's pre-warm does at start.
    for t in topics {
        sink.ensure(&DestinationKey::new(stream, t.as_str())).await.expect("ensure");
    }
    let mut policy = RouterPolicy::default();
    policy.batch.batch_max_records = BATCH;
    let started = Instant::now();
    let router =
        Router::start(wal, sink, Arc::new(StateCursorStore::new(state)), Policies::uniform(policy)).expect("router");
    while router.released_below() < n as u64 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let elapsed = started.elapsed();
    router.shutdown().await;
    elapsed
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async {
        let n = env_usize("DRAIN_RECORDS", 50_000);
        let rounds = env_usize("DRAIN_ROUNDS", 3);
        let (addr, target, _broker) = match std::env::var("IGGY_TEST_ADDR") {
            Ok(a) if !a.is_empty() => (a, "a real Iggy server", None),
            _ => {
                let b = TestBroker::start(TestBrokerConfig::default()).await.expect("broker");
                (b.addr().to_string(), "the test broker", Some(b))
            }
        };
        println!("drain benchmark: {n} records of ~300 bytes, {rounds} rounds each, into {target} at {addr}");
        println!("| destinations | direct records/s | router records/s | router / direct |");
        println!("| ---: | ---: | ---: | ---: |");
        for destinations in [1usize, 16] {
            let mut direct_rates = Vec::new();
            let mut router_rates = Vec::new();
            for _ in 0..rounds {
                let topics: Vec<String> = (0..destinations).map(|k| format!("t{k}")).collect();
                let records: Vec<Bytes> = (0..n)
                    .map(|i| record("x", &topics[i % destinations], i as u64, EnvPartitioning::Balanced))
                    .collect();
                let d = direct(&addr, &unique("drain-direct"), &topics, &records).await;
                direct_rates.push(n as f64 / d.as_secs_f64());
                let r = through_router(&addr, &unique("drain-router"), &topics, n).await;
                router_rates.push(n as f64 / r.as_secs_f64());
            }
            let (d, r) = (median(direct_rates), median(router_rates));
            println!("| {destinations} | {d:.0} | {r:.0} | {:.2} |", r / d);
        }
    });
}
