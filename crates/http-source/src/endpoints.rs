//! Secret-path endpoints (`/v1/e/{endpoint_id}`): the static ones from configuration and
//! the dynamic ones registered through the admin API and kept in the state database.
//!
//! Invariants:
//! - An endpoint id is 128 bits, written as 32 lower-case hex digits.
//! - A dynamic change (register, rotate, revoke) is committed durably to redb before the
//!   in-memory view changes and before the call returns; changes are serialized, and each
//!   runs to its end in its own task, so a caller that stops waiting cannot leave redb
//!   and memory disagreeing.
//! - A request is admitted by one [`EndpointVersion`]: the endpoint's record as one change
//!   left it. [`EndpointRegistry::recheck`] checks, once the request's body was read, that
//!   this version is still the current one (or checks the current one instead), still
//!   active and not expired, and hands out an [`EndpointPermit`], a shared hold on the
//!   endpoint's gate. A rotate or revoke installs its new version under the gate's
//!   exclusive hold, so it returns only after every request admitted by an older
//!   version has finished appending: once it returned, no request authorised by the
//!   old record (the old secret, or a revoked id) can still be appended. It takes that
//!   hold before the lock that serialises changes, so a slow append through one
//!   endpoint delays changes to that endpoint only.
//! - A revoked endpoint stays revoked: the tombstone is kept, lookups answer `Revoked`.
//! - Static endpoints cannot be rotated or revoked through the API (`Static`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use base64::Engine;
use ingest::{EndpointRecord, KeyedRegistration, StateDb, StateError, StoredAuth};
use serde::Serialize;
use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock as AsyncRwLock};

use crate::auth::AuthScheme;

/// One endpoint, ready to check requests.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub id: u128,
    pub source_key: String,
    pub auth: AuthScheme,
    pub handshake_param: Option<String>,
    pub expires_at_unix_ms: Option<u64>,
    pub revoked_at_unix_ms: Option<u64>,
    pub dynamic: bool,
    /// The stored form (dynamic endpoints only).
    pub record: Option<EndpointRecord>,
    /// Why a dynamic endpoint's stored auth no longer reads (a record written by another
    /// build, or damaged): it takes no request (404, as unknown) and can only be listed
    /// and revoked.
    pub unusable: Option<String>,
}

/// One version of an endpoint: its record as one change (load, register, rotate,
/// revoke) left it, with the gate every version of the same id shares.
#[derive(Debug)]
pub struct EndpointVersion {
    pub endpoint: Endpoint,
    /// Unique among the registry's versions; the gate holds the current one's.
    version: u64,
    gate: Arc<EndpointGate>,
}

/// The version number of an endpoint's current record, behind a lock that a request holds
/// shared from its re-check to the end of its append, and a change takes exclusively to
/// install a new version.
type EndpointGate = AsyncRwLock<u64>;

/// A request's shared hold on its endpoint's gate: while it is held, no rotate or revoke
/// of the endpoint can complete. Keep it until the request's append resolved.
#[derive(Debug)]
pub struct EndpointPermit {
    _shared: OwnedRwLockReadGuard<u64>,
}

/// Why an endpoint does not take a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Unknown,
    Revoked,
    Expired,
    /// A stored endpoint whose auth no longer reads ([`Endpoint::unusable`]).
    Unusable,
}

#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("no endpoint {0}")]
    Unknown(String),
    #[error("endpoint {0} is static (defined in the configuration file); change it there")]
    Static(String),
    #[error("endpoint {0} is revoked")]
    Revoked(String),
    #[error("no source {0:?}")]
    UnknownSource(String),
    #[error("invalid auth: {0}")]
    InvalidAuth(String),
    #[error("endpoint {0}'s stored auth no longer reads ({1}): it takes no request; revoke it and register a new one")]
    Unusable(String, String),
    #[error(
        "endpoint {0} has auth_type \"none\": it has no secret to rotate (its id is its only secret); \
         register a new endpoint and revoke this one"
    )]
    NoSecret(String),
    #[error(
        "endpoint {0} expired: it answers 410 whatever its secret; register a new endpoint (revoking this one \
         makes it answer 404; its tombstone still counts against the endpoints' bound)"
    )]
    Expired(String),
    #[error(
        "{0} dynamic endpoints are registered, revoked ones included, the most there may be; \
         revoked ones are kept for ever (a revocation never comes back)"
    )]
    TooMany(usize),
    /// A field of a registration that could never work as given (the message names it).
    #[error("{0}")]
    InvalidField(String),
    /// The registration's idempotency key was used before for a registration that asked
    /// for something else (it made the endpoint named).
    #[error(
        "this Idempotency-Key was used for a different registration (it made endpoint {0}): \
         a retry must repeat the request exactly; a new registration needs a new key"
    )]
    KeyReused(String),
    #[error(transparent)]
    State(#[from] StateError),
}

fn check_new_secret(scheme: &str, secret: Option<&str>) -> Result<(), EndpointError> {
    // Stripe makes each endpoint's signing secret and shows it; no receiver can set one.
    // A secret made here would be answered 401 on every real delivery.
    if scheme == "stripe" && secret.is_none() {
        return Err(EndpointError::InvalidAuth(
            "auth_secret: required for stripe: Stripe makes the endpoint's signing secret (whsec_...) and no \
             other can be set there; pass the one its dashboard shows"
                .to_string(),
        ));
    }
    crate::auth::check_new_secret(scheme, secret)
        .map_err(|(field, message)| EndpointError::InvalidAuth(format!("auth_{field}: {message}")))
}

/// The longest `handshake_param`: a query parameter's name.
pub const HANDSHAKE_PARAM_MAX_BYTES: usize = 64;

/// Refuses a `handshake_param` no GET handshake could carry (every one would answer 400
/// `missing_challenge`), for a registration and for a static endpoint alike. The query
/// is form-decoded before the name is looked up (`+` is a space, `%41` is `A`), so a
/// name holding `+` or `%` would match only a sender that encodes it, which none does.
pub fn check_handshake_param(p: &str) -> Result<(), String> {
    if p.is_empty()
        || p.len() > HANDSHAKE_PARAM_MAX_BYTES
        || !p.bytes().all(|b| b.is_ascii_graphic() && !matches!(b, b'&' | b'=' | b'#' | b'?' | b'+' | b'%'))
    {
        return Err(format!(
            "{p:?} is not a query parameter name (1 to {HANDSHAKE_PARAM_MAX_BYTES} visible ASCII characters, none of & = # ? + %)"
        ));
    }
    Ok(())
}

/// The most dynamic endpoints (revoked ones included: their tombstones are never
/// removed, so that a revoked id never works again). Every one is held in memory and
/// read at each start; registration past it is refused.
pub const DYNAMIC_ENDPOINTS_MAX: usize = 100_000;

/// An endpoint as listed (no secrets).
#[derive(Debug, Clone, Serialize)]
pub struct EndpointView {
    pub id: String,
    pub source: String,
    /// As registered (a dynamic endpoint's stored scheme) or configured.
    pub auth_type: String,
    pub dynamic: bool,
    pub state: &'static str,
    pub handshake_param: Option<String>,
    pub expires_at_unix_ms: Option<u64>,
    pub revoked_at_unix_ms: Option<u64>,
}

pub fn format_id(id: u128) -> String {
    format!("{id:032x}")
}

pub use ingest::endpoints::id_prefix;

/// Why the endpoints could not be loaded at start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    State(#[from] StateError),
    #[error(
        "the static endpoint whose id starts {0} was revoked through the admin API, and a revoked id \
         never works again: give that endpoint a new id in the configuration file"
    )]
    RevokedStatic(String),
    #[error(
        "the static endpoint whose id starts {0} has a stored record under the same id that does not \
         decode, and may have been a revocation: give that endpoint a new id in the configuration file \
         (start without it to list or revoke the stored one)"
    )]
    UnreadableStatic(String),
}

/// Parses a 32-hex-digit endpoint id.
pub fn parse_id(s: &str) -> Option<u128> {
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u128::from_str_radix(s, 16).ok()
}

/// Builds the checker for an auth already stored. A setting its scheme does not read
/// (stored before such settings were refused) is left out, so that an endpoint
/// registered then still loads and answers as it did.
pub fn scheme_from_stored(a: &StoredAuth) -> Result<AuthScheme, String> {
    let hmac = a.scheme.starts_with("hmac-");
    let timestamped = matches!(a.scheme.as_str(), "standard-webhooks" | "stripe");
    AuthScheme::from_parts(
        &a.scheme,
        // Earlier builds stored a secret given for (or generated on rotating) an endpoint
        // with no auth; it was never checked, and is not now.
        a.secret.as_deref().filter(|_| a.scheme != "none"),
        a.header.as_deref().filter(|_| hmac),
        a.prefix.as_deref().filter(|_| hmac),
        a.tolerance_secs.filter(|_| timestamped),
    )
    .map_err(|(field, msg)| format!("{field}: {msg}"))
}

/// Builds the checker for a new registration: a setting its scheme does not read is an
/// error, as in the configuration.
/// A problem is named by the request's field (`auth_header`), as the configuration
/// names its key.
pub fn scheme_from_request(a: &StoredAuth) -> Result<AuthScheme, String> {
    AuthScheme::from_parts(&a.scheme, a.secret.as_deref(), a.header.as_deref(), a.prefix.as_deref(), a.tolerance_secs)
        .and_then(|scheme| crate::auth::check_new_tolerance(a.tolerance_secs).map(|()| scheme))
        .map_err(|(field, msg)| format!("auth_{field}: {msg}"))
}

/// A fresh secret in the form the scheme expects (`whsec_` + base64 for Standard
/// Webhooks, 64 hex digits otherwise).
pub fn generate_secret(scheme: &str) -> String {
    let bytes: [u8; 32] = rand::random();
    if scheme == "standard-webhooks" {
        format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(bytes))
    } else {
        hex::encode(bytes)
    }
}

pub struct EndpointRegistry {
    state: Arc<StateDb>,
    sources: Vec<String>,
    /// The largest `tolerance_secs` a registration for one of `keyed_sources` may ask
    /// for: half the delivery ids' retention
    /// ([`EndpointRegistry::with_tolerance_secs_max`]).
    tolerance_secs_max: u64,
    /// The sources that keep delivery ids: only their replays must find one.
    keyed_sources: Vec<String>,
    /// The most dynamic endpoints (revoked ones included) a registration may make:
    /// [`DYNAMIC_ENDPOINTS_MAX`] unless [`EndpointRegistry::with_dynamic_endpoints_max`].
    dynamic_endpoints_max: usize,
    endpoints: RwLock<HashMap<u128, Arc<EndpointVersion>>>,
    /// Registrations made under an idempotency key: key → (the endpoint it made, the
    /// request's fingerprint). Changed only under `changes`, after the commit that
    /// stored the key with its endpoint; at most one key per dynamic endpoint.
    registrations: Mutex<HashMap<Vec<u8>, KeyedEndpoint>>,
    changes: tokio::sync::Mutex<()>,
    next_version: AtomicU64,
    /// The ids whose last change's commit failed: a failed commit may hold on disk all
    /// the same (the data flushed, then the sync reported an error), so memory may not
    /// say what a restart would load. Each is settled by taking what the disk says once
    /// it reads again: by the id's next change ([`EndpointRegistry::settle_held`]), or by
    /// a task that tries every [`SETTLE_RETRY_INTERVAL`] ([`EndpointRegistry::settle_one`]),
    /// each under the id's gate and the change lock, as a change is made.
    unsettled: Mutex<std::collections::HashSet<u128>>,
    /// Whether the task settling `unsettled` runs.
    settler_running: std::sync::atomic::AtomicBool,
}

/// How often the ids whose change's commit failed are tried again against the disk.
const SETTLE_RETRY_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// The latest expiry a registration may ask for: the last millisecond of the year 9999.
const EXPIRES_AT_UNIX_MS_MAX: u64 = 253_402_300_799_999;

/// The endpoint a stored dynamic record makes, as a start loads it: unusable (404, listed
/// so, revocable) where its auth no longer reads or its source is not configured; a
/// tombstone whatever its auth holds.
fn endpoint_from_stored(record: EndpointRecord, sources: &[String]) -> Endpoint {
    // A tombstone's auth is never checked (a revocation keeps no secret), and must stay
    // whatever it holds: a revocation never comes back, not even as a static endpoint of
    // the same id.
    let auth =
        if record.revoked_at_unix_ms.is_some() { Ok(AuthScheme::None) } else { scheme_from_stored(&record.auth) };
    let endpoint = match auth {
        Ok(auth) => endpoint_from_record(record, auth),
        Err(e) => {
            tracing::error!(
                endpoint = %id_prefix(record.id),
                error = %e,
                "a stored endpoint's auth no longer reads; it answers 404 until revoked through the admin API"
            );
            unusable_from_record(record, e)
        }
    };
    // A live endpoint of a source no longer configured takes no request: a POST would
    // find no source to take it. Unusable, its handshake is refused alike (an echo would
    // tell a provider the URL works), and the listing says so.
    if endpoint.revoked_at_unix_ms.is_none() && endpoint.unusable.is_none() && !sources.contains(&endpoint.source_key) {
        let why = format!("its source {:?} is not in the configuration", endpoint.source_key);
        tracing::warn!(endpoint = %id_prefix(endpoint.id), source = %endpoint.source_key, "a stored endpoint's source is not in the configuration; it answers 404 until the source is configured again or it is revoked");
        Endpoint { unusable: Some(why), ..endpoint }
    } else {
        endpoint
    }
}

/// The endpoint a registration under an idempotency key made, and the fingerprint of
/// what it asked for.
type KeyedEndpoint = (u128, [u8; 32]);

/// What a registration did.
#[derive(Debug, Clone)]
pub struct Registered {
    /// The endpoint's record (secret included: shown to the caller).
    pub record: EndpointRecord,
    /// The call repeated an earlier registration under the same idempotency key, and
    /// `record` is the endpoint that registration made, as it is now; nothing was
    /// written.
    pub replayed: bool,
}

/// What a registration asked for, fingerprinted so a retry under the same idempotency
/// key can be told from a different registration reusing it.
struct RegistrationRequest<'a> {
    source_key: &'a str,
    auth: &'a StoredAuth,
    handshake_param: Option<&'a str>,
    expires_at_unix_ms: Option<u64>,
}

impl RegistrationRequest<'_> {
    /// SHA-256 over every field, each absent (a 0 byte) or present (a 1 byte, then its
    /// length and bytes, or its 8 bytes): no two requests share the encoding.
    fn fingerprint(&self) -> [u8; 32] {
        use sha2::Digest;
        fn text(h: &mut sha2::Sha256, t: Option<&str>) {
            match t {
                None => h.update([0]),
                Some(t) => {
                    h.update([1]);
                    h.update((t.len() as u64).to_le_bytes());
                    h.update(t.as_bytes());
                }
            }
        }
        fn number(h: &mut sha2::Sha256, n: Option<u64>) {
            match n {
                None => h.update([0]),
                Some(n) => {
                    h.update([1]);
                    h.update(n.to_le_bytes());
                }
            }
        }
        let mut h = sha2::Sha256::new();
        text(&mut h, Some(self.source_key));
        text(&mut h, Some(&self.auth.scheme));
        text(&mut h, self.auth.secret.as_deref());
        text(&mut h, self.auth.header.as_deref());
        text(&mut h, self.auth.prefix.as_deref());
        number(&mut h, self.auth.tolerance_secs);
        text(&mut h, self.handshake_param);
        number(&mut h, self.expires_at_unix_ms);
        h.finalize().into()
    }
}

impl EndpointRegistry {
    /// Loads the static endpoints and every dynamic one from the state database.
    /// A live dynamic record whose auth no longer reads is loaded unusable, with an error
    /// log: it answers 404, is listed as `unusable`, and can be revoked; a revoked one
    /// stays a tombstone. A static endpoint whose id was
    /// revoked is refused: a revocation never comes back.
    pub fn load(
        state: Arc<StateDb>,
        sources: Vec<String>,
        statics: Vec<Endpoint>,
    ) -> Result<EndpointRegistry, LoadError> {
        let next_version = AtomicU64::new(0);
        let first_version = |endpoint: Endpoint| {
            let version = next_version.fetch_add(1, Ordering::Relaxed);
            Arc::new(EndpointVersion { endpoint, version, gate: Arc::new(AsyncRwLock::new(version)) })
        };
        let mut map: HashMap<u128, Arc<EndpointVersion>> = HashMap::new();
        // Tombstones an earlier build revoked, which kept their secret.
        let mut kept_secrets = Vec::new();
        for stored in state.load_endpoints()? {
            let mut record = match stored {
                Ok(record) => record,
                Err(unreadable) => {
                    tracing::error!(
                        endpoint = %id_prefix(unreadable.id),
                        error = %unreadable.error,
                        "a stored endpoint record does not decode; it answers 404 until revoked through the admin API"
                    );
                    let endpoint = unreadable_endpoint(&unreadable);
                    map.insert(endpoint.id, first_version(endpoint));
                    continue;
                }
            };
            if record.revoked_at_unix_ms.is_some() && record.auth.secret.take().is_some() {
                // A tombstone's auth is never checked; the secret is taken out of the
                // database below.
                kept_secrets.push(record.id);
            }
            let endpoint = endpoint_from_stored(record, &sources);
            map.insert(endpoint.id, first_version(endpoint));
        }
        // Every static endpoint is checked before any stored record is removed: a start
        // refused for one must leave the others' dynamic records as they were.
        for s in &statics {
            if let Some(dynamic) = map.get(&s.id) {
                if dynamic.endpoint.revoked_at_unix_ms.is_some() {
                    return Err(LoadError::RevokedStatic(id_prefix(s.id)));
                }
                if dynamic.endpoint.record.as_ref().is_some_and(|r| r.auth.scheme == UNREADABLE_SCHEME) {
                    return Err(LoadError::UnreadableStatic(id_prefix(s.id)));
                }
            }
        }
        // Kept in the database, they would stay as long as their tombstones (for ever).
        // Not needed to start: a failure is said, and the next start tries again.
        if !kept_secrets.is_empty() {
            match state.forget_tombstone_secrets(&kept_secrets) {
                Ok(n) => tracing::info!(tombstones = n, "the secrets kept in revoked endpoints' records were removed"),
                Err(e) => tracing::warn!(
                    error = %e,
                    "cannot remove the secrets kept in revoked endpoints' records; the next start tries again"
                ),
            }
        }
        for s in statics {
            if map.contains_key(&s.id) {
                // The configuration now owns the id: the stored record is removed, so
                // that taking the static endpoint out of the configuration ends the id
                // (404) rather than bring back the dynamic one with its old secret, and
                // no hidden record counts against the cap or escapes a revocation.
                state.remove_live_endpoint(s.id)?;
                tracing::warn!(endpoint = %id_prefix(s.id), "a static endpoint takes the id of a dynamic one; the dynamic endpoint's stored record is removed");
            }
            map.insert(s.id, first_version(s));
        }
        // Read after the removals above, which take their endpoints' keys with them.
        let registrations =
            state.load_keyed_registrations()?.into_iter().map(|r| (r.key, (r.id, r.fingerprint))).collect();
        Ok(EndpointRegistry {
            state,
            sources,
            tolerance_secs_max: u64::MAX,
            keyed_sources: Vec::new(),
            dynamic_endpoints_max: DYNAMIC_ENDPOINTS_MAX,
            endpoints: RwLock::new(map),
            registrations: Mutex::new(registrations),
            changes: tokio::sync::Mutex::new(()),
            next_version,
            unsettled: Mutex::new(std::collections::HashSet::new()),
            settler_running: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Bounds dynamic endpoints at `max` instead of [`DYNAMIC_ENDPOINTS_MAX`] (never
    /// above it): for a test that reaches the bound through `register` without making a
    /// hundred thousand durable commits.
    #[cfg(test)]
    pub(crate) fn with_dynamic_endpoints_max(mut self, max: usize) -> EndpointRegistry {
        self.dynamic_endpoints_max = max.min(DYNAMIC_ENDPOINTS_MAX);
        self
    }

    /// Bounds the `tolerance_secs` of registrations for `keyed_sources` (those that keep
    /// delivery ids) to `max` (the daemon passes half of `idempotency.retention_secs`): a
    /// request replayed within its signature's tolerance must still find its delivery
    /// id, or it is appended again. A source that keeps no delivery ids has no replay to
    /// answer, and any tolerance. A stored endpoint over the bound (the retention was
    /// lowered since) keeps working, with a warning.
    pub fn with_tolerance_secs_max(mut self, max: u64, keyed_sources: Vec<String>) -> EndpointRegistry {
        self.tolerance_secs_max = max;
        self.keyed_sources = keyed_sources;
        for current in self.endpoints.read().unwrap_or_else(|p| p.into_inner()).values() {
            let e = &current.endpoint;
            if let Some(t) = e.auth.tolerance_secs()
                && t > max
                && self.keyed_sources.contains(&e.source_key)
                && e.dynamic
                && e.revoked_at_unix_ms.is_none()
            {
                tracing::warn!(
                    endpoint = %id_prefix(e.id),
                    tolerance_secs = t,
                    tolerance_secs_max = max,
                    "an endpoint's signature tolerance is more than half the delivery ids' retention: a request replayed late in its tolerance is appended again"
                );
            }
        }
        self
    }

    /// The endpoint's current version, if it takes requests at `now_unix_ms`. What a
    /// request's head is checked against; [`EndpointRegistry::recheck`] decides again
    /// once its body was read.
    pub fn lookup(&self, id: u128, now_unix_ms: u64) -> Result<Arc<EndpointVersion>, Refusal> {
        let current = self.current(id).ok_or(Refusal::Unknown)?;
        check_active(&current.endpoint, now_unix_ms)?;
        Ok(current)
    }

    /// Decides again, after a request's body was read, whether the endpoint that admitted
    /// its head (`seen`) takes it: the version current now (`seen` itself, unless a
    /// rotate or revoke installed another meanwhile), if it is still active and not
    /// expired at `now_unix_ms`, with a permit that holds off every further change until
    /// dropped. Authenticate the request against the version returned, and keep the
    /// permit until its append resolved. One uncontended lock acquisition when nothing
    /// changed.
    pub async fn recheck(
        &self,
        seen: &Arc<EndpointVersion>,
        now_unix_ms: u64,
    ) -> Result<(Arc<EndpointVersion>, EndpointPermit), Refusal> {
        let shared = seen.gate.clone().read_owned().await;
        let current = if *shared == seen.version {
            seen.clone()
        } else {
            // A change installed another version while the body was read. The gate and the
            // map change together under the gate's exclusive hold, so under the shared hold
            // the map holds the version the gate names.
            self.current(seen.endpoint.id).ok_or(Refusal::Unknown)?
        };
        check_active(&current.endpoint, now_unix_ms)?;
        Ok((current, EndpointPermit { _shared: shared }))
    }

    fn current(&self, id: u128) -> Option<Arc<EndpointVersion>> {
        self.endpoints.read().unwrap_or_else(|p| p.into_inner()).get(&id).cloned()
    }

    /// Every endpoint, by id.
    pub fn list(&self, now_unix_ms: u64) -> Vec<EndpointView> {
        self.list_page(now_unix_ms, None, usize::MAX).0
    }

    /// At most `limit` endpoints, by id, those after `after` (all from the first with
    /// `None`), and whether more follow the last one returned. Only the page is built:
    /// a listing of 200,000 endpoints (both kinds at their bounds) is never one answer.
    pub fn list_page(&self, now_unix_ms: u64, after: Option<u128>, limit: usize) -> (Vec<EndpointView>, bool) {
        let map = self.endpoints.read().unwrap_or_else(|p| p.into_inner());
        let mut ids: Vec<u128> = map.keys().copied().filter(|id| after.is_none_or(|a| *id > a)).collect();
        ids.sort_unstable();
        let more = ids.len() > limit;
        let page = ids.iter().take(limit).filter_map(|id| map.get(id)).map(|e| view(&e.endpoint, now_unix_ms));
        (page.collect(), more)
    }

    /// Registers a new dynamic endpoint. A missing secret (for a scheme that needs one)
    /// is generated. Returns the stored record, secret included (shown once).
    pub async fn register(
        self: &Arc<Self>,
        source_key: String,
        auth: StoredAuth,
        handshake_param: Option<String>,
        expires_at_unix_ms: Option<u64>,
        now_unix_ms: u64,
    ) -> Result<EndpointRecord, EndpointError> {
        let registered =
            self.register_keyed(source_key, auth, handshake_param, expires_at_unix_ms, None, now_unix_ms).await?;
        Ok(registered.record)
    }

    /// [`EndpointRegistry::register`], under an idempotency key when `key` is given
    /// (1 to [`ingest::endpoints::REGISTRATION_KEY_MAX_BYTES`] bytes): the first call
    /// with a key registers and stores the key with the endpoint, durably in the same
    /// step; a later call with the same key and the same request writes nothing and
    /// returns that endpoint as it is now (`replayed`), across restarts; the same key
    /// with a different request is [`EndpointError::KeyReused`]. A key whose endpoint's
    /// id was taken by a static endpoint registers anew.
    pub async fn register_keyed(
        self: &Arc<Self>,
        source_key: String,
        auth: StoredAuth,
        handshake_param: Option<String>,
        expires_at_unix_ms: Option<u64>,
        key: Option<Vec<u8>>,
        now_unix_ms: u64,
    ) -> Result<Registered, EndpointError> {
        if let Some(k) = &key
            && (k.is_empty() || k.len() > ingest::endpoints::REGISTRATION_KEY_MAX_BYTES)
        {
            return Err(EndpointError::InvalidField(format!(
                "Idempotency-Key: {} bytes; a key is 1 to {} bytes",
                k.len(),
                ingest::endpoints::REGISTRATION_KEY_MAX_BYTES
            )));
        }
        let this = self.clone();
        run_to_end(async move {
            let registered =
                this.register_now(source_key, auth, handshake_param, expires_at_unix_ms, key, now_unix_ms).await;
            this.settle_later();
            registered
        })
        .await
    }

    /// Replaces a dynamic endpoint's secret (generated when `secret` is `None`). Returns
    /// once no request checked against the old secret can still be appended.
    pub async fn rotate(
        self: &Arc<Self>,
        id: u128,
        secret: Option<String>,
        now_unix_ms: u64,
    ) -> Result<EndpointRecord, EndpointError> {
        let this = self.clone();
        run_to_end(async move {
            let rotated = this.rotate_now(id, secret, now_unix_ms).await;
            this.settle_later();
            rotated
        })
        .await
    }

    /// Revokes a dynamic endpoint (a tombstone; the id never works again). Returns once no
    /// request admitted by the endpoint can still be appended.
    pub async fn revoke(self: &Arc<Self>, id: u128, now_unix_ms: u64) -> Result<EndpointRecord, EndpointError> {
        let this = self.clone();
        run_to_end(async move {
            let revoked = this.revoke_now(id, now_unix_ms).await;
            this.settle_later();
            revoked
        })
        .await
    }

    async fn register_now(
        &self,
        source_key: String,
        mut auth: StoredAuth,
        handshake_param: Option<String>,
        expires_at_unix_ms: Option<u64>,
        key: Option<Vec<u8>>,
        now_unix_ms: u64,
    ) -> Result<Registered, EndpointError> {
        // Taken before the key is looked up, so two calls with one key make one endpoint.
        let _serial = self.changes.lock().await;
        // A registration answered 500 may hold on disk with its key: found before the key
        // is looked up, so that its retry is answered with it, not made again.
        self.settle_registrations_locked();
        let keyed = match key {
            None => None,
            Some(key) => {
                let fingerprint = RegistrationRequest {
                    source_key: &source_key,
                    auth: &auth,
                    handshake_param: handshake_param.as_deref(),
                    expires_at_unix_ms,
                }
                .fingerprint();
                // A retry is answered before the request is checked again: what was
                // valid when it registered (an expiry then in the future) still names it.
                if let Some(record) = self.registered_under(&key, fingerprint)? {
                    return Ok(Registered { record, replayed: true });
                }
                Some((key, fingerprint))
            }
        };
        if !self.sources.contains(&source_key) {
            return Err(EndpointError::UnknownSource(source_key));
        }
        // An endpoint that could only ever answer 410 would take a slot for good (a
        // revoked one's tombstone counts too): an expiry in seconds reads as 1970.
        if let Some(t) = expires_at_unix_ms.filter(|&t| t <= now_unix_ms) {
            return Err(EndpointError::InvalidField(format!(
                "expires_at_unix_ms: {t} is not in the future (milliseconds since the epoch; now is {now_unix_ms})"
            )));
        }
        // The other way round, microseconds (or nanoseconds) given for milliseconds read
        // as an expiry thousands of years away: an endpoint meant to expire never would.
        if let Some(t) = expires_at_unix_ms.filter(|&t| t > EXPIRES_AT_UNIX_MS_MAX) {
            return Err(EndpointError::InvalidField(format!(
                "expires_at_unix_ms: {t} is after the year 9999 (milliseconds since the epoch, not microseconds; now is {now_unix_ms})"
            )));
        }
        if let Some(Err(message)) = handshake_param.as_deref().map(check_handshake_param) {
            return Err(EndpointError::InvalidField(format!("handshake_param: {message}")));
        }
        check_new_secret(&auth.scheme, auth.secret.as_deref())?;
        let too_long = crate::auth::check_new_lengths(auth.header.as_deref(), auth.prefix.as_deref());
        if !too_long.is_empty() {
            let problems: Vec<String> = too_long.into_iter().map(|(field, m)| format!("auth_{field}: {m}")).collect();
            return Err(EndpointError::InvalidAuth(problems.join("; ")));
        }
        if auth.secret.is_none() && auth.scheme != "none" {
            auth.secret = Some(generate_secret(&auth.scheme));
        }
        let scheme = scheme_from_request(&auth).map_err(EndpointError::InvalidAuth)?;
        if let Some(t) = scheme.tolerance_secs()
            && t > self.tolerance_secs_max
            && self.keyed_sources.contains(&source_key)
        {
            return Err(EndpointError::InvalidAuth(format!(
                "auth_tolerance_secs: {t} is more than {} (half of idempotency.retention_secs): a request replayed late in its tolerance would no longer find its delivery id and be appended again",
                self.tolerance_secs_max
            )));
        }
        self.registration_room(self.dynamic_endpoints_max)?;
        let mut id: u128 = rand::random();
        while self.endpoints.read().unwrap_or_else(|p| p.into_inner()).contains_key(&id) {
            id = rand::random();
        }
        let record = EndpointRecord {
            id,
            source_key,
            auth,
            handshake_param,
            created_at_unix_ms: now_unix_ms,
            expires_at_unix_ms,
            revoked_at_unix_ms: None,
            rotated_at_unix_ms: None,
        };
        match keyed {
            None => self.commit(record.clone()).await?,
            Some((key, fingerprint)) => {
                let registration = KeyedRegistration { key, id, fingerprint };
                self.commit_registered(record.clone(), registration.clone()).await?;
                self.registrations
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(registration.key, (id, fingerprint));
            }
        }
        self.install_new(endpoint_from_record(record.clone(), scheme));
        Ok(Registered { record, replayed: false })
    }

    /// The endpoint an earlier registration under `key` made, as it is now, if that
    /// registration asked for what `fingerprint` says; `KeyReused` if it asked for
    /// something else; `None` if the key is new (or its endpoint's id was taken by a
    /// static endpoint since).
    fn registered_under(&self, key: &[u8], fingerprint: [u8; 32]) -> Result<Option<EndpointRecord>, EndpointError> {
        let Some((id, stored)) = self.registrations.lock().unwrap_or_else(|p| p.into_inner()).get(key).copied() else {
            return Ok(None);
        };
        let record = self.current(id).filter(|v| v.endpoint.dynamic).and_then(|v| v.endpoint.record.clone());
        match record {
            None => Ok(None),
            Some(_) if stored != fingerprint => Err(EndpointError::KeyReused(id_prefix(id))),
            Some(record) => Ok(Some(record)),
        }
    }

    /// `Err(TooMany)` when `max` dynamic endpoints (revoked ones included) exist.
    fn registration_room(&self, max: usize) -> Result<(), EndpointError> {
        let map = self.endpoints.read().unwrap_or_else(|p| p.into_inner());
        let dynamic = map.values().filter(|e| e.endpoint.dynamic).count();
        if dynamic >= max { Err(EndpointError::TooMany(dynamic)) } else { Ok(()) }
    }

    async fn rotate_now(
        &self,
        id: u128,
        secret: Option<String>,
        now_unix_ms: u64,
    ) -> Result<EndpointRecord, EndpointError> {
        // Refused before the endpoint's requests are held off: a rotation that can only
        // be refused (a static endpoint, one with no secret) never holds its traffic
        // while it waits for the change lock. Checked again under both.
        self.rotatable(id, secret.as_deref(), now_unix_ms)?;
        let mut held = self.hold_off_requests(id).await?;
        let _serial = self.changes.lock().await;
        self.settle_held(id, &mut held)?;
        let mut record = self.rotatable(id, secret.as_deref(), now_unix_ms)?;
        record.auth.secret = Some(secret.unwrap_or_else(|| generate_secret(&record.auth.scheme)));
        record.rotated_at_unix_ms = Some(now_unix_ms);
        // Named as the request names it (`auth_secret`), as a registration's error is.
        let scheme = scheme_from_stored(&record.auth).map_err(|e| EndpointError::InvalidAuth(format!("auth_{e}")))?;
        self.commit(record.clone()).await?;
        self.install_held(&mut held, endpoint_from_record(record.clone(), scheme));
        Ok(record)
    }

    /// The stored record of `id` if a rotation to `secret` may be made now, else why not.
    fn rotatable(&self, id: u128, secret: Option<&str>, now_unix_ms: u64) -> Result<EndpointRecord, EndpointError> {
        let record = self.dynamic_record(id)?;
        if let Some(why) = self.current(id).and_then(|v| v.endpoint.unusable.clone()) {
            return Err(EndpointError::Unusable(format_id(id), why));
        }
        if record.auth.scheme == "none" {
            return Err(EndpointError::NoSecret(format_id(id)));
        }
        // As a registration that could only ever answer 410 is refused: a new secret for
        // an expired endpoint would be committed and shown, and work nowhere.
        if record.expires_at_unix_ms.is_some_and(|t| t <= now_unix_ms) {
            return Err(EndpointError::Expired(format_id(id)));
        }
        check_new_secret(&record.auth.scheme, secret)?;
        Ok(record)
    }

    async fn revoke_now(&self, id: u128, now_unix_ms: u64) -> Result<EndpointRecord, EndpointError> {
        // Refused before the endpoint's requests are held off, as a rotation is.
        self.dynamic_record(id)?;
        let mut held = self.hold_off_requests(id).await?;
        let _serial = self.changes.lock().await;
        self.settle_held(id, &mut held)?;
        let mut record = self.dynamic_record(id)?;
        record.revoked_at_unix_ms = Some(now_unix_ms);
        // A tombstone's auth is never checked, so its secret is not kept: neither in the
        // database (where it would stay as long as the tombstone, for ever) nor here. An
        // endpoint whose stored auth no longer reads is revoked all the same.
        record.auth.secret = None;
        self.commit(record.clone()).await?;
        self.install_held(&mut held, endpoint_from_record(record.clone(), AuthScheme::None));
        Ok(record)
    }

    fn dynamic_record(&self, id: u128) -> Result<EndpointRecord, EndpointError> {
        let map = self.endpoints.read().unwrap_or_else(|p| p.into_inner());
        let e = &map.get(&id).ok_or_else(|| EndpointError::Unknown(format_id(id)))?.endpoint;
        if !e.dynamic {
            return Err(EndpointError::Static(format_id(id)));
        }
        if e.revoked_at_unix_ms.is_some() {
            return Err(EndpointError::Revoked(format_id(id)));
        }
        e.record.clone().ok_or_else(|| EndpointError::Unknown(format_id(id)))
    }

    async fn commit_registered(
        &self,
        record: EndpointRecord,
        registration: KeyedRegistration,
    ) -> Result<(), EndpointError> {
        let (state, id) = (self.state.clone(), record.id);
        let committed = tokio::task::spawn_blocking(move || state.put_registered_endpoint(&record, &registration))
            .await
            .map_err(|e| StateError::Storage(format!("endpoint commit task failed: {e}")))
            .and_then(|r| r);
        self.unsettled_if_failed(id, committed)
    }

    async fn commit(&self, record: EndpointRecord) -> Result<(), EndpointError> {
        let (state, id) = (self.state.clone(), record.id);
        let committed = tokio::task::spawn_blocking(move || state.put_endpoint(&record))
            .await
            .map_err(|e| StateError::Storage(format!("endpoint commit task failed: {e}")))
            .and_then(|r| r);
        self.unsettled_if_failed(id, committed)
    }

    /// A commit of `id`'s change that failed may hold on disk all the same: `id` is
    /// unsettled until what the disk says is read back.
    fn unsettled_if_failed(&self, id: u128, committed: Result<(), StateError>) -> Result<(), EndpointError> {
        if committed.is_err() {
            self.unsettled.lock().unwrap_or_else(|p| p.into_inner()).insert(id);
        }
        Ok(committed?)
    }

    fn is_unsettled(&self, id: u128) -> bool {
        self.unsettled.lock().unwrap_or_else(|p| p.into_inner()).contains(&id)
    }

    /// Starts the task that settles the unsettled ids, if there are any and it does not
    /// run: it tries each every [`SETTLE_RETRY_INTERVAL`] until the disk reads, and ends
    /// once none is left.
    fn settle_later(self: &Arc<Self>) {
        if self.unsettled.lock().unwrap_or_else(|p| p.into_inner()).is_empty()
            || self.settler_running.swap(true, Ordering::AcqRel)
        {
            return;
        }
        // Held weakly between tries: a registry dropped (the daemon stopped) ends it.
        let registry = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(SETTLE_RETRY_INTERVAL).await;
                let Some(this) = registry.upgrade() else { return };
                let ids: Vec<u128> = this.unsettled.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect();
                for id in ids {
                    this.settle_one(id).await;
                }
                let unsettled = this.unsettled.lock().unwrap_or_else(|p| p.into_inner());
                if unsettled.is_empty() {
                    // Under the set's lock: an id added after this saw it empty starts a
                    // task of its own.
                    this.settler_running.store(false, Ordering::Release);
                    return;
                }
            }
        });
    }

    /// Takes what the disk says of `id`, if it is still unsettled and the disk reads: its
    /// stored record becomes its current version (a new one, for a registration that
    /// held), or, with none stored, memory already says it. Made as a change is: under
    /// the id's gate (once its requests in flight have appended) and the change lock, so
    /// that no change of the id runs between the disk's read and what it installs.
    async fn settle_one(&self, id: u128) {
        // Nothing is held off until the disk reads: while the database waits for its
        // reopen, the endpoint's requests must not wait a change's turn every second.
        if self.state.get_endpoint(id).is_err() {
            return;
        }
        let mut held = match self.current(id) {
            Some(current) => Some(current.gate.clone().write_owned().await),
            None => None,
        };
        let _serial = self.changes.lock().await;
        if !self.is_unsettled(id) {
            return;
        }
        let state = self.state.clone();
        let Ok(Ok(stored)) = tokio::task::spawn_blocking(move || state.get_endpoint(id)).await else { return };
        match (stored, held.as_mut()) {
            (Some(record), Some(held)) => self.install_stored(record, held),
            (Some(record), None) if self.current(id).is_none() => self.install_registration_held(record),
            _ => {}
        }
        self.settled(id);
    }

    /// Settles `id` for a change holding its gate and the change lock: a change of an
    /// unsettled id must start from what the disk says (a rotation of an endpoint whose
    /// revocation held would write a live record over its tombstone), so a disk that
    /// does not read refuses it.
    fn settle_held(&self, id: u128, held: &mut OwnedRwLockWriteGuard<u64>) -> Result<(), EndpointError> {
        if !self.is_unsettled(id) {
            return Ok(());
        }
        if let Some(record) = self.state.get_endpoint(id)? {
            self.install_stored(record, held);
        }
        self.settled(id);
        Ok(())
    }

    /// Settles, for a registration holding the change lock, every unsettled id memory
    /// does not know (a registration answered 500 that may hold on disk, its key with
    /// it); an id whose record does not read yet is left to the task.
    fn settle_registrations_locked(&self) {
        let unknown: Vec<u128> = self
            .unsettled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .copied()
            .filter(|id| self.current(*id).is_none())
            .collect();
        for id in unknown {
            match self.state.get_endpoint(id) {
                Ok(Some(record)) => {
                    self.install_registration_held(record);
                    self.settled(id);
                }
                Ok(None) => self.settled(id),
                Err(_) => {}
            }
        }
    }

    /// Makes known a registration whose commit failed yet held, with the idempotency key
    /// it was stored under, as a restart would load it.
    fn install_registration_held(&self, record: EndpointRecord) {
        let id = record.id;
        tracing::warn!(endpoint = %id_prefix(id), "a registration whose commit failed is in the state database; it is served as a restart would");
        self.install_new(endpoint_from_stored(record, &self.sources));
        self.load_registration_of(id);
    }

    fn install_stored(&self, record: EndpointRecord, held: &mut OwnedRwLockWriteGuard<u64>) {
        tracing::warn!(endpoint = %id_prefix(record.id), revoked = record.revoked_at_unix_ms.is_some(), "a change whose commit failed is taken as the state database holds it");
        self.install_held(held, endpoint_from_stored(record, &self.sources));
    }

    fn settled(&self, id: u128) {
        self.unsettled.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }

    /// The idempotency key a registration of `id` was stored under, if any, as a start
    /// loads it (best effort: without it, a retry under the key registers anew).
    fn load_registration_of(&self, id: u128) {
        if let Ok(keyed) = self.state.load_keyed_registrations() {
            let mut registrations = self.registrations.lock().unwrap_or_else(|p| p.into_inner());
            for r in keyed.into_iter().filter(|r| r.id == id) {
                registrations.insert(r.key, (r.id, r.fingerprint));
            }
        }
    }

    /// The exclusive hold on an existing endpoint's gate, once every request admitted by
    /// its current version has finished appending; new requests wait at their recheck
    /// until it is dropped. A rotate or revoke takes it before the serialising lock, so
    /// that it waits out the requests of its own endpoint while holding nothing else: a
    /// registration, or a change to another endpoint, never queues behind one endpoint's
    /// slow append.
    async fn hold_off_requests(&self, id: u128) -> Result<OwnedRwLockWriteGuard<u64>, EndpointError> {
        let gate = self.current(id).ok_or_else(|| EndpointError::Unknown(format_id(id)))?.gate.clone();
        Ok(gate.write_owned().await)
    }

    /// Makes `endpoint` the current version of its id, under the exclusive hold on its
    /// gate ([`EndpointRegistry::hold_off_requests`]): every request admitted by an older
    /// version has finished appending, and every later one re-checks against this one.
    fn install_held(&self, held: &mut OwnedRwLockWriteGuard<u64>, endpoint: Endpoint) {
        let id = endpoint.id;
        let version = self.next_version.fetch_add(1, Ordering::Relaxed);
        // The hold is on the gate every version of the id shares: the new one takes it.
        let gate = OwnedRwLockWriteGuard::rwlock(held).clone();
        let next = EndpointVersion { endpoint, version, gate };
        self.endpoints.write().unwrap_or_else(|p| p.into_inner()).insert(id, Arc::new(next));
        **held = version;
    }

    /// Makes a newly registered `endpoint` known, with a gate of its own.
    fn install_new(&self, endpoint: Endpoint) {
        let id = endpoint.id;
        let version = self.next_version.fetch_add(1, Ordering::Relaxed);
        let fresh = EndpointVersion { endpoint, version, gate: Arc::new(AsyncRwLock::new(version)) };
        let previous = self.endpoints.write().unwrap_or_else(|p| p.into_inner()).insert(id, Arc::new(fresh));
        debug_assert!(previous.is_none(), "a registration replaced endpoint {}", format_id(id));
    }
}

/// Runs a change in its own task and waits for it, so that a caller that stops waiting
/// (an admin client that disconnected) cannot cut it between the durable commit and the
/// in-memory install.
async fn run_to_end<F, T>(change: F) -> Result<T, EndpointError>
where
    F: std::future::Future<Output = Result<T, EndpointError>> + Send + 'static,
    T: Send + 'static,
{
    tokio::spawn(change)
        .await
        .map_err(|e| EndpointError::State(StateError::Storage(format!("endpoint change task failed: {e}"))))?
}

/// Whether an endpoint takes requests at `now_unix_ms`.
fn check_active(e: &Endpoint, now_unix_ms: u64) -> Result<(), Refusal> {
    if e.revoked_at_unix_ms.is_some() {
        Err(Refusal::Revoked)
    } else if e.unusable.is_some() {
        Err(Refusal::Unusable)
    } else if e.expires_at_unix_ms.is_some_and(|t| t <= now_unix_ms) {
        Err(Refusal::Expired)
    } else {
        Ok(())
    }
}

fn endpoint_from_record(record: EndpointRecord, auth: AuthScheme) -> Endpoint {
    Endpoint {
        id: record.id,
        source_key: record.source_key.clone(),
        auth,
        handshake_param: record.handshake_param.clone(),
        expires_at_unix_ms: record.expires_at_unix_ms,
        revoked_at_unix_ms: record.revoked_at_unix_ms,
        dynamic: true,
        record: Some(record),
        unusable: None,
    }
}

/// The scheme name a record stands in with for a stored record that does not decode. A
/// revocation writes it into the tombstone, which then loads as revoked.
const UNREADABLE_SCHEME: &str = "unreadable";

/// A stored record that does not decode: unusable under its id, with a stand-in record
/// (no source, no secret, the [`UNREADABLE_SCHEME`]) that a revocation turns into a
/// tombstone written over the bytes. Never a request's endpoint: [`check_active`] refuses
/// an unusable one first.
fn unreadable_endpoint(u: &ingest::UnreadableEndpoint) -> Endpoint {
    let record = EndpointRecord {
        id: u.id,
        source_key: String::new(),
        auth: StoredAuth {
            scheme: UNREADABLE_SCHEME.into(),
            secret: None,
            header: None,
            prefix: None,
            tolerance_secs: None,
        },
        handshake_param: None,
        created_at_unix_ms: 0,
        expires_at_unix_ms: None,
        revoked_at_unix_ms: None,
        rotated_at_unix_ms: None,
    };
    unusable_from_record(record, format!("its stored record does not decode ({})", u.error))
}

/// A live stored endpoint whose auth does not read (`why`): it takes no request. Its
/// auth is the never-checked placeholder; [`check_active`] refuses it first.
fn unusable_from_record(record: EndpointRecord, why: String) -> Endpoint {
    Endpoint { unusable: Some(why), ..endpoint_from_record(record, AuthScheme::None) }
}

fn view(e: &Endpoint, now_unix_ms: u64) -> EndpointView {
    let state = if e.revoked_at_unix_ms.is_some() {
        "revoked"
    } else if e.unusable.is_some() {
        "unusable"
    } else if e.expires_at_unix_ms.is_some_and(|t| t <= now_unix_ms) {
        "expired"
    } else {
        "active"
    };
    EndpointView {
        id: format_id(e.id),
        source: e.source_key.clone(),
        auth_type: e.record.as_ref().map_or_else(|| e.auth.name().to_string(), |r| r.auth.scheme.clone()),
        dynamic: e.dynamic,
        state,
        handshake_param: e.handshake_param.clone(),
        expires_at_unix_ms: e.expires_at_unix_ms,
        revoked_at_unix_ms: e.revoked_at_unix_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_setting_its_scheme_does_not_read_still_loads_but_a_new_one_is_refused() {
        let stored = StoredAuth {
            scheme: "bearer".into(),
            secret: Some("a-token-of-some-length".into()),
            header: Some("x-webhook-key".into()),
            prefix: None,
            tolerance_secs: Some(60),
        };
        assert!(scheme_from_stored(&stored).is_ok(), "an endpoint registered before would be lost at start");
        let e = scheme_from_request(&stored).unwrap_err();
        assert!(e.starts_with("auth_header:"), "{e}");
    }

    /// A static endpoint of source `default` without auth.
    fn static_endpoint(id: u128) -> Endpoint {
        Endpoint {
            id,
            source_key: "default".into(),
            auth: AuthScheme::None,
            handshake_param: None,
            expires_at_unix_ms: None,
            revoked_at_unix_ms: None,
            dynamic: false,
            record: None,
            unusable: None,
        }
    }

    fn bearer() -> StoredAuth {
        StoredAuth { scheme: "bearer".into(), secret: None, header: None, prefix: None, tolerance_secs: None }
    }

    #[test]
    fn logs_name_an_endpoint_by_the_first_8_of_its_32_hex_digits() {
        let id = 0x0123_4567_89ab_cdef_0011_2233_4455_6677u128;
        assert_eq!(id_prefix(id), "01234567");
        assert!(format_id(id).starts_with(&id_prefix(id)));
        assert_eq!(id_prefix(0xabc), "00000000", "the leading digits, zeros included");
    }

    #[test]
    fn ids_are_exactly_32_hex_digits() {
        assert_eq!(parse_id(&format_id(0xabc)), Some(0xabc));
        assert_eq!(parse_id("abc"), None);
        assert_eq!(parse_id(&"g".repeat(32)), None);
        assert_eq!(parse_id(&"f".repeat(33)), None);
    }

    /// A rotation to a secret its scheme cannot take names the request's field
    /// (`auth_secret`), as a registration does, and changes nothing.
    #[tokio::test]
    async fn a_rotation_to_an_unusable_secret_names_auth_secret_and_changes_nothing() {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["default".into()], vec![]).unwrap());
        let auth = StoredAuth { scheme: "standard-webhooks".into(), ..bearer() };
        let rec = reg.register("default".into(), auth, None, None, 10).await.unwrap();
        let e = reg.rotate(rec.id, Some("whsec_!!".into()), 11).await.expect_err("an undecodable key");
        assert!(matches!(&e, EndpointError::InvalidAuth(m) if m.starts_with("auth_secret: ")), "{e:?}");
        assert_eq!(state.get_endpoint(rec.id).unwrap(), Some(rec));
    }

    /// Stripe makes its endpoints' signing secrets, so a Stripe registration or rotation
    /// with no secret is refused, naming `auth_secret`, and changes nothing: one made
    /// here could never match a real delivery.
    #[tokio::test]
    async fn a_stripe_endpoint_needs_the_secret_stripe_made_at_registration_and_rotation() {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["default".into()], vec![]).unwrap());
        let stripe =
            |secret: Option<&str>| StoredAuth { scheme: "stripe".into(), secret: secret.map(Into::into), ..bearer() };
        let e = reg.register("default".into(), stripe(None), None, None, 10).await.expect_err("no secret");
        assert!(
            matches!(&e, EndpointError::InvalidAuth(m) if m.starts_with("auth_secret: required for stripe")),
            "{e:?}"
        );
        assert!(reg.list(10).is_empty(), "a refused registration was kept");
        let rec = reg.register("default".into(), stripe(Some("whsec_test_secret")), None, None, 10).await.unwrap();
        let e = reg.rotate(rec.id, None, 11).await.expect_err("no secret");
        assert!(
            matches!(&e, EndpointError::InvalidAuth(m) if m.starts_with("auth_secret: required for stripe")),
            "{e:?}"
        );
        assert_eq!(state.get_endpoint(rec.id).unwrap(), Some(rec.clone()));
        reg.rotate(rec.id, Some("whsec_rolled".into()), 12).await.unwrap();
    }

    /// A tombstone whose stored auth this build no longer reads (a Standard Webhooks key
    /// shorter than it now requires) stays revoked: its id cannot come back as a static
    /// endpoint, and the listing still shows it, under the scheme it was registered with.
    #[tokio::test]
    async fn a_revoked_endpoint_whose_stored_auth_no_longer_reads_stays_revoked() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let id = 0x42u128;
        let short_key = StoredAuth {
            scheme: "standard-webhooks".into(),
            secret: Some("whsec_AAAA".into()),
            header: None,
            prefix: None,
            tolerance_secs: None,
        };
        assert!(scheme_from_stored(&short_key).is_err(), "the key must be one this build refuses");
        state
            .put_endpoint(&EndpointRecord {
                id,
                source_key: "default".into(),
                auth: short_key,
                handshake_param: None,
                created_at_unix_ms: 1,
                expires_at_unix_ms: None,
                revoked_at_unix_ms: Some(2),
                rotated_at_unix_ms: None,
            })
            .unwrap();
        let reg = EndpointRegistry::load(state.clone(), vec!["default".into()], vec![]).unwrap();
        assert_eq!(reg.lookup(id, 3).err(), Some(Refusal::Revoked));
        let listed = reg.list(3);
        assert_eq!(listed.len(), 1);
        assert_eq!((listed[0].state, listed[0].auth_type.as_str()), ("revoked", "standard-webhooks"));
        drop(reg);
        let same_id = static_endpoint(id);
        assert!(matches!(
            EndpointRegistry::load(state, vec!["default".into()], vec![same_id]),
            Err(LoadError::RevokedStatic(_))
        ));
    }

    fn no_auth() -> StoredAuth {
        StoredAuth { scheme: "none".into(), secret: None, header: None, prefix: None, tolerance_secs: None }
    }

    /// Stores a dynamic endpoint of source `default` with `auth` and `secret`, revoked at
    /// `revoked_at_unix_ms` when given, as an earlier start or build left it.
    fn store_dynamic(
        state: &StateDb,
        id: u128,
        auth: StoredAuth,
        secret: Option<String>,
        revoked_at_unix_ms: Option<u64>,
    ) {
        let record = EndpointRecord {
            id,
            source_key: "default".into(),
            auth: StoredAuth { secret, ..auth },
            handshake_param: None,
            created_at_unix_ms: 1,
            expires_at_unix_ms: None,
            revoked_at_unix_ms,
            rotated_at_unix_ms: None,
        };
        state.put_endpoint(&record).unwrap();
    }

    /// A tombstone an earlier build revoked kept its secret, in the database for as long
    /// as the tombstone stays (for ever): the next start takes it out, there and in
    /// memory, and leaves a live endpoint's secret and the tombstone's revocation as they
    /// were.
    #[tokio::test]
    async fn a_start_takes_the_secret_out_of_a_tombstone_an_earlier_build_kept() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let (live, revoked) = (0x71u128, 0x72u128);
        for (id, revoked_at_unix_ms) in [(live, None), (revoked, Some(2))] {
            let secret = Some(format!("token-of-{id}-0123456789abcdef"));
            store_dynamic(&state, id, StoredAuth { scheme: "bearer".into(), ..no_auth() }, secret, revoked_at_unix_ms);
        }
        let reg = EndpointRegistry::load(state.clone(), vec!["default".into()], vec![]).unwrap();
        let stored: Vec<(u128, Option<String>, Option<u64>)> = state
            .load_endpoints()
            .unwrap()
            .into_iter()
            .map(|r| r.unwrap())
            .map(|r| (r.id, r.auth.secret, r.revoked_at_unix_ms))
            .collect();
        assert_eq!(stored, [(live, Some(format!("token-of-{live}-0123456789abcdef")), None), (revoked, None, Some(2))]);
        assert_eq!(reg.lookup(revoked, 3).err(), Some(Refusal::Revoked));
        assert!(reg.lookup(live, 3).is_ok());
        let in_memory = reg.endpoints.read().unwrap().get(&revoked).and_then(|v| v.endpoint.record.clone());
        assert_eq!(in_memory.map(|r| r.auth.secret), Some(None), "the tombstone's secret is still held in memory");
        // Nothing left to take out: neither record holds a secret a start would forget.
        assert_eq!(state.forget_tombstone_secrets(&[live, revoked]).unwrap(), 0);
    }

    /// A start refused for one static endpoint (its id revoked) deletes no stored record
    /// for another static endpoint that takes a dynamic one's id: the operator who takes
    /// the change back finds the dynamic endpoint as it was. Before, records were removed
    /// in the loop that could still refuse the start, and the dynamic endpoint was gone.
    #[tokio::test]
    async fn a_refused_start_removes_no_dynamic_endpoint_for_a_static_one() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let (live, revoked) = (0x61u128, 0x62u128);
        for (id, revoked_at_unix_ms) in [(live, None), (revoked, Some(2))] {
            store_dynamic(&state, id, no_auth(), None, revoked_at_unix_ms);
        }
        let sources = || vec!["default".to_string()];
        let refused =
            EndpointRegistry::load(state.clone(), sources(), vec![static_endpoint(live), static_endpoint(revoked)]);
        assert!(matches!(refused, Err(LoadError::RevokedStatic(_))), "{:?}", refused.err());
        let reg = EndpointRegistry::load(state, sources(), vec![]).unwrap();
        assert!(reg.lookup(live, 3).is_ok(), "the refused start deleted the dynamic endpoint");
        assert_eq!(reg.lookup(revoked, 3).err(), Some(Refusal::Revoked));
    }

    /// A rotation or revocation that can only be refused (a static endpoint) is refused
    /// at once, without holding off the endpoint's requests: while a request holds its
    /// permit, the change would wait for it, and every request after it would wait
    /// behind the change.
    #[tokio::test]
    async fn a_change_that_can_only_be_refused_does_not_wait_for_the_endpoints_requests() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let id = 0x51u128;
        let reg = Arc::new(EndpointRegistry::load(state, vec!["default".into()], vec![static_endpoint(id)]).unwrap());
        let seen = reg.lookup(id, 1).unwrap();
        let (_, permit) = reg.recheck(&seen, 1).await.unwrap();
        let soon = std::time::Duration::from_secs(2);
        let rotated = tokio::time::timeout(soon, reg.rotate(id, None, 1)).await;
        assert!(matches!(rotated, Ok(Err(EndpointError::Static(_)))), "{rotated:?}");
        let revoked = tokio::time::timeout(soon, reg.revoke(id, 1)).await;
        assert!(matches!(revoked, Ok(Err(EndpointError::Static(_)))), "{revoked:?}");
        // A later request of the endpoint is taken at once too.
        let next = tokio::time::timeout(soon, reg.recheck(&seen, 1)).await;
        assert!(next.is_ok_and(|r| r.is_ok()), "a request waited behind a refused change");
        drop(permit);
    }

    /// A static endpoint given the id of a live dynamic one takes it over for good: the
    /// stored record is removed, so taking the static endpoint out of the configuration
    /// ends the id (404) instead of bringing the dynamic one back with its old secret.
    #[tokio::test]
    async fn a_static_endpoint_given_a_dynamic_ones_id_takes_it_over_for_good() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["default".into()], vec![]).unwrap());
        let id = reg.register("default".into(), bearer(), None, None, 1).await.unwrap().id;
        drop(reg);
        let with_static =
            EndpointRegistry::load(state.clone(), vec!["default".into()], vec![static_endpoint(id)]).unwrap();
        assert!(with_static.lookup(id, 2).is_ok_and(|v| !v.endpoint.dynamic));
        assert_eq!(state.get_endpoint(id).unwrap(), None, "the dynamic record is still stored");
        assert_eq!(with_static.list(2).len(), 1);
        drop(with_static);
        let without = EndpointRegistry::load(state, vec!["default".into()], vec![]).unwrap();
        assert_eq!(without.lookup(id, 3).err(), Some(Refusal::Unknown));
    }

    /// A registration may not ask for a signature tolerance longer than half the
    /// delivery ids' retention, the default of 300 s included, when its source keeps
    /// delivery ids; one whose source keeps none may (it has no replay to answer).
    #[tokio::test]
    async fn a_registration_s_tolerance_is_bounded_by_the_retention() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let reg = Arc::new(
            EndpointRegistry::load(state, vec!["default".into(), "unkeyed".into()], vec![])
                .unwrap()
                .with_tolerance_secs_max(200, vec!["default".into()]),
        );
        let stripe = |tolerance_secs| StoredAuth {
            scheme: "stripe".into(),
            secret: Some("whsec_test_secret".into()),
            header: None,
            prefix: None,
            tolerance_secs,
        };
        for tolerance in [None, Some(201)] {
            match reg.register("default".into(), stripe(tolerance), None, None, 10).await {
                Err(EndpointError::InvalidAuth(m)) => assert!(m.contains("retention_secs"), "{m}"),
                other => panic!("{tolerance:?}: {other:?}"),
            }
        }
        assert!(reg.list(10).is_empty(), "a refused registration was kept");
        reg.register("default".into(), stripe(Some(200)), None, None, 10).await.unwrap();
        reg.register("default".into(), bearer(), None, None, 10).await.unwrap();
        for tolerance in [None, Some(201), Some(86_400)] {
            reg.register("unkeyed".into(), stripe(tolerance), None, None, 10)
                .await
                .unwrap_or_else(|e| panic!("{tolerance:?} for a source without delivery ids: {e}"));
        }
        // Yet not without any bound: past a day a captured request passes for days.
        match reg.register("unkeyed".into(), stripe(Some(86_401)), None, None, 10).await {
            Err(EndpointError::InvalidAuth(m)) => {
                assert!(m.starts_with("auth_tolerance_secs: 86401 is more than 86400"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }

    /// A registration that could never work as given is refused, naming the field, and
    /// takes no slot: an expiry not in the future (seconds given for milliseconds read
    /// as 1970, and the endpoint would only answer 410), a handshake parameter no query
    /// could carry, a bearer token no request could present. Rotating to such a token
    /// is refused too.
    #[tokio::test]
    async fn a_registration_that_could_never_work_is_refused_naming_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let reg = Arc::new(EndpointRegistry::load(state, vec!["default".into()], vec![]).unwrap());
        let now = 1_767_225_600_000;
        let with_secret = |s: &str| StoredAuth { secret: Some(s.into()), ..bearer() };
        let long_secret = "s".repeat(crate::auth::AUTH_SECRET_MAX_BYTES + 1);
        let hmac = |header: &str, prefix: &str| StoredAuth {
            scheme: "hmac-sha256".into(),
            secret: Some("key".into()),
            header: Some(header.into()),
            prefix: Some(prefix.into()),
            tolerance_secs: None,
        };
        let (long_header, long_prefix) = ("x".repeat(129), "p".repeat(65));
        let hmac_key = |key: &str| StoredAuth { secret: Some(key.into()), header: None, prefix: None, ..hmac("", "") };
        let refusals: [(StoredAuth, Option<&str>, Option<u64>, &str); 14] = [
            (bearer(), None, Some(1_767_225_600), "expires_at_unix_ms: 1767225600 is not in the future"),
            (bearer(), None, Some(now), "expires_at_unix_ms"),
            (bearer(), None, Some(now * 1000), "expires_at_unix_ms: 1767225600000000 is after the year 9999"),
            (bearer(), Some(""), None, "handshake_param"),
            (bearer(), Some("a&b"), None, "handshake_param"),
            (bearer(), Some("hub+challenge"), None, "handshake_param"),
            (bearer(), Some("hub%2Echallenge"), None, "handshake_param"),
            (with_secret("tok "), None, None, "secret: a bearer token is visible ASCII"),
            (with_secret("tök"), None, None, "secret: a bearer token is visible ASCII"),
            (with_secret(&long_secret), None, None, "auth_secret: is 1025 bytes long; at most 1024"),
            (hmac_key("key\n"), None, None, "secret: holds a control character"),
            (hmac(&long_header, "sha256="), None, None, "auth_header: is 129 bytes long; at most 128"),
            (hmac("x-sig", &long_prefix), None, None, "auth_prefix: is 65 bytes long; at most 64"),
            (
                hmac(&long_header, &long_prefix),
                None,
                None,
                "auth_header: is 129 bytes long; at most 128 are accepted; auth_prefix: is 65",
            ),
        ];
        for (auth, param, expires, says) in refusals {
            match reg.register("default".into(), auth, param.map(str::to_string), expires, now).await {
                Err(e @ (EndpointError::InvalidField(_) | EndpointError::InvalidAuth(_))) => {
                    assert!(e.to_string().contains(says), "{e}")
                }
                other => panic!("{param:?} {expires:?}: {other:?}"),
            }
        }
        assert!(reg.list(now).is_empty(), "a refused registration was kept");
        let fine = reg.register("default".into(), with_secret("tok"), Some("challenge".into()), Some(now + 1), now);
        let fine = fine.await.unwrap();
        match reg.rotate(fine.id, Some("new token".into()), now).await {
            Err(EndpointError::InvalidAuth(m)) => assert!(m.contains("visible ASCII"), "{m}"),
            other => panic!("{other:?}"),
        }
        match reg.rotate(fine.id, Some(long_secret.clone()), now).await {
            Err(EndpointError::InvalidAuth(m)) => assert!(m.contains("at most 1024"), "{m}"),
            other => panic!("{other:?}"),
        }
        // At the bounds, each is taken.
        let at_bounds = hmac(&"x".repeat(128), &"p".repeat(64));
        let at_bounds = StoredAuth { secret: Some("k".repeat(1024)), ..at_bounds };
        reg.register("default".into(), at_bounds, None, None, now).await.unwrap();
    }

    /// Registrations are bounded, and tombstones count: they are never removed (a
    /// revoked id never works again), so without the bound a management client could
    /// grow the state database and the daemon's memory without end.
    #[tokio::test]
    async fn dynamic_endpoints_are_bounded_and_revoked_ones_count() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let statics = vec![static_endpoint(1)];
        let reg = Arc::new(EndpointRegistry::load(state, vec!["default".into()], statics).unwrap());
        let a = reg.register("default".into(), bearer(), None, None, 10).await.unwrap();
        reg.register("default".into(), bearer(), None, None, 10).await.unwrap();
        reg.revoke(a.id, 11).await.unwrap();
        // Two dynamic endpoints, one revoked; the static one does not count.
        assert!(matches!(reg.registration_room(2), Err(EndpointError::TooMany(2))));
        assert!(reg.registration_room(3).is_ok());
        assert_eq!(reg.dynamic_endpoints_max, DYNAMIC_ENDPOINTS_MAX, "the daemon's bound");

        // Through `register` itself, at a bound of 3: the third is made, the fourth
        // refused, and nothing of it is stored.
        let state = Arc::new(StateDb::open(dir.path().join("t.redb")).unwrap());
        let reg = Arc::new(
            EndpointRegistry::load(state.clone(), vec!["default".into()], vec![static_endpoint(1)])
                .unwrap()
                .with_dynamic_endpoints_max(3),
        );
        let first = reg.register("default".into(), bearer(), None, None, 10).await.unwrap();
        reg.revoke(first.id, 11).await.unwrap();
        for _ in 0..2 {
            reg.register("default".into(), bearer(), None, None, 12).await.unwrap();
        }
        match reg.register("default".into(), bearer(), None, None, 13).await {
            Err(EndpointError::TooMany(3)) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(state.load_endpoints().unwrap().len(), 3, "the refused registration was stored");
    }

    #[tokio::test]
    async fn register_rotate_revoke_persist_and_static_ones_refuse() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let statics = vec![static_endpoint(1)];
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["default".into()], statics.clone()).unwrap());
        let rec = reg.register("default".into(), bearer(), None, None, 10).await.unwrap();
        let first_secret = rec.auth.secret.clone().unwrap();
        assert_eq!(first_secret.len(), 64);
        let rotated = reg.rotate(rec.id, None, 11).await.unwrap();
        assert_ne!(rotated.auth.secret.as_deref(), Some(first_secret.as_str()));
        assert!(matches!(reg.rotate(1, None, 11).await, Err(EndpointError::Static(_))));
        assert!(matches!(reg.revoke(1, 11).await, Err(EndpointError::Static(_))));
        assert!(matches!(
            reg.register("nope".into(), bearer(), None, None, 10).await,
            Err(EndpointError::UnknownSource(_))
        ));
        let revoked = reg.revoke(rec.id, 12).await.unwrap();
        assert_eq!(reg.lookup(rec.id, 13).err(), Some(Refusal::Revoked));
        assert!(matches!(reg.rotate(rec.id, None, 13).await, Err(EndpointError::Revoked(_))));
        // The tombstone keeps no secret, on disk or in memory.
        assert_eq!(revoked.auth.secret, None);
        let on_disk = state.get_endpoint(rec.id).unwrap().expect("the tombstone");
        assert_eq!((on_disk.revoked_at_unix_ms, on_disk.auth.secret), (Some(12), None));
        assert_eq!(on_disk.auth.scheme, "bearer", "the rest of its auth stays, for the listing");
        drop(reg);
        let again = EndpointRegistry::load(state, vec!["default".into()], statics).unwrap();
        assert_eq!(again.lookup(rec.id, 14).err(), Some(Refusal::Revoked));
        assert!(again.lookup(1, 14).is_ok());
        assert_eq!(again.lookup(2, 14).err(), Some(Refusal::Unknown));
    }

    /// An admin change whose durable commit fails is answered as a failure and changes
    /// nothing in memory: a revocation that failed leaves the endpoint working (as the
    /// error said), never revoked in memory while the disk may not hold it. Once the
    /// database is reopened, the change made again is answered, and a power loss after
    /// that answer keeps it.
    #[tokio::test]
    async fn a_change_whose_commit_fails_changes_nothing_and_its_retry_survives_a_power_loss() {
        use wal::storage::{CrashMode, FaultOp, SimStorage, Storage};
        let sim = SimStorage::new();
        sim.set_failed_syncs_write_nothing(true);
        sim.write_file_durably(std::path::Path::new("/data/keep"), b"").unwrap();
        let open = |sim: &SimStorage| {
            let storage: Arc<dyn Storage> = Arc::new(sim.clone());
            Arc::new(StateDb::open_on(storage, "/data/state.redb").unwrap())
        };
        let state = open(&sim);
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["default".into()], vec![]).unwrap());
        let rec = reg.register("default".into(), bearer(), None, None, 10).await.unwrap();

        sim.fail_nth(FaultOp::Sync, 1, std::io::ErrorKind::Other);
        assert!(matches!(reg.revoke(rec.id, 11).await, Err(EndpointError::State(_))), "the commit failed");
        assert!(reg.lookup(rec.id, 12).is_ok(), "a revocation answered failed revoked nothing");
        assert!(matches!(reg.revoke(rec.id, 12).await, Err(EndpointError::State(_))), "until the reopen");
        assert!(state.reopen_if_failed().unwrap());
        reg.revoke(rec.id, 13).await.unwrap();
        assert_eq!(reg.lookup(rec.id, 14).err(), Some(Refusal::Revoked));
        drop((reg, state));

        sim.crash(CrashMode::LoseUnsynced);
        let again = EndpointRegistry::load(open(&sim), vec!["default".into()], vec![]).unwrap();
        assert_eq!(again.lookup(rec.id, 15).err(), Some(Refusal::Revoked), "the revocation answered came back");
    }

    /// A storage double whose armed sync makes the data durable, then reports a failure
    /// (a disk that flushed and then erred, or an earlier writeback's error reported at
    /// this sync): a commit that fails yet holds.
    #[derive(Debug, Default)]
    struct SyncsThenFails {
        armed: std::sync::atomic::AtomicBool,
    }

    impl wal::storage::Hooks for SyncsThenFails {
        fn sync_data(&self, file: &dyn wal::storage::StorageFile) -> std::io::Result<()> {
            file.sync_data()?;
            match self.armed.swap(false, Ordering::SeqCst) {
                true => Err(std::io::Error::other("the sync was made, then failed (test double)")),
                false => Ok(()),
            }
        }
    }

    /// A change whose commit failed may hold on disk all the same. Once the database reads
    /// again, the registry takes what the disk says: a revocation that held is in effect
    /// (the endpoint refused as revoked), and is never undone by a later change (a
    /// rotation of it is refused); a rotation that held serves its new secret, the one a
    /// restart would load. Before, memory kept the old state until a restart: a revoked
    /// endpoint kept answering 200, and a rotation of it wrote a live record over its
    /// tombstone.
    #[tokio::test]
    async fn a_change_that_failed_yet_held_on_disk_is_taken_from_the_disk() {
        use wal::storage::{HookedStorage, SimStorage, Storage};
        let sim = SimStorage::new();
        sim.write_file_durably(std::path::Path::new("/data/keep"), b"").unwrap();
        let hooked = Arc::new(HookedStorage::new(Arc::new(sim), SyncsThenFails::default()));
        let storage: Arc<dyn Storage> = hooked.clone();
        let state = Arc::new(StateDb::open_on(storage, "/data/state.redb").unwrap());
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["default".into()], vec![]).unwrap());
        let (a, b) = (
            reg.register("default".into(), bearer(), None, None, 10).await.unwrap(),
            reg.register("default".into(), bearer(), None, None, 10).await.unwrap(),
        );

        hooked.hooks().armed.store(true, Ordering::SeqCst);
        assert!(matches!(reg.rotate(b.id, None, 11).await, Err(EndpointError::State(_))), "the commit failed");
        assert!(state.reopen_if_failed().unwrap());
        hooked.hooks().armed.store(true, Ordering::SeqCst);
        assert!(matches!(reg.revoke(a.id, 11).await, Err(EndpointError::State(_))), "the commit failed");
        assert!(state.reopen_if_failed().unwrap());
        let on_disk = |id| state.get_endpoint(id).unwrap().unwrap();
        assert!(on_disk(a.id).revoked_at_unix_ms.is_some(), "precondition: the revocation holds on disk");
        let rotated_secret = on_disk(b.id).auth.secret;
        assert_ne!(rotated_secret, b.auth.secret, "precondition: the rotation holds on disk");

        // A change of an unsettled id starts from the disk: the rotation is refused, and
        // the revocation is in effect from then on.
        assert!(matches!(reg.rotate(a.id, None, 12).await, Err(EndpointError::Revoked(_))));
        assert!(on_disk(a.id).revoked_at_unix_ms.is_some(), "a rotation undid a revocation on disk");
        assert_eq!(reg.lookup(a.id, 12).err(), Some(Refusal::Revoked), "a revocation on disk is not in effect");
        // With no change to come, the registry settles by itself within a second or so.
        let secret_served = |reg: &EndpointRegistry| {
            reg.lookup(b.id, 12).unwrap().endpoint.record.as_ref().and_then(|r| r.auth.secret.clone())
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while secret_served(&reg) != rotated_secret {
            assert!(std::time::Instant::now() < deadline, "the rotation on disk is not served");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }

        // A registration that failed yet held is listed, as a restart would list it.
        hooked.hooks().armed.store(true, Ordering::SeqCst);
        let failed = reg.register("default".into(), bearer(), None, None, 13).await;
        assert!(matches!(failed, Err(EndpointError::State(_))), "the commit failed");
        assert!(state.reopen_if_failed().unwrap());
        assert_eq!(state.load_endpoints().unwrap().len(), 3, "precondition: the registration holds on disk");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while reg.list(14).len() != 3 {
            assert!(std::time::Instant::now() < deadline, "a registration on disk is not listed");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }

        // A keyed registration that failed yet held is found by its retry at once, under
        // its key, not made a second time.
        let keyed = || reg.register_keyed("default".into(), bearer(), None, None, Some(b"k-1".to_vec()), 15);
        hooked.hooks().armed.store(true, Ordering::SeqCst);
        assert!(matches!(keyed().await, Err(EndpointError::State(_))), "the commit failed");
        assert!(state.reopen_if_failed().unwrap());
        assert_eq!(state.load_endpoints().unwrap().len(), 4, "precondition: the registration holds on disk");
        let retried = keyed().await.unwrap();
        assert!(retried.replayed, "the retry registered a second endpoint");
        assert_eq!(state.load_endpoints().unwrap().len(), 4);
    }

    /// Registrations (with a key and without), rotations and revocations made through the
    /// registry, with a power loss before each write of the state database in turn:
    /// after the restart, every change answered is in effect (a rotated endpoint has its
    /// new secret, a revoked one is refused as revoked, a registered one exists as
    /// answered and a keyed one is found again under its key), and the change the loss
    /// cut short is done or not, nothing else. The state database's own sweep (`ingest/tests/power_loss.rs`) writes
    /// endpoints directly; this one goes through what the admin API calls.
    #[tokio::test]
    async fn every_change_answered_through_the_registry_survives_a_power_loss_before_any_write() {
        use wal::storage::{CrashMode, FaultOp, SimStorage, Storage};

        #[derive(Clone, Copy, Debug)]
        enum Step {
            Register,
            RegisterKeyed,
            Rotate(usize),
            Revoke(usize),
        }
        // Each `Rotate(i)`/`Revoke(i)` acts on the `i`th endpoint registered.
        const SCRIPT: [Step; 6] =
            [Step::Register, Step::Rotate(0), Step::RegisterKeyed, Step::Revoke(0), Step::Rotate(1), Step::Register];
        let sources = || vec!["default".to_string()];
        let open = |sim: &SimStorage| -> Result<Arc<EndpointRegistry>, String> {
            let storage: Arc<dyn Storage> = Arc::new(sim.clone());
            let state = Arc::new(StateDb::open_on(storage, "/data/state.redb").map_err(|e| e.to_string())?);
            Ok(Arc::new(EndpointRegistry::load(state, sources(), vec![]).map_err(|e| format!("{e:?}"))?))
        };
        // What was answered: the last record of each endpoint, in registration order, and
        // the step that failed (cut short by the loss), if any.
        #[derive(Default, Debug)]
        struct Answered {
            records: Vec<EndpointRecord>,
            cut_short: Option<(Step, u64)>,
        }
        async fn run(reg: &Arc<EndpointRegistry>) -> Answered {
            let mut answered = Answered::default();
            for (i, step) in SCRIPT.iter().enumerate() {
                let now = 100 + i as u64;
                let result = match *step {
                    Step::Register => reg.register("default".into(), bearer(), None, None, now).await,
                    Step::RegisterKeyed => reg
                        .register_keyed("default".into(), bearer(), None, None, Some(b"deploy-1".to_vec()), now)
                        .await
                        .map(|r| r.record),
                    Step::Rotate(n) => reg.rotate(answered.records[n].id, None, now).await,
                    Step::Revoke(n) => reg.revoke(answered.records[n].id, now).await,
                };
                match result {
                    Ok(record) => match answered.records.iter_mut().find(|r| r.id == record.id) {
                        Some(r) => *r = record,
                        None => answered.records.push(record),
                    },
                    Err(_) => {
                        answered.cut_short = Some((*step, now));
                        break;
                    }
                }
            }
            answered
        }
        let new_disk = || {
            let sim = SimStorage::new();
            sim.write_file_durably(std::path::Path::new("/data/keep"), b"").unwrap();
            sim
        };

        let clean = new_disk();
        let before = clean.ops();
        let reg = open(&clean).unwrap();
        let all = run(&reg).await;
        assert!(all.cut_short.is_none(), "the script failed with the power on: {all:?}");
        let mutations = clean.ops() - before;
        let mut cut = 0;
        for n in 1..=mutations {
            for mode in [CrashMode::LoseUnsynced, CrashMode::Reordered { seed: n }] {
                let sim = new_disk();
                sim.crash_at_nth(FaultOp::AnyMutation, n, mode);
                let answered = match open(&sim) {
                    Ok(reg) => run(&reg).await,
                    Err(_) => Answered::default(),
                };
                if sim.crashes() == 0 {
                    continue;
                }
                cut += 1;
                sim.disarm();
                let case = format!("power lost before mutation {n} of {mutations}, {mode:?}: {answered:?}");
                let reg = open(&sim).unwrap_or_else(|e| panic!("{case}: the restart failed: {e}"));
                let now = 1_000;
                // The one change the loss may have cut short: its endpoint may show it.
                let cut_target = match answered.cut_short {
                    Some((Step::Rotate(i) | Step::Revoke(i), at)) => answered.records.get(i).map(|r| (r.id, at)),
                    _ => None,
                };
                for want in &answered.records {
                    let got = match reg.lookup(want.id, now) {
                        Ok(v) => v.endpoint.record.clone(),
                        Err(Refusal::Revoked) => {
                            let stored = reg.state.get_endpoint(want.id).unwrap();
                            assert!(stored.as_ref().is_some_and(|s| s.revoked_at_unix_ms.is_some()), "{case}");
                            stored
                        }
                        Err(e) => panic!("{case}: endpoint {} answered {e:?} after the restart", format_id(want.id)),
                    };
                    let Some(got) = got else { panic!("{case}: endpoint {} has no record", format_id(want.id)) };
                    if got == *want {
                        continue;
                    }
                    // Not as answered: only the change cut short may have reached it.
                    let by_cut = cut_target.is_some_and(|(id, at)| {
                        id == want.id && (got.rotated_at_unix_ms == Some(at) || got.revoked_at_unix_ms == Some(at))
                    });
                    assert!(by_cut, "{case}: endpoint {} is {got:?}, answered {want:?}", format_id(want.id));
                }
                // At most one endpoint more: a registration cut short.
                let extra = reg.list(now).len() - answered.records.len();
                let registering = matches!(answered.cut_short, Some((Step::Register | Step::RegisterKeyed, _)));
                assert!(extra == 0 || (extra == 1 && registering), "{case}: {extra} endpoints more than answered");
                // A keyed registration answered is found again under its key.
                if let Some(keyed) = answered.records.get(1) {
                    let again = reg
                        .register_keyed("default".into(), bearer(), None, None, Some(b"deploy-1".to_vec()), now)
                        .await
                        .unwrap();
                    assert!(again.replayed && again.record.id == keyed.id, "{case}: the keyed registration was lost");
                }
            }
        }
        assert!(cut as u64 > mutations, "only {cut} of {mutations} loss points were reached");
    }

    /// An expired endpoint answers 410 whatever its secret: rotating it is refused and
    /// stores nothing; revoking it works.
    #[tokio::test]
    async fn an_expired_endpoint_is_not_rotated_but_can_be_revoked() {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["default".into()], vec![]).unwrap());
        let rec = reg.register("default".into(), bearer(), None, Some(20), 10).await.unwrap();
        assert!(reg.rotate(rec.id, None, 19).await.is_ok(), "before its expiry");
        let stored = state.get_endpoint(rec.id).unwrap();
        assert!(matches!(reg.rotate(rec.id, None, 20).await, Err(EndpointError::Expired(_))));
        assert_eq!(state.get_endpoint(rec.id).unwrap(), stored, "a refused rotation stored a secret");
        reg.revoke(rec.id, 21).await.unwrap();
        assert_eq!(reg.lookup(rec.id, 22).err(), Some(Refusal::Revoked));
    }

    /// A live stored endpoint of a source removed from the configuration takes nothing,
    /// not even a handshake, and is listed as unusable; configured again, it is active.
    #[tokio::test]
    async fn a_stored_endpoint_of_a_source_no_longer_configured_is_unusable() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["a".into(), "b".into()], vec![]).unwrap());
        let none = StoredAuth { scheme: "none".into(), secret: None, header: None, prefix: None, tolerance_secs: None };
        let id = reg.register("a".into(), none, Some("challenge".into()), None, 1).await.unwrap().id;
        assert!(reg.lookup(id, 2).is_ok());
        drop(reg);
        let without = EndpointRegistry::load(state.clone(), vec!["b".into()], vec![]).unwrap();
        assert_eq!(without.lookup(id, 3).err(), Some(Refusal::Unusable));
        assert_eq!(without.list(3)[0].state, "unusable");
        drop(without);
        let again = EndpointRegistry::load(state, vec!["a".into(), "b".into()], vec![]).unwrap();
        assert!(again.lookup(id, 4).is_ok());
        assert_eq!(again.list(4)[0].state, "active");
    }

    /// A stored record that does not decode at all (damage the database's own checks did
    /// not catch) does not keep the daemon from starting: it is listed as unusable under
    /// its id, takes nothing, can be revoked (a tombstone written over its bytes), and the
    /// revocation holds across a restart. A static endpoint of its id is refused: the
    /// record may have been a revocation.
    #[tokio::test]
    async fn a_stored_record_that_does_not_decode_takes_nothing_but_can_be_revoked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.redb");
        drop(StateDb::open(&path).unwrap());
        let id = 0x00bb_0000_0000_0000_0000_0000_0000_0001u128;
        {
            let db = redb::Database::open(&path).unwrap();
            let txn = db.begin_write().unwrap();
            {
                let mut table = txn.open_table(redb::TableDefinition::<u128, &[u8]>::new("endpoints")).unwrap();
                table.insert(id, &[0xff_u8, 0xff, 0xff][..]).unwrap();
            }
            txn.commit().unwrap();
        }
        let state = Arc::new(StateDb::open(&path).unwrap());
        let sources = || vec!["default".to_string()];
        let refused = EndpointRegistry::load(state.clone(), sources(), vec![static_endpoint(id)]);
        assert!(matches!(refused, Err(LoadError::UnreadableStatic(_))), "{:?}", refused.err());
        let reg = Arc::new(EndpointRegistry::load(state.clone(), sources(), vec![static_endpoint(1)]).unwrap());
        assert_eq!(reg.lookup(id, 2).err(), Some(Refusal::Unusable));
        assert!(reg.lookup(1, 2).is_ok(), "the other endpoints work");
        let listed: Vec<_> = reg.list(2).into_iter().filter(|v| v.id == format_id(id)).collect();
        assert_eq!((listed[0].state, listed[0].auth_type.as_str()), ("unusable", "unreadable"));
        assert!(matches!(reg.rotate(id, None, 3).await, Err(EndpointError::Unusable(..))));
        assert_eq!(reg.revoke(id, 4).await.unwrap().revoked_at_unix_ms, Some(4));
        assert_eq!(reg.lookup(id, 5).err(), Some(Refusal::Revoked));
        drop(reg);
        let again = EndpointRegistry::load(state.clone(), sources(), vec![]).unwrap();
        assert_eq!(again.lookup(id, 6).err(), Some(Refusal::Revoked));
        assert!(matches!(state.load_endpoints().unwrap()[0], Ok(EndpointRecord { revoked_at_unix_ms: Some(4), .. })));
        drop(again);
        let refused = EndpointRegistry::load(state, sources(), vec![static_endpoint(id)]);
        assert!(matches!(refused, Err(LoadError::RevokedStatic(_))), "{:?}", refused.err());
    }

    /// A live stored record whose auth this build cannot read takes no request, but is
    /// listed and can be revoked, and the revocation holds across a restart: skipped at
    /// load, it could never be revoked, and a build that reads it again would bring it back.
    #[tokio::test]
    async fn a_stored_endpoint_whose_auth_does_not_read_takes_nothing_but_can_be_revoked() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let id = 0x00aa_0000_0000_0000_0000_0000_0000_0001u128;
        let unreadable = StoredAuth {
            scheme: "a-scheme-of-another-build".into(),
            secret: Some("s".into()),
            header: None,
            prefix: None,
            tolerance_secs: None,
        };
        assert!(scheme_from_stored(&unreadable).is_err());
        state
            .put_endpoint(&EndpointRecord {
                id,
                source_key: "default".into(),
                auth: unreadable,
                handshake_param: None,
                created_at_unix_ms: 1,
                expires_at_unix_ms: None,
                revoked_at_unix_ms: None,
                rotated_at_unix_ms: None,
            })
            .unwrap();
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["default".into()], vec![]).unwrap());
        assert_eq!(reg.lookup(id, 2).err(), Some(Refusal::Unusable));
        let listed = reg.list(2);
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].state, "unusable");
        assert!(matches!(reg.rotate(id, None, 3).await, Err(EndpointError::Unusable(..))));
        let revoked = reg.revoke(id, 4).await.unwrap();
        assert_eq!(revoked.revoked_at_unix_ms, Some(4));
        assert_eq!(reg.lookup(id, 5).err(), Some(Refusal::Revoked));
        drop(reg);
        let again = EndpointRegistry::load(state, vec!["default".into()], vec![]).unwrap();
        assert_eq!(again.lookup(id, 6).err(), Some(Refusal::Revoked));
        assert_eq!(again.list(6)[0].state, "revoked");
    }

    #[tokio::test]
    async fn a_change_waits_for_every_permit_of_the_old_version_and_a_recheck_sees_the_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let reg = Arc::new(EndpointRegistry::load(state, vec!["default".into()], vec![]).unwrap());
        let rec = reg.register("default".into(), bearer(), None, Some(1_000), 10).await.unwrap();
        let seen = reg.lookup(rec.id, 20).unwrap();
        let (admitted, permit) = reg.recheck(&seen, 20).await.unwrap();
        assert!(Arc::ptr_eq(&admitted, &seen), "nothing changed: the version seen is the one admitted");

        // A rotate cannot complete while a request admitted by the old version holds its permit.
        let rotating = tokio::spawn({
            let reg = reg.clone();
            async move { reg.rotate(rec.id, Some("new-secret".into()), 30).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!rotating.is_finished(), "the rotate returned while a request of the old version was appending");
        drop(permit);
        rotating.await.unwrap().unwrap();

        // A request whose head saw the old version is checked against the new one.
        let (current, permit) = reg.recheck(&seen, 40).await.unwrap();
        assert!(!Arc::ptr_eq(&current, &seen));
        let token = match &current.endpoint.auth {
            AuthScheme::Bearer { token } => token.clone(),
            other => panic!("{other:?}"),
        };
        assert!(token.matches("new-secret"));
        drop(permit);

        // Revoked, and past its expiry: refused however the head saw it.
        assert_eq!(reg.recheck(&seen, 2_000).await.err(), Some(Refusal::Expired));
        reg.revoke(rec.id, 50).await.unwrap();
        assert_eq!(reg.recheck(&seen, 60).await.err(), Some(Refusal::Revoked));
    }

    /// A rotate waiting for a slow request of its endpoint holds up nothing else: a
    /// registration, and a rotate and a revoke of another endpoint, complete meanwhile.
    #[tokio::test]
    async fn a_change_waiting_for_its_endpoint_s_requests_holds_up_no_other_change() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let reg = Arc::new(EndpointRegistry::load(state, vec!["default".into()], vec![]).unwrap());
        let slow = reg.register("default".into(), bearer(), None, None, 10).await.unwrap();
        let other = reg.register("default".into(), bearer(), None, None, 10).await.unwrap();
        let (_, permit) = reg.recheck(&reg.lookup(slow.id, 20).unwrap(), 20).await.unwrap();
        let rotating = tokio::spawn({
            let reg = reg.clone();
            async move { reg.rotate(slow.id, Some("new-secret".into()), 30).await }
        });
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!rotating.is_finished(), "the rotate returned while a request of the old version was appending");

        let limit = std::time::Duration::from_secs(5);
        let others = async {
            reg.register("default".into(), bearer(), None, None, 40).await.unwrap();
            reg.rotate(other.id, Some("other-secret".into()), 41).await.unwrap();
            reg.revoke(other.id, 42).await.unwrap();
        };
        tokio::time::timeout(limit, others).await.expect("changes to other endpoints waited for the slow request");
        assert!(!rotating.is_finished());
        drop(permit);
        let rotated = tokio::time::timeout(limit, rotating).await.expect("the rotate never finished").unwrap().unwrap();
        assert_eq!(rotated.auth.secret.as_deref(), Some("new-secret"));
        assert_eq!(reg.list(50).len(), 3);
    }

    /// A registration repeated under its idempotency key makes no second endpoint: it is
    /// answered with the endpoint the first made (its generated secret, and after a
    /// rotation the current one), across a power loss; the same key with a different
    /// request is refused and writes nothing; a retry whose expiry has passed since is
    /// still the same registration.
    #[tokio::test]
    async fn a_registration_repeated_under_its_key_makes_one_endpoint_across_a_power_loss() {
        use wal::storage::{CrashMode, SimStorage, Storage};
        let sim = SimStorage::new();
        sim.write_file_durably(std::path::Path::new("/data/keep"), b"").unwrap();
        let open = |sim: &SimStorage| {
            let storage: Arc<dyn Storage> = Arc::new(sim.clone());
            let state = Arc::new(StateDb::open_on(storage, "/data/state.redb").unwrap());
            Arc::new(EndpointRegistry::load(state, vec!["default".into(), "other".into()], vec![]).unwrap())
        };
        let reg = open(&sim);
        let key = || Some(b"deploy-42".to_vec());
        let register = |reg: Arc<EndpointRegistry>, expires: Option<u64>, now: u64| async move {
            reg.register_keyed("default".into(), bearer(), None, expires, key(), now).await
        };
        let first = register(reg.clone(), Some(1_000), 10).await.unwrap();
        assert!(!first.replayed);
        let secret = first.record.auth.secret.clone();
        assert!(secret.is_some(), "a secret was generated");
        let again = register(reg.clone(), Some(1_000), 11).await.unwrap();
        assert!(again.replayed);
        assert_eq!(again.record, first.record, "the retry is answered with the first registration's endpoint");
        assert_eq!(reg.list(12).len(), 1, "one endpoint");

        // The same key for another request: refused, nothing written.
        let other = reg.register_keyed("other".into(), bearer(), None, Some(1_000), key(), 13).await;
        assert!(matches!(other, Err(EndpointError::KeyReused(_))), "{other:?}");
        let other = register(reg.clone(), Some(2_000), 13).await;
        assert!(matches!(other, Err(EndpointError::KeyReused(_))), "another expiry is another request");
        assert_eq!(reg.list(14).len(), 1, "a reused key made an endpoint");

        // Durable with the endpoint: after a power loss the retry still finds it, even
        // once the expiry it asked for has passed (it is the same request).
        drop(reg);
        sim.crash(CrashMode::LoseUnsynced);
        let reg = open(&sim);
        let after = register(reg.clone(), Some(1_000), 2_000).await.unwrap();
        assert!(after.replayed);
        assert_eq!(after.record.id, first.record.id);
        assert_eq!(after.record.auth.secret, secret);

        // A rotation since: the retry shows the endpoint as it is now.
        let rotated = reg.rotate(first.record.id, None, 500).await.unwrap();
        let after = register(reg.clone(), Some(1_000), 501).await.unwrap();
        assert_eq!(after.record.auth.secret, rotated.auth.secret);
        assert_eq!(reg.list(502).len(), 1);

        // Keys are 1 to 255 bytes; without a key every call registers.
        let empty = reg.register_keyed("default".into(), bearer(), None, None, Some(vec![]), 600).await;
        assert!(matches!(empty, Err(EndpointError::InvalidField(_))), "{empty:?}");
        let long = reg.register_keyed("default".into(), bearer(), None, None, Some(vec![b'k'; 256]), 600).await;
        assert!(matches!(long, Err(EndpointError::InvalidField(_))), "{long:?}");
        reg.register("default".into(), bearer(), None, None, 600).await.unwrap();
        reg.register("default".into(), bearer(), None, None, 600).await.unwrap();
        assert_eq!(reg.list(601).len(), 3);
    }

    /// Calls racing with one key make one endpoint: every one is answered with it, and
    /// exactly one of them registered it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn racing_registrations_under_one_key_make_one_endpoint() {
        let state = Arc::new(StateDb::open_in_memory().unwrap());
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["default".into()], vec![]).unwrap());
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let reg = reg.clone();
                tokio::spawn(async move {
                    reg.register_keyed("default".into(), bearer(), None, None, Some(b"k".to_vec()), 1).await.unwrap()
                })
            })
            .collect();
        let mut answers = Vec::new();
        for c in calls {
            answers.push(c.await.unwrap());
        }
        assert_eq!(answers.iter().filter(|a| !a.replayed).count(), 1, "{answers:?}");
        assert!(answers.iter().all(|a| a.record == answers[0].record), "{answers:?}");
        assert_eq!(reg.list(2).len(), 1);
        assert_eq!(state.load_endpoints().unwrap().len(), 1);
    }

    /// A key whose endpoint's id a static endpoint took since registers anew; the
    /// removed record took its key with it.
    #[tokio::test]
    async fn a_key_whose_endpoint_a_static_one_replaced_registers_anew() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["default".into()], vec![]).unwrap());
        let first =
            reg.register_keyed("default".into(), bearer(), None, None, Some(b"k".to_vec()), 1).await.unwrap().record;
        drop(reg);
        let taken = Endpoint {
            id: first.id,
            source_key: "default".into(),
            auth: AuthScheme::None,
            handshake_param: None,
            expires_at_unix_ms: None,
            revoked_at_unix_ms: None,
            dynamic: false,
            record: None,
            unusable: None,
        };
        let reg = Arc::new(EndpointRegistry::load(state.clone(), vec!["default".into()], vec![taken]).unwrap());
        assert!(state.load_keyed_registrations().unwrap().is_empty(), "the removed record's key stayed");
        let again = reg.register_keyed("default".into(), bearer(), None, None, Some(b"k".to_vec()), 2).await.unwrap();
        assert!(!again.replayed);
        assert_ne!(again.record.id, first.id);
    }
}
