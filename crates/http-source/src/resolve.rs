//! Resolving a request's destinations at the door: each event is routed, checked
//! against the grammar and the source's admission, and partitioned, before anything is
//! appended, while the sender still owns the events.
//!
//! Invariants:
//! - All or nothing: if any event is refused (unknown destination with
//!   `on_missing_destination = "error"`, a name outside the grammar, denylisted, not
//!   allowlisted), the whole request is refused, naming the NDJSON line, and no event
//!   of it is kept.
//! - Dropped events (`on_missing_destination = "drop"`) are only counted; the kept
//!   events keep their request order and their place in the request
//!   (`Event::request_index`, which a keyed event's message id is derived from).
//! - Pure: nothing is counted or appended here; the door counts what this returns once
//!   it knows the request's fate.

use axum::http::HeaderMap;
use bytes::Bytes;
use ingest::{Destination, Event};
use serde_json::Value;

use crate::admission::{Refusal, is_name};
use crate::partition::KeyMisses;
use crate::route::{OnMissing, Routed, Unmatched, shorten};
use crate::source::{Destinations, SourceSpec};

/// The events to append, and what was counted on the way.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Resolution {
    pub events: Vec<Event>,
    /// Events left out by `on_missing_destination = "drop"`.
    pub dropped: u64,
    /// Events sent to the default destination because their route was missing.
    pub defaulted: u64,
    /// Events sent balanced because their partition key was missing or not a `u32`.
    pub key_misses: KeyMisses,
}

/// Why a request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalKind {
    /// The routed field is missing or unmapped and `on_missing_destination = "error"`.
    Unknown,
    /// A name read from the payload is outside the grammar.
    Invalid,
    Admission(Refusal),
}

impl RefusalKind {
    /// The answer's `error` code.
    pub fn code(self) -> &'static str {
        match self {
            RefusalKind::Unknown => "unknown_destination",
            RefusalKind::Invalid => "invalid_destination",
            RefusalKind::Admission(r) => r.code(),
        }
    }

    /// The `reason` label of `iggy_connector_destinations_rejected_total`.
    pub fn reason(self) -> &'static str {
        match self {
            RefusalKind::Unknown => "unknown",
            RefusalKind::Invalid => "invalid",
            RefusalKind::Admission(r) => r.reason(),
        }
    }
}

/// A refused request: the first refused event, its NDJSON line, and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub kind: RefusalKind,
    pub line: Option<usize>,
    pub message: String,
}

/// Resolves every event of a request; `lines` are the NDJSON lines of the events,
/// `values` what their JSON holds at the fields routing reads when the body decoder kept
/// it (else parsed here if needed, [`crate::json_fields`]).
pub fn resolve(
    source: &SourceSpec,
    headers: &HeaderMap,
    events: Vec<Bytes>,
    lines: Option<&[usize]>,
    values: Option<Vec<Value>>,
) -> Result<Resolution, Rejection> {
    let fields = source.fields_read();
    let mut out = Resolution { events: Vec::with_capacity(events.len()), ..Resolution::default() };
    let mut values = values.map(Vec::into_iter);
    for (i, payload) in events.into_iter().enumerate() {
        let line = lines.and_then(|l| l.get(i).copied());
        let reject = |kind: RefusalKind, message: String| {
            let message = match line {
                Some(n) => format!("line {n}: {message}"),
                None => message,
            };
            Rejection { kind, line, message }
        };
        let kept = values.as_mut().and_then(Iterator::next);
        let json: Option<Value> = match kept {
            Some(v) => Some(v),
            None if !fields.is_empty() => {
                match simdutf8::basic::from_utf8(&payload).map(|text| crate::json_fields::parse(text, &fields)) {
                    Ok(Ok(v)) => Some(v),
                    // Routed by one of two values a reader may take: refused, as at the body's check.
                    Ok(Err(e @ crate::json_fields::FieldsError::DuplicateKey(_))) => {
                        return Err(reject(RefusalKind::Invalid, e.to_string()));
                    }
                    // Not JSON: no field is there (a source that takes any content type).
                    Ok(Err(crate::json_fields::FieldsError::Json(_))) | Err(_) => None,
                }
            }
            None => None,
        };
        let (stream, topic) = match &source.destinations {
            Destinations::Fixed { stream, topic } => (stream.clone(), topic.clone()),
            Destinations::Routed(route) => match route.resolve(json.as_ref()) {
                Routed::Found { stream, topic } => {
                    for (what, name) in [("stream", &stream), ("topic", &topic)] {
                        if !is_name(name) {
                            return Err(reject(
                                RefusalKind::Invalid,
                                format!(
                                    "the routed {what} {:?} is not a name of the grammar [a-zA-Z0-9._-] (1 to 255 bytes)",
                                    shorten(name)
                                ),
                            ));
                        }
                    }
                    (stream, topic)
                }
                Routed::Unmatched(which) => match route.on_missing {
                    OnMissing::Default => {
                        out.defaulted += 1;
                        (route.default_stream.clone(), route.default_topic.clone())
                    }
                    OnMissing::Drop => {
                        out.dropped += 1;
                        continue;
                    }
                    OnMissing::Error => {
                        let why = match (which, &route.stream_field) {
                            (Unmatched::Stream, Some(field)) => format!("{} is missing", field.as_dotted()),
                            _ => format!("{} is missing or not in the mapping", route.topic_field.as_dotted()),
                        };
                        return Err(reject(RefusalKind::Unknown, format!("no destination for this event ({why})")));
                    }
                },
            },
        };
        if let Err(r) = source.admission.check(&stream, &topic) {
            let why = match r {
                Refusal::Denylisted => "is denylisted for this source",
                Refusal::NotAllowlisted => "is not allowlisted for this source",
            };
            return Err(reject(RefusalKind::Admission(r), format!("destination {stream}/{topic} {why}")));
        }
        let (partitioning, miss) = source.partitioning.partitioning(headers, json.as_ref());
        if let Some(m) = miss {
            out.key_misses.add(m);
        }
        // Bounded far below `u32::MAX` by the source's event limit.
        let request_index = u32::try_from(i).unwrap_or(u32::MAX);
        out.events.push(Event { destination: Destination { stream, topic, partitioning }, payload, request_index });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::{Admission, Rule};
    use crate::body::Accept;
    use crate::field_path::FieldPath;
    use crate::partition::{KeyEncoding, KeySource, PartitionRule};
    use crate::route::{Mapping, MappingSource, Route, Target};
    use crate::source::MetadataFields;
    use ingest::Partitioning;

    fn spec(on_missing: OnMissing, admission: Admission, partitioning: PartitionRule) -> SourceSpec {
        let mapping = Mapping::new([
            ("a".to_string(), Target { stream: None, topic: "ta".into() }),
            ("b".to_string(), Target { stream: None, topic: "tb".into() }),
        ])
        .unwrap();
        SourceSpec {
            key: "shop".into(),
            destinations: Destinations::Routed(Route {
                topic_field: FieldPath::parse("type").unwrap(),
                stream_field: Some(FieldPath::parse("tenant").unwrap()),
                mapping: MappingSource::Table(mapping),
                default_stream: "shop".into(),
                default_topic: "other".into(),
                on_missing,
            }),
            partitioning,
            admission,
            accept: Accept::Any,
            named_path: true,
            auth: crate::auth::AuthScheme::None,
            forward_headers: Vec::new(),
            metadata: MetadataFields::default(),
            idempotency_header: None,
            idempotency: true,
        }
    }

    #[test]
    fn the_destinations_known_at_start_are_the_default_and_literal_allowlist_entries() {
        let balanced = PartitionRule::Fixed(Partitioning::Balanced);
        let rules = [("shop", "other"), ("shop", "ta"), ("audit", "*"), ("*", "tb"), ("shop", "ta")];
        let allow = Admission::Allowlist(rules.iter().map(|(s, t)| Rule::parse(s, t).unwrap()).collect());
        let known = spec(OnMissing::Default, allow, balanced.clone()).destinations_known_at_start();
        assert_eq!(known, vec![("shop".to_string(), "other".to_string()), ("shop".to_string(), "ta".to_string())]);
        // A default the admission refuses is not among them.
        let deny = Admission::Denylist(vec![Rule::parse("shop", "other").unwrap()]);
        assert!(spec(OnMissing::Default, deny, balanced.clone()).destinations_known_at_start().is_empty());
        // Nor a default no event can fall back to.
        for on_missing in [OnMissing::Error, OnMissing::Drop] {
            assert!(spec(on_missing, Admission::Open, balanced.clone()).destinations_known_at_start().is_empty());
        }
    }

    fn events(lines: &[&str]) -> Vec<Bytes> {
        lines.iter().map(|l| Bytes::copy_from_slice(l.as_bytes())).collect()
    }

    fn topics(r: &Resolution) -> Vec<String> {
        r.events.iter().map(|e| format!("{}/{}", e.destination.stream, e.destination.topic)).collect()
    }

    #[test]
    fn each_event_is_routed_on_its_own_and_unmatched_ones_follow_the_action() {
        let body = events(&[r#"{"type":"a","tenant":"t1"}"#, r#"{"type":"zzz"}"#, r#"{"type":"b","tenant":"t2"}"#]);
        let fixed = PartitionRule::default();
        let r = resolve(
            &spec(OnMissing::Default, Admission::Open, fixed.clone()),
            &HeaderMap::new(),
            body.clone(),
            None,
            None,
        )
        .unwrap();
        assert_eq!(topics(&r), ["t1/ta", "shop/other", "t2/tb"]);
        assert_eq!((r.defaulted, r.dropped), (1, 0));
        let r = resolve(
            &spec(OnMissing::Drop, Admission::Open, fixed.clone()),
            &HeaderMap::new(),
            body.clone(),
            None,
            None,
        )
        .unwrap();
        assert_eq!(topics(&r), ["t1/ta", "t2/tb"]);
        assert_eq!(&r.events[1].payload[..], br#"{"type":"b","tenant":"t2"}"#);
        assert_eq!((r.defaulted, r.dropped), (0, 1));
        // Each kept event keeps its place in the request, which its message id follows.
        assert_eq!(r.events.iter().map(|e| e.request_index).collect::<Vec<_>>(), [0, 2]);
        let e =
            resolve(&spec(OnMissing::Error, Admission::Open, fixed), &HeaderMap::new(), body, Some(&[1, 2, 4]), None)
                .unwrap_err();
        assert_eq!((e.kind, e.line), (RefusalKind::Unknown, Some(2)));
        assert!(e.message.starts_with("line 2: "), "{}", e.message);
    }

    /// The refusal of an event with no destination names the routed field that left it
    /// without one: the stream field when the topic was found (it named the topic
    /// field, present and mapped, before).
    #[test]
    fn a_refusal_for_no_destination_names_the_field_that_is_missing() {
        let strict = spec(OnMissing::Error, Admission::Open, PartitionRule::default());
        let refusal = |line: &str| resolve(&strict, &HeaderMap::new(), events(&[line]), None, None).unwrap_err();
        let e = refusal(r#"{"type":"a"}"#);
        assert_eq!(e.message, "no destination for this event (tenant is missing)");
        for unmapped in [r#"{"type":"zzz","tenant":"t1"}"#, r#"{"tenant":"t1"}"#, "not json"] {
            let e = refusal(unmapped);
            assert_eq!(
                e.message, "no destination for this event (type is missing or not in the mapping)",
                "{unmapped}"
            );
        }
    }

    #[test]
    fn admission_and_the_grammar_refuse_the_whole_request() {
        let deny = Admission::Denylist(vec![Rule::parse("*", "tb").unwrap()]);
        let body = events(&[r#"{"type":"a","tenant":"t1"}"#, r#"{"type":"b","tenant":"t2"}"#]);
        let e = resolve(
            &spec(OnMissing::Default, deny, PartitionRule::default()),
            &HeaderMap::new(),
            body.clone(),
            None,
            None,
        )
        .unwrap_err();
        assert_eq!(e.kind, RefusalKind::Admission(Refusal::Denylisted));
        assert_eq!(e.kind.code(), "denylisted");
        let allow = Admission::Allowlist(vec![Rule::parse("t1", "*").unwrap()]);
        let e =
            resolve(&spec(OnMissing::Default, allow, PartitionRule::default()), &HeaderMap::new(), body, None, None)
                .unwrap_err();
        assert_eq!((e.kind.code(), e.kind.reason()), ("not_allowlisted", "not_allowlisted"));
        let bad = events(&[r#"{"type":"a","tenant":"no/slashes"}"#]);
        let e = resolve(
            &spec(OnMissing::Default, Admission::Open, PartitionRule::default()),
            &HeaderMap::new(),
            bad,
            None,
            None,
        )
        .unwrap_err();
        assert_eq!(e.kind.code(), "invalid_destination");
    }

    #[test]
    fn partition_keys_are_read_per_event_and_misses_reported() {
        let rule = PartitionRule::Key {
            source: KeySource::Field(FieldPath::parse("customer").unwrap()),
            encoding: KeyEncoding::Bytes,
        };
        let body = events(&[r#"{"type":"a","tenant":"t","customer":"c1"}"#, r#"{"type":"a","tenant":"t"}"#]);
        let r = resolve(&spec(OnMissing::Default, Admission::Open, rule), &HeaderMap::new(), body, None, None).unwrap();
        assert_eq!(r.events[0].destination.partitioning, Partitioning::Key(b"c1".to_vec()));
        assert_eq!(r.events[1].destination.partitioning, Partitioning::Balanced);
        assert_eq!(r.key_misses, KeyMisses { missing: 1, not_u32: 0 });
    }
}
