//! The router's knobs, with the defaults an operator gets and why.
//!
//! Invariant: every limit is validated (`RouterPolicy::validate`, `Policies::validate`)
//! against a lower and an upper bound: a batch, a lane's queue, the number of lanes, the
//! number of sends in flight and every duration. So memory is bounded no matter how long
//! a destination stays down, and no value that passes validation can break a task at run
//! time (a semaphore over its permits, a deadline past the clock's range): such a panic
//! would end the task while the router kept reporting on it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use crate::sink::{DestinationKey, LaneKey};

/// The most sends in flight per source. tokio's semaphore (the source's send slots)
/// panics above `Semaphore::MAX_PERMITS`; and each send in flight holds a connection of
/// its own to the server (the sink takes one per call), so this also bounds a source's
/// connections: past a few thousand a process runs out of file descriptors long before
/// it delivers any faster. 4096 is far above any useful setting (the default is 16).
pub const MAX_CONCURRENT_DESTINATIONS: usize = 4096;

/// The most destinations per source. Each is a lane (a task, a queue, a status and a
/// cursor); the cap guards against a runaway route, and 100 000 is two orders of
/// magnitude above the default.
pub const MAX_DESTINATIONS: usize = 100_000;

/// The most records per send (and per read of the log). A lane keeps up to two batches in
/// memory (one in flight, the next prepared).
pub const MAX_BATCH_RECORDS: usize = 100_000;

/// The most payload bytes per send (and per read of the log): 64 MiB, for the same
/// reason, per lane.
pub const MAX_BATCH_BYTES: usize = 64 * 1024 * 1024;

/// The most records a lane keeps in memory before it re-reads the log.
pub const MAX_LANE_QUEUE_RECORDS: usize = 1_000_000;
/// The most payload bytes one lane may keep queued in memory: 1 GiB.
pub const MAX_LANE_QUEUE_BYTES: usize = 1024 * 1024 * 1024;
/// The most bytes all lanes of the router together may keep queued: 64 GiB, a bound
/// for the machine's memory, not for a lane. (On a 32-bit target, `usize::MAX`.)
pub const MAX_QUEUES_BYTES: usize = if usize::BITS >= 64 { 64 << 30 } else { usize::MAX };

/// The longest duration of any knob: one day. Far above any useful setting, and the
/// lanes take deadlines (`now + linger`, `now + cool_down`) that would overflow the
/// clock, and panic, for a value near `u64::MAX` milliseconds.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 60 * 60);

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
    /// Bytes a destination may hold in memory before it re-reads from the log instead (a
    /// queue may pass it by the one record that reached it), each record counted with
    /// its envelope and decoded header, not by its payload alone. 8 MiB: with the
    /// record count alone, a lane stuck on a failing destination kept up to 4096 events
    /// of up to `http.max_body_bytes` each in memory for the whole outage.
    pub lane_queue_max_bytes: usize,
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
    /// Bytes every lane of every source together keeps queued in memory, counted as
    /// `lane_queue_max_bytes` counts them. 256 MiB: each lane's own bound alone let a
    /// router hold its destinations' number times that (1000 × 8 MiB per source at the
    /// defaults). A record past it is re-read from the log by its lane instead, and a
    /// Degraded lane holds none, so what takes it is destinations that deliver.
    pub queues_max_bytes: usize,
    /// (source, destination) pairs whose records are given up: dropped, counted and
    /// logged instead of delivered, so the log is released past them. An operator's
    /// decision for a destination that can never be delivered; the source need not be
    /// configured any more. Empty by default.
    pub given_up: Arc<HashSet<LaneKey>>,
}

impl Policies {
    /// One policy for every source.
    pub fn uniform(policy: RouterPolicy) -> Policies {
        Policies {
            default: Arc::new(policy),
            sources: HashMap::new(),
            read_batch_max_records: 4096,
            read_batch_max_bytes: 4 * 1024 * 1024,
            queues_max_bytes: 256 * 1024 * 1024,
            given_up: Arc::default(),
        }
    }

    /// Whether records of `source` bound for `stream`/`topic` are given up.
    pub fn is_given_up(&self, source: &str, stream: &str, topic: &str) -> bool {
        is_given_up(&self.given_up, source, stream, topic)
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
        within("read_batch_max_records", self.read_batch_max_records, MAX_BATCH_RECORDS).map_err(|p| p.to_string())?;
        within("read_batch_max_bytes", self.read_batch_max_bytes, MAX_BATCH_BYTES).map_err(|p| p.to_string())?;
        within("queues_max_bytes", self.queues_max_bytes, MAX_QUEUES_BYTES).map_err(|p| p.to_string())?;
        for (source, p) in
            std::iter::once(("default policy", &self.default)).chain(self.sources.iter().map(|(k, p)| (k.as_str(), p)))
        {
            if p.lane_queue_max_bytes > self.queues_max_bytes {
                return Err(format!(
                    "lane_queue_max_bytes of {source} ({}) is above queues_max_bytes ({}), which bounds every lane together",
                    p.lane_queue_max_bytes, self.queues_max_bytes
                ));
            }
        }
        Ok(())
    }
}

/// Whether `given_up` holds (source, stream/topic); allocates only when it holds anything.
pub(crate) fn is_given_up(given_up: &HashSet<LaneKey>, source: &str, stream: &str, topic: &str) -> bool {
    !given_up.is_empty()
        && given_up.contains(&LaneKey { source: source.to_string(), destination: DestinationKey::new(stream, topic) })
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
            lane_queue_max_bytes: 8 * 1024 * 1024,
            overflow_after: Duration::from_millis(100),
        }
    }
}

/// The policy's durations, as [`PolicyProblem::field`] names them: a configuration that
/// checks them under its own keys leaves these out.
pub const DURATION_FIELDS: [&str; 6] =
    ["linger", "result_timeout", "backoff_base", "backoff_max", "cool_down", "overflow_after"];

/// One problem of a [`RouterPolicy`]: the field it is about (as the policy names it, for
/// a configuration to map onto its own key) and what is wrong with it. Shown as the field
/// then the message: `batch_max_records must be at most 65536`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyProblem {
    pub field: &'static str,
    pub message: String,
}

impl PolicyProblem {
    fn new(field: &'static str, message: impl Into<String>) -> PolicyProblem {
        PolicyProblem { field, message: message.into() }
    }
}

impl std::fmt::Display for PolicyProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.field, self.message)
    }
}

impl RouterPolicy {
    /// Checks the policy; the error (the first of [`RouterPolicy::problems`]) names the
    /// field first.
    pub fn validate(&self) -> Result<(), String> {
        self.problems().into_iter().next().map_or(Ok(()), |p| Err(p.to_string()))
    }

    /// Every problem of the policy, with its field (a configuration check lists them all
    /// at once, each under its own key).
    pub fn problems(&self) -> Vec<PolicyProblem> {
        let mut problems = Vec::new();
        let counts = [
            ("batch_max_records", self.batch.batch_max_records, MAX_BATCH_RECORDS),
            ("batch_max_bytes", self.batch.batch_max_bytes, MAX_BATCH_BYTES),
            ("max_destinations", self.max_destinations, MAX_DESTINATIONS),
            ("max_concurrent_destinations", self.max_concurrent_destinations, MAX_CONCURRENT_DESTINATIONS),
            ("lane_queue_max_records", self.lane_queue_max_records, MAX_LANE_QUEUE_RECORDS),
            ("lane_queue_max_bytes", self.lane_queue_max_bytes, MAX_LANE_QUEUE_BYTES),
        ];
        for (name, v, max) in counts {
            problems.extend(within(name, v, max).err());
        }
        let durations = [
            self.batch.linger,
            self.batch.result_timeout,
            self.batch.backoff_base,
            self.batch.backoff_max,
            self.breaker.cool_down,
            self.overflow_after,
        ];
        for (name, d) in DURATION_FIELDS.into_iter().zip(durations) {
            if d > MAX_DURATION {
                problems
                    .push(PolicyProblem::new(name, format!("must be at most {} s (one day)", MAX_DURATION.as_secs())));
            }
        }
        if self.breaker.failure_threshold == 0 {
            problems.push(PolicyProblem::new("failure_threshold", "must be at least 1"));
        }
        if self.batch.degraded_after_failures == 0 {
            problems.push(PolicyProblem::new("degraded_after_failures", "must be at least 1"));
        }
        if self.batch.backoff_base.is_zero() || self.batch.backoff_max < self.batch.backoff_base {
            problems
                .push(PolicyProblem::new("backoff_max", "must be at least backoff_base, and backoff_base above zero"));
        }
        if self.batch.result_timeout.is_zero() {
            problems.push(PolicyProblem::new("result_timeout", "must be above zero"));
        }
        // A record held for a partition its topic lacks asks the topic again after each
        // cool-down: with none, that loop would not rest at all.
        if self.breaker.cool_down.is_zero() {
            problems.push(PolicyProblem::new("cool_down", "must be above zero"));
        }
        if self.on_admission_failure == OnAdmissionFailure::DeadLetter && self.dead_letter.is_none() {
            problems.push(PolicyProblem::new("dead_letter", "is required when on_admission_failure = \"dead_letter\""));
        }
        problems
    }

    /// The delay before retry number `failures` (1 = the first retry).
    pub fn backoff(&self, failures: u32) -> Duration {
        let exp = failures.saturating_sub(1).min(30);
        self.batch.backoff_base.saturating_mul(1u32 << exp).min(self.batch.backoff_max)
    }
}

/// `v` within `1..=max`, or the problem of the field `name`.
fn within(name: &'static str, v: usize, max: usize) -> Result<(), PolicyProblem> {
    if v == 0 {
        return Err(PolicyProblem::new(name, "must be at least 1"));
    }
    if v > max {
        return Err(PolicyProblem::new(name, format!("must be at most {max}")));
    }
    Ok(())
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
    fn every_count_and_duration_is_bounded_and_named() {
        let cases: Vec<(RouterPolicy, &str)> = vec![
            (
                RouterPolicy { max_concurrent_destinations: usize::MAX, ..RouterPolicy::default() },
                "max_concurrent_destinations",
            ),
            (
                RouterPolicy {
                    max_concurrent_destinations: MAX_CONCURRENT_DESTINATIONS + 1,
                    ..RouterPolicy::default()
                },
                "max_concurrent_destinations",
            ),
            (RouterPolicy { max_destinations: MAX_DESTINATIONS + 1, ..RouterPolicy::default() }, "max_destinations"),
            (
                RouterPolicy { lane_queue_max_records: MAX_LANE_QUEUE_RECORDS + 1, ..RouterPolicy::default() },
                "lane_queue_max_records",
            ),
            (
                RouterPolicy { overflow_after: MAX_DURATION + Duration::from_millis(1), ..RouterPolicy::default() },
                "overflow_after",
            ),
        ];
        let batch = |f: fn(&mut BatchPolicy), name: &'static str| {
            let mut p = RouterPolicy::default();
            f(&mut p.batch);
            (p, name)
        };
        let batches = vec![
            batch(|b| b.batch_max_records = MAX_BATCH_RECORDS + 1, "batch_max_records"),
            batch(|b| b.batch_max_bytes = MAX_BATCH_BYTES + 1, "batch_max_bytes"),
            batch(|b| b.linger = Duration::MAX, "linger"),
            batch(|b| b.result_timeout = Duration::MAX, "result_timeout"),
            batch(|b| b.backoff_max = Duration::MAX, "backoff_max"),
        ];
        let mut cool_down = RouterPolicy::default();
        cool_down.breaker.cool_down = Duration::from_millis(u64::MAX);
        let mut no_cool_down = RouterPolicy::default();
        no_cool_down.breaker.cool_down = Duration::ZERO;
        for (p, name) in cases.into_iter().chain(batches).chain([(cool_down, "cool_down"), (no_cool_down, "cool_down")])
        {
            let e = p.validate().unwrap_err();
            assert!(e.starts_with(name), "{name}: {e}");
        }
        // The bounds themselves pass.
        let mut p = RouterPolicy {
            max_concurrent_destinations: MAX_CONCURRENT_DESTINATIONS,
            max_destinations: MAX_DESTINATIONS,
            lane_queue_max_records: MAX_LANE_QUEUE_RECORDS,
            overflow_after: MAX_DURATION,
            ..RouterPolicy::default()
        };
        p.batch.batch_max_records = MAX_BATCH_RECORDS;
        p.batch.batch_max_bytes = MAX_BATCH_BYTES;
        p.batch.linger = MAX_DURATION;
        p.batch.result_timeout = MAX_DURATION;
        p.batch.backoff_max = MAX_DURATION;
        p.breaker.cool_down = MAX_DURATION;
        assert_eq!(p.validate(), Ok(()));
        let mut policies = Policies::uniform(RouterPolicy::default());
        policies.read_batch_max_bytes = MAX_BATCH_BYTES + 1;
        assert!(policies.validate().unwrap_err().starts_with("read_batch_max_bytes"));
        // One lane's queue bound above every lane's together, by default or per source.
        let mut policies = Policies::uniform(RouterPolicy::default());
        policies.queues_max_bytes = 1 << 20;
        assert!(policies.validate().unwrap_err().contains("lane_queue_max_bytes of default policy"));
        let small = RouterPolicy { lane_queue_max_bytes: 1 << 20, ..RouterPolicy::default() };
        let mut policies = Policies::uniform(small.clone());
        policies.queues_max_bytes = 1 << 20;
        assert_eq!(policies.validate(), Ok(()));
        policies.sources.insert("s".into(), Arc::new(RouterPolicy::default()));
        assert!(policies.validate().unwrap_err().contains("lane_queue_max_bytes of s"));
    }

    #[test]
    fn dead_letter_needs_a_destination() {
        let p = RouterPolicy { on_admission_failure: OnAdmissionFailure::DeadLetter, ..RouterPolicy::default() };
        assert!(p.validate().unwrap_err().contains("dead_letter"));
        assert!(RouterPolicy::default().validate().is_ok());
    }
}
