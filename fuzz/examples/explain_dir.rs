//! Shows, step by step, what an `open_arbitrary_dir` input does to the log: the directory
//! it builds (each segment's header and frames), what `verify` and a read-only open say,
//! and what strict and salvage opens, an append, a close and a strict reopen do.
//! `cargo +nightly run --example explain_dir -- <input-file>`

use std::path::Path;
use std::sync::Arc;

use iggy_ingest_fuzz::{file_names, log_dir, open_dir, payload};
use wal::format::{FrameHeader, SEGMENT_HEADER_LEN, SegmentHeader};
use wal::storage::{SimStorage, Storage};
use wal::{RecoveryMode, Wal, WalOptions};

fn describe(bytes: &[u8]) -> String {
    let mut out = match SegmentHeader::decode(bytes) {
        Ok(h) => format!("header base={} flags={}", h.base_offset, h.flags),
        Err(p) => format!("header <{p}>"),
    };
    let mut pos = SEGMENT_HEADER_LEN as usize;
    while let Some(b) = bytes.get(pos..pos + 32) {
        match FrameHeader::decode(b) {
            Ok(h) => {
                let kind = if h.is_seal() {
                    "seal"
                } else if h.ends_batch() {
                    "end"
                } else {
                    "rec"
                };
                out +=
                    &format!(" | @{pos} {kind} offset={} len={} synced_len={}", h.offset, h.payload_len, h.synced_len);
                pos += h.frame_len() as usize;
            }
            Err(p) => {
                out += &format!(" | @{pos} <{p}>");
                break;
            }
        }
    }
    out
}

fn dump(sim: &SimStorage, label: &str) {
    let dir = log_dir();
    println!("--- {label}");
    for name in file_names(sim, &dir) {
        let bytes = sim.read_file(&dir.join(&name)).expect("read a listed file");
        let what = if name.ends_with(".seg") { describe(&bytes) } else { String::new() };
        println!("{name} ({} bytes) {what}", bytes.len());
    }
    let damaged = file_names(sim, &dir.join(wal::DAMAGED_DIR));
    if !damaged.is_empty() {
        println!("damaged/: {damaged:?}");
    }
}

fn options(segment: u8, recovery: RecoveryMode) -> WalOptions {
    WalOptions { segment_max_bytes: 96 + u64::from(segment) * 8, max_bytes: 1 << 30, recovery, ..WalOptions::default() }
}

/// Reads the whole log as a consumer would, without judging what comes back.
fn read_and_show(wal: &Wal) {
    let mut offsets = Vec::new();
    let error = match wal.reader(wal.start_offset()) {
        Err(e) => Some(e),
        Ok(mut reader) => loop {
            match reader.try_read(64, 4096) {
                Ok(batch) if batch.is_empty() => break None,
                Ok(batch) => offsets.extend(batch.iter().map(|r| r.offset)),
                Err(e) => {
                    println!("  (reader stands at {} after the error)", reader.position());
                    break Some(e);
                }
            }
        },
    };
    println!("  start={} next={} read offsets {offsets:?} error {error:?}", wal.start_offset(), wal.next_offset());
}

fn main() {
    let path = std::env::args().nth(1).expect("usage: explain_dir <input-file>");
    let data = std::fs::read(Path::new(&path)).expect("read the input");
    let (image, mutations, segment) = open_dir::decode(&data);
    println!("image: {image:?}");
    println!("mutations: {mutations:?}");
    let sim = SimStorage::new();
    open_dir::prepare(&sim, &image, &mutations);
    dump(&sim, "directory");
    let dir = log_dir();
    let storage: Arc<dyn Storage> = Arc::new(sim.clone());
    println!("verify: {:?}", wal::inspect::verify(&sim, &dir, &mut |_| {}));
    match Wal::open_read_only_with(storage.clone(), &dir) {
        Ok(w) => {
            println!("read-only open: {:?}", w.open_report());
            read_and_show(&w);
        }
        Err(e) => println!("read-only open: {e}"),
    }
    let wal = match Wal::open_with(storage.clone(), &dir, options(segment, RecoveryMode::Strict)) {
        Ok(w) => {
            println!("strict open: {:?}", w.open_report());
            w
        }
        Err(e) => {
            println!("strict open: {e}");
            match Wal::open_with(storage.clone(), &dir, options(segment, RecoveryMode::Salvage)) {
                Ok(w) => {
                    println!("salvage open: {:?}", w.open_report());
                    dump(&sim, "after salvage");
                    w
                }
                Err(e) => {
                    println!("salvage open: {e}");
                    return;
                }
            }
        }
    };
    read_and_show(&wal);
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    println!("append: {:?}", runtime.block_on(wal.append(vec![payload(u64::MAX, 100)])));
    println!("close: {:?}", runtime.block_on(wal.close()));
    drop(wal);
    dump(&sim, "after append and close");
    match Wal::open_with(storage, &dir, options(segment, RecoveryMode::Strict)) {
        Ok(w) => {
            println!("strict reopen: {:?}", w.open_report());
            read_and_show(&w);
        }
        Err(e) => println!("strict reopen: {e}"),
    }
}
