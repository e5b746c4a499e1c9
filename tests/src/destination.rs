//! Where the daemon delivers in an end-to-end scenario, and how an outage is made: the
//! test broker (stopped and restarted), or a real Iggy server (`IGGY_TEST_ADDR`) made
//! unreachable through a TCP proxy, or stopped and started by commands the operator of
//! the run supplies (`IGGY_TEST_STOP_CMD`, `IGGY_TEST_START_CMD`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use test_broker::{TestBroker, TestBrokerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::load::{Delivered, TOPICS};

pub enum Destination {
    Broker(TestBroker),
    Live { server: String, outage: LiveOutage },
}

pub enum LiveOutage {
    Proxy(Proxy),
    Commands { stop: String, start: String },
}

impl Destination {
    /// A fresh test broker.
    pub async fn broker() -> Destination {
        Destination::Broker(TestBroker::start(TestBrokerConfig::default()).await.expect("start the test broker"))
    }

    /// The real server at `IGGY_TEST_ADDR`, if set.
    pub async fn live() -> Option<Destination> {
        let server = std::env::var("IGGY_TEST_ADDR").ok().filter(|a| !a.is_empty())?;
        let command = |v: &str| std::env::var(v).ok().filter(|c| !c.is_empty());
        let outage = match (command("IGGY_TEST_STOP_CMD"), command("IGGY_TEST_START_CMD")) {
            (Some(stop), Some(start)) => LiveOutage::Commands { stop, start },
            _ => LiveOutage::Proxy(Proxy::start(&server).await),
        };
        Some(Destination::Live { server, outage })
    }

    /// The test broker, to set its faults.
    pub fn test_broker(&self) -> Option<&TestBroker> {
        match self {
            Destination::Broker(b) => Some(b),
            Destination::Live { .. } => None,
        }
    }

    /// What the daemon's `[iggy] address` should be.
    pub fn daemon_address(&self) -> String {
        match self {
            Destination::Broker(b) => b.addr().to_string(),
            Destination::Live { outage: LiveOutage::Proxy(p), .. } => p.addr().to_string(),
            Destination::Live { server, .. } => server.clone(),
        }
    }

    pub fn describe(&self) -> &'static str {
        match self {
            Destination::Broker(_) => "test broker (stopped and restarted)",
            Destination::Live { outage: LiveOutage::Proxy(_), .. } => "Iggy server (cut off through a proxy)",
            Destination::Live { .. } => "Iggy server (stopped and started)",
        }
    }

    /// The destination becomes unreachable.
    pub async fn outage_begin(&self) {
        match self {
            Destination::Broker(b) => b.stop().await,
            Destination::Live { outage: LiveOutage::Proxy(p), .. } => p.cut().await,
            Destination::Live { outage: LiveOutage::Commands { stop, .. }, .. } => run_command(stop),
        }
    }

    /// The destination is reachable again.
    pub async fn outage_end(&self) {
        match self {
            Destination::Broker(b) => b.restart().await.expect("restart the test broker"),
            Destination::Live { outage: LiveOutage::Proxy(p), .. } => p.restore().await,
            Destination::Live { outage: LiveOutage::Commands { start, .. }, .. } => run_command(start),
        }
    }

    /// Every message of `stream`'s topics, each topic in arrival order. Empty while a
    /// live server cannot be read.
    pub async fn delivered(&self, stream: &str) -> Vec<Delivered> {
        let mut out = Vec::new();
        match self {
            Destination::Broker(b) => {
                for t in TOPICS {
                    out.extend(b.messages(stream, t).into_iter().map(|m| Delivered {
                        topic: t.to_string(),
                        id: m.id,
                        payload: m.payload,
                    }));
                }
            }
            Destination::Live { server, .. } => {
                let Ok(Some(c)) = tokio::time::timeout(Duration::from_secs(20), crate::try_client(server)).await else {
                    return out;
                };
                for t in TOPICS {
                    out.extend(crate::read_back(&c, stream, t).await.into_iter().map(|m| Delivered {
                        topic: t.to_string(),
                        id: m.id,
                        payload: m.payload,
                    }));
                }
            }
        }
        out
    }
}

fn run_command(cmd: &str) {
    let status = std::process::Command::new("sh").arg("-c").arg(cmd).status().expect("run the outage command");
    assert!(status.success(), "`{cmd}` failed: {status}");
}

/// A TCP forwarder: the daemon connects here, and the test cuts and restores the path.
pub struct Proxy {
    addr: SocketAddr,
    target: String,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    pub async fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let p = Proxy { addr, target: target.to_string(), tasks: Arc::default() };
        p.serve(listener);
        p
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn serve(&self, listener: TcpListener) {
        let (target, tasks) = (self.target.clone(), self.tasks.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                let pipe = tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                tasks.lock().unwrap_or_else(|p| p.into_inner()).push(pipe);
            }
        });
        self.tasks.lock().unwrap_or_else(|p| p.into_inner()).push(accept);
    }

    /// Stops listening and closes every forwarded connection.
    pub async fn cut(&self) {
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        for t in tasks {
            t.abort();
            let _ = t.await;
        }
    }

    /// Listens again on the same address.
    pub async fn restore(&self) {
        let listener = TcpListener::bind(self.addr).await.expect("rebind the proxy");
        self.serve(listener);
    }
}
