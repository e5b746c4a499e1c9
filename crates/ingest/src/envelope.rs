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
//!   delivery id when there is one, scoped like the idempotency key (source, and the
//!   endpoint for a request through one), so a duplicate delivery that slips past the
//!   idempotency window still carries the same id and two endpoints' deliveries never
//!   share one; random otherwise. Replaying the log sends the same id again.
//! - Decoding rejects an unknown version instead of guessing.

use std::sync::Arc;

use bytes::Bytes;
use serde::ser::SerializeSeq;
use serde::{Deserialize, Serialize, Serializer};
use sha2::{Digest, Sha256};

/// The version byte written first in every record.
pub const ENVELOPE_VERSION: u8 = 1;

/// How a message is spread over a topic's partitions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Partitioning {
    /// Round robin over the topic's partitions (placed by the router, one turn per
    /// destination).
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

/// [`EnvelopeHeader`] with every field borrowed: what the door encodes, so that writing
/// a record copies no string into a header first. The same fields in the same order
/// with the same serde shapes, so postcard writes exactly the bytes the owned header
/// would (a test holds the two together).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct EnvelopeHeaderRef<'a> {
    pub message_id: u128,
    pub received_at_unix_ms: u64,
    pub source_key: &'a str,
    pub endpoint_id: Option<u128>,
    pub content_type: Option<&'a str>,
    pub metadata: MetadataRef<'a>,
    pub headers: &'a [(String, Vec<u8>)],
    pub idempotency_key: Option<&'a str>,
    pub batch_index: u32,
    pub batch_len: u32,
    pub destination: &'a Destination,
}

/// A metadata value as the door holds it: text it already has (the peer address,
/// formatted once per connection), or a number, recorded as its decimal text. Either way
/// the record holds a string, so nothing is formatted into a `String` per request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetadataValue {
    Text(Arc<str>),
    Decimal(u64),
}

/// The metadata of a header being encoded: an owned header's strings, or the door's
/// values. Both write the same shape, a list of (name, value) strings.
#[derive(Debug, Clone, Copy)]
pub enum MetadataRef<'a> {
    Strings(&'a [(String, String)]),
    Values(&'a [(&'static str, MetadataValue)]),
}

impl MetadataRef<'_> {
    /// The encoded length of the list (its varint length, then each name and value).
    fn encoded_len(&self) -> usize {
        match self {
            MetadataRef::Strings(pairs) => pairs_bytes(pairs.len(), pairs.iter().map(|(n, v)| (n.len(), v.len()))),
            MetadataRef::Values(pairs) => pairs_bytes(
                pairs.len(),
                pairs.iter().map(|(n, v)| {
                    let value_len = match v {
                        MetadataValue::Text(t) => t.len(),
                        MetadataValue::Decimal(d) => decimal_digits(*d),
                    };
                    (n.len(), value_len)
                }),
            ),
        }
    }
}

impl Serialize for MetadataRef<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            MetadataRef::Strings(pairs) => pairs.serialize(serializer),
            MetadataRef::Values(pairs) => {
                let mut seq = serializer.serialize_seq(Some(pairs.len()))?;
                let mut digits = itoa::Buffer::new();
                for (name, value) in pairs.iter() {
                    let value: &str = match value {
                        MetadataValue::Text(t) => t,
                        MetadataValue::Decimal(d) => digits.format(*d),
                    };
                    seq.serialize_element(&(*name, value))?;
                }
                seq.end()
            }
        }
    }
}

impl EnvelopeHeaderRef<'_> {
    /// The length of this header's postcard encoding, computed without encoding it:
    /// integers as varints, a string or byte string as its varint length and its bytes, an
    /// option as a tag byte and its value, a list as its varint length and its elements,
    /// an enum as its varint variant index and its value.
    pub fn encoded_len(&self) -> usize {
        let d = self.destination;
        varint_bytes(self.message_id)
            + varint_bytes(self.received_at_unix_ms.into())
            + text_bytes(self.source_key.len())
            + 1
            + self.endpoint_id.map_or(0, varint_bytes)
            + 1
            + self.content_type.map_or(0, |c| text_bytes(c.len()))
            + self.metadata.encoded_len()
            + pairs_bytes(self.headers.len(), self.headers.iter().map(|(n, v)| (n.len(), v.len())))
            + 1
            + self.idempotency_key.map_or(0, |k| text_bytes(k.len()))
            + varint_bytes(self.batch_index.into())
            + varint_bytes(self.batch_len.into())
            + text_bytes(d.stream.len())
            + text_bytes(d.topic.len())
            + match &d.partitioning {
                Partitioning::Balanced => 1,
                Partitioning::Key(k) => 1 + text_bytes(k.len()),
                Partitioning::PartitionId(id) => 1 + varint_bytes((*id).into()),
            }
    }
}

impl EnvelopeHeader {
    /// The bytes this decoded header holds on the heap: its strings and lists (each
    /// list's elements counted at their size).
    pub fn heap_bytes(&self) -> usize {
        let pair = std::mem::size_of::<(String, String)>();
        let d = &self.destination;
        let partition_key = match &d.partitioning {
            Partitioning::Key(k) => k.len(),
            _ => 0,
        };
        self.source_key.len()
            + self.content_type.as_ref().map_or(0, String::len)
            + self.metadata.iter().map(|(n, v)| pair + n.len() + v.len()).sum::<usize>()
            + self.headers.iter().map(|(n, v)| pair + n.len() + v.len()).sum::<usize>()
            + self.idempotency_key.as_ref().map_or(0, String::len)
            + d.stream.len()
            + d.topic.len()
            + partition_key
    }

    /// This header, borrowed.
    pub fn as_ref(&self) -> EnvelopeHeaderRef<'_> {
        EnvelopeHeaderRef {
            message_id: self.message_id,
            received_at_unix_ms: self.received_at_unix_ms,
            source_key: &self.source_key,
            endpoint_id: self.endpoint_id,
            content_type: self.content_type.as_deref(),
            metadata: MetadataRef::Strings(&self.metadata),
            headers: &self.headers,
            idempotency_key: self.idempotency_key.as_deref(),
            batch_index: self.batch_index,
            batch_len: self.batch_len,
            destination: &self.destination,
        }
    }
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
        Envelope::encode_ref(&header.as_ref(), payload)
    }

    /// [`Envelope::encode`] from borrowed fields.
    ///
    /// The record's buffer is allocated at its exact length, so it is never grown (a
    /// copy of everything written so far) and becomes `Bytes` without a second
    /// allocation (`Bytes::from` a `Vec` whose length is its capacity takes it whole).
    pub fn encode_ref(header: &EnvelopeHeaderRef<'_>, payload: &[u8]) -> Bytes {
        let len = 1 + header.encoded_len() + payload.len();
        let mut out = Vec::with_capacity(len);
        out.push(ENVELOPE_VERSION);
        // Serializing plain structs of strings, integers and vectors into a Vec cannot fail.
        if let Err(e) = postcard::serialize_with_flavor(header, VecFlavor(&mut out)) {
            unreachable!("postcard into a Vec failed: {e}");
        }
        out.extend_from_slice(payload);
        debug_assert_eq!(out.len(), len, "encoded_len disagrees with postcard");
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

/// postcard's output into an existing `Vec`, a byte with `push` and a slice with
/// `extend_from_slice` (its own `to_extend` goes through `Extend` one byte at a time).
struct VecFlavor<'a>(&'a mut Vec<u8>);

impl postcard::ser_flavors::Flavor for VecFlavor<'_> {
    type Output = ();

    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.0.push(data);
        Ok(())
    }

    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(data);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
}

/// What a reader needs to pick a record's lane and account for it, read from the record
/// without copying or allocating anything (the full [`Envelope::decode`] allocates every
/// string). The router reads every record; most it only routes, or skips for a lane that
/// re-reads the log itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvelopeSummary<'a> {
    pub message_id: u128,
    pub received_at_unix_ms: u64,
    pub source_key: &'a str,
    pub stream: &'a str,
    pub topic: &'a str,
    pub payload_len: usize,
}

/// [`EnvelopeHeader`] as borrowed views of the record's bytes: the same fields in the same
/// order, so postcard reads the same encoding. The lists are walked, not collected.
#[derive(Deserialize)]
struct HeaderView<'a> {
    message_id: u128,
    received_at_unix_ms: u64,
    source_key: &'a str,
    _endpoint_id: Option<u128>,
    _content_type: Option<&'a str>,
    _metadata: Skipped<(&'a str, &'a str)>,
    _headers: Skipped<(&'a str, &'a [u8])>,
    _idempotency_key: Option<&'a str>,
    _batch_index: u32,
    _batch_len: u32,
    stream: &'a str,
    topic: &'a str,
    _partitioning: PartitioningView<'a>,
}

/// [`Partitioning`], borrowed. Read only to find where the payload begins.
#[derive(Deserialize)]
#[allow(dead_code)]
enum PartitioningView<'a> {
    Balanced,
    Key(&'a [u8]),
    PartitionId(u32),
}

/// A sequence read element by element and dropped.
struct Skipped<T>(std::marker::PhantomData<T>);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Skipped<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Walk<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Walk<T> {
            type Value = Skipped<T>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a sequence")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<T>()?.is_some() {}
                Ok(Skipped(std::marker::PhantomData))
            }
        }
        d.deserialize_seq(Walk(std::marker::PhantomData))
    }
}

impl Envelope {
    /// Reads a record's [`EnvelopeSummary`]; accepts exactly what [`Envelope::decode`]
    /// accepts (a test holds the two together).
    pub fn summarize(record: &[u8]) -> Result<EnvelopeSummary<'_>, EnvelopeError> {
        let (&version, rest) = record.split_first().ok_or(EnvelopeError::Empty)?;
        if version != ENVELOPE_VERSION {
            return Err(EnvelopeError::UnknownVersion(version));
        }
        let (h, tail) =
            postcard::take_from_bytes::<HeaderView<'_>>(rest).map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
        Ok(EnvelopeSummary {
            message_id: h.message_id,
            received_at_unix_ms: h.received_at_unix_ms,
            source_key: h.source_key,
            stream: h.stream,
            topic: h.topic,
            payload_len: tail.len(),
        })
    }
}

/// The message id for event `request_index` of a delivery the sender named `key` (its
/// place in the request, counted before routing dropped any), through
/// `endpoint_id` (`None`: the source's named path): the first 128 bits of SHA-256 over a
/// domain tag, the endpoint id (for an endpoint, under its own tag), the source key, the
/// delivery key and the index. Stable across retries and restarts; a named-path id is
/// what it was before ids were scoped by endpoint.
pub fn message_id_for_delivery(source_key: &str, endpoint_id: Option<u128>, key: &str, request_index: u32) -> u128 {
    let mut h = Sha256::new();
    match endpoint_id {
        None => h.update(b"iggy-ingest/message-id/v1\0"),
        Some(id) => {
            h.update(b"iggy-ingest/message-id/v1/endpoint\0");
            h.update(id.to_be_bytes());
        }
    }
    h.update(source_key.as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    h.update([0]);
    h.update(request_index.to_be_bytes());
    let digest = h.finalize();
    let mut first = [0u8; 16];
    first.copy_from_slice(&digest[..16]);
    u128::from_be_bytes(first)
}

/// The longest value the door lets into each of an envelope's client-chosen text
/// fields: the content type, the delivery id, a forwarded header's value, a stream or
/// topic name and a partition key (what Iggy takes in a header, a name or a key).
pub const ENVELOPE_FIELD_MAX_BYTES: usize = 255;

/// The bytes of a postcard varint holding `n`.
fn varint_bytes(n: u128) -> usize {
    let mut bytes = 1;
    let mut rest = n >> 7;
    while rest > 0 {
        rest >>= 7;
        bytes += 1;
    }
    bytes
}

/// The bytes of a postcard string (or byte vector) of `len` bytes: its varint length,
/// then the bytes.
fn text_bytes(len: usize) -> usize {
    varint_bytes(len as u128) + len
}

/// The bytes of a postcard list of `count` (name, value) pairs of strings whose lengths
/// `lens` gives: its varint length, then each name and value.
fn pairs_bytes(count: usize, lens: impl Iterator<Item = (usize, usize)>) -> usize {
    varint_bytes(count as u128) + lens.map(|(n, v)| text_bytes(n) + text_bytes(v)).sum::<usize>()
}

/// The digits of `n` in decimal, as `itoa` writes it.
fn decimal_digits(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |log| log as usize + 1)
}

/// The most bytes a record can hold beside its event: the version byte and an
/// [`EnvelopeHeader`] whose every field is as long as the door lets it be. What varies
/// with configuration is passed in: the source key's length, the forwarded headers'
/// name lengths (their values are at most [`ENVELOPE_FIELD_MAX_BYTES`]) and the metadata
/// fields as (name length, longest value). So `max_body_bytes` plus this is the largest
/// record a source can write, which the configuration check holds under
/// `wal.record_max_bytes` (a test encodes a header at every maximum and gets exactly
/// this). The door asks it of every request's source: nothing here allocates.
pub fn envelope_max_bytes(
    source_key_bytes: usize,
    forwarded_name_bytes: impl ExactSizeIterator<Item = usize>,
    metadata: &[(usize, usize)],
) -> usize {
    let field = text_bytes(ENVELOPE_FIELD_MAX_BYTES);
    1 // ENVELOPE_VERSION
        + varint_bytes(u128::MAX) // message_id
        + varint_bytes(u64::MAX.into()) // received_at_unix_ms
        + text_bytes(source_key_bytes)
        + 1 + varint_bytes(u128::MAX) // endpoint_id
        + 1 + field // content_type
        + pairs_bytes(metadata.len(), metadata.iter().copied())
        + pairs_bytes(forwarded_name_bytes.len(), forwarded_name_bytes.map(|n| (n, ENVELOPE_FIELD_MAX_BYTES)))
        + 1 + field // idempotency_key
        + 2 * varint_bytes(u32::MAX.into()) // batch_index, batch_len
        + 2 * field // stream, topic
        + 1 + field.max(varint_bytes(u32::MAX.into())) // partitioning: a key or an id
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

    /// `header()`, one with every optional field empty and odd header bytes, and one
    /// with two metadata entries and balanced partitioning.
    fn variants() -> Vec<EnvelopeHeader> {
        let mut bare = header();
        bare.endpoint_id = None;
        bare.content_type = None;
        bare.metadata = vec![];
        bare.headers = vec![("a".into(), vec![]), ("b".into(), vec![0, 255, 7]), ("c".into(), b"zz".to_vec())];
        bare.idempotency_key = None;
        bare.destination.partitioning = Partitioning::PartitionId(u32::MAX);
        let mut two = header();
        two.metadata = vec![("peer_addr".into(), "[::1]:9".into()), ("received_at_unix_ms".into(), "1".into())];
        two.destination.partitioning = Partitioning::Balanced;
        vec![header(), bare, two]
    }

    #[test]
    fn the_borrowed_header_writes_the_owned_headers_bytes() {
        for h in variants() {
            let owned = postcard::to_allocvec(&h).unwrap();
            assert_eq!(postcard::to_allocvec(&h.as_ref()).unwrap(), owned, "{h:?}");
            assert_eq!(h.as_ref().encoded_len(), owned.len(), "{h:?}");
            let record = Envelope::encode_ref(&h.as_ref(), b"p");
            assert_eq!(record.len(), 1 + owned.len() + 1);
            assert_eq!(&record[1..1 + owned.len()], &owned[..]);
            assert_eq!(Envelope::decode(&record).unwrap().header, h);
        }
    }

    /// The door's metadata values write the bytes of the same metadata as strings, and
    /// `encoded_len` counts them (a number's decimal text included).
    #[test]
    fn door_metadata_values_write_the_strings_bytes() {
        for received_at in [0, 9, 10, 1_700_000_000_123, u64::MAX] {
            for peer in ["127.0.0.1:5000", "[::1]:9", ""] {
                let mut h = header();
                h.metadata =
                    vec![("peer_addr".into(), peer.into()), ("received_at_unix_ms".into(), received_at.to_string())];
                let values = [
                    ("peer_addr", MetadataValue::Text(peer.into())),
                    ("received_at_unix_ms", MetadataValue::Decimal(received_at)),
                ];
                let door = EnvelopeHeaderRef { metadata: MetadataRef::Values(&values), ..h.as_ref() };
                let owned = postcard::to_allocvec(&h).unwrap();
                assert_eq!(postcard::to_allocvec(&door).unwrap(), owned, "{received_at} {peer}");
                assert_eq!(door.encoded_len(), owned.len(), "{received_at} {peer}");
                assert_eq!(Envelope::decode(&Envelope::encode_ref(&door, b"p")).unwrap().header, h);
            }
        }
    }

    #[test]
    fn a_summary_reads_what_decode_reads_without_copying() {
        for (i, h) in variants().iter().enumerate() {
            for payload in [&b""[..], b"x", &[0u8; 3000][..]] {
                let bytes = Envelope::encode(h, payload);
                let s = Envelope::summarize(&bytes).unwrap_or_else(|e| panic!("variant {i}: {e}"));
                let e = Envelope::decode(&bytes).unwrap();
                assert_eq!(s.message_id, e.header.message_id);
                assert_eq!(s.received_at_unix_ms, e.header.received_at_unix_ms);
                assert_eq!(s.source_key, e.header.source_key);
                assert_eq!((s.stream, s.topic), (&*e.header.destination.stream, &*e.header.destination.topic));
                assert_eq!(s.payload_len, e.payload.len(), "variant {i}");
                // Every cut of the record that decode refuses, summarize refuses too.
                for cut in 0..bytes.len() - payload.len() {
                    let short = bytes.slice(..cut);
                    assert_eq!(Envelope::summarize(&short).is_ok(), Envelope::decode(&short).is_ok(), "cut at {cut}");
                }
            }
        }
        assert_eq!(Envelope::summarize(&[]), Err(EnvelopeError::Empty));
        assert_eq!(Envelope::summarize(&[9, 0]), Err(EnvelopeError::UnknownVersion(9)));
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
        let a = message_id_for_delivery("github", None, "abc", 0);
        // The named path's ids are what they were before ids were scoped by endpoint
        // (SHA-256 over the v1 tag, "github", "abc" and index 0, computed independently).
        assert_eq!(a, 0x67c1f914d3b342c906fe186aaf738de6);
        assert_eq!(a, message_id_for_delivery("github", None, "abc", 0));
        assert_ne!(a, message_id_for_delivery("github", None, "abc", 1));
        assert_ne!(a, message_id_for_delivery("stripe", None, "abc", 0));
        assert_ne!(a, message_id_for_delivery("github", None, "abd", 0));
        let e1 = message_id_for_delivery("github", Some(1), "abc", 0);
        assert_eq!(e1, message_id_for_delivery("github", Some(1), "abc", 0));
        assert_ne!(e1, a, "an endpoint's delivery is not the named path's");
        assert_ne!(e1, message_id_for_delivery("github", Some(2), "abc", 0), "nor another endpoint's");
        assert_ne!(random_message_id(), random_message_id());
    }

    /// The bound is exact: a header with every field at its longest encodes to it.
    #[test]
    fn a_header_at_every_maximum_encodes_to_exactly_envelope_max_bytes() {
        let long = |n: usize| "x".repeat(n);
        let field = ENVELOPE_FIELD_MAX_BYTES;
        for (key_bytes, names, metadata) in
            [(1, vec![], vec![]), (255, vec![14, 64], vec![(9, 64), (19, 20)]), (40, vec![200; 30], vec![(9, 64)])]
        {
            let header = EnvelopeHeader {
                message_id: u128::MAX,
                received_at_unix_ms: u64::MAX,
                source_key: long(key_bytes),
                endpoint_id: Some(u128::MAX),
                content_type: Some(long(field)),
                metadata: metadata.iter().map(|&(n, v)| (long(n), long(v))).collect(),
                headers: names.iter().map(|&n| (long(n), vec![b'v'; field])).collect(),
                idempotency_key: Some(long(field)),
                batch_index: u32::MAX,
                batch_len: u32::MAX,
                destination: Destination {
                    stream: long(field),
                    topic: long(field),
                    partitioning: Partitioning::Key(vec![b'k'; field]),
                },
            };
            let encoded = Envelope::encode(&header, b"");
            assert_eq!(1 + header.as_ref().encoded_len(), encoded.len(), "multi-byte varints counted");
            assert_eq!(
                encoded.len(),
                envelope_max_bytes(key_bytes, names.iter().copied(), &metadata),
                "key {key_bytes}, names {names:?}"
            );
        }
    }
}
