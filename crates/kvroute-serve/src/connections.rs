//! What one client connection may hold: a request head within `header_timeout`, an idle
//! kept-alive connection for `keepalive_timeout`, an answer it does not read for
//! `send_timeout`, and a place among `max_connections`.
//!
//! hyper's own head timer runs from the end of the previous answer, so it cannot keep an idle
//! connection open longer than a head may take to arrive (load balancers keep theirs ~60 s and
//! must never send on a connection the router is closing). So each connection has a
//! [`ConnState`] that the reading side (a byte of a head arrived), the request handler (a
//! request started or its answer ended) and a watchdog share, and [`deadline`] says, purely
//! from that state, when the watchdog must act:
//!
//! - a fresh connection with no byte yet: `header_timeout` after it opened (closed, counted
//!   `header`);
//! - a head partly received: `header_timeout` after its first byte (408, counted `header`);
//! - a kept-alive connection idle between requests: `keepalive_timeout` (closed, `idle`);
//! - a request being served: no limit here (the body and first-byte timeouts are the
//!   handler's);
//! - in any phase, an answer the client has taken no byte of for `send_timeout` while the
//!   router had more to write (the socket's buffers full): closed, counted `send`. A client
//!   that stops reading would otherwise hold its connection, its worker's and what they
//!   buffer for as long as it likes.
//!
//! At `max_connections` a new connection first sheds a lingering one (done, its answer sent),
//! else the one waiting longest for a head ([`shed_candidate`]: slow-header connections
//! cannot lock valid clients out);
//! when none waits it is answered 503 and closed (the server's), so the descriptors never run
//! out and the port never goes silent.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

/// Where a connection is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Open, no byte of a first request yet.
    Fresh,
    /// A request head partly received.
    Head,
    /// A request being served (from its complete head until its answer ended).
    Busy,
    /// Kept alive between requests.
    Idle,
    /// Done, its answer sent: what the client still sends is read and discarded until it
    /// closes (the server's lingering close), bounded by the server.
    Lingering,
}

impl Phase {
    fn from_u8(v: u8) -> Self {
        match v {
            0 => Phase::Fresh,
            1 => Phase::Head,
            2 => Phase::Busy,
            3 => Phase::Idle,
            _ => Phase::Lingering,
        }
    }
}

/// What the watchdog does when a deadline passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// Close without a word (nothing of a request arrived), counted as this kind.
    Close(&'static str),
    /// Answer 408 and close (part of a head arrived), counted `header`.
    Timeout408,
}

/// The limits [`deadline`] applies.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub header_timeout: Duration,
    pub keepalive_timeout: Duration,
    /// None: a client may leave its answer unread indefinitely.
    pub send_timeout: Option<Duration>,
}

/// When the connection in `phase` since `since`, its writes stalled since `stalled` (None:
/// they are not), must be acted on, and how (None: no limit while a request is served and
/// its answer flows).
pub fn deadline(
    phase: Phase,
    since: Duration,
    stalled: Option<Duration>,
    limits: &Limits,
) -> Option<(Duration, Expiry)> {
    let by_phase = match phase {
        Phase::Fresh => Some((since + limits.header_timeout, Expiry::Close("header"))),
        Phase::Head => Some((since + limits.header_timeout, Expiry::Timeout408)),
        Phase::Idle => Some((since + limits.keepalive_timeout, Expiry::Close("idle"))),
        Phase::Busy => None,
        Phase::Lingering => return None, // bounded by the lingering close itself
    };
    let by_send = stalled
        .zip(limits.send_timeout)
        .map(|(at, limit)| (at + limit, Expiry::Close("send")));
    match (by_phase, by_send) {
        (Some(p), Some(s)) => Some(if s.0 < p.0 { s } else { p }),
        (p, s) => p.or(s),
    }
}

/// One connection's state, shared by its reader, its handler and its watchdog.
pub struct ConnState {
    phase: AtomicU8,
    /// When the phase began, in nanoseconds since the registry's start.
    since_ns: AtomicU64,
    /// When the socket last refused a write after taking one (nanoseconds since the
    /// registry's start, at least 1), 0 while writes go through.
    stalled_ns: AtomicU64,
    origin: Instant,
    /// Set when another connection shed this one.
    pub shed: AtomicBool,
    /// Wakes the watchdog at every phase change and at a shed.
    pub changed: Notify,
}

impl ConnState {
    fn new(origin: Instant) -> Self {
        let s = Self {
            phase: AtomicU8::new(Phase::Fresh as u8),
            since_ns: AtomicU64::new(0),
            stalled_ns: AtomicU64::new(0),
            origin,
            shed: AtomicBool::new(false),
            changed: Notify::new(),
        };
        s.since_ns.store(s.now_ns(), Ordering::Relaxed);
        s
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The phase and when it began (time since the registry's start).
    pub fn phase(&self) -> (Phase, Duration) {
        let phase = Phase::from_u8(self.phase.load(Ordering::Acquire));
        (
            phase,
            Duration::from_nanos(self.since_ns.load(Ordering::Acquire)),
        )
    }

    fn set(&self, phase: Phase) {
        self.since_ns.store(self.now_ns(), Ordering::Release);
        self.phase.store(phase as u8, Ordering::Release);
        self.changed.notify_one();
    }

    /// Bytes arrived: a head begins if the connection was waiting for one.
    fn bytes_arrived(&self) {
        let p = Phase::from_u8(self.phase.load(Ordering::Acquire));
        if matches!(p, Phase::Fresh | Phase::Idle) {
            self.set(Phase::Head);
        }
    }

    /// A request's head is complete: it is being served.
    pub fn request_started(&self) {
        self.set(Phase::Busy);
    }

    /// A request's answer ended: the connection waits for the next head.
    pub fn answer_ended(&self) {
        if Phase::from_u8(self.phase.load(Ordering::Acquire)) == Phase::Busy {
            self.set(Phase::Idle);
        }
    }

    /// The socket refused a write (its buffers are full): a stall begins unless one has.
    /// Wakes the watchdog only then, not at every refusal.
    fn write_refused(&self) {
        let now = self.now_ns().max(1);
        if self
            .stalled_ns
            .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.changed.notify_one();
        }
    }

    /// The socket took bytes: no stall (the watchdog finds it over when it looks).
    fn write_taken(&self) {
        if self.stalled_ns.load(Ordering::Relaxed) != 0 {
            self.stalled_ns.store(0, Ordering::Release);
        }
    }

    /// Since when writes are stalled (time since the registry's start), None while they are not.
    pub fn stalled(&self) -> Option<Duration> {
        match self.stalled_ns.load(Ordering::Acquire) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    /// Its answers are done: the connection lingers until the client closes.
    pub fn lingering(&self) {
        self.set(Phase::Lingering);
    }

    /// Time since the registry's start.
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.now_ns())
    }
}

/// Every open connection's state, for shedding.
pub struct Registry {
    origin: Instant,
    next_id: AtomicU64,
    open: Mutex<HashMap<u64, Arc<ConnState>>>,
}

impl Default for Registry {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            next_id: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        }
    }
}

impl Registry {
    /// Register a new connection; its id and state.
    pub fn open(&self) -> (u64, Arc<ConnState>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState::new(self.origin));
        self.lock().insert(id, state.clone());
        (id, state)
    }

    /// Forget a closed connection.
    pub fn close(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// Connections open.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnState>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Shed a lingering connection, else the one waiting longest for a request head (fresh,
    /// or a head partly received), if any: true when one was told to close.
    pub fn shed_one(&self) -> bool {
        let open = self.lock();
        let states: Vec<(Phase, Duration, &Arc<ConnState>)> = open
            .values()
            .filter(|s| !s.shed.load(Ordering::Relaxed))
            .map(|s| {
                let (p, since) = s.phase();
                (p, since, s)
            })
            .collect();
        let Some(i) = shed_candidate(states.iter().map(|(p, since, _)| (*p, *since))) else {
            return false;
        };
        let victim = states[i].2;
        victim.shed.store(true, Ordering::Release);
        victim.changed.notify_one();
        true
    }
}

/// Index of the connection to shed among `(phase, since)`: the longest lingering one (its
/// answers are sent), else the one waiting longest for a head; None when every one is serving
/// a request or kept alive between requests.
pub fn shed_candidate(states: impl Iterator<Item = (Phase, Duration)>) -> Option<usize> {
    states
        .enumerate()
        .filter(|(_, (p, _))| matches!(p, Phase::Fresh | Phase::Head | Phase::Lingering))
        .min_by_key(|(_, (p, since))| (*p != Phase::Lingering, *since))
        .map(|(i, _)| i)
}

/// A client socket that tells its [`ConnState`] when bytes arrive and when writes stall.
pub struct WatchedIo<T> {
    inner: T,
    state: Arc<ConnState>,
}

impl<T> WatchedIo<T> {
    pub fn new(inner: T, state: Arc<ConnState>) -> Self {
        Self { inner, state }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for WatchedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.state.bytes_arrived();
        }
        result
    }
}

impl<T> WatchedIo<T> {
    /// Tell the state what a write did.
    fn watch_write(&self, result: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        match result {
            Poll::Pending => self.state.write_refused(),
            Poll::Ready(Ok(n)) if n > 0 => self.state.write_taken(),
            Poll::Ready(_) => {}
        }
        result
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for WatchedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch_write(result)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch_write(result)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    const LIMITS: Limits = Limits {
        header_timeout: Duration::from_secs(10),
        keepalive_timeout: Duration::from_secs(75),
        send_timeout: Some(Duration::from_secs(60)),
    };

    #[test]
    fn each_phase_has_its_limit() {
        assert_eq!(
            deadline(Phase::Fresh, S(1), None, &LIMITS),
            Some((S(11), Expiry::Close("header")))
        );
        assert_eq!(
            deadline(Phase::Head, S(2), None, &LIMITS),
            Some((S(12), Expiry::Timeout408))
        );
        assert_eq!(
            deadline(Phase::Idle, S(3), None, &LIMITS),
            Some((S(78), Expiry::Close("idle")))
        );
        assert_eq!(deadline(Phase::Busy, S(4), None, &LIMITS), None);
    }

    #[test]
    fn a_stalled_answer_has_the_send_limit_in_any_phase_unless_it_is_off() {
        assert_eq!(
            deadline(Phase::Busy, S(4), Some(S(5)), &LIMITS),
            Some((S(65), Expiry::Close("send")))
        );
        // Its last bytes still flushing after the answer ended: the earlier limit wins.
        assert_eq!(
            deadline(Phase::Idle, S(4), Some(S(5)), &LIMITS),
            Some((S(65), Expiry::Close("send")))
        );
        assert_eq!(
            deadline(Phase::Idle, S(4), Some(S(30)), &LIMITS),
            Some((S(79), Expiry::Close("idle")))
        );
        let off = Limits {
            send_timeout: None,
            ..LIMITS
        };
        assert_eq!(deadline(Phase::Busy, S(4), Some(S(5)), &off), None);
    }

    #[test]
    fn a_stall_begins_at_the_first_refused_write_and_ends_at_a_taken_one() {
        let s = ConnState::new(Instant::now());
        assert_eq!(s.stalled(), None);
        s.write_refused();
        let began = s.stalled().expect("a stall");
        std::thread::sleep(Duration::from_millis(2));
        s.write_refused(); // still the same stall
        assert_eq!(s.stalled(), Some(began));
        s.write_taken();
        assert_eq!(s.stalled(), None);
    }

    #[test]
    fn the_oldest_unfinished_head_is_shed_never_a_served_connection() {
        let states = [
            (Phase::Busy, S(1)),
            (Phase::Head, S(5)),
            (Phase::Idle, S(2)),
            (Phase::Fresh, S(4)),
        ];
        assert_eq!(shed_candidate(states.into_iter()), Some(3));
        let served = [(Phase::Busy, S(1)), (Phase::Idle, S(2))];
        assert_eq!(shed_candidate(served.into_iter()), None);
        // A lingering connection goes first, however young.
        let lingering = [(Phase::Fresh, S(1)), (Phase::Lingering, S(9))];
        assert_eq!(shed_candidate(lingering.into_iter()), Some(1));
        assert_eq!(deadline(Phase::Lingering, S(1), Some(S(1)), &LIMITS), None);
    }

    #[test]
    fn bytes_start_a_head_only_between_requests() {
        let s = ConnState::new(Instant::now());
        s.bytes_arrived();
        assert_eq!(s.phase().0, Phase::Head);
        s.request_started();
        s.bytes_arrived(); // a pipelined head while busy: still busy
        assert_eq!(s.phase().0, Phase::Busy);
        s.answer_ended();
        assert_eq!(s.phase().0, Phase::Idle);
        s.bytes_arrived();
        assert_eq!(s.phase().0, Phase::Head);
    }

    #[test]
    fn the_registry_sheds_the_oldest_head_once_and_never_a_served_connection() {
        let r = Registry::default();
        let (_, served) = r.open();
        served.request_started();
        let (_, waiting) = r.open();
        assert!(r.shed_one());
        assert!(waiting.shed.load(Ordering::Relaxed));
        assert!(!served.shed.load(Ordering::Relaxed));
        assert!(!r.shed_one()); // the shed one is not picked twice
        assert_eq!(r.len(), 2);
    }
}
