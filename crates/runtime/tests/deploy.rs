//! The files in `deploy/` agree with each other and with the daemon: the systemd unit
//! (checked by `systemd-analyze verify` where the machine has it), the container
//! image's Dockerfile, and the configuration both run on.

#[path = "common/skip.rs"]
mod skip;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(repo().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// `section -> key -> values` (a key may repeat) of a unit file.
fn parse_unit(text: &str) -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let mut out: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    let mut section = String::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(s) = line.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
            section = s.to_string();
            continue;
        }
        assert!(!section.is_empty(), "line {}: a key outside any section", n + 1);
        let (k, v) = line.split_once('=').unwrap_or_else(|| panic!("line {}: not key=value: {line}", n + 1));
        out.entry(section.clone()).or_default().entry(k.trim().to_string()).or_default().push(v.trim().to_string());
    }
    out
}

fn one<'a>(unit: &'a BTreeMap<String, BTreeMap<String, Vec<String>>>, section: &str, key: &str) -> &'a str {
    let values = unit.get(section).and_then(|s| s.get(key)).unwrap_or_else(|| panic!("[{section}] {key} missing"));
    assert_eq!(values.len(), 1, "[{section}] {key} given {} times", values.len());
    &values[0]
}

/// The production configuration, parsed (its token variable is set for the check).
fn deploy_config() -> (iggy_ingest::config::Config, iggy_ingest::config::Settings) {
    let text = read("deploy/iggy-ingest.toml");
    let config = iggy_ingest::config::parse(&text, None).unwrap_or_else(|e| panic!("{e}"));
    // Validation reads admin.token_env from the environment, so it runs in a child.
    let out = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["config", "check"])
        .arg(repo().join("deploy/iggy-ingest.toml"))
        .env("IGGY_INGEST_ADMIN_TOKEN", "a-token-for-the-config-check-0123")
        .output()
        .unwrap();
    assert!(out.status.success(), "deploy/iggy-ingest.toml: {}", String::from_utf8_lossy(&out.stderr));
    let mut with_token = config.clone();
    with_token.admin.token_env = None;
    with_token.admin.token = Some("a-token-for-the-config-check-0123".into());
    let settings = iggy_ingest::config::validate(&with_token, Some(&text), None).unwrap_or_else(|e| panic!("{e}"));
    (config, settings)
}

#[test]
fn the_production_config_needs_its_admin_token_from_the_environment() {
    let (config, _) = deploy_config();
    assert_eq!(config.admin.token_env.as_deref(), Some("IGGY_INGEST_ADMIN_TOKEN"));
    let out = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["config", "check"])
        .arg(repo().join("deploy/iggy-ingest.toml"))
        .env_remove("IGGY_INGEST_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "a start without the token must be refused");
    assert!(String::from_utf8_lossy(&out.stderr).contains("admin.token_env"));
}

#[test]
fn the_systemd_unit_runs_the_production_config_with_room_to_drain() {
    let unit = parse_unit(&read("deploy/systemd/iggy-ingest.service"));
    let (config, settings) = deploy_config();

    // The configuration arrives as a credential from /etc, named after the repo's file.
    let credential = one(&unit, "Service", "LoadCredential");
    let (name, source) = credential.split_once(':').expect("LoadCredential=NAME:PATH");
    assert_eq!(source, "/etc/iggy-ingest/iggy-ingest.toml");
    let file = Path::new(source).file_name().unwrap().to_str().unwrap();
    assert!(repo().join("deploy").join(file).is_file(), "deploy/{file} is what gets installed at {source}");
    let exec = one(&unit, "Service", "ExecStart");
    let args: Vec<&str> = exec.split_whitespace().collect();
    assert_eq!(args[1..], ["run", "--config", &format!("%d/{name}")], "{exec}");

    // The token variable the config names comes from the unit's environment file.
    assert_eq!(one(&unit, "Service", "EnvironmentFile"), "/etc/iggy-ingest/iggy-ingest.env");

    // The data directory is the state directory, and writable under ProtectSystem=strict.
    assert_eq!(config.storage.data_dir, "/var/lib/iggy-ingest");
    assert_eq!(format!("/var/lib/{}", one(&unit, "Service", "StateDirectory")), config.storage.data_dir);
    assert_eq!(one(&unit, "Service", "ReadWritePaths"), config.storage.data_dir);

    // systemd must wait longer than the longest stop before it kills: the drain, and
    // what a stop may take past it (the router, closing the log, the admin listener).
    let stop: u64 = one(&unit, "Service", "TimeoutStopSec").parse().expect("TimeoutStopSec in seconds");
    let longest = settings.drain_delay + settings.grace_period + iggy_ingest::daemon::STOP_PAST_GRACE_MAX;
    assert!(stop * 1000 > longest.as_millis() as u64 + 5_000, "TimeoutStopSec={stop} vs a stop of up to {longest:?}");

    let files: u64 = one(&unit, "Service", "LimitNOFILE").parse().unwrap();
    assert!(files >= settings.max_connections as u64 + 1024, "LimitNOFILE={files}");
    for (key, value) in [
        ("Restart", "on-failure"),
        ("RestartPreventExitStatus", "2"),
        ("NoNewPrivileges", "yes"),
        ("PrivateTmp", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("CapabilityBoundingSet", ""),
        ("KillSignal", "SIGTERM"),
    ] {
        assert_eq!(one(&unit, "Service", key), value, "[Service] {key}");
    }
    assert_ne!(one(&unit, "Service", "User"), "root");
    assert_eq!(one(&unit, "Install", "WantedBy"), "multi-user.target");
}

#[test]
fn systemd_analyze_verifies_the_unit() {
    let probe = Command::new("systemd-analyze").arg("--version").output();
    if !probe.is_ok_and(|o| o.status.success()) {
        skip::skip_or_fail(
            "systemd_analyze_verifies_the_unit",
            "systemd-analyze is not installed (Debian: apt-get install systemd)",
        );
        return;
    }
    // verify checks that ExecStart's program exists: point it at the binary just built.
    let text = read("deploy/systemd/iggy-ingest.service")
        .replace("ExecStart=/usr/local/bin/iggy-ingest ", &format!("ExecStart={} ", env!("CARGO_BIN_EXE_iggy-ingest")));
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("iggy-ingest.service");
    std::fs::write(&path, text).unwrap();
    let out = Command::new("systemd-analyze").args(["verify", "--man=no"]).arg(&path).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    // It exits 0 on unknown keys and bad values too, and only says so: any output fails.
    assert!(out.status.success() && stderr.trim().is_empty(), "systemd-analyze verify: {stderr}");
}

#[test]
fn the_dockerfile_builds_in_stages_runs_unprivileged_and_matches_the_config() {
    let text = read("deploy/Dockerfile");
    // Instructions with their continuation lines joined.
    let mut instructions: Vec<(String, String)> = Vec::new();
    let mut pending = String::new();
    for line in text.lines() {
        let t = line.trim();
        if pending.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            pending.push_str(head);
            pending.push(' ');
            continue;
        }
        pending.push_str(t);
        let (op, args) = pending.split_once(' ').unwrap_or((pending.as_str(), ""));
        instructions.push((op.to_uppercase(), args.trim().to_string()));
        pending.clear();
    }
    let all =
        |op: &str| -> Vec<String> { instructions.iter().filter(|(o, _)| o == op).map(|(_, a)| a.clone()).collect() };

    let froms = all("FROM");
    assert!(froms.len() >= 2, "multi-stage: {froms:?}");
    assert!(froms[0].to_lowercase().contains(" as build"), "{froms:?}");
    let rust_version = read("Cargo.toml")
        .lines()
        .find_map(|l| l.strip_prefix("rust-version = ").map(|v| v.trim_matches('"').to_string()))
        .expect("workspace rust-version");
    assert!(froms[0].starts_with(&format!("rust:{rust_version}")), "the build stage uses the MSRV: {froms:?}");
    assert!(all("COPY").iter().any(|c| c.starts_with("--from=build ")), "the binary comes from the build stage");

    let user = all("USER");
    let user = user.last().expect("a USER");
    let uid = user.split(':').next().unwrap();
    assert!(uid != "root" && uid != "0", "runs as {user}");

    let (config, _) = deploy_config();
    let copied = all("COPY");
    assert!(
        copied.iter().any(|c| c == "deploy/iggy-ingest.toml /etc/iggy-ingest/iggy-ingest.toml"),
        "the image carries the production config: {copied:?}"
    );
    let cmd = all("CMD");
    assert_eq!(cmd, [r#"["run", "--config", "/etc/iggy-ingest/iggy-ingest.toml"]"#]);
    assert_eq!(all("VOLUME"), [format!("[\"{}\"]", config.storage.data_dir)], "the log lives on the volume");

    // The exposed ports are the configured ones, and those of the built-in default.
    let port = |addr: &str| addr.rsplit(':').next().unwrap().to_string();
    let builtin = iggy_ingest::config::Config::builtin();
    let mut exposed: Vec<String> = all("EXPOSE").iter().flat_map(|e| e.split_whitespace().map(String::from)).collect();
    exposed.sort();
    let mut configured = vec![port(&config.http.listen), port(&config.admin.listen)];
    configured.sort();
    let mut default = vec![port(&builtin.http.listen), port(&builtin.admin.listen)];
    default.sort();
    assert_eq!(exposed, configured);
    assert_eq!(exposed, default);
    // Inside a container only a wildcard address is reachable through a published port.
    assert!(config.http.listen.starts_with("0.0.0.0:") && config.admin.listen.starts_with("0.0.0.0:"));

    let health = all("HEALTHCHECK");
    assert_eq!(health.len(), 1);
    assert!(
        health[0].contains(&format!("http://127.0.0.1:{}/health", port(&config.admin.listen))),
        "the health check probes the admin /health: {health:?}"
    );
    assert!(Path::new(&repo()).join("deploy/Dockerfile.dockerignore").is_file(), "keep target/ out of the context");
}
