//! Structured logs through `tracing`: text or JSON on stderr, the level from the
//! configuration unless `RUST_LOG` is set. Text is coloured only when stderr is a
//! terminal.
//!
//! The `iggy` client's own messages are off unless the configured level or `RUST_LOG`
//! names the `iggy` target: it logs every failed connection attempt at error level,
//! which during an outage repeats the router's own account (status transitions with
//! their reason, the last error on `/connectors/{key}/destinations`) once per retry.
//!
//! Invariant: installing twice is harmless (the second call does nothing).

use tracing_subscriber::EnvFilter;

/// The `iggy` client's targets. A filter directive matches a target by prefix, so the
/// client's own crate is named with its path separator: a bare `iggy` would also
/// silence this daemon's `iggy_ingest` targets.
const CLIENT_TARGETS: [&str; 3] = ["iggy::", "iggy_common", "iggy_binary_protocol"];

/// The filter for a configured level: the level itself, with the client's messages off
/// unless the level names them.
pub fn filter_for(level: &str) -> String {
    let names_client = level.split(',').any(|directive| {
        let target = directive.split(['=', '[']).next().unwrap_or("");
        target == "iggy" || CLIENT_TARGETS.iter().any(|t| target.starts_with(t))
    });
    if names_client {
        level.to_string()
    } else {
        let off: Vec<String> = CLIENT_TARGETS.iter().map(|t| format!("{t}=off")).collect();
        format!("{level},{}", off.join(","))
    }
}

pub fn init(level: &str, json: bool) {
    // RUST_LOG, when set and valid, takes the configured level's place: through the same
    // filter, so the client stays quiet there too unless it is named.
    let from_env = std::env::var(EnvFilter::DEFAULT_ENV).ok().filter(|v| EnvFilter::try_new(v).is_ok());
    let filter = EnvFilter::try_new(filter_for(from_env.as_deref().unwrap_or(level)))
        .unwrap_or_else(|_| EnvFilter::new(filter_for("info")));
    // Colours only for a terminal: a journal, a file or a log shipper gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::{Arc, Mutex};

    /// What a subscriber with the filter for `level` writes of one message per target.
    fn written(level: &str, targets: &[&str]) -> String {
        let out = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(EnvFilter::try_new(filter_for(level)).unwrap())
            .with_writer(move || Writer(sink.clone()))
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            for t in targets {
                // The macros take a constant target: one arm per target used below.
                match *t {
                    "iggy_ingest::daemon" => tracing::info!(target: "iggy_ingest::daemon", "from iggy_ingest::daemon"),
                    "router::status" => tracing::info!(target: "router::status", "from router::status"),
                    "iggy::tcp::tcp_client" => {
                        tracing::error!(target: "iggy::tcp::tcp_client", "from iggy::tcp::tcp_client")
                    }
                    "iggy_common::error" => tracing::error!(target: "iggy_common::error", "from iggy_common::error"),
                    other => unreachable!("{other}"),
                }
            }
        });
        String::from_utf8(out.lock().unwrap().clone()).unwrap()
    }

    struct Writer(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Writer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The daemon's own messages pass at the configured level; the client's are off
    /// unless the level names them.
    #[test]
    fn the_client_is_quiet_unless_asked_for_and_the_daemon_is_not() {
        let all = ["iggy_ingest::daemon", "router::status", "iggy::tcp::tcp_client", "iggy_common::error"];
        let out = written("info", &all);
        assert!(out.contains("from iggy_ingest::daemon") && out.contains("from router::status"), "{out}");
        assert!(!out.contains("from iggy::") && !out.contains("from iggy_common"), "{out}");
        let out = written("warn,iggy=debug", &all);
        assert!(out.contains("from iggy::tcp::tcp_client") && !out.contains("from router::status"), "{out}");
        let out = written("info,iggy_ingest=warn", &all);
        assert!(!out.contains("from iggy_ingest::daemon") && out.contains("from router::status"), "{out}");
        assert!(!out.contains("from iggy::"), "{out}");
    }
}
