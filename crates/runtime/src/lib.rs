//! The `iggy-ingest` daemon: configuration, listeners, admin API, metrics and signals.
