//! The router's place in the replica mesh (`kvroute_core::mesh` for what it means,
//! `crate::mesh` for the sockets): its decisions, first tokens, ends and refreshes published
//! from the pipeline, its peers' applied to the fleet, peer decisions expired (or released
//! when the connection to their replica closes), heartbeats sent, each worker's retention
//! owner kept current, a snapshot asked for while just started and adopted, or sent to a
//! peer that asks, and the mesh's figures for `/metrics`.
//!
//! Lock order: the mesh's state, then the fleet (never the other way round: the pipeline
//! publishes only after it let the fleet go).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use kvroute_core::mesh::{MeshMessage, Received};
use tokio::sync::watch;

use super::mesh_link::unix_now;
use super::refresh::spawn_idle_refreshes;
use super::shared::Shared;
use crate::fleet::RefreshTenant;
use crate::mesh::{LinkEvent, OnMessage, follow_peers};

/// How often peer decisions are expired, heartbeats sent and owners recomputed.
const TICK: Duration = Duration::from_millis(100);

/// Start the mesh's loops: following the peers, and the tick (expiry, heartbeats, owners).
pub(super) fn start(
    shared: &Arc<Shared>,
    runtime: &tokio::runtime::Runtime,
    stopped: watch::Receiver<bool>,
) {
    let Some(link) = &shared.mesh else { return };
    let weak = Arc::downgrade(shared);
    let on_message: OnMessage = Arc::new(move |link, event: LinkEvent<'_>| {
        let Some(shared) = weak.upgrade() else { return };
        match event {
            LinkEvent::Message(payload) => receive(&shared, link, payload),
            LinkEvent::Closed => link_closed(&shared, link),
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

/// Apply one peer payload, which came on connection `connection`.
fn receive(shared: &Arc<Shared>, connection: u64, payload: &[u8]) {
    let Some(link) = &shared.mesh else { return };
    let Ok(message) = MeshMessage::decode(payload) else {
        link.counters.malformed.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let sent_unix_s = message.sent_unix_s;
    let now = shared.now();
    let mut state = link.state();
    let mut reply = None;
    let refreshes = match state.receive(connection, message, now, unix_now()) {
        Received::Nothing => None,
        Received::Routed {
            peer,
            decision,
            worker,
            routed,
            model,
            cache_salt,
        } => {
            let tenant = RefreshTenant::named(model, cache_salt);
            let (handle, refreshes) = shared
                .fleet()
                .apply_peer_routed(worker, &routed, tenant, now);
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
        Received::SnapshotWanted => {
            let (shares, decisions) = shared.fleet().recent_shares();
            reply = Some(state.snapshot(shares, decisions, now, unix_now()));
            None
        }
        Received::Adopt {
            shares,
            share_decisions,
            open,
        } => {
            let mut fleet = shared.fleet();
            fleet.adopt_shares(&shares, share_decisions);
            let applied: Vec<_> = open
                .into_iter()
                .map(|entry| {
                    let handle = fleet.adopt_open(&entry, now);
                    (entry, handle)
                })
                .collect();
            drop(fleet);
            state.adopted(applied, now);
            None
        }
    };
    drop(state);
    link.applied(sent_unix_s);
    if let Some(snapshot) = reply {
        link.publisher.publish(Bytes::from(snapshot.encode()));
    }
    if let Some(idle) = refreshes
        && !shared.draining.load(Ordering::SeqCst)
    {
        link.refreshed(&idle.url, &idle.refreshes, now);
        spawn_idle_refreshes(&tokio::runtime::Handle::current(), shared.clone(), idle);
    }
}

/// The connection `connection` to a peer closed: release the decisions of the peers heard on
/// it.
fn link_closed(shared: &Arc<Shared>, connection: u64) {
    let Some(link) = &shared.mesh else { return };
    let now = shared.now();
    let mut state = link.state();
    let released = state.link_closed(connection, now);
    if !released.is_empty() {
        let mut fleet = shared.fleet();
        for handle in released {
            fleet.peer_finished(handle, now);
        }
    }
}

/// Every [`TICK`]: release expired peer decisions, send a heartbeat when quiet (and, just
/// started, a request for a snapshot), and give the fleet the workers whose retention this
/// replica owns among the live replicas.
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
        let ask = state.ask_snapshot(now, unix_now());
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
        for message in ask.into_iter().chain(heartbeat) {
            link.publisher.publish(Bytes::from(message.encode()));
        }
    }
}
