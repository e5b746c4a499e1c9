//! The daemon's accepting state, shared by both listeners' `/health` and the door.
//!
//! Invariants:
//! - Once draining, always draining (until the process exits); once refusing, always
//!   refusing, and refusing implies draining. A stop first drains (`/health` 503, so a
//!   load balancer sends new traffic elsewhere, while the requests that still arrive
//!   are served), and only after `shutdown.drain_delay_ms` refuses new requests (503
//!   `shutting_down`) as the listener closes.
//! - Once the log stopped taking appends (closed, or poisoned after a storage failure it
//!   could not undo or an interval sync that failed), health stays 503: only a restart (which recovers the log) clears
//!   it, so a load balancer sends traffic elsewhere instead of into 503s. Health asks
//!   the log itself ([`Health::watch_log`]), so it says so before any request fails,
//!   also when the failure came from a background sync.
//! - While the log cannot create its next segment (or seal its full one), health is 503
//!   too (`log_unavailable`, the code every append then gets); it turns 200 again by
//!   itself once the log's writer, which keeps trying, has rolled over.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

#[derive(Debug, Default)]
pub struct Health {
    draining: AtomicBool,
    refusing: AtomicBool,
    /// The log whose state health reports (none in tests of the door alone).
    log: OnceLock<Arc<wal::Wal>>,
}

/// What `/health` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HealthState {
    Accepting,
    Draining,
    LogStopped,
    LogUnavailable,
    /// The log's writer has been in one write, sync or segment change for
    /// [`LOG_STALLED_AFTER`] or more: a disk that stopped answering, every append
    /// waiting behind it.
    LogStalled,
}

/// How long the log's writer may be in one piece of work before health calls the log
/// stalled. A sync takes milliseconds, a group's writes and sync on a busy disk well
/// under a second: ten seconds is a disk that stopped answering, not a slow one, and
/// long enough that a load balancer is never told to leave over one slow sync.
pub const LOG_STALLED_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

impl HealthState {
    pub fn as_str(self) -> &'static str {
        match self {
            HealthState::Accepting => "accepting",
            HealthState::Draining => "draining",
            HealthState::LogStopped => "log_stopped",
            HealthState::LogUnavailable => "log_unavailable",
            HealthState::LogStalled => "log_stalled",
        }
    }

    pub fn is_accepting(self) -> bool {
        self == HealthState::Accepting
    }
}

impl Health {
    /// `/health` answers 503 from now on; event requests are still served.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Event requests are refused (503 `shutting_down`) from now on, and `/health`
    /// answers 503.
    pub fn stop_accepting(&self) {
        self.draining.store(true, Ordering::Release);
        self.refusing.store(true, Ordering::Release);
    }

    pub fn is_refusing(&self) -> bool {
        self.refusing.load(Ordering::Acquire)
    }

    /// Health follows `wal` from now on: once it takes no more appends, health is 503.
    pub fn watch_log(&self, wal: Arc<wal::Wal>) {
        let _ = self.log.set(wal);
    }

    pub fn state(&self) -> HealthState {
        if self.is_draining() {
            return HealthState::Draining;
        }
        match self.log.get() {
            Some(wal) if !wal.accepts_appends() => HealthState::LogStopped,
            Some(wal) if wal.awaits_segment() => HealthState::LogUnavailable,
            Some(wal) if wal.writer_busy_for().is_some_and(|d| d >= LOG_STALLED_AFTER) => HealthState::LogStalled,
            _ => HealthState::Accepting,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stop drains first: health says so while requests are still served; refusing
    /// comes after, and implies draining. Neither goes back.
    #[test]
    fn a_stop_drains_before_it_refuses_and_neither_goes_back() {
        let health = Health::default();
        assert_eq!((health.state(), health.is_refusing()), (HealthState::Accepting, false));
        health.start_draining();
        assert_eq!((health.state(), health.is_refusing()), (HealthState::Draining, false));
        health.stop_accepting();
        assert_eq!((health.state(), health.is_refusing()), (HealthState::Draining, true));
        health.start_draining();
        assert!(health.is_refusing(), "draining again took the refusal back");
        let refusing_at_once = Health::default();
        refusing_at_once.stop_accepting();
        assert_eq!(refusing_at_once.state(), HealthState::Draining, "refusing without draining");
    }
}
