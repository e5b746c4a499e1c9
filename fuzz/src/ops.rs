//! `ops_vs_model`: operation sequences against the log and a reference model.
//!
//! The input is decoded into a few options and a bounded sequence of operations (append,
//! read, release, power loss, clean close, restart, injected faults), run one at a time
//! on a current-thread runtime against a log on the simulated disk. The model remembers
//! what the log promised and checks, after every operation and every reopen:
//!
//! - every append that resolved `Ok` is present, with the same payload at the same
//!   offset, after every later crash and reopen, unless it was released;
//! - every record a reader ever returned stays (it was durable), unless released;
//! - no record appears that was never appended, none appears twice, and records keep the
//!   order they were appended in;
//! - offsets are dense, never go backwards and an offset never names two payloads;
//! - a failed append changes nothing: the next offset stays where it was;
//! - a batch is whole or absent: a record of a batch in the log has every other record
//!   of that batch beside it, at consecutive offsets, but those released;
//! - reads of released offsets and past the end fail with the matching error.
//!
//! Payloads carry a unique tag ([`crate::payload`]), so a record read back names the
//! append it came from. An append that failed may still surface after a power loss (its
//! bytes may have reached the disk); that is allowed, but it is then held to the same
//! rules as any other record.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::sync::Arc;

use bytes::Bytes;
use wal::format::OFFSET_MAX;
use wal::storage::{CrashMode, FaultOp, SimStorage, Storage};
use wal::{Record, Wal, WalError, WalOptions};

use crate::{Input, Jumps, known, log_dir, payload, read_all, tag_of};

/// At most this many operations per input.
pub const MAX_OPS: usize = 64;
/// At most this many records and payload bytes attempted per input.
pub const MAX_RECORDS: u64 = 512;
pub const MAX_PAYLOAD_BYTES: usize = 512 * 1024;
/// "Unbounded" capacity: far above anything an input can write.
const UNBOUNDED_MAX_BYTES: u64 = 1 << 30;

/// The log's options, as three bytes of input (the capacity's byte also picks the zeros
/// written ahead of the tail).
#[derive(Debug, Clone, Copy, Default)]
pub struct Setup {
    pub segment: u8,
    pub capacity: u8,
    pub initial: u8,
}

impl Setup {
    pub fn options(&self) -> WalOptions {
        let segment_max_bytes = 128 + u64::from(self.segment) * 16;
        let max_bytes = if self.capacity < 192 {
            UNBOUNDED_MAX_BYTES
        } else {
            segment_max_bytes * (2 + u64::from(self.capacity % 8))
        };
        let initial_offset = match self.initial % 4 {
            0 => 0,
            1 => u64::from(self.initial) * 1000,
            // The end of the offset space: exhaustion must be an error, not a wrap.
            2 => OFFSET_MAX - u64::from(self.initial % 64),
            _ => u64::from(u32::MAX) - 8 + u64::from(self.initial % 16),
        };
        // The zeros written ahead of the tail: the default (which fills a segment this
        // small at its first write), a quarter segment (so that later writes grow the
        // file, and a crash can cut a growth), or none.
        let preallocate_bytes = match (self.capacity / 8) % 3 {
            0 => WalOptions::default().preallocate_bytes,
            1 => segment_max_bytes / 4,
            _ => 0,
        };
        WalOptions { segment_max_bytes, max_bytes, initial_offset, preallocate_bytes, ..WalOptions::default() }
    }
}

/// One operation. Sizes and positions are codes, scaled by the decoder.
#[derive(Debug, Clone)]
pub enum Op {
    /// One atomic batch; one size code per record (1 to 4 records).
    Append { sizes: Vec<u8> },
    /// One batch of one record per size code (1 to 4), all in flight at once, so the
    /// writer groups them into one write and sync (or splits them at a segment's end).
    AppendConcurrently { sizes: Vec<u8> },
    /// Read from a position between just below the start and just past the end.
    Read { from: u8, max_records: u8, max_bytes: u16 },
    /// Release below a position between the start and just past the end.
    Release { at: u8 },
    /// Power loss keeping an arbitrary mix of unsynced changes, then reopen.
    Crash { seed: u8 },
    /// Power loss keeping exactly what was synced, then reopen.
    CrashLoseUnsynced,
    /// Clean close, then reopen.
    CloseReopen,
    /// The process ends without closing (the disk keeps everything), then reopen.
    Restart,
    /// Fail the `n`th operation of a kind.
    FailNth { op: u8, n: u8, kind: u8 },
    /// Lose power just before the `n`th operation of a kind.
    CrashAtNth { op: u8, n: u8, seed: u8 },
    /// Limit the disk to what it holds plus `extra * 16` bytes; 0 lifts the limit.
    SpaceLimit { extra: u16 },
}

const OP_KINDS: u8 = 10;

impl Op {
    fn decode(input: &mut Input<'_>) -> Op {
        match input.u8() % OP_KINDS {
            0 => {
                let code = input.u8();
                let n = 1 + (code % 4) as usize;
                let sizes = (0..n).map(|_| input.u8()).collect();
                if code & 0x80 == 0 { Op::Append { sizes } } else { Op::AppendConcurrently { sizes } }
            }
            1 => Op::Read { from: input.u8(), max_records: input.u8(), max_bytes: input.u16() },
            2 => Op::Release { at: input.u8() },
            3 => Op::Crash { seed: input.u8() },
            4 => Op::CrashLoseUnsynced,
            5 => Op::CloseReopen,
            6 => Op::Restart,
            7 => Op::FailNth { op: input.u8(), n: input.u8(), kind: input.u8() },
            8 => Op::CrashAtNth { op: input.u8(), n: input.u8(), seed: input.u8() },
            _ => Op::SpaceLimit { extra: input.u16() },
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Op::Append { sizes } => {
                out.push(0);
                out.push((sizes.len().clamp(1, 4) - 1) as u8);
                out.extend(sizes.iter().take(4));
            }
            Op::AppendConcurrently { sizes } => {
                out.push(0);
                out.push((sizes.len().clamp(1, 4) - 1) as u8 | 0x80);
                out.extend(sizes.iter().take(4));
            }
            Op::Read { from, max_records, max_bytes } => {
                out.extend([1, *from, *max_records]);
                out.extend(max_bytes.to_le_bytes());
            }
            Op::Release { at } => out.extend([2, *at]),
            Op::Crash { seed } => out.extend([3, *seed]),
            Op::CrashLoseUnsynced => out.push(4),
            Op::CloseReopen => out.push(5),
            Op::Restart => out.push(6),
            Op::FailNth { op, n, kind } => out.extend([7, *op, *n, *kind]),
            Op::CrashAtNth { op, n, seed } => out.extend([8, *op, *n, *seed]),
            Op::SpaceLimit { extra } => {
                out.push(9);
                out.extend(extra.to_le_bytes());
            }
        }
    }
}

/// Encodes a setup and operations as an input the target decodes back to them.
pub fn encode(setup: Setup, ops: &[Op]) -> Vec<u8> {
    let mut out = vec![setup.segment, setup.capacity, setup.initial];
    for op in ops {
        op.encode(&mut out);
    }
    out
}

/// The kind of operation a fault counts. Reads and lookups (listing a directory,
/// opening a file that exists, a file's length) are kinds only for the target that
/// injects read faults, so the inputs of the others keep their meaning.
fn fault_op(code: u8, reads: bool) -> FaultOp {
    match code % if reads { 7 } else { 5 } {
        0 => FaultOp::Write,
        1 => FaultOp::Sync,
        2 => FaultOp::SyncDir,
        3 => FaultOp::Metadata,
        5 => FaultOp::Read,
        6 => FaultOp::Lookup,
        _ => FaultOp::AnyMutation,
    }
}

fn error_kind(code: u8) -> io::ErrorKind {
    match code % 4 {
        0 => io::ErrorKind::Other,
        1 => io::ErrorKind::StorageFull,
        2 => io::ErrorKind::PermissionDenied,
        _ => io::ErrorKind::WriteZero,
    }
}

/// The size of a record from its code: tiny (0..15), small, medium, or about a whole
/// segment (a batch of its own).
fn record_size(code: u8, segment_max_bytes: u64) -> usize {
    let low = usize::from(code & 63);
    match code >> 6 {
        0 => low & 15,
        1 => 16 + low * 4,
        2 => 64 + low * 24,
        _ => (segment_max_bytes as usize).saturating_sub(96) + low * 4,
    }
}

/// What the log promised so far.
#[derive(Default)]
struct Model {
    /// Offset → payload of every append that resolved `Ok`.
    acked: BTreeMap<u64, Bytes>,
    /// Offset → payload of every record ever acknowledged or read.
    seen: BTreeMap<u64, Bytes>,
    /// Tag → offset of every tagged record ever acknowledged or read.
    tag_at: BTreeMap<u64, u64>,
    /// Tag → payload of every record ever passed to `append`.
    attempted: HashMap<u64, Bytes>,
    /// Untagged (short) payloads ever passed to `append`.
    attempted_short: HashSet<Bytes>,
    /// Tag → the batch the tagged record was passed to `append` in, and its place there.
    batch_of: HashMap<u64, (Arc<Vec<Bytes>>, usize)>,
    /// Everything below this was released by the owner and may be gone.
    floor: u64,
    /// The offset after the highest one ever acknowledged or read.
    min_next: u64,
}

impl Model {
    /// A record the log returned or acknowledged at `offset`.
    fn observe(&mut self, offset: u64, p: &Bytes) {
        if let Some(before) = self.seen.get(&offset) {
            assert_eq!(before, p, "offset {offset} names two different payloads");
        }
        match tag_of(p) {
            Some(tag) => {
                assert_eq!(
                    self.attempted.get(&tag),
                    Some(p),
                    "record at offset {offset} was never appended (tag {tag})"
                );
                if let Some(&at) = self.tag_at.get(&tag) {
                    assert_eq!(at, offset, "record with tag {tag} appears at offsets {at} and {offset}");
                } else {
                    // Appended earlier means a lower offset, appended later a higher one.
                    if let Some((t, &o)) = self.tag_at.range(..tag).next_back() {
                        assert!(o < offset, "record {tag} at {offset} is not after record {t} at {o}: reordered");
                    }
                    if let Some((t, &o)) = self.tag_at.range(tag + 1..).next() {
                        assert!(o > offset, "record {tag} at {offset} is not before record {t} at {o}: reordered");
                    }
                    self.tag_at.insert(tag, offset);
                }
            }
            None => assert!(self.attempted_short.contains(p), "short record at offset {offset} was never appended"),
        }
        self.seen.insert(offset, p.clone());
        self.min_next = self.min_next.max(offset + 1);
    }
}

struct Harness {
    sim: SimStorage,
    options: WalOptions,
    wal: Option<Wal>,
    model: Model,
    next_tag: u64,
    /// Records and bytes attempted so far (bounded per input).
    records: u64,
    bytes: usize,
    /// A fault may still be armed, or a space limit is set, or the log still waits to
    /// create a segment a fault kept it from creating: an operation (even an open) may
    /// fail for that reason alone. Cleared after an operation that left none of these,
    /// so a log that keeps failing once its faults are gone is caught.
    faults_possible: bool,
    /// A space limit is set.
    space_limited: bool,
    crashes_seen: u64,
    /// Faults may fail reads too (`ops_with_read_faults`).
    read_faults: bool,
}

impl Harness {
    fn wal(&self) -> &Wal {
        self.wal.as_ref().expect("the harness keeps a log open between operations")
    }

    fn storage(&self) -> Arc<dyn Storage> {
        Arc::new(self.sim.clone())
    }

    /// Opens the log, retrying once without faults if an injected fault (or a power loss
    /// it caused) made the open fail. Then checks everything against the model.
    fn open(&mut self) {
        let mut attempt = 0;
        let wal = loop {
            let crashes_before = self.sim.crashes();
            match Wal::open_with(self.storage(), &log_dir(), self.options.clone()) {
                // Power was lost during the open at an operation whose failure the open
                // may ignore (publishing the advisory durable watermark): that process is
                // gone, whatever the call returned. Open again, as a restart would.
                Ok(w) if self.sim.crashes() != crashes_before => {
                    drop(w);
                    self.lift_faults();
                    self.crashes_seen = self.sim.crashes();
                    attempt += 1;
                    assert!(attempt < 3, "the log does not reopen once faults are lifted");
                }
                Ok(w) => break w,
                Err(e) if self.faults_possible || self.sim.crashes() != self.crashes_seen => {
                    assert!(!e.is_corruption(), "an injected fault during open was reported as damage to the log: {e}");
                    if trace() {
                        eprintln!("    open failed ({e}); again without faults");
                    }
                    self.lift_faults();
                    self.crashes_seen = self.sim.crashes();
                    attempt += 1;
                    assert!(attempt < 3, "the log does not reopen once faults are lifted: {e}");
                }
                Err(e) => panic!("the log does not reopen after a crash or restart: {e}"),
            }
        };
        self.crashes_seen = self.sim.crashes();
        if trace() {
            eprintln!("    opened: {:?}", wal.open_report());
        }
        self.wal = Some(wal);
        self.check_everything();
        if self.power_lost() {
            // A power loss armed at a read fired while the check read the log back.
            self.reopen();
        }
    }

    /// With the simulated disk's finding `sim-simultaneous-faults` known (two armed
    /// faults due on the same operation: one fires, the other's countdown underflows on
    /// the next operation), arm only one fault at a time.
    fn one_fault_at_a_time(&self) {
        if known("sim-simultaneous-faults") {
            self.sim.disarm();
        }
    }

    fn lift_faults(&mut self) {
        self.sim.disarm();
        self.sim.set_space_limit(None);
        self.space_limited = false;
        self.faults_possible = false;
    }

    /// Drops the handle (its writer thread stops) and opens again.
    fn reopen(&mut self) {
        drop(self.wal.take());
        self.open();
    }

    /// If an armed crash fired during the last operation, the handle is dead: reopen.
    fn reopen_if_crashed(&mut self) {
        if self.sim.crashes() != self.crashes_seen {
            self.reopen();
        }
    }

    /// The whole log against the model: every promise kept, nothing invented.
    fn check_everything(&mut self) {
        let wal = self.wal();
        let (start, next) = (wal.start_offset(), wal.next_offset());
        assert!(start <= next, "start {start} is past the end {next}");
        assert!(
            next >= self.model.min_next,
            "the log ends at {next}, but offset {} was durable",
            self.model.min_next - 1
        );
        let Some(records) = self.read_all_past_faults(start, 1000, 1 << 20) else { return };
        assert_eq!(records.len() as u64, next - start, "read {} records from {start} to {next}", records.len());
        for r in &records {
            self.model.observe(r.offset, &r.payload);
        }
        // Whole or absent: a batch's records beside each one the log holds.
        for r in &records {
            let Some((batch, i)) = tag_of(&r.payload).and_then(|tag| self.model.batch_of.get(&tag)) else { continue };
            let first = r.offset - *i as u64;
            for (j, p) in batch.iter().enumerate() {
                let offset = first + j as u64;
                if offset < start {
                    continue; // released
                }
                let held = records.get((offset - start) as usize).filter(|h| h.offset == offset);
                assert!(
                    held.is_some_and(|h| &h.payload == p),
                    "a torn batch: record {} of {} (at offset {offset}) is not beside record {} (at offset {}); the \
                     log holds {start}..{next}",
                    j + 1,
                    batch.len(),
                    i + 1,
                    r.offset
                );
            }
        }
        let floor = self.model.floor;
        for (&offset, p) in self.model.seen.range(floor..) {
            let held = offset.checked_sub(start).and_then(|i| records.get(i as usize));
            match held {
                Some(r) => assert_eq!(&r.payload, p, "offset {offset} changed its payload"),
                None => {
                    let promised = if self.model.acked.contains_key(&offset) { "acknowledged" } else { "read" };
                    panic!(
                        "{promised} record at offset {offset} is gone (log holds {start}..{next}, released below {floor})"
                    )
                }
            }
        }
    }

    /// The payloads of records of these size codes, each noted as attempted, in one batch
    /// (`as_one_batch`) or each a batch of its own; `None` past the input's bounds on
    /// records and bytes.
    fn attempt(&mut self, sizes: &[u8], as_one_batch: bool) -> Option<(Vec<usize>, Vec<Bytes>)> {
        let seg = self.options.segment_max_bytes;
        let lens: Vec<usize> = sizes.iter().map(|&c| record_size(c, seg)).collect();
        let total: usize = lens.iter().sum();
        if self.records + lens.len() as u64 > MAX_RECORDS || self.bytes + total > MAX_PAYLOAD_BYTES {
            return None;
        }
        self.records += lens.len() as u64;
        self.bytes += total;
        let tagged: Vec<(Option<u64>, Bytes)> = lens
            .iter()
            .map(|&len| {
                let tag = self.next_tag;
                self.next_tag += 1;
                let p = payload(tag, len);
                if len >= 8 {
                    self.model.attempted.insert(tag, p.clone());
                    (Some(tag), p)
                } else {
                    self.model.attempted_short.insert(p.clone());
                    (None, p)
                }
            })
            .collect();
        let payloads: Vec<Bytes> = tagged.iter().map(|(_, p)| p.clone()).collect();
        let batch = Arc::new(payloads.clone());
        for (i, (tag, p)) in tagged.iter().enumerate() {
            if let Some(tag) = tag {
                let place = match as_one_batch {
                    true => (batch.clone(), i),
                    false => (Arc::new(vec![p.clone()]), 0),
                };
                self.model.batch_of.insert(*tag, place);
            }
        }
        Some((lens, payloads))
    }

    async fn append(&mut self, sizes: &[u8]) {
        let Some((lens, batch)) = self.attempt(sizes, true) else { return };
        let n = batch.len() as u64;
        let expected = self.wal().next_offset();
        let result = self.wal().append(batch.clone()).await;
        if trace() {
            eprintln!("    append of {lens:?} -> {result:?}");
        }
        match result {
            Ok(a) => {
                assert_eq!(
                    a.first_offset, expected,
                    "append landed at {} while the log ended at {expected}",
                    a.first_offset
                );
                assert_eq!(a.last_offset - a.first_offset + 1, n, "a batch of {n} records got offsets {a:?}");
                assert!(a.last_offset <= OFFSET_MAX, "offset {} is past the maximum", a.last_offset);
                assert_eq!(self.wal().next_offset(), a.last_offset + 1, "a resolved append is not readable yet");
                for (i, p) in batch.iter().enumerate() {
                    let offset = a.first_offset + i as u64;
                    self.model.acked.insert(offset, p.clone());
                    self.model.observe(offset, p);
                }
            }
            Err(WalError::OffsetsExhausted { .. }) => {
                assert!(expected.saturating_add(n - 1) > OFFSET_MAX, "offsets exhausted at {expected} for {n} records");
                assert_eq!(self.wal().next_offset(), expected, "a batch refused for its offsets moved the end");
            }
            Err(WalError::Full { .. }) => {
                assert!(self.options.max_bytes < UNBOUNDED_MAX_BYTES, "a log with room to spare reported Full");
                let framed: u64 = batch.iter().map(|p| 32 + p.len() as u64).sum();
                assert!(framed <= self.options.batch_max_bytes(), "a batch no release could make room for got Full");
                assert_eq!(self.wal().next_offset(), expected, "a batch refused as Full moved the end");
            }
            Err(WalError::BatchTooLarge { batch_bytes, max_batch_bytes }) => {
                let framed: u64 = batch.iter().map(|p| 32 + p.len() as u64).sum();
                assert_eq!(batch_bytes, framed, "the refusal names another size than the batch's");
                assert_eq!(max_batch_bytes, self.options.batch_max_bytes());
                assert!(batch_bytes > max_batch_bytes, "a batch that fits an empty log was refused as too large");
                assert_eq!(self.wal().next_offset(), expected, "a batch refused as too large moved the end");
            }
            Err(WalError::Poisoned(_)) => {
                assert!(self.faults_possible || self.sim.crashes() != self.crashes_seen, "poisoned without a fault");
                // The handle is done; a new process would reopen.
                self.reopen();
            }
            Err(WalError::Io { .. }) if self.faults_possible || self.sim.crashes() != self.crashes_seen => {
                // The writer answers a failed append before it cuts the segment back; a
                // command queued behind it returns once the cut is done, so the next
                // operation (a fault armed, a power loss) always lands after it and an
                // input replays exactly.
                let _ = self.wal().release_below(0).await;
                if self.sim.crashes() == self.crashes_seen {
                    // A fault undone: the log is exactly what it was before the append.
                    assert_eq!(self.wal().next_offset(), expected, "a failed append moved the end of the log");
                }
                if !self.wal().accepts_appends() {
                    // A second fault failed the undo too: the log poisoned itself after it
                    // answered. The handle is done, here and not at some later append (by
                    // then a lifted fault would make the poisoning look unprovoked); a new
                    // process would reopen.
                    self.reopen();
                }
            }
            Err(e) => panic!("append failed without an injected fault: {e}"),
        }
    }

    /// One record per batch, every batch in flight at once (submitted in order on this
    /// current-thread runtime). How the writer groups them depends on when its thread
    /// wakes, so this operation is the one that is not replayed exactly; whatever the
    /// grouping, the ones answered `Ok` tile the log from its end before, in submission
    /// order, with no gap: a failed one takes no offset.
    async fn append_concurrently(&mut self, sizes: &[u8]) {
        let Some((lens, payloads)) = self.attempt(sizes, false) else { return };
        let expected = self.wal().next_offset();
        let results = {
            let wal = self.wal();
            let mut appends = payloads.iter().map(|p| wal.append(vec![p.clone()]));
            async fn maybe<F: std::future::Future>(f: Option<F>) -> Option<F::Output> {
                match f {
                    Some(f) => Some(f.await),
                    None => None,
                }
            }
            let (a, b, c, d) = tokio::join!(
                maybe(appends.next()),
                maybe(appends.next()),
                maybe(appends.next()),
                maybe(appends.next())
            );
            [a, b, c, d].into_iter().flatten().collect::<Vec<_>>()
        };
        if trace() {
            eprintln!("    concurrent appends of {lens:?} -> {results:?}");
        }
        let faulted = |h: &Self| h.faults_possible || h.sim.crashes() != h.crashes_seen;
        let (mut at, mut failed_io, mut poisoned) = (expected, false, false);
        // Appends before this one that failed in their write or sync: staged, they held
        // their offsets (and room) while later ones were staged, and gave them back only
        // when they failed.
        let mut held_then_failed = 0u64;
        for (p, result) in payloads.iter().zip(results) {
            match result {
                Ok(a) => {
                    assert_eq!(
                        (a.first_offset, a.last_offset),
                        (at, at),
                        "concurrent appends: one landed out of submission order, or past a gap"
                    );
                    self.model.acked.insert(at, p.clone());
                    self.model.observe(at, p);
                    at += 1;
                }
                Err(WalError::OffsetsExhausted { .. }) => {
                    assert!(at.saturating_add(held_then_failed) > OFFSET_MAX, "offsets exhausted at {at}");
                }
                Err(WalError::Full { .. }) => {
                    assert!(self.options.max_bytes < UNBOUNDED_MAX_BYTES, "a log with room to spare reported Full");
                }
                Err(WalError::BatchTooLarge { batch_bytes, max_batch_bytes }) => {
                    assert!(batch_bytes > max_batch_bytes, "a record that fits an empty log was refused as too large");
                }
                Err(WalError::Poisoned(_)) if faulted(self) => {
                    poisoned = true;
                    held_then_failed += 1;
                }
                Err(WalError::Io { .. }) if faulted(self) => {
                    failed_io = true;
                    held_then_failed += 1;
                }
                Err(e) => panic!("a concurrent append failed without an injected fault: {e}"),
            }
        }
        if poisoned {
            self.reopen();
            return;
        }
        if failed_io {
            // As for one append: wait for the writer's undo before anything else.
            let _ = self.wal().release_below(0).await;
            if !self.wal().accepts_appends() {
                self.reopen();
                return;
            }
        }
        if self.sim.crashes() == self.crashes_seen {
            assert_eq!(self.wal().next_offset(), at, "the log's end is not past the appends answered Ok");
        }
    }

    async fn read(&mut self, from: u8, max_records: u8, max_bytes: u16) {
        let wal = self.wal();
        let (start, next) = (wal.start_offset(), wal.next_offset());
        let lo = start.saturating_sub(1);
        let span = next - lo + 2;
        let from = lo.saturating_add(u64::from(from) % span);
        let max_records = 1 + usize::from(max_records % 32);
        let max_bytes = 1 + usize::from(max_bytes);
        if from < start {
            match wal.reader(from) {
                Err(WalError::Released { .. }) => {}
                other => panic!("reading released offset {from} (start {start}) gave {other:?}"),
            }
            return;
        }
        if from > next {
            match wal.reader(from) {
                Err(WalError::BeyondEnd { .. }) => {}
                other => panic!("reading offset {from} past the end {next} gave {other:?}"),
            }
            return;
        }
        if from < next {
            // The awaiting read must return at once when records are there.
            let mut reader = wal.reader(from).expect("reader at a retained offset");
            match reader.read(max_records, max_bytes).await {
                Ok(first) => assert_eq!(first.first().map(|r| r.offset), Some(from), "read did not start at {from}"),
                Err(e) => {
                    self.injected_read_failure(&e);
                    if self.power_lost() {
                        return;
                    }
                }
            }
        }
        let Some(records) = self.read_all_past_faults(from, max_records, max_bytes) else { return };
        assert_eq!(records.len() as u64, next - from, "read {} records from {from} to {next}", records.len());
        for r in &records {
            self.model.observe(r.offset, &r.payload);
        }
    }

    /// True once an armed power loss fired: the process is gone, whatever it was doing,
    /// and the operation's outcome is moot (the harness reopens after it).
    fn power_lost(&self) -> bool {
        self.sim.crashes() != self.crashes_seen
    }

    /// A read failed: only an injected fault may do that (a failed read or a power
    /// loss), and it must say I/O error, never damage. The faults are lifted, so the
    /// caller's retry reads the disk as it is.
    fn injected_read_failure(&mut self, e: &WalError) {
        assert!(
            self.read_faults && (self.faults_possible || self.power_lost()) && matches!(e, WalError::Io { .. }),
            "a read failed without an injected read fault, or called it damage: {e}"
        );
        if trace() {
            eprintln!("    read failed ({e}); again without faults");
        }
        self.lift_faults();
    }

    /// Every record from `from` on ([`read_all`]); a read an injected fault failed is read
    /// again once, after the fault is lifted. `None` when a power loss ended the process
    /// during the read. Any other failure breaks a promise.
    fn read_all_past_faults(&mut self, from: u64, max_records: usize, max_bytes: usize) -> Option<Vec<Record>> {
        let mut retried = false;
        loop {
            let (records, err) = read_all(self.wal(), from, max_records, max_bytes, Jumps::ToGapBases(&[]));
            let Some(e) = err else { return Some(records) };
            if retried || !self.read_faults {
                panic!("reading from {from} failed after {} records: {e}", records.len());
            }
            self.injected_read_failure(&e);
            if self.power_lost() {
                return None;
            }
            retried = true;
        }
    }

    async fn release(&mut self, at: u8) {
        let wal = self.wal();
        let (start, next) = (wal.start_offset(), wal.next_offset());
        let below = if at == 255 { next.saturating_add(5) } else { start + (next - start) * u64::from(at) / 254 };
        match wal.release_below(below).await {
            Ok(r) => {
                // Exactly what was asked (never past the end, never back): a release that
                // went further would make records nobody released unreadable, and taking
                // the floor from the log's own answer would excuse it.
                let asked = start.max(below.min(next));
                assert_eq!(r.start, asked, "release below {below} (log {start}..{next}) left the start at {}", r.start);
                assert_eq!(self.wal().start_offset(), r.start, "the start does not match the release");
                self.model.floor = self.model.floor.max(asked);
            }
            Err(WalError::Io { .. }) if self.faults_possible || self.sim.crashes() != self.crashes_seen => {
                // Part of the release may have happened; the promise is only what was
                // asked for, and only the floor may be lost.
                self.model.floor = self.model.floor.max(below.min(next));
            }
            Err(e) => panic!("release below {below} failed without an injected fault: {e}"),
        }
    }

    async fn close_and_reopen(&mut self) {
        let next = self.wal().next_offset();
        let closed = self.wal().close().await;
        let clean = closed.is_ok() && !self.faults_possible && self.sim.crashes() == self.crashes_seen;
        if closed.is_err() {
            assert!(
                self.faults_possible || self.sim.crashes() != self.crashes_seen,
                "close failed without a fault: {closed:?}"
            );
        }
        self.reopen();
        if clean {
            assert_eq!(self.wal().next_offset(), next, "a cleanly closed log reopened with a different end");
            assert!(self.wal().open_report().clean_shutdown, "a clean close was not recognised on reopen");
        }
    }

    async fn run(&mut self, op: Op) {
        if trace() {
            let wal = self.wal();
            eprintln!("[{}..{}) {op:?}", wal.start_offset(), wal.next_offset());
        }
        match op {
            Op::Append { sizes } => self.append(&sizes).await,
            Op::AppendConcurrently { sizes } => self.append_concurrently(&sizes).await,
            Op::Read { from, max_records, max_bytes } => self.read(from, max_records, max_bytes).await,
            Op::Release { at } => self.release(at).await,
            Op::Crash { seed } => {
                self.sim.crash(CrashMode::Adversarial { seed: u64::from(seed) });
                self.faults_possible = false;
                self.sim.set_space_limit(None);
                self.space_limited = false;
                self.reopen();
            }
            Op::CrashLoseUnsynced => {
                self.sim.crash(CrashMode::LoseUnsynced);
                self.faults_possible = false;
                self.sim.set_space_limit(None);
                self.space_limited = false;
                self.reopen();
            }
            Op::CloseReopen => self.close_and_reopen().await,
            Op::Restart => self.reopen(),
            Op::FailNth { op, n, kind } => {
                self.one_fault_at_a_time();
                self.sim.fail_nth(fault_op(op, self.read_faults), 1 + u64::from(n % 16), error_kind(kind));
                self.faults_possible = true;
            }
            Op::CrashAtNth { op, n, seed } => {
                self.one_fault_at_a_time();
                let mode = CrashMode::Adversarial { seed: u64::from(seed) };
                self.sim.crash_at_nth(fault_op(op, self.read_faults), 1 + u64::from(n % 16), mode);
                self.faults_possible = true;
            }
            Op::SpaceLimit { extra } => {
                if extra == 0 {
                    self.sim.set_space_limit(None);
                    self.space_limited = false;
                } else {
                    let limit = self.sim.used_bytes() + u64::from(extra % 4096) * 16;
                    self.sim.set_space_limit(Some(limit));
                    self.space_limited = true;
                    self.faults_possible = true;
                }
            }
        }
        self.reopen_if_crashed();
        if self.faults_possible && self.sim.armed_faults() == 0 && !self.space_limited && !self.wal().awaits_segment() {
            // Every fault fired (or was lifted) and nothing is left over from one: the
            // next operation must succeed as on a healthy disk.
            self.faults_possible = false;
        }
    }
}

/// `FUZZ_TRACE=1` prints each operation with the log's range before it (for `replay`).
fn trace() -> bool {
    static TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("FUZZ_TRACE").is_some())
}

/// Decodes and runs one input. Panics on any broken promise.
pub fn run(data: &[u8]) {
    run_with(data, false);
}

/// [`run`], with faults that may also fail reads: a read fault must surface as an I/O
/// error (never as damage), lose nothing, and leave the log readable once lifted.
pub fn run_with_read_faults(data: &[u8]) {
    run_with(data, true);
}

fn run_with(data: &[u8], read_faults: bool) {
    let mut input = Input::new(data);
    let setup = Setup { segment: input.u8(), capacity: input.u8(), initial: input.u8() };
    let options = setup.options();
    let mut ops = Vec::new();
    while !input.is_empty() && ops.len() < MAX_OPS {
        ops.push(Op::decode(&mut input));
    }
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a current-thread runtime");
    let mut h = Harness {
        sim: SimStorage::new(),
        model: Model { floor: 0, min_next: options.initial_offset, ..Model::default() },
        options,
        wal: None,
        next_tag: 1,
        records: 0,
        bytes: 0,
        faults_possible: false,
        space_limited: false,
        crashes_seen: 0,
        read_faults,
    };
    h.open();
    runtime.block_on(async {
        for op in ops {
            h.run(op).await;
        }
    });
    // Every input ends with a power loss: whatever was promised must still be there.
    h.lift_faults();
    h.sim.crash(CrashMode::LoseUnsynced);
    h.reopen();
    drop(h.wal.take());
}
