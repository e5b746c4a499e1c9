//! The door's metric handles, registered once per source at start, so the hot path
//! increments handles instead of looking names and labels up per request.
//!
//! Invariants:
//! - Labels are the source key (from configuration), status class and fixed reasons
//!   only: never paths, ids or peer addresses. The `iggy_connector_*` routing series
//!   use only `connector_key` (the source key), `reason` and `action`, the labels the
//!   router uses for the same names.
//! - Handles are created after the process installed its recorder (the daemon builds
//!   the door after installing it); handles made without a recorder are no-ops.

use std::collections::HashMap;
use std::sync::Arc;

use metrics::{Counter, Histogram};

use crate::partition::{KeyMiss, KeyMisses};
use crate::resolve::RefusalKind;
use crate::route::OnMissing;

/// The handles of one source.
#[derive(Clone)]
pub struct SourceMetrics {
    pub requests_2xx: Counter,
    pub events_accepted: Counter,
    /// Forwarded header values cut to what Iggy takes, in requests appended.
    pub header_values_clamped: Counter,
    pub request_duration: Histogram,
    pub routing: RoutingMetrics,
}

/// What routing at the door decided, per source.
#[derive(Clone)]
pub struct RoutingMetrics {
    unmatched_default: Counter,
    unmatched_drop: Counter,
    unmatched_error: Counter,
    rejected_unknown: Counter,
    rejected_invalid: Counter,
    rejected_denylist: Counter,
    rejected_not_allowlisted: Counter,
    key_missing: Counter,
    key_not_u32: Counter,
}

impl RoutingMetrics {
    pub fn new(source: &str) -> RoutingMetrics {
        let unmatched = |action: &'static str| metrics::counter!("iggy_connector_routing_unmatched_total", "connector_key" => source.to_string(), "action" => action);
        let rejected = |reason: &'static str| metrics::counter!("iggy_connector_destinations_rejected_total", "connector_key" => source.to_string(), "reason" => reason);
        let key = |reason: &'static str| metrics::counter!("iggy_connector_partition_key_missing_total", "connector_key" => source.to_string(), "reason" => reason);
        RoutingMetrics {
            unmatched_default: unmatched(OnMissing::Default.action()),
            unmatched_drop: unmatched(OnMissing::Drop.action()),
            unmatched_error: unmatched(OnMissing::Error.action()),
            rejected_unknown: rejected(RefusalKind::Unknown.reason()),
            rejected_invalid: rejected(RefusalKind::Invalid.reason()),
            rejected_denylist: rejected("denylist"),
            rejected_not_allowlisted: rejected("not_allowlisted"),
            key_missing: key(KeyMiss::Missing.reason()),
            key_not_u32: key(KeyMiss::NotU32.reason()),
        }
    }

    /// Counts the events of an accepted request that went to the default or were dropped.
    pub fn unmatched(&self, defaulted: u64, dropped: u64) {
        self.unmatched_default.increment(defaulted);
        self.unmatched_drop.increment(dropped);
    }

    /// Counts the events of an accepted request whose partition key was missing, or not
    /// a `u32` where one was asked for ([`KeyMisses`]).
    pub fn key_misses(&self, misses: KeyMisses) {
        if misses != KeyMisses::default() {
            self.key_missing.increment(misses.missing);
            self.key_not_u32.increment(misses.not_u32);
        }
    }

    /// Counts a refused request (once, for its first refused event).
    pub fn refused(&self, kind: RefusalKind) {
        match kind {
            RefusalKind::Unknown => {
                self.unmatched_error.increment(1);
                self.rejected_unknown.increment(1);
            }
            RefusalKind::Invalid => self.rejected_invalid.increment(1),
            RefusalKind::Admission(crate::admission::Refusal::Denylisted) => self.rejected_denylist.increment(1),
            RefusalKind::Admission(crate::admission::Refusal::NotAllowlisted) => {
                self.rejected_not_allowlisted.increment(1)
            }
        }
    }
}

impl SourceMetrics {
    pub fn new(source: &str) -> SourceMetrics {
        let key = source.to_string();
        SourceMetrics {
            requests_2xx: metrics::counter!("iggy_ingest_http_requests_total", "source" => key.clone(), "status_class" => "2xx"),
            events_accepted: metrics::counter!("iggy_ingest_events_accepted_total", "source" => key.clone()),
            header_values_clamped: metrics::counter!("iggy_ingest_header_values_clamped_total", "source" => key.clone()),
            request_duration: metrics::histogram!("iggy_ingest_http_request_duration_seconds", "source" => key),
            routing: RoutingMetrics::new(source),
        }
    }
}

/// Handles for every configured source.
#[derive(Clone, Default)]
pub struct DoorMetrics {
    per_source: HashMap<String, Arc<SourceMetrics>>,
}

impl DoorMetrics {
    pub fn new<'a>(sources: impl IntoIterator<Item = &'a str>) -> DoorMetrics {
        DoorMetrics {
            per_source: sources.into_iter().map(|k| (k.to_string(), Arc::new(SourceMetrics::new(k)))).collect(),
        }
    }

    /// The handles of source `key`, shared: an acceptance is counted by them once the
    /// log holds it, whether or not its request still waits ([`crate::door`]).
    pub fn source(&self, key: &str) -> Option<&Arc<SourceMetrics>> {
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
