//! Shared pieces of the fuzz targets.
//!
//! The targets themselves (`fuzz_targets/`) are one line each; the work is here so that
//! the seed generator (`examples/seed_corpus.rs`) encodes inputs with the same code the
//! targets decode them with.
//!
//! - [`open_dir`]: builds a log directory on the simulated disk from the input (a real
//!   log written through the API and then damaged, or files given byte for byte), then
//!   opens it every way there is and checks that the answers are records or clear errors
//!   and agree with each other.
//! - [`door`]: drives the webhook door's router with requests built from the input and
//!   checks every answer against the HTTP contract and the log.
//! - [`ops`]: runs a sequence of appends, reads, releases, crashes, reopens and injected
//!   faults against the log and a reference model of what it promised.
//!
//! Every assertion here is a property of the log; a panic is a finding.

pub mod door;
pub mod open_dir;
pub mod ops;

use std::path::{Path, PathBuf};

use bytes::Bytes;
use wal::{Record, Wal, WalError};

/// Where the fuzzed log lives on the simulated disk.
pub fn log_dir() -> PathBuf {
    PathBuf::from("/fuzz/log")
}

/// Reads the fuzz input front to back; past its end every read yields zeros, so any
/// input decodes to something.
pub struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Input<'a> {
        Input { data, pos: 0 }
    }

    pub fn is_empty(&self) -> bool {
        self.pos >= self.data.len()
    }

    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// Up to `n` bytes (fewer at the end of the input).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let from = self.pos.min(self.data.len());
        let to = self.pos.saturating_add(n).min(self.data.len());
        self.pos = self.pos.saturating_add(n);
        &self.data[from..to]
    }
}

/// A payload that names itself: records of 8 bytes or more start with their tag, and
/// the rest is derived from it, so a record read back identifies the append it came from.
/// Shorter records are only a repeated byte.
pub fn payload(tag: u64, len: usize) -> Bytes {
    if len < 8 {
        return Bytes::from(vec![(tag as u8) ^ 0x5a; len]);
    }
    let mut v = tag.to_le_bytes().to_vec();
    v.extend((8..len).map(|i| (tag.wrapping_mul(31).wrapping_add(i as u64) % 251) as u8));
    Bytes::from(v)
}

/// The tag of a payload [`payload`] made, if it is long enough to carry one.
pub fn tag_of(p: &[u8]) -> Option<u64> {
    let b: [u8; 8] = p.get(..8)?.try_into().ok()?;
    Some(u64::from_le_bytes(b))
}

/// Which jumps in offsets a read may show.
#[derive(Debug, Clone, Copy)]
pub enum Jumps<'a> {
    /// Only forward to one of these bases: segments a salvage started past a gap.
    ToGapBases(&'a [u64]),
    /// Any jump forward. For logs opened on a clean-shutdown marker that lies about the
    /// tail, which the log trusts by design; offsets must still only increase.
    Any,
}

impl Jumps<'_> {
    fn allows(&self, from: u64, to: u64) -> bool {
        match self {
            Jumps::ToGapBases(bases) => to == from || (to > from && bases.contains(&to)),
            Jumps::Any => to >= from,
        }
    }
}

/// Reads every durable record from `from` on, in batches bounded by `max_records` and
/// `max_bytes`, checking each batch's bounds and that offsets are dense (except for the
/// `jumps` allowed), and that a failed read consumes nothing. Returns what was read and
/// the error that stopped the read, if any.
pub fn read_all(
    wal: &Wal,
    from: u64,
    max_records: usize,
    max_bytes: usize,
    jumps: Jumps<'_>,
) -> (Vec<Record>, Option<WalError>) {
    let mut out: Vec<Record> = Vec::new();
    let mut reader = match wal.reader(from) {
        Ok(r) => r,
        Err(e) => return (out, Some(e)),
    };
    let mut expected = from;
    loop {
        match reader.try_read(max_records, max_bytes) {
            Ok(batch) if batch.is_empty() => return (out, None),
            Ok(batch) => {
                assert!(batch.len() <= max_records, "a batch of {} records, limit {max_records}", batch.len());
                let bytes: usize = batch.iter().map(|r| r.payload.len()).sum();
                assert!(
                    batch.len() == 1 || bytes <= max_bytes,
                    "a batch of {} records and {bytes} bytes, limit {max_bytes}",
                    batch.len()
                );
                for r in batch {
                    assert!(
                        jumps.allows(expected, r.offset),
                        "offsets not dense: {} where {expected} was due",
                        r.offset
                    );
                    expected = r.offset + 1;
                    out.push(r);
                }
                // Having crossed a seal, the reader may already stand at the base of the
                // next segment.
                let at = reader.position();
                assert!(
                    jumps.allows(expected, at),
                    "reader position {at} disagrees with what it returned (next due {expected})"
                );
                // Now and then the reader lets its read window go, as a lane waiting on
                // its destination does: the next read goes on from the same record.
                if (at ^ max_bytes as u64) % 3 == 0 {
                    reader.release_buffer();
                    assert_eq!(reader.position(), at, "a released reader moved");
                }
            }
            Err(e) => {
                // A failed read hands back nothing, so it must consume nothing: a retry
                // (after a transient error) has to start at the first record not returned.
                let at = reader.position();
                if !known("reader-error-consumes-records") {
                    assert!(
                        jumps.allows(expected, at),
                        "a read that failed ({e}) moved the reader to {at}, past records it never returned (from {expected})"
                    );
                }
                return (out, Some(e));
            }
        }
    }
}

/// Findings already reported against the log, named in `FUZZ_KNOWN_FINDINGS`
/// (comma-separated), whose checks are skipped so that fuzzing can look past them while
/// they wait for a fix (`fuzz/README.md` lists the names). Unset, as in CI, every check
/// runs.
pub fn known(finding: &str) -> bool {
    static KNOWN: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    KNOWN
        .get_or_init(|| {
            std::env::var("FUZZ_KNOWN_FINDINGS")
                .unwrap_or_default()
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        })
        .iter()
        .any(|k| k == finding)
}

/// The names of the files in `dir`, sorted.
pub fn file_names(storage: &dyn wal::storage::Storage, dir: &Path) -> Vec<String> {
    let mut names = storage.list_dir(dir).unwrap_or_default();
    names.sort();
    names
}
