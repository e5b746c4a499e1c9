//! Durable append throughput on the real file system, beside its baseline.
//!
//! One criterion group per record size (256 B, 1 KiB, 16 KiB), `durable_append/{size}`:
//!
//! - `baseline/write+fdatasync_per_record`: one `write` + one `fdatasync` per record on a
//!   plain file (`std::fs`), the cost a log without group commit would pay. Measured
//!   first in each group, so it sees the same disk as the log runs right after it.
//! - `log/{n}_appenders` for 1, 16 and 256: `n` tasks on a multi-thread runtime share one
//!   log under `SyncPolicy::Always`; each appends one record per `append` call and
//!   awaits it before the next, so every record counted was written and `fdatasync`ed
//!   before its append resolved. One iteration appends a fixed number of records spread
//!   evenly over the appenders.
//!
//! Criterion reports records/s. At the end a summary table gives records/s, MB/s, the
//! baseline's records/s, the ratio, and what the log's own metrics say about its groups
//! (fsyncs per second, appends per group, mean fsync latency), so a missed target can be
//! explained from the same run. Last, a paired check alternates baseline and log bursts
//! (256 appenders) and reports the ratio per round, which drift in the disk's sync
//! latency (other I/O on the machine) cannot bias.
//!
//! The log lives in a temporary directory under `WAL_BENCH_DIR` if set, otherwise under
//! Cargo's target directory. Point it at the disk you care about: on tmpfs `fdatasync`
//! is free and the figures mean nothing (the bench warns).
//!
//! Run: `cargo bench -p iggy-ingest-wal --bench append`

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput};
use metrics::{Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use wal::{SyncPolicy, Wal, WalOptions};

const APPENDERS: [usize; 3] = [1, 16, 256];
const RECORD_SIZES: [usize; 3] = [256, 1024, 16 * 1024];
/// Records per baseline iteration (one sync each).
const BASELINE_RECORDS: usize = 256;

/// Records per iteration for a number of appenders: enough that one iteration takes tens
/// of milliseconds and every appender appends several times.
fn records_per_iteration(appenders: usize) -> usize {
    match appenders {
        1 => 256,
        n if n <= 16 => 128 * n,
        n => 32 * n,
    }
}

/// Counts what the log's writer reports about its groups and syncs.
#[derive(Default)]
struct WriterStats {
    groups: AtomicU64,
    group_appends: AtomicU64,
    fsyncs: AtomicU64,
    fsync_nanos: AtomicU64,
}

impl WriterStats {
    fn reset(&self) {
        for a in [&self.groups, &self.group_appends, &self.fsyncs, &self.fsync_nanos] {
            a.store(0, Ordering::Relaxed);
        }
    }
}

struct GroupHistogram(Arc<WriterStats>);
struct FsyncHistogram(Arc<WriterStats>);

impl HistogramFn for GroupHistogram {
    fn record(&self, value: f64) {
        self.0.groups.fetch_add(1, Ordering::Relaxed);
        self.0.group_appends.fetch_add(value as u64, Ordering::Relaxed);
    }
}

impl HistogramFn for FsyncHistogram {
    fn record(&self, seconds: f64) {
        self.0.fsyncs.fetch_add(1, Ordering::Relaxed);
        self.0.fsync_nanos.fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
    }
}

/// A metrics recorder that keeps only the two histograms the summary needs.
struct StatsRecorder(Arc<WriterStats>);

impl Recorder for StatsRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        match key.name() {
            "iggy_ingest_wal_group_commit_appends" => Histogram::from_arc(Arc::new(GroupHistogram(self.0.clone()))),
            "iggy_ingest_wal_fsync_seconds" => Histogram::from_arc(Arc::new(FsyncHistogram(self.0.clone()))),
            _ => Histogram::noop(),
        }
    }
}

/// What one benchmark saw over every iteration criterion ran (warm-up included).
#[derive(Debug, Default, Clone)]
struct Totals {
    /// Records per second of each iteration.
    rates: Vec<f64>,
    elapsed: Duration,
    groups: u64,
    group_appends: u64,
    fsyncs: u64,
    fsync_time: Duration,
}

impl Totals {
    /// The median iteration's rate: robust against the odd iteration a busy disk slowed.
    fn records_per_sec(&self) -> f64 {
        median(self.rates.clone())
    }
}

struct Bench {
    root: tempfile::TempDir,
    runtime: tokio::runtime::Runtime,
    stats: Arc<WriterStats>,
    /// Keyed by (appenders, size); appenders 0 is the baseline.
    results: Mutex<BTreeMap<(usize, usize), Totals>>,
}

impl Bench {
    fn new() -> Bench {
        let stats = Arc::new(WriterStats::default());
        if metrics::set_global_recorder(StatsRecorder(stats.clone())).is_err() {
            eprintln!("warning: a metrics recorder was already installed; group statistics will read zero");
        }
        let parent = std::env::var_os("WAL_BENCH_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
        std::fs::create_dir_all(&parent).expect("create the bench directory's parent");
        let root = tempfile::Builder::new().prefix("wal-bench-").tempdir_in(&parent).expect("create a temp dir");
        let fs = filesystem_of(root.path()).unwrap_or_else(|| "unknown".into());
        eprintln!("bench directory: {} (file system: {fs})", root.path().display());
        if fs == "tmpfs" || fs == "ramfs" {
            eprintln!("warning: {fs} does not make fdatasync durable; set WAL_BENCH_DIR to a real disk");
        }
        let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
        Bench { root, runtime, stats, results: Mutex::new(BTreeMap::new()) }
    }

    fn record(&self, key: (usize, usize), elapsed: Duration, records: u64) {
        let mut results = self.results.lock().unwrap_or_else(|p| p.into_inner());
        let t = results.entry(key).or_default();
        t.rates.push(records as f64 / elapsed.as_secs_f64().max(1e-9));
        t.elapsed += elapsed;
    }

    fn finish(&self, key: (usize, usize)) {
        let mut results = self.results.lock().unwrap_or_else(|p| p.into_inner());
        // Nothing to add to a benchmark the command line filtered out.
        let Some(t) = results.get_mut(&key) else { return };
        t.groups = self.stats.groups.load(Ordering::Relaxed);
        t.group_appends = self.stats.group_appends.load(Ordering::Relaxed);
        t.fsyncs = self.stats.fsyncs.load(Ordering::Relaxed);
        t.fsync_time = Duration::from_nanos(self.stats.fsync_nanos.load(Ordering::Relaxed));
    }
}

/// The type of the file system holding `path`, from the longest matching mount point.
fn filesystem_of(path: &Path) -> Option<String> {
    let path = path.canonicalize().ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_dev, mount, fstype) = (f.next()?, f.next()?, f.next()?);
            path.starts_with(mount).then(|| (mount.len(), fstype.to_string()))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, fs)| fs)
}

/// One group per record size: the baseline first, then the log with 1, 16 and 256
/// appenders, so each ratio compares runs minutes (not the whole bench) apart.
fn bench_size(c: &mut Criterion, bench: &Bench, size: usize) {
    let mut group = c.benchmark_group(format!("durable_append/{}", size_label(size).replace(' ', "")));
    group.sampling_mode(SamplingMode::Flat).sample_size(10).warm_up_time(Duration::from_secs(1));
    group.measurement_time(Duration::from_secs(5));
    bench_baseline(&mut group, bench, size);
    for &appenders in &APPENDERS {
        let per_appender = records_per_iteration(appenders) / appenders;
        let records = (per_appender * appenders) as u64;
        let dir = bench.root.path().join(format!("log-{appenders}x{size}"));
        let options = WalOptions { sync: SyncPolicy::Always, ..WalOptions::default() };
        let wal = Arc::new(Wal::open(&dir, options).expect("open the log"));
        let payload = Bytes::from(vec![0xA5u8; size]);
        bench.stats.reset();
        group.throughput(Throughput::Elements(records));
        group.bench_function(format!("log/{appenders}_appenders"), |b| {
            b.iter_custom(|iters| {
                let mut elapsed = Duration::ZERO;
                for _ in 0..iters {
                    let took = bench.runtime.block_on(append_concurrently(&wal, appenders, per_appender, &payload));
                    elapsed += took;
                    bench.record((appenders, size), took, records);
                    // Keep the disk use bounded; not part of the measured time.
                    let next = wal.next_offset();
                    bench.runtime.block_on(wal.release_below(next)).expect("release");
                }
                elapsed
            });
        });
        bench.finish((appenders, size));
        bench.runtime.block_on(wal.close()).expect("close the log");
        drop(wal);
        let _ = std::fs::remove_dir_all(&dir);
    }
    group.finish();
}

/// `appenders` tasks, each appending `per_appender` single-record batches one after the
/// other. Returns the time until the last append resolved.
async fn append_concurrently(wal: &Arc<Wal>, appenders: usize, per_appender: usize, payload: &Bytes) -> Duration {
    let start = Instant::now();
    let tasks: Vec<_> = (0..appenders)
        .map(|_| {
            let wal = wal.clone();
            let payload = payload.clone();
            tokio::spawn(async move {
                for _ in 0..per_appender {
                    wal.append(vec![payload.clone()]).await.expect("durable append");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("appender task");
    }
    start.elapsed()
}

fn bench_baseline(group: &mut BenchmarkGroup<'_, WallTime>, bench: &Bench, size: usize) {
    let path = bench.root.path().join(format!("baseline-{size}.dat"));
    let record = vec![0xA5u8; size];
    group.throughput(Throughput::Elements(BASELINE_RECORDS as u64));
    group.bench_function("baseline/write+fdatasync_per_record", |b| {
        b.iter_custom(|iters| {
            let mut elapsed = Duration::ZERO;
            for _ in 0..iters {
                // A fresh file per iteration, created outside the measured time.
                let mut file = OpenOptions::new()
                    .create(true)
                    .write(true)
                    .truncate(true)
                    .open(&path)
                    .expect("create the baseline file");
                file.sync_all().expect("sync the new file");
                let took = write_and_sync_each(&mut file, &record, BASELINE_RECORDS);
                elapsed += took;
                bench.record((0, size), took, BASELINE_RECORDS as u64);
            }
            elapsed
        });
    });
    let _ = std::fs::remove_file(&path);
}

fn write_and_sync_each(file: &mut File, record: &[u8], n: usize) -> Duration {
    let start = Instant::now();
    for _ in 0..n {
        file.write_all(record).expect("write");
        file.sync_data().expect("fdatasync");
    }
    start.elapsed()
}

fn print_summary(bench: &Bench) {
    let results = bench.results.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if results.is_empty() {
        return;
    }
    println!();
    println!("Summary: records/s of the median iteration (warm-up included); group figures are");
    println!("totals over all iterations; MB = 10^6 bytes");
    println!();
    println!(
        "| appenders | record | records/s | MB/s | baseline records/s | ratio | fsyncs/s | appends/group | mean fsync |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (&(appenders, size), t) in &results {
        if appenders == 0 {
            continue;
        }
        let rps = t.records_per_sec();
        let baseline = results.get(&(0, size)).map(Totals::records_per_sec);
        let (base, ratio) = match baseline {
            Some(b) => (format!("{b:.0}"), format!("{:.1}x", rps / b)),
            None => ("-".into(), "-".into()),
        };
        let fsyncs_per_sec = t.fsyncs as f64 / t.elapsed.as_secs_f64().max(1e-9);
        let per_group = t.group_appends as f64 / t.groups.max(1) as f64;
        let mean_fsync = t.fsync_time.as_secs_f64() * 1e6 / t.fsyncs.max(1) as f64;
        println!(
            "| {appenders} | {} | {rps:.0} | {:.1} | {base} | {ratio} | {fsyncs_per_sec:.0} | {per_group:.1} | {mean_fsync:.0} µs |",
            size_label(size),
            rps * size as f64 / 1e6,
        );
    }
    for (&(appenders, size), t) in &results {
        if appenders == 0 {
            let rps = t.records_per_sec();
            println!(
                "baseline {}: {rps:.0} records/s, {:.2} MB/s, {:.0} µs per write+fdatasync",
                size_label(size),
                rps * size as f64 / 1e6,
                1e6 / rps
            );
        }
    }
}

fn size_label(size: usize) -> String {
    if size >= 1024 { format!("{} KiB", size / 1024) } else { format!("{size} B") }
}

/// Rounds of the paired comparison per record size.
const PAIRED_ROUNDS: usize = 15;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The target, measured so that drift in the disk's sync latency cannot bias it:
/// rounds that alternate one baseline burst and one burst of the log with 256 appenders,
/// each ratio taken between neighbours.
fn print_paired(bench: &Bench) {
    let appenders = 256;
    let per_appender = records_per_iteration(appenders) / appenders;
    let records = (per_appender * appenders) as f64;
    println!();
    println!("Paired check: {PAIRED_ROUNDS} rounds of (baseline burst of {BASELINE_RECORDS} records, log burst of");
    println!("{records} records over {appenders} appenders), ratio per round");
    println!();
    println!("| record | log records/s (median) | baseline records/s (median) | ratio: median | ratio: min |");
    println!("|---:|---:|---:|---:|---:|");
    for &size in &RECORD_SIZES {
        let dir = bench.root.path().join(format!("paired-{size}"));
        let options = WalOptions { sync: SyncPolicy::Always, ..WalOptions::default() };
        let wal = Arc::new(Wal::open(&dir, options).expect("open the log"));
        let payload = Bytes::from(vec![0xA5u8; size]);
        let record = vec![0xA5u8; size];
        let path = bench.root.path().join(format!("paired-{size}.dat"));
        let (mut log_rates, mut base_rates, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..=PAIRED_ROUNDS {
            let mut file = File::create(&path).expect("create the baseline file");
            file.sync_all().expect("sync the new file");
            let base =
                BASELINE_RECORDS as f64 / write_and_sync_each(&mut file, &record, BASELINE_RECORDS).as_secs_f64();
            let took = bench.runtime.block_on(append_concurrently(&wal, appenders, per_appender, &payload));
            let log = records / took.as_secs_f64();
            let next = wal.next_offset();
            bench.runtime.block_on(wal.release_below(next)).expect("release");
            // Round 0 warms up.
            if round > 0 {
                log_rates.push(log);
                base_rates.push(base);
                ratios.push(log / base);
            }
        }
        bench.runtime.block_on(wal.close()).expect("close the log");
        drop(wal);
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_file(&path);
        let min_ratio = ratios.iter().copied().fold(f64::INFINITY, f64::min);
        println!(
            "| {} | {:.0} | {:.0} | {:.1}x | {:.1}x |",
            size_label(size),
            median(log_rates),
            median(base_rates),
            median(ratios),
            min_ratio
        );
    }
}

fn main() {
    let bench = Bench::new();
    let mut c = Criterion::default().configure_from_args();
    for &size in &RECORD_SIZES {
        bench_size(&mut c, &bench, size);
    }
    c.final_summary();
    print_summary(&bench);
    print_paired(&bench);
}
