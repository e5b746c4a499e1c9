//! Routing at the door against the real binary: events routed by a payload field into
//! their topics, the default for unknown values, admission refusing with 422 and
//! appending nothing, drops, NDJSON atomicity, partition keys, config errors, and a
//! mapping fetched from a URL at start.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use ingest::{Envelope, Partitioning};
use serde_json::json;

const SOURCES: &str = r#"
[router]
enabled = false

[sources.shop]
accept = "json"

[sources.shop.route]
topic_field = "event.type"
default_stream = "shop"
default_topic = "other"
mapping = { "order.created" = "orders", "order.paid" = "payments", "user.signup" = { stream = "users", topic = "signups" } }

[sources.strict]
route = { topic_field = "type", stream_field = "tenant", default_stream = "strict", default_topic = "unrouted", on_missing_destination = "error" }
admission = { mode = "allowlist", allowlist = [{ stream = "acme", topic = "*" }, { stream = "strict", topic = "unrouted" }] }

[sources.guarded]
route = { topic_field = "type", default_stream = "g", default_topic = "misc" }
admission = { mode = "denylist", denylist = [{ stream = "*", topic = "secrets" }] }

[sources.dropper]
destination = { stream = "d", topic = "known" }
route = { topic_field = "type", mapping = { keep = "kept" }, on_missing_destination = "drop" }

[sources.by_header]
destination = { stream = "k", topic = "header" }
partitioning = { key_header = "x-tenant" }

[sources.by_path]
destination = { stream = "k", topic = "path" }
partitioning = { key_field = "customer.id", key_encoding = "key_u32" }
"#;

const NDJSON: (&str, &str) = ("content-type", "application/x-ndjson");

fn assert_refused(a: &Answer, code: &str) -> String {
    assert_eq!(a.status, 422, "{:?}", String::from_utf8_lossy(&a.body));
    let j = a.json();
    assert_eq!(j["error"], code, "{j}");
    j["message"].as_str().unwrap_or_else(|| panic!("no message: {j}")).to_string()
}

fn destinations(log: &[(u64, Envelope)]) -> Vec<String> {
    log.iter().map(|(_, e)| format!("{}/{}", e.header.destination.stream, e.header.destination.topic)).collect()
}

async fn metrics(d: &Daemon) -> String {
    String::from_utf8_lossy(&request(d.admin, "GET", "/metrics", &[], "").await.body).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_types_land_in_their_topics_and_unknown_ones_in_the_default() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    for t in ["order.created", "order.paid", "user.signup", "refund.issued"] {
        let a = post_json(d.http, "/v1/sources/shop", &json!({"event": {"type": t}, "id": 1}).to_string()).await;
        assert_eq!(a.status, 200, "{t}: {:?}", a.body);
    }
    // No object on the path, and an array on it: both missing, so the default.
    assert_eq!(post_json(d.http, "/v1/sources/shop", r#"{"event": "order.created"}"#).await.status, 200);
    assert_eq!(post_json(d.http, "/v1/sources/shop", r#"{"event": [{"type": "order.paid"}]}"#).await.status, 200);
    // NDJSON: each line routed on its own.
    let body = "{\"event\":{\"type\":\"order.paid\"}}\n{\"event\":{\"type\":\"user.signup\"}}\n";
    let a = request(d.http, "POST", "/v1/sources/shop", &[NDJSON], body).await;
    assert_eq!(a.json(), json!({"accepted": 2, "offsets": [6, 7]}));
    let m = metrics(&d).await;
    assert!(m.contains(r#"iggy_connector_routing_unmatched_total{connector_key="shop",action="default"} 3"#), "{m}");

    assert!(d.stop().success());
    let log = read_log(&dir.path().join("data/wal"));
    assert_eq!(
        destinations(&log),
        [
            "shop/orders",
            "shop/payments",
            "users/signups",
            "shop/other",
            "shop/other",
            "shop/other",
            "shop/payments",
            "users/signups"
        ]
    );
    assert!(log.iter().all(|(_, e)| e.header.destination.partitioning == Partitioning::Balanced));
    assert_eq!(&log[3].1.payload[..], json!({"event": {"type": "refund.issued"}, "id": 1}).to_string().as_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_destinations_are_422_with_the_reason_and_append_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let h = d.http;
    let ok = post_json(h, "/v1/sources/strict", r#"{"tenant":"acme","type":"orders"}"#).await;
    assert_eq!(ok.json(), json!({"accepted": 1, "offsets": [0, 0]}));
    let ok = post_json(h, "/v1/sources/guarded", r#"{"type":"public"}"#).await;
    assert_eq!(ok.json(), json!({"accepted": 1, "offsets": [1, 1]}));

    let m = assert_refused(
        &post_json(h, "/v1/sources/strict", r#"{"tenant":"evil","type":"orders"}"#).await,
        "not_allowlisted",
    );
    assert!(m.contains("evil/orders"), "{m}");
    // The topic field is there and mapped: the stream field is what is missing.
    let m = assert_refused(&post_json(h, "/v1/sources/strict", r#"{"type":"orders"}"#).await, "unknown_destination");
    assert!(m.contains("tenant is missing"), "{m}");
    assert_refused(
        &post_json(h, "/v1/sources/strict", r#"{"tenant":"acme","type":"no spaces"}"#).await,
        "invalid_destination",
    );
    assert_refused(&post_json(h, "/v1/sources/guarded", r#"{"type":"secrets"}"#).await, "denylisted");
    // A routed key given twice (here once escaped): JSON readers disagree on which counts,
    // so the admission could check one value and a consumer read the other. Refused by
    // the body's check where the request says it is JSON, and by routing where it does not.
    let twice = r#"{"tenant":"acme","type":"orders","\u0074enant":"evil"}"#;
    let a = post_json(h, "/v1/sources/strict", twice).await;
    assert_eq!((a.status, a.json()["error"].as_str()), (400, Some("invalid_json")), "{:?}", a.json());
    let plain = ("content-type", "text/plain");
    let m = assert_refused(&request(h, "POST", "/v1/sources/strict", &[plain], twice).await, "invalid_destination");
    assert!(m.contains("\"tenant\" is given twice"), "{m}");
    // A refused NDJSON line refuses the whole request, naming the line.
    let body = "{\"type\":\"public\"}\n\n{\"type\":\"secrets\"}\n{\"type\":\"public\"}\n";
    let m = assert_refused(&request(h, "POST", "/v1/sources/guarded", &[NDJSON], body).await, "denylisted");
    assert!(m.starts_with("line 3:"), "{m}");
    let body = "{\"tenant\":\"acme\",\"type\":\"a\"}\n{\"tenant\":\"acme\"}\n";
    let m = assert_refused(&request(h, "POST", "/v1/sources/strict", &[NDJSON], body).await, "unknown_destination");
    assert!(m.starts_with("line 2:"), "{m}");

    let m = metrics(&d).await;
    for series in [
        r#"iggy_connector_destinations_rejected_total{connector_key="strict",reason="not_allowlisted"} 1"#,
        r#"iggy_connector_destinations_rejected_total{connector_key="strict",reason="unknown"} 2"#,
        r#"iggy_connector_destinations_rejected_total{connector_key="strict",reason="invalid"} 2"#,
        r#"iggy_connector_destinations_rejected_total{connector_key="guarded",reason="denylist"} 2"#,
        r#"iggy_connector_routing_unmatched_total{connector_key="strict",action="error"} 2"#,
    ] {
        assert!(m.contains(series), "{series} missing from {m}");
    }
    let st = request(d.admin, "GET", "/status", &[], "").await.json();
    assert_eq!(st["sources"]["strict"]["last_error"]["code"], "unknown_destination", "{st}");

    assert!(d.stop().success());
    let log = read_log(&dir.path().join("data/wal"));
    assert_eq!(destinations(&log), ["acme/orders", "g/public"], "only the 200s are in the log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_events_are_answered_200_counted_and_never_appended() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let a = post_json(d.http, "/v1/sources/dropper", r#"{"type":"unknown"}"#).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json(), json!({"accepted": 0, "dropped": 1}));
    let body = "{\"type\":\"keep\",\"n\":1}\n{\"type\":\"other\"}\n{\"type\":\"keep\",\"n\":2}\n";
    let a = request(d.http, "POST", "/v1/sources/dropper", &[NDJSON, ("idempotency-key", "drop-1")], body).await;
    assert_eq!(a.json(), json!({"accepted": 2, "dropped": 1, "offsets": [0, 1]}));
    // A retry of the same delivery is a replay with the same answer, not a second append.
    let again = request(d.http, "POST", "/v1/sources/dropper", &[NDJSON, ("idempotency-key", "drop-1")], body).await;
    assert_eq!(again.json(), json!({"accepted": 2, "dropped": 1, "offsets": [0, 1]}));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    let m = metrics(&d).await;
    assert!(m.contains(r#"iggy_connector_routing_unmatched_total{connector_key="dropper",action="drop"} 2"#), "{m}");

    assert!(d.stop().success());
    let log = read_log(&dir.path().join("data/wal"));
    assert_eq!(destinations(&log), ["d/kept", "d/kept"]);
    let indexes: Vec<_> = log.iter().map(|(_, e)| (e.header.batch_index, e.header.batch_len)).collect();
    assert_eq!(indexes, [(0, 2), (1, 2)]);
    assert_eq!(&log[1].1.payload[..], br#"{"type":"keep","n":2}"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_keys_come_from_a_header_or_a_path_and_missing_ones_go_balanced() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "", SOURCES);
    let h = d.http;
    let json_ct = ("content-type", "application/json");
    assert_eq!(request(h, "POST", "/v1/sources/by_header", &[json_ct, ("x-tenant", "acme")], "{}").await.status, 200);
    assert_eq!(request(h, "POST", "/v1/sources/by_header", &[json_ct], "{}").await.status, 200);
    let long = "t".repeat(300);
    assert_eq!(request(h, "POST", "/v1/sources/by_header", &[json_ct, ("x-tenant", &long)], "{}").await.status, 200);
    let body = "{\"customer\":{\"id\":258}}\n{\"customer\":{}}\n{\"customer\":{\"id\":\"x\"}}\n{\"customer\":{\"id\":\"7\"}}\n";
    assert_eq!(request(h, "POST", "/v1/sources/by_path", &[NDJSON], body).await.status, 200);
    let m = metrics(&d).await;
    for series in [
        r#"iggy_connector_partition_key_missing_total{connector_key="by_header",reason="missing"} 1"#,
        r#"iggy_connector_partition_key_missing_total{connector_key="by_path",reason="missing"} 1"#,
        r#"iggy_connector_partition_key_missing_total{connector_key="by_path",reason="not_u32"} 1"#,
    ] {
        assert!(m.contains(series), "{series} missing from {m}");
    }

    assert!(d.stop().success());
    let log = read_log(&dir.path().join("data/wal"));
    let parts: Vec<_> = log.iter().map(|(_, e)| e.header.destination.partitioning.clone()).collect();
    assert_eq!(parts[0], Partitioning::Key(b"acme".to_vec()));
    assert_eq!(parts[1], Partitioning::Balanced, "a missing header key goes balanced");
    match &parts[2] {
        Partitioning::Key(k) => assert_eq!(k.len(), 32, "a key over 255 bytes is its SHA-256"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        parts[3..],
        [
            Partitioning::Key(258u32.to_le_bytes().to_vec()),
            Partitioning::Balanced,
            Partitioning::Balanced,
            Partitioning::Key(7u32.to_le_bytes().to_vec())
        ]
    );
}

fn config_check(dir: &Path, text: &str) -> (bool, Option<i32>, String) {
    let file = dir.join("check.toml");
    std::fs::write(&file, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_iggy-ingest")).args(["config", "check"]).arg(&file).output().unwrap();
    (out.status.success(), out.status.code(), String::from_utf8_lossy(&out.stderr).to_string())
}

#[test]
fn config_check_names_the_key_path_of_routing_errors() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("[sources.a]\nroute = { topic_field = \"type\", default_stream = \"s\" }\n", "sources.a.route.default_topic"),
        (
            "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nroute = { topic_field = \"type\", default_stream = \"other\" }\n",
            "sources.a.route.default_stream",
        ),
        (
            "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nadmission = { mode = \"allowlist\", allowlist = [{ stream = \"*\", topic = \"*\" }] }\n",
            "sources.a.admission.allowlist[0]",
        ),
        (
            "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nadmission = { mode = \"denylist\", denylist = [{ stream = \"a*\", topic = \"t\" }] }\n",
            "sources.a.admission.denylist[0].stream",
        ),
        (
            "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\npartitioning = { key_field = \"a..b\" }\n",
            "sources.a.partitioning.key_field",
        ),
    ];
    for (text, path) in cases {
        let (ok, code, err) = config_check(dir.path(), text);
        assert!(!ok, "{text}");
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains(&format!(": {path}: ")), "{path} not named in {err}");
        assert!(err.contains("line "), "{err}");
    }
}

/// Serves `body` with `status` at `/mapping.json`; returns the URL.
async fn serve_mapping(status: u16, body: &'static str) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let status = axum::http::StatusCode::from_u16(status).unwrap();
    let app = axum::Router::new().route("/mapping.json", axum::routing::get(move || async move { (status, body) }));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/mapping.json")
}

fn url_source(url: &str) -> String {
    format!(
        "[router]\nenabled = false\n\n[sources.web]\nroute = {{ topic_field = \"kind\", default_stream = \"web\", default_topic = \"misc\", mapping_url = \"{url}\" }}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mapping_fetched_from_a_url_routes_events() {
    let url = serve_mapping(200, r#"{"click": "clicks", "buy": {"stream": "sales", "topic": "orders"}}"#).await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let d = tokio::task::spawn_blocking(move || Daemon::start(&root, "", &url_source(&url))).await.unwrap();
    for kind in ["click", "buy", "scroll"] {
        assert_eq!(post_json(d.http, "/v1/sources/web", &json!({"kind": kind}).to_string()).await.status, 200);
    }
    assert!(d.stop().success());
    let log = read_log(&dir.path().join("data/wal"));
    assert_eq!(destinations(&log), ["web/clicks", "sales/orders", "web/misc"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_or_malformed_mapping_fetch_refuses_to_start() {
    let cases = [
        (serve_mapping(500, "oops").await, "500"),
        (serve_mapping(200, r#"["not", "an", "object"]"#).await, "expected a JSON object"),
        (serve_mapping(200, "{}").await, "empty"),
        (serve_mapping(200, r#"{"a": "no spaces allowed"}"#).await, "entry \"a\""),
        (serve_mapping(404, "").await, "404"),
    ];
    for (url, why) in cases {
        let dir = tempfile::tempdir().unwrap();
        let cfg = dir.path().join("config.toml");
        std::fs::write(&cfg, config_text(dir.path(), "", &url_source(&url))).unwrap();
        let (code, err) = tokio::task::spawn_blocking(move || refused_start(&cfg)).await.unwrap();
        assert_eq!(code, Some(1), "{why}: {err}");
        assert!(err.contains("sources.web.route.mapping_url") && err.contains(why), "{why}: {err}");
        assert!(!dir.path().join("data/wal").exists(), "nothing is opened before the mapping is loaded");
    }
}

/// A fetched mapping with entries the source's own admission refuses refuses the start,
/// naming them, as an inline table's are named at load: every event routed by such an
/// entry would be answered 422.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetched_mapping_entry_the_sources_admission_refuses_refuses_to_start() {
    let url =
        serve_mapping(200, r#"{"click": "clicks", "audit": "audit", "buy": {"stream": "sales", "topic": "audit"}}"#)
            .await;
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    let source = format!(
        "{}admission = {{ mode = \"denylist\", denylist = [{{ stream = \"*\", topic = \"audit\" }}] }}\n",
        url_source(&url)
    );
    std::fs::write(&cfg, config_text(dir.path(), "", &source)).unwrap();
    let (code, err) = tokio::task::spawn_blocking(move || refused_start(&cfg)).await.unwrap();
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("sources.web.route.mapping_url"), "{err}");
    assert!(err.contains(r#""audit" to web/audit, "buy" to sales/audit"#), "{err}");
    assert!(!err.contains("clicks"), "an entry admitted is not named: {err}");
    assert!(!dir.path().join("data/wal").exists(), "nothing is opened before the mapping is checked");
}

/// A sender's retry of a delivery the log holds is answered as the replay it is, also
/// after a restart whose configuration would now refuse its route (422) or drop it: it
/// was answered 200 once, and a 4xx now would tell the sender otherwise. Whether the
/// daemon that answered it stopped cleanly or was killed (-9) right after its 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_of_an_accepted_delivery_is_a_replay_under_a_route_that_would_refuse_it_now() {
    for killed in [false, true] {
        retry_under_a_route_that_would_refuse_it_now(killed).await;
    }
}

async fn retry_under_a_route_that_would_refuse_it_now(killed: bool) {
    let dir = tempfile::tempdir().unwrap();
    let before = "[router]\nenabled = false\n\n[sources.orders]\naccept = \"json\"\n\
                  route = { topic_field = \"type\", default_stream = \"o\", default_topic = \"other\", mapping = { a = \"alpha\" }, on_missing_destination = \"error\" }\n";
    let mut d = Daemon::start(dir.path(), "", before);
    let json_key = |k: &'static str| [("content-type", "application/json"), ("idempotency-key", k)];
    let first = request(d.http, "POST", "/v1/sources/orders", &json_key("d-1"), r#"{"type":"a"}"#).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    assert_eq!(first.json()["offsets"], json!([0, 0]));
    if killed {
        d.kill9();
    } else {
        assert!(d.stop().success());
    }

    // "a" is no longer mapped: a new delivery of it is refused, the retry is a replay.
    let refusing = before.replace("mapping = { a = \"alpha\" }", "mapping = { b = \"beta\" }");
    let d = Daemon::start(dir.path(), "", &refusing);
    let retry = request(d.http, "POST", "/v1/sources/orders", &json_key("d-1"), r#"{"type":"a"}"#).await;
    assert_eq!((retry.status, retry.json()), (200, json!({"accepted": 1, "offsets": [0, 0]})));
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_refused(
        &request(d.http, "POST", "/v1/sources/orders", &json_key("d-2"), r#"{"type":"a"}"#).await,
        "unknown_destination",
    );
    assert!(d.stop().success());

    // Now the route drops it: the retry is still a replay, not `{"accepted": 0}`, and
    // says what the route of now drops of its body, as a replay whose events are partly
    // dropped does (docs/routing.md).
    let dropping = refusing.replace("on_missing_destination = \"error\"", "on_missing_destination = \"drop\"");
    let d = Daemon::start(dir.path(), "", &dropping);
    let retry = request(d.http, "POST", "/v1/sources/orders", &json_key("d-1"), r#"{"type":"a"}"#).await;
    assert_eq!((retry.status, retry.json()), (200, json!({"accepted": 1, "offsets": [0, 0], "dropped": 1})));
    let dropped = request(d.http, "POST", "/v1/sources/orders", &json_key("d-3"), r#"{"type":"a"}"#).await;
    assert_eq!((dropped.status, dropped.json()), (200, json!({"accepted": 0, "dropped": 1})));
    assert!(d.stop().success());
    assert_eq!(log_len(&dir.path().join("data/wal")), 1, "no retry appended anything");
}

/// A stop while a route mapping is fetched ends the process at once, a clean stop (exit
/// 0) with nothing opened: neither the fetch (up to 10 s a mapping) nor the start after
/// it is waited for, where before the stop waited out the fetch, whose failure then
/// ended the process with exit 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_a_mapping_is_fetched_ends_the_process_at_once() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/mapping.json", silent.local_addr().unwrap());
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, config_text(dir.path(), "", &url_source(&url))).unwrap();
    let mut d = Daemon::spawn(dir.path(), &cfg);
    // The fetch began: the daemon's stop handlers are in place.
    let (held, _) =
        tokio::time::timeout(Duration::from_secs(30), silent.accept()).await.expect("the fetch never came").unwrap();
    let asked = std::time::Instant::now();
    d.signal(libc::SIGTERM);
    let status = tokio::task::spawn_blocking(move || d.wait_exit(Duration::from_secs(30))).await.unwrap();
    assert_eq!(status.code(), Some(0), "{status}");
    assert!(asked.elapsed() < Duration::from_secs(5), "the stop took {:?}", asked.elapsed());
    assert!(!dir.path().join("data/wal").exists(), "the log was opened");
    drop(held);
}
