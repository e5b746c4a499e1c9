//! Readers: sequential, batched reads from any retained offset, and tailing.
//!
//! Invariants:
//! - A reader returns only records below the log's durable watermark, read only from
//!   bytes below their segment's durable length: nothing unsynced is ever returned.
//! - Records come back in offset order with no gaps; every header and payload checksum
//!   is checked on the way (damage is an error naming file and byte position).
//! - The one exception is a salvage gap (a seal followed by a `GAP_BEFORE` segment whose
//!   base is past it): its offsets name no record, so a reader crossing it, or started
//!   inside it, goes on at that segment's base.
//! - A batch holds at most `max_records` records and, unless its first record alone is
//!   larger, at most `max_bytes` payload bytes.
//! - A read the storage failed leaves nothing cached: the reader stays where it was and
//!   the next call reads the same bytes again.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use tokio::sync::watch;

use crate::error::{Location, Result, WalError};
use crate::format::{FRAME_HEADER_LEN, FrameHeader, FrameProblem, SEGMENT_HEADER_LEN};
use crate::shared::{SegmentRef, Shared};
use crate::storage::ReadBuffer;

const READ_CHUNK_BYTES: usize = 256 * 1024;

/// One record, its offset and its place in the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub offset: u64,
    pub payload: Bytes,
    /// Where the record lies: [`crate::Wal::read_placed`] reads it again from there,
    /// without a reader's walk or scan.
    pub place: RecordPlace,
}

/// Where a record lies in the log: its segment (by base offset) and its frame's byte
/// position in that segment's file. The bytes of a durable frame never change while
/// its segment is retained, so a place stays true until the record is released. 16
/// bytes: what a caller keeps instead of a record it gave up (a batch waiting out a
/// destination's outage), to read it again later at the cost of one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RecordPlace {
    segment_base: u64,
    frame_pos: u64,
}

struct Cursor {
    seg: Arc<SegmentRef>,
    /// Byte position of the frame holding `Reader::next`.
    pos: u64,
    /// Durable bytes of the segment, read a `READ_CHUNK_BYTES` chunk at a time.
    buf: ReadBuffer,
    /// The frame header last decoded, and its position: a record's header is looked at
    /// by the seal check, the read and the batch's size check, and decoded (its checksum
    /// computed) once. Bytes below the durable length never change, so it stays valid.
    header: Option<(u64, FrameHeader)>,
}

impl Cursor {
    fn at_start_of(seg: Arc<SegmentRef>) -> Cursor {
        Cursor { seg, pos: SEGMENT_HEADER_LEN, buf: ReadBuffer::new(READ_CHUNK_BYTES), header: None }
    }
}

/// Reads the log from an offset onwards.
pub struct Reader {
    shared: Arc<Shared>,
    next: u64,
    cursor: Option<Cursor>,
    durable: watch::Receiver<u64>,
    /// Where each record the last read returned was: its offset, its segment's base and
    /// its frame's byte position ([`Reader::unread_from`]). Kept from read to read so
    /// that it holds no allocation of its own per read.
    returned: Vec<(u64, u64, u64)>,
    /// How far a walk to `next` from its segment's start has got, while `cursor` is
    /// `None`: the cursor and the offset of the frame at its position
    /// ([`Reader::position_some`]).
    walk: Option<(Cursor, u64)>,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader").field("next", &self.next).finish()
    }
}

impl Reader {
    pub(crate) fn new(shared: Arc<Shared>, from: u64) -> Result<Reader> {
        let durable = shared.durable_next.subscribe();
        let end = *durable.borrow();
        if from > end {
            return Err(WalError::BeyondEnd { offset: from, end });
        }
        let r = Reader { shared, next: from, cursor: None, durable, returned: Vec::new(), walk: None };
        r.check_retained()?;
        Ok(r)
    }

    /// The offset of the next record this reader returns.
    pub fn position(&self) -> u64 {
        self.next
    }

    fn check_retained(&self) -> Result<()> {
        retained(&self.shared, self.next)
    }

    /// Returns the durable records available now from the reader's position (possibly
    /// none), and moves past them.
    pub fn try_read(&mut self, max_records: usize, max_bytes: usize) -> Result<Vec<Record>> {
        self.check_retained()?;
        self.returned.clear();
        let end = *self.durable.borrow_and_update();
        let mut out = Vec::new();
        let mut bytes = 0usize;
        while self.next < end && out.len() < max_records {
            // An error after some records were read returns those records; the reader
            // stays at the failing offset and the next call reports the error.
            let record = match self.read_one(end) {
                Ok(Some(r)) => r,
                Ok(None) => break,
                Err(e) if out.is_empty() => return Err(e),
                Err(_) => break,
            };
            bytes += record.payload.len();
            out.push(record);
            if bytes >= max_bytes {
                break;
            }
            match self.peek_len() {
                Ok(Some(r)) if bytes + r > max_bytes => break,
                Ok(_) => {}
                Err(_) => break, // reported by the next call
            }
        }
        Ok(out)
    }

    /// Steps back to `offset`, one of the records the last read returned, so that the
    /// next read returns it and those after it again; `false` (and nothing changes) if the
    /// last read returned no such record, or it was stepped back over already. A caller
    /// that read more records than it could take gives them back this way without a new
    /// reader, which would find its position by walking its segment from the start.
    pub fn unread_from(&mut self, offset: u64) -> bool {
        let Some(i) = self.returned.iter().position(|r| r.0 == offset) else { return false };
        let (_, seg_base, pos) = self.returned[i];
        match self.cursor.as_mut() {
            Some(c) if c.seg.base == seg_base => {
                c.pos = pos;
            }
            _ => {
                // The cursor crossed into the next segment after that record.
                let Some(seg) = self.shared.segment_for(offset).filter(|s| s.base == seg_base) else {
                    return false;
                };
                let mut c = Cursor::at_start_of(seg);
                c.pos = pos;
                self.cursor = Some(c);
            }
        }
        self.next = offset;
        self.returned.clear();
        true
    }

    /// Frees the memory this reader holds between reads (its read window: a chunk, or
    /// the largest record it read), keeping its position: the next read reads from the
    /// same byte on, with no walk of the segment. What the last read returned can no
    /// longer be given back ([`Reader::unread_from`]). For a reader kept while its owner waits
    /// (for a destination that does not answer, for hours): a thousand such readers
    /// would otherwise hold a chunk each.
    ///
    /// A reader that read its segment to the end (its position the next segment's base)
    /// lets go of that segment too: its open file would keep a segment the log deletes
    /// (once every destination has delivered past it) taking its disk space for as long
    /// as the reader waits. The next read starts at the next segment's base, which needs
    /// no walk.
    pub fn release_buffer(&mut self) {
        let read_to_the_end = self
            .cursor
            .as_ref()
            .is_some_and(|c| self.shared.segment_after(c.seg.base).is_some_and(|n| n.base <= self.next));
        if read_to_the_end {
            self.cursor = None;
        }
        if let Some(c) = self.cursor.as_mut() {
            c.buf.release();
        }
        if let Some((c, _)) = self.walk.as_mut() {
            c.buf.release();
        }
        self.returned = Vec::new();
    }

    /// Like [`Reader::try_read`], but waits for at least one record. Fails with
    /// [`WalError::Closed`] once the log is closed and everything durable was read.
    pub async fn read(&mut self, max_records: usize, max_bytes: usize) -> Result<Vec<Record>> {
        loop {
            let batch = self.try_read(max_records, max_bytes)?;
            if !batch.is_empty() {
                return Ok(batch);
            }
            if self.shared.is_closed() || self.durable.changed().await.is_err() {
                let last = self.try_read(max_records, max_bytes)?;
                if last.is_empty() {
                    return Err(WalError::Closed);
                }
                return Ok(last);
            }
        }
    }

    /// Walks at most about `max_bytes` of frames towards the reader's position and says
    /// whether it is there. A new reader finds its position by walking its segment's
    /// frames from the start (up to `segment_max_bytes`, 64 MiB by default): a caller
    /// that shares its thread with others (an async task) walks in steps and lets them
    /// run in between. [`Reader::try_read`] walks the rest of the way itself.
    pub fn position_some(&mut self, max_bytes: u64) -> Result<bool> {
        if self.cursor.is_some() {
            return Ok(true);
        }
        self.check_retained()?;
        self.walk_to_next(max_bytes)
    }

    /// Continues the walk to the frame holding `self.next` for at most about `max_bytes`
    /// (at least one frame) and sets the cursor there once reached: true if it was. A
    /// failed read ends the walk; the next call starts it again.
    fn walk_to_next(&mut self, max_bytes: u64) -> Result<bool> {
        let (mut c, mut offset) = match self.walk.take() {
            Some(w) => w,
            None => {
                let seg = self
                    .shared
                    .segment_for(self.next)
                    .ok_or(WalError::Released { offset: self.next, start: self.shared.start() })?;
                let c = Cursor::at_start_of(seg);
                let base = c.seg.base;
                (c, base)
            }
        };
        let mut walked = 0u64;
        while offset < self.next {
            if walked > 0 && walked >= max_bytes {
                self.walk = Some((c, offset));
                return Ok(false);
            }
            let h = frame_header(&mut c)?;
            if h.is_seal() {
                if h.offset != offset {
                    return Err(corrupt(&c, FrameProblem::UnexpectedOffset { expected: offset, found: h.offset }));
                }
                // `self.next` lies in a salvage gap: past this seal, below the next
                // segment's base (the open checked that only a `GAP_BEFORE` segment
                // may start past its predecessor's seal).
                let next = self.shared.segment_after(c.seg.base).ok_or_else(|| WalError::MissingSuccessor {
                    location: Location { file: c.seg.path.clone(), position: c.pos },
                    next_offset: h.offset,
                })?;
                // A release may have deleted the segments after this one during the walk
                // (this seal read through the segment's open file): the next segment then
                // starts past the released offsets, which are `Released`, not a gap.
                self.check_retained()?;
                offset = next.base;
                self.next = self.next.max(next.base);
                c = Cursor::at_start_of(next);
                walked += FRAME_HEADER_LEN;
                continue;
            }
            if h.offset != offset {
                return Err(corrupt(&c, FrameProblem::UnexpectedOffset { expected: offset, found: h.offset }));
            }
            c.pos += h.frame_len();
            walked += h.frame_len();
            offset += 1;
        }
        self.cursor = Some(c);
        Ok(true)
    }

    /// Positions the cursor on the frame holding `self.next`, crossing seals (and, after
    /// a salvage, the offset gap a seal may be followed by). A reader that starts inside
    /// such a gap starts at the base of the segment after it: those offsets name no record.
    fn position_cursor(&mut self) -> Result<&mut Cursor> {
        if self.cursor.is_none() {
            self.walk_to_next(u64::MAX)?;
        }
        loop {
            let c = self.cursor.as_mut().ok_or(WalError::Closed)?;
            if c.pos + FRAME_HEADER_LEN > c.seg.durable_len.load(Ordering::Acquire) {
                // Nothing durable here yet (a fresh segment after a gap).
                break;
            }
            let h = frame_header(c)?;
            if !h.is_seal() {
                break;
            }
            let next = self.shared.segment_after(c.seg.base).ok_or_else(|| WalError::MissingSuccessor {
                location: Location { file: c.seg.path.clone(), position: c.pos },
                next_offset: h.offset,
            })?;
            if h.offset != self.next {
                return Err(corrupt(c, FrameProblem::UnexpectedOffset { expected: self.next, found: h.offset }));
            }
            // As in the walk: released since `try_read` checked, never skipped.
            retained(&self.shared, self.next)?;
            self.next = next.base;
            *c = Cursor::at_start_of(next);
        }
        self.cursor.as_mut().ok_or(WalError::Closed)
    }

    /// The record at `self.next`, or `None` if crossing a salvage gap led to `end`.
    fn read_one(&mut self, end: u64) -> Result<Option<Record>> {
        self.position_cursor()?;
        let expected = self.next;
        if expected >= end {
            return Ok(None);
        }
        let c = self.cursor.as_mut().ok_or(WalError::Closed)?;
        let h = frame_header(c)?;
        if h.offset != expected {
            let problem = FrameProblem::UnexpectedOffset { expected, found: h.offset };
            return Err(corrupt(c, problem));
        }
        let payload_pos = c.pos + FRAME_HEADER_LEN;
        let payload = Bytes::copy_from_slice(bytes_at(c, payload_pos, h.payload_len as usize)?);
        h.check_payload(&payload).map_err(|p| corrupt(c, p))?;
        self.returned.push((expected, c.seg.base, c.pos));
        let place = RecordPlace { segment_base: c.seg.base, frame_pos: c.pos };
        c.pos += h.frame_len();
        self.next += 1;
        Ok(Some(Record { offset: expected, payload, place }))
    }

    /// The payload length of the next record, if it is durable already.
    fn peek_len(&mut self) -> Result<Option<usize>> {
        if self.next >= *self.durable.borrow() {
            return Ok(None);
        }
        self.position_cursor()?;
        if self.next >= *self.durable.borrow() {
            return Ok(None);
        }
        let c = self.cursor.as_mut().ok_or(WalError::Closed)?;
        Ok(Some(frame_header(c)?.payload_len as usize))
    }
}

/// The record at `offset`, read from `place` (where a reader found it): one header and
/// one payload read, both checksums checked, and the frame's offset checked against
/// `offset`, so a place that is not this record's is [`WalError::Corrupt`], never
/// another record. [`WalError::Released`] once the record is released,
/// [`WalError::BeyondEnd`] for an offset not yet durable.
pub(crate) fn read_placed(shared: &Shared, offset: u64, place: RecordPlace) -> Result<Record> {
    let start = shared.start();
    if offset < start {
        return Err(WalError::Released { offset, start });
    }
    let end = shared.durable_next();
    if offset >= end {
        return Err(WalError::BeyondEnd { offset, end });
    }
    let seg = shared.segment_for(offset).ok_or(WalError::Released { offset, start: shared.start() })?;
    let at = |position: u64, problem: FrameProblem| WalError::Corrupt {
        location: Location { file: seg.path.clone(), position },
        problem,
    };
    if seg.base != place.segment_base || place.frame_pos < SEGMENT_HEADER_LEN {
        return Err(at(
            place.frame_pos,
            FrameProblem::UnexpectedOffset { expected: offset, found: place.segment_base },
        ));
    }
    // Bytes below the durable length were synced before it was published: final.
    let durable = seg.durable_len.load(Ordering::Acquire);
    let payload_pos = place.frame_pos + FRAME_HEADER_LEN;
    if payload_pos > durable {
        return Err(at(place.frame_pos, FrameProblem::Truncated));
    }
    // The header and what may follow it, within the durable bytes, in one read: a
    // record that fits (most do) costs one read, a larger one a second for the rest.
    let first_read = (durable - place.frame_pos).min(PLACED_FIRST_READ_BYTES) as usize;
    let mut frame = vec![0u8; first_read];
    crate::storage::read_exact_at(&*seg.file, &mut frame, place.frame_pos).map_err(|e| WalError::io(&seg.path, e))?;
    let h = FrameHeader::decode(&frame[..FRAME_HEADER_LEN as usize]).map_err(|p| at(place.frame_pos, p))?;
    if h.is_seal() || h.offset != offset {
        return Err(at(place.frame_pos, FrameProblem::UnexpectedOffset { expected: offset, found: h.offset }));
    }
    if payload_pos + u64::from(h.payload_len) > durable {
        return Err(at(place.frame_pos, FrameProblem::Truncated));
    }
    let frame_len = FRAME_HEADER_LEN as usize + h.payload_len as usize;
    let payload = if frame_len <= frame.len() {
        // Copied out: the record kept must not hold the bytes read past it.
        Bytes::copy_from_slice(&frame[FRAME_HEADER_LEN as usize..frame_len])
    } else {
        let read = frame.len();
        frame.resize(frame_len, 0);
        crate::storage::read_exact_at(&*seg.file, &mut frame[read..], place.frame_pos + read as u64)
            .map_err(|e| WalError::io(&seg.path, e))?;
        Bytes::from(frame).slice(FRAME_HEADER_LEN as usize..)
    };
    h.check_payload(&payload).map_err(|p| at(place.frame_pos, p))?;
    Ok(Record { offset, payload, place })
}

/// What [`read_placed`] reads of a frame at first: its header and the payload of a
/// record of up to about 4 KiB.
const PLACED_FIRST_READ_BYTES: u64 = 4096;

/// `Released` if `offset` is below the log's start.
fn retained(shared: &Shared, offset: u64) -> Result<()> {
    let start = shared.start();
    if offset < start {
        return Err(WalError::Released { offset, start });
    }
    Ok(())
}

fn corrupt(c: &Cursor, problem: FrameProblem) -> WalError {
    WalError::Corrupt { location: Location { file: c.seg.path.clone(), position: c.pos }, problem }
}

fn frame_header(c: &mut Cursor) -> Result<FrameHeader> {
    let pos = c.pos;
    if let Some((at, h)) = c.header
        && at == pos
    {
        return Ok(h);
    }
    let b = bytes_at(c, pos, FRAME_HEADER_LEN as usize)?;
    let h = FrameHeader::decode(b).map_err(|p| corrupt(c, p))?;
    c.header = Some((pos, h));
    Ok(h)
}

/// `n` durable bytes at `pos` of the cursor's segment, through its read buffer.
fn bytes_at(c: &mut Cursor, pos: u64, n: usize) -> Result<&[u8]> {
    // Load the durable length first: the bytes below it were synced before it was
    // published, so everything read up to it is final (and a buffer filled below it
    // stays true).
    let durable = c.seg.durable_len.load(Ordering::Acquire);
    let Cursor { seg, pos: at, buf, .. } = c;
    match buf.get(&*seg.file, pos, n, durable) {
        Ok(Some(b)) => Ok(b),
        Ok(None) => Err(WalError::Corrupt {
            location: Location { file: seg.path.clone(), position: *at },
            problem: FrameProblem::Truncated,
        }),
        Err(e) => Err(WalError::io(&seg.path, e)),
    }
}
