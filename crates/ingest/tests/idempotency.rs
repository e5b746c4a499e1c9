//! Delivery ids across a log that lost its tail after their keys were stored.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ingest::{Destination, Event, IdempotencyIndex, Ingestor, Partitioning, StateDb, Submission};
use wal::storage::{CrashMode, SimStorage};
use wal::{SyncPolicy, Wal, WalOptions};

const RETENTION_MS: u64 = 86_400_000;

fn submission(delivery_key: Option<&str>, now: u64) -> Submission {
    Submission {
        source_key: "s".into(),
        endpoint_id: None,
        content_type: None,
        metadata: vec![],
        headers: vec![],
        delivery_key: delivery_key.map(str::to_string),
        events: vec![Event {
            destination: Destination { stream: "a".into(), topic: "b".into(), partitioning: Partitioning::Balanced },
            payload: Bytes::from_static(b"{}"),
            request_index: 0,
        }],
        received_at_unix_ms: now,
    }
}

fn open_wal(sim: &SimStorage, sync: SyncPolicy) -> Arc<Wal> {
    let options = WalOptions { sync, ..WalOptions::default() };
    Arc::new(Wal::open_with(Arc::new(sim.clone()), Path::new("/wal"), options).unwrap())
}

/// A started index: rebuilt against `wal`, as the daemon does before serving.
fn start(state: &Arc<StateDb>, wal: &Arc<Wal>, now: u64) -> (Ingestor, ingest::idempotency::RebuildReport) {
    let index = Arc::new(IdempotencyIndex::new(state.clone(), RETENTION_MS));
    let report = index.rebuild(wal, now).unwrap();
    (Ingestor::new(wal.clone(), index), report)
}

#[tokio::test]
async fn a_key_whose_record_a_power_loss_took_is_forgotten_and_its_retry_appended_again() {
    let dir = tempfile::tempdir().unwrap();
    let state = Arc::new(StateDb::open(dir.path().join("state.redb")).unwrap());
    let sim = SimStorage::new();
    let now = ingest::time::now_unix_ms();

    // d-0 (offset 0) and two events without a delivery id, synced; a checkpoint covers them.
    let wal = open_wal(&sim, SyncPolicy::Always);
    let (ingestor, _) = start(&state, &wal, now);
    let d0 = ingestor.accept(submission(Some("d-0"), now)).await.unwrap();
    assert_eq!((d0.first_offset, d0.replayed), (0, false));
    for _ in 0..2 {
        ingestor.accept(submission(None, now)).await.unwrap();
    }
    assert_eq!(ingestor.idempotency().checkpoint(&wal, now).await.unwrap(), 3);
    wal.close().await.unwrap();
    drop((ingestor, wal));

    // Under `interval`, d-1 is answered (offset 3) and its key recorded before the sync;
    // a durable commit of the state database (here a cursor store) persists the key, then
    // the power goes before the log syncs.
    let wal = open_wal(&sim, SyncPolicy::Interval(Duration::from_secs(60)));
    let (ingestor, _) = start(&state, &wal, now);
    let d1 = ingestor.accept(submission(Some("d-1"), now)).await.unwrap();
    assert_eq!((d1.first_offset, d1.replayed), (3, false));
    state.store_cursors(&[]).unwrap();
    sim.crash(CrashMode::LoseUnsynced);
    drop((ingestor, wal));

    let wal = open_wal(&sim, SyncPolicy::Always);
    assert_eq!(wal.next_offset(), 3, "the power loss took d-1's record");
    let (ingestor, report) = start(&state, &wal, now + 1);
    assert_eq!(report.keys_beyond_log_forgotten, 1);

    // The retry of d-1 is appended anew, at the offset the log now gives it.
    let retry = ingestor.accept(submission(Some("d-1"), now + 1)).await.unwrap();
    assert!(
        !retry.replayed,
        "answered as a replay of offsets {}..={}, which the log (next offset 3) does not hold",
        retry.first_offset, retry.last_offset
    );
    assert_eq!(retry.first_offset, 3);
    let records: Vec<_> = wal::inspect::Records::new(&wal, 0).unwrap().map(|r| r.unwrap()).collect();
    let stored = ingest::Envelope::decode(&records[3].payload).unwrap();
    assert_eq!(stored.header.idempotency_key.as_deref(), Some("d-1"));

    // Keys below the log's end are kept: d-0 still replays, and so does d-1 now.
    let again = ingestor.accept(submission(Some("d-0"), now + 2)).await.unwrap();
    assert_eq!((again.first_offset, again.last_offset, again.replayed), (0, 0, true));
    let again = ingestor.accept(submission(Some("d-1"), now + 2)).await.unwrap();
    assert_eq!((again.first_offset, again.replayed), (3, true));

    // A later start finds the keys below the log's end and forgets none.
    wal.close().await.unwrap();
    drop((ingestor, wal));
    let wal = open_wal(&sim, SyncPolicy::Always);
    let (_, report) = start(&state, &wal, now + 3);
    assert_eq!(report.keys_beyond_log_forgotten, 0);
}

#[tokio::test]
async fn keys_are_forgotten_when_the_log_directory_was_replaced_by_a_shorter_one() {
    let dir = tempfile::tempdir().unwrap();
    let state = Arc::new(StateDb::open(dir.path().join("state.redb")).unwrap());
    let now = ingest::time::now_unix_ms();
    let sim = SimStorage::new();
    let wal = open_wal(&sim, SyncPolicy::Always);
    let (ingestor, _) = start(&state, &wal, now);
    for _ in 0..3 {
        ingestor.accept(submission(None, now)).await.unwrap();
    }
    let d1 = ingestor.accept(submission(Some("d-1"), now)).await.unwrap();
    assert_eq!(d1.first_offset, 3);
    ingestor.idempotency().checkpoint(&wal, now).await.unwrap();
    wal.close().await.unwrap();
    drop((ingestor, wal));

    // Another, empty log directory: the checkpoint (4) is ahead of it.
    let wal = open_wal(&SimStorage::new(), SyncPolicy::Always);
    let (ingestor, report) = start(&state, &wal, now + 1);
    assert_eq!(report.keys_beyond_log_forgotten, 1);
    let retry = ingestor.accept(submission(Some("d-1"), now + 1)).await.unwrap();
    assert_eq!((retry.first_offset, retry.replayed), (0, false));
}

/// Under `interval` a failed sync stops the log, and may have taken records already
/// answered: a retry of such a delivery is not answered 200 as a replay of offsets the
/// log does not hold, but refused like any request to a stopped log. A delivery whose
/// record the log holds durably still replays.
#[tokio::test]
async fn a_retry_is_not_replayed_from_offsets_a_stopped_log_does_not_hold() {
    let dir = tempfile::tempdir().unwrap();
    let state = Arc::new(StateDb::open(dir.path().join("state.redb")).unwrap());
    let sim = SimStorage::new();
    let now = ingest::time::now_unix_ms();
    let wal = open_wal(&sim, SyncPolicy::Interval(Duration::from_millis(20)));
    let (ingestor, _) = start(&state, &wal, now);
    let durable = ingestor.accept(submission(Some("d-durable"), now)).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while wal.next_offset() <= durable.last_offset {
        assert!(std::time::Instant::now() < deadline, "the interval sync never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The next sync fails: d-lost was answered, then the log stops without it.
    sim.fail_nth(wal::storage::FaultOp::Sync, 1, std::io::ErrorKind::Other);
    let lost = ingestor.accept(submission(Some("d-lost"), now)).await.unwrap();
    assert!(!lost.replayed);
    while wal.accepts_appends() {
        assert!(std::time::Instant::now() < deadline, "the failed sync did not stop the log");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(wal.next_offset() <= lost.first_offset, "the log holds d-lost durably after all");

    match ingestor.accept(submission(Some("d-lost"), now + 1)).await {
        Err(ingest::IngestError::Stopped(why)) => assert!(why.contains("does not hold"), "{why}"),
        other => panic!("the retry of a delivery the stopped log may have lost was answered {other:?}"),
    }
    let again = ingestor.accept(submission(Some("d-durable"), now + 1)).await.unwrap();
    assert_eq!((again.first_offset, again.replayed), (durable.first_offset, true));
}

/// A salvage in place keeps the log's prefix before damage and resumes above every
/// offset the damaged files could hold; `wal salvage --out` copies around damage. Either
/// way the log goes on past offsets it no longer holds, so a key recorded there is below
/// the log's end and the rule for keys past the end does not reach it. Such a key must
/// not answer its retry "replayed": the event is gone, and the retry is all that can
/// bring it back. Keys of records the log kept still replay.
#[tokio::test]
async fn keys_of_records_a_salvage_skipped_are_forgotten_and_their_retries_appended_again() {
    let dir = tempfile::tempdir().unwrap();
    let state = Arc::new(StateDb::open(dir.path().join("state.redb")).unwrap());
    let sim = SimStorage::new();
    let now = ingest::time::now_unix_ms();
    let options = |recovery| WalOptions { segment_max_bytes: 1024, recovery, ..WalOptions::default() };
    let open =
        |recovery| Arc::new(Wal::open_with(Arc::new(sim.clone()), Path::new("/wal"), options(recovery)).unwrap());

    // Keys d-0 to d-39, a few records per segment; a checkpoint covers all of them.
    let wal = open(wal::RecoveryMode::Strict);
    let (ingestor, _) = start(&state, &wal, now);
    let mut offsets = Vec::new();
    for i in 0..40 {
        offsets.push(ingestor.accept(submission(Some(&format!("d-{i}")), now)).await.unwrap().first_offset);
    }
    ingestor.idempotency().checkpoint(&wal, now).await.unwrap();
    let segments = wal.segment_paths();
    assert!(segments.len() >= 4, "{segments:?}");
    wal.close().await.unwrap();
    drop((ingestor, wal));

    // A flipped byte in the second segment's first record.
    let second = &segments[1];
    let mut bytes = sim.read_file(second).unwrap();
    bytes[wal::format::SEGMENT_HEADER_LEN as usize + wal::format::FRAME_HEADER_LEN as usize + 1] ^= 1;
    sim.write_file_durably(second, &bytes).unwrap();

    let wal = open(wal::RecoveryMode::Salvage);
    let salvage = wal.open_report().salvage.clone().expect("the open salvaged");
    let kept_below = salvage.kept_until_offset;
    assert!(kept_below > 0 && kept_below < 40, "{salvage:?}");
    assert!(wal.next_offset() > 40, "the salvage resumes above the damaged files' offsets");
    let (ingestor, report) = start(&state, &wal, now + 1);
    let skipped = offsets.iter().filter(|&&o| o >= kept_below).count() as u64;
    assert_eq!(report.keys_beyond_log_forgotten, 0, "the keys are below the log's end");
    assert_eq!(report.keys_in_missing_ranges_forgotten, skipped);

    let kept = ingestor.accept(submission(Some("d-0"), now + 1)).await.unwrap();
    assert_eq!((kept.first_offset, kept.replayed), (0, true), "a kept record's key still replays");
    let retry = ingestor.accept(submission(Some("d-39"), now + 1)).await.unwrap();
    assert!(!retry.replayed, "the retry of a delivery the salvage skipped was answered as a replay");
    assert!(retry.first_offset >= salvage.resumed_at_offset);
    ingestor.idempotency().checkpoint(&wal, now + 1).await.unwrap();
    wal.close().await.unwrap();
    drop((ingestor, wal));

    // The next start finds the same missing ranges: nothing left to forget, and the
    // retried delivery replays from its new offset.
    let wal = open(wal::RecoveryMode::Strict);
    let (ingestor, report) = start(&state, &wal, now + 2);
    assert_eq!(report.keys_in_missing_ranges_forgotten, 0);
    let again = ingestor.accept(submission(Some("d-39"), now + 2)).await.unwrap();
    assert_eq!((again.first_offset, again.replayed), (retry.first_offset, true));
}

/// A storage double: the simulated disk, whose syncs can be held
/// ([`wal::storage::HoldSyncs`]).
type HeldSyncs = wal::storage::HookedStorage<wal::storage::HoldSyncs>;

/// Two requests with one delivery id at once: while the first is being appended (its
/// sync held), its twin is refused as in flight and appends nothing, by `accept` and by
/// `replay_of`; once the first is durable, a retry is its replay, with its offsets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_twin_arriving_while_its_delivery_is_appended_is_refused_and_appends_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let state = Arc::new(StateDb::open(dir.path().join("state.redb")).unwrap());
    let storage = HeldSyncs::new(Arc::new(SimStorage::new()), wal::storage::HoldSyncs::default());
    let wal = Arc::new(Wal::open_with(Arc::new(storage.clone()), Path::new("/wal"), WalOptions::default()).unwrap());
    let now = ingest::time::now_unix_ms();
    let (ingestor, _) = start(&state, &wal, now);
    let ingestor = Arc::new(ingestor);
    ingestor.accept(submission(Some("d-0"), now)).await.unwrap();

    let held = storage.hold_syncs();
    let first = {
        let ingestor = ingestor.clone();
        tokio::spawn(async move { ingestor.accept(submission(Some("d-1"), now)).await })
    };
    let key = ingest::IdempotencyKey { source_key: "s".into(), endpoint_id: None, delivery_key: "d-1".into() };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !ingestor.idempotency().is_claimed(&key) {
        assert!(std::time::Instant::now() < deadline, "the first request never claimed its delivery id");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The first is in flight: its twin is refused and nothing is appended for it.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!first.is_finished(), "the first request finished with its sync held");
    // (Bounded: a twin let through would wait on the held sync for good.)
    let twin = tokio::time::timeout(Duration::from_secs(5), ingestor.accept(submission(Some("d-1"), now))).await;
    assert!(matches!(twin, Ok(Err(ingest::IngestError::InFlight))), "{twin:?}");
    let replay = tokio::time::timeout(Duration::from_secs(5), ingestor.replay_of(&key, now)).await;
    assert!(matches!(replay, Ok(Err(ingest::IngestError::InFlight))), "{replay:?}");

    drop(held);
    let accepted = first.await.unwrap().unwrap();
    assert_eq!((accepted.first_offset, accepted.replayed), (1, false));
    let retry = ingestor.accept(submission(Some("d-1"), now)).await.unwrap();
    assert_eq!((retry.first_offset, retry.last_offset, retry.replayed), (1, accepted.last_offset, true));
    assert_eq!(wal.next_offset(), 2, "the twin or the retry appended");
}

/// A record whose envelope names a request of more events than the log holds after it
/// (no append of the daemon writes one: a log from elsewhere, or damaged under checksums
/// that still check) has its delivery id left out of the index, where its range was
/// taken as written: past the log's end, or wrapped past `u64::MAX` (an overflow panic
/// in a debug build, and a retry appended again in a release one). The other keys are
/// restored, and a retry of the left-out one is appended anew.
#[tokio::test]
async fn a_delivery_id_whose_request_reaches_past_the_log_is_not_restored() {
    let now = ingest::time::now_unix_ms();
    let header = |key: &str, batch_len: u32| ingest::EnvelopeHeader {
        message_id: 1,
        received_at_unix_ms: now,
        source_key: "s".into(),
        endpoint_id: None,
        content_type: None,
        metadata: vec![],
        headers: vec![],
        idempotency_key: Some(key.into()),
        batch_index: 0,
        batch_len,
        destination: Destination { stream: "a".into(), topic: "b".into(), partitioning: Partitioning::Balanced },
    };
    for initial_offset in [0, wal::format::OFFSET_MAX - 2] {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("state.redb")).unwrap());
        let sim = SimStorage::new();
        let options = WalOptions { initial_offset, ..WalOptions::default() };
        let wal = Arc::new(Wal::open_with(Arc::new(sim.clone()), Path::new("/wal"), options).unwrap());
        let records = [header("whole", 1), header("past-the-end", 1000)]
            .iter()
            .map(|h| ingest::Envelope::encode(h, b"{}"))
            .collect::<Vec<_>>();
        for record in records {
            wal.append(vec![record]).await.unwrap();
        }
        let (ingestor, report) = start(&state, &wal, now);
        assert_eq!((report.keys_restored, report.batches_past_log_end), (1, 1), "from {initial_offset}: {report:?}");
        let whole = ingestor.accept(submission(Some("whole"), now)).await.unwrap();
        assert!(whole.replayed && whole.first_offset == initial_offset, "from {initial_offset}: {whole:?}");
        let retry = ingestor.accept(submission(Some("past-the-end"), now)).await.unwrap();
        assert!(!retry.replayed && retry.first_offset == initial_offset + 2, "from {initial_offset}: {retry:?}");
    }
}
