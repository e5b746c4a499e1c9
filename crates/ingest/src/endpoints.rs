//! Persistence of dynamic secret-path endpoints in the state database.
//!
//! Invariants:
//! - Every change is committed with `Durability::Immediate` before the call returns, so
//!   a caller that answers 2xx afterwards answers for something durable.
//! - Revocation is a tombstone (the record stays, with `revoked_at_unix_ms`), so a
//!   revoked id can never come back, not even by re-registration with the same id. Only
//!   a live record is ever removed (`remove_live_endpoint`: a static endpoint took its
//!   id).
//! - The auth fields are stored as configured (scheme name and parameters); the HTTP
//!   source validates them the same way as static endpoints when it loads them.
//! - A registration made under an idempotency key stores the key (with the id it made
//!   and the request's fingerprint) in the same transaction as the endpoint: after a
//!   crash either both are there or neither. A key is removed only with its endpoint's
//!   record (`remove_live_endpoint`), so there are never more keys than endpoints.
//! - The `endpoint_registrations` table is created when first written to; a
//!   database without it (written before it existed, or by a build that never made
//!   one) has no keys. Builds that do not know the table leave it alone, so it changes
//!   no schema version.

use redb::{Durability, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use crate::state::{ENDPOINTS, StateDb, StateError, open_table_if_present, storage_err};

/// `idempotency key → (endpoint id, request fingerprint)`: the registrations made under
/// a key (`Idempotency-Key` on the admin API's register call).
const ENDPOINT_REGISTRATIONS: TableDefinition<&[u8], (u128, [u8; 32])> = TableDefinition::new("endpoint_registrations");

/// The longest idempotency key a registration may carry, in bytes.
pub const REGISTRATION_KEY_MAX_BYTES: usize = 255;

/// A registration made under an idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyedRegistration {
    pub key: Vec<u8>,
    /// The endpoint the registration made.
    pub id: u128,
    /// SHA-256 of what the registration asked for, so a retry is told from a different
    /// registration reusing the key.
    pub fingerprint: [u8; 32],
}

/// How logs and errors name an endpoint: the first 8 of its 32 hex digits. Enough to
/// find it in a listing, nothing like enough to post to it: for an endpoint with
/// `auth_type = "none"` the full id is the only secret, and logs travel further than the
/// admin API.
pub fn id_prefix(id: u128) -> String {
    format!("{:08x}", (id >> 96) as u32)
}

/// An endpoint's auth, as configured. Its `Debug` leaves the secret out, so that no
/// log line or panic message made of a record (or an endpoint holding one) carries it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredAuth {
    /// `none`, `bearer`, `hmac-sha256`, `hmac-sha1`, `standard-webhooks`, `stripe`.
    pub scheme: String,
    pub secret: Option<String>,
    pub header: Option<String>,
    pub prefix: Option<String>,
    pub tolerance_secs: Option<u64>,
}

impl std::fmt::Debug for StoredAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredAuth")
            .field("scheme", &self.scheme)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("header", &self.header)
            .field("prefix", &self.prefix)
            .field("tolerance_secs", &self.tolerance_secs)
            .finish()
    }
}

/// A dynamic endpoint, live or revoked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndpointRecord {
    pub id: u128,
    pub source_key: String,
    pub auth: StoredAuth,
    /// Query parameter echoed back on `GET` (a provider's verification handshake).
    pub handshake_param: Option<String>,
    pub created_at_unix_ms: u64,
    pub expires_at_unix_ms: Option<u64>,
    pub revoked_at_unix_ms: Option<u64>,
    pub rotated_at_unix_ms: Option<u64>,
}

/// A stored endpoint record that does not decode: its id (the table's key) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnreadableEndpoint {
    pub id: u128,
    pub error: String,
}

impl StateDb {
    /// Writes (inserts or replaces) an endpoint record durably. A live record is never
    /// written over a tombstone, whatever the caller believes: a revocation never comes
    /// back.
    pub fn put_endpoint(&self, record: &EndpointRecord) -> Result<(), StateError> {
        let bytes = postcard::to_stdvec(record).map_err(|e| StateError::Malformed(e.to_string()))?;
        let db = self.db()?;
        let mut txn = db.begin_write().map_err(storage_err)?;
        txn.set_durability(Durability::Immediate).map_err(|e| StateError::Storage(e.to_string()))?;
        {
            let mut table = txn.open_table(ENDPOINTS).map_err(storage_err)?;
            if record.revoked_at_unix_ms.is_none() {
                let stored_revoked = match table.get(record.id).map_err(storage_err)? {
                    // One that does not decode is not known to be live either.
                    Some(v) => postcard::from_bytes::<EndpointRecord>(v.value())
                        .map_or(true, |stored| stored.revoked_at_unix_ms.is_some()),
                    None => false,
                };
                if stored_revoked {
                    return Err(StateError::Malformed(format!(
                        "endpoint {}… is revoked (or its record does not read); its tombstone stays",
                        id_prefix(record.id)
                    )));
                }
            }
            table.insert(record.id, bytes.as_slice()).map_err(storage_err)?;
        }
        txn.commit().map_err(storage_err)
    }

    /// Writes a new endpoint's record and the idempotency key it was registered under,
    /// durably, in one transaction.
    pub fn put_registered_endpoint(
        &self,
        record: &EndpointRecord,
        registration: &KeyedRegistration,
    ) -> Result<(), StateError> {
        if registration.id != record.id {
            return Err(StateError::Malformed(format!(
                "registration key names endpoint {}…, the record is {}…",
                id_prefix(registration.id),
                id_prefix(record.id)
            )));
        }
        if registration.key.is_empty() || registration.key.len() > REGISTRATION_KEY_MAX_BYTES {
            return Err(StateError::Malformed(format!(
                "a registration key is 1 to {REGISTRATION_KEY_MAX_BYTES} bytes, not {}",
                registration.key.len()
            )));
        }
        let bytes = postcard::to_stdvec(record).map_err(|e| StateError::Malformed(e.to_string()))?;
        let db = self.db()?;
        let mut txn = db.begin_write().map_err(storage_err)?;
        txn.set_durability(Durability::Immediate).map_err(|e| StateError::Storage(e.to_string()))?;
        {
            let mut table = txn.open_table(ENDPOINTS).map_err(storage_err)?;
            table.insert(record.id, bytes.as_slice()).map_err(storage_err)?;
            let mut keys = txn.open_table(ENDPOINT_REGISTRATIONS).map_err(storage_err)?;
            keys.insert(registration.key.as_slice(), (registration.id, registration.fingerprint))
                .map_err(storage_err)?;
        }
        txn.commit().map_err(storage_err)
    }

    /// Every registration made under an idempotency key, in key order (none in a
    /// database without the table).
    pub fn load_keyed_registrations(&self) -> Result<Vec<KeyedRegistration>, StateError> {
        let db = self.db()?;
        let txn = db.begin_read().map_err(storage_err)?;
        let Some(table) = open_table_if_present(&txn, ENDPOINT_REGISTRATIONS)? else { return Ok(Vec::new()) };
        let mut out = Vec::new();
        for entry in table.iter().map_err(storage_err)? {
            let (k, v) = entry.map_err(storage_err)?;
            let (id, fingerprint) = v.value();
            out.push(KeyedRegistration { key: k.value().to_vec(), id, fingerprint });
        }
        Ok(out)
    }

    /// Removes a live endpoint's record durably (a static endpoint of the same id took
    /// its place). A tombstone is never removed: that would let a revoked id come back.
    pub fn remove_live_endpoint(&self, id: u128) -> Result<(), StateError> {
        let db = self.db()?;
        let mut txn = db.begin_write().map_err(storage_err)?;
        txn.set_durability(Durability::Immediate).map_err(|e| StateError::Storage(e.to_string()))?;
        {
            let mut table = txn.open_table(ENDPOINTS).map_err(storage_err)?;
            let revoked = match table.get(id).map_err(storage_err)? {
                Some(v) => postcard::from_bytes::<EndpointRecord>(v.value())
                    .map_err(|e| StateError::Malformed(e.to_string()))?
                    .revoked_at_unix_ms
                    .is_some(),
                None => false,
            };
            if revoked {
                return Err(StateError::Malformed(format!(
                    "endpoint {}… is revoked; its tombstone stays",
                    id_prefix(id)
                )));
            }
            table.remove(id).map_err(storage_err)?;
            match txn.open_table(ENDPOINT_REGISTRATIONS) {
                Ok(mut keys) => {
                    keys.retain(|_, (named, _)| named != id).map_err(storage_err)?;
                }
                Err(redb::TableError::TableDoesNotExist(_)) => {}
                Err(e) => return Err(storage_err(e)),
            }
        }
        txn.commit().map_err(storage_err)
    }

    pub fn get_endpoint(&self, id: u128) -> Result<Option<EndpointRecord>, StateError> {
        let db = self.db()?;
        let txn = db.begin_read().map_err(storage_err)?;
        let table = txn.open_table(ENDPOINTS).map_err(storage_err)?;
        match table.get(id).map_err(storage_err)? {
            Some(v) => postcard::from_bytes(v.value()).map(Some).map_err(|e| StateError::Malformed(e.to_string())),
            None => Ok(None),
        }
    }

    /// Takes the secret out of the tombstones `ids` (revoked by a build that kept it: a
    /// tombstone's auth is never checked, and it stays for ever), in one durable
    /// transaction; how many were written. An id that is not a tombstone holding a
    /// secret (live, gone, or a record that does not decode) is left as it is.
    pub fn forget_tombstone_secrets(&self, ids: &[u128]) -> Result<u64, StateError> {
        let db = self.db()?;
        let mut txn = db.begin_write().map_err(storage_err)?;
        txn.set_durability(Durability::Immediate).map_err(|e| StateError::Storage(e.to_string()))?;
        let mut forgotten = 0;
        {
            let mut table = txn.open_table(ENDPOINTS).map_err(storage_err)?;
            for &id in ids {
                let stored =
                    table.get(id).map_err(storage_err)?.map(|v| postcard::from_bytes::<EndpointRecord>(v.value()));
                let Some(Ok(mut record)) = stored else { continue };
                if record.id != id || record.revoked_at_unix_ms.is_none() || record.auth.secret.is_none() {
                    continue;
                }
                record.auth.secret = None;
                let bytes = postcard::to_stdvec(&record).map_err(|e| StateError::Malformed(e.to_string()))?;
                table.insert(id, bytes.as_slice()).map_err(storage_err)?;
                forgotten += 1;
            }
        }
        txn.commit().map_err(storage_err)?;
        Ok(forgotten)
    }

    /// Every stored endpoint, tombstones included, in id order. A record that does not
    /// decode (damage the database's own checks did not catch, or a defect) is returned
    /// as [`UnreadableEndpoint`] under its table key, not as an error: one such record
    /// must not keep the daemon from starting, where the operator can revoke it.
    pub fn load_endpoints(&self) -> Result<Vec<Result<EndpointRecord, UnreadableEndpoint>>, StateError> {
        let db = self.db()?;
        let txn = db.begin_read().map_err(storage_err)?;
        let table = txn.open_table(ENDPOINTS).map_err(storage_err)?;
        let mut out = Vec::new();
        for entry in table.iter().map_err(storage_err)? {
            let (k, v) = entry.map_err(storage_err)?;
            out.push(
                postcard::from_bytes::<EndpointRecord>(v.value())
                    .map_err(|e| e.to_string())
                    .and_then(|r| match r.id == k.value() {
                        true => Ok(r),
                        false => Err(format!("it names the id {}…", id_prefix(r.id))),
                    })
                    .map_err(|error| UnreadableEndpoint { id: k.value(), error }),
            );
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record's `Debug` (what a log line or a panic message would carry) names the
    /// scheme and whether there is a secret, never the secret.
    #[test]
    fn a_records_debug_leaves_its_secret_out() {
        let auth = StoredAuth {
            scheme: "hmac-sha256".into(),
            secret: Some("the-secret-0123456789".into()),
            header: Some("x-signature".into()),
            prefix: None,
            tolerance_secs: None,
        };
        let record = EndpointRecord {
            id: 7,
            source_key: "default".into(),
            auth,
            handshake_param: None,
            created_at_unix_ms: 1,
            expires_at_unix_ms: None,
            revoked_at_unix_ms: None,
            rotated_at_unix_ms: None,
        };
        let shown = format!("{record:?} {record:#?}");
        assert!(!shown.contains("the-secret-0123456789"), "{shown}");
        assert!(
            shown.contains("hmac-sha256") && shown.contains("<redacted>") && shown.contains("x-signature"),
            "{shown}"
        );
    }

    #[test]
    fn endpoints_survive_reopen_with_their_tombstones() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.redb");
        let mut rec = EndpointRecord {
            id: 42,
            source_key: "default".into(),
            auth: StoredAuth {
                scheme: "bearer".into(),
                secret: Some("t".into()),
                header: None,
                prefix: None,
                tolerance_secs: None,
            },
            handshake_param: None,
            created_at_unix_ms: 1,
            expires_at_unix_ms: None,
            revoked_at_unix_ms: None,
            rotated_at_unix_ms: None,
        };
        {
            let db = StateDb::open(&p).unwrap();
            db.put_endpoint(&rec).unwrap();
            rec.revoked_at_unix_ms = Some(2);
            db.put_endpoint(&rec).unwrap();
        }
        let db = StateDb::open(&p).unwrap();
        assert_eq!(db.load_endpoints().unwrap(), vec![Ok(rec.clone())]);
        assert_eq!(db.get_endpoint(42).unwrap(), Some(rec.clone()));
        assert_eq!(db.get_endpoint(43).unwrap(), None);
        // A tombstone is never removed, nor written over by a live record; a live record
        // is removed, durably.
        assert!(db.remove_live_endpoint(42).is_err());
        let revived = EndpointRecord { revoked_at_unix_ms: None, rotated_at_unix_ms: Some(3), ..rec.clone() };
        match db.put_endpoint(&revived) {
            Ok(()) => panic!("a live record was written over a tombstone"),
            // The error is logged: it names the endpoint by its prefix, never its whole id
            // (for an endpoint without auth, the id is the secret).
            Err(e) => {
                let whole = format!("{:032x}", revived.id);
                assert!(!e.to_string().contains(&whole), "{e}");
                assert!(e.to_string().contains(&id_prefix(revived.id)), "{e}");
            }
        }
        assert_eq!(db.get_endpoint(42).unwrap(), Some(rec.clone()));
        let live = EndpointRecord { id: 44, revoked_at_unix_ms: None, ..rec };
        db.put_endpoint(&live).unwrap();
        db.remove_live_endpoint(44).unwrap();
        drop(db);
        let db = StateDb::open(&p).unwrap();
        assert_eq!(db.get_endpoint(44).unwrap(), None);
        assert_eq!(db.load_endpoints().unwrap().len(), 1);
    }

    /// A keyed registration's key is stored with its endpoint and survives a reopen; it
    /// goes only with a live record that is removed; a database without the table has
    /// no keys; a key naming another id than the record's is refused, writing nothing.
    #[test]
    fn a_registration_key_is_kept_with_its_endpoint_and_removed_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.redb");
        let rec = |id| EndpointRecord {
            id,
            source_key: "default".into(),
            auth: StoredAuth { scheme: "none".into(), secret: None, header: None, prefix: None, tolerance_secs: None },
            handshake_param: None,
            created_at_unix_ms: 1,
            expires_at_unix_ms: None,
            revoked_at_unix_ms: None,
            rotated_at_unix_ms: None,
        };
        let key = |k: &str, id| KeyedRegistration { key: k.as_bytes().to_vec(), id, fingerprint: [id as u8; 32] };
        {
            let db = StateDb::open(&p).unwrap();
            assert_eq!(db.load_keyed_registrations().unwrap(), vec![], "no table yet");
            db.put_registered_endpoint(&rec(1), &key("a", 1)).unwrap();
            db.put_registered_endpoint(&rec(2), &key("b", 2)).unwrap();
            assert!(matches!(db.put_registered_endpoint(&rec(3), &key("c", 4)), Err(StateError::Malformed(_))));
            assert!(db.put_registered_endpoint(&rec(3), &key("", 3)).is_err(), "an empty key");
            let long = "k".repeat(REGISTRATION_KEY_MAX_BYTES + 1);
            assert!(db.put_registered_endpoint(&rec(3), &key(&long, 3)).is_err(), "a key over the limit");
            assert_eq!(db.get_endpoint(3).unwrap(), None, "a refused registration wrote nothing");
        }
        let db = StateDb::open(&p).unwrap();
        assert_eq!(db.load_keyed_registrations().unwrap(), vec![key("a", 1), key("b", 2)]);
        db.remove_live_endpoint(1).unwrap();
        drop(db);
        let db = StateDb::open(&p).unwrap();
        assert_eq!(db.load_keyed_registrations().unwrap(), vec![key("b", 2)]);
        assert_eq!(db.load_endpoints().unwrap(), vec![Ok(rec(2))]);
        drop(db);
        // `state show` and `state reset` say what losing the table means.
        let said = crate::state::inventory(&p).unwrap().consequences();
        assert!(
            said.iter().any(|l| l.starts_with("endpoint_registrations: 1 entries (the idempotency keys")),
            "{said:?}"
        );
        assert!(!said.iter().any(|l| l.contains("unknown to this build")), "{said:?}");
    }

    /// Bytes that do not decode, or a record stored under another id than its own, come
    /// back as unreadable under their key, beside the records that read.
    #[test]
    fn a_record_that_does_not_decode_is_returned_as_unreadable_by_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let db = StateDb::open(dir.path().join("s.redb")).unwrap();
        let rec = EndpointRecord {
            id: 7,
            source_key: "default".into(),
            auth: StoredAuth { scheme: "none".into(), secret: None, header: None, prefix: None, tolerance_secs: None },
            handshake_param: None,
            created_at_unix_ms: 1,
            expires_at_unix_ms: None,
            revoked_at_unix_ms: None,
            rotated_at_unix_ms: None,
        };
        db.put_endpoint(&rec).unwrap();
        let misplaced = postcard::to_stdvec(&EndpointRecord { id: 8, ..rec.clone() }).unwrap();
        let txn = db.db().unwrap().begin_write().unwrap();
        {
            let mut table = txn.open_table(ENDPOINTS).unwrap();
            table.insert(5u128, &[0xff_u8, 0xff, 0xff][..]).unwrap();
            table.insert(9u128, misplaced.as_slice()).unwrap();
        }
        txn.commit().unwrap();
        let loaded = db.load_endpoints().unwrap();
        assert_eq!(loaded.len(), 3, "{loaded:?}");
        assert!(matches!(&loaded[0], Err(UnreadableEndpoint { id: 5, .. })), "{loaded:?}");
        assert_eq!(loaded[1], Ok(rec));
        assert!(
            matches!(&loaded[2], Err(UnreadableEndpoint { id: 9, error }) if error.contains("names the id")),
            "{loaded:?}"
        );
    }
}
