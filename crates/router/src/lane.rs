//! A lane: the delivery task of one destination.
//!
//! The dispatcher hands a lane its records through the lane's gate (a bounded queue).
//! When the queue is full the lane *overflows*: the dispatcher stops queueing (it only
//! notes the offsets it skipped) and the lane re-reads its records from the log itself,
//! from where the overflow began, until a read reaches what the dispatcher had routed
//! with nothing skipped past it; then queueing resumes, the batch that read took sent
//! before anything queued (a destination that keeps receiving need not fall silent for
//! its lane to hand back). So a
//! destination that is down for hours holds its records in the log, never in memory.
//!
//! Invariants:
//! - What a lane queues is counted in its router's [`QueueBudget`] by the gate's own
//!   `push`, `count_out`, `spill` and `Drop`, nowhere else: all lanes together never
//!   queue more than `queues_max_bytes`, and a record that does not fit overflows its lane.
//!   A batch taken from the queue stays counted until its delivery ends (acknowledged,
//!   or parked): the batches lanes hold waiting for a send slot, lingering, in flight,
//!   retried or prepared ahead are within the budget, whatever the number of lanes.
//! - A Degraded lane (failures in a row, its breaker open, or records held out of its
//!   topic's partitions) queues nothing until it delivers again: its queue is shed to the
//!   log ([`Gate::shed`]), and between tries its batch waits in the log too, the lane
//!   keeping only each record's place ([`Parked`]), so memory is held by destinations
//!   that deliver, never by an outage. A batch read from the log waits there from its
//!   first failed try, and is filled only with one of its source's catch-up leaves
//!   ([`SendSlots::catch_up`]): lanes catching up hold at most that many batches. A parked batch pins the log from its first record
//!   as a batch in flight does, and what it delivered before it was parked is
//!   acknowledged then, never sent again.
//! - Records of a destination are sent in log order; a batch is retried until it is
//!   acknowledged (or disposed of by an explicit admission policy), never skipped. A
//!   send cut short by the result timeout halves what the next sends carry
//!   ([`SendCap`]), so a batch too slow to be answered whole is not sent whole again.
//! - A lane's acknowledged records keep pinning the log (`unstored_from`) until the
//!   cursor flusher has stored a cursor past them; only then does `low_water` move.
//!   An acknowledgement and the flusher's settling of a stored cursor are each one step
//!   under the gate ([`Gate::acknowledged`], [`Gate::cursor_stored`]), so no order of the
//!   two can clear `unstored_from` for an acknowledgement the flusher has not stored.
//! - Handoff from re-reading back to queueing happens under the gate lock and only when
//!   every record the dispatcher skipped lies below the lane's read position, so no
//!   record is lost or sent twice by the handoff.
//! - A lane re-reading the log yields to the runtime's other tasks after every
//!   [`CATCHUP_SCAN_RECORDS_PER_YIELD`] records it scans, so a destination with a small
//!   share of a long backlog never holds a worker for the whole scan, and still fills
//!   its batches.
//! - Client-wide failures (disconnected, unavailable) never count against the breaker.
//! - A record is taken for out of its topic's partitions (then dropped, dead-lettered or
//!   held, as the policy says) only on a partition count the server gave while its batch
//!   was being delivered, never on one the lane learnt before: an operator may have
//!   added the partition since, and the record was answered 200.
//! - A lane is counted in `iggy_connector_destinations_active` from its creation until it
//!   is dropped (once its task ended and the router stopped), and its breaker in
//!   `iggy_connector_destination_circuit_open` while it is not closed and its task
//!   lives: each count is taken back by a `Drop`, so a stopped router (or one started
//!   again in the same process) counts no lane and no open breaker of a task that is gone.
//! - A record below a lane's stored cursor is skipped as delivered before a restart only
//!   where that cursor speaks for it (the router lowered every stored cursor above the
//!   log's next offset to it at start, so no record appended since is skipped): a
//!   destination's own lane always; the dead-letter lane only for a record below the
//!   stored cursor of the record's own destination ([`DeliveredAtStart`], as the
//!   dispatcher decides it for the cap), or one it delivered itself in this run. Which
//!   destinations the cap admits can change across a restart, so a record the
//!   dead-letter topic never had can lie below its cursor; it is dead-lettered (at least
//!   once), never skipped.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use ingest::envelope::{Destination, Envelope, EnvelopeSummary, Partitioning};
use tokio::sync::{Notify, Semaphore, watch};
use tokio::time::{Duration, Instant};
use wal::{Record, RecordPlace, Wal};

use crate::breaker::{Breaker, BreakerState};
use crate::cursors::{CursorStore, DeliveredAtStart};
use crate::policy::{OnAdmissionFailure, RouterPolicy};
use crate::sink::{DestinationKey, LaneKey, OutMessage, SendError, SendErrorKind, Sink, TopicInfo};
use crate::status::{Status, StatusCell};

/// A record with its decoded envelope.
#[derive(Debug, Clone)]
pub(crate) struct Routed {
    pub offset: u64,
    /// Where the record lies in the log: a batch given back to the log while its lane
    /// waits out an outage keeps this, not the record ([`Parked`]).
    pub place: RecordPlace,
    pub envelope: Envelope,
    /// Why this record is on the dead-letter lane, if it is.
    pub dead_letter_reason: Option<&'static str>,
    /// The bytes its message takes in a send, at most ([`send_bytes`]): computed once,
    /// looked at by every batch bound it meets.
    send_bytes: usize,
}

impl Routed {
    pub(crate) fn new(
        offset: u64,
        place: RecordPlace,
        envelope: Envelope,
        dead_letter_reason: Option<&'static str>,
    ) -> Routed {
        let mut r = Routed { offset, place, envelope, dead_letter_reason, send_bytes: 0 };
        r.send_bytes = send_bytes(&r);
        r
    }
}

/// What the dispatcher and the lane share, under one lock.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    queue: VecDeque<Routed>,
    /// Set while the lane re-reads from the log: the next offset it has not read.
    overflow_from: Option<u64>,
    /// The last offset the dispatcher skipped for this lane while it overflowed.
    last_skipped: Option<u64>,
    /// First offset of the batch being delivered.
    in_flight_first: Option<u64>,
    /// At or below the lowest offset of an acknowledged record whose cursor is not yet
    /// stored (such records still pin the log).
    unstored_from: Option<u64>,
    /// Every record of this lane below this offset was acknowledged (its cursor not yet
    /// necessarily stored).
    acked_below: u64,
    /// Records and payload bytes routed here and not yet delivered (queued, in flight,
    /// or waiting in the log).
    held_records: u64,
    held_bytes: u64,
    /// The oldest held record's receive time, when known, and since when the lane holds
    /// it as its oldest.
    oldest_held: Option<OldestHeld>,
    /// When an offer first found the queue full since it was last at most half full:
    /// how long this lane has been keeping up with the reader less than its queue needs.
    full_since: Option<Instant>,
    /// Queue length at which an offer wakes the lane: 0 or 1 normally (any record), the
    /// room left in the batch while the lane lingers (so a filling batch costs one
    /// wake-up, not one per record), never more than the queue can hold.
    wake_at_queued: usize,
    /// What the records in `queue` hold ([`queued_size`]): bounded by
    /// `lane_queue_max_bytes`.
    queued_bytes: usize,
    /// The payload bytes of the records in `queue`: what fills a batch.
    queued_payload_bytes: usize,
    /// While the lane lingers, the payload bytes left in the batch: queued payload bytes
    /// that reach it fill the batch, and wake the lane as well (0: not lingering).
    wake_at_bytes: usize,
    /// Set while the lane is Degraded, until it moves records on again: the
    /// lane cannot send, so it keeps nothing in its queue and the dispatcher's next
    /// record for it starts a re-read from the log ([`Lane::cannot_send`]).
    cannot_send: bool,
    /// What every lane of the router together keeps queued; `budgeted_bytes` of this
    /// gate are counted in it: `queued_bytes`, and the batches taken from the queue
    /// whose deliveries have not ended ([`Gate::count_out`]).
    budget: Arc<QueueBudget>,
    budgeted_bytes: usize,
}

/// The bytes every lane of a router keeps in its queue, as [`queued_size`] counts them,
/// against one bound (`Policies::queues_max_bytes`): with each lane bounded alone, a
/// router with many destinations held their number times `lane_queue_max_bytes`. A
/// record that does not fit is not queued; its lane re-reads it from the log instead.
#[derive(Debug)]
pub(crate) struct QueueBudget {
    queued_bytes: std::sync::atomic::AtomicUsize,
    max_bytes: usize,
}

impl QueueBudget {
    pub(crate) fn new(max_bytes: usize) -> QueueBudget {
        QueueBudget { queued_bytes: std::sync::atomic::AtomicUsize::new(0), max_bytes }
    }

    /// Counts `bytes` in if they fit within the bound; false (nothing counted) if not.
    pub(crate) fn take(&self, bytes: usize) -> bool {
        self.queued_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                q.checked_add(bytes).filter(|&total| total <= self.max_bytes)
            })
            .is_ok()
    }

    fn give_back(&self, bytes: usize) {
        // Saturating: a miscount must not wrap the total to near `usize::MAX`, which would
        // refuse every record of every lane for good (each re-read from the log).
        let before = self
            .queued_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| Some(q.saturating_sub(bytes)))
            .unwrap_or_else(|q| q);
        debug_assert!(before >= bytes, "queue budget gave back {bytes} of {before}");
    }

    /// The bytes all lanes keep queued now.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.queued_bytes.load(Ordering::Acquire)
    }

    pub(crate) fn max_bytes(&self) -> usize {
        self.max_bytes
    }
}

/// No bound: for a gate built on its own (the unit tests below). A lane's gate always
/// takes its router's budget ([`Lane::new`]).
impl Default for QueueBudget {
    fn default() -> QueueBudget {
        QueueBudget::new(usize::MAX)
    }
}

/// A lane dropped with records queued (its router stopped) gives their bytes back.
impl Drop for Gate {
    fn drop(&mut self) {
        self.budget.give_back(self.budgeted_bytes);
    }
}

impl Gate {
    /// A lane's gate: everything below `acked_below` acknowledged, nothing queued.
    fn new(acked_below: u64, budget: Arc<QueueBudget>) -> Gate {
        let mut gate = Gate::default();
        gate.acked_below = acked_below;
        gate.budget = budget;
        gate
    }

    /// Queues `r` if the router's budget has room for it; gives it back if not.
    // The `Err` is the record handed back, not an error: boxing it would allocate per record.
    #[allow(clippy::result_large_err)]
    fn push(&mut self, r: Routed) -> Result<(), Routed> {
        let size = queued_size(&r);
        if !self.budget.take(size) {
            return Err(r);
        }
        self.budgeted_bytes += size;
        self.queued_bytes += size;
        self.queued_payload_bytes += r.envelope.payload.len();
        self.queue.push_back(r);
        Ok(())
    }

    /// Takes the front record into a batch. Its bytes stay counted in the budget until
    /// that batch's delivery ends ([`Gate::count_out`], once for the batch: not one
    /// shared atomic operation per record).
    fn pop_front(&mut self) -> Option<Routed> {
        let r = self.queue.pop_front()?;
        self.queued_bytes -= queued_size(&r);
        self.queued_payload_bytes -= r.envelope.payload.len();
        Some(r)
    }

    /// Gives the budget back `bytes` of records taken from the queue into a batch whose
    /// delivery ended (acknowledged, disposed of, or parked: what is left of it waits in
    /// the log). Until then they stayed counted, waiting for a send slot, lingering,
    /// in flight or retried: a thousand lanes waiting behind a source's sixteen slots
    /// hold their batches within `queues_max_bytes`, not a batch each beside it.
    fn count_out(&mut self, bytes: usize) {
        debug_assert!(self.budgeted_bytes >= self.queued_bytes + bytes, "counted out more than was taken");
        let bytes = bytes.min(self.budgeted_bytes - self.queued_bytes);
        self.budgeted_bytes -= bytes;
        self.budget.give_back(bytes);
    }

    /// Empties the queue into the log: the lane re-reads its records from the first one
    /// queued, and the dispatcher's next record for it (if none was queued) starts such
    /// a re-read too. The records stay held (counted, pinning the log); only memory is
    /// given back. Returns the records, to be dropped once the gate's lock is let go: a
    /// queue of up to `lane_queue_max_records` freed under it would stall the log's
    /// reader, which offers every destination's records through such locks.
    #[must_use = "the shed records are dropped by the caller, outside the gate's lock"]
    fn shed(&mut self) -> VecDeque<Routed> {
        self.cannot_send = true;
        self.spill()
    }

    /// [`Gate::shed`] without its "cannot send": the queue goes to the log (and what the
    /// dispatcher offers next is re-read with it), but the lane may queue again once its
    /// re-read caught up. For a batch parked before the lane is Degraded: what it queued
    /// lies after that batch, and must not be sent before it.
    #[must_use = "the spilled records are dropped by the caller, outside the gate's lock"]
    fn spill(&mut self) -> VecDeque<Routed> {
        let (Some(first), Some(last)) = (self.queue.front(), self.queue.back()) else { return VecDeque::new() };
        // Queued records lie below any offset skipped since: an overflow stops queueing.
        self.re_read(first.offset, last.offset);
        self.full_since = None;
        // Only the queue's bytes: those of batches taken from it are counted out as
        // their deliveries end.
        self.budgeted_bytes -= self.queued_bytes;
        self.budget.give_back(self.queued_bytes);
        self.queued_bytes = 0;
        self.queued_payload_bytes = 0;
        std::mem::take(&mut self.queue)
    }

    /// The lane's records `first..=last` (given back from memory) are re-read from the log:
    /// its re-read starts no later than `first`, and hands back to queueing only past `last`.
    fn re_read(&mut self, first: u64, last: u64) {
        self.overflow_from = Some(self.overflow_from.map_or(first, |o| o.min(first)));
        self.last_skipped = Some(self.last_skipped.map_or(last, |s| s.max(last)));
    }

    /// Counts a record routed here as held (queued, or skipped to be re-read from the log).
    fn hold(&mut self, payload_len: usize, received_at_unix_ms: u64) {
        self.held_records += 1;
        self.held_bytes += payload_len as u64;
        if self.oldest_held.is_none() {
            self.oldest_held = Some(OldestHeld::noted_now(received_at_unix_ms));
        }
    }

    /// The oldest held record is now the one received at `received_at_unix_ms` (`None`:
    /// none held). The same receive time as before keeps when it was noted: a lane that
    /// reads the same record back try after try holds it all along.
    fn note_oldest_held(&mut self, received_at_unix_ms: Option<u64>) {
        self.oldest_held = match (self.oldest_held, received_at_unix_ms) {
            (_, None) => None,
            (Some(o), Some(r)) if o.received_at_unix_ms == r => Some(o),
            (_, Some(r)) => Some(OldestHeld::noted_now(r)),
        };
    }

    /// The destination acknowledged the batch in flight, whose records all lie below
    /// `below`; the lane's stored cursor is `stored_below` (read under the gate). The
    /// records not yet covered by it keep pinning the log until [`Gate::cursor_stored`]
    /// settles a cursor at or past `below`. (Only the dead-letter lane sends records
    /// below its stored cursor: those a restart newly refused for the cap.)
    fn acknowledged(&mut self, below: u64, stored_below: u64) {
        self.acked_below = self.acked_below.max(below);
        if below > stored_below {
            let from = self.in_flight_first.map_or(stored_below, |f| f.max(stored_below));
            self.unstored_from = Some(self.unstored_from.map_or(from, |u| u.min(from)));
        }
    }

    /// Every record below this offset was acknowledged; what the cursor flusher stores.
    pub(crate) fn acked_below(&self) -> u64 {
        self.acked_below
    }

    /// The cursor flusher durably stored `stored`, a value it read from
    /// [`Gate::acked_below`] earlier. Acknowledgements since then still pin the log, from
    /// `stored` on.
    pub(crate) fn cursor_stored(&mut self, stored: u64) {
        self.unstored_from = (self.acked_below > stored).then_some(stored);
    }

    /// Payload bytes this lane holds, and the receive time of its oldest held record when
    /// known: what the releaser sums into the held gauges each round, read under the
    /// lock it takes anyway (a [`Lane::snapshot`] would clone every name and status).
    pub(crate) fn held(&self) -> (u64, Option<OldestHeld>) {
        (self.held_bytes, self.oldest_held)
    }

    /// The lowest offset of a record this lane has not delivered, if it holds any.
    pub(crate) fn low_water(&self) -> Option<u64> {
        [self.unstored_from, self.in_flight_first, self.queue.front().map(|r| r.offset), self.overflow_from]
            .into_iter()
            .flatten()
            .min()
    }
}

/// What the admin API shows of a lane.
#[derive(Debug, Clone, PartialEq)]
pub struct LaneSnapshot {
    /// The source (connector) whose records this lane delivers.
    pub source: String,
    pub destination: DestinationKey,
    pub status: Status,
    pub breaker: &'static str,
    pub delivered_below: u64,
    pub held_records: u64,
    pub held_bytes: u64,
    pub oldest_held_age_ms: Option<u64>,
    pub sent_records: u64,
    pub rejected_records: u64,
    pub consecutive_failures: u32,
    /// The lane's last error of any kind (a failed send, an unreadable log, a record
    /// beyond its topic's partitions, ...), and when it happened: it stays after the lane
    /// recovers, the time telling how old it is.
    pub last_error: Option<String>,
    pub last_error_at: Option<std::time::SystemTime>,
    /// Why the lane has its status, and since when.
    pub status_reason: String,
    pub status_since: std::time::SystemTime,
    pub partitions_count: Option<u32>,
    /// Set when the topic acknowledges without syncing: its acks may not survive a crash
    /// of the server.
    pub not_durable_warning: bool,
    pub overflowed: bool,
    /// What the lane keeps in its queue in memory, as `lane_queue_max_bytes` counts it.
    pub queued_bytes: usize,
    /// What its batch being delivered (and the next one, prepared ahead) keep in memory,
    /// counted the same way: 0 while its batch is parked (the lane is Degraded, or the
    /// batch was read from the log, and waits to try again: it waits in the log).
    pub batch_bytes: usize,
    /// The most records one send carries after sends cut short by the destination's
    /// timeout ([`SendCap`]); `None`: no cap beyond `batch_max_records`.
    pub send_records_max: Option<usize>,
}

#[derive(Debug, Default)]
struct Info {
    breaker: Option<BreakerState>,
    topic: Option<TopicInfo>,
    sent_records: u64,
    rejected_records: u64,
    consecutive_failures: u32,
    /// The lane's last attempt that said anything of its destination held its send slot
    /// for [`SLOW_TO_FAIL_SHARE`] of the result timeout or more and failed: its next one
    /// may hold a slot as long, and waits for the failing lanes' share of them
    /// ([`SendSlots`]). Set by such a failure, cleared by any success; a failure that
    /// came back sooner (a dropped connection, a refused connect, a destination's quick
    /// refusal) leaves it as it was, since it says nothing of how long the next attempt
    /// will hold a slot.
    slow_to_fail: bool,
    /// The last offset of the out-of-range runs already counted as rejected: a run read
    /// back after a park (the same records, or the part of them not dead-lettered yet)
    /// is not counted again. A lane's records come in log order, so a new run ends past it.
    out_of_range_counted_through: Option<u64>,
    /// Failed dead-letter sends in a row, and the cap on what a dead-letter send
    /// carries: a run parked while the dead-letter destination fails (or answers too
    /// slowly) goes on from both after it is read back.
    dead_letter_failures: u32,
    /// [`Info::slow_to_fail`] of the lane's sends to its dead-letter destination.
    dead_letter_slow_to_fail: bool,
    dead_letter_cap: SendCap,
    /// The last offset of a run parked while it was dead-lettered: read back, its rest
    /// goes to the dead-letter destination too, never to its own topic.
    dead_lettering_through: Option<u64>,
    /// What sends cut short by the destination's timeout left of a send's records.
    send_cap: SendCap,
}

/// Acknowledged sends in a row under a [`SendCap`] before it doubles: growing at every
/// acknowledgement would, on a server that stays slow, cut every other send short (each
/// of those copies perhaps stored), where this is one in seventeen at most.
const SEND_CAP_GROWS_AFTER_ACKNOWLEDGED: u32 = 16;

/// What a send cut short by the result timeout, while the server answered other calls
/// (`SendErrorKind::Timeout`), does to the next ones. Its outcome is unknown: the server
/// may store it after all. Sent again whole, a batch too large to be answered within the
/// timeout (a slow link, a slow sync on the server) would be cut short again and again,
/// stored again each time, and the lane would never move on. So each such cut halves the
/// most records a send carries, down to one, and every
/// [`SEND_CAP_GROWS_AFTER_ACKNOWLEDGED`] sends acknowledged in a row double it back,
/// until it reaches `batch_max_records` and the cap goes. Copies are then bounded: each
/// halving's at most once, not one batch per retry for as long as the server is slow.
/// A lane keeps one for its destination; a dead-letter send keeps one for its run.
#[derive(Debug, Default)]
struct SendCap {
    /// `None`: no cap beyond the batch.
    records_max: Option<usize>,
    acknowledged_in_a_row: u32,
}

impl SendCap {
    /// The end of the next send from `from`, `end` at most.
    fn end(&self, from: usize, end: usize) -> usize {
        self.records_max.map_or(end, |max| end.min(from + max))
    }

    /// A send of `records` was cut short by the destination's timeout; the new cap if it
    /// was lowered.
    fn cut_short(&mut self, records: usize) -> Option<usize> {
        let max = (records / 2).max(1);
        self.acknowledged_in_a_row = 0;
        let lowered = self.records_max.is_none_or(|m| max < m);
        if lowered {
            self.records_max = Some(max);
        }
        lowered.then_some(max)
    }

    /// A send was acknowledged; the cap goes once doubled to `batch_max_records`.
    fn acknowledged(&mut self, batch_max_records: usize) {
        let Some(max) = self.records_max else { return };
        self.acknowledged_in_a_row += 1;
        if self.acknowledged_in_a_row >= SEND_CAP_GROWS_AFTER_ACKNOWLEDGED {
            self.acknowledged_in_a_row = 0;
            let doubled = max.saturating_mul(2);
            self.records_max = (doubled < batch_max_records).then_some(doubled);
        }
    }
}

/// Counts a lane's failed call (a send, or an ensure) in `send_failures_total`.
fn count_failure(lane: &Lane, e: &SendError) {
    metrics::counter!("iggy_connector_send_failures_total", "connector_key" => lane.key.source.clone(), "reason" => e.kind.as_str()).increment(1);
}

/// `dest` ensured (its stream and topic made to exist), the calls that succeed timed,
/// wherever they are made (a lane, the pre-warm, a dead-letter send): a failure's time is
/// a timeout or a refusal, counted in `send_failures_total` by a lane (or logged by the
/// pre-warm), and would read as a slow server. A call cut short by its caller is not
/// timed either.
pub(crate) async fn ensure_timed<S: Sink>(sink: &S, dest: &DestinationKey) -> Result<TopicInfo, SendError> {
    let started = std::time::Instant::now();
    let ensured = sink.ensure(dest).await;
    if ensured.is_ok() {
        metrics::histogram!("iggy_connector_destination_create_latency_seconds")
            .record(started.elapsed().as_secs_f64());
    }
    ensured
}

/// A lane's oldest held record: when it was received (the wall clock at the door, in
/// its envelope) and when the lane came to hold it as its oldest (the monotonic clock).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OldestHeld {
    received_at_unix_ms: u64,
    noted: Instant,
}

impl OldestHeld {
    fn noted_now(received_at_unix_ms: u64) -> OldestHeld {
        OldestHeld { received_at_unix_ms, noted: Instant::now() }
    }

    /// How long it has been held: since it was received, by the wall clock of `now_ms`,
    /// and never less than the lane has held it. A wall clock stepped back since the
    /// door stamped it (or one that was ahead then) would otherwise put the age at 0 for
    /// the size of the step, and keep an alert on a destination that takes nothing quiet
    /// for as long.
    pub(crate) fn age_ms(&self, now_ms: u64) -> u64 {
        let held_ms = u64::try_from(self.noted.elapsed().as_millis()).unwrap_or(u64::MAX);
        now_ms.saturating_sub(self.received_at_unix_ms).max(held_ms)
    }
}

/// A source's sends in flight: at most `max_concurrent_destinations`, of which lanes
/// slow to fail ([`Info::slow_to_fail`]: their last attempt held its slot a quarter of
/// the result timeout or more, and failed) hold at most half (at least one). Such a lane
/// can hold its slot for a whole result timeout (twice, with the ping after it); without
/// the bound, a handful of destinations that never answer would take every slot of their
/// source and queue its healthy destinations behind their timeouts. A failure that came
/// back at once (a dropped connection, a server restarting: every lane gets one) moves
/// no lane into that share, nor out of it: a healthy lane that shared an outage with a
/// silent one is not queued behind the silent one's timeouts after it. With one slot in
/// all, a failing lane can still hold it: sends are then one at a time by the
/// operator's choice.
#[derive(Debug)]
pub(crate) struct SendSlots {
    all: Semaphore,
    failing: Semaphore,
    /// Parked batches of the source read back at once ([`SendSlots::read_back`]): as
    /// many as its failing lanes may have sends in flight.
    read_back: Arc<Semaphore>,
    /// Batches of the source re-read from the log at once ([`SendSlots::catch_up`]): twice
    /// as many as it may have sends in flight, so that a batch is read while another's
    /// send is in flight and no slot waits for a read.
    catch_up: Arc<Semaphore>,
}

/// A send slot, held for one attempt.
pub(crate) struct SendSlot<'a> {
    _failing: Option<tokio::sync::SemaphorePermit<'a>>,
    _slot: tokio::sync::SemaphorePermit<'a>,
}

impl SendSlots {
    /// `max` is within tokio's `Semaphore::MAX_PERMITS`: `RouterPolicy::validate` bounds it.
    pub(crate) fn new(max: usize) -> SendSlots {
        let failing = (max / 2).max(1);
        SendSlots {
            all: Semaphore::new(max),
            failing: Semaphore::new(failing),
            read_back: Arc::new(Semaphore::new(failing)),
            catch_up: Arc::new(Semaphore::new(max.saturating_mul(2))),
        }
    }

    /// Leave to re-read a batch from the log, held until its try ends. A batch re-read
    /// waits in memory for its send slot: after an outage a thousand lanes catching up
    /// would each read one (a megabyte at the defaults) and wait for one of the source's
    /// slots with it. `None` once the slots are closed.
    pub(crate) async fn catch_up(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        leave(&self.catch_up).await
    }

    /// [`SendSlots::catch_up`] if one is free now.
    fn try_catch_up(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.catch_up.clone().try_acquire_owned().ok()
    }

    /// Leave for a lane slow to fail to read a parked batch back into memory, held until
    /// its try ends. Such lanes send one at a time per failing slot, and a try through a
    /// server that does not answer takes a whole result timeout: read back before their
    /// turn, a thousand parked batches would wait for it all in memory again. Any other
    /// lane reads its parked batch back with the leave of a re-read
    /// ([`SendSlots::catch_up`]): its try takes the time of a send. `None` once the
    /// slots are closed.
    pub(crate) async fn read_back(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        leave(&self.read_back).await
    }

    /// Waits for a slot; a lane slow to fail (`failing`) first waits for one of the
    /// failing lanes' share. `None` once the slots are closed.
    pub(crate) async fn acquire(&self, failing: bool) -> Option<SendSlot<'_>> {
        let failing = if failing { Some(self.failing.acquire().await.ok()?) } else { None };
        let slot = self.all.acquire().await.ok()?;
        Some(SendSlot { _failing: failing, _slot: slot })
    }
}

/// A permit of `permits`, held past the borrow of its owner; `None` once it is closed.
async fn leave(permits: &Arc<Semaphore>) -> Option<tokio::sync::OwnedSemaphorePermit> {
    permits.clone().acquire_owned().await.ok()
}

pub(crate) struct Lane {
    pub key: LaneKey,
    /// The policy of the lane's source.
    pub policy: Arc<RouterPolicy>,
    /// The source's limit on sends in flight.
    pub send_slots: Arc<SendSlots>,
    /// Which records read back from the log are this lane's.
    pub belongs: Arc<BelongsFn>,
    /// See [`SourceShare::dead_letter_given_up`].
    dead_letter_given_up: bool,
    /// See [`SourceShare::dead_letter_lane`].
    dead_letter_lane: Arc<OnceLock<Weak<Lane>>>,
    gate: Mutex<Gate>,
    wake: Notify,
    /// Woken when the lane takes records from its queue.
    pub space: Notify,
    pub delivered_below: AtomicU64,
    /// The dead-letter lane's view of every stored cursor of its source at start (see
    /// [`Lane::delivered_before`]); `None` for a destination's own lane.
    cursors_at_start: Option<Arc<DeliveredAtStart>>,
    /// `delivered_below` at start.
    delivered_below_at_start: u64,
    /// What the batch being delivered and the one prepared after it keep in memory, as
    /// [`queued_size`] counts a record: 0 while the lane is parked ([`Parked`]) or waits
    /// for records.
    batch_bytes: AtomicUsize,
    pub status: StatusCell,
    info: Mutex<Info>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for Lane {
    fn drop(&mut self) {
        metrics::gauge!("iggy_connector_destinations_active").decrement(1.0);
    }
}

impl std::fmt::Debug for Lane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lane").field("key", &self.key).finish_non_exhaustive()
    }
}

/// What a source's lanes share.
#[derive(Clone)]
pub(crate) struct SourceShare {
    pub policy: Arc<RouterPolicy>,
    pub send_slots: Arc<SendSlots>,
    pub belongs: Arc<BelongsFn>,
    /// The source's dead-letter destination is given up (`[router.give_up]`): what
    /// would go there is dropped and counted as given up instead.
    pub dead_letter_given_up: bool,
    /// The router's bound on what all its lanes keep queued.
    pub queue_budget: Arc<QueueBudget>,
    /// The source's dead-letter lane, once it exists: the row in the status that shows
    /// what its destination took, also what another lane of the source dead-letters
    /// itself (records beyond its topic's partitions). Weak: the dead-letter lane is
    /// one of the lanes holding it.
    pub dead_letter_lane: Arc<OnceLock<Weak<Lane>>>,
}

impl Lane {
    /// A new lane, counted as active until it is dropped.
    pub(crate) fn new(key: LaneKey, delivered_below: u64, share: &SourceShare) -> Lane {
        let status = StatusCell::new("destinations", key.to_string());
        metrics::gauge!("iggy_connector_destinations_active").increment(1.0);
        Lane {
            key,
            policy: share.policy.clone(),
            send_slots: share.send_slots.clone(),
            belongs: share.belongs.clone(),
            dead_letter_given_up: share.dead_letter_given_up,
            dead_letter_lane: share.dead_letter_lane.clone(),
            gate: Mutex::new(Gate::new(delivered_below, share.queue_budget.clone())),
            wake: Notify::new(),
            space: Notify::new(),
            delivered_below: AtomicU64::new(delivered_below),
            cursors_at_start: None,
            delivered_below_at_start: delivered_below,
            batch_bytes: AtomicUsize::new(0),
            status,
            info: Mutex::new(Info::default()),
        }
    }

    /// A dead-letter lane: a record below its cursor counts as delivered before a restart
    /// only if its own destination's cursor at start (`cursors_at_start`) is past it.
    pub(crate) fn new_dead_letter(
        key: LaneKey,
        delivered_below: u64,
        share: &SourceShare,
        cursors_at_start: Arc<DeliveredAtStart>,
    ) -> Lane {
        let mut lane = Lane::new(key, delivered_below, share);
        lane.cursors_at_start = Some(cursors_at_start);
        lane
    }

    /// True if the record at `offset`, bound for `stream`/`topic`, was delivered: before a
    /// restart (by its stored cursor) or in this run (by this lane's progress).
    fn delivered_before(&self, offset: u64, stream: &str, topic: &str) -> bool {
        let now = self.delivered_below.load(Ordering::Acquire);
        match &self.cursors_at_start {
            None => offset < now,
            Some(cursors) => {
                cursors.delivered(offset, stream, topic) || (self.delivered_below_at_start..now).contains(&offset)
            }
        }
    }

    pub(crate) fn dest(&self) -> &DestinationKey {
        &self.key.destination
    }

    pub(crate) fn gate(&self) -> MutexGuard<'_, Gate> {
        lock(&self.gate)
    }

    /// Called by the dispatcher for each record bound here, in log order. With
    /// `may_refuse`, a full queue of a healthy lane gives the record back (the dispatcher
    /// waits briefly for room: a healthy lane that is merely busy should not re-read the
    /// log), unless the queue has not been below half full for `overflow_after` since an
    /// offer first found it full: a lane that slow would pace the log's single reader, and
    /// with it every other destination, one short wait at a time. Otherwise a full queue
    /// overflows. A refusal hands the record back with what is left of `overflow_after`,
    /// the longest the dispatcher is to wait before offering it again.
    // The `Err` is the record handed back, not an error: boxing it would allocate per record.
    #[allow(clippy::result_large_err)]
    pub(crate) fn offer(
        &self,
        r: Routed,
        queue_max: usize,
        overflow_after: Duration,
        may_refuse: bool,
    ) -> Result<(), (Routed, Duration)> {
        let d = &r.envelope.header.destination;
        if self.delivered_before(r.offset, &d.stream, &d.topic) {
            return Ok(());
        }
        // Full by records, or by bytes held (a queue holding any record takes no more
        // once it holds `lane_queue_max_bytes`, `queued_size` each: what a stuck lane
        // keeps in memory is bounded by bytes too, not only by a count of events of up to
        // a megabyte each, and records of tiny payloads count their headers).
        let max_bytes = self.policy.lane_queue_max_bytes;
        let mut g = self.gate();
        if g.queue.len() <= queue_max / 2 && g.queued_bytes <= max_bytes / 2 {
            g.full_since = None;
        }
        let full = g.overflow_from.is_none()
            && (g.cannot_send || g.queue.len() >= queue_max || (!g.queue.is_empty() && g.queued_bytes >= max_bytes));
        if full && may_refuse && !g.cannot_send && self.is_healthy() {
            let now = Instant::now();
            let since = *g.full_since.get_or_insert(now);
            let full_for = now.duration_since(since);
            if full_for < overflow_after {
                return Err((r, overflow_after - full_for));
            }
        }
        g.hold(r.envelope.payload.len(), r.envelope.header.received_at_unix_ms);
        let wake = if g.overflow_from.is_some() {
            g.last_skipped = Some(r.offset);
            true
        } else if full {
            g.overflow_from = Some(r.offset);
            g.last_skipped = Some(r.offset);
            g.full_since = None;
            true
        } else {
            match g.push(r) {
                // A lingering lane is woken once its batch could fill, or once its queue is
                // full by bytes held (it takes no more then, so waiting would gain nothing).
                Ok(()) => {
                    g.queue.len() >= g.wake_at_queued.max(1)
                        || (g.wake_at_bytes > 0
                            && (g.queued_payload_bytes >= g.wake_at_bytes || g.queued_bytes >= max_bytes))
                }
                // The router's lanes together hold all the budget allows: this lane
                // re-reads from this record on.
                Err(r) => {
                    g.overflow_from = Some(r.offset);
                    g.last_skipped = Some(r.offset);
                    g.full_since = None;
                    true
                }
            }
        };
        drop(g);
        if wake {
            self.wake.notify_one();
        }
        Ok(())
    }

    /// The lane cannot send (it is Degraded: failures in a row, its breaker open, or
    /// records held out of its topic's partitions): its queue is emptied into the log, and it queues nothing more until
    /// it moves records on again ([`Lane::sends_again`]). Memory is held by lanes that
    /// deliver, never by an outage, however many destinations it hits.
    fn cannot_send(&self) {
        let shed = self.gate().shed();
        drop(shed);
        // The log's reader may be waiting for room in this queue: there is, now.
        self.space.notify_waiters();
    }

    /// The lane moved records on: its queue takes records again.
    fn sends_again(&self) {
        self.gate().cannot_send = false;
    }

    /// True while the lane re-reads the log itself rather than taking records from its
    /// queue.
    pub(crate) fn is_overflowed(&self) -> bool {
        self.gate().overflow_from.is_some()
    }

    /// While the lane re-reads the log itself (it overflowed), notes that the dispatcher
    /// skipped the record at `offset` and returns true; otherwise changes nothing and
    /// returns false (the record is to be offered). Lets the dispatcher skip a record
    /// without decoding it in full.
    pub(crate) fn skip_if_overflowed(&self, summary: &EnvelopeSummary<'_>, offset: u64) -> bool {
        if self.delivered_before(offset, summary.stream, summary.topic) {
            return true;
        }
        let (payload_len, received_at_unix_ms) = (summary.payload_len, summary.received_at_unix_ms);
        let mut g = self.gate();
        if g.overflow_from.is_none() {
            return false;
        }
        g.hold(payload_len, received_at_unix_ms);
        g.last_skipped = Some(offset);
        drop(g);
        self.wake.notify_one();
        true
    }

    /// Sending (or about to: a lane just created has not run yet) and not failing:
    /// worth waiting for. A lane that overflowed re-reads its records from the log, which
    /// decodes them a second time; a backlog drained through a new lane must not start so.
    fn is_healthy(&self) -> bool {
        matches!(self.status.get(), Status::Starting | Status::Running) && lock(&self.info).consecutive_failures == 0
    }

    pub(crate) fn snapshot(&self) -> LaneSnapshot {
        let status = self.status.snapshot();
        let (last_error, last_error_at) = status.last_error.map_or((None, None), |(e, at)| (Some(e), Some(at)));
        let g = self.gate();
        let i = lock(&self.info);
        let now_ms = ingest_time_ms();
        LaneSnapshot {
            source: self.key.source.clone(),
            destination: self.key.destination.clone(),
            status: status.status,
            status_reason: status.reason,
            status_since: status.since,
            last_error,
            last_error_at,
            breaker: i.breaker.map_or("closed", |b| b.at(Instant::now()).as_str()),
            delivered_below: self.delivered_below.load(Ordering::Acquire),
            held_records: g.held_records,
            held_bytes: g.held_bytes,
            oldest_held_age_ms: g.oldest_held.map(|o| o.age_ms(now_ms)),
            sent_records: i.sent_records,
            rejected_records: i.rejected_records,
            consecutive_failures: i.consecutive_failures,
            partitions_count: i.topic.map(|t| t.partitions_count),
            not_durable_warning: i.topic.is_some_and(|t| !t.durable),
            overflowed: g.overflow_from.is_some(),
            queued_bytes: g.queued_bytes,
            batch_bytes: self.batch_bytes.load(Ordering::Relaxed),
            send_records_max: i.send_cap.records_max,
        }
    }
}

pub(crate) fn ingest_time_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Decides whether a record read back from the log belongs to a lane: `None` if not,
/// `Some(reason)` if it does (with the dead-letter reason when it is there by rejection).
pub(crate) type BelongsFn = dyn Fn(&LaneKey, &EnvelopeSummary<'_>) -> Option<Option<&'static str>> + Send + Sync;

/// Everything a lane task needs besides its lane.
pub(crate) struct LaneContext<S, C> {
    pub wal: Arc<Wal>,
    pub sink: Arc<S>,
    pub cursors: Arc<C>,
    /// The dispatcher has routed every record below this offset.
    pub processed_below: Arc<AtomicU64>,
    /// Woken after every delivery, so the log can be released.
    pub delivered: Arc<Notify>,
    /// Woken after every acknowledgement, so the cursors get stored.
    pub cursor_dirty: Arc<Notify>,
    pub shutdown: watch::Receiver<bool>,
    /// Degraded/Running of the router as a whole follows its lanes.
    pub router_status: Arc<crate::RouterHealth>,
    /// Whether the server answers writes, for telling a silent destination from a
    /// server that stalls every write ([`bounded_write`]).
    pub writes: Arc<crate::write_watch::WriteWatch>,
    /// The router's bound on what all its lanes keep queued.
    pub queue_budget: Arc<QueueBudget>,
}

impl<S, C> Clone for LaneContext<S, C> {
    fn clone(&self) -> Self {
        LaneContext {
            wal: self.wal.clone(),
            sink: self.sink.clone(),
            cursors: self.cursors.clone(),
            processed_below: self.processed_below.clone(),
            delivered: self.delivered.clone(),
            cursor_dirty: self.cursor_dirty.clone(),
            shutdown: self.shutdown.clone(),
            router_status: self.router_status.clone(),
            writes: self.writes.clone(),
            queue_budget: self.queue_budget.clone(),
        }
    }
}

/// Outcome of delivering a batch, or a range of it.
enum Delivery {
    Done,
    ShuttingDown,
    /// The lane is Degraded and must wait `wait` before its next try: the records of
    /// the batch from index `from` on wait in the log, not in memory ([`Parked`]).
    Park {
        from: usize,
        wait: Duration,
    },
}

/// A batch given back to the log while its lane, Degraded, waits out an outage: the
/// offset, place and dead-letter reason of each record not yet delivered (40 bytes a
/// record, at most `batch_max_records` of them), where the batch held every record's
/// payload, envelope and prepared message. Read back at the next try ([`unpark`]), each
/// record from its place: no walk of a segment, no scan of other destinations' records.
type Parked = Vec<(u64, RecordPlace, Option<&'static str>)>;

/// Spawns the delivery task of `lane`. If it ends by a panic, the lane is in Error, and
/// its connector and the router with it, until a restart: its records stay held.
pub(crate) fn spawn<S: Sink, C: CursorStore>(lane: Arc<Lane>, ctx: LaneContext<S, C>) -> tokio::task::JoinHandle<()> {
    let (watched, health) = (lane.clone(), ctx.router_status.clone());
    crate::spawn_task(run(lane, ctx), move || {
        // The breaker went with the task (its count in the gauge taken back as it was
        // dropped): the status shows none open either.
        lock(&watched.info).breaker = None;
        // So did its batches (the one in flight and the one prepared ahead): their bytes
        // are no longer kept in memory, nor counted against the router's queue budget.
        {
            let mut g = watched.gate();
            let in_batches = g.budgeted_bytes - g.queued_bytes;
            g.count_out(in_batches);
        }
        watched.batch_bytes.store(0, Ordering::Relaxed);
        health.lane_panicked(&watched.key, &watched.status);
    })
}

async fn run<S: Sink, C: CursorStore>(lane: Arc<Lane>, mut ctx: LaneContext<S, C>) {
    // Starting until the first send succeeds (`progressed`) or the lane degrades:
    // "running" is said of a destination that took records, never of one only created.
    let mut breaker = CountedBreaker::new(Breaker::new(lane.policy.breaker.clone()));
    let mut catchup: Option<wal::Reader> = None;
    // The next batch, taken from the queue and prepared while the previous one was in
    // flight (only ever a full one: a short batch is better left to fill).
    let mut ahead: Option<(Vec<Routed>, Prepared<S::Message>)> = None;
    // The previous batch, freed while the next one is in flight.
    let mut done: Option<(Vec<Routed>, Prepared<S::Message>)> = None;
    // The batch given back to the log while the lane waits to try it again, and the
    // leave its try holds once it is read back.
    let mut parked: Option<Parked> = None;
    // The leave a batch read from the log (re-read, or read back) holds until its try
    // ends ([`SendSlots::catch_up`], [`SendSlots::read_back`]).
    let mut leave: Option<tokio::sync::OwnedSemaphorePermit> = None;
    // The status a failed log read put the lane in Error from, to return to.
    let mut before_read_error: Option<(Status, String)> = None;
    loop {
        if *ctx.shutdown.borrow() {
            break;
        }
        let (batch, mut prepared) = match ahead.take() {
            Some(next) => next,
            None => {
                let read = match parked.take() {
                    // Records read before, each once: they were all this lane's. Read on a
                    // blocking thread: after a long outage they may be out of the page
                    // cache, scattered through the log.
                    Some(places) => {
                        let slow_to_fail = {
                            let i = lock(&lane.info);
                            i.slow_to_fail || i.dead_letter_slow_to_fail
                        };
                        let permit = tokio::select! {
                            p = lane.send_slots.read_back(), if slow_to_fail => p,
                            p = lane.send_slots.catch_up(), if !slow_to_fail => p,
                            _ = ctx.shutdown.changed() => None,
                        };
                        let Some(permit) = permit else { break };
                        let wal = ctx.wal.clone();
                        let read = tokio::task::spawn_blocking(move || {
                            let batch = unpark(&wal, &places);
                            (places, batch)
                        })
                        .await;
                        match read {
                            Ok((_, Ok(batch))) => {
                                leave = Some(permit);
                                Ok(Some(batch))
                            }
                            Ok((places, Err(e))) => {
                                parked = Some(places);
                                Err(e)
                            }
                            // A defect: the lane's task ends in Error, as for any panic.
                            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                            // The blocking pool is shutting down with the runtime.
                            Err(_) => break,
                        }
                    }
                    None => {
                        let read = next_batch(&lane, &mut ctx, &mut catchup, &mut leave, &mut done).await;
                        if !matches!(read, Ok(Some(_))) {
                            // Nothing to send: the leave goes (a wait for records, or after
                            // a failed read, holds none).
                            leave = None;
                        }
                        read.map_err(|e| e.to_string())
                    }
                };
                match read {
                    Ok(Some(b)) => {
                        reads_again(&lane, &ctx, &mut before_read_error);
                        let prepared = prepare(&*ctx.sink, &b);
                        (b, prepared)
                    }
                    Ok(None) => {
                        reads_again(&lane, &ctx, &mut before_read_error);
                        continue;
                    }
                    Err(e) => {
                        // The log could not be read (damage): say so and keep trying, slowly.
                        let now = lane.status.snapshot();
                        if now.status != Status::Error {
                            before_read_error = Some((now.status, now.reason));
                        }
                        lane.status.record_error(&e);
                        ctx.router_status.lane_failed(&lane.key, &lane.status, "cannot read the log");
                        tracing::error!(destination = %lane.key, error = %e, "lane cannot read the log");
                        if sleep_or_shutdown(&mut ctx.shutdown, lane.policy.batch.backoff_max).await {
                            break;
                        }
                        continue;
                    }
                }
            }
        };
        let Some(last) = batch.last().map(|r| r.offset) else { continue };
        let batch_size: usize = batch.iter().map(queued_size).sum();
        lane.batch_bytes.store(batch_size, Ordering::Relaxed);
        // A batch taken from the queue (not read from the log with leave) stays counted
        // in the router's budget until its delivery ends.
        let counted_bytes = if leave.is_none() { batch_size } else { 0 };
        // The send is polled first: it writes its request and waits for the answer,
        // and meanwhile the previous batch is freed and the next full batch (if queued)
        // is taken and prepared.
        let (delivery, next) = tokio::join!(
            deliver(&lane, &ctx, &mut breaker, &batch, &mut prepared, &mut catchup, leave.is_some()),
            async {
                drop(done.take());
                take_full_batch(&lane).map(|b| {
                    lane.batch_bytes.fetch_add(b.iter().map(queued_size).sum(), Ordering::Relaxed);
                    let prepared = prepare(&*ctx.sink, &b);
                    (b, prepared)
                })
            }
        );
        ahead = next;
        // The try is over: another batch of the source may be read from the log.
        drop(leave.take());
        match delivery {
            Delivery::ShuttingDown => break,
            Delivery::Park { from, wait } => {
                // Degraded: the wait may last as long as the outage. What it delivered of
                // the batch is acknowledged; the rest, and the batch prepared after it,
                // wait in the log.
                assert!(from < batch.len(), "a batch is parked from a record it has not delivered");
                if from > 0 {
                    acknowledge(&lane, &batch[..from], batch[from].offset, Some(&batch[from]), 0);
                    ctx.cursor_dirty.notify_one();
                }
                parked = Some(park(&lane, &batch[from..], counted_bytes, ahead.take()));
                drop((batch, prepared, done.take()));
                lane.batch_bytes.store(0, Ordering::Relaxed);
                // A breaker opened by this failure cools down for longer than the backoff:
                // no try (and no read of the batch) before it may send.
                let wait = wait.max(breaker.wait(Instant::now()));
                if sleep_or_shutdown(&mut ctx.shutdown, wait).await {
                    break;
                }
                continue;
            }
            Delivery::Done => {}
        }
        // Acknowledged: the cursor flusher stores it; until then the records pin the log.
        acknowledge(&lane, &batch, last + 1, ahead.as_ref().and_then(|(b, _)| b.first()), counted_bytes);
        lane.batch_bytes.store(ahead.as_ref().map_or(0, |(b, _)| b.iter().map(queued_size).sum()), Ordering::Relaxed);
        ctx.cursor_dirty.notify_one();
        done = Some((batch, prepared));
    }
    lane.batch_bytes.store(0, Ordering::Relaxed);
    lane.status.set(Status::Stopped, "shutdown");
}

/// The destination acknowledged `delivered` (or the policy disposed of it): every record
/// of the lane below `below` is delivered, `next_first` is the first record it holds in
/// memory after them (the next batch's, or the parked batch's), if any. The cursor
/// flusher stores the new cursor; until then the records pin the log. `counted_bytes`
/// of a batch taken from the queue are counted out of the router's budget with it (0
/// for a batch read from the log, or for a part of a batch that is parked: the park
/// counts the whole batch out).
fn acknowledge(lane: &Lane, delivered: &[Routed], below: u64, next_first: Option<&Routed>, counted_bytes: usize) {
    let mut g = lane.gate();
    g.count_out(counted_bytes);
    g.acknowledged(below, lane.delivered_below.load(Ordering::Acquire));
    g.in_flight_first = next_first.map(|r| r.offset);
    g.held_records = g.held_records.saturating_sub(delivered.len() as u64);
    let bytes: u64 = delivered.iter().map(|r| r.envelope.payload.len() as u64).sum();
    g.held_bytes = g.held_bytes.saturating_sub(bytes);
    // The oldest record still held: the next batch's first, else the queue's front,
    // else (re-reading the log, nothing read yet) one received no earlier than the last
    // record just delivered.
    let oldest = if g.held_records == 0 {
        None
    } else {
        next_first
            .or(g.queue.front())
            .or(delivered.last())
            .map(|r| r.envelope.header.received_at_unix_ms)
            .or(g.oldest_held.map(|o| o.received_at_unix_ms))
    };
    g.note_oldest_held(oldest);
}

/// Gives `undelivered` (the rest of a batch, in log order, never empty) and `ahead`
/// (the batch prepared after it) back to the log: the first pins the log as a batch in
/// flight does until it is read back and delivered, the second is re-read with the
/// lane's other records (it lies below anything queued or skipped since). Returns the
/// places to read `undelivered` back from. Both are dropped outside the gate's lock, and
/// counted out of the router's budget: `counted_bytes` of the batch (0 for one read
/// from the log), and all of `ahead` (taken from the queue).
fn park<M>(lane: &Lane, undelivered: &[Routed], counted_bytes: usize, ahead: Option<(Vec<Routed>, M)>) -> Parked {
    let parked: Parked = undelivered.iter().map(|r| (r.offset, r.place, r.dead_letter_reason)).collect();
    let spilled = {
        let mut g = lane.gate();
        g.in_flight_first = undelivered.first().map(|r| r.offset);
        let ahead_bytes: usize = ahead.as_ref().map_or(0, |(b, _)| b.iter().map(queued_size).sum());
        g.count_out(counted_bytes + ahead_bytes);
        if let Some((b, _)) = &ahead
            && let (Some(first), Some(last)) = (b.first(), b.last())
        {
            g.re_read(first.offset, last.offset);
        }
        // A lane parked before it is Degraded still queues: what it queued lies after the
        // batch prepared ahead, and goes to the log with it, or it would be sent before
        // that batch is read again (and its acknowledgement would pass over it).
        g.spill()
    };
    drop(ahead);
    if !spilled.is_empty() {
        drop(spilled);
        lane.space.notify_waiters();
    }
    parked
}

/// A parked batch read back from the log, each record from its place, checked as any
/// read is.
fn unpark(wal: &Wal, parked: &Parked) -> Result<Vec<Routed>, String> {
    parked
        .iter()
        .map(|&(offset, place, reason)| {
            let rec = wal.read_placed(offset, place).map_err(|e| e.to_string())?;
            let envelope = Envelope::decode(&rec.payload)
                .map_err(|e| format!("record {offset}, read again, cannot be decoded: {e}"))?;
            Ok(Routed::new(offset, place, envelope, reason))
        })
        .collect()
}

/// Takes a full batch from the queue, if one is queued; never waits.
fn take_full_batch(lane: &Lane) -> Option<Vec<Routed>> {
    let (max_records, max_bytes) = (lane.policy.batch.batch_max_records, lane.policy.batch.batch_max_bytes);
    let batch = {
        let mut g = lane.gate();
        let full = g.queue.len() >= max_records
            || g.queue
                .iter()
                .scan(BatchBytes::default(), |b, r| {
                    b.add(r);
                    Some(*b)
                })
                .any(|b| b.full(max_bytes));
        if !full {
            return None;
        }
        take_from_queue(&mut g, max_records, max_bytes)
    };
    lane.space.notify_waiters();
    Some(batch)
}

/// One of the source's send slots, or `None` once a stop is asked (or the router is
/// gone) before or while waiting for it: a stopping lane starts no new call. Lanes that
/// wait for a slot behind calls that never answer would otherwise each start one more,
/// a few at a time, long past the daemon's grace period.
async fn slot_or_shutdown<'a>(
    lane: &'a Lane,
    failing: bool,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<SendSlot<'a>> {
    if *shutdown.borrow() {
        return None;
    }
    tokio::select! {
        biased;
        _ = shutdown.changed() => None,
        slot = lane.send_slots.acquire(failing) => slot,
    }
}

async fn sleep_or_shutdown(shutdown: &mut watch::Receiver<bool>, d: Duration) -> bool {
    if *shutdown.borrow() {
        return true;
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = shutdown.changed() => true,
    }
}

/// Records a lane re-reading the log scans before it lets the runtime's other tasks run,
/// and then goes on filling its batch. A destination with a small share of a long
/// backlog finds few of its records in it: without a yield, filling one batch would scan
/// the whole backlog (gigabytes), holding a worker of the runtime the door and every
/// other lane share (the only one, on a 2-core host) for as long. Stopping the batch at
/// the bound instead would send batches of a few records. 4096 records is a few
/// milliseconds.
const CATCHUP_SCAN_RECORDS_PER_YIELD: usize = 4096;

/// The next batch: from the queue, or re-read from the log while overflowed. `None`
/// when there was nothing yet (after waiting for a wake-up).
async fn next_batch<S, C>(
    lane: &Arc<Lane>,
    ctx: &mut LaneContext<S, C>,
    catchup: &mut Option<wal::Reader>,
    leave: &mut Option<tokio::sync::OwnedSemaphorePermit>,
    done: &mut Option<(Vec<Routed>, Prepared<S::Message>)>,
) -> wal::Result<Option<Vec<Routed>>>
where
    S: Sink,
{
    let max_records = lane.policy.batch.batch_max_records;
    let max_bytes = lane.policy.batch.batch_max_bytes;
    let queued = {
        let mut g = lane.gate();
        if g.queue.is_empty() { Err(g.overflow_from) } else { Ok(take_from_queue(&mut g, max_records, max_bytes)) }
    };
    let overflow_from = match queued {
        Ok(batch) => {
            lane.space.notify_waiters();
            // The last batch, counted out of the budget as it was delivered, is not kept
            // through a linger (up to a day) either.
            drop(done.take());
            return Ok(Some(linger(lane, batch, &mut ctx.shutdown).await));
        }
        Err(overflow_from) => overflow_from,
    };
    let Some(from) = overflow_from else {
        // The next batch may be long in coming: the last one is not kept meanwhile (it is
        // otherwise freed while the next one's send is in flight).
        drop(done.take());
        tokio::select! {
            _ = lane.wake.notified() => {}
            _ = ctx.shutdown.changed() => {}
        }
        return Ok(None);
    };
    // Re-read this lane's records from the log, up to what the dispatcher has routed.
    let limit = ctx.processed_below.load(Ordering::Acquire);
    let reader = match catchup {
        Some(r) if r.position() == from => r,
        _ => catchup.insert(ctx.wal.reader(from)?),
    };
    crate::walk_to_position(reader).await?;
    // The same limits as a batch taken from the queue: at most `max_records`, and payload
    // bytes within `max_bytes` unless a single record is larger (it goes alone). Reads
    // ask for no more than the room left, and a record past the byte room is read again
    // first next time.
    let mut batch = Vec::new();
    let mut bytes = BatchBytes::default();
    let mut scanned_since_yield = 0usize;
    'read: while reader.position() < limit && batch.len() < max_records && !bytes.full(max_bytes) {
        if scanned_since_yield >= CATCHUP_SCAN_RECORDS_PER_YIELD {
            tokio::task::yield_now().await;
            scanned_since_yield = 0;
        }
        let want = ((limit - reader.position()) as usize)
            .min(max_records - batch.len())
            .min(CATCHUP_SCAN_RECORDS_PER_YIELD - scanned_since_yield);
        let records = read_below(reader, &ctx.wal, limit, want, max_bytes - bytes.payload)?;
        if records.is_empty() {
            break;
        }
        scanned_since_yield += records.len();
        let mut wait_for_leave = false;
        for rec in records {
            let offset = rec.offset;
            if let Some(routed) = own_record(lane, rec) {
                // A batch re-read from the log waits for its send slot in memory: it is
                // filled only with leave ([`SendSlots::catch_up`]), taken at its first
                // record (the scan to it holds none) and kept by the caller until its try
                // ends. With none free, this record and those read after it are given
                // back to the reader, which waits for one holding nothing read.
                if leave.is_none() {
                    match lane.send_slots.try_catch_up() {
                        Some(permit) => *leave = Some(permit),
                        None => {
                            if !reader.unread_from(offset) || reader.position() != offset {
                                *reader = ctx.wal.reader(offset)?;
                            }
                            wait_for_leave = true;
                            break;
                        }
                    }
                }
                if !batch.is_empty() && bytes.would_pass(&routed, max_bytes) {
                    // Given back to the reader with those read after it, read again
                    // first next time: a new reader would walk the segment from its
                    // start to find it. By payload bytes it is the last record the read
                    // returned (the read asks for no more than that room); by the
                    // bytes a send may carry it can be any of them.
                    if !reader.unread_from(offset) || reader.position() != offset {
                        *reader = ctx.wal.reader(offset)?;
                    }
                    break 'read;
                }
                bytes.add(&routed);
                batch.push(routed);
            }
        }
        if wait_for_leave {
            drop(done.take());
            reader.release_buffer();
            // Stopping meanwhile, nothing was taken: the next start reads again.
            let permit = tokio::select! {
                p = lane.send_slots.catch_up() => p,
                _ = ctx.shutdown.changed() => None,
            };
            let Some(permit) = permit else { return Ok(None) };
            *leave = Some(permit);
        }
    }
    let pos = reader.position();
    let (caught_up, found_nothing) = {
        let mut g = lane.gate();
        // Caught up with the dispatcher: the read reached what it had routed, and nothing
        // it skipped for this lane since lies at or beyond the read position. The lane
        // queues again from here, with or without a batch read: under the gate's lock the
        // dispatcher's next offer of this lane's records (all at or past `pos`) is queued,
        // and the batch (below `pos`) is sent before anything queued. Waiting for a read
        // that finds nothing instead kept a lane whose destination receives a record per
        // send re-reading the log for as long as that traffic lasted, every other
        // destination's records summarised again on each read.
        let caught_up = pos >= limit && g.last_skipped.is_none_or(|s| s < pos);
        if caught_up {
            g.overflow_from = None;
            g.last_skipped = None;
        } else {
            // The next read starts at `pos` (with this reader), not again at `from`:
            // below it, this lane's records are in the batch, if any.
            g.overflow_from = Some(pos);
        }
        if batch.is_empty() && pos >= limit {
            (caught_up, true)
        } else {
            g.in_flight_first = batch.first().map(|r| r.offset);
            // Re-read from the log, this batch's first record is the oldest held.
            if let Some(first) = batch.first() {
                g.note_oldest_held(Some(first.envelope.header.received_at_unix_ms));
            }
            (caught_up, false)
        }
    };
    if caught_up {
        *catchup = None;
    }
    match (found_nothing, caught_up) {
        (true, true) => Ok(None),
        (true, false) => {
            // The dispatcher is ahead of `limit` by now; read on.
            tokio::task::yield_now().await;
            Ok(None)
        }
        (false, _) => Ok(Some(batch)),
    }
}

/// At most `max_records` records (and `max_bytes` of payload, as [`wal::Reader::try_read`]
/// bounds them) from `reader`'s position, every one below `limit`; the first at or past it
/// is given back, read again first next time.
///
/// A read counts records and `limit` is an offset: across a salvage gap (offsets that
/// name no record) the read asked for `limit - position` records returns records past
/// `limit`. The dispatcher has not routed those yet: a record it will refuse or hold must
/// not be sent, nor acknowledged past, by a lane re-reading the log.
fn read_below(
    reader: &mut wal::Reader,
    wal: &Wal,
    limit: u64,
    max_records: usize,
    max_bytes: usize,
) -> wal::Result<Vec<Record>> {
    let mut records = reader.try_read(max_records, max_bytes)?;
    if let Some(i) = records.iter().position(|r| r.offset >= limit) {
        let first_past = records[i].offset;
        records.truncate(i);
        if !reader.unread_from(first_past) || reader.position() != first_past {
            *reader = wal.reader(first_past)?;
        }
    }
    debug_assert!(records.iter().all(|r| r.offset < limit));
    Ok(records)
}

fn own_record(lane: &Lane, rec: Record) -> Option<Routed> {
    // Other lanes' records are told apart from the summary; only this lane's are decoded.
    let summary = Envelope::summarize(&rec.payload).ok()?;
    if lane.delivered_before(rec.offset, summary.stream, summary.topic) {
        return None;
    }
    let reason = (lane.belongs)(&lane.key, &summary)?;
    let envelope = Envelope::decode(&rec.payload).ok()?;
    Some(Routed::new(rec.offset, rec.place, envelope, reason))
}

/// What a queued record holds in memory, as `lane_queue_max_bytes` counts it: its
/// record's bytes (the payload and the encoded header its payload is a slice of), the
/// decoded header's strings, and the `Routed` itself. A lane stuck with records of tiny
/// payloads and long headers holds their headers, not only their payloads.
fn queued_size(r: &Routed) -> usize {
    let header = r.envelope.header.heap_bytes();
    r.envelope.payload.len() + 2 * header + std::mem::size_of::<Routed>()
}

/// The bytes `r`'s message takes in a send, at most: Iggy's 64-byte message header and
/// 16-byte index entry, its payload, and each user header as the protocol encodes it
/// (a kind and a length beside the name and the value: 10 bytes more), the dead-letter
/// headers as the most they can be. [`out_message`] builds the headers counted here.
fn send_bytes(r: &Routed) -> usize {
    const MESSAGE_OVERHEAD_BYTES: usize = 64 + 16;
    let header = |name: usize, value: usize| 10 + name + value;
    let h = &r.envelope.header;
    let mut bytes =
        MESSAGE_OVERHEAD_BYTES + r.envelope.payload.len() + header("iggy-ingest-source".len(), h.source_key.len());
    if let Some(ct) = &h.content_type {
        bytes += header("content-type".len(), ct.len());
    }
    bytes += h.metadata.iter().map(|(k, v)| header(k.len(), v.len())).sum::<usize>();
    bytes += h.headers.iter().map(|(k, v)| header(k.len(), v.len())).sum::<usize>();
    if r.dead_letter_reason.is_some() {
        bytes += DEAD_LETTER_HEADERS_MAX_BYTES;
    }
    bytes
}

/// The most bytes the headers a dead-lettered message gains take in a send: four (the
/// reason, the stream, the topic and both), names under 32 bytes, values at most 255,
/// each with the kind and length the protocol adds (10 bytes).
const DEAD_LETTER_HEADERS_MAX_BYTES: usize = 4 * (10 + 32 + crate::iggy_sink::HEADER_FIELD_MAX_BYTES);

/// Where a send of `records[from..end]` must stop (at most `end`, at least one record
/// past `from`) for its messages to take at most [`crate::SEND_MESSAGES_MAX_BYTES`],
/// each `extra_each` bytes more than [`send_bytes`] counted when its batch was made.
fn end_within_send_bytes(records: &[Routed], from: usize, end: usize, extra_each: usize) -> usize {
    let mut bytes = 0usize;
    for (i, r) in records[from..end].iter().enumerate() {
        bytes = bytes.saturating_add(r.send_bytes.saturating_add(extra_each));
        if i > 0 && bytes > crate::SEND_MESSAGES_MAX_BYTES {
            return from + i;
        }
    }
    end
}

/// A batch's size by both of its byte bounds: the payload bytes `batch_max_bytes` counts,
/// and the bytes its messages take in the send, which [`crate::SEND_MESSAGES_MAX_BYTES`]
/// bounds whatever the payloads are.
#[derive(Debug, Clone, Copy, Default)]
struct BatchBytes {
    payload: usize,
    send: usize,
}

impl BatchBytes {
    fn add(&mut self, r: &Routed) {
        self.payload += r.envelope.payload.len();
        self.send += r.send_bytes;
    }

    /// Whether adding `r` would pass either bound (a batch's first record is taken
    /// whatever its size: it goes alone).
    fn would_pass(&self, r: &Routed, max_payload_bytes: usize) -> bool {
        self.payload + r.envelope.payload.len() > max_payload_bytes
            || self.send + r.send_bytes > crate::SEND_MESSAGES_MAX_BYTES
    }

    fn full(&self, max_payload_bytes: usize) -> bool {
        self.payload >= max_payload_bytes || self.send >= crate::SEND_MESSAGES_MAX_BYTES
    }
}

fn take_from_queue(g: &mut Gate, max_records: usize, max_bytes: usize) -> Vec<Routed> {
    let mut batch = Vec::new();
    let mut bytes = BatchBytes::default();
    while let Some(front) = g.queue.front() {
        if !batch.is_empty() && (batch.len() >= max_records || bytes.would_pass(front, max_bytes)) {
            break;
        }
        bytes.add(front);
        if let Some(r) = g.pop_front() {
            batch.push(r);
        }
    }
    // The batch's bytes stay counted in the router's budget until its delivery ends
    // ([`Gate::count_out`]).
    if let Some(first) = batch.first() {
        g.in_flight_first = Some(g.in_flight_first.map_or(first.offset, |f| f.min(first.offset)));
    }
    batch
}

/// Lets a short batch fill for up to `linger`, topping it up as records are queued and
/// returning as soon as it is full: a lane draining a backlog never waits, a lane fed
/// slowly waits at most `linger` per batch. A shutdown ends the wait: the router's stop
/// is not held for a linger (at most a day).
async fn linger(lane: &Lane, mut batch: Vec<Routed>, shutdown: &mut watch::Receiver<bool>) -> Vec<Routed> {
    if lane.policy.batch.linger.is_zero() || *shutdown.borrow() {
        return batch;
    }
    let deadline = Instant::now() + lane.policy.batch.linger;
    loop {
        // Registered before the queue is looked at, so an offer in between still wakes us.
        let queued = lane.wake.notified();
        tokio::pin!(queued);
        queued.as_mut().enable();
        match top_up(lane, &mut batch, true) {
            TopUp::Full => break,
            TopUp::Moved => continue,
            TopUp::Waiting => {}
        }
        tokio::select! {
            _ = &mut queued => {}
            _ = tokio::time::sleep_until(deadline) => break,
            _ = shutdown.changed() => break,
        }
    }
    // Also puts the lane's wake-up threshold back to "any record".
    top_up(lane, &mut batch, false);
    batch
}

enum TopUp {
    /// The batch reached a limit.
    Full,
    /// Records were added and there is room for more.
    Moved,
    /// Nothing queued; with `lingering`, the lane is woken once the batch could fill.
    Waiting,
}

/// Moves queued records onto `batch` within the batch limits. While `lingering`, the lane
/// asks to be woken only once enough records are queued to fill the batch (one wake-up per
/// batch, not one per record); otherwise, as normally, by any record.
fn top_up(lane: &Lane, batch: &mut Vec<Routed>, lingering: bool) -> TopUp {
    let (max_records, max_bytes) = (lane.policy.batch.batch_max_records, lane.policy.batch.batch_max_bytes);
    let mut bytes = batch.iter().fold(BatchBytes::default(), |mut b, r| {
        b.add(r);
        b
    });
    let mut g = lane.gate();
    let mut moved = false;
    let mut full = batch.len() >= max_records || bytes.full(max_bytes);
    while !full && let Some(front) = g.queue.front() {
        if bytes.would_pass(front, max_bytes) {
            full = true;
            break;
        }
        bytes.add(front);
        if let Some(r) = g.pop_front() {
            batch.push(r);
            moved = true;
        }
        full = batch.len() >= max_records || bytes.full(max_bytes);
    }
    // Counted until the batch's delivery ends, as in `take_from_queue`.
    let lingers = lingering && !full;
    // Woken once the queue holds what fills the batch, by count or by bytes; a batch
    // larger than the queue is woken when the queue is full, and tops up again.
    g.wake_at_queued = if lingers { (max_records - batch.len()).min(lane.policy.lane_queue_max_records) } else { 0 };
    // Never more than the queue holds by bytes either, or a lingering lane whose queue
    // filled by bytes would never be woken (and its offers refused meanwhile).
    g.wake_at_bytes = if lingers { (max_bytes - bytes.payload).min(lane.policy.lane_queue_max_bytes) } else { 0 };
    drop(g);
    if moved {
        lane.space.notify_waiters();
    }
    match (full, moved) {
        (true, _) => TopUp::Full,
        (false, true) => TopUp::Moved,
        (false, false) => TopUp::Waiting,
    }
}

fn out_message(r: &Routed) -> OutMessage<'_> {
    let h = &r.envelope.header;
    let mut headers: Vec<(&str, Cow<'_, [u8]>)> = Vec::with_capacity(h.metadata.len() + h.headers.len() + 4);
    headers.push(("iggy-ingest-source", Cow::Borrowed(h.source_key.as_bytes())));
    if let Some(ct) = &h.content_type {
        headers.push(("content-type", Cow::Borrowed(ct.as_bytes())));
    }
    for (k, v) in &h.metadata {
        headers.push((k, Cow::Borrowed(v.as_bytes())));
    }
    for (k, v) in &h.headers {
        headers.push((k, Cow::Borrowed(v)));
    }
    if let Some(reason) = r.dead_letter_reason {
        rejected_headers(&mut headers, reason, &h.destination);
    }
    OutMessage { id: h.message_id, payload: &r.envelope.payload, headers }
}

/// The headers a dead-lettered message carries: why, and where it was bound. The
/// stream and the topic each have a header of their own, which always fits (a name is at
/// most 255 bytes, as is a header value); `stream/topic` in one header is there too when
/// it fits, and left out (not sent to be dropped by the sink and counted) when it does
/// not.
pub(crate) fn rejected_headers<'a>(
    headers: &mut Vec<(&'a str, Cow<'a, [u8]>)>,
    reason: &'static str,
    d: &'a Destination,
) {
    headers.push(("iggy-ingest-rejected-reason", Cow::Borrowed(reason.as_bytes())));
    headers.push(("iggy-ingest-destination-stream", Cow::Borrowed(d.stream.as_bytes())));
    headers.push(("iggy-ingest-destination-topic", Cow::Borrowed(d.topic.as_bytes())));
    if d.stream.len() + 1 + d.topic.len() <= crate::iggy_sink::HEADER_FIELD_MAX_BYTES {
        headers.push(("iggy-ingest-destination", Cow::Owned(format!("{}/{}", d.stream, d.topic).into_bytes())));
    }
}

/// A batch's messages in the sink's form, or why the sink cannot take them.
type Prepared<M> = Result<Vec<M>, SendError>;

fn prepare<S: Sink>(sink: &S, batch: &[Routed]) -> Prepared<S::Message> {
    let messages: Vec<OutMessage<'_>> = batch.iter().map(out_message).collect();
    sink.prepare(&messages)
}

/// Delivers one batch: ensures the destination, applies the partition check, and sends
/// each run of equal partitioning, retrying until acknowledged.
async fn deliver<S: Sink, C>(
    lane: &Lane,
    ctx: &LaneContext<S, C>,
    breaker: &mut CountedBreaker,
    batch: &[Routed],
    prepared: &mut Prepared<S::Message>,
    catchup: &mut Option<wal::Reader>,
    from_log: bool,
) -> Delivery {
    let mut shutdown = ctx.shutdown.clone();
    // A batch read back after a park goes on counting the failures before it (0 for any
    // other: a batch starts after its predecessor was delivered).
    let mut failures: u32 = lock(&lane.info).consecutive_failures;
    // Set once the topic's partitions were asked of the server for this batch: what it
    // answered decides every run of the batch. Before that, the count is what the lane
    // learnt earlier, and an operator may have added partitions since.
    let mut asked = false;
    let mut i = 0;
    while i < batch.len() {
        // The rest of a run parked while it was dead-lettered goes where the rest went,
        // whatever the topic has since: a send to the dead-letter topic cut short by the
        // timeout may have stored records there, and a record is in one destination.
        let dead_lettering = lock(&lane.info).dead_lettering_through.filter(|&t| batch[i].offset <= t);
        if let (Some(through), Some(dlq)) = (dead_lettering, lane.policy.dead_letter.as_ref()) {
            let end = batch[i..].iter().position(|r| r.offset > through).map_or(batch.len(), |k| i + k);
            release_reader(catchup);
            match dead_letter(lane, ctx, dlq, &batch[i..end], from_log, &mut shutdown).await {
                Delivery::Done => {
                    i = end;
                    continue;
                }
                Delivery::ShuttingDown => return Delivery::ShuttingDown,
                Delivery::Park { from, wait } => return Delivery::Park { from: i + from, wait },
            }
        }
        // Make sure the destination exists and its partitions are known.
        let cached = lock(&lane.info).topic;
        let topic = match cached {
            Some(t) => t,
            None => match attempt(lane, ctx, breaker, &mut failures, Op::Ensure, from_log, &mut shutdown).await {
                Attempt::Ensured(t) => {
                    asked = true;
                    t
                }
                Attempt::Retry => {
                    release_reader(catchup);
                    continue;
                }
                Attempt::Park(wait) => {
                    release_reader(catchup);
                    return Delivery::Park { from: i, wait };
                }
                Attempt::Sent | Attempt::ShuttingDown => return Delivery::ShuttingDown,
            },
        };
        let partitioning = send_partitioning(&batch[i]);
        let mut end = i + 1;
        while end < batch.len() && send_partitioning(&batch[end]) == partitioning {
            end += 1;
        }
        if let Partitioning::PartitionId(p) = partitioning
            && p >= topic.partitions_count
        {
            if !asked {
                // Out of range by a count learnt earlier: the topic may have gained
                // partitions since. Dropping, dead-lettering or holding a record whose
                // partition exists would be wrong, so the server is asked first (once
                // for the batch; its answer is trusted for the rest of it), as after a
                // failed send: by forgetting what the lane learnt.
                lock(&lane.info).topic = None;
                continue;
            }
            // The server just answered for the destination (`asked`): whatever failed
            // before, these records are out of range, which is never a breaker failure.
            // A breaker left half-open (or a count of failures) through a hold that can
            // last hours would say "open", and "failing", of a destination that answers.
            // Closed, it counts from zero again with the lane: else the next single
            // failure would open it.
            if breaker.state() != BreakerState::Closed {
                tracing::info!(destination = %lane.key, "circuit breaker closed: the destination answers; its records are out of range");
            }
            close_breaker(lane, breaker);
            failures = 0;
            lock(&lane.info).consecutive_failures = 0;
            release_reader(catchup);
            match out_of_range(lane, ctx, &batch[i..end], p, topic, from_log, &mut shutdown).await {
                Delivery::Done => {
                    i = end;
                    continue;
                }
                Delivery::ShuttingDown => return Delivery::ShuttingDown,
                // Held until the topic has the partition (parked from the run on), or
                // dead-lettered while that destination fails (parked from the first
                // record not yet there).
                Delivery::Park { from, wait } => return Delivery::Park { from: i + from, wait },
            }
        }
        // Disposing of out-of-range records sends nothing to this destination: only what
        // is sent here is capped.
        let end = lock(&lane.info).send_cap.end(i, end);
        let op = match prepared {
            Ok(messages) => Op::Send(&partitioning, &mut messages[i..end]),
            Err(e) => Op::Unsendable(e.clone()),
        };
        match attempt(lane, ctx, breaker, &mut failures, op, from_log, &mut shutdown).await {
            Attempt::Sent => {
                metrics::counter!("iggy_connector_messages_routed_total", "connector_key" => lane.key.source.clone())
                    .increment((end - i) as u64);
                lock(&lane.info).sent_records += (end - i) as u64;
                i = end;
            }
            Attempt::Retry => release_reader(catchup),
            Attempt::Park(wait) => {
                release_reader(catchup);
                return Delivery::Park { from: i, wait };
            }
            Attempt::Ensured(_) => {}
            Attempt::ShuttingDown => return Delivery::ShuttingDown,
        }
    }
    // Every record is sent or disposed of. A breaker still not closed was opened by
    // failures on records the destination then answered for (its topic ensured) and that
    // were disposed of without a send (out of range, dropped or dead-lettered): with
    // nothing left to send, no probe would ever close it, and its gauge would say
    // "open" for good. The next failure counts from zero (a closed breaker's count of
    // failures too: the destination answered).
    if breaker.state() != BreakerState::Closed {
        tracing::info!(destination = %lane.key, "circuit breaker closed: nothing is left to send");
    }
    close_breaker(lane, breaker);
    Delivery::Done
}

/// A try failed (or holds): the batch waits, perhaps for hours (an outage, a hold). The
/// reader re-reading the log keeps its position but not its read window meanwhile:
/// memory outside the queue budget would otherwise grow with the lanes waiting.
fn release_reader(catchup: &mut Option<wal::Reader>) {
    if let Some(r) = catchup.as_mut() {
        r.release_buffer();
    }
}

/// Closes `breaker` and publishes it (status; the open-breakers gauge follows the state).
fn close_breaker(lane: &Lane, breaker: &mut CountedBreaker) {
    breaker.on_success();
    lock(&lane.info).breaker = Some(breaker.state());
}

/// A lane's breaker, counted in `iggy_connector_destination_circuit_open` while it is not
/// closed (open, or half-open for its probe). The count moves here only, with the state,
/// and is taken back when the breaker is dropped: the lane's task ended (shutdown, or a
/// panic), and a breaker nobody holds is open for no one.
struct CountedBreaker {
    breaker: Breaker,
    counted: bool,
}

impl CountedBreaker {
    fn new(breaker: Breaker) -> CountedBreaker {
        let mut b = CountedBreaker { breaker, counted: false };
        b.publish();
        b
    }

    fn state(&self) -> BreakerState {
        self.breaker.state()
    }

    fn wait(&mut self, now: Instant) -> Duration {
        let wait = self.breaker.wait(now);
        self.publish();
        wait
    }

    fn on_failure(&mut self, now: Instant) {
        self.breaker.on_failure(now);
        self.publish();
    }

    fn on_success(&mut self) {
        self.breaker.on_success();
        self.publish();
    }

    /// Moves the gauge to the state: counted once while not closed.
    fn publish(&mut self) {
        let open = self.breaker.state() != BreakerState::Closed;
        if open != self.counted {
            self.counted = open;
            let gauge = metrics::gauge!("iggy_connector_destination_circuit_open");
            if open { gauge.increment(1.0) } else { gauge.decrement(1.0) }
        }
    }
}

impl Drop for CountedBreaker {
    fn drop(&mut self) {
        if self.counted {
            metrics::gauge!("iggy_connector_destination_circuit_open").decrement(1.0);
        }
    }
}

/// How a record is sent: as it was accepted, except a dead-lettered record, which is
/// balanced. Its partition id or key was chosen for the destination it was refused, not
/// for the dead-letter topic (which may have fewer partitions: an id beyond them would
/// fail every send of the dead-letter lane for good).
fn send_partitioning(r: &Routed) -> Partitioning {
    if r.dead_letter_reason.is_some() {
        Partitioning::Balanced
    } else {
        r.envelope.header.destination.partitioning.clone()
    }
}

/// An answer to another call within the last `1 / ANSWERED_RECENTLY_SHARE` of a call's
/// wait shows the server answering at its end: a quarter (750 ms of a 3 s result
/// timeout). Earlier, a ping is asked instead.
const ANSWERED_RECENTLY_SHARE: u32 = 4;

/// `call`, cut short after `timeout`. A call cut short failed at its destination
/// (`Timeout`, which its breaker counts) only if the server answers at its end: some
/// other call answered in the last quarter of its wait ([`ANSWERED_RECENTLY_SHARE`]), or else a
/// probe right after (bounded by the same timeout). An answer early in the wait says
/// nothing of a server that went silent since (an outage's first moments). While the
/// sink was still connecting, or the server answers nothing, the server as a whole is
/// what does not answer, which is every destination's: `Unavailable`, which no breaker
/// counts.
///
/// Beside the result, for a call cut short (whatever it is taken for), where the last part of its
/// wait began, for [`bounded_write`] to judge writes by: taken when the timeout fired,
/// `timeout / ANSWERED_RECENTLY_SHARE` before then and never before the call began (the
/// answers are timed by the real clock, which a test's paused one outruns).
async fn bounded<S: Sink, T>(
    sink: &S,
    timeout: Duration,
    call: impl std::future::Future<Output = Result<T, SendError>>,
) -> (Result<T, SendError>, Option<std::time::Instant>) {
    let started = std::time::Instant::now();
    match tokio::time::timeout(timeout, call).await {
        Ok(result) => (result, None),
        Err(_) => {
            let recently = std::time::Instant::now()
                .checked_sub(timeout / ANSWERED_RECENTLY_SHARE)
                .map_or(started, |t| t.max(started));
            if sink.connecting() {
                let e = SendError::new(SendErrorKind::Unavailable, "not connected within the result timeout");
                return (Err(e), Some(recently));
            }
            let answers = sink.answered_since(recently)
                || tokio::time::timeout(timeout, sink.server_answers()).await.unwrap_or(false);
            let e = if answers {
                SendError::new(SendErrorKind::Timeout, "no answer within the result timeout")
            } else {
                SendError::new(SendErrorKind::Unavailable, "the server answered nothing within the result timeout")
            };
            (Err(e), Some(recently))
        }
    }
}

/// A call that writes to `dest` (a send, or an ensure that may create the topic), cut
/// short after `timeout`, as [`bounded`] but telling a server that stalls every write
/// from a silent destination ([`crate::write_watch`]): a call cut short while no write
/// was answered in the last part of its wait (or since), and another destination's went
/// unanswered meanwhile, is
/// the server's (`Unavailable`, no breaker counts it), even though the server still
/// answers pings. Only an acknowledged send (`ok_is_write`) is noted as a write
/// answered: a refusal may come from the client itself (a name it cannot encode) or from
/// a server that validates but writes nothing, and an ensure may have only read.
async fn bounded_write<S: Sink, C, T>(
    ctx: &LaneContext<S, C>,
    dest: &DestinationKey,
    timeout: Duration,
    ok_is_write: bool,
    call: impl std::future::Future<Output = Result<T, SendError>>,
) -> Result<T, SendError> {
    let (result, recently) = bounded(&*ctx.sink, timeout, call).await;
    match (&result, recently) {
        (Ok(_), _) if ok_is_write => ctx.writes.answered(),
        (Err(e), Some(recently)) if e.kind == SendErrorKind::Timeout && ctx.writes.unanswered(dest, recently) => {
            return Err(SendError::new(
                SendErrorKind::Unavailable,
                "the server answered no write within the result timeout, to this destination or another",
            ));
        }
        // Cut short while the sink was connecting (for another lane's call, say: a call
        // cut short costs its connection) or while the server answered nothing: no
        // breaker counts it, and it is still a write gone unanswered, which the watch
        // must hear of. Unheard, a server that stalls every write, its lanes timing out
        // in step as each reconnects for the next try, showed the watch one silent
        // destination alone, whose breaker then opened.
        (Err(e), Some(recently)) if e.kind == SendErrorKind::Unavailable => {
            ctx.writes.unanswered(dest, recently);
        }
        _ => {}
    }
    result
}

/// What an attempt does.
enum Op<'a, M> {
    /// Make sure the destination exists.
    Ensure,
    /// Send these messages with this partitioning.
    Send(&'a Partitioning, &'a mut [M]),
    /// The sink could not prepare the messages: fail as a send would.
    Unsendable(SendError),
}

enum Attempt {
    Sent,
    Ensured(TopicInfo),
    Retry,
    ShuttingDown,
    /// Failed, and the lane is Degraded: wait this long before the next try, the batch
    /// in the log meanwhile ([`Delivery::Park`]).
    Park(Duration),
}

/// A failed attempt that held its send slot for `1 / SLOW_TO_FAIL_SHARE` of the result
/// timeout or more makes its lane slow to fail ([`Info::slow_to_fail`]): a send the
/// server answers takes milliseconds, so a failure that took that long is a destination
/// (or a server) that keeps slots, whatever it was blamed on in the end.
const SLOW_TO_FAIL_SHARE: u32 = 4;

/// Whether a lane is slow to fail after an attempt that held its slot for `held` under
/// `timeout` and succeeded or not, from `was`: any success clears it, a failure that
/// held the slot long sets it, a quicker failure leaves it as it was.
fn slow_to_fail_after(was: bool, succeeded: bool, held: Duration, timeout: Duration) -> bool {
    if succeeded { false } else { was || held >= timeout / SLOW_TO_FAIL_SHARE }
}

/// One try of an ensure or a send, with breaker, backoff and status.
async fn attempt<S: Sink, C>(
    lane: &Lane,
    ctx: &LaneContext<S, C>,
    breaker: &mut CountedBreaker,
    failures: &mut u32,
    op: Op<'_, S::Message>,
    from_log: bool,
    shutdown: &mut watch::Receiver<bool>,
) -> Attempt {
    let wait = breaker.wait(Instant::now());
    lock(&lane.info).breaker = Some(breaker.state());
    if !wait.is_zero() && sleep_or_shutdown(shutdown, wait).await {
        return Attempt::ShuttingDown;
    }
    let wait = breaker.wait(Instant::now());
    lock(&lane.info).breaker = Some(breaker.state());
    if !wait.is_zero() {
        return Attempt::Retry;
    }
    let slow_to_fail = lock(&lane.info).slow_to_fail;
    let Some(_slot) = slot_or_shutdown(lane, slow_to_fail, shutdown).await else { return Attempt::ShuttingDown };
    let held_from = Instant::now();
    let timeout = lane.policy.batch.result_timeout;
    let result: Result<Option<TopicInfo>, SendError> = match op {
        Op::Unsendable(e) => Err(e),
        Op::Ensure => {
            bounded_write(ctx, lane.dest(), timeout, false, ensure_timed(&*ctx.sink, lane.dest())).await.map(Some)
        }
        Op::Send(partitioning, messages) => {
            let started = std::time::Instant::now();
            let records = messages.len();
            fail_points::fail_point!("router.send");
            let r = bounded_write(ctx, lane.dest(), timeout, true, ctx.sink.send(lane.dest(), partitioning, messages))
                .await;
            match &r {
                Ok(()) => {
                    metrics::histogram!("iggy_connector_send_latency_seconds").record(started.elapsed().as_secs_f64());
                    lock(&lane.info).send_cap.acknowledged(lane.policy.batch.batch_max_records);
                }
                // Cut short while the server answered other calls: this send is what it
                // did not answer in time. Cut short with the server answering nothing, or
                // still connecting, the send may not even have been written, and its size
                // is not what failed.
                Err(e) if e.kind == SendErrorKind::Timeout => {
                    let lowered = lock(&lane.info).send_cap.cut_short(records);
                    if let Some(max) = lowered {
                        tracing::warn!(destination = %lane.key, records, send_records_max = max, "a send was cut short by the result timeout (it may still be stored); sends to this destination carry fewer records until they are answered in time");
                    }
                }
                Err(_) => {}
            }
            r.map(|()| None)
        }
    };
    drop(_slot);
    {
        let mut i = lock(&lane.info);
        i.slow_to_fail = slow_to_fail_after(i.slow_to_fail, result.is_ok(), held_from.elapsed(), timeout);
    }
    match result {
        Ok(Some(t)) if *failures > 0 => {
            // The destination exists, but only a send proves it accepts: the breaker,
            // the failure count and the status wait for one.
            lock(&lane.info).topic = Some(t);
            Attempt::Ensured(t)
        }
        Ok(info) => {
            close_breaker(lane, breaker);
            *failures = 0;
            {
                let mut i = lock(&lane.info);
                i.consecutive_failures = 0;
                if info.is_none() && i.dead_letter_failures > 0 {
                    // A send went out: a run parked while it was dead-lettered went out
                    // here after all (the topic gained the partition). Its count and cap go.
                    i.dead_letter_failures = 0;
                    i.dead_letter_cap = SendCap::default();
                }
                if let Some(t) = info {
                    // A topic without fsync is said in the log by the sink, once per
                    // destination, and in the lane's status.
                    i.topic = Some(t);
                }
            }
            match info {
                // A destination that exists has not taken anything yet: the status
                // waits for a send (a lane is `starting` until its first).
                Some(t) => Attempt::Ensured(t),
                None => {
                    progressed(lane, ctx, "send succeeded");
                    Attempt::Sent
                }
            }
        }
        Err(e) => {
            *failures = failures.saturating_add(1);
            let was_open = breaker.state() != BreakerState::Closed;
            if e.kind.counts_against_destination() {
                breaker.on_failure(Instant::now());
            }
            let is_open = breaker.state() != BreakerState::Closed;
            if is_open && !was_open {
                tracing::warn!(destination = %lane.key, "circuit breaker opened");
            }
            if e.kind == SendErrorKind::Destination {
                // The topic may be gone: ensure it again before the next send.
                lock(&lane.info).topic = None;
            }
            count_failure(lane, &e);
            failed(lane, ctx, *failures, is_open, &e.to_string());
            // Shown after the status: a reader who sees the breaker open sees the lane
            // Degraded.
            lock(&lane.info).breaker = Some(breaker.state());
            tracing::debug!(destination = %lane.key, error = %e, failures = *failures, "send failed; holding and retrying");
            let backoff = lane.policy.backoff(*failures);
            // A batch read from the log (re-read, or read back) is there already: it waits
            // there, at no cost of memory and none of a scan to read it back. Any other
            // waits there once the lane is Degraded (now, as `failed` decided, or still:
            // records held out of the topic's partitions, then a failure): the wait can
            // last as long as the outage,
            // for every destination it hits, so the batch waits in the log. A blip before
            // that is waited out with the batch in memory.
            if from_log || lane.status.get() == Status::Degraded {
                return Attempt::Park(backoff);
            }
            if sleep_or_shutdown(shutdown, backoff).await {
                return Attempt::ShuttingDown;
            }
            Attempt::Retry
        }
    }
}

/// Records whose partition id is beyond the topic's partitions: never a breaker failure.
/// Counted once however long they are held; then disposed of as the policy says.
async fn out_of_range<S: Sink, C>(
    lane: &Lane,
    ctx: &LaneContext<S, C>,
    records: &[Routed],
    partition: u32,
    topic: TopicInfo,
    from_log: bool,
    shutdown: &mut watch::Receiver<bool>,
) -> Delivery {
    let n = records.len() as u64;
    let first = records.first().map(|r| r.offset);
    let last = records.last().map(|r| r.offset);
    let counted_before = {
        let mut info = lock(&lane.info);
        let before = info.out_of_range_counted_through.is_some_and(|through| last.is_some_and(|l| l <= through));
        info.out_of_range_counted_through = info.out_of_range_counted_through.max(last);
        before
    };
    let why = format!("partition id {partition} is beyond the topic's {} partitions", topic.partitions_count);
    if !counted_before {
        metrics::counter!("iggy_connector_destinations_rejected_total", "connector_key" => lane.key.source.clone(), "reason" => "partition_id_out_of_range")
            .increment(n);
        lock(&lane.info).rejected_records += n;
        lane.status.record_error(&why);
    }
    match lane.policy.on_admission_failure {
        OnAdmissionFailure::Drop => {
            tracing::warn!(destination = %lane.key, records = n, first_offset = first, last_offset = last, "{why}: dropped, as configured");
            metrics::counter!("iggy_connector_messages_dropped_total", "connector_key" => lane.key.source.clone(), "reason" => "partition_id_out_of_range")
                .increment(n);
            lock(&lane.info).consecutive_failures = 0;
            progressed(lane, ctx, "records out of the topic's partitions dropped, as configured");
            Delivery::Done
        }
        OnAdmissionFailure::DeadLetter if lane.dead_letter_given_up => {
            tracing::warn!(destination = %lane.key, records = n, first_offset = first, last_offset = last, "{why}: dropped, the dead-letter destination is given up (router.give_up)");
            metrics::counter!("iggy_connector_messages_dropped_total", "connector_key" => lane.key.source.clone(), "reason" => "given_up")
                .increment(n);
            lock(&lane.info).consecutive_failures = 0;
            progressed(
                lane,
                ctx,
                "records out of the topic's partitions dropped: the dead-letter destination is given up",
            );
            Delivery::Done
        }
        OnAdmissionFailure::DeadLetter => {
            // Validation refuses `dead_letter` without a destination; were one to slip
            // through, the records are held, never counted delivered unsent.
            let Some(dlq) = lane.policy.dead_letter.clone() else {
                return hold_until_partitions_exist(lane, ctx, &why);
            };
            // Said once a run, when it is first refused (a run parked and read back is
            // the same run).
            if !counted_before {
                tracing::warn!(destination = %lane.key, records = n, first_offset = first, last_offset = last, dead_letter = %dlq, "{why}: sent to the dead-letter destination, as configured");
            }
            dead_letter(lane, ctx, &dlq, records, from_log, shutdown).await
        }
        OnAdmissionFailure::Error => hold_until_partitions_exist(lane, ctx, &why),
    }
}

/// Holds records whose partition id the topic lacks: the lane is Degraded (and the
/// router with it) for as long as it holds them. They are parked ([`Delivery::Park`]) for
/// a cool-down; the next try reads them back and asks the destination again (the topic
/// may have gained partitions): sent if it has, parked again if not. An ask that fails
/// is a failed try like any other (counted, the breaker told, retried after the
/// backoff). Memory is not held
/// for a hold that can last as long as the operator takes to add partitions.
fn hold_until_partitions_exist<S: Sink, C>(lane: &Lane, ctx: &LaneContext<S, C>, why: &str) -> Delivery {
    degraded(lane, ctx, why);
    Delivery::Park { from: 0, wait: lane.policy.breaker.cool_down }
}

/// Sends refused records to the dead-letter topic, balanced, until it acknowledged them
/// or the lane is Degraded: then `Park` from the first record not yet there, the rest
/// of the run sent there (never to its own topic) after its read-back, with the failure
/// count and the send cap where they were. Bounded like any send (the result timeout,
/// the source's send slots); the lane is Degraded (and the router with it) after
/// `degraded_after_failures` failures in a row, and Running again once the records are
/// delivered there.
async fn dead_letter<S: Sink, C>(
    lane: &Lane,
    ctx: &LaneContext<S, C>,
    dlq: &DestinationKey,
    records: &[Routed],
    from_log: bool,
    shutdown: &mut watch::Receiver<bool>,
) -> Delivery {
    let messages: Vec<OutMessage<'_>> = records
        .iter()
        .map(|r| {
            let mut m = out_message(r);
            rejected_headers(&mut m.headers, "partition_id_out_of_range", &r.envelope.header.destination);
            m
        })
        .collect();
    let mut prepared = ctx.sink.prepare(&messages);
    let timeout = lane.policy.batch.result_timeout;
    let mut failures = lock(&lane.info).dead_letter_failures;
    // Sent from `from`, under a cap of its own, as a lane's sends are: a run too slow to
    // be answered whole is not sent whole again at every retry.
    let (mut from, mut cap) = (0, std::mem::take(&mut lock(&lane.info).dead_letter_cap));
    loop {
        // The batch was bounded without the dead-letter headers these messages gain
        // (they are the destination's own records): bounded again with them.
        let end = end_within_send_bytes(records, from, cap.end(from, records.len()), DEAD_LETTER_HEADERS_MAX_BYTES);
        let sent = {
            let slow_to_fail = lock(&lane.info).dead_letter_slow_to_fail;
            let Some(_slot) = slot_or_shutdown(lane, slow_to_fail, shutdown).await else {
                return Delivery::ShuttingDown;
            };
            let held_from = Instant::now();
            let ensured = bounded_write(ctx, dlq, timeout, false, ensure_timed(&*ctx.sink, dlq)).await;
            let sent = match (ensured, &mut prepared) {
                (Err(e), _) => Err(e),
                (Ok(_), Err(e)) => Err(e.clone()),
                (Ok(_), Ok(messages)) => {
                    let started = std::time::Instant::now();
                    let send = ctx.sink.send(dlq, &Partitioning::Balanced, &mut messages[from..end]);
                    let r = bounded_write(ctx, dlq, timeout, true, send).await;
                    if r.is_ok() {
                        metrics::histogram!("iggy_connector_send_latency_seconds")
                            .record(started.elapsed().as_secs_f64());
                    }
                    // Only a send cut short says its size failed, as for a lane's own
                    // sends: an ensure of the dead-letter topic cut short sent nothing.
                    if matches!(&r, Err(e) if e.kind == SendErrorKind::Timeout) {
                        cap.cut_short(end - from);
                    }
                    r
                }
            };
            // As for the lane's own sends (`attempt`).
            let mut info = lock(&lane.info);
            info.dead_letter_slow_to_fail =
                slow_to_fail_after(info.dead_letter_slow_to_fail, sent.is_ok(), held_from.elapsed(), timeout);
            drop(info);
            sent
        };
        // Counted as every send is (the dead-letter lane's, for the cap, included).
        match &sent {
            Ok(()) => {
                metrics::counter!("iggy_connector_messages_routed_total", "connector_key" => lane.key.source.clone())
                    .increment((end - from) as u64)
            }
            Err(e) => count_failure(lane, e),
        }
        match sent {
            Ok(()) => {
                {
                    let mut info = lock(&lane.info);
                    info.consecutive_failures = 0;
                    info.dead_letter_failures = 0;
                }
                progressed(lane, ctx, "records out of the topic's partitions dead-lettered");
                dead_lettered_here(lane, ctx, (end - from) as u64);
                cap.acknowledged(records.len());
                failures = 0;
                from = end;
                if from == records.len() {
                    lock(&lane.info).dead_lettering_through = None;
                    return Delivery::Done;
                }
            }
            Err(e) => {
                failures = failures.saturating_add(1);
                lock(&lane.info).dead_letter_failures = failures;
                failed(lane, ctx, failures, false, &format!("dead-letter send failed: {e}"));
                let backoff = lane.policy.backoff(failures);
                // Degraded, or read from the log: the rest of the run waits in the log, as
                // such a batch does (what went out is acknowledged with the batch's
                // records before it).
                if from_log || lane.status.get() == Status::Degraded {
                    let mut info = lock(&lane.info);
                    info.dead_letter_cap = cap;
                    info.dead_lettering_through = records.last().map(|r| r.offset);
                    return Delivery::Park { from, wait: backoff };
                }
                if sleep_or_shutdown(shutdown, backoff).await {
                    return Delivery::ShuttingDown;
                }
            }
        }
    }
}

/// A lane in Error because it could not read the log has read it again: back to the
/// status it had before (`before`), and the router told. Reading is not delivering: a
/// lane that never had a send acknowledged is Starting again, and a Degraded one stays
/// Degraded (its queue still given back) until a send succeeds.
fn reads_again<S, C>(lane: &Lane, ctx: &LaneContext<S, C>, before: &mut Option<(Status, String)>) {
    if lane.status.get() != Status::Error {
        return;
    }
    match before.take() {
        // Degraded for a reason the read error did not change: that reason again, not
        // "the log reads again", which says nothing of why it is degraded.
        Some((Status::Degraded, why)) => {
            ctx.router_status.lane_reads_again(&lane.key, &lane.status, Status::Degraded, &why)
        }
        Some((Status::Starting, _)) => {
            ctx.router_status.lane_reads_again(&lane.key, &lane.status, Status::Starting, "the log reads again")
        }
        _ => ctx.router_status.lane_reads_again(&lane.key, &lane.status, Status::Running, "the log reads again"),
    }
}

/// The `failures`th failure in a row: shown (snapshot and status), and the lane Degraded
/// once there are `degraded_after_failures` of them, or its breaker is open (it sends
/// nothing for a cool-down, whatever the count).
fn failed<S, C>(lane: &Lane, ctx: &LaneContext<S, C>, failures: u32, breaker_open: bool, why: &str) {
    lock(&lane.info).consecutive_failures = failures;
    lane.status.record_error(why);
    if failures >= lane.policy.batch.degraded_after_failures {
        degraded(lane, ctx, &format!("{failures} consecutive failures, last: {why}"));
    } else if breaker_open {
        degraded(lane, ctx, &format!("circuit breaker open; last failure: {why}"));
    } else {
        // Still Starting or Running: the reason says the lane retries, not what held at
        // its last success.
        let degraded_after = lane.policy.batch.degraded_after_failures;
        let reason = format!("retrying: {failures} consecutive failures (degraded at {degraded_after}), last: {why}");
        lane.status.set_reason_while(&[Status::Starting, Status::Running], &reason);
    }
}

/// The lane is retrying without progress: Degraded, the router told, and its queue shed
/// to the log. Not before: a lane that sheds re-reads the log from its first queued
/// record, scanning every record since (all destinations'), so a blip of a few failed
/// attempts is better held in memory, within the lanes' bounds.
fn degraded<S, C>(lane: &Lane, ctx: &LaneContext<S, C>, why: &str) {
    lane.cannot_send();
    ctx.router_status.lane_degraded(&lane.key, &lane.status, why);
}

/// The lane moved its records on: Running, its queue open again, and the router told.
/// `lane` dead-lettered `records` records itself, acknowledged by the source's
/// dead-letter destination: that destination's row counts them, and says `running` if
/// it was still `starting` (it took records). A row degraded or in error by its own lane's
/// failures is left so: that lane says when it sends again.
fn dead_lettered_here<S, C>(lane: &Lane, ctx: &LaneContext<S, C>, records: u64) {
    let Some(dl) = lane.dead_letter_lane.get().and_then(Weak::upgrade) else { return };
    lock(&dl.info).sent_records += records;
    if dl.status.get() == Status::Starting {
        let why = format!("records dead-lettered by {}", lane.key);
        ctx.router_status.lane_took_records_while_starting(&dl.key, &dl.status, &why);
    }
}

fn progressed<S, C>(lane: &Lane, ctx: &LaneContext<S, C>, why: &str) {
    lane.sends_again();
    ctx.router_status.lane_recovered(&lane.key, &lane.status, why);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One step of the lane or of the cursor flusher.
    #[derive(Clone, Copy, Debug)]
    enum Step {
        /// The lane takes the batch `[first, below)` to deliver.
        Take { first: u64 },
        /// The destination acknowledged the batch in flight, all of it below `below`.
        Ack { below: u64 },
        /// The flusher reads what to store.
        Snapshot,
        /// The flusher's store of its snapshot is durable.
        Stored,
    }

    /// Runs `steps` on a gate, as the lane and the flusher would, and checks after every
    /// step that no record taken and not yet durably stored lies below the gate's low
    /// water (the releaser frees the log below it). Returns the final low water.
    fn run(steps: &[Step]) -> Option<u64> {
        let mut g = Gate::default();
        let (mut durable, mut taken_below, mut snapshot) = (0u64, 0u64, None);
        for (i, step) in steps.iter().enumerate() {
            match *step {
                Step::Take { first } => {
                    g.in_flight_first = Some(first);
                    taken_below = first + 10;
                }
                Step::Ack { below } => {
                    g.acknowledged(below, durable);
                    g.in_flight_first = None;
                }
                Step::Snapshot => snapshot = Some(g.acked_below()).filter(|a| *a > durable),
                Step::Stored => {
                    if let Some(s) = snapshot.take() {
                        durable = durable.max(s);
                        g.cursor_stored(s);
                    }
                }
            }
            if taken_below > durable {
                let low = g.low_water();
                assert!(
                    low.is_some_and(|l| l <= durable),
                    "after step {i} of {steps:?}: records from {durable} are not stored, yet the low water is {low:?}"
                );
            }
        }
        g.low_water()
    }

    /// Every interleaving of the lane's two steps per batch with the flusher's two steps
    /// per store. Whatever the order, the log is never released past a record whose
    /// cursor is not stored, and once a last store follows the last acknowledgement
    /// nothing pins it.
    #[test]
    fn no_order_of_acks_and_cursor_stores_releases_an_unstored_record_or_pins_a_stored_one() {
        let lane: Vec<Step> =
            (0..3u64).flat_map(|b| [Step::Take { first: b * 10 }, Step::Ack { below: b * 10 + 10 }]).collect();
        let flusher: Vec<Step> = (0..3).flat_map(|_| [Step::Snapshot, Step::Stored]).collect();
        let mut orders = 0;
        // Each order is a choice of which of the 12 positions the lane's steps take.
        for mask in 0u32..(1 << 12) {
            if mask.count_ones() != 6 {
                continue;
            }
            let (mut l, mut f) = (lane.iter(), flusher.iter());
            let mut steps: Vec<Step> = (0..12)
                .map(|pos| if mask & (1 << pos) != 0 { *l.next().unwrap() } else { *f.next().unwrap() })
                .collect();
            steps.extend([Step::Snapshot, Step::Stored]);
            assert_eq!(run(&steps), None, "the last store left the log pinned: {steps:?}");
            orders += 1;
        }
        assert_eq!(orders, 924);
    }

    /// A lane of source `s` for `a/b` under `policy`, alone in its source (one send slot,
    /// no other records of the log its own).
    fn lane_on_a_b(policy: RouterPolicy) -> Lane {
        let belongs: Arc<BelongsFn> = Arc::new(|_: &LaneKey, _: &EnvelopeSummary<'_>| None);
        let share = SourceShare {
            policy: Arc::new(policy),
            send_slots: Arc::new(SendSlots::new(1)),
            belongs,
            dead_letter_given_up: false,
            queue_budget: Arc::default(),
            dead_letter_lane: Arc::default(),
        };
        Lane::new(LaneKey { source: "s".into(), destination: DestinationKey::new("a", "b") }, 0, &share)
    }

    /// A lingering lane is woken once its queue holds what fills the batch, or what the
    /// queue holds at most, by count and by bytes alike. With a queue bounded below a
    /// batch's bytes, waking only at a batch's bytes would never come: the queue fills,
    /// the lane lingers on, and the log's reader waits at its full queue.
    #[test]
    fn a_lingering_lane_is_woken_by_what_its_queue_can_hold() {
        let mut policy = RouterPolicy::default();
        policy.batch.batch_max_bytes = 1024 * 1024;
        policy.lane_queue_max_bytes = 100;
        policy.batch.batch_max_records = 500;
        policy.lane_queue_max_records = 10;
        let lane = lane_on_a_b(policy);
        let mut batch = Vec::new();
        top_up(&lane, &mut batch, true);
        let g = lane.gate();
        assert_eq!((g.wake_at_queued, g.wake_at_bytes), (10, 100));
    }

    /// A queue's byte bound counts what its records hold, headers included: records of
    /// ten-byte payloads under long headers fill a 64 KiB queue after a few dozen, not
    /// after six thousand (by payload alone, the record count would be the only bound).
    #[test]
    fn a_queue_full_by_bytes_counts_what_its_records_hold_not_their_payloads() {
        let policy = RouterPolicy {
            lane_queue_max_bytes: 64 * 1024,
            lane_queue_max_records: 100_000,
            ..RouterPolicy::default()
        };
        let d = DestinationKey::new("a", "b");
        let lane = lane_on_a_b(policy);
        let long = "h".repeat(255);
        let header = ingest::EnvelopeHeader {
            message_id: 1,
            received_at_unix_ms: 0,
            source_key: "s".into(),
            endpoint_id: None,
            content_type: Some(long.clone()),
            metadata: vec![],
            headers: vec![("x-a".into(), long.clone().into_bytes()), ("x-b".into(), long.clone().into_bytes())],
            idempotency_key: Some(long.clone()),
            batch_index: 0,
            batch_len: 1,
            destination: ingest::envelope::Destination {
                stream: d.stream.clone(),
                topic: d.topic.clone(),
                partitioning: ingest::envelope::Partitioning::Balanced,
            },
        };
        let record = Envelope::encode(&header, b"0123456789");
        let mut queued = 0u64;
        loop {
            let r = Routed::new(queued, RecordPlace::default(), Envelope::decode(&record).unwrap(), None);
            lane.offer(r, 100_000, Duration::from_secs(3600), false).unwrap();
            if lane.is_overflowed() {
                break;
            }
            queued += 1;
            assert!(queued < 1000, "the queue took {queued} records of 10-byte payloads and was not full");
        }
        let g = lane.gate();
        assert!(g.queued_bytes >= 64 * 1024 && g.queued_payload_bytes == 10 * queued as usize, "{g:?}");
    }

    fn routed_at(offset: u64) -> Routed {
        let header = ingest::EnvelopeHeader {
            message_id: u128::from(offset),
            received_at_unix_ms: 0,
            source_key: "s".into(),
            endpoint_id: None,
            content_type: None,
            metadata: vec![],
            headers: vec![],
            idempotency_key: None,
            batch_index: 0,
            batch_len: 1,
            destination: ingest::envelope::Destination {
                stream: "a".into(),
                topic: "b".into(),
                partitioning: ingest::envelope::Partitioning::Balanced,
            },
        };
        let record = Envelope::encode(&header, b"{}");
        Routed::new(offset, RecordPlace::default(), Envelope::decode(&record).unwrap(), None)
    }

    /// A shed queue is re-read from its first record, past everything queued and skipped
    /// (an overflow already under way included), and its bytes go back to the budget; a
    /// shed lane's next record starts a re-read even with room in its queue and budget.
    #[test]
    fn a_shed_queue_is_re_read_from_its_first_record_and_its_bytes_given_back() {
        let budget = Arc::new(QueueBudget::new(1 << 20));
        for overflow in [None, Some((9, 12))] {
            let mut g = Gate::new(0, budget.clone());
            g.push(routed_at(5)).unwrap();
            g.push(routed_at(6)).unwrap();
            assert!(budget.queued_bytes() > 0);
            if let Some((from, skipped)) = overflow {
                (g.overflow_from, g.last_skipped) = (Some(from), Some(skipped));
            }
            drop(g.shed());
            let want_skipped = overflow.map_or(6, |(_, s)| s);
            assert_eq!((g.overflow_from, g.last_skipped), (Some(5), Some(want_skipped)), "{overflow:?}");
            assert_eq!((g.queue.len(), g.queued_bytes, g.queued_payload_bytes), (0, 0, 0));
            assert_eq!(budget.queued_bytes(), 0);
            assert_eq!(g.low_water(), Some(5));
        }
        let lane = lane_on_a_b(RouterPolicy::default());
        lane.cannot_send();
        lane.offer(routed_at(1), 4096, Duration::from_secs(3600), true).unwrap();
        let g = lane.gate();
        assert_eq!((g.queue.len(), g.overflow_from, g.last_skipped), (0, Some(1), Some(1)));
        drop(g);
        lane.sends_again();
        lane.offer(routed_at(2), 4096, Duration::from_secs(3600), true).unwrap();
        assert_eq!(lane.gate().queue.len(), 0, "queued while re-reading");
    }

    /// The router's budget is all its lanes' together: a record that does not fit is
    /// not queued, its lane re-reads it; what a gate dropped with records queued held
    /// is given back.
    #[test]
    fn a_record_past_the_routers_budget_overflows_its_lane() {
        let size = queued_size(&routed_at(0));
        let budget = Arc::new(QueueBudget::new(3 * size));
        let mut a = Gate::new(0, budget.clone());
        let mut b = Gate::new(0, budget.clone());
        a.push(routed_at(0)).unwrap();
        a.push(routed_at(1)).unwrap();
        b.push(routed_at(2)).unwrap();
        assert_eq!(b.push(routed_at(3)).map_err(|r| r.offset), Err(3));
        assert_eq!((b.queue.len(), budget.queued_bytes()), (1, 3 * size));
        drop(a);
        assert_eq!(budget.queued_bytes(), size);
        b.pop_front().unwrap();
        assert_eq!(budget.queued_bytes(), size, "given back before the batch's delivery ended");
        b.count_out(size);
        assert_eq!(budget.queued_bytes(), 0);
    }

    /// A shed gives back what the queue held, not what batches taken from it hold:
    /// those are counted out as their deliveries end, each once.
    #[test]
    fn a_shed_gives_back_the_queue_and_leaves_taken_batches_counted() {
        let size = queued_size(&routed_at(0));
        let budget = Arc::new(QueueBudget::new(usize::MAX));
        let mut g = Gate::new(0, budget.clone());
        for offset in 0..5 {
            g.push(routed_at(offset)).unwrap();
        }
        let batch = take_from_queue(&mut g, 2, crate::policy::MAX_BATCH_BYTES);
        assert_eq!((batch.len(), budget.queued_bytes()), (2, 5 * size));
        drop(g.shed());
        assert_eq!(budget.queued_bytes(), 2 * size, "the taken batch was given back by the shed");
        g.count_out(2 * size);
        assert_eq!(budget.queued_bytes(), 0);
        drop(g);
        assert_eq!(budget.queued_bytes(), 0, "given back twice");
    }

    /// A record of `payload_bytes` with `forwarded` headers of names and values of 255
    /// bytes, the content type and metadata a door writes, bound to a destination of
    /// 255-byte names, on the dead-letter lane with `dead_letter`.
    fn heavy_routed(offset: u64, payload_bytes: usize, forwarded: usize, dead_letter: bool) -> Routed {
        let long = |c: char| std::iter::repeat_n(c, 255).collect::<String>();
        let header = ingest::EnvelopeHeader {
            message_id: u128::from(offset) + 1,
            received_at_unix_ms: 0,
            source_key: "shop".into(),
            endpoint_id: None,
            content_type: Some(long('c')),
            metadata: vec![("peer_addr".into(), "127.0.0.1:5000".into()), ("received_at_unix_ms".into(), "0".into())],
            headers: (0..forwarded).map(|i| (format!("x-{i:0>253}"), vec![b'v'; 255])).collect(),
            idempotency_key: None,
            batch_index: 0,
            batch_len: 1,
            destination: ingest::envelope::Destination {
                stream: long('s'),
                topic: long('t'),
                partitioning: ingest::envelope::Partitioning::Balanced,
            },
        };
        let record = Envelope::encode(&header, &vec![b'p'; payload_bytes]);
        Routed::new(offset, RecordPlace::default(), Envelope::decode(&record).unwrap(), dead_letter.then_some("cap"))
    }

    /// `send_bytes` is what a message takes in a send as the sink encodes it (its
    /// 64-byte header, 16-byte index entry, headers and payload), exactly for a
    /// destination's record, at least for a dead-lettered one (whose headers it bounds).
    #[test]
    fn send_bytes_is_what_a_message_takes_in_a_send() {
        for (forwarded, dead_letter) in
            [(0, false), (3, false), (crate::FORWARD_HEADERS_MAX, false), (0, true), (64, true)]
        {
            let r = heavy_routed(0, 1000, forwarded, dead_letter);
            let sent = crate::iggy_sink::to_iggy(&[out_message(&r)]).unwrap();
            let headers = sent[0].user_headers.as_ref().map_or(0, |h| h.len());
            let taken = 64 + 16 + sent[0].payload.len() + headers;
            if dead_letter {
                assert!(r.send_bytes >= taken, "{forwarded} forwarded: {} < {taken}", r.send_bytes);
            } else {
                assert_eq!(r.send_bytes, taken, "{forwarded} forwarded");
            }
        }
    }

    /// A batch stops at `SEND_MESSAGES_MAX_BYTES` of messages even when its payloads are
    /// far within `batch_max_bytes`: records with many headers would otherwise make one
    /// request larger than Iggy takes. A first record larger than the bound goes alone.
    #[test]
    fn a_batch_stops_at_the_bytes_one_send_may_carry() {
        let budget = Arc::new(QueueBudget::new(usize::MAX));
        let mut g = Gate::new(0, budget);
        let each = heavy_routed(0, 100, crate::FORWARD_HEADERS_MAX, false).send_bytes;
        let fit = crate::SEND_MESSAGES_MAX_BYTES / each;
        for i in 0..2 * fit as u64 {
            g.push(heavy_routed(i, 100, crate::FORWARD_HEADERS_MAX, false)).unwrap();
        }
        let batch = take_from_queue(&mut g, 100_000, crate::policy::MAX_BATCH_BYTES);
        assert_eq!(batch.len(), fit, "{each} bytes each");
        let payloads: usize = batch.iter().map(|r| r.envelope.payload.len()).sum();
        assert!(payloads < crate::policy::MAX_BATCH_BYTES / 100, "stopped by the payloads");

        let mut g = Gate::new(0, Arc::new(QueueBudget::new(usize::MAX)));
        g.push(heavy_routed(0, crate::SEND_MESSAGES_MAX_BYTES, 0, false)).unwrap();
        g.push(heavy_routed(1, 10, 0, false)).unwrap();
        let alone = take_from_queue(&mut g, 100_000, crate::policy::MAX_BATCH_BYTES);
        assert_eq!(alone.iter().map(|r| r.offset).collect::<Vec<_>>(), vec![0]);
    }

    /// The log's reader waiting for room in a lane's full queue is woken when the lane
    /// sheds it: it would otherwise sleep out `overflow_after` (up to a day) for a queue
    /// already empty.
    #[tokio::test]
    async fn a_shed_wakes_the_reader_waiting_for_room() {
        let lane = Arc::new(lane_on_a_b(RouterPolicy::default()));
        lane.offer(routed_at(0), 1, Duration::from_secs(3600), false).unwrap();
        let waiting = {
            let lane = lane.clone();
            tokio::spawn(async move { lane.space.notified().await })
        };
        tokio::task::yield_now().await;
        lane.cannot_send();
        tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("not woken by the shed").unwrap();
        assert_eq!(lane.gate().queue.len(), 0);
    }

    /// A lane re-reading the log takes nothing at or past the offset the dispatcher has
    /// routed up to, even where a salvage gap makes the records below it fewer than the
    /// offsets: the dispatcher has not decided those yet (it may refuse one, or hold at
    /// one it cannot decode), and a lane that sent one and acknowledged past it would
    /// lose it.
    #[tokio::test]
    async fn a_re_read_across_a_salvage_gap_stops_at_what_the_dispatcher_routed() {
        use wal::format::{FRAME_HEADER_LEN, SEGMENT_HEADER_LEN, segment_file_name};
        use wal::storage::{SimStorage, Storage};
        use wal::{RecoveryMode, WalOptions};

        let sim = SimStorage::new();
        let dir = std::path::Path::new("/sim/log");
        let opts =
            WalOptions { segment_max_bytes: 4096, max_bytes: 1 << 20, preallocate_bytes: 0, ..Default::default() };
        let open = |opts: WalOptions| Wal::open_with(Arc::new(sim.clone()) as Arc<dyn Storage>, dir, opts).unwrap();
        let payload = |tag: u8| bytes::Bytes::from(vec![tag; 100]);
        let wal = open(opts.clone());
        for tag in 0..10 {
            wal.append(vec![payload(tag)]).await.unwrap();
        }
        drop(wal);
        // Record 3's payload damaged; the records after it prove it was durable.
        let path = dir.join(segment_file_name(0));
        let mut b = sim.read_file(&path).unwrap();
        b[(SEGMENT_HEADER_LEN + 3 * (FRAME_HEADER_LEN + 100) + FRAME_HEADER_LEN + 5) as usize] ^= 0x40;
        sim.write_file_durably(&path, &b).unwrap();
        let wal = open(WalOptions { recovery: RecoveryMode::Salvage, ..opts });
        let s = wal.open_report().salvage.clone().expect("salvaged");
        let (kept, resumed) = (s.kept_until_offset, s.resumed_at_offset);
        assert!(resumed > kept + 1, "{s:?}");
        for tag in 0..5 {
            wal.append(vec![payload(100 + tag)]).await.unwrap();
        }
        // The dispatcher has routed the first record past the gap; the lane is at 0 and
        // asks for as many records as there are offsets below the limit.
        let limit = resumed + 1;
        let mut reader = wal.reader(0).unwrap();
        let got = read_below(&mut reader, &wal, limit, limit as usize, usize::MAX).unwrap();
        let offsets: Vec<u64> = got.iter().map(|r| r.offset).collect();
        let mut want: Vec<u64> = (0..kept).collect();
        want.push(resumed);
        assert_eq!(offsets, want);
        assert_eq!(reader.position(), limit);
        // What lies past the limit is read next, once the dispatcher has routed it.
        let next = read_below(&mut reader, &wal, resumed + 5, 10, usize::MAX).unwrap();
        assert_eq!(next.iter().map(|r| r.offset).collect::<Vec<_>>(), (resumed + 1..resumed + 5).collect::<Vec<_>>());
        assert_eq!(next[0].payload[0], 101);
    }
}
