//! Durable per-lane cursors: for each (source, destination), the offset below which
//! every record of that source bound for that destination was acknowledged.
//!
//! Invariants:
//! - `store` returns only once the cursor is durable; the log is released below a
//!   destination's records only after that.
//! - A cursor never moves backwards (the router only stores larger values).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use ingest::{CursorRow, StateDb};
use tokio::sync::{mpsc, oneshot};

use crate::sink::{DestinationKey, LaneKey};

pub trait CursorStore: Send + Sync + 'static {
    /// Every stored cursor.
    fn load(&self) -> Result<HashMap<LaneKey, u64>, String>;

    /// Durably records that every record of lane `dest` below `delivered_below` was acked.
    fn store(&self, dest: &LaneKey, delivered_below: u64) -> impl Future<Output = Result<(), String>> + Send;
}

/// Cursors kept in memory only: a test double, and the store for a daemon that was
/// told to keep no state. Never durable.
#[derive(Debug, Default)]
pub struct MemoryCursorStore {
    cursors: Mutex<HashMap<LaneKey, u64>>,
}

impl MemoryCursorStore {
    pub fn new() -> MemoryCursorStore {
        MemoryCursorStore::default()
    }

    pub fn get(&self, dest: &LaneKey) -> Option<u64> {
        self.cursors.lock().unwrap_or_else(|p| p.into_inner()).get(dest).copied()
    }
}

impl CursorStore for MemoryCursorStore {
    fn load(&self) -> Result<HashMap<LaneKey, u64>, String> {
        Ok(self.cursors.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }

    async fn store(&self, dest: &LaneKey, delivered_below: u64) -> Result<(), String> {
        let mut c = self.cursors.lock().unwrap_or_else(|p| p.into_inner());
        let v = c.entry(dest.clone()).or_insert(0);
        *v = (*v).max(delivered_below);
        Ok(())
    }
}

/// Cursors in the daemon's state database, group-committed: every cursor stored while
/// the previous commit ran goes into the next one, so many lanes share one durable
/// commit. Each lane has at most one store in flight, so the queue is bounded by the
/// number of lanes.
pub struct StateCursorStore {
    state: Arc<StateDb>,
    queue: mpsc::UnboundedSender<(CursorRow, oneshot::Sender<Result<(), String>>)>,
}

impl std::fmt::Debug for StateCursorStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateCursorStore").finish_non_exhaustive()
    }
}

impl StateCursorStore {
    /// Starts the committer task; call inside a tokio runtime.
    pub fn new(state: Arc<StateDb>) -> StateCursorStore {
        let (queue, mut rx) = mpsc::unbounded_channel::<(CursorRow, oneshot::Sender<Result<(), String>>)>();
        let db = state.clone();
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut group = vec![first];
                while let Ok(more) = rx.try_recv() {
                    group.push(more);
                }
                let rows: Vec<CursorRow> = group.iter().map(|(r, _)| r.clone()).collect();
                let db = db.clone();
                let started = std::time::Instant::now();
                let result = match tokio::task::spawn_blocking(move || db.store_cursors(&rows)).await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(e) => Err(format!("cursor commit task failed: {e}")),
                };
                metrics::histogram!("iggy_connector_cursor_commit_seconds").record(started.elapsed().as_secs_f64());
                for (_, reply) in group {
                    let _ = reply.send(result.clone());
                }
            }
        });
        StateCursorStore { state, queue }
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

    async fn store(&self, dest: &LaneKey, delivered_below: u64) -> Result<(), String> {
        let row = CursorRow {
            source: dest.source.clone(),
            stream: dest.destination.stream.clone(),
            topic: dest.destination.topic.clone(),
            delivered_below,
        };
        let (reply, rx) = oneshot::channel();
        self.queue.send((row, reply)).map_err(|_| "cursor committer stopped".to_string())?;
        rx.await.map_err(|_| "cursor committer stopped".to_string())?
    }
}
