//! The on-disk format: segment headers, record frames, the clean-shutdown marker.
//!
//! Everything here is pure: bytes in, typed values or a typed reason out. The layout is
//! documented byte by byte in `crates/wal/FORMAT.md`; a change here is a change there and
//! a new [`FORMAT_VERSION`].
//!
//! Invariants:
//! - All integers are little-endian.
//! - A frame header is trusted only after its own CRC checked: a torn or flipped length
//!   is never used to size a read or to skip bytes.
//! - A payload is trusted only after its CRC checked; the header CRC covers the payload
//!   CRC, so one header check plus one payload check covers every byte of a frame.

/// First eight bytes of every segment file.
pub const SEGMENT_MAGIC: [u8; 8] = *b"IIWALSEG";
/// First eight bytes of the clean-shutdown marker.
pub const CLEAN_MAGIC: [u8; 8] = *b"IIWALCLN";
/// The durable watermark's magic.
pub const WATERMARK_MAGIC: [u8; 8] = *b"IIWALDWM";
/// Length of the durable watermark record.
pub const WATERMARK_LEN: usize = 40;
/// The format this code writes and the only one it reads.
pub const FORMAT_VERSION: u32 = 1;
/// Length of the segment header at byte 0 of every segment.
pub const SEGMENT_HEADER_LEN: u64 = 32;
/// Length of every frame header (records and seals alike).
pub const FRAME_HEADER_LEN: u64 = 32;
/// Length of a seal frame (a header with an empty payload).
pub const SEAL_LEN: u64 = FRAME_HEADER_LEN;
/// Length of the clean-shutdown marker file.
pub const CLEAN_MARKER_LEN: usize = 40;
/// The largest payload a frame can describe. 64 MiB: large enough for any webhook body
/// the door accepts (whose own limit is far lower), small enough that a reader can always
/// hold one record in memory. The configured `record_max_bytes` may only lower it.
pub const RECORD_MAX_BYTES: u32 = 64 * 1024 * 1024;
/// The largest offset a record can carry. `u64::MAX` is kept free so that "the offset
/// after the last record" is always representable.
pub const OFFSET_MAX: u64 = u64::MAX - 1;

/// Frame flag: this record closes an appended batch. Recovery keeps whole batches only.
pub const FLAG_END_OF_BATCH: u32 = 1;
/// Frame flag: this frame seals the segment. Its `offset` is the first offset of the next
/// segment and nothing may follow it in the file.
pub const FLAG_SEAL: u32 = 2;
const FLAGS_KNOWN: u32 = FLAG_END_OF_BATCH | FLAG_SEAL;

/// Segment header flag: offsets below this segment's base may be missing because an
/// operator salvaged a damaged log. Without it, a segment must start exactly where its
/// predecessor's seal says.
pub const SEGMENT_FLAG_GAP_BEFORE: u32 = 1;

/// The decoded segment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    pub base_offset: u64,
    pub flags: u32,
}

/// Why a segment header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderProblem {
    TooShort,
    BadMagic,
    BadChecksum,
    UnsupportedVersion(u32),
    UnknownFlags(u32),
    /// The reserved bytes 24..28 are not zero (this build writes zero).
    ReservedNotZero(u32),
    /// The header's base offset is not the one the file name says.
    BaseMismatch {
        name: u64,
        header: u64,
    },
}

impl HeaderProblem {
    /// The header checks and says another format version wrote the segment (a newer
    /// build, before a rollback): not damage, and nothing this build may salvage.
    pub fn is_other_version(&self) -> bool {
        matches!(self, HeaderProblem::UnsupportedVersion(_))
    }
}

impl std::fmt::Display for HeaderProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeaderProblem::TooShort => write!(f, "segment header is shorter than 32 bytes"),
            HeaderProblem::BadMagic => write!(f, "not a segment (bad magic)"),
            HeaderProblem::BadChecksum => write!(f, "segment header checksum mismatch"),
            HeaderProblem::UnsupportedVersion(v) => {
                write!(f, "segment format version {v}, this build reads version {FORMAT_VERSION}")
            }
            HeaderProblem::UnknownFlags(v) => write!(f, "unknown segment header flags {v:#x}"),
            HeaderProblem::ReservedNotZero(v) => write!(f, "segment header reserved bytes are {v:#x}, not zero"),
            HeaderProblem::BaseMismatch { name, header } => {
                write!(f, "file name says base offset {name}, header says {header}")
            }
        }
    }
}

impl SegmentHeader {
    pub fn encode(&self) -> [u8; SEGMENT_HEADER_LEN as usize] {
        let mut b = [0u8; SEGMENT_HEADER_LEN as usize];
        b[0..8].copy_from_slice(&SEGMENT_MAGIC);
        b[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.flags.to_le_bytes());
        b[16..24].copy_from_slice(&self.base_offset.to_le_bytes());
        // 24..28 reserved, zero.
        let crc = crc32fast::hash(&b[0..28]);
        b[28..32].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<SegmentHeader, HeaderProblem> {
        if b.len() < SEGMENT_HEADER_LEN as usize {
            return Err(HeaderProblem::TooShort);
        }
        if b[0..8] != SEGMENT_MAGIC {
            return Err(HeaderProblem::BadMagic);
        }
        // The checksum first: a version field that does not check is damage, not a newer
        // format (one flipped bit must not make a damaged log look unsalvageable).
        if crc32fast::hash(&b[0..28]) != le_u32(&b[28..32]) {
            return Err(HeaderProblem::BadChecksum);
        }
        let version = le_u32(&b[8..12]);
        if version != FORMAT_VERSION {
            return Err(HeaderProblem::UnsupportedVersion(version));
        }
        let flags = le_u32(&b[12..16]);
        if flags & !SEGMENT_FLAG_GAP_BEFORE != 0 {
            return Err(HeaderProblem::UnknownFlags(flags));
        }
        let reserved = le_u32(&b[24..28]);
        if reserved != 0 {
            return Err(HeaderProblem::ReservedNotZero(reserved));
        }
        Ok(SegmentHeader { base_offset: le_u64(&b[16..24]), flags })
    }
}

/// The decoded header of a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    pub payload_len: u32,
    pub offset: u64,
    /// The segment's durable length when this frame was written. A frame is always
    /// written at or after that position; recovery uses it to tell a torn unsynced tail
    /// from damage to bytes that were already durable.
    pub synced_len: u64,
    pub flags: u32,
    pub payload_crc: u32,
}

/// Why a frame header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameProblem {
    /// Fewer than 32 bytes remain in the file.
    Truncated,
    BadHeaderChecksum,
    UnknownFlags(u32),
    /// The header checked, but describes a payload larger than [`RECORD_MAX_BYTES`] or a
    /// seal with a payload.
    BadLength(u32),
    /// The header checked, but its payload runs past the end of the file.
    PayloadTruncated,
    BadPayloadChecksum,
    /// The header checked, but its offset is not the one the sequence requires.
    UnexpectedOffset {
        expected: u64,
        found: u64,
    },
    /// A seal frame before the end of the batch it follows (after `records` of its
    /// records): the writer seals only after whole batches.
    SealInsideBatch {
        records: u64,
    },
    /// Bytes follow a seal frame.
    DataAfterSeal,
    /// A segment that has a successor does not end in a seal.
    MissingSeal,
    /// Bytes known to be durable (a tail closed cleanly, or within a live writer's
    /// watermark) end inside a batch, after `records` of its records: the writer syncs
    /// only whole batches.
    UnfinishedBatch {
        records: u64,
    },
}

impl std::fmt::Display for FrameProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameProblem::Truncated => write!(f, "frame header cut short by the end of the file"),
            FrameProblem::BadHeaderChecksum => write!(f, "frame header checksum mismatch"),
            FrameProblem::UnknownFlags(v) => write!(f, "unknown frame flags {v:#x}"),
            FrameProblem::BadLength(n) => write!(f, "impossible payload length {n}"),
            FrameProblem::PayloadTruncated => write!(f, "payload cut short by the end of the file"),
            FrameProblem::BadPayloadChecksum => write!(f, "payload checksum mismatch"),
            FrameProblem::UnexpectedOffset { expected, found } => {
                write!(f, "offset {found} where {expected} was expected")
            }
            FrameProblem::SealInsideBatch { records } => {
                write!(f, "a seal inside an unfinished batch (after {records} of its records)")
            }
            FrameProblem::DataAfterSeal => write!(f, "bytes after the segment's seal"),
            FrameProblem::MissingSeal => write!(f, "segment has a successor but no seal"),
            FrameProblem::UnfinishedBatch { records } => {
                write!(
                    f,
                    "a batch without its last record (after {records} of its records) in bytes known to be durable"
                )
            }
        }
    }
}

impl FrameHeader {
    pub fn is_seal(&self) -> bool {
        self.flags & FLAG_SEAL != 0
    }

    pub fn ends_batch(&self) -> bool {
        self.flags & FLAG_END_OF_BATCH != 0
    }

    /// Bytes this frame occupies on disk.
    pub fn frame_len(&self) -> u64 {
        FRAME_HEADER_LEN + u64::from(self.payload_len)
    }

    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN as usize] {
        let mut b = [0u8; FRAME_HEADER_LEN as usize];
        b[4..8].copy_from_slice(&self.payload_len.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.synced_len.to_le_bytes());
        b[24..28].copy_from_slice(&self.flags.to_le_bytes());
        b[28..32].copy_from_slice(&self.payload_crc.to_le_bytes());
        let crc = crc32fast::hash(&b[4..32]);
        b[0..4].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and checks a frame header. Only a header that passes is ever used to size
    /// a read.
    pub fn decode(b: &[u8]) -> Result<FrameHeader, FrameProblem> {
        if b.len() < FRAME_HEADER_LEN as usize {
            return Err(FrameProblem::Truncated);
        }
        if crc32fast::hash(&b[4..32]) != le_u32(&b[0..4]) {
            return Err(FrameProblem::BadHeaderChecksum);
        }
        let h = FrameHeader {
            payload_len: le_u32(&b[4..8]),
            offset: le_u64(&b[8..16]),
            synced_len: le_u64(&b[16..24]),
            flags: le_u32(&b[24..28]),
            payload_crc: le_u32(&b[28..32]),
        };
        if h.flags & !FLAGS_KNOWN != 0 || h.flags == FLAGS_KNOWN {
            return Err(FrameProblem::UnknownFlags(h.flags));
        }
        if h.payload_len > RECORD_MAX_BYTES || (h.is_seal() && h.payload_len != 0) {
            return Err(FrameProblem::BadLength(h.payload_len));
        }
        Ok(h)
    }

    /// Checks a payload against this header.
    pub fn check_payload(&self, payload: &[u8]) -> Result<(), FrameProblem> {
        if crc32fast::hash(payload) != self.payload_crc {
            return Err(FrameProblem::BadPayloadChecksum);
        }
        Ok(())
    }

    /// A seal frame whose offset is the first offset of the next segment.
    pub fn seal(next_offset: u64, synced_len: u64) -> FrameHeader {
        FrameHeader {
            payload_len: 0,
            offset: next_offset,
            synced_len,
            flags: FLAG_SEAL,
            payload_crc: crc32fast::hash(&[]),
        }
    }
}

/// The clean-shutdown marker: written after the last sync of an orderly close, removed
/// (and the removal made durable) before a writer appends again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CleanMarker {
    pub tail_base: u64,
    pub tail_len: u64,
    pub next_offset: u64,
    pub tail_sealed: bool,
}

impl CleanMarker {
    pub fn encode(&self) -> [u8; CLEAN_MARKER_LEN] {
        let mut b = [0u8; CLEAN_MARKER_LEN];
        b[0..8].copy_from_slice(&CLEAN_MAGIC);
        b[8..16].copy_from_slice(&self.tail_base.to_le_bytes());
        b[16..24].copy_from_slice(&self.tail_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.next_offset.to_le_bytes());
        b[32..36].copy_from_slice(&u32::from(self.tail_sealed).to_le_bytes());
        let crc = crc32fast::hash(&b[0..36]);
        b[36..40].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// `None` for anything that is not a whole, checked marker: a marker that cannot be
    /// trusted only costs a scan.
    pub fn decode(b: &[u8]) -> Option<CleanMarker> {
        if b.len() != CLEAN_MARKER_LEN || b[0..8] != CLEAN_MAGIC {
            return None;
        }
        if crc32fast::hash(&b[0..36]) != le_u32(&b[36..40]) {
            return None;
        }
        let sealed = le_u32(&b[32..36]);
        if sealed > 1 {
            return None;
        }
        Some(CleanMarker {
            tail_base: le_u64(&b[8..16]),
            tail_len: le_u64(&b[16..24]),
            next_offset: le_u64(&b[24..32]),
            tail_sealed: sealed == 1,
        })
    }
}

/// The durable watermark a live writer publishes after each successful sync: how far
/// the log is durable. Advisory: written with one positioned write and never synced, read
/// only by read-only openers while the writer's lock is held, never by recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DurableWatermark {
    /// Base offset of the segment the last sync covered.
    pub segment_base: u64,
    /// That segment's durable length in bytes.
    pub durable_len: u64,
    /// The offset after the last durable record (the seal's offset if sealed).
    pub next_offset: u64,
}

impl DurableWatermark {
    pub fn encode(&self) -> [u8; WATERMARK_LEN] {
        let mut b = [0u8; WATERMARK_LEN];
        b[0..8].copy_from_slice(&WATERMARK_MAGIC);
        b[8..16].copy_from_slice(&self.segment_base.to_le_bytes());
        b[16..24].copy_from_slice(&self.durable_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.next_offset.to_le_bytes());
        // 32..36 reserved, zero.
        let crc = crc32fast::hash(&b[0..36]);
        b[36..40].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// `None` for anything that is not a whole, checked record (a read that raced the
    /// writer's update, a file from another build, garbage).
    pub fn decode(b: &[u8]) -> Option<DurableWatermark> {
        if b.len() != WATERMARK_LEN || b[0..8] != WATERMARK_MAGIC {
            return None;
        }
        if crc32fast::hash(&b[0..36]) != le_u32(&b[36..40]) {
            return None;
        }
        let durable_len = le_u64(&b[16..24]);
        if le_u32(&b[32..36]) != 0 || durable_len < SEGMENT_HEADER_LEN {
            return None;
        }
        Some(DurableWatermark { segment_base: le_u64(&b[8..16]), durable_len, next_offset: le_u64(&b[24..32]) })
    }
}

/// The file name of the segment whose first offset is `base`: twenty decimal digits, so
/// names sort in offset order and every u64 fits.
pub fn segment_file_name(base: u64) -> String {
    format!("{base:020}.seg")
}

/// The base offset a segment file name encodes, or `None` if the name is not one.
pub fn parse_segment_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".seg")?;
    if digits.len() != 20 || !digits.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_header_round_trips_and_rejects_each_corruption() {
        let h = SegmentHeader { base_offset: OFFSET_MAX, flags: SEGMENT_FLAG_GAP_BEFORE };
        let b = h.encode();
        assert_eq!(SegmentHeader::decode(&b), Ok(h));
        assert_eq!(SegmentHeader::decode(&b[..31]), Err(HeaderProblem::TooShort));
        for i in 0..32 {
            let mut c = b;
            c[i] ^= 0x01;
            assert!(SegmentHeader::decode(&c).is_err(), "flip in byte {i} went unnoticed");
        }
    }

    #[test]
    fn frame_header_rejects_every_single_bit_flip() {
        let payload = b"hello";
        let h = FrameHeader {
            payload_len: 5,
            offset: 42,
            synced_len: 32,
            flags: FLAG_END_OF_BATCH,
            payload_crc: crc32fast::hash(payload),
        };
        let b = h.encode();
        assert_eq!(FrameHeader::decode(&b), Ok(h));
        for byte in 0..32 {
            for bit in 0..8 {
                let mut c = b;
                c[byte] ^= 1 << bit;
                assert!(FrameHeader::decode(&c).is_err(), "flip {byte}:{bit} accepted");
            }
        }
    }

    #[test]
    fn a_checked_header_cannot_claim_more_than_the_maximum_record() {
        let mut h = FrameHeader::seal(1, 32);
        h.flags = 0;
        h.payload_len = RECORD_MAX_BYTES + 1;
        assert_eq!(FrameHeader::decode(&h.encode()), Err(FrameProblem::BadLength(RECORD_MAX_BYTES + 1)));
        h.payload_len = RECORD_MAX_BYTES;
        assert!(FrameHeader::decode(&h.encode()).is_ok());
    }

    #[test]
    fn segment_names_cover_the_whole_offset_range_and_sort_by_offset() {
        for base in [0, 1, 999, OFFSET_MAX, u64::MAX] {
            assert_eq!(parse_segment_file_name(&segment_file_name(base)), Some(base));
        }
        assert!(segment_file_name(9) < segment_file_name(10));
        assert!(segment_file_name(OFFSET_MAX - 1) < segment_file_name(OFFSET_MAX));
        for bad in ["1.seg", "0000000000000000000a.seg", "00000000000000000000.tmp", "99999999999999999999.seg"] {
            assert_eq!(parse_segment_file_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn clean_marker_round_trips_and_refuses_damage() {
        let m = CleanMarker { tail_base: 7, tail_len: 4096, next_offset: 99, tail_sealed: true };
        let b = m.encode();
        assert_eq!(CleanMarker::decode(&b), Some(m));
        let mut c = b;
        c[20] ^= 4;
        assert_eq!(CleanMarker::decode(&c), None);
        assert_eq!(CleanMarker::decode(&b[..39]), None);
    }

    #[test]
    fn durable_watermark_round_trips_and_refuses_damage() {
        let w = DurableWatermark { segment_base: 64, durable_len: 8192, next_offset: 130 };
        let b = w.encode();
        assert_eq!(DurableWatermark::decode(&b), Some(w));
        for i in 0..WATERMARK_LEN {
            let mut c = b;
            c[i] ^= 0x10;
            assert_eq!(DurableWatermark::decode(&c), None, "byte {i}");
        }
        assert_eq!(DurableWatermark::decode(&b[..39]), None);
        assert_eq!(DurableWatermark::decode(&CleanMarker::decode(&[0; 40]).map_or([0; 40], |m| m.encode())), None);
    }
}
