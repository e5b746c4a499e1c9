//! `verify` throughput on a 1 GiB log beside a baseline in the same run: a raw
//! sequential read of the same segment files in 1 MiB chunks with `crc32fast` over every
//! byte (the cost of reading and checksumming, with no parsing at all).
//!
//! `cargo bench -p iggy-ingest-wal --bench verify` (env `VERIFY_BENCH_MIB` to change the
//! size, `VERIFY_BENCH_DIR` for where the log is written, `VERIFY_BENCH_CLI` to also time
//! a built `iggy-ingest wal verify` on the same log). Both sides read from a warm
//! page cache (the log was just written); rounds alternate so drift hits both alike.

use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use wal::storage::FsStorage;
use wal::{SyncPolicy, Wal, WalOptions};

const RECORD_BYTES: usize = 1024;
const BATCH_RECORDS: usize = 256;
const ROUNDS: usize = 5;

fn build(dir: &Path, mib: u64) -> u64 {
    let opts = WalOptions {
        max_bytes: (mib + 256) << 20,
        sync: SyncPolicy::Interval(Duration::from_secs(1)),
        ..WalOptions::default()
    };
    let wal = Wal::open(dir, opts).expect("open");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let target = mib << 20;
    let mut written = 0u64;
    let mut n = 0u64;
    rt.block_on(async {
        while written < target {
            let batch: Vec<Bytes> = (0..BATCH_RECORDS)
                .map(|i| {
                    let mut v = vec![0u8; RECORD_BYTES];
                    let tag = n + i as u64;
                    for (k, b) in v.iter_mut().enumerate() {
                        *b = (tag.wrapping_mul(31) as usize + k) as u8;
                    }
                    Bytes::from(v)
                })
                .collect();
            wal.append(batch).await.expect("append");
            n += BATCH_RECORDS as u64;
            written += (BATCH_RECORDS * (RECORD_BYTES + 32)) as u64;
        }
        wal.close().await.expect("close");
    });
    n
}

fn segment_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    v.sort();
    v
}

/// Reads every segment byte once in 1 MiB chunks and CRCs it; returns bytes read.
fn baseline(dir: &Path) -> u64 {
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    let mut crc = 0u32;
    for p in segment_files(dir) {
        let mut f = std::fs::File::open(&p).expect("open");
        loop {
            let n = f.read(&mut buf).expect("read");
            if n == 0 {
                break;
            }
            crc ^= crc32fast::hash(&buf[..n]);
            total += n as u64;
        }
    }
    std::hint::black_box(crc);
    total
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` runs this too: keep it tiny there.
    let quick = !std::env::args().any(|a| a == "--bench");
    let mib: u64 =
        std::env::var("VERIFY_BENCH_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(if quick { 8 } else { 1024 });
    let tmp = match std::env::var("VERIFY_BENCH_DIR") {
        Ok(d) => tempfile::tempdir_in(d),
        Err(_) => tempfile::tempdir(),
    }
    .expect("temp dir");
    let dir = tmp.path().join("wal");
    let t = Instant::now();
    let records = build(&dir, mib);
    let size: u64 = segment_files(&dir).iter().map(|p| std::fs::metadata(p).expect("stat").len()).sum();
    println!(
        "log: {records} records of {RECORD_BYTES} B, {} segment files, {:.2} GiB, written in {:.1}s",
        segment_files(&dir).len(),
        size as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64()
    );
    // With VERIFY_BENCH_CLI naming a built `iggy-ingest`, each round also times the
    // command an operator runs, end to end (process start, output, exit status).
    let cli = std::env::var("VERIFY_BENCH_CLI").ok();
    let (mut base, mut ver, mut cmd) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..if quick { 1 } else { ROUNDS } {
        let t = Instant::now();
        let read = baseline(&dir);
        let b = gbps(read, t.elapsed());
        let t = Instant::now();
        let report = wal::inspect::verify(&FsStorage, &dir, &mut |_| {}).expect("verify");
        let v = gbps(report.bytes, t.elapsed());
        assert!(report.is_clean() && report.records == records, "{report:?}");
        println!(
            "round {round}: baseline read+crc32 {b:.2} GB/s, verify {v:.2} GB/s ({:.0}% of baseline)",
            100.0 * v / b
        );
        base.push(b);
        ver.push(v);
        if let Some(bin) = &cli {
            let t = Instant::now();
            let status = std::process::Command::new(bin)
                .args(["wal", "verify"])
                .arg(&dir)
                .stdout(std::process::Stdio::null())
                .status()
                .expect("run the CLI");
            let c = gbps(report.bytes, t.elapsed());
            assert!(status.success(), "`wal verify` failed: {status}");
            println!("round {round}: `iggy-ingest wal verify` {c:.2} GB/s");
            cmd.push(c);
        }
    }
    if !cmd.is_empty() {
        println!("median `iggy-ingest wal verify`: {:.2} GB/s", median(cmd));
    }
    let rounds = ver.len();
    let (b, v) = (median(base), median(ver));
    println!(
        "median of {} rounds: baseline {b:.2} GB/s, verify {v:.2} GB/s ({:.0}% of baseline), {:.2} M records/s",
        rounds,
        100.0 * v / b,
        v * 1e9 / (size as f64 / records as f64) / 1e6
    );
}
