//! Random operation sequences against a reference model, under a simulated disk that
//! loses power (cleanly or adversarially), fails chosen writes and syncs, and fills up.
//!
//! The model's rules, checked after every reopen and on every read:
//! - every append that resolved `Ok` is present with its payload at its offset, unless
//!   its offset was released;
//! - no record appears that was never appended, and an append refused with `Full`
//!   never appears;
//! - offsets are dense from the start to the end, never reordered or duplicated;
//! - an offset that was ever observed (resolved or read) never names another record.

mod common;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use common::*;
use proptest::prelude::*;
use wal::storage::{CrashMode, FaultOp, SimStorage};
use wal::{Wal, WalError, WalOptions};

#[derive(Debug, Clone)]
enum Op {
    Append(Vec<usize>),
    Concurrent(Vec<Vec<usize>>),
    Read(u8),
    Release(u8),
    Crash { seed: u64, adversarial: bool },
    CrashDuring { nth: u8, seed: u64 },
    Fail { sync: bool, nth: u8 },
    CloseReopen,
}

fn batch() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(prop_oneof![8usize..64, 64usize..700, Just(3000usize)], 1..5)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => batch().prop_map(Op::Append),
        3 => prop::collection::vec(batch(), 2..6).prop_map(Op::Concurrent),
        2 => any::<u8>().prop_map(Op::Read),
        2 => any::<u8>().prop_map(Op::Release),
        2 => (any::<u64>(), any::<bool>()).prop_map(|(seed, adversarial)| Op::Crash { seed, adversarial }),
        2 => (1u8..12, any::<u64>()).prop_map(|(nth, seed)| Op::CrashDuring { nth, seed }),
        1 => (any::<bool>(), 1u8..4).prop_map(|(sync, nth)| Op::Fail { sync, nth }),
        1 => Just(Op::CloseReopen),
    ]
}

struct Model {
    /// Offset → tag of every record whose append resolved Ok (or that a reader saw).
    acked: BTreeMap<u64, u64>,
    /// Tags appended without a resolved Ok: they may or may not exist.
    maybe: HashSet<u64>,
    /// Tags refused with Full: they must never exist.
    refused: HashSet<u64>,
    /// The highest offset a release asked to free, whether it resolved or not (a failed
    /// one may have freed some): no record at or above it may be missing, and a reopened
    /// log starts at or below it.
    release_floor: u64,
    next_tag: u64,
}

impl Model {
    fn check_record(&mut self, offset: u64, tag: u64) -> Result<(), TestCaseError> {
        prop_assert!(!self.refused.contains(&tag), "refused tag {tag} appeared at {offset}");
        match self.acked.get(&offset) {
            Some(&t) => prop_assert_eq!(t, tag, "offset {} changed its record", offset),
            None => {
                prop_assert!(self.maybe.remove(&tag), "invented record: tag {} at offset {}", tag, offset);
                self.acked.insert(offset, tag);
            }
        }
        Ok(())
    }

    /// After a reopen: the whole log against the model.
    fn check_log(&mut self, wal: &Wal) -> Result<(), TestCaseError> {
        let start = wal.start_offset();
        prop_assert!(
            start <= self.release_floor,
            "the log starts at {}, past every release (to {})",
            start,
            self.release_floor
        );
        let all = read_all(wal, start);
        prop_assert_eq!(all.len() as u64, wal.next_offset() - start, "log is not dense");
        for (i, r) in all.iter().enumerate() {
            prop_assert_eq!(r.offset, start + i as u64);
            self.check_record(r.offset, tag_of(&r.payload))?;
        }
        for (&o, &t) in self.acked.range(self.release_floor..) {
            let present = o < wal.next_offset() && all.get((o - start) as usize).map(|r| tag_of(&r.payload)) == Some(t);
            prop_assert!(present, "acknowledged record at offset {} (tag {}) lost", o, t);
        }
        for &o in self.acked.keys() {
            prop_assert!(o < wal.next_offset(), "offset {} will be reused", o);
        }
        // Whatever was in doubt and did not come back is gone for good.
        self.maybe.clear();
        Ok(())
    }

    fn tags(&mut self, n: usize) -> Vec<u64> {
        let t = (self.next_tag..self.next_tag + n as u64).collect();
        self.next_tag += n as u64;
        t
    }

    fn record_result(&mut self, tags: &[u64], r: Result<wal::Appended, WalError>) -> Result<(), TestCaseError> {
        match r {
            Ok(a) => {
                prop_assert_eq!(a.last_offset - a.first_offset + 1, tags.len() as u64);
                for (k, &t) in tags.iter().enumerate() {
                    let o = a.first_offset + k as u64;
                    prop_assert!(!self.acked.contains_key(&o), "offset {} handed out twice", o);
                    self.acked.insert(o, t);
                }
            }
            Err(WalError::Full { .. }) => self.refused.extend(tags.iter().copied()),
            Err(_) => self.maybe.extend(tags.iter().copied()),
        }
        Ok(())
    }
}

fn options() -> WalOptions {
    // Zeros written ahead a quarter of a segment at a time: files grow several times per
    // segment, as with the defaults (64 MiB segments, 1 MiB of zeros).
    WalOptions { segment_max_bytes: 4096, max_bytes: 48 * 1024, preallocate_bytes: 1024, ..WalOptions::default() }
}

fn reopen(sim: &SimStorage) -> Result<Arc<Wal>, TestCaseError> {
    sim.disarm();
    match try_open(sim, options()) {
        Ok(w) => Ok(Arc::new(w)),
        Err(e) => Err(TestCaseError::fail(format!("reopen failed: {e}"))),
    }
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let sim = SimStorage::new();
    let rt = rt();
    let mut wal = reopen(&sim)?;
    let mut m =
        Model { acked: BTreeMap::new(), maybe: HashSet::new(), refused: HashSet::new(), release_floor: 0, next_tag: 0 };
    for op in ops {
        match op {
            Op::Append(sizes) => {
                let tags = m.tags(sizes.len());
                let records = tags.iter().zip(&sizes).map(|(&t, &n)| payload(t, n)).collect();
                let r = rt.block_on(wal.append(records));
                m.record_result(&tags, r)?;
            }
            Op::Concurrent(batches) => {
                let results = rt.block_on(async {
                    let mut set = tokio::task::JoinSet::new();
                    for sizes in batches {
                        let tags = m.tags(sizes.len());
                        let records = tags.iter().zip(&sizes).map(|(&t, &n)| payload(t, n)).collect();
                        let wal = wal.clone();
                        set.spawn(async move { (tags, wal.append(records).await) });
                    }
                    set.join_all().await
                });
                for (tags, r) in results {
                    m.record_result(&tags, r)?;
                }
            }
            Op::Read(frac) => {
                let (start, end) = (wal.start_offset(), wal.next_offset());
                let from = start + (end - start) * u64::from(frac) / 255;
                let mut reader = match wal.reader(from) {
                    Ok(r) => r,
                    Err(e) => return Err(TestCaseError::fail(format!("reader at {from}: {e}"))),
                };
                let mut expect = from;
                loop {
                    let batch = reader.try_read(17, 5000).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    if batch.is_empty() {
                        break;
                    }
                    for r in batch {
                        prop_assert_eq!(r.offset, expect);
                        expect += 1;
                        m.check_record(r.offset, tag_of(&r.payload))?;
                    }
                }
            }
            Op::Release(frac) => {
                let (start, end) = (wal.start_offset(), wal.next_offset());
                let below = start + (end - start) * u64::from(frac) / 255;
                m.release_floor = m.release_floor.max(below);
                let _ = rt.block_on(wal.release_below(below));
            }
            Op::Crash { seed, adversarial } => {
                sim.crash(if adversarial { CrashMode::Adversarial { seed } } else { CrashMode::LoseUnsynced });
                drop(wal);
                wal = reopen(&sim)?;
                m.check_log(&wal)?;
            }
            Op::CrashDuring { nth, seed } => {
                sim.crash_at_nth(FaultOp::AnyMutation, u64::from(nth), CrashMode::Adversarial { seed });
                let crashes = sim.crashes();
                for _ in 0..12 {
                    let tags = m.tags(2);
                    let records = tags.iter().map(|&t| payload(t, 300)).collect();
                    let r = rt.block_on(wal.append(records));
                    m.record_result(&tags, r)?;
                    if sim.crashes() > crashes {
                        break;
                    }
                }
                if sim.crashes() == crashes {
                    sim.crash(CrashMode::Adversarial { seed });
                }
                drop(wal);
                wal = reopen(&sim)?;
                m.check_log(&wal)?;
            }
            Op::Fail { sync, nth } => {
                let what = if sync { FaultOp::Sync } else { FaultOp::Write };
                sim.fail_nth(what, u64::from(nth), std::io::ErrorKind::Other);
            }
            Op::CloseReopen => {
                let closed = rt.block_on(wal.close());
                drop(wal);
                wal = reopen(&sim)?;
                if closed.is_ok() {
                    prop_assert!(wal.open_report().clean_shutdown, "clean close not recognised");
                }
                m.check_log(&wal)?;
            }
        }
    }
    sim.crash(CrashMode::Adversarial { seed: 7 });
    drop(wal);
    let wal = reopen(&sim)?;
    m.check_log(&wal)
}

proptest! {
    // 384 cases by default; `PROPTEST_CASES=N` runs a deeper search.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(384),
        max_shrink_iters: 4096,
        ..ProptestConfig::default()
    })]

    #[test]
    fn the_log_matches_the_model_through_crashes_and_faults(ops in prop::collection::vec(op(), 1..48)) {
        run(ops)?;
    }
}
