//! The dispatcher: reads the log once, in order, and hands each record to the lane of
//! its destination (creating lanes within the cap), applying admission at run time.
//!
//! Invariants:
//! - A record is handed to its lane (or disposed of by policy, or held) *before*
//!   `processed_below` moves past it, so the releaser, which reads `processed_below`
//!   first and the lanes second, never releases a record that is still owed.
//! - The dispatcher never waits for a lane: a full lane overflows and re-reads from the
//!   log, so one stuck destination cannot stall the others.
//! - Once the number of admitted destinations reaches the cap, the admitted set never
//!   changes while running, so "rejected for cap" is a stable property of a record (the
//!   dead-letter lane re-reading the log decides it the same way).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use ingest::envelope::Envelope;
use tokio::sync::watch;
use wal::{Record, Wal};

use crate::cursors::CursorStore;
use crate::lane::{self, Lane, LaneContext, Routed};
use crate::policy::{OnAdmissionFailure, RouterPolicy};
use crate::sink::{DestinationKey, Sink};

/// The set of destinations with a lane, shared with the lanes' re-read filter.
#[derive(Debug, Default)]
pub(crate) struct Admitted {
    pub keys: RwLock<HashSet<DestinationKey>>,
    pub max: usize,
}

impl Admitted {
    pub(crate) fn is_rejected_for_cap(&self, key: &DestinationKey) -> bool {
        let keys = self.keys.read().unwrap_or_else(|p| p.into_inner());
        keys.len() >= self.max && !keys.contains(key)
    }
}

pub(crate) struct Dispatcher<S, C> {
    pub wal: Arc<Wal>,
    pub policy: Arc<RouterPolicy>,
    pub lanes: Arc<RwLock<HashMap<DestinationKey, Arc<Lane>>>>,
    pub admitted: Arc<Admitted>,
    pub cursors_at_start: HashMap<DestinationKey, u64>,
    pub ctx: LaneContext<S, C>,
    /// The lowest offset held because it could not be admitted (`on_admission_failure =
    /// error`), pinning the log below it.
    pub held_from: Arc<AtomicU64>,
    pub dead_letter_lane: Option<Arc<Lane>>,
}

impl<S: Sink, C: CursorStore> Dispatcher<S, C> {
    pub(crate) async fn run(mut self, from: u64, mut shutdown: watch::Receiver<bool>) {
        let mut reader = match self.wal.reader(from) {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "router cannot read the log");
                return;
            }
        };
        let (max_records, max_bytes) = (self.policy.read_batch_max_records, self.policy.read_batch_max_bytes);
        loop {
            let batch = tokio::select! {
                r = reader.read(max_records, max_bytes) => r,
                _ = shutdown.changed() => return,
            };
            let batch = match batch {
                Ok(b) => b,
                Err(wal::WalError::Closed) => return,
                Err(e) => {
                    tracing::error!(error = %e, "router cannot read the log; retrying");
                    self.ctx.router_status.set_error(&e.to_string());
                    tokio::select! {
                        _ = tokio::time::sleep(self.policy.batch.backoff_max) => {}
                        _ = shutdown.changed() => return,
                    }
                    match self.wal.reader(reader.position()) {
                        Ok(r) => reader = r,
                        Err(e) => tracing::error!(error = %e, "router cannot reopen its reader"),
                    }
                    continue;
                }
            };
            for rec in batch {
                let offset = rec.offset;
                self.route(rec);
                self.ctx.processed_below.store(offset + 1, Ordering::Release);
            }
            self.ctx.delivered.notify_one();
        }
    }

    fn route(&mut self, rec: Record) {
        let envelope = match Envelope::decode(&rec.payload) {
            Ok(e) => e,
            Err(e) => {
                // Not a record this build can route: hold it (and the log below it) and say so.
                tracing::error!(offset = rec.offset, error = %e, "undecodable record held in the log");
                metrics::counter!("iggy_connector_destinations_rejected_total", "reason" => "malformed").increment(1);
                self.held_from.fetch_min(rec.offset, Ordering::AcqRel);
                return;
            }
        };
        let d = &envelope.header.destination;
        let key = DestinationKey::new(d.stream.clone(), d.topic.clone());
        let lane = match self.lane_for(&key) {
            Some(l) => l,
            None => {
                self.reject_for_cap(rec.offset, envelope);
                return;
            }
        };
        lane.offer(
            Routed { offset: rec.offset, envelope, dead_letter_reason: None },
            self.policy.lane_queue_max_records,
        );
    }

    fn lane_for(&mut self, key: &DestinationKey) -> Option<Arc<Lane>> {
        if let Some(l) = self.lanes.read().unwrap_or_else(|p| p.into_inner()).get(key) {
            return Some(l.clone());
        }
        if let Some(dl) = &self.dead_letter_lane
            && &dl.key == key
        {
            return Some(dl.clone());
        }
        {
            let mut admitted = self.admitted.keys.write().unwrap_or_else(|p| p.into_inner());
            if admitted.len() >= self.admitted.max {
                return None;
            }
            admitted.insert(key.clone());
        }
        let delivered_below = self.cursors_at_start.get(key).copied().unwrap_or(0);
        let lane = Arc::new(Lane::new(key.clone(), delivered_below, false));
        self.lanes.write().unwrap_or_else(|p| p.into_inner()).insert(key.clone(), lane.clone());
        let n = self.lanes.read().unwrap_or_else(|p| p.into_inner()).len();
        metrics::gauge!("iggy_connector_destinations_active").set(n as f64);
        tokio::spawn(lane::run(lane.clone(), self.ctx.clone()));
        Some(lane)
    }

    fn reject_for_cap(&mut self, offset: u64, envelope: Envelope) {
        metrics::counter!("iggy_connector_destinations_rejected_total", "reason" => "cap").increment(1);
        match self.policy.on_admission_failure {
            OnAdmissionFailure::Error => {
                let before = self.held_from.fetch_min(offset, Ordering::AcqRel);
                if before == u64::MAX {
                    tracing::error!(
                        offset,
                        max_destinations = self.admitted.max,
                        "destination cap reached: records held in the log"
                    );
                }
            }
            OnAdmissionFailure::Drop => {
                metrics::counter!("iggy_connector_messages_dropped_total", "reason" => "cap").increment(1);
                tracing::warn!(offset, "destination cap reached: record dropped, as configured");
            }
            OnAdmissionFailure::DeadLetter => match &self.dead_letter_lane {
                Some(dl) => dl.offer(
                    Routed { offset, envelope, dead_letter_reason: Some("cap") },
                    self.policy.lane_queue_max_records,
                ),
                None => {
                    self.held_from.fetch_min(offset, Ordering::AcqRel);
                }
            },
        }
    }
}
