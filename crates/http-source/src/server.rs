//! Serving a router on a TCP listener with the daemon's connection rules.
//!
//! Invariants:
//! - At most `max_connections` connections are served at once; further clients wait in
//!   the kernel's accept backlog (they are not accepted and dropped).
//! - `header_read_timeout` bounds both the time to receive a request head and the time
//!   a keep-alive connection may sit idle between requests (hyper starts the same timer
//!   when it starts waiting for the next head), so slow or idle clients cannot hold
//!   connection slots.
//! - With TLS (`tls.rs`), the handshake runs in the connection's own task, bounded by
//!   `header_read_timeout` and cut when the drain starts: the accept loop never waits for
//!   a client, and a client that never finishes its handshake holds its slot no longer
//!   than one that never sends a head. Handshakes that fail or time out are counted in
//!   `iggy_ingest_tls_handshake_failures_total{listener, reason}`.
//! - `write_timeout` bounds how long an answer may wait for its client to take it: from
//!   the first write the socket's buffer refuses until the whole answer is handed to the
//!   kernel. A client that sends requests and never reads the answers (or reads them a
//!   byte at a time) loses its connection then, so it cannot hold a slot either.
//! - A client that shuts its sending side after a whole request (`shutdown(SHUT_WR)`,
//!   `nc -N`) gets its answer; one that does so between requests is closed.
//! - A connection that closes lingers ([`LINGER_MAX_MS`], [`LINGER_MAX_BYTES`]): it
//!   sends the end of its writes, then discards what its client still sends, so that a
//!   body left unread (an early 413) does not turn the answer into a reset. Once the
//!   listener drains, only a connection whose client is found still sending lingers:
//!   the drain waits for requests, not for clients to close the idle connections it ends.
//! - On shutdown the listener stops accepting at once, in-flight requests are finished,
//!   idle keep-alive connections are closed, and the whole drain is bounded by `grace`:
//!   a connection still open then is cut (its task aborted, its socket closed) before
//!   `serve` returns, so no request of it is answered after the daemon moved on to
//!   closing the log.
//! - `iggy_ingest_http_connections{listener}` counts the connections open now (taken
//!   back when a connection's task ends, aborted or not), and
//!   `iggy_ingest_http_connection_waits_total{listener}` the clients that waited in the
//!   backlog for a slot (one found there the moment a slot freed): a listener at its
//!   cap shows, though its clients wait in the kernel.
//! - A failed accept (typically EMFILE: the process is out of file descriptors) is
//!   retried after 50 ms, never in a spin and never ending the listener; each is counted
//!   in `iggy_ingest_http_accept_failures_total{listener}` and logged at most once a
//!   second (with how many were left out): clients can cause them at will once
//!   descriptors are short.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use ingest::log_limit::LogLimit;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Sleep;
use tower::ServiceExt;

use crate::door::PeerAddr;
use crate::tls::ListenerTls;

#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    /// How long an answer may wait for the client to read it (see the module's
    /// invariants).
    pub write_timeout: Duration,
}

/// How long a failed accept waits before the next: the connection it could not take
/// stays in the backlog, and is taken once a descriptor is free.
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(50);

/// At most one line per listener per this interval says accepts fail.
const ACCEPT_FAILURE_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// How a serve loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// True when every connection finished within the grace period.
    pub complete: bool,
}

/// Serves `router` on `listener` (over TLS with `tls`) until `shutdown` resolves, then
/// drains within `grace`.
pub async fn serve(
    listener: TcpListener,
    tls: Option<ListenerTls>,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    listener_name: &'static str,
) -> Drained {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let open = metrics::gauge!("iggy_ingest_http_connections", "listener" => listener_name);
    let waits = metrics::counter!("iggy_ingest_http_connection_waits_total", "listener" => listener_name);
    let accept_failures = metrics::counter!("iggy_ingest_http_accept_failures_total", "listener" => listener_name);
    let accept_failure_log = LogLimit::every(ACCEPT_FAILURE_LOG_INTERVAL);
    let graceful = GracefulShutdown::new();
    // Set when the drain starts: handshakes still under way give up.
    let (draining_tx, draining) = tokio::sync::watch::channel(false);
    let mut builder = hyper::server::conn::http1::Builder::new();
    // Half-closed: a client that shuts its sending side after a whole request still
    // reads, and its answer (a 200 whose events are on disk) is sent. Without it hyper
    // takes the end of the client's sending for a disconnect while the request runs, and
    // drops the request: its events appended, its answer never sent.
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout).keep_alive(true).half_close(true);
    tokio::pin!(shutdown);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        // Reap finished connections so the set holds only live ones.
        while connections.try_join_next().is_some() {}
        // A client found in the backlog the moment a slot freed: it waited for the slot.
        let mut waited: Option<std::io::Result<(TcpStream, SocketAddr)>> = None;
        let permit = match slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // Every slot is taken: further clients wait in the kernel's backlog.
                let p = tokio::select! {
                    _ = &mut shutdown => break,
                    p = slots.clone().acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break,
                    },
                };
                if let Poll::Ready(accepted) = std::future::poll_fn(|cx| Poll::Ready(listener.poll_accept(cx))).await {
                    // A failed accept (EMFILE, an aborted connection) is no client served.
                    if accepted.is_ok() {
                        waits.increment(1);
                    }
                    waited = Some(accepted);
                }
                p
            }
        };
        let accepted = match waited {
            Some(accepted) => accepted,
            None => tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => accepted,
            },
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // Typically EMFILE/ENFILE: back off instead of spinning.
                accept_failures.increment(1);
                if let Some(suppressed) = accept_failure_log.admit() {
                    tracing::warn!(listener = listener_name, error = %e, suppressed, "accept failed");
                }
                tokio::time::sleep(ACCEPT_RETRY_DELAY).await;
                continue;
            }
        };
        fail_points::fail_point!("listener.accept");
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let peer_addr = PeerAddr::new(peer);
        let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            req.extensions_mut().insert(peer_addr.clone());
            router.clone().oneshot(req.map(axum::body::Body::new))
        });
        let stream = WriteDeadline::new(stream, limits.write_timeout, draining.clone());
        let slot = OpenConnection::new(permit, open.clone());
        let handshake = tls.as_ref().map(|tls| Handshake {
            tls: tls.clone(),
            timeout: limits.header_read_timeout,
            draining: draining.clone(),
            listener: listener_name,
        });
        // Subscribed now: a drain that starts during a TLS handshake waits for it (cut
        // short by `draining`) and closes the connection it yields.
        let watcher = graceful.watcher();
        let builder = builder.clone();
        connections.spawn(async move {
            let ended = match handshake {
                None => watcher.watch(builder.serve_connection(TokioIo::new(stream), service)).await,
                Some(handshake) => match handshake.run(stream, peer).await {
                    Some(stream) => watcher.watch(builder.serve_connection(TokioIo::new(stream), service)).await,
                    None => Ok(()),
                },
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, peer = %peer, "connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    let _ = draining_tx.send(true);
    fail_points::fail_point!("listener.drain");
    let complete = tokio::time::timeout(grace, graceful.shutdown()).await.is_ok();
    if !complete {
        tracing::warn!(
            listener = listener_name,
            grace_ms = grace.as_millis() as u64,
            open = connections.len(),
            "connections still open after the grace period: cut"
        );
    }
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    Drained { complete }
}

/// A TLS handshake on an accepted connection, with its bounds.
struct Handshake {
    tls: ListenerTls,
    timeout: Duration,
    draining: tokio::sync::watch::Receiver<bool>,
    listener: &'static str,
}

impl Handshake {
    /// The connection's TLS stream, or `None` when the handshake failed, outlasted the
    /// timeout or was under way when the drain started (counted, logged at debug: a
    /// port scanner or a client with no common protocol is no operator's error).
    async fn run(
        mut self,
        stream: WriteDeadline,
        peer: SocketAddr,
    ) -> Option<tokio_rustls::server::TlsStream<WriteDeadline>> {
        let failed = |reason: &'static str| {
            metrics::counter!("iggy_ingest_tls_handshake_failures_total", "listener" => self.listener, "reason" => reason)
                .increment(1);
        };
        let accept = self.tls.acceptor().accept(stream);
        tokio::select! {
            done = tokio::time::timeout(self.timeout, accept) => match done {
                Ok(Ok(stream)) => Some(stream),
                Ok(Err(e)) => {
                    failed("refused");
                    tracing::debug!(listener = self.listener, peer = %peer, error = %e, "TLS handshake failed");
                    None
                }
                Err(_) => {
                    failed("timed_out");
                    tracing::debug!(listener = self.listener, peer = %peer, "TLS handshake outlasted the header read timeout");
                    None
                }
            },
            _ = self.draining.wait_for(|d| *d) => None,
        }
    }
}

/// A connection's slot, counted in the open-connections gauge while it is held: dropped
/// when the connection's task ends, also when the task is aborted at the end of a drain.
struct OpenConnection {
    _permit: tokio::sync::OwnedSemaphorePermit,
    open: metrics::Gauge,
}

impl OpenConnection {
    fn new(permit: tokio::sync::OwnedSemaphorePermit, open: metrics::Gauge) -> OpenConnection {
        open.increment(1.0);
        OpenConnection { _permit: permit, open }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.open.decrement(1.0);
    }
}

/// How long a closing connection goes on reading (and discarding) what its client
/// still sends, after its last answer and the end of its writes were sent: the time a
/// client on a slow link needs to read the answer and stop sending. Without it, a
/// connection closed with a request body unread (an early 413, a 404 or 401 answered
/// before the body) is reset by the kernel, and a client still writing its body gets
/// the reset, often instead of the answer. Bounded so that a client that never stops
/// cannot hold its slot or the drain (nginx's `lingering_close`, shorter).
pub const LINGER_MAX_MS: u64 = 2_000;

/// The most a closing connection discards while it lingers: a body several times the
/// usual `max_body_bytes`, so an oversized delivery still gets its 413; past it the
/// connection is closed at once (a client sending that much reads its reset).
pub const LINGER_MAX_BYTES: usize = 32 << 20;

/// A connection's socket whose writes may stay refused for at most `limit`: the clock
/// starts at the first write the socket does not take at once and stops when hyper
/// flushes, which it does once its whole buffered answer went to the kernel. Partial
/// progress does not stop it, so a client reading a byte at a time is cut as well.
/// Nothing is allocated while the socket takes every write at once.
///
/// Its shutdown lingers: it sends the end of the connection's writes, then reads and
/// discards what the client still sends until the client closes, for at most
/// [`LINGER_MAX_MS`] and [`LINGER_MAX_BYTES`]; once the listener drains, only if the
/// client is found still sending.
struct WriteDeadline {
    stream: TcpStream,
    limit: Duration,
    /// Running while a write is waiting for the client to read.
    blocked: Option<Pin<Box<Sleep>>>,
    /// Set once the end of the writes was sent: how long and how much more to read.
    lingering: Option<Linger>,
    /// True once the listener drains: a connection closed then lingers only while its
    /// client is still sending ([`Linger::close_if_quiet`]), so the drain waits for
    /// requests and bodies, not for clients to close the idle connections it ends.
    draining: tokio::sync::watch::Receiver<bool>,
}

/// The bounds of a closing connection's lingering read, counted from its start.
struct Linger {
    until: Pin<Box<Sleep>>,
    discarded_bytes: usize,
    /// Set for a connection the drain closes: it lingers only if its client is found
    /// still sending at the first read (a body the answer left unread), and closes at
    /// once if nothing is there (an idle keep-alive client).
    close_if_quiet: bool,
}

impl WriteDeadline {
    fn new(stream: TcpStream, limit: Duration, draining: tokio::sync::watch::Receiver<bool>) -> WriteDeadline {
        WriteDeadline { stream, limit, blocked: None, lingering: None, draining }
    }

    /// Reads and discards what the client sends until it closes, an error, or a bound:
    /// ready then, pending while the client may still send.
    fn poll_linger(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(linger) = self.lingering.as_mut() else { return Poll::Ready(()) };
        let mut scratch = [std::mem::MaybeUninit::<u8>::uninit(); 8192];
        loop {
            if linger.discarded_bytes >= LINGER_MAX_BYTES || linger.until.as_mut().poll(cx).is_ready() {
                return Poll::Ready(());
            }
            let mut buf = ReadBuf::uninit(&mut scratch);
            match Pin::new(&mut self.stream).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                    linger.discarded_bytes += buf.filled().len();
                    linger.close_if_quiet = false;
                }
                // The client closed (or reset) its side: nothing more can come.
                Poll::Ready(_) => return Poll::Ready(()),
                Poll::Pending if linger.close_if_quiet => return Poll::Ready(()),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// After a write the socket refused: an error once the clock ran out, else pending.
    fn refused<T>(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<T>> {
        let limit = self.limit;
        let clock = self.blocked.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        ready!(clock.as_mut().poll(cx));
        Poll::Ready(Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the client took no answer for {} ms (http.write_timeout_ms)", limit.as_millis()),
        )))
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match Pin::new(&mut self.stream).poll_write(cx, buf) {
            Poll::Pending => self.refused(cx),
            done => done,
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match Pin::new(&mut self.stream).poll_write_vectored(cx, bufs) {
            Poll::Pending => self.refused(cx),
            done => done,
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let flushed = ready!(Pin::new(&mut self.stream).poll_flush(cx));
        self.blocked = None;
        Poll::Ready(flushed)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.lingering.is_none() {
            ready!(Pin::new(&mut self.stream).poll_shutdown(cx))?;
            let close_if_quiet = *self.draining.borrow();
            self.lingering = Some(Linger {
                until: Box::pin(tokio::time::sleep(Duration::from_millis(LINGER_MAX_MS))),
                discarded_bytes: 0,
                close_if_quiet,
            });
        }
        ready!(self.poll_linger(cx));
        Poll::Ready(Ok(()))
    }
}

/// How many connections the kernel keeps waiting for an accept: clients beyond a
/// listener's cap of connections, and those of a start that has bound its listeners but
/// does not serve yet, wait there rather than have their connects dropped and retried
/// seconds later. (A plain bind takes 128, the standard library's choice; Linux lowers
/// the figure to `net.core.somaxconn` where that is less.)
pub const LISTEN_BACKLOG: u32 = 1024;

/// Binds a listener (the address reusable at once after a restart, as a plain bind makes
/// it, and a backlog of [`LISTEN_BACKLOG`]), with the address in the error.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let named = |e: std::io::Error| std::io::Error::new(e.kind(), format!("binding {addr}: {e}"));
    let socket = if addr.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() }.map_err(named)?;
    socket.set_reuseaddr(true).map_err(named)?;
    socket.bind(addr).map_err(named)?;
    socket.listen(LISTEN_BACKLOG).map_err(named)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    use super::*;

    /// A listener that accepts nothing (its cap reached, or a start not serving yet) keeps
    /// far more than the 128 connections a plain bind would in its backlog: each of them
    /// completes its connect at once, none waits for a SYN sent again a second later.
    #[tokio::test]
    async fn a_listener_keeps_hundreds_of_connections_waiting_for_an_accept() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connects: Vec<_> = (0..400)
            .map(|_| {
                tokio::spawn(async move {
                    tokio::time::timeout(Duration::from_millis(700), TcpStream::connect(addr)).await.ok()?.ok()
                })
            })
            .collect();
        let mut connected = Vec::new();
        for c in connects {
            connected.extend(c.await.unwrap());
        }
        assert_eq!(connected.len(), 400, "connects completed with nothing accepted");
        drop(listener);
    }

    /// `router` served on an ephemeral port with four slots, `header_read_timeout` and a
    /// write timeout of 5 s, until the sender returned is used (or dropped), then drained
    /// within `grace`: its address, that sender, and the serve task.
    async fn stoppable_listener(
        router: Router,
        header_read_timeout: Duration,
        grace: Duration,
    ) -> (SocketAddr, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<Drained>) {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let limits =
            ConnectionLimits { max_connections: 4, header_read_timeout, write_timeout: Duration::from_secs(5) };
        let shutdown = async {
            let _ = stopped.await;
        };
        (addr, stop, tokio::spawn(serve(listener, None, router, limits, shutdown, grace, "test")))
    }

    /// A request still running when the grace period ends is cut before `serve` returns:
    /// its client sees the connection close, and never the answer the handler would give
    /// later (after the daemon moved on to closing the log).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_still_open_after_the_grace_period_is_cut_before_serve_returns() {
        let started = std::sync::Arc::new(tokio::sync::Notify::new());
        let router = Router::new().route(
            "/slow",
            axum::routing::post({
                let started = started.clone();
                move || async move {
                    started.notify_one();
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    "late"
                }
            }),
        );
        let (addr, stop, server) = stoppable_listener(router, Duration::from_secs(5), Duration::from_millis(200)).await;
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        client.write_all(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n").unwrap();
        // The request is in its handler when the stop comes.
        tokio::time::timeout(Duration::from_secs(30), started.notified()).await.unwrap();
        let _ = stop.send(());
        let drained = tokio::time::timeout(Duration::from_secs(2), server).await.unwrap().unwrap();
        assert!(!drained.complete, "the slow request cannot have finished within the grace period");
        let returned = Instant::now();
        client.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let (read, buf) = tokio::task::spawn_blocking(move || {
            let mut buf = Vec::new();
            (client.read_to_end(&mut buf), buf)
        })
        .await
        .unwrap();
        // Closed (end of stream, or reset): not timed out.
        if let Err(e) = &read {
            assert!(
                !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
                "the connection was still open a second after serve returned"
            );
        }
        assert!(buf.is_empty(), "an answer came after the grace period: {}", String::from_utf8_lossy(&buf));
        assert!(returned.elapsed() < Duration::from_secs(1));
    }

    /// `router` served on an ephemeral port with one connection slot and `write_timeout`,
    /// never stopped.
    async fn one_slot_listener(router: Router, write_timeout: Duration) -> SocketAddr {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits =
            ConnectionLimits { max_connections: 1, header_read_timeout: Duration::from_secs(30), write_timeout };
        tokio::spawn(serve(
            listener,
            None,
            router,
            limits,
            std::future::pending::<()>(),
            Duration::from_secs(1),
            "test",
        ));
        addr
    }

    /// `GET /small` on a connection of its own, closed after: how the read ended, and
    /// the answer.
    async fn get_small_once(addr: SocketAddr, read_timeout: Duration) -> (std::io::Result<usize>, String) {
        tokio::task::spawn_blocking(move || {
            let mut b = std::net::TcpStream::connect(addr).unwrap();
            b.set_read_timeout(Some(read_timeout)).unwrap();
            b.write_all(b"GET /small HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").unwrap();
            let mut answer = Vec::new();
            (b.read_to_end(&mut answer), String::from_utf8_lossy(&answer).into_owned())
        })
        .await
        .unwrap()
    }

    /// A listener with a route that answers 413 at once, never reading the body (as the
    /// door does when `Content-Length` is over `max_body_bytes`), and one connection slot.
    async fn refusing_listener() -> SocketAddr {
        let router = Router::new()
            .route("/refuse", axum::routing::post(|| async { axum::http::StatusCode::PAYLOAD_TOO_LARGE }))
            .route("/small", axum::routing::get(|| async { "small" }));
        one_slot_listener(router, Duration::from_secs(5)).await
    }

    /// A client that writes its whole (oversized) body before it reads gets the 413, not
    /// a reset: the connection, closed with the body unread, reads and discards what
    /// still comes instead of letting the kernel reset it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_still_sending_its_body_after_an_early_413_reads_the_413() {
        let addr = refusing_listener().await;
        let body_bytes = 4 << 20;
        let (wrote, answer) = tokio::task::spawn_blocking(move || {
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            c.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
            c.write_all(format!("POST /refuse HTTP/1.1\r\nhost: x\r\ncontent-length: {body_bytes}\r\n\r\n").as_bytes())
                .unwrap();
            // The answer is sent and the connection closing before the body comes.
            std::thread::sleep(Duration::from_millis(300));
            let wrote = c.write_all(&vec![b'x'; body_bytes]);
            let mut answer = Vec::new();
            let _ = c.read_to_end(&mut answer);
            (wrote, String::from_utf8_lossy(&answer).into_owned())
        })
        .await
        .unwrap();
        assert!(wrote.is_ok(), "the body's writes failed: {wrote:?}");
        assert!(answer.starts_with("HTTP/1.1 413"), "no 413 read: {answer:?}");
    }

    /// A client that goes on sending after an early 413 holds its slot no longer than
    /// `LINGER_MAX_MS`, however slowly (or without end) it sends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_never_stops_sending_after_a_413_frees_its_slot_after_the_linger() {
        let addr = refusing_listener().await;
        std::thread::spawn(move || {
            let mut a = std::net::TcpStream::connect(addr).unwrap();
            a.write_all(b"POST /refuse HTTP/1.1\r\nhost: x\r\ncontent-length: 1000000000\r\n\r\n").unwrap();
            // A byte every 50 ms, for longer than the test (50 s).
            for _ in 0..1000 {
                if a.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        let (read, answer) = get_small_once(addr, Duration::from_secs(30)).await;
        assert!(read.is_ok(), "{read:?}");
        assert!(answer.ends_with("small"), "{answer:?}");
        let waited = started.elapsed();
        // The linger and room for a loaded machine; held by A, it would be 50 s.
        assert!(waited < Duration::from_millis(LINGER_MAX_MS + 8_000), "the slot was held {waited:?}");
    }

    /// A drain ends the idle keep-alive connections without lingering on them: a client
    /// that keeps its idle connection open after the server closed it holds the drain no
    /// longer than a client that closes it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_drain_does_not_linger_on_the_idle_connections_it_closes() {
        let router = Router::new().route("/small", axum::routing::get(|| async { "small" }));
        let (addr, stop, server) =
            stoppable_listener(router, Duration::from_secs(30), Duration::from_millis(1_000)).await;
        // One keep-alive request answered, then the socket held open, never read again.
        let client = tokio::task::spawn_blocking(move || {
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.write_all(b"GET /small HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
            let mut answer = [0u8; 512];
            let n = c.read(&mut answer).unwrap();
            assert!(String::from_utf8_lossy(&answer[..n]).ends_with("small"));
            c
        })
        .await
        .unwrap();
        let started = Instant::now();
        let _ = stop.send(());
        let drained = tokio::time::timeout(Duration::from_secs(5), server).await.unwrap().unwrap();
        assert!(drained.complete, "the drain was cut at its grace period");
        assert!(started.elapsed() < Duration::from_millis(LINGER_MAX_MS / 2), "the drain took {:?}", started.elapsed());
        drop(client);
    }

    /// A request answered during the drain without its body read (the door's 503
    /// `shutting_down`) while its client is still sending that body: the connection
    /// lingers, so the client gets the answer (and its `Retry-After`), not a reset.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_still_sending_when_the_drain_answers_it_reads_the_answer() {
        let started = std::sync::Arc::new(tokio::sync::Notify::new());
        let release = std::sync::Arc::new(tokio::sync::Notify::new());
        let router = Router::new().route(
            "/late",
            axum::routing::post({
                let (started, release) = (started.clone(), release.clone());
                move || async move {
                    started.notify_one();
                    release.notified().await;
                    axum::http::StatusCode::SERVICE_UNAVAILABLE
                }
            }),
        );
        let (addr, stop, server) = stoppable_listener(router, Duration::from_secs(30), Duration::from_secs(10)).await;
        let body_bytes = 4usize << 20;
        let client = tokio::task::spawn_blocking(move || {
            let mut c = std::net::TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            c.write_all(format!("POST /late HTTP/1.1\r\nhost: x\r\ncontent-length: {body_bytes}\r\n\r\n").as_bytes())
                .unwrap();
            // The body, sent steadily for about half a second.
            let chunk = vec![b'x'; 64 << 10];
            let mut wrote = Ok(());
            for _ in 0..body_bytes / chunk.len() {
                wrote = c.write_all(&chunk);
                if wrote.is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(8));
            }
            let mut answer = Vec::new();
            let _ = c.read_to_end(&mut answer);
            (wrote, String::from_utf8_lossy(&answer).into_owned())
        });
        tokio::time::timeout(Duration::from_secs(10), started.notified()).await.unwrap();
        let _ = stop.send(());
        tokio::time::sleep(Duration::from_millis(50)).await;
        release.notify_one();
        let (wrote, answer) = client.await.unwrap();
        assert!(wrote.is_ok(), "the body's writes failed: {wrote:?}");
        assert!(answer.starts_with("HTTP/1.1 503"), "no 503 read: {answer:?}");
        let drained = tokio::time::timeout(Duration::from_secs(10), server).await.unwrap().unwrap();
        assert!(drained.complete);
    }

    /// A client that sends requests and never reads the answers loses its connection
    /// after `write_timeout`, so the one slot it held serves the next client.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_that_never_reads_its_answers_is_cut_after_the_write_timeout() {
        let big = "x".repeat(64 * 1024);
        let router = Router::new()
            .route("/big", axum::routing::get(move || std::future::ready(big.clone())))
            .route("/small", axum::routing::get(|| async { "small" }));
        let addr = one_slot_listener(router, Duration::from_millis(500)).await;
        // Client A: a small receive buffer, 200 pipelined requests for 64 KiB answers,
        // and never a read.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        let a = socket.connect(addr).await.unwrap().into_std().unwrap();
        a.set_nonblocking(false).unwrap();
        let (a_sent, a_done) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut a = a;
            for _ in 0..200 {
                if a.write_all(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n").is_err() {
                    break;
                }
            }
            let _ = a_sent.send(());
            // Held open (and unread) well past the test.
            std::thread::sleep(Duration::from_secs(40));
        });
        let _ = tokio::task::spawn_blocking(move || a_done.recv_timeout(Duration::from_secs(5))).await;
        // Client B, behind A in the accept backlog: served once A was cut.
        let started = Instant::now();
        let (read, answer) = get_small_once(addr, Duration::from_secs(20)).await;
        assert!(read.is_ok(), "client B was not served while A held the only slot: {read:?}");
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("small"), "{answer}");
        // The write timeout (0.5 s) and room for a loaded machine; held by A, 40 s.
        assert!(started.elapsed() < Duration::from_secs(10), "B waited {:?}", started.elapsed());
    }

    /// A TLS listener on an ephemeral port with one slot, serving `GET /small`.
    async fn tls_listener(
        header_read_timeout: Duration,
    ) -> (SocketAddr, crate::tls::testing::TestPair, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let pair = crate::tls::testing::pair();
        let tls = ListenerTls::new(crate::tls::testing::write(dir.path(), &pair), "test").unwrap();
        let router = Router::new().route("/small", axum::routing::get(|| async { "small" }));
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits =
            ConnectionLimits { max_connections: 1, header_read_timeout, write_timeout: Duration::from_secs(5) };
        tokio::spawn(serve(
            listener,
            Some(tls),
            router,
            limits,
            std::future::pending::<()>(),
            Duration::from_secs(1),
            "test",
        ));
        (addr, pair, dir)
    }

    /// `GET /small` over TLS on a new connection: the whole answer.
    async fn get_small_over_tls(addr: SocketAddr, pair: &crate::tls::testing::TestPair) -> std::io::Result<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let mut tls = crate::tls::testing::client(&[pair], &[]).connect(crate::tls::testing::localhost(), tcp).await?;
        tls.write_all(b"GET /small HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await?;
        let mut answer = Vec::new();
        tls.read_to_end(&mut answer).await?;
        Ok(String::from_utf8_lossy(&answer).into_owned())
    }

    /// A client that connects and never starts its handshake holds the only slot no
    /// longer than the header-read timeout: the next client is served after it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tls_handshake_never_finished_frees_its_slot_after_the_header_read_timeout() {
        let (addr, pair, _dir) = tls_listener(Duration::from_millis(300)).await;
        // Before the connect: the listener's timer starts once it accepted, after it, so
        // the wait below is at least the timeout however late this task runs.
        let started = Instant::now();
        let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        let answer = tokio::time::timeout(Duration::from_secs(10), get_small_over_tls(addr, &pair))
            .await
            .expect("the second client was never served")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("small"), "{answer}");
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(250),
            "served before the silent client's slot could be free: {waited:?}"
        );
    }

    /// Plain HTTP sent to a TLS listener is answered with no HTTP at all (its handshake
    /// fails), and the slot it held serves the next client at once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plain_http_to_a_tls_listener_gets_no_http_answer_and_frees_its_slot() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (addr, pair, _dir) = tls_listener(Duration::from_secs(30)).await;
        let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
        plain.write_all(b"GET /small HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut answer)).await.unwrap();
        assert!(!String::from_utf8_lossy(&answer).contains("HTTP/1.1"), "{answer:?}");
        let answer =
            tokio::time::timeout(Duration::from_secs(5), get_small_over_tls(addr, &pair)).await.unwrap().unwrap();
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("small"), "{answer}");
    }
}
