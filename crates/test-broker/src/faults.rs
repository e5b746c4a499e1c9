//! Fault settings, changed by tests and read by every connection.
//!
//! Invariants:
//! - a pending connection drop is one-shot: the first request of the chosen
//!   kind takes it, on whichever connection it arrives;
//! - topic faults are keyed by (stream name, topic name), so they apply to a
//!   destination whether or not it exists yet, and are matched only against
//!   `SendMessages`;
//! - a black hole wins over a failing topic when both are set;
//! - a refused creation applies to `CreateTopic` only: a topic that exists is sent to
//!   as ever.

use crate::kind::RequestKind;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// When a dropped connection is closed relative to applying the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropPoint {
    /// Close before the request has any effect: nothing is stored.
    BeforeApplying,
    /// Apply the request (messages are stored), then close without replying:
    /// the reply is lost, as when a connection breaks on the way back.
    AfterApplying,
}

/// What the broker does with a `SendMessages` to one topic (and, for `BlackHole`, with
/// a `CreateTopic` of it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TopicFault {
    /// Answer with this nonzero status (an `IggyError` code); store nothing.
    Fail(u32),
    /// Read the request and never answer it; store (or create) nothing.
    BlackHole,
}

#[derive(Debug, Default)]
pub(crate) struct Faults {
    pub refuse: bool,
    pub delay: Duration,
    pub drop_next: Option<(RequestKind, DropPoint)>,
    pub failing: HashMap<(String, String), u32>,
    pub black_holes: HashSet<(String, String)>,
    /// `CreateTopic` of (stream, topic) refused with this code, as the server commits
    /// a refusal (a user without the permission to create it: `Unauthorized`).
    pub create_refused: HashMap<(String, String), u32>,
    /// `CreateStream` of a stream refused with this code (a user without the
    /// permission to create streams: `Unauthorized`).
    pub stream_create_refused: HashMap<String, u32>,
    /// The next request of this kind is applied and answered with a reply header the
    /// client cannot parse (its size field below a header's), followed by the proper
    /// reply: a server out of step with its client. One-shot.
    pub malformed_reply_next: Option<RequestKind>,
}

impl Faults {
    /// Takes the pending connection drop if it is armed for `kind`.
    pub fn take_drop(&mut self, kind: RequestKind) -> Option<DropPoint> {
        match self.drop_next {
            Some((armed, point)) if armed == kind => {
                self.drop_next = None;
                Some(point)
            }
            _ => None,
        }
    }

    /// Takes the pending malformed reply if it is armed for `kind`.
    pub fn take_malformed_reply(&mut self, kind: RequestKind) -> bool {
        if self.malformed_reply_next == Some(kind) {
            self.malformed_reply_next = None;
            return true;
        }
        false
    }

    /// The fault set on a destination, if any.
    pub fn topic_fault(&self, stream: &str, topic: &str) -> Option<TopicFault> {
        let key = (stream.to_owned(), topic.to_owned());
        if self.black_holes.contains(&key) {
            return Some(TopicFault::BlackHole);
        }
        self.failing.get(&key).map(|code| TopicFault::Fail(*code))
    }
}
