//! The daemon as a process: start it on ephemeral ports in a directory, kill it, restart
//! it on the same directory, and talk HTTP/1.1 to its listeners.

use std::net::SocketAddr;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;

/// Generous: the machine running the tests may be busy compiling.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(90);

/// The daemon binary of this package (the runtime with the fail points compiled in):
/// beside the directory of the running test binary, where cargo puts a package's binaries.
pub fn daemon_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("CARGO_BIN_EXE_e2e-daemon") {
        return p.into();
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe.parent().and_then(Path::parent).expect("target directory");
    dir.join("e2e-daemon")
}

/// A configuration: ephemeral ports, data under `root/data`, Iggy at `iggy`, and `rest`
/// (`[router]`, `[wal]`, sources).
pub fn config_text(root: &Path, iggy: &str, rest: &str) -> String {
    format!(
        r#"
[http]
listen = "127.0.0.1:0"

[admin]
listen = "127.0.0.1:0"

[shutdown]
grace_period_ms = 20000

[logging]
level = "error"

[storage]
data_dir = "{data}"

[idempotency]
checkpoint_interval_ms = 200

[iggy]
address = "{iggy}"
reconnection_interval_ms = 100

{rest}
"#,
        data = root.join("data").display()
    )
}

/// A running (or dead) daemon process.
pub struct Daemon {
    pub child: Child,
    pub http: SocketAddr,
    pub admin: SocketAddr,
    pub root: PathBuf,
    /// Where this process's stderr goes.
    pub stderr_path: PathBuf,
}

impl Daemon {
    /// Writes `config` to `root/config.toml` and starts the daemon on it.
    pub async fn start(root: &Path, config: &str, env: &[(&str, String)]) -> Daemon {
        std::fs::write(root.join("config.toml"), config).expect("write config");
        Daemon::restart(root, env).await
    }

    /// Starts the daemon on the configuration written before; waits for its ready file.
    pub async fn restart(root: &Path, env: &[(&str, String)]) -> Daemon {
        let ready = root.join("ready.json");
        let _ = std::fs::remove_file(&ready);
        let n = (0..).find(|n| !root.join(format!("daemon-{n}.stderr")).exists()).unwrap_or(0);
        let stderr_path = root.join(format!("daemon-{n}.stderr"));
        let stderr = std::fs::File::create(&stderr_path).expect("stderr file");
        let mut cmd = Command::new(daemon_bin());
        cmd.arg("--config").arg(root.join("config.toml")).arg("--ready-file").arg(&ready);
        cmd.env_remove("IGGY_INGEST_FAIL_POINT")
            .env_remove("IGGY_INGEST_FAIL_POINT_HIT")
            .env_remove("IGGY_INGEST_FAIL_POINT_ACTION");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(stderr).spawn().expect("spawn daemon");
        let unbound: SocketAddr = ([127, 0, 0, 1], 1).into();
        let mut d = Daemon { child, http: unbound, admin: unbound, root: root.into(), stderr_path };
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Ok(text) = std::fs::read_to_string(&ready) {
                let v: serde_json::Value = serde_json::from_str(&text).expect("ready file is JSON");
                d.http = v["http"].as_str().and_then(|a| a.parse().ok()).expect("http address");
                d.admin = v["admin"].as_str().and_then(|a| a.parse().ok()).expect("admin address");
                return d;
            }
            if let Some(status) = d.child.try_wait().expect("try_wait") {
                panic!("daemon exited before it was ready ({status}): {}", d.stderr());
            }
            assert!(Instant::now() < deadline, "daemon not ready within {STARTUP_TIMEOUT:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// SIGKILL, and reap it.
    pub fn kill9(&mut self) {
        // SAFETY: kill(2) with the pid of our own child process.
        let rc = unsafe { libc::kill(self.child.id() as i32, libc::SIGKILL) };
        assert_eq!(rc, 0, "kill -9 failed");
        self.child.wait().expect("wait");
    }

    /// SIGTERM, and wait for the exit.
    pub async fn stop(mut self) -> ExitStatus {
        // SAFETY: kill(2) with the pid of our own child process.
        let rc = unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        assert_eq!(rc, 0, "kill -TERM failed");
        self.wait_exit(Duration::from_secs(60)).await.expect("daemon did not stop within 60 s")
    }

    /// Waits for the process to end by itself, up to `limit`.
    pub async fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait().expect("try_wait") {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// What the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
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

/// A directory for one test's daemon. With `E2E_KEEP_DIRS` set it is kept after the
/// test (its path printed), with the daemon's stderr of every start and its data.
pub fn test_dir(what: &str) -> tempfile::TempDir {
    let mut dir = tempfile::Builder::new().prefix(&format!("e2e-{what}-")).tempdir().expect("temp dir");
    if std::env::var_os("E2E_KEEP_DIRS").is_some() {
        dir.disable_cleanup(true);
        eprintln!("{what}: keeping {}", dir.path().display());
    }
    dir
}

/// Killed by SIGKILL (by a test or by a fail point).
pub fn killed_by_sigkill(s: &ExitStatus) -> bool {
    s.signal() == Some(libc::SIGKILL)
}

/// One HTTP answer.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", String::from_utf8_lossy(&self.body)))
    }
}

/// A keep-alive HTTP/1.1 connection.
pub struct Conn {
    sender: SendRequest<Full<Bytes>>,
}

impl Conn {
    pub async fn open(addr: SocketAddr) -> std::io::Result<Conn> {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        let (sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(std::io::Error::other)?;
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
        let req = req.body(Full::new(body.into())).expect("request");
        self.sender.ready().await?;
        let resp = self.sender.send_request(req).await?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok(Answer { status, body })
    }
}

/// `GET path` on a fresh connection; `None` when the daemon does not answer.
pub async fn get(addr: SocketAddr, path: &str) -> Option<Answer> {
    let fut = async {
        let mut c = Conn::open(addr).await.ok()?;
        c.send("GET", path, &[], Bytes::new()).await.ok()
    };
    tokio::time::timeout(Duration::from_secs(10), fut).await.ok().flatten()
}

/// The delivery status of a source (`running`, `degraded`, ...), from `/connectors/{key}`.
pub async fn delivery_status(admin: SocketAddr, source: &str) -> Option<String> {
    let a = get(admin, &format!("/connectors/{source}")).await?;
    let j: serde_json::Value = serde_json::from_slice(&a.body).ok()?;
    j["delivery"]["status"].as_str().map(str::to_string)
}

/// The value of an unlabelled metric from `/metrics`.
pub async fn metric(admin: SocketAddr, name: &str) -> Option<f64> {
    let a = get(admin, "/metrics").await?;
    let text = String::from_utf8_lossy(&a.body).into_owned();
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')).and_then(|v| v.trim().parse().ok()))
}
