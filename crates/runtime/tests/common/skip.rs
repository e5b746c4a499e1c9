//! Tests that need something of the machine (root for a tmpfs, `promtool`,
//! `systemd-analyze`, Python's YAML module) say so when it is missing, where the test
//! output shows it even for a test that passes, and fail instead when
//! `IGGY_INGEST_REQUIRE_ALL_CHECKS` is set: CI installs everything and sets it, so a
//! check that silently did not run cannot pass there.

use std::io::Write;

/// Skips `test` for `why` (writes past the test harness's capture), or panics when
/// every check is required.
pub fn skip_or_fail(test: &str, why: &str) {
    if std::env::var_os("IGGY_INGEST_REQUIRE_ALL_CHECKS").is_some() {
        panic!("{test} could not run ({why}), and IGGY_INGEST_REQUIRE_ALL_CHECKS is set");
    }
    // Not eprintln!: the harness captures that for a passing test.
    let _ = writeln!(std::io::stderr(), "SKIPPED {test}: {why}");
}
