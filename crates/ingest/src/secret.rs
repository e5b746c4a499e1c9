//! A secret's text (a password, a token, an auth secret) as configuration and requests
//! carry it.
//!
//! Invariant: its `Debug` never shows the text, so no `{:?}` of a configuration, of the
//! settings made from it or of a request holding one carries a secret into a log line,
//! an error or a panic message. The text is read only through [`SecretString::expose`],
//! which names every place that needs it.

/// A secret's text; `Debug` shows `"<redacted>"`.
#[derive(Clone, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(transparent)]
pub struct SecretString(String);

impl SecretString {
    pub fn new(text: impl Into<String>) -> SecretString {
        SecretString(text.into())
    }

    /// The text, for the one place that uses it (a sign-in, a digest, a check).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for SecretString {
    fn from(text: String) -> SecretString {
        SecretString(text)
    }
}

impl From<&str> for SecretString {
    fn from(text: &str) -> SecretString {
        SecretString(text.to_string())
    }
}

impl std::fmt::Debug for SecretString {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn its_debug_never_shows_the_text_and_expose_does() {
        #[derive(Debug)]
        struct Holder {
            password: SecretString,
        }
        let h = Holder { password: SecretString::from("hunter2") };
        assert!(!format!("{h:?}").contains("hunter2"), "{h:?}");
        assert_eq!(h.password.expose(), "hunter2");
    }
}
