//! The test broker: a fault-injecting stand-in for an Iggy server that speaks
//! the binary TCP protocol through the real codec (`iggy_binary_protocol`), so
//! that the real `iggy` client (`IggyClient` over TCP) can connect to it and
//! tests can watch what the client does when the destination misbehaves.
//!
//! It implements what the daemon's client uses: login (username and
//! password), cluster metadata, ping, logout, get/create stream, get/create
//! topic (options kept and returned), send messages (to a partition id; the
//! client resolves balanced and key partitioning itself) and poll messages.
//! Streams, topics and messages live in memory and survive `stop()` /
//! `restart()`, which model an outage of the broker, not a loss of its data.
//!
//! Faults, each changeable at any time from the test:
//! - [`TestBroker::refuse_connections`]: nothing listens on the address;
//! - [`TestBroker::stop`] / [`TestBroker::restart`]: an outage (listener and
//!   every connection closed), then listening again on the same port;
//! - [`TestBroker::disconnect_all`]: close the open connections only;
//! - [`TestBroker::set_delay`]: delay every reply;
//! - [`TestBroker::drop_connection_after_next_request`]: close the connection
//!   that carries the next request of a kind, before or after applying it;
//! - [`TestBroker::fail_topic`]: sends to one destination get an error status;
//! - [`TestBroker::black_hole_topic`]: sends to one destination, and its
//!   creation, are read and never answered;
//! - [`TestBroker::refuse_create_topic`], [`TestBroker::refuse_create_stream`]:
//!   creating one topic, or one stream, is refused with an error status (a user
//!   without the permission to create it).
//!
//! Which client error each fault produces is recorded in this crate's
//! `README.md` and checked by `tests/client.rs`.
//!
//! Invariants:
//! - the broker never unwraps data read from the network: a malformed frame
//!   closes the connection, a malformed body gets an error status;
//! - a message is stored only when a `SendMessages` reply with status 0 was
//!   produced for it, except under `DropPoint::AfterApplying`, whose purpose is
//!   a stored message whose acknowledgement is lost;
//! - inspection (`messages`, `topic_options`, counters) reads the same state
//!   the connections write, under one lock, so a test sees every reply's
//!   effect once the client has the reply.

mod faults;
mod handler;
mod kind;
mod server;
mod store;
mod wire;

pub use faults::DropPoint;
pub use handler::BROKER_NAME;
pub use kind::RequestKind;
pub use store::StoredMessage;

use crate::server::Shared;
use iggy_common::{IggyError, TopicCreateOptions};
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// How the broker is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestBrokerConfig {
    /// The only username a login accepts.
    pub username: String,
    /// The only password a login accepts.
    pub password: String,
}

impl Default for TestBrokerConfig {
    /// The daemon's default credentials, `iggy`/`iggy`.
    fn default() -> Self {
        Self { username: "iggy".to_owned(), password: "iggy".to_owned() }
    }
}

/// A running test broker. Dropping it closes the listener and every
/// connection.
pub struct TestBroker {
    shared: Arc<Shared>,
}

impl TestBroker {
    /// Starts a broker on `127.0.0.1` with a free port.
    ///
    /// # Errors
    /// When the socket cannot be bound.
    pub async fn start(config: TestBrokerConfig) -> io::Result<Self> {
        Self::start_at(config, SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Starts a broker on `addr` (e.g. the address of a broker dropped
    /// earlier, to model a restart that lost the broker's memory).
    ///
    /// # Errors
    /// When the socket cannot be bound.
    pub async fn start_at(config: TestBrokerConfig, addr: SocketAddr) -> io::Result<Self> {
        Ok(Self { shared: Shared::bind(config, addr).await? })
    }

    /// The address the broker listens on (it never changes).
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// While `true`, nothing listens on the address: a connect is refused by
    /// the operating system. Open connections are left alone.
    ///
    /// # Errors
    /// When listening again fails (the port was taken meanwhile).
    pub async fn refuse_connections(&self, refuse: bool) -> io::Result<()> {
        if refuse {
            self.shared.close_listener().await;
            Ok(())
        } else {
            self.shared.listen().await
        }
    }

    /// An outage: stops listening and closes every open connection. Stored
    /// data is kept. Undo with [`TestBroker::restart`].
    pub async fn stop(&self) {
        self.shared.close_listener().await;
        self.shared.close_connections().await;
    }

    /// Ends an outage: listens again on the same address.
    ///
    /// # Errors
    /// When the port was taken meanwhile.
    pub async fn restart(&self) -> io::Result<()> {
        self.shared.listen().await
    }

    /// Closes every open connection, and keeps listening.
    pub async fn disconnect_all(&self) {
        self.shared.close_connections().await;
    }

    /// Delays every reply by `delay` (zero turns it off).
    pub fn set_delay(&self, delay: Duration) {
        self.shared.faults().delay = delay;
    }

    /// The next request of `kind`, on any connection, closes its connection
    /// without a reply, before or after it is applied. One-shot; a later call
    /// replaces a pending one.
    pub fn drop_connection_after_next_request(&self, kind: RequestKind, point: DropPoint) {
        self.shared.faults().drop_next = Some((kind, point));
    }

    /// The next request of `kind`, on any connection, is applied and answered with a
    /// reply header the client cannot parse (`InvalidCommand`), followed by the proper
    /// reply, which the connection's next call then reads as its own answer. One-shot.
    pub fn malformed_reply_to_next_request(&self, kind: RequestKind) {
        self.shared.faults().malformed_reply_next = Some(kind);
    }

    /// `Some(error)`: every `SendMessages` to `stream`/`topic` is answered with
    /// `error`'s code and stores nothing. `None`: sends succeed again.
    pub fn fail_topic(&self, stream: &str, topic: &str, error: Option<IggyError>) {
        set_code(&mut self.shared.faults().failing, stream, topic, error);
    }

    /// `Some(error)`: every `CreateTopic` of `stream`/`topic` is refused with `error`'s
    /// code, as the server refuses a user without the permission to create it
    /// (`Unauthorized`); nothing is created. `None`: it is created again.
    pub fn refuse_create_topic(&self, stream: &str, topic: &str, error: Option<IggyError>) {
        set_code(&mut self.shared.faults().create_refused, stream, topic, error);
    }

    /// `Some(error)`: every `CreateStream` of `stream` is refused with `error`'s code, as
    /// the server refuses a user without the permission to create streams
    /// (`Unauthorized`); nothing is created. `None`: it is created again.
    pub fn refuse_create_stream(&self, stream: &str, error: Option<IggyError>) {
        let mut faults = self.shared.faults();
        match error {
            Some(e) => faults.stream_create_refused.insert(stream.to_owned(), e.as_code()),
            None => faults.stream_create_refused.remove(stream),
        };
    }

    /// `true`: every `SendMessages` to `stream`/`topic`, and every `CreateTopic`
    /// of it, is read and never answered (nothing is stored or created). `false`:
    /// they are answered again.
    pub fn black_hole_topic(&self, stream: &str, topic: &str, black_hole: bool) {
        let key = (stream.to_owned(), topic.to_owned());
        let mut faults = self.shared.faults();
        if black_hole {
            faults.black_holes.insert(key);
        } else {
            faults.black_holes.remove(&key);
        }
    }

    /// Grows `stream`/`topic` to `partitions_count` partitions, as an operator adding
    /// partitions would. `false` when it does not exist or already has that many.
    pub fn grow_partitions(&self, stream: &str, topic: &str, partitions_count: u32) -> bool {
        self.shared.store().grow_partitions(stream, topic, partitions_count)
    }

    /// Removes partitions from the end of `stream`/`topic` until it has
    /// `partitions_count` (0: none), as an operator deleting partitions would. `false`
    /// when it does not exist or has at most that many.
    pub fn shrink_partitions(&self, stream: &str, topic: &str, partitions_count: u32) -> bool {
        self.shared.store().shrink_partitions(stream, topic, partitions_count)
    }

    /// Every message stored in `stream`/`topic`, in arrival order (across
    /// partitions). Empty when the destination does not exist.
    #[must_use]
    pub fn messages(&self, stream: &str, topic: &str) -> Vec<StoredMessage> {
        self.shared.store().topic_by_names(stream, topic).map(|topic| topic.messages.clone()).unwrap_or_default()
    }

    /// The options `stream`/`topic` was created with, parsed, with
    /// `partitions_count` set. `None` when the destination does not exist.
    #[must_use]
    pub fn topic_options(&self, stream: &str, topic: &str) -> Option<TopicCreateOptions> {
        self.shared.store().topic_by_names(stream, topic).map(|topic| topic.options.clone())
    }

    /// How many requests of `kind` arrived (including faulted ones).
    #[must_use]
    pub fn request_count(&self, kind: RequestKind) -> u64 {
        self.shared.request_count(kind)
    }

    /// How many connections were accepted since the start.
    #[must_use]
    pub fn accepted_connections(&self) -> u64 {
        self.shared.accepted_connections()
    }

    /// How many accepted connections are still open.
    #[must_use]
    pub fn open_connections(&self) -> usize {
        self.shared.open_connections()
    }
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        self.shared.abort_all();
    }
}

/// Sets (`Some`) or clears (`None`) the error code a fault map holds for `stream`/`topic`.
fn set_code(
    codes: &mut std::collections::HashMap<(String, String), u32>,
    stream: &str,
    topic: &str,
    error: Option<IggyError>,
) {
    let key = (stream.to_owned(), topic.to_owned());
    match error {
        Some(error) => codes.insert(key, error.as_code()),
        None => codes.remove(&key),
    };
}
