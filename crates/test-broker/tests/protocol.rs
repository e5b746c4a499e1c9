//! Bytes the real client would never send: the broker closes the connection
//! or answers with an eviction, and never panics.

use iggy_binary_protocol::codes::CREATE_STREAM_CODE;
use iggy_binary_protocol::consensus::{Command, GenericHeader, HEADER_SIZE, Operation, RequestHeader};
use std::time::Duration;
use test_broker::{RequestKind, TestBroker, TestBrokerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn read_to_end(socket: &mut TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), socket.read_to_end(&mut received))
        .await
        .expect("the broker answers or closes")
        .expect("read");
    received
}

#[tokio::test]
async fn a_frame_with_an_impossible_size_closes_the_connection() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.expect("start");
    let mut socket = TcpStream::connect(broker.addr()).await.expect("connect");
    socket.write_all(&[0u8; HEADER_SIZE]).await.expect("write");
    assert!(read_to_end(&mut socket).await.is_empty());

    let mut socket = TcpStream::connect(broker.addr()).await.expect("connect again");
    let mut header = [0xffu8; HEADER_SIZE];
    header[48..52].copy_from_slice(&u32::MAX.to_le_bytes());
    socket.write_all(&header).await.expect("write");
    assert!(read_to_end(&mut socket).await.is_empty());
}

#[tokio::test]
async fn a_write_without_a_session_is_evicted() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.expect("start");
    let mut socket = TcpStream::connect(broker.addr()).await.expect("connect");
    let body = [1u8, 2, 3];
    let header = RequestHeader {
        command: Command::Request,
        operation: Operation::CreateStream,
        size: u32::try_from(HEADER_SIZE + body.len()).expect("size"),
        client: 7,
        request: 1,
        session: 1,
        ..RequestHeader::default()
    };
    socket.write_all(bytemuck::bytes_of(&header)).await.expect("write");
    socket.write_all(&body).await.expect("write");
    let mut reply = [0u8; HEADER_SIZE];
    socket.read_exact(&mut reply).await.expect("reply");
    let command = std::mem::offset_of!(GenericHeader, command);
    assert_eq!(reply[command], Command::Eviction as u8);
    assert_eq!(broker.request_count(RequestKind::CreateStream), 1);
    assert_eq!(RequestKind::from_code(CREATE_STREAM_CODE), RequestKind::CreateStream);
}
