//! A per-destination circuit breaker: closed, open for a cool-down after
//! `failure_threshold` consecutive failures, then half-open for exactly one probe.
//!
//! Invariants:
//! - Only failures that belong to the destination are recorded here (the caller filters
//!   client-wide failures out), so a broker outage opens no breaker.
//! - An open breaker never drops anything: it only says "not now"; the caller holds.
//! - Half-open admits one probe; its success closes the breaker, its failure reopens it
//!   for a full cool-down.

use tokio::time::{Duration, Instant};

use crate::policy::BreakerPolicy;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open { until: Instant },
    HalfOpen,
}

impl BreakerState {
    /// The state as of `now`: an open breaker whose cool-down has ended is half-open,
    /// whether or not the lane has come back to it yet (it may be waiting for a send
    /// slot, or for the leave to read its batch back): the next try is its probe.
    pub fn at(self, now: Instant) -> BreakerState {
        match self {
            BreakerState::Open { until } if now >= until => BreakerState::HalfOpen,
            state => state,
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open { .. } => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

#[derive(Debug, Clone)]
pub struct Breaker {
    policy: BreakerPolicy,
    state: BreakerState,
    consecutive_failures: u32,
}

impl Breaker {
    pub fn new(policy: BreakerPolicy) -> Breaker {
        Breaker { policy, state: BreakerState::Closed, consecutive_failures: 0 }
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// How long to wait before a send may go out; zero if it may go now. Moves an open
    /// breaker whose cool-down ended to half-open.
    pub fn wait(&mut self, now: Instant) -> Duration {
        match self.state {
            BreakerState::Open { until } if now < until => until - now,
            BreakerState::Open { .. } => {
                self.state = BreakerState::HalfOpen;
                Duration::ZERO
            }
            _ => Duration::ZERO,
        }
    }

    pub fn on_success(&mut self) {
        self.state = BreakerState::Closed;
        self.consecutive_failures = 0;
    }

    /// Records a failure that belongs to the destination. Returns true if this opened
    /// the breaker.
    pub fn on_failure(&mut self, now: Instant) -> bool {
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        let open = match self.state {
            BreakerState::HalfOpen => true,
            BreakerState::Closed => self.consecutive_failures >= self.policy.failure_threshold,
            BreakerState::Open { .. } => false,
        };
        if open {
            self.state = BreakerState::Open { until: now + self.policy.cool_down };
        }
        open
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> BreakerPolicy {
        BreakerPolicy { failure_threshold: 3, cool_down: Duration::from_secs(10) }
    }

    #[test]
    fn opens_after_the_threshold_holds_for_the_cool_down_then_probes_once() {
        let t0 = Instant::now();
        let mut b = Breaker::new(policy());
        assert!(!b.on_failure(t0));
        assert!(!b.on_failure(t0));
        assert_eq!(b.wait(t0), Duration::ZERO);
        assert!(b.on_failure(t0));
        assert_eq!(b.wait(t0 + Duration::from_secs(4)), Duration::from_secs(6));
        assert_eq!(b.wait(t0 + Duration::from_secs(10)), Duration::ZERO);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        // The probe fails: a full cool-down again.
        let t1 = t0 + Duration::from_secs(11);
        assert!(b.on_failure(t1));
        assert_eq!(b.wait(t1), Duration::from_secs(10));
        // The next probe succeeds: closed, and the count starts over.
        assert_eq!(b.wait(t1 + Duration::from_secs(10)), Duration::ZERO);
        b.on_success();
        assert_eq!(b.state(), BreakerState::Closed);
        assert!(!b.on_failure(t1));
    }

    /// What a lane's status shows of a breaker it left open while it waits elsewhere (for
    /// a send slot, for the leave to read its batch back): half-open from the end of the
    /// cool-down, as the lane's next try will find it.
    #[test]
    fn an_open_breaker_reads_half_open_from_the_end_of_its_cool_down() {
        let t0 = Instant::now();
        let mut b = Breaker::new(policy());
        for _ in 0..3 {
            b.on_failure(t0);
        }
        let open = b.state();
        assert_eq!(open.at(t0 + Duration::from_secs(9)).as_str(), "open");
        assert_eq!(open.at(t0 + Duration::from_secs(10)), BreakerState::HalfOpen);
        assert_eq!(BreakerState::Closed.at(t0 + Duration::from_secs(60)), BreakerState::Closed);
    }

    #[test]
    fn a_success_resets_the_count() {
        let t0 = Instant::now();
        let mut b = Breaker::new(policy());
        b.on_failure(t0);
        b.on_failure(t0);
        b.on_success();
        assert!(!b.on_failure(t0));
        assert!(!b.on_failure(t0));
        assert_eq!(b.state(), BreakerState::Closed);
    }
}
