//! TLS on the listeners, against the real binary: webhooks answered 200 over TLS are in
//! the log; plain HTTP sent to a TLS listener is not served and appends nothing; SIGHUP
//! reloads the certificates for new connections while open ones go on; a reload that
//! fails keeps the certificate served before and says so in `/status` and `/metrics`;
//! `config check` names the key of a file that does not load; a reload that loads an
//! expired certificate warns of it.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

/// One source, no delivery (nothing here is about Iggy), and both listeners on TLS.
fn tls_config(webhook: (&Path, &Path), admin: (&Path, &Path)) -> (String, String) {
    let http_extra = format!("[http.tls]\ncert_file = {:?}\nkey_file = {:?}\n", webhook.0, webhook.1);
    let rest = format!(
        "[admin.tls]\ncert_file = {:?}\nkey_file = {:?}\n\n[router]\nenabled = false\n\n\
         [sources.hooks]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n",
        admin.0, admin.1
    );
    (http_extra, rest)
}

async fn post_over(conn: &mut Conn, n: u32) -> u16 {
    let body = format!("{{\"n\":{n}}}");
    conn.send("POST", "/v1/sources/hooks", &[("content-type", "application/json")], body).await.unwrap().status
}

/// `GET path` on the admin listener over TLS.
async fn admin_get(daemon: &Daemon, admin: &TlsPair, path: &str) -> Answer {
    let (mut conn, _) = Conn::open_tls(daemon.admin, &[admin]).await.unwrap();
    conn.send("GET", path, &[], "").await.unwrap()
}

/// Waits until `/status` says what `done` looks for in the webhook listener's TLS.
async fn wait_for_tls_status(daemon: &Daemon, admin: &TlsPair, what: &str, done: impl Fn(&serde_json::Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let status = admin_get(daemon, admin, "/status").await.json();
        if done(&status["tls"]["webhook"]) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A certificate a reload loads is held to the expiry rule the start applies: one past
/// its end is served (a renewal may be on its way) and warned of in the log, naming the
/// listener; the start, on a certificate far from its end, warned of nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_loads_an_expired_certificate_warns_of_it() {
    let dir = tempfile::tempdir().unwrap();
    let (fresh, admin) = (TlsPair::new(), TlsPair::new());
    let webhook_files = fresh.write(&dir.path().join("webhook-tls"));
    let admin_files = admin.write(&dir.path().join("admin-tls"));
    let (http_extra, rest) = tls_config((&webhook_files.0, &webhook_files.1), (&admin_files.0, &admin_files.1));
    let cfg = dir.path().join("config.toml");
    let text = config_text(dir.path(), &http_extra, &rest).replace("level = \"error\"", "level = \"warn\"");
    std::fs::write(&cfg, text).unwrap();
    let log = dir.path().join("daemon.log");
    let daemon = Daemon::spawn_logging_to(dir.path(), &cfg, std::fs::File::create(&log).unwrap()).ready();
    let loaded_at =
        admin_get(&daemon, &admin, "/status").await.json()["tls"]["webhook"]["loaded_at_unix_ms"].as_u64().unwrap();
    let warned =
        || std::fs::read_to_string(&log).unwrap().lines().find(|l| l.contains("expired at")).map(str::to_string);
    assert_eq!(warned(), None, "a certificate far from its end was warned of");

    tokio::time::sleep(Duration::from_millis(5)).await;
    let expired = TlsPair::until(2020);
    expired.write(&dir.path().join("webhook-tls"));
    daemon.signal(libc::SIGHUP);
    wait_for_tls_status(&daemon, &admin, "the reload", |t| t["loaded_at_unix_ms"].as_u64() > Some(loaded_at)).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let line = loop {
        if let Some(line) = warned() {
            break line;
        }
        assert!(
            Instant::now() < deadline,
            "no warning of the expired certificate:\n{}",
            std::fs::read_to_string(&log).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(line.contains("WARN") && line.contains("webhook"), "{line}");
    assert!(line.contains("the certificate expired at 2020-01-01T00:00:00Z"), "{line}");
    let status = admin_get(&daemon, &admin, "/status").await.json();
    assert_eq!(status["tls"]["webhook"]["expires_at_unix_secs"], 1_577_836_800, "{status}");
    assert!(daemon.stop().success());
}

/// A reload whose file does not answer (here: the webhook certificate replaced by a FIFO
/// no one writes to) holds neither the other listener's reload nor a later SIGHUP's: the
/// admin listener serves its new pair at once, the webhook listener's status says its
/// reload failed once the read has not returned within 5 s, and a SIGHUP meanwhile says
/// the earlier read is still going. When the read returns, what it read is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_whose_file_does_not_answer_holds_no_other_and_says_it_failed() {
    let dir = tempfile::tempdir().unwrap();
    let (webhook, admin, admin_next) = (TlsPair::new(), TlsPair::new(), TlsPair::new());
    let webhook_files = webhook.write(&dir.path().join("webhook-tls"));
    let admin_files = admin.write(&dir.path().join("admin-tls"));
    let (http_extra, rest) = tls_config((&webhook_files.0, &webhook_files.1), (&admin_files.0, &admin_files.1));
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, config_text(dir.path(), &http_extra, &rest)).unwrap();
    let daemon = Daemon::spawn(dir.path(), &cfg).ready();
    let tls_status = async || {
        let (mut conn, _) = Conn::open_tls(daemon.admin, &[&admin, &admin_next]).await.unwrap();
        conn.send("GET", "/status", &[], "").await.unwrap().json()["tls"].clone()
    };
    let before = tls_status().await;
    let loaded_at = |t: &serde_json::Value, listener: &str| t[listener]["loaded_at_unix_ms"].as_u64().unwrap();
    let failure = |t: &serde_json::Value| t["webhook"]["reload_failed"]["error"].as_str().map(str::to_string);

    std::fs::remove_file(&webhook_files.0).unwrap();
    let path = std::ffi::CString::new(webhook_files.0.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) with a valid C string.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    admin_next.write(&dir.path().join("admin-tls"));
    tokio::time::sleep(Duration::from_millis(5)).await;
    let hangup = Instant::now();
    daemon.signal(libc::SIGHUP);

    // The admin listener's reload is its own: done well before the webhook's read gives up.
    loop {
        let t = tls_status().await;
        if loaded_at(&t, "admin") > loaded_at(&before, "admin") {
            assert!(hangup.elapsed() < Duration::from_secs(4), "the admin reload waited {:?}", hangup.elapsed());
            assert_eq!(failure(&t), None, "said failed before its time: {t}");
            break;
        }
        assert!(hangup.elapsed() < Duration::from_secs(4), "the admin listener's pair was not reloaded: {t}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, served) = Conn::open_tls(daemon.admin, &[&admin_next]).await.unwrap();
    assert_eq!(served, admin_next.cert_der, "the admin listener serves the new certificate");

    // The webhook's read has not returned: a failed reload, in the status and the metrics.
    let deadline = Instant::now() + Duration::from_secs(20);
    let said = loop {
        let t = tls_status().await;
        if let Some(e) = failure(&t) {
            break e;
        }
        assert!(Instant::now() < deadline, "the stuck reload was never said to have failed: {t}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(said.contains("did not return within 5 s"), "{said}");
    assert!(hangup.elapsed() >= Duration::from_secs(5), "said failed after {:?}", hangup.elapsed());
    let (mut conn, _) = Conn::open_tls(daemon.admin, &[&admin_next]).await.unwrap();
    let metrics = String::from_utf8_lossy(&conn.send("GET", "/metrics", &[], "").await.unwrap().body).to_string();
    assert!(metrics.contains("iggy_ingest_tls_reload_failed{listener=\"webhook\"} 1"), "{metrics}");

    // A SIGHUP while the read still hangs starts no second one, and says why.
    daemon.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let t = tls_status().await;
        if failure(&t).is_some_and(|e| e.contains("still reading the files")) {
            break;
        }
        assert!(Instant::now() < deadline, "a SIGHUP during the stuck read did not say so: {t}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The file answers at last (with the certificate the key belongs to): served.
    let before_answer = tls_status().await;
    std::fs::write(&webhook_files.0, &webhook.cert_pem).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let t = tls_status().await;
        if loaded_at(&t, "webhook") > loaded_at(&before_answer, "webhook") {
            assert_eq!(failure(&t), None, "{t}");
            break;
        }
        assert!(Instant::now() < deadline, "what the read returned was not applied: {t}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(daemon.stop().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_over_tls_are_logged_and_a_sighup_serves_the_new_certificate_or_keeps_the_old_one() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b, admin) = (TlsPair::new(), TlsPair::new(), TlsPair::new());
    let webhook_files = a.write(&dir.path().join("webhook-tls"));
    let admin_files = admin.write(&dir.path().join("admin-tls"));
    let (http_extra, rest) = tls_config((&webhook_files.0, &webhook_files.1), (&admin_files.0, &admin_files.1));
    let daemon = Daemon::start(dir.path(), &http_extra, &rest);

    // Over TLS: served, with the configured certificate.
    let (mut first, leaf) = Conn::open_tls(daemon.http, &[&a, &b]).await.unwrap();
    assert_eq!(leaf, a.cert_der);
    assert_eq!(post_over(&mut first, 1).await, 200);

    // Plain HTTP to the TLS listener: no answer at all, nothing appended.
    let mut plain = Conn::open(daemon.http).await.unwrap();
    let answered = plain.send("POST", "/v1/sources/hooks", &[("content-type", "application/json")], "{\"n\":0}").await;
    assert!(answered.is_err(), "plain HTTP was answered on the TLS listener: {answered:?}");

    // The admin listener is on TLS too, and says what the webhook listener serves.
    let status = admin_get(&daemon, &admin, "/status").await.json();
    assert_eq!(status["log"]["next_offset"], 1, "{status}");
    let webhook = &status["tls"]["webhook"];
    assert_eq!(webhook["cert_file"], webhook_files.0.display().to_string(), "{status}");
    assert!(webhook["reload_failed"].is_null() && status["tls"]["admin"].is_object(), "{status}");
    let loaded_at = webhook["loaded_at_unix_ms"].as_u64().unwrap();

    // A rotation: new files, then SIGHUP. New connections get the new certificate; the
    // one opened before goes on.
    tokio::time::sleep(Duration::from_millis(5)).await;
    b.write(&dir.path().join("webhook-tls"));
    daemon.signal(libc::SIGHUP);
    wait_for_tls_status(&daemon, &admin, "the reload", |t| t["loaded_at_unix_ms"].as_u64() > Some(loaded_at)).await;
    let (mut second, leaf) = Conn::open_tls(daemon.http, &[&a, &b]).await.unwrap();
    assert_eq!(leaf, b.cert_der, "a connection after the reload was shown the old certificate");
    assert_eq!(post_over(&mut second, 2).await, 200);
    assert_eq!(post_over(&mut first, 3).await, 200, "the connection opened before the reload was cut");
    assert!(Conn::open_tls(daemon.http, &[&a]).await.is_err(), "the old certificate is still served");

    // Half a rotation (a's certificate beside b's key): the reload fails, b stays served,
    // and the status and the metrics say the files are not what is served.
    std::fs::write(&webhook_files.0, &a.cert_pem).unwrap();
    daemon.signal(libc::SIGHUP);
    wait_for_tls_status(&daemon, &admin, "the failed reload", |t| !t["reload_failed"].is_null()).await;
    let status = admin_get(&daemon, &admin, "/status").await.json();
    let error = status["tls"]["webhook"]["reload_failed"]["error"].as_str().unwrap().to_string();
    assert!(error.starts_with("key_file: ") && error.contains("is not the private key"), "{error}");
    let metrics = String::from_utf8_lossy(&admin_get(&daemon, &admin, "/metrics").await.body).into_owned();
    for line in [
        "iggy_ingest_tls_reload_failed{listener=\"webhook\"} 1",
        "iggy_ingest_tls_reload_failed{listener=\"admin\"} 0",
        "iggy_ingest_tls_reloads_total{listener=\"webhook\",outcome=\"failed\"} 1",
        "iggy_ingest_tls_reloads_total{listener=\"webhook\",outcome=\"loaded\"} 1",
        "iggy_ingest_tls_handshake_failures_total{listener=\"webhook\",reason=\"refused\"}",
        "iggy_ingest_tls_certificate_expiry_timestamp_seconds{listener=\"webhook\"} ",
    ] {
        assert!(metrics.contains(line), "no {line:?} in /metrics:\n{metrics}");
    }
    let (mut third, leaf) = Conn::open_tls(daemon.http, &[&a, &b]).await.unwrap();
    assert_eq!(leaf, b.cert_der, "a failed reload changed the certificate served");
    assert_eq!(post_over(&mut third, 4).await, 200);

    // `wal inspect --admin` reads the running daemon over TLS, trusting the admin
    // listener's certificate; an https:// URL without a certificate to trust is refused
    // before any connection.
    let (wal_dir, admin_url, admin_ca) =
        (daemon.wal_dir(), format!("https://localhost:{}", daemon.admin.port()), admin_files.0.clone());
    let (inspected, untrusting) = tokio::task::spawn_blocking(move || {
        let inspect = |extra: &[&std::ffi::OsStr]| {
            Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
                .args(["wal", "inspect"])
                .arg(&wal_dir)
                .args(["--json", "--admin", &admin_url])
                .args(extra)
                .output()
                .unwrap()
        };
        (inspect(&["--admin-ca".as_ref(), admin_ca.as_os_str()]), inspect(&[]))
    })
    .await
    .unwrap();
    assert!(inspected.status.success(), "{}", String::from_utf8_lossy(&inspected.stderr));
    let report: serde_json::Value = serde_json::from_slice(&inspected.stdout).unwrap();
    assert_eq!(report["destinations"]["cursors_from"], "admin", "{report}");
    assert_eq!(untrusting.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&untrusting.stderr).contains("needs --admin-ca"));

    drop((first, second, third, plain));
    let mut daemon = daemon;
    daemon.signal(libc::SIGTERM);
    assert!(daemon.wait_exit(Duration::from_secs(60)).success());
    let logged: Vec<serde_json::Value> =
        read_log(&daemon.wal_dir()).iter().map(|(_, e)| serde_json::from_slice(&e.payload).unwrap()).collect();
    let numbers: Vec<u64> = logged.iter().map(|v| v["n"].as_u64().unwrap()).collect();
    assert_eq!(numbers, vec![1, 2, 3, 4], "the log holds what was answered 200, and nothing else");
}

/// A SIGHUP that comes while `run` still reads its configuration (here: a certificate
/// file that is a FIFO no one writes to yet), before its handler is installed, does not
/// end the process as the signal's default action would: a `systemctl reload` right
/// after a start would stop the daemon, and the unit would not restart it.
#[test]
fn a_sighup_while_the_configuration_is_read_does_not_end_the_process() {
    let dir = tempfile::tempdir().unwrap();
    let (_, key) = TlsPair::new().write(&dir.path().join("a"));
    let fifo = dir.path().join("cert.fifo");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) with a valid C string.
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    let file = dir.path().join("c.toml");
    std::fs::write(
        &file,
        format!("[http]\nlisten = \"127.0.0.1:0\"\n\n[http.tls]\ncert_file = {fifo:?}\nkey_file = {key:?}\n"),
    )
    .unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["run", "--config"])
        .arg(&file)
        .current_dir(dir.path())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Once its SIGHUP is ignored (`SigIgn` in its status), the process is in its start;
    // a fixed sleep could end before a loaded machine got there, and the signal's
    // default action would end it.
    let status = format!("/proc/{}/status", child.id());
    let ignores_sighup = || {
        std::fs::read_to_string(&status).ok().and_then(|s| {
            let mask = s.lines().find_map(|l| l.strip_prefix("SigIgn:"))?.trim().to_string();
            u64::from_str_radix(&mask, 16).ok()
        })
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while ignores_sighup().is_none_or(|mask| mask & (1 << (libc::SIGHUP - 1)) == 0) {
        assert!(std::time::Instant::now() < deadline, "the process never came to ignore SIGHUP");
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: kill(2) of the child's pid.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGHUP) }, 0);
    // A writer that writes nothing: the certificate file holds none. Opened without
    // waiting, again until the process is there to read it (until then the open fails,
    // ENXIO); once the process ended, no later open could succeed.
    use std::os::unix::fs::OpenOptionsExt;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&fifo).is_ok() {
            break;
        }
        if std::time::Instant::now() > deadline || std::fs::metadata(format!("/proc/{}/exe", child.id())).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    // Bounded: a process still reading the FIFO then would hold the test for ever.
    let pid = child.id() as i32;
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if done_rx.recv_timeout(Duration::from_secs(60)).is_err() {
            // SAFETY: kill(2) of the child's pid, not yet reaped (the test waits on it).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let out = child.wait_with_output().unwrap();
    drop(done_tx);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(out.status.signal(), None, "ended by a signal: {:?}", out.status);
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_tls_file_that_does_not_load_is_named_by_its_key_and_line_and_the_daemon_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (TlsPair::new(), TlsPair::new());
    let (cert, _) = a.write(&dir.path().join("a"));
    let (_, other_key) = b.write(&dir.path().join("b"));
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        format!("[http]\nlisten = \"127.0.0.1:0\"\n\n[http.tls]\ncert_file = {cert:?}\nkey_file = {other_key:?}\n"),
    )
    .unwrap();
    let check = Command::new(env!("CARGO_BIN_EXE_iggy-ingest")).args(["config", "check"]).arg(&file).output().unwrap();
    assert_eq!(check.status.code(), Some(2));
    let err = String::from_utf8_lossy(&check.stderr);
    assert!(err.contains("line 6: http.tls.key_file: ") && err.contains("is not the private key"), "{err}");

    std::fs::write(&file, format!("[admin.tls]\ncert_file = {cert:?}\n")).unwrap();
    let check = Command::new(env!("CARGO_BIN_EXE_iggy-ingest")).args(["config", "check"]).arg(&file).output().unwrap();
    assert_eq!(check.status.code(), Some(2));
    let err = String::from_utf8_lossy(&check.stderr);
    assert!(err.contains("admin.tls") && err.contains("key_file"), "{err}");

    // An expired certificate is valid configuration, warned of: clients refuse it, and a
    // renewal may be on its way.
    let (old_cert, old_key) = TlsPair::until(2020).write(&dir.path().join("old"));
    let old = dir.path().join("old.toml");
    std::fs::write(
        &old,
        format!("[http.tls]\ncert_file = {old_cert:?}\nkey_file = {old_key:?}\n\n[sources.a]\ndestination = {{ stream = \"s\", topic = \"t\" }}\n"),
    )
    .unwrap();
    let check = Command::new(env!("CARGO_BIN_EXE_iggy-ingest")).args(["config", "check"]).arg(&old).output().unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    let err = String::from_utf8_lossy(&check.stderr);
    assert!(
        err.contains("warning: line 2: http.tls.cert_file: the certificate expired at 2020-01-01T00:00:00Z"),
        "{err}"
    );

    let run = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(["run", "--config"])
        .arg(&file)
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2), "{}", String::from_utf8_lossy(&run.stderr));
    assert!(!dir.path().join("data").exists(), "a refused start created the data directory");
}
