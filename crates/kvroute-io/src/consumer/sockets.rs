//! Addresses and connections: ZeroMQ endpoints, listeners of bound streams, one ZMTP
//! connection's non-blocking reads and writes, and the live side's reconnect schedule.

use std::io::{self, ErrorKind, Read};
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rustix::event::PollFlags;
use rustix::net::SendFlags;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::zmtp::{Codec, ProtocolError, SocketType};

/// The longest message a connection may carry, in bytes: far above a batch of vLLM's (a
/// 128k-token prefill stores ~0.6 MB), so only a broken or hostile peer reaches it; the
/// connection is then reset (memory stays bounded by this per connection).
pub const MAX_MESSAGE: usize = 64 << 20;

/// Bytes taken from one connection per turn of the loop, so one busy stream cannot starve the
/// others (poll is level-triggered: the rest is taken on the next turn, without the gathering
/// sleep).
pub(super) const BYTES_PER_TURN: usize = 1 << 20;

/// Publishers one bound stream accepts at once (more are closed on arrival).
pub(super) const MAX_ACCEPTED: usize = 64;

/// Wait before reconnecting a lost or refused live connection: libzmq's default
/// `ZMQ_RECONNECT_IVL`, so an engine back from a quick restart is followed again within
/// 0.1 s (batches it publishes before the subscription arrives are dropped by its PUB; the
/// tracker sees the restart from the first one that comes, and replays the rest).
pub(super) const RECONNECT_IVL: Duration = Duration::from_millis(100);

/// Failed attempts at [`RECONNECT_IVL`] before the wait doubles per attempt, up to
/// [`RECONNECT_MAX`] (an engine that stays away is not dialled 10 times a second for ever);
/// a handshake starts again from the first.
pub(super) const RECONNECT_QUICK_ATTEMPTS: u32 = 20;

/// Longest wait between two attempts to reconnect.
pub(super) const RECONNECT_MAX: Duration = Duration::from_secs(2);

/// A ZeroMQ endpoint this consumer can reach: `tcp://HOST:PORT` (HOST an IPv4 address, `[IPv6]`,
/// a name, or `*` when binding; PORT `*` or 0 when binding picks a free one) or `ipc://PATH`
/// (a Unix socket). `inproc://` is one libzmq process's own and cannot be reached from here.
#[derive(Clone, Debug)]
pub(super) enum Address {
    Tcp { host: String, port: u16 },
    Ipc(PathBuf),
}

impl Address {
    pub(super) fn parse(endpoint: &str, bind: bool) -> Result<Self, String> {
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

    pub(super) fn socket(domain: Domain) -> io::Result<Socket> {
        let protocol = (domain != Domain::UNIX).then_some(Protocol::TCP);
        let socket = Socket::new(domain, Type::STREAM, protocol)?;
        socket.set_nonblocking(true)?;
        if domain != Domain::UNIX {
            socket.set_tcp_nodelay(true)?;
        }
        Ok(socket)
    }

    /// Start connecting without blocking.
    pub(super) fn connect(&self, kind: SocketType) -> io::Result<Conn> {
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
pub(super) struct Listener {
    pub(super) socket: Socket,
    /// Its address, port resolved.
    pub(super) endpoint: String,
    /// The Unix socket's file, removed on close (as libzmq does).
    pub(super) path: Option<PathBuf>,
}

impl Listener {
    pub(super) fn bind(address: &Address) -> io::Result<Self> {
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
    pub(super) fn accept(&self) -> io::Result<Option<Conn>> {
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
pub(super) enum LiveSource {
    /// Connect to the engine's PUB (and reconnect when the connection is lost).
    Dial(Address),
    /// Accept the engines' PUB connections.
    Listen(Listener),
}

/// One connection: a non-blocking socket and its ZMTP state.
pub(super) struct Conn {
    pub(super) socket: Socket,
    pub(super) codec: Codec,
    /// False while a non-blocking connect is under way.
    pub(super) connected: bool,
}

/// What one read found.
pub(super) enum ReadOutcome {
    /// It filled the space offered: more may be waiting.
    Full,
    /// The socket has nothing more now.
    Drained,
}

impl Conn {
    /// The poll flags it needs: writable while connecting or while bytes wait to go,
    /// readable if `read` (errors and hang-ups are always reported).
    pub(super) fn interest(&self, read: bool) -> PollFlags {
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
    pub(super) fn finish_connect(&mut self) -> io::Result<()> {
        if let Some(error) = self.socket.take_error()? {
            return Err(error);
        }
        self.socket.peer_addr()?;
        self.connected = true;
        Ok(())
    }

    /// Write what the codec queued, as far as the socket takes it now.
    pub(super) fn flush(&mut self) -> io::Result<()> {
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
    pub(super) fn read_once(&mut self, budget: &mut usize) -> io::Result<ReadOutcome> {
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
pub(super) enum Closed {
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

/// A live side that connects: where to, and when to try again.
pub(super) struct Dialer {
    pub(super) address: Address,
    pub(super) retry_at: Option<Instant>,
    /// Attempts that failed since the last handshake.
    pub(super) failures: u32,
}

impl Dialer {
    /// The wait before the next attempt, after `failures` failed ones.
    pub(super) fn backoff(failures: u32) -> Duration {
        let doublings = failures.saturating_sub(RECONNECT_QUICK_ATTEMPTS).min(8);
        (RECONNECT_IVL * (1 << doublings)).min(RECONNECT_MAX)
    }
}
