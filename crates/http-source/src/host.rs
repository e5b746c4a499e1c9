//! The `Host` header every listener asks of a request (RFC 9112, section 3.2).
//!
//! Invariants:
//! - An HTTP/1.1 request without a `Host` header, any request with more than one, and
//!   any whose `Host` is not a host with an optional port are refused 400
//!   `invalid_host` before a route runs: nothing of them is appended, and no
//!   credential of them is checked. HTTP/1.0 may leave it out (its clients predate it:
//!   a load balancer's plain health check).
//! - An empty `Host` is taken: a client sends one when its target has no authority.
//! - The value is never used for anything else: routes, auth and records do not depend
//!   on it, so a refusal here protects the clients of proxies in front, which may read a
//!   request with two hosts differently than this daemon.

use axum::http::{HeaderMap, StatusCode, Version, header};

use crate::error::ApiError;

/// Why a request's `Host` is refused, or `None` when it is taken.
pub fn refusal(version: Version, headers: &HeaderMap) -> Option<ApiError> {
    let mut hosts = headers.get_all(header::HOST).iter();
    let refused = |message: &str| Some(ApiError::new(StatusCode::BAD_REQUEST, "invalid_host", message));
    match (hosts.next(), hosts.next()) {
        (None, _) if version >= Version::HTTP_11 => refused("an HTTP/1.1 request needs a Host header"),
        (None, _) => None,
        (Some(_), Some(_)) => refused("the Host header is given more than once"),
        (Some(host), None) if !is_host(host.as_bytes()) => {
            refused("the Host header is not a host with an optional port")
        }
        (Some(_), None) => None,
    }
}

/// [`refusal`] of `req`, as its answer: closing the connection when the request
/// declared a body, which is not read (`door::before_body`). Both listeners' routers
/// ask it before any route.
pub fn refusal_of(req: &axum::extract::Request) -> Option<ApiError> {
    refusal(req.version(), req.headers()).map(|e| crate::door::before_body(req.headers(), e))
}

/// `uri-host [ ":" port ]` (RFC 9110, section 7.2), or nothing: a registered name of
/// unreserved and sub-delim characters and percent-escapes, an IPv4 address (which the
/// name's characters include), or an IP literal in brackets; then a port of digits.
fn is_host(value: &[u8]) -> bool {
    let (host, port) = match value.strip_prefix(b"[") {
        Some(rest) => match rest.iter().position(|b| *b == b']') {
            Some(end) => {
                let literal = &rest[..end];
                if literal.is_empty() || !literal.iter().all(|b| b.is_ascii_hexdigit() || b":.".contains(b)) {
                    // Not IPv6; IPvFuture (`v1.x`) is left out: no client sends it.
                    return false;
                }
                (None, &rest[end + 1..])
            }
            None => return false,
        },
        None => match value.iter().position(|b| *b == b':') {
            Some(colon) => (Some(&value[..colon]), &value[colon..]),
            None => (Some(value), &b""[..]),
        },
    };
    let name_ok =
        host.is_none_or(|name| name.iter().all(|b| b.is_ascii_alphanumeric() || b"-._~!$&'()*+,;=%".contains(b)));
    let port_ok = match port.strip_prefix(b":") {
        Some(digits) => digits.iter().all(u8::is_ascii_digit),
        None => port.is_empty(),
    };
    name_ok && port_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(hosts: &[&[u8]]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for host in hosts {
            h.append(header::HOST, axum::http::HeaderValue::from_bytes(host).unwrap());
        }
        h
    }

    #[test]
    fn a_missing_host_is_refused_from_http_1_1_on_and_taken_from_http_1_0() {
        assert_eq!(refusal(Version::HTTP_11, &headers(&[])).map(|e| e.code), Some("invalid_host"));
        assert!(refusal(Version::HTTP_10, &headers(&[])).is_none());
        assert!(refusal(Version::HTTP_11, &headers(&[b"example.com"])).is_none());
    }

    #[test]
    fn two_hosts_are_refused_in_any_version() {
        for version in [Version::HTTP_10, Version::HTTP_11] {
            let e = refusal(version, &headers(&[b"a.example", b"a.example"])).expect("two hosts");
            assert_eq!((e.status, e.code), (StatusCode::BAD_REQUEST, "invalid_host"));
        }
    }

    #[test]
    fn a_host_is_a_name_or_address_with_an_optional_port() {
        for good in [
            &b""[..],
            b"localhost",
            b"localhost:8080",
            b"127.0.0.1:8080",
            b"[::1]",
            b"[::1]:8080",
            b"[2001:db8::1]:443",
            b"hooks.example.com",
            b"xn--bcher-kva.example",
            b"a%20b",
            b"host:",
        ] {
            assert!(refusal(Version::HTTP_11, &headers(&[good])).is_none(), "{:?}", String::from_utf8_lossy(good));
        }
        for bad in [
            &b"user@host"[..],
            b"host/path",
            b"a b",
            b"host:80:80",
            b"host:http",
            b"[::1",
            b"[]",
            b"[::1]x",
            b"[v1.x]",
            b"host?",
            b"\xff",
        ] {
            let e = refusal(Version::HTTP_11, &headers(&[bad]));
            assert_eq!(e.map(|e| e.code), Some("invalid_host"), "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
