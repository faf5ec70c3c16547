//! This replica's end of the replica mesh: its state, its publisher, the peers it follows and
//! its counters (`super::mesh` applies what arrives).

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;

use kvroute_core::mesh::{Mesh, MeshBody};
use kvroute_core::retention::Refresh;
use tokio::sync::watch;

use crate::config::ConfigError;
use crate::fleet::Dispatch;
use crate::mesh::{MeshSettings, Publisher, WireCounters};
use crate::metrics::exposition::{Exposition, Histogram, Kind};
use crate::prompt::Prompt;

/// This replica's mesh: its state, its PUB socket, and the peers it follows.
pub(super) struct MeshLink {
    state: Mutex<Mesh>,
    pub(super) publisher: Publisher,
    pub(super) counters: Arc<WireCounters>,
    pub(super) peers: watch::Sender<Vec<String>>,
    /// Each peer message's lag: from its sending to its being applied here (wall clocks).
    lag: Histogram,
}

/// The lag histogram's bounds, in seconds: 20 µs .. 100 ms, finer below 2 ms where a
/// loopback or cluster network's lag lies.
const LAG_BUCKETS: [f64; 16] = [
    2e-5, 5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 7.5e-4, 1e-3, 1.5e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2e-2, 5e-2,
    0.1,
];

/// Wall-clock seconds since the Unix epoch (messages carry it, for the mesh's lag).
pub(super) fn unix_now() -> f64 {
    jiff::Timestamp::now().as_duration().as_secs_f64()
}

impl MeshLink {
    /// Bind the PUB socket on `runtime` (the loops start with [`start`]).
    pub(super) fn bind(
        settings: &MeshSettings,
        instance: &str,
        runtime: &tokio::runtime::Runtime,
        stopped: watch::Receiver<bool>,
    ) -> Result<Self, ConfigError> {
        let counters = Arc::new(WireCounters::default());
        let publisher = runtime
            .block_on(Publisher::start(&settings.bind, counters.clone(), stopped))
            .map_err(|e| {
                ConfigError::new(format!("cannot bind the mesh on {}: {e}", settings.bind))
            })?;
        Ok(Self {
            state: Mutex::new(Mesh::new(instance, settings.config)),
            publisher,
            counters,
            peers: watch::Sender::new(settings.peers.clone()),
            lag: Histogram::new(&LAG_BUCKETS),
        })
    }

    pub(super) fn state(&self) -> MutexGuard<'_, Mesh> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where its PUB socket listens.
    pub(super) fn local_addr(&self) -> std::net::SocketAddr {
        self.publisher.local_addr()
    }

    /// Replace the peers followed (discovery's list of `host:port`).
    pub(super) fn set_peers(&self, peers: Vec<String>) {
        self.peers.send_replace(peers);
    }

    fn publish(&self, body: MeshBody, now: f64) {
        let message = self.state().message(body, now, unix_now());
        self.publisher.publish(Bytes::from(message.encode()));
    }

    /// Publish this replica's decision `dispatch` of `prompt`; its number, for its first token
    /// and end.
    pub(super) fn routed(&self, dispatch: &Dispatch, prompt: &Prompt, now: f64) -> u64 {
        let (ids, output_tokens, model, cache_salt) = match &prompt.retained {
            Some(r) => (
                r.ids.clone(),
                r.output_tokens,
                r.model.clone().unwrap_or_default(),
                r.cache_salt.clone().unwrap_or_default(),
            ),
            None => (Vec::new(), 0, String::new(), String::new()),
        };
        let mut state = self.state();
        let decision = state.next_decision();
        let message = state.message(
            MeshBody::Routed {
                decision,
                worker: dispatch.url.clone(),
                block_hashes: prompt.block_hashes.clone(),
                prompt_tokens: u32::try_from(prompt.tokens).unwrap_or(u32::MAX),
                output_tokens: u32::try_from(output_tokens).unwrap_or(u32::MAX),
                overlap: u32::try_from(dispatch.decision.overlap).unwrap_or(u32::MAX),
                prompt: ids,
                model,
                cache_salt,
            },
            now,
            unix_now(),
        );
        drop(state);
        self.publisher.publish(Bytes::from(message.encode()));
        decision
    }

    /// This replica's decision `decision` got its first token.
    pub(super) fn first_token(&self, decision: u64, now: f64) {
        self.publish(MeshBody::FirstToken { decision }, now);
    }

    /// This replica's decision `decision` ended.
    pub(super) fn finished(&self, decision: u64, now: f64) {
        self.publish(MeshBody::Finished { decision }, now);
    }

    /// This replica sent `refreshes` to the worker at `url`.
    pub(super) fn refreshed(&self, url: &str, refreshes: &[Refresh], now: f64) {
        for r in refreshes {
            self.publish(
                MeshBody::Refreshed {
                    worker: url.to_owned(),
                    block_hashes: r.block_hashes.to_vec(),
                },
                now,
            );
        }
    }

    /// A peer message sent at `sent_unix_s` (its wall clock) is applied.
    pub(super) fn applied(&self, sent_unix_s: f64) {
        self.lag.observe((unix_now() - sent_unix_s).max(0.0));
    }

    /// The mesh's figures.
    pub(super) fn render(&self, out: &mut Exposition, now: f64) {
        let state = self.state();
        let stats = state.stats();
        let lag = state.peers().map(|p| p.lag_s).fold(0.0, f64::max);
        let rows: [(&str, Kind, &str, f64); 13] = [
            (
                "kvroute_mesh_peers_live",
                Kind::Gauge,
                "Peer replicas heard within the liveness window",
                state.live_peers(now) as f64,
            ),
            (
                "kvroute_mesh_peer_connections",
                Kind::Gauge,
                "Connections to peers' PUB sockets up now",
                self.counters.connected.load(Ordering::Relaxed) as f64,
            ),
            (
                "kvroute_mesh_messages_sent",
                Kind::Counter,
                "Mesh messages published",
                stats.sent as f64,
            ),
            (
                "kvroute_mesh_messages_received",
                Kind::Counter,
                "Mesh messages received from peers",
                stats.received as f64,
            ),
            (
                "kvroute_mesh_messages_lost",
                Kind::Counter,
                "Peer messages that never arrived (gaps in their sequence)",
                stats.lost as f64,
            ),
            (
                "kvroute_mesh_messages_dropped",
                Kind::Counter,
                "Messages a slow subscriber of this replica lost (its queue was full)",
                self.counters.dropped.load(Ordering::Relaxed) as f64,
            ),
            (
                "kvroute_mesh_messages_malformed",
                Kind::Counter,
                "Mesh payloads or connections that did not decode",
                self.counters.malformed.load(Ordering::Relaxed) as f64,
            ),
            (
                "kvroute_mesh_decisions_expired",
                Kind::Counter,
                "Peer decisions released without their end (expired, or their peer gone)",
                stats.expired as f64,
            ),
            (
                "kvroute_mesh_decisions_open",
                Kind::Gauge,
                "Peer decisions applied here and not ended",
                state.open_decisions() as f64,
            ),
            (
                "kvroute_mesh_lag_seconds",
                Kind::Gauge,
                "Largest lag of a peer's last message (receipt minus sending, wall clocks)",
                lag,
            ),
            (
                "kvroute_mesh_snapshots_sent",
                Kind::Counter,
                "Snapshots of this replica's state sent to peers that had just started",
                stats.snapshots_sent as f64,
            ),
            (
                "kvroute_mesh_snapshots_adopted",
                Kind::Counter,
                "Peer snapshots this replica adopted after its start (at most one)",
                stats.snapshots_adopted as f64,
            ),
            (
                "kvroute_mesh_snapshot_decisions",
                Kind::Counter,
                "Open decisions taken from the adopted snapshot",
                stats.adopted_decisions as f64,
            ),
        ];
        for (name, kind, help, value) in rows {
            out.scalar(name, kind, help, value);
        }
        if let Some(after) = state.adopted_after() {
            out.scalar(
                "kvroute_mesh_snapshot_adopted_seconds",
                Kind::Gauge,
                "Seconds from this replica's first request for a snapshot (its mesh's start) to its adopting one",
                after,
            );
        }
        drop(state);
        out.histogram(
            "kvroute_mesh_apply_lag_seconds",
            "Peer messages' lag from their sending to their being applied here (wall clocks)",
            &self.lag,
        );
    }
}
