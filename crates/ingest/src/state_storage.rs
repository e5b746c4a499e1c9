//! redb over the log's storage layer ([`wal::storage::Storage`]), so that the state
//! database can live on any storage the log runs on. With the simulated disk
//! (`wal::storage::SimStorage`) one power loss takes the log and the state database at
//! the same instant, as it does on a real machine, and the crash tests check the two
//! against each other.
//!
//! Invariants:
//! - Every call passes through unchanged: `read` fills exactly the bytes asked for (a
//!   read past the end is an error, as redb requires), `write` writes all of them, and
//!   `sync_data` is the storage's, which makes the written bytes and the length durable:
//!   redb's durable commit (one sync after its checksummed pages) rests on that alone.
//! - No byte-range locks: redb then admits one writer per open database, which is how
//!   the state database is used. On the real file system the daemon opens the database
//!   with redb's own file backend ([`crate::StateDb::open`]), which also locks the file
//!   against a second process.

use std::io;
use std::sync::Arc;

use wal::storage::StorageFile;

/// A file of the log's storage layer as redb's storage backend.
#[derive(Debug)]
pub struct StorageFileBackend {
    file: Arc<dyn StorageFile>,
}

impl StorageFileBackend {
    pub fn new(file: Arc<dyn StorageFile>) -> StorageFileBackend {
        StorageFileBackend { file }
    }
}

impl redb::StorageBackend for StorageFileBackend {
    fn len(&self) -> io::Result<u64> {
        self.file.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        wal::storage::read_exact_at(&*self.file, out, offset)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, offset)
    }
}
