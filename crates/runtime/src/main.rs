//! The `iggy-ingest` command line: `run`, `config check`, `config default`,
//! `state show`, `state reset`, and the read-only log tools `wal inspect|dump|tail|verify|salvage`
//! (`src/wal_cli/`, whose exit codes are its own: 0 done, 1 damage found, 2 unusable
//! arguments).
//!
//! Exit codes: 0 after a clean run or a valid config; 1 for a failed start or an
//! unclean shutdown; 2 for an invalid configuration or command line (clap's own);
//! 130 when a second SIGTERM/SIGINT cut the drain short.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use iggy_ingest::config::{self, Config, Settings};
use iggy_ingest::{daemon, logging};

#[derive(Debug, Parser)]
#[command(name = "iggy-ingest", version, about = "Lossless webhook ingestion into Apache Iggy")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the daemon (on the built-in default configuration without --config).
    Run {
        /// A TOML configuration file (see config/example.toml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Once both listeners are bound, write their addresses here as JSON
        /// (`{"http": "...", "admin": "...", "pid": N}`), atomically.
        #[arg(long)]
        ready_file: Option<PathBuf>,
    },
    /// Configuration tools.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Read-only tools over a log directory (DATA_DIR/wal); safe beside a running daemon.
    Wal {
        #[command(subcommand)]
        command: iggy_ingest::wal_cli::WalCommand,
    },
    /// The state database (DATA_DIR/state.redb) of a stopped daemon.
    State {
        #[command(subcommand)]
        command: StateCommand,
    },
}

#[derive(Debug, Subcommand)]
enum StateCommand {
    /// Show the schema version and what each table holds (any schema version).
    Show {
        /// The daemon's storage.data_dir.
        #[arg(long)]
        data_dir: PathBuf,
    },
    /// Discard the state database, saying what is lost. The log is not touched.
    /// Without --yes nothing is changed.
    Reset {
        #[arg(long)]
        data_dir: PathBuf,
        /// Really delete it.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Validate a configuration file without starting; errors name key path and line.
    Check { file: PathBuf },
    /// Print the built-in default configuration.
    Default,
}

const DEFAULT_TOML: &str = include_str!("../../../config/default.toml");

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Config { command: ConfigCommand::Check { file } } => match config::load(&file) {
            Ok(s) => {
                println!(
                    "{}: ok ({} source(s), {} static endpoint(s))",
                    file.display(),
                    s.sources.len(),
                    s.endpoints.len()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(2)
            }
        },
        Command::Config { command: ConfigCommand::Default } => {
            print!("{DEFAULT_TOML}");
            ExitCode::SUCCESS
        }
        Command::State { command } => state_command(command),
        Command::Wal { command } => iggy_ingest::wal_cli::run(command),
        Command::Run { config, ready_file } => {
            let settings = match &config {
                Some(path) => config::load(path),
                None => config::validate(&Config::builtin(), None, None),
            };
            let settings = match settings {
                Ok(s) => s,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            run(settings, ready_file)
        }
    }
}

fn state_command(command: StateCommand) -> ExitCode {
    let (data_dir, yes, reset) = match command {
        StateCommand::Show { data_dir } => (data_dir, false, false),
        StateCommand::Reset { data_dir, yes } => (data_dir, yes, true),
    };
    let path = data_dir.join("state.redb");
    let result = if reset && yes { ingest::state::reset(&path) } else { ingest::state::inventory(&path) };
    let inventory = match result {
        Ok(i) => i,
        Err(e) => {
            eprintln!("iggy-ingest: {e}");
            return ExitCode::FAILURE;
        }
    };
    let version = inventory.schema_version.map_or("none".to_string(), |v| v.to_string());
    println!("{}: schema version {version} (this build: {})", path.display(), ingest::SCHEMA_VERSION);
    for line in inventory.consequences() {
        println!("  {line}");
    }
    match (reset, yes) {
        (true, true) => println!("deleted {}; the next start creates a new one", path.display()),
        (true, false) => println!("nothing changed: pass --yes to discard the above"),
        _ => {}
    }
    ExitCode::SUCCESS
}

fn run(settings: Settings, ready_file: Option<PathBuf>) -> ExitCode {
    logging::init(&settings.log_level, settings.log_json);
    let metrics = match iggy_ingest::telemetry::install() {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::warn!(error = %e, "metrics recorder not installed; /metrics answers 404");
            None
        }
    };
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
                tracing::error!(error = %e, "start failed");
                eprintln!("iggy-ingest: {e}");
                if let daemon::StartError::State(ingest::StateError::SchemaMismatch { .. }) = e {
                    eprintln!(
                        "iggy-ingest: `iggy-ingest state show --data-dir DIR` shows what the database holds; \
                         `iggy-ingest state reset --data-dir DIR --yes` discards it (the log is kept)"
                    );
                }
                return ExitCode::FAILURE;
            }
        };
        if let Some(path) = ready_file
            && let Err(e) = write_ready_file(&path, &running)
        {
            tracing::error!(error = %e, path = %path.display(), "cannot write the ready file");
            running.shutdown();
            running.wait().await;
            return ExitCode::FAILURE;
        }
        wait_for_signal().await;
        running.shutdown();
        // A second signal stops at once. Safe: every event answered 200 is already
        // durable in the log; only requests still in flight are cut (without a 200).
        tokio::spawn(async {
            wait_for_signal().await;
            eprintln!("iggy-ingest: second signal, exiting without waiting for the drain");
            std::process::exit(130);
        });
        let report = running.wait().await;
        // Connections still open after the grace period were cut without a 200, so
        // nothing they carried was acknowledged: that alone is not a failure.
        if !report.drained {
            tracing::warn!("some connections were still open after the grace period and were closed");
        }
        if report.wal_closed.is_ok() && report.checkpoint.is_ok() {
            ExitCode::SUCCESS
        } else {
            eprintln!("iggy-ingest: unclean shutdown: {report:?}");
            ExitCode::FAILURE
        }
    })
}

fn write_ready_file(path: &std::path::Path, running: &daemon::RunningDaemon) -> std::io::Result<()> {
    let body = serde_json::json!({
        "http": running.http_addr.to_string(),
        "admin": running.admin_addr.to_string(),
        "pid": std::process::id(),
    });
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, body.to_string())?;
    std::fs::rename(&tmp, path)
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int) = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            tracing::error!("cannot install signal handlers; waiting for Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}
