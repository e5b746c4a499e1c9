//! The destination the daemon really delivers to: an Iggy server, through the `iggy`
//! crate over TCP. Every use of that crate is in this module, so moving to a newer
//! server is one change.
//!
//! Invariants:
//! - One client per daemon. The daemon starts and holds while the server is
//!   unreachable: connecting is retried before each attempt, never required at start.
//! - After a failed connection or a dropped one, the next attempt reconnects explicitly
//!   first (the client otherwise stays disconnected and fails at once).
//! - Every (re)connect builds a new client and connects it in a task of its own; the old
//!   client is dropped once no operation uses it. A client is never reconnected in place:
//!   the `iggy` client interrupted in the middle of connecting believes it is still
//!   connecting and never connects again, and after a long outage its own reconnects
//!   (from a failed send, from its heartbeat) were seen to hang it for good. A lane's
//!   result timeout may stop waiting for a connect, never stop it half-way: connects cut
//!   short one after another by the lanes' timeouts never finish.
//! - A failure reported by an operation on an older connection than the current one
//!   does not ask for a reconnect (it would tear down a connection that works).
//! - Destinations are created on first use with the topic defaults; "already exists" is
//!   success. Topics the daemon creates are durable by default (`enforce_fsync`, one
//!   message per save), because an ack from a topic without fsync does not survive a
//!   crash of the server; an existing topic that is not durable is reported, not changed.
//! - Messages carry the stable id from the log; a resend after an unknown outcome sends
//!   the same id.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::BytesMut;
use iggy::prelude::{
    AutoLogin, Client, ClientWrapper, Credentials, HeaderKind, Identifier, IggyByteSize, IggyClient, IggyDuration,
    IggyError, IggyExpiry, IggyMessage, IggyMessageHeader, IggyTimestamp, MAX_PAYLOAD_SIZE, MAX_USER_HEADERS_SIZE,
    MaxTopicSize, MessageClient, Partitioning as IggyPartitioning, StreamClient, TcpClient, TcpClientConfig,
    TcpClientReconnectionConfig, TopicClient, TopicCreateOptions,
};
use iggy_binary_protocol::encode_user_headers;
use ingest::envelope::Partitioning;
use tokio::task::JoinHandle;

use crate::sink::{DestinationKey, OutMessage, SendError, SendErrorKind, Sink, TopicInfo};

/// Settings of topics the daemon creates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopicDefaults {
    pub partitions_count: u32,
    /// Message expiry; `None` keeps messages until the topic's size limit.
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
    pub password: String,
    pub tls: bool,
    pub tls_domain: Option<String>,
    pub tls_ca_file: Option<String>,
    /// Kept in the client's configuration, but the client's own reconnection is off:
    /// the sink reconnects, one attempt per retry of the router, which retries forever.
    pub reconnection_max_retries: u32,
    pub reconnection_interval: Duration,
    pub topic_defaults: TopicDefaults,
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
            topic_defaults: TopicDefaults::default(),
        }
    }
}

/// Delivers to an Iggy server.
pub struct IggySink {
    config: IggySinkConfig,
    /// The current client; replaced (never reconnected in place) by each connect.
    client: std::sync::RwLock<Arc<IggyClient>>,
    defaults: TopicDefaults,
    /// Set after a failure that leaves the client disconnected.
    needs_connect: AtomicBool,
    /// Counts explicit connects: which connection an operation ran on.
    generation: AtomicU64,
    /// The connect in progress, if any; its task finishes even when nobody waits for it.
    connecting: tokio::sync::Mutex<Option<JoinHandle<Result<IggyClient, IggyError>>>>,
}

impl std::fmt::Debug for IggySink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IggySink").finish_non_exhaustive()
    }
}

impl IggySink {
    /// Builds the client. Does not connect: the first attempt does, and a server that
    /// is down only delays delivery.
    pub fn new(config: &IggySinkConfig) -> Result<IggySink, String> {
        let client = build_client(config).map_err(|e| format!("iggy client: {e}"))?;
        Ok(IggySink {
            config: config.clone(),
            client: std::sync::RwLock::new(Arc::new(client)),
            defaults: config.topic_defaults.clone(),
            needs_connect: AtomicBool::new(true),
            generation: AtomicU64::new(0),
            connecting: tokio::sync::Mutex::new(None),
        })
    }

    fn client(&self) -> Arc<IggyClient> {
        self.client.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Connects if needed; returns the generation of the connection to use.
    async fn connected(&self) -> Result<u64, SendError> {
        if !self.needs_connect.load(Ordering::Acquire) {
            return Ok(self.generation.load(Ordering::Acquire));
        }
        let mut connecting = self.connecting.lock().await;
        if !self.needs_connect.load(Ordering::Acquire) {
            return Ok(self.generation.load(Ordering::Acquire));
        }
        let task = connecting.get_or_insert_with(|| {
            let config = self.config.clone();
            tokio::spawn(async move {
                let client = build_client(&config)?;
                client.connect().await?;
                Ok(client)
            })
        });
        // Cancel-safe: dropped here, the task runs on and its handle stays for the next
        // caller.
        let joined = task.await;
        *connecting = None;
        match joined {
            Err(e) => Err(SendError::new(SendErrorKind::Unavailable, format!("the connect task failed: {e}"))),
            // A failed connect is the client's, whatever the error: no destination's.
            Ok(Err(e)) => {
                let mut failure = self.classify(e, None);
                if failure.kind == SendErrorKind::Destination {
                    failure.kind = SendErrorKind::Unavailable;
                }
                Err(failure)
            }
            Ok(Ok(client)) => {
                *self.client.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(client);
                let generation = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
                self.needs_connect.store(false, Ordering::Release);
                tracing::info!("connected to iggy");
                Ok(generation)
            }
        }
    }

    /// The connection of `generation` is not to be trusted any more.
    fn lost(&self, generation: u64) {
        if generation == self.generation.load(Ordering::Acquire) {
            self.needs_connect.store(true, Ordering::Release);
        }
    }

    /// Classifies `e`; a client-wide failure on the current connection (or while
    /// connecting, `generation` None) asks for a reconnect.
    fn classify(&self, e: IggyError, generation: Option<u64>) -> SendError {
        let kind = classify(&e);
        if matches!(kind, SendErrorKind::Disconnected | SendErrorKind::Unavailable | SendErrorKind::Unauthorized) {
            match generation {
                Some(g) => self.lost(g),
                None => self.needs_connect.store(true, Ordering::Release),
            }
        }
        SendError::new(kind, e.to_string())
    }

    fn create_options(&self) -> TopicCreateOptions {
        let d = &self.defaults;
        TopicCreateOptions {
            partitions_count: Some(d.partitions_count),
            message_expiry: d.message_expiry.map(|e| IggyExpiry::ExpireDuration(IggyDuration::from(e))),
            max_topic_size: d.max_topic_size_bytes.map(|b| MaxTopicSize::Custom(IggyByteSize::from(b))),
            segment_size: d.segment_size_bytes.map(IggyByteSize::from),
            enforce_fsync: Some(d.enforce_fsync),
            messages_required_to_save: Some(d.messages_required_to_save),
            ..TopicCreateOptions::default()
        }
    }
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
            config.password.clone().into(),
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
        | IggyError::IoError(_) => SendErrorKind::Unavailable,
        IggyError::InvalidCredentials | IggyError::Unauthenticated => SendErrorKind::Unauthorized,
        _ => SendErrorKind::Destination,
    }
}

fn topic_info(details_partitions: u32, options: &iggy::prelude::ResourceOptions) -> TopicInfo {
    let parsed = TopicCreateOptions::from_resource_options(options);
    let durable = parsed.enforce_fsync == Some(true) && parsed.messages_required_to_save == Some(1);
    TopicInfo { partitions_count: details_partitions, durable }
}

/// The largest header name or value the server takes.
const HEADER_FIELD_MAX_BYTES: usize = 255;

/// Builds the wire messages of a batch: the same messages `IggyMessage::builder()` builds
/// (a test compares them byte for byte), without its per-message map and per-header
/// buffers. The header blocks of the whole batch are encoded, with the protocol crate's
/// encoder, into one buffer that each message then shares a slice of; headers are sorted
/// by name, and a repeated name keeps its last value, as the builder's map does.
/// Headers the server could not take (empty, longer than 255 bytes) are left out and
/// counted; the door clamps what it forwards, so this is a last guard, not the rule.
fn to_iggy(messages: &[OutMessage<'_>]) -> Result<Vec<IggyMessage>, SendError> {
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

fn partitioning(p: &Partitioning) -> IggyPartitioning {
    match p {
        Partitioning::Balanced => IggyPartitioning::balanced(),
        Partitioning::PartitionId(id) => IggyPartitioning::partition_id(*id),
        Partitioning::Key(k) => IggyPartitioning::messages_key(k).unwrap_or_else(|_| {
            metrics::counter!("iggy_connector_partition_key_invalid_total").increment(1);
            IggyPartitioning::balanced()
        }),
    }
}

impl Sink for IggySink {
    type Message = IggyMessage;

    fn prepare(&self, messages: &[OutMessage<'_>]) -> Result<Vec<IggyMessage>, SendError> {
        to_iggy(messages)
    }

    async fn ensure(&self, dest: &DestinationKey) -> Result<TopicInfo, SendError> {
        let generation = self.connected().await?;
        self.ensure_on(dest, generation).await
    }

    fn connecting(&self) -> bool {
        self.needs_connect.load(Ordering::Acquire)
    }

    async fn send(
        &self,
        dest: &DestinationKey,
        p: &Partitioning,
        messages: &mut [IggyMessage],
    ) -> Result<(), SendError> {
        let generation = self.connected().await?;
        self.send_on(dest, p, messages, generation).await
    }
}

impl IggySink {
    async fn ensure_on(&self, dest: &DestinationKey, generation: u64) -> Result<TopicInfo, SendError> {
        let g = Some(generation);
        let client = self.client();
        let stream =
            Identifier::named(&dest.stream).map_err(|e| SendError::new(SendErrorKind::Destination, e.to_string()))?;
        let topic =
            Identifier::named(&dest.topic).map_err(|e| SendError::new(SendErrorKind::Destination, e.to_string()))?;
        let existing = client.get_stream(&stream).await.map_err(|e| self.classify(e, g))?;
        if existing.is_none() {
            match client.create_stream(&dest.stream).await {
                Ok(_) | Err(IggyError::StreamNameAlreadyExists(_)) => {}
                Err(e) => return Err(self.classify(e, g)),
            }
        }
        let details = match client.get_topic(&stream, &topic).await.map_err(|e| self.classify(e, g))? {
            Some(d) => d,
            None => match client.create_topic(&stream, &dest.topic, &self.create_options()).await {
                Ok(d) => d,
                Err(IggyError::TopicNameAlreadyExists(..)) => client
                    .get_topic(&stream, &topic)
                    .await
                    .map_err(|e| self.classify(e, g))?
                    .ok_or_else(|| SendError::new(SendErrorKind::Destination, "topic vanished after creation"))?,
                Err(e) => return Err(self.classify(e, g)),
            },
        };
        let info = topic_info(details.partitions_count, &details.options);
        if !info.durable {
            tracing::warn!(destination = %dest, "topic does not sync every message: its acks may not survive a crash of the server");
        }
        Ok(info)
    }

    async fn send_on(
        &self,
        dest: &DestinationKey,
        p: &Partitioning,
        messages: &mut [IggyMessage],
        generation: u64,
    ) -> Result<(), SendError> {
        let stream =
            Identifier::named(&dest.stream).map_err(|e| SendError::new(SendErrorKind::Destination, e.to_string()))?;
        let topic =
            Identifier::named(&dest.topic).map_err(|e| SendError::new(SendErrorKind::Destination, e.to_string()))?;
        let client = self.client();
        match client.send_messages(&stream, &topic, &partitioning(p), messages).await {
            Ok(_) => Ok(()),
            Err(e) => Err(self.classify(e, Some(generation))),
        }
    }
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

    #[test]
    fn a_message_the_server_cannot_take_is_refused_by_id() {
        let empty = Bytes::new();
        let err = to_iggy(&[OutMessage { id: 42, payload: &empty, headers: vec![] }]).expect_err("refused");
        assert_eq!(err.kind, SendErrorKind::Destination);
        assert!(err.detail.contains("message 42"), "{err}");
    }
}
