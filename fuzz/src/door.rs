//! The webhook door's request path: routing, size limits, auth, decoding, delivery ids and
//! routing at the door, driven in-process through the door's axum router (`oneshot`) with
//! the log on the simulated disk and the state database in memory.
//!
//! Input: a configuration choice (body limit, log capacity, what a route does with an
//! unmatched event, whether delivery ids are honoured), then up to four requests, each a
//! method, a path (a source, an endpoint id, or raw bytes with percent-encoded tricks), a
//! query, headers (mostly with a `Host`), a content type, a body (raw bytes, JSON events
//! or NDJSON lines built from the input) and an auth mode (none, garbage, or a signature
//! the harness computes for the body, with a chosen clock skew, possibly over other
//! bytes).
//!
//! What must hold, for every request:
//! - no panic;
//! - a request with no `Host` or two is refused 400 `invalid_host`, and one with the
//!   harness's own is not;
//! - the status is one the contract documents (`docs/http.md`), never 500;
//! - every answer but a handshake echo and `/health` is JSON: `{"error", "message"}` with a
//!   code documented for its status, or a 200 `{"accepted", "offsets"[, "dropped"]}`;
//!   every 503 carries `Retry-After`;
//! - a 4xx or 5xx appended nothing;
//! - a 200 appended exactly `accepted` records at the offsets it names (none when it is
//!   an idempotent replay, which names offsets already in the log), each an envelope of the
//!   addressed source whose payload is bytes of the request body, numbered as one batch;
//! - after the requests, a power loss that keeps exactly what was synced: every record a
//!   200 named is still in the log, byte for byte.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Method, Request, header};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as B64;
use hmac::{Hmac, Mac};
use http_body_util::BodyExt;
use http_source::admission::{Admission, Rule};
use http_source::auth::AuthScheme;
use http_source::body::Accept;
use http_source::door::{Door, DoorLimits, PeerAddr};
use http_source::endpoints::{Endpoint, EndpointRegistry};
use http_source::field_path::FieldPath;
use http_source::health::Health;
use http_source::metrics::DoorMetrics;
use http_source::partition::{KeyEncoding, KeySource, PartitionRule};
use http_source::route::{Mapping, MappingSource, OnMissing, Route, Target};
use http_source::source::{Destinations, MetadataFields, SourceSpec};
use http_source::status::StatusBoard;
use ingest::{Envelope, IdempotencyIndex, Ingestor, Partitioning, StateDb};
use sha2::Sha256;
use tower::ServiceExt;
use wal::storage::{SimStorage, Storage};
use wal::{Wal, WalOptions};

use crate::Input;

const GITHUB_SECRET: &str = "It's a Secret to Everybody";
const SVIX_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const STRIPE_SECRET: &str = "whsec_test_secret";
const BEARER_TOKEN: &str = "endpoint-token-0123";
/// The active endpoint (bearer auth, a GET handshake) and an expired one.
pub const ENDPOINT: &str = "0123456789abcdef0123456789abcdef";
pub const EXPIRED_ENDPOINT: &str = "fedcba9876543210fedcba9876543210";
const TOLERANCE_SECS: u64 = 300;

/// The sources every door has; the input picks which one a request addresses.
pub const SOURCES: [&str; 5] = ["open", "json", "svix", "stripe", "hidden"];

/// The configuration part of the input.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub max_body_bytes: usize,
    /// Log capacity: small ones make 503 `log_full` reachable.
    pub wal_max_bytes: u64,
    pub on_missing: OnMissing,
    pub idempotency: bool,
    /// Small ones make 413 `too_many_events` reachable.
    pub max_events_per_request: usize,
}

impl Setup {
    pub fn decode(input: &mut Input<'_>) -> Setup {
        let b = input.u8();
        Setup {
            max_body_bytes: [64, 512, 4096, 65536][usize::from(b & 3)],
            wal_max_bytes: [2048, 1 << 20][usize::from((b >> 2) & 1)],
            on_missing: [OnMissing::Default, OnMissing::Drop, OnMissing::Error, OnMissing::Default]
                [usize::from((b >> 3) & 3)],
            idempotency: b & 0x20 == 0,
            max_events_per_request: if b & 0x40 == 0 { http_source::body::MAX_EVENTS_PER_REQUEST_DEFAULT } else { 4 },
        }
    }

    pub fn encode(&self) -> u8 {
        let body = match self.max_body_bytes {
            64 => 0,
            512 => 1,
            4096 => 2,
            _ => 3,
        };
        let wal = u8::from(self.wal_max_bytes > 2048);
        let missing = match self.on_missing {
            OnMissing::Default => 0,
            OnMissing::Drop => 1,
            OnMissing::Error => 2,
        };
        let few_events = if self.max_events_per_request <= 4 { 0x40 } else { 0 };
        body | (wal << 2) | (missing << 3) | if self.idempotency { 0 } else { 0x20 } | few_events
    }
}

/// How a request authenticates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthMode {
    /// No auth headers added by the harness.
    None,
    /// The right signature (or token) for the addressed source, over the body, signed at
    /// `now + skew` seconds.
    Valid { skew: i64 },
    /// A right signature over other bytes than the body.
    OtherBody,
    /// Garbage in the scheme's header.
    Garbage,
}

/// One request.
#[derive(Debug, Clone)]
pub struct Req {
    pub method: Method,
    /// The source the path addresses, if it addresses one (for auth and checks).
    pub source: Option<&'static str>,
    pub path: String,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Vec<u8>,
    pub auth: AuthMode,
    pub peer: bool,
}

const METHODS: [&str; 8] = ["POST", "POST", "POST", "GET", "PUT", "DELETE", "HEAD", "PATCH"];
const CONTENT_TYPES: [&str; 8] = [
    "",
    "application/json",
    "application/x-ndjson",
    "text/plain",
    "application/vnd.event+json; charset=utf-8",
    "application/jsonl",
    "APPLICATION/JSON",
    "multipart/form-data",
];
const HEADER_NAMES: [&str; 17] = [
    "content-type",
    "host",
    "content-length",
    "idempotency-key",
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "svix-id",
    "stripe-signature",
    "x-hub-signature-256",
    "authorization",
    "x-key",
    "x-event",
    "x-github-delivery",
    "transfer-encoding",
    "svix-signature",
    "x-other",
];
const TYPES: [&str; 6] = ["a", "b", "secret", "bad name", "", "c.d"];

fn pick<'a, T: ?Sized>(input: &mut Input<'_>, items: &[&'a T]) -> &'a T {
    items[usize::from(input.u8()) % items.len()]
}

/// Up to `max - 1` bytes, the count read first.
fn chunk(input: &mut Input<'_>, max: u8) -> Vec<u8> {
    let n = input.u8() % max;
    input.bytes(usize::from(n)).to_vec()
}

fn text(input: &mut Input<'_>, max: usize) -> String {
    let n = usize::from(input.u8()) % (max + 1);
    String::from_utf8_lossy(input.bytes(n)).into_owned()
}

/// One JSON event built from the input: a routed `type`, a numeric `id`, `kind` and `ns`
/// for the identity route, and some text.
fn json_event(input: &mut Input<'_>) -> Vec<u8> {
    let kind = input.u8();
    let mut fields = Vec::new();
    if kind & 1 != 0 {
        fields.push(format!("\"type\":{}", serde_json::json!(pick(input, &TYPES))));
    }
    if kind & 2 != 0 {
        let id = input.u32();
        fields.push(if kind & 0x40 != 0 { format!("\"id\":\"{id}\"") } else { format!("\"id\":{id}") });
    }
    if kind & 4 != 0 {
        fields.push(format!("\"kind\":{}", serde_json::json!(pick(input, &TYPES))));
    }
    if kind & 8 != 0 {
        fields.push(format!("\"ns\":{}", serde_json::json!(text(input, 8))));
    }
    if kind & 16 != 0 {
        fields.push(format!("\"t\":{}", serde_json::json!(text(input, 32))));
    }
    let mut object = format!("{{{}}}", fields.join(",")).into_bytes();
    if kind & 0x80 != 0 {
        // Damaged: cut somewhere, possibly inside a character.
        object.truncate(usize::from(input.u8()) % (object.len() + 1));
    }
    object
}

impl Req {
    pub fn decode(input: &mut Input<'_>) -> Req {
        let method = Method::from_bytes(pick(input, &METHODS).as_bytes()).unwrap_or(Method::POST);
        let (source, mut path) = match input.u8() % 8 {
            0..=2 => {
                let s = pick(input, &SOURCES);
                (Some(s), format!("/v1/sources/{s}"))
            }
            3 => (Some("hidden"), format!("/v1/e/{ENDPOINT}")),
            4 => (Some("hidden"), format!("/v1/e/{EXPIRED_ENDPOINT}")),
            5 => (None, "/health".to_string()),
            6 => {
                // A source or endpoint path with raw bytes after it, percent-encoded
                // where they are not URL characters.
                let prefix = if input.u8() & 1 == 0 { "/v1/sources/" } else { "/v1/e/" };
                let raw = chunk(input, 48);
                (None, format!("{prefix}{}", percent_encode(&raw)))
            }
            _ => {
                let raw = chunk(input, 64);
                (None, format!("/{}", percent_encode(&raw)))
            }
        };
        if input.u8() & 3 == 0 {
            let q = chunk(input, 32);
            path.push_str(&format!("?challenge={}", percent_encode(&q)));
        }
        let mut headers = Vec::new();
        let ct = pick(input, &CONTENT_TYPES);
        if !ct.is_empty() {
            headers.push((HeaderName::from_static("content-type"), HeaderValue::from_static(ct)));
        }
        // Mostly the one `Host` a client sends; sometimes none, and a second (or one of
        // any bytes) from the names below.
        if input.u8() % 8 != 0 {
            headers.push((HeaderName::from_static("host"), HeaderValue::from_static("hooks.example:8080")));
        }
        for _ in 0..input.u8() % 5 {
            let name = pick(input, &HEADER_NAMES);
            let value = chunk(input, 80);
            if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(&value)) {
                headers.push((n, v));
            }
        }
        let body = match input.u8() % 4 {
            0 => {
                let n = input.u16() % 600;
                input.bytes(usize::from(n)).to_vec()
            }
            1 => json_event(input),
            _ => {
                let lines = 1 + input.u8() % 6;
                let mut body = Vec::new();
                for _ in 0..lines {
                    match input.u8() % 8 {
                        0 => body.push(b'\n'),
                        1 => body.extend_from_slice(b"\r\n"),
                        2 => body.extend_from_slice("{\"a\":\"\u{e9}\"}\n".as_bytes()),
                        _ => {
                            body.extend_from_slice(&json_event(input));
                            body.push(b'\n');
                        }
                    }
                }
                body
            }
        };
        let auth = match input.u8() % 6 {
            0 => AuthMode::None,
            1 | 2 => AuthMode::Valid { skew: 0 },
            3 => AuthMode::Valid {
                skew: [-301, 301, -299, 299, i64::from(input.u16()) - 32768][usize::from(input.u8() % 5)],
            },
            4 => AuthMode::OtherBody,
            _ => AuthMode::Garbage,
        };
        let peer = input.u8() & 1 == 0;
        Req { method, source, path, headers, body, auth, peer }
    }
}

/// Percent-encodes every byte that is not an unreserved URL character, and leaves some
/// `/`, `.` and `%` as they are so traversal and double-encoding shapes stay reachable.
fn percent_encode(raw: &[u8]) -> String {
    let mut out = String::new();
    for &b in raw {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/' | b'%') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn mac(key: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut m = Hmac::<Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m
}

/// The auth headers for `source` under `mode`, at `now` (Unix seconds).
fn auth_headers(source: &str, mode: AuthMode, body: &[u8], now: u64) -> Vec<(&'static str, String)> {
    let (signed_body, skew): (&[u8], i64) = match mode {
        AuthMode::None => return Vec::new(),
        AuthMode::Valid { skew } => (body, skew),
        AuthMode::OtherBody => (b"other bytes", 0),
        AuthMode::Garbage => {
            return match source {
                "json" => vec![("x-hub-signature-256", "sha256=zz".into())],
                "svix" => vec![
                    ("webhook-id", "m".into()),
                    ("webhook-timestamp", "x".into()),
                    ("webhook-signature", "v1,==".into()),
                ],
                "stripe" => vec![("stripe-signature", "t=,v1=".into())],
                "hidden" => vec![("authorization", "Bearer".into())],
                _ => Vec::new(),
            };
        }
    };
    let ts = now.saturating_add_signed(skew);
    match source {
        "json" => {
            let sig = hex::encode(mac(GITHUB_SECRET.as_bytes(), &[signed_body]).finalize().into_bytes());
            vec![("x-hub-signature-256", format!("sha256={sig}"))]
        }
        "svix" => {
            let key = B64.decode(SVIX_SECRET.trim_start_matches("whsec_")).expect("the test key is base64");
            let id = "msg_fuzz";
            let sig = B64.encode(
                mac(&key, &[id.as_bytes(), b".", ts.to_string().as_bytes(), b".", signed_body]).finalize().into_bytes(),
            );
            vec![
                ("webhook-id", id.into()),
                ("webhook-timestamp", ts.to_string()),
                ("webhook-signature", format!("v1,{sig}")),
            ]
        }
        "stripe" => {
            let sig = hex::encode(
                mac(STRIPE_SECRET.as_bytes(), &[ts.to_string().as_bytes(), b".", signed_body]).finalize().into_bytes(),
            );
            vec![("stripe-signature", format!("t={ts},v1={sig}"))]
        }
        "hidden" if matches!(mode, AuthMode::Valid { .. }) => vec![("authorization", format!("Bearer {BEARER_TOKEN}"))],
        "hidden" => vec![("authorization", "Bearer not-the-token".into())],
        _ => Vec::new(),
    }
}

fn rule(stream: &str, topic: &str) -> Rule {
    Rule::parse(stream, topic).expect("a valid rule")
}

fn field(path: &str) -> FieldPath {
    FieldPath::parse(path).expect("a valid field path")
}

fn sources(setup: &Setup) -> Vec<SourceSpec> {
    let scheme = |name: &str, secret: &str| {
        let tolerance = matches!(name, "standard-webhooks" | "stripe").then_some(TOLERANCE_SECS);
        AuthScheme::from_parts(name, Some(secret), None, None, tolerance).expect("a valid scheme")
    };
    let base = |key: &str| SourceSpec {
        key: key.to_string(),
        destinations: Destinations::Fixed { stream: "s".into(), topic: key.into() },
        partitioning: PartitionRule::default(),
        admission: Admission::Open,
        accept: Accept::Any,
        named_path: true,
        auth: AuthScheme::None,
        forward_headers: Vec::new(),
        metadata: MetadataFields::default(),
        idempotency_header: None,
        idempotency: setup.idempotency,
    };
    let mapping = Mapping::new([
        ("a".to_string(), Target { stream: None, topic: "ta".into() }),
        ("b".to_string(), Target { stream: Some("sb".into()), topic: "tb".into() }),
        ("secret".to_string(), Target { stream: Some("sx".into()), topic: "secret".into() }),
    ])
    .expect("a valid mapping");
    vec![
        SourceSpec {
            forward_headers: vec!["x-event".into()],
            metadata: MetadataFields { peer_addr: true, received_at: true },
            ..base("open")
        },
        SourceSpec {
            accept: Accept::Json,
            auth: scheme("hmac-sha256", GITHUB_SECRET),
            partitioning: PartitionRule::Key {
                source: KeySource::Header("x-key".into()),
                encoding: KeyEncoding::Bytes,
            },
            ..base("json")
        },
        SourceSpec {
            auth: scheme("standard-webhooks", SVIX_SECRET),
            destinations: Destinations::Routed(Route {
                topic_field: field("type"),
                stream_field: None,
                mapping: MappingSource::Table(mapping),
                default_stream: "s".into(),
                default_topic: "other".into(),
                on_missing: setup.on_missing,
            }),
            admission: Admission::Allowlist(vec![rule("s", "*"), rule("sb", "tb")]),
            partitioning: PartitionRule::Key { source: KeySource::Field(field("id")), encoding: KeyEncoding::U32 },
            ..base("svix")
        },
        SourceSpec {
            accept: Accept::Json,
            auth: scheme("stripe", STRIPE_SECRET),
            destinations: Destinations::Routed(Route {
                topic_field: field("kind"),
                stream_field: Some(field("ns")),
                mapping: MappingSource::Identity,
                default_stream: "s".into(),
                default_topic: "stripe".into(),
                on_missing: setup.on_missing,
            }),
            admission: Admission::Denylist(vec![rule("*", "secret")]),
            idempotency_header: Some("x-event".into()),
            ..base("stripe")
        },
        SourceSpec {
            named_path: false,
            partitioning: PartitionRule::Fixed(Partitioning::PartitionId(3)),
            ..base("hidden")
        },
    ]
}

/// A fresh door over a fresh log.
pub struct World {
    pub router: axum::Router,
    pub wal: Arc<Wal>,
    pub max_events_per_request: usize,
    /// The simulated disk under the log, and the log's options: to lose power after the
    /// requests and open the log again.
    pub sim: SimStorage,
    pub options: WalOptions,
}

impl World {
    pub fn new(setup: &Setup) -> World {
        let sim = SimStorage::new();
        let options = WalOptions {
            segment_max_bytes: (setup.wal_max_bytes / 2).min(4096),
            max_bytes: setup.wal_max_bytes,
            ..WalOptions::default()
        };
        let wal = Arc::new(
            Wal::open_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &crate::log_dir(), options.clone())
                .expect("a fresh log opens"),
        );
        let state = Arc::new(StateDb::open_in_memory().expect("an in-memory state database"));
        let idempotency = Arc::new(IdempotencyIndex::new(state.clone(), 86_400_000));
        let specs = sources(setup);
        let keys: Vec<String> = specs.iter().map(|s| s.key.clone()).collect();
        let id = |s: &str| u128::from_str_radix(s, 16).expect("a hex id");
        let endpoint = |hex: &str, expires: Option<u64>| Endpoint {
            id: id(hex),
            source_key: "hidden".into(),
            auth: AuthScheme::Bearer { token: http_source::auth::TokenDigest::of(BEARER_TOKEN) },
            handshake_param: Some("challenge".into()),
            expires_at_unix_ms: expires,
            revoked_at_unix_ms: None,
            dynamic: false,
            record: None,
            unusable: None,
        };
        let endpoints = EndpointRegistry::load(
            state.clone(),
            keys.clone(),
            vec![endpoint(ENDPOINT, None), endpoint(EXPIRED_ENDPOINT, Some(1))],
        )
        .expect("endpoints load");
        let door = Door {
            sources: specs.into_iter().map(|s| (s.key.clone(), Arc::new(s))).collect::<HashMap<_, _>>(),
            endpoints: Arc::new(endpoints),
            ingestor: Ingestor::new(wal.clone(), idempotency),
            limits: DoorLimits {
                max_body_bytes: setup.max_body_bytes,
                max_events_per_request: setup.max_events_per_request,
                body_read_timeout: std::time::Duration::from_secs(5),
                retry_after_secs: 5,
            },
            health: Arc::new(Health::default()),
            status: Arc::new(StatusBoard::new(keys.clone())),
            metrics: DoorMetrics::new(keys.iter().map(String::as_str)),
        };
        World {
            router: http_source::router(Arc::new(door)),
            wal,
            max_events_per_request: setup.max_events_per_request,
            sim,
            options,
        }
    }
}

/// The error codes `docs/http.md` documents, by status.
fn documented(status: u16, code: &str) -> bool {
    let codes: &[&str] = match status {
        400 => &[
            "invalid_json",
            "malformed_ndjson_line",
            "no_events",
            "invalid_delivery_id",
            "missing_challenge",
            "invalid_challenge",
            "invalid_content_type",
            "body_read_failed",
            "invalid_host",
        ],
        401 => &["unauthorized"],
        404 => &["not_found"],
        405 => &["method_not_allowed"],
        408 => &["body_read_timeout"],
        409 => &["delivery_in_progress"],
        410 => &["endpoint_expired"],
        413 => &["body_too_large", "record_too_large", "batch_too_large", "too_many_events"],
        415 => &["unsupported_media_type", "unsupported_content_encoding"],
        422 => &["unknown_destination", "invalid_destination", "denylisted", "not_allowlisted"],
        501 => &["unsupported_transfer_coding"],
        503 => &["log_full", "shutting_down", "log_unavailable", "disk_full", "state_unavailable"],
        _ => &[],
    };
    codes.contains(&code)
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let setup = Setup::decode(&mut input);
    let requests: Vec<Req> = (0..1 + input.u8() % 4).map(|_| Req::decode(&mut input)).collect();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    runtime.block_on(async {
        let world = World::new(&setup);
        let mut answered = Vec::new();
        for req in &requests {
            check_one(&world, req, &mut answered).await;
        }
        survives_a_power_loss(world, &answered);
    });
}

/// Every record a 200 named is in the log after a power loss that keeps exactly what was
/// synced, with the bytes it was read back with before.
fn survives_a_power_loss(world: World, answered: &[(u64, bytes::Bytes)]) {
    let World { router, wal, sim, options, .. } = world;
    sim.crash(wal::storage::CrashMode::LoseUnsynced);
    drop((router, wal));
    let wal = Wal::open_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &crate::log_dir(), options)
        .expect("the log reopens after a power loss");
    let Some(first) = answered.iter().map(|(o, _)| *o).min() else { return };
    let held: HashMap<u64, bytes::Bytes> = wal::inspect::Records::new(&wal, first)
        .expect("a reader at the first offset answered 200")
        .map(|r| r.expect("a record answered 200 reads back after a power loss"))
        .map(|r| (r.offset, r.payload))
        .collect();
    for (offset, payload) in answered {
        assert_eq!(
            held.get(offset),
            Some(payload),
            "offset {offset}, answered 200, is not as answered after a power loss"
        );
    }
}

async fn check_one(world: &World, req: &Req, answered: &mut Vec<(u64, bytes::Bytes)>) {
    let now = ingest::time::now_unix_ms() / 1000;
    let mut builder = Request::builder().method(req.method.clone()).uri(req.path.as_str());
    for (n, v) in &req.headers {
        builder = builder.header(n, v);
    }
    if let Some(source) = req.source {
        for (n, v) in auth_headers(source, req.auth, &req.body, now) {
            builder = builder.header(n, v);
        }
    }
    // A URI the HTTP layer would refuse never reaches the router.
    let Ok(mut request) = builder.body(Body::from(req.body.clone())) else { return };
    if req.peer {
        request.extensions_mut().insert(PeerAddr::new("127.0.0.1:4000".parse().expect("an address")));
    }
    let before = world.wal.next_offset();
    let response = world.router.clone().oneshot(request).await.expect("the router is infallible");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.expect("an in-memory body").to_bytes();
    let after = world.wal.next_offset();
    if std::env::var_os("FUZZ_TRACE").is_some() {
        let answer = String::from_utf8_lossy(&body);
        eprintln!("{} {} ({:?}) -> {status} {answer:.100}", req.method, req.path, req.auth);
    }
    let path_only = req.path.split('?').next().unwrap_or("");
    let content_type = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");

    // The `Host` decides before any route: none or two is refused whatever else the
    // request is, the harness's own is taken (one of any bytes may go either way).
    let hosts: Vec<&[u8]> = req.headers.iter().filter(|(n, _)| n == header::HOST).map(|(_, v)| v.as_bytes()).collect();
    let host_refused = status == 400 && body.windows(14).any(|w| w == b"\"invalid_host\"");
    match hosts[..] {
        [] | [_, _, ..] => {
            // A HEAD answer has its status alone.
            let refused = host_refused || (status == 400 && req.method == Method::HEAD);
            assert!(refused, "{} Host headers, answered {status} for {req:?}", hosts.len());
            assert_eq!(before, after, "a request refused for its Host appended");
            return;
        }
        [b"hooks.example:8080"] => assert!(!host_refused, "the harness's Host refused for {req:?}"),
        [_] if host_refused => {
            assert_eq!(before, after, "a request refused for its Host appended");
            return;
        }
        [_] => {}
    }
    if path_only == format!("/v1/e/{EXPIRED_ENDPOINT}") {
        // Past its `expires_at`: no event taken and no handshake echoed, whatever the
        // credentials.
        assert_ne!(status, 200, "an expired endpoint answered 200: {req:?}");
    }
    if req.method == Method::HEAD {
        // Answered as GET without a body (axum); only the status and the log can be checked.
        assert!(matches!(status, 200 | 400 | 401 | 404 | 405 | 410), "HEAD answered {status} for {req:?}");
        assert_eq!(before, after, "a HEAD appended");
        return;
    }
    // The GET handshake's echo and /health are the only answers not in the error shape.
    if status == 200 && req.method == Method::GET && path_only.starts_with("/v1/e/") {
        assert_eq!(content_type, "text/plain; charset=utf-8", "{req:?}");
        assert_eq!(headers.get("x-content-type-options").map(|v| v.as_bytes()), Some(&b"nosniff"[..]));
        assert_eq!(before, after, "a handshake appends nothing");
        return;
    }
    if path_only == "/health" && req.method == Method::GET {
        assert_eq!(status, 200, "a fresh door is healthy");
        assert_eq!(before, after);
        return;
    }
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_else(|e| {
        panic!("status {status}: body is not JSON ({e}): {:?} for {req:?}", String::from_utf8_lossy(&body))
    });
    assert!(content_type.starts_with("application/json"), "status {status} content type {content_type:?}");
    if status != 200 {
        let code = json["error"].as_str().unwrap_or_else(|| panic!("no error code in {json} ({req:?})"));
        assert!(documented(status, code), "undocumented answer {status} {code:?}: {json} for {req:?}");
        assert!(json["message"].as_str().is_some_and(|m| !m.is_empty()), "{json}");
        if status == 503 {
            assert!(headers.contains_key("retry-after"), "503 without Retry-After: {json}");
        }
        assert_eq!(before, after, "{status} {code} appended {} records for {req:?}", after - before);
        return;
    }

    // A 200 for events.
    assert_eq!(req.method, Method::POST, "200 {json} for {req:?}");
    assert!(authenticated(req), "200 {json} without valid credentials: {req:?}");
    let accepted = json["accepted"].as_u64().unwrap_or_else(|| panic!("no accepted in {json}"));
    let dropped = json["dropped"].as_u64().unwrap_or(0);
    assert!(
        accepted + dropped <= world.max_events_per_request as u64,
        "{accepted} events accepted and {dropped} dropped past the limit of {}: {json}",
        world.max_events_per_request
    );
    let replayed = headers.get("idempotent-replayed").is_some();
    if accepted == 0 {
        assert!(json["dropped"].as_u64().is_some_and(|d| d > 0), "{json}");
        assert!(json.get("offsets").is_none(), "{json}");
        assert_eq!(before, after, "a request whose events were all dropped appended nothing");
        return;
    }
    let first = json["offsets"][0].as_u64().unwrap_or_else(|| panic!("no offsets in {json}"));
    let last = json["offsets"][1].as_u64().unwrap_or_else(|| panic!("no offsets in {json}"));
    assert_eq!(last - first + 1, accepted, "{json}");
    if replayed {
        assert_eq!(before, after, "a replay appended");
        assert!(last < before, "a replay names offsets already in the log: {json}");
        // The whole batch of one earlier 200 of this input, for this source: every offset
        // it names was answered, from the first record of a batch to its last.
        let earlier = |offset: u64| {
            let payload = answered
                .iter()
                .find(|(o, _)| *o == offset)
                .map(|(_, p)| p)
                .unwrap_or_else(|| panic!("a replay names offset {offset}, never answered 200: {json} for {req:?}"));
            Envelope::decode(payload).expect("an answered record is an envelope").header
        };
        let (head, tail) = (earlier(first), earlier(last));
        assert_eq!(head.source_key, req.source.unwrap_or(""), "a replay of another source's delivery: {req:?}");
        assert_eq!((head.batch_index, u64::from(head.batch_len)), (0, accepted), "not a whole batch: {json}");
        assert_eq!(tail.batch_index + 1, tail.batch_len, "not a whole batch: {json}");
        return;
    }
    assert_eq!((first, after - before), (before, accepted), "a 200 appended exactly what it names: {json}");
    let records: Vec<_> = wal::inspect::Records::new(&world.wal, first)
        .expect("a reader")
        .take(accepted as usize)
        .map(|r| r.expect("an appended record reads back"))
        .collect();
    assert_eq!(records.len() as u64, accepted);
    answered.extend(records.iter().map(|r| (r.offset, r.payload.clone())));
    let source = req.source.unwrap_or("");
    for (i, r) in records.iter().enumerate() {
        let env = Envelope::decode(&r.payload).expect("an appended record is an envelope");
        assert_eq!(env.header.source_key, source, "{req:?}");
        assert_eq!((env.header.batch_index as usize, u64::from(env.header.batch_len)), (i, accepted));
        let payload: &[u8] = &env.payload;
        assert!(!payload.is_empty(), "an empty event was appended");
        assert!(
            req.body.windows(payload.len()).any(|w| w == payload),
            "record {i} holds bytes that are not in the body: {:?}",
            String::from_utf8_lossy(payload)
        );
    }
}

/// Whether a 200 is allowed for `req` by its auth: always on the source without auth;
/// otherwise only with the right credentials, and for the timestamped schemes (Standard
/// Webhooks, Stripe) only when signed within the tolerance (a second of slack either
/// way: the door reads the clock a moment after the harness). Whatever headers the
/// request sets itself: a scheme's header it sets beside the harness's (added after
/// it) is given twice, which no scheme takes, and one the harness does not set carries
/// no signature the fuzzer could compute.
fn authenticated(req: &Req) -> bool {
    let Some(source) = req.source else { return true };
    if source == "open" {
        return true;
    }
    match req.auth {
        AuthMode::Valid { skew } => !matches!(source, "svix" | "stripe") || skew.unsigned_abs() <= TOLERANCE_SECS + 1,
        AuthMode::None | AuthMode::OtherBody | AuthMode::Garbage => false,
    }
}

/// One seed request: a POST to a source (`path` 0) or the active endpoint (`path` 3),
/// with a content type (0 none, 1 JSON, 2 NDJSON, 3 text), a body of under 600 bytes and
/// an auth mode (0 none, 1 valid, 3 skewed, 4 over other bytes, 5 garbage).
#[derive(Debug, Clone)]
pub struct Seed<'a> {
    pub path: u8,
    pub source: u8,
    pub content_type: u8,
    pub body: &'a str,
    pub auth: u8,
}

/// Encodes requests the way [`run`] decodes them, for the seed corpus.
pub fn encode_seed(setup: Setup, requests: &[Seed<'_>]) -> Vec<u8> {
    let mut out = vec![setup.encode(), requests.len().saturating_sub(1) as u8];
    for r in requests {
        out.push(0); // POST
        out.push(r.path);
        if r.path <= 2 {
            out.push(r.source);
        }
        out.push(1); // no query
        out.push(r.content_type);
        out.push(0); // no extra headers
        out.push(0); // a raw body
        out.extend_from_slice(&(r.body.len() as u16).to_le_bytes());
        out.extend_from_slice(r.body.as_bytes());
        out.push(r.auth);
        out.push(0); // with a peer address
    }
    out
}
