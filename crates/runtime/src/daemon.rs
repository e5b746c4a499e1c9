//! Starting, running and stopping the daemon.
//!
//! Start order: fetch the routes' `mapping_url`s (a failure refuses the start before
//! anything is opened), bind both listeners (a taken port refuses it before the log is
//! opened), open the log (taking its lock), open the state database (checking its
//! schema version), rebuild the idempotency keys the last checkpoint missed (the first
//! time on a database from before keys were scoped by endpoint, after forgetting
//! every unscoped key), load the endpoints, start delivery; only then serve.
//!
//! Shutdown order (SIGTERM/SIGINT, [`RunningDaemon::shutdown`], or a task the daemon
//! cannot run without ending by a panic):
//! 1. `draining` is set: both `/health` answer 503, so a load balancer sends new
//!    traffic elsewhere; event requests that still arrive are served as before;
//! 2. after `drain_delay` new event requests get 503 and the webhook listener closes;
//!    in-flight requests finish, bounded by `grace_period`;
//! 3. the router stops sending and stores its last cursors (bounded by what is left of
//!    the grace period, at least `ROUTER_STOP_MIN`);
//! 4. the log is closed (synced, clean-shutdown marker written);
//! 5. a final idempotency checkpoint makes every recorded key durable, and stops below
//!    any key the recorder could not take, which the next start's rebuild restores from
//!    the log (4 and 5 together bounded by `CLOSE_MAX`);
//! 6. the admin listener closes.
//!
//! Invariants:
//! - The data directory (with any parent the start creates) and the state database's
//!   entry in it are durable before anything is served: each directory created is
//!   fsynced with its parent, and the data directory again once the state database file
//!   was first created, so a power loss after a first start cannot take them away.
//! - The log is closed only after the webhook listener drained, so no request that was
//!   answered 200 can be behind the close.
//! - Startup failures are typed ([`StartError`]) and name what failed.
//! - The router starts before the webhook listener serves, so the log's next offset it
//!   checks the stored cursors against is the log's end at open (`router::Router::start`).
//! - A task the daemon cannot do its work without (either listener, the idempotency
//!   checkpoint, the metrics upkeep, the log's writer thread and the idempotency
//!   recorder thread) that panics stops the
//!   daemon: a listener gone while
//!   `/health` still said "accepting" would turn a load balancer's traffic into refused
//!   connections. The stop takes the usual order, and the report names the task, so the
//!   process exits 1 and a service manager restarts it; every event answered 200 is in
//!   the log. (The router's own tasks put the router in Error instead: delivery stops,
//!   accepting goes on, and the status says so.)

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http_source::auth::TokenDigest;
use http_source::door::{Door, DoorLimits};
use http_source::endpoints::EndpointRegistry;
use http_source::health::Health;
use http_source::server::{self, ConnectionLimits};
use http_source::status::StatusBoard;
use http_source::tls::ListenerTls;
use ingest::{IdempotencyIndex, Ingestor, StateDb, StateError};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use wal::storage::FsStorage;
use wal::{Wal, WalError};

use crate::config::Settings;

/// What the routes of both listeners share.
pub struct Shared {
    pub wal: Arc<Wal>,
    pub state: Arc<StateDb>,
    pub endpoints: Arc<EndpointRegistry>,
    pub idempotency: Arc<IdempotencyIndex>,
    pub status: Arc<StatusBoard>,
    pub health: Arc<Health>,
    /// Guards every admin route but `/health` (see `admin.rs`).
    pub admin_token: Option<TokenDigest>,
    pub management_token: Option<TokenDigest>,
    pub metrics: Option<PrometheusHandle>,
    pub delivery: Arc<crate::delivery::Delivery>,
    /// `http.body_read_timeout_ms`, applied to admin request bodies too.
    pub body_read_timeout: std::time::Duration,
    /// The listeners served over TLS (`[http.tls]`, `[admin.tls]`), for reloads and the
    /// status API.
    pub tls: Vec<ListenerTls>,
}

impl StartError {
    /// The exit status of a start refused with this error: 2 for a refusal only an
    /// operator can end, as for an invalid configuration (a state database of another
    /// schema version; a static endpoint whose id the store holds as revoked, or in a
    /// record that does not decode; a damaged log, one of another format version, an
    /// unfinished salvage copy), which a supervisor that restarts on failure would
    /// only meet again (the systemd unit: `RestartPreventExitStatus=2`); 1 for the rest,
    /// which a restart may end (a port still taken, a log still locked, a mapping not
    /// reachable yet or refused: its server's owner may correct it without touching the
    /// configuration, an I/O error).
    pub fn exit_code(&self) -> u8 {
        use http_source::endpoints::LoadError;
        match self {
            StartError::State(
                StateError::SchemaMismatch { .. }
                | StateError::Open { unreadable: true, .. }
                | StateError::NotAFile { .. },
            )
            | StartError::StateMissing { .. }
            | StartError::LogNotTheStates { .. }
            | StartError::Endpoints(LoadError::RevokedStatic(_) | LoadError::UnreadableStatic(_)) => 2,
            // A log with damage in what was durable, a segment of another format version
            // (a rollback), or a salvage copy that never finished: the same log again at
            // every restart, until an operator salvages, upgrades or removes it.
            StartError::Wal { source, .. }
                if source.is_corruption()
                    || matches!(source, WalError::BadSegmentHeader { .. } | WalError::UnfinishedSalvage(_)) =>
            {
                2
            }
            _ => 1,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot create (or make durable) data directory {path}: {source}")]
    DataDir { path: PathBuf, source: std::io::Error },
    #[error("cannot open the log in {path}: {source}")]
    Wal { path: PathBuf, source: WalError },
    #[error(transparent)]
    State(#[from] StateError),
    #[error(
        "there is no state database at {path} while the log beside it was written before (its next offset is \
         {log_next_offset}): refusing to start with an empty one (nothing was changed)"
    )]
    StateMissing { path: PathBuf, log_next_offset: u64 },
    /// The state database holds offsets of another log than the one beside it (the log
    /// was replaced, or deleted and begun again): its cursors would pass over records
    /// never sent, and its delivery ids answer retries with offsets that hold other
    /// events. Nothing was used; `state forget-log` lets the database take this log.
    #[error(
        "the log in {wal_dir} (identity {found:016x}) is not the log the state database {state_path} holds offsets of \
         (identity {recorded:016x}): {cause}; refusing to start (the state database was not changed)"
    )]
    LogNotTheStates { wal_dir: PathBuf, state_path: PathBuf, recorded: u64, found: u64, cause: String },
    #[error("cannot load a route mapping: {0}")]
    Mapping(String),
    #[error("cannot start delivery: {0}")]
    Delivery(String),
    #[error(transparent)]
    Endpoints(#[from] http_source::endpoints::LoadError),
    #[error("cannot bind the {listener} listener: {source}")]
    Bind { listener: &'static str, source: std::io::Error },
    #[error("cannot load the {listener} listener's TLS certificate ({section}.tls.{error})")]
    Tls { listener: &'static str, section: &'static str, error: http_source::tls::TlsError },
}

/// A started daemon.
pub struct RunningDaemon {
    pub http_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub shared: Arc<Shared>,
    shutdown_tx: Arc<watch::Sender<bool>>,
    task: JoinHandle<ShutdownReport>,
    /// Set by [`RunningDaemon::shutdown_before_ready`]: the drain skips
    /// `shutdown.drain_delay_ms`.
    skip_drain_delay: Arc<std::sync::atomic::AtomicBool>,
}

/// How a shutdown went.
#[derive(Debug, Clone)]
pub struct ShutdownReport {
    /// Every webhook connection finished within the grace period.
    pub drained: bool,
    /// The log was closed cleanly (marker written).
    pub wal_closed: Result<(), String>,
    pub checkpoint: Result<u64, String>,
    /// The task whose panic stopped the daemon, when one did.
    pub failed_task: Option<&'static str>,
}

impl ShutdownReport {
    pub fn is_clean(&self) -> bool {
        self.drained && self.wal_closed.is_ok() && self.checkpoint.is_ok() && self.failed_task.is_none()
    }
}

impl RunningDaemon {
    /// Starts the shutdown sequence (idempotent).
    pub fn shutdown(&self) {
        // Kept whether or not a receiver is there to see it (`send` would drop it).
        self.shutdown_tx.send_replace(true);
    }

    /// [`RunningDaemon::shutdown`] of a daemon asked to stop while it started, before it
    /// said it was ready: no load balancer saw its `/health` answer 200, so none has
    /// traffic to move away, and the drain does not wait `shutdown.drain_delay_ms`.
    pub fn shutdown_before_ready(&self) {
        self.skip_drain_delay.store(true, std::sync::atomic::Ordering::Release);
        self.shutdown();
    }

    /// Resolves once the shutdown sequence started, whether asked for or because a task
    /// the daemon cannot run without panicked.
    pub async fn stopping(&self) {
        stopped(self.shutdown_tx.subscribe()).await;
    }

    /// Waits for the shutdown sequence to finish.
    pub async fn wait(self) -> ShutdownReport {
        match self.task.await {
            Ok(r) => r,
            Err(e) => ShutdownReport {
                drained: false,
                wal_closed: Err(format!("daemon task failed: {e}")),
                checkpoint: Err("not run".into()),
                failed_task: None,
            },
        }
    }
}

/// Fetches every route's `mapping_url` into the settings (see
/// [`crate::mapping_fetch::resolve_all`]), warning of what the tables fetched exceed:
/// the first step of a start, before anything is bound or opened, so that a stop while
/// it waits (each fetch may take 10 s) can end the process at once. A no-op where no
/// mapping is fetched, or all were already.
pub async fn fetch_mappings(settings: &mut Settings) -> Result<(), StartError> {
    let policies = settings.delivery.policies.clone();
    let mapping_warnings =
        crate::mapping_fetch::resolve_all(&mut settings.sources, |key| policies.for_source(key).max_destinations)
            .await
            .map_err(StartError::Mapping)?;
    for warning in mapping_warnings {
        tracing::warn!("configuration: {warning}");
    }
    Ok(())
}

/// Starts the daemon on `settings` (its mappings fetched first, if
/// [`fetch_mappings`] was not called). `metrics` renders `/metrics` (the process-wide
/// recorder, installed by the binary).
pub async fn start(mut settings: Settings, metrics: Option<PrometheusHandle>) -> Result<RunningDaemon, StartError> {
    // Every metric at zero from the first scrape on (a no-op without a recorder).
    crate::telemetry::register_all(settings.sources.iter().map(|s| s.key.as_str()));
    fetch_mappings(&mut settings).await?;
    // Read again here (validation read them too): the files may have changed since.
    let tls_of = |files: &Option<http_source::tls::TlsFiles>, listener: &'static str, section: &'static str| {
        files
            .clone()
            .map(|f| ListenerTls::new(f, listener).map_err(|error| StartError::Tls { listener, section, error }))
            .transpose()
    };
    let http_tls = tls_of(&settings.http_tls, "webhook", "http")?;
    let admin_tls = tls_of(&settings.admin_tls, "admin", "admin")?;
    // Bound first, served last: a port that is taken (an old process still stopping)
    // fails the start before the log is opened (which would mark it not cleanly shut
    // down) and before delivery begins. Until served, a connection waits in the backlog.
    let http_listener =
        server::bind(settings.http_listen).await.map_err(|source| StartError::Bind { listener: "webhook", source })?;
    let admin_listener =
        server::bind(settings.admin_listen).await.map_err(|source| StartError::Bind { listener: "admin", source })?;
    let http_addr = http_listener.local_addr().map_err(|source| StartError::Bind { listener: "webhook", source })?;
    let admin_addr = admin_listener.local_addr().map_err(|source| StartError::Bind { listener: "admin", source })?;
    wal::storage::create_dir_all_durably(&FsStorage, &settings.data_dir)
        .map_err(|source| StartError::DataDir { path: settings.data_dir.clone(), source })?;
    // A relative `storage.data_dir` is taken from the working directory: a start from
    // another one would find another (empty) log, so the log says which one this is.
    let data_dir_absolute = std::fs::canonicalize(&settings.data_dir).unwrap_or_else(|_| settings.data_dir.clone());
    tracing::info!(data_dir = %data_dir_absolute.display(), "data directory");
    let wal_dir = settings.wal_dir();
    // A recovery after a crash reads the log's tail (and more, damaged): off the async
    // worker, so that the binary's signal wait goes on meanwhile (a second stop signal
    // exits at once, as during the rest of the start).
    let opened = {
        let (dir, options) = (wal_dir.clone(), settings.wal.clone());
        tokio::task::spawn_blocking(move || Wal::open(&dir, options)).await
    };
    let wal = opened
        .map_err(|e| WalError::Io {
            path: wal_dir.clone(),
            source: std::io::Error::other(format!("open task failed: {e}")),
        })
        .and_then(|opened| opened)
        .map_err(|source| StartError::Wal { path: wal_dir.clone(), source })?;
    let report = wal.open_report();
    tracing::info!(dir = %wal_dir.display(), report = ?report, "log opened");
    let wal = Arc::new(wal);

    // The open removed the clean-shutdown marker (and may have cut a torn tail): a start
    // refused after it closes the log again, so that it is as a clean stop leaves it, not
    // taken for a crash by the next start, the log tools and an operator, and the next
    // open still tells damage in the last batch from a torn write.
    let OnLog { state, idempotency, endpoints, status, health, delivery } = match open_on_log(&settings, &wal).await {
        Ok(parts) => parts,
        Err(e) => {
            // Bounded as a stop's close is: the refusal may be the disk's (the state
            // database failing beside the log), and a sync it never answers must not hold
            // the start for ever, listeners bound and unserved.
            match close_log_by(&wal, tokio::time::Instant::now() + CLOSE_MAX).await {
                Some(Ok(())) => {}
                Some(Err(close)) => tracing::warn!(error = %close, "cannot close the log after a refused start"),
                None => tracing::warn!("after a refused start: not marked clean; the next start recovers it"),
            }
            return Err(e);
        }
    };

    let shared = Arc::new(Shared {
        wal: wal.clone(),
        state: state.clone(),
        endpoints: endpoints.clone(),
        idempotency: idempotency.clone(),
        status: status.clone(),
        health: health.clone(),
        admin_token: settings.admin_token.as_ref().map(|t| TokenDigest::of(t.expose())),
        management_token: settings.management_token.as_ref().map(|t| TokenDigest::of(t.expose())),
        metrics,
        delivery: delivery.clone(),
        body_read_timeout: settings.body_read_timeout,
        tls: http_tls.iter().chain(admin_tls.iter()).cloned().collect(),
    });
    let door = Arc::new(Door {
        sources: settings.sources.iter().map(|s| (s.key.clone(), Arc::new(s.clone()))).collect::<HashMap<_, _>>(),
        endpoints,
        ingestor: Ingestor::new(wal.clone(), idempotency.clone()),
        limits: DoorLimits {
            max_body_bytes: settings.max_body_bytes,
            max_events_per_request: settings.max_events_per_request,
            body_read_timeout: settings.body_read_timeout,
            retry_after_secs: settings.retry_after_secs,
        },
        health: health.clone(),
        status,
        metrics: http_source::metrics::DoorMetrics::new(settings.sources.iter().map(|s| s.key.as_str())),
    });

    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let shutdown_tx = Arc::new(shutdown_tx);
    let (failed_tx, mut failed_rx) = tokio::sync::mpsc::unbounded_channel::<&'static str>();
    let (http_stop_tx, http_stop_rx) = watch::channel(false);
    let (admin_stop_tx, admin_stop_rx) = watch::channel(false);
    let limits = ConnectionLimits {
        max_connections: settings.max_connections,
        header_read_timeout: settings.header_read_timeout,
        write_timeout: settings.write_timeout,
    };
    let grace = settings.grace_period;
    let http_task = spawn_essential(
        "the webhook listener",
        server::serve(
            http_listener,
            http_tls,
            http_source::router(door),
            limits.clone(),
            stopped(http_stop_rx),
            grace,
            "webhook",
        ),
        &failed_tx,
    );
    let admin_task = spawn_essential(
        "the admin listener",
        server::serve(
            admin_listener,
            admin_tls,
            crate::admin::router(shared.clone()),
            ConnectionLimits { max_connections: 64, ..limits.clone() },
            stopped(admin_stop_rx),
            Duration::from_secs(5),
            "admin",
        ),
        &failed_tx,
    );
    let sweep_clock = Arc::new(ingest::time::SweepClock::new());
    let checkpoint_task = spawn_essential(
        "the idempotency checkpoint",
        checkpoint_loop(idempotency.clone(), wal.clone(), settings.checkpoint_interval, sweep_clock.clone()),
        &failed_tx,
    );
    let upkeep_task = shared.metrics.clone().map(|h| {
        spawn_essential(
            "the metrics upkeep",
            crate::telemetry::upkeep_loop(h, crate::telemetry::UPKEEP_INTERVAL),
            &failed_tx,
        )
    });
    // The log's writer and the idempotency recorder are threads, not tasks: watched
    // here, so that a panic in either stops the daemon as one in the tasks above does
    // (the log marks itself poisoned and closed at once, so `/health` says `log_stopped`
    // meanwhile; without its recorder, no delivery id would be recorded and nothing
    // would say so).
    let thread_watch = {
        let failed = failed_tx.clone();
        let (wal, idempotency) = (wal.clone(), idempotency.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(THREAD_WATCH_INTERVAL);
            loop {
                tick.tick().await;
                if wal.writer_panicked() {
                    let _ = failed.send("the log's writer");
                    return;
                }
                if idempotency.recorder_stopped() {
                    let _ = failed.send("the idempotency recorder");
                    return;
                }
            }
        })
    };
    // Only the tasks hold senders now: once they are all gone, `recv` says so.
    drop(failed_tx);
    tracing::info!(webhook = %http_addr, admin = %admin_addr, "listening");

    let drain_delay = settings.drain_delay;
    let skip_drain_delay = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let skip_drain_delay_seen = skip_drain_delay.clone();
    let stop_tx = shutdown_tx.clone();
    let task = tokio::spawn(async move {
        let mut failed_task = until_stop_or_failure(shutdown_rx, &mut failed_rx, &stop_tx).await;
        tracing::info!("shutting down: draining");
        // Health first, so that a load balancer sends new traffic elsewhere; what still
        // arrives meanwhile is served (each 200 durable as ever), not refused.
        health.start_draining();
        if !skip_drain_delay_seen.load(std::sync::atomic::Ordering::Acquire) {
            tokio::time::sleep(drain_delay).await;
        }
        health.stop_accepting();
        // From here the whole drain is bounded by the grace period.
        let grace_ends = tokio::time::Instant::now() + grace;
        let _ = http_stop_tx.send(true);
        // A listener that panics during the drain stopped the daemon as surely as one
        // that panics before it: said so, and exit 1, not taken for a grace timeout.
        let drained = match http_task.await {
            Ok(d) => d.complete,
            Err(e) => {
                if e.is_panic() {
                    failed_task = failed_task.or(Some("the webhook listener"));
                }
                false
            }
        };
        // A periodic checkpoint restoring delivery ids from the log (after the state
        // database failed) reads on a blocking thread that an abort cannot interrupt:
        // it is told to end, so that the final checkpoint is not held behind it.
        idempotency.stop_restores();
        checkpoint_task.abort();
        // Stop sending and store the last cursors while the log is still open. A send
        // still waiting for Iggy when the grace period ends is abandoned with the
        // router: its records stay in the log above the stored cursors, and go again
        // (with the same message ids) after the restart.
        // At least ROUTER_STOP_MIN even when the requests took the whole grace period,
        // so that idle lanes stop and the acknowledged cursors are stored.
        let router_ends = grace_ends.max(tokio::time::Instant::now() + ROUTER_STOP_MIN);
        if tokio::time::timeout_at(router_ends, delivery.shutdown()).await.is_err() {
            tracing::warn!(
                grace_ms = grace.as_millis() as u64,
                "the router did not stop within the grace period: sends in flight abandoned, their records are sent again after the restart"
            );
        }
        // Closing the log and the last checkpoint are a sync each: bounded too, so that a
        // disk whose syncs never return cannot hold the exit for ever. Cut short, the log
        // is not marked clean, and the next start recovers it as after a crash (nothing
        // answered 200 is at stake: it is durable already).
        let close_ends = tokio::time::Instant::now() + CLOSE_MAX;
        let (wal_closed, checkpoint) = match close_log_by(&wal, close_ends).await {
            Some(closed) => {
                let checkpoint = idempotency.final_checkpoint(&wal, sweep_clock.now_unix_ms());
                let checkpoint = match tokio::time::timeout_at(close_ends, checkpoint).await {
                    Ok(c) => c.map_err(|e| e.to_string()),
                    Err(_) => {
                        // It waits for the idempotency recorder's pending ids, so the
                        // recorder may be stuck in the state database's disk: the last
                        // handle on the index must not wait for it as it goes (a drop
                        // joins the recorder).
                        std::mem::forget(idempotency.clone());
                        Err(format!(
                            "the final checkpoint did not finish within {} ms; the delivery ids since the last one are restored from the log at the next start",
                            CLOSE_MAX.as_millis()
                        ))
                    }
                };
                (closed.map_err(|e| e.to_string()), checkpoint)
            }
            None => {
                // Nor may the last handle on the idempotency index wait as it goes (a
                // drop joins its recorder, which writes beside the log, likely on the
                // same disk).
                std::mem::forget(idempotency.clone());
                (
                    Err(format!(
                        "the log did not close within {} ms: not marked clean, recovered at the next start",
                        CLOSE_MAX.as_millis()
                    )),
                    Err("not run: the log did not close".to_string()),
                )
            }
        };
        let _ = admin_stop_tx.send(true);
        // What is left of the grace period, and at least a moment for a scrape in flight:
        // a client holding an admin connection open (a half-sent request needs no token)
        // does not hold the exit past it. Nothing is at stake: the log is closed.
        let mut admin_task = admin_task;
        let admin_ends = grace_ends.max(tokio::time::Instant::now() + ADMIN_STOP_MIN);
        match tokio::time::timeout_at(admin_ends, &mut admin_task).await {
            Ok(Err(e)) if e.is_panic() => failed_task = failed_task.or(Some("the admin listener")),
            Ok(_) => {}
            Err(_) => {
                admin_task.abort();
                tracing::warn!(
                    grace_ms = grace.as_millis() as u64,
                    "admin connections still open at the end of the grace period: cut"
                );
            }
        }
        if let Some(t) = upkeep_task {
            t.abort();
        }
        thread_watch.abort();
        // A task the daemon cannot run without that panicked during the drain (after
        // the stop was asked for) is a failure of this run all the same: exit 1, named.
        if failed_task.is_none() {
            failed_task = failed_rx.try_recv().ok();
        }
        let report = ShutdownReport { drained, wal_closed, checkpoint, failed_task };
        tracing::info!(?report, "shutdown complete");
        report
    });
    Ok(RunningDaemon { http_addr, admin_addr, shared, shutdown_tx, task, skip_drain_delay })
}

/// What the start builds on the open log, each step of which may refuse the start.
struct OnLog {
    state: Arc<StateDb>,
    idempotency: Arc<IdempotencyIndex>,
    endpoints: Arc<EndpointRegistry>,
    status: Arc<StatusBoard>,
    health: Arc<Health>,
    delivery: Arc<crate::delivery::Delivery>,
}

/// The start's steps after the log is open: the state database, the idempotency
/// rebuild, the endpoints, delivery. [`start`] closes the log again if one fails.
async fn open_on_log(settings: &Settings, wal: &Arc<Wal>) -> Result<OnLog, StartError> {
    let state_path = settings.state_path();
    // Never an empty database in place of one lost or moved aside beside a log written
    // before: every record in the log would go to Iggy again, every dynamic endpoint
    // answer 404 and every revocation be forgotten, with nothing said.
    let log_next_offset = wal.next_offset();
    let state = {
        // Created whole (or not at all) and its name made durable (`StateDb::open`); file
        // work, on a blocking thread, as the checks around it.
        let p = state_path.clone();
        tokio::task::spawn_blocking(move || ingest::state::open_beside_a_log(&p, log_next_offset))
            .await
            .map_err(|e| StateError::Storage(format!("open task failed: {e}")))??
    };
    let Some(state) = state else {
        return Err(StartError::StateMissing { path: state_path, log_next_offset });
    };
    let state = Arc::new(state);
    // Before any offset the database holds is used (the rebuild's checkpoint, the keys'
    // answers, the cursors): they must be this log's.
    if let Some(found) = wal.open_report().log_id {
        let s = state.clone();
        let checked = tokio::task::spawn_blocking(move || s.check_or_record_log_id(found))
            .await
            .map_err(|e| StateError::Storage(format!("log identity task failed: {e}")))??;
        match checked {
            ingest::state::LogIdCheck::Other(recorded) => {
                let cause = match &wal.open_report().log_id_damaged {
                    Some(damage) => format!("its identity was damaged ({damage}), and the log was given a new one"),
                    None => "it was replaced, or deleted and begun again".to_string(),
                };
                let wal_dir = settings.wal_dir();
                return Err(StartError::LogNotTheStates { wal_dir, state_path, recorded, found, cause });
            }
            ingest::state::LogIdCheck::Recorded => {
                tracing::info!(log_id = %format!("{found:016x}"), "the state database now holds offsets of this log");
            }
            ingest::state::LogIdCheck::Same => {}
        }
    }
    let idempotency = Arc::new(
        IdempotencyIndex::new(state.clone(), settings.idempotency_retention.as_millis() as u64)
            .with_max_keys(settings.idempotency_max_keys),
    );
    let rebuilt = {
        let (idem, wal) = (idempotency.clone(), wal.clone());
        tokio::task::spawn_blocking(move || {
            // Before the rebuild, which restores the keys it re-reads in their scoped form.
            let forgotten = idem.forget_unscoped_keys_once()?;
            if forgotten > 0 {
                tracing::warn!(
                    forgotten,
                    "delivery ids recorded before they were scoped by endpoint were forgotten; a retry of one of those deliveries is appended again"
                );
            }
            idem.rebuild(&wal, ingest::time::now_unix_ms())
        })
        .await
        .map_err(|e| StateError::Storage(format!("rebuild task failed: {e}")))??
    };
    tracing::info!(?rebuilt, "idempotency keys rebuilt from the log");

    let source_keys: Vec<String> = settings.sources.iter().map(|s| s.key.clone()).collect();
    // A static endpoint past its `expires_at` is how an operator retires one (410 from
    // then on), and a restart after that time must not fail: said, not refused.
    let now_unix_ms = ingest::time::now_unix_ms();
    for e in settings.endpoints.iter().filter(|e| e.expires_at_unix_ms.is_some_and(|t| t <= now_unix_ms)) {
        tracing::warn!(
            endpoint = %http_source::endpoints::id_prefix(e.id),
            source = %e.source_key,
            "a static endpoint is past its expires_at: it answers 410 to every request"
        );
    }
    let endpoints = Arc::new(
        EndpointRegistry::load(state.clone(), source_keys.clone(), settings.endpoints.clone())?
            .with_tolerance_secs_max(
                settings.idempotency_retention.as_secs() / 2,
                settings.sources.iter().filter(|s| s.idempotency).map(|s| s.key.clone()).collect(),
            ),
    );
    let status = Arc::new(StatusBoard::new(source_keys));
    let health = Arc::new(Health::default());
    health.watch_log(wal.clone());

    // Delivery never waits for Iggy: the daemon accepts and holds while it is away.
    let known_at_start = crate::delivery::destinations_to_prewarm(&settings.sources, &settings.delivery.policies);
    let delivery = Arc::new(
        crate::delivery::Delivery::start(
            &settings.delivery,
            wal.clone(),
            state.clone(),
            idempotency.clone(),
            known_at_start,
        )
        .map_err(StartError::Delivery)?,
    );
    Ok(OnLog { state, idempotency, endpoints, status, health, delivery })
}

/// Spawns a task the daemon cannot run without. Should it panic, `name` goes to `failed`
/// as the panic unwinds (tokio keeps the panic itself to the join handle, which only the
/// shutdown awaits), and the daemon stops.
fn spawn_essential<F>(
    name: &'static str,
    task: F,
    failed: &tokio::sync::mpsc::UnboundedSender<&'static str>,
) -> JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let failed = failed.clone();
    router::spawn_task(task, move || {
        let _ = failed.send(name);
    })
}

/// How often the daemon looks whether the log's writer or the idempotency recorder
/// thread panicked.
const THREAD_WATCH_INTERVAL: Duration = Duration::from_millis(200);

/// The least time the router is given to stop, even past the grace period: enough to
/// end idle lanes and store the acknowledged cursors (a few milliseconds), never long
/// enough to matter to a service manager's stop timeout.
const ROUTER_STOP_MIN: Duration = Duration::from_secs(1);

/// The least time the admin listener is given to finish its requests at the end of a
/// stop, even past the grace period: a scrape or a `/status` in flight is answered in
/// milliseconds.
const ADMIN_STOP_MIN: Duration = Duration::from_millis(200);

/// The most time closing the log and the final checkpoint may take together, past the
/// grace period: each is a sync, milliseconds on a healthy disk. Past it the stop goes
/// on without them (exit 1, the log recovered at the next start as after a crash).
pub const CLOSE_MAX: Duration = Duration::from_secs(10);

/// The most time the process takes, at the end of a stop, for blocking work still under
/// way (a sync the disk does not answer) before it exits without it.
pub const RUNTIME_STOP_MAX: Duration = Duration::from_secs(1);

/// The most a stop takes past `shutdown.drain_delay_ms` + `shutdown.grace_period_ms`:
/// what a service manager's stop timeout must leave room for beyond those two.
pub const STOP_PAST_GRACE_MAX: Duration = Duration::from_millis(
    ROUTER_STOP_MIN.as_millis() as u64
        + CLOSE_MAX.as_millis() as u64
        + ADMIN_STOP_MIN.as_millis() as u64
        + RUNTIME_STOP_MAX.as_millis() as u64,
);

/// Closes the log (its last sync and the clean-shutdown marker) by `deadline`, the bound
/// of every close (`CLOSE_MAX`): a disk whose sync does not return by then is failing,
/// and neither a stop nor a refused start may wait on it for ever. `None` past it: the
/// log is left unmarked (the next start recovers it, losing nothing answered 200), and
/// its handle is left too, since dropping the last one would join the writer thread
/// stuck in the disk.
async fn close_log_by(wal: &Arc<Wal>, deadline: tokio::time::Instant) -> Option<Result<(), WalError>> {
    match tokio::time::timeout_at(deadline, wal.close()).await {
        Ok(closed) => Some(closed),
        Err(_) => {
            tracing::error!(
                close_max_ms = CLOSE_MAX.as_millis() as u64,
                "the log did not close in time (a sync the disk does not answer?): not marked clean; the next start recovers it, and every event answered 200 is in it"
            );
            std::mem::forget(wal.clone());
            None
        }
    }
}

/// Waits until a stop is asked for (`shutdown_rx`) or a task the daemon cannot run
/// without fails (`failed_rx`), and returns the failed task's name. A failure is
/// announced on `stop_tx` as a stop, for whoever waits on `stopping()` (the binary's
/// signal wait) at any time from now: the value is replaced whether or not a receiver is
/// there. With `send`, a failure before the binary's first wait (between the listeners
/// starting and its `select!`) left the value false once `shutdown_rx` was dropped here:
/// the daemon drained and closed everything, and the process stayed up, waiting for a
/// signal.
async fn until_stop_or_failure(
    shutdown_rx: watch::Receiver<bool>,
    failed_rx: &mut tokio::sync::mpsc::UnboundedReceiver<&'static str>,
    stop_tx: &watch::Sender<bool>,
) -> Option<&'static str> {
    let failed_task = tokio::select! {
        _ = stopped(shutdown_rx) => None,
        Some(name) = failed_rx.recv() => Some(name),
    };
    if let Some(name) = failed_task {
        tracing::error!(
            task = name,
            "a task the daemon cannot run without panicked (its message is above): stopping, exit status 1; \
             every event answered 200 is in the log"
        );
        stop_tx.send_replace(true);
    }
    failed_task
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    // A dropped sender also means stop.
    let _ = rx.wait_for(|stop| *stop).await;
}

/// Checkpoints on `clock`, shared with the final checkpoint at the stop: the sweeps of
/// expired delivery ids follow a step of the wall clock forward only as time passes
/// ([`ingest::time::SweepClock`]).
async fn checkpoint_loop(
    idempotency: Arc<IdempotencyIndex>,
    wal: Arc<Wal>,
    every: Duration,
    clock: Arc<ingest::time::SweepClock>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = idempotency.checkpoint(&wal, clock.now_unix_ms()).await {
            metrics::counter!("iggy_ingest_idempotency_checkpoint_failures_total").increment(1);
            tracing::error!(error = %e, "idempotency checkpoint failed (keys since the last one are rebuilt from the log on start)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A task that fails before anyone waits for the stop (the binary subscribes to
    /// `stopping()` only once it reaches its signal wait) still makes `stopping()`
    /// resolve when it is waited for later. Announced with `send`, with no receiver
    /// left, the stop was lost and the process outlived its own shutdown.
    #[tokio::test]
    async fn a_failure_before_anyone_waits_for_the_stop_still_stops_the_wait() {
        let (stop_tx, shutdown_rx) = watch::channel(false);
        let (failed_tx, mut failed_rx) = tokio::sync::mpsc::unbounded_channel();
        failed_tx.send("checkpoint").unwrap();
        assert_eq!(until_stop_or_failure(shutdown_rx, &mut failed_rx, &stop_tx).await, Some("checkpoint"));
        let waited = tokio::time::timeout(Duration::from_secs(5), stopped(stop_tx.subscribe())).await;
        assert!(waited.is_ok(), "the stop a failure announced was lost");

        // A stop asked for is no failure.
        let (stop_tx, shutdown_rx) = watch::channel(false);
        let (_failed_tx, mut failed_rx) = tokio::sync::mpsc::unbounded_channel::<&'static str>();
        stop_tx.send_replace(true);
        assert_eq!(until_stop_or_failure(shutdown_rx, &mut failed_rx, &stop_tx).await, None);
    }
}
