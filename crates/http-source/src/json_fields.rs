//! The fields of a JSON event that routing reads, parsed without the rest of it.
//!
//! Routing at the door reads at most a few dotted paths of an event (a route's topic and
//! stream fields, a partition key's field). Parsing the whole event into a
//! `serde_json::Value` costs many times the body's size in memory (a 1 MiB array of
//! zeros is half a million 32-byte nodes), for every request in flight. [`parse`] checks
//! the whole text as one JSON value, as serde_json does, and keeps only what lies on one
//! of the paths.
//!
//! Invariants:
//! - It accepts and refuses exactly the texts the door's check of an unrouted event
//!   accepts and refuses (serde_json skipping one JSON value, trailing characters and
//!   all), with serde_json's error (its wording can differ: a value read and a value
//!   skipped fail at the same place under different names). Like that check, it walks nesting off the
//!   paths without recursion, so depth is bounded by the body's size alone; on the paths
//!   it recurses at most [`crate::field_path::FIELD_PATH_MAX_SEGMENTS`] levels.
//! - A key given twice in an object on a path (the same key text once unescaped) is
//!   refused ([`FieldsError::DuplicateKey`]): JSON readers disagree on which one counts
//!   (serde_json and most DOM readers take the last, streaming readers often the
//!   first), so an event could be routed by one value and read downstream by the other.
//!   Keys off the paths may repeat, as the unrouted check lets them.
//! - For every path it was given, [`FieldPath::lookup`] on the result answers what it
//!   answers on the fully parsed value. A text that is well formed but holds what
//!   serde_json reads and cannot hold, on a path or in a key beside one (a number past
//!   f64's range, a lone surrogate escape: skipping only checks their syntax), has no
//!   fully parsed value: it is accepted, as the unrouted check accepts it, with nothing
//!   at any path (routing takes every field as missing).
//! - What it keeps is bounded by the paths, not by the event: the objects along them
//!   (each with only the keys on a path) and the string or number at a path's end.
//!   [`kept_bytes_max`] bounds the objects per event (the door's room counts it); the
//!   strings at the paths' ends are copies of parts of the body, at most its length in
//!   all.

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::field_path::FieldPath;

/// The most bytes one object [`parse`] keeps allocates, its key's text aside: a
/// `serde_json::Map` of at most one key per path, one node of its B-tree (632 bytes on
/// 64-bit targets), with room for an allocator's rounding. `tests/door_memory.rs`
/// measures it.
pub const KEPT_OBJECT_MAX_BYTES: usize = 768;

/// A bound of the bytes [`parse`] keeps for one event besides the strings at the paths'
/// ends: an object for each key of each path (`a.b.c` walks three objects: the event,
/// `a`, `a.b`), with its key's text. Paths that share keys share objects; each is
/// counted anyway.
pub fn kept_bytes_max(paths: &[&FieldPath]) -> usize {
    paths.iter().map(|p| p.key_count() * KEPT_OBJECT_MAX_BYTES + p.keys_bytes()).sum()
}

/// Why [`parse`] refused a text.
#[derive(Debug, thiserror::Error)]
pub enum FieldsError {
    /// Not one JSON text (serde_json's error).
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A key on a routed path given twice in one object.
    #[error(
        "the key {0:?} is given twice in one object on a routed field's path: JSON readers disagree on which one counts"
    )]
    DuplicateKey(String),
}

/// Parses `text` as one JSON value, keeping only what `paths` can reach.
pub fn parse(text: &str, paths: &[&FieldPath]) -> Result<Value, FieldsError> {
    let duplicate: Cell<Option<String>> = Cell::new(None);
    let pruned = (|| {
        let mut de = serde_json::Deserializer::from_str(text);
        let value = Pruned { paths, depth: 0, duplicate: &duplicate }.deserialize(&mut de)?;
        de.end()?;
        Ok(value)
    })();
    pruned.or_else(|e: serde_json::Error| {
        if let Some(key) = duplicate.take() {
            return Err(FieldsError::DuplicateKey(key));
        }
        match serde_json::from_str::<IgnoredAny>(text) {
            // Well formed, but not a value serde_json can hold (see the module's invariants).
            Ok(_) => Ok(Value::Null),
            Err(_) => Err(FieldsError::Json(e)),
        }
    })
}

/// The value at `depth` keys below the top, for the paths that went through the keys
/// above it.
#[derive(Clone, Copy)]
struct Pruned<'p> {
    paths: &'p [&'p FieldPath],
    depth: usize,
    /// Set to the key found twice on a path, as the parse is ended with an error.
    duplicate: &'p Cell<Option<String>>,
}

impl Pruned<'_> {
    /// A path ends here: a string or number here is a value some lookup returns.
    fn is_leaf(&self) -> bool {
        self.paths.iter().any(|p| p.key_count() == self.depth)
    }
}

impl<'de> DeserializeSeed<'de> for Pruned<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Pruned<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    // Only a string or a number at a path's end is ever looked at (see `FieldPath`):
    // everything else is kept as `null`, which no lookup returns.
    fn visit_bool<E>(self, _: bool) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(if self.is_leaf() { Value::from(v) } else { Value::Null })
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(if self.is_leaf() { Value::from(v) } else { Value::Null })
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(if self.is_leaf() { Value::from(v) } else { Value::Null })
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(if self.is_leaf() { Value::String(v.to_owned()) } else { Value::Null })
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(if self.is_leaf() { Value::String(v) } else { Value::Null })
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        // No path walks into an array.
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Value::Null)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut kept = Map::new();
        while let Some(Key(key)) = map.next_key()? {
            let on_a_path = |p: &&&FieldPath| p.key(self.depth) == Some(key.as_ref());
            if !self.paths.iter().any(|p| on_a_path(&p)) {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            let below: Vec<&FieldPath> = self.paths.iter().filter(on_a_path).copied().collect();
            let value =
                map.next_value_seed(Pruned { paths: &below, depth: self.depth + 1, duplicate: self.duplicate })?;
            if kept.contains_key(key.as_ref()) {
                self.duplicate.set(Some(key.clone().into_owned()));
                return Err(serde::de::Error::custom(format!("the key {:?} is given twice", key.as_ref())));
            }
            kept.insert(key.into_owned(), value);
        }
        Ok(Value::Object(kept))
    }
}

/// An object's key, borrowed from the text where it has no escapes.
struct Key<'de>(Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object key")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(p: &str) -> FieldPath {
        FieldPath::parse(p).unwrap()
    }

    /// Texts that exercise every kind of value on and off the paths: nesting, arrays on
    /// the way, keys repeated off the paths, escapes in keys and values, numbers of every
    /// form, and leaves that are not strings or numbers.
    const TEXTS: &[&str] = &[
        r#"{"event": {"type": "order.created", "n": 42, "f": 1.5}, "top": "x"}"#,
        r#"{"event": {"type": 7}, "customer": {"id": -12}}"#,
        r#"{"event": {"type": 1e3}, "customer": {"id": 18446744073709551615}}"#,
        r#"{"event": {"type": 123456789012345678901234567890}, "customer": {"id": 0.1}}"#,
        r#"{"event": [{"type": "a"}], "customer": "id"}"#,
        r#"{"pad": 1, "pad": 2, "event": {"other": 1, "other": 2, "type": "t"}}"#,
        r#"{"ev\u0065nt": {"t\u0079pe": "escaped \"key\" \u00e9"}}"#,
        r#"{"event": {"type": null, "other": {"type": "no"}}, "customer": {"id": true}}"#,
        r#"{"event": {"type": ""}, "customer": {"id": {}}}"#,
        r#"{"event.type": "flat", "event": {"type.x": "dotted"}}"#,
        r#"["event", {"type": "x"}]"#,
        r#""a string""#,
        "42",
        "null",
        r#"{"pad": [1, 2, [3, {"event": {"type": "deep"}}]], "event": {"pad": "x", "type": "t"}}"#,
    ];

    #[test]
    fn every_lookup_answers_as_on_the_fully_parsed_value() {
        let paths = [path("event.type"), path("customer.id"), path("top"), path("event.type.x"), path("event.n")];
        let refs: Vec<&FieldPath> = paths.iter().collect();
        for text in TEXTS {
            let full: Value = serde_json::from_str(text).unwrap();
            let pruned = parse(text, &refs).unwrap_or_else(|e| panic!("{text}: {e}"));
            for p in &paths {
                assert_eq!(p.lookup(&pruned), p.lookup(&full), "{} in {text}", p.as_dotted());
            }
            // Each path alone, too: the paths must not need each other.
            for p in &paths {
                let alone = parse(text, &[p]).unwrap();
                assert_eq!(p.lookup(&alone), p.lookup(&full), "{} alone in {text}", p.as_dotted());
            }
        }
    }

    /// A key on a path given twice in one object, however it is written, is refused:
    /// the event would be routed by one value and could be read downstream by the other.
    #[test]
    fn a_key_given_twice_on_a_path_is_refused() {
        let paths = [path("event.type"), path("tenant")];
        let refs: Vec<&FieldPath> = paths.iter().collect();
        for (text, key) in [
            (r#"{"event": {"type": "first"}, "event": {"type": "second"}}"#, "event"),
            (r#"{"event": {"type": "first"}, "event": 5}"#, "event"),
            (r#"{"event": {"type": "a", "type": "b"}}"#, "type"),
            (r#"{"tenant": "acme", "x": 1, "tenant": "evil"}"#, "tenant"),
        ] {
            match parse(text, &refs) {
                Err(FieldsError::DuplicateKey(k)) => assert_eq!(k, key, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn it_accepts_and_refuses_what_the_unrouted_check_does() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        let deep_on_the_path = format!("{}1{}", r#"{"a":"#.repeat(200), "}".repeat(200));
        let texts =
            ["", "{", r#"{"a": }"#, r#"{"a": 1} x"#, "[1,]", r#"{"a" 1}"#, "nul", r#""\x""#, &deep, &deep_on_the_path];
        // Well formed, yet no value serde_json can hold: a number past f64's range, a
        // lone surrogate escape, on a path, beside one and at the top.
        let unholdable = [
            r#"{"a": 1e400}"#,
            "1e400",
            r#"{"a": "\ud800"}"#,
            r#"{"a": {"a": 1}, "\ud800": 1}"#,
            r#"{"b": 1e400, "a": "x"}"#,
        ];
        let texts: Vec<&str> = texts.into_iter().chain(unholdable).collect();
        let long = vec!["a"; crate::field_path::FIELD_PATH_MAX_SEGMENTS].join(".");
        for text in texts {
            let theirs = serde_json::from_str::<IgnoredAny>(text).is_ok();
            for p in [path("a"), path(&long)] {
                assert_eq!(parse(text, &[&p]).is_ok(), theirs, "{text:?} with {}", p.as_dotted());
            }
        }
    }

    /// Such a text has nothing at its paths: routing takes the fields as missing (its
    /// default or its refusal), where before the request was refused 400 on a routed
    /// source and taken on an unrouted one.
    #[test]
    fn a_text_serde_json_cannot_hold_has_nothing_at_its_paths() {
        let a = path("a");
        for text in [r#"{"a": 1e400}"#, r#"{"a": "x", "\udc00": 1}"#, "1e400"] {
            assert!(serde_json::from_str::<Value>(text).is_err(), "{text} is holdable after all");
            assert_eq!(a.lookup(&parse(text, &[&a]).unwrap()), None, "{text}");
        }
        // What serde_json can hold beside it is read as ever.
        assert_eq!(a.lookup(&parse(r#"{"a": "x", "b": 1e400}"#, &[&a]).unwrap()), Some("x".to_string()));
    }

    #[test]
    fn what_is_kept_is_bounded_by_the_paths_not_by_the_event() {
        let big = format!(
            r#"{{"event": {{"type": "t", "pad": "{}"}}, "list": [{}0]}}"#,
            "x".repeat(1 << 16),
            "0,".repeat(1 << 16)
        );
        let kept = parse(&big, &[&path("event.type")]).unwrap();
        assert_eq!(kept, serde_json::json!({"event": {"type": "t"}}));
        // Nothing of the text at all when no key is on a path.
        assert_eq!(parse(&big, &[&path("other")]).unwrap(), serde_json::json!({}));
    }
}
