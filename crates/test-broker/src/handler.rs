//! Answers one decoded request: authentication, then the command.
//!
//! Replies follow the server's conventions:
//! - reads (`Ping`, `GetClusterMetadata`, `GetStream`, `GetTopic`,
//!   `PollMessages`) carry their payload raw; a missing stream or topic on
//!   `GetStream`/`GetTopic` is an empty body (the client reads `None`);
//! - metadata writes (`CreateStream`, `CreateTopic`) and a successful login
//!   carry a result section: `[0u32]` then the payload on success,
//!   `[1u32][0u32][code]` for a committed rejection such as "already exists";
//! - a request refused before it takes effect (bad body, unknown command,
//!   rejected options, send to a missing or failing destination) gets an
//!   empty body and a nonzero status;
//! - a login with wrong credentials, or a replicated request without a
//!   session, gets an eviction frame.
//!
//! Invariant: nothing read from the network is unwrapped; every decode
//! failure becomes an error status.

use crate::faults::TopicFault;
use crate::server::Shared;
use crate::store::{NewMessage, StoredMessage, Topic};
use crate::wire::{Request, encode_eviction, encode_reply, result_framed_err, result_framed_ok};
use bytes::{BufMut, Bytes, BytesMut};
use iggy_binary_protocol::batch::{BATCH_HEADER_SIZE, BatchHeader, calculate_batch_checksum, decode_batch_slice};
use iggy_binary_protocol::codes::{
    CREATE_STREAM_CODE, CREATE_TOPIC_CODE, GET_CLUSTER_METADATA_CODE, GET_STREAM_CODE, GET_TOPIC_CODE, PING_CODE,
    POLL_MESSAGES_CODE, SEND_MESSAGES_CODE,
};
use iggy_binary_protocol::consensus::{EvictionReason, Operation, RequestHeader};
use iggy_binary_protocol::requests::messages::{PollMessagesRequest, SendMessagesHeader};
use iggy_binary_protocol::requests::streams::{CreateStreamRequest, GetStreamRequest};
use iggy_binary_protocol::requests::topics::{CreateTopicRequest, GetTopicRequest};
use iggy_binary_protocol::requests::users::LoginRegisterRequest;
use iggy_binary_protocol::responses::messages::{
    PollMessagesResponseHeader, SendMessagesConfirmationResponse, SendMessagesResponse,
};
use iggy_binary_protocol::responses::streams::{GetStreamResponse, StreamResponse, TopicHeader};
use iggy_binary_protocol::responses::system::{ClusterMetadataResponse, ClusterNodeResponse};
use iggy_binary_protocol::responses::topics::{GetTopicResponse, PartitionResponse};
use iggy_binary_protocol::responses::users::LoginRegisterResponse;
use iggy_binary_protocol::{
    IGGY_PROTOCOL_VERSION, MAX_PARTITIONS_PER_REQUEST, WireDecode, WireEncode, WireName, WireOptions, WireUserHeaders,
};
use iggy_common::{ClusterNodeRole, ClusterNodeStatus, IggyError, MaxTopicSize, TopicCreateOptions};
use secrecy::ExposeSecret;

/// The name the broker reports for itself.
pub const BROKER_NAME: &str = "test-broker";

/// What the connection does after a request was handled.
pub(crate) enum Action {
    /// Write this frame.
    Reply(Bytes),
    /// Write nothing (a black-holed destination).
    Silence,
}

/// Per-connection state.
#[derive(Debug, Default)]
pub(crate) struct Connection {
    /// The session bound by a successful login.
    session: Option<u64>,
}

fn ok(header: &RequestHeader, body: &[u8]) -> Action {
    Action::Reply(encode_reply(header, 0, body))
}

fn deny(header: &RequestHeader, error: &IggyError) -> Action {
    Action::Reply(encode_reply(header, error.as_code(), &[]))
}

fn decode<T: WireDecode>(body: &[u8]) -> Result<T, IggyError> {
    T::decode_from(body).map_err(|_| IggyError::InvalidCommand)
}

pub(crate) fn handle(shared: &Shared, connection: &mut Connection, request: &Request) -> Action {
    let header = &request.header;
    match header.operation {
        Operation::Register => return login(shared, connection, request),
        Operation::Logout => {
            connection.session = None;
            return ok(header, &[]);
        }
        _ => {}
    }
    let code = request.code();
    if connection.session.is_none() && code != PING_CODE {
        if header.operation == Operation::NonReplicated {
            return deny(header, &IggyError::Unauthenticated);
        }
        return Action::Reply(encode_eviction(header.client, EvictionReason::NoSession));
    }
    let body = &request.body;
    let outcome = match code {
        PING_CODE => Ok(ok(header, &[])),
        GET_CLUSTER_METADATA_CODE => Ok(cluster_metadata(shared, header)),
        GET_STREAM_CODE => get_stream(shared, header, body),
        CREATE_STREAM_CODE => create_stream(shared, header, body),
        GET_TOPIC_CODE => get_topic(shared, header, body),
        CREATE_TOPIC_CODE => create_topic(shared, header, body),
        SEND_MESSAGES_CODE => send_messages(shared, header, body),
        POLL_MESSAGES_CODE => poll_messages(shared, header, body),
        _ => Err(IggyError::FeatureUnavailable),
    };
    outcome.unwrap_or_else(|error| deny(header, &error))
}

fn login(shared: &Shared, connection: &mut Connection, request: &Request) -> Action {
    let header = &request.header;
    let Ok(login) = LoginRegisterRequest::decode_from(&request.body) else {
        return Action::Reply(encode_eviction(header.client, EvictionReason::MalformedLogin));
    };
    if login.username.as_str() != shared.config.username || login.password.expose_secret() != shared.config.password {
        return Action::Reply(encode_eviction(header.client, EvictionReason::InvalidCredentials));
    }
    let session = shared.new_session();
    connection.session = Some(session);
    let Ok(server_version) = WireName::new(BROKER_NAME) else {
        return deny(header, &IggyError::InvalidFormat);
    };
    let response =
        LoginRegisterResponse { user_id: 0, session, server_protocol_version: IGGY_PROTOCOL_VERSION, server_version };
    ok(header, &result_framed_ok(&response.to_bytes()))
}

fn cluster_metadata(shared: &Shared, header: &RequestHeader) -> Action {
    let node = ClusterNodeResponse {
        name: BROKER_NAME.to_owned(),
        ip: shared.addr.ip().to_string(),
        tcp_port: shared.addr.port(),
        quic_port: 0,
        http_port: 0,
        websocket_port: 0,
        role: ClusterNodeRole::Leader as u8,
        status: ClusterNodeStatus::Healthy as u8,
    };
    let response = ClusterMetadataResponse { name: BROKER_NAME.to_owned(), nodes: vec![node] };
    ok(header, &response.to_bytes())
}

fn name(value: &str) -> Result<WireName, IggyError> {
    WireName::new(value).map_err(|_| IggyError::InvalidFormat)
}

fn topic_header(topic: &Topic) -> Result<TopicHeader, IggyError> {
    Ok(TopicHeader {
        id: topic.id,
        created_at: topic.created_at,
        partitions_count: topic.partitions_count,
        message_expiry: topic.options.message_expiry.map_or(0, u64::from),
        compression_algorithm: topic.options.compression_algorithm.unwrap_or_default().as_code(),
        max_topic_size: topic.options.max_topic_size.unwrap_or(MaxTopicSize::ServerDefault).as_bytes_u64(),
        size_bytes: topic.size_bytes(),
        messages_count: topic.messages.len() as u64,
        name: name(&topic.name)?,
        options: topic.wire_options.clone(),
        derived_options: WireOptions::empty(),
    })
}

fn stream_response(stream: &crate::store::Stream) -> Result<GetStreamResponse, IggyError> {
    let topics = stream.topics.iter().map(topic_header).collect::<Result<Vec<_>, _>>()?;
    Ok(GetStreamResponse {
        stream: StreamResponse {
            id: stream.id,
            created_at: stream.created_at,
            topics_count: u32::try_from(topics.len()).unwrap_or(u32::MAX),
            size_bytes: stream.topics.iter().map(Topic::size_bytes).sum(),
            messages_count: stream.topics.iter().map(|topic| topic.messages.len() as u64).sum(),
            name: name(&stream.name)?,
            options: WireOptions::empty(),
        },
        topics,
    })
}

fn topic_response(topic: &Topic) -> Result<GetTopicResponse, IggyError> {
    let partitions = (0..topic.partitions_count)
        .map(|id| {
            let messages = topic.partition_messages(id);
            let (count, size) =
                messages.fold((0u64, 0u64), |(count, size), message| (count + 1, size + message.payload.len() as u64));
            PartitionResponse {
                id,
                created_at: topic.created_at,
                segments_count: 1,
                current_offset: topic.next_offset(id).saturating_sub(1),
                size_bytes: size,
                messages_count: count,
            }
        })
        .collect();
    Ok(GetTopicResponse { topic: topic_header(topic)?, partitions })
}

fn get_stream(shared: &Shared, header: &RequestHeader, body: &[u8]) -> Result<Action, IggyError> {
    let request: GetStreamRequest = decode(body)?;
    let store = shared.store();
    match store.stream(&request.stream_id) {
        Some(stream) => Ok(ok(header, &stream_response(stream)?.to_bytes())),
        None => Ok(ok(header, &[])),
    }
}

fn create_stream(shared: &Shared, header: &RequestHeader, body: &[u8]) -> Result<Action, IggyError> {
    let request: CreateStreamRequest = decode(body)?;
    if let Some(code) = shared.faults().stream_create_refused.get(request.name.as_str()) {
        return Ok(ok(header, &result_framed_err(*code)));
    }
    let mut store = shared.store();
    let reply = match store.create_stream(request.name.as_str()) {
        Ok(stream) => result_framed_ok(&stream_response(stream)?.to_bytes()),
        Err(error) => result_framed_err(error.as_code()),
    };
    Ok(ok(header, &reply))
}

fn get_topic(shared: &Shared, header: &RequestHeader, body: &[u8]) -> Result<Action, IggyError> {
    let request: GetTopicRequest = decode(body)?;
    let store = shared.store();
    match store.topic(&request.stream_id, &request.topic_id) {
        Ok((_, topic)) => Ok(ok(header, &topic_response(topic)?.to_bytes())),
        Err(_) => Ok(ok(header, &[])),
    }
}

fn create_topic(shared: &Shared, header: &RequestHeader, body: &[u8]) -> Result<Action, IggyError> {
    let request: CreateTopicRequest = decode(body)?;
    if request.partitions_count > MAX_PARTITIONS_PER_REQUEST {
        return Err(IggyError::TooManyPartitions);
    }
    // Admission: unknown keys and bad values are refused before anything is
    // created, as the server does.
    let options = TopicCreateOptions::parse(&request.options)?;
    // A segment size out of the server's bounds (1 MiB to 1 GiB, a multiple of 512) is
    // refused before the commit, as the server refuses it; so is a preallocation past
    // its reservation cap.
    if let Some(size) = options.segment_size {
        iggy_common::validate_topic_segment_size(size.as_bytes_u64(), iggy_common::MAX_TOPIC_SEGMENT_SIZE)?;
    }
    // A size limit below one segment could never be kept: the server refuses it
    // (`validate_topic_size_floor`), against the topic's segment size or, without one,
    // its fixed default (1 GiB, whatever the server's own configuration says).
    let segment_bytes = options.segment_size.map_or(iggy_common::DEFAULT_SEGMENT_SIZE, |s| s.as_bytes_u64());
    if let Some(max) = options.max_topic_size
        && !matches!(max, MaxTopicSize::ServerDefault)
        && max.as_bytes_u64() < segment_bytes
    {
        return Err(IggyError::InvalidTopicSize(max, iggy_common::IggyByteSize::from(segment_bytes)));
    }
    let mut store = shared.store();
    // A black-holed destination's creation is a write like its sends: never answered.
    if let Some(stream) = store.stream(&request.stream_id) {
        let faults = shared.faults();
        if faults.topic_fault(&stream.name, request.name.as_str()) == Some(TopicFault::BlackHole) {
            return Ok(Action::Silence);
        }
        if let Some(code) = faults.create_refused.get(&(stream.name.clone(), request.name.to_string())) {
            return Ok(ok(header, &result_framed_err(*code)));
        }
    }
    let reply = match store.create_topic(
        &request.stream_id,
        request.name.as_str(),
        request.partitions_count,
        request.options.clone(),
        options,
    ) {
        Ok(topic) => result_framed_ok(&topic_response(topic)?.to_bytes()),
        Err(error) => result_framed_err(error.as_code()),
    };
    Ok(ok(header, &reply))
}

fn decode_messages(batch_bytes: &[u8], expected: u32) -> Result<Vec<NewMessage>, IggyError> {
    let batch = decode_batch_slice(batch_bytes).map_err(|_| IggyError::InvalidCommand)?;
    if batch.message_count() != expected {
        return Err(IggyError::InvalidCommand);
    }
    let mut messages = Vec::with_capacity(expected as usize);
    for view in batch.iter() {
        let (headers, raw_headers) = if view.user_headers.is_empty() {
            (Default::default(), None)
        } else {
            let raw = Bytes::copy_from_slice(view.user_headers);
            let wire = WireUserHeaders::from_bytes(raw.clone()).map_err(|_| IggyError::InvalidCommand)?;
            let map = iggy_common::wire_conversions::user_headers_from_wire(&wire)?;
            (map, Some(raw))
        };
        messages.push(NewMessage {
            id: view.header.id,
            origin_timestamp: batch.header.origin_timestamp + u64::from(view.header.timestamp_delta),
            checksum: view.header.checksum,
            payload: Bytes::copy_from_slice(view.payload),
            headers,
            raw_headers,
        });
    }
    if messages.len() != expected as usize {
        return Err(IggyError::InvalidCommand);
    }
    Ok(messages)
}

fn send_messages(shared: &Shared, header: &RequestHeader, body: &[u8]) -> Result<Action, IggyError> {
    let metadata_length = body
        .get(..4)
        .and_then(|bytes| bytes.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or(IggyError::InvalidCommand)? as usize;
    let metadata = body.get(4..4 + metadata_length).ok_or(IggyError::InvalidCommand)?;
    let (send, consumed) = SendMessagesHeader::decode(metadata).map_err(|_| IggyError::InvalidCommand)?;
    if consumed != metadata_length {
        return Err(IggyError::InvalidCommand);
    }
    let batch_bytes = body.get(4 + metadata_length..).ok_or(IggyError::InvalidCommand)?;
    let messages = decode_messages(batch_bytes, send.messages_count)?;

    let mut store = shared.store();
    if let Some((stream, topic)) = store.names_of(&send.stream_id, &send.topic_id) {
        match shared.faults().topic_fault(&stream, &topic) {
            Some(TopicFault::BlackHole) => return Ok(Action::Silence),
            Some(TopicFault::Fail(code)) => {
                return Ok(Action::Reply(encode_reply(header, code, &[])));
            }
            None => {}
        }
    }
    // The server answers a send it cannot route with `ResourceNotFound`.
    let appended = store
        .append(&send.stream_id, &send.topic_id, &send.partitioning, messages)
        .map_err(|_| IggyError::ResourceNotFound(String::new()))?;
    let response = SendMessagesResponse {
        confirmations: vec![SendMessagesConfirmationResponse {
            stream_id: appended.stream_id,
            topic_id: appended.topic_id,
            partition_id: appended.partition_id,
            base_offset: appended.base_offset,
        }],
    };
    Ok(ok(header, &response.to_bytes()))
}

/// One batch per message, so every message keeps its own arrival time.
fn encode_polled(partition_id: u32, current_offset: u64, messages: &[StoredMessage]) -> Bytes {
    let mut out = BytesMut::new();
    PollMessagesResponseHeader {
        partition_id,
        current_offset,
        messages_count: u32::try_from(messages.len()).unwrap_or(u32::MAX),
    }
    .encode(&mut out);
    for message in messages {
        let headers = message.raw_headers.as_deref().unwrap_or_default();
        let mut blob = BytesMut::new();
        blob.put_u64_le(message.checksum);
        blob.put_u128_le(message.id);
        blob.put_u32_le(0); // offset delta
        blob.put_u32_le(0); // timestamp delta
        blob.put_u32_le(u32::try_from(headers.len()).unwrap_or(u32::MAX));
        blob.put_u32_le(u32::try_from(message.payload.len()).unwrap_or(u32::MAX));
        blob.put_u64_le(0); // reserved
        blob.put_slice(&message.payload);
        blob.put_slice(headers);
        let mut batch = BatchHeader::new(
            u64::from(partition_id),
            message.origin_timestamp,
            (BATCH_HEADER_SIZE + blob.len()) as u64,
            1,
        );
        batch.base_offset = message.offset;
        batch.base_timestamp = message.timestamp;
        batch.batch_checksum = calculate_batch_checksum(&batch, &blob);
        let mut batch_header = [0u8; BATCH_HEADER_SIZE];
        batch.encode_into(&mut batch_header);
        out.put_slice(&batch_header);
        out.put_slice(&blob);
    }
    out.freeze()
}

fn poll_messages(shared: &Shared, header: &RequestHeader, body: &[u8]) -> Result<Action, IggyError> {
    let request: PollMessagesRequest = decode(body)?;
    let consumer = format!("{}:{:?}", request.consumer.kind, request.consumer.id);
    let polled = shared.store().poll(
        consumer,
        &request.stream_id,
        &request.topic_id,
        request.partition_id.unwrap_or(0),
        request.strategy,
        request.count,
        request.auto_commit,
    )?;
    let body = encode_polled(polled.partition_id, polled.current_offset, &polled.messages);
    Ok(ok(header, &body))
}
