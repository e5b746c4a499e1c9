//! The router's per-lane cursors in the state database: for each (source, stream,
//! topic), the offset below which every record of that lane was acknowledged.
//!
//! Invariants:
//! - `store_cursors` commits durably (redb's default immediate durability) before it
//!   returns: the log may be released below a cursor only once it is stored.
//! - A stored cursor never moves backwards: a smaller value than the stored one is
//!   ignored.

use redb::{ReadableDatabase, ReadableTable, TableDefinition};

use crate::state::{StateDb, StateError, storage_err};

const CURSORS: TableDefinition<(&str, &str, &str), u64> = TableDefinition::new("router_cursors");

/// One lane's cursor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CursorRow {
    pub source: String,
    pub stream: String,
    pub topic: String,
    pub delivered_below: u64,
}

impl StateDb {
    /// Every stored cursor.
    pub fn load_cursors(&self) -> Result<Vec<CursorRow>, StateError> {
        let txn = self.db.begin_read().map_err(storage_err)?;
        let table = match txn.open_table(CURSORS) {
            Ok(t) => t,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(e) => return Err(storage_err(e)),
        };
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

    /// Stores several cursors in one durable transaction.
    pub fn store_cursors(&self, rows: &[CursorRow]) -> Result<(), StateError> {
        let txn = self.db.begin_write().map_err(storage_err)?;
        {
            let mut table = txn.open_table(CURSORS).map_err(storage_err)?;
            for r in rows {
                let key = (r.source.as_str(), r.stream.as_str(), r.topic.as_str());
                let current = table.get(key).map_err(storage_err)?.map(|v| v.value());
                if current.is_none_or(|c| c < r.delivered_below) {
                    table.insert(key, r.delivered_below).map_err(storage_err)?;
                }
            }
        }
        txn.commit().map_err(storage_err)
    }
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
}
