//! The router's place in the replica mesh (`kvroute_core::mesh` for what it means,
//! `crate::mesh` for the sockets): its decisions, first tokens, ends and refreshes published
//! from the pipeline, its peers' applied to the fleet, peer decisions expired, heartbeats
//! sent, each worker's retention owner kept current, and the mesh's figures for `/metrics`.
//!
//! Lock order: the mesh's state, then the fleet (never the other way round: the pipeline
//! publishes only after it let the fleet go).

use std::collections::HashSet;
use std::fmt::Write as _;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use bytes::Bytes;
use kvroute_core::mesh::{Mesh, MeshBody, MeshMessage, Received};
use kvroute_core::retention::Refresh;
use tokio::sync::watch;

use super::refresh::send_refreshes;
use super::state::Shared;
use crate::config::ConfigError;
use crate::fleet::{Choice, PeerRouted};
use crate::mesh::{MeshSettings, OnMessage, Publisher, WireCounters, follow_peers};
use crate::prompt::Prompt;

/// How often peer decisions are expired, heartbeats sent and owners recomputed.
const TICK: Duration = Duration::from_millis(100);

/// This replica's mesh: its state, its PUB socket, and the peers it follows.
pub(super) struct MeshLink {
    state: Mutex<Mesh>,
    publisher: Publisher,
    counters: Arc<WireCounters>,
    peers: watch::Sender<Vec<String>>,
}

fn unix_now() -> f64 {
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

    fn state(&self) -> MutexGuard<'_, Mesh> {
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

/// Start the mesh's loops: following the peers, and the tick (expiry, heartbeats, owners).
pub(super) fn start(
    shared: &Arc<Shared>,
    runtime: &tokio::runtime::Runtime,
    stopped: watch::Receiver<bool>,
) {
    let Some(link) = &shared.mesh else { return };
    let weak = Arc::downgrade(shared);
    let on_message: OnMessage = Arc::new(move |payload: &[u8]| {
        if let Some(shared) = weak.upgrade() {
            receive(&shared, payload);
        }
    });
    runtime.spawn(follow_peers(
        link.peers.subscribe(),
        link.local_addr(),
        link.counters.clone(),
        on_message,
        stopped.clone(),
    ));
    runtime.spawn(tick_loop(Arc::downgrade(shared), stopped));
}

/// Apply one peer payload.
fn receive(shared: &Arc<Shared>, payload: &[u8]) {
    let Some(link) = &shared.mesh else { return };
    let Ok(message) = MeshMessage::decode(payload) else {
        link.counters.malformed.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let now = shared.now();
    let mut state = link.state();
    let refreshes = match state.receive(message, now, unix_now()) {
        Received::Nothing => None,
        Received::Routed {
            peer,
            decision,
            worker,
            block_hashes,
            prompt_tokens,
            output_tokens,
            overlap,
            prompt,
            model,
            cache_salt,
        } => {
            let routed = PeerRouted {
                worker_url: worker,
                block_hashes,
                prompt_tokens,
                output_tokens,
                overlap,
                prompt,
                model,
                cache_salt,
            };
            let (handle, refreshes) = shared.fleet().apply_peer_routed(&routed, now);
            state.opened(peer, decision, handle, now);
            refreshes
        }
        Received::FirstToken(handle) => {
            shared.fleet().peer_first_token(handle);
            None
        }
        Received::Finished(handle) => {
            shared.fleet().peer_finished(handle, now);
            None
        }
        Received::Refreshed {
            worker,
            block_hashes,
        } => {
            shared.fleet().apply_peer_refresh(worker, block_hashes, now);
            None
        }
    };
    drop(state);
    if let Some(idle) = refreshes
        && !shared.draining.load(Ordering::SeqCst)
    {
        link.refreshed(&idle.url, &idle.refreshes, now);
        let shared = shared.clone();
        tokio::spawn(async move {
            send_refreshes(
                &shared,
                &idle.name,
                &idle.url,
                &idle.refreshes,
                &idle.tenants,
            )
            .await;
        });
    }
}

/// Every [`TICK`]: release expired peer decisions, send a heartbeat when quiet, and give the
/// fleet the workers whose retention this replica owns among the live replicas.
async fn tick_loop(shared: Weak<Shared>, mut stopped: watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(TICK) => {}
            _ = stopped.changed() => return,
        }
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let Some(link) = &shared.mesh else { return };
        let now = shared.now();
        let mut state = link.state();
        let released = state.expire(now);
        let heartbeat = state.heartbeat(now, unix_now());
        let urls = shared.fleet().worker_urls();
        let owned: HashSet<String> = urls.into_iter().filter(|u| state.owns(u, now)).collect();
        {
            let mut fleet = shared.fleet();
            for handle in released {
                fleet.peer_finished(handle, now);
            }
            fleet.set_retention_owned(Some(owned));
        }
        drop(state);
        if let Some(beat) = heartbeat {
            link.publisher.publish(Bytes::from(beat.encode()));
        }
    }
}
