//! A power loss at every write, sync and metadata change the router's delivery causes:
//! the log and the state database that keeps the cursors on one simulated disk
//! (`SimStorage`, the database through `StateDb::open_on`), the router draining the log
//! into an in-memory destination in small batches, so that cursors are stored and
//! segments released many times, each interleaved with the other. The power is cut just
//! before the disk's nth mutation, for every n the drain reaches, losing what was
//! unsynced or an adversarial mix of it (`CrashMode::Reordered`: an unlink can reach the
//! disk while an earlier unsynced write does not). The destination is not on that disk
//! and keeps what it acknowledged, as an Iggy server does; from the cut on it takes
//! nothing more (`UntilThePowerGoes`): the process is gone, and only what it delivered
//! before counts.
//!
//! The log and the database are then opened on what the disk kept, as a restart does,
//! and a new router drains them into the same destination. What must hold: every record
//! reaches its destination, in log order once repeats are set aside. A release that
//! reached the disk before the cursor store it relied on, or a cursor stored past what
//! was acknowledged, loses records here.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use ingest::envelope::Partitioning;
use router::{
    DestinationKey, OutMessage, Policies, Router, SendError, SendErrorKind, Sink, StateCursorStore, TopicInfo,
};
use support::{FaultySink, Prepared, fast_policy, fill, key};
use wal::storage::{CrashMode, FaultOp, SimStorage, Storage};
use wal::{Wal, WalOptions};

/// Records in the log before the router starts: several segments' worth.
const RECORDS: u64 = 240;

fn open(sim: &SimStorage) -> (Arc<Wal>, Arc<StateCursorStore>) {
    let storage: Arc<dyn Storage> = Arc::new(sim.clone());
    wal::storage::create_dir_all_durably(sim, Path::new("/data")).expect("the data directory");
    let options = WalOptions { segment_max_bytes: 2 * 1024, max_bytes: 64 << 20, ..WalOptions::default() };
    let wal = Arc::new(Wal::open_with(storage.clone(), Path::new("/data/wal"), options).expect("the log opens"));
    let state = Arc::new(ingest::StateDb::open_on(storage, "/data/state.redb").expect("the database opens"));
    (wal, Arc::new(StateCursorStore::new(state)))
}

/// Small batches: a cursor store, and a release, every few records.
fn policies() -> Policies {
    let mut policy = fast_policy();
    policy.batch.batch_max_records = 8;
    Policies::uniform(policy)
}

/// A test double of the destination as the daemon sees it while its machine has power:
/// `FaultySink` until the simulated disk lost its power, and from then on a server that
/// cannot be reached. A send that began before the cut is answered as it would have
/// been (the server may have stored it).
struct UntilThePowerGoes {
    sink: Arc<FaultySink>,
    disk: SimStorage,
}

impl UntilThePowerGoes {
    fn check(&self) -> Result<(), SendError> {
        match self.disk.crashes() {
            0 => Ok(()),
            _ => Err(SendError::new(SendErrorKind::Unavailable, "the power went")),
        }
    }
}

impl Sink for UntilThePowerGoes {
    type Message = Prepared;

    fn prepare(&self, messages: &[OutMessage<'_>]) -> Result<Vec<Prepared>, SendError> {
        self.sink.prepare(messages)
    }

    async fn ensure(&self, dest: &DestinationKey) -> Result<TopicInfo, SendError> {
        self.check()?;
        self.sink.ensure(dest).await
    }

    async fn send(&self, dest: &DestinationKey, p: &Partitioning, messages: &mut [Prepared]) -> Result<(), SendError> {
        self.check()?;
        self.sink.send(dest, p, messages).await
    }
}

/// Waits up to `limit` for `cond`; whether it held.
async fn wait_for(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = tokio::time::Instant::now();
    while !cond() {
        if start.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_record_is_lost_to_a_power_loss_at_any_write_of_its_delivery() {
    let dests = [key("s", "a"), key("s", "b"), key("t", "c")];
    let mut cuts = 0u64;
    let mut releases_seen = 0u64;
    // How many mutations a whole drain makes, from a run the power stays on through.
    // Timing moves it by a few (how acknowledgements group into cursor stores), so the
    // sweep goes past it rather than stop at the first run that ended before its cut.
    let mut mutations = 0u64;
    let mut n = 0u64;
    while n <= mutations + 8 {
        for mode in [CrashMode::LoseUnsynced, CrashMode::Reordered { seed: n }] {
            let sim = SimStorage::new();
            let (wal, cursors) = open(&sim);
            let want = fill(&wal, &dests, 0, RECORDS).await;
            let segments_at_start = wal.segment_paths().len();
            let mutations_before = sim.ops();
            if n > 0 {
                sim.crash_at_nth(FaultOp::AnyMutation, n, mode);
            }
            let sink = FaultySink::new();
            let destination = Arc::new(UntilThePowerGoes { sink: sink.clone(), disk: sim.clone() });
            let router = Router::start(wal.clone(), destination, cursors, policies()).expect("the router starts");
            // Until the power goes, or the drain is over: everything delivered, and the
            // log released to its last segment.
            let drained = wait_for(Duration::from_secs(20), || {
                sim.crashes() > 0
                    || (dests.iter().all(|d| sink.ids(d).len() == want[d].len())
                        && router.released_below() == RECORDS
                        && wal.segment_paths().len() == 1)
            })
            .await;
            assert!(drained, "cut before mutation {n} ({mode:?}): the drain neither ended nor lost its power");
            let stopped = tokio::time::timeout(Duration::from_secs(20), router.shutdown()).await;
            assert!(stopped.is_ok(), "cut before mutation {n} ({mode:?}): the router did not stop");
            if sim.crashes() == 0 {
                releases_seen = releases_seen.max((segments_at_start - wal.segment_paths().len()) as u64);
                mutations = mutations.max(sim.ops() - mutations_before);
                continue;
            }
            cuts += 1;
            drop(router);
            drop(wal);
            sim.disarm();
            let case = format!("cut before mutation {n} ({mode:?})");

            // The restart, on what the disk kept; the destination kept what it took.
            let disk = sim.fork();
            let (wal, cursors) = open(&disk);
            let router = Router::start(wal.clone(), sink.clone(), cursors, policies())
                .unwrap_or_else(|e| panic!("{case}: the router does not start after the loss: {e}"));
            let complete = wait_for(Duration::from_secs(20), || {
                dests.iter().all(|d| first_occurrences(&sink.ids(d)).len() >= want[d].len())
            })
            .await;
            for d in &dests {
                assert_eq!(
                    first_occurrences(&sink.ids(d)),
                    want[d],
                    "{case}: records of {d} lost or reordered (log start after the loss: {})",
                    wal.start_offset()
                );
            }
            assert!(complete, "{case}: the drain after the loss did not end");
            let stopped = tokio::time::timeout(Duration::from_secs(20), router.shutdown()).await;
            assert!(stopped.is_ok(), "{case}: the router did not stop after the loss");
        }
        // The first round (n = 0) has no cut: it measures the drain.
        if n == 0 {
            assert!(mutations > 0, "the drain made no mutation");
        }
        n += 1;
        assert!(n < 20_000, "the drain never ran to its end");
    }
    assert!(releases_seen >= 3, "the drain released {releases_seen} segments: too few to test");
    // The sweep reached past the longest run by construction; that the cuts landed
    // (at least one a point on average) is checked here.
    assert!(cuts >= mutations, "{cuts} cuts for a drain of {mutations} mutations");
    eprintln!(
        "power cut before each of the drain's {mutations} mutations in turn, in two ways ({cuts} cuts), each checked"
    );
}

/// `ids` with every repeat of an earlier id left out.
fn first_occurrences(ids: &[u128]) -> Vec<u128> {
    let mut seen = std::collections::HashSet::new();
    ids.iter().copied().filter(|id| seen.insert(*id)).collect()
}
