//! The TOML configuration: its schema, the built-in default, and validation into the
//! settings the daemon runs on.
//!
//! Invariants:
//! - Every error names the key path (`sources.github.endpoints[1].auth_secret`) and,
//!   when the value or its table is in the file, the line.
//! - Unknown keys are errors (a typo must not silently fall back to a default).
//! - [`Config::builtin`] is the configuration `iggy-ingest run` uses without `--config`;
//!   `config/default.toml` spells out exactly the same (a test holds them together).
//! - Credential headers can never be forwarded into the log; secrets never appear in
//!   error messages.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use http_source::admission::{Admission, Rule, RuleError, is_name};
use http_source::auth::AuthScheme;
use http_source::endpoints::{Endpoint, parse_id};
use http_source::field_path::FieldPath;
use http_source::partition::{KeyEncoding, KeySource, PartitionRule};
use http_source::route::{Mapping, MappingError, MappingSource, OnMissing, Route, Target};
use http_source::source::is_credential_header;
use http_source::tls::TlsFiles;
use http_source::{Accept, Destinations, MetadataFields, SourceSpec};
use ingest::Partitioning;
use ingest::secret::SecretString;
use serde::Deserialize;
use wal::options::PREALLOCATE_BYTES_MAX;
use wal::{SyncPolicy, WalOptions};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub http: HttpConfig,
    pub admin: AdminConfig,
    pub shutdown: ShutdownConfig,
    pub runtime: RuntimeConfig,
    pub logging: LoggingConfig,
    pub storage: StorageConfig,
    pub wal: WalConfig,
    pub idempotency: IdempotencyConfig,
    pub iggy: IggyConfig,
    pub router: crate::delivery::RouterSection,
    pub sources: BTreeMap<String, SourceConfig>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    pub listen: String,
    pub max_body_bytes: u64,
    pub header_read_timeout_ms: u64,
    pub body_read_timeout_ms: u64,
    pub write_timeout_ms: u64,
    pub max_connections: u64,
    pub retry_after_secs: u64,
    pub max_events_per_request: u64,
    /// `[http.tls]`: serve the webhook listener over TLS.
    pub tls: Option<TlsConfig>,
}

/// `[http.tls]` and `[admin.tls]`: a listener's certificate chain and private key, PEM
/// files read at start and again on SIGHUP (`docs/http.md`, "TLS").
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    pub cert_file: String,
    pub key_file: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    pub listen: String,
    /// Bearer token for every admin route but `/health` (see docs/operations.md).
    pub token: Option<SecretString>,
    pub token_env: Option<String>,
    /// Serve the admin routes without a token on an address other than loopback.
    pub allow_unauthenticated_remote: bool,
    pub management_token: Option<SecretString>,
    pub management_token_env: Option<String>,
    /// `[admin.tls]`: serve the admin listener over TLS.
    pub tls: Option<TlsConfig>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShutdownConfig {
    pub grace_period_ms: u64,
    pub drain_delay_ms: u64,
}

/// The async runtime that serves both listeners and the router.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RuntimeConfig {
    /// Worker threads; 0 picks the machine's cores minus one (at least one), leaving a
    /// core to the log's writer thread and the kernel's network and disk work.
    pub worker_threads: u64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingConfig {
    pub level: String,
    pub format: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    pub data_dir: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WalConfig {
    pub segment_max_bytes: u64,
    pub max_bytes: u64,
    pub record_max_bytes: u64,
    pub sync: String,
    pub sync_interval_ms: u64,
    pub preallocate_bytes: u64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdempotencyConfig {
    pub retention_secs: u64,
    pub checkpoint_interval_ms: u64,
    pub max_keys: u64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IggyConfig {
    pub address: String,
    pub username: String,
    pub password: SecretString,
    pub tls: bool,
    pub tls_domain: Option<String>,
    pub tls_ca_file: Option<String>,
    pub reconnection_interval_ms: u64,
    pub connection_max_age_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DestinationConfig {
    pub stream: String,
    pub topic: String,
    #[serde(default)]
    pub partition_id: Option<u32>,
    #[serde(default)]
    pub partition_key: Option<String>,
}

/// `[sources.<key>.route]`: the route transform (see docs/routing.md).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub topic_field: String,
    #[serde(default)]
    pub stream_field: Option<String>,
    #[serde(default)]
    pub default_stream: Option<String>,
    #[serde(default)]
    pub default_topic: Option<String>,
    #[serde(default)]
    pub mapping: Option<BTreeMap<String, MappingTargetConfig>>,
    #[serde(default)]
    pub mapping_url: Option<String>,
    #[serde(default = "default_on_missing")]
    pub on_missing_destination: String,
}

/// A mapping entry: `"topic"` or `{ stream = "...", topic = "..." }`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged, expecting = "a topic name, or { stream = \"...\", topic = \"...\" } (no other keys)")]
pub enum MappingTargetConfig {
    Topic(String),
    Full(FullTargetConfig),
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FullTargetConfig {
    #[serde(default)]
    pub stream: Option<String>,
    pub topic: String,
}

/// `[sources.<key>.partitioning]`: exactly one of `key_header`, `key_field`,
/// `partition_id`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartitioningConfig {
    #[serde(default)]
    pub key_header: Option<String>,
    #[serde(default)]
    pub key_field: Option<String>,
    #[serde(default)]
    pub key_encoding: Option<String>,
    #[serde(default)]
    pub partition_id: Option<u32>,
}

/// `[sources.<key>.admission]`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionConfig {
    #[serde(default = "default_mode")]
    pub mode: String,
    #[serde(default)]
    pub allowlist: Vec<RuleConfig>,
    #[serde(default)]
    pub denylist: Vec<RuleConfig>,
}

/// One admission list entry.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    pub stream: String,
    pub topic: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// A fixed destination; with a `route`, the route's default (see docs/routing.md).
    #[serde(default)]
    pub destination: Option<DestinationConfig>,
    #[serde(default)]
    pub route: Option<RouteConfig>,
    #[serde(default)]
    pub partitioning: Option<PartitioningConfig>,
    #[serde(default)]
    pub admission: Option<AdmissionConfig>,
    #[serde(default = "default_accept")]
    pub accept: String,
    #[serde(default = "default_true")]
    pub named_path: bool,
    #[serde(default = "default_auth_type")]
    pub auth_type: String,
    #[serde(default)]
    pub auth_secret: Option<SecretString>,
    /// The name of an environment variable holding the secret (instead of `auth_secret`).
    #[serde(default)]
    pub auth_secret_env: Option<String>,
    #[serde(default)]
    pub auth_header: Option<String>,
    #[serde(default)]
    pub auth_prefix: Option<String>,
    #[serde(default)]
    pub auth_tolerance_secs: Option<u64>,
    #[serde(default)]
    pub forward_headers: Vec<String>,
    #[serde(default = "default_metadata")]
    pub metadata: Vec<String>,
    #[serde(default = "default_true")]
    pub idempotency: bool,
    #[serde(default)]
    pub idempotency_header: Option<String>,
    #[serde(default)]
    pub endpoints: Vec<EndpointConfig>,
}

/// The auth keys shared by sources and endpoints. Both structs spell the keys out
/// rather than `#[serde(flatten)]` one struct: serde does not support flatten together
/// with `deny_unknown_fields`, and a misspelt key must stay a config error.
#[derive(Debug, Clone, Copy)]
struct AuthConfig<'a> {
    auth_type: &'a str,
    auth_secret: Option<&'a str>,
    auth_secret_env: Option<&'a str>,
    auth_header: Option<&'a str>,
    auth_prefix: Option<&'a str>,
    auth_tolerance_secs: Option<u64>,
}

impl AuthConfig<'_> {
    /// The first auth setting given a value other than its default (`auth_type =
    /// "none"`, nothing else set), by its key.
    fn first_set_key(&self) -> Option<&'static str> {
        [
            ("auth_type", self.auth_type != "none"),
            ("auth_secret", self.auth_secret.is_some()),
            ("auth_secret_env", self.auth_secret_env.is_some()),
            ("auth_header", self.auth_header.is_some()),
            ("auth_prefix", self.auth_prefix.is_some()),
            ("auth_tolerance_secs", self.auth_tolerance_secs.is_some()),
        ]
        .into_iter()
        .find_map(|(key, set)| set.then_some(key))
    }
}

impl SourceConfig {
    fn auth(&self) -> AuthConfig<'_> {
        AuthConfig {
            auth_type: &self.auth_type,
            auth_secret: self.auth_secret.as_ref().map(SecretString::expose),
            auth_secret_env: self.auth_secret_env.as_deref(),
            auth_header: self.auth_header.as_deref(),
            auth_prefix: self.auth_prefix.as_deref(),
            auth_tolerance_secs: self.auth_tolerance_secs,
        }
    }
}

impl EndpointConfig {
    fn auth(&self) -> AuthConfig<'_> {
        AuthConfig {
            auth_type: &self.auth_type,
            auth_secret: self.auth_secret.as_ref().map(SecretString::expose),
            auth_secret_env: self.auth_secret_env.as_deref(),
            auth_header: self.auth_header.as_deref(),
            auth_prefix: self.auth_prefix.as_deref(),
            auth_tolerance_secs: self.auth_tolerance_secs,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    pub id: String,
    /// Required, `"none"` included: an endpoint is never left unauthenticated by a line
    /// left out (as `POST /v1/endpoints` requires it too).
    pub auth_type: String,
    #[serde(default)]
    pub auth_secret: Option<SecretString>,
    /// The name of an environment variable holding the secret (instead of `auth_secret`).
    #[serde(default)]
    pub auth_secret_env: Option<String>,
    #[serde(default)]
    pub auth_header: Option<String>,
    #[serde(default)]
    pub auth_prefix: Option<String>,
    #[serde(default)]
    pub auth_tolerance_secs: Option<u64>,
    #[serde(default)]
    pub expires_at: Option<String>,
    #[serde(default)]
    pub handshake_param: Option<String>,
}

fn default_accept() -> String {
    "any".into()
}
fn default_true() -> bool {
    true
}
fn default_metadata() -> Vec<String> {
    vec!["peer_addr".into(), "received_at".into()]
}
fn default_auth_type() -> String {
    "none".into()
}
fn default_on_missing() -> String {
    "default".into()
}
fn default_mode() -> String {
    "open".into()
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: "127.0.0.1:8080".into(),
            max_body_bytes: 1024 * 1024,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 30_000,
            write_timeout_ms: 10_000,
            max_connections: 1024,
            retry_after_secs: 5,
            max_events_per_request: http_source::body::MAX_EVENTS_PER_REQUEST_DEFAULT as u64,
            tls: None,
        }
    }
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: "127.0.0.1:9180".into(),
            token: None,
            token_env: None,
            allow_unauthenticated_remote: false,
            management_token: None,
            management_token_env: None,
            tls: None,
        }
    }
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig { grace_period_ms: 30_000, drain_delay_ms: 0 }
    }
}

impl Default for LoggingConfig {
    fn default() -> Self {
        LoggingConfig { level: "info".into(), format: "text".into() }
    }
}

impl Default for StorageConfig {
    fn default() -> Self {
        StorageConfig { data_dir: "./data".into() }
    }
}

impl Default for WalConfig {
    fn default() -> Self {
        let d = WalOptions::default();
        WalConfig {
            segment_max_bytes: d.segment_max_bytes,
            max_bytes: d.max_bytes,
            record_max_bytes: 4 * 1024 * 1024,
            sync: "always".into(),
            sync_interval_ms: 10,
            preallocate_bytes: d.preallocate_bytes,
        }
    }
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        IdempotencyConfig {
            retention_secs: 86_400,
            checkpoint_interval_ms: 1_000,
            max_keys: ingest::idempotency::MAX_KEYS_DEFAULT,
        }
    }
}

impl Default for IggyConfig {
    /// The sink's own defaults, so that the two can never disagree.
    fn default() -> Self {
        let sink = router::iggy_sink::IggySinkConfig::default();
        IggyConfig {
            address: sink.address,
            username: sink.username,
            password: sink.password,
            tls: sink.tls,
            tls_domain: sink.tls_domain,
            tls_ca_file: sink.tls_ca_file,
            reconnection_interval_ms: sink.reconnection_interval.as_millis() as u64,
            connection_max_age_ms: sink.connection_max_age.as_millis() as u64,
        }
    }
}

impl Default for Config {
    /// The defaults of every section, and no sources.
    fn default() -> Self {
        Config {
            http: HttpConfig::default(),
            admin: AdminConfig::default(),
            shutdown: ShutdownConfig::default(),
            runtime: RuntimeConfig::default(),
            logging: LoggingConfig::default(),
            storage: StorageConfig::default(),
            wal: WalConfig::default(),
            idempotency: IdempotencyConfig::default(),
            iggy: IggyConfig::default(),
            router: crate::delivery::RouterSection::default(),
            sources: BTreeMap::new(),
        }
    }
}

impl Config {
    /// What `iggy-ingest run` runs on without `--config`: the section defaults plus one
    /// source `default` (no auth, any content type) into stream `ingest`, topic `events`.
    pub fn builtin() -> Config {
        let mut c = Config::default();
        c.sources.insert(
            "default".into(),
            SourceConfig {
                destination: Some(DestinationConfig {
                    stream: "ingest".into(),
                    topic: "events".into(),
                    partition_id: None,
                    partition_key: None,
                }),
                route: None,
                partitioning: None,
                admission: None,
                accept: default_accept(),
                named_path: true,
                auth_type: default_auth_type(),
                auth_secret: None,
                auth_secret_env: None,
                auth_header: None,
                auth_prefix: None,
                auth_tolerance_secs: None,
                forward_headers: Vec::new(),
                metadata: default_metadata(),
                idempotency: true,
                idempotency_header: None,
                endpoints: Vec::new(),
            },
        );
        c
    }
}

/// One configuration problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// `sources.github.endpoints[1].auth_secret`; empty for the document itself.
    pub path: String,
    pub line: Option<usize>,
    pub message: String,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let path = if self.path.is_empty() { "(document)" } else { self.path.as_str() };
        // A message may quote the file's own text (serde's "unknown field `...`"): what
        // would act on a terminal (or forge a line of the journal) is escaped.
        let message = crate::terminal_text::safe(&self.message);
        match self.line {
            Some(l) => write!(f, "line {l}: {path}: {message}"),
            // Of the file, not of a key in it (it could not be read).
            None if self.path.is_empty() => write!(f, "{message}"),
            None => write!(f, "{path}: {message}"),
        }
    }
}

/// All problems found in one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors {
    pub file: Option<PathBuf>,
    pub errors: Vec<ConfigError>,
}

impl std::fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            match &self.file {
                Some(p) => write!(f, "{}: {e}", p.display())?,
                None => write!(f, "{e}")?,
            }
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// A path into the document, built while validating.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct KeyPath(Vec<Seg>);

#[derive(Debug, Clone, PartialEq)]
enum Seg {
    Key(String),
    Index(usize),
}

impl KeyPath {
    pub(crate) fn key(&self, k: &str) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Key(k.to_string()));
        p
    }
    pub(crate) fn index(&self, i: usize) -> KeyPath {
        let mut p = self.clone();
        p.0.push(Seg::Index(i));
        p
    }
}

impl std::fmt::Display for KeyPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, s) in self.0.iter().enumerate() {
            match s {
                Seg::Key(k) if !is_bare_key(k) && i == 0 => write!(f, "{k:?}")?,
                Seg::Key(k) if !is_bare_key(k) => write!(f, ".{k:?}")?,
                Seg::Key(k) if i == 0 => write!(f, "{k}")?,
                Seg::Key(k) => write!(f, ".{k}")?,
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

/// A key TOML writes without quotes.
fn is_bare_key(k: &str) -> bool {
    !k.is_empty() && k.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
}

fn line_of(text: &str, byte: usize) -> usize {
    text.as_bytes()[..byte.min(text.len())].iter().filter(|&&b| b == b'\n').count() + 1
}

/// Finds the line of the deepest part of `path` present in the document.
fn locate(text: Option<&str>, path: &KeyPath) -> Option<usize> {
    let text = text?;
    let root = parse_document(text)?;
    locate_in(text, &root, path)
}

/// The document `text` as spanned values, for [`locate_in`].
fn parse_document(text: &str) -> Option<toml::de::DeValue<'_>> {
    toml::de::DeTable::parse(text).ok().map(|root| toml::de::DeValue::Table(root.into_inner()))
}

/// [`locate`] in a document parsed once: a file with many problems is not parsed again
/// for each (nor any part of it copied).
fn locate_in(text: &str, root: &toml::de::DeValue<'_>, path: &KeyPath) -> Option<usize> {
    let mut span = None;
    let mut current = root;
    for seg in &path.0 {
        let next = match seg {
            Seg::Key(k) => current.get(k.as_str()),
            Seg::Index(i) => current.get(*i),
        };
        match next {
            Some(v) => {
                span = Some(v.span());
                current = v.get_ref();
            }
            None => break,
        }
    }
    span.map(|s| line_of(text, s.start))
}

/// Parses a file's text. `file` is only used in messages.
pub fn parse(text: &str, file: Option<PathBuf>) -> Result<Config, ConfigErrors> {
    let de = match toml::de::Deserializer::parse(text) {
        Ok(d) => d,
        Err(e) => {
            let at = e.span().map(|s| s.start);
            let (path, line) =
                (at.map(|b| crate::toml_lines::key_path_at(text, b)).unwrap_or_default(), at.map(|b| line_of(text, b)));
            return Err(ConfigErrors {
                file,
                errors: vec![ConfigError { path, line, message: e.message().to_string() }],
            });
        }
    };
    let first = match serde_path_to_error::deserialize::<_, Config>(de) {
        Ok(config) => return Ok(config),
        Err(e) => shape_error(text, e),
    };
    // serde stops at the first value of the wrong shape; the others are found by reading
    // the document again without each key refused so far (`more_shape_errors`).
    let mut errors = vec![first];
    more_shape_errors(text, &mut errors);
    let mut errors: Vec<ConfigError> = errors.into_iter().map(|(_, e)| e).collect();
    // In the order of the file, as a person fixes them.
    errors.sort_by_key(|e| e.line.unwrap_or(usize::MAX));
    Err(ConfigErrors { file, errors })
}

/// The most problems of shape (a value of the wrong type, an unknown key) one reading
/// reports: a file with more is rarely one a person wrote, and each costs a parse.
const SHAPE_ERRORS_MAX: usize = 20;

/// One problem of shape, with the key path it was found at.
fn shape_error(text: &str, e: serde_path_to_error::Error<toml::de::Error>) -> (KeyPath, ConfigError) {
    // Written as validation writes key paths (a key that is not bare quoted, as in
    // `sources."shop.v2".accept`): the crate's own joins segments with dots unquoted.
    use serde_path_to_error::Segment;
    let key_path = e.path().iter().fold(KeyPath::default(), |p, seg| match seg {
        Segment::Seq { index } => p.index(*index),
        Segment::Map { key } => p.key(key),
        Segment::Enum { variant } => p.key(variant),
        Segment::Unknown => p.key("?"),
    });
    let path = key_path.to_string();
    let inner = e.into_inner();
    let line = inner.span().map(|s| line_of(text, s.start)).or_else(|| locate(Some(text), &key_path));
    // serde quotes the value it refused ("invalid type: integer `12345678`"): at a
    // secret's key that would print the secret to the terminal and the journal.
    let message = if is_secret_key(&path) {
        "must be a string (what was given is not repeated here: it is a secret)".to_string()
    } else {
        inner.message().to_string()
    };
    (key_path, ConfigError { path, line, message })
}

/// Adds to `errors` (which holds the first) the problems of shape a reading finds once the
/// keys already refused are left out of the document, one more per reading, until one
/// reads (or [`SHAPE_ERRORS_MAX`]). The document left is written out and parsed as text,
/// as the file was, so that each problem is the one the file would give once the others
/// were fixed; its line is looked up in the file itself. A required key found missing
/// then is reported unless it is one that was left out; either way the table that needs
/// it is left out next; a wrong element of a list leaves out the whole list (removing the
/// element would renumber the others, and their paths would be wrong).
fn more_shape_errors(text: &str, errors: &mut Vec<(KeyPath, ConfigError)>) {
    let Ok(mut doc) = text.parse::<toml::Table>() else { return };
    let mut leave_out = errors.last().map(|(p, _)| p.clone());
    // The keys left out so far: a required one among them missing is not the file's
    // problem.
    let mut removed: Vec<KeyPath> = Vec::new();
    // Each reading leaves out one more key or table: bounded by what the file holds,
    // and by this.
    for _ in 0..4 * SHAPE_ERRORS_MAX {
        if errors.len() >= SHAPE_ERRORS_MAX {
            return;
        }
        let Some(path) = leave_out.take() else { return };
        if remove_key(&mut doc, &path) {
            removed.push(path);
        } else {
            // An element of a list: the whole list is left out (removing the element
            // would renumber those after it).
            let Some(list) = path.0.iter().rposition(|s| matches!(s, Seg::Key(_))) else { return };
            let list = KeyPath(path.0[..=list].to_vec());
            if !remove_key(&mut doc, &list) {
                return;
            }
            removed.push(list);
        }
        let Ok(rest) = toml::to_string(&doc) else { return };
        let Ok(de) = toml::de::Deserializer::parse(&rest) else { return };
        let (path, mut error) = match serde_path_to_error::deserialize::<_, Config>(de) {
            Ok(_) => return,
            Err(e) => shape_error(&rest, e),
        };
        if errors.iter().any(|(p, _)| *p == path) {
            return;
        }
        leave_out = Some(path.clone());
        // serde's words: "missing field `name`".
        let missing = error.message.strip_prefix("missing field `").and_then(|m| m.split('`').next());
        let left_out_here = missing.is_some_and(|field| {
            let key = path.key(field);
            removed.iter().any(|r| key.0.starts_with(&r.0))
        });
        if !left_out_here {
            error.line = locate(Some(text), &path);
            errors.push((path, error));
        }
    }
}

/// Removes the key at `path` from `doc`; false if `path` does not end at a key there.
fn remove_key(doc: &mut toml::Table, path: &KeyPath) -> bool {
    let Some((Seg::Key(last), parents)) = path.0.split_last() else { return false };
    let mut table = doc;
    let mut i = 0;
    while i < parents.len() {
        let next = match &parents[i] {
            Seg::Key(k) => table.get_mut(k.as_str()),
            Seg::Index(_) => None,
        };
        // A table, or an element of an array of tables.
        table = match (next, parents.get(i + 1)) {
            (Some(toml::Value::Table(t)), _) => t,
            (Some(toml::Value::Array(a)), Some(Seg::Index(n))) => match a.get_mut(*n) {
                Some(toml::Value::Table(t)) => {
                    i += 1;
                    t
                }
                _ => return false,
            },
            _ => return false,
        };
        i += 1;
    }
    table.remove(last.as_str()).is_some()
}

/// Whether the key at `path` (dotted) holds a secret: its value never appears in a message.
fn is_secret_key(path: &str) -> bool {
    let last = path.rsplit('.').next().unwrap_or(path);
    matches!(last, "auth_secret" | "password" | "token" | "management_token")
}

/// Everything the daemon runs on, validated.
#[derive(Debug, Clone)]
pub struct Settings {
    pub http_listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub max_body_bytes: usize,
    /// `http.max_events_per_request`: the most events one request may hold.
    pub max_events_per_request: usize,
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    /// `http.write_timeout_ms`: how long an answer may wait for its client to read it.
    pub write_timeout: Duration,
    pub max_connections: usize,
    pub retry_after_secs: u64,
    /// `[http.tls]`, loaded once at validation (so `config check` reads the files too).
    pub http_tls: Option<TlsFiles>,
    /// `[admin.tls]`, as `http_tls`.
    pub admin_tls: Option<TlsFiles>,
    /// Guards every admin route but `/health`; `None` leaves them open (loopback only,
    /// unless `admin.allow_unauthenticated_remote`).
    pub admin_token: Option<SecretString>,
    pub management_token: Option<SecretString>,
    pub grace_period: Duration,
    pub drain_delay: Duration,
    /// `runtime.worker_threads`; 0 = the machine's cores minus one, at least one
    /// ([`Settings::runtime_worker_threads`]).
    pub worker_threads: usize,
    pub log_level: String,
    pub log_json: bool,
    pub data_dir: PathBuf,
    pub wal: WalOptions,
    pub idempotency_retention: Duration,
    /// `idempotency.max_keys`.
    pub idempotency_max_keys: u64,
    pub checkpoint_interval: Duration,
    pub sources: Vec<SourceSpec>,
    pub endpoints: Vec<Endpoint>,
    pub delivery: crate::delivery::DeliverySettings,
    /// Settings that are valid but look unintended (`Checker::warn`): printed by `config
    /// check`, logged at start. Never a reason to refuse: what they depend on (a topic's
    /// partitions on the server, which destinations a sender names) is outside the file.
    pub warnings: ConfigErrors,
}

/// The log's directory under `storage.data_dir`. Its lock (`wal::LOCK_FILE`) is the
/// daemon's: taken before the state database is opened, held while the daemon runs, and
/// taken by every command that changes the state database.
pub const WAL_DIR_NAME: &str = "wal";

impl Settings {
    pub fn wal_dir(&self) -> PathBuf {
        self.data_dir.join(WAL_DIR_NAME)
    }
    pub fn state_path(&self) -> PathBuf {
        self.data_dir.join("state.redb")
    }

    /// The async runtime's worker threads on a machine with `cores` cores: as
    /// configured, or (0) one fewer than the cores, at least one. The log's writer is
    /// a thread of its own that each group commit wakes; a worker per core beside it
    /// oversubscribes the cores, and idle workers woken to steal work cost more than
    /// they take (docs/performance.md, "the CPU budget, one worker fewer").
    pub fn runtime_worker_threads(&self, cores: usize) -> usize {
        if self.worker_threads > 0 { self.worker_threads } else { cores.saturating_sub(1).max(1) }
    }
}

/// The longest `idempotency.checkpoint_interval_ms`. The log is released only below the
/// durable checkpoint (a record leaves the log once its key is durable), so the interval
/// is how long delivered records keep their space; and a start re-reads the log from
/// the last checkpoint. A minute, like the longest `wal.sync_interval_ms`.
const CHECKPOINT_INTERVAL_MS_MAX: u64 = 60_000;

/// The most `wal.max_bytes / wal.segment_max_bytes`. The log keeps each segment's file
/// open, and a segment can be as little as half full, so a full log holds up to twice
/// this many files, which the start counts with the connections against the open-file
/// limit (`open_files`). A log that ran out of descriptors could neither rotate (every
/// append refused) nor be opened again after a restart.
const WAL_SEGMENTS_MAX: u64 = 16_384;

/// The longest idempotency window: ten years.
const RETENTION_SECS_MAX: u64 = 10 * 366 * 86_400;

/// The most `idempotency.max_keys` may allow: a billion keys, up to about 360 GB of
/// state database at 360 bytes a key.
const MAX_KEYS_MAX: u64 = 1_000_000_000;

/// Two listen addresses one process cannot both bind: the same port (not 0, which picks
/// a free one) on the same address; or with either on `::`, which takes the port on
/// every address of both families (Linux's dual stack, `net.ipv6.bindv6only = 0`, the
/// default); or with either on `0.0.0.0` and the other an IPv4 address (an IPv4-mapped
/// IPv6 one included). `0.0.0.0` and `::1` bind side by side: the families differ.
fn listeners_collide(a: SocketAddr, b: SocketAddr) -> bool {
    use std::net::IpAddr;
    if a.port() == 0 || a.port() != b.port() {
        return false;
    }
    let (a, b) = (a.ip(), b.ip());
    let v6_any = |ip: IpAddr| matches!(ip, IpAddr::V6(v) if v.is_unspecified());
    let v4 = |ip: IpAddr| match ip {
        IpAddr::V4(v) => Some(v),
        IpAddr::V6(v) => v.to_ipv4_mapped(),
    };
    a == b
        || v6_any(a)
        || v6_any(b)
        || matches!((v4(a), v4(b)), (Some(x), Some(y)) if x == y || x.is_unspecified() || y.is_unspecified())
}

/// Whether a client connecting to `address` (`HOST:PORT`, checked) reaches the listener
/// bound to `listen` of this process: the same port (not 0), and the same IP address, or
/// a loopback or unspecified one of a family the listener takes where it is on every
/// address (`0.0.0.0` takes IPv4 only, `::` both). `localhost` is both loopbacks; any
/// other host name is not resolved: it may name another machine.
fn connects_to_listener(address: &str, listen: SocketAddr) -> bool {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let targets: Vec<SocketAddr> = match address.parse::<SocketAddr>() {
        Ok(a) => vec![a],
        Err(_) => match address.rsplit_once(':') {
            Some((host, port)) if host.eq_ignore_ascii_case("localhost") || host.eq_ignore_ascii_case("localhost.") => {
                match port.parse::<u16>() {
                    Ok(port) => vec![
                        SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port),
                        SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), port),
                    ],
                    Err(_) => return false,
                }
            }
            _ => return false,
        },
    };
    let local = |ip: IpAddr| ip.is_loopback() || ip.is_unspecified();
    // Whether a listener on every address of `listen`'s family takes `ip`'s.
    let takes_family = |ip: IpAddr| matches!((listen.ip(), ip), (IpAddr::V6(_), _) | (IpAddr::V4(_), IpAddr::V4(_)));
    targets.iter().any(|target| {
        listen.port() != 0
            && target.port() == listen.port()
            && (target.ip() == listen.ip()
                || (listen.ip().is_unspecified() && local(target.ip()) && takes_family(target.ip()))
                || (target.ip().is_unspecified() && local(listen.ip()) && target.is_ipv4() == listen.is_ipv4()))
    })
}

/// Headers that do not tell one delivery from the next (the same for every one of a
/// sender, or for every one in the same second: `date`); as a delivery id each would make
/// every request after the first a "replay" answered 200 and never stored.
const SAME_FOR_EVERY_DELIVERY: &[&str] = &[
    "host",
    "date",
    "origin",
    "referer",
    "via",
    "forwarded",
    "x-forwarded-host",
    "x-forwarded-proto",
    "accept-language",
    "cache-control",
    "expect",
    "user-agent",
    "content-type",
    "content-length",
    "content-encoding",
    "accept",
    "accept-encoding",
    "connection",
    "transfer-encoding",
    "x-forwarded-for",
    "x-real-ip",
];

/// The most `http.max_events_per_request` may allow: every event of a request is encoded
/// (its envelope included) in memory before the one append that holds them all.
const MAX_EVENTS_PER_REQUEST_LIMIT: u64 = 1_000_000;

/// The most connections `http.max_connections` may allow: each is an open file, and
/// a million is already beyond what a process is usually allowed (`ulimit -n`); far
/// above it the connection semaphore itself could not be built.
const MAX_CONNECTIONS_LIMIT: u64 = 1_000_000;

/// The longest `http.retry_after_secs`: an hour. A sender that obeys `Retry-After` stops
/// sending deliveries it still owes for that long; a value meant in milliseconds (5000)
/// would be over an hour, and a larger one would make senders give up.
const RETRY_AFTER_SECS_MAX: u64 = 3600;

/// The longest header name or value Iggy takes: bounds a source key (sent with every
/// message as `iggy-ingest-source`) and a forwarded header's name.
const IGGY_HEADER_FIELD_MAX_BYTES: usize = ingest::envelope::ENVELOPE_FIELD_MAX_BYTES;

/// The most worker threads `runtime.worker_threads` may ask for.
pub const MAX_WORKER_THREADS: u64 = 1024;

struct Checker<'a> {
    text: Option<&'a str>,
    /// `text` parsed, once, at the first problem found.
    document: std::cell::OnceCell<Option<toml::de::DeValue<'a>>>,
    errors: Vec<ConfigError>,
    warnings: Vec<ConfigError>,
}

impl Checker<'_> {
    fn line(&self, path: &KeyPath) -> Option<usize> {
        let text = self.text?;
        let root = self.document.get_or_init(|| parse_document(text)).as_ref()?;
        locate_in(text, root, path)
    }

    fn err(&mut self, path: &KeyPath, message: impl Into<String>) {
        let line = self.line(path);
        self.errors.push(ConfigError { path: path.to_string(), line, message: message.into() });
    }

    /// A setting that is valid but, as far as this file can tell, will not do what its
    /// operator wants: `config check` prints it and the daemon logs it at start.
    fn warn(&mut self, path: &KeyPath, message: impl Into<String>) {
        let line = self.line(path);
        self.warnings.push(ConfigError { path: path.to_string(), line, message: message.into() });
    }

    fn addr(&mut self, path: &KeyPath, s: &str) -> SocketAddr {
        match s.parse() {
            Ok(a) => a,
            Err(_) => {
                self.err(path, format!("{s:?} is not an address of the form IP:PORT (port 0 picks a free one)"));
                SocketAddr::from(([127, 0, 0, 1], 0))
            }
        }
    }

    fn positive(&mut self, path: &KeyPath, v: u64) -> u64 {
        if v == 0 {
            self.err(path, "must be greater than 0");
        }
        v
    }
}

/// The longest `http.body_read_timeout_ms`: two minutes, well inside the five minutes
/// (`ingest::idempotency::SWEEP_GRACE_MS`) a request with a delivery id has from its head
/// to its lookup, so a slow body meets its 408 rather than a 503 once it was read.
const BODY_READ_TIMEOUT_MS_MAX: u64 = 120_000;

/// The longest `http.header_read_timeout_ms` and `http.write_timeout_ms`: two minutes, as
/// for the body. They are what keeps a slow or idle client from holding one of
/// `http.max_connections`; an hour (a zero too many) would turn that protection off.
const CLIENT_TIMEOUT_MS_MAX: u64 = 120_000;

/// The longest `shutdown.grace_period_ms` and `shutdown.drain_delay_ms`: an hour, far
/// past any supervisor's stop timeout (systemd's default is 90 s).
const SHUTDOWN_MS_MAX: u64 = 3_600_000;

/// How near its expiry a listener's certificate is warned of: two weeks, the margin of
/// the alert on `iggy_ingest_tls_certificate_expiry_timestamp_seconds`.
const TLS_EXPIRY_WARNING_SECS: i64 = 14 * 86_400;

/// What to say of a listener's certificate valid over `validity`, if it is not valid yet,
/// or within [`TLS_EXPIRY_WARNING_SECS`] of its expiry or past it: a valid
/// configuration, but clients refuse the certificate (or will soon). Said by `config
/// check` and at start (as a warning of the configuration) and at each reload; never a
/// reason to refuse one (a renewal may be on its way, a clock may be behind, and SIGHUP
/// takes the next).
pub fn tls_validity_warning(validity: http_source::tls::Validity) -> Option<String> {
    let now_secs = (ingest::time::now_unix_ms() / 1000) as i64;
    let show = |at: i64| {
        jiff::Timestamp::from_second(at)
            .map(|t| format!("{t:.0}"))
            .unwrap_or_else(|_| format!("{at} s from the Unix epoch"))
    };
    if validity.not_before_unix_secs > now_secs {
        return Some(format!(
            "the certificate is not valid until {}: clients refuse it until then",
            show(validity.not_before_unix_secs)
        ));
    }
    let at = validity.not_after_unix_secs;
    if at - now_secs >= TLS_EXPIRY_WARNING_SECS {
        return None;
    }
    let when = show(at);
    Some(if at <= now_secs {
        format!("the certificate expired at {when}: clients refuse it")
    } else {
        format!("the certificate expires at {when}, in {} days", (at - now_secs) / 86_400)
    })
}

/// Everything to say of a pair a listener loaded (its validity, its chain), each a
/// warning: `config check` and the start say them of the configuration, a reload logs
/// them.
pub fn tls_warnings(pair: &rustls::sign::CertifiedKey) -> Vec<String> {
    let validity = http_source::tls::validity(pair).and_then(tls_validity_warning);
    [validity, http_source::tls::chain_warning(&pair.cert)].into_iter().flatten().collect()
}

/// A listener's `tls` table as the files it names, each read and checked as the listener
/// will at start: a problem names the key of the file it is in.
fn tls_files(c: &mut Checker<'_>, path: &KeyPath, tls: Option<&TlsConfig>) -> Option<TlsFiles> {
    let tls = tls?;
    let mut empty = false;
    for (key, value) in [("cert_file", &tls.cert_file), ("key_file", &tls.key_file)] {
        if value.is_empty() {
            c.err(&path.key(key), "must name a PEM file");
            empty = true;
        }
    }
    if empty {
        return None;
    }
    let files = TlsFiles { cert_file: PathBuf::from(&tls.cert_file), key_file: PathBuf::from(&tls.key_file) };
    match http_source::tls::load(&files) {
        Ok(pair) => {
            for message in tls_warnings(&pair) {
                c.warn(&path.key("cert_file"), message);
            }
            Some(files)
        }
        Err(e) => {
            c.err(&path.key(e.file.key()), e.message);
            None
        }
    }
}

/// Validates a parsed configuration. `text` is the file's text, for line numbers.
pub fn validate(config: &Config, text: Option<&str>, file: Option<PathBuf>) -> Result<Settings, ConfigErrors> {
    let mut c = Checker { text, document: std::cell::OnceCell::new(), errors: Vec::new(), warnings: Vec::new() };
    let root = KeyPath::default();

    let http = root.key("http");
    let http_listen = c.addr(&http.key("listen"), &config.http.listen);
    let max_body_bytes = c.positive(&http.key("max_body_bytes"), config.http.max_body_bytes);
    // Past it, the per-source checks of what a body takes are not run (their arithmetic
    // can saturate), and the limit is refused once, here.
    let body_limit_refused = max_body_bytes > router::IGGY_PAYLOAD_MAX_BYTES;
    if body_limit_refused {
        // A single event takes the whole body: past this it would be accepted, and its
        // destination would refuse it for ever, blocking the events behind it.
        c.err(
            &http.key("max_body_bytes"),
            format!(
                "must be at most {} (the largest payload Iggy stores in one message): a larger event would be accepted and never delivered",
                router::IGGY_PAYLOAD_MAX_BYTES
            ),
        );
    }
    let header_read_timeout_ms = c.positive(&http.key("header_read_timeout_ms"), config.http.header_read_timeout_ms);
    for (key, value) in [
        ("header_read_timeout_ms", config.http.header_read_timeout_ms),
        ("write_timeout_ms", config.http.write_timeout_ms),
    ] {
        if value > CLIENT_TIMEOUT_MS_MAX {
            c.err(
                &http.key(key),
                format!(
                    "must be at most {CLIENT_TIMEOUT_MS_MAX}: it bounds how long a slow or idle client may hold a connection"
                ),
            );
        }
    }
    let body_read_timeout_ms = c.positive(&http.key("body_read_timeout_ms"), config.http.body_read_timeout_ms);
    if body_read_timeout_ms > BODY_READ_TIMEOUT_MS_MAX {
        c.err(
            &http.key("body_read_timeout_ms"),
            format!(
                "must be at most {BODY_READ_TIMEOUT_MS_MAX}: a request with a delivery id must reach its lookup within \
                 {} ms of its head (keys are kept that long past their window), or it is refused with 503",
                ingest::idempotency::SWEEP_GRACE_MS
            ),
        );
    }
    let write_timeout_ms = c.positive(&http.key("write_timeout_ms"), config.http.write_timeout_ms);
    let max_connections = c.positive(&http.key("max_connections"), config.http.max_connections);
    if max_connections > MAX_CONNECTIONS_LIMIT {
        c.err(&http.key("max_connections"), format!("must be at most {MAX_CONNECTIONS_LIMIT}"));
    }
    let retry_after_secs = c.positive(&http.key("retry_after_secs"), config.http.retry_after_secs);
    if retry_after_secs > RETRY_AFTER_SECS_MAX {
        c.err(&http.key("retry_after_secs"), format!("must be at most {RETRY_AFTER_SECS_MAX} (an hour)"));
    }
    let max_events_per_request = c.positive(&http.key("max_events_per_request"), config.http.max_events_per_request);
    if max_events_per_request > MAX_EVENTS_PER_REQUEST_LIMIT {
        c.err(
            &http.key("max_events_per_request"),
            format!("{max_events_per_request} is more than {MAX_EVENTS_PER_REQUEST_LIMIT}"),
        );
    }

    let http_tls = tls_files(&mut c, &http.key("tls"), config.http.tls.as_ref());

    let admin = root.key("admin");
    let admin_listen = c.addr(&admin.key("listen"), &config.admin.listen);
    let admin_tls = tls_files(&mut c, &admin.key("tls"), config.admin.tls.as_ref());
    if listeners_collide(http_listen, admin_listen) {
        c.err(
            &admin.key("listen"),
            format!("{admin_listen} is also the webhook listener's address (http.listen = {http_listen}); one of them could not bind"),
        );
    }
    let management_token = match (&config.admin.management_token, &config.admin.management_token_env) {
        (Some(_), Some(_)) => {
            c.err(&admin.key("management_token_env"), "set either management_token or management_token_env, not both");
            None
        }
        (Some(t), None) => usable_token(&mut c, &admin.key("management_token"), "the token", t.expose())
            .then(|| t.expose().to_string()),
        (None, Some(var)) => match std::env::var(var) {
            Ok(t) => {
                let from = format!("the value of environment variable {var}");
                usable_token(&mut c, &admin.key("management_token_env"), &from, &t).then_some(t)
            }
            Err(_) => {
                c.err(
                    &admin.key("management_token_env"),
                    format!("environment variable {var} is not set (or not UTF-8)"),
                );
                None
            }
        },
        (None, None) => None,
    };
    let admin_token = admin_token(&mut c, &admin, &config.admin, management_token.as_deref());
    let token_configured = config.admin.token.is_some() || config.admin.token_env.is_some();
    if token_configured && config.admin.allow_unauthenticated_remote {
        c.err(
            &admin.key("allow_unauthenticated_remote"),
            "has no effect with admin.token set (every admin route but /health needs the token); remove it",
        );
    }
    if !token_configured && config.admin.allow_unauthenticated_remote && admin_listen.ip().is_loopback() {
        // Valid (a listener moved off loopback later needs it), but it allows nothing now.
        c.warn(
            &admin.key("allow_unauthenticated_remote"),
            format!("has no effect while admin.listen ({admin_listen}) is a loopback address"),
        );
    }
    if !token_configured && !config.admin.allow_unauthenticated_remote && !admin_listen.ip().is_loopback() {
        c.err(
            &admin.key("listen"),
            format!(
                "{admin_listen} is not a loopback address, and without admin.token (or admin.token_env) anyone who \
                 can reach it reads /status and /metrics; set a token, or admin.allow_unauthenticated_remote = true \
                 if the network in front of it is trusted"
            ),
        );
    }

    // A limit like every other: far above any machine this runs on, low enough that a
    // typo (an extra digit or three) is refused instead of spawning threads by the thousand.
    let worker_threads = config.runtime.worker_threads;
    if worker_threads > MAX_WORKER_THREADS {
        c.err(
            &root.key("runtime").key("worker_threads"),
            format!("{worker_threads} is more than {MAX_WORKER_THREADS}; 0 picks the machine's cores minus one"),
        );
    }
    let worker_threads = worker_threads.min(MAX_WORKER_THREADS) as usize;

    let logging = root.key("logging");
    let log_level = config.logging.level.clone();
    if crate::logging::normalized(&log_level).is_empty() {
        c.err(&logging.key("level"), "must name a level or filter (e.g. \"info\", \"warn,iggy_ingest=debug\")");
    } else if crate::logging::parse(&log_level).is_err() {
        c.err(
            &logging.key("level"),
            format!("{log_level:?} is not a level or filter (e.g. \"info\", \"iggy_ingest=debug\")"),
        );
    } else if !crate::logging::sets_default_level(&log_level) {
        c.warn(
            &logging.key("level"),
            format!(
                "{log_level:?} sets no level for every target (a misspelt level is a target name to it), so every \
                 target it does not name logs at {}: add a level, e.g. \"info,iggy_ingest=debug\"",
                crate::logging::LEVEL_WHERE_NONE_IS_SET
            ),
        );
    }
    let log_json = match config.logging.format.as_str() {
        "text" => false,
        "json" => true,
        other => {
            c.err(&logging.key("format"), format!("{other:?}: expected \"text\" or \"json\""));
            false
        }
    };

    let storage = root.key("storage");
    if config.storage.data_dir.is_empty() {
        c.err(&storage.key("data_dir"), "must not be empty");
    }

    let w = root.key("wal");
    // Checked whatever the policy: a value that would refuse the switch to "interval"
    // later is said now.
    let ms = config.wal.sync_interval_ms;
    if ms == 0 || ms > 60_000 {
        c.err(&w.key("sync_interval_ms"), "must be between 1 and 60000");
    }
    let sync = match config.wal.sync.as_str() {
        "always" => SyncPolicy::Always,
        "interval" => SyncPolicy::Interval(Duration::from_millis(ms.clamp(1, 60_000))),
        other => {
            c.err(&w.key("sync"), format!("{other:?}: expected \"always\" or \"interval\""));
            SyncPolicy::Always
        }
    };
    let record_max_bytes = u32::try_from(config.wal.record_max_bytes).unwrap_or(u32::MAX);
    if record_max_bytes == 0 || record_max_bytes > wal::format::RECORD_MAX_BYTES {
        c.err(&w.key("record_max_bytes"), format!("must be between 1 and {}", wal::format::RECORD_MAX_BYTES));
    }
    if u128::from(config.wal.max_bytes) < 2 * u128::from(config.wal.segment_max_bytes) {
        c.err(&w.key("max_bytes"), "must be at least twice wal.segment_max_bytes (space is freed a segment at a time)");
    }
    if config.wal.segment_max_bytes < 4096 {
        c.err(&w.key("segment_max_bytes"), "must be at least 4096");
    } else if config.wal.max_bytes / config.wal.segment_max_bytes > WAL_SEGMENTS_MAX {
        c.err(
            &w.key("max_bytes"),
            format!(
                "must be at most {WAL_SEGMENTS_MAX} times wal.segment_max_bytes: the log keeps a file open per segment (raise segment_max_bytes for a larger log)"
            ),
        );
    }
    if config.wal.preallocate_bytes > PREALLOCATE_BYTES_MAX {
        c.err(&w.key("preallocate_bytes"), format!("must be at most {PREALLOCATE_BYTES_MAX}"));
    }
    let wal_options = WalOptions {
        segment_max_bytes: config.wal.segment_max_bytes,
        max_bytes: config.wal.max_bytes,
        record_max_bytes: record_max_bytes.clamp(1, wal::format::RECORD_MAX_BYTES),
        sync,
        preallocate_bytes: config.wal.preallocate_bytes,
        ..WalOptions::default()
    };
    // A body of one event, with its envelope and frame header, must also fit in the log
    // as one batch even when the log is empty: otherwise its sender would be told "full,
    // retry later" (503) for ever. Checked per source, with its own envelope, below.
    let batch_max_bytes = wal_options.batch_max_bytes();

    let idem = root.key("idempotency");
    let retention_secs = c.positive(&idem.key("retention_secs"), config.idempotency.retention_secs);
    if retention_secs > RETENTION_SECS_MAX {
        // Kept as milliseconds since the epoch: far larger windows would wrap.
        c.err(&idem.key("retention_secs"), format!("{retention_secs} is more than {RETENTION_SECS_MAX} (ten years)"));
    }
    let checkpoint_ms = c.positive(&idem.key("checkpoint_interval_ms"), config.idempotency.checkpoint_interval_ms);
    if checkpoint_ms > CHECKPOINT_INTERVAL_MS_MAX {
        c.err(
            &idem.key("checkpoint_interval_ms"),
            format!(
                "must be at most {CHECKPOINT_INTERVAL_MS_MAX}: the log is released only below the last checkpoint, so a longer interval holds delivered records in it that long"
            ),
        );
    }

    let max_keys = c.positive(&idem.key("max_keys"), config.idempotency.max_keys);
    if max_keys > MAX_KEYS_MAX {
        c.err(
            &idem.key("max_keys"),
            format!("{max_keys} is more than {MAX_KEYS_MAX}: up to about 360 GB of state database"),
        );
    }

    let iggy = root.key("iggy");
    let address = &config.iggy.address;
    match crate::host_port::check(address) {
        Err(why) => c.err(&iggy.key("address"), format!("{address:?} {why}")),
        // The client takes the TLS server name from the text before the first ':'.
        Ok(()) if config.iggy.tls && config.iggy.tls_domain.is_none() && address.starts_with('[') => c.err(
            &iggy.key("tls_domain"),
            format!(
                "must be set with iggy.tls = true and an IPv6 iggy.address ({address}): the client would take \"[\" \
                 as the server's name"
            ),
        ),
        Ok(()) => {
            for (listener, listen) in [("http.listen", http_listen), ("admin.listen", admin_listen)] {
                if connects_to_listener(address, listen) {
                    c.err(
                        &iggy.key("address"),
                        format!(
                            "{address:?} is the daemon's own {listener} ({listen}): it would send its events to \
                             itself, and never deliver one (Iggy's TCP port is 8090 by default)"
                        ),
                    );
                }
            }
        }
    }
    if let Some(domain) = &config.iggy.tls_domain {
        if !config.iggy.tls {
            c.err(&iggy.key("tls_domain"), "is not used unless iggy.tls = true");
        } else if rustls::pki_types::ServerName::try_from(domain.as_str()).is_err() {
            // The client checks it only when it connects, and a failed connect only holds
            // the records: every connect would fail, and nothing would be delivered.
            c.err(
                &iggy.key("tls_domain"),
                format!("{domain:?} is not a DNS name or IP address to check the server's certificate against"),
            );
        }
    }
    // The client refuses other lengths before it sends the sign-in: the daemon would
    // start, accept, and never deliver. (The password's length only, never its text.)
    for (key, len, range) in [
        ("username", config.iggy.username.len(), router::IGGY_USERNAME_BYTES),
        ("password", config.iggy.password.expose().len(), router::IGGY_PASSWORD_BYTES),
    ] {
        if !range.contains(&len) {
            c.err(
                &iggy.key(key),
                format!("is {len} bytes long; Iggy signs in only with {} to {} bytes", range.start(), range.end()),
            );
        }
    }
    if let Some(ca) = &config.iggy.tls_ca_file {
        // The client reads it only when it connects, and a failed connect only holds the
        // records: a wrong path would pass every check and never deliver.
        if !config.iggy.tls {
            c.err(&iggy.key("tls_ca_file"), "is not used unless iggy.tls = true");
        } else if let Err(problem) = ca_roots(std::path::Path::new(ca)) {
            c.err(&iggy.key("tls_ca_file"), problem);
        }
    }

    let shutdown = root.key("shutdown");
    if config.shutdown.grace_period_ms == 0 || config.shutdown.grace_period_ms > SHUTDOWN_MS_MAX {
        c.err(
            &shutdown.key("grace_period_ms"),
            format!("must be between 1 and {SHUTDOWN_MS_MAX} (0 would cut every request in flight at each stop)"),
        );
    }
    if config.shutdown.drain_delay_ms > SHUTDOWN_MS_MAX {
        c.err(&shutdown.key("drain_delay_ms"), format!("must be at most {SHUTDOWN_MS_MAX}"));
    }

    let source_keys: Vec<String> = config.sources.keys().cloned().collect();
    let (delivery, problems) = crate::delivery::check(&config.router, &config.iggy, &source_keys);
    for (segments, message) in problems {
        let path = segments.iter().fold(KeyPath::default(), |p, k| p.key(k));
        c.err(&path, message);
    }

    let sources_path = root.key("sources");
    if config.sources.is_empty() {
        c.err(&sources_path, "at least one source is required");
    }
    if config.sources.len() > SOURCES_MAX {
        c.err(
            &sources_path,
            format!(
                "{} sources; at most {SOURCES_MAX} (each is a label of every per-source metric): serve many senders of one kind through one source's endpoints",
                config.sources.len()
            ),
        );
    }
    let static_endpoints: usize = config.sources.values().map(|s| s.endpoints.len()).sum();
    if static_endpoints > http_source::endpoints::DYNAMIC_ENDPOINTS_MAX {
        c.err(
            &sources_path,
            format!(
                "{static_endpoints} static endpoints in all; at most {} (every one is held in memory): register more through the management API",
                http_source::endpoints::DYNAMIC_ENDPOINTS_MAX
            ),
        );
    }
    let mut sources = Vec::new();
    let mut endpoints: Vec<Endpoint> = Vec::new();
    let mut endpoint_ids: std::collections::HashSet<u128> = std::collections::HashSet::new();
    for (key, s) in &config.sources {
        let sp = sources_path.key(key);
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')) {
            c.err(&sp, "a source key may only hold letters, digits, '-', '_' and '.'");
        } else if RESERVED_SOURCE_KEYS.contains(&key.as_str()) {
            c.err(
                &sp,
                format!(
                    "{key:?} is reserved: the metrics count requests that name no source, and records of none, under it"
                ),
            );
        } else if key.bytes().all(|b| b == b'.') {
            // `/v1/sources/..` is a dot segment: clients resolve it away (RFC 3986, 5.2.4)
            // before they send, so the source's named path could never be reached.
            c.err(&sp, "a source key may not be made of dots alone ('.' and '..' are path segments clients remove)");
        } else if key.len() > IGGY_HEADER_FIELD_MAX_BYTES {
            // Every record carries it, and every message as the iggy-ingest-source header.
            c.err(
                &sp,
                format!("a source key is at most {IGGY_HEADER_FIELD_MAX_BYTES} bytes (Iggy's header value limit)"),
            );
        }
        let (destinations, partitioning, admission) = where_events_go(&mut c, &sp, s);
        let accept = match s.accept.as_str() {
            "any" => Accept::Any,
            "json" => Accept::Json,
            other => {
                c.err(&sp.key("accept"), format!("{other:?}: expected \"any\" or \"json\""));
                Accept::Any
            }
        };
        // The source's own auth guards its named path only: without one, it would guard
        // nothing, though it reads as if it did (each endpoint has its own).
        // A warning, as for the other settings that do nothing now (kept for a named
        // path turned on later; a file that started before still does).
        let auth = match s.auth().first_set_key() {
            Some(key) if !s.named_path => {
                c.warn(
                    &sp.key(key),
                    "is not used: named_path = false, so no request reaches the source's own auth (each of its \
                     endpoints has an auth_type of its own)",
                );
                AuthScheme::None
            }
            _ => auth_scheme(&mut c, &sp, s.auth()),
        };
        // A source that keeps no delivery ids has no replay to answer.
        if s.idempotency && s.named_path {
            tolerance_within_retention(&mut c, &sp, &auth, s.auth().auth_tolerance_secs.is_some(), retention_secs);
        }
        let mut forward_headers = Vec::new();
        if s.forward_headers.len() > router::FORWARD_HEADERS_MAX {
            c.err(
                &sp.key("forward_headers"),
                format!(
                    "{} names; at most {}, so that a message's headers stay within Iggy's limit of {} bytes",
                    s.forward_headers.len(),
                    router::FORWARD_HEADERS_MAX,
                    router::IGGY_USER_HEADERS_MAX_BYTES
                ),
            );
        }
        for (i, h) in s.forward_headers.iter().enumerate() {
            let hp = sp.key("forward_headers").index(i);
            if axum::http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                c.err(&hp, format!("{h:?} is not a valid header name"));
            } else if h.len() > IGGY_HEADER_FIELD_MAX_BYTES {
                c.err(
                    &hp,
                    format!("a header name is at most {IGGY_HEADER_FIELD_MAX_BYTES} bytes (Iggy's header name limit)"),
                );
            } else if forward_headers.contains(&h.to_ascii_lowercase()) {
                c.err(&hp, format!("{h:?} is listed twice"));
            } else if is_credential_header(h) {
                c.err(&hp, format!("{h:?} carries credentials and may not be forwarded into the log"));
            } else if let Some(why) = set_by_the_daemon(h) {
                c.err(&hp, format!("{h:?} {why}; a sender's value would replace it in every message"));
            } else {
                forward_headers.push(h.to_ascii_lowercase());
            }
        }
        if let Some(signature) = auth.configured_signature_header() {
            forwarded_signature(&mut c, &sp, s, signature, "the source's named path");
        }
        let mut metadata = MetadataFields::default();
        for (i, m) in s.metadata.iter().enumerate() {
            match m.as_str() {
                "peer_addr" => metadata.peer_addr = true,
                "received_at" => metadata.received_at = true,
                other => {
                    c.err(&sp.key("metadata").index(i), format!("{other:?}: expected \"peer_addr\" or \"received_at\""))
                }
            }
        }
        let idempotency_header = s.idempotency_header.as_ref().map(|h| h.to_ascii_lowercase());
        if let Some(h) = &idempotency_header {
            let ip = sp.key("idempotency_header");
            if !s.idempotency {
                c.err(&ip, "is not used unless the source's idempotency = true");
            } else if axum::http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                c.err(&ip, format!("{h:?} is not a valid header name"));
            } else if is_credential_header(h) {
                // The delivery id is stored in every record, and a credential repeats
                // across deliveries: every request after the first would be answered as
                // its replay and never stored.
                c.err(
                    &ip,
                    format!("{h:?} carries credentials: it would be stored in the log and name every delivery alike"),
                );
            } else if SAME_FOR_EVERY_DELIVERY.contains(&h.as_str()) {
                c.err(
                    &ip,
                    format!("{h:?} does not tell one delivery from the next (a sender sends the same for many): every request after the first would be answered as a replay and never stored"),
                );
            } else if s.named_path && matches!(auth, AuthScheme::StandardWebhooks { .. }) {
                // The signed id wins (an unsigned header beside it could make a captured
                // request a new delivery): on this path the header is never read.
                c.warn(
                    &ip,
                    format!(
                        "{h:?} is not read on the named path: a Standard Webhooks request's delivery id is its signed \
                         webhook-id; it is read only on endpoints of another auth_type"
                    ),
                );
            }
        }
        for (i, e) in s.endpoints.iter().enumerate() {
            let ep = sp.key("endpoints").index(i);
            let Some(id) = parse_id(&e.id) else {
                c.err(&ep.key("id"), "must be 32 hex digits (a 128-bit id; e.g. `openssl rand -hex 16`)");
                continue;
            };
            if !endpoint_ids.insert(id) {
                c.err(&ep.key("id"), "is used by another endpoint");
            }
            let auth = auth_scheme(&mut c, &ep, e.auth());
            if let Some(Err(message)) = e.handshake_param.as_deref().map(http_source::endpoints::check_handshake_param)
            {
                c.err(&ep.key("handshake_param"), message);
            }
            if s.idempotency {
                tolerance_within_retention(&mut c, &ep, &auth, e.auth().auth_tolerance_secs.is_some(), retention_secs);
            }
            let expires_at_unix_ms = match &e.expires_at {
                None => None,
                // RFC 3339: a time with its offset (`Z`, `+01:00`). One without an offset
                // is refused, not read as UTC: an hour off, an endpoint would expire early
                // or late without a word.
                Some(t) => match t.parse::<jiff::Timestamp>() {
                    Ok(ts) if ts >= jiff::Timestamp::UNIX_EPOCH => Some(ts.as_millisecond().unsigned_abs()),
                    Ok(_) => {
                        c.err(&ep.key("expires_at"), format!("{t:?} is before 1970"));
                        None
                    }
                    // A time a year earlier would parse: the text is well formed, and past
                    // the latest instant the daemon's time type holds.
                    Err(_)
                        if t.strip_prefix("9999-")
                            .is_some_and(|r| format!("9998-{r}").parse::<jiff::Timestamp>().is_ok()) =>
                    {
                        c.err(
                            &ep.key("expires_at"),
                            format!(
                                "{t:?} is past the latest time taken, {}",
                                jiff::Timestamp::MAX.strftime("%Y-%m-%dT%H:%M:%SZ")
                            ),
                        );
                        None
                    }
                    Err(_) => {
                        c.err(
                            &ep.key("expires_at"),
                            format!(
                                "{t:?} is not an RFC 3339 time with its offset (e.g. \"2027-01-31T00:00:00Z\" or \"2027-01-31T01:00:00+01:00\")"
                            ),
                        );
                        None
                    }
                },
            };
            if let Some(signature) = auth.configured_signature_header() {
                // Named by its place in the file: a static endpoint's id is its secret path,
                // and errors are printed, logged and kept by service managers.
                forwarded_signature(&mut c, &sp, s, signature, &format!("endpoint {ep}"));
            }
            endpoints.push(Endpoint {
                id,
                source_key: key.clone(),
                auth,
                handshake_param: e.handshake_param.clone(),
                expires_at_unix_ms,
                revoked_at_unix_ms: None,
                dynamic: false,
                record: None,
                unusable: None,
            });
        }
        if !s.named_path && s.endpoints.is_empty() && management_token.is_none() {
            c.warn(
                &sp.key("named_path"),
                "false, with no static endpoints and no admin.management_token to register dynamic ones: no \
                 request can reach this source",
            );
        }
        let spec = SourceSpec {
            key: key.clone(),
            destinations,
            partitioning,
            admission,
            accept,
            named_path: s.named_path,
            auth,
            forward_headers,
            metadata,
            idempotency_header,
            idempotency: s.idempotency,
        };
        // The largest event plus the largest envelope this source writes must be a
        // record the log takes, or a body within max_body_bytes could get 413. (Neither
        // this nor the room below is said of a body limit already refused.)
        let envelope_max_bytes = spec.envelope_max_bytes() as u128;
        let record_bytes = max_body_bytes as u128 + envelope_max_bytes;
        if !body_limit_refused && record_bytes > u128::from(record_max_bytes) {
            c.err(
                &http.key("max_body_bytes"),
                format!(
                    "with source {key:?}'s envelope (up to {envelope_max_bytes} bytes: its key, forwarded headers, metadata, and 255 bytes each for the content type, delivery id, stream, topic and partition key) an event of {max_body_bytes} bytes exceeds wal.record_max_bytes ({record_max_bytes})"
                ),
            );
        } else if !body_limit_refused
            && record_bytes + u128::from(wal::format::FRAME_HEADER_LEN) > u128::from(batch_max_bytes)
        {
            c.err(
                &http.key("max_body_bytes"),
                format!(
                    "an event of {max_body_bytes} bytes, with source {key:?}'s envelope (up to {envelope_max_bytes} bytes) and a {}-byte frame header, can never fit in the log: wal.max_bytes ({}) takes at most {batch_max_bytes} bytes in one append",
                    wal::format::FRAME_HEADER_LEN,
                    config.wal.max_bytes
                ),
            );
        }
        // Every event of a request is encoded with its own envelope before the one append
        // that holds them all, and the door takes room for the most its body can become
        // before it decodes it: as many events as lines (its newlines and one more, up to
        // max_events_per_request), each with the source's largest envelope and what
        // routing reads, beside the body. The largest request this source can be sent must
        // fit in the room all requests share, or it would run alone, past every bound on
        // what requests hold together. (Not said again of a limit already refused.)
        let fields = spec.fields_read();
        let per_event_bytes =
            spec.envelope_max_bytes() as u64 + http_source::json_fields::kept_bytes_max(&fields) as u64;
        let kept_leaves_bytes = if fields.is_empty() { 0 } else { max_body_bytes };
        let room_bytes = |events: u64| {
            ingest::ingestor::footprint_bound(max_body_bytes, events, per_event_bytes).saturating_add(kept_leaves_bytes)
        };
        let events_max = max_events_per_request.min(max_body_bytes.saturating_add(1));
        let room_max = ingest::ingestor::RUNNING_ON_MAX_BYTES;
        if !body_limit_refused
            && max_events_per_request <= MAX_EVENTS_PER_REQUEST_LIMIT
            && room_bytes(events_max) > room_max
        {
            // Both limits are bounded here, so nothing saturates and an event takes room.
            let one_bytes = (room_bytes(1) - room_bytes(0)).max(1);
            let fits = room_max.saturating_sub(room_bytes(0)) / one_bytes;
            c.err(
                &http.key("max_events_per_request"),
                format!(
                    "a request to source {key:?} of {events_max} events (an NDJSON body of max_body_bytes) takes room for {} bytes ({one_bytes} per event: the source's envelope, with its forwarded headers and metadata, and what routing reads; and the body), more than the {room_max} bytes all requests being accepted share; this source takes at most {fits}",
                    room_bytes(events_max)
                ),
            );
        }
        unreachable_by_default(&mut c, &sp, s, &spec, &delivery);
        sources.push(spec);
    }

    if !c.errors.is_empty() {
        return Err(ConfigErrors { file, errors: c.errors });
    }
    Ok(Settings {
        http_listen,
        admin_listen,
        max_body_bytes: max_body_bytes as usize,
        max_events_per_request: max_events_per_request as usize,
        header_read_timeout: Duration::from_millis(header_read_timeout_ms),
        body_read_timeout: Duration::from_millis(body_read_timeout_ms),
        write_timeout: Duration::from_millis(write_timeout_ms),
        max_connections: max_connections as usize,
        retry_after_secs,
        http_tls,
        admin_tls,
        admin_token: admin_token.map(SecretString::from),
        management_token: management_token.map(SecretString::from),
        grace_period: Duration::from_millis(config.shutdown.grace_period_ms),
        drain_delay: Duration::from_millis(config.shutdown.drain_delay_ms),
        worker_threads,
        log_level,
        log_json,
        data_dir: PathBuf::from(&config.storage.data_dir),
        wal: wal_options,
        idempotency_retention: Duration::from_secs(retention_secs),
        idempotency_max_keys: max_keys,
        checkpoint_interval: Duration::from_millis(checkpoint_ms),
        sources,
        endpoints,
        delivery,
        warnings: ConfigErrors { file, errors: c.warnings },
    })
}

/// Warnings for a source whose settings pass every check but name more than the daemon's
/// own defaults can deliver: a fixed partition id that a topic the daemon creates lacks
/// (its records held, or handled as `on_admission_failure` says, as
/// `partition_id_out_of_range`), and more destinations known from the file than the
/// source's `max_destinations` (those the cap does not admit held likewise, as `cap`).
/// Warnings, not errors: the topic may exist with more partitions, and the cap counts the
/// destinations a source's records name, which need not be all the file allows.
fn unreachable_by_default(
    c: &mut Checker<'_>,
    sp: &KeyPath,
    s: &SourceConfig,
    spec: &SourceSpec,
    delivery: &crate::delivery::DeliverySettings,
) {
    let partitions_count = delivery.sink.topic_defaults.partitions_count;
    if let PartitionRule::Fixed(Partitioning::PartitionId(id)) = spec.partitioning
        && id >= partitions_count
    {
        let at = match &s.destination {
            Some(d) if d.partition_id.is_some() => sp.key("destination").key("partition_id"),
            _ => sp.key("partitioning").key("partition_id"),
        };
        c.warn(
            &at,
            format!(
                "partition {id} is not in a topic the daemon creates (router.topic_defaults.partitions_count = \
                 {partitions_count}: ids 0 to {}); unless the topic exists with more partitions, its events are \
                 refused as partition_id_out_of_range and held, dropped or dead-lettered as on_admission_failure says",
                partitions_count.saturating_sub(1)
            ),
        );
    }
    let policy = delivery.policies.for_source(&spec.key);
    let max_destinations = policy.max_destinations;
    if spec.senders_choose_destinations() && policy.on_admission_failure == router::OnAdmissionFailure::Error {
        c.warn(
            &sp.key("route"),
            format!(
                "takes destination names from the events and the source's admission does not limit them to names \
                 listed here (an allowlist of exact names): a sender can name more destinations than max_destinations \
                 ({max_destinations}), and with on_admission_failure = \"error\" the records of those past the cap are \
                 held, keeping the log from being freed for every source until the cap is raised and the daemon \
                 restarted; list the destinations in an allowlist, or choose on_admission_failure = \"drop\" or \
                 \"dead_letter\" for this source"
            ),
        );
    }
    let topics_max = router::iggy_sink::TOPICS_PER_STREAM_MAX;
    if spec.senders_choose_topics() && max_destinations > topics_max {
        c.warn(
            &sp.key("route"),
            format!(
                "takes destination names from the events, and max_destinations ({max_destinations}) lets them name \
                 more than the {topics_max} topics Iggy holds in one stream: the records of a topic the server refuses \
                 to create are held, as for any destination it cannot create, until it is given up in \
                 [router.give_up]; keep max_destinations at {topics_max} or below, or list the topics in an allowlist or \
                 a mapping"
            ),
        );
    }
    let named = spec.destinations_named_in_file().len();
    if named > max_destinations {
        // Said where the destinations past the start's are listed: a mapping's targets,
        // or else the allowlist's entries.
        let (at, what) = if named > spec.destinations_known_at_start().len() {
            (
                sp.key("route").key("mapping"),
                "its mapping's targets, with its default and allowlist entries where counted",
            )
        } else {
            (sp.key("admission").key("allowlist"), "with the source's default")
        };
        c.warn(
            &at,
            format!(
                "names {named} destinations ({what}), more than its max_destinations ({max_destinations}): events \
                 to those the cap does not admit are refused as cap and held, dropped or dead-lettered as \
                 on_admission_failure says"
            ),
        );
    }
}

/// `admin.token` / `admin.token_env`: the bearer token of the admin routes.
fn admin_token(
    c: &mut Checker<'_>,
    admin: &KeyPath,
    a: &AdminConfig,
    management_token: Option<&str>,
) -> Option<String> {
    let (path, token) = match (&a.token, &a.token_env) {
        (Some(_), Some(_)) => {
            c.err(&admin.key("token_env"), "set either token or token_env, not both");
            return None;
        }
        (Some(t), None) => (admin.key("token"), t.expose().to_string()),
        (None, Some(var)) => match std::env::var(var) {
            Ok(t) => (admin.key("token_env"), t),
            Err(_) => {
                c.err(&admin.key("token_env"), format!("environment variable {var} is not set (or not UTF-8)"));
                return None;
            }
        },
        (None, None) => return None,
    };
    let from = match &a.token_env {
        Some(var) => format!("the value of environment variable {var}"),
        None => "the token".into(),
    };
    if !usable_token(c, &path, &from, &token) {
        return None;
    }
    if management_token == Some(token.as_str()) {
        c.err(&path, "must differ from admin.management_token (a reader could then manage endpoints)");
        return None;
    }
    Some(token)
}

/// The rules of both admin tokens (`admin.token`, `admin.management_token`), named at
/// `path`; `from` says where the value came from ("the token", "the value of
/// environment variable V"). A client must be able to send the token in an
/// `Authorization` header as it is: only visible ASCII (the admin API does not read a
/// header value with other bytes as text, so such a token could never match).
fn usable_token(c: &mut Checker<'_>, path: &KeyPath, from: &str, token: &str) -> bool {
    if token.len() < 16 {
        c.err(path, format!("{from} must be at least 16 characters"));
        return false;
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        c.err(path, format!("{from} may only hold visible ASCII characters (no spaces)"));
        return false;
    }
    true
}

/// Source keys the metrics use for what belongs to no source: `-` for requests whose
/// path names no source (an unknown path or endpoint id), `unknown` for records the
/// router cannot decode. A source keyed so would share their series.
const RESERVED_SOURCE_KEYS: [&str; 2] = ["-", "unknown"];

/// The most sources one daemon may have: each source key is a label value of every
/// per-source metric, so sources bound the exporter's series. Many senders of one kind
/// are one source with an endpoint each (any number, `DYNAMIC_ENDPOINTS_MAX`).
const SOURCES_MAX: usize = 1024;

/// The most entries an admission allowlist or denylist may hold: every event is checked
/// against them in turn.
const ADMISSION_RULES_MAX: usize = 1024;

/// Why a header name may not be forwarded, if it is one the daemon itself sets on every
/// message it sends (delivery.md, "Messages"): a message holds one value per header name,
/// the forwarded headers come after the daemon's, and the last value is the one Iggy
/// keeps, so a sender could otherwise forge the source key, the peer address or the
/// receive time downstream.
fn set_by_the_daemon(name: &str) -> Option<&'static str> {
    let n = name.to_ascii_lowercase();
    if n.starts_with("iggy-ingest-") {
        Some("is in the daemon's own header namespace (iggy-ingest-*)")
    } else if n == "content-type" {
        Some("is already carried: every message has the request's content-type")
    } else if n == http_source::source::METADATA_PEER_ADDR || n == http_source::source::METADATA_RECEIVED_AT {
        Some("names a metadata field the daemon sets (`metadata`)")
    } else {
        None
    }
}

/// A source's destination, route, partitioning and admission (see docs/routing.md for
/// which combinations are allowed and why).
fn where_events_go(c: &mut Checker<'_>, sp: &KeyPath, s: &SourceConfig) -> (Destinations, PartitionRule, Admission) {
    let dp = sp.key("destination");
    if let Some(d) = &s.destination {
        // The grammar of routed names, the mapping's and `[router.give_up]`'s: a
        // destination that can never be delivered can always be given up by name.
        for (name, v) in [("stream", &d.stream), ("topic", &d.topic)] {
            check_name(c, &dp.key(name), v);
        }
    }
    let fixed_partitioning = match &s.destination {
        None => None,
        Some(d) => match (d.partition_id, &d.partition_key) {
            (Some(_), Some(_)) => {
                c.err(&dp.key("partition_key"), "set either partition_id or partition_key, not both");
                None
            }
            (Some(id), None) => Some(Partitioning::PartitionId(id)),
            (None, Some(k)) if k.is_empty() || k.len() > 255 => {
                c.err(&dp.key("partition_key"), "must be 1 to 255 bytes");
                None
            }
            (None, Some(k)) => Some(Partitioning::Key(k.as_bytes().to_vec())),
            (None, None) => None,
        },
    };

    let destinations = match (&s.destination, &s.route) {
        (None, None) => {
            c.err(&dp, "required: a source needs a fixed destination or a route");
            Destinations::Fixed { stream: String::new(), topic: String::new() }
        }
        (Some(d), None) => Destinations::Fixed { stream: d.stream.clone(), topic: d.topic.clone() },
        (d, Some(r)) => Destinations::Routed(route(c, &sp.key("route"), r, d.as_ref(), &dp)),
    };

    let pp = sp.key("partitioning");
    let partitioning = match (&s.partitioning, fixed_partitioning) {
        (None, fixed) => PartitionRule::Fixed(fixed.unwrap_or(Partitioning::Balanced)),
        (Some(_), Some(_)) => {
            c.err(&pp, "contradicts destination.partition_id/partition_key: set the partitioning in one place");
            PartitionRule::default()
        }
        (Some(p), None) => partition_rule(c, &pp, p),
    };

    let admission = match &s.admission {
        None => Admission::Open,
        Some(a) => admission(c, &sp.key("admission"), a),
    };
    // A destination every event (or every unmatched event) goes to, refused by the
    // source's own admission, would turn each such request into a 422: refused here.
    let default = match &destinations {
        Destinations::Fixed { stream, topic } => Some((stream, topic)),
        Destinations::Routed(r) if r.on_missing == OnMissing::Default => Some((&r.default_stream, &r.default_topic)),
        Destinations::Routed(_) => None,
    };
    if let Some((stream, topic)) = default
        && !stream.is_empty()
        && !topic.is_empty()
        && admission.check(stream, topic).is_err()
    {
        c.err(
            &sp.key("admission"),
            format!("refuses the source's own default destination {stream}/{topic}: every event sent there would be answered 422"),
        );
    }
    // So would a mapping entry whose destination is known here (its own stream, or the
    // default one when no field routes the stream) and refused by the same admission.
    if let Destinations::Routed(r) = &destinations {
        for e in r.entries_refused_by(&admission) {
            c.err(
                &sp.key("route").key("mapping").key(&e.value),
                format!(
                    "{}/{} is refused by the source's admission: every event routed here would be answered 422",
                    e.stream, e.topic
                ),
            );
        }
    }
    (destinations, partitioning, admission)
}

/// A name of the narrow grammar, or an error at `path`.
fn check_name(c: &mut Checker<'_>, path: &KeyPath, name: &str) {
    if !is_name(name) {
        c.err(path, not_a_name(name));
    }
}

/// The problem with a stream or topic name outside the grammar of routed names.
pub(crate) fn not_a_name(name: &str) -> String {
    format!("{name:?} is not a name of the grammar [a-zA-Z0-9._-] (1 to 255 bytes)")
}

fn field_path(c: &mut Checker<'_>, path: &KeyPath, text: &str) -> FieldPath {
    FieldPath::parse(text).unwrap_or_else(|message| {
        c.err(path, message);
        FieldPath::parse("invalid").unwrap_or_else(|_| unreachable!("a one-key path parses"))
    })
}

/// The route transform. With a fixed `destination` too, the destination is the
/// route's default: defaults given in both places must agree.
fn route(
    c: &mut Checker<'_>,
    rp: &KeyPath,
    r: &RouteConfig,
    destination: Option<&DestinationConfig>,
    dp: &KeyPath,
) -> Route {
    let topic_field = field_path(c, &rp.key("topic_field"), &r.topic_field);
    let stream_field = r.stream_field.as_deref().map(|f| field_path(c, &rp.key("stream_field"), f));
    // `name` is the destination's key ("stream", "topic"); the route's is `default_<name>`.
    let mut default = |name: &'static str, own: Option<&String>, fixed: Option<&String>| -> String {
        let key = format!("default_{name}");
        match (own, fixed) {
            (Some(o), Some(f)) if o != f => {
                c.err(
                    &rp.key(&key),
                    format!("{o:?} contradicts {dp}.{name}: {f:?} (with both, the destination is the route's default)"),
                );
                o.clone()
            }
            (Some(o), _) => {
                check_name(c, &rp.key(&key), o);
                o.clone()
            }
            // Checked with the fixed destination (`where_events_go`), once.
            (None, Some(f)) => f.clone(),
            (None, None) => {
                c.err(
                    &rp.key(&key),
                    "required: events whose routed field is missing or unmapped need a default (or set a fixed destination)",
                );
                String::new()
            }
        }
    };
    let default_stream = default("stream", r.default_stream.as_ref(), destination.map(|d| &d.stream));
    let default_topic = default("topic", r.default_topic.as_ref(), destination.map(|d| &d.topic));
    let mapping = match (&r.mapping, &r.mapping_url) {
        (Some(_), Some(_)) => {
            c.err(&rp.key("mapping_url"), "set either mapping or mapping_url, not both");
            MappingSource::Identity
        }
        (Some(m), None) => {
            let mp = rp.key("mapping");
            let mut entries = Vec::with_capacity(m.len());
            for (value, target) in m {
                let (stream, topic) = match target {
                    MappingTargetConfig::Topic(t) => (None, t.clone()),
                    MappingTargetConfig::Full(f) => (f.stream.clone(), f.topic.clone()),
                };
                entries.push((value.clone(), Target { stream, topic }));
            }
            // Every entry's problem is named, not only the first one's.
            let problems: Vec<(String, String)> =
                entries.iter().filter_map(|(v, t)| t.check().err().map(|m| (v.clone(), m))).collect();
            if !problems.is_empty() {
                for (value, message) in problems {
                    c.err(&mp.key(&value), message);
                }
                MappingSource::Identity
            } else {
                match Mapping::new(entries) {
                    Ok(m) => MappingSource::Table(m),
                    Err(MappingError::Entry { value, message }) => {
                        c.err(&mp.key(&value), message);
                        MappingSource::Identity
                    }
                    Err(e) => {
                        c.err(&mp, format!("{e}; to use the field's value as the topic name, leave mapping out"));
                        MappingSource::Identity
                    }
                }
            }
        }
        (None, Some(url)) => match crate::mapping_fetch::check_url(url) {
            Ok(()) => MappingSource::Url(url.clone()),
            Err(message) => {
                c.err(&rp.key("mapping_url"), message);
                MappingSource::Identity
            }
        },
        (None, None) => MappingSource::Identity,
    };
    let on_missing = match r.on_missing_destination.as_str() {
        "default" => OnMissing::Default,
        "drop" => OnMissing::Drop,
        "error" => OnMissing::Error,
        other => {
            c.err(&rp.key("on_missing_destination"), format!("{other:?}: expected \"default\", \"drop\" or \"error\""));
            OnMissing::Default
        }
    };
    Route { topic_field, stream_field, mapping, default_stream, default_topic, on_missing }
}

fn partition_rule(c: &mut Checker<'_>, pp: &KeyPath, p: &PartitioningConfig) -> PartitionRule {
    let encoding = match p.key_encoding.as_deref() {
        None | Some("bytes") => KeyEncoding::Bytes,
        Some("key_u32") => KeyEncoding::U32,
        Some(other) => {
            c.err(&pp.key("key_encoding"), format!("{other:?}: expected \"bytes\" or \"key_u32\""));
            KeyEncoding::Bytes
        }
    };
    match (&p.key_header, &p.key_field, p.partition_id) {
        (Some(h), None, None) => {
            let h = h.to_ascii_lowercase();
            if axum::http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                c.err(&pp.key("key_header"), format!("{h:?} is not a valid header name"));
            } else if is_credential_header(&h) {
                // The key is stored in every record's envelope, as a forwarded header is.
                c.err(
                    &pp.key("key_header"),
                    format!("{h:?} carries credentials and may not become the partition key stored in the log"),
                );
            }
            PartitionRule::Key { source: KeySource::Header(h), encoding }
        }
        (None, Some(f), None) => {
            PartitionRule::Key { source: KeySource::Field(field_path(c, &pp.key("key_field"), f)), encoding }
        }
        (None, None, Some(id)) => {
            if p.key_encoding.is_some() {
                c.err(&pp.key("key_encoding"), "only applies to key_header or key_field");
            }
            PartitionRule::Fixed(Partitioning::PartitionId(id))
        }
        (None, None, None) => {
            c.err(pp, "set one of key_header, key_field or partition_id (leave the table out for balanced)");
            PartitionRule::default()
        }
        _ => {
            c.err(pp, "set only one of key_header, key_field or partition_id");
            PartitionRule::default()
        }
    }
}

fn admission(c: &mut Checker<'_>, ap: &KeyPath, a: &AdmissionConfig) -> Admission {
    let rules = |c: &mut Checker<'_>, list: &'static str, entries: &[RuleConfig]| -> Vec<Rule> {
        let lp = ap.key(list);
        if entries.len() > ADMISSION_RULES_MAX {
            c.err(
                &lp,
                format!(
                    "{} entries; at most {ADMISSION_RULES_MAX} (every event is checked against them in turn)",
                    entries.len()
                ),
            );
        }
        let mut out = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let ep = lp.index(i);
            match Rule::parse(&e.stream, &e.topic) {
                Ok(r) => out.push(r),
                Err(RuleError { key: "", message }) => c.err(&ep, message),
                Err(RuleError { key, message }) => c.err(&ep.key(key), message),
            }
        }
        out
    };
    let allowlist = rules(c, "allowlist", &a.allowlist);
    let denylist = rules(c, "denylist", &a.denylist);
    let unused = |c: &mut Checker<'_>, list: &'static str, entries: &[RuleConfig], mode: &str| {
        if !entries.is_empty() {
            c.err(&ap.key(list), format!("only read when mode = \"{list}\" (mode is \"{mode}\")"));
        }
    };
    match a.mode.as_str() {
        "open" => {
            unused(c, "allowlist", &a.allowlist, "open");
            unused(c, "denylist", &a.denylist, "open");
            Admission::Open
        }
        "allowlist" => {
            unused(c, "denylist", &a.denylist, "allowlist");
            if a.allowlist.is_empty() {
                c.err(&ap.key("allowlist"), "required and non-empty when mode = \"allowlist\"");
            }
            Admission::Allowlist(allowlist)
        }
        "denylist" => {
            unused(c, "allowlist", &a.allowlist, "denylist");
            if a.denylist.is_empty() {
                c.err(&ap.key("denylist"), "required and non-empty when mode = \"denylist\"");
            }
            Admission::Denylist(denylist)
        }
        other => {
            c.err(&ap.key("mode"), format!("{other:?}: expected \"open\", \"allowlist\" or \"denylist\""));
            Admission::Open
        }
    }
}

/// Refuses a signature tolerance (at `at`, the source or endpoint; `set` whether the file
/// sets `auth_tolerance_secs` there, or the default applies) longer than half the
/// delivery ids' retention: a captured request can be sent again until its timestamp is
/// `tolerance` in the past, having been first accepted when it was up to `tolerance` in
/// the future, and must then still find its delivery id, or it is appended again.
fn tolerance_within_retention(c: &mut Checker<'_>, at: &KeyPath, auth: &AuthScheme, set: bool, retention_secs: u64) {
    let Some(tolerance) = auth.tolerance_secs() else { return };
    if tolerance.saturating_mul(2) <= retention_secs {
        return;
    }
    if set {
        c.err(
            &at.key("auth_tolerance_secs"),
            format!(
                "{tolerance} is more than half of idempotency.retention_secs ({retention_secs}): a request replayed late in its tolerance would no longer find its delivery id and be appended again"
            ),
        );
    } else {
        c.err(
            &KeyPath::default().key("idempotency").key("retention_secs"),
            format!(
                "{retention_secs} is less than twice the signature tolerance of {at} ({tolerance} s, the default): a request replayed late in its tolerance would no longer find its delivery id and be appended again"
            ),
        );
    }
}

/// Refuses a `forward_headers` entry naming `signature`, the header an hmac scheme of
/// `whose` reads its signature from: a signature without a timestamp, copied into the
/// log, would let any consumer post the stored event again as a new delivery.
fn forwarded_signature(c: &mut Checker<'_>, source: &KeyPath, s: &SourceConfig, signature: &str, whose: &str) {
    let why = |h: &str| format!("{h:?} carries the signature of {whose} (its auth_header)");
    for (i, h) in s.forward_headers.iter().enumerate() {
        if h.eq_ignore_ascii_case(signature) {
            c.err(&source.key("forward_headers").index(i), format!("{} and may not be forwarded into the log", why(h)));
        }
    }
    // A partition key and a delivery id are stored in every record as well.
    if let Some(h) = s.partitioning.as_ref().and_then(|p| p.key_header.as_deref())
        && h.eq_ignore_ascii_case(signature)
    {
        c.err(
            &source.key("partitioning").key("key_header"),
            format!("{} and may not become the partition key", why(h)),
        );
    }
    if let Some(h) = s.idempotency_header.as_deref()
        && h.eq_ignore_ascii_case(signature)
    {
        c.err(&source.key("idempotency_header"), format!("{} and may not become the delivery id", why(h)));
    }
}

fn auth_scheme(c: &mut Checker<'_>, path: &KeyPath, a: AuthConfig<'_>) -> AuthScheme {
    let from_env;
    let secret = match (a.auth_secret, a.auth_secret_env) {
        (Some(_), Some(_)) => {
            c.err(&path.key("auth_secret_env"), "set either auth_secret or auth_secret_env, not both");
            return AuthScheme::None;
        }
        (None, Some(var)) => match std::env::var(var) {
            Ok(v) if !v.is_empty() => {
                from_env = v;
                Some(from_env.as_str())
            }
            _ => {
                c.err(
                    &path.key("auth_secret_env"),
                    format!("environment variable {var} is not set (or empty, or not UTF-8)"),
                );
                return AuthScheme::None;
            }
        },
        (secret, None) => secret,
    };
    // Every setting the scheme does not read is named at once; and once there is none,
    // every problem of those it reads (the scheme's own, the tolerance's bounds, the
    // secret's characters: none of these checks looks at what another refuses).
    let mut problems =
        AuthScheme::unused_settings(a.auth_type, secret, a.auth_header, a.auth_prefix, a.auth_tolerance_secs);
    if problems.is_empty() {
        let scheme = AuthScheme::from_parts(a.auth_type, secret, a.auth_header, a.auth_prefix, a.auth_tolerance_secs);
        let tolerance = http_source::auth::check_new_tolerance(a.auth_tolerance_secs);
        let secret_ok = http_source::auth::check_new_secret(a.auth_type, secret);
        let too_long = http_source::auth::check_new_lengths(a.auth_header, a.auth_prefix);
        match (scheme, tolerance, secret_ok) {
            (Ok(s), Ok(()), Ok(())) if too_long.is_empty() => return s,
            (scheme, tolerance, secret_ok) => {
                problems.extend([scheme.err(), tolerance.err(), secret_ok.err()].into_iter().flatten());
                problems.extend(too_long);
            }
        }
    }
    for (field, message) in problems {
        match (field, a.auth_secret_env) {
            // A secret read from the environment is named by the key that names it.
            ("secret", Some(var)) => c.err(&path.key("auth_secret_env"), format!("the value of {var}: {message}")),
            _ => c.err(&path.key(&format!("auth_{field}")), message),
        }
    }
    AuthScheme::None
}

/// Reads, parses and validates a configuration file.
pub fn load(path: &std::path::Path) -> Result<Settings, ConfigErrors> {
    let text = read(path)?;
    let config = parse(&text, Some(path.to_path_buf()))?;
    validate(&config, Some(&text), Some(path.to_path_buf()))
}

/// `wal.max_bytes` of a configuration file, for the log tools, which need nothing else
/// of it: the file must read and parse (syntax, types, unknown keys), and the capacity
/// pass the daemon's own checks; nothing else is looked at (no environment variables,
/// addresses or sources), so a file the daemon runs on elsewhere serves as it is.
pub fn load_wal_max_bytes(path: &std::path::Path) -> Result<u64, ConfigErrors> {
    let text = read(path)?;
    let config = parse(&text, Some(path.to_path_buf()))?;
    // The file's log section on the built-in default, which validates: the same rules
    // as the daemon's, without the rest of the file.
    let wal_only = Config { wal: config.wal.clone(), ..Config::builtin() };
    match validate(&wal_only, Some(&text), Some(path.to_path_buf())) {
        Ok(settings) => Ok(settings.wal.max_bytes),
        Err(mut e) => {
            e.errors.retain(|e| e.path == "wal.max_bytes");
            if e.errors.is_empty() { Ok(config.wal.max_bytes) } else { Err(e) }
        }
    }
}

/// The most a configuration file may hold: far more than any configuration, static
/// endpoints by the thousand included; a larger file is not one.
pub const CONFIG_FILE_MAX_BYTES: u64 = 64 << 20;

fn read(path: &std::path::Path) -> Result<String, ConfigErrors> {
    crate::regular_file::read_text(path, CONFIG_FILE_MAX_BYTES).map_err(|e| ConfigErrors {
        file: Some(path.to_path_buf()),
        errors: vec![ConfigError { path: String::new(), line: None, message: format!("cannot read: {e}") }],
    })
}

/// The roots a TLS client trusts from the CA file at `path`, read as the Iggy client
/// reads `iggy.tls_ca_file` when it connects (each PEM certificate in it added to an
/// empty set of roots), or what is wrong with it. A file without a certificate passes
/// that read, and every connection would then fail to verify the server: it is a
/// problem too. `wal inspect --admin-ca` reads its file here as well.
pub fn ca_roots(path: &std::path::Path) -> Result<rustls::RootCertStore, String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let shown = path.display().to_string();
    let bytes = crate::regular_file::read(path, http_source::tls::TLS_FILE_MAX_BYTES)
        .map_err(|e| format!("{shown:?} cannot be read: {e}"))?;
    let mut roots = rustls::RootCertStore::empty();
    for (i, cert) in CertificateDer::pem_slice_iter(&bytes).enumerate() {
        let n = i + 1;
        let cert = cert.map_err(|e| format!("{shown:?}: certificate {n} is not valid PEM: {e}"))?;
        roots.add(cert).map_err(|e| format!("{shown:?}: certificate {n} is not a usable CA certificate: {e}"))?;
    }
    if roots.is_empty() {
        return Err(format!(
            "{shown:?} holds no PEM certificate (-----BEGIN CERTIFICATE-----): no server could be verified against it"
        ));
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEFAULT_TOML: &str = include_str!("../../../config/default.toml");
    const EXAMPLE_TOML: &str = include_str!("../../../config/example.toml");

    #[test]
    fn config_default_toml_is_exactly_the_builtin_default() {
        let parsed = parse(DEFAULT_TOML, None).unwrap();
        assert_eq!(parsed, Config::builtin());
    }

    /// The default spells out every setting the example sets (a key the default left
    /// out would still parse to the built-in value, so the comparison above cannot see
    /// it), but for what only a source has.
    #[test]
    fn config_default_toml_spells_out_every_setting_the_example_sets() {
        fn keys(table: &toml::Table, prefix: &str, out: &mut Vec<String>) {
            for (k, v) in table {
                let path = format!("{prefix}{k}");
                match v {
                    toml::Value::Table(t) => keys(t, &format!("{path}."), out),
                    _ => out.push(path),
                }
            }
        }
        let (mut example, mut default) = (Vec::new(), Vec::new());
        keys(&EXAMPLE_TOML.parse::<toml::Table>().unwrap(), "", &mut example);
        keys(&DEFAULT_TOML.parse::<toml::Table>().unwrap(), "", &mut default);
        let missing: Vec<&String> = example
            .iter()
            .filter(|k| !k.starts_with("sources.") && !k.starts_with("router.sources."))
            .filter(|k| !default.contains(k))
            .collect();
        assert!(missing.is_empty(), "config/default.toml leaves out {missing:?}");
    }

    /// A file that cannot be read is named with the reason, not as a key path.
    #[test]
    fn a_file_that_cannot_be_read_is_named_not_a_key() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.toml");
        let e = load(&missing).unwrap_err().to_string();
        assert_eq!(e, format!("{}: cannot read: No such file or directory (os error 2)", missing.display()));
    }

    #[test]
    fn the_example_validates() {
        let config = parse(EXAMPLE_TOML, None).unwrap();
        let settings = validate(&config, Some(EXAMPLE_TOML), None).unwrap_or_else(|e| panic!("{e}"));
        assert!(settings.sources.len() >= 2);
        assert!(!settings.endpoints.is_empty());
        // Partition ids start at 0: a fixed one must exist in the topics the daemon
        // creates, or a copied example holds its events for good (a warning says so).
        assert!(
            settings
                .sources
                .iter()
                .any(|s| matches!(s.partitioning, PartitionRule::Fixed(Partitioning::PartitionId(_)))),
            "the example shows a fixed partition id"
        );
        assert_eq!(settings.warnings.errors, vec![], "the example warns");
        assert_eq!(
            validate(&Config::builtin(), None, None).unwrap().warnings.errors,
            vec![],
            "the built-in default warns"
        );
    }

    /// A route whose senders choose the destinations' names (a topic with no mapping, a
    /// stream from a field), under an admission that does not list them and with the
    /// records past the cap held, is warned of at the route: any sender could then keep
    /// the log from being freed for every source. Not where the names are bounded by the
    /// file, or where the cap's refusals are dropped or dead-lettered.
    #[test]
    fn a_route_whose_senders_can_name_destinations_past_the_cap_is_warned_of() {
        let route = |extra: &str| {
            format!(
                "[sources.a]\n\
                 route = {{ topic_field = \"type\", default_stream = \"s\", default_topic = \"d\"{extra} }}\n"
            )
        };
        let warned = |text: &str| -> Vec<String> {
            let settings = validate(&parse(text, None).unwrap(), Some(text), None).unwrap_or_else(|e| panic!("{e}"));
            settings.warnings.errors.iter().map(|w| format!("{}@{:?}", w.path, w.line)).collect()
        };
        let open = route("");
        assert_eq!(warned(&open), vec!["sources.a.route@Some(2)"]);
        let message = {
            let settings = validate(&parse(&open, None).unwrap(), Some(&open), None).unwrap();
            settings.warnings.errors[0].message.clone()
        };
        assert!(message.contains("max_destinations (1000)") && message.contains("allowlist"), "{message}");
        let stream_field =
            route(", stream_field = \"tenant\", mapping = { x = \"t\", y = { stream = \"s\", topic = \"u\" } }");
        assert_eq!(warned(&stream_field), vec!["sources.a.route@Some(2)"], "a stream named by the event");
        let denylist =
            format!("{open}admission = {{ mode = \"denylist\", denylist = [{{ stream = \"s\", topic = \"x\" }}] }}\n");
        assert_eq!(warned(&denylist), vec!["sources.a.route@Some(2)"]);
        let wildcard = format!(
            "{open}admission = {{ mode = \"allowlist\", allowlist = [{{ stream = \"s\", topic = \"*\" }}] }}\n"
        );
        assert_eq!(warned(&wildcard), vec!["sources.a.route@Some(2)"]);

        let listed = format!(
            "{open}admission = {{ mode = \"allowlist\", allowlist = [{{ stream = \"s\", topic = \"d\" }}, {{ stream = \"s\", topic = \"x\" }}] }}\n"
        );
        assert_eq!(warned(&listed), Vec::<String>::new(), "every name listed");
        let mapped = route(", mapping = { x = \"t\" }");
        assert_eq!(warned(&mapped), Vec::<String>::new(), "names from the mapping");
        let mapped_streams = route(", stream_field = \"tenant\", mapping = { x = { stream = \"s\", topic = \"u\" } }");
        assert_eq!(warned(&mapped_streams), Vec::<String>::new(), "every entry names its stream");
        for choice in ["drop", "dead_letter"] {
            let dead_letter =
                if choice == "dead_letter" { "dead_letter_stream = \"s\"\ndead_letter_topic = \"dl\"\n" } else { "" };
            let text = format!("{open}\n[router.sources.a]\non_admission_failure = \"{choice}\"\n{dead_letter}");
            assert_eq!(warned(&text), Vec::<String>::new(), "{choice}");
        }
        let everywhere = format!("{open}\n[router]\non_admission_failure = \"drop\"\n");
        assert_eq!(warned(&everywhere), Vec::<String>::new(), "dropped router-wide");
    }

    /// A route whose senders choose topic names, with a cap above the topics Iggy holds
    /// in one stream, is warned of: the topics past that are never created and their
    /// records held. Not at the limit, nor where the names are bounded by the file.
    #[test]
    fn a_route_whose_senders_can_name_more_topics_than_a_stream_holds_is_warned_of() {
        let text = |max: usize, extra: &str| {
            format!(
                "[sources.a]\n\
                 route = {{ topic_field = \"type\", default_stream = \"s\", default_topic = \"d\"{extra} }}\n\
                 [router]\non_admission_failure = \"drop\"\nmax_destinations = {max}\n"
            )
        };
        let warned = |text: &str| -> Vec<String> {
            let settings = validate(&parse(text, None).unwrap(), Some(text), None).unwrap_or_else(|e| panic!("{e}"));
            settings.warnings.errors.iter().map(|w| format!("{}: {}", w.path, w.message)).collect()
        };
        let past = warned(&text(4097, ""));
        assert_eq!(past.len(), 1, "{past:?}");
        assert!(past[0].starts_with("sources.a.route: ") && past[0].contains("4096 topics"), "{past:?}");
        assert_eq!(warned(&text(4096, "")), Vec::<String>::new(), "at the limit");
        assert_eq!(warned(&text(5000, ", mapping = { x = \"t\" }")), Vec::<String>::new(), "names from the mapping");
        let streams_only =
            text(5000, ", stream_field = \"tenant\", mapping = { x = { stream = \"s\", topic = \"u\" }, y = \"v\" }");
        assert_eq!(warned(&streams_only), Vec::<String>::new(), "senders choose streams, not topics");
        let listed = "[sources.a]\n\
                      route = { topic_field = \"type\", default_stream = \"s\", default_topic = \"d\" }\n\
                      admission = { mode = \"allowlist\", allowlist = [{ stream = \"*\", topic = \"d\" }, { stream = \"*\", topic = \"e\" }] }\n\
                      [router]\non_admission_failure = \"drop\"\nmax_destinations = 5000\n";
        assert_eq!(warned(listed), Vec::<String>::new(), "topics listed by name");
    }

    /// Valid settings the daemon's own defaults cannot deliver are warned of, by key path
    /// and line, and refuse nothing: a fixed partition id past the partitions of a topic
    /// the daemon creates (set in either place), and more destinations known from the
    /// file than the source's cap admits.
    #[test]
    fn settings_the_defaults_cannot_deliver_are_warned_of_not_refused() {
        let text = r#"
[sources.a]
destination = { stream = "s", topic = "t", partition_id = 2 }

[sources.b]
destination = { stream = "s", topic = "u" }
partitioning = { partition_id = 1 }

[sources.c]
destination = { stream = "s", topic = "v" }
admission = { mode = "allowlist", allowlist = [{ stream = "s", topic = "v" }, { stream = "s", topic = "w" }, { stream = "x", topic = "*" }] }

[sources.d]
destination = { stream = "s", topic = "v", partition_id = 1 }
admission = { mode = "allowlist", allowlist = [{ stream = "s", topic = "v" }, { stream = "s", topic = "w" }] }

[router.topic_defaults]
partitions_count = 2

[router.sources.c]
max_destinations = 1
"#;
        let settings = validate(&parse(text, None).unwrap(), Some(text), None).unwrap_or_else(|e| panic!("{e}"));
        let warned: Vec<(&str, Option<usize>)> =
            settings.warnings.errors.iter().map(|w| (w.path.as_str(), w.line)).collect();
        // a's id 2 of 2 partitions; b's 1 and d's 1 exist; d's two destinations are
        // within the default cap.
        assert_eq!(
            warned,
            vec![("sources.a.destination.partition_id", Some(3)), ("sources.c.admission.allowlist", Some(11))]
        );
        assert!(
            settings.warnings.errors[0].message.contains("partitions_count = 2: ids 0 to 1"),
            "{:?}",
            settings.warnings
        );
        assert!(settings.warnings.errors[1].message.contains("names 2 destinations"), "{:?}", settings.warnings);

        let one_partition = text.replace("partitions_count = 2", "partitions_count = 1");
        let settings = validate(&parse(&one_partition, None).unwrap(), Some(&one_partition), None).unwrap();
        let warned: Vec<&str> = settings.warnings.errors.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(
            warned,
            vec![
                "sources.a.destination.partition_id",
                "sources.b.partitioning.partition_id",
                "sources.c.admission.allowlist",
                "sources.d.destination.partition_id"
            ]
        );
    }

    /// A mapping table names its destinations in the file as an allowlist does: more of
    /// them (with the default) than the source's cap is warned of, at the mapping. Those
    /// the admission refuses, those that repeat and those whose stream an event names
    /// are not counted. Before, a mapping was never counted, and with the default
    /// `on_admission_failure = "error"` the third destination's records held the log.
    #[test]
    fn a_mapping_naming_more_destinations_than_the_cap_is_warned_of() {
        let config = |mapping: &str, extra: &str| {
            format!(
                "[sources.a]\nroute = {{ topic_field = \"type\", default_stream = \"s\", default_topic = \"d\", mapping = {{ {mapping} }}{extra} }}\n\n[router]\nmax_destinations = 2\n"
            )
        };
        let warnings = |text: &str| {
            let settings = validate(&parse(text, None).unwrap(), Some(text), None).unwrap_or_else(|e| panic!("{e}"));
            settings.warnings.errors.iter().map(|w| (w.path.clone(), w.line, w.message.clone())).collect::<Vec<_>>()
        };
        let text = config(r#"a = "t1", b = "t2", c = { stream = "o", topic = "t3" }"#, "");
        let w = warnings(&text);
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!((w[0].0.as_str(), w[0].1), ("sources.a.route.mapping", Some(2)));
        assert!(w[0].2.contains("names 4 destinations") && w[0].2.contains("(2)"), "{}", w[0].2);
        // Two entries to one destination, and one back to the default: two in all.
        assert!(warnings(&config(r#"a = "t1", b = "t1", c = "d""#, "")).is_empty());
        // Entries whose stream comes from the event are the senders' to name.
        let text = config(r#"a = "t1", b = "t2""#, r#", stream_field = "stream""#);
        assert!(warnings(&text).iter().all(|w| w.0 != "sources.a.route.mapping"), "{:?}", warnings(&text));
    }

    /// An `iggy.address` that is one of the daemon's own listeners (8080 for 8090) would
    /// have it send every event to itself and deliver none, its status saying only that
    /// Iggy fails: refused, naming both. Another host, or another port, is not.
    #[test]
    fn an_iggy_address_that_is_the_daemons_own_listener_is_refused() {
        let config = |listen: &str, address: &str| {
            format!(
                "[http]\nlisten = \"{listen}\"\n[iggy]\naddress = \"{address}\"\n[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n"
            )
        };
        for (listen, address) in [
            ("127.0.0.1:8080", "127.0.0.1:8080"),
            ("127.0.0.1:8080", "localhost:8080"),
            ("0.0.0.0:8080", "127.0.0.1:8080"),
            ("[::]:8080", "[::1]:8080"),
            ("[::]:8080", "127.0.0.1:8080"),
            ("[::1]:8080", "localhost:8080"),
            ("127.0.0.1:8080", "0.0.0.0:8080"),
        ] {
            let e = errors(&config(listen, address));
            assert_eq!(e.len(), 1, "{listen} {address}: {e:?}");
            assert_eq!((e[0].path.as_str(), e[0].line), ("iggy.address", Some(4)), "{listen} {address}");
            assert!(e[0].message.contains("http.listen"), "{}", e[0].message);
        }
        let text =
            "[iggy]\naddress = \"127.0.0.1:9180\"\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        assert!(errors(text)[0].message.contains("admin.listen"), "{:?}", errors(text));
        for (listen, address) in [
            ("127.0.0.1:8080", "127.0.0.1:8090"),
            ("127.0.0.1:8080", "10.0.0.2:8080"),
            ("10.0.0.1:8080", "127.0.0.1:8080"),
            ("127.0.0.1:8080", "iggy.internal:8080"),
            ("127.0.0.1:0", "127.0.0.1:8080"),
            ("0.0.0.0:8080", "[::1]:8080"),
        ] {
            let text = config(listen, address);
            assert!(validate(&parse(&text, None).unwrap(), Some(&text), None).is_ok(), "{listen} {address}");
        }
    }

    #[test]
    fn the_builtin_default_validates_to_the_documented_addresses() {
        let s = validate(&Config::builtin(), None, None).unwrap();
        assert_eq!(s.http_listen.to_string(), "127.0.0.1:8080");
        assert_eq!(s.admin_listen.to_string(), "127.0.0.1:9180");
        assert_eq!(s.data_dir, PathBuf::from("./data"));
        assert_eq!(s.sources[0].key, "default");
        assert_eq!(s.sources[0].destinations, Destinations::Fixed { stream: "ingest".into(), topic: "events".into() });
        assert_eq!(s.sources[0].partitioning, PartitionRule::Fixed(Partitioning::Balanced));
        assert_eq!(s.sources[0].admission, Admission::Open);
        assert_eq!(s.wal.sync, SyncPolicy::Always);
    }

    #[test]
    fn worker_threads_leave_a_core_unless_configured() {
        let auto = validate(&Config::builtin(), None, None).unwrap();
        assert_eq!(auto.worker_threads, 0);
        assert_eq!(auto.runtime_worker_threads(1), 1);
        assert_eq!(auto.runtime_worker_threads(2), 1);
        assert_eq!(auto.runtime_worker_threads(16), 15);
        let text = "[runtime]\nworker_threads = 3\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let set = validate(&parse(text, None).unwrap(), Some(text), None).unwrap();
        assert_eq!(set.runtime_worker_threads(2), 3);
        assert_eq!(set.runtime_worker_threads(64), 3);
    }

    /// A keyed request has five minutes from its head to its lookup; a body timeout
    /// near that would turn a slow sender's 408 into a 503 after its body was read.
    #[test]
    fn a_body_read_timeout_past_two_minutes_is_refused_naming_the_key() {
        let src = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let at_max = format!("[http]\nbody_read_timeout_ms = 120000\n{src}");
        assert!(validate(&parse(&at_max, None).unwrap(), Some(&at_max), None).is_ok());
        let e = errors(&format!("[http]\nbody_read_timeout_ms = 120001\n{src}"));
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].path.as_str(), e[0].line), ("http.body_read_timeout_ms", Some(2)));
        assert!(e[0].to_string().contains("must be at most 120000"), "{}", e[0]);
    }

    /// Settings that could never work, or would be ignored, are refused at load with
    /// their key path and line, as the management API refuses them for a registration.
    #[test]
    fn settings_that_could_never_work_or_would_be_ignored_are_refused_naming_the_key() {
        let src = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let endpoint =
            |extra: &str| format!("{src}[[sources.a.endpoints]]\nid = \"0123456789abcdef0123456789abcdef\"\n{extra}");
        let cases: Vec<(String, &str, usize, &str)> = vec![
            (
                format!("[http]\nheader_read_timeout_ms = 120001\n{src}"),
                "http.header_read_timeout_ms",
                2,
                "at most 120000",
            ),
            (format!("[http]\nwrite_timeout_ms = 3600000\n{src}"), "http.write_timeout_ms", 2, "at most 120000"),
            (format!("[iggy]\ntls_domain = \"iggy.internal\"\n{src}"), "iggy.tls_domain", 2, "iggy.tls = true"),
            (format!("[iggy]\ntls = true\ntls_domain = \"\"\n{src}"), "iggy.tls_domain", 3, "is not a DNS name"),
            (
                format!("[iggy]\ntls = true\naddress = \"[::1]:8090\"\ntls_domain = \"iggy internal\"\n{src}"),
                "iggy.tls_domain",
                4,
                "is not a DNS name",
            ),
            (
                format!("{src}idempotency = false\nidempotency_header = \"x-delivery\"\n"),
                "sources.a.idempotency_header",
                4,
                "idempotency = true",
            ),
            (
                endpoint("auth_type = \"stripe\"\nauth_secret = \"whsec_x\"\nauth_tolerance_secs = 0\n"),
                "sources.a.endpoints[0].auth_tolerance_secs",
                7,
                "at least 1",
            ),
            (
                endpoint("auth_type = \"bearer\"\nauth_secret = \"token-with-a-newline\\n\"\n"),
                "sources.a.endpoints[0].auth_secret",
                6,
                "visible ASCII",
            ),
            (
                endpoint("auth_type = \"hmac-sha256\"\nauth_secret = \"key-read-with-its-newline\\n\"\n"),
                "sources.a.endpoints[0].auth_secret",
                6,
                "control character",
            ),
            (
                endpoint("auth_type = \"stripe\"\nauth_secret = \"whsec_x\\r\\n\"\n"),
                "sources.a.endpoints[0].auth_secret",
                6,
                "control character",
            ),
            (
                endpoint("auth_type = \"none\"\nhandshake_param = \"a=b\"\n"),
                "sources.a.endpoints[0].handshake_param",
                6,
                "not a query parameter name",
            ),
        ];
        for (text, path, line, says) in cases {
            let e = errors(&text);
            assert_eq!(e.len(), 1, "{text}: {e:?}");
            assert_eq!((e[0].path.as_str(), e[0].line), (path, Some(line)), "{text}");
            assert!(e[0].to_string().contains(says), "{text}: {}", e[0]);
        }
        for fine in [
            format!("[http]\nheader_read_timeout_ms = 120000\nwrite_timeout_ms = 120000\n{src}"),
            format!("[iggy]\ntls = true\ntls_domain = \"iggy.internal\"\n{src}"),
            endpoint("auth_type = \"stripe\"\nauth_secret = \"whsec_x\"\nauth_tolerance_secs = 1\n"),
            endpoint("auth_type = \"hmac-sha256\"\nauth_secret = \"It's a Secret to Everybody\"\n"),
            endpoint("auth_type = \"none\"\nhandshake_param = \"crc_token\"\n"),
        ] {
            assert!(validate(&parse(&fine, None).unwrap(), Some(&fine), None).is_ok(), "{fine}");
        }
    }

    #[test]
    fn an_idempotency_window_past_ten_years_is_refused() {
        let text = "[idempotency]\nretention_secs = 18446744073709552\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let e = errors(text);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].path.as_str(), e[0].line), ("idempotency.retention_secs", Some(2)));
    }

    #[test]
    fn the_two_listeners_may_not_share_an_address() {
        let text = |http: &str, admin: &str| {
            format!(
                "[http]\nlisten = \"{http}\"\n[admin]\nlisten = \"{admin}\"\n[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n"
            )
        };
        for (http, admin) in [
            ("127.0.0.1:18080", "127.0.0.1:18080"),
            ("0.0.0.0:18080", "127.0.0.1:18080"),
            ("[::]:18080", "127.0.0.1:18080"),
            ("[::]:18080", "[::1]:18080"),
            ("[::1]:18080", "[::1]:18080"),
        ] {
            let e = errors(&text(http, admin));
            assert_eq!(e.len(), 1, "{http} {admin}: {e:?}");
            assert_eq!((e[0].path.as_str(), e[0].line), ("admin.listen", Some(4)));
            assert!(e[0].message.contains("webhook listener"), "{}", e[0].message);
        }
        // Apart on Linux: another address of the same family, or another family unless
        // one side is `::` (each pair binds side by side with `bindv6only = 0`).
        for (http, admin) in [
            ("127.0.0.1:0", "127.0.0.1:0"),
            ("127.0.0.1:18080", "127.0.0.2:18080"),
            ("0.0.0.0:18080", "[::1]:18080"),
            ("127.0.0.1:18080", "[::1]:18080"),
        ] {
            let t = text(http, admin);
            assert!(validate(&parse(&t, None).unwrap(), Some(&t), None).is_ok(), "{http} {admin}");
        }
    }

    #[test]
    fn an_idempotency_header_that_names_every_delivery_alike_is_refused() {
        for (header, needle) in [
            ("Authorization", "credentials"),
            ("x-hub-signature-256", "credentials"),
            ("User-Agent", "does not tell"),
            ("Date", "does not tell"),
        ] {
            let text = format!(
                "[sources.a]\nauth_type = \"bearer\"\nauth_secret = \"tok-0123456789abcdef\"\ndestination = {{ stream = \"s\", topic = \"t\" }}\nidempotency_header = \"{header}\"\n"
            );
            let e = errors(&text);
            assert_eq!(e.len(), 1, "{header}: {e:?}");
            assert_eq!((e[0].path.as_str(), e[0].line), ("sources.a.idempotency_header", Some(5)), "{header}");
            assert!(e[0].message.contains(needle), "{header}: {}", e[0].message);
        }
        let text =
            "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nidempotency_header = \"X-Delivery-Id\"\n";
        assert!(validate(&parse(text, None).unwrap(), Some(text), None).is_ok());
    }

    #[test]
    fn max_events_per_request_is_bounded_both_ways_and_named() {
        for (value, needle) in [("0", "greater than 0"), ("1000001", "1000000")] {
            let text = format!(
                "[http]\nmax_events_per_request = {value}\n[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n"
            );
            let e = errors(&text);
            assert_eq!(e.len(), 1, "{e:?}");
            assert_eq!((e[0].path.as_str(), e[0].line), ("http.max_events_per_request", Some(2)));
            assert!(e[0].message.contains(needle), "{}", e[0].message);
        }
        let text = "[http]\nmax_events_per_request = 5\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        assert_eq!(validate(&parse(text, None).unwrap(), Some(text), None).unwrap().max_events_per_request, 5);
    }

    /// Every event of a request carries its own envelope, encoded before the one append
    /// that holds them all: a source whose largest request's envelopes (many tiny NDJSON
    /// events, each with every forwarded header) exceed the room all requests share is
    /// refused at the limit that allows it, naming the source and what it takes. Before,
    /// such a request (a million events with 64 forwarded headers: about 34 GB) was
    /// accepted by the configuration and ran alone, past every bound on memory.
    #[test]
    fn max_events_per_request_is_refused_where_one_requests_envelopes_exceed_the_shared_room() {
        let headers: Vec<String> = (0..64).map(|i| format!("\"x-f-{i:02}\"")).collect();
        let config = |max_events: u64, max_body: u64| {
            format!(
                "[http]\nmax_events_per_request = {max_events}\nmax_body_bytes = {max_body}\n[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\nforward_headers = [{}]\n",
                headers.join(", ")
            )
        };
        let text = config(1_000_000, 1024 * 1024);
        let e = errors(&text);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].path.as_str(), e[0].line), ("http.max_events_per_request", Some(2)));
        assert!(e[0].message.contains("source \"a\"") && e[0].message.contains("takes at most"), "{}", e[0].message);
        let at_most: u64 = e[0].message.rsplit(' ').next().unwrap().parse().unwrap();
        assert!((1_000..100_000).contains(&at_most), "{at_most}");
        // The most lines a body can hold is its length and one: a body that short fits.
        for ok in [config(at_most, 1024 * 1024), config(1_000_000, at_most - 1)] {
            assert!(validate(&parse(&ok, None).unwrap(), Some(&ok), None).is_ok(), "{ok}");
        }
        assert!(!errors(&config(at_most + 1, 1024 * 1024)).is_empty());
        // A source with no forwarded header does not fit at the limit's top either.
        let text = "[http]\nmax_events_per_request = 1000000\nmax_body_bytes = 1000000\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        assert!(!errors(text).is_empty(), "half a million bare events hold more than the room");
        let text =
            "[http]\nmax_events_per_request = 50000\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        assert!(validate(&parse(text, None).unwrap(), Some(text), None).is_ok());
    }

    #[test]
    fn too_many_worker_threads_name_the_key_and_line() {
        let text = "[runtime]\nworker_threads = 20000\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let e = errors(text);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].path, "runtime.worker_threads");
        assert_eq!(e[0].line, Some(2));
        assert!(e[0].message.contains("1024"), "{}", e[0].message);
    }

    /// A level the logging crate's parser panics on or refuses as written is checked as
    /// the daemon will use it, and a level that silences every target but the ones it
    /// names (a misspelt level is one) is warned of.
    #[test]
    fn a_logging_level_is_checked_as_the_daemon_uses_it() {
        let src = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let settings = |level: &str| {
            let text = format!("[logging]\nlevel = {level:?}\n{src}");
            validate(&parse(&text, None).unwrap(), Some(&text), None)
        };
        for fine in ["info, iggy_ingest=debug", "info, é=debug", "warn"] {
            let s = settings(fine).unwrap_or_else(|e| panic!("{fine:?}: {e:?}"));
            assert_eq!(s.warnings.errors, vec![], "{fine:?}");
        }
        for silent in ["inof", "iggy_ingest=debug"] {
            let w = settings(silent).unwrap().warnings.errors;
            assert_eq!((w.len(), w[0].path.as_str(), w[0].line), (1, "logging.level", Some(2)), "{silent:?}");
            assert!(w[0].message.contains("sets no level for every target"), "{}", w[0].message);
        }
        for refused in ["info,=x=", "", " , "] {
            let e = settings(refused).unwrap_err().errors;
            assert_eq!((e.len(), e[0].path.as_str(), e[0].line), (1, "logging.level", Some(2)), "{refused:?}: {e:?}");
        }
    }

    fn errors(text: &str) -> Vec<ConfigError> {
        match parse(text, None).and_then(|c| validate(&c, Some(text), None)) {
            Ok(_) => panic!("expected errors"),
            Err(e) => e.errors,
        }
    }

    /// A document that does not parse has no key path from the parser: the error names
    /// the one its line shows (the table above it and the key on it), never a table the
    /// problem is not in, and never a value.
    #[test]
    fn an_error_quoting_the_files_text_escapes_what_would_act_on_a_terminal() {
        // A quoted key may hold any character; serde's "unknown field" repeats it.
        let text = "[http]\n\"listen\\u001b]0;PWNED\\u0007\\nc.toml: ok (1 source(s))\" = 1\n";
        let shown = parse(text, None).map(|_| ()).unwrap_err().to_string();
        assert!(shown.contains("unknown field `listen\\u{1b}]0;PWNED\\u{7}\\nc.toml: ok"), "{shown}");
        assert!(!shown.chars().any(char::is_control), "{shown:?}");
    }

    #[test]
    fn a_syntax_error_names_the_key_path_its_line_shows() {
        let cases = [
            ("[http]\nlisten = \"127.0.0.1:1\"\nlisten = \"127.0.0.1:2\"\n", 3, "http.listen"),
            ("[http]\nmax_body_bytes = 1 2\n", 2, "http.max_body_bytes"),
            ("[http]\n\n[sources.a]\n\"accept\" = \"json\"\naccept = \"any\"\n", 5, "sources.a.accept"),
            (
                "[[sources.a.endpoints]]\nid = \"1\"\n[[ sources.a.endpoints ]]\nid = \"2\"\nid = \"3\"\n",
                5,
                "sources.a.endpoints[1].id",
            ),
            ("[http]\n[http]\n", 2, "http"),
            ("[sources.a.endpoints]\n[[sources.a.endpoints]]\n", 2, "sources.a.endpoints[0]"),
            ("log = { level = \"info\" \n", 1, "log"),
            ("[http]\nlisten = \"x\"\n[sources.a\nkey = 1\n", 3, ""),
            ("[http]\n= 5\n", 2, ""),
            // Within a value that spans lines: the value's key, never its text.
            (
                "[sources.a.admission]\nallowlist = [\n  { stream = \"s\", topic = \"t\" },\n  { stream = \"s\" topic = \"u\" },\n]\n",
                4,
                "sources.a.admission.allowlist",
            ),
            ("[sources.a]\nauth_secret = \"\"\"\n[x]\nabc\\qdef= \"\"\"\n", 4, "sources.a.auth_secret"),
            ("[sources.a]\nnote = '''\n[x]\n'''\naccept = \"any\"\naccept = \"json\"\n", 6, "sources.a.accept"),
            // Quoted keys stay whole, and are quoted as the other errors quote them.
            (
                "[sources.a.route.mapping]\n\"order.created\" = \"x\"\n\"order.created\" = \"y\"\n",
                3,
                "sources.a.route.mapping.\"order.created\"",
            ),
            ("\"a=b\" = 1\n\"a=b\" = 2\n", 2, "\"a=b\""),
            // A bracket in a header's quoted key is the key's; a header whose key holds
            // an escape is not followed, nor are the lines under it: no table they are
            // not in is named.
            ("[http]\nlisten = \"x\"\n[sources.\"a]b\"]\naccept = json\n", 4, "sources.\"a]b\".accept"),
            ("[http]\nlisten = \"x\"\n[sources.\"a\\\"b\"]\naccept = json\n", 4, ""),
            ("[http]\n\"a\\\"=b\" = \"\"\"\n[x]\n\"\"\"\nlisten = 1 2\n", 5, "http.listen"),
            // Not ASCII, and CRLF line ends.
            ("[http]\r\nlisten = \"é\" \"ü\"\r\n", 2, "http.listen"),
        ];
        for (text, line, path) in cases {
            let e = match parse(text, None) {
                Err(e) => e.errors,
                Ok(_) => panic!("{text:?} parsed"),
            };
            assert_eq!((e.len(), e[0].line, e[0].path.as_str()), (1, Some(line), path), "{text:?}: {e:?}");
        }
        let e = parse("[iggy]\npassword = \"hunter2\" x\n", None).unwrap_err();
        assert_eq!(e.errors[0].path, "iggy.password");
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }

    #[test]
    fn preallocation_reaches_the_log() {
        let text = "[wal]\npreallocate_bytes = 0\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let s = validate(&parse(text, None).unwrap(), Some(text), None).unwrap();
        assert_eq!(s.wal.preallocate_bytes, 0);
        assert_eq!(validate(&Config::builtin(), None, None).unwrap().wal.preallocate_bytes, 1024 * 1024);
        // Larger than a (small) segment is not an error: the zeros stop at the segment's size.
        let text = "[wal]\nsegment_max_bytes = 65536\nmax_bytes = 4194304\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        assert!(validate(&parse(text, None).unwrap(), Some(text), None).is_ok());
        // But bounded: the zeros pass through the writer's buffer.
        let e = errors(
            "[wal]\npreallocate_bytes = 67108865\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n",
        );
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].path, "wal.preallocate_bytes");
        assert_eq!(e[0].line, Some(2));
    }

    /// A body of `http.max_body_bytes` that could never fit in the log, even empty, would
    /// be answered 503 "retry later" for ever: the configuration is refused, naming the
    /// key. The smallest log that holds one (body, envelope room, frame header, and the
    /// log's own 96 bytes of headers and seal) is accepted.
    #[test]
    fn a_body_the_log_could_never_hold_is_refused_naming_the_key() {
        let with_max_bytes = |max_bytes: u64| {
            format!(
                "[http]\nmax_body_bytes = 1048576\n[wal]\nsegment_max_bytes = 65536\nmax_bytes = {max_bytes}\n\
                 [sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n"
            )
        };
        let e = errors(&with_max_bytes(1_048_576));
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].path, "http.max_body_bytes");
        assert_eq!(e[0].line, Some(2));
        assert!(e[0].message.contains("wal.max_bytes (1048576)"), "{}", e[0].message);
        let envelope = ingest::envelope::envelope_max_bytes(1, std::iter::empty(), &[(9, 64), (19, 20)]) as u64;
        let smallest = 1_048_576 + envelope + 32 + 96;
        let e = errors(&with_max_bytes(smallest - 1));
        assert_eq!(e[0].path, "http.max_body_bytes", "{e:?}");
        let text = with_max_bytes(smallest);
        validate(&parse(&text, None).unwrap(), Some(&text), None).unwrap_or_else(|e| panic!("{e:?}"));
    }

    /// The `iggy` client gives up on a reply after 30 s and reports the connection lost,
    /// which the router takes for the whole server: a result timeout at or above it would
    /// never fire, so a silent topic would open no breaker and cost every idle connection.
    /// Refused at its key path and line, per source too; the largest value below passes.
    #[test]
    fn a_result_timeout_the_iggy_client_would_preempt_is_refused_naming_the_key() {
        let with = |global: u64, github: u64| {
            format!(
                "[router]\nresult_timeout_ms = {global}\n[router.sources.a]\nresult_timeout_ms = {github}\n\
                 [sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n"
            )
        };
        let e = errors(&with(30_000, 1_000));
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].path.as_str(), e[0].line), ("router.result_timeout_ms", Some(2)));
        assert!(e[0].message.contains("at most 25000"), "{}", e[0].message);
        assert!(e[0].message.contains("30 s"), "{}", e[0].message);
        let e = errors(&with(1_000, 30_000));
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].path.as_str(), e[0].line), ("router.sources.a.result_timeout_ms", Some(4)));
        let text = with(25_000, 25_000);
        validate(&parse(&text, None).unwrap(), Some(&text), None).unwrap_or_else(|e| panic!("{e:?}"));
    }

    #[test]
    fn a_missing_secret_names_the_endpoint_key_path_and_line() {
        let text = r#"
[sources.github]
destination = { stream = "s", topic = "t" }

[[sources.github.endpoints]]
id = "000102030405060708090a0b0c0d0e0f"
auth_type = "none"

[[sources.github.endpoints]]
id = "100102030405060708090a0b0c0d0e0f"
auth_type = "hmac-sha256"
"#;
        let e = errors(text);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].path, "sources.github.endpoints[1].auth_secret");
        assert_eq!(e[0].message, "required when auth_type = \"hmac-sha256\"");
        assert_eq!(e[0].line, Some(9), "the line of the endpoint's table");
    }

    /// An endpoint's auth_type is never implied: an entry without one is refused, naming
    /// the entry ("none" must be asked for, as `POST /v1/endpoints` requires too).
    #[test]
    fn an_endpoint_without_an_auth_type_is_refused() {
        let text = "[sources.github]\ndestination = { stream = \"s\", topic = \"t\" }\n[[sources.github.endpoints]]\nid = \"000102030405060708090a0b0c0d0e0f\"\n";
        let e = errors(text);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].path, "sources.github.endpoints[0]");
        assert!(e[0].message.contains("auth_type"), "{}", e[0].message);
    }

    #[test]
    fn a_secret_on_an_endpoint_without_auth_is_refused_at_its_key() {
        let text = r#"
[sources.github]
destination = { stream = "s", topic = "t" }

[[sources.github.endpoints]]
id = "000102030405060708090a0b0c0d0e0f"
auth_type = "none"
auth_secret = "never checked"
"#;
        let e = errors(text);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].path, "sources.github.endpoints[0].auth_secret");
        assert_eq!(e[0].message, "is not used by auth_type = \"none\" (nothing is checked)");
    }

    /// serde stops at the first value of the wrong shape; every other one is named too,
    /// in the order of the file: inside an array of tables, after a secret (not repeated),
    /// and after a required key of the wrong type, whose absence is not reported as a
    /// second problem.
    #[test]
    fn every_problem_of_shape_is_named_in_the_order_of_the_file() {
        let text = "[iggy]\npassword = 12345\n[sources.a]\ndestination = { stream = \"s\", topic = 7 }\n\
            accept = [\"application/json\", 3]\n[[sources.a.endpoints]]\n\
            id = \"0123456789abcdef0123456789abcdef\"\nauth_type = \"none\"\n[[sources.a.endpoints]]\n\
            id = 5\nauth_type = \"none\"\n[wal]\nmax_bytes = \"big\"\nmax_byte = 3\n";
        let e = errors(text);
        let found: Vec<(&str, Option<usize>)> = e.iter().map(|e| (e.path.as_str(), e.line)).collect();
        assert_eq!(
            found,
            vec![
                ("iggy.password", Some(2)),
                ("sources.a.destination.topic", Some(4)),
                ("sources.a.accept", Some(5)),
                ("sources.a.endpoints[1].id", Some(10)),
                ("wal.max_bytes", Some(13)),
                ("wal.max_byte", Some(14)),
            ],
            "{e:?}"
        );
        assert!(e.iter().all(|e| !e.message.contains("12345") && !e.message.contains("missing field")), "{e:?}");
    }

    /// A required key the file itself lacks is named too, after a problem of shape
    /// elsewhere: only the absence of a key left out for its wrong type is not.
    #[test]
    fn a_required_key_the_file_lacks_is_named_beside_other_problems_of_shape() {
        let text = "[http]\nlisten = 5\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n\
            [[sources.a.endpoints]]\nid = \"0123456789abcdef0123456789abcdef\"\n";
        let e = errors(text);
        let found: Vec<&str> = e.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(found, vec!["http.listen", "sources.a.endpoints[0]"], "{e:?}");
        assert!(e[1].message.contains("auth_type"), "{e:?}");
        assert_eq!(e[1].line, Some(5), "{e:?}");
    }

    /// `wal.sync_interval_ms` is checked whatever the sync policy: a value that would refuse
    /// the switch to "interval" is said at once. And `allow_unauthenticated_remote` on a
    /// loopback listener allows nothing: a warning, not an error.
    #[test]
    fn settings_that_do_nothing_now_are_still_checked_or_warned_of() {
        let source = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let e = errors(&format!("[wal]\nsync = \"always\"\nsync_interval_ms = 0\n{source}"));
        assert_eq!(e.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(), vec!["wal.sync_interval_ms"], "{e:?}");
        let text = format!("[admin]\nallow_unauthenticated_remote = true\n{source}");
        let settings = validate(&parse(&text, None).unwrap(), Some(&text), None).unwrap();
        let warned: Vec<&str> = settings.warnings.errors.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(warned, vec!["admin.allow_unauthenticated_remote"]);
        let text = "[sources.a]\nnamed_path = false\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let settings = validate(&parse(text, None).unwrap(), Some(text), None).unwrap();
        let warned: Vec<&str> = settings.warnings.errors.iter().map(|w| w.path.as_str()).collect();
        assert_eq!(warned, vec!["sources.a.named_path"], "a source nothing can reach");
        let managed = format!("[admin]\nmanagement_token = \"manage-0123456789abcdef\"\n{text}");
        let settings = validate(&parse(&managed, None).unwrap(), Some(&managed), None).unwrap();
        assert_eq!(settings.warnings.errors, vec![], "reached through dynamic endpoints");
    }

    /// A delivery-id header set on a source whose named path checks Standard Webhooks
    /// signatures is never read there (the signed `webhook-id` is the id): a warning at
    /// the key, not an error (endpoints of another scheme read it).
    #[test]
    fn an_idempotency_header_a_standard_webhooks_path_never_reads_is_warned_of() {
        let text = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nauth_type = \"standard-webhooks\"\n\
                    auth_secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\nidempotency_header = \"x-delivery\"\n";
        let settings = validate(&parse(text, None).unwrap(), Some(text), None).unwrap_or_else(|e| panic!("{e}"));
        let warned: Vec<(&str, Option<usize>)> =
            settings.warnings.errors.iter().map(|w| (w.path.as_str(), w.line)).collect();
        assert_eq!(warned, vec![("sources.a.idempotency_header", Some(5))]);
        let bearer = text
            .replace("standard-webhooks", "bearer")
            .replace("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "a-token-of-some-length");
        let settings = validate(&parse(&bearer, None).unwrap(), Some(&bearer), None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(settings.warnings.errors, vec![], "read on a bearer path");
    }

    /// A source without its named path has no use for its own auth settings (each
    /// endpoint has its own): set, they read as guarding something and guard nothing,
    /// and are warned of at the first one set. Their checks tied to the named path (the
    /// tolerance against the idempotency window) are not made.
    #[test]
    fn a_sources_own_auth_without_its_named_path_is_warned_of() {
        let endpoint = "[[sources.a.endpoints]]\nid = \"0123456789abcdef0123456789abcdef\"\nauth_type = \"none\"\n";
        let source = |auth: &str| {
            format!(
                "[sources.a]\nnamed_path = false\ndestination = {{ stream = \"s\", topic = \"t\" }}\n{auth}{endpoint}"
            )
        };
        for (auth, key, line) in [
            ("auth_type = \"stripe\"\nauth_secret = \"whsec_x\"\n", "sources.a.auth_type", 4),
            ("auth_secret = \"left-over\"\n", "sources.a.auth_secret", 4),
            ("auth_tolerance_secs = 86400\n", "sources.a.auth_tolerance_secs", 4),
        ] {
            let text = source(auth);
            let settings = validate(&parse(&text, None).unwrap(), Some(&text), None).unwrap_or_else(|e| panic!("{e}"));
            let w = &settings.warnings.errors;
            assert_eq!(w.len(), 1, "{auth}: {w:?}");
            assert_eq!((w[0].path.as_str(), w[0].line), (key, Some(line)), "{auth}");
            assert!(w[0].message.contains("named_path = false"), "{}", w[0]);
        }
        let fine = source("");
        assert!(validate(&parse(&fine, None).unwrap(), Some(&fine), None).is_ok(), "{fine}");
        let with_path =
            source("auth_type = \"stripe\"\nauth_secret = \"whsec_x\"\n").replace("named_path = false\n", "");
        assert!(validate(&parse(&with_path, None).unwrap(), Some(&with_path), None).is_ok(), "{with_path}");
    }

    /// A routed source's fixed destination is its route's default: a bad name in it is
    /// one error, not one for each of the two uses.
    #[test]
    fn a_bad_name_in_a_routed_sources_destination_is_named_once() {
        let text =
            "[sources.a]\ndestination = { stream = \"s s\", topic = \"t\" }\nroute = { topic_field = \"kind\" }\n";
        let e = errors(text);
        assert_eq!(e.iter().map(|e| e.path.as_str()).collect::<Vec<_>>(), vec!["sources.a.destination.stream"]);
    }

    /// Every auth setting the scheme does not read is named at once, each at its key.
    #[test]
    fn every_auth_setting_the_scheme_does_not_read_is_named() {
        let text = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nauth_type = \"bearer\"\n\
                    auth_secret = \"a-token-of-some-length\"\nauth_header = \"x-key\"\nauth_prefix = \"p=\"\n\
                    auth_tolerance_secs = 60\n";
        let e = errors(text);
        let found: Vec<&str> = e.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            found,
            vec!["sources.a.auth_header", "sources.a.auth_prefix", "sources.a.auth_tolerance_secs"],
            "{e:?}"
        );
    }

    /// The problems of the settings a scheme reads are named together too: a Stripe
    /// source without a secret and with a tolerance past a day gets both at once.
    #[test]
    fn every_problem_of_the_settings_a_scheme_reads_is_named() {
        let text = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nauth_type = \"stripe\"\n\
                    auth_tolerance_secs = 100000\n";
        let e = errors(text);
        let found: Vec<&str> = e.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(found, vec!["sources.a.auth_secret", "sources.a.auth_tolerance_secs"], "{e:?}");
        assert!(e[0].message.contains("required"), "{e:?}");
        assert!(e[1].message.contains("more than 86400"), "{e:?}");
    }

    /// A secret, signature header or prefix past its bound is named at its key, with
    /// the scheme's other problems; at the bounds each is taken.
    #[test]
    fn auth_settings_past_their_bounds_are_named() {
        let hmac = |secret: usize, header: usize, prefix: usize| {
            format!(
                "[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\nauth_type = \"hmac-sha256\"\n\
                 auth_secret = \"{}\"\nauth_header = \"{}\"\nauth_prefix = \"{}\"\n",
                "k".repeat(secret),
                "x".repeat(header),
                "p".repeat(prefix)
            )
        };
        let e = errors(&hmac(1025, 129, 65));
        let found: Vec<(&str, &str)> = e.iter().map(|e| (e.path.as_str(), e.message.as_str())).collect();
        assert_eq!(
            found,
            vec![
                ("sources.a.auth_secret", "is 1025 bytes long; at most 1024 are accepted"),
                ("sources.a.auth_header", "is 129 bytes long; at most 128 are accepted"),
                ("sources.a.auth_prefix", "is 65 bytes long; at most 64 are accepted"),
            ],
            "{e:?}"
        );
        let text = hmac(1024, 128, 64);
        validate(&parse(&text, None).unwrap(), Some(&text), None).unwrap();
    }

    /// `idempotency.max_keys` is at least 1 and at most a billion, named at its key;
    /// unset, the index keeps the default.
    #[test]
    fn max_keys_is_bounded_and_defaults() {
        let source = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        for bad in [0u64, MAX_KEYS_MAX + 1] {
            let e = errors(&format!("[idempotency]\nmax_keys = {bad}\n{source}"));
            let found: Vec<(&str, Option<usize>)> = e.iter().map(|e| (e.path.as_str(), e.line)).collect();
            assert_eq!(found, vec![("idempotency.max_keys", Some(2))], "{bad}: {e:?}");
        }
        let text = format!("[idempotency]\nmax_keys = {MAX_KEYS_MAX}\n{source}");
        let settings = validate(&parse(&text, None).unwrap(), Some(&text), None).unwrap();
        assert_eq!(settings.idempotency_max_keys, MAX_KEYS_MAX);
        let settings = validate(&parse(source, None).unwrap(), Some(source), None).unwrap();
        assert_eq!(settings.idempotency_max_keys, ingest::idempotency::MAX_KEYS_DEFAULT);
    }

    /// Every problem of a file with many is named at its own line, from one parse of
    /// the file (a parse per problem made 1,500 of them take 45 s in a debug build).
    #[test]
    fn many_problems_are_each_named_at_their_line() {
        let text: String = (0..200)
            .map(|i| {
                format!(
                    "[sources.s{i}]\ndestination = {{ stream = \"s\", topic = \"t\" }}\nauth_type = \"bearer\"\nauth_secret = \"tok en\"\n\n"
                )
            })
            .collect();
        let e = errors(&text);
        assert_eq!(e.len(), 200, "{e:?}");
        for (i, error) in e.iter().enumerate() {
            // Sources are checked in key order: s0, s1, s10, s100, ...
            let n: usize = error.path.trim_start_matches("sources.s").trim_end_matches(".auth_secret").parse().unwrap();
            assert_eq!(
                (error.path.as_str(), error.line),
                (format!("sources.s{n}.auth_secret").as_str(), Some(5 * n + 4)),
                "{i}"
            );
        }
    }

    /// Sources, static endpoints and admission lists are bounded, each named at its key;
    /// at the bounds each is taken.
    #[test]
    fn sources_endpoints_and_admission_lists_are_bounded() {
        let sources = |n: usize| -> String {
            (0..n).map(|i| format!("[sources.s{i}]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n")).collect()
        };
        let e = errors(&sources(SOURCES_MAX + 1));
        let found: Vec<&str> = e.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(found, vec!["sources"], "{e:?}");
        assert!(e[0].message.starts_with("1025 sources; at most 1024"), "{e:?}");
        let text = sources(SOURCES_MAX);
        validate(&parse(&text, None).unwrap(), Some(&text), None).unwrap();

        let list = |n: usize| -> String {
            let entries: Vec<String> = (0..n).map(|i| format!("{{ stream = \"s\", topic = \"t{i}\" }}")).collect();
            format!(
                "[sources.a]\ndestination = {{ stream = \"s\", topic = \"t0\" }}\n\
                 admission = {{ mode = \"allowlist\", allowlist = [{}] }}\n",
                entries.join(", ")
            )
        };
        let e = errors(&list(ADMISSION_RULES_MAX + 1));
        let found: Vec<&str> = e.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(found, vec!["sources.a.admission.allowlist"], "{e:?}");
        let text = list(ADMISSION_RULES_MAX);
        validate(&parse(&text, None).unwrap(), Some(&text), None).unwrap();

        let endpoints = |n: usize| -> String {
            let mut text = String::from("[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n");
            for i in 0..n {
                text.push_str(&format!("[[sources.a.endpoints]]\nid = \"{i:032x}\"\nauth_type = \"none\"\n"));
            }
            text
        };
        let max = http_source::endpoints::DYNAMIC_ENDPOINTS_MAX;
        let e = errors(&endpoints(max + 1));
        let found: Vec<&str> = e.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(found, vec!["sources"], "{e:?}");
        assert!(e[0].message.starts_with("100001 static endpoints in all; at most 100000"), "{e:?}");
        let text = endpoints(max);
        validate(&parse(&text, None).unwrap(), Some(&text), None).unwrap();
    }

    /// A file of nothing but unknown keys gets a bounded list, not one line per key.
    #[test]
    fn problems_of_shape_are_listed_up_to_a_bound() {
        let text: String = (0..SHAPE_ERRORS_MAX + 10).map(|i| format!("unknown_{i:02} = 1\n")).collect();
        let e = errors(&text);
        assert_eq!(e.len(), SHAPE_ERRORS_MAX, "{e:?}");
        assert_eq!(e[0].path, "unknown_00");
        assert_eq!(e[0].line, Some(1));
    }

    #[test]
    fn type_errors_and_unknown_keys_name_the_path_and_line() {
        let e = errors("[http]\nmax_body_bytes = \"big\"\n");
        assert_eq!(e[0].path, "http.max_body_bytes");
        assert_eq!(e[0].line, Some(2));
        let e = errors("[http]\nlisten = \"127.0.0.1:1\"\nmax_body_byte = 3\n");
        assert_eq!(e[0].path, "http.max_body_byte");
        assert!(e[0].message.contains("max_body_byte"), "{e:?}");
        assert_eq!(e[0].line, Some(3));
        let e = errors("[http\n");
        assert_eq!(e[0].line, Some(1));
    }

    #[test]
    fn secrets_can_come_from_the_environment_and_a_missing_variable_is_named() {
        let text = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nauth_type = \"bearer\"\nauth_secret_env = \"IGGY_INGEST_TEST_UNSET_VARIABLE\"\n";
        let e = errors(text);
        assert_eq!(e[0].path, "sources.a.auth_secret_env");
        assert!(e[0].message.contains("IGGY_INGEST_TEST_UNSET_VARIABLE"), "{e:?}");
        assert_eq!(e[0].line, Some(4));
        // PATH is set in every test environment.
        let text = text.replace("IGGY_INGEST_TEST_UNSET_VARIABLE", "PATH");
        let c = parse(&text, None).unwrap();
        assert!(validate(&c, Some(&text), None).is_ok());
        let both = format!("{text}auth_secret = \"x\"\n");
        assert_eq!(errors(&both)[0].path, "sources.a.auth_secret_env");
        // A value from the environment that is no key of its scheme is named by the key
        // that named the variable (PATH holds ':', which base64 does not).
        let swh = text.replace("\"bearer\"", "\"standard-webhooks\"");
        let e = errors(&swh);
        assert_eq!(e[0].path, "sources.a.auth_secret_env", "{e:?}");
        assert!(e[0].message.contains("PATH"), "{e:?}");
        assert_eq!(e[0].line, Some(4));
    }

    /// A fixed destination's names keep to the grammar of routed names, which
    /// `[router.give_up]` takes: one that Iggy may refuse can always be given up.
    #[test]
    fn a_fixed_destination_is_named_by_the_grammar_of_routed_names() {
        let e = errors("[sources.x]\ndestination = { stream = \"s\", topic = \"a b\" }\n");
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].path, "sources.x.destination.topic");
        assert!(e[0].message.contains("[a-zA-Z0-9._-]"), "{e:?}");
        let e = errors("[sources.x]\ndestination = { stream = \"\", topic = \"t\" }\n");
        assert_eq!(e[0].path, "sources.x.destination.stream");
    }

    /// A body within max_body_bytes must make a record the log takes, whatever the
    /// source adds around it: the margin is the source's own envelope bound, and a
    /// source key or forwarded header name is bounded like Iggy's headers.
    #[test]
    fn max_body_bytes_must_fit_with_each_sources_largest_envelope() {
        let source = |headers: &str| {
            format!(
                "[wal]\nrecord_max_bytes = 8192\n[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\nforward_headers = [{headers}]\n"
            )
        };
        let fits = |max_body: u64, headers: &str| {
            let text = format!("[http]\nmax_body_bytes = {max_body}\n{}", source(headers));
            let c = parse(&text, None).unwrap();
            validate(&c, Some(&text), None)
        };
        // No forwarded header: the envelope of source "a" with the default metadata.
        let spec_bound = |headers: &[&str]| {
            ingest::envelope::envelope_max_bytes(1, headers.iter().map(|h| h.len()), &[(9, 64), (19, 20)]) as u64
        };
        let bare = 8192 - spec_bound(&[]);
        assert!(fits(bare, "").is_ok());
        let e = fits(bare + 1, "").unwrap_err().errors;
        assert_eq!(e[0].path, "http.max_body_bytes");
        assert!(
            e[0].message.contains("source \"a\"") && e[0].message.contains("wal.record_max_bytes (8192)"),
            "{}",
            e[0].message
        );
        // Each forwarded header takes room: what fitted alone no longer does.
        let headers = ["x-github-event", "x-github-hook-id", "user-agent"];
        let listed = headers.iter().map(|h| format!("\"{h}\"")).collect::<Vec<_>>().join(", ");
        assert!(fits(bare, &listed).is_err());
        assert!(fits(8192 - spec_bound(&headers), &listed).is_ok());
        // A name listed twice, a name longer than Iggy takes, a source key likewise.
        let e = fits(1024, "\"x-a\", \"X-A\"").unwrap_err().errors;
        assert_eq!((e[0].path.as_str(), e[0].message.contains("twice")), ("sources.a.forward_headers[1]", true));
        let e = fits(1024, &format!("\"x-{}\"", "a".repeat(300))).unwrap_err().errors;
        assert_eq!((e[0].path.as_str(), e[0].message.contains("at most 255")), ("sources.a.forward_headers[0]", true));
        let long_key = format!("[sources.{}]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n", "k".repeat(256));
        assert!(errors(&long_key).iter().any(|e| e.message.contains("at most 255")), "{:?}", errors(&long_key));
    }

    /// Numbers at the edge of u64 are errors naming their keys, not overflows.
    #[test]
    fn huge_numbers_are_errors_at_their_key_not_overflows() {
        let text = "[http]\nmax_connections = 3000000000000000000\n[wal]\nsegment_max_bytes = 18446744073709551615\nmax_bytes = 18446744073709551615\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let e = errors(text);
        let at = |path: &str| e.iter().find(|e| e.path == path).unwrap_or_else(|| panic!("no error at {path}: {e:?}"));
        assert!(at("http.max_connections").message.contains("at most 1000000"));
        assert_eq!(at("http.max_connections").line, Some(2));
        assert!(at("wal.max_bytes").message.contains("twice"), "{:?}", at("wal.max_bytes"));
        // Retry-After is bounded too: a value meant in milliseconds is refused.
        let src = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let e = errors(&format!("[http]\nretry_after_secs = 5000\n{src}"));
        assert_eq!((e[0].path.as_str(), e[0].line), ("http.retry_after_secs", Some(2)), "{e:?}");
        assert!(e[0].message.contains("at most 3600"));
        let text = format!("[http]\nretry_after_secs = 3600\n{src}");
        assert!(parse(&text, None).and_then(|c| validate(&c, Some(&text), None)).is_ok());
    }

    /// The log is released only below the idempotency checkpoint: an hour between
    /// checkpoints would hold an hour of delivered records, and fill a log sized for
    /// delivery that keeps up.
    #[test]
    fn the_checkpoint_interval_is_bounded_at_its_key() {
        let with = |ms: u64| {
            format!(
                "[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n[idempotency]\ncheckpoint_interval_ms = {ms}\n"
            )
        };
        let e = errors(&with(60_001));
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].path.as_str(), e[0].line), ("idempotency.checkpoint_interval_ms", Some(4)));
        assert!(e[0].message.contains("at most 60000"), "{}", e[0].message);
        let at_the_bound = with(60_000);
        if let Err(e) = parse(&at_the_bound, None).and_then(|c| validate(&c, Some(&at_the_bound), None)) {
            panic!("the longest interval was refused: {e:?}");
        }
    }

    /// Each segment is an open file: more segments than descriptors would stop the log.
    #[test]
    fn a_log_of_more_segments_than_the_file_budget_is_refused_at_its_key() {
        let with = |max_bytes: u64| {
            format!(
                "[wal]\nsegment_max_bytes = 1048576\nmax_bytes = {max_bytes}\n[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n"
            )
        };
        let e = errors(&with(16_385 * 1_048_576));
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].path.as_str(), e[0].line), ("wal.max_bytes", Some(3)));
        assert!(e[0].message.contains("16384 times wal.segment_max_bytes"), "{}", e[0].message);
        let at_the_bound = with(16_384 * 1_048_576);
        if let Err(e) = parse(&at_the_bound, None).and_then(|c| validate(&c, Some(&at_the_bound), None)) {
            panic!("the largest log was refused: {e:?}");
        }
    }

    #[test]
    fn credential_headers_cannot_be_forwarded() {
        let text = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nforward_headers = [\"x-github-event\", \"Authorization\"]\n";
        let e = errors(text);
        assert_eq!(e[0].path, "sources.a.forward_headers[1]");
        assert_eq!(e[0].line, Some(3));
    }

    /// The headers the daemon sets on every message (its own `iggy-ingest-*`, the
    /// content type, the metadata fields) cannot be forwarded: the forwarded value comes
    /// last and is the one Iggy keeps, so a sender would forge them downstream. Other
    /// names forward as before.
    #[test]
    fn headers_the_daemon_sets_on_every_message_cannot_be_forwarded() {
        for name in
            ["iggy-ingest-source", "Iggy-Ingest-Destination", "content-type", "peer_addr", "received_at_unix_ms"]
        {
            let text = format!(
                "[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\nforward_headers = [\"x-a\", \"{name}\"]\n"
            );
            let e = errors(&text);
            assert_eq!(e.len(), 1, "{name}: {e:?}");
            assert_eq!((e[0].path.as_str(), e[0].line), ("sources.a.forward_headers[1]", Some(3)), "{name}");
            assert!(e[0].message.contains("would replace it"), "{name}: {}", e[0].message);
        }
        let text = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nforward_headers = [\"x-iggy-ingest-source\", \"x-peer_addr\", \"content-language\"]\n";
        let settings = validate(&parse(text, None).unwrap(), Some(text), None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(settings.sources[0].forward_headers.len(), 3);
    }

    /// More forwarded headers than a message can carry within Iggy's limit are refused;
    /// the largest number allowed loads.
    #[test]
    fn more_forwarded_headers_than_a_message_can_carry_are_refused() {
        let text = |n: usize| {
            let names: Vec<String> = (0..n).map(|i| format!("\"x-h{i}\"")).collect();
            format!(
                "[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\nforward_headers = [{}]\n",
                names.join(", ")
            )
        };
        let at_max = text(router::FORWARD_HEADERS_MAX);
        assert!(validate(&parse(&at_max, None).unwrap(), Some(&at_max), None).is_ok());
        let e = errors(&text(router::FORWARD_HEADERS_MAX + 1));
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].path.as_str(), e[0].line), ("sources.a.forward_headers", Some(3)));
        assert!(e[0].message.contains("at most 64"), "{}", e[0].message);
    }

    /// A source with one static endpoint whose `expires_at` is `t` (on line 6).
    /// A certificate not valid yet is warned of (clients refuse it until then), as one
    /// that expired or expires within two weeks; one well inside its validity is not.
    #[test]
    fn a_certificate_not_valid_yet_or_near_its_expiry_is_warned_of() {
        use http_source::tls::Validity;
        let now = (ingest::time::now_unix_ms() / 1000) as i64;
        let day = 86_400;
        let warning = |from: i64, until: i64| {
            tls_validity_warning(Validity { not_before_unix_secs: from, not_after_unix_secs: until })
        };
        let future = warning(now + 30 * day, now + 400 * day).expect("a warning");
        assert!(
            future.starts_with("the certificate is not valid until ") && future.ends_with("until then"),
            "{future}"
        );
        assert!(warning(now - day, now - 1).expect("a warning").contains("expired at"));
        assert!(warning(now - day, now + 3 * day).expect("a warning").contains("expires at"));
        assert_eq!(warning(now - day, now + 400 * day), None);
    }

    fn static_endpoint_expiring_at(t: &str) -> String {
        format!(
            "[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n[[sources.a.endpoints]]\nid = \"0123456789abcdef0123456789abcdef\"\nauth_type = \"none\"\nexpires_at = \"{t}\"\n"
        )
    }

    /// A static endpoint's `expires_at` before 1970 is refused, naming the key; one in the
    /// past loads (an endpoint retired by its time: a restart must not fail).
    #[test]
    fn a_static_endpoint_expiring_before_1970_is_refused_and_one_in_the_past_loads() {
        let text = static_endpoint_expiring_at;
        let e = errors(&text("1969-12-31T23:59:59Z"));
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].path.as_str(), e[0].line), ("sources.a.endpoints[0].expires_at", Some(6)));
        let past = text("2001-01-01T00:00:00Z");
        let settings = validate(&parse(&past, None).unwrap(), Some(&past), None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(settings.endpoints[0].expires_at_unix_ms, Some(978_307_200_000));
        // At the far end: the latest instant the time type holds loads, and a well-formed
        // time past it is refused as such, not as text that is not a time.
        let latest = text("9999-12-30T22:00:00Z");
        assert!(validate(&parse(&latest, None).unwrap(), Some(&latest), None).is_ok());
        for late in ["9999-12-31T00:00:00Z", "9999-12-31T23:59:59+23:59"] {
            let e = errors(&text(late));
            assert_eq!((e.len(), e[0].path.as_str()), (1, "sources.a.endpoints[0].expires_at"), "{e:?}");
            assert!(e[0].message.contains("past the latest time taken, 9999-12-30T22:00:00Z"), "{}", e[0].message);
        }
        assert!(errors(&text("9999-13-01T00:00:00Z"))[0].message.contains("not an RFC 3339 time"));
    }

    /// A static endpoint's `expires_at` is RFC 3339 with its offset: one given in another
    /// zone means that instant, and one without an offset is refused (read as UTC, it
    /// would expire hours early or late, without a word).
    #[test]
    fn a_static_endpoints_expiry_takes_its_offset_and_needs_one() {
        let text = static_endpoint_expiring_at;
        let offset = text("2001-01-01T01:00:00+01:00");
        let settings = validate(&parse(&offset, None).unwrap(), Some(&offset), None).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(settings.endpoints[0].expires_at_unix_ms, Some(978_307_200_000));
        for local in ["2001-01-01T00:00:00", "2001-01-01 00:00:00", "2001-01-01"] {
            let e = errors(&text(local));
            assert_eq!(e.len(), 1, "{local}: {e:?}");
            assert_eq!(e[0].path, "sources.a.endpoints[0].expires_at", "{local}");
            assert!(e[0].message.contains("with its offset"), "{local}: {}", e[0].message);
        }
    }

    /// An Iggy username or password of a length the client never sends, and dead-letter
    /// names no policy uses, are refused naming their keys (never the password's text).
    #[test]
    fn iggy_credentials_that_cannot_sign_in_and_unused_dead_letter_names_are_refused() {
        let src = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let long = "p".repeat(101);
        for (iggy, path) in [
            ("username = \"ab\"".to_string(), "iggy.username"),
            ("password = \"\"".to_string(), "iggy.password"),
            (format!("password = \"{long}\""), "iggy.password"),
        ] {
            let e = errors(&format!("[iggy]\n{iggy}\n{src}"));
            assert_eq!((e.len(), e[0].path.as_str(), e[0].line), (1, path, Some(2)), "{e:?}");
            assert!(e[0].message.contains("Iggy signs in only with"), "{}", e[0].message);
            assert!(!e[0].to_string().contains(&long), "{}", e[0]);
        }
        let ok = format!("[iggy]\nusername = \"{}\"\npassword = \"{}\"\n{src}", "u".repeat(50), "p".repeat(100));
        assert!(validate(&parse(&ok, None).unwrap(), Some(&ok), None).is_ok());

        let dlq = "dead_letter_stream = \"dlq\"\ndead_letter_topic = \"rejected\"\n";
        let e = errors(&format!("[router]\n{dlq}{src}"));
        assert_eq!((e.len(), e[0].path.as_str()), (1, "router.dead_letter_stream"), "{e:?}");
        let e = errors(&format!("{src}[router.sources.a]\n{dlq}"));
        assert_eq!((e.len(), e[0].path.as_str()), (1, "router.sources.a.dead_letter_stream"), "{e:?}");
        // Used: by [router]'s own policy, or by an override that inherits the names.
        for text in [
            format!("[router]\non_admission_failure = \"dead_letter\"\n{dlq}{src}"),
            format!("[router]\n{dlq}{src}[router.sources.a]\non_admission_failure = \"dead_letter\"\n"),
        ] {
            validate(&parse(&text, None).unwrap(), Some(&text), None).unwrap_or_else(|e| panic!("{text}: {e}"));
        }
    }

    /// An error found while reading the file names its key as validation does: a key
    /// that is not bare is quoted, so `sources."shop.v2".accept` is not read as a table
    /// `v2` in a source `shop`.
    #[test]
    fn a_type_error_names_a_dotted_key_quoted_as_validation_does() {
        let text = "[sources.\"shop.v2\"]\ndestination = { stream = \"s\", topic = \"t\" }\naccept = 5\n";
        let e = parse(text, None).unwrap_err();
        assert_eq!((e.errors[0].path.as_str(), e.errors[0].line), ("sources.\"shop.v2\".accept", Some(3)), "{e}");
        let text = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nforward_headers = [\"x\", 5]\n";
        let e = parse(text, None).unwrap_err();
        assert_eq!(e.errors[0].path, "sources.a.forward_headers[1]", "{e}");
    }

    /// `.` and `..` are dot segments that clients remove from a URL before sending it,
    /// so a source keyed so could never be reached at its named path; `-` and `unknown`
    /// are what the metrics count requests and records of no source under.
    #[test]
    fn a_source_key_of_dots_alone_or_reserved_by_the_metrics_is_refused() {
        for key in [".", "..", "...", "-", "unknown"] {
            let text = format!("[sources.\"{key}\"]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n");
            let e = errors(&text);
            assert_eq!(e.len(), 1, "{key}: {e:?}");
            // A key TOML would take bare is named bare.
            let bare = key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
            let path = if bare { format!("sources.{key}") } else { format!("sources.\"{key}\"") };
            assert_eq!(e[0].path, path, "{key}");
            assert!(
                e[0].message.contains("dots alone") || e[0].message.contains("reserved"),
                "{key}: {}",
                e[0].message
            );
        }
        let text = "[sources.\"v1.a\"]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        assert!(validate(&parse(text, None).unwrap(), Some(text), None).is_ok());
    }

    /// A configured signature header passes the check by name (Shopify's
    /// `X-Shopify-Hmac-Sha256` holds none of its words) and is refused because the
    /// source's or a static endpoint's hmac scheme reads it.
    #[test]
    fn the_header_an_hmac_scheme_reads_its_signature_from_cannot_be_forwarded() {
        // A name no credential rule knows (one with "hmac" in it is refused as such).
        let source = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nauth_type = \"hmac-sha256-base64\"\nauth_secret = \"x\"\nauth_header = \"X-Vendor-Mac-Sha256\"\nforward_headers = [\"x-vendor-topic\", \"x-vendor-mac-sha256\"]\n";
        let e = errors(source);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].path.as_str(), e[0].line), ("sources.a.forward_headers[1]", Some(6)));
        assert!(e[0].message.contains("the source's named path"), "{}", e[0].message);

        let endpoint = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nforward_headers = [\"X-Sig\"]\n[[sources.a.endpoints]]\nid = \"0123456789abcdef0123456789abcdef\"\nauth_type = \"hmac-sha256\"\nauth_secret = \"x\"\nauth_header = \"x-sig\"\n";
        let e = errors(endpoint);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].path, "sources.a.forward_headers[0]");
        assert!(e[0].message.contains("endpoint sources.a.endpoints[0]"), "{}", e[0].message);
        assert!(!e[0].message.contains("0123456789abcdef"), "an endpoint's id is its secret path: {}", e[0].message);
        // Nor may it become the partition key or the delivery id, both stored in every record.
        let keyed = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nauth_type = \"hmac-sha256\"\nauth_secret = \"x\"\nauth_header = \"x-sig\"\nidempotency_header = \"X-Sig\"\npartitioning = { key_header = \"x-sig\" }\n";
        let paths: Vec<String> = errors(keyed).into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["sources.a.partitioning.key_header", "sources.a.idempotency_header"], "{paths:?}");
        let other = endpoint.replace("auth_header = \"x-sig\"", "auth_header = \"x-other\"");
        if let Err(e) = parse(&other, None).and_then(|c| validate(&c, Some(&other), None)) {
            panic!("another header was refused: {e:?}");
        }
    }

    /// No `{:?}` of the configuration, or of the settings made from it, carries a secret:
    /// one added to a log line or an error would print the Iggy password and the tokens.
    #[test]
    fn no_debug_of_the_configuration_or_its_settings_shows_a_secret() {
        let text = r#"
[admin]
token = "reader-token-0123456789"
management_token = "manager-token-0123456789"
[iggy]
password = "iggy-password-value"
[sources.a]
destination = { stream = "s", topic = "t" }
auth_type = "bearer"
auth_secret = "bearer-secret-value-0123"
[[sources.a.endpoints]]
id = "0123456789abcdef0123456789abcdef"
auth_type = "hmac-sha256"
auth_secret = "endpoint-secret-value"
"#;
        let config = parse(text, None).unwrap_or_else(|e| panic!("{e:?}"));
        let settings = validate(&config, Some(text), None).unwrap_or_else(|e| panic!("{e:?}"));
        assert_eq!(config.iggy.password.expose(), "iggy-password-value", "the secret is kept, only not shown");
        for shown in [format!("{config:?}"), format!("{settings:?}")] {
            for secret in [
                "reader-token-0123456789",
                "manager-token-0123456789",
                "iggy-password-value",
                "bearer-secret-value-0123",
                "endpoint-secret-value",
            ] {
                assert!(!shown.contains(secret), "{secret} shown in {shown}");
            }
        }
    }

    #[test]
    fn semantic_checks_name_their_keys() {
        let text = r#"
[http]
listen = "nowhere"
[wal]
segment_max_bytes = 1048576
max_bytes = 1048576
sync = "sometimes"
[sources.a]
destination = { stream = "", topic = "t", partition_id = 1, partition_key = "k" }
metadata = ["peer_addr", "geo"]
"#;
        let paths: Vec<String> = errors(text).into_iter().map(|e| e.path).collect();
        for p in [
            "http.listen",
            "wal.max_bytes",
            "wal.sync",
            "sources.a.destination.stream",
            "sources.a.destination.partition_key",
            "sources.a.metadata[1]",
        ] {
            assert!(paths.contains(&p.to_string()), "{p} missing from {paths:?}");
        }
    }

    #[test]
    fn a_route_needs_its_defaults_and_may_not_contradict_the_destination() {
        let text = "[sources.a]\nroute = { topic_field = \"event.type\" }\n";
        let paths: Vec<String> = errors(text).into_iter().map(|e| e.path).collect();
        assert_eq!(paths, ["sources.a.route.default_stream", "sources.a.route.default_topic"]);
        let text = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n\
                    route = { topic_field = \"type\", default_topic = \"other\" }\n";
        let e = errors(text);
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].path, "sources.a.route.default_topic");
        assert!(e[0].message.contains("contradicts"), "{e:?}");
        assert_eq!(e[0].line, Some(3));
        // The destination is the route's default when the route names none, or the same.
        let ok = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n\
                  route = { topic_field = \"type\", default_topic = \"t\", mapping = { x = \"tx\" } }\n";
        let s = validate(&parse(ok, None).unwrap(), Some(ok), None).unwrap();
        let Destinations::Routed(r) = &s.sources[0].destinations else { panic!("not routed") };
        assert_eq!((r.default_stream.as_str(), r.default_topic.as_str()), ("s", "t"));
        let none = "[sources.a]\naccept = \"json\"\n";
        assert_eq!(errors(none)[0].path, "sources.a.destination");
    }

    #[test]
    fn route_keys_are_checked_with_their_paths() {
        let text = r#"
[sources.a.route]
topic_field = "event..type"
stream_field = "tenant"
default_stream = "bad stream"
default_topic = "other"
on_missing_destination = "ignore"
mapping = { "order.created" = "orders", refund = { stream = "s", topic = "no/slash" } }
mapping_url = "https://example.com/m.json"
"#;
        let paths: Vec<String> = errors(text).into_iter().map(|e| e.path).collect();
        for p in [
            "sources.a.route.topic_field",
            "sources.a.route.default_stream",
            "sources.a.route.on_missing_destination",
            "sources.a.route.mapping_url",
        ] {
            assert!(paths.contains(&p.to_string()), "{p} missing from {paths:?}");
        }
        let text = "[sources.a.route]\ntopic_field = \"t\"\ndefault_stream = \"s\"\ndefault_topic = \"d\"\n\
                    mapping = { \"order.created\" = \"orders\", refund = { stream = \"s\", topic = \"no/slash\" } }\n";
        let e = errors(text);
        assert_eq!(e[0].path, "sources.a.route.mapping.refund");
        // Every entry with a problem is named, not only the first.
        let two = text.replace("\"orders\"", "\"bad topic\"");
        let mut paths: Vec<String> = errors(&two).into_iter().map(|e| e.path).collect();
        paths.sort();
        assert_eq!(paths, ["sources.a.route.mapping.\"order.created\"", "sources.a.route.mapping.refund"]);
        let shape = text.replace("{ stream = \"s\", topic = \"no/slash\" }", "{ queue = \"q\" }");
        let e = errors(&shape);
        assert_eq!(e[0].path, "sources.a.route.mapping.refund");
        assert!(e[0].message.contains("a topic name, or"), "{e:?}");
        let dotted = text.replace("refund", "\"refund.issued\"");
        let e = errors(&dotted);
        assert_eq!(e[0].path, "sources.a.route.mapping.\"refund.issued\"", "a key with a dot is quoted");
        assert_eq!(e[0].line, Some(5));
        let empty =
            "[sources.a.route]\ntopic_field = \"t\"\ndefault_stream = \"s\"\ndefault_topic = \"d\"\nmapping = {}\n";
        assert_eq!(errors(empty)[0].path, "sources.a.route.mapping");
        let bad_url = "[sources.a.route]\ntopic_field = \"t\"\ndefault_stream = \"s\"\ndefault_topic = \"d\"\nmapping_url = \"https://x/m\"\n";
        assert_eq!(errors(bad_url)[0].path, "sources.a.route.mapping_url");
    }

    #[test]
    fn admission_lists_follow_the_narrow_grammar_and_their_mode() {
        let base = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let case = |admission: &str| errors(&format!("{base}admission = {admission}\n"));
        let e = case(
            "{ mode = \"allowlist\", allowlist = [{ stream = \"s\", topic = \"t\" }, { stream = \"*\", topic = \"*\" }] }",
        );
        assert_eq!(e[0].path, "sources.a.admission.allowlist[1]");
        assert!(e[0].message.contains("every destination"), "{e:?}");
        let e = case("{ mode = \"denylist\", denylist = [{ stream = \"*\", topic = \"*\" }] }");
        assert_eq!(e[0].path, "sources.a.admission.denylist[0]");
        let e = case("{ mode = \"denylist\", denylist = [{ stream = \"orders-*\", topic = \"t\" }] }");
        assert_eq!(e[0].path, "sources.a.admission.denylist[0].stream");
        let e = case("{ mode = \"allowlist\", allowlist = [{ stream = \"s\", topic = \"t\", partition = 1 }] }");
        assert!(e[0].path.starts_with("sources.a.admission.allowlist"), "{e:?}");
        let e = case("{ mode = \"allowlist\" }");
        assert_eq!(e[0].path, "sources.a.admission.allowlist");
        let e = case("{ mode = \"open\", denylist = [{ stream = \"s\", topic = \"t\" }] }");
        assert_eq!(e[0].path, "sources.a.admission.denylist");
        let e = case("{ mode = \"closed\" }");
        assert_eq!(e[0].path, "sources.a.admission.mode");
        let e = case("{ mode = \"denylist\", denylist = [{ stream = \"s\", topic = \"*\" }] }");
        assert_eq!(e[0].path, "sources.a.admission");
        assert!(e[0].message.contains("s/t"), "{e:?}");
        let ok = format!(
            "{base}admission = {{ mode = \"denylist\", denylist = [{{ stream = \"*\", topic = \"audit\" }}] }}\n"
        );
        let s = validate(&parse(&ok, None).unwrap(), Some(&ok), None).unwrap();
        assert_eq!(s.sources[0].admission, Admission::Denylist(vec![Rule::parse("*", "audit").unwrap()]));
    }

    /// A mapping entry whose destination is known at load and refused by the source's own
    /// admission would answer every event routed there 422: refused at its entry. One
    /// whose stream comes from a field is judged per event, as before.
    #[test]
    fn a_mapping_entry_the_sources_admission_refuses_is_named() {
        let route = |stream_field: &str| {
            format!(
                "[sources.a]\nadmission = {{ mode = \"denylist\", denylist = [{{ stream = \"*\", topic = \"audit\" }}] }}\n\
                 [sources.a.route]\ntopic_field = \"t\"\n{stream_field}default_stream = \"shop\"\ndefault_topic = \"d\"\n\
                 mapping = {{ x = \"audit\", y = \"orders\", z = {{ stream = \"other\", topic = \"audit\" }} }}\n"
            )
        };
        let e = errors(&route(""));
        let found: Vec<&str> = e.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(found, vec!["sources.a.route.mapping.x", "sources.a.route.mapping.z"], "{e:?}");
        assert!(e[0].message.contains("shop/audit"), "{e:?}");
        let e = errors(&route("stream_field = \"s\"\n"));
        let found: Vec<&str> = e.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(found, vec!["sources.a.route.mapping.z"], "{e:?}");
    }

    const ONE_SOURCE: &str = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";

    fn admin_settings(admin: &str) -> Result<Settings, Vec<ConfigError>> {
        let text = format!("[admin]\n{admin}\n{ONE_SOURCE}");
        parse(&text, None).and_then(|c| validate(&c, Some(&text), None)).map_err(|e| e.errors)
    }

    #[test]
    fn a_non_loopback_admin_address_needs_a_token_or_an_explicit_opt_out() {
        let e = admin_settings("listen = \"0.0.0.0:9180\"").unwrap_err();
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!((e[0].path.as_str(), e[0].line), ("admin.listen", Some(2)));
        for named in ["admin.token", "admin.allow_unauthenticated_remote"] {
            assert!(e[0].message.contains(named), "{e:?}");
        }
        assert_eq!(admin_settings("listen = \"10.1.2.3:9180\"").unwrap_err()[0].path, "admin.listen");
        // Loopback, v4 and v6, needs nothing.
        for lo in ["127.0.0.1:9180", "127.0.0.2:0", "[::1]:9180"] {
            let s = admin_settings(&format!("listen = \"{lo}\"")).unwrap_or_else(|e| panic!("{lo}: {e:?}"));
            assert_eq!(s.admin_token, None);
        }
        let s = admin_settings("listen = \"0.0.0.0:9180\"\nallow_unauthenticated_remote = true").unwrap();
        assert_eq!(s.admin_token, None);
        let s = admin_settings("listen = \"0.0.0.0:9180\"\ntoken = \"reader-token-0123456789\"").unwrap();
        assert_eq!(s.admin_token.as_ref().map(SecretString::expose), Some("reader-token-0123456789"));
        // PATH is set in every test environment (and is long enough).
        let s = admin_settings("listen = \"0.0.0.0:9180\"\ntoken_env = \"PATH\"").unwrap();
        assert_eq!(s.admin_token.as_ref().map(SecretString::expose), std::env::var("PATH").ok().as_deref());
    }

    #[test]
    fn a_bad_admin_token_is_named_by_its_key() {
        let case = |admin: &str| {
            let e = admin_settings(admin).unwrap_err();
            assert_eq!(e.len(), 1, "{admin}: {e:?}");
            (e[0].path.clone(), e[0].message.clone())
        };
        let (p, m) = case("token = \"short\"");
        assert_eq!(p, "admin.token");
        assert!(m.contains("16"), "{m}");
        assert_eq!(case("token = \"has a space in it, sadly\"").0, "admin.token");
        assert_eq!(case("token = \"0123456789abcdefX\"\ntoken_env = \"PATH\"").0, "admin.token_env");
        let (p, m) = case("token_env = \"IGGY_INGEST_TEST_UNSET_VARIABLE\"");
        assert_eq!(p, "admin.token_env");
        assert!(m.contains("IGGY_INGEST_TEST_UNSET_VARIABLE"), "{m}");
        let (p, m) = case("token = \"same-token-0123456789\"\nmanagement_token = \"same-token-0123456789\"");
        assert_eq!(p, "admin.token");
        assert!(m.contains("management_token"), "{m}");
        let (p, _) = case("token = \"reader-token-0123456789\"\nallow_unauthenticated_remote = true");
        assert_eq!(p, "admin.allow_unauthenticated_remote");
        // A bad token on a public address is one error, not two.
        assert_eq!(case("listen = \"0.0.0.0:1\"\ntoken = \"short\"").0, "admin.token");
    }

    #[test]
    fn the_iggy_address_is_host_and_port_as_the_client_connects_to_it() {
        let text = |iggy: &str| format!("[iggy]\n{iggy}\n{ONE_SOURCE}");
        for bad in
            ["not an address", "127.0.0.1", "127.0.0.1:0", "iggy:65536", "::1:8090", "[::1]", "http://iggy:8090", ""]
        {
            let e = errors(&text(&format!("address = {bad:?}")));
            assert_eq!(e.len(), 1, "{bad:?}: {e:?}");
            assert_eq!((e[0].path.as_str(), e[0].line), ("iggy.address", Some(2)), "{bad:?}: {e:?}");
            assert!(e[0].message.contains("HOST:PORT"), "{bad:?}: {}", e[0].message);
        }
        for ok in ["127.0.0.1:8090", "iggy.internal:8090", "localhost:8090", "[::1]:8090"] {
            let t = text(&format!("address = {ok:?}"));
            let s = validate(&parse(&t, None).unwrap(), Some(&t), None).unwrap_or_else(|e| panic!("{ok}: {e}"));
            assert_eq!(s.delivery.sink.address, ok);
        }
        // With TLS the client takes the server name from the text before the first ':',
        // which for an IPv6 address is "[": iggy.tls_domain must say it.
        let e = errors(&text("address = \"[::1]:8090\"\ntls = true"));
        assert_eq!((e.len(), e[0].path.as_str()), (1, "iggy.tls_domain"), "{e:?}");
        let t = text("address = \"[::1]:8090\"\ntls = true\ntls_domain = \"iggy.internal\"");
        assert!(validate(&parse(&t, None).unwrap(), Some(&t), None).is_ok());
        // A CA file is read at config load: a wrong path would only show as connects
        // that fail for ever, the records held.
        let e = errors(&text("tls = true\ntls_ca_file = \"/nonexistent/ca.pem\""));
        assert_eq!((e.len(), e[0].path.as_str()), (1, "iggy.tls_ca_file"), "{e:?}");
        assert!(e[0].message.contains("cannot be read"), "{}", e[0].message);
        let e = errors(&text("tls_ca_file = \"/nonexistent/ca.pem\""));
        assert!(e[0].message.contains("not used unless iggy.tls = true"), "{}", e[0].message);
        // Its content too, as the client will read it: a file the client would turn into
        // no roots, or refuse, fails here, naming the problem.
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        let with_ca = |content: &str| {
            std::fs::write(&ca, content).unwrap();
            let t = text(&format!("tls = true\ntls_ca_file = {:?}", ca.display().to_string()));
            validate(&parse(&t, None).unwrap(), Some(&t), None).map(|_| ())
        };
        with_ca(TEST_CA_PEM).unwrap();
        with_ca(&format!("{TEST_CA_PEM}{TEST_CA_PEM}")).unwrap();
        let garbage = TEST_CA_PEM.replace("MIIBlDCC", "AAAAAAAA");
        for (content, says) in [
            ("", "holds no PEM certificate"),
            ("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", "holds no PEM certificate"),
            ("-----BEGIN CERTIFICATE-----\n", "certificate 1 is not valid PEM"),
            (garbage.as_str(), "certificate 1 is not a usable CA certificate"),
        ] {
            let e = match with_ca(content) {
                Err(ConfigErrors { errors, .. }) => errors,
                Ok(()) => panic!("{content:?} passed"),
            };
            assert_eq!((e.len(), e[0].path.as_str()), (1, "iggy.tls_ca_file"), "{e:?}");
            assert!(e[0].message.contains(says), "{content:?}: {}", e[0].message);
        }
    }

    /// A CA certificate (self-signed, P-256, valid until 2126) for the checks above.
    const TEST_CA_PEM: &str = "-----BEGIN CERTIFICATE-----
MIIBlDCCATmgAwIBAgIUUfUtsD3xztALss4Z2FRFdpBRBlYwCgYIKoZIzj0EAwIw
HjEcMBoGA1UEAwwTaWdneS1pbmdlc3QgdGVzdCBDQTAgFw0yNjEyMDIxNTU2NDda
GA8yMTI2MTEwODE1NTY0N1owHjEcMBoGA1UEAwwTaWdneS1pbmdlc3QgdGVzdCBD
QTBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABOf1dDaBHHrif+CeSCmPxxcJzG51
oy4/Jf0/g+tbh5Y/HalVNkuQdG5eiz0akuV007zcTXsP78we1Xv7YZs7HTqjUzBR
MB0GA1UdDgQWBBRYq30DHj4qNWveiDLPiz9un1LzdDAfBgNVHSMEGDAWgBRYq30D
Hj4qNWveiDLPiz9un1LzdDAPBgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0kA
MEYCIQDdANBkmDQFww9i5RQhvNuKwA5ZH2xt1JEZsFIszbXCTAIhAOm7dqPjNHJ+
bBtPhzVL3fJI+53KVnAh3DIZNmANmTYN
-----END CERTIFICATE-----
";

    /// A secret of the wrong type (a number left unquoted) is refused at its key without
    /// repeating it: the message would otherwise go to the terminal and the journal.
    #[test]
    fn a_secret_of_the_wrong_type_is_refused_without_repeating_it() {
        for (text, path) in [
            (
                "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nauth_type = \"bearer\"\nauth_secret = 987654321\n",
                "sources.a.auth_secret",
            ),
            (
                "[iggy]\npassword = 987654321\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n",
                "iggy.password",
            ),
            (
                "[admin]\nmanagement_token = 987654321\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n",
                "admin.management_token",
            ),
        ] {
            let e = errors(text);
            assert_eq!(e[0].path, path);
            assert!(!e[0].message.contains("987654321"), "{path}: {}", e[0].message);
            assert!(e[0].message.contains("must be a string"), "{path}: {}", e[0].message);
        }
        // Elsewhere the refused value is named as serde names it.
        let e =
            errors("[http]\nmax_body_bytes = \"lots\"\n[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n");
        assert!(e[0].message.contains("lots"), "{}", e[0].message);
    }

    /// A signature tolerance longer than half the delivery ids' retention is refused: at
    /// the tolerance when the file sets it, at the retention when the default (300 s)
    /// applies.
    #[test]
    fn a_signature_tolerance_needs_twice_its_length_of_retention() {
        let stripe = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\nauth_type = \"stripe\"\nauth_secret = \"whsec_x\"\n";
        let e = errors(&format!("[idempotency]\nretention_secs = 599\n{stripe}"));
        assert_eq!((e.len(), e[0].path.as_str(), e[0].line), (1, "idempotency.retention_secs", Some(2)), "{e:?}");
        assert!(e[0].message.contains("sources.a"), "{}", e[0].message);
        // A source that keeps no delivery ids has nothing to replay.
        let unkeyed = format!("[idempotency]\nretention_secs = 599\n{stripe}idempotency = false\n");
        assert!(validate(&parse(&unkeyed, None).unwrap(), Some(&unkeyed), None).is_ok());
        let fine = format!("[idempotency]\nretention_secs = 600\n{stripe}");
        assert!(validate(&parse(&fine, None).unwrap(), Some(&fine), None).is_ok());
        let e = errors(&format!("[idempotency]\nretention_secs = 600\n{stripe}auth_tolerance_secs = 301\n"));
        assert_eq!((e.len(), e[0].path.as_str(), e[0].line), (1, "sources.a.auth_tolerance_secs", Some(7)), "{e:?}");
        let endpoint = "[sources.b]\ndestination = { stream = \"s\", topic = \"t\" }\n[[sources.b.endpoints]]\nid = \"0123456789abcdef0123456789abcdef\"\nauth_type = \"standard-webhooks\"\nauth_secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"\nauth_tolerance_secs = 100\n";
        let e = errors(&format!("[idempotency]\nretention_secs = 199\n{endpoint}"));
        assert_eq!(e[0].path, "sources.b.endpoints[0].auth_tolerance_secs", "{e:?}");
        // Without delivery ids a day at most: past it, a captured request passes for days.
        let day = format!("{stripe}idempotency = false\nauth_tolerance_secs = 86400\n");
        assert!(validate(&parse(&day, None).unwrap(), Some(&day), None).is_ok());
        let e = errors(&format!("{stripe}idempotency = false\nauth_tolerance_secs = 86401\n"));
        assert_eq!((e.len(), e[0].path.as_str(), e[0].line), (1, "sources.a.auth_tolerance_secs", Some(6)), "{e:?}");
        assert!(e[0].message.contains("more than 86400"), "{}", e[0].message);
    }

    /// A body larger than Iggy stores in one message (64,000,000 bytes, under the log's
    /// largest record of 64 MiB) would be accepted and never delivered.
    #[test]
    fn a_body_larger_than_iggy_stores_is_refused() {
        let t = |body: u64| {
            format!(
                "[http]\nmax_body_bytes = {body}\n[wal]\nrecord_max_bytes = 67108864\n[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n"
            )
        };
        let e = errors(&t(64_000_001));
        assert_eq!((e.len(), e[0].path.as_str(), e[0].line), (1, "http.max_body_bytes", Some(2)), "{e:?}");
        assert!(e[0].message.contains("64000000"), "{}", e[0].message);
        let fine = t(64_000_000);
        if let Err(e) = parse(&fine, None).and_then(|c| validate(&c, Some(&fine), None)) {
            panic!("Iggy's own limit was refused: {e:?}");
        }
        // At the type's top, with and without a field the route reads (which adds the
        // body to a request's room once more): refused once, at the key, and the checks
        // of what a request takes are not run on a limit already refused.
        for body in [i64::MAX as u64, 7_000_000_000_000_000_000, u64::MAX] {
            for fields in ["", "partitioning = { key_field = \"customer\" }\n"] {
                let text = format!(
                    "[http]\nmax_body_bytes = {body}\n[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n{fields}"
                );
                let e = errors(&text);
                assert_eq!(
                    (e.len(), e[0].path.as_str(), e[0].line),
                    (1, "http.max_body_bytes", Some(2)),
                    "{body}: {e:?}"
                );
            }
        }
    }

    #[test]
    fn the_shutdown_timings_are_bounded() {
        let t = |body: &str| {
            format!("[shutdown]\n{body}\n[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n")
        };
        let e = errors(&t("grace_period_ms = 0"));
        assert_eq!((e[0].path.as_str(), e[0].line), ("shutdown.grace_period_ms", Some(2)));
        assert_eq!(errors(&t("grace_period_ms = 3600001"))[0].path, "shutdown.grace_period_ms");
        assert_eq!(errors(&t("drain_delay_ms = 3600001"))[0].path, "shutdown.drain_delay_ms");
        let fine = t("grace_period_ms = 3600000\ndrain_delay_ms = 3600000");
        assert!(validate(&parse(&fine, None).unwrap(), Some(&fine), None).is_ok());
    }

    #[test]
    fn the_management_token_follows_the_same_rules_as_the_admin_token() {
        // A token that is not visible ASCII can never be presented (a header value that
        // is not visible ASCII is not read as text), so every management call would be 401.
        for (token, why) in [
            ("short", "16"),
            ("has a space in it, sadly", "visible ASCII"),
            ("tab\there-0123456789", "visible ASCII"),
            ("t\u{f6}k\u{e9}n-0123456789abcdef", "visible ASCII"),
        ] {
            for key in ["management_token", "token"] {
                let e = admin_settings(&format!("{key} = {token:?}")).unwrap_err();
                assert_eq!(e.len(), 1, "{key} = {token:?}: {e:?}");
                assert_eq!((e[0].path.clone(), e[0].line), (format!("admin.{key}"), Some(2)), "{e:?}");
                assert!(e[0].message.contains(why), "{key} = {token:?}: {}", e[0].message);
            }
        }
        let s = admin_settings("management_token = \"!visible~ascii-0123456789\"").unwrap();
        assert_eq!(s.management_token.as_ref().map(SecretString::expose), Some("!visible~ascii-0123456789"));
    }

    #[test]
    fn partitioning_is_set_in_one_place_with_one_source_of_keys() {
        let base = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
        let ok = format!("{base}partitioning = {{ key_field = \"customer.id\", key_encoding = \"key_u32\" }}\n");
        let s = validate(&parse(&ok, None).unwrap(), Some(&ok), None).unwrap();
        assert_eq!(
            s.sources[0].partitioning,
            PartitionRule::Key {
                source: KeySource::Field(FieldPath::parse("customer.id").unwrap()),
                encoding: KeyEncoding::U32
            }
        );
        let case = |p: &str| errors(&format!("{base}partitioning = {p}\n"));
        assert_eq!(case("{ key_header = \"x-a\", partition_id = 1 }")[0].path, "sources.a.partitioning");
        assert_eq!(case("{}")[0].path, "sources.a.partitioning");
        assert_eq!(case("{ key_header = \"bad header\" }")[0].path, "sources.a.partitioning.key_header");
        let credential = case("{ key_header = \"X-Api-Key\" }");
        assert_eq!(credential[0].path, "sources.a.partitioning.key_header");
        assert!(credential[0].message.contains("carries credentials"), "{}", credential[0].message);
        assert_eq!(
            case("{ key_header = \"x-a\", key_encoding = \"u64\" }")[0].path,
            "sources.a.partitioning.key_encoding"
        );
        let both = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\", partition_id = 1 }\npartitioning = { key_header = \"x-a\" }\n";
        assert_eq!(errors(both)[0].path, "sources.a.partitioning");
    }
}
