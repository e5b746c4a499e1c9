//! The log's identity: a random number written once, when a writable open finds none, in
//! `log-id` beside the segments.
//!
//! What a log's offsets mean is known only to that log: another log, or this directory
//! emptied and written again, holds other records at the same offsets. Whoever keeps
//! offsets of this log elsewhere (the daemon's state database: delivery cursors and the
//! offsets a delivery id was answered with) keeps its identity beside them, and can tell a
//! log that is not the one those offsets name before it uses any of them.
//!
//! Invariants:
//! - Written once per log: by the first writable open that finds no `log-id` (a new log,
//!   or one an earlier build wrote), through a temporary file synced, renamed into place
//!   and the directory synced ([`crate::writer::write_file_atomically`]), before the open
//!   returns. A crash before the rename leaves only a `.tmp` file, which the next
//!   writable open removes, and then writes an identity of its own: a log opened by no
//!   one yet has promised nothing to anyone.
//! - Never changed afterwards: no open rewrites a whole one. A salvage copy carries its
//!   source's (the same records at the same offsets), an in-place salvage keeps it.
//! - A `log-id` that is not whole (its length, magic or checksum: damage) is moved to
//!   `log-id.damaged` and replaced by a new identity, with a warning and in the open's report
//!   ([`crate::OpenReport::log_id_damaged`]): the log itself stays usable, and a keeper of
//!   its offsets, finding another identity than the one it recorded, refuses it until an
//!   operator decides (the daemon's `state forget-log`). Refusing the open instead would
//!   leave the operator nothing to do but remove the file, to the same end.
//! - Never 0: a keeper of offsets may use 0 for "no log known".

use std::hash::{BuildHasher, Hasher};
use std::path::Path;

use crate::error::{Result, WalError};
use crate::storage::{OpenMode, Storage, read_up_to_at};

/// The file's name in the log's directory.
pub const LOG_ID_FILE: &str = "log-id";

/// Where a damaged identity is moved before a new one is written, as evidence (replaced
/// by the next one damaged).
pub const LOG_ID_DAMAGED_FILE: &str = "log-id.damaged";

/// Its length: magic, the identity, the CRC32 of both.
pub const LOG_ID_LEN: usize = 20;

const MAGIC: &[u8; 8] = b"IIWALLID";

/// The identity's bytes (FORMAT.md, "Log identity").
fn encode(id: u64) -> [u8; LOG_ID_LEN] {
    let mut b = [0u8; LOG_ID_LEN];
    b[..8].copy_from_slice(MAGIC);
    b[8..16].copy_from_slice(&id.to_le_bytes());
    let crc = crc32fast::hash(&b[..16]);
    b[16..20].copy_from_slice(&crc.to_le_bytes());
    b
}

/// The identity in `b`, or what is wrong with it.
fn decode(b: &[u8]) -> Result<u64, &'static str> {
    if b.len() != LOG_ID_LEN {
        return Err("not 20 bytes long");
    }
    if &b[..8] != MAGIC {
        return Err("no IIWALLID magic");
    }
    let crc = u32::from_le_bytes([b[16], b[17], b[18], b[19]]);
    if crc != crc32fast::hash(&b[..16]) {
        return Err("its checksum does not match");
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&b[8..16]);
    match u64::from_le_bytes(id) {
        0 => Err("its identity is 0"),
        id => Ok(id),
    }
}

/// The identity of the log in `dir`: `None` when it has no `log-id`.
pub(crate) fn read(storage: &dyn Storage, dir: &Path) -> Result<Option<u64>> {
    let path = dir.join(LOG_ID_FILE);
    let f = match storage.open(&path, OpenMode::Read) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(WalError::io(&path, e)),
    };
    // One byte more than a whole one: a longer file is told apart from a whole one.
    let mut b = [0u8; LOG_ID_LEN + 1];
    let n = read_up_to_at(&*f, &mut b, 0).map_err(|e| WalError::io(&path, e))?;
    decode(&b[..n]).map(Some).map_err(|problem| WalError::BadLogId { path, problem })
}

/// The identity of the log in `dir` on the real file system, read without writing
/// anything (the read-only tools): `None` when it has none, an error when it is not whole.
pub fn read_in(dir: &Path) -> Result<Option<u64>> {
    read(&crate::storage::FsStorage, dir)
}

/// Gives the log in `dir` a new identity, durably, and returns it.
pub(crate) fn create(storage: &dyn Storage, dir: &Path) -> Result<u64> {
    let id = random_nonzero();
    write(storage, dir, id)?;
    Ok(id)
}

/// Writes `id` as the identity of the log in `dir`, durably: a new one ([`create`]), or a
/// salvage copy's, its source's.
pub(crate) fn write(storage: &dyn Storage, dir: &Path, id: u64) -> Result<()> {
    crate::writer::write_file_atomically(storage, dir, LOG_ID_FILE, &encode(id))
}

/// 64 random bits, not 0, from the standard library's per-process random hasher keys
/// (seeded by the operating system), mixed with the time and the process id: an
/// identity, not a secret, that two logs must not share by chance.
fn random_nonzero() -> u64 {
    loop {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        h.write_u128(now.as_nanos());
        h.write_u32(std::process::id());
        let id = h.finish();
        if id != 0 {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_reads_back_and_damage_is_named() {
        let id = random_nonzero();
        assert_eq!(decode(&encode(id)), Ok(id));
        assert_ne!(random_nonzero(), random_nonzero(), "two identities alike");
        let whole = encode(0x0123_4567_89ab_cdef);
        assert_eq!(decode(&whole[..19]), Err("not 20 bytes long"));
        let mut longer = whole.to_vec();
        longer.push(0);
        assert_eq!(decode(&longer), Err("not 20 bytes long"));
        for i in 0..LOG_ID_LEN {
            let mut flipped = whole;
            flipped[i] ^= 0x10;
            assert!(decode(&flipped).is_err(), "a flip at byte {i} went unseen");
        }
        assert_eq!(decode(&encode(0)), Err("its identity is 0"));
    }
}
