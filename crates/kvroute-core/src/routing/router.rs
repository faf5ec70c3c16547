//! The one routing operation: a [`RoutingStep`] with its policy and retention, which the live
//! router's fleet (`kvroute-serve`), the simulator's placements and replicas (`kvroute-sim`)
//! and the replica mesh only call, so that none of them can route otherwise than the others.
//!
//! The [`Router`] owns the step (load accounting, admission, the workers' LoRA slots), the
//! policy and the retention model; the index is lent to each call (the live router shares it
//! with its KV-event consumer's thread, the simulator with its engines' events). What it does:
//!
//! - **route** ([`Router::route`]): a request with retention on that the index finds cached
//!   on none of the candidates goes where retention makes room for it
//!   (`Retention::room_for`), any other where the policy chooses; then the step counts the
//!   decision, and retention's model learns of it, after polling the chosen worker for the
//!   refreshes its new blocks call for (sent ahead of the request);
//! - **first token** and **finished** ([`Router::first_token`], [`Router::finished`]): the
//!   load leaves the worker; a worker left idle may be due the refreshes `auto` spared it
//!   ([`IdlePoll`], [`Router::poll_idle`]);
//! - **a peer replica's decision** ([`Router::apply_peer`]): counted as if made here (the
//!   step's accounting, the policy's observation among the candidates it would have chosen
//!   from, retention's model), its first token and end ([`Router::peer_first_token`],
//!   [`Router::peer_finished`]), a decision in flight that a snapshot lists
//!   ([`Router::adopt_open`]), and a peer's refresh ([`Router::apply_peer_refresh`]).
//!
//! One rule for retention, wherever a decision comes from:
//!
//! - retention applies to a request ([`Router::retains`]) when it is on and the request
//!   carries its prompt's tokens and at least one block hash (a text prompt whose tokens the
//!   front does not know, or a prompt shorter than a block, is routed by the policy alone and
//!   left out of the model);
//! - the refreshes a worker's decisions and idleness call for are asked (and so sent) only
//!   by the router that owns that worker's retention ([`Router::set_retention_owned`]: all of
//!   them without a mesh, one replica per worker with it), while every router's model learns
//!   of every decision it sees, and of the owner's refreshes through the mesh.

use std::collections::HashSet;

use super::step::{Decision, Request, RoutingStep};
use crate::index::KvIndex;
use crate::kvevents::events::KvCacheEvent;
use crate::mesh::{DecisionHandle, OpenEntry, PeerDecision};
use crate::policies::{Choose, Policy, RequestView, WorkerState};
use crate::retention::{Refresh, Retention};

impl<'a> From<&PeerDecision<'a>> for Request<'a> {
    fn from(d: &PeerDecision<'a>) -> Self {
        Self {
            block_hashes: d.block_hashes,
            prompt: d.prompt,
            prompt_tokens: d.prompt_tokens,
            output_tokens: d.output_tokens,
            adapter: d.adapter,
        }
    }
}

/// A worker whose last request just finished and whose retention this router owns: due
/// retention's idle poll ([`Router::poll_idle`]), which the caller makes when it can still
/// send refreshes there (the live router skips a worker that went unavailable meanwhile).
#[must_use = "an idle worker's refreshes are sent only by polling it"]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct IdlePoll {
    worker: usize,
    now: f64,
}

impl IdlePoll {
    /// The idle worker's slot.
    pub fn worker(&self) -> usize {
        self.worker
    }
}

/// The routing step, its policy and its retention model: the one routing operation (see the
/// module docs).
#[derive(Clone, Debug)]
pub struct Router<P = Policy> {
    step: RoutingStep,
    policy: P,
    retention: Option<Retention>,
    /// The slots whose retention this router owns (None: all).
    owned: Option<HashSet<usize>>,
}

impl<P: Choose> Router<P> {
    /// A router of `step` (its workers, admission and LoRA models as set), `policy`, and
    /// `retention` (None: off), owning every worker's retention.
    pub fn new(step: RoutingStep, policy: P, retention: Option<Retention>) -> Self {
        Self {
            step,
            policy,
            retention,
            owned: None,
        }
    }

    /// The step, the policy and the retention model back (a driver that lends them for a
    /// run keeps them between runs).
    pub fn into_parts(self) -> (RoutingStep, P, Option<Retention>) {
        (self.step, self.policy, self.retention)
    }

    /// The routing step.
    pub fn step(&self) -> &RoutingStep {
        &self.step
    }

    /// The routing step, to add and remove workers and set its models up.
    pub fn step_mut(&mut self) -> &mut RoutingStep {
        &mut self.step
    }

    /// The policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// The policy, to hand its state over (a snapshot's shares).
    pub fn policy_mut(&mut self) -> &mut P {
        &mut self.policy
    }

    /// The retention model (None: retention off).
    pub fn retention(&self) -> Option<&Retention> {
        self.retention.as_ref()
    }

    /// Own the retention of the slots in `owned` only (None: all).
    pub fn set_retention_owned(&mut self, owned: Option<HashSet<usize>>) {
        self.owned = owned;
    }

    /// Whether this router asks for (and so sends) `slot`'s refreshes.
    pub fn owns_retention(&self, slot: usize) -> bool {
        self.owned.as_ref().is_none_or(|o| o.contains(&slot))
    }

    /// Whether retention applies to `request`: it is on, and the request carries its
    /// prompt's tokens and at least one block hash.
    pub fn retains(&self, request: &Request<'_>) -> bool {
        self.retention.is_some() && !request.prompt.is_empty() && !request.block_hashes.is_empty()
    }

    /// Route `request` among `candidates` (slots, in the order the policy sees them; None:
    /// every worker in the step) at `now`, the refreshes to send the chosen worker ahead of it
    /// appended to `refreshes` (see the module docs). Panics when there is no candidate.
    pub fn route(
        &mut self,
        mut index: Option<&mut KvIndex>,
        request: &Request<'_>,
        candidates: Option<&[usize]>,
        now: f64,
        refreshes: &mut Vec<Refresh>,
    ) -> Decision {
        let retains = self.retains(request);
        let room = match &self.retention {
            Some(r) if retains => r.room_for(
                &self.step,
                index.as_deref_mut(),
                candidates.unwrap_or(self.step.live_slots()),
                request.block_hashes,
                request.adapter,
                now,
            ),
            _ => None,
        };
        let decision = match room {
            Some(worker) => self.step.route_to(
                index.as_deref_mut(),
                worker,
                request.block_hashes,
                request.prompt_tokens,
                request.adapter,
                now,
            ),
            None => self.step.route(
                index.as_deref_mut(),
                &mut self.policy,
                request,
                candidates,
                now,
            ),
        };
        if retains {
            self.retain(
                index,
                decision.worker,
                request,
                decision.overlap,
                now,
                refreshes,
            );
        }
        decision
    }

    /// Retention's side of a decision for `request` to `worker`, credited with `overlap`
    /// blocks: the owner's poll for the refreshes its new blocks call for, then the model's
    /// update.
    fn retain(
        &mut self,
        index: Option<&mut KvIndex>,
        worker: usize,
        request: &Request<'_>,
        overlap: usize,
        now: f64,
        refreshes: &mut Vec<Refresh>,
    ) {
        let owned = self.owns_retention(worker);
        let Some(r) = &mut self.retention else {
            return;
        };
        if owned {
            let incoming = (request.prompt.len() + request.output_tokens)
                .div_ceil(self.step.block_size())
                .saturating_sub(overlap);
            r.poll_step(&self.step, index, worker, incoming, now, refreshes);
        }
        r.routed(
            worker,
            request.block_hashes,
            request.prompt,
            overlap,
            request.output_tokens,
            now,
        );
    }

    /// The request routed to `worker` with `prefill_tokens` produced its first token.
    pub fn first_token(&mut self, worker: usize, prefill_tokens: usize) {
        self.step.first_token(worker, prefill_tokens);
    }

    /// A request routed to `worker` (with `ticket`, see [`Decision`]) finished at `now`; the
    /// idle poll it makes `worker` due, if any.
    pub fn finished(&mut self, worker: usize, ticket: Option<u64>, now: f64) -> Option<IdlePoll> {
        self.step.finished(worker, ticket, now);
        let r = self.retention.as_ref()?;
        (self.owns_retention(worker) && r.polls_idle(&self.step, worker))
            .then_some(IdlePoll { worker, now })
    }

    /// Retention's refreshes for a worker fallen idle (`Retention::poll_idle`), appended to
    /// `out`.
    pub fn poll_idle(
        &mut self,
        index: Option<&mut KvIndex>,
        poll: IdlePoll,
        out: &mut Vec<Refresh>,
    ) {
        if let Some(r) = &mut self.retention {
            r.poll_idle(&self.step, index, poll.worker, poll.now, out);
        }
    }

    /// Apply `worker`'s KV events to the index (at `now`, for the step's journal).
    pub fn apply_events(
        &mut self,
        index: &mut KvIndex,
        worker: usize,
        events: &[KvCacheEvent],
        now: f64,
    ) {
        self.step.apply_events(index, worker, events, now);
    }

    /// `slot`'s engine has `blocks` usable KV blocks: the admission model and retention
    /// count its cache by them.
    pub fn set_kv_capacity(&mut self, slot: usize, blocks: usize) {
        self.step.set_kv_capacity(slot, blocks);
        if let Some(r) = &mut self.retention {
            r.set_capacity(slot, blocks);
        }
    }

    /// Apply a peer replica's decision `peer` (to slot `slot`) at `now` as if this router had made
    /// it; `candidates` are the slots the policy would have chosen from. The refreshes it
    /// calls for (when this router owns `slot`'s retention) are appended to `refreshes`.
    /// Returns the handle that releases its load at its first token and end.
    pub fn apply_peer(
        &mut self,
        mut index: Option<&mut KvIndex>,
        slot: usize,
        candidates: &[usize],
        peer: &PeerDecision<'_>,
        now: f64,
        refreshes: &mut Vec<Refresh>,
    ) -> DecisionHandle {
        let request = Request::from(peer);
        let decision = self.step.route_to(
            index.as_deref_mut(),
            slot,
            request.block_hashes,
            request.prompt_tokens,
            request.adapter,
            now,
        );
        if let Some(chosen) = candidates.iter().position(|&s| s == slot) {
            let states: Vec<&WorkerState> =
                candidates.iter().map(|&s| self.step.state(s)).collect();
            self.policy.observe(&states, chosen);
        }
        if self.retains(&request) {
            self.retain(index, slot, &request, peer.overlap, now, refreshes);
        }
        DecisionHandle {
            decision,
            first_token: false,
        }
    }

    /// A decision in flight that an adopted snapshot lists (`crate::mesh::adopt`), applied to
    /// `slot` at `now`: its load and prediction as a peer's decision's, with its prefill
    /// released at once if its first token came; the policy's shares and the retention model
    /// are left as the snapshot's shares have them. A snapshot names no adapter, so the
    /// decision leaves the worker's modelled LoRA slots as they are (the next decisions for it
    /// fill them).
    pub fn adopt_open(
        &mut self,
        index: Option<&mut KvIndex>,
        slot: usize,
        entry: &OpenEntry,
        now: f64,
    ) -> DecisionHandle {
        let decision = self.step.route_to(
            index,
            slot,
            &entry.block_hashes,
            entry.prompt_tokens as usize,
            None,
            now,
        );
        if entry.first_token {
            self.step.first_token(slot, decision.prefill_tokens);
        }
        DecisionHandle {
            decision,
            first_token: entry.first_token,
        }
    }

    /// A peer decision applied as `handle` got its first token: its prefill leaves the load.
    pub fn peer_first_token(&mut self, handle: &DecisionHandle) {
        let d = &handle.decision;
        self.step.first_token(d.worker, d.prefill_tokens);
    }

    /// A peer decision applied as `handle` ended (or expired) at `now`: release what it
    /// charged.
    pub fn peer_finished(&mut self, handle: DecisionHandle, now: f64) {
        let d = handle.decision;
        if !handle.first_token {
            self.step.first_token(d.worker, d.prefill_tokens);
        }
        self.step.finished(d.worker, d.ticket, now);
    }

    /// The owner of `slot`'s retention refreshed the prefix of these block hashes there at
    /// `now`: the prediction in the index and the retention model follow, as after this
    /// router's own refresh.
    pub fn apply_peer_refresh(
        &mut self,
        index: Option<&mut KvIndex>,
        slot: usize,
        block_hashes: &[u64],
        now: f64,
    ) {
        if let Some(index) = index {
            let id = index.ensure_worker(&self.step.state(slot).name);
            index.record_routed_to(id, block_hashes, now);
        }
        if let Some(r) = &mut self.retention {
            r.refreshed_elsewhere(slot, block_hashes);
        }
    }
}

/// A lent policy routes as the policy does: a driver that keeps its policy between runs (the
/// simulator's Python face) lends it to the router for a run.
impl<C: Choose + ?Sized> Choose for &mut C {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn needs_overlap(&self) -> bool {
        (**self).needs_overlap()
    }

    fn needs_admission(&self) -> bool {
        (**self).needs_admission()
    }

    fn choose(&mut self, request: &RequestView<'_>, workers: &[&WorkerState]) -> usize {
        (**self).choose(request, workers)
    }

    fn observe(&mut self, workers: &[&WorkerState], chosen: usize) {
        (**self).observe(workers, chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::{KvAware, KvAwareConfig};
    use crate::pyrandom::PyRandom;
    use crate::retention::{RetentionConfig, RetentionMode};

    /// A kv-aware router of workers `a` and `b` with retention in `mode` (None: off).
    fn router(mode: Option<RetentionMode>) -> Router {
        let mut step = RoutingStep::new(16);
        step.add_worker("a");
        step.add_worker("b");
        let policy = Policy::KvAware(Box::new(
            KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(0)).unwrap(),
        ));
        let retention = mode.map(|m| Retention::new(RetentionConfig::new(m, 16, 100)));
        Router::new(step, policy, retention)
    }

    #[test]
    fn retention_applies_to_a_prompt_with_its_tokens_and_a_block_only() {
        let tokens: Vec<u32> = (0..40).collect();
        let request = Request {
            block_hashes: &[1, 2],
            prompt: &tokens,
            prompt_tokens: 40,
            output_tokens: 8,
            adapter: None,
        };
        let on = router(Some(RetentionMode::Auto));
        assert!(on.retains(&request));
        let text = Request {
            prompt: &[],
            ..request
        };
        let short = Request {
            block_hashes: &[],
            ..request
        };
        assert!(!on.retains(&text) && !on.retains(&short));
        assert!(!router(None).retains(&request));
    }

    #[test]
    fn only_the_owner_of_a_workers_retention_polls_it_idle() {
        let mut r = router(Some(RetentionMode::Auto));
        r.set_retention_owned(Some(HashSet::from([0])));
        let mut refreshes = Vec::new();
        for (slot, owned) in [(0, true), (1, false)] {
            let d = r.route(
                None,
                &Request {
                    prompt_tokens: 16,
                    ..Request::default()
                },
                Some(&[slot]),
                0.0,
                &mut refreshes,
            );
            assert_eq!(d.worker, slot);
            r.first_token(slot, d.prefill_tokens);
            let poll = r.finished(slot, d.ticket, 1.0);
            assert_eq!(poll.map(|p| p.worker()), owned.then_some(slot));
        }
        let mut off = router(None);
        let d = off.route(None, &Request::default(), None, 0.0, &mut refreshes);
        assert_eq!(off.finished(d.worker, d.ticket, 1.0), None);
        assert!(refreshes.is_empty());
    }
}
