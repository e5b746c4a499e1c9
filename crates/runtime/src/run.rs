//! `iggy-ingest run`: the daemon's process life, shared by the `iggy-ingest` binary and
//! the end-to-end tests' daemon (which is the same code with the fail points compiled in).
//!
//! Invariants:
//! - The ready file is written (atomically: temporary file, rename) only once both
//!   listeners are bound, and never by a daemon asked to stop during its start; a
//!   failure to write it stops the daemon.
//! - A first SIGTERM/SIGINT drains (one during the start, as soon as the start is done);
//!   a second exits with 130 at once, also during the start, which is safe because every
//!   event answered 200 is already durable.
//! - A daemon that stopped itself (a task it cannot run without panicked) exits 1.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::config::Settings;
use crate::{daemon, logging};

/// Runs the daemon on `settings` until SIGTERM/SIGINT, as `iggy-ingest run` does:
/// logging, the metrics recorder, the open-file limit (`open_files`), `daemon::start`, the ready file, a graceful stop (a
/// second signal exits at once with 130). Exit: 0 after a clean stop, 1 for a failed
/// start or an unclean stop, 2 for a start refusal only an operator can end (a ready
/// file that cannot be written, [`daemon::StartError::exit_code`]).
pub fn run(settings: Settings, ready_file: Option<PathBuf>) -> ExitCode {
    if let Some(path) = &ready_file
        && let Err(why) = check_ready_file(path)
    {
        crate::say_on_stderr!("iggy-ingest: --ready-file {}: {why} (nothing was started)", path.display());
        return ExitCode::from(2);
    }
    logging::init(&settings.log_level, settings.log_json);
    for w in &settings.warnings.errors {
        tracing::warn!(setting = %w.path, line = w.line, "configuration: {}", w.message);
    }
    let metrics = match crate::telemetry::install() {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::warn!(error = %e, "metrics recorder not installed; /metrics answers 404");
            None
        }
    };
    // Before any file is opened: the log's segments and the connections need room.
    crate::open_files::raise_for(&settings);
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let worker_threads = settings.runtime_worker_threads(cores);
    tracing::info!(worker_threads, cores, "starting the async runtime");
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(worker_threads).enable_all().build()
    {
        Ok(r) => r,
        Err(e) => {
            crate::say_on_stderr!("cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // A ready file left by an earlier run (killed, or crashed) would tell a supervisor
    // this one is ready, with the old run's ports and pid, before it is. One whose
    // daemon still runs is left alone: this start will find its log locked and stop.
    if let Some(path) = &ready_file
        && !written_by_a_live_process(path)
        && let Err(e) = std::fs::remove_file(path)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        crate::say_on_stderr!(
            "iggy-ingest: cannot remove the ready file {} left by an earlier run: {e}",
            path.display()
        );
        return ExitCode::FAILURE;
    }
    let code = runtime.block_on(async move {
        // Installed before anything else: a stop signal that comes while the daemon
        // starts, or right after it said it is ready, is then a clean stop, not the
        // default action's sudden death (no clean-shutdown marker, exit by signal).
        let mut signals = match StopSignals::install() {
            Ok(s) => s,
            Err(e) => {
                // Without them a stop could only kill the process: no drain, no clean
                // shutdown, what a supervisor's SIGTERM then does. Not started.
                tracing::error!(error = %e, "cannot install the SIGTERM and SIGINT handlers: not started");
                return ExitCode::FAILURE;
            }
        };
        // SIGHUP's default action would end the process without a drain; from here on
        // it reloads the listeners' TLS certificates instead (once the daemon started:
        // one sent during the start is kept for then).
        let hangups = install_hangup();
        let data_dir = settings.data_dir.clone();
        // Route mappings first (each fetch may take 10 s): nothing is bound or opened
        // yet, so a stop signal meanwhile ends the process at once, a clean stop (exit
        // 0), rather than wait for the fetches and start only to stop.
        let mut settings = settings;
        tokio::select! {
            fetched = daemon::fetch_mappings(&mut settings) => {
                if let Err(e) = fetched {
                    return start_failed(&e, &data_dir);
                }
            }
            _ = signals.recv() => {
                tracing::info!("stop signal while the route mappings were fetched: stopped, nothing was opened");
                return ExitCode::SUCCESS;
            }
        }
        // The rest of the start can take a while too (a long log re-read for delivery
        // ids): a first signal meanwhile stops the daemon once it is started, a second
        // exits at once, as during a drain (safe: nothing was answered 200 yet).
        let start = daemon::start(settings, metrics);
        tokio::pin!(start);
        let mut stop_asked = false;
        let started = loop {
            tokio::select! {
                r = &mut start => break r,
                _ = signals.recv() => {
                    if stop_asked {
                        crate::say_on_stderr!("iggy-ingest: second signal during the start, exiting without finishing it");
                        // At once: returning would drop the runtime, which waits for the
                        // start's blocking tasks (the state open, the log re-read).
                        std::process::exit(130);
                    }
                    stop_asked = true;
                    tracing::info!("stop signal during the start: stopping as soon as it is done");
                }
            }
        };
        let running = match started {
            Ok(r) => r,
            Err(e) => return start_failed(&e, &data_dir),
        };
        // A daemon about to stop is not ready: a supervisor would send it traffic.
        let ready_file = ready_file.filter(|_| !stop_asked);
        if let Some(path) = &ready_file
            && let Err(e) = write_ready_file(path, &running)
        {
            tracing::error!(error = %e, path = %path.display(), "cannot write the ready file");
            // Nobody was told it was ready: no load balancer has traffic to move away.
            running.shutdown_before_ready();
            running.wait().await;
            return ExitCode::FAILURE;
        }
        if let Some(hangups) = hangups {
            tokio::spawn(reload_tls_on_hangup(hangups, running.shared.tls.clone()));
        }
        // A task the daemon cannot run without that panicked stops it too.
        let signalled = stop_asked
            || tokio::select! {
                _ = signals.recv() => true,
                _ = running.stopping() => false,
            };
        if stop_asked {
            running.shutdown_before_ready();
        } else {
            running.shutdown();
        }
        // A second signal stops at once. Safe: every event answered 200 is already
        // durable in the log; only requests still in flight are cut (without a 200).
        // After a stop of the daemon's own, the first signal (a supervisor's ordinary
        // stop) is the first: it lets the drain finish.
        tokio::spawn(async move {
            if !signalled {
                signals.recv().await;
            }
            signals.recv().await;
            crate::say_on_stderr!("iggy-ingest: second signal, exiting without waiting for the drain");
            std::process::exit(130);
        });
        let report = running.wait().await;
        // The ready file names this process's ports: gone with it (a supervisor reading
        // it after the stop would take a dead daemon for a ready one).
        if let Some(path) = &ready_file
            && let Err(e) = std::fs::remove_file(path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(error = %e, path = %path.display(), "cannot remove the ready file");
        }
        // Connections still open after the grace period were cut without a 200, so
        // nothing they carried was acknowledged: that alone is not a failure.
        if !report.drained {
            tracing::warn!("some connections were still open after the grace period and were closed");
        }
        if let Some(task) = report.failed_task {
            crate::say_on_stderr!("iggy-ingest: stopped because {task} panicked: {report:?}");
            ExitCode::FAILURE
        } else if report.wal_closed.is_ok() && report.checkpoint.is_ok() {
            ExitCode::SUCCESS
        } else {
            crate::say_on_stderr!("iggy-ingest: unclean shutdown: {report:?}");
            ExitCode::FAILURE
        }
    });
    // Blocking work still under way (a sync the disk does not answer) does not hold the
    // exit: whatever it was doing, a crash there loses nothing answered 200.
    runtime.shutdown_timeout(daemon::RUNTIME_STOP_MAX);
    code
}

/// A start that failed: logged, said on stderr with its hint, and its exit code.
fn start_failed(e: &daemon::StartError, data_dir: &Path) -> ExitCode {
    tracing::error!(error = %e, "start failed");
    crate::say_on_stderr!("iggy-ingest: {e}");
    if let Some(hint) = start_hint(e, data_dir) {
        crate::say_on_stderr!("iggy-ingest: {hint}");
    }
    ExitCode::from(e.exit_code())
}

/// What an operator can do about a refused start, where the error alone does not say.
fn start_hint(e: &daemon::StartError, data_dir: &Path) -> Option<String> {
    use daemon::StartError;
    use ingest::StateError;
    let dir = data_dir.display();
    Some(match e {
        StartError::State(StateError::SchemaMismatch { found, .. }) => {
            let migrate = if *found > 0 && *found < ingest::SCHEMA_VERSION {
                format!(
                    "`iggy-ingest state migrate --data-dir {dir}` moves it to this build's version, saying what it \
                     discards\niggy-ingest: "
                )
            } else {
                String::new()
            };
            let newer = if *found > ingest::SCHEMA_VERSION {
                "a newer build wrote it: run that build again (prefer this); or "
            } else {
                ""
            };
            format!(
                "{migrate}`iggy-ingest state show --data-dir {dir}` shows what the database holds; {newer}\
                 `iggy-ingest state reset --data-dir {dir} --yes` discards it: {RESET_DISCARDS}"
            )
        }
        StartError::StateMissing { .. } => format!(
            "put the database back (moved aside, or from a backup); or `iggy-ingest state reset --data-dir {dir} \
             --yes` to start with an empty one: {RESET_DISCARDS}"
        ),
        StartError::LogNotTheStates { .. } => format!(
            "the records the state's cursors and delivery ids name are not in this log. If it was meant (the log \
             deleted, or another daemon's moved here), `iggy-ingest state forget-log --data-dir {dir} --yes` lets \
             the state take this log: every record in it is delivered, delivery ids are rebuilt from it, endpoints \
             are kept. Otherwise put back the log this state was written beside (docs/operations.md, \"Backup and \
             restore\")"
        ),
        StartError::State(StateError::Open { unreadable: true, .. }) => format!(
            "the file is not a database this build can read (damaged?): `iggy-ingest state reset --data-dir {dir} \
             --yes` discards it: {RESET_DISCARDS}"
        ),
        StartError::State(StateError::NotAFile { path, .. }) => format!(
            "move {} away (nothing here is a database); then put the database back (moved aside, or from a \
             backup), or `iggy-ingest state reset --data-dir {dir} --yes` to start with an empty one: {RESET_DISCARDS}",
            path.display()
        ),
        // What kept it from opening may pass: no reset is called for.
        StartError::State(StateError::Open { unreadable: false, .. }) => "if another process holds it (`state show`, \
             `wal inspect`), start again once that ends; an I/O error is the disk's, to fix first"
            .to_string(),
        StartError::Wal { source: wal::WalError::UnfinishedSalvage(_), .. } => format!(
            "{dir}/wal is a salvage copy that never finished, not a log: put the original log back, or remove \
             the copy and run `iggy-ingest wal salvage` again from the original"
        ),
        StartError::Wal { source, .. } if source.is_corruption() => {
            format!(
                "`iggy-ingest wal verify {dir}/wal` lists each problem; `iggy-ingest wal salvage {dir}/wal --out \
                 {dir}/wal.salvaged` copies every record that still checks (docs/operations.md, \"After a crash\": \
                 if it refuses to start)"
            )
        }
        _ => return None,
    })
}

/// Whether the ready file at `path` names a live process of this same program (its
/// `pid`, other than this one, running the executable this one runs): a pid reused by
/// an unrelated process since does not count. A file that cannot be read or names no
/// pid does not either.
fn written_by_a_live_process(path: &Path) -> bool {
    let Some(pid) = ready_file_pid(path).filter(|&p| p != u64::from(std::process::id())) else { return false };
    let Ok(theirs) = std::fs::read_link(Path::new("/proc").join(pid.to_string()).join("exe")) else { return false };
    let Ok(ours) = std::env::current_exe() else { return false };
    let theirs = theirs.as_os_str().to_string_lossy();
    let ours = ours.as_os_str().to_string_lossy();
    theirs.strip_suffix(REPLACED_EXE_SUFFIX).unwrap_or(&theirs)
        == ours.strip_suffix(REPLACED_EXE_SUFFIX).unwrap_or(&ours)
}

/// The most a ready file holds (two addresses and a pid): a file at the path that is
/// larger is not one.
const READY_FILE_MAX_BYTES: u64 = 4096;

/// The pid a ready file at `path` names: `None` when there is none, or what is there is
/// not a regular file of at most [`READY_FILE_MAX_BYTES`] holding a JSON object with
/// `http`, `admin` and `pid` (read through [`crate::regular_file`]: a FIFO would block
/// the start).
fn ready_file_pid(path: &Path) -> Option<u64> {
    let text = crate::regular_file::read_text(path, READY_FILE_MAX_BYTES).ok()?;
    let v = serde_json::from_str::<serde_json::Value>(&text).ok()?;
    (v["http"].is_string() && v["admin"].is_string()).then(|| v["pid"].as_u64())?
}

/// Checks, before anything is opened, that the ready file can be written where `path`
/// says: a file name, not a directory, in a directory that takes a file. Found only once
/// the daemon had started, a bad path would stop it with exit 1, which a supervisor
/// restarts for ever; the caller refuses it as an unusable argument (exit 2).
fn check_ready_file(path: &Path) -> Result<(), String> {
    if path.file_name().is_none() {
        return Err("names no file".to_string());
    }
    if path.is_dir() {
        return Err("is a directory".to_string());
    }
    // What is there is replaced once the daemon is ready, and removed at the start when
    // an earlier run left it: only ever a ready file, so that a path given by mistake
    // (a configuration, a FIFO) is never removed or overwritten.
    if std::fs::symlink_metadata(path).is_ok() && ready_file_pid(path).is_none() {
        return Err("holds something that is not a ready file (a regular file with `http`, `admin` and `pid`); \
                    remove it or name another path"
            .to_string());
    }
    // A probe of a name of its own, created only if absent (never through a link, never
    // over a file that is there), then removed.
    let mut probe_name = std::ffi::OsString::from(".");
    probe_name.push(path.file_name().unwrap_or_default());
    probe_name.push(format!(".{}.probe", std::process::id()));
    let probe = path.with_file_name(probe_name);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .and_then(|_| std::fs::remove_file(&probe))
        .map_err(|e| format!("cannot write a file beside it ({}): {e}", probe.display()))
}

fn write_ready_file(path: &Path, running: &daemon::RunningDaemon) -> std::io::Result<()> {
    let body = serde_json::json!({
        "http": running.http_addr.to_string(),
        "admin": running.admin_addr.to_string(),
        "pid": std::process::id(),
    });
    // Beside it under another name (its name plus `.tmp`, whatever its own extension),
    // then renamed over it: a reader never sees half of it.
    let mut tmp_name = path.file_name().unwrap_or_default().to_os_string();
    tmp_name.push(".tmp");
    let tmp = path.with_file_name(tmp_name);
    std::fs::write(&tmp, body.to_string())?;
    std::fs::rename(&tmp, path)
}

/// An executable replaced on disk since its process started (an upgrade in place) reads,
/// in `/proc/PID/exe`, as its path with this after it.
const REPLACED_EXE_SUFFIX: &str = " (deleted)";

/// What a `state reset` throws away, said by every hint that offers one.
const RESET_DISCARDS: &str = "every record still in the log is delivered again (the cursors are gone), every dynamic \
     endpoint answers 404 and every revocation is forgotten; the log is kept and delivery ids are rebuilt from it";

fn install_hangup() -> Option<tokio::signal::unix::Signal> {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::error!(error = %e, "cannot install the SIGHUP handler; TLS certificates reload only on restart");
            None
        }
    }
}

/// How long a reload of a listener's files may read them before it is reported failed
/// (the file system does not answer): the read goes on, and applies what it reads if it
/// ever returns, but the status says meanwhile that the files are not what is served.
const TLS_RELOAD_READ_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// Reloads every TLS listener's certificate and key at each SIGHUP: a pair that does
/// not load is logged and the one served before stays (`http_source::tls`). Each
/// listener's reload is a task of its own, so a file that hangs one (a mount that does
/// not answer) neither holds the other's nor the next SIGHUP's; a read that has not
/// returned within [`TLS_RELOAD_READ_MAX`] is a failed reload, in `/status` and the
/// metrics.
async fn reload_tls_on_hangup(mut hangups: tokio::signal::unix::Signal, tls: Vec<http_source::tls::ListenerTls>) {
    while hangups.recv().await.is_some() {
        // Said at each one: an operator who edited the file and sent a reload (systemd's
        // `reload`) must not take the reload for the file's.
        tracing::info!(
            "SIGHUP received: it reloads TLS certificates and keys only; the configuration file is read only at start (restart to apply a change to it)"
        );
        if tls.is_empty() {
            tracing::info!("SIGHUP received: no listener serves TLS, nothing to reload");
        }
        for t in &tls {
            tokio::spawn(reload_tls_listener(t.clone()));
        }
    }
}

async fn reload_tls_listener(t: http_source::tls::ListenerTls) {
    let files = t.files().clone();
    let Some(reload) = t.begin_reload() else {
        let why = "the reload asked for by an earlier SIGHUP is still reading the files (a file system that does not answer?)";
        t.reload_not_returned(why);
        tracing::error!(listener = t.listener(), cert_file = %files.cert_file.display(), "SIGHUP received: {why}; nothing reloaded");
        return;
    };
    // File reads, on a blocking thread: a certificate on a mount that hangs must not
    // hold an async worker (and the requests it serves).
    let reloaded = match tokio::time::timeout(TLS_RELOAD_READ_MAX, tokio::task::spawn_blocking(move || reload.run()))
        .await
    {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            tracing::error!(listener = t.listener(), error = %e, "SIGHUP received: the TLS reload failed");
            return;
        }
        Err(_) => {
            let why = format!(
                "reading the certificate and key did not return within {} s (a file system that does not answer?); \
                 the pair loaded before is served, and what the read returns, if it does, is applied then",
                TLS_RELOAD_READ_MAX.as_secs()
            );
            t.reload_not_returned(&why);
            tracing::error!(listener = t.listener(), cert_file = %files.cert_file.display(), "SIGHUP received: {why}");
            return;
        }
    };
    match reloaded {
        Ok(()) => {
            tracing::info!(
                listener = t.listener(),
                cert_file = %files.cert_file.display(),
                "SIGHUP received: TLS certificate reloaded"
            );
            for warning in crate::config::tls_warnings(&t.served()) {
                tracing::warn!(listener = t.listener(), cert_file = %files.cert_file.display(), "{warning}");
            }
        }
        Err(e) => tracing::error!(
            listener = t.listener(),
            error = %e,
            "SIGHUP received: the TLS certificate did not load; the one loaded before is still served"
        ),
    }
}

/// SIGTERM and SIGINT, listened to from the moment they are installed: a signal that
/// comes before anything waits for it is kept for the first `recv`.
struct StopSignals(tokio::signal::unix::Signal, tokio::signal::unix::Signal);

impl StopSignals {
    /// Both handlers, or why not. There is no fallback: `ctrl_c` installs the same SIGINT
    /// handler, and failing likewise it would resolve at once, taken for a stop asked.
    fn install() -> std::io::Result<StopSignals> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(StopSignals(signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?))
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.0.recv() => tracing::info!("SIGTERM received"),
            _ = self.1.recv() => tracing::info!("SIGINT received"),
        }
    }
}
