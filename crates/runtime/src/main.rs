//! The `iggy-ingest` command line.

fn main() {}
