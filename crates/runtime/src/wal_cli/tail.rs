//! `wal tail`: follows a log as the daemon makes records durable, like `tail -f`.
//!
//! A read-only view of the log is fixed when it is opened, so following means looking
//! again: every `--interval-ms` the directory's segment names and the newest segment's
//! length are compared with the last look, and only on a change is the log reopened
//! (read-only, bounded by the writer's durable watermark) and read on from the next
//! offset. Each reopen scans the newest segment once (at most its size, 64 MiB by
//! default); an idle log costs one directory listing per interval.
//!
//! Invariants:
//! - Records come out once each, in offset order, with no gaps except what was released
//!   while the tool was not looking (said on stderr, then it continues from the start).
//! - `--from` is checked as `dump` checks it: below the log's start or past its end it
//!   is refused (exit 2). A log that later ends below what was shown was replaced: exit 1.
//! - Only durable records are shown, as in every read-only view.
//! - It runs until interrupted or until its output is closed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use ingest::Envelope;
use wal::WalError;

use super::dump::{EndpointIds, Filter, Format, write_record};
use super::dump::{FilterArgs, FormatArgs};
use super::{CliResult, open_log, stdout, wal_error};

#[derive(Debug, Args)]
pub struct TailArgs {
    /// The log directory (the daemon's DATA_DIR/wal).
    pub dir: PathBuf,
    /// Start with the last N records already in the log that match the filters (0: only
    /// new ones).
    #[arg(short = 'n', long, value_name = "N", default_value_t = 10)]
    pub lines: u64,
    /// Start at this offset instead.
    #[arg(long, value_name = "N", conflicts_with = "lines")]
    pub from: Option<u64>,
    /// How often to look for new records: 10 to 60000 (a minute).
    #[arg(long, value_name = "MS", default_value_t = 200, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub interval_ms: u64,
    #[command(flatten)]
    pub filter: FilterArgs,
    #[command(flatten)]
    pub format: FormatArgs,
}

/// The offset from which the log's last `n` records that match `filter` follow (the
/// log's start if it holds fewer). Without a filter that is `n` records back; with one,
/// windows of the log's end, each four times the last, are read until one holds `n`
/// matches or reaches the log's start: the records read are at most about 4/3 of the
/// span searched (and that span, over the last match's window, at most four times).
fn start_of_last_matching(wal: &wal::Wal, filter: &Filter, n: u64) -> Result<u64, WalError> {
    let (start, end) = (wal.start_offset(), wal.next_offset());
    if filter.is_empty() || n == 0 {
        return Ok(end.saturating_sub(n).max(start));
    }
    let mut window = n;
    loop {
        let from = end.saturating_sub(window).max(start);
        // The offsets of the last `n` matches in the window, oldest first.
        let mut matched = std::collections::VecDeque::new();
        let mut matches = 0u64;
        for r in wal::inspect::Records::new(wal, from)? {
            let r = r?;
            if filter.matches(Envelope::decode(&r.payload).as_ref().ok()) {
                if matched.len() as u64 == n {
                    matched.pop_front();
                }
                matched.push_back(r.offset);
                matches += 1;
            }
        }
        if matches >= n
            && let Some(&first) = matched.front()
        {
            return Ok(first);
        }
        if from == start {
            return Ok(start);
        }
        window = window.saturating_mul(4);
    }
}

/// What a cheap look at the directory sees: segment names, the newest segment's length
/// and the durable watermark's bytes (they change with every sync). A change means
/// "reopen".
type Look = (Vec<String>, u64, Vec<u8>);

fn look(dir: &Path) -> Option<Look> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".seg"))
        .collect();
    names.sort();
    let newest = names.last()?;
    let len = std::fs::metadata(dir.join(newest)).ok()?.len();
    let watermark = std::fs::read(dir.join(wal::WATERMARK_FILE)).unwrap_or_default();
    Some((names, len, watermark))
}

pub(crate) fn run(a: TailArgs) -> CliResult {
    let filter = Filter::parse(&a.filter)?;
    let format = Format::of(&a.format);
    let endpoint_ids = EndpointIds::of(&a.format);
    let interval = Duration::from_millis(a.interval_ms);
    // Look first, then open: a sync between the two is then seen as a change and read
    // by the next reopen, never skipped.
    let mut last_look = look(&a.dir);
    let wal = open_log(&a.dir)?;
    let mut next = match a.from {
        // As `dump` does: an offset the log no longer (or does not yet) hold is refused.
        Some(f) => match wal::inspect::Records::new(&wal, f) {
            Ok(_) => f,
            Err(e @ (WalError::Released { .. } | WalError::BeyondEnd { .. })) => {
                return Err(super::CliError::Usage(format!("--from {f}: {e}")));
            }
            Err(e) => return Err(wal_error(&a.dir, e)),
        },
        None => start_of_last_matching(&wal, &filter, a.lines).map_err(|e| wal_error(&a.dir, e))?,
    };
    let mut out = stdout();
    let mut wal = Some(wal);
    loop {
        if let Some(w) = wal.take() {
            if next < w.start_offset() {
                super::say(format_args!("offsets {next}..{} were released meanwhile; continuing", w.start_offset()));
                next = w.start_offset();
            }
            let records = match wal::inspect::Records::new(&w, next) {
                Ok(r) => r,
                // Read up to `next` before: the log now ends lower (it was replaced, by a
                // salvaged copy say) and what follows is not the log that was followed.
                Err(WalError::BeyondEnd { end, .. }) => {
                    return Err(super::CliError::Failed(format!(
                        "the log now ends at offset {end}, below offset {next} already shown: was {} replaced?",
                        a.dir.display()
                    )));
                }
                Err(e) => return Err(wal_error(&a.dir, e)),
            };
            for r in records {
                let r = r.map_err(|e| wal_error(&a.dir, e))?;
                next = r.offset + 1;
                let envelope = Envelope::decode(&r.payload);
                if filter.matches(envelope.as_ref().ok()) {
                    write_record(&mut out, format, endpoint_ids, r.offset, &r.payload, &envelope)?;
                }
            }
            out.flush()?;
        }
        // Wait for a change, noticing a closed output on the way.
        loop {
            std::thread::sleep(interval);
            out.flush()?;
            if closed_output() {
                return Ok(ExitCode::SUCCESS);
            }
            let now = look(&a.dir);
            if now.is_none() {
                return Err(super::not_a_log(&a.dir));
            }
            if now != last_look {
                last_look = now;
                break;
            }
        }
        match wal::Wal::open_read_only(&a.dir) {
            Ok(w) => wal = Some(w),
            // The writer was starting or moving on: look again next time, changed or not.
            Err(WalError::Unsettled { .. }) => last_look = None,
            Err(e) => return Err(wal_error(&a.dir, e)),
        }
    }
}

/// Whether standard output is a pipe whose reader has gone (so a quiet log does not keep
/// `wal tail | head` alive forever).
fn closed_output() -> bool {
    let mut fds = [libc::pollfd { fd: 1, events: 0, revents: 0 }];
    // SAFETY: poll on our own standard output with a valid one-element array, no wait.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) };
    n > 0 && fds[0].revents & (libc::POLLERR | libc::POLLHUP) != 0
}
