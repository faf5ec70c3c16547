//! The replica mesh's transport: ZeroMQ PUB/SUB over the router's own ZMTP codec
//! (`kvroute_io::zmtp`), on the router's tokio runtime. Each replica binds one PUB socket
//! (`--mesh-bind`) and subscribes to each peer's (`--peer`, a host name resolving to several
//! addresses counting as several peers: a Kubernetes headless Service). What the messages
//! say and what a replica does with them is `kvroute_core::mesh` and `server::mesh`; this
//! module moves bytes.
//!
//! Bounded and loss-tolerant by construction: messages to publish go through a broadcast
//! queue of [`QUEUE`] messages; a subscriber connection that falls that far behind loses the
//! oldest (counted in `dropped`), and a publisher never waits for a peer. A peer's connection
//! that breaks is dialled again every [`RECONNECT`]; its messages meanwhile are lost (the
//! receiver counts them by the gap in the sequence numbers).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kvroute_core::mesh::MeshConfig;
use kvroute_io::zmtp::{Codec, Event, SocketType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, watch};

/// The topic every mesh message is published under (its first frame).
pub const TOPIC: &[u8] = b"kvroute-mesh";
/// Messages queued for the subscribers at most; a slower subscriber loses the oldest.
pub const QUEUE: usize = 4096;
/// The longest mesh message taken (a decision carries its prompt's token ids).
pub const MAX_MESSAGE: usize = 8 << 20;
/// How long before a broken or refused peer connection is dialled again.
pub const RECONNECT: Duration = Duration::from_millis(250);
/// How often a peer given by host name is resolved again (a headless Service's pods change).
pub const RESOLVE_INTERVAL: Duration = Duration::from_secs(5);

/// What a subscriber connection does with each peer payload.
pub type OnMessage = Arc<dyn Fn(&[u8]) + Send + Sync>;

/// `kvroute serve --mesh-bind/--peer`: where this replica publishes, whom it follows.
#[derive(Clone, Debug, PartialEq)]
pub struct MeshSettings {
    /// `host:port` of this replica's PUB socket (port 0: an ephemeral port).
    pub bind: String,
    /// Peers' PUB sockets, `host:port`; a host name is resolved, every address a peer.
    pub peers: Vec<String>,
    pub config: MeshConfig,
}

/// Counters of the transport.
#[derive(Default)]
pub struct WireCounters {
    /// Messages a subscriber connection fell too far behind to get.
    pub dropped: AtomicU64,
    /// Payloads that were not mesh messages (or broke the ZMTP framing).
    pub malformed: AtomicU64,
    /// Peer connections up now.
    pub connected: AtomicU64,
}

/// This replica's PUB side: what to publish goes in here.
pub struct Publisher {
    tx: broadcast::Sender<Bytes>,
    addr: SocketAddr,
}

impl Publisher {
    /// Bind `bind` and serve every subscriber that connects until `stopped`.
    pub async fn start(
        bind: &str,
        counters: Arc<WireCounters>,
        stopped: watch::Receiver<bool>,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let (tx, _) = broadcast::channel(QUEUE);
        let subscribers = tx.clone();
        tokio::spawn(async move {
            let mut stop = stopped.clone();
            loop {
                let accepted = tokio::select! {
                    a = listener.accept() => a,
                    _ = stop.changed() => return,
                };
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let rx = subscribers.subscribe();
                tokio::spawn(serve_subscriber(
                    stream,
                    rx,
                    counters.clone(),
                    stopped.clone(),
                ));
            }
        });
        Ok(Self { tx, addr })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Queue `payload` for every subscriber (none connected: it goes nowhere).
    pub fn publish(&self, payload: Bytes) {
        let _ = self.tx.send(payload);
    }
}

/// One subscriber's connection: the handshake, then every published message, until it
/// breaks or the router stops. What the subscriber sends (its subscription) is read and
/// ignored: every mesh message is under [`TOPIC`].
async fn serve_subscriber(
    mut stream: TcpStream,
    mut rx: broadcast::Receiver<Bytes>,
    counters: Arc<WireCounters>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut codec = Codec::new(SocketType::Pub, 4096);
    loop {
        while !codec.outgoing().is_empty() {
            match stream.write(codec.outgoing()).await {
                Ok(0) | Err(_) => return,
                Ok(n) => codec.sent(n),
            }
        }
        tokio::select! {
            read = stream.read(codec.read_space()) => {
                match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => codec.filled(n),
                }
                loop {
                    match codec.next_event() {
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(_) => {
                            counters.malformed.fetch_add(1, Ordering::Relaxed);
                            return;
                        }
                    }
                }
            }
            message = rx.recv() => match message {
                Ok(payload) => codec.send_message(&[TOPIC, &payload]),
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    counters.dropped.fetch_add(n, Ordering::Relaxed);
                }
                Err(broadcast::error::RecvError::Closed) => return,
            },
            _ = stopped.changed() => return,
        }
    }
}

/// Follow the peers named in `peers` (re-resolved every [`RESOLVE_INTERVAL`]): one
/// subscriber connection per address, each payload given to `on_message`.
pub async fn follow_peers(
    peers: watch::Receiver<Vec<String>>,
    own: SocketAddr,
    counters: Arc<WireCounters>,
    on_message: OnMessage,
    stopped: watch::Receiver<bool>,
) {
    let mut followed: HashSet<SocketAddr> = HashSet::new();
    let mut peers = peers;
    let mut stop = stopped.clone();
    loop {
        let names = peers.borrow_and_update().clone();
        for name in names {
            let Ok(addrs) = tokio::net::lookup_host(name.as_str()).await else {
                continue;
            };
            for addr in addrs {
                if addr == own || !followed.insert(addr) {
                    continue;
                }
                tokio::spawn(follow_one(
                    addr,
                    counters.clone(),
                    on_message.clone(),
                    stopped.clone(),
                ));
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(RESOLVE_INTERVAL) => {}
            _ = peers.changed() => {}
            _ = stop.changed() => return,
        }
    }
}

/// One peer's PUB socket, dialled again after every break, until the router stops.
async fn follow_one(
    addr: SocketAddr,
    counters: Arc<WireCounters>,
    on_message: OnMessage,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        if let Ok(stream) = TcpStream::connect(addr).await {
            let _ = stream.set_nodelay(true);
            counters.connected.fetch_add(1, Ordering::Relaxed);
            let end = subscribe(stream, &counters, &*on_message, &mut stopped).await;
            counters.connected.fetch_sub(1, Ordering::Relaxed);
            if end.is_none() {
                return;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(RECONNECT) => {}
            _ = stopped.changed() => return,
        }
    }
}

/// One subscriber connection until it breaks (Some) or the router stops (None).
async fn subscribe(
    mut stream: TcpStream,
    counters: &WireCounters,
    on_message: &(dyn Fn(&[u8]) + Send + Sync),
    stopped: &mut watch::Receiver<bool>,
) -> Option<()> {
    let mut codec = Codec::new(SocketType::Sub, MAX_MESSAGE);
    codec.subscribe(TOPIC);
    loop {
        while !codec.outgoing().is_empty() {
            match stream.write(codec.outgoing()).await {
                Ok(0) | Err(_) => return Some(()),
                Ok(n) => codec.sent(n),
            }
        }
        tokio::select! {
            read = stream.read(codec.read_space()) => match read {
                Ok(0) | Err(_) => return Some(()),
                Ok(n) => codec.filled(n),
            },
            _ = stopped.changed() => return None,
        }
        loop {
            match codec.next_event() {
                Ok(Some(Event::Message(m))) if m.len() == 2 && m.frame(0) == TOPIC => {
                    on_message(m.frame(1));
                }
                Ok(Some(Event::Message(_))) => {
                    counters.malformed.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Some(Event::Ready { .. })) => {}
                Ok(None) => break,
                Err(_) => {
                    counters.malformed.fetch_add(1, Ordering::Relaxed);
                    return Some(());
                }
            }
        }
    }
}
