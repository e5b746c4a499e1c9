//! The listener and the connections: accepting, reading requests in order,
//! applying faults, writing replies.
//!
//! Invariants:
//! - while the broker refuses connections (or is stopped) no socket listens on
//!   its address, so a client's connect is refused by the operating system;
//! - the address never changes: listening again binds the same address;
//! - one connection handles one request at a time, in arrival order, as the
//!   client's lockstep protocol expects;
//! - closing connections waits until their sockets are dropped, so after
//!   `stop()` returns no old connection can answer anything.

use crate::TestBrokerConfig;
use crate::faults::{DropPoint, Faults};
use crate::handler::{self, Action, Connection};
use crate::kind::RequestKind;
use crate::store::Store;
use crate::wire::read_request;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Locks a mutex, ignoring poisoning (a panicking test must not hide the
/// broker's state from the next assertion).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(crate) struct Shared {
    pub config: TestBrokerConfig,
    pub addr: SocketAddr,
    store: Mutex<Store>,
    faults: Mutex<Faults>,
    counters: Mutex<HashMap<RequestKind, u64>>,
    sessions: AtomicU64,
    accepted: AtomicU64,
    listener: Mutex<Option<JoinHandle<()>>>,
    connections: Mutex<Vec<JoinHandle<()>>>,
}

impl Shared {
    /// Binds `addr` and starts accepting.
    pub async fn bind(config: TestBrokerConfig, addr: SocketAddr) -> io::Result<Arc<Self>> {
        let listener = TcpListener::bind(addr).await?;
        let shared = Arc::new(Self {
            config,
            addr: listener.local_addr()?,
            store: Mutex::default(),
            faults: Mutex::default(),
            counters: Mutex::default(),
            sessions: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            listener: Mutex::new(None),
            connections: Mutex::default(),
        });
        shared.spawn_accept(listener);
        Ok(shared)
    }

    pub fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }

    pub fn faults(&self) -> MutexGuard<'_, Faults> {
        lock(&self.faults)
    }

    pub fn new_session(&self) -> u64 {
        self.sessions.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn request_count(&self, kind: RequestKind) -> u64 {
        lock(&self.counters).get(&kind).copied().unwrap_or(0)
    }

    pub fn accepted_connections(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }

    pub fn open_connections(&self) -> usize {
        lock(&self.connections).iter().filter(|task| !task.is_finished()).count()
    }

    fn spawn_accept(self: &Arc<Self>, listener: TcpListener) {
        let task = tokio::spawn(accept_loop(Arc::downgrade(self), listener));
        if let Some(previous) = lock(&self.listener).replace(task) {
            previous.abort();
        }
    }

    /// Listens again on the broker's address (no-op when listening).
    pub async fn listen(self: &Arc<Self>) -> io::Result<()> {
        self.faults().refuse = false;
        if lock(&self.listener).is_some() {
            return Ok(());
        }
        let listener = TcpListener::bind(self.addr).await?;
        self.spawn_accept(listener);
        Ok(())
    }

    /// Stops listening; the address refuses connections until `listen`.
    pub async fn close_listener(&self) {
        self.faults().refuse = true;
        let task = lock(&self.listener).take();
        if let Some(task) = task {
            task.abort();
            let _ = task.await;
        }
    }

    /// Closes every open connection.
    pub async fn close_connections(&self) {
        let tasks: Vec<JoinHandle<()>> = std::mem::take(&mut *lock(&self.connections));
        for task in &tasks {
            task.abort();
        }
        for task in tasks {
            let _ = task.await;
        }
    }

    /// Aborts every task without waiting (used on drop).
    pub fn abort_all(&self) {
        if let Some(task) = lock(&self.listener).take() {
            task.abort();
        }
        for task in lock(&self.connections).drain(..) {
            task.abort();
        }
    }
}

async fn accept_loop(shared: std::sync::Weak<Shared>, listener: TcpListener) {
    loop {
        let Ok((socket, _peer)) = listener.accept().await else {
            // Out of descriptors or similar: back off instead of spinning.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.faults().refuse {
            drop(socket);
            continue;
        }
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        let _ = socket.set_nodelay(true);
        let task = tokio::spawn(serve(Arc::downgrade(&shared), socket));
        let mut connections = lock(&shared.connections);
        connections.retain(|task| !task.is_finished());
        connections.push(task);
    }
}

async fn serve(shared: std::sync::Weak<Shared>, mut socket: TcpStream) {
    let mut connection = Connection::default();
    loop {
        let request = match read_request(&mut socket).await {
            Ok(Some(request)) => request,
            Ok(None) | Err(_) => return,
        };
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let kind = RequestKind::from_code(request.code());
        *lock(&shared.counters).entry(kind).or_insert(0) += 1;
        let (delay, drop_point, malformed) = {
            let mut faults = shared.faults();
            (faults.delay, faults.take_drop(kind), faults.take_malformed_reply(kind))
        };
        if drop_point == Some(DropPoint::BeforeApplying) {
            return;
        }
        let action = handler::handle(&shared, &mut connection, &request);
        if drop_point == Some(DropPoint::AfterApplying) {
            return;
        }
        drop(shared);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        match action {
            Action::Reply(frame) => {
                if malformed && socket.write_all(&crate::wire::malformed_reply_header()).await.is_err() {
                    return;
                }
                if socket.write_all(&frame).await.is_err() {
                    return;
                }
            }
            Action::Silence => {}
        }
    }
}
