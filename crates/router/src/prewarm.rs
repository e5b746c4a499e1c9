//! Pre-warming: the destinations known at start are ensured (stream and topic created
//! with the topic defaults) before their first record needs them, within a deadline;
//! a lane's own first ensure then only reads what exists.
//!
//! Invariants:
//! - Pre-warming never delays the daemon: it runs as its own task, and a destination it
//!   could not ensure before the deadline is simply ensured on first use, as any other.
//! - It only creates what a record could create (the same `Sink::ensure`): destinations
//!   a source's records can name and its cap would admit (its fixed destination, its
//!   route's default where events can fall back to it, literal allowlist entries; at
//!   most `max_destinations` per source, chosen by the caller). A literal allowlist
//!   entry no record ever names is still created: listing it is taken as saying it is
//!   expected.
//! - Every attempt is bounded: the whole run ends at the deadline, each attempt at the
//!   largest result timeout (below the `iggy` client's own reply timeout, past which the
//!   client would drop its connection and count the server as gone), each failure waits
//!   a capped backoff before the next try.
//! - At most [`PREWARM_MAX_IN_FLIGHT`] destinations are ensured at once: each call holds a
//!   connection of its own, and a long literal allowlist must not open hundreds.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::sink::{DestinationKey, Sink};

/// What a pre-warm run achieved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrewarmReport {
    pub ready: Vec<DestinationKey>,
    /// Not ensured before the deadline, with the last error.
    pub not_ready: Vec<(DestinationKey, String)>,
}

const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// The most destinations pre-warmed at once: the default of `max_concurrent_destinations`,
/// the bound on one source's connections.
pub const PREWARM_MAX_IN_FLIGHT: usize = 16;

/// The longest one attempt waits for its answer.
const ATTEMPT_MAX: Duration = crate::iggy_sink::MAX_RESULT_TIMEOUT;

/// Ensures every one of `destinations` (each on its own task, retrying failures) until
/// all are ready or `deadline_after` has passed; logs and returns the outcome. A
/// destination that never answers holds only itself.
pub async fn prewarm<S: Sink>(
    sink: Arc<S>,
    destinations: Vec<DestinationKey>,
    deadline_after: Duration,
) -> PrewarmReport {
    let deadline = Instant::now() + deadline_after;
    let slots = Arc::new(tokio::sync::Semaphore::new(PREWARM_MAX_IN_FLIGHT));
    let mut tasks = JoinSet::new();
    for dest in destinations {
        let sink = sink.clone();
        let slots = slots.clone();
        tasks.spawn(async move {
            let outcome = match tokio::time::timeout_at(deadline, slots.acquire()).await {
                Ok(Ok(_slot)) => ensure_until(&*sink, &dest, deadline).await,
                _ => Err("no pre-warm slot free before the deadline".to_string()),
            };
            (dest, outcome)
        });
    }
    let mut report = PrewarmReport::default();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((dest, Ok(()))) => report.ready.push(dest),
            Ok((dest, Err(e))) => report.not_ready.push((dest, e)),
            Err(e) => tracing::warn!(error = %e, "a pre-warm task failed"),
        }
    }
    report.ready.sort();
    report.not_ready.sort();
    if report.not_ready.is_empty() {
        tracing::info!(destinations = report.ready.len(), "pre-warmed every destination known at start");
    } else {
        for (dest, e) in &report.not_ready {
            tracing::warn!(destination = %dest, error = %e, "not pre-warmed within the deadline; it is ensured on first use");
        }
    }
    report
}

async fn ensure_until<S: Sink>(sink: &S, dest: &DestinationKey, deadline: Instant) -> Result<(), String> {
    let mut backoff = BACKOFF_FIRST;
    let mut last_error = "no answer before the deadline".to_string();
    while Instant::now() < deadline {
        match tokio::time::timeout_at(deadline.min(Instant::now() + ATTEMPT_MAX), crate::lane::ensure_timed(sink, dest))
            .await
        {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => last_error = e.to_string(),
            Err(_) if Instant::now() >= deadline => break,
            Err(_) => last_error = format!("no answer within {} s", ATTEMPT_MAX.as_secs()),
        }
        tokio::time::sleep_until((Instant::now() + backoff).min(deadline)).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
    Err(last_error)
}
