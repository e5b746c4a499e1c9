//! The destination side of the router, as a trait: where records go and how a failure
//! is classified. `iggy_sink.rs` implements it with the `iggy` crate; tests implement it
//! with a fault-injecting double.
//!
//! Invariants:
//! - `send` returns `Ok` only once the destination acknowledged every message of the
//!   call; anything else is a failure and the whole call is retried (message ids make a
//!   resend identifiable).
//! - The classification decides who pays for a failure: `Disconnected`, `Unavailable`
//!   and `Unauthorized` (credentials) are the client's (no destination's breaker counts
//!   them); `Destination` failures (a permission denied for one stream or topic among
//!   them) and `Timeout` count against that destination's breaker only.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;

use bytes::Bytes;
pub use ingest::envelope::Partitioning;

/// A (stream, topic) pair. Never used as a metric label.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DestinationKey {
    pub stream: String,
    pub topic: String,
}

impl DestinationKey {
    pub fn new(stream: impl Into<String>, topic: impl Into<String>) -> DestinationKey {
        DestinationKey { stream: stream.into(), topic: topic.into() }
    }
}

impl fmt::Display for DestinationKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.stream, self.topic)
    }
}

/// A lane's identity: the source a record came in through and its destination.
/// Records of one source to one destination are delivered in log order.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LaneKey {
    pub source: String,
    pub destination: DestinationKey,
}

impl fmt::Display for LaneKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}", self.source, self.destination)
    }
}

/// One message to send, borrowed from its record's envelope (the sink copies what it
/// keeps while preparing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutMessage<'a> {
    /// The stable id stored in the log record.
    pub id: u128,
    pub payload: &'a Bytes,
    /// User headers: name and value.
    pub headers: Vec<(&'a str, Cow<'a, [u8]>)>,
}

/// What the router knows about a destination once it exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicInfo {
    pub partitions_count: u32,
    /// The topic syncs every message before acknowledging it. An ack from a topic that
    /// does not may not survive a crash of the server.
    pub durable: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendErrorKind {
    /// The connection dropped after the request was written: the outcome is unknown.
    Disconnected,
    /// The server could not be reached at all.
    Unavailable,
    /// This destination failed (missing and not creatable, rejected, server error).
    Destination,
    /// The credentials were refused, or the session is not signed in: every destination
    /// would fail the same way. A permission denied for one destination is not this
    /// (the server grants permissions per stream and topic): it is `Destination`.
    Unauthorized,
    /// No answer within the result timeout.
    Timeout,
}

impl SendErrorKind {
    /// True if the failure belongs to one destination (and so counts against its breaker).
    pub fn counts_against_destination(self) -> bool {
        matches!(self, SendErrorKind::Destination | SendErrorKind::Timeout)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SendErrorKind::Disconnected => "disconnected",
            SendErrorKind::Unavailable => "unavailable",
            SendErrorKind::Destination => "destination",
            SendErrorKind::Unauthorized => "unauthorized",
            SendErrorKind::Timeout => "timeout",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {detail}", kind.as_str())]
pub struct SendError {
    pub kind: SendErrorKind,
    pub detail: String,
}

impl SendError {
    pub fn new(kind: SendErrorKind, detail: impl Into<String>) -> SendError {
        SendError { kind, detail: detail.into() }
    }
}

/// Where the router delivers.
pub trait Sink: Send + Sync + 'static {
    /// A message in the form `send` takes. A lane prepares the next batch's messages
    /// while the previous batch is in flight, so the conversion is off the path a
    /// destination's throughput depends on; a retry sends the prepared messages again.
    type Message: Send + 'static;

    /// Converts a batch's messages, in order. An error names a message the destination
    /// could never take; the batch is then held and retried like a failed send.
    fn prepare(&self, messages: &[OutMessage<'_>]) -> Result<Vec<Self::Message>, SendError>;

    /// Makes sure the destination exists (creating it if needed; "already exists" is
    /// success) and reports its partitions and durability. Asks the destination every
    /// time, so a caller that asks again learns of partitions added since (callers keep
    /// what it answered).
    fn ensure(&self, dest: &DestinationKey) -> impl Future<Output = Result<TopicInfo, SendError>> + Send;

    /// True while the sink waits for a connection to the server (no call can be answered
    /// before it is made), or makes a new one for a call that found none idle. A call cut
    /// short then failed for every destination alike.
    fn connecting(&self) -> bool {
        false
    }

    /// True if the server answered some call (an ack, or an error of its own) at or after
    /// `since`. A call cut short that began at `since` then failed at its destination;
    /// otherwise the server as a whole stopped answering, which is no destination's fault.
    fn answered_since(&self, since: std::time::Instant) -> bool {
        let _ = since;
        true
    }

    /// Whether the server answers at all now (for the IggySink, a ping on a connection
    /// of its own). Asked after a call was cut short while no other call was answered.
    fn server_answers(&self) -> impl Future<Output = bool> + Send {
        async { true }
    }

    /// Sends `messages` to `dest` in order, all with the same partitioning, and returns
    /// once they were acknowledged.
    fn send(
        &self,
        dest: &DestinationKey,
        partitioning: &Partitioning,
        messages: &mut [Self::Message],
    ) -> impl Future<Output = Result<(), SendError>> + Send;
}
