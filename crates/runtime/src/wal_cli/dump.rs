//! `wal dump`: the decoded envelopes of a log, streamed.
//!
//! Invariants:
//! - Records come out in offset order, one at a time: memory stays bounded by one read
//!   batch whatever the log's size, and the first lines appear at once.
//! - `--limit` counts records shown (after the filters), not records read.
//! - A record that does not decode as an envelope is shown (base64) and never matches a
//!   `--source` or `--destination` filter.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use bytes::Bytes;
use clap::Args;
use ingest::{Envelope, Partitioning};
use serde_json::json;

use crate::terminal_text::safe as terminal_safe;

use super::{CliError, CliResult, open_log, payload_text, rfc3339_ms, stdout, wal_error, write_json_line};

#[derive(Debug, Args)]
pub struct DumpArgs {
    /// The log directory (the daemon's DATA_DIR/wal).
    pub dir: PathBuf,
    /// First offset to show (default: the log's first retained offset).
    #[arg(long, value_name = "N")]
    pub from: Option<u64>,
    /// Show at most this many records (after filtering).
    #[arg(long, value_name = "M")]
    pub limit: Option<u64>,
    #[command(flatten)]
    pub filter: FilterArgs,
    #[command(flatten)]
    pub format: FormatArgs,
}

#[derive(Debug, Clone, Args)]
pub struct FilterArgs {
    /// Only records accepted by this source (connector key).
    #[arg(long, value_name = "KEY")]
    pub source: Option<String>,
    /// Only records routed to this destination.
    #[arg(long, value_name = "STREAM/TOPIC")]
    pub destination: Option<String>,
}

#[derive(Debug, Clone, Args)]
pub struct FormatArgs {
    /// One JSON object per record and line (NDJSON), for scripts.
    #[arg(long, conflicts_with = "payload_only")]
    pub json: bool,
    /// Only each payload and a newline: as text when UTF-8, else base64 (to a terminal,
    /// with what would act on it escaped).
    #[arg(long)]
    pub payload_only: bool,
    /// Show secret-path endpoint ids in full. By default only their first 8 hex digits
    /// are shown, as the daemon's logs show them: an endpoint's id is its URL's secret.
    #[arg(long)]
    pub full_endpoint_ids: bool,
}

/// How a record's endpoint id is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndpointIds {
    /// Its first 8 hex digits and `…`: enough to tell endpoints apart and to find one in
    /// `GET /v1/endpoints`, not enough to send to it.
    Prefix,
    Full,
}

impl EndpointIds {
    pub(crate) fn of(a: &FormatArgs) -> EndpointIds {
        if a.full_endpoint_ids { EndpointIds::Full } else { EndpointIds::Prefix }
    }

    fn show(self, id: u128) -> String {
        match self {
            EndpointIds::Prefix => format!("{}…", ingest::endpoints::id_prefix(id)),
            EndpointIds::Full => format!("{id:032x}"),
        }
    }
}

/// The parsed filters.
#[derive(Debug, Clone, Default)]
pub(crate) struct Filter {
    source: Option<String>,
    destination: Option<(String, String)>,
}

impl Filter {
    pub(crate) fn parse(a: &FilterArgs) -> CliResult<Filter> {
        let destination = match &a.destination {
            None => None,
            Some(d) => match d.split_once('/') {
                Some((s, t)) if !s.is_empty() && !t.is_empty() && !t.contains('/') => {
                    Some((s.to_string(), t.to_string()))
                }
                _ => return Err(CliError::Usage(format!("--destination {d:?}: expected STREAM/TOPIC"))),
            },
        };
        Ok(Filter { source: a.source.clone(), destination })
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.source.is_none() && self.destination.is_none()
    }

    pub(crate) fn matches(&self, e: Option<&Envelope>) -> bool {
        if self.is_empty() {
            return true;
        }
        let Some(e) = e else { return false };
        let h = &e.header;
        self.source.as_ref().is_none_or(|s| *s == h.source_key)
            && self.destination.as_ref().is_none_or(|(s, t)| *s == h.destination.stream && *t == h.destination.topic)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Human,
    Json,
    /// Each payload exactly, for another program.
    PayloadOnly,
    /// Each payload with what would act on a terminal escaped: `--payload-only` whose
    /// output is a terminal, where a sender's bytes would otherwise set its title, clear
    /// it or forge lines.
    PayloadOnlyShown,
}

impl Format {
    /// The format `a` asks for, to standard output as it is (a terminal or not).
    pub(crate) fn of(a: &FormatArgs) -> Format {
        if a.json {
            Format::Json
        } else if a.payload_only && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
            Format::PayloadOnlyShown
        } else if a.payload_only {
            Format::PayloadOnly
        } else {
            Format::Human
        }
    }
}

fn partitioning_text(p: &Partitioning) -> String {
    match p {
        Partitioning::Balanced => "balanced".into(),
        Partitioning::Key(k) => match std::str::from_utf8(k) {
            Ok(s) => format!("key:{s}"),
            Err(_) => format!("key-hex:{}", hex::encode(k)),
        },
        Partitioning::PartitionId(id) => format!("partition:{id}"),
    }
}

fn partitioning_json(p: &Partitioning) -> serde_json::Value {
    match p {
        Partitioning::Balanced => json!({"kind": "balanced"}),
        Partitioning::Key(k) => {
            let (v, enc) = payload_text(k);
            json!({"kind": "key", "key": v, "encoding": enc})
        }
        Partitioning::PartitionId(id) => json!({"kind": "partition_id", "partition_id": id}),
    }
}

/// Writes one record in `format`.
pub(crate) fn write_record(
    out: &mut impl Write,
    format: Format,
    endpoint_ids: EndpointIds,
    offset: u64,
    record: &Bytes,
    envelope: &Result<Envelope, ingest::EnvelopeError>,
) -> std::io::Result<()> {
    match (format, envelope) {
        (Format::PayloadOnly | Format::PayloadOnlyShown, _) => {
            let bytes = envelope.as_ref().map_or(&record[..], |e| &e.payload[..]);
            let (text, _) = payload_text(bytes);
            match format {
                Format::PayloadOnlyShown => out.write_all(terminal_safe(&text).as_bytes())?,
                _ => out.write_all(text.as_bytes())?,
            }
            out.write_all(b"\n")
        }
        (Format::Json, Ok(e)) => {
            let h = &e.header;
            let (payload, encoding) = payload_text(&e.payload);
            let headers: Vec<serde_json::Value> = h
                .headers
                .iter()
                .map(|(k, v)| {
                    let (value, encoding) = payload_text(v);
                    json!({"name": k, "value": value, "encoding": encoding})
                })
                .collect();
            let v = json!({
                "offset": offset,
                "id": format!("{:032x}", h.message_id),
                "received_at": rfc3339_ms(h.received_at_unix_ms),
                "received_at_unix_ms": h.received_at_unix_ms,
                "source": h.source_key,
                "endpoint": h.endpoint_id.map(|id| endpoint_ids.show(id)),
                "destination": {"stream": h.destination.stream, "topic": h.destination.topic},
                "partitioning": partitioning_json(&h.destination.partitioning),
                "content_type": h.content_type,
                "idempotency_key": h.idempotency_key,
                "batch_index": h.batch_index,
                "batch_len": h.batch_len,
                "metadata": h.metadata.iter().map(|(k, v)| json!({"name": k, "value": v})).collect::<Vec<_>>(),
                "headers": headers,
                "payload": payload,
                "payload_encoding": encoding,
                "payload_bytes": e.payload.len(),
            });
            super::write_json_line(out, &v)
        }
        (Format::Json, Err(err)) => {
            let raw = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, record);
            write_json_line(out, &json!({"offset": offset, "error": err.to_string(), "record_base64": raw}))
        }
        (Format::Human, Ok(e)) => {
            // Every field a sender could have chosen is shown with its control characters
            // escaped: the human format goes to a terminal, one line per field.
            let h = &e.header;
            write!(
                out,
                "#{offset} {} {} -> {}/{} ({}) id={:032x}",
                rfc3339_ms(h.received_at_unix_ms),
                terminal_safe(&h.source_key),
                terminal_safe(&h.destination.stream),
                terminal_safe(&h.destination.topic),
                terminal_safe(&partitioning_text(&h.destination.partitioning)),
                h.message_id,
            )?;
            if let Some(ep) = h.endpoint_id {
                write!(out, " endpoint={}", endpoint_ids.show(ep))?;
            }
            if let Some(k) = &h.idempotency_key {
                write!(out, " delivery={}", terminal_safe(k))?;
            }
            if h.batch_len > 1 {
                write!(out, " event={}/{}", u64::from(h.batch_index) + 1, h.batch_len)?;
            }
            writeln!(out)?;
            if let Some(ct) = &h.content_type {
                writeln!(out, "  content-type: {}", terminal_safe(ct))?;
            }
            for (k, v) in &h.metadata {
                writeln!(out, "  meta {}: {}", terminal_safe(k), terminal_safe(v))?;
            }
            for (k, v) in &h.headers {
                match payload_text(v) {
                    (text, "utf-8") => writeln!(out, "  header {}: {}", terminal_safe(k), terminal_safe(&text))?,
                    (text, encoding) => writeln!(out, "  header {} ({encoding}): {text}", terminal_safe(k))?,
                }
            }
            let (payload, encoding) = payload_text(&e.payload);
            writeln!(out, "  payload ({} bytes, {encoding}): {}", e.payload.len(), terminal_safe(&payload))
        }
        (Format::Human, Err(err)) => {
            let raw = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, record);
            writeln!(out, "#{offset} not an envelope ({err}); {} bytes, base64: {raw}", record.len())
        }
    }
}

pub(crate) fn run(a: DumpArgs) -> CliResult {
    let filter = Filter::parse(&a.filter)?;
    let format = Format::of(&a.format);
    let endpoint_ids = EndpointIds::of(&a.format);
    let wal = open_log(&a.dir)?;
    let from = a.from.unwrap_or_else(|| wal.start_offset());
    let records = wal::inspect::Records::new(&wal, from).map_err(|e| wal_error(&a.dir, e))?;
    let mut out = stdout();
    let mut shown = 0u64;
    if a.limit == Some(0) {
        return Ok(ExitCode::SUCCESS);
    }
    let progress = super::ScanProgress::new(from, wal.next_offset(), !super::stdout_is_a_file());
    for r in records {
        let r = r.map_err(|e| wal_error(&a.dir, e))?;
        progress.at(r.offset);
        let envelope = Envelope::decode(&r.payload);
        if !filter.matches(envelope.as_ref().ok()) {
            continue;
        }
        write_record(&mut out, format, endpoint_ids, r.offset, &r.payload, &envelope)?;
        shown += 1;
        if a.limit.is_some_and(|l| shown >= l) {
            break;
        }
    }
    out.flush()?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ingest::{Destination, EnvelopeHeader};

    /// A sender's bytes (the payload, a forwarded header, a partition key from a JSON
    /// field) reach the terminal with their control characters escaped: no escape
    /// sequence, no carriage return, and no line of the human format that the record did
    /// not make. The JSON and payload-only formats stay exact.
    #[test]
    fn the_human_format_escapes_what_a_sender_could_send_to_the_terminal() {
        let header = EnvelopeHeader {
            message_id: 7,
            received_at_unix_ms: 0,
            source_key: "s".into(),
            endpoint_id: None,
            content_type: Some("text/plain".into()),
            metadata: vec![],
            headers: vec![("x-kind".into(), b"a\tb".to_vec())],
            idempotency_key: None,
            batch_index: 0,
            batch_len: 1,
            destination: Destination {
                stream: "st".into(),
                topic: "tp".into(),
                partitioning: Partitioning::Key(b"k\rey".to_vec()),
            },
        };
        let payload = "title\u{1b}]0;pwned\u{7}\n#2 1970-01-01T00:00:00.000Z forged -> x/y";
        let record = ingest::Envelope::encode(&header, payload.as_bytes());
        let envelope = ingest::Envelope::decode(&record);
        let mut out = Vec::new();
        write_record(&mut out, Format::Human, EndpointIds::Full, 1, &record, &envelope).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(!text.chars().any(|c| c.is_control() && c != '\n'), "{text:?}");
        assert_eq!(text.lines().count(), 4, "{text}");
        assert!(text.lines().all(|l| !l.starts_with("#2")), "a forged line: {text}");
        assert!(text.contains(r"title\u{1b}]0;pwned\u{7}\n#2"), "{text}");
        assert!(text.contains(r"(key:k\rey)") && text.contains(r"header x-kind: a\tb"), "{text}");

        let mut exact = Vec::new();
        write_record(&mut exact, Format::PayloadOnly, EndpointIds::Full, 1, &record, &envelope).unwrap();
        assert!(exact.starts_with(payload.as_bytes()), "payload-only is the payload's bytes");
        // To a terminal, the payload alone is escaped as the human format escapes it.
        let mut shown = Vec::new();
        write_record(&mut shown, Format::PayloadOnlyShown, EndpointIds::Full, 1, &record, &envelope).unwrap();
        let shown = String::from_utf8(shown).unwrap();
        assert_eq!(shown, "title\\u{1b}]0;pwned\\u{7}\\n#2 1970-01-01T00:00:00.000Z forged -> x/y\n");
    }
}
