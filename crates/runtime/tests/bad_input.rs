//! Bad input against the real binary over TCP, grouped by theme: malformed bodies, sizes
//! and lying lengths, oversized request heads, slow and idle clients, forged, replayed and
//! stale signatures, and tricks in paths and endpoint ids.
//!
//! Every case checks three things: the documented answer (a 4xx with a JSON body naming
//! the problem, or a closed connection for clients too slow to finish a request head),
//! that nothing was appended (the log's next offset in `/status` did not move, and after
//! the daemon stopped every record in the log is one of the well-behaved requests), and
//! that a well-behaved client is served during and after the attack.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MAX_BODY: usize = 4096;
/// `http.max_events_per_request` here: a body under `MAX_BODY` can hold far more.
const MAX_EVENTS: usize = 100;

/// `open` takes anything; the others each exercise one check. The secret-path endpoint
/// has its own bearer token and a GET handshake.
const SOURCES: &str = r#"
[router]
enabled = false

[sources.open]
destination = { stream = "s", topic = "open" }

[sources.jsononly]
destination = { stream = "s", topic = "json" }
accept = "json"

[sources.github]
destination = { stream = "s", topic = "gh" }
auth_type = "hmac-sha256"
auth_secret = "It's a Secret to Everybody"

[sources.svix]
destination = { stream = "s", topic = "svix" }
auth_type = "standard-webhooks"
auth_secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

[sources.stripe]
destination = { stream = "s", topic = "stripe" }
auth_type = "stripe"
auth_secret = "whsec_test_secret"

[sources.hidden]
destination = { stream = "s", topic = "hidden" }
named_path = false

[[sources.hidden.endpoints]]
id = "0123456789abcdef0123456789abcdef"
auth_type = "bearer"
auth_secret = "endpoint-token"
handshake_param = "challenge"
"#;

const ENDPOINT: &str = "/v1/e/0123456789abcdef0123456789abcdef";

/// The limits every daemon here runs with: small enough that slow clients are cut off
/// within a second and a body limit a test can cross by one byte.
fn http_limits() -> String {
    format!(
        "max_body_bytes = {MAX_BODY}\nheader_read_timeout_ms = 1000\nbody_read_timeout_ms = 1000\nmax_events_per_request = {MAX_EVENTS}"
    )
}

/// A daemon, the offset its log must be at, and a well-behaved client.
struct Fixture {
    d: Daemon,
    dir: tempfile::TempDir,
    /// The log's next offset as it must be: moved only by requests answered 200.
    expected_next: u64,
    /// Payloads of the requests answered 200, in order.
    accepted: Vec<Vec<u8>>,
}

impl Fixture {
    fn start(http_extra: &str) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let d = Daemon::start(dir.path(), http_extra, SOURCES);
        Fixture { d, dir, expected_next: 0, accepted: Vec::new() }
    }

    fn http(&self) -> SocketAddr {
        self.d.http
    }

    async fn next_offset(&self) -> u64 {
        let st = request(self.d.admin, "GET", "/status", &[], "").await.json();
        st["log"]["next_offset"].as_u64().unwrap_or_else(|| panic!("no next_offset in {st}"))
    }

    /// Nothing was appended since the last accepted request.
    async fn nothing_appended(&self, what: &str) {
        assert_eq!(self.next_offset().await, self.expected_next, "{what}: the log moved");
    }

    /// Notes a request answered 200 with one event.
    fn note_accepted(&mut self, a: &Answer, payload: &[u8]) {
        assert_eq!(a.status, 200, "{:?}", String::from_utf8_lossy(&a.body));
        let j = a.json();
        assert_eq!(j["offsets"], serde_json::json!([self.expected_next, self.expected_next]), "{j}");
        self.expected_next += 1;
        self.accepted.push(payload.to_vec());
    }

    /// A well-behaved client is served: one JSON event on a fresh connection.
    async fn serves(&mut self, what: &str) {
        let body = format!("{{\"good\":{},\"after\":{:?}}}", self.accepted.len(), what);
        let a = post_json(self.http(), "/v1/sources/open", &body).await;
        assert_eq!(a.status, 200, "{what}: a good request failed: {:?}", String::from_utf8_lossy(&a.body));
        self.note_accepted(&a, body.as_bytes());
    }

    /// Stops the daemon, checks that the log holds exactly the accepted payloads, and
    /// returns it.
    fn stop_and_check_log(self) -> Vec<(u64, ingest::Envelope)> {
        assert!(self.d.stop().success());
        let log = read_log(&self.dir.path().join("data/wal"));
        let payloads: Vec<Vec<u8>> = log.iter().map(|(_, e)| e.payload.to_vec()).collect();
        assert_eq!(payloads.len(), self.accepted.len(), "the log holds exactly the requests answered 200");
        for (i, (got, want)) in payloads.iter().zip(&self.accepted).enumerate() {
            assert_eq!(got, want, "record {i}");
        }
        log
    }
}

fn assert_error(a: &Answer, status: u16, code: &str, what: &str) {
    assert_eq!(a.status, status, "{what}: {:?}", String::from_utf8_lossy(&a.body));
    let j = a.json();
    assert_eq!(j["error"], code, "{what}: {j}");
    assert!(j["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {j}");
}

/// What came back on a raw connection.
#[derive(Debug)]
struct Raw {
    /// Every byte the server sent before it closed (or the read gave up).
    bytes: Vec<u8>,
    /// The server closed the connection (EOF or reset) within the wait.
    closed: bool,
}

impl Raw {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }

    /// The first response's status line code.
    fn status(&self) -> Option<u16> {
        let text = self.text();
        let line = text.lines().next()?;
        line.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
    }

    /// The first response's body (every answer of the door has a Content-Length).
    fn first_body(&self) -> Vec<u8> {
        let text = &self.bytes;
        let Some(end) = text.windows(4).position(|w| w == b"\r\n\r\n") else { return Vec::new() };
        let head = String::from_utf8_lossy(&text[..end]).to_ascii_lowercase();
        let len = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(0);
        text[end + 4..].iter().copied().take(len).collect()
    }

    fn assert_error(&self, status: u16, code: &str, what: &str) {
        assert_eq!(self.status(), Some(status), "{what}: {}", self.text());
        let j: serde_json::Value = serde_json::from_slice(&self.first_body())
            .unwrap_or_else(|e| panic!("{what}: body is not JSON ({e}): {}", self.text()));
        assert_eq!(j["error"], code, "{what}: {j}");
        assert!(j["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {j}");
    }
}

/// Reads what the server sends until it closes the connection, for at most `wait`.
async fn read_until_closed(s: &mut TcpStream, wait: Duration) -> Raw {
    let mut bytes = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => return Raw { bytes, closed: false },
            Ok(Ok(0)) | Ok(Err(_)) => return Raw { bytes, closed: true },
            Ok(Ok(n)) => bytes.extend_from_slice(&buf[..n]),
        }
    }
}

/// Sends `bytes` on a fresh connection (a write the server refuses half-way is not an
/// error: it may answer and close before reading everything) and reads until it closes.
async fn raw(addr: SocketAddr, bytes: &[u8]) -> Raw {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    read_until_closed(&mut s, Duration::from_secs(30)).await
}

/// Request headers as name and value.
type Headers<'a> = Vec<(&'a str, &'a str)>;

async fn metrics_text(admin: SocketAddr) -> String {
    String::from_utf8_lossy(&request(admin, "GET", "/metrics", &[], "").await.body).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_malformed_bodies_and_content_types_get_400_or_415_and_append_nothing() {
    let mut f = Fixture::start(&http_limits());
    let h = f.http();
    let ndjson_bad_at_50: Vec<u8> = (1..=50)
        .flat_map(|n| if n == 50 { b"{\"n\":50\n".to_vec() } else { format!("{{\"n\":{n}}}\n").into_bytes() })
        .collect();

    // (path, content type, body, status, code, text the message must hold)
    type Case<'a> = (&'a str, Option<&'a str>, Vec<u8>, u16, &'a str, &'a str);
    let cases: Vec<Case<'_>> = vec![
        ("/v1/sources/jsononly", Some("application/json"), b"{\"a\":".to_vec(), 400, "invalid_json", "EOF"),
        ("/v1/sources/jsononly", Some("application/json"), b"[1,2".to_vec(), 400, "invalid_json", ""),
        ("/v1/sources/jsononly", Some("application/json"), b"\"abc".to_vec(), 400, "invalid_json", ""),
        ("/v1/sources/jsononly", Some("application/json"), b"{\"a\":\"\xff\xfe\"}".to_vec(), 400, "invalid_json", ""),
        ("/v1/sources/jsononly", Some("application/json"), b"\xef\xbb\xbf{}".to_vec(), 400, "invalid_json", ""),
        ("/v1/sources/jsononly", Some("application/json"), b"{} {}".to_vec(), 400, "invalid_json", ""),
        ("/v1/sources/open", Some("application/json"), b"{\"a\":1}garbage".to_vec(), 400, "invalid_json", ""),
        ("/v1/sources/open", Some("application/vnd.x+json"), b"nope".to_vec(), 400, "invalid_json", ""),
        ("/v1/sources/open", Some("application/json"), Vec::new(), 400, "no_events", ""),
        ("/v1/sources/open", None, Vec::new(), 400, "no_events", ""),
        (
            "/v1/sources/open",
            Some("application/x-ndjson"),
            b"{\"a\":1}\n{\"a\":\xff}\n{\"a\":3}\n".to_vec(),
            400,
            "malformed_ndjson_line",
            "line 2",
        ),
        (
            "/v1/sources/jsononly",
            Some("application/ndjson"),
            b"{\"a\":1}\r\n{\"a\":2}\r\n{\"a\":".to_vec(),
            400,
            "malformed_ndjson_line",
            "line 3",
        ),
        (
            "/v1/sources/open",
            Some("application/x-ndjson"),
            b"{\"a\":1}\n{\"a\":\"caf\xe9\"}\n".to_vec(),
            400,
            "malformed_ndjson_line",
            "line 2: not valid JSON: not UTF-8",
        ),
        ("/v1/sources/open", Some("application/jsonl"), ndjson_bad_at_50, 400, "malformed_ndjson_line", "line 50"),
        ("/v1/sources/open", Some("application/x-ndjson"), b"\n \r\n\n".to_vec(), 400, "no_events", ""),
        // 2,000 one-byte events in 4,000 bytes: each would be a record with its own
        // envelope, far more than the body.
        (
            "/v1/sources/open",
            Some("application/x-ndjson"),
            b"1\n".repeat(2000),
            413,
            "too_many_events",
            "more than 100",
        ),
        (
            "/v1/sources/open",
            Some("application/x-ndjson"),
            b"{}\n".repeat(MAX_EVENTS + 1),
            413,
            "too_many_events",
            "http.max_events_per_request",
        ),
        ("/v1/sources/jsononly", Some("text/plain"), b"{}".to_vec(), 415, "unsupported_media_type", "text/plain"),
        ("/v1/sources/jsononly", None, b"{}".to_vec(), 415, "unsupported_media_type", "no Content-Type header"),
        ("/v1/sources/jsononly", Some("application/jsonx"), b"{}".to_vec(), 415, "unsupported_media_type", ""),
        ("/v1/sources/jsononly", Some("json"), b"{}".to_vec(), 415, "unsupported_media_type", ""),
        (
            "/v1/sources/jsononly",
            Some("multipart/form-data; boundary=x"),
            b"{}".to_vec(),
            415,
            "unsupported_media_type",
            "",
        ),
    ];
    for (path, ct, body, status, code, needle) in cases {
        let what = format!("{path} {ct:?} {:?}", String::from_utf8_lossy(&body));
        let headers: Vec<(&str, &str)> = ct.map(|c| ("content-type", c)).into_iter().collect();
        let a = request(h, "POST", path, &headers, body).await;
        assert_error(&a, status, code, &what);
        let message = a.json()["message"].as_str().unwrap_or_default().to_string();
        assert!(message.contains(needle), "{what}: the message {message:?} does not name {needle:?}");
        f.nothing_appended(&what).await;
    }
    // The limit itself is a batch like any other.
    let at_limit =
        request(h, "POST", "/v1/sources/open", &[("content-type", "application/x-ndjson")], b"{}\n".repeat(MAX_EVENTS))
            .await;
    assert_eq!(at_limit.status, 200, "{:?}", String::from_utf8_lossy(&at_limit.body));
    for _ in 0..MAX_EVENTS {
        f.accepted.push(b"{}".to_vec());
    }
    f.expected_next += MAX_EVENTS as u64;
    f.serves("malformed bodies").await;

    // Header values that are not ASCII, or longer than Iggy takes: a Content-Type, a
    // delivery id.
    let long_content_type = format!("content-type: text/plain; x={}\r\n", "b".repeat(8000)).into_bytes();
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (b"content-type: application/json\xff\r\n".to_vec(), 400, "invalid_content_type"),
        (long_content_type, 400, "invalid_content_type"),
        (b"content-type: application/json\r\nidempotency-key: d\xe9j\xe0\r\n".to_vec(), 400, "invalid_delivery_id"),
        (b"content-type: application/json\r\nidempotency-key:  \r\n".to_vec(), 400, "invalid_delivery_id"),
        (
            b"content-type: application/json\r\nidempotency-key: a\r\nidempotency-key: b\r\n".to_vec(),
            400,
            "invalid_delivery_id",
        ),
        (
            b"content-type: application/json\r\nx-github-delivery: a\r\nX-GitHub-Delivery: a\r\n".to_vec(),
            400,
            "invalid_delivery_id",
        ),
    ];
    for (header, status, code) in cases {
        let mut req =
            b"POST /v1/sources/open HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 2\r\n".to_vec();
        req.extend_from_slice(&header);
        req.extend_from_slice(b"\r\n{}");
        let what = String::from_utf8_lossy(&header).into_owned();
        raw(h, &req).await.assert_error(status, code, &what);
        f.nothing_appended(&what).await;
    }

    // A source that accepts anything keeps bytes that are not UTF-8 exactly as sent:
    // documented, and not a way to smuggle anything past the JSON sources.
    let bytes = b"\xff\xfe\x00raw".to_vec();
    let a =
        request(h, "POST", "/v1/sources/open", &[("content-type", "application/octet-stream")], bytes.clone()).await;
    f.note_accepted(&a, &bytes);

    let m = metrics_text(f.d.admin).await;
    for line in [
        r#"iggy_ingest_http_rejected_total{source="jsononly",reason="invalid_json"} 6"#,
        r#"iggy_ingest_http_rejected_total{source="jsononly",reason="unsupported_media_type"} 5"#,
        r#"iggy_ingest_http_rejected_total{source="open",reason="malformed_ndjson_line"} 3"#,
    ] {
        assert!(m.contains(line), "{line} missing in\n{m}");
    }
    f.serves("after everything").await;
    f.stop_and_check_log();
}

fn post_head(path: &str, extra: &str) -> Vec<u8> {
    format!("POST {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{extra}\r\n").into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_bodies_over_the_limit_get_413_whatever_the_length_headers_say() {
    let mut f = Fixture::start(&http_limits());
    let h = f.http();

    // Exactly at the limit is accepted; one byte over is refused, by Content-Length and
    // by a chunked body that grows past it, for single events and NDJSON batches alike.
    let at_limit = vec![b'a'; MAX_BODY];
    let a = request(h, "POST", "/v1/sources/open", &[("content-type", "text/plain")], at_limit.clone()).await;
    f.note_accepted(&a, &at_limit);
    let over = vec![b'a'; MAX_BODY + 1];
    let a = request(h, "POST", "/v1/sources/open", &[("content-type", "text/plain")], over.clone()).await;
    assert_error(&a, 413, "body_too_large", "one byte over, with Content-Length");
    f.nothing_appended("one byte over").await;
    let line = b"{\"n\":1}\n";
    let ndjson: Vec<u8> = line.iter().copied().cycle().take((MAX_BODY / line.len() + 1) * line.len()).collect();
    let a = request(h, "POST", "/v1/sources/open", &[("content-type", "application/x-ndjson")], ndjson).await;
    assert_error(&a, 413, "body_too_large", "an NDJSON batch over the limit");
    f.nothing_appended("NDJSON over").await;

    let chunked = |body: &[u8], chunk: usize| -> Vec<u8> {
        let mut req = post_head("/v1/sources/open", "content-type: text/plain\r\ntransfer-encoding: chunked\r\n");
        for c in body.chunks(chunk) {
            req.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
            req.extend_from_slice(c);
            req.extend_from_slice(b"\r\n");
        }
        req.extend_from_slice(b"0\r\n\r\n");
        req
    };
    raw(h, &chunked(&over, 1000)).await.assert_error(413, "body_too_large", "one byte over, chunked");
    f.nothing_appended("chunked one over").await;
    raw(h, &chunked(&vec![b'z'; 1 << 20], 64 * 1024)).await.assert_error(413, "body_too_large", "1 MiB chunked");
    f.nothing_appended("chunked far over").await;
    f.serves("chunked").await;

    // Far over: a Content-Length of 1 GB is refused from the header, before the body is
    // read (only 64 KiB of it is ever sent).
    let mut req = post_head("/v1/sources/open", "content-type: text/plain\r\ncontent-length: 1000000000\r\n");
    req.extend_from_slice(&[b'q'; 64 * 1024]);
    let r = raw(h, &req).await;
    r.assert_error(413, "body_too_large", "Content-Length 1 GB");
    assert!(r.closed, "the connection is closed instead of reading a gigabyte");
    f.nothing_appended("far over").await;

    // A Content-Length too large for any integer type.
    let req = post_head("/v1/sources/open", "content-length: 99999999999999999999999999\r\n");
    let r = raw(h, &req).await;
    assert_eq!(r.status(), Some(400), "{}", r.text());
    f.nothing_appended("absurd Content-Length").await;

    // Lying Content-Length, smaller than the body: what the header announced is the
    // body (here not JSON: 400), and the rest is not taken as a second request.
    let mut req = post_head("/v1/sources/jsononly", "content-type: application/json\r\ncontent-length: 5\r\n");
    req.extend_from_slice(
        b"{\"a\":1,\"smuggled\":true}\r\n\r\nPOST /v1/sources/open HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}",
    );
    let r = raw(h, &req).await;
    r.assert_error(400, "invalid_json", "Content-Length shorter than the body");
    assert_eq!(r.text().matches("HTTP/1.1 ").count(), 1, "one answer only: {}", r.text());
    f.nothing_appended("short Content-Length").await;

    // Lying Content-Length, larger than the body: the body never completes (408).
    let mut req = post_head("/v1/sources/open", "content-length: 100\r\n");
    req.extend_from_slice(b"{\"only\":\"part\"}");
    raw(h, &req).await.assert_error(408, "body_read_timeout", "Content-Length longer than the body");
    f.nothing_appended("long Content-Length").await;

    // No Content-Length and no chunking: HTTP/1.1 says there is no body.
    let mut req = post_head("/v1/sources/open", "content-type: application/json\r\n");
    req.extend_from_slice(b"{\"a\":1}");
    raw(h, &req).await.assert_error(400, "no_events", "body without a length");
    f.nothing_appended("no length").await;

    // Both Content-Length and chunked (a request-smuggling shape): refused by the HTTP
    // layer or, with chunking taking precedence, judged by the bytes that arrive.
    let mut req = post_head(
        "/v1/sources/open",
        "content-type: text/plain\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n",
    );
    let big = vec![b'w'; MAX_BODY + 10];
    req.extend_from_slice(format!("{:x}\r\n", big.len()).as_bytes());
    req.extend_from_slice(&big);
    req.extend_from_slice(b"\r\n0\r\n\r\n");
    let r = raw(h, &req).await;
    assert!(matches!(r.status(), Some(400 | 413)), "{}", r.text());
    f.nothing_appended("Content-Length and chunked").await;

    // A chunk whose size is not hex: the body cannot be read.
    let mut req = post_head("/v1/sources/open", "content-type: text/plain\r\ntransfer-encoding: chunked\r\n");
    req.extend_from_slice(b"4\r\nabcd\r\nzz\r\nrest\r\n0\r\n\r\n");
    raw(h, &req).await.assert_error(400, "body_read_failed", "a malformed chunk");
    f.nothing_appended("malformed chunk").await;

    f.serves("after sizes").await;
    f.stop_and_check_log();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_request_heads_over_the_limits_are_refused_before_any_route_runs() {
    let mut f = Fixture::start(&http_limits());
    let h = f.http();

    // One header of 512 KiB, more headers than allowed, a 512 KiB path: the HTTP layer
    // refuses them (no route, no auth, no body read) and closes the connection.
    let huge_value = format!("x-big: {}\r\n", "v".repeat(512 * 1024));
    let many: String = (0..200).map(|i| format!("x-h{i}: {i}\r\n")).collect();
    let long_path = format!("/v1/sources/{}", "p".repeat(512 * 1024));
    let cases: Vec<(String, Vec<u8>)> = vec![
        ("a 512 KiB header".into(), post_head("/v1/sources/open", &format!("content-length: 2\r\n{huge_value}"))),
        ("200 headers".into(), post_head("/v1/sources/open", &format!("content-length: 2\r\n{many}"))),
        ("a 512 KiB path".into(), post_head(&long_path, "content-length: 2\r\n")),
    ];
    for (what, mut req) in cases {
        req.extend_from_slice(b"{}");
        let r = raw(h, &req).await;
        assert!(matches!(r.status(), Some(414 | 431)), "{what}: {}", r.text());
        assert!(r.closed, "{what}: the connection is closed");
        f.nothing_appended(&what).await;
        f.serves(&what).await;
    }

    // Bytes that are not HTTP: a bare 400 from the HTTP layer, and the connection closed.
    let cases: Vec<(&str, &[u8])> = vec![
        ("not HTTP", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n"),
        ("a raw byte in the path", b"POST /v1/sources/op\xffen HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"),
        (
            "a space in a header name",
            b"POST /v1/sources/open HTTP/1.1\r\nhost: x\r\nbad name: 1\r\ncontent-length: 2\r\n\r\n{}",
        ),
        (
            "a NUL in a header value",
            b"POST /v1/sources/open HTTP/1.1\r\nhost: x\r\nx-a: a\x00b\r\ncontent-length: 2\r\n\r\n{}",
        ),
        ("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
    ];
    for (what, req) in cases {
        let r = raw(h, req).await;
        assert!(matches!(r.status(), Some(400..=499) | None), "{what}: {}", r.text());
        assert!(r.closed, "{what}: the connection is closed");
        f.nothing_appended(what).await;
    }
    f.serves("after bad heads").await;
    f.stop_and_check_log();
}

/// Connects and sends `bytes` one at a time, `every` apart, until the server answers or
/// closes; returns what it sent back and how many bytes were sent before that.
async fn trickle(addr: SocketAddr, bytes: Vec<u8>, every: Duration) -> (Raw, usize) {
    trickle_on(TcpStream::connect(addr).await.unwrap(), bytes, every).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_slow_clients_are_cut_off_while_others_are_served() {
    // header_read_timeout_ms = 1000 and body_read_timeout_ms = 1000; the slow clients
    // below would need 8 seconds to finish.
    let mut f = Fixture::start(&http_limits());
    let h = f.http();
    let every = Duration::from_millis(100);

    // Head trickled a byte at a time (slowloris), 16 at once.
    let mut head = b"POST /v1/sources/open HTTP/1.1\r\nhost: x\r\nx-slow: ".to_vec();
    head.extend(std::iter::repeat_n(b's', 80));
    head.extend_from_slice(b"\r\ncontent-length: 2\r\n\r\n{}");
    let total = head.len();
    let slow: Vec<_> = (0..16).map(|_| tokio::spawn(trickle(h, head.clone(), every))).collect();
    // Served while the slow clients hold their connections.
    f.serves("during slowloris").await;
    for t in slow {
        let (r, sent) = t.await.unwrap();
        assert!(r.closed, "the server closed the slow connection");
        assert!(sent < total, "cut off before the head was complete ({sent} of {total} bytes)");
        assert!(!r.text().contains("200 OK"), "{}", r.text());
    }
    f.nothing_appended("slowloris").await;

    // Head complete, body trickled: 408 with its JSON body, before the body completes.
    let mut req = post_head("/v1/sources/open", "content-length: 80\r\n");
    let head_len = req.len();
    req.extend(std::iter::repeat_n(b'b', 80));
    let mut s = TcpStream::connect(h).await.unwrap();
    s.write_all(&req[..head_len]).await.unwrap();
    let body_trickle = tokio::spawn(trickle_on(s, req[head_len..].to_vec(), every));
    f.serves("during a trickled body").await;
    let (r, sent) = body_trickle.await.unwrap();
    r.assert_error(408, "body_read_timeout", "a trickled body");
    assert!(sent < 80, "answered before the body was complete ({sent} of 80 bytes)");
    f.nothing_appended("trickled body").await;

    f.serves("after slow clients").await;
    f.stop_and_check_log();
}

/// [`trickle`] on a connection that already sent part of its request.
async fn trickle_on(mut s: TcpStream, bytes: Vec<u8>, every: Duration) -> (Raw, usize) {
    let mut sent = 0;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    for b in bytes {
        tokio::select! {
            biased;
            r = s.read(&mut buf) => match r {
                Ok(0) | Err(_) => return (Raw { bytes: got, closed: true }, sent),
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    break;
                }
            },
            _ = tokio::time::sleep(every) => {
                if s.write_all(&[b]).await.is_err() {
                    break;
                }
                sent += 1;
            }
        }
    }
    let rest = read_until_closed(&mut s, Duration::from_secs(30)).await;
    got.extend_from_slice(&rest.bytes);
    (Raw { bytes: got, closed: rest.closed }, sent)
}

/// Raises this process's open-file limit to its hard limit (the daemon inherits it) and
/// returns the soft limit now in force.
fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    lim.rlim_cur
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_thousands_of_idle_connections_are_bounded_by_the_cap_and_time_out() {
    const CAP: usize = 256;
    // The listener's accept backlog is 1024: more waiting clients than that would wait
    // for SYN retries instead of the queue, good clients included.
    const WANTED: usize = 1200;
    let limit = raise_fd_limit();
    // This process holds every idle connection; the daemon at most CAP of them.
    let idle_count = WANTED.min(limit.saturating_sub(200) as usize);
    if idle_count < WANTED {
        eprintln!("open-file limit {limit}: running with {idle_count} idle connections instead of {WANTED}");
    }
    assert!(idle_count > 2 * CAP, "open-file limit {limit} is too low for this test (needs {} files)", 2 * CAP + 200);
    let mut f = Fixture::start(&format!("{}\nmax_connections = {CAP}", http_limits()));
    let h = f.http();
    let pid = f.d.child.id();
    let baseline_fds = open_fds(pid);

    let mut idle = Vec::with_capacity(idle_count);
    for _ in 0..idle_count {
        idle.push(TcpStream::connect(h).await.expect("connect (the kernel queues what the daemon has not accepted)"));
    }
    // Each idle connection is closed by the daemon once the header timeout passes.
    let watchers: Vec<_> = idle
        .into_iter()
        .map(|mut s| tokio::spawn(async move { read_until_closed(&mut s, Duration::from_secs(120)).await }))
        .collect();

    // A good client, queued behind the idle ones, is served once the timeout freed slots;
    // meanwhile the daemon's open files stay bounded by the cap.
    let good = tokio::spawn(async move { post_json(h, "/v1/sources/open", "{\"good\":\"behind idle\"}").await });
    let mut max_fds = 0;
    while !good.is_finished() {
        max_fds = max_fds.max(open_fds(pid));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a = good.await.unwrap();
    f.note_accepted(&a, b"{\"good\":\"behind idle\"}");
    assert!(
        max_fds <= baseline_fds + CAP + 16,
        "the daemon held {max_fds} files with {idle_count} clients connected (baseline {baseline_fds}, cap {CAP})"
    );
    assert!(max_fds >= baseline_fds + CAP / 2, "the daemon accepted connections up to the cap ({max_fds} files)");
    for w in watchers {
        let r = w.await.unwrap();
        assert!(r.closed, "an idle connection was never closed");
        assert!(r.bytes.is_empty() || r.status() == Some(408), "{}", r.text());
    }
    f.nothing_appended("idle connections").await;
    f.serves("after idle connections").await;
    f.stop_and_check_log();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_forged_replayed_and_stale_signatures_are_refused_and_append_nothing() {
    let mut f = Fixture::start(&http_limits());
    let h = f.http();
    let unauthorized = serde_json::json!({"error": "unauthorized", "message": "authentication failed"});
    let refused = |a: &Answer, what: &str| {
        assert_eq!((a.status, a.json()), (401, unauthorized.clone()), "{what}");
    };

    // Standard Webhooks: one good delivery, then its replays and forgeries.
    let key = B64.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
    let body = r#"{"type":"invoice.paid","n":1}"#;
    let sign = |id: &str, ts: u64, body: &str| format!("v1,{}", hmac_b64(&key, format!("{id}.{ts}.{body}").as_bytes()));
    let now = now_secs();
    let sig = sign("msg_1", now, body);
    let ts = now.to_string();
    let good = [("webhook-id", "msg_1"), ("webhook-timestamp", ts.as_str()), ("webhook-signature", sig.as_str())];
    let first = request(h, "POST", "/v1/sources/svix", &good, body).await;
    f.note_accepted(&first, body.as_bytes());
    // The same request again: the delivery id makes it a replay, answered with the
    // original offsets and appending nothing.
    let again = request(h, "POST", "/v1/sources/svix", &good, body).await;
    assert_eq!((again.status, again.json()), (200, first.json()));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    f.nothing_appended("a replayed Standard Webhooks delivery").await;

    let other_body = r#"{"type":"invoice.paid","n":2}"#;
    let stale_ts = (now - 600).to_string();
    let stale_sig = sign("msg_2", now - 600, body);
    let future_ts = (now + 600).to_string();
    let future_sig = sign("msg_2", now + 600, body);
    let wrong_key_sig = format!("v1,{}", hmac_b64(b"another key", format!("msg_2.{ts}.{body}").as_bytes()));
    let sig_2 = sign("msg_2", now, body);
    let cases: Vec<(&str, Headers<'_>, &str)> = vec![
        ("the signature replayed over another body", good.to_vec(), other_body),
        ("the signature replayed under another id", vec![("webhook-id", "msg_2"), good[1], good[2]], body),
        (
            "a stale timestamp",
            vec![("webhook-id", "msg_2"), ("webhook-timestamp", &stale_ts), ("webhook-signature", &stale_sig)],
            body,
        ),
        (
            "a future timestamp",
            vec![("webhook-id", "msg_2"), ("webhook-timestamp", &future_ts), ("webhook-signature", &future_sig)],
            body,
        ),
        (
            "the timestamp moved, signature kept",
            vec![("webhook-id", "msg_2"), ("webhook-timestamp", &stale_ts), ("webhook-signature", &sig_2)],
            body,
        ),
        ("a wrong key", vec![("webhook-id", "msg_2"), good[1], ("webhook-signature", &wrong_key_sig)], body),
        ("no signature", vec![("webhook-id", "msg_2"), good[1]], body),
        (
            "a timestamp that is not a number",
            vec![("webhook-id", "msg_2"), ("webhook-timestamp", "soon"), ("webhook-signature", &sig_2)],
            body,
        ),
        (
            "a signature that is not base64",
            vec![("webhook-id", "msg_2"), good[1], ("webhook-signature", "v1,!!!")],
            body,
        ),
        (
            "an unknown signature version",
            vec![("webhook-id", "msg_2"), good[1], ("webhook-signature", "v2,AAAA")],
            body,
        ),
    ];
    for (what, headers, body) in cases {
        refused(&request(h, "POST", "/v1/sources/svix", &headers, body).await, what);
        f.nothing_appended(what).await;
    }
    f.serves("after Standard Webhooks forgeries").await;

    // Stripe: no delivery id, so the timestamp bounds replays.
    let body = r#"{"id":"evt_1","type":"charge.succeeded"}"#;
    let stripe = |ts: u64, secret: &[u8], body: &str| {
        format!("t={ts},v1={}", hmac_hex(secret, format!("{ts}.{body}").as_bytes()))
    };
    let good = stripe(now, b"whsec_test_secret", body);
    let a = request(h, "POST", "/v1/sources/stripe", &[("stripe-signature", &good)], body).await;
    f.note_accepted(&a, body.as_bytes());
    let cases: Vec<(&str, String, &str)> = vec![
        ("a stale timestamp", stripe(now - 600, b"whsec_test_secret", body), body),
        ("a future timestamp", stripe(now + 600, b"whsec_test_secret", body), body),
        ("the signature replayed over another body", good.clone(), r#"{"id":"evt_2"}"#),
        ("the timestamp moved, signature kept", good.replacen(&format!("t={now}"), &format!("t={}", now - 1), 1), body),
        ("a wrong secret", stripe(now, b"whsec_other", body), body),
        ("no timestamp", good.split(',').nth(1).unwrap_or_default().to_string(), body),
        ("no v1 signature", format!("t={now},v0=abc"), body),
        ("a signature that is not hex", format!("t={now},v1=zz"), body),
    ];
    for (what, header, body) in cases {
        refused(&request(h, "POST", "/v1/sources/stripe", &[("stripe-signature", &header)], body).await, what);
        f.nothing_appended(what).await;
    }
    refused(&request(h, "POST", "/v1/sources/stripe", &[], body).await, "no Stripe-Signature");
    f.nothing_appended("no Stripe-Signature").await;

    // GitHub HMAC: a replay carrying X-GitHub-Delivery appends nothing; forgeries fail.
    let gh = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
    let delivered = [("x-hub-signature-256", gh), ("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958")];
    let a = request(h, "POST", "/v1/sources/github", &delivered, "Hello, World!").await;
    f.note_accepted(&a, b"Hello, World!");
    let again = request(h, "POST", "/v1/sources/github", &delivered, "Hello, World!").await;
    assert_eq!((again.status, again.header("idempotent-replayed")), (200, Some("true")));
    f.nothing_appended("a replayed GitHub delivery").await;
    let upper = gh.to_ascii_uppercase();
    let cases: Vec<(&str, &str, &str)> = vec![
        ("the signature over another body", gh, "Hello, World?"),
        ("a SHA-1 prefix", "sha1=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17", "Hello, World!"),
        ("a truncated signature", "sha256=757107ea0eb2509fc211221cce984b8a", "Hello, World!"),
        ("an upper-cased prefix", &upper, "Hello, World!"),
        ("not hex", "sha256=not-hex", "Hello, World!"),
        ("empty", "", "Hello, World!"),
    ];
    for (what, sig, body) in cases {
        refused(&request(h, "POST", "/v1/sources/github", &[("x-hub-signature-256", sig)], body).await, what);
        f.nothing_appended(what).await;
    }

    let m = metrics_text(f.d.admin).await;
    // A stale timestamp is counted only for a request whose signature holds: the one
    // moved out of tolerance under a kept signature is a bad signature.
    for line in [
        r#"iggy_ingest_auth_failures_total{source="svix",reason="auth_stale_timestamp"} 2"#,
        r#"iggy_ingest_auth_failures_total{source="svix",reason="auth_bad_signature"} 4"#,
        r#"iggy_ingest_auth_failures_total{source="svix",reason="auth_missing"} 1"#,
        r#"iggy_ingest_auth_failures_total{source="svix",reason="auth_malformed"} 3"#,
        r#"iggy_ingest_auth_failures_total{source="stripe",reason="auth_stale_timestamp"} 2"#,
        r#"iggy_ingest_auth_failures_total{source="stripe",reason="auth_bad_signature"} 3"#,
        r#"iggy_ingest_auth_failures_total{source="stripe",reason="auth_malformed"} 3"#,
        r#"iggy_ingest_auth_failures_total{source="stripe",reason="auth_missing"} 1"#,
        r#"iggy_ingest_auth_failures_total{source="github",reason="auth_bad_signature"} 2"#,
        r#"iggy_ingest_auth_failures_total{source="github",reason="auth_malformed"} 4"#,
    ] {
        assert!(m.contains(line), "{line} missing in\n{m}");
    }
    f.serves("after signatures").await;
    f.stop_and_check_log();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_a_replayed_standard_webhooks_request_with_an_added_idempotency_key_is_still_a_replay() {
    let mut f = Fixture::start(&http_limits());
    let h = f.http();
    let key = B64.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
    let sign =
        |id: &str, ts: &str, body: &str| format!("v1,{}", hmac_b64(&key, format!("{id}.{ts}.{body}").as_bytes()));
    let ts = now_secs().to_string();

    // A captured delivery, resent within the tolerance with an unsigned Idempotency-Key
    // added: still the signed id's replay, with the original offsets.
    let body = r#"{"type":"invoice.paid","n":1}"#;
    let sig = sign("msg_1", &ts, body);
    let good = [("webhook-id", "msg_1"), ("webhook-timestamp", ts.as_str()), ("webhook-signature", sig.as_str())];
    let first = request(h, "POST", "/v1/sources/svix", &good, body).await;
    f.note_accepted(&first, body.as_bytes());
    for extra in ["anything-new", "msg_2", "   "] {
        let mut replay = good.to_vec();
        replay.push(("idempotency-key", extra));
        let again = request(h, "POST", "/v1/sources/svix", &replay, body).await;
        assert_eq!((again.status, again.json()), (200, first.json()), "Idempotency-Key {extra:?}");
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "Idempotency-Key {extra:?}");
        f.nothing_appended("a replay with an added Idempotency-Key").await;
    }

    // The same with the svix- header names: the id the signature covers is svix-id.
    let body = r#"{"type":"invoice.paid","n":2}"#;
    let sig = sign("msg_svix", &ts, body);
    let svix = [("svix-id", "msg_svix"), ("svix-timestamp", ts.as_str()), ("svix-signature", sig.as_str())];
    let first = request(h, "POST", "/v1/sources/svix", &svix, body).await;
    f.note_accepted(&first, body.as_bytes());
    let mut replay = svix.to_vec();
    replay.push(("idempotency-key", "anything-new"));
    let again = request(h, "POST", "/v1/sources/svix", &replay, body).await;
    assert_eq!((again.status, again.header("idempotent-replayed")), (200, Some("true")));
    assert_eq!(again.json(), first.json());
    f.nothing_appended("a svix- replay with an added Idempotency-Key").await;

    // And the other way: a new signed delivery carrying another delivery's id as its
    // Idempotency-Key is its own delivery, appended, not answered as the other's replay.
    let body = r#"{"type":"invoice.paid","n":3}"#;
    let sig = sign("msg_3", &ts, body);
    let third = [
        ("webhook-id", "msg_3"),
        ("webhook-timestamp", ts.as_str()),
        ("webhook-signature", sig.as_str()),
        ("idempotency-key", "msg_1"),
    ];
    let a = request(h, "POST", "/v1/sources/svix", &third, body).await;
    assert_eq!(a.header("idempotent-replayed"), None);
    f.note_accepted(&a, body.as_bytes());

    f.serves("after replays with added keys").await;
    let log = f.stop_and_check_log();
    let ids: Vec<_> = log.iter().filter_map(|(_, e)| e.header.idempotency_key.clone()).collect();
    assert_eq!(ids, ["msg_1", "msg_svix", "msg_3"], "each record keeps the id its signature covered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_path_traversal_and_encoded_tricks_in_ids_and_keys_find_nothing() {
    let mut f = Fixture::start(&http_limits());
    let h = f.http();
    let token = [("authorization", "Bearer endpoint-token"), ("content-type", "application/json")];

    // Every one of these names no source and no endpoint: 404 with a JSON body.
    let not_found = [
        "/v1/e/..%2F..%2Fsources%2Fopen",
        "/v1/e/../../v1/sources/open",
        "/v1/e/0123456789abcdef0123456789abcdef/../../sources/open",
        "/v1/e/0123456789abcdef0123456789abcdef/",
        "/v1/e/0123456789abcdef0123456789abcde",
        "/v1/e/0123456789abcdef0123456789abcdef0",
        "/v1/e/0123456789abcdef0123456789abcdeg",
        "/v1/e/+123456789abcdef0123456789abcdef",
        "/v1/e/%2B123456789abcdef0123456789abcdef",
        "/v1/e/0x23456789abcdef0123456789abcdef",
        "/v1/e/%00123456789abcdef0123456789abcdef",
        "/v1/e/0123456789abcdef0123456789abcdef%00",
        "/v1/e/%200123456789abcdef0123456789abcdef",
        "/v1/e/0123456789abcdef%2F0123456789abcdef",
        "/v1/e/",
        "/v1/e",
        "/v1/sources/hidden",
        "/v1/sources/%68idden",
        "/v1/sources/open%2F..%2Fhidden",
        "/v1/sources/..%2Fsources%2Fopen",
        "/v1/sources/../sources/open",
        "/v1/sources/./open",
        "/v1/sources/open/",
        "/v1/sources/open/x",
        "/v1/sources/OPEN",
        "/v1/sources/open%00",
        "/v1/sources/open;x=1",
        "/v1/sources/",
        "//v1/sources/open",
        "/v1//sources/open",
        "/V1/sources/open",
        "/v1/sources/%2e%2e",
    ];
    for path in not_found {
        let a = request(h, "POST", path, &token, "{\"trick\":1}").await;
        assert_error(&a, 404, "not_found", path);
        f.nothing_appended(path).await;
    }

    // Paths whose percent-encoding does not decode to UTF-8, in a source key, an
    // endpoint id and the handshake's query: still a JSON answer, and nothing appended.
    for (method, path, status, code) in [
        ("POST", "/v1/sources/%FF", 404, "not_found"),
        ("POST", "/v1/sources/op%C3en", 404, "not_found"),
        ("POST", "/v1/e/%FF%FE0123456789abcdef0123456789ab", 404, "not_found"),
        ("GET", "/v1/e/%FF", 404, "not_found"),
    ] {
        let a = request(h, method, path, &token, "").await;
        assert_error(&a, status, code, path);
        f.nothing_appended(path).await;
    }
    // The handshake's challenge is echoed exactly, as plain text that no browser may
    // sniff; one that does not decode to UTF-8 is refused, not echoed with its bytes
    // replaced.
    let a = request(h, "GET", &format!("{ENDPOINT}?challenge=%FF%3Cb%3E"), &[], "").await;
    assert_error(&a, 400, "invalid_challenge", "a challenge that is not UTF-8");
    let a = request(h, "GET", &format!("{ENDPOINT}?challenge=%3Cb%3E"), &[], "").await;
    assert_eq!((a.status, a.body.as_ref()), (200, "<b>".as_bytes()));
    assert_eq!(a.header("x-content-type-options"), Some("nosniff"));
    assert_eq!(a.header("content-type"), Some("text/plain; charset=utf-8"));
    f.nothing_appended("a handshake").await;

    // The endpoint's id percent-encoded, or in upper case, is the same endpoint (RFC 3986:
    // the same URL), and its own auth still applies.
    for path in ["/v1/e/0123456789abcdef0123456789abcde%66", "/v1/e/0123456789ABCDEF0123456789ABCDEF"] {
        let a = request(h, "POST", path, &[("content-type", "application/json")], "{}").await;
        assert_error(&a, 401, "unauthorized", path);
        f.nothing_appended(path).await;
    }
    let a = request(h, "POST", "/v1/e/0123456789abcdef0123456789abcde%66", &token, "{\"via\":\"encoded id\"}").await;
    f.note_accepted(&a, b"{\"via\":\"encoded id\"}");

    // Methods the paths do not take.
    for (method, path) in
        [("PUT", "/v1/sources/open"), ("DELETE", "/v1/sources/open"), ("GET", "/v1/sources/open"), ("PATCH", ENDPOINT)]
    {
        let a = request(h, method, path, &token, "{}").await;
        assert_error(&a, 405, "method_not_allowed", &format!("{method} {path}"));
        assert!(a.header("allow").is_some_and(|m| m.contains("POST")), "{method} {path}: no Allow header");
        f.nothing_appended(path).await;
    }
    f.serves("after path tricks").await;
    let log = f.stop_and_check_log();
    let (_, via_encoded) = &log[0];
    assert_eq!(via_encoded.header.endpoint_id, Some(0x0123456789abcdef0123456789abcdef), "the configured endpoint");
    assert_eq!(via_encoded.header.source_key, "hidden");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_the_admin_api_answers_wrong_methods_and_undecodable_paths_in_json() {
    const READER: &str = "Bearer test-admin-reader-token-42";
    let root = tempfile::tempdir().unwrap();
    let text =
        config_text(root.path(), "", SOURCES).replace("[admin]\n", "[admin]\ntoken = \"test-admin-reader-token-42\"\n");
    let d = Daemon::start_text(root.path(), &text);
    let manager = format!("Bearer {MANAGEMENT_TOKEN}");
    let json_error = |a: &Answer, status: u16, code: &str, what: &str| {
        assert_eq!(
            a.header("content-type"),
            Some("application/json"),
            "{what}: {:?}",
            String::from_utf8_lossy(&a.body)
        );
        assert_error(a, status, code, what);
    };

    // A method a path does not take: 405 with a JSON body and the methods it does take.
    for (method, path, token) in [
        ("POST", "/status", READER),
        ("DELETE", "/metrics", READER),
        ("PUT", "/connectors/open", READER),
        ("POST", "/connectors/open/destinations", READER),
        ("POST", "/health", READER),
        ("PUT", "/v1/endpoints", manager.as_str()),
        ("GET", "/v1/endpoints/0123456789abcdef0123456789abcdef", manager.as_str()),
        ("GET", "/v1/endpoints/0123456789abcdef0123456789abcdef/rotate", manager.as_str()),
    ] {
        let what = format!("{method} {path}");
        let a = request(d.admin, method, path, &[("authorization", token)], "").await;
        json_error(&a, 405, "method_not_allowed", &what);
        assert!(a.header("allow").is_some_and(|m| !m.is_empty()), "{what}: no Allow header");
    }
    // Without the admin token a wrong method is refused like any other call: the token
    // is checked first, so a wrong method says nothing about which paths exist.
    let a = request(d.admin, "POST", "/status", &[], "").await;
    json_error(&a, 401, "unauthorized", "POST /status without a token");

    // A path segment that does not percent-decode to UTF-8 names nothing: 404 in JSON,
    // never a plain-text rejection.
    for (method, path, token) in [
        ("GET", "/connectors/%FF", READER),
        ("GET", "/connectors/op%C3en", READER),
        ("GET", "/connectors/%FF/destinations", READER),
        ("DELETE", "/v1/endpoints/%FF", manager.as_str()),
        ("POST", "/v1/endpoints/%FF%FE/rotate", manager.as_str()),
    ] {
        let a = request(d.admin, method, path, &[("authorization", token)], "").await;
        json_error(&a, 404, "not_found", &format!("{method} {path}"));
    }
    // The management token is still checked before the path is looked at.
    let a = request(d.admin, "DELETE", "/v1/endpoints/%FF", &[("authorization", READER)], "").await;
    json_error(&a, 401, "unauthorized", "DELETE /v1/endpoints/%FF with the reader token");

    // A management body past its own 64 KiB limit is refused naming that limit, not the
    // door's max_body_bytes; nothing is registered.
    let big = format!("{{\"source\":\"open\",\"auth_type\":\"none\",\"pad\":\"{}\"}}", "x".repeat(64 * 1024));
    let a = request(d.admin, "POST", "/v1/endpoints", &[("authorization", &manager)], big).await;
    json_error(&a, 413, "body_too_large", "a 64 KiB registration");
    assert!(
        a.json()["message"].as_str().is_some_and(|m| m.contains("management request body is at most 65536")),
        "{}",
        a.json()
    );

    // The static endpoint is untouched and the daemon still serves.
    let a = request(d.admin, "GET", "/v1/endpoints", &[("authorization", &manager)], "").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["endpoints"].as_array().map(Vec::len), Some(1), "{}", a.json());
    assert_eq!(post_json(d.http, "/v1/sources/open", "{}").await.status, 200);
    assert!(d.stop().success());
}
