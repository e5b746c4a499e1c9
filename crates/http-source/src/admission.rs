//! Admission of a resolved destination at the door: the narrow name grammar and the
//! `open | allowlist | denylist` modes.
//!
//! Invariants:
//! - A name segment (`SEG`) is `[a-zA-Z0-9._-]+`, 1 to 255 bytes; a rule segment is a
//!   `SEG` or `*` as the whole segment (never a partial wildcard such as `orders-*`).
//! - `{stream = "*", topic = "*"}` is refused when a rule is built, in both lists: it
//!   would make an allowlist open and a denylist refuse everything.
//! - Deciding is pure and allocation-free: the same destination gets the same answer
//!   until the configuration changes.

/// The longest stream or topic name.
pub const NAME_MAX_BYTES: usize = 255;

/// Whether `s` is a literal stream or topic name of the narrow grammar.
pub fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= NAME_MAX_BYTES
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// One segment of a rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pattern {
    Any,
    Exact(String),
}

impl Pattern {
    /// Parses `*` or a literal name; the error is for the config message.
    pub fn parse(s: &str) -> Result<Pattern, String> {
        if s == "*" {
            Ok(Pattern::Any)
        } else if is_name(s) {
            Ok(Pattern::Exact(s.to_string()))
        } else {
            Err(format!(
                "{s:?} is neither a name ([a-zA-Z0-9._-], 1 to {NAME_MAX_BYTES} bytes) nor \"*\" as the whole segment"
            ))
        }
    }

    fn matches(&self, name: &str) -> bool {
        match self {
            Pattern::Any => true,
            Pattern::Exact(e) => e == name,
        }
    }
}

/// One list entry: `{stream = SEG, topic = SEG}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub stream: Pattern,
    pub topic: Pattern,
}

/// Which of a rule's keys is wrong, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleError {
    /// `"stream"`, `"topic"`, or `""` for the rule as a whole.
    pub key: &'static str,
    pub message: String,
}

impl Rule {
    pub fn parse(stream: &str, topic: &str) -> Result<Rule, RuleError> {
        let stream = Pattern::parse(stream).map_err(|message| RuleError { key: "stream", message })?;
        let topic = Pattern::parse(topic).map_err(|message| RuleError { key: "topic", message })?;
        if stream == Pattern::Any && topic == Pattern::Any {
            return Err(RuleError {
                key: "",
                message: "{stream = \"*\", topic = \"*\"} matches every destination: use mode = \"open\" \
                          instead of an allowlist, and no source should deny everything"
                    .into(),
            });
        }
        Ok(Rule { stream, topic })
    }

    pub fn matches(&self, stream: &str, topic: &str) -> bool {
        self.stream.matches(stream) && self.topic.matches(topic)
    }
}

/// A source's admission mode and its list.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Admission {
    /// Every destination of the grammar is admitted.
    #[default]
    Open,
    Allowlist(Vec<Rule>),
    Denylist(Vec<Rule>),
}

/// Why a destination is refused; `reason` is the metrics label, `code` the answer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Denylisted,
    NotAllowlisted,
}

impl Refusal {
    pub fn code(self) -> &'static str {
        match self {
            Refusal::Denylisted => "denylisted",
            Refusal::NotAllowlisted => "not_allowlisted",
        }
    }

    pub fn reason(self) -> &'static str {
        match self {
            Refusal::Denylisted => "denylist",
            Refusal::NotAllowlisted => "not_allowlisted",
        }
    }
}

impl Admission {
    pub fn check(&self, stream: &str, topic: &str) -> Result<(), Refusal> {
        match self {
            Admission::Open => Ok(()),
            Admission::Allowlist(rules) if rules.iter().any(|r| r.matches(stream, topic)) => Ok(()),
            Admission::Allowlist(_) => Err(Refusal::NotAllowlisted),
            Admission::Denylist(rules) if rules.iter().any(|r| r.matches(stream, topic)) => Err(Refusal::Denylisted),
            Admission::Denylist(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_narrow_grammar() {
        for ok in ["a", "orders", "order.created", "A-b_c.9", &"x".repeat(NAME_MAX_BYTES)] {
            assert!(is_name(ok), "{ok}");
        }
        for bad in ["", "a b", "a/b", "*", "orders-*", "ä", "a:b", &"x".repeat(NAME_MAX_BYTES + 1)] {
            assert!(!is_name(bad), "{bad}");
        }
    }

    #[test]
    fn a_wildcard_is_only_a_whole_segment_and_never_both() {
        assert_eq!(Pattern::parse("*"), Ok(Pattern::Any));
        assert_eq!(Pattern::parse("shop"), Ok(Pattern::Exact("shop".into())));
        for bad in ["orders-*", "**", "*a", "", "a b"] {
            assert!(Pattern::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(Rule::parse("*", "*").unwrap_err().key, "");
        assert_eq!(Rule::parse("a*", "t").unwrap_err().key, "stream");
        assert_eq!(Rule::parse("s", "t?").unwrap_err().key, "topic");
        assert!(Rule::parse("*", "t").is_ok());
        assert!(Rule::parse("s", "*").is_ok());
    }

    #[test]
    fn modes_decide_as_documented() {
        let rules = vec![Rule::parse("shop", "*").unwrap(), Rule::parse("*", "audit").unwrap()];
        let allow = Admission::Allowlist(rules.clone());
        let deny = Admission::Denylist(rules);
        for (s, t, listed) in [("shop", "orders", true), ("x", "audit", true), ("x", "orders", false)] {
            assert_eq!(allow.check(s, t).is_ok(), listed, "{s}/{t}");
            assert_eq!(deny.check(s, t).is_ok(), !listed, "{s}/{t}");
        }
        assert_eq!(allow.check("x", "y"), Err(Refusal::NotAllowlisted));
        assert_eq!(deny.check("shop", "y"), Err(Refusal::Denylisted));
        assert_eq!(Admission::Open.check("any", "thing"), Ok(()));
    }
}
