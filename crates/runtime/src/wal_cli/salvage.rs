//! `wal salvage DIR --out NEWDIR`: every record that still checks, copied under its own
//! offset into a new log (`wal::salvage_copy`), for the day a disk error damaged the
//! middle of a log.
//!
//! Invariants:
//! - The source is only read; nothing is written outside `--out`, which must not hold a
//!   log already.
//! - Offsets are kept, so the delivery cursors beside the log stay true for the copy;
//!   every skipped byte range and every missing offset range is reported.
//! - Exit 0 when everything was copied, 1 when damage was skipped (the copy is still a
//!   whole log), 2 for unusable arguments.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use serde_json::json;
use wal::storage::FsStorage;

use super::{CliError, CliResult, human_bytes, not_a_log, stdout, wal_error, write_json_line};

#[derive(Debug, Args)]
pub struct SalvageArgs {
    /// The damaged log directory (read only).
    pub dir: PathBuf,
    /// A new directory for the copy (created; must not hold a log).
    #[arg(long, value_name = "NEWDIR")]
    pub out: PathBuf,
    /// A JSON report on standard output, for scripts.
    #[arg(long)]
    pub json: bool,
}

pub(crate) fn run(a: SalvageArgs) -> CliResult {
    if !a.dir.is_dir() {
        return Err(not_a_log(&a.dir));
    }
    if let (Ok(x), Ok(y)) = (a.dir.canonicalize(), a.out.canonicalize())
        && x == y
    {
        return Err(CliError::Usage("--out must be a new directory, not the log itself".into()));
    }
    let report = match wal::salvage_copy::salvage_copy(&FsStorage, &a.dir, &a.out) {
        Ok(r) => r,
        Err(wal::WalError::InvalidOptions(m)) => return Err(CliError::Usage(m)),
        Err(e) => return Err(wal_error(&a.dir, e)),
    };
    // The copy must open as a log, or it is no use to anyone.
    if report.records > 0 {
        let copy = wal::Wal::open_read_only(&a.out)
            .map_err(|e| CliError::Failed(format!("the copy in {} does not open: {e}", a.out.display())))?;
        if copy.next_offset() != report.next_offset.unwrap_or(0) {
            return Err(CliError::Failed(format!(
                "the copy in {} ends at offset {}, expected {:?}",
                a.out.display(),
                copy.next_offset(),
                report.next_offset
            )));
        }
    }
    let mut out = stdout();
    let damaged = !report.skipped.is_empty() || !report.missing_offsets.is_empty();
    if a.json {
        write_json_line(
            &mut out,
            &json!({
                "dir": a.dir,
                "out": a.out,
                "records": report.records,
                "payload_bytes": report.payload_bytes,
                "segments_written": report.segments_written,
                "first_offset": report.first_offset,
                "next_offset": report.next_offset,
                "missing_offsets": report.missing_offsets.iter().map(|(a, b)| json!({"first": a, "last": b})).collect::<Vec<_>>(),
                "skipped": report.skipped.iter().map(|s| json!({"file": s.file, "from": s.from, "to": s.to, "why": s.why})).collect::<Vec<_>>(),
            }),
        )?;
    } else {
        for s in &report.skipped {
            writeln!(
                out,
                "skipped {} bytes {}..{} ({} bytes): {}",
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
        let range = match (report.first_offset, report.next_offset) {
            (Some(f), Some(n)) => format!("offsets {f}..{n}"),
            _ => "no records".into(),
        };
        writeln!(
            out,
            "copied {} record(s) ({}, {range}) into {} ({} segment(s)){}",
            report.records,
            human_bytes(report.payload_bytes),
            a.out.display(),
            report.segments_written,
            if damaged { "; damage skipped, see above" } else { "; nothing skipped" }
        )?;
    }
    out.flush()?;
    Ok(if damaged { ExitCode::from(1) } else { ExitCode::SUCCESS })
}
