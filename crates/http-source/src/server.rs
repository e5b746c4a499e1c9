//! Serving a router on a TCP listener with the daemon's connection rules.
//!
//! Invariants:
//! - At most `max_connections` connections are served at once; further clients wait in
//!   the kernel's accept backlog (they are not accepted and dropped).
//! - `header_read_timeout` bounds both the time to receive a request head and the time
//!   a keep-alive connection may sit idle between requests (hyper starts the same timer
//!   when it starts waiting for the next head), so slow or idle clients cannot hold
//!   connection slots.
//! - On shutdown the listener stops accepting at once, in-flight requests are finished,
//!   idle keep-alive connections are closed, and the whole drain is bounded by `grace`:
//!   a connection still open then is cut (its task aborted, its socket closed) before
//!   `serve` returns, so no request of it is answered after the daemon moved on to
//!   closing the log.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::door::PeerAddr;

#[derive(Debug, Clone)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
}

/// How a serve loop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// True when every connection finished within the grace period.
    pub complete: bool,
}

/// Serves `router` on `listener` until `shutdown` resolves, then drains within `grace`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
    listener_name: &'static str,
) -> Drained {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout).keep_alive(true);
    tokio::pin!(shutdown);
    let mut connections = tokio::task::JoinSet::new();
    loop {
        // Reap finished connections so the set holds only live ones.
        while connections.try_join_next().is_some() {}
        let permit = tokio::select! {
            _ = &mut shutdown => break,
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Typically EMFILE/ENFILE: back off instead of spinning.
                    tracing::warn!(listener = listener_name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let peer_addr = PeerAddr::new(peer);
        let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
            req.extensions_mut().insert(peer_addr.clone());
            router.clone().oneshot(req.map(axum::body::Body::new))
        });
        let conn = builder.serve_connection(TokioIo::new(stream), service);
        let watched = graceful.watch(conn);
        connections.spawn(async move {
            if let Err(e) = watched.await {
                tracing::debug!(error = %e, peer = %peer, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
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

/// Binds a listener, with the address in the error.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| std::io::Error::new(e.kind(), format!("binding {addr}: {e}")))
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    use super::*;

    /// A request still running when the grace period ends is cut before `serve` returns:
    /// its client sees the connection close, and never the answer the handler would give
    /// later (after the daemon moved on to closing the log).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_connection_still_open_after_the_grace_period_is_cut_before_serve_returns() {
        let router = Router::new().route(
            "/slow",
            axum::routing::post(|| async {
                tokio::time::sleep(Duration::from_secs(3)).await;
                "late"
            }),
        );
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let limits = ConnectionLimits { max_connections: 4, header_read_timeout: Duration::from_secs(5) };
        let server = tokio::spawn(serve(
            listener,
            router,
            limits,
            async {
                let _ = stopped.await;
            },
            Duration::from_millis(200),
            "test",
        ));
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        client.write_all(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n").unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
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
}
