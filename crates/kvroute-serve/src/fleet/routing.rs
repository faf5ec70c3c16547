//! The fleet's routing glue: the candidates (available, serving the request's model, not
//! tried yet) and the request as `kvroute_core::routing::Router` routes it, the worker's
//! address and the refreshes to send with each decision, and the figures the metrics read.

use kvroute_core::policies::{Policy, WorkerState};
use kvroute_core::retention::{Refresh, RetentionStats};
use kvroute_core::routing::{Decision, Request};
use kvroute_io::consumer::lock_index;

use super::state::Fleet;
use super::tenants::RefreshTenant;
use crate::prompt::Retained;

/// A routing decision with what the server needs to carry it out: the worker's address and
/// the refreshes to send it first.
#[derive(Clone, Debug, PartialEq)]
pub struct Dispatch {
    /// The decision: the worker's routing-step slot, its ticket in the admission model (both
    /// what [`Fleet::first_token`] and [`Fleet::finished`] take), the prompt tokens charged to
    /// its load until the first response byte, the leading prompt blocks the index credited it
    /// with.
    pub decision: Decision,
    /// The worker's name and base URL.
    pub name: String,
    pub url: String,
    /// Refreshes retention sends that worker ahead of this request (their prompts).
    pub refreshes: Vec<Refresh>,
    /// Whose prefix each refresh keeps (its `model` and `cache_salt`), in the same order.
    pub refresh_tenants: Vec<RefreshTenant>,
}

/// Refreshes for a worker whose last request just finished ([`Fleet::finished`]).
#[derive(Clone, Debug, PartialEq)]
pub struct IdleRefreshes {
    /// The worker's name and base URL.
    pub name: String,
    pub url: String,
    pub refreshes: Vec<Refresh>,
    /// Whose prefix each refresh keeps, in the same order.
    pub tenants: Vec<RefreshTenant>,
}

/// One worker as the admission guard sees it ([`Fleet::admission_figures`]).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerAdmission<'a> {
    pub name: &'a str,
    /// The blocks the router's requests in flight pin there.
    pub pinned_blocks: usize,
}

impl Fleet {
    /// Route a prompt for `model` among the available workers that serve it and are not in
    /// `tried` (names), at `now` (monotonic seconds); None when there is no such worker. With
    /// retention on and a token-id prompt (`retained`), a prompt cached nowhere goes where it
    /// displaces least (`Retention::room_for`), and the dispatch carries the refreshes to send
    /// first, each with the tenant of the prefix it keeps.
    pub fn route(
        &mut self,
        block_hashes: &[u64],
        prompt_tokens: usize,
        tried: &[String],
        now: f64,
        retained: Option<&Retained>,
        model: Option<&str>,
    ) -> Option<Dispatch> {
        self.candidates.clear();
        self.candidates.extend(
            self.members
                .iter()
                .filter(|m| m.available(now) && m.serves(model) && !tried.contains(&m.name))
                .map(|m| m.slot),
        );
        if self.candidates.is_empty() {
            return None;
        }
        let request = Request {
            block_hashes,
            prompt: retained.map_or(&[], |r| &r.ids),
            prompt_tokens,
            output_tokens: retained.map_or(0, |r| r.output_tokens),
            adapter: self.adapter_of(model),
        };
        if let Some(r) = retained
            && self.router.retains(&request)
        {
            let tenant = RefreshTenant {
                model: r.model.clone(),
                cache_salt: r.cache_salt.clone(),
            };
            self.tenants.remember(block_hashes[0], tenant);
        }
        let mut refreshes = Vec::new();
        let mut index = self.index_lock.lock(&self.index);
        let decision = self.router.route(
            Some(&mut index),
            &request,
            Some(&self.candidates),
            now,
            &mut refreshes,
        );
        drop(index);
        let member = self
            .members
            .iter()
            .find(|m| m.slot == decision.worker)
            .expect("the router routes among the members' slots");
        Some(Dispatch {
            decision,
            name: member.name.clone(),
            url: member.url.clone(),
            refresh_tenants: self.tenants.of(&refreshes),
            refreshes,
        })
    }

    /// The request charged to `slot` got its first response byte.
    pub fn first_token(&mut self, slot: usize, prefill_tokens: usize) {
        self.router.first_token(slot, prefill_tokens);
    }

    /// The request charged to `slot` (with `ticket`, see [`Dispatch`]) ended (answered, failed
    /// or abandoned) at `now`. With retention on, a worker left with no request gets the
    /// refreshes it was spared while requests were going to it idle (`Retention::poll_idle`):
    /// to send now, if it is still available.
    pub fn finished(
        &mut self,
        slot: usize,
        ticket: Option<u64>,
        now: f64,
    ) -> Option<IdleRefreshes> {
        // Most finishes call for no poll: no index lock taken.
        let poll = self.router.finished(slot, ticket, now)?;
        let member = self
            .members
            .iter()
            .find(|m| m.slot == slot && m.available(now))?;
        let (name, url) = (member.name.clone(), member.url.clone());
        let mut refreshes = Vec::new();
        let mut index = lock_index(&self.index);
        self.router
            .poll_idle(Some(&mut index), poll, &mut refreshes);
        drop(index);
        (!refreshes.is_empty()).then(|| IdleRefreshes {
            name,
            url,
            tenants: self.tenants.of(&refreshes),
            refreshes,
        })
    }

    /// `(event-backed entries, predicted entries, evicted entries)` of the index (predicted
    /// entries as of the last routing decision).
    pub fn index_figures(&self) -> (usize, usize, u64) {
        let s = lock_index(&self.index).stats();
        (s.blocks, s.predicted, s.evicted_blocks)
    }

    /// The admission guard's view, None without one: decisions it moved (cumulative), and
    /// the blocks each worker's requests in flight pin.
    pub fn admission_figures(&self) -> Option<(u64, Vec<WorkerAdmission<'_>>)> {
        let admission = self.router.step().admission()?;
        let diversions = match self.router.policy() {
            Policy::KvAware(p) => p.admission_diversions(),
            _ => 0,
        };
        let workers = self
            .members
            .iter()
            .map(|m| WorkerAdmission {
                name: &m.name,
                pinned_blocks: admission.pinned_blocks(m.slot),
            })
            .collect();
        Some((diversions, workers))
    }

    /// Retention's counters (None when it is off).
    pub fn retention_stats(&self) -> Option<RetentionStats> {
        self.router.retention().map(|r| r.stats())
    }

    /// The load accounting of `slot`: `(requests in flight, prompt tokens still to prefill)`.
    pub fn load(&self, slot: usize) -> (i64, i64) {
        let s = self.router.step().state(slot);
        (s.in_flight, s.in_flight_tokens)
    }

    /// The routing step's whole view of `slot`: its name, load and cached blocks (as of the
    /// last decision whose policy looked at the overlaps), what a policy sees; for comparing
    /// the router's step with the simulator's (`tests/routing_parity.rs`).
    pub fn state(&self, slot: usize) -> &WorkerState {
        self.router.step().state(slot)
    }
}
