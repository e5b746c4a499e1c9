//! The daemon's life: dynamic endpoints across restarts, requests in flight across a
//! revoke or rotate, graceful shutdown, a full log answering 503 and recovering, and a
//! state database of another schema version.

mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use iggy_ingest::{config, daemon};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SOURCES: &str = r#"
[sources.default]
destination = { stream = "ingest", topic = "events" }

[[sources.default.endpoints]]
id = "0123456789abcdef0123456789abcdef"
auth_type = "none"
"#;

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_endpoints_register_rotate_revoke_and_survive_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path(), "", SOURCES);
    let mgmt = bearer(MANAGEMENT_TOKEN);
    let auth = [("authorization", mgmt.as_str()), ("content-type", "application/json")];

    // The management token is required.
    let a = request(d.admin, "POST", "/v1/endpoints", &[], r#"{"source":"default"}"#).await;
    assert_eq!(a.status, 401);
    let a =
        request(d.admin, "POST", "/v1/endpoints", &[("authorization", "Bearer wrong-token-wrong-token")], "{}").await;
    assert_eq!(a.status, 401);
    let a = request(d.admin, "POST", "/v1/endpoints", &auth, r#"{"source":"nope","auth_type":"bearer"}"#).await;
    assert_eq!(a.status, 400);

    let reg = request(d.admin, "POST", "/v1/endpoints", &auth, r#"{"source":"default","auth_type":"bearer"}"#).await;
    assert_eq!(reg.status, 201, "{:?}", reg.body);
    let reg = reg.json();
    let id = reg["id"].as_str().unwrap().to_string();
    let path = format!("/v1/e/{id}");
    assert_eq!(reg["path"], path);
    let secret1 = reg["secret"].as_str().unwrap().to_string();
    let s1 = bearer(&secret1);
    assert_eq!(request(d.http, "POST", &path, &[("authorization", &s1)], "e1").await.status, 200);
    assert_eq!(request(d.http, "POST", &path, &[("authorization", "Bearer nope")], "e1").await.status, 401);

    // Rotate: the old secret stops working at once.
    let rot = request(d.admin, "POST", &format!("/v1/endpoints/{id}/rotate"), &auth, "").await;
    assert_eq!(rot.status, 200);
    let secret2 = rot.json()["secret"].as_str().unwrap().to_string();
    assert_ne!(secret1, secret2);
    let s2 = bearer(&secret2);
    assert_eq!(request(d.http, "POST", &path, &[("authorization", &s1)], "e2").await.status, 401);
    assert_eq!(request(d.http, "POST", &path, &[("authorization", &s2)], "e2").await.status, 200);
    // Static endpoints are changed in the file, not here.
    let a = request(d.admin, "POST", "/v1/endpoints/0123456789abcdef0123456789abcdef/rotate", &auth, "").await;
    assert_eq!(a.status, 409);

    // Rotation survives a crash: it was committed before the answer.
    d.kill9();
    let d = Daemon::restart(dir.path());
    assert_eq!(request(d.http, "POST", &path, &[("authorization", &s1)], "e3").await.status, 401);
    assert_eq!(request(d.http, "POST", &path, &[("authorization", &s2)], "e3").await.status, 200);
    let list = request(d.admin, "GET", "/v1/endpoints", &auth, "").await;
    let text = String::from_utf8_lossy(&list.body).to_string();
    assert!(text.contains(&id) && !text.contains(&secret2) && !text.contains("secret"), "{text}");

    // Revoke: 404 from then on, also after a crash.
    assert_eq!(request(d.admin, "DELETE", &format!("/v1/endpoints/{id}"), &auth, "").await.status, 200);
    assert_eq!(request(d.http, "POST", &path, &[("authorization", &s2)], "e4").await.status, 404);
    assert_eq!(request(d.admin, "POST", &format!("/v1/endpoints/{id}/rotate"), &auth, "").await.status, 404);
    let mut d = d;
    d.kill9();
    let d = Daemon::restart(dir.path());
    assert_eq!(request(d.http, "POST", &path, &[("authorization", &s2)], "e5").await.status, 404);
    let list = request(d.admin, "GET", "/v1/endpoints", &auth, "").await.json();
    let listed = list["endpoints"].as_array().unwrap().iter().find(|e| e["id"] == id.as_str()).unwrap().clone();
    assert_eq!(listed["state"], "revoked");
    assert!(d.stop().success());
    assert_eq!(log_len(&dir.path().join("data/wal")), 3);
}

/// A registration retried under its `Idempotency-Key` (its answer lost, the daemon
/// killed meanwhile) is answered with the endpoint the first call made, secret and all,
/// marked `Idempotent-Replayed`, and makes no second endpoint; the key with another
/// request is 409; a key that is not 1 to 255 visible characters is 400 naming the
/// header; a revoked endpoint's retry shows it revoked, without its secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_retried_under_its_idempotency_key_after_kill_9_makes_no_second_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(dir.path(), "", SOURCES);
    let mgmt = bearer(MANAGEMENT_TOKEN);
    let keyed = |key: &'static str| {
        [("authorization", mgmt.clone()), ("content-type", "application/json".into()), ("idempotency-key", key.into())]
    };
    let register = |admin, key: &'static str, body: &'static str| {
        let headers = keyed(key);
        async move {
            let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            request(admin, "POST", "/v1/endpoints", &headers, body).await
        }
    };
    let body = r#"{"source":"default","auth_type":"bearer"}"#;
    let dynamic = |list: serde_json::Value| {
        list["endpoints"].as_array().unwrap().iter().filter(|e| e["id"] != "0123456789abcdef0123456789abcdef").count()
    };
    let auth = [("authorization", mgmt.as_str())];

    let first = register(d.admin, "setup-github-1", body).await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.header("idempotent-replayed"), None);
    let first = first.json();
    let (id, secret) = (first["id"].as_str().unwrap().to_string(), first["secret"].as_str().unwrap().to_string());

    d.kill9();
    let d = Daemon::restart(dir.path());
    let retry = register(d.admin, "setup-github-1", body).await;
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.json()["id"], id.as_str());
    assert_eq!(retry.json()["secret"], secret.as_str(), "the retry's answer carries the secret that works");
    let path = format!("/v1/e/{id}");
    let s = bearer(&secret);
    assert_eq!(request(d.http, "POST", &path, &[("authorization", s.as_str())], "e1").await.status, 200);
    assert_eq!(dynamic(request(d.admin, "GET", "/v1/endpoints", &auth, "").await.json()), 1);

    // The key with another request: refused, nothing made.
    let other = register(d.admin, "setup-github-1", r#"{"source":"default","auth_type":"hmac-sha256"}"#).await;
    assert_eq!(other.status, 409, "{:?}", other.body);
    assert_eq!(other.json()["error"], "idempotency_key_reused");
    // Keys that are not 1 to 255 visible ASCII characters: 400 naming the header.
    let long: &'static str = Box::leak("k".repeat(256).into_boxed_str());
    for bad in ["two words", long] {
        let a = register(d.admin, bad, body).await;
        assert_eq!(a.status, 400, "{bad:?}: {:?}", a.body);
        assert!(a.json()["message"].as_str().unwrap().starts_with("Idempotency-Key"), "{:?}", a.body);
    }
    assert_eq!(dynamic(request(d.admin, "GET", "/v1/endpoints", &auth, "").await.json()), 1, "a refused call made one");

    // Revoked since: the retry shows it so, and no secret.
    assert_eq!(request(d.admin, "DELETE", &format!("/v1/endpoints/{id}"), &auth, "").await.status, 200);
    let retry = register(d.admin, "setup-github-1", body).await;
    assert_eq!(retry.status, 201);
    let retry = retry.json();
    assert_eq!((retry["id"].as_str(), retry["secret"].as_str()), (Some(id.as_str()), None), "{retry}");
    assert!(retry["revoked_at_unix_ms"].is_u64(), "{retry}");
    // Another key registers another endpoint.
    assert_eq!(register(d.admin, "setup-github-2", body).await.status, 201);
    assert_eq!(dynamic(request(d.admin, "GET", "/v1/endpoints", &auth, "").await.json()), 2);
    assert!(d.stop().success());
}

/// An endpoint without auth (`auth_type = "none"`, asked for explicitly) has nothing to
/// rotate: its id is its only secret. A rotate
/// that answered a secret would let an operator believe a leaked URL was shut, and a
/// secret given at registration would never be checked; both are refused. A revoked id
/// written into the configuration file as a static endpoint refuses the start instead
/// of coming back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_without_auth_has_no_secret_to_set_or_rotate_and_its_revoked_id_never_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let mgmt = bearer(MANAGEMENT_TOKEN);
    let auth = [("authorization", mgmt.as_str()), ("content-type", "application/json")];

    // The scheme is never implied: a registration without one is refused.
    let a = request(d.admin, "POST", "/v1/endpoints", &auth, r#"{"source":"default"}"#).await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    let j = a.json();
    assert_eq!(j["error"], "invalid_json", "{j}");
    assert!(j["message"].as_str().unwrap().contains("auth_type"), "{j}");

    let a = request(
        d.admin,
        "POST",
        "/v1/endpoints",
        &auth,
        r#"{"source":"default","auth_type":"none","auth_secret":"abc"}"#,
    )
    .await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    let j = a.json();
    assert_eq!(j["error"], "invalid_request", "{j}");
    assert!(j["message"].as_str().unwrap().contains("auth_secret: is not used by auth_type = \"none\""), "{j}");
    // Named by the request's fields, as the configuration names its keys.
    for (body, field) in [
        (r#"{"source":"default","auth_type":"digest"}"#, "auth_type: "),
        (
            r#"{"source":"default","auth_type":"bearer","auth_header":"x-key","auth_tolerance_secs":60}"#,
            "auth_header: ",
        ),
    ] {
        let a = request(d.admin, "POST", "/v1/endpoints", &auth, body).await;
        assert_eq!(a.status, 400, "{:?}", a.body);
        let m = a.json()["message"].as_str().unwrap().to_string();
        assert!(m.contains(field), "{body}: {m}");
    }

    let reg = request(d.admin, "POST", "/v1/endpoints", &auth, r#"{"source":"default","auth_type":"none"}"#).await;
    assert_eq!(reg.status, 201, "{:?}", reg.body);
    let reg = reg.json();
    assert!(reg["secret"].is_null(), "{reg}");
    let id = reg["id"].as_str().unwrap().to_string();
    let path = format!("/v1/e/{id}");

    let rot = request(d.admin, "POST", &format!("/v1/endpoints/{id}/rotate"), &auth, "").await;
    assert_eq!(rot.status, 409, "{:?}", rot.body);
    let j = rot.json();
    assert_eq!(j["error"], "no_secret", "{j}");
    assert!(j.get("secret").is_none(), "{j}");
    let given = request(d.admin, "POST", &format!("/v1/endpoints/{id}/rotate"), &auth, r#"{"auth_secret":"x"}"#).await;
    assert_eq!(given.status, 409, "{:?}", given.body);
    // Nothing changed: the endpoint takes requests as before.
    assert_eq!(request(d.http, "POST", &path, &[], "e1").await.status, 200);

    assert_eq!(request(d.admin, "DELETE", &format!("/v1/endpoints/{id}"), &auth, "").await.status, 200);
    assert!(d.stop().success());

    // The revoked id as a static endpoint: the start is refused, naming the id's prefix.
    let text = config_text(
        dir.path(),
        "",
        &format!("{SOURCES}\n[[sources.default.endpoints]]\nid = \"{id}\"\nauth_type = \"none\"\n"),
    );
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, text).unwrap();
    let (code, err) = refused_start(&cfg);
    // 2: only an operator can end it (a supervisor restarting on failure would not).
    assert_eq!(code, Some(2));
    assert!(err.contains("was revoked") && err.contains(&id[..8]) && !err.contains(&id), "{err}");
    assert_eq!(log_len(&dir.path().join("data/wal")), 1);
}

/// Reads what the server sends on `s` until it closes or `wait` passes.
async fn answer_within(s: &mut tokio::net::TcpStream, wait: Duration) -> String {
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(wait, s.read_to_end(&mut buf)).await;
    String::from_utf8_lossy(&buf).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_management_body_sent_slowly_is_cut_off_and_one_without_the_token_is_never_read() {
    let dir = tempfile::tempdir().unwrap();
    // A body timeout well above how long a refusal takes on a busy machine, so that the
    // two cannot be mistaken for each other.
    let d = Daemon::start(dir.path(), "body_read_timeout_ms = 3000", SOURCES);
    let head = |token: &str| {
        format!(
            "POST /v1/endpoints HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"source\""
        )
    };
    // With the token: the body stalls after 10 bytes; 408 once the read timeout passed.
    let mut slow = tokio::net::TcpStream::connect(d.admin).await.unwrap();
    slow.write_all(head(MANAGEMENT_TOKEN).as_bytes()).await.unwrap();
    let started = Instant::now();
    let answer = answer_within(&mut slow, Duration::from_secs(20)).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("body_read_timeout"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(10), "cut off after {:?}", started.elapsed());
    // Without it: refused at once, the body never waited for.
    let mut refused = tokio::net::TcpStream::connect(d.admin).await.unwrap();
    refused.write_all(head("not-the-token-not-the-token").as_bytes()).await.unwrap();
    let started = Instant::now();
    let mut buf = vec![0u8; 12];
    tokio::time::timeout(Duration::from_secs(5), refused.read_exact(&mut buf))
        .await
        .expect("no answer before the body")
        .unwrap();
    assert_eq!(&buf, b"HTTP/1.1 401", "{:?}", String::from_utf8_lossy(&buf));
    assert!(started.elapsed() < Duration::from_millis(2000), "waited {:?}", started.elapsed());
    // Larger than a management call needs: 413 from Content-Length.
    let big = "x".repeat(70_000);
    let a = request(
        d.admin,
        "POST",
        "/v1/endpoints",
        &[("authorization", &bearer(MANAGEMENT_TOKEN)), ("content-type", "application/json")],
        big.clone(),
    )
    .await;
    assert_eq!(a.status, 413, "{:?}", String::from_utf8_lossy(&a.body));
    assert!(d.stop().success());
}

/// The body of every [`half_sent`] request.
const HALF_SENT_BODY: &[u8] = b"0123456789";

/// The header that signs [`HALF_SENT_BODY`] with `secret` for an `hmac-sha256` endpoint
/// (GitHub's header and prefix). A signature scheme, so that a request signed with a
/// secret the endpoint does not have is refused only once its body was read: what its
/// head holds is of the scheme's form whatever the secret.
fn signed_with(secret: &str) -> String {
    format!("x-hub-signature-256: sha256={}", hmac_hex(secret.as_bytes(), HALF_SENT_BODY))
}

/// Opens a connection and sends a request's head, with the header line `credential`,
/// and the first half of its 10-byte body ([`HALF_SENT_BODY`]): a request in flight, its
/// endpoint already looked up and its head authenticated, its body not yet read.
async fn half_sent(addr: std::net::SocketAddr, path: &str, credential: &str) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: x\r\n{credential}\r\nconnection: close\r\ncontent-length: 10\r\nexpect: 100-continue\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    // The daemon asks for the body only once it has checked the head (the endpoint was
    // active then) and starts reading the body: the request is in flight from here on.
    let mut interim = [0u8; 25];
    tokio::time::timeout(Duration::from_secs(30), s.read_exact(&mut interim)).await.unwrap().unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n", "{}", String::from_utf8_lossy(&interim));
    s.write_all(&HALF_SENT_BODY[..5]).await.unwrap();
    s
}

/// Sends the rest of a [`half_sent`] request's body and returns the status and JSON body
/// of the answer.
async fn finish(mut s: tokio::net::TcpStream) -> (u16, serde_json::Value) {
    s.write_all(&HALF_SENT_BODY[5..]).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut buf)).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&buf).to_string();
    let status = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("no status line: {text}"));
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
    (status, serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {text}")))
}

/// A daemon with one dynamic endpoint of `auth_type` on `default`: the daemon, its
/// directory, the management headers, and the registration's answer (`id`, `path`,
/// `secret`).
async fn daemon_with_an_endpoint(auth_type: &str) -> (Daemon, tempfile::TempDir, String, serde_json::Value) {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let mgmt = bearer(MANAGEMENT_TOKEN);
    let auth = [("authorization", mgmt.as_str()), ("content-type", "application/json")];
    let registration = format!(r#"{{"source":"default","auth_type":"{auth_type}"}}"#);
    let reg = request(d.admin, "POST", "/v1/endpoints", &auth, registration).await;
    assert_eq!(reg.status, 201, "{:?}", reg.body);
    (d, dir, mgmt, reg.json())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_across_a_revoke_is_refused_404_and_appends_nothing() {
    let (d, dir, mgmt, reg) = daemon_with_an_endpoint("hmac-sha256").await;
    let auth = [("authorization", mgmt.as_str()), ("content-type", "application/json")];
    let path = reg["path"].as_str().unwrap().to_string();
    let before = log_next_offset(d.admin).await;

    // The head arrives while the endpoint is active; the revoke answers while the body is
    // half sent (it does not wait for a body still being read). A request signed with a
    // wrong secret in flight across it gets the same 404 (it got 401 before).
    let in_flight = half_sent(d.http, &path, &signed_with(reg["secret"].as_str().unwrap())).await;
    let wrong_token = half_sent(d.http, &path, &signed_with("not-the-endpoint-secret-0123456789")).await;
    let id = reg["id"].as_str().unwrap();
    let revoked = request(d.admin, "DELETE", &format!("/v1/endpoints/{id}"), &auth, "").await;
    assert_eq!(revoked.status, 200);
    let (status, body) = finish(in_flight).await;
    assert_eq!((status, body["error"].as_str()), (404, Some("not_found")), "{body}");
    let (status, body) = finish(wrong_token).await;
    assert_eq!((status, body["error"].as_str()), (404, Some("not_found")), "{body}");
    assert_eq!(log_next_offset(d.admin).await, before, "a request of a revoked endpoint was appended");
    assert!(d.stop().success());
    assert_eq!(log_len(&dir.path().join("data/wal")), 0);
}

/// An endpoint that expires while a request's body is read answers 410 once the body
/// was read, as the contract says, also to a request whose credentials are wrong (it got
/// 401 before), and appends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_across_an_expiry_is_refused_410_whatever_its_credentials() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let mgmt = bearer(MANAGEMENT_TOKEN);
    let auth = [("authorization", mgmt.as_str()), ("content-type", "application/json")];
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
    // Far enough ahead for the registration and both heads on a busy machine.
    let expires_at = now_ms + 6000;
    let body = format!(r#"{{"source":"default","auth_type":"hmac-sha256","expires_at_unix_ms":{expires_at}}}"#);
    let reg = request(d.admin, "POST", "/v1/endpoints", &auth, body).await;
    assert_eq!(reg.status, 201, "{:?}", reg.body);
    let reg = reg.json();
    let path = reg["path"].as_str().unwrap().to_string();
    let before = log_next_offset(d.admin).await;

    // Both heads are taken while the endpoint is active (each got its 100 Continue).
    let right = half_sent(d.http, &path, &signed_with(reg["secret"].as_str().unwrap())).await;
    let wrong = half_sent(d.http, &path, &signed_with("not-the-endpoint-secret-0123456789")).await;
    let past = std::time::UNIX_EPOCH + Duration::from_millis(expires_at + 200);
    tokio::time::sleep(past.duration_since(std::time::SystemTime::now()).unwrap_or_default()).await;
    for in_flight in [right, wrong] {
        let (status, body) = finish(in_flight).await;
        assert_eq!((status, body["error"].as_str()), (410, Some("endpoint_expired")), "{body}");
    }
    assert_eq!(log_next_offset(d.admin).await, before, "a request of an expired endpoint was appended");
    assert!(d.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_in_flight_across_a_rotate_with_the_old_secret_is_refused_401_and_appends_nothing() {
    let (d, dir, mgmt, reg) = daemon_with_an_endpoint("hmac-sha256").await;
    let auth = [("authorization", mgmt.as_str()), ("content-type", "application/json")];
    let path = reg["path"].as_str().unwrap().to_string();
    let old = signed_with(reg["secret"].as_str().unwrap());
    let before = log_next_offset(d.admin).await;

    // Two requests whose heads arrive before the rotate: one with the old secret, one
    // with the secret the rotate is about to set. Each is authenticated against the
    // record current once its body was read.
    let new_secret = "the-secret-the-rotate-sets-0123456789";
    let with_old_secret = half_sent(d.http, &path, &old).await;
    let with_new_secret = half_sent(d.http, &path, &signed_with(new_secret)).await;
    let id = reg["id"].as_str().unwrap();
    let rotate_body = format!(r#"{{"auth_secret":"{new_secret}"}}"#);
    let rotated = request(d.admin, "POST", &format!("/v1/endpoints/{id}/rotate"), &auth, rotate_body).await;
    assert_eq!(rotated.status, 200, "{:?}", rotated.body);
    let (status, body) = finish(with_old_secret).await;
    assert_eq!(
        (status, body),
        (401, serde_json::json!({"error": "unauthorized", "message": "authentication failed"})),
        "the old secret was accepted after the rotate answered"
    );
    assert_eq!(log_next_offset(d.admin).await, before, "a request with the old secret was appended");
    let (status, body) = finish(with_new_secret).await;
    assert_eq!((status, &body["offsets"]), (200, &serde_json::json!([before, before])), "{body}");
    assert!(d.stop().success());
    let log = read_log(&dir.path().join("data/wal"));
    assert_eq!(log.len(), 1);
    assert_eq!(&log[0].1.payload[..], b"0123456789");
}

/// Waits until `listener` counts `open` connections (`iggy_ingest_http_connections`), as
/// scraped from the admin listener at `admin`: a client's connection taken by the
/// daemon, which no fixed wait makes sure of on a busy machine.
async fn connections_counted(admin: std::net::SocketAddr, listener: &str, open: u32) {
    let want = format!("iggy_ingest_http_connections{{listener=\"{listener}\"}} {open}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = String::from_utf8(request(admin, "GET", "/metrics", &[], "").await.body.to_vec()).unwrap();
        if metrics.lines().any(|l| l == want) {
            return;
        }
        assert!(Instant::now() < deadline, "never counted: {want}: {metrics}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_health_first_finishes_in_flight_and_closes_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let text = config_text_with_shutdown(dir.path(), "", "drain_delay_ms = 3000", SOURCES);
    let mut d = Daemon::start_text(dir.path(), &text);

    // A request in flight: head sent, half the body.
    let mut inflight = tokio::net::TcpStream::connect(d.http).await.unwrap();
    inflight
        .write_all(b"POST /v1/sources/default HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n01234")
        .await
        .unwrap();
    let mut keepalive = Conn::open(d.http).await.unwrap();
    assert_eq!(keepalive.send("GET", "/health", &[], "").await.unwrap().status, 200);
    // Both connections taken by the daemon before the stop (a fixed wait could lose
    // that race on a busy machine, and the request would arrive after the drain).
    connections_counted(d.admin, "webhook", 2).await;

    d.signal(libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let h = keepalive.send("GET", "/health", &[], "").await.unwrap();
        if h.status == 503 {
            assert_eq!(h.json()["status"], "draining");
            break;
        }
        assert!(Instant::now() < deadline, "health never went 503");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Health said draining, so a load balancer sends new traffic elsewhere; what still
    // arrives during the drain delay is served, not refused.
    let served = keepalive.send("POST", "/v1/sources/default", &[], "during the drain").await.unwrap();
    assert_eq!(served.status, 200, "a request during the drain delay: {:?}", served.json());
    assert_eq!(served.json(), serde_json::json!({"accepted": 1, "offsets": [0, 0]}));

    // The in-flight request completes with a 200.
    inflight.write_all(b"56789").await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), inflight.read_to_end(&mut buf)).await.unwrap().unwrap();
    let answer = String::from_utf8_lossy(&buf).to_string();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#"{"accepted":1,"offsets":[1,1]}"#), "{answer}");

    let status = d.wait_exit(Duration::from_secs(60));
    assert!(status.success(), "{status}");
    assert!(dir.path().join("data/wal").join(wal::CLEAN_MARKER_FILE).exists(), "clean-shutdown marker");
    assert!(!dir.path().join("ready.json").exists(), "the ready file of a stopped daemon");
    let log = read_log(&dir.path().join("data/wal"));
    assert_eq!(log.len(), 2);
    assert_eq!(&log[0].1.payload[..], b"during the drain");
    assert_eq!(&log[1].1.payload[..], b"0123456789");
}

/// A send to a server that never answers (where Iggy should be) does not hold the exit past the grace
/// period: the drain ends within it, the log is closed cleanly and holds the event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grace_period_bounds_the_drain_while_a_send_to_a_silent_server_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let (iggy, accepted) = silent_server();
    let rest = format!("[iggy]\naddress = \"{iggy}\"\n\n[router]\n{SILENT_ROUTER}\n{SOURCES}");
    let text = config_text(dir.path(), "", &rest).replace("grace_period_ms = 20000", "grace_period_ms = 1000");
    let mut d = Daemon::start_text(dir.path(), &text);
    assert_eq!(post_json(d.http, "/v1/sources/default", "{}").await.status, 200);
    a_call_is_out(&accepted).await;
    let signalled = Instant::now();
    d.signal(libc::SIGTERM);
    let status = d.wait_exit(Duration::from_secs(30));
    let took = signalled.elapsed();
    assert!(status.success(), "{status}");
    // At most the grace period (1 s) and the router's least stop time (1 s), with room
    // for a busy machine; without the bound it waited out the 25 s result timeout.
    assert!(took < Duration::from_secs(15), "the drain took {took:?} with a grace period of 1 s");
    assert!(dir.path().join("data/wal").join(wal::CLEAN_MARKER_FILE).exists(), "clean-shutdown marker");
    assert_eq!(log_len(&dir.path().join("data/wal")), 1, "the event stays in the log, to be sent after a restart");
}

/// While the router stops (a send to a silent server holds it for the grace period),
/// `/status` and the destinations say what is happening, `stopping` and what each
/// destination holds, not `stopped` and nothing while the gauges say otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_router_stops_the_status_says_stopping_and_lists_the_destinations() {
    let dir = tempfile::tempdir().unwrap();
    let (iggy, accepted) = silent_server();
    let rest = format!("[iggy]\naddress = \"{iggy}\"\n\n[router]\n{SILENT_ROUTER}\n{SOURCES}");
    let text = config_text_with_shutdown(dir.path(), "", "drain_delay_ms = 0", &rest)
        .replace("grace_period_ms = 20000", "grace_period_ms = 10000");
    let mut d = Daemon::start_text(dir.path(), &text);
    assert_eq!(post_json(d.http, "/v1/sources/default", "{}").await.status, 200);
    // The destination holds the event before the stop begins.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let lanes = request(d.admin, "GET", "/connectors/default/destinations", &[], "").await.json();
        if lanes["destinations"][0]["held_records"] == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the event was never held: {lanes}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    a_call_is_out(&accepted).await;
    d.signal(libc::SIGTERM);
    // Within the grace period (10 s), which the send to the silent server takes whole.
    let deadline = Instant::now() + Duration::from_secs(8);
    let (router, destinations) = loop {
        let status = request(d.admin, "GET", "/status", &[], "").await.json();
        if status["router"]["status"] != "running" && status["router"]["status"] != "degraded" {
            let lanes = request(d.admin, "GET", "/connectors/default/destinations", &[], "").await.json();
            break (status["router"].clone(), lanes);
        }
        assert!(Instant::now() < deadline, "the router never left running: {status}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(router["status"], "stopping", "{router}");
    let lanes = destinations["destinations"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        lanes.len(),
        1,
        "the destination holding the event is not listed while the router stops: {destinations}"
    );
    assert_eq!(lanes[0]["held_records"], 1, "{destinations}");
    let status = d.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_cuts_the_drain_short() {
    let dir = tempfile::tempdir().unwrap();
    let text = config_text_with_shutdown(dir.path(), "", "drain_delay_ms = 60000", SOURCES);
    let mut d = Daemon::start_text(dir.path(), &text);
    assert_eq!(post_json(d.http, "/v1/sources/default", "{}").await.status, 200);
    d.signal(libc::SIGTERM);
    // Draining (the drain delay would hold it for a minute)...
    let deadline = Instant::now() + Duration::from_secs(10);
    while request(d.http, "GET", "/health", &[], "").await.status != 503 {
        assert!(Instant::now() < deadline, "health never went 503");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ...until a second signal.
    d.signal(libc::SIGINT);
    let status = d.wait_exit(Duration::from_secs(30));
    assert_eq!(status.code(), Some(130));
    assert_eq!(log_len(&dir.path().join("data/wal")), 1, "what was acknowledged is in the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_log_answers_503_appends_nothing_and_recovers_after_release() {
    let dir = tempfile::tempdir().unwrap();
    // No router: the test releases by hand, and an Iggy server that happens to listen on
    // the default address must not drain the log behind its back.
    let rest = format!(
        "[wal]\nsegment_max_bytes = 65536\nmax_bytes = 131072\nrecord_max_bytes = 16384\n\n[router]\nenabled = false\n{SOURCES}"
    );
    let text = config_text(dir.path(), "max_body_bytes = 8192", &rest);
    let cfg = config::parse(&text, None).unwrap();
    let settings = config::validate(&cfg, Some(&text), None).unwrap();
    let running = daemon::start(settings, None).await.unwrap();
    let h = running.http_addr;
    let event = format!("{{\"pad\":\"{}\"}}", "x".repeat(4000));

    let mut accepted = 0u64;
    let full = loop {
        let a = post_json(h, "/v1/sources/default", &event).await;
        if a.status != 200 {
            break a;
        }
        accepted += 1;
        assert!(accepted < 1000, "the log never filled");
    };
    assert_eq!(full.status, 503);
    assert_eq!(full.json()["error"], "log_full");
    assert_eq!(full.header("retry-after"), Some("5"));
    let wal = running.shared.wal.clone();
    assert_eq!(wal.next_offset(), accepted, "a 503 appended nothing");
    assert_eq!(post_json(h, "/v1/sources/default", &event).await.status, 503, "still full");
    assert_eq!(request(h, "GET", "/health", &[], "").await.status, 200, "full is not unhealthy");
    let admin = running.admin_addr;
    let status = request(admin, "GET", "/status", &[], "").await.json();
    assert_eq!(
        (status["state"].as_str(), status["log"]["full"].as_bool()),
        (Some("accepting"), Some(true)),
        "{status}"
    );

    // What the router does once every destination acknowledged: release.
    let released = wal.release_below(wal.next_offset()).await.unwrap();
    assert!(released.segments_deleted >= 1, "{released:?}");
    let status = request(admin, "GET", "/status", &[], "").await.json();
    assert_eq!(status["log"]["full"].as_bool(), Some(false), "space was freed: {status}");
    let a = post_json(h, "/v1/sources/default", &event).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.json()["offsets"], serde_json::json!([accepted, accepted]));

    running.shutdown();
    assert!(running.wait().await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_stopped_taking_appends_turns_health_503() {
    let dir = tempfile::tempdir().unwrap();
    let text = config_text(dir.path(), "", SOURCES);
    let settings = config::validate(&config::parse(&text, None).unwrap(), Some(&text), None).unwrap();
    let running = daemon::start(settings, None).await.unwrap();
    assert_eq!(post_json(running.http_addr, "/v1/sources/default", "{}").await.status, 200);
    assert_eq!(request(running.admin_addr, "GET", "/health", &[], "").await.status, 200);
    // What a storage failure the log cannot undo looks like from outside: no appends.
    running.shared.wal.close().await.unwrap();
    // Health says so before any request has failed (the failure may be a background
    // sync's, with no request in flight).
    for addr in [running.http_addr, running.admin_addr] {
        let h = request(addr, "GET", "/health", &[], "").await;
        assert_eq!((h.status, h.json()["status"].as_str()), (503, Some("log_stopped")), "before any request");
    }
    let a = post_json(running.http_addr, "/v1/sources/default", "{}").await;
    assert_eq!(a.status, 503);
    assert_eq!(a.json()["error"], "log_unavailable");
    for addr in [running.http_addr, running.admin_addr] {
        let h = request(addr, "GET", "/health", &[], "").await;
        assert_eq!((h.status, h.json()["status"].as_str()), (503, Some("log_stopped")));
    }
    running.shutdown();
    running.wait().await;
}

/// When the log cannot create its next segment (here: a directory sits where the new
/// segment's temporary file must go, which no permission can override), no event can be
/// taken: health says so on both listeners, every request gets 503 `log_unavailable`, and
/// once the cause is gone health turns 200 again by itself, with no request to prompt it
/// (a load balancer that stopped sending waits on exactly that), and events are taken at
/// the next offset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_cannot_create_its_next_segment_turns_health_503_until_it_can() {
    let dir = tempfile::tempdir().unwrap();
    let rest = format!(
        "[wal]\nsegment_max_bytes = 65536\nmax_bytes = 1048576\nrecord_max_bytes = 16384\n\n[router]\nenabled = false\n{SOURCES}"
    );
    let text = config_text(dir.path(), "max_body_bytes = 8192", &rest);
    let settings = config::validate(&config::parse(&text, None).unwrap(), Some(&text), None).unwrap();
    let running = daemon::start(settings, None).await.unwrap();
    let (h, admin) = (running.http_addr, running.admin_addr);
    let log_dir = dir.path().join("data/wal");
    // Every segment the test can reach, after the first.
    let blockers: Vec<_> = (1..=64).map(|base| log_dir.join(format!("{base:020}.seg.tmp"))).collect();
    for b in &blockers {
        std::fs::create_dir(b).unwrap();
    }
    let event = format!("{{\"pad\":\"{}\"}}", "x".repeat(4000));
    let mut accepted = 0u64;
    let refused = loop {
        let a = post_json(h, "/v1/sources/default", &event).await;
        if a.status != 200 {
            break a;
        }
        accepted += 1;
        assert!(accepted < 64, "the log never rotated");
    };
    assert_eq!((refused.status, refused.json()["error"].as_str()), (503, Some("log_unavailable")));
    for addr in [h, admin] {
        let health = request(addr, "GET", "/health", &[], "").await;
        assert_eq!((health.status, health.json()["status"].as_str()), (503, Some("log_unavailable")));
    }
    assert_eq!(post_json(h, "/v1/sources/default", &event).await.status, 503, "still no segment");
    for b in &blockers {
        std::fs::remove_dir(b).unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut health = request(admin, "GET", "/health", &[], "").await;
    while health.status != 200 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        health = request(admin, "GET", "/health", &[], "").await;
    }
    assert_eq!((health.status, health.json()["status"].as_str()), (200, Some("accepting")));
    let a = post_json(h, "/v1/sources/default", &event).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.json()["offsets"], serde_json::json!([accepted, accepted]), "a 503 took no offset");
    running.shutdown();
    assert!(running.wait().await.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_are_capped_and_idle_ones_are_closed() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "max_connections = 2\nheader_read_timeout_ms = 3000", SOURCES);
    let mut c1 = Conn::open(d.http).await.unwrap();
    let mut c2 = Conn::open(d.http).await.unwrap();
    // Neither slot can free before 3 s after this moment (the idle timeout starts
    // after each connection's last answer).
    let started = Instant::now();
    assert_eq!(c1.send("GET", "/health", &[], "").await.unwrap().status, 200);
    assert_eq!(c2.send("GET", "/health", &[], "").await.unwrap().status, 200);
    // A third connection waits: both slots are held by idle keep-alive connections...
    let mut c3 = Conn::open(d.http).await.unwrap();
    let third = tokio::time::timeout(Duration::from_secs(30), c3.send("GET", "/health", &[], "")).await;
    // ...until the idle timeout closes them and frees a slot.
    assert_eq!(third.expect("the third connection was never served").unwrap().status, 200);
    assert!(
        started.elapsed() >= Duration::from_millis(2500),
        "served before a slot was freed: {:?}",
        started.elapsed()
    );
    // Both idle connections time out at about the same moment; give the later one time.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(c1.send("GET", "/health", &[], "").await.is_err(), "idle connection 1 was closed");
    assert!(c2.send("GET", "/health", &[], "").await.is_err(), "idle connection 2 was closed");
    assert!(d.stop().success());
}

/// A state database beside another log than the one its offsets name (another daemon's
/// moved in, or the log deleted and begun again) refuses the start, exit 2, naming the
/// way out, before it uses or changes any of them: started, a retry of a delivery the old
/// log held was answered 200 "already accepted" with offsets that hold other events in
/// the other log, and its cursors would pass over records never sent. Its own log put
/// back, it answers that retry as before. `state forget-log --yes` (a dry run first,
/// which changes nothing) lets it take the other log: the retry is appended, not
/// answered with the other log's record at its old offset, and dynamic endpoints are
/// kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_database_beside_another_log_refuses_to_start_until_it_forgets_its_log() {
    async fn keyed(http: std::net::SocketAddr, key: &str, body: &str) -> Answer {
        let headers = [("content-type", "application/json"), ("idempotency-key", key)];
        request(http, "POST", "/v1/sources/default", &headers, body.to_string()).await
    }
    let replayed = |a: &Answer| a.headers.get("idempotent-replayed").is_some();
    let (d, dir, _, reg) = daemon_with_an_endpoint("bearer").await;
    let (path, token) = (reg["path"].as_str().unwrap().to_string(), bearer(reg["secret"].as_str().unwrap()));
    for (key, body) in [("d1", "{\"old\":1}"), ("d2", "{\"old\":2}")] {
        assert_eq!(keyed(d.http, key, body).await.status, 200);
    }
    assert!(d.stop().success());
    let data = dir.path().join("data");
    let (wal, own, others) = (data.join("wal"), dir.path().join("wal.own"), dir.path().join("wal.other"));
    let cfg = dir.path().join("config.toml");

    // Another daemon's log of three records, moved in: refused.
    let other = tempfile::tempdir().unwrap();
    let o = Daemon::start(other.path(), "", SOURCES);
    for n in 0..3 {
        assert_eq!(post_json(o.http, "/v1/sources/default", &format!("{{\"other\":{n}}}")).await.status, 200);
    }
    assert!(o.stop().success());
    std::fs::rename(other.path().join("data").join("wal"), &others).unwrap();
    std::fs::rename(&wal, &own).unwrap();
    std::fs::rename(&others, &wal).unwrap();
    let (code, err) = refused_start(&cfg);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("is not the log the state database") && err.contains("state forget-log"), "{err}");

    // Its own log back: nothing was used or changed, the retry is answered as before.
    std::fs::rename(&wal, &others).unwrap();
    std::fs::rename(&own, &wal).unwrap();
    let d = Daemon::restart(dir.path());
    let retry = keyed(d.http, "d2", "{\"old\":2}").await;
    assert_eq!((retry.status, replayed(&retry)), (200, true), "{:?}", retry.body);
    assert_eq!(retry.json()["offsets"], serde_json::json!([1, 1]));
    assert!(d.stop().success());

    // Its log deleted and begun again: refused too.
    std::fs::remove_dir_all(&wal).unwrap();
    let (code, err) = refused_start(&cfg);
    assert_eq!(code, Some(2), "a log begun again was taken for the old one: {err}");
    assert!(err.contains("deleted and begun again"), "{err}");

    // Told to take the other log.
    std::fs::remove_dir_all(&wal).unwrap();
    std::fs::rename(&others, &wal).unwrap();
    let cli = |args: &[&str]| data_dir_cli(&data, args);
    let shows_identity =
        || String::from_utf8_lossy(&cli(&["state", "show"]).stdout).contains("holds offsets of the log of identity");
    assert!(shows_identity(), "state show does not say which log the state names");
    let dry = cli(&["state", "forget-log"]);
    assert!(dry.status.success(), "{}", String::from_utf8_lossy(&dry.stderr));
    assert!(String::from_utf8_lossy(&dry.stdout).contains("nothing changed"));
    assert_eq!(refused_start(&cfg).0, Some(2), "a dry run let the state take the log");
    let forgot = cli(&["state", "forget-log", "--yes"]);
    assert!(forgot.status.success(), "{}", String::from_utf8_lossy(&forgot.stderr));
    let said = String::from_utf8_lossy(&forgot.stdout).to_string();
    assert!(said.contains("2 delivery ids"), "{said}");
    assert!(!shows_identity(), "the identity was not forgotten");

    let d = Daemon::restart(dir.path());
    // The other log's offset 1 holds its record: the retry must not be answered with it.
    let retry = keyed(d.http, "d2", "{\"old\":2}").await;
    assert_eq!((retry.status, replayed(&retry)), (200, false), "{:?}", retry.body);
    assert_eq!(retry.json()["offsets"], serde_json::json!([3, 3]), "the retry was not appended after the log's three");
    let endpoint = request(d.http, "POST", &path, &[("authorization", token.as_str())], "{}").await;
    assert_eq!(endpoint.status, 200, "the dynamic endpoint was not kept: {:?}", endpoint.body);
    assert!(d.stop().success());
    // Taken: the next start finds the log it now names.
    let d = Daemon::restart(dir.path());
    assert!(d.stop().success());

    // Its identity damaged on the disk: the log is given a new one (the damaged one kept
    // aside), and the start refuses, saying so.
    let id_file = wal.join(wal::identity::LOG_ID_FILE);
    let mut bytes = std::fs::read(&id_file).unwrap();
    bytes[10] ^= 0x40;
    std::fs::write(&id_file, &bytes).unwrap();
    let (code, err) = refused_start(&cfg);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("its identity was damaged"), "{err}");
    assert_eq!(std::fs::read(wal.join(wal::identity::LOG_ID_DAMAGED_FILE)).unwrap(), bytes);
}

/// A state database that is gone (moved aside, deleted, lost) beside a log written
/// before is not replaced by an empty one: the start is refused, exit 2, naming the
/// way back and the way out, and changes nothing. Created empty, every record in the log
/// would go to Iggy again and every dynamic endpoint answer 404, with nothing said.
/// `state reset --yes` says an empty one is wanted; the next start creates it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_state_database_beside_a_written_log_refuses_to_start_until_reset() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    assert_eq!(post_json(d.http, "/v1/sources/default", "{}").await.status, 200);
    assert!(d.stop().success());
    let data = dir.path().join("data");
    std::fs::rename(data.join("state.redb"), dir.path().join("state.redb.aside")).unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, config_text(dir.path(), "", SOURCES)).unwrap();
    let start = || refused_start(&cfg);
    let (code, err) = start();
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("there is no state database at") && err.contains("state reset"), "{err}");
    assert!(!data.join("state.redb").exists(), "an empty database was created");

    let cli = |args: &[&str]| data_dir_cli(&data, args);
    let dry = cli(&["state", "reset"]);
    assert!(dry.status.success(), "{}", String::from_utf8_lossy(&dry.stderr));
    assert!(String::from_utf8_lossy(&dry.stdout).contains("nothing changed"));
    assert_eq!(start().0, Some(2), "a dry run let the start create an empty database");
    let reset = cli(&["state", "reset", "--yes"]);
    assert!(reset.status.success(), "{}", String::from_utf8_lossy(&reset.stderr));
    let d = Daemon::start(dir.path(), "", SOURCES);
    assert!(d.stop().success());
    assert!(data.join("state.redb").exists());
    assert!(!ingest::state::reset_marker(&data.join("state.redb")).exists(), "the reset's marker was left");
    // Gone again, the start refuses again: the marker served one start.
    std::fs::remove_file(data.join("state.redb")).unwrap();
    assert_eq!(start().0, Some(2));
}

/// A ready file that cannot be written where `--ready-file` says (a missing directory,
/// a directory) is refused before anything is opened, with exit 2 naming the flag: found
/// once the daemon had started, it stopped it with exit 1, restarted for ever.
#[test]
fn a_ready_file_that_cannot_be_written_is_refused_before_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, config_text(dir.path(), "", SOURCES)).unwrap();
    for ready in [dir.path().join("missing/ready.json"), dir.path().to_path_buf()] {
        let out = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(["run", "--config"])
            .arg(&cfg)
            .arg("--ready-file")
            .arg(&ready)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{}: {err}", ready.display());
        assert!(err.contains("--ready-file"), "{err}");
        assert!(!dir.path().join("data").exists(), "the refused start made its data directory");
    }
}

/// A log damaged in what was durable refuses the start with exit 2, naming the damage:
/// every restart would meet it again, until an operator salvages the log.
#[test]
fn a_damaged_log_refuses_to_start_with_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    assert!(d.stop().success());
    // Five records after the daemon's clean stop, then a byte of the first one flipped:
    // damage with checked records after it, not a torn tail.
    let wal_dir = dir.path().join("data/wal");
    let wal = wal::Wal::open(&wal_dir, wal::WalOptions::default()).unwrap();
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
        for i in 0..5u8 {
            wal.append(vec![bytes::Bytes::from(vec![i; 64])]).await.unwrap();
        }
        wal.close().await.unwrap();
    });
    let first = wal_dir.join("00000000000000000000.seg");
    let mut damaged = std::fs::read(&first).unwrap();
    damaged[32 + 32 + 5] ^= 0x40;
    std::fs::write(&first, &damaged).unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, config_text(dir.path(), "", SOURCES)).unwrap();
    let (code, err) = refused_start(&cfg);
    assert_eq!(code, Some(2), "a refusal only an operator can end: {err}");
    assert!(err.contains("corrupt record"), "{err}");
    assert!(err.contains("wal salvage"), "no way forward named: {err}");
}

/// `iggy-ingest ARGS --data-dir DATA` run to its end (a `state` command).
fn data_dir_cli(data: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_iggy-ingest")).args(args).arg("--data-dir").arg(data).output().unwrap()
}

/// Wherever a command takes a file (a configuration, a CA file, the state database,
/// `--state`), something that is not a regular file is refused at once, exit 2, naming
/// what it is, and nothing is changed: a FIFO blocked the command (and a start) until a
/// writer came, `/dev/zero` filled memory, and `state reset --yes` on a directory said it
/// had done its work, leaving a start that failed with exit 1 for ever.
#[test]
fn a_path_that_is_not_a_regular_file_is_refused_at_once_wherever_a_file_is_named() {
    use std::ffi::OsStr;
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, config_text(dir.path(), "", SOURCES)).unwrap();
    let with_ca = dir.path().join("with-ca.toml");
    let iggy_tls = format!("{SOURCES}\n[iggy]\ntls = true\ntls_domain = \"localhost\"\ntls_ca_file = {fifo:?}\n");
    std::fs::write(&with_ca, config_text(dir.path(), "", &iggy_tls)).unwrap();
    for (args, what) in [
        (vec![OsStr::new("config"), OsStr::new("check"), fifo.as_os_str()], "a FIFO"),
        (vec![OsStr::new("config"), OsStr::new("check"), OsStr::new("/dev/zero")], "a device"),
        (vec![OsStr::new("run"), OsStr::new("--config"), fifo.as_os_str()], "a FIFO"),
        (vec![OsStr::new("config"), OsStr::new("check"), with_ca.as_os_str()], "a FIFO"),
    ] {
        let (code, err) = ends_with(&args, "did not end");
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(what), "{args:?}: {err}");
    }

    // A data directory whose state database is a FIFO, then a directory, beside its log.
    let d = Daemon::start(dir.path(), "", SOURCES);
    assert!(d.stop().success());
    let data = dir.path().join("data");
    let state = data.join("state.redb");
    std::fs::rename(&state, dir.path().join("state.redb.aside")).unwrap();
    assert!(Command::new("mkfifo").arg(&state).status().unwrap().success());
    let (code, err) = ends_with(&[OsStr::new("run"), OsStr::new("--config"), cfg.as_os_str()], "did not end");
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("is not a regular file (a FIFO)") && err.contains("move"), "{err}");
    let (code, err) = ends_with(
        &[
            OsStr::new("wal"),
            OsStr::new("inspect"),
            data.join("wal").as_os_str(),
            OsStr::new("--state"),
            state.as_os_str(),
        ],
        "did not end",
    );
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("a FIFO"), "{err}");
    std::fs::remove_file(&state).unwrap();
    std::fs::create_dir(&state).unwrap();
    for command in ["show", "migrate", "reset"] {
        let mut args = vec![OsStr::new("state"), OsStr::new(command), OsStr::new("--data-dir"), data.as_os_str()];
        if command == "reset" {
            args.push(OsStr::new("--yes"));
        }
        let (code, err) = ends_with(&args, "did not end");
        assert_eq!(code, Some(2), "state {command}: {err}");
        assert!(err.contains("is a directory, not a state database") && err.contains("nothing was changed"), "{err}");
    }
    assert!(state.is_dir(), "the directory was touched");
    let names: Vec<String> =
        std::fs::read_dir(&data).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.contains("reset")), "a reset left its marker: {names:?}");
}

#[test]
fn a_state_database_of_another_schema_version_refuses_to_start_until_reset() {
    let dir = tempfile::tempdir().unwrap();
    // A log and a state database a clean stop left, the database then of another version.
    let d = Daemon::start(dir.path(), "", SOURCES);
    assert!(d.stop().success());
    ingest::StateDb::open(dir.path().join("data/state.redb")).unwrap().force_schema_version(7).unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, config_text(dir.path(), "", SOURCES)).unwrap();
    let (code, err) = refused_start(&cfg);
    assert_eq!(code, Some(2), "a refusal only an operator can end");
    assert!(err.contains("schema version 7") && err.contains(&format!("expects {}", ingest::SCHEMA_VERSION)), "{err}");
    assert!(!err.contains("state migrate"), "no step leads from version 7: {err}");
    // The refused start opened the log (removing its clean-shutdown marker) and closed it
    // again: it is as the clean stop left it.
    let log = wal::Wal::open(dir.path().join("data/wal"), wal::WalOptions::default()).unwrap();
    assert!(log.open_report().clean_shutdown, "a refused start left the log not cleanly shut down");
    drop(log);

    // The explicit way out: show, a dry-run reset that changes nothing, then the reset.
    let data = dir.path().join("data");
    let cli = |args: &[&str]| data_dir_cli(&data, args);
    let show = cli(&["state", "show"]);
    assert!(show.status.success());
    assert!(String::from_utf8_lossy(&show.stdout).contains("schema version 7"));
    let dry = cli(&["state", "reset"]);
    assert!(String::from_utf8_lossy(&dry.stdout).contains("nothing changed"));
    assert!(data.join("state.redb").exists());
    let reset = cli(&["state", "reset", "--yes"]);
    assert!(reset.status.success(), "{}", String::from_utf8_lossy(&reset.stderr));
    assert!(String::from_utf8_lossy(&reset.stdout).contains("endpoints: 0 entries"));
    // Once gone, naming it is a command-line error (2) and reports where it looked.
    let gone = cli(&["state", "show"]);
    assert_eq!(gone.status.code(), Some(2), "{}", String::from_utf8_lossy(&gone.stderr));
    assert!(String::from_utf8_lossy(&gone.stderr).contains("no state database at"));
    let d = Daemon::start(dir.path(), "", SOURCES);
    assert!(d.stop().success());
}

/// `state show` and a reset's preview of a database another process holds (a running
/// daemon) say so and whom to stop, exit 1, where they printed redb's "Database already
/// open. Cannot acquire lock."
#[test]
fn reading_a_state_database_another_process_holds_says_to_stop_it() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let held = ingest::StateDb::open(data.join("state.redb")).unwrap();
    for args in [&["state", "show"][..], &["state", "reset"][..]] {
        let out = data_dir_cli(&data, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("held by another process") && err.contains("stop it first"), "{args:?}: {err}");
    }
    drop(held);
    assert!(data_dir_cli(&data, &["state", "show"]).status.success());
}

/// `state reset --yes` and `state migrate` take the daemon's lock (its log's) before
/// they change the database. redb's lock on the database alone leaves two windows: a
/// running daemon lets go of it while it reopens the database after an I/O error, and a
/// daemon starting beside a reset can create a new database in place of the one being
/// deleted. Here the log is held, the database closed: what a daemon in either window
/// looks like. Both commands refuse, changing nothing; once the log is free they work.
#[test]
fn state_commands_that_change_the_database_refuse_while_a_daemon_holds_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    ingest::StateDb::open(data.join("state.redb")).unwrap().force_schema_version(1).unwrap();
    let before = std::fs::read(data.join("state.redb")).unwrap();
    let cli = |args: &[&str]| data_dir_cli(&data, args);
    let held = wal::Wal::open(data.join("wal"), wal::WalOptions::default()).unwrap();
    for args in [&["state", "reset", "--yes"][..], &["state", "migrate"][..], &["state", "forget-log", "--yes"][..]] {
        let out = cli(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", String::from_utf8_lossy(&out.stdout));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("a daemon runs on") && err.contains("nothing was changed"), "{args:?}: {err}");
        assert_eq!(std::fs::read(data.join("state.redb")).unwrap(), before, "{args:?} changed the database");
    }
    // Reading changes nothing, and needs no lock.
    assert!(cli(&["state", "show"]).status.success());
    drop(held);
    let migrated = cli(&["state", "migrate"]);
    assert!(migrated.status.success(), "{}", String::from_utf8_lossy(&migrated.stderr));
    let forgot = cli(&["state", "forget-log", "--yes"]);
    assert!(forgot.status.success(), "{}", String::from_utf8_lossy(&forgot.stderr));
    let reset = cli(&["state", "reset", "--yes"]);
    assert!(reset.status.success(), "{}", String::from_utf8_lossy(&reset.stderr));
    assert!(!data.join("state.redb").exists());

    // Where the command has to make the log's directory to lock it, what it makes is the
    // data directory owner's (the daemon's user), not the caller's.
    if unsafe { libc::geteuid() } != 0 {
        skip_or_fail(
            "state_commands_that_change_the_database_refuse_while_a_daemon_holds_the_log",
            "not root: the ownership of what the lock makes is not checked",
        );
        return;
    }
    use std::os::unix::fs::MetadataExt;
    std::fs::remove_dir_all(data.join("wal")).unwrap();
    ingest::StateDb::open(data.join("state.redb")).unwrap();
    std::os::unix::fs::chown(&data, Some(54321), Some(54322)).unwrap();
    let reset = cli(&["state", "reset", "--yes"]);
    assert!(reset.status.success(), "{}", String::from_utf8_lossy(&reset.stderr));
    for made in [data.join("wal"), data.join("wal").join(wal::LOCK_FILE)] {
        let m = std::fs::metadata(&made).unwrap();
        assert_eq!((m.uid(), m.gid()), (54321, 54322), "{}", made.display());
    }
}

/// A database of an older schema version refuses to start and names the way forward;
/// `state migrate` moves it, saying what it discards, and the daemon starts on it, its
/// endpoints kept. Migrating again changes nothing; no database is a command-line error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_database_of_an_older_schema_version_is_migrated_explicitly_and_keeps_its_endpoints() {
    let (d, dir, _, reg) = daemon_with_an_endpoint("bearer").await;
    let (path, secret) = (reg["path"].as_str().unwrap().to_string(), bearer(reg["secret"].as_str().unwrap()));
    assert!(d.stop().success());
    let data = dir.path().join("data");
    ingest::StateDb::open(data.join("state.redb")).unwrap().force_schema_version(1).unwrap();

    let cfg = dir.path().join("config.toml");
    let (code, err) = refused_start(&cfg);
    assert_eq!(code, Some(2), "a refusal only an operator can end");
    let migrate = format!("state migrate --data-dir {}", data.display());
    assert!(err.contains("schema version 1") && err.contains(&migrate), "{err}");

    let cli = |args: &[&str]| data_dir_cli(&data, args);
    let migrated = cli(&["state", "migrate"]);
    assert!(migrated.status.success(), "{}", String::from_utf8_lossy(&migrated.stderr));
    let said = String::from_utf8_lossy(&migrated.stdout);
    assert!(said.contains(&format!("migrated from schema version 1 to {}", ingest::SCHEMA_VERSION)), "{said}");
    assert!(said.contains("discarded:"), "{said}");
    let again = cli(&["state", "migrate"]);
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stdout).contains("nothing to migrate"));

    let d = Daemon::restart(dir.path());
    let event = request(d.http, "POST", &path, &[("authorization", &secret)], "{}").await;
    assert_eq!(event.status, 200, "the endpoint registered before the migration: {:?}", event.body);
    assert!(d.stop().success());
    let nothing = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["state", "migrate", "--data-dir"])
        .arg(dir.path().join("elsewhere"))
        .output()
        .unwrap();
    assert_eq!(nothing.status.code(), Some(2));
}

#[test]
fn config_check_names_the_key_path_and_line_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[sources.github]\ndestination = { stream = \"s\", topic = \"t\" }\n\n[[sources.github.endpoints]]\nid = \"000102030405060708090a0b0c0d0e0f\"\nauth_type = \"hmac-sha256\"\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_iggy-ingest")).args(["config", "check"]).arg(&bad).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("line 4: sources.github.endpoints[0].auth_secret: required when auth_type = \"hmac-sha256\""),
        "{err}"
    );
    let ok = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["config", "check", concat!(env!("CARGO_MANIFEST_DIR"), "/../../config/example.toml")])
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert_eq!(String::from_utf8_lossy(&ok.stderr), "", "the example warns");

    // Valid but not deliverable with the daemon's defaults: a warning, exit 0.
    let odd = dir.path().join("odd.toml");
    std::fs::write(&odd, "[sources.a]\ndestination = { stream = \"s\", topic = \"t\", partition_id = 1 }\n").unwrap();
    let warned = Command::new(env!("CARGO_BIN_EXE_iggy-ingest")).args(["config", "check"]).arg(&odd).output().unwrap();
    assert!(warned.status.success(), "{}", String::from_utf8_lossy(&warned.stderr));
    assert!(String::from_utf8_lossy(&warned.stdout).ends_with(": ok (1 source(s), 0 static endpoint(s))\n"));
    let err = String::from_utf8_lossy(&warned.stderr);
    assert!(
        err.contains("warning: line 2: sources.a.destination.partition_id: partition 1 is not in a topic"),
        "{err}"
    );
}

/// A stop signal that comes while the daemon is still starting (here: re-reading a long
/// log for delivery ids, before it is ready) is a clean stop once the start is done, not
/// the signal's default action: a process killed by it leaves no clean-shutdown marker,
/// and a service manager sees a death, not a stop. It does not wait out
/// `shutdown.drain_delay_ms`: no load balancer ever saw it ready.
#[test]
fn a_stop_signal_during_the_start_is_a_clean_stop() {
    let dir = tempfile::tempdir().unwrap();
    let (mut d, wal_dir) = a_daemon_in_a_long_start(dir.path());
    d.signal(libc::SIGTERM);
    let signalled = Instant::now();
    let (status, ready_seen) = wait_exit_watching(&mut d, &dir.path().join("ready.json"));
    assert!(!ready_seen, "a daemon asked to stop wrote its ready file");
    assert!(status.success(), "a stop signal during the start: {status}");
    // Without waiting out the drain delay (40 s here): no load balancer saw it ready.
    let took = signalled.elapsed();
    assert!(took < Duration::from_secs(30), "the stop took {took:?}: the drain delay was waited out");
    assert!(wal_dir.join(wal::CLEAN_MARKER_FILE).exists(), "no clean-shutdown marker");
    // It stopped as soon as it had started, and was never said to be ready (watched
    // while it ran: a stopping daemon removes its ready file).
    assert!(!ready_seen, "a daemon asked to stop wrote its ready file");
}

/// Waits up to a minute for `d` to exit, looking for `ready` meanwhile: the exit status,
/// and whether the file was ever there.
fn wait_exit_watching(d: &mut Daemon, ready: &std::path::Path) -> (std::process::ExitStatus, bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = false;
    loop {
        seen |= ready.exists();
        if let Some(s) = d.child.try_wait().unwrap() {
            return (s, seen);
        }
        assert!(Instant::now() < deadline, "the daemon did not exit");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A second stop signal during a long start exits at once (130), as during a drain,
/// instead of waiting for the start to finish: nothing was answered yet.
#[test]
fn a_second_stop_signal_during_the_start_exits_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (mut d, _) = a_daemon_in_a_long_start(dir.path());
    d.signal(libc::SIGTERM);
    std::thread::sleep(Duration::from_millis(50));
    let second = Instant::now();
    // Of the other kind: two of one kind sent before the daemon looked are one to it
    // (a signal's delivery merges repeats), and on a loaded machine 50 ms may be that.
    d.signal(libc::SIGINT);
    let (status, ready_seen) = wait_exit_watching(&mut d, &dir.path().join("ready.json"));
    let took = second.elapsed();
    assert_eq!(status.code(), Some(130), "{status}");
    assert!(!ready_seen, "the start went on to the end");
    // At once, not once the start's blocking work (the log re-read) is done.
    assert!(took < Duration::from_secs(2), "the exit took {took:?} after the second signal");
}

/// A daemon spawned on a long log with no state database, caught while its start
/// re-reads the log (after its signal handlers are installed, before it is ready).
fn a_daemon_in_a_long_start(root: &std::path::Path) -> (Daemon, std::path::PathBuf) {
    let dir = root;
    // A long log and an empty state database (no checkpoint): the start re-reads all of
    // it.
    let wal_dir = dir.join("data/wal");
    let wal = wal::Wal::open(&wal_dir, wal::WalOptions::default()).unwrap();
    let record = |i: u64| {
        let header = ingest::EnvelopeHeader {
            message_id: u128::from(i) + 1,
            received_at_unix_ms: 1_700_000_000_000,
            source_key: "default".into(),
            endpoint_id: None,
            content_type: None,
            metadata: vec![],
            headers: vec![],
            idempotency_key: None,
            batch_index: 0,
            batch_len: 1,
            destination: ingest::Destination {
                stream: "ingest".into(),
                topic: "events".into(),
                partitioning: ingest::Partitioning::Balanced,
            },
        };
        ingest::Envelope::encode(&header, b"{}")
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        for batch in 0..1000u64 {
            wal.append((0..1000).map(|i| record(batch * 1000 + i)).collect()).await.unwrap();
        }
        wal.close().await.unwrap();
    });
    drop(wal);
    drop(ingest::StateDb::open(dir.join("data/state.redb")).unwrap());
    let cfg = dir.join("config.toml");
    // A long drain delay: a stop asked for during the start skips it.
    std::fs::write(&cfg, config_text_with_shutdown(dir, "", "drain_delay_ms = 40000", SOURCES)).unwrap();
    let d = Daemon::spawn(dir, &cfg);
    // The log's open takes the clean-shutdown marker away, after the daemon installed
    // its signal handlers and before it is ready (the rest of the start reads the log).
    let marker = wal_dir.join(wal::CLEAN_MARKER_FILE);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while marker.exists() {
        assert!(std::time::Instant::now() < deadline, "the daemon never opened the log");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(!dir.join("ready.json").exists(), "the daemon was ready before the signal: the test needs a longer log");
    (d, wal_dir)
}

/// A server where Iggy should be that takes connections and never answers a byte.
/// Also counts the connections it took.
fn silent_server() -> (std::net::SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = accepted.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in silent.incoming().map_while(Result::ok) {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(conn);
        }
    });
    (addr, accepted)
}

/// The `[router]` keys of the tests against `silent_server`: pre-warming off, so that
/// the first connection the server accepts is a lane's own call (a stop waits for a
/// call in flight, and starts none), and a result timeout longer than any grace period.
const SILENT_ROUTER: &str = "result_timeout_ms = 25000\nprewarm_timeout_ms = 0";

/// Waits until a lane has a call out to `silent_server` (it took a connection: with
/// pre-warming off, see [`SILENT_ROUTER`], only a lane's call connects).
async fn a_call_is_out(accepted: &std::sync::atomic::AtomicUsize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while accepted.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the router never called the silent server");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A ready file an earlier run left (killed before it could remove it) is removed at
/// start, before anything else: a supervisor waiting for it never reads the old run's
/// ports and pid as this run's. One whose process still runs (a second start beside a
/// running daemon) is left alone. Here the start then fails (its listen address is
/// taken), so no new ready file is written either.
#[test]
fn a_ready_file_left_by_an_earlier_run_is_removed_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let text = config_text(dir.path(), "", SOURCES).replacen(
        "listen = \"127.0.0.1:0\"",
        &format!("listen = \"{}\"", taken.local_addr().unwrap()),
        1,
    );
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, text).unwrap();
    let ready = dir.path().join("ready.json");
    let start = || {
        Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(["run", "--config"])
            .arg(&cfg)
            .arg("--ready-file")
            .arg(&ready)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap()
    };
    // Written by a process that is gone: removed.
    let mut gone = Command::new("true").spawn().unwrap();
    let gone_pid = gone.id();
    gone.wait().unwrap();
    std::fs::write(&ready, format!(r#"{{"http":"127.0.0.1:1","admin":"127.0.0.1:2","pid":{gone_pid}}}"#)).unwrap();
    assert!(!start().success(), "the start did not fail on the taken address");
    assert!(!ready.exists(), "the earlier run's ready file is still there");
    // The address is bound before anything else is opened: the log was not (opening it
    // would have marked it as not cleanly shut down, on every restart of a supervisor
    // waiting for the port).
    assert!(!dir.path().join("data").exists(), "the start opened the log before it found its port taken");
    // Written by a process that runs another program (a pid reused since): removed.
    let other = format!(r#"{{"http":"127.0.0.1:1","admin":"127.0.0.1:2","pid":{}}}"#, std::process::id());
    std::fs::write(&ready, &other).unwrap();
    assert!(!start().success());
    assert!(!ready.exists(), "a ready file of another program's pid was kept");
    // Written by a daemon that runs (one this start finds holding the log): left alone.
    let mut live = Daemon::start(dir.path(), "", SOURCES);
    let theirs = std::fs::read_to_string(dir.path().join("ready.json")).unwrap();
    // `start` runs the configuration the live daemon wrote, with its ready file.
    assert!(!start().success(), "a second daemon started on a held log");
    assert_eq!(std::fs::read_to_string(&ready).unwrap(), theirs, "the live daemon's ready file was removed");
    live.kill9();
}

/// What `--ready-file` names is only ever a ready file: a path that holds anything else
/// (a file given by mistake, a FIFO) is refused before the start, exit 2, and left as
/// it was, where the start removed it as a stale ready file (or blocked reading the
/// FIFO). A running daemon's ready file is left alone also after its executable was
/// replaced on disk (an upgrade in place), which made it look like another program's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ready_file_path_holding_anything_else_is_refused_and_a_replaced_daemons_is_kept() {
    use std::ffi::OsStr;
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, config_text(dir.path(), "", SOURCES)).unwrap();
    let start = |bin: &std::path::Path, ready: &std::path::Path| {
        let mut run = Command::new(bin);
        run.args(["run", "--config"]).arg(&cfg).arg("--ready-file").arg(ready);
        run.stdout(Stdio::null()).stderr(Stdio::piped());
        run
    };
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_iggy-ingest"));
    let important = dir.path().join("important.json");
    std::fs::write(&important, r#"{"not":"ready"}"#).unwrap();
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo").arg(&fifo).status().unwrap();
    assert!(made.success());
    for path in [&important, &fifo] {
        let args =
            [OsStr::new("run"), OsStr::new("--config"), cfg.as_os_str(), OsStr::new("--ready-file"), path.as_os_str()];
        let (code, err) = ends_with(&args, "did not end");
        assert_eq!(code, Some(2), "{}: {err}", path.display());
        assert!(err.contains("--ready-file") && err.contains("not a ready file"), "{err}");
    }
    assert_eq!(std::fs::read_to_string(&important).unwrap(), r#"{"not":"ready"}"#);
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&std::fs::symlink_metadata(&fifo).unwrap().file_type()));
    assert!(!dir.path().join("data").exists(), "a refused start made its data directory");

    // A daemon run from a copy of the program, the copy then replaced.
    let copy = dir.path().join("bin/iggy-ingest");
    std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
    std::fs::copy(bin, &copy).unwrap();
    let ready = dir.path().join("ready.json");
    let mut live = start(&copy, &ready).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "the daemon did not get ready");
        assert!(live.try_wait().unwrap().is_none(), "the daemon ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let theirs = std::fs::read_to_string(&ready).unwrap();
    std::fs::remove_file(&copy).unwrap();
    std::fs::copy(bin, &copy).unwrap();
    let second = start(&copy, &ready).output().unwrap();
    assert!(!second.status.success(), "a second daemon started on a held log");
    assert_eq!(std::fs::read_to_string(&ready).unwrap(), theirs, "the live daemon's ready file was removed");
    // SAFETY: kill(2) with the pid of our own child process.
    assert_eq!(unsafe { libc::kill(live.id() as i32, libc::SIGTERM) }, 0);
    assert!(live.wait().unwrap().success());
}

/// The daemon's soft and hard open-file limits, from `/proc/PID/limits`.
fn open_file_limits(pid: u32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let numbers: Vec<u64> = line.split_whitespace().filter_map(|w| w.parse().ok()).collect();
    (numbers[0], numbers[1])
}

/// Starts the daemon on `text` with its open-file limits set to `soft` and `hard` before
/// it runs, its log (at info level) in `root/daemon.log`.
fn start_with_open_file_limits(root: &std::path::Path, text: &str, soft: u64, hard: u64) -> Daemon {
    use std::os::unix::process::CommandExt;
    let cfg = root.join("config.toml");
    std::fs::write(&cfg, text.replace("level = \"error\"", "level = \"info\"")).unwrap();
    let log = std::fs::File::create(root.join("daemon.log")).unwrap();
    let _ = std::fs::remove_file(root.join("ready.json"));
    let mut command = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"));
    command
        .arg("run")
        .arg("--config")
        .arg(&cfg)
        .arg("--ready-file")
        .arg(root.join("ready.json"))
        .stdout(Stdio::null())
        .stderr(Stdio::from(log));
    // SAFETY: setrlimit is async-signal-safe, and the closure touches nothing else.
    unsafe {
        command.pre_exec(move || {
            let lim = libc::rlimit { rlim_cur: soft, rlim_max: hard };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = command.spawn().unwrap();
    Daemon { child, http: "127.0.0.1:1".parse().unwrap(), admin: "127.0.0.1:1".parse().unwrap(), root: root.into() }
        .ready()
}

/// Many systems start a service with a soft open-file limit of 1024, which the default
/// `http.max_connections` alone would fill, and then the log could not rotate either.
/// The daemon raises its soft limit to what its configuration may open, within the hard
/// limit; when even the hard limit is short it still starts and says so, naming
/// `http.max_connections`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_raises_its_open_file_limit_and_warns_when_the_hard_limit_is_short() {
    let (_, hard) = open_file_limits(std::process::id());
    let dir = tempfile::tempdir().unwrap();
    let text = config_text(dir.path(), "max_connections = 1024", SOURCES);
    let settings = config::validate(&config::parse(&text, None).unwrap(), Some(&text), None).unwrap();
    let needed = iggy_ingest::open_files::files_needed(&settings);
    assert!(needed > 1024, "{needed}");

    // Room under the hard limit: the soft limit is raised to the need.
    if hard >= needed {
        let d = start_with_open_file_limits(dir.path(), &text, 256, hard);
        assert_eq!(open_file_limits(d.child.id()), (needed, hard));
        let a = post_json(d.http, "/v1/sources/default", "{\"n\":1}").await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        assert!(d.stop().success());
        let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
        assert!(!log.contains("http.max_connections"), "a warning with room to spare: {log}");
    } else {
        eprintln!("hard open-file limit {hard} is below {needed}: only the short case runs");
    }

    // A hard limit below the need: raised to it, and a warning that names the setting.
    let short = 700;
    let d = start_with_open_file_limits(dir.path(), &text, 256, short);
    assert_eq!(open_file_limits(d.child.id()), (short, short));
    assert!(d.stop().success());
    let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
    let warning = log.lines().find(|l| l.contains("open-file limit is below")).unwrap_or_else(|| panic!("{log}"));
    assert!(warning.contains("http.max_connections") && warning.contains("WARN"), "{warning}");
    assert!(!log.contains('\u{1b}'), "terminal colours in a log written to a file: {warning:?}");
}

/// Out of file descriptors, a listener's accepts fail until one is free: each failure is
/// counted, the connection waits in the backlog, and the log says so at most once a
/// second (with how many lines it left out), where it wrote a line a retry, some 20 a
/// second, which clients can cause at will.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepts_failing_for_want_of_descriptors_are_counted_and_logged_at_most_once_a_second() {
    let dir = tempfile::tempdir().unwrap();
    let text = config_text(dir.path(), "", SOURCES);
    let limit = 128;
    let d = start_with_open_file_limits(dir.path(), &text, limit, limit);
    let open_now = std::fs::read_dir(format!("/proc/{}/fd", d.child.id())).unwrap().count() as u64;
    assert!(open_now + 8 < limit, "the daemon holds {open_now} descriptors at start");
    // More clients than the daemon has descriptors left: the kernel completes each
    // connection, and the daemon cannot accept the last ones.
    let clients: Vec<std::net::TcpStream> =
        (0..limit - open_now + 40).map(|_| std::net::TcpStream::connect(d.http).unwrap()).collect();
    let failing_from = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    drop(clients);
    let failing_for = failing_from.elapsed();

    // The closed clients give the descriptors back: the admin listener answers again.
    let deadline = Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        if let Ok(a) = tokio::time::timeout(Duration::from_secs(5), request(d.admin, "GET", "/metrics", &[], "")).await
        {
            break String::from_utf8(a.body.to_vec()).unwrap();
        }
        assert!(Instant::now() < deadline, "the admin listener did not answer once descriptors were free");
    };
    let failures: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("iggy_ingest_http_accept_failures_total{listener=\"webhook\"} "))
        .unwrap_or_else(|| panic!("no accept failure count: {metrics}"))
        .parse()
        .unwrap();
    assert!(failures >= 10.0, "{failures} failed accepts counted in {failing_for:?} out of descriptors");
    assert!(d.stop().success());

    let log = std::fs::read_to_string(dir.path().join("daemon.log")).unwrap();
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("accept failed")).collect();
    let most = failing_for.as_secs() + 2;
    assert!(!lines.is_empty() && lines.len() as u64 <= most, "{} lines in {failing_for:?}: {lines:#?}", lines.len());
    assert!(lines.iter().any(|l| l.contains("suppressed") && !l.contains("suppressed=0")), "{lines:#?}");
}

/// A client holding an admin connection open with a half-sent request (no token needed
/// for that) does not hold the exit past the grace period: the admin listener gets what
/// is left of it, as every other part of the drain does. Before, it had five seconds of
/// its own after the log was closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_admin_request_does_not_hold_the_exit_past_the_grace_period() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let text = config_text_with_shutdown(dir.path(), "", "drain_delay_ms = 0", SOURCES)
        .replace("grace_period_ms = 20000", "grace_period_ms = 1000");
    let mut d = Daemon::start_text(dir.path(), &text);
    let mut held = tokio::net::TcpStream::connect(d.admin).await.unwrap();
    held.write_all(b"GET /status HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    // The connection is open before the stop (the admin listener counts it).
    // (The scrape's own connection is the second.)
    connections_counted(d.admin, "admin", 2).await;
    let signalled = Instant::now();
    d.signal(libc::SIGTERM);
    let status = d.wait_exit(Duration::from_secs(30));
    let took = signalled.elapsed();
    assert!(status.success(), "{status}");
    // The grace period (1 s) and the router's least stop time (1 s), with room for a busy
    // machine (the log's close and the last commit, a sync each); the admin listener's
    // own five seconds came on top before, 7 s at least.
    assert!(took < Duration::from_millis(6500), "the stop took {took:?} with a grace period of 1 s");
    assert!(dir.path().join("data/wal").join(wal::CLEAN_MARKER_FILE).exists(), "clean-shutdown marker");
    drop(held);
}

/// A state database that is not one (damaged, or emptied) refuses the start, exit 2, with
/// the way out named; `state reset --yes` discards it though it cannot be read, saying what
/// that loses, and the daemon starts again on the log it kept.
#[test]
fn a_damaged_state_database_is_discarded_by_a_reset_and_the_daemon_starts_again() {
    for bytes in [&b""[..], &b"not a redb database, not at all: damaged bytes"[..]] {
        let dir = tempfile::tempdir().unwrap();
        let d = Daemon::start(dir.path(), "", SOURCES);
        assert!(d.stop().success());
        let data = dir.path().join("data");
        std::fs::write(data.join("state.redb"), bytes).unwrap();
        let cfg = dir.path().join("config.toml");
        std::fs::write(&cfg, config_text(dir.path(), "", SOURCES)).unwrap();
        let (code, err) = refused_start(&cfg);
        // A refusal only an operator can end: 2, which the unit keeps from restarting it
        // (`RestartPreventExitStatus=2`), where 1 restarted it into the same refusal.
        assert_eq!(code, Some(2), "{err}");
        let hint = format!("state reset --data-dir {} --yes", data.display());
        assert!(err.contains("cannot open state database") && err.contains(&hint), "{err}");
        assert!(err.contains("not a database this build can read"), "{err}");

        // Without --yes: what the reset would do, said as the reset will say it, and
        // nothing changed.
        let dry = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(["state", "reset", "--data-dir"])
            .arg(&data)
            .output()
            .unwrap();
        assert!(dry.status.success(), "{}", String::from_utf8_lossy(&dry.stderr));
        let said = String::from_utf8_lossy(&dry.stdout);
        assert!(said.contains("unreadable (") && said.contains("nothing changed: pass --yes"), "{said}");
        assert_eq!(std::fs::read(data.join("state.redb")).unwrap(), bytes, "a reset without --yes changed the file");

        let reset = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(["state", "reset", "--yes", "--data-dir"])
            .arg(&data)
            .output()
            .unwrap();
        assert!(reset.status.success(), "{}", String::from_utf8_lossy(&reset.stderr));
        let said = String::from_utf8_lossy(&reset.stdout);
        assert!(said.contains("unreadable (") && said.contains("whatever it held is discarded"), "{said}");
        assert!(!data.join("state.redb").exists());
        let d = Daemon::start(dir.path(), "", SOURCES);
        assert!(d.stop().success());
    }
}

/// Endpoints are listed a page at a time, by id: `limit` of them (1,000 unless asked),
/// after the id `after` names, with `next_after` naming the last one while more follow.
/// Walking the pages lists every endpoint once, static and dynamic; a query that does
/// not read is a 400 naming its parameter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_are_listed_a_page_at_a_time_by_id() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let mgmt = bearer(MANAGEMENT_TOKEN);
    let auth = [("authorization", mgmt.as_str()), ("content-type", "application/json")];
    for _ in 0..6 {
        let reg =
            request(d.admin, "POST", "/v1/endpoints", &auth, r#"{"source":"default","auth_type":"bearer"}"#).await;
        assert_eq!(reg.status, 201, "{:?}", reg.body);
    }
    let whole = request(d.admin, "GET", "/v1/endpoints", &auth, "").await.json();
    let ids = |page: &serde_json::Value| -> Vec<String> {
        page["endpoints"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap().to_string()).collect()
    };
    let all = ids(&whole);
    assert_eq!(all.len(), 7, "six registered and the static one: {whole}");
    assert!(all.windows(2).all(|w| w[0] < w[1]), "listed by id: {all:?}");
    assert_eq!(whole["next_after"], serde_json::Value::Null);

    let id = |e: &serde_json::Value| e["id"].as_str().unwrap().to_string();
    let walked = walk_pages(d.admin, &auth, "/v1/endpoints?limit=3", 3, "endpoints", id).await;
    assert_eq!(walked, all, "the pages list every endpoint once, in order");
    // After the last id: an empty last page.
    let tail = request(d.admin, "GET", &format!("/v1/endpoints?after={}", all[6]), &auth, "").await.json();
    assert_eq!((ids(&tail).len(), tail["next_after"].clone()), (0, serde_json::Value::Null));
    // A page of exactly what is left says nothing follows.
    let last = request(d.admin, "GET", &format!("/v1/endpoints?after={}&limit=2", all[4]), &auth, "").await.json();
    assert_eq!((ids(&last), last["next_after"].clone()), (all[5..].to_vec(), serde_json::Value::Null));

    for (query, named) in [
        ("limit=0", "limit"),
        ("limit=10001", "limit"),
        ("limit=ten", "limit"),
        ("limit=2&limit=3", "limit"),
        ("after=0123", "after"),
        ("after=", "after"),
        ("sort=id", "\"sort\""),
    ] {
        let a = request(d.admin, "GET", &format!("/v1/endpoints?{query}"), &auth, "").await;
        assert_eq!(a.status, 400, "{query}: {:?}", a.body);
        let body = a.json();
        assert_eq!(body["error"], "invalid_query", "{query}: {body}");
        assert!(body["message"].as_str().is_some_and(|m| m.starts_with(named)), "{query}: {body}");
    }
    assert!(d.stop().success());
}
