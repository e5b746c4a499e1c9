//! The admin listener: `/health`, `/status`, `/metrics`, and the endpoint management
//! API behind the management token.
//!
//! Two tokens, two privileges (docs/operations.md, "Securing the admin API"):
//! - `admin.token`, when set, is needed for every route but `/health` (a reader:
//!   status, connectors, metrics). The management token is accepted there too.
//! - `admin.management_token` is needed for endpoint management (it hands out
//!   secrets); the admin token alone never manages.
//!
//! Invariants:
//! - `/health` never needs a token: load balancers and orchestrators probe it bare.
//! - Every token comparison is constant-time over SHA-256 digests (no length signal);
//!   every refusal is a 401 with a JSON body and counts
//!   `iggy_ingest_admin_auth_failures_total`.
//! - Management calls need `Authorization: Bearer <management_token>`; without a
//!   configured token they answer 404.
//! - A 2xx from a management call means the change is committed to redb; a
//!   registration repeated under its `Idempotency-Key` commits nothing and answers with
//!   the endpoint the first one made.
//! - Secrets appear only in the answers of register (a repeat included, unless the
//!   endpoint was revoked since) and rotate, never in listings.
//! - Every answer but a 2xx and `/metrics` is a JSON `ApiError`, as at the webhook
//!   door: a method a path does not take is a 405 (with `Allow`), and a path parameter
//!   that does not percent-decode to UTF-8 names nothing (404), never axum's empty or
//!   plain-text rejections.
//! - A management body is read only after the token was checked, at most 64 KiB and
//!   within `http.body_read_timeout_ms` (413, 408), so a client without the token
//!   cannot hold an admin connection by sending a body slowly.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http_source::door::path_param;
use http_source::endpoints::{EndpointError, Registered, format_id, id_prefix, parse_id};
use http_source::error::ApiError;
use http_source::route::shorten;
use ingest::log_limit::LogLimit;
use ingest::{EndpointRecord, StoredAuth};
use serde::Deserialize;
use serde_json::json;

use crate::daemon::Shared;

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/connectors/{key}", get(connector))
        .route("/connectors/{key}/destinations", get(crate::delivery::destinations))
        .route("/v1/endpoints", get(list).post(register))
        .route("/v1/endpoints/{id}", axum::routing::delete(revoke))
        .route("/v1/endpoints/{id}/rotate", post(rotate))
        .fallback(|| async { ApiError::not_found("no such path") })
        // After every route: it applies to the routes there are when it is called.
        .method_not_allowed_fallback(|| async { ApiError::method_not_allowed() })
        // On the whole router, fallbacks included: without the token an unknown path
        // and a known one, a wrong method and a right one, look alike.
        .layer(middleware::from_fn_with_state(shared.clone(), require_admin_token))
        // Outermost: a request refused for its `Host` has no token checked or counted.
        .layer(middleware::map_request(host_checked))
        .with_state(shared)
}

/// A request whose `Host` the admin listener refuses (`http_source::host`), as the
/// webhook listener refuses it; any other goes on.
async fn host_checked(request: Request) -> Result<Request, Response> {
    match http_source::host::refusal_of(&request) {
        None => Ok(request),
        Some(e) => Err(e.into_response()),
    }
}

/// The `admin.token` check in front of every route but `/health`.
async fn require_admin_token(State(s): State<Arc<Shared>>, request: Request, next: Next) -> Response {
    let Some(token) = &s.admin_token else { return next.run(request).await };
    if request.uri().path() == "/health" {
        return next.run(request).await;
    }
    let presented = bearer(request.headers());
    let accepted = presented.is_some_and(|p| {
        // Both comparisons always run, so the time taken says nothing about which matched.
        let admin = token.matches(p);
        let management = s.management_token.as_ref().is_some_and(|m| m.matches(p));
        admin | management
    });
    if accepted { next.run(request).await } else { refuse(presented.is_some(), "admin call", request.headers()) }
}

/// The token of an `Authorization: Bearer <token>` header, if there is one: parsed as
/// the webhook door's bearer scheme parses it.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    http_source::auth::bearer_token(headers).ok()
}

/// A 401 with a JSON body and a `WWW-Authenticate` challenge; counted and logged. Given
/// before the request's body is read: it closes the connection when `headers` declare
/// one.
fn refuse(presented: bool, what: &str, headers: &HeaderMap) -> Response {
    metrics::counter!("iggy_ingest_admin_auth_failures_total").increment(1);
    let why = if presented { "a wrong token" } else { "no bearer token" };
    // Any client can repeat this at will: one line a second, with the count left out.
    static LOG: LogLimit = LogLimit::every(std::time::Duration::from_secs(1));
    if let Some(suppressed) = LOG.admit() {
        tracing::warn!(suppressed, "{what} with {why}");
    }
    http_source::door::before_body(headers, ApiError::unauthorized("Bearer", "iggy-ingest admin")).into_response()
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    http_source::door::health_answer(&s.health)
}

async fn status(State(s): State<Arc<Shared>>) -> Response {
    let state = s.health.state().as_str();
    let stats = s.wal.stats();
    let mut sources: serde_json::Map<String, serde_json::Value> = s
        .status
        .sources
        .iter()
        .map(|(k, v)| {
            let mut view = serde_json::to_value(v.view()).unwrap_or_default();
            if let Some(obj) = view.as_object_mut() {
                obj.insert("configured".into(), json!(true));
                obj.insert("state".into(), json!(state));
                obj.insert("delivery".into(), json!(crate::delivery::connector_delivery_status(&s.delivery, k)));
            }
            (k.clone(), view)
        })
        .collect();
    // A source removed from the configuration whose records the router still delivers:
    // no door, its delivery all the same.
    for k in s.delivery.unconfigured_sources(|k| s.status.sources.contains_key(k)) {
        let delivery = crate::delivery::connector_delivery_status(&s.delivery, &k);
        sources.insert(k, json!({"configured": false, "state": state, "delivery": delivery}));
    }
    Json(json!({
        "state": state,
        "log": {
            "start_offset": stats.start_offset,
            "next_offset": stats.next_offset,
            "segments": stats.segments,
            "used_bytes": stats.used_bytes,
            "max_bytes": stats.max_bytes,
            "full": s.wal.is_full(),
            "disk_full": s.wal.is_disk_full(),
            "writer_busy_ms": s.wal.writer_busy_for().map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        },
        "sources": sources,
        "router": s.delivery.status_json(),
        "tls": s.tls.iter().map(|t| (t.listener().to_string(), json!(t.view()))).collect::<serde_json::Map<_, _>>(),
    }))
    .into_response()
}

/// `GET /connectors/{key}`: one source's door status and its delivery status. A source
/// removed from the configuration whose records are still in the log has no door
/// (`configured: false`, `door: null`) but its delivery, as `/destinations` shows it.
async fn connector(State(s): State<Arc<Shared>>, key: Result<Path<String>, PathRejection>) -> Response {
    let key = match path_param(key, "connector") {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    let door = s.status.get(&key);
    let destinations = s.delivery.destinations_of(&key);
    if door.is_none() && destinations.is_empty() {
        return ApiError::not_found("no such connector").into_response();
    }
    let held_records: u64 = destinations.iter().map(|d| d.held_records).sum();
    let held_bytes: u64 = destinations.iter().map(|d| d.held_bytes).sum();
    Json(json!({
        "connector": key,
        "configured": door.is_some(),
        "state": s.health.state().as_str(),
        "door": door.map(|d| serde_json::to_value(d.view()).unwrap_or_default()),
        "delivery": {
            "status": crate::delivery::connector_delivery_status(&s.delivery, &key),
            "destinations": destinations.len(),
            "held_records": held_records,
            "held_bytes": held_bytes,
            "router": s.delivery.status_json(),
        },
    }))
    .into_response()
}

async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    match &s.metrics {
        Some(handle) => {
            let unconfigured = s.delivery.unconfigured_sources(|k| s.status.sources.contains_key(k));
            crate::delivery::publish_connector_statuses(&s.delivery, s.status.sources.keys().chain(&unconfigured));
            // Measured now too: the releaser that also sets them may be waiting on the log.
            s.delivery.publish_held_gauges();
            // Measured now: a writer stuck in a sync records nothing else.
            let busy = s.wal.writer_busy_for().map_or(0.0, |d| d.as_secs_f64());
            metrics::gauge!("iggy_ingest_wal_writer_busy_seconds").set(busy);
            ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], handle.render()).into_response()
        }
        None => ApiError::not_found("metrics are not installed in this process").into_response(),
    }
}

/// The management token check: `None` to go on, or the answer refusing the call.
fn refuse_management(s: &Shared, headers: &HeaderMap) -> Option<Response> {
    let Some(token) = &s.management_token else {
        return Some(
            ApiError::not_found("endpoint management is disabled (no admin.management_token)").into_response(),
        );
    };
    let presented = bearer(headers);
    if presented.is_some_and(|p| token.matches(p)) {
        None
    } else {
        Some(refuse(presented.is_some(), "management call", headers))
    }
}

fn endpoint_error(e: EndpointError) -> ApiError {
    match e {
        EndpointError::Unknown(_) | EndpointError::Revoked(_) => ApiError::not_found(e.to_string()),
        EndpointError::Static(_) => ApiError::new(StatusCode::CONFLICT, "static_endpoint", e.to_string()),
        EndpointError::NoSecret(_) => ApiError::new(StatusCode::CONFLICT, "no_secret", e.to_string()),
        EndpointError::Expired(_) => ApiError::new(StatusCode::CONFLICT, "endpoint_expired", e.to_string()),
        EndpointError::Unusable(..) => ApiError::new(StatusCode::CONFLICT, "endpoint_unusable", e.to_string()),
        EndpointError::TooMany(_) => ApiError::new(StatusCode::CONFLICT, "too_many_endpoints", e.to_string()),
        EndpointError::KeyReused(_) => ApiError::new(StatusCode::CONFLICT, "idempotency_key_reused", e.to_string()),
        EndpointError::UnknownSource(_) | EndpointError::InvalidAuth(_) | EndpointError::InvalidField(_) => {
            ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", e.to_string())
        }
        EndpointError::State(_) => {
            tracing::error!(error = %e, "endpoint change failed");
            ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "state_error", "the change could not be committed")
        }
    }
}

fn record_json(r: &EndpointRecord, with_secret: bool) -> serde_json::Value {
    let mut v = json!({
        "id": format_id(r.id),
        "path": format!("/v1/e/{}", format_id(r.id)),
        "source": r.source_key,
        "auth_type": r.auth.scheme,
        "handshake_param": r.handshake_param,
        "expires_at_unix_ms": r.expires_at_unix_ms,
        "revoked_at_unix_ms": r.revoked_at_unix_ms,
    });
    if with_secret && let Some(obj) = v.as_object_mut() {
        obj.insert("secret".into(), json!(r.auth.secret));
    }
    v
}

/// Entries one listing (endpoints, a connector's destinations) returns when the request
/// names no `limit`.
pub(crate) const LIST_LIMIT_DEFAULT: usize = 1000;
/// The most entries one listing returns: a page of at most a few megabytes.
const LIST_LIMIT_MAX: usize = 10_000;

/// `GET /v1/endpoints?limit=N&after=ID`: a page of endpoints by id, and the id to ask
/// after for the next page (`next_after`, `null` on the last).
async fn list(State(s): State<Arc<Shared>>, headers: HeaderMap, RawQuery(query): RawQuery) -> Response {
    if let Some(refused) = refuse_management(&s, &headers) {
        return refused;
    }
    let (after, limit) = match page_query(query.as_deref(), "an endpoint id (32 hex digits)", parse_id) {
        Ok(q) => q,
        Err(e) => return e.into_response(),
    };
    let (page, more) = s.endpoints.list_page(ingest::time::now_unix_ms(), after, limit);
    let next_after = if more { page.last().map(|e| e.id.clone()) } else { None };
    Json(json!({"endpoints": page, "next_after": next_after})).into_response()
}

/// The `after` and `limit` of a listing's query (`after` read by `parse_after`, which
/// `after_is` describes); any other parameter, a value given twice or one that does not
/// read is a 400 `invalid_query` whose message starts with the parameter's name.
/// Names and values are percent-decoded first, as every HTTP client library encodes a
/// query (`after=shop%2Forders` is `after=shop/orders`); one that does not decode to
/// UTF-8 does not read.
pub(crate) fn page_query<T>(
    query: Option<&str>,
    after_is: &str,
    parse_after: impl Fn(&str) -> Option<T>,
) -> Result<(Option<T>, usize), ApiError> {
    let bad = |detail: String| ApiError::new(StatusCode::BAD_REQUEST, "invalid_query", detail);
    let decode = |raw: &str| percent_encoding::percent_decode_str(raw).decode_utf8().map(|d| d.into_owned());
    let (mut after, mut limit) = (None, None);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (raw_name, raw_value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = decode(raw_name)
            .map_err(|_| bad(format!("{:?}: not a parameter of this listing (after, limit)", shorten(raw_name))))?;
        let value = decode(raw_value).map_err(|_| bad(format!("{name}: not UTF-8 once percent-decoded")))?;
        let (name, value) = (name.as_str(), value.as_str());
        match name {
            "after" if after.is_none() => {
                let parsed = parse_after(value);
                after =
                    Some(parsed.ok_or_else(|| bad(format!("after: must be {after_is}, got {:?}", shorten(value))))?);
            }
            "limit" if limit.is_none() => {
                let n = value.parse::<usize>().ok().filter(|n| (1..=LIST_LIMIT_MAX).contains(n));
                limit =
                    Some(n.ok_or_else(|| {
                        bad(format!("limit: must be 1 to {LIST_LIMIT_MAX}, got {:?}", shorten(value)))
                    })?);
            }
            "after" | "limit" => return Err(bad(format!("{name}: given more than once"))),
            other => {
                return Err(bad(format!("{:?}: not a parameter of this listing (after, limit)", shorten(other))));
            }
        }
    }
    Ok((after, limit.unwrap_or(LIST_LIMIT_DEFAULT)))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RegisterRequest {
    source: String,
    /// Required, `"none"` included: an endpoint is never left unauthenticated by a
    /// field a script forgot.
    auth_type: String,
    auth_secret: Option<ingest::secret::SecretString>,
    auth_header: Option<String>,
    auth_prefix: Option<String>,
    auth_tolerance_secs: Option<u64>,
    handshake_param: Option<String>,
    expires_at_unix_ms: Option<u64>,
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", without_values(&e.to_string())))
}

/// A JSON error's message without the value it quotes: serde says "invalid type: integer
/// `1234`, expected a string", and the value may be a secret typed into the wrong field
/// (an answer's body travels further than the request: client logs, proxies). The kind
/// of value, the field names and the place stay.
fn without_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) =
        ["invalid type: ", "invalid value: "].iter().filter_map(|p| rest.find(p).map(|i| i + p.len())).min()
    {
        out.push_str(&rest[..at]);
        rest = &rest[at..];
        // The kind is the words before the quoted value (`integer`, `string`, `floating
        // point`); the value runs to ", expected".
        let value_end = rest.find(", expected").unwrap_or(rest.len());
        let kind_end = rest[..value_end].find(['`', '"']).unwrap_or(value_end);
        out.push_str(rest[..kind_end].trim_end());
        rest = &rest[value_end..];
    }
    out.push_str(rest);
    out
}

/// The largest management request body (a registration with its secret is a few
/// hundred bytes).
const MANAGEMENT_BODY_MAX_BYTES: usize = 64 * 1024;

/// A management request's body, read only once the caller is known to be allowed: at
/// most [`MANAGEMENT_BODY_MAX_BYTES`], within `http.body_read_timeout_ms`, so no client
/// can hold an admin connection by sending a body slowly.
async fn management_body(s: &Shared, body: axum::body::Body) -> Result<axum::body::Bytes, Response> {
    http_source::door::read_body(body, MANAGEMENT_BODY_MAX_BYTES, s.body_read_timeout).await.map_err(|e| {
        // Named by this limit, not the door's `max_body_bytes` the shared reader names.
        if e.status == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body_too_large",
                format!("a management request body is at most {MANAGEMENT_BODY_MAX_BYTES} bytes"),
            )
            .closing()
            .into_response()
        } else {
            e.into_response()
        }
    })
}

async fn register(State(s): State<Arc<Shared>>, headers: HeaderMap, body: axum::body::Body) -> Response {
    if let Some(refused) = refuse_management(&s, &headers) {
        return refused;
    }
    let body = match management_body(&s, body).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let req: RegisterRequest = match parse_json(&body) {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let key = match registration_key(&headers) {
        Ok(k) => k,
        Err(e) => return e.into_response(),
    };
    let auth = StoredAuth {
        scheme: req.auth_type,
        secret: req.auth_secret.map(|s| s.expose().to_string()),
        header: req.auth_header,
        prefix: req.auth_prefix,
        tolerance_secs: req.auth_tolerance_secs,
    };
    let now = ingest::time::now_unix_ms();
    match s.endpoints.register_keyed(req.source, auth, req.handshake_param, req.expires_at_unix_ms, key, now).await {
        Ok(Registered { record: r, replayed: false }) => {
            tracing::info!(endpoint = %id_prefix(r.id), source = %r.source_key, "endpoint registered");
            (StatusCode::CREATED, Json(record_json(&r, true))).into_response()
        }
        Ok(Registered { record: r, replayed: true }) => {
            tracing::info!(endpoint = %id_prefix(r.id), source = %r.source_key, "endpoint registration repeated under its idempotency key; nothing changed");
            // A revoked endpoint's secret works nowhere: it is not shown again.
            let with_secret = r.revoked_at_unix_ms.is_none();
            (StatusCode::CREATED, [(IDEMPOTENT_REPLAYED, "true")], Json(record_json(&r, with_secret))).into_response()
        }
        Err(e) => endpoint_error(e).into_response(),
    }
}

/// The answer header that marks a registration repeated under its idempotency key.
const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// A registration's `Idempotency-Key` header: `Ok(None)` without one; a 400 naming the
/// header for one that is not 1 to 255 visible ASCII characters (or appears twice).
fn registration_key(headers: &HeaderMap) -> Result<Option<Vec<u8>>, ApiError> {
    let mut values = headers.get_all("idempotency-key").iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    let bad = |why: &str| ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", format!("Idempotency-Key: {why}"));
    if values.next().is_some() {
        return Err(bad("given more than once"));
    }
    let bytes = value.as_bytes();
    if bytes.is_empty() || bytes.len() > ingest::endpoints::REGISTRATION_KEY_MAX_BYTES {
        return Err(bad(&format!(
            "{} bytes; a key is 1 to {} visible ASCII characters",
            bytes.len(),
            ingest::endpoints::REGISTRATION_KEY_MAX_BYTES
        )));
    }
    if !bytes.iter().all(|b| b.is_ascii_graphic()) {
        return Err(bad("a key is visible ASCII characters only (no spaces or control characters)"));
    }
    Ok(Some(bytes.to_vec()))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RotateRequest {
    auth_secret: Option<ingest::secret::SecretString>,
}

async fn rotate(
    State(s): State<Arc<Shared>>,
    id: Result<Path<String>, PathRejection>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    if let Some(refused) = refuse_management(&s, &headers) {
        return refused;
    }
    let body = match management_body(&s, body).await {
        Ok(b) => b,
        Err(refused) => return refused,
    };
    let id = match path_param(id, "endpoint") {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let Some(id) = parse_id(&id) else { return ApiError::not_found("no such endpoint").into_response() };
    let req: RotateRequest = if body.is_empty() {
        RotateRequest::default()
    } else {
        match parse_json(&body) {
            Ok(r) => r,
            Err(e) => return e.into_response(),
        }
    };
    match s.endpoints.rotate(id, req.auth_secret.map(|s| s.expose().to_string()), ingest::time::now_unix_ms()).await {
        Ok(r) => {
            tracing::info!(endpoint = %id_prefix(r.id), "endpoint secret rotated");
            Json(record_json(&r, true)).into_response()
        }
        Err(e) => endpoint_error(e).into_response(),
    }
}

async fn revoke(State(s): State<Arc<Shared>>, id: Result<Path<String>, PathRejection>, headers: HeaderMap) -> Response {
    if let Some(refused) = refuse_management(&s, &headers) {
        return refused;
    }
    let id = match path_param(id, "endpoint") {
        Ok(id) => id,
        Err(e) => return e.into_response(),
    };
    let Some(id) = parse_id(&id) else { return ApiError::not_found("no such endpoint").into_response() };
    match s.endpoints.revoke(id, ingest::time::now_unix_ms()).await {
        Ok(r) => {
            tracing::info!(endpoint = %id_prefix(r.id), "endpoint revoked");
            Json(record_json(&r, false)).into_response()
        }
        Err(e) => endpoint_error(e).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value typed into the wrong field (a secret, as a number or under another
    /// field's type) is not repeated in the 400's body; what is wrong with it and where
    /// still is.
    #[test]
    fn a_json_error_does_not_repeat_the_value_it_refuses() {
        let refused = |body: &str| match parse_json::<RegisterRequest>(body.as_bytes()) {
            Ok(r) => panic!("taken: {r:?}"),
            Err(e) => e.message,
        };
        let m = refused(r#"{"source":"a","auth_type":"bearer","auth_secret":1234567890123456}"#);
        assert!(!m.contains("1234567890123456"), "{m}");
        assert!(m.contains("invalid type: integer, expected a string"), "{m}");
        let m = refused(r#"{"source":"a","auth_type":"bearer","auth_tolerance_secs":"s3cr3t-value"}"#);
        assert!(!m.contains("s3cr3t-value"), "{m}");
        assert!(m.contains("invalid type: string, expected u64"), "{m}");
        let m = refused(r#"{"source":"a","auth_type":"bearer","auth_secret":"x","nope":1}"#);
        assert!(m.contains("unknown field `nope`"), "field names stay: {m}");
        assert_eq!(without_values("no value here"), "no value here");
    }
}
