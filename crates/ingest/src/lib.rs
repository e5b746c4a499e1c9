//! The ingest core: turns an accepted request into log records, and keeps the daemon's
//! state beside the log.
//!
//! ```text
//!  Submission ──▶ Ingestor::accept ──▶ idempotency lookup ──▶ envelope per event ──▶ wal.append (one batch)
//!                                                                                   │ resolved = durable
//!                                       idempotency record (redb) ◀────────────────┘
//! ```
//!
//! Invariants:
//! - An `Ok` from [`Ingestor::accept`] means every event of the submission is durable in
//!   the log as one atomic batch; an `Err` means nothing of it was appended.
//! - Every record is an [`Envelope`] carrying its resolved destination, so re-reading the
//!   log routes each record as it was accepted.
//! - All daemon state lives in one redb database ([`StateDb`]) with a schema version; a
//!   different version refuses to open.

pub mod cursors;
pub mod endpoints;
pub mod envelope;
pub mod idempotency;
pub mod ingestor;
pub mod log_limit;
pub mod secret;
pub mod state;
pub mod state_storage;
pub mod time;

pub use cursors::{CursorRow, CursorsSnapshot, read_cursors_read_only};
pub use endpoints::{EndpointRecord, KeyedRegistration, StoredAuth, UnreadableEndpoint};
pub use envelope::{
    Destination, Envelope, EnvelopeError, EnvelopeHeader, EnvelopeHeaderRef, MetadataRef, MetadataValue, Partitioning,
};
pub use idempotency::{IdempotencyIndex, IdempotencyKey, RebuildReport};
pub use ingestor::{Accepted, Event, IngestError, Ingestor, Submission};
pub use state::{SCHEMA_VERSION, StateDb, StateError};
