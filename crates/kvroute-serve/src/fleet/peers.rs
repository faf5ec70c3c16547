//! The fleet's side of the replica mesh (`kvroute_core::mesh`): a peer replica's decisions
//! and refreshes applied to this replica's routing step, index and retention model as if it
//! had made them, and which workers' retention this replica owns.
//!
//! A peer's decision goes through [`RoutingStep::route_to`](kvroute_core::routing::RoutingStep::route_to)
//! (the same accounting as this replica's own: the prediction in the index, the load, the
//! admission ticket) and, with retention on, `Retention::routed` with the peer's overlap (the
//! credit its decision saw). Workers are named by URL between replicas: every replica reaches
//! a worker at the same address, whatever name its discovery gives it.

use std::collections::HashSet;

use kvroute_core::mesh::DecisionHandle;
use kvroute_core::policies::{Choose, WorkerState};
use kvroute_io::consumer::lock_index;

use super::{Fleet, IdleRefreshes, PeerRouted, RefreshTenant, remember_tenant};

impl Fleet {
    /// Whether this replica sends `slot`'s refreshes (all of them while no mesh says
    /// otherwise, [`Fleet::set_retention_owned`]).
    pub(super) fn owns_retention(&self, slot: usize) -> bool {
        super::owns(&self.retention_owned, &self.members, slot)
    }

    /// The worker URLs whose retention this replica owns (None: all, no mesh).
    pub fn set_retention_owned(&mut self, owned: Option<HashSet<String>>) {
        self.retention_owned = owned;
    }

    /// The URLs of every worker (the mesh names workers by them).
    pub fn worker_urls(&self) -> Vec<String> {
        self.members.iter().map(|m| m.url.clone()).collect()
    }

    /// Apply a peer's decision at `now`: its handle to release later (None for a worker this
    /// replica does not know), and, when this replica owns the worker's retention, the
    /// refreshes the decision calls for, to send as a worker falling idle gets them.
    pub fn apply_peer_routed(
        &mut self,
        peer: &PeerRouted<'_>,
        now: f64,
    ) -> (Option<DecisionHandle>, Option<IdleRefreshes>) {
        let Some(member) = self.members.iter().find(|m| m.url == peer.worker_url) else {
            return (None, None);
        };
        let (slot, name, url) = (member.slot, member.name.clone(), member.url.clone());
        let owned = self.owns_retention(slot);
        let mut index = lock_index(&self.index);
        let routed = self.routing.route_to(
            Some(&mut index),
            slot,
            peer.block_hashes,
            peer.prompt_tokens,
            now,
        );
        // The policy counts the peer's choice among the workers it would have chosen from.
        let candidates: Vec<usize> = self
            .members
            .iter()
            .filter(|m| m.available(now))
            .map(|m| m.slot)
            .collect();
        if let Some(chosen) = candidates.iter().position(|&s| s == slot) {
            let states: Vec<&WorkerState> =
                candidates.iter().map(|&s| self.routing.state(s)).collect();
            self.policy.observe(&states, chosen);
        }
        let mut refreshes = Vec::new();
        if let Some(r) = self.retention.as_mut()
            && !peer.prompt.is_empty()
            && !peer.block_hashes.is_empty()
        {
            let tenant = RefreshTenant {
                model: Some(peer.model)
                    .filter(|m| !m.is_empty())
                    .map(str::to_owned),
                cache_salt: Some(peer.cache_salt)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned),
            };
            remember_tenant(&mut self.tenants, peer.block_hashes[0], tenant);
            if owned {
                let incoming = (peer.prompt.len() + peer.output_tokens)
                    .div_ceil(self.routing.block_size())
                    .saturating_sub(peer.overlap);
                r.poll_step(
                    &self.routing,
                    Some(&mut index),
                    slot,
                    incoming,
                    now,
                    &mut refreshes,
                );
            }
            r.routed(
                slot,
                peer.block_hashes,
                peer.prompt,
                peer.overlap,
                peer.output_tokens,
                now,
            );
        }
        drop(index);
        let handle = DecisionHandle {
            slot,
            prefill_tokens: routed.prefill_tokens,
            ticket: routed.ticket,
            first_token: false,
        };
        let refreshes = (!refreshes.is_empty()).then(|| IdleRefreshes {
            name,
            url,
            tenants: self.tenants_of(&refreshes),
            refreshes,
        });
        (Some(handle), refreshes)
    }

    /// A peer's decision got its first token: its prefill leaves the worker's load.
    pub fn peer_first_token(&mut self, handle: &DecisionHandle) {
        self.routing.first_token(handle.slot, handle.prefill_tokens);
    }

    /// A peer's decision ended (or expired) at `now`: release what it charged.
    pub fn peer_finished(&mut self, handle: DecisionHandle, now: f64) {
        if !handle.first_token {
            self.routing.first_token(handle.slot, handle.prefill_tokens);
        }
        self.routing.finished(handle.slot, handle.ticket, now);
    }

    /// The owner of `worker_url`'s retention refreshed this prefix there at `now`: the
    /// prediction in the index and the retention model follow, as after this replica's own.
    pub fn apply_peer_refresh(&mut self, worker_url: &str, block_hashes: &[u64], now: f64) {
        let Some(member) = self.members.iter().find(|m| m.url == worker_url) else {
            return;
        };
        let (slot, name) = (member.slot, member.name.clone());
        let mut index = lock_index(&self.index);
        let id = index.ensure_worker(&name);
        index.record_routed_to(id, block_hashes, now);
        drop(index);
        if let Some(r) = self.retention.as_mut() {
            r.refreshed_elsewhere(slot, block_hashes);
        }
    }
}
