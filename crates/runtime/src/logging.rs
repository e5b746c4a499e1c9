//! Structured logs through `tracing`: text or JSON on stderr, the level from the
//! configuration unless `RUST_LOG` is set.
//!
//! Invariant: installing twice is harmless (the second call does nothing).

use tracing_subscriber::EnvFilter;

pub fn init(level: &str, json: bool) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}
