//! Test doubles for the router's own tests and other crates' (feature `test-doubles`):
//! never built into the daemon, never standing in for the durable [`StateCursorStore`].
//!
//! [`StateCursorStore`]: crate::StateCursorStore

use std::collections::HashMap;
use std::sync::Mutex;

use crate::cursors::CursorStore;
use crate::sink::LaneKey;

/// Cursors kept in memory only: a test double, never durable.
#[derive(Debug)]
pub struct MemoryCursorStore {
    cursors: Mutex<HashMap<LaneKey, u64>>,
    commits: Mutex<u64>,
    release_ceiling: std::sync::atomic::AtomicU64,
    release_held_by: Mutex<Option<String>>,
}

impl Default for MemoryCursorStore {
    fn default() -> MemoryCursorStore {
        MemoryCursorStore {
            cursors: Mutex::default(),
            commits: Mutex::default(),
            release_ceiling: std::sync::atomic::AtomicU64::new(u64::MAX),
            release_held_by: Mutex::new(None),
        }
    }
}

impl MemoryCursorStore {
    pub fn new() -> MemoryCursorStore {
        MemoryCursorStore::default()
    }

    /// What [`CursorStore::release_ceiling`] answers from now on (no bound at first).
    pub fn set_release_ceiling(&self, below: u64) {
        self.release_ceiling.store(below, std::sync::atomic::Ordering::Release);
    }

    /// What [`CursorStore::release_held_by`] answers from now on.
    pub fn set_release_held_by(&self, why: Option<&str>) {
        *self.release_held_by.lock().unwrap_or_else(|p| p.into_inner()) = why.map(str::to_string);
    }

    pub fn get(&self, lane: &LaneKey) -> Option<u64> {
        self.cursors.lock().unwrap_or_else(|p| p.into_inner()).get(lane).copied()
    }

    /// How many times `store` was called.
    pub fn commits(&self) -> u64 {
        *self.commits.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl CursorStore for MemoryCursorStore {
    fn load(&self) -> Result<HashMap<LaneKey, u64>, String> {
        Ok(self.cursors.lock().unwrap_or_else(|p| p.into_inner()).clone())
    }

    async fn store(&self, cursors: Vec<(LaneKey, u64)>) -> Result<(), String> {
        *self.commits.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        let mut c = self.cursors.lock().unwrap_or_else(|p| p.into_inner());
        for (lane, below) in cursors {
            let v = c.entry(lane).or_insert(0);
            *v = (*v).max(below);
        }
        Ok(())
    }

    fn release_ceiling(&self) -> u64 {
        self.release_ceiling.load(std::sync::atomic::Ordering::Acquire)
    }

    fn release_held_by(&self) -> Option<String> {
        self.release_held_by.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn lower(&self, cursors: Vec<(LaneKey, u64)>) -> Result<(), String> {
        *self.commits.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        let mut c = self.cursors.lock().unwrap_or_else(|p| p.into_inner());
        for (lane, below) in cursors {
            if let Some(v) = c.get_mut(&lane) {
                *v = (*v).min(below);
            }
        }
        Ok(())
    }

    fn forget(&self, cursors: Vec<(LaneKey, u64)>) -> Result<(), String> {
        *self.commits.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        let mut c = self.cursors.lock().unwrap_or_else(|p| p.into_inner());
        for (lane, at_most) in cursors {
            if c.get(&lane).is_some_and(|v| *v <= at_most) {
                c.remove(&lane);
            }
        }
        Ok(())
    }
}
