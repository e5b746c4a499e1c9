//! Structured logs through `tracing`: text or JSON on stderr, the level from the
//! configuration unless `RUST_LOG` is set (a `RUST_LOG` with no level for every target
//! is added to it; an empty one counts as unset: [`effective_filter`]). Text is coloured
//! only when stderr is a terminal.
//!
//! Each of the `iggy` client's targets is off unless the configured level or `RUST_LOG`
//! names all of it (or `iggy`, all of them): it logs every failed connection attempt at error level,
//! which during an outage repeats the router's own account (status transitions with
//! their reason, the last error on `/connectors/{key}/destinations`) once per retry.
//!
//! Invariant: installing twice is harmless (the second call does nothing).

use tracing_subscriber::EnvFilter;

/// The `iggy` client's targets. A filter directive matches a target by prefix, so the
/// client's own crate is named with its path separator: a bare `iggy` would also
/// silence this daemon's `iggy_ingest` targets.
const CLIENT_TARGETS: [&str; 3] = ["iggy::", "iggy_common", "iggy_binary_protocol"];

/// `filter` as `tracing-subscriber` 0.3 parses it without fault: each comma-separated
/// directive trimmed, empty ones left out. Its directive parser trims a directive for one
/// step and indexes the untrimmed text in the next, so a space after a comma refuses an
/// ordinary filter (`"info, iggy_ingest=debug"`) and, before a character of more than one
/// byte, panics. (It splits on every comma too, so this changes no directive's meaning.)
pub fn normalized(filter: &str) -> String {
    filter.split(',').map(str::trim).filter(|d| !d.is_empty()).collect::<Vec<_>>().join(",")
}

/// `filter`, normalized, as a filter; the parser's own words when it is none.
pub fn parse(filter: &str) -> Result<EnvFilter, String> {
    EnvFilter::try_new(normalized(filter)).map_err(|e| e.to_string())
}

/// Whether `filter` sets a level for every target (a directive that is a level alone,
/// as in `"warn,iggy_ingest=debug"`). Without one, only the targets it names log at all,
/// errors of every other included: a misspelt level (`"inof"`) is such a target name.
pub fn sets_default_level(filter: &str) -> bool {
    // An empty directive is a level to `LevelFilter` (error), but no directive to a filter.
    normalized(filter).split(',').any(|d| !d.is_empty() && d.parse::<tracing_subscriber::filter::LevelFilter>().is_ok())
}

/// The level every target gets from a configured level that sets none (`"inof"`, a
/// misspelt level, is a target name to the parser; `"iggy_ingest=debug"` names one
/// target): without it the daemon's other targets, errors included, and the
/// configuration's warning that says so, would not be written.
pub const LEVEL_WHERE_NONE_IS_SET: &str = "warn";

/// The filter for a configured level: the level itself ([`LEVEL_WHERE_NONE_IS_SET`] for
/// every target it does not set), with each of the client's targets off unless the
/// level names it (or `iggy`, all of them).
pub fn filter_for(level: &str) -> String {
    let level = normalized(level);
    let level = match sets_default_level(&level) {
        true => level,
        false if level.is_empty() => LEVEL_WHERE_NONE_IS_SET.to_string(),
        false => format!("{LEVEL_WHERE_NONE_IS_SET},{level}"),
    };
    let named: Vec<&str> = level.split(',').map(|directive| directive.split(['=', '[']).next().unwrap_or("")).collect();
    let off: Vec<String> = CLIENT_TARGETS
        .iter()
        // A directive names the targets its own starts (a filter matches by prefix): one
        // that covers all of `t` turns `t` on; one for a part of it (`iggy::clients`) is
        // more specific than `t=off`, and wins for that part alone.
        .filter(|t| {
            !named.iter().any(|target| {
                !target.is_empty()
                    && (*target == "iggy" || t.trim_end_matches("::").starts_with(target.trim_end_matches("::")))
            })
        })
        .map(|t| format!("{t}=off"))
        .collect();
    if off.is_empty() { level } else { format!("{level},{}", off.join(",")) }
}

/// The filter the daemon logs by, from the configured `level` and `RUST_LOG`'s value
/// (`env`), and why `RUST_LOG` was left out, when it was not a filter. `RUST_LOG`, when it
/// is a filter, wins for what it names; one that sets no level for every target
/// (`hyper=debug`) is added to the configured level, which stays the level of every
/// other target: alone it would silence the daemon's own errors, and the warning that
/// would say so. An empty one (`RUST_LOG=` in a unit or compose file) counts as unset.
pub fn effective_filter(level: &str, env: Option<&str>) -> (String, Option<String>) {
    let Some(value) = env.filter(|v| !normalized(v).is_empty()) else {
        return (filter_for(level), None);
    };
    match parse(value) {
        Err(why) => (filter_for(level), Some(why)),
        Ok(_) if sets_default_level(value) => (filter_for(value), None),
        Ok(_) => (filter_for(&format!("{},{}", normalized(level), normalized(value))), None),
    }
}

pub fn init(level: &str, json: bool) {
    let env = std::env::var(EnvFilter::DEFAULT_ENV).ok();
    let (filter, refused) = effective_filter(level, env.as_deref());
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new(filter_for("info")));
    // Colours only for a terminal: a journal, a file or a log shipper gets plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    let _ = if json { builder.json().try_init() } else { builder.try_init() };
    if let (Some(value), Some(why)) = (&env, refused) {
        // Said on stderr where the configured level writes no warning (`error`, `off`):
        // a RUST_LOG that does nothing must not pass unsaid.
        if tracing::enabled!(tracing::Level::WARN) {
            tracing::warn!(rust_log = %value, error = %why, level, "RUST_LOG is not a filter: the configured level is used");
        } else {
            crate::say_on_stderr!(
                "iggy-ingest: RUST_LOG {value:?} is not a filter ({why}): the configured level {level:?} is used"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tracing-subscriber`'s parser refuses the first and panics on the second as they
    /// are; normalized, both are filters, the second with its target named as written.
    #[test]
    fn spaces_after_commas_are_taken_as_the_filter_means_them_and_never_panic() {
        for (given, target) in
            [("info, iggy_ingest=debug", "iggy_ingest"), ("info, é=debug", "é"), (" warn ,, x=info ", "x")]
        {
            let filter = parse(given).unwrap_or_else(|e| panic!("{given:?}: {e}"));
            assert!(filter.to_string().contains(target), "{given:?} became {filter}");
        }
        assert!(parse("info,=x=").is_err());
    }

    #[test]
    fn a_filter_without_a_level_for_every_target_is_told_apart() {
        for given in ["info", "warn,iggy_ingest=debug", "iggy_ingest=debug, error", "off"] {
            assert!(sets_default_level(given), "{given:?}");
        }
        // A typo is a target name to the parser: everything else would be silent.
        for given in ["inof", "iggy_ingest=debug", "", " , "] {
            assert!(!sets_default_level(given), "{given:?}");
        }
    }

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

    /// `RUST_LOG` wins for what it names; without a level for every target it is added
    /// to the configured level, and empty it counts as unset: never a filter that
    /// silences the daemon's own messages. Taken alone, `RUST_LOG=` and
    /// `RUST_LOG=hyper=debug` left every daemon line, errors included, unwritten.
    #[test]
    fn rust_log_never_silences_the_daemon_unless_it_says_so() {
        let daemon = ["iggy_ingest::daemon", "router::status"];
        let logs_the_daemon = |env: Option<&str>| {
            let (filter, refused) = effective_filter("info", env);
            assert_eq!(refused, None, "{env:?}");
            let out = written(&filter, &daemon);
            out.contains("from iggy_ingest::daemon") && out.contains("from router::status")
        };
        for env in [None, Some(""), Some(" , "), Some("hyper=debug"), Some("info"), Some("iggy_ingest=debug")] {
            assert!(logs_the_daemon(env), "{env:?}");
        }
        // What RUST_LOG sets for every target, or for a target it names, it sets.
        assert!(!logs_the_daemon(Some("warn")));
        assert!(!logs_the_daemon(Some("iggy_ingest=warn,router=warn")));
        let (filter, refused) = effective_filter("info", Some("info,=x="));
        assert!(refused.is_some(), "{filter}");
        assert_eq!(filter, filter_for("info"));
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
        // Naming one of the client's targets turns that one on, not the others; naming a
        // part of one turns on that part alone.
        let out = written("info,iggy_common=error", &all);
        assert!(out.contains("from iggy_common::error") && !out.contains("from iggy::"), "{out}");
        let out = written("info,iggy::clients=debug", &all);
        assert!(!out.contains("from iggy::tcp::tcp_client") && !out.contains("from iggy_common"), "{out}");
        let out = written("info,iggy_common::other=off", &all);
        assert!(!out.contains("from iggy_common::error"), "{out}");
    }

    /// A configured level that sets none for every target (a misspelt one is a target
    /// name to the parser) leaves the daemon's other targets at warn: their errors, and
    /// the configuration's warning that says so, are written. Before, nothing was.
    #[test]
    fn a_level_that_sets_none_for_every_target_leaves_the_rest_at_warn() {
        let out = Arc::new(Mutex::new(Vec::<u8>::new()));
        let sink = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter(EnvFilter::try_new(filter_for("warning")).unwrap())
            .with_writer(move || Writer(sink.clone()))
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::warn!(target: "iggy_ingest::run", "a warning of the daemon");
            tracing::error!(target: "router::status", "an error of the router");
            tracing::info!(target: "iggy_ingest::daemon", "an info line");
        });
        let out = String::from_utf8(out.lock().unwrap().clone()).unwrap();
        assert!(out.contains("a warning of the daemon") && out.contains("an error of the router"), "{out}");
        assert!(!out.contains("an info line"), "{out}");
        assert!(filter_for("iggy_ingest=debug").starts_with("warn,iggy_ingest=debug"));
        assert!(filter_for("info").starts_with("info,"));
    }
}
