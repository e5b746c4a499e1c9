//! The `iggy-ingest` daemon: configuration, listeners, admin API, metrics and signals.
//!
//! The binary (`src/main.rs`) is a thin command line over this library, so tests can
//! run the daemon in-process ([`daemon::start`]) as well as the built binary.

/// `eprintln!` that never panics: a standard error that cannot be written (closed, or a
/// pipe whose reader went away: `2>&1 | head -1`) loses the line and changes nothing
/// else, so the process still exits with its own code, not 101.
#[macro_export]
macro_rules! say_on_stderr {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}
pub mod admin;
pub mod config;
pub mod daemon;
pub mod delivery;
pub mod host_port;
pub mod logging;
pub mod mapping_fetch;
pub mod open_files;
pub mod regular_file;
pub mod run;
pub mod telemetry;
pub mod terminal_text;
mod toml_lines;
pub mod wal_cli;
