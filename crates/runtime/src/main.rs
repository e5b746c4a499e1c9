//! The `iggy-ingest` command line: `run`, `config check`, `config default`,
//! `state show`, `state migrate`, `state reset`, and the read-only log tools `wal inspect|dump|tail|verify|salvage`
//! (`src/wal_cli/`, whose exit codes are its own: 0 done, 1 damage found, 2 unusable
//! arguments, 3 busy).
//!
//! Exit codes: 0 after a clean run or a valid config; 1 for a failed start or an
//! unclean shutdown; 2 for an invalid configuration or command line (clap's own), or a
//! start refusal only an operator can end; 130 when a second SIGTERM/SIGINT cut the
//! start or the drain short.

use std::path::PathBuf;

/// mimalloc, not the system allocator. Under load every record crosses threads: the
/// HTTP workers allocate it and the log's writer thread frees it. glibc's malloc then
/// contends on the workers' arena locks: 0.55 futex calls per request with glibc, 0.05
/// with mimalloc (whose frees from other threads take no lock), and, in five paired
/// load runs, 3 to 20 % more events/s (docs/performance.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use iggy_ingest::config::{self, Config};
use iggy_ingest::wal_cli::write_out;

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
    /// Tools over a log directory (DATA_DIR/wal); all but `salvage` are read-only and safe beside a running daemon.
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
    /// Move a state database of an older schema version to this build's, saying what
    /// the step discards. The log is not touched.
    Migrate {
        /// The daemon's storage.data_dir.
        #[arg(long)]
        data_dir: PathBuf,
    },
    /// Forget what the state database holds of its log (delivery cursors, delivery ids,
    /// the log's identity), keeping endpoints and revocations, so that the next start
    /// takes the log beside it as its own: for a log that was replaced, or deleted and
    /// begun again. Without --yes nothing is changed.
    ForgetLog {
        /// The daemon's storage.data_dir.
        #[arg(long)]
        data_dir: PathBuf,
        /// Really forget it.
        #[arg(long)]
        yes: bool,
    },
    /// Discard the state database, saying what is lost. The log is not touched.
    /// Without --yes nothing is changed.
    Reset {
        /// The daemon's storage.data_dir.
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
                // Valid, but likely not what was meant: on stderr, so `ok` stays the
                // one line a script reads from stdout.
                for w in &s.warnings.errors {
                    iggy_ingest::say_on_stderr!("{}: warning: {w}", file.display());
                }
                write_out(&format!(
                    "{}: ok ({} source(s), {} static endpoint(s))\n",
                    file.display(),
                    s.sources.len(),
                    s.endpoints.len()
                ))
            }
            Err(e) => {
                iggy_ingest::say_on_stderr!("{e}");
                ExitCode::from(2)
            }
        },
        Command::Config { command: ConfigCommand::Default } => write_out(DEFAULT_TOML),
        Command::State { command } => state_command(command),
        Command::Wal { command } => iggy_ingest::wal_cli::run(command),
        Command::Run { config, ready_file } => {
            // SIGHUP's default action ends the process. It reloads the TLS certificates
            // once `run` installs its handler; until then (the configuration and its
            // certificate files being read) it is ignored: the start reads the files
            // again after the handler is in place, so nothing a reload would bring is lost.
            // SAFETY: setting a signal's disposition to ignore, before any thread exists.
            unsafe {
                libc::signal(libc::SIGHUP, libc::SIG_IGN);
            }
            let settings = match &config {
                Some(path) => config::load(path),
                None => config::validate(&Config::builtin(), None, None),
            };
            let settings = match settings {
                Ok(s) => s,
                Err(e) => {
                    iggy_ingest::say_on_stderr!("{e}");
                    return ExitCode::from(2);
                }
            };
            iggy_ingest::run::run(settings, ready_file)
        }
    }
}

fn state_command(command: StateCommand) -> ExitCode {
    let (data_dir, yes, reset) = match &command {
        StateCommand::Show { data_dir } | StateCommand::Migrate { data_dir } => (data_dir, false, false),
        StateCommand::Reset { data_dir, yes } => (data_dir, *yes, true),
        StateCommand::ForgetLog { data_dir, yes } => (data_dir, *yes, false),
    };
    let path = data_dir.join("state.redb");
    // An argument that names no database is a command-line error (2), like the log
    // tools' unusable arguments; a database that cannot be read is a failure (1).
    match std::fs::metadata(&path) {
        Ok(m) if m.is_file() => {}
        // Nothing a state command could open, change or delete: an operator moves it.
        Ok(m) => {
            let kind = ingest::state::not_a_regular_file(m.file_type()).unwrap_or("not a regular file");
            iggy_ingest::say_on_stderr!(
                "iggy-ingest: {} is {kind}, not a state database: move it away first (nothing was changed)",
                path.display()
            );
            return ExitCode::from(2);
        }
        Err(e) if !iggy_ingest::wal_cli::is_not_there(&e) => {
            // It may well exist: a data directory of mode 0750 seen by another user.
            iggy_ingest::say_on_stderr!("iggy-ingest: {}", iggy_ingest::wal_cli::cannot_look_at(&path, &e));
            return ExitCode::FAILURE;
        }
        // A reset of a database that is gone says that an empty one is wanted: a start
        // beside a log written before refuses to create one otherwise.
        // (Only beside a log: elsewhere --data-dir is more likely mistyped.)
        _ if reset && data_dir.join(config::WAL_DIR_NAME).is_dir() => {
            return reset_a_missing_database(data_dir, &path, yes);
        }
        _ => {
            iggy_ingest::say_on_stderr!(
                "iggy-ingest: no state database at {} (is --data-dir the daemon's storage.data_dir?)",
                path.display()
            );
            return ExitCode::from(2);
        }
    }
    // A command that changes the database first locks out the daemon (and keeps it out
    // until done), so that neither a running one nor one starting meanwhile can meet a
    // database being deleted or migrated.
    let changes =
        matches!(command, StateCommand::Migrate { .. } | StateCommand::ForgetLog { yes: true, .. }) || (reset && yes);
    let _daemon_locked_out = match changes.then(|| lock_out_the_daemon(data_dir)).transpose() {
        Ok(lock) => lock,
        Err(why) => {
            iggy_ingest::say_on_stderr!("iggy-ingest: {why} (nothing was changed)");
            return ExitCode::FAILURE;
        }
    };
    match command {
        StateCommand::Migrate { .. } => return state_migrate(&path),
        StateCommand::ForgetLog { yes, .. } => return state_forget_log(&path, yes),
        _ => {}
    }
    let result = match (reset, yes) {
        (true, true) => ingest::state::reset(&path),
        // What the reset would discard, as it would see it: a file it deletes as
        // unreadable is said to be so, not a failure to look.
        (true, false) => ingest::state::reset_preview(&path),
        _ => ingest::state::inventory(&path),
    };
    let inventory = match result {
        Ok(i) => i,
        Err(e) => {
            iggy_ingest::say_on_stderr!("iggy-ingest: {e}");
            return ExitCode::FAILURE;
        }
    };
    let version = inventory.schema_version.map_or("none".to_string(), |v| v.to_string());
    let mut out = format!("{}: schema version {version} (this build: {})\n", path.display(), ingest::SCHEMA_VERSION);
    if let Some(id) = inventory.log_id {
        out += &format!("  holds offsets of the log of identity {id:016x} (wal/log-id)\n");
    }
    if inventory.from_repaired_copy {
        out += &format!("  {}\n", ingest::state::REPAIRED_COPY_NOTE);
    }
    for line in inventory.consequences() {
        out += &format!("  {line}\n");
    }
    match (reset, yes) {
        (true, true) => out += &format!("deleted {}; the next start creates a new one\n", path.display()),
        (true, false) => out += "nothing changed: pass --yes to discard the above\n",
        _ => {}
    }
    write_out(&out)
}

/// What `state forget-log` does, for its preview and its report.
const FORGET_LOG_CONSEQUENCES: &str = "the next start takes the log beside it as its own: every record in that log \
     is delivered (no cursor is kept), delivery ids are rebuilt from it (a retry of a delivery it does not hold is \
     appended again); dynamic endpoints, their secrets and revocations are kept";

/// `state forget-log` of the database at `path`: exit 0 forgotten (or, without `yes`,
/// what it would do), 1 refused (a running daemon, another schema version, a database
/// that cannot be read).
fn state_forget_log(path: &std::path::Path, yes: bool) -> ExitCode {
    if !yes {
        return write_out(&format!(
            "{}: with --yes, forgets the delivery cursors, the delivery ids and the log's identity: \
             {FORGET_LOG_CONSEQUENCES}\nnothing changed: pass --yes to ask for it\n",
            path.display()
        ));
    }
    match ingest::state::forget_log(path) {
        Ok(f) => {
            let log = f.log_id.map_or("no log".to_string(), |id| format!("the log of identity {id:016x}"));
            write_out(&format!(
                "{}: forgot {log}: {} delivery cursors, {} delivery ids; {FORGET_LOG_CONSEQUENCES}\n",
                path.display(),
                f.cursors,
                f.delivery_ids
            ))
        }
        Err(e) => {
            iggy_ingest::say_on_stderr!("iggy-ingest: {e} (nothing was changed)");
            ExitCode::FAILURE
        }
    }
}

/// `state reset` where there is no database: with `--yes`, leaves the marker that lets
/// the next start create an empty one beside a log written before (under the daemon's
/// lock, as any change); without, says what that would do.
fn reset_a_missing_database(data_dir: &std::path::Path, path: &std::path::Path, yes: bool) -> ExitCode {
    let consequences = "the next start creates an empty one: every record still in the log is delivered again, \
                        dynamic endpoints and their revocations are gone, delivery ids are rebuilt from the log";
    if !yes {
        return write_out(&format!(
            "{}: no state database; with --yes {consequences}\nnothing changed: pass --yes to ask for it\n",
            path.display()
        ));
    }
    let _daemon_locked_out = match lock_out_the_daemon(data_dir) {
        Ok(lock) => lock,
        Err(why) => {
            iggy_ingest::say_on_stderr!("iggy-ingest: {why} (nothing was changed)");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = ingest::state::mark_reset(path) {
        iggy_ingest::say_on_stderr!("iggy-ingest: {e}");
        return ExitCode::FAILURE;
    }
    write_out(&format!("{}: no state database; {consequences}\n", path.display()))
}

/// Takes the lock of the log in `data_dir`, which the daemon takes at start before it
/// opens the state database and holds for as long as it runs. redb's own lock on the
/// database is not enough: a running daemon lets go of it while it reopens the database
/// after an I/O error, and a daemon starting beside a reset could create a new database
/// in place of the one the reset deletes.
fn lock_out_the_daemon(data_dir: &std::path::Path) -> Result<Box<dyn Send + Sync>, String> {
    use std::os::unix::fs::MetadataExt;
    use wal::storage::Storage;
    let wal_dir = data_dir.join(config::WAL_DIR_NAME);
    let lock = wal_dir.join(wal::LOCK_FILE);
    let (dir_existed, lock_existed) = (wal_dir.exists(), lock.exists());
    let fs = wal::storage::FsStorage;
    wal::storage::create_dir_all_durably(&fs, &wal_dir).map_err(|e| format!("{}: {e}", wal_dir.display()))?;
    let held = fs.try_lock(&lock).map_err(|e| match e.kind() {
        std::io::ErrorKind::WouldBlock => {
            format!("a daemon runs on {} (its log {} is locked); stop it first", data_dir.display(), wal_dir.display())
        }
        _ => format!("{}: {e}", lock.display()),
    })?;
    // What this made belongs to whoever owns the data directory (the daemon's user),
    // not to whoever ran the command (root, say): else the daemon could not take its
    // own lock, or write its log, at its next start.
    let owner = std::fs::metadata(data_dir).map_err(|e| format!("{}: {e}", data_dir.display()))?;
    for (made, path) in [(!dir_existed, &wal_dir), (!lock_existed, &lock)] {
        if made {
            std::os::unix::fs::chown(path, Some(owner.uid()), Some(owner.gid()))
                .map_err(|e| format!("{}: giving it the data directory's owner: {e}", path.display()))?;
        }
    }
    Ok(held)
}

/// `state migrate` of the database at `path`: exit 0 migrated or already current, 1
/// refused (a version with no step to this build's, a running daemon, a database that
/// cannot be read).
fn state_migrate(path: &std::path::Path) -> ExitCode {
    match ingest::state::migrate(path) {
        Ok(ingest::state::Migration::AlreadyCurrent) => {
            write_out(&format!("{}: schema version {}; nothing to migrate\n", path.display(), ingest::SCHEMA_VERSION))
        }
        Ok(ingest::state::Migration::Migrated { from, discarded }) => {
            let mut out =
                format!("{}: migrated from schema version {from} to {}\n", path.display(), ingest::SCHEMA_VERSION);
            for line in discarded {
                out += &format!("  discarded: {line}\n");
            }
            write_out(&out)
        }
        Err(ingest::StateError::SchemaMismatch { found, .. }) => {
            iggy_ingest::say_on_stderr!(
                "iggy-ingest: {}: no migration step leads from schema version {found} to {} (nothing was changed)",
                path.display(),
                ingest::SCHEMA_VERSION
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            iggy_ingest::say_on_stderr!("iggy-ingest: {e}");
            ExitCode::FAILURE
        }
    }
}
