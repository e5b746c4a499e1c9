//! Request bodies to events: one event per request, or NDJSON batches.
//!
//! Invariants:
//! - Decoding is all-or-nothing: one malformed NDJSON line rejects the whole request,
//!   naming the line (1-based), so nothing of it is appended.
//! - Event bytes are kept exactly as received (for NDJSON: each line without its line
//!   terminator); nothing is re-serialized.
//! - A source that accepts only JSON gets 415 for any other media type and 400 for
//!   bytes that are not JSON.
//! - A request holds at most `max_events` events: one more is refused before it is
//!   checked, so a body cannot turn into more records (each with its own envelope) than
//!   the operator allowed.
//! - JSON is UTF-8 (RFC 8259): a JSON body or NDJSON line holding bytes that are not
//!   UTF-8 is refused, even inside a string, where skipping the value alone would not
//!   look at them.

use std::borrow::Cow;

use bytes::Bytes;
use serde::de::IgnoredAny;
use serde_json::Value;

use crate::field_path::FieldPath;

/// What a source accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accept {
    /// Any content type; single events are stored as raw bytes.
    Any,
    /// `application/json`, `application/*+json` or NDJSON only, validated.
    Json,
}

/// A decoded body.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    pub events: Vec<Bytes>,
    /// The content type stored with each event.
    pub content_type: Option<String>,
    /// For NDJSON, the 1-based line of each event (blank lines are skipped, so this is
    /// not the event's index); `None` for a single-event body.
    pub lines: Option<Vec<usize>>,
    /// With fields to keep and a JSON or NDJSON body: each event parsed down to those
    /// fields ([`crate::json_fields`]), so that routing at the door does not parse it
    /// again.
    pub values: Option<Vec<Value>>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// The media type sent, `None` when the request had no `Content-Type`.
    #[error("{}", unsupported_media_type(.0.as_deref()))]
    UnsupportedMediaType(Option<String>),
    #[error("body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("line {line}: not valid JSON: {detail}")]
    MalformedLine { line: usize, detail: String },
    #[error("body holds no events (an empty body is not an event: Iggy stores no empty message)")]
    NoEvents,
    #[error("the batch holds more than {max} events (http.max_events_per_request)")]
    TooManyEvents { max: usize },
}

impl BodyError {
    pub fn reason(&self) -> &'static str {
        match self {
            BodyError::UnsupportedMediaType(_) => "unsupported_media_type",
            BodyError::InvalidJson(_) => "invalid_json",
            BodyError::MalformedLine { .. } => "malformed_ndjson_line",
            BodyError::NoEvents => "no_events",
            BodyError::TooManyEvents { .. } => "too_many_events",
        }
    }
}

/// The media type without parameters, lower-cased (borrowed when it already is, as
/// senders mostly write it: no allocation on every request).
fn essence(content_type: &str) -> Cow<'_, str> {
    let essence = content_type.split(';').next().unwrap_or("").trim();
    if essence.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(essence.to_ascii_lowercase())
    } else {
        Cow::Borrowed(essence)
    }
}

fn is_ndjson(essence: &str) -> bool {
    matches!(essence, "application/x-ndjson" | "application/ndjson" | "application/jsonl" | "application/x-jsonlines")
}

fn is_json(essence: &str) -> bool {
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

/// The most events `body` under `content_type` can become (before it is decoded): one,
/// unless it is NDJSON, whose every event is a line (its lines are its newlines and one
/// more), and at most `max_events`.
pub fn events_at_most(content_type: Option<&str>, body: &[u8], max_events: usize) -> usize {
    match content_type.map(essence) {
        Some(e) if is_ndjson(&e) => {
            let lines = body.iter().filter(|&&b| b == b'\n').count() + 1;
            lines.clamp(1, max_events.max(1))
        }
        _ => 1,
    }
}

/// The default of `http.max_events_per_request`: a 1 MiB NDJSON body of 100-byte events.
pub const MAX_EVENTS_PER_REQUEST_DEFAULT: usize = 10_000;

/// The message of a 415: the type sent, or that none was.
fn unsupported_media_type(sent: Option<&str>) -> String {
    const ACCEPTS: &str = "it accepts JSON or NDJSON: application/json, application/x-ndjson";
    match sent {
        Some(t) => format!("content type {t:?} is not accepted by this source ({ACCEPTS})"),
        None => format!("the request has no Content-Type header, and this source needs one ({ACCEPTS})"),
    }
}

/// Splits and checks a body, with at most [`MAX_EVENTS_PER_REQUEST_DEFAULT`] events.
/// `content_type` is the request's `Content-Type`, if any.
pub fn decode(content_type: Option<&str>, body: Bytes, accept: Accept) -> Result<Decoded, BodyError> {
    decode_with(content_type, body, accept, &[], MAX_EVENTS_PER_REQUEST_DEFAULT)
}

/// [`decode`] with at most `max_events` events, also keeping what each JSON event holds
/// at `keep_fields` (the one parse both checks the JSON and serves routing).
pub fn decode_with(
    content_type: Option<&str>,
    body: Bytes,
    accept: Accept,
    keep_fields: &[&FieldPath],
    max_events: usize,
) -> Result<Decoded, BodyError> {
    let ess = content_type.map(essence);
    // The media type first, as the documented order of checks has it: a source that
    // takes only JSON answers 415 to another type, empty or not.
    if accept == Accept::Json && !ess.as_deref().is_some_and(|e| is_ndjson(e) || is_json(e)) {
        return Err(BodyError::UnsupportedMediaType(ess.map(Cow::into_owned)));
    }
    // Iggy stores no empty message: an empty body would be accepted and never delivered.
    if body.is_empty() {
        return Err(BodyError::NoEvents);
    }
    match ess.as_deref() {
        Some(e) if is_ndjson(e) => decode_ndjson(body, keep_fields, max_events),
        Some(e) if is_json(e) => {
            let value = check_json(&body, keep_fields).map_err(BodyError::InvalidJson)?;
            Ok(Decoded {
                events: vec![body],
                content_type: content_type.map(str::to_string),
                lines: None,
                values: value.map(|v| vec![v]),
            })
        }
        // Any other type, on a source that takes any (a JSON-only one refused it above).
        _ => Ok(Decoded {
            events: vec![body],
            content_type: content_type.map(str::to_string),
            lines: None,
            values: None,
        }),
    }
}

/// Checks that `bytes` are one JSON text, returning what it holds at `keep` when that
/// names any field. serde_json skips an ignored string's bytes without decoding them, so
/// UTF-8 is checked first, with SIMD (`simdutf8` accepts exactly what
/// `std::str::from_utf8` accepts, several times faster on the mostly-ASCII bodies
/// webhooks carry).
fn check_json(bytes: &[u8], keep: &[&FieldPath]) -> Result<Option<Value>, String> {
    let text = simdutf8::compat::from_utf8(bytes)
        .map_err(|e| format!("not UTF-8: invalid byte at offset {}", e.valid_up_to()))?;
    if keep.is_empty() {
        serde_json::from_str::<IgnoredAny>(text).map(|_| None).map_err(|e| e.to_string())
    } else {
        crate::json_fields::parse(text, keep).map(Some).map_err(|e| e.to_string())
    }
}

fn decode_ndjson(body: Bytes, keep_fields: &[&FieldPath], max_events: usize) -> Result<Decoded, BodyError> {
    let mut events = Vec::new();
    let mut lines = Vec::new();
    let mut values = Vec::new();
    let mut start = 0usize;
    let mut line_no = 0usize;
    while start < body.len() {
        line_no += 1;
        let end = body[start..].iter().position(|&b| b == b'\n').map_or(body.len(), |p| start + p);
        let mut line_end = end;
        if line_end > start && body[line_end - 1] == b'\r' {
            line_end -= 1;
        }
        let line = body.slice(start..line_end);
        start = end + 1;
        // Blank: JSON's own whitespace only (RFC 8259: space, tab, CR, LF). A form feed,
        // which `is_ascii_whitespace` counts, is not JSON whitespace: such a line is
        // refused as malformed, not skipped.
        if line.iter().all(|b| matches!(b, b' ' | b'\t' | b'\r')) {
            continue;
        }
        if events.len() >= max_events {
            return Err(BodyError::TooManyEvents { max: max_events });
        }
        let value =
            check_json(&line, keep_fields).map_err(|detail| BodyError::MalformedLine { line: line_no, detail })?;
        values.extend(value);
        events.push(line);
        lines.push(line_no);
    }
    if events.is_empty() {
        return Err(BodyError::NoEvents);
    }
    let values = (!keep_fields.is_empty()).then_some(values);
    Ok(Decoded { events, content_type: Some("application/json".to_string()), lines: Some(lines), values })
}

#[cfg(test)]
mod tests {

    #[test]
    fn the_events_a_body_can_become_are_bounded_before_it_is_decoded() {
        let nd = Some("application/x-ndjson; charset=utf-8");
        // "1\n" per event, the last newline optional: 5 bytes hold at most 3 events.
        let body = Bytes::from_static(b"1\n2\n3");
        let decoded = decode(nd, body.clone(), Accept::Any).unwrap();
        assert_eq!(decoded.events.len(), 3);
        assert_eq!(events_at_most(nd, &body, 100), 3);
        // Lines of a hundred bytes: a line each, not one per two bytes.
        let lines = format!("{}\n", "x".repeat(99)).repeat(200);
        assert_eq!(events_at_most(nd, lines.as_bytes(), 10_000), 201);
        assert_eq!(events_at_most(nd, "1\n".repeat(500).as_bytes(), 100), 100, "capped by max_events");
        assert_eq!(events_at_most(Some("application/json"), lines.as_bytes(), 100), 1);
        assert_eq!(events_at_most(None, lines.as_bytes(), 100), 1);
    }
    use super::*;

    #[test]
    fn media_types_are_told_apart_in_any_case_and_with_parameters() {
        for json in ["application/json", "Application/JSON; charset=UTF-8", " application/vnd.api+JSON "] {
            let d = decode(Some(json), Bytes::from_static(b"{\"a\":1}"), Accept::Json).unwrap();
            assert_eq!(d.events.len(), 1, "{json}");
            assert_eq!(
                decode(Some(json), Bytes::from_static(b"{"), Accept::Json).map(|_| ()).map_err(|e| e.reason()),
                Err("invalid_json"),
                "{json} is checked as JSON"
            );
        }
        for ndjson in ["application/x-ndjson", "APPLICATION/X-NDJSON;charset=utf-8"] {
            assert_eq!(decode(Some(ndjson), Bytes::from_static(b"1\n2"), Accept::Json).unwrap().events.len(), 2);
            assert_eq!(events_at_most(Some(ndjson), b"1\n2", 10), 2, "{ndjson}");
        }
        // The refusal names the type as the sender wrote it, lower-cased.
        assert_eq!(
            decode(Some("Text/Plain; charset=utf-8"), Bytes::from_static(b"x"), Accept::Json),
            Err(BodyError::UnsupportedMediaType(Some("text/plain".into())))
        );
        assert!(matches!(essence("text/plain"), Cow::Borrowed("text/plain")));
    }

    #[test]
    fn a_batch_may_hold_max_events_and_not_one_more_and_blank_lines_are_not_events() {
        let at_max = Bytes::from_static(b"1\n\n2\r\n   \n3\n");
        let d = decode_with(Some("application/x-ndjson"), at_max.clone(), Accept::Json, &[], 3).unwrap();
        assert_eq!(d.events.len(), 3);
        assert_eq!(d.lines, Some(vec![1, 3, 5]));
        assert_eq!(
            decode_with(Some("application/x-ndjson"), at_max, Accept::Json, &[], 2),
            Err(BodyError::TooManyEvents { max: 2 })
        );
        // Refused before the line past the limit is checked: the count, not the JSON.
        let over = Bytes::from_static(b"1\n2\nnot json\n");
        let e = decode_with(Some("application/x-ndjson"), over, Accept::Json, &[], 2).unwrap_err();
        assert_eq!((e.reason(), e.to_string().contains("more than 2 events")), ("too_many_events", true));
        // A single-event body is one event whatever the limit.
        assert!(decode_with(Some("application/json"), Bytes::from_static(b"[1,2]"), Accept::Json, &[], 1).is_ok());
    }

    #[test]
    fn kept_values_are_the_events_parsed_and_only_kept_when_asked() {
        let a = FieldPath::parse("a").unwrap();
        let body = Bytes::from_static(b"{\"a\":1,\"b\":2}\n\n[2,\"x\"]\n");
        let d = decode_with(
            Some("application/x-ndjson"),
            body.clone(),
            Accept::Json,
            &[&a],
            MAX_EVENTS_PER_REQUEST_DEFAULT,
        )
        .unwrap();
        // Only what the fields reach is kept.
        assert_eq!(d.values, Some(vec![serde_json::json!({"a": 1}), serde_json::Value::Null]));
        assert_eq!(decode(Some("application/x-ndjson"), body, Accept::Json).unwrap().values, None);
        let one = decode_with(
            Some("application/json"),
            Bytes::from_static(b"{\"a\":\"x\",\"b\":true}"),
            Accept::Any,
            &[&a],
            MAX_EVENTS_PER_REQUEST_DEFAULT,
        )
        .unwrap();
        assert_eq!(one.values, Some(vec![serde_json::json!({"a": "x"})]));
        let raw = decode_with(
            Some("text/plain"),
            Bytes::from_static(b"{}"),
            Accept::Any,
            &[&a],
            MAX_EVENTS_PER_REQUEST_DEFAULT,
        )
        .unwrap();
        assert_eq!(raw.values, None, "a body not declared JSON is not parsed by the decoder");
    }

    /// The SIMD check must accept and reject exactly what the standard library does, and
    /// name the same offset: bytes around every boundary of the UTF-8 grammar (overlong
    /// forms, surrogates, past U+10FFFF, truncated sequences), at every alignment of a
    /// 64-byte SIMD block, inside a JSON string.
    #[test]
    fn the_utf8_check_agrees_with_the_standard_library_byte_for_byte() {
        let pieces: [&[u8]; 16] = [
            b"a",
            "\u{e9}".as_bytes(),
            "\u{20ac}".as_bytes(),
            "\u{10ffff}".as_bytes(),
            b"\xc0\x80",
            b"\xc1\xbf",
            b"\xe0\x80\x80",
            b"\xed\xa0\x80",
            b"\xf4\x90\x80\x80",
            b"\xf5\x80\x80\x80",
            b"\xc3",
            b"\xe2\x82",
            b"\xf0\x9f\x98",
            b"\x80",
            b"\xff",
            b"\xef\xbb\xbf",
        ];
        for pad in 0..70 {
            for a in pieces {
                for b in pieces {
                    let mut body = b"\"".to_vec();
                    body.extend(std::iter::repeat_n(b'x', pad));
                    body.extend_from_slice(a);
                    body.extend_from_slice(b);
                    body.push(b'"');
                    let ours = check_json(&body, &[]);
                    match std::str::from_utf8(&body) {
                        Ok(_) => assert_eq!(ours, Ok(None), "{body:?}"),
                        Err(e) => assert_eq!(
                            ours,
                            Err(format!("not UTF-8: invalid byte at offset {}", e.valid_up_to())),
                            "{body:?}"
                        ),
                    }
                }
            }
        }
    }

    /// A source that takes only JSON answers 415 to another media type before anything
    /// else, an empty body included (the documented order: Content-Type, then decoding).
    #[test]
    fn a_json_source_refuses_another_media_type_before_looking_at_the_body() {
        for body in [Bytes::new(), Bytes::from_static(b"x")] {
            let e = decode(Some("text/plain"), body.clone(), Accept::Json).unwrap_err();
            assert!(matches!(e, BodyError::UnsupportedMediaType(Some(ref t)) if t == "text/plain"), "{e:?}");
            let e = decode(None, body, Accept::Json).unwrap_err();
            assert!(matches!(e, BodyError::UnsupportedMediaType(None)), "{e:?}");
            assert!(e.to_string().contains("no Content-Type header"), "{e}");
        }
        assert!(matches!(decode(Some("application/json"), Bytes::new(), Accept::Json), Err(BodyError::NoEvents)));
    }

    /// A blank line is JSON whitespace only: a line of form feeds (which
    /// `is_ascii_whitespace` counts) is malformed, not skipped.
    #[test]
    fn a_line_of_form_feeds_is_not_blank() {
        let body = Bytes::from_static(
            b"1
 \t\r
\x0c
2
",
        );
        let e = decode(Some("application/x-ndjson"), body, Accept::Json).unwrap_err();
        assert!(matches!(e, BodyError::MalformedLine { line: 3, .. }), "{e:?}");
    }

    #[test]
    fn ndjson_splits_lines_skips_blank_ones_and_names_the_bad_line() {
        let d =
            decode(Some("application/x-ndjson"), Bytes::from_static(b"{\"a\":1}\r\n\n[2]\n"), Accept::Json).unwrap();
        assert_eq!(d.events, vec![Bytes::from_static(b"{\"a\":1}"), Bytes::from_static(b"[2]")]);
        assert_eq!(d.lines, Some(vec![1, 3]), "blank lines are skipped but still counted");
        let e =
            decode(Some("application/x-ndjson; charset=utf-8"), Bytes::from_static(b"{}\n\n{oops\n{}"), Accept::Any);
        assert!(matches!(e, Err(BodyError::MalformedLine { line: 3, .. })), "{e:?}");
        assert_eq!(
            decode(Some("application/x-ndjson"), Bytes::from_static(b"\n \n"), Accept::Any),
            Err(BodyError::NoEvents)
        );
    }

    #[test]
    fn an_empty_body_is_no_event_whatever_the_source_accepts() {
        for ct in [None, Some("text/plain"), Some("application/json")] {
            assert_eq!(decode(ct, Bytes::new(), Accept::Any), Err(BodyError::NoEvents), "{ct:?}");
        }
    }

    #[test]
    fn json_only_sources_refuse_other_media_types_and_bad_json() {
        assert!(matches!(
            decode(Some("text/plain"), Bytes::from_static(b"{}"), Accept::Json),
            Err(BodyError::UnsupportedMediaType(Some(t))) if t == "text/plain"
        ));
        assert!(matches!(
            decode(None, Bytes::from_static(b"{}"), Accept::Json),
            Err(BodyError::UnsupportedMediaType(_))
        ));
        assert!(matches!(
            decode(Some("application/json"), Bytes::from_static(b"{\"a\":"), Accept::Any),
            Err(BodyError::InvalidJson(_))
        ));
        let ok = decode(Some("application/vnd.api+json"), Bytes::from_static(b"{\"a\":1}"), Accept::Json).unwrap();
        assert_eq!(ok.events.len(), 1);
    }

    #[test]
    fn bytes_that_are_not_utf8_are_not_json_even_inside_a_string() {
        let e = decode(Some("application/json"), Bytes::from_static(b"{\"a\":\"\xff\"}"), Accept::Json);
        assert!(matches!(&e, Err(BodyError::InvalidJson(m)) if m.contains("UTF-8")), "{e:?}");
        let e = decode(Some("application/x-ndjson"), Bytes::from_static(b"{}\n[\"\xc3\"]\n"), Accept::Any);
        assert!(matches!(e, Err(BodyError::MalformedLine { line: 2, .. })), "{e:?}");
        let ok = decode(Some("application/json"), Bytes::from("{\"a\":\"é\"}"), Accept::Json).unwrap();
        assert_eq!(ok.events.len(), 1);
    }

    #[test]
    fn any_sources_keep_raw_bytes_and_content_type() {
        let d = decode(Some("text/plain"), Bytes::from_static(b"hello"), Accept::Any).unwrap();
        assert_eq!(d.events, vec![Bytes::from_static(b"hello")]);
        assert_eq!(d.content_type.as_deref(), Some("text/plain"));
    }
}
