//! Structured logs through `tracing`: text or JSON on stderr, the level from the
//! configuration unless `RUST_LOG` is set.
//!
//! The `iggy` client's own messages are off unless the configured level or `RUST_LOG`
//! names the `iggy` target: it logs every failed connection attempt at error level,
//! which during an outage repeats the router's own account (status transitions with
//! their reason, the last error on `/connectors/{key}/destinations`) once per retry.
//!
//! Invariant: installing twice is harmless (the second call does nothing).

use tracing_subscriber::EnvFilter;

/// The filter for a configured level: the level itself, with the client's messages off
/// unless the level names them.
pub fn filter_for(level: &str) -> String {
    if level.contains("iggy=") { level.to_string() } else { format!("{level},iggy=off") }
}

pub fn init(level: &str, json: bool) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(filter_for(level)))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_client_is_quiet_unless_asked_for() {
        assert_eq!(filter_for("info"), "info,iggy=off");
        assert_eq!(filter_for("warn,iggy=debug"), "warn,iggy=debug");
        assert!(EnvFilter::try_new(filter_for("info,iggy_ingest=debug")).is_ok());
    }
}
