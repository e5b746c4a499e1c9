//! The scenario the daemon exists for: webhook senders post numbered events at a steady
//! rate for the whole test while the destination becomes unreachable for longer than any
//! breaker window and comes back; in one variant the daemon is also SIGKILLed and
//! restarted while the destination is still away (it must start and accept without it).
//!
//! Checked: every event that got a 200 arrives, exactly once by id after dedupe, in
//! per-connection order within its topic, and nothing arrives that was not sent; the
//! door answered every request 200 (the log had room) and never failed a request while
//! the daemon was up; every source's delivery status went `degraded` during the outage and
//! `running` after; `/metrics` showed the held bytes growing during the outage and
//! draining after it.
//!
//! The same body runs against the test broker (always; the outage lasts
//! `OUTAGE_SECS`, default 4 s) and against a real Iggy server (the `live_` tests, ignored
//! unless asked for with `-- --include-ignored`, and then failing without
//! `IGGY_TEST_ADDR`; default 120 s). A live outage cuts the daemon off through a TCP
//! proxy, or, when `IGGY_TEST_STOP_CMD` and `IGGY_TEST_START_CMD` are set, stops and
//! starts the server with them.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use e2e::daemon::{Daemon, config_text, delivery_status, metric, test_dir};
use e2e::destination::Destination;
use e2e::load::{Figures, Load, Target, sources_config};

const SOURCES: u32 = 3;
const CONNECTIONS: u32 = 2;
/// Each connection posts one event every this long (300 events/s in all).
const PERIOD: Duration = Duration::from_millis(20);

fn outage_length(live: bool) -> Duration {
    let default = if live { 120 } else { 4 };
    let secs = std::env::var("OUTAGE_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    Duration::from_secs(secs)
}

/// Stream names unique to this run, so live reruns do not collide.
fn unique(prefix: &str) -> String {
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros());
    format!("{prefix}-{t}")
}

/// Router settings: retries and breaker windows far shorter than the outage.
const ROUTER: &str = r#"
[router]
linger_ms = 2
backoff_base_ms = 50
backoff_max_ms = 500
degraded_after_failures = 3
failure_threshold = 3
cool_down_ms = 1000
result_timeout_ms = 5000
"#;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Before = 0,
    Outage = 1,
    After = 2,
}

#[derive(Debug, Clone)]
struct Sample {
    phase: u8,
    held_bytes: f64,
    degraded: usize,
}

/// Polls `/metrics` and `/connectors/{key}` of whichever daemon is current.
struct Monitor {
    admin: Mutex<SocketAddr>,
    phase: AtomicU8,
    samples: Mutex<Vec<Sample>>,
}

impl Monitor {
    fn start(admin: SocketAddr) -> Arc<Monitor> {
        let m = Arc::new(Monitor {
            admin: Mutex::new(admin),
            phase: AtomicU8::new(Phase::Before as u8),
            samples: Mutex::default(),
        });
        let weak = Arc::downgrade(&m);
        tokio::spawn(async move {
            while let Some(m) = weak.upgrade() {
                let admin = m.admin();
                // A sample belongs to a phase only if the phase did not change while it
                // was taken.
                let phase = m.phase.load(Ordering::SeqCst);
                let held = metric(admin, "iggy_connector_held_bytes").await;
                let mut degraded = 0;
                for s in 0..SOURCES {
                    if delivery_status(admin, &format!("s{s}")).await.as_deref() == Some("degraded") {
                        degraded += 1;
                    }
                }
                if let Some(held_bytes) = held
                    && m.phase.load(Ordering::SeqCst) == phase
                {
                    m.samples.lock().unwrap_or_else(|p| p.into_inner()).push(Sample { phase, held_bytes, degraded });
                }
                drop(m);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        m
    }
    fn admin(&self) -> SocketAddr {
        *self.admin.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn set_admin(&self, a: SocketAddr) {
        *self.admin.lock().unwrap_or_else(|p| p.into_inner()) = a;
    }
    fn set_phase(&self, p: Phase) {
        self.phase.store(p as u8, Ordering::SeqCst);
    }
    fn samples(&self) -> Vec<Sample> {
        self.samples.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn len(&self) -> usize {
        self.samples.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// Waits until every source's delivery status is `want`.
async fn all_sources(admin: SocketAddr, want: &str, limit: Duration, what: &str) {
    let start = Instant::now();
    loop {
        let mut all = true;
        let mut seen = Vec::new();
        for s in 0..SOURCES {
            let st = delivery_status(admin, &format!("s{s}")).await;
            all &= st.as_deref() == Some(want);
            seen.push(st);
        }
        if all {
            return;
        }
        assert!(start.elapsed() < limit, "{what}: not every source {want} within {limit:?}: {seen:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_for(limit: Duration, what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let start = Instant::now();
    while !cond().await {
        assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The scenario; returns its figures after asserting everything it promises.
async fn broker_outage(dest: Destination, outage: Duration, kill_in_outage: bool) -> Figures {
    let label =
        format!("{} outage of {outage:?}{}", dest.describe(), if kill_in_outage { ", kill -9 inside" } else { "" });
    let stream = unique("scenario");
    let dir = test_dir(&stream);
    let rest = format!("{ROUTER}\n{}", sources_config(&stream, SOURCES as usize));
    let mut daemon = Daemon::start(dir.path(), &config_text(dir.path(), &dest.daemon_address(), &rest), &[]).await;
    let target = Target::new(daemon.http);
    let monitor = Monitor::start(daemon.admin);
    let load = Load::start(target.clone(), SOURCES, CONNECTIONS, PERIOD);
    let ledger = load.ledger.clone();

    // Delivering before the outage.
    wait_for(Duration::from_secs(60), "first deliveries", async || dest.delivered(&stream).await.len() >= 100).await;
    all_sources(daemon.admin, "running", Duration::from_secs(30), "before the outage").await;

    // The destination goes away for longer than any breaker window.
    let began = Instant::now();
    dest.outage_begin().await;
    monitor.set_phase(Phase::Outage);
    all_sources(daemon.admin, "degraded", Duration::from_secs(30), "during the outage").await;
    let acked_at_degraded = ledger.acked();
    wait_for(Duration::from_secs(30), "the door accepting during the outage", async || {
        ledger.acked() > acked_at_degraded + 50
    })
    .await;

    if kill_in_outage {
        // Half-way through, the daemon dies and comes back with the destination still away.
        let half = outage / 2;
        if began.elapsed() < half {
            tokio::time::sleep(half - began.elapsed()).await;
        }
        target.set_down();
        daemon.kill9();
        daemon = Daemon::restart(dir.path(), &[]).await;
        target.set_up(daemon.http);
        monitor.set_admin(daemon.admin);
        let acked_at_restart = ledger.acked();
        wait_for(Duration::from_secs(30), "accepting after the restart, without the destination", async || {
            ledger.acked() > acked_at_restart + 50
        })
        .await;
        all_sources(daemon.admin, "degraded", Duration::from_secs(30), "after the restart, still in the outage").await;
    }
    // The outage lasts its length (the senders keep posting all along).
    if began.elapsed() < outage {
        tokio::time::sleep(outage - began.elapsed()).await;
    }
    let samples_in_outage = monitor.len();
    dest.outage_end().await;
    monitor.set_phase(Phase::After);
    let outage_took = began.elapsed();

    all_sources(daemon.admin, "running", Duration::from_secs(120), "after the outage").await;
    let peak =
        monitor.samples().iter().filter(|s| s.phase == Phase::Outage as u8).map(|s| s.held_bytes).fold(0.0, f64::max);
    wait_for(Duration::from_secs(120), "held bytes draining after the outage", async || {
        metric(daemon.admin, "iggy_connector_held_bytes").await.is_some_and(|h| h <= peak / 10.0)
    })
    .await;
    // Keep posting a little after the recovery, then stop the senders.
    let seen = monitor.len();
    wait_for(Duration::from_secs(30), "samples after the outage", async || monitor.len() >= seen + 5).await;
    let ledger = load.stop().await;

    // Everything acknowledged arrives.
    let acked = ledger.acked_keys();
    let stream_name = stream.clone();
    wait_for(Duration::from_secs(180), "every acknowledged event delivered", async || {
        Figures::compute(&ledger, &dest.delivered(&stream_name).await).lost.is_empty() && !acked.is_empty()
    })
    .await;
    wait_for(Duration::from_secs(60), "nothing held", async || {
        metric(daemon.admin, "iggy_connector_held_bytes").await == Some(0.0)
    })
    .await;
    all_sources(daemon.admin, "running", Duration::from_secs(30), "at the end").await;
    let figures = Figures::compute(&ledger, &dest.delivered(&stream).await);

    // What the senders saw: only 200s, and no failed request while the daemon was up.
    let refused = ledger.refused();
    assert!(refused.is_empty(), "{label}: the door refused {} requests, first {:?}", refused.len(), refused.first());
    let failed = ledger.unanswered_while_up();
    assert!(
        failed.is_empty(),
        "{label}: {} requests failed while the daemon was up, first {:?}",
        failed.len(),
        failed.first()
    );

    // What the admin API and /metrics showed.
    let samples = monitor.samples();
    let outage_samples: Vec<&Sample> = samples.iter().filter(|s| s.phase == Phase::Outage as u8).collect();
    assert!(
        outage_samples.iter().any(|s| s.degraded == SOURCES as usize),
        "{label}: no sample saw every source degraded during the outage"
    );
    let first_held = outage_samples.first().map_or(0.0, |s| s.held_bytes);
    assert!(
        peak > first_held && peak >= 100.0 * 64.0,
        "{label}: held bytes did not grow during the outage (first {first_held}, peak {peak}, {samples_in_outage} samples)"
    );
    assert!(
        samples.iter().any(|s| s.phase == Phase::After as u8 && s.held_bytes <= peak / 10.0),
        "{label}: held bytes never drained after the outage (peak {peak})"
    );

    figures.assert_sound(&label);
    eprintln!(
        "{label}: {}; requests unanswered while the daemon was down {}; held bytes peaked at {peak}; outage lasted {outage_took:?}",
        figures.line(),
        ledger.unanswered_while_down()
    );
    assert!(daemon.stop().await.success(), "{label}: the daemon did not stop cleanly");
    figures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_loses_nothing_and_status_and_metrics_follow_it() {
    broker_outage(Destination::broker().await, outage_length(false), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_with_the_daemon_killed_and_restarted_inside_it_loses_nothing() {
    broker_outage(Destination::broker().await, outage_length(false), true).await;
}

/// A live test asked for without a real server fails: it is never counted as passed
/// without having run.
fn no_server(test: &str) -> ! {
    panic!("live test {test}: IGGY_TEST_ADDR is not set (no real Iggy server to test against)")
}

/// The live tests share one server (and may stop it): one at a time.
static LIVE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real Iggy server: IGGY_TEST_ADDR, and -- --include-ignored"]
async fn live_a_server_outage_loses_nothing_and_status_and_metrics_follow_it() {
    let _one_at_a_time = LIVE.lock().await;
    let Some(dest) = Destination::live().await else { no_server("live_a_server_outage_loses_nothing") };
    broker_outage(dest, outage_length(true), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a real Iggy server: IGGY_TEST_ADDR, and -- --include-ignored"]
async fn live_a_server_outage_with_the_daemon_killed_and_restarted_inside_it_loses_nothing() {
    let _one_at_a_time = LIVE.lock().await;
    let Some(dest) = Destination::live().await else { no_server("live_..._killed_and_restarted_inside_it") };
    broker_outage(dest, outage_length(true), true).await;
}
