//! Every metric the daemon exports, in one catalog: its name, kind, labels and help
//! text. At start the daemon describes each one and registers it (at zero, for every
//! configured source and every fixed label value), so the first scrape of `/metrics`
//! already shows the whole set: an alert on `rate(...)` sees the first increment, and a
//! dashboard has no "no data" panels on a quiet daemon.
//!
//! Invariants:
//! - Every name a `counter!`, `gauge!` or `histogram!` in the workspace emits is in
//!   [`catalog`], with the same kind, and every catalog entry is emitted somewhere (a
//!   test reads the sources to hold them together).
//! - Registering only creates series; it never sets a value, so it is safe at any time,
//!   even after a gauge was moved.
//! - Histograms are exported as Prometheus histograms (`_bucket`, `_sum`, `_count`)
//!   with the buckets below, so they aggregate and `histogram_quantile` works.
//! - Labels stay low-cardinality: source keys from the configuration and fixed reasons.

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder, PrometheusHandle};
use router::sink::SendErrorKind;
use router::status::Status;

/// What kind of series a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One exported metric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Metric {
    pub name: String,
    pub kind: Kind,
    /// The label names its series carry (empty: one series).
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

fn m(name: &str, kind: Kind, labels: &'static [&'static str], help: &'static str) -> Metric {
    Metric { name: name.to_string(), kind, labels, help }
}

use Kind::{Counter, Gauge, Histogram};

/// Every metric the daemon exports.
pub fn catalog() -> Vec<Metric> {
    let mut v = vec![
        // The log.
        m(
            "iggy_ingest_wal_appends_total",
            Counter,
            &[],
            "Appends (requests) the log took: made durable (wal.sync = always), or written ahead of the next sync (interval)",
        ),
        m(
            "iggy_ingest_wal_records_total",
            Counter,
            &[],
            "Records (events) the log took: made durable (wal.sync = always), or written ahead of the next sync (interval)",
        ),
        m("iggy_ingest_wal_bytes_written_total", Counter, &[], "Bytes written to the log, frames included"),
        m("iggy_ingest_wal_group_commit_appends", Histogram, &[], "Appends carried by one write and sync"),
        m("iggy_ingest_wal_fsync_seconds", Histogram, &[], "Time of one fdatasync of the log"),
        m("iggy_ingest_wal_used_bytes", Gauge, &[], "Bytes the log's segments take on disk"),
        m("iggy_ingest_wal_capacity_bytes", Gauge, &[], "The log's capacity (wal.max_bytes)"),
        m("iggy_ingest_wal_segments", Gauge, &[], "Segment files of the log"),
        m("iggy_ingest_wal_full_rejections_total", Counter, &[], "Appends refused because the log was full (503)"),
        m(
            "iggy_ingest_wal_full",
            Gauge,
            &[],
            "1 from an append refused because the log was full until an append fits or space is freed",
        ),
        m(
            "iggy_ingest_wal_disk_full",
            Gauge,
            &[],
            "1 from a write, sync or segment creation of the log the file system refused for want of space until one succeeds",
        ),
        m(
            "iggy_ingest_wal_storage_errors_total",
            Counter,
            &[],
            "Failed writes, syncs or segment creations of the log (the appends they carried failed), and failed removals of released segments",
        ),
        m(
            "iggy_ingest_wal_stopped",
            Gauge,
            &[],
            "1 while the log takes no append until a restart (a write or sync it could not undo; health 503 log_stopped)",
        ),
        m(
            "iggy_ingest_wal_writer_busy_seconds",
            Gauge,
            &[],
            "How long the log's writer has been in its current write, sync or segment change, 0 while it waits (measured at each scrape; health 503 log_stalled from 10 s)",
        ),
        m(
            "iggy_ingest_wal_awaiting_segment",
            Gauge,
            &[],
            "1 while the log cannot create its next segment and takes no append (health 503 log_unavailable)",
        ),
        // The listeners.
        m("iggy_ingest_http_connections", Gauge, &["listener"], "Connections open now, by listener (webhook, admin)"),
        m(
            "iggy_ingest_http_connection_waits_total",
            Counter,
            &["listener"],
            "Clients that waited in the backlog for a free slot (found there when one freed): the listener was at its connection cap (http.max_connections)",
        ),
        m(
            "iggy_ingest_http_accept_failures_total",
            Counter,
            &["listener"],
            "Accepts that failed, each retried after 50 ms: typically the process out of file descriptors (EMFILE); its clients wait in the backlog",
        ),
        // The door.
        m(
            "iggy_ingest_http_requests_total",
            Counter,
            &["source", "status_class"],
            "Webhook requests answered, by source and status class",
        ),
        m(
            "iggy_ingest_http_rejected_total",
            Counter,
            &["source", "reason"],
            "Webhook requests answered other than 2xx, by source and error code",
        ),
        m(
            "iggy_ingest_http_request_duration_seconds",
            Histogram,
            &["source"],
            "Time to answer a request to a source, whatever the answer (for a 200: append and sync included)",
        ),
        m("iggy_ingest_auth_failures_total", Counter, &["source", "reason"], "Webhook requests that failed auth"),
        m(
            "iggy_ingest_events_accepted_total",
            Counter,
            &["source"],
            "Events the log took for the source's requests (answered 200, or durable after their client went away)",
        ),
        m(
            "iggy_ingest_idempotent_replays_total",
            Counter,
            &["source"],
            "Retried deliveries answered from the idempotency index, nothing appended",
        ),
        m(
            "iggy_ingest_header_values_clamped_total",
            Counter,
            &["source"],
            "Forwarded header values cut to 255 bytes, in requests appended",
        ),
        m(
            "iggy_ingest_append_latency_seconds",
            Histogram,
            &[],
            "Time from submitting an append until it is durable (wal.sync = interval: written); refused appends are not timed",
        ),
        m(
            "iggy_ingest_idempotency_record_failures_total",
            Counter,
            &[],
            "Delivery ids that could not be recorded after their append (rebuilt from the log on start)",
        ),
        m(
            "iggy_ingest_idempotency_keys",
            Gauge,
            &[],
            "Delivery ids kept in the idempotency index, as of the last checkpoint",
        ),
        m(
            "iggy_ingest_idempotency_keys_evicted_total",
            Counter,
            &[],
            "Delivery ids forgotten before their retention ended: the index was at idempotency.max_keys",
        ),
        m(
            "iggy_ingest_idempotency_checkpoint_failures_total",
            Counter,
            &[],
            "Failed idempotency checkpoints (keys since the last one are rebuilt from the log on start)",
        ),
        m(
            "iggy_ingest_admin_auth_failures_total",
            Counter,
            &[],
            "Admin API calls refused for a missing or wrong token (401)",
        ),
        // TLS, on the listeners that serve it ([http.tls], [admin.tls]).
        m(
            "iggy_ingest_tls_handshake_failures_total",
            Counter,
            &["listener", "reason"],
            "TLS handshakes that failed (refused) or outlasted the header read timeout (timed_out)",
        ),
        m(
            "iggy_ingest_tls_reloads_total",
            Counter,
            &["listener", "outcome"],
            "Certificate reloads on SIGHUP, by outcome (loaded, failed)",
        ),
        m(
            "iggy_ingest_tls_reload_failed",
            Gauge,
            &["listener"],
            "1 from a certificate reload that failed until one that loads: the files are not what the listener serves",
        ),
        m(
            "iggy_ingest_tls_certificate_expiry_timestamp_seconds",
            Gauge,
            &["listener"],
            "When the certificate the listener serves expires (its notAfter, Unix seconds; 0 if it does not read)",
        ),
        // Routing at the door and delivery.
        m(
            "iggy_connector_routing_unmatched_total",
            Counter,
            &["connector_key", "action"],
            "Events whose routed field was missing or unmapped, by the action taken",
        ),
        m(
            "iggy_connector_destinations_rejected_total",
            Counter,
            &["connector_key", "reason"],
            "Requests refused at the door and records not admitted by the router, by reason",
        ),
        m(
            "iggy_connector_partition_key_missing_total",
            Counter,
            &["connector_key", "reason"],
            "Events sent balanced because their partition key was missing or not a u32",
        ),
        m(
            "iggy_connector_partition_key_invalid_total",
            Counter,
            &[],
            "Sends (every try) of records whose stored partition key Iggy cannot take (sent balanced)",
        ),
        m(
            "iggy_connector_connections_retired_total",
            Counter,
            &[],
            "Connections to Iggy replaced for reaching iggy.connection_max_age_ms",
        ),
        m(
            "iggy_connector_destinations_created_total",
            Counter,
            &[],
            "Topics the router created on the Iggy server (with their stream where it was missing), with router.topic_defaults: at first use, and again after one was deleted there",
        ),
        m(
            "iggy_connector_messages_routed_total",
            Counter,
            &["connector_key"],
            "Messages acknowledged by Iggy and released by their lane",
        ),
        m(
            "iggy_connector_messages_dropped_total",
            Counter,
            &["connector_key", "reason"],
            "Records dropped by on_admission_failure = \"drop\", or given up (router.give_up)",
        ),
        m(
            "iggy_connector_send_failures_total",
            Counter,
            &["connector_key", "reason"],
            "Failed sends to Iggy, by failure class (every one is retried)",
        ),
        m(
            "iggy_connector_headers_dropped_total",
            Counter,
            &[],
            "Message headers Iggy cannot take, left out, each time a record is prepared (again for a dead-letter topic)",
        ),
        m("iggy_connector_destinations_active", Gauge, &[], "Lanes: (source, destination) pairs the router knows"),
        m("iggy_connector_destination_circuit_open", Gauge, &[], "Destinations whose circuit breaker is open now"),
        m("iggy_connector_held_bytes", Gauge, &[], "Payload bytes routed and not yet acknowledged by Iggy"),
        m(
            "iggy_connector_queued_bytes",
            Gauge,
            &[],
            "Bytes every destination's queue keeps in memory, against router.queues_max_bytes",
        ),
        m(
            "iggy_connector_queues_max_bytes",
            Gauge,
            &[],
            "router.queues_max_bytes: the most bytes all destinations' queues keep in memory (0 while the router is stopped)",
        ),
        m(
            "iggy_connector_oldest_held_age_seconds",
            Gauge,
            &[],
            "Age of the oldest record not yet acknowledged by Iggy (0 when none is held)",
        ),
        m(
            "iggy_connector_destination_create_latency_seconds",
            Histogram,
            &[],
            "Time to ensure a destination's stream and topic exist (calls that succeeded)",
        ),
        m(
            "iggy_connector_send_latency_seconds",
            Histogram,
            &[],
            "Time of one send, until acknowledged (acknowledged sends only)",
        ),
        m("iggy_connector_cursor_commit_seconds", Histogram, &[], "Time of one durable commit of the cursors"),
        m(
            "iggy_connector_admission_held",
            Gauge,
            &[],
            "1 while a record admission refused (cap, error policy) or could not decode holds the log until a restart",
        ),
        m(
            "iggy_connector_cursor_store_failures_total",
            Counter,
            &[],
            "Cursor commits that failed (retried; the log stays pinned below them meanwhile)",
        ),
        m(
            "iggy_connector_delivery_status",
            Gauge,
            &["connector_key", "status"],
            "1 for a connector's delivery status (as /status says it), 0 for the others",
        ),
    ];
    for s in Status::ALL {
        v.push(Metric {
            name: format!("iggy_connector_router_{}", s.as_str()),
            kind: Gauge,
            labels: &[],
            help: router_status_help(s),
        });
        v.push(Metric {
            name: format!("iggy_connector_destinations_{}", s.as_str()),
            kind: Gauge,
            labels: &[],
            help: destination_status_help(s),
        });
    }
    v
}

fn router_status_help(s: Status) -> &'static str {
    match s {
        Status::Starting => "1 while the router is starting",
        Status::Running => "1 while the router delivers normally",
        Status::Degraded => {
            "1 while any destination is Degraded (retrying, not progressing), or delivered log space cannot be freed (cursors not stored, segments not removed, idempotency checkpoints failing)"
        }
        Status::Error => "1 while the router is in Error",
        Status::Stopping => "1 while the router is stopping",
        Status::Stopped => "1 once the router stopped",
    }
}

fn destination_status_help(s: Status) -> &'static str {
    match s {
        Status::Starting => "Destinations not yet sent to",
        Status::Running => "Destinations delivering normally",
        Status::Degraded => {
            "Destinations retrying without progress (failures past degraded_after_failures, an open breaker, or records out of the topic's partitions held)"
        }
        Status::Error => "Destinations in Error",
        Status::Stopping => "Destinations stopping",
        Status::Stopped => "Destinations stopped",
    }
}

/// The error codes the door counts in `iggy_ingest_http_rejected_total`: the table of
/// docs/http.md, "Answers other than 200" (a test holds them equal).
pub const REJECTION_REASONS: &[&str] = &[
    "invalid_json",
    "malformed_ndjson_line",
    "no_events",
    "invalid_delivery_id",
    "invalid_content_type",
    "body_read_failed",
    "missing_challenge",
    "invalid_challenge",
    "unsupported_content_encoding",
    "unsupported_transfer_coding",
    "invalid_host",
    "unauthorized",
    "not_found",
    "method_not_allowed",
    "body_read_timeout",
    "delivery_in_progress",
    "endpoint_expired",
    "body_too_large",
    "too_many_events",
    "record_too_large",
    "batch_too_large",
    "unsupported_media_type",
    "unknown_destination",
    "invalid_destination",
    "denylisted",
    "not_allowlisted",
    "internal",
    "log_full",
    "disk_full",
    "state_unavailable",
    "lookup_too_late",
    "shutting_down",
    "log_unavailable",
];

const AUTH_REASONS: &[&str] = &["auth_missing", "auth_malformed", "auth_bad_signature", "auth_stale_timestamp"];
const SEND_FAILURES: [SendErrorKind; 5] = [
    SendErrorKind::Disconnected,
    SendErrorKind::Unavailable,
    SendErrorKind::Destination,
    SendErrorKind::Unauthorized,
    SendErrorKind::Timeout,
];
/// Router-side reasons of `iggy_connector_destinations_rejected_total` and
/// `iggy_connector_messages_dropped_total`.
const ADMISSION_REASONS: &[&str] = &["cap", "partition_id_out_of_range"];

/// Bucket bounds in seconds, from a fast fsync (100 µs) to a send at its timeout.
const SECONDS_BUCKETS: &[f64] =
    &[0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
/// Appends per group commit.
const GROUP_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0];

/// The Prometheus exporter with the catalog's histogram buckets, not yet installed.
pub fn exporter() -> Result<PrometheusBuilder, BuildError> {
    let mut b = PrometheusBuilder::new();
    for metric in catalog().into_iter().filter(|x| x.kind == Histogram) {
        let buckets =
            if metric.name == "iggy_ingest_wal_group_commit_appends" { GROUP_BUCKETS } else { SECONDS_BUCKETS };
        b = b.set_buckets_for_metric(Matcher::Full(metric.name), buckets)?;
    }
    Ok(b)
}

/// Installs the process-wide recorder (the binary's `run` calls this once).
pub fn install() -> Result<PrometheusHandle, BuildError> {
    exporter()?.install_recorder()
}

/// How often [`upkeep_loop`] drains the histograms.
pub const UPKEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// Drains every histogram's recorded samples into its buckets, every `every`, for as
/// long as the daemon runs. The exporter keeps each sample of a histogram (two per
/// request, more per group commit) until a scrape or an upkeep drains them; without
/// this loop a daemon nobody scrapes grows by about 35 bytes per request, without end.
pub async fn upkeep_loop(handle: PrometheusHandle, every: std::time::Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        handle.run_upkeep();
    }
}

/// Describes every metric and registers its series at zero: label-less ones once,
/// labelled ones for every source in `sources` and every fixed label value. A no-op
/// without an installed recorder. (A listener's TLS series are registered by its
/// `ListenerTls`, made at start before any listener is served: the TLS series of a
/// listener without TLS would say nothing.)
pub fn register_all<'a>(sources: impl IntoIterator<Item = &'a str> + Clone) {
    for metric in catalog() {
        let (name, help) = (metric.name.clone(), metric.help);
        match metric.kind {
            Counter => metrics::describe_counter!(name, help),
            Gauge => metrics::describe_gauge!(name, help),
            Histogram => metrics::describe_histogram!(name, help),
        }
        if metric.labels.is_empty() {
            match metric.kind {
                Counter => drop(metrics::counter!(metric.name)),
                Gauge => drop(metrics::gauge!(metric.name)),
                Histogram => drop(metrics::histogram!(metric.name)),
            }
        }
    }
    let counter = |name: &'static str, labels: [(&'static str, String); 2]| drop(metrics::counter!(name, &labels));
    for source in sources {
        let s = || source.to_string();
        for class in ["2xx", "4xx", "5xx"] {
            counter("iggy_ingest_http_requests_total", [("source", s()), ("status_class", class.into())]);
        }
        for reason in REJECTION_REASONS {
            counter("iggy_ingest_http_rejected_total", [("source", s()), ("reason", (*reason).into())]);
        }
        for reason in AUTH_REASONS {
            counter("iggy_ingest_auth_failures_total", [("source", s()), ("reason", (*reason).into())]);
        }
        drop(metrics::counter!("iggy_ingest_events_accepted_total", "source" => s()));
        drop(metrics::counter!("iggy_ingest_idempotent_replays_total", "source" => s()));
        drop(metrics::counter!("iggy_ingest_header_values_clamped_total", "source" => s()));
        drop(metrics::histogram!("iggy_ingest_http_request_duration_seconds", "source" => s()));
        // Routing at the door: the door's own handles (unmatched actions, refusals, key misses).
        drop(http_source::metrics::RoutingMetrics::new(source));
        drop(metrics::counter!("iggy_connector_messages_routed_total", "connector_key" => s()));
        for reason in ADMISSION_REASONS {
            let labels = [("connector_key", s()), ("reason", (*reason).into())];
            counter("iggy_connector_destinations_rejected_total", labels.clone());
            counter("iggy_connector_messages_dropped_total", labels);
        }
        counter("iggy_connector_messages_dropped_total", [("connector_key", s()), ("reason", "given_up".into())]);
        for kind in SEND_FAILURES {
            counter("iggy_connector_send_failures_total", [("connector_key", s()), ("reason", kind.as_str().into())]);
        }
        // Set for real at each scrape (`delivery::publish_connector_statuses`).
        for status in crate::delivery::connector_delivery_statuses() {
            drop(metrics::gauge!("iggy_connector_delivery_status", "connector_key" => s(), "status" => status));
        }
    }
    // A record the router cannot decode has no source it can name.
    counter(
        "iggy_connector_destinations_rejected_total",
        [("connector_key", "unknown".into()), ("reason", "malformed".into())],
    );
    for listener in ["webhook", "admin"] {
        drop(metrics::gauge!("iggy_ingest_http_connections", "listener" => listener));
        drop(metrics::counter!("iggy_ingest_http_connection_waits_total", "listener" => listener));
        drop(metrics::counter!("iggy_ingest_http_accept_failures_total", "listener" => listener));
    }
    // Requests no source is resolved for count under source "-": unknown paths or ids,
    // endpoints already expired, methods a path does not take.
    counter("iggy_ingest_http_requests_total", [("source", "-".into()), ("status_class", "4xx".into())]);
    for reason in ["not_found", "endpoint_expired", "method_not_allowed"] {
        counter("iggy_ingest_http_rejected_total", [("source", "-".into()), ("reason", reason.into())]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    const COMPUTED: &str = "<computed>";

    /// `(file, name, kind)` of every literal metric name given to a metrics macro in
    /// `dir`'s Rust files. A name that is not a literal is recorded as `<computed>`.
    fn emitted(dir: &Path, out: &mut Vec<(PathBuf, String, Kind)>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                emitted(&path, out);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            for (kind, mac) in [(Counter, "counter!("), (Gauge, "gauge!("), (Histogram, "histogram!(")] {
                for (at, _) in text.match_indices(mac) {
                    let rest = text[at + mac.len()..].trim_start();
                    let name = match rest.strip_prefix('"') {
                        Some(lit) => lit.split('"').next().unwrap_or_default(),
                        None => COMPUTED,
                    };
                    out.push((path.clone(), name.to_string(), kind));
                }
            }
        }
    }

    /// The arguments of every metrics macro call in `text` whose name is the literal
    /// `name`, each split at its top-level commas (a call that spans lines included).
    fn calls_of(text: &str, name: &str) -> Vec<Vec<String>> {
        let mut calls = Vec::new();
        for mac in ["counter!(", "gauge!(", "histogram!("] {
            for (at, _) in text.match_indices(mac) {
                let args_from = at + mac.len();
                if !text[args_from..].trim_start().starts_with(&format!("\"{name}\"")) {
                    continue;
                }
                let (mut depth, mut in_str, mut args, mut arg) = (1usize, false, Vec::new(), String::new());
                for c in text[args_from..].chars() {
                    match c {
                        '"' => in_str = !in_str,
                        '(' | '[' | '{' if !in_str => depth += 1,
                        ')' | ']' | '}' if !in_str => depth -= 1,
                        ',' if !in_str && depth == 1 => {
                            args.push(std::mem::take(&mut arg));
                            continue;
                        }
                        _ => {}
                    }
                    if depth == 0 {
                        break;
                    }
                    arg.push(c);
                }
                args.push(arg);
                calls.push(args.into_iter().map(|a| a.trim().to_string()).filter(|a| !a.is_empty()).collect());
            }
        }
        calls
    }

    /// Label names the brief allows: the connector (source) key, a reason, an action, and
    /// the door's own fixed sets. Never a stream, topic, path, id or peer address.
    const LABELS_ALLOWED: [&str; 8] =
        ["source", "connector_key", "reason", "action", "status_class", "listener", "outcome", "status"];

    /// Every call that emits a metric of the catalog names exactly the catalog's labels,
    /// each one the brief allows, as `"label" => value` pairs: a label added at one call
    /// site (a `stream`), or renamed at one, fails here.
    #[test]
    fn every_call_names_exactly_the_catalogs_labels() {
        let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut checked = 0;
        for (file, name, _) in workspace_sources().into_iter().filter(|(_, n, _)| n != COMPUTED) {
            let metric = catalog().into_iter().find(|m| m.name == name).expect("the catalog test covers names");
            let mut want: Vec<&str> = metric.labels.to_vec();
            want.sort_unstable();
            for label in &want {
                assert!(LABELS_ALLOWED.contains(label), "{name}: label {label} is not one the brief allows");
            }
            let text = std::fs::read_to_string(crates.join(&file)).unwrap_or_default();
            for args in calls_of(&text, &name) {
                let mut got: Vec<&str> = Vec::new();
                for pair in &args[1..] {
                    let label = pair
                        .strip_prefix('"')
                        .and_then(|p| p.split_once('"'))
                        .filter(|(_, after)| after.trim_start().starts_with("=>"))
                        .map(|(label, _)| label);
                    let label = label.unwrap_or_else(|| {
                        panic!("{}: {name}: `{pair}` is not a `\"label\" => value` pair", file.display())
                    });
                    got.push(label);
                }
                got.sort_unstable();
                assert_eq!(got, want, "{}: {name} is emitted with other labels than the catalog's", file.display());
                checked += 1;
            }
        }
        assert!(checked > 50, "the scan found {checked} calls: too few");
    }

    fn workspace_sources() -> Vec<(PathBuf, String, Kind)> {
        let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut out = Vec::new();
        // Every crate the daemon is built from (a new source crate included); the test
        // broker is a stand-in for Iggy, never part of the daemon.
        for entry in std::fs::read_dir(&crates).unwrap().flatten() {
            if entry.file_name() != "test-broker" {
                emitted(&entry.path().join("src"), &mut out);
            }
        }
        // This module registers every name itself; what counts is where values move.
        out.retain(|(p, _, _)| !p.ends_with("telemetry.rs"));
        out
    }

    #[test]
    fn the_catalog_is_exactly_what_the_code_emits() {
        let known: BTreeMap<String, Kind> = catalog().into_iter().map(|x| (x.name, x.kind)).collect();
        assert_eq!(known.len(), catalog().len(), "a name is in the catalog twice");
        let mut found = workspace_sources();
        assert!(found.len() > 30, "the source scan found too little: {found:?}");
        // Only the status model computes names (`iggy_connector_{kind}_{status}`, listed
        // in the catalog from `Status::ALL`); anywhere else a computed name could
        // escape the catalog.
        for (file, name, _) in &found {
            assert!(
                name != COMPUTED || file.ends_with("router/src/status.rs"),
                "{} gives a metrics macro a computed name: use a literal, or extend telemetry::catalog and this test",
                file.display()
            );
        }
        found.retain(|(_, name, _)| name != COMPUTED);
        for (file, name, kind) in &found {
            assert_eq!(
                known.get(name),
                Some(kind),
                "{} emits {name} as a {}: add it to telemetry::catalog with that kind",
                file.display(),
                kind.as_str()
            );
        }
        // The status gauges are named by router::status from the kind and the status.
        for name in known.keys() {
            let by_status = ["iggy_connector_router_", "iggy_connector_destinations_"]
                .iter()
                .any(|p| name.strip_prefix(p).is_some_and(|rest| Status::ALL.iter().any(|s| s.as_str() == rest)));
            assert!(
                by_status || found.iter().any(|(_, n, _)| n == name),
                "{name} is in the catalog but nothing emits it"
            );
        }
    }

    #[test]
    fn every_metric_is_described_and_present_before_any_event() {
        let recorder = exporter().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            register_all(["github", "shop"]);
            // What a listener served over TLS registers as it is made.
            http_source::tls::register_metrics("webhook");
        });
        let text = handle.render();
        for metric in catalog() {
            assert!(text.contains(&format!("# HELP {} ", metric.name)), "no help for {}:\n{text}", metric.name);
            assert!(
                text.contains(&format!("# TYPE {} {}", metric.name, metric.kind.as_str())),
                "{} is not a {}:\n{text}",
                metric.name,
                metric.kind.as_str()
            );
        }
        // Zero-valued series for every configured source and fixed reason.
        for line in [
            r#"iggy_ingest_http_rejected_total{source="shop",reason="log_full"} 0"#,
            r#"iggy_ingest_auth_failures_total{source="github",reason="auth_bad_signature"} 0"#,
            r#"iggy_connector_send_failures_total{connector_key="github",reason="destination"} 0"#,
            r#"iggy_connector_messages_routed_total{connector_key="shop"} 0"#,
            r#"iggy_ingest_wal_fsync_seconds_bucket{le="0.001"} 0"#,
            "iggy_ingest_wal_fsync_seconds_count 0",
            "iggy_connector_router_degraded 0",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
    }

    #[test]
    fn the_rejection_reasons_are_the_documented_error_codes() {
        let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/http.md")).unwrap();
        let table = doc.split("### Answers other than 200").nth(1).expect("the section in docs/http.md");
        let documented: std::collections::BTreeSet<&str> = table
            .lines()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .skip(2) // the header and its rule
            .filter_map(|row| row.split('|').nth(2))
            .filter_map(|cell| cell.trim().strip_prefix('`')?.strip_suffix('`'))
            .collect();
        assert!(documented.len() > 20, "{documented:?}");
        let ours: std::collections::BTreeSet<&str> = REJECTION_REASONS.iter().copied().collect();
        assert_eq!(ours, documented, "REJECTION_REASONS and docs/http.md's table differ");
    }

    #[test]
    fn registering_again_changes_no_value() {
        let recorder = exporter().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            metrics::gauge!("iggy_connector_destination_circuit_open").increment(2.0);
            metrics::counter!("iggy_ingest_events_accepted_total", "source" => "shop").increment(3);
            register_all(["shop"]);
        });
        let text = handle.render();
        assert!(text.contains("iggy_connector_destination_circuit_open 2"), "{text}");
        assert!(text.contains(r#"iggy_ingest_events_accepted_total{source="shop"} 3"#), "{text}");
    }
}
