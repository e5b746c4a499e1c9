//! The idempotency index: which deliveries (by the sender's delivery id) were already
//! accepted, and at which offsets, within a retention window.
//!
//! Ordering, and why a crash cannot turn into a loss: the log is the source of truth.
//! A request is appended to the log **first**; only after the append resolved is its key
//! written to redb, in a cheap non-durable commit shared with the keys of concurrent
//! requests (a recorder thread group-commits them, lingering [`RECORD_LINGER_DEFAULT`]
//! for more). The request is answered without waiting for that commit: its claim holds
//! the acceptance until the key is recorded, and a retry meanwhile is answered from the
//! claim ([`IdempotencyIndex::claim_or_answered`]). Every record carries its delivery key
//! in its envelope, so the index can always be rebuilt from the log:
//!
//! - A periodic checkpoint waits until no keyed request is between "append resolved" and
//!   "key recorded" (a gate: keyed requests hold it shared, the checkpoint takes it
//!   exclusively for an instant), notes the log's next offset N, and commits durably
//!   `idempotency_indexed_through = N`. Every key of a record below N is then durable.
//! - On start, [`IdempotencyIndex::rebuild`] re-reads the log from
//!   `idempotency_indexed_through` to its end and re-inserts the keys found there.
//!
//! A crash between the append and the key record therefore loses nothing and does not
//! even open a duplicate window (the rebuild restores the key); the only duplicates
//! possible are deliveries retried after the retention window, as the wall clock
//! measures it (while that clock is stepped ahead, look-ups take the keys the step made
//! look old for expired; the daemon's checkpoints sweep on
//! [`crate::time::SweepClock`], which deletes none of them for it; docs/operations.md,
//! "The clock"). Two things keep it so:
//! - the log is not released at or above the durable checkpoint
//!   ([`IdempotencyIndex::durable_through`], which the router's cursor store answers as
//!   its release ceiling), so a record leaves the log only once its key is durable;
//! - a key whose record failed (the database refused it, the recorder thread is gone)
//!   holds the checkpoint below its record until a rebuild from the log restored it,
//!   which the next checkpoint runs (the last one, at a stop, leaves it to the next
//!   start's rebuild: a stop does not wait for a read of the log).
//!
//! The other way round, the log can end below keys the database kept: under
//! `wal.sync = "interval"` a key is recorded once its append is written, before the sync,
//! and any later durable commit of the database (a checkpoint, a cursor store) persists
//! it, so a power loss can take the record and keep the key; recovery can cut damage in
//! the last synced write; the log directory can be replaced. Such a key would answer a
//! retry with offsets the log does not hold (and will give to other events), and the
//! retried event would never be stored. So the rebuild forgets every key whose offsets
//! reach the log's next offset. It need not read every key on each start to find them:
//! the database keeps a bound, `idempotency_keys_below` (every recorded key's last offset
//! is below it), raised in the very transaction that records keys, so it is durable
//! whenever they are; the keys are scanned only when that bound is above the log's next
//! offset (or absent: a database from before the bound, scanned once).
//!
//! Invariants:
//! - A delivery id is scoped by the source and by the secret-path endpoint the request
//!   came through ([`IdempotencyKey`]): two endpoints of one source (two tenants) never
//!   share a key, nor does an endpoint with the source's named path. The rebuild computes
//!   the same key from the envelope's source, endpoint id and delivery id.
//! - A key is recorded only for a request whose append resolved `Ok`.
//! - Two concurrent requests with the same key never both append: the second finds the
//!   key claimed and is refused (409) until the first is answered; from then until the
//!   first's key is recorded (or owed), the claim holds the first's acceptance and the
//!   second is its replay. A claim is let go only after its key's record was committed or
//!   marked owed, under the claim's share of the gate: no checkpoint passes a record
//!   whose key is neither in the database nor owed.
//! - At most [`RECORDINGS_UNANSWERED_MAX`] acceptances are answered before their record;
//!   past it the answer waits for the record, so a stalled recorder holds a bounded
//!   number of claims and paces keyed requests instead of gathering them.
//! - Entries older than the retention window are ignored by lookups and swept by
//!   checkpoints; past `idempotency.max_keys` ([`MAX_KEYS_DEFAULT`]) checkpoints also
//!   forget the oldest before their window ends (a duplicate at worst, never a loss).
//! - After a rebuild, every key's offsets are below the log's next offset and outside
//!   every range the log reports missing (`wal::OpenReport::missing_ranges`: offsets a
//!   salvage skipped, in place or by copy): a key never answers a retry with offsets the
//!   log does not hold. The missing ranges are known only at the log's open, and the
//!   keys are scanned for them once per set of ranges (a fingerprint in the database). `idempotency_keys_below` is
//!   above every recorded key's last offset, in every committed state of the database.
//! - Keys recorded before keys were scoped by endpoint cannot be told apart: a request
//!   through an endpoint was recorded in its source's named-path scope. Once per
//!   database, before the first rebuild that scopes keys, all of them are forgotten
//!   ([`IdempotencyIndex::forget_unscoped_keys_once`]), so none can answer a named-path
//!   request with another delivery's offsets; a retry of such a delivery is appended
//!   again (a duplicate, never a loss).
//! - No transaction gathers more than a bound of keys in memory: sweeps and the bulk
//!   forgets at start (a log that lost its tail or was replaced, missing ranges, the
//!   once-only sort) each work in transactions of at most 10,000 keys, so a table of
//!   millions is never held at once.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use redb::{Durability, ReadableDatabase, ReadableTable};
use tokio::sync::{OwnedRwLockReadGuard, OwnedSemaphorePermit, RwLock, Semaphore, oneshot};
use wal::Wal;
use wal::inspect::Records;

use crate::envelope::Envelope;
use crate::state::{IDEMPOTENCY, IDEMPOTENCY_BY_TIME, META, StateDb, StateError, storage_err};

pub(crate) const META_INDEXED_THROUGH: &str = "idempotency_indexed_through";
/// Every recorded key's last offset is below this value: raised in the transaction that
/// records keys, so it is durable whenever they are. Absent in a database from before it.
pub(crate) const META_KEYS_BELOW: &str = "idempotency_keys_below";
/// A fingerprint of the log's missing offset ranges whose keys were last forgotten
/// ([`IdempotencyIndex::rebuild`]): a rebuild scans the keys again only when the log
/// reports other ranges.
pub(crate) const META_MISSING_RANGES_RECONCILED: &str = "idempotency_missing_ranges_reconciled";
/// How long after its retention window a key is swept. A request's lookup is made at
/// the time its head arrived, which its body (up to `http.body_read_timeout_ms`) and a
/// wait for room can put minutes behind the checkpoint that sweeps: a retry whose head
/// arrived within the window still finds its key. Lookups apply the exact window, so a
/// key kept longer changes no answer. A request that reaches its lookup later than this
/// after its head is refused (`IngestError::LookupTooLate`), and `http.body_read_timeout_ms`
/// is bounded well inside it.
pub const SWEEP_GRACE_MS: u64 = 5 * 60 * 1000;

/// Set once the keys recorded before keys were scoped by endpoint were sorted out
/// ([`IdempotencyIndex::forget_unscoped_keys_once`]).
pub(crate) const META_KEYS_SCOPED_BY_ENDPOINT: &str = "idempotency_keys_scoped_by_endpoint";

/// A delivery as the sender named it, scoped by source and by the endpoint it came
/// through (`None`: the source's named path).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    pub source_key: String,
    pub endpoint_id: Option<u128>,
    pub delivery_key: String,
}

impl IdempotencyKey {
    /// `source 0x00 delivery` for the named path (the form every key had before keys were
    /// scoped by endpoint, so a database's named-path keys keep working), and
    /// `source 0x00 delivery 0x00 endpoint_id` (16 bytes, big-endian) for an endpoint.
    /// Neither a source key nor a delivery id holds a 0x00 byte (source keys are
    /// `[a-zA-Z0-9._-]`, delivery ids visible ASCII), so the two forms never meet.
    fn table_key(&self) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.source_key.len() + self.delivery_key.len() + 18);
        k.extend_from_slice(self.source_key.as_bytes());
        k.push(0);
        k.extend_from_slice(self.delivery_key.as_bytes());
        if let Some(endpoint_id) = self.endpoint_id {
            k.push(0);
            k.extend_from_slice(&endpoint_id.to_be_bytes());
        }
        k
    }
}

/// What a previous acceptance of the same delivery produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PriorAcceptance {
    pub first_offset: u64,
    pub last_offset: u64,
    pub accepted_at_unix_ms: u64,
}

/// What a rebuild found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RebuildReport {
    pub from_offset: u64,
    pub records_scanned: u64,
    pub keys_restored: u64,
    pub undecodable_records: u64,
    /// Keys forgotten because their offsets were at or past the log's next offset (the
    /// log lost its tail, or was replaced, after they were recorded).
    pub keys_beyond_log_forgotten: u64,
    /// Keys forgotten because their offsets reach into a range the log reports missing
    /// (`wal::OpenReport::missing_ranges`: a salvage skipped it).
    pub keys_in_missing_ranges_forgotten: u64,
    /// Delivery ids not restored: the first record of their request names more records
    /// (`batch_len`) than the log holds from it on, which no append of the daemon writes.
    pub batches_past_log_end: u64,
}

/// When a rebuild runs: at start, before any append of this process was answered, or
/// while serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Start,
    Serving,
}

/// What a checkpoint is for: one of those made while serving, or the last, at a stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CheckpointAt {
    Serving,
    Stop,
}

/// The index. Share it behind an `Arc`.
pub struct IdempotencyIndex {
    state: Arc<StateDb>,
    retention_ms: u64,
    /// The durable checkpoint: every key of a record below it is durable in the state
    /// database. Set by [`IdempotencyIndex::rebuild`], raised by each checkpoint.
    durable_through: Arc<AtomicU64>,
    /// Why the last checkpoint failed, while no checkpoint has succeeded since: the
    /// durable checkpoint, and with it the log's release, stands still meanwhile.
    checkpoint_failure: Mutex<Option<CheckpointFailure>>,
    /// The records whose keys could not be recorded (or a reopen dropped) since the last
    /// restore read them: the checkpoint stays below them until a restore did. Shared
    /// with the recorder thread, which widens it before it lets a failed key's claim go.
    owed: Arc<Mutex<Option<OwedKeys>>>,
    /// The offset after the last record whose key a request recorded (or tried to):
    /// above the log's durable end only for appends answered before their sync (under
    /// `interval`), whose keys a reopen's restore cannot read back yet.
    recorded_below: AtomicU64,
    /// Set while a reopen of the state database may have happened without its dropped
    /// keys being owed yet: a recovery cancelled at its await (the daemon aborts its
    /// checkpoint task at shutdown) leaves it set, and the next recovery owes them.
    reopen_unsettled: AtomicBool,
    /// Set at a stop ([`IdempotencyIndex::stop_restores`]): a restore from the log while
    /// serving ends at its next record, committing nothing, so that the final checkpoint
    /// (which waits for the gate it holds) is not held behind a long read.
    restores_stopped: AtomicBool,
    gate: Arc<RwLock<()>>,
    /// The most keys the index keeps ([`IdempotencyIndex::with_max_keys`]).
    max_keys: u64,
    /// The claimed keys: `None` while the claim's request is being accepted, the
    /// acceptance once it was answered and its key is being recorded.
    in_flight: Arc<InFlight>,
    /// Room for acceptances answered before their key is recorded
    /// ([`RECORDINGS_UNANSWERED_MAX`]).
    answered_early: Arc<Semaphore>,
    /// The recorder's linger, in microseconds ([`RECORD_LINGER_DEFAULT`]).
    record_linger_us: Arc<AtomicU64>,
    recorder: Mutex<Option<std::sync::mpsc::Sender<RecordJob>>>,
    recorder_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// Run once by the next checkpoint between its restore and its reading of the log's
    /// end (a test makes the log's interval sync land there).
    #[cfg(test)]
    after_restore: Mutex<Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>>,
    /// Run once by the next recovery right after its reopen returned (a test cancels
    /// the recovery there).
    #[cfg(test)]
    after_reopen: Mutex<Option<std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>>>,
    /// Run once by the next restore while serving, on the thread that reads the log (a
    /// test checks that the async worker stays free meanwhile).
    #[cfg(test)]
    during_restore: Mutex<Option<Box<dyn FnOnce() + Send>>>,
}

/// The claimed keys (see `IdempotencyIndex::in_flight`).
type InFlight = Mutex<HashMap<Vec<u8>, Option<PriorAcceptance>>>;

/// One key to record: the claim it was accepted under (let go once the record is
/// committed, or failed and is owed), the acceptance, its room among the acceptances
/// answered before their record (`None`: its request waits for the record), and where
/// to say how it went.
struct RecordJob {
    /// Declared before the claim, so that a job dropped unfinished (never sent, or the
    /// recorder unwinding) owes its key before its claim, and with it its share of the
    /// gate, is let go.
    owed_unless_recorded: OwedUnlessRecorded,
    claim: Claim,
    prior: PriorAcceptance,
    _answered_early: Option<OwnedSemaphorePermit>,
    reply: oneshot::Sender<Result<(), StateError>>,
}

/// The offsets of records whose keys may be missing from the database, from the first to
/// the last (some between may be recorded): a restore that reads only part of them (the
/// rest not yet durable, under `interval`) owes the rest, not nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct OwedKeys {
    from: u64,
    /// One past the first offset of the last owed record.
    below: u64,
}

impl OwedKeys {
    /// `owed` widened by the records from `from` to before `below`.
    fn widen(owed: Option<OwedKeys>, from: u64, below: u64) -> OwedKeys {
        match owed {
            None => OwedKeys { from, below },
            Some(o) => OwedKeys { from: o.from.min(from), below: o.below.max(below) },
        }
    }

    /// What is still owed once a restore read every record before `read_below`.
    fn after_reading_below(self, read_below: u64) -> Option<OwedKeys> {
        (self.below > read_below).then(|| OwedKeys { from: self.from.max(read_below), below: self.below })
    }
}

/// Marks its record's key owed (`owed`) when dropped armed: a record that was not
/// committed, for whatever reason, holds the checkpoint below it until a restore from the
/// log read it. The recorder disarms it once the record is committed.
struct OwedUnlessRecorded {
    owed: Arc<Mutex<Option<OwedKeys>>>,
    first_offset: u64,
    armed: bool,
}

impl Drop for OwedUnlessRecorded {
    fn drop(&mut self) {
        if self.armed {
            let mut owed = self.owed.lock().unwrap_or_else(|p| p.into_inner());
            *owed = Some(OwedKeys::widen(*owed, self.first_offset, self.first_offset.saturating_add(1)));
        }
    }
}

/// The most keys one recorder transaction carries.
const RECORD_GROUP_MAX: usize = 4096;

/// How long the recorder waits for more keys after one whose request was answered
/// ([`IdempotencyIndex::with_record_linger`]): a redb commit costs the same for one key
/// or a hundred, and nobody waits for it. Measured in `docs/performance.md`
/// ("keyed requests answered before their record").
pub const RECORD_LINGER_DEFAULT: std::time::Duration = std::time::Duration::from_millis(4);

/// The most acceptances answered before their key is recorded, at once. Past it a
/// keyed request waits for its record before its answer, as every one did before:
/// a recorder stuck on its database holds at most this many claims of answered requests
/// (and their keys in memory), besides those of requests that wait for their record
/// (bounded by the submissions' room), and the requests behind them are paced by it. One recorder transaction's
/// worth, so a full group is never split by this bound.
pub const RECORDINGS_UNANSWERED_MAX: usize = RECORD_GROUP_MAX;

/// The recorder thread: group-commits key records, many requests per redb transaction
/// (redb serializes write transactions, so one per request would queue them), and
/// keeps the blocking redb writes off the async runtime's threads. It lets each job's
/// claim go only after its record was committed, or failed and was marked owed in
/// `owed` (under the claim's share of the gate, so no checkpoint runs in
/// between): a retry meanwhile is answered from the claim's acceptance, never by a
/// lookup that cannot find it yet.
fn run_recorder(state: Arc<StateDb>, linger_us: Arc<AtomicU64>, jobs: std::sync::mpsc::Receiver<RecordJob>) {
    while let Ok(first) = jobs.recv() {
        let linger = std::time::Duration::from_micros(linger_us.load(Ordering::Relaxed));
        if first._answered_early.is_some() && !linger.is_zero() {
            // Nobody waits for this record: let more gather for the same transaction.
            std::thread::sleep(linger);
        }
        let mut group = vec![first];
        while group.len() < RECORD_GROUP_MAX {
            match jobs.try_recv() {
                Ok(job) => group.push(job),
                Err(_) => break,
            }
        }
        fail_points::fail_point!("idempotency.record");
        let result = (|| {
            let db = state.db()?;
            let mut txn = db.begin_write().map_err(storage_err)?;
            txn.set_durability(Durability::None).map_err(|e| StateError::Storage(e.to_string()))?;
            let mut below = 0u64;
            {
                let mut tables = KeyTables::open(&txn)?;
                for job in &group {
                    tables.insert(&job.claim.key, job.prior)?;
                    below = below.max(job.prior.last_offset.saturating_add(1));
                }
            }
            raise_keys_below(&txn, below)?;
            txn.commit().map_err(storage_err)
        })();
        if let Err(e) = &result {
            report_record_failure(group.len(), e);
        }
        for RecordJob { mut owed_unless_recorded, claim, reply, .. } in group {
            // Owed first (a failed record), then the claim: whoever the reply wakes finds
            // the key recorded or owed, not held.
            owed_unless_recorded.armed = result.is_err();
            drop(owed_unless_recorded);
            drop(claim);
            let _ = reply.send(result.clone());
        }
    }
}

/// Counts and logs keys that could not be recorded. The events are durable; each key
/// is restored from the log by the next checkpoint (which does not pass its record
/// before) or a restart.
fn report_record_failure(keys: usize, e: &StateError) {
    metrics::counter!("iggy_ingest_idempotency_record_failures_total").increment(keys as u64);
    // Every keyed request fails so while the state database does: one line a second,
    // with the count left out.
    static LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::every(std::time::Duration::from_secs(1));
    if let Some(suppressed) = LOG.admit() {
        tracing::error!(keys, error = %e, suppressed, "recording delivery ids failed; a retry may duplicate until the state database recovers");
    }
}

/// Held while a keyed request is in progress; dropping it releases the key.
pub struct Claim {
    in_flight: Arc<InFlight>,
    key: Vec<u8>,
    _gate: OwnedRwLockReadGuard<()>,
    /// Run first when the claim is dropped (a test looks at what is owed then).
    #[cfg(test)]
    on_drop: Option<Box<dyn FnOnce() + Send>>,
}

/// What [`IdempotencyIndex::claim_or_answered`] found.
pub enum Claiming {
    /// The key is this request's now.
    Claimed(Claim),
    /// Another request holds it, its acceptance not yet answered.
    InFlight,
    /// Another request's acceptance was answered, and its key is being recorded: this
    /// request is its retry.
    Answered(PriorAcceptance),
}

/// A key's record under way ([`IdempotencyIndex::record`]): resolves once the record is
/// committed (non-durably) or failed. Dropping it changes nothing: the recorder commits
/// the record and lets the claim go either way.
pub struct Recording {
    done: Option<oneshot::Receiver<Result<(), StateError>>>,
    answered_early: bool,
}

impl Recording {
    /// Whether the request may be answered before the record is committed: it had room
    /// among [`RECORDINGS_UNANSWERED_MAX`]. Retries are answered from the claim meanwhile.
    pub fn may_answer_now(&self) -> bool {
        self.answered_early
    }
}

impl std::future::Future for Recording {
    type Output = Result<(), StateError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let Some(done) = self.done.as_mut() else {
            return std::task::Poll::Ready(Err(StateError::Storage("the idempotency recorder is not running".into())));
        };
        std::pin::Pin::new(done)
            .poll(cx)
            .map(|r| r.unwrap_or_else(|_| Err(StateError::Storage("the idempotency recorder stopped".into()))))
    }
}

impl IdempotencyIndex {
    /// True once the recorder thread has ended while the index still runs: it ends
    /// only by a panic (a defect), and from then on no key is recorded at runtime (each
    /// is owed until a checkpoint restores it from the log, and a retry before then is
    /// appended again), with nothing else to show it. The daemon watches this as it
    /// watches the log's writer, and stops.
    pub fn recorder_stopped(&self) -> bool {
        self.recorder_thread.lock().unwrap_or_else(|p| p.into_inner()).as_ref().is_some_and(|t| t.is_finished())
    }
}

impl Drop for IdempotencyIndex {
    /// Stops the recorder after the records it holds, so the state database is released
    /// when the index is.
    fn drop(&mut self) {
        self.recorder.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(handle) = self.recorder_thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = handle.join();
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        #[cfg(test)]
        if let Some(hook) = self.on_drop.take() {
            hook();
        }
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.key);
    }
}

impl IdempotencyIndex {
    pub fn new(state: Arc<StateDb>, retention_ms: u64) -> IdempotencyIndex {
        let (tx, rx) = std::sync::mpsc::channel();
        let recorder_state = state.clone();
        let owed = Arc::new(Mutex::new(None));
        let record_linger_us = Arc::new(AtomicU64::new(RECORD_LINGER_DEFAULT.as_micros() as u64));
        let recorder_linger_us = record_linger_us.clone();
        let (recorder, recorder_thread) = match std::thread::Builder::new()
            .name("idempotency-recorder".into())
            .spawn(move || run_recorder(recorder_state, recorder_linger_us, rx))
        {
            Ok(handle) => (Some(tx), Some(handle)),
            Err(e) => {
                // Keys are then not recorded at runtime (each failure is counted); they
                // are still rebuilt from the log on the next start.
                tracing::error!(error = %e, "cannot start the idempotency recorder thread");
                (None, None)
            }
        };
        IdempotencyIndex {
            state,
            retention_ms,
            durable_through: Arc::new(AtomicU64::new(0)),
            checkpoint_failure: Mutex::new(None),
            owed,
            recorded_below: AtomicU64::new(0),
            reopen_unsettled: AtomicBool::new(false),
            gate: Arc::new(RwLock::new(())),
            max_keys: MAX_KEYS_DEFAULT,
            in_flight: Arc::new(Mutex::new(HashMap::new())),
            answered_early: Arc::new(Semaphore::new(RECORDINGS_UNANSWERED_MAX)),
            record_linger_us,
            recorder: Mutex::new(recorder),
            recorder_thread: Mutex::new(recorder_thread),
            #[cfg(test)]
            after_restore: Mutex::new(None),
            #[cfg(test)]
            after_reopen: Mutex::new(None),
            #[cfg(test)]
            during_restore: Mutex::new(None),
            restores_stopped: AtomicBool::new(false),
        }
    }

    #[cfg(test)]
    pub(crate) fn state_for_tests(&self) -> &StateDb {
        &self.state
    }

    /// Sets how long the recorder waits for more keys after one whose request was
    /// answered before its record (zero: it commits what it has at once).
    pub fn with_record_linger(self, linger: std::time::Duration) -> IdempotencyIndex {
        self.record_linger_us.store(u64::try_from(linger.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
        self
    }

    pub fn retention_ms(&self) -> u64 {
        self.retention_ms
    }

    /// Keeps at most `max_keys` keys (at least 1): past it, each checkpoint forgets the
    /// oldest before their retention ends (see [`MAX_KEYS_DEFAULT`]).
    pub fn with_max_keys(mut self, max_keys: u64) -> IdempotencyIndex {
        self.max_keys = max_keys.max(1);
        self
    }

    /// The durable checkpoint, live: the log may be released below it (and not above,
    /// or a crash could take a record whose key only the log still held).
    pub fn durable_through(&self) -> Arc<AtomicU64> {
        self.durable_through.clone()
    }

    /// Claims `key` for one request. `None` when another request holds it.
    pub async fn claim(&self, key: &IdempotencyKey) -> Option<Claim> {
        match self.claim_or_answered(key).await {
            Claiming::Claimed(claim) => Some(claim),
            Claiming::InFlight | Claiming::Answered(_) => None,
        }
    }

    /// Claims `key` for one request, or says why not: another request is accepting it,
    /// or has been answered and its key is being recorded (this request is a retry of it).
    pub async fn claim_or_answered(&self, key: &IdempotencyKey) -> Claiming {
        let gate = self.gate.clone().read_owned().await;
        let mut claims = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        match claims.entry(key.table_key()) {
            Entry::Occupied(e) => e.get().map_or(Claiming::InFlight, Claiming::Answered),
            Entry::Vacant(e) => {
                let k = e.key().clone();
                e.insert(None);
                Claiming::Claimed(Claim {
                    in_flight: self.in_flight.clone(),
                    key: k,
                    _gate: gate,
                    #[cfg(test)]
                    on_drop: None,
                })
            }
        }
    }

    /// Holds the gate shared, as a claim does, until the guard is dropped: no checkpoint
    /// or recovery (which restores keys a reopen dropped) runs meanwhile, and one running
    /// now is waited for.
    pub async fn hold_shared(&self) -> OwnedRwLockReadGuard<()> {
        self.gate.clone().read_owned().await
    }

    /// The first offset from which a record's key may be missing from the database (it
    /// could not be recorded, or a reopen dropped it) until a checkpoint restores it from
    /// the log; `None` when no key is owed. A lookup that finds nothing while keys are
    /// owed does not show that the delivery is new.
    pub fn keys_owed_from(&self) -> Option<u64> {
        self.owed.lock().unwrap_or_else(|p| p.into_inner()).map(|o| o.from)
    }

    /// Whether a request holds `key` now (its acceptance is under way, or answered and
    /// its key being recorded).
    pub fn is_claimed(&self, key: &IdempotencyKey) -> bool {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&key.table_key())
    }

    /// The acceptance of `key` a request was answered with while its key is being
    /// recorded; `None` when no request holds `key` or its holder has not been answered.
    pub fn answered(&self, key: &IdempotencyKey) -> Option<PriorAcceptance> {
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).get(&key.table_key()).copied().flatten()
    }

    /// The earlier acceptance of `key`, if it is within the retention window at `now`.
    pub fn lookup(&self, key: &IdempotencyKey, now_unix_ms: u64) -> Result<Option<PriorAcceptance>, StateError> {
        let db = self.state.db()?;
        let txn = db.begin_read().map_err(storage_err)?;
        let table = txn.open_table(IDEMPOTENCY).map_err(storage_err)?;
        let Some(v) = table.get(key.table_key().as_slice()).map_err(storage_err)? else {
            return Ok(None);
        };
        let (first_offset, last_offset, accepted_at_unix_ms) = v.value();
        if accepted_at_unix_ms.saturating_add(self.retention_ms) < now_unix_ms {
            return Ok(None);
        }
        if last_offset < first_offset || last_offset == u64::MAX {
            // No acceptance is recorded so (a row from elsewhere, or damage redb's
            // checksums missed): it says nothing true of the delivery, so it is taken
            // for none, and the retry appended again (a duplicate at worst, never a 200
            // with made-up offsets).
            tracing::warn!(first_offset, last_offset, "a recorded delivery id names no range of offsets; ignored");
            return Ok(None);
        }
        Ok(Some(PriorAcceptance { first_offset, last_offset, accepted_at_unix_ms }))
    }

    /// Records the acceptance `prior` of the claimed key (non-durably: see the module doc
    /// for why that is safe), handing the claim to the recorder, which lets it go once
    /// the record is committed or failed (a failure is counted, logged, and owed to the
    /// next checkpoint's restore from the log). From now until then, a retry of the
    /// delivery finds the acceptance in the claim and is answered as its replay
    /// ([`IdempotencyIndex::claim_or_answered`]), so the request need not wait for the
    /// record before its 200 when [`Recording::may_answer_now`] says so.
    pub fn record(&self, claim: Claim, prior: PriorAcceptance) -> Recording {
        self.recorded_below.fetch_max(prior.last_offset.saturating_add(1), Ordering::AcqRel);
        self.in_flight.lock().unwrap_or_else(|p| p.into_inner()).insert(claim.key.clone(), Some(prior));
        let answered_early = self.answered_early.clone().try_acquire_owned().ok();
        let may_answer_now = answered_early.is_some();
        let (reply, done) = oneshot::channel();
        let owed_unless_recorded =
            OwedUnlessRecorded { owed: self.owed.clone(), first_offset: prior.first_offset, armed: true };
        let job = RecordJob { owed_unless_recorded, claim, prior, _answered_early: answered_early, reply };
        let unsent = {
            let recorder = self.recorder.lock().unwrap_or_else(|p| p.into_inner());
            match recorder.as_ref() {
                Some(tx) => tx.send(job).err().map(|e| e.0),
                None => Some(job),
            }
        };
        if let Some(job) = unsent {
            // Dropping the job owes the key, then lets the claim go.
            drop(job);
            let e = StateError::Storage("the idempotency recorder is not running".into());
            report_record_failure(1, &e);
            return Recording { done: None, answered_early: false };
        }
        Recording { done: Some(done), answered_early: may_answer_now }
    }

    /// Makes every key of records below the log's current end durable, and sweeps keys
    /// older than the retention window. Returns the offset now covered: never past a
    /// record whose key is still owed (it could not be recorded, and the restore did not
    /// reach it because it was not yet durable), even when the log's end moved past it
    /// after the restore read it.
    ///
    /// First, if the state database latched an I/O error (a full disk), reopens it and
    /// restores from the log the keys its repair dropped, with keyed requests held at the
    /// gate, so the index recovers without a restart once the disk has room again.
    ///
    /// A failure is kept ([`IdempotencyIndex::checkpoint_failure`]) until a checkpoint
    /// succeeds.
    pub async fn checkpoint(&self, wal: &Wal, now_unix_ms: u64) -> Result<u64, StateError> {
        self.checkpoint_as(wal, now_unix_ms, CheckpointAt::Serving).await
    }

    /// Ends any restore from the log running while serving (a checkpoint's, a recovery's)
    /// at its next record, committing nothing: the keys it was restoring stay owed, the
    /// final checkpoint stops below them, and the next start restores them. Call at a
    /// stop, before the final checkpoint.
    pub fn stop_restores(&self) {
        self.restores_stopped.store(true, Ordering::Release);
    }

    /// [`IdempotencyIndex::checkpoint`] at shutdown: the same durable checkpoint, without
    /// the work a stop should not wait for, which the next start does: it does not go on
    /// sweeping a backlog of expired keys, and it does not restore owed keys from the log
    /// (a read of every record since the durable checkpoint, as long as the log, which
    /// runs on its thread to the end: no timeout could cut it short). It stops below the
    /// first owed key instead, and the next start's rebuild restores them.
    pub async fn final_checkpoint(&self, wal: &Wal, now_unix_ms: u64) -> Result<u64, StateError> {
        self.checkpoint_as(wal, now_unix_ms, CheckpointAt::Stop).await
    }

    async fn checkpoint_as(&self, wal: &Wal, now_unix_ms: u64, at: CheckpointAt) -> Result<u64, StateError> {
        let result = self.checkpoint_once(wal, now_unix_ms, at).await;
        let mut failure = self.checkpoint_failure.lock().unwrap_or_else(|p| p.into_inner());
        *failure = match &result {
            Ok(_) => None,
            Err(e) => Some(CheckpointFailure {
                in_a_row: failure.as_ref().map_or(1, |f| f.in_a_row.saturating_add(1)),
                error: e.to_string(),
            }),
        };
        result
    }

    /// The checkpoints that failed in a row since the last that succeeded, and the last
    /// one's error; `None` if the last succeeded. The durable checkpoint
    /// ([`IdempotencyIndex::durable_through`]) does not move meanwhile, so the log is not
    /// released past it: an operator must hear of it before the log fills.
    pub fn checkpoint_failure(&self) -> Option<CheckpointFailure> {
        self.checkpoint_failure.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    async fn checkpoint_once(&self, wal: &Wal, now_unix_ms: u64, at: CheckpointAt) -> Result<u64, StateError> {
        let through = {
            let _exclusive = self.gate.write().await;
            self.recover_locked(wal, now_unix_ms, at).await?;
            let owed = *self.owed.lock().unwrap_or_else(|p| p.into_inner());
            if owed.is_some() && at == CheckpointAt::Serving {
                // Keys the recorder did not take: restore them from the log (durably),
                // as a restart would, before the checkpoint may pass their records.
                let report = self.restore_from_log(wal, now_unix_ms)?;
                if report.keys_restored > 0 {
                    tracing::warn!(?report, "delivery ids that could not be recorded were restored from the log");
                }
            }
            #[cfg(test)]
            {
                let hook = self.after_restore.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(hook) = hook {
                    hook.await;
                }
            }
            let owed_from = self.keys_owed_from();
            owed_from.map_or(wal.next_offset(), |owed| owed.min(wal.next_offset()))
        };
        let state = self.state.clone();
        let cutoff = now_unix_ms.saturating_sub(self.retention_ms).saturating_sub(SWEEP_GRACE_MS);
        let bounds = SweepBounds { cutoff_unix_ms: cutoff, max_keys: self.max_keys };
        let durable_through = self.durable_through.clone();
        tokio::task::spawn_blocking(move || {
            let swept = commit_checkpoint(&state, through, bounds)?;
            // Durable now, whatever the sweep that follows does.
            durable_through.fetch_max(through, Ordering::AcqRel);
            if at == CheckpointAt::Serving
                && let Err(e) = sweep_the_rest(&state, bounds, swept)
            {
                // Housekeeping: the expired keys stay (lookups ignore them) and the next
                // checkpoint sweeps them; the checkpoint itself is made.
                tracing::warn!(error = %e, "sweeping expired delivery ids failed; the next checkpoint tries again");
            }
            Ok::<(), StateError>(())
        })
        .await
        .map_err(|e| StateError::Storage(format!("checkpoint task failed: {e}")))??;
        Ok(through)
    }

    /// If the state database latched an I/O error, reopens it and restores from the log
    /// the keys its repair dropped, with keyed requests held at the gate. Returns whether
    /// it reopened. Called by every checkpoint, and by the ingestor as soon as a lookup
    /// fails, so a full disk that got space back does not wait for the next checkpoint.
    pub async fn recover(&self, wal: &Wal, now_unix_ms: u64) -> Result<bool, StateError> {
        let _exclusive = self.gate.write().await;
        self.recover_locked(wal, now_unix_ms, CheckpointAt::Serving).await
    }

    /// [`IdempotencyIndex::recover`] for a caller holding the gate exclusively. At a stop
    /// the keys a reopen dropped are owed and left to the next start's rebuild.
    async fn recover_locked(&self, wal: &Wal, now_unix_ms: u64, at: CheckpointAt) -> Result<bool, StateError> {
        if self.reopen_unsettled.swap(true, Ordering::AcqRel) {
            // An earlier recovery stopped at its await below: its reopen may have run to
            // the end on its blocking thread, its dropped keys owed by no one.
            self.owe_from(self.durable_through.load(Ordering::Acquire));
        }
        let state = self.state.clone();
        let reopened = tokio::task::spawn_blocking(move || state.reopen_if_failed())
            .await
            .map_err(|e| StateError::Storage(format!("reopen task failed: {e}")))??;
        #[cfg(test)]
        {
            let hook = self.after_reopen.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(hook) = hook {
                hook.await;
            }
        }
        if reopened {
            // The repair kept the last durable commit: keys recorded since (not durably)
            // are gone from the database, and owed until a restore reads their records:
            // owed from the checkpoint to the last key recorded, in case the restore
            // fails; the restore keeps owing what it could not read yet (answered under
            // `interval`, not yet synced), and under `always` it reads every answered
            // record and nothing is owed after it.
            self.owe_from(self.durable_through.load(Ordering::Acquire));
            self.reopen_unsettled.store(false, Ordering::Release);
            if at == CheckpointAt::Stop {
                return Ok(true);
            }
            let report = self.restore_from_log(wal, now_unix_ms)?;
            tracing::warn!(?report, "idempotency keys restored from the log after the state database was reopened");
        } else {
            self.reopen_unsettled.store(false, Ordering::Release);
        }
        Ok(reopened)
    }

    /// Marks the keys of records from `offset` on owed (see `owed`), up to the last key
    /// recorded (or tried): a reopen may have dropped any of them.
    /// None is owed when no key was recorded from there on: a reopen dropped none, and
    /// owing one would refuse every retry (503) until an append and a restore.
    fn owe_from(&self, offset: u64) {
        let below = self.recorded_below.load(Ordering::Acquire);
        if below <= offset {
            return;
        }
        let mut owed = self.owed.lock().unwrap_or_else(|p| p.into_inner());
        *owed = Some(OwedKeys::widen(*owed, offset, below));
    }

    /// Once per database (a durable marker says it was done): forgets every key recorded
    /// before keys were scoped by endpoint, of every source. Such a key may have been
    /// recorded by a request through an endpoint, yet it sits in the named path's scope,
    /// where it could answer a named-path request carrying the same delivery id with
    /// another delivery's offsets (a 200 for an event never stored); forgetting it can at
    /// worst let a retry be appended again. Which sources had endpoints cannot be told:
    /// a static endpoint removed from the configuration leaves no trace in the database.
    /// Call before [`IdempotencyIndex::rebuild`], which restores the keys of the records
    /// it re-reads in their scoped form. Returns how many keys were forgotten.
    pub fn forget_unscoped_keys_once(&self) -> Result<u64, StateError> {
        {
            let db = self.state.db()?;
            let txn = db.begin_read().map_err(storage_err)?;
            let meta = txn.open_table(META).map_err(storage_err)?;
            if meta.get(META_KEYS_SCOPED_BY_ENDPOINT).map_err(storage_err)?.is_some() {
                return Ok(0);
            }
        }
        // A named-path key holds one 0x00, an endpoint's two (see
        // `IdempotencyKey::table_key`). A crash part way leaves the marker unset, and the
        // next start forgets the rest.
        let forgotten = forget_keys_in_chunks(&self.state, |key, _, _| key.iter().filter(|&&b| b == 0).count() == 1)?;
        let db = self.state.db()?;
        let mut txn = db.begin_write().map_err(storage_err)?;
        txn.set_durability(Durability::Immediate).map_err(|e| StateError::Storage(e.to_string()))?;
        txn.open_table(META).map_err(storage_err)?.insert(META_KEYS_SCOPED_BY_ENDPOINT, 1).map_err(storage_err)?;
        txn.commit().map_err(storage_err)?;
        Ok(forgotten.keys)
    }

    /// Forgets the keys the log does not hold (offsets at or past its next offset, or in
    /// a range it reports missing), then restores the keys of records the last checkpoint
    /// did not cover. Call once after opening the log, before serving.
    pub fn rebuild(&self, wal: &Wal, now_unix_ms: u64) -> Result<RebuildReport, StateError> {
        self.rebuild_from_log(wal, now_unix_ms, Phase::Start)
    }

    /// Restores from the log the keys of records the last checkpoint did not cover, while
    /// serving (keyed requests held at the gate). Forgets nothing: under `wal.sync =
    /// "interval"` the log's durable end is below appends already answered, whose keys
    /// are recorded and must keep answering their retries.
    ///
    /// It reads every record from the durable checkpoint on, which after a long failure of
    /// the state database is a long read: on a multi-threaded runtime it runs with the
    /// worker handed over ([`tokio::task::block_in_place`]), so the door's other requests
    /// (and `/health`) keep being served by the runtime while keyed ones wait at the gate.
    fn restore_from_log(&self, wal: &Wal, now_unix_ms: u64) -> Result<RebuildReport, StateError> {
        let restore = || {
            #[cfg(test)]
            {
                let hook = self.during_restore.lock().unwrap_or_else(|p| p.into_inner()).take();
                if let Some(hook) = hook {
                    hook();
                }
            }
            self.rebuild_from_log(wal, now_unix_ms, Phase::Serving)
        };
        let multi_threaded = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi_threaded { tokio::task::block_in_place(restore) } else { restore() }
    }

    fn rebuild_from_log(&self, wal: &Wal, now_unix_ms: u64, phase: Phase) -> Result<RebuildReport, StateError> {
        let (indexed_through, keys_below, missing_reconciled) = {
            let db = self.state.db()?;
            let txn = db.begin_read().map_err(storage_err)?;
            let meta = txn.open_table(META).map_err(storage_err)?;
            let get = |name| meta.get(name).map_err(storage_err).map(|v| v.map(|v| v.value()));
            (get(META_INDEXED_THROUGH)?.unwrap_or(0), get(META_KEYS_BELOW)?, get(META_MISSING_RANGES_RECONCILED)?)
        };
        let stats = wal.stats();
        let from = if indexed_through > stats.next_offset {
            tracing::warn!(
                indexed_through,
                log_next_offset = stats.next_offset,
                "idempotency index is ahead of the log (was the log directory replaced?); rescanning the whole log"
            );
            stats.start_offset
        } else {
            indexed_through.max(stats.start_offset)
        };
        let mut report = RebuildReport { from_offset: from, ..RebuildReport::default() };
        // Keys are forgotten in transactions of their own, before the one that restores
        // keys and writes the bounds (and so makes them durable); a crash between them
        // leaves fewer keys, never a key the log does not hold, and the next start
        // forgets the rest.
        if phase == Phase::Start && keys_below.is_none_or(|below| below > stats.next_offset) {
            report.keys_beyond_log_forgotten =
                forget_keys_in_chunks(&self.state, |_, _, last| last >= stats.next_offset)?.keys;
            if report.keys_beyond_log_forgotten > 0 {
                tracing::warn!(
                    forgotten = report.keys_beyond_log_forgotten,
                    keys_below = ?keys_below,
                    log_next_offset = stats.next_offset,
                    "delivery ids recorded at offsets the log does not hold (it lost its tail, or was replaced) were forgotten; a retry of one of those deliveries is appended again"
                );
            }
        }
        // A salvage skips what it cannot read and the log goes on above it: a key of a
        // skipped record would answer its retry "replayed" while the log holds no such
        // record. Below the log's end, only the ranges the log reports missing tell.
        let missing = &wal.open_report().missing_ranges;
        let fingerprint = missing_ranges_fingerprint(missing);
        let reconcile = phase == Phase::Start && !missing.is_empty() && missing_reconciled != Some(fingerprint);
        if reconcile {
            report.keys_in_missing_ranges_forgotten = forget_keys_in_chunks(&self.state, |_, first, last| {
                missing.iter().any(|r| first < r.end && last >= r.start)
            })?
            .keys;
            if report.keys_in_missing_ranges_forgotten > 0 {
                tracing::warn!(
                    forgotten = report.keys_in_missing_ranges_forgotten,
                    missing_ranges = ?missing,
                    "delivery ids recorded at offsets a salvage skipped were forgotten; a retry of one of those deliveries is appended again"
                );
            }
        }
        let db = self.state.db()?;
        let mut txn = db.begin_write().map_err(storage_err)?;
        txn.set_durability(Durability::Immediate).map_err(|e| StateError::Storage(e.to_string()))?;
        if reconcile {
            // In the durable transaction, after every key in the ranges was forgotten.
            txn.open_table(META)
                .map_err(storage_err)?
                .insert(META_MISSING_RANGES_RECONCILED, fingerprint)
                .map_err(storage_err)?;
        }
        let records = Records::new(wal, from).map_err(|e| StateError::Storage(format!("reading the log: {e}")))?;
        let mut next = from;
        let mut tables = KeyTables::open(&txn)?;
        for record in records {
            let record = record.map_err(|e| StateError::Storage(format!("reading the log: {e}")))?;
            report.records_scanned += 1;
            if phase == Phase::Serving && self.restores_stopped.load(Ordering::Acquire) {
                return Err(StateError::Storage(
                    "the restore of delivery ids from the log was stopped (the daemon stops); the next start restores them"
                        .into(),
                ));
            }
            next = record.offset + 1;
            let envelope = match Envelope::decode(&record.payload) {
                Ok(e) => e,
                Err(_) => {
                    report.undecodable_records += 1;
                    continue;
                }
            };
            let h = envelope.header;
            let Some(delivery_key) = h.idempotency_key else { continue };
            if h.batch_index != 0 || h.received_at_unix_ms.saturating_add(self.retention_ms) < now_unix_ms {
                continue;
            }
            // A batch is appended whole, so a first record the log holds has the rest of
            // its batch after it. One naming more records than the log holds after it
            // (a log written by something else, or damaged under checksums that still
            // check) would answer a retry with offsets the log does not hold: not
            // restored, its retry appended again.
            let last_offset =
                record.offset.checked_add(u64::from(h.batch_len.max(1)) - 1).filter(|last| *last < wal.next_offset());
            let Some(last_offset) = last_offset else {
                report.batches_past_log_end += 1;
                continue;
            };
            let key = IdempotencyKey { source_key: h.source_key, endpoint_id: h.endpoint_id, delivery_key }.table_key();
            let prior = PriorAcceptance {
                first_offset: record.offset,
                last_offset,
                accepted_at_unix_ms: h.received_at_unix_ms,
            };
            tables.insert(&key, prior)?;
            report.keys_restored += 1;
        }
        drop(tables);
        if report.batches_past_log_end > 0 {
            tracing::warn!(
                batches = report.batches_past_log_end,
                log_next_offset = wal.next_offset(),
                "records name a request of more events than the log holds after them (not written by this daemon, or damaged); their delivery ids were not restored, and a retry of one is appended again"
            );
        }
        {
            let mut meta = txn.open_table(META).map_err(storage_err)?;
            meta.insert(META_INDEXED_THROUGH, next.max(from)).map_err(storage_err)?;
            // At start every key left is below the log's end: the forgotten ones were at
            // or past it, the restored ones are records of the log. While serving, keys
            // of answered appends above the durable end stay, and so does the bound.
            let below = next.max(stats.next_offset);
            let below = match phase {
                Phase::Start => below,
                Phase::Serving => keys_below.map_or(below, |b| b.max(below)),
            };
            meta.insert(META_KEYS_BELOW, below).map_err(storage_err)?;
        }
        txn.commit().map_err(storage_err)?;
        self.durable_through.store(next.max(from), Ordering::Release);
        // Every key of the log from `from` to `next` is in the database now, those whose
        // record failed included; those of records not yet durable (under `interval`)
        // are still owed, and hold the next checkpoint's restore.
        let mut owed = self.owed.lock().unwrap_or_else(|p| p.into_inner());
        *owed = owed.and_then(|o| o.after_reading_below(next.max(from)));
        Ok(report)
    }
}

/// The two tables a recorded key lives in, opened once for all the keys a transaction
/// records: opening a table checks its stored definition (type names formatted and
/// compared), which cost about a sixth of a key's record when it was done per key.
struct KeyTables<'txn> {
    keys: redb::Table<'txn, &'static [u8], (u64, u64, u64)>,
    by_time: redb::Table<'txn, (u64, &'static [u8]), ()>,
}

impl<'txn> KeyTables<'txn> {
    fn open(txn: &'txn redb::WriteTransaction) -> Result<KeyTables<'txn>, StateError> {
        Ok(KeyTables {
            keys: txn.open_table(IDEMPOTENCY).map_err(storage_err)?,
            by_time: txn.open_table(IDEMPOTENCY_BY_TIME).map_err(storage_err)?,
        })
    }

    /// Records `key`'s acceptance, replacing (in both tables) an earlier one of it.
    fn insert(&mut self, key: &[u8], prior: PriorAcceptance) -> Result<(), StateError> {
        let old = self
            .keys
            .insert(key, (prior.first_offset, prior.last_offset, prior.accepted_at_unix_ms))
            .map_err(storage_err)?
            .map(|v| v.value().2);
        if let Some(old_at) = old {
            self.by_time.remove((old_at, key)).map_err(storage_err)?;
        }
        self.by_time.insert((prior.accepted_at_unix_ms, key), ()).map_err(storage_err)?;
        Ok(())
    }
}

/// Records one key in its own opening of the tables, for tests.
#[cfg(test)]
fn insert(txn: &redb::WriteTransaction, key: &[u8], prior: PriorAcceptance) -> Result<(), StateError> {
    KeyTables::open(txn)?.insert(key, prior)
}

/// Raises `idempotency_keys_below` to `below` (never lowers it).
fn raise_keys_below(txn: &redb::WriteTransaction, below: u64) -> Result<(), StateError> {
    let mut meta = txn.open_table(META).map_err(storage_err)?;
    let current = meta.get(META_KEYS_BELOW).map_err(storage_err)?.map(|v| v.value());
    if current.is_none_or(|c| c < below) {
        meta.insert(META_KEYS_BELOW, below).map_err(storage_err)?;
    }
    Ok(())
}

/// The most keys one transaction of a bulk forget removes ([`forget_keys_in_chunks`]):
/// as for a sweep ([`SWEEP_MAX_KEYS_PER_TRANSACTION`]), the keys of a transaction are
/// gathered in memory first, and a table of millions (a log directory replaced, every key
/// to forget) must not be gathered at once.
pub(crate) const FORGET_MAX_KEYS_PER_TRANSACTION: usize = 10_000;

/// What a bulk forget did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Forgotten {
    pub keys: u64,
    pub transactions: u64,
}

/// Removes every key for which `forget(table key, first offset, last offset)` holds, in
/// transactions of at most [`FORGET_MAX_KEYS_PER_TRANSACTION`] keys, each taking up the
/// scan after the last key the one before gathered. Not durable: the caller's next
/// durable commit makes them so, and a forget a crash undid is done again by whoever
/// asked for it (it is idempotent).
fn forget_keys_in_chunks(state: &StateDb, forget: impl Fn(&[u8], u64, u64) -> bool) -> Result<Forgotten, StateError> {
    let mut done = Forgotten::default();
    let mut after: Option<Vec<u8>> = None;
    loop {
        let db = state.db()?;
        let mut txn = db.begin_write().map_err(storage_err)?;
        txn.set_durability(Durability::None).map_err(|e| StateError::Storage(e.to_string()))?;
        let full = {
            let mut table = txn.open_table(IDEMPOTENCY).map_err(storage_err)?;
            let mut by_time = txn.open_table(IDEMPOTENCY_BY_TIME).map_err(storage_err)?;
            let mut matched: Vec<(Vec<u8>, u64)> = Vec::new();
            {
                let range = match after.as_deref() {
                    None => table.range::<&[u8]>(..),
                    Some(a) => table.range::<&[u8]>((std::ops::Bound::Excluded(a), std::ops::Bound::Unbounded)),
                };
                for entry in range.map_err(storage_err)? {
                    let (k, v) = entry.map_err(storage_err)?;
                    let (first_offset, last_offset, accepted_at) = v.value();
                    if forget(k.value(), first_offset, last_offset) {
                        matched.push((k.value().to_vec(), accepted_at));
                        if matched.len() == FORGET_MAX_KEYS_PER_TRANSACTION {
                            break;
                        }
                    }
                }
            }
            for (key, accepted_at) in &matched {
                table.remove(key.as_slice()).map_err(storage_err)?;
                by_time.remove((*accepted_at, key.as_slice())).map_err(storage_err)?;
            }
            done.keys += matched.len() as u64;
            let full = matched.len() == FORGET_MAX_KEYS_PER_TRANSACTION;
            after = matched.pop().map(|(key, _)| key);
            full
        };
        txn.commit().map_err(storage_err)?;
        done.transactions += 1;
        if !full {
            return Ok(done);
        }
    }
}

/// The first 8 bytes of a SHA-256 over the ranges: stable across builds and platforms.
fn missing_ranges_fingerprint(ranges: &[std::ops::Range<u64>]) -> u64 {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    for r in ranges {
        hash.update(r.start.to_le_bytes());
        hash.update(r.end.to_le_bytes());
    }
    let digest = hash.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_le_bytes(first)
}

/// Checkpoints failing in a row ([`IdempotencyIndex::checkpoint_failure`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointFailure {
    pub in_a_row: u32,
    pub error: String,
}

/// The most expired keys one write transaction sweeps. A transaction holds redb's
/// writer, which the recorder of every keyed request waits for, and its expired keys are
/// gathered in memory first: after a downtime longer than the retention window (or a
/// shorter window configured) millions of keys expire at once, and sweeping them in one
/// transaction would hold every keyed request for minutes and gigabytes. A checkpoint
/// sweeps in transactions of at most this many, letting the recorder in between, for at
/// most [`SWEEP_TIME_BUDGET`]; the next checkpoints take the rest, and lookups ignore
/// expired keys meanwhile.
pub(crate) const SWEEP_MAX_KEYS_PER_TRANSACTION: usize = 10_000;

/// How long one checkpoint goes on sweeping a backlog of expired keys: half the default
/// checkpoint interval. At tens of thousands of keys per transaction-second this keeps
/// up with any rate of keyed requests the daemon takes (about 30,000 a second measured,
/// performance.md), and clears a backlog of millions within minutes.
pub(crate) const SWEEP_TIME_BUDGET: std::time::Duration = std::time::Duration::from_millis(500);

/// The pause between two sweeping transactions, in which the recorder takes the writer.
const SWEEP_PAUSE: std::time::Duration = std::time::Duration::from_millis(2);

/// The default of `idempotency.max_keys`: ten million keys, a few gigabytes of state
/// database at most (delivery ids of 36 bytes take 180 to 360 bytes a key, both tables
/// counted, by the order they come in; docs/http.md), a day of 115 keyed requests a second. The keys are bounded by
/// the request rate times the retention window, which nothing else bounds: past this
/// many, each checkpoint forgets the oldest keys before their retention ends (a retry of
/// such a delivery is appended again: a duplicate, never a loss), counted in
/// `iggy_ingest_idempotency_keys_evicted_total`.
pub const MAX_KEYS_DEFAULT: u64 = 10_000_000;

/// What a sweep removes: keys accepted before `cutoff_unix_ms`, then the oldest while
/// more than `max_keys` are kept.
#[derive(Debug, Clone, Copy)]
struct SweepBounds {
    cutoff_unix_ms: u64,
    max_keys: u64,
}

/// What one sweeping transaction removed, and the keys it left.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Swept {
    expired: usize,
    evicted: usize,
    keys_left: u64,
}

impl Swept {
    /// Whether the transaction took all it may ([`SWEEP_MAX_KEYS_PER_TRANSACTION`]): more
    /// may be left to sweep.
    fn was_full(&self) -> bool {
        self.expired + self.evicted == SWEEP_MAX_KEYS_PER_TRANSACTION
    }

    /// Counts what was evicted and how many keys are left, once its transaction committed.
    fn tell(&self, max_keys: u64) {
        metrics::gauge!("iggy_ingest_idempotency_keys").set(self.keys_left as f64);
        if self.evicted == 0 {
            return;
        }
        metrics::counter!("iggy_ingest_idempotency_keys_evicted_total").increment(self.evicted as u64);
        static LOG: crate::log_limit::LogLimit = crate::log_limit::LogLimit::every(std::time::Duration::from_secs(60));
        if let Some(suppressed) = LOG.admit() {
            tracing::warn!(
                evicted = self.evicted,
                max_keys,
                suppressed,
                "the delivery-id index is at idempotency.max_keys: the oldest ids are forgotten before their retention ends (a retry of one is appended again); raise it, or shorten idempotency.retention_secs"
            );
        }
    }
}

/// After a checkpoint that swept `swept` keys: while its transaction was full, sweeps on,
/// a transaction of at most [`SWEEP_MAX_KEYS_PER_TRANSACTION`] keys at a time (not
/// durable: a sweep a crash undoes is done again), within [`SWEEP_TIME_BUDGET`].
fn sweep_the_rest(state: &StateDb, bounds: SweepBounds, mut swept: Swept) -> Result<(), StateError> {
    let started = std::time::Instant::now();
    while swept.was_full() && started.elapsed() < SWEEP_TIME_BUDGET {
        // redb's writer is not handed over fairly: without a pause the recorder of the
        // keyed requests, woken by the last commit, would lose the writer to this loop
        // again and wait for the whole budget.
        std::thread::sleep(SWEEP_PAUSE);
        let db = state.db()?;
        let mut txn = db.begin_write().map_err(storage_err)?;
        txn.set_durability(Durability::None).map_err(|e| StateError::Storage(e.to_string()))?;
        swept = sweep_expired(&txn, bounds)?;
        txn.commit().map_err(storage_err)?;
        swept.tell(bounds.max_keys);
    }
    Ok(())
}

/// Removes expired keys, oldest first, then (in what is left of the transaction's share)
/// the oldest keys past `max_keys`: at most [`SWEEP_MAX_KEYS_PER_TRANSACTION`] in all.
fn sweep_expired(txn: &redb::WriteTransaction, bounds: SweepBounds) -> Result<Swept, StateError> {
    use redb::ReadableTableMetadata;
    let mut table = txn.open_table(IDEMPOTENCY).map_err(storage_err)?;
    let mut by_time = txn.open_table(IDEMPOTENCY_BY_TIME).map_err(storage_err)?;
    let mut gone: Vec<(u64, Vec<u8>)> = Vec::new();
    let range = by_time.range::<(u64, &[u8])>(..(bounds.cutoff_unix_ms, &[][..])).map_err(storage_err)?;
    for entry in range.take(SWEEP_MAX_KEYS_PER_TRANSACTION) {
        let (k, _) = entry.map_err(storage_err)?;
        let (at, key) = k.value();
        gone.push((at, key.to_vec()));
    }
    let expired = gone.len();
    let over = table.len().map_err(storage_err)?.saturating_sub(expired as u64).saturating_sub(bounds.max_keys);
    let evict = usize::try_from(over).unwrap_or(usize::MAX).min(SWEEP_MAX_KEYS_PER_TRANSACTION - expired);
    if evict > 0 {
        // The oldest left once the expired ones go: those come first in the same order.
        let range = by_time.range::<(u64, &[u8])>(..).map_err(storage_err)?;
        for entry in range.skip(expired).take(evict) {
            let (k, _) = entry.map_err(storage_err)?;
            let (at, key) = k.value();
            gone.push((at, key.to_vec()));
        }
    }
    for (at, key) in &gone {
        by_time.remove((*at, key.as_slice())).map_err(storage_err)?;
        table.remove(key.as_slice()).map_err(storage_err)?;
    }
    let keys_left = table.len().map_err(storage_err)?;
    Ok(Swept { expired, evicted: gone.len() - expired, keys_left })
}

/// Commits the checkpoint `through` durably, with a first sweep of expired keys; returns
/// how many it swept.
fn commit_checkpoint(state: &StateDb, through: u64, bounds: SweepBounds) -> Result<Swept, StateError> {
    let db = state.db()?;
    let txn = db.begin_write().map_err(storage_err)?;
    let swept = sweep_expired(&txn, bounds)?;
    {
        let mut meta = txn.open_table(META).map_err(storage_err)?;
        let current = meta.get(META_INDEXED_THROUGH).map_err(storage_err)?.map(|v| v.value()).unwrap_or(0);
        meta.insert(META_INDEXED_THROUGH, current.max(through)).map_err(storage_err)?;
    }
    txn.commit().map_err(storage_err)?;
    swept.tell(bounds.max_keys);
    Ok(swept)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(k: &str) -> IdempotencyKey {
        IdempotencyKey { source_key: "s".into(), endpoint_id: None, delivery_key: k.into() }
    }

    #[test]
    fn named_path_keys_keep_their_form_and_endpoint_keys_are_apart() {
        assert_eq!(key("d").table_key(), b"s\0d");
        let endpoint = |id: u128| IdempotencyKey { endpoint_id: Some(id), ..key("d") };
        assert_ne!(endpoint(1).table_key(), key("d").table_key());
        assert_ne!(endpoint(1).table_key(), endpoint(2).table_key());
        assert_eq!(endpoint(1).table_key(), endpoint(1).table_key());
    }

    /// A request of one small event for source `s`, with `delivery_key` if any.
    fn one_event(delivery_key: Option<&str>, now: u64) -> crate::Submission {
        use crate::{Destination, Event, Partitioning, Submission};
        Submission {
            source_key: "s".into(),
            endpoint_id: None,
            content_type: None,
            metadata: vec![],
            headers: vec![],
            delivery_key: delivery_key.map(str::to_string),
            events: vec![Event {
                destination: Destination {
                    stream: "a".into(),
                    topic: "b".into(),
                    partitioning: Partitioning::Balanced,
                },
                payload: bytes::Bytes::from_static(b"{}"),
                request_index: 0,
            }],
            received_at_unix_ms: now,
        }
    }

    /// A log under `wal.sync = "interval"` (a sync a minute, so nothing is synced unless
    /// a test closes the log) on the simulated disk, and an index over `state` rebuilt
    /// from it with the ingest core in front: the daemon serving, `now` its clock.
    fn serving_under_interval(state: Arc<StateDb>) -> (Arc<Wal>, Arc<IdempotencyIndex>, crate::Ingestor, u64) {
        let options = wal::WalOptions {
            sync: wal::SyncPolicy::Interval(std::time::Duration::from_secs(60)),
            ..wal::WalOptions::default()
        };
        serving_with(state, options)
    }

    /// The log on the simulated disk under `options`, the index over `state` rebuilt
    /// from it, and an ingestor over both.
    fn serving_with(
        state: Arc<StateDb>,
        options: wal::WalOptions,
    ) -> (Arc<Wal>, Arc<IdempotencyIndex>, crate::Ingestor, u64) {
        let sim = Arc::new(wal::storage::SimStorage::new());
        let wal = Arc::new(Wal::open_with(sim, std::path::Path::new("/wal"), options).unwrap());
        let now = crate::time::now_unix_ms();
        let index = Arc::new(IdempotencyIndex::new(state, 86_400_000));
        index.rebuild(&wal, now).unwrap();
        let ingestor = crate::Ingestor::new(wal.clone(), index.clone());
        (wal, index, ingestor, now)
    }

    /// Under `wal.sync = "interval"` an append is answered once written, before the sync,
    /// and its key recorded at once. A restore from the log while serving (here: a
    /// checkpoint after a key the recorder could not take) must not forget such keys as
    /// if the log had lost them, must not lower the bound a restart's check relies on,
    /// and must keep owing the failed key of a record not yet durable until it restored
    /// it.
    #[tokio::test]
    async fn a_restore_while_serving_keeps_the_keys_of_appends_answered_before_their_sync() {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let (wal, index, ingestor, now) = serving_under_interval(state.clone());
        let submission = |delivery_key: &str| one_event(Some(delivery_key), now);
        let d0 = ingestor.accept(submission("d-0")).await.unwrap();
        assert_eq!((d0.first_offset, d0.replayed), (0, false));
        *index.recorder.lock().unwrap() = None;
        let d1 = ingestor.accept(submission("d-1")).await.unwrap();
        assert_eq!(d1.first_offset, 1);
        assert_eq!(wal.next_offset(), 0, "nothing is durable yet");

        // The checkpoint restores from the log (a key is owed), which holds nothing yet.
        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 0);
        assert_eq!(index.lookup(&key("d-0"), now).unwrap().map(|p| p.first_offset), Some(0), "d-0 was forgotten");
        let keys_below = {
            let db = state.db().unwrap();
            let txn = db.begin_read().unwrap();
            txn.open_table(META).unwrap().get(META_KEYS_BELOW).unwrap().map(|v| v.value())
        };
        assert!(keys_below.is_some_and(|b| b > 0), "the bound fell below d-0's offset: {keys_below:?}");

        // Once the records are durable, the next checkpoint restores d-1's key.
        wal.close().await.unwrap();
        assert_eq!(wal.next_offset(), 2);
        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 2);
        assert_eq!(index.lookup(&key("d-1"), now).unwrap().map(|p| p.first_offset), Some(1), "d-1 is still owed");
    }

    /// Two keys owed, the lower one's record durable and the higher one's not yet (under
    /// `interval`): the restore reads the first and must keep owing the second, or the
    /// next checkpoint passes its record once it is durable and its key is never stored
    /// (a retry appended again, or refused for a delivery the log holds). Before, what
    /// was owed was its lowest offset alone, and the restore that passed it owed nothing.
    #[tokio::test]
    async fn a_restore_that_reads_the_lowest_owed_key_still_owes_a_higher_one_not_yet_durable() {
        use wal::storage::{HoldSyncs, HookedStorage, SimStorage};
        let storage = HookedStorage::new(Arc::new(SimStorage::new()), HoldSyncs::default());
        let options = wal::WalOptions {
            sync: wal::SyncPolicy::Interval(std::time::Duration::from_millis(1)),
            ..wal::WalOptions::default()
        };
        let wal = Arc::new(Wal::open_with(Arc::new(storage.clone()), std::path::Path::new("/wal"), options).unwrap());
        let now = crate::time::now_unix_ms();
        let index = Arc::new(IdempotencyIndex::new(Arc::new(StateDb::open_in_memory().unwrap()), 86_400_000));
        index.rebuild(&wal, now).unwrap();
        let ingestor = crate::Ingestor::new(wal.clone(), index.clone());
        *index.recorder.lock().unwrap() = None;

        let d0 = ingestor.accept(one_event(Some("d-0"), now)).await.unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while wal.next_offset() <= d0.first_offset {
            assert!(std::time::Instant::now() < deadline, "d-0 never became durable");
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let held = storage.hold_syncs();
        let d1 = ingestor.accept(one_event(Some("d-1"), now)).await.unwrap();
        assert_eq!(index.keys_owed_from(), Some(d0.first_offset));

        let through = index.checkpoint(&wal, now).await.unwrap();
        assert_eq!(wal.next_offset(), d1.first_offset, "d-1 became durable with its syncs held");
        assert_eq!(index.lookup(&key("d-0"), now).unwrap().map(|p| p.first_offset), Some(d0.first_offset));
        assert_eq!(through, d1.first_offset);
        assert_eq!(index.keys_owed_from(), Some(d1.first_offset), "d-1's key is owed no more, and not recorded");

        drop(held);
        while wal.next_offset() <= d1.first_offset {
            assert!(std::time::Instant::now() < deadline, "d-1 never became durable");
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), d1.first_offset + 1);
        assert_eq!(index.lookup(&key("d-1"), now).unwrap().map(|p| p.first_offset), Some(d1.first_offset));
        assert_eq!(index.keys_owed_from(), None);
    }

    /// A storage double for the state database: the file, whose writes and syncs fail
    /// once `fail` is set (a full disk), so that redb latches the I/O error.
    #[derive(Debug)]
    struct FailingFile {
        inner: redb::backends::FileBackend,
        fail: Arc<std::sync::atomic::AtomicBool>,
    }

    impl FailingFile {
        fn check(&self) -> std::io::Result<()> {
            match self.fail.load(Ordering::SeqCst) {
                true => Err(std::io::Error::new(std::io::ErrorKind::StorageFull, "the disk is full (test double)")),
                false => Ok(()),
            }
        }
    }

    impl redb::StorageBackend for FailingFile {
        fn len(&self) -> std::io::Result<u64> {
            self.inner.len()
        }
        fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
            self.inner.read(offset, out)
        }
        fn set_len(&self, len: u64) -> std::io::Result<()> {
            self.check()?;
            self.inner.set_len(len)
        }
        fn sync_data(&self) -> std::io::Result<()> {
            self.check()?;
            self.inner.sync_data()
        }
        fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
            self.check()?;
            self.inner.write(offset, data)
        }
        fn close(&self) -> std::io::Result<()> {
            self.inner.close()
        }
        fn try_lock_range(
            &self,
            start: std::ops::Bound<u64>,
            end: std::ops::Bound<u64>,
        ) -> Result<bool, redb::BackendError> {
            self.inner.try_lock_range(start, end)
        }
        fn try_lock_shared_range(
            &self,
            start: std::ops::Bound<u64>,
            end: std::ops::Bound<u64>,
        ) -> Result<bool, redb::BackendError> {
            self.inner.try_lock_shared_range(start, end)
        }
        fn lock_range(&self, start: std::ops::Bound<u64>, end: std::ops::Bound<u64>) -> Result<(), redb::BackendError> {
            self.inner.lock_range(start, end)
        }
        fn lock_shared_range(
            &self,
            start: std::ops::Bound<u64>,
            end: std::ops::Bound<u64>,
        ) -> Result<(), redb::BackendError> {
            self.inner.lock_shared_range(start, end)
        }
        fn unlock_range(
            &self,
            start: std::ops::Bound<u64>,
            end: std::ops::Bound<u64>,
        ) -> Result<(), redb::BackendError> {
            self.inner.unlock_range(start, end)
        }
    }

    /// A state database in `dir` on [`FailingFile`]s, and the switch that fails them.
    fn failing_state(dir: &std::path::Path) -> (Arc<StateDb>, Arc<AtomicBool>) {
        let path = dir.join("s.redb");
        let fail = Arc::new(AtomicBool::new(false));
        let (p, failing) = (path.clone(), fail.clone());
        let backend = move || {
            let file =
                std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&p).unwrap();
            FailingFile { inner: redb::backends::FileBackend::new(file).unwrap(), fail: failing.clone() }
        };
        (Arc::new(StateDb::open_with_backend(&path, backend).unwrap()), fail)
    }

    /// Under `interval`, a reopen after an I/O error (redb repairs the database to its
    /// last durable commit) loses the keys recorded since for appends answered before
    /// their sync, which the restore that follows cannot read yet: they are owed, and the
    /// restore that first reads their records brings them back. Before, they were gone
    /// for good and a retry was appended again.
    #[tokio::test]
    async fn keys_a_reopen_lost_for_records_not_yet_synced_come_back_once_the_records_are_durable() {
        let dir = tempfile::tempdir().unwrap();
        let (state, fail) = failing_state(dir.path());
        let (wal, index, ingestor, now) = serving_under_interval(state);
        let d0 = ingestor.accept(one_event(Some("d-0"), now)).await.unwrap();
        assert_eq!((d0.first_offset, d0.replayed), (0, false));
        assert_eq!(wal.next_offset(), 0, "nothing is durable yet");

        // The disk fills: the checkpoint's commit fails and redb latches the error. Once
        // it has room again, the next checkpoint reopens the database.
        assert_eq!(index.checkpoint_failure(), None);
        fail.store(true, Ordering::SeqCst);
        let failed = index.checkpoint(&wal, now).await.unwrap_err().to_string();
        let kept = index.checkpoint_failure().expect("the failure is kept");
        assert_eq!((kept.in_a_row, kept.error.as_str()), (1, failed.as_str()));
        assert!(index.checkpoint(&wal, now).await.is_err());
        assert_eq!(index.checkpoint_failure().map(|f| f.in_a_row), Some(2), "counted in a row");
        fail.store(false, Ordering::SeqCst);
        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 0, "reopened and restored");
        assert_eq!(index.checkpoint_failure(), None, "a checkpoint that succeeds clears it");
        assert_eq!(index.lookup(&key("d-0"), now).unwrap(), None, "the repair kept the key after all");

        // The record becomes durable: the next checkpoint's restore reads it.
        wal.close().await.unwrap();
        assert_eq!(wal.next_offset(), 1);
        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 1);
        assert_eq!(index.lookup(&key("d-0"), now).unwrap().map(|p| p.first_offset), Some(0), "d-0 never came back");
    }

    /// A reopen after an I/O error with no key recorded since the last durable checkpoint
    /// dropped none, and owes none: a retry is answered from the database at once. Before,
    /// the keys from the checkpoint on were owed until some append moved the log's end and
    /// a checkpoint restored nothing, every retry meanwhile refused (503).
    #[tokio::test]
    async fn a_reopen_that_dropped_no_key_owes_none() {
        let dir = tempfile::tempdir().unwrap();
        let (state, fail) = failing_state(dir.path());
        let (wal, index, ingestor, now) = serving_with(state, wal::WalOptions::default());
        let d0 = ingestor.accept(one_event(Some("d-0"), now)).await.unwrap();
        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 1);
        fail.store(true, Ordering::SeqCst);
        assert!(index.checkpoint(&wal, now).await.is_err());
        fail.store(false, Ordering::SeqCst);
        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 1, "reopened");
        assert_eq!(index.keys_owed_from(), None);
        let replayed = ingestor.replay_of(&key("d-0"), now).await.unwrap();
        assert!(replayed.is_some_and(|a| a.replayed && a.first_offset == d0.first_offset));
    }

    /// A recovery cancelled right after its reopen (the daemon aborts its checkpoint task
    /// at shutdown) has not yet owed the keys redb's repair dropped: the next recovery
    /// (here the next checkpoint while serving) must owe and restore them, or it would
    /// commit its checkpoint past their records and a retry would be appended again.
    #[tokio::test]
    async fn keys_a_reopen_dropped_are_restored_even_when_the_recovery_was_cancelled_after_the_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let (state, fail) = failing_state(dir.path());
        let (wal, index, ingestor, now) = serving_under_interval(state);
        ingestor.accept(one_event(Some("d-0"), now)).await.unwrap();
        wal.close().await.unwrap();
        assert_eq!(wal.next_offset(), 1, "the record is durable");

        fail.store(true, Ordering::SeqCst);
        assert!(index.checkpoint(&wal, now).await.is_err(), "the commit fails, redb latches the error");
        fail.store(false, Ordering::SeqCst);
        let (reached, at_hook) = tokio::sync::oneshot::channel::<()>();
        *index.after_reopen.lock().unwrap() = Some(Box::pin(async move {
            let _ = reached.send(());
            std::future::pending::<()>().await
        }));
        let cancelled = tokio::spawn({
            let (index, wal) = (index.clone(), wal.clone());
            async move { index.checkpoint(&wal, now).await }
        });
        at_hook.await.unwrap();
        cancelled.abort();
        assert!(cancelled.await.unwrap_err().is_cancelled());
        assert_eq!(index.lookup(&key("d-0"), now).unwrap(), None, "the reopen ran: the repair dropped the key");

        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 1);
        assert_eq!(index.lookup(&key("d-0"), now).unwrap().map(|p| p.first_offset), Some(0), "d-0 was never restored");
    }

    /// A row naming no range of offsets (last before first, or the very last offset) is
    /// no acceptance: the lookup finds none, never a count made of the difference.
    #[test]
    fn a_recorded_row_naming_no_range_of_offsets_is_taken_for_none() {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let index = IdempotencyIndex::new(state.clone(), 86_400_000);
        let now = crate::time::now_unix_ms();
        for (n, (first, last)) in [(5u64, 3u64), (0, u64::MAX), (7, 7)].into_iter().enumerate() {
            let k = key(&format!("d-{n}"));
            let db = state.db().unwrap();
            let txn = db.begin_write().unwrap();
            insert(
                &txn,
                &k.table_key(),
                PriorAcceptance { first_offset: first, last_offset: last, accepted_at_unix_ms: now },
            )
            .unwrap();
            txn.commit().unwrap();
            let found = index.lookup(&k, now).unwrap().map(|p| (p.first_offset, p.last_offset));
            assert_eq!(found, (first <= last && last != u64::MAX).then_some((first, last)), "({first}, {last})");
        }
    }

    /// Under `always` every answered record is durable, so the restore after a reopen
    /// reads every one: no key is owed once it is done, and a retry is answered (here
    /// through `replay_of`, which refuses while keys are owed) as soon as the database
    /// is back, not only after some later append moved the log's end.
    #[tokio::test]
    async fn under_always_a_reopen_leaves_no_key_owed_once_restored() {
        let dir = tempfile::tempdir().unwrap();
        let (state, fail) = failing_state(dir.path());
        let (wal, index, ingestor, now) = serving_with(state, wal::WalOptions::default());
        ingestor.accept(one_event(Some("d-0"), now)).await.unwrap();

        fail.store(true, Ordering::SeqCst);
        assert!(index.checkpoint(&wal, now).await.is_err(), "the commit fails, redb latches the error");
        fail.store(false, Ordering::SeqCst);
        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 1, "reopened and restored");
        assert_eq!(index.keys_owed_from(), None);
        let replay = ingestor.replay_of(&key("d-0"), now).await.unwrap().expect("the retry is a replay");
        assert_eq!((replay.first_offset, replay.replayed), (0, true));
    }

    /// A restore while serving reads the log from the durable checkpoint on, which after
    /// a long failure of the state database is a long read. The daemon runs one async
    /// worker on two cores: a restore read on it would stall every request of the door,
    /// `/health` included. Here the restore spawns a task on the one-worker runtime and
    /// waits for it, which can run only if the restore handed the worker over.
    #[test]
    fn a_restore_while_serving_leaves_the_async_worker_free() {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        runtime.block_on(async {
            let state = Arc::new(StateDb::open_in_memory().unwrap());
            let (wal, index, ingestor, now) = serving_under_interval(state);
            ingestor.accept(one_event(Some("d-0"), now)).await.unwrap();
            *index.recorder.lock().unwrap() = None;
            ingestor.accept(one_event(Some("d-1"), now)).await.unwrap();
            wal.close().await.unwrap();

            let worker_was_free = Arc::new(AtomicBool::new(false));
            let (seen, runtime) = (worker_was_free.clone(), tokio::runtime::Handle::current());
            *index.during_restore.lock().unwrap() = Some(Box::new(move || {
                // Spawned from inside the restore: it can run only on a free worker.
                let (ping, pinged) = std::sync::mpsc::channel::<()>();
                runtime.spawn(async move {
                    let _ = ping.send(());
                });
                let arrived = pinged.recv_timeout(std::time::Duration::from_secs(5)).is_ok();
                seen.store(arrived, Ordering::SeqCst);
            }));
            // On the runtime's one worker, as the daemon's checkpoint task is.
            let checkpoint = tokio::spawn({
                let (index, wal) = (index.clone(), wal.clone());
                async move { index.checkpoint(&wal, now).await }
            });
            assert_eq!(checkpoint.await.unwrap().unwrap(), 2);
            assert!(worker_was_free.load(Ordering::SeqCst), "the restore held the async worker");
            assert_eq!(index.lookup(&key("d-1"), now).unwrap().map(|p| p.first_offset), Some(1));
        });
    }

    /// Under `interval`, the log's sync can land between a checkpoint's restore (which
    /// read the log up to its durable end, short of a record whose key is owed) and its
    /// reading of the log's end: the checkpoint must still stop below the owed record,
    /// or the next restore would start past it and the key would never come back.
    #[tokio::test]
    async fn a_checkpoint_stops_below_an_owed_key_when_the_log_synced_after_its_restore() {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let (wal, index, ingestor, now) = serving_under_interval(state);
        ingestor.accept(one_event(Some("d-0"), now)).await.unwrap();
        *index.recorder.lock().unwrap() = None;
        let d1 = ingestor.accept(one_event(Some("d-1"), now)).await.unwrap();
        assert_eq!(d1.first_offset, 1);
        assert_eq!(wal.next_offset(), 0, "nothing is durable yet");

        // The log becomes durable right after the restore read it (empty).
        let syncing = wal.clone();
        *index.after_restore.lock().unwrap() = Some(Box::pin(async move { syncing.close().await.unwrap() }));
        let through = index.checkpoint(&wal, now).await.unwrap();
        assert_eq!(wal.next_offset(), 2);
        assert!(through <= 1, "the checkpoint passed the owed key of offset 1: {through}");
        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 2);
        assert_eq!(index.lookup(&key("d-1"), now).unwrap().map(|p| p.first_offset), Some(1), "d-1 was never restored");
    }

    /// The checkpoint at a stop restores no owed key from the log: that read runs on its
    /// thread to the end, as long as the log since the last checkpoint, and a stop bounded
    /// by a timeout could not cut it short. It stops below the owed key instead, and the
    /// next start's rebuild restores it.
    #[tokio::test]
    async fn the_checkpoint_at_a_stop_leaves_owed_keys_to_the_next_start() {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let (wal, index, ingestor, now) = serving_with(state.clone(), wal::WalOptions::default());
        ingestor.accept(one_event(Some("d-0"), now)).await.unwrap();
        *index.recorder.lock().unwrap() = None;
        let d1 = ingestor.accept(one_event(Some("d-1"), now)).await.unwrap();
        assert_eq!((d1.first_offset, index.keys_owed_from()), (1, Some(1)));
        let restored = Arc::new(AtomicBool::new(false));
        let seen = restored.clone();
        *index.during_restore.lock().unwrap() = Some(Box::new(move || seen.store(true, Ordering::SeqCst)));

        assert_eq!(index.final_checkpoint(&wal, now).await.unwrap(), 1, "stopped below the owed key");
        assert!(!restored.load(Ordering::SeqCst), "the stop's checkpoint read the log");
        assert_eq!(index.lookup(&key("d-1"), now).unwrap(), None);
        wal.close().await.unwrap();

        // The next start.
        let reopened = IdempotencyIndex::new(state, 86_400_000);
        reopened.rebuild(&wal, now).unwrap();
        assert_eq!(reopened.lookup(&key("d-1"), now).unwrap().map(|p| p.first_offset), Some(1), "d-1 not restored");
        // While serving, a checkpoint restores it itself.
        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 2);
        assert!(restored.load(Ordering::SeqCst));
    }

    /// A stop ends a restore from the log that a periodic checkpoint is running (a long
    /// read, holding the gate the final checkpoint waits for) within a step, committing
    /// nothing: the owed key stays owed, and the final checkpoint stops below it at once.
    /// Before, the restore ran to the end, and a stop bounded by a timeout could give up
    /// on the final checkpoint (exit 1).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stop_ends_a_restore_from_the_log_at_its_next_record() {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let (wal, index, ingestor, now) = serving_with(state, wal::WalOptions::default());
        ingestor.accept(one_event(Some("d-0"), now)).await.unwrap();
        *index.recorder.lock().unwrap() = None;
        let d1 = ingestor.accept(one_event(Some("d-1"), now)).await.unwrap();
        assert_eq!(index.keys_owed_from(), Some(d1.first_offset));
        let records = 10_000;
        wal.append((0..records).map(|_| bytes::Bytes::from_static(b"a record of another kind")).collect())
            .await
            .unwrap();
        let durable_before = index.durable_through().load(Ordering::SeqCst);
        let stopping = index.clone();
        *index.during_restore.lock().unwrap() = Some(Box::new(move || stopping.stop_restores()));

        let stopped = index.checkpoint(&wal, now).await.unwrap_err().to_string();
        assert!(stopped.contains("stopped"), "{stopped}");
        assert_eq!(index.keys_owed_from(), Some(d1.first_offset), "the stopped restore settled what it owed");
        assert_eq!(index.durable_through().load(Ordering::SeqCst), durable_before, "the stopped restore committed");
        assert_eq!(index.final_checkpoint(&wal, now).await.unwrap(), d1.first_offset);
    }

    /// A log on the simulated disk (`sync = always`), an index rebuilt from it over an
    /// in-memory database, and the ingestor over both, serving; and now.
    fn serving_under_always() -> (Arc<Wal>, Arc<IdempotencyIndex>, Arc<crate::Ingestor>, u64) {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let sim = wal::storage::SimStorage::new();
        let wal =
            Arc::new(Wal::open_with(Arc::new(sim), std::path::Path::new("/wal"), wal::WalOptions::default()).unwrap());
        let now = crate::time::now_unix_ms();
        let index = Arc::new(IdempotencyIndex::new(state, 86_400_000));
        index.rebuild(&wal, now).unwrap();
        let ingestor = Arc::new(crate::Ingestor::new(wal.clone(), index.clone()));
        (wal, index, ingestor, now)
    }

    /// A key whose record failed (here: the recorder thread is gone) must not be passed
    /// over by a checkpoint, or neither a restart nor the log (released below the
    /// checkpoint) could restore it: the checkpoint restores it from the log first, and
    /// the log's release ceiling (`durable_through`) follows the checkpoint.
    #[tokio::test]
    async fn a_key_the_recorder_could_not_take_is_restored_from_the_log_before_a_checkpoint_passes_it() {
        let (wal, index, ingestor, now) = serving_under_always();
        let submission = |delivery_key: Option<&str>| one_event(delivery_key, now);
        ingestor.accept(submission(None)).await.unwrap();
        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 1);
        assert_eq!(index.durable_through().load(Ordering::Acquire), 1);

        *index.recorder.lock().unwrap() = None;
        let first = ingestor.accept(submission(Some("d-1"))).await.unwrap();
        assert_eq!((first.first_offset, first.replayed), (1, false));
        assert_eq!(index.lookup(&key("d-1"), now).unwrap(), None, "the key was not recorded");
        assert_eq!(index.durable_through().load(Ordering::Acquire), 1, "nothing is released past it yet");

        assert_eq!(index.checkpoint(&wal, now).await.unwrap(), 2);
        assert_eq!(index.lookup(&key("d-1"), now).unwrap().map(|p| p.first_offset), Some(1));
        assert_eq!(index.durable_through().load(Ordering::Acquire), 2);
        let retry = ingestor.accept(submission(Some("d-1"))).await.unwrap();
        assert_eq!((retry.first_offset, retry.replayed), (1, true));
        assert_eq!(wal.next_offset(), 2, "the retry appended nothing");
    }

    /// A retry the door would refuse asks `replay_of`. While its key is owed (the recorder
    /// could not take it, and no checkpoint has restored it from the log yet), "no replay"
    /// is not known, and the door would send the refusal for a delivery the log holds:
    /// `StateUnavailable`. Once a checkpoint restored it, the replay. And while a recovery
    /// holds the gate (restoring keys a reopen dropped), the lookup waits for it.
    #[tokio::test]
    async fn a_replay_asked_while_keys_are_owed_is_unavailable_and_waits_for_a_recovery() {
        use crate::IngestError;
        let (wal, index, ingestor, now) = serving_under_always();
        ingestor.accept(one_event(Some("d-0"), now)).await.unwrap();
        assert!(ingestor.replay_of(&key("d-0"), now).await.unwrap().is_some_and(|a| a.replayed));
        assert_eq!(ingestor.replay_of(&key("new"), now).await.unwrap(), None, "nothing owed: none is the answer");

        *index.recorder.lock().unwrap() = None;
        ingestor.accept(one_event(Some("d-1"), now)).await.unwrap();
        assert_eq!(index.keys_owed_from(), Some(1));
        match ingestor.replay_of(&key("d-1"), now).await {
            Err(IngestError::StateUnavailable(why)) => assert!(why.contains("offset 1"), "{why}"),
            other => panic!("a lookup while d-1 is owed: {other:?}"),
        }
        index.checkpoint(&wal, now).await.unwrap();
        assert_eq!(index.keys_owed_from(), None);
        let replayed = ingestor.replay_of(&key("d-1"), now).await.unwrap();
        assert!(replayed.is_some_and(|a| a.replayed && a.first_offset == 1));

        let exclusive = index.gate.clone().write_owned().await;
        let asking = tokio::spawn({
            let ingestor = ingestor.clone();
            async move { ingestor.replay_of(&key("d-1"), now).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!asking.is_finished(), "the lookup did not wait for the recovery holding the gate");
        drop(exclusive);
        assert!(asking.await.unwrap().unwrap().is_some_and(|a| a.replayed));
    }

    /// A key whose record was not committed, however it ended (the recorder unwound with
    /// its group, or was gone when the key came), is owed to the next checkpoint's
    /// restore before its claim is let go: no checkpoint passes its record meanwhile.
    #[tokio::test]
    async fn a_record_dropped_unfinished_owes_its_key_before_its_claim_is_let_go() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let index = Arc::new(IdempotencyIndex::new(state, 60_000));

        // A job the recorder drops unfinished, as an unwinding recorder drops its group.
        // What is owed is looked at as the claim goes.
        let mut c = index.claim(&key("a")).await.unwrap();
        let owed_as_the_claim_went = Arc::new(Mutex::new(None));
        let (seen, owed) = (owed_as_the_claim_went.clone(), index.owed.clone());
        c.on_drop = Some(Box::new(move || *seen.lock().unwrap() = Some(owed.lock().unwrap().map(|o| o.from))));
        let (reply, done) = oneshot::channel();
        let job = RecordJob {
            owed_unless_recorded: OwedUnlessRecorded { owed: index.owed.clone(), first_offset: 9, armed: true },
            claim: c,
            prior: PriorAcceptance { first_offset: 9, last_offset: 9, accepted_at_unix_ms: 10_000 },
            _answered_early: None,
            reply,
        };
        drop(job);
        assert_eq!(*owed_as_the_claim_went.lock().unwrap(), Some(Some(9)), "the claim went before the key was owed");
        assert_eq!(index.keys_owed_from(), Some(9));
        assert!(!index.is_claimed(&key("a")));
        let recording = Recording { done: Some(done), answered_early: false };
        assert!(recording.await.is_err(), "a dropped job's request must not be told its key was recorded");

        // The recorder gone: the key is owed from the lower offset, and its request told.
        index.recorder.lock().unwrap().take();
        let c = index.claim(&key("b")).await.unwrap();
        let recording =
            index.record(c, PriorAcceptance { first_offset: 4, last_offset: 6, accepted_at_unix_ms: 10_000 });
        assert!(!recording.may_answer_now(), "answered before a record that cannot happen");
        assert!(recording.await.is_err());
        assert_eq!(index.keys_owed_from(), Some(4));
        assert!(!index.is_claimed(&key("b")));
    }

    #[tokio::test]
    async fn a_claimed_key_cannot_be_claimed_twice_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let index = Arc::new(IdempotencyIndex::new(state, 60_000));
        let c = index.claim(&key("a")).await.unwrap();
        assert!(index.claim(&key("a")).await.is_none());
        assert!(index.claim(&key("b")).await.is_some());
        drop(c);
        assert!(index.claim(&key("a")).await.is_some());
    }

    #[tokio::test]
    async fn keys_from_before_endpoint_scoping_are_forgotten_once_for_every_source() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let index = Arc::new(IdempotencyIndex::new(state, 60_000));
        let mixed =
            |endpoint_id, k: &str| IdempotencyKey { source_key: "mixed".into(), endpoint_id, delivery_key: k.into() };
        let plain = IdempotencyKey { source_key: "plain".into(), endpoint_id: None, delivery_key: "d".into() };
        // "mixed-more" shares the prefix "mixed" but is another source.
        let neighbour = IdempotencyKey { source_key: "mixed-more".into(), endpoint_id: None, delivery_key: "d".into() };
        let prior = PriorAcceptance { first_offset: 1, last_offset: 1, accepted_at_unix_ms: 10_000 };
        let keys = [mixed(None, "d"), mixed(None, "e"), mixed(Some(7), "d"), plain.clone(), neighbour.clone()];
        for key in &keys {
            let c = index.claim(key).await.unwrap();
            index.record(c, prior).await.unwrap();
        }
        assert_eq!(index.forget_unscoped_keys_once().unwrap(), 4);
        assert_eq!(index.lookup(&mixed(None, "d"), 10_500).unwrap(), None);
        assert_eq!(index.lookup(&mixed(None, "e"), 10_500).unwrap(), None);
        assert_eq!(index.lookup(&mixed(Some(7), "d"), 10_500).unwrap(), Some(prior), "a scoped key is kept");
        // A source with no endpoint now may have had a static one, removed from the
        // configuration before the upgrade: nothing in the database says so.
        assert_eq!(index.lookup(&plain, 10_500).unwrap(), None, "a source without endpoints now");
        assert_eq!(index.lookup(&neighbour, 10_500).unwrap(), None);

        // Once: keys recorded after the first run are the scoped kind and stay.
        let c = index.claim(&mixed(None, "f")).await.unwrap();
        index.record(c, prior).await.unwrap();
        assert_eq!(index.forget_unscoped_keys_once().unwrap(), 0);
        assert_eq!(index.lookup(&mixed(None, "f"), 10_500).unwrap(), Some(prior));
        // The time index lost the forgotten keys too: a sweep of everything passes.
        let wal_dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(wal_dir.path(), wal::WalOptions::default()).unwrap();
        index.checkpoint(&wal, 100_000 + SWEEP_GRACE_MS).await.unwrap();
        assert_eq!(index.lookup(&mixed(Some(7), "d"), 10_500).unwrap(), None);
    }

    /// A build of schema version 1 records an endpoint request's delivery id in its
    /// source's scope. Run on a database this build had sorted out (a rollback), it would
    /// put such ids back where a named-path request finds them, and the once-only sort
    /// would never run again: the named-path request with the same delivery id would be
    /// answered as a replay of another delivery, its event never stored. Such a build
    /// refuses this build's databases (version 2), and a database of version 1 must be
    /// migrated, which makes the next start sort the keys out again.
    #[tokio::test]
    async fn keys_a_version_1_build_recorded_after_the_sort_are_sorted_out_again_after_migrating() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.redb");
        let named = IdempotencyKey { source_key: "s".into(), endpoint_id: None, delivery_key: "d".into() };
        let prior = PriorAcceptance { first_offset: 1, last_offset: 1, accepted_at_unix_ms: 10_000 };
        {
            let state = Arc::new(StateDb::open(&path).unwrap());
            let index = IdempotencyIndex::new(state.clone(), 60_000);
            assert_eq!(index.forget_unscoped_keys_once().unwrap(), 0);
            // What a version 1 build does with an endpoint request's id "d": it records it
            // in the source's scope, the named path's.
            let db = state.db().unwrap();
            let txn = db.begin_write().unwrap();
            insert(&txn, &named.table_key(), prior).unwrap();
            txn.open_table(META).unwrap().insert(crate::state::META_SCHEMA_VERSION, 1).unwrap();
            txn.commit().unwrap();
        }
        assert!(
            matches!(StateDb::open(&path), Err(StateError::SchemaMismatch { found: 1, .. })),
            "a database a version 1 build wrote must not be taken as it is"
        );
        assert!(matches!(crate::state::migrate(&path).unwrap(), crate::state::Migration::Migrated { from: 1, .. }));
        let index = IdempotencyIndex::new(Arc::new(StateDb::open(&path).unwrap()), 60_000);
        assert_eq!(index.forget_unscoped_keys_once().unwrap(), 1);
        assert_eq!(index.lookup(&named, 10_500).unwrap(), None, "the named path would answer with another delivery");
    }

    /// A bulk forget of more keys than one transaction takes (here two and a half
    /// transactions' worth, at the daemon's own bound) forgets every matching key and only
    /// those, in transactions of at most the bound each, and leaves the time index without
    /// them too.
    #[tokio::test]
    async fn a_bulk_forget_runs_in_bounded_transactions_and_forgets_exactly_the_matching_keys() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let n = FORGET_MAX_KEYS_PER_TRANSACTION * 5 / 2;
        {
            let db = state.db().unwrap();
            let txn = db.begin_write().unwrap();
            // Even keys at offsets a log lost (from 1,000,000 on), odd ones below: the
            // matching keys are spread through the table, not one run of it.
            for i in 0..2 * n as u64 {
                let offset = if i % 2 == 0 { 1_000_000 + i } else { i };
                let prior =
                    PriorAcceptance { first_offset: offset, last_offset: offset, accepted_at_unix_ms: 10_000 + i };
                insert(&txn, &key(&format!("d-{i:06}")).table_key(), prior).unwrap();
            }
            txn.commit().unwrap();
        }
        use redb::ReadableTableMetadata;
        let forgotten = forget_keys_in_chunks(&state, |_, _, last| last >= 1_000_000).unwrap();
        assert_eq!(forgotten, Forgotten { keys: n as u64, transactions: 3 });
        let db = state.db().unwrap();
        let txn = db.begin_read().unwrap();
        let table = txn.open_table(IDEMPOTENCY).unwrap();
        let by_time = txn.open_table(IDEMPOTENCY_BY_TIME).unwrap();
        assert_eq!((table.len().unwrap(), by_time.len().unwrap()), (n as u64, n as u64));
        for entry in table.iter().unwrap() {
            let (_, v) = entry.unwrap();
            assert!(v.value().1 < 1_000_000, "a key the forget matched was kept: {:?}", v.value());
        }
        drop((table, by_time, txn, db));
        // Nothing left to match: one transaction that finds none.
        assert_eq!(
            forget_keys_in_chunks(&state, |_, _, last| last >= 1_000_000).unwrap(),
            Forgotten { keys: 0, transactions: 1 }
        );
    }

    fn keys_below(index: &IdempotencyIndex) -> Option<u64> {
        let db = index.state.db().unwrap();
        let txn = db.begin_read().unwrap();
        let meta = txn.open_table(META).unwrap();
        meta.get(META_KEYS_BELOW).unwrap().map(|v| v.value())
    }

    #[tokio::test]
    async fn the_bound_on_recorded_keys_follows_the_records_and_a_database_without_it_is_scanned_once() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let index = Arc::new(IdempotencyIndex::new(state.clone(), 60_000));
        let wal_dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(wal_dir.path(), wal::WalOptions::default()).unwrap();
        for _ in 0..4 {
            wal.append(vec![bytes::Bytes::from_static(b"not an envelope")]).await.unwrap();
        }
        // A database from before the bound: keys, no bound.
        {
            let db = state.db().unwrap();
            let txn = db.begin_write().unwrap();
            insert(
                &txn,
                &key("kept").table_key(),
                PriorAcceptance { first_offset: 1, last_offset: 3, accepted_at_unix_ms: 10_000 },
            )
            .unwrap();
            insert(
                &txn,
                &key("gone").table_key(),
                PriorAcceptance { first_offset: 2, last_offset: 4, accepted_at_unix_ms: 10_000 },
            )
            .unwrap();
            txn.commit().unwrap();
        }
        assert_eq!(keys_below(&index), None);
        let report = index.rebuild(&wal, 10_500).unwrap();
        assert_eq!(report.keys_beyond_log_forgotten, 1, "a batch reaching past the log's end is gone whole");
        assert!(index.lookup(&key("kept"), 10_500).unwrap().is_some());
        assert_eq!(index.lookup(&key("gone"), 10_500).unwrap(), None);
        assert_eq!(keys_below(&index), Some(4));

        // Recording raises the bound past the key's last offset, never lowers it.
        let c = index.claim(&key("new")).await.unwrap();
        index
            .record(c, PriorAcceptance { first_offset: 7, last_offset: 9, accepted_at_unix_ms: 10_000 })
            .await
            .unwrap();
        assert_eq!(keys_below(&index), Some(10));
        let c = index.claim(&key("older")).await.unwrap();
        index
            .record(c, PriorAcceptance { first_offset: 5, last_offset: 5, accepted_at_unix_ms: 10_000 })
            .await
            .unwrap();
        assert_eq!(keys_below(&index), Some(10));

        // The bound is past the log's end (4): the rebuild forgets those two and lowers it.
        let report = index.rebuild(&wal, 10_500).unwrap();
        assert_eq!(report.keys_beyond_log_forgotten, 2);
        assert_eq!(keys_below(&index), Some(4));
        assert!(index.lookup(&key("kept"), 10_500).unwrap().is_some());
        // The time index lost them too: a sweep of everything passes.
        index.checkpoint(&wal, 100_000 + SWEEP_GRACE_MS).await.unwrap();
        assert_eq!(index.lookup(&key("kept"), 10_500).unwrap(), None);
    }

    #[tokio::test]
    async fn lookups_honour_the_retention_window_and_checkpoints_sweep() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let index = Arc::new(IdempotencyIndex::new(state, 1_000));
        let c = index.claim(&key("a")).await.unwrap();
        let prior = PriorAcceptance { first_offset: 3, last_offset: 5, accepted_at_unix_ms: 10_000 };
        index.record(c, prior).await.unwrap();
        assert_eq!(index.lookup(&key("a"), 10_500).unwrap(), Some(prior));
        assert_eq!(index.lookup(&key("a"), 11_001).unwrap(), None);
        assert_eq!(index.lookup(&key("b"), 10_500).unwrap(), None);

        let wal_dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(wal_dir.path(), wal::WalOptions::default()).unwrap();
        // A checkpoint just past the window keeps it: a request whose head arrived
        // within the window (its body still coming) looks it up at that earlier time.
        index.checkpoint(&wal, 11_001).await.unwrap();
        assert_eq!(index.lookup(&key("a"), 10_999).unwrap(), Some(prior));
        index.checkpoint(&wal, 11_000 + SWEEP_GRACE_MS).await.unwrap();
        assert_eq!(index.lookup(&key("a"), 10_999).unwrap(), Some(prior));
        index.checkpoint(&wal, 11_001 + SWEEP_GRACE_MS).await.unwrap();
        // Swept: even a lookup "in the past" no longer finds it.
        assert_eq!(index.lookup(&key("a"), 10_500).unwrap(), None);
    }

    /// A forward step of the wall clock, stepped back later, deletes no delivery id when
    /// the checkpoints run on the daemon's sweep clock: with the wall clock's reading
    /// itself, the first checkpoint after the step swept the id for good.
    #[tokio::test]
    async fn a_forward_step_of_the_wall_clock_sweeps_nothing_on_the_sweep_clock() {
        for (on_the_sweep_clock, kept) in [(true, true), (false, false)] {
            let dir = tempfile::tempdir().unwrap();
            let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
            let retention_ms = 86_400_000;
            let index = Arc::new(IdempotencyIndex::new(state, retention_ms));
            let c = index.claim(&key("a")).await.unwrap();
            let accepted_at = 1_700_000_000_000;
            let prior = PriorAcceptance { first_offset: 3, last_offset: 5, accepted_at_unix_ms: accepted_at };
            index.record(c, prior).await.unwrap();
            let wal_dir = tempfile::tempdir().unwrap();
            let wal = Wal::open(wal_dir.path(), wal::WalOptions::default()).unwrap();
            let clock = crate::time::SweepClock::new();
            let t0 = std::time::Instant::now();
            let now = |wall: u64, secs: u64| {
                if on_the_sweep_clock { clock.at(wall, t0 + std::time::Duration::from_secs(secs)) } else { wall }
            };
            index.checkpoint(&wal, now(accepted_at + 60_000, 0)).await.unwrap();
            // The wall clock steps two days ahead for a second, then back.
            index.checkpoint(&wal, now(accepted_at + 61_000 + 2 * retention_ms, 1)).await.unwrap();
            index.checkpoint(&wal, now(accepted_at + 62_000, 2)).await.unwrap();
            let found = index.lookup(&key("a"), accepted_at + 63_000).unwrap();
            assert_eq!(found.is_some(), kept, "on the sweep clock: {on_the_sweep_clock}");
        }
    }

    /// After a downtime longer than the window, more keys expire at once than one
    /// transaction sweeps: the checkpoint's own sweeps at most SWEEP_MAX_KEYS_PER_TRANSACTION
    /// (the real limit), oldest first; the checkpoint then sweeps the rest in more
    /// transactions; a key still in the window stays.
    #[tokio::test]
    async fn a_checkpoint_sweeps_expired_keys_in_bounded_transactions() {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let index = Arc::new(IdempotencyIndex::new(state.clone(), 1_000));
        let expired = 3 * SWEEP_MAX_KEYS_PER_TRANSACTION + 2_500;
        {
            let db = state.db().unwrap();
            let txn = db.begin_write().unwrap();
            for i in 0..expired {
                let prior = PriorAcceptance { first_offset: 0, last_offset: 0, accepted_at_unix_ms: i as u64 };
                insert(&txn, key(&format!("old-{i}")).table_key().as_slice(), prior).unwrap();
            }
            let fresh = PriorAcceptance { first_offset: 1, last_offset: 1, accepted_at_unix_ms: 1_000_000 };
            insert(&txn, key("fresh").table_key().as_slice(), fresh).unwrap();
            txn.commit().unwrap();
        }
        let count = |t| {
            use redb::ReadableTableMetadata;
            let db = state.db().unwrap();
            let txn = db.begin_read().unwrap();
            match t {
                "keys" => txn.open_table(IDEMPOTENCY).unwrap().len().unwrap(),
                _ => txn.open_table(IDEMPOTENCY_BY_TIME).unwrap().len().unwrap(),
            }
        };
        let wal_dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(wal_dir.path(), wal::WalOptions::default()).unwrap();
        let now = 1_000_000 + SWEEP_GRACE_MS;
        let cutoff = now - 1_000 - SWEEP_GRACE_MS;
        let bounds = SweepBounds { cutoff_unix_ms: cutoff, max_keys: MAX_KEYS_DEFAULT };
        let swept = commit_checkpoint(&state, 0, bounds).unwrap();
        assert_eq!((swept.expired, swept.evicted), (SWEEP_MAX_KEYS_PER_TRANSACTION, 0));
        let left = (2 * SWEEP_MAX_KEYS_PER_TRANSACTION + 2_501) as u64;
        assert_eq!(count("keys"), left, "one transaction swept more or less than its share");
        assert_eq!(count("by_time"), left);
        assert_eq!(index.lookup(&key("old-0"), now).unwrap(), None, "the oldest go first");
        assert!(index.lookup(&key(&format!("old-{}", expired - 1)), 1_000).unwrap().is_some(), "the newest stay");
        // The final checkpoint (at shutdown) sweeps its own transaction's share only.
        index.final_checkpoint(&wal, now).await.unwrap();
        assert_eq!(count("keys"), left - SWEEP_MAX_KEYS_PER_TRANSACTION as u64);
        // A checkpoint sweeps the rest, in more than one transaction.
        index.checkpoint(&wal, now).await.unwrap();
        assert_eq!((count("keys"), count("by_time")), (1, 1), "the checkpoint sweeps the rest");
        assert!(index.lookup(&key("fresh"), 1_000_500).unwrap().is_some());
    }

    /// Past `max_keys`, a checkpoint forgets the oldest keys before their retention ends,
    /// expired ones first, and counts what it evicted; under the bound it evicts nothing.
    #[tokio::test]
    async fn past_max_keys_a_checkpoint_forgets_the_oldest_keys_first() {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let index = Arc::new(IdempotencyIndex::new(state.clone(), 1_000_000).with_max_keys(3));
        {
            let db = state.db().unwrap();
            let txn = db.begin_write().unwrap();
            // One expired key (accepted at 1), then six live ones, oldest first.
            for (name, at) in [("expired", 1), ("k0", 10), ("k1", 20), ("k2", 30), ("k3", 40), ("k4", 50), ("k5", 60)] {
                let prior = PriorAcceptance { first_offset: 0, last_offset: 0, accepted_at_unix_ms: at };
                insert(&txn, key(name).table_key().as_slice(), prior).unwrap();
            }
            txn.commit().unwrap();
        }
        let now = 1_000_000 + SWEEP_GRACE_MS + 5;
        let bounds = SweepBounds { cutoff_unix_ms: now - 1_000_000 - SWEEP_GRACE_MS, max_keys: 3 };
        let swept = commit_checkpoint(&state, 0, bounds).unwrap();
        assert_eq!(swept, Swept { expired: 1, evicted: 3, keys_left: 3 });
        for (name, kept) in
            [("expired", false), ("k0", false), ("k1", false), ("k2", false), ("k3", true), ("k4", true), ("k5", true)]
        {
            assert_eq!(index.lookup(&key(name), 100).unwrap().is_some(), kept, "{name}");
        }
        // At the bound, nothing more goes.
        let again = commit_checkpoint(&state, 0, bounds).unwrap();
        assert_eq!(again, Swept { expired: 0, evicted: 0, keys_left: 3 });
        // Through the index's own checkpoint, with its bound: one more key, one evicted.
        let c = index.claim(&key("k6")).await.unwrap();
        index.record(c, PriorAcceptance { first_offset: 1, last_offset: 1, accepted_at_unix_ms: 70 }).await.unwrap();
        let wal_dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(wal_dir.path(), wal::WalOptions::default()).unwrap();
        index.checkpoint(&wal, 100).await.unwrap();
        assert!(index.lookup(&key("k3"), 100).unwrap().is_none(), "the oldest was kept past the bound");
        assert!(index.lookup(&key("k6"), 100).unwrap().is_some(), "the newest was evicted");
    }
}
