//! Runs saved inputs through a target's code outside libFuzzer, for debugging a finding
//! with an ordinary debugger or `RUST_BACKTRACE=1`:
//! `cargo +nightly run --example replay -- <target> <input-file>...`

fn main() {
    let mut args = std::env::args().skip(1);
    let target = args.next().unwrap_or_default();
    let run: fn(&[u8]) = match target.as_str() {
        "open_arbitrary_dir" => iggy_ingest_fuzz::open_dir::run,
        "ops_vs_model" => iggy_ingest_fuzz::ops::run,
        "ops_with_read_faults" => iggy_ingest_fuzz::ops::run_with_read_faults,
        "http_door" => iggy_ingest_fuzz::door::run,
        _ => {
            eprintln!("usage: replay open_arbitrary_dir|ops_vs_model|ops_with_read_faults|http_door <input-file>...");
            std::process::exit(2);
        }
    };
    for path in args {
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        if std::env::var_os("REPLAY_DECODE").is_some() && target == "open_arbitrary_dir" {
            eprintln!("{:#?}", iggy_ingest_fuzz::open_dir::decode(&data));
        }
        eprintln!("{path}: running");
        // REPLAY_REPEAT=n runs each input n times, for profiling.
        let repeat: u32 = std::env::var("REPLAY_REPEAT").ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1);
        let started = std::time::Instant::now();
        for _ in 0..repeat {
            run(&data);
        }
        eprintln!("{path}: ok in {:?} per run", started.elapsed() / repeat);
    }
}
