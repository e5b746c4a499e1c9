//! Helpers for the end-to-end tests: envelopes to append, a client that reads back what
//! a server stored, waiting for a condition, and (for the daemon-level tests) the daemon
//! as a process ([`daemon`]), steady load with its ledger ([`load`]) and the destination
//! with its outages ([`destination`]).

pub mod daemon;
pub mod destination;
pub mod load;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use iggy::prelude::*;
use ingest::envelope::{Destination, Envelope, EnvelopeHeader, Partitioning as EnvPartitioning};
use wal::storage::{SimStorage, Storage};
use wal::{Wal, WalOptions};

/// An envelope for `stream/topic` whose id is `n + 1` and whose payload names `n`.
pub fn record(stream: &str, topic: &str, n: u64, partitioning: EnvPartitioning) -> Bytes {
    let header = EnvelopeHeader {
        message_id: u128::from(n) + 1,
        received_at_unix_ms: 1_700_000_000_000 + n,
        source_key: "e2e".into(),
        endpoint_id: None,
        content_type: Some("application/json".into()),
        metadata: vec![("received_at".into(), (1_700_000_000_000 + n).to_string())],
        headers: vec![("x-n".into(), n.to_string().into_bytes())],
        idempotency_key: None,
        batch_index: 0,
        batch_len: 1,
        destination: Destination { stream: stream.into(), topic: topic.into(), partitioning },
    };
    Envelope::encode(&header, format!("{{\"n\":{n}}}").as_bytes())
}

/// A log on the simulated disk.
pub fn sim_wal() -> Arc<Wal> {
    let sim = SimStorage::new();
    let opts = WalOptions { segment_max_bytes: 1 << 20, max_bytes: 256 << 20, ..WalOptions::default() };
    Arc::new(Wal::open_with(Arc::new(sim) as Arc<dyn Storage>, &PathBuf::from("/sim/log"), opts).expect("open log"))
}

/// One message as a server returned it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadBack {
    pub id: u128,
    pub partition_id: u32,
    pub payload: Bytes,
    pub headers: BTreeMap<String, Bytes>,
}

/// A signed-in client of the server at `addr`.
pub async fn client(addr: &str) -> IggyClient {
    let c = IggyClient::builder()
        .with_tcp()
        .with_server_address(addr.to_string())
        .with_auto_sign_in(AutoLogin::Enabled(Credentials::UsernamePassword("iggy".into(), "iggy".to_string().into())))
        .build()
        .expect("client");
    c.connect().await.expect("connect");
    c
}

/// A signed-in client of the server at `addr`, or `None` while it cannot be reached.
pub async fn try_client(addr: &str) -> Option<IggyClient> {
    let c = IggyClient::builder()
        .with_tcp()
        .with_server_address(addr.to_string())
        .with_auto_sign_in(AutoLogin::Enabled(Credentials::UsernamePassword("iggy".into(), "iggy".to_string().into())))
        .build()
        .ok()?;
    c.connect().await.ok()?;
    Some(c)
}

/// Every message of `stream/topic`, partition by partition, each in offset order.
pub async fn read_back(c: &IggyClient, stream: &str, topic: &str) -> Vec<ReadBack> {
    let s = Identifier::named(stream).expect("stream id");
    let t = Identifier::named(topic).expect("topic id");
    let Ok(Some(details)) = c.get_topic(&s, &t).await else { return Vec::new() };
    let consumer = Consumer::new(Identifier::numeric(1).expect("consumer id"));
    let mut out = Vec::new();
    for p in 0..details.partitions_count {
        let mut offset = 0;
        loop {
            let polled = c
                .poll_messages(&s, &t, Some(p), &consumer, &PollingStrategy::offset(offset), 1000, false)
                .await
                .expect("poll");
            if polled.messages.is_empty() {
                break;
            }
            for m in &polled.messages {
                let headers = m
                    .user_headers_map()
                    .expect("headers")
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| {
                        (String::from_utf8_lossy(k.as_bytes()).into_owned(), Bytes::copy_from_slice(v.as_bytes()))
                    })
                    .collect();
                out.push(ReadBack { id: m.header.id, partition_id: p, payload: m.payload.clone(), headers });
                offset = m.header.offset + 1;
            }
        }
    }
    out
}

/// Waits until `cond` holds, panicking after `limit`.
pub async fn eventually<F, Fut>(limit: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = tokio::time::Instant::now();
    while !cond().await {
        assert!(start.elapsed() < limit, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
