//! Load benchmark of the webhook door, beside its baseline, in one invocation.
//!
//! `load.sh` beside this file installs `wrk` (Debian) if missing and runs this target.
//! It runs `wrk` (64 keep-alive connections, 1 KiB JSON events) against:
//!
//! - **bare**: a minimal axum server started here that answers 200 without doing
//!   anything (the ceiling of HTTP handling on this machine);
//! - **durable floor**: the same kind of axum server, on the daemon's runtime shape (as
//!   many async workers as the daemon's default, the cores minus one, at least one, and
//!   one writer thread), that answers 200 only after a writer thread wrote
//!   the body with one `pwrite` per group and one `fdatasync` (group commit into a
//!   preallocated file in the bench directory), and does nothing else: no envelope, no
//!   checksum, no metrics, no router. What a durable 200 costs on this machine before
//!   any of the daemon's own work; not a log (it wraps around its file), a measure;
//! - **daemon**: the release `iggy-ingest` binary with `wal.sync = "always"`, i.e. every
//!   200 waited for `fdatasync`, its router on and Iggy unreachable (`127.0.0.1:1`, unless
//!   `LOAD_DAEMON_EXTRA` gives an `[iggy]` address): the records are held, not delivered;
//!
//! in rounds (bare and daemon back to back, bare first in odd rounds and the daemon
//! first in even ones, then the floor; `LOAD_ROUNDS` times), after a sync of the disk and
//! a short discarded run of load on each server, all of them on the daemon's allocator
//! (mimalloc), and prints events/s, p50/p99
//! latency, non-2xx answers, the CPU time the server's process spent per request (user
//! and system, from `/proc`: what each design costs the machine, steadier than a rate
//! the other tenants move) and each round's ratio to the bare server as a Markdown
//! table, then the median ratios: the daemon's against bare (the figure the target is
//! set on), the floor's against bare, and the daemon's against the floor (what the
//! daemon's own work costs beside the durable write). `LOAD_FLOOR=0` leaves the floor
//! out. A shared virtual machine's speed drifts from minute to minute;
//! a ratio taken within one round, and the median over rounds, is what holds still.
//! Afterwards it checks that the daemon's log took at least as many records (offsets
//! appended, delivered ones included) as wrk counted 2xx answers.
//!
//! `LOAD_KEYED=1` gives every request a delivery id of its own (`Idempotency-Key`), as
//! GitHub, Stripe and Standard Webhooks senders do: the daemon then also looks each one
//! up and records it in its state database (the other two servers ignore it).
//!
//! Environment: `LOAD_SECS` (default 10), `LOAD_ROUNDS` (3), `LOAD_CONNECTIONS` (64), `LOAD_THREADS` (2), `LOAD_FLOOR` (1), `LOAD_KEYED` (0),
//! `LOAD_BENCH_DIR` (default: Cargo's target tmp dir; put it on the disk you care about:
//! on tmpfs `fdatasync` is free and the figures mean nothing).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The daemon's allocator (`src/main.rs`), for the bare server and the floor too: the
/// floor frees on its writer thread what its workers allocated, the pattern under which
/// glibc's malloc cost the daemon 3 to 20 % (docs/performance.md), so with glibc here the
/// baselines would run on another allocator than the daemon they are set against.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

#[derive(Debug, Default)]
struct WrkResult {
    requests: u64,
    requests_per_sec: f64,
    p50_ms: f64,
    p99_ms: f64,
    non_2xx: u64,
    socket_errors: String,
    /// CPU time the server's process spent per completed request, in microseconds.
    cpu_us_per_request: f64,
}

fn to_ms(s: &str) -> f64 {
    let s = s.trim();
    let (num, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len()));
    let v: f64 = num.parse().unwrap_or(f64::NAN);
    match unit {
        "us" => v / 1000.0,
        "ms" => v,
        "s" => v * 1000.0,
        "m" => v * 60_000.0,
        _ => f64::NAN,
    }
}

fn parse_wrk(out: &str) -> WrkResult {
    let mut r = WrkResult::default();
    for line in out.lines() {
        let t = line.trim();
        if let Some(v) = t.strip_prefix("Requests/sec:") {
            r.requests_per_sec = v.trim().parse().unwrap_or(f64::NAN);
        } else if let Some(v) = t.strip_prefix("50%") {
            r.p50_ms = to_ms(v);
        } else if let Some(v) = t.strip_prefix("99%") {
            r.p99_ms = to_ms(v);
        } else if let Some(v) = t.strip_prefix("Non-2xx or 3xx responses:") {
            r.non_2xx = v.trim().parse().unwrap_or(u64::MAX);
        } else if t.starts_with("Socket errors:") {
            r.socket_errors = t.to_string();
        } else if t.contains(" requests in ") {
            r.requests = t.split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(0);
        }
    }
    r
}

/// The median, lowest and highest of some ratios (at least one).
fn spread(mut ratios: Vec<f64>) -> (f64, f64, f64) {
    ratios.sort_by(f64::total_cmp);
    let n = ratios.len();
    // The median: the middle value, or the mean of the two middle ones.
    let median = if n % 2 == 1 { ratios[n / 2] } else { (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0 };
    (median, ratios[0], ratios[n - 1])
}

/// CPU time (user and system) a process has used so far, in microseconds: `None` for
/// this one (the bench, whose only busy threads during a run are the server's under
/// load), or a child's pid. From `/proc/PID/stat` (`utime`, `stime`, in clock ticks).
fn cpu_us(pid: Option<u32>) -> u64 {
    let path = pid.map_or_else(|| "/proc/self/stat".to_string(), |p| format!("/proc/{p}/stat"));
    let stat = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    // The command name, field 2, is in parentheses and may hold spaces: count from after it.
    let after_name = &stat[stat.rfind(')').expect("a stat line") + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // SAFETY: sysconf reads a constant of the system.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    ticks * 1_000_000 / per_second
}

/// A run of wrk against `url`, and the CPU the server's process (`pid`, as for
/// [`cpu_us`]) spent per completed request meanwhile.
fn run_wrk(
    url: &str,
    script: &Path,
    secs: u64,
    connections: u64,
    threads: u64,
    pid: Option<u32>,
) -> (WrkResult, String) {
    let cpu_before = cpu_us(pid);
    let out = Command::new("wrk")
        .args([
            "-t",
            &threads.to_string(),
            "-c",
            &connections.to_string(),
            "-d",
            &format!("{secs}s"),
            "--latency",
            "-s",
        ])
        .arg(script)
        .arg(url)
        .output()
        .unwrap_or_else(|e| panic!("cannot run wrk ({e}); run crates/runtime/benches/load.sh, which installs it"));
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "wrk failed: {}\n{text}", String::from_utf8_lossy(&out.stderr));
    let mut result = parse_wrk(&text);
    result.cpu_us_per_request = (cpu_us(pid) - cpu_before) as f64 / result.requests.max(1) as f64;
    (result, text)
}

fn start_bare_server() -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let app = axum::Router::new()
                .route("/v1/sources/default", axum::routing::post(|| async { axum::http::StatusCode::OK }));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    rx.recv().unwrap()
}

/// The durable floor's file: appends wrap around inside it, so that every sync persists
/// data pages and no size change, as the daemon's log does with its zeros written ahead.
const FLOOR_FILE_BYTES: u64 = 256 << 20;

type FloorQueue = std::sync::Mutex<Vec<(axum::body::Bytes, tokio::sync::oneshot::Sender<()>)>>;

/// Starts the durable floor (see the module comment) with its file in `dir`.
fn start_floor_server(dir: &Path) -> SocketAddr {
    use std::os::unix::fs::FileExt;
    use std::sync::{Arc, Condvar};
    let path = dir.join("floor.bin");
    let file = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).unwrap();
    let zeros = vec![0u8; 1 << 20];
    for i in 0..FLOOR_FILE_BYTES >> 20 {
        file.write_all_at(&zeros, i << 20).unwrap();
    }
    file.sync_all().unwrap();
    let queue: Arc<(FloorQueue, Condvar)> = Arc::default();
    let writer_queue = queue.clone();
    std::thread::spawn(move || {
        let (pending, wake) = &*writer_queue;
        let mut at = 0u64;
        let mut buf = Vec::with_capacity(1 << 20);
        loop {
            let group = {
                let mut q = pending.lock().unwrap();
                while q.is_empty() {
                    q = wake.wait(q).unwrap();
                }
                std::mem::take(&mut *q)
            };
            buf.clear();
            for (body, _) in &group {
                buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
                buf.extend_from_slice(body);
            }
            if at + buf.len() as u64 > FLOOR_FILE_BYTES {
                at = 0;
            }
            if let Err(e) = file.write_all_at(&buf, at).and_then(|()| file.sync_data()) {
                // Every request would wait for ever: end the bench with the reason instead.
                eprintln!("the durable floor cannot write or sync {}: {e}", path.display());
                std::process::exit(1);
            }
            at += buf.len() as u64;
            for (_, done) in group {
                let _ = done.send(());
            }
        }
    });
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // The daemon's default (`runtime.worker_threads = 0`): the cores minus one.
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get().saturating_sub(1).max(1));
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(workers).enable_all().build().unwrap();
        rt.block_on(async move {
            let append = move |body: axum::body::Bytes| {
                let queue = queue.clone();
                async move {
                    let (done, wait) = tokio::sync::oneshot::channel();
                    {
                        let mut q = queue.0.lock().unwrap();
                        q.push((body, done));
                        if q.len() == 1 {
                            queue.1.notify_one();
                        }
                    }
                    match wait.await {
                        Ok(()) => axum::http::StatusCode::OK,
                        Err(_) => axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    }
                }
            };
            let app = axum::Router::new().route("/v1/sources/default", axum::routing::post(append));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    rx.recv().unwrap()
}

struct DaemonProcess(Child);

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The Iggy address the daemon is given unless `LOAD_DAEMON_EXTRA` names one: a port
/// nothing listens on, so the router runs (its lanes failing, the records held) and
/// delivers nothing. With the built-in default (127.0.0.1:8090), a server left running
/// there would take the records and its own share of the two cores, and the figures
/// would measure something else.
const UNREACHABLE_IGGY: &str = "127.0.0.1:1";

fn start_daemon(dir: &Path) -> (DaemonProcess, SocketAddr, SocketAddr) {
    let cfg = dir.join("config.toml");
    let ready = dir.join("ready.json");
    // LOAD_DAEMON_EXTRA: more TOML, e.g. "[router]\nenabled = false" to measure the door
    // alone, or an [iggy] address to deliver while accepting.
    let extra = std::env::var("LOAD_DAEMON_EXTRA").unwrap_or_default().replace("\\n", "\n");
    let iggy =
        if extra.contains("[iggy]") { String::new() } else { format!("[iggy]\naddress = \"{UNREACHABLE_IGGY}\"\n") };
    std::fs::write(
        &cfg,
        format!(
            "[http]\nlisten = \"127.0.0.1:0\"\n[admin]\nlisten = \"127.0.0.1:0\"\n[logging]\nlevel = \"warn\"\n[storage]\ndata_dir = \"{}\"\n[wal]\nsync = \"always\"\n{iggy}[sources.default]\ndestination = {{ stream = \"ingest\", topic = \"events\" }}\n{extra}",
            dir.join("data").display(),
        ),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["run", "--config"])
        .arg(&cfg)
        .arg("--ready-file")
        .arg(&ready)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let child = DaemonProcess(child);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(t) = std::fs::read_to_string(&ready) {
            let v: serde_json::Value = serde_json::from_str(&t).unwrap();
            return (
                child,
                v["http"].as_str().unwrap().parse().unwrap(),
                v["admin"].as_str().unwrap().parse().unwrap(),
            );
        }
        assert!(Instant::now() < deadline, "daemon not ready");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a plain `cargo test --benches` passes nothing and
    // should not run a minute-long load test.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let secs = env_or("LOAD_SECS", 10);
    let connections = env_or("LOAD_CONNECTIONS", 64);
    let threads = env_or("LOAD_THREADS", 2);
    let rounds_wanted = env_or("LOAD_ROUNDS", 3).max(1);
    let base: PathBuf = std::env::var_os("LOAD_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")));
    std::fs::create_dir_all(&base).unwrap();
    let dir = tempfile::tempdir_in(&base).unwrap();

    // A 1 KiB JSON event.
    let pad = 1024 - r#"{"type":"bench","pad":""}"#.len();
    let event = format!(r#"{{"type":"bench","pad":"{}"}}"#, "x".repeat(pad));
    assert_eq!(event.len(), 1024);
    let script = dir.path().join("post.lua");
    let keyed = env_or("LOAD_KEYED", 0) != 0;
    let mut lua =
        format!("wrk.method = \"POST\"\nwrk.headers[\"Content-Type\"] = \"application/json\"\nwrk.body = '{event}'\n");
    if keyed {
        // One delivery id per request: the run's start (each round's wrk is a process of
        // its own, whose counters start again), the wrk thread's number and a counter.
        lua.push_str(
            "threads_started = 0\n\
             setup = function(thread)\n  threads_started = threads_started + 1\n  \
             thread:set(\"prefix\", \"bench-\" .. os.time() .. \"-\" .. threads_started .. \"-\")\nend\n\
             sent = 0\n\
             request = function()\n  sent = sent + 1\n  \
             wrk.headers[\"Idempotency-Key\"] = prefix .. sent\n  \
             return wrk.format()\nend\n",
        );
    }
    std::fs::write(&script, lua).unwrap();

    // Each round runs bare and the daemon back to back, bare first in odd rounds and the
    // daemon first in even ones (then the floor), so that a change in what the machine
    // gives (other tenants of its host, frequency, a position in the round) lands on
    // both sides of the target's ratio; the verdict is the median round.
    let bare_addr = start_bare_server();
    let floor_addr = (env_or("LOAD_FLOOR", 1) != 0).then(|| start_floor_server(dir.path()));
    let (daemon, http, _admin) = start_daemon(dir.path());
    let mut rounds: Vec<(WrkResult, WrkResult)> = Vec::new();
    let mut floors: Vec<WrkResult> = Vec::new();
    // One wrk run against the server at `addr`, whose process is `pid` (`None`: this one).
    let wrk = |addr: SocketAddr, pid: Option<u32>| {
        run_wrk(&format!("http://{addr}/v1/sources/default"), &script, secs, connections, threads, pid)
    };
    // The build that ran just before leaves its output to be written back, and the
    // servers' first seconds fill caches and pools: neither belongs to round 1. The
    // disk is synced and given a moment, and each server takes a short run of load
    // whose figures are left out.
    // SAFETY: sync(2) takes no argument and cannot fail.
    unsafe { libc::sync() };
    std::thread::sleep(Duration::from_secs(2));
    let warm_up_secs = 2.min(secs);
    for (addr, pid) in [(Some(bare_addr), None), (Some(http), Some(daemon.0.id())), (floor_addr, None)] {
        if let Some(addr) = addr {
            run_wrk(&format!("http://{addr}/v1/sources/default"), &script, warm_up_secs, connections, threads, pid);
        }
    }
    for round in 1..=rounds_wanted {
        let bare_first = round % 2 == 1;
        let mut bare = None;
        if bare_first {
            let (b, raw) = wrk(bare_addr, None);
            eprintln!("--- round {round}, wrk, bare server ---\n{raw}");
            bare = Some(b);
        }
        let (durable, durable_raw) = wrk(http, Some(daemon.0.id()));
        eprintln!("--- round {round}, wrk, daemon ---\n{durable_raw}");
        let bare = bare.unwrap_or_else(|| {
            let (b, raw) = wrk(bare_addr, None);
            eprintln!("--- round {round}, wrk, bare server ---\n{raw}");
            b
        });
        rounds.push((bare, durable));
        if let Some(addr) = floor_addr {
            let (floor, floor_raw) = wrk(addr, None);
            eprintln!("--- round {round}, wrk, durable floor ---\n{floor_raw}");
            floors.push(floor);
        }
    }
    // Stop the daemon cleanly, then count what its log holds.
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(daemon.0.id() as i32, libc::SIGTERM) };
    let mut daemon = daemon;
    let _ = daemon.0.wait();
    // Offsets appended since the log was created (it starts empty here); records a
    // router delivered (LOAD_DAEMON_EXTRA with an [iggy] address) are released from the
    // log but keep their offsets.
    let wal = wal::Wal::open_read_only(dir.path().join("data/wal")).unwrap();
    let records = wal.next_offset();

    println!("\n| round | server | events/s | p50 | p99 | non-2xx | CPU per request | vs bare |");
    println!("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    let mut ratios = Vec::new();
    for (i, (bare, durable)) in rounds.iter().enumerate() {
        let ratio = durable.requests_per_sec / bare.requests_per_sec;
        ratios.push(ratio);
        println!(
            "| {} | bare axum (200, nothing done) | {:.0} | {:.2} ms | {:.2} ms | {} | {:.1} µs | 1.00 |",
            i + 1,
            bare.requests_per_sec,
            bare.p50_ms,
            bare.p99_ms,
            bare.non_2xx,
            bare.cpu_us_per_request
        );
        if let Some(floor) = floors.get(i) {
            println!(
                "| {} | durable floor (group commit + fdatasync, nothing else) | {:.0} | {:.2} ms | {:.2} ms | {} | {:.1} µs | {:.2} |",
                i + 1,
                floor.requests_per_sec,
                floor.p50_ms,
                floor.p99_ms,
                floor.non_2xx,
                floor.cpu_us_per_request,
                floor.requests_per_sec / bare.requests_per_sec
            );
        }
        println!(
            "| {} | iggy-ingest, sync = always | {:.0} | {:.2} ms | {:.2} ms | {} | {:.1} µs | {ratio:.2} |",
            i + 1,
            durable.requests_per_sec,
            durable.p50_ms,
            durable.p99_ms,
            durable.non_2xx,
            durable.cpu_us_per_request
        );
    }
    let (median, lowest, highest) = spread(ratios);
    let requests: u64 = rounds.iter().map(|(_, d)| d.requests).sum();
    let non_2xx: u64 = rounds.iter().map(|(_, d)| d.non_2xx).sum();
    let worst_p99 = rounds.iter().map(|(_, d)| d.p99_ms).fold(0.0, f64::max);
    let socket_errors: Vec<&str> =
        rounds.iter().map(|(_, d)| d.socket_errors.as_str()).filter(|e| !e.is_empty()).collect();
    println!(
        "\nmedian ratio {median:.2} over {} rounds (lowest {lowest:.2}, highest {highest:.2}); daemon p99 at most {worst_p99:.2} ms, {non_2xx} non-2xx",
        rounds.len(),
    );
    // wrk counts as non-2xx only answers of 400 and above; its socket errors (connect,
    // read, write, timeout) are answers that never came, so they fail the target too.
    let met = median >= 0.6 && worst_p99 < 10.0 && non_2xx == 0 && socket_errors.is_empty();
    println!(
        "target (median ratio at least 0.60, p99 under 10 ms, no non-2xx answer, no socket error): {}",
        if met { "met" } else { "not met" }
    );
    if !floors.is_empty() {
        let (median, lowest, highest) = spread(
            floors.iter().zip(&rounds).map(|(f, (bare, _))| f.requests_per_sec / bare.requests_per_sec).collect(),
        );
        println!("durable floor: median ratio {median:.2} (lowest {lowest:.2}, highest {highest:.2})");
        // What the daemon's own work costs beside the durable write, round by round.
        let (median, lowest, highest) =
            spread(floors.iter().zip(&rounds).map(|(f, (_, d))| d.requests_per_sec / f.requests_per_sec).collect());
        println!(
            "daemon against the durable floor: median ratio {median:.2} (lowest {lowest:.2}, highest {highest:.2})"
        );
    }
    let median_cpu = |runs: Vec<f64>| spread(runs).0;
    let cpu_bare = median_cpu(rounds.iter().map(|(b, _)| b.cpu_us_per_request).collect());
    let cpu_daemon = median_cpu(rounds.iter().map(|(_, d)| d.cpu_us_per_request).collect());
    let cpu_floor = (!floors.is_empty()).then(|| median_cpu(floors.iter().map(|f| f.cpu_us_per_request).collect()));
    println!(
        "CPU per request (the server's process, user and system; medians): bare {cpu_bare:.1} µs, {}daemon {cpu_daemon:.1} µs",
        cpu_floor.map_or(String::new(), |f| format!("durable floor {f:.1} µs, ")),
    );
    println!(
        "{secs} s per run, {connections} keep-alive connections, {threads} wrk threads, 1 KiB JSON events{}; \
         the daemon's log took {records} records for {requests} requests wrk completed{}; {}",
        if keyed { ", each with a delivery id of its own" } else { "" },
        if socket_errors.is_empty() { String::new() } else { format!(" ({})", socket_errors.join("; ")) },
        if std::env::var("LOAD_DAEMON_EXTRA").unwrap_or_default().contains("[iggy]") {
            "Iggy as LOAD_DAEMON_EXTRA gives it".to_string()
        } else {
            format!("router on, Iggy unreachable ({UNREACHABLE_IGGY})")
        }
    );
    assert!(records >= requests - non_2xx, "fewer records in the log than 2xx answers");
}
