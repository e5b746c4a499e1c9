//! Opening a log directory built from arbitrary bytes; see `src/open_dir.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iggy_ingest_fuzz::open_dir::run(data));
