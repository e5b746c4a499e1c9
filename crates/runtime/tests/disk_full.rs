//! A full disk under the real daemon: its data directory (log and state database) on a
//! size-limited tmpfs, filled by accepted events and a filler file.
//!
//! While the disk is full the door answers 503 with `Retry-After` and a JSON body naming
//! the problem; nothing accepted before is lost or damaged (every acknowledged event is
//! read back from the log, byte for byte, at the offset its 200 named); once the filler is
//! deleted, ingest resumes without a restart, keyed requests included.
//!
//! Mounting needs root (CAP_SYS_ADMIN). Where mounting is not permitted the test prints
//! why and what it did not check, and returns.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

/// A tmpfs mounted for the test, unmounted on drop.
struct Tmpfs {
    path: PathBuf,
}

impl Tmpfs {
    fn mount(path: &Path, size: &str) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(path).map_err(|e| e.to_string())?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700"), "tmpfs"])
            .arg(path)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Tmpfs { path: path.to_path_buf() })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

const SOURCES: &str = r#"
[router]
enabled = false

[wal]
segment_max_bytes = 262144
max_bytes = 1073741824

[sources.default]
destination = { stream = "s", topic = "t" }
"#;

/// Event `n`: numbered, about 8 KiB, so the disk fills within a few hundred requests.
fn event(n: u64) -> String {
    format!("{{\"n\":{n},\"pad\":\"{}\"}}", "x".repeat(8 * 1024))
}

/// The value of an unlabelled metric (0 when not yet exported).
async fn metric(admin: std::net::SocketAddr, name: &str) -> f64 {
    let text = String::from_utf8_lossy(&request(admin, "GET", "/metrics", &[], "").await.body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Notes an event answered 200 (`a`): its body under its offset, which no earlier 200
/// may have named, and its delivery id under that offset when it had one (true then).
fn note_accepted(
    acked: &mut BTreeMap<u64, String>,
    keyed: &mut Vec<(String, u64)>,
    a: &Answer,
    body: String,
    key: Option<String>,
) -> bool {
    let offset = a.json()["offsets"][0].as_u64().unwrap();
    assert!(acked.insert(offset, body).is_none(), "offset {offset} acknowledged twice");
    key.map(|k| keyed.push((k, offset))).is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disk_full_answers_503_loses_nothing_and_resumes_when_space_returns() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let _mount = match Tmpfs::mount(&data, "8m") {
        Ok(m) => m,
        Err(why) => {
            skip_or_fail(
                "disk_full_answers_503_loses_nothing_and_resumes_when_space_returns",
                &format!("{why}. A full disk was NOT tested; run the tests as root (CAP_SYS_ADMIN) to mount a tmpfs"),
            );
            return;
        }
    };
    let d = Daemon::start(dir.path(), "max_body_bytes = 65536\nretry_after_secs = 7", SOURCES);
    let h = d.http;
    // Leave about 3 MiB for the log and the state database.
    let filler = data.join("filler");
    std::fs::write(&filler, vec![0u8; 5 << 20]).expect("the filler fits on the fresh tmpfs");

    // Acknowledged: offset → payload.
    let mut acked: BTreeMap<u64, String> = BTreeMap::new();
    // Keyed requests answered 200: delivery id → offset.
    let mut keyed: Vec<(String, u64)> = Vec::new();
    let mut n = 0u64;
    let mut refusals = 0;
    let send = async |n: u64| {
        let body = event(n);
        let key = format!("delivery-{n}");
        let mut headers = vec![("content-type", "application/json")];
        if n.is_multiple_of(2) {
            headers.push(("idempotency-key", key.as_str()));
        }
        let a = request(h, "POST", "/v1/sources/default", &headers, body.clone()).await;
        (a, body, n.is_multiple_of(2).then_some(key))
    };
    // Fill the disk: accept until the door refuses several in a row.
    while refusals < 5 {
        assert!(n < 2000, "8 MiB should be full long before 2000 events of 8 KiB");
        let (a, body, key) = send(n).await;
        n += 1;
        match a.status {
            200 => {
                refusals = 0;
                note_accepted(&mut acked, &mut keyed, &a, body, key);
            }
            503 => {
                refusals += 1;
                assert_eq!(a.header("retry-after"), Some("7"), "503 carries Retry-After");
                let j = a.json();
                // The log's write failed for space; or, for a keyed request, the state
                // database (on the same disk) could not be read before the append.
                assert!(j["error"] == "disk_full" || (key.is_some() && j["error"] == "state_unavailable"), "{j}");
            }
            other => panic!("event {n}: unexpected {other}: {:?}", String::from_utf8_lossy(&a.body)),
        }
    }
    // Stay full across several idempotency checkpoints (every 200 ms here), which write
    // to the state database on the same disk. A request may still fit now and then (a
    // failed write is cut back, a reopened state database is smaller): it is accepted
    // and must survive like any other; the rest are refused as above.
    let full_since = std::time::Instant::now();
    let mut refused_while_full = 0;
    // At least 1.5 s and ten refusals, however slowly a busy machine answers.
    while full_since.elapsed() < std::time::Duration::from_millis(1500) || refused_while_full < 10 {
        assert!(
            full_since.elapsed() < std::time::Duration::from_secs(60),
            "only {refused_while_full} refusals in 60 s while the disk was full"
        );
        let (a, body, key) = send(n).await;
        n += 1;
        if a.status == 200 {
            note_accepted(&mut acked, &mut keyed, &a, body, key);
        } else {
            assert_eq!(a.status, 503, "still full: {:?}", String::from_utf8_lossy(&a.body));
            assert!(a.header("retry-after").is_some());
            refused_while_full += 1;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(refused_while_full >= 10, "only {refused_while_full} refusals while the disk was full");
    assert!(acked.len() >= 50, "the disk filled after only {} events", acked.len());
    let st = request(d.admin, "GET", "/status", &[], "").await.json();
    assert_eq!(st["log"]["next_offset"], acked.len() as u64, "refused requests appended nothing: {st}");
    let m = String::from_utf8_lossy(&request(d.admin, "GET", "/metrics", &[], "").await.body).into_owned();
    assert!(m.contains(r#"iggy_ingest_http_rejected_total{source="default",reason="disk_full"}"#), "{m}");
    // Right after a refusal for space (nothing writes to the log in between), the log
    // says the disk is full, in /status and its gauge; health stays 200 (only a write
    // can tell that space came back: docs/http.md).
    for tries in 0.. {
        assert!(tries < 200, "no refusal for space in 200 requests on the full disk");
        let (a, body, key) = send(n).await;
        n += 1;
        if a.status == 200 {
            note_accepted(&mut acked, &mut keyed, &a, body, key);
        } else if a.json()["error"] == "disk_full" {
            break;
        }
    }
    let st = request(d.admin, "GET", "/status", &[], "").await.json();
    assert_eq!(st["log"]["disk_full"], true, "{st}");
    assert_eq!(st["log"]["full"], false, "the log itself is not full: {st}");
    assert_eq!(metric(d.admin, "iggy_ingest_wal_disk_full").await, 1.0);
    assert_eq!(request(h, "GET", "/health", &[], "").await.status, 200);

    // Space returns. Without a restart, every request without a delivery id is accepted
    // at once. Keyed ones too, unless the state database (on the same disk) latched an
    // I/O error while it was full: they get 503 state_unavailable until it is reopened
    // (started by the first refused lookup, and by every idempotency checkpoint), then are
    // accepted and their ids recorded again.
    // A keyed request is answered before its id is recorded: the recorder counts a
    // failure a few milliseconds after the 200 (it gathers ids for 4 ms), so the counter
    // is read once the last ids answered had time to be recorded.
    let record_settles = std::time::Duration::from_millis(100);
    tokio::time::sleep(record_settles).await;
    let state_failed = metric(d.admin, "iggy_ingest_idempotency_checkpoint_failures_total").await > 0.0
        || metric(d.admin, "iggy_ingest_idempotency_record_failures_total").await > 0.0;
    std::fs::remove_file(&filler).unwrap();
    let mut keyed_accepted_after = 0;
    let mut state_refusals = 0;
    while keyed_accepted_after < 20 {
        assert!(state_refusals < 100, "keyed requests still refused after {state_refusals} tries");
        let failures = metric(d.admin, "iggy_ingest_idempotency_record_failures_total").await;
        let (a, body, key) = send(n).await;
        n += 1;
        if a.status == 503 && key.is_some() {
            assert_eq!(a.json()["error"], "state_unavailable", "{:?}", String::from_utf8_lossy(&a.body));
            // Read again: a checkpoint (every 200 ms) or a slow recorder may have failed
            // on the full disk after the counters were read, before space returned.
            let failed_since = metric(d.admin, "iggy_ingest_idempotency_checkpoint_failures_total").await > 0.0
                || metric(d.admin, "iggy_ingest_idempotency_record_failures_total").await > 0.0;
            assert!(state_failed || failed_since, "the state database refused without having failed");
            state_refusals += 1;
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            continue;
        }
        assert_eq!(a.status, 200, "after space returned: {:?}", String::from_utf8_lossy(&a.body));
        let was_keyed = note_accepted(&mut acked, &mut keyed, &a, body, key);
        if was_keyed {
            tokio::time::sleep(record_settles).await;
        }
        if was_keyed && metric(d.admin, "iggy_ingest_idempotency_record_failures_total").await == failures {
            keyed_accepted_after += 1;
        }
    }
    let st = request(d.admin, "GET", "/status", &[], "").await.json();
    assert_eq!(st["log"]["disk_full"], false, "events are written again: {st}");
    assert_eq!(metric(d.admin, "iggy_ingest_wal_disk_full").await, 0.0);
    // A retry of a delivery accepted before the disk filled is still recognized.
    let (first_key, first_offset) = keyed[0].clone();
    let first_n: u64 = first_key.trim_start_matches("delivery-").parse().unwrap();
    let again = request(
        h,
        "POST",
        "/v1/sources/default",
        &[("content-type", "application/json"), ("idempotency-key", &first_key)],
        event(first_n),
    )
    .await;
    assert_eq!((again.status, again.header("idempotent-replayed")), (200, Some("true")));
    assert_eq!(again.json()["offsets"], serde_json::json!([first_offset, first_offset]));

    assert!(d.stop().success(), "a clean stop (log closed, final checkpoint written) once space returned");
    let log = read_log(&data.join("wal"));
    let offsets: Vec<u64> = log.iter().map(|(o, _)| *o).collect();
    assert_eq!(offsets, acked.keys().copied().collect::<Vec<_>>(), "exactly the acknowledged offsets, dense");
    for (offset, env) in &log {
        assert_eq!(env.payload.as_ref(), acked[offset].as_bytes(), "offset {offset}");
    }
    eprintln!(
        "disk full: {} events acknowledged, {n} requests sent; the state database {} (keyed requests refused {state_refusals} times after space returned)",
        acked.len(),
        if state_failed { "failed too and was reopened" } else { "did not fail" },
    );
}
