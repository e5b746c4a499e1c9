//! `iggy-ingest wal ...` run as the built binary on logs made by the wal crate (clean,
//! torn tail, damaged middle, empty, not a log) and on the log of a running daemon
//! receiving traffic: output and exit codes.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::Bytes;
use common::*;
use ingest::{CursorRow, Destination, Envelope, EnvelopeHeader, Partitioning, StateDb};
use serde_json::Value;
use wal::{Wal, WalOptions};

fn cli(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iggy-ingest")).arg("wal").args(args).output().expect("run iggy-ingest")
}

fn cli_in(args: &[&str], dir: &Path) -> Output {
    let mut all: Vec<&str> = args.to_vec();
    let d = dir.to_str().unwrap();
    all.insert(1, d);
    cli(&all)
}

/// `iggy-ingest ARGS` whose standard output is a pipe no one reads (closed before it
/// writes, as `| grep -q`, `| head -0` or a pager quit at once leave it).
fn run_into_a_closed_pipe(args: &[&str]) -> Output {
    use std::os::fd::FromRawFd;
    let mut fds = [0i32; 2];
    // SAFETY: pipe(2) fills the two descriptors; the read end is closed at once and the
    // write end is owned by the child's standard output from here.
    let write_end = unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        libc::close(fds[0]);
        std::os::fd::OwnedFd::from_raw_fd(fds[1])
    };
    Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(args)
        .stdout(Stdio::from(write_end))
        .output()
        .expect("run iggy-ingest")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or_else(|| panic!("killed by a signal: {o:?}"))
}

fn json_lines(o: &Output) -> Vec<Value> {
    stdout(o).lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect()
}

fn json(o: &Output) -> Value {
    let v = json_lines(o);
    assert_eq!(v.len(), 1, "{}", stdout(o));
    v.into_iter().next().unwrap()
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

const T0: u64 = 1_760_000_000_000;

/// Record `i`'s `x-event` header: `e{i}`, or, for every seventh, those bytes cut inside
/// a UTF-8 character (as the door's clamp to 255 bytes can).
fn header_value(i: u64) -> Vec<u8> {
    let mut v = format!("e{i}").into_bytes();
    if i % 7 == 6 {
        v.push("é".as_bytes()[0]);
    }
    v
}

/// Record `i`: sources alternate github/stripe, destinations events/push and
/// events/orders; every fifth payload is binary.
fn envelope(i: u64) -> Bytes {
    let (source, topic) = if i.is_multiple_of(2) { ("github", "push") } else { ("stripe", "orders") };
    let header = EnvelopeHeader {
        message_id: u128::from(i) << 64 | 0xabc,
        received_at_unix_ms: T0 + i * 1000,
        source_key: source.into(),
        endpoint_id: None,
        content_type: Some("application/json".into()),
        metadata: vec![],
        headers: vec![("x-event".into(), header_value(i))],
        idempotency_key: Some(format!("d-{i}")),
        batch_index: 0,
        batch_len: 1,
        destination: Destination {
            stream: "events".into(),
            topic: topic.into(),
            partitioning: if i.is_multiple_of(3) { Partitioning::Key(b"k".to_vec()) } else { Partitioning::Balanced },
        },
    };
    let payload = if i % 5 == 4 { vec![0xff, 0xfe, i as u8, 0] } else { format!("{{\"n\":{i}}}").into_bytes() };
    Envelope::encode(&header, &payload)
}

/// Appends `record` to `wal` and closes it, from async code.
async fn rt_append(wal: &Wal, record: Bytes) {
    wal.append(vec![record]).await.unwrap();
    wal.close().await.unwrap();
}

fn small() -> WalOptions {
    WalOptions { segment_max_bytes: 4096, max_bytes: 1 << 24, ..WalOptions::default() }
}

/// A log of `n` records in `root/wal` (one record per append), closed cleanly.
fn make_log(root: &Path, n: u64, opts: WalOptions) -> PathBuf {
    let dir = root.join("wal");
    let wal = Wal::open(&dir, opts).unwrap();
    rt().block_on(async {
        for i in 0..n {
            wal.append(vec![envelope(i)]).await.unwrap();
        }
        wal.close().await.unwrap();
    });
    dir
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    v.sort();
    v
}

#[test]
fn a_clean_log_verifies_dumps_inspects_and_salvages_to_the_same_records() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 40, small());
    assert!(segments(&dir).len() > 1, "the test wants several segments");

    let o = cli_in(&["verify"], &dir);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("40 record(s)") && stdout(&o).ends_with(": clean\n"), "{}", stdout(&o));
    assert!(o.stderr.is_empty(), "no progress bar when stderr is not a terminal: {}", stderr(&o));
    let v = json(&cli_in(&["verify", "--json"], &dir));
    assert_eq!((v["clean"].as_bool(), v["records"].as_u64()), (Some(true), Some(40)));
    assert!(v["problems"].as_array().unwrap().is_empty() && v["torn_tail"].is_null());

    // dump: every record, decoded, in order; binary payloads as base64.
    let lines = json_lines(&cli_in(&["dump", "--json"], &dir));
    assert_eq!(lines.len(), 40);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["offset"].as_u64(), Some(i as u64));
        assert_eq!(l["received_at_unix_ms"].as_u64(), Some(T0 + i as u64 * 1000));
        assert_eq!(l["id"].as_str().unwrap(), format!("{:032x}", (i as u128) << 64 | 0xabc));
        let header = &l["headers"][0];
        let shown = header["value"].as_str().unwrap().as_bytes().to_vec();
        match header["encoding"].as_str() {
            Some("utf-8") => assert_eq!(shown, header_value(i as u64)),
            Some("base64") => {
                assert_eq!(base64::engine::general_purpose::STANDARD.decode(shown).unwrap(), header_value(i as u64));
                assert_eq!(i % 7, 6, "a UTF-8 value in base64: {header}");
            }
            _ => panic!("{header}"),
        }
        if i % 5 == 4 {
            assert_eq!(l["payload_encoding"], "base64");
            let raw = base64::engine::general_purpose::STANDARD.decode(l["payload"].as_str().unwrap()).unwrap();
            assert_eq!(raw, vec![0xff, 0xfe, i as u8, 0]);
        } else {
            assert_eq!(l["payload"].as_str().unwrap(), format!("{{\"n\":{i}}}"));
        }
    }
    assert_eq!(lines[3]["partitioning"]["key"], "k");
    assert_eq!(lines[1]["destination"]["topic"], "orders");

    // Filters, --from and --limit (counting shown records).
    let o = cli_in(&["dump", "--source", "stripe", "--from", "10", "--limit", "3", "--json"], &dir);
    let offs: Vec<u64> = json_lines(&o).iter().map(|l| l["offset"].as_u64().unwrap()).collect();
    assert_eq!(offs, vec![11, 13, 15]);
    let o = cli_in(&["dump", "--destination", "events/push", "--payload-only", "--limit", "2"], &dir);
    assert_eq!(stdout(&o), "{\"n\":0}\n{\"n\":2}\n");
    let o = cli_in(&["dump", "--limit", "1"], &dir);
    let text = stdout(&o);
    assert!(text.starts_with("#0 2025-10-09T08:53:20.000Z github -> events/push (key:k) id="), "{text}");
    assert!(
        text.contains("  header x-event: e0\n") && text.contains("  payload (7 bytes, utf-8): {\"n\":0}\n"),
        "{text}"
    );

    // Bad arguments: exit 2 with one line.
    for args in [&["dump", "--destination", "nope"][..], &["dump", "--from", "999"][..]] {
        let o = cli_in(args, &dir);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert_eq!(stderr(&o).lines().count(), 1, "{}", stderr(&o));
    }

    // inspect, with cursors from a stopped daemon's state database.
    let state = StateDb::open(root.path().join("state.redb")).unwrap();
    let row = |s: &str, t: &str, at| CursorRow {
        source: s.into(),
        stream: "events".into(),
        topic: t.into(),
        delivered_below: at,
    };
    state.store_cursors(&[row("github", "push", 30), row("stripe", "orders", 0)]).unwrap();
    // Cursors of another log are not counted against this one.
    let ours = wal::identity::read_in(&dir).unwrap().expect("the log has an identity");
    assert_eq!(state.check_or_record_log_id(ours ^ 1).unwrap(), ingest::state::LogIdCheck::Recorded);
    drop(state);
    let v = json(&cli_in(&["inspect", "--json"], &dir));
    assert_eq!(v["destinations"]["cursors_from"], "unavailable", "{v}");
    assert!(v["destinations"]["note"].as_str().unwrap_or_default().contains("another log's"), "{v}");
    std::fs::remove_file(root.path().join("state.redb")).unwrap();
    let state = StateDb::open(root.path().join("state.redb")).unwrap();
    assert_eq!(state.check_or_record_log_id(ours).unwrap(), ingest::state::LogIdCheck::Recorded);
    state.store_cursors(&[row("github", "push", 30), row("stripe", "orders", 0)]).unwrap();
    drop(state);
    let v = json(&cli_in(&["inspect", "--json"], &dir));
    assert_eq!(v["writer_running"], false);
    assert_eq!(v["clean_shutdown"], true);
    assert_eq!((v["start_offset"].as_u64(), v["next_offset"].as_u64()), (Some(0), Some(40)));
    let segs = v["segments"].as_array().unwrap();
    assert_eq!(segs.iter().map(|s| s["records"].as_u64().unwrap()).sum::<u64>(), 40);
    assert_eq!(segs[0]["first_record_at"], "2025-10-09T08:53:20.000Z");
    assert_eq!(v["destinations"]["cursors_from"], "state");
    let lanes = v["destinations"]["lanes"].as_array().unwrap();
    let push = lanes.iter().find(|l| l["topic"] == "push").unwrap();
    // github/push holds offsets 30, 32, ..., 38.
    assert_eq!((push["cursor"].as_u64(), push["held_records"].as_u64()), (Some(30), Some(5)));
    // Payload bytes, as the admin API counts them, not the records' envelopes:
    // {"n":30}, {"n":32}, 4 binary bytes at 34, {"n":36}, {"n":38}.
    assert_eq!(push["held_bytes"].as_u64(), Some(8 + 8 + 4 + 8 + 8));
    let orders = lanes.iter().find(|l| l["topic"] == "orders").unwrap();
    assert_eq!(orders["held_records"].as_u64(), Some(20));
    assert!(orders["oldest_held_age_ms"].as_u64().unwrap() > 1000);
    let o = cli_in(&["inspect"], &dir);
    assert_eq!(code(&o), 0);
    assert!(stdout(&o).contains("shutdown  clean") && stdout(&o).contains("events/push"), "{}", stdout(&o));
    assert!(!stdout(&o).contains("without a cursor"), "every destination has one: {}", stdout(&o));
    // A destination without a stored cursor counts all its records as held, which the
    // tool cannot tell from one the router gives up on: it says so.
    std::fs::remove_file(root.path().join("state.redb")).unwrap();
    let state = StateDb::open(root.path().join("state.redb")).unwrap();
    state.store_cursors(&[row("github", "push", 30)]).unwrap();
    drop(state);
    let o = cli_in(&["inspect"], &dir);
    assert!(stdout(&o).contains("without a cursor (-)") && stdout(&o).contains("--admin tells"), "{}", stdout(&o));

    // salvage of a clean log copies everything, offsets kept.
    let copy = root.path().join("copy");
    let o = cli(&["salvage", dir.to_str().unwrap(), "--out", copy.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("copied 40 record(s)"), "{}", stdout(&o));
    assert!(stdout(&o).contains("the copy carries the log's identity"), "{}", stdout(&o));
    assert_eq!(code(&cli_in(&["verify"], &copy)), 0);
    assert_eq!(json_lines(&cli_in(&["dump", "--json"], &copy)), lines);
    // The copy is the same log: it carries the source's identity.
    let identity = |d: &Path| std::fs::read(d.join(wal::identity::LOG_ID_FILE)).unwrap();
    assert_eq!(identity(&copy), identity(&dir));
    // Never into a directory that already holds a log.
    let o = cli(&["salvage", dir.to_str().unwrap(), "--out", copy.to_str().unwrap()]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    // Nothing was written to the source.
    let names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(
        names.iter().all(|n| n.ends_with(".seg")
            || ["clean-shutdown", "wal.lock", "durable-watermark", "log-id"].contains(&n.as_str())),
        "{names:?}"
    );
}

#[test]
fn a_torn_tail_is_reported_but_is_not_damage() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 10, small());
    let _ = std::fs::remove_file(dir.join("clean-shutdown"));
    let tail = segments(&dir).pop().unwrap();
    let len = std::fs::metadata(&tail).unwrap().len();
    // Half a frame header: an append that never finished its write.
    let mut f = std::fs::OpenOptions::new().append(true).open(&tail).unwrap();
    std::io::Write::write_all(&mut f, &[0x5a; 17]).unwrap();
    drop(f);

    let o = cli_in(&["verify"], &dir);
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    let expected = format!("torn tail {} at byte {len}", tail.display());
    assert!(stdout(&o).contains(&expected), "{}", stdout(&o));
    let v = json(&cli_in(&["verify", "--json"], &dir));
    assert_eq!(v["torn_tail"]["position"].as_u64(), Some(len));
    assert_eq!(json_lines(&cli_in(&["dump", "--json"], &dir)).len(), 10);
    let v = json(&cli_in(&["inspect", "--json", "--quick"], &dir));
    assert_eq!(v["clean_shutdown"], false);
    assert_eq!(v["torn_tail"]["position"].as_u64(), Some(len));
    assert_eq!(std::fs::metadata(&tail).unwrap().len(), len + 17, "read-only tools never cut");
}

#[test]
fn damage_in_the_middle_is_named_by_file_and_byte_and_salvage_keeps_what_checks() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 40, small());
    let first = segments(&dir)[0].clone();
    // Flip a byte in the payload of the third record of the first segment.
    let bytes = std::fs::read(&first).unwrap();
    let mut pos = 32usize;
    for _ in 0..2 {
        let len = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().unwrap()) as usize;
        pos += 32 + len;
    }
    let frame = pos;
    let mut damaged = bytes.clone();
    damaged[frame + 32 + 5] ^= 0x40;
    std::fs::write(&first, &damaged).unwrap();

    let o = cli_in(&["verify"], &dir);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    let line = format!("DAMAGED {} at byte {frame}: ", first.display());
    assert!(stdout(&o).contains(&line), "{}", stdout(&o));
    assert!(stdout(&o).contains("DAMAGED (1 problem(s))"), "{}", stdout(&o));
    let v = json(&cli_in(&["verify", "--json"], &dir));
    assert_eq!(v["clean"], false);
    assert_eq!(v["problems"][0]["position"].as_u64(), Some(frame as u64));
    // A reader gone before the report (`| grep -q DAMAGED`) still gets the verdict.
    for args in [&["wal", "verify", dir.to_str().unwrap()][..], &["wal", "verify", dir.to_str().unwrap(), "--json"]] {
        let o = run_into_a_closed_pipe(args);
        assert_eq!(code(&o), 1, "{args:?}: a damaged log verified clean: {}", stderr(&o));
    }

    // dump shows what precedes the damage, then fails naming it.
    let o = cli_in(&["dump", "--json"], &dir);
    assert_eq!(code(&o), 1);
    assert_eq!(json_lines(&o).len(), 2);
    assert!(stderr(&o).contains(&format!("at byte {frame}")), "{}", stderr(&o));

    let piped = root.path().join("salvaged-into-a-closed-pipe");
    let o = run_into_a_closed_pipe(&["wal", "salvage", dir.to_str().unwrap(), "--out", piped.to_str().unwrap()]);
    assert_eq!(code(&o), 1, "a salvage that skipped damage ended 0: {}", stderr(&o));
    let copy = root.path().join("salvaged");
    let o = cli(&["salvage", dir.to_str().unwrap(), "--out", copy.to_str().unwrap(), "--json"]);
    assert_eq!(code(&o), 1, "{}{}", stdout(&o), stderr(&o));
    let r = json(&o);
    assert_eq!(r["records"].as_u64(), Some(39));
    assert_eq!(r["missing_offsets"][0]["first"].as_u64(), Some(2));
    assert_eq!(r["missing_offsets"][0]["last"].as_u64(), Some(2));
    assert_eq!(r["skipped"][0]["from"].as_u64(), Some(frame as u64));
    assert_eq!(r["skipped"][0]["torn_tail"], false, "damage in a sealed segment taken for a torn tail");
    assert_eq!(code(&cli_in(&["verify"], &copy)), 0);
    let offs: Vec<u64> =
        json_lines(&cli_in(&["dump", "--json"], &copy)).iter().map(|l| l["offset"].as_u64().unwrap()).collect();
    let want: Vec<u64> = (0..40).filter(|&o| o != 2).collect();
    assert_eq!(offs, want, "offsets are kept across the gap");
    // inspect counts the records the copy holds, not the offsets it spans.
    let v = json(&cli_in(&["inspect", "--json", "--quick"], &copy));
    assert_eq!((v["start_offset"].as_u64(), v["next_offset"].as_u64()), (Some(0), Some(40)), "{v}");
    assert_eq!(v["records"].as_u64(), Some(39), "{v}");
    assert_eq!(v["missing_ranges"], serde_json::json!([{"from": 2, "to": 3}]), "{v}");
    let held: u64 = v["segments"].as_array().unwrap().iter().map(|s| s["records"].as_u64().unwrap()).sum();
    assert_eq!(held, 39, "{v}");
    let text = stdout(&cli_in(&["inspect", "--quick"], &copy));
    assert!(text.contains("(39 records;") && text.contains("missing   2..3 (1 offset(s) a salvage skipped)"), "{text}");
    // The copy is a log the daemon can open and append to.
    let wal = Wal::open(&copy, small()).unwrap();
    let a = rt().block_on(wal.append(vec![envelope(99)])).unwrap();
    assert_eq!(a.first_offset, 40);
}

/// A batch of three events whose write never finished (the power failed before its
/// sync: its sender was never answered 200) is not copied in part: its first two records
/// are left out, counted and said, and the copy ends where the log's recovery would.
#[test]
fn salvage_leaves_out_a_batch_whose_closing_record_was_lost() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 5, small());
    let wal = Wal::open(&dir, small()).unwrap();
    rt().block_on(async {
        wal.append(vec![envelope(5), envelope(6), envelope(7)]).await.unwrap();
        wal.close().await.unwrap();
    });
    drop(wal);
    // The batch's last record never reached the disk.
    let tail = segments(&dir).last().unwrap().clone();
    let bytes = std::fs::read(&tail).unwrap();
    let mut pos = 32usize;
    for _ in 0..7 {
        let len = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().unwrap()) as usize;
        pos += 32 + len;
    }
    std::fs::write(&tail, &bytes[..pos]).unwrap();

    let copy = root.path().join("salvaged");
    let o = cli(&["salvage", dir.to_str().unwrap(), "--out", copy.to_str().unwrap()]);
    // At the tail's end with nothing proving it durable, as recovery finds it: a torn
    // tail, left out and no damage, so the copy ends 0, as `wal verify` does.
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("2 record(s) of a batch whose closing record was lost (offsets 5..=6)"), "{out}");
    assert!(out.contains("(a torn tail: a write a crash cut short, never answered 200; not damage)"), "{out}");
    assert!(out.contains("copied 5 record(s)") && out.contains("offsets 0..5"), "{out}");
    assert!(out.contains("; only a torn tail left out, as recovery cuts it"), "{out}");
    // Their offsets named records: the copy goes on past them, never giving them to others.
    assert!(
        out.contains("reserved offsets 5..=6: past the last record copied") && out.contains("continues at offset 7"),
        "{out}"
    );
    assert!(!out.contains("missing offsets"), "the copy's records lack no offset: {out}");
    assert_eq!(Wal::open_read_only(&copy).unwrap().next_offset(), 7);
    let offs: Vec<u64> =
        json_lines(&cli_in(&["dump", "--json"], &copy)).iter().map(|l| l["offset"].as_u64().unwrap()).collect();
    assert_eq!(offs, (0..5).collect::<Vec<_>>());
    assert_eq!(Wal::open_read_only(&dir).unwrap().next_offset(), 5, "the log's own recovery ends there too");

    let copy = root.path().join("salvaged-json");
    let o = cli(&["salvage", dir.to_str().unwrap(), "--out", copy.to_str().unwrap(), "--json"]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    let r = json(&o);
    assert_eq!((r["records"].as_u64(), r["next_offset"].as_u64()), (Some(5), Some(5)));
    assert_eq!(r["partial_batch_records"].as_u64(), Some(2));
    assert_eq!(r["skipped"][0]["records"].as_u64(), Some(2));
    assert_eq!(r["skipped"][0]["torn_tail"], true);
    assert_eq!(r["end_offset"].as_u64(), Some(7));
    assert_eq!((r["reserved_offsets"]["first"].as_u64(), r["reserved_offsets"]["last"].as_u64()), (Some(5), Some(6)));
    assert_eq!(r["missing_offsets"], serde_json::json!([]));
}

/// A log whose newest segment starts above its last record (an in-place salvage
/// resumed there) lost nothing a copy could keep: the copy reserves those offsets too,
/// says so, and exits 0 with "nothing skipped".
#[test]
fn salvage_of_a_whole_log_whose_tail_starts_past_its_last_record_skips_nothing() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 4, small());
    // The last record damaged in a tail the clean shutdown vouched for: the in-place
    // salvage moves it aside and resumes past every offset its bytes could hold.
    let tail = segments(&dir).last().unwrap().clone();
    let mut bytes = std::fs::read(&tail).unwrap();
    let last = bytes.len() - 3;
    bytes[last] ^= 1;
    std::fs::write(&tail, &bytes).unwrap();
    let salvaging = WalOptions { recovery: wal::RecoveryMode::Salvage, ..small() };
    let wal = Wal::open(&dir, salvaging).unwrap();
    let resumed = wal.open_report().salvage.as_ref().expect("an in-place salvage").resumed_at_offset;
    assert!(resumed > 3, "{resumed}");
    rt().block_on(wal.close()).unwrap();
    drop(wal);
    std::fs::remove_dir_all(dir.join(wal::DAMAGED_DIR)).unwrap();
    assert_eq!(code(&cli_in(&["verify"], &dir)), 0, "the source is a whole log");

    let copy = root.path().join("salvaged");
    let o = cli(&["salvage", dir.to_str().unwrap(), "--out", copy.to_str().unwrap()]);
    let out = stdout(&o);
    assert_eq!(code(&o), 0, "{out}{}", stderr(&o));
    assert!(out.contains(&format!("reserved offsets 3..={}", resumed - 1)), "{out}");
    assert!(out.contains("; nothing skipped;") && out.contains(&format!("continues at offset {resumed}")), "{out}");
    assert!(!out.contains("missing offsets"), "{out}");
    assert_eq!(Wal::open_read_only(&copy).unwrap().next_offset(), resumed);

    // Once the log goes on past its gap, a salvage of it keeps the gap as the source's
    // own, and says nothing was lost now: exit 0, no missing offsets.
    let wal = Wal::open(&dir, small()).unwrap();
    rt().block_on(wal.append(vec![bytes::Bytes::from_static(b"after the gap")])).unwrap();
    rt().block_on(wal.close()).unwrap();
    drop(wal);
    let again = root.path().join("salvaged-again");
    let o = cli(&["salvage", dir.to_str().unwrap(), "--out", again.to_str().unwrap(), "--json"]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    let r = json(&o);
    assert_eq!(r["missing_offsets"], serde_json::json!([]), "{r}");
    assert_eq!(r["source_gaps"], serde_json::json!([{"first": 3, "last": resumed - 1}]), "{r}");
    assert_eq!(r["end_offset"].as_u64(), Some(resumed + 1), "{r}");
}

/// Every file and directory under `dir`, with each file's length.
fn tree(dir: &Path) -> Vec<(PathBuf, Option<u64>)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                todo.push(p.clone());
                out.push((p, None));
            } else {
                out.push((p, Some(m.len())));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn salvage_never_writes_into_the_log_and_refuses_an_unusable_out_with_exit_2() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 10, small());
    let r = root.path();
    let file = r.join("a-file");
    std::fs::write(&file, b"keep me").unwrap();
    std::os::unix::fs::symlink(&dir, r.join("link")).unwrap();
    let before = tree(r);

    // Inside the log directory, however it is spelled, the directory itself, a directory
    // that holds it, an existing file, and a path under a file.
    let outs: Vec<(PathBuf, &str)> = vec![
        (dir.join("copy"), "inside"),
        (dir.join("a/b/copy"), "inside"),
        (dir.join("."), "the log directory itself"),
        (dir.clone(), "the log directory itself"),
        (r.join("nowhere/../wal/copy"), "inside"),
        (r.join("link/copy"), "inside"),
        (r.join("link"), "the log directory itself"),
        (r.to_path_buf(), "holds the log directory"),
        (file.clone(), "not a directory"),
        (file.join("copy"), "not a directory"),
    ];
    for (out, why) in &outs {
        let o = cli(&["salvage", dir.to_str().unwrap(), "--out", out.to_str().unwrap()]);
        assert_eq!(code(&o), 2, "--out {}: {}{}", out.display(), stdout(&o), stderr(&o));
        let e = stderr(&o);
        assert_eq!(e.lines().count(), 1, "--out {}: {e}", out.display());
        assert!(e.contains("--out") && e.contains(why), "--out {}: {e}", out.display());
        assert!(o.stdout.is_empty(), "--out {}", out.display());
        assert_eq!(tree(r), before, "--out {} changed something", out.display());
    }
    // A relative --out is taken from the working directory.
    let o = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["wal", "salvage", ".", "--out", "copy"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("inside"), "{}", stderr(&o));
    assert_eq!(tree(r), before);

    // Beside the log, as the runbook has it, the copy is made.
    let beside = r.join("wal.salvaged");
    let o = cli(&["salvage", dir.to_str().unwrap(), "--out", beside.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    assert_eq!(code(&cli_in(&["verify"], &beside)), 0);
}

#[test]
fn inspect_reads_only_the_log_s_capacity_from_a_config_and_refuses_a_bad_admin_url_with_exit_2() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 10, small());
    let inspect = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(["wal", "inspect", dir.to_str().unwrap(), "--json"])
            .args(args)
            .env_remove("IGGY_INGEST_ADMIN_TOKEN")
            .env_remove("IGGY_INGEST_MANAGEMENT_TOKEN")
            .output()
            .unwrap()
    };
    // The deployed configuration names its tokens by environment variable; inspect needs
    // none of them, only wal.max_bytes.
    let deployed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/iggy-ingest.toml");
    let o = inspect(&["--config", deployed.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(json(&o)["max_bytes"].as_u64(), Some(8 << 30));
    // Nor does anything else the daemon would refuse to start with.
    let cfg = root.path().join("c.toml");
    let with = |text: &str| {
        std::fs::write(&cfg, text).unwrap();
        inspect(&["--config", cfg.to_str().unwrap()])
    };
    let o = with("[admin]\ntoken = \"short\"\n[iggy]\naddress = \"nowhere\"\n[wal]\nmax_bytes = 1073741824\n");
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(json(&o)["max_bytes"].as_u64(), Some(1 << 30));
    // Without the key, the daemon's default.
    let o = with("[http]\nlisten = \"127.0.0.1:0\"\n");
    assert_eq!(json(&o)["max_bytes"].as_u64(), Some(8 << 30), "{}", stderr(&o));
    // A file that does not parse, or a capacity the daemon would refuse: exit 2, named
    // by key path and line.
    for (text, named) in [
        ("[wal]\nmax_bytes = \"lots\"\n", "line 2: wal.max_bytes"),
        ("[wal]\nsegment_max_bytes = 67108864\nmax_bytes = 4096\n", "line 3: wal.max_bytes"),
        ("[wal]\nmax_byte = 4096\n", "max_byte"),
        ("[wal\n", "line 1"),
    ] {
        let o = with(text);
        assert_eq!(code(&o), 2, "{text}: {}", stderr(&o));
        assert!(stderr(&o).contains(named) && stderr(&o).contains("--config"), "{text}: {}", stderr(&o));
        assert!(o.stdout.is_empty(), "{text}");
    }
    let o = inspect(&["--config", root.path().join("missing.toml").to_str().unwrap()]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));

    // An --admin that is not http://HOST:PORT is an unusable argument, said before any
    // connection is tried.
    for url in [
        "http://a b",
        "http://a b:9180",
        "http://127.0.0.1",
        "http://127.0.0.1:0",
        "https://127.0.0.1:9180",
        "127.0.0.1:9180",
        "http://h:9180/x",
        "http://",
    ] {
        let o = inspect(&["--admin", url]);
        assert_eq!(code(&o), 2, "{url}: {}", stderr(&o));
        let e = stderr(&o);
        assert_eq!(e.lines().count(), 1, "{url}: {e}");
        assert!(e.contains(&format!("--admin {url}")) && e.contains("http://HOST:PORT"), "{url}: {e}");
        assert!(o.stdout.is_empty(), "{url}");
    }

    // Arguments refused before any connection is tried or the log is read: a --config
    // that does not load also beside --admin (which names the capacity itself), a token
    // that is no header value (named, not echoed), a --state with nothing there.
    let unreachable = "http://127.0.0.1:9";
    let o = inspect(&["--admin", unreachable, "--config", root.path().join("missing.toml").to_str().unwrap()]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--config"), "{}", stderr(&o));
    let o = inspect(&["--admin", unreachable, "--admin-token", "a\nsecret"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--admin-token") && !stderr(&o).contains("secret"), "{}", stderr(&o));
    let o = inspect(&["--state", root.path().join("nope.redb").to_str().unwrap()]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--state") && o.stdout.is_empty(), "{}", stderr(&o));
}

/// An admin API that answers without end (a wrong address, a proxy gone astray) is read
/// up to `--admin`'s bound and refused, exit 1, naming the bound: the CLI never holds
/// more than that. The answer here is 17 MiB of spaces, then `{}`: JSON once whole, so a
/// CLI without the bound would take it.
#[test]
fn an_admin_answer_past_its_bound_is_refused_naming_the_bound() {
    use std::io::{Read, Write};
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 3, small());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().map_while(Result::ok) {
            let mut head = [0u8; 4096];
            let _ = conn.read(&mut head);
            let spaces = 17 * 1024 * 1024;
            let head =
                format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", spaces + 2);
            let _ = conn.write_all(head.as_bytes());
            let chunk = vec![b' '; 1 << 20];
            for _ in 0..17 {
                if conn.write_all(&chunk).is_err() {
                    break;
                }
            }
            let _ = conn.write_all(b"{}");
        }
    });
    let o = cli_in(&["inspect", "--json", "--admin", &format!("http://{addr}")], &dir);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(stderr(&o).contains("at most 16777216 bytes are read"), "{}", stderr(&o));
    assert!(o.stdout.is_empty(), "{}", stdout(&o));
}

/// An admin API's answer other than 200 is quoted in the error with what would act on a
/// terminal escaped, and only its start: whatever answers at that address chose it.
#[test]
fn an_admin_error_answer_is_quoted_escaped_and_cut() {
    use std::io::{Read, Write};
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 3, small());
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let body = format!("\u{1b}]0;PWNED\u{7}\u{1b}[2J\nfake: everything is fine{}", "x".repeat(4096));
    let answer = body.clone();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().map_while(Result::ok) {
            let mut head = [0u8; 4096];
            let _ = conn.read(&mut head);
            let head = format!("HTTP/1.1 500 Internal Server Error\r\ncontent-length: {}\r\n\r\n", answer.len());
            let _ = conn.write_all(head.as_bytes());
            let _ = conn.write_all(answer.as_bytes());
        }
    });
    let o = cli_in(&["inspect", "--admin", &format!("http://{addr}")], &dir);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains(r"HTTP 500: \u{1b}]0;PWNED\u{7}\u{1b}[2J\nfake: everything is fine"), "{err}");
    assert!(!err.contains('\u{1b}') && err.lines().count() == 1, "{err:?}");
    assert!(err.trim_end().ends_with(" …") && err.len() < 1024, "{err}");
}

#[test]
fn an_empty_log_is_clean_and_shows_nothing() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 0, small());
    let o = cli_in(&["verify"], &dir);
    assert_eq!(code(&o), 0);
    assert!(stdout(&o).contains("0 record(s)"), "{}", stdout(&o));
    let o = cli_in(&["dump"], &dir);
    assert_eq!((code(&o), stdout(&o).as_str()), (0, ""));
    let v = json(&cli_in(&["inspect", "--json"], &dir));
    assert_eq!((v["next_offset"].as_u64(), v["segments"].as_array().unwrap().len()), (Some(0), 1));
    assert_eq!(v["destinations"]["cursors_from"], "unavailable");
}

/// A log directory whose name is not UTF-8 (a Linux path is bytes): each `--json` answer
/// names it with U+FFFD in place of the bytes that are not, and exits as for any other
/// name; `salvage` included, whose copy is made before its answer is written.
#[test]
fn json_answers_name_a_directory_whose_name_is_not_utf8() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let root = tempfile::tempdir().unwrap();
    let made = make_log(root.path(), 20, small());
    let dir = root.path().join(OsStr::from_bytes(b"w\xffal"));
    std::fs::rename(&made, &dir).unwrap();
    let out = root.path().join(OsStr::from_bytes(b"copy\xfe"));
    let run = |args: &[&OsStr]| {
        Command::new(env!("CARGO_BIN_EXE_iggy-ingest")).arg("wal").args(args).output().expect("run iggy-ingest")
    };
    let shown = |name: &str| format!("{}/{name}", root.path().display());
    let (json_flag, dir_arg) = (OsStr::new("--json"), dir.as_os_str());
    for sub in ["verify", "inspect"] {
        let o = run(&[OsStr::new(sub), dir_arg, json_flag]);
        assert_eq!(code(&o), 0, "{sub}: {}", stderr(&o));
        let v = json(&o);
        assert_eq!(v["dir"], shown("w\u{fffd}al"), "{sub}");
        if sub == "inspect" {
            let file = v["segments"][0]["file"].as_str().unwrap();
            assert!(file.starts_with(&shown("w\u{fffd}al/")), "{file}");
        }
    }
    let o = run(&[OsStr::new("salvage"), dir_arg, OsStr::new("--out"), out.as_os_str(), json_flag]);
    assert_eq!(code(&o), 0, "salvage: {}", stderr(&o));
    let v = json(&o);
    assert_eq!((v["out"].as_str(), v["records"].as_u64()), (Some(shown("copy\u{fffd}").as_str()), Some(20)));
    assert_eq!(code(&run(&[OsStr::new("verify"), out.as_os_str()])), 0, "the copy is a log");
}

/// A log with more distinct destinations than `wal inspect` lists (100 000, the router's
/// own largest cap): the first 100 000 are listed, and the records of the rest are
/// counted together, none lost from the figures; a listed destination's later records
/// still count as its own.
#[test]
fn inspect_lists_at_most_100_000_destinations_and_counts_the_rest_together() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("wal");
    let opts = WalOptions { max_bytes: 1 << 28, ..WalOptions::default() };
    let topic_of = |i: u64| match i {
        0..100_000 => format!("t{i}"),
        100_000 | 100_001 => "late-a".to_string(),
        100_002 => "late-b".to_string(),
        _ => "t0".to_string(),
    };
    let record = |i: u64| {
        let header = EnvelopeHeader {
            message_id: u128::from(i),
            received_at_unix_ms: T0 + i,
            source_key: "github".into(),
            endpoint_id: None,
            content_type: None,
            metadata: vec![],
            headers: vec![],
            idempotency_key: None,
            batch_index: 0,
            batch_len: 1,
            destination: Destination {
                stream: "events".into(),
                topic: topic_of(i),
                partitioning: Partitioning::Balanced,
            },
        };
        Envelope::encode(&header, b"{}")
    };
    let wal = Wal::open(&dir, opts).unwrap();
    rt().block_on(async {
        for first in (0..100_004u64).step_by(1000) {
            wal.append((first..(first + 1000).min(100_004)).map(record).collect()).await.unwrap();
        }
        wal.close().await.unwrap();
    });
    drop(wal);
    // An empty state database: no cursors, so every record is held.
    drop(StateDb::open(root.path().join("state.redb")).unwrap());
    let v = json(&cli_in(&["inspect", "--json"], &dir));
    let lanes = v["destinations"]["lanes"].as_array().unwrap();
    assert_eq!(lanes.len(), 100_000);
    assert!(lanes.iter().all(|l| l["topic"].as_str().unwrap().starts_with('t')));
    let t0 = lanes.iter().find(|l| l["topic"] == "t0").unwrap();
    assert_eq!(t0["records_in_log"].as_u64(), Some(2));
    let left_out = &v["destinations"]["left_out"];
    assert_eq!(left_out["listed_max"].as_u64(), Some(100_000));
    assert_eq!((left_out["records_in_log"].as_u64(), left_out["held_records"].as_u64()), (Some(3), Some(3)));
    assert_eq!(left_out["held_bytes"].as_u64(), Some(6));
    let text = stdout(&cli_in(&["inspect"], &dir));
    assert!(
        text.contains("left out  destinations past the first 100000 listed: 3 record(s) in the log, 3 held"),
        "{}",
        &text[text.len().saturating_sub(600)..]
    );
}

#[test]
fn something_that_is_not_a_log_is_said_in_one_line_with_exit_2() {
    let root = tempfile::tempdir().unwrap();
    let empty = root.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let file = root.path().join("file");
    std::fs::write(&file, b"hello").unwrap();
    let missing = root.path().join("missing");
    let out = root.path().join("out");
    for p in [&empty, &file, &missing] {
        let p = p.to_str().unwrap();
        for args in [
            vec!["inspect", p],
            vec!["dump", p],
            vec!["tail", p],
            vec!["verify", p],
            vec!["salvage", p, "--out", out.to_str().unwrap()],
        ] {
            let o = cli(&args);
            assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
            let e = stderr(&o);
            assert_eq!(e.lines().count(), 1, "{args:?}: {e}");
            assert!(e.contains("not a log") || e.contains("does not exist"), "{args:?}: {e}");
            assert!(o.stdout.is_empty());
        }
    }
    assert!(!out.join("00000000000000000000.seg").exists());
}

#[test]
fn dump_stops_cleanly_when_its_reader_goes_away() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 3000, WalOptions { segment_max_bytes: 1 << 20, ..small() });
    let mut child = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["wal", "dump", dir.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    stdout.read_line(&mut first).unwrap();
    assert!(first.starts_with("#0 "), "{first}");
    drop(stdout); // like `| head -1`
    let status = child.wait().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(status.code(), Some(0), "{status:?} {err}");
    assert!(err.is_empty(), "{err}");
}

/// The other commands that print (`config check`, `config default`, `state show`) end as
/// the log tools do when their reader is gone before they write (`| head -0`, a pager
/// quit at once): exit 0 and nothing on stderr, never a panic.
#[test]
fn config_and_state_commands_end_quietly_when_their_reader_is_gone() {
    let root = tempfile::tempdir().unwrap();
    drop(StateDb::open(root.path().join("state.redb")).unwrap());
    let config = root.path().join("config.toml");
    std::fs::write(&config, "[sources.a]\ndestination = { stream = \"s\", topic = \"t\" }\n").unwrap();
    let (data_dir, config) = (root.path().to_str().unwrap(), config.to_str().unwrap());
    for args in
        [vec!["config", "default"], vec!["config", "check", config], vec!["state", "show", "--data-dir", data_dir]]
    {
        let o = run_into_a_closed_pipe(&args);
        assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).is_empty(), "{args:?}: {}", stderr(&o));
    }
}

/// What a shell command run on a terminal (a pseudo-terminal from `script`, for standard
/// output and error unless the command redirects them) wrote there.
fn on_a_terminal(command: &str) -> String {
    let o = Command::new("script").args(["-qec", command, "/dev/null"]).stdin(Stdio::null()).output().unwrap();
    assert!(o.status.success(), "{command}: {o:?}");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The scans of a whole log (`inspect`, `verify`, `salvage`, and `dump` into a file) show a progress
/// bar when standard error is a terminal, and clear it; `dump` whose lines go to the
/// terminal itself, or through a pipe to another program that shows them there, draws
/// none, so no bar tears them.
#[test]
fn long_scans_show_a_progress_bar_on_a_terminal_but_never_across_their_own_lines() {
    const TEST: &str = "long_scans_show_a_progress_bar_on_a_terminal_but_never_across_their_own_lines";
    if Command::new("script").arg("--version").output().is_err() {
        skip_or_fail(TEST, "`script` (util-linux) is not installed");
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 300, WalOptions { segment_max_bytes: 1 << 20, ..small() });
    let (bin, d) = (env!("CARGO_BIN_EXE_iggy-ingest"), dir.display());
    let out = root.path().join("dump.txt");
    const CLEAR_LINE: &str = "\u{1b}[2K";

    for (what, command) in [
        ("inspect", format!("'{bin}' wal inspect '{d}' > /dev/null")),
        ("inspect --json", format!("'{bin}' wal inspect '{d}' --json | cat > /dev/null")),
        ("dump > FILE", format!("'{bin}' wal dump '{d}' > '{}'", out.display())),
    ] {
        let screen = on_a_terminal(&command);
        assert!(screen.contains("/300 records"), "{what}: no bar on the terminal: {screen:?}");
        assert!(screen.trim_end().ends_with(CLEAR_LINE), "{what}: the bar was left on the screen: {screen:?}");
    }
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().filter(|l| l.starts_with('#')).count(), 300);

    let copy = root.path().join("salvaged");
    for (what, command) in [
        ("verify", format!("'{bin}' wal verify '{d}' > /dev/null")),
        ("salvage", format!("'{bin}' wal salvage '{d}' --out '{}' > /dev/null", copy.display())),
    ] {
        let screen = on_a_terminal(&command);
        assert!(screen.contains(" eta "), "{what}: no bar on the terminal: {screen:?}");
        assert!(screen.trim_end().ends_with(CLEAR_LINE), "{what}: the bar was left on the screen: {screen:?}");
    }
    assert_eq!(code(&cli(&["verify", copy.to_str().unwrap()])), 0, "the salvaged copy verifies");

    for (what, command) in
        [("dump", format!("'{bin}' wal dump '{d}'")), ("dump | cat", format!("'{bin}' wal dump '{d}' --json | cat"))]
    {
        let screen = on_a_terminal(&command);
        assert_eq!(
            screen.lines().filter(|l| l.starts_with("#0 ") || l.contains("\"offset\":0,")).count(),
            1,
            "{what}: {screen:?}"
        );
        assert!(
            !screen.contains(" records ") && !screen.contains(CLEAR_LINE),
            "{what}: a bar across the lines: {screen:?}"
        );
    }
}

/// `tail -n N` with a filter starts with the last N records that match, however far back
/// they are, not with the matches among the last N records.
#[test]
fn tail_with_a_filter_shows_the_last_n_records_that_match() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 200, WalOptions { segment_max_bytes: 4096, ..small() });
    let first_lines = |args: &[&str], n: usize| -> Vec<String> {
        let mut child = KillOnDrop(
            Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
                .args(["wal", "tail", dir.to_str().unwrap(), "--interval-ms", "20"])
                .args(args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let lines = line_reader(&mut child.0);
        (0..n).map(|_| lines.recv_timeout(Duration::from_secs(30)).expect("a line from tail")).collect()
    };
    let offsets = |lines: Vec<String>| -> Vec<u64> {
        lines
            .iter()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["offset"].as_u64().unwrap())
            .collect()
    };
    // Records 0..200 alternate github (even) and stripe (odd).
    let stripe = offsets(first_lines(&["-n", "3", "--source", "stripe", "--json"], 3));
    assert_eq!(stripe, vec![195, 197, 199]);
    // The last 60 to events/push (github) reach back 120 records, past the first window.
    let github = offsets(first_lines(&["-n", "60", "--destination", "events/push", "--json"], 60));
    assert_eq!(github, (80..200).step_by(2).collect::<Vec<u64>>());
    // More than the log holds: every match, from the log's start.
    let all = offsets(first_lines(&["-n", "1000", "--source", "stripe", "--json"], 2));
    assert_eq!(all, vec![1, 3]);
}

#[test]
fn tail_shows_the_last_records_then_follows_and_ends_when_its_reader_goes() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 10, small());
    let mut tail = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(["wal", "tail", dir.to_str().unwrap(), "-n", "3", "--payload-only", "--interval-ms", "20"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Read on this thread (so dropping the reader closes the pipe); a watchdog kills a
    // stuck tail, which ends the read with EOF instead of hanging the test.
    let pid = tail.0.id() as i32;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watchdog_done = done.clone();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(60));
        if !watchdog_done.load(std::sync::atomic::Ordering::SeqCst) {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let mut out = BufReader::new(tail.0.stdout.take().unwrap());
    let mut next = || {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "tail ended early");
        l.trim_end().to_string()
    };
    let first: Vec<String> = (0..3).map(|_| next()).collect();
    assert_eq!(first, vec!["{\"n\":7}", "{\"n\":8}", "//4JAA=="], "the last 3, the binary one as base64");
    // A writer appends (the log is free: no daemon), across a segment rotation.
    let wal = Wal::open(&dir, small()).unwrap();
    rt().block_on(async {
        for i in 10..40 {
            wal.append(vec![envelope(i)]).await.unwrap();
        }
    });
    for i in 10..40u64 {
        let line = next();
        if i % 5 != 4 {
            assert_eq!(line, format!("{{\"n\":{i}}}"));
        }
    }
    // An idle tail whose reader is gone ends by itself, with 0.
    drop(out);
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = tail.0.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "tail kept running with nobody reading");
        std::thread::sleep(Duration::from_millis(20));
    };
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(status.code(), Some(0));
    drop(wal);
}

const ADMIN_TOKEN: &str = "admin-reader-token-0123456789";

const SOURCES: &str = r#"
[sources.default]
destination = { stream = "ingest", topic = "events" }
"#;

/// A child process killed when the test ends, passing or not.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads lines from a child's stdout on a thread, so a test can wait with a deadline.
fn line_reader(child: &mut std::process::Child) -> std::sync::mpsc::Receiver<String> {
    let out = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subcommand_works_on_a_running_daemons_log() {
    let root = tempfile::tempdir().unwrap();
    // Readers of the admin API need a token here, as an operator would set up.
    let text =
        config_text(root.path(), "", SOURCES).replace("[admin]\n", &format!("[admin]\ntoken = \"{ADMIN_TOKEN}\"\n"));
    let d = Daemon::start_text(root.path(), &text);
    let dir = d.wal_dir();
    let mut tail = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(["wal", "tail", dir.to_str().unwrap(), "--from", "0", "--json", "--interval-ms", "50"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap(),
    );
    let lines = line_reader(&mut tail.0);

    // Traffic keeps arriving while the tools run.
    let http = d.http;
    let traffic = tokio::spawn(async move {
        let mut n = 0u64;
        for i in 0..150 {
            let a = post_json(http, "/v1/sources/default", &format!("{{\"i\":{i}}}")).await;
            assert_eq!(a.status, 200);
            n += 1;
        }
        n
    });
    let mut counts = Vec::new();
    while !traffic.is_finished() {
        let dir = dir.clone();
        let (v, d_) = tokio::task::spawn_blocking(move || {
            (cli_in(&["verify", "--json"], &dir), cli_in(&["dump", "--json"], &dir))
        })
        .await
        .unwrap();
        assert_eq!(code(&v), 0, "{}", stdout(&v));
        let v = json(&v);
        assert_eq!(v["clean"], true, "{v}");
        assert!(v["torn_tail"].is_null(), "a live writer's unsynced bytes were read: {v}");
        assert_eq!(code(&d_), 0, "{}", stderr(&d_));
        let dumped = json_lines(&d_);
        for (k, l) in dumped.iter().enumerate() {
            assert_eq!(l["offset"].as_u64(), Some(k as u64));
            assert_eq!(l["source"], "default");
        }
        counts.push((v["records"].as_u64().unwrap(), dumped.len() as u64));
    }
    let sent = traffic.await.unwrap();
    assert!(counts.windows(2).all(|w| w[0].0 <= w[1].0), "views went backwards: {counts:?}");

    // Everything answered 200 is visible now, to every tool.
    let dir2 = dir.clone();
    let (v, dumped, insp) = tokio::task::spawn_blocking(move || {
        (
            cli_in(&["verify", "--json"], &dir2),
            cli_in(&["dump", "--json"], &dir2),
            cli_in(&["inspect", "--json"], &dir2),
        )
    })
    .await
    .unwrap();
    assert_eq!(json(&v)["records"].as_u64(), Some(sent));
    assert_eq!(json_lines(&dumped).len() as u64, sent);
    let i = json(&insp);
    assert_eq!(i["writer_running"], true);
    assert!(i["clean_shutdown"].is_null());
    assert_eq!(i["next_offset"].as_u64(), Some(sent));
    assert_eq!(i["destinations"]["cursors_from"], "unavailable");
    assert!(i["destinations"]["note"].as_str().unwrap().contains("--admin"), "{i}");
    let lane = &i["destinations"]["lanes"][0];
    assert_eq!((lane["stream"].as_str(), lane["records_in_log"].as_u64()), (Some("ingest"), Some(sent)));

    // With --admin, cursors and held figures come from the daemon itself; without its
    // token the answer says what to pass.
    let (dir3, admin) = (dir.clone(), format!("http://{}", d.admin));
    let (no_token, o) = tokio::task::spawn_blocking(move || {
        let no_token = cli_in(&["inspect", "--json", "--admin", &admin], &dir3);
        let o = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(["wal", "inspect", dir3.to_str().unwrap(), "--json", "--admin", &admin])
            .env("IGGY_INGEST_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()
            .unwrap();
        (no_token, o)
    })
    .await
    .unwrap();
    assert_eq!(code(&no_token), 1);
    assert!(
        stderr(&no_token).contains("HTTP 401") && stderr(&no_token).contains("--admin-token"),
        "{}",
        stderr(&no_token)
    );
    assert!(no_token.stdout.is_empty());
    // The webhook listener given for the admin one: its 404 is an error, not an empty view.
    let (dir5, webhook) = (dir.clone(), format!("http://{}", d.http));
    let wrong =
        tokio::task::spawn_blocking(move || cli_in(&["inspect", "--json", "--admin", &webhook], &dir5)).await.unwrap();
    assert_eq!(code(&wrong), 1, "{}", stdout(&wrong));
    assert!(stderr(&wrong).contains("HTTP 404"), "{}", stderr(&wrong));
    assert!(wrong.stdout.is_empty());
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let i = json(&o);
    assert_eq!(i["destinations"]["cursors_from"], "admin");
    let lane = &i["destinations"]["lanes"][0];
    assert_eq!((lane["source"].as_str(), lane["topic"].as_str()), (Some("default"), Some("events")));
    assert!(lane["held_records"].as_u64().is_some(), "{i}");
    assert!(i["max_bytes"].as_u64().is_some());

    // A source key from the log that is no path segment (a log of another daemon, say)
    // is asked for escaped: the daemon knows no such connector, and the lane is shown.
    let odd = tempfile::tempdir().unwrap();
    let odd_dir = odd.path().join("wal");
    {
        let wal = Wal::open(&odd_dir, small()).unwrap();
        let mut header = Envelope::decode(&envelope(1)).unwrap().header;
        header.source_key = "a b?c/d".into();
        rt_append(&wal, Envelope::encode(&header, b"{}")).await;
    }
    let admin = format!("http://{}", d.admin);
    let o = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(["wal", "inspect", odd_dir.to_str().unwrap(), "--json", "--admin", &admin])
            .env("IGGY_INGEST_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let lane = &json(&o)["destinations"]["lanes"][0];
    assert_eq!(lane["source"], "a b?c/d", "{lane}");

    // tail saw every record once, in order, as the daemon synced them.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    while (seen.len() as u64) < sent {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = lines.recv_timeout(left).unwrap_or_else(|_| panic!("tail showed {} of {sent}", seen.len()));
        let v: Value = serde_json::from_str(&line).unwrap();
        seen.push(v["offset"].as_u64().unwrap());
    }
    assert_eq!(seen, (0..sent).collect::<Vec<_>>());
    drop(tail);

    // salvage refuses beside the running daemon: its copy, put in the log's place, would
    // lack every event the daemon answered 200 for after it.
    let (dir4, out) = (dir.clone(), root.path().join("copy"));
    let out4 = out.clone();
    let o =
        tokio::task::spawn_blocking(move || cli(&["salvage", dir4.to_str().unwrap(), "--out", out4.to_str().unwrap()]))
            .await
            .unwrap();
    assert_eq!(code(&o), 3, "{}{}", stdout(&o), stderr(&o));
    assert!(stderr(&o).contains("stop it first"), "{}", stderr(&o));
    assert!(!out.exists(), "nothing is written");

    // No tool took the writer's lock or changed anything: the daemon goes on and stops cleanly.
    assert_eq!(post_json(d.http, "/v1/sources/default", "{\"after\":true}").await.status, 200);
    let status = d.stop();
    assert!(status.success(), "{status:?}");
    let o = cli_in(&["inspect", "--json", "--quick"], &dir);
    let i = json(&o);
    assert_eq!((i["writer_running"].as_bool(), i["clean_shutdown"].as_bool()), (Some(false), Some(true)));
    assert_eq!(i["next_offset"].as_u64(), Some(sent + 1));
}

/// `tail --from` is checked as `dump --from` is: below the log's start (released) or past
/// its end it is refused at once, exit 2, instead of following from elsewhere and
/// saying the offsets "were released meanwhile".
#[test]
fn tail_and_dump_refuse_a_from_below_the_start_or_past_the_end_alike() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("wal");
    let wal = Wal::open(&dir, small()).unwrap();
    rt().block_on(async {
        for i in 0..40 {
            wal.append(vec![envelope(i)]).await.unwrap();
        }
        // Past the first segment's records, so that its file goes (the start itself is
        // not kept across a reopen: the log then starts at its first segment).
        wal.release_below(39).await.unwrap();
        wal.close().await.unwrap();
    });
    let start = Wal::open_read_only(&dir).unwrap().start_offset();
    assert!(start > 0, "the test wants a released head");
    for from in ["0".to_string(), "41".to_string()] {
        for tool in ["dump", "tail"] {
            let started = std::time::Instant::now();
            let mut child = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
                .args(["wal", tool, dir.to_str().unwrap(), "--from", &from])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            // A tail that follows instead never ends: stop it after a while (through its
            // handle, which is never a pid reused by another process).
            while child.try_wait().unwrap().is_none() {
                if started.elapsed() > Duration::from_secs(10) {
                    let _ = child.kill();
                    panic!("{tool} --from {from} kept running");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let o = child.wait_with_output().unwrap();
            assert_eq!(code(&o), 2, "{tool} --from {from}: {}{}", stdout(&o), stderr(&o));
            assert!(stdout(&o).is_empty(), "{tool} --from {from}: {}", stdout(&o));
        }
    }
    // At the start, and at the end (nothing yet, so tail waits), both are fine.
    let o = cli_in(&["dump", "--from", &start.to_string(), "--limit", "1", "--json"], &dir);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// After a kill -9 the state database was not closed cleanly, and redb's read-only open
/// refuses such a database until it is repaired, which only the daemon's next start does:
/// the moment (a daemon that will not start) the runbook needs the cursors most. `wal
/// inspect` still reads them, and `state show` the tables, from a repaired copy, each
/// saying so, and neither writes the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tools_read_the_state_database_a_kill_9_left() {
    let root = tempfile::tempdir().unwrap();
    let mut d = Daemon::start(root.path(), "", SOURCES);
    for i in 0..3 {
        assert_eq!(post_json(d.http, "/v1/sources/default", &format!("{{\"i\":{i}}}")).await.status, 200);
    }
    // Past a checkpoint of the delivery ids' index: the database has commits of the run.
    tokio::time::sleep(Duration::from_millis(600)).await;
    d.kill9();
    let data = root.path().join("data");
    let state = data.join("state.redb");
    assert!(
        matches!(redb::ReadOnlyDatabase::open(&state), Err(redb::DatabaseError::RepairAborted)),
        "the kill left a database that needs no repair; nothing here is tested"
    );
    let before = std::fs::read(&state).unwrap();

    let o = cli_in(&["inspect", "--json"], &d.wal_dir());
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let i = json(&o);
    assert_eq!(i["destinations"]["cursors_from"], "state", "{i}");
    assert!(i["destinations"]["note"].as_str().unwrap().contains("repaired copy"), "{i}");
    assert_eq!(i["next_offset"].as_u64(), Some(3));

    let o = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["state", "show", "--data-dir"])
        .arg(&data)
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("repaired copy") && stdout(&o).contains("idempotency"), "{}", stdout(&o));
    assert_eq!(std::fs::read(&state).unwrap(), before, "a read-only tool wrote the state database");

    // The daemon starts on it (redb repairs it then), and a clean stop leaves a database
    // the tools read in place.
    let d = Daemon::restart(root.path());
    assert!(d.stop().success());
    let o = cli_in(&["inspect", "--json"], &data.join("wal"));
    let i = json(&o);
    assert!(!i["destinations"]["note"].as_str().unwrap().contains("repaired copy"), "{i}");
}

/// A log whose writer's lock is held while no durable watermark can be read (a daemon
/// recovering its log at start, or `state migrate`/`state reset --yes`, which take the
/// lock and write none) is busy, not damaged: `verify` says so and exits 3 after trying
/// for a while, so that a script taking 1 for damage does not send it to salvage.
#[test]
fn a_log_held_by_a_writer_whose_state_cannot_be_read_is_busy_not_damaged() {
    use wal::storage::{FsStorage, Storage};
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 20, small());
    let _ = std::fs::remove_file(dir.join(wal::WATERMARK_FILE));
    let lock = FsStorage.try_lock(&dir.join(wal::LOCK_FILE)).unwrap();
    let out = root.path().join("wal.salvaged");
    let salvage = ["salvage", dir.to_str().unwrap(), "--out", out.to_str().unwrap()];
    for args in [&["verify"][..], &["verify", "--json"][..], &["inspect"][..], &["dump"][..], &salvage[..1]] {
        let all = if args[0] == "salvage" { salvage.to_vec() } else { [args, &[dir.to_str().unwrap()]].concat() };
        let o = cli(&all);
        assert_eq!(code(&o), 3, "{args:?}: {}{}", stdout(&o), stderr(&o));
        assert!(stderr(&o).contains("a running writer holds this log"), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("run it again"), "{args:?}: {}", stderr(&o));
    }
    // The busy salvage wrote nothing, so running it again into the same place works.
    assert!(std::fs::read_dir(&out).map_or(true, |mut d| d.next().is_none()), "{:?}", tree(&out));
    drop(lock);
    let o = cli(&["verify", dir.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    let o = cli(&salvage);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    assert_eq!(code(&cli(&["verify", out.to_str().unwrap()])), 0);
}

/// A path that cannot be looked at (here a symbolic link that loops; as another user, a
/// data directory of mode 0750) is not reported as missing or "not a log" (exit 2,
/// which a script reads as "nothing there"): it is a failure (exit 1) naming the error.
/// Truly missing paths stay exit 2.
#[test]
fn a_path_that_cannot_be_looked_at_is_a_failure_not_a_missing_log() {
    let root = tempfile::tempdir().unwrap();
    let looped = root.path().join("loop");
    std::os::unix::fs::symlink(&looped, &looped).unwrap();
    for args in [&["verify"][..], &["inspect"][..], &["dump"][..]] {
        let o = cli(&[args, &[looped.to_str().unwrap()]].concat());
        assert_eq!(code(&o), 1, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains("cannot look at"), "{args:?}: {}", stderr(&o));
    }
    let state = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["state", "show", "--data-dir"])
        .arg(&looped)
        .output()
        .unwrap();
    assert_eq!(state.status.code(), Some(1), "{}", stderr(&state));
    assert!(stderr(&state).contains("cannot look at"), "{}", stderr(&state));
    let missing = root.path().join("missing");
    assert_eq!(code(&cli(&["verify", missing.to_str().unwrap()])), 2);
    // The data directory instead of the log under it: named, with the log's path.
    let log = make_log(root.path(), 3, small());
    let o = cli(&["verify", root.path().to_str().unwrap()]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains(&format!("did you mean {}?", log.display())), "{}", stderr(&o));
    let state = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["state", "show", "--data-dir"])
        .arg(&missing)
        .output()
        .unwrap();
    assert_eq!(state.status.code(), Some(2));
}

/// A salvage run as root (as after a disk error) gives its copy the owner of the log it
/// copied (the daemon's user): a copy owned by root, put in the log's place, would
/// refuse the daemon its own lock at the next start.
#[test]
fn a_salvaged_copy_is_owned_as_the_log_it_copies() {
    use std::os::unix::fs::MetadataExt;
    if unsafe { libc::geteuid() } != 0 {
        skip_or_fail("a_salvaged_copy_is_owned_as_the_log_it_copies", "not root: ownership cannot be given");
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 40, small());
    for entry in std::fs::read_dir(&dir).unwrap() {
        std::os::unix::fs::chown(entry.unwrap().path(), Some(54321), Some(54322)).unwrap();
    }
    std::os::unix::fs::chown(&dir, Some(54321), Some(54322)).unwrap();
    let out = root.path().join("wal.salvaged");
    let o = cli(&["salvage", dir.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    let mut seen = 0;
    for path in std::iter::once(out.clone()).chain(std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().path())) {
        let m = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!((m.uid(), m.gid()), (54321, 54322), "{}", path.display());
        seen += 1;
    }
    assert!(seen >= 2, "the copy holds {seen} paths");

    // Into a directory that existed, with a file of its own: only what salvage wrote
    // changes owner; the directory and the file are left, and the line says so.
    let existing = root.path().join("existing");
    std::fs::create_dir(&existing).unwrap();
    std::fs::write(existing.join("notes.txt"), b"mine").unwrap();
    let o = cli(&["salvage", dir.to_str().unwrap(), "--out", existing.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{}{}", stdout(&o), stderr(&o));
    for (path, want) in [(existing.clone(), (0, 0)), (existing.join("notes.txt"), (0, 0))] {
        let m = std::fs::metadata(&path).unwrap();
        assert_eq!((m.uid(), m.gid()), want, "{} changed owner", path.display());
    }
    let copied: Vec<PathBuf> = std::fs::read_dir(&existing)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap() != "notes.txt")
        .collect();
    assert!(!copied.is_empty());
    for path in copied {
        let m = std::fs::symlink_metadata(&path).unwrap();
        assert_eq!((m.uid(), m.gid()), (54321, 54322), "{}", path.display());
    }
    assert!(stderr(&o).contains("existed with another owner"), "{}", stderr(&o));
}

/// `--interval-ms` is bounded: an hour's worth of digits too many would make `tail` look
/// for new records never again, and it says so instead of waiting.
#[test]
fn tail_refuses_an_interval_outside_its_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let log = make_log(dir.path(), 1, small());
    for ms in ["100000000000", "0", "9"] {
        let o = cli_in(&["tail", "--interval-ms", ms], &log);
        assert_eq!(code(&o), 2, "{ms}: {}", stderr(&o));
        assert!(stderr(&o).contains("--interval-ms"), "{ms}: {}", stderr(&o));
    }
}

/// Names read from records are shown with their control characters escaped, by `inspect`
/// as by `dump`: a log written elsewhere (or crafted) cannot move the cursor, clear the
/// screen or forge a line of the table.
#[test]
fn names_read_from_records_cannot_write_to_the_terminal() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("wal");
    let wal = Wal::open(&dir, small()).unwrap();
    let mut header = Envelope::decode(&envelope(1)).unwrap().header;
    header.source_key = "so\u{1b}[2Jurce".into();
    header.destination.stream = "ev\nents".into();
    header.destination.topic = "to\u{7}pic".into();
    rt().block_on(rt_append(&wal, Envelope::encode(&header, b"{}")));
    for args in [&["inspect"][..], &["dump"]] {
        let text = stdout(&cli_in(args, &dir));
        assert!(!text.contains(['\u{1b}', '\u{7}']), "{args:?}: {text:?}");
        assert!(text.contains("so\\u{1b}[2Jurce"), "{args:?}: {text:?}");
        assert!(text.contains("ev\\nents") && text.contains("to\\u{7}pic"), "{args:?}: {text:?}");
    }
}

/// `iggy-ingest ARGS` with its soft open-file limit set to `soft` (the hard limit left
/// as it is), as a shell's `ulimit -Sn` leaves it.
fn run_with_soft_open_files(args: &[&str], soft: u64) -> Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"));
    cmd.args(args);
    // SAFETY: only async-signal-safe calls (getrlimit, setrlimit) between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            lim.rlim_cur = soft.min(lim.rlim_max);
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.output().expect("run iggy-ingest")
}

/// The tools hold every segment open (`verify` twice while it checks one): a log of
/// more segments than the soft open-file limit is read whole, the limit raised to the
/// hard one, where "Too many open files" made `verify` exit 1, its code for damage.
#[test]
fn a_log_of_more_segments_than_the_soft_open_file_limit_is_read_whole() {
    let root = tempfile::tempdir().unwrap();
    let dir = make_log(root.path(), 1_500, small());
    let d = dir.to_str().unwrap();
    let count = segments(&dir).len();
    assert!(count > 40, "{count} segments: too few to pass a soft limit of 32");
    let verify = run_with_soft_open_files(&["wal", "verify", d], 32);
    assert_eq!(code(&verify), 0, "{}", stderr(&verify));
    let dump = run_with_soft_open_files(&["wal", "dump", d, "--json"], 32);
    assert_eq!((code(&dump), json_lines(&dump).len()), (0, 1_500), "{}", stderr(&dump));
    let inspect = run_with_soft_open_files(&["wal", "inspect", d, "--json"], 32);
    assert_eq!(code(&inspect), 0, "{}", stderr(&inspect));
    assert_eq!(json(&inspect)["segments"].as_array().map(Vec::len), Some(count), "{}", stdout(&inspect));
}

/// An error said to a standard error that cannot be written (a pipe whose reader went
/// away: `2>&1 | head -1`) is lost, and the exit code is still the command's: 2 for a
/// path that holds no log and for a configuration `config check` refuses, where `eprintln!` panicked
/// (exit 101).
#[test]
fn an_error_said_to_a_closed_standard_error_keeps_its_exit_code() {
    use std::os::fd::FromRawFd;
    let root = tempfile::tempdir().unwrap();
    let bad_config = root.path().join("bad.toml");
    std::fs::write(&bad_config, "[http]\naccept = 3\n").unwrap();
    let no_log = root.path().join("nothing-here");
    let no_log = no_log.to_str().unwrap();
    let bad_config = bad_config.to_str().unwrap();
    for (args, want) in [(vec!["wal", "verify", no_log], 2), (vec!["config", "check", bad_config], 2)] {
        let mut fds = [0i32; 2];
        // SAFETY: pipe(2) fills the two descriptors; the read end is closed at once and
        // the write end is owned by the child's standard error from here.
        let write_end = unsafe {
            assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
            libc::close(fds[0]);
            std::os::fd::OwnedFd::from_raw_fd(fds[1])
        };
        let out = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(&args)
            .stderr(Stdio::from(write_end))
            .output()
            .expect("run iggy-ingest");
        assert_eq!(code(&out), want, "{args:?}");
    }
}

/// A secret-path endpoint's id is its URL's secret: `wal dump` and `wal tail` show its
/// first 8 hex digits, as the daemon's logs do, in both formats, and the whole id only
/// when asked (`--full-endpoint-ids`).
#[test]
fn dump_and_tail_show_an_endpoint_id_by_its_prefix_unless_asked_for_it_whole() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("wal");
    let id: u128 = 0x1a2b3c4d_5e6f7081_92a3b4c5_d6e7f809;
    let record = {
        let mut e = Envelope::decode(&envelope(1)).unwrap();
        e.header.endpoint_id = Some(id);
        Envelope::encode(&e.header, &e.payload)
    };
    let wal = Wal::open(&dir, small()).unwrap();
    rt().block_on(rt_append(&wal, record));
    let whole = format!("{id:032x}");
    let d = dir.to_str().unwrap();
    let human = stdout(&cli(&["dump", d]));
    assert!(human.contains(" endpoint=1a2b3c4d… "), "{human}");
    let json = json_lines(&cli(&["dump", d, "--json"]));
    assert_eq!(json[0]["endpoint"], "1a2b3c4d…");
    let mut tail = KillOnDrop(
        Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .args(["wal", "tail", d, "--interval-ms", "20", "-n", "1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let tailed = line_reader(&mut tail.0).recv_timeout(Duration::from_secs(30)).expect("a line from tail");
    assert!(tailed.contains(" endpoint=1a2b3c4d… "), "{tailed}");
    for shown in [&human, &json[0].to_string(), &tailed] {
        assert!(!shown.contains(&whole), "the whole id shown: {shown}");
    }
    let asked = stdout(&cli(&["dump", d, "--full-endpoint-ids"]));
    assert!(asked.contains(&format!(" endpoint={whole} ")), "{asked}");
    let asked = json_lines(&cli(&["dump", d, "--json", "--full-endpoint-ids"]));
    assert_eq!(asked[0]["endpoint"], whole.as_str());
}

/// `--payload-only` shows each payload exactly to another program, and to a terminal
/// with what would act on it escaped: a sender's bytes set no title, clear nothing and
/// forge no line there, as in the human format.
#[test]
fn payload_only_to_a_terminal_escapes_what_would_act_on_it() {
    const TEST: &str = "payload_only_to_a_terminal_escapes_what_would_act_on_it";
    if Command::new("script").arg("--version").output().is_err() {
        skip_or_fail(TEST, "`script` (util-linux) is not installed");
        return;
    }
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("wal");
    let payload = "red\u{1b}]0;PWNED\u{7}\u{1b}[2J\r\nforged line\u{9b}31m";
    let record = {
        let e = Envelope::decode(&envelope(1)).unwrap();
        Envelope::encode(&e.header, payload.as_bytes())
    };
    let wal = Wal::open(&dir, small()).unwrap();
    rt().block_on(rt_append(&wal, record));
    let (bin, d) = (env!("CARGO_BIN_EXE_iggy-ingest"), dir.display());
    let piped = cli(&["dump", dir.to_str().unwrap(), "--payload-only"]);
    assert_eq!(piped.stdout, format!("{payload}\n").as_bytes(), "not exact into a pipe");
    for command in [
        format!("'{bin}' wal dump '{d}' --payload-only"),
        format!("'{bin}' wal tail '{d}' --payload-only -n 1 & sleep 3; kill $!"),
    ] {
        let screen = on_a_terminal(&command);
        assert!(screen.contains(r"red\u{1b}]0;PWNED\u{7}\u{1b}[2J\r\nforged line\u{9b}31m"), "{command}: {screen:?}");
        assert!(!screen.contains('\u{1b}') && !screen.contains('\u{9b}'), "{command}: {screen:?}");
    }
}
