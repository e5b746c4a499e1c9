//! The real `iggy` client against the test broker: the happy path, and the
//! client error each fault produces (the table in the crate's README.md).

use bytes::Bytes;
use iggy::prelude::*;
use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use test_broker::{DropPoint, RequestKind, TestBroker, TestBrokerConfig};

const STREAM: &str = "events";
const TOPIC: &str = "orders";

fn credentials() -> AutoLogin {
    AutoLogin::Enabled(Credentials::UsernamePassword("iggy".to_owned(), "iggy".to_owned().into()))
}

/// A client as the router builds one: TCP, auto sign-in, bounded reconnects.
fn client(broker: &TestBroker) -> IggyClient {
    IggyClient::builder()
        .with_tcp()
        .with_server_address(broker.addr().to_string())
        .with_auto_sign_in(credentials())
        .with_reconnection_max_retries(Some(2))
        .with_reconnection_interval(IggyDuration::from(Duration::from_millis(50)))
        .with_reestablish_after(IggyDuration::from(Duration::ZERO))
        .build()
        .expect("client builds")
}

/// A client whose transport never reconnects on its own.
fn client_without_reconnection(broker: &TestBroker) -> IggyClient {
    let config = TcpClientConfig {
        server_address: broker.addr().to_string(),
        auto_login: credentials(),
        reconnection: TcpClientReconnectionConfig {
            enabled: false,
            reestablish_after: IggyDuration::from(Duration::ZERO),
            ..TcpClientReconnectionConfig::default()
        },
        ..TcpClientConfig::default()
    };
    let tcp = TcpClient::create(Arc::new(config)).expect("tcp client");
    IggyClient::builder().with_client(ClientWrapper::Tcp(tcp)).build().expect("client builds")
}

async fn start() -> TestBroker {
    TestBroker::start(TestBrokerConfig::default()).await.expect("broker starts")
}

fn id(name: &str) -> Identifier {
    Identifier::named(name).expect("identifier")
}

async fn ensure_destination(client: &IggyClient, partitions: u32) {
    client.create_stream(STREAM).await.expect("create stream");
    let options = TopicCreateOptions {
        partitions_count: Some(partitions),
        enforce_fsync: Some(true),
        messages_required_to_save: Some(1),
        ..TopicCreateOptions::default()
    };
    client.create_topic(&id(STREAM), TOPIC, &options).await.expect("create topic");
}

fn headers(n: u32) -> BTreeMap<HeaderKey, HeaderValue> {
    BTreeMap::from([
        (HeaderKey::from_str("source").expect("key"), HeaderValue::from_str("webhook").expect("value")),
        (HeaderKey::from_str("seq").expect("key"), HeaderValue::from(n)),
    ])
}

fn message(message_id: u128, with_headers: bool) -> IggyMessage {
    let payload = Bytes::from(format!("payload-{message_id}"));
    let builder = IggyMessage::builder().id(message_id).payload(payload);
    if with_headers {
        let seq = u32::try_from(message_id).expect("small id");
        builder.user_headers(headers(seq)).build().expect("message")
    } else {
        builder.build().expect("message")
    }
}

async fn send(client: &IggyClient, partitioning: &Partitioning, ids: &[u128]) -> Result<(), IggyError> {
    let mut messages: Vec<IggyMessage> = ids.iter().map(|id| message(*id, true)).collect();
    client.send_messages(&id(STREAM), &id(TOPIC), partitioning, &mut messages).await.map(|_| ())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_signs_in_and_fetches_cluster_metadata() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    assert_eq!(broker.request_count(RequestKind::Login), 1);
    assert_eq!(broker.request_count(RequestKind::ClusterMetadata), 1);
    client.ping().await.expect("ping");
    assert!(broker.request_count(RequestKind::Ping) >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_invalid_credentials() {
    let broker = TestBroker::start(TestBrokerConfig { username: "admin".to_owned(), password: "secret".to_owned() })
        .await
        .expect("broker starts");
    let client = client(&broker);
    let error = client.connect().await.expect_err("login must fail");
    assert_eq!(error, IggyError::InvalidCredentials);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_and_topics_are_created_once_with_their_options() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");

    assert!(client.get_stream(&id(STREAM)).await.expect("get").is_none());
    ensure_destination(&client, 3).await;

    let again = client.create_stream(STREAM).await.expect_err("exists");
    assert!(matches!(again, IggyError::StreamNameAlreadyExists(_)), "{again:?}");
    let options = TopicCreateOptions { partitions_count: Some(3), ..TopicCreateOptions::default() };
    let again = client.create_topic(&id(STREAM), TOPIC, &options).await.expect_err("exists");
    assert!(matches!(again, IggyError::TopicNameAlreadyExists(..)), "{again:?}");
    let missing = client.create_topic(&id("nowhere"), TOPIC, &options).await.expect_err("no stream");
    assert!(matches!(missing, IggyError::StreamIdNotFound(_)), "{missing:?}");
    // A size limit below one segment (given, or the default 1 GiB) is refused, as the
    // server does; one of a segment or more is taken.
    for (max_bytes, segment_bytes, taken) in [
        (500_000_000u64, None, false),
        ((4 << 20) - 1, Some(4u64 << 20), false),
        (4 << 20, Some(4 << 20), true),
        (1 << 30, None, true),
    ] {
        let name = format!("sized-{max_bytes}");
        let options = TopicCreateOptions {
            max_topic_size: Some(MaxTopicSize::Custom(IggyByteSize::from(max_bytes))),
            segment_size: segment_bytes.map(IggyByteSize::from),
            ..TopicCreateOptions::default()
        };
        let created = client.create_topic(&id(STREAM), &name, &options).await;
        match created {
            Ok(_) => assert!(taken, "{max_bytes} of {segment_bytes:?} taken"),
            Err(e) => {
                assert!(!taken, "{max_bytes} of {segment_bytes:?}: {e:?}");
                assert!(matches!(e, IggyError::InvalidTopicSize(..)), "{e:?}");
            }
        }
    }

    // A segment size out of the server's bounds is refused before anything is created.
    for bad in [1024 * 1024 - 512, (1 << 30) + 512, (4 << 20) + 1] {
        let options =
            TopicCreateOptions { segment_size: Some(IggyByteSize::from(bad)), ..TopicCreateOptions::default() };
        let e = client.create_topic(&id(STREAM), &format!("segment-{bad}"), &options).await.expect_err("refused");
        assert!(matches!(e, IggyError::InvalidOptionValue(_)), "{bad}: {e:?}");
    }

    let stream = client.get_stream(&id(STREAM)).await.expect("get").expect("stream");
    assert_eq!(stream.name, STREAM);
    assert_eq!(stream.topics_count, 3);
    let topic = client.get_topic(&id(STREAM), &id(TOPIC)).await.expect("get").expect("topic");
    assert_eq!(topic.partitions_count, 3);
    assert_eq!(topic.partitions.iter().map(|p| p.id).collect::<Vec<_>>(), vec![0, 1, 2]);
    let parsed = TopicCreateOptions::from_resource_options(&topic.options);
    assert_eq!(parsed.enforce_fsync, Some(true));
    assert_eq!(parsed.messages_required_to_save, Some(1));
    assert!(client.get_topic(&id(STREAM), &id("other")).await.expect("get").is_none());

    let kept = broker.topic_options(STREAM, TOPIC).expect("kept");
    assert_eq!(kept.partitions_count, Some(3));
    assert_eq!(kept.enforce_fsync, Some(true));
    assert_eq!(kept.messages_required_to_save, Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sent_messages_are_stored_and_polled_back_with_ids_and_headers() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    ensure_destination(&client, 2).await;

    send(&client, &Partitioning::balanced(), &[11, 12, 13]).await.expect("balanced");
    send(&client, &Partitioning::partition_id(1), &[21, 22]).await.expect("partition 1");
    let mut plain = vec![message(31, false)];
    client
        .send_messages(&id(STREAM), &id(TOPIC), &Partitioning::partition_id(0), &mut plain)
        .await
        .expect("no headers");

    let stored = broker.messages(STREAM, TOPIC);
    assert_eq!(stored.iter().map(|m| m.id).collect::<Vec<_>>(), vec![11, 12, 13, 21, 22, 31]);
    // One balanced batch lands whole in one partition.
    assert!(stored[..3].iter().all(|m| m.partition_id == stored[0].partition_id));
    assert!(stored[3..5].iter().all(|m| m.partition_id == 1));
    for message in &stored[..5] {
        assert_eq!(message.payload, Bytes::from(format!("payload-{}", message.id)));
        let seq = u32::try_from(message.id).expect("small");
        assert_eq!(message.headers, headers(seq));
    }
    assert!(stored[5].headers.is_empty());

    let consumer = Consumer::new(Identifier::numeric(1).expect("id"));
    for partition in 0..2u32 {
        let polled = client
            .poll_messages(&id(STREAM), &id(TOPIC), Some(partition), &consumer, &PollingStrategy::offset(0), 100, false)
            .await
            .expect("poll");
        let expected: Vec<_> = stored.iter().filter(|m| m.partition_id == partition).collect();
        assert_eq!(polled.messages.len(), expected.len());
        for (got, want) in polled.messages.iter().zip(expected) {
            assert_eq!(got.header.id, want.id);
            assert_eq!(got.header.offset, want.offset);
            assert_eq!(got.payload, want.payload);
            let got_headers = got.user_headers_map().expect("headers").unwrap_or_default();
            assert_eq!(got_headers, want.headers);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connection_is_cannot_establish_connection() {
    let broker = start().await;
    broker.refuse_connections(true).await.expect("refuse");
    let client = client(&broker);
    let error = client.connect().await.expect_err("refused");
    assert_eq!(error, IggyError::CannotEstablishConnection);
    assert_eq!(broker.accepted_connections(), 0);

    broker.refuse_connections(false).await.expect("accept again");
    client.connect().await.expect("connect after refusal ends");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_dropped_after_a_send_is_disconnected_without_reconnection() {
    let broker = start().await;
    let client = client_without_reconnection(&broker);
    client.connect().await.expect("connect");
    ensure_destination(&client, 1).await;

    broker.drop_connection_after_next_request(RequestKind::SendMessages, DropPoint::AfterApplying);
    let error = send(&client, &Partitioning::partition_id(0), &[1]).await.expect_err("dropped");
    assert_eq!(error, IggyError::Disconnected);
    // The outcome was unknown to the client: the message is stored.
    assert_eq!(broker.messages(STREAM, TOPIC).len(), 1);

    // The client stays disconnected until it connects again.
    let error = send(&client, &Partitioning::partition_id(0), &[2]).await.expect_err("still down");
    assert_eq!(error, IggyError::Disconnected);
    client.connect().await.expect("reconnect");
    send(&client, &Partitioning::partition_id(0), &[2]).await.expect("after connect");
    assert_eq!(broker.messages(STREAM, TOPIC).iter().map(|m| m.id).collect::<Vec<_>>(), vec![1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_dropped_after_a_send_is_resent_once_by_a_reconnecting_client() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    ensure_destination(&client, 1).await;

    broker.drop_connection_after_next_request(RequestKind::SendMessages, DropPoint::AfterApplying);
    send(&client, &Partitioning::partition_id(0), &[7]).await.expect("resent after reconnect");
    // The client reconnected, signed in again and resent the same request:
    // the reply was lost, so the same id is stored twice.
    let ids: Vec<u128> = broker.messages(STREAM, TOPIC).iter().map(|m| m.id).collect();
    assert_eq!(ids, vec![7, 7]);
    assert_eq!(broker.request_count(RequestKind::Login), 2);

    broker.drop_connection_after_next_request(RequestKind::SendMessages, DropPoint::BeforeApplying);
    send(&client, &Partitioning::partition_id(0), &[8]).await.expect("resent after reconnect");
    let ids: Vec<u128> = broker.messages(STREAM, TOPIC).iter().map(|m| m.id).collect();
    assert_eq!(ids, vec![7, 7, 8]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_topic_returns_the_server_error_and_stores_nothing() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    ensure_destination(&client, 1).await;

    broker.fail_topic(STREAM, TOPIC, Some(IggyError::Error));
    let error = send(&client, &Partitioning::partition_id(0), &[1]).await.expect_err("fails");
    assert_eq!(error, IggyError::Error);

    broker.fail_topic(STREAM, TOPIC, Some(IggyError::TopicIdNotFound(id(TOPIC), id(STREAM))));
    let error = send(&client, &Partitioning::balanced(), &[2]).await.expect_err("fails");
    assert!(matches!(error, IggyError::TopicIdNotFound(..)), "{error:?}");
    assert!(broker.messages(STREAM, TOPIC).is_empty());
    // The failure was an answer: the connection is still usable.
    assert_eq!(broker.accepted_connections(), 1);

    broker.fail_topic(STREAM, TOPIC, None);
    send(&client, &Partitioning::partition_id(0), &[3]).await.expect("healed");
    assert_eq!(broker.messages(STREAM, TOPIC).len(), 1);
}

/// A reply header the client cannot parse fails the call with `InvalidCommand` and
/// leaves the rest of the reply in the connection, which the client keeps: its next
/// call reads that leftover as its own answer, so a send the server refused returns
/// `Ok`. Whoever gets `InvalidCommand` must not make another call on that connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_reply_header_is_invalid_command_and_leaves_the_connection_out_of_step() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    ensure_destination(&client, 1).await;

    broker.malformed_reply_to_next_request(RequestKind::SendMessages);
    let error = send(&client, &Partitioning::partition_id(0), &[1]).await.expect_err("fails");
    assert_eq!(error, IggyError::InvalidCommand);
    assert_eq!(broker.messages(STREAM, TOPIC).len(), 1, "the request was applied");

    broker.fail_topic(STREAM, TOPIC, Some(IggyError::Error));
    send(&client, &Partitioning::partition_id(0), &[2]).await.expect("the leftover reply, read as this one's");
    assert_eq!(broker.messages(STREAM, TOPIC).len(), 1, "the refused send was stored");
    assert_eq!(broker.accepted_connections(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_destination_errors_depend_on_partitioning() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    client.create_stream(STREAM).await.expect("stream");

    // Balanced (and key) partitioning asks for the topic first, client-side.
    let error = send(&client, &Partitioning::balanced(), &[1]).await.expect_err("no topic");
    assert!(matches!(error, IggyError::TopicIdNotFound(..)), "{error:?}");
    // An explicit partition goes straight to the server, which cannot route it.
    let error = send(&client, &Partitioning::partition_id(0), &[1]).await.expect_err("no topic");
    assert!(matches!(error, IggyError::ResourceNotFound(_)), "{error:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_then_restart_needs_an_explicit_connect() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    ensure_destination(&client, 1).await;
    send(&client, &Partitioning::partition_id(0), &[1]).await.expect("before outage");

    broker.stop().await;
    assert_eq!(broker.open_connections(), 0);
    let error = send(&client, &Partitioning::partition_id(0), &[2]).await.expect_err("down");
    assert_eq!(error, IggyError::CannotEstablishConnection);
    let error = send(&client, &Partitioning::partition_id(0), &[2]).await.expect_err("down");
    assert_eq!(error, IggyError::Disconnected);

    broker.restart().await.expect("restart");
    // Still disconnected: nothing reconnects the client but `connect()` (or
    // the heartbeat, every 5 s by default).
    let error = send(&client, &Partitioning::partition_id(0), &[2]).await.expect_err("stale");
    assert_eq!(error, IggyError::Disconnected);
    client.connect().await.expect("reconnect");
    send(&client, &Partitioning::partition_id(0), &[2]).await.expect("after restart");
    assert_eq!(broker.messages(STREAM, TOPIC).iter().map(|m| m.id).collect::<Vec<_>>(), vec![1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_replies_arrive_late_but_succeed() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    ensure_destination(&client, 1).await;

    broker.set_delay(Duration::from_millis(300));
    let started = Instant::now();
    send(&client, &Partitioning::partition_id(0), &[1]).await.expect("slow send");
    assert!(started.elapsed() >= Duration::from_millis(300));
    broker.set_delay(Duration::ZERO);
    assert_eq!(broker.messages(STREAM, TOPIC).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn black_holed_topic_never_answers() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    ensure_destination(&client, 1).await;

    broker.black_hole_topic(STREAM, TOPIC, true);
    let pending =
        tokio::time::timeout(Duration::from_secs(2), send(&client, &Partitioning::partition_id(0), &[1])).await;
    assert!(pending.is_err(), "a black-holed send must not be answered");
    assert!(broker.messages(STREAM, TOPIC).is_empty());
    assert_eq!(broker.request_count(RequestKind::SendMessages), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn black_holed_topic_is_never_created() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    client.create_stream(STREAM).await.expect("create stream");

    broker.black_hole_topic(STREAM, TOPIC, true);
    let options = TopicCreateOptions { partitions_count: Some(1), ..TopicCreateOptions::default() };
    let pending = tokio::time::timeout(Duration::from_secs(2), client.create_topic(&id(STREAM), TOPIC, &options)).await;
    assert!(pending.is_err(), "a black-holed topic's creation must not be answered");
    assert!(broker.topic_options(STREAM, TOPIC).is_none(), "a creation never answered made the topic");
    assert_eq!(broker.request_count(RequestKind::CreateTopic), 1);

    broker.black_hole_topic(STREAM, TOPIC, false);
    let client = self::client(&broker);
    client.connect().await.expect("connect");
    client.create_topic(&id(STREAM), TOPIC, &options).await.expect("created once answered again");
    assert!(broker.topic_options(STREAM, TOPIC).is_some());
}

/// Records what the client finally returns for a send that is never
/// answered: its own 30 s reply timeout, then one reconnect and resend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "takes about a minute: the client's fixed 30 s reply timeout, twice"]
async fn black_holed_topic_times_out_in_the_client() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    ensure_destination(&client, 1).await;

    broker.black_hole_topic(STREAM, TOPIC, true);
    let started = Instant::now();
    let error = send(&client, &Partitioning::partition_id(0), &[1]).await.expect_err("timeout");
    let elapsed = started.elapsed();
    eprintln!("black hole: {error:?} after {elapsed:?}");
    assert_eq!(error, IggyError::Disconnected);
    assert_eq!(broker.request_count(RequestKind::SendMessages), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_level_error_codes_make_the_client_reconnect_and_resend_once() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    ensure_destination(&client, 1).await;

    broker.fail_topic(STREAM, TOPIC, Some(IggyError::Unauthenticated));
    let error = send(&client, &Partitioning::partition_id(0), &[1]).await.expect_err("fails");
    assert_eq!(error, IggyError::Unauthenticated);
    assert_eq!(broker.request_count(RequestKind::SendMessages), 2);
    assert_eq!(broker.request_count(RequestKind::Login), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_reconnects_after_an_outage() {
    let broker = start().await;
    let config = TcpClientConfig {
        server_address: broker.addr().to_string(),
        auto_login: credentials(),
        heartbeat_interval: IggyDuration::from(Duration::from_millis(200)),
        reconnection: TcpClientReconnectionConfig {
            max_retries: Some(1),
            interval: IggyDuration::from(Duration::from_millis(50)),
            reestablish_after: IggyDuration::from(Duration::ZERO),
            ..TcpClientReconnectionConfig::default()
        },
        ..TcpClientConfig::default()
    };
    let tcp = TcpClient::create(Arc::new(config)).expect("tcp client");
    let client = IggyClient::builder().with_client(ClientWrapper::Tcp(tcp)).build().expect("client builds");
    client.connect().await.expect("connect");
    ensure_destination(&client, 1).await;

    broker.stop().await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    broker.restart().await.expect("restart");
    let logins = broker.request_count(RequestKind::Login);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if send(&client, &Partitioning::partition_id(0), &[1]).await.is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "the heartbeat never reconnected");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(broker.request_count(RequestKind::Login) > logins);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_closed_by_the_broker_are_reopened_transparently() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    ensure_destination(&client, 1).await;

    broker.disconnect_all().await;
    assert_eq!(broker.open_connections(), 0);
    send(&client, &Partitioning::partition_id(0), &[1]).await.expect("reconnected");
    assert_eq!(broker.accepted_connections(), 2);
    assert_eq!(broker.messages(STREAM, TOPIC).iter().map(|m| m.id).collect::<Vec<_>>(), vec![1]);
}

/// A stream holds at most as many topics as the server's (4,096): the next is refused
/// with `TooManyTopics`, as the server refuses it, so a router that names more
/// destinations in one stream meets the refusal in CI too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_holds_at_most_the_servers_number_of_topics() {
    let broker = start().await;
    let client = client(&broker);
    client.connect().await.expect("connect");
    client.create_stream("many").await.expect("stream");
    let options = TopicCreateOptions { partitions_count: Some(1), ..TopicCreateOptions::default() };
    let max = iggy_binary_protocol::namespace::MAX_TOPICS;
    for n in 0..max {
        client.create_topic(&id("many"), &format!("t{n}"), &options).await.unwrap_or_else(|e| panic!("t{n}: {e:?}"));
    }
    let e = client.create_topic(&id("many"), "one-too-many", &options).await.expect_err("refused");
    assert!(matches!(e, IggyError::TooManyTopics), "{e:?}");
    assert!(client.get_topic(&id("many"), &id("one-too-many")).await.expect("get").is_none());
}
