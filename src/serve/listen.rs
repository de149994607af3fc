//! The accept loop. The server runs hyper's HTTP/1 connections itself rather than through
//! `axum::serve`, which sets none of the limits a server exposed to slow or hostile clients
//! needs:
//! - `header_read_timeout`: hyper closes a connection whose request line and headers have not
//!   all arrived in time, however slowly they trickle in (and an idle kept-alive connection);
//! - `max_header_bytes`: hyper answers 431 and closes once the unparsed head grows past it;
//! - `max_connections`: a semaphore permit per open connection, taken *before* `accept`.
//!
//! At the connection cap the loop stops accepting instead of accepting and closing: a client
//! over the cap waits in the kernel's listen backlog and is served as soon as a connection
//! closes (every slow one is cut off within `header_read_timeout`), rather than getting a reset
//! it may not retry; and the process never holds more sockets than the cap, so it cannot run
//! out of file descriptors. (`body_read_timeout` is enforced where handlers read the body,
//! `body::RequestBody`.)

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use super::Limits;

/// How often, at most, the log says that the connection cap holds new clients back.
const CAP_LOG_EVERY: Duration = Duration::from_secs(60);

/// Serves `app` on `listener` until `shutdown` resolves; then stops accepting, asks every
/// connection to finish its request in flight and close, and returns once all have closed.
pub(crate) async fn run(listener: TcpListener, app: Router, limits: &Limits, shutdown: impl Future<Output = ()>) {
    // acquire_many takes a u32: the cap is clamped to what a semaphore can count.
    let cap = limits.max_connections.clamp(1, (u32::MAX as usize).min(Semaphore::MAX_PERMITS));
    let permits = Arc::new(Semaphore::new(cap));
    let http = http1_builder(limits);
    let (stop, stopping) = watch::channel(());
    let mut last_cap_log = None;
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = permit(&permits, cap, &mut last_cap_log) => p,
            _ = &mut shutdown => break,
        };
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = &mut shutdown => break,
        };
        match accepted {
            Ok((tcp, _)) => {
                tokio::spawn(connection(http.clone(), tcp, app.clone(), limits.clone(), stopping.clone(), permit));
            }
            Err(e) => accept_error(e).await,
        }
    }
    drop(listener);
    // An error means no connection is left to tell.
    let _ = stop.send(());
    // Every connection holds a permit until it closes: all `cap` back means all closed.
    let _ = permits.acquire_many(cap as u32).await;
}

/// HTTP/1 with the header limits; keep-alive on (hyper's default).
fn http1_builder(limits: &Limits) -> http1::Builder {
    let mut b = http1::Builder::new();
    b.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        // Checked as the head is read, not only once it is complete: the read buffer never
        // grows much past the cap.
        .max_header_size(limits.max_header_bytes.max(1));
    b
}

/// A connection slot; when none is free, waits for one (logging that the cap holds clients
/// back, at most once a minute).
async fn permit(permits: &Arc<Semaphore>, cap: usize, last_log: &mut Option<Instant>) -> OwnedSemaphorePermit {
    if let Ok(p) = permits.clone().try_acquire_owned() {
        return p;
    }
    if last_log.is_none_or(|t| t.elapsed() >= CAP_LOG_EVERY) {
        tracing::warn!(max_connections = cap, "{cap} connections are open, the server's max_connections: new clients wait until one closes");
        *last_log = Some(Instant::now());
    }
    permits.clone().acquire_owned().await.expect("the connection semaphore is never closed")
}

/// One connection to its end; on shutdown it finishes the request in flight, then closes.
/// The permit is released when it returns.
async fn connection(http: http1::Builder, tcp: TcpStream, app: Router, limits: Limits, mut stopping: watch::Receiver<()>, _permit: OwnedSemaphorePermit) {
    // Tokens go out as they are produced: without TCP_NODELAY, Nagle's algorithm holds small
    // SSE/NDJSON writes back until the client's delayed ACK (~40 ms per request).
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!("TCP_NODELAY not set: {e}");
    }
    let conn = http.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(app));
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        // The one change ever sent is the shutdown (a dropped sender also ends the wait).
        _ = stopping.changed() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        log_closed(&e, &limits);
    }
}

/// Why hyper ended a connection, naming the limit when one did.
fn log_closed(e: &hyper::Error, limits: &Limits) {
    if e.is_timeout() {
        let secs = limits.header_read_timeout.as_secs_f64();
        tracing::info!(header_read_timeout_s = secs, "closed a connection whose request headers did not arrive within the server's header_read_timeout of {secs} s");
    } else if e.is_parse_too_large() {
        let max = limits.max_header_bytes;
        tracing::info!(max_header_bytes = max, "refused a request whose headers exceed the server's max_header_bytes of {max} bytes (431)");
    } else {
        tracing::debug!("connection ended: {e}");
    }
}

/// As axum::serve does (after hyper 0.14): errors of one connection are skipped; others, such
/// as running out of file descriptors, are logged and the loop pauses a second.
async fn accept_error(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(e.kind(), ConnectionAborted | ConnectionRefused | ConnectionReset) {
        return;
    }
    tracing::error!("accept failed: {e}");
    tokio::time::sleep(Duration::from_secs(1)).await;
}
