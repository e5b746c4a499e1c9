//! Crash test: concurrent clients send numbered events, the daemon is SIGKILLed at a
//! random moment, restarted; every event that got a 200 must be in the log (read back
//! through the wal crate) at the offsets the 200 named, in per-connection order, and
//! every NDJSON batch must be whole or absent.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use rand::Rng;

const SOURCES: &str = r#"
[sources.default]
destination = { stream = "ingest", topic = "events" }
"#;

const CONNECTIONS: u64 = 8;
const BATCH_LINES: u64 = 3;
const ROUNDS: usize = 3;

/// Acknowledged: (connection, sequence) → (first offset, last offset).
type Acked = Arc<Mutex<BTreeMap<(u64, u64), (u64, u64)>>>;

async fn client(addr: std::net::SocketAddr, conn_id: u64, acked: Acked) {
    let Ok(mut conn) = Conn::open(addr).await else { return };
    for seq in 0.. {
        // Every fifth request is an NDJSON batch.
        let (ct, body) = if seq % 5 == 4 {
            let lines: String = (0..BATCH_LINES)
                .map(|part| format!("{{\"conn\":{conn_id},\"seq\":{seq},\"part\":{part}}}\n"))
                .collect();
            ("application/x-ndjson", lines)
        } else {
            ("application/json", format!("{{\"conn\":{conn_id},\"seq\":{seq},\"part\":0}}"))
        };
        let answer = match conn.send("POST", "/v1/sources/default", &[("content-type", ct)], body).await {
            Ok(a) => a,
            Err(_) => return,
        };
        if answer.status != 200 {
            return;
        }
        let Ok(j) = serde_json::from_slice::<serde_json::Value>(&answer.body) else { return };
        let first = j["offsets"][0].as_u64().unwrap();
        let last = j["offsets"][1].as_u64().unwrap();
        acked.lock().unwrap().insert((conn_id, seq), (first, last));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_event_survives_kill_9_in_per_connection_order() {
    let mut rng = rand::thread_rng();
    for round in 0..ROUNDS {
        let dir = tempfile::tempdir().unwrap();
        let mut d = Daemon::start(dir.path(), "", SOURCES);
        let acked: Acked = Arc::default();
        let clients: Vec<_> = (0..CONNECTIONS).map(|c| tokio::spawn(client(d.http, c, acked.clone()))).collect();
        // Wait until traffic flows (a loaded machine may be slow to start), then kill at
        // a random moment.
        let flowing = std::time::Instant::now();
        while acked.lock().unwrap().len() < 20 {
            assert!(flowing.elapsed() < Duration::from_secs(60), "round {round}: no traffic acknowledged");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let kill_after = Duration::from_millis(rng.gen_range(0..1200));
        tokio::time::sleep(kill_after).await;
        d.kill9();
        for c in clients {
            tokio::time::timeout(Duration::from_secs(30), c).await.expect("client hung after the kill").unwrap();
        }
        // Restart (recovery cuts any torn tail), prove it still appends, stop cleanly.
        let d = Daemon::restart(dir.path());
        let after = post_json(d.http, "/v1/sources/default", r#"{"after":"restart"}"#).await;
        assert_eq!(after.status, 200);
        assert!(d.stop().success());

        let log = read_log(&dir.path().join("data/wal"));
        let mut found: HashMap<(u64, u64), Vec<(u64, u64)>> = HashMap::new();
        for (offset, envelope) in &log {
            let j: serde_json::Value = serde_json::from_slice(&envelope.payload).unwrap();
            if j.get("after").is_some() {
                continue;
            }
            let key = (j["conn"].as_u64().unwrap(), j["seq"].as_u64().unwrap());
            found.entry(key).or_default().push((*offset, j["part"].as_u64().unwrap()));
        }
        let acked = acked.lock().unwrap().clone();
        assert!(!acked.is_empty(), "round {round}: nothing was acknowledged before the kill");
        for (&(c, s), &(first, last)) in &acked {
            let got = found.get(&(c, s)).unwrap_or_else(|| panic!("round {round}: acknowledged ({c},{s}) missing"));
            let offsets: Vec<u64> = got.iter().map(|(o, _)| *o).collect();
            assert_eq!(offsets, (first..=last).collect::<Vec<_>>(), "round {round}: ({c},{s}) at other offsets");
        }
        // Batches are whole or absent, acknowledged or not.
        for ((c, s), parts) in &found {
            let expected = if s % 5 == 4 { BATCH_LINES as usize } else { 1 };
            assert_eq!(parts.len(), expected, "round {round}: ({c},{s}) is partial: {parts:?}");
        }
        // Per-connection order: offsets grow with the sequence number.
        for c in 0..CONNECTIONS {
            let mut seqs: Vec<(u64, u64)> =
                found.iter().filter(|((cc, _), _)| *cc == c).map(|((_, s), p)| (*s, p[0].0)).collect();
            seqs.sort();
            assert!(seqs.windows(2).all(|w| w[0].1 < w[1].1), "round {round}: connection {c} out of order: {seqs:?}");
        }
        eprintln!(
            "kill -9 round {round}: killed {kill_after:?} after traffic started, {} requests acknowledged, {} records in the log, all present",
            acked.len(),
            log.len()
        );
    }
}
