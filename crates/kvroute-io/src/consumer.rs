//! The router's KV-event consumer: one thread owns every worker's sockets, follows each
//! stream's sequence with the core's [`SequenceTracker`], decodes batches with the core's codec
//! and applies them to the shared KV index, so no batch wakes Python.
//!
//! One message vLLM publishes is the multipart `[topic, seq (8 bytes, big-endian), payload]`
//! on a PUB socket; its replay side is a ROUTER that answers a DEALER's `[b"", start seq]` with
//! `[b"", (topic,) seq, payload]` per buffered batch and an end marker of seq −1 (see
//! `vllm/distributed/kv_events.py` and `docs/vllm.md`). Per stream the thread does what the
//! tracker says:
//!
//! * **catch-up** on subscribing: the engine's whole buffer is replayed before any live batch,
//!   so a router started beside idle engines knows their caches at once;
//! * a **gap** asks the replay socket for the missing batches; the stream's live connections
//!   are not read meanwhile (the tracker wants the answer first; the kernel's and the
//!   publisher's queues hold what comes), the other streams are;
//! * a **restart**, a **failed replay** or a **malformed** batch reset the worker's entries in
//!   the index (what it stored or removed meanwhile is unknown);
//! * **duplicates** (a replay ahead of the live stream) are skipped.
//!
//! The thread speaks ZeroMQ's wire protocol itself ([`crate::zmtp`], ZMTP 3.0 with the NULL
//! mechanism) over non-blocking TCP and Unix sockets, as a SUB towards the engine's PUB and a
//! DEALER towards its replay ROUTER: there is no libzmq I/O thread, which woke once per TCP
//! segment (one per batch: ~17 µs of CPU each on a shared VM, more than decoding and applying
//! it). The thread blocks in `poll` while every stream is idle; once batches come it takes
//! what every socket holds, applies all of it under one lock of the index, and then sleeps
//! the gathering window (`coalesce`) before it looks again, so a busy fleet costs one wake-up
//! per window, not one per batch. That wake-up is the floor of the thread's cost (a bare 2 ms
//! sleep costs ~18 µs of CPU on the shared VM, see `bench_wake_floor`), so a gathering turn
//! whose streams are all in traffic skips the poll and reads each connection at once. What
//! libzmq did for the old consumer it does too: connect without blocking and reconnect,
//! backing off (an engine that dies or restarts is followed again when it is back; the
//! tracker sees the restart or the gap), bind and accept several publishers (`bind`), and
//! bound its memory (a message over [`MAX_MESSAGE`] bytes or a framing error is counted as
//! malformed and its connection reset). Replays never block the thread either: a replay's
//! connection is polled with the live ones, with a deadline per awaited message
//! (`replay_timeout`).
//!
//! Python is woken only for what it must see: the rare conditions above, as [`Notice`]s for its
//! log (and, in outbox mode, every item, for `kvroute.kvevents.KVEventSubscriber`), through a
//! socket pair whose read end it watches. Counters ([`CounterSnapshot`]) are atomics read when
//! `/metrics` is scraped.
//!
//! The index is shared as `Arc<Mutex<KvIndex>>` ([`SharedIndex`]): this thread locks it once
//! per turn to apply what the turn decoded (decoding happens outside the lock), the routing
//! step once per decision. A decision waits at most for one turn's applies (a few batches);
//! a channel of batches drained by the routing step would instead put every apply on the
//! request path and grow without bound while no request comes.
//!
//! Shutdown is bounded: the thread never blocks outside `poll` (whose timeout it sets) and the
//! gathering sleep, and [`Consumer::close`] waits for it at most the time it is given.

use std::collections::{HashMap, VecDeque};
use std::io::{self, ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvroute_core::index::{KvIndex, WorkerId};
use kvroute_core::kvevents::codec::{self, DecodedBatch};
use kvroute_core::kvevents::sequence::{self, Action, SequenceTracker};
use rustix::event::{PollFd, PollFlags, Timespec};
use rustix::net::SendFlags;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::zmtp::{Codec, Event, Message, ProtocolError, SocketType};

/// The KV index shared by the consumer thread (writes) and the routing step (look-ups).
pub type SharedIndex = Arc<Mutex<KvIndex>>;

/// Lock the shared index. A panic while it was held (a bug) does not make the router stop
/// routing: the lock is taken anyway.
pub fn lock_index(index: &SharedIndex) -> MutexGuard<'_, KvIndex> {
    index.lock().unwrap_or_else(PoisonError::into_inner)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The longest message a connection may carry, in bytes: far above a batch of vLLM's (a
/// 128k-token prefill stores ~0.6 MB), so only a broken or hostile peer reaches it; the
/// connection is then reset (memory stays bounded by this per connection).
pub const MAX_MESSAGE: usize = 64 << 20;
/// Bytes taken from one connection per turn of the loop, so one busy stream cannot starve the
/// others (poll is level-triggered: the rest is taken on the next turn, without the gathering
/// sleep).
const BYTES_PER_TURN: usize = 1 << 20;
/// Batches one replay may bring (vLLM buffers 10,000 steps by default).
const MAX_REPLAYED: usize = 1_000_000;
/// Payload bytes one replay may bring.
const MAX_REPLAYED_BYTES: usize = 1 << 30;
/// Items the outbox may hold before outbox-mode streams stop being read (the kernel's and the
/// publisher's queues then fill and the publisher drops, which the tracker sees as gaps): a
/// consumer nobody reads stays bounded.
const OUTBOX_LIMIT: usize = 100_000;
/// How often a loop with paused streams looks whether the outbox drained.
const PAUSED_POLL: Duration = Duration::from_millis(20);
/// Wait before reconnecting a lost or refused live connection: libzmq's default
/// `ZMQ_RECONNECT_IVL`, so an engine back from a quick restart is followed again within
/// 0.1 s (batches it publishes before the subscription arrives are dropped by its PUB; the
/// tracker sees the restart from the first one that comes, and replays the rest).
const RECONNECT_IVL: Duration = Duration::from_millis(100);
/// Failed attempts at [`RECONNECT_IVL`] before the wait doubles per attempt, up to
/// [`RECONNECT_MAX`] (an engine that stays away is not dialled 10 times a second for ever);
/// a handshake starts again from the first.
const RECONNECT_QUICK_ATTEMPTS: u32 = 20;
/// Longest wait between two attempts to reconnect.
const RECONNECT_MAX: Duration = Duration::from_secs(2);
/// Wait before a replay's next connection attempt (within its deadline).
const REPLAY_RETRY: Duration = Duration::from_millis(50);
/// Publishers one bound stream accepts at once (more are closed on arrival).
const MAX_ACCEPTED: usize = 64;
/// The replay stream's end marker: seq −1 as a signed 8-byte big-endian integer.
const END_SEQ: [u8; 8] = [0xff; 8];

/// Where one engine's KV events come from, and how to follow them.
#[derive(Clone, Debug)]
pub struct Subscription {
    /// The engine's PUB address (connected), or the address to bind (`bind`).
    pub endpoint: String,
    /// The engine's replay ROUTER address; None: gaps cannot be repaired.
    pub replay_endpoint: Option<String>,
    /// Subscription prefix (vLLM's `topic`; empty for all).
    pub topic: Vec<u8>,
    /// Bind the SUB socket instead of connecting it (engines with an explicit-host endpoint
    /// connect to the subscriber).
    pub bind: bool,
    /// Longest wait for each message of a replay.
    pub replay_timeout: Duration,
    /// Replay the engine's buffer before any live batch.
    pub catch_up: bool,
}

/// What happened on a stream, as the outbox hands it over.
#[derive(Debug)]
pub enum Item {
    /// A decoded batch; `replayed` if it came from the replay socket.
    Batch {
        /// Its sequence number.
        seq: u64,
        /// The decoded payload.
        batch: DecodedBatch,
        /// True if it came from the replay socket.
        replayed: bool,
    },
    /// Live `got` arrived while `expected` was next; a replay attempt follows.
    Gap {
        /// The seq that should have come.
        expected: u64,
        /// The seq that came.
        got: u64,
    },
    /// Batches `expected..got` are lost for good (the worker's entries were reset).
    ReplayFailed {
        /// First lost seq.
        expected: u64,
        /// First seq after the loss.
        got: u64,
        /// Why the replay could not fill the gap.
        reason: String,
    },
    /// The sequence went back: a new engine process (the worker's entries were reset).
    Restarted {
        /// The last seq handed over before, if any.
        last_seq: Option<u64>,
        /// The new process's first seq seen.
        new_seq: u64,
    },
    /// A message that could not be decoded (the worker's entries were reset); `seq` is None
    /// when even its framing was wrong.
    Malformed {
        /// Its seq, when the framing was right.
        seq: Option<u64>,
        /// What was wrong.
        error: String,
    },
    /// The consumer thread stopped on a bug (a panic); no stream is followed any more.
    Crashed {
        /// The panic's message.
        error: String,
    },
}

/// An [`Item`] of one worker's stream.
#[derive(Debug)]
pub struct Notice {
    /// The worker's name (as given to [`Consumer::add_worker`]).
    pub worker: String,
    /// What happened.
    pub item: Item,
}

/// Cumulative counts of one worker's stream (the router's `kvroute_router_kv_*` metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    /// Batches decoded and delivered.
    pub batches: u64,
    /// Events of known types in them.
    pub events: u64,
    /// Events of unknown types skipped.
    pub unknown_events: u64,
    /// Batches that could not be decoded, or messages with wrong framing.
    pub malformed: u64,
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Gaps the replay could not fill.
    pub replay_failures: u64,
    /// Sequence restarts (new engine processes).
    pub restarts: u64,
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    events: AtomicU64,
    unknown_events: AtomicU64,
    malformed: AtomicU64,
    gaps: AtomicU64,
    replay_failures: AtomicU64,
    restarts: AtomicU64,
}

impl Counters {
    fn snapshot(&self) -> CounterSnapshot {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            batches: get(&self.batches),
            events: get(&self.events),
            unknown_events: get(&self.unknown_events),
            malformed: get(&self.malformed),
            gaps: get(&self.gaps),
            replay_failures: get(&self.replay_failures),
            restarts: get(&self.restarts),
        }
    }
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// What the thread and the handle share.
struct Shared {
    /// Notices for Python, oldest first.
    outbox: Mutex<VecDeque<Notice>>,
    /// Write end of the bell: one byte when the outbox stops being empty.
    bell: UnixStream,
    /// Every followed worker's counters.
    counters: Mutex<HashMap<String, Arc<Counters>>>,
}

impl Shared {
    fn post(&self, notice: Notice) {
        let mut outbox = lock(&self.outbox);
        let was_empty = outbox.is_empty();
        outbox.push_back(notice);
        drop(outbox);
        if was_empty {
            // Non-blocking: a full socket buffer already holds a wake-up.
            let _ = (&self.bell).write(&[1]);
        }
    }

    fn outbox_full(&self) -> bool {
        lock(&self.outbox).len() >= OUTBOX_LIMIT
    }
}

enum Command {
    Add {
        worker: String,
        live: LiveSource,
        subscription: Subscription,
        counters: Arc<Counters>,
    },
    Remove {
        worker: String,
    },
    Stop,
}

/// The consumer: a handle on its thread. Workers are added and removed by name; the thread
/// runs until [`Consumer::close`] (or the handle is dropped).
pub struct Consumer {
    commands: mpsc::Sender<Command>,
    /// The handle's end of the thread's wake-up pipe: a byte wakes the thread.
    wake: UnixStream,
    thread: Mutex<Option<(JoinHandle<()>, mpsc::Receiver<()>)>>,
    shared: Arc<Shared>,
    /// Read end of the bell (see [`Consumer::notice_fd`]).
    bell: UnixStream,
}

impl Consumer {
    /// Start the thread. With an index, every stream's batches are applied to it and only the
    /// conditions that reset a worker are posted as notices (for the log); without one, every
    /// item is posted (the outbox mode of `KVEventSubscriber`).
    ///
    /// `coalesce`: after a turn that took messages (and left none waiting), the thread sleeps
    /// this long before polling again, so the batches of several engine steps are taken in
    /// one wake-up. Waking costs ~20 µs of CPU on a shared 2-core VM against ~2 µs to decode
    /// and apply a batch; a couple of milliseconds more before the index has a batch matters
    /// little beside an engine step (and the predicted entries bridge it). Zero: poll again
    /// at once.
    pub fn start(index: Option<SharedIndex>, coalesce: Duration) -> io::Result<Self> {
        let (control, wake) = UnixStream::pair()?;
        control.set_nonblocking(true)?;
        wake.set_nonblocking(true)?;
        let (bell_read, bell_write) = UnixStream::pair()?;
        bell_read.set_nonblocking(true)?;
        bell_write.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            outbox: Mutex::new(VecDeque::new()),
            bell: bell_write,
            counters: Mutex::new(HashMap::new()),
        });
        let (commands, receiver) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let mut state = Loop {
            control,
            commands: receiver,
            streams: Vec::new(),
            shared: shared.clone(),
            index,
            actions: Vec::new(),
            coalesce,
        };
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("kvroute-kv-events".into())
            .spawn(move || {
                let outcome = catch_unwind(AssertUnwindSafe(|| state.run()));
                drop(state); // closes every socket before saying it is done
                if let Err(panic) = outcome {
                    let error = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "unknown panic".into());
                    thread_shared.post(Notice {
                        worker: String::new(),
                        item: Item::Crashed { error },
                    });
                }
                let _ = done_tx.send(());
            })?;
        Ok(Self {
            commands,
            wake,
            thread: Mutex::new(Some((thread, done_rx))),
            shared,
            bell: bell_read,
        })
    }

    fn ring(&self) {
        // Non-blocking: a full pipe means the thread has wake-ups pending already.
        let _ = (&self.wake).write(&[1]);
    }

    /// Follow `worker`'s stream (replacing a stream of that name). The address is checked
    /// here, and a bound one bound here, so a malformed or taken address fails at once;
    /// returns its address (the bound one, port resolved, when binding). Connecting happens on
    /// the thread, and is retried while the engine is not there.
    pub fn add_worker(&self, worker: &str, subscription: Subscription) -> Result<String, String> {
        let fail = |e: String| format!("cannot subscribe to {}: {e}", subscription.endpoint);
        let address = Address::parse(&subscription.endpoint, subscription.bind).map_err(fail)?;
        if let Some(replay) = &subscription.replay_endpoint {
            Address::parse(replay, false)
                .map_err(|e| format!("bad replay endpoint {replay}: {e}"))?;
        }
        let (live, endpoint) = if subscription.bind {
            let listener = Listener::bind(&address).map_err(|e| fail(e.to_string()))?;
            let endpoint = listener.endpoint.clone();
            (LiveSource::Listen(listener), endpoint)
        } else {
            (LiveSource::Dial(address), subscription.endpoint.clone())
        };
        let counters = Arc::new(Counters::default());
        lock(&self.shared.counters).insert(worker.to_string(), counters.clone());
        let command = Command::Add {
            worker: worker.to_string(),
            live,
            subscription,
            counters,
        };
        self.commands
            .send(command)
            .map_err(|_| "the KV event consumer has stopped".to_string())?;
        self.ring();
        Ok(endpoint)
    }

    /// Stop following `worker` (its sockets close; in index mode its entries are dropped
    /// after its last batch, so no late batch brings it back).
    pub fn remove_worker(&self, worker: &str) {
        lock(&self.shared.counters).remove(worker);
        let _ = self.commands.send(Command::Remove {
            worker: worker.to_string(),
        });
        self.ring();
    }

    /// The counts of every followed worker, by name.
    pub fn counters(&self) -> Vec<(String, CounterSnapshot)> {
        lock(&self.shared.counters)
            .iter()
            .map(|(name, c)| (name.clone(), c.snapshot()))
            .collect()
    }

    /// A descriptor that becomes readable when notices are waiting (watch it, then call
    /// [`Consumer::take_notices`]).
    pub fn notice_fd(&self) -> RawFd {
        self.bell.as_raw_fd()
    }

    /// The notices posted since the last call, oldest first.
    pub fn take_notices(&self) -> Vec<Notice> {
        // The bell first: a notice posted after this read rings it again.
        drain_pipe(&self.bell);
        lock(&self.shared.outbox).drain(..).collect()
    }

    /// Stop the thread, waiting at most `timeout`; true if it stopped in time. Idempotent.
    /// A thread that did not stop in time (it never should: it blocks only in a poll it
    /// bounds) is left to finish on its own.
    pub fn close(&self, timeout: Duration) -> bool {
        let Some((thread, done)) = lock(&self.thread).take() else {
            return true;
        };
        let _ = self.commands.send(Command::Stop);
        self.ring();
        match done.recv_timeout(timeout) {
            Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => {
                let _ = thread.join();
                true
            }
            Err(mpsc::RecvTimeoutError::Timeout) => false,
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.close(Duration::from_secs(2));
    }
}

/// Read a non-blocking pipe empty.
fn drain_pipe(mut pipe: &UnixStream) {
    let mut buf = [0u8; 256];
    loop {
        match pipe.read(&mut buf) {
            Ok(n) if n > 0 => continue,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            _ => break,
        }
    }
}

// --- addresses and connections -------------------------------------------------------------

/// A ZeroMQ endpoint this consumer can reach: `tcp://HOST:PORT` (HOST an IPv4 address, `[IPv6]`,
/// a name, or `*` when binding; PORT `*` or 0 when binding picks a free one) or `ipc://PATH`
/// (a Unix socket). `inproc://` is one libzmq process's own and cannot be reached from here.
#[derive(Clone, Debug)]
enum Address {
    Tcp { host: String, port: u16 },
    Ipc(PathBuf),
}

impl Address {
    fn parse(endpoint: &str, bind: bool) -> Result<Self, String> {
        if let Some(rest) = endpoint.strip_prefix("tcp://") {
            let (host, port) = rest
                .rsplit_once(':')
                .ok_or_else(|| "expected tcp://HOST:PORT".to_string())?;
            let host = host
                .strip_prefix('[')
                .and_then(|h| h.strip_suffix(']'))
                .unwrap_or(host);
            if host.is_empty() {
                return Err("expected tcp://HOST:PORT".into());
            }
            let host = match host {
                "*" if bind => "0.0.0.0",
                "*" => return Err("a wildcard host can only be bound".into()),
                h => h,
            };
            let port = match port {
                "*" if bind => 0,
                p => p.parse::<u16>().map_err(|_| format!("bad port {p:?}"))?,
            };
            if port == 0 && !bind {
                return Err("port 0 can only be bound".into());
            }
            return Ok(Self::Tcp {
                host: host.to_string(),
                port,
            });
        }
        if let Some(path) = endpoint.strip_prefix("ipc://") {
            if path.is_empty() || path == "*" || path.starts_with('@') {
                return Err("expected ipc://PATH (a file path)".into());
            }
            return Ok(Self::Ipc(PathBuf::from(path)));
        }
        if endpoint.starts_with("inproc://") {
            return Err("inproc:// is within one process; use tcp:// or ipc://".into());
        }
        Err("expected tcp://HOST:PORT or ipc://PATH".into())
    }

    /// The socket address to use: a literal host as it is, a name resolved (the first IPv4
    /// address, else the first; libzmq resolves on its I/O thread the same way).
    fn resolve(&self) -> io::Result<(SockAddr, Domain)> {
        match self {
            Self::Tcp { host, port } => {
                let addr = match host.parse::<IpAddr>() {
                    Ok(ip) => SocketAddr::new(ip, *port),
                    Err(_) => {
                        let all: Vec<SocketAddr> =
                            (host.as_str(), *port).to_socket_addrs()?.collect();
                        all.iter()
                            .find(|a| a.is_ipv4())
                            .or(all.first())
                            .copied()
                            .ok_or_else(|| io::Error::other(format!("{host} has no address")))?
                    }
                };
                Ok((addr.into(), Domain::for_address(addr)))
            }
            Self::Ipc(path) => Ok((SockAddr::unix(path)?, Domain::UNIX)),
        }
    }

    fn socket(domain: Domain) -> io::Result<Socket> {
        let protocol = (domain != Domain::UNIX).then_some(Protocol::TCP);
        let socket = Socket::new(domain, Type::STREAM, protocol)?;
        socket.set_nonblocking(true)?;
        if domain != Domain::UNIX {
            socket.set_tcp_nodelay(true)?;
        }
        Ok(socket)
    }

    /// Start connecting without blocking.
    fn connect(&self, kind: SocketType) -> io::Result<Conn> {
        let (addr, domain) = self.resolve()?;
        let socket = Self::socket(domain)?;
        let connected = match socket.connect(&addr) {
            Ok(()) => true,
            Err(e)
                if e.raw_os_error() == Some(rustix::io::Errno::INPROGRESS.raw_os_error())
                    || e.kind() == ErrorKind::WouldBlock =>
            {
                false
            }
            Err(e) => return Err(e),
        };
        Ok(Conn {
            socket,
            codec: Codec::new(kind, MAX_MESSAGE),
            connected,
        })
    }
}

/// A bound SUB side: publishers connect to it (vLLM connects when its endpoint names a host).
struct Listener {
    socket: Socket,
    /// Its address, port resolved.
    endpoint: String,
    /// The Unix socket's file, removed on close (as libzmq does).
    path: Option<PathBuf>,
}

impl Listener {
    fn bind(address: &Address) -> io::Result<Self> {
        let (addr, domain) = address.resolve()?;
        let socket = Address::socket(domain)?;
        let path = match address {
            Address::Ipc(path) => {
                // A file left by an earlier run would refuse the bind (libzmq removes it too).
                let _ = std::fs::remove_file(path);
                Some(path.clone())
            }
            Address::Tcp { .. } => {
                socket.set_reuse_address(true)?;
                None
            }
        };
        socket.bind(&addr)?;
        socket.listen(128)?;
        let endpoint = match (&path, socket.local_addr()?.as_socket()) {
            (Some(path), _) => format!("ipc://{}", path.display()),
            (None, Some(SocketAddr::V6(a))) => format!("tcp://[{}]:{}", a.ip(), a.port()),
            (None, Some(a)) => format!("tcp://{a}"),
            (None, None) => return Err(io::Error::other("no local address")),
        };
        Ok(Self {
            socket,
            endpoint,
            path,
        })
    }

    /// The next publisher waiting to be accepted, if any.
    fn accept(&self) -> io::Result<Option<Conn>> {
        match self.socket.accept() {
            Ok((socket, _)) => {
                socket.set_nonblocking(true)?;
                if self.path.is_none() {
                    socket.set_tcp_nodelay(true)?;
                }
                Ok(Some(Conn {
                    socket,
                    codec: Codec::new(SocketType::Sub, MAX_MESSAGE),
                    connected: true,
                }))
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
            Err(e) if e.kind() == ErrorKind::Interrupted => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Some(path) = &self.path {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// How a stream's live side is reached.
enum LiveSource {
    /// Connect to the engine's PUB (and reconnect when the connection is lost).
    Dial(Address),
    /// Accept the engines' PUB connections.
    Listen(Listener),
}

/// One connection: a non-blocking socket and its ZMTP state.
struct Conn {
    socket: Socket,
    codec: Codec,
    /// False while a non-blocking connect is under way.
    connected: bool,
}

/// What one read found.
enum ReadOutcome {
    /// It filled the space offered: more may be waiting.
    Full,
    /// The socket has nothing more now.
    Drained,
}

impl Conn {
    /// The poll flags it needs: writable while connecting or while bytes wait to go,
    /// readable if `read` (errors and hang-ups are always reported).
    fn interest(&self, read: bool) -> PollFlags {
        if !self.connected {
            return PollFlags::OUT;
        }
        let mut flags = PollFlags::empty();
        if read {
            flags |= PollFlags::IN;
        }
        if !self.codec.outgoing().is_empty() {
            flags |= PollFlags::OUT;
        }
        flags
    }

    /// A connect under way finished (the socket became writable): Ok if it succeeded.
    fn finish_connect(&mut self) -> io::Result<()> {
        if let Some(error) = self.socket.take_error()? {
            return Err(error);
        }
        self.socket.peer_addr()?;
        self.connected = true;
        Ok(())
    }

    /// Write what the codec queued, as far as the socket takes it now.
    fn flush(&mut self) -> io::Result<()> {
        while self.connected && !self.codec.outgoing().is_empty() {
            match rustix::net::send(&self.socket, self.codec.outgoing(), SendFlags::NOSIGNAL) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => self.codec.sent(n),
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// One read into the codec's buffer; counts the bytes against `budget`.
    fn read_once(&mut self, budget: &mut usize) -> io::Result<ReadOutcome> {
        loop {
            let space = self.codec.read_space();
            let offered = space.len();
            match (&self.socket).read(space) {
                Ok(0) => {
                    return Err(io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "the peer closed the connection",
                    ));
                }
                Ok(n) => {
                    self.codec.filled(n);
                    *budget = budget.saturating_sub(n);
                    return Ok(if n == offered {
                        ReadOutcome::Full
                    } else {
                        ReadOutcome::Drained
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(ReadOutcome::Drained),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }
}

/// Why a connection is closed.
enum Closed {
    /// A socket error or the peer's close: reconnect, nothing to count.
    Io(io::Error),
    /// The peer broke the protocol: counted as malformed, the worker reset, then reconnect.
    Protocol(ProtocolError),
}

impl From<io::Error> for Closed {
    fn from(e: io::Error) -> Self {
        Self::Io(e)
    }
}

impl From<ProtocolError> for Closed {
    fn from(e: ProtocolError) -> Self {
        Self::Protocol(e)
    }
}

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Io(e) => write!(f, "{e}"),
            Self::Protocol(e) => write!(f, "{e}"),
        }
    }
}

// --- the thread ----------------------------------------------------------------------------

/// Why a replay was asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Purpose {
    CatchUp,
    Gap,
}

/// A replay in progress: its DEALER connection (None between two connection attempts), what
/// it brought so far, and when it gives up.
struct Replay {
    endpoint: String,
    address: Address,
    /// The first seq asked for.
    from: u64,
    conn: Option<Conn>,
    /// When to try connecting again (a refused or lost connection before any answer).
    retry_at: Option<Instant>,
    purpose: Purpose,
    received: Vec<(u64, Vec<u8>)>,
    received_bytes: usize,
    /// The longest wait for each message.
    timeout: Duration,
    deadline: Instant,
}

/// How a replay stands after its connection was serviced.
enum Progress {
    Pending,
    Ended,
    Failed(String),
}

impl Replay {
    /// Connect (a fresh connection per request: a late answer to a timed-out request can never
    /// be taken for the next one's) and queue the request `[b"", from]`.
    fn connect(&mut self, now: Instant) {
        self.retry_at = None;
        match self.address.connect(SocketType::Dealer) {
            Ok(mut conn) => {
                conn.codec.send_message(&[b"", &self.from.to_be_bytes()]);
                match conn.flush() {
                    Ok(()) => self.conn = Some(conn),
                    Err(_) => self.retry_at = Some(now + REPLAY_RETRY),
                }
            }
            Err(_) => self.retry_at = Some(now + REPLAY_RETRY),
        }
    }

    /// The connection went: try again if nothing came yet (the engine may be starting), else
    /// the replay failed.
    fn lost(&mut self, error: &io::Error, now: Instant) -> Progress {
        self.conn = None;
        if self.received.is_empty() {
            self.retry_at = Some(now + REPLAY_RETRY);
            Progress::Pending
        } else {
            Progress::Failed(format!("replay endpoint {}: {error}", self.endpoint))
        }
    }

    fn service(&mut self, revents: PollFlags, now: Instant) -> Progress {
        let Some(conn) = self.conn.as_mut() else {
            return Progress::Pending;
        };
        if !conn.connected {
            if !revents.intersects(PollFlags::OUT | PollFlags::ERR | PollFlags::HUP) {
                return Progress::Pending;
            }
            if let Err(error) = conn.finish_connect() {
                return self.lost(&error, now);
            }
        }
        if let Err(error) = conn.flush() {
            return self.lost(&error, now);
        }
        if !revents.intersects(PollFlags::IN | PollFlags::ERR | PollFlags::HUP) {
            return Progress::Pending;
        }
        let mut budget = 4 * BYTES_PER_TURN;
        loop {
            let outcome = match conn.read_once(&mut budget) {
                Ok(outcome) => outcome,
                Err(error) => return self.lost(&error, now),
            };
            loop {
                let message = match conn.codec.next_event() {
                    Ok(None) => break,
                    Ok(Some(Event::Ready { .. })) => continue,
                    Ok(Some(Event::Message(message))) => message,
                    Err(error) => {
                        return Progress::Failed(format!(
                            "replay endpoint {}: {error}",
                            self.endpoint
                        ));
                    }
                };
                match take_reply(message) {
                    Ok(Some((seq, payload))) => {
                        self.received_bytes += payload.len();
                        self.received.push((seq, payload.to_vec()));
                        if self.received.len() > MAX_REPLAYED
                            || self.received_bytes > MAX_REPLAYED_BYTES
                        {
                            return Progress::Failed(format!(
                                "replay endpoint {}: more than {MAX_REPLAYED} batches or \
                                 {MAX_REPLAYED_BYTES} bytes",
                                self.endpoint
                            ));
                        }
                        self.deadline = now + self.timeout;
                    }
                    Ok(None) => return Progress::Ended,
                    Err(reason) => return Progress::Failed(reason),
                }
            }
            // What the greeting released (READY, the request), PONGs.
            if let Err(error) = conn.flush() {
                return self.lost(&error, now);
            }
            if matches!(outcome, ReadOutcome::Drained) || budget == 0 {
                return Progress::Pending;
            }
        }
    }
}

/// One replayed batch `(seq, payload)`, or None for the end marker. Current vLLM sends
/// `[b"", topic, seq, payload]`; before the topic frame was added, `[b"", seq, payload]`. The
/// end marker has seq −1 and an empty payload in both.
fn take_reply(message: Message<'_>) -> Result<Option<(u64, &[u8])>, String> {
    let n = message.len();
    if !(n == 3 || n == 4) || !message.frame(0).is_empty() || message.frame(n - 2).len() != 8 {
        return Err(format!("unexpected replay reply of {n} frames"));
    }
    if message.frame(n - 2) == END_SEQ {
        return Ok(None);
    }
    let seq = sequence::parse_seq(message.frame(n - 2)).expect("8 bytes");
    Ok(Some((seq, message.frame(n - 1))))
}

/// What the index must do for one stream, in order, at the end of the turn (under one lock
/// for every stream).
enum IndexOp {
    Apply(DecodedBatch),
    Reset,
}

/// Where one stream's items go.
struct Sink {
    worker: String,
    index: Option<SharedIndex>,
    counters: Arc<Counters>,
    shared: Arc<Shared>,
    /// Index mode: what this turn decoded, applied at its end.
    pending: Vec<IndexOp>,
    /// The worker's id in the index and the index's epoch it was resolved at (ids stay
    /// valid while the epoch does): no look-up by name per batch.
    id: Option<(u64, WorkerId)>,
}

impl Sink {
    fn post(&self, item: Item) {
        self.shared.post(Notice {
            worker: self.worker.clone(),
            item,
        });
    }

    /// Decode and deliver batch `seq`: queue it for the index (index mode) or post it.
    fn deliver(&mut self, seq: u64, payload: &[u8], replayed: bool) {
        match codec::decode_batch(payload) {
            Ok(batch) => {
                let c = &self.counters;
                bump(&c.batches, 1);
                bump(&c.events, batch.events.len() as u64);
                bump(&c.unknown_events, batch.unknown_events as u64);
                if self.index.is_some() {
                    self.pending.push(IndexOp::Apply(batch));
                } else {
                    self.post(Item::Batch {
                        seq,
                        batch,
                        replayed,
                    });
                }
            }
            Err(error) => self.malformed(Some(seq), error.0),
        }
    }

    /// Do what this turn queued to `index`.
    fn apply(&mut self, index: &mut KvIndex) {
        for op in self.pending.drain(..) {
            match op {
                IndexOp::Apply(batch) => {
                    let id = match self.id {
                        Some((epoch, id)) if epoch == index.epoch() => id,
                        _ => {
                            let id = index.ensure_worker(&self.worker);
                            self.id = Some((index.epoch(), id));
                            id
                        }
                    };
                    index.apply_to(id, &batch.events);
                }
                IndexOp::Reset => index.reset_worker(&self.worker),
            }
        }
    }

    fn reset(&mut self) {
        if self.index.is_some() {
            // What was queued before is superseded.
            self.pending.clear();
            self.pending.push(IndexOp::Reset);
        }
    }

    fn gap(&self, expected: u64, got: u64) {
        bump(&self.counters.gaps, 1);
        if self.index.is_none() {
            self.post(Item::Gap { expected, got });
        }
    }

    fn replay_failed(&mut self, expected: u64, got: u64, reason: String) {
        bump(&self.counters.replay_failures, 1);
        self.reset();
        self.post(Item::ReplayFailed {
            expected,
            got,
            reason,
        });
    }

    fn restarted(&mut self, last_seq: Option<u64>, new_seq: u64) {
        bump(&self.counters.restarts, 1);
        self.reset();
        self.post(Item::Restarted { last_seq, new_seq });
    }

    fn malformed(&mut self, seq: Option<u64>, error: String) {
        bump(&self.counters.malformed, 1);
        self.reset();
        self.post(Item::Malformed { seq, error });
    }
}

/// A live side that connects: where to, and when to try again.
struct Dialer {
    address: Address,
    retry_at: Option<Instant>,
    /// Attempts that failed since the last handshake.
    failures: u32,
}

impl Dialer {
    /// The wait before the next attempt, after `failures` failed ones.
    fn backoff(failures: u32) -> Duration {
        let doublings = failures.saturating_sub(RECONNECT_QUICK_ATTEMPTS).min(8);
        (RECONNECT_IVL * (1 << doublings)).min(RECONNECT_MAX)
    }
}

/// One engine's stream.
struct Stream {
    subscription: Subscription,
    tracker: SequenceTracker,
    sink: Sink,
    /// Live connections: the dialer's one, or the publishers a listener accepted.
    conns: Vec<Conn>,
    dialer: Option<Dialer>,
    listener: Option<Listener>,
    replay: Option<Replay>,
    /// The live payload that showed a gap, handed over once the replay answered.
    held: Option<Vec<u8>>,
    /// A replay ended this turn: the live bytes already buffered are taken again.
    resume: bool,
    /// The catch-up replay is still to be asked for (see [`Stream::start`]).
    catch_up_pending: bool,
}

/// A descriptor in one turn's poll set.
#[derive(Clone, Copy, Debug)]
enum Token {
    Control,
    Listener(usize),
    Live(usize, usize),
    Replay(usize),
}

impl Stream {
    /// Start following: forget what the index knew (a catch-up replays every store again),
    /// connect, and ask for the catch-up replay: at once when publishers connect to us, else
    /// once the live connection's handshake is done and its subscription sent. A replay asked
    /// before could be answered before the subscription reaches the engine, and a batch
    /// published in between would be in neither (found only when the next one shows the gap).
    fn start(&mut self, now: Instant) {
        self.sink.reset();
        self.catch_up_pending =
            self.subscription.catch_up && self.subscription.replay_endpoint.is_some();
        if self.dialer.is_some() {
            self.connect_live(now);
        } else {
            self.catch_up(now);
        }
    }

    /// Ask for the catch-up replay if it is still to be asked for.
    fn catch_up(&mut self, now: Instant) {
        if std::mem::take(&mut self.catch_up_pending) {
            // A replay that cannot even be asked for leaves everything to the live stream
            // (the tracker makes nothing of an empty catch-up).
            let _ = self.start_replay(0, Purpose::CatchUp, now);
        }
    }

    fn connect_live(&mut self, now: Instant) {
        let Some(dialer) = self.dialer.as_mut() else {
            return;
        };
        dialer.retry_at = None;
        match dialer.address.connect(SocketType::Sub) {
            Ok(mut conn) => {
                conn.codec.subscribe(&self.subscription.topic);
                match conn.flush() {
                    Ok(()) => self.conns.push(conn),
                    Err(_) => self.retry_later(now),
                }
            }
            Err(_) => self.retry_later(now),
        }
    }

    fn retry_later(&mut self, now: Instant) {
        if let Some(dialer) = self.dialer.as_mut() {
            dialer.failures = dialer.failures.saturating_add(1);
            dialer.retry_at = Some(now + Dialer::backoff(dialer.failures));
        }
    }

    /// Live connection `j` is closed: a protocol error resets the worker (its batches were
    /// lost with the framing); the dialer reconnects after its backoff.
    fn live_closed(&mut self, j: usize, why: Closed, now: Instant) {
        self.conns.remove(j);
        if let Closed::Protocol(error) = why {
            let endpoint = self.subscription.endpoint.clone();
            self.sink
                .malformed(None, format!("{endpoint}: {error}; connection reset"));
        }
        if self.conns.is_empty() {
            self.retry_later(now);
        }
    }

    fn poll_items<'a>(
        &'a self,
        i: usize,
        paused: bool,
        fds: &mut Vec<PollFd<'a>>,
        tokens: &mut Vec<Token>,
    ) {
        if let Some(listener) = &self.listener {
            fds.push(PollFd::new(&listener.socket, PollFlags::IN));
            tokens.push(Token::Listener(i));
        }
        if let Some(conn) = self.replay.as_ref().and_then(|r| r.conn.as_ref()) {
            fds.push(PollFd::new(&conn.socket, conn.interest(true)));
            tokens.push(Token::Replay(i));
        }
        // A handshake goes on during a replay (or a pause): only messages wait.
        let read = self.replay.is_none() && !paused;
        for (j, conn) in self.conns.iter().enumerate() {
            let flags = conn.interest(read || !conn.codec.is_ready());
            if !flags.is_empty() {
                fds.push(PollFd::new(&conn.socket, flags));
                tokens.push(Token::Live(i, j));
            }
        }
    }

    /// Nothing but live connections in traffic to read: no replay, no listener, no timer,
    /// no handshake or bytes to send (the gathering turn may read it without polling).
    fn steady(&self) -> bool {
        self.replay.is_none()
            && self.listener.is_none()
            && !self.conns.is_empty()
            && self
                .conns
                .iter()
                .all(|c| c.connected && c.codec.is_ready() && c.codec.outgoing().is_empty())
    }

    /// When a timer of this stream runs out (a reconnect, a replay's retry or deadline).
    fn next_deadline(&self) -> Option<Instant> {
        let reconnect = self
            .dialer
            .as_ref()
            .filter(|_| self.conns.is_empty())
            .and_then(|d| d.retry_at);
        let replay = self.replay.as_ref().map(|r| match r.retry_at {
            Some(retry) if r.conn.is_none() => retry.min(r.deadline),
            _ => r.deadline,
        });
        reconnect.into_iter().chain(replay).min()
    }

    fn on_timers(&mut self, now: Instant, actions: &mut Vec<Action>) {
        let reconnect = self
            .dialer
            .as_ref()
            .is_some_and(|d| d.retry_at.is_some_and(|t| t <= now));
        if reconnect && self.conns.is_empty() {
            self.connect_live(now);
        }
        let Some(replay) = self.replay.as_mut() else {
            return;
        };
        if replay.deadline <= now {
            let seconds = replay.timeout.as_secs_f64();
            let reason = format!(
                "no reply from replay endpoint {} within {seconds}s",
                replay.endpoint
            );
            self.finish_replay(actions, Some(reason), now);
        } else if replay.conn.is_none() && replay.retry_at.is_some_and(|t| t <= now) {
            replay.connect(now);
        }
    }

    fn accept_all(&mut self) {
        let Some(listener) = &self.listener else {
            return;
        };
        while let Ok(Some(mut conn)) = listener.accept() {
            if self.conns.len() >= MAX_ACCEPTED {
                continue; // closed at once
            }
            conn.codec.subscribe(&self.subscription.topic);
            if conn.flush().is_ok() {
                self.conns.push(conn);
            }
        }
    }

    /// Live connection `j` is ready (`revents`): finish its connect, send what waits, take
    /// what it holds (`budget` bytes at most). True if it may hold more.
    fn service_live(
        &mut self,
        j: usize,
        revents: PollFlags,
        budget: &mut usize,
        actions: &mut Vec<Action>,
    ) -> Result<bool, Closed> {
        if !self.conns[j].connected {
            if !revents.intersects(PollFlags::OUT | PollFlags::ERR | PollFlags::HUP) {
                return Ok(false);
            }
            self.conns[j].finish_connect()?;
        }
        self.conns[j].flush()?;
        if !revents.intersects(PollFlags::IN | PollFlags::ERR | PollFlags::HUP) {
            return Ok(false);
        }
        loop {
            if self.replay.is_some() && self.conns[j].codec.is_ready() {
                return Ok(false); // a gap: the live side waits for the replay's answer
            }
            let outcome = self.conns[j].read_once(budget)?;
            self.pump_live(j, actions)?;
            self.conns[j].flush()?; // PONGs
            match outcome {
                ReadOutcome::Drained => return Ok(false),
                ReadOutcome::Full if *budget == 0 => return Ok(true),
                ReadOutcome::Full => {}
            }
        }
    }

    /// Take the whole messages live connection `j` has buffered, until none is left or a gap
    /// starts a replay.
    fn pump_live(&mut self, j: usize, actions: &mut Vec<Action>) -> Result<(), ProtocolError> {
        loop {
            if self.replay.is_some() && self.conns[j].codec.is_ready() {
                return Ok(()); // the handshake's READY is taken, messages wait
            }
            let frames: Vec<Vec<u8>> = {
                let message = match self.conns[j].codec.next_event()? {
                    None => return Ok(()),
                    Some(Event::Ready { .. }) => {
                        if let Some(dialer) = self.dialer.as_mut() {
                            dialer.failures = 0;
                        }
                        // The subscription goes out with this turn's flush, ahead of the
                        // catch-up's request (whose connection has its handshake to do).
                        self.catch_up(Instant::now());
                        continue;
                    }
                    Some(Event::Message(message)) => message,
                };
                // A PUB filters by topic itself; this keeps a peer that does not from
                // feeding other topics in.
                if !message.frame(0).starts_with(&self.subscription.topic) {
                    continue;
                }
                // The fast path: the batch after the last one.
                if message.len() == 3
                    && let Some(seq) = sequence::parse_seq(message.frame(1))
                    && self.tracker.in_order(seq)
                {
                    self.sink.deliver(seq, message.frame(2), false);
                    continue;
                }
                message.frames().map(<[u8]>::to_vec).collect()
            };
            self.live_message(frames, actions);
        }
    }

    /// A live message off the fast path: what the tracker says of it.
    fn live_message(&mut self, mut frames: Vec<Vec<u8>>, actions: &mut Vec<Action>) {
        let payload = if frames.len() == 3 {
            let refs: [&[u8]; 3] = [&frames[0], &frames[1], &frames[2]];
            self.tracker.live_message(&refs, actions);
            frames.pop()
        } else {
            // Wrong framing (what the tracker says of it, without handing it every frame).
            actions.push(Action::MalformedFrames {
                frame_lengths: frames.iter().map(Vec::len).collect(),
            });
            None
        };
        self.follow(actions, payload.as_deref(), &[], Instant::now());
    }

    /// Take the live messages already buffered (after a replay ended); closes the
    /// connections whose bytes break the protocol.
    fn pump_all(&mut self, actions: &mut Vec<Action>, now: Instant) {
        let mut j = 0;
        while j < self.conns.len() {
            match self.pump_live(j, actions) {
                Ok(()) => j += 1,
                Err(error) => self.live_closed(j, Closed::Protocol(error), now),
            }
        }
    }

    /// Do what the tracker said (`actions`, drained): hand batches over, report conditions,
    /// start the replay it asks for.
    fn follow(
        &mut self,
        actions: &mut Vec<Action>,
        live: Option<&[u8]>,
        replayed: &[(u64, Vec<u8>)],
        now: Instant,
    ) {
        let mut replay_from = None;
        for action in actions.drain(..) {
            match action {
                Action::Live { seq } => {
                    self.sink
                        .deliver(seq, live.expect("a live action has its payload"), false)
                }
                Action::Replayed { seq, index } => self.sink.deliver(seq, &replayed[index].1, true),
                Action::Gap { expected, got } => self.sink.gap(expected, got),
                Action::Replay { from } => replay_from = Some(from),
                Action::ReplayFailed {
                    expected,
                    got,
                    reason,
                } => self.sink.replay_failed(expected, got, reason),
                Action::Restarted { last_seq, new_seq } => self.sink.restarted(last_seq, new_seq),
                Action::MalformedFrames { frame_lengths } => self.sink.malformed(
                    None,
                    format!("expected [topic, 8-byte seq, payload], got frames of {frame_lengths:?} bytes"),
                ),
            }
        }
        // The tracker's last action of a live message, when there is a gap.
        if let Some(from) = replay_from {
            self.held = live.map(<[u8]>::to_vec);
            if let Err(reason) = self.start_replay(from, Purpose::Gap, now) {
                self.finish_replay_with(actions, Purpose::Gap, Vec::new(), Some(reason), now);
            }
        }
    }

    /// Ask the replay socket for every buffered batch from `from` on.
    fn start_replay(&mut self, from: u64, purpose: Purpose, now: Instant) -> Result<(), String> {
        let Some(endpoint) = &self.subscription.replay_endpoint else {
            return Err("no replay endpoint configured".into());
        };
        let address = Address::parse(endpoint, false)
            .map_err(|e| format!("replay endpoint {endpoint}: {e}"))?;
        let mut replay = Replay {
            endpoint: endpoint.clone(),
            address,
            from,
            conn: None,
            retry_at: None,
            purpose,
            received: Vec::new(),
            received_bytes: 0,
            timeout: self.subscription.replay_timeout,
            deadline: now + self.subscription.replay_timeout,
        };
        replay.connect(now);
        self.replay = Some(replay);
        Ok(())
    }

    fn service_replay(&mut self, revents: PollFlags, actions: &mut Vec<Action>, now: Instant) {
        let Some(replay) = self.replay.as_mut() else {
            return;
        };
        match replay.service(revents, now) {
            Progress::Pending => {}
            Progress::Ended => self.finish_replay(actions, None, now),
            Progress::Failed(reason) => self.finish_replay(actions, Some(reason), now),
        }
    }

    fn finish_replay(&mut self, actions: &mut Vec<Action>, failure: Option<String>, now: Instant) {
        let replay = self.replay.take().expect("a replay is running");
        self.finish_replay_with(actions, replay.purpose, replay.received, failure, now);
    }

    /// The replay's answer to the tracker, and what it says to do.
    fn finish_replay_with(
        &mut self,
        actions: &mut Vec<Action>,
        purpose: Purpose,
        received: Vec<(u64, Vec<u8>)>,
        failure: Option<String>,
        now: Instant,
    ) {
        match purpose {
            // A failed catch-up leaves the rest to the live stream: what came is used.
            Purpose::CatchUp => self.tracker.catch_up_done(&received, actions),
            Purpose::Gap => self.tracker.replay_done(&received, failure, actions),
        }
        let held = self.held.take();
        self.follow(actions, held.as_deref(), &received, now);
        self.resume = true;
    }
}

/// The thread's state.
struct Loop {
    /// Read end of the wake-up pipe (a byte per command).
    control: UnixStream,
    commands: mpsc::Receiver<Command>,
    streams: Vec<Stream>,
    shared: Arc<Shared>,
    index: Option<SharedIndex>,
    actions: Vec<Action>,
    /// How long batches gather after a turn that took some (see [`Consumer::start`]).
    coalesce: Duration,
}

impl Loop {
    fn run(&mut self) {
        let mut ready: Vec<(Token, PollFlags)> = Vec::new();
        let mut closing: Vec<(usize, usize, Closed)> = Vec::new();
        let mut gathering = false;
        loop {
            if gathering {
                // Let the next batches gather: a wake-up costs far more than a batch (see
                // `Consumer::start`).
                std::thread::sleep(self.coalesce);
            }
            let paused = self.index.is_none() && self.shared.outbox_full();
            let now = Instant::now();
            let mut deadline = self.streams.iter().filter_map(Stream::next_deadline).min();
            if paused {
                deadline = Some(deadline.map_or(now + PAUSED_POLL, |d| d.min(now + PAUSED_POLL)));
            }
            let timeout = if gathering {
                Some(Duration::ZERO)
            } else {
                deadline.map(|d| d.saturating_duration_since(now))
            };
            ready.clear();
            if gathering && !paused && self.streams.iter().all(Stream::steady) {
                // The usual turn of a busy fleet: every connection is past its handshake and
                // nothing else waits, so each is read at once (a read that finds nothing
                // costs less than a poll over every socket), and commands are taken below as
                // on every turn. A wake-up's fixed cost dominates at a few batches per window.
                for (i, stream) in self.streams.iter().enumerate() {
                    ready.extend(
                        (0..stream.conns.len()).map(|j| (Token::Live(i, j), PollFlags::IN)),
                    );
                }
            } else {
                let mut fds = Vec::with_capacity(1 + 2 * self.streams.len());
                let mut tokens = Vec::with_capacity(fds.capacity());
                fds.push(PollFd::new(&self.control, PollFlags::IN));
                tokens.push(Token::Control);
                for (i, stream) in self.streams.iter().enumerate() {
                    stream.poll_items(i, paused, &mut fds, &mut tokens);
                }
                let timespec = timeout.map(|d| Timespec {
                    tv_sec: d.as_secs() as i64,
                    tv_nsec: i64::from(d.subsec_nanos()),
                });
                match rustix::event::poll(&mut fds, timespec.as_ref()) {
                    Ok(_) => {}
                    Err(rustix::io::Errno::INTR) => {
                        gathering = false;
                        continue;
                    }
                    Err(error) => panic!("poll failed: {error}"),
                }
                for (fd, &token) in fds.iter().zip(&tokens) {
                    let revents = fd.revents();
                    if !revents.is_empty() {
                        ready.push((token, revents));
                    }
                }
            }
            let (mut backlog, mut control) = (false, false);
            let taken_before = self.taken();
            let now = Instant::now();
            for &(token, revents) in &ready {
                match token {
                    Token::Control => control = true,
                    Token::Listener(i) => self.streams[i].accept_all(),
                    Token::Live(i, j) => {
                        let mut budget = BYTES_PER_TURN;
                        let stream = &mut self.streams[i];
                        match stream.service_live(j, revents, &mut budget, &mut self.actions) {
                            Ok(more) => backlog |= more,
                            Err(why) => closing.push((i, j, why)),
                        }
                    }
                    Token::Replay(i) => {
                        self.streams[i].service_replay(revents, &mut self.actions, now);
                    }
                }
            }
            // Connections close after every token was served (their indices stay valid).
            closing.sort_by_key(|&(i, j, _)| std::cmp::Reverse((i, j)));
            for (i, j, why) in closing.drain(..) {
                self.streams[i].live_closed(j, why, now);
            }
            for stream in &mut self.streams {
                if std::mem::take(&mut stream.resume) {
                    stream.pump_all(&mut self.actions, now);
                }
                stream.on_timers(now, &mut self.actions);
                if std::mem::take(&mut stream.resume) {
                    stream.pump_all(&mut self.actions, now); // a replay timed out
                }
            }
            self.apply_pending();
            if control {
                drain_pipe(&self.control);
            }
            while let Ok(command) = self.commands.try_recv() {
                match command {
                    Command::Add {
                        worker,
                        live,
                        subscription,
                        counters,
                    } => self.add(worker, live, subscription, counters),
                    Command::Remove { worker } => self.remove(&worker),
                    Command::Stop => return,
                }
            }
            self.apply_pending();
            // Only after batches (a handshake or a replay's progress waits for nothing), and
            // not while a socket still holds bytes, so the window never caps the rate.
            let received = self.taken() != taken_before;
            gathering = received && !backlog && !self.coalesce.is_zero();
        }
    }

    /// Batches (good or malformed) taken so far, over every stream.
    fn taken(&self) -> u64 {
        let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
        self.streams
            .iter()
            .map(|s| count(&s.sink.counters.batches) + count(&s.sink.counters.malformed))
            .sum()
    }

    /// Apply what every stream decoded this turn, under one lock of the index.
    fn apply_pending(&mut self) {
        let Some(index) = &self.index else {
            return;
        };
        if self.streams.iter().all(|s| s.sink.pending.is_empty()) {
            return;
        }
        let mut index = lock_index(index);
        for stream in &mut self.streams {
            stream.sink.apply(&mut index);
        }
    }

    fn add(
        &mut self,
        worker: String,
        live: LiveSource,
        subscription: Subscription,
        counters: Arc<Counters>,
    ) {
        self.streams.retain(|s| s.sink.worker != worker);
        let (dialer, listener) = match live {
            LiveSource::Dial(address) => (
                Some(Dialer {
                    address,
                    retry_at: None,
                    failures: 0,
                }),
                None,
            ),
            LiveSource::Listen(listener) => (None, Some(listener)),
        };
        let mut stream = Stream {
            subscription,
            tracker: SequenceTracker::new(),
            sink: Sink {
                worker,
                index: self.index.clone(),
                counters,
                shared: self.shared.clone(),
                pending: Vec::new(),
                id: None,
            },
            conns: Vec::new(),
            dialer,
            listener,
            replay: None,
            held: None,
            resume: false,
            catch_up_pending: false,
        };
        stream.start(Instant::now());
        self.streams.push(stream);
    }

    fn remove(&mut self, worker: &str) {
        let mut stream = self
            .streams
            .iter()
            .position(|s| s.sink.worker == worker)
            .map(|at| self.streams.remove(at));
        if let Some(index) = &self.index {
            let mut index = lock_index(index);
            if let Some(stream) = stream.as_mut() {
                stream.sink.apply(&mut index);
            }
            index.remove_worker(worker);
        }
    }
}

#[cfg(test)]
mod tests;
