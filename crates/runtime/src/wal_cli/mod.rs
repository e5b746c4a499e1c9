//! `iggy-ingest wal ...`: read-only tools over a log directory, for operators.
//!
//! ```text
//!  inspect  segments, offsets, capacity, each destination's cursor and what it holds
//!  dump     the decoded envelopes, filtered, as text, NDJSON or bare payloads
//!  tail     like dump, then follows new records as the daemon syncs them
//!  verify   every header and checksum and the offset sequence; exit 0 / 1 / 2 / 3
//!  salvage  every whole batch that still checks, copied under its offsets into a new log
//! ```
//!
//! Invariants:
//! - Nothing here writes to the log directory, takes the writer's lock or opens the log
//!   for writing: every read goes through `Wal::open_read_only` or `wal::inspect`, which
//!   beside a running daemon read only what its last sync made durable (the log's
//!   durable watermark). `salvage` writes only into its new `--out` directory.
//! - The state database is read only with redb's read-only open, for the moment of the
//!   read; while the daemon holds it, `inspect` says so instead of waiting or guessing.
//! - Exit codes: 0 done (verify: clean); 1 damage found (verify, salvage) or a failure
//!   while reading; 2 unusable arguments, including a path that holds no log, which is
//!   said in one line; 3 busy: a writer holds the log and its durable state could not
//!   be read (it is starting, or a state command runs), nothing was written, run it again.
//! - Output is streamed and a closed pipe (`| head`) ends the command quietly, with 0,
//!   except `verify` and `salvage`, which still exit with their verdict.
//! - No record's bytes are trusted: a record that is not an envelope is shown as such
//!   (base64), never a reason to stop.
//! - A progress bar is drawn on standard error only while it is a terminal and nothing
//!   the command writes meanwhile could reach the same screen ([`ScanProgress`]).

mod dump;
mod inspect;
mod salvage;
mod tail;
mod verify;

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use base64::Engine;
use clap::Subcommand;
use wal::{Wal, WalError};

pub use dump::DumpArgs;
pub use inspect::InspectArgs;
pub use salvage::SalvageArgs;
pub use tail::TailArgs;
pub use verify::VerifyArgs;

/// The log tools (read-only; safe beside a running daemon).
#[derive(Debug, Subcommand)]
pub enum WalCommand {
    /// Segments, offsets, capacity, and each destination's cursor and held records.
    #[command(after_help = "Examples:\n  \
        iggy-ingest wal inspect /var/lib/iggy-ingest/wal\n  \
        iggy-ingest wal inspect ./data/wal --json | jq '.destinations.lanes'\n  \
        iggy-ingest wal inspect ./data/wal --admin http://127.0.0.1:9180 --admin-token \"$TOKEN\"")]
    Inspect(InspectArgs),
    /// The decoded records (envelopes), from an offset, filtered by source or destination.
    #[command(after_help = "Examples:\n  \
        iggy-ingest wal dump ./data/wal --limit 20\n  \
        iggy-ingest wal dump ./data/wal --from 1200 --destination events/orders --json | jq .payload\n  \
        iggy-ingest wal dump ./data/wal --source github --payload-only | head")]
    Dump(DumpArgs),
    /// Follows new records as the daemon makes them durable, like `tail -f`.
    #[command(after_help = "Examples:\n  \
        iggy-ingest wal tail ./data/wal\n  \
        iggy-ingest wal tail ./data/wal -n 0 --source stripe --json")]
    Tail(TailArgs),
    /// Checks every segment header, record checksum and the offset sequence.
    #[command(after_help = "Exit status: 0 clean (a torn tail is reported but is not damage), 1 damaged \
        (each problem named by file and byte), 2 unusable arguments or not a log, 3 busy: a daemon holds \
        the log and its durable state could not be read (it is starting, or a state command runs); run \
        it again.\n\nExamples:\n  \
        iggy-ingest wal verify ./data/wal\n  \
        iggy-ingest wal verify ./data/wal --json > report.json; [ $? -eq 1 ] && echo damaged")]
    Verify(VerifyArgs),
    /// Copies every whole batch that still checks into a new log, keeping offsets.
    #[command(after_help = "The source is only read. Stop the daemon, salvage into a new directory \
        beside the log directory (never inside it), check the copy with `wal verify`, then put the \
        copy in place of the log directory.\n\nExit status: 0 everything \
        copied, 1 copied with something skipped (damage, or records of an unfinished batch; listed), 2 \
        unusable arguments, 3 a running daemon holds the log (stop it first: a copy made beside it would \
        lack every event it accepts after the copy), or busy: its durable state could not be read (a \
        daemon starting, or a state command runs); nothing was written.\n\nExamples:\n  \
        iggy-ingest wal salvage ./data/wal --out ./data/wal.salvaged")]
    Salvage(SalvageArgs),
}

pub fn run(cmd: WalCommand) -> ExitCode {
    crate::open_files::raise_to_hard();
    let result = match cmd {
        WalCommand::Inspect(a) => inspect::run(a),
        WalCommand::Dump(a) => dump::run(a),
        WalCommand::Tail(a) => tail::run(a),
        WalCommand::Verify(a) => verify::run(a),
        WalCommand::Salvage(a) => salvage::run(a),
    };
    exit_code(result)
}

/// How a command ends: its code, 0 for a reader that went away (`| head`), 2 for
/// unusable arguments, 1 for a failure, 3 when busy; each error said in one line.
fn exit_code(result: CliResult) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(CliError::ClosedPipe) => ExitCode::SUCCESS,
        Err(CliError::Usage(m)) => {
            say(format_args!("{m}"));
            ExitCode::from(2)
        }
        Err(CliError::Failed(m)) => {
            say(format_args!("{m}"));
            ExitCode::from(1)
        }
        Err(CliError::Busy(m)) => {
            say(format_args!("{m}; run it again"));
            ExitCode::from(3)
        }
        Err(CliError::HeldByDaemon(m)) => {
            say(format_args!("{m}"));
            ExitCode::from(3)
        }
    }
}

/// Writes one line to standard error, `iggy-ingest: ` first. A standard error that
/// cannot be written (a closed pipe: `2>&1 | head -1`) loses the line and changes
/// nothing else: the command's exit code stays its verdict (see [`say_on_stderr`](crate::say_on_stderr)).
pub(crate) fn say(line: std::fmt::Arguments<'_>) {
    crate::say_on_stderr!("iggy-ingest: {line}");
}

/// Why a subcommand stopped.
#[derive(Debug)]
pub(crate) enum CliError {
    /// The reader of our output went away: not an error.
    ClosedPipe,
    /// Unusable arguments (exit 2).
    Usage(String),
    /// Something failed while working (exit 1).
    Failed(String),
    /// A writer holds the log and its durable state could not be read consistently for
    /// a while (it is recovering the log, or a state command holds its lock): not damage,
    /// and not a failure of this run's doing (exit 3, so that a script that takes 1 for
    /// damage runs it again instead of salvaging).
    Busy(String),
    /// A running daemon holds the log, and the command is one that must not run beside
    /// it (exit 3, as busy; stop the daemon first).
    HeldByDaemon(String),
}

/// Writes `text` to standard output and ends as the log tools do: 0, also when the
/// reader went away (what it wanted it has), 1 if the output cannot be written
/// otherwise. For the other commands that print (`config`, `state`): never the panic
/// `println!` is on a closed pipe.
pub fn write_out(text: &str) -> ExitCode {
    let mut out = stdout();
    let written = out.write_all(text.as_bytes()).and_then(|()| out.flush());
    exit_code(written.map(|()| ExitCode::SUCCESS).map_err(CliError::from))
}

impl From<io::Error> for CliError {
    fn from(e: io::Error) -> CliError {
        if e.kind() == io::ErrorKind::BrokenPipe { CliError::ClosedPipe } else { CliError::Failed(e.to_string()) }
    }
}

pub(crate) type CliResult<T = ExitCode> = Result<T, CliError>;

/// The one line said when `dir` holds no log.
pub(crate) fn not_a_log(dir: &Path) -> CliError {
    let what = if !dir.exists() {
        "does not exist"
    } else if !dir.is_dir() {
        "is not a directory, so not a log"
    } else if dir.join(crate::config::WAL_DIR_NAME).is_dir() {
        // The daemon's data directory: its log is the directory under it.
        return CliError::Usage(format!(
            "{} is not a log (no segment files); did you mean {}?",
            dir.display(),
            dir.join(crate::config::WAL_DIR_NAME).display()
        ));
    } else {
        "is not a log (no segment files)"
    };
    CliError::Usage(format!("{} {what}", dir.display()))
}

/// Maps a log error to the CLI's exit classes.
pub(crate) fn wal_error(dir: &Path, e: WalError) -> CliError {
    match e {
        WalError::NotALog(_) => not_a_log(dir),
        WalError::Io { ref source, .. } if source.kind() == io::ErrorKind::NotFound && !dir.exists() => not_a_log(dir),
        WalError::Released { .. } | WalError::BeyondEnd { .. } => CliError::Usage(e.to_string()),
        WalError::Unsettled { .. } => CliError::Busy(e.to_string()),
        e if e.is_corruption() => CliError::Failed(format!(
            "{e}\n`iggy-ingest wal verify {}` lists every problem; `wal salvage` copies what still checks",
            dir.display()
        )),
        e => CliError::Failed(e.to_string()),
    }
}

/// Refuses a path that is not a directory (exit 2), and one that cannot be looked at
/// (exit 1: a data directory of mode 0750 seen by another user exists, and saying it
/// does not would send a script the wrong way).
pub(crate) fn a_directory(dir: &Path) -> CliResult<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(not_a_log(dir)),
        Err(e) if is_not_there(&e) => Err(not_a_log(dir)),
        Err(e) => Err(CliError::Failed(cannot_look_at(dir, &e))),
    }
}

/// Whether looking at a path failed because nothing is there (the path, or a directory
/// on its way): an argument error. Anything else (permission denied, a loop of links)
/// says nothing of whether it exists.
pub fn is_not_there(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::NotADirectory)
}

/// The one line said of a path that cannot be looked at.
pub fn cannot_look_at(path: &Path, e: &io::Error) -> String {
    format!("cannot look at {}: {e} (run as the daemon's user, or as root)", path.display())
}

/// Opens the log in `dir` read-only, refusing a path that is not a log directory.
pub(crate) fn open_log(dir: &Path) -> CliResult<Wal> {
    a_directory(dir)?;
    Wal::open_read_only(dir).map_err(|e| wal_error(dir, e))
}

/// Whether a writer (the daemon) holds the log in `dir` now, tested without taking its lock.
pub(crate) fn writer_running(dir: &Path) -> bool {
    use wal::storage::{FsStorage, Storage};
    FsStorage.is_locked(&dir.join(wal::LOCK_FILE)).unwrap_or(false)
}

/// A payload as text when it is UTF-8, base64 otherwise; the second value names which.
pub(crate) fn payload_text(p: &[u8]) -> (std::borrow::Cow<'_, str>, &'static str) {
    match std::str::from_utf8(p) {
        Ok(s) => (s.into(), "utf-8"),
        Err(_) => (base64::engine::general_purpose::STANDARD.encode(p).into(), "base64"),
    }
}

/// The last millisecond RFC 3339 can write: 9999-12-31T23:59:59.999Z.
const RFC3339_MAX_MS: u64 = 253_402_300_799_999;

/// Milliseconds since the epoch as an RFC 3339 UTC time. A time RFC 3339 cannot write
/// (past the year 9999: a record's bytes are never trusted to be sensible) is shown as
/// its milliseconds instead.
pub(crate) fn rfc3339_ms(ms: u64) -> String {
    // A civil (UTC) time, not a `jiff::Timestamp`: a timestamp stops a day short of the
    // year's end at 9999, so that it is a valid time in every offset.
    let epoch = jiff::civil::date(1970, 1, 1).at(0, 0, 0, 0);
    let t = i64::try_from(ms)
        .ok()
        .filter(|_| ms <= RFC3339_MAX_MS)
        .map(|ms| epoch.checked_add(jiff::SignedDuration::from_millis(ms)));
    match t {
        Some(Ok(t)) => format!("{t:.3}Z"),
        _ => format!("{ms}ms-after-epoch"),
    }
}

/// Bytes as a short human size (binary units).
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{n} B") } else { format!("{v:.1} {}", UNITS[u]) }
}

/// A duration in milliseconds as a short human age.
pub(crate) fn human_age(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0 => format!("{ms}ms"),
        1..=119 => format!("{s}s"),
        120..=7199 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

/// A progress bar on standard error, drawn only while it is a terminal and `draw` holds,
/// in `template`'s words; cleared when dropped.
struct TerminalBar(Option<indicatif::ProgressBar>);

impl TerminalBar {
    fn new(len: u64, template: &str, draw: bool) -> TerminalBar {
        TerminalBar((std::io::IsTerminal::is_terminal(&io::stderr()) && draw).then(|| {
            let b = indicatif::ProgressBar::new(len);
            b.set_style(
                indicatif::ProgressStyle::with_template(template)
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b
        }))
    }
}

impl Drop for TerminalBar {
    fn drop(&mut self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}

/// A progress bar over a scan of the records `from..end`, in records, drawn on standard
/// error only while it is a terminal and `output_while_scanning` is false: lines the
/// scan writes meanwhile (to the terminal, or through a pipe to `jq`, `head` or `less`
/// that shows them there) would tear the bar and be torn by it. Cleared when dropped.
pub(crate) struct ScanProgress {
    bar: TerminalBar,
    from: u64,
}

impl ScanProgress {
    pub(crate) fn new(from: u64, end: u64, output_while_scanning: bool) -> ScanProgress {
        let template = "{bar:40} {human_pos}/{human_len} records, eta {eta}";
        ScanProgress { bar: TerminalBar::new(end.saturating_sub(from), template, !output_while_scanning), from }
    }

    /// The scan has reached `offset`. Cheap enough for every record: one atomic store,
    /// and a redraw at most a few times a second (indicatif's own limit).
    pub(crate) fn at(&self, offset: u64) {
        if let Some(b) = &self.bar.0 {
            b.set_position(offset.saturating_sub(self.from));
        }
    }
}

/// A progress bar over a walk of the log's bytes (`verify`, `salvage`), drawn on standard
/// error only while it is a terminal; their reports are written once the walk is over,
/// so nothing they print can tear it. Cleared when dropped.
pub(crate) struct BytesProgress(TerminalBar);

impl BytesProgress {
    pub(crate) fn new() -> BytesProgress {
        BytesProgress(TerminalBar::new(0, "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}", true))
    }

    pub(crate) fn at(&self, p: wal::inspect::VerifyProgress) {
        if let Some(b) = &self.0.0 {
            b.set_length(p.bytes_total);
            b.set_position(p.bytes_done);
        }
    }
}

/// Whether standard output is a regular file (`> FILE`): what is written there is seen
/// by no one until the command ends.
pub(crate) fn stdout_is_a_file() -> bool {
    std::fs::metadata("/proc/self/fd/1").is_ok_and(|m| m.is_file())
}

/// Standard output, buffered; `flush` at the end or at each followed record.
pub(crate) fn stdout() -> io::BufWriter<io::StdoutLock<'static>> {
    io::BufWriter::with_capacity(64 * 1024, io::stdout().lock())
}

/// A path as a JSON string. Paths are bytes on Linux and JSON strings are UTF-8: a path
/// that is not UTF-8 (an operator may name a directory anything) is shown with each
/// invalid sequence replaced by U+FFFD, as `Path::display` does for the text output,
/// instead of failing the whole answer.
pub(crate) fn path_json(p: &Path) -> serde_json::Value {
    serde_json::Value::String(p.to_string_lossy().into_owned())
}

pub(crate) fn write_json_line(out: &mut impl Write, v: &serde_json::Value) -> io::Result<()> {
    serde_json::to_writer(&mut *out, v).map_err(io::Error::from)?;
    out.write_all(b"\n")
}

/// The default place of the state database for a log directory: `DATA_DIR/wal` sits
/// beside `DATA_DIR/state.redb`.
pub(crate) fn default_state_path(dir: &Path) -> Option<PathBuf> {
    let parent = dir.canonicalize().ok()?.parent()?.to_path_buf();
    Some(parent.join("state.redb"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_receive_time_a_record_can_hold_is_shown_without_a_panic() {
        assert_eq!(rfc3339_ms(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_ms(RFC3339_MAX_MS), "9999-12-31T23:59:59.999Z");
        assert_eq!(rfc3339_ms(RFC3339_MAX_MS + 1), "253402300800000ms-after-epoch");
        assert_eq!(rfc3339_ms(u64::MAX), format!("{}ms-after-epoch", u64::MAX));
    }
}
