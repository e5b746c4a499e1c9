//! The daemon under test: `e2e-daemon --config FILE --ready-file FILE` starts the runtime
//! library exactly as `iggy-ingest run` does (logging, metrics recorder, `daemon::start`,
//! ready file, SIGTERM/SIGINT for a graceful stop). It exists because a test can only
//! start a binary of its own package, and because in this package's test builds the
//! daemon carries the fail points (`crates/fail-points`, feature `enabled`).

use std::path::PathBuf;
use std::process::ExitCode;

use runtime::{config, daemon, logging};

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
    logging::init(&settings.log_level, settings.log_json);
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder().ok();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let running = match daemon::start(settings, metrics).await {
            Ok(r) => r,
            Err(e) => {
                eprintln!("e2e-daemon: {e}");
                return ExitCode::FAILURE;
            }
        };
        if let Some(path) = ready_file {
            let body = serde_json::json!({
                "http": running.http_addr.to_string(),
                "admin": running.admin_addr.to_string(),
                "pid": std::process::id(),
            });
            let tmp = path.with_extension("tmp");
            if let Err(e) = std::fs::write(&tmp, body.to_string()).and_then(|()| std::fs::rename(&tmp, &path)) {
                eprintln!("e2e-daemon: cannot write the ready file: {e}");
                running.shutdown();
                running.wait().await;
                return ExitCode::FAILURE;
            }
        }
        wait_for_signal().await;
        running.shutdown();
        let report = running.wait().await;
        if report.wal_closed.is_ok() && report.checkpoint.is_ok() {
            ExitCode::SUCCESS
        } else {
            eprintln!("e2e-daemon: unclean shutdown: {report:?}");
            ExitCode::FAILURE
        }
    })
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
