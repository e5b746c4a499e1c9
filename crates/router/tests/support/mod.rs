//! Test doubles and helpers for the router's tests.
//!
//! `FaultySink` is a test double of the router's destination trait: an in-memory
//! destination that records what it acknowledged and fails on command, per destination
//! or for the whole "client".
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use ingest::envelope::{Destination, Envelope, EnvelopeHeader, Partitioning};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use router::{DestinationKey, OutMessage, SendError, SendErrorKind, Sink, TopicInfo};
use wal::storage::{HookedStorage, Hooks, SimStorage, Storage, StorageFile};
use wal::{Wal, WalOptions};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Fails every call with this kind.
    Fail(SendErrorKind),
    /// Fails every send with this kind; the destination exists (its ensure answers).
    FailSends(SendErrorKind),
    /// Never answers (the router's result timeout decides).
    BlackHole,
    /// Panics in the call, as a defect of the sink would: the lane's task ends.
    Panic,
    /// Answers every send, successfully, after this long: a healthy but slow server.
    Slow(Duration),
    /// Answers every send, successfully, after this long for each of its messages: a
    /// slow link, or a server slow to store.
    SlowPerMessage(Duration),
    /// Fails every send to this partition id with this kind; the others are answered.
    FailSendsToPartition(u32, SendErrorKind),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivered {
    pub id: u128,
    pub payload: Bytes,
    pub partitioning: Partitioning,
    pub headers: Vec<(String, Bytes)>,
}

#[derive(Debug, Default)]
struct State {
    delivered: BTreeMap<DestinationKey, Vec<Delivered>>,
    faults: HashMap<DestinationKey, Fault>,
    client_fault: Option<SendErrorKind>,
    partitions: HashMap<DestinationKey, u32>,
    calls: HashMap<DestinationKey, u64>,
    /// Every send's message count and payload bytes, answered or not.
    sizes: HashMap<DestinationKey, Vec<(usize, usize)>>,
    /// Every send's bytes as Iggy encodes its messages (header, index, payload, user
    /// headers), answered or not.
    wire_sizes: HashMap<DestinationKey, Vec<usize>>,
    ensured: HashMap<DestinationKey, u64>,
    /// How long every `ensure` takes from now on.
    ensure_delay: Option<Duration>,
    ensures_in_flight: u64,
    /// The most `ensure` calls in flight at once since [`FaultySink::set_ensure_delay`].
    ensures_peak: u64,
    /// [`FaultySink::set_connecting_when_an_ensure_is_cut_short`].
    connecting_at_cut_ensures: bool,
    /// `connecting` answers true this many more times.
    connecting_answers: u32,
}

#[derive(Debug, Default)]
pub struct FaultySink {
    state: Mutex<State>,
}

impl FaultySink {
    pub fn new() -> Arc<FaultySink> {
        Arc::new(FaultySink::default())
    }
    fn st(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }
    pub fn fault(&self, dest: &DestinationKey, f: Option<Fault>) {
        match f {
            Some(f) => self.st().faults.insert(dest.clone(), f),
            None => self.st().faults.remove(dest),
        };
    }
    pub fn client_fault(&self, f: Option<SendErrorKind>) {
        self.st().client_fault = f;
    }
    pub fn set_partitions(&self, dest: &DestinationKey, n: u32) {
        self.st().partitions.insert(dest.clone(), n);
    }
    pub fn delivered(&self, dest: &DestinationKey) -> Vec<Delivered> {
        self.st().delivered.get(dest).cloned().unwrap_or_default()
    }
    pub fn ids(&self, dest: &DestinationKey) -> Vec<u128> {
        self.delivered(dest).iter().map(|d| d.id).collect()
    }
    pub fn ensured(&self, dest: &DestinationKey) -> u64 {
        self.st().ensured.get(dest).copied().unwrap_or(0)
    }
    /// Every `ensure` from now on takes `d`; counts the most in flight at once from zero.
    pub fn set_ensure_delay(&self, d: Option<Duration>) {
        let mut st = self.st();
        st.ensure_delay = d;
        st.ensures_peak = 0;
    }
    /// From now on, an `ensure` cut short (its call dropped unanswered) leaves the sink
    /// connecting for the next `connecting` question, which the lane whose call it was
    /// asks at once: as when the sink is making a connection for another lane's next
    /// call the moment this one is judged (a call cut short costs its connection, so
    /// lanes cut short in step reconnect in step).
    pub fn set_connecting_when_an_ensure_is_cut_short(&self, on: bool) {
        self.st().connecting_at_cut_ensures = on;
    }
    pub fn ensures_peak(&self) -> u64 {
        self.st().ensures_peak
    }
    pub fn calls(&self, dest: &DestinationKey) -> u64 {
        self.st().calls.get(dest).copied().unwrap_or(0)
    }
    /// Each send's (messages, payload bytes), in order.
    pub fn send_sizes(&self, dest: &DestinationKey) -> Vec<(usize, usize)> {
        self.st().sizes.get(dest).cloned().unwrap_or_default()
    }
    /// Each send's bytes as Iggy encodes its messages: 64 bytes of header and 16 of
    /// index each, the payload, and each user header with its kind and length.
    pub fn wire_sizes(&self, dest: &DestinationKey) -> Vec<usize> {
        self.st().wire_sizes.get(dest).cloned().unwrap_or_default()
    }
    fn slow(&self, dest: &DestinationKey) -> Option<Duration> {
        match self.st().faults.get(dest) {
            Some(Fault::Slow(d)) => Some(*d),
            _ => None,
        }
    }
    fn slow_per_message(&self, dest: &DestinationKey) -> Option<Duration> {
        match self.st().faults.get(dest) {
            Some(Fault::SlowPerMessage(d)) => Some(*d),
            _ => None,
        }
    }
    fn check(&self, dest: &DestinationKey) -> Result<(), Option<SendError>> {
        self.check_call(dest, false)
    }

    /// `check` for a send: also fails under [`Fault::FailSends`].
    fn check_send(&self, dest: &DestinationKey) -> Result<(), Option<SendError>> {
        self.check_call(dest, true)
    }

    fn check_call(&self, dest: &DestinationKey, send: bool) -> Result<(), Option<SendError>> {
        // The state's lock is let go before a panic, so other destinations' calls go on.
        let (client_fault, fault) = {
            let st = self.st();
            (st.client_fault, st.faults.get(dest).copied())
        };
        if let Some(k) = client_fault {
            return Err(Some(SendError::new(k, "injected client fault")));
        }
        match fault {
            Some(Fault::Fail(k)) => Err(Some(SendError::new(k, "injected destination fault"))),
            Some(Fault::FailSends(k)) if send => Err(Some(SendError::new(k, "injected send fault"))),
            Some(Fault::FailSends(_)) => Ok(()),
            Some(Fault::BlackHole) => Err(None),
            Some(Fault::Panic) => panic!("injected panic in a call for {dest}"),
            Some(Fault::Slow(_) | Fault::SlowPerMessage(_) | Fault::FailSendsToPartition(..)) | None => Ok(()),
        }
    }
}

impl Sink for FaultySink {
    type Message = Prepared;

    fn prepare(&self, messages: &[OutMessage<'_>]) -> Result<Vec<Prepared>, SendError> {
        Ok(messages
            .iter()
            .map(|m| Prepared {
                id: m.id,
                payload: m.payload.clone(),
                headers: m.headers.iter().map(|(k, v)| (k.to_string(), Bytes::copy_from_slice(v))).collect(),
            })
            .collect())
    }

    async fn ensure(&self, dest: &DestinationKey) -> Result<TopicInfo, SendError> {
        *self.st().ensured.entry(dest.clone()).or_default() += 1;
        let delay = self.st().ensure_delay;
        if let Some(d) = delay {
            {
                let mut st = self.st();
                st.ensures_in_flight += 1;
                st.ensures_peak = st.ensures_peak.max(st.ensures_in_flight);
            }
            // Counted down even when the call is dropped at the router's timeout.
            struct InFlight<'a>(&'a FaultySink);
            impl Drop for InFlight<'_> {
                fn drop(&mut self) {
                    self.0.st().ensures_in_flight -= 1;
                }
            }
            let _in_flight = InFlight(self);
            tokio::time::sleep(d).await;
        }
        match self.check(dest) {
            Ok(()) => {}
            Err(Some(e)) => return Err(e),
            Err(None) => {
                // Dropped unanswered (cut short), it may leave the sink connecting.
                struct CutShort<'a>(&'a FaultySink);
                impl Drop for CutShort<'_> {
                    fn drop(&mut self) {
                        let mut st = self.0.st();
                        if st.connecting_at_cut_ensures {
                            st.connecting_answers += 1;
                        }
                    }
                }
                let _cut_short = CutShort(self);
                std::future::pending::<()>().await
            }
        }
        let partitions_count = self.st().partitions.get(dest).copied().unwrap_or(3);
        Ok(TopicInfo { partitions_count, durable: true })
    }

    fn connecting(&self) -> bool {
        let mut st = self.st();
        let connecting = st.connecting_answers > 0;
        st.connecting_answers = st.connecting_answers.saturating_sub(1);
        connecting
    }

    async fn send(&self, dest: &DestinationKey, p: &Partitioning, messages: &mut [Prepared]) -> Result<(), SendError> {
        {
            let mut st = self.st();
            *st.calls.entry(dest.clone()).or_default() += 1;
            let bytes = messages.iter().map(|m| m.payload.len()).sum();
            st.sizes.entry(dest.clone()).or_default().push((messages.len(), bytes));
            let wire = messages
                .iter()
                .map(|m| 80 + m.payload.len() + m.headers.iter().map(|(k, v)| 10 + k.len() + v.len()).sum::<usize>())
                .sum();
            st.wire_sizes.entry(dest.clone()).or_default().push(wire);
        }
        match self.check_send(dest) {
            Ok(()) => {}
            Err(Some(e)) => return Err(e),
            Err(None) => std::future::pending::<()>().await,
        }
        if let (Some(Fault::FailSendsToPartition(id, kind)), Partitioning::PartitionId(p)) =
            (self.st().faults.get(dest).copied(), p)
            && id == *p
        {
            return Err(SendError::new(kind, "injected fault of one partition's sends"));
        }
        if let Some(d) = self.slow(dest) {
            tokio::time::sleep(d).await;
        }
        if let Some(d) = self.slow_per_message(dest) {
            tokio::time::sleep(d * messages.len() as u32).await;
        }
        let mut st = self.st();
        // As Iggy does: a partition id the topic does not have fails the send.
        let partitions_count = st.partitions.get(dest).copied().unwrap_or(3);
        if let Partitioning::PartitionId(id) = p
            && *id >= partitions_count
        {
            return Err(SendError::new(SendErrorKind::Destination, format!("partition {id} not found")));
        }
        let v = st.delivered.entry(dest.clone()).or_default();
        for m in messages.iter() {
            v.push(Delivered {
                id: m.id,
                payload: m.payload.clone(),
                partitioning: p.clone(),
                headers: m.headers.clone(),
            });
        }
        Ok(())
    }
}

/// A message as `FaultySink` takes it: an owned copy of what the router handed over.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub id: u128,
    pub payload: Bytes,
    pub headers: Vec<(String, Bytes)>,
}

pub fn key(s: &str, t: &str) -> DestinationKey {
    DestinationKey::new(s, t)
}

/// An envelope for `dest` whose id and payload carry `n`.
pub fn record(dest: &DestinationKey, n: u64, partitioning: Partitioning) -> Bytes {
    record_from("test", dest, n, partitioning)
}

/// The same, as if it came in through `source`.
pub fn record_from(source: &str, dest: &DestinationKey, n: u64, partitioning: Partitioning) -> Bytes {
    record_received_at(source, dest, n, partitioning, 1_700_000_000_000 + n)
}

/// The same, received at `received_at_unix_ms`.
pub fn record_received_at(
    source: &str,
    dest: &DestinationKey,
    n: u64,
    partitioning: Partitioning,
    received_at_unix_ms: u64,
) -> Bytes {
    let header = EnvelopeHeader {
        message_id: u128::from(n) + 1,
        received_at_unix_ms,
        source_key: source.into(),
        endpoint_id: None,
        content_type: Some("application/json".into()),
        metadata: vec![],
        headers: vec![("x-n".into(), n.to_string().into_bytes())],
        idempotency_key: None,
        batch_index: 0,
        batch_len: 1,
        destination: Destination { stream: dest.stream.clone(), topic: dest.topic.clone(), partitioning },
    };
    Envelope::encode(&header, format!("{{\"n\":{n}}}").as_bytes())
}

pub fn open_wal(sim: &SimStorage) -> Arc<Wal> {
    let opts = WalOptions { segment_max_bytes: 16 * 1024, max_bytes: 64 << 20, ..WalOptions::default() };
    Arc::new(Wal::open_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &PathBuf::from("/sim/log"), opts).unwrap())
}

/// A router over `wal` delivering to `sink`, every source under `policy`, its cursors
/// kept in memory.
pub fn start_router(wal: &Arc<Wal>, sink: &Arc<FaultySink>, policy: router::RouterPolicy) -> router::Router {
    start_router_with(wal, sink, router::Policies::uniform(policy))
}

/// [`start_router`] under `policies` (a router-wide bound, per-source policies).
pub fn start_router_with(wal: &Arc<Wal>, sink: &Arc<FaultySink>, policies: router::Policies) -> router::Router {
    router::Router::start(wal.clone(), sink.clone(), Arc::new(router::test_doubles::MemoryCursorStore::new()), policies)
        .unwrap()
}

/// Every one of `dests` got exactly its records of `want`, in log order, each once.
pub fn assert_delivered_in_order(
    sink: &FaultySink,
    dests: &[DestinationKey],
    want: &BTreeMap<DestinationKey, Vec<u128>>,
) {
    for d in dests {
        assert_eq!(sink.ids(d), want[d], "lost, reordered or duplicated records of {d}");
    }
}

/// Appends `n` records round-robin over `dests`, one record per append; returns the
/// ids per destination in log order.
pub async fn fill(wal: &Wal, dests: &[DestinationKey], from: u64, n: u64) -> BTreeMap<DestinationKey, Vec<u128>> {
    fill_in_appends_of(wal, dests, from, n, 1).await
}

/// [`fill`] in appends of 100 records: for a test whose records must all be in the log
/// within a fault's few seconds, which one append per record (a round trip to the log's
/// writer thread each) may not make on a loaded machine.
pub async fn fill_fast(wal: &Wal, dests: &[DestinationKey], from: u64, n: u64) -> BTreeMap<DestinationKey, Vec<u128>> {
    fill_in_appends_of(wal, dests, from, n, 100).await
}

async fn fill_in_appends_of(
    wal: &Wal,
    dests: &[DestinationKey],
    from: u64,
    n: u64,
    per_append: u64,
) -> BTreeMap<DestinationKey, Vec<u128>> {
    let mut want: BTreeMap<DestinationKey, Vec<u128>> = BTreeMap::new();
    for first in (from..from + n).step_by(per_append as usize) {
        let numbers = first..(first + per_append).min(from + n);
        let mut batch = Vec::new();
        for i in numbers {
            let d = &dests[(i as usize) % dests.len()];
            batch.push(record(d, i, Partitioning::Balanced));
            want.entry(d.clone()).or_default().push(u128::from(i) + 1);
        }
        wal.append(batch).await.unwrap();
    }
    want
}

/// Waits (in the test's time) until `cond` holds, panicking after `limit`.
pub async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = tokio::time::Instant::now();
    while !cond() {
        if start.elapsed() > limit {
            panic!("timed out waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub fn fast_policy() -> router::RouterPolicy {
    let mut p = router::RouterPolicy::default();
    p.batch.linger = Duration::from_millis(1);
    p.batch.result_timeout = Duration::from_secs(2);
    p.batch.backoff_base = Duration::from_millis(50);
    p.batch.backoff_max = Duration::from_secs(2);
    p.batch.degraded_after_failures = 3;
    p.breaker.failure_threshold = 3;
    p.breaker.cool_down = Duration::from_secs(5);
    p
}

/// The sum of a metric's series in the exporter's rendering (the daemon's own exporter)
/// whose labels contain `label` (`""`: every series), e.g. `reason="cap"`.
pub fn metric(handle: &PrometheusHandle, name: &str, label: &str) -> f64 {
    handle
        .render()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, _)| (*k == name || k.starts_with(&format!("{name}{{"))) && k.contains(label))
        .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
        .sum()
}

/// A gauge's value: the sum of its series.
pub fn gauge(handle: &PrometheusHandle, name: &str) -> f64 {
    metric(handle, name, "")
}

/// Runs `test` on a single-threaded runtime (its clock paused when `paused`) with a
/// Prometheus recorder of its own, whose handle it gets.
pub fn with_metrics<F, Fut>(paused: bool, test: F)
where
    F: FnOnce(PrometheusHandle) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let recorder = PrometheusBuilder::new().build_recorder();
    let snap = recorder.handle();
    metrics::with_local_recorder(&recorder, || {
        let mut builder = tokio::runtime::Builder::new_current_thread();
        builder.enable_all().start_paused(paused);
        builder.build().unwrap().block_on(test(snap));
    });
}

/// Hooks for the simulated disk that count the bytes read from its files.
#[derive(Debug, Default)]
pub struct CountReads {
    bytes_read: AtomicU64,
}

impl Hooks for CountReads {
    fn read_at(&self, file: &dyn StorageFile, buf: &mut [u8], pos: u64) -> std::io::Result<usize> {
        let n = file.read_at(buf, pos)?;
        self.bytes_read.fetch_add(n as u64, Ordering::SeqCst);
        Ok(n)
    }
}

/// A storage double: the simulated disk, counting the bytes read from its files.
#[derive(Debug, Clone)]
pub struct CountingReads {
    storage: HookedStorage<CountReads>,
}

impl CountingReads {
    pub fn new(sim: &SimStorage) -> CountingReads {
        CountingReads { storage: HookedStorage::new(Arc::new(sim.clone()), CountReads::default()) }
    }

    pub fn bytes_read(&self) -> u64 {
        self.storage.hooks().bytes_read.load(Ordering::SeqCst)
    }

    /// The log of [`open_wal`] on this storage.
    pub fn open_wal(&self) -> Arc<Wal> {
        self.open_wal_with_segments_of(16 * 1024)
    }

    /// The same with segments of `segment_max_bytes`.
    pub fn open_wal_with_segments_of(&self, segment_max_bytes: u64) -> Arc<Wal> {
        let opts =
            WalOptions { segment_max_bytes, max_bytes: (64 << 20).max(2 * segment_max_bytes), ..WalOptions::default() };
        Arc::new(Wal::open_with(Arc::new(self.storage.clone()), &PathBuf::from("/sim/log"), opts).unwrap())
    }
}
