//! What a source is: its key, where its events go (a fixed destination or a route, a
//! partitioning rule, admission), accepted bodies, auth for its named path, and which
//! request details go into each record.
//!
//! Invariants:
//! - Specs are validated when built from configuration; at request time nothing here
//!   can fail.
//! - A routed source's mapping is a table by the time the door serves it (a
//!   `mapping_url` is fetched at start, before the listener binds).
//! - `forward_headers` never names a credential header (refused at config load by
//!   [`is_credential_header`]).

use crate::admission::{Admission, Pattern, Rule};
use crate::auth::AuthScheme;
use crate::body::Accept;
use crate::partition::PartitionRule;
use crate::route::{MappingSource, Route};

/// The largest header value Iggy accepts; longer forwarded values are cut to this and
/// the cut is counted. A longer `Content-Type` is refused.
pub const HEADER_VALUE_MAX_BYTES: usize = ingest::envelope::ENVELOPE_FIELD_MAX_BYTES;

/// The longest delivery id accepted for idempotency; a longer one is a 400.
pub const DELIVERY_KEY_MAX_BYTES: usize = 255;

// Every field the envelope bound counts at ENVELOPE_FIELD_MAX_BYTES is held to it here,
// so raising one limit alone cannot make `SourceSpec::envelope_max_bytes` (and the
// configuration check built on it) too small.
const _: () = assert!(DELIVERY_KEY_MAX_BYTES <= ingest::envelope::ENVELOPE_FIELD_MAX_BYTES);
const _: () = assert!(crate::partition::KEY_MAX_BYTES <= ingest::envelope::ENVELOPE_FIELD_MAX_BYTES);
const _: () = assert!(crate::admission::NAME_MAX_BYTES <= ingest::envelope::ENVELOPE_FIELD_MAX_BYTES);

/// The request headers that carry a sender's delivery id, in the order they are tried
/// (after a source's own configured header). Not for a request authenticated by
/// Standard Webhooks: its delivery id is the id its signature covers, and only that.
/// Parsed once (a lookup by `&str` parses and classifies the name on every request).
pub static DELIVERY_ID_HEADERS: [axum::http::HeaderName; 4] = [
    axum::http::HeaderName::from_static("idempotency-key"),
    axum::http::HeaderName::from_static("webhook-id"),
    axum::http::HeaderName::from_static("svix-id"),
    axum::http::HeaderName::from_static("x-github-delivery"),
];

/// Which receive details are stored as metadata with each event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MetadataFields {
    pub peer_addr: bool,
    pub received_at: bool,
}

/// Where a source's events go, before partitioning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destinations {
    /// Every event goes to this stream and topic.
    Fixed { stream: String, topic: String },
    /// Each event is routed by its payload.
    Routed(Route),
}

impl Destinations {
    pub fn route(&self) -> Option<&Route> {
        match self {
            Destinations::Fixed { .. } => None,
            Destinations::Routed(r) => Some(r),
        }
    }

    pub fn route_mut(&mut self) -> Option<&mut Route> {
        match self {
            Destinations::Fixed { .. } => None,
            Destinations::Routed(r) => Some(r),
        }
    }
}

#[derive(Debug, Clone)]
pub struct SourceSpec {
    pub key: String,
    pub destinations: Destinations,
    pub partitioning: PartitionRule,
    pub admission: Admission,
    pub accept: Accept,
    /// Whether `POST /v1/sources/{key}` is served (secret-path endpoints work either way).
    pub named_path: bool,
    /// Auth of the named path.
    pub auth: AuthScheme,
    /// Lower-case header names copied into each record.
    pub forward_headers: Vec<String>,
    pub metadata: MetadataFields,
    /// A header, besides [`DELIVERY_ID_HEADERS`], that carries the delivery id (lower-case).
    pub idempotency_header: Option<String>,
    /// Whether delivery ids are honoured at all for this source.
    pub idempotency: bool,
}

impl SourceSpec {
    /// The payload fields routing reads from each event: the route's topic and stream
    /// fields and the partition key's field. Empty when no event is read.
    pub fn fields_read(&self) -> Vec<&crate::field_path::FieldPath> {
        let route = self.destinations.route();
        let route_fields = route.into_iter().flat_map(|r| std::iter::once(&r.topic_field).chain(&r.stream_field));
        route_fields.chain(self.partitioning.field()).collect()
    }

    /// The destinations this source's events can be seen to go to before any arrives,
    /// in order, without repeats: its fixed destination, or its route's default (only
    /// where an event can go there: `on_missing_destination = "default"`), and the
    /// allowlist's literal entries; each only if the source's admission lets it in. What
    /// the router pre-warms at start (at most the source's `max_destinations` of them).
    pub fn destinations_known_at_start(&self) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = Vec::new();
        match &self.destinations {
            Destinations::Fixed { stream, topic } => out.push((stream.clone(), topic.clone())),
            Destinations::Routed(r) if r.on_missing == crate::route::OnMissing::Default => {
                out.push((r.default_stream.clone(), r.default_topic.clone()))
            }
            Destinations::Routed(_) => {}
        }
        if let Admission::Allowlist(rules) = &self.admission {
            for rule in rules {
                if let (Pattern::Exact(stream), Pattern::Exact(topic)) = (&rule.stream, &rule.topic) {
                    out.push((stream.clone(), topic.clone()));
                }
            }
        }
        let mut seen = std::collections::HashSet::new();
        out.retain(|(s, t)| self.admission.check(s, t).is_ok() && seen.insert((s.clone(), t.clone())));
        out
    }

    /// The destinations this source's file names: those known at start
    /// ([`SourceSpec::destinations_known_at_start`]) and its mapping table's targets whose
    /// stream is named there too (an entry's own, or the route's default where it has no
    /// stream field), each only if the source's admission lets it in, without repeats.
    /// What the cap must admit for every event the file routes to be delivered.
    pub fn destinations_named_in_file(&self) -> Vec<(String, String)> {
        let mut out = self.destinations_known_at_start();
        if let Destinations::Routed(r) = &self.destinations
            && let crate::route::MappingSource::Table(mapping) = &r.mapping
        {
            let mut targets: Vec<(String, String)> = mapping
                .targets()
                .filter_map(|t| match (&t.stream, &r.stream_field) {
                    (Some(stream), _) => Some((stream.clone(), t.topic.clone())),
                    (None, None) => Some((r.default_stream.clone(), t.topic.clone())),
                    (None, Some(_)) => None,
                })
                .filter(|(s, t)| self.admission.check(s, t).is_ok())
                .collect();
            targets.sort();
            for target in targets {
                if !out.contains(&target) {
                    out.push(target);
                }
            }
        }
        out
    }

    /// Whether this source's senders choose its destinations' names: its route takes a
    /// name from the event itself (a topic with no mapping, or a stream from
    /// `stream_field` where a mapping entry names none) and its admission does not limit
    /// what gets in to names listed in the file (an allowlist of exact names only).
    /// Such a source can name more destinations than any cap, whatever its file says.
    pub fn senders_choose_destinations(&self) -> bool {
        let Destinations::Routed(route) = &self.destinations else { return false };
        let named_by_events = match &route.mapping {
            MappingSource::Identity => true,
            // A fetched table is not known before the start: any entry may leave the
            // stream to `stream_field`.
            MappingSource::Url(_) => route.stream_field.is_some(),
            MappingSource::Table(m) => route.stream_field.is_some() && m.leaves_a_stream_unnamed(),
        };
        let listed_only =
            self.admitted_only_if(|r| matches!((&r.stream, &r.topic), (Pattern::Exact(_), Pattern::Exact(_))));
        named_by_events && !listed_only
    }

    /// Whether a sender can name topics of its own choosing (a route whose topic is the
    /// event's field, no table), not limited by the source's admission to topics listed
    /// here by name: the topics of one stream are then bounded by nothing the file says.
    pub fn senders_choose_topics(&self) -> bool {
        let Destinations::Routed(route) = &self.destinations else { return false };
        matches!(route.mapping, MappingSource::Identity)
            && !self.admitted_only_if(|r| matches!(r.topic, Pattern::Exact(_)))
    }

    /// Whether the source's admission is an allowlist whose every rule is `listed`.
    fn admitted_only_if(&self, listed: impl Fn(&Rule) -> bool) -> bool {
        match &self.admission {
            Admission::Allowlist(rules) => rules.iter().all(listed),
            Admission::Open | Admission::Denylist(_) => false,
        }
    }

    /// The most bytes a record of this source holds beside its event
    /// ([`ingest::envelope::envelope_max_bytes`] for its key, forwarded headers and
    /// metadata), so `http.max_body_bytes` plus this is its largest record.
    pub fn envelope_max_bytes(&self) -> usize {
        // Asked for by every request: nothing here allocates.
        let mut metadata = [(0, 0); 2];
        let mut fields = 0;
        if self.metadata.peer_addr {
            metadata[fields] = (METADATA_PEER_ADDR.len(), PEER_ADDR_TEXT_MAX_BYTES);
            fields += 1;
        }
        if self.metadata.received_at {
            metadata[fields] = (METADATA_RECEIVED_AT.len(), RECEIVED_AT_TEXT_MAX_BYTES);
            fields += 1;
        }
        ingest::envelope::envelope_max_bytes(
            self.key.len(),
            self.forward_headers.iter().map(String::len),
            &metadata[..fields],
        )
    }
}

/// The metadata name of the sender's address.
pub const METADATA_PEER_ADDR: &str = "peer_addr";
/// The metadata name of the receive time.
pub const METADATA_RECEIVED_AT: &str = "received_at_unix_ms";
/// The longest receive time text: `u64::MAX` in decimal.
pub const RECEIVED_AT_TEXT_MAX_BYTES: usize = 20;
/// The longest socket address text: `[` an IPv6 address of 39 characters, `%` a scope id
/// of up to 10 digits, `]:` and a port of up to 5 digits is 58; rounded up.
pub const PEER_ADDR_TEXT_MAX_BYTES: usize = 64;

/// Headers that carry credentials; forwarding them into the log would copy secrets
/// into every downstream consumer (and `wal dump` prints them). Exact names, then parts
/// of a name that say a credential whatever surrounds them: API keys under a provider's
/// own name (`x-goog-api-key`, `apikey`, `ocp-apim-subscription-key`,
/// `x-functions-key`), HMACs under a name without "signature" (`x-shopify-hmac-sha256`),
/// session ids (a cookie's value by another name).
pub fn is_credential_header(name: &str) -> bool {
    const PARTS: [&str; 13] = [
        "signature",
        "secret",
        "token",
        "password",
        "apikey",
        "api-key",
        "api_key",
        "hmac",
        "credential",
        "session",
        "subscription-key",
        "functions-key",
        "auth-key",
    ];
    let n = name.to_ascii_lowercase();
    matches!(n.as_str(), "authorization" | "proxy-authorization" | "cookie" | "set-cookie")
        || PARTS.iter().any(|part| n.contains(part))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_receive_time_text_is_u64_max_in_decimal() {
        assert_eq!(RECEIVED_AT_TEXT_MAX_BYTES, u64::MAX.to_string().len());
    }

    #[test]
    fn credential_headers_are_recognised_case_insensitively() {
        for h in [
            "Authorization",
            "cookie",
            "X-Hub-Signature-256",
            "Stripe-Signature",
            "X-Gitlab-Token",
            "x-api-key",
            "x-auth-token",
            "X-Goog-Api-Key",
            "apikey",
            "x-functions-key",
            "Ocp-Apim-Subscription-Key",
            "x-auth-key",
            "X-Shopify-Hmac-Sha256",
            "x-session-id",
            "x-amz-security-credential",
        ] {
            assert!(is_credential_header(h), "{h}");
        }
        // Delivery ids, partition keys and event names are not credentials.
        for h in [
            "x-github-event",
            "content-type",
            "user-agent",
            "x-request-id",
            "idempotency-key",
            "x-partition-key",
            "x-github-delivery",
            "webhook-id",
        ] {
            assert!(!is_credential_header(h), "{h}");
        }
    }
}
