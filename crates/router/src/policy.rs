//! The router's knobs, with the defaults an operator gets and why.
//!
//! Invariant: every limit is finite and validated (`RouterPolicy::validate`): a batch,
//! a lane's queue, the number of lanes and the number of sends in flight are all bounded,
//! so memory is bounded no matter how long a destination stays down.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crate::sink::DestinationKey;

/// How records are batched and retried, per destination.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPolicy {
    /// Records per send. 1000 amortises a round trip without making a retry expensive.
    pub batch_max_records: usize,
    /// Payload bytes per send (a single larger record is sent alone). 1 MiB.
    pub batch_max_bytes: usize,
    /// How long a lane waits for more records before sending a short batch; a batch that
    /// fills meanwhile goes at once. 5 ms: far below any human-visible delay, long enough
    /// to batch a burst.
    pub linger: Duration,
    /// A send not answered within this time counts as a failure (and is retried: the
    /// message ids make a duplicate identifiable). 10 s.
    pub result_timeout: Duration,
    /// First retry delay; doubles per consecutive failure. 100 ms.
    pub backoff_base: Duration,
    /// The retry delay never exceeds this. 30 s: an outage is noticed within half a
    /// minute of its end.
    pub backoff_max: Duration,
    /// Consecutive failures after which a destination (and the router) is Degraded. 5.
    pub degraded_after_failures: u32,
}

impl Default for BatchPolicy {
    fn default() -> Self {
        BatchPolicy {
            batch_max_records: 1000,
            batch_max_bytes: 1024 * 1024,
            linger: Duration::from_millis(5),
            result_timeout: Duration::from_secs(10),
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_secs(30),
            degraded_after_failures: 5,
        }
    }
}

/// Per-destination circuit breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerPolicy {
    /// Consecutive send failures of one destination that open its breaker. 5.
    pub failure_threshold: u32,
    /// How long an open breaker holds before one probe is let through. 30 s.
    pub cool_down: Duration,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        BreakerPolicy { failure_threshold: 5, cool_down: Duration::from_secs(30) }
    }
}

/// What happens to a record the router cannot admit (cap reached, partition id out of
/// range). The default is `Error`: after a 200, a drop is a loss, and only an operator
/// may choose it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnAdmissionFailure {
    /// Hold the record in the log and retry; the log's space stays pinned below it.
    Error,
    /// Drop it, counted and logged.
    Drop,
    /// Send it to the dead-letter destination with the reason in a header.
    DeadLetter,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterPolicy {
    pub batch: BatchPolicy,
    pub breaker: BreakerPolicy,
    /// The most destinations one source's records go to (per source). 1000.
    pub max_destinations: usize,
    /// The most sends in flight at once, over one source's destinations. 16.
    pub max_concurrent_destinations: usize,
    pub on_admission_failure: OnAdmissionFailure,
    /// Where `DeadLetter` sends; required when it is chosen.
    pub dead_letter: Option<DestinationKey>,
    /// Records a destination may hold in memory before it re-reads from the log
    /// instead. 4096.
    pub lane_queue_max_records: usize,
    /// How long the dispatcher waits for room in the full queue of a healthy
    /// destination before letting it overflow to the log. 100 ms: a busy destination
    /// keeps its records in memory, a stuck one (failing, or slower than this for
    /// good) re-reads them later; a wait never happens for a failing destination.
    pub overflow_after: Duration,
}

/// The policy of each source, and the dispatcher's own read sizes.
#[derive(Debug, Clone)]
pub struct Policies {
    /// For sources without a policy of their own (including sources no longer
    /// configured whose records are still in the log).
    pub default: Arc<RouterPolicy>,
    pub sources: HashMap<String, Arc<RouterPolicy>>,
    /// Records the dispatcher reads from the log per step. 4096.
    pub read_batch_max_records: usize,
    /// Bytes the dispatcher reads from the log per step. 4 MiB.
    pub read_batch_max_bytes: usize,
}

impl Policies {
    /// One policy for every source.
    pub fn uniform(policy: RouterPolicy) -> Policies {
        Policies {
            default: Arc::new(policy),
            sources: HashMap::new(),
            read_batch_max_records: 4096,
            read_batch_max_bytes: 4 * 1024 * 1024,
        }
    }

    pub fn for_source(&self, source: &str) -> Arc<RouterPolicy> {
        self.sources.get(source).unwrap_or(&self.default).clone()
    }

    /// Checks every policy; the error names the source.
    pub fn validate(&self) -> Result<(), String> {
        self.default.validate().map_err(|e| format!("default policy: {e}"))?;
        for (k, p) in &self.sources {
            p.validate().map_err(|e| format!("source {k}: {e}"))?;
        }
        if self.read_batch_max_records == 0 || self.read_batch_max_bytes == 0 {
            return Err("read_batch_max_records and read_batch_max_bytes must be at least 1".into());
        }
        Ok(())
    }
}

impl Default for RouterPolicy {
    fn default() -> Self {
        RouterPolicy {
            batch: BatchPolicy::default(),
            breaker: BreakerPolicy::default(),
            max_destinations: 1000,
            max_concurrent_destinations: 16,
            on_admission_failure: OnAdmissionFailure::Error,
            dead_letter: None,
            lane_queue_max_records: 4096,
            overflow_after: Duration::from_millis(100),
        }
    }
}

impl RouterPolicy {
    /// Checks the policy; the error names the field.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("batch_max_records", self.batch.batch_max_records),
            ("batch_max_bytes", self.batch.batch_max_bytes),
            ("max_destinations", self.max_destinations),
            ("max_concurrent_destinations", self.max_concurrent_destinations),
            ("lane_queue_max_records", self.lane_queue_max_records),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        if self.breaker.failure_threshold == 0 {
            return Err("failure_threshold must be at least 1".into());
        }
        if self.batch.degraded_after_failures == 0 {
            return Err("degraded_after_failures must be at least 1".into());
        }
        if self.batch.backoff_base.is_zero() || self.batch.backoff_max < self.batch.backoff_base {
            return Err("backoff_max must be at least backoff_base, and backoff_base above zero".into());
        }
        if self.batch.result_timeout.is_zero() {
            return Err("result_timeout must be above zero".into());
        }
        if self.on_admission_failure == OnAdmissionFailure::DeadLetter && self.dead_letter.is_none() {
            return Err("dead_letter is required when on_admission_failure = \"dead_letter\"".into());
        }
        Ok(())
    }

    /// The delay before retry number `failures` (1 = the first retry).
    pub fn backoff(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(30);
        self.batch.backoff_base.saturating_mul(1u32 << exp).min(self.batch.backoff_max)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_is_capped() {
        let p = RouterPolicy::default();
        assert_eq!(p.backoff(1), Duration::from_millis(100));
        assert_eq!(p.backoff(2), Duration::from_millis(200));
        assert_eq!(p.backoff(4), Duration::from_millis(800));
        assert_eq!(p.backoff(20), Duration::from_secs(30));
        assert_eq!(p.backoff(u32::MAX), Duration::from_secs(30));
    }

    #[test]
    fn dead_letter_needs_a_destination() {
        let p = RouterPolicy { on_admission_failure: OnAdmissionFailure::DeadLetter, ..RouterPolicy::default() };
        assert!(p.validate().unwrap_err().contains("dead_letter"));
        assert!(RouterPolicy::default().validate().is_ok());
    }
}
