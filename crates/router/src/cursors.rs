//! Durable per-lane cursors: for each (source, destination), the offset below which
//! every record of that source bound for that destination was acknowledged.
//!
//! Invariants:
//! - `store` returns only once the cursor is durable; the log is released below a
//!   destination's records only after that.
//! - A cursor never moves backwards (the router only stores larger values).

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;

use crate::sink::LaneKey;

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
