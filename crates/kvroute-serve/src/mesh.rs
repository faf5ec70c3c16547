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

use std::collections::{HashMap, HashSet};
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

/// What a subscriber connection reports, under its connection's number (new for every
/// connection, never 0).
pub enum LinkEvent<'a> {
    /// A peer's payload.
    Message(&'a [u8]),
    /// The connection closed (the peer went away, or it is no longer followed).
    Closed,
}

/// What a subscriber connection does with what it reports.
pub type OnMessage = Arc<dyn Fn(u64, LinkEvent<'_>) + Send + Sync>;

/// The next connection's number.
static NEXT_LINK: AtomicU64 = AtomicU64::new(1);

/// `kvroute serve --mesh-bind/--peer`: where this replica publishes, whom it follows.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeshSettings {
    /// `host:port` of this replica's PUB socket (port 0: an ephemeral port).
    pub bind: String,
    /// Peers' PUB sockets, `host:port`; a host name is resolved, every address a peer.
    #[serde(default)]
    pub peers: Vec<String>,
    #[serde(default)]
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

/// Follow the peers named in `peers` (re-resolved every [`RESOLVE_INTERVAL`] and whenever the
/// list changes): one subscriber connection per address, each payload given to `on_message`.
/// An address no name resolves to any more (a pod gone from a headless Service, a peer taken
/// off the list) is no longer followed; a round in which some name does not resolve retires
/// nothing (a DNS hiccup must not cut the mesh).
pub async fn follow_peers(
    peers: watch::Receiver<Vec<String>>,
    own: SocketAddr,
    counters: Arc<WireCounters>,
    on_message: OnMessage,
    stopped: watch::Receiver<bool>,
) {
    let mut followed: HashMap<SocketAddr, watch::Sender<bool>> = HashMap::new();
    let mut peers = peers;
    let mut stop = stopped.clone();
    loop {
        let names = peers.borrow_and_update().clone();
        let mut current: HashSet<SocketAddr> = HashSet::new();
        let mut complete = true;
        for name in names {
            match tokio::net::lookup_host(name.as_str()).await {
                Ok(addrs) => current.extend(addrs.filter(|a| *a != own)),
                Err(_) => complete = false,
            }
        }
        if complete {
            // Dropping a follower's sender tells it to stop.
            followed.retain(|addr, _| current.contains(addr));
        }
        for addr in current {
            if followed.contains_key(&addr) {
                continue;
            }
            let (retire, retired) = watch::channel(false);
            followed.insert(addr, retire);
            tokio::spawn(follow_one(
                addr,
                counters.clone(),
                on_message.clone(),
                stopped.clone(),
                retired,
            ));
        }
        tokio::select! {
            _ = tokio::time::sleep(RESOLVE_INTERVAL) => {}
            _ = peers.changed() => {}
            _ = stop.changed() => return,
        }
    }
}

/// One peer's PUB socket, dialled again after every break, until the router stops or the peer
/// is retired (its sender dropped).
async fn follow_one(
    addr: SocketAddr,
    counters: Arc<WireCounters>,
    on_message: OnMessage,
    mut stopped: watch::Receiver<bool>,
    mut retired: watch::Receiver<bool>,
) {
    loop {
        let connect = tokio::select! {
            c = TcpStream::connect(addr) => c,
            _ = retired.changed() => return,
        };
        if let Ok(stream) = connect {
            let _ = stream.set_nodelay(true);
            let link = NEXT_LINK.fetch_add(1, Ordering::Relaxed);
            counters.connected.fetch_add(1, Ordering::Relaxed);
            let end = tokio::select! {
                end = subscribe(stream, link, &counters, &*on_message, &mut stopped) => end,
                _ = retired.changed() => None,
            };
            counters.connected.fetch_sub(1, Ordering::Relaxed);
            on_message(link, LinkEvent::Closed);
            if end.is_none() {
                return;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(RECONNECT) => {}
            _ = stopped.changed() => return,
            _ = retired.changed() => return,
        }
    }
}

/// One subscriber connection until it breaks (Some) or the router stops (None).
async fn subscribe(
    mut stream: TcpStream,
    link: u64,
    counters: &WireCounters,
    on_message: &(dyn Fn(u64, LinkEvent<'_>) + Send + Sync),
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
                    on_message(link, LinkEvent::Message(m.frame(1)));
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    async fn until(check: impl Fn() -> bool) {
        for _ in 0..200 {
            if check() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("not within 2 s");
    }

    #[tokio::test]
    async fn a_subscriber_gets_what_is_published_and_a_retired_peer_is_let_go() {
        let (_stop, stopped) = watch::channel(false);
        let counters = Arc::new(WireCounters::default());
        let publisher = Publisher::start("127.0.0.1:0", counters.clone(), stopped.clone())
            .await
            .unwrap();
        let got: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
        let sink = got.clone();
        let closed = Arc::new(AtomicU64::new(0));
        let closes = closed.clone();
        let on_message: OnMessage = Arc::new(move |_, event: LinkEvent<'_>| match event {
            LinkEvent::Message(p) => sink.lock().unwrap().push(p.to_vec()),
            LinkEvent::Closed => {
                closes.fetch_add(1, Ordering::Relaxed);
            }
        });
        let (peers, peers_rx) = watch::channel(vec![publisher.local_addr().to_string()]);
        let own: SocketAddr = "127.0.0.1:1".parse().unwrap();
        tokio::spawn(follow_peers(
            peers_rx,
            own,
            counters.clone(),
            on_message,
            stopped,
        ));
        until(|| counters.connected.load(Ordering::Relaxed) == 1).await;
        // The subscription reaches the publisher after the connection: publish until one
        // arrives, then the rest in order.
        until(|| {
            publisher.publish(Bytes::from_static(b"hello"));
            !got.lock().unwrap().is_empty()
        })
        .await;
        for i in 0..100u8 {
            publisher.publish(Bytes::from(vec![i; 1 + usize::from(i) * 100]));
        }
        // (Hellos published before the first arrived may still come: they are left out.)
        let numbered = || -> Vec<Vec<u8>> {
            let got = got.lock().unwrap();
            got.iter()
                .filter(|p| p.as_slice() != b"hello")
                .cloned()
                .collect()
        };
        until(|| numbered().len() == 100).await;
        let sizes: Vec<usize> = numbered().iter().map(Vec::len).collect();
        assert_eq!(sizes, (0..100).map(|i| 1 + i * 100).collect::<Vec<_>>());
        // Taken off the list: its connection closes and is not dialled again.
        peers.send_replace(Vec::new());
        until(|| counters.connected.load(Ordering::Relaxed) == 0).await;
        until(|| closed.load(Ordering::Relaxed) == 1).await;
        tokio::time::sleep(RECONNECT * 2).await;
        assert_eq!(counters.connected.load(Ordering::Relaxed), 0);
        assert_eq!(counters.malformed.load(Ordering::Relaxed), 0);
    }
}
