//! Request authentication schemes, checked over the raw body before anything is decoded.
//!
//! Invariants:
//! - Every secret comparison is constant-time (`Mac::verify_slice`, or `subtle` over
//!   SHA-256 digests for bearer tokens, so not even the length leaks).
//! - A failure carries a fixed reason for logs and metrics; the HTTP answer never
//!   says which check failed.
//! - Timestamped schemes (Standard Webhooks, Stripe) reject signatures outside their
//!   tolerance in either direction; `now` is a parameter so the checks are testable.
//! - Several signatures in one header (key rotation) pass if any one matches.
//! - A scheme whose signature covers a delivery id (Standard Webhooks) names it through
//!   [`AuthScheme::signed_delivery_id_header`], the same choice `verify` signs over, so
//!   the door keys idempotency by exactly the id that was authenticated.

use axum::http::HeaderMap;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

type HmacSha256 = Hmac<Sha256>;
type HmacSha1 = Hmac<sha1::Sha1>;

/// The digest an HMAC scheme uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HmacAlgorithm {
    Sha256,
    Sha1,
}

/// How the signature in the header is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignatureEncoding {
    Hex,
    Base64,
}

/// One endpoint's authentication.
#[derive(Clone)]
pub enum AuthScheme {
    None,
    /// `Authorization: Bearer <token>`, kept as the token's SHA-256 digest: a request's
    /// check hashes what it presents and compares two digests, so its time depends on
    /// nothing of the token's (not even its length).
    Bearer {
        token: TokenDigest,
    },
    /// HMAC over the raw body in `header`, after `prefix` (GitHub: `X-Hub-Signature-256`,
    /// `sha256=`).
    Hmac {
        algorithm: HmacAlgorithm,
        secret: Vec<u8>,
        header: String,
        prefix: String,
        encoding: SignatureEncoding,
    },
    /// Standard Webhooks / Svix: `webhook-id`, `webhook-timestamp`, `webhook-signature`
    /// (or the `svix-` names); base64 HMAC-SHA256 over `id.timestamp.body`.
    StandardWebhooks {
        keys: Vec<Vec<u8>>,
        tolerance_secs: u64,
    },
    /// Stripe: `Stripe-Signature: t=<ts>,v1=<hex>[,v1=...]`, HMAC-SHA256 over `t.body`.
    Stripe {
        secret: Vec<u8>,
        tolerance_secs: u64,
    },
}

impl std::fmt::Debug for AuthScheme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print secrets.
        f.write_str(self.name())
    }
}

/// Why a request failed authentication. Logged and counted, never sent to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthFailure {
    MissingHeader,
    Malformed,
    BadSignature,
    StaleTimestamp,
}

impl AuthFailure {
    pub fn reason(self) -> &'static str {
        match self {
            AuthFailure::MissingHeader => "auth_missing",
            AuthFailure::Malformed => "auth_malformed",
            AuthFailure::BadSignature => "auth_bad_signature",
            AuthFailure::StaleTimestamp => "auth_stale_timestamp",
        }
    }
}

/// The shortest Standard Webhooks key accepted, decoded: the specification's lower bound.
pub const STANDARD_WEBHOOKS_MIN_KEY_BYTES: usize = 24;

/// A configured signature header, lower-cased, refused unless it is a valid header name
/// (an invalid one would be looked up in vain and every request would get 401).
fn header_name(header: &str) -> Result<String, (&'static str, String)> {
    let header = header.to_ascii_lowercase();
    if axum::http::HeaderName::from_bytes(header.as_bytes()).is_err() {
        return Err(("header", format!("{header:?} is not a valid header name")));
    }
    // Headers the door itself reads for the request's framing and type: a signature
    // there is a mistake, and since a signature header is never kept with the event,
    // one named content-type would leave every event without its type (a JSON-only
    // source would answer 415 to every request).
    if matches!(header.as_str(), "content-type" | "content-length" | "transfer-encoding" | "host") {
        return Err(("header", format!("{header:?} carries the request's framing or type, not a signature")));
    }
    Ok(header)
}

/// Refuses an hmac `prefix` no signature header could start with: the header's value is
/// read as visible ASCII (and spaces) with the surrounding whitespace trimmed, so a
/// prefix with another character, or one that starts with a space, never matches and
/// every request would get 401.
fn signature_prefix(prefix: &str) -> Result<String, (&'static str, String)> {
    if !prefix.bytes().all(|b| (0x20..=0x7e).contains(&b)) || prefix.starts_with(' ') {
        return Err((
            "prefix",
            format!("{prefix:?} can never start a signature header (visible ASCII and spaces, not leading ones)"),
        ));
    }
    Ok(prefix.to_string())
}

/// The default tolerance of timestamped schemes (Standard Webhooks and Stripe both use
/// five minutes).
pub const DEFAULT_TOLERANCE_SECS: u64 = 300;

/// The longest tolerance a configuration or a registration may set: a day. Within it a
/// captured request passes again, so past a day the timestamp checks nothing a sender's
/// clock needs. (An endpoint stored with more before this bound still loads as it was.)
pub const TOLERANCE_SECS_MAX: u64 = 86_400;

/// Refuses a tolerance of 0 or over [`TOLERANCE_SECS_MAX`], for a new configuration or
/// registration (the error names the parameter, as [`AuthScheme::from_parts`]'s do).
/// A timestamp is sent in whole seconds and compared with a clock in milliseconds, so a
/// tolerance of 0 fails nearly every request; there is no way to turn the check off.
pub fn check_new_tolerance(tolerance_secs: Option<u64>) -> Result<(), (&'static str, String)> {
    match tolerance_secs {
        Some(0) => Err((
            "tolerance_secs",
            "must be at least 1: a timestamp in whole seconds would fail nearly every request (the check cannot be turned off)"
                .to_string(),
        )),
        Some(t) if t > TOLERANCE_SECS_MAX => Err((
            "tolerance_secs",
            format!("{t} is more than {TOLERANCE_SECS_MAX} (a day): a captured request would pass again for as long"),
        )),
        _ => Ok(()),
    }
}

/// Refuses a secret no request could present for the scheme, for a new configuration or
/// registration: a bearer token is visible ASCII without spaces (a request's
/// `Authorization` header is trimmed, and holds nothing else), so one outside that
/// (a value read from a file or the environment with its newline, say) could never match
/// and every request would get 401. Other schemes' secrets are keys, any text but a
/// control character (that newline again).
/// A secret longer than [`AUTH_SECRET_MAX_BYTES`] is refused too.
pub fn check_new_secret(scheme: &str, secret: Option<&str>) -> Result<(), (&'static str, String)> {
    match secret {
        Some(s) if s.len() > AUTH_SECRET_MAX_BYTES => {
            Err(("secret", format!("is {} bytes long; at most {AUTH_SECRET_MAX_BYTES} are accepted", s.len())))
        }
        Some(s) if scheme == "bearer" && !s.bytes().all(|b| b.is_ascii_graphic()) => Err((
            "secret",
            "a bearer token is visible ASCII without spaces; no request could present this one".to_string(),
        )),
        // A key holding a newline, a carriage return or a tab is a value read from a file
        // or the environment with its line end: the sender signs with the key without
        // it, so every request would fail its check.
        Some(s) if s.chars().any(char::is_control) => Err((
            "secret",
            "holds a control character (a newline read with it from a file or the environment?); no sender \
             signs with such a key"
                .to_string(),
        )),
        _ => Ok(()),
    }
}

/// The longest secret a new configuration, registration or rotation may set. Every
/// endpoint's secret is held in memory and read at each start, up to
/// `DYNAMIC_ENDPOINTS_MAX` of them; providers' secrets are tens of bytes (an HMAC key
/// longer than the hash's 64-byte block is hashed down to 32 bytes anyway).
pub const AUTH_SECRET_MAX_BYTES: usize = 1024;

/// The longest `auth_header` a new configuration or registration may name (signature
/// headers in use are under 40 bytes long).
pub const AUTH_HEADER_MAX_BYTES: usize = 128;

/// The longest `auth_prefix` a new configuration or registration may set (`sha256=`,
/// `v0=`: a few bytes).
pub const AUTH_PREFIX_MAX_BYTES: usize = 64;

/// Refuses an `auth_header` or `auth_prefix` longer than its bound
/// ([`AUTH_HEADER_MAX_BYTES`], [`AUTH_PREFIX_MAX_BYTES`]), for a new configuration or
/// registration: each problem, named by its setting. An endpoint stored with a longer
/// one by an earlier build still loads as it was.
pub fn check_new_lengths(header: Option<&str>, prefix: Option<&str>) -> Vec<(&'static str, String)> {
    let too_long = |field: &'static str, value: Option<&str>, max: usize| {
        value
            .filter(|v| v.len() > max)
            .map(|v| (field, format!("is {} bytes long; at most {max} are accepted", v.len())))
    };
    [too_long("header", header, AUTH_HEADER_MAX_BYTES), too_long("prefix", prefix, AUTH_PREFIX_MAX_BYTES)]
        .into_iter()
        .flatten()
        .collect()
}

impl AuthScheme {
    pub fn name(&self) -> &'static str {
        match self {
            AuthScheme::None => "none",
            AuthScheme::Bearer { .. } => "bearer",
            AuthScheme::Hmac { algorithm: HmacAlgorithm::Sha256, encoding: SignatureEncoding::Base64, .. } => {
                "hmac-sha256-base64"
            }
            AuthScheme::Hmac { algorithm: HmacAlgorithm::Sha256, .. } => "hmac-sha256",
            AuthScheme::Hmac { algorithm: HmacAlgorithm::Sha1, .. } => "hmac-sha1",
            AuthScheme::StandardWebhooks { .. } => "standard-webhooks",
            AuthScheme::Stripe { .. } => "stripe",
        }
    }

    /// The scheme a 401's `WWW-Authenticate` challenge names under this one (RFC 9110
    /// requires a challenge): what a sender must use, never why its request failed.
    /// `Bearer` is HTTP's own scheme; the signature schemes have none, so each is named
    /// by its configuration name (`hmac-sha256`, `standard-webhooks`, `stripe`, ...).
    pub fn challenge(&self) -> &'static str {
        match self {
            AuthScheme::Bearer { .. } => "Bearer",
            other => other.name(),
        }
    }

    /// The settings given that the scheme does not read, each with why, in the order
    /// `header`, `prefix`, `tolerance_secs`, `secret`: such a setting would be silently
    /// ignored (an auth_header on a bearer source still reads Authorization, and every
    /// request would get 401). None for a scheme this build does not know
    /// ([`AuthScheme::from_parts`] refuses that).
    pub fn unused_settings(
        scheme: &str,
        secret: Option<&str>,
        header: Option<&str>,
        prefix: Option<&str>,
        tolerance_secs: Option<u64>,
    ) -> Vec<(&'static str, String)> {
        let hmac = matches!(scheme, "hmac-sha256" | "hmac-sha1" | "hmac-sha256-base64");
        let timestamped = matches!(scheme, "standard-webhooks" | "stripe");
        let known = hmac || timestamped || matches!(scheme, "none" | "bearer");
        let mut unused = Vec::new();
        if !known {
            return unused;
        }
        let only = |what: &str| format!("is not used by auth_type = \"{scheme}\" (only by {what})");
        if header.is_some() && !hmac {
            unused.push(("header", only("the hmac schemes")));
        }
        if prefix.is_some() && !hmac {
            unused.push(("prefix", only("the hmac schemes")));
        }
        if tolerance_secs.is_some() && !timestamped {
            unused.push(("tolerance_secs", only("standard-webhooks and stripe")));
        }
        // A secret nothing checks would let an operator believe the endpoint is guarded
        // when anyone with its URL can post.
        if scheme == "none" && secret.is_some_and(|s| !s.is_empty()) {
            unused.push(("secret", "is not used by auth_type = \"none\" (nothing is checked)".to_string()));
        }
        unused
    }

    /// Builds a scheme from its configured name and parameters. The error says what is
    /// wrong with which parameter (`secret`, `header`, ...), for the config error path.
    pub fn from_parts(
        scheme: &str,
        secret: Option<&str>,
        header: Option<&str>,
        prefix: Option<&str>,
        tolerance_secs: Option<u64>,
    ) -> Result<AuthScheme, (&'static str, String)> {
        let need_secret = || -> Result<&str, (&'static str, String)> {
            match secret {
                Some(s) if !s.is_empty() => Ok(s),
                _ => Err(("secret", format!("required when auth_type = \"{scheme}\""))),
            }
        };
        if let Some(first) =
            AuthScheme::unused_settings(scheme, secret, header, prefix, tolerance_secs).into_iter().next()
        {
            return Err(first);
        }
        let tolerance_secs = tolerance_secs.unwrap_or(DEFAULT_TOLERANCE_SECS);
        Ok(match scheme {
            "none" => AuthScheme::None,
            "bearer" => AuthScheme::Bearer { token: TokenDigest::of(need_secret()?) },
            "hmac-sha256" | "hmac-sha1" => {
                let algorithm = if scheme == "hmac-sha256" { HmacAlgorithm::Sha256 } else { HmacAlgorithm::Sha1 };
                let (default_header, default_prefix) = match algorithm {
                    HmacAlgorithm::Sha256 => ("x-hub-signature-256", "sha256="),
                    HmacAlgorithm::Sha1 => ("x-hub-signature", "sha1="),
                };
                let header = header_name(header.unwrap_or(default_header))?;
                AuthScheme::Hmac {
                    algorithm,
                    secret: need_secret()?.as_bytes().to_vec(),
                    header,
                    prefix: signature_prefix(prefix.unwrap_or(default_prefix))?,
                    encoding: SignatureEncoding::Hex,
                }
            }
            "hmac-sha256-base64" => {
                let header = match header {
                    Some(h) => header_name(h)?,
                    None => return Err(("header", format!("required when auth_type = \"{scheme}\""))),
                };
                AuthScheme::Hmac {
                    algorithm: HmacAlgorithm::Sha256,
                    secret: need_secret()?.as_bytes().to_vec(),
                    header,
                    prefix: signature_prefix(prefix.unwrap_or(""))?,
                    encoding: SignatureEncoding::Base64,
                }
            }
            "standard-webhooks" => {
                let s = need_secret()?;
                let b64 = s.strip_prefix("whsec_").unwrap_or(s);
                let key = BASE64
                    .decode(b64)
                    .map_err(|_| ("secret", "must be base64 (optionally prefixed whsec_)".to_string()))?;
                // An empty key ("whsec_") would let anyone sign; the specification asks
                // for 24 to 64 bytes.
                if key.len() < STANDARD_WEBHOOKS_MIN_KEY_BYTES {
                    return Err((
                        "secret",
                        format!(
                            "decodes to a {}-byte key; Standard Webhooks keys are at least {STANDARD_WEBHOOKS_MIN_KEY_BYTES} bytes",
                            key.len()
                        ),
                    ));
                }
                AuthScheme::StandardWebhooks { keys: vec![key], tolerance_secs }
            }
            "stripe" => AuthScheme::Stripe { secret: need_secret()?.as_bytes().to_vec(), tolerance_secs },
            other => {
                return Err((
                    "type",
                    format!(
                        "unknown auth type {other:?}; expected one of none, bearer, hmac-sha256, hmac-sha1, hmac-sha256-base64, standard-webhooks, stripe"
                    ),
                ));
            }
        })
    }

    /// The header holding the delivery id this scheme's signature covers, if it covers
    /// one: for Standard Webhooks the message id (`webhook-id`, or `svix-id` when there is
    /// no `webhook-id`), exactly the header [`AuthScheme::verify`] signs over;
    /// `None` for every other scheme.
    pub fn signed_delivery_id_header(&self, headers: &HeaderMap) -> Option<&'static str> {
        match self {
            AuthScheme::StandardWebhooks { .. } => standard_webhooks_id(headers).ok().map(|(name, _)| name),
            _ => None,
        }
    }

    /// The header a configured name chose to carry this scheme's signature (the hmac
    /// schemes' `auth_header`), which the name-based credential check
    /// ([`is_credential_header`](crate::source::is_credential_header)) cannot know: such
    /// a signature carries no timestamp, and forwarded into the log it would let any
    /// consumer post the stored event again. The other schemes' headers are credential
    /// headers by name.
    pub fn configured_signature_header(&self) -> Option<&str> {
        match self {
            AuthScheme::Hmac { header, .. } => Some(header),
            _ => None,
        }
    }

    /// How far from now a signed timestamp may be, either way, for the schemes that sign
    /// one (Standard Webhooks, Stripe). A captured request can be sent again for twice
    /// this long; the delivery ids must be kept at least that long to answer it as the
    /// replay it is.
    pub fn tolerance_secs(&self) -> Option<u64> {
        match self {
            AuthScheme::StandardWebhooks { tolerance_secs, .. } | AuthScheme::Stripe { tolerance_secs, .. } => {
                Some(*tolerance_secs)
            }
            _ => None,
        }
    }

    /// What the request's head alone decides, before its body is read: a bearer
    /// token in full; for the signature schemes, that every header they read is there,
    /// once, and of the scheme's form (the failures [`AuthScheme::verify`] gives before
    /// it computes a MAC, the same reasons). A request that passes may still fail
    /// `verify` on its body; one that fails here fails `verify` with the same reason,
    /// whatever its body.
    pub fn verify_head(&self, headers: &HeaderMap) -> Result<(), AuthFailure> {
        match self {
            AuthScheme::None => Ok(()),
            AuthScheme::Bearer { .. } => self.verify(headers, &[], 0),
            AuthScheme::Hmac { header, prefix, encoding, .. } => {
                hmac_signature(headers, header, prefix, *encoding).map(drop)
            }
            AuthScheme::StandardWebhooks { .. } => standard_webhooks_head(headers).map(drop),
            AuthScheme::Stripe { .. } => stripe_head(headers).map(drop),
        }
    }

    /// Checks a request. `now_unix_ms` is the receive time, in milliseconds: a
    /// timestamp's tolerance is measured to the millisecond, so that a request and its
    /// replay, each within the tolerance, are at most twice the tolerance apart, which
    /// the delivery ids' retention covers (rounded to seconds, a replay up to 999 ms
    /// later would pass, and find the id expired).
    pub fn verify(&self, headers: &HeaderMap, body: &[u8], now_unix_ms: u64) -> Result<(), AuthFailure> {
        match self {
            AuthScheme::None => Ok(()),
            AuthScheme::Bearer { token } => {
                if token.matches(bearer_token(headers)?) {
                    Ok(())
                } else {
                    Err(AuthFailure::BadSignature)
                }
            }
            AuthScheme::Hmac { algorithm, secret, header, prefix, encoding } => {
                let sig = hmac_signature(headers, header, prefix, *encoding)?;
                let ok = match algorithm {
                    HmacAlgorithm::Sha256 => mac256(secret, &[body]).verify_slice(&sig).is_ok(),
                    HmacAlgorithm::Sha1 => {
                        let mut m = HmacSha1::new_from_slice(secret).map_err(|_| AuthFailure::BadSignature)?;
                        m.update(body);
                        m.verify_slice(&sig).is_ok()
                    }
                };
                if ok { Ok(()) } else { Err(AuthFailure::BadSignature) }
            }
            AuthScheme::StandardWebhooks { keys, tolerance_secs } => {
                let head = standard_webhooks_head(headers)?;
                // The signature is checked before the timestamp's tolerance, so that
                // `auth_stale_timestamp` counts signed requests only (a sender's clock,
                // or a replay of a real delivery), never junk with an old timestamp.
                // One tag per key, computed once: the header may list any number of
                // signatures (hyper admits a head of some 400 KB), and a MAC over the
                // body per listed signature would let one unsigned request hold the
                // worker for minutes.
                let tags: Vec<[u8; 32]> = keys
                    .iter()
                    .map(|key| {
                        mac256(key, &[head.id.as_bytes(), b".", head.timestamp.as_bytes(), b".", body])
                            .finalize()
                            .into_bytes()
                            .into()
                    })
                    .collect();
                // The length is not secret; the bytes are compared in constant time.
                let signed = head
                    .signatures
                    .iter()
                    .any(|sig| tags.iter().any(|tag| sig.len() == tag.len() && bool::from(tag.ct_eq(sig.as_slice()))));
                if signed {
                    check_tolerance(head.timestamp_secs, now_unix_ms, *tolerance_secs)
                } else {
                    Err(AuthFailure::BadSignature)
                }
            }
            AuthScheme::Stripe { secret, tolerance_secs } => {
                let head = stripe_head(headers)?;
                // Signature first, then tolerance, as for Standard Webhooks; the tag
                // computed once, however many `v1` entries the header lists.
                let tag: [u8; 32] =
                    mac256(secret, &[head.timestamp.as_bytes(), b".", body]).finalize().into_bytes().into();
                // The length is not secret; the bytes are compared in constant time.
                if head.signatures.iter().any(|sig| sig.len() == tag.len() && bool::from(tag.ct_eq(sig.as_slice()))) {
                    check_tolerance(head.timestamp_secs, now_unix_ms, *tolerance_secs)
                } else {
                    Err(AuthFailure::BadSignature)
                }
            }
        }
    }
}

/// The signature an HMAC scheme's `header` holds after `prefix`, decoded.
fn hmac_signature(
    headers: &HeaderMap,
    header: &str,
    prefix: &str,
    encoding: SignatureEncoding,
) -> Result<Vec<u8>, AuthFailure> {
    let value = header_str(headers, header)?;
    let sig = value.trim().strip_prefix(prefix).ok_or(AuthFailure::Malformed)?;
    match encoding {
        SignatureEncoding::Hex => hex::decode(sig).map_err(|_| AuthFailure::Malformed),
        SignatureEncoding::Base64 => BASE64.decode(sig).map_err(|_| AuthFailure::Malformed),
    }
}

/// What a signed timestamp scheme's headers say: the signed timestamp as sent (the
/// text the MAC covers) and as seconds, and every signature of the scheme's form,
/// decoded (at least one).
struct SignedHead<'h> {
    /// Standard Webhooks' message id; empty for Stripe, which signs none.
    id: &'h str,
    timestamp: &'h str,
    timestamp_secs: u64,
    signatures: Vec<Vec<u8>>,
}

/// A Standard Webhooks head: `webhook-id`, `webhook-timestamp` and `webhook-signature`
/// (each or its `svix-` twin), the signatures the space-separated `v1,<base64>` entries;
/// entries of other versions, or not base64, are passed over, and a header with none
/// left is malformed.
fn standard_webhooks_head(headers: &HeaderMap) -> Result<SignedHead<'_>, AuthFailure> {
    let (_, id) = standard_webhooks_id(headers)?;
    let timestamp = header_str_or(headers, "webhook-timestamp", "svix-timestamp")?.trim();
    let listed = header_str_or(headers, "webhook-signature", "svix-signature")?;
    let timestamp_secs: u64 = timestamp.parse().map_err(|_| AuthFailure::Malformed)?;
    let signatures: Vec<Vec<u8>> = listed
        .split(' ')
        .filter_map(|entry| entry.strip_prefix("v1,"))
        .filter_map(|b64| BASE64.decode(b64).ok())
        .collect();
    if signatures.is_empty() {
        return Err(AuthFailure::Malformed);
    }
    Ok(SignedHead { id, timestamp, timestamp_secs, signatures })
}

/// A Stripe head: `Stripe-Signature: t=<ts>,v1=<hex>[,v1=...]`; `v1` entries that are
/// not hex and other keys are passed over, and a header without `t` or any `v1` left is
/// malformed.
fn stripe_head(headers: &HeaderMap) -> Result<SignedHead<'_>, AuthFailure> {
    let value = header_str(headers, "stripe-signature")?;
    let mut timestamp: Option<&str> = None;
    let mut signatures: Vec<Vec<u8>> = Vec::new();
    for part in value.split(',') {
        let Some((k, v)) = part.trim().split_once('=') else { continue };
        match k {
            "t" => timestamp = Some(v),
            "v1" => {
                if let Ok(sig) = hex::decode(v) {
                    signatures.push(sig);
                }
            }
            _ => {}
        }
    }
    let timestamp = timestamp.ok_or(AuthFailure::Malformed)?;
    if signatures.is_empty() {
        return Err(AuthFailure::Malformed);
    }
    let timestamp_secs: u64 = timestamp.parse().map_err(|_| AuthFailure::Malformed)?;
    Ok(SignedHead { id: "", timestamp, timestamp_secs, signatures })
}

fn mac256(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    #[cfg(test)]
    tests::MACS_COMPUTED.with(|n| n.set(n.get() + 1));
    // HMAC takes keys of any length; `new_from_slice` cannot fail for it.
    let mut m = match HmacSha256::new_from_slice(key) {
        Ok(m) => m,
        Err(e) => unreachable!("HMAC accepts any key length: {e}"),
    };
    for p in parts {
        m.update(p);
    }
    m
}

/// A Standard Webhooks message id and the header it is in: `webhook-id`, or `svix-id`
/// when there is no `webhook-id`. A `webhook-id` that is not text is malformed, as
/// [`header_str_or`] has it.
fn standard_webhooks_id(headers: &HeaderMap) -> Result<(&'static str, &str), AuthFailure> {
    match header_str(headers, "webhook-id") {
        Err(AuthFailure::MissingHeader) => header_str(headers, "svix-id").map(|id| ("svix-id", id)),
        found => found.map(|id| ("webhook-id", id)),
    }
}

/// The text of header `name`, or of `fallback` when there is no `name` at all: a `name`
/// that is there but not text is `Malformed` (counted as `auth_malformed`), not taken
/// for missing.
fn header_str_or<'a>(headers: &'a HeaderMap, name: &str, fallback: &str) -> Result<&'a str, AuthFailure> {
    match header_str(headers, name) {
        Err(AuthFailure::MissingHeader) => header_str(headers, fallback),
        found => found,
    }
}

/// A bearer token, kept as its SHA-256 digest: [`TokenDigest::matches`] hashes what a
/// request presents and compares two digests in constant time, so the time a check takes
/// depends on nothing of the token's, not even its length. The webhook door's bearer
/// scheme and the admin API's tokens.
#[derive(Clone)]
pub struct TokenDigest([u8; 32]);

impl TokenDigest {
    pub fn of(token: &str) -> TokenDigest {
        TokenDigest(Sha256::digest(token.as_bytes()).into())
    }

    pub fn matches(&self, presented: &str) -> bool {
        let presented: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        bool::from(presented.ct_eq(&self.0))
    }
}

impl std::fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenDigest(..)")
    }
}

/// The token of an `Authorization: Bearer <token>` header, without surrounding blanks.
/// The scheme name is case-insensitive (RFC 9110, section 11.1). One parser for the
/// webhook door's bearer scheme and the admin API's tokens, so a header one accepts the
/// other does too.
pub fn bearer_token(headers: &HeaderMap) -> Result<&str, AuthFailure> {
    let value = header_str(headers, "authorization")?;
    value
        .get(..7)
        .filter(|scheme| scheme.eq_ignore_ascii_case("bearer "))
        .map(|_| value[7..].trim())
        .ok_or(AuthFailure::Malformed)
}

/// The text of header `name`. Given more than once, it is `Malformed`: every header a
/// scheme reads is a single value, and where the check read one value and the door
/// another (a forwarded `webhook-id`, a partition key from a header), a captured
/// request resent with a second value after the signed one would pass its check and
/// store the unsigned one.
fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Result<&'a str, AuthFailure> {
    let mut values = headers.get_all(name).iter();
    let v = values.next().ok_or(AuthFailure::MissingHeader)?;
    if values.next().is_some() {
        return Err(AuthFailure::Malformed);
    }
    v.to_str().map_err(|_| AuthFailure::Malformed)
}

fn check_tolerance(ts_secs: u64, now_ms: u64, tolerance_secs: u64) -> Result<(), AuthFailure> {
    let off_ms = ts_secs.saturating_mul(1000).abs_diff(now_ms);
    if off_ms > tolerance_secs.saturating_mul(1000) { Err(AuthFailure::StaleTimestamp) } else { Ok(()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A receive time of `secs` seconds, in the milliseconds `verify` takes.
    fn ms(secs: u64) -> u64 {
        secs * 1000
    }

    /// The tolerance is measured to the millisecond: 300 s after the timestamp passes,
    /// 1 ms more does not (rounded down to seconds, 999 ms more would have).
    #[test]
    fn the_tolerance_is_measured_to_the_millisecond() {
        let s = AuthScheme::from_parts("stripe", Some("whsec_test"), None, None, Some(300)).unwrap();
        let t = 1_700_000_000u64;
        let mac = mac256(b"whsec_test", &[t.to_string().as_bytes(), b".", b"{}"]);
        let sig = hex::encode(mac.finalize().into_bytes());
        let h = headers(&[("stripe-signature", &format!("t={t},v1={sig}"))]);
        for (now_ms, ok) in [
            (ms(t + 300), true),
            (ms(t + 300) + 1, false),
            (ms(t + 300) + 999, false),
            (ms(t - 300), true),
            (ms(t - 300) - 1, false),
        ] {
            let want = if ok { Ok(()) } else { Err(AuthFailure::StaleTimestamp) };
            assert_eq!(s.verify(&h, b"{}", now_ms), want, "{now_ms}");
        }
    }
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    // GitHub's documented example: secret "It's a Secret to Everybody", payload
    // "Hello, World!" (docs: "Validating webhook deliveries").
    const GITHUB_SIG: &str = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";

    #[test]
    fn github_documented_vector_passes_and_tampering_fails() {
        let s = AuthScheme::from_parts("hmac-sha256", Some("It's a Secret to Everybody"), None, None, None).unwrap();
        assert_eq!(s.verify(&headers(&[("x-hub-signature-256", GITHUB_SIG)]), b"Hello, World!", ms(0)), Ok(()));
        assert_eq!(
            s.verify(&headers(&[("x-hub-signature-256", GITHUB_SIG)]), b"Hello, World?", ms(0)),
            Err(AuthFailure::BadSignature)
        );
        assert_eq!(s.verify(&headers(&[]), b"Hello, World!", ms(0)), Err(AuthFailure::MissingHeader));
        let no_prefix = GITHUB_SIG.trim_start_matches("sha256=");
        assert_eq!(
            s.verify(&headers(&[("x-hub-signature-256", no_prefix)]), b"Hello, World!", ms(0)),
            Err(AuthFailure::Malformed)
        );
    }

    #[test]
    fn hmac_sha1_vector_computed_independently() {
        // Computed with Python's hmac module: hmac.new(secret, body, hashlib.sha1).hexdigest()
        let s = AuthScheme::from_parts("hmac-sha1", Some("It's a Secret to Everybody"), None, None, None).unwrap();
        let h = headers(&[("x-hub-signature", "sha1=01dc10d0c83e72ed246219cdd91669667fe2ca59")]);
        assert_eq!(s.verify(&h, b"Hello, World!", ms(0)), Ok(()));
        assert_eq!(s.verify(&h, b"Hello, World", ms(0)), Err(AuthFailure::BadSignature));
    }

    // The Standard Webhooks specification's published example.
    const SW_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const SW_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
    const SW_TS: &str = "1614265330";
    const SW_BODY: &[u8] = br#"{"test": 2432232314}"#;
    const SW_SIG: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

    #[test]
    fn standard_webhooks_published_vector_passes_under_both_header_families() {
        let s = AuthScheme::from_parts("standard-webhooks", Some(SW_SECRET), None, None, None).unwrap();
        let now = 1_614_265_330;
        let h = headers(&[("webhook-id", SW_ID), ("webhook-timestamp", SW_TS), ("webhook-signature", SW_SIG)]);
        assert_eq!(s.verify(&h, SW_BODY, ms(now)), Ok(()));
        let svix = headers(&[("svix-id", SW_ID), ("svix-timestamp", SW_TS), ("svix-signature", SW_SIG)]);
        assert_eq!(s.verify(&svix, SW_BODY, ms(now + 299)), Ok(()));
        // Rotation: several signatures, the valid one last.
        let rotated = format!("v1,AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA= {SW_SIG}");
        let h = headers(&[("webhook-id", SW_ID), ("webhook-timestamp", SW_TS), ("webhook-signature", &rotated)]);
        assert_eq!(s.verify(&h, SW_BODY, ms(now)), Ok(()));
    }

    #[test]
    fn the_signed_delivery_id_is_the_id_standard_webhooks_verify_signs_over_and_none_elsewhere() {
        let s = AuthScheme::from_parts("standard-webhooks", Some(SW_SECRET), None, None, None).unwrap();
        let now = 1_614_265_330;
        let both = headers(&[
            ("svix-id", "msg_other"),
            ("webhook-id", SW_ID),
            ("webhook-timestamp", SW_TS),
            ("webhook-signature", SW_SIG),
            ("idempotency-key", "unsigned"),
        ]);
        assert_eq!(s.verify(&both, SW_BODY, ms(now)), Ok(()));
        assert_eq!(s.signed_delivery_id_header(&both), Some("webhook-id"));
        let svix = headers(&[("svix-id", SW_ID), ("svix-timestamp", SW_TS), ("svix-signature", SW_SIG)]);
        assert_eq!(s.verify(&svix, SW_BODY, ms(now)), Ok(()));
        assert_eq!(s.signed_delivery_id_header(&svix), Some("svix-id"));
        let hmac = AuthScheme::from_parts("hmac-sha256", Some("secret"), None, None, None).unwrap();
        assert_eq!(hmac.signed_delivery_id_header(&both), None);
        assert_eq!(AuthScheme::None.signed_delivery_id_header(&both), None);
    }

    thread_local! {
        /// How many HMACs this thread computed (counted by `mac256`).
        pub(super) static MACS_COMPUTED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    /// A header listing many signatures costs one MAC over the body per key, not one per
    /// listed signature: before, 10,000 empty `v1,` entries (about 40 KB of header, no
    /// secret needed) cost 10,000 MACs over a body of up to `max_body_bytes`.
    #[test]
    fn standard_webhooks_computes_one_mac_per_key_however_many_signatures_are_listed() {
        let s = AuthScheme::from_parts("standard-webhooks", Some(SW_SECRET), None, None, None).unwrap();
        let now = 1_614_265_330;
        let many = format!("{}{SW_SIG}", "v1, ".repeat(10_000));
        let h = headers(&[("webhook-id", SW_ID), ("webhook-timestamp", SW_TS), ("webhook-signature", &many)]);
        let before = MACS_COMPUTED.with(|n| n.get());
        assert_eq!(s.verify(&h, SW_BODY, ms(now)), Ok(()), "the valid signature listed last");
        assert_eq!(MACS_COMPUTED.with(|n| n.get()) - before, 1);
        let bogus = "v1, ".repeat(10_000);
        let h = headers(&[("webhook-id", SW_ID), ("webhook-timestamp", SW_TS), ("webhook-signature", &bogus)]);
        let before = MACS_COMPUTED.with(|n| n.get());
        assert_eq!(s.verify(&h, SW_BODY, ms(now)), Err(AuthFailure::BadSignature));
        assert_eq!(MACS_COMPUTED.with(|n| n.get()) - before, 1);
    }

    #[test]
    fn standard_webhooks_rejects_stale_wrong_and_tampered() {
        let s = AuthScheme::from_parts("standard-webhooks", Some(SW_SECRET), None, None, None).unwrap();
        let now = 1_614_265_330;
        let h = headers(&[("webhook-id", SW_ID), ("webhook-timestamp", SW_TS), ("webhook-signature", SW_SIG)]);
        assert_eq!(s.verify(&h, SW_BODY, ms(now + 301)), Err(AuthFailure::StaleTimestamp));
        assert_eq!(s.verify(&h, SW_BODY, ms(now - 301)), Err(AuthFailure::StaleTimestamp));
        assert_eq!(s.verify(&h, br#"{"test": 2432232315}"#, ms(now)), Err(AuthFailure::BadSignature));
        let other_id = headers(&[("webhook-id", "msg_x"), ("webhook-timestamp", SW_TS), ("webhook-signature", SW_SIG)]);
        assert_eq!(s.verify(&other_id, SW_BODY, ms(now)), Err(AuthFailure::BadSignature));
        let v2 = headers(&[("webhook-id", SW_ID), ("webhook-timestamp", SW_TS), ("webhook-signature", "v2,abc")]);
        assert_eq!(s.verify(&v2, SW_BODY, ms(now)), Err(AuthFailure::Malformed));
    }

    /// What senders put beside a good signature is passed over, not failed: another
    /// version's entry (`v1a,` asymmetric signatures) before the `v1,` one, a Stripe
    /// signature in upper-case hex, and an empty body signed as such.
    #[test]
    fn other_versions_upper_case_hex_and_an_empty_body_pass_with_a_good_signature() {
        let s = AuthScheme::from_parts("standard-webhooks", Some(SW_SECRET), None, None, None).unwrap();
        let now = 1_614_265_330;
        let mixed = format!("v1a,c2lnbmF0dXJl {SW_SIG}");
        let h = headers(&[("webhook-id", SW_ID), ("webhook-timestamp", SW_TS), ("webhook-signature", &mixed)]);
        assert_eq!(s.verify(&h, SW_BODY, ms(now)), Ok(()));
        let stripe = AuthScheme::from_parts("stripe", Some("whsec_test_secret"), None, None, None).unwrap();
        let sig = "248a374f50f943a28b0f6ab50faf9a7e7e29b710fa26df9fb1618b9bf8ea9c9a".to_ascii_uppercase();
        let upper = format!("t=1700000000,v1={sig}");
        assert_eq!(
            stripe.verify(&headers(&[("stripe-signature", &upper)]), br#"{"id":"evt_1"}"#, ms(1_700_000_000)),
            Ok(())
        );
        // hmac.new(b"whsec_test_secret", b"1700000000.", hashlib.sha256).hexdigest()
        let empty = "t=1700000000,v1=316b9ab98c15bfa039d243f3196acee619cf29749a91a634e6a8154e2f7b6727";
        assert_eq!(stripe.verify(&headers(&[("stripe-signature", empty)]), b"", ms(1_700_000_000)), Ok(()));
        assert_eq!(
            stripe.verify(&headers(&[("stripe-signature", empty)]), b" ", ms(1_700_000_000)),
            Err(AuthFailure::BadSignature)
        );
    }

    /// A timestamp out of tolerance is told only of a request whose signature holds:
    /// junk with an old timestamp is a bad signature, so `auth_stale_timestamp` stays a
    /// sign of a sender's clock or a replay.
    #[test]
    fn a_stale_timestamp_is_told_only_of_a_signed_request() {
        let s = AuthScheme::from_parts("standard-webhooks", Some(SW_SECRET), None, None, None).unwrap();
        let now = 1_614_265_330;
        let junk = headers(&[("webhook-id", SW_ID), ("webhook-timestamp", SW_TS), ("webhook-signature", "v1,AAAA")]);
        assert_eq!(s.verify(&junk, SW_BODY, ms(now + 301)), Err(AuthFailure::BadSignature));
        let stripe = AuthScheme::from_parts("stripe", Some("whsec_test_secret"), None, None, None).unwrap();
        let junk = format!("t=1700000000,v1={}", "00".repeat(32));
        assert_eq!(
            stripe.verify(&headers(&[("stripe-signature", &junk)]), br#"{"id":"evt_1"}"#, ms(1_700_000_301)),
            Err(AuthFailure::BadSignature)
        );
    }

    /// A Standard Webhooks header that is there but not text is malformed, not missing,
    /// even where the `svix-` header of the same name is absent.
    #[test]
    fn a_standard_webhooks_header_that_is_not_text_is_malformed_not_missing() {
        let s = AuthScheme::from_parts("standard-webhooks", Some(SW_SECRET), None, None, None).unwrap();
        let now = 1_614_265_330;
        for name in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
            let mut h = headers(&[("webhook-id", SW_ID), ("webhook-timestamp", SW_TS), ("webhook-signature", SW_SIG)]);
            h.insert(name, HeaderValue::from_bytes(b"16142653\xff30").unwrap());
            assert_eq!(s.verify(&h, SW_BODY, ms(now)), Err(AuthFailure::Malformed), "{name}");
        }
    }

    #[test]
    fn stripe_vector_computed_independently() {
        // Computed with Python's hmac module:
        // hmac.new(b"whsec_test_secret", b'1700000000.{"id":"evt_1"}', hashlib.sha256).hexdigest()
        let sig = "248a374f50f943a28b0f6ab50faf9a7e7e29b710fa26df9fb1618b9bf8ea9c9a";
        let s = AuthScheme::from_parts("stripe", Some("whsec_test_secret"), None, None, None).unwrap();
        let body = br#"{"id":"evt_1"}"#;
        let good = format!("t=1700000000,v1={sig},v0=ignored");
        assert_eq!(s.verify(&headers(&[("stripe-signature", &good)]), body, ms(1_700_000_100)), Ok(()));
        assert_eq!(
            s.verify(&headers(&[("stripe-signature", &good)]), body, ms(1_700_000_301)),
            Err(AuthFailure::StaleTimestamp)
        );
        let wrong_t = format!("t=1700000001,v1={sig}");
        assert_eq!(
            s.verify(&headers(&[("stripe-signature", &wrong_t)]), body, ms(1_700_000_000)),
            Err(AuthFailure::BadSignature)
        );
        assert_eq!(
            s.verify(&headers(&[("stripe-signature", "t=1700000000")]), body, ms(1_700_000_000)),
            Err(AuthFailure::Malformed)
        );
    }

    /// Stripe's header may list several `v1` signatures: one tag is computed, not one per
    /// entry (a head of some 400 KB holds thousands, no secret needed).
    #[test]
    fn stripe_computes_one_mac_however_many_signatures_are_listed() {
        let s = AuthScheme::from_parts("stripe", Some("whsec_test_secret"), None, None, None).unwrap();
        let body = br#"{"id":"evt_1"}"#;
        let good = "248a374f50f943a28b0f6ab50faf9a7e7e29b710fa26df9fb1618b9bf8ea9c9a";
        let bogus = format!("v1={},", "00".repeat(32)).repeat(1_000);
        for (value, want) in [
            (format!("t=1700000000,{bogus}v1={good}"), Ok(())),
            (format!("t=1700000000,{bogus}"), Err(AuthFailure::BadSignature)),
        ] {
            let before = MACS_COMPUTED.with(|n| n.get());
            assert_eq!(s.verify(&headers(&[("stripe-signature", &value)]), body, ms(1_700_000_000)), want);
            assert_eq!(MACS_COMPUTED.with(|n| n.get()) - before, 1);
        }
    }

    /// Every header a scheme reads, given twice, is malformed: a check that read the
    /// first value while the door forwards or keys on the last would let a captured
    /// request store an unsigned id. Here the signed value comes first, and passes alone.
    #[test]
    fn a_header_a_scheme_reads_given_twice_is_malformed() {
        let sw = AuthScheme::from_parts("standard-webhooks", Some(SW_SECRET), None, None, None).unwrap();
        let signed = [("webhook-id", SW_ID), ("webhook-timestamp", SW_TS), ("webhook-signature", SW_SIG)];
        let now = ms(1_614_265_330);
        assert_eq!(sw.verify(&headers(&signed), SW_BODY, now), Ok(()));
        for (name, second) in
            [("webhook-id", "msg_unsigned"), ("webhook-timestamp", "1614265331"), ("webhook-signature", SW_SIG)]
        {
            let mut h = headers(&signed);
            h.append(name, HeaderValue::from_static(second));
            assert_eq!(sw.verify(&h, SW_BODY, now), Err(AuthFailure::Malformed), "{name}");
        }
        let github =
            AuthScheme::from_parts("hmac-sha256", Some("It's a Secret to Everybody"), None, None, None).unwrap();
        let twice = headers(&[("x-hub-signature-256", GITHUB_SIG), ("x-hub-signature-256", GITHUB_SIG)]);
        assert_eq!(github.verify(&twice, b"Hello, World!", ms(0)), Err(AuthFailure::Malformed));
        let stripe = AuthScheme::from_parts("stripe", Some("whsec_test_secret"), None, None, None).unwrap();
        let good = "t=1700000000,v1=248a374f50f943a28b0f6ab50faf9a7e7e29b710fa26df9fb1618b9bf8ea9c9a";
        let twice = headers(&[("stripe-signature", good), ("stripe-signature", "t=1700000001")]);
        assert_eq!(stripe.verify(&twice, br#"{"id":"evt_1"}"#, ms(1_700_000_000)), Err(AuthFailure::Malformed));
        let bearer = AuthScheme::from_parts("bearer", Some("token-0123456789"), None, None, None).unwrap();
        let twice = headers(&[("authorization", "Bearer token-0123456789"), ("authorization", "Bearer other")]);
        assert_eq!(bearer.verify(&twice, b"", ms(0)), Err(AuthFailure::Malformed));
    }

    /// GitHub sends lower-case hex; a signature in upper case is the same bytes and
    /// passes (the prefix, though, is matched as configured).
    #[test]
    fn an_hmac_signature_in_upper_case_hex_passes() {
        let s = AuthScheme::from_parts("hmac-sha256", Some("It's a Secret to Everybody"), None, None, None).unwrap();
        let upper = format!("sha256={}", GITHUB_SIG.trim_start_matches("sha256=").to_ascii_uppercase());
        assert_eq!(s.verify(&headers(&[("x-hub-signature-256", &upper)]), b"Hello, World!", ms(0)), Ok(()));
        let upper_prefix = GITHUB_SIG.replace("sha256=", "SHA256=");
        assert_eq!(
            s.verify(&headers(&[("x-hub-signature-256", &upper_prefix)]), b"Hello, World!", ms(0)),
            Err(AuthFailure::Malformed)
        );
    }

    #[test]
    fn bearer_compares_whole_tokens() {
        let s = AuthScheme::from_parts("bearer", Some("s3cret"), None, None, None).unwrap();
        assert_eq!(s.verify(&headers(&[("authorization", "Bearer s3cret")]), b"", ms(0)), Ok(()));
        assert_eq!(
            s.verify(&headers(&[("authorization", "Bearer s3cre")]), b"", ms(0)),
            Err(AuthFailure::BadSignature)
        );
        assert_eq!(
            s.verify(&headers(&[("authorization", "Bearer s3cretX")]), b"", ms(0)),
            Err(AuthFailure::BadSignature)
        );
        assert_eq!(s.verify(&headers(&[("authorization", "Basic s3cret")]), b"", ms(0)), Err(AuthFailure::Malformed));
        assert_eq!(s.verify(&headers(&[]), b"", ms(0)), Err(AuthFailure::MissingHeader));
        // The scheme's name in any case; nothing but a space after it.
        assert_eq!(s.verify(&headers(&[("authorization", "BEARER s3cret")]), b"", ms(0)), Ok(()));
        assert_eq!(s.verify(&headers(&[("authorization", "bEaReR s3cret")]), b"", ms(0)), Ok(()));
        assert_eq!(s.verify(&headers(&[("authorization", "Bearers3cret")]), b"", ms(0)), Err(AuthFailure::Malformed));
        assert_eq!(s.verify(&headers(&[("authorization", "Bearer")]), b"", ms(0)), Err(AuthFailure::Malformed));
        assert_eq!(s.verify(&headers(&[("authorization", "Beär s3cret")]), b"", ms(0)), Err(AuthFailure::Malformed));
    }

    #[test]
    fn config_errors_name_the_parameter() {
        assert_eq!(AuthScheme::from_parts("hmac-sha256", None, None, None, None).unwrap_err().0, "secret");
        assert_eq!(
            AuthScheme::from_parts("standard-webhooks", Some("whsec_!!"), None, None, None).unwrap_err().0,
            "secret"
        );
        assert_eq!(AuthScheme::from_parts("digest", None, None, None, None).unwrap_err().0, "type");
        assert_eq!(
            AuthScheme::from_parts("hmac-sha256", Some("k"), Some("bad header"), None, None).unwrap_err().0,
            "header"
        );
    }

    #[test]
    fn a_setting_the_scheme_does_not_read_is_an_error_not_ignored() {
        let refused = [
            ("bearer", Some("x-webhook-key"), None, None, "header"),
            ("stripe", Some("x-sig"), None, None, "header"),
            ("standard-webhooks", None, Some("v1,"), None, "prefix"),
            ("bearer", None, None, Some(60), "tolerance_secs"),
            ("hmac-sha256", None, None, Some(60), "tolerance_secs"),
            ("none", Some("x-sig"), None, None, "header"),
        ];
        for (scheme, header, prefix, tolerance, field) in refused {
            let secret = if scheme == "standard-webhooks" { SW_SECRET } else { "s3cret" };
            let e = AuthScheme::from_parts(scheme, Some(secret), header, prefix, tolerance).unwrap_err();
            assert_eq!(e.0, field, "{scheme}: {e:?}");
            assert!(e.1.contains("not used by"), "{scheme}: {}", e.1);
        }
        assert!(AuthScheme::from_parts("hmac-sha256", Some("k"), Some("x-sig"), Some("v1="), None).is_ok());
        assert!(AuthScheme::from_parts("stripe", Some("k"), None, None, Some(60)).is_ok());
    }

    /// A key anyone can sign with is refused, and so is a signature header the scheme
    /// would look up in vain: each with the parameter named.
    #[test]
    fn an_empty_or_short_standard_webhooks_key_and_an_invalid_header_name_are_refused() {
        for secret in ["whsec_", "whsec_AAAA", "c2hvcnQ="] {
            let e = AuthScheme::from_parts("standard-webhooks", Some(secret), None, None, None).unwrap_err();
            assert_eq!(e.0, "secret", "{secret}: {e:?}");
            assert!(e.1.contains("at least 24 bytes"), "{secret}: {}", e.1);
        }
        let at_least = format!("whsec_{}", BASE64.encode([7u8; STANDARD_WEBHOOKS_MIN_KEY_BYTES]));
        assert!(AuthScheme::from_parts("standard-webhooks", Some(&at_least), None, None, None).is_ok());
        for scheme in ["hmac-sha256", "hmac-sha1", "hmac-sha256-base64"] {
            let e = AuthScheme::from_parts(scheme, Some("k"), Some("x sig"), None, None).unwrap_err();
            assert_eq!(e.0, "header", "{scheme}: {e:?}");
            assert!(e.1.contains("not a valid header name"), "{scheme}: {}", e.1);
        }
        let ok = AuthScheme::from_parts("hmac-sha256-base64", Some("k"), Some("X-Shopify-Hmac-Sha256"), None, None);
        assert!(matches!(ok, Ok(AuthScheme::Hmac { ref header, .. }) if header == "x-shopify-hmac-sha256"));
    }

    /// An hmac setting no request could satisfy is refused, naming its parameter: a
    /// signature in a header the door reads for the request's type or framing, and a
    /// prefix no trimmed visible-ASCII header value can start with. A prefix ending in a
    /// space can match (the signature follows it), and is kept.
    #[test]
    fn an_hmac_header_or_prefix_no_request_could_satisfy_is_refused() {
        for header in ["Content-Type", "content-length", "Transfer-Encoding", "host"] {
            let e = AuthScheme::from_parts("hmac-sha256", Some("k"), Some(header), None, None).unwrap_err();
            assert_eq!(e.0, "header", "{header}: {e:?}");
        }
        for prefix in [" sha256=", "\tsha256=", "sha256=\n", "sha256\u{e9}=", " "] {
            let e = AuthScheme::from_parts("hmac-sha256", Some("k"), None, Some(prefix), None).unwrap_err();
            assert_eq!(e.0, "prefix", "{prefix:?}: {e:?}");
            assert!(e.1.contains("can never start a signature header"), "{prefix:?}: {}", e.1);
        }
        let body = b"payload";
        let sig = hex::encode(mac256(b"k", &[body]).finalize().into_bytes());
        let s = AuthScheme::from_parts("hmac-sha256", Some("k"), None, Some("sha256= "), None).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-hub-signature-256", format!("sha256= {sig}").parse().unwrap());
        assert!(s.verify(&headers, body, 0).is_ok());
        assert!(AuthScheme::from_parts("hmac-sha256-base64", Some("k"), Some("x-sig"), None, None).is_ok());
    }

    /// The name a scheme is listed under is the name it is configured by: an operator
    /// copies it to register a replacement, and a base64 endpoint listed as hex would
    /// refuse every request of its sender.
    #[test]
    fn every_scheme_is_named_as_it_is_configured() {
        let secret = format!("whsec_{}", BASE64.encode([7u8; STANDARD_WEBHOOKS_MIN_KEY_BYTES]));
        for scheme in
            ["none", "bearer", "hmac-sha256", "hmac-sha1", "hmac-sha256-base64", "standard-webhooks", "stripe"]
        {
            let (secret, header) = match scheme {
                "none" => (None, None),
                "bearer" => (Some("a-token-of-some-length"), None),
                "standard-webhooks" => (Some(secret.as_str()), None),
                "stripe" => (Some("whsec_k"), None),
                _ => (Some("k"), Some("x-signature")),
            };
            let built = AuthScheme::from_parts(scheme, secret, header, None, None)
                .unwrap_or_else(|e| panic!("{scheme}: {e:?}"));
            assert_eq!(built.name(), scheme);
        }
    }

    /// The head check refuses a request only where the full check refuses it, for the
    /// same reason, whatever the body; and passes every head whose body could still
    /// pass (the good signature of each scheme among them).
    #[test]
    fn the_head_check_refuses_only_what_the_full_check_refuses_and_for_the_same_reason() {
        let now = 1_614_265_330;
        let github =
            AuthScheme::from_parts("hmac-sha256", Some("It's a Secret to Everybody"), None, None, None).unwrap();
        let github_sig = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
        let standard = AuthScheme::from_parts("standard-webhooks", Some(SW_SECRET), None, None, None).unwrap();
        let stripe = AuthScheme::from_parts("stripe", Some("whsec_k"), None, None, None).unwrap();
        let stripe_body: &[u8] = br#"{"id":"evt_1"}"#;
        let stripe_sig = format!(
            "t={now},v1={}",
            hex::encode(mac256(b"whsec_k", &[now.to_string().as_bytes(), b".", stripe_body]).finalize().into_bytes())
        );
        let bearer = AuthScheme::from_parts("bearer", Some("a-token-of-some-length"), None, None, None).unwrap();
        let sw = |id: &'static str, sig: &'static str| {
            vec![("webhook-id", id), ("webhook-timestamp", SW_TS), ("webhook-signature", sig)]
        };
        type Case<'a> = (&'a AuthScheme, &'a [u8], Vec<(&'static str, &'a str)>, bool);
        let cases: Vec<Case> = vec![
            (&github, b"Hello, World!", vec![("x-hub-signature-256", github_sig)], true),
            (&github, b"Hello, World!", vec![], false),
            (
                &github,
                b"Hello, World!",
                vec![("x-hub-signature-256", github_sig), ("x-hub-signature-256", github_sig)],
                false,
            ),
            (&github, b"Hello, World!", vec![("x-hub-signature-256", "sha1=00")], false),
            (&github, b"Hello, World!", vec![("x-hub-signature-256", "sha256=zz")], false),
            (&github, b"Hello, World!", vec![("x-hub-signature-256", "sha256=00")], false),
            (&standard, SW_BODY, sw(SW_ID, SW_SIG), true),
            (&standard, SW_BODY, vec![("svix-id", SW_ID), ("svix-timestamp", SW_TS), ("svix-signature", SW_SIG)], true),
            (&standard, SW_BODY, sw(SW_ID, "v2,AAAA"), false),
            (&standard, SW_BODY, sw(SW_ID, "v1,not base64!"), false),
            (&standard, SW_BODY, vec![("webhook-id", SW_ID), ("webhook-signature", SW_SIG)], false),
            (
                &standard,
                SW_BODY,
                vec![("webhook-id", SW_ID), ("webhook-timestamp", "soon"), ("webhook-signature", SW_SIG)],
                false,
            ),
            (&stripe, stripe_body, vec![("stripe-signature", stripe_sig.as_str())], true),
            (&stripe, stripe_body, vec![("stripe-signature", "v1=00")], false),
            (&stripe, stripe_body, vec![("stripe-signature", "t=1,v1=zz")], false),
            (&stripe, stripe_body, vec![("stripe-signature", "t=x,v1=00")], false),
            (&bearer, b"", vec![("authorization", "Bearer a-token-of-some-length")], true),
            (&bearer, b"", vec![("authorization", "Bearer another")], false),
            (&bearer, b"", vec![("authorization", "Basic a-token-of-some-length")], false),
            (&AuthScheme::None, b"", vec![], true),
        ];
        for (scheme, body, pairs, passes) in cases {
            let h = headers(&pairs);
            let what = format!("{} with {pairs:?}", scheme.name());
            assert_eq!(scheme.verify(&h, body, ms(now)).is_ok(), passes, "{what}");
            match scheme.verify_head(&h) {
                Ok(()) => {}
                Err(reason) => {
                    assert_eq!(scheme.verify(&h, body, ms(now)), Err(reason), "{what}");
                    assert_eq!(scheme.verify(&h, b"any other body", ms(now)), Err(reason), "{what}");
                }
            }
            if passes {
                assert_eq!(scheme.verify_head(&h), Ok(()), "{what}");
            }
        }
        // A well-formed signature made with another secret is the body's to refuse.
        assert_eq!(github.verify_head(&headers(&[("x-hub-signature-256", "sha256=00")])), Ok(()));
        assert_eq!(standard.verify_head(&headers(&sw(SW_ID, "v1,AAAA"))), Ok(()));
    }
}
