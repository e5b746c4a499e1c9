//! How an event is spread over its topic's partitions: balanced, a fixed partition id,
//! a fixed key, or a key read per request (header) or per event (dotted path).
//!
//! Invariants:
//! - A missing key value is never an error: the event goes balanced and the miss is
//!   reported to the caller (which counts it).
//! - A key is 1 to [`KEY_MAX_BYTES`] bytes, what Iggy accepts: a longer value is
//!   replaced by its SHA-256 (32 bytes), so events with the same long key still land in
//!   the same partition and no event is refused for its key's length.
//! - `key_u32` keys are the four little-endian bytes of the number, as Iggy's own
//!   `messages_key_u32` builds them; a value that is not a `u32` counts as missing.
//! - Partition id bounds are not checked here: the router checks them against the
//!   topic's partition count.

use axum::http::HeaderMap;
use ingest::Partitioning;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::field_path::FieldPath;

/// The longest key Iggy takes.
pub const KEY_MAX_BYTES: usize = 255;

/// Where a key is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeySource {
    /// A request header (lower-case name): the same key for every event of the request.
    Header(String),
    /// A dotted path into each event's JSON payload.
    Field(FieldPath),
}

/// How the value read becomes key bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyEncoding {
    /// The value's bytes (a header's raw bytes, a field's UTF-8 text).
    Bytes,
    /// The value parsed as a decimal `u32`, as four little-endian bytes.
    U32,
}

/// A source's partitioning rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PartitionRule {
    /// The same partitioning for every event (balanced, a partition id or a fixed key).
    Fixed(Partitioning),
    Key {
        source: KeySource,
        encoding: KeyEncoding,
    },
}

impl Default for PartitionRule {
    fn default() -> Self {
        PartitionRule::Fixed(Partitioning::Balanced)
    }
}

/// Why a key could not be read; the metrics `reason` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyMiss {
    Missing,
    NotU32,
}

impl KeyMiss {
    pub fn reason(self) -> &'static str {
        match self {
            KeyMiss::Missing => "missing",
            KeyMiss::NotU32 => "not_u32",
        }
    }
}

/// How many events of a request had their partition key missing, by reason: what
/// routing counts of a request once it is accepted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeyMisses {
    pub missing: u64,
    pub not_u32: u64,
}

impl KeyMisses {
    pub fn add(&mut self, miss: KeyMiss) {
        match miss {
            KeyMiss::Missing => self.missing += 1,
            KeyMiss::NotU32 => self.not_u32 += 1,
        }
    }
}

impl PartitionRule {
    /// The payload field a key is read from, if any.
    pub fn field(&self) -> Option<&FieldPath> {
        match self {
            PartitionRule::Key { source: KeySource::Field(path), .. } => Some(path),
            _ => None,
        }
    }

    /// The partitioning of one event, and why its key was missing if it was.
    pub fn partitioning(&self, headers: &HeaderMap, payload: Option<&Value>) -> (Partitioning, Option<KeyMiss>) {
        let (source, encoding) = match self {
            PartitionRule::Fixed(p) => return (p.clone(), None),
            PartitionRule::Key { source, encoding } => (source, *encoding),
        };
        let raw: Option<Vec<u8>> = match source {
            KeySource::Header(name) => last_value(headers, name).map(|v| v.as_bytes().to_vec()),
            KeySource::Field(path) => payload.and_then(|p| path.lookup(p)).map(String::into_bytes),
        };
        let raw = match raw {
            Some(r) if !r.is_empty() => r,
            _ => return (Partitioning::Balanced, Some(KeyMiss::Missing)),
        };
        match encoding {
            KeyEncoding::Bytes => (Partitioning::Key(clamp_key(raw)), None),
            // Blanks are spaces and tabs, as in a header's value; not every Unicode space.
            KeyEncoding::U32 => match std::str::from_utf8(&raw)
                .ok()
                .and_then(|s| s.trim_matches(|c| c == ' ' || c == '\t').parse::<u32>().ok())
            {
                Some(n) => (Partitioning::Key(n.to_le_bytes().to_vec()), None),
                None => (Partitioning::Balanced, Some(KeyMiss::NotU32)),
            },
        }
    }
}

/// The value of header `name`, its last when it was sent more than once: the one a
/// forwarded header keeps (Iggy holds one value per header name), so that an event's
/// partition key and the header it carries to Iggy never disagree.
pub(crate) fn last_value<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a axum::http::HeaderValue> {
    headers.get_all(name).iter().next_back()
}

/// A key Iggy takes: itself when short enough, else its SHA-256.
pub fn clamp_key(raw: Vec<u8>) -> Vec<u8> {
    if raw.len() <= KEY_MAX_BYTES { raw } else { Sha256::digest(&raw).to_vec() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;
    use serde_json::json;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn header_keys_are_the_raw_bytes_or_a_u32() {
        let rule = PartitionRule::Key { source: KeySource::Header("x-tenant".into()), encoding: KeyEncoding::Bytes };
        let h = headers(&[("x-tenant", "acme")]);
        assert_eq!(rule.partitioning(&h, None), (Partitioning::Key(b"acme".to_vec()), None));
        assert_eq!(rule.partitioning(&HeaderMap::new(), None), (Partitioning::Balanced, Some(KeyMiss::Missing)));
        // Sent more than once: the last value, the one the header forwarded with the
        // event keeps.
        let mut twice = headers(&[("x-tenant", "first")]);
        twice.append("x-tenant", HeaderValue::from_static("last"));
        assert_eq!(rule.partitioning(&twice, None), (Partitioning::Key(b"last".to_vec()), None));
        let u32_rule = PartitionRule::Key { source: KeySource::Header("x-tenant".into()), encoding: KeyEncoding::U32 };
        assert_eq!(
            u32_rule.partitioning(&headers(&[("x-tenant", "258")]), None),
            (Partitioning::Key(vec![2, 1, 0, 0]), None)
        );
        assert_eq!(u32_rule.partitioning(&h, None), (Partitioning::Balanced, Some(KeyMiss::NotU32)));
        assert_eq!(
            u32_rule.partitioning(&headers(&[("x-tenant", "4294967296")]), None),
            (Partitioning::Balanced, Some(KeyMiss::NotU32))
        );
        // As docs/routing.md says: surrounding blanks, a leading `+` and leading zeros
        // are taken; a sign of minus, a fraction or an exponent is not.
        for seven in ["7", " 7 ", "+7", "007", "+0007"] {
            let h = headers(&[("x-tenant", seven)]);
            assert_eq!(u32_rule.partitioning(&h, None), (Partitioning::Key(vec![7, 0, 0, 0]), None), "{seven:?}");
        }
        for not_u32 in ["-7", "7.0", "7e0", "0x7", "7 7"] {
            let h = headers(&[("x-tenant", not_u32)]);
            assert_eq!(u32_rule.partitioning(&h, None), (Partitioning::Balanced, Some(KeyMiss::NotU32)), "{not_u32:?}");
        }
        // Blanks are spaces and tabs: a payload's other Unicode spaces are not taken.
        let field_rule = PartitionRule::Key {
            source: KeySource::Field(FieldPath::parse("id").unwrap()),
            encoding: KeyEncoding::U32,
        };
        assert_eq!(
            field_rule.partitioning(&HeaderMap::new(), Some(&json!({"id": "\t7 "}))),
            (Partitioning::Key(vec![7, 0, 0, 0]), None)
        );
        for other_space in ["\u{a0}7", "7\u{3000}"] {
            assert_eq!(
                field_rule.partitioning(&HeaderMap::new(), Some(&json!({ "id": other_space }))),
                (Partitioning::Balanced, Some(KeyMiss::NotU32)),
                "{other_space:?}"
            );
        }
    }

    #[test]
    fn field_keys_come_from_each_payload() {
        let path = FieldPath::parse("customer.id").unwrap();
        let rule = PartitionRule::Key { source: KeySource::Field(path.clone()), encoding: KeyEncoding::Bytes };
        let p = json!({"customer": {"id": "c-1"}});
        assert_eq!(rule.partitioning(&HeaderMap::new(), Some(&p)), (Partitioning::Key(b"c-1".to_vec()), None));
        let missing = json!({"customer": {}});
        assert_eq!(
            rule.partitioning(&HeaderMap::new(), Some(&missing)),
            (Partitioning::Balanced, Some(KeyMiss::Missing))
        );
        assert_eq!(rule.partitioning(&HeaderMap::new(), None), (Partitioning::Balanced, Some(KeyMiss::Missing)));
        let n = PartitionRule::Key { source: KeySource::Field(path), encoding: KeyEncoding::U32 };
        let p = json!({"customer": {"id": 7}});
        assert_eq!(n.partitioning(&HeaderMap::new(), Some(&p)), (Partitioning::Key(vec![7, 0, 0, 0]), None));
    }

    #[test]
    fn long_keys_become_their_hash_and_short_ones_stay() {
        let exact = vec![b'k'; KEY_MAX_BYTES];
        assert_eq!(clamp_key(exact.clone()), exact);
        let long = vec![b'k'; KEY_MAX_BYTES + 1];
        let hashed = clamp_key(long.clone());
        assert_eq!(hashed.len(), 32);
        assert_eq!(hashed, clamp_key(long), "the same long key maps to the same partition key");
        assert_ne!(hashed, clamp_key(vec![b'j'; KEY_MAX_BYTES + 1]));
    }

    #[test]
    fn fixed_rules_ignore_the_request() {
        let rule = PartitionRule::Fixed(Partitioning::PartitionId(3));
        assert_eq!(rule.partitioning(&headers(&[("x", "y")]), None), (Partitioning::PartitionId(3), None));
        assert!(rule.field().is_none());
    }
}
