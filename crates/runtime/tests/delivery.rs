//! The daemon delivering into Iggy's wire protocol (the test broker): accepted events
//! arrive with their ids, the admin API shows the destination, and a broker outage with
//! a kill -9 of the daemon in the middle loses nothing.

mod common;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use test_broker::{TestBroker, TestBrokerConfig};

fn rest(broker: SocketAddr) -> String {
    format!(
        r#"
[iggy]
address = "{broker}"
reconnection_interval_ms = 100

[router]
linger_ms = 1
backoff_base_ms = 50
backoff_max_ms = 500
degraded_after_failures = 3

[sources.default]
destination = {{ stream = "ingest", topic = "events" }}
"#
    )
}

async fn wait_until<F: FnMut() -> bool>(what: &str, limit: Duration, mut cond: F) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn admin_json(admin: SocketAddr, path: &str) -> serde_json::Value {
    request(admin, "GET", path, &[], "").await.json()
}

/// The `n` of every stored message, in arrival order, first copy of each id only.
fn delivered_ns(broker: &TestBroker) -> Vec<u64> {
    let mut seen = HashSet::new();
    broker
        .messages("ingest", "events")
        .into_iter()
        .filter(|m| seen.insert(m.id))
        .map(|m| {
            let v: serde_json::Value = serde_json::from_slice(&m.payload).expect("payload is the posted JSON");
            v["n"].as_u64().expect("n")
        })
        .collect()
}

/// Posts `{"n": n}` for each `n` to the default source; each must be answered 200.
async fn post_numbered(http: SocketAddr, ns: std::ops::Range<u64>) {
    for n in ns {
        let a = post_json(http, "/v1/sources/default", &format!("{{\"n\":{n}}}")).await;
        assert_eq!(a.status, 200, "event {n}");
    }
}

/// The default source's first destination as the admin API shows it, once its cursor
/// reached `cursor` or 30 s passed (the caller asserts what it needs).
/// `wal inspect --json --admin` of the daemon `d`'s log, through its admin listener:
/// exit 0, its JSON.
async fn inspect_with_admin(d: &Daemon) -> serde_json::Value {
    let (wal_dir, admin) = (d.wal_dir(), format!("http://{}", d.admin));
    let o = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(["wal", "inspect", wal_dir.to_str().unwrap(), "--json", "--admin", &admin])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The first lane of source `default`, once its cursor is `cursor`; fails the test if it
/// is not within 30 s.
async fn first_lane_once_its_cursor_reaches(admin: SocketAddr, cursor: u64) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let lane = admin_json(admin, "/connectors/default/destinations").await["destinations"][0].clone();
        if lane["cursor"] == cursor {
            return lane;
        }
        assert!(Instant::now() < deadline, "the cursor never reached {cursor}: {lane}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_events_reach_the_test_broker_and_the_admin_api_shows_the_destination() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(dir.path(), "", &rest(broker.addr()));
    post_numbered(daemon.http, 0..50).await;
    wait_until("delivered", Duration::from_secs(30), || broker.messages("ingest", "events").len() >= 50).await;
    assert_eq!(delivered_ns(&broker), (0..50).collect::<Vec<_>>());
    // The ids the broker stored are the ids in the log.
    let in_log: HashSet<u128> = read_log(&daemon.wal_dir()).iter().map(|(_, e)| e.header.message_id).collect();
    assert!(broker.messages("ingest", "events").iter().all(|m| in_log.contains(&m.id)));

    let lane = first_lane_once_its_cursor_reaches(daemon.admin, 50).await;
    // Nothing failed: each event was sent once (`delivered_ns` keeps first copies).
    assert_eq!(broker.messages("ingest", "events").len(), 50, "an event was sent twice with no failure");
    assert_eq!(lane["stream"], "ingest");
    assert_eq!(lane["topic"], "events");
    assert_eq!(lane["cursor"], 50, "{lane}");
    assert_eq!(lane["held_records"], 0);
    assert_eq!(lane["breaker"], "closed");
    assert_eq!(lane["warning"], serde_json::Value::Null, "the daemon's own topic must be durable");
    let c = admin_json(daemon.admin, "/connectors/default").await;
    assert_eq!(c["delivery"]["status"], "running", "{c}");
    assert_eq!(request(daemon.admin, "GET", "/connectors/nope/destinations", &[], "").await.status, 404);
    let metrics = String::from_utf8(request(daemon.admin, "GET", "/metrics", &[], "").await.body.to_vec()).unwrap();
    assert!(metrics.contains("iggy_connector_messages_routed_total{connector_key=\"default\"} 50"), "{metrics}");
    // The topic was created on the broker, once, and that is counted.
    assert!(metrics.contains("\niggy_connector_destinations_created_total 1\n"), "{metrics}");
    assert!(daemon.stop().success());

    // After a clean stop and a start, delivery goes on from the stored cursor: the next
    // event is the only one sent (a lane sends in log order, so a re-send of the first
    // fifty would come before it). The topic is there: nothing is created.
    let daemon = Daemon::start(dir.path(), "", &rest(broker.addr()));
    post_numbered(daemon.http, 50..51).await;
    first_lane_once_its_cursor_reaches(daemon.admin, 51).await;
    assert_eq!(delivered_ns(&broker), (0..51).collect::<Vec<_>>());
    assert_eq!(broker.messages("ingest", "events").len(), 51, "sent again after a clean restart");
    let metrics = String::from_utf8(request(daemon.admin, "GET", "/metrics", &[], "").await.body.to_vec()).unwrap();
    assert!(metrics.contains("\niggy_connector_destinations_created_total 0\n"), "{metrics}");
    assert!(daemon.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_with_a_kill_9_in_the_middle_loses_nothing() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut daemon = Daemon::start(dir.path(), "", &rest(broker.addr()));
    let mut n = 0u64;
    let mut post = |addr: SocketAddr| {
        let body = format!("{{\"n\":{n}}}");
        n += 1;
        async move {
            let a = post_json(addr, "/v1/sources/default", &body).await;
            assert_eq!(a.status, 200, "the door stopped accepting during the outage");
        }
    };
    for _ in 0..20 {
        post(daemon.http).await;
    }
    wait_until("first events delivered", Duration::from_secs(30), || broker.messages("ingest", "events").len() >= 20)
        .await;

    broker.stop().await;
    for _ in 0..100 {
        post(daemon.http).await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let c = admin_json(daemon.admin, "/connectors/default").await;
        if c["delivery"]["status"] == "degraded" {
            assert!(c["delivery"]["held_records"].as_u64().unwrap_or(0) > 0, "{c}");
            break;
        }
        assert!(Instant::now() < deadline, "never degraded: {c}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The daemon dies while the broker is still away, and comes back without it.
    daemon.kill9();
    let daemon = Daemon::restart(dir.path());
    for _ in 0..30 {
        post(daemon.http).await;
    }
    broker.restart().await.unwrap();
    wait_until("everything delivered", Duration::from_secs(60), || delivered_ns(&broker).len() >= 150).await;
    assert_eq!(delivered_ns(&broker), (0..150).collect::<Vec<_>>(), "lost or reordered events");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let c = admin_json(daemon.admin, "/connectors/default").await;
        if c["delivery"]["status"] == "running" && c["delivery"]["held_records"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "never back to running: {c}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(daemon.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_destinations_known_at_start_are_created_before_any_event() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    // Iggy is away at first: the daemon starts anyway and pre-warming keeps trying.
    broker.refuse_connections(true).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let rest = format!(
        r#"
[iggy]
address = "{broker}"
reconnection_interval_ms = 100

[sources.default]
destination = {{ stream = "ingest", topic = "events" }}

[sources.shop.route]
topic_field = "type"
default_stream = "shop"
default_topic = "unrouted"

[sources.shop.admission]
mode = "allowlist"
allowlist = [{{ stream = "shop", topic = "*" }}, {{ stream = "crm", topic = "customers" }}, {{ stream = "crm", topic = "orders" }}]

[router.sources.shop]
max_destinations = 2
"#,
        broker = broker.addr()
    );
    let daemon = Daemon::start(dir.path(), "", &rest);
    assert_eq!(request(daemon.http, "GET", "/health", &[], "").await.status, 200, "started without Iggy");
    broker.refuse_connections(false).await.unwrap();
    let known = [("ingest", "events"), ("shop", "unrouted"), ("crm", "customers")];
    wait_until("every known destination created", Duration::from_secs(30), || {
        known.iter().all(|(s, t)| broker.topic_options(s, t).is_some())
    })
    .await;
    for (s, t) in known {
        let o = broker.topic_options(s, t).unwrap();
        assert_eq!((o.enforce_fsync, o.messages_required_to_save), (Some(true), Some(1)), "{s}/{t} durable");
    }
    // Each created once, before any event; the first event then goes to the topic
    // already there, not created again.
    let created = broker.request_count(test_broker::RequestKind::CreateTopic);
    assert_eq!(created, known.len() as u64, "creations before any event");
    post_numbered(daemon.http, 0..1).await;
    wait_until("the first event delivered", Duration::from_secs(30), || broker.messages("ingest", "events").len() == 1)
        .await;
    assert_eq!(broker.request_count(test_broker::RequestKind::CreateTopic), created, "created again at first use");
    // The shop source's cap admits two destinations: a third literal entry would never
    // be created by a record, so it is not pre-warmed either.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(broker.topic_options("crm", "orders").is_none(), "pre-warmed past the source's cap");
    assert!(daemon.stop().success());
}

/// Records refused for a source's destination cap and sent to its dead-letter
/// destination leave their own destination by the operator's decision: the log says so,
/// with their offsets, as it does for drops (counted, logged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_dead_lettered_for_the_cap_are_logged_with_their_offsets() {
    let dir = tempfile::tempdir().unwrap();
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let rest = format!(
        r#"
[iggy]
address = "{broker}"
reconnection_interval_ms = 100

[sources.shop.route]
topic_field = "type"
default_stream = "shop"
default_topic = "unrouted"

[router.sources.shop]
max_destinations = 1
on_admission_failure = "dead_letter"
dead_letter_stream = "dlq"
dead_letter_topic = "rejected"
"#,
        broker = broker.addr()
    );
    let cfg = dir.path().join("config.toml");
    let text = config_text(dir.path(), "", &rest).replace("level = \"error\"", "level = \"warn\"");
    std::fs::write(&cfg, text).unwrap();
    let log = dir.path().join("daemon.log");
    let daemon = Daemon::spawn_logging_to(dir.path(), &cfg, std::fs::File::create(&log).unwrap()).ready();
    // Offsets 0 and 1 go to shop/orders, the one destination the cap admits; 2 and 3
    // name another and are refused.
    for (n, kind) in ["orders", "orders", "refunds", "refunds"].iter().enumerate() {
        let a = post_json(daemon.http, "/v1/sources/shop", &format!("{{\"type\":\"{kind}\",\"n\":{n}}}")).await;
        assert_eq!(a.status, 200, "event {n}");
    }
    wait_until("the refused records dead-lettered", Duration::from_secs(30), || {
        broker.messages("dlq", "rejected").len() == 2
    })
    .await;
    let said = || {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .filter(|l| l.contains("sent to the dead-letter destination"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    // The first of the second is a line of its own; the other is told by its count and
    // offsets on a line after the second is over.
    wait_until("both dead-lettered records logged", Duration::from_secs(10), || said().len() >= 2).await;
    let lines = said();
    assert!(lines[0].contains("offset=2") && lines[0].contains("source=shop"), "{lines:?}");
    assert!(lines[0].contains("dlq/rejected"), "names the dead-letter destination: {lines:?}");
    assert!(
        lines[1..].iter().any(|l| l.contains("dead_lettered=1") && l.contains("first_offset=3")),
        "the second record, on the line after: {lines:?}"
    );
    assert!(daemon.stop().success());
}

/// A source removed from the configuration while its records are still in the log keeps
/// a lane that holds (and pins) them: its destinations are shown, not a 404, so the
/// runbook can find what pins the log. A name that never had records stays 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_destinations_of_a_source_removed_from_the_configuration_are_still_shown() {
    let dir = tempfile::tempdir().unwrap();
    let unreachable = "127.0.0.1:1".parse().unwrap();
    let old = "\n[sources.old]\ndestination = { stream = \"legacy\", topic = \"events\" }\n";
    let d = Daemon::start(dir.path(), "", &format!("{}{old}", rest(unreachable)));
    for n in 0..3 {
        assert_eq!(post_json(d.http, "/v1/sources/old", &format!("{{\"n\":{n}}}")).await.status, 200);
    }
    assert!(d.stop().success());
    let d = Daemon::start(dir.path(), "", &rest(unreachable));
    let mut lanes = serde_json::Value::Null;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let a = request(d.admin, "GET", "/connectors/old/destinations", &[], "").await;
        if a.status == 200 {
            lanes = a.json()["destinations"].clone();
            if lanes[0]["held_records"] == 3 {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!((lanes[0]["stream"].as_str(), lanes[0]["held_records"].as_u64()), (Some("legacy"), Some(3)), "{lanes}");
    assert_eq!(request(d.admin, "GET", "/connectors/never/destinations", &[], "").await.status, 404);
    // The connector itself answers too, without a door, with what its lanes hold.
    let c = request(d.admin, "GET", "/connectors/old", &[], "").await;
    assert_eq!(c.status, 200, "{:?}", String::from_utf8_lossy(&c.body));
    let c = c.json();
    assert_eq!((c["configured"].as_bool(), c["door"].is_null()), (Some(false), true), "{c}");
    assert_eq!((c["delivery"]["destinations"].as_u64(), c["delivery"]["held_records"].as_u64()), (Some(1), Some(3)));
    assert_eq!(request(d.admin, "GET", "/connectors/never", &[], "").await.status, 404);
    // `/status` lists it beside the configured ones, without a door, and the delivery
    // status gauge names it, so an alert grouped by connector sees it.
    let st = request(d.admin, "GET", "/status", &[], "").await.json();
    let listed = &st["sources"]["old"];
    assert_eq!(
        (listed["configured"].as_bool(), listed["delivery"].as_str()),
        (Some(false), c["delivery"]["status"].as_str()),
        "{st}"
    );
    assert_eq!(st["sources"]["default"]["configured"].as_bool(), Some(true), "{st}");
    let m = String::from_utf8_lossy(&request(d.admin, "GET", "/metrics", &[], "").await.body).to_string();
    let gauge = format!(
        r#"iggy_connector_delivery_status{{connector_key="old",status="{}"}} 1"#,
        listed["delivery"].as_str().unwrap_or_default()
    );
    assert!(m.contains(&gauge), "{gauge} not in:\n{m}");
    // `wal inspect --admin` shows them too, with the daemon's figures.
    let i = inspect_with_admin(&d).await;
    let lanes = i["destinations"]["lanes"].as_array().unwrap();
    let old = lanes.iter().find(|l| l["source"] == "old").unwrap_or_else(|| panic!("{i}"));
    assert_eq!((old["stream"].as_str(), old["held_records"].as_u64()), (Some("legacy"), Some(3)), "{i}");
    assert!(old["status"].is_string(), "{i}");
    assert!(d.stop().success());
}

/// The log directory is replaced by an earlier copy of itself, still empty (a backup
/// restored without the state database beside it), while the state database keeps the
/// cursors of the log as it grew since, and the daemon then runs with delivery disabled: the events it accepts take offsets below
/// those cursors. When delivery is enabled again, every one of them is delivered. Left
/// in place, the old cursors would make the lane pass over the new records as delivered
/// and the releaser free them, never sent: so they are lowered at every start, with the
/// router or without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_accepted_with_delivery_disabled_over_a_replaced_log_are_all_delivered() {
    let broker = TestBroker::start(TestBrokerConfig::default()).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let wal_dir = dir.path().join("data").join("wal");
    let backup = dir.path().join("wal.backup");
    // The backup: the log as its first start left it, its identity and no record.
    assert!(Daemon::start(dir.path(), "", &rest(broker.addr())).stop().success());
    let copied = std::process::Command::new("cp").arg("-a").arg(&wal_dir).arg(&backup).status().unwrap();
    assert!(copied.success());
    let daemon = Daemon::restart(dir.path());
    post_numbered(daemon.http, 0..5).await;
    let lane = first_lane_once_its_cursor_reaches(daemon.admin, 5).await;
    assert_eq!(lane["cursor"], 5, "the cursor never reached 5: {lane}");
    assert!(daemon.stop().success());
    assert_eq!(delivered_ns(&broker), (0..5).collect::<Vec<_>>());

    std::fs::remove_dir_all(&wal_dir).unwrap();
    std::fs::rename(&backup, &wal_dir).unwrap();
    let disabled = rest(broker.addr()).replace("[router]\n", "[router]\nenabled = false\n");
    let daemon = Daemon::start(dir.path(), "", &disabled);
    for n in 5..10u64 {
        let a = post_json(daemon.http, "/v1/sources/default", &format!("{{\"n\":{n}}}")).await;
        assert_eq!(a.status, 200);
        assert_eq!(a.json()["offsets"][0], n - 5, "the replaced log starts again at offset 0");
    }
    assert!(daemon.stop().success());

    let daemon = Daemon::start(dir.path(), "", &rest(broker.addr()));
    wait_until("the new events delivered", Duration::from_secs(30), || delivered_ns(&broker).len() >= 10).await;
    assert_eq!(delivered_ns(&broker), (0..10).collect::<Vec<_>>(), "lost or reordered events");
    // Two clean stops and starts, and no failed send: each event was sent once (the
    // first five not again after the restarts, their cursor stored).
    first_lane_once_its_cursor_reaches(daemon.admin, 5).await;
    assert_eq!(broker.messages("ingest", "events").len(), 10, "an event was sent twice");
    assert!(daemon.stop().success());
}

/// A log holding many records this build cannot decode (a rollback over a newer
/// build's log) is held at the first of them, every one counted, in a few log lines: one
/// line a second, the next saying how many were held since and their offsets. It was
/// one line per record, at every start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_of_many_undecodable_records_is_held_in_a_few_log_lines() {
    const RECORDS: u64 = 5000;
    let dir = tempfile::tempdir().unwrap();
    {
        let wal = wal::Wal::open(dir.path().join("data/wal"), wal::WalOptions::default()).unwrap();
        // An envelope version no build wrote.
        let records = (0..RECORDS).map(|i| bytes::Bytes::from(vec![0xEE, i as u8])).collect();
        wal.append(records).await.unwrap();
        wal.close().await.unwrap();
    }
    // The log was written by hand: its state database, as a daemon would have left it.
    drop(ingest::StateDb::open(dir.path().join("data/state.redb")).unwrap());
    let cfg = dir.path().join("config.toml");
    let rest = "[iggy]\naddress = \"127.0.0.1:1\"\n[sources.default]\ndestination = { stream = \"ingest\", topic = \"events\" }\n";
    std::fs::write(&cfg, config_text(dir.path(), "", rest)).unwrap();
    let log = dir.path().join("daemon.log");
    let daemon = Daemon::spawn_logging_to(dir.path(), &cfg, std::fs::File::create(&log).unwrap()).ready();
    let counted = format!(
        "iggy_connector_destinations_rejected_total{{connector_key=\"unknown\",reason=\"malformed\"}} {RECORDS}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let metrics = String::from_utf8(request(daemon.admin, "GET", "/metrics", &[], "").await.body.to_vec()).unwrap();
        if metrics.lines().any(|l| l == counted) {
            break;
        }
        assert!(Instant::now() < deadline, "never counted: {counted}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let held = admin_json(daemon.admin, "/status").await;
    assert_eq!(held["router"]["held_from_offset"], 0, "{held}");
    assert!(daemon.stop().success());
    let text = std::fs::read_to_string(&log).unwrap();
    let lines = text.lines().filter(|l| l.contains("undecodable record")).count();
    assert!(
        (1..=4).contains(&lines),
        "{lines} lines for {RECORDS} undecodable records:\n{}",
        &text[..text.len().min(2000)]
    );
}

/// A connector's destinations are listed a page at a time, by stream and topic:
/// `limit` of them (1,000 unless asked) after `after` (`STREAM/TOPIC`), `next_after`
/// naming the last while more follow; the pages together list each destination once. A
/// query that does not read is a 400 naming its parameter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connectors_destinations_are_listed_a_page_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let unreachable = "127.0.0.1:1".parse().unwrap();
    let routed =
        "\n[sources.r]\nroute = { topic_field = \"type\", default_stream = \"g\", default_topic = \"misc\" }\n";
    let d = Daemon::start(dir.path(), "", &format!("{}{routed}", rest(unreachable)));
    for t in ["t3", "t0", "t4", "t1", "t2"] {
        assert_eq!(post_json(d.http, "/v1/sources/r", &format!("{{\"type\":\"{t}\"}}")).await.status, 200);
    }
    let names = |page: &serde_json::Value| -> Vec<String> {
        page["destinations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| format!("{}/{}", l["stream"].as_str().unwrap(), l["topic"].as_str().unwrap()))
            .collect()
    };
    let want: Vec<String> = (0..5).map(|i| format!("g/t{i}")).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let all = admin_json(d.admin, "/connectors/r/destinations").await;
        if names(&all) == want {
            assert_eq!(all["next_after"], serde_json::Value::Null, "{all}");
            break;
        }
        assert!(Instant::now() < deadline, "every destination, by name: {all}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let name = |l: &serde_json::Value| format!("{}/{}", l["stream"].as_str().unwrap(), l["topic"].as_str().unwrap());
    let walked = walk_pages(d.admin, &[], "/connectors/r/destinations?limit=2", 2, "destinations", name).await;
    assert_eq!(walked, want, "the pages list each destination once, in order");
    for (query, named) in
        [("limit=0", "limit"), ("after=g", "after"), ("after=g/t1&after=g/t2", "after"), ("x=1", "\"x\"")]
    {
        let a = request(d.admin, "GET", &format!("/connectors/r/destinations?{query}"), &[], "").await;
        assert_eq!(a.status, 400, "{query}: {:?}", a.body);
        let body = a.json();
        assert_eq!(body["error"], "invalid_query", "{query}: {body}");
        assert!(body["message"].as_str().is_some_and(|m| m.starts_with(named)), "{query}: {body}");
    }
    // Every client library percent-encodes a query's values: `next_after` sent back so
    // reads as sent raw.
    let raw = admin_json(d.admin, "/connectors/r/destinations?after=g/t1&limit=2").await;
    let encoded = admin_json(d.admin, "/connectors/r/destinations?after=g%2Ft1&limit=2").await;
    assert_eq!((names(&raw), &raw["next_after"]), (vec!["g/t2".to_string(), "g/t3".to_string()], &"g/t3".into()));
    assert_eq!((names(&encoded), &encoded["next_after"]), (names(&raw), &raw["next_after"]));
    let a = request(d.admin, "GET", "/connectors/r/destinations?after=g%FF", &[], "").await;
    assert_eq!((a.status, a.json()["error"].as_str()), (400, Some("invalid_query")));
    assert!(d.stop().success());
}

/// `wal inspect --admin` reads every page of a connector's destinations: a source routed
/// to more destinations than one page of the listing holds (1,000) shows each with the
/// daemon's figures, none as unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_inspect_with_admin_reads_every_page_of_destinations() {
    const TOPICS: usize = 1_500;
    let dir = tempfile::tempdir().unwrap();
    let unreachable = "127.0.0.1:1".parse().unwrap();
    let routed =
        "\n[sources.r]\nroute = { topic_field = \"type\", default_stream = \"g\", default_topic = \"misc\" }\n";
    let config = format!("{}{routed}", rest(unreachable)).replace("[router]\n", "[router]\nmax_destinations = 2000\n");
    assert!(config.contains("max_destinations = 2000"), "{config}");
    let d = Daemon::start(dir.path(), "", &config);
    let body: String = (0..TOPICS).map(|i| format!("{{\"type\":\"t{i:04}\"}}\n")).collect();
    let a = request(d.http, "POST", "/v1/sources/r", &[("content-type", "application/x-ndjson")], body).await;
    assert_eq!(a.status, 200, "{:?}", String::from_utf8_lossy(&a.body));
    // The router has made a lane for each (each holds its record: the server is down).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let c = admin_json(d.admin, "/connectors/r").await;
        if c["delivery"]["destinations"].as_u64() == Some(TOPICS as u64) {
            break;
        }
        assert!(Instant::now() < deadline, "a lane per destination: {c}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let i = inspect_with_admin(&d).await;
    let lanes = i["destinations"]["lanes"].as_array().unwrap();
    let routed: Vec<&serde_json::Value> = lanes.iter().filter(|l| l["source"] == "r").collect();
    assert_eq!(routed.len(), TOPICS, "one entry per destination");
    let unknown: Vec<String> = routed
        .iter()
        .filter(|l| !l["status"].is_string() || l["held_records"].as_u64() != Some(1))
        .map(|l| l["topic"].to_string())
        .collect();
    assert!(
        unknown.is_empty(),
        "{} destination(s) without the daemon's figures, first {:?}",
        unknown.len(),
        unknown.first()
    );
    assert!(d.stop().success());
}
