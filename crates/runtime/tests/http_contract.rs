//! The HTTP contract against the real binary: status codes, JSON error bodies, NDJSON
//! atomicity, every auth scheme, idempotent retries, the handshake, and that no
//! rejected request appends anything.

mod common;

use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use common::*;

const SOURCES: &str = r#"
[sources.default]
destination = { stream = "ingest", topic = "events" }
forward_headers = ["x-event-kind"]

[sources.jsononly]
destination = { stream = "s", topic = "json", partition_id = 2 }
accept = "json"

[sources.github]
destination = { stream = "gh", topic = "events" }
auth_type = "hmac-sha256"
auth_secret = "It's a Secret to Everybody"

[sources.legacy]
destination = { stream = "gh", topic = "legacy" }
auth_type = "hmac-sha1"
auth_secret = "It's a Secret to Everybody"

[sources.internal]
destination = { stream = "i", topic = "t" }
auth_type = "bearer"
auth_secret = "internal-token"

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
auth_type = "none"
handshake_param = "challenge"

[[sources.hidden.endpoints]]
id = "fedcba9876543210fedcba9876543210"
auth_type = "none"
expires_at = "2001-01-01T00:00:00Z"
"#;

fn assert_error(a: &Answer, status: u16, code: &str) {
    assert_eq!(a.status, status, "{:?}", String::from_utf8_lossy(&a.body));
    let j = a.json();
    assert_eq!(j["error"], code, "{j}");
    assert!(j["message"].is_string(), "{j}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_codes_bodies_and_records() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "max_body_bytes = 4096\nbody_read_timeout_ms = 1000", SOURCES);
    let h = d.http;

    // 200 with offsets; the record carries the resolved destination and details.
    let a = request(
        h,
        "POST",
        "/v1/sources/default",
        &[("content-type", "text/plain"), ("x-event-kind", "first"), ("x-event-kind", &"k".repeat(300))],
        "hello",
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json(), serde_json::json!({"accepted": 1, "offsets": [0, 0]}));
    let a = post_json(h, "/v1/sources/jsononly", r#"{"a":1}"#).await;
    assert_eq!(a.json(), serde_json::json!({"accepted": 1, "offsets": [1, 1]}));
    let mut appended = 2;

    // Every rejection: a JSON body naming the problem.
    assert_error(&post_json(h, "/v1/sources/nope", "{}").await, 404, "not_found");
    assert_error(&post_json(h, "/elsewhere", "{}").await, 404, "not_found");
    assert_error(&post_json(h, "/v1/sources/hidden", "{}").await, 404, "not_found");
    assert_error(&request(h, "GET", "/v1/sources/default", &[], "").await, 405, "method_not_allowed");
    assert_error(&request(h, "POST", "/v1/sources/default", &[], vec![b'x'; 5000]).await, 413, "body_too_large");
    assert_error(
        &request(h, "POST", "/v1/sources/jsononly", &[("content-type", "text/plain")], "{}").await,
        415,
        "unsupported_media_type",
    );
    assert_error(&post_json(h, "/v1/sources/jsononly", r#"{"a":"#).await, 400, "invalid_json");
    assert_error(&request(h, "POST", "/v1/sources/github", &[], "Hello, World!").await, 401, "unauthorized");
    assert_error(&post_json(h, "/v1/e/00000000000000000000000000000000", "{}").await, 404, "not_found");
    assert_error(&post_json(h, "/v1/e/not-an-id", "{}").await, 404, "not_found");
    assert_error(&post_json(h, "/v1/e/fedcba9876543210fedcba9876543210", "{}").await, 410, "endpoint_expired");
    let too_long_key = "k".repeat(300);
    assert_error(
        &request(h, "POST", "/v1/sources/default", &[("idempotency-key", &too_long_key)], "x").await,
        400,
        "invalid_delivery_id",
    );

    // 408: a body that never completes.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(h).await.unwrap();
        s.write_all(
            b"POST /v1/sources/default HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 100\r\n\r\npartial",
        )
        .await
        .unwrap();
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(30), s.read_to_end(&mut buf)).await;
        let text = String::from_utf8_lossy(&buf);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("body_read_timeout"), "{text}");
    }

    // 413 also without Content-Length: a chunked body that grows past the limit.
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(h).await.unwrap();
        s.write_all(
            b"POST /v1/sources/default HTTP/1.1\r\nhost: x\r\nconnection: close\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .await
        .unwrap();
        let chunk = format!("{:x}\r\n{}\r\n", 1000, "y".repeat(1000));
        for _ in 0..5 {
            if s.write_all(chunk.as_bytes()).await.is_err() {
                break;
            }
        }
        let _ = s.write_all(b"0\r\n\r\n").await;
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(30), s.read_to_end(&mut buf)).await;
        let text = String::from_utf8_lossy(&buf);
        assert!(text.starts_with("HTTP/1.1 413"), "{text}");
        assert!(text.contains("body_too_large"), "{text}");
    }

    // NDJSON: one atomic batch, or nothing with the line named.
    let a = request(
        h,
        "POST",
        "/v1/sources/default",
        &[("content-type", "application/x-ndjson")],
        "{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n",
    )
    .await;
    assert_eq!(a.json(), serde_json::json!({"accepted": 3, "offsets": [2, 4]}));
    appended += 3;
    let a = request(
        h,
        "POST",
        "/v1/sources/default",
        &[("content-type", "application/x-ndjson")],
        "{\"n\":1}\n{\"n\":\n{\"n\":3}\n",
    )
    .await;
    assert_error(&a, 400, "malformed_ndjson_line");
    assert!(a.json()["message"].as_str().unwrap().contains("line 2"), "{}", a.json());

    // GET handshake echo on a secret-path endpoint, then an event through it.
    let a = request(h, "GET", "/v1/e/0123456789abcdef0123456789abcdef?challenge=abc123", &[], "").await;
    assert_eq!((a.status, &a.body[..]), (200, &b"abc123"[..]));
    assert_eq!(a.header("x-content-type-options"), Some("nosniff"));
    // Decoded as a form's value is; beside other parameters; its name decoded too.
    let echoed = [
        ("?challenge=a+b%2Fc%C3%A9", "a b/cé"),
        ("?hub.mode=subscribe&challenge=1234&x", "1234"),
        ("?ch%61llenge=z", "z"),
        ("?challenge=", ""),
    ];
    for (query, echo) in echoed {
        let a = request(h, "GET", &format!("/v1/e/0123456789abcdef0123456789abcdef{query}"), &[], "").await;
        assert_eq!((a.status, &a.body[..]), (200, echo.as_bytes()), "{query}");
    }
    // No echo could be the one checked: one of two, or bytes that are not UTF-8.
    for query in ["?challenge=a&challenge=b", "?challenge=%FF%FE", "?challenge=a&ch%61llenge=a"] {
        let a = request(h, "GET", &format!("/v1/e/0123456789abcdef0123456789abcdef{query}"), &[], "").await;
        assert_error(&a, 400, "invalid_challenge");
    }
    let hidden = |st: &serde_json::Value| st["sources"]["hidden"].clone();
    let before = hidden(&request(d.admin, "GET", "/status", &[], "").await.json());
    assert_error(&request(h, "GET", "/v1/e/0123456789abcdef0123456789abcdef", &[], "").await, 400, "missing_challenge");
    // A refused handshake is the source's refusal, in its status as in its counters.
    let after = hidden(&request(d.admin, "GET", "/status", &[], "").await.json());
    assert_eq!(after["last_error"]["code"], "missing_challenge", "{after}");
    assert_eq!(after["rejected_requests"], before["rejected_requests"].as_u64().unwrap() + 1, "{before} {after}");
    let a = post_json(h, "/v1/e/0123456789abcdef0123456789abcdef", r#"{"via":"endpoint"}"#).await;
    assert_eq!(a.status, 200);
    appended += 1;

    // Health on the webhook listener.
    let a = request(h, "GET", "/health", &[], "").await;
    assert_eq!((a.status, a.json()["status"].as_str()), (200, Some("accepting")));

    // Metrics: rejections counted by reason; no paths or ids in labels.
    let m = request(d.admin, "GET", "/metrics", &[], "").await;
    let text = String::from_utf8_lossy(&m.body).to_string();
    assert!(
        text.contains(r#"iggy_ingest_http_rejected_total{source="jsononly",reason="unsupported_media_type"} 1"#),
        "{text}"
    );
    assert!(text.contains(r#"iggy_ingest_auth_failures_total{source="github",reason="auth_missing"} 1"#), "{text}");
    assert!(text.contains(r#"iggy_ingest_header_values_clamped_total{source="default"} 1"#), "{text}");
    assert!(!text.contains("fedcba98") && !text.contains("/v1/") && !text.contains("127.0.0.1"), "{text}");
    // Every refusal is counted under the code its answer carried: the documented codes,
    // nothing else (the 404s and the handshake without its parameter above included).
    for line in text.lines().filter(|l| l.starts_with("iggy_ingest_http_rejected_total{")) {
        let reason = line.split("reason=\"").nth(1).and_then(|r| r.split('"').next()).unwrap_or_default();
        assert!(
            iggy_ingest::telemetry::REJECTION_REASONS.contains(&reason),
            "rejections counted under {reason:?}, not a documented code: {line}"
        );
    }
    assert!(text.contains(r#"iggy_ingest_http_rejected_total{source="-",reason="not_found"} "#), "{text}");
    assert!(!text.contains(r#"iggy_ingest_http_rejected_total{source="-",reason="not_found"} 0"#), "{text}");
    assert!(text.contains(r#"reason="missing_challenge"} 1"#), "{text}");
    assert!(text.contains(r#"reason="invalid_challenge"} 3"#), "{text}");
    // Every request to a source is timed, whatever its answer, a handshake's included.
    let sum_of = |prefix: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .sum()
    };
    for source in ["default", "github", "jsononly", "hidden"] {
        let requests = sum_of(&format!("iggy_ingest_http_requests_total{{source=\"{source}\","));
        let timed = sum_of(&format!("iggy_ingest_http_request_duration_seconds_count{{source=\"{source}\"}}"));
        assert!(requests > 0.0 && timed == requests, "{source}: {requests} requests counted, {timed} timed:\n{text}");
    }
    let st = request(d.admin, "GET", "/status", &[], "").await.json();
    assert_eq!(st["sources"]["jsononly"]["last_error"]["code"], "invalid_json", "{st}");
    assert_eq!(st["log"]["next_offset"], appended);

    assert!(d.stop().success());
    let log = read_log(&dir.path().join("data/wal"));
    assert_eq!(log.len() as u64, appended, "only the 200s are in the log");
    let (_, first) = &log[0];
    assert_eq!(&first.payload[..], b"hello");
    assert_eq!(first.header.content_type.as_deref(), Some("text/plain"));
    assert_eq!(first.header.destination.stream, "ingest");
    assert_eq!(first.header.destination.topic, "events");
    assert_eq!(
        first.header.headers,
        vec![("x-event-kind".to_string(), vec![b'k'; 255])],
        "the last value of a repeated header, clamped to 255 bytes"
    );
    assert!(first.header.metadata.iter().any(|(k, v)| k == "peer_addr" && v.starts_with("127.0.0.1:")));
    let (_, second) = &log[1];
    assert_eq!(second.header.destination.partitioning, ingest::Partitioning::PartitionId(2));
    let batch: Vec<_> = log[2..5].iter().map(|(_, e)| (e.header.batch_index, e.header.batch_len)).collect();
    assert_eq!(batch, vec![(0, 3), (1, 3), (2, 3)]);
    assert_eq!(log[5].1.header.endpoint_id, Some(0x0123456789abcdef0123456789abcdef));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_auth_scheme_accepts_good_and_refuses_bad_signatures() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let h = d.http;
    let unauthorized = serde_json::json!({"error": "unauthorized", "message": "authentication failed"});

    // GitHub's documented example vector.
    let gh = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
    assert_eq!(
        request(h, "POST", "/v1/sources/github", &[("x-hub-signature-256", gh)], "Hello, World!").await.status,
        200
    );
    let bad = request(h, "POST", "/v1/sources/github", &[("x-hub-signature-256", gh)], "Hello, World?").await;
    assert_eq!((bad.status, bad.json()), (401, unauthorized.clone()));
    // Every 401 carries a challenge (RFC 9110) naming the scheme expected, not the reason.
    assert_eq!(bad.header("www-authenticate"), Some("hmac-sha256 realm=\"iggy-ingest\""));

    // HMAC-SHA1 (vector computed with Python's hmac module).
    let sha1 = "sha1=01dc10d0c83e72ed246219cdd91669667fe2ca59";
    assert_eq!(
        request(h, "POST", "/v1/sources/legacy", &[("x-hub-signature", sha1)], "Hello, World!").await.status,
        200
    );
    let bad = request(h, "POST", "/v1/sources/legacy", &[("x-hub-signature", "sha1=00")], "Hello, World!").await;
    assert_eq!((bad.status, bad.header("www-authenticate")), (401, Some("hmac-sha1 realm=\"iggy-ingest\"")));

    // Bearer.
    assert_eq!(
        request(h, "POST", "/v1/sources/internal", &[("authorization", "Bearer internal-token")], "x").await.status,
        200
    );
    let bad = request(h, "POST", "/v1/sources/internal", &[("authorization", "Bearer internal-tokem")], "x").await;
    assert_eq!((bad.status, bad.json()), (401, unauthorized.clone()));
    assert_eq!(bad.header("www-authenticate"), Some("Bearer realm=\"iggy-ingest\""));

    // Standard Webhooks, and the same under Svix's header names: signed now with the
    // spec example's key.
    let key = B64.decode("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
    let ts = now_secs().to_string();
    let body = r#"{"test": 2432232314}"#;
    let sig = format!("v1,{}", hmac_b64(&key, format!("msg_1.{ts}.{body}").as_bytes()));
    let sw = [("webhook-id", "msg_1"), ("webhook-timestamp", ts.as_str()), ("webhook-signature", sig.as_str())];
    assert_eq!(request(h, "POST", "/v1/sources/svix", &sw, body).await.status, 200);
    let sig2 = format!("v1,{}", hmac_b64(&key, format!("msg_2.{ts}.{body}").as_bytes()));
    let svix = [("svix-id", "msg_2"), ("svix-timestamp", ts.as_str()), ("svix-signature", sig2.as_str())];
    assert_eq!(request(h, "POST", "/v1/sources/svix", &svix, body).await.status, 200);
    let old_ts = (now_secs() - 600).to_string();
    let stale_sig = format!("v1,{}", hmac_b64(&key, format!("msg_3.{old_ts}.{body}").as_bytes()));
    let stale =
        [("webhook-id", "msg_3"), ("webhook-timestamp", old_ts.as_str()), ("webhook-signature", stale_sig.as_str())];
    let bad = request(h, "POST", "/v1/sources/svix", &stale, body).await;
    assert_eq!(
        (bad.json(), bad.header("www-authenticate")),
        (unauthorized, Some("standard-webhooks realm=\"iggy-ingest\""))
    );

    // Stripe.
    let body = r#"{"id":"evt_1"}"#;
    let st = format!("t={ts},v1={}", hmac_hex(b"whsec_test_secret", format!("{ts}.{body}").as_bytes()));
    assert_eq!(request(h, "POST", "/v1/sources/stripe", &[("stripe-signature", &st)], body).await.status, 200);
    let forged = format!("t={ts},v1={}", hmac_hex(b"whsec_other", format!("{ts}.{body}").as_bytes()));
    let bad = request(h, "POST", "/v1/sources/stripe", &[("stripe-signature", &forged)], body).await;
    assert_eq!((bad.status, bad.header("www-authenticate")), (401, Some("stripe realm=\"iggy-ingest\"")));

    let m = String::from_utf8_lossy(&request(d.admin, "GET", "/metrics", &[], "").await.body).to_string();
    for line in [
        r#"iggy_ingest_auth_failures_total{source="github",reason="auth_bad_signature"} 1"#,
        r#"iggy_ingest_auth_failures_total{source="svix",reason="auth_stale_timestamp"} 1"#,
        r#"iggy_ingest_auth_failures_total{source="stripe",reason="auth_bad_signature"} 1"#,
    ] {
        assert!(m.contains(line), "{line} missing in\n{m}");
    }
    assert!(d.stop().success());
    assert_eq!(log_len(&dir.path().join("data/wal")), 6, "only the accepted requests were appended");
}

/// An NDJSON batch of tiny events through a secret-path endpoint, under a delivery id at
/// its longest: the room its task takes before the body is decoded covers what the
/// decoded request holds (a debug build checks it as the task starts), and it is
/// accepted whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_tiny_events_through_an_endpoint_runs_within_its_room() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let key = "d".repeat(255);
    let body = "1\n".repeat(5000);
    let a = request(
        d.http,
        "POST",
        "/v1/e/0123456789abcdef0123456789abcdef",
        &[("content-type", "application/x-ndjson"), ("idempotency-key", key.as_str())],
        body,
    )
    .await;
    assert_eq!(a.status, 200, "{:?}", String::from_utf8_lossy(&a.body));
    assert_eq!(a.json(), serde_json::json!({"accepted": 5000, "offsets": [0, 4999]}));
    assert!(d.stop().success());
}

/// The same through a source's named path with no delivery id, each event's record
/// carrying a forwarded header at its longest: such a request runs on its connection, in
/// room taken before its body is decoded all the same (a debug build checks that the
/// room covers the decoded request), and is accepted whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_tiny_events_through_a_named_path_runs_within_its_room() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let kind = "k".repeat(255);
    let body = "1\n".repeat(5000);
    let headers = [("content-type", "application/x-ndjson"), ("x-event-kind", kind.as_str())];
    let a = request(d.http, "POST", "/v1/sources/default", &headers, body).await;
    assert_eq!(a.status, 200, "{:?}", String::from_utf8_lossy(&a.body));
    assert_eq!(a.json(), serde_json::json!({"accepted": 5000, "offsets": [0, 4999]}));
    assert!(d.stop().success());
    let log = read_log(&dir.path().join("data/wal"));
    assert_eq!(log.len(), 5000);
    assert!(log.iter().all(|(_, e)| e.header.headers.iter().any(|(n, v)| n == "x-event-kind" && v.len() == 255)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_delivery_gets_its_original_offsets_even_after_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    // No checkpoint before the kill: the key must come back from the log itself.
    let text =
        config_text(dir.path(), "", SOURCES).replace("checkpoint_interval_ms = 200", "checkpoint_interval_ms = 60000");
    let mut d = Daemon::start_text(dir.path(), &text);
    let long_kind = "k".repeat(300);
    let key = [
        ("content-type", "application/x-ndjson"),
        ("idempotency-key", "delivery-1"),
        ("x-event-kind", long_kind.as_str()),
    ];
    let first = request(d.http, "POST", "/v1/sources/default", &key, "{\"a\":1}\n{\"a\":2}\n").await;
    assert_eq!(first.json(), serde_json::json!({"accepted": 2, "offsets": [0, 1]}));
    assert_eq!(first.header("idempotent-replayed"), None);
    let again = request(d.http, "POST", "/v1/sources/default", &key, "{\"a\":1}\n{\"a\":2}\n").await;
    assert_eq!(again.json(), first.json());
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    // The value cut once, for the append: the replay stored nothing.
    let m = request(d.admin, "GET", "/metrics", &[], "").await;
    let text = String::from_utf8_lossy(&m.body).to_string();
    assert!(text.contains(r#"iggy_ingest_header_values_clamped_total{source="default"} 1"#), "{text}");
    // GitHub's delivery header counts as a delivery id too, scoped per source.
    let gh = [("x-github-delivery", "delivery-1"), ("content-type", "application/json")];
    let other = request(d.http, "POST", "/v1/sources/jsononly", &gh, "{}").await;
    assert_eq!(other.json()["offsets"], serde_json::json!([2, 2]));

    d.kill9();
    let d = Daemon::restart(dir.path());
    let after = request(d.http, "POST", "/v1/sources/default", &key, "{\"a\":1}\n{\"a\":2}\n").await;
    assert_eq!(after.json(), first.json(), "the key survives a crash (rebuilt from the log)");
    assert!(d.stop().success());
    let log = read_log(&dir.path().join("data/wal"));
    assert_eq!(log.len(), 3);
    let ids: Vec<u128> = log.iter().map(|(_, e)| e.header.message_id).collect();
    assert_eq!(ids[0], ingest::envelope::message_id_for_delivery("default", None, "delivery-1", 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivery_ids_are_scoped_per_endpoint_so_two_tenants_never_replay_each_other_even_after_kill_9() {
    let dir = tempfile::tempdir().unwrap();
    // No checkpoint before the kill: the keys must come back from the log itself.
    let text =
        config_text(dir.path(), "", SOURCES).replace("checkpoint_interval_ms = 200", "checkpoint_interval_ms = 60000");
    let mut d = Daemon::start_text(dir.path(), &text);
    let mgmt = format!("Bearer {MANAGEMENT_TOKEN}");
    let admin = [("authorization", mgmt.as_str()), ("content-type", "application/json")];
    let mut tenants = Vec::new();
    for _ in 0..2 {
        let reg =
            request(d.admin, "POST", "/v1/endpoints", &admin, r#"{"source":"default","auth_type":"bearer"}"#).await;
        assert_eq!(reg.status, 201, "{:?}", reg.body);
        let reg = reg.json();
        let path = reg["path"].as_str().unwrap().to_string();
        let token = format!("Bearer {}", reg["secret"].as_str().unwrap());
        let id = u128::from_str_radix(reg["id"].as_str().unwrap(), 16).unwrap();
        tenants.push((path, token, id));
    }
    // An endpoint without a handshake takes no GET: 405, naming the method it takes.
    let a = request(d.http, "GET", &tenants[0].0, &[], "").await;
    assert_error(&a, 405, "method_not_allowed");
    assert_eq!(a.header("allow"), Some("POST"));
    let st = request(d.admin, "GET", "/status", &[], "").await.json();
    assert_eq!(st["sources"]["default"]["last_error"]["code"], "method_not_allowed", "{st}");
    // Two tenants of one source, and the source's named path, each send the same
    // Idempotency-Key with their own event: three deliveries, three records.
    let send = |http: std::net::SocketAddr, path: String, token: Option<String>, body: String| async move {
        let mut headers = vec![("idempotency-key", "order-1")];
        if let Some(t) = &token {
            headers.push(("authorization", t.as_str()));
        }
        request(http, "POST", &path, &headers, body).await
    };
    let events: Vec<(String, Option<String>, String)> = vec![
        (tenants[0].0.clone(), Some(tenants[0].1.clone()), r#"{"tenant":"a"}"#.into()),
        (tenants[1].0.clone(), Some(tenants[1].1.clone()), r#"{"tenant":"b"}"#.into()),
        ("/v1/sources/default".into(), None, r#"{"tenant":"named"}"#.into()),
    ];
    for (i, (path, token, body)) in events.iter().enumerate() {
        let a = send(d.http, path.clone(), token.clone(), body.clone()).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        assert_eq!(a.header("idempotent-replayed"), None, "delivery {i} was taken for another's replay");
        assert_eq!(a.json()["offsets"], serde_json::json!([i, i]));
    }
    // Each retry replays its own delivery's offsets, before and after a kill -9 (the
    // keys are rebuilt from the log).
    for round in ["before the kill", "after the kill"] {
        for (i, (path, token, body)) in events.iter().enumerate() {
            let again = send(d.http, path.clone(), token.clone(), body.clone()).await;
            assert_eq!(again.header("idempotent-replayed"), Some("true"), "retry {i} {round}");
            assert_eq!(again.json()["offsets"], serde_json::json!([i, i]), "retry {i} {round}");
        }
        if round == "before the kill" {
            d.kill9();
            d = Daemon::restart(dir.path());
        }
    }
    assert!(d.stop().success());
    let log = read_log(&dir.path().join("data/wal"));
    let records: Vec<(Option<u128>, &[u8])> = log.iter().map(|(_, e)| (e.header.endpoint_id, &e.payload[..])).collect();
    assert_eq!(
        records,
        [
            (Some(tenants[0].2), &br#"{"tenant":"a"}"#[..]),
            (Some(tenants[1].2), &br#"{"tenant":"b"}"#[..]),
            (None, &br#"{"tenant":"named"}"#[..]),
        ]
    );
    let ids: std::collections::HashSet<u128> = log.iter().map(|(_, e)| e.header.message_id).collect();
    assert_eq!(ids.len(), 3, "each delivery has its own message id");
}

/// A dynamic endpoint may carry its hmac signature in any header, one its source
/// forwards included: the signature (no timestamp in it) is never copied into the log,
/// where any consumer could post the stored event again with it. The source's named
/// path still forwards that header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_header_a_request_was_signed_in_is_never_forwarded_into_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let mgmt = format!("Bearer {MANAGEMENT_TOKEN}");
    let admin = [("authorization", mgmt.as_str()), ("content-type", "application/json")];
    let reg = request(
        d.admin,
        "POST",
        "/v1/endpoints",
        &admin,
        r#"{"source":"default","auth_type":"hmac-sha256","auth_secret":"s3cret","auth_header":"X-Event-Kind","auth_prefix":""}"#,
    )
    .await;
    assert_eq!(reg.status, 201, "{:?}", reg.body);
    let path = reg.json()["path"].as_str().unwrap().to_string();
    let signature = hmac_hex(b"s3cret", b"signed");
    let a = request(d.http, "POST", &path, &[("x-event-kind", &signature)], "signed").await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let a = request(d.http, "POST", "/v1/sources/default", &[("x-event-kind", "push")], "named").await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert!(d.stop().success());

    let log = read_log(&dir.path().join("data/wal"));
    let payloads: Vec<&[u8]> = log.iter().map(|(_, e)| &e.payload[..]).collect();
    assert_eq!(payloads, [&b"signed"[..], &b"named"[..]]);
    assert_eq!(log[0].1.header.headers, [], "the signature was forwarded");
    assert_eq!(log[1].1.header.headers, [("x-event-kind".to_string(), b"push".to_vec())]);
}

/// Sends `request` on a new connection, shuts the connection's sending side, and reads
/// until the daemon closes it: what a client such as `nc -N` sees.
async fn sent_then_half_closed(addr: std::net::SocketAddr, request: String) -> String {
    tokio::task::spawn_blocking(move || {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(30))).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut answer = Vec::new();
        s.read_to_end(&mut answer).unwrap();
        String::from_utf8_lossy(&answer).into_owned()
    })
    .await
    .unwrap()
}

/// A client that shuts its sending side once its request is sent is still reading: it
/// gets its 200 (HTTP/1.1 and 1.0, with a delivery id and without), as many as the log
/// took, where the request used to be dropped on that end of input while its append
/// ran, its events appended and no answer sent. One that shuts it between requests is
/// closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_half_closes_after_its_request_gets_its_200() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    for n in 0..6u64 {
        let version = if n % 2 == 0 { "HTTP/1.1" } else { "HTTP/1.0" };
        let key = if n % 3 == 0 { format!("idempotency-key: half-closed-{n}\r\n") } else { String::new() };
        let body = format!("{{\"n\":{n}}}");
        let request = format!(
            "POST /v1/sources/default {version}\r\nhost: x\r\ncontent-type: application/json\r\n{key}content-length: {}\r\n\r\n{body}",
            body.len()
        );
        let answer = sent_then_half_closed(d.http, request).await;
        assert!(answer.starts_with(&format!("{version} 200 OK")), "request {n}: {answer:?}");
        assert!(answer.ends_with(&format!("\"offsets\":[{n},{n}]}}")), "request {n}: {answer:?}");
    }
    let idle = sent_then_half_closed(d.http, String::new()).await;
    assert_eq!(idle, "", "an idle connection half-closed");
    assert!(d.stop().success());
    assert_eq!(read_log(&dir.path().join("data/wal")).len(), 6);
}

/// Sends `request` on `s` and reads one answer's head and its `content-length` body.
async fn one_answer(s: &mut tokio::net::TcpStream, request: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    while !got.ends_with(b"\r\n\r\n") {
        let read = tokio::time::timeout(std::time::Duration::from_secs(30), s.read(&mut byte)).await.unwrap().unwrap();
        assert_eq!(read, 1, "closed after {:?}", String::from_utf8_lossy(&got));
        got.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&got).to_ascii_lowercase();
    let len: usize =
        head.lines().find_map(|l| l.strip_prefix("content-length: ")).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).await.unwrap();
    head + &String::from_utf8_lossy(&body)
}

/// An answer given before the request's body was read to its end (a 401 its head
/// earns, an unknown source, a `Content-Length` over `max_body_bytes`) says
/// `Connection: close`, as the connection is closed after it: a client that pools
/// connections must not send its next request on it. One given after the body was read
/// (invalid JSON) leaves the connection open for the next request, as does an early
/// answer to a request without a body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_given_before_the_body_was_read_closes_the_connection_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let with_body = |path: &str, extra: &str, length: usize| {
        format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n{extra}content-length: {length}\r\n\r\n"
        )
    };
    let closing = [
        ("401 at the head", with_body("/v1/sources/internal", "authorization: Bearer wrong\r\n", 2), "401"),
        ("no such source", with_body("/v1/sources/nowhere", "", 2), "404"),
        ("too large", with_body("/v1/sources/default", "", 2 << 20), "413"),
        ("expired endpoint", with_body("/v1/e/fedcba9876543210fedcba9876543210", "", 2), "410"),
    ];
    for (what, head, status) in closing {
        let mut s = tokio::net::TcpStream::connect(d.http).await.unwrap();
        let answer = one_answer(&mut s, &head).await;
        assert!(answer.starts_with(&format!("http/1.1 {status}")), "{what}: {answer}");
        assert!(answer.contains("\r\nconnection: close\r\n"), "{what}: {answer}");
    }
    // Read to its end, or none declared: kept open, the next request answered on it.
    let mut s = tokio::net::TcpStream::connect(d.http).await.unwrap();
    let kept = [
        (format!("{}{{x", with_body("/v1/sources/jsononly", "", 2)), "400"),
        ("POST /v1/sources/nowhere HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n".to_string(), "404"),
        ("GET /v1/sources/default HTTP/1.1\r\nhost: x\r\n\r\n".to_string(), "405"),
        (format!("{}{{}}", with_body("/v1/sources/default", "", 2)), "200"),
    ];
    for (request, status) in kept {
        let answer = one_answer(&mut s, &request).await;
        assert!(answer.starts_with(&format!("http/1.1 {status}")), "{answer}");
        assert!(!answer.contains("connection: close"), "{answer}");
    }
    assert!(d.stop().success());
}

/// A body in a content coding (`Content-Encoding: gzip`) or a transfer coding besides
/// chunked is refused before it is read (415, 501), where its bytes were stored as if
/// they were what the `Content-Type` says; `identity` is no coding. A `Content-Type`
/// given twice is refused as a signature header given twice is; a blank one is none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_in_a_coding_and_doubled_content_types_are_refused_and_append_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let post = |extra: &str, body: &str| {
        format!("POST /v1/sources/default HTTP/1.1\r\nhost: x\r\n{extra}content-length: {}\r\n\r\n{body}", body.len())
    };
    let refused = [
        (post("content-type: application/json\r\ncontent-encoding: gzip\r\n", "{}"), "415", "unsupported_content_encoding"),
        (post("content-encoding: identity, br\r\n", "{}"), "415", "unsupported_content_encoding"),
        (
            "POST /v1/sources/default HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
                .to_string(),
            "501",
            "unsupported_transfer_coding",
        ),
        (post("content-type: application/json\r\ncontent-type: text/plain\r\n", "{}"), "400", "invalid_content_type"),
    ];
    for (request, status, code) in refused {
        let mut s = tokio::net::TcpStream::connect(d.http).await.unwrap();
        let answer = one_answer(&mut s, &request).await;
        assert!(answer.starts_with(&format!("http/1.1 {status}")), "{request:?}: {answer}");
        assert!(answer.contains(&format!("\"error\":\"{code}\"")), "{request:?}: {answer}");
    }
    let mut s = tokio::net::TcpStream::connect(d.http).await.unwrap();
    for request in [
        post("content-type: application/json\r\ncontent-encoding: identity\r\n", "{}"),
        post("content-type: \r\n", "blank"),
    ] {
        let answer = one_answer(&mut s, &request).await;
        assert!(answer.starts_with("http/1.1 200"), "{request:?}: {answer}");
    }
    assert!(d.stop().success());
    let log = read_log(&dir.path().join("data/wal"));
    let stored: Vec<(&[u8], Option<&str>)> =
        log.iter().map(|(_, e)| (&e.payload[..], e.header.content_type.as_deref())).collect();
    assert_eq!(stored, [(&b"{}"[..], Some("application/json")), (&b"blank"[..], None)]);
}

/// An HTTP/1.1 request without a `Host`, any request with two, and one whose `Host` is
/// no host are refused 400 `invalid_host` by both listeners before any route runs
/// (RFC 9112, section 3.2): nothing appended, no credential checked, the webhook
/// listener's refusals counted. An HTTP/1.0 request without one, and an empty one, are
/// served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_one_good_host_is_refused_by_both_listeners_and_appends_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let post = |version: &str, hosts: &str| {
        format!(
            "POST /v1/sources/default {version}\r\n{hosts}content-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
        )
    };
    let refused = [
        post("HTTP/1.1", ""),
        post("HTTP/1.1", "host: a.example\r\nhost: b.example\r\n"),
        post("HTTP/1.0", "host: a.example\r\nhost: a.example\r\n"),
        post("HTTP/1.1", "host: user@a.example\r\n"),
        post("HTTP/1.1", "host: a.example:port\r\n"),
        // Refused before its route: an unknown source, a path of no route (the
        // fallback) and a GET handshake alike.
        "POST /v1/sources/nowhere HTTP/1.1\r\ncontent-length: 0\r\n\r\n".to_string(),
        "POST /nowhere HTTP/1.1\r\ncontent-length: 0\r\n\r\n".to_string(),
        "GET /v1/e/fedcba9876543210fedcba9876543210?challenge=x HTTP/1.1\r\n\r\n".to_string(),
    ];
    for request in &refused {
        let mut s = tokio::net::TcpStream::connect(d.http).await.unwrap();
        let answer = one_answer(&mut s, request).await;
        assert!(answer.split_once(' ').is_some_and(|(_, rest)| rest.starts_with("400")), "{request:?}: {answer}");
        assert!(answer.contains("\"error\":\"invalid_host\""), "{request:?}: {answer}");
    }
    // The admin listener: refused before its token is asked for.
    let mut s = tokio::net::TcpStream::connect(d.admin).await.unwrap();
    let answer = one_answer(&mut s, "GET /status HTTP/1.1\r\n\r\n").await;
    assert!(answer.starts_with("http/1.1 400") && answer.contains("\"error\":\"invalid_host\""), "{answer}");
    let mut s = tokio::net::TcpStream::connect(d.http).await.unwrap();
    for request in [post("HTTP/1.1", "host: \r\n"), post("HTTP/1.1", "host: [::1]:8080\r\n")] {
        let answer = one_answer(&mut s, &request).await;
        assert!(answer.starts_with("http/1.1 200"), "{request:?}: {answer}");
    }
    let answer = sent_then_half_closed(d.http, post("HTTP/1.0", "")).await;
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    let m = String::from_utf8_lossy(&request(d.admin, "GET", "/metrics", &[], "").await.body).to_string();
    let counted = format!(r#"iggy_ingest_http_rejected_total{{source="-",reason="invalid_host"}} {}"#, refused.len());
    assert!(m.contains(&counted), "{counted} not in {m}");
    assert!(d.stop().success());
    assert_eq!(read_log(&dir.path().join("data/wal")).len(), 3, "only the three served requests were appended");
}
