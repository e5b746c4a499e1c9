//! One status model for the router and each destination, and the only function that
//! moves a status: [`StatusCell::set`]. It moves the status gauges in the same step,
//! under the same lock, so a status and its gauges can never disagree.
//!
//! Invariants:
//! - Every transition is logged with its reason and recorded with its time; the reason
//!   shown is always the latest one given for the current status.
//! - A gauge `iggy_connector_{kind}_{status}` counts the cells of that kind in that
//!   status; each cell is counted in exactly one status at a time.
//! - A task that ends sets Stopped (or Error) itself; nothing reports Running for a task
//!   that is gone.

use std::sync::Mutex;
use std::time::SystemTime;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Status {
    Starting,
    Running,
    /// Still retrying, not progressing.
    Degraded,
    Error,
    Stopping,
    Stopped,
}

impl Status {
    pub const ALL: [Status; 6] =
        [Status::Starting, Status::Running, Status::Degraded, Status::Error, Status::Stopping, Status::Stopped];

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Starting => "starting",
            Status::Running => "running",
            Status::Degraded => "degraded",
            Status::Error => "error",
            Status::Stopping => "stopping",
            Status::Stopped => "stopped",
        }
    }
}

/// A point-in-time copy of a cell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusSnapshot {
    pub status: Status,
    pub since: SystemTime,
    pub reason: String,
    pub last_error: Option<(String, SystemTime)>,
}

#[derive(Debug)]
pub struct StatusCell {
    /// `router` or `destinations`: the gauge family.
    kind: &'static str,
    /// For logs only (a destination's name never becomes a metric label).
    name: String,
    inner: Mutex<StatusSnapshot>,
}

fn gauge_name(kind: &str, status: Status) -> String {
    format!("iggy_connector_{kind}_{}", status.as_str())
}

impl StatusCell {
    /// A new cell in `Starting`, counted in its gauge.
    pub fn new(kind: &'static str, name: impl Into<String>) -> StatusCell {
        metrics::gauge!(gauge_name(kind, Status::Starting)).increment(1.0);
        StatusCell {
            kind,
            name: name.into(),
            inner: Mutex::new(StatusSnapshot {
                status: Status::Starting,
                since: SystemTime::now(),
                reason: "created".into(),
                last_error: None,
            }),
        }
    }

    /// Moves the status (if it changes) and its gauges together, and logs the reason. A
    /// new reason for the same status replaces the old one (the status keeps its
    /// `since`): a reason is what holds now, never what held when the status began.
    pub fn set(&self, to: Status, reason: &str) {
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if s.status == to {
            if s.reason != reason {
                tracing::debug!(kind = self.kind, name = %self.name, status = to.as_str(), reason, "status reason");
                s.reason = reason.to_string();
            }
            return;
        }
        metrics::gauge!(gauge_name(self.kind, s.status)).decrement(1.0);
        metrics::gauge!(gauge_name(self.kind, to)).increment(1.0);
        tracing::info!(kind = self.kind, name = %self.name, from = s.status.as_str(), to = to.as_str(), reason, "status");
        s.status = to;
        s.since = SystemTime::now();
        s.reason = reason.to_string();
    }

    /// Replaces the reason, keeping the status and its `since`, if the status is one of
    /// `while_in`: a lane retrying before it is Degraded says so, rather than keeping the
    /// reason of its last success, and never overwrites a worse status's reason.
    pub fn set_reason_while(&self, while_in: &[Status], reason: &str) {
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if while_in.contains(&s.status) && s.reason != reason {
            s.reason = reason.to_string();
        }
    }

    /// Records an error without changing the status.
    pub fn record_error(&self, error: &str) {
        let mut s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        s.last_error = Some((error.to_string(), SystemTime::now()));
    }

    pub fn get(&self) -> Status {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).status
    }

    pub fn snapshot(&self) -> StatusSnapshot {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for StatusCell {
    fn drop(&mut self) {
        let s = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        metrics::gauge!(gauge_name(self.kind, s.status)).decrement(1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_reason_for_the_same_status_replaces_the_old_and_keeps_since() {
        let cell = StatusCell::new("test_status_cell", "x");
        cell.set(Status::Degraded, "destination a is degraded");
        let first = cell.snapshot();
        std::thread::sleep(std::time::Duration::from_millis(5));
        cell.set(Status::Degraded, "destination b is degraded");
        let now = cell.snapshot();
        assert_eq!((now.status, now.reason.as_str()), (Status::Degraded, "destination b is degraded"));
        assert_eq!(now.since, first.since, "the status did not change");
        cell.set(Status::Running, "recovered");
        assert!(cell.snapshot().since > first.since);
    }
}
