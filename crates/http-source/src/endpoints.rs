//! Secret-path endpoints (`/v1/e/{endpoint_id}`): the static ones from configuration and
//! the dynamic ones registered through the admin API and kept in the state database.
//!
//! Invariants:
//! - An endpoint id is 128 bits, written as 32 lower-case hex digits.
//! - A dynamic change (register, rotate, revoke) is committed durably to redb before the
//!   in-memory view changes and before the call returns; changes are serialized.
//! - A revoked endpoint stays revoked: the tombstone is kept, lookups answer `Revoked`.
//! - Static endpoints cannot be rotated or revoked through the API (`Static`).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use base64::Engine;
use ingest::{EndpointRecord, StateDb, StateError, StoredAuth};
use serde::Serialize;

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
}

/// What a lookup found.
#[derive(Debug, Clone)]
pub enum Lookup {
    Active(Arc<Endpoint>),
    Revoked,
    Expired,
    Unknown,
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
    #[error(transparent)]
    State(#[from] StateError),
}

/// An endpoint as listed (no secrets).
#[derive(Debug, Clone, Serialize)]
pub struct EndpointView {
    pub id: String,
    pub source: String,
    pub auth_type: &'static str,
    pub dynamic: bool,
    pub state: &'static str,
    pub handshake_param: Option<String>,
    pub expires_at_unix_ms: Option<u64>,
    pub revoked_at_unix_ms: Option<u64>,
}

pub fn format_id(id: u128) -> String {
    format!("{id:032x}")
}

/// Parses a 32-hex-digit endpoint id.
pub fn parse_id(s: &str) -> Option<u128> {
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u128::from_str_radix(s, 16).ok()
}

/// Builds the checker for a stored auth.
pub fn scheme_from_stored(a: &StoredAuth) -> Result<AuthScheme, String> {
    AuthScheme::from_parts(&a.scheme, a.secret.as_deref(), a.header.as_deref(), a.prefix.as_deref(), a.tolerance_secs)
        .map_err(|(field, msg)| format!("{field}: {msg}"))
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
    endpoints: RwLock<HashMap<u128, Arc<Endpoint>>>,
    changes: tokio::sync::Mutex<()>,
}

impl EndpointRegistry {
    /// Loads the static endpoints and every dynamic one from the state database.
    /// A dynamic record whose auth no longer validates is skipped with an error log.
    pub fn load(
        state: Arc<StateDb>,
        sources: Vec<String>,
        statics: Vec<Endpoint>,
    ) -> Result<EndpointRegistry, StateError> {
        let mut map: HashMap<u128, Arc<Endpoint>> = HashMap::new();
        for record in state.load_endpoints()? {
            let auth = match scheme_from_stored(&record.auth) {
                Ok(a) => a,
                Err(e) => {
                    tracing::error!(endpoint = %format_id(record.id), error = %e, "stored endpoint has invalid auth; it answers 404");
                    continue;
                }
            };
            map.insert(record.id, Arc::new(endpoint_from_record(record, auth)));
        }
        for s in statics {
            if map.contains_key(&s.id) {
                tracing::warn!(endpoint = %format_id(s.id), "a static endpoint shadows a dynamic one with the same id");
            }
            map.insert(s.id, Arc::new(s));
        }
        Ok(EndpointRegistry { state, sources, endpoints: RwLock::new(map), changes: tokio::sync::Mutex::new(()) })
    }

    pub fn lookup(&self, id: u128, now_unix_ms: u64) -> Lookup {
        let map = self.endpoints.read().unwrap_or_else(|p| p.into_inner());
        match map.get(&id) {
            None => Lookup::Unknown,
            Some(e) if e.revoked_at_unix_ms.is_some() => Lookup::Revoked,
            Some(e) if e.expires_at_unix_ms.is_some_and(|t| t <= now_unix_ms) => Lookup::Expired,
            Some(e) => Lookup::Active(e.clone()),
        }
    }

    pub fn list(&self, now_unix_ms: u64) -> Vec<EndpointView> {
        let map = self.endpoints.read().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<_> = map.values().map(|e| view(e, now_unix_ms)).collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Registers a new dynamic endpoint. A missing secret (for a scheme that needs one)
    /// is generated. Returns the stored record, secret included (shown once).
    pub async fn register(
        &self,
        source_key: String,
        mut auth: StoredAuth,
        handshake_param: Option<String>,
        expires_at_unix_ms: Option<u64>,
        now_unix_ms: u64,
    ) -> Result<EndpointRecord, EndpointError> {
        if !self.sources.contains(&source_key) {
            return Err(EndpointError::UnknownSource(source_key));
        }
        if auth.secret.is_none() && auth.scheme != "none" {
            auth.secret = Some(generate_secret(&auth.scheme));
        }
        let scheme = scheme_from_stored(&auth).map_err(EndpointError::InvalidAuth)?;
        let _serial = self.changes.lock().await;
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
        self.commit(record.clone()).await?;
        self.install(endpoint_from_record(record.clone(), scheme));
        Ok(record)
    }

    /// Replaces a dynamic endpoint's secret (generated when `secret` is `None`).
    pub async fn rotate(
        &self,
        id: u128,
        secret: Option<String>,
        now_unix_ms: u64,
    ) -> Result<EndpointRecord, EndpointError> {
        let _serial = self.changes.lock().await;
        let mut record = self.dynamic_record(id)?;
        record.auth.secret = Some(secret.unwrap_or_else(|| generate_secret(&record.auth.scheme)));
        record.rotated_at_unix_ms = Some(now_unix_ms);
        let scheme = scheme_from_stored(&record.auth).map_err(EndpointError::InvalidAuth)?;
        self.commit(record.clone()).await?;
        self.install(endpoint_from_record(record.clone(), scheme));
        Ok(record)
    }

    /// Revokes a dynamic endpoint (a tombstone; the id never works again).
    pub async fn revoke(&self, id: u128, now_unix_ms: u64) -> Result<EndpointRecord, EndpointError> {
        let _serial = self.changes.lock().await;
        let mut record = self.dynamic_record(id)?;
        record.revoked_at_unix_ms = Some(now_unix_ms);
        let scheme = scheme_from_stored(&record.auth).map_err(EndpointError::InvalidAuth)?;
        self.commit(record.clone()).await?;
        self.install(endpoint_from_record(record.clone(), scheme));
        Ok(record)
    }

    fn dynamic_record(&self, id: u128) -> Result<EndpointRecord, EndpointError> {
        let map = self.endpoints.read().unwrap_or_else(|p| p.into_inner());
        let e = map.get(&id).ok_or_else(|| EndpointError::Unknown(format_id(id)))?;
        if !e.dynamic {
            return Err(EndpointError::Static(format_id(id)));
        }
        if e.revoked_at_unix_ms.is_some() {
            return Err(EndpointError::Revoked(format_id(id)));
        }
        e.record.clone().ok_or_else(|| EndpointError::Unknown(format_id(id)))
    }

    async fn commit(&self, record: EndpointRecord) -> Result<(), EndpointError> {
        let state = self.state.clone();
        tokio::task::spawn_blocking(move || state.put_endpoint(&record))
            .await
            .map_err(|e| StateError::Storage(format!("endpoint commit task failed: {e}")))??;
        Ok(())
    }

    fn install(&self, endpoint: Endpoint) {
        let mut map = self.endpoints.write().unwrap_or_else(|p| p.into_inner());
        map.insert(endpoint.id, Arc::new(endpoint));
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
    }
}

fn view(e: &Endpoint, now_unix_ms: u64) -> EndpointView {
    let state = if e.revoked_at_unix_ms.is_some() {
        "revoked"
    } else if e.expires_at_unix_ms.is_some_and(|t| t <= now_unix_ms) {
        "expired"
    } else {
        "active"
    };
    EndpointView {
        id: format_id(e.id),
        source: e.source_key.clone(),
        auth_type: e.auth.name(),
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

    fn bearer() -> StoredAuth {
        StoredAuth { scheme: "bearer".into(), secret: None, header: None, prefix: None, tolerance_secs: None }
    }

    #[test]
    fn ids_are_exactly_32_hex_digits() {
        assert_eq!(parse_id(&format_id(0xabc)), Some(0xabc));
        assert_eq!(parse_id("abc"), None);
        assert_eq!(parse_id(&"g".repeat(32)), None);
        assert_eq!(parse_id(&"f".repeat(33)), None);
    }

    #[tokio::test]
    async fn register_rotate_revoke_persist_and_static_ones_refuse() {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(StateDb::open(dir.path().join("s.redb")).unwrap());
        let statics = vec![Endpoint {
            id: 1,
            source_key: "default".into(),
            auth: AuthScheme::None,
            handshake_param: None,
            expires_at_unix_ms: None,
            revoked_at_unix_ms: None,
            dynamic: false,
            record: None,
        }];
        let reg = EndpointRegistry::load(state.clone(), vec!["default".into()], statics.clone()).unwrap();
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
        reg.revoke(rec.id, 12).await.unwrap();
        assert!(matches!(reg.lookup(rec.id, 13), Lookup::Revoked));
        assert!(matches!(reg.rotate(rec.id, None, 13).await, Err(EndpointError::Revoked(_))));
        drop(reg);
        let again = EndpointRegistry::load(state, vec!["default".into()], statics).unwrap();
        assert!(matches!(again.lookup(rec.id, 14), Lookup::Revoked));
        assert!(matches!(again.lookup(1, 14), Lookup::Active(_)));
        assert!(matches!(again.lookup(2, 14), Lookup::Unknown));
    }
}
