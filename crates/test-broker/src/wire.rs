//! Framing: reading request frames and writing reply frames.
//!
//! Every frame starts with a 256-byte consensus header (`RequestHeader` from
//! the client, `ReplyHeader` or `EvictionHeader` from the broker) whose `size`
//! field counts the header plus the body. The header types come from
//! `iggy_binary_protocol`; this module only moves bytes.
//!
//! Invariants:
//! - a frame whose size is below the header size, above [`MAX_FRAME_SIZE`], or
//!   whose header is not a valid `Request` is an error: the caller closes the
//!   connection, it never guesses;
//! - a reply echoes the request's `client`, `request`, `request_checksum` and
//!   `operation`, so the client's lockstep reader accepts it.

use bytes::{BufMut, Bytes, BytesMut};
use iggy_binary_protocol::codes::{LOGIN_REGISTER_CODE, LOGOUT_USER_CODE};
use iggy_binary_protocol::consensus::{
    Command, EvictionHeader, EvictionReason, HEADER_SIZE, Operation, ReplyHeader, RequestHeader, read_size_field,
};
use std::io;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The largest frame the broker accepts (header plus body).
pub const MAX_FRAME_SIZE: usize = 64 * 1024 * 1024;

/// One request as read off the socket.
#[derive(Debug)]
pub struct Request {
    pub header: RequestHeader,
    pub body: Bytes,
}

impl Request {
    /// The command code this request carries. Non-replicated operations carry
    /// it in the first four reserved bytes; the others are named by their
    /// operation.
    pub fn code(&self) -> u32 {
        match self.header.operation {
            Operation::Register => LOGIN_REGISTER_CODE,
            Operation::Logout => LOGOUT_USER_CODE,
            Operation::NonReplicated => {
                let mut code = [0u8; 4];
                code.copy_from_slice(&self.header.reserved[..4]);
                u32::from_le_bytes(code)
            }
            operation => operation.to_command_code().unwrap_or(0),
        }
    }
}

fn invalid(message: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

/// Reads one request frame. `Ok(None)` means the peer closed the connection
/// cleanly between frames.
pub async fn read_request<R: AsyncRead + Unpin>(reader: &mut R) -> io::Result<Option<Request>> {
    let mut header_bytes = [0u8; HEADER_SIZE];
    match reader.read_exact(&mut header_bytes).await {
        Ok(_) => {}
        Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(error),
    }
    let size = read_size_field(&header_bytes).ok_or_else(|| invalid("short header"))? as usize;
    if !(HEADER_SIZE..=MAX_FRAME_SIZE).contains(&size) {
        return Err(invalid("frame size out of range"));
    }
    let header: RequestHeader =
        bytemuck::checked::try_pod_read_unaligned(&header_bytes).map_err(|_| invalid("not a request header"))?;
    if header.command != Command::Request {
        return Err(invalid("frame is not a request"));
    }
    let mut body = vec![0u8; size - HEADER_SIZE];
    reader.read_exact(&mut body).await?;
    Ok(Some(Request { header, body: Bytes::from(body) }))
}

/// Encodes a reply to `request`: `status` 0 with `body`, or a nonzero status
/// (an `IggyError` code) with an empty body.
pub fn encode_reply(request: &RequestHeader, status: u32, body: &[u8]) -> Bytes {
    let size = u32::try_from(HEADER_SIZE + body.len()).unwrap_or(u32::MAX);
    let header = ReplyHeader {
        command: Command::Reply,
        size,
        request_checksum: request.request_checksum,
        client: request.client,
        request: request.request,
        operation: request.operation,
        status,
        ..ReplyHeader::default()
    };
    let mut out = BytesMut::with_capacity(HEADER_SIZE + body.len());
    out.put_slice(bytemuck::bytes_of(&header));
    out.put_slice(body);
    out.freeze()
}

/// A reply header whose size field is below a header's size: the client refuses it
/// (`InvalidCommand`) without reading anything after it.
pub fn malformed_reply_header() -> Bytes {
    let header = ReplyHeader { command: Command::Reply, size: 1, ..ReplyHeader::default() };
    Bytes::copy_from_slice(bytemuck::bytes_of(&header))
}

/// Encodes an eviction frame (a terminal answer to a login or to a request
/// without a session).
pub fn encode_eviction(client: u128, reason: EvictionReason) -> Bytes {
    // The header rejects a zero client id; the client always sends a random one.
    let header = EvictionHeader::new(0, 0, 0, client.max(1), reason);
    Bytes::copy_from_slice(bytemuck::bytes_of(&header))
}

/// The body of a successful metadata reply: an empty result section, then
/// the typed payload.
pub fn result_framed_ok(payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(4 + payload.len());
    out.put_u32_le(0);
    out.put_slice(payload);
    out.freeze()
}

/// The body of a committed metadata rejection: one result entry
/// `{index: 0, result: code}` and no payload.
pub fn result_framed_err(code: u32) -> Bytes {
    let mut out = BytesMut::with_capacity(12);
    out.put_u32_le(1);
    out.put_u32_le(0);
    out.put_u32_le(code);
    out.freeze()
}
