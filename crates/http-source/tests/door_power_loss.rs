//! A power loss at every write, sync and metadata change the door's requests cause,
//! through the whole HTTP path: the log and the state database on one simulated disk
//! (`SimStorage`, the database through `StateDb::open_on`), a script of every kind of
//! request that is answered 200 (one event and NDJSON batches, the source's named path
//! and a secret-path endpoint, with a delivery id and without, and the retry of an
//! answered delivery), cut just before the disk's nth mutation for every n the script
//! reaches, losing what was unsynced or keeping a mix of it in any order
//! (`CrashMode::Reordered`, the disk redb's design assumes). The door is then
//! built again on what the disk kept, as a restart does, and checked against what was
//! answered:
//!
//! - every event answered 200 is in the log at the offsets its answer named, with the
//!   bytes that were sent, a batch whole;
//! - the retry of every delivery answered 200 is answered with its offsets, marked
//!   replayed, and appends nothing.
//!
//! The ingest core's own sweep (`crates/ingest/tests/power_loss.rs`) drives the
//! ingestor directly; this one goes through what a sender calls.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use http_source::auth::TokenDigest;
use http_source::{AuthScheme, Door, DoorLimits, Endpoint, EndpointRegistry, SourceSpec};
use tower::ServiceExt;
use wal::storage::{CrashMode, FaultOp, SimStorage, Storage};
use wal::{Wal, WalOptions};

const SOURCE_TOKEN: &str = "source-token-0123456789";
const ENDPOINT_TOKEN: &str = "endpoint-token-0123456789";
const ENDPOINT_ID: u128 = 0x5eed;
const NAMED: &str = "/v1/sources/hooks";

/// One request of the script: where it goes, whether it is an NDJSON batch of three,
/// and its delivery id.
#[derive(Debug, Clone, Copy)]
struct Step {
    endpoint: bool,
    batch: bool,
    delivery_id: Option<&'static str>,
}

const SCRIPT: [Step; 7] = [
    Step { endpoint: false, batch: false, delivery_id: None },
    Step { endpoint: false, batch: true, delivery_id: Some("named-batch") },
    Step { endpoint: true, batch: false, delivery_id: Some("endpoint-one") },
    Step { endpoint: true, batch: true, delivery_id: None },
    Step { endpoint: false, batch: false, delivery_id: Some("named-one") },
    // The retry of an answered delivery: a replay, appending nothing.
    Step { endpoint: false, batch: true, delivery_id: Some("named-batch") },
    Step { endpoint: true, batch: false, delivery_id: None },
];

/// A request answered 200: what it sent, where, and the offsets its answer named.
#[derive(Debug, Clone)]
struct Answered {
    step: Step,
    events: Vec<String>,
    offsets: (u64, u64),
}

struct Daemon {
    wal: Arc<Wal>,
    door: Arc<Door>,
}

/// The door on the disk's `/data`, as a start builds it: the log opened (recovered), the
/// state database opened, the delivery ids the last checkpoint missed restored from the
/// log.
fn start(sim: &SimStorage, now: u64) -> Result<Daemon, String> {
    let storage: Arc<dyn Storage> = Arc::new(sim.clone());
    wal::storage::create_dir_all_durably(sim, Path::new("/data")).map_err(|e| e.to_string())?;
    let wal = Arc::new(
        Wal::open_with(storage.clone(), Path::new("/data/wal"), WalOptions::default()).map_err(|e| e.to_string())?,
    );
    let state = Arc::new(ingest::StateDb::open_on(storage, "/data/state.redb").map_err(|e| e.to_string())?);
    let idempotency = Arc::new(ingest::IdempotencyIndex::new(state.clone(), 86_400_000));
    idempotency.rebuild(&wal, now).map_err(|e| e.to_string())?;
    let source = SourceSpec {
        key: "hooks".into(),
        destinations: http_source::Destinations::Fixed { stream: "s".into(), topic: "t".into() },
        partitioning: http_source::partition::PartitionRule::Fixed(ingest::Partitioning::Balanced),
        admission: http_source::admission::Admission::Open,
        accept: http_source::Accept::Any,
        named_path: true,
        auth: AuthScheme::Bearer { token: TokenDigest::of(SOURCE_TOKEN) },
        forward_headers: Vec::new(),
        metadata: http_source::MetadataFields::default(),
        idempotency_header: None,
        idempotency: true,
    };
    let endpoint = Endpoint {
        id: ENDPOINT_ID,
        source_key: "hooks".into(),
        auth: AuthScheme::Bearer { token: TokenDigest::of(ENDPOINT_TOKEN) },
        handshake_param: None,
        expires_at_unix_ms: None,
        revoked_at_unix_ms: None,
        dynamic: false,
        record: None,
        unusable: None,
    };
    let endpoints =
        EndpointRegistry::load(state, vec!["hooks".into()], vec![endpoint]).map_err(|e| format!("{e:?}"))?;
    let door = Arc::new(Door {
        sources: HashMap::from([("hooks".to_string(), Arc::new(source))]),
        endpoints: Arc::new(endpoints),
        ingestor: ingest::Ingestor::new(wal.clone(), idempotency),
        limits: DoorLimits {
            max_body_bytes: 1024 * 1024,
            max_events_per_request: 100,
            body_read_timeout: Duration::from_secs(10),
            retry_after_secs: 1,
        },
        health: Arc::default(),
        status: Arc::new(http_source::status::StatusBoard::new(["hooks".to_string()])),
        metrics: http_source::metrics::DoorMetrics::new(["hooks"]),
    });
    Ok(Daemon { wal, door })
}

/// Sends `step` (its events named by `tag`); the status, whether it was marked replayed,
/// the offsets it was answered with, and the events sent.
async fn send(door: &Arc<Door>, step: Step, tag: &str) -> (StatusCode, bool, Option<(u64, u64)>, Vec<String>) {
    let events: Vec<String> = match step.batch {
        true => (0..3).map(|part| format!("{{\"tag\":\"{tag}\",\"part\":{part}}}")).collect(),
        false => vec![format!("{{\"tag\":\"{tag}\",\"part\":0}}")],
    };
    let (content_type, body) = match step.batch {
        true => ("application/x-ndjson", events.iter().map(|e| format!("{e}\n")).collect::<String>()),
        false => ("application/json", events[0].clone()),
    };
    let (path, token) = match step.endpoint {
        true => (format!("/v1/e/{ENDPOINT_ID:032x}"), ENDPOINT_TOKEN),
        false => (NAMED.to_string(), SOURCE_TOKEN),
    };
    let mut req = Request::builder()
        .method("POST")
        .uri(path)
        .header(header::HOST, "hooks.example")
        .header(header::CONTENT_TYPE, content_type)
        .header(header::AUTHORIZATION, format!("Bearer {token}"));
    if let Some(id) = step.delivery_id {
        req = req.header("idempotency-key", id);
    }
    let answer = http_source::router(door.clone()).oneshot(req.body(Body::from(body)).unwrap()).await.unwrap();
    let status = answer.status();
    let replayed = answer.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
    let bytes = answer.into_body().collect().await.unwrap().to_bytes();
    let offsets = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|j| Some((j["offsets"][0].as_u64()?, j["offsets"][1].as_u64()?)));
    (status, replayed, offsets, events)
}

/// Runs the script until the power goes (or to its end); what was answered 200.
async fn run_script(daemon: &Daemon, sim: &SimStorage) -> Vec<Answered> {
    let mut answered: Vec<Answered> = Vec::new();
    for (i, step) in SCRIPT.iter().enumerate() {
        let (status, replayed, offsets, events) = send(&daemon.door, *step, &format!("op{i}")).await;
        if status == StatusCode::OK {
            let offsets = offsets.expect("a 200 names its offsets");
            let first =
                answered.iter().find(|a| a.step.delivery_id.is_some() && a.step.delivery_id == step.delivery_id);
            match first {
                Some(first) => {
                    assert!(replayed, "op {i}: a retry of an answered delivery was appended again");
                    assert_eq!(offsets, first.offsets, "op {i}: a replay named other offsets");
                }
                None => {
                    assert!(!replayed, "op {i}: a new delivery was answered as a replay");
                    answered.push(Answered { step: *step, events, offsets });
                }
            }
        } else {
            assert!(sim.crashes() > 0, "op {i} refused with the power on: {status}");
        }
        if sim.crashes() > 0 {
            break;
        }
    }
    answered
}

/// Checks the disk `sim` kept after a power loss against what was `answered`.
async fn check(sim: &SimStorage, answered: &[Answered], now: u64, case: &str) {
    let daemon = start(sim, now).unwrap_or_else(|e| panic!("{case}: the start after the loss failed: {e}"));
    for a in answered {
        let (first, last) = a.offsets;
        let mut reader = daemon.wal.reader(first).unwrap_or_else(|e| panic!("{case}: {a:?}: {e}"));
        let records = reader.try_read(a.events.len(), usize::MAX).unwrap_or_else(|e| panic!("{case}: {a:?}: {e}"));
        let got: Vec<(u64, String)> = records
            .iter()
            .map(|r| {
                let envelope = ingest::Envelope::decode(&r.payload).unwrap_or_else(|e| panic!("{case}: {e}"));
                (r.offset, String::from_utf8_lossy(&envelope.payload).into_owned())
            })
            .collect();
        let want: Vec<(u64, String)> = (first..=last).zip(a.events.iter().cloned()).collect();
        assert_eq!(got, want, "{case}: an answered request is not in the log as answered");
    }
    let end = daemon.wal.next_offset();
    for a in answered.iter().filter(|a| a.step.delivery_id.is_some()) {
        let (status, replayed, offsets, _) = send(&daemon.door, a.step, "retry").await;
        assert_eq!((status, replayed, offsets), (StatusCode::OK, true, Some(a.offsets)), "{case}: retry of {a:?}");
    }
    assert_eq!(daemon.wal.next_offset(), end, "{case}: a retry was appended");
    daemon.wal.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_answered_200_survives_a_power_loss_at_any_write() {
    let now = ingest::time::now_unix_ms();
    // How many mutations the script makes, from a run the power stays on through (the
    // first round, n = 0). Timing moves it by a few (how the recorder groups delivery
    // ids), so the sweep goes past it rather than stop at the first run that ended
    // before its cut.
    let mut mutations = 0u64;
    let mut cuts = 0u64;
    let mut n = 0u64;
    while n <= mutations + 8 {
        // The script's mutations counted from after the start, which is not what is
        // tested here (the log's and the database's own sweeps cut their opens).
        for mode in [CrashMode::LoseUnsynced, CrashMode::Reordered { seed: n }] {
            let sim = SimStorage::new();
            let daemon = start(&sim, now).unwrap();
            let mutations_before = sim.ops();
            if n > 0 {
                sim.crash_at_nth(FaultOp::AnyMutation, n, mode);
            }
            let answered = run_script(&daemon, &sim).await;
            // The delivery ids' recorder writes after the answers (it lingers a few
            // milliseconds for more): its writes are mutations of the script too.
            tokio::time::sleep(Duration::from_millis(50)).await;
            if sim.crashes() == 0 {
                mutations = mutations.max(sim.ops() - mutations_before);
                continue;
            }
            cuts += 1;
            drop(daemon);
            sim.disarm();
            let case = format!(
                "cut before mutation {n} ({mutations_before} made before the script; {mode:?}), {} answered",
                answered.len()
            );
            check(&sim.fork(), &answered, now, &case).await;
        }
        if n == 0 {
            assert!(mutations > 0, "the script made no mutation");
        }
        n += 1;
        assert!(n < 10_000, "the script never ran to its end");
    }
    // The sweep reached past the longest run by construction; that the cuts landed
    // (at least one a point on average) is checked here.
    assert!(cuts >= mutations, "{cuts} cuts for a script of {mutations} mutations");
    eprintln!(
        "power cut before each of the script's {mutations} mutations in turn, in two ways ({cuts} cuts), each checked"
    );
}
