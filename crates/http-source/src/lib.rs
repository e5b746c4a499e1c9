//! The webhook source: HTTP listener, auth schemes, body decoding and endpoints.
//!
//! ```text
//!  TCP ─▶ server (connection cap, header/idle timeout, graceful drain)
//!        ─▶ host (a Host header as HTTP/1.1 asks)
//!        ─▶ door (route ─▶ size/timeout ─▶ auth ─▶ room ─▶ endpoint re-check (auth again if rotated) ─▶ content type ─▶ delivery id ─▶ decode ─▶ resolve destinations)
//!        ─▶ ingest::Ingestor
//! ```
//!
//! Invariant of the whole crate: a request is answered 200 only after the ingest core
//! reported its events durable; every other answer appends nothing.

pub mod admission;
pub mod auth;
pub mod body;
pub mod door;
pub mod endpoints;
pub mod error;
pub mod field_path;
pub mod health;
pub mod host;
pub mod json_fields;
pub mod metrics;
pub mod partition;
pub mod resolve;
pub mod route;
pub mod server;
pub mod source;
pub mod status;
pub mod tls;

pub use auth::AuthScheme;
pub use body::Accept;
pub use door::{Door, DoorLimits, router};
pub use endpoints::{Endpoint, EndpointRegistry};
pub use source::{Destinations, MetadataFields, SourceSpec};
