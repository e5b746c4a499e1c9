//! `ops_vs_model` with faults that may also fail reads; see `src/ops.rs`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| iggy_ingest_fuzz::ops::run_with_read_faults(data));
