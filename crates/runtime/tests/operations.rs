//! What an operator runs against: the daemon's `/metrics` from its first scrape, the
//! Grafana dashboard and Prometheus alerts in `config/` checked against a real scrape,
//! and the admin API's token.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use test_broker::{TestBroker, TestBrokerConfig};

const ADMIN_TOKEN: &str = "test-admin-reader-token-42";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn sources(broker: SocketAddr) -> String {
    format!(
        r#"
[iggy]
address = "{broker}"
reconnection_interval_ms = 100

[router]
linger_ms = 1

[sources.default]
destination = {{ stream = "ingest", topic = "events" }}

[sources.shop]
accept = "json"
auth_type = "bearer"
auth_secret = "shop-secret-token"
destination = {{ stream = "shop", topic = "orders" }}
"#
    )
}

async fn scrape(admin: SocketAddr, headers: &[(&str, &str)]) -> String {
    let a = request(admin, "GET", "/metrics", headers, "").await;
    assert_eq!(a.status, 200, "{:?}", String::from_utf8_lossy(&a.body));
    String::from_utf8(a.body.to_vec()).expect("metrics are UTF-8")
}

/// One sample of a scrape: its name as written (`_bucket` etc. included) and labels.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

fn parse_scrape(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("bad value: {line}"));
        let (name, labels) = match series.split_once('{') {
            None => (series.to_string(), BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').unwrap_or_else(|| panic!("unclosed labels: {line}"));
                let mut labels = BTreeMap::new();
                // Label values here are source keys and fixed reasons: no commas or quotes.
                for pair in body.split(',').filter(|p| !p.is_empty()) {
                    let (k, v) = pair.split_once('=').unwrap_or_else(|| panic!("bad label: {line}"));
                    labels.insert(k.to_string(), v.trim_matches('"').to_string());
                }
                (name.to_string(), labels)
            }
        };
        out.push(Sample { name, labels, value });
    }
    out
}

fn value(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| s.name == name && labels.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
        .map(|s| s.value)
}

/// A webhook listener at its connection cap shows it: the open connections, and the
/// accepts that had to wait for a slot (the waiting clients sit in the kernel's backlog,
/// where nothing else sees them). Closed connections are taken back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_at_its_connection_cap_shows_it_in_its_metrics() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path(), "max_connections = 2", &sources(broker.addr()));
    let connections = || async {
        let samples = parse_scrape(&scrape(d.admin, &[]).await);
        let open = value(&samples, "iggy_ingest_http_connections", &[("listener", "webhook")]);
        let waits = value(&samples, "iggy_ingest_http_connection_waits_total", &[("listener", "webhook")]);
        (open.unwrap_or(-1.0), waits.unwrap_or(-1.0))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let until = |want: (f64, f64)| {
        let connections = &connections;
        async move {
            while connections().await != want {
                assert!(std::time::Instant::now() < deadline, "want {want:?}, have {:?}", connections().await);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    assert_eq!(connections().await, (0.0, 0.0));
    // Two idle connections take both slots. One closing with nobody waiting is no wait.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(tokio::net::TcpStream::connect(d.http).await.unwrap());
    }
    until((2.0, 0.0)).await;
    held.pop();
    until((1.0, 0.0)).await;
    held.push(tokio::net::TcpStream::connect(d.http).await.unwrap());
    until((2.0, 0.0)).await;
    // A third waits in the backlog: counted as it gets the slot one of the two frees.
    let waiting = tokio::net::TcpStream::connect(d.http).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(connections().await, (2.0, 0.0), "the third waits, not yet counted");
    held.pop();
    until((2.0, 1.0)).await;
    drop(held);
    drop(waiting);
    until((0.0, 1.0)).await;
    assert!(d.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_scrape_describes_every_metric_the_daemon_exports() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The webhook listener on TLS, whose series exist only then.
    let (cert, key) = TlsPair::new().write(&dir.path().join("tls"));
    let tls = format!("[http.tls]\ncert_file = {cert:?}\nkey_file = {key:?}\n");
    let d = Daemon::start(dir.path(), &tls, &sources(broker.addr()));
    let text = scrape(d.admin, &[]).await;
    for metric in iggy_ingest::telemetry::catalog() {
        assert!(text.contains(&format!("# HELP {} ", metric.name)), "no HELP for {}:\n{text}", metric.name);
        assert!(
            text.contains(&format!("# TYPE {} {}\n", metric.name, metric.kind.as_str())),
            "{} is not exported as a {}:\n{text}",
            metric.name,
            metric.kind.as_str()
        );
    }
    let samples = parse_scrape(&text);
    // Zero series for every configured source, before any request.
    for source in ["default", "shop"] {
        assert_eq!(value(&samples, "iggy_ingest_events_accepted_total", &[("source", source)]), Some(0.0));
        assert_eq!(
            value(&samples, "iggy_ingest_http_rejected_total", &[("source", source), ("reason", "log_full")]),
            Some(0.0)
        );
        assert_eq!(value(&samples, "iggy_connector_messages_routed_total", &[("connector_key", source)]), Some(0.0));
    }
    // The log's gauges are set by its opening, not left at the registered zero.
    assert_eq!(value(&samples, "iggy_ingest_wal_capacity_bytes", &[]), Some(8_589_934_592.0));
    // TLS series for the listener that serves it, none for the one that does not.
    assert_eq!(value(&samples, "iggy_ingest_tls_reload_failed", &[("listener", "webhook")]), Some(0.0));
    assert_eq!(value(&samples, "iggy_ingest_tls_reload_failed", &[("listener", "admin")]), None);
    assert!(d.stop().success());
}

/// Every expression of the dashboard (panel targets and template queries).
fn dashboard_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(o) => {
            for (k, x) in o {
                match (k.as_str(), x) {
                    ("expr" | "definition", serde_json::Value::String(s)) => out.push(s.clone()),
                    ("query", serde_json::Value::String(s)) if s.contains('(') => out.push(s.clone()),
                    _ => dashboard_exprs(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| dashboard_exprs(x, out)),
        _ => {}
    }
}

/// `(alert name, expr)` of every rule in the alert file. The file keeps one shape (a
/// rule starts with `- alert:`; `expr:` is a one-line value or a `|` block), which this
/// checks as it reads.
fn alert_exprs(text: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out: Vec<(String, String)> = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i].trim_start();
        if let Some(name) = line.strip_prefix("- alert:") {
            out.push((name.trim().to_string(), String::new()));
        } else if let Some(rest) = line.strip_prefix("expr:") {
            let (_, expr) = out.last_mut().unwrap_or_else(|| panic!("line {}: expr before any alert", i + 1));
            assert!(expr.is_empty(), "line {}: a second expr in one rule", i + 1);
            let rest = rest.trim();
            if rest == "|" {
                let indent = lines[i].len() - line.len();
                let mut block = Vec::new();
                while i + 1 < lines.len() {
                    let next = lines[i + 1];
                    if !next.trim().is_empty() && next.len() - next.trim_start().len() <= indent {
                        break;
                    }
                    block.push(next.trim());
                    i += 1;
                }
                *expr = block.join("\n").trim().to_string();
            } else {
                *expr = rest.to_string();
            }
        }
        i += 1;
    }
    for (name, expr) in &out {
        assert!(!expr.is_empty(), "alert {name} has no expr");
    }
    out
}

/// Names Prometheus writes itself, which the daemon does not export.
const PROMETHEUS_OWN: &[&str] = &["up"];

/// PromQL words that may precede `(` or stand alone; never metric names.
fn is_identifier_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b':'
}

/// Brackets and quotes outside string literals pair up.
fn balanced(expr: &str) -> Result<(), String> {
    let mut stack = Vec::new();
    let mut in_string = false;
    for (i, c) in expr.char_indices() {
        match c {
            '"' => in_string = !in_string,
            _ if in_string => {}
            '(' | '{' | '[' => stack.push(c),
            ')' | '}' | ']' => {
                let open = match c {
                    ')' => '(',
                    '}' => '{',
                    _ => '[',
                };
                if stack.pop() != Some(open) {
                    return Err(format!("unmatched {c:?} at byte {i}"));
                }
            }
            _ => {}
        }
    }
    match (in_string, stack.last()) {
        (true, _) => Err("unclosed string".into()),
        (false, Some(c)) => Err(format!("unclosed {c:?}")),
        (false, None) => Ok(()),
    }
}

/// Checks one expression against a scrape; returns the problems found.
fn check_expr(expr: &str, samples: &[Sample]) -> Vec<String> {
    let mut problems = Vec::new();
    if let Err(e) = balanced(expr) {
        problems.push(e);
    }
    let bytes = expr.as_bytes();
    let mut used_metrics: Vec<String> = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        // Skip string literals (label values, template text).
        if bytes[i] == b'"' {
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += 1;
            }
            i += 1;
            continue;
        }
        if !is_identifier_byte(bytes[i]) || (i > 0 && is_identifier_byte(bytes[i - 1])) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && is_identifier_byte(bytes[i]) {
            i += 1;
        }
        let word = &expr[start..i];
        let after = expr[i..].trim_start();
        let selector = after.starts_with('{') || after.starts_with('[');
        let ours = word.starts_with("iggy_");
        if !ours {
            if selector && !PROMETHEUS_OWN.contains(&word) && !word.starts_with('$') {
                problems.push(format!("{word} is not a metric of the daemon"));
            }
            continue;
        }
        let series: Vec<&Sample> = samples.iter().filter(|s| s.name == word).collect();
        if series.is_empty() {
            problems.push(format!("{word} is not in the daemon's /metrics"));
            continue;
        }
        used_metrics.push(word.to_string());
        let Some(body) = after.strip_prefix('{') else { continue };
        let Some(end) = body.find('}') else {
            problems.push(format!("{word}: unclosed selector"));
            continue;
        };
        for matcher in body[..end].split(',').map(str::trim).filter(|m| !m.is_empty()) {
            let op_at = matcher.find(['=', '!']).unwrap_or(matcher.len());
            let label = matcher[..op_at].trim();
            let rest = &matcher[op_at..];
            let (op, val) = ["=~", "!~", "!=", "="]
                .iter()
                .find_map(|op| rest.strip_prefix(op).map(|v| (*op, v.trim().trim_matches('"'))))
                .unwrap_or(("?", ""));
            if ["instance", "job"].contains(&label) {
                continue;
            }
            if !series.iter().any(|s| s.labels.contains_key(label)) {
                problems.push(format!("{word} has no label {label}"));
                continue;
            }
            let wanted: Vec<&str> = match op {
                "=" => vec![val],
                "=~" => val.split('|').collect(),
                _ => Vec::new(),
            };
            for w in wanted.into_iter().filter(|w| w.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')) {
                if !series.iter().any(|s| s.labels.get(label).map(String::as_str) == Some(w)) {
                    problems.push(format!("{word} has no series with {label}=\"{w}\""));
                }
            }
        }
    }
    // Grouping labels must exist on some metric the expression reads.
    for (at, _) in expr.match_indices("by (").chain(expr.match_indices("on (")) {
        let list = &expr[at + 4..];
        let list = &list[..list.find(')').unwrap_or(list.len())];
        for label in list.split(',').map(str::trim).filter(|l| !l.is_empty()) {
            if ["instance", "job"].contains(&label) {
                continue;
            }
            let found = samples.iter().any(|s| used_metrics.contains(&s.name) && s.labels.contains_key(label));
            if !found {
                problems.push(format!("grouping label {label} is on none of {used_metrics:?}"));
            }
        }
    }
    if used_metrics.is_empty() && !expr.contains("up{") {
        problems.push("uses no metric of the daemon".into());
    }
    problems
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_the_alerts_use_only_what_the_daemon_exports() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The webhook listener on TLS: the TLS alerts read series that exist only then.
    let pair = TlsPair::new();
    let (cert, key) = pair.write(&dir.path().join("tls"));
    let tls = format!("[http.tls]\ncert_file = {cert:?}\nkey_file = {key:?}\n");
    let d = Daemon::start(dir.path(), &tls, &sources(broker.addr()));

    // A little traffic: accepted events, a refused auth, a wrong content type.
    // A connection each: a 401 given by the head closes its connection.
    let post = async |path: &str, headers: &[(&str, &str)], body: String| {
        let (mut conn, _) = Conn::open_tls(d.http, &[&pair]).await.unwrap();
        conn.send("POST", path, headers, body).await.unwrap().status
    };
    let json = [("content-type", "application/json")];
    for n in 0..3 {
        assert_eq!(post("/v1/sources/default", &json, format!("{{\"n\":{n}}}")).await, 200);
    }
    let auth = [("content-type", "application/json"), ("authorization", "Bearer shop-secret-token")];
    assert_eq!(post("/v1/sources/shop", &auth, "{\"order\":1}".into()).await, 200);
    assert_eq!(post("/v1/sources/shop", &json, "{}".into()).await, 401);
    let text_body = [("content-type", "text/plain"), ("authorization", "Bearer shop-secret-token")];
    assert_eq!(post("/v1/sources/shop", &text_body, "x".into()).await, 415);
    let deadline = Instant::now() + Duration::from_secs(30);
    let samples = loop {
        let samples = parse_scrape(&scrape(d.admin, &[]).await);
        let routed = value(&samples, "iggy_connector_messages_routed_total", &[("connector_key", "default")]);
        if routed == Some(3.0) {
            break samples;
        }
        assert!(Instant::now() < deadline, "the three events were not delivered: {routed:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // The traffic moved the real counters, not only the registered zeros.
    assert_eq!(value(&samples, "iggy_ingest_events_accepted_total", &[("source", "default")]), Some(3.0));
    assert_eq!(
        value(&samples, "iggy_ingest_auth_failures_total", &[("source", "shop"), ("reason", "auth_missing")]),
        Some(1.0)
    );
    assert_eq!(
        value(&samples, "iggy_ingest_http_rejected_total", &[("source", "shop"), ("reason", "unsupported_media_type")]),
        Some(1.0)
    );
    assert!(value(&samples, "iggy_ingest_wal_fsync_seconds_count", &[]).is_some_and(|n| n >= 2.0));
    assert!(value(&samples, "iggy_ingest_wal_fsync_seconds_bucket", &[("le", "+Inf")]).is_some_and(|n| n >= 2.0));
    assert_eq!(value(&samples, "iggy_connector_router_running", &[]), Some(1.0));
    // Each connector's delivery status, as /status says it.
    let status_of = |key: &str, status: &str| {
        value(&samples, "iggy_connector_delivery_status", &[("connector_key", key), ("status", status)])
    };
    assert_eq!((status_of("default", "running"), status_of("default", "degraded")), (Some(1.0), Some(0.0)));
    let listed = request(d.admin, "GET", "/status", &[], "").await.json();
    assert_eq!(listed["sources"]["default"]["delivery"], "running", "{listed}");

    let dashboard_text = std::fs::read_to_string(repo().join("config/grafana/iggy-ingest.json")).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&dashboard_text).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    dashboard_exprs(&dashboard, &mut exprs);
    assert!(exprs.len() >= 30, "too few expressions found in the dashboard: {exprs:?}");
    let alerts_text = std::fs::read_to_string(repo().join("config/prometheus/alerts.yml")).unwrap();
    let alerts = alert_exprs(&alerts_text);
    assert!(alerts.len() >= 15, "too few alerts found: {alerts:?}");

    let mut problems = Vec::new();
    for e in &exprs {
        problems.extend(check_expr(e, &samples).into_iter().map(|p| format!("dashboard `{e}`: {p}")));
    }
    for (name, e) in &alerts {
        problems.extend(check_expr(e, &samples).into_iter().map(|p| format!("alert {name}: {p}")));
    }
    // The alert tests' made-up series use names and label values the daemon emits, so
    // a passing `promtool test rules` speaks of series that can exist. Source and
    // connector keys are the test's own; every other label value must be a real one.
    let tests_text = std::fs::read_to_string(repo().join("config/prometheus/alerts_test.yml")).unwrap();
    let test_series = test_input_series(&tests_text);
    assert!(test_series.len() >= 15, "too few input series found: {test_series:?}");
    for (name, labels) in test_series.iter().filter(|(name, _)| name != "up") {
        let series: Vec<&Sample> = samples.iter().filter(|s| &s.name == name).collect();
        if series.is_empty() {
            problems.push(format!("alerts_test.yml: the daemon has no series {name}"));
            continue;
        }
        for (label, val) in labels {
            if ["job", "instance", "source", "connector_key", "stream", "topic", "destination"]
                .contains(&label.as_str())
            {
                continue;
            }
            if !series.iter().any(|s| s.labels.get(label) == Some(val)) {
                problems.push(format!("alerts_test.yml: {name} has no series with {label}=\"{val}\""));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));

    // What the brief asks the alerts to watch, by metric.
    let all_alert_text: String = alerts.iter().map(|(_, e)| e.as_str()).collect::<Vec<_>>().join("\n");
    for watched in [
        "iggy_ingest_wal_used_bytes",
        "iggy_connector_oldest_held_age_seconds",
        "iggy_connector_router_degraded",
        "iggy_connector_destination_circuit_open",
        "iggy_ingest_wal_fsync_seconds_bucket",
        "iggy_ingest_http_requests_total",
        "iggy_ingest_wal_full_rejections_total",
    ] {
        assert!(all_alert_text.contains(watched), "no alert watches {watched}");
    }
    assert!(d.stop().success());
}

/// The `input_series` of a promtool rule-test file: each series' metric name and labels.
fn test_input_series(text: &str) -> Vec<(String, BTreeMap<String, String>)> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("- series:"))
        .map(|l| {
            let l = l.trim().trim_matches('\'');
            let (name, rest) = l.split_once('{').unwrap_or((l, "}"));
            let labels = rest
                .trim_end_matches('}')
                .split(',')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.trim().to_string(), v.trim().trim_matches('"').to_string()))
                .collect();
            (name.trim().to_string(), labels)
        })
        .collect()
}

#[test]
fn every_alert_names_its_severity_and_a_runbook_section_that_exists() {
    let text = std::fs::read_to_string(repo().join("config/prometheus/alerts.yml")).unwrap();
    let ops = std::fs::read_to_string(repo().join("docs/operations.md")).unwrap();
    // GitHub's anchors: lower-case, spaces to '-', punctuation other than '-' dropped.
    let anchors: BTreeSet<String> = ops
        .lines()
        .filter_map(|l| l.strip_prefix("## ").or_else(|| l.strip_prefix("### ")))
        .map(|h| {
            h.to_lowercase()
                .chars()
                .filter_map(|c| match c {
                    ' ' => Some('-'),
                    c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
                    _ => None,
                })
                .collect()
        })
        .collect();
    let rules: Vec<&str> = text.split("- alert:").skip(1).collect();
    assert!(rules.len() >= 15);
    for rule in rules {
        let name = rule.lines().next().unwrap_or_default().trim();
        let severity = rule.lines().find_map(|l| l.trim().strip_prefix("severity:")).map(str::trim);
        assert!(matches!(severity, Some("critical" | "warning" | "info")), "{name}: severity {severity:?}");
        let runbook = rule
            .lines()
            .find_map(|l| l.trim().strip_prefix("runbook:"))
            .unwrap_or_else(|| panic!("{name} has no runbook"))
            .trim()
            .trim_matches('"');
        let anchor = runbook
            .strip_prefix("docs/operations.md#")
            .unwrap_or_else(|| panic!("{name}: runbook {runbook} is not a section of docs/operations.md"));
        assert!(anchors.contains(anchor), "{name}: docs/operations.md has no section #{anchor} ({anchors:?})");
    }
}

/// Prometheus's own parser, when the machine has Python's YAML module: the file is YAML
/// of the rule-file shape, and the line reader above saw every rule.
#[test]
fn the_alert_file_is_yaml_of_the_rule_file_shape() {
    let path = repo().join("config/prometheus/alerts.yml");
    let script = "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))";
    let out = match std::process::Command::new("python3").arg("-c").arg(script).arg(&path).output() {
        Ok(o) if o.status.success() => o,
        _ => {
            skip_or_fail(
                "the_alert_file_is_yaml_of_the_rule_file_shape",
                "python3 with the yaml module is not available (Debian: apt-get install python3-yaml)",
            );
            return;
        }
    };
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let groups = doc["groups"].as_array().expect("groups");
    let mut seen = Vec::new();
    for g in groups {
        assert!(g["name"].is_string(), "{g}");
        for rule in g["rules"].as_array().expect("rules") {
            let keys: BTreeSet<&str> = rule.as_object().expect("rule").keys().map(String::as_str).collect();
            let allowed: BTreeSet<&str> = ["alert", "expr", "for", "labels", "annotations"].into();
            assert!(keys.is_subset(&allowed), "unexpected keys in {rule}");
            let f = rule["for"].as_str().unwrap_or("0s");
            assert!(f.ends_with('m') || f.ends_with('s') || f.ends_with('h'), "{rule}");
            seen.push((
                rule["alert"].as_str().expect("alert").to_string(),
                rule["expr"].as_str().expect("expr").trim().to_string(),
            ));
        }
    }
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(seen, alert_exprs(&text), "the line reader and the YAML parser disagree");
}

/// Prometheus's own tool: the rules load (`promtool check rules`), and the unit tests in
/// `config/prometheus/alerts_test.yml` (synthetic series; which alert fires, with which
/// labels and annotations, at which minute) pass. Skipped, saying so, where promtool is
/// not installed, unless `IGGY_INGEST_REQUIRE_ALL_CHECKS` is set (CI installs it and sets it).
#[test]
fn the_alert_rules_load_in_prometheus_and_pass_their_unit_tests() {
    let dir = repo().join("config/prometheus");
    let run = |args: &[&str]| std::process::Command::new("promtool").args(args).current_dir(&dir).output();
    let check = match run(&["check", "rules", "alerts.yml"]) {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            skip_or_fail(
                "the_alert_rules_load_in_prometheus_and_pass_their_unit_tests",
                "promtool is not installed (Debian: apt-get install prometheus)",
            );
            return;
        }
        Err(e) => panic!("promtool could not be run: {e}"),
    };
    let said = |o: &std::process::Output| {
        format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
    };
    assert!(check.status.success(), "promtool check rules:\n{}", said(&check));
    let test = run(&["test", "rules", "alerts_test.yml"]).expect("promtool ran a moment ago");
    assert!(test.status.success(), "promtool test rules:\n{}", said(&test));
    // Every alert of the file is exercised by at least one unit test.
    let tests = std::fs::read_to_string(dir.join("alerts_test.yml")).unwrap();
    let rules = std::fs::read_to_string(dir.join("alerts.yml")).unwrap();
    let untested: Vec<String> = alert_exprs(&rules)
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| !tests.contains(&format!("alertname: {name}\n")))
        .collect();
    assert!(untested.is_empty(), "alerts without a unit test in alerts_test.yml: {untested:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_guards_every_route_but_health() {
    let dir = tempfile::tempdir().unwrap();
    let rest = "[sources.default]\ndestination = { stream = \"ingest\", topic = \"events\" }\n\
                [router]\nenabled = false\n";
    let text = config_text(dir.path(), "", rest).replace("[admin]\n", &format!("[admin]\ntoken = \"{ADMIN_TOKEN}\"\n"));
    let d = Daemon::start_text(dir.path(), &text);
    let reader = format!("Bearer {ADMIN_TOKEN}");
    let manager = format!("Bearer {MANAGEMENT_TOKEN}");
    let mut refused = 0;

    let a = request(d.admin, "GET", "/health", &[], "").await;
    assert_eq!(a.status, 200, "/health needs no token");
    for path in ["/status", "/metrics", "/connectors/default", "/connectors/default/destinations", "/nowhere"] {
        for headers in [
            vec![],
            vec![("authorization", "Bearer wrong-token-0123456789")],
            vec![("authorization", ADMIN_TOKEN)], // no scheme
            vec![("authorization", "Basic dXNlcjpwYXNz")],
        ] {
            let a = request(d.admin, "GET", path, &headers, "").await;
            assert_eq!(a.status, 401, "{path} {headers:?}");
            assert_eq!(a.json()["error"], "unauthorized", "{path}");
            assert_eq!(a.header("www-authenticate"), Some("Bearer realm=\"iggy-ingest admin\""));
            refused += 1;
        }
        let expected = if path == "/nowhere" { 404 } else { 200 };
        let lower = format!("bearer {ADMIN_TOKEN}");
        // As the webhook door's bearer scheme takes it: the name in any case, blanks
        // around the token.
        let spaced = format!("BEARER  {ADMIN_TOKEN} ");
        for token in [&reader, &manager, &lower, &spaced] {
            let a = request(d.admin, "GET", path, &[("authorization", token)], "").await;
            assert_eq!(a.status, expected, "{path} with {token}: {:?}", String::from_utf8_lossy(&a.body));
        }
    }
    // The reader token does not manage endpoints; the management token does.
    let a = request(d.admin, "GET", "/v1/endpoints", &[("authorization", &reader)], "").await;
    assert_eq!((a.status, a.json()["error"].as_str()), (401, Some("unauthorized")));
    refused += 1;
    let a = request(d.admin, "GET", "/v1/endpoints", &[("authorization", &manager)], "").await;
    assert_eq!(a.status, 200);

    let samples = parse_scrape(&scrape(d.admin, &[("authorization", &reader)]).await);
    assert_eq!(value(&samples, "iggy_ingest_admin_auth_failures_total", &[]), Some(f64::from(refused)));
    // The webhook listener is not behind the admin token.
    assert_eq!(post_json(d.http, "/v1/sources/default", "{}").await.status, 200);
    assert!(d.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_admin_routes_stay_open_on_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let rest = "[sources.default]\ndestination = { stream = \"ingest\", topic = \"events\" }\n\
                [router]\nenabled = false\n";
    let d = Daemon::start(dir.path(), "", rest);
    for path in ["/health", "/status", "/metrics"] {
        assert_eq!(request(d.admin, "GET", path, &[], "").await.status, 200, "{path}");
    }
    // Endpoint management still needs its own token.
    assert_eq!(request(d.admin, "GET", "/v1/endpoints", &[], "").await.status, 401);
    assert!(d.stop().success());
}

fn config_check(text: &str) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(&path, text).unwrap();
    std::process::Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["config", "check"])
        .arg(&path)
        .env_remove("IGGY_INGEST_ADMIN_TOKEN")
        .output()
        .unwrap()
}

#[test]
fn a_public_admin_address_without_a_token_is_refused_naming_the_key() {
    let source = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n";
    let out = config_check(&format!("[admin]\nlisten = \"0.0.0.0:9180\"\n{source}"));
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 2: admin.listen:"), "{err}");
    assert!(err.contains("admin.token") && err.contains("admin.allow_unauthenticated_remote"), "{err}");

    let out =
        config_check(&format!("[admin]\nlisten = \"0.0.0.0:9180\"\nallow_unauthenticated_remote = true\n{source}"));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out = config_check(&format!("[admin]\nlisten = \"0.0.0.0:9180\"\ntoken = \"{ADMIN_TOKEN}\"\n{source}"));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let out =
        config_check(&format!("[admin]\nlisten = \"0.0.0.0:9180\"\ntoken_env = \"IGGY_INGEST_ADMIN_TOKEN\"\n{source}"));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("admin.token_env"), "the missing variable is named");
}

#[test]
fn the_operations_guide_lists_every_metric() {
    let doc = std::fs::read_to_string(repo().join("docs/operations.md")).unwrap();
    for metric in iggy_ingest::telemetry::catalog() {
        // The status gauges are documented as one pattern per family.
        let documented = ["iggy_connector_router_", "iggy_connector_destinations_"]
            .iter()
            .find(|p| {
                metric
                    .name
                    .strip_prefix(**p)
                    .is_some_and(|s| ["starting", "running", "degraded", "error", "stopping", "stopped"].contains(&s))
            })
            .map_or(format!("`{}", metric.name), |p| format!("`{p}{{status}}`"));
        // The whole name: followed by its labels or the end of the code span, so that a
        // longer name sharing its prefix does not count.
        let listed = if documented.ends_with('`') {
            doc.contains(&documented)
        } else {
            [format!("{documented}`"), format!("{documented}{{")].iter().any(|w| doc.contains(w.as_str()))
        };
        assert!(listed, "docs/operations.md does not list {}", metric.name);
    }
}

/// Every metric a guide's table names (`| `name{labels}` | ...`) is written with the
/// labels its series carry, and docs/delivery.md lists every metric of the router: a
/// label a dashboard or an alert must aggregate over (or may filter on) is never left out.
#[test]
fn the_guides_name_each_metric_with_the_labels_it_carries() {
    let catalog: BTreeMap<String, BTreeSet<&str>> =
        iggy_ingest::telemetry::catalog().into_iter().map(|m| (m.name, m.labels.iter().copied().collect())).collect();
    let mut listed: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    let mut unknown: Vec<String> = Vec::new();
    for doc in ["docs/operations.md", "docs/delivery.md", "docs/routing.md"] {
        let text = std::fs::read_to_string(repo().join(doc)).unwrap();
        for line in text.lines() {
            let Some(cell) = line.strip_prefix("| `").and_then(|l| l.split('`').next()) else { continue };
            let (name, labels) = match cell.split_once('{') {
                Some((name, rest)) => (name, rest.trim_end_matches('}').split(',').filter(|l| !l.is_empty()).collect()),
                None => (cell, BTreeSet::new()),
            };
            // The status gauges are one pattern per family, with the status in the name
            // (`iggy_connector_router_{status}`).
            if name.ends_with('_') && labels.contains("status") {
                continue;
            }
            let Some(want) = catalog.get(name) else {
                // A row naming a series the daemon does not write (renamed, removed,
                // misspelt) would have dashboards and alerts built on nothing.
                if name.starts_with("iggy_") {
                    unknown.push(format!("{doc}: {name}"));
                }
                continue;
            };
            assert_eq!(&labels, want, "{doc} names {name} with the labels {labels:?}; its series carry {want:?}");
            listed.entry(doc).or_default().insert(name.to_string());
        }
    }
    assert_eq!(unknown, Vec::<String>::new(), "the guides' tables name metrics the daemon does not write");
    // The router's metrics (the door's own routing metrics are in docs/routing.md).
    let door = ["iggy_connector_routing_unmatched_total", "iggy_connector_partition_key_missing_total"];
    let by_status = ["iggy_connector_router_", "iggy_connector_destinations_"].map(|p| {
        move |n: &str| {
            n.strip_prefix(p)
                .is_some_and(|s| ["starting", "running", "degraded", "error", "stopping", "stopped"].contains(&s))
        }
    });
    let delivery = listed.get("docs/delivery.md").cloned().unwrap_or_default();
    for name in catalog.keys().filter(|n| n.starts_with("iggy_connector_")) {
        if door.contains(&name.as_str()) || by_status.iter().any(|f| f(name)) {
            continue;
        }
        assert!(delivery.contains(name), "docs/delivery.md's metrics table does not list {name}");
    }
}

/// What Grafana needs to lay the dashboard out and query it: unique panel ids, panels
/// inside the 24-column grid without overlaps, every query on the dashboard's data
/// source variable, and unique query ids per panel.
#[test]
fn the_dashboard_is_laid_out_and_wired_to_its_data_source() {
    let text = std::fs::read_to_string(repo().join("config/grafana/iggy-ingest.json")).unwrap();
    let d: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(d["uid"], "iggy-ingest");
    let vars: Vec<&str> =
        d["templating"]["list"].as_array().unwrap().iter().filter_map(|v| v["name"].as_str()).collect();
    assert_eq!(vars, ["datasource", "instance"]);
    let panels = d["panels"].as_array().unwrap();
    let mut ids = BTreeSet::new();
    let mut cells: BTreeSet<(u64, u64)> = BTreeSet::new();
    for p in panels {
        let title = p["title"].as_str().unwrap_or("?");
        assert!(ids.insert(p["id"].as_u64().expect("panel id")), "duplicate id at {title}");
        let g = &p["gridPos"];
        let (x, y, w, h) =
            (g["x"].as_u64().unwrap(), g["y"].as_u64().unwrap(), g["w"].as_u64().unwrap(), g["h"].as_u64().unwrap());
        assert!(w > 0 && h > 0 && x + w <= 24, "{title} is outside the grid: {g}");
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(cells.insert((cx, cy)), "{title} overlaps another panel at ({cx}, {cy})");
            }
        }
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"], "${datasource}", "{title}");
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("{title} has no queries"));
        assert!(!targets.is_empty(), "{title} has no queries");
        let mut refs = BTreeSet::new();
        for t in targets {
            assert!(refs.insert(t["refId"].as_str().unwrap()), "{title}: duplicate refId");
            assert_eq!(t["datasource"]["uid"], "${datasource}", "{title}");
            let expr = t["expr"].as_str().unwrap();
            assert!(expr.contains("instance=~\"$instance\""), "{title}: `{expr}` ignores the instance selector");
        }
    }
}

/// The sizing formula's per-event overhead (`O` in docs/operations.md) is what the log
/// really writes around a payload with the default metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sizing_guide_states_the_log_s_real_per_event_overhead() {
    let doc = std::fs::read_to_string(repo().join("docs/operations.md")).unwrap();
    let documented: f64 = doc
        .split("About **")
        .nth(1)
        .and_then(|rest| rest.split(" bytes**").next())
        .and_then(|n| n.parse().ok())
        .expect("docs/operations.md states the overhead as `About **N bytes**`");

    let dir = tempfile::tempdir().unwrap();
    let rest = "[sources.default]\ndestination = { stream = \"ingest\", topic = \"events\" }\n\
                [router]\nenabled = false\n";
    let d = Daemon::start(dir.path(), "", rest);
    let payload = format!("{{\"data\":\"{}\"}}", "x".repeat(1024 - 11));
    assert_eq!(payload.len(), 1024);
    let events = 50;
    for _ in 0..events {
        assert_eq!(post_json(d.http, "/v1/sources/default", &payload).await.status, 200);
    }
    let samples = parse_scrape(&scrape(d.admin, &[]).await);
    let bytes = value(&samples, "iggy_ingest_wal_bytes_written_total", &[]).unwrap();
    assert_eq!(value(&samples, "iggy_ingest_wal_records_total", &[]), Some(f64::from(events)));
    let overhead = bytes / f64::from(events) - 1024.0;
    assert!(
        (overhead - documented).abs() <= 25.0,
        "the log writes {overhead} bytes around each event, the guide says {documented}"
    );
    assert!(d.stop().success());
}

/// `admin.allow_unauthenticated_remote = true`: the operator's explicit word lets the
/// admin listener bind every address without a token, and it serves as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_explicit_opt_out_binds_every_address_without_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let rest = "[sources.default]\ndestination = { stream = \"ingest\", topic = \"events\" }\n\
                [router]\nenabled = false\n";
    let text = config_text(dir.path(), "", rest).replace(
        "[admin]\nlisten = \"127.0.0.1:0\"\n",
        "[admin]\nlisten = \"0.0.0.0:0\"\nallow_unauthenticated_remote = true\n",
    );
    assert!(text.contains("0.0.0.0:0"), "the test's config template changed");
    let d = Daemon::start_text(dir.path(), &text);
    assert!(d.admin.ip().is_unspecified(), "bound to {}", d.admin);
    let local = SocketAddr::from(([127, 0, 0, 1], d.admin.port()));
    assert_eq!(request(local, "GET", "/status", &[], "").await.status, 200);
    assert!(d.stop().success());
}

/// What the held-too-long, Degraded and not-delivering alerts watch moves as they
/// assume while Iggy is unreachable: records are held and age, the router turns
/// Degraded, failures are counted as `unavailable`, and no breaker opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_iggy_is_away_the_alerted_metrics_show_it() {
    // A port nothing listens on: every connection is refused.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    let rest = format!(
        "[iggy]\naddress = \"127.0.0.1:{port}\"\nreconnection_interval_ms = 50\n\
         [router]\nbackoff_base_ms = 20\nbackoff_max_ms = 100\ndegraded_after_failures = 2\n\
         [sources.default]\ndestination = {{ stream = \"ingest\", topic = \"events\" }}\n"
    );
    let d = Daemon::start(dir.path(), "", &rest);
    for n in 0..5 {
        assert_eq!(post_json(d.http, "/v1/sources/default", &format!("{{\"n\":{n}}}")).await.status, 200);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let samples = loop {
        let samples = parse_scrape(&scrape(d.admin, &[]).await);
        let degraded = value(&samples, "iggy_connector_router_degraded", &[]) == Some(1.0);
        let aged = value(&samples, "iggy_connector_oldest_held_age_seconds", &[]).is_some_and(|a| a > 0.0);
        if degraded && aged {
            break samples;
        }
        assert!(Instant::now() < deadline, "never Degraded with aged records while Iggy is away");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(value(&samples, "iggy_connector_held_bytes", &[]).is_some_and(|b| b > 0.0));
    assert!(value(&samples, "iggy_connector_destinations_degraded", &[]).is_some_and(|n| n >= 1.0));
    assert_eq!(value(&samples, "iggy_connector_router_running", &[]), Some(0.0));
    let status_of = |status: &str| {
        value(&samples, "iggy_connector_delivery_status", &[("connector_key", "default"), ("status", status)])
    };
    assert_eq!((status_of("degraded"), status_of("running")), (Some(1.0), Some(0.0)), "the connector's status");
    assert_eq!(value(&samples, "iggy_connector_messages_routed_total", &[("connector_key", "default")]), Some(0.0));
    let unavailable = [("connector_key", "default"), ("reason", "unavailable")];
    let disconnected = [("connector_key", "default"), ("reason", "disconnected")];
    let failures = value(&samples, "iggy_connector_send_failures_total", &unavailable).unwrap_or(0.0)
        + value(&samples, "iggy_connector_send_failures_total", &disconnected).unwrap_or(0.0);
    assert!(failures >= 2.0, "broker-wide failures counted: {failures}");
    assert_eq!(value(&samples, "iggy_connector_destination_circuit_open", &[]), Some(0.0), "no breaker for an outage");
    let lanes = request(d.admin, "GET", "/connectors/default/destinations", &[], "").await.json();
    assert_eq!(lanes["destinations"][0]["status"], "degraded", "{lanes}");
    assert_eq!(lanes["destinations"][0]["held_records"], 5, "{lanes}");
    assert!(d.stop().success());
}

/// What the log alerts watch when the log fills: used bytes reach the capacity, and the
/// refusals are counted as full rejections, as `log_full` and as 5xx answers. The append
/// latency times the durable appends only: a refusal answered at once is no append.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_log_shows_in_the_metrics_the_log_alerts_watch() {
    let dir = tempfile::tempdir().unwrap();
    let rest = "[wal]\nsegment_max_bytes = 65536\nmax_bytes = 131072\nrecord_max_bytes = 16384\n\
                [router]\nenabled = false\n\
                [sources.default]\ndestination = { stream = \"ingest\", topic = \"events\" }\n";
    let d = Daemon::start(dir.path(), "max_body_bytes = 8192", rest);
    let body = format!("{{\"data\":\"{}\"}}", "x".repeat(8000));
    let (mut accepted, mut refused) = (0, 0);
    for _ in 0..100 {
        match post_json(d.http, "/v1/sources/default", &body).await.status {
            200 => accepted += 1,
            503 => refused += 1,
            other => panic!("unexpected {other}"),
        }
        if refused == 3 {
            break;
        }
    }
    assert_eq!(refused, 3, "the log never filled");
    let samples = parse_scrape(&scrape(d.admin, &[]).await);
    let used = value(&samples, "iggy_ingest_wal_used_bytes", &[]).unwrap();
    let capacity = value(&samples, "iggy_ingest_wal_capacity_bytes", &[]).unwrap();
    assert_eq!(capacity, 131_072.0);
    assert!(used / capacity > 0.85, "IggyIngestLogAlmostFull would not fire at {used} of {capacity}");
    assert_eq!(value(&samples, "iggy_ingest_wal_full_rejections_total", &[]), Some(3.0));
    let full = [("source", "default"), ("reason", "log_full")];
    assert_eq!(value(&samples, "iggy_ingest_http_rejected_total", &full), Some(3.0));
    let server_errors = [("source", "default"), ("status_class", "5xx")];
    assert_eq!(value(&samples, "iggy_ingest_http_requests_total", &server_errors), Some(3.0));
    assert!(accepted > 0);
    assert_eq!(value(&samples, "iggy_ingest_append_latency_seconds_count", &[]), Some(f64::from(accepted)));
    assert!(d.stop().success());
}

/// A `RUST_LOG` that is no filter is said, also under a configured level that writes no
/// warning (`error`, as these tests run): on stderr then. Before, it was a warning the
/// level filtered away, and a RUST_LOG that did nothing passed unsaid.
#[test]
fn a_rust_log_that_is_no_filter_is_said_whatever_the_level() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    let source = "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n\n[router]\nenabled = false\n";
    std::fs::write(&cfg, config_text(dir.path(), "", source)).unwrap();
    assert!(std::fs::read_to_string(&cfg).unwrap().contains("level = \"error\""));
    let log = dir.path().join("daemon.log");
    let ready = dir.path().join("ready.json");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["run", "--config"])
        .arg(&cfg)
        .arg("--ready-file")
        .arg(&ready)
        .env("RUST_LOG", "info,=x=")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let daemon = Daemon {
        child,
        http: "127.0.0.1:1".parse().unwrap(),
        admin: "127.0.0.1:1".parse().unwrap(),
        root: dir.path().into(),
    }
    .ready();
    assert!(daemon.stop().success());
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(said.contains("RUST_LOG \"info,=x=\" is not a filter"), "{said}");
}
