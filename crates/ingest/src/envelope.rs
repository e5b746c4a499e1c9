//! The record format the door writes into the log: a versioned envelope around the
//! event's raw bytes.
//!
//! Layout of one log record: `[ENVELOPE_VERSION: u8][postcard(EnvelopeHeader)][payload]`.
//! The payload is the remainder of the record, stored as received (no re-encoding), so
//! a reader gets it back without a copy.
//!
//! Invariants:
//! - The destination is resolved before the record is written and stored in it; nothing
//!   downstream re-derives it from configuration.
//! - The message id is fixed when the record is written: derived from the sender's
//!   delivery id when there is one (so a duplicate delivery that slips past the
//!   idempotency window still carries the same id), random otherwise. Replaying the log
//!   sends the same id again.
//! - Decoding rejects an unknown version instead of guessing.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The version byte written first in every record.
pub const ENVELOPE_VERSION: u8 = 1;

/// How a message is spread over a topic's partitions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Partitioning {
    /// The broker picks (round robin).
    Balanced,
    /// Messages with the same key go to the same partition.
    Key(Vec<u8>),
    /// A fixed partition id (checked against the topic's partition count on delivery).
    PartitionId(u32),
}

/// Where a message goes: resolved at the door, stored in the record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Destination {
    pub stream: String,
    pub topic: String,
    pub partitioning: Partitioning,
}

/// Everything about an event except its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EnvelopeHeader {
    /// Stable 128-bit id of this message.
    pub message_id: u128,
    pub received_at_unix_ms: u64,
    pub source_key: String,
    /// The secret-path endpoint the event came through, if any.
    pub endpoint_id: Option<u128>,
    pub content_type: Option<String>,
    /// Configured metadata (`peer_addr`, `received_at`), name and value.
    pub metadata: Vec<(String, String)>,
    /// Forwarded request headers, lower-case name and value (clamped).
    pub headers: Vec<(String, Vec<u8>)>,
    /// The sender's delivery id, when the request carried one.
    pub idempotency_key: Option<String>,
    /// Position of this event in its request, and the request's event count.
    pub batch_index: u32,
    pub batch_len: u32,
    pub destination: Destination,
}

/// One record: header plus the event's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    pub header: EnvelopeHeader,
    pub payload: Bytes,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EnvelopeError {
    #[error("empty record")]
    Empty,
    #[error("unknown envelope version {0} (this build reads {ENVELOPE_VERSION})")]
    UnknownVersion(u8),
    #[error("malformed envelope header: {0}")]
    Malformed(String),
}

impl Envelope {
    /// Encodes the record bytes written to the log.
    pub fn encode(header: &EnvelopeHeader, payload: &[u8]) -> Bytes {
        let mut out = Vec::with_capacity(payload.len() + 128);
        out.push(ENVELOPE_VERSION);
        // Serializing plain structs of strings, integers and vectors into a Vec cannot fail.
        let out = match postcard::to_extend(header, out) {
            Ok(v) => v,
            Err(e) => unreachable!("postcard into a Vec failed: {e}"),
        };
        let mut out = out;
        out.extend_from_slice(payload);
        Bytes::from(out)
    }

    /// Decodes a record read back from the log.
    pub fn decode(record: &Bytes) -> Result<Envelope, EnvelopeError> {
        let (&version, rest) = record.split_first().ok_or(EnvelopeError::Empty)?;
        if version != ENVELOPE_VERSION {
            return Err(EnvelopeError::UnknownVersion(version));
        }
        let (header, tail) =
            postcard::take_from_bytes::<EnvelopeHeader>(rest).map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
        let payload_start = record.len() - tail.len();
        Ok(Envelope { header, payload: record.slice(payload_start..) })
    }
}

/// The message id for event `batch_index` of a delivery the sender named `key`: the
/// first 128 bits of SHA-256 over a domain tag, the source key, the delivery key and
/// the index. Stable across retries and restarts.
pub fn message_id_for_delivery(source_key: &str, key: &str, batch_index: u32) -> u128 {
    let mut h = Sha256::new();
    h.update(b"iggy-ingest/message-id/v1\0");
    h.update(source_key.as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    h.update([0]);
    h.update(batch_index.to_be_bytes());
    let digest = h.finalize();
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    u128::from_be_bytes(first)
}

/// A random message id, for events that came without a delivery id.
pub fn random_message_id() -> u128 {
    rand::random::<u128>()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> EnvelopeHeader {
        EnvelopeHeader {
            message_id: 0x0123_4567_89ab_cdef_0123_4567_89ab_cdef,
            received_at_unix_ms: 1_700_000_000_123,
            source_key: "github".into(),
            endpoint_id: Some(7),
            content_type: Some("application/json".into()),
            metadata: vec![("peer_addr".into(), "127.0.0.1:5000".into())],
            headers: vec![("x-github-event".into(), b"push".to_vec())],
            idempotency_key: Some("d-1".into()),
            batch_index: 0,
            batch_len: 1,
            destination: Destination {
                stream: "s".into(),
                topic: "t".into(),
                partitioning: Partitioning::Key(b"k".to_vec()),
            },
        }
    }

    #[test]
    fn round_trips_header_and_payload() {
        let h = header();
        let bytes = Envelope::encode(&h, b"{\"a\":1}");
        let e = Envelope::decode(&bytes).unwrap();
        assert_eq!(e.header, h);
        assert_eq!(&e.payload[..], b"{\"a\":1}");
    }

    #[test]
    fn rejects_unknown_version_and_garbage() {
        let mut bytes = Envelope::encode(&header(), b"x").to_vec();
        bytes[0] = 9;
        assert_eq!(Envelope::decode(&Bytes::from(bytes)), Err(EnvelopeError::UnknownVersion(9)));
        assert_eq!(Envelope::decode(&Bytes::new()), Err(EnvelopeError::Empty));
        assert!(matches!(Envelope::decode(&Bytes::from_static(&[1, 0xff])), Err(EnvelopeError::Malformed(_))));
    }

    #[test]
    fn delivery_ids_are_stable_and_distinct() {
        let a = message_id_for_delivery("github", "abc", 0);
        assert_eq!(a, message_id_for_delivery("github", "abc", 0));
        assert_ne!(a, message_id_for_delivery("github", "abc", 1));
        assert_ne!(a, message_id_for_delivery("stripe", "abc", 0));
        assert_ne!(a, message_id_for_delivery("github", "abd", 0));
        assert_ne!(random_message_id(), random_message_id());
    }
}
