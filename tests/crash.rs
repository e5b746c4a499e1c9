//! Crashes of the daemon under concurrent load while the router delivers to the test
//! broker: kill -9 at random moments (`CRASH_CYCLES` cycles, default 5; the full run uses
//! 50), and a crash inside each phase that matters, driven by the fail points of
//! `crates/fail-points` (armed through the environment of the killed process only) or,
//! for a send awaiting its answer, by the broker holding the answer while the test kills.
//!
//! After each: restart (without the fail point), keep sending, stop the senders, drain,
//! and check against the senders' ledger that every event answered 200 was delivered,
//! that nothing was delivered that was never sent, that an event never travels under two
//! ids, and that each connection's events arrive in order within their topic.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use e2e::daemon::{Conn, Daemon, config_text, daemon_bin, get, killed_by_sigkill, metric, test_dir};
use e2e::destination::Destination;
use e2e::load::{Figures, Ledger, Load, Target, sources_config};
use rand::Rng;
use test_broker::RequestKind;

const SOURCES: u32 = 2;
const CONNECTIONS: u32 = 3;
/// Each connection posts one event every this long (600 events/s in all).
const PERIOD: Duration = Duration::from_millis(10);

fn unique(prefix: &str) -> String {
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros());
    format!("{prefix}-{t}")
}

/// Small segments, so that segments are sealed, created and released all the time.
fn rest(stream: &str, segment_max_bytes: u64) -> String {
    rest_with(stream, segment_max_bytes, "")
}

fn rest_with(stream: &str, segment_max_bytes: u64, wal_extra: &str) -> String {
    format!(
        r#"
[router]
linger_ms = 2
backoff_base_ms = 50
backoff_max_ms = 500
result_timeout_ms = 20000

[wal]
segment_max_bytes = {segment_max_bytes}
max_bytes = 67108864
{wal_extra}

{}"#,
        sources_config(stream, SOURCES as usize)
    )
}

async fn wait_for(limit: Duration, what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !cond().await {
        assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `n` more events were acknowledged.
async fn accepting(ledger: &Ledger, n: usize, what: &str) {
    let from = ledger.acked();
    wait_for(Duration::from_secs(60), what, async || ledger.acked() >= from + n).await;
}

/// Stops the senders, waits until every acknowledged event was delivered, checks the
/// figures, stops the daemon cleanly.
async fn drain_and_check(label: &str, dest: &Destination, stream: &str, load: Load, daemon: Daemon) -> Figures {
    let ledger = load.stop().await;
    assert!(ledger.acked() > 0, "{label}: nothing was acknowledged");
    wait_for(Duration::from_secs(120), "every acknowledged event delivered", async || {
        Figures::compute(&ledger, &dest.delivered(stream).await).lost.is_empty()
    })
    .await;
    let figures = Figures::compute(&ledger, &dest.delivered(stream).await);
    figures.assert_sound(label);
    assert!(ledger.refused().is_empty(), "{label}: the door refused requests: {:?}", ledger.refused().first());
    eprintln!("{label}: {}", figures.line());
    assert!(daemon.stop().await.success(), "{label}: the daemon did not stop cleanly after the drain");
    figures
}

fn crash_cycles() -> u32 {
    std::env::var("CRASH_CYCLES").ok().and_then(|v| v.parse().ok()).unwrap_or(5)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_at_random_moments_under_load_loses_no_acknowledged_event() {
    kill_loop(crash_cycles(), "sync = \"always\"").await;
}

/// Under `interval` a 200 comes before the sync; a process crash still loses nothing,
/// because the kernel keeps what was written (a power loss would not: see
/// docs/durability.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_the_interval_sync_policy_loses_no_acknowledged_event() {
    kill_loop(crash_cycles().div_ceil(2), "sync = \"interval\"\nsync_interval_ms = 50").await;
}

async fn kill_loop(cycles: u32, sync: &str) {
    let dest = Destination::broker().await;
    let stream = unique("kill9");
    let dir = test_dir(&stream);
    let config = config_text(dir.path(), &dest.daemon_address(), &rest_with(&stream, 65536, sync));
    let mut daemon = Daemon::start(dir.path(), &config, &[]).await;
    let target = Target::new(daemon.http);
    let load = Load::start(target.clone(), SOURCES, CONNECTIONS, PERIOD);
    let mut rng = rand::thread_rng();
    let started = Instant::now();
    for cycle in 0..cycles {
        // Traffic flows again after the restart, then the kill lands at a random moment.
        accepting(&load.ledger, 20, &format!("cycle {cycle}: accepting")).await;
        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..1000))).await;
        target.set_down();
        daemon.kill9();
        daemon = Daemon::restart(dir.path(), &[]).await;
        target.set_up(daemon.http);
    }
    accepting(&load.ledger, 20, "accepting after the last restart").await;
    let label = format!("kill -9 loop ({}): {cycles} cycles in {:?}", sync.replace('\n', ", "), started.elapsed());
    // Every acknowledged event delivered, in order, each once: checked by the drain.
    drain_and_check(&label, &dest, &stream, load, daemon).await;
}

/// Runs load with `point` armed on its `hit`th hit, waits for the daemon to die there,
/// restarts it unarmed, and checks the drain.
async fn crash_at(point: &str, hit: u64, segment_max_bytes: u64) -> Figures {
    let dest = Destination::broker().await;
    let stream = unique("fail-point");
    let dir = test_dir(&stream);
    let config = config_text(dir.path(), &dest.daemon_address(), &rest(&stream, segment_max_bytes));
    let env = [("IGGY_INGEST_FAIL_POINT", point.to_string()), ("IGGY_INGEST_FAIL_POINT_HIT", hit.to_string())];
    let mut daemon = Daemon::start(dir.path(), &config, &env).await;
    let target = Target::new(daemon.http);
    let load = Load::start(target.clone(), SOURCES, CONNECTIONS, PERIOD);
    let Some(status) = daemon.wait_exit(Duration::from_secs(120)).await else {
        panic!(
            "{point}: the daemon did not die at the fail point within 120 s (built without crates/fail-points' `enabled`?)"
        );
    };
    target.set_down();
    assert!(killed_by_sigkill(&status), "{point}: the daemon ended otherwise: {status}: {}", daemon.stderr());
    let said = format!("fail point {point}: hit {hit}, killing the process");
    assert!(daemon.stderr().contains(&said), "{point}: died, but not at the point: {}", daemon.stderr());
    let acked_before = load.ledger.acked();
    daemon = Daemon::restart(dir.path(), &[]).await;
    target.set_up(daemon.http);
    accepting(&load.ledger, 50, &format!("{point}: accepting after the restart")).await;
    let label = format!("crash at {point} (hit {hit}, {acked_before} events acknowledged before it)");
    drain_and_check(&label, &dest, &stream, load, daemon).await
}

/// The log's writer is held after it wrote a group and before it synced it (the fail
/// point hangs its thread there, the process alive), then the daemon is killed. None of
/// that group's requests may have been answered: while it is held no answer comes, and
/// after the restart its events are delivered (the kernel keeps the written bytes of a
/// killed process) without a 200. Killed at the point instead, an answer sent between
/// the write and the sync could be cut off with the process before it reached its
/// client, and the test could not tell. (What a power loss does to bytes not synced is
/// the simulated disk's: faults.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_write_and_the_sync_loses_nothing_acknowledged() {
    let point = "wal.append.written";
    let dest = Destination::broker().await;
    let stream = unique("written-not-synced");
    let dir = test_dir(&stream);
    let config = config_text(dir.path(), &dest.daemon_address(), &rest(&stream, 65536));
    let env = [
        ("IGGY_INGEST_FAIL_POINT", point.to_string()),
        ("IGGY_INGEST_FAIL_POINT_HIT", "50".to_string()),
        ("IGGY_INGEST_FAIL_POINT_ACTION", "hang".to_string()),
    ];
    let mut daemon = Daemon::start(dir.path(), &config, &env).await;
    let target = Target::new(daemon.http);
    let load = Load::start(target.clone(), SOURCES, CONNECTIONS, PERIOD);
    let said = format!("fail point {point}: hit 50, hanging");
    wait_for(Duration::from_secs(120), "the writer held after a write", async || daemon.stderr().contains(&said)).await;
    // Answers of the groups synced before it land (until the count has stood for 2 s: a
    // loaded machine may be slow to deliver them); then none may come while it is held.
    let mut held_at = load.ledger.acked();
    let settling = std::time::Instant::now();
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = load.ledger.acked();
        if now == held_at {
            break;
        }
        assert!(settling.elapsed() < Duration::from_secs(30), "answers kept coming with the writer held");
        held_at = now;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(load.ledger.acked(), held_at, "requests were answered while the log's writer was held before its sync");
    // Held for longer, the log is stalled and says so (a disk that stopped answering a
    // sync records no fsync latency, no error, nothing else): health is 503
    // `log_stalled`, so a load balancer sends new events elsewhere, and the status and
    // the metric give how long the writer has been stuck.
    wait_for(Duration::from_secs(30), "health 503 log_stalled", async || {
        get(daemon.admin, "/health")
            .await
            .is_some_and(|a| a.status == 503 && String::from_utf8_lossy(&a.body).contains("log_stalled"))
    })
    .await;
    let busy = metric(daemon.admin, "iggy_ingest_wal_writer_busy_seconds").await.unwrap_or(0.0);
    assert!(busy >= 10.0, "the writer held for over 10 s shown busy for {busy} s");
    let status: serde_json::Value = get(daemon.admin, "/status")
        .await
        .and_then(|a| serde_json::from_slice(&a.body).ok())
        .expect("a /status answer while the log is stalled");
    assert!(status["log"]["writer_busy_ms"].as_u64().is_some_and(|ms| ms >= 10_000), "{}", status["log"]);
    target.set_down();
    daemon.kill9();
    daemon = Daemon::restart(dir.path(), &[]).await;
    target.set_up(daemon.http);
    accepting(&load.ledger, 50, "accepting after the restart").await;
    let label = format!("held at {point} (hit 50, {held_at} events acknowledged before it), then killed");
    let f = drain_and_check(&label, &dest, &stream, load, daemon).await;
    assert!(f.delivered_unacknowledged >= 1, "the written, unsynced group came back answered: {}", f.line());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_sync_and_the_200_keeps_the_unanswered_event() {
    let f = crash_at("door.append.synced", 50, 65536).await;
    // The request that died there was synced: it is delivered though it got no 200.
    assert!(f.delivered_unacknowledged >= 1, "the synced, unanswered event is missing: {}", f.line());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_as_a_batch_is_handed_to_the_client_loses_nothing() {
    crash_at("router.send", 5, 65536).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_ack_before_the_cursor_is_stored_resends_under_the_same_ids() {
    let f = crash_at("router.acked", 5, 65536).await;
    // What was acknowledged but not recorded is sent again, under the same ids.
    assert!(f.duplicates >= 1, "no resend after a crash before the cursor was stored: {}", f.line());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_in_the_middle_of_a_segment_deletion_loses_nothing() {
    // 4 KiB segments: a few events each, so releases start almost at once.
    crash_at("wal.release.removed", 3, 4096).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_while_a_send_awaits_its_answer_resends_under_the_same_ids() {
    let dest = Destination::broker().await;
    let broker = dest.test_broker().expect("test broker");
    let stream = unique("in-flight");
    let dir = test_dir(&stream);
    let config = config_text(dir.path(), &dest.daemon_address(), &rest(&stream, 65536));
    let mut daemon = Daemon::start(dir.path(), &config, &[]).await;
    let target = Target::new(daemon.http);
    let load = Load::start(target.clone(), SOURCES, CONNECTIONS, PERIOD);
    wait_for(Duration::from_secs(60), "first deliveries", async || dest.delivered(&stream).await.len() >= 100).await;

    // From now on the broker stores each request at once and answers it 10 s later.
    broker.set_delay(Duration::from_secs(10));
    // Requests on the daemon's connection are served one after another: once a send
    // counted after the delay was set has arrived, every earlier one is finished, and
    // whatever is stored from then on belongs to a send whose answer is held.
    let counted = broker.request_count(RequestKind::SendMessages);
    wait_for(Duration::from_secs(30), "a send under the delay", async || {
        broker.request_count(RequestKind::SendMessages) > counted
    })
    .await;
    let stored = dest.delivered(&stream).await.len();
    wait_for(Duration::from_secs(30), "the held send stored", async || dest.delivered(&stream).await.len() > stored)
        .await;
    target.set_down();
    daemon.kill9();
    broker.set_delay(Duration::ZERO);

    daemon = Daemon::restart(dir.path(), &[]).await;
    target.set_up(daemon.http);
    accepting(&load.ledger, 50, "accepting after the restart").await;
    let f = drain_and_check("crash while a send awaits its answer", &dest, &stream, load, daemon).await;
    assert!(f.duplicates >= 1, "the batch stored while its answer was held was not sent again: {}", f.line());
}

/// The log's writer is a thread, not a task: should it panic, the log must not look
/// open (`/health` "accepting", the process running on) while every append fails. The
/// log marks itself stopped, the daemon exits 1 naming the writer, and the event
/// answered before the panic is delivered after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_writer_that_panics_stops_the_daemon_with_status_1_and_loses_nothing() {
    let dest = Destination::broker().await;
    let stream = unique("writer-panic");
    let dir = test_dir(&stream);
    let config = config_text(dir.path(), &dest.daemon_address(), &rest(&stream, 65536));
    // The first group is written and synced; the writer panics after writing the second.
    let env = [
        ("IGGY_INGEST_FAIL_POINT", "wal.append.written".to_string()),
        ("IGGY_INGEST_FAIL_POINT_HIT", "2".to_string()),
        ("IGGY_INGEST_FAIL_POINT_ACTION", "panic".to_string()),
    ];
    let mut daemon = Daemon::start(dir.path(), &config, &env).await;
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    let event = br#"{"t":"a","n":1}"#.as_slice();
    let a = conn.send("POST", "/v1/sources/s0", &[("content-type", "application/json")], event).await.expect("answer");
    assert_eq!(a.status, 200, "{:?}", a.body);
    let second = br#"{"t":"a","n":2}"#.as_slice();
    if let Ok(b) = conn.send("POST", "/v1/sources/s0", &[("content-type", "application/json")], second).await {
        assert_ne!(b.status, 200, "an append whose writer panicked before its sync was answered 200");
    }

    let Some(status) = daemon.wait_exit(Duration::from_secs(60)).await else {
        panic!("the daemon went on after the log's writer panicked: {}", daemon.stderr());
    };
    let stderr = daemon.stderr();
    assert!(stderr.contains("fail point wal.append.written: hit 2, panicking"), "not the fail point's panic: {stderr}");
    assert_eq!(status.code(), Some(1), "exit status after the panic: {status}: {stderr}");
    assert!(stderr.contains("the log's writer panicked"), "the exit does not name the writer: {stderr}");

    let daemon = Daemon::restart(dir.path(), &[]).await;
    wait_for(Duration::from_secs(60), "the event answered before the panic delivered", async || {
        dest.delivered(&stream).await.iter().any(|d| d.payload.as_ref() == event)
    })
    .await;
    assert!(daemon.stop().await.success());
}

/// A stop whose log never closes (its writer's last sync never returns, as on a failing
/// disk) still ends, within the bound a service manager's stop timeout is sized by: exit
/// status 1, saying so, the log not marked clean; and the next start recovers it and
/// delivers the event answered before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_whose_log_never_closes_exits_1_in_bounded_time_and_loses_nothing() {
    let dest = Destination::broker().await;
    let stream = unique("close-hangs");
    let dir = test_dir(&stream);
    let grace = Duration::from_secs(1);
    let config = config_text(dir.path(), &dest.daemon_address(), &rest(&stream, 65536))
        .replace("grace_period_ms = 20000", "grace_period_ms = 1000\ndrain_delay_ms = 0");
    let env =
        [("IGGY_INGEST_FAIL_POINT", "wal.close".to_string()), ("IGGY_INGEST_FAIL_POINT_ACTION", "hang".to_string())];
    let mut daemon = Daemon::start(dir.path(), &config, &env).await;
    let event = br#"{"t":"a","n":1}"#.as_slice();
    {
        let mut conn = Conn::open(daemon.http).await.expect("connect");
        let a = conn.send("POST", "/v1/sources/s0", &[("content-type", "application/json")], event).await;
        assert_eq!(a.expect("answer").status, 200);
    }
    // SAFETY: kill(2) with the pid of our own child process.
    assert_eq!(unsafe { libc::kill(daemon.child.id() as i32, libc::SIGTERM) }, 0);
    let bound = grace + runtime::daemon::STOP_PAST_GRACE_MAX + Duration::from_secs(5);
    let Some(status) = daemon.wait_exit(bound).await else {
        panic!("the stop waited on a log that never closes past {bound:?}: {}", daemon.stderr());
    };
    let stderr = daemon.stderr();
    assert!(stderr.contains("fail point wal.close: hit 1, hanging"), "not the fail point's hang: {stderr}");
    assert_eq!(status.code(), Some(1), "exit status after a close cut short: {status}: {stderr}");
    assert!(stderr.contains("the log did not close"), "the exit does not say why: {stderr}");
    let marker = dir.path().join("data/wal").join(wal::CLEAN_MARKER_FILE);
    assert!(!marker.exists(), "a log that never closed was marked clean");

    let daemon = Daemon::restart(dir.path(), &[]).await;
    wait_for(Duration::from_secs(60), "the event answered before the stop delivered", async || {
        dest.delivered(&stream).await.iter().any(|d| d.payload.as_ref() == event)
    })
    .await;
    assert!(daemon.stop().await.success());
}

/// A source `k` whose records are not delivered (the router is off).
const KEYED_SOURCE: &str =
    "[router]\nenabled = false\n\n[sources.k]\ndestination = { stream = \"s\", topic = \"t\" }\n";

/// The idempotency recorder held at the first key it records (the fail point's hang),
/// as when the state database's disk stops answering.
fn recorder_held() -> [(&'static str, String); 2] {
    [
        ("IGGY_INGEST_FAIL_POINT", "idempotency.record".to_string()),
        ("IGGY_INGEST_FAIL_POINT_ACTION", "hang".to_string()),
    ]
}

/// Posts delivery `delivery-1` to source `k` on `conn`: answered 200 at offset 0, the log
/// holding that one record (a first sending, or a retry that appended nothing).
async fn post_delivery_1(daemon: &Daemon, conn: &mut Conn, what: &str) {
    let keyed = [("idempotency-key", "delivery-1")];
    let a = conn.send("POST", "/v1/sources/k", &keyed, "{}").await.expect("answer");
    assert_eq!((a.status, a.json()["offsets"].clone()), (200, serde_json::json!([0, 0])), "{what}");
    let status = e2e::daemon::get(daemon.admin, "/status").await.expect("status").json();
    assert_eq!(status["log"]["next_offset"], 1, "{what}: appended again: {status}");
}

/// A stop whose idempotency recorder never finishes (stuck in the state database's
/// disk, with the id of a request already answered 200) still ends within the same
/// bound: the final checkpoint gives up, exit status 1, and the exit does not wait for the
/// recorder. The next start restores the id from the log: the retry is a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_whose_recorder_never_finishes_exits_1_in_bounded_time_and_loses_nothing() {
    let dir = test_dir("recorder-hangs");
    let grace = Duration::from_secs(1);
    let config = config_text(dir.path(), "127.0.0.1:1", KEYED_SOURCE)
        .replace("grace_period_ms = 20000", "grace_period_ms = 1000\ndrain_delay_ms = 0");
    let mut daemon = Daemon::start(dir.path(), &config, &recorder_held()).await;
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    post_delivery_1(&daemon, &mut conn, "the first sending").await;
    drop(conn);
    // SAFETY: kill(2) with the pid of our own child process.
    assert_eq!(unsafe { libc::kill(daemon.child.id() as i32, libc::SIGTERM) }, 0);
    let bound = grace + runtime::daemon::STOP_PAST_GRACE_MAX + Duration::from_secs(5);
    let Some(status) = daemon.wait_exit(bound).await else {
        panic!("the stop waited on a recorder that never finishes past {bound:?}: {}", daemon.stderr());
    };
    let stderr = daemon.stderr();
    assert!(stderr.contains("fail point idempotency.record: hit 1, hanging"), "not the fail point's hang: {stderr}");
    assert_eq!(status.code(), Some(1), "exit status after a checkpoint cut short: {status}: {stderr}");
    assert!(stderr.contains("the final checkpoint did not finish"), "the exit does not say why: {stderr}");

    let daemon = Daemon::restart(dir.path(), &[]).await;
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    post_delivery_1(&daemon, &mut conn, "the retry after the restart").await;
    assert!(daemon.stop().await.success());
}

/// The idempotency recorder is a thread, not a task: should it panic, no delivery id
/// would be recorded from then on (a retry appended again), with health, status and
/// exit all saying nothing. The daemon exits 1 naming the recorder, and the next start
/// restores the id from the log: the retry is a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_recorder_that_panics_stops_the_daemon_with_status_1_and_loses_nothing() {
    let dir = test_dir("recorder-panics");
    let config = config_text(dir.path(), "127.0.0.1:1", KEYED_SOURCE);
    let env = [
        ("IGGY_INGEST_FAIL_POINT", "idempotency.record".to_string()),
        ("IGGY_INGEST_FAIL_POINT_ACTION", "panic".to_string()),
    ];
    let mut daemon = Daemon::start(dir.path(), &config, &env).await;
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    let keyed = [("idempotency-key", "delivery-1")];
    let a = conn.send("POST", "/v1/sources/k", &keyed, "{}").await.expect("answer");
    assert_eq!((a.status, a.json()["offsets"].clone()), (200, serde_json::json!([0, 0])), "the first sending");
    drop(conn);
    let Some(status) = daemon.wait_exit(Duration::from_secs(60)).await else {
        panic!("the daemon went on after its idempotency recorder panicked: {}", daemon.stderr());
    };
    let stderr = daemon.stderr();
    assert!(stderr.contains("fail point idempotency.record: hit 1, panicking"), "not the fail point's panic: {stderr}");
    assert_eq!(status.code(), Some(1), "exit status after the panic: {status}: {stderr}");
    assert!(stderr.contains("the idempotency recorder panicked"), "the exit does not name the recorder: {stderr}");

    let daemon = Daemon::restart(dir.path(), &[]).await;
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    post_delivery_1(&daemon, &mut conn, "the retry after the restart").await;
    assert!(daemon.stop().await.success());
}

/// A retry answered while its delivery's id is not yet recorded (the recorder held: the
/// answer comes from the claim in memory, not from the state database), then a kill -9:
/// the retry's 200 named the original offsets and appended nothing, and after the restart
/// (the id restored from the log) a retry gets the same offsets, the log still holding
/// one record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_answered_before_its_id_is_recorded_survives_a_kill_9() {
    let dir = test_dir("replay-unrecorded");
    // No periodic checkpoint while the recorder is held: one would wait for the claim the
    // held recorder keeps (it takes the gate exclusively), and every keyed request after
    // it, the retry this test sends, would wait behind it. The first runs at the start.
    let config = config_text(dir.path(), "127.0.0.1:1", KEYED_SOURCE)
        .replace("checkpoint_interval_ms = 200", "checkpoint_interval_ms = 60000");
    assert!(config.contains("checkpoint_interval_ms = 60000"));
    let mut daemon = Daemon::start(dir.path(), &config, &recorder_held()).await;
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    post_delivery_1(&daemon, &mut conn, "the first sending").await;
    wait_for(Duration::from_secs(30), "the recorder held", async || {
        daemon.stderr().contains("fail point idempotency.record: hit 1, hanging")
    })
    .await;
    post_delivery_1(&daemon, &mut conn, "the retry while the recorder is held").await;
    drop(conn);
    daemon.kill9();

    let daemon = Daemon::restart(dir.path(), &[]).await;
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    post_delivery_1(&daemon, &mut conn, "the retry after the restart").await;
    assert!(daemon.stop().await.success());
}

/// A listener that panics while the daemon drains after SIGTERM stopped it as surely as
/// one that panics before: exit status 1, naming it, not exit 0 with the panic taken for
/// connections cut at the end of the grace period. The webhook listener drains first
/// (the point's first hit), the admin listener after the log is closed (its second).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_that_panics_during_the_drain_makes_the_exit_status_1() {
    let dest = Destination::broker().await;
    for (hit, listener) in [(1, "webhook"), (2, "admin")] {
        let stream = unique(&format!("drain-panic-{listener}"));
        let dir = test_dir(&stream);
        let config = config_text(dir.path(), &dest.daemon_address(), &rest(&stream, 65536));
        let env = [
            ("IGGY_INGEST_FAIL_POINT", "listener.drain".to_string()),
            ("IGGY_INGEST_FAIL_POINT_HIT", hit.to_string()),
            ("IGGY_INGEST_FAIL_POINT_ACTION", "panic".to_string()),
        ];
        let mut daemon = Daemon::start(dir.path(), &config, &env).await;
        // SAFETY: kill(2) with the pid of our own child process.
        assert_eq!(unsafe { libc::kill(daemon.child.id() as i32, libc::SIGTERM) }, 0);
        let Some(status) = daemon.wait_exit(Duration::from_secs(60)).await else {
            panic!("the daemon did not exit after SIGTERM: {}", daemon.stderr());
        };
        let stderr = daemon.stderr();
        assert!(
            stderr.contains(&format!("fail point listener.drain: hit {hit}, panicking")),
            "{listener}: not the fail point's panic: {stderr}"
        );
        assert_eq!(status.code(), Some(1), "{listener}: exit status after the panic: {status}: {stderr}");
        assert!(
            stderr.contains(&format!("the {listener} listener panicked")),
            "{listener}: the exit does not name the task: {stderr}"
        );
    }
}

/// A listener that panics takes the daemon down with exit status 1 instead of leaving a
/// process whose `/health` says "accepting" while nothing takes connections: a service
/// manager then restarts it, and the event answered before the panic is still delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_listener_that_panics_stops_the_daemon_with_status_1_and_loses_nothing() {
    let dest = Destination::broker().await;
    let stream = unique("listener-panic");
    let dir = test_dir(&stream);
    let config = config_text(dir.path(), &dest.daemon_address(), &rest(&stream, 65536));
    // The first connection is served; the listener panics as it accepts the second.
    let env = [
        ("IGGY_INGEST_FAIL_POINT", "listener.accept".to_string()),
        ("IGGY_INGEST_FAIL_POINT_HIT", "2".to_string()),
        ("IGGY_INGEST_FAIL_POINT_ACTION", "panic".to_string()),
    ];
    let mut daemon = Daemon::start(dir.path(), &config, &env).await;
    let mut first = Conn::open(daemon.http).await.expect("connect");
    let event = br#"{"t":"a","n":1}"#.as_slice();
    let a = first
        .send("POST", "/v1/sources/s0", &[("content-type", "application/json")], event)
        .await
        .expect("an answer on the first connection");
    assert_eq!(a.status, 200, "{:?}", a.body);

    let second = async {
        let mut c = Conn::open(daemon.http).await.ok()?;
        c.send("POST", "/v1/sources/s0", &[("content-type", "application/json")], event).await.ok()
    };
    let answered = tokio::time::timeout(Duration::from_secs(10), second).await.ok().flatten();
    assert!(answered.is_none(), "the connection the listener panicked on was answered: {answered:?}");

    let Some(status) = daemon.wait_exit(Duration::from_secs(60)).await else {
        panic!("the daemon went on after its webhook listener panicked: {}", daemon.stderr());
    };
    let stderr = daemon.stderr();
    assert!(stderr.contains("fail point listener.accept: hit 2, panicking"), "not the fail point's panic: {stderr}");
    assert_eq!(status.code(), Some(1), "exit status after the panic: {status}: {stderr}");
    assert!(stderr.contains("the webhook listener panicked"), "the exit does not name the task: {stderr}");

    let daemon = Daemon::restart(dir.path(), &[]).await;
    wait_for(Duration::from_secs(60), "the event answered before the panic delivered", async || {
        dest.delivered(&stream).await.iter().any(|d| d.payload.as_ref() == event)
    })
    .await;
    assert!(daemon.stop().await.success());
}

/// After the daemon stopped itself (a listener panicked), a supervisor's ordinary stop
/// signal during the drain is the first signal, not the second: the drain goes on (the
/// log is closed cleanly, the keys checkpointed). Only a second one exits 130 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_stop_of_its_own_the_first_signal_lets_the_drain_finish() {
    let dest = Destination::broker().await;
    let stream = unique("self-stop-signal");
    let dir = test_dir(&stream);
    let config = config_text(dir.path(), &dest.daemon_address(), &rest(&stream, 65536))
        .replace("grace_period_ms = 20000", "grace_period_ms = 20000\ndrain_delay_ms = 60000");
    let env = [
        ("IGGY_INGEST_FAIL_POINT", "listener.accept".to_string()),
        ("IGGY_INGEST_FAIL_POINT_HIT", "1".to_string()),
        ("IGGY_INGEST_FAIL_POINT_ACTION", "panic".to_string()),
    ];
    let mut daemon = Daemon::start(dir.path(), &config, &env).await;
    // The webhook listener panics as it accepts this connection, which is dropped (the
    // admin listener is asked only after: its accept must not be the one that panics).
    let dropped = async {
        let mut c = Conn::open(daemon.http).await.ok()?;
        c.send("GET", "/health", &[], b"".as_slice()).await.ok()
    };
    let answered = tokio::time::timeout(Duration::from_secs(10), dropped).await.ok().flatten();
    assert!(answered.is_none(), "the connection the listener panicked on was answered");
    wait_for(Duration::from_secs(30), "the daemon draining after the panic", async || {
        e2e::daemon::get(daemon.admin, "/health").await.is_some_and(|a| a.json()["status"] == "draining")
    })
    .await;
    let term = |d: &Daemon| {
        // SAFETY: kill(2) with the pid of our own child process.
        assert_eq!(unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) }, 0);
    };
    term(&daemon);
    let early = daemon.wait_exit(Duration::from_millis(1500)).await;
    assert!(early.is_none(), "the first signal after a stop of its own ended the drain: {early:?}");
    term(&daemon);
    let status = daemon.wait_exit(Duration::from_secs(30)).await.expect("the second signal did not stop it");
    assert_eq!(status.code(), Some(130), "{status}: {}", daemon.stderr());
}

/// A crash while the recorder holds delivery ids whose requests were answered 200 (a
/// keyed request is answered once its events are durable, before its id is recorded):
/// after the restart, every answered delivery's retry is answered with its first
/// answer's offsets and appends nothing, and so is the one the crash left unanswered if
/// its events were appended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_answered_delivery_ids_are_recorded_answers_every_retry_from_the_log() {
    const HIT: u64 = 5;
    let dir = test_dir("keyed-record");
    let rest = "[router]\nenabled = false\n\n[sources.k]\ndestination = { stream = \"s\", topic = \"t\" }\n";
    let config = config_text(dir.path(), "127.0.0.1:1", rest);
    let env =
        [("IGGY_INGEST_FAIL_POINT", "idempotency.record".to_string()), ("IGGY_INGEST_FAIL_POINT_HIT", HIT.to_string())];
    let mut daemon = Daemon::start(dir.path(), &config, &env).await;
    let post = async |conn: &mut Conn, n: u64| {
        let key = format!("delivery-{n}");
        conn.send("POST", "/v1/sources/k", &[("idempotency-key", key.as_str())], format!("{{\"n\":{n}}}")).await
    };
    // One request at a time: the n-th is appended at offset n - 1.
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    let mut answered = Vec::new();
    for n in 1..=10_000u64 {
        match post(&mut conn, n).await {
            Ok(a) => {
                assert_eq!(a.status, 200, "delivery-{n}: {:?}", String::from_utf8_lossy(&a.body));
                assert_eq!(a.json()["offsets"], serde_json::json!([n - 1, n - 1]), "delivery-{n}");
                answered.push(n);
            }
            Err(_) => break,
        }
    }
    let status = daemon.wait_exit(Duration::from_secs(60)).await.expect("the daemon died at the fail point");
    assert!(killed_by_sigkill(&status), "ended otherwise: {status}: {}", daemon.stderr());
    assert!(daemon.stderr().contains(&format!("fail point idempotency.record: hit {HIT}")), "{}", daemon.stderr());
    let answered = answered.len() as u64;
    // Each commit holds at least one request; the fifth's first may have come in the last
    // instant before the kill.
    assert!(answered + 1 >= HIT, "only {answered} requests were answered before the recorder's {HIT}th commit");

    let daemon = Daemon::restart(dir.path(), &[]).await;
    let status = e2e::daemon::get(daemon.admin, "/status").await.expect("status").json();
    let appended = status["log"]["next_offset"].as_u64().expect("next_offset");
    assert!(appended == answered || appended == answered + 1, "{appended} records for {answered} answers");
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    for n in 1..=appended {
        let a = post(&mut conn, n).await.expect("answered");
        assert_eq!(a.status, 200, "retry of delivery-{n}: {:?}", String::from_utf8_lossy(&a.body));
        assert_eq!(a.json()["offsets"], serde_json::json!([n - 1, n - 1]), "retry of delivery-{n}");
    }
    let status = e2e::daemon::get(daemon.admin, "/status").await.expect("status").json();
    assert_eq!(status["log"]["next_offset"], appended, "a retry was appended again: {status}");
    assert!(daemon.stop().await.success());
}

/// A crash after a keyed request's events were appended (and synced) and before its
/// delivery id was recorded: its sender got no answer, yet the event is in the log. After
/// the restart every retry, that one's included, is answered with the offsets the log
/// holds for it and appends nothing: the restart restores the delivery ids from the log.
/// Also a retry of that one whose body the source now refuses (not JSON): it is a
/// replay (the door asks `replay_of` before refusing), not a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_a_keyed_append_and_its_recorded_id_answers_every_retry_from_the_log() {
    const HIT: u64 = 20;
    let dir = test_dir("keyed-append");
    let rest = "[router]\nenabled = false\n\n[sources.k]\naccept = \"json\"\ndestination = { stream = \"s\", topic = \"t\" }\n";
    let config = config_text(dir.path(), "127.0.0.1:1", rest);
    let env =
        [("IGGY_INGEST_FAIL_POINT", "ingest.appended".to_string()), ("IGGY_INGEST_FAIL_POINT_HIT", HIT.to_string())];
    let mut daemon = Daemon::start(dir.path(), &config, &env).await;
    let post = async |conn: &mut Conn, n: u64| {
        let key = format!("delivery-{n}");
        let headers = [("idempotency-key", key.as_str()), ("content-type", "application/json")];
        conn.send("POST", "/v1/sources/k", &headers, format!("{{\"n\":{n}}}")).await
    };
    // One request at a time: the n-th is appended at offset n - 1.
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    let mut answered = Vec::new();
    for n in 1..=HIT {
        match post(&mut conn, n).await {
            Ok(a) => {
                assert_eq!(a.status, 200, "delivery-{n}: {:?}", String::from_utf8_lossy(&a.body));
                answered.push(a.json()["offsets"].clone());
            }
            Err(_) => break,
        }
    }
    let status = daemon.wait_exit(Duration::from_secs(60)).await.expect("the daemon died at the fail point");
    assert!(killed_by_sigkill(&status), "ended otherwise: {status}: {}", daemon.stderr());
    assert!(daemon.stderr().contains(&format!("fail point ingest.appended: hit {HIT}")), "{}", daemon.stderr());
    assert_eq!(answered.len() as u64, HIT - 1, "the requests before the crash were answered");

    let daemon = Daemon::restart(dir.path(), &[]).await;
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    let key = format!("delivery-{HIT}");
    let refused_body = [("idempotency-key", key.as_str()), ("content-type", "application/json")];
    let a = conn.send("POST", "/v1/sources/k", &refused_body, "not json".to_string()).await.expect("answered");
    assert_eq!(a.status, 200, "a retry with a refused body: {:?}", String::from_utf8_lossy(&a.body));
    assert_eq!(a.json()["offsets"], serde_json::json!([HIT - 1, HIT - 1]), "a retry with a refused body");
    let not_json = conn.send("POST", "/v1/sources/k", &[("content-type", "application/json")], "not json".to_string());
    assert_eq!(not_json.await.expect("answered").status, 400, "the body is refused without a delivery id");
    for n in 1..=HIT {
        let a = post(&mut conn, n).await.expect("answered");
        assert_eq!(a.status, 200, "retry of delivery-{n}: {:?}", String::from_utf8_lossy(&a.body));
        let want = serde_json::json!([n - 1, n - 1]);
        assert_eq!(a.json()["offsets"], want, "retry of delivery-{n}");
        if let Some(before) = answered.get((n - 1) as usize) {
            assert_eq!(*before, want, "delivery-{n}'s first answer");
        }
    }
    let status = e2e::daemon::get(daemon.admin, "/status").await.expect("status").json();
    assert_eq!(status["log"]["next_offset"], HIT, "a retry was appended again: {status}");
    assert!(daemon.stop().await.success());
}

/// A start refused after the log opened (here, a state database of another schema
/// version) closes the log again, bounded as a stop's close is: with the disk not
/// answering that close (the writer held at its last sync), the start still ends, exit 2
/// within the close's bound (10 s), instead of hanging with its listeners bound and
/// unserved while its service manager shows it active. The log is then not marked
/// clean, and the next start recovers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_start_whose_log_close_hangs_still_ends() {
    let dest = Destination::broker().await;
    let stream = unique("refused-start");
    let dir = test_dir(&stream);
    let config = config_text(dir.path(), &dest.daemon_address(), &rest(&stream, 65536));
    let daemon = Daemon::start(dir.path(), &config, &[]).await;
    let mut conn = Conn::open(daemon.http).await.expect("connect");
    let json = [("content-type", "application/json")];
    let event = conn.send("POST", "/v1/sources/s0", &json, r#"{"t":"a","n":1}"#.to_string()).await;
    assert_eq!(event.expect("answered").status, 200);
    assert!(daemon.stop().await.success());
    let marker = dir.path().join("data/wal").join(wal::CLEAN_MARKER_FILE);
    assert!(marker.exists(), "the stop before the refused start marked the log clean");
    let state = dir.path().join("data/state.redb");
    let state_as_it_was = dir.path().join("state.redb.as-it-was");
    std::fs::copy(&state, &state_as_it_was).unwrap();
    ingest::StateDb::open(&state).unwrap().force_schema_version(7).unwrap();
    let started = Instant::now();
    let mut child = std::process::Command::new(daemon_bin())
        .arg("--config")
        .arg(dir.path().join("config.toml"))
        .env("IGGY_INGEST_FAIL_POINT", "wal.close")
        .env("IGGY_INGEST_FAIL_POINT_ACTION", "hang")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the daemon");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the refused start did not end within 30 s while its log's close hung");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut said = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().expect("stderr"), &mut said).unwrap();
    assert_eq!(status.code(), Some(2), "{said}");
    assert!(said.contains("fail point wal.close: hit 1, hanging"), "the close was not held: {said}");
    assert!(said.contains("schema version 7"), "{said}");
    // The close's bound, and some seconds for the start up to it on a busy machine.
    let took = started.elapsed();
    assert!(took < runtime::daemon::CLOSE_MAX + Duration::from_secs(8), "the refused start took {took:?}");
    assert!(!marker.exists(), "a log whose close never ended was marked clean");

    // Put back, the next start recovers the log as after a crash and holds the event.
    std::fs::rename(&state_as_it_was, &state).unwrap();
    let daemon = Daemon::restart(dir.path(), &[]).await;
    let status = e2e::daemon::get(daemon.admin, "/status").await.expect("status").json();
    assert_eq!(status["log"]["next_offset"], 1, "the log after the refused start: {status}");
    assert!(daemon.stop().await.success());
}
