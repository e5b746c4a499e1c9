//! The destination the daemon really delivers to: an Iggy server, through the `iggy`
//! crate over TCP. Every use of that crate is in this module, so moving to a newer
//! server is one change.
//!
//! Invariants:
//! - A pool of connections, one call at a time on each: a call takes an idle connection
//!   (or makes a new one) for itself and gives it back only once answered. The `iggy`
//!   client runs one request at a time per connection, so with one shared connection a
//!   destination that does not answer would hold every other destination's sends behind
//!   it; now it holds only the connection its own call took.
//! - A call cut short (the lane's result timeout) leaves its connection behind: it is
//!   dropped, never reused, so a late answer can never be read as another call's.
//! - A call whose connection failed (disconnected, unavailable, signed out) drops that
//!   connection alone and takes the server for unreachable until a call is answered; it
//!   paces no connect. The `iggy` client, its own reconnection off, answers every
//!   connection's failure "disconnected", so one failure cannot tell a server gone from
//!   one connection closed while idle (by the server, or a proxy's idle timeout) before
//!   its heartbeat noticed: the other idle connections stay, each dead one fails its own
//!   call the same way, and a connect that fails paces connects. A "not now" answer
//!   (busy, catching up) keeps its connection, the server having answered on it. An idle
//!   connection is taken only while signed in: one its heartbeat found closed is dropped
//!   alone, before any call is made on it.
//! - The daemon starts and holds while the server is unreachable: connecting is retried
//!   by the next call, never required at start. One connect runs at a time, in a task of
//!   its own; a caller's timeout may stop waiting for it, never stop it half-way (the
//!   `iggy` client interrupted in the middle of connecting never connects again); the
//!   connect parks its connection as idle, and a call that waited long for it leaves it
//!   to the retry, which then has a whole result timeout for its request. A client is
//!   never reconnected in place: every connect builds a new one. A connect fails after
//!   `connect_timeout`; after a failed one (paced from the moment it failed), no connect
//!   is made for `reconnection_interval`. A
//!   connect that ended while nobody waited is taken in by the next caller, never handed
//!   to it as its own outcome; one that succeeded counts as the server answering.
//! - A call's timeout is the destination's only if the server answered some other call
//!   in the last quarter of its wait ([`Sink::answered_since`]) or answers a ping right after
//!   ([`Sink::server_answers`]); otherwise the server, not the destination, is what
//!   stopped answering, and no breaker counts it.
//! - Destinations are created on first use with the topic defaults; "already exists" is
//!   success. Topics the daemon creates are durable by default (`enforce_fsync`, one
//!   message per save), because an ack from a topic without fsync does not survive a
//!   crash of the server; an existing topic that is not durable is reported, not changed.
//! - Messages carry the stable id from the log; a resend after an unknown outcome sends
//!   the same id.
//! - Balanced and keyed messages are placed by the sink, not by the client: the `iggy`
//!   client places them against a partition count it asks once per connection, with a
//!   round-robin turn of its own per connection, so a pool of connections of different
//!   ages would send one key to two partitions in turn after partitions were added, and
//!   fresh connections would each start balanced sends at partition 0. The sink keeps one
//!   count and one turn per destination ([`Placement`]) for every connection, and sends
//!   every message to an explicit partition: a key's partition changes once, when the
//!   count does. The count is learnt by each ensure, asked again once it is
//!   `connection_max_age` old (partitions added while the daemon runs are used within
//!   that age), and marked stale when a placed send fails at its destination
//!   (partitions deleted), so the retry asks again; the turn is kept. At most
//!   [`PLACEMENTS_MAX`] are kept.
//! - A connection is retired once it is `connection_max_age` old. Retiring never fails, delays or
//!   re-classifies a call, and never shrinks the pool: an old connection taken is
//!   swapped for an idle one within its age if there is one (at most one retired per
//!   take); if not, the call goes out on it while one replacement is made in the
//!   background (one at a time, none while connects are paced; it is not a connect
//!   [`Sink::connecting`] reports, and its failure paces nothing), and the old one is
//!   swapped at a later take.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::BytesMut;
use iggy::prelude::{
    AutoLogin, Client, ClientWrapper, ClusterClient, Credentials, HeaderKind, Identifier, IggyByteSize, IggyClient,
    IggyDuration, IggyError, IggyExpiry, IggyMessage, IggyMessageHeader, IggyTimestamp, MAX_PAYLOAD_SIZE,
    MAX_USER_HEADERS_SIZE, MaxTopicSize, MessageClient, Partitioning as IggyPartitioning, StreamClient, SystemClient,
    TcpClient, TcpClientConfig, TcpClientReconnectionConfig, TopicClient, TopicCreateOptions,
};
use iggy_binary_protocol::encode_user_headers;
use ingest::envelope::Partitioning;
use tokio::task::JoinHandle;

use crate::sink::{DestinationKey, OutMessage, SendError, SendErrorKind, Sink, TopicInfo};

/// Settings of topics the daemon creates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicDefaults {
    pub partitions_count: u32,
    /// Message expiry; `None` keeps messages until the topic's size limit (the topic is
    /// created with "never expire", not the server's default, which its configuration may
    /// set to delete them).
    pub message_expiry: Option<Duration>,
    pub max_topic_size_bytes: Option<u64>,
    pub segment_size_bytes: Option<u64>,
    /// Sync every save to disk before acknowledging. Default true.
    pub enforce_fsync: bool,
    /// Messages per save. Default 1: every message is saved (and synced) before its ack.
    pub messages_required_to_save: u32,
}

impl Default for TopicDefaults {
    fn default() -> Self {
        TopicDefaults {
            partitions_count: 1,
            message_expiry: None,
            max_topic_size_bytes: None,
            segment_size_bytes: None,
            enforce_fsync: true,
            messages_required_to_save: 1,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IggySinkConfig {
    /// `host:port` of the server's TCP listener.
    pub address: String,
    pub username: String,
    pub password: ingest::secret::SecretString,
    pub tls: bool,
    pub tls_domain: Option<String>,
    pub tls_ca_file: Option<String>,
    /// Kept in the client's configuration, but the client's own reconnection is off:
    /// the sink reconnects, one attempt per retry of the router, which retries forever.
    pub reconnection_max_retries: u32,
    /// After a failed connect no new connect is made for this long: the calls in between
    /// that need one fail `Unavailable` at once (and the router retries them with its
    /// backoff), so a server that is down or refusing sees at most one connect per
    /// interval, however many destinations retry. A call whose connection fails paces
    /// nothing (see the module's invariants).
    pub reconnection_interval: Duration,
    /// How long one connect (TCP, sign-in, the pings and the cluster-metadata request
    /// that prove the connection answers, in step)
    /// may take before it fails. The client bounds each reply by itself
    /// ([`CLIENT_REPLY_TIMEOUT`]) but not the TCP connect, which on a network that drops
    /// packets lasts until the kernel gives up (about two minutes on Linux), with every
    /// caller joined to it. 30 s by default.
    pub connect_timeout: Duration,
    /// How old a destination's partition count may be before the next balanced or keyed
    /// send asks the server again, and a connection this old is retired at its next take
    /// (see the module's invariants): the longest a partition added to a topic goes
    /// without balanced and keyed messages. Five minutes by default, the age at which
    /// Kafka's producers refresh the same knowledge (`metadata.max.age.ms`).
    pub connection_max_age: Duration,
    /// How long a call may wait for a new connection (its connect, and the connects
    /// queued ahead of it: one runs at a time) and still go out on it; past it, the call
    /// fails `Unavailable` and leaves the connection to its retry (see
    /// [`IggySink::take`]). The daemon sets [`fresh_connection_usable_for`] of the
    /// shortest result timeout the router is given; [`FRESH_CONNECTION_USABLE_FOR_MIN`]
    /// by default.
    pub fresh_connection_usable_for: Duration,
    pub topic_defaults: TopicDefaults,
}

/// [`IggySinkConfig::fresh_connection_usable_for`] for a router whose shortest result
/// timeout is `result_timeout`: a quarter of it, so that a call that waited that long
/// for its connection still has three quarters of its timeout for its request (with
/// less, a connect slower than what is left would have every try cut short, its
/// connection dropped, and a new connect made for the next: never a send), and never
/// less than [`FRESH_CONNECTION_USABLE_FOR_MIN`].
pub fn fresh_connection_usable_for(result_timeout: Duration) -> Duration {
    (result_timeout / 4).max(FRESH_CONNECTION_USABLE_FOR_MIN)
}

impl Default for IggySinkConfig {
    fn default() -> Self {
        IggySinkConfig {
            address: "127.0.0.1:8090".into(),
            username: "iggy".into(),
            password: "iggy".into(),
            tls: false,
            tls_domain: None,
            tls_ca_file: None,
            reconnection_max_retries: 1,
            reconnection_interval: Duration::from_millis(500),
            connect_timeout: CLIENT_REPLY_TIMEOUT,
            connection_max_age: CONNECTION_MAX_AGE_DEFAULT,
            fresh_connection_usable_for: FRESH_CONNECTION_USABLE_FOR_MIN,
            topic_defaults: TopicDefaults::default(),
        }
    }
}

/// [`IggySinkConfig::connection_max_age`] unless configured.
pub const CONNECTION_MAX_AGE_DEFAULT: Duration = Duration::from_secs(300);

/// Delivers to an Iggy server.
pub struct IggySink {
    config: IggySinkConfig,
    defaults: TopicDefaults,
    /// Connections no call is using.
    idle: Arc<std::sync::Mutex<Vec<Connection>>>,
    /// Set while no connection is known to work: at start, after a failed connect and
    /// after a call whose connection failed; cleared by a connect that succeeds and by
    /// any call the server answers.
    unreachable: AtomicBool,
    /// The connect in progress, if any; its task finishes even when nobody waits for it.
    connecting: tokio::sync::Mutex<Option<JoinHandle<Result<(), ConnectFailure>>>>,
    /// When the server last answered a call (an ack, or an error of its own).
    last_answer: std::sync::Mutex<Option<std::time::Instant>>,
    /// No connect before this: set `reconnection_interval` ahead by a failed connect (by
    /// its task, when it fails, whether or not anybody still waits for it).
    connect_not_before: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
    /// Set while a replacement for a connection past its age is being made.
    replacing: Arc<AtomicBool>,
    /// Where balanced and keyed messages go, per destination, for every connection, and
    /// what the sink has said of each.
    placements: std::sync::Mutex<std::collections::HashMap<DestinationKey, Placement>>,
}

/// A destination's partition count as last learnt.
#[derive(Debug, Clone, Copy)]
struct Placement {
    partitions_count: u32,
    learnt_at: std::time::Instant,
    /// Set when a send placed by this count failed at its destination: asked again
    /// before the next.
    stale: bool,
    /// The destination was reported as acknowledging without fsync: the warning is
    /// logged once per destination, not at every ensure (a dead-letter topic is ensured
    /// before each of its sends).
    not_durable_warned: bool,
}

impl Placement {
    fn new(partitions_count: u32, learnt_at: std::time::Instant) -> Placement {
        Placement { partitions_count, learnt_at, stale: false, not_durable_warned: false }
    }
}

/// The most destinations whose [`Placement`] is kept: past it, those older than
/// `connection_max_age` (or stale) are dropped, and if that leaves too many, all (each
/// is asked again at its next send: a cache, never the only copy of anything; a topic
/// without fsync is reported again). The whole daemon's destinations share it.
pub const PLACEMENTS_MAX: usize = 100_000;

/// The most topics the server holds in one stream: it refuses to create one more
/// (`TooManyTopics`, a destination's error like any topic it cannot create).
pub const TOPICS_PER_STREAM_MAX: usize = iggy_binary_protocol::namespace::MAX_TOPICS;

/// How long the `iggy` client waits for a reply (its `RESPONSE_READ_TIMEOUT`, fixed and
/// not exported): a request unanswered this long fails `Disconnected` and the client
/// drops its connection. The sink reads `Disconnected` as the server gone (every idle
/// connection dropped, no breaker counting it), so a result timeout must fire first to
/// tell a silent destination from a silent server.
pub const CLIENT_REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// The longest result timeout the router may be given with this client: below
/// [`CLIENT_REPLY_TIMEOUT`] by a margin that absorbs a busy runtime polling the lane's
/// timer late (the client's clock starts a little after the router's, once the call has
/// a connection, so only lateness can let the client's fire first).
pub const MAX_RESULT_TIMEOUT: Duration = Duration::from_secs(25);

/// The least [`IggySinkConfig::fresh_connection_usable_for`]: above one connect on a
/// working network, below any result timeout worth configuring.
pub const FRESH_CONNECTION_USABLE_FOR_MIN: Duration = Duration::from_millis(250);

/// Why a connect failed.
#[derive(Debug)]
enum ConnectFailure {
    /// It outlasted `connect_timeout`.
    TimedOut(Duration),
    Client(IggyError),
}

impl std::fmt::Display for ConnectFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectFailure::TimedOut(limit) => {
                write!(f, "connecting took longer than {} ms (the connect timeout)", limit.as_millis())
            }
            ConnectFailure::Client(e) => write!(f, "{e}"),
        }
    }
}

/// A connected client and when it connected.
struct Connection {
    client: Arc<IggyClient>,
    connected_at: std::time::Instant,
}

impl Connection {
    fn is_older_than(&self, max_age: Duration) -> bool {
        self.connected_at.elapsed() >= max_age
    }
}

/// A connection taken by one call. Given back by [`IggySink::settle`] once the call was
/// answered; dropped otherwise (a call cut short, a dead connection), never reused.
struct Taken {
    connection: Connection,
}

impl Taken {
    fn client(&self) -> &IggyClient {
        &self.connection.client
    }
}

impl std::fmt::Debug for IggySink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IggySink").finish_non_exhaustive()
    }
}

impl IggySink {
    /// Makes no connection: the first call does, and a server that is down only delays
    /// delivery. Fails only on a configuration the client refuses.
    pub fn new(config: &IggySinkConfig) -> Result<IggySink, String> {
        build_client(config).map_err(|e| format!("iggy client: {e}"))?;
        Ok(IggySink {
            config: config.clone(),
            defaults: config.topic_defaults.clone(),
            idle: Arc::default(),
            unreachable: AtomicBool::new(true),
            connecting: tokio::sync::Mutex::new(None),
            last_answer: std::sync::Mutex::new(None),
            connect_not_before: Arc::default(),
            replacing: Arc::default(),
            placements: std::sync::Mutex::default(),
        })
    }

    /// Whether `dest`'s warning of a topic without fsync is yet to be logged (then it is
    /// taken as logged).
    fn first_not_durable_warning(&self, dest: &DestinationKey, partitions_count: u32) -> bool {
        self.with_placement(dest, partitions_count, |p| !std::mem::replace(&mut p.not_durable_warned, true))
    }

    fn placements(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<DestinationKey, Placement>> {
        self.placements.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `f` on `dest`'s placement, made with `partitions_count` when there is none. Past
    /// [`PLACEMENTS_MAX`], a new one first drops those past their age or stale, then all.
    fn with_placement<R>(
        &self,
        dest: &DestinationKey,
        partitions_count: u32,
        f: impl FnOnce(&mut Placement) -> R,
    ) -> R {
        let now = std::time::Instant::now();
        let mut placements = self.placements();
        if placements.len() >= PLACEMENTS_MAX && !placements.contains_key(dest) {
            let max_age = self.config.connection_max_age;
            placements.retain(|_, p| !p.stale && now.duration_since(p.learnt_at) < max_age);
            if placements.len() >= PLACEMENTS_MAX {
                placements.clear();
            }
        }
        f(placements.entry(dest.clone()).or_insert_with(|| Placement::new(partitions_count, now)))
    }

    /// `dest` has `partitions_count` partitions, as the server just said.
    fn learn_partitions(&self, dest: &DestinationKey, partitions_count: u32) {
        self.with_placement(dest, partitions_count, |p| {
            p.partitions_count = partitions_count;
            p.learnt_at = std::time::Instant::now();
            p.stale = false;
        });
    }

    /// The partition a send with `partitioning` to `dest` goes to, its count asked of the
    /// server (on `client`, the send's own connection) when unknown or past its age. A
    /// balanced batch goes to the partition its first message's id names (the id modulo
    /// the count): ids are random or hashes, so batches spread evenly, and a batch sent
    /// again (a retry after an unknown outcome, or the first batch after a restart,
    /// which starts at the stored cursor, where a batch started) goes to the partition
    /// its first copy went to, where a consumer of that partition, or Iggy's own
    /// per-partition deduplication, can tell it for a duplicate.
    async fn place(
        &self,
        client: &IggyClient,
        dest: &DestinationKey,
        stream: &Identifier,
        topic: &Identifier,
        partitioning: &Partitioning,
        first_id: u128,
    ) -> Result<u32, IggyError> {
        let max_age = self.config.connection_max_age;
        let fresh = self
            .placements()
            .get(dest)
            .filter(|p| !p.stale && p.learnt_at.elapsed() < max_age)
            .map(|p| p.partitions_count);
        let count = match fresh {
            Some(count) => count,
            None => {
                let details = client
                    .get_topic(stream, topic)
                    .await?
                    .ok_or_else(|| IggyError::TopicIdNotFound(topic.clone(), stream.clone()))?;
                self.learn_partitions(dest, details.partitions_count);
                details.partitions_count
            }
        };
        if count == 0 {
            // The topic is there (it was just ensured or asked): what to tell the operator
            // is that it has no partition to place the message in.
            return Err(IggyError::NoPartitions(topic.clone(), stream.clone()));
        }
        if let Partitioning::Key(key) = partitioning {
            // As the client places a key (its `MessagesKey`), so that a key goes where
            // any other producer of the `iggy` crate sends it.
            match IggyPartitioning::messages_key(key) {
                Ok(k) => return Ok(iggy_common::calculate_32(&k.value) % count),
                Err(_) => metrics::counter!("iggy_connector_partition_key_invalid_total").increment(1),
            }
        }
        // Below `count`, a u32.
        Ok((first_id % u128::from(count)) as u32)
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Connection>> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A connection for one call: an idle one, or a new one. A call that had to wait
    /// long for a new connection does not go out on it: its result timeout ran while it
    /// waited, and a call cut short costs its connection, so with a connect slower than
    /// what is left, every try would connect again and never send. It fails
    /// `Unavailable` instead, and the retry takes the parked connection with a whole
    /// result timeout of its own. An idle connection past `connection_max_age` is
    /// swapped for one within it, or taken while a replacement is made (see the
    /// module's invariants).
    async fn take(&self) -> Result<Taken, SendError> {
        loop {
            let Some(connection) = self.idle().pop() else { break };
            if !signed_in(&connection.client).await {
                // Closed while it was idle (its heartbeat failed): that connection's
                // trouble alone. The others, and connects, are left as they are.
                tracing::debug!("an idle connection to iggy was closed; dropped");
                continue;
            }
            if !connection.is_older_than(self.config.connection_max_age) {
                return Ok(Taken { connection });
            }
            return Ok(Taken { connection: self.swap_or_replace(connection).await });
        }
        let started = std::time::Instant::now();
        self.connect().await?;
        let usable = started.elapsed() < self.config.fresh_connection_usable_for;
        let connection = usable.then(|| self.idle().pop()).flatten();
        connection.map(|connection| Taken { connection }).ok_or_else(|| {
            SendError::new(SendErrorKind::Unavailable, "connected to the server; the call goes out on the next try")
        })
    }

    /// For `old`, a signed-in connection past its age: an idle connection within its
    /// age, `old` retired, if the pool holds one; else `old` itself, with a replacement
    /// started in the background (unless one is being made, or connects are paced).
    async fn swap_or_replace(&self, old: Connection) -> Connection {
        let max_age = self.config.connection_max_age;
        let young = {
            let mut idle = self.idle();
            let at = idle.iter().rposition(|c| !c.is_older_than(max_age));
            at.map(|i| idle.remove(i))
        };
        if let Some(young) = young {
            if signed_in(&young.client).await {
                drop(old);
                metrics::counter!("iggy_connector_connections_retired_total").increment(1);
                tracing::debug!("a connection to iggy reached connection_max_age; retired");
                return young;
            }
            tracing::debug!("an idle connection to iggy was closed; dropped");
        }
        self.replace_in_background();
        old
    }

    /// Starts making one more idle connection, to replace one past its age: at most one
    /// at a time, none while connects are paced. Not the connect `connect` makes and
    /// [`Sink::connecting`] reports: the server answers on the old connection, and a
    /// replacement that fails says nothing of it, paces nothing and is tried again at
    /// the next take of an old connection.
    fn replace_in_background(&self) {
        if self.connect_wait().is_some() || self.replacing.swap(true, Ordering::AcqRel) {
            return;
        }
        let (config, idle, replacing) = (self.config.clone(), self.idle.clone(), self.replacing.clone());
        tokio::spawn(async move {
            match open_connection(&config).await {
                Ok(connection) => idle.lock().unwrap_or_else(|p| p.into_inner()).push(connection),
                // Said: the old connection keeps serving, so a password changed or a user
                // disabled on the server shows here first, before the old one ends.
                Err(e) => {
                    static LOG: ingest::log_limit::LogLimit =
                        ingest::log_limit::LogLimit::every(std::time::Duration::from_secs(60));
                    if let Some(suppressed) = LOG.admit() {
                        tracing::warn!(error = %e, suppressed, "a replacement connection to iggy failed; the older one keeps serving");
                    }
                }
            }
            replacing.store(false, Ordering::Release);
        });
    }

    /// Makes one more idle connection, unless one is there: one connect at a time, in a
    /// task of its own that parks its connection as idle whether or not anybody still
    /// waits for it. Within `reconnection_interval` of a failure that paced connects, it
    /// fails `Unavailable` at once.
    async fn connect(&self) -> Result<(), SendError> {
        let mut connecting = self.connecting.lock().await;
        if let Some(task) = connecting.take_if(|t| t.is_finished()) {
            // It ended while nobody waited (every caller's timeout cut it short): its
            // outcome is taken in, not handed to a caller who came later as if it were
            // theirs, and a success long past is no answer of the server now.
            let _ = self.connected(task.await, false);
        }
        if !self.idle().is_empty() {
            return Ok(());
        }
        if connecting.is_none()
            && let Some(wait) = self.connect_wait()
        {
            return Err(SendError::new(
                SendErrorKind::Unavailable,
                format!(
                    "the server was unreachable; connecting again in {} ms (reconnection_interval_ms)",
                    wait.as_millis()
                ),
            ));
        }
        let task = connecting.get_or_insert_with(|| {
            let (config, idle, not_before) = (self.config.clone(), self.idle.clone(), self.connect_not_before.clone());
            tokio::spawn(async move {
                match open_connection(&config).await {
                    Ok(connection) => {
                        idle.lock().unwrap_or_else(|p| p.into_inner()).push(connection);
                        Ok(())
                    }
                    Err(e) => {
                        // Paced from the failure, not from when somebody reads it.
                        pace(&not_before, config.reconnection_interval);
                        Err(e)
                    }
                }
            })
        });
        // Cancel-safe: dropped here, the task runs on and its handle stays for the next
        // caller.
        let joined = task.await;
        *connecting = None;
        self.connected(joined, true)
    }

    /// Takes in the outcome of a connect task; `fresh`: it ended just now, as its caller
    /// waited for it.
    fn connected(
        &self,
        joined: Result<Result<(), ConnectFailure>, tokio::task::JoinError>,
        fresh: bool,
    ) -> Result<(), SendError> {
        match joined {
            Err(e) => Err(SendError::new(SendErrorKind::Unavailable, format!("the connect task failed: {e}"))),
            // A failed connect is the client's, whatever the error: no destination's.
            Ok(Err(failure)) => {
                self.unreachable.store(true, Ordering::Release);
                let kind = match &failure {
                    ConnectFailure::Client(e) => classify(e),
                    ConnectFailure::TimedOut(_) => SendErrorKind::Unavailable,
                };
                let kind = if kind == SendErrorKind::Destination { SendErrorKind::Unavailable } else { kind };
                Err(SendError::new(kind, failure.to_string()))
            }
            Ok(Ok(())) if fresh => {
                if self.unreachable.load(Ordering::Acquire) {
                    tracing::info!("connected to iggy");
                }
                // The new connection signed in and answered two pings and a request whose
                // answer decoded: the server answers.
                self.answered();
                Ok(())
            }
            // Its connection is parked: a call made on it says whether the server answers.
            Ok(Ok(())) => Ok(()),
        }
    }

    /// The outcome of a call made on `taken`: an answered call gives the connection back
    /// (a destination's error included: the server answered); a failure of the
    /// connection drops it alone (see the module's invariants). `InvalidCommand` drops the connection
    /// as well: it is also
    /// what the client returns for a reply header it cannot parse, after which it keeps
    /// the connection with the rest of that reply unread, and the connection's next call
    /// would read the leftover as its own answer (an `Ok` for a send the server refused,
    /// records freed from the log undelivered; the test broker's `client.rs` shows it).
    fn settle<T>(&self, taken: Taken, result: Result<T, IggyError>) -> Result<T, SendError> {
        match result {
            Ok(v) => {
                self.answered();
                self.idle().push(taken.connection);
                Ok(v)
            }
            Err(e) => {
                let kind = classify(&e);
                if matches!(
                    e,
                    IggyError::TransientNotAccepted
                        | IggyError::TransientNotCommitted
                        | IggyError::RequestAlreadyApplied
                ) {
                    // The server answered "not now" (busy, catching up) on this
                    // connection: it is there, and so is the connection. No destination's
                    // fault either (the kind says so), and nothing to reconnect.
                    self.answered();
                    self.idle().push(taken.connection);
                } else if matches!(
                    kind,
                    SendErrorKind::Disconnected | SendErrorKind::Unavailable | SendErrorKind::Unauthorized
                ) {
                    // The connection failed: it is dropped, and the server taken for
                    // unreachable until some call is answered. One failed connection
                    // cannot tell a server gone from a connection closed while idle (by
                    // the server, or a proxy's idle timeout) before its heartbeat noticed:
                    // the client, its own reconnection off, answers both "disconnected".
                    // So the other idle connections stay and connects are not paced; a
                    // dead one fails its own call the same way, and a connect that fails
                    // paces connects.
                    self.unreachable.store(true, Ordering::Release);
                } else {
                    self.answered();
                    let out_of_step = matches!(e, IggyError::InvalidCommand);
                    if !out_of_step {
                        self.idle().push(taken.connection);
                    }
                }
                Err(SendError::new(kind, e.to_string()))
            }
        }
    }

    /// How long until a connect may be made, if it may not be made now.
    fn connect_wait(&self) -> Option<Duration> {
        let not_before = (*self.connect_not_before.lock().unwrap_or_else(|p| p.into_inner()))?;
        let wait = not_before.saturating_duration_since(std::time::Instant::now());
        (!wait.is_zero()).then_some(wait)
    }

    /// The server answered a call: it is reachable. Also takes back a client-wide
    /// failure seen earlier on another connection, which only a new connect used to take
    /// back: while it stood, a destination that went silent on a pooled connection was
    /// taken for the whole server (never counted by its breaker).
    fn answered(&self) {
        *self.last_answer.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now());
        self.unreachable.store(false, Ordering::Release);
    }

    fn create_options(&self) -> TopicCreateOptions {
        let d = &self.defaults;
        TopicCreateOptions {
            partitions_count: Some(d.partitions_count),
            message_expiry: Some(
                d.message_expiry.map_or(IggyExpiry::NeverExpire, |e| IggyExpiry::ExpireDuration(IggyDuration::from(e))),
            ),
            max_topic_size: d.max_topic_size_bytes.map(|b| MaxTopicSize::Custom(IggyByteSize::from(b))),
            segment_size: d.segment_size_bytes.map(IggyByteSize::from),
            enforce_fsync: Some(d.enforce_fsync),
            messages_required_to_save: Some(d.messages_required_to_save),
            ..TopicCreateOptions::default()
        }
    }
}

/// A new connection to the server in `config`: connected, signed in and answering, or
/// why not within `connect_timeout`.
async fn open_connection(config: &IggySinkConfig) -> Result<Connection, ConnectFailure> {
    let client = tokio::time::timeout(config.connect_timeout, async {
        let client = build_client(config)?;
        client.connect().await?;
        // The client's heartbeat pings at once on connecting, from a task of its own, and
        // the connection takes one request at a time: parked before that ping was
        // answered, the first call would wait behind it (on a slow server, long enough to
        // miss its result timeout, drop the connection, and start over). The heartbeat's
        // task may not have run yet when this task pings, so it pings twice: by the time
        // the first was answered (a round trip), the heartbeat's ping is queued, and the
        // second waits for it. Both prove the signed-in connection answers.
        client.ping().await?;
        client.ping().await?;
        // A ping takes any answer. The client's own leader check on connecting ends a
        // reply it could not parse with a warning, not an error, and the rest of that
        // reply is then read as the next call's answer: the pings above read it and each
        // other's, and a send would read the last ping's as its own, and take a refusal
        // for delivered. So the connection is proven in step by a call whose answer must
        // decode: on a connection one reply behind it reads a ping's empty answer, which
        // does not. A server that refuses the call with an error of its own answered it
        // whole, in step.
        match client.get_cluster_metadata().await {
            Err(e @ (IggyError::InvalidFormat | IggyError::InvalidCommand)) => {
                // Said apart from an outage: on every connect it is a server whose
                // answers this client cannot read (another protocol version), which no
                // wait ends.
                static OUT_OF_STEP_LOG: ingest::log_limit::LogLimit =
                    ingest::log_limit::LogLimit::every(Duration::from_secs(60));
                if let Some(failed_before) = OUT_OF_STEP_LOG.admit() {
                    tracing::error!(
                        error = %e,
                        failed_before,
                        "a new connection to iggy failed its check: the answer to a cluster-metadata request did not decode (a reply the client could not parse, or a server of another protocol version); not used, connecting again"
                    );
                }
                return Err(e);
            }
            Err(e) if matches!(classify(&e), SendErrorKind::Disconnected | SendErrorKind::Unavailable) => {
                return Err(e);
            }
            Ok(_) | Err(_) => {}
        }
        Ok(client)
    })
    .await
    .map_err(|_| ConnectFailure::TimedOut(config.connect_timeout))
    .and_then(|r| r.map_err(ConnectFailure::Client))?;
    Ok(Connection { client: Arc::new(client), connected_at: std::time::Instant::now() })
}

/// No connect before `interval` from now.
fn pace(not_before: &std::sync::Mutex<Option<std::time::Instant>>, interval: Duration) {
    *not_before.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::time::Instant::now() + interval);
}

/// A client of the server in `config`, not connected. Its own reconnection is off: every
/// reconnect is the sink's, with a new client.
fn build_client(config: &IggySinkConfig) -> Result<IggyClient, IggyError> {
    let tcp = TcpClientConfig {
        server_address: config.address.clone(),
        tls_enabled: config.tls,
        tls_domain: config.tls_domain.clone().unwrap_or_default(),
        tls_ca_file: config.tls_ca_file.clone(),
        auto_login: AutoLogin::Enabled(Credentials::UsernamePassword(
            config.username.clone(),
            config.password.expose().to_string().into(),
        )),
        reconnection: TcpClientReconnectionConfig {
            enabled: false,
            max_retries: Some(config.reconnection_max_retries),
            interval: IggyDuration::from(config.reconnection_interval),
            reestablish_after: IggyDuration::from(config.reconnection_interval),
        },
        ..TcpClientConfig::default()
    };
    let tcp = TcpClient::create(Arc::new(tcp))?;
    Ok(IggyClient::create(ClientWrapper::Tcp(tcp), None, None))
}

/// Whether `client`'s connection is signed in, as far as it knows: a connection its
/// heartbeat found closed says `Disconnected`.
async fn signed_in(client: &IggyClient) -> bool {
    use iggy_common::locking::IggyRwLockFn;
    use iggy_common::{BinaryTransport, ClientState};
    let wrapper = client.client();
    let wrapper = wrapper.read().await;
    match &*wrapper {
        ClientWrapper::Tcp(tcp) => tcp.get_state().await == ClientState::Authenticated,
        // The sink builds TCP clients only.
        _ => true,
    }
}

/// Which failures are whose. Server errors arrive as codes, so this matches variants.
pub fn classify(e: &IggyError) -> SendErrorKind {
    match e {
        IggyError::Disconnected => SendErrorKind::Disconnected,
        IggyError::CannotEstablishConnection
        | IggyError::NotConnected
        | IggyError::ConnectionClosed
        | IggyError::StaleClient
        | IggyError::TcpError
        | IggyError::EmptyResponse
        | IggyError::IoError(_)
        // The server's own state (not caught up after a restart, a full pipeline), not
        // one destination's; an outcome not committed is unknown, like a disconnect.
        | IggyError::TransientNotCommitted
        | IggyError::TransientNotAccepted
        // A call the server applied before, its reply gone: the server's own
        // bookkeeping, no destination's (a send so answered is sent again,
        // `IggySink::send`).
        | IggyError::RequestAlreadyApplied => SendErrorKind::Unavailable,
        // Refused credentials, or a session not signed in: no call can succeed.
        IggyError::InvalidCredentials | IggyError::Unauthenticated => SendErrorKind::Unauthorized,
        // Everything else is one destination's, `Unauthorized` (permission denied)
        // included: Iggy grants permissions per stream and topic, so a user may lack
        // them for one destination only, and that destination's breaker should open,
        // not every destination be held as though the server were gone. So is
        // `InvalidCommand` on a send (its connection is dropped, `settle`): the client's
        // word for a reply it could not parse, but also the server's for a batch it
        // could not decode, which may be one batch's alone; taken for the server's, one
        // such batch would hold every destination.
        _ => SendErrorKind::Destination,
    }
}

fn topic_info(details_partitions: u32, options: &iggy::prelude::ResourceOptions) -> TopicInfo {
    let parsed = TopicCreateOptions::from_resource_options(options);
    let durable = parsed.enforce_fsync == Some(true) && parsed.messages_required_to_save == Some(1);
    TopicInfo { partitions_count: details_partitions, durable }
}

/// The largest header name or value the server takes.
pub(crate) const HEADER_FIELD_MAX_BYTES: usize = 255;

/// Builds the wire messages of a batch: the same messages `IggyMessage::builder()` builds
/// (a test compares them byte for byte), without its per-message map and per-header
/// buffers. The header blocks of the whole batch are encoded, with the protocol crate's
/// encoder, into one buffer that each message then shares a slice of; headers are sorted
/// by name, and a repeated name keeps its last value, as the builder's map does.
/// Headers the server could not take (empty, longer than 255 bytes) are left out and
/// counted; the door clamps what it forwards, so this is a last guard, not the rule.
pub(crate) fn to_iggy(messages: &[OutMessage<'_>]) -> Result<Vec<IggyMessage>, SendError> {
    let (name_kind, value_kind) = (HeaderKind::String.as_code(), HeaderKind::Raw.as_code());
    let block_max: usize =
        messages.iter().map(|m| m.headers.iter().map(|(k, v)| 10 + k.len() + v.len()).sum::<usize>()).sum();
    let mut blocks = BytesMut::with_capacity(block_max);
    let mut entries: Vec<(u8, &[u8], u8, &[u8])> = Vec::new();
    let origin_timestamp = IggyTimestamp::now().as_micros();
    let mut wire = Vec::with_capacity(messages.len());
    for m in messages {
        let unsendable =
            |why: &str| SendError::new(SendErrorKind::Destination, format!("message {} cannot be sent: {why}", m.id));
        if m.payload.is_empty() || m.payload.len() > MAX_PAYLOAD_SIZE as usize {
            return Err(unsendable(&format!("payload of {} bytes", m.payload.len())));
        }
        entries.clear();
        for (name, value) in &m.headers {
            let fits = |b: &[u8]| !b.is_empty() && b.len() <= HEADER_FIELD_MAX_BYTES;
            if fits(name.as_bytes()) && fits(value) {
                entries.push((name_kind, name.as_bytes(), value_kind, value));
            } else {
                metrics::counter!("iggy_connector_headers_dropped_total").increment(1);
            }
        }
        // Stable: among equal names the last stays last, and dedup keeps it.
        entries.sort_by(|a, b| a.1.cmp(b.1));
        let mut i = 0;
        while i + 1 < entries.len() {
            if entries[i].1 == entries[i + 1].1 {
                entries.remove(i);
            } else {
                i += 1;
            }
        }
        encode_user_headers(&entries, &mut blocks);
        let headers = blocks.split().freeze();
        if headers.len() > MAX_USER_HEADERS_SIZE as usize {
            return Err(unsendable(&format!("{} bytes of headers", headers.len())));
        }
        wire.push(IggyMessage {
            header: IggyMessageHeader {
                checksum: 0,
                id: m.id,
                offset: 0,
                timestamp: 0,
                origin_timestamp,
                user_headers_length: headers.len() as u32,
                payload_length: m.payload.len() as u32,
                reserved: 0,
            },
            payload: m.payload.clone(),
            user_headers: (!headers.is_empty()).then_some(headers),
        });
    }
    Ok(wire)
}

impl Sink for IggySink {
    type Message = IggyMessage;

    fn prepare(&self, messages: &[OutMessage<'_>]) -> Result<Vec<IggyMessage>, SendError> {
        to_iggy(messages)
    }

    async fn ensure(&self, dest: &DestinationKey) -> Result<TopicInfo, SendError> {
        let taken = self.take().await?;
        let result = ensure_on(taken.client(), dest, &self.create_options()).await;
        let info = self.settle(taken, result)?;
        self.learn_partitions(dest, info.partitions_count);
        if !info.durable && self.first_not_durable_warning(dest, info.partitions_count) {
            tracing::warn!(destination = %dest, "topic acknowledges without fsync: its acks may not survive a crash of the server");
        }
        Ok(info)
    }

    /// Unreachable since a failure, or a connect in flight: a call cut short while it
    /// waited for a new connection (every idle one taken) failed for the whole client,
    /// even when the server answered on other connections meanwhile (a server slow to take
    /// or sign in new connections), and no breaker may count it. The connect task runs on
    /// after its waiters gave up, so it is still in flight when their timeouts are judged.
    /// A call on an existing connection that times out meanwhile is taken for the
    /// client's too: a breaker then counts a silent destination a little later, never a
    /// healthy one.
    fn connecting(&self) -> bool {
        if self.unreachable.load(Ordering::Acquire) {
            return true;
        }
        match self.connecting.try_lock() {
            Ok(task) => task.as_ref().is_some_and(|t| !t.is_finished()),
            // Held: a caller is in `connect`, waiting on a connect or about to start one.
            Err(_) => true,
        }
    }

    fn answered_since(&self, since: std::time::Instant) -> bool {
        self.last_answer.lock().unwrap_or_else(|p| p.into_inner()).is_some_and(|t| t >= since)
    }

    async fn server_answers(&self) -> bool {
        let asked = std::time::Instant::now();
        // A connect that succeeded but took too long for a call to go out on it (`take`)
        // still showed the server answering.
        let Ok(taken) = self.take().await else { return self.answered_since(asked) };
        let pinged = taken.client().ping().await;
        self.settle(taken, pinged).is_ok()
    }

    async fn send(
        &self,
        dest: &DestinationKey,
        p: &Partitioning,
        messages: &mut [IggyMessage],
    ) -> Result<(), SendError> {
        let stream =
            Identifier::named(&dest.stream).map_err(|e| SendError::new(SendErrorKind::Destination, e.to_string()))?;
        let topic =
            Identifier::named(&dest.topic).map_err(|e| SendError::new(SendErrorKind::Destination, e.to_string()))?;
        let taken = self.take().await?;
        let result = async {
            let partition = match p {
                Partitioning::PartitionId(id) => *id,
                placed => {
                    let first_id = messages.first().map_or(0, |m| m.header.id);
                    self.place(taken.client(), dest, &stream, &topic, placed, first_id).await?
                }
            };
            let partitioning = IggyPartitioning::partition_id(partition);
            // Only `Ok` frees records. A send is never answered "already applied" by the
            // server this client speaks to: its request-id table deduplicates metadata
            // calls only, and sends are at-least-once (`core/sdk/src/vsr.rs`,
            // `core/consensus/src/metadata_helpers.rs` in apache/iggy). Any answer but
            // `Ok`, that one included, leaves the records held and sent again: a
            // duplicate at worst, never a loss on an answer nothing here can check.
            taken.client().send_messages(&stream, &topic, &partitioning, messages).await.map(|_| ())
        }
        .await;
        if !matches!(p, Partitioning::PartitionId(_))
            && let Err(e) = &result
            && classify(e) == SendErrorKind::Destination
        {
            // The count it was placed by may be what is wrong (partitions deleted): the
            // retry asks the server again.
            if let Some(p) = self.placements().get_mut(dest) {
                p.stale = true;
            }
        }
        self.settle(taken, result).map(|_| ())
    }
}

/// Makes sure `dest` exists on the server `client` is connected to, creating what is
/// missing; "already exists" is success.
async fn ensure_on(
    client: &IggyClient,
    dest: &DestinationKey,
    options: &TopicCreateOptions,
) -> Result<TopicInfo, IggyError> {
    let stream = Identifier::named(&dest.stream)?;
    let topic = Identifier::named(&dest.topic)?;
    // The topic first: its answer is the topic's own details, where the stream's lists
    // every topic of the stream (with routing by payload, thousands), which every lane's
    // start, re-ensure after a failure and dead-letter send would fetch.
    match client.get_topic(&stream, &topic).await {
        Ok(Some(d)) => return Ok(topic_info(d.partitions_count, &d.options)),
        Ok(None)
        | Err(
            IggyError::StreamIdNotFound(_)
            | IggyError::StreamNameNotFound(_)
            | IggyError::TopicIdNotFound(..)
            | IggyError::TopicNameNotFound(..),
        ) => {}
        Err(e) => return Err(e),
    }
    // Each creation is said and counted: at first use, as after the stream or topic was
    // deleted on the server (or the server replaced by an empty one), when it is made
    // again with `topic_defaults`, not with whatever settings it had.
    if client.get_stream(&stream).await?.is_none() {
        match client.create_stream(&dest.stream).await {
            Ok(_) => {
                tracing::info!(stream = %dest.stream, "created the stream on the iggy server");
            }
            Err(IggyError::StreamNameAlreadyExists(_)) => {}
            Err(e) => return Err(e),
        }
    }
    let details = match client.get_topic(&stream, &topic).await? {
        Some(d) => d,
        None => match client.create_topic(&stream, &dest.topic, options).await {
            Ok(d) => {
                metrics::counter!("iggy_connector_destinations_created_total").increment(1);
                tracing::info!(
                    stream = %dest.stream,
                    topic = %dest.topic,
                    partitions = d.partitions_count,
                    "created the topic on the iggy server, with router.topic_defaults"
                );
                d
            }
            Err(IggyError::TopicNameAlreadyExists(..)) => client
                .get_topic(&stream, &topic)
                .await?
                .ok_or(IggyError::TopicIdNotFound(topic.clone(), stream.clone()))?,
            Err(e) => return Err(e),
        },
    };
    Ok(topic_info(details.partitions_count, &details.options))
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;
    use std::collections::BTreeMap;

    use bytes::Bytes;
    use iggy::prelude::{HeaderKey, HeaderValue};

    use super::*;

    /// What the crate's own builder makes of `m`, as the reference for `to_iggy`.
    fn built_by_the_crate(m: &OutMessage<'_>) -> IggyMessage {
        let mut headers = BTreeMap::new();
        for (k, v) in &m.headers {
            if let (Ok(k), Ok(v)) = (HeaderKey::try_from(*k), HeaderValue::from_raw(HeaderKind::Raw, v)) {
                headers.insert(k, v);
            }
        }
        let b = IggyMessage::builder().id(m.id).payload(m.payload.clone());
        if headers.is_empty() { b.build() } else { b.user_headers(headers).build() }.expect("the builder takes it")
    }

    /// A test broker, and a sink on it with `config` (its address set to the broker's).
    async fn broker_and_sink(config: IggySinkConfig) -> (test_broker::TestBroker, IggySink) {
        let broker = test_broker::TestBroker::start(test_broker::TestBrokerConfig::default()).await.unwrap();
        let sink = IggySink::new(&IggySinkConfig { address: broker.addr().to_string(), ..config }).unwrap();
        (broker, sink)
    }

    /// The wire messages of one `{}` event with message id `id`.
    fn one_message(id: u128) -> Vec<IggyMessage> {
        let payload = Bytes::from_static(b"{}");
        to_iggy(&[OutMessage { id, payload: &payload, headers: vec![] }]).unwrap()
    }

    /// `n` connections in the pool: taken at once (each a new one), then given back.
    async fn fill_pool(sink: &IggySink, n: usize) {
        let mut taken = Vec::new();
        for _ in 0..n {
            taken.push(sink.take().await.expect("a connection"));
        }
        for t in taken {
            assert!(sink.settle(t, Ok(())).is_ok());
        }
    }

    /// A connection taken by a call, made now and never connected.
    fn unconnected_taken() -> Taken {
        let client = Arc::new(build_client(&IggySinkConfig::default()).unwrap());
        Taken { connection: Connection { client, connected_at: std::time::Instant::now() } }
    }

    /// Waits until the broker has accepted `n` connections and the sink holds `idle`
    /// idle ones (a replacement is made in the background).
    async fn connections_settle(sink: &IggySink, broker: &test_broker::TestBroker, n: u64, idle: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while broker.accepted_connections() != n || sink.idle().len() != idle {
            assert!(
                std::time::Instant::now() < deadline,
                "{} connections accepted, {} idle; wanted {n} and {idle}",
                broker.accepted_connections(),
                sink.idle().len()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A connection past `connection_max_age` still takes the call it was taken for
    /// (no wait for a connect, no failure) while a replacement is made in the
    /// background; taken again, it is swapped for the replacement and retired. Without
    /// the age, the first connection served every call for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_past_its_age_is_swapped_for_a_replacement_made_meanwhile() {
        let broker = test_broker::TestBroker::start(test_broker::TestBrokerConfig::default()).await.unwrap();
        let max_age = Duration::from_secs(1);
        let config =
            IggySinkConfig { address: broker.addr().to_string(), connection_max_age: max_age, ..Default::default() };
        let sink = IggySink::new(&config).unwrap();
        let dest = DestinationKey::new("s", "t");
        sink.ensure(&dest).await.expect("the destination");
        sink.ensure(&dest).await.expect("a second call");
        assert_eq!(broker.accepted_connections(), 1, "a connection younger than its age was not kept");
        tokio::time::sleep(max_age + Duration::from_millis(100)).await;

        // Taken past its age: it is the old one, and a replacement is under way.
        let old = sink.take().await.expect("the old connection");
        assert!(old.connection.is_older_than(max_age));
        connections_settle(&sink, &broker, 2, 1).await;
        assert!(sink.settle(old, Ok(())).is_ok());
        // Taken again: swapped for the replacement, and retired.
        let taken = sink.take().await.expect("a connection");
        assert!(!taken.connection.is_older_than(max_age), "the old connection was taken again");
        assert_eq!(sink.idle().len(), 0, "the old connection was kept beside the new one");
        assert_eq!(broker.accepted_connections(), 2);
        assert!(sink.settle(taken, Ok(())).is_ok());
        assert!(!sink.connecting(), "a replacement was taken for the server being unreachable");
    }

    /// Retiring never fails a call nor shrinks the pool: of three connections past their
    /// age, a take retires at most one (the one it swaps for a replacement); a take
    /// while connects are paced (no replacement can be made) takes an old one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn retiring_fails_no_call_and_leaves_the_pool_its_size() {
        let max_age = Duration::from_secs(1);
        let config = IggySinkConfig {
            connection_max_age: max_age,
            reconnection_interval: Duration::from_secs(3),
            ..Default::default()
        };
        let (broker, sink) = broker_and_sink(config).await;
        fill_pool(&sink, 3).await;
        assert_eq!(broker.accepted_connections(), 3);
        tokio::time::sleep(max_age + Duration::from_millis(100)).await;

        // No connect may be made: the call goes out on an old connection, at once.
        // As a failed connect paces them.
        pace(&sink.connect_not_before, sink.config.reconnection_interval);
        sink.ensure(&DestinationKey::new("s", "t")).await.expect("a call while connects are paced");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!((broker.accepted_connections(), sink.idle().len()), (3, 3), "a connect while paced");

        // Once connects may be made: one replacement, one old connection retired for it.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let old = sink.take().await.expect("an old connection");
        connections_settle(&sink, &broker, 4, 3).await;
        assert!(sink.settle(old, Ok(())).is_ok());
        let young = sink.take().await.expect("the replacement");
        assert!(!young.connection.is_older_than(max_age));
        assert_eq!(sink.idle().len(), 2, "more than the one swapped were retired");
        assert!(sink.settle(young, Ok(())).is_ok());
        assert_eq!((broker.accepted_connections(), sink.idle().len()), (4, 3), "the pool shrank");
    }

    /// A connection that failed for the whole client (disconnected) marks the server
    /// unreachable; a call answered on another connection afterwards shows it is not.
    /// Left standing, the mark made every timed-out call count as the whole server's,
    /// so a silent destination's breaker never counted it, for as long as pooled
    /// connections kept a new connect from happening.
    #[test]
    fn a_call_answered_after_a_client_wide_failure_takes_the_failure_back() {
        let sink = IggySink::new(&IggySinkConfig::default()).unwrap();
        let taken = unconnected_taken;
        assert!(sink.settle::<()>(taken(), Err(IggyError::Disconnected)).is_err());
        assert!(sink.connecting(), "a disconnection is the whole client's");
        assert!(sink.settle(taken(), Ok(())).is_ok());
        assert!(!sink.connecting(), "the server answered, yet it is still taken for unreachable");
    }

    /// A connection the server closes under a call (as a proxy's idle timeout, or the
    /// server dropping one client, does while the rest are fine) is that connection's
    /// trouble: the call fails as disconnected and no breaker counts it, the other idle
    /// connections stay, connects are not paced, and the next call goes out at once on
    /// another connection. The client answers such a call "disconnected", as it does for
    /// a server gone; taken for that, every idle connection was dropped and every call
    /// failed for `reconnection_interval`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_closed_under_a_call_is_dropped_alone_and_the_next_call_goes_out() {
        let (broker, sink) = broker_and_sink(IggySinkConfig::default()).await;
        let dest = DestinationKey::new("s", "t");
        sink.ensure(&dest).await.expect("the destination");
        fill_pool(&sink, 3).await;
        assert_eq!(broker.accepted_connections(), 3);
        let partition = Partitioning::PartitionId(0);

        broker.drop_connection_after_next_request(
            test_broker::RequestKind::SendMessages,
            test_broker::DropPoint::BeforeApplying,
        );
        let e =
            sink.send(&dest, &partition, &mut one_message(1)).await.expect_err("the connection closed under the call");
        assert_eq!(e.kind, SendErrorKind::Disconnected, "{e}");
        assert!(sink.connecting(), "taken for answered before any call was");
        assert_eq!(sink.idle().len(), 2, "the other connections were dropped, or the closed one kept");
        assert!(sink.connect_wait().is_none(), "connects paced");

        sink.send(&dest, &partition, &mut one_message(2)).await.expect("the next call, on another connection");
        assert!(!sink.connecting(), "the server answered, yet it is taken for unreachable");
        assert_eq!((broker.accepted_connections(), sink.idle().len()), (3, 2), "a connect was made");
        let ids: Vec<u128> = broker.messages("s", "t").iter().map(|m| m.id).collect();
        assert_eq!(ids, vec![2]);
    }

    /// An idle connection closed while it was idle (its heartbeat found it so) is
    /// dropped alone when taken: the call goes out on another, the rest of the pool stays,
    /// and connects are not paced. Made on it, the call failed "disconnected" (the
    /// client's own reconnection is off), which was taken for the whole server: every
    /// idle connection dropped, connects paced, and the call failed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_closed_while_idle_is_dropped_alone_and_the_call_goes_out_on_another() {
        let (_broker, sink) = broker_and_sink(IggySinkConfig::default()).await;
        let mut taken = Vec::new();
        for _ in 0..3 {
            taken.push(sink.take().await.expect("a connection"));
        }
        // The last given back is the first taken: it is the one closed.
        taken[2].client().disconnect().await.unwrap();
        for t in taken {
            assert!(sink.settle(t, Ok(())).is_ok());
        }
        sink.ensure(&DestinationKey::new("s", "t")).await.expect("the call went out on a closed connection");
        assert_eq!(sink.idle().len(), 2, "the live connections were dropped, or the closed one kept");
        assert!(sink.connect_wait().is_none(), "connects paced");
        assert!(!sink.connecting(), "taken for the whole server");
    }

    /// Calls that queue behind one another's connects (one connect runs at a time) go
    /// out on their new connections when they waited less than a quarter of the result
    /// timeout. With a fixed 250 ms, every call behind connects slower than that failed
    /// "unavailable" (counted against its lane, which backed off) on a server that
    /// answered every request.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_queued_behind_slow_connects_go_out_within_a_quarter_of_the_result_timeout() {
        assert_eq!(fresh_connection_usable_for(Duration::from_secs(10)), Duration::from_millis(2500));
        assert_eq!(fresh_connection_usable_for(Duration::from_millis(100)), FRESH_CONNECTION_USABLE_FOR_MIN);
        let broker = test_broker::TestBroker::start(test_broker::TestBrokerConfig::default()).await.unwrap();
        broker.set_delay(Duration::from_millis(60));
        let config = IggySinkConfig {
            address: broker.addr().to_string(),
            fresh_connection_usable_for: fresh_connection_usable_for(Duration::from_secs(10)),
            ..IggySinkConfig::default()
        };
        let sink = Arc::new(IggySink::new(&config).unwrap());
        let calls: Vec<_> = (0..3)
            .map(|i| {
                let sink = sink.clone();
                tokio::spawn(async move { sink.ensure(&DestinationKey::new("s", format!("t{i}"))).await })
            })
            .collect();
        for call in calls {
            call.await.unwrap().expect("a call failed on a server that answers");
        }
    }

    /// A balanced send to a topic whose partitions were all deleted fails as the
    /// destination's, saying the topic has no partitions, not that it is missing (which
    /// sent the operator looking for a topic that exists).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_placed_send_to_a_topic_without_partitions_says_so() {
        let (broker, sink) = broker_and_sink(IggySinkConfig::default()).await;
        let dest = DestinationKey::new("s", "t");
        sink.ensure(&dest).await.expect("the destination");
        assert!(broker.shrink_partitions("s", "t", 0));
        let mut batch = one_message(1);
        // The count learnt by the ensure places the first try; its failure has it asked again.
        let first = sink.send(&dest, &Partitioning::Balanced, &mut batch).await.expect_err("no partition");
        assert_eq!(first.kind, SendErrorKind::Destination, "{first}");
        let e = sink.send(&dest, &Partitioning::Balanced, &mut batch).await.expect_err("no partition");
        assert_eq!(e.kind, SendErrorKind::Destination, "{e}");
        assert!(e.detail.contains("has no partitions"), "{e}");
        assert_eq!(broker.messages("s", "t"), vec![]);
    }

    /// A send answered "already applied" (a code the server gives metadata calls only)
    /// is not taken for delivered: records are freed on `Ok` alone, so the send fails
    /// and is retried (a duplicate at worst), as the server's, not the destination's,
    /// and the connection, answered on, stays in the pool.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_send_answered_already_applied_is_sent_again_not_freed() {
        let (broker, sink) = broker_and_sink(IggySinkConfig::default()).await;
        let dest = DestinationKey::new("s", "t");
        sink.ensure(&dest).await.expect("the destination");
        let mut batch = one_message(1);
        broker.fail_topic("s", "t", Some(IggyError::RequestAlreadyApplied));
        let e = sink.send(&dest, &Partitioning::PartitionId(0), &mut batch).await.expect_err("taken for delivered");
        assert_eq!(e.kind, SendErrorKind::Unavailable, "{e}");
        assert_eq!(sink.idle().len(), 1, "the connection answered on was dropped");
        assert!(!sink.connecting());
        assert_eq!(
            classify(&IggyError::RequestAlreadyApplied),
            SendErrorKind::Unavailable,
            "taken for a destination's fault"
        );
    }

    /// A reply the client could not parse (`InvalidCommand`) leaves its connection out of
    /// step: the next call on it would read the rest of that reply as its own answer.
    /// The connection is dropped, so a send the server then refuses fails, and is not
    /// taken for delivered. Kept, that send returned `Ok` with nothing stored.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_reply_the_client_cannot_parse_drops_its_connection() {
        let (broker, sink) = broker_and_sink(IggySinkConfig::default()).await;
        let dest = DestinationKey::new("s", "t");
        sink.ensure(&dest).await.expect("the destination");
        let partition = Partitioning::PartitionId(0);

        broker.malformed_reply_to_next_request(test_broker::RequestKind::SendMessages);
        let e = sink.send(&dest, &partition, &mut one_message(1)).await.expect_err("the malformed reply");
        assert_eq!(e.kind, SendErrorKind::Destination);
        assert_eq!(sink.idle().len(), 0, "the connection out of step was given back");

        broker.fail_topic("s", "t", Some(IggyError::Error));
        let refused = sink.send(&dest, &partition, &mut one_message(2)).await;
        assert!(refused.is_err(), "a send the server refused was taken for delivered: {refused:?}");
        assert_eq!(broker.messages("s", "t").len(), 1, "only the first send is stored");
        assert_eq!(broker.accepted_connections(), 2, "the second send went out on the first connection");
    }

    /// A reply the client cannot parse while it connects (to its own leader check, which
    /// it ends with a warning, not an error) leaves the new connection one reply behind:
    /// a ping takes any answer, so its proving pings read the leftover reply and each
    /// other's, and its first send would read the last ping's answer as its own. The
    /// connect ends with a call whose answer must decode, so such a connection is never
    /// used: a send the server refuses fails. Used, that send returned `Ok` with nothing
    /// stored.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_left_out_of_step_by_its_connect_is_never_used() {
        let broker = test_broker::TestBroker::start(test_broker::TestBrokerConfig::default()).await.unwrap();
        let config = IggySinkConfig { address: broker.addr().to_string(), ..IggySinkConfig::default() };
        let dest = DestinationKey::new("s", "t");
        IggySink::new(&config).unwrap().ensure(&dest).await.expect("the destination");
        broker.malformed_reply_to_next_request(test_broker::RequestKind::ClusterMetadata);
        broker.fail_topic("s", "t", Some(IggyError::Error));

        let sink = IggySink::new(&config).unwrap();
        let payload = Bytes::from_static(b"{}");
        for id in 1..=3 {
            let mut batch = sink.prepare(&[OutMessage { id, payload: &payload, headers: vec![] }]).unwrap();
            let sent = sink.send(&dest, &Partitioning::PartitionId(0), &mut batch).await;
            assert!(sent.is_err(), "try {id}: a send the server refused was taken for delivered");
        }
        assert!(broker.messages("s", "t").is_empty());
    }

    /// A sink of `partitions` partitions per topic created, on `broker`, with
    /// `connection_max_age`, and the destination `s/t` made.
    async fn placing_sink(
        broker: &test_broker::TestBroker,
        partitions: u32,
        max_age: Duration,
    ) -> (IggySink, DestinationKey) {
        let config = IggySinkConfig {
            address: broker.addr().to_string(),
            connection_max_age: max_age,
            topic_defaults: TopicDefaults { partitions_count: partitions, ..TopicDefaults::default() },
            ..IggySinkConfig::default()
        };
        let sink = IggySink::new(&config).unwrap();
        let dest = DestinationKey::new("s", "t");
        sink.ensure(&dest).await.expect("the destination");
        (sink, dest)
    }

    /// One message, `id`, sent to `dest` with `partitioning` on a connection made for it
    /// (the pool gives back the last connection given: a new one is taken first).
    async fn send_on_a_new_connection(sink: &IggySink, dest: &DestinationKey, partitioning: &Partitioning, id: u128) {
        let fresh = open_connection(&sink.config).await.expect("a connection");
        sink.idle().push(fresh);
        let mut batch = one_message(id);
        sink.send(dest, partitioning, &mut batch).await.expect("sent");
    }

    /// A balanced batch goes to the partition its first message's id names, whatever
    /// connection it goes out on, and so does its retry: placed by a turn, a retry after
    /// an unknown outcome went to the next partition, where neither a consumer of the
    /// first one nor Iggy's per-partition deduplication could tell it for a duplicate.
    /// Placed by the client, each new connection began at partition 0.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_balanced_batch_and_its_retry_go_to_the_partition_its_first_id_names() {
        let broker = test_broker::TestBroker::start(test_broker::TestBrokerConfig::default()).await.unwrap();
        let (sink, dest) = placing_sink(&broker, 4, Duration::from_secs(300)).await;
        for id in 1..=8 {
            send_on_a_new_connection(&sink, &dest, &Partitioning::Balanced, id).await;
        }
        let partitions: Vec<u32> = broker.messages("s", "t").iter().map(|m| m.partition_id).collect();
        assert_eq!(partitions, [1, 2, 3, 0, 1, 2, 3, 0], "spread over every partition");
        // A send refused at the destination has the count asked again once, and its
        // retry goes where the first try went.
        broker.fail_topic("s", "t", Some(IggyError::Error));
        let mut batch = one_message(9);
        assert!(sink.send(&dest, &Partitioning::Balanced, &mut batch).await.is_err());
        broker.fail_topic("s", "t", None);
        let topics_asked = broker.request_count(test_broker::RequestKind::GetTopic);
        sink.send(&dest, &Partitioning::Balanced, &mut batch).await.expect("the retry");
        send_on_a_new_connection(&sink, &dest, &Partitioning::Balanced, 9).await;
        assert_eq!(broker.request_count(test_broker::RequestKind::GetTopic), topics_asked + 1, "asked again, once");
        // A batch of several goes whole where its first message's id says.
        let payload = Bytes::from_static(b"{}");
        let out: Vec<OutMessage<'_>> =
            (14..=16).map(|id| OutMessage { id, payload: &payload, headers: vec![] }).collect();
        let mut batch = sink.prepare(&out).unwrap();
        sink.send(&dest, &Partitioning::Balanced, &mut batch).await.expect("sent");
        let partitions: Vec<u32> = broker.messages("s", "t")[8..].iter().map(|m| m.partition_id).collect();
        assert_eq!(partitions, [1, 1, 2, 2, 2]);
    }

    /// A key goes to one partition on every connection, and after partitions are added,
    /// once the count is asked again (at `connection_max_age`), to its new partition on
    /// every connection, never back. Placed by the client, a connection that learnt the
    /// count before the change and one made after it sent the key to two partitions in
    /// turn.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_key_changes_partition_once_when_partitions_are_added() {
        let broker = test_broker::TestBroker::start(test_broker::TestBrokerConfig::default()).await.unwrap();
        // Long enough for two connects and three sends on a busy machine.
        let max_age = Duration::from_secs(3);
        let (sink, dest) = placing_sink(&broker, 1, max_age).await;
        // A key that three partitions place in partition 2.
        let key = (0u32..).map(|i| format!("k{i}")).find(|k| iggy_common::calculate_32(k.as_bytes()) % 3 == 2).unwrap();
        let keyed = Partitioning::Key(key.into_bytes());
        let send = |id: u128| {
            let (sink, dest, keyed) = (&sink, &dest, &keyed);
            async move {
                let payload = Bytes::from_static(b"{}");
                let mut batch = sink.prepare(&[OutMessage { id, payload: &payload, headers: vec![] }]).unwrap();
                sink.send(dest, keyed, &mut batch).await.expect("sent");
            }
        };
        // On connection A, which then knows the topic as one partition.
        send_on_a_new_connection(&sink, &dest, &keyed, 1).await;
        assert!(broker.grow_partitions("s", "t", 3));
        // On connection B, made after the change; then on A again, within the age.
        send_on_a_new_connection(&sink, &dest, &keyed, 2).await;
        let b = sink.idle().pop().expect("B given back");
        send(3).await;
        sink.idle().push(b);
        tokio::time::sleep(max_age + Duration::from_millis(100)).await;
        send(4).await;
        send(5).await;
        let partitions: Vec<u32> = broker.messages("s", "t").iter().map(|m| m.partition_id).collect();
        assert_eq!(partitions, [0, 0, 0, 2, 2]);
    }

    /// Ensuring a destination that exists asks for the topic alone, never for its stream,
    /// whose answer lists every topic of the stream.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ensuring_an_existing_topic_does_not_fetch_its_stream() {
        let (broker, sink) = broker_and_sink(IggySinkConfig::default()).await;
        let dest = DestinationKey::new("s", "t");
        sink.ensure(&dest).await.expect("created");
        assert_eq!(broker.topic_options("s", "t").map(|o| o.partitions_count), Some(Some(1)));
        let streams_asked = broker.request_count(test_broker::RequestKind::GetStream);
        for _ in 0..3 {
            assert_eq!(sink.ensure(&dest).await.expect("ensured").partitions_count, 1);
        }
        assert_eq!(broker.request_count(test_broker::RequestKind::GetStream), streams_asked);
        // A topic of an existing stream, and one of a new stream, are still made.
        for (stream, topic) in [("s", "u"), ("new", "t")] {
            sink.ensure(&DestinationKey::new(stream, topic)).await.expect("created");
            assert!(broker.topic_options(stream, topic).is_some(), "{stream}/{topic}");
        }
    }

    /// What a test's subscriber writes: every line logged, kept.
    #[derive(Clone, Default)]
    struct LoggedLines(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for LoggedLines {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl LoggedLines {
        fn count(&self, text: &str) -> usize {
            String::from_utf8_lossy(&self.0.lock().unwrap()).lines().filter(|l| l.contains(text)).count()
        }
    }

    /// A topic that acknowledges without fsync is said once in the log, not at every
    /// ensure: a dead-letter topic is ensured before each of its sends. (One thread, so
    /// that the subscriber set for it sees every line the sink's tasks log.)
    #[tokio::test(flavor = "current_thread")]
    async fn a_topic_without_fsync_is_reported_once() {
        let logged = LoggedLines::default();
        let writer = logged.clone();
        let subscriber = tracing_subscriber::fmt().with_writer(move || writer.clone()).with_ansi(false).finish();
        let _logging = tracing::subscriber::set_default(subscriber);
        let broker = test_broker::TestBroker::start(test_broker::TestBrokerConfig::default()).await.unwrap();
        let config = IggySinkConfig {
            address: broker.addr().to_string(),
            topic_defaults: TopicDefaults { enforce_fsync: false, ..TopicDefaults::default() },
            ..IggySinkConfig::default()
        };
        let sink = IggySink::new(&config).unwrap();
        let dest = DestinationKey::new("s", "t");
        for _ in 0..3 {
            assert!(!sink.ensure(&dest).await.expect("the destination").durable);
        }
        assert_eq!(logged.count("acknowledges without fsync"), 1, "logged once for three ensures");
        sink.ensure(&DestinationKey::new("s", "other")).await.expect("another destination");
        assert_eq!(logged.count("acknowledges without fsync"), 2, "and once for another destination");
    }

    /// A server that answers "not now" is there, and so is its connection.
    #[test]
    fn a_transient_answer_keeps_the_connection_and_the_pool() {
        let sink = IggySink::new(&IggySinkConfig::default()).unwrap();
        let taken = unconnected_taken;
        assert!(sink.settle(taken(), Ok(())).is_ok());
        let before = std::time::Instant::now();
        for transient in [IggyError::TransientNotAccepted, IggyError::TransientNotCommitted] {
            let e = sink.settle::<()>(taken(), Err(transient)).unwrap_err();
            assert_eq!(e.kind, SendErrorKind::Unavailable, "no breaker counts it");
        }
        assert_eq!(sink.idle().len(), 3);
        assert!(sink.answered_since(before) && !sink.connecting());
    }

    /// A server that takes connections and closes each after `hold` (never answering a
    /// byte), counting them.
    fn closing_server_after(hold: Duration) -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = accepted.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().map_while(Result::ok) {
                counted.fetch_add(1, Ordering::SeqCst);
                std::thread::spawn(move || {
                    std::thread::sleep(hold);
                    drop(conn);
                });
            }
        });
        (addr, accepted)
    }

    /// A server that takes connections and closes them at once, counting them.
    fn closing_server() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        closing_server_after(Duration::ZERO)
    }

    /// A topic created with no expiry configured never expires, as the configuration
    /// says (0: never), rather than taking the server's default, which may delete.
    #[test]
    fn a_topic_without_an_expiry_is_created_never_to_expire() {
        let sink = IggySink::new(&IggySinkConfig::default()).unwrap();
        assert_eq!(sink.create_options().message_expiry, Some(IggyExpiry::NeverExpire));
        let defaults = TopicDefaults { message_expiry: Some(Duration::from_secs(60)), ..TopicDefaults::default() };
        let sink = IggySink::new(&IggySinkConfig { topic_defaults: defaults, ..IggySinkConfig::default() }).unwrap();
        let sixty = IggyExpiry::ExpireDuration(IggyDuration::from(Duration::from_secs(60)));
        assert_eq!(sink.create_options().message_expiry, Some(sixty));
    }

    /// A call cut short while it waited for a new connection is the client's, not its
    /// destination's, even though the server answered on other connections a moment ago
    /// (here: takes the connection and never signs it in). Before, the answers on other
    /// connections made it a `Timeout` that the destination's breaker counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_call_cut_short_while_a_connect_is_in_flight_is_the_clients() {
        let (address, _accepted) = closing_server_after(Duration::from_secs(30));
        let config = IggySinkConfig { address, connect_timeout: Duration::from_secs(20), ..Default::default() };
        let sink = IggySink::new(&config).unwrap();
        sink.answered();
        assert!(!sink.connecting(), "the server answered");
        assert!(tokio::time::timeout(Duration::from_millis(200), sink.take()).await.is_err(), "no connection yet");
        sink.answered();
        assert!(sink.connecting(), "a connect in flight, yet a call cut short would be the destination's");
    }

    /// A connect whose every waiter gave up (their result timeouts) fails later: the next
    /// call, once the reconnection interval has passed since that failure, makes a new
    /// attempt. Before, it was handed the old failure as its own, and no attempt was made.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connect_that_failed_while_nobody_waited_is_not_handed_to_a_later_call() {
        let (address, accepted) = closing_server_after(Duration::from_millis(500));
        let config =
            IggySinkConfig { address, reconnection_interval: Duration::from_millis(300), ..Default::default() };
        let sink = IggySink::new(&config).unwrap();
        assert!(tokio::time::timeout(Duration::from_millis(100), sink.connect()).await.is_err(), "gave up waiting");
        // The connect fails about 500 ms in, then the interval passes.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !sink.connecting.lock().await.as_ref().is_some_and(|t| t.is_finished()) {
            assert!(std::time::Instant::now() < deadline, "the connect never ended");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        let again = tokio::time::timeout(Duration::from_secs(20), sink.connect()).await.expect("connect ends");
        assert!(again.is_err(), "the server closes every connection");
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "no new attempt: the old failure was handed over");
    }

    /// A connect that succeeded just now, as its caller waited, shows the server answering
    /// (a timed-out call's check that the server still answers relies on it); one that
    /// succeeded long ago, taken in later, shows nothing about the server now: counted as
    /// an answer, it would charge a silent server's timeouts to each destination's breaker.
    #[test]
    fn only_a_connect_that_just_succeeded_counts_as_the_server_answering() {
        let sink = IggySink::new(&IggySinkConfig::default()).unwrap();
        let before = std::time::Instant::now();
        assert!(sink.connected(Ok(Ok(())), false).is_ok());
        assert!(!sink.answered_since(before), "a success long past counted as an answer now");
        assert!(sink.connecting(), "a success long past took the server for reachable");
        assert!(sink.connected(Ok(Ok(())), true).is_ok());
        assert!(sink.answered_since(before));
        assert!(!sink.connecting());
    }

    /// A connect to a server that takes the connection and never answers fails after the
    /// connect timeout, not after the client's own reply timeout (30 s) or, for a TCP
    /// connect into a network that drops packets, the kernel's (about two minutes).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connect_to_a_server_that_never_answers_fails_after_the_connect_timeout() {
        let (address, _accepted) = closing_server_after(Duration::from_secs(120));
        let config = IggySinkConfig { address, connect_timeout: Duration::from_millis(300), ..Default::default() };
        let sink = IggySink::new(&config).unwrap();
        let started = std::time::Instant::now();
        let failed = tokio::time::timeout(Duration::from_secs(15), sink.connect()).await;
        let failed = failed.expect("the connect outlasted 15 s: no connect timeout");
        assert!(failed.is_err());
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
    }

    /// After a failed connect no new one is made for `reconnection_interval`: the calls
    /// in between fail at once, so however many destinations retry, a server that is
    /// down sees one connect per interval. Once it has passed, the next call connects.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_connect_is_not_tried_again_before_the_reconnection_interval() {
        let (address, accepted) = closing_server();
        let interval = Duration::from_millis(1500);
        let sink =
            IggySink::new(&IggySinkConfig { address, reconnection_interval: interval, ..Default::default() }).unwrap();
        let first = tokio::time::timeout(Duration::from_secs(20), sink.connect()).await.expect("connect ends");
        assert!(first.is_err(), "a server that closes every connection cannot be connected to");
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
        // Calls well inside the interval (half of it, whatever a busy machine delays).
        let failed_at = std::time::Instant::now();
        let mut refused = 0;
        while failed_at.elapsed() < interval / 2 && refused < 20 {
            let again = sink.connect().await.expect_err("within the interval");
            assert_eq!(again.kind, SendErrorKind::Unavailable, "{again}");
            assert!(again.detail.contains("reconnection_interval_ms"), "{again}");
            refused += 1;
        }
        assert!(refused > 0, "no call was made within the interval");
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "a connect was made within the interval");
        tokio::time::sleep(interval).await;
        let _ = tokio::time::timeout(Duration::from_secs(20), sink.connect()).await.expect("connect ends");
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "the interval passed, and no connect was made");
    }

    /// The worst a configured source can put on one message: the daemon's own headers,
    /// the four of a dead letter, and `FORWARD_HEADERS_MAX` forwarded ones, every name
    /// and value 255 bytes, is sendable; 200 forwarded headers (which the config refuses)
    /// would not be, and the destination would hold at that message for good.
    #[test]
    fn the_most_headers_a_source_can_forward_fit_in_one_message() {
        let payload = Bytes::from_static(b"{}");
        let value = vec![b'v'; 255];
        let names: Vec<String> = (0..200).map(|i| format!("{i:0>255}")).collect();
        let message = |forwarded: usize| {
            let mut headers: Vec<(&str, Cow<'_, [u8]>)> = [
                "iggy-ingest-source",
                "content-type",
                "peer_addr",
                "received_at_unix_ms",
                "iggy-ingest-rejected-reason",
                "iggy-ingest-destination-stream",
                "iggy-ingest-destination-topic",
                "iggy-ingest-destination",
            ]
            .into_iter()
            .map(|n| (n, Cow::Borrowed(&value[..])))
            .collect();
            headers.extend(names[..forwarded].iter().map(|n| (n.as_str(), Cow::Borrowed(&value[..]))));
            OutMessage { id: 1, payload: &payload, headers }
        };
        let sent = to_iggy(&[message(crate::FORWARD_HEADERS_MAX)]).expect("the most a source forwards is sendable");
        let len = sent[0].user_headers.as_ref().map_or(0, |h| h.len());
        assert!(len < crate::IGGY_USER_HEADERS_MAX_BYTES as usize / 2, "{len} bytes of headers");
        assert!(to_iggy(&[message(200)]).is_err(), "200 forwarded headers are over Iggy's limit");
    }

    #[test]
    fn a_batch_is_built_byte_for_byte_as_the_crates_builder_builds_it() {
        let payloads = [Bytes::from_static(b"{\"a\":1}"), Bytes::from_static(b"x"), Bytes::from(vec![7u8; 3000])];
        let long = "n".repeat(256);
        let messages = vec![
            // Unsorted names, a repeated name (the last value wins), a value and a name
            // the server cannot take.
            OutMessage {
                id: 1,
                payload: &payloads[0],
                headers: vec![
                    ("x-b", Cow::Borrowed(&b"2"[..])),
                    ("iggy-ingest-source", Cow::Borrowed(&b"github"[..])),
                    ("x-a", Cow::Borrowed(&b"first"[..])),
                    ("x-a", Cow::Owned(b"second".to_vec())),
                    ("x-empty", Cow::Borrowed(&b""[..])),
                    (long.as_str(), Cow::Borrowed(&b"v"[..])),
                ],
            },
            OutMessage { id: 2, payload: &payloads[1], headers: vec![] },
            OutMessage {
                id: u128::MAX,
                payload: &payloads[2],
                headers: vec![("content-type", Cow::Owned(vec![b'j'; 255]))],
            },
        ];
        let ours = to_iggy(&messages).expect("prepared");
        assert_eq!(ours.len(), messages.len());
        for (m, got) in messages.iter().zip(&ours) {
            let want = built_by_the_crate(m);
            assert_eq!(got.user_headers, want.user_headers, "headers of message {}", m.id);
            assert_eq!(got.payload, want.payload);
            let (g, w) = (&got.header, &want.header);
            let fields = |h: &IggyMessageHeader| {
                (h.checksum, h.id, h.offset, h.timestamp, h.user_headers_length, h.payload_length, h.reserved)
            };
            assert_eq!(fields(g), fields(w), "header of message {}", m.id);
            assert!(g.origin_timestamp > 0);
            // And the server's reading of it.
            assert_eq!(got.user_headers_map().expect("parses"), want.user_headers_map().expect("parses"));
        }
        let first = ours[0].user_headers_map().expect("parses").expect("has headers");
        assert_eq!(first.len(), 3, "x-a once, x-b and iggy-ingest-source; the empty value and the long name left out");
        assert_eq!(
            first.get(&HeaderKey::try_from("x-a").expect("key")).map(|v| v.as_bytes().to_vec()),
            Some(b"second".to_vec())
        );
    }

    /// Refused credentials fail every destination alike; a permission denied is one
    /// destination's (Iggy grants permissions per stream and topic).
    #[test]
    fn bad_credentials_are_every_destinations_and_a_permission_denied_is_one_destinations() {
        assert_eq!(classify(&IggyError::InvalidCredentials), SendErrorKind::Unauthorized);
        assert_eq!(classify(&IggyError::Unauthenticated), SendErrorKind::Unauthorized);
        assert_eq!(classify(&IggyError::Unauthorized), SendErrorKind::Destination);
        assert!(classify(&IggyError::Unauthorized).counts_against_destination());
        assert!(!classify(&IggyError::InvalidCredentials).counts_against_destination());
    }

    /// A dead-lettered message says where it was bound however long the names: a stream
    /// and a topic of up to 255 bytes each reach the server in headers of their own, and
    /// `stream/topic`, longer than a header value may be, is not sent at all (nothing is
    /// dropped and counted).
    #[test]
    fn a_dead_lettered_message_keeps_its_destination_whatever_the_length_of_its_names() {
        let payload = Bytes::from_static(b"{}");
        let header = |m: &IggyMessage, name: &str| {
            let map = m.user_headers_map().expect("parses").expect("has headers");
            map.get(&HeaderKey::try_from(name).expect("key")).map(|v| v.as_bytes().to_vec())
        };
        for (stream, topic) in [("s".to_string(), "c".to_string()), ("s".repeat(255), "t".repeat(255))] {
            let d = ingest::envelope::Destination {
                stream: stream.clone(),
                topic: topic.clone(),
                partitioning: Partitioning::Balanced,
            };
            let mut headers = Vec::new();
            crate::lane::rejected_headers(&mut headers, "cap", &d);
            let sent = to_iggy(&[OutMessage { id: 7, payload: &payload, headers: headers.clone() }]).expect("prepared");
            assert_eq!(header(&sent[0], "iggy-ingest-rejected-reason"), Some(b"cap".to_vec()));
            assert_eq!(header(&sent[0], "iggy-ingest-destination-stream"), Some(stream.clone().into_bytes()));
            assert_eq!(header(&sent[0], "iggy-ingest-destination-topic"), Some(topic.clone().into_bytes()));
            let combined =
                (stream.len() + 1 + topic.len() <= HEADER_FIELD_MAX_BYTES).then(|| format!("{stream}/{topic}"));
            assert_eq!(header(&sent[0], "iggy-ingest-destination"), combined.map(String::into_bytes));
            let sent_count = sent[0].user_headers_map().expect("parses").expect("has headers").len();
            assert_eq!(sent_count, headers.len(), "every header built was sent: none dropped");
        }
    }

    #[test]
    fn a_message_the_server_cannot_take_is_refused_by_id() {
        let empty = Bytes::new();
        let err = to_iggy(&[OutMessage { id: 42, payload: &empty, headers: vec![] }]).expect_err("refused");
        assert_eq!(err.kind, SendErrorKind::Destination);
        assert!(err.detail.contains("message 42"), "{err}");
    }
}
