//! The daemon's state database: one redb file beside the log, for idempotency keys,
//! dynamic endpoints and the router's cursors.
//!
//! Invariants:
//! - The database carries a schema version in its `meta` table. Opening a database whose
//!   version differs from [`SCHEMA_VERSION`] fails with [`StateError::SchemaMismatch`]
//!   naming both versions; it is never reset or migrated silently: [`migrate`] (the CLI's
//!   `state migrate`) moves an older version forward, saying what it discards, and an
//!   older build refuses a newer database (a rollback cannot write the old layout into
//!   it unnoticed).
//! - A database with tables but no version is treated as version 0, i.e. a mismatch.
//! - The file is created whole or not at all: a new database is set up (schema and
//!   tables, committed durably) under a temporary name and renamed into place, and its
//!   directory is synced at every open, before anything in it is answered for.
//! - Every table this crate uses is defined here, in one place.
//! - The offsets this database holds (cursors, delivery ids' answers, checkpoints) name
//!   records of one log, whose identity ([`wal::identity`]) it records beside them
//!   ([`StateDb::check_or_record_log_id`]); a start beside another log refuses before it
//!   uses any of them, and only [`forget_log`] (the CLI's `state forget-log`) or a reset
//!   lets this database take another log, forgetting every offset it held.
//! - After an I/O error (a full disk, say) redb refuses every operation until the
//!   database is reopened. [`StateDb::reopen_if_failed`] reopens it in place, which
//!   redb repairs to its last durable commit; every handle keeps working afterwards.
//! - Every open reads the file from the disk, not from the page cache
//!   ([`read_from_disk`]): a commit whose sync failed leaves its pages there, clean but
//!   not on the disk (Linux after a writeback error), and redb, reading them, would take
//!   that commit for its last durable one, build the next commits on pages the disk
//!   never got, and after a power loss find no commit that checks.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use wal::storage::{OpenMode, Storage};

/// The schema this build reads and writes. Bump it with every incompatible change to a
/// table's key or value layout, or to what a key means, and teach [`migrate`] the step.
///
/// - 1: the delivery ids of requests through a secret-path endpoint were recorded in
///   their source's scope, the scope of its named path.
/// - 2: they are recorded in their endpoint's scope. A build of version 1 writing into a
///   database (a rollback) would put such ids back where a named-path request with the
///   same delivery id finds them, after this build sorted them out once
///   (`idempotency_keys_scoped_by_endpoint`): the bump makes that build refuse it.
pub const SCHEMA_VERSION: u64 = 2;

/// `name → u64`: `schema_version`, `idempotency_indexed_through`, `idempotency_keys_below`,
/// `idempotency_keys_scoped_by_endpoint`.
pub(crate) const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// `source key ␀ delivery key → (first offset, last offset, accepted at unix ms)`.
pub(crate) const IDEMPOTENCY: TableDefinition<&[u8], (u64, u64, u64)> = TableDefinition::new("idempotency");
/// `(accepted at unix ms, idempotency table key) → ()`: the expiry order.
pub(crate) const IDEMPOTENCY_BY_TIME: TableDefinition<(u64, &[u8]), ()> = TableDefinition::new("idempotency_by_time");
/// `endpoint id → postcard(EndpointRecord)`: dynamic secret-path endpoints, tombstones included.
pub(crate) const ENDPOINTS: TableDefinition<u128, &[u8]> = TableDefinition::new("endpoints");

pub(crate) const META_SCHEMA_VERSION: &str = "schema_version";
/// `meta` key: the identity of the log whose offsets this database holds
/// ([`wal::identity`]). Absent where none is known yet: a new database, one an earlier
/// build wrote, or one whose log was forgotten ([`forget_log`]).
pub(crate) const META_LOG_ID: &str = "log_id";

#[derive(Debug, Clone, thiserror::Error)]
pub enum StateError {
    #[error(
        "state database {path} has schema version {found}, this build expects {expected}; refusing to start (the database was not changed)"
    )]
    SchemaMismatch { path: PathBuf, found: u64, expected: u64 },
    /// `unreadable`: the file is not a database this build can read (damaged, emptied,
    /// not a redb file), which only an operator can end (`state reset`); otherwise what
    /// kept it from opening may pass (held open by another process, an I/O error).
    #[error("cannot open state database {path}: {detail}")]
    Open { path: PathBuf, detail: String, unreadable: bool },
    /// Something other than a regular file is where the database belongs (a directory,
    /// a FIFO): never opened (a FIFO would block the open), and only an operator can
    /// move it away.
    #[error("state database {path} is not a regular file ({kind}); nothing there was opened")]
    NotAFile { path: PathBuf, kind: &'static str },
    /// Another process holds the database (a running daemon, or a command that changes
    /// it): it was not opened, nothing was changed.
    #[error("state database {0} is held by another process (a running daemon?); stop it first (nothing was changed)")]
    Held(PathBuf),
    #[error("state database: {0}")]
    Storage(String),
    #[error("state database record is malformed: {0}")]
    Malformed(String),
}

/// What is at `path` when it is there and is not a regular file (followed through a
/// symbolic link): "a directory", "a FIFO", ...; `None` for a regular file or nothing.
pub fn not_a_file(path: &Path) -> Option<&'static str> {
    not_a_regular_file(std::fs::metadata(path).ok()?.file_type())
}

/// What a file of type `kind` is, when it is not a regular file: "a directory", "a
/// FIFO", "a socket", "a device"; `None` for a regular file.
pub fn not_a_regular_file(kind: std::fs::FileType) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_file() {
        return None;
    }
    Some(match () {
        () if kind.is_dir() => "a directory",
        () if kind.is_fifo() => "a FIFO",
        () if kind.is_socket() => "a socket",
        () if kind.is_char_device() || kind.is_block_device() => "a device",
        () => "not a regular file",
    })
}

/// A read-only open that failed: [`StateError::Held`] when another process holds the
/// database, else as [`open_err`].
fn held_or_open_err(path: &Path, e: redb::DatabaseError) -> StateError {
    match e {
        redb::DatabaseError::DatabaseAlreadyOpen => StateError::Held(path.to_path_buf()),
        e => open_err(path, e),
    }
}

pub(crate) fn open_err(path: &Path, e: impl std::fmt::Display) -> StateError {
    StateError::Open { path: path.to_path_buf(), detail: e.to_string(), unreadable: false }
}

/// The database at `path` did not open: whether because the file is no database this
/// build can read ([`unreadable_as_a_database`]) is kept.
fn open_failed(path: &Path, e: &redb::DatabaseError) -> StateError {
    StateError::Open { path: path.to_path_buf(), detail: e.to_string(), unreadable: unreadable_as_a_database(e) }
}

pub(crate) fn storage_err<E: Into<redb::Error>>(e: E) -> StateError {
    StateError::Storage(e.into().to_string())
}

/// `definition`'s table in a read transaction, or `None` in a database that never had it
/// (a new one, or one written by a build from before the table).
pub(crate) fn open_table_if_present<K: redb::Key + 'static, V: redb::Value + 'static>(
    txn: &redb::ReadTransaction,
    definition: TableDefinition<K, V>,
) -> Result<Option<redb::ReadOnlyTable<K, V>>, StateError> {
    match txn.open_table(definition) {
        Ok(table) => Ok(Some(table)),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(storage_err(e)),
    }
}

/// The schema version a read transaction sees (`None`: none stored yet).
pub(crate) fn schema_version_in(txn: &redb::ReadTransaction) -> Result<Option<u64>, StateError> {
    meta_in(txn, META_SCHEMA_VERSION)
}

/// The identity of the log whose offsets the database holds, as a read transaction sees
/// it (`None`: none recorded).
pub(crate) fn log_id_in(txn: &redb::ReadTransaction) -> Result<Option<u64>, StateError> {
    meta_in(txn, META_LOG_ID)
}

/// The `meta` value `key` a read transaction sees (`None` in a database without it).
fn meta_in(txn: &redb::ReadTransaction, key: &str) -> Result<Option<u64>, StateError> {
    match open_table_if_present(txn, META)? {
        Some(meta) => Ok(meta.get(key).map_err(storage_err)?.map(|v| v.value())),
        None => Ok(None),
    }
}

/// A state database opened to be read, never written: the read-only tools' view.
pub(crate) enum ReadOnlyView {
    /// The file itself, through redb's read-only open.
    File(redb::ReadOnlyDatabase),
    /// A database not closed cleanly (the daemon crashed, was killed, or the machine
    /// lost power, and has not started since), read from a copy repaired in a temporary
    /// directory: redb's read-only open refuses a database that needs repair, and the
    /// file itself is not to be written (the daemon repairs it at its next start).
    RepairedCopy { db: Database, _dir: tempfile::TempDir },
}

impl ReadOnlyView {
    /// Opens `path` to be read. `DatabaseAlreadyOpen` while a daemon holds it.
    pub(crate) fn open(path: &Path) -> Result<ReadOnlyView, redb::DatabaseError> {
        read_from_disk(&wal::storage::FsStorage, path);
        match redb::ReadOnlyDatabase::open(path) {
            Ok(db) => Ok(ReadOnlyView::File(db)),
            Err(redb::DatabaseError::RepairAborted) => {
                let io = |e: std::io::Error| redb::DatabaseError::Storage(redb::StorageError::Io(e));
                let dir = tempfile::Builder::new().prefix("iggy-ingest-state-").tempdir().map_err(io)?;
                let size = std::fs::metadata(path).map_err(io)?.len();
                room_for_copy(dir.path(), size).map_err(io)?;
                let copy = dir.path().join("state.redb");
                std::fs::copy(path, &copy).map_err(io)?;
                let db = Database::open(&copy)?;
                Ok(ReadOnlyView::RepairedCopy { db, _dir: dir })
            }
            Err(e) => Err(e),
        }
    }

    pub(crate) fn begin_read(&self) -> Result<redb::ReadTransaction, redb::TransactionError> {
        match self {
            ReadOnlyView::File(db) => db.begin_read(),
            ReadOnlyView::RepairedCopy { db, .. } => db.begin_read(),
        }
    }

    pub(crate) fn is_repaired_copy(&self) -> bool {
        matches!(self, ReadOnlyView::RepairedCopy { .. })
    }
}

/// Room the copy of a database being repaired leaves free in its directory, besides its
/// own size (redb's repair writes a little more than it reads; the rest is what other
/// users of a shared `$TMPDIR` need).
const COPY_SPARE_BYTES: u64 = 64 * 1024 * 1024;

/// Whether `dir` (the copy's own temporary directory) has room for a copy of `bytes`
/// bytes and [`COPY_SPARE_BYTES`] more; an error naming both sizes and the directory it
/// was made in (`$TMPDIR`) if not. `$TMPDIR` is often memory (tmpfs),
/// and the copy is as large as the database, which the idempotency window can make
/// gigabytes: filling it would take the machine's memory, and fail only at the end.
fn room_for_copy(dir: &Path, bytes: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let d = std::fs::File::open(dir)?;
    // SAFETY: all-zero is a valid `statvfs` (a plain C struct); `fstatvfs` fills it in
    // from a descriptor this function owns, and reads no memory of ours.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::fstatvfs(d.as_raw_fd(), &mut st) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Both are `u64` on 64-bit Linux, narrower on some other targets.
    #[allow(clippy::useless_conversion)]
    let free = u64::from(st.f_bavail).saturating_mul(u64::from(st.f_frsize));
    let needed = bytes.saturating_add(COPY_SPARE_BYTES);
    if free < needed {
        return Err(std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            format!(
                "repairing a copy of the state database needs {needed} bytes free in {} and it has {free}; \
                 set TMPDIR to a directory with room (the copy is removed afterwards)",
                dir.parent().unwrap_or(dir).display()
            ),
        ));
    }
    Ok(())
}

/// Drops the page cache's clean pages of the database at `path`, so that the open that
/// follows reads what the disk holds (dirty pages, written and not yet synced, stay: they
/// are what the file holds). A failure is logged and the open goes on, reading what is
/// cached: at worst what it did before.
pub(crate) fn read_from_disk(storage: &dyn Storage, path: &Path) {
    match storage.open(path, OpenMode::Read).and_then(|f| f.drop_cached()) {
        Ok(()) => {}
        // The open that follows says so, or creates it.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "could not drop the state database's cached pages; reading them as cached")
        }
    }
}

/// What a tool says of a database read from a repaired copy.
pub const REPAIRED_COPY_NOTE: &str = "not closed cleanly (the daemon crashed or was killed, and has not started since): read from a repaired copy; the file itself is left as it is, and repaired at the daemon's next start";

/// Opens the database anew (redb repairs it to its last durable commit).
type Opener = Box<dyn Fn() -> Result<Database, StateError> + Send + Sync>;

/// The open state database.
pub struct StateDb {
    /// `None` only while [`StateDb::reopen_if_failed`] replaces a failed database.
    db: RwLock<Option<Arc<Database>>>,
    path: PathBuf,
    /// How the database was opened, to open it again after an I/O error; `None` when it
    /// is held in memory (fuzzing, tests): nothing to reopen.
    reopen: Option<Opener>,
}

impl std::fmt::Debug for StateDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateDb").field("path", &self.path).finish()
    }
}

/// The most memory redb may keep of the database's pages (read and written): 64 MiB.
/// redb's default is 1 GiB, which a database of delivery ids fills as it grows (some
/// 250 bytes an id: at 50 keyed requests a second and the default day of retention, a
/// 1 GiB database), so that the daemon's resident memory grew with the ids it kept, up
/// to 1 GiB more than its requests in flight need. Pages past it are read again from
/// the file, through the kernel's page cache (docs/performance.md, "The state
/// database's cache": keyed requests about 6 % slower there).
pub const CACHE_BYTES: usize = 64 << 20;

/// A redb builder whose cache is [`CACHE_BYTES`].
fn bounded_cache() -> redb::Builder {
    let mut builder = redb::Builder::new();
    builder.set_cache_size(CACHE_BYTES);
    builder
}

impl StateDb {
    /// Opens (creating if needed, see [`create_whole`]) the database at `path` and checks
    /// its schema version.
    pub fn open(path: impl AsRef<Path>) -> Result<StateDb, StateError> {
        if let Some(kind) = not_a_file(path.as_ref()) {
            return Err(StateError::NotAFile { path: path.as_ref().to_path_buf(), kind });
        }
        StateDb::opened(
            path.as_ref().to_path_buf(),
            Arc::new(wal::storage::FsStorage),
            |p| bounded_cache().create(p).map_err(|e| e.to_string()),
            // Never `create` at the final name: a file gone from under the daemon (a
            // reset, by hand) must fail the open, not be set up again in place.
            |p| bounded_cache().open(p),
        )
    }

    /// [`StateDb::open`] on another storage of the log's storage layer (the simulated
    /// disk: a power loss there takes the log and the state database together), through
    /// [`StorageFileBackend`](crate::state_storage::StorageFileBackend).
    pub fn open_on(storage: Arc<dyn Storage>, path: impl AsRef<Path>) -> Result<StateDb, StateError> {
        let files = storage.clone();
        // `ReadWrite` opens an existing file only: a file gone from under the daemon
        // fails the open here too.
        let open_at = move |p: &Path| {
            let file = files
                .open(p, OpenMode::ReadWrite)
                .map_err(|e| redb::DatabaseError::Storage(redb::StorageError::Io(e)))?;
            bounded_cache().create_with_backend(crate::state_storage::StorageFileBackend::new(file))
        };
        let opener = open_at.clone();
        let create_at = move |p: &Path| opener(p).map_err(|e| e.to_string());
        StateDb::opened(path.as_ref().to_path_buf(), storage, create_at, open_at)
    }

    /// The database at `path` on `storage`, created whole if missing (set up by
    /// `create_at` in an empty file under a temporary name), opened by `open_at` (which
    /// opens an existing database only), once its schema version checks; kept to open
    /// it again after an I/O error.
    fn opened(
        path: PathBuf,
        storage: Arc<dyn Storage>,
        create_at: impl Fn(&Path) -> Result<Database, String> + Send + Sync + 'static,
        open_at: impl Fn(&Path) -> Result<Database, redb::DatabaseError> + Send + Sync + 'static,
    ) -> Result<StateDb, StateError> {
        create_whole(&*storage, &path, &create_at)?;
        // A reopen (after an I/O error) opens the same file, never a new one: a database
        // gone from under the daemon fails it (and every operation after it) rather than
        // be replaced by an empty one, which would drop every key and endpoint unsaid.
        let p = path.clone();
        let open = move || {
            read_from_disk(&*storage, &p);
            open_at(&p).map_err(|e| open_failed(&p, &e))
        };
        let db = open()?;
        StateDb::checked(db, path, Some(Box::new(open)))
    }

    /// `db`, opened at `path`, once its schema version checks (or a new one is set up).
    fn checked(db: Database, path: PathBuf, reopen: Option<Opener>) -> Result<StateDb, StateError> {
        let state = StateDb { db: RwLock::new(Some(Arc::new(db))), path, reopen };
        state.check_or_init_schema()?;
        Ok(state)
    }

    /// [`StateDb::open`] on backends of the caller's (a test's, that fails on demand):
    /// `backend` gives one for the open and for every reopen after an I/O error.
    #[cfg(test)]
    pub(crate) fn open_with_backend<B: redb::StorageBackend>(
        path: impl AsRef<Path>,
        backend: impl Fn() -> B + Send + Sync + 'static,
    ) -> Result<StateDb, StateError> {
        let path = path.as_ref().to_path_buf();
        let p = path.clone();
        let open = move || redb::Builder::new().create_with_backend(backend()).map_err(|e| open_err(&p, e));
        StateDb::checked(open()?, path, Some(Box::new(open)))
    }

    /// A fresh database held in memory, for tests and fuzzing: the same tables and
    /// schema, nothing on disk.
    pub fn open_in_memory() -> Result<StateDb, StateError> {
        let path = PathBuf::from("(in memory)");
        let db = redb::Builder::new()
            .create_with_backend(redb::backends::InMemoryBackend::new())
            .map_err(|e| open_err(&path, e))?;
        StateDb::checked(db, path, None)
    }

    /// The database, for one operation. Keep the handle alive until the operation's
    /// transaction is done (declare it first), so a reopen waits for the operation.
    pub(crate) fn db(&self) -> Result<Arc<Database>, StateError> {
        self.db
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| StateError::Storage("the state database is being reopened after an I/O error".to_string()))
    }

    /// If redb latched an I/O error (every operation then fails with "Previous I/O
    /// error"), closes the database and opens it again, which repairs it to its last
    /// durable commit: non-durable commits since then are lost (the idempotency keys
    /// among them are rebuilt from the log by the caller). Returns whether it reopened.
    /// Waits (bounded) for operations in progress; if they do not finish, or the reopen
    /// fails (the disk is still full), the database stays failed and a later call retries.
    pub fn reopen_if_failed(&self) -> Result<bool, StateError> {
        let Some(reopen) = &self.reopen else {
            return Ok(false);
        };
        let failed = match self.db.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
            None => true,
            Some(db) => {
                matches!(db.try_begin_write(), Err(redb::TransactionError::Storage(redb::StorageError::PreviousIo)))
            }
        };
        if !failed {
            return Ok(false);
        }
        let mut taken = self.db.write().unwrap_or_else(|p| p.into_inner()).take();
        // Operations in progress hold a clone: wait for them, within reason.
        for _ in 0..500 {
            match taken.map(Arc::try_unwrap) {
                None | Some(Ok(_)) => {
                    taken = None;
                    break;
                }
                Some(Err(still_shared)) => {
                    taken = Some(still_shared);
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            }
        }
        if let Some(still_shared) = taken {
            *self.db.write().unwrap_or_else(|p| p.into_inner()) = Some(still_shared);
            return Err(StateError::Storage("the state database is in use; reopening it later".to_string()));
        }
        // The failed database is closed (dropped above): open it again, repaired.
        let db = reopen()?;
        *self.db.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(db));
        tracing::warn!(path = %self.path.display(), "state database reopened after an I/O error");
        Ok(true)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The schema version stored in the database at `path`, without changing anything.
    pub fn stored_schema_version(&self) -> Result<Option<u64>, StateError> {
        let db = self.db()?;
        schema_version_in(&db.begin_read().map_err(storage_err)?)
    }

    fn check_or_init_schema(&self) -> Result<(), StateError> {
        let found = self.stored_schema_version()?;
        match found {
            Some(v) if v == SCHEMA_VERSION => Ok(()),
            Some(v) => Err(StateError::SchemaMismatch { path: self.path.clone(), found: v, expected: SCHEMA_VERSION }),
            None => {
                let db = self.db()?;
                let txn = db.begin_write().map_err(storage_err)?;
                let has_tables = txn.list_tables().map_err(storage_err)?.next().is_some();
                if has_tables {
                    drop(txn);
                    return Err(StateError::SchemaMismatch {
                        path: self.path.clone(),
                        found: 0,
                        expected: SCHEMA_VERSION,
                    });
                }
                {
                    let mut meta = txn.open_table(META).map_err(storage_err)?;
                    meta.insert(META_SCHEMA_VERSION, SCHEMA_VERSION).map_err(storage_err)?;
                    txn.open_table(IDEMPOTENCY).map_err(storage_err)?;
                    txn.open_table(IDEMPOTENCY_BY_TIME).map_err(storage_err)?;
                    txn.open_table(ENDPOINTS).map_err(storage_err)?;
                }
                txn.commit().map_err(storage_err)?;
                Ok(())
            }
        }
    }

    /// Checks that the log beside this database, of identity `log_id`, is the one whose
    /// offsets it holds ([`META_LOG_ID`]), recording it durably where none is recorded
    /// yet: `Ok(Recorded)` for a log this database now names, `Ok(Same)` for the one it
    /// named, `Ok(Other(recorded))` for another, nothing changed. One write transaction.
    pub fn check_or_record_log_id(&self, log_id: u64) -> Result<LogIdCheck, StateError> {
        let db = self.db()?;
        let txn = db.begin_write().map_err(storage_err)?;
        let check = {
            let mut meta = txn.open_table(META).map_err(storage_err)?;
            let recorded = meta.get(META_LOG_ID).map_err(storage_err)?.map(|v| v.value());
            match recorded {
                Some(r) if r == log_id => LogIdCheck::Same,
                Some(r) => LogIdCheck::Other(r),
                None => {
                    meta.insert(META_LOG_ID, log_id).map_err(storage_err)?;
                    LogIdCheck::Recorded
                }
            }
        };
        match check {
            LogIdCheck::Recorded => txn.commit().map_err(storage_err)?,
            _ => txn.abort().map_err(storage_err)?,
        }
        Ok(check)
    }

    /// Overwrites the stored schema version. For tests of the mismatch path and for an
    /// explicit migration tool; the daemon never calls it.
    pub fn force_schema_version(&self, version: u64) -> Result<(), StateError> {
        let db = self.db()?;
        let txn = db.begin_write().map_err(storage_err)?;
        {
            let mut meta = txn.open_table(META).map_err(storage_err)?;
            meta.insert(META_SCHEMA_VERSION, version).map_err(storage_err)?;
        }
        txn.commit().map_err(storage_err)
    }
}

/// Makes sure a database exists at `path`, created whole or not at all. A new one is set
/// up (schema and tables, committed durably) under `path` + `.init`, closed, renamed into
/// place and its directory synced: a power loss while redb sets up a file in place can
/// leave one of a length redb refuses, or without its header, which no start could open
/// again. An existing one has its directory synced again, so that its entry is durable
/// before any commit in it is answered (an earlier run may have stopped before that).
fn create_whole(
    storage: &dyn Storage,
    path: &Path,
    create_at: &dyn Fn(&Path) -> Result<Database, String>,
) -> Result<(), StateError> {
    let io = |e: std::io::Error| open_err(path, e);
    let parent = parent_dir(path);
    match storage.open(path, OpenMode::Read) {
        Ok(_) => return storage.sync_dir(parent).map_err(io),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".init");
    let init = path.with_file_name(name);
    match storage.remove_file(&init) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    storage.open(&init, OpenMode::CreateNew).map_err(io)?;
    let db = create_at(&init).map_err(|e| open_err(&init, e))?;
    drop(StateDb::checked(db, init.clone(), None)?);
    storage.rename(&init, path).map_err(io)?;
    storage.sync_dir(parent).map_err(io)
}

/// What a state database holds, read without checking its schema version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateInventory {
    pub schema_version: Option<u64>,
    /// The identity of the log whose offsets it holds ([`META_LOG_ID`]), when recorded.
    pub log_id: Option<u64>,
    /// Every table and its number of entries, by name.
    pub tables: Vec<(String, u64)>,
    /// Read from a repaired copy: the database was not closed cleanly.
    pub from_repaired_copy: bool,
    /// Why the file could not be read as a database (damaged, not a redb file, of a
    /// file format this build cannot open), when a reset discarded it so: what it held
    /// is unknown.
    pub unreadable: Option<String>,
}

impl StateInventory {
    /// A file that could not be read as a database, for the reason `e` gives.
    fn unreadable(e: &redb::DatabaseError) -> StateInventory {
        StateInventory {
            schema_version: None,
            log_id: None,
            tables: Vec::new(),
            from_repaired_copy: false,
            unreadable: Some(e.to_string()),
        }
    }

    /// What losing each table means, for an operator about to reset.
    pub fn consequences(&self) -> Vec<String> {
        let unreadable = self.unreadable.iter().map(|why| {
            format!(
                "unreadable ({why}): whatever it held is discarded: delivery ids (rebuilt from the log on the next \
                 start, within the retention window), dynamic endpoints with their secrets and revocation tombstones \
                 (their URLs answer 404), delivery cursors (records still in the log are delivered again, same \
                 message ids)"
            )
        });
        unreadable
            .chain(self.tables.iter().map(|(name, n)| {
                let what = match name.as_str() {
                    "idempotency" | "idempotency_by_time" => {
                        "delivery ids; rebuilt from the log on the next start (within the retention window)"
                    }
                    "endpoints" => "dynamic endpoints, their secrets and revocation tombstones; their URLs answer 404",
                    "endpoint_registrations" => {
                        "the idempotency keys endpoints were registered under; a retried registration makes a new endpoint"
                    }
                    "router_cursors" => {
                        "delivery cursors; records still in the log are delivered again (same message ids)"
                    }
                    "meta" => "schema version and checkpoints; written anew",
                    _ => "unknown to this build",
                };
                format!("{name}: {n} entries ({what})")
            }))
            .collect()
    }
}

/// Reads what the database at `path` holds, whatever its schema version, opened
/// read-only: the file is not written (a database of another build is shown as it is;
/// one not closed cleanly is read from a repaired copy). Fails if a running daemon holds it.
pub fn inventory(path: &Path) -> Result<StateInventory, StateError> {
    let view = ReadOnlyView::open(path).map_err(|e| held_or_open_err(path, e))?;
    inventory_of_view(&view)
}

fn inventory_of_view(view: &ReadOnlyView) -> Result<StateInventory, StateError> {
    let txn = view.begin_read().map_err(storage_err)?;
    Ok(StateInventory { from_repaired_copy: view.is_repaired_copy(), ..inventory_of(txn)? })
}

/// What [`reset`] would discard from the database at `path`, read as [`inventory`]
/// reads it, the file not written: for a file that is not a database this build can
/// read, that it is unreadable (a reset deletes such a file as it is), where
/// [`inventory`] fails.
pub fn reset_preview(path: &Path) -> Result<StateInventory, StateError> {
    match ReadOnlyView::open(path) {
        Ok(view) => inventory_of_view(&view),
        Err(e) if unreadable_as_a_database(&e) => Ok(StateInventory::unreadable(&e)),
        Err(e) => Err(held_or_open_err(path, e)),
    }
}

fn inventory_of(txn: redb::ReadTransaction) -> Result<StateInventory, StateError> {
    use redb::{ReadableTableMetadata, TableHandle};
    let schema_version = schema_version_in(&txn)?;
    let log_id = log_id_in(&txn)?;
    let mut tables = Vec::new();
    for handle in txn.list_tables().map_err(storage_err)? {
        let name = handle.name().to_string();
        let table = txn.open_untyped_table(handle).map_err(storage_err)?;
        tables.push((name, table.len().map_err(storage_err)?));
    }
    tables.sort();
    Ok(StateInventory { schema_version, log_id, tables, from_repaired_copy: false, unreadable: None })
}

/// What [`migrate`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Migration {
    /// The database was already of this build's version: nothing changed.
    AlreadyCurrent,
    /// Moved from version `from` to [`SCHEMA_VERSION`]; `discarded` says what the step
    /// gave up, one line each.
    Migrated { from: u64, discarded: Vec<&'static str> },
}

/// Moves the database at `path` (of a stopped daemon: fails, changing nothing, if a
/// running one holds it) from an older schema version to [`SCHEMA_VERSION`], in one
/// durable transaction. A version with no step to this one (newer, or unknown) is
/// refused with [`StateError::SchemaMismatch`], changing nothing.
///
/// 1 → 2: the facts a build of version 1 could have made untrue are dropped, so the next
/// start establishes them again from what the database holds: the mark that the keys
/// recorded in a source's scope by endpoint requests were sorted out (they are forgotten
/// again, for every source), and the bound on recorded keys'
/// offsets (the next start checks every key against the log's end).
pub fn migrate(path: &Path) -> Result<Migration, StateError> {
    use crate::idempotency::{META_KEYS_BELOW, META_KEYS_SCOPED_BY_ENDPOINT};
    read_from_disk(&wal::storage::FsStorage, path);
    let db = bounded_cache().open(path).map_err(|e| open_err(path, e))?;
    let txn = db.begin_write().map_err(storage_err)?;
    let found = {
        let meta = txn.open_table(META).map_err(storage_err)?;
        meta.get(META_SCHEMA_VERSION).map_err(storage_err)?.map(|v| v.value())
    };
    match found {
        Some(SCHEMA_VERSION) => Ok(Migration::AlreadyCurrent),
        Some(1) => {
            {
                let mut meta = txn.open_table(META).map_err(storage_err)?;
                meta.remove(META_KEYS_SCOPED_BY_ENDPOINT).map_err(storage_err)?;
                meta.remove(META_KEYS_BELOW).map_err(storage_err)?;
                meta.insert(META_SCHEMA_VERSION, SCHEMA_VERSION).map_err(storage_err)?;
            }
            txn.commit().map_err(storage_err)?;
            Ok(Migration::Migrated {
                from: 1,
                discarded: vec![
                    "the mark that delivery ids recorded in a source's scope by endpoint requests were sorted out: the next start forgets every delivery id recorded in a source's scope again, for every source (a retry of one of those deliveries is appended again)",
                    "the bound on recorded delivery ids' offsets: the next start checks every id against the log's end",
                ],
            })
        }
        other => Err(StateError::SchemaMismatch {
            path: path.to_path_buf(),
            found: other.unwrap_or(0),
            expected: SCHEMA_VERSION,
        }),
    }
}

/// What [`StateDb::check_or_record_log_id`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogIdCheck {
    /// None was recorded: this log's is now.
    Recorded,
    Same,
    /// Another log's, recorded before.
    Other(u64),
}

/// What [`forget_log`] forgot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForgottenLog {
    /// The identity of the log the database named, if it named one.
    pub log_id: Option<u64>,
    pub cursors: u64,
    pub delivery_ids: u64,
}

/// Forgets, in one durable transaction, everything the database at `path` holds of its
/// log: the router's cursors, the delivery ids with the offsets they were answered with,
/// the rebuild's checkpoints, and the log's identity. Dynamic endpoints, their secrets,
/// revocations and registrations are kept. The next start takes the log beside it as its
/// own: it delivers every record the log holds (no cursor), rebuilds the delivery ids
/// from it, and records its identity. Fails, changing nothing, while a running daemon
/// holds the database, or for a database of another schema version.
pub fn forget_log(path: &Path) -> Result<ForgottenLog, StateError> {
    use crate::cursors::CURSORS;
    use crate::idempotency::{META_INDEXED_THROUGH, META_KEYS_BELOW, META_MISSING_RANGES_RECONCILED};
    read_from_disk(&wal::storage::FsStorage, path);
    let db = bounded_cache().open(path).map_err(|e| held_or_open_err(path, e))?;
    let txn = db.begin_write().map_err(storage_err)?;
    let (found, log_id) = {
        let meta = txn.open_table(META).map_err(storage_err)?;
        let get = |k| meta.get(k).map(|v| v.map(|v| v.value())).map_err(storage_err);
        (get(META_SCHEMA_VERSION)?, get(META_LOG_ID)?)
    };
    if found != Some(SCHEMA_VERSION) {
        return Err(StateError::SchemaMismatch {
            path: path.to_path_buf(),
            found: found.unwrap_or(0),
            expected: SCHEMA_VERSION,
        });
    }
    let cursors = txn.open_table(CURSORS).map_err(storage_err)?.len().map_err(storage_err)?;
    let delivery_ids = txn.open_table(IDEMPOTENCY).map_err(storage_err)?.len().map_err(storage_err)?;
    txn.delete_table(CURSORS).map_err(storage_err)?;
    txn.delete_table(IDEMPOTENCY).map_err(storage_err)?;
    txn.delete_table(IDEMPOTENCY_BY_TIME).map_err(storage_err)?;
    txn.open_table(IDEMPOTENCY).map_err(storage_err)?;
    txn.open_table(IDEMPOTENCY_BY_TIME).map_err(storage_err)?;
    {
        let mut meta = txn.open_table(META).map_err(storage_err)?;
        for key in [META_INDEXED_THROUGH, META_KEYS_BELOW, META_MISSING_RANGES_RECONCILED, META_LOG_ID] {
            meta.remove(key).map_err(storage_err)?;
        }
    }
    txn.commit().map_err(storage_err)?;
    Ok(ForgottenLog { log_id, cursors, delivery_ids })
}

/// Deletes the database at `path` after reading what it held (returned). The log is
/// not touched. Fails, changing nothing, if a running daemon holds the database.
///
/// The file is unlinked while this holds the database's lock, so a daemon starting
/// meanwhile either finds the lock taken (and refuses to start) or no file (and creates
/// a new database): never one that is deleted under it. The removal is made durable.
pub fn reset(path: &Path) -> Result<StateInventory, StateError> {
    reset_on(&wal::storage::FsStorage, path, |p| Database::open(p), || {})
}

/// The file `state reset --yes` leaves beside the database it deleted (or found
/// missing): `state.redb.reset`. A start that finds no database beside a log written
/// before creates a new one only where this says an empty one is wanted, and removes it
/// once the new one exists; without it, that start is refused ([`missing_beside_a_log`]):
/// a database lost or moved aside must not be replaced, silently, by an empty one.
pub fn reset_marker(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".reset");
    path.with_file_name(name)
}

/// Leaves [`reset_marker`] for `path`, durably (the file, then its directory).
pub fn mark_reset(path: &Path) -> Result<(), StateError> {
    mark_reset_on(&wal::storage::FsStorage, path)
}

/// [`mark_reset`] on `storage`. A marker left by an earlier reset is written again.
fn mark_reset_on(storage: &dyn Storage, path: &Path) -> Result<(), StateError> {
    const TEXT: &[u8] =
        b"the state database was discarded by `iggy-ingest state reset --yes`: the next start creates an empty one\n";
    let marker = reset_marker(path);
    let written = match storage.open(&marker, OpenMode::CreateNew) {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => storage.open(&marker, OpenMode::ReadWrite),
        opened => opened,
    }
    .and_then(|f| {
        f.set_len(0)?;
        f.write_all_at(TEXT, 0)?;
        f.sync_data()
    });
    written.map_err(|e| open_err(&marker, e))?;
    storage.sync_dir(parent_dir(&marker)).map_err(|e| open_err(&marker, e))
}

/// The directory holding `path` (`.` for a bare file name).
fn parent_dir(path: &Path) -> &Path {
    path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// Whether a start must refuse rather than create the database at `path`: there is none,
/// the log beside it was written before (`log_next_offset` above 0: a daemon ran, and
/// kept its cursors, endpoints and tombstones there), and no reset asked for an empty
/// one ([`reset_marker`]).
fn missing_beside_a_log(storage: &dyn Storage, path: &Path, log_next_offset: u64) -> Result<bool, StateError> {
    let exists = |p: &Path| match storage.open(p, OpenMode::Read) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(open_err(p, e)),
    };
    Ok(log_next_offset > 0 && !exists(path)? && !exists(&reset_marker(path))?)
}

/// Opens the database at `path` as a start does beside a log whose next offset is
/// `log_next_offset`: `None` where [`missing_beside_a_log`] says the start must refuse;
/// otherwise the database (created whole where missing, [`StateDb::open`]), with
/// [`reset_marker`] removed once it exists, never before.
pub fn open_beside_a_log(path: &Path, log_next_offset: u64) -> Result<Option<StateDb>, StateError> {
    open_beside_a_log_on(&wal::storage::FsStorage, path, log_next_offset, |p| StateDb::open(p))
}

/// [`open_beside_a_log`] on `storage`, the database opened by `open`.
fn open_beside_a_log_on(
    storage: &dyn Storage,
    path: &Path,
    log_next_offset: u64,
    open: impl FnOnce(&Path) -> Result<StateDb, StateError>,
) -> Result<Option<StateDb>, StateError> {
    if missing_beside_a_log(storage, path, log_next_offset)? {
        return Ok(None);
    }
    let state = open(path)?;
    clear_reset_marker(storage, path);
    Ok(Some(state))
}

/// Removes [`reset_marker`] once a new database exists: best effort, as a marker left
/// over only lets a later start create a database where it finds none.
fn clear_reset_marker(storage: &dyn Storage, path: &Path) {
    match storage.remove_file(&reset_marker(path)) {
        Ok(()) => {
            let _ = storage.sync_dir(parent_dir(path));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(error = %e, "cannot remove the state reset marker"),
    }
}

/// [`reset`] on `storage`, the database opened by `open` (on the file system, redb's own
/// open, which takes the file's lock), running `before_unlink` while the lock is held
/// and the file not yet removed (where a concurrent start is tested).
fn reset_on(
    storage: &dyn Storage,
    path: &Path,
    open: impl FnOnce(&Path) -> Result<Database, redb::DatabaseError>,
    before_unlink: impl FnOnce(),
) -> Result<StateInventory, StateError> {
    read_from_disk(storage, path);
    let (db, inventory) = match open(path) {
        Ok(db) => {
            let inventory = inventory_of(db.begin_read().map_err(storage_err)?)?;
            (Some(db), inventory)
        }
        // A file that is not a database this build can read (damaged, not a redb file,
        // an old file format) is discarded as it is: otherwise nothing but a removal by
        // hand, outside the daemon's lock, would get a daemon started again. An error
        // that says nothing of the file (held open, I/O) refuses.
        Err(e) if unreadable_as_a_database(&e) => (None, StateInventory::unreadable(&e)),
        Err(e) => return Err(open_err(path, e)),
    };
    before_unlink();
    // The marker first, synced, then the unlink: so no moment has the database gone
    // without the marker that lets the next start create an empty one, whatever a
    // power loss keeps of the directory's unsynced changes
    // (`tests::a_power_loss_during_a_reset_or_the_start_after_it_never_refuses_the_next_start`).
    mark_reset_on(storage, path)?;
    storage.remove_file(path).map_err(|e| open_err(path, e))?;
    drop(db);
    storage.sync_dir(parent_dir(path)).map_err(|e| open_err(path, e))?;
    Ok(inventory)
}

/// Whether `e`, from opening a database file, says the file is not a database at all
/// or is damaged: not redb's bytes, emptied, or failing redb's checks. Not so for a
/// database held open elsewhere, an I/O error, or a sound database of another redb
/// file format (an older one, `UpgradeRequired`; a newer one, which redb reports as
/// corrupted, "Expected file format version"): written by another build, it may be
/// whole, and that build can still read it.
fn unreadable_as_a_database(e: &redb::DatabaseError) -> bool {
    use redb::{DatabaseError, StorageError};
    match e {
        DatabaseError::Storage(StorageError::Corrupted(why)) => !why.starts_with("Expected file format version"),
        DatabaseError::Storage(StorageError::Io(io)) => io.kind() == std::io::ErrorKind::InvalidData,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reset discards a file that is not a database, and refuses one of another redb
    /// file format, a newer one included (which redb reports as corrupted): written by
    /// another build, it may be whole.
    #[test]
    fn a_reset_discards_garbage_but_not_a_database_of_another_file_format() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        drop(StateDb::open(&path).unwrap());
        let sound = std::fs::read(&path).unwrap();
        // The file format version is the first byte of each of the two commit slots,
        // after the 64-byte header.
        for version in [1u8, 4] {
            let mut other = sound.clone();
            other[64] = version;
            other[64 + 128] = version;
            std::fs::write(&path, &other).unwrap();
            assert!(reset(&path).is_err(), "version {version}: discarded");
            assert_eq!(std::fs::read(&path).unwrap(), other, "version {version}: changed");
        }
        std::fs::write(&path, b"not a database").unwrap();
        let discarded = reset(&path).unwrap();
        assert!(discarded.unreadable.is_some());
        assert!(!path.exists());
    }

    /// A copy that does not fit in its directory (with the spare room) is refused with
    /// an error naming the directory and both sizes, before any byte is copied; one that
    /// fits passes.
    #[test]
    fn a_repaired_copy_larger_than_the_room_in_its_directory_is_refused_first() {
        let dir = tempfile::tempdir().unwrap();
        room_for_copy(dir.path(), 1).unwrap();
        let e = room_for_copy(dir.path(), u64::MAX / 2).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::StorageFull);
        let text = e.to_string();
        let parent = dir.path().parent().unwrap().display().to_string();
        assert!(text.contains(&format!("free in {parent} and")) && text.contains("TMPDIR"), "{text}");
        assert!(text.contains(&(u64::MAX / 2 + COPY_SPARE_BYTES).to_string()), "{text}");
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none(), "something was written");
    }

    /// `migrate` moves version 1 forward once, dropping the facts an older build could
    /// have made untrue; it leaves a current database alone, and refuses a version it has
    /// no step from, changing nothing.
    #[test]
    fn migrate_moves_version_1_forward_and_refuses_what_it_cannot_move() {
        use crate::idempotency::{META_KEYS_BELOW, META_KEYS_SCOPED_BY_ENDPOINT};
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.redb");
        let meta_of = |p: &Path| {
            let db = Database::open(p).unwrap();
            let txn = db.begin_read().unwrap();
            let meta = txn.open_table(META).unwrap();
            let get = |k| meta.get(k).unwrap().map(|v| v.value());
            (get(META_SCHEMA_VERSION), get(META_KEYS_BELOW), get(META_KEYS_SCOPED_BY_ENDPOINT))
        };
        {
            let db = StateDb::open(&p).unwrap();
            let d = db.db().unwrap();
            let txn = d.begin_write().unwrap();
            {
                let mut meta = txn.open_table(META).unwrap();
                meta.insert(META_KEYS_BELOW, 40).unwrap();
                meta.insert(META_KEYS_SCOPED_BY_ENDPOINT, 1).unwrap();
            }
            txn.commit().unwrap();
            db.force_schema_version(1).unwrap();
        }
        assert_eq!(meta_of(&p), (Some(1), Some(40), Some(1)));
        let Migration::Migrated { from, discarded } = migrate(&p).unwrap() else { panic!("not migrated") };
        assert_eq!((from, discarded.len()), (1, 2));
        assert_eq!(meta_of(&p), (Some(SCHEMA_VERSION), None, None));
        StateDb::open(&p).expect("a migrated database opens");
        assert_eq!(migrate(&p).unwrap(), Migration::AlreadyCurrent);
        assert_eq!(meta_of(&p), (Some(SCHEMA_VERSION), None, None));

        StateDb::open(&p).unwrap().force_schema_version(7).unwrap();
        assert!(matches!(migrate(&p), Err(StateError::SchemaMismatch { found: 7, .. })));
        assert_eq!(meta_of(&p).0, Some(7), "a refused migration changed the version");
        // A running daemon holds the database: refused.
        {
            let db = Database::open(&p).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(META).unwrap().insert(META_SCHEMA_VERSION, 1).unwrap();
            txn.commit().unwrap();
        }
        let held = Database::open(&p).unwrap();
        assert!(matches!(migrate(&p), Err(StateError::Open { .. })));
        drop(held);
        assert_eq!(meta_of(&p).0, Some(1));
    }

    #[test]
    fn new_database_gets_the_current_version_and_reopens() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.redb");
        let db = StateDb::open(&p).unwrap();
        assert_eq!(db.stored_schema_version().unwrap(), Some(SCHEMA_VERSION));
        drop(db);
        StateDb::open(&p).unwrap();
    }

    #[test]
    fn showing_what_a_database_holds_writes_nothing_to_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.redb");
        drop(StateDb::open(&p).unwrap());
        let before = std::fs::read(&p).unwrap();
        for _ in 0..2 {
            let inv = inventory(&p).unwrap();
            assert_eq!(inv.schema_version, Some(SCHEMA_VERSION));
        }
        assert!(std::fs::read(&p).unwrap() == before, "state show changed the database file");
    }

    #[test]
    fn reset_reports_what_it_discards_and_refuses_while_the_database_is_open() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.redb");
        let db = StateDb::open(&p).unwrap();
        db.force_schema_version(9).unwrap();
        assert!(reset(&p).is_err(), "a database held open must not be reset");
        drop(db);
        let inv = inventory(&p).unwrap();
        assert_eq!(inv.schema_version, Some(9));
        assert!(inv.tables.iter().any(|(n, c)| n == "meta" && *c == 1), "{inv:?}");
        assert_eq!(reset(&p).unwrap(), inv);
        assert!(!p.exists());
        StateDb::open(&p).unwrap();
    }

    /// A daemon starting while a reset runs must not open the file the reset is about to
    /// delete: it would run on a file no longer in the directory, and everything it
    /// stored (cursors, delivery ids, endpoints) would be gone at its next start.
    #[test]
    fn a_start_during_a_reset_never_gets_the_file_the_reset_deletes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.redb");
        drop(StateDb::open(&p).unwrap());
        let mut started = None;
        reset_on(&wal::storage::FsStorage, &p, |p| Database::open(p), || started = Some(StateDb::open(&p))).unwrap();
        match started.expect("the hook ran") {
            Err(_) => {}
            Ok(db) => {
                assert!(p.exists(), "the start opened the file the reset then deleted");
                drop(db);
            }
        }
        assert!(!p.exists(), "the reset left the file");
    }

    /// After an I/O error the database is reopened in place. If its file is gone by then
    /// (deleted by hand under the daemon), the reopen fails and keeps failing: setting up
    /// an empty database in its place would drop every delivery id and endpoint unsaid.
    #[test]
    fn a_reopen_never_sets_up_a_database_in_place_of_one_deleted() {
        use wal::storage::{FaultOp, SimStorage};
        let sim = SimStorage::new();
        let storage: Arc<dyn Storage> = Arc::new(sim.clone());
        let dir = Path::new("/sim/data");
        wal::storage::create_dir_all_durably(&*storage, dir).unwrap();
        let p = dir.join("state.redb");
        let db = StateDb::open_on(storage.clone(), &p).unwrap();
        sim.fail_nth(FaultOp::Write, 1, std::io::ErrorKind::Other);
        assert!(db.force_schema_version(SCHEMA_VERSION).is_err(), "the write fault did not fail the commit");
        storage.remove_file(&p).unwrap();
        storage.sync_dir(dir).unwrap();
        assert!(db.reopen_if_failed().is_err(), "a reopen set up a new database");
        assert!(db.reopen_if_failed().is_err());
        assert!(sim.list_dir(dir).unwrap().is_empty(), "{:?}", sim.list_dir(dir));
    }

    #[test]
    fn a_different_version_refuses_to_open_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.redb");
        StateDb::open(&p).unwrap().force_schema_version(SCHEMA_VERSION + 1).unwrap();
        match StateDb::open(&p) {
            Err(StateError::SchemaMismatch { found, expected, .. }) => {
                assert_eq!(found, SCHEMA_VERSION + 1);
                assert_eq!(expected, SCHEMA_VERSION);
            }
            other => panic!("expected a schema mismatch, got {other:?}"),
        }
    }

    /// A power loss before any one of the writes, syncs and directory changes of a
    /// reset, or of the start after it, never leaves the start that follows refused for
    /// a missing database (the log beside it was written): the database is there (the
    /// one the reset was to discard, or the empty one the start made), or the marker
    /// that lets that start create one is. Cut on the simulated disk, losing what was
    /// unsynced, or keeping any mix of the directory's unsynced changes (a removal kept,
    /// a creation lost). A reset that returned and the start after it leave an empty
    /// database and no marker.
    #[test]
    fn a_power_loss_during_a_reset_or_the_start_after_it_never_refuses_the_next_start() {
        use wal::storage::{CrashMode, FaultOp, SimStorage};
        let path = Path::new("/data/state.redb");
        let open_on = |sim: &SimStorage| {
            let sim = sim.clone();
            move |p: &Path| {
                let file = sim.open(p, OpenMode::ReadWrite).map_err(|e| redb::DatabaseError::Storage(e.into()))?;
                redb::Builder::new().create_with_backend(crate::state_storage::StorageFileBackend::new(file))
            }
        };
        // The start as the daemon makes it, beside a log written before.
        let start = |sim: &SimStorage| -> Result<StateDb, String> {
            open_beside_a_log_on(sim, path, 1, |p| StateDb::open_on(Arc::new(sim.clone()), p))
                .map_err(|e| e.to_string())?
                .ok_or_else(|| "refused: the database is missing beside a log written before".to_string())
        };
        let row = crate::CursorRow { source: "s".into(), stream: "st".into(), topic: "t".into(), delivered_below: 7 };
        for n in 1.. {
            let mut cut = false;
            for mode in [CrashMode::LoseUnsynced, CrashMode::Reordered { seed: n }] {
                let sim = SimStorage::new();
                wal::storage::create_dir_all_durably(&sim, Path::new("/data")).unwrap();
                let first = StateDb::open_on(Arc::new(sim.clone()), path).unwrap();
                first.store_cursors(std::slice::from_ref(&row)).unwrap();
                drop(first);
                sim.crash_at_nth(FaultOp::AnyMutation, n, mode);
                // The process's view of the disk: every call through it fails once the
                // power went (the test's own `sim` is the disk, which outlives it).
                let process = sim.clone();
                let reset = reset_on(&process, path, open_on(&process), || {});
                let started = reset.as_ref().map_err(|e| e.to_string()).and_then(|_| start(&process));
                if sim.crashes() == 0 {
                    let db = started.unwrap_or_else(|e| panic!("no cut: the reset or the start failed: {e}"));
                    assert_eq!(db.load_cursors().unwrap(), vec![], "the reset kept a cursor");
                    assert!(sim.open(&reset_marker(path), OpenMode::Read).is_err(), "the start left the marker");
                    continue;
                }
                cut = true;
                drop(started);
                sim.disarm();
                let disk = sim.fork();
                let case = format!(
                    "cut before mutation {n} ({mode:?}; the reset {})",
                    match &reset {
                        Ok(_) => "returned",
                        Err(_) => "failed",
                    }
                );
                let db = start(&disk).unwrap_or_else(|e| panic!("{case}: the next start: {e}"));
                let cursors = db.load_cursors().unwrap();
                assert!(cursors.is_empty() || cursors == vec![row.clone()], "{case}: {cursors:?}");
                if reset.is_ok() {
                    assert!(cursors.is_empty(), "{case}: a reset that returned came back");
                }
            }
            if !cut {
                assert!(n > 1, "the reset made no mutation");
                return;
            }
            assert!(n < 1_000, "the reset never ran to its end");
        }
    }
}
