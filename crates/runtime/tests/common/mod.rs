//! Test support: start the built `iggy-ingest` binary on ephemeral ports in a temp
//! directory, talk HTTP/1.1 to it, and read its log back through the wal crate.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use ingest::Envelope;

mod skip;
#[allow(unused_imports)] // not every test file skips
pub use skip::skip_or_fail;

pub const MANAGEMENT_TOKEN: &str = "test-management-token-0123";

/// Generous: the machine running the tests may be busy compiling.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

pub struct Daemon {
    pub child: Child,
    pub http: SocketAddr,
    pub admin: SocketAddr,
    pub root: PathBuf,
}

/// The configuration the tests run on: ephemeral ports, data under `root/data`, plus
/// `http_extra` lines in `[http]` and `rest` (sources, `[wal]`, ...).
pub fn config_text(root: &Path, http_extra: &str, rest: &str) -> String {
    config_text_with_shutdown(root, http_extra, "", rest)
}

/// [`config_text`] with extra lines in `[shutdown]`.
pub fn config_text_with_shutdown(root: &Path, http_extra: &str, shutdown_extra: &str, rest: &str) -> String {
    format!(
        r#"
[http]
listen = "127.0.0.1:0"
{http_extra}

[admin]
listen = "127.0.0.1:0"
management_token = "{MANAGEMENT_TOKEN}"

[shutdown]
grace_period_ms = 20000
{shutdown_extra}

[logging]
level = "error"

[storage]
data_dir = "{data}"

[idempotency]
checkpoint_interval_ms = 200

{rest}
"#,
        data = root.join("data").display()
    )
}

impl Daemon {
    /// Writes the config and starts the daemon; waits for its ready file.
    pub fn start(root: &Path, http_extra: &str, rest: &str) -> Daemon {
        Daemon::start_text(root, &config_text(root, http_extra, rest))
    }

    pub fn start_text(root: &Path, text: &str) -> Daemon {
        let cfg = root.join("config.toml");
        std::fs::write(&cfg, text).unwrap();
        Daemon::start_with(root, &cfg)
    }

    /// Starts again on the config written before.
    pub fn restart(root: &Path) -> Daemon {
        Daemon::start_with(root, &root.join("config.toml"))
    }

    fn start_with(root: &Path, cfg: &Path) -> Daemon {
        Daemon::spawn(root, cfg).ready()
    }

    /// Starts the daemon on `cfg` without waiting for it to be ready (its addresses are
    /// unknown until [`Daemon::ready`]); it writes `root/ready.json` once it is.
    pub fn spawn(root: &Path, cfg: &Path) -> Daemon {
        Daemon::spawn_logging_to(root, cfg, Stdio::inherit())
    }

    /// [`Daemon::spawn`] with the daemon's log (its stderr) sent to `log`.
    pub fn spawn_logging_to(root: &Path, cfg: &Path, log: impl Into<Stdio>) -> Daemon {
        let ready = root.join("ready.json");
        let _ = std::fs::remove_file(&ready);
        let child = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
            .arg("run")
            .arg("--config")
            .arg(cfg)
            .arg("--ready-file")
            .arg(&ready)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        Daemon { child, http: "127.0.0.1:1".parse().unwrap(), admin: "127.0.0.1:1".parse().unwrap(), root: root.into() }
    }

    /// Waits for the ready file and reads the addresses from it.
    pub fn ready(mut self) -> Daemon {
        let ready = self.root.join("ready.json");
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                let v: serde_json::Value = serde_json::from_str(&text).unwrap();
                self.http = v["http"].as_str().unwrap().parse().unwrap();
                self.admin = v["admin"].as_str().unwrap().parse().unwrap();
                return self;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("daemon exited before it was ready: {status}");
            }
            assert!(Instant::now() < deadline, "daemon not ready within {STARTUP_TIMEOUT:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) with the pid of our own child process.
        let rc = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(rc, 0, "kill({sig}) failed");
    }

    pub fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        self.child.wait().unwrap();
    }

    /// Sends SIGTERM and waits for the exit.
    pub fn stop(mut self) -> ExitStatus {
        self.signal(libc::SIGTERM);
        self.wait_exit(Duration::from_secs(60))
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            assert!(Instant::now() < deadline, "daemon did not exit within {timeout:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn wal_dir(&self) -> PathBuf {
        self.root.join("data").join("wal")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A self-signed certificate for `localhost` and its key.
pub struct TlsPair {
    pub cert_pem: String,
    pub key_pem: String,
    pub cert_der: rustls::pki_types::CertificateDer<'static>,
}

impl TlsPair {
    pub fn new() -> TlsPair {
        let made = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        TlsPair {
            cert_pem: made.cert.pem(),
            key_pem: made.signing_key.serialize_pem(),
            cert_der: made.cert.der().clone(),
        }
    }

    /// A pair whose certificate is valid until the start of `year`.
    pub fn until(year: i32) -> TlsPair {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params.not_after = rcgen::date_time_ymd(year, 1, 1);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        TlsPair { cert_pem: cert.pem(), key_pem: key.serialize_pem(), cert_der: cert.der().clone() }
    }

    /// Writes the pair as `cert.pem` and `key.pem` in `dir`: the two paths.
    pub fn write(&self, dir: &Path) -> (PathBuf, PathBuf) {
        std::fs::create_dir_all(dir).unwrap();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&cert, &self.cert_pem).unwrap();
        std::fs::write(&key, &self.key_pem).unwrap();
        (cert, key)
    }
}

/// One answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// A keep-alive HTTP/1.1 connection.
pub struct Conn {
    sender: SendRequest<Full<Bytes>>,
}

impl Conn {
    pub async fn open(addr: SocketAddr) -> std::io::Result<Conn> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        Conn::over(stream).await
    }

    /// A connection over TLS to `addr` as `localhost`, trusting `trusted` alone; with
    /// the leaf certificate the listener showed.
    pub async fn open_tls(
        addr: SocketAddr,
        trusted: &[&TlsPair],
    ) -> std::io::Result<(Conn, rustls::pki_types::CertificateDer<'static>)> {
        let mut roots = rustls::RootCertStore::empty();
        for p in trusted {
            roots.add(p.cert_der.clone()).map_err(std::io::Error::other)?;
        }
        let config =
            rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(std::io::Error::other)?
                .with_root_certificates(roots)
                .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = rustls::pki_types::ServerName::try_from("localhost").map_err(std::io::Error::other)?;
        let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)).connect(name, tcp).await?;
        let leaf = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first().cloned())
            .ok_or_else(|| std::io::Error::other("the listener showed no certificate"))?;
        Ok((Conn::over(tls).await?, leaf))
    }

    async fn over<IO>(io: IO) -> std::io::Result<Conn>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(io)).await.map_err(std::io::Error::other)?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Conn { sender })
    }

    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<Answer, hyper::Error> {
        let mut req = hyper::Request::builder().method(method).uri(path).header("host", "localhost");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body.into())).unwrap();
        self.sender.ready().await?;
        let resp = self.sender.send_request(req).await?;
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok(Answer { status, headers, body })
    }
}

/// One request on a fresh connection.
pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Answer {
    let mut c = Conn::open(addr).await.unwrap();
    c.send(method, path, headers, body).await.unwrap()
}

pub async fn post_json(addr: SocketAddr, path: &str, body: &str) -> Answer {
    request(addr, "POST", path, &[("content-type", "application/json")], body.to_string()).await
}

/// The log's next offset, as the admin API's `/status` reports it.
pub async fn log_next_offset(admin: SocketAddr) -> u64 {
    let status = request(admin, "GET", "/status", &[], "").await.json();
    status["log"]["next_offset"].as_u64().unwrap_or_else(|| panic!("no log.next_offset in {status}"))
}

/// Every record of the log in `wal_dir`, decoded.
pub fn read_log(wal_dir: &Path) -> Vec<(u64, Envelope)> {
    let wal = wal::Wal::open_read_only(wal_dir).unwrap();
    wal::inspect::Records::new(&wal, wal.start_offset())
        .unwrap()
        .map(|r| {
            let r = r.unwrap();
            (r.offset, Envelope::decode(&r.payload).unwrap())
        })
        .collect()
}

pub fn log_len(wal_dir: &Path) -> usize {
    read_log(wal_dir).len()
}

/// Seconds since the epoch, for signed-webhook timestamps.
pub fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs()
}

/// HMAC-SHA256 of `msg`, base64 (Standard Webhooks).
pub fn hmac_b64(key: &[u8], msg: &[u8]) -> String {
    use base64::Engine;
    use hmac::Mac;
    let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).unwrap();
    m.update(msg);
    base64::engine::general_purpose::STANDARD.encode(m.finalize().into_bytes())
}

/// HMAC-SHA256 of `msg`, lower-case hex (GitHub, Stripe).
pub fn hmac_hex(key: &[u8], msg: &[u8]) -> String {
    use hmac::Mac;
    let mut m = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).unwrap();
    m.update(msg);
    hex::encode(m.finalize().into_bytes())
}

/// Every entry of a paged admin listing, walked from `path` (whose query names a
/// `limit` of at most `limit`) by following `next_after`, each entry named by `name`.
/// Checks every page: 200, at most `limit` entries under `list`, and a `next_after` that
/// names the page's last entry while more follow.
pub async fn walk_pages(
    admin: SocketAddr,
    headers: &[(&str, &str)],
    path: &str,
    limit: usize,
    list: &str,
    name: impl Fn(&serde_json::Value) -> String,
) -> Vec<String> {
    let mut walked = Vec::new();
    let mut next = path.to_string();
    loop {
        let page = request(admin, "GET", &next, headers, "").await;
        assert_eq!(page.status, 200, "{next}: {:?}", page.body);
        let page = page.json();
        let got: Vec<String> = page[list].as_array().unwrap().iter().map(&name).collect();
        assert!(got.len() <= limit, "{page}");
        walked.extend(got.clone());
        match page["next_after"].as_str() {
            Some(after) => {
                assert_eq!(Some(after), got.last().map(String::as_str), "next_after names the page's last entry");
                let base = path.split('?').next().unwrap_or(path);
                next = format!("{base}?after={after}&limit={limit}");
            }
            None => return walked,
        }
    }
}

/// `iggy-ingest run --config CFG` that is to refuse to start: its exit code and stderr.
/// One still running after 30 s is killed and the test fails: it started where it had
/// to refuse (waited for with `output`, the test would hang instead).
pub fn refused_start(cfg: &std::path::Path) -> (Option<i32>, String) {
    ends_with(&["run".as_ref(), "--config".as_ref(), cfg.as_os_str()], "the daemon started where it had to refuse")
}

/// Runs the program with `args` (standard input closed), failing the test with
/// `otherwise` if it has not ended within 30 s: its exit code and standard error.
pub fn ends_with(args: &[&std::ffi::OsStr], otherwise: &str) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_iggy-ingest"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{otherwise}: {args:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}
