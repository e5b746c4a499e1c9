//! Operation sequences against the log and a reference model; see `src/ops.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iggy_ingest_fuzz::ops::run(data));
