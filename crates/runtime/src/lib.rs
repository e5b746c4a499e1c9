//! The `iggy-ingest` daemon: configuration, listeners, admin API, metrics and signals.
//!
//! The binary (`src/main.rs`) is a thin command line over this library, so tests can
//! run the daemon in-process ([`daemon::start`]) as well as the built binary.

pub mod admin;
pub mod config;
pub mod daemon;
pub mod delivery;
pub mod host_port;
pub mod logging;
pub mod mapping_fetch;
pub mod open_files;
pub mod run;
pub mod telemetry;
mod toml_lines;
pub mod wal_cli;
