//! The daemon under test: `e2e-daemon --config FILE --ready-file FILE` runs the runtime
//! library's `run::run`, the very function `iggy-ingest run` calls (logging, metrics
//! recorder, `daemon::start`, ready file, SIGTERM/SIGINT for a graceful stop). It exists
//! because a test can only start a binary of its own package, and because in this
//! package's test builds the daemon carries the fail points (`crates/fail-points`,
//! feature `enabled`).

use std::path::PathBuf;
use std::process::ExitCode;

use runtime::config;

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut config_path, mut ready_file) = (None, None);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--config" => config_path = args.next().map(PathBuf::from),
            "--ready-file" => ready_file = args.next().map(PathBuf::from),
            other => {
                eprintln!("e2e-daemon: unknown argument {other}");
                return ExitCode::from(2);
            }
        }
    }
    let Some(config_path) = config_path else {
        eprintln!("e2e-daemon: --config FILE is required");
        return ExitCode::from(2);
    };
    let settings = match config::load(&config_path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    runtime::run::run(settings, ready_file)
}
