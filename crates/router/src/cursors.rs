//! Durable per-lane cursors: for each (source, destination), the offset below which
//! every record of that source bound for that destination was acknowledged.
//!
//! Invariants:
//! - `store` returns only once the cursors are durable; the log is released below a
//!   lane's records only after that.
//! - A cursor never moves backwards through `store` (stores only ever raise it). Only
//!   `lower`, called by the router at start for a cursor above the log's next offset (the
//!   log lost its tail, or was replaced, after the cursor was stored), moves one back.
//! - A record below its own destination's cursor as the router found it at start was
//!   delivered there before the restart (`DeliveredAtStart`, the one place that says
//!   so for records a lane of another destination sees).
//! - The log is never released at or above the store's `release_ceiling`: the daemon's
//!   store answers the idempotency index's durable checkpoint, so a record leaves the log
//!   only once its delivery id is durable elsewhere.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use ingest::{CursorRow, StateDb};

use crate::sink::{DestinationKey, LaneKey};

pub trait CursorStore: Send + Sync + 'static {
    /// Every stored cursor.
    fn load(&self) -> Result<HashMap<LaneKey, u64>, String>;

    /// Durably records, for each lane, that every record of it below the offset was
    /// acknowledged; all or nothing.
    fn store(&self, cursors: Vec<(LaneKey, u64)>) -> impl Future<Output = Result<(), String>> + Send;

    /// Durably lowers, for each lane, a stored cursor above the offset to it (one at or
    /// below it is left); all or nothing. Blocking: called once at start, before the
    /// router runs.
    fn lower(&self, cursors: Vec<(LaneKey, u64)>) -> Result<(), String>;

    /// Durably deletes, for each lane, a stored cursor at or below the offset (one above
    /// it, stored meanwhile, is kept); all or nothing. Blocking: called once at start,
    /// for cursors the log's start has passed.
    fn forget(&self, cursors: Vec<(LaneKey, u64)>) -> Result<(), String>;

    /// The log may be released below this offset at most, whatever the cursors say
    /// (default: no bound).
    fn release_ceiling(&self) -> u64 {
        u64::MAX
    }

    /// Why the release ceiling stands still, while a failure holds it (the daemon's
    /// idempotency checkpoints failing); `None` while nothing does. The router is
    /// Degraded meanwhile: the log fills though every destination delivers.
    fn release_held_by(&self) -> Option<String> {
        None
    }
}

/// One source's stored cursors as the router found them at start (none above the log's
/// next offset), by stream and topic: a record of that source below its own destination's
/// cursor here was delivered there before the restart. Which destinations the cap admits
/// can change across a restart, so a record can be refused now that was delivered then:
/// the dispatcher passes over it (neither counted, held, dropped nor dead-lettered), and
/// the dead-letter lane does not send it again. A destination's own lane needs no such
/// view: its cursor speaks for every record bound there.
#[derive(Debug, Default)]
pub(crate) struct DeliveredAtStart(HashMap<String, HashMap<String, u64>>);

impl DeliveredAtStart {
    /// The cursors of `source`'s lanes among `cursors` (every stored cursor at start).
    pub(crate) fn of_source(cursors: &HashMap<LaneKey, u64>, source: &str) -> DeliveredAtStart {
        let mut by_stream: HashMap<String, HashMap<String, u64>> = HashMap::new();
        for (lane, below) in cursors.iter().filter(|(lane, _)| lane.source == source) {
            by_stream
                .entry(lane.destination.stream.clone())
                .or_default()
                .insert(lane.destination.topic.clone(), *below);
        }
        DeliveredAtStart(by_stream)
    }

    /// True if the record at `offset`, bound for `stream`/`topic`, lies below that
    /// destination's cursor at start: delivered there before the restart.
    pub(crate) fn delivered(&self, offset: u64, stream: &str, topic: &str) -> bool {
        self.0.get(stream).and_then(|topics| topics.get(topic)).is_some_and(|&below| offset < below)
    }
}

/// Checkpoints failing in a row before the daemon's store says they hold the log's
/// release (the router is then Degraded, if the ceiling is what holds it).
pub const CHECKPOINT_FAILURES_HOLDING: u32 = 3;

/// Cursors in the daemon's state database: one durable redb transaction per store.
pub struct StateCursorStore {
    state: Arc<StateDb>,
    /// The idempotency index, whose durable checkpoint
    /// ([`ingest::IdempotencyIndex::durable_through`]) is the release ceiling: the keys
    /// of every record below it are durable in the state database. A record above it may
    /// still need the log to rebuild its key after a crash, so it is not released before.
    idempotency: Option<Arc<ingest::IdempotencyIndex>>,
}

impl std::fmt::Debug for StateCursorStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateCursorStore").finish_non_exhaustive()
    }
}

impl StateCursorStore {
    pub fn new(state: Arc<StateDb>) -> StateCursorStore {
        StateCursorStore { state, idempotency: None }
    }

    /// Releases of the log wait for the idempotency index's checkpoints.
    pub fn with_idempotency(mut self, index: Arc<ingest::IdempotencyIndex>) -> StateCursorStore {
        self.idempotency = Some(index);
        self
    }
}

impl CursorStore for StateCursorStore {
    fn load(&self) -> Result<HashMap<LaneKey, u64>, String> {
        let rows = self.state.load_cursors().map_err(|e| e.to_string())?;
        Ok(rows
            .into_iter()
            .map(|r| {
                (LaneKey { source: r.source, destination: DestinationKey::new(r.stream, r.topic) }, r.delivered_below)
            })
            .collect())
    }

    async fn store(&self, cursors: Vec<(LaneKey, u64)>) -> Result<(), String> {
        let rows = rows(cursors);
        let state = self.state.clone();
        let started = std::time::Instant::now();
        let result = match tokio::task::spawn_blocking(move || state.store_cursors(&rows)).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(e) => Err(format!("cursor commit task failed: {e}")),
        };
        if result.is_ok() {
            metrics::histogram!("iggy_connector_cursor_commit_seconds").record(started.elapsed().as_secs_f64());
        }
        result
    }

    fn lower(&self, cursors: Vec<(LaneKey, u64)>) -> Result<(), String> {
        self.state.lower_cursors(&rows(cursors)).map_err(|e| e.to_string())
    }

    fn forget(&self, cursors: Vec<(LaneKey, u64)>) -> Result<(), String> {
        self.state.forget_cursors(&rows(cursors)).map_err(|e| e.to_string())
    }

    fn release_ceiling(&self) -> u64 {
        self.idempotency.as_ref().map_or(u64::MAX, |i| i.durable_through().load(std::sync::atomic::Ordering::Acquire))
    }

    fn release_held_by(&self) -> Option<String> {
        checkpoints_holding(self.idempotency.as_ref()?.checkpoint_failure())
    }
}

/// What failing checkpoints say of the release: nothing until
/// [`CHECKPOINT_FAILURES_HOLDING`] in a row (one failure is a checkpoint late by an
/// interval), then the last error. The count stays out of the text, which is the
/// router's status reason: it changes when the error does, not with every failure.
fn checkpoints_holding(failure: Option<ingest::idempotency::CheckpointFailure>) -> Option<String> {
    let failure = failure.filter(|f| f.in_a_row >= CHECKPOINT_FAILURES_HOLDING)?;
    Some(format!("idempotency checkpoints fail: {}", failure.error))
}

fn rows(cursors: Vec<(LaneKey, u64)>) -> Vec<CursorRow> {
    cursors
        .into_iter()
        .map(|(lane, below)| CursorRow {
            source: lane.source,
            stream: lane.destination.stream,
            topic: lane.destination.topic,
            delivered_below: below,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use ingest::idempotency::CheckpointFailure;

    #[test]
    fn checkpoints_hold_the_release_from_the_third_failure_in_a_row_with_a_steady_text() {
        let failed = |in_a_row| Some(CheckpointFailure { in_a_row, error: "disk I/O error".into() });
        assert_eq!(checkpoints_holding(None), None);
        assert_eq!(checkpoints_holding(failed(1)), None);
        assert_eq!(checkpoints_holding(failed(2)), None);
        let third = checkpoints_holding(failed(3));
        assert_eq!(third.as_deref(), Some("idempotency checkpoints fail: disk I/O error"));
        assert_eq!(checkpoints_holding(failed(40)), third, "the text does not move with the count");
    }
}
