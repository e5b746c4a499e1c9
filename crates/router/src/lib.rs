//! The router: drains the log into its destinations, one lane per destination, and
//! releases log space only below what every destination has acknowledged.
//!
//! ```text
//!  wal ──reader──▶ dispatcher ──offer──▶ lane (queue | re-read from the log) ──send──▶ Sink (Iggy)
//!                      │ processed_below          │ ack ─▶ cursor stored ─▶ low_water moves
//!                      └──────────────▶ releaser: release_below(min(processed, lanes' low water, held))
//! ```
//!
//! Invariants (each tested in `tests/`):
//! 1. **NACKs hold.** A failed send is retried with capped exponential backoff, forever;
//!    no number of failures stops a lane or drops a record. Only an operator's
//!    `on_admission_failure = drop | dead_letter` disposes of a record, counted.
//! 2. **A failing destination stalls nothing else.** Lanes are independent tasks; the
//!    dispatcher never waits for one; a stuck lane pins log space, not memory.
//! 3. **Release follows acknowledgement.** The log is released below the lowest offset
//!    any lane still owes, only after that lane's cursor is durable.
//! 4. **Order.** Within a destination, records are sent in log order.
//! 5. **Status tells the truth.** Statuses and their gauges move together
//!    ([`status::StatusCell::set`]); Degraded after `degraded_after_failures`, Running
//!    again on the first success; Error while the dispatcher or a lane cannot read the
//!    log, left as soon as it reads again ([`RouterHealth`] settles the router's own).
//!    The gauges of a router that stopped count no lane, no open breaker and nothing
//!    held: each count is taken back by a `Drop` of what it counts (a lane, its breaker,
//!    the task that wrote it). What is held (bytes held and queued, the oldest held
//!    record's age) is measured from the lanes by the releaser and at every scrape
//!    ([`Router::publish_held_gauges`]), so it stays true while the releaser waits on a
//!    stuck log or after it panicked. A task of the router that ends by a
//!    panic puts it (and a lane's, its destination and connector) in Error until a
//!    restart: nothing reports Running for work that nobody does ([`spawn_task`]).
//!    A lane is never seen worse off than its router: a lane that worsens tells the
//!    router before its own status moves, one that recovers moves its own first.
//! 6. **No cursor is ahead of the log.** A lane passes over records below its cursor as
//!    delivered; at start a stored cursor above the log's next offset (the log lost its
//!    tail, or was replaced) is taken as that offset and lowered in the store before the
//!    router runs, so records that reuse those offsets are delivered before release.
//! 7. **No task outlives its router's stop.** [`Router::shutdown`] joins every task; a
//!    stop abandoned part way (its future dropped at the end of the daemon's grace
//!    period) aborts those not ended, so no send goes on while the log closes, and no
//!    cursor commit starts. One already running on its blocking thread
//!    ([`StateCursorStore`]) cannot be aborted and finishes: it stores only cursors of
//!    acknowledged records, so what it stores is true, and the state database's final
//!    checkpoint, a write transaction too, waits for it. What the aborted tasks held is
//!    above the stored cursors and is sent again.

pub mod breaker;
pub mod cursors;
mod dispatcher;
pub mod iggy_sink;
mod lane;
pub mod policy;
pub mod prewarm;
pub mod sink;
pub mod status;
#[cfg(feature = "test-doubles")]
pub mod test_doubles;
mod write_watch;

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use wal::Wal;

pub use cursors::{CursorStore, StateCursorStore};
/// The largest payload Iggy stores in one message (`iggy::MAX_PAYLOAD_SIZE`: 64 * 1000 *
/// 1000 bytes, not 64 MiB). An event larger than this could be accepted into the log and
/// never delivered.
pub const IGGY_PAYLOAD_MAX_BYTES: u64 = iggy::prelude::MAX_PAYLOAD_SIZE as u64;
/// Iggy's limit on the encoded user headers of one message: a message over it cannot be
/// sent at all.
pub const IGGY_USER_HEADERS_MAX_BYTES: u64 = iggy::prelude::MAX_USER_HEADERS_SIZE as u64;

/// The lengths in bytes of an Iggy username and password the client sends at all: it
/// refuses others before they reach the server, so a connect with them never signs in.
pub const IGGY_USERNAME_BYTES: std::ops::RangeInclusive<usize> =
    iggy::prelude::defaults::MIN_USERNAME_LENGTH..=iggy::prelude::defaults::MAX_USERNAME_LENGTH;
pub const IGGY_PASSWORD_BYTES: std::ops::RangeInclusive<usize> =
    iggy::prelude::defaults::MIN_PASSWORD_LENGTH..=iggy::prelude::defaults::MAX_PASSWORD_LENGTH;

/// The most bytes of messages one send carries, whatever `batch_max_bytes` (which counts
/// payloads) allows: half the 64 MiB Iggy takes in one request (the server's
/// `max_message_size`), which closes the connection over it. Without it, a batch of
/// records with many forwarded headers could pass the limit, and its lane would send it
/// again for good, each time taken for a lost connection to the whole server. Half leaves
/// ample room for the request's own fields (names, partitioning, counts). A single
/// record larger than this is sent alone, and fits: at most [`IGGY_PAYLOAD_MAX_BYTES`]
/// of payload and [`IGGY_USER_HEADERS_MAX_BYTES`] of headers.
pub const SEND_MESSAGES_MAX_BYTES: usize = 32 * 1024 * 1024;

/// The most request headers a source may forward into its messages. Each message carries
/// them beside the daemon's own (source, content type, two metadata fields, four
/// dead-letter headers), every name and value at most 255 bytes (the door clamps values;
/// the config refuses longer names): 72 headers, at most about 37 KB encoded, well
/// inside [`IGGY_USER_HEADERS_MAX_BYTES`] (`iggy_sink`'s tests encode that worst case).
/// Over Iggy's limit a message could not be sent at all, and its destination would hold
/// at it for good.
pub const FORWARD_HEADERS_MAX: usize = 64;
use dispatcher::{Dispatcher, LaneTasks, Lanes};
pub use lane::LaneSnapshot;
use lane::{Lane, LaneContext, QueueBudget};
pub use policy::{BatchPolicy, BreakerPolicy, OnAdmissionFailure, Policies, RouterPolicy};
pub use sink::{DestinationKey, LaneKey, OutMessage, SendError, SendErrorKind, Sink, TopicInfo};
use status::{Status, StatusCell, StatusSnapshot};

/// The router's own status, settled from what troubles it in one place: Error while the
/// dispatcher or any lane cannot read the log, or once one of its tasks ended by a panic,
/// else Degraded while cursors cannot be stored or any destination is degraded, else
/// Running. Starting, Stopping and Stopped are the router's own (`start`, `shutdown`)
/// and no trouble moves them.
///
/// A connector's (source's) delivery status is settled from the same troubles, keeping
/// only those that affect it: the dispatcher's (it reads the log for every source) and
/// the cursor store's (no source's log is released), and its own lanes', never another
/// source's.
#[derive(Debug)]
pub struct RouterHealth {
    cell: StatusCell,
    troubles: Mutex<Troubles>,
}

/// The lane sets are ordered: a settle names the least lane in trouble, and an outage
/// moves every lane in and out of them one by one, each move a settle under the lock
/// every lane's status change takes. Found in order, that is a step down a tree, not a
/// walk of the set (tens of thousands of lanes made each outage quadratic: minutes of
/// CPU under that lock at 30,000).
#[derive(Debug, Default)]
struct Troubles {
    degraded: BTreeSet<LaneKey>,
    /// Lanes that cannot read the log.
    failed: BTreeSet<LaneKey>,
    /// Why the dispatcher cannot read the log, while it cannot.
    dispatcher: Option<String>,
    /// Why acknowledged cursors cannot be stored, while they cannot (the log stays
    /// pinned below them).
    cursors: Option<String>,
    /// Why the log's released space cannot be freed, while it cannot (the log fills
    /// though every destination delivers).
    release: Option<String>,
    /// Why the cursor store's release ceiling stands still, while the store says it is
    /// held by a failure (the daemon's idempotency checkpoints failing): delivered
    /// records are not released past it, so the log fills though every destination
    /// delivers.
    release_held: Option<String>,
    /// The router's own tasks (the dispatcher, the releaser, the cursor flusher) that
    /// ended by a panic: what they did is not done until a restart.
    tasks_ended: BTreeSet<&'static str>,
    /// Lanes whose task ended by a panic: their records are held until a restart.
    lanes_ended: BTreeSet<LaneKey>,
    /// Records the dispatcher holds in the log until a restart (refused by admission
    /// under a policy that keeps them, or undecodable): per source (`None`: a record
    /// that names none, so every source's), the lowest such offset and why. Nothing at
    /// or above the lowest is released, so the log fills though every destination
    /// delivers, and no lane counts these records as held.
    held_by_admission: BTreeMap<Option<String>, (u64, String)>,
}

impl Troubles {
    /// What the troubles say of the router as a whole (`source: None`) or of one source's
    /// delivery: Error once a task of the router (or of a lane of it) ended by a panic, or
    /// while the dispatcher, or a lane of it, cannot read the log;
    /// Degraded while cursors cannot be stored, or a lane of it is degraded; `None`: no
    /// trouble (Running).
    fn verdict(&self, source: Option<&str>) -> Option<(Status, String)> {
        if let Some(task) = self.tasks_ended.first() {
            return Some((Status::Error, format!("the router's {task} ended unexpectedly (a panic); restart it")));
        }
        if let Some(e) = &self.dispatcher {
            return Some((Status::Error, format!("the router cannot read the log: {e}")));
        }
        if let Some(k) = least_of(&self.lanes_ended, source) {
            return Some((
                Status::Error,
                format!("the task of destination {k} ended unexpectedly (a panic); restart it"),
            ));
        }
        if let Some(k) = least_of(&self.failed, source) {
            return Some((Status::Error, format!("destination {k} cannot read the log")));
        }
        if let Some(e) = &self.cursors {
            return Some((
                Status::Degraded,
                format!("acknowledged cursors cannot be stored (the log is not released): {e}"),
            ));
        }
        if let Some(e) = &self.release {
            return Some((Status::Degraded, format!("delivered log space cannot be freed (the log fills): {e}")));
        }
        if let Some(e) = &self.release_held {
            return Some((Status::Degraded, format!("delivered records are not released (the log fills): {e}")));
        }
        if let Some((offset, why)) = self
            .held_by_admission
            .iter()
            .filter(|(of, _)| source.is_none() || of.is_none() || of.as_deref() == source)
            .map(|(_, held)| held)
            .min()
        {
            return Some((
                Status::Degraded,
                format!("the log is held from offset {offset} until a restart (nothing above it is released): {why}"),
            ));
        }
        if let Some(k) = least_of(&self.degraded, source) {
            return Some((Status::Degraded, format!("destination {k} is degraded")));
        }
        None
    }
}

/// The least lane of `lanes`, or of those of `source`: a lane key orders by its source
/// first, so a source's lanes are together and the first at or after the least key that
/// source can have is its least.
fn least_of<'a>(lanes: &'a BTreeSet<LaneKey>, source: Option<&str>) -> Option<&'a LaneKey> {
    match source {
        None => lanes.first(),
        Some(s) => {
            let least = LaneKey { source: s.to_string(), destination: DestinationKey::new("", "") };
            lanes.range(least..).next().filter(|k| k.source == s)
        }
    }
}

/// The router's reason while nothing troubles it: running says the router works (it
/// reads the log, holds and routes), not that anything was delivered. Right after the
/// start, with no destination yet or with Iggy not yet answered, none is degraded
/// either; what each destination did is its own status.
const ROUTER_RUNNING_REASON: &str = "no destination is degraded";

impl RouterHealth {
    fn new() -> RouterHealth {
        RouterHealth { cell: StatusCell::new("router", "router"), troubles: Mutex::default() }
    }

    fn troubles(&self) -> std::sync::MutexGuard<'_, Troubles> {
        self.troubles.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the status to what `t` says, unless the router is starting or stopping.
    fn settle(&self, t: &Troubles, starting: bool) {
        let now = self.cell.get();
        let settles =
            matches!(now, Status::Running | Status::Degraded | Status::Error) || (starting && now == Status::Starting);
        if !settles {
            return;
        }
        let (to, why) = t.verdict(None).unwrap_or_else(|| (Status::Running, ROUTER_RUNNING_REASON.to_string()));
        self.cell.set(to, &why);
    }

    fn started(&self) {
        let t = self.troubles();
        self.settle(&t, true);
    }

    /// Sets a status of the router's own (stopping, stopped) under the troubles' lock,
    /// which every settle holds from reading the status to setting it: set without it,
    /// a settle that had read `Running` could write `Running` over `Stopping`, and no
    /// later settle moves a stopping router.
    fn set_own(&self, status: Status, why: &str) {
        let _settles_wait = self.troubles();
        self.cell.set(status, why);
    }

    /// Applies `change` to the troubles and settles the status if it changed them.
    fn update(&self, change: impl FnOnce(&mut Troubles) -> bool) {
        let mut t = self.troubles();
        if change(&mut t) {
            self.settle(&t, false);
        }
    }

    // The lane's own status and the router's move in an order that keeps a reader who
    // looks at the lane and then at the router from seeing the router better off than
    // the lane it just read: a lane that worsens tells the router first, a lane that
    // recovers sets its own status first.

    /// The lane `key` (status `lane`) is retrying without progress: Degraded.
    pub(crate) fn lane_degraded(&self, key: &LaneKey, lane: &StatusCell, why: &str) {
        self.update(|t| t.failed.remove(key) | t.degraded.insert(key.clone()));
        lane.set(Status::Degraded, why);
    }

    /// The lane `key` (status `lane`) cannot read the log: Error.
    pub(crate) fn lane_failed(&self, key: &LaneKey, lane: &StatusCell, why: &str) {
        self.update(|t| t.degraded.remove(key) | t.failed.insert(key.clone()));
        lane.set(Status::Error, why);
    }

    /// The lane `key` (status `lane`), in Error for a failed log read, reads the log again:
    /// `to`, the status it had before (Starting, Running or Degraded).
    pub(crate) fn lane_reads_again(&self, key: &LaneKey, lane: &StatusCell, to: Status, why: &str) {
        if to == Status::Degraded {
            // Still not progressing.
            self.lane_degraded(key, lane, why);
        } else {
            lane.set(to, why);
            self.update(|t| t.failed.remove(key));
        }
    }

    /// The lane `key` (status `lane`) moved its records on: Running.
    pub(crate) fn lane_recovered(&self, key: &LaneKey, lane: &StatusCell, why: &str) {
        lane.set(Status::Running, why);
        self.update(|t| t.degraded.remove(key) | t.failed.remove(key));
    }

    /// The lane `key` (status `lane`) took records another lane sent it (a dead-letter
    /// topic): Running if it is still Starting and not failing itself. Decided under the
    /// troubles' lock: a lane that worsens tells the router first, so a lane whose key is
    /// in the troubles is on its way to Degraded or Error, and made Running here, then
    /// Degraded by its own task, it would leave the router Running over it.
    pub(crate) fn lane_took_records_while_starting(&self, key: &LaneKey, lane: &StatusCell, why: &str) {
        let t = self.troubles();
        if lane.get() == Status::Starting && !t.degraded.contains(key) && !t.failed.contains(key) {
            // Not in the troubles: the router's status does not change.
            lane.set(Status::Running, why);
        }
    }

    pub(crate) fn dispatcher_failed(&self, e: &str) {
        self.cell.record_error(e);
        self.update(|t| t.dispatcher.replace(e.to_string()).as_deref() != Some(e));
    }

    /// The dispatcher holds the log from `offset` until a restart: a record of `source`
    /// (`None`: one that names no source) that admission refused under a policy that
    /// keeps it, or that this build cannot decode. Degraded: the log fills from there.
    pub(crate) fn held_by_admission(&self, offset: u64, source: Option<&str>, why: &str) {
        self.update(|t| {
            let held = t.held_by_admission.entry(source.map(str::to_string)).or_insert((u64::MAX, String::new()));
            if offset >= held.0 {
                return false;
            }
            *held = (offset, why.to_string());
            true
        });
    }

    pub(crate) fn dispatcher_reading(&self) {
        self.update(|t| t.dispatcher.take().is_some());
    }

    pub(crate) fn cursors_failed(&self, e: &str) {
        self.cell.record_error(e);
        self.update(|t| t.cursors.replace(e.to_string()).as_deref() != Some(e));
    }

    pub(crate) fn cursors_stored(&self) {
        self.update(|t| t.cursors.take().is_some());
    }

    pub(crate) fn release_failed(&self, e: &str) {
        self.cell.record_error(e);
        self.update(|t| t.release.replace(e.to_string()).as_deref() != Some(e));
    }

    pub(crate) fn released(&self) {
        self.update(|t| t.release.take().is_some());
    }

    /// What the cursor store says holds its release ceiling back (`None`: nothing).
    pub(crate) fn release_held_by(&self, why: Option<String>) {
        self.update(|t| {
            let changed = t.release_held != why;
            if changed && let Some(e) = &why {
                self.cell.record_error(e);
            }
            t.release_held = why;
            changed
        });
    }

    /// One of the router's own tasks ended by a panic (called while it unwinds).
    pub(crate) fn task_panicked(&self, task: &'static str) {
        tracing::error!(
            task,
            "a task of the router ended unexpectedly (a panic); the router is in error until a restart"
        );
        self.cell.record_error(&format!("the router's {task} ended unexpectedly (a panic)"));
        self.update(|t| t.tasks_ended.insert(task));
    }

    /// A lane's task ended by a panic (called while it unwinds).
    pub(crate) fn lane_panicked(&self, key: &LaneKey, lane: &StatusCell) {
        tracing::error!(destination = %key, "a lane's task ended unexpectedly (a panic); its records are held until a restart");
        self.update(|t| t.degraded.remove(key) | t.failed.remove(key) | t.lanes_ended.insert(key.clone()));
        lane.set(Status::Error, "the lane's task ended unexpectedly (a panic)");
    }

    pub fn snapshot(&self) -> StatusSnapshot {
        self.cell.snapshot()
    }

    /// The delivery status of `source`: the router's own while it is starting or
    /// stopping, otherwise what the troubles that affect this source say.
    pub fn connector_status(&self, source: &str) -> Status {
        let t = self.troubles();
        match self.cell.get() {
            Status::Running | Status::Degraded | Status::Error => {
                t.verdict(Some(source)).map_or(Status::Running, |(status, _)| status)
            }
            own => own,
        }
    }
}

/// A running router.
pub struct Router {
    lanes: Lanes,
    health: Arc<RouterHealth>,
    released_below: Arc<AtomicU64>,
    held_from: Arc<AtomicU64>,
    queue_budget: Arc<QueueBudget>,
    shutdown: watch::Sender<bool>,
    /// Taken by the shutdown, which runs behind `&self` so that the router's status
    /// stays readable ("stopping") while it waits for its tasks.
    tasks: std::sync::Mutex<Vec<JoinHandle<()>>>,
    lane_tasks: LaneTasks,
    stop_flusher: watch::Sender<bool>,
    flusher: std::sync::Mutex<Option<JoinHandle<()>>>,
    held_gauges: Arc<HeldGauges>,
    /// The sources the router had lanes for when it stopped: a stop empties the lanes,
    /// and the status of a source no longer configured must still be told (stopped), not
    /// left as it was before the stop.
    sources_at_stop: std::sync::Mutex<BTreeSet<String>>,
}

/// What measures and sets the gauges of what the router holds
/// (`iggy_connector_held_bytes`, `iggy_connector_queued_bytes`,
/// `iggy_connector_oldest_held_age_seconds`; the releaser also zeroes them when it starts
/// and when it is dropped unstopped): the releaser at each round and every scrape
/// ([`Router::publish_held_gauges`]) measure the lanes and set them, so they stay true
/// while the releaser waits on a log writer stuck in a sync, or after it panicked. Once the router stopped they are zero, and no
/// measure taken before the stop can set them again (the flag and the gauges change
/// under one lock).
struct HeldGauges {
    stopped: Mutex<bool>,
    lanes: Lanes,
    queue_budget: Arc<QueueBudget>,
}

impl HeldGauges {
    /// Measures what the lanes hold now and sets the gauges (nothing once stopped);
    /// returns the lowest offset a lane still needs.
    fn publish(&self) -> Option<u64> {
        let snapshot: Vec<Arc<Lane>> = {
            let l = self.lanes.read().unwrap_or_else(|p| p.into_inner());
            l.values().cloned().collect()
        };
        let mut low_water: Option<u64> = None;
        let mut held_bytes = 0u64;
        let mut oldest_ms = 0u64;
        let now_ms = lane::ingest_time_ms();
        for lane in &snapshot {
            let g = lane.gate();
            low_water = [low_water, g.low_water()].into_iter().flatten().min();
            let (bytes, oldest) = g.held();
            held_bytes += bytes;
            oldest_ms = oldest_ms.max(oldest.map_or(0, |o| o.age_ms(now_ms)));
        }
        let stopped = self.stopped.lock().unwrap_or_else(|p| p.into_inner());
        if !*stopped {
            metrics::gauge!("iggy_connector_held_bytes").set(held_bytes as f64);
            metrics::gauge!("iggy_connector_queued_bytes").set(self.queue_budget.queued_bytes() as f64);
            metrics::gauge!("iggy_connector_oldest_held_age_seconds").set(oldest_ms as f64 / 1000.0);
        }
        low_water
    }

    /// Zero from now on: the router stopped.
    fn clear(&self) {
        let mut stopped = self.stopped.lock().unwrap_or_else(|p| p.into_inner());
        *stopped = true;
        clear_held_gauges();
    }
}

/// Tasks a stop waits for, aborted if the stop is abandoned before they ended.
struct AbortUnlessJoined(Vec<JoinHandle<()>>);

impl AbortUnlessJoined {
    async fn join(&mut self) {
        for t in self.0.iter_mut() {
            let _ = t.await;
        }
        self.0.clear();
    }
}

impl Drop for AbortUnlessJoined {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Held by [`Router::shutdown`]: if the stop is abandoned, the tasks it has not taken
/// yet (the lanes', the flusher) are aborted too, and the status says the stop was cut.
struct AbortIfAbandoned<'a> {
    router: &'a Router,
    joined: bool,
}

impl Drop for AbortIfAbandoned<'_> {
    fn drop(&mut self) {
        if self.joined {
            return;
        }
        let r = self.router;
        for t in r.lane_tasks.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            t.abort();
        }
        if let Some(f) = r.flusher.lock().unwrap_or_else(|p| p.into_inner()).take() {
            f.abort();
        }
        // No task of the router runs on: it holds nothing, in the status and the gauges
        // as after a stop that ended.
        r.clear_after_stop();
        r.health.set_own(
            Status::Stopped,
            "stop abandoned: sends in flight cut, their records are sent again after a restart",
        );
    }
}

/// A router dropped without [`Router::shutdown`] (a daemon whose start failed after it
/// started delivery, say) still stops its tasks: with the stop signals' senders gone
/// and no value sent, a task waiting on them would wake at once, again and again.
impl Drop for Router {
    fn drop(&mut self) {
        self.shutdown.send_replace(true);
        self.stop_flusher.send_replace(true);
    }
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router").field("released_below", &self.released_below()).finish()
    }
}

impl Router {
    /// Starts draining `wal` into `sink`. Must be called inside a tokio runtime. A stored
    /// cursor above the log's next offset is lowered to it (durably, in `cursors`, before
    /// this returns; a failure to do so is an `Err`). The first start over a log just
    /// opened belongs before the log takes appends: a cursor ahead of the log's end at
    /// open, once new appends reached it, looks like a live one.
    pub fn start<S: Sink, C: CursorStore>(
        wal: Arc<Wal>,
        sink: Arc<S>,
        cursors: Arc<C>,
        policies: Policies,
    ) -> Result<Router, String> {
        policies.validate()?;
        let cursors_at_start = cursors_within_the_log(&*cursors, wal.start_offset(), wal.next_offset())?;
        let policies = Arc::new(policies);
        let health = Arc::new(RouterHealth::new());
        let (shutdown, shutdown_rx) = watch::channel(false);
        let lanes: Lanes = Arc::default();
        let processed_below = Arc::new(AtomicU64::new(wal.start_offset()));
        let delivered = Arc::new(Notify::new());
        let cursor_dirty = Arc::new(Notify::new());
        let (stop_flusher, stop_flusher_rx) = watch::channel(false);
        let on_panic = |task: &'static str| {
            let health = health.clone();
            move || health.task_panicked(task)
        };
        let undecodable_from = Arc::new(AtomicU64::new(u64::MAX));
        let flusher = spawn_task(
            cursor_flush_loop(
                lanes.clone(),
                cursors.clone(),
                undecodable_from.clone(),
                cursor_dirty.clone(),
                delivered.clone(),
                health.clone(),
                stop_flusher_rx,
            ),
            on_panic("cursor flusher"),
        );
        let queue_budget = Arc::new(QueueBudget::new(policies.queues_max_bytes));
        let ctx = LaneContext {
            wal: wal.clone(),
            sink,
            cursors: cursors.clone(),
            processed_below: processed_below.clone(),
            delivered: delivered.clone(),
            cursor_dirty,
            shutdown: shutdown_rx.clone(),
            router_status: health.clone(),
            writes: Arc::default(),
            queue_budget: queue_budget.clone(),
        };
        let held_from = Arc::new(AtomicU64::new(u64::MAX));
        let lane_tasks = LaneTasks::default();
        let dispatcher = Dispatcher {
            lane_tasks: lane_tasks.clone(),
            wal: wal.clone(),
            policies,
            lanes: lanes.clone(),
            sources: HashMap::new(),
            cursors_at_start,
            ctx,
            held_from: held_from.clone(),
            undecodable_from,
            last_lane: None,
            given_up_logged: HashSet::new(),
            holds_reported: HashSet::new(),
        };
        let start = wal.start_offset();
        let mut tasks = vec![spawn_task(dispatcher.run(start, shutdown_rx.clone()), on_panic("log reader"))];
        let released_below = Arc::new(AtomicU64::new(start));
        let held_gauges = Arc::new(HeldGauges {
            stopped: Mutex::new(false),
            lanes: lanes.clone(),
            queue_budget: queue_budget.clone(),
        });
        tasks.push(spawn_task(
            release_loop(
                wal,
                cursors.clone(),
                held_gauges.clone(),
                processed_below,
                held_from.clone(),
                released_below.clone(),
                delivered,
                health.clone(),
                queue_budget.clone(),
                shutdown_rx,
            ),
            on_panic("releaser"),
        ));
        health.started();
        Ok(Router {
            lanes,
            health,
            released_below,
            held_from,
            queue_budget,
            shutdown,
            tasks: std::sync::Mutex::new(tasks),
            lane_tasks,
            stop_flusher,
            flusher: std::sync::Mutex::new(Some(flusher)),
            held_gauges,
            sources_at_stop: std::sync::Mutex::default(),
        })
    }

    /// Sets the gauges of what the router holds (bytes held and queued, the oldest held
    /// record's age) from its lanes as they are now; nothing once it stopped. Called at
    /// each scrape, so that they stay true while the releaser, which sets them too,
    /// waits on the log or is gone.
    pub fn publish_held_gauges(&self) {
        self.held_gauges.publish();
    }

    /// Every lane the router delivers through, with its live state, ordered by source
    /// and destination.
    pub fn destinations(&self) -> Vec<LaneSnapshot> {
        let lanes = self.lanes.read().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<LaneSnapshot> = lanes.values().map(|l| l.snapshot()).collect();
        v.sort_by(|a, b| (&a.source, &a.destination).cmp(&(&b.source, &b.destination)));
        v
    }

    /// The sources the router has lanes for, each once, in order: configured ones that
    /// routed a record, and any the log holds records of that the configuration no
    /// longer names. Once stopped, those it had when it stopped.
    pub fn sources(&self) -> Vec<String> {
        let mut sources = self.sources_at_stop.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let lanes = self.lanes.read().unwrap_or_else(|p| p.into_inner());
        let of_lanes: BTreeSet<&str> = lanes.keys().map(|k| k.source.as_str()).collect();
        sources.extend(of_lanes.into_iter().map(str::to_string));
        sources.into_iter().collect()
    }

    /// The lanes of one source.
    pub fn destinations_of(&self, source: &str) -> Vec<LaneSnapshot> {
        self.destinations().into_iter().filter(|d| d.source == source).collect()
    }

    pub fn status(&self) -> StatusSnapshot {
        self.health.snapshot()
    }

    /// The delivery status of one source (connector): Error while the router cannot read
    /// the log or one of the source's destinations cannot; Degraded while cursors cannot
    /// be stored or one of its destinations is degraded; Running otherwise. Another
    /// source's trouble never shows here. While the router starts or stops, its own
    /// status.
    pub fn connector_status(&self, source: &str) -> Status {
        self.health.connector_status(source)
    }

    /// The log has been released below this offset.
    pub fn released_below(&self) -> u64 {
        self.released_below.load(Ordering::Acquire)
    }

    /// The bytes all lanes keep queued in memory now (with the batches taken from their
    /// queues whose deliveries have not ended), and the most they may
    /// (`Policies::queues_max_bytes`); both 0 once the router stopped, as in its gauges:
    /// a stopped router queues nothing (a stop cut short leaves a batch in flight
    /// counted until its aborted lane is dropped, a moment later).
    pub fn queued_bytes(&self) -> (usize, usize) {
        if self.health.cell.get() == Status::Stopped {
            return (0, 0);
        }
        (self.queue_budget.queued_bytes(), self.queue_budget.max_bytes())
    }

    /// The lowest offset held because it could not be admitted, if any.
    pub fn held_from(&self) -> Option<u64> {
        Some(self.held_from.load(Ordering::Acquire)).filter(|&o| o != u64::MAX)
    }

    /// Stops every task; batches in flight stay in the log and are sent again next time.
    /// The status says `stopping` until every task has stopped, then `stopped`; a second
    /// call finds nothing left to wait for.
    ///
    /// A stop abandoned part way (its future dropped: the daemon's grace period ended
    /// while a send still waited for its destination) aborts every task of the router
    /// that has not ended, so none outlives the stop (a lane's send, the flusher storing
    /// cursors while the log closes): what they held stays in the log, above the stored
    /// cursors, and is sent again after the restart.
    pub async fn shutdown(&self) {
        self.health.set_own(Status::Stopping, "shutdown requested");
        let _ = self.shutdown.send(true);
        let mut abandoned = AbortIfAbandoned { router: self, joined: false };
        let mut tasks = AbortUnlessJoined(std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner())));
        tasks.join().await;
        // The dispatcher has stopped, so no lane is created after this.
        let mut lane_tasks =
            AbortUnlessJoined(std::mem::take(&mut *self.lane_tasks.lock().unwrap_or_else(|p| p.into_inner())));
        lane_tasks.join().await;
        // Every lane has stopped: store what they acknowledged, then stop the flusher.
        let _ = self.stop_flusher.send(true);
        let flusher = self.flusher.lock().unwrap_or_else(|p| p.into_inner()).take();
        AbortUnlessJoined(flusher.into_iter().collect()).join().await;
        abandoned.joined = true;
        self.clear_after_stop();
        self.health.set_own(Status::Stopped, "shutdown complete");
    }

    /// Once no task of the router runs (every one joined, or aborted by a stop cut
    /// short): the lanes go (and with them their counts in the gauges, taken back when a
    /// lane is dropped), as they did when the router itself was dropped at its shutdown;
    /// the gauges of what it held go to zero; and, as nothing runs that could release the
    /// log below a held record any more, the hold goes with the router, in the status as
    /// in its gauge.
    fn clear_after_stop(&self) {
        let lanes: Vec<Arc<Lane>> =
            self.lanes.write().unwrap_or_else(|p| p.into_inner()).drain().map(|(_, lane)| lane).collect();
        self.sources_at_stop
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(lanes.iter().map(|l| l.key.source.clone()));
        for lane in lanes {
            lane.status.set(Status::Stopped, "router stopped");
        }
        self.held_gauges.clear();
        self.held_from.store(u64::MAX, Ordering::Release);
        clear_admission_held();
    }
}

/// Lowers every stored cursor above `wal`'s next offset to it, durably, as
/// [`Router::start`] does: for a daemon that serves without its router. It must run
/// before the log takes appends, whether the router runs or not: a run that accepts
/// events at offsets below a stale cursor would otherwise leave, for the next run that
/// delivers, new records that look delivered (and are released, never sent).
pub fn lower_cursors_ahead_of_the_log<C: CursorStore>(wal: &Wal, cursors: &C) -> Result<(), String> {
    cursors_within_the_log(cursors, wal.start_offset(), wal.next_offset()).map(drop)
}

/// The stored cursors, none above `log_next_offset`. A cursor above the log's next offset
/// says records were delivered that the log does not hold: it lost its tail after the
/// cursor was stored (a power loss under `wal.sync = "interval"`, recovery cutting damage
/// in the last synced write) or the log directory was replaced. Kept, it would make its
/// lane pass over the new records that reuse those offsets as delivered, and the
/// releaser free them, never sent. Such a cursor is taken as the log's next offset, and
/// lowered in the store (durably) before the router runs, so a later store, which only
/// ever raises a cursor, cannot leave the old value in place.
///
/// Against the log's end at open: the daemon starts the router before it serves. (A
/// stale cursor that appends made since the open have reached cannot be told apart.)
///
/// A cursor at or below the log's start says nothing of any record the log holds (every
/// one is at or above it), so it is forgotten, durably (a store that cannot delete it keeps
/// it, with a warning, until a later start): the store does not grow by every
/// destination that was ever written to (names a route takes from the payload, run
/// after run), and a start does not load them all.
fn cursors_within_the_log<C: CursorStore>(
    cursors: &C,
    log_start_offset: u64,
    log_next_offset: u64,
) -> Result<HashMap<LaneKey, u64>, String> {
    let mut loaded = cursors.load()?;
    let mut behind: Vec<(LaneKey, u64)> =
        loaded.iter().filter(|(_, c)| **c <= log_start_offset).map(|(l, c)| (l.clone(), *c)).collect();
    if !behind.is_empty() {
        behind.sort();
        tracing::info!(cursors = behind.len(), log_start_offset, "forgetting cursors the log has passed");
        for (lane, _) in &behind {
            loaded.remove(lane);
        }
        // Housekeeping only: a cursor the log's start has passed is harmless where it
        // stays, so a store that cannot delete it now does not stop the start.
        if let Err(e) = cursors.forget(behind) {
            tracing::warn!(error = %e, "forgetting cursors the log has passed failed; they are kept, and forgotten at a later start");
        }
    }
    let mut ahead: Vec<(LaneKey, u64)> = Vec::new();
    for (lane, cursor) in loaded.iter_mut() {
        if *cursor > log_next_offset {
            tracing::warn!(
                lane = %lane,
                stored_cursor = *cursor,
                log_next_offset,
                "a stored cursor is ahead of the log (it lost its tail, or was replaced, after the cursor was stored); the lane resumes at the log's end"
            );
            *cursor = log_next_offset;
            ahead.push((lane.clone(), log_next_offset));
        }
    }
    if !ahead.is_empty() {
        ahead.sort();
        cursors.lower(ahead).map_err(|e| format!("lowering cursors ahead of the log: {e}"))?;
    }
    Ok(loaded)
}

/// Bytes of frames a new log reader walks, finding its position from the start of its
/// segment, before it lets the runtime's other tasks run. A segment is up to
/// `segment_max_bytes` (64 MiB by default), which one walk would read (from the disk,
/// past the page cache the writer gave back) while holding a worker that the door and
/// every lane share, the only one on a 2-core host. 256 KiB (the reader's read size)
/// is a fraction of a millisecond from the page cache; a yield costs about a
/// microsecond, so a whole segment's walk is 256 turns.
pub(crate) const READER_WALK_BYTES_PER_TURN: u64 = 256 << 10;

/// Walks `reader` to its position in steps of [`READER_WALK_BYTES_PER_TURN`], letting the
/// runtime's other tasks run between them.
pub(crate) async fn walk_to_position(reader: &mut wal::Reader) -> wal::Result<()> {
    while !reader.position_some(READER_WALK_BYTES_PER_TURN)? {
        tokio::task::yield_now().await;
    }
    Ok(())
}

/// Spawns a task that must not end unnoticed: one of the router's, and the daemon's own
/// listeners and loops. If it ends by a panic, `on_panic` runs as it unwinds: the task is
/// gone and what it did is not done until a restart, so its owner must say so instead of
/// reporting Running (tokio keeps a task's panic to its join handle, which only a
/// shutdown awaits). A task that returns was told to stop.
pub fn spawn_task<F>(task: F, on_panic: impl FnOnce() + Send + 'static) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    /// Runs its function if dropped while the thread panics: the task's future is dropped
    /// while the panic unwinds out of its poll.
    struct OnPanic<G: FnOnce()>(Option<G>);

    impl<G: FnOnce()> Drop for OnPanic<G> {
        fn drop(&mut self) {
            if std::thread::panicking()
                && let Some(f) = self.0.take()
            {
                f();
            }
        }
    }

    tokio::spawn(async move {
        let _watch = OnPanic(Some(on_panic));
        task.await
    })
}

/// Runs its function when dropped, unless by a panic. Held by the task that is the one
/// writer of some gauges, with a function that sets them to zero, so that once the task
/// was stopped they say the truth: nothing held by a router that is gone. A task that
/// panicked leaves them as they were: the router is in Error and the records it held
/// stay held (the log pinned) until a restart.
pub(crate) struct OnDrop(pub fn());

impl Drop for OnDrop {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            (self.0)();
        }
    }
}

/// No record holds the log for admission: the dispatcher was aborted, or the router
/// stopped.
pub(crate) fn clear_admission_held() {
    metrics::gauge!("iggy_connector_admission_held").set(0.0);
}

/// The router's gauges of what it holds, at zero: a router that stopped holds nothing.
fn clear_held_gauges() {
    metrics::gauge!("iggy_connector_held_bytes").set(0.0);
    metrics::gauge!("iggy_connector_queued_bytes").set(0.0);
    metrics::gauge!("iggy_connector_queues_max_bytes").set(0.0);
    metrics::gauge!("iggy_connector_oldest_held_age_seconds").set(0.0);
}

#[allow(clippy::too_many_arguments)]
async fn release_loop<C: CursorStore>(
    wal: Arc<Wal>,
    cursors: Arc<C>,
    held_gauges: Arc<HeldGauges>,
    processed_below: Arc<AtomicU64>,
    held_from: Arc<AtomicU64>,
    released_below: Arc<AtomicU64>,
    delivered: Arc<Notify>,
    health: Arc<RouterHealth>,
    queue_budget: Arc<QueueBudget>,
    mut shutdown: watch::Receiver<bool>,
) {
    metrics::gauge!("iggy_connector_queued_bytes").set(0.0);
    metrics::gauge!("iggy_connector_queues_max_bytes").set(queue_budget.max_bytes() as f64);
    // Aborted (the router dropped without a stop), nothing is held by it any more. On a
    // stop the lanes still hold and send until they end: `Router::shutdown` clears these
    // once they have.
    let held = OnDrop(clear_held_gauges);
    loop {
        tokio::select! {
            _ = delivered.notified() => {}
            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            _ = shutdown.changed() => {
                std::mem::forget(held);
                return;
            }
        }
        // `processed_below` first: every record below it is in a lane by now.
        let mut low = processed_below.load(Ordering::Acquire).min(held_from.load(Ordering::Acquire));
        if let Some(lw) = held_gauges.publish() {
            low = low.min(lw);
        }
        // Nor past what the cursor store's owner still needs of the log (the daemon: a
        // record whose delivery id is not yet durably checkpointed).
        dispatcher::log_cap_drops_left_out();
        let ceiling = cursors.release_ceiling();
        // Said only while the ceiling is what holds the log: below what delivery alone
        // would free.
        let held = cursors.release_held_by().filter(|_| ceiling < low);
        health.release_held_by(held.map(|why| format!("the log is not released past offset {ceiling}: {why}")));
        low = low.min(ceiling);
        if low > released_below.load(Ordering::Acquire) {
            match wal.release_below(low).await {
                Ok(r) => {
                    released_below.store(low, Ordering::Release);
                    health.released();
                    if r.segments_deleted > 0 {
                        tracing::debug!(
                            below = low,
                            segments = r.segments_deleted,
                            bytes = r.bytes_freed,
                            "log released"
                        );
                    }
                }
                Err(e) => {
                    // Each round tries again (rounds follow deliveries, not a clock): one
                    // line a minute, with how many failed since the last.
                    static RELEASE_FAILED_LOG: ingest::log_limit::LogLimit =
                        ingest::log_limit::LogLimit::every(std::time::Duration::from_secs(60));
                    if let Some(failed_before) = RELEASE_FAILED_LOG.admit() {
                        tracing::error!(error = %e, failed_before, "releasing log space failed; will retry");
                    }
                    health.release_failed(&format!("releasing the log below {low} failed: {e}"));
                }
            }
        }
    }
}

/// Stores the cursors of every lane that acknowledged records since the last store, in
/// one durable commit, and wakes the releaser. Acknowledgements that arrive during a
/// commit go into the next one (group commit across lanes); on a stop signal it stores
/// once more and ends.
async fn cursor_flush_loop<C: CursorStore>(
    lanes: Lanes,
    cursors: Arc<C>,
    undecodable_from: Arc<AtomicU64>,
    dirty: Arc<Notify>,
    delivered: Arc<Notify>,
    health: Arc<RouterHealth>,
    mut stop: watch::Receiver<bool>,
) {
    let mut failures = 0u32;
    let mut stop_seen = false;
    loop {
        // A stop is taken first: once asked, the flusher stores once more and ends,
        // however many acknowledgements keep coming.
        let stopping = stop_seen
            || tokio::select! {
                biased;
                _ = stop.changed() => true,
                _ = dirty.notified() => false,
            };
        let snapshot: Vec<(Arc<Lane>, u64)> = {
            let l = lanes.read().unwrap_or_else(|p| p.into_inner());
            l.values()
                .filter_map(|lane| {
                    let acked = lane.gate().acked_below();
                    // No cursor passes a record held as undecodable (see `Dispatcher`).
                    // Read after the acknowledgements: a lane acknowledges past that
                    // record only after the dispatcher published it (`processed_below`,
                    // which follows the hold), so this load sees the hold.
                    let acked = acked.min(undecodable_from.load(Ordering::Acquire));
                    (acked > lane.delivered_below.load(Ordering::Acquire)).then(|| (lane.clone(), acked))
                })
                .collect()
        };
        if !snapshot.is_empty() {
            fail_points::fail_point!("router.acked");
            let rows = snapshot.iter().map(|(l, a)| (l.key.clone(), *a)).collect();
            match cursors.store(rows).await {
                Ok(()) => {
                    failures = 0;
                    health.cursors_stored();
                    for (lane, stored) in &snapshot {
                        lane.delivered_below.fetch_max(*stored, Ordering::AcqRel);
                        lane.gate().cursor_stored(*stored);
                    }
                    delivered.notify_one();
                }
                Err(e) => {
                    failures = failures.saturating_add(1);
                    tracing::error!(error = %e, "storing cursors failed; retrying");
                    metrics::counter!("iggy_connector_cursor_store_failures_total").increment(1);
                    health.cursors_failed(&format!("storing cursors failed: {e}"));
                    if stopping {
                        // The last try failed: what it carried stays in the log, and is
                        // delivered again after a restart (with the same ids).
                        return;
                    }
                    // The backoff (up to 25.6 s) ends early for a stop, which must not
                    // wait it out past the daemon's grace period.
                    let delay = std::time::Duration::from_millis(100u64.saturating_mul(1 << failures.min(8)));
                    tokio::select! {
                        biased;
                        _ = stop.changed() => stop_seen = true,
                        _ = tokio::time::sleep(delay) => {}
                    }
                    dirty.notify_one();
                    continue;
                }
            }
        }
        if stopping {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source's least lane in trouble is found by its place in the ordered set, also
    /// where another source's name begins with it or sorts between its lanes.
    #[test]
    fn the_least_lane_of_a_source_is_its_own() {
        let lane = |source: &str, stream: &str| LaneKey {
            source: source.into(),
            destination: DestinationKey::new(stream, "t"),
        };
        let lanes: BTreeSet<LaneKey> =
            [lane("ab", "a"), lane("ab", "0"), lane("b", "z"), lane("a", "q"), lane("a", "m"), lane("abc", "")].into();
        assert_eq!(least_of(&lanes, None), Some(&lane("a", "m")));
        assert_eq!(least_of(&lanes, Some("a")), Some(&lane("a", "m")));
        assert_eq!(least_of(&lanes, Some("ab")), Some(&lane("ab", "0")));
        assert_eq!(least_of(&lanes, Some("abc")), Some(&lane("abc", "")));
        assert_eq!(least_of(&lanes, Some("b")), Some(&lane("b", "z")));
        assert_eq!(least_of(&lanes, Some("aa")), None);
        assert_eq!(least_of(&lanes, Some("c")), None);
        assert_eq!(least_of(&lanes, Some("")), None);
        let only_longer: BTreeSet<LaneKey> = [lane("ab", "a")].into();
        assert_eq!(least_of(&only_longer, Some("a")), None, "another source's lane, whose name begins with this one's");
    }

    /// Once cleared (the router stopped), a measure taken then sets nothing: a scrape
    /// racing the stop cannot leave the gauges counting what a stopped router held.
    #[test]
    fn a_measure_after_the_clear_sets_no_held_gauge() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            let queue_budget = Arc::new(QueueBudget::new(1 << 20));
            assert!(queue_budget.take(4096));
            let gauges = HeldGauges { stopped: Mutex::new(false), lanes: Lanes::default(), queue_budget };
            gauges.publish();
            assert!(handle.render().lines().any(|l| l == "iggy_connector_queued_bytes 4096"), "{}", handle.render());
            gauges.clear();
            gauges.publish();
            assert!(handle.render().lines().any(|l| l == "iggy_connector_queued_bytes 0"), "{}", handle.render());
        });
    }

    /// A settle reads the status and then sets it, under the troubles' lock. A stop that
    /// comes between the two must not be overwritten: it waits for the settle to end.
    #[test]
    fn a_stop_is_not_overwritten_by_a_settle_that_read_the_status_before_it() {
        let health = Arc::new(RouterHealth::new());
        health.started();
        assert_eq!(health.cell.get(), Status::Running);
        let guard = health.troubles();
        // A settle's first half: it read Running.
        let read = health.cell.get();
        let stopper = {
            let health = health.clone();
            std::thread::spawn(move || health.set_own(Status::Stopping, "shutdown requested"))
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        // Its second half.
        health.cell.set(read, ROUTER_RUNNING_REASON);
        drop(guard);
        stopper.join().unwrap();
        assert_eq!(health.cell.get(), Status::Stopping);
    }

    /// A lane that worsens tells the router before its own status moves: while the
    /// router's update waits (here, for the troubles' lock the test holds), the lane
    /// still shows Running, so no reader sees a degraded or failed lane under a running
    /// router. A lane that recovers shows it first.
    #[test]
    fn a_lane_never_shows_worse_than_the_router_it_belongs_to() {
        type Worsen = fn(&RouterHealth, &LaneKey, &StatusCell);
        let worsenings: [(Worsen, Status); 3] = [
            (|h, k, c| h.lane_degraded(k, c, "failing"), Status::Degraded),
            (|h, k, c| h.lane_failed(k, c, "cannot read"), Status::Error),
            (|h, k, c| h.lane_panicked(k, c), Status::Error),
        ];
        for (worsen, to) in worsenings {
            let health = Arc::new(RouterHealth::new());
            health.started();
            let key = LaneKey { source: "s".into(), destination: DestinationKey::new("st", "t") };
            let lane = Arc::new(StatusCell::new("destinations", "s/st/t"));
            lane.set(Status::Running, "lane started");
            let guard = health.troubles();
            let (running, started) = std::sync::mpsc::channel();
            let worsening = {
                let (health, key, lane) = (health.clone(), key.clone(), lane.clone());
                std::thread::spawn(move || {
                    let _ = running.send(());
                    worsen(&health, &key, &lane)
                })
            };
            // The thread runs; given a moment, a lane that moved before its router would
            // show it (with the right order, the thread waits for the lock held here).
            started.recv().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert_eq!(lane.get(), Status::Running, "the lane moved to {to:?} before its router");
            drop(guard);
            worsening.join().unwrap();
            assert_eq!((lane.get(), health.cell.get()), (to, to));

            let guard = health.troubles();
            let recovering = {
                let (health, key, lane) = (health.clone(), key.clone(), lane.clone());
                std::thread::spawn(move || health.lane_recovered(&key, &lane, "delivered"))
            };
            if to == Status::Degraded {
                // The lane moves while the router's update waits for the lock held here.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
                while lane.get() != Status::Running {
                    assert!(std::time::Instant::now() < deadline, "a recovering lane shows it first");
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
            drop(guard);
            recovering.join().unwrap();
        }
    }

    /// A dead-letter lane that worsens while another lane sends it records: the other
    /// lane's word that it took them comes between the router's update and the lane's
    /// own status (the interleaving a race can give), and must not make it Running, or
    /// the router would say Running over a Degraded lane.
    #[test]
    fn a_dead_letter_lane_on_its_way_to_degraded_is_not_made_running_by_another_lane() {
        let health = RouterHealth::new();
        health.started();
        health.cell.set(Status::Running, ROUTER_RUNNING_REASON);
        let key = LaneKey { source: "s".into(), destination: DestinationKey::new("dlq", "rejected") };
        let lane = StatusCell::new("destinations", "s/dlq/rejected");
        assert_eq!(lane.get(), Status::Starting);
        // The first half of `lane_degraded`: the router is told.
        health.update(|t| t.degraded.insert(key.clone()));
        health.lane_took_records_while_starting(&key, &lane, "records dead-lettered by s -> a/b");
        assert_eq!(lane.get(), Status::Starting, "made Running on its way to Degraded");
        // Its second half.
        lane.set(Status::Degraded, "failing");
        assert_eq!((lane.get(), health.cell.get()), (Status::Degraded, Status::Degraded));

        // Not failing: made Running, and the router stays as it is.
        let other = LaneKey { source: "s".into(), destination: DestinationKey::new("dlq", "other") };
        let other_lane = StatusCell::new("destinations", "s/dlq/other");
        health.lane_took_records_while_starting(&other, &other_lane, "records dead-lettered by s -> a/b");
        assert_eq!(other_lane.get(), Status::Running);
        assert_eq!(health.cell.get(), Status::Degraded);
    }
}
