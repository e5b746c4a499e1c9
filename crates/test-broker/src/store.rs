//! In-memory streams, topics and messages.
//!
//! Invariants:
//! - stream ids are 0-based in creation order, topic ids 0-based within their
//!   stream, partition ids `0..partitions_count` (as the server numbers them);
//! - names are unique per stream (streams) and per stream (topics); creating
//!   an existing name fails with `StreamNameAlreadyExists` /
//!   `TopicNameAlreadyExists` and changes nothing;
//! - a topic keeps every accepted message in arrival order; offsets are dense
//!   and increase by one per message within a partition;
//! - an append is all or nothing: either every message of the batch is stored
//!   or none is.

use bytes::Bytes;
use iggy_binary_protocol::{WireIdentifier, WireOptions, WirePartitioning, WirePollingStrategy};
use iggy_common::{HeaderKey, HeaderValue, Identifier, IggyError, TopicCreateOptions};
use std::collections::{BTreeMap, HashMap};
use std::time::{SystemTime, UNIX_EPOCH};

/// One message as the broker stored it.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredMessage {
    /// The id the client sent.
    pub id: u128,
    pub partition_id: u32,
    /// Offset within the partition, from 0.
    pub offset: u64,
    /// Arrival time at the broker, microseconds since the Unix epoch.
    pub timestamp: u64,
    /// The client's origin timestamp, microseconds.
    pub origin_timestamp: u64,
    /// The frame checksum the client computed, returned as-is on poll.
    pub checksum: u64,
    pub payload: Bytes,
    /// The user headers decoded (empty when the message had none).
    pub headers: BTreeMap<HeaderKey, HeaderValue>,
    /// The user headers as encoded on the wire.
    pub raw_headers: Option<Bytes>,
}

/// A message of an incoming batch, before it gets a partition and an offset.
pub(crate) struct NewMessage {
    pub id: u128,
    pub origin_timestamp: u64,
    pub checksum: u64,
    pub payload: Bytes,
    pub headers: BTreeMap<HeaderKey, HeaderValue>,
    pub raw_headers: Option<Bytes>,
}

pub(crate) struct Stream {
    pub id: u32,
    pub name: String,
    pub created_at: u64,
    pub topics: Vec<Topic>,
}

pub(crate) struct Topic {
    pub id: u32,
    pub name: String,
    pub created_at: u64,
    pub partitions_count: u32,
    /// The options block exactly as the client sent it.
    pub wire_options: WireOptions,
    /// The same options parsed, with `partitions_count` filled in.
    pub options: TopicCreateOptions,
    /// Every message, in arrival order across partitions.
    pub messages: Vec<StoredMessage>,
    next_offsets: Vec<u64>,
    round_robin: u32,
}

impl Topic {
    /// The next offset of `partition` (its message count).
    pub fn next_offset(&self, partition: u32) -> u64 {
        self.next_offsets.get(partition as usize).copied().unwrap_or(0)
    }

    pub fn partition_messages(&self, partition: u32) -> impl Iterator<Item = &StoredMessage> {
        self.messages.iter().filter(move |message| message.partition_id == partition)
    }

    pub fn size_bytes(&self) -> u64 {
        self.messages.iter().map(|message| message.payload.len() as u64).sum()
    }
}

/// Where a batch landed.
pub(crate) struct Appended {
    pub stream_id: u32,
    pub topic_id: u32,
    pub partition_id: u32,
    pub base_offset: u64,
}

/// What a poll returns.
pub(crate) struct Polled {
    pub partition_id: u32,
    pub current_offset: u64,
    pub messages: Vec<StoredMessage>,
}

pub(crate) fn now_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
}

fn stream_not_found() -> IggyError {
    IggyError::StreamIdNotFound(Identifier::default())
}

fn topic_not_found() -> IggyError {
    IggyError::TopicIdNotFound(Identifier::default(), Identifier::default())
}

fn matches(id: &WireIdentifier, numeric: u32, name: &str) -> bool {
    match id {
        WireIdentifier::Numeric(value) => *value == numeric,
        WireIdentifier::String(value) => value.as_str() == name,
    }
}

#[derive(Default)]
pub(crate) struct Store {
    streams: Vec<Stream>,
    /// Stored consumer offsets: (consumer, stream id, topic id, partition).
    consumer_offsets: HashMap<(String, u32, u32, u32), u64>,
}

impl Store {
    pub fn stream(&self, id: &WireIdentifier) -> Option<&Stream> {
        self.streams.iter().find(|stream| matches(id, stream.id, &stream.name))
    }

    pub fn topic(&self, stream_id: &WireIdentifier, topic_id: &WireIdentifier) -> Result<(&Stream, &Topic), IggyError> {
        let stream = self.stream(stream_id).ok_or_else(stream_not_found)?;
        let topic =
            stream.topics.iter().find(|topic| matches(topic_id, topic.id, &topic.name)).ok_or_else(topic_not_found)?;
        Ok((stream, topic))
    }

    fn topic_mut(
        &mut self,
        stream_id: &WireIdentifier,
        topic_id: &WireIdentifier,
    ) -> Result<(u32, &mut Topic), IggyError> {
        let stream = self
            .streams
            .iter_mut()
            .find(|stream| matches(stream_id, stream.id, &stream.name))
            .ok_or_else(stream_not_found)?;
        let stream_numeric = stream.id;
        let topic = stream
            .topics
            .iter_mut()
            .find(|topic| matches(topic_id, topic.id, &topic.name))
            .ok_or_else(topic_not_found)?;
        Ok((stream_numeric, topic))
    }

    /// Looks a destination up by names (for inspection).
    pub fn topic_by_names(&self, stream: &str, topic: &str) -> Option<&Topic> {
        self.streams
            .iter()
            .find(|candidate| candidate.name == stream)?
            .topics
            .iter()
            .find(|candidate| candidate.name == topic)
    }

    fn topic_by_names_mut(&mut self, stream: &str, topic: &str) -> Option<&mut Topic> {
        self.streams
            .iter_mut()
            .find(|candidate| candidate.name == stream)?
            .topics
            .iter_mut()
            .find(|candidate| candidate.name == topic)
    }

    /// Adds partitions to `stream`/`topic` until it has `partitions_count`, as an
    /// operator's `create_partitions` would (the new ones empty). `false` when the
    /// destination does not exist or already has at least that many.
    pub fn grow_partitions(&mut self, stream: &str, topic: &str, partitions_count: u32) -> bool {
        let Some(t) = self.topic_by_names_mut(stream, topic) else { return false };
        if partitions_count <= t.partitions_count {
            return false;
        }
        t.partitions_count = partitions_count;
        t.options.partitions_count = Some(partitions_count);
        t.next_offsets.resize(partitions_count as usize, 0);
        true
    }

    /// Removes partitions from the end of `stream`/`topic` until it has
    /// `partitions_count`, as an operator's `delete_partitions` would (their messages
    /// stay listed for inspection). `false` when the destination does not exist or has
    /// at most that many (0 leaves the topic with none, as deleting every partition does).
    pub fn shrink_partitions(&mut self, stream: &str, topic: &str, partitions_count: u32) -> bool {
        let Some(t) = self.topic_by_names_mut(stream, topic) else { return false };
        if partitions_count >= t.partitions_count {
            return false;
        }
        t.partitions_count = partitions_count;
        t.options.partitions_count = Some(partitions_count);
        t.next_offsets.truncate(partitions_count as usize);
        true
    }

    /// The names a pair of identifiers refers to: the identifiers' own names
    /// when they are named, the stored names when they are numeric.
    pub fn names_of(&self, stream_id: &WireIdentifier, topic_id: &WireIdentifier) -> Option<(String, String)> {
        let stream_name = match stream_id {
            WireIdentifier::String(name) => name.as_str().to_owned(),
            WireIdentifier::Numeric(_) => self.stream(stream_id)?.name.clone(),
        };
        let topic_name = match topic_id {
            WireIdentifier::String(name) => name.as_str().to_owned(),
            WireIdentifier::Numeric(_) => self.topic(stream_id, topic_id).ok()?.1.name.clone(),
        };
        Some((stream_name, topic_name))
    }

    pub fn create_stream(&mut self, name: &str) -> Result<&Stream, IggyError> {
        if self.streams.iter().any(|stream| stream.name == name) {
            return Err(IggyError::StreamNameAlreadyExists(name.to_owned()));
        }
        let id = u32::try_from(self.streams.len()).map_err(|_| IggyError::InvalidCommand)?;
        self.streams.push(Stream { id, name: name.to_owned(), created_at: now_micros(), topics: Vec::new() });
        self.streams.last().ok_or(IggyError::InvalidCommand)
    }

    pub fn create_topic(
        &mut self,
        stream_id: &WireIdentifier,
        name: &str,
        partitions_count: u32,
        wire_options: WireOptions,
        mut options: TopicCreateOptions,
    ) -> Result<&Topic, IggyError> {
        let stream = self
            .streams
            .iter_mut()
            .find(|stream| matches(stream_id, stream.id, &stream.name))
            .ok_or_else(stream_not_found)?;
        if stream.topics.iter().any(|topic| topic.name == name) {
            return Err(IggyError::TopicNameAlreadyExists(name.to_owned(), Identifier::default()));
        }
        // The server holds at most this many topics in one stream (its metadata state
        // machine refuses the next with `TooManyTopics`).
        if stream.topics.len() >= iggy_binary_protocol::namespace::MAX_TOPICS {
            return Err(IggyError::TooManyTopics);
        }
        let id = u32::try_from(stream.topics.len()).map_err(|_| IggyError::InvalidCommand)?;
        options.partitions_count = Some(partitions_count);
        stream.topics.push(Topic {
            id,
            name: name.to_owned(),
            created_at: now_micros(),
            partitions_count,
            wire_options,
            options,
            messages: Vec::new(),
            next_offsets: vec![0; partitions_count as usize],
            round_robin: 0,
        });
        stream.topics.last().ok_or(IggyError::InvalidCommand)
    }

    /// Appends a batch to one partition. Missing stream, topic or partition
    /// fail with `StreamIdNotFound`, `TopicIdNotFound`, `PartitionNotFound`.
    pub fn append(
        &mut self,
        stream_id: &WireIdentifier,
        topic_id: &WireIdentifier,
        partitioning: &WirePartitioning,
        messages: Vec<NewMessage>,
    ) -> Result<Appended, IggyError> {
        let (stream_numeric, topic) = self.topic_mut(stream_id, topic_id)?;
        let count = topic.partitions_count;
        if count == 0 {
            return Err(topic_not_found());
        }
        let partition_id = match partitioning {
            WirePartitioning::PartitionId(id) => *id,
            WirePartitioning::Balanced => {
                let next = topic.round_robin % count;
                topic.round_robin = topic.round_robin.wrapping_add(1);
                next
            }
            WirePartitioning::MessagesKey(key) => iggy_common::calculate_32(key) % count,
        };
        let not_found =
            || IggyError::PartitionNotFound(partition_id as usize, Identifier::default(), Identifier::default());
        let next_offset = topic.next_offsets.get_mut(partition_id as usize).ok_or_else(not_found)?;
        let base_offset = *next_offset;
        let timestamp = now_micros();
        for message in messages {
            let offset = *next_offset;
            *next_offset += 1;
            topic.messages.push(StoredMessage {
                id: message.id,
                partition_id,
                offset,
                timestamp,
                origin_timestamp: message.origin_timestamp,
                checksum: message.checksum,
                payload: message.payload,
                headers: message.headers,
                raw_headers: message.raw_headers,
            });
        }
        Ok(Appended { stream_id: stream_numeric, topic_id: topic.id, partition_id, base_offset })
    }

    /// Reads up to `count` messages of one partition. Strategies: offset,
    /// timestamp (arrival time at or after the value), first, last (the last
    /// `count`), next (after the consumer's stored offset). `auto_commit`
    /// stores the last returned offset for the consumer.
    #[allow(clippy::too_many_arguments)]
    pub fn poll(
        &mut self,
        consumer: String,
        stream_id: &WireIdentifier,
        topic_id: &WireIdentifier,
        partition_id: u32,
        strategy: WirePollingStrategy,
        count: u32,
        auto_commit: bool,
    ) -> Result<Polled, IggyError> {
        let (stream, topic) = self.topic(stream_id, topic_id)?;
        if partition_id >= topic.partitions_count {
            return Err(IggyError::PartitionNotFound(
                partition_id as usize,
                Identifier::default(),
                Identifier::default(),
            ));
        }
        let key = (consumer, stream.id, topic.id, partition_id);
        let end = topic.next_offset(partition_id);
        let start = match strategy.kind {
            1 => strategy.value,
            3 | 2 => 0,
            4 => end.saturating_sub(u64::from(count)),
            5 => self.consumer_offsets.get(&key).map_or(0, |stored| stored + 1),
            _ => return Err(IggyError::InvalidCommand),
        };
        let messages: Vec<StoredMessage> = topic
            .partition_messages(partition_id)
            .filter(|message| message.offset >= start)
            .filter(|message| strategy.kind != 2 || message.timestamp >= strategy.value)
            .take(count as usize)
            .cloned()
            .collect();
        let current_offset = end.saturating_sub(1);
        if auto_commit && let Some(last) = messages.last() {
            self.consumer_offsets.insert(key, last.offset);
        }
        Ok(Polled { partition_id, current_offset, messages })
    }
}
