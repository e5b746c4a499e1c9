//! Writes the seed corpus of every fuzz target into `corpus/<target>/`.
//!
//! Run from `fuzz/`: `cargo +nightly run --example seed_corpus`. The seeds are encoded
//! with the same code the targets decode with, so they stay meaningful when the input
//! formats change (rerun this, then commit the result). Existing files are overwritten,
//! other files in the corpus directories are left alone.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use iggy_ingest_fuzz::door;
use iggy_ingest_fuzz::open_dir::{self, Built, Ending, Image, Mutation, RawFile, RawName};
use iggy_ingest_fuzz::ops::{self, Op, Setup};
use iggy_ingest_fuzz::{file_names, log_dir, payload};
use wal::format::parse_segment_file_name;
use wal::storage::{SimStorage, Storage};
use wal::{CLEAN_MARKER_FILE, Wal, WalOptions};

fn save(target: &str, name: &str, bytes: &[u8]) {
    save_in("corpus", target, name, bytes);
}

fn save_in(kind: &str, target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(kind).join(target);
    std::fs::create_dir_all(&dir).expect("create the corpus directory");
    std::fs::write(dir.join(name), bytes).expect("write a seed");
}

fn built(segment: u8, initial: u8, batches: &[&[u8]], ending: Ending) -> Image {
    Image::Built(Built { segment, initial, batches: batches.iter().map(|b| b.to_vec()).collect(), ending })
}

/// A real log's files, as a raw image: segments written through the API, optionally
/// closed cleanly (with its marker).
fn raw_from_real_log(records: u64, close: bool) -> Vec<RawFile> {
    let sim = SimStorage::new();
    let dir = log_dir();
    // Small segments, so the image holds several sealed ones and a tail.
    let options = WalOptions { segment_max_bytes: 640, max_bytes: 1 << 20, ..WalOptions::default() };
    let wal = Wal::open_with(Arc::new(sim.clone()) as Arc<dyn Storage>, &dir, options).expect("open");
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    runtime.block_on(async {
        for i in 0..records {
            let batch: Vec<Bytes> = (0..1 + i % 3).map(|k| payload(i * 4 + k, 20 + (i as usize * 7) % 60)).collect();
            wal.append(batch).await.expect("append");
        }
        if close {
            wal.close().await.expect("close");
        }
    });
    drop(wal);
    file_names(&sim, &dir)
        .into_iter()
        .filter_map(|n| {
            let name = if n == CLEAN_MARKER_FILE {
                RawName::CleanMarker
            } else {
                RawName::Segment(u16::try_from(parse_segment_file_name(&n)?).ok()?)
            };
            Some(RawFile { name, bytes: sim.read_file(&dir.join(&n)).expect("read") })
        })
        .collect()
}

fn open_arbitrary_dir() {
    let t = "open_arbitrary_dir";
    let save_image =
        |name: &str, image: Image, mutations: &[Mutation]| save(t, name, &open_dir::encode(&image, mutations));
    let few: &[&[u8]] = &[&[10], &[40, 41], &[100], &[7, 8, 9, 200]];
    let many: Vec<&[u8]> = (0..16).map(|i| if i % 2 == 0 { &[60u8, 61][..] } else { &[120u8][..] }).collect();
    save_image("built-empty", built(10, 0, &[], Ending::Drop), &[]);
    save_image("built-few-closed", built(20, 0, few, Ending::Close), &[]);
    save_image("built-rotating-dropped", built(8, 0, &many, Ending::Drop), &[]);
    save_image("built-rotating-closed", built(8, 0, &many, Ending::Close), &[]);
    save_image("built-crash-mid-way", built(8, 0, &many, Ending::CrashAt { n: 20, seed: 7 }), &[]);
    save_image("built-released", built(8, 0, &many, Ending::ReleaseThenClose { at: 128 }), &[]);
    save_image("built-offset-max", built(8, 2, few, Ending::Close), &[]);
    save_image("built-u32-boundary", built(8, 3, &many, Ending::Drop), &[]);
    save_image("built-large-records", built(4, 0, &[&[250, 251], &[255], &[5]], Ending::Drop), &[]);
    let rotating = || built(8, 0, &many, Ending::Drop);
    save_image("mut-flip-first-record", rotating(), &[Mutation::FlipBit { file: 0, pos: 70, bit: 3 }]);
    save_image("mut-truncate-tail", rotating(), &[Mutation::Truncate { file: 255, pos: 150 }]);
    save_image("mut-frame-offset", rotating(), &[Mutation::FrameField { file: 0, frame: 0, field: 1, value: 99 }]);
    save_image(
        "mut-frame-synced-len",
        built(40, 0, few, Ending::Drop),
        &[
            Mutation::FlipBit { file: 0, pos: 70, bit: 1 },
            Mutation::FrameField { file: 0, frame: 3, field: 2, value: 4096 },
        ],
    );
    save_image("mut-payload-byte", rotating(), &[Mutation::PayloadByte { file: 3, frame: 0, pos: 5, value: 0xFF }]);
    save_image("mut-delete-middle", rotating(), &[Mutation::Delete { file: 2 }]);
    save_image("mut-rename-tail", rotating(), &[Mutation::Rename { file: 255, delta: 2 }]);
    save_image("mut-gap-flag", rotating(), &[Mutation::SegmentHeaderField { file: 2, field: 1, value: 1 }]);
    save_image("mut-dup-frame", built(40, 0, few, Ending::Drop), &[Mutation::DuplicateFrame { file: 0, frame: 1 }]);
    save_image(
        "mut-marker",
        built(40, 0, few, Ending::Drop),
        &[Mutation::Marker { len_delta: 0, next_delta: 0, sealed: 0 }],
    );
    save_image(
        "mut-zero-append",
        rotating(),
        &[Mutation::ZeroRange { file: 4, pos: 40, len: 64 }, Mutation::AppendBytes { file: 4, bytes: vec![0xAB; 40] }],
    );
    save_image("raw-real-log", Image::Raw(raw_from_real_log(10, false)), &[]);
    save_image("raw-real-log-closed", Image::Raw(raw_from_real_log(10, true)), &[]);
    save_image(
        "raw-odd-names",
        Image::Raw(vec![
            RawFile { name: RawName::HighSegment(0), bytes: vec![0; 64] },
            RawFile { name: RawName::Temp(3), bytes: vec![1; 10] },
            RawFile { name: RawName::CleanMarker, bytes: vec![2; 40] },
        ]),
        &[Mutation::SegmentHeaderField { file: 0, field: 2, value: 0 }],
    );
}

fn ops_vs_model() {
    let t = "ops_vs_model";
    let append = |sizes: &[u8]| Op::Append { sizes: sizes.to_vec() };
    let plain = Setup { segment: 8, capacity: 0, initial: 0 };
    let mut basic = Vec::new();
    for i in 0..12u8 {
        basic.push(append(&[64 + i, 70]));
        if i % 4 == 3 {
            basic.push(Op::Read { from: i * 20, max_records: 3, max_bytes: 200 });
        }
    }
    basic.extend([Op::Crash { seed: 1 }, append(&[80]), Op::Read { from: 0, max_records: 8, max_bytes: 1000 }]);
    save(t, "append-read-crash", &ops::encode(plain, &basic));

    let mut release = Vec::new();
    for i in 0..16u8 {
        release.push(append(&[100 + i, 10, 150]));
    }
    release.extend([Op::Release { at: 128 }, Op::CloseReopen, Op::Release { at: 250 }, Op::Restart, append(&[1])]);
    save(t, "rotate-release-reopen", &ops::encode(plain, &release));

    let faults = vec![
        append(&[90]),
        Op::FailNth { op: 0, n: 0, kind: 0 },
        append(&[90, 91]),
        append(&[92]),
        Op::FailNth { op: 1, n: 0, kind: 1 },
        append(&[93]),
        append(&[94]),
        Op::CrashLoseUnsynced,
        Op::Read { from: 0, max_records: 31, max_bytes: 5000 },
    ];
    save(t, "fail-write-and-sync", &ops::encode(plain, &faults));

    let mut crash_at = vec![append(&[150; 4])];
    for n in [0u8, 3, 6] {
        crash_at.push(Op::CrashAtNth { op: 4, n, seed: n + 1 });
        crash_at.extend((0..4).map(|i| append(&[200 + i, 130])));
    }
    save(t, "crash-at-nth-during-rotation", &ops::encode(Setup { segment: 2, ..plain }, &crash_at));

    // Zeros ahead of a quarter segment (the capacity byte's choice 1): appends grow the
    // segment's file, and power is lost at writes and syncs among them.
    let mut growing = Vec::new();
    for n in [1u8, 4, 9] {
        growing.extend((0..5).map(|i| append(&[60 + i, 40])));
        growing.push(Op::CrashAtNth { op: n % 2, n, seed: n });
    }
    growing.push(Op::Read { from: 0, max_records: 64, max_bytes: 20_000 });
    save(t, "crash-while-zeros-ahead-grow-the-file", &ops::encode(Setup { capacity: 8, ..plain }, &growing));

    let exhaust: Vec<Op> = (0..10).map(|i| append(&[20 + i, 30])).collect();
    save(t, "offsets-near-max", &ops::encode(Setup { initial: 2, ..plain }, &exhaust));

    let mut full: Vec<Op> = (0..30).map(|i| append(&[140 + (i % 20)])).collect();
    full.insert(10, Op::Release { at: 200 });
    save(t, "small-capacity", &ops::encode(Setup { segment: 4, capacity: 192, initial: 0 }, &full));

    let mut space = vec![append(&[100]), Op::SpaceLimit { extra: 20 }];
    space.extend((0..8).map(|i| append(&[130 + i])));
    space.extend([Op::SpaceLimit { extra: 0 }, append(&[5]), Op::Crash { seed: 9 }]);
    save(t, "disk-full", &ops::encode(plain, &space));

    let tiny: Vec<Op> = (0..20).map(|i| append(&[i % 16, 0, 255])).chain([Op::CloseReopen]).collect();
    save(t, "tiny-and-segment-sized-records", &ops::encode(Setup { segment: 1, ..plain }, &tiny));
}

/// Reads failed by the disk (fault kind 5 in this target): by the reader, during an open,
/// and a power loss at a read.
fn ops_with_read_faults() {
    let t = "ops_with_read_faults";
    let append = |sizes: &[u8]| Op::Append { sizes: sizes.to_vec() };
    let plain = Setup { segment: 8, capacity: 0, initial: 0 };
    let filled = |n: u8| (0..n).map(|i| append(&[100 + i, 60])).collect::<Vec<Op>>();

    let mut reader = filled(12);
    reader.extend([
        Op::FailNth { op: 5, n: 0, kind: 0 },
        Op::Read { from: 0, max_records: 4, max_bytes: 2000 },
        Op::FailNth { op: 5, n: 1, kind: 0 },
        Op::Read { from: 40, max_records: 1, max_bytes: 100 },
        append(&[7]),
    ]);
    save(t, "fail-reads-of-the-reader", &ops::encode(plain, &reader));

    let mut open = filled(12);
    open.extend([
        Op::FailNth { op: 5, n: 0, kind: 0 },
        Op::Restart,
        Op::FailNth { op: 5, n: 3, kind: 0 },
        Op::CrashLoseUnsynced,
        append(&[9]),
    ]);
    save(t, "fail-reads-during-open", &ops::encode(plain, &open));

    let mut power = filled(8);
    power.extend([
        Op::CrashAtNth { op: 5, n: 0, seed: 3 },
        Op::Read { from: 0, max_records: 8, max_bytes: 4000 },
        append(&[11]),
        Op::CrashAtNth { op: 5, n: 2, seed: 4 },
        Op::CloseReopen,
    ]);
    save(t, "power-loss-at-a-read", &ops::encode(plain, &power));
}

/// Inputs that showed a defect in the log, kept as regression input (`fuzz/README.md`
/// describes each). Each fails only its own check once the others are listed in
/// `FUZZ_KNOWN_FINDINGS`.
fn regressions() {
    // Two faults due on the same write: the simulated disk fires one, and the other's
    // countdown underflows on the next counted operation (a panic in the disk itself).
    let plain = Setup { segment: 8, capacity: 0, initial: 0 };
    let two_faults = [
        Op::FailNth { op: 0, n: 0, kind: 0 },
        Op::FailNth { op: 4, n: 0, kind: 0 },
        Op::Append { sizes: vec![60] },
        Op::Append { sizes: vec![60] },
    ];
    save_in("regressions", "ops_vs_model", "sim-simultaneous-faults", &ops::encode(plain, &two_faults));

    let t = "open_arbitrary_dir";
    let save_image = |name: &str, image: Image, mutations: &[Mutation]| {
        save_in("regressions", t, name, &open_dir::encode(&image, mutations))
    };
    let many: Vec<&[u8]> = (0..16).map(|i| if i % 2 == 0 { &[60u8, 61][..] } else { &[120u8][..] }).collect();
    let rotating = || built(8, 0, &many, Ending::Drop);
    // A stray copy of segment 0 named past the tail: salvage keeps the unsealed tail and
    // starts a new segment after it, and the salvaged log does not reopen.
    save_image("salvage-keeps-unsealed-tail-before-bad-header", rotating(), &[Mutation::Copy { file: 0, delta: -1 }]);
    // Segment 2 renamed over segment 5: salvage keeps segments 0 and 3 although 0's seal
    // says 2, and readers skip offset 2 without an error.
    save_image("salvage-skips-seal-check-before-bad-header", rotating(), &[Mutation::Rename { file: 1, delta: 3 }]);
    // A payload bit flipped in a sealed segment: the read that meets it fails, but the
    // records it read before the damage are consumed and never returned.
    save_image("reader-error-consumes-records", rotating(), &[Mutation::FlipBit { file: 1, pos: 100, bit: 3 }]);
    // A header bit flipped in the only record of a cleanly closed log:
    // verify calls it a torn tail and reports the log clean; readers fail on it.
    // A checked clean-shutdown marker that vouches for a 280-byte tail holding no valid
    // record (next offset = the tail's base): the open trusts it, the first append needs
    // a new segment, and the writer thread panics in `rotate` ("rotating an empty
    // segment") instead of failing the append; every later call gets `Closed`.
    save_image(
        "lying-marker-writer-panic",
        built(20, 0, &[&[216]], Ending::Drop),
        &[Mutation::FlipBit { file: 0, pos: 40, bit: 0 }, Mutation::Marker { len_delta: 0, next_delta: 0, sealed: 0 }],
    );
    save_image(
        "verify-calls-damage-in-closed-tail-torn",
        built(100, 0, &[&[10]], Ending::Close),
        &[Mutation::FlipBit { file: 0, pos: 40, bit: 0 }],
    );
}

/// The door: one seed per kind of answer, so fuzzing starts from requests that reach
/// auth, decoding, routing and the append.
fn http_door() {
    use door::{Seed, Setup};
    use http_source::route::OnMissing;
    let setup = |max_body_bytes, wal_max_bytes, on_missing, idempotency| Setup {
        max_body_bytes,
        wal_max_bytes,
        on_missing,
        idempotency,
        max_events_per_request: http_source::body::MAX_EVENTS_PER_REQUEST_DEFAULT,
    };
    let open = |content_type, body| Seed { path: 0, source: 0, content_type, body, auth: 0 };
    let signed = |source, content_type, body, auth| Seed { path: 0, source, content_type, body, auth };
    let default = setup(4096, 1 << 20, OnMissing::Default, true);
    let (long_x, long_y) = ("x".repeat(100), "y".repeat(500));
    let seeds: Vec<(&str, Setup, Vec<Seed<'_>>)> = vec![
        ("open-json", default, vec![open(1, r#"{"a":1}"#)]),
        ("open-ndjson", default, vec![open(2, "{\"n\":1}\n{\"n\":2}\r\n\n{\"n\":3}\n")]),
        ("open-ndjson-bad-line", default, vec![open(2, "{\"n\":1}\n{\"n\":\n")]),
        (
            "open-ndjson-over-the-event-limit",
            Setup { max_events_per_request: 4, ..default },
            vec![open(2, "1\n2\n3\n4\n"), open(2, "1\n2\n\n3\n4\n5\n")],
        ),
        ("open-text-then-empty", default, vec![open(3, "hello"), open(0, "")]),
        ("open-over-limit", setup(64, 1 << 20, OnMissing::Default, true), vec![open(3, &long_x)]),
        ("log-full", setup(4096, 2048, OnMissing::Default, true), vec![open(3, &long_y); 4]),
        ("github-signed", default, vec![signed(1, 1, r#"{"zen":"hi"}"#, 1), signed(1, 1, r#"{"zen":"hi"}"#, 4)]),
        ("github-not-json", default, vec![signed(1, 3, "{}", 1)]),
        (
            "svix-routed",
            setup(4096, 1 << 20, OnMissing::Error, true),
            vec![signed(2, 1, r#"{"type":"a","id":7}"#, 1), signed(2, 1, r#"{"type":"a","id":7}"#, 1)],
        ),
        (
            "svix-unmatched-dropped",
            setup(4096, 1 << 20, OnMissing::Drop, true),
            vec![signed(2, 2, "{\"type\":\"zzz\"}\n{\"type\":\"b\",\"id\":1}\n", 1)],
        ),
        ("svix-stale", default, vec![signed(2, 1, r#"{"type":"b"}"#, 3)]),
        ("stripe-identity-route", default, vec![signed(3, 1, r#"{"kind":"charges","ns":"billing"}"#, 1)]),
        ("stripe-denylisted", default, vec![signed(3, 1, r#"{"kind":"secret","ns":"billing"}"#, 1)]),
        ("stripe-garbage-signature", default, vec![signed(3, 1, r#"{"kind":"x"}"#, 5)]),
        ("endpoint-bearer", default, vec![Seed { path: 3, source: 0, content_type: 1, body: r#"{"e":1}"#, auth: 1 }]),
        ("endpoint-no-token", default, vec![Seed { path: 3, source: 0, content_type: 1, body: "{}", auth: 0 }]),
        ("hidden-named-path", default, vec![signed(4, 1, "{}", 0)]),
    ];
    for (name, setup, requests) in seeds {
        save("http_door", name, &door::encode_seed(setup, &requests));
    }
}

fn main() {
    open_arbitrary_dir();
    ops_vs_model();
    ops_with_read_faults();
    http_door();
    regressions();
}
