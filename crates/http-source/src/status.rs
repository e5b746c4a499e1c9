//! Per-source counters and last error, for the admin `/status` answer.
//!
//! Invariants:
//! - Counters only grow; `last_error` is replaced, never cleared, and carries its time.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::Serialize;

#[derive(Debug, Default)]
pub struct SourceStatus {
    accepted_requests: AtomicU64,
    accepted_events: AtomicU64,
    replayed_requests: AtomicU64,
    rejected_requests: AtomicU64,
    last_error: Mutex<Option<LastError>>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct LastError {
    pub code: String,
    pub message: String,
    pub at_unix_ms: u64,
}

/// A snapshot for serialization.
#[derive(Debug, Clone, Serialize)]
pub struct SourceStatusView {
    pub accepted_requests: u64,
    pub accepted_events: u64,
    pub replayed_requests: u64,
    pub rejected_requests: u64,
    pub last_error: Option<LastError>,
}

impl SourceStatus {
    pub fn accepted(&self, events: u64, replayed: bool) {
        self.accepted_requests.fetch_add(1, Ordering::Relaxed);
        if replayed {
            self.replayed_requests.fetch_add(1, Ordering::Relaxed);
        } else {
            self.accepted_events.fetch_add(events, Ordering::Relaxed);
        }
    }

    pub fn rejected(&self, code: &str, message: &str, at_unix_ms: u64) {
        self.rejected_requests.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last_error.lock().unwrap_or_else(|p| p.into_inner());
        *last = Some(LastError { code: code.to_string(), message: message.to_string(), at_unix_ms });
    }

    pub fn view(&self) -> SourceStatusView {
        SourceStatusView {
            accepted_requests: self.accepted_requests.load(Ordering::Relaxed),
            accepted_events: self.accepted_events.load(Ordering::Relaxed),
            replayed_requests: self.replayed_requests.load(Ordering::Relaxed),
            rejected_requests: self.rejected_requests.load(Ordering::Relaxed),
            last_error: self.last_error.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }
}

/// Status of every configured source, by key.
#[derive(Debug, Default)]
pub struct StatusBoard {
    pub sources: BTreeMap<String, Arc<SourceStatus>>,
}

impl StatusBoard {
    pub fn new(keys: impl IntoIterator<Item = String>) -> StatusBoard {
        StatusBoard { sources: keys.into_iter().map(|k| (k, Arc::default())).collect() }
    }

    /// Source `key`'s status, shared as [`crate::metrics::DoorMetrics::source`] is.
    pub fn get(&self, key: &str) -> Option<&Arc<SourceStatus>> {
        self.sources.get(key)
    }
}
