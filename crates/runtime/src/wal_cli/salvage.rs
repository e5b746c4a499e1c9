//! `wal salvage DIR --out NEWDIR`: every whole batch that still checks, copied under its
//! own offsets into a new log (`wal::salvage_copy`), for the day a disk error damaged the
//! middle of a log.
//!
//! Invariants:
//! - Refused (exit 3) while a daemon holds the log: the copy replaces the log, and one
//!   made beside a running daemon would lack what it accepted since.
//! - The source is only read; nothing is written outside `--out`, which must not hold a
//!   log already, and must be neither the log directory, nor inside it, nor hold it
//!   (compared with every symlink and `..` resolved, as the writes would resolve them):
//!   the runbook moves the log directory aside and the copy into its place.
//! - Offsets are kept, so the delivery cursors beside the log stay true for the copy,
//!   and the copy continues past every offset a left-out record may have had;
//!   every skipped byte range and every missing offset range is reported, and so are the
//!   records left out because their batch is not whole (a batch is copied whole or not
//!   at all), with their count. The offsets kept from reuse past the last copied record
//!   are reported as reserved, not missing: they are an upper bound (damaged bytes are
//!   counted at the most records they could hold), and a source whose newest segment
//!   starts above its last record reserves some with nothing lost.
//! - Exit 0 when everything was copied (offsets reserved or not), 1 when anything was
//!   skipped (damage, or records of a batch that is not whole; the copy is still a whole
//!   log), 2 for unusable
//!   arguments (an `--out` above, or one that exists and is not a directory), each said
//!   in one line before anything is written. A copy that did not finish is refused by
//!   every open (`wal::SALVAGE_INCOMPLETE_FILE`), and the error says to remove it.
//! - The progress bar (bytes of the source walked) is drawn on standard error only when
//!   it is a terminal, and cleared before anything is printed.

use std::io::{self, Write};
use std::path::{Component, Path, PathBuf};
use std::process::ExitCode;

use clap::Args;
use serde_json::json;
use wal::storage::FsStorage;

use super::{CliError, CliResult, human_bytes, path_json, stdout, wal_error, write_json_line};

#[derive(Debug, Args)]
pub struct SalvageArgs {
    /// The damaged log directory (read only).
    pub dir: PathBuf,
    /// A new directory for the copy, beside the log directory (created; must not hold a log).
    #[arg(long, value_name = "NEWDIR")]
    pub out: PathBuf,
    /// A JSON report on standard output, for scripts.
    #[arg(long)]
    pub json: bool,
}

pub(crate) fn run(a: SalvageArgs) -> CliResult {
    super::a_directory(&a.dir)?;
    let target = check_out(&a.dir, &a.out)?;
    // What `--out` held before (`None`: salvage makes it), so that only what salvage
    // writes is given the log's owner.
    let held_before: Option<std::collections::HashSet<std::ffi::OsString>> =
        std::fs::read_dir(&target).ok().map(|entries| entries.flatten().map(|e| e.file_name()).collect());
    let bar = super::BytesProgress::new();
    // The copy ends where the log was when it was made, and a daemon goes on accepting
    // into DIR: put in DIR's place, it would lack every event answered 200 since, and
    // give their offsets to new ones. So a writer holding DIR refuses the copy, in the
    // same read as the bound it is made to; one that takes DIR during the copy voids it
    // (`salvage-incomplete` stays).
    let copied = wal::salvage_copy::salvage_copy_of_a_stopped_log(&FsStorage, &a.dir, &a.out, &mut |p| bar.at(p));
    drop(bar);
    let report = match copied {
        Ok(r) => r,
        Err(wal::WalError::InvalidOptions(m)) => return Err(CliError::Usage(m)),
        Err(e @ wal::WalError::WriterRunning(_)) => {
            return Err(CliError::HeldByDaemon(format!("{e}; nothing was written")));
        }
        Err(e) => {
            let unfinished = a.out.join(wal::SALVAGE_INCOMPLETE_FILE).exists();
            // Busy too: a run again into the same directory is refused, it holds the
            // unfinished copy.
            return Err(match wal_error(&a.dir, e) {
                CliError::Failed(m) if unfinished => CliError::Failed(format!(
                    "{m}\nthe copy in {} did not finish: every open refuses it; remove the directory and salvage again",
                    a.out.display()
                )),
                // A writer took DIR while the copy was made (exit 3, as one found there).
                CliError::Busy(m) if unfinished => CliError::HeldByDaemon(format!(
                    "{m}: a writer took the log while it was copied\nthe copy in {} did not finish: every open refuses it; stop the daemon, remove the directory and salvage again",
                    a.out.display()
                )),
                other => other,
            });
        }
    };
    // The copy must open as a log, or it is no use to anyone.
    let copy = wal::Wal::open_read_only(&a.out)
        .map_err(|e| CliError::Failed(format!("the copy in {} does not open: {e}", a.out.display())))?;
    if copy.next_offset() != report.end_offset {
        return Err(CliError::Failed(format!(
            "the copy in {} ends at offset {}, expected {}",
            a.out.display(),
            copy.next_offset(),
            report.end_offset
        )));
    }
    drop(copy);
    give_the_logs_owner(&a.dir, &target, held_before.as_ref());
    // A torn tail is left out as recovery cuts it, and is no damage: it alone ends 0.
    let skipped_any = report.left_out_more_than_a_torn_tail();
    let verdict = if skipped_any { ExitCode::from(1) } else { ExitCode::SUCCESS };
    match print(&a, &report) {
        // A reader that went away still gets the verdict as the exit: a copy that skipped
        // something never exits 0.
        Ok(()) | Err(CliError::ClosedPipe) => Ok(verdict),
        Err(e) => Err(e),
    }
}

fn print(a: &SalvageArgs, report: &wal::salvage_copy::CopyReport) -> CliResult<()> {
    let mut out = stdout();
    if a.json {
        write_json_line(
            &mut out,
            &json!({
                "dir": path_json(&a.dir),
                "out": path_json(&a.out),
                "records": report.records,
                "payload_bytes": report.payload_bytes,
                "segments_written": report.segments_written,
                "first_offset": report.first_offset,
                "next_offset": report.next_offset,
                "end_offset": report.end_offset,
                "missing_offsets": report.missing_offsets.iter().map(|(a, b)| json!({"first": a, "last": b})).collect::<Vec<_>>(),
                "reserved_offsets": report.reserved_offsets.map(|(a, b)| json!({"first": a, "last": b})),
                "source_gaps": report.source_gaps.iter().map(|(a, b)| json!({"first": a, "last": b})).collect::<Vec<_>>(),
                "skipped": report.skipped.iter().map(|s| json!({"file": path_json(&s.file), "from": s.from, "to": s.to, "records": s.records, "why": s.why, "torn_tail": s.torn_tail})).collect::<Vec<_>>(),
                "partial_batch_records": report.partial_batch_records(),
                "log_id": report.log_id.map(|id| format!("{id:016x}")),
            }),
        )?;
    } else {
        for s in &report.skipped {
            let torn = if s.torn_tail {
                " (a torn tail: a write a crash cut short, never answered 200; not damage)"
            } else {
                ""
            };
            writeln!(
                out,
                "skipped {} bytes {}..{} ({} bytes): {}{torn}",
                s.file.display(),
                s.from,
                s.to,
                s.to - s.from,
                s.why
            )?;
        }
        for (first, last) in &report.missing_offsets {
            writeln!(out, "missing offsets {first}..={last} ({} record(s))", last - first + 1)?;
        }
        for (first, last) in &report.source_gaps {
            writeln!(
                out,
                "gap offsets {first}..={last}: not in DIR since an earlier salvage (reported then), kept as a gap; nothing lost now"
            )?;
        }
        if let Some((first, last)) = report.reserved_offsets {
            writeln!(
                out,
                "reserved offsets {first}..={last}: past the last record copied, given to no new record (they may have \
                 named records of what was skipped there)"
            )?;
        }
        // Bytes that do not check, or offsets missing, are damage; records of a batch that
        // is not whole alone are the trace of a write that never finished.
        let damage =
            report.skipped.iter().any(|s| s.records == 0 && !s.torn_tail) || !report.missing_offsets.is_empty();
        let partial: u64 = report.skipped.iter().filter(|s| !s.torn_tail).map(|s| s.records).sum();
        let left_out = match (damage, partial) {
            (false, 0) => "; nothing skipped".to_string(),
            (true, 0) => "; damage skipped, see above".to_string(),
            (false, n) => format!("; {n} record(s) of unfinished batches left out, see above"),
            (true, n) => format!("; damage and {n} record(s) of unfinished batches skipped, see above"),
        };
        let left_out = match (report.skipped.iter().any(|s| s.torn_tail), damage || partial > 0) {
            (false, _) => left_out,
            (true, false) => "; only a torn tail left out, as recovery cuts it".to_string(),
            (true, true) => format!("{left_out}; a torn tail left out too, as recovery cuts it"),
        };
        let range = match (report.first_offset, report.next_offset) {
            (Some(f), Some(n)) => format!("offsets {f}..{n}"),
            _ => "no records".into(),
        };
        writeln!(
            out,
            "copied {} record(s) ({}, {range}) into {} ({} segment(s)){left_out}; the copy continues at offset {}",
            report.records,
            human_bytes(report.payload_bytes),
            a.out.display(),
            report.segments_written,
            report.end_offset,
        )?;
        // Whether a state database beside the log will take the copy in its place.
        match report.log_id {
            Some(id) => writeln!(
                out,
                "the copy carries the log's identity ({id:016x}): moved into the log's place, the state database beside it takes it"
            )?,
            None => writeln!(
                out,
                "the copy carries no identity (the log had none that reads whole): moved into the log's place, a start refuses it as another log until `iggy-ingest state forget-log --data-dir DATA_DIR --yes` (its records are then delivered again)"
            )?,
        }
    }
    out.flush()?;
    Ok(())
}

/// Refuses an `--out` the copy cannot usefully go to: the log directory itself, a
/// directory inside it or one holding it, or a path that exists (or runs through
/// something that exists) and is not a directory.
/// Checks `--out`; returns where it leads, symlinks resolved.
fn check_out(dir: &Path, out: &Path) -> CliResult<PathBuf> {
    let failed = |p: &Path, e: io::Error| CliError::Failed(format!("{}: {e}", p.display()));
    let log = dir.canonicalize().map_err(|e| failed(dir, e))?;
    let usage = |why: String| CliError::Usage(format!("--out {} {why}", out.display()));
    let beside = format!("give a new directory beside it (e.g. {}.salvaged)", log.display());
    let target = match resolve(out).map_err(|e| failed(out, e))? {
        Resolved::To(p) => p,
        Resolved::NotADirectory => {
            return Err(usage("exists and is not a directory; salvage needs a new directory".into()));
        }
        Resolved::Through(p) => {
            return Err(usage(format!("runs through {}, which is not a directory", p.display())));
        }
    };
    if target == log {
        Err(usage(format!("is the log directory itself; {beside}")))
    } else if target.starts_with(&log) {
        Err(usage(format!("is inside the log directory {}, which salvage never writes to; {beside}", log.display())))
    } else if log.starts_with(&target) {
        Err(usage(format!("holds the log directory {}; {beside}", log.display())))
    } else {
        Ok(target)
    }
}

enum Resolved {
    /// Where the path leads, symlinks and `..` resolved.
    To(PathBuf),
    /// The path exists and is not a directory.
    NotADirectory,
    /// The path runs through this, which exists and is not a directory.
    Through(PathBuf),
}

/// Where `out` leads once created, as the kernel resolves it: relative to the working
/// directory, every existing part with its symlinks resolved, and the parts below the
/// last existing one (which cannot be symlinks) as written, `..` removing the part
/// before it (as `create_dir_all` meets it).
fn resolve(out: &Path) -> io::Result<Resolved> {
    let absolute = std::path::absolute(out)?;
    let mut at = PathBuf::new();
    // How many of the last parts of `at` do not exist; 0: `at` exists and is canonical.
    let mut missing = 0usize;
    for part in absolute.components() {
        if missing == 0 && matches!(part, Component::ParentDir | Component::Normal(_)) && !at.is_dir() {
            return Ok(Resolved::Through(at));
        }
        match part {
            Component::Prefix(_) | Component::RootDir => at.push(part),
            Component::CurDir => {}
            Component::ParentDir => {
                // Of a canonical path, the parent is where `..` leads.
                at.pop();
                missing = missing.saturating_sub(1);
            }
            Component::Normal(name) if missing > 0 => {
                at.push(name);
                missing += 1;
            }
            Component::Normal(name) => {
                let next = at.join(name);
                match next.canonicalize() {
                    Ok(p) => at = p,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        at = next;
                        missing = 1;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    }
    if missing == 0 && !at.is_dir() {
        return Ok(Resolved::NotADirectory);
    }
    Ok(Resolved::To(at))
}

/// Gives what salvage wrote into `out` (the directory itself when salvage made it, and
/// the entries it added; never what was there before) the owner of the log in `dir`
/// (the daemon's user), as the state commands do with what they make: salvage is run
/// as root after a disk error, and a copy owned by root, put in the log's place, would
/// refuse the daemon its own lock at the next start. `out` is the resolved path, so a
/// symlink given as `--out` is not what changes owner. Where that cannot be done (not
/// run as root), or `out` existed with another owner, says what to run instead; the
/// copy itself is sound either way.
fn give_the_logs_owner(dir: &Path, out: &Path, held_before: Option<&std::collections::HashSet<std::ffi::OsString>>) {
    use std::os::unix::fs::MetadataExt;
    let Ok(owner) = std::fs::metadata(dir) else { return };
    let (uid, gid) = (owner.uid(), owner.gid());
    let owned_so = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.uid() == uid && m.gid() == gid);
    let mut made: Vec<PathBuf> = Vec::new();
    if held_before.is_none() {
        made.push(out.to_path_buf());
    }
    if let Ok(entries) = std::fs::read_dir(out) {
        made.extend(
            entries.flatten().filter(|e| held_before.is_none_or(|h| !h.contains(&e.file_name()))).map(|e| e.path()),
        );
    }
    let mut failed = None;
    for path in &made {
        if !owned_so(path)
            && let Err(e) = std::os::unix::fs::lchown(path, Some(uid), Some(gid))
        {
            failed.get_or_insert(format!("{}: {e}", path.display()));
        }
    }
    if failed.is_none() && !owned_so(out) {
        failed = Some(format!("{} existed with another owner and was left so", out.display()));
    }
    if let Some(why) = failed {
        super::say(format_args!(
            "the copy is not owned as the log is ({why}): before putting it in the log's place, run `chown -R \
             {uid}:{gid} {}`",
            out.display()
        ));
    }
}
