//! The fleet's side of the replica mesh (`kvroute_core::mesh`): a peer replica's decisions
//! and refreshes applied to this replica's routing step, index and retention model as if it
//! had made them, which workers' retention this replica owns, and the policy state and open
//! decisions a snapshot hands to a replica that has just started.
//!
//! A peer's decision is applied by the routing operation's rule
//! (`kvroute_core::routing::Router::apply_peer`, which the simulator's replicas follow too),
//! with the tenant its refreshes will carry remembered here. Workers are named by URL between
//! replicas: every replica reaches a worker at the same address, whatever name its discovery
//! gives it.

use std::collections::HashSet;

use kvroute_core::mesh::{DecisionHandle, OpenEntry, PeerDecision};
use kvroute_core::policies::Policy;
use kvroute_core::routing::Request;
use kvroute_io::consumer::lock_index;

use super::routing::IdleRefreshes;
use super::state::Fleet;
use super::tenants::RefreshTenant;

impl Fleet {
    /// The worker URLs whose retention this replica owns (None: all, no mesh).
    pub fn set_retention_owned(&mut self, owned: Option<HashSet<String>>) {
        self.retention_owned = owned;
        self.share_retention_owned();
    }

    /// Tell the router the slots of the workers whose retention this replica owns (after the
    /// owned URLs or the members changed).
    pub(super) fn share_retention_owned(&mut self) {
        let owned = self.retention_owned.as_ref().map(|urls| {
            self.members
                .iter()
                .filter(|m| urls.contains(&m.url))
                .map(|m| m.slot)
                .collect()
        });
        self.router.set_retention_owned(owned);
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
        worker_url: &str,
        peer: &PeerDecision<'_>,
        tenant: RefreshTenant,
        now: f64,
    ) -> (Option<DecisionHandle>, Option<IdleRefreshes>) {
        let Some(member) = self.members.iter().find(|m| m.url == worker_url) else {
            return (None, None);
        };
        let (slot, name, url) = (member.slot, member.name.clone(), member.url.clone());
        // The body names the model; whether it is an adapter is this fleet's knowledge.
        let adapter = self.adapter_of(tenant.model.as_deref());
        let peer = &PeerDecision { adapter, ..*peer };
        if self.router.retains(&Request::from(peer)) {
            self.tenants.remember(peer.block_hashes[0], tenant);
        }
        // The policy counts the peer's choice among the workers it would have chosen from.
        let candidates: Vec<usize> = self
            .members
            .iter()
            .filter(|m| m.available(now))
            .map(|m| m.slot)
            .collect();
        let mut refreshes = Vec::new();
        let mut index = lock_index(&self.index);
        let handle = self.router.apply_peer(
            Some(&mut index),
            slot,
            &candidates,
            peer,
            now,
            &mut refreshes,
        );
        drop(index);
        let refreshes = (!refreshes.is_empty()).then(|| IdleRefreshes {
            name,
            url,
            tenants: self.tenants.of(&refreshes),
            refreshes,
        });
        (Some(handle), refreshes)
    }

    /// A peer's decision got its first token: its prefill leaves the worker's load.
    pub fn peer_first_token(&mut self, handle: &DecisionHandle) {
        self.router.peer_first_token(handle);
    }

    /// A peer's decision ended (or expired) at `now`: release what it charged.
    pub fn peer_finished(&mut self, handle: DecisionHandle, now: f64) {
        self.router.peer_finished(handle, now);
    }

    /// The owner of `worker_url`'s retention refreshed this prefix there at `now`: the
    /// prediction in the index and the retention model follow, as after this replica's own.
    pub fn apply_peer_refresh(&mut self, worker_url: &str, block_hashes: &[u64], now: f64) {
        let Some(member) = self.members.iter().find(|m| m.url == worker_url) else {
            return;
        };
        let slot = member.slot;
        let mut index = lock_index(&self.index);
        self.router
            .apply_peer_refresh(Some(&mut index), slot, block_hashes, now);
    }

    /// kv-aware's recent shares by worker URL and the decisions they counted, for a
    /// snapshot (empty for the other policies, which keep no such state).
    pub fn recent_shares(&self) -> (Vec<(String, f64)>, u64) {
        let Policy::KvAware(p) = self.router.policy() else {
            return (Vec::new(), 0);
        };
        let shares = p
            .recent_shares()
            .filter_map(|(name, share)| {
                let member = self.members.iter().find(|m| m.name == name)?;
                Some((member.url.clone(), share))
            })
            .collect();
        (shares, p.share_decisions())
    }

    /// Take a peer's recent shares (by worker URL; workers not known here are left out, a
    /// share that is not a fraction refuses them all) and the decisions they counted.
    pub fn adopt_shares(&mut self, shares: &[(String, f64)], decisions: u64) {
        let Policy::KvAware(p) = self.router.policy_mut() else {
            return;
        };
        if shares.is_empty() || shares.iter().any(|(_, s)| !(0.0..=1.0).contains(s)) {
            return;
        }
        let by_name: Vec<(String, f64)> = shares
            .iter()
            .filter_map(|(url, share)| {
                let member = self.members.iter().find(|m| m.url == *url)?;
                Some((member.name.clone(), *share))
            })
            .collect();
        p.restore_shares(by_name, Some(decisions));
    }

    /// Apply a decision in flight that an adopted snapshot lists, at `now`: its handle to
    /// release at its end (None for a worker this replica does not know).
    pub fn adopt_open(&mut self, entry: &OpenEntry, now: f64) -> Option<DecisionHandle> {
        let slot = self.members.iter().find(|m| m.url == entry.worker)?.slot;
        let mut index = lock_index(&self.index);
        Some(self.router.adopt_open(Some(&mut index), slot, entry, now))
    }
}
