//! The `route` transform: where an event goes, read from its JSON payload and looked up
//! in a static mapping table.
//!
//! Invariants:
//! - Every name a mapping yields, and both defaults, follow the narrow grammar
//!   ([`crate::admission::is_name`]): checked when the mapping is built, whether it came
//!   from the configuration file or from `mapping_url`.
//! - A mapping is never empty: an empty table is refused when it is built, so a failed
//!   or empty fetch can never turn into "everything goes to the default".
//! - Resolving is pure: the same payload and mapping give the same answer, so whether
//!   an event is matched never depends on timing.
//! - Names read straight from a payload (`stream_field`, or `topic_field` without a
//!   mapping) are not checked here: the door checks them and answers 422
//!   `invalid_destination`.

use std::collections::HashMap;

use serde_json::Value;

use crate::admission::{Admission, is_name};
use crate::field_path::FieldPath;

/// What a mapping entry names: a topic (in the default stream, or the stream read from
/// `stream_field`), or both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub stream: Option<String>,
    pub topic: String,
}

impl Target {
    /// Whether its names are ones Iggy takes; the problem, naming the field, if not.
    pub fn check(&self) -> Result<(), String> {
        if !is_name(&self.topic) {
            return Err(name_message("topic", &self.topic));
        }
        match &self.stream {
            Some(s) if !is_name(s) => Err(name_message("stream", s)),
            _ => Ok(()),
        }
    }
}

/// Field value to target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mapping {
    entries: HashMap<String, Target>,
}

impl Mapping {
    /// Builds a mapping; the error names the offending entry (for the config message).
    pub fn new(entries: impl IntoIterator<Item = (String, Target)>) -> Result<Mapping, MappingError> {
        let mut map = HashMap::new();
        for (value, target) in entries {
            if value.is_empty() {
                // A field's empty value counts as missing (`FieldPath::lookup`): never looked up.
                let message = "an empty value never matches: an event whose field is empty counts as missing it";
                return Err(MappingError::Entry { value, message: message.into() });
            }
            if let Err(message) = target.check() {
                return Err(MappingError::Entry { value, message });
            }
            if map.insert(value.clone(), target).is_some() {
                return Err(MappingError::Entry { value, message: "appears twice".into() });
            }
        }
        if map.is_empty() {
            return Err(MappingError::Empty);
        }
        Ok(Mapping { entries: map })
    }

    /// Its entries' targets, in no set order.
    pub fn targets(&self) -> impl Iterator<Item = &Target> {
        self.entries.values()
    }

    /// Whether an entry names no stream (an event it matches takes its stream from the
    /// route's `stream_field`, when there is one).
    pub fn leaves_a_stream_unnamed(&self) -> bool {
        self.entries.values().any(|t| t.stream.is_none())
    }

    /// Parses a fetched mapping: a JSON object of value to `"topic"` or
    /// `{"stream": "...", "topic": "..."}` (no other keys). A key given twice, at either
    /// level, is refused: JSON parsers disagree on which of the two counts.
    pub fn from_json(bytes: &[u8]) -> Result<Mapping, MappingError> {
        let document: Pairs = serde_json::from_slice(bytes).map_err(|e| MappingError::Malformed(e.to_string()))?;
        let mut entries = Vec::with_capacity(document.0.len());
        for (value, target) in document.0 {
            let target = match target {
                Pair::Value(Value::String(topic)) => Target { stream: None, topic },
                Pair::Object(fields) => {
                    let mut stream = None;
                    let mut topic = None;
                    for (k, v) in fields {
                        let slot = match (k.as_str(), v) {
                            ("stream", Pair::Value(Value::String(s))) => (&mut stream, s),
                            ("topic", Pair::Value(Value::String(t))) => (&mut topic, t),
                            (other, _) => {
                                return Err(MappingError::Entry {
                                    value,
                                    message: format!(
                                        "unexpected key {:?} or non-string value (expected \"stream\" and \"topic\" strings)",
                                        shorten(other)
                                    ),
                                });
                            }
                        };
                        if slot.0.replace(slot.1).is_some() {
                            return Err(MappingError::Entry { value, message: format!("{k:?} appears twice") });
                        }
                    }
                    let Some(topic) = topic else {
                        return Err(MappingError::Entry { value, message: "has no \"topic\"".into() });
                    };
                    Target { stream, topic }
                }
                Pair::Value(_) => {
                    return Err(MappingError::Entry {
                        value,
                        message: "expected a topic name or {\"stream\", \"topic\"}".into(),
                    });
                }
            };
            entries.push((value, target));
        }
        Mapping::new(entries)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn get(&self, value: &str) -> Option<&Target> {
        self.entries.get(value)
    }

    /// Every entry, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Target)> {
        self.entries.iter()
    }
}

fn name_message(what: &str, name: &str) -> String {
    format!("{what} {:?} is not a name of the grammar [a-zA-Z0-9._-] (1 to 255 bytes)", shorten(name))
}

/// A value or name as quoted in a message: at most [`QUOTED_MAX_CHARS`] characters of
/// it, and `…` when it is longer (a fetched mapping may hold keys of megabytes).
pub fn shorten(text: &str) -> String {
    let mut chars = text.chars();
    let mut quoted: String = chars.by_ref().take(QUOTED_MAX_CHARS).collect();
    if chars.next().is_some() {
        quoted.push('…');
    }
    quoted
}

/// The most characters of a value or name a message quotes.
pub const QUOTED_MAX_CHARS: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MappingError {
    #[error("the mapping is empty (an empty mapping would send every event to the default)")]
    Empty,
    #[error("not a mapping: {0}")]
    Malformed(String),
    #[error("entry {:?}: {message}", shorten(value))]
    Entry { value: String, message: String },
}

/// A JSON object's members in document order, duplicates kept, objects within kept
/// the same way one level down (a mapping's entries and their targets).
struct Pairs(Vec<(String, Pair)>);

enum Pair {
    Value(Value),
    Object(Vec<(String, Pair)>),
}

impl<'de> serde::Deserialize<'de> for Pairs {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Pairs;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Pairs, A::Error> {
                let mut pairs = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Pair>()? {
                    pairs.push((k, v));
                }
                Ok(Pairs(pairs))
            }
        }
        d.deserialize_map(Visit)
    }
}

impl<'de> serde::Deserialize<'de> for Pair {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // An object is kept member by member (its duplicates with it), at any depth;
        // anything else is a value.
        match PairOrValue::deserialize(d)? {
            PairOrValue::Object(Pairs(pairs)) => Ok(Pair::Object(pairs)),
            PairOrValue::Value(v) => Ok(Pair::Value(v)),
        }
    }
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum PairOrValue {
    Object(Pairs),
    Value(Value),
}

/// Where a route's table comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MappingSource {
    /// No table: the field's value is the topic name itself.
    Identity,
    Table(Mapping),
    /// Fetched once at start; the daemon replaces it with [`MappingSource::Table`]
    /// before it serves (a route still holding a URL matches nothing).
    Url(String),
}

/// What to do with an event whose routed field is missing or not in the mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnMissing {
    /// Send it to the default destination (counted).
    Default,
    /// Answer 200 without appending it (counted).
    Drop,
    /// Refuse the request with 422 `unknown_destination`.
    Error,
}

impl OnMissing {
    /// The metrics `action` label.
    pub fn action(self) -> &'static str {
        match self {
            OnMissing::Default => "default",
            OnMissing::Drop => "drop",
            OnMissing::Error => "error",
        }
    }
}

/// A source's route transform.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub topic_field: FieldPath,
    pub stream_field: Option<FieldPath>,
    pub mapping: MappingSource,
    pub default_stream: String,
    pub default_topic: String,
    pub on_missing: OnMissing,
}

/// The outcome of routing one payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Routed {
    Found {
        stream: String,
        topic: String,
    },
    /// A routed field is missing, or its value is not in the mapping: which one.
    Unmatched(Unmatched),
}

/// Which routed field left an event without a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unmatched {
    /// The topic field is missing (or the payload is not JSON), or its value is not in
    /// the mapping.
    Topic,
    /// The topic was found and the stream field is missing.
    Stream,
}

/// A mapping entry whose destination is known before any event arrives and refused by
/// the source's admission: every event routed by it would be answered 422.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct RefusedEntry {
    /// The field value the entry maps.
    pub value: String,
    pub stream: String,
    pub topic: String,
}

impl Route {
    /// The entries of the route's table (none until a `mapping_url` is fetched) whose
    /// destination is known without an event (the entry names its stream, or no field
    /// routes the stream, so it is the default) and that `admission` refuses, in the
    /// order of their values. One whose stream comes from an event is judged per event.
    pub fn entries_refused_by(&self, admission: &Admission) -> Vec<RefusedEntry> {
        let MappingSource::Table(mapping) = &self.mapping else { return Vec::new() };
        let mut refused: Vec<RefusedEntry> = mapping
            .iter()
            .filter_map(|(value, t)| {
                let stream = t.stream.as_ref().or(self.stream_field.is_none().then_some(&self.default_stream))?;
                admission.check(stream, &t.topic).is_err().then(|| RefusedEntry {
                    value: value.clone(),
                    stream: stream.clone(),
                    topic: t.topic.clone(),
                })
            })
            .collect();
        refused.sort();
        refused
    }

    /// Routes one payload (`None` when it is not JSON).
    ///
    /// The topic is the mapping's entry for the `topic_field` value (or the value
    /// itself without a mapping). The stream is the entry's stream if it names one,
    /// else the `stream_field` value if that field is routed, else the default stream.
    pub fn resolve(&self, payload: Option<&Value>) -> Routed {
        let Some(payload) = payload else { return Routed::Unmatched(Unmatched::Topic) };
        let Some(value) = self.topic_field.lookup(payload) else { return Routed::Unmatched(Unmatched::Topic) };
        let (entry_stream, topic) = match &self.mapping {
            MappingSource::Identity => (None, value),
            MappingSource::Table(m) => match m.get(&value) {
                Some(t) => (t.stream.clone(), t.topic.clone()),
                None => return Routed::Unmatched(Unmatched::Topic),
            },
            MappingSource::Url(_) => return Routed::Unmatched(Unmatched::Topic),
        };
        let stream = match (entry_stream, &self.stream_field) {
            (Some(s), _) => s,
            (None, Some(field)) => match field.lookup(payload) {
                Some(s) => s,
                None => return Routed::Unmatched(Unmatched::Stream),
            },
            (None, None) => self.default_stream.clone(),
        };
        Routed::Found { stream, topic }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn target(stream: Option<&str>, topic: &str) -> Target {
        Target { stream: stream.map(str::to_string), topic: topic.into() }
    }

    fn route(mapping: MappingSource, stream_field: Option<&str>) -> Route {
        Route {
            topic_field: FieldPath::parse("event.type").unwrap(),
            stream_field: stream_field.map(|f| FieldPath::parse(f).unwrap()),
            mapping,
            default_stream: "shop".into(),
            default_topic: "other".into(),
            on_missing: OnMissing::Default,
        }
    }

    fn found(stream: &str, topic: &str) -> Routed {
        Routed::Found { stream: stream.into(), topic: topic.into() }
    }

    #[test]
    fn a_mapping_names_the_topic_and_optionally_the_stream() {
        let m = Mapping::new([
            ("order.created".to_string(), target(None, "orders")),
            ("user.signup".to_string(), target(Some("users"), "signups")),
            ("7".to_string(), target(None, "sevens")),
        ])
        .unwrap();
        let r = route(MappingSource::Table(m), None);
        let ev = |t: Value| json!({"event": {"type": t}});
        assert_eq!(r.resolve(Some(&ev(json!("order.created")))), found("shop", "orders"));
        assert_eq!(r.resolve(Some(&ev(json!("user.signup")))), found("users", "signups"));
        assert_eq!(r.resolve(Some(&ev(json!(7)))), found("shop", "sevens"));
        assert_eq!(r.resolve(Some(&ev(json!("refund")))), Routed::Unmatched(Unmatched::Topic));
        assert_eq!(r.resolve(Some(&json!({"event": "order.created"}))), Routed::Unmatched(Unmatched::Topic));
        assert_eq!(r.resolve(None), Routed::Unmatched(Unmatched::Topic));
    }

    #[test]
    fn a_stream_field_gives_the_stream_unless_the_entry_names_one() {
        let m = Mapping::new([("a".to_string(), target(None, "ta")), ("b".to_string(), target(Some("fixed"), "tb"))])
            .unwrap();
        let r = route(MappingSource::Table(m), Some("tenant"));
        assert_eq!(r.resolve(Some(&json!({"tenant": "acme", "event": {"type": "a"}}))), found("acme", "ta"));
        assert_eq!(r.resolve(Some(&json!({"tenant": "acme", "event": {"type": "b"}}))), found("fixed", "tb"));
        assert_eq!(
            r.resolve(Some(&json!({"event": {"type": "a"}}))),
            Routed::Unmatched(Unmatched::Stream),
            "stream field missing"
        );
    }

    #[test]
    fn without_a_mapping_the_value_is_the_topic() {
        let r = route(MappingSource::Identity, None);
        assert_eq!(r.resolve(Some(&json!({"event": {"type": "pushes"}}))), found("shop", "pushes"));
        let url = route(MappingSource::Url("http://x/".into()), None);
        assert_eq!(url.resolve(Some(&json!({"event": {"type": "pushes"}}))), Routed::Unmatched(Unmatched::Topic));
    }

    #[test]
    fn mappings_are_checked_when_built() {
        assert_eq!(Mapping::new(Vec::new()), Err(MappingError::Empty));
        assert!(matches!(
            Mapping::new([("a".to_string(), target(None, "bad topic"))]),
            Err(MappingError::Entry { value, .. }) if value == "a"
        ));
        assert!(matches!(
            Mapping::new([("a".to_string(), target(Some("*"), "t"))]),
            Err(MappingError::Entry { value, .. }) if value == "a"
        ));
    }

    #[test]
    fn fetched_mappings_parse_both_forms_and_refuse_anything_else() {
        let m =
            Mapping::from_json(br#"{"a": "ta", "b": {"stream": "s", "topic": "tb"}, "c": {"topic": "tc"}}"#).unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m.get("b"), Some(&target(Some("s"), "tb")));
        assert_eq!(m.get("c"), Some(&target(None, "tc")));
        assert_eq!(Mapping::from_json(b"{}"), Err(MappingError::Empty));
        for bad in [
            &b"[]"[..],
            b"not json",
            br#"{"a": 1}"#,
            br#"{"a": {"stream": "s"}}"#,
            br#"{"a": {"topic": "t", "extra": "x"}}"#,
            br#"{"a": "no spaces"}"#,
            br#"{"a": {"topic": {"nested": "t"}}}"#,
        ] {
            assert!(Mapping::from_json(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    /// A key given twice is refused at either level, where serde_json's own map kept
    /// the last one silently (and an inline TOML table refuses it at load).
    #[test]
    fn a_fetched_mapping_with_a_key_given_twice_is_refused() {
        let twice = |json: &[u8]| match Mapping::from_json(json) {
            Err(MappingError::Entry { value, message }) => (value, message),
            other => panic!("{:?}: {other:?}", String::from_utf8_lossy(json)),
        };
        assert_eq!(twice(br#"{"a": "x", "b": "y", "a": "z"}"#), ("a".into(), "appears twice".into()));
        assert_eq!(twice(br#"{"a": {"topic": "x", "topic": "y"}}"#), ("a".into(), "\"topic\" appears twice".into()));
        assert_eq!(
            twice(br#"{"a": {"stream": "s", "topic": "x", "stream": "s"}}"#),
            ("a".into(), "\"stream\" appears twice".into())
        );
        assert_eq!(Mapping::from_json(br#"{"a": "x", "b": "x"}"#).map(|m| m.len()), Ok(2), "two keys, one topic");
    }

    /// An entry for the empty value is refused: an empty field counts as missing, so
    /// it could never match.
    #[test]
    fn an_entry_for_the_empty_value_is_refused() {
        for built in [Mapping::new([("".to_string(), target(None, "t"))]), Mapping::from_json(br#"{"": "t"}"#)] {
            assert!(matches!(built, Err(MappingError::Entry { ref value, .. }) if value.is_empty()), "{built:?}");
        }
    }

    /// What a refusal quotes of a value or a name is at most 64 characters: a fetched
    /// mapping may hold keys of megabytes, and the message goes into the start's error
    /// and the log.
    #[test]
    fn a_refusal_quotes_at_most_64_characters_of_a_value_or_name() {
        let long = "k".repeat(1 << 20);
        let json = format!(r#"{{"{long}": "bad topic", "{long}x": {{"{long}": "t"}}}}"#);
        let e = Mapping::from_json(json.as_bytes()).unwrap_err().to_string();
        assert!(e.len() < 400, "{} bytes: {}", e.len(), &e[..400.min(e.len())]);
        assert!(e.contains(&format!("\"{}…\"", "k".repeat(64))), "{e}");
        let topic = "t".repeat(1 << 20);
        let e = Mapping::from_json(format!(r#"{{"a": "{topic}"}}"#).as_bytes()).unwrap_err().to_string();
        assert!(e.len() < 400, "{} bytes", e.len());
        assert_eq!(shorten("short"), "short");
    }
}
