//! Crash test: concurrent clients send numbered events, half of them through the
//! source's named path and half through a secret-path endpoint with its own auth, every
//! third request with a delivery id; the daemon is SIGKILLed at a random moment,
//! restarted; every event that got a 200 must be in the log (read back through the wal
//! crate) at the offsets the 200 named, in per-connection order, every NDJSON batch must
//! be whole or absent, and the retry of every answered delivery must be answered with its
//! offsets, appending nothing. The last round serves the webhook listener over TLS, so
//! the 200s given there are covered too. The same rounds run under `wal.sync =
//! "interval"`, whose 200 (given once the write reached the OS, before its sync) makes
//! the same promise against a process crash: keyed, batched and endpoint requests alike.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use rand::Rng;

const SOURCES: &str = r#"
[sources.default]
destination = { stream = "ingest", topic = "events" }

[[sources.default.endpoints]]
id = "0123456789abcdef0123456789abcdef"
auth_type = "bearer"
auth_secret = "kill9-endpoint-token-0123456789"
"#;
const ENDPOINT_PATH: &str = "/v1/e/0123456789abcdef0123456789abcdef";
const ENDPOINT_AUTH: &str = "Bearer kill9-endpoint-token-0123456789";

const CONNECTIONS: u64 = 8;
const BATCH_LINES: u64 = 3;
const ROUNDS: usize = 3;

/// Acknowledged: (connection, sequence) → (first offset, last offset).
type Acked = Arc<Mutex<BTreeMap<(u64, u64), (u64, u64)>>>;

/// Answers other than a 200 with its offsets, which a daemon up and serving never gives
/// here: (connection, sequence) and what came back. A kill ends connections, it answers
/// nothing.
type Refused = Arc<Mutex<Vec<String>>>;

/// Where connection `conn_id` sends, with which headers: odd connections through the
/// endpoint. Every third sequence number carries a delivery id.
fn route(conn_id: u64, seq: u64) -> (&'static str, Vec<(&'static str, String)>) {
    let mut headers = Vec::new();
    let path = if conn_id % 2 == 1 {
        headers.push(("authorization", ENDPOINT_AUTH.to_string()));
        ENDPOINT_PATH
    } else {
        "/v1/sources/default"
    };
    if seq.is_multiple_of(3) {
        headers.push(("idempotency-key", format!("c{conn_id}-s{seq}")));
    }
    (path, headers)
}

/// A connection to the webhook listener: over TLS when the round serves it so.
async fn open(addr: std::net::SocketAddr, tls: Option<&TlsPair>) -> std::io::Result<Conn> {
    match tls {
        None => Conn::open(addr).await,
        Some(pair) => Ok(Conn::open_tls(addr, &[pair]).await?.0),
    }
}

async fn client(addr: std::net::SocketAddr, conn_id: u64, acked: Acked, refused: Refused, tls: Option<Arc<TlsPair>>) {
    let Ok(mut conn) = open(addr, tls.as_deref()).await else { return };
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
        let (path, mut headers) = route(conn_id, seq);
        headers.push(("content-type", ct.to_string()));
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        // A connection error is the kill (or the client's end after it).
        let Ok(answer) = conn.send("POST", path, &headers, body).await else { return };
        let offsets = serde_json::from_slice::<serde_json::Value>(&answer.body)
            .ok()
            .and_then(|j| Some((j["offsets"][0].as_u64()?, j["offsets"][1].as_u64()?)));
        match offsets {
            Some(offsets) if answer.status == 200 => {
                acked.lock().unwrap().insert((conn_id, seq), offsets);
            }
            _ => {
                let body = String::from_utf8_lossy(&answer.body);
                refused.lock().unwrap().push(format!("({conn_id},{seq}): {} {body}", answer.status));
                return;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_event_survives_kill_9_in_per_connection_order() {
    kill_9_rounds("", ROUNDS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_event_survives_kill_9_under_the_interval_sync_policy() {
    // A sync every 50 ms: at any kill, appends answered since the last one are written
    // but not synced, which a process crash must not lose.
    kill_9_rounds("[wal]\nsync = \"interval\"\nsync_interval_ms = 50\n", 2).await;
}

/// `rounds` rounds of traffic, a kill -9 and the checks, the daemon's configuration
/// ending with `wal_extra`; the last round over TLS.
async fn kill_9_rounds(wal_extra: &str, rounds: usize) {
    let mut rng = rand::thread_rng();
    let sources_and_wal = format!("{SOURCES}\n{wal_extra}");
    for round in 0..rounds {
        let dir = tempfile::tempdir().unwrap();
        let tls = (round == rounds - 1).then(|| Arc::new(TlsPair::new()));
        let http_extra = tls.as_ref().map_or(String::new(), |pair| {
            let (cert, key) = pair.write(&dir.path().join("tls"));
            format!("[http.tls]\ncert_file = {cert:?}\nkey_file = {key:?}\n")
        });
        let mut d = Daemon::start(dir.path(), &http_extra, &sources_and_wal);
        let acked: Acked = Arc::default();
        let refused: Refused = Arc::default();
        let clients: Vec<_> = (0..CONNECTIONS)
            .map(|c| tokio::spawn(client(d.http, c, acked.clone(), refused.clone(), tls.clone())))
            .collect();
        // Wait until traffic flows (a loaded machine may be slow to start), with a batch
        // and an endpoint's request among what was acknowledged, so that the checks below
        // have them to check; then kill at a random moment.
        let flowing = std::time::Instant::now();
        let acked_at_start = loop {
            let (count, batch, endpoint) = {
                let acked = acked.lock().unwrap();
                let batch = acked.keys().any(|(_, s)| s % 5 == 4);
                (acked.len(), batch, acked.keys().any(|(c, _)| c % 2 == 1))
            };
            if count >= 20 && batch && endpoint {
                break count;
            }
            assert!(refused.lock().unwrap().is_empty(), "round {round}: refused {:?}", refused.lock().unwrap());
            assert!(flowing.elapsed() < Duration::from_secs(60), "round {round}: no traffic acknowledged");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let kill_after = Duration::from_millis(rng.gen_range(0..2000));
        tokio::time::sleep(kill_after).await;
        let acked_at_kill = acked.lock().unwrap().len();
        d.kill9();
        // The kill came under load: requests were still being answered up to it (a second
        // at least: a loaded machine's disk may hold one sync for a few hundred ms).
        if kill_after >= Duration::from_secs(1) {
            assert!(acked_at_kill > acked_at_start, "round {round}: traffic stopped before the kill");
        }
        for c in clients {
            tokio::time::timeout(Duration::from_secs(30), c).await.expect("client hung after the kill").unwrap();
        }
        let refused = refused.lock().unwrap().clone();
        assert!(refused.is_empty(), "round {round}: the daemon refused requests before the kill: {refused:?}");
        // Restart (recovery cuts any torn tail). Every answered delivery's retry is
        // answered with its offsets and appends nothing; then it still appends.
        let d = Daemon::restart(dir.path());
        let acked_now = acked.lock().unwrap().clone();
        let mut retried = 0;
        for (&(c, s), &(first, last)) in acked_now.iter().filter(|((_, s), _)| s.is_multiple_of(3)) {
            let (path, headers) = route(c, s);
            let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let mut conn = open(d.http, tls.as_deref()).await.unwrap();
            let again = conn.send("POST", path, &headers, r#"{"retry":true}"#).await.unwrap();
            assert_eq!(again.status, 200, "round {round}: retry of ({c},{s}): {:?}", again.body);
            assert_eq!(again.header("idempotent-replayed"), Some("true"), "round {round}: ({c},{s}) appended again");
            assert_eq!(again.json()["offsets"], serde_json::json!([first, last]), "round {round}: ({c},{s})");
            retried += 1;
        }
        let mut conn = open(d.http, tls.as_deref()).await.unwrap();
        let json = [("content-type", "application/json")];
        let after = conn.send("POST", "/v1/sources/default", &json, r#"{"after":"restart"}"#).await.unwrap();
        assert_eq!(after.status, 200);
        assert!(d.stop().success());

        let log = read_log(&dir.path().join("data/wal"));
        let mut found: HashMap<(u64, u64), Vec<(u64, u64)>> = HashMap::new();
        for (offset, envelope) in &log {
            let j: serde_json::Value = serde_json::from_slice(&envelope.payload).unwrap();
            assert!(j.get("retry").is_none(), "round {round}: a retry was appended at {offset}");
            if j.get("after").is_some() {
                continue;
            }
            let key = (j["conn"].as_u64().unwrap(), j["seq"].as_u64().unwrap());
            let via_endpoint = envelope.header.endpoint_id.is_some();
            assert_eq!(
                via_endpoint,
                key.0 % 2 == 1,
                "round {round}: ({},{}) came through the wrong door",
                key.0,
                key.1
            );
            found.entry(key).or_default().push((*offset, j["part"].as_u64().unwrap()));
        }
        let acked = acked.lock().unwrap().clone();
        assert!(!acked.is_empty(), "round {round}: nothing was acknowledged before the kill");
        for (&(c, s), &(first, last)) in &acked {
            let got = found.get(&(c, s)).unwrap_or_else(|| panic!("round {round}: acknowledged ({c},{s}) missing"));
            let offsets: Vec<u64> = got.iter().map(|(o, _)| *o).collect();
            assert_eq!(offsets, (first..=last).collect::<Vec<_>>(), "round {round}: ({c},{s}) at other offsets");
        }
        // Batches are whole or absent, acknowledged or not, their parts in order at
        // consecutive offsets.
        for ((c, s), parts) in &found {
            let expected = if s % 5 == 4 { BATCH_LINES } else { 1 };
            let mut parts = parts.clone();
            parts.sort();
            let first = parts[0].0;
            let want: Vec<(u64, u64)> = (0..expected).map(|part| (first + part, part)).collect();
            assert_eq!(parts, want, "round {round}: ({c},{s}) is partial or out of order");
        }
        // Per-connection order: offsets grow with the sequence number.
        for c in 0..CONNECTIONS {
            let mut seqs: Vec<(u64, u64)> =
                found.iter().filter(|((cc, _), _)| *cc == c).map(|((_, s), p)| (*s, p[0].0)).collect();
            seqs.sort();
            assert!(seqs.windows(2).all(|w| w[0].1 < w[1].1), "round {round}: connection {c} out of order: {seqs:?}");
        }
        eprintln!(
            "kill -9 round {round}{}{}: killed {kill_after:?} after traffic started, {} requests acknowledged ({retried} with a delivery id, each replayed), {} records in the log, all present",
            if tls.is_some() { " (over TLS)" } else { "" },
            if wal_extra.is_empty() { "" } else { " (sync = interval)" },
            acked.len(),
            log.len()
        );
    }
}
