//! Dotted paths into a JSON payload (`event.type`), the one way the door reads a field
//! of an event for routing and partition keys.
//!
//! Invariants:
//! - A path is one or more non-empty keys separated by `.`; keys cannot contain a dot
//!   (there is no escaping) and the path holds at most [`FIELD_PATH_MAX_SEGMENTS`] keys.
//! - Only objects are walked: an array, or any non-object, on the way is "missing".
//! - Only a string or a number leaf is a value; `null`, booleans, arrays, objects and
//!   the empty string are "missing". A number's value is an integer's decimal text
//!   (`42`), or the shortest text that reads back as the 64-bit float nearest to what
//!   was written (`1.50` is `1.5`: serde_json's `float_roundtrip`, so that equal numbers
//!   always give equal text), as docs/routing.md says.
//! - Looking a path up never fails and never allocates for a missing value.

use serde_json::Value;

/// The most keys a path may hold.
pub const FIELD_PATH_MAX_SEGMENTS: usize = 32;

/// A validated dotted path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldPath {
    keys: Vec<String>,
}

impl FieldPath {
    /// Parses `a.b.c`; the error says what is wrong, for the config error message.
    pub fn parse(text: &str) -> Result<FieldPath, String> {
        if text.is_empty() {
            return Err("must not be empty (a dotted path such as \"event.type\")".into());
        }
        let keys: Vec<String> = text.split('.').map(str::to_string).collect();
        if keys.iter().any(String::is_empty) {
            return Err(format!(
                "{text:?} has an empty key (a dotted path such as \"event.type\"; keys cannot contain dots)"
            ));
        }
        if keys.len() > FIELD_PATH_MAX_SEGMENTS {
            return Err(format!("{text:?} has more than {FIELD_PATH_MAX_SEGMENTS} keys"));
        }
        Ok(FieldPath { keys })
    }

    /// How many keys the path holds (at least one).
    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// The bytes of its keys' text, dots not counted.
    pub fn keys_bytes(&self) -> usize {
        self.keys.iter().map(String::len).sum()
    }

    /// The key at `depth` (0: the event's top-level key).
    pub fn key(&self, depth: usize) -> Option<&str> {
        self.keys.get(depth).map(String::as_str)
    }

    /// The path as written.
    pub fn as_dotted(&self) -> String {
        self.keys.join(".")
    }

    /// The string or number at this path, if the payload has one there.
    pub fn lookup(&self, payload: &Value) -> Option<String> {
        let mut current = payload;
        for key in &self.keys {
            current = current.as_object()?.get(key)?;
        }
        match current {
            Value::String(s) if !s.is_empty() => Some(s.clone()),
            Value::Number(n) => Some(n.to_string()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn path(p: &str) -> FieldPath {
        FieldPath::parse(p).unwrap()
    }

    #[test]
    fn walks_objects_to_a_string_or_number_leaf() {
        let v = json!({"event": {"type": "order.created", "n": 42, "f": 1.5}, "top": "x"});
        assert_eq!(path("event.type").lookup(&v).as_deref(), Some("order.created"));
        assert_eq!(path("event.n").lookup(&v).as_deref(), Some("42"));
        assert_eq!(path("event.f").lookup(&v).as_deref(), Some("1.5"));
        assert_eq!(path("top").lookup(&v).as_deref(), Some("x"));
    }

    /// What docs/routing.md says a number's value is, as the door reads it (through the
    /// routed decoder, which keeps what the paths reach).
    #[test]
    fn a_numbers_value_is_its_shortest_decimal_text() {
        let p = path("n");
        for (written, read) in [
            ("42", "42"),
            ("-7", "-7"),
            ("-0", "-0.0"),
            ("1.50", "1.5"),
            ("1e3", "1000.0"),
            ("7.0", "7.0"),
            ("18446744073709551616", "1.8446744073709552e+19"),
            // Read to the nearest double, as JSON.stringify and Python write them: the
            // same value however many trailing zeros, never a neighbour of it.
            ("26.633056045725954", "26.633056045725954"),
            ("26.6330560457259540", "26.633056045725954"),
            ("509.95969090737725", "509.95969090737725"),
            ("1e-23", "1e-23"),
            ("10e-24", "1e-23"),
        ] {
            let values = crate::json_fields::parse(&format!("{{\"n\":{written}}}"), &[&p]).unwrap();
            assert_eq!(p.lookup(&values).as_deref(), Some(read), "{written}");
        }
    }

    #[test]
    fn arrays_non_objects_and_other_leaves_are_missing() {
        let v = json!({
            "list": [{"type": "a"}],
            "s": "text",
            "leaf": {"null": null, "bool": true, "obj": {}, "arr": ["a"], "empty": ""}
        });
        for p in ["list.0.type", "list.type", "s.type", "leaf.null", "leaf.bool", "leaf.obj", "leaf.arr", "leaf.empty"]
        {
            assert_eq!(path(p).lookup(&v), None, "{p}");
        }
        assert_eq!(path("missing.deep").lookup(&v), None);
        // The payload itself is not an object.
        assert_eq!(path("a").lookup(&json!(["a"])), None);
        assert_eq!(path("a").lookup(&json!("a")), None);
    }

    #[test]
    fn a_key_with_a_dot_is_not_one_key() {
        let v = json!({"event.type": "flat", "event": {"type": "nested"}});
        assert_eq!(path("event.type").lookup(&v).as_deref(), Some("nested"));
        assert_eq!(path("event.type").lookup(&json!({"event.type": "flat"})), None);
    }

    #[test]
    fn malformed_paths_are_refused() {
        for bad in ["", ".", "a.", ".a", "a..b"] {
            assert!(FieldPath::parse(bad).is_err(), "{bad:?}");
        }
        let long = vec!["k"; FIELD_PATH_MAX_SEGMENTS + 1].join(".");
        assert!(FieldPath::parse(&long).is_err());
        let ok = vec!["k"; FIELD_PATH_MAX_SEGMENTS].join(".");
        assert_eq!(FieldPath::parse(&ok).unwrap().as_dotted(), ok);
    }
}
