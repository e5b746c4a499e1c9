//! `open_arbitrary_dir`: opening a log directory built from arbitrary bytes.
//!
//! The input builds a directory on the simulated disk in one of two ways:
//! - **built**: a real log written through the API (segment size, offsets, batches, and
//!   how the writer ended: dropped, closed cleanly, released, or cut by a power loss at an
//!   arbitrary operation), so the fuzzer starts from valid, deep structure;
//! - **raw**: files given byte for byte, named like segments (anywhere in the offset
//!   space), like the clean-shutdown marker, or like leftover temporary files.
//!
//! Then a list of mutations damages it: bit flips, byte writes, truncation, appended or
//! zeroed bytes, deleted, renamed or copied segments, and edits that keep checksums valid
//! (a frame header field, a payload byte, a segment header field, a clean-shutdown marker
//! that disagrees with the tail), so damage reaches past the first checksum.
//!
//! The directory is then verified, listed, opened read-only and read to the end, opened
//! writable (strict, then salvage if strict refused) and read to the end, appended to,
//! closed and reopened. None of it may panic or hang; every refusal must be a clear error
//! of the right kind; and the answers must agree with each other:
//! - read-only inspection changes no byte on disk;
//! - whatever opens reads back with dense offsets (jumping only to a segment a salvage
//!   started past a gap) up to `next_offset()`;
//! - a read-only and a writable open see the same log, and `verify` finds damage exactly
//!   when opening refuses it;
//! - a log that opened (or was salvaged) takes an append at `next_offset()`, closes, and
//!   reopens strictly with the same records plus the new one;
//! - an undamaged built log holds every record whose append resolved.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use tokio::runtime::Runtime;
use wal::format::{
    CLEAN_MARKER_LEN, CleanMarker, FRAME_HEADER_LEN, FrameHeader, OFFSET_MAX, SEGMENT_HEADER_LEN, SegmentHeader,
    parse_segment_file_name, segment_file_name,
};
use wal::inspect::{self, VerifyProgress};
use wal::storage::{CrashMode, FaultOp, SimStorage, Storage};
use wal::{CLEAN_MARKER_FILE, Record, RecoveryMode, Wal, WalError, WalOptions};

use crate::{Input, Jumps, file_names, known, log_dir, payload, read_all};

/// Bounds that keep one execution fast.
pub const MAX_BATCHES: u8 = 16;
pub const MAX_MUTATIONS: u8 = 16;
pub const MAX_RAW_FILES: u8 = 6;
pub const MAX_RAW_FILE_BYTES: usize = 8 * 1024;

/// How the writer of a built log ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The handle was dropped: no clean-shutdown marker.
    Drop,
    /// `close()`: a clean-shutdown marker.
    Close,
    /// Power lost just before the `n`th mutating operation, keeping a seeded mix of
    /// whatever was not synced.
    CrashAt { n: u8, seed: u8 },
    /// `release_below` a position (0..=255 of the way through), then `close()`.
    ReleaseThenClose { at: u8 },
}

/// A log written through the API.
#[derive(Debug, Clone)]
pub struct Built {
    pub segment: u8,
    pub initial: u8,
    /// Record size codes, one list per batch.
    pub batches: Vec<Vec<u8>>,
    pub ending: Ending,
}

/// A file given byte for byte.
#[derive(Debug, Clone)]
pub struct RawFile {
    pub name: RawName,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Copy)]
pub enum RawName {
    /// A segment named by a small base offset.
    Segment(u16),
    /// A segment named near the end of the offset space.
    HighSegment(u8),
    CleanMarker,
    /// A leftover temporary file.
    Temp(u8),
}

/// One change to the directory. `file` picks a file (modulo the number present).
#[derive(Debug, Clone)]
pub enum Mutation {
    FlipBit {
        file: u8,
        pos: u16,
        bit: u8,
    },
    SetByte {
        file: u8,
        pos: u16,
        value: u8,
    },
    Truncate {
        file: u8,
        pos: u16,
    },
    AppendBytes {
        file: u8,
        bytes: Vec<u8>,
    },
    ZeroRange {
        file: u8,
        pos: u16,
        len: u16,
    },
    Delete {
        file: u8,
    },
    /// Renames a segment to the name of its base plus `delta`.
    Rename {
        file: u8,
        delta: i16,
    },
    /// Copies a segment to the name of its base plus `delta`.
    Copy {
        file: u8,
        delta: i16,
    },
    /// Sets a field of the `frame`th frame header, keeping the header checksum valid.
    FrameField {
        file: u8,
        frame: u8,
        field: u8,
        value: u64,
    },
    /// Changes a payload byte of the `frame`th frame, keeping both checksums valid.
    PayloadByte {
        file: u8,
        frame: u8,
        pos: u16,
        value: u8,
    },
    /// Rewrites a segment header field, keeping its checksum valid.
    SegmentHeaderField {
        file: u8,
        field: u8,
        value: u64,
    },
    /// Appends a copy of the `frame`th frame at the end of the file.
    DuplicateFrame {
        file: u8,
        frame: u8,
    },
    /// Writes a checked clean-shutdown marker for the last segment, off by the deltas.
    Marker {
        len_delta: i8,
        next_delta: i8,
        sealed: u8,
    },
}

#[derive(Debug, Clone)]
pub enum Image {
    Built(Built),
    Raw(Vec<RawFile>),
}

fn segment_max_bytes(code: u8) -> u64 {
    96 + u64::from(code) * 8
}

fn initial_offset(code: u8) -> u64 {
    match code % 4 {
        0 => 0,
        1 => u64::from(code) * 1000,
        2 => OFFSET_MAX - u64::from(code % 32),
        _ => u64::from(u32::MAX) - 4 + u64::from(code % 8),
    }
}

fn record_size(code: u8, segment: u64) -> usize {
    if code >= 250 { segment as usize + usize::from(code - 250) * 16 } else { usize::from(code) }
}

impl Mutation {
    fn decode(input: &mut Input<'_>) -> Mutation {
        let kind = input.u8() % 13;
        let file = input.u8();
        match kind {
            0 => Mutation::FlipBit { file, pos: input.u16(), bit: input.u8() },
            1 => Mutation::SetByte { file, pos: input.u16(), value: input.u8() },
            2 => Mutation::Truncate { file, pos: input.u16() },
            3 => {
                let n = usize::from(input.u8());
                Mutation::AppendBytes { file, bytes: input.bytes(n).to_vec() }
            }
            4 => Mutation::ZeroRange { file, pos: input.u16(), len: input.u16() },
            5 => Mutation::Delete { file },
            6 => Mutation::Rename { file, delta: input.u16() as i16 },
            7 => Mutation::Copy { file, delta: input.u16() as i16 },
            8 => Mutation::FrameField { file, frame: input.u8(), field: input.u8(), value: input.u64() },
            9 => Mutation::PayloadByte { file, frame: input.u8(), pos: input.u16(), value: input.u8() },
            10 => Mutation::SegmentHeaderField { file, field: input.u8(), value: input.u64() },
            11 => Mutation::DuplicateFrame { file, frame: input.u8() },
            _ => Mutation::Marker { len_delta: input.u8() as i8, next_delta: input.u8() as i8, sealed: input.u8() },
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Mutation::FlipBit { file, pos, bit } => {
                out.extend([0, *file]);
                out.extend(pos.to_le_bytes());
                out.push(*bit);
            }
            Mutation::SetByte { file, pos, value } => {
                out.extend([1, *file]);
                out.extend(pos.to_le_bytes());
                out.push(*value);
            }
            Mutation::Truncate { file, pos } => {
                out.extend([2, *file]);
                out.extend(pos.to_le_bytes());
            }
            Mutation::AppendBytes { file, bytes } => {
                let n = bytes.len().min(255);
                out.extend([3, *file, n as u8]);
                out.extend(&bytes[..n]);
            }
            Mutation::ZeroRange { file, pos, len } => {
                out.extend([4, *file]);
                out.extend(pos.to_le_bytes());
                out.extend(len.to_le_bytes());
            }
            Mutation::Delete { file } => out.extend([5, *file]),
            Mutation::Rename { file, delta } => {
                out.extend([6, *file]);
                out.extend(delta.to_le_bytes());
            }
            Mutation::Copy { file, delta } => {
                out.extend([7, *file]);
                out.extend(delta.to_le_bytes());
            }
            Mutation::FrameField { file, frame, field, value } => {
                out.extend([8, *file, *frame, *field]);
                out.extend(value.to_le_bytes());
            }
            Mutation::PayloadByte { file, frame, pos, value } => {
                out.extend([9, *file, *frame]);
                out.extend(pos.to_le_bytes());
                out.push(*value);
            }
            Mutation::SegmentHeaderField { file, field, value } => {
                out.extend([10, *file, *field]);
                out.extend(value.to_le_bytes());
            }
            Mutation::DuplicateFrame { file, frame } => out.extend([11, *file, *frame]),
            Mutation::Marker { len_delta, next_delta, sealed } => {
                // The decoder reads a file byte first; the marker ignores it.
                out.extend([12, 0, *len_delta as u8, *next_delta as u8, *sealed]);
            }
        }
    }
}

/// Decodes an input into an image, the mutations to apply and the segment size to open
/// with.
pub fn decode(data: &[u8]) -> (Image, Vec<Mutation>, u8) {
    let mut input = Input::new(data);
    let mode = input.u8();
    let segment = input.u8();
    let image = if mode.is_multiple_of(2) {
        let initial = input.u8();
        let batches = (0..input.u8() % (MAX_BATCHES + 1))
            .map(|_| {
                let n = 1 + input.u8() % 4;
                (0..n).map(|_| input.u8()).collect()
            })
            .collect();
        let ending = match input.u8() % 4 {
            0 => Ending::Drop,
            1 => Ending::Close,
            2 => Ending::CrashAt { n: input.u8(), seed: input.u8() },
            _ => Ending::ReleaseThenClose { at: input.u8() },
        };
        Image::Built(Built { segment, initial, batches, ending })
    } else {
        let files = (0..1 + input.u8() % MAX_RAW_FILES)
            .map(|_| {
                let name = match input.u8() % 4 {
                    0 => RawName::Segment(input.u16()),
                    1 => RawName::HighSegment(input.u8()),
                    2 => RawName::CleanMarker,
                    _ => RawName::Temp(input.u8()),
                };
                let len = usize::from(input.u16()) % (MAX_RAW_FILE_BYTES + 1);
                RawFile { name, bytes: input.bytes(len).to_vec() }
            })
            .collect();
        Image::Raw(files)
    };
    let count = input.u8() % (MAX_MUTATIONS + 1);
    let mut mutations = Vec::new();
    while mutations.len() < usize::from(count) && !input.is_empty() {
        mutations.push(Mutation::decode(&mut input));
    }
    (image, mutations, segment)
}

/// Encodes an image and mutations as an input [`decode`] turns back into them.
pub fn encode(image: &Image, mutations: &[Mutation]) -> Vec<u8> {
    let mut out = Vec::new();
    match image {
        Image::Built(b) => {
            out.extend([0, b.segment, b.initial, b.batches.len().min(MAX_BATCHES as usize) as u8]);
            for batch in b.batches.iter().take(MAX_BATCHES as usize) {
                out.push((batch.len().clamp(1, 4) - 1) as u8);
                out.extend(batch.iter().take(4));
            }
            match b.ending {
                Ending::Drop => out.push(0),
                Ending::Close => out.push(1),
                Ending::CrashAt { n, seed } => out.extend([2, n, seed]),
                Ending::ReleaseThenClose { at } => out.extend([3, at]),
            }
        }
        Image::Raw(files) => {
            // Raw images are opened with the smallest segment size code.
            out.extend([1, 0, (files.len().clamp(1, MAX_RAW_FILES as usize) - 1) as u8]);
            for f in files.iter().take(MAX_RAW_FILES as usize) {
                match f.name {
                    RawName::Segment(b) => {
                        out.push(0);
                        out.extend(b.to_le_bytes());
                    }
                    RawName::HighSegment(b) => out.extend([1, b]),
                    RawName::CleanMarker => out.push(2),
                    RawName::Temp(b) => out.extend([3, b]),
                }
                let n = f.bytes.len().min(MAX_RAW_FILE_BYTES);
                out.extend((n as u16).to_le_bytes());
                out.extend(&f.bytes[..n]);
            }
        }
    }
    out.push(mutations.len().min(MAX_MUTATIONS as usize) as u8);
    for m in mutations.iter().take(MAX_MUTATIONS as usize) {
        m.encode(&mut out);
    }
    out
}

fn storage(sim: &SimStorage) -> Arc<dyn Storage> {
    Arc::new(sim.clone())
}

/// What building a log through the API promised: records at or above `floor` whose
/// append resolved.
struct Promised {
    records: Vec<(u64, Bytes)>,
    floor: u64,
    crashed: bool,
}

/// Writes a real log; returns what it promised.
fn build(sim: &SimStorage, runtime: &Runtime, b: &Built) -> Promised {
    let segment = segment_max_bytes(b.segment);
    let options = WalOptions {
        segment_max_bytes: segment,
        max_bytes: 1 << 30,
        initial_offset: initial_offset(b.initial),
        ..WalOptions::default()
    };
    let wal = Wal::open_with(storage(sim), &log_dir(), options).expect("a new log opens on an empty disk");
    let mut promised = Promised { records: Vec::new(), floor: 0, crashed: false };
    if let Ending::CrashAt { n, seed } = b.ending {
        sim.crash_at_nth(FaultOp::AnyMutation, 1 + u64::from(n % 64), CrashMode::Adversarial { seed: u64::from(seed) });
        promised.crashed = true;
    }
    let mut tag = 1;
    runtime.block_on(async {
        for sizes in &b.batches {
            let batch: Vec<Bytes> = sizes
                .iter()
                .map(|&c| {
                    tag += 1;
                    payload(tag, record_size(c, segment))
                })
                .collect();
            if let Ok(a) = wal.append(batch.clone()).await {
                for (i, p) in batch.into_iter().enumerate() {
                    promised.records.push((a.first_offset + i as u64, p));
                }
            }
        }
        match b.ending {
            Ending::Close => {
                let _ = wal.close().await;
            }
            Ending::ReleaseThenClose { at } => {
                let (start, next) = (wal.start_offset(), wal.next_offset());
                let below = start + (next - start) * u64::from(at) / 255;
                if let Ok(r) = wal.release_below(below).await {
                    // Exactly what was asked: the floor is not taken from the log's own
                    // answer, which would excuse a release that went too far.
                    let asked = start.max(below.min(next));
                    assert_eq!(
                        r.start, asked,
                        "release below {below} (log {start}..{next}) left the start at {}",
                        r.start
                    );
                    promised.floor = asked;
                }
                let _ = wal.close().await;
            }
            Ending::Drop | Ending::CrashAt { .. } => {}
        }
    });
    drop(wal);
    sim.disarm();
    promised
}

fn write_raw(sim: &SimStorage, files: &[RawFile]) {
    let dir = log_dir();
    for f in files {
        let name = match f.name {
            RawName::Segment(b) => segment_file_name(u64::from(b)),
            RawName::HighSegment(b) => segment_file_name(u64::MAX - u64::from(b % 4) * 1000 - u64::from(b / 4)),
            RawName::CleanMarker => CLEAN_MARKER_FILE.to_string(),
            RawName::Temp(b) => format!("{}.tmp", segment_file_name(u64::from(b))),
        };
        sim.write_file_durably(&dir.join(name), &f.bytes).expect("write a file of the image");
    }
}

/// The frames of a segment image that decode, with their positions (stops at the first
/// that does not).
fn frames(bytes: &[u8]) -> Vec<(usize, FrameHeader)> {
    let mut out = Vec::new();
    let mut pos = SEGMENT_HEADER_LEN as usize;
    while let Some(b) = bytes.get(pos..pos + FRAME_HEADER_LEN as usize) {
        let Ok(h) = FrameHeader::decode(b) else { break };
        out.push((pos, h));
        pos = pos.saturating_add(h.frame_len() as usize);
    }
    out
}

fn pick<T>(items: &[T], code: u8) -> Option<&T> {
    if items.is_empty() { None } else { items.get(usize::from(code) % items.len()) }
}

fn apply(sim: &SimStorage, m: &Mutation) {
    let dir = log_dir();
    let names = file_names(sim, &dir);
    let file = match m {
        Mutation::FlipBit { file, .. }
        | Mutation::SetByte { file, .. }
        | Mutation::Truncate { file, .. }
        | Mutation::AppendBytes { file, .. }
        | Mutation::ZeroRange { file, .. }
        | Mutation::Delete { file }
        | Mutation::Rename { file, .. }
        | Mutation::Copy { file, .. }
        | Mutation::FrameField { file, .. }
        | Mutation::PayloadByte { file, .. }
        | Mutation::SegmentHeaderField { file, .. }
        | Mutation::DuplicateFrame { file, .. } => *file,
        Mutation::Marker { .. } => 0,
    };
    let Some(name) = pick(&names, file).cloned() else { return };
    let path = dir.join(&name);
    let mut bytes = sim.read_file(&path).expect("a listed file reads");
    let at = |pos: u16, len: usize| if len == 0 { 0 } else { usize::from(pos) % len };
    match m {
        Mutation::FlipBit { pos, bit, .. } => {
            if !bytes.is_empty() {
                let i = at(*pos, bytes.len());
                bytes[i] ^= 1 << (bit % 8);
            }
        }
        Mutation::SetByte { pos, value, .. } => {
            if !bytes.is_empty() {
                let i = at(*pos, bytes.len());
                bytes[i] = *value;
            }
        }
        Mutation::Truncate { pos, .. } => bytes.truncate(at(*pos, bytes.len() + 1)),
        Mutation::AppendBytes { bytes: extra, .. } => bytes.extend_from_slice(extra),
        Mutation::ZeroRange { pos, len, .. } => {
            let from = at(*pos, bytes.len() + 1);
            let to = from.saturating_add(usize::from(*len % 2048)).min(bytes.len());
            bytes[from..to].fill(0);
        }
        Mutation::Delete { .. } => {
            let _ = sim.remove_file(&path);
            let _ = sim.sync_dir(&dir);
            return;
        }
        Mutation::Rename { delta, .. } | Mutation::Copy { delta, .. } => {
            let base = parse_segment_file_name(&name).unwrap_or(0);
            let to = dir.join(segment_file_name(base.wrapping_add_signed(i64::from(*delta))));
            if matches!(m, Mutation::Rename { .. }) {
                let _ = sim.remove_file(&path);
                let _ = sim.sync_dir(&dir);
            }
            sim.write_file_durably(&to, &bytes).expect("write a renamed or copied file");
            return;
        }
        Mutation::FrameField { frame, field, value, .. } => {
            let Some(&(pos, mut h)) = pick(&frames(&bytes), *frame) else { return };
            match field % 5 {
                0 => h.payload_len = *value as u32,
                // With `scan-offset-overflow` known, keep record offsets in range so
                // fuzzing can look past the scan's overflow on a record at u64::MAX.
                1 if known("scan-offset-overflow") && !h.is_seal() => h.offset = (*value).min(OFFSET_MAX),
                1 => h.offset = *value,
                2 => h.synced_len = *value,
                3 => h.flags = *value as u32,
                _ => h.payload_crc = *value as u32,
            }
            bytes[pos..pos + FRAME_HEADER_LEN as usize].copy_from_slice(&h.encode());
        }
        Mutation::PayloadByte { frame, pos: p, value, .. } => {
            let Some(&(pos, mut h)) = pick(&frames(&bytes), *frame) else { return };
            let start = pos + FRAME_HEADER_LEN as usize;
            let end = (start + h.payload_len as usize).min(bytes.len());
            if end > start {
                let i = start + at(*p, end - start);
                bytes[i] = *value;
                h.payload_crc = crc32fast::hash(&bytes[start..end]);
                bytes[pos..pos + FRAME_HEADER_LEN as usize].copy_from_slice(&h.encode());
            }
        }
        Mutation::SegmentHeaderField { field, value, .. } => {
            let base = parse_segment_file_name(&name).unwrap_or(0);
            let mut h = SegmentHeader::decode(&bytes).unwrap_or(SegmentHeader { base_offset: base, flags: 0 });
            match field % 3 {
                0 => h.base_offset = *value,
                1 => h.flags = *value as u32,
                // A whole, valid header where there was none (or a damaged one).
                _ => {}
            }
            let encoded = h.encode();
            if bytes.len() < encoded.len() {
                bytes.resize(encoded.len(), 0);
            }
            bytes[..encoded.len()].copy_from_slice(&encoded);
        }
        Mutation::DuplicateFrame { frame, .. } => {
            let Some(&(pos, h)) = pick(&frames(&bytes), *frame) else { return };
            let end = (pos + h.frame_len() as usize).min(bytes.len());
            let copy = bytes[pos..end].to_vec();
            bytes.extend_from_slice(&copy);
        }
        Mutation::Marker { len_delta, next_delta, sealed } => {
            let Some(tail) = names.iter().rfind(|n| parse_segment_file_name(n).is_some()) else {
                return;
            };
            let tail_base = parse_segment_file_name(tail).unwrap_or(0);
            let tail_bytes = sim.read_file(&dir.join(tail)).expect("a listed file reads");
            let fs = frames(&tail_bytes);
            let next_offset =
                fs.iter().filter(|(_, h)| !h.is_seal()).map(|(_, h)| h.offset + 1).max().unwrap_or(tail_base);
            let marker = CleanMarker {
                tail_base,
                tail_len: (tail_bytes.len() as u64).wrapping_add_signed(i64::from(*len_delta)),
                next_offset: next_offset.wrapping_add_signed(i64::from(*next_delta)),
                tail_sealed: *sealed % 2 == 1,
            };
            let encoded = marker.encode();
            debug_assert_eq!(encoded.len(), CLEAN_MARKER_LEN);
            sim.write_file_durably(&dir.join(CLEAN_MARKER_FILE), &encoded).expect("write the marker");
            return;
        }
    }
    sim.write_file_durably(&path, &bytes).expect("write a mutated file");
}

/// What a scan of a segment image finds: where its whole batches end, the offset after
/// them, and the seal's offset if it ends in one. The oracle's own, small version of the
/// log's tail scan, used only to tell whether a clean-shutdown marker tells the truth.
fn scan_image(bytes: &[u8], base: u64) -> (usize, u64, Option<u64>) {
    let (mut pos, mut expected) = (SEGMENT_HEADER_LEN as usize, base);
    let (mut valid_end, mut next) = (pos, base);
    while let Some(b) = bytes.get(pos..pos + FRAME_HEADER_LEN as usize) {
        let Ok(h) = FrameHeader::decode(b) else { break };
        if h.offset != expected {
            break;
        }
        if h.is_seal() {
            // A seal ends a segment of records: one at its base is damage.
            if next != expected || h.offset <= base {
                break;
            }
            let end = pos + FRAME_HEADER_LEN as usize;
            return (end, next, if end == bytes.len() { Some(h.offset) } else { None });
        }
        let start = pos + FRAME_HEADER_LEN as usize;
        let Some(payload) = bytes.get(start..start + h.payload_len as usize) else { break };
        if h.check_payload(payload).is_err() {
            break;
        }
        pos = start + payload.len();
        expected += 1;
        if h.ends_batch() {
            (valid_end, next) = (pos, expected);
        }
    }
    (valid_end, next, None)
}

/// What the clean-shutdown marker says about the directory as it is now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MarkerState {
    /// No marker the log would use: none, unchecked, or not about the current tail.
    Unused,
    /// A checked marker for the current tail, which the log trusts instead of scanning.
    /// `intact`: the tail scans cleanly to the length the marker vouches for;
    /// `truthful`: and it ends where the marker says, sealed as it says.
    Trusted { intact: bool, truthful: bool },
}

fn marker_state(sim: &SimStorage, dir: &Path) -> MarkerState {
    let Ok(bytes) = sim.read_file(&dir.join(CLEAN_MARKER_FILE)) else { return MarkerState::Unused };
    let Some(m) = CleanMarker::decode(&bytes) else { return MarkerState::Unused };
    let names = file_names(sim, dir);
    let Some(tail) = names.iter().filter_map(|n| parse_segment_file_name(n)).max() else {
        return MarkerState::Unused;
    };
    let Ok(image) = sim.read_file(&dir.join(segment_file_name(tail))) else { return MarkerState::Unused };
    if m.tail_base != tail || m.tail_len != image.len() as u64 {
        return MarkerState::Unused;
    }
    let (valid_end, next, sealed) = scan_image(&image, tail);
    let intact = valid_end == image.len();
    let truthful = intact && m.next_offset == sealed.unwrap_or(next) && m.tail_sealed == sealed.is_some();
    MarkerState::Trusted { intact, truthful }
}

/// Every file of the directory with its bytes: what read-only access must not change.
fn snapshot(sim: &SimStorage, dir: &Path) -> Vec<(String, Vec<u8>)> {
    file_names(sim, dir)
        .into_iter()
        .map(|n| {
            let bytes = sim.read_file(&dir.join(&n)).expect("a listed file reads");
            (n, bytes)
        })
        .collect()
}

/// The bases of segments a salvage started past a gap.
fn gap_bases(sim: &SimStorage, dir: &Path) -> Vec<u64> {
    match inspect::list_segments(storage(sim), dir) {
        Ok(segments) => segments.iter().filter(|s| s.gap_before).map(|s| s.base_offset).collect(),
        Err(_) => Vec::new(),
    }
}

/// A finished read of a whole log: its records, or the error that stopped it.
struct ReadBack {
    start: u64,
    next: u64,
    records: Vec<Record>,
    error: Option<WalError>,
}

/// Reads an open log to its end and checks what can be checked of any log. `lenient`:
/// the log was opened on a clean-shutdown marker that lies about its tail, so it may skip
/// offsets and end elsewhere; errors must still be clear.
fn read_back(wal: &Wal, gaps: &[u64], lenient: bool) -> ReadBack {
    let (start, next) = (wal.start_offset(), wal.next_offset());
    assert!(start <= next, "start {start} past the end {next}");
    let jumps = if lenient { Jumps::Any } else { Jumps::ToGapBases(gaps) };
    let (records, error) = read_all(wal, start, 64, 4096, jumps);
    if let Some(r) = records.iter().find(|r| r.offset >= next) {
        panic!("a reader returned offset {} at or past the log's end {next}", r.offset);
    }
    if let Some(e) = &error {
        assert!(e.is_corruption(), "reading a log that opened failed with something other than damage: {e}");
        assert!(!e.to_string().is_empty());
    } else if !lenient {
        // The log ends after its last record, or at the base of an empty segment a
        // salvage started past a gap.
        let end = records.last().map_or(start, |r| r.offset + 1);
        assert!(end == next || (end < next && gaps.contains(&next)), "the records end at {end}, the log at {next}");
        if gaps.is_empty() {
            assert_eq!(records.len() as u64, next - start, "read {} records from {start} to {next}", records.len());
        }
    }
    ReadBack { start, next, records, error }
}

fn options(segment: u8, recovery: RecoveryMode) -> WalOptions {
    WalOptions { segment_max_bytes: segment_max_bytes(segment), max_bytes: 1 << 30, recovery, ..WalOptions::default() }
}

/// How a log came to be open, for the checks after it.
struct Opened<'a> {
    /// "strict", or the damage a salvage dealt with.
    how: &'a str,
    /// The open trusted a clean-shutdown marker that lies about the tail: what it built
    /// on that lie need not reopen (it must still fail with a clear error).
    trusted_a_lie: bool,
}

/// Appends one record to a log that opened, closes it, reopens it strictly and checks
/// the records are the same plus the new one.
fn append_close_reopen(sim: &SimStorage, runtime: &Runtime, wal: Wal, before: &ReadBack, segment: u8, opened: Opened) {
    let how = opened.how;
    let dir = log_dir();
    let extra = payload(u64::MAX, 100);
    let appended = runtime.block_on(wal.append(vec![extra.clone()]));
    let grew = match appended {
        Ok(a) => {
            assert_eq!(a.first_offset, before.next, "an append after recovery landed at {}", a.first_offset);
            true
        }
        Err(WalError::OffsetsExhausted { next, .. }) => {
            assert_eq!(next, before.next);
            assert!(next > OFFSET_MAX, "offsets exhausted at {next}");
            false
        }
        // Built on a lie, the log may refuse (it must not panic, and it must say why).
        Err(e) if opened.trusted_a_lie => {
            assert!(!e.to_string().is_empty());
            return;
        }
        Err(e) => panic!("a log that opened ({how}) refused an append: {e}"),
    };
    runtime.block_on(wal.close()).expect("a log that opened closes");
    drop(wal);
    let wal = match Wal::open_with(storage(sim), &dir, options(segment, RecoveryMode::Strict)) {
        Ok(w) => w,
        Err(e) if opened.trusted_a_lie => {
            assert!(e.is_corruption(), "reopening after a lying marker failed with something other than damage: {e}");
            return;
        }
        Err(e) => panic!("a log that opened ({how}), took an append and closed does not reopen: {e}"),
    };
    assert!(wal.open_report().clean_shutdown, "a clean close was not recognised");
    let after = read_back(&wal, &gap_bases(sim, &dir), opened.trusted_a_lie);
    if opened.trusted_a_lie {
        // What the log built on the lie (here, say, an offset written twice) is not
        // held against it; only clear errors are.
        return;
    }
    assert_eq!(after.next, before.next + u64::from(grew), "the end moved across a clean close");
    if before.error.is_none() {
        // A log that read back whole before its append, close and reopen reads back
        // whole after them, from the same start.
        assert!(
            after.error.is_none(),
            "a log that read back whole does not after an append, a close and a reopen: {:?}",
            after.error
        );
        assert_eq!(after.start, before.start, "the start moved across an append, a close and a reopen");
        let mut expected: Vec<_> = before.records.iter().map(|r| (r.offset, r.payload.clone())).collect();
        if grew {
            expected.push((before.next, extra));
        }
        let got: Vec<_> = after.records.iter().map(|r| (r.offset, r.payload.clone())).collect();
        assert_eq!(got, expected, "records changed across an append, a close and a reopen");
    }
}

/// Builds the image on `sim` and applies the mutations: the directory the checks run on.
pub fn prepare(sim: &SimStorage, image: &Image, mutations: &[Mutation]) {
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a current-thread runtime");
    prepare_with(sim, &runtime, image, mutations);
}

fn prepare_with(sim: &SimStorage, runtime: &Runtime, image: &Image, mutations: &[Mutation]) -> Option<Promised> {
    // Durably, as the log itself creates it: an image whose directory a power loss can
    // take away would lose every record the build promised.
    wal::storage::create_dir_all_durably(sim, &log_dir()).expect("create the log directory");
    let promised = match image {
        Image::Built(b) => Some(build(sim, runtime, b)),
        Image::Raw(files) => {
            write_raw(sim, files);
            None
        }
    };
    for m in mutations {
        apply(sim, m);
    }
    promised
}

/// Builds the directory from the input and runs every check.
pub fn run(data: &[u8]) {
    let (image, mutations, segment) = decode(data);
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a current-thread runtime");
    let sim = SimStorage::new();
    let dir = log_dir();
    let promised = prepare_with(&sim, &runtime, &image, &mutations);
    // A checked marker that lies about the tail is trusted by design (the log only
    // writes true ones): such an image is held to "no panic, no hang, clear errors" and
    // to the checks that do not depend on the tail's content.
    let marker = marker_state(&sim, &dir);
    let consistent = matches!(marker, MarkerState::Unused | MarkerState::Trusted { truthful: true, .. });

    // Read-only inspection: no panic, and not one byte changed.
    let before = snapshot(&sim, &dir);
    let mut last_done = 0;
    let verified = inspect::verify(&sim, &dir, &mut |p: VerifyProgress| {
        assert!(p.bytes_done <= p.bytes_total, "progress {} of {}", p.bytes_done, p.bytes_total);
        assert!(p.bytes_done >= last_done, "progress went backwards");
        last_done = p.bytes_done;
    });
    let _ = inspect::list_segments(storage(&sim), &dir);
    let gaps = gap_bases(&sim, &dir);
    let read_only = Wal::open_read_only_with(storage(&sim), &dir);
    let ro = match &read_only {
        Ok(wal) => {
            let refused = runtime.block_on(wal.append(vec![Bytes::from_static(b"x")]));
            assert!(matches!(refused, Err(WalError::ReadOnly)), "a read-only log took an append: {refused:?}");
            Some(read_back(wal, &gaps, !consistent))
        }
        Err(e) => {
            assert!(
                e.is_corruption() || matches!(e, WalError::NotALog(_)),
                "read-only open refused with something other than damage: {e}"
            );
            None
        }
    };
    drop(read_only);
    assert!(snapshot(&sim, &dir) == before, "read-only inspection changed the directory");

    if let Ok(report) = &verified {
        if consistent {
            match &ro {
                Some(ro) if report.is_clean() => {
                    assert!(ro.error.is_none(), "verify found no damage, reading found some: {:?}", ro.error);
                }
                None if report.segments > 0 => {
                    assert!(!report.is_clean(), "the read-only open refused a log verify found clean");
                }
                _ => {}
            }
        }
        // Bytes a checked clean-shutdown marker vouches for were durable: a frame in them
        // that does not check is damage, not a torn write.
        if marker == (MarkerState::Trusted { intact: false, truthful: false }) && !known("verify-closed-tail") {
            assert!(
                !report.is_clean(),
                "verify calls damage inside a cleanly closed tail a torn tail: {:?}",
                report.torn_tail
            );
        }
    }

    // An undamaged built log holds every record it promised.
    if let Some(p) = &promised
        && mutations.is_empty()
        && !p.crashed
    {
        let ro = ro.as_ref().expect("an undamaged log opens read-only");
        assert!(ro.error.is_none(), "an undamaged log does not read back: {:?}", ro.error);
        let got: Vec<_> =
            ro.records.iter().filter(|r| r.offset >= p.floor).map(|r| (r.offset, r.payload.clone())).collect();
        let want: Vec<_> = p.records.iter().filter(|(o, _)| *o >= p.floor).cloned().collect();
        assert_eq!(got, want, "an undamaged log does not hold what its appends promised");
    }

    // Writable, strict.
    match Wal::open_with(storage(&sim), &dir, options(segment, RecoveryMode::Strict)) {
        Ok(wal) => {
            let rw = read_back(&wal, &gap_bases(&sim, &dir), !consistent);
            if consistent && let Some(ro) = &ro {
                assert_eq!((rw.start, rw.next), (ro.start, ro.next), "read-only and writable opens disagree");
                if ro.error.is_none() {
                    assert!(
                        rw.error.is_none(),
                        "the read-only open read back whole, the writable one not: {:?}",
                        rw.error
                    );
                    assert!(rw.records == ro.records, "read-only and writable opens read different records");
                }
            }
            if !consistent && known("lying-marker-writer-panic") {
                return;
            }
            let opened = Opened { how: "strict", trusted_a_lie: !consistent };
            append_close_reopen(&sim, &runtime, wal, &rw, segment, opened);
        }
        Err(e) => {
            assert!(e.is_corruption(), "a writable open refused with something other than damage: {e}");
            if consistent {
                assert!(ro.is_none(), "the read-only open took a log the writable open refused: {e}");
            }
            // Salvage keeps what it can and must always produce a log that opens.
            let wal = match Wal::open_with(storage(&sim), &dir, options(segment, RecoveryMode::Salvage)) {
                Ok(w) => w,
                Err(e2) => panic!("salvage failed on a log strict recovery refused ({e}): {e2}"),
            };
            let Some(salvage) = wal.open_report().salvage.clone() else {
                panic!("a salvage open of a damaged log reported no salvage");
            };
            // No offset the kept records hold may be handed out again.
            if salvage.resumed_at_offset < salvage.kept_until_offset {
                assert!(
                    known("salvage-resume-below-kept"),
                    "salvage resumed at {} below the offsets it kept (to {}): {salvage:?}",
                    salvage.resumed_at_offset,
                    salvage.kept_until_offset
                );
                return;
            }
            if matches!(e, WalError::BadSegmentHeader { .. }) && known("salvage-after-bad-header") {
                return;
            }
            let rw = read_back(&wal, &gap_bases(&sim, &dir), !consistent);
            let how = format!("salvaged after: {e}");
            append_close_reopen(&sim, &runtime, wal, &rw, segment, Opened { how: &how, trusted_a_lie: !consistent });
        }
    }
}
