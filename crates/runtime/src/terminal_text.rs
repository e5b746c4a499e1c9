//! Text from outside the process, made safe to show on a terminal.
//!
//! Invariants:
//! - What [`safe`] returns holds no control character (C0, DEL, C1: newlines, carriage
//!   returns, escape sequences, 8-bit CSI) and no bidirectional formatting character
//!   (embeddings, overrides, isolates, marks): each is written as its Rust escape
//!   (`\n`, `\u{1b}`, `\u{202e}`). So text a sender, a file or a server chose cannot move
//!   the cursor, set the window title, forge a line of the output, or show a line
//!   reordered.
//! - Text with none of those is returned as it is, without a copy.

use std::borrow::Cow;

/// Whether `c` would act on a terminal rather than be shown.
fn acts(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `s` with every character that would act on a terminal escaped.
pub fn safe(s: &str) -> Cow<'_, str> {
    if !s.chars().any(acts) {
        return s.into();
    }
    s.chars().map(|c| if acts(c) { c.escape_default().collect() } else { c.to_string() }).collect::<String>().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_acts_on_a_terminal_is_escaped_and_the_rest_is_left_as_it_is() {
        assert!(matches!(safe("plain text, é, 日本"), Cow::Borrowed(_)));
        let shown = safe("a\nb\r\u{1b}]0;title\u{7}\u{9b}31m\u{202e}cba\u{2066}\u{7f}");
        assert_eq!(shown, "a\\nb\\r\\u{1b}]0;title\\u{7}\\u{9b}31m\\u{202e}cba\\u{2066}\\u{7f}");
        assert!(!shown.chars().any(acts));
    }
}
