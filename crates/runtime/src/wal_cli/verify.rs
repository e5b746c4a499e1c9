//! `wal verify`: every segment header, record checksum and the offset sequence.
//!
//! Invariants:
//! - Every byte of every segment (up to a running writer's durable watermark) is read
//!   once, in large sequential reads, with no allocation per record (`wal::inspect::verify`).
//! - Exit 0 clean (a torn tail, the normal trace of a crash, is reported but is not
//!   damage), 1 damaged with every problem named by file and byte position, 2 unusable
//!   arguments (including a path that holds no log), 3 busy: a writer holds the log and its
//!   durable state could not be read consistently for a while (run it again).
//! - The progress bar is drawn on standard error only when it is a terminal.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::Args;
use serde_json::json;
use wal::storage::FsStorage;

use super::{CliError, CliResult, human_bytes, path_json, stdout, wal_error, write_json_line};

#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// The log directory (the daemon's DATA_DIR/wal).
    pub dir: PathBuf,
    /// A JSON report on standard output, for scripts.
    #[arg(long)]
    pub json: bool,
}

pub(crate) fn run(a: VerifyArgs) -> CliResult {
    super::a_directory(&a.dir)?;
    let bar = super::BytesProgress::new();
    let started = Instant::now();
    let report = wal::inspect::verify(&FsStorage, &a.dir, &mut |p| bar.at(p));
    drop(bar);
    let report = report.map_err(|e| wal_error(&a.dir, e))?;
    let seconds = started.elapsed().as_secs_f64();
    let verdict = if report.is_clean() { ExitCode::SUCCESS } else { ExitCode::from(1) };
    match print(&a, &report, seconds) {
        // A reader that went away (`| grep -q DAMAGED`, `| head`) still gets the verdict
        // as the exit: a damaged log never exits 0.
        Ok(()) | Err(CliError::ClosedPipe) => Ok(verdict),
        Err(e) => Err(e),
    }
}

fn print(a: &VerifyArgs, report: &wal::inspect::VerifyReport, seconds: f64) -> CliResult<()> {
    let mut out = stdout();
    if a.json {
        let problems: Vec<serde_json::Value> = report
            .problems
            .iter()
            .map(|p| json!({"file": path_json(&p.location.file), "position": p.location.position, "problem": p.what}))
            .collect();
        write_json_line(
            &mut out,
            &json!({
                "dir": path_json(&a.dir),
                "clean": report.is_clean(),
                "segments": report.segments,
                "records": report.records,
                "bytes": report.bytes,
                "problems": problems,
                "torn_tail": report.torn_tail.as_ref().map(|t| json!({"file": path_json(&t.file), "position": t.position, "zeros_only": report.torn_tail_zeros_only})),
                "seconds": seconds,
            }),
        )?;
    } else {
        for p in &report.problems {
            writeln!(out, "DAMAGED {} at byte {}: {}", p.location.file.display(), p.location.position, p.what)?;
        }
        if let Some(t) = &report.torn_tail {
            let what = if report.torn_tail_zeros_only {
                "only the zeros written ahead of the last write (no write was interrupted)"
            } else {
                "an interrupted write"
            };
            writeln!(
                out,
                "torn tail {} at byte {}: {what}, not damage (the daemon's next start cuts it)",
                t.file.display(),
                t.position
            )?;
        }
        let verdict = if report.is_clean() {
            "clean".to_string()
        } else {
            format!("DAMAGED ({} problem(s))", report.problems.len())
        };
        writeln!(
            out,
            "{}: {} segment(s), {} record(s), {} checked in {:.2}s: {verdict}",
            a.dir.display(),
            report.segments,
            report.records,
            human_bytes(report.bytes),
            seconds
        )?;
    }
    out.flush().map_err(CliError::from)
}
