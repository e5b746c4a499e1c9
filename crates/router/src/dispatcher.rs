//! The dispatcher: reads the log once, in order, and hands each record to the lane of
//! its (source, destination), creating lanes within the source's cap and applying
//! admission at run time.
//!
//! Invariants:
//! - A record is handed to its lane (or disposed of by policy, or held) *before*
//!   `processed_below` moves past it, so the releaser, which reads `processed_below`
//!   first and the lanes second, never releases a record that is still owed.
//! - The dispatcher never waits long for a lane: a full lane overflows and re-reads
//!   from the log, so one stuck destination cannot stall the others. It waits for room
//!   in a healthy lane's full queue for at most `overflow_after`, and only until that
//!   lane's queue has stayed above half full for `overflow_after` in all: a destination
//!   that answers, only slower than the log is read, does not pace the others.
//! - Once a source's admitted destinations reach its cap, its admitted set never changes
//!   while running, so "rejected for cap" is a stable property of a record (the
//!   dead-letter lane re-reading the log decides it the same way).
//! - A record of a destination the operator gave up (`Policies::given_up`) is dropped
//!   and counted before any lane is made for it: it never pins the log, is never sent,
//!   and a dead-letter lane re-reading the log passes over it.
//! - A record this build cannot decode holds the log, and no lane's stored cursor passes
//!   it ([`Dispatcher::undecodable_from`]): it names no destination, so it may be any
//!   lane's, and a build that can read it (a rollback, then forward again) would
//!   otherwise find it below its lane's cursor and skip it as delivered. The records
//!   delivered after it are sent again after a restart, with the same ids.
//! - A record the cap refuses that lies below its own destination's cursor at start was
//!   delivered before the restart (the admitted set is built again at each start, so a
//!   destination admitted then may be refused now): it is passed over, neither counted,
//!   logged, held nor dead-lettered ([`DeliveredAtStart`], the notion the dead-letter
//!   lane uses too).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use ingest::envelope::{Envelope, EnvelopeSummary};
use tokio::sync::watch;
use wal::{Record, Wal};

use crate::cursors::{CursorStore, DeliveredAtStart};
use crate::lane::{self, Lane, LaneContext, Routed, SourceShare};
use crate::policy::{OnAdmissionFailure, Policies};
use crate::sink::{DestinationKey, LaneKey, Sink};

/// The log line of records dropped for the cap, at most one a second (their count and
/// offsets on the next line): the destination cap refuses what senders send.
static CAP_DROP_LOG: ingest::log_limit::LogLimit =
    ingest::log_limit::LogLimit::every(std::time::Duration::from_secs(1));

/// The log line of records refused for the cap and sent to the dead-letter destination,
/// at most one a second (their count and offsets on the next line).
static CAP_DEAD_LETTER_LOG: ingest::log_limit::LogLimit =
    ingest::log_limit::LogLimit::every(std::time::Duration::from_secs(1));

/// The log line of records held as undecodable, at most one a second (their count and
/// offsets on the next): a log written by a newer build can hold millions of them, and
/// each start meets them all again.
static UNDECODABLE_LOG: ingest::log_limit::LogLimit =
    ingest::log_limit::LogLimit::every(std::time::Duration::from_secs(1));

/// Writes the records dropped for the cap or sent to the dead-letter destination for it,
/// and those held as undecodable, that no later
/// line carried (the end of a burst), once their second is over; the router's releaser
/// calls it every round.
pub(crate) fn log_cap_drops_left_out() {
    flush_left_out(&CAP_DROP_LOG, |count, first_offset, last_offset| {
        tracing::warn!(
            dropped = count,
            first_offset,
            last_offset,
            "destination cap reached: records dropped, as configured (of any source, between these offsets)"
        )
    });
    flush_left_out(&CAP_DEAD_LETTER_LOG, |count, first_offset, last_offset| {
        tracing::warn!(
            dead_lettered = count,
            first_offset,
            last_offset,
            "destination cap reached: records sent to the dead-letter destination, as configured (of any source, between these offsets)"
        )
    });
    flush_left_out(&UNDECODABLE_LOG, |count, first_offset, last_offset| {
        tracing::error!(
            held = count,
            first_offset,
            last_offset,
            "undecodable records held in the log (between these offsets)"
        )
    });
}

/// Says, through `say` (count, first and last offset), what `limit` left out of the log
/// once its second is over.
fn flush_left_out(limit: &ingest::log_limit::LogLimit, say: impl FnOnce(u64, Option<u64>, Option<u64>)) {
    if let Some(s) = limit.flush_due() {
        let (first, last) = s.first_last();
        say(s.count, first, last);
    }
}

/// The destinations a source has lanes for, shared with its lanes' re-read filter.
#[derive(Debug, Default)]
pub(crate) struct Admitted {
    pub keys: RwLock<HashSet<DestinationKey>>,
    pub max: usize,
}

impl Admitted {
    pub(crate) fn is_rejected_for_cap(&self, key: &DestinationKey) -> bool {
        let keys = self.keys.read().unwrap_or_else(|p| p.into_inner());
        keys.len() >= self.max && !keys.contains(key)
    }
}

/// Everything the dispatcher keeps per source.
pub(crate) struct SourceRoute {
    pub share: SourceShare,
    pub admitted: Arc<Admitted>,
    pub dead_letter_lane: Option<Arc<Lane>>,
    /// The source's cursors at start, shared with its dead-letter lane.
    pub delivered_at_start: Arc<DeliveredAtStart>,
}

pub(crate) type Lanes = Arc<RwLock<HashMap<LaneKey, Arc<Lane>>>>;

/// How routing a record ended.
enum Routing {
    Done,
    /// The router began to stop while the record waited for its lane's room.
    Stopped,
}

pub(crate) struct Dispatcher<S, C> {
    pub wal: Arc<Wal>,
    pub policies: Arc<Policies>,
    pub lanes: Lanes,
    pub sources: HashMap<String, SourceRoute>,
    /// The stored cursors, none above the log's next offset at start (see
    /// `cursors_within_the_log`).
    pub cursors_at_start: HashMap<LaneKey, u64>,
    pub ctx: LaneContext<S, C>,
    /// The lowest offset held because it could not be admitted (`on_admission_failure =
    /// error`, or a record this build cannot decode), pinning the log below it.
    pub held_from: Arc<AtomicU64>,
    /// The lowest offset held because this build cannot decode it: it names no
    /// destination, so it may be any lane's, and no stored cursor may pass it.
    pub undecodable_from: Arc<AtomicU64>,
    /// Lane tasks, so a shutdown can wait for every one of them.
    pub lane_tasks: LaneTasks,
    /// The lane the previous record went to (lanes are never removed while running),
    /// with its source's queue limit and overflow wait.
    pub last_lane: Option<(Arc<Lane>, usize, std::time::Duration)>,
    /// The given-up destinations whose first record of this run was logged.
    pub given_up_logged: HashSet<LaneKey>,
    /// The sources (`None`: records that name none) a hold was reported for, in this
    /// run. Records are routed in offset order, so a source's first hold is its lowest:
    /// the router's status is told once per source, not for every record held.
    pub holds_reported: HashSet<Option<String>>,
}

pub(crate) type LaneTasks = Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>;

impl<S: Sink, C: CursorStore> Dispatcher<S, C> {
    pub(crate) async fn run(mut self, from: u64, mut shutdown: watch::Receiver<bool>) {
        // A hold lasts until the router stops (a restart decides again). On a stop the
        // lanes still deliver, and the log stays held, until they end: `Router::shutdown`
        // lets the hold go, the gauge with it, once every task has, so that the gauge and
        // `held_from` in the status never disagree (a router dropped without a stop is
        // told to stop as well, but nothing lets its hold go after: the daemon always
        // stops its router). Aborted (a stop cut short: `Router::shutdown` clears it
        // after), nothing is held by it. Ended by a closed log, or by a panic, both stay
        // as they were: the router is in Error and the log held until a restart.
        let held = crate::OnDrop(crate::clear_admission_held);
        let log_closed = self.read_and_route(from, &mut shutdown).await;
        let stopping = *shutdown.borrow();
        if stopping || log_closed {
            std::mem::forget(held);
        }
        if log_closed && !stopping {
            // The log's writer stopped (a panic of its thread, or a close the router was
            // not told of): nothing more is routed, which the status says instead of
            // Running.
            tracing::error!(
                "the router's dispatcher stopped: the log is closed; nothing more is delivered until a restart"
            );
            self.ctx
                .router_status
                .dispatcher_failed("the log is closed (its writer stopped); nothing more is read until a restart");
        }
    }

    /// Reads and routes from `from` until the router stops or the log is closed; `true`
    /// for a closed log.
    async fn read_and_route(&mut self, from: u64, shutdown: &mut watch::Receiver<bool>) -> bool {
        let retry_after = self.policies.default.batch.backoff_max;
        // Set after a failure: the next read does not wait for new records, so that a log
        // that reads again is known to (and the router's Error left) at once.
        let mut failing = false;
        let mut reader = loop {
            match self.wal.reader(from) {
                Ok(r) => break r,
                Err(wal::WalError::Closed) => return true,
                Err(e) => {
                    failing = true;
                    if self.failed_to_read(&e, retry_after, shutdown).await {
                        return false;
                    }
                }
            }
        };
        let (max_records, max_bytes) = (self.policies.read_batch_max_records, self.policies.read_batch_max_bytes);
        loop {
            let batch = if let Err(e) = crate::walk_to_position(&mut reader).await {
                Err(e)
            } else if failing {
                reader.try_read(max_records, max_bytes)
            } else {
                tokio::select! {
                    r = reader.read(max_records, max_bytes) => r,
                    _ = shutdown.changed() => return false,
                }
            };
            let batch = match batch {
                Ok(b) => {
                    if failing {
                        failing = false;
                        self.ctx.router_status.dispatcher_reading();
                    }
                    b
                }
                Err(wal::WalError::Closed) => return true,
                Err(e) => {
                    failing = true;
                    if self.failed_to_read(&e, retry_after, shutdown).await {
                        return false;
                    }
                    match self.wal.reader(reader.position()) {
                        Ok(r) => reader = r,
                        Err(e) => tracing::error!(error = %e, "router cannot reopen its reader"),
                    }
                    continue;
                }
            };
            for rec in batch {
                let offset = rec.offset;
                if let Routing::Stopped = self.route(rec, shutdown).await {
                    return false;
                }
                self.ctx.processed_below.store(offset + 1, Ordering::Release);
            }
            self.ctx.delivered.notify_one();
        }
    }

    /// Says that the log could not be read (the router is in Error until it reads again)
    /// and waits `retry_after`; true if shutdown came first.
    async fn failed_to_read(
        &self,
        e: &wal::WalError,
        retry_after: std::time::Duration,
        shutdown: &mut watch::Receiver<bool>,
    ) -> bool {
        tracing::error!(error = %e, "router cannot read the log; retrying");
        self.ctx.router_status.dispatcher_failed(&e.to_string());
        tokio::select! {
            _ = tokio::time::sleep(retry_after) => false,
            _ = shutdown.changed() => true,
        }
    }

    /// Routes one record; [`Routing::Stopped`] if the router began to stop while it
    /// waited for a lane's room (the record is then not routed: it is not counted as
    /// processed, and pins the log for the next start).
    async fn route(&mut self, rec: Record, shutdown: &mut watch::Receiver<bool>) -> Routing {
        if !self.policies.given_up.is_empty()
            && let Ok(s) = Envelope::summarize(&rec.payload)
            && self.policies.is_given_up(s.source_key, s.stream, s.topic)
        {
            self.give_up(rec.offset, s.source_key, s.stream, s.topic);
            return Routing::Done;
        }
        // While the lane of the previous record re-reads the log itself (its destination
        // down, or far behind), most records are only skipped: read just the summary
        // (no allocation) and decode in full only a record that is to be queued.
        // Otherwise decode at once; the record is almost certainly queued.
        let skipping = self.last_lane.as_ref().is_some_and(|(l, _, _)| l.is_overflowed());
        if skipping {
            let summary = match Envelope::summarize(&rec.payload) {
                Ok(s) => s,
                Err(e) => {
                    self.hold_undecodable(rec.offset, &e);
                    return Routing::Done;
                }
            };
            if let Some((lane, _, _)) = self.lane_of(summary.source_key, summary.stream, summary.topic)
                && lane.skip_if_overflowed(&summary, rec.offset)
            {
                return Routing::Done;
            }
        }
        let envelope = match Envelope::decode(&rec.payload) {
            Ok(e) => e,
            Err(e) => {
                self.hold_undecodable(rec.offset, &e);
                return Routing::Done;
            }
        };
        let h = &envelope.header;
        let Some((lane, queue_max, wait)) = self.lane_of(&h.source_key, &h.destination.stream, &h.destination.topic)
        else {
            let key = LaneKey {
                source: h.source_key.clone(),
                destination: DestinationKey::new(h.destination.stream.clone(), h.destination.topic.clone()),
            };
            self.reject_for_cap(&key, rec.offset, rec.place, envelope);
            return Routing::Done;
        };
        let routed = Routed::new(rec.offset, rec.place, envelope, None);
        let space = lane.space.notified();
        tokio::pin!(space);
        space.as_mut().enable();
        if let Err((routed, left)) = lane.offer(routed, queue_max, wait, true) {
            // A healthy lane with a full queue: give it a moment before it overflows, no
            // longer than what is left of `overflow_after` since the queue was first found
            // full, and none at all once the router stops (the lane may have ended, and
            // nothing would make room then).
            tokio::select! {
                _ = space => {}
                _ = tokio::time::sleep(left) => {}
                _ = shutdown.changed() => return Routing::Stopped,
            }
            let _ = lane.offer(routed, queue_max, wait, false);
        }
        Routing::Done
    }

    /// The lane of (source, stream, topic), created within the source's cap; `None` when
    /// the cap refuses it. Records of a source mostly go where the previous one went: that
    /// lane is reused without building (and hashing) a key.
    fn lane_of(&mut self, source: &str, stream: &str, topic: &str) -> Option<(Arc<Lane>, usize, std::time::Duration)> {
        if let Some(found) = self.last_lane.as_ref().filter(|(l, _, _)| {
            l.key.source == source && l.key.destination.stream == stream && l.key.destination.topic == topic
        }) {
            return Some(found.clone());
        }
        let key = LaneKey { source: source.to_string(), destination: DestinationKey::new(stream, topic) };
        let found = self.lane_for(&key)?;
        self.last_lane = Some(found.clone());
        Some(found)
    }

    /// A record of a destination the operator gave up: dropped, counted, and the first of
    /// each destination in this run logged with its offset. No lane is made for it, so
    /// nothing holds the log below it. A record below the destination's stored cursor
    /// was delivered before it was given up: it is neither counted nor logged.
    fn give_up(&mut self, offset: u64, source: &str, stream: &str, topic: &str) {
        let key = LaneKey { source: source.to_string(), destination: DestinationKey::new(stream, topic) };
        if self.cursors_at_start.get(&key).is_some_and(|&delivered_below| offset < delivered_below) {
            return;
        }
        self.count_given_up(offset, key);
    }

    /// Counts a record dropped because `key`, where it would go, is given up, and logs
    /// the first of each destination in this run.
    fn count_given_up(&mut self, offset: u64, key: LaneKey) {
        let (source, stream, topic) = (&key.source, &key.destination.stream, &key.destination.topic);
        metrics::counter!("iggy_connector_messages_dropped_total", "connector_key" => source.to_string(), "reason" => "given_up")
            .increment(1);
        if !self.given_up_logged.contains(&key) {
            tracing::warn!(
                offset,
                source,
                stream,
                topic,
                "destination given up (router.give_up): its records are dropped, not delivered"
            );
            self.given_up_logged.insert(key);
        }
    }

    /// Not a record this build can route: hold it (and the log below it) and say so.
    fn hold_undecodable(&mut self, offset: u64, e: &ingest::envelope::EnvelopeError) {
        // One a line, the others of the same second by their count and first and last
        // offset on the next (or on a line of their own: `log_cap_drops_left_out`).
        if let Some(s) = UNDECODABLE_LOG.admit_numbered(offset) {
            let (first, last) = s.first_last();
            tracing::error!(
                offset,
                error = %e,
                held_before = s.count,
                held_before_first_offset = first,
                held_before_last_offset = last,
                "undecodable record held in the log"
            );
        }
        metrics::counter!("iggy_connector_destinations_rejected_total", "connector_key" => "unknown", "reason" => "malformed")
            .increment(1);
        self.undecodable_from.fetch_min(offset, Ordering::AcqRel);
        self.hold_from(offset, None, || format!("a record this build cannot decode ({e})"));
    }

    /// Holds the log from `offset` on: a record of `source` (`None`: one that names
    /// none) admission refused (or could not decode) under a policy that keeps it, for
    /// `why`. Until a restart nothing at or above it is released; the gauge and the
    /// router's status say so, since no lane counts such a record as held.
    fn hold_from(&mut self, offset: u64, source: Option<&str>, why: impl FnOnce() -> String) -> u64 {
        metrics::gauge!("iggy_connector_admission_held").set(1.0);
        if self.holds_reported.insert(source.map(str::to_string)) {
            self.ctx.router_status.held_by_admission(offset, source, &why());
        }
        self.held_from.fetch_min(offset, Ordering::AcqRel)
    }

    fn source(&mut self, source: &str) -> &SourceRoute {
        if !self.sources.contains_key(source) {
            let route = new_source_route(
                source,
                &self.policies,
                &self.cursors_at_start,
                &self.ctx,
                &self.lanes,
                &self.lane_tasks,
            );
            self.sources.insert(source.to_string(), route);
        }
        &self.sources[source]
    }

    fn lane_for(&mut self, key: &LaneKey) -> Option<(Arc<Lane>, usize, std::time::Duration)> {
        let existing = self.lanes.read().unwrap_or_else(|p| p.into_inner()).get(key).cloned();
        let route = self.source(&key.source);
        let queue_max = route.share.policy.lane_queue_max_records;
        let wait = route.share.policy.overflow_after;
        if let Some(l) = existing {
            return Some((l, queue_max, wait));
        }
        if let Some(dl) = &route.dead_letter_lane
            && dl.key == *key
        {
            return Some((dl.clone(), queue_max, wait));
        }
        {
            let mut admitted = route.admitted.keys.write().unwrap_or_else(|p| p.into_inner());
            if admitted.len() >= route.admitted.max {
                return None;
            }
            admitted.insert(key.destination.clone());
        }
        let share = route.share.clone();
        let delivered_below = self.cursors_at_start.get(key).copied().unwrap_or(0);
        let lane = Arc::new(Lane::new(key.clone(), delivered_below, &share));
        self.lanes.write().unwrap_or_else(|p| p.into_inner()).insert(key.clone(), lane.clone());
        let task = lane::spawn(lane.clone(), self.ctx.clone());
        self.lane_tasks.lock().unwrap_or_else(|p| p.into_inner()).push(task);
        Some((lane, queue_max, wait))
    }

    fn reject_for_cap(&mut self, key: &LaneKey, offset: u64, place: wal::RecordPlace, envelope: Envelope) {
        let route = self.source(&key.source);
        if route.delivered_at_start.delivered(offset, &key.destination.stream, &key.destination.topic) {
            // Delivered before the restart, when the cap admitted its destination: there
            // is nothing to refuse, and nothing to hold the log for.
            return;
        }
        let policy = route.share.policy.clone();
        let dead_letter_lane = route.dead_letter_lane.clone();
        let max = route.admitted.max;
        let connector = key.source.clone();
        metrics::counter!("iggy_connector_destinations_rejected_total", "connector_key" => connector.clone(), "reason" => "cap")
            .increment(1);
        match policy.on_admission_failure {
            OnAdmissionFailure::Error => {
                let why = || {
                    format!(
                        "source {connector} reached its destination cap (max_destinations = {max}), and on_admission_failure = \"error\" keeps the records refused"
                    )
                };
                let before = self.hold_from(offset, Some(&connector), why);
                if before == u64::MAX {
                    tracing::error!(offset, source = %key.source, max_destinations = max, "destination cap reached: records held in the log");
                }
            }
            OnAdmissionFailure::Drop => {
                metrics::counter!("iggy_connector_messages_dropped_total", "connector_key" => connector, "reason" => "cap")
                    .increment(1);
                // Every drop is logged: one a line, the others of the same second by their
                // count and first and last offset on the next (or, at the end of a burst,
                // on a line of their own: `log_cap_drops_left_out`).
                if let Some(s) = CAP_DROP_LOG.admit_numbered(offset) {
                    let (first, last) = s.first_last();
                    tracing::warn!(
                        offset,
                        source = %key.source,
                        dropped_before = s.count,
                        dropped_before_first_offset = first,
                        dropped_before_last_offset = last,
                        "destination cap reached: record dropped, as configured"
                    );
                }
            }
            OnAdmissionFailure::DeadLetter => match (dead_letter_lane, &policy.dead_letter) {
                (Some(dl), _) => {
                    // Logged as drops are: one a line, the others of the same second by
                    // their count and offsets on the next.
                    if let Some(s) = CAP_DEAD_LETTER_LOG.admit_numbered(offset) {
                        let (first, last) = s.first_last();
                        tracing::warn!(
                            offset,
                            source = %key.source,
                            dead_letter = %dl.key.destination,
                            dead_lettered_before = s.count,
                            dead_lettered_before_first_offset = first,
                            dead_lettered_before_last_offset = last,
                            "destination cap reached: record sent to the dead-letter destination, as configured"
                        );
                    }
                    let routed = Routed::new(offset, place, envelope, Some("cap"));
                    let _ = dl.offer(routed, policy.lane_queue_max_records, policy.overflow_after, false);
                }
                (None, Some(dlq)) if route.share.dead_letter_given_up => {
                    // Refused by the cap in this run (records delivered before it were
                    // passed over above): the dead-letter lane's cursor says nothing
                    // about them, so every one is counted.
                    let key = LaneKey { source: connector, destination: dlq.clone() };
                    self.count_given_up(offset, key);
                }
                (None, _) => {
                    let why = || {
                        format!(
                            "source {connector} reached its destination cap (max_destinations = {max}), and it has no dead-letter destination for the records refused"
                        )
                    };
                    self.hold_from(offset, Some(&connector), why);
                }
            },
        }
    }
}

/// A source's policy, admitted set, send slots, re-read filter and dead-letter lane.
pub(crate) fn new_source_route<S: Sink, C: CursorStore>(
    source: &str,
    policies: &Policies,
    cursors_at_start: &HashMap<LaneKey, u64>,
    ctx: &LaneContext<S, C>,
    lanes: &Lanes,
    lane_tasks: &LaneTasks,
) -> SourceRoute {
    let policy = policies.for_source(source);
    let admitted = Arc::new(Admitted { keys: RwLock::default(), max: policy.max_destinations });
    let dead_letter = policy.dead_letter.clone();
    let dl_on_reject = policy.on_admission_failure == OnAdmissionFailure::DeadLetter;
    let belongs = {
        let admitted = admitted.clone();
        let dead_letter = dead_letter.clone();
        let given_up = policies.given_up.clone();
        Arc::new(move |lane: &LaneKey, e: &EnvelopeSummary<'_>| {
            if lane.source != e.source_key {
                return None;
            }
            // Given up: dropped by the dispatcher, never dead-lettered by a re-read.
            if crate::policy::is_given_up(&given_up, &lane.source, e.stream, e.topic) {
                return None;
            }
            let own = lane.destination.stream == e.stream && lane.destination.topic == e.topic;
            if Some(&lane.destination) == dead_letter.as_ref() && !own {
                let key = DestinationKey::new(e.stream, e.topic);
                return (dl_on_reject && admitted.is_rejected_for_cap(&key)).then_some(Some("cap"));
            }
            own.then_some(None)
        })
    };
    // A given-up dead-letter destination gets no lane: what would go there is dropped
    // and counted as given up, and holds nothing.
    let dead_letter_given_up = dead_letter
        .as_ref()
        .is_some_and(|d| crate::policy::is_given_up(&policies.given_up, source, &d.stream, &d.topic));
    // Nor does one that nothing is sent to through a lane (the cap's refusals go there
    // only under `dead_letter`): it would only show as a destination that never sends.
    let dead_letter = dead_letter.filter(|_| !dead_letter_given_up && dl_on_reject);
    let share = SourceShare {
        send_slots: Arc::new(crate::lane::SendSlots::new(policy.max_concurrent_destinations)),
        policy,
        belongs,
        dead_letter_given_up,
        queue_budget: ctx.queue_budget.clone(),
        dead_letter_lane: Arc::default(),
    };
    let delivered_at_start = Arc::new(DeliveredAtStart::of_source(cursors_at_start, source));
    let dead_letter_lane = dead_letter.map(|destination| {
        let key = LaneKey { source: source.to_string(), destination };
        let below = cursors_at_start.get(&key).copied().unwrap_or(0);
        let lane = Arc::new(Lane::new_dead_letter(key.clone(), below, &share, delivered_at_start.clone()));
        let _first = share.dead_letter_lane.set(Arc::downgrade(&lane));
        // A dead-letter lane is a lane like any other: counted from its start.
        lanes.write().unwrap_or_else(|p| p.into_inner()).insert(key, lane.clone());
        let task = lane::spawn(lane.clone(), ctx.clone());
        lane_tasks.lock().unwrap_or_else(|p| p.into_inner()).push(task);
        lane
    });
    SourceRoute { share, admitted, dead_letter_lane, delivered_at_start }
}
