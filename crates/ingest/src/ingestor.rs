//! Accepting a submission: idempotency check, envelopes, one atomic append.
//!
//! Invariants:
//! - `Ok` means the submission's events are durable in the log as one atomic batch
//!   (or, for a replayed delivery, were so earlier at the offsets returned).
//! - `Err` means nothing of this submission was appended.
//! - Once the append resolved `Ok` the answer is `Ok`, whatever happens afterwards:
//!   a failure to record the idempotency key is logged and counted, never reported as
//!   an error (an error would invite a retry, i.e. a duplicate, for a durable event).
//! - A keyed submission runs in its own task, so a client that disconnects mid-request
//!   cannot interrupt it between the append and handing its key to the recorder (which
//!   records it whether or not anyone waits, and lets the claim go after); so does one accepted
//!   with a hold ([`Ingestor::accept_holding`]), which is released only after its append
//!   resolved.
//! - The caller's `on_accepted` ([`Ingestor::accept_in`]) is called with every `Ok`
//!   acceptance, and only with those, whether or not the caller still waits: a batch
//!   queued to the log is written even if its caller goes away, and what it counts (the
//!   door's accepted events) is then counted on a task of its own
//!   ([`wal::Wal::append_observed`]; none runs once the runtime shuts down).
//! - What submissions hold is bounded: [`RUNNING_ON_MAX_BYTES`] in all, those that run
//!   in their own tasks (which outlive their callers) and those on their callers' tasks
//!   alike (a submission larger than that waits until none runs). The bound does not
//!   depend on the number of connections: ten thousand one-byte events, each encoded with
//!   the source's forwarded headers, hold megabytes, and a thousand connections would
//!   otherwise hold gigabytes. A caller takes its [`Room`] before its task starts, before it takes anything
//!   a change would wait for (the door: before an endpoint's permit), and holds nothing
//!   else while it waits: clients that send a body and disconnect cannot pile up appends
//!   in memory faster than the log takes them. A submission's room is what it holds
//!   until its append resolved ([`Submission::footprint_bytes`]: its events and their
//!   encoded records, envelopes included), not its payload bytes alone: a thousand
//!   one-byte events under a long delivery id hold hundreds of times their payload.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use bytes::Bytes;
use wal::{Wal, WalError};

use crate::envelope::{
    Destination, Envelope, EnvelopeHeaderRef, MetadataRef, MetadataValue, message_id_for_delivery, random_message_id,
};
use crate::idempotency::{Claiming, IdempotencyIndex, IdempotencyKey, PriorAcceptance, SWEEP_GRACE_MS};
use crate::state::StateError;

/// One event of a submission and where it goes (resolved at the door).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub destination: Destination,
    pub payload: Bytes,
    /// Its place among the request's events (0-based) before routing dropped any: with
    /// the delivery id, what its message id is derived from, so that a retry numbers
    /// each event as the first try did, whatever a changed mapping drops or keeps.
    pub request_index: u32,
}

/// One request's worth of events, decoded, authenticated and routed.
#[derive(Debug, Clone)]
pub struct Submission {
    pub source_key: String,
    pub endpoint_id: Option<u128>,
    pub content_type: Option<String>,
    /// Configured metadata, name and value (see [`MetadataValue`]).
    pub metadata: Vec<(&'static str, MetadataValue)>,
    pub headers: Vec<(String, Vec<u8>)>,
    /// The sender's delivery id, if the request carried one.
    pub delivery_key: Option<String>,
    /// Each event with its own destination (events of one request may go to different
    /// topics), in request order.
    pub events: Vec<Event>,
    pub received_at_unix_ms: u64,
}

/// What each event of a submission holds beside its payload and its record's header:
/// the `Event` itself, its destination's three strings' allocations (stream, topic, a
/// partition key: each at most 255 bytes, counted as they are), and the record's
/// `Bytes` handle.
const EVENT_HOLD_BYTES: u64 = (std::mem::size_of::<Event>() + std::mem::size_of::<Bytes>()) as u64;

impl Submission {
    /// At least what this submission holds until its append resolved: each event (its
    /// destination and payload) and its encoded record (the envelope's version byte, a
    /// header whose message id is counted at its longest, and the payload again). What
    /// [`Ingestor::room`] is taken for.
    pub fn footprint_bytes(&self) -> u64 {
        let batch_len = u32::try_from(self.events.len()).unwrap_or(u32::MAX);
        let mut total = 0u64;
        for (i, event) in self.events.iter().enumerate() {
            let header = self.header_ref(event, u128::MAX, u32::try_from(i).unwrap_or(u32::MAX), batch_len);
            let d = &event.destination;
            let partition_key = match &d.partitioning {
                crate::envelope::Partitioning::Key(k) => k.len(),
                _ => 0,
            };
            let event_bytes = EVENT_HOLD_BYTES + (d.stream.len() + d.topic.len() + partition_key) as u64;
            let record_bytes = 1 + header.encoded_len() as u64 + event.payload.len() as u64;
            total = total.saturating_add(event_bytes + event.payload.len() as u64 + record_bytes);
        }
        total
    }
}

impl Submission {
    /// The record header of `event` (at `batch_index` of `batch_len`), under `message_id`:
    /// what the append encodes, and what the footprint counts.
    pub fn header_ref<'a>(
        &'a self,
        event: &'a Event,
        message_id: u128,
        batch_index: u32,
        batch_len: u32,
    ) -> EnvelopeHeaderRef<'a> {
        EnvelopeHeaderRef {
            message_id,
            received_at_unix_ms: self.received_at_unix_ms,
            source_key: &self.source_key,
            endpoint_id: self.endpoint_id,
            content_type: self.content_type.as_deref(),
            metadata: MetadataRef::Values(&self.metadata),
            headers: &self.headers,
            idempotency_key: self.delivery_key.as_deref(),
            batch_index,
            batch_len,
            destination: &event.destination,
        }
    }
}

/// A bound of [`Submission::footprint_bytes`] for a body not yet decoded: `body_bytes`
/// long, to become at most `events_max` events (their payloads lie within the body), of
/// a source whose records hold at most `envelope_max_bytes` beside their event
/// (`ingest::envelope::envelope_max_bytes`).
pub fn footprint_bound(body_bytes: u64, events_max: u64, envelope_max_bytes: u64) -> u64 {
    let destination_bytes = 3 * crate::envelope::ENVELOPE_FIELD_MAX_BYTES as u64;
    let per_event = EVENT_HOLD_BYTES + destination_bytes + envelope_max_bytes;
    body_bytes.saturating_mul(2).saturating_add(events_max.saturating_mul(per_event))
}

/// Where a submission's events are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    pub events: u64,
    pub first_offset: u64,
    pub last_offset: u64,
    /// True when this was a retry of a delivery accepted earlier: nothing was appended.
    pub replayed: bool,
}

impl Accepted {
    /// `events` appended now, where the log put them.
    fn appended(events: u64, a: &wal::Appended) -> Accepted {
        Accepted { events, first_offset: a.first_offset, last_offset: a.last_offset, replayed: false }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("log is full: {used_bytes} of {max_bytes} bytes used")]
    Full { used_bytes: u64, max_bytes: u64 },
    #[error("a request with the same delivery id is in progress")]
    InFlight,
    #[error("event of {len} bytes exceeds the record limit of {max} bytes")]
    TooLarge { len: usize, max: u32 },
    /// The request's events, as log records, take more than the log can hold in one
    /// batch even when empty: permanent, unlike `Full`.
    #[error("the request's events take {bytes} bytes in the log, more than the {max_bytes} it can take in one batch")]
    BatchTooLarge { bytes: u64, max_bytes: u64 },
    #[error("no events in the request")]
    Empty,
    /// The disk holding the log has no space (ENOSPC, or a quota): the log undid the
    /// failed write and takes appends again once space returns.
    #[error("disk full: {0}")]
    DiskFull(String),
    /// The state database could not be read before the append (after an I/O error it
    /// is reopened by the next idempotency checkpoint); nothing was appended.
    #[error("state database unavailable: {0}")]
    StateUnavailable(String),
    /// The log failed this append (a storage error it recovered from); a retry may work.
    #[error("log unavailable: {0}")]
    Unavailable(String),
    /// The log takes no more appends through this handle (closed, or poisoned by a
    /// storage failure it could not undo or, under `interval`, a failed sync that may
    /// have lost appends already answered); only a restart recovers.
    #[error("log stopped: {0}")]
    Stopped(String),
    /// A keyed request reached its delivery-id lookup more than
    /// [`crate::idempotency::SWEEP_GRACE_MS`] after its head arrived: a checkpoint may have
    /// swept the key its lookup window still covers, so the lookup could answer "new" for
    /// a delivery already accepted. Nothing was appended; a retry is looked up afresh.
    #[error(
        "the request reached its delivery-id lookup {waited_ms} ms after its head arrived, more than the {grace_ms} ms \
         keys are kept past their window"
    )]
    LookupTooLate { waited_ms: u64, grace_ms: u64 },
    #[error("internal error: {0}")]
    Internal(String),
}

impl IngestError {
    /// A short, fixed name for metrics labels and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            IngestError::Full { .. } => "log_full",
            IngestError::InFlight => "delivery_in_progress",
            IngestError::TooLarge { .. } => "record_too_large",
            IngestError::BatchTooLarge { .. } => "batch_too_large",
            IngestError::Empty => "empty",
            IngestError::DiskFull(_) => "disk_full",
            IngestError::StateUnavailable(_) => "state_unavailable",
            IngestError::Unavailable(_) => "log_unavailable",
            IngestError::Stopped(_) => "log_stopped",
            IngestError::LookupTooLate { .. } => "lookup_too_late",
            IngestError::Internal(_) => "internal",
        }
    }
}

/// The most payload bytes the submissions running in their own tasks may hold at once.
/// Past the log's queue (`wal::WalOptions::queue_max_bytes`, 64 MiB) they would only wait.
pub const RUNNING_ON_MAX_BYTES: u64 = 256 * 1024 * 1024;

/// A submission's share of [`RUNNING_ON_MAX_BYTES`], given back when dropped.
#[derive(Debug)]
pub struct Room {
    /// The bytes it was asked for (its permits are these in KiB, at most all of them).
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    bytes: u64,
    _kib: tokio::sync::OwnedSemaphorePermit,
}

impl Room {
    /// A room taken for a bound before the body was decoded must cover what the decoded
    /// submission holds, or the bound on what submissions hold is not one. Checked in
    /// debug builds (every test), where a bound that falls short fails.
    fn check_covers(&self, submission: &Submission) {
        #[cfg(debug_assertions)]
        {
            let footprint = submission.footprint_bytes();
            assert!(footprint <= self.bytes, "a submission holding {footprint} bytes ran in room for {}", self.bytes);
        }
        #[cfg(not(debug_assertions))]
        let _ = submission;
    }
}

/// Turns submissions into log records. Cheap to clone.
#[derive(Clone)]
pub struct Ingestor {
    wal: Arc<Wal>,
    idempotency: Arc<IdempotencyIndex>,
    /// [`RUNNING_ON_MAX_BYTES`] in KiB, taken by each submission until its append resolved.
    running_on_kib: Arc<tokio::sync::Semaphore>,
    append_latency: metrics::Histogram,
    /// Set while a recovery of the state database, started by a failed lookup, runs.
    recovering: Arc<AtomicBool>,
}

impl Ingestor {
    pub fn new(wal: Arc<Wal>, idempotency: Arc<IdempotencyIndex>) -> Ingestor {
        let append_latency = metrics::histogram!("iggy_ingest_append_latency_seconds");
        let running_on_kib = Arc::new(tokio::sync::Semaphore::new((RUNNING_ON_MAX_BYTES / 1024) as usize));
        Ingestor { wal, idempotency, running_on_kib, append_latency, recovering: Arc::new(AtomicBool::new(false)) }
    }

    pub fn wal(&self) -> &Arc<Wal> {
        &self.wal
    }

    pub fn idempotency(&self) -> &Arc<IdempotencyIndex> {
        &self.idempotency
    }

    /// Accepts a submission, in room taken for it here; see the module invariants.
    pub async fn accept(&self, submission: Submission) -> Result<Accepted, IngestError> {
        let room = self.room(submission.footprint_bytes()).await?;
        self.accept_in(submission, room, |_| ()).await
    }

    /// [`Ingestor::accept`] in `room` taken before (for a bound of the submission's
    /// footprint, before its body was decoded), held until its append resolved.
    /// `on_accepted` is called with the acceptance (an append or a replay, never a
    /// refusal) whether or not the caller still waits for it: a caller that goes away
    /// once the batch is queued leaves it to be written all the same, and what the log
    /// took is counted all the same ([`wal::Wal::append_observed`]).
    pub async fn accept_in(
        &self,
        submission: Submission,
        room: Room,
        on_accepted: impl FnOnce(&Accepted) + Send + 'static,
    ) -> Result<Accepted, IngestError> {
        if submission.delivery_key.is_some() {
            return self.accept_holding(submission, (), room, on_accepted).await;
        }
        room.check_covers(&submission);
        // Nothing follows the append but `on_accepted`, which the log calls whether or
        // not this future is still polled: run it on the caller's task, which holds the
        // room as long as the submission.
        let accepted = self.accept_inner(submission, on_accepted).await;
        drop(room);
        accepted
    }

    /// Room for a submission that holds `bytes` ([`Submission::footprint_bytes`], or a
    /// bound of it taken before its body was decoded) to run in a task of its own
    /// ([`Ingestor::accept_holding`]): waits while others hold [`RUNNING_ON_MAX_BYTES`].
    pub async fn room(&self, bytes: u64) -> Result<Room, IngestError> {
        let kib = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX).min((RUNNING_ON_MAX_BYTES / 1024) as u32);
        self.running_on_kib
            .clone()
            .acquire_many_owned(kib)
            .await
            .map(|kib| Room { bytes, _kib: kib })
            .map_err(|e| IngestError::Internal(format!("the submissions' room is closed: {e}")))
    }

    /// [`Ingestor::accept`], keeping `hold` until the submission's append resolved (and
    /// its key was handed to the recorder), even if the caller stops waiting: the submission runs in
    /// its own task, which owns `hold` and `room` (taken first, see [`Ingestor::room`]).
    /// For a guard that must outlive every append made under it (the door's endpoint
    /// permit).
    /// `on_accepted` as for [`Ingestor::accept_in`].
    pub async fn accept_holding(
        &self,
        submission: Submission,
        hold: impl Send + 'static,
        room: Room,
        on_accepted: impl FnOnce(&Accepted) + Send + 'static,
    ) -> Result<Accepted, IngestError> {
        room.check_covers(&submission);
        let this = self.clone();
        tokio::spawn(async move {
            let accepted = this.accept_inner(submission, on_accepted).await;
            drop((hold, room));
            accepted
        })
        .await
        .map_err(|e| IngestError::Internal(format!("accept task failed: {e}")))?
    }

    /// The earlier acceptance of the delivery `key`, for a request the door refuses
    /// before it reaches [`Ingestor::accept`] (under the configuration of now, its body or
    /// its route no longer passes: a mapping or a limit changed since): a retry of a
    /// delivery the log holds is answered as the replay it is, whatever the
    /// configuration says now. `None` when there is none (the refusal stands then); an
    /// error, as [`Ingestor::accept`] gives it, when the state database cannot say or the
    /// log does not hold the delivery durably: neither a refusal nor a 200 is true then.
    /// `received_at_unix_ms` is when the request's head arrived: a lookup more than
    /// `SWEEP_GRACE_MS` after it is `LookupTooLate`, as in [`Ingestor::accept`] (a
    /// checkpoint may have swept the key, and "none" would turn the refusal of a
    /// delivery the log holds into the answer).
    /// A delivery another request is accepting right now is `InFlight` (409), as for
    /// [`Ingestor::accept`]: it may be a replay in a moment, so the refusal is not yet
    /// the answer either. (Asked before the lookup: its claim is let go only after its
    /// key is recorded.)
    /// The lookup holds the idempotency gate shared, as an acceptance does: while a
    /// recovery restores the keys a reopen of the state database dropped, it waits for the
    /// restore. While keys are owed (a key could not be recorded, and no checkpoint has
    /// restored it from the log yet), "none" is not known to be true: `StateUnavailable`.
    pub async fn replay_of(
        &self,
        key: &IdempotencyKey,
        received_at_unix_ms: u64,
    ) -> Result<Option<Accepted>, IngestError> {
        lookup_in_time(received_at_unix_ms)?;
        let _shared = self.idempotency.hold_shared().await;
        lookup_in_time(received_at_unix_ms)?;
        if let Some(prior) = self.idempotency.answered(key) {
            return self.replay(key, prior).map(Some);
        }
        if self.idempotency.is_claimed(key) {
            return Err(IngestError::InFlight);
        }
        if let Some(from) = self.idempotency.keys_owed_from() {
            return Err(IngestError::StateUnavailable(format!(
                "delivery ids of records from offset {from} on are being restored from the log"
            )));
        }
        match self.prior(key, received_at_unix_ms)? {
            Some(prior) => self.replay(key, prior).map(Some),
            None => Ok(None),
        }
    }

    /// The recorded acceptance of `key`, if any. A state database that cannot be read is
    /// `StateUnavailable` (and reopened in the background), never "none": the caller
    /// would append a retry again, or refuse a delivery the log holds.
    fn prior(&self, key: &IdempotencyKey, now_unix_ms: u64) -> Result<Option<PriorAcceptance>, IngestError> {
        match self.idempotency.lookup(key, now_unix_ms) {
            Ok(prior) => Ok(prior),
            Err(e @ StateError::Storage(_)) => {
                // Reopen it now rather than at the next checkpoint. The task waits at the
                // gate until a request holding it shared has answered.
                self.recover_state_soon(now_unix_ms);
                Err(IngestError::StateUnavailable(e.to_string()))
            }
            Err(e) => Err(IngestError::Internal(e.to_string())),
        }
    }

    /// Answers a delivery found in the index as a replay of `prior`.
    fn replay(&self, key: &IdempotencyKey, prior: PriorAcceptance) -> Result<Accepted, IngestError> {
        if !self.wal.accepts_appends() && prior.last_offset >= self.wal.next_offset() {
            // The log stopped (under `interval`, a failed sync may have taken records
            // already answered) and does not hold these offsets durably: a replay
            // would answer 200 for an event that may be gone. Refused like a new
            // request; after the restart the key is forgotten if its record is, and
            // the retry is appended again.
            return Err(IngestError::Stopped(format!(
                "the log takes no appends and does not hold offsets {} to {} durably",
                prior.first_offset, prior.last_offset
            )));
        }
        metrics::counter!("iggy_ingest_idempotent_replays_total", "source" => key.source_key.clone()).increment(1);
        Ok(Accepted {
            // The index takes no row with `last_offset < first_offset` or at `u64::MAX`.
            events: prior.last_offset.saturating_sub(prior.first_offset).saturating_add(1),
            first_offset: prior.first_offset,
            last_offset: prior.last_offset,
            replayed: true,
        })
    }

    async fn accept_inner(
        &self,
        s: Submission,
        on_accepted: impl FnOnce(&Accepted) + Send + 'static,
    ) -> Result<Accepted, IngestError> {
        if s.events.is_empty() {
            return Err(IngestError::Empty);
        }
        let Some(delivery_key) = s.delivery_key.clone() else {
            return self.append(&s, on_accepted).await;
        };
        let key = IdempotencyKey { source_key: s.source_key.clone(), endpoint_id: s.endpoint_id, delivery_key };
        let claim = match self.idempotency.claim_or_answered(&key).await {
            Claiming::Claimed(claim) => claim,
            Claiming::InFlight => return Err(IngestError::InFlight),
            Claiming::Answered(prior) => return self.replay(&key, prior).inspect(on_accepted),
        };
        lookup_in_time(s.received_at_unix_ms)?;
        if let Some(prior) = self.prior(&key, s.received_at_unix_ms)? {
            return self.replay(&key, prior).inspect(on_accepted);
        }
        let accepted = self.append(&s, on_accepted).await?;
        fail_points::fail_point!("ingest.appended");
        let prior = PriorAcceptance {
            first_offset: accepted.first_offset,
            last_offset: accepted.last_offset,
            accepted_at_unix_ms: s.received_at_unix_ms,
        };
        // The events are durable. The key's record is the recorder's from here (it counts
        // and logs a failure, and owes the key to the next checkpoint's restore from the
        // log); a retry meanwhile is answered from the claim. Only past the bound on
        // acceptances answered before their record does the answer wait for it.
        let recording = self.idempotency.record(claim, prior);
        if !recording.may_answer_now() {
            let _ = recording.await;
        }
        Ok(accepted)
    }

    /// Starts one recovery of the state database in the background (none if one runs).
    fn recover_state_soon(&self, now_unix_ms: u64) {
        if self.recovering.swap(true, Ordering::AcqRel) {
            return;
        }
        let (index, wal, recovering) = (self.idempotency.clone(), self.wal.clone(), self.recovering.clone());
        tokio::spawn(async move {
            if let Err(e) = index.recover(&wal, now_unix_ms).await {
                tracing::warn!(error = %e, "the state database could not be reopened yet; the next checkpoint retries");
            }
            recovering.store(false, Ordering::Release);
        });
    }

    /// Appends the submission's events as one batch; `on_accepted` is called once it is
    /// durable, also if this future is dropped first ([`wal::Wal::append_observed`]).
    async fn append(
        &self,
        s: &Submission,
        on_accepted: impl FnOnce(&Accepted) + Send + 'static,
    ) -> Result<Accepted, IngestError> {
        let batch_len =
            u32::try_from(s.events.len()).map_err(|_| IngestError::TooLarge { len: s.events.len(), max: u32::MAX })?;
        let mut records = Vec::with_capacity(s.events.len());
        for (i, event) in s.events.iter().enumerate() {
            let batch_index = i as u32;
            let message_id = match &s.delivery_key {
                Some(k) => message_id_for_delivery(&s.source_key, s.endpoint_id, k, event.request_index),
                None => random_message_id(),
            };
            let header = s.header_ref(event, message_id, batch_index, batch_len);
            records.push(Envelope::encode_ref(&header, &event.payload));
        }
        let started = Instant::now();
        let events = u64::from(batch_len);
        let result = self.wal.append_observed(records, move |a| on_accepted(&Accepted::appended(events, a))).await;
        // Durable appends only: a refusal (log full, stopped) answers at once and would
        // pull the histogram towards zero while nothing is written.
        if result.is_ok() {
            self.append_latency.record(started.elapsed().as_secs_f64());
        }
        match result {
            Ok(a) => Ok(Accepted::appended(events, &a)),
            Err(WalError::Full { used_bytes, max_bytes, .. }) => Err(IngestError::Full { used_bytes, max_bytes }),
            Err(WalError::RecordTooLarge { len, max }) => Err(IngestError::TooLarge { len, max }),
            Err(WalError::BatchTooLarge { batch_bytes, max_batch_bytes }) => {
                Err(IngestError::BatchTooLarge { bytes: batch_bytes, max_bytes: max_batch_bytes })
            }
            Err(WalError::EmptyBatch) => Err(IngestError::Empty),
            Err(e @ (WalError::Poisoned(_) | WalError::Closed | WalError::ReadOnly)) => {
                Err(IngestError::Stopped(e.to_string()))
            }
            Err(WalError::Io { path, source }) if wal::error::is_out_of_space(&source) => {
                Err(IngestError::DiskFull(format!("{}: {source}", path.display())))
            }
            Err(e) => Err(IngestError::Unavailable(e.to_string())),
        }
    }
}

/// The lookup of a delivery id is made at its head's arrival time, but a checkpoint
/// sweeps by its own clock, keeping keys only `SWEEP_GRACE_MS` past their window: a request
/// that took longer than that to reach its lookup (a body trickling in, a wait for room)
/// could miss the key of a delivery already accepted, and is refused (retryable) instead.
fn lookup_in_time(received_at_unix_ms: u64) -> Result<(), IngestError> {
    let waited_ms = crate::time::now_unix_ms().saturating_sub(received_at_unix_ms);
    if waited_ms > SWEEP_GRACE_MS {
        return Err(IngestError::LookupTooLate { waited_ms, grace_ms: SWEEP_GRACE_MS });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::Partitioning;
    use crate::state::StateDb;

    fn submission(key: Option<&str>, events: &[&str]) -> Submission {
        Submission {
            source_key: "default".into(),
            endpoint_id: None,
            content_type: Some("application/json".into()),
            metadata: vec![],
            headers: vec![],
            delivery_key: key.map(str::to_string),
            events: events
                .iter()
                .enumerate()
                .map(|(i, e)| Event {
                    destination: Destination {
                        stream: "ingest".into(),
                        topic: format!("events-{i}"),
                        partitioning: Partitioning::Balanced,
                    },
                    payload: Bytes::copy_from_slice(e.as_bytes()),
                    request_index: i as u32,
                })
                .collect(),
            received_at_unix_ms: crate::time::now_unix_ms(),
        }
    }

    /// Waits until `key`'s claim was let go: its record is committed or owed.
    async fn until_recorded(ing: &Ingestor, key: &IdempotencyKey) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while ing.idempotency().is_claimed(key) {
            assert!(std::time::Instant::now() < deadline, "the key's record never ended");
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    fn open(dir: &std::path::Path) -> (Arc<Wal>, Ingestor) {
        let wal = Arc::new(Wal::open(dir.join("wal"), wal::WalOptions::default()).unwrap());
        let state = Arc::new(StateDb::open(dir.join("state.redb")).unwrap());
        let idem = Arc::new(IdempotencyIndex::new(state, 3_600_000));
        idem.rebuild(&wal, crate::time::now_unix_ms()).unwrap();
        (wal.clone(), Ingestor::new(wal, idem))
    }

    /// The room a submission takes covers what it holds: every encoded record (envelopes
    /// included) beside its events, not its payload bytes alone. Ten thousand one-byte
    /// events under a 255-byte delivery id, with fields at their longest, hold hundreds
    /// of times their payload; and the bound the door takes before decoding a body of
    /// them covers that too.
    #[test]
    fn a_submissions_room_covers_its_records_and_the_bound_before_decoding_covers_it() {
        let long = "k".repeat(crate::envelope::ENVELOPE_FIELD_MAX_BYTES);
        let n = 10_000usize;
        let mut s = submission(Some(&long), &vec!["1"; n]);
        s.content_type = Some("c".repeat(crate::envelope::ENVELOPE_FIELD_MAX_BYTES));
        s.endpoint_id = Some(u128::MAX);
        s.headers = vec![("x-forwarded".into(), vec![b'v'; crate::envelope::ENVELOPE_FIELD_MAX_BYTES])];
        s.metadata = vec![("peer_addr", MetadataValue::Text("p".repeat(47).into()))];
        for e in &mut s.events {
            e.destination = Destination {
                stream: long.clone(),
                topic: long.clone(),
                partitioning: Partitioning::Key(long.clone().into_bytes()),
            };
        }
        let payload: u64 = s.events.iter().map(|e| e.payload.len() as u64).sum();
        let records: u64 = s
            .events
            .iter()
            .enumerate()
            .map(|(i, e)| {
                // What the append encodes for it.
                let header = s.header_ref(e, random_message_id(), i as u32, n as u32);
                Envelope::encode_ref(&header, &e.payload).len() as u64
            })
            .sum();
        let footprint = s.footprint_bytes();
        assert!(footprint >= records + payload, "{footprint} < {records} + {payload}");
        assert!(footprint > 500 * payload, "the envelopes are counted: {footprint} for {payload} payload bytes");
        // The body these events came from (NDJSON, "1\n" each), bounded before decoding
        // with the source's largest envelope.
        let body_bytes = 2 * n as u64;
        let envelope_max =
            crate::envelope::envelope_max_bytes(s.source_key.len(), ["x-forwarded".len()].into_iter(), &[(9, 47)]);
        let bound = footprint_bound(body_bytes, n as u64, envelope_max as u64);
        assert!(bound >= footprint, "{bound} < {footprint}");
    }

    /// A submission that runs in its own task waits for room before the task starts:
    /// while the room is taken, its caller holds nothing, and a caller that goes away
    /// then (a client that disconnected) leaves nothing running and appends nothing.
    #[tokio::test]
    async fn a_submission_waits_for_room_before_its_task_runs_on_without_its_caller() {
        use std::future::Future;
        let dir = tempfile::tempdir().unwrap();
        let (wal, ing) = open(dir.path());
        let all = (RUNNING_ON_MAX_BYTES / 1024) as u32;
        let taken = ing.running_on_kib.clone().acquire_many_owned(all).await.unwrap();
        {
            let mut waiting = std::pin::pin!(ing.accept(submission(Some("gone"), &["x"])));
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            assert!(waiting.as_mut().poll(&mut cx).is_pending());
        } // the caller goes away while it waits
        drop(taken);
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(wal.next_offset(), 0, "a submission whose caller went away before it had room was appended");
        let a = ing.accept(submission(Some("kept"), &["y"])).await.unwrap();
        assert_eq!((a.first_offset, a.replayed), (0, false));
        assert_eq!(ing.running_on_kib.available_permits(), all as usize, "room was not given back");
    }

    /// A submission with no delivery id runs on its caller's task, and takes room all the
    /// same: what such submissions hold is bounded in all, not by the number of
    /// connections, and the room is held until its append resolved, then given back.
    #[tokio::test]
    async fn a_submission_with_no_delivery_id_waits_for_room_too() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, ing) = open(dir.path());
        let all = (RUNNING_ON_MAX_BYTES / 1024) as u32;
        let taken = ing.running_on_kib.clone().acquire_many_owned(all).await.unwrap();
        let ing2 = ing.clone();
        let mut waiting = tokio::spawn(async move { ing2.accept(submission(None, &["x", "y"])).await });
        // Time enough for an append to be durable, had it not waited.
        let early = tokio::time::timeout(std::time::Duration::from_millis(500), &mut waiting).await;
        assert!(early.is_err(), "a submission with no delivery id ran without room: {early:?}");
        assert_eq!(wal.next_offset(), 0, "a submission with no delivery id was appended without room");
        drop(taken);
        let a = waiting.await.unwrap().unwrap();
        assert_eq!((a.first_offset, a.last_offset, a.replayed), (0, 1, false));
        assert_eq!(ing.running_on_kib.available_permits(), all as usize, "room was not given back");
    }

    /// A retry the door would refuse under today's configuration is answered as the
    /// replay it is; when the state database cannot be read, neither "no replay" (the
    /// door would then send the refusal, for a delivery the log may hold) nor a replay is
    /// true: it is `StateUnavailable`, a 503 the sender retries.
    #[tokio::test]
    async fn a_replay_the_state_database_cannot_answer_is_unavailable_not_absent() {
        use wal::storage::{FaultOp, SimStorage, Storage};
        let sim = SimStorage::new();
        let storage: Arc<dyn Storage> = Arc::new(sim.clone());
        let wal =
            Arc::new(Wal::open_with(storage.clone(), std::path::Path::new("/sim/wal"), Default::default()).unwrap());
        let state = Arc::new(StateDb::open_on(storage, "/sim/state.redb").unwrap());
        let ing = Ingestor::new(wal, Arc::new(IdempotencyIndex::new(state.clone(), 3_600_000)));
        let s = submission(Some("d"), &["x"]);
        let now = s.received_at_unix_ms;
        let key = IdempotencyKey { source_key: "default".into(), endpoint_id: None, delivery_key: "d".into() };
        assert_eq!(ing.replay_of(&key, now).await.unwrap(), None);
        ing.accept(s).await.unwrap();
        assert!(ing.replay_of(&key, now).await.unwrap().is_some_and(|a| a.replayed && a.first_offset == 0));
        until_recorded(&ing, &key).await;
        // The disk fails a write, and the reopen that follows fails too (its file is
        // gone): until one succeeds, the database cannot answer.
        sim.fail_nth(FaultOp::Write, 1, std::io::ErrorKind::Other);
        assert!(state.force_schema_version(crate::state::SCHEMA_VERSION).is_err());
        sim.remove_file(std::path::Path::new("/sim/state.redb")).unwrap();
        assert!(state.reopen_if_failed().is_err());
        match ing.replay_of(&key, now).await {
            Err(IngestError::StateUnavailable(_)) => {}
            other => panic!("{other:?}"),
        }
    }

    /// A keyed request that reached its lookup more than SWEEP_GRACE_MS after its head
    /// arrived is refused (retryable), appending nothing: a checkpoint may have swept the
    /// key its lookup window covers, and "new" would append an accepted delivery again.
    /// A request without a delivery id has no lookup to miss, and is taken.
    #[tokio::test]
    async fn a_keyed_request_that_reaches_its_lookup_past_the_sweep_grace_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, ing) = open(dir.path());
        let late = |key: Option<&str>, by_ms: u64| {
            let mut s = submission(key, &["x"]);
            s.received_at_unix_ms -= by_ms;
            s
        };
        match ing.accept(late(Some("d"), SWEEP_GRACE_MS + 1_000)).await {
            Err(e @ IngestError::LookupTooLate { .. }) => assert_eq!(e.reason(), "lookup_too_late"),
            other => panic!("{other:?}"),
        }
        assert_eq!(wal.next_offset(), 0, "a refused request was appended");
        let a = ing.accept(late(Some("d"), SWEEP_GRACE_MS - 60_000)).await.unwrap();
        assert_eq!((a.first_offset, a.replayed), (0, false));
        let b = ing.accept(late(None, SWEEP_GRACE_MS + 1_000)).await.unwrap();
        assert_eq!(b.first_offset, 1);
        // The door's look-up for a request it refuses (its body or route no longer
        // passes) is held to the same bound: a late "none" would let the refusal stand
        // for a delivery the log holds.
        let key = IdempotencyKey { source_key: "default".into(), endpoint_id: None, delivery_key: "d".into() };
        let head = crate::time::now_unix_ms();
        assert!(ing.replay_of(&key, head).await.unwrap().is_some_and(|r| r.replayed && r.first_offset == 0));
        match ing.replay_of(&key, head - SWEEP_GRACE_MS - 1_000).await {
            Err(e @ IngestError::LookupTooLate { .. }) => assert_eq!(e.reason(), "lookup_too_late"),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_batch_is_one_append_with_envelopes_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, ing) = open(dir.path());
        let a = ing.accept(submission(None, &["{\"n\":1}", "{\"n\":2}"])).await.unwrap();
        assert_eq!((a.events, a.first_offset, a.last_offset, a.replayed), (2, 0, 1, false));
        let records: Vec<_> = wal::inspect::Records::new(&wal, 0).unwrap().map(|r| r.unwrap()).collect();
        let e1 = Envelope::decode(&records[1].payload).unwrap();
        assert_eq!(&e1.payload[..], b"{\"n\":2}");
        assert_eq!(e1.header.destination.topic, "events-1", "each event keeps its own destination");
        assert_eq!((e1.header.batch_index, e1.header.batch_len), (1, 2));
    }

    /// A keyed event's message id follows its place in the request, not in the batch:
    /// with an event dropped by routing, the batch's second event is the request's third,
    /// and a retry under a mapping that keeps the dropped one gives every event the id its
    /// first try gave it (a consumer deduplicating on ids keeps each event once).
    #[tokio::test]
    async fn a_keyed_events_message_id_follows_its_place_in_the_request() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, ing) = open(dir.path());
        let mut first_try = submission(Some("d"), &["a", "b", "c"]);
        first_try.events.remove(1);
        ing.accept(first_try).await.unwrap();
        let records: Vec<_> = wal::inspect::Records::new(&wal, 0).unwrap().map(|r| r.unwrap()).collect();
        let ids = |records: &[wal::Record]| -> Vec<(Vec<u8>, u128, u32)> {
            records
                .iter()
                .map(|r| {
                    let e = Envelope::decode(&r.payload).unwrap();
                    (e.payload.to_vec(), e.header.message_id, e.header.batch_index)
                })
                .collect()
        };
        let id = |i| message_id_for_delivery("default", None, "d", i);
        assert_eq!(ids(&records), vec![(b"a".to_vec(), id(0), 0), (b"c".to_vec(), id(2), 1)]);
        // The same delivery whole (its key lost, as after `state reset`): on a new log,
        // each event takes the id its place gives it, the kept ones as before.
        let dir = tempfile::tempdir().unwrap();
        let (wal, ing) = open(dir.path());
        ing.accept(submission(Some("d"), &["a", "b", "c"])).await.unwrap();
        let records: Vec<_> = wal::inspect::Records::new(&wal, 0).unwrap().map(|r| r.unwrap()).collect();
        assert_eq!(
            ids(&records),
            vec![(b"a".to_vec(), id(0), 0), (b"b".to_vec(), id(1), 1), (b"c".to_vec(), id(2), 2)]
        );
    }

    #[tokio::test]
    async fn a_retried_delivery_replays_offsets_and_appends_nothing_across_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (wal, ing) = open(dir.path());
            let a = ing.accept(submission(Some("d1"), &["a", "b"])).await.unwrap();
            let again = ing.accept(submission(Some("d1"), &["a", "b"])).await.unwrap();
            assert!(again.replayed);
            assert_eq!((again.first_offset, again.last_offset), (a.first_offset, a.last_offset));
            assert_eq!(wal.next_offset(), 2);
            // No checkpoint and no clean close. (Dropping in-process does not lose redb's
            // non-durable commits; the kill -9 test of the binary proves the rebuild.)
        }
        let (wal, ing) = open(dir.path());
        let again = ing.accept(submission(Some("d1"), &["a", "b"])).await.unwrap();
        assert!(again.replayed, "the key must survive the reopen");
        assert_eq!((again.first_offset, again.last_offset), (0, 1));
        assert_eq!(wal.next_offset(), 2);
        let fresh = ing.accept(submission(Some("d2"), &["c"])).await.unwrap();
        assert_eq!((fresh.first_offset, fresh.replayed), (2, false));
    }

    #[tokio::test]
    async fn the_same_delivery_id_through_two_endpoints_is_two_deliveries_across_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let through = |endpoint_id, body| Submission { endpoint_id, ..submission(Some("d1"), &[body]) };
        {
            let (wal, ing) = open(dir.path());
            let a = ing.accept(through(Some(1), "a")).await.unwrap();
            let b = ing.accept(through(Some(2), "b")).await.unwrap();
            let named = ing.accept(through(None, "n")).await.unwrap();
            assert_eq!([a, b, named].map(|x| (x.first_offset, x.replayed)), [(0, false), (1, false), (2, false)]);
            assert_eq!(wal.next_offset(), 3);
        }
        // The rebuild from the log computes the same scoped keys.
        let state_path = dir.path().join("state.redb");
        std::fs::remove_file(&state_path).unwrap();
        let (wal, ing) = open(dir.path());
        for (endpoint_id, offset) in [(Some(1), 0), (Some(2), 1), (None, 2)] {
            let again = ing.accept(through(endpoint_id, "x")).await.unwrap();
            assert_eq!((again.first_offset, again.replayed), (offset, true), "{endpoint_id:?}");
        }
        assert_eq!(wal.next_offset(), 3);
    }

    /// Holds the state database's write lock (redb takes one write transaction at a
    /// time), so the recorder cannot commit a key until the guard is dropped.
    fn stall_the_recorder(ing: &Ingestor) -> redb::WriteTransaction {
        ing.idempotency().state_for_tests().db().unwrap().begin_write().unwrap()
    }

    /// A keyed request is answered once its events are durable, without waiting for
    /// its key's record; until the record is committed a retry is answered from the
    /// claim as the replay it is (by `accept` and by `replay_of`), appending nothing,
    /// and afterwards from the database.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_keyed_request_is_answered_before_its_key_is_recorded_and_its_retry_is_a_replay() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, ing) = open(dir.path());
        let key = IdempotencyKey { source_key: "default".into(), endpoint_id: None, delivery_key: "d1".into() };
        let stalled = stall_the_recorder(&ing);
        let first =
            tokio::time::timeout(std::time::Duration::from_secs(5), ing.accept(submission(Some("d1"), &["a", "b"])))
                .await
                .expect("the answer waited for the key's record")
                .unwrap();
        assert_eq!((first.first_offset, first.last_offset, first.replayed), (0, 1, false));
        assert!(ing.idempotency().is_claimed(&key), "the key was recorded with the database's write lock held");
        assert_eq!(ing.idempotency().lookup(&key, crate::time::now_unix_ms()).unwrap(), None);
        let retry = ing.accept(submission(Some("d1"), &["a", "b"])).await.unwrap();
        assert_eq!((retry.first_offset, retry.last_offset, retry.replayed), (0, 1, true));
        let door = ing.replay_of(&key, crate::time::now_unix_ms()).await.unwrap();
        assert_eq!(door.map(|a| (a.first_offset, a.last_offset, a.replayed)), Some((0, 1, true)));
        assert_eq!(wal.next_offset(), 2, "a retry was appended");

        drop(stalled);
        until_recorded(&ing, &key).await;
        let prior = ing.idempotency().lookup(&key, crate::time::now_unix_ms()).unwrap();
        assert_eq!(prior.map(|p| (p.first_offset, p.last_offset)), Some((0, 1)));
        let retry = ing.accept(submission(Some("d1"), &["a", "b"])).await.unwrap();
        assert_eq!((retry.first_offset, retry.last_offset, retry.replayed), (0, 1, true));
        assert_eq!(wal.next_offset(), 2);
    }

    /// At most `RECORDINGS_UNANSWERED_MAX` acceptances are answered before their keys are
    /// recorded: with the recorder stalled, that many keyed requests are answered, the
    /// next one waits for its record, and it is answered once the recorder commits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_the_bound_on_unrecorded_answers_a_keyed_request_waits_for_its_record() {
        use crate::idempotency::RECORDINGS_UNANSWERED_MAX;
        let dir = tempfile::tempdir().unwrap();
        let wal = Arc::new(
            Wal::open(
                dir.path().join("wal"),
                wal::WalOptions {
                    sync: wal::SyncPolicy::Interval(std::time::Duration::from_millis(50)),
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let state = Arc::new(StateDb::open(dir.path().join("state.redb")).unwrap());
        let ing = Arc::new(Ingestor::new(wal.clone(), Arc::new(IdempotencyIndex::new(state, 3_600_000))));
        let stalled = stall_the_recorder(&ing);
        for i in 0..RECORDINGS_UNANSWERED_MAX {
            let answered = tokio::time::timeout(
                std::time::Duration::from_secs(5),
                ing.accept(submission(Some(&format!("d{i}")), &["x"])),
            )
            .await;
            assert!(matches!(answered, Ok(Ok(_))), "request {i} of {RECORDINGS_UNANSWERED_MAX}: {answered:?}");
        }
        let ing2 = ing.clone();
        let mut past = tokio::spawn(async move { ing2.accept(submission(Some("past"), &["x"])).await });
        let early = tokio::time::timeout(std::time::Duration::from_millis(300), &mut past).await;
        assert!(early.is_err(), "a request past the bound was answered before its key was recorded: {early:?}");
        assert_eq!(wal.next_offset(), RECORDINGS_UNANSWERED_MAX as u64 + 1, "its events are appended meanwhile");
        drop(stalled);
        let a = tokio::time::timeout(std::time::Duration::from_secs(10), past).await.unwrap().unwrap().unwrap();
        assert_eq!((a.first_offset, a.replayed), (RECORDINGS_UNANSWERED_MAX as u64, false));
        let key = IdempotencyKey { source_key: "default".into(), endpoint_id: None, delivery_key: "past".into() };
        assert!(ing.idempotency().lookup(&key, crate::time::now_unix_ms()).unwrap().is_some());
    }

    #[tokio::test]
    async fn a_delivery_in_progress_refuses_a_concurrent_twin_and_appends_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, ing) = open(dir.path());
        let key = IdempotencyKey { source_key: "default".into(), endpoint_id: None, delivery_key: "d1".into() };
        let claim = ing.idempotency().claim(&key).await.unwrap();
        assert!(matches!(ing.accept(submission(Some("d1"), &["a"])).await, Err(IngestError::InFlight)));
        // A twin whose body the door refuses asks for a replay instead: in flight too.
        assert!(matches!(ing.replay_of(&key, crate::time::now_unix_ms()).await, Err(IngestError::InFlight)));
        assert_eq!(wal.next_offset(), 0);
        drop(claim);
        assert!(matches!(ing.replay_of(&key, crate::time::now_unix_ms()).await, Ok(None)));
        assert!(!ing.accept(submission(Some("d1"), &["a"])).await.unwrap().replayed);
        assert_eq!(wal.next_offset(), 1);
    }

    /// An ingestor over a log of 8 KiB (segments of 4 KiB) in `dir`.
    fn small_log(dir: &std::path::Path) -> (Arc<Wal>, Ingestor) {
        let options = wal::WalOptions { segment_max_bytes: 4096, max_bytes: 8192, ..wal::WalOptions::default() };
        let wal = Arc::new(Wal::open(dir.join("wal"), options).unwrap());
        let state = Arc::new(StateDb::open(dir.join("state.redb")).unwrap());
        let ing = Ingestor::new(wal.clone(), Arc::new(IdempotencyIndex::new(state, 60_000)));
        (wal, ing)
    }

    #[tokio::test]
    async fn a_full_log_is_a_typed_error_with_nothing_appended() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, ing) = small_log(dir.path());
        let big = "x".repeat(1000);
        let mut last = Ok(());
        for _ in 0..100 {
            match ing.accept(submission(Some(&format!("k{}", wal.next_offset())), &[big.as_str()])).await {
                Ok(_) => {}
                Err(e) => {
                    last = Err(e);
                    break;
                }
            }
        }
        let before = wal.next_offset();
        assert!(matches!(last, Err(IngestError::Full { .. })), "{last:?}");
        assert!(matches!(ing.accept(submission(None, &[big.as_str()])).await, Err(IngestError::Full { .. })));
        assert_eq!(wal.next_offset(), before);
    }

    /// A request whose events could not fit even in an empty log is refused as too large
    /// (413), not as full (503, "retry later", for ever), and appends nothing.
    #[tokio::test]
    async fn a_batch_no_release_could_make_room_for_is_too_large_not_full() {
        let dir = tempfile::tempdir().unwrap();
        let (wal, ing) = small_log(dir.path());
        let event = "x".repeat(1000);
        let events = vec![event.as_str(); 9];
        let e = ing.accept(submission(Some("k"), &events)).await.unwrap_err();
        assert!(matches!(e, IngestError::BatchTooLarge { max_bytes: 8096, .. }), "{e:?}");
        assert_eq!(e.reason(), "batch_too_large");
        assert_eq!(wal.next_offset(), 0);
        let fits = ing.accept(submission(Some("k"), &events[..4])).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((fits.first_offset, fits.replayed), (0, false), "the refused delivery id was not recorded");
    }
}
