//! The router's per-lane cursors in the state database: for each (source, stream,
//! topic), the offset below which every record of that lane was acknowledged.
//!
//! Invariants:
//! - `store_cursors` commits durably (redb's default immediate durability) before it
//!   returns: the log may be released below a cursor only once it is stored.
//! - A stored cursor never moves backwards through `store_cursors`: a smaller value than
//!   the stored one is ignored. Only `lower_cursors` moves one back, for a cursor the log
//!   does not reach (it lost its tail after the cursor was stored).

use redb::{ReadableDatabase, ReadableTable, TableDefinition};

use crate::state::{StateDb, StateError, open_table_if_present, storage_err};

pub(crate) const CURSORS: TableDefinition<(&str, &str, &str), u64> = TableDefinition::new("router_cursors");

/// One lane's cursor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CursorRow {
    pub source: String,
    pub stream: String,
    pub topic: String,
    pub delivered_below: u64,
}

/// Every cursor a read transaction sees (none in a database without the table).
fn cursors_in(txn: &redb::ReadTransaction) -> Result<Vec<CursorRow>, StateError> {
    let Some(table) = open_table_if_present(txn, CURSORS)? else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    for entry in table.iter().map_err(storage_err)? {
        let (k, v) = entry.map_err(storage_err)?;
        let (source, stream, topic) = k.value();
        out.push(CursorRow {
            source: source.to_string(),
            stream: stream.to_string(),
            topic: topic.to_string(),
            delivered_below: v.value(),
        });
    }
    Ok(out)
}

impl StateDb {
    /// Every stored cursor.
    pub fn load_cursors(&self) -> Result<Vec<CursorRow>, StateError> {
        let db = self.db()?;
        cursors_in(&db.begin_read().map_err(storage_err)?)
    }

    /// Stores several cursors in one durable transaction; a cursor never moves back.
    pub fn store_cursors(&self, rows: &[CursorRow]) -> Result<(), StateError> {
        self.change_cursors(rows, |current, new| current.is_none_or(|c| c < new).then_some(CursorChange::Set))
    }

    /// Lowers each stored cursor that is above the row's offset to it, in one durable
    /// transaction; a cursor at or below it, or none, is left as it is. For a cursor the
    /// log does not reach: kept, it would pass over records that reuse its offsets.
    pub fn lower_cursors(&self, rows: &[CursorRow]) -> Result<(), StateError> {
        self.change_cursors(rows, |current, new| current.is_some_and(|c| c > new).then_some(CursorChange::Set))
    }

    /// Deletes each stored cursor at or below its row's offset, in one durable
    /// transaction; one above it, or none, is left as it is. For a cursor the log's start
    /// has passed: it says nothing of any record the log holds.
    pub fn forget_cursors(&self, rows: &[CursorRow]) -> Result<(), StateError> {
        self.change_cursors(rows, |current, at_most| {
            current.is_some_and(|c| c <= at_most).then_some(CursorChange::Remove)
        })
    }

    /// Applies to each row's stored cursor what `change` says of it (given the stored
    /// offset, `None` for no cursor yet, and the row's), in one durable transaction.
    fn change_cursors(
        &self,
        rows: &[CursorRow],
        change: impl Fn(Option<u64>, u64) -> Option<CursorChange>,
    ) -> Result<(), StateError> {
        let db = self.db()?;
        let txn = db.begin_write().map_err(storage_err)?;
        {
            let mut table = txn.open_table(CURSORS).map_err(storage_err)?;
            for r in rows {
                let key = (r.source.as_str(), r.stream.as_str(), r.topic.as_str());
                let current = table.get(key).map_err(storage_err)?.map(|v| v.value());
                match change(current, r.delivered_below) {
                    Some(CursorChange::Set) => drop(table.insert(key, r.delivered_below).map_err(storage_err)?),
                    Some(CursorChange::Remove) => drop(table.remove(key).map_err(storage_err)?),
                    None => {}
                }
            }
        }
        txn.commit().map_err(storage_err)
    }
}

/// What [`StateDb::change_cursors`] does to one stored cursor.
enum CursorChange {
    /// Set it to the row's offset.
    Set,
    Remove,
}

/// What a read-only look at the stored cursors found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CursorsSnapshot {
    /// The database was free: every stored cursor, and the schema version.
    /// `from_repaired_copy`: it was not closed cleanly, and was read from a repaired copy
    /// ([`crate::state::REPAIRED_COPY_NOTE`]).
    /// `log_id`: the identity of the log whose offsets the cursors are (`None`: none
    /// recorded, a database from before identities or not started yet).
    Read { schema_version: Option<u64>, cursors: Vec<CursorRow>, from_repaired_copy: bool, log_id: Option<u64> },
    /// A running daemon holds the database (redb locks it for as long as it is open).
    HeldByRunningDaemon,
    /// No database at that path.
    Missing,
}

/// Reads the stored cursors at `path` without writing anything: redb's read-only open,
/// which takes a shared lock for the moment of the read and fails while a daemon holds
/// the database. Refuses a schema version other than this build's (the cursor layout
/// could differ), and a database with tables but no version, as the daemon does.
pub fn read_cursors_read_only(path: &std::path::Path) -> Result<CursorsSnapshot, StateError> {
    use crate::state::SCHEMA_VERSION;
    // Missing only when the file system says so: a path that cannot be looked at (no
    // search right on a directory) goes on to the open, which names its error.
    if std::fs::symlink_metadata(path).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
        return Ok(CursorsSnapshot::Missing);
    }
    // Never opened: a FIFO would block the open.
    if let Some(kind) = crate::state::not_a_file(path) {
        return Err(StateError::NotAFile { path: path.to_path_buf(), kind });
    }
    let db = match crate::state::ReadOnlyView::open(path) {
        Ok(db) => db,
        Err(redb::DatabaseError::DatabaseAlreadyOpen) => return Ok(CursorsSnapshot::HeldByRunningDaemon),
        Err(e) => return Err(crate::state::open_err(path, e)),
    };
    let from_repaired_copy = db.is_repaired_copy();
    let txn = db.begin_read().map_err(storage_err)?;
    let schema_version = crate::state::schema_version_in(&txn)?;
    // A database with tables and no version is version 0, as the daemon's open takes it
    // (`check_or_init_schema`); one with no table at all is a database not yet
    // initialised, which holds no cursor.
    let found = match schema_version {
        Some(v) => Some(v),
        None if txn.list_tables().map_err(storage_err)?.next().is_some() => Some(0),
        None => None,
    };
    if let Some(v) = found
        && v != SCHEMA_VERSION
    {
        return Err(StateError::SchemaMismatch { path: path.to_path_buf(), found: v, expected: SCHEMA_VERSION });
    }
    let log_id = crate::state::log_id_in(&txn)?;
    Ok(CursorsSnapshot::Read { schema_version, cursors: cursors_in(&txn)?, from_repaired_copy, log_id })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(source: &str, topic: &str, at: u64) -> CursorRow {
        CursorRow { source: source.into(), stream: "s".into(), topic: topic.into(), delivered_below: at }
    }

    #[test]
    fn cursors_survive_a_reopen_and_never_move_backwards() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.redb");
        let db = StateDb::open(&p).unwrap();
        assert!(db.load_cursors().unwrap().is_empty());
        db.store_cursors(&[row("a", "t", 10), row("b", "t", 5)]).unwrap();
        db.store_cursors(&[row("a", "t", 7)]).unwrap();
        drop(db);
        let db = StateDb::open(&p).unwrap();
        let mut got = db.load_cursors().unwrap();
        got.sort_by(|x, y| x.source.cmp(&y.source));
        assert_eq!(got, vec![row("a", "t", 10), row("b", "t", 5)]);
    }

    #[test]
    fn lowering_moves_only_cursors_above_the_offset_back_and_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.redb");
        let db = StateDb::open(&p).unwrap();
        db.store_cursors(&[row("a", "t", 500), row("b", "t", 5)]).unwrap();
        db.lower_cursors(&[row("a", "t", 10), row("b", "t", 10), row("c", "t", 10)]).unwrap();
        drop(db);
        let db = StateDb::open(&p).unwrap();
        let mut got = db.load_cursors().unwrap();
        got.sort_by(|x, y| x.source.cmp(&y.source));
        assert_eq!(got, vec![row("a", "t", 10), row("b", "t", 5)], "b was below the offset, c had none");
    }

    #[test]
    fn forgetting_deletes_only_cursors_at_or_below_the_offset_and_survives_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.redb");
        let db = StateDb::open(&p).unwrap();
        db.store_cursors(&[row("a", "t", 500), row("b", "t", 5), row("c", "t", 10)]).unwrap();
        db.forget_cursors(&[row("a", "t", 10), row("b", "t", 10), row("c", "t", 10), row("d", "t", 10)]).unwrap();
        drop(db);
        let db = StateDb::open(&p).unwrap();
        assert_eq!(db.load_cursors().unwrap(), vec![row("a", "t", 500)], "a was above the offset, d had none");
    }

    #[test]
    fn a_read_only_look_says_when_the_daemon_holds_the_database() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.redb");
        assert_eq!(read_cursors_read_only(&p).unwrap(), CursorsSnapshot::Missing);
        let db = StateDb::open(&p).unwrap();
        db.store_cursors(&[row("a", "t", 10)]).unwrap();
        assert_eq!(read_cursors_read_only(&p).unwrap(), CursorsSnapshot::HeldByRunningDaemon);
        drop(db);
        match read_cursors_read_only(&p).unwrap() {
            CursorsSnapshot::Read { cursors, .. } => assert_eq!(cursors, vec![row("a", "t", 10)]),
            other => panic!("{other:?}"),
        }
        StateDb::open(&p).expect("the read-only look left the database free");
    }

    /// A database with tables and no schema version (a file of another program, or of a
    /// build before versions) is refused by the read-only look as the daemon's open
    /// refuses it: version 0. One with no table at all is read, and holds no cursor.
    #[test]
    fn a_read_only_look_refuses_a_database_with_tables_and_no_version() {
        let dir = tempfile::tempdir().unwrap();
        let (unversioned, empty) = (dir.path().join("unversioned.redb"), dir.path().join("empty.redb"));
        {
            let db = redb::Database::create(&unversioned).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(CURSORS).unwrap().insert(("a", "s", "t"), 10).unwrap();
            txn.commit().unwrap();
        }
        match read_cursors_read_only(&unversioned) {
            Err(StateError::SchemaMismatch { found: 0, .. }) => {}
            other => panic!("a database with tables and no version was read: {other:?}"),
        }
        assert!(
            matches!(StateDb::open(&unversioned), Err(StateError::SchemaMismatch { found: 0, .. })),
            "the daemon's open must refuse it the same way"
        );
        drop(redb::Database::create(&empty).unwrap());
        match read_cursors_read_only(&empty).unwrap() {
            CursorsSnapshot::Read { schema_version: None, cursors, .. } => assert!(cursors.is_empty()),
            other => panic!("{other:?}"),
        }
    }

    /// A database not closed cleanly (its image while the daemon had it open, as a crash
    /// leaves it) is one redb's read-only open refuses until repaired: it is read from a
    /// repaired copy, and says so, and the file itself is not written.
    #[test]
    fn a_database_not_closed_cleanly_is_read_from_a_repaired_copy_and_left_as_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let (p, crashed) = (dir.path().join("state.redb"), dir.path().join("crashed.redb"));
        let db = StateDb::open(&p).unwrap();
        db.store_cursors(&[row("a", "t", 10)]).unwrap();
        std::fs::copy(&p, &crashed).unwrap();
        drop(db);
        assert!(
            matches!(redb::ReadOnlyDatabase::open(&crashed), Err(redb::DatabaseError::RepairAborted)),
            "the image must be one that needs repair"
        );
        let before = std::fs::read(&crashed).unwrap();
        match read_cursors_read_only(&crashed).unwrap() {
            CursorsSnapshot::Read { cursors, from_repaired_copy, .. } => {
                assert_eq!(cursors, vec![row("a", "t", 10)]);
                assert!(from_repaired_copy);
            }
            other => panic!("{other:?}"),
        }
        let inventory = crate::state::inventory(&crashed).unwrap();
        assert!(inventory.from_repaired_copy);
        assert!(inventory.tables.iter().any(|(name, n)| name == "router_cursors" && *n == 1), "{inventory:?}");
        assert_eq!(std::fs::read(&crashed).unwrap(), before, "a read-only look wrote the file");
        // A database closed cleanly is read in place.
        match read_cursors_read_only(&p).unwrap() {
            CursorsSnapshot::Read { from_repaired_copy, .. } => assert!(!from_repaired_copy),
            other => panic!("{other:?}"),
        }
    }
}
