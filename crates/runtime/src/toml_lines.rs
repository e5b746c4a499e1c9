//! The key path of a line in a TOML document that did not parse, for the error that
//! names it (`line 3: http.listen: duplicate key`). The parser gives only an offset;
//! the path is read off the text, line by line, as far as naming keys needs.
//!
//! Invariants:
//! - Only keys are ever taken from the text, never a value's: within a string, a
//!   multi-line one included (a secret's), nothing is read as a key or a header.
//! - A line that shows no key (an unclosed header, say) gets no path, rather than one
//!   of a table the problem is not in; so do the lines under a header it cannot read
//!   (a quoted key with an escape, which it does not follow).
//! - Offsets are handled as bytes: no text and no offset can make it panic.

use std::collections::BTreeMap;

use crate::config::KeyPath;

/// The key path of the line holding `byte`, read off the text of a document that did
/// not parse: the last table header above it (an array of tables with its index among
/// the headers of that name), then the header or the dotted key on the line itself; for
/// a line within a value that spans lines (a multi-line string, array or inline table),
/// the key of that value. Empty when the line is neither (an unclosed header, say),
/// rather than name a table the problem is not in. Only keys are ever taken from the
/// text, never a value's.
pub(crate) fn key_path_at(text: &str, byte: usize) -> String {
    let bytes = text.as_bytes();
    let byte = byte.min(bytes.len());
    let start = bytes[..byte].iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let end = bytes[start..].iter().position(|&b| b == b'\n').map_or(bytes.len(), |i| start + i);
    let mut reader = TomlLines::default();
    for line in text[..start].lines() {
        reader.read(line);
    }
    reader.read(&text[start..end]).map(|p| p.to_string()).unwrap_or_default()
}

/// Follows a TOML document line by line, as far as naming keys needs: table headers,
/// the keys lines assign, and values that span lines. Strings are skipped (a `#`, `=`
/// or bracket in one means nothing), and comments end a line.
#[derive(Default)]
struct TomlLines {
    table: KeyPath,
    /// The last header could not be read (a key this reader does not follow, such as an
    /// escape in a quoted one): the lines under it name no table until the next header.
    table_unread: bool,
    /// Arrays of tables seen, by name: how many of each.
    arrays: BTreeMap<String, usize>,
    /// Inside a value that spans lines: its key, the multi-line string's delimiter (if
    /// in one), and how deep in brackets and braces.
    open: Option<(KeyPath, Option<&'static str>, usize)>,
}

impl TomlLines {
    /// Reads one line; returns the key path it belongs to, if it shows one.
    fn read(&mut self, line: &str) -> Option<KeyPath> {
        if let Some((key, quote, depth)) = self.open.take() {
            let (quote, depth) = value_state(line, quote, depth);
            if quote.is_some() || depth > 0 {
                self.open = Some((key.clone(), quote, depth));
            }
            return Some(key);
        }
        let trimmed = line.trim_start();
        if trimmed.starts_with('[') {
            let path = header_path(trimmed).map(|(mut path, array)| {
                if array {
                    let seen = self.arrays.entry(path.to_string()).or_insert(0);
                    path = path.index(*seen);
                    *seen += 1;
                }
                path
            });
            self.table_unread = path.is_none();
            if let Some(path) = &path {
                self.table = path.clone();
            }
            return path;
        }
        let (key, value) = split_assignment(trimmed)?;
        // A value that spans lines is followed whatever its key, so that nothing in it
        // is read as a key or a header.
        let (quote, depth) = value_state(value, None, 0);
        let path = if self.table_unread { None } else { key_parts(key).map(|parts| keys(&self.table, &parts)) };
        if quote.is_some() || depth > 0 {
            self.open = Some((path.clone().unwrap_or_default(), quote, depth));
        }
        path
    }
}

/// The key path a table header (`[a."b]c"]`, or `[[a]]` and whether it is one) names;
/// `None` if it cannot be read.
fn header_path(header: &str) -> Option<(KeyPath, bool)> {
    let (rest, array) = match header.strip_prefix("[[") {
        Some(rest) => (rest, true),
        None => (header.strip_prefix('[')?, false),
    };
    let close = if array { "]]" } else { "]" };
    let inner = &rest[..outside_quotes(rest, |tail| tail.starts_with(close))?];
    let parts = key_parts(inner)?;
    Some((keys(&KeyPath::default(), &parts), array))
}

/// `table` with `parts` added.
fn keys(table: &KeyPath, parts: &[String]) -> KeyPath {
    parts.iter().fold(table.clone(), |path, part| path.key(part))
}

/// The first byte of `text` outside a quoted key at which `at` holds (a backslash in a
/// basic-string key escapes the character after it); `None` if it holds nowhere.
fn outside_quotes(text: &str, at: impl Fn(&str) -> bool) -> Option<usize> {
    let mut quote = None;
    let mut escaped = false;
    for (i, c) in text.char_indices() {
        match (quote, c) {
            _ if escaped => escaped = false,
            (Some('"'), '\\') => escaped = true,
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, _) if at(&text[i..]) => return Some(i),
            _ => {}
        }
    }
    None
}

/// `key = value` at the first `=` outside a quoted key (`None` on a comment first).
fn split_assignment(line: &str) -> Option<(&str, &str)> {
    let i = outside_quotes(line, |tail| tail.starts_with(['=', '#']))?;
    line[i..].strip_prefix('=').map(|value| (&line[..i], value))
}

/// The parts of a dotted key (`a."b.c".d`), unquoted; `None` unless every part is a
/// bare key or a whole quoted one.
fn key_parts(key: &str) -> Option<Vec<String>> {
    let mut parts = Vec::new();
    let mut rest = key.trim();
    loop {
        let (part, after) = match rest.chars().next()? {
            q @ ('"' | '\'') => {
                let close = rest[1..].find(q)? + 1;
                if q == '"' && rest[1..close].contains('\\') {
                    // An escape: the key's text is not what is written (and the quote
                    // found may be an escaped one). Not followed: no path.
                    return None;
                }
                (rest[1..close].to_string(), &rest[close + 1..])
            }
            _ => {
                let len =
                    rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '-' || c == '_')).unwrap_or(rest.len());
                (rest[..len].to_string(), &rest[len..])
            }
        };
        if part.is_empty() && !rest.starts_with(['"', '\'']) {
            return None;
        }
        parts.push(part);
        rest = after.trim_start();
        match rest.strip_prefix('.') {
            Some(r) => rest = r.trim_start(),
            None if rest.is_empty() => return Some(parts),
            None => return None,
        }
    }
}

/// Where a value's text leaves off at the end of `text`: inside a multi-line string
/// (its delimiter) and how deep in brackets and braces, starting from `quote` and
/// `depth`.
fn value_state(text: &str, mut quote: Option<&'static str>, mut depth: usize) -> (Option<&'static str>, usize) {
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if let Some(q) = quote {
            if b[i..].starts_with(q.as_bytes()) {
                quote = None;
                i += q.len();
            } else {
                // A backslash escapes the next byte in a basic string.
                i += if q == "\"\"\"" && b[i] == b'\\' { 2 } else { 1 };
            }
            continue;
        }
        match b[i] {
            b'"' | b'\'' if b[i..].starts_with(b"\"\"\"") || b[i..].starts_with(b"'''") => {
                quote = Some(if b[i] == b'"' { "\"\"\"" } else { "\'\'\'" });
                i += 3;
            }
            q @ (b'"' | b'\'') => {
                // A one-line string: skip it (an unclosed one ends with the line).
                i += 1;
                while i < b.len() && b[i] != q {
                    i += if q == b'"' && b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'[' | b'{' => {
                depth += 1;
                i += 1;
            }
            b']' | b'}' => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            b'#' => break,
            _ => i += 1,
        }
    }
    (quote, depth)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any offset at all, on a line of any text, names a key or nothing.
    #[test]
    fn no_text_and_no_offset_panics() {
        let odd = "[sörces.\"ä.b\"]\r\nkey = \"\"\"é\n[[x]]\n\"\"\" # ü\n'k' = [ { a = 'ö' }, \n\"k\\\"q\" = 1\n=\n[\n";
        for byte in 0..=odd.len() + 1 {
            let _ = key_path_at(odd, byte);
        }
    }
}
