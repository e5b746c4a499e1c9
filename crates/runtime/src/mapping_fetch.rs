//! Fetching a route's `mapping_url` once at start.
//!
//! Invariants:
//! - A mapping is fetched exactly once, before the daemon opens its log or binds a
//!   listener; it is never refreshed while running (a change needs a restart, so every
//!   event of one run is routed by one table).
//! - Any failure (unreachable, timeout, a status other than 200, a body over
//!   [`MAPPING_MAX_BYTES`], not a JSON object, an entry outside the grammar, an empty
//!   object), or an entry the source's own admission refuses (as an inline table's is at
//!   load), refuses the start with an error naming the key path: an empty mapping is
//!   never a fallback.
//! - Only `http://` URLs: the fetch speaks plain HTTP/1.1 with hyper's client.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use http_source::route::{Mapping, MappingSource, shorten};
use http_source::source::SourceSpec;
use hyper::Uri;
use hyper_util::rt::TokioIo;

/// The largest mapping document accepted.
pub const MAPPING_MAX_BYTES: usize = 16 * 1024 * 1024;

/// How long one fetch may take, connection included.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(10);

/// Checks the URL's form at config load (nothing is fetched).
pub fn check_url(url: &str) -> Result<(), String> {
    parse(url).map(|_| ())
}

struct Target {
    authority: String,
    uri: Uri,
}

/// The URL as an error shows it: credentials in it (`user:password@`, refused below)
/// replaced by `***@`, so that a password never reaches a terminal or a log.
fn shown(url: &str) -> String {
    // Up to the last `@` anywhere: a password may hold `/`, `?` or `#`, which end the
    // authority as a URL parser reads it (`http://u:12/ss@h/m` is host `u`, port 12).
    let scheme_end = url.find("://").map_or(0, |i| i + 3);
    let rest = &url[scheme_end..];
    match rest.rfind('@') {
        Some(at) => format!("{}***{}", &url[..scheme_end], &rest[at..]),
        None => url.to_string(),
    }
}

fn parse(url: &str) -> Result<Target, String> {
    // Refused wherever it stands, before any other check can repeat the URL: an `@`
    // after a password holding `/` is not in the authority as the parser reads it, and
    // the URL would pass, its password then in every log line naming it.
    if url.contains('@') {
        return Err(format!(
            "{:?}: an '@' in the URL is not supported (credentials in a URL would be logged, never sent)",
            shown(url)
        ));
    }
    // From here the URL holds no credentials: it is shown as written.
    let uri: Uri = url.parse().map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!("{url:?}: only http:// URLs are supported"));
    }
    let Some(authority) = uri.authority() else {
        return Err(format!("{url:?} has no host"));
    };
    // The `http` crate takes any digits, or none, as a port (`Authority::port` then says
    // nothing); credentials, which it would take in the authority (and this client send
    // as part of the Host header and print in its log lines), were refused above.
    // The address connected to, checked as `iggy.address` is (HTTP's port when none is
    // written; an IPv6 host, in brackets, holds colons of its own).
    let raw = authority.as_str();
    let after_host = if raw.starts_with('[') { raw.find(']').map_or("", |i| &raw[i + 1..]) } else { raw };
    let authority = if after_host.contains(':') { raw.to_string() } else { format!("{raw}:80") };
    if let Some(why) = crate::host_port::problem(&authority) {
        return Err(format!("{url:?}: {authority:?} {why}"));
    }
    Ok(Target { authority, uri })
}

/// Fetches and parses one mapping.
pub async fn fetch(url: &str) -> Result<Mapping, String> {
    match tokio::time::timeout(FETCH_TIMEOUT, fetch_inner(url)).await {
        Ok(r) => r,
        Err(_) => Err(format!("fetching {url} took longer than {}s", FETCH_TIMEOUT.as_secs())),
    }
}

async fn fetch_inner(url: &str) -> Result<Mapping, String> {
    let target = parse(url)?;
    let stream = tokio::net::TcpStream::connect(&target.authority)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", target.authority))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP handshake with {} failed: {e}", target.authority))?;
    let conn = tokio::spawn(conn);
    // The request target: the path (which `Uri::path` gives as "/" when the URL names
    // none) and the query. `path_and_query` of `http://h?v=2` is "?v=2", no request target.
    let path = match target.uri.query() {
        Some(q) => format!("{}?{q}", target.uri.path()),
        None => target.uri.path().to_string(),
    };
    let host = target.uri.authority().map_or(target.authority.as_str(), |a| a.as_str());
    let request = hyper::Request::get(path.as_str())
        .header(hyper::header::HOST, host)
        .header(hyper::header::ACCEPT, "application/json")
        .body(Empty::new())
        .map_err(|e| format!("cannot build the request for {url}: {e}"))?;
    let response = sender.send_request(request).await.map_err(|e| format!("GET {url} failed: {e}"))?;
    let status = response.status();
    if status != hyper::StatusCode::OK {
        conn.abort();
        return Err(format!("GET {url} answered {status} (expected 200)"));
    }
    let body = Limited::new(response.into_body(), MAPPING_MAX_BYTES)
        .collect()
        .await
        .map_err(|e| format!("reading the answer of {url} failed (over {MAPPING_MAX_BYTES} bytes?): {e}"))?
        .to_bytes();
    conn.abort();
    Mapping::from_json(&body).map_err(|e| format!("the mapping at {url} is refused: {e}"))
}

/// Replaces every route's `mapping_url` with the fetched table. The error names the
/// key path (`sources.<key>.route.mapping_url`) and why. Returns the warnings an inline
/// table would get at `config check`, for the caller to log: a table whose targets, with
/// the source's default and allowlist entries, are more destinations than the source's
/// cap (`max_destinations`, from the source's key), whose records past it are refused.
pub async fn resolve_all(
    sources: &mut [SourceSpec],
    max_destinations: impl Fn(&str) -> usize,
) -> Result<Vec<String>, String> {
    let mut warnings = Vec::new();
    for source in sources {
        let Some(route) = source.destinations.route_mut() else { continue };
        let MappingSource::Url(url) = &route.mapping else { continue };
        let path = crate::config::KeyPath::default().key("sources").key(&source.key).key("route").key("mapping_url");
        let mapping = fetch(url).await.map_err(|e| format!("{path}: {e}"))?;
        let url = url.clone();
        let entries = mapping.len();
        route.mapping = MappingSource::Table(mapping);
        // As an inline table's would be at load: an entry the source's own admission
        // refuses would answer every event routed by it 422.
        let refused = route.entries_refused_by(&source.admission);
        if !refused.is_empty() {
            let named: Vec<String> = refused
                .iter()
                .take(REFUSED_ENTRIES_NAMED_MAX)
                .map(|e| format!("{:?} to {}/{}", shorten(&e.value), e.stream, e.topic))
                .collect();
            let more = refused.len().saturating_sub(named.len());
            let more = if more > 0 { format!(" and {more} more") } else { String::new() };
            return Err(format!(
                "{path}: the mapping at {url} routes {}{more} to a destination the source's admission refuses: \
                 every event routed there would be answered 422",
                named.join(", ")
            ));
        }
        tracing::info!(source = %source.key, url = %url, entries, "route mapping fetched");
        let (named, cap) = (source.destinations_named_in_file().len(), max_destinations(&source.key));
        if named > cap {
            warnings.push(format!(
                "{path}: the mapping at {url} names {named} destinations (its targets, with the source's default and \
                 allowlist entries where counted), more than its max_destinations ({cap}): events to those the cap \
                 does not admit are refused as cap and held, dropped or dead-lettered as on_admission_failure says"
            ));
        }
    }
    Ok(warnings)
}

/// The most refused entries of a fetched mapping an error names (a mapping may hold
/// thousands; the count of the others is said).
pub const REFUSED_ENTRIES_NAMED_MAX: usize = 10;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_http_urls_with_a_host_are_accepted() {
        assert!(check_url("http://127.0.0.1:8000/mapping.json").is_ok());
        assert!(check_url("http://mappings.internal/m").is_ok());
        for bad in [
            "https://x/m",
            "ftp://x/m",
            "/relative",
            "not a url",
            "",
            "http://h:99999/m",
            "http://h:0/m",
            "http://h:/m",
            "http://u:p@h/m",
        ] {
            assert!(check_url(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse("http://h/m").unwrap().authority, "h:80");
        // No error repeats a password written in the URL, whichever check refuses it.
        for with_password in [
            "http://u:s3cret@h/m",
            "https://u:s3cret@h/m",
            "http://u:s3cret@h:99999/m",
            "u:s3cret@h",
            "http://u:12/s3cret@h/m",
            "http://u:s3#cret@h/m",
            "http://u:s3?cret@h/m",
        ] {
            let e = check_url(with_password).unwrap_err();
            assert!(!e.contains("cret"), "{with_password:?}: {e}");
        }
        assert_eq!(shown("http://u:p@h:81/m?q=a"), "http://***@h:81/m?q=a");
        assert_eq!(shown("http://u:12/ss@h/m"), "http://***@h/m");
        assert_eq!(parse("http://[::1]:81/m").unwrap().authority, "[::1]:81");
    }

    /// A source key may hold a dot: the error names it as `config check` does, quoted.
    #[tokio::test]
    async fn a_failed_fetch_names_the_key_path_as_config_check_does() {
        let text = "[sources.\"shop.v2\"]\nroute = { topic_field = \"kind\", default_stream = \"s\", default_topic = \"t\", mapping_url = \"http://127.0.0.1:1/m\" }\n";
        let config = crate::config::parse(text, None).unwrap();
        let mut settings = crate::config::validate(&config, Some(text), None).unwrap();
        let e = resolve_all(&mut settings.sources, |_| 1000).await.unwrap_err();
        assert!(e.starts_with("sources.\"shop.v2\".route.mapping_url: "), "{e}");
    }

    /// A fetched table is counted against the source's cap as an inline one is at
    /// `config check`: more destinations than `max_destinations` is warned of, naming
    /// the key path. Before, a fetched table was never counted.
    #[tokio::test]
    async fn a_fetched_mapping_naming_more_destinations_than_the_cap_is_warned_of() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let body = r#"{"a": {"stream": "s", "topic": "x"}, "b": "y", "c": "z"}"#;
        let app = axum::Router::new().route("/m", axum::routing::get(move || async move { body }));
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let text = format!(
            "[sources.web]\nroute = {{ topic_field = \"kind\", default_stream = \"web\", default_topic = \"misc\", mapping_url = \"http://{addr}/m\" }}\n"
        );
        let config = crate::config::parse(&text, None).unwrap();
        let settings = crate::config::validate(&config, Some(&text), None).unwrap();
        let mut sources = settings.sources.clone();
        let warnings = resolve_all(&mut sources, |key| if key == "web" { 3 } else { 1000 }).await.unwrap();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with("sources.web.route.mapping_url: ") && warnings[0].contains("names 4"),
            "{}",
            warnings[0]
        );
        let mut sources = settings.sources;
        assert_eq!(resolve_all(&mut sources, |_| 4).await.unwrap(), Vec::<String>::new());
    }

    /// A URL with a query and no path is fetched from `/` with its query. Before, its
    /// request target was the query alone, which no request can carry: every start
    /// failed, although `config check` took the URL.
    #[tokio::test]
    async fn a_url_with_a_query_and_no_path_is_fetched_from_the_root() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(|q: axum::extract::RawQuery| async move {
                if q.0.as_deref() == Some("v=2") { r#"{"a": "b"}"# } else { "{}" }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let url = format!("http://{addr}?v=2");
        assert!(check_url(&url).is_ok());
        let mapping = fetch(&url).await.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(mapping.len(), 1);
        assert!(fetch(&format!("http://{addr}")).await.unwrap_err().contains("empty"));
    }
}
