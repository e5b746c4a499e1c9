//! `wal inspect`: what a log holds and for whom.
//!
//! Segments and offsets come from the log (read-only). Each destination's cursor comes
//! from the daemon's state database, `DATA_DIR/state.redb`, which redb locks for as long
//! as the daemon runs. So:
//! - daemon stopped: the cursors are read from the database (redb's read-only open, for
//!   the moment of the read), and held records, bytes and the oldest held age are
//!   counted from the log: every record of a destination at or above its cursor;
//! - daemon running: the database cannot be read; the table says so, still lists every
//!   destination the log holds records for (without cursors), and `--admin URL` reads
//!   the cursors and held figures from the running daemon's admin API
//!   (`GET /status`, `GET /connectors/{key}/destinations`) instead.
//!
//! Invariants:
//! - One read-only view of the log serves the whole report (segments and records agree).
//! - Nothing is written anywhere; the state database is never opened for writing.
//! - A figure that cannot be known is shown as unknown (`-`, `null`), never guessed.
//! - At most [`DESTINATIONS_MAX`] destinations are kept, one entry each: the records of
//!   any further destination are counted together (`left_out`), never dropped from the
//!   figures, so a log a runaway route filled with distinct topics cannot make the tool
//!   hold memory in proportion to the log.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use ingest::{CursorsSnapshot, Envelope};
use serde_json::{Value, json};

use super::{
    CliError, CliResult, default_state_path, human_age, human_bytes, open_log, path_json, rfc3339_ms, stdout,
    wal_error, write_json_line, writer_running,
};
use crate::terminal_text::safe as terminal_safe;

#[derive(Debug, Args)]
pub struct InspectArgs {
    /// The log directory (the daemon's DATA_DIR/wal).
    pub dir: PathBuf,
    /// A JSON report on standard output, for scripts.
    #[arg(long)]
    pub json: bool,
    /// The state database (default: state.redb beside the log directory).
    #[arg(long, value_name = "FILE")]
    pub state: Option<PathBuf>,
    /// Read cursors and held figures from the running daemon's admin API
    /// (http://HOST:PORT, or https://HOST:PORT with --admin-ca).
    #[arg(long, value_name = "URL")]
    pub admin: Option<String>,
    /// PEM certificates to trust for an https:// --admin: the admin listener's own
    /// certificate, or the CA it chains to.
    #[arg(long, value_name = "FILE", requires = "admin")]
    pub admin_ca: Option<PathBuf>,
    /// Bearer token for the admin API (default: $IGGY_INGEST_ADMIN_TOKEN).
    #[arg(long, value_name = "TOKEN")]
    pub admin_token: Option<String>,
    /// The daemon's configuration, for the log's capacity (only wal.max_bytes is read).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Skip reading every record: no record times, no held counts from the log.
    #[arg(long)]
    pub quick: bool,
}

#[derive(Debug, Default, Clone)]
struct Lane {
    cursor: Option<u64>,
    records_in_log: u64,
    held_records: Option<u64>,
    held_bytes: Option<u64>,
    oldest_held_age_ms: Option<u64>,
    status: Option<String>,
}

type LaneKey = (String, String, String);

/// The most destinations `wal inspect` lists (and keeps an entry for, about a hundred
/// bytes each and their names). The router keeps at most `max_destinations` per source
/// (1000 by default, at most 100 000), but the log also holds the records of
/// destinations it refused for that cap.
const DESTINATIONS_MAX: usize = 100_000;
type AdminLane = (LaneKey, Lane);

pub(crate) fn run(a: InspectArgs) -> CliResult {
    let admin = a.admin.as_deref().map(|url| admin_target(url, a.admin_ca.as_deref())).transpose()?;
    // Every argument is checked before the log is opened: `--config` also where the
    // admin API will name the log's capacity, the admin token as a header value, and a
    // `--state` that names nothing (named by the operator: a mistyped argument).
    let max_bytes_from_config = a.config.as_deref().map(config_max_bytes).transpose()?;
    if admin.is_none()
        && let Some(state) = &a.state
    {
        if std::fs::symlink_metadata(state).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) {
            return Err(CliError::Usage(format!("--state {}: no such file", state.display())));
        }
        // Never opened (a FIFO would block the read-only open): no database is there.
        if let Some(kind) = ingest::state::not_a_file(state) {
            return Err(CliError::Usage(format!("--state {}: it is {kind}, not a state database", state.display())));
        }
    }
    let token = a.admin_token.clone().or_else(|| std::env::var("IGGY_INGEST_ADMIN_TOKEN").ok());
    if admin.is_some()
        && let Some(t) = &token
        && hyper::header::HeaderValue::try_from(format!("Bearer {t}")).is_err()
    {
        return Err(CliError::Usage(
            "--admin-token (or IGGY_INGEST_ADMIN_TOKEN): not a header value (it holds a control character: a \
             newline read with it from a file?)"
                .to_string(),
        ));
    }
    let wal = open_log(&a.dir)?;
    let running = writer_running(&a.dir);
    let segments = wal::inspect::segments_of(&wal).map_err(|e| wal_error(&a.dir, e))?;
    let stats = wal.stats();
    let now_ms = ingest::time::now_unix_ms();

    // Cursors: the state database when it is free, else the admin API when given.
    let mut lanes: BTreeMap<LaneKey, Lane> = BTreeMap::new();
    let mut max_bytes: Option<u64> = None;
    let mut asked_sources = BTreeSet::new();
    let (cursor_source, cursor_note) = if let Some(target) = &admin {
        let (rows, log_max, sources) = admin_lanes(target, token.as_deref())?;
        max_bytes = log_max;
        asked_sources = sources;
        for (k, l) in rows {
            lanes.insert(k, l);
        }
        ("admin", format!("cursors and held figures from the running daemon at {}", target.url))
    } else {
        let path = a.state.clone().or_else(|| default_state_path(&a.dir));
        // This log's identity, read once (none, or one not whole: nothing to compare).
        let ours = wal::identity::read_in(&a.dir).ok().flatten();
        match path.as_deref().map(ingest::read_cursors_read_only) {
            None => ("unavailable", "no state database found beside the log; pass --state FILE".to_string()),
            // Cursors are offsets of one log: another's would count its records held or
            // delivered by offsets that name other records here.
            Some(Ok(CursorsSnapshot::Read { log_id: Some(theirs), .. })) if ours.is_some_and(|ours| ours != theirs) => {
                let ours = ours.unwrap_or_default();
                (
                    "unavailable",
                    format!(
                        "the state database's cursors are another log's (identity {theirs:016x}; this log's is {ours:016x}): held records are not counted"
                    ),
                )
            }
            Some(Ok(CursorsSnapshot::Read { cursors, from_repaired_copy, .. })) => {
                for c in cursors {
                    lanes.entry((c.source, c.stream, c.topic)).or_default().cursor = Some(c.delivered_below);
                }
                let from = path.as_deref().map(|p| p.display().to_string()).unwrap_or_default();
                let note = if from_repaired_copy {
                    format!("cursors from {from}, {}", ingest::state::REPAIRED_COPY_NOTE)
                } else {
                    format!("cursors from {from}")
                };
                ("state", note)
            }
            Some(Ok(CursorsSnapshot::Missing)) => (
                "unavailable",
                format!(
                    "no state database at {} (nothing delivered yet, or pass --state FILE)",
                    path.as_deref().map(|p| p.display().to_string()).unwrap_or_default()
                ),
            ),
            Some(Ok(CursorsSnapshot::HeldByRunningDaemon)) => (
                "unavailable",
                "the running daemon holds the state database; pass --admin http://HOST:PORT to read cursors from it"
                    .to_string(),
            ),
            Some(Err(e)) => ("unavailable", format!("cannot read the state database: {e}")),
        }
    };
    if max_bytes.is_none() {
        max_bytes = max_bytes_from_config;
    }

    // One pass over the records: per-segment times, per-destination counts.
    let mut first_time: BTreeMap<u64, u64> = BTreeMap::new();
    let mut last_time: BTreeMap<u64, u64> = BTreeMap::new();
    let mut undecodable = 0u64;
    // Records of destinations past `DESTINATIONS_MAX`, counted together; such a
    // destination has no stored cursor (those are all listed), so all its records are held.
    let mut left_out = Lane::default();
    if !a.quick {
        let count_held = cursor_source == "state";
        let mut seg_iter = segments.iter().peekable();
        let records = wal::inspect::Records::new(&wal, wal.start_offset()).map_err(|e| wal_error(&a.dir, e))?;
        let progress = super::ScanProgress::new(wal.start_offset(), wal.next_offset(), false);
        for r in records {
            let r = r.map_err(|e| wal_error(&a.dir, e))?;
            progress.at(r.offset);
            while seg_iter.peek().is_some_and(|s| r.offset >= s.next_offset) {
                seg_iter.next();
            }
            let Ok(e) = Envelope::decode(&r.payload) else {
                undecodable += 1;
                continue;
            };
            let t = e.header.received_at_unix_ms;
            if let Some(s) = seg_iter.peek() {
                first_time.entry(s.base_offset).or_insert(t);
                last_time.insert(s.base_offset, t);
            }
            let d = &e.header.destination;
            let key = (e.header.source_key.clone(), d.stream.clone(), d.topic.clone());
            let lane = if lanes.len() < DESTINATIONS_MAX || lanes.contains_key(&key) {
                lanes.entry(key).or_default()
            } else {
                &mut left_out
            };
            lane.records_in_log += 1;
            if count_held && lane.cursor.is_none_or(|c| r.offset >= c) {
                *lane.held_records.get_or_insert(0) += 1;
                *lane.held_bytes.get_or_insert(0) += e.payload.len() as u64;
                if lane.oldest_held_age_ms.is_none() {
                    lane.oldest_held_age_ms = Some(now_ms.saturating_sub(t));
                }
            }
        }
        if count_held {
            for l in lanes.values_mut().chain((left_out.records_in_log > 0).then_some(&mut left_out)) {
                l.held_records.get_or_insert(0);
                l.held_bytes.get_or_insert(0);
            }
        }
        // A source no longer configured is in the daemon's `/status` only once the router
        // made a lane for it, but its records in the log pin the log (which is what an
        // operator runs this to find): asked for by name.
        if let Some(target) = &admin {
            let unasked: BTreeSet<String> =
                lanes.keys().map(|k| k.0.clone()).filter(|s| !asked_sources.contains(s)).collect();
            for src in unasked {
                for (k, l) in admin_destinations(target, token.as_deref(), &src)? {
                    let lane = lanes.entry(k).or_default();
                    *lane = Lane { records_in_log: lane.records_in_log, ..l };
                }
            }
        }
    }

    let report = wal.open_report();
    // Offsets between the head and the tail that the log does not hold (a salvage skipped
    // them): not records.
    let missing: Vec<std::ops::Range<u64>> = report
        .missing_ranges
        .iter()
        .map(|r| r.start.max(stats.start_offset)..r.end.min(stats.next_offset))
        .filter(|r| r.start < r.end)
        .collect();
    let records = stats.next_offset - stats.start_offset - missing.iter().map(|r| r.end - r.start).sum::<u64>();
    let shutdown = if running {
        "running"
    } else if report.clean_shutdown {
        "clean"
    } else {
        "not clean (recovered on next start)"
    };
    let mut out = stdout();
    if a.json {
        let segs: Vec<Value> = segments
            .iter()
            .map(|s| {
                json!({
                    "file": path_json(&s.path),
                    "first_offset": s.base_offset,
                    "last_offset": (s.records > 0).then(|| s.next_offset - 1),
                    "next_offset": s.next_offset,
                    "records": s.records,
                    "bytes": s.bytes,
                    "sealed": s.sealed,
                    "gap_before": s.gap_before,
                    "first_record_at": first_time.get(&s.base_offset).map(|&t| rfc3339_ms(t)),
                    "last_record_at": last_time.get(&s.base_offset).map(|&t| rfc3339_ms(t)),
                })
            })
            .collect();
        let lane_json: Vec<Value> = lanes
            .iter()
            .map(|((src, stream, topic), l)| {
                json!({
                    "source": src, "stream": stream, "topic": topic,
                    "cursor": l.cursor,
                    "records_in_log": if a.quick || cursor_source == "admin" { None } else { Some(l.records_in_log) },
                    "held_records": l.held_records,
                    "held_bytes": l.held_bytes,
                    "oldest_held_age_ms": l.oldest_held_age_ms,
                    "status": l.status,
                })
            })
            .collect();
        write_json_line(
            &mut out,
            &json!({
                "dir": path_json(&a.dir),
                "writer_running": running,
                "clean_shutdown": if running { None } else { Some(report.clean_shutdown) },
                "torn_tail": report.torn_at.as_ref().map(|t| json!({"file": path_json(&t.file), "position": t.position, "zeros_only": report.torn_tail_zeros_only})),
                "start_offset": stats.start_offset,
                "next_offset": stats.next_offset,
                "records": records,
                "missing_ranges": missing.iter().map(|r| json!({"from": r.start, "to": r.end})).collect::<Vec<_>>(),
                "used_bytes": stats.used_bytes,
                "max_bytes": max_bytes,
                "capacity_used": max_bytes.map(|m| stats.used_bytes as f64 / m.max(1) as f64),
                "segments": segs,
                "undecodable_records": if a.quick { None } else { Some(undecodable) },
                "destinations": {
                    "cursors_from": cursor_source,
                    "note": cursor_note,
                    "lanes": lane_json,
                    "left_out": (left_out.records_in_log > 0).then(|| json!({
                        "listed_max": DESTINATIONS_MAX,
                        "records_in_log": left_out.records_in_log,
                        "held_records": left_out.held_records,
                        "held_bytes": left_out.held_bytes,
                        "oldest_held_age_ms": left_out.oldest_held_age_ms,
                    })),
                },
            }),
        )?;
        out.flush()?;
        return Ok(ExitCode::SUCCESS);
    }

    writeln!(out, "log       {}", a.dir.display())?;
    writeln!(out, "writer    {}", if running { "running (read up to its last sync)" } else { "stopped" })?;
    writeln!(out, "shutdown  {shutdown}")?;
    if let Some(t) = &report.torn_at {
        if report.torn_tail_zeros_only {
            writeln!(out, "torn tail {t} (only the zeros written ahead of the last write; cut on the next start)")?;
        } else {
            writeln!(out, "torn tail {t} (an interrupted write; cut on the next start)")?;
        }
    }
    writeln!(
        out,
        "offsets   {}..{} ({} records; head {}, tail {})",
        stats.start_offset, stats.next_offset, records, stats.start_offset, stats.next_offset
    )?;
    for r in &missing {
        writeln!(out, "missing   {}..{} ({} offset(s) a salvage skipped)", r.start, r.end, r.end - r.start)?;
    }
    match max_bytes {
        Some(m) => writeln!(
            out,
            "capacity  {} of {} used ({:.1}%)",
            human_bytes(stats.used_bytes),
            human_bytes(m),
            100.0 * stats.used_bytes as f64 / m.max(1) as f64
        )?,
        None => writeln!(
            out,
            "capacity  {} used (limit unknown: pass --config FILE or --admin URL)",
            human_bytes(stats.used_bytes)
        )?,
    }
    if undecodable > 0 {
        writeln!(out, "warning   {undecodable} record(s) are not envelopes (see `wal dump`)")?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "{:<26} {:>12} {:>12} {:>9} {:>10} {:<6} {:<24} {:<11}",
        "SEGMENT", "FIRST", "LAST", "RECORDS", "BYTES", "SEALED", "FIRST RECORD", "LAST RECORD"
    )?;
    for s in &segments {
        let name = s.path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let last = if s.records > 0 { (s.next_offset - 1).to_string() } else { "-".into() };
        let t = |m: &BTreeMap<u64, u64>| m.get(&s.base_offset).map_or("-".to_string(), |&t| rfc3339_ms(t));
        writeln!(
            out,
            "{:<26} {:>12} {:>12} {:>9} {:>10} {:<6} {:<24} {}",
            name,
            s.base_offset,
            last,
            s.records,
            human_bytes(s.bytes),
            if s.sealed { "yes" } else { "no" },
            t(&first_time),
            t(&last_time)
        )?;
    }
    writeln!(out)?;
    writeln!(out, "destinations: {cursor_note}")?;
    if lanes.is_empty() {
        writeln!(out, "  (none)")?;
    } else {
        writeln!(
            out,
            "{:<16} {:<32} {:>12} {:>12} {:>12} {:>12}",
            "SOURCE", "STREAM/TOPIC", "CURSOR", "HELD", "HELD BYTES", "OLDEST HELD"
        )?;
        for ((src, stream, topic), l) in &lanes {
            let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
            writeln!(
                out,
                "{:<16} {:<32} {:>12} {:>12} {:>12} {:>12}",
                // Names read from records: a log written elsewhere may hold anything.
                terminal_safe(src),
                format!("{}/{}", terminal_safe(stream), terminal_safe(topic)),
                opt(l.cursor),
                opt(l.held_records),
                l.held_bytes.map_or("-".to_string(), human_bytes),
                l.oldest_held_age_ms.map_or("-".to_string(), human_age)
            )?;
        }
    }
    if left_out.records_in_log > 0 {
        writeln!(
            out,
            "left out  destinations past the first {DESTINATIONS_MAX} listed: {} record(s) in the log{}",
            left_out.records_in_log,
            match (left_out.held_records, left_out.held_bytes) {
                (Some(r), Some(b)) => format!(", {r} held ({}), none with a cursor", human_bytes(b)),
                _ => String::new(),
            }
        )?;
    }
    if cursor_source == "state" && lanes.values().any(|l| l.cursor.is_none()) {
        writeln!(
            out,
            "note      a destination without a cursor (-) has delivered nothing yet, or is one the router gives up on or refuses (its records then pin nothing); --admin tells"
        )?;
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

/// `wal.max_bytes` of the daemon's configuration file: only that is read, so the file
/// serves without the environment the daemon runs in (its token variables, say).
fn config_max_bytes(path: &std::path::Path) -> CliResult<u64> {
    crate::config::load_wal_max_bytes(path).map_err(|e| CliError::Usage(format!("--config {}: {e}", path.display())))
}

/// Where `--admin` points: the URL (for messages), its `HOST:PORT`, and for an https://
/// URL the TLS client that trusts `--admin-ca` and the name the certificate must carry.
struct AdminTarget<'a> {
    url: &'a str,
    address: &'a str,
    tls: Option<(tokio_rustls::TlsConnector, rustls::pki_types::ServerName<'static>)>,
}

/// An `--admin http://HOST:PORT[/]` or `https://HOST:PORT[/]` URL, checked as the
/// connection will take it (an https:// one with the certificates of `ca` to trust);
/// anything else is an unusable argument.
fn admin_target<'a>(url: &'a str, ca: Option<&std::path::Path>) -> CliResult<AdminTarget<'a>> {
    let usage =
        |why: String| CliError::Usage(format!("--admin {url}: {why}; expected http://HOST:PORT or https://HOST:PORT"));
    let (rest, https) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
        (Some(rest), _) => (rest, false),
        (_, Some(rest)) => (rest, true),
        _ => return Err(usage("not an http:// or https:// URL".into())),
    };
    let address = rest.strip_suffix('/').unwrap_or(rest);
    if address.contains('/') {
        return Err(usage("has a path".into()));
    }
    if let Some(why) = crate::host_port::problem(address) {
        return Err(usage(format!("{address:?} {why}")));
    }
    let tls = match (https, ca) {
        (false, None) => None,
        (false, Some(_)) => return Err(usage("--admin-ca is for an https:// URL".into())),
        (true, None) => {
            return Err(usage(
                "an https:// URL needs --admin-ca FILE (the admin listener's certificate, or the CA it chains to)"
                    .into(),
            ));
        }
        (true, Some(ca)) => Some(admin_tls(address, ca)?),
    };
    Ok(AdminTarget { url, address, tls })
}

/// A TLS client trusting the PEM certificates in `ca`, and the server name of `address`
/// (its host: a DNS name, or an IP address, brackets left off).
fn admin_tls(
    address: &str,
    ca: &std::path::Path,
) -> CliResult<(tokio_rustls::TlsConnector, rustls::pki_types::ServerName<'static>)> {
    let roots = crate::config::ca_roots(ca).map_err(|why| CliError::Usage(format!("--admin-ca: {why}")))?;
    let host = address.rsplit_once(':').map_or(address, |(host, _)| host);
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    let name = rustls::pki_types::ServerName::try_from(host.to_string()).map_err(|e| {
        CliError::Usage(format!("--admin {address}: {host:?} is not a name to check a certificate against: {e}"))
    })?;
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(http_source::tls::provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| CliError::Failed(format!("TLS: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok((tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)), name))
}

/// Cursors and held figures of every connector's destinations, and the log's capacity,
/// from a running daemon's admin API.
/// Also returns the sources asked for (those of `/status`: the configured ones, and those
/// the router has lanes for).
fn admin_lanes(
    target: &AdminTarget<'_>,
    token: Option<&str>,
) -> CliResult<(Vec<AdminLane>, Option<u64>, BTreeSet<String>)> {
    // A 404 here is not a daemon's admin listener (the webhook listener, say): an error,
    // never an empty answer.
    let url = target.url;
    let status = http_get_json(target, "/status", token)?
        .ok_or_else(|| CliError::Failed(format!("admin API {url}/status: HTTP 404: not a daemon's admin listener")))?;
    let max = status["log"]["max_bytes"].as_u64();
    let sources: BTreeSet<String> =
        status["sources"].as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
    let mut out = Vec::new();
    for src in &sources {
        out.extend(admin_destinations(target, token, src)?);
    }
    Ok((out, max, sources))
}

/// The destinations the running daemon shows for source `src` (none if it knows no such
/// connector: a source no longer configured whose lanes the router has not made yet),
/// every page of them: the listing answers [`ADMIN_PAGE_LIMIT`] at a time, by stream and
/// topic, and names where the next page starts (`next_after`). At most
/// [`DESTINATIONS_MAX`] are read, and a page that does not move past the one before is
/// an error, so a daemon that answers wrongly cannot keep the command walking.
fn admin_destinations(target: &AdminTarget<'_>, token: Option<&str>, src: &str) -> CliResult<Vec<AdminLane>> {
    use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
    // Names are [a-zA-Z0-9._-] and a slash parts them: those stay as they are, so that
    // a daemon that does not percent-decode its query (before this paging) reads them.
    const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC.remove(b'/').remove(b'.').remove(b'-').remove(b'_');
    let mut out = Vec::new();
    // A source key read from the log is not trusted to be a path segment (a `?`, `/` or
    // space in it would ask for another resource, or no valid URI at all): escaped.
    let segment = utf8_percent_encode(src, NON_ALPHANUMERIC);
    let mut after: Option<String> = None;
    loop {
        let mut path = format!("/connectors/{segment}/destinations?limit={ADMIN_PAGE_LIMIT}");
        if let Some(a) = &after {
            path.push_str(&format!("&after={}", utf8_percent_encode(a, QUERY_VALUE)));
        }
        let Some(v) = http_get_json(target, &path, token)? else {
            return Ok(out);
        };
        for d in v["destinations"].as_array().into_iter().flatten() {
            let key = (
                src.to_string(),
                d["stream"].as_str().unwrap_or_default().to_string(),
                d["topic"].as_str().unwrap_or_default().to_string(),
            );
            out.push((
                key,
                Lane {
                    cursor: d["cursor"].as_u64(),
                    records_in_log: 0,
                    held_records: d["held_records"].as_u64(),
                    held_bytes: d["held_bytes"].as_u64(),
                    oldest_held_age_ms: d["oldest_held_age_ms"].as_u64(),
                    status: d["status"].as_str().map(str::to_string),
                },
            ));
        }
        let Some(next) = v["next_after"].as_str() else {
            return Ok(out);
        };
        let failed = |why: &str| CliError::Failed(format!("admin API {}{path}: {why}", target.url));
        // Pages are in order of (stream, topic), which is not the order of the joined
        // text ("a/z" sorts after "a.b/c", its page before it).
        let by_name = |a: &str| a.split_once('/').map(|(s, t)| (s.to_string(), t.to_string()));
        if after.as_deref().is_some_and(|a| by_name(next) <= by_name(a)) {
            return Err(failed(&format!("the next page starts at {next:?}, not past {after:?}")));
        }
        if out.len() >= DESTINATIONS_MAX {
            return Err(failed(&format!("more than {DESTINATIONS_MAX} destinations listed for source {src:?}")));
        }
        after = Some(next.to_string());
    }
}

/// Destinations asked for per request of [`admin_destinations`]: the listing's default
/// page, well inside [`ADMIN_ANSWER_MAX_BYTES`] (a destination is a few hundred bytes).
const ADMIN_PAGE_LIMIT: usize = crate::admin::LIST_LIMIT_DEFAULT;

/// One request on a new HTTP/1.1 connection over `io`.
async fn send_over<IO>(
    io: IO,
    request: hyper::Request<http_body_util::Empty<bytes::Bytes>>,
) -> Result<hyper::Response<hyper::body::Incoming>, hyper::Error>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io)).await?;
    tokio::spawn(conn);
    sender.send_request(request).await
}

/// The most of an admin API answer `--admin` reads.
const ADMIN_ANSWER_MAX_BYTES: usize = 16 * 1024 * 1024;

/// How much of an answer other than 200 the error shows: the daemon's own errors are a
/// line of JSON, and anything longer (a proxy's HTML page) is not the daemon's.
const ADMIN_ERROR_SHOWN_CHARS: usize = 512;

/// `GET path` from the admin API at `target` (checked by [`admin_target`]) with hyper
/// (one connection, over TLS for an https:// URL, on a runtime of its own: the CLI has
/// none), JSON body expected; 10 s for the whole exchange. `None` for a 404.
fn http_get_json(target: &AdminTarget<'_>, path: &str, token: Option<&str>) -> CliResult<Option<Value>> {
    use http_body_util::{BodyExt, Empty};
    let (base, host) = (target.url, target.address);
    let usage = |m: String| CliError::Usage(format!("--admin {base}: {m}"));
    let failed = |m: String| CliError::Failed(format!("admin API {base}{path}: {m}"));
    let mut request = hyper::Request::get(path).header(hyper::header::HOST, host);
    if let Some(t) = token {
        request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let request = request.body(Empty::<bytes::Bytes>::new()).map_err(|e| usage(e.to_string()))?;
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| failed(e.to_string()))?;
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(host).await.map_err(|e| failed(e.to_string()))?;
        let answer = match &target.tls {
            None => send_over(stream, request).await,
            Some((connector, name)) => {
                let tls = connector.connect(name.clone(), stream).await.map_err(|e| failed(format!("TLS: {e}")))?;
                send_over(tls, request).await
            }
        }
        .map_err(|e| failed(e.to_string()))?;
        let code = answer.status();
        // Bounded: the daemon's largest answer (a thousand destinations) is far below.
        let body = http_body_util::Limited::new(answer.into_body(), ADMIN_ANSWER_MAX_BYTES)
            .collect()
            .await
            .map_err(|e| failed(format!("{e} (at most {ADMIN_ANSWER_MAX_BYTES} bytes are read)")))?
            .to_bytes();
        Ok::<_, CliError>((code, body))
    };
    let (code, body) = runtime
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), exchange).await })
        .map_err(|_| failed("no answer within 10 s".into()))??;
    if code == hyper::StatusCode::NOT_FOUND {
        return Ok(None);
    }
    if code != hyper::StatusCode::OK {
        let hint = if code == hyper::StatusCode::UNAUTHORIZED {
            " (pass --admin-token or set IGGY_INGEST_ADMIN_TOKEN)"
        } else {
            ""
        };
        // Whatever answers at that address chose the body: shown escaped, and only its
        // start (a proxy's error page can be long).
        let body = String::from_utf8_lossy(&body);
        let body = body.trim();
        let shown: String = body.chars().take(ADMIN_ERROR_SHOWN_CHARS).collect();
        let cut = if shown.len() < body.len() { " …" } else { "" };
        return Err(failed(format!("HTTP {}{hint}: {}{cut}", code.as_u16(), terminal_safe(&shown))));
    }
    serde_json::from_slice(&body).map(Some).map_err(|e| failed(format!("not JSON: {e}")))
}
