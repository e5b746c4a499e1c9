//! The door's metric handles, registered once per source at start, so the hot path
//! increments handles instead of looking names and labels up per request.
//!
//! Invariants:
//! - Labels are the source key (from configuration), status class and fixed reasons
//!   only: never paths, ids or peer addresses.
//! - Handles are created after the process installed its recorder (the daemon builds
//!   the door after installing it); handles made without a recorder are no-ops.

use std::collections::HashMap;

use metrics::{Counter, Histogram};

/// The handles of one source.
#[derive(Clone)]
pub struct SourceMetrics {
    pub requests_2xx: Counter,
    pub events_accepted: Counter,
    pub request_duration: Histogram,
}

impl SourceMetrics {
    pub fn new(source: &str) -> SourceMetrics {
        let key = source.to_string();
        SourceMetrics {
            requests_2xx: metrics::counter!("iggy_ingest_http_requests_total", "source" => key.clone(), "status_class" => "2xx"),
            events_accepted: metrics::counter!("iggy_ingest_events_accepted_total", "source" => key.clone()),
            request_duration: metrics::histogram!("iggy_ingest_http_request_duration_seconds", "source" => key),
        }
    }
}

/// Handles for every configured source.
#[derive(Clone, Default)]
pub struct DoorMetrics {
    per_source: HashMap<String, SourceMetrics>,
}

impl DoorMetrics {
    pub fn new<'a>(sources: impl IntoIterator<Item = &'a str>) -> DoorMetrics {
        DoorMetrics { per_source: sources.into_iter().map(|k| (k.to_string(), SourceMetrics::new(k))).collect() }
    }

    pub fn source(&self, key: &str) -> Option<&SourceMetrics> {
        self.per_source.get(key)
    }
}

/// Counts an answer of any class on the slow path (rejections, unknown sources).
pub fn count_answer(source: &str, class: &'static str, reason: &'static str) {
    metrics::counter!("iggy_ingest_http_requests_total", "source" => source.to_string(), "status_class" => class)
        .increment(1);
    if class != "2xx" {
        metrics::counter!("iggy_ingest_http_rejected_total", "source" => source.to_string(), "reason" => reason)
            .increment(1);
    }
}
