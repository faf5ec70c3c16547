//! `kvroute serve`'s connections: the accept loop and its connection limit, each connection
//! under its watchdog ([`crate::connections`]), and the lingering close.

use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::StatusCode;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::routes::handle;
use super::shared::Shared;
use crate::connections::{self, ConnState, Expiry, WatchedIo};
use crate::edge::{self, Body};

/// How long a connection hyper is done with waits for its client to close ([`linger`]).
const LINGER_TIME: Duration = Duration::from_secs(5);
/// How much a lingering connection reads and discards at most.
const LINGER_BYTES: usize = 64 << 20;
/// The answer to a connection whose request head did not arrive in time.
static HEAD_TIMEOUT: LazyLock<Vec<u8>> = LazyLock::new(|| {
    edge::canned(
        StatusCode::REQUEST_TIMEOUT,
        "",
        "request head not received in time",
        "RequestTimeout",
    )
});
/// The answer to a connection past `max_connections`, written before it is closed.
static REFUSED: LazyLock<Vec<u8>> = LazyLock::new(|| {
    edge::canned(
        StatusCode::SERVICE_UNAVAILABLE,
        "Retry-After: 1\r\n",
        "too many connections; retry",
        "ServiceUnavailable",
    )
});

/// Accept connections until stopped. At `max_connections` a new one sheds the connection
/// waiting longest for a request head, or, when none waits, is answered 503 and closed.
pub(super) async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(c) => c,
                // Out of descriptors or a connection reset while queued: keep serving.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
            _ = stopped.changed() => return,
        };
        if shared.connections.len() >= shared.config.max_connections {
            if shared.connections.shed_one() {
                shared.metrics.client_timeout("shed");
            } else {
                shared
                    .metrics
                    .connections_refused
                    .fetch_add(1, Ordering::Relaxed);
                tokio::spawn(refuse(stream));
                continue;
            }
        }
        let _ = stream.set_nodelay(true);
        tokio::spawn(serve_connection(shared.clone(), stream));
    }
}

/// Serve one client connection under its watchdog ([`crate::connections`]).
async fn serve_connection(shared: Arc<Shared>, stream: TcpStream) {
    // A second handle on the socket, for the watchdog's 408 while hyper owns the first.
    let Ok((stream, raw)) = split_handle(stream) else {
        return;
    };
    let (id, state) = shared.connections.open();
    let service = {
        let (shared, state) = (shared.clone(), state.clone());
        service_fn(move |request| {
            let (shared, state) = (shared.clone(), state.clone());
            state.request_started();
            async move {
                let response = handle(shared, request).await;
                // The connection waits for its next head once the answer's body is done.
                Ok::<_, std::convert::Infallible>(
                    response.map(|body| TrackedBody { inner: body, state }.boxed()),
                )
            }
        })
    };
    let limits = connections::Limits {
        header_timeout: shared.config.header_timeout,
        keepalive_timeout: shared.config.keepalive_timeout,
        send_timeout: shared.config.send_timeout,
    };
    // Whether hyper ended the connection (true) or the watchdog did; hyper's side of it is
    // dropped at the end of the block.
    let by_hyper = {
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .serve_connection(TokioIo::new(WatchedIo::new(stream, state.clone())), service);
        tokio::pin!(connection);
        loop {
            let notified = state.changed.notified();
            if state.shed.load(Ordering::Acquire) {
                break false;
            }
            let (phase, since) = state.phase();
            let stalled = state.stalled();
            let limit = connections::deadline(phase, since, stalled, &limits);
            let wait = limit.map(|(at, _)| at.saturating_sub(state.now()));
            tokio::select! {
                _ = &mut connection => break true,
                _ = notified => continue,
                _ = sleep_or_never(wait) => {
                    // The phase may have moved on, or the stall ended, since the deadline
                    // was read.
                    let Some((_, expiry)) = limit else { continue };
                    if state.phase() != (phase, since) || state.stalled() != stalled {
                        continue;
                    }
                    match expiry {
                        Expiry::Timeout408 => {
                            shared.metrics.client_timeout("header");
                            answer_and_close(&raw, &HEAD_TIMEOUT);
                        }
                        Expiry::Close(kind) => shared.metrics.client_timeout(kind),
                    }
                    break false;
                }
            }
        }
    };
    if by_hyper {
        linger(raw, &state).await;
    } else {
        let _ = raw.shutdown(std::net::Shutdown::Both);
    }
    shared.connections.close(id);
}

/// Close a connection hyper is done with the way nginx's `lingering_close` does: end the
/// sending side (the answer, then FIN), then read and discard what the client still sends
/// until it closes, for at most [`LINGER_TIME`] and [`LINGER_BYTES`], or until a new
/// connection at the limit sheds it. Closing a socket with unread bytes resets the connection,
/// and a client still sending a body the router refused (413, or 503 over the body budget)
/// would see the reset instead of the answer.
async fn linger(raw: std::net::TcpStream, state: &ConnState) {
    use tokio::io::AsyncReadExt;
    state.lingering();
    let _ = raw.shutdown(std::net::Shutdown::Write);
    if raw.set_nonblocking(true).is_err() {
        return;
    }
    let Ok(mut stream) = TcpStream::from_std(raw) else {
        return;
    };
    let deadline = tokio::time::Instant::now() + LINGER_TIME;
    // Small: every lingering connection has one (4,096 of them hold 32 MiB).
    let mut buf = [0u8; 8 << 10];
    let mut discarded = 0;
    while discarded < LINGER_BYTES && !state.shed.load(Ordering::Acquire) {
        let shed = state.changed.notified();
        tokio::select! {
            read = tokio::time::timeout_at(deadline, stream.read(&mut buf)) => match read {
                Ok(Ok(n)) if n > 0 => discarded += n,
                _ => return, // the client closed, failed or took too long: close
            },
            _ = shed => {}
        }
    }
}

/// `stream` and a second (std) handle on its socket.
fn split_handle(stream: TcpStream) -> std::io::Result<(TcpStream, std::net::TcpStream)> {
    let std_stream = stream.into_std()?;
    let raw = std_stream.try_clone()?;
    Ok((TcpStream::from_std(std_stream)?, raw))
}

/// Write a canned answer on a connection waiting for its head (its send buffer is empty, so a
/// non-blocking write takes it whole or the client is gone anyway), then close it.
fn answer_and_close(raw: &std::net::TcpStream, answer: &[u8]) {
    use std::io::Write;
    let mut raw = raw;
    let _ = raw.write_all(answer);
    let _ = raw.shutdown(std::net::Shutdown::Both);
}

async fn sleep_or_never(wait: Option<Duration>) {
    match wait {
        Some(w) => tokio::time::sleep(w).await,
        None => std::future::pending().await,
    }
}

/// A response body that tells its connection when the answer is done (dropped by hyper
/// once written, or when the client left).
struct TrackedBody {
    inner: Body,
    state: Arc<ConnState>,
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = edge::Aborted;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for TrackedBody {
    fn drop(&mut self) {
        self.state.answer_ended();
    }
}

/// Answer a connection over the limit with a 503 and close it (at most a second spent).
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(&REFUSED).await;
        let _ = stream.shutdown().await;
    })
    .await;
}
