//! This replica's end of the replica mesh: its state, its publisher, the peers it follows and
//! its counters (`super::mesh` applies what arrives).

use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;

use kvroute_core::mesh::{Mesh, MeshBody};
use kvroute_core::retention::Refresh;
use tokio::sync::watch;

use crate::config::ConfigError;
use crate::fleet::Choice;
use crate::mesh::{MeshSettings, Publisher, WireCounters};
use crate::prompt::Prompt;

/// This replica's mesh: its state, its PUB socket, and the peers it follows.
pub(super) struct MeshLink {
    state: Mutex<Mesh>,
    pub(super) publisher: Publisher,
    pub(super) counters: Arc<WireCounters>,
    pub(super) peers: watch::Sender<Vec<String>>,
}

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
            .map_err(|e| ConfigError(format!("cannot bind the mesh on {}: {e}", settings.bind)))?;
        Ok(Self {
            state: Mutex::new(Mesh::new(instance, settings.config)),
            publisher,
            counters,
            peers: watch::Sender::new(settings.peers.clone()),
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

    /// Publish this replica's decision `choice` of `prompt`; its number, for its first token
    /// and end.
    pub(super) fn routed(&self, choice: &Choice, prompt: &Prompt, now: f64) -> u64 {
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
                worker: choice.url.clone(),
                block_hashes: prompt.block_hashes.clone(),
                prompt_tokens: u32::try_from(prompt.tokens).unwrap_or(u32::MAX),
                output_tokens: u32::try_from(output_tokens).unwrap_or(u32::MAX),
                overlap: u32::try_from(choice.overlap_blocks).unwrap_or(u32::MAX),
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

    /// The mesh's figures in Prometheus text.
    pub(super) fn render(&self, out: &mut String, now: f64) {
        let state = self.state();
        let stats = state.stats();
        let lag = state.peers().map(|p| p.lag_s).fold(0.0, f64::max);
        let rows: [(&str, &str, &str, f64); 10] = [
            (
                "kvroute_mesh_peers_live",
                "gauge",
                "Peer replicas heard within the liveness window",
                state.live_peers(now) as f64,
            ),
            (
                "kvroute_mesh_peer_connections",
                "gauge",
                "Connections to peers' PUB sockets up now",
                self.counters.connected.load(Ordering::Relaxed) as f64,
            ),
            (
                "kvroute_mesh_messages_sent_total",
                "counter",
                "Mesh messages published",
                stats.sent as f64,
            ),
            (
                "kvroute_mesh_messages_received_total",
                "counter",
                "Mesh messages received from peers",
                stats.received as f64,
            ),
            (
                "kvroute_mesh_messages_lost_total",
                "counter",
                "Peer messages that never arrived (gaps in their sequence)",
                stats.lost as f64,
            ),
            (
                "kvroute_mesh_messages_dropped_total",
                "counter",
                "Messages a slow subscriber of this replica lost (its queue was full)",
                self.counters.dropped.load(Ordering::Relaxed) as f64,
            ),
            (
                "kvroute_mesh_messages_malformed_total",
                "counter",
                "Mesh payloads or connections that did not decode",
                self.counters.malformed.load(Ordering::Relaxed) as f64,
            ),
            (
                "kvroute_mesh_decisions_expired_total",
                "counter",
                "Peer decisions released without their end (expired, or their peer gone)",
                stats.expired as f64,
            ),
            (
                "kvroute_mesh_decisions_open",
                "gauge",
                "Peer decisions applied here and not ended",
                state.open_decisions() as f64,
            ),
            (
                "kvroute_mesh_lag_seconds",
                "gauge",
                "Largest lag of a peer's last message (receipt minus sending, wall clocks)",
                lag,
            ),
        ];
        for (name, kind, help, value) in rows {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value:?}"
            );
        }
    }
}
