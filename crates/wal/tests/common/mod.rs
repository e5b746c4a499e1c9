//! Helpers shared by the log's test themes.
#![allow(dead_code)]

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use wal::storage::{Hooks, SimStorage, Storage, StorageFile};
use wal::{Record, Wal, WalOptions};

pub fn dir() -> PathBuf {
    PathBuf::from("/sim/log")
}

pub fn small_options() -> WalOptions {
    WalOptions { segment_max_bytes: 4096, max_bytes: 1 << 20, ..WalOptions::default() }
}

pub fn open(sim: &SimStorage, opts: WalOptions) -> Wal {
    Wal::open_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &dir(), opts).expect("open")
}

pub fn try_open(sim: &SimStorage, opts: WalOptions) -> wal::Result<Wal> {
    Wal::open_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &dir(), opts)
}

/// A payload that names itself, so a test can tell every record from every other.
pub fn payload(tag: u64, len: usize) -> Bytes {
    let mut v = tag.to_le_bytes().to_vec();
    v.resize(len.max(8), (tag % 251) as u8);
    Bytes::from(v)
}

pub fn tag_of(p: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&p[..8]);
    u64::from_le_bytes(a)
}

/// Appends `payload(tag, len)` for each tag in `tags`, one record an append, each
/// awaited before the next.
pub fn append_tagged(wal: &Wal, tags: std::ops::Range<u64>, len: usize) {
    rt().block_on(async {
        for tag in tags {
            wal.append(vec![payload(tag, len)]).await.expect("append");
        }
    });
}

/// Every durable record from `from` on.
pub fn read_all(wal: &Wal, from: u64) -> Vec<Record> {
    let mut r = wal.reader(from).expect("reader");
    let mut out = Vec::new();
    loop {
        let b = r.try_read(1000, 1 << 20).expect("read");
        if b.is_empty() {
            return out;
        }
        out.extend(b);
    }
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime")
}

pub fn segment_files(sim: &SimStorage, dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = sim.list_dir(dir).unwrap().into_iter().filter(|n| n.ends_with(".seg")).collect();
    v.sort();
    v
}

/// Hooks for the simulated disk under which every file write takes at least
/// `write_delay` (a busy disk, or the kernel throttling dirty pages: what a log under
/// steady load meets).
#[derive(Debug)]
pub struct SlowWrites {
    pub write_delay: Duration,
}

impl Hooks for SlowWrites {
    fn write_all_at(&self, file: &dyn StorageFile, buf: &[u8], pos: u64) -> io::Result<()> {
        std::thread::sleep(self.write_delay);
        file.write_all_at(buf, pos)
    }
}

/// Waits up to 10 s for `done`, polling, and fails the test naming `what` if it never is.
#[allow(dead_code)] // Not every test binary that shares this module waits.
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
