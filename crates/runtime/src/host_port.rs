//! `HOST:PORT`, the address a TCP client connects to: `iggy.address` (the iggy client
//! hands its text to `tokio::net::TcpStream::connect`), the admin URL of
//! `wal inspect --admin` and a route's `mapping_url` (connected to the same way).
//!
//! What such a connect takes, and so what is accepted here: an IP address or a host
//! name, a colon, and a port. An IPv6 address goes in brackets (`[::1]:8090`; a
//! numeric zone, `[fe80::1%2]:8090`, is taken too); without them its last group would
//! be read as the port. A host name is letters, digits, `-` and `_` in dot-separated
//! labels (a trailing dot, the fully qualified form, is allowed), at most 253 bytes.
//! Port 0 names no server: a connect to it always fails.
//!
//! Whether the name resolves is not checked: that belongs to the moment of connecting
//! (DNS changes; the daemon holds events while the server is away).

use std::net::SocketAddr;

/// The longest host name DNS can carry, without its trailing dot.
const HOST_NAME_MAX_BYTES: usize = 253;

/// The form, said after every reason.
pub const FORM: &str = "expected HOST:PORT (a host name or IP address, IPv6 in brackets, and a port from 1 to 65535)";

/// `Ok` when `s` is `HOST:PORT` as described above, else why not and the expected form
/// (a phrase that follows the value in a message).
pub fn check(s: &str) -> Result<(), String> {
    problem(s).map_or(Ok(()), |why| Err(format!("{why}; {FORM}")))
}

/// Why `s` is not `HOST:PORT` (a phrase that follows the value), or `None` when it is.
pub fn problem(s: &str) -> Option<String> {
    if s.contains("://") {
        return Some("is a URL, not an address (no scheme)".into());
    }
    if s.starts_with('[') {
        return match s.parse::<SocketAddr>() {
            Ok(addr) => port(addr.port()),
            Err(_) => Some("is not [IPv6 ADDRESS]:PORT".into()),
        };
    }
    let Some((host, p)) = s.rsplit_once(':') else { return Some("has no port".into()) };
    if host.contains(':') {
        return Some("looks like an IPv6 address without brackets ([ADDRESS]:PORT)".into());
    }
    if host.is_empty() {
        return Some("has no host".into());
    }
    if !is_host_name(host) {
        return Some(format!("has {host:?} for a host, which is not a host name or IP address"));
    }
    if looks_numeric(host) && host.parse::<std::net::Ipv4Addr>().is_err() {
        // The resolver reads such a "name" as an address in its own way: 010.0.0.1 in
        // octal (8.0.0.1), 2130706433 and 0x7f.1 as 127.0.0.1.
        return Some(format!(
            "has {host:?} for a host, which a resolver would read as an IPv4 address other than the one it looks like \
             (write four decimal numbers, 0 to 255, without leading zeros)"
        ));
    }
    if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
        return Some(format!("has {p:?} for a port, which is not a number"));
    }
    match p.parse() {
        Ok(p) => port(p),
        Err(_) => Some(format!("has port {p}, more than 65535")),
    }
}

fn port(p: u16) -> Option<String> {
    (p == 0).then(|| "has port 0, which names no server (a connection to it always fails)".into())
}

/// Whether a resolver takes `host` for an IPv4 address in some notation: its last label
/// (DNS has no numeric top-level domain) is a number, decimal or `0x` hex.
fn looks_numeric(host: &str) -> bool {
    let name = host.strip_suffix('.').unwrap_or(host);
    let last = name.rsplit('.').next().unwrap_or(name);
    let hex = last.strip_prefix("0x").or_else(|| last.strip_prefix("0X"));
    match hex {
        Some(digits) => !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_hexdigit()),
        None => !last.is_empty() && last.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// A host name or an IPv4 address (digits and dots are a valid name too).
fn is_host_name(host: &str) -> bool {
    let name = host.strip_suffix('.').unwrap_or(host);
    !name.is_empty()
        && name.len() <= HOST_NAME_MAX_BYTES
        && name.split('.').all(|label| {
            !label.is_empty() && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_tcp_connect_takes_is_accepted() {
        for ok in [
            "127.0.0.1:8090",
            "10.0.0.7:1",
            "localhost:8090",
            "iggy:65535",
            "iggy.internal:8090",
            "iggy-0.iggy.default.svc.cluster.local.:8090",
            "my_host:8090",
            "[::1]:8090",
            "[2001:db8::7]:8090",
            "[fe80::1%2]:8090",
            "0.0.0.0:8090",
            "iggy.0x:8090",
            "10x.internal:8090",
        ] {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn anything_else_is_refused_with_the_reason() {
        for (bad, why) in [
            ("", "no port"),
            ("not an address", "no port"),
            ("127.0.0.1", "no port"),
            ("iggy.internal", "no port"),
            ("127.0.0.1:0", "port 0"),
            ("[::1]:0", "port 0"),
            ("127.0.0.1:65536", "65535"),
            ("127.0.0.1:99999999999999999999", "65535"),
            ("127.0.0.1:", "not a number"),
            ("127.0.0.1:+80", "not a number"),
            ("127.0.0.1:80x", "not a number"),
            (":8090", "no host"),
            ("::1:8090", "brackets"),
            ("[::1]", "[IPv6 ADDRESS]:PORT"),
            ("[::1]8090", "[IPv6 ADDRESS]:PORT"),
            ("[iggy]:8090", "[IPv6 ADDRESS]:PORT"),
            ("[fe80::1%eth0]:8090", "[IPv6 ADDRESS]:PORT"),
            ("not an address:8090", "not a host name"),
            ("http://iggy:8090", "no scheme"),
            ("iggy/x:8090", "not a host name"),
            ("iggy..internal:8090", "not a host name"),
            (".:8090", "not a host name"),
            ("ïggy:8090", "not a host name"),
            // Read by the resolver as another address than they look like.
            ("010.0.0.1:8090", "IPv4 address other than"),
            ("2130706433:8090", "IPv4 address other than"),
            ("0x7f.1:8090", "IPv4 address other than"),
            ("127.1:8090", "IPv4 address other than"),
            ("256.0.0.1:8090", "IPv4 address other than"),
        ] {
            let e = check(bad).expect_err(bad);
            assert!(e.contains(why) && e.contains(FORM), "{bad:?}: {e}");
        }
        let long = format!("{}:8090", "a.".repeat(130));
        assert!(check(&long).is_err(), "a name over 253 bytes");
    }
}
