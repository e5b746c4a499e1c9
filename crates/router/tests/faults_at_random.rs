//! The router under faults that come and go at random, against a reference model: the
//! records appended to each destination, in log order. Whatever the destinations do
//! meanwhile (fail, never answer, answer slowly, the whole server gone), with queues
//! and the router's queue budget small enough that lanes overflow, shed and re-read
//! all the time, every record is delivered once, in order, once the faults end; the
//! budget never goes past its bound and is all given back; the log is released to its
//! end. Seeds are fixed and a failure names its seed, which fixes the faults, their
//! order and the waits between them; the interleaving with the router's tasks still
//! follows real time on a multi-threaded runtime, so a seed that failed once may need
//! several runs to fail again.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use ingest::envelope::Partitioning;
use router::{Policies, SendErrorKind};
use support::*;
use wal::storage::SimStorage;

/// xorshift64*: a few lines, no dependency, the same sequence for a seed everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const QUEUES_MAX_BYTES: usize = 48 * 1024;

fn policy() -> router::RouterPolicy {
    let mut p = router::RouterPolicy::default();
    p.batch.batch_max_records = 16;
    p.batch.linger = Duration::from_millis(1);
    // Far above the slow answers below, so a send the sink took is never timed out (and
    // sent again, which the exactly-once check below would count as a duplicate).
    p.batch.result_timeout = Duration::from_secs(2);
    p.batch.backoff_base = Duration::from_millis(10);
    p.batch.backoff_max = Duration::from_millis(100);
    p.batch.degraded_after_failures = 2;
    p.breaker.failure_threshold = 3;
    p.breaker.cool_down = Duration::from_millis(100);
    p.max_concurrent_destinations = 3;
    p.lane_queue_max_records = 64;
    p.lane_queue_max_bytes = 16 * 1024;
    p.overflow_after = Duration::from_millis(20);
    p
}

/// What a run went through: rounds with records queued, with a lane re-reading the log,
/// with a lane degraded.
#[derive(Debug, Default)]
struct Seen {
    queued: u32,
    reading_from_log: u32,
    degraded: u32,
}

/// Records balanced, or (`by_partition`) also with partition ids of the topic's three,
/// so that a batch holds several runs and one of them may fail while another was sent.
async fn run(seed: u64, by_partition: bool) -> Seen {
    let mut seen = Seen::default();
    let mut rng = Rng(seed);
    let sim = SimStorage::new();
    let wal = open_wal(&sim);
    let sink = FaultySink::new();
    let dests: Vec<_> = (0..5).map(|i| key("s", &format!("d{i}"))).collect();
    let mut policies = Policies::uniform(policy());
    policies.queues_max_bytes = QUEUES_MAX_BYTES;
    let router = start_router_with(&wal, &sink, policies);
    let mut want: BTreeMap<_, Vec<u128>> = BTreeMap::new();
    let mut next = 0u64;
    for round in 0..60 {
        for d in &dests {
            if rng.below(4) == 0 {
                let fault = match rng.below(if by_partition { 9 } else { 8 }) {
                    0..=3 => None,
                    4 => Some(Fault::Fail(SendErrorKind::Destination)),
                    5 => Some(Fault::FailSends(SendErrorKind::Destination)),
                    6 => Some(Fault::BlackHole),
                    7 => Some(Fault::Slow(Duration::from_millis(20))),
                    _ => Some(Fault::FailSendsToPartition(1, SendErrorKind::Unavailable)),
                };
                sink.fault(d, fault);
            }
        }
        if rng.below(10) == 0 {
            let whole = (rng.below(2) == 0).then_some(SendErrorKind::Disconnected);
            sink.client_fault(whole);
        }
        for _ in 0..=rng.below(3) {
            let n = 1 + rng.below(40);
            let batch: Vec<_> = (0..n)
                .map(|_| {
                    let d = &dests[rng.below(dests.len() as u64) as usize];
                    want.entry(d.clone()).or_default().push(u128::from(next) + 1);
                    next += 1;
                    let partitioning = match rng.below(if by_partition { 4 } else { 1 }) {
                        0 => Partitioning::Balanced,
                        p => Partitioning::PartitionId(p as u32 - 1),
                    };
                    record(d, next - 1, partitioning)
                })
                .collect();
            wal.append(batch).await.unwrap();
        }
        let (queued, max) = router.queued_bytes();
        assert!(queued <= max, "seed {seed}, round {round}: {queued} bytes queued of {max}");
        let lanes = router.destinations();
        seen.queued += u32::from(queued > 0);
        seen.reading_from_log += u32::from(lanes.iter().any(|l| l.overflowed));
        seen.degraded += u32::from(lanes.iter().any(|l| l.status == router::status::Status::Degraded));
        tokio::time::sleep(Duration::from_millis(rng.below(40))).await;
    }
    sink.client_fault(None);
    for d in &dests {
        sink.fault(d, None);
    }
    eventually(Duration::from_secs(90), &format!("seed {seed}: all delivered"), || {
        dests.iter().all(|d| sink.ids(d).len() >= want.get(d).map_or(0, Vec::len))
    })
    .await;
    for d in &dests {
        let empty = Vec::new();
        assert_eq!(sink.ids(d), *want.get(d).unwrap_or(&empty), "seed {seed}, {d}: lost, reordered or duplicated");
    }
    eventually(Duration::from_secs(10), &format!("seed {seed}: the budget given back"), || {
        router.queued_bytes().0 == 0
    })
    .await;
    eventually(Duration::from_secs(10), &format!("seed {seed}: the log released"), || {
        router.released_below() == wal.next_offset()
    })
    .await;
    router.shutdown().await;
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_delivered_once_in_order_whatever_faults_come_and_go() {
    for seed in [0x9e37_79b9_7f4a_7c15, 0xdead_beef_cafe_f00d, 0x1234_5678_9abc_def1, 0x0bad_5eed_0bad_5eed] {
        let seen = run(seed, false).await;
        eprintln!("seed {seed:#x}: {seen:?} of 60 rounds");
        // The faults must drive the paths under test, or the run proves nothing.
        assert!(seen.queued > 0 && seen.reading_from_log > 0 && seen.degraded > 0, "seed {seed:#x}: {seen:?}");
    }
}

/// The same with records of several partitions in a batch, and a fault that fails only
/// one partition's sends: batches parked halfway (their first runs acknowledged), read
/// back while the lane still queues, parked again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_several_partitions_are_delivered_once_in_order_whatever_faults_come_and_go() {
    for seed in [0x5151_e5ee_d000_0001, 0x2545_f491_4f6c_dd1d, 0x7777_0000_3333_1111] {
        let seen = run(seed, true).await;
        eprintln!("seed {seed:#x}: {seen:?} of 60 rounds");
        assert!(seen.queued > 0 && seen.reading_from_log > 0 && seen.degraded > 0, "seed {seed:#x}: {seen:?}");
    }
}
