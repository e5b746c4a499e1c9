//! The webhook listener's routes: named source paths, secret-path endpoints, the GET
//! handshake and `/health`.
//!
//! Invariants:
//! - 200 is answered only after the ingest core's append resolved; the body is
//!   `{"accepted": n, "offsets": [first, last]}`, plus `"dropped": d` when the route
//!   dropped events. A request whose every event was dropped appends nothing and is
//!   answered `{"accepted": 0, "dropped": d}`.
//! - Every other answer is an [`ApiError`] with a JSON body, and nothing is appended:
//!   all checks (draining, size, timeouts, auth, decoding, delivery id, destinations)
//!   run before the append, and once the append resolved `Ok` the answer is 200.
//! - Destinations are resolved here, at the door ([`crate::resolve`]): a refused
//!   destination is a 422 naming the reason, while the sender still owns the event.
//! - What a request's head alone fails to authenticate ([`AuthScheme::verify_head`]: no
//!   credentials, a wrong bearer token, a malformed signature header) is answered 401
//!   before its body is read.
//! - A secret-path endpoint is looked up when the request head arrives (404/410 before
//!   any body is read) and checked again once the body was read
//!   ([`EndpointRegistry::recheck`]); the request is authenticated against the version
//!   current then, and the permit that check returns is held until the append resolved
//!   (in the append's own task, so a client that disconnects does not release it early).
//!   So once a rotate or revoke answered, nothing authorised by the old record is
//!   appended.
//! - Every request takes its room in the ingest core ([`ingest::ingestor::Ingestor::room`],
//!   256 MiB in all) once its body was read and before it is decoded, for the most the
//!   body can become, and holds it until its append resolved: what requests hold is
//!   bounded in all, not by the number of connections. It is authenticated first
//!   (against the source, or the endpoint version that admitted its head, unless a
//!   rotate installed another since): the room is taken in order and sized by the
//!   request's own headers and body, so one that cannot authenticate never waits for
//!   it, and never holds up those behind.
//! - What the log took is counted once the log holds it, whether or not the request
//!   still waits: a client that disconnects while its events are appended leaves them
//!   in the log (and delivered), so they are counted as accepted (`events_accepted`,
//!   the source's status, its `accepted_requests` included, routing's counts) all the
//!   same ([`wal::Wal::append_observed`]). Only its answer, which no one received, is
//!   not: `iggy_ingest_http_requests_total` counts requests by the class of the answer
//!   they got. (A runtime shutting down runs no new task: a request dropped in that
//!   moment, whose batch then becomes durable, goes uncounted; the counts are the
//!   process's own and end with it.)
//! - Metrics labels are the source key (from configuration, never from the request),
//!   status class and fixed reasons: never paths, ids or peer addresses.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::BodyExt;
use ingest::log_limit::LogLimit;
use ingest::{IngestError, Ingestor, MetadataValue, Submission};
use serde_json::json;

use crate::auth::AuthScheme;
use crate::body::{self, BodyError};
use crate::endpoints::{EndpointRegistry, EndpointVersion, Refusal, parse_id};
use crate::error::ApiError;
use crate::health::Health;
use crate::metrics::{DoorMetrics, SourceMetrics};
use crate::resolve::resolve;
use crate::source::{
    DELIVERY_ID_HEADERS, DELIVERY_KEY_MAX_BYTES, HEADER_VALUE_MAX_BYTES, METADATA_PEER_ADDR, METADATA_RECEIVED_AT,
    SourceSpec,
};
use crate::status::{SourceStatus, StatusBoard};

/// The peer address of a connection, put into each request's extensions by the server.
/// Its text (the `peer_addr` metadata value) is formatted once per connection, not once
/// per request.
#[derive(Debug, Clone)]
pub struct PeerAddr {
    pub addr: SocketAddr,
    pub text: Arc<str>,
}

impl PeerAddr {
    pub fn new(addr: SocketAddr) -> PeerAddr {
        PeerAddr { addr, text: addr.to_string().into() }
    }
}

/// Request limits of the webhook listener.
#[derive(Debug, Clone)]
pub struct DoorLimits {
    pub max_body_bytes: usize,
    /// Most events one request (an NDJSON batch) may hold; more is a 413.
    pub max_events_per_request: usize,
    pub body_read_timeout: Duration,
    /// `Retry-After` sent with 503 answers.
    pub retry_after_secs: u64,
}

/// Everything the routes share.
pub struct Door {
    pub sources: HashMap<String, Arc<SourceSpec>>,
    pub endpoints: Arc<EndpointRegistry>,
    pub ingestor: Ingestor,
    pub limits: DoorLimits,
    pub health: Arc<Health>,
    pub status: Arc<StatusBoard>,
    pub metrics: DoorMetrics,
}

/// The webhook listener's router.
pub fn router(door: Arc<Door>) -> Router {
    Router::new()
        .route("/v1/sources/{key}", post(post_source))
        .route("/v1/e/{endpoint_id}", post(post_endpoint).get(get_handshake))
        .route("/health", get(health))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::map_request(host_checked))
        .with_state(door)
}

/// A request whose `Host` the webhook listener refuses (`host.rs`), counted like every
/// refusal of the door; any other goes on to its route.
async fn host_checked(req: Request) -> Result<Request, Response> {
    match crate::host::refusal_of(&req) {
        None => Ok(req),
        Some(e) => {
            count("-", "4xx", e.code);
            Err(e.into_response())
        }
    }
}

async fn not_found(req: Request) -> Response {
    count("-", "4xx", "not_found");
    before_body(req.headers(), ApiError::not_found("no such path")).into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    count("-", "4xx", "method_not_allowed");
    before_body(req.headers(), ApiError::method_not_allowed()).into_response()
}

/// Whether a request's framing says a body follows: a `Content-Length` other than 0, or
/// a `Transfer-Encoding`.
fn declares_body(headers: &HeaderMap) -> bool {
    headers.contains_key(header::TRANSFER_ENCODING) || content_length(headers).is_some_and(|len| len > 0)
}

/// `e`, answered before the request's body was read: closing the connection when the
/// request declared one ([`ApiError::closing`]). (hyper reads on past a body that
/// already arrived whole, and closes the connection on one that did not; which one it
/// is cannot be known here, so a declared body closes it.)
pub fn before_body(headers: &HeaderMap, e: ApiError) -> ApiError {
    if declares_body(headers) { e.closing() } else { e }
}

async fn health(State(door): State<Arc<Door>>) -> Response {
    health_answer(&door.health)
}

/// The `/health` answer of both listeners: 200 while accepting, 503 otherwise.
pub fn health_answer(health: &Health) -> Response {
    let state = health.state();
    let status = if state.is_accepting() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(json!({"status": state.as_str()}))).into_response()
}

use crate::metrics::count_answer as count;

/// A path segment that does not percent-decode to UTF-8 names nothing: 404 like any
/// other unknown name (`no such {what}`), never axum's plain-text rejection. The admin
/// API's path parameters go through it too.
pub fn path_param(path: Result<Path<String>, PathRejection>, what: &str) -> Result<String, ApiError> {
    path.map(|Path(s)| s).map_err(|_| ApiError::not_found(format!("no such {what}")))
}

/// [`path_param`] for the webhook routes, counted like every other refusal of the door.
fn path_segment(path: Result<Path<String>, PathRejection>, what: &str) -> Result<String, ApiError> {
    path_param(path, what).inspect_err(|_| count("-", "4xx", "not_found"))
}

async fn post_source(
    State(door): State<Arc<Door>>,
    key: Result<Path<String>, PathRejection>,
    req: Request,
) -> Response {
    let key = match path_segment(key, "source") {
        Ok(k) => k,
        Err(e) => return before_body(req.headers(), e).into_response(),
    };
    let Some(source) = door.sources.get(&key).filter(|s| s.named_path).cloned() else {
        count("-", "4xx", "not_found");
        return before_body(req.headers(), ApiError::not_found("no such source")).into_response();
    };
    receive(&door, source, Entrance::SourcePath, req).await
}

async fn post_endpoint(
    State(door): State<Arc<Door>>,
    id: Result<Path<String>, PathRejection>,
    req: Request,
) -> Response {
    let id = match path_segment(id, "endpoint") {
        Ok(id) => id,
        Err(e) => return before_body(req.headers(), e).into_response(),
    };
    let endpoint = match resolve_endpoint(&door, &id) {
        Ok(e) => e,
        Err(e) => return before_body(req.headers(), e).into_response(),
    };
    let Some(source) = door.sources.get(&endpoint.endpoint.source_key).cloned() else {
        count("-", "4xx", "not_found");
        return before_body(req.headers(), ApiError::not_found("no such endpoint")).into_response();
    };
    receive(&door, source, Entrance::Endpoint(endpoint), req).await
}

fn resolve_endpoint(door: &Door, id: &str) -> Result<Arc<EndpointVersion>, ApiError> {
    let now = ingest::time::now_unix_ms();
    let Some(id) = parse_id(id) else {
        count("-", "4xx", "not_found");
        return Err(ApiError::not_found("no such endpoint"));
    };
    door.endpoints.lookup(id, now).map_err(|refusal| {
        count("-", "4xx", refusal_reason(refusal));
        refusal_error(refusal)
    })
}

fn refusal_reason(refusal: Refusal) -> &'static str {
    match refusal {
        Refusal::Unknown | Refusal::Revoked | Refusal::Unusable => "not_found",
        Refusal::Expired => "endpoint_expired",
    }
}

/// Revoked answers like unknown (404): a leaked URL tells nothing. Expired is 410.
fn refusal_error(refusal: Refusal) -> ApiError {
    match refusal {
        Refusal::Unknown | Refusal::Revoked | Refusal::Unusable => ApiError::not_found("no such endpoint"),
        Refusal::Expired => ApiError::new(StatusCode::GONE, "endpoint_expired", "this endpoint has expired"),
    }
}

async fn get_handshake(
    State(door): State<Arc<Door>>,
    id: Result<Path<String>, PathRejection>,
    RawQuery(query): RawQuery,
) -> Response {
    let id = match path_segment(id, "endpoint") {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let started = Instant::now();
    let endpoint = match resolve_endpoint(&door, &id) {
        Ok(e) => e,
        Err(e) => return e.into_response(),
    };
    let endpoint = &endpoint.endpoint;
    let answer = handshake_answer(&door, endpoint, query.as_deref().unwrap_or(""));
    // Timed as every request to a source is, so that the histogram's count is its
    // requests' count.
    if let Some(m) = door.metrics.source(&endpoint.source_key) {
        m.request_duration.record(started.elapsed().as_secs_f64());
    }
    answer
}

/// The answer to a GET handshake on `endpoint`: the challenge echoed, or a refusal.
fn handshake_answer(door: &Door, endpoint: &crate::Endpoint, query: &str) -> Response {
    let refused = |e: ApiError| refused(door, &endpoint.source_key, e);
    let Some(param) = endpoint.handshake_param.as_deref() else {
        // A 405 names the methods the resource takes (RFC 9110, 15.5.6), as axum's own do.
        let mut refused = refused(ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "this endpoint has no GET handshake",
        ));
        refused.headers_mut().insert(header::ALLOW, HeaderValue::from_static("POST"));
        return refused;
    };
    let invalid = |why: &str| {
        refused(ApiError::new(StatusCode::BAD_REQUEST, "invalid_challenge", format!("query parameter {param:?} {why}")))
    };
    match query_values(query, param)[..] {
        [Some(ref challenge)] => {
            count(&endpoint.source_key, "2xx", "handshake");
            // The echo is attacker-chosen text: never let a browser sniff it into HTML.
            (
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8"), (header::X_CONTENT_TYPE_OPTIONS, "nosniff")],
                challenge.clone(),
            )
                .into_response()
        }
        [] => refused(ApiError::new(
            StatusCode::BAD_REQUEST,
            "missing_challenge",
            format!("query parameter {param:?} is required"),
        )),
        // Echoing one of two, or a value with its bytes replaced, would answer a check
        // the provider did not ask: it would fail there, with nothing said here.
        [None] => invalid("does not decode to UTF-8"),
        [_, _, ..] => invalid("is given more than once"),
    }
}

/// The values of query parameter `name` in `query`, decoded as a form's are (`+` a
/// space, then percent-escapes): `None` for one whose bytes are not UTF-8. A name is
/// compared decoded too.
fn query_values(query: &str, name: &str) -> Vec<Option<String>> {
    let decoded = |text: &str| -> Option<String> {
        let spaced = text.replace('+', " ");
        percent_encoding::percent_decode_str(&spaced).decode_utf8().ok().map(|s| s.into_owned())
    };
    query
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| pair.split_once('=').unwrap_or((pair, "")))
        .filter(|(n, _)| decoded(n).as_deref() == Some(name))
        .map(|(_, value)| decoded(value))
        .collect()
}

/// How a request came in, which says what it is authenticated against.
enum Entrance {
    /// `POST /v1/sources/{key}`: the source's own auth, fixed by configuration.
    SourcePath,
    /// `POST /v1/e/{id}`: the endpoint as its lookup found it when the head arrived.
    Endpoint(Arc<EndpointVersion>),
}

/// The common path of every event-carrying request.
async fn receive(door: &Door, source: Arc<SourceSpec>, entrance: Entrance, req: Request) -> Response {
    let started = Instant::now();
    // Looked up once per request: the per-source handles do not change while it runs.
    let metrics = door.metrics.source(&source.key);
    let status = door.status.get(&source.key);
    let result = receive_inner(door, &source, metrics, status, entrance, req).await;
    if let Some(m) = metrics {
        m.request_duration.record(started.elapsed().as_secs_f64());
    }
    match result {
        Ok(resp) => resp,
        Err(e) => refused(door, &source.key, e),
    }
}

/// A request that failed authentication against `scheme`: logged (at most once per
/// interval), counted by reason, and answered 401 with no detail (its challenge names
/// `scheme`).
fn auth_refused(
    source: &SourceSpec,
    scheme: &AuthScheme,
    failure: crate::auth::AuthFailure,
    peer: Option<&PeerAddr>,
) -> ApiError {
    static LOG: LogLimit = LogLimit::every(LOG_INTERVAL);
    if let Some(suppressed) = LOG.admit() {
        tracing::warn!(source = %source.key, reason = failure.reason(), peer = ?peer.map(|p| p.addr), suppressed, "request failed authentication");
    }
    metrics::counter!("iggy_ingest_auth_failures_total", "source" => source.key.clone(), "reason" => failure.reason())
        .increment(1);
    ApiError::unauthorized(scheme.challenge(), "iggy-ingest")
}

/// The answer to a request of `source` refused with `e` (a POST's or a handshake's):
/// counted under its code, and in the source's status as the last request it refused.
fn refused(door: &Door, source: &str, e: ApiError) -> Response {
    let class = if e.status.is_server_error() { "5xx" } else { "4xx" };
    count(source, class, e.code);
    if let Some(s) = door.status.get(source) {
        s.rejected(e.code, &e.message, ingest::time::now_unix_ms());
    }
    e.into_response()
}

async fn receive_inner(
    door: &Door,
    source: &SourceSpec,
    metrics: Option<&Arc<SourceMetrics>>,
    status: Option<&Arc<SourceStatus>>,
    entrance: Entrance,
    req: Request,
) -> Result<Response, ApiError> {
    let received_at_unix_ms = ingest::time::now_unix_ms();
    if door.health.is_refusing() {
        let e = ApiError::unavailable("shutting_down", "the daemon is shutting down", door.limits.retry_after_secs);
        return Err(before_body(req.headers(), e));
    }
    let (mut parts, body) = req.into_parts();
    let peer = parts.extensions.get::<PeerAddr>();
    let max = door.limits.max_body_bytes;
    if let Some(len) = content_length(&parts.headers)
        && len > max as u64
    {
        return Err(too_large(max).closing());
    }
    if let Some(refused) = coding_refused(&parts.headers) {
        return Err(refused.closing());
    }
    // What the head alone fails (no credentials, a wrong bearer token, a signature
    // header missing or not of the scheme's form) is refused before the body is read:
    // a sender that cannot authenticate holds no body buffer, and no read of one.
    let admitted_by: &AuthScheme = match &entrance {
        Entrance::SourcePath => &source.auth,
        Entrance::Endpoint(seen) => &seen.endpoint.auth,
    };
    if let Err(failure) = admitted_by.verify_head(&parts.headers) {
        return Err(before_body(&parts.headers, auth_refused(source, admitted_by, failure, peer)));
    }
    let body = read_body(body, max, door.limits.body_read_timeout).await?;

    // Authenticated before the room is taken, against the source's scheme or the
    // endpoint version that admitted the head: the room a request asks for is sized by
    // its own headers and body (an NDJSON body of newlines can ask for all of it), and
    // one that waits for room makes every request after it wait (the room is taken in
    // order), so a sender that cannot authenticate must not get that far.
    let authenticated = match admitted_by.verify(&parts.headers, &body, received_at_unix_ms) {
        Ok(()) => true,
        Err(failure) => {
            // Unless a rotate installed another version while the body was read, and the
            // sender already signs with its secret: checked against that version here,
            // before the room, and again after it (`recheck`), which decides. An endpoint
            // revoked or expired meanwhile answers as the check after the body promises
            // (404, 410), whatever the credentials.
            let rotated_to = match &entrance {
                Entrance::SourcePath => None,
                Entrance::Endpoint(seen) => {
                    let current =
                        door.endpoints.lookup(seen.endpoint.id, ingest::time::now_unix_ms()).map_err(refusal_error)?;
                    (!Arc::ptr_eq(&current, seen)).then_some(current)
                }
            };
            let Some(current) = rotated_to else {
                return Err(auth_refused(source, admitted_by, failure, peer));
            };
            if let Err(failure) = current.endpoint.auth.verify(&parts.headers, &body, received_at_unix_ms) {
                return Err(auth_refused(source, &current.endpoint.auth, failure, peer));
            }
            false
        }
    };

    // The room the request's append runs in, for the most it will hold once decoded:
    // its body may become many events, each with a record's envelope. Taken by every
    // request, before anything else it holds: what requests hold is bounded in all, not
    // by the number of connections.
    // Routing's fields are kept for every event while the request is decoded and
    // resolved: the objects along their paths, and the strings at their ends (copies of
    // parts of the body).
    let fields = source.fields_read();
    let room = {
        let content_type = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
        let events = body::events_at_most(content_type, &body, door.limits.max_events_per_request);
        let kept_leaves_bytes = if fields.is_empty() { 0 } else { body.len() };
        let per_event_bytes = source.envelope_max_bytes() + crate::json_fields::kept_bytes_max(&fields);
        let bound = ingest::ingestor::footprint_bound(body.len() as u64, events as u64, per_event_bytes as u64)
            .saturating_add(kept_leaves_bytes as u64);
        door.ingestor.room(bound).await.map_err(|e| ingest_error(e, door.limits.retry_after_secs))?
    };
    // The endpoint may have been rotated, revoked or expired while the body was read:
    // decide again, and hold the permit until the append resolved. The room was taken
    // first: waiting for room with the permit held would hold off every change to the
    // endpoint (and every registration) for as long.
    let (endpoint, permit) = match &entrance {
        Entrance::SourcePath => (None, None),
        Entrance::Endpoint(seen) => {
            let (current, permit) =
                door.endpoints.recheck(seen, ingest::time::now_unix_ms()).await.map_err(refusal_error)?;
            // A rotate installed another version while the body was read: its secret
            // decides (the version that admitted the head may no longer). A request the
            // first check refused is checked again whatever the versions: that refusal
            // stands unless the version current now takes it.
            if (!authenticated || !Arc::ptr_eq(seen, &current))
                && let Err(failure) = current.endpoint.auth.verify(&parts.headers, &body, received_at_unix_ms)
            {
                return Err(auth_refused(source, &current.endpoint.auth, failure, peer));
            }
            (Some(current), Some(permit))
        }
    };
    let auth: &AuthScheme = endpoint.as_ref().map_or(&source.auth, |e| &e.endpoint.auth);
    // Checked, the signature is done with: a header a configured name chose to carry it
    // (an hmac scheme's `auth_header`, which no name-based credential check knows) is
    // dropped here, so nothing after (forwarded headers, a partition key, a delivery id)
    // can copy into the log a signature with no timestamp in it, that any consumer could
    // post again. The configuration refuses naming it for a source and its static
    // endpoints; a dynamic endpoint's registration can choose any name.
    for scheme in [admitted_by, auth] {
        if let Some(signature) = scheme.configured_signature_header() {
            parts.headers.remove(signature);
        }
    }

    // One value, or none: a blank one is none (it would travel as an empty header).
    let content_types = parts.headers.get_all(header::CONTENT_TYPE).iter().count();
    if content_types > 1 {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_content_type",
            format!("Content-Type is given {content_types} times; one is accepted"),
        ));
    }
    let content_type = match parts.headers.get(header::CONTENT_TYPE) {
        None => None,
        Some(v) if v.as_bytes().trim_ascii().is_empty() => None,
        Some(v) if v.len() > HEADER_VALUE_MAX_BYTES => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_content_type",
                format!("Content-Type is {} bytes long; at most {HEADER_VALUE_MAX_BYTES} are accepted", v.len()),
            ));
        }
        Some(v) => Some(v.to_str().map_err(|_| {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_content_type", "Content-Type is not valid ASCII")
        })?),
    };
    let delivery_key = if source.idempotency { delivery_key(source, auth, &parts.headers)? } else { None };
    // A retry of a delivery the log already holds is a replay, also when its body or its
    // route would be refused now (a mapping, a content rule or a limit changed since it
    // was accepted): the sender was answered 200 for it, and must not be told otherwise.
    let endpoint_id = endpoint.as_ref().map(|e| e.endpoint.id);
    // A state database that cannot say answers 503, not the refusal: the delivery may be
    // one the log holds.
    // `dropped`: the events the route of now drops from the retry's body (docs/routing.md:
    // a replay says so, as its first answer did); 0 where the retry would be refused.
    let replay = async |dropped: u64| -> Result<Option<Response>, ApiError> {
        let Some(delivery_key) = delivery_key.clone() else { return Ok(None) };
        let key = ingest::IdempotencyKey { source_key: source.key.clone(), endpoint_id, delivery_key };
        let accepted = door.ingestor.replay_of(&key, received_at_unix_ms).await;
        let Some(accepted) = accepted.map_err(|e| ingest_error(e, door.limits.retry_after_secs))? else {
            return Ok(None);
        };
        if let Some(s) = status {
            s.accepted(accepted.events, true);
        }
        if let Some(m) = metrics {
            m.requests_2xx.increment(1);
        }
        Ok(Some(accepted_response(&accepted, dropped)))
    };
    let max_events = door.limits.max_events_per_request;
    let decoded = match body::decode_with(content_type, body, source.accept, &fields, max_events) {
        Ok(d) => d,
        Err(e) => {
            let status = match e {
                BodyError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
                BodyError::TooManyEvents { .. } => StatusCode::PAYLOAD_TOO_LARGE,
                _ => StatusCode::BAD_REQUEST,
            };
            return replay(0).await?.ok_or_else(|| ApiError::new(status, e.reason(), e.to_string()));
        }
    };

    let routing = metrics.map(|m| &m.routing);
    let resolution = match resolve(source, &parts.headers, decoded.events, decoded.lines.as_deref(), decoded.values) {
        Ok(r) => r,
        Err(r) => {
            if let Some(replayed) = replay(0).await? {
                return Ok(replayed);
            }
            if let Some(m) = routing {
                m.refused(r.kind);
            }
            return Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, r.kind.code(), r.message));
        }
    };
    if resolution.events.is_empty() {
        if let Some(replayed) = replay(resolution.dropped).await? {
            return Ok(replayed);
        }
        // Every event was dropped by the route: nothing to append, and the sender is
        // told how many were dropped.
        if let Some(m) = metrics {
            m.routing.unmatched(resolution.defaulted, resolution.dropped);
            m.requests_2xx.increment(1);
        }
        if let Some(s) = status {
            s.accepted(0, false);
        }
        return Ok(AcceptedBody { accepted: 0, offsets: None, dropped: Some(resolution.dropped) }.into_response());
    }
    let (headers, clamped) = forward_headers(source, &parts.headers);
    let mut metadata = Vec::with_capacity(2);
    if source.metadata.peer_addr
        && let Some(p) = peer
    {
        metadata.push((METADATA_PEER_ADDR, MetadataValue::Text(p.text.clone())));
    }
    if source.metadata.received_at {
        metadata.push((METADATA_RECEIVED_AT, MetadataValue::Decimal(received_at_unix_ms)));
    }
    let submission = Submission {
        source_key: source.key.clone(),
        endpoint_id,
        content_type: decoded.content_type,
        metadata,
        headers,
        delivery_key,
        events: resolution.events,
        received_at_unix_ms,
    };
    let counted = AcceptanceCount {
        status: status.cloned(),
        metrics: metrics.cloned(),
        clamped,
        defaulted: resolution.defaulted,
        dropped: resolution.dropped,
        key_misses: resolution.key_misses,
    };
    let on_accepted = move |accepted: &ingest::Accepted| counted.count(accepted);
    let accepted = match permit {
        None => door.ingestor.accept_in(submission, room, on_accepted).await,
        Some(permit) => door.ingestor.accept_holding(submission, permit, room, on_accepted).await,
    };
    let accepted = accepted.map_err(|e| ingest_error(e, door.limits.retry_after_secs))?;
    fail_points::fail_point!("door.append.synced");
    if let Some(m) = metrics {
        m.requests_2xx.increment(1);
    }
    Ok(accepted_response(&accepted, resolution.dropped))
}

/// What an acceptance is counted by, and what routing decided for its events: counted
/// when the log holds them (or, for a replay, when found), whether or not the request
/// still waits (see the module invariants). Kept to a few words: it is carried in the
/// request's future, which is moved by value on its way down.
struct AcceptanceCount {
    status: Option<Arc<SourceStatus>>,
    metrics: Option<Arc<SourceMetrics>>,
    /// Forwarded header values cut to what Iggy takes.
    clamped: u64,
    defaulted: u64,
    dropped: u64,
    key_misses: crate::partition::KeyMisses,
}

impl AcceptanceCount {
    fn count(self, accepted: &ingest::Accepted) {
        if let Some(s) = &self.status {
            s.accepted(accepted.events, accepted.replayed);
        }
        // A replay stored nothing: nothing cut, routed or accepted now.
        if accepted.replayed {
            return;
        }
        if let Some(m) = &self.metrics {
            m.events_accepted.increment(accepted.events);
            if self.clamped > 0 {
                m.header_values_clamped.increment(self.clamped);
            }
            m.routing.unmatched(self.defaulted, self.dropped);
            m.routing.key_misses(self.key_misses);
        }
    }
}

/// The 200 for events in the log: appended now, or (`replayed`) earlier.
fn accepted_response(accepted: &ingest::Accepted, dropped: u64) -> Response {
    let body = AcceptedBody {
        accepted: accepted.events,
        offsets: Some([accepted.first_offset, accepted.last_offset]),
        dropped: (dropped > 0).then_some(dropped),
    };
    let mut resp = body.into_response();
    if accepted.replayed {
        resp.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    resp
}

/// The body of a 200: `{"accepted": n, "offsets": [first, last]}` when something was
/// appended, and `"dropped": n` when the route dropped some of the request's events.
/// Written by hand, byte for byte what `serde_json` writes for this struct (a test holds
/// the two together), without a serializer: every 200 carries one.
#[derive(serde::Serialize)]
struct AcceptedBody {
    accepted: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    offsets: Option<[u64; 2]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dropped: Option<u64>,
}

impl AcceptedBody {
    /// Three numbers of at most 20 digits each and the punctuation around them.
    const JSON_MAX_BYTES: usize = 128;

    /// The JSON, written into a buffer on the stack and copied once into the body's
    /// `Bytes` (a `Vec` whose length is not its capacity would take a second allocation).
    fn to_json(&self) -> Bytes {
        let mut out = [0u8; Self::JSON_MAX_BYTES];
        let mut len = 0;
        let mut put = |part: &[u8]| {
            out[len..len + part.len()].copy_from_slice(part);
            len += part.len();
        };
        let mut digits = itoa::Buffer::new();
        put(b"{\"accepted\":");
        put(digits.format(self.accepted).as_bytes());
        if let Some([first, last]) = self.offsets {
            put(b",\"offsets\":[");
            put(digits.format(first).as_bytes());
            put(b",");
            put(digits.format(last).as_bytes());
            put(b"]");
        }
        if let Some(dropped) = self.dropped {
            put(b",\"dropped\":");
            put(digits.format(dropped).as_bytes());
        }
        put(b"}");
        Bytes::copy_from_slice(&out[..len])
    }
}

impl IntoResponse for AcceptedBody {
    /// A 200 with `Content-Type: application/json`, as `axum::Json` answers.
    fn into_response(self) -> Response {
        let mut resp = Response::new(Body::from(self.to_json()));
        resp.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        resp
    }
}

/// A body sent in a coding the door does not undo, refused before it is read: a
/// `Content-Encoding` other than `identity` (415 `unsupported_content_encoding`: its
/// bytes are not what its `Content-Type` says, and would be stored and delivered as if
/// they were), or a `Transfer-Encoding` other than `chunked` (501
/// `unsupported_transfer_coding`, RFC 9112 section 6.1; hyper takes the chunked
/// framing off and would leave the rest).
fn coding_refused(headers: &HeaderMap) -> Option<ApiError> {
    let named = |value: &HeaderValue| match value.to_str() {
        Ok(text) if text.len() <= 64 => format!(" ({})", text.trim()),
        _ => String::new(),
    };
    // The first value of header `name` that lists a coding other than `allowed` (blank
    // list members are none).
    let only = |name: header::HeaderName, allowed: &str| {
        headers.get_all(name).iter().find(|value| {
            value
                .as_bytes()
                .split(|b| *b == b',')
                .map(<[u8]>::trim_ascii)
                .any(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(allowed.as_bytes()))
        })
    };
    if let Some(value) = only(header::CONTENT_ENCODING, "identity") {
        return Some(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_content_encoding",
            format!("the body is in a content coding{}; send it without one (identity)", named(value)),
        ));
    }
    if let Some(value) = only(header::TRANSFER_ENCODING, "chunked") {
        return Some(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "unsupported_transfer_coding",
            format!("the body is in a transfer coding other than chunked{}", named(value)),
        ));
    }
    None
}

fn too_large(max: usize) -> ApiError {
    ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "body_too_large", format!("body exceeds max_body_bytes ({max})"))
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

/// Reads a whole body of at most `max` bytes within `timeout` of the first byte wait:
/// 413 past `max`, 408 after `timeout`, 400 when reading fails; each closing the
/// connection, whose request body was not read to its end.
pub async fn read_body(body: Body, max: usize, timeout: Duration) -> Result<Bytes, ApiError> {
    let mut collect = std::pin::pin!(collect_bounded(body, max));
    // A body that came in with its headers is complete at the first poll; a timer is
    // armed only for one that has to be waited for.
    let first = std::future::poll_fn(|cx| std::task::Poll::Ready(collect.as_mut().poll(cx))).await;
    let collected = match first {
        std::task::Poll::Ready(r) => r,
        std::task::Poll::Pending => match tokio::time::timeout(timeout, collect).await {
            Ok(r) => r,
            Err(_) => {
                return Err(ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "body_read_timeout",
                    "the body was not received in time",
                )
                .closing());
            }
        },
    };
    match collected {
        Err(BodyReadError::TooLarge) => Err(too_large(max).closing()),
        Err(BodyReadError::Failed(e)) => {
            Err(ApiError::new(StatusCode::BAD_REQUEST, "body_read_failed", format!("reading the body failed: {e}"))
                .closing())
        }
        Ok(bytes) => Ok(bytes),
    }
}

/// The most a body in pieces can become once `arrived` bytes came: the whole body when its
/// framing says what is still to come (`to_come`, hyper's exact hint for a `Content-Length`
/// body: the rest, not the whole), never past `max`.
fn joined_bound(arrived: usize, to_come: Option<u64>, max: usize) -> usize {
    match to_come {
        Some(rest) => arrived.saturating_add(usize::try_from(rest).unwrap_or(usize::MAX)).min(max),
        None => max,
    }
}

/// The buffer a body in pieces is first joined into: twice what came, within `bound`.
/// Never what the framing announces: a `Content-Length` is the client's word, and a buffer
/// sized by it let a client that sent two bytes of an announced 1 MiB body hold 1 MiB
/// until the body-read timeout, before any signature was checked (990 such connections,
/// some 100 KB sent, held 985 MiB). Grown by doubling, the copies stay linear in the body.
fn joined_capacity(arrived: usize, bound: usize) -> usize {
    arrived.saturating_mul(2).min(bound)
}

/// Makes room in `buf` for `more` bytes, growing it as `Vec` would (at least twice its
/// capacity) but never past `max` (the body's [`joined_bound`]): `Vec`'s own doubling
/// would take a chunked body of `max` bytes, read in pieces, to a buffer of up to twice
/// `max` before it is shrunk, and an announced body to more than its length.
/// The caller has checked that the body, `more` included, is within `max`.
fn reserve_within(buf: &mut Vec<u8>, more: usize, max: usize) {
    let needed = buf.len().saturating_add(more);
    if needed <= buf.capacity() {
        return;
    }
    let grown = buf.capacity().saturating_mul(2).max(needed).min(max.max(needed));
    buf.reserve_exact(grown - buf.len());
}

enum BodyReadError {
    TooLarge,
    Failed(String),
}

/// `e`'s text followed by its sources', `: `-joined: hyper's own says only "error
/// reading a body from connection", its source what was wrong (a chunk size that is
/// not hex, trailers over the limit, the connection closed early).
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The body's bytes, at most `max` of them, holding nothing of the connection's read
/// buffers once a second frame came. Each frame hyper gives is a slice of its read
/// buffer, and a buffer a slice is still held from is not reused: the next read takes a
/// fresh block of 8 KiB. Keeping the frames (as `collect` does) let a client that sends
/// its body a byte per read hold some 8 KiB per byte, 230 MiB for a 1 MiB body trickled
/// within the body-read timeout, before any auth check. So the first frame is kept as it
/// is (the whole body, for nearly every request: no copy), and from the second on every
/// frame is copied into one buffer and dropped at once; chunk framing is never kept.
async fn collect_bounded(mut body: Body, max: usize) -> Result<Bytes, BodyReadError> {
    let mut first: Option<Bytes> = None;
    let mut copied: Option<(Vec<u8>, usize)> = None;
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| BodyReadError::Failed(with_sources(&e)))?;
        let Ok(data) = frame.into_data() else { continue }; // trailers
        total = total.saturating_add(data.len());
        if total > max {
            return Err(BodyReadError::TooLarge);
        }
        if data.is_empty() {
            continue;
        }
        match (&mut first, &mut copied) {
            (_, Some((buf, bound))) => {
                reserve_within(buf, data.len(), *bound);
                buf.extend_from_slice(&data);
            }
            (None, None) => first = Some(data),
            (Some(_), None) => {
                // Bounded by what the framing says is still to come (hyper's hint is the
                // rest of a `Content-Length` body), sized by what came.
                let bound = joined_bound(total, hyper::body::Body::size_hint(&body).exact(), max);
                let mut buf = Vec::with_capacity(joined_capacity(total, bound));
                buf.extend_from_slice(&first.take().unwrap_or_default());
                buf.extend_from_slice(&data);
                copied = Some((buf, bound));
            }
        }
    }
    Ok(match copied {
        // `Bytes` keeps a `Vec`'s whole capacity: a chunked body's spare room is given
        // back, so the request holds its bytes and no more on its way to the log.
        Some((mut buf, _)) => {
            buf.shrink_to_fit();
            Bytes::from(buf)
        }
        None => first.unwrap_or_default(),
    })
}

/// The request's delivery id. For a request whose signature covers an id (Standard
/// Webhooks), that id and nothing else: an unsigned header (`Idempotency-Key`, the
/// source's `idempotency_header`) beside it is ignored, so that adding one to a captured
/// request cannot make it a new delivery (nor make a new delivery a replay of another).
/// Otherwise the source's `idempotency_header`, then [`DELIVERY_ID_HEADERS`] in order.
fn delivery_key(source: &SourceSpec, auth: &AuthScheme, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let found = match auth.signed_delivery_id_header(headers) {
        Some(signed) => headers.get(signed).map(|v| (signed, v)),
        None => {
            let configured = source.idempotency_header.as_deref().and_then(|name| Some((name, headers.get(name)?)));
            configured.or_else(|| DELIVERY_ID_HEADERS.iter().find_map(|n| Some((n.as_str(), headers.get(n)?))))
        }
    };
    if let Some((name, v)) = found {
        // Which of two ids would be the delivery's? The first is what a signature covers
        // and the last what a forwarded header keeps: neither reading is safe to guess.
        if headers.get_all(name).iter().nth(1).is_some() {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_delivery_id",
                format!("header {name} is sent more than once"),
            ));
        }
        let v = v.to_str().map_err(|_| {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_delivery_id", format!("header {name} is not valid ASCII"))
        })?;
        let v = v.trim();
        if v.is_empty() {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_delivery_id",
                format!("header {name} is empty"),
            ));
        }
        if v.len() > DELIVERY_KEY_MAX_BYTES {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_delivery_id",
                format!("header {name} is longer than {DELIVERY_KEY_MAX_BYTES} bytes"),
            ));
        }
        return Ok(Some(v.to_string()));
    }
    Ok(None)
}

/// The configured headers of a request, each once: a header sent several times forwards
/// its last value, the one Iggy would keep (a message holds one value per header name).
/// So what a request adds to each of its events' envelopes is bounded by the
/// configuration (names x 255 bytes), not by how often a client repeats a header.
/// Never the header the request's hmac signature came in: it is dropped once checked.
/// Also returns how many values were cut to `HEADER_VALUE_MAX_BYTES`.
fn forward_headers(source: &SourceSpec, headers: &HeaderMap) -> (Vec<(String, Vec<u8>)>, u64) {
    let mut out = Vec::new();
    let mut clamped = 0;
    for name in &source.forward_headers {
        if let Some(v) = crate::partition::last_value(headers, name) {
            let bytes = v.as_bytes();
            let value = if bytes.len() > HEADER_VALUE_MAX_BYTES {
                clamped += 1;
                bytes[..HEADER_VALUE_MAX_BYTES].to_vec()
            } else {
                bytes.to_vec()
            };
            out.push((name.clone(), value));
        }
    }
    (out, clamped)
}

/// How often a line that requests can repeat at will is written at most (per call site;
/// the counters count every request).
const LOG_INTERVAL: Duration = Duration::from_secs(1);

fn ingest_error(e: IngestError, retry_after_secs: u64) -> ApiError {
    static FULL: LogLimit = LogLimit::every(LOG_INTERVAL);
    static DISK_FULL: LogLimit = LogLimit::every(LOG_INTERVAL);
    static STATE: LogLimit = LogLimit::every(LOG_INTERVAL);
    static UNAVAILABLE: LogLimit = LogLimit::every(LOG_INTERVAL);
    static STOPPED: LogLimit = LogLimit::every(LOG_INTERVAL);
    static TOO_LATE: LogLimit = LogLimit::every(LOG_INTERVAL);
    match e {
        IngestError::Full { .. } => {
            if let Some(suppressed) = FULL.admit() {
                tracing::warn!(error = %e, suppressed, "log full: answering 503");
            }
            ApiError::unavailable("log_full", "the log is full; retry later", retry_after_secs)
        }
        IngestError::InFlight => ApiError {
            retry_after_secs: Some(1),
            ..ApiError::new(
                StatusCode::CONFLICT,
                "delivery_in_progress",
                "a request with the same delivery id is in progress",
            )
        },
        IngestError::TooLarge { len, max } => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "record_too_large",
            format!("an event of {len} bytes exceeds the record limit of {max} bytes"),
        ),
        IngestError::BatchTooLarge { bytes, max_bytes } => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "batch_too_large",
            format!(
                "the request's events take {bytes} bytes in the log, which holds at most {max_bytes} in one request"
            ),
        ),
        IngestError::Empty => ApiError::new(StatusCode::BAD_REQUEST, "no_events", "body holds no events"),
        IngestError::DiskFull(ref m) => {
            if let Some(suppressed) = DISK_FULL.admit() {
                tracing::warn!(error = %m, suppressed, "the disk holding the log is full: answering 503 until space returns");
            }
            ApiError::unavailable("disk_full", "the disk holding the log is full; retry later", retry_after_secs)
        }
        IngestError::StateUnavailable(ref m) => {
            if let Some(suppressed) = STATE.admit() {
                tracing::error!(error = %m, suppressed, "the state database cannot be read: answering 503");
            }
            ApiError::unavailable(
                "state_unavailable",
                "the daemon's state cannot be read now; retry later",
                retry_after_secs,
            )
        }
        IngestError::Unavailable(ref m) => {
            if let Some(suppressed) = UNAVAILABLE.admit() {
                tracing::error!(error = %m, suppressed, "log append failed");
            }
            ApiError::unavailable("log_unavailable", "the log cannot take events now", retry_after_secs)
        }
        IngestError::Stopped(ref m) => {
            if let Some(suppressed) = STOPPED.admit() {
                tracing::error!(error = %m, suppressed, "the log stopped taking appends; /health now answers 503");
            }
            ApiError::unavailable("log_unavailable", "the log cannot take events now", retry_after_secs)
        }
        IngestError::LookupTooLate { waited_ms, .. } => {
            if let Some(suppressed) = TOO_LATE.admit() {
                tracing::warn!(
                    waited_ms,
                    suppressed,
                    "a request with a delivery id took too long to reach its lookup: answering 503"
                );
            }
            ApiError::unavailable(
                "lookup_too_late",
                "the request took too long between its head and its delivery-id check; retry",
                retry_after_secs,
            )
        }
        IngestError::Internal(ref m) => {
            tracing::error!(error = %m, "internal error while accepting");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "internal error")
        }
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Poll};

    use hyper::body::Frame;

    use super::*;

    const SOURCE_TOKEN: &str = "source-token-0123456789";
    const ENDPOINT_TOKEN: &str = "endpoint-token-0123456789";
    const ENDPOINT_ID: u128 = 0x42;

    /// A door on a new log and state database in `dir`: source `hooks` (bearer
    /// [`SOURCE_TOKEN`]) with one static endpoint ([`ENDPOINT_ID`], bearer
    /// [`ENDPOINT_TOKEN`]), and room for NDJSON batches of up to a million events.
    fn door_in(dir: &std::path::Path) -> Arc<Door> {
        door_on(dir, Arc::new(wal::Wal::open(dir.join("wal"), wal::WalOptions::default()).unwrap()))
    }

    /// [`door_in`], on the log `wal`.
    fn door_on(dir: &std::path::Path, wal: Arc<wal::Wal>) -> Arc<Door> {
        let state = Arc::new(ingest::StateDb::open(dir.join("state.redb")).unwrap());
        let idempotency = Arc::new(ingest::IdempotencyIndex::new(state.clone(), 86_400_000));
        let source = SourceSpec {
            key: "hooks".into(),
            destinations: crate::Destinations::Fixed { stream: "s".into(), topic: "t".into() },
            partitioning: crate::partition::PartitionRule::Fixed(ingest::Partitioning::Balanced),
            admission: crate::admission::Admission::Open,
            accept: crate::Accept::Any,
            named_path: true,
            auth: AuthScheme::Bearer { token: crate::auth::TokenDigest::of(SOURCE_TOKEN) },
            forward_headers: Vec::new(),
            metadata: crate::MetadataFields::default(),
            idempotency_header: None,
            idempotency: true,
        };
        let endpoint = crate::Endpoint {
            id: ENDPOINT_ID,
            source_key: "hooks".into(),
            auth: AuthScheme::Bearer { token: crate::auth::TokenDigest::of(ENDPOINT_TOKEN) },
            handshake_param: None,
            expires_at_unix_ms: None,
            revoked_at_unix_ms: None,
            dynamic: false,
            record: None,
            unusable: None,
        };
        let endpoints = Arc::new(crate::EndpointRegistry::load(state, vec!["hooks".into()], vec![endpoint]).unwrap());
        Arc::new(Door {
            sources: HashMap::from([("hooks".to_string(), Arc::new(source))]),
            endpoints,
            ingestor: ingest::Ingestor::new(wal, idempotency),
            limits: DoorLimits {
                max_body_bytes: 4 * 1024 * 1024,
                max_events_per_request: 1_000_000,
                body_read_timeout: Duration::from_secs(10),
                retry_after_secs: 1,
            },
            health: Arc::default(),
            status: Arc::new(crate::status::StatusBoard::new(["hooks".to_string()])),
            metrics: crate::metrics::DoorMetrics::new(["hooks"]),
        })
    }

    /// POST `body` as NDJSON to `path` with `token`, through the door's router.
    async fn post(door: &Arc<Door>, path: &str, token: &str, body: String) -> StatusCode {
        use tower::ServiceExt;
        let req = Request::builder()
            .method("POST")
            .uri(path)
            .header(header::HOST, "hooks.example")
            .header(header::CONTENT_TYPE, "application/x-ndjson")
            .header(header::AUTHORIZATION, format!("Bearer {token}"))
            .body(Body::from(body))
            .unwrap();
        router(door.clone()).oneshot(req).await.unwrap().status()
    }

    /// A request that cannot authenticate is answered 401 without waiting for room, also
    /// when the room it would ask for (a body of newlines, each line an event) is all of
    /// it and others hold it: the room is taken in order, so waiting for it would hold up
    /// every request behind. One that authenticates waits for its room.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_that_cannot_authenticate_is_refused_without_waiting_for_room() {
        let dir = tempfile::tempdir().unwrap();
        let door = door_in(dir.path());
        // Everything: any request that waits for room waits here.
        let held = door.ingestor.room(ingest::ingestor::RUNNING_ON_MAX_BYTES).await.unwrap();
        let newlines = "\n".repeat(1024 * 1024);
        let endpoint = format!("/v1/e/{}", crate::endpoints::format_id(ENDPOINT_ID));
        for path in ["/v1/sources/hooks", endpoint.as_str()] {
            let answer =
                tokio::time::timeout(Duration::from_secs(5), post(&door, path, "wrong-token", newlines.clone()));
            assert_eq!(answer.await.expect("an unauthenticated request waited for room"), StatusCode::UNAUTHORIZED);
        }

        let (path, token) = ("/v1/sources/hooks".to_string(), SOURCE_TOKEN);
        let waiting = tokio::spawn({
            let door = door.clone();
            async move { post(&door, &path, token, "{\"a\":1}\n".repeat(1000)).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!waiting.is_finished(), "a request ran in room another held");
        drop(held);
        assert_eq!(tokio::time::timeout(Duration::from_secs(10), waiting).await.unwrap().unwrap(), StatusCode::OK);
    }

    /// A body whose pieces come from a channel, as a sender sends them.
    struct ChannelBody(tokio::sync::mpsc::Receiver<Bytes>);

    impl hyper::body::Body for ChannelBody {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0.poll_recv(cx).map(|piece| piece.map(|b| Ok(Frame::data(b))))
        }
    }

    /// What a request's head alone fails is answered 401 before its body is read: a body
    /// that never comes holds no one up (the door's body timeout is 10 s). A head that
    /// passes waits for its body, which decides: the right bearer token, and a signature
    /// header of the right form, whatever the secret it was made with.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_whose_head_fails_authentication_is_refused_before_its_body_is_read() {
        use tower::ServiceExt;
        let dir = tempfile::tempdir().unwrap();
        let door = door_in(dir.path());
        let hmac = ingest::endpoints::StoredAuth {
            scheme: "hmac-sha256".into(),
            secret: Some("hmac-secret-0123456789".into()),
            header: None,
            prefix: None,
            tolerance_secs: None,
        };
        let signed =
            door.endpoints.register("hooks".into(), hmac, None, None, ingest::time::now_unix_ms()).await.unwrap().id;
        let signed = format!("/v1/e/{}", crate::endpoints::format_id(signed));
        let static_endpoint = format!("/v1/e/{}", crate::endpoints::format_id(ENDPOINT_ID));
        let bearer = |token: &str| Some(("authorization", format!("Bearer {token}")));
        let signature = |value: &str| Some(("x-hub-signature-256", value.to_string()));
        let cases = [
            ("/v1/sources/hooks", None, true),
            ("/v1/sources/hooks", bearer("wrong-token"), true),
            ("/v1/sources/hooks", Some(("authorization", format!("Basic {SOURCE_TOKEN}"))), true),
            ("/v1/sources/hooks", bearer(SOURCE_TOKEN), false),
            (static_endpoint.as_str(), bearer(SOURCE_TOKEN), true),
            (static_endpoint.as_str(), bearer(ENDPOINT_TOKEN), false),
            (signed.as_str(), None, true),
            (signed.as_str(), signature("sha1=00"), true),
            (signed.as_str(), signature("sha256=not-hex"), true),
            (signed.as_str(), signature(&format!("sha256={}", "00".repeat(32))), false),
        ];
        for (path, credentials, refused_at_head) in cases {
            let (pieces, rx) = tokio::sync::mpsc::channel::<Bytes>(1);
            let mut req = Request::builder()
                .method("POST")
                .uri(path)
                .header(header::HOST, "hooks.example")
                .header(header::CONTENT_TYPE, "application/json")
                .header(header::CONTENT_LENGTH, "1000");
            if let Some((name, value)) = &credentials {
                req = req.header(*name, value.as_str());
            }
            let req = req.body(Body::new(ChannelBody(rx))).unwrap();
            let request = tokio::spawn(router(door.clone()).oneshot(req));
            let what = format!("{path} with {credentials:?}");
            if refused_at_head {
                let answer = tokio::time::timeout(Duration::from_secs(5), request)
                    .await
                    .unwrap_or_else(|_| panic!("{what} waited for its body"));
                assert_eq!(answer.unwrap().unwrap().status(), StatusCode::UNAUTHORIZED, "{what}");
            } else {
                tokio::time::sleep(Duration::from_millis(300)).await;
                assert!(!request.is_finished(), "{what} was answered before its body came");
                request.abort();
            }
            drop(pieces);
        }
    }

    /// A request to an endpoint rotated while its body was read, whose signature passes
    /// neither the version that admitted its head nor the one the rotate installed, is
    /// answered 401 without waiting for room, as one to an endpoint left alone is; and
    /// one signed with the new secret waits for its room, as it must. (A signature
    /// scheme: what its head holds is of the right form whatever the secret, so only the
    /// body decides.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_that_cannot_authenticate_after_a_rotate_is_refused_without_waiting_for_room() {
        use hmac::Mac;
        use tower::ServiceExt;
        let dir = tempfile::tempdir().unwrap();
        let door = door_in(dir.path());
        let hmac = |secret: &str| ingest::endpoints::StoredAuth {
            scheme: "hmac-sha256".into(),
            secret: Some(secret.into()),
            header: None,
            prefix: None,
            tolerance_secs: None,
        };
        let body = b"{\"a\":1}\n{\"a\":2}\n";
        let signed_with = |secret: &str| {
            let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret.as_bytes()).unwrap();
            mac.update(body);
            format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
        };
        let held = door.ingestor.room(ingest::ingestor::RUNNING_ON_MAX_BYTES).await.unwrap();
        for (secret, refused) in [("wrong-secret-0123456789", true), ("new-secret-0123456789", false)] {
            let id = door
                .endpoints
                .register("hooks".into(), hmac("old-secret-0123456789"), None, None, ingest::time::now_unix_ms())
                .await
                .unwrap()
                .id;
            let (pieces, rx) = tokio::sync::mpsc::channel(4);
            let req = Request::builder()
                .method("POST")
                .uri(format!("/v1/e/{}", crate::endpoints::format_id(id)))
                .header(header::HOST, "hooks.example")
                .header(header::CONTENT_TYPE, "application/x-ndjson")
                .header("x-hub-signature-256", signed_with(secret))
                .body(Body::new(ChannelBody(rx)))
                .unwrap();
            let request = tokio::spawn(router(door.clone()).oneshot(req));
            pieces.send(Bytes::from_static(b"{\"a\":1}\n")).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            door.endpoints.rotate(id, Some("new-secret-0123456789".into()), ingest::time::now_unix_ms()).await.unwrap();
            pieces.send(Bytes::from_static(b"{\"a\":2}\n")).await.unwrap();
            drop(pieces);
            match refused {
                true => {
                    let answer = tokio::time::timeout(Duration::from_secs(5), request)
                        .await
                        .expect("a request no version authenticates waited for room");
                    assert_eq!(answer.unwrap().unwrap().status(), StatusCode::UNAUTHORIZED);
                }
                false => {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    assert!(!request.is_finished(), "a request ran in room another held");
                    drop(held);
                    let answer = tokio::time::timeout(Duration::from_secs(10), request).await.unwrap();
                    assert_eq!(answer.unwrap().unwrap().status(), StatusCode::OK);
                    return;
                }
            }
        }
    }

    /// A client that goes away while its events are appended (hyper drops the request's
    /// future then) leaves them in the log, and delivered; they are counted as accepted
    /// all the same, with a delivery id and without: the source's status says what the
    /// log took, where it said nothing of them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn events_appended_for_a_client_that_went_away_are_counted_as_accepted() {
        use tower::ServiceExt;
        use wal::storage::{HoldSyncs, HookedStorage, SimStorage};
        let dir = tempfile::tempdir().unwrap();
        let storage = HookedStorage::new(Arc::new(SimStorage::new()), HoldSyncs::default());
        let opts = wal::WalOptions::default();
        let wal = Arc::new(wal::Wal::open_with(Arc::new(storage.clone()), std::path::Path::new("/wal"), opts).unwrap());
        let door = door_on(dir.path(), wal.clone());
        let status = door.status.get("hooks").unwrap();
        for (i, delivery_id) in [None, Some("delivery-1")].into_iter().enumerate() {
            let counted_before = 2 * i as u64;
            let held = storage.hold_syncs();
            let mut req = Request::builder()
                .method("POST")
                .uri("/v1/sources/hooks")
                .header(header::HOST, "hooks.example")
                .header(header::CONTENT_TYPE, "application/x-ndjson")
                .header(header::AUTHORIZATION, format!("Bearer {SOURCE_TOKEN}"));
            if let Some(id) = delivery_id {
                req = req.header("idempotency-key", id);
            }
            let req = req.body(Body::from("{\"a\":1}\n{\"a\":2}\n")).unwrap();
            let request = tokio::spawn(router(door.clone()).oneshot(req));
            // The log's writer took the batch (its sync waits): the request is then
            // dropped, as hyper drops it when its client goes away.
            let deadline = Instant::now() + Duration::from_secs(10);
            while storage.hooks().waiting() == 0 {
                assert!(Instant::now() < deadline, "the request's batch never reached the log: {delivery_id:?}");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert!(!request.is_finished(), "answered with the log's syncs held: {delivery_id:?}");
            request.abort();
            assert!(request.await.is_err_and(|e| e.is_cancelled()), "{delivery_id:?}");
            assert_eq!(status.view().accepted_events, counted_before, "counted before the log held them");

            drop(held);
            let deadline = Instant::now() + Duration::from_secs(10);
            while wal.next_offset() < counted_before + 2 || status.view().accepted_events < counted_before + 2 {
                assert!(
                    Instant::now() < deadline,
                    "the log holds {} records; the status counts {} events accepted ({delivery_id:?})",
                    wal.next_offset(),
                    status.view().accepted_events
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let view = status.view();
        assert_eq!((wal.next_offset(), view.accepted_events, view.accepted_requests), (4, 4, 2));
    }

    /// No request is answered before the sync that makes its records durable, whichever
    /// way it comes: one event or an NDJSON batch, through the source's named path or a
    /// secret-path endpoint (whose append runs in a task of its own), with a delivery id
    /// (answered before its id is recorded, never before its records) or without. The
    /// log's syncs are held: the group is written, its sync waits, and no answer may come
    /// until it is let go. A kill -9 cannot show this (a killed process's writes stay in
    /// the kernel); a power loss would take such a group.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_request_of_any_kind_is_answered_before_its_records_are_synced() {
        use tower::ServiceExt;
        use wal::storage::{HoldSyncs, HookedStorage, SimStorage};
        let dir = tempfile::tempdir().unwrap();
        let storage = HookedStorage::new(Arc::new(SimStorage::new()), HoldSyncs::default());
        let opts = wal::WalOptions::default();
        assert_eq!(opts.sync, wal::SyncPolicy::Always);
        let wal = Arc::new(wal::Wal::open_with(Arc::new(storage.clone()), std::path::Path::new("/wal"), opts).unwrap());
        let door = door_on(dir.path(), wal.clone());
        let endpoint_path = format!("/v1/e/{ENDPOINT_ID:032x}");
        let kinds = [
            ("/v1/sources/hooks", SOURCE_TOKEN, false, None),
            ("/v1/sources/hooks", SOURCE_TOKEN, true, None),
            ("/v1/sources/hooks", SOURCE_TOKEN, false, Some("named-single")),
            ("/v1/sources/hooks", SOURCE_TOKEN, true, Some("named-batch")),
            (endpoint_path.as_str(), ENDPOINT_TOKEN, false, None),
            (endpoint_path.as_str(), ENDPOINT_TOKEN, true, Some("endpoint-batch")),
        ];
        for (path, token, batch, delivery_id) in kinds {
            let what = format!("{path} batch={batch} delivery_id={delivery_id:?}");
            let durable_before = wal.next_offset();
            let held = storage.hold_syncs();
            let (content_type, body) = match batch {
                true => ("application/x-ndjson", "{\"a\":1}\n{\"a\":2}\n{\"a\":3}\n"),
                false => ("application/json", "{\"a\":1}"),
            };
            let mut req = Request::builder()
                .method("POST")
                .uri(path)
                .header(header::HOST, "hooks.example")
                .header(header::CONTENT_TYPE, content_type)
                .header(header::AUTHORIZATION, format!("Bearer {token}"));
            if let Some(id) = delivery_id {
                req = req.header("idempotency-key", id);
            }
            let request = tokio::spawn(router(door.clone()).oneshot(req.body(Body::from(body)).unwrap()));
            let deadline = Instant::now() + Duration::from_secs(10);
            while storage.hooks().waiting() == 0 {
                assert!(Instant::now() < deadline, "{what}: its records never reached the log");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            assert!(!request.is_finished(), "{what}: answered with its records written and not synced");
            assert_eq!(wal.next_offset(), durable_before, "{what}: durable with the sync held");
            drop(held);
            let answer = tokio::time::timeout(Duration::from_secs(10), request).await.unwrap().unwrap().unwrap();
            assert_eq!(answer.status(), StatusCode::OK, "{what}");
            let events = if batch { 3 } else { 1 };
            assert_eq!(wal.next_offset(), durable_before + events, "{what}: answered before durable");
            let body = answer.into_body().collect().await.unwrap().to_bytes();
            let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(json["offsets"], serde_json::json!([durable_before, durable_before + events - 1]), "{what}");
        }
    }

    #[tokio::test]
    async fn the_200_body_is_what_serde_json_writes() {
        let edge = [0, 1, 9, 10, 99, 4096, u64::MAX - 1, u64::MAX];
        for accepted in edge {
            for offsets in [None, Some([0, 0]), Some([accepted, u64::MAX]), Some([7, 123_456_789])] {
                for dropped in [None, Some(1), Some(accepted)] {
                    let body = AcceptedBody { accepted, offsets, dropped };
                    let expected = serde_json::to_vec(&body).unwrap();
                    assert_eq!(
                        String::from_utf8(body.to_json().to_vec()).unwrap(),
                        String::from_utf8(expected.clone()).unwrap()
                    );
                    let resp = body.into_response();
                    assert_eq!(resp.status(), StatusCode::OK);
                    assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
                    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
                    assert_eq!(&bytes[..], &expected[..]);
                }
            }
        }
    }

    /// A body of the given pieces, its length announced (as `Content-Length` does) or not.
    struct Pieces {
        pieces: Vec<&'static [u8]>,
        announced: bool,
    }

    impl hyper::body::Body for Pieces {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            if self.pieces.is_empty() {
                return Poll::Ready(None);
            }
            let piece = self.pieces.remove(0);
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(piece)))))
        }

        fn size_hint(&self) -> hyper::body::SizeHint {
            let left: usize = self.pieces.iter().map(|p| p.len()).sum();
            if self.announced {
                hyper::body::SizeHint::with_exact(left as u64)
            } else {
                hyper::body::SizeHint::default()
            }
        }
    }

    /// One 8 KiB block of a connection's read buffer, counted while alive.
    struct Block {
        bytes: Vec<u8>,
        live: Arc<AtomicUsize>,
    }

    impl AsRef<[u8]> for Block {
        fn as_ref(&self) -> &[u8] {
            &self.bytes
        }
    }

    impl Drop for Block {
        fn drop(&mut self) {
            self.live.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// A body sent a byte per read, as hyper gives it then: each frame a 1-byte slice of
    /// a block of its own. Records the most blocks alive at once.
    struct Trickle {
        left: usize,
        live: Arc<AtomicUsize>,
        most_live: Arc<AtomicUsize>,
    }

    impl hyper::body::Body for Trickle {
        type Data = Bytes;
        type Error = std::convert::Infallible;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            if self.left == 0 {
                return Poll::Ready(None);
            }
            self.left -= 1;
            let live = self.live.fetch_add(1, Ordering::SeqCst) + 1;
            self.most_live.fetch_max(live, Ordering::SeqCst);
            let block = Block { bytes: vec![b'x'; 8192], live: self.live.clone() };
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_owner(block).slice(0..1)))))
        }
    }

    /// A body trickled a byte per read holds no more than two of the connection's read
    /// blocks while it is read (the first frame, kept uncopied, and the one in hand),
    /// where keeping every frame held one 8 KiB block per byte: 2,000 here.
    #[tokio::test]
    async fn a_trickled_body_holds_no_read_buffer_per_byte() {
        let (live, most_live) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let body = Body::new(Trickle { left: 2_000, live: live.clone(), most_live: most_live.clone() });
        let bytes = read_body(body, 1 << 20, Duration::from_secs(5)).await.unwrap();
        assert_eq!(bytes, vec![b'x'; 2_000]);
        assert!(most_live.load(Ordering::SeqCst) <= 2, "{} blocks alive at once", most_live.load(Ordering::SeqCst));
        assert_eq!(live.load(Ordering::SeqCst), 0, "the answer holds a read block");

        // Joined into a buffer sized by what came, whatever length is announced (hyper's
        // hint is what is still to come), and grown within the announced whole, never
        // past `max`.
        assert_eq!(joined_bound(2, Some(1_048_574), 1 << 20), 1 << 20);
        assert_eq!(joined_capacity(2, joined_bound(2, Some(1_048_574), 1 << 20)), 4);
        assert_eq!(joined_bound(4, Some(6), 1 << 20), 10);
        assert_eq!(joined_bound(4, Some(u64::MAX), 1 << 20), 1 << 20);
        assert_eq!(joined_capacity(4, 1 << 20), 8);
        assert_eq!(joined_capacity(600_000, 1 << 20), 1 << 20);
        let mut buf = Vec::with_capacity(joined_capacity(4, 10));
        buf.extend_from_slice(b"abcdefgh");
        reserve_within(&mut buf, 2, 10);
        assert_eq!(buf.capacity(), 10, "grown to the announced whole, not past it");
        // A body in pieces is joined in order, a `Content-Length` one or a chunked one.
        for announced in [true, false] {
            let body = Body::new(Pieces { pieces: vec![&b"ab"[..], b"cd", b"efg"], announced });
            assert_eq!(read_body(body, 1 << 20, Duration::from_secs(5)).await.unwrap(), "abcdefg");
        }

        // One frame: the body as it came, and past `max`: 413.
        let one = read_body(Body::from("whole"), 5, Duration::from_secs(5)).await.unwrap();
        assert_eq!(one, "whole");
        let over = Body::new(Trickle { left: 10, live: live.clone(), most_live: most_live.clone() });
        assert_eq!(read_body(over, 9, Duration::from_secs(5)).await.unwrap_err().status, StatusCode::PAYLOAD_TOO_LARGE);
    }
}
