//! Delivery to Iggy inside the daemon: the `[router]` configuration, the router's start
//! and stop, and the admin routes that show connectors and their destinations.
//!
//! Invariants:
//! - Every `[router]` setting is validated with the key path named in the error, and
//!   every default is written out, with why, in `config/example.toml`.
//! - The router starts after the log and the state database are open and stops after
//!   the webhook listener drained and before the log closes, so its last cursors are
//!   stored while the log is still there.
//! - The daemon starts and accepts while Iggy is unreachable: nothing here waits for it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::config::IggyConfig;
use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use ingest::StateDb;
use router::iggy_sink::{CLIENT_REPLY_TIMEOUT, IggySink, IggySinkConfig, MAX_RESULT_TIMEOUT, TopicDefaults};
use router::status::Status;
use router::{
    BatchPolicy, BreakerPolicy, DestinationKey, LaneSnapshot, OnAdmissionFailure, Policies, Router, RouterPolicy,
    StateCursorStore,
};
use serde::Deserialize;
use serde_json::json;
use wal::Wal;

/// The most partitions Iggy creates a topic with (its `MAX_PARTITIONS_COUNT`).
const TOPIC_PARTITIONS_MAX: u32 = 1000;

/// The bounds Iggy puts on a topic's own segment size (`MIN_TOPIC_SEGMENT_SIZE`, the
/// segment maximum `MAX_SIZE_OF_MESSAGES_REQUIRED_TO_SAVE` mirrors, and a multiple of
/// 512: `validate_topic_segment_size` in `iggy_common`). Outside them every create of a
/// topic fails, and every record bound for a new destination is held.
const TOPIC_SEGMENT_BYTES_MIN: u64 = 1024 * 1024;
const TOPIC_SEGMENT_BYTES_MAX: u64 = 1024 * 1024 * 1024;
const TOPIC_SEGMENT_BYTES_MULTIPLE: u64 = 512;
/// The segment size Iggy gives a topic created without one (`DEFAULT_SEGMENT_SIZE`), and
/// checks a topic's size limit against.
const TOPIC_SEGMENT_BYTES_DEFAULT: u64 = 1024 * 1024 * 1024;

/// The most `messages_required_to_save` Iggy admits (`MAX_MESSAGES_REQUIRED_TO_SAVE`).
const MESSAGES_REQUIRED_TO_SAVE_MAX: u64 = 16 * 1024 * 1024;

/// The youngest `iggy.connection_max_age_ms`: each retirement costs a connect and a
/// sign-in, so an age far below the time a send takes would make one per send.
const CONNECTION_MAX_AGE_MIN_MS: u64 = 1000;

/// `[router]`: defaults for every source, `[router.sources.<key>]` overrides per source.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterSection {
    /// `false` keeps every accepted event in the log and sends nothing.
    pub enabled: bool,
    pub batch_max_records: u64,
    pub batch_max_bytes: u64,
    pub linger_ms: u64,
    pub result_timeout_ms: u64,
    pub backoff_base_ms: u64,
    pub backoff_max_ms: u64,
    pub degraded_after_failures: u64,
    pub failure_threshold: u64,
    pub cool_down_ms: u64,
    pub max_destinations: u64,
    pub max_concurrent_destinations: u64,
    pub on_admission_failure: String,
    pub dead_letter_stream: Option<String>,
    pub dead_letter_topic: Option<String>,
    pub lane_queue_max_records: u64,
    pub lane_queue_max_bytes: u64,
    pub overflow_after_ms: u64,
    /// How long the destinations known at start may take to be ensured in the
    /// background (0: not pre-warmed; each is ensured on first use).
    pub prewarm_timeout_ms: u64,
    /// What every lane of every source together keeps queued in memory (router-wide;
    /// no per-source override).
    pub queues_max_bytes: u64,
    pub topic_defaults: TopicDefaultsSection,
    pub sources: BTreeMap<String, PolicyOverrides>,
    /// `[router.give_up]`: by source key, the destinations (`"stream/topic"`) whose records
    /// are dropped instead of delivered. The source need not be configured any more.
    pub give_up: BTreeMap<String, Vec<String>>,
}

impl Default for RouterSection {
    fn default() -> Self {
        let p = RouterPolicy::default();
        RouterSection {
            enabled: true,
            batch_max_records: p.batch.batch_max_records as u64,
            batch_max_bytes: p.batch.batch_max_bytes as u64,
            linger_ms: p.batch.linger.as_millis() as u64,
            result_timeout_ms: p.batch.result_timeout.as_millis() as u64,
            backoff_base_ms: p.batch.backoff_base.as_millis() as u64,
            backoff_max_ms: p.batch.backoff_max.as_millis() as u64,
            degraded_after_failures: u64::from(p.batch.degraded_after_failures),
            failure_threshold: u64::from(p.breaker.failure_threshold),
            cool_down_ms: p.breaker.cool_down.as_millis() as u64,
            max_destinations: p.max_destinations as u64,
            max_concurrent_destinations: p.max_concurrent_destinations as u64,
            on_admission_failure: "error".into(),
            dead_letter_stream: None,
            dead_letter_topic: None,
            lane_queue_max_records: p.lane_queue_max_records as u64,
            lane_queue_max_bytes: p.lane_queue_max_bytes as u64,
            overflow_after_ms: p.overflow_after.as_millis() as u64,
            prewarm_timeout_ms: 10_000,
            queues_max_bytes: Policies::uniform(RouterPolicy::default()).queues_max_bytes as u64,
            topic_defaults: TopicDefaultsSection::default(),
            sources: BTreeMap::new(),
            give_up: BTreeMap::new(),
        }
    }
}

/// Per-source overrides: any key of `[router]`'s policy, absent ones inherited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyOverrides {
    pub batch_max_records: Option<u64>,
    pub batch_max_bytes: Option<u64>,
    pub linger_ms: Option<u64>,
    pub result_timeout_ms: Option<u64>,
    pub backoff_base_ms: Option<u64>,
    pub backoff_max_ms: Option<u64>,
    pub degraded_after_failures: Option<u64>,
    pub failure_threshold: Option<u64>,
    pub cool_down_ms: Option<u64>,
    pub max_destinations: Option<u64>,
    pub max_concurrent_destinations: Option<u64>,
    pub on_admission_failure: Option<String>,
    pub dead_letter_stream: Option<String>,
    pub dead_letter_topic: Option<String>,
    pub lane_queue_max_records: Option<u64>,
    pub lane_queue_max_bytes: Option<u64>,
    pub overflow_after_ms: Option<u64>,
}

/// `[router.topic_defaults]`: how the daemon creates a stream's topic on first use.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TopicDefaultsSection {
    pub partitions_count: u64,
    /// 0: messages never expire.
    pub message_expiry_secs: u64,
    /// 0: no limit beyond the server's.
    pub max_topic_size_bytes: u64,
    /// 0: the server's segment size.
    pub segment_size_bytes: u64,
    pub enforce_fsync: bool,
    pub messages_required_to_save: u64,
}

impl Default for TopicDefaultsSection {
    fn default() -> Self {
        let d = TopicDefaults::default();
        TopicDefaultsSection {
            partitions_count: u64::from(d.partitions_count),
            message_expiry_secs: 0,
            max_topic_size_bytes: 0,
            segment_size_bytes: 0,
            enforce_fsync: d.enforce_fsync,
            messages_required_to_save: u64::from(d.messages_required_to_save),
        }
    }
}

/// The validated delivery settings.
#[derive(Debug, Clone)]
pub struct DeliverySettings {
    pub enabled: bool,
    pub policies: Policies,
    pub sink: IggySinkConfig,
    /// Zero: no pre-warming.
    pub prewarm_timeout: Duration,
}

/// One validation problem: the key path below the document root, and the message.
pub type Problem = (Vec<String>, String);

/// A count from the configuration as the router takes it. Past `usize` (only on a 32-bit
/// target) it is `usize::MAX`, which the router's validation refuses under the key, as it
/// does any value above its bound.
fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// The router's longest duration, in the configuration's milliseconds.
fn max_duration_ms() -> u64 {
    u64::try_from(router::policy::MAX_DURATION.as_millis()).unwrap_or(u64::MAX)
}

/// The longest `result_timeout_ms`: the client's reply timeout, less a margin
/// ([`router::iggy_sink::MAX_RESULT_TIMEOUT`]).
fn max_result_timeout_ms() -> u64 {
    u64::try_from(MAX_RESULT_TIMEOUT.as_millis()).unwrap_or(u64::MAX)
}

/// The most seconds `message_expiry_secs` takes: a hundred years (of 365.25 days). Iggy
/// keeps a topic's expiry in microseconds, in a `u64`, and tells a segment expired by
/// adding it to the segment's last message time in microseconds, unchecked: an expiry
/// within a few thousand years of `u64::MAX` microseconds wraps that sum and expires the
/// segment at once, after the router freed its records on the ack. A century (36,525
/// days) is far from that, and longer than any retention means.
const MESSAGE_EXPIRY_SECS_MAX: u64 = 36_525 * 86_400;

fn to_u32(v: u64, path: &[&str], problems: &mut Vec<Problem>) -> u32 {
    u32::try_from(v).unwrap_or_else(|_| {
        problems.push((path.iter().map(|s| s.to_string()).collect(), format!("must be at most {}", u32::MAX)));
        u32::MAX
    })
}

fn policy_from(s: &RouterSection, prefix: &[&str], problems: &mut Vec<Problem>) -> RouterPolicy {
    let at = |k: &str| -> Vec<String> { prefix.iter().map(|s| s.to_string()).chain([k.to_string()]).collect() };
    let on_admission_failure = match s.on_admission_failure.as_str() {
        "error" => OnAdmissionFailure::Error,
        "drop" => OnAdmissionFailure::Drop,
        "dead_letter" => OnAdmissionFailure::DeadLetter,
        other => {
            problems.push((
                at("on_admission_failure"),
                format!("{other:?} is not one of \"error\", \"drop\", \"dead_letter\""),
            ));
            OnAdmissionFailure::Error
        }
    };
    for (key, name) in [("dead_letter_stream", &s.dead_letter_stream), ("dead_letter_topic", &s.dead_letter_topic)] {
        // As for a fixed destination: a name Iggy refuses would fail every dead-letter
        // send, and the records would hold the log for good (unless given up, by a name
        // of this grammar).
        if let Some(n) = name
            && !http_source::admission::is_name(n)
        {
            problems.push((at(key), crate::config::not_a_name(n)));
        }
    }
    let dead_letter = match (&s.dead_letter_stream, &s.dead_letter_topic) {
        (Some(stream), Some(topic)) => Some(DestinationKey::new(stream.clone(), topic.clone())),
        (None, None) => None,
        (Some(_), None) => {
            problems.push((at("dead_letter_topic"), "required when dead_letter_stream is set".into()));
            None
        }
        (None, Some(_)) => {
            problems.push((at("dead_letter_stream"), "required when dead_letter_topic is set".into()));
            None
        }
    };
    let mut u32_of = |v: u64, k: &str| {
        let path = at(k);
        let refs: Vec<&str> = path.iter().map(String::as_str).collect();
        to_u32(v, &refs, problems)
    };
    let degraded_after_failures = u32_of(s.degraded_after_failures, "degraded_after_failures");
    let failure_threshold = u32_of(s.failure_threshold, "failure_threshold");
    let policy = RouterPolicy {
        batch: BatchPolicy {
            batch_max_records: to_usize(s.batch_max_records),
            batch_max_bytes: to_usize(s.batch_max_bytes),
            linger: Duration::from_millis(s.linger_ms),
            result_timeout: Duration::from_millis(s.result_timeout_ms),
            backoff_base: Duration::from_millis(s.backoff_base_ms),
            backoff_max: Duration::from_millis(s.backoff_max_ms),
            degraded_after_failures,
        },
        breaker: BreakerPolicy { failure_threshold, cool_down: Duration::from_millis(s.cool_down_ms) },
        max_destinations: to_usize(s.max_destinations),
        max_concurrent_destinations: to_usize(s.max_concurrent_destinations),
        on_admission_failure,
        dead_letter,
        lane_queue_max_records: to_usize(s.lane_queue_max_records),
        lane_queue_max_bytes: to_usize(s.lane_queue_max_bytes),
        overflow_after: Duration::from_millis(s.overflow_after_ms),
    };
    // The durations are checked here under their own keys (the router's message names its
    // fields, `backoff_max`, `result_timeout`, not the keys with their units).
    let mut durations_ok = true;
    let max_ms = max_duration_ms();
    for (key, ms) in [
        ("linger_ms", s.linger_ms),
        ("backoff_base_ms", s.backoff_base_ms),
        ("backoff_max_ms", s.backoff_max_ms),
        ("cool_down_ms", s.cool_down_ms),
        ("overflow_after_ms", s.overflow_after_ms),
    ] {
        if ms > max_ms {
            problems.push((at(key), format!("must be at most {max_ms} (one day)")));
            durations_ok = false;
        }
    }
    // Below the `iggy` client's own reply timeout: past it the client reports the
    // connection lost, which counts for the whole server (no breaker, every idle
    // connection dropped), so a topic that never answers would never open its breaker.
    let result_max_ms = max_result_timeout_ms();
    if s.result_timeout_ms > result_max_ms {
        problems.push((
            at("result_timeout_ms"),
            format!(
                "must be at most {result_max_ms}: the iggy client gives up on a reply after {} s and reports \
                 the connection lost, which no destination's breaker counts",
                CLIENT_REPLY_TIMEOUT.as_secs()
            ),
        ));
        durations_ok = false;
    }
    if s.result_timeout_ms == 0 {
        problems.push((at("result_timeout_ms"), "must be greater than 0".into()));
        durations_ok = false;
    }
    if s.cool_down_ms == 0 {
        // A held record asks its topic again after each cool-down: with none, that loop
        // would not rest at all.
        problems.push((at("cool_down_ms"), "must be greater than 0".into()));
        durations_ok = false;
    }
    if s.backoff_base_ms == 0 {
        problems.push((at("backoff_base_ms"), "must be greater than 0".into()));
        durations_ok = false;
    } else if s.backoff_max_ms < s.backoff_base_ms {
        problems.push((at("backoff_max_ms"), format!("must be at least backoff_base_ms ({})", s.backoff_base_ms)));
        durations_ok = false;
    }
    // One lane's bound above all lanes' together: a merely busy lane would fill the
    // router's budget and re-read its records at once, never waiting for room
    // (`overflow_after_ms`), and leave none to the others.
    // (Each value beyond its own bound is named once, under its own key.)
    let own_bounds = s.lane_queue_max_bytes <= router::policy::MAX_LANE_QUEUE_BYTES as u64
        && (1..=router::policy::MAX_QUEUES_BYTES as u64).contains(&s.queues_max_bytes);
    if own_bounds && s.lane_queue_max_bytes > s.queues_max_bytes {
        problems.push((
            at("lane_queue_max_bytes"),
            format!(
                "{} is above router.queues_max_bytes ({}), which bounds every lane's queue together: lower this \
                 or raise that",
                s.lane_queue_max_bytes, s.queues_max_bytes
            ),
        ));
    }
    // The router's problems of durations are those above, said here under the keys with
    // their units; once those are all right the router finds none of its own.
    let router_problems =
        policy.problems().into_iter().filter(|p| durations_ok || !router::policy::DURATION_FIELDS.contains(&p.field));
    for p in router_problems {
        // The router's field is this section's key, but for its `dead_letter`, which is
        // the pair of keys here: named by the first.
        let key = if p.field == "dead_letter" { "dead_letter_stream" } else { p.field };
        problems.push((at(key), p.message));
    }
    policy
}

/// `[router.give_up]` as (source, destination) pairs. A source key or a name that could
/// not be one is a problem at the source's key: such an entry would give up nothing.
fn given_up(section: &BTreeMap<String, Vec<String>>, problems: &mut Vec<Problem>) -> HashSet<router::LaneKey> {
    let mut out = HashSet::new();
    for (source, destinations) in section {
        let at = vec!["router".to_string(), "give_up".to_string(), source.clone()];
        if !http_source::admission::is_name(source) {
            problems.push((at.clone(), format!("{source:?} cannot be a source key")));
            continue;
        }
        for d in destinations {
            match d.split_once('/') {
                Some((stream, topic))
                    if http_source::admission::is_name(stream) && http_source::admission::is_name(topic) =>
                {
                    out.insert(router::LaneKey {
                        source: source.clone(),
                        destination: DestinationKey::new(stream, topic),
                    });
                }
                _ => problems.push((
                    at.clone(),
                    format!("{d:?} is not \"stream/topic\" (names of letters, digits, '.', '_' and '-')"),
                )),
            }
        }
    }
    out
}

/// `base` with a source's overrides applied (only the policy keys matter here).
fn merged(base: &RouterSection, o: &PolicyOverrides) -> RouterSection {
    RouterSection {
        batch_max_records: o.batch_max_records.unwrap_or(base.batch_max_records),
        batch_max_bytes: o.batch_max_bytes.unwrap_or(base.batch_max_bytes),
        linger_ms: o.linger_ms.unwrap_or(base.linger_ms),
        result_timeout_ms: o.result_timeout_ms.unwrap_or(base.result_timeout_ms),
        backoff_base_ms: o.backoff_base_ms.unwrap_or(base.backoff_base_ms),
        backoff_max_ms: o.backoff_max_ms.unwrap_or(base.backoff_max_ms),
        degraded_after_failures: o.degraded_after_failures.unwrap_or(base.degraded_after_failures),
        failure_threshold: o.failure_threshold.unwrap_or(base.failure_threshold),
        cool_down_ms: o.cool_down_ms.unwrap_or(base.cool_down_ms),
        max_destinations: o.max_destinations.unwrap_or(base.max_destinations),
        max_concurrent_destinations: o.max_concurrent_destinations.unwrap_or(base.max_concurrent_destinations),
        on_admission_failure: o.on_admission_failure.clone().unwrap_or_else(|| base.on_admission_failure.clone()),
        dead_letter_stream: o.dead_letter_stream.clone().or_else(|| base.dead_letter_stream.clone()),
        dead_letter_topic: o.dead_letter_topic.clone().or_else(|| base.dead_letter_topic.clone()),
        lane_queue_max_records: o.lane_queue_max_records.unwrap_or(base.lane_queue_max_records),
        lane_queue_max_bytes: o.lane_queue_max_bytes.unwrap_or(base.lane_queue_max_bytes),
        overflow_after_ms: o.overflow_after_ms.unwrap_or(base.overflow_after_ms),
        enabled: base.enabled,
        prewarm_timeout_ms: base.prewarm_timeout_ms,
        queues_max_bytes: base.queues_max_bytes,
        topic_defaults: base.topic_defaults.clone(),
        sources: BTreeMap::new(),
        give_up: BTreeMap::new(),
    }
}

/// Validates `[router]` against the configured sources. Problems name key paths below
/// the document root.
pub fn check(section: &RouterSection, iggy: &IggyConfig, sources: &[String]) -> (DeliverySettings, Vec<Problem>) {
    let mut problems = Vec::new();
    let default = policy_from(section, &["router"], &mut problems);
    let mut per_source = HashMap::new();
    for (key, o) in &section.sources {
        if !sources.contains(key) {
            problems
                .push((vec!["router".into(), "sources".into(), key.clone()], format!("there is no source {key:?}")));
            continue;
        }
        // What the override inherits was checked at [router]: a problem there is reported
        // there once, not again under every source that overrides something else.
        let mut own = Vec::new();
        let p = policy_from(&merged(section, o), &["router", "sources", key], &mut own);
        // The keys this table sets: a problem there is the override's own, even when
        // [router] has the same one.
        let set: Vec<String> = match serde_json::to_value(o) {
            Ok(serde_json::Value::Object(m)) => m.into_iter().filter(|(_, v)| !v.is_null()).map(|(k, _)| k).collect(),
            _ => Vec::new(),
        };
        let inherited = |(path, message): &Problem| {
            path.get(3).is_some_and(|k| {
                !set.contains(k) && problems.iter().any(|(gp, gm)| gp.len() == 2 && gp[1] == *k && gm == message)
            })
        };
        let own: Vec<Problem> = own.into_iter().filter(|p| !inherited(p)).collect();
        problems.extend(own);
        per_source.insert(key.clone(), Arc::new(p));
    }
    // Dead-letter names no policy uses would be ignored, and an operator would believe a
    // dead-letter path is in place. [router]'s are used by its own policy, and by every
    // source override that inherits them; an override's own only by its policy.
    let dead_letters = |p: &RouterPolicy| p.on_admission_failure == OnAdmissionFailure::DeadLetter;
    let names_set = |stream: &Option<String>, topic: &Option<String>| {
        if stream.is_some() { Some("dead_letter_stream") } else { topic.is_some().then_some("dead_letter_topic") }
    };
    if let Some(k) = names_set(&section.dead_letter_stream, &section.dead_letter_topic) {
        let inherited_and_used = section.sources.iter().any(|(key, o)| {
            o.dead_letter_stream.is_none()
                && o.dead_letter_topic.is_none()
                && per_source.get(key).is_some_and(|p| dead_letters(p))
        });
        if !dead_letters(&default) && !inherited_and_used {
            problems.push((
                vec!["router".into(), k.into()],
                "is not used unless on_admission_failure = \"dead_letter\" (here, or in a [router.sources.KEY] that inherits it)".into(),
            ));
        }
    }
    for (key, o) in &section.sources {
        if let Some(k) = names_set(&o.dead_letter_stream, &o.dead_letter_topic)
            && per_source.get(key).is_some_and(|p| !dead_letters(p))
        {
            problems.push((
                vec!["router".into(), "sources".into(), key.clone(), k.into()],
                "is not used unless this source's on_admission_failure = \"dead_letter\"".into(),
            ));
        }
    }
    let t = &section.topic_defaults;
    let at = |k: &str| vec!["router".to_string(), "topic_defaults".to_string(), k.to_string()];
    if t.partitions_count == 0 || t.partitions_count > u64::from(TOPIC_PARTITIONS_MAX) {
        // Iggy refuses a topic with more (`MAX_PARTITIONS_COUNT`): every create would fail.
        problems.push((at("partitions_count"), format!("must be 1 to {TOPIC_PARTITIONS_MAX}")));
    }
    if t.messages_required_to_save == 0 || t.messages_required_to_save > MESSAGES_REQUIRED_TO_SAVE_MAX {
        problems.push((
            at("messages_required_to_save"),
            format!("must be 1 to {MESSAGES_REQUIRED_TO_SAVE_MAX} (Iggy's limit)"),
        ));
    }
    if t.segment_size_bytes != 0
        && (!(TOPIC_SEGMENT_BYTES_MIN..=TOPIC_SEGMENT_BYTES_MAX).contains(&t.segment_size_bytes)
            || !t.segment_size_bytes.is_multiple_of(TOPIC_SEGMENT_BYTES_MULTIPLE))
    {
        problems.push((
            at("segment_size_bytes"),
            format!(
                "must be 0 (the server's default) or {TOPIC_SEGMENT_BYTES_MIN} to {TOPIC_SEGMENT_BYTES_MAX} and a multiple of {TOPIC_SEGMENT_BYTES_MULTIPLE} (Iggy refuses any other topic)"
            ),
        ));
    }
    // Iggy refuses a topic whose size limit is below one segment (it could never be
    // kept): against segment_size_bytes, or with 0 the server's fixed default of 1 GiB.
    let segment_bytes = if t.segment_size_bytes == 0 { TOPIC_SEGMENT_BYTES_DEFAULT } else { t.segment_size_bytes };
    if t.max_topic_size_bytes != 0 && t.max_topic_size_bytes < segment_bytes {
        problems.push((
            at("max_topic_size_bytes"),
            format!(
                "must be 0 (the server's limit) or at least one segment, {segment_bytes} bytes (segment_size_bytes, or \
                 Iggy's default of {TOPIC_SEGMENT_BYTES_DEFAULT} when 0): Iggy refuses to create a topic with a smaller limit"
            ),
        ));
    }
    if t.message_expiry_secs > MESSAGE_EXPIRY_SECS_MAX {
        problems.push((
            at("message_expiry_secs"),
            format!(
                "must be at most {MESSAGE_EXPIRY_SECS_MAX} (a hundred years; 0 is never): Iggy adds it to a message's time in microseconds, and a sum past 64 bits would expire the topic's segments at once"
            ),
        ));
    }
    // Both refused above past their ranges, which are within a u32: one error a key.
    let partitions_count = u32::try_from(t.partitions_count).unwrap_or(u32::MAX);
    let messages_required_to_save = u32::try_from(t.messages_required_to_save).unwrap_or(u32::MAX);
    // At most a day, as the router's durations: after a failed connect, none is made
    // for this long.
    if iggy.reconnection_interval_ms == 0 || iggy.reconnection_interval_ms > max_duration_ms() {
        problems.push((
            vec!["iggy".into(), "reconnection_interval_ms".into()],
            format!("must be 1 to {} (one day)", max_duration_ms()),
        ));
    }
    // At least a second: each retirement is a connect and a sign-in.
    if !(CONNECTION_MAX_AGE_MIN_MS..=max_duration_ms()).contains(&iggy.connection_max_age_ms) {
        problems.push((
            vec!["iggy".into(), "connection_max_age_ms".into()],
            format!("must be {CONNECTION_MAX_AGE_MIN_MS} to {} (one second to one day)", max_duration_ms()),
        ));
    }
    let shortest_result_timeout = per_source
        .values()
        .map(|p: &Arc<RouterPolicy>| p.batch.result_timeout)
        .fold(default.batch.result_timeout, Duration::min);
    let sink = IggySinkConfig {
        address: iggy.address.clone(),
        username: iggy.username.clone(),
        password: iggy.password.clone(),
        tls: iggy.tls,
        tls_domain: iggy.tls_domain.clone(),
        tls_ca_file: iggy.tls_ca_file.clone(),
        reconnection_max_retries: 1,
        reconnection_interval: Duration::from_millis(iggy.reconnection_interval_ms.max(1)),
        connect_timeout: router::iggy_sink::CLIENT_REPLY_TIMEOUT,
        connection_max_age: Duration::from_millis(iggy.connection_max_age_ms.max(CONNECTION_MAX_AGE_MIN_MS)),
        fresh_connection_usable_for: router::iggy_sink::fresh_connection_usable_for(shortest_result_timeout),
        topic_defaults: TopicDefaults {
            partitions_count,
            message_expiry: (t.message_expiry_secs > 0).then(|| Duration::from_secs(t.message_expiry_secs)),
            max_topic_size_bytes: (t.max_topic_size_bytes > 0).then_some(t.max_topic_size_bytes),
            segment_size_bytes: (t.segment_size_bytes > 0).then_some(t.segment_size_bytes),
            enforce_fsync: t.enforce_fsync,
            messages_required_to_save,
        },
    };
    let mut policies = Policies::uniform(default);
    policies.sources = per_source;
    policies.given_up = Arc::new(given_up(&section.give_up, &mut problems));
    policies.queues_max_bytes = to_usize(section.queues_max_bytes);
    let queues_max_bytes = router::policy::MAX_QUEUES_BYTES as u64;
    if !(1..=queues_max_bytes).contains(&section.queues_max_bytes) {
        problems.push((
            vec!["router".into(), "queues_max_bytes".into()],
            format!("must be at least 1 and at most {queues_max_bytes}"),
        ));
    }
    if section.prewarm_timeout_ms > max_duration_ms() {
        // Its deadline (`now + prewarm_timeout`) would overflow the clock.
        problems.push((
            vec!["router".into(), "prewarm_timeout_ms".into()],
            format!("must be at most {} (one day)", max_duration_ms()),
        ));
    }
    let prewarm_timeout = Duration::from_millis(section.prewarm_timeout_ms);
    (DeliverySettings { enabled: section.enabled, policies, sink, prewarm_timeout }, problems)
}

/// The running router, as the daemon holds it.
pub struct Delivery {
    router: Mutex<Option<Arc<Router>>>,
    prewarm: Mutex<Option<tokio::task::JoinHandle<router::prewarm::PrewarmReport>>>,
    enabled: bool,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery").field("enabled", &self.enabled).finish()
    }
}

/// The destinations pre-warmed at start: what each source's records can be seen to name
/// before any arrives ([`SourceSpec::destinations_known_at_start`]), no more than its cap
/// would admit, each once, and none given up for that source (`[router.give_up]`: no
/// lane and no send, so no stream or topic made again either; nor does one take a place
/// under the cap).
pub fn destinations_to_prewarm(
    sources: &[http_source::source::SourceSpec],
    policies: &Policies,
) -> Vec<DestinationKey> {
    let mut out: Vec<DestinationKey> = Vec::new();
    for source in sources {
        let max = policies.for_source(&source.key).max_destinations;
        let named = source.destinations_known_at_start().into_iter();
        let wanted = named.filter(|(stream, topic)| !policies.is_given_up(&source.key, stream, topic));
        for (stream, topic) in wanted.take(max) {
            let d = DestinationKey::new(stream, topic);
            if !out.contains(&d) {
                out.push(d);
            }
        }
    }
    out
}

impl Delivery {
    /// Starts the router over `wal` (unless disabled), and pre-warms `known_at_start` in
    /// the background. Never waits for Iggy. The log is released only below
    /// the idempotency index's durable checkpoint, and the router is Degraded while the
    /// checkpoints fail.
    pub fn start(
        settings: &DeliverySettings,
        wal: Arc<Wal>,
        state: Arc<StateDb>,
        idempotency: Arc<ingest::IdempotencyIndex>,
        known_at_start: Vec<DestinationKey>,
    ) -> Result<Delivery, String> {
        if !settings.enabled {
            // Cursors ahead of the log are lowered even so: the door appends at the
            // offsets they claim, and a later run with delivery would pass over those
            // records as delivered.
            router::lower_cursors_ahead_of_the_log(&wal, &StateCursorStore::new(state))?;
            tracing::warn!("delivery is disabled ([router] enabled = false): events are kept in the log only");
            return Ok(Delivery { router: Mutex::new(None), prewarm: Mutex::new(None), enabled: false });
        }
        let sink = Arc::new(IggySink::new(&settings.sink)?);
        let cursors = Arc::new(StateCursorStore::new(state).with_idempotency(idempotency));
        let router = Router::start(wal, sink.clone(), cursors, settings.policies.clone())?;
        let prewarm = (!settings.prewarm_timeout.is_zero() && !known_at_start.is_empty())
            .then(|| tokio::spawn(router::prewarm::prewarm(sink, known_at_start, settings.prewarm_timeout)));
        tracing::info!(iggy = %settings.sink.address, "delivery started");
        Ok(Delivery { router: Mutex::new(Some(Arc::new(router))), prewarm: Mutex::new(prewarm), enabled: true })
    }

    /// Stops sending; what is in flight stays in the log and is sent after a restart.
    pub async fn shutdown(&self) {
        if let Some(p) = self.prewarm.lock().unwrap_or_else(|p| p.into_inner()).take() {
            p.abort();
        }
        // The router stays here while it stops, so that the status and the destinations
        // say `stopping` (and what each lane still holds) for the whole drain.
        let router = self.router.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(r) = router {
            r.shutdown().await;
        }
    }

    fn with<T>(&self, f: impl FnOnce(&Router) -> T) -> Option<T> {
        self.router.lock().unwrap_or_else(|p| p.into_inner()).as_deref().map(f)
    }

    /// Sets the router's gauges of what it holds, measured now (see
    /// [`Router::publish_held_gauges`]); nothing without a router.
    pub fn publish_held_gauges(&self) {
        self.with(|r| r.publish_held_gauges());
    }

    /// The router's status (`stopping` while it stops, `stopped` after), or `disabled`.
    pub fn status_json(&self) -> serde_json::Value {
        match self.with(|r| (r.status(), r.released_below(), r.held_from(), r.queued_bytes())) {
            None if !self.enabled => json!({"status": "disabled"}),
            None => json!({"status": "stopped"}),
            Some((s, released, held, (queued_bytes, queues_max_bytes))) => json!({
                "status": s.status.as_str(),
                "since_unix_ms": unix_ms(s.since),
                "reason": s.reason,
                "last_error": s.last_error.map(|(e, t)| json!({"message": e, "at_unix_ms": unix_ms(t)})),
                "log_released_below": released,
                "held_from_offset": held,
                "queued_bytes": queued_bytes,
                "queues_max_bytes": queues_max_bytes,
            }),
        }
    }

    pub fn destinations_of(&self, source: &str) -> Vec<LaneSnapshot> {
        self.with(|r| r.destinations_of(source)).unwrap_or_default()
    }

    /// The sources the router has lanes for (see [`Router::sources`]) that
    /// `is_configured` does not name: removed from the configuration, their records
    /// still in the log and delivered. `/status` and `iggy_connector_delivery_status`
    /// speak of them beside the configured ones. None without a router.
    pub fn unconfigured_sources(&self, is_configured: impl Fn(&str) -> bool) -> Vec<String> {
        let sources = self.with(|r| r.sources()).unwrap_or_default();
        sources.into_iter().filter(|s| !is_configured(s)).collect()
    }
}

fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

pub fn lane_json(d: &LaneSnapshot) -> serde_json::Value {
    json!({
        "stream": d.destination.stream,
        "topic": d.destination.topic,
        "status": d.status.as_str(),
        "breaker": d.breaker,
        "cursor": d.delivered_below,
        "held_records": d.held_records,
        "held_bytes": d.held_bytes,
        "oldest_held_age_ms": d.oldest_held_age_ms,
        "sent_records": d.sent_records,
        "rejected_records": d.rejected_records,
        "status_reason": d.status_reason,
        "status_since_unix_ms": unix_ms(d.status_since),
        "consecutive_failures": d.consecutive_failures,
        "last_error": d.last_error,
        "last_error_at_unix_ms": d.last_error_at.map(unix_ms),
        "partitions_count": d.partitions_count,
        "warning": d.not_durable_warning.then_some(
            "the topic acknowledges without fsync: its acks may not survive a crash of the server"
        ),
        "reading_from_log": d.overflowed,
        "queued_bytes": d.queued_bytes,
        "batch_bytes": d.batch_bytes,
        "send_records_max": d.send_records_max,
    })
}

/// A connector's delivery status, as the router settles it for that source
/// ([`Router::connector_status`]): only the troubles that affect it (the router's log
/// reader and its cursor store, which serve every source, and its own destinations),
/// never another connector's.
pub fn connector_delivery_status(delivery: &Delivery, source: &str) -> &'static str {
    match delivery.with(|r| r.connector_status(source)) {
        Some(s) => s.as_str(),
        None if !delivery.enabled => "disabled",
        None => Status::Stopped.as_str(),
    }
}

/// What [`connector_delivery_status`] answers, each: the `status` label values of
/// `iggy_connector_delivery_status` (the router's statuses, and `disabled`).
pub fn connector_delivery_statuses() -> impl Iterator<Item = &'static str> {
    Status::ALL.into_iter().map(Status::as_str).chain(["disabled"])
}

/// Sets `iggy_connector_delivery_status{connector_key, status}` for each of `sources`: 1
/// for its delivery status, 0 for the others. Called at each scrape, with the function
/// `/status` answers with ([`connector_delivery_status`]), so the gauge and the status
/// cannot disagree, and an alert can name the connector.
pub fn publish_connector_statuses<'a>(delivery: &Delivery, sources: impl Iterator<Item = &'a String>) {
    for key in sources {
        let now = connector_delivery_status(delivery, key);
        for status in connector_delivery_statuses() {
            let value = if status == now { 1.0 } else { 0.0 };
            metrics::gauge!("iggy_connector_delivery_status", "connector_key" => key.clone(), "status" => status)
                .set(value);
        }
    }
}

/// `GET /connectors/{key}/destinations`.
/// `GET /connectors/{key}/destinations?limit=N&after=STREAM/TOPIC`: a page of the
/// connector's destinations by stream and topic, and where the next page starts
/// (`next_after`, `null` on the last). A source may route to 100,000 destinations.
pub async fn destinations(
    State(s): State<Arc<crate::daemon::Shared>>,
    key: Result<Path<String>, axum::extract::rejection::PathRejection>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let key = match http_source::door::path_param(key, "connector") {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    // Names are [a-zA-Z0-9._-]: a slash parts the stream from the topic unambiguously.
    let parse_after = |v: &str| v.split_once('/').map(|(s, t)| (s.to_string(), t.to_string()));
    let (after, limit) = match crate::admin::page_query(query.as_deref(), "STREAM/TOPIC", parse_after) {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    // A source removed from the configuration may still have records in the log, and
    // lanes delivering (or holding) them: those are shown, as they pin the log as well.
    let mut lanes = s.delivery.destinations_of(&key);
    if s.status.get(&key).is_none() && lanes.is_empty() {
        return http_source::error::ApiError::not_found("no such connector").into_response();
    }
    fn name(l: &LaneSnapshot) -> (&str, &str) {
        (l.destination.stream.as_str(), l.destination.topic.as_str())
    }
    lanes.retain(|l| after.as_ref().is_none_or(|(s, t)| name(l) > (s.as_str(), t.as_str())));
    lanes.sort_unstable_by(|a, b| name(a).cmp(&name(b)));
    let more = lanes.len() > limit;
    lanes.truncate(limit);
    let next_after =
        if more { lanes.last().map(|l| format!("{}/{}", l.destination.stream, l.destination.topic)) } else { None };
    let page: Vec<serde_json::Value> = lanes.iter().map(lane_json).collect();
    Json(json!({"connector": key, "destinations": page, "next_after": next_after})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iggy() -> IggyConfig {
        IggyConfig::default()
    }

    /// Each section is refused with exactly one problem, at the key path given.
    fn each_refused_at_its_key(cases: Vec<(RouterSection, &str)>) {
        for (section, want) in cases {
            let (_, problems) = check(&section, &iggy(), &[]);
            let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
            assert_eq!(paths, vec![want.to_string()], "{problems:?}");
        }
    }

    /// Every problem of the section is named at once, the router's own checks included,
    /// also beside a duration out of its bound.
    #[test]
    fn every_problem_of_the_router_section_is_named_at_once() {
        let section = RouterSection {
            batch_max_records: 0,
            max_destinations: 0,
            failure_threshold: 0,
            linger_ms: u64::MAX,
            ..RouterSection::default()
        };
        let (_, problems) = check(&section, &iggy(), &[]);
        let mut paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
        paths.sort();
        let want =
            ["router.batch_max_records", "router.failure_threshold", "router.linger_ms", "router.max_destinations"];
        assert_eq!(paths, want, "{problems:?}");
        // Each message is said of its key, which the path names: not named again in it.
        for (path, message) in &problems {
            assert!(message.starts_with("must be "), "{path:?}: {message}");
        }
    }

    /// What is pre-warmed at start leaves out each source's given-up destinations (a
    /// stream or topic deleted on purpose was made again at every start), and one left
    /// out takes no place under the source's cap; the same destination named by another
    /// source that did not give it up is still pre-warmed.
    #[test]
    fn prewarm_leaves_out_the_destinations_a_source_gave_up() {
        let text = r#"
[sources.a]
destination = { stream = "s", topic = "gone" }
[sources.b]
destination = { stream = "s", topic = "kept" }
[sources.c]
destination = { stream = "s", topic = "gone" }
[sources.d]
destination = { stream = "d", topic = "first" }
[sources.d.admission]
mode = "allowlist"
allowlist = [{ stream = "d", topic = "first" }, { stream = "d", topic = "second" }]
[router.sources.d]
max_destinations = 1
[router.give_up]
a = ["s/gone"]
d = ["d/first"]
"#;
        let config = crate::config::parse(text, None).unwrap();
        let settings = crate::config::validate(&config, Some(text), None).unwrap_or_else(|e| panic!("{e}"));
        let prewarmed = destinations_to_prewarm(&settings.sources, &settings.delivery.policies);
        let names: Vec<String> = prewarmed.iter().map(|d| format!("{}/{}", d.stream, d.topic)).collect();
        assert_eq!(names, ["s/kept", "s/gone", "d/second"]);
    }

    /// A destination may be given up for a source no longer configured (its records are
    /// still in the log); an entry that could not name one is refused at its source's key.
    #[test]
    fn given_up_destinations_are_read_by_source_and_bad_entries_named() {
        let mut section = RouterSection::default();
        section.give_up.insert("gone".into(), vec!["webhooks/deleted".into(), "a/b".into()]);
        let (settings, problems) = check(&section, &iggy(), &["github".into()]);
        assert!(problems.is_empty(), "{problems:?}");
        let given_up = &settings.policies;
        assert!(given_up.is_given_up("gone", "webhooks", "deleted") && given_up.is_given_up("gone", "a", "b"));
        assert!(!given_up.is_given_up("github", "webhooks", "deleted"), "only the source named");
        for bad in ["webhooks", "a/b/c", "/t", "s/", "s p/t"] {
            let mut section = RouterSection::default();
            section.give_up.insert("gone".into(), vec![bad.into()]);
            let (_, problems) = check(&section, &iggy(), &[]);
            let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
            assert_eq!(paths, vec!["router.give_up.gone".to_string()], "{bad:?}: {problems:?}");
        }
        let mut section = RouterSection::default();
        section.give_up.insert("no such key".into(), vec!["s/t".into()]);
        assert_eq!(check(&section, &iggy(), &[]).1.len(), 1);
    }

    /// A problem with an inherited value is reported once, at [router], not again under
    /// every source that overrides something else (at a key its table does not hold);
    /// one the override itself makes is reported under the source.
    #[test]
    fn an_inherited_problem_is_reported_once_at_router() {
        let mut section = RouterSection { backoff_base_ms: 500, backoff_max_ms: 100, ..RouterSection::default() };
        section.sources.insert("a".into(), PolicyOverrides { linger_ms: Some(5), ..PolicyOverrides::default() });
        let (_, problems) = check(&section, &iggy(), &["a".into()]);
        let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
        assert_eq!(paths, ["router.backoff_max_ms"], "{problems:?}");

        let mut section = RouterSection::default();
        section.sources.insert("a".into(), PolicyOverrides { cool_down_ms: Some(0), ..PolicyOverrides::default() });
        let (_, problems) = check(&section, &iggy(), &["a".into()]);
        let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
        assert_eq!(paths, ["router.sources.a.cool_down_ms"], "{problems:?}");

        // The same bad value set in both places is reported in both.
        let mut section = RouterSection { cool_down_ms: 0, ..RouterSection::default() };
        section.sources.insert("a".into(), PolicyOverrides { cool_down_ms: Some(0), ..PolicyOverrides::default() });
        let (_, problems) = check(&section, &iggy(), &["a".into()]);
        let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
        assert_eq!(paths, ["router.cool_down_ms", "router.sources.a.cool_down_ms"], "{problems:?}");
    }

    #[test]
    fn a_source_inherits_the_defaults_and_overrides_only_what_it_names() {
        let mut section = RouterSection { batch_max_records: 500, ..RouterSection::default() };
        section.sources.insert("github".into(), PolicyOverrides { linger_ms: Some(50), ..PolicyOverrides::default() });
        let (settings, problems) = check(&section, &iggy(), &["github".into(), "stripe".into()]);
        assert!(problems.is_empty(), "{problems:?}");
        let github = settings.policies.for_source("github");
        assert_eq!((github.batch.batch_max_records, github.batch.linger), (500, Duration::from_millis(50)));
        let stripe = settings.policies.for_source("stripe");
        assert_eq!((stripe.batch.batch_max_records, stripe.batch.linger), (500, Duration::from_millis(5)));
    }

    #[test]
    fn durations_and_dead_letter_names_are_named_by_their_own_keys() {
        let cases: Vec<(RouterSection, &str)> = vec![
            (RouterSection { result_timeout_ms: 0, ..RouterSection::default() }, "router.result_timeout_ms"),
            (RouterSection { backoff_base_ms: 0, ..RouterSection::default() }, "router.backoff_base_ms"),
            // A held record asks its topic again after each cool-down: none would spin.
            (RouterSection { cool_down_ms: 0, ..RouterSection::default() }, "router.cool_down_ms"),
            (
                RouterSection { backoff_base_ms: 500, backoff_max_ms: 100, ..RouterSection::default() },
                "router.backoff_max_ms",
            ),
            (
                RouterSection {
                    on_admission_failure: "dead_letter".into(),
                    dead_letter_stream: Some("dlq".into()),
                    dead_letter_topic: Some(String::new()),
                    ..RouterSection::default()
                },
                "router.dead_letter_topic",
            ),
        ];
        each_refused_at_its_key(cases);
        // Past a u32 too: one error, not a second of the conversion's.
        for partitions_count in [0, u64::from(TOPIC_PARTITIONS_MAX) + 1, u64::from(u32::MAX) + 1] {
            let topic_defaults = TopicDefaultsSection { partitions_count, ..TopicDefaultsSection::default() };
            let (_, problems) = check(&RouterSection { topic_defaults, ..RouterSection::default() }, &iggy(), &[]);
            let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
            assert_eq!(paths, vec!["router.topic_defaults.partitions_count"], "{problems:?}");
        }
        // Values Iggy refuses for a topic, which would fail every create.
        let segment =
            |segment_size_bytes| TopicDefaultsSection { segment_size_bytes, ..TopicDefaultsSection::default() };
        let saves = |messages_required_to_save| TopicDefaultsSection {
            messages_required_to_save,
            ..TopicDefaultsSection::default()
        };
        let size = |max_topic_size_bytes, segment_size_bytes| TopicDefaultsSection {
            max_topic_size_bytes,
            segment_size_bytes,
            ..TopicDefaultsSection::default()
        };
        let refused = [
            // A size limit below one segment: the explicit one, or Iggy's default.
            (size(500_000_000, 0), "max_topic_size_bytes"),
            (size(TOPIC_SEGMENT_BYTES_DEFAULT - 1, 0), "max_topic_size_bytes"),
            (size(TOPIC_SEGMENT_BYTES_MIN * 4 - 1, TOPIC_SEGMENT_BYTES_MIN * 4), "max_topic_size_bytes"),
            (segment(1000), "segment_size_bytes"),
            (segment(TOPIC_SEGMENT_BYTES_MIN - 512), "segment_size_bytes"),
            (segment(TOPIC_SEGMENT_BYTES_MIN + 1), "segment_size_bytes"),
            (segment(TOPIC_SEGMENT_BYTES_MAX + 512), "segment_size_bytes"),
            (saves(0), "messages_required_to_save"),
            (saves(MESSAGES_REQUIRED_TO_SAVE_MAX + 1), "messages_required_to_save"),
            (saves(u64::from(u32::MAX) + 1), "messages_required_to_save"),
        ];
        for (topic_defaults, key) in refused {
            let (_, problems) = check(&RouterSection { topic_defaults, ..RouterSection::default() }, &iggy(), &[]);
            let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
            assert_eq!(paths, vec![format!("router.topic_defaults.{key}")], "{problems:?}");
        }
        for topic_defaults in [
            size(TOPIC_SEGMENT_BYTES_DEFAULT, 0),
            size(TOPIC_SEGMENT_BYTES_MIN * 4, TOPIC_SEGMENT_BYTES_MIN * 4),
            size(0, TOPIC_SEGMENT_BYTES_MIN),
            segment(0),
            segment(TOPIC_SEGMENT_BYTES_MIN),
            segment(TOPIC_SEGMENT_BYTES_MAX),
            saves(MESSAGES_REQUIRED_TO_SAVE_MAX),
            TopicDefaultsSection { message_expiry_secs: MESSAGE_EXPIRY_SECS_MAX, ..TopicDefaultsSection::default() },
        ] {
            let (_, problems) = check(
                &RouterSection { topic_defaults: topic_defaults.clone(), ..RouterSection::default() },
                &iggy(),
                &[],
            );
            assert!(problems.is_empty(), "{topic_defaults:?}: {problems:?}");
        }
        let mut section = RouterSection::default();
        section.sources.insert("a".into(), PolicyOverrides { backoff_max_ms: Some(1), ..PolicyOverrides::default() });
        let (_, problems) = check(&section, &iggy(), &["a".into()]);
        let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
        assert_eq!(paths, vec!["router.sources.a.backoff_max_ms"], "{problems:?}");
    }

    /// Every count and duration above what the router can run is refused under its own
    /// key: accepted, a limit of sends in flight above tokio's semaphore maximum, say,
    /// would panic the router's log reader at the first record, while the router kept
    /// reporting Running.
    #[test]
    fn a_limit_beyond_its_bound_is_named_by_its_own_key_path() {
        let over_day = max_duration_ms() + 1;
        let cases: Vec<(RouterSection, &str)> = vec![
            (
                RouterSection { max_concurrent_destinations: u64::MAX, ..RouterSection::default() },
                "router.max_concurrent_destinations",
            ),
            (
                RouterSection { max_concurrent_destinations: 4097, ..RouterSection::default() },
                "router.max_concurrent_destinations",
            ),
            (RouterSection { max_destinations: u64::MAX, ..RouterSection::default() }, "router.max_destinations"),
            (RouterSection { batch_max_records: u64::MAX, ..RouterSection::default() }, "router.batch_max_records"),
            (RouterSection { batch_max_bytes: u64::MAX, ..RouterSection::default() }, "router.batch_max_bytes"),
            (
                RouterSection { lane_queue_max_records: u64::MAX, ..RouterSection::default() },
                "router.lane_queue_max_records",
            ),
            (
                RouterSection { lane_queue_max_bytes: u64::MAX, ..RouterSection::default() },
                "router.lane_queue_max_bytes",
            ),
            (RouterSection { lane_queue_max_bytes: 0, ..RouterSection::default() }, "router.lane_queue_max_bytes"),
            (RouterSection { linger_ms: u64::MAX, ..RouterSection::default() }, "router.linger_ms"),
            (RouterSection { result_timeout_ms: over_day, ..RouterSection::default() }, "router.result_timeout_ms"),
            (RouterSection { backoff_max_ms: u64::MAX, ..RouterSection::default() }, "router.backoff_max_ms"),
            (RouterSection { cool_down_ms: u64::MAX, ..RouterSection::default() }, "router.cool_down_ms"),
            (RouterSection { overflow_after_ms: u64::MAX, ..RouterSection::default() }, "router.overflow_after_ms"),
            (RouterSection { prewarm_timeout_ms: u64::MAX, ..RouterSection::default() }, "router.prewarm_timeout_ms"),
            (RouterSection { queues_max_bytes: 0, ..RouterSection::default() }, "router.queues_max_bytes"),
            (
                RouterSection { lane_queue_max_bytes: 300 << 20, ..RouterSection::default() },
                "router.lane_queue_max_bytes",
            ),
            (RouterSection { queues_max_bytes: (64 << 30) + 1, ..RouterSection::default() }, "router.queues_max_bytes"),
            (
                RouterSection {
                    topic_defaults: TopicDefaultsSection {
                        message_expiry_secs: MESSAGE_EXPIRY_SECS_MAX + 1,
                        ..TopicDefaultsSection::default()
                    },
                    ..RouterSection::default()
                },
                "router.topic_defaults.message_expiry_secs",
            ),
            // The most microseconds 64 bits hold, in seconds: added to a message's time,
            // it wraps.
            (
                RouterSection {
                    topic_defaults: TopicDefaultsSection {
                        message_expiry_secs: u64::MAX / 1_000_000,
                        ..TopicDefaultsSection::default()
                    },
                    ..RouterSection::default()
                },
                "router.topic_defaults.message_expiry_secs",
            ),
        ];
        each_refused_at_its_key(cases);
        let mut section = RouterSection::default();
        section.sources.insert(
            "a".into(),
            PolicyOverrides { max_concurrent_destinations: Some(u64::MAX), ..PolicyOverrides::default() },
        );
        let (_, problems) = check(&section, &iggy(), &["a".into()]);
        let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
        assert_eq!(paths, vec!["router.sources.a.max_concurrent_destinations"], "{problems:?}");
        assert!(problems[0].1.contains("at most 4096"), "{problems:?}");
        // After a failed connect none is made for the reconnection interval: a day at most.
        for reconnection_interval_ms in [0, max_duration_ms() + 1] {
            let iggy = IggyConfig { reconnection_interval_ms, ..iggy() };
            let (_, problems) = check(&RouterSection::default(), &iggy, &[]);
            let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
            assert_eq!(paths, vec!["iggy.reconnection_interval_ms"], "{problems:?}");
        }
        // A connection's age: a second to a day, each end taken.
        for connection_max_age_ms in [0, CONNECTION_MAX_AGE_MIN_MS - 1, max_duration_ms() + 1] {
            let iggy = IggyConfig { connection_max_age_ms, ..iggy() };
            let (_, problems) = check(&RouterSection::default(), &iggy, &[]);
            let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
            assert_eq!(paths, vec!["iggy.connection_max_age_ms"], "{problems:?}");
        }
        for connection_max_age_ms in [CONNECTION_MAX_AGE_MIN_MS, max_duration_ms()] {
            let iggy = IggyConfig { connection_max_age_ms, ..iggy() };
            let (settings, problems) = check(&RouterSection::default(), &iggy, &[]);
            assert!(problems.is_empty(), "{problems:?}");
            assert_eq!(settings.sink.connection_max_age, Duration::from_millis(connection_max_age_ms));
        }
        // The bounds themselves pass.
        let section = RouterSection {
            max_concurrent_destinations: 4096,
            cool_down_ms: max_duration_ms(),
            prewarm_timeout_ms: max_duration_ms(),
            queues_max_bytes: 64 << 30,
            ..RouterSection::default()
        };
        let (_, problems) = check(&section, &iggy(), &[]);
        assert!(problems.is_empty(), "{problems:?}");
    }

    /// A result timeout the `iggy` client's own 30 s reply timeout would cut short first
    /// (as a lost connection, every destination's) is refused, globally and per source;
    /// the largest value below it passes.
    #[test]
    fn a_result_timeout_at_the_clients_reply_timeout_is_refused() {
        for ms in [30_000, 25_001] {
            each_refused_at_its_key(vec![(
                RouterSection { result_timeout_ms: ms, ..RouterSection::default() },
                "router.result_timeout_ms",
            )]);
            let mut section = RouterSection::default();
            section
                .sources
                .insert("a".into(), PolicyOverrides { result_timeout_ms: Some(ms), ..PolicyOverrides::default() });
            let (_, problems) = check(&section, &iggy(), &["a".into()]);
            let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
            assert_eq!(paths, vec!["router.sources.a.result_timeout_ms"], "{problems:?}");
        }
        let mut section = RouterSection { result_timeout_ms: 25_000, ..RouterSection::default() };
        section
            .sources
            .insert("a".into(), PolicyOverrides { result_timeout_ms: Some(25_000), ..PolicyOverrides::default() });
        let (settings, problems) = check(&section, &iggy(), &["a".into()]);
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(settings.policies.for_source("a").batch.result_timeout, Duration::from_secs(25));
    }

    #[test]
    fn a_bad_override_is_named_by_its_own_key_path() {
        let mut section = RouterSection::default();
        section.sources.insert(
            "github".into(),
            PolicyOverrides { on_admission_failure: Some("dead_letter".into()), ..PolicyOverrides::default() },
        );
        let (_, problems) = check(&section, &iggy(), &["github".into()]);
        let paths: Vec<String> = problems.iter().map(|(p, _)| p.join(".")).collect();
        assert_eq!(paths, vec!["router.sources.github.dead_letter_stream"], "{problems:?}");
    }
}
