//! Storage faults and power loss at every single operation of a scenario.
//!
//! The scenario appends, rotates and releases. For every `n`, a run fails (or loses
//! power at) the `n`th storage operation. Afterwards the log must reopen, hold every
//! append that resolved, and hold nothing that was never appended.

mod common;

use std::collections::BTreeMap;
use std::io::ErrorKind;

use common::*;
use wal::storage::{CrashMode, FaultOp, SimStorage};
use wal::{Wal, WalOptions};

fn options() -> WalOptions {
    // Zeros written ahead a quarter of a segment at a time: a segment's file grows several
    // times, as one of the default 64 MiB with 1 MiB of zeros does (with the default
    // zeros, the first write of each small segment would fill it).
    WalOptions { segment_max_bytes: 2048, max_bytes: 1 << 20, preallocate_bytes: 512, ..WalOptions::default() }
}

/// The sweeps below cross the writes that grow a segment's file (records and new zeros
/// past its end), not only writes over zeros written ahead: in the scenario, segment
/// files grow by steps, each ending short of the segment's size at first.
#[test]
fn the_scenario_grows_segment_files_in_steps() {
    let sim = SimStorage::new();
    let wal = open(&sim, options());
    let mut lengths = std::collections::BTreeSet::new();
    rt().block_on(async {
        for i in 0..12u64 {
            wal.append(vec![payload(i, 150)]).await.unwrap();
            for name in segment_files(&sim, &dir()) {
                lengths.insert((name.clone(), sim.read_file(&dir().join(&name)).unwrap().len()));
            }
        }
    });
    let first = segment_files(&sim, &dir()).into_iter().next().unwrap();
    let grown: Vec<usize> = lengths.iter().filter(|(n, _)| *n == first).map(|(_, l)| *l).collect();
    assert!(grown.len() >= 3, "the first segment's file grew {} times: {grown:?}", grown.len());
    assert!(grown[0] < 2048, "its first write filled it: {grown:?}");
}

/// Runs the scenario; returns offset → tag of every append that resolved Ok, and the
/// highest offset a release asked to free (whether it resolved or not).
fn scenario(wal: &Wal) -> (BTreeMap<u64, u64>, u64) {
    let mut acked = BTreeMap::new();
    let floor = std::cell::Cell::new(0);
    rt().block_on(async {
        for i in 0..24u64 {
            let tags = [i * 2, i * 2 + 1];
            let records = tags.iter().map(|&t| payload(t, 150 + (i as usize * 37) % 300)).collect();
            if let Ok(a) = wal.append(records).await {
                acked.insert(a.first_offset, tags[0]);
                acked.insert(a.last_offset, tags[1]);
            }
            if i % 8 == 7 {
                let _ = wal.release_below(a_third(wal, &floor)).await;
            }
        }
    });
    (acked, floor.get())
}

/// A third of the way into the log, noted in `floor` (the highest offset asked to be
/// released): a check after a reopen knows no record at or above it may be missing.
fn a_third(wal: &Wal, floor: &std::cell::Cell<u64>) -> u64 {
    let below = wal.start_offset() + (wal.next_offset() - wal.start_offset()) / 3;
    floor.set(floor.get().max(below));
    below
}

/// Counts the mutating storage operations the scenario performs without faults.
fn operations_in_scenario() -> u64 {
    let sim = SimStorage::new();
    let wal = open(&sim, options());
    let before = sim.ops();
    scenario(&wal);
    sim.ops() - before
}

fn check(sim: &SimStorage, (acked, release_floor): &(BTreeMap<u64, u64>, u64), context: &str) {
    check_tags_below(sim, acked, *release_floor, 48, context);
}

/// [`check`] for a scenario whose tags are below `tags_below`, and whose releases asked
/// to free no record at or above `release_floor`: the reopened log starts at or below it
/// (a log that lost its front would otherwise start later and look whole), and holds
/// every acknowledged record from it on.
fn check_tags_below(sim: &SimStorage, acked: &BTreeMap<u64, u64>, release_floor: u64, tags_below: u64, context: &str) {
    sim.disarm();
    let wal = try_open(sim, options()).unwrap_or_else(|e| panic!("{context}: reopen failed: {e}"));
    let start = wal.start_offset();
    assert!(start <= release_floor, "{context}: the log starts at {start}, past every release (to {release_floor})");
    let all = read_all(&wal, start);
    for (i, r) in all.iter().enumerate() {
        assert_eq!(r.offset, start + i as u64, "{context}: not dense");
        let tag = tag_of(&r.payload);
        assert!(tag < tags_below, "{context}: invented record {tag}");
        if let Some(&t) = acked.get(&r.offset) {
            assert_eq!(t, tag, "{context}: offset {} changed", r.offset);
        }
    }
    for (&o, &t) in acked.range(release_floor..) {
        let got = all.get((o - start) as usize).map(|r| tag_of(&r.payload));
        assert_eq!(got, Some(t), "{context}: acknowledged offset {o} lost");
    }
}

#[test]
fn power_loss_at_every_operation_keeps_every_resolved_append() {
    let total = operations_in_scenario();
    assert!(total > 60, "scenario too small to mean anything: {total} operations");
    for n in 1..=total + 1 {
        for mode in [CrashMode::LoseUnsynced, CrashMode::Adversarial { seed: n }] {
            let sim = SimStorage::new();
            let wal = open(&sim, options());
            sim.crash_at_nth(FaultOp::AnyMutation, n, mode);
            let acked = scenario(&wal);
            if sim.crashes() == 0 {
                sim.crash(mode);
            }
            drop(wal);
            check(&sim, &acked, &format!("power loss at operation {n} ({mode:?})"));
        }
    }
}

/// The scenario with appends in flight together. Each round sends four appends and, every
/// third round, a release at once, so the writer takes them as one group: appends
/// answered in the middle of a group before a rotation, a release that forces a flush
/// between appends of one group. It ends with a close (the final sync, the cut of the
/// zeros written ahead, the clean-shutdown marker). Returns offset → tag of every append
/// that resolved Ok, and whether the close did.
fn concurrent_scenario(wal: &Wal) -> (BTreeMap<u64, u64>, bool, u64) {
    let mut acked = BTreeMap::new();
    let floor = std::cell::Cell::new(0);
    let closed = rt().block_on(async {
        for round in 0..8u64 {
            let append = |k: u64| {
                let tag = round * 8 + k * 2;
                let records = vec![payload(tag, 120 + ((round * 4 + k) as usize * 53) % 400), payload(tag + 1, 90)];
                async move { (tag, wal.append(records).await) }
            };
            let release = async {
                if round % 3 == 2 {
                    let _ = wal.release_below(a_third(wal, &floor)).await;
                }
            };
            let (a, b, (), c, d) = tokio::join!(append(0), append(1), release, append(2), append(3));
            for (tag, appended) in [a, b, c, d] {
                if let Ok(x) = appended {
                    acked.insert(x.first_offset, tag);
                    acked.insert(x.last_offset, tag + 1);
                }
            }
        }
        wal.close().await.is_ok()
    });
    (acked, closed, floor.get())
}

/// Every append of [`concurrent_scenario`] is a batch of two records, tags `2k` and
/// `2k + 1`: in the reopened log each batch is whole or absent, answered or not (the
/// door's NDJSON requests are such batches, and a sender told nothing must not find half
/// of its request delivered).
fn check_batches_whole(sim: &SimStorage, context: &str) {
    let wal = try_open(sim, options()).unwrap_or_else(|e| panic!("{context}: reopen failed: {e}"));
    let tags: Vec<u64> = read_all(&wal, wal.start_offset()).iter().map(|r| tag_of(&r.payload)).collect();
    assert!(tags.len().is_multiple_of(2), "{context}: an odd number of records, {tags:?}");
    for pair in tags.chunks(2) {
        assert!(
            pair[0].is_multiple_of(2) && pair[1] == pair[0] + 1,
            "{context}: a batch not whole: {pair:?} in {tags:?}"
        );
    }
}

/// The synced length every record frame of the log carries, in file order.
fn frame_synced_lengths(sim: &SimStorage) -> Vec<(String, u64)> {
    use wal::format::{FrameHeader, SEGMENT_HEADER_LEN};
    let mut out = Vec::new();
    for name in segment_files(sim, &dir()) {
        let b = sim.read_file(&dir().join(&name)).unwrap();
        let mut pos = SEGMENT_HEADER_LEN as usize;
        while let Some(h) = b.get(pos..).and_then(|rest| FrameHeader::decode(rest).ok()) {
            if !h.is_seal() {
                out.push((name.clone(), h.synced_len));
            }
            pos += h.frame_len() as usize;
        }
    }
    out
}

/// A power loss at every storage operation of the concurrent scenario, under `always`:
/// every append that resolved Ok is in the reopened log, whatever was in flight beside
/// it, and nothing that was never appended is.
#[test]
fn power_loss_at_every_operation_with_appends_in_flight_keeps_every_resolved_append() {
    let sim = SimStorage::new();
    let wal = open(&sim, options());
    let before = sim.ops();
    let (acked, closed, _) = concurrent_scenario(&wal);
    let total = sim.ops() - before;
    assert!(closed && acked.len() == 64, "the scenario without faults: closed {closed}, {} acked", acked.len());
    drop(wal);
    // The appends of a round were written together: records of one group share the
    // synced length their frames carry.
    let frames = frame_synced_lengths(&sim);
    let appends = frames.len() / 2;
    let groups = frames.into_iter().collect::<std::collections::BTreeSet<_>>().len();
    assert!(groups < appends, "each of the {appends} appends left in the log was a group of its own");
    for n in 1..=total + 1 {
        for mode in [CrashMode::LoseUnsynced, CrashMode::Adversarial { seed: n }] {
            let sim = SimStorage::new();
            let wal = open(&sim, options());
            sim.crash_at_nth(FaultOp::AnyMutation, n, mode);
            let (acked, _, floor) = concurrent_scenario(&wal);
            if sim.crashes() == 0 {
                sim.crash(mode);
            }
            drop(wal);
            let context = format!("power loss at operation {n} of {total} ({mode:?})");
            check_tags_below(&sim, &acked, floor, 64, &context);
            check_batches_whole(&sim, &context);
        }
    }
}

/// The same under `interval`, where an append is answered before its sync: what a close
/// that succeeded covered survives a power loss after it; a power loss at any operation
/// before leaves a log that reopens, dense, with nothing invented.
#[test]
fn under_interval_power_loss_at_every_operation_keeps_what_a_clean_close_covered() {
    let interval = || WalOptions { sync: wal::SyncPolicy::Interval(std::time::Duration::from_secs(60)), ..options() };
    let sim = SimStorage::new();
    let wal = open(&sim, interval());
    let before = sim.ops();
    let (_, closed, _) = concurrent_scenario(&wal);
    let total = sim.ops() - before;
    assert!(closed);
    drop(wal);
    for n in 1..=total + 1 {
        for mode in [CrashMode::LoseUnsynced, CrashMode::Adversarial { seed: n }] {
            let sim = SimStorage::new();
            let wal = open(&sim, interval());
            sim.crash_at_nth(FaultOp::AnyMutation, n, mode);
            let (acked, closed, floor) = concurrent_scenario(&wal);
            let crashed = sim.crashes() > 0;
            if !crashed {
                sim.crash(mode);
            }
            drop(wal);
            let promised = if closed && !crashed { acked } else { BTreeMap::new() };
            let context = format!("interval, power loss at operation {n} of {total} ({mode:?})");
            check_tags_below(&sim, &promised, floor, 64, &context);
            check_batches_whole(&sim, &context);
        }
    }
    // How many operations a run takes depends on how the appends of a round happen to
    // group: the sweep above may never pass the last one. A run without a power loss
    // inside it, then one right after its clean close, always keeps every append.
    let sim = SimStorage::new();
    let wal = open(&sim, interval());
    let (acked, closed, floor) = concurrent_scenario(&wal);
    assert!(closed && acked.len() == 64, "the scenario without faults: closed {closed}, {} acked", acked.len());
    sim.crash(CrashMode::Adversarial { seed: 7 });
    drop(wal);
    check_tags_below(&sim, &acked, floor, 64, "interval, power loss after a clean close");
}

#[test]
fn an_error_at_every_operation_leaves_a_consistent_reopenable_log() {
    let total = operations_in_scenario();
    for n in 1..=total + 1 {
        for kind in [ErrorKind::Other, ErrorKind::StorageFull] {
            let sim = SimStorage::new();
            let wal = open(&sim, options());
            sim.fail_nth(FaultOp::AnyMutation, n, kind);
            let acked = scenario(&wal);
            // Without a power loss, a clean reopen sees everything resolved...
            drop(wal);
            check(&sim, &acked, &format!("{kind:?} at operation {n}"));
            // ...and so does one after a power loss.
            sim.crash(CrashMode::Adversarial { seed: n });
            check(&sim, &acked, &format!("{kind:?} at operation {n}, then power loss"));
        }
    }
}

/// A lookup that fails (a directory listing, the open of a file that exists, a file's
/// length) at any point while the log runs (rotations, releases, reads): every append
/// answered Ok is in the log a clean reopen finds, and in the one a power loss leaves.
#[test]
fn a_failed_lookup_at_any_point_while_running_loses_no_answered_append() {
    let mut fired = 0;
    for n in 1.. {
        let sim = SimStorage::new();
        let wal = open(&sim, options());
        sim.fail_nth(FaultOp::Lookup, n, ErrorKind::Other);
        let acked = scenario(&wal);
        drop(wal);
        if sim.armed_faults() > 0 {
            break;
        }
        fired += 1;
        check(&sim, &acked, &format!("lookup {n} failed"));
        sim.crash(CrashMode::Adversarial { seed: n });
        check(&sim, &acked, &format!("lookup {n} failed, then power loss"));
    }
    assert!(fired > 5, "too few lookups in the scenario to mean anything: {fired}");
}

/// Under `interval` an append is answered once written; only a failed sync (which may
/// have dropped pages) or a power loss may take it back. A failed write at any point,
/// for any reason, loses none of them: the log reopens with every one.
#[test]
fn under_interval_a_failed_write_at_any_point_loses_no_answered_append() {
    let interval = || WalOptions { sync: wal::SyncPolicy::Interval(std::time::Duration::from_secs(60)), ..options() };
    let total = operations_in_scenario();
    let mut fired = 0;
    for n in 1..=total {
        for kind in [ErrorKind::Other, ErrorKind::StorageFull] {
            let sim = SimStorage::new();
            let wal = open(&sim, interval());
            sim.fail_nth(FaultOp::Write, n, kind);
            let acked = scenario(&wal);
            fired += usize::from(sim.armed_faults() == 0);
            drop(wal);
            check(&sim, &acked, &format!("interval, {kind:?} at write {n}"));
        }
    }
    assert!(fired > 20, "too few writes failed to mean anything: {fired}");
}

#[test]
fn what_a_restart_appends_after_any_fault_survives_a_power_loss() {
    // A fault can leave things undurable that a restarted process then builds on (a
    // segment whose directory sync failed, say): the reopen must make them durable.
    let total = operations_in_scenario();
    for n in 1..=total + 1 {
        let sim = SimStorage::new();
        let wal = open(&sim, options());
        sim.fail_nth(FaultOp::AnyMutation, n, ErrorKind::Other);
        // The process stops at the first failed append, before anything heals the fault.
        let mut acked = BTreeMap::new();
        rt().block_on(async {
            for i in 0..24u64 {
                match wal.append(vec![payload(i, 150 + (i as usize * 37) % 300)]).await {
                    Ok(a) => {
                        acked.insert(a.first_offset, i);
                    }
                    Err(_) => break,
                }
            }
        });
        drop(wal);
        sim.disarm();
        let wal = open(&sim, options());
        rt().block_on(async {
            for t in 100..104u64 {
                let a = wal.append(vec![payload(t % 48, 60)]).await.expect("append after the restart");
                acked.insert(a.first_offset, t % 48);
            }
        });
        drop(wal);
        sim.crash(CrashMode::LoseUnsynced);
        // Nothing was released: the log must start at 0.
        check(&sim, &(acked, 0), &format!("error at operation {n}, restart, appends, power loss"));
    }
}

#[test]
fn after_a_failed_write_the_log_keeps_accepting() {
    let sim = SimStorage::new();
    let wal = open(&sim, options());
    rt().block_on(async {
        wal.append(vec![payload(0, 100)]).await.unwrap();
        sim.fail_nth(FaultOp::Write, 1, ErrorKind::Other);
        assert!(wal.append(vec![payload(1, 100)]).await.is_err());
        for t in 2..10 {
            wal.append(vec![payload(t, 100)]).await.expect("the log recovered from the failed write");
        }
    });
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![0, 2, 3, 4, 5, 6, 7, 8, 9]);
}

/// A failed write whose cut back fails too: its bytes may be in the page cache whole.
/// Here the write grows the file, so its buffer is the frame plus the zeros written
/// ahead, and the half the simulated disk writes before failing holds the whole frame.
/// The writer overwrites them with zeros instead of cutting: the append answered
/// "failed" is not found by the next open (a sender that retries would otherwise have
/// two copies), nor after a power loss, and the log goes on.
#[test]
fn a_failed_write_whose_cut_fails_is_overwritten_with_zeros_and_does_not_come_back() {
    let opts = WalOptions { segment_max_bytes: 1 << 20, max_bytes: 4 << 20, ..WalOptions::default() };
    for seed in 0..8 {
        let sim = SimStorage::new();
        let wal = open(&sim, opts.clone());
        rt().block_on(async {
            sim.fail_nth(FaultOp::Write, 1, ErrorKind::Other);
            sim.fail_nth(FaultOp::Metadata, 1, ErrorKind::Other);
            assert!(wal.append(vec![payload(1, 100)]).await.is_err());
        });
        assert_eq!(sim.armed_faults(), 0, "the write or the cut did not fail");
        drop(wal);
        let wal = open(&sim, opts.clone());
        let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
        assert_eq!(tags, Vec::<u64>::new(), "seed {seed}: the append answered failed came back after a reopen");
        drop(wal);
        sim.crash(CrashMode::Adversarial { seed });
        let wal = open(&sim, opts.clone());
        assert_eq!(wal.next_offset(), 0, "seed {seed}: the append answered failed came back after a power loss");
    }
}

/// After such a zeroing the log is a tail followed by zeros, as with the zeros written
/// ahead: it keeps accepting, the failed append's offset (never answered) goes to the
/// next one, and a clean close cuts the zeros.
#[test]
fn after_a_failed_write_whose_cut_failed_the_log_keeps_accepting() {
    let sim = SimStorage::new();
    let wal = open(&sim, options());
    rt().block_on(async {
        wal.append(vec![payload(0, 100)]).await.unwrap_or_else(|e| panic!("{e}"));
        sim.fail_nth(FaultOp::Write, 1, ErrorKind::Other);
        sim.fail_nth(FaultOp::Metadata, 1, ErrorKind::Other);
        assert!(wal.append(vec![payload(1, 100)]).await.is_err());
        assert!(wal.accepts_appends(), "the zeros undid the write: the log is consistent");
        let a = wal.append(vec![payload(2, 100)]).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.first_offset, 1);
        wal.close().await.unwrap_or_else(|e| panic!("{e}"));
    });
    drop(wal);
    let wal = open(&sim, options());
    assert!(wal.open_report().clean_shutdown);
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![0, 2]);
}

#[test]
fn when_the_write_the_cut_and_the_zeroing_all_fail_the_log_refuses_appends_until_reopened() {
    let sim = SimStorage::new();
    let wal = open(&sim, options());
    rt().block_on(async {
        wal.append(vec![payload(0, 100)]).await.unwrap();
        assert!(wal.accepts_appends());
        // The write fails, then the truncation meant to undo it, then the zeros meant to
        // undo it instead.
        sim.fail_nth(FaultOp::Write, 1, ErrorKind::Other);
        sim.fail_nth(FaultOp::Metadata, 1, ErrorKind::Other);
        sim.fail_nth(FaultOp::Write, 2, ErrorKind::Other);
        assert!(wal.append(vec![payload(1, 100)]).await.is_err());
        assert_eq!(sim.armed_faults(), 0);
        // Known before another append is tried.
        assert!(!wal.accepts_appends(), "a poisoned log says it accepts appends");
        let e = wal.append(vec![payload(2, 100)]).await.unwrap_err();
        assert!(matches!(e, wal::WalError::Poisoned(_)), "{e}");
    });
    drop(wal);
    let wal = open(&sim, options());
    assert!(wal.accepts_appends());
    rt().block_on(wal.append(vec![payload(3, 100)])).expect("reopened log accepts");
    // The failed write (half of its frame: this one did not grow the file) is a torn
    // tail. Had it left its frame whole, the record would be back: the one case where an
    // append answered "failed" can come back.
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![0, 3]);
}

#[test]
fn an_append_answered_failed_does_not_come_back_after_a_power_loss() {
    // The sync fails after the bytes were written. The writer cuts the segment back and
    // syncs the cut (before it answers, `Writer::fail`): a power loss right after the
    // answer, keeping any unsynced write it likes, must not bring the failed record back,
    // or a sender that retries would end up with two copies. (That the cut comes before
    // the answer is not observable here: the simulated process outlives its power loss.)
    for seed in 0..64 {
        let sim = SimStorage::new();
        let wal = open(&sim, options());
        rt().block_on(async {
            wal.append(vec![payload(0, 100)]).await.unwrap();
            sim.fail_nth(FaultOp::Sync, 1, ErrorKind::Other);
            assert!(wal.append(vec![payload(1, 100)]).await.is_err());
            sim.crash(CrashMode::Adversarial { seed });
        });
        drop(wal);
        sim.disarm();
        let wal = open(&sim, options());
        let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
        assert_eq!(tags, vec![0], "seed {seed}: the failed append came back after a power loss");
    }
}

#[test]
fn a_release_whose_directory_sync_failed_is_made_durable_before_the_next_removal() {
    // Release removes segment A, its directory sync fails; a later release removes B and
    // loses power at the directory sync after it. A power loss that keeps B's removal
    // but undoes A's would leave A sealed before a missing B: a hole in the middle. The
    // later release must first make A's removal durable. Directory changes persist in
    // any order here (per name), so many seeds.
    for seed in 0..64 {
        let sim = SimStorage::new();
        let wal = open(&sim, options());
        rt().block_on(async {
            for t in 0..40 {
                wal.append(vec![payload(t, 300)]).await.unwrap();
            }
        });
        let bases: Vec<u64> = segment_files(&sim, &dir()).iter().map(|n| n[..20].parse().unwrap()).collect();
        assert!(bases.len() >= 4, "{bases:?}");
        rt().block_on(async {
            sim.fail_nth(FaultOp::SyncDir, 1, ErrorKind::Other);
            assert!(wal.release_below(bases[1]).await.is_err(), "the first removal's directory sync fails");
            // Power is lost at the next directory sync (the one after removing B, without
            // the rule; the one that comes first, with it).
            sim.crash_at_nth(FaultOp::SyncDir, 1, CrashMode::Adversarial { seed });
            assert!(wal.release_below(bases[2]).await.is_err());
        });
        assert_eq!(sim.crashes(), 1);
        drop(wal);
        sim.disarm();
        let wal = try_open(&sim, options()).unwrap_or_else(|e| panic!("seed {seed}: reopen failed: {e}"));
        let start = wal.start_offset();
        let all = read_all(&wal, start);
        assert_eq!(all.len() as u64, 40 - start, "seed {seed}: not dense from {start}");
    }
}

/// Under `interval` an append is answered once written, before its sync. A later group
/// whose write fails (here: the disk is full) must cut back only its own bytes: the
/// appends answered before it stay, and their offsets are not handed out again.
#[test]
fn under_interval_a_failed_write_keeps_the_appends_answered_before_it() {
    let sim = SimStorage::new();
    let opts = WalOptions {
        sync: wal::SyncPolicy::Interval(std::time::Duration::from_secs(30)),
        preallocate_bytes: 0,
        ..small_options()
    };
    let wal = open(&sim, opts.clone());
    rt().block_on(async {
        let a = wal.append(vec![payload(1, 100)]).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(a.first_offset, 0);
        sim.set_space_limit(Some(sim.used_bytes() + 50));
        assert!(wal.append(vec![payload(2, 100)]).await.is_err(), "a write past the space limit succeeded");
        sim.set_space_limit(None);
        let c = wal.append(vec![payload(3, 100)]).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.first_offset, 1, "the answered append's offset was handed out again");
        wal.close().await.unwrap_or_else(|e| panic!("{e}"));
    });
    drop(wal);
    let wal = open(&sim, opts);
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![1, 3], "an append answered Ok was dropped without any crash");
}

fn lazy(sync_interval: std::time::Duration) -> WalOptions {
    WalOptions { sync: wal::SyncPolicy::Interval(sync_interval), ..small_options() }
}

/// Under `interval` appends are answered before their sync. When a sync then fails (here
/// the one a rotation makes before it seals), the pages it carried may never reach the
/// disk, and the cut back to the durable length takes those answered appends. Their
/// offsets must not be answered to other appends in the same open (a sender holds them,
/// and the daemon recorded its delivery id at them): the log is poisoned, saying what may
/// be lost, and a reopen recovers exactly what is durable.
#[test]
fn under_interval_a_failed_sync_poisons_the_log_rather_than_answer_an_offset_twice() {
    let sim = SimStorage::new();
    let opts = lazy(std::time::Duration::from_secs(60));
    let wal = open(&sim, opts.clone());
    rt().block_on(async {
        let mut answered = Vec::new();
        for t in 0..3 {
            answered.push(wal.append(vec![payload(t, 1000)]).await.unwrap_or_else(|e| panic!("{e}")).first_offset);
        }
        assert_eq!(answered, vec![0, 1, 2]);
        sim.fail_nth(FaultOp::Sync, 1, ErrorKind::Other);
        // Does not fit beside the others: a rotation, whose sync fails.
        assert!(wal.append(vec![payload(3, 1000)]).await.is_err());
        match wal.append(vec![payload(4, 1000)]).await {
            Err(wal::WalError::Poisoned(why)) => {
                assert!(why.contains("(offsets 0 to 2) may be lost"), "{why}");
            }
            other => panic!("an append after answered offsets were lost got {other:?}"),
        }
        assert!(!wal.accepts_appends());
    });
    drop(wal);
    // Nothing was synced: the reopened log is empty, as after a power loss.
    let wal = open(&sim, opts);
    assert_eq!((wal.start_offset(), wal.next_offset()), (0, 0));
    assert!(wal.accepts_appends());
}

/// The same when the failing sync is the interval's own, with no append in flight: the
/// log stops at once (its health says so before a request fails).
#[test]
fn under_interval_a_failed_interval_sync_poisons_the_log() {
    let sim = SimStorage::new();
    let wal = open(&sim, lazy(std::time::Duration::from_millis(10)));
    sim.fail_nth(FaultOp::Sync, 1, ErrorKind::Other);
    append_tagged(&wal, 0..2, 100);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while wal.accepts_appends() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(!wal.accepts_appends(), "the log took appends after a sync lost answered ones");
    let e = rt().block_on(wal.append(vec![payload(2, 100)])).unwrap_err();
    assert!(matches!(&e, wal::WalError::Poisoned(why) if why.contains("(offsets 0 to 1) may be lost")), "{e}");
}

/// And when it is the sync of a clean close: the close fails, saying what may be lost,
/// and writes no clean-shutdown marker.
#[test]
fn under_interval_a_failed_final_sync_fails_the_close_and_says_what_may_be_lost() {
    let sim = SimStorage::new();
    let opts = lazy(std::time::Duration::from_secs(60));
    let wal = open(&sim, opts.clone());
    append_tagged(&wal, 0..2, 100);
    sim.fail_nth(FaultOp::Sync, 1, ErrorKind::Other);
    let e = rt().block_on(wal.close()).unwrap_err();
    assert!(matches!(&e, wal::WalError::Poisoned(why) if why.contains("(offsets 0 to 1) may be lost")), "{e}");
    drop(wal);
    let wal = open(&sim, opts);
    assert!(!wal.open_report().clean_shutdown);
    assert_eq!(wal.next_offset(), 0);
}

/// Three records of 1000 bytes fill a small segment; with every metadata change of the
/// disk refused from then on, the next two appends need a rotation that fails: each is
/// refused, and the log says it awaits the rotation without being stopped.
fn appends_refused_for_a_rotation(sim: &SimStorage, wal: &wal::Wal) {
    append_tagged(wal, 0..3, 1000);
    assert!(!wal.awaits_segment());
    for _ in 0..100 {
        sim.fail_nth(FaultOp::Metadata, 1, ErrorKind::PermissionDenied);
    }
    rt().block_on(async {
        for tag in 3..5 {
            let e = wal.append(vec![payload(tag, 1000)]).await.unwrap_err();
            assert!(e.to_string().contains("simulated fault"), "{e}");
            assert!(wal.awaits_segment(), "a log that can take no append says it accepts them");
            assert!(wal.accepts_appends(), "nothing is lost or poisoned: a reopen is not needed");
        }
    });
}

/// A rotation seals the active segment, then creates its successor. When that creation
/// fails and keeps failing (a directory that turned read-only, a full disk), no append
/// can be taken: the log says so (`awaits_segment`, which the daemon's health reports),
/// takes no offset for the appends it fails, and keeps trying with no append arriving,
/// so that once the cause is gone the successor exists before the next append comes
/// (a load balancer stopped sending on that health, and is waiting for it to clear).
#[test]
fn a_successor_that_cannot_be_created_is_created_by_the_writer_once_it_can() {
    let sim = SimStorage::new();
    // No zeros written ahead, so the seal cuts nothing and the first namespace change of
    // the rotation is the successor's creation.
    let wal = open(&sim, WalOptions { preallocate_bytes: 0, ..small_options() });
    // Does not fit beside the three: a rotation, whose successor is refused.
    appends_refused_for_a_rotation(&sim, &wal);
    assert_eq!(segment_files(&sim, &dir()).len(), 1);
    // With no append arriving, the writer tries again by itself.
    let armed = sim.armed_faults();
    wait_until("the writer did not try again with no append waiting", || sim.armed_faults() < armed);
    assert!(wal.awaits_segment());
    // The cause goes away: the successor is created before any append asks for it.
    sim.disarm();
    wait_until("the successor was never created", || !wal.awaits_segment());
    assert_eq!(segment_files(&sim, &dir()).len(), 2);
    // The failed appends took no offsets.
    let a = rt().block_on(wal.append(vec![payload(5, 1000)])).unwrap();
    assert_eq!(a.first_offset, 3);
    drop(wal);
    let wal = open(&sim, small_options());
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![0, 1, 2, 5]);
}

/// A rotation whose seal cannot be written (here its cut of the zeros written ahead
/// fails, and so does the undo's cut, which overwrites them with zeros instead) leaves
/// the full segment unsealed: no append can be taken until the rotation succeeds, as
/// when the successor cannot be created. The log says so (`awaits_segment`, the daemon's
/// health), and the writer tries again by itself. Before, every append failed while the
/// log said it took them, and only an append retried the rotation.
#[test]
fn a_seal_that_cannot_be_written_is_awaited_and_retried_like_a_successor() {
    let sim = SimStorage::new();
    let opts = small_options();
    assert!(opts.preallocate_bytes > 0, "the seal's first step must be its cut of the zeros");
    let wal = open(&sim, opts.clone());
    // The undo of the seal writes zeros where it cannot cut: nothing to reopen for.
    appends_refused_for_a_rotation(&sim, &wal);
    let armed = sim.armed_faults();
    wait_until("the writer did not try again with no append waiting", || sim.armed_faults() < armed);
    sim.disarm();
    wait_until("the rotation was never made", || !wal.awaits_segment());
    assert_eq!(segment_files(&sim, &dir()).len(), 2);
    let a = rt().block_on(wal.append(vec![payload(5, 1000)])).unwrap();
    assert_eq!(a.first_offset, 3, "the failed appends took no offsets");
    drop(wal);
    let wal = open(&sim, opts);
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![0, 1, 2, 5]);
}

/// A power loss between a seal and its successor's creation leaves a log whose tail is
/// sealed, and the open creates the successor. When it cannot (the disk full), the log
/// opens anyway and waits for it, as a running one does: a daemon that could not start
/// could not deliver what its log holds either, which is what would free the disk.
#[test]
fn a_log_whose_sealed_tail_cannot_get_its_successor_opens_and_waits_for_it() {
    let sim = SimStorage::new();
    let opts = WalOptions { preallocate_bytes: 0, ..small_options() };
    let wal = open(&sim, opts.clone());
    append_tagged(&wal, 0..3, 1000);
    for _ in 0..100 {
        sim.fail_nth(FaultOp::Metadata, 1, ErrorKind::PermissionDenied);
    }
    // The rotation seals the tail (synced), then fails to create the successor.
    assert!(rt().block_on(wal.append(vec![payload(3, 1000)])).is_err());
    assert!(wal.awaits_segment());
    assert!(!wal.is_disk_full(), "refused for permission, not space");
    sim.crash(CrashMode::LoseUnsynced);
    drop(wal);
    sim.disarm();
    // No room for one more byte: the successor's header cannot be written.
    sim.set_space_limit(Some(sim.used_bytes()));
    let wal = try_open(&sim, opts.clone()).unwrap_or_else(|e| panic!("a full disk kept the log from opening: {e}"));
    assert!(wal.awaits_segment());
    assert!(wal.is_disk_full(), "the successor was refused for space");
    assert_eq!(segment_files(&sim, &dir()).len(), 1);
    let tags: Vec<u64> = read_all(&wal, 0).iter().map(|r| tag_of(&r.payload)).collect();
    assert_eq!(tags, vec![0, 1, 2], "what the log held is readable (and deliverable) meanwhile");
    let e = rt().block_on(wal.append(vec![payload(4, 100)])).unwrap_err();
    assert!(matches!(e, wal::WalError::Io { .. }), "{e}");
    // Space returns: the writer creates the successor by itself.
    sim.set_space_limit(None);
    wait_until("the successor was never created", || !wal.awaits_segment());
    assert!(!wal.is_disk_full(), "the successor's creation found space");
    assert_eq!(rt().block_on(wal.append(vec![payload(5, 100)])).unwrap().first_offset, 3);
}
