//! The webhook door's request path against the HTTP contract; see `src/door.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iggy_ingest_fuzz::door::run(data));
