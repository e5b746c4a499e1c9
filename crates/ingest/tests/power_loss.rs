//! One power loss takes the log and the state database together, as on a real machine:
//! both live on one simulated disk (`SimStorage`, the state database through
//! `StateDb::open_on`). A seeded script of what the daemon does with them (accepts with
//! and without a delivery id, retries, idempotency checkpoints, endpoint registrations
//! with and without an idempotency key, rotations and revocations, cursor stores and
//! releases) runs until the power goes just
//! before the disk's nth write, sync or metadata change, for every n the script reaches,
//! under both sync policies, losing exactly what was unsynced or keeping any mix of it,
//! sector by sector and entry by entry, in any order (`CrashMode::Reordered`: the disk
//! redb's design assumes, atomic sector writes; the log's own sweeps also tear sectors
//! into garbage, which the database does not claim to survive). Then both are opened again, as a restart does, and checked against what was
//! answered:
//!
//! - every endpoint change that returned is in effect (a revocation never comes back);
//!   the change in flight at the crash is either in effect or not; a registration's
//!   idempotency key is there exactly when its endpoint is;
//! - the stored cursor is at least the last one stored, and the log was not released
//!   past it;
//! - under `always`, every answered event is in the log at the offsets it was given, and
//!   the retry of every answered delivery is answered with those offsets, appending
//!   nothing;
//! - under `interval`, a retry is answered as a replay only of offsets the log holds for
//!   that very delivery; otherwise it is appended again (never a 200 for an event the
//!   log does not hold).
//!
//! The start after a power loss writes too (the index forgets the delivery ids the log
//! lost, then commits its bounds), so after each power loss whose start forgets ids the
//! sweep loses power again at each write of that start, on forks of the disk the first
//! loss left, and checks the start after that the same way.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ingest::{
    CursorRow, Destination, EndpointRecord, Envelope, Event, IdempotencyIndex, Ingestor, KeyedRegistration,
    Partitioning, RebuildReport, StateDb, StoredAuth, Submission,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use wal::storage::{CrashMode, FaultOp, SimStorage, Storage};
use wal::{SyncPolicy, Wal, WalOptions};

const DATA_DIR: &str = "/data";
const STATE_PATH: &str = "/data/state.redb";
const WAL_DIR: &str = "/data/wal";
const RETENTION_MS: u64 = 86_400_000;
const SCRIPT_OPS: usize = 36;
/// A bound on each step, so that a hang after the crash fails the test instead of
/// stalling it.
const STEP_LIMIT: Duration = Duration::from_secs(20);

/// One step of the script.
#[derive(Debug, Clone)]
enum Op {
    /// An event, with a delivery id or without.
    Accept {
        delivery_key: Option<String>,
    },
    /// A delivery sent again (an earlier one of the script, answered or not).
    Retry {
        delivery_key: String,
    },
    Checkpoint,
    /// Registers an endpoint, under an idempotency key when `keyed`.
    Register {
        id: u128,
        keyed: bool,
    },
    /// Rotates (or revokes) the `nth` (modulo how many) endpoint registered so far, if
    /// there is one.
    Rotate {
        nth: usize,
    },
    Revoke {
        nth: usize,
    },
    /// Stores the cursor somewhere up to the log's end, then releases below it (and
    /// below the idempotency checkpoint), as the router does.
    StoreCursorAndRelease {
        ahead: u64,
    },
    /// Gives the log's interval sync a chance to run.
    Pause,
}

fn script(seed: u64) -> Vec<Op> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut keys = 0u32;
    (0..SCRIPT_OPS)
        .map(|i| match rng.gen_range(0..100) {
            0..35 => {
                keys += 1;
                Op::Accept { delivery_key: Some(format!("d-{keys}")) }
            }
            35..50 => Op::Accept { delivery_key: None },
            50..58 if keys > 0 => Op::Retry { delivery_key: format!("d-{}", rng.gen_range(1..=keys)) },
            58..66 => Op::Checkpoint,
            66..74 => Op::Register { id: (seed as u128) << 64 | i as u128, keyed: i % 2 == 0 },
            74..80 => Op::Rotate { nth: rng.r#gen() },
            80..86 => Op::Revoke { nth: rng.r#gen() },
            86..95 => Op::StoreCursorAndRelease { ahead: rng.gen_range(0..8) },
            _ => Op::Pause,
        })
        .collect()
}

fn options(sync: SyncPolicy) -> WalOptions {
    // Small segments, so that the script rotates and releases whole segments.
    WalOptions { sync, segment_max_bytes: 1024, max_bytes: 1 << 20, preallocate_bytes: 256, ..WalOptions::default() }
}

/// The endpoint a delivery came through: every other delivery id of the script through a
/// secret-path endpoint (its id scoped by the endpoint), the rest by the named path.
fn endpoint_of(delivery_key: &str) -> Option<u128> {
    let n: u64 = delivery_key.trim_start_matches("d-").parse().unwrap_or(0);
    (n % 2 == 1).then_some(0x5eed)
}

/// A request of one to three events (an NDJSON batch: one append of as many records),
/// as many for each sending of one delivery id, each event's payload `payload` and its
/// place in the request.
fn submission(delivery_key: Option<&str>, payload: String, now: u64) -> Submission {
    let size = |text: &str| 1 + text.bytes().map(u64::from).sum::<u64>() % 3;
    let events = delivery_key.map_or_else(|| size(&payload), size);
    Submission {
        source_key: "s".into(),
        endpoint_id: delivery_key.and_then(endpoint_of),
        content_type: None,
        metadata: vec![],
        headers: vec![],
        delivery_key: delivery_key.map(str::to_string),
        events: (0..events)
            .map(|j| Event {
                destination: Destination {
                    stream: "a".into(),
                    topic: "b".into(),
                    partitioning: Partitioning::Balanced,
                },
                payload: Bytes::from(format!("{payload}/{j}")),
                request_index: j as u32,
            })
            .collect(),
        received_at_unix_ms: now,
    }
}

/// Notes each event of `s`, appended from `first`, as answered at its offset.
fn note_records(answered: &mut Answered, s: &Submission, first: u64) {
    for (j, e) in s.events.iter().enumerate() {
        answered.records.insert(first + j as u64, e.payload.clone());
    }
}

fn endpoint(id: u128, secret: &str, now: u64) -> EndpointRecord {
    EndpointRecord {
        id,
        source_key: "s".into(),
        auth: StoredAuth {
            scheme: "bearer".into(),
            secret: Some(secret.into()),
            header: None,
            prefix: None,
            tolerance_secs: None,
        },
        handshake_param: None,
        created_at_unix_ms: now,
        expires_at_unix_ms: None,
        revoked_at_unix_ms: None,
        rotated_at_unix_ms: None,
    }
}

fn cursor_row(delivered_below: u64) -> CursorRow {
    CursorRow { source: "s".into(), stream: "a".into(), topic: "b".into(), delivered_below }
}

/// A durable state that outlived its step's answer, or the step the crash cut short.
#[derive(Debug, Default)]
struct Answered {
    /// Delivery id → the offsets its first acceptance was given.
    keys: BTreeMap<String, (u64, u64)>,
    /// Offset → the payload answered there.
    records: BTreeMap<u64, Bytes>,
    /// Endpoint id → the record of its last answered change (`None`: its registration
    /// never answered), and the change in flight at the crash.
    endpoints: BTreeMap<u128, (Option<EndpointRecord>, Option<EndpointRecord>)>,
    /// Endpoint id → whether its registration under an idempotency key answered (`false`:
    /// in flight at the crash).
    registration_keys: BTreeMap<u128, bool>,
    /// The last cursor stored, and one in flight at the crash.
    cursor: (u64, Option<u64>),
}

/// The daemon's pieces over one disk.
struct Opened {
    wal: Arc<Wal>,
    state: Arc<StateDb>,
    ingestor: Ingestor,
    /// What the index's rebuild at this start did.
    rebuilt: RebuildReport,
}

fn open(sim: &SimStorage, sync: SyncPolicy, now: u64) -> Result<Opened, String> {
    let storage: Arc<dyn Storage> = Arc::new(sim.clone());
    let wal =
        Wal::open_with(storage.clone(), Path::new(WAL_DIR), options(sync)).map_err(|e| format!("the log: {e}"))?;
    let wal = Arc::new(wal);
    let state = Arc::new(StateDb::open_on(storage, STATE_PATH).map_err(|e| format!("the state database: {e}"))?);
    // The recorder commits each key as soon as it has it, and the script waits for the
    // commit after each keyed acceptance (`until_recorded`): the order of the disk's
    // mutations is then the same in every run, so a power loss before the nth lands on
    // the same write each time; and a key is recorded before the log's interval sync
    // (a linger longer than the interval would never let the sweep reach a key durable
    // in the database for a record the log lost).
    let index = Arc::new(IdempotencyIndex::new(state.clone(), RETENTION_MS).with_record_linger(Duration::ZERO));
    let rebuilt = index.rebuild(&wal, now).map_err(|e| format!("the idempotency index: {e}"))?;
    let ingestor = Ingestor::new(wal.clone(), index);
    Ok(Opened { wal, state, ingestor, rebuilt })
}

/// Waits until the key of `delivery_key`'s acceptance is recorded (or owed): its claim
/// was let go.
async fn until_recorded(ingestor: &Ingestor, delivery_key: &str) {
    let key = ingest::IdempotencyKey {
        source_key: "s".into(),
        endpoint_id: endpoint_of(delivery_key),
        delivery_key: delivery_key.into(),
    };
    while ingestor.idempotency().is_claimed(&key) {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

/// Runs `script` on a fresh disk until its end or the power loss armed at the `crash_at`th
/// mutation; returns what was answered and how many mutations the disk saw.
async fn run_until_crash(
    sim: &SimStorage,
    script: &[Op],
    sync: SyncPolicy,
    crash_at: Option<(u64, CrashMode)>,
    now: u64,
) -> Answered {
    if let Some((n, mode)) = crash_at {
        sim.crash_at_nth(FaultOp::AnyMutation, n, mode);
    }
    let mut answered = Answered::default();
    // The first start creates the data directory, the log and the state database: the
    // power may go while it does.
    let started = wal::storage::create_dir_all_durably(sim, Path::new(DATA_DIR))
        .map_err(|e| e.to_string())
        .and_then(|()| open(sim, sync, now));
    let daemon = match started {
        Ok(daemon) => daemon,
        Err(_) if sim.crashes() > 0 => return answered,
        Err(e) => panic!("the first start failed with the power on: {e}"),
    };
    let mut registered: Vec<u128> = Vec::new();
    for (i, op) in script.iter().enumerate() {
        let payload = format!("{{\"op\":{i}}}");
        let step = async {
            match op {
                Op::Accept { delivery_key } => {
                    let s = submission(delivery_key.as_deref(), payload.clone(), now);
                    match daemon.ingestor.accept(s.clone()).await {
                        Ok(a) if a.replayed => panic!("op {i}: a new delivery was answered as a replay: {a:?}"),
                        Ok(a) => {
                            note_records(&mut answered, &s, a.first_offset);
                            if let Some(k) = delivery_key {
                                answered.keys.insert(k.clone(), (a.first_offset, a.last_offset));
                                until_recorded(&daemon.ingestor, k).await;
                            }
                            Ok(())
                        }
                        Err(e) => Err(e.to_string()),
                    }
                }
                Op::Retry { delivery_key } => {
                    let s = submission(Some(delivery_key), payload.clone(), now);
                    match daemon.ingestor.accept(s.clone()).await {
                        Ok(a) if a.replayed => {
                            let original = answered.keys.get(delivery_key).copied();
                            assert_eq!(
                                original,
                                Some((a.first_offset, a.last_offset)),
                                "op {i}: replayed {delivery_key}"
                            );
                            Ok(())
                        }
                        Ok(a) => {
                            // Its earlier sending was not answered (the script never
                            // answers one without a crash): this one is appended.
                            assert!(!answered.keys.contains_key(delivery_key), "op {i}: {delivery_key} appended twice");
                            note_records(&mut answered, &s, a.first_offset);
                            answered.keys.insert(delivery_key.clone(), (a.first_offset, a.last_offset));
                            until_recorded(&daemon.ingestor, delivery_key).await;
                            Ok(())
                        }
                        Err(e) => Err(e.to_string()),
                    }
                }
                Op::Checkpoint => daemon
                    .ingestor
                    .idempotency()
                    .checkpoint(&daemon.wal, now)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                Op::Register { id, keyed: false } => {
                    registered.push(*id);
                    put(&daemon.state, &mut answered, endpoint(*id, &format!("secret-{i}"), now))
                }
                Op::Register { id, keyed: true } => {
                    registered.push(*id);
                    let record = endpoint(*id, &format!("secret-{i}"), now);
                    answered.endpoints.entry(*id).or_default().1 = Some(record.clone());
                    answered.registration_keys.insert(*id, false);
                    daemon.state.put_registered_endpoint(&record, &registration_key(*id)).map_err(|e| e.to_string())?;
                    answered.endpoints.insert(*id, (Some(record), None));
                    answered.registration_keys.insert(*id, true);
                    Ok(())
                }
                Op::Rotate { nth } | Op::Revoke { nth } => {
                    let Some(&id) = registered.get(nth % registered.len().max(1)) else { return Ok(()) };
                    let Some(current) = daemon.state.get_endpoint(id).map_err(|e| e.to_string())? else {
                        return Ok(());
                    };
                    let mut next = current.clone();
                    if matches!(op, Op::Revoke { .. }) {
                        next.revoked_at_unix_ms = Some(now + i as u64);
                    } else {
                        next.auth.secret = Some(format!("secret-{i}"));
                        next.rotated_at_unix_ms = Some(now + i as u64);
                    }
                    put(&daemon.state, &mut answered, next)
                }
                Op::StoreCursorAndRelease { ahead } => {
                    let stored = answered.cursor.0;
                    let cursor = (stored + ahead).min(daemon.wal.next_offset()).max(stored);
                    answered.cursor.1 = Some(cursor);
                    daemon.state.store_cursors(&[cursor_row(cursor)]).map_err(|e| e.to_string())?;
                    answered.cursor = (cursor, None);
                    let ceiling =
                        daemon.ingestor.idempotency().durable_through().load(std::sync::atomic::Ordering::Acquire);
                    daemon.wal.release_below(cursor.min(ceiling)).await.map(|_| ()).map_err(|e| e.to_string())
                }
                Op::Pause => {
                    tokio::time::sleep(Duration::from_millis(3)).await;
                    Ok(())
                }
            }
        };
        let outcome = tokio::time::timeout(STEP_LIMIT, step).await.unwrap_or_else(|_| panic!("op {i} ({op:?}) hung"));
        if sim.crashes() > 0 {
            break;
        }
        if let Err(e) = outcome {
            panic!("op {i} ({op:?}) failed with the power on: {e}");
        }
    }
    answered
}

/// The idempotency key endpoint `id` is registered under, when it is.
fn registration_key(id: u128) -> KeyedRegistration {
    KeyedRegistration { key: format!("reg-{id:x}").into_bytes(), id, fingerprint: [id as u8; 32] }
}

/// Writes an endpoint change durably, noting it in flight first.
fn put(state: &StateDb, answered: &mut Answered, record: EndpointRecord) -> Result<(), String> {
    let entry = answered.endpoints.entry(record.id).or_default();
    entry.1 = Some(record.clone());
    state.put_endpoint(&record).map_err(|e| e.to_string())?;
    *entry = (Some(record), None);
    Ok(())
}

/// Opens the disk again after the power loss and checks it against `answered`.
async fn check_after_crash(sim: &SimStorage, answered: &Answered, sync: SyncPolicy, now: u64, case: &str) {
    let daemon = open(sim, SyncPolicy::Always, now + 1).unwrap_or_else(|e| panic!("{case}: {e}"));
    let wal = &daemon.wal;

    for (id, (done, in_flight)) in &answered.endpoints {
        let found = daemon.state.get_endpoint(*id).unwrap();
        let allowed = found == *done || (found.is_some() && found == *in_flight);
        assert!(allowed, "{case}: endpoint {id:x} is {found:?}, answered {done:?} (in flight {in_flight:?})");
    }
    // A registration's key is stored with its endpoint: both, or (in flight) neither.
    let keys = daemon.state.load_keyed_registrations().unwrap();
    for (&id, &registration_answered) in &answered.registration_keys {
        let key_found = keys.contains(&registration_key(id));
        let endpoint_found = daemon.state.get_endpoint(id).unwrap().is_some();
        assert!(key_found || !registration_answered, "{case}: the key of endpoint {id:x}'s answered registration");
        assert_eq!(key_found, endpoint_found, "{case}: endpoint {id:x}'s key and record apart");
    }
    assert!(
        keys.iter().all(|k| answered.registration_keys.contains_key(&k.id)),
        "{case}: a key no registration wrote: {keys:?}"
    );

    let (cursor_done, cursor_in_flight) = answered.cursor;
    let stored = daemon.state.load_cursors().unwrap().first().map_or(0, |r| r.delivered_below);
    assert!(
        stored >= cursor_done && stored <= cursor_in_flight.unwrap_or(cursor_done).max(cursor_done),
        "{case}: the stored cursor is {stored}, answered {cursor_done} (in flight {cursor_in_flight:?})"
    );
    assert!(
        wal.start_offset() <= stored,
        "{case}: the log was released to {} past its cursor {stored}",
        wal.start_offset()
    );

    let next_at_reopen = wal.next_offset();
    let held: BTreeMap<u64, Envelope> = wal::inspect::Records::new(wal, wal.start_offset())
        .unwrap()
        .map(|r| r.unwrap())
        .map(|r| (r.offset, Envelope::decode(&r.payload).unwrap()))
        .collect();
    if sync == SyncPolicy::Always {
        for (offset, payload) in answered.records.range(wal.start_offset()..) {
            let found = held.get(offset).map(|e| &e.payload);
            assert_eq!(found, Some(payload), "{case}: the event answered at offset {offset}");
        }
    }
    for (offset, envelope) in &held {
        if let Some(payload) = answered.records.get(offset) {
            assert_eq!(&envelope.payload, payload, "{case}: another event at answered offset {offset}");
        }
    }

    for (key, &(first, last)) in &answered.keys {
        let retry = daemon.ingestor.accept(submission(Some(key), "{\"retry\":true}".into(), now + 1)).await.unwrap();
        if retry.replayed {
            assert_eq!((retry.first_offset, retry.last_offset), (first, last), "{case}: {key} replayed elsewhere");
            assert!(last < next_at_reopen, "{case}: {key} replayed from offsets the log does not hold");
            if let Some(envelope) = held.get(&first) {
                assert_eq!(envelope.header.idempotency_key.as_deref(), Some(key.as_str()), "{case}: offset {first}");
            }
        } else {
            assert!(sync != SyncPolicy::Always, "{case}: answered delivery {key} appended again: {retry:?}");
            assert!(first >= next_at_reopen, "{case}: {key} appended again though the log holds it at {first}");
        }
    }
    if sync == SyncPolicy::Always {
        assert_eq!(wal.next_offset(), next_at_reopen, "{case}: a retry appended");
    }

    // And it goes on: a new delivery is appended, and its retry replayed.
    let fresh = daemon.ingestor.accept(submission(Some("after"), "{}".into(), now + 2)).await.unwrap();
    let again = daemon.ingestor.accept(submission(Some("after"), "{}".into(), now + 2)).await.unwrap();
    assert!(!fresh.replayed && again.replayed && again.first_offset == fresh.first_offset, "{case}: after the restart");
    wal.close().await.unwrap();
}

/// How many of the mutations of a crash-free run to crash at: every one by default
/// (`POWER_LOSS_STRIDE=N` takes every nth, for a quicker run).
fn stride() -> u64 {
    std::env::var("POWER_LOSS_STRIDE").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1)
}

/// What a script's crash-free run did, beside accepting: so that a change to the script
/// cannot quietly stop testing it.
#[derive(Debug, Default, Clone, Copy)]
struct Covered {
    released: bool,
    rotated: bool,
    revoked: bool,
    keyed: bool,
    /// A start after a power loss forgot delivery ids ([`cut_the_start_after`]), and was
    /// cut before its durable commit (the next start forgot again) and after it.
    start_forgot: bool,
    start_cut_before_commit: bool,
    start_cut_after_commit: bool,
}

impl std::ops::BitOr for Covered {
    type Output = Covered;
    fn bitor(self, o: Covered) -> Covered {
        Covered {
            released: self.released | o.released,
            rotated: self.rotated | o.rotated,
            revoked: self.revoked | o.revoked,
            keyed: self.keyed | o.keyed,
            start_forgot: self.start_forgot | o.start_forgot,
            start_cut_before_commit: self.start_cut_before_commit | o.start_cut_before_commit,
            start_cut_after_commit: self.start_cut_after_commit | o.start_cut_after_commit,
        }
    }
}

async fn sweep(seed: u64, sync: SyncPolicy) -> Covered {
    let now = ingest::time::now_unix_ms();
    let script = script(seed);
    let clean = SimStorage::new();
    let answered = run_until_crash(&clean, &script, sync, None, now).await;
    let released = Wal::open_read_only_with(Arc::new(clean.clone()), Path::new(WAL_DIR)).unwrap().start_offset() > 0;
    let changes = |f: fn(&EndpointRecord) -> bool| answered.endpoints.values().flat_map(|(done, _)| done).any(f);
    let mut covered = Covered {
        released,
        rotated: changes(|e| e.rotated_at_unix_ms.is_some()),
        revoked: changes(|e| e.revoked_at_unix_ms.is_some()),
        keyed: answered.registration_keys.values().any(|&answered| answered),
        ..Covered::default()
    };
    let mut cut = CutStarts::default();
    let mutations = clean.ops();
    assert!(mutations > 50, "the script barely wrote: {mutations} mutations");
    let mut crashes = 0;
    let mut points = 0u64;
    for n in (1..=mutations).step_by(stride() as usize) {
        points += 1;
        for mode in [CrashMode::LoseUnsynced, CrashMode::Reordered { seed: seed ^ n }] {
            let sim = SimStorage::new();
            let answered = run_until_crash(&sim, &script, sync, Some((n, mode)), now).await;
            if sim.crashes() == 0 {
                continue; // this run made fewer mutations than the clean one
            }
            crashes += 1;
            sim.disarm();
            let case = format!("seed {seed}, {sync:?}, crash before mutation {n} of {mutations}, {mode:?}");
            cut_the_start_after(&sim, &answered, sync, now, &case, &mut cut).await;
            check_after_crash(&sim, &answered, sync, now, &case).await;
        }
    }
    // Two runs a point: more than one on average cut (the others made fewer mutations
    // than the clean run, by timing), whatever the stride.
    assert!(crashes as u64 > points, "only {crashes} cuts at {points} crash points of {mutations} mutations");
    covered.start_forgot = cut.forgetting_starts > 0;
    covered.start_cut_before_commit = cut.forgot_again > 0;
    covered.start_cut_after_commit = cut.forgot_nothing > 0;
    eprintln!(
        "seed {seed}, {sync:?}: {crashes} power losses over {mutations} mutations, all consistent; starts cut short: \
         {cut:?}; {covered:?}"
    );
    covered
}

/// What the starts cut short by [`cut_the_start_after`] found.
#[derive(Debug, Default)]
struct CutStarts {
    /// First power losses after which the start forgot delivery ids.
    forgetting_starts: u64,
    /// Power losses during those starts.
    cuts: u64,
    /// Cuts after which the next start forgot ids again: the cut came before the start's
    /// durable commit, and its forgets were lost or never made.
    forgot_again: u64,
    /// Cuts after which it had nothing left to forget: the cut came after that commit.
    forgot_nothing: u64,
}

/// A start after a power loss writes too: the log makes its recovered tail durable, and
/// the index forgets the delivery ids the log lost (in transactions of at most 10,000
/// keys, not durable on their own), then restores keys and writes its bounds in one
/// durable commit. If the start after the power loss `sim` went through forgets ids, the
/// power goes again before each write of that start, and once just after it returned (on
/// forks of the disk as the first loss left it), and the start after that is checked as
/// after any power loss: an id the log lost must not answer a retry as a replay,
/// whichever of its forgets survived.
async fn cut_the_start_after(
    sim: &SimStorage,
    answered: &Answered,
    sync: SyncPolicy,
    now: u64,
    case: &str,
    found: &mut CutStarts,
) {
    let probe = sim.fork();
    let start = open(&probe, SyncPolicy::Always, now + 1).unwrap_or_else(|e| panic!("{case}: the start failed: {e}"));
    let start_mutations = probe.ops();
    let forgot = start.rebuilt.keys_beyond_log_forgotten;
    start.wal.close().await.unwrap();
    if forgot == 0 {
        return;
    }
    found.forgetting_starts += 1;
    for m in 1..=start_mutations + 1 {
        let seed = m << 32 ^ start_mutations;
        for cut_mode in [CrashMode::LoseUnsynced, CrashMode::Reordered { seed }] {
            let disk = sim.fork();
            if m <= start_mutations {
                disk.crash_at_nth(FaultOp::AnyMutation, m, cut_mode);
            }
            // The start cut short: it fails, or returns just before the power goes.
            let started = open(&disk, SyncPolicy::Always, now + 1);
            if m > start_mutations {
                disk.crash(cut_mode);
            }
            drop(started);
            if disk.crashes() == 0 {
                continue;
            }
            disk.disarm();
            found.cuts += 1;
            let case = format!("{case}, then before mutation {m} of the start's {start_mutations} ({cut_mode:?})");
            let next = disk.fork();
            let again = open(&next, SyncPolicy::Always, now + 1).unwrap_or_else(|e| panic!("{case}: {e}"));
            if again.rebuilt.keys_beyond_log_forgotten > 0 {
                found.forgot_again += 1;
            } else {
                found.forgot_nothing += 1;
            }
            again.wal.close().await.unwrap();
            check_after_crash(&disk, answered, sync, now, &case).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_loss_at_any_write_keeps_every_answer_of_the_log_and_the_state_database_under_always() {
    let covered = sweep(1, SyncPolicy::Always).await | sweep(2, SyncPolicy::Always).await;
    assert!(covered.released && covered.rotated && covered.revoked && covered.keyed, "{covered:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_loss_at_any_write_never_replays_what_the_log_lost_under_interval() {
    let interval = SyncPolicy::Interval(Duration::from_millis(2));
    let covered = sweep(3, interval).await | sweep(4, interval).await;
    assert!(covered.released && covered.rotated && covered.revoked && covered.keyed, "{covered:?}");
    // The sweep reached starts that forget, and cut them both before and after their
    // durable commit.
    assert!(covered.start_forgot && covered.start_cut_before_commit && covered.start_cut_after_commit, "{covered:?}");
}

/// A commit whose sync failed leaves its pages in the page cache, clean but not on the
/// disk. The database opened again after it (in process, or by the next start) must read
/// the disk, not those pages: a database that adopted the failed commit from the cache
/// would build the next commits on pages the disk never got, and after a power loss
/// neither its newest nor its previous commit would check. Here the failed commit stores
/// a cursor, and the one after the reopen revokes an endpoint, answered 2xx: it leaves
/// the cursors' table as it found it, so it points at that table's pages. After the
/// power loss the database opens, the revocation holds, and the cursor is the one
/// stored before.
#[test]
fn a_reopen_after_a_failed_sync_reads_the_disk_not_the_failed_commit_left_in_the_cache() {
    for reopened_by in ["the running daemon", "the next start"] {
        let sim = SimStorage::new();
        sim.set_failed_syncs_write_nothing(true);
        let storage: Arc<dyn Storage> = Arc::new(sim.clone());
        sim.write_file_durably(Path::new("/data/keep"), b"").unwrap();
        let state = StateDb::open_on(storage.clone(), STATE_PATH).unwrap();
        let first = endpoint(1, "one", 1_000);
        state.put_endpoint(&first).unwrap();
        state.store_cursors(&[cursor_row(10)]).unwrap();

        sim.fail_nth(FaultOp::Sync, 1, std::io::ErrorKind::Other);
        state.store_cursors(&[cursor_row(20)]).expect_err("its sync failed");
        let state = match reopened_by {
            "the running daemon" => {
                assert!(state.reopen_if_failed().unwrap(), "reopened");
                state
            }
            _ => {
                drop(state);
                StateDb::open_on(storage.clone(), STATE_PATH).unwrap()
            }
        };
        assert_eq!(state.load_cursors().unwrap(), vec![cursor_row(10)], "{reopened_by}: the disk's cursor");
        let revoked = EndpointRecord { revoked_at_unix_ms: Some(3_000), ..first.clone() };
        state.put_endpoint(&revoked).unwrap();
        drop(state);

        sim.crash(CrashMode::LoseUnsynced);
        // The process after the power loss has a view of its own.
        let state = StateDb::open_on(Arc::new(sim.clone()), STATE_PATH)
            .unwrap_or_else(|e| panic!("{reopened_by}: the database does not open after the power loss: {e}"));
        assert_eq!(state.get_endpoint(1).unwrap(), Some(revoked), "{reopened_by}: the revocation holds");
        assert_eq!(state.load_cursors().unwrap(), vec![cursor_row(10)], "{reopened_by}: the cursor stored");
    }
}
