//! Load and its ledger: senders that post numbered events at a steady rate to whichever
//! daemon is current, a record of what was sent and what got a 200, and the final check
//! of what a destination received against that record.
//!
//! An event is `{"src": S, "conn": C, "seq": N, "t": "a"|"b", ...}`: source `S`, the
//! sender's connection `C`, its sequence number `N` on that connection (a sender waits
//! for each answer before the next request, so `N` is also the order in which that
//! connection's events were accepted), and `t`, which the sources' route maps to topic
//! `alpha` or `beta`. A sender never re-sends: an event without a 200 stays unacknowledged
//! (it may or may not be in the log), and the next request carries the next number.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::task::JoinHandle;

use crate::daemon::Conn;

/// The topics events are routed to, by their `t`.
pub const TOPICS: [&str; 2] = ["alpha", "beta"];

/// The `[sources.*]` of `sources` sources (`s0`, `s1`, ...), each routing `t` into
/// `stream`'s topics `alpha` (t = a) and `beta` (t = b).
pub fn sources_config(stream: &str, sources: usize) -> String {
    (0..sources)
        .map(|s| {
            format!(
                "[sources.s{s}]\naccept = \"json\"\nroute = {{ topic_field = \"t\", default_stream = \"{stream}\", \
                 default_topic = \"alpha\", mapping = {{ a = \"alpha\", b = \"beta\" }} }}\n\n"
            )
        })
        .collect()
}

/// Which daemon the senders talk to. A test marks it down before it kills the daemon
/// and up again with the new address once the restart is ready.
#[derive(Debug)]
pub struct Target {
    http: RwLock<SocketAddr>,
    down: AtomicBool,
    epoch: AtomicU64,
}

impl Target {
    pub fn new(http: SocketAddr) -> Arc<Target> {
        Arc::new(Target { http: RwLock::new(http), down: AtomicBool::new(false), epoch: AtomicU64::new(0) })
    }
    pub fn http(&self) -> SocketAddr {
        *self.http.read().unwrap_or_else(|p| p.into_inner())
    }
    pub fn set_down(&self) {
        self.down.store(true, Ordering::SeqCst);
        self.epoch.fetch_add(1, Ordering::SeqCst);
    }
    pub fn set_up(&self, http: SocketAddr) {
        *self.http.write().unwrap_or_else(|p| p.into_inner()) = http;
        self.epoch.fetch_add(1, Ordering::SeqCst);
        self.down.store(false, Ordering::SeqCst);
    }
    fn is_down(&self) -> bool {
        self.down.load(Ordering::SeqCst)
    }
    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }
}

/// One event: (source, connection, sequence number).
pub type EventKey = (u32, u32, u64);

#[derive(Debug, Default)]
struct LedgerInner {
    sent: HashSet<EventKey>,
    acked: HashSet<EventKey>,
    /// Answers other than 200, with the body.
    refused: Vec<(EventKey, u16, String)>,
    /// No answer while the daemon was meant to be up (a request failed without a kill).
    unanswered_while_up: Vec<(EventKey, String)>,
    /// No answer because the daemon was being killed or restarted.
    unanswered_while_down: u64,
    /// Numbers skipped because the daemon was known to be down.
    not_posted_while_down: u64,
}

/// What was sent and what was acknowledged.
#[derive(Debug, Default)]
pub struct Ledger {
    inner: Mutex<LedgerInner>,
}

impl Ledger {
    fn with<R>(&self, f: impl FnOnce(&mut LedgerInner) -> R) -> R {
        f(&mut self.inner.lock().unwrap_or_else(|p| p.into_inner()))
    }
    pub fn sent(&self) -> usize {
        self.with(|l| l.sent.len())
    }
    pub fn acked(&self) -> usize {
        self.with(|l| l.acked.len())
    }
    pub fn acked_keys(&self) -> HashSet<EventKey> {
        self.with(|l| l.acked.clone())
    }
    pub fn refused(&self) -> Vec<(EventKey, u16, String)> {
        self.with(|l| l.refused.clone())
    }
    pub fn unanswered_while_up(&self) -> Vec<(EventKey, String)> {
        self.with(|l| l.unanswered_while_up.clone())
    }
    pub fn unanswered_while_down(&self) -> u64 {
        self.with(|l| l.unanswered_while_down)
    }
}

/// Senders posting at a steady rate until stopped.
pub struct Load {
    pub ledger: Arc<Ledger>,
    stop: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Load {
    /// `connections` senders per source, each posting one event every `period`.
    pub fn start(target: Arc<Target>, sources: u32, connections: u32, period: Duration) -> Load {
        let ledger = Arc::new(Ledger::default());
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for s in 0..sources {
            for c in 0..connections {
                tasks.push(tokio::spawn(sender(target.clone(), ledger.clone(), stop.clone(), s, c, period)));
            }
        }
        Load { ledger, stop, tasks }
    }

    /// Stops every sender and waits for its last request to finish.
    pub async fn stop(self) -> Arc<Ledger> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            let _ = t.await;
        }
        self.ledger
    }
}

async fn sender(
    target: Arc<Target>,
    ledger: Arc<Ledger>,
    stop: Arc<AtomicBool>,
    src: u32,
    conn: u32,
    period: Duration,
) {
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut connection: Option<(u64, Conn)> = None;
    let pad = "x".repeat(64);
    for seq in 0u64.. {
        tick.tick().await;
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let key = (src, conn, seq);
        if target.is_down() {
            // Being killed or restarted: this number is never posted.
            ledger.with(|l| l.not_posted_while_down += 1);
            continue;
        }
        let t = if seq % 2 == 0 { "a" } else { "b" };
        let body = format!(r#"{{"src":{src},"conn":{conn},"seq":{seq},"t":"{t}","pad":"{pad}"}}"#);
        ledger.with(|l| l.sent.insert(key));
        let epoch = target.epoch();
        let outcome = async {
            if connection.as_ref().is_none_or(|(e, _)| *e != epoch) {
                connection = None;
                let c = Conn::open(target.http()).await.map_err(|e| format!("connect: {e}"))?;
                connection = Some((epoch, c));
            }
            let Some((_, c)) = connection.as_mut() else { return Err("no connection".to_string()) };
            let path = format!("/v1/sources/s{src}");
            let sent = c.send("POST", &path, &[("content-type", "application/json")], Bytes::from(body));
            match tokio::time::timeout(Duration::from_secs(30), sent).await {
                Ok(Ok(a)) => Ok(a),
                Ok(Err(e)) => Err(format!("request: {e}")),
                Err(_) => Err("no answer within 30 s".to_string()),
            }
        }
        .await;
        match outcome {
            Ok(a) if a.status == 200 => ledger.with(|l| {
                l.acked.insert(key);
            }),
            Ok(a) => ledger.with(|l| l.refused.push((key, a.status, String::from_utf8_lossy(&a.body).into_owned()))),
            Err(why) => {
                connection = None;
                let excused = target.is_down() || target.epoch() != epoch;
                ledger.with(|l| {
                    if excused {
                        l.unanswered_while_down += 1;
                    } else {
                        l.unanswered_while_up.push((key, why));
                    }
                });
                if !excused {
                    // A daemon that died by itself (a fail point): do not spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

/// One message as a destination stored it.
#[derive(Debug, Clone)]
pub struct Delivered {
    pub topic: String,
    pub id: u128,
    pub payload: Bytes,
}

/// The outcome of comparing deliveries with the ledger.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    pub sent: usize,
    pub acknowledged: usize,
    /// Distinct events delivered (by id).
    pub delivered: usize,
    /// Messages delivered beyond the first copy of their id.
    pub duplicates: usize,
    /// Acknowledged events not delivered.
    pub lost: Vec<EventKey>,
    /// Delivered events that were never sent.
    pub invented: Vec<String>,
    /// Delivered but never acknowledged (in doubt when the daemon died: allowed).
    pub delivered_unacknowledged: usize,
    /// One event under two ids, or one id for two events.
    pub id_conflicts: Vec<String>,
    /// Per-connection order broken within a topic, or an event in the wrong topic.
    pub order_violations: Vec<String>,
}

impl Figures {
    /// Compares `delivered` (each topic in arrival order) with `ledger`.
    pub fn compute(ledger: &Ledger, delivered: &[Delivered]) -> Figures {
        let (sent, acked) = ledger.with(|l| (l.sent.clone(), l.acked.clone()));
        let mut f = Figures { sent: sent.len(), acknowledged: acked.len(), ..Figures::default() };
        let mut by_id: HashMap<u128, EventKey> = HashMap::new();
        let mut by_key: HashMap<EventKey, u128> = HashMap::new();
        let mut last_seq: BTreeMap<(String, u32, u32), u64> = BTreeMap::new();
        for m in delivered {
            let Some(key) = parse_event(&m.payload) else {
                f.invented.push(format!("unreadable payload {:?}", String::from_utf8_lossy(&m.payload)));
                continue;
            };
            if !sent.contains(&key) {
                f.invented.push(format!("{key:?} (id {:#x}) was never sent", m.id));
                continue;
            }
            match by_id.get(&m.id) {
                Some(k) if *k == key => {
                    f.duplicates += 1;
                    continue;
                }
                Some(k) => {
                    f.id_conflicts.push(format!("id {:#x} carries {k:?} and {key:?}", m.id));
                    continue;
                }
                None => {}
            }
            if let Some(other) = by_key.insert(key, m.id) {
                f.id_conflicts.push(format!("{key:?} delivered under ids {other:#x} and {:#x}", m.id));
            }
            by_id.insert(m.id, key);
            let want_topic = if key.2 % 2 == 0 { TOPICS[0] } else { TOPICS[1] };
            if m.topic != want_topic {
                f.order_violations.push(format!("{key:?} in topic {}, routed to {want_topic}", m.topic));
            }
            let last = last_seq.entry((m.topic.clone(), key.0, key.1)).or_insert(0);
            if key.2 < *last {
                f.order_violations.push(format!("{key:?} in {} after seq {}", m.topic, *last));
            }
            *last = (*last).max(key.2);
        }
        f.delivered = by_key.len();
        f.lost = acked.iter().filter(|k| !by_key.contains_key(k)).copied().collect();
        f.lost.sort();
        f.delivered_unacknowledged = by_key.keys().filter(|k| !acked.contains(k)).count();
        f
    }

    /// Every acknowledged event delivered, nothing invented, ids stable, order kept.
    pub fn assert_sound(&self, what: &str) {
        assert!(
            self.lost.is_empty(),
            "{what}: {} acknowledged events lost, first {:?}",
            self.lost.len(),
            &self.lost[..self.lost.len().min(10)]
        );
        assert!(
            self.invented.is_empty(),
            "{what}: invented events: {:?}",
            &self.invented[..self.invented.len().min(10)]
        );
        assert!(
            self.id_conflicts.is_empty(),
            "{what}: ids not stable: {:?}",
            &self.id_conflicts[..self.id_conflicts.len().min(10)]
        );
        assert!(
            self.order_violations.is_empty(),
            "{what}: order or routing broken: {:?}",
            &self.order_violations[..self.order_violations.len().min(10)]
        );
    }

    /// One line for the test output (and the figures in docs/durability.md).
    pub fn line(&self) -> String {
        format!(
            "sent {}, acknowledged {}, delivered {} (of them {} without a 200), duplicates {}, losses {}, invented {}",
            self.sent,
            self.acknowledged,
            self.delivered,
            self.delivered_unacknowledged,
            self.duplicates,
            self.lost.len(),
            self.invented.len()
        )
    }
}

fn parse_event(payload: &[u8]) -> Option<EventKey> {
    let v: serde_json::Value = serde_json::from_slice(payload).ok()?;
    Some((u32::try_from(v["src"].as_u64()?).ok()?, u32::try_from(v["conn"].as_u64()?).ok()?, v["seq"].as_u64()?))
}
