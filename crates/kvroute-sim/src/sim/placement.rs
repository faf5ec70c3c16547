//! The seam between a driver that runs engines (the simulator) and whatever decides which
//! worker gets each request (`kvroute_core::routing::RoutingStep`, the step the live router runs
//! too). The driver tells it about the life of each request, it answers where to send it.

use kvroute_core::index::KvIndex;
use kvroute_core::kvevents::events::KvCacheEvent;
use kvroute_core::policies::Choose;
use kvroute_core::retention::{Refresh, Retention};
use kvroute_core::routing::{Routed, RoutingStep};

use crate::hash_events::{HashEvents, apply_hash_events, trusts_engine_hashes};

/// Where a request was placed, and what the placement charged to that worker's load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    /// Index of the chosen worker.
    pub worker: usize,
    /// Prompt tokens the worker still has to prefill after the overlap the index credits it
    /// with (at least 1): carried in its load until the request's first token.
    pub prefill_tokens: usize,
    /// Its ticket in the routing step's KV-admission model, if it keeps one.
    pub ticket: Option<u64>,
    /// The placement's own number for the decision, to find it again at its first token and
    /// end (0 for a placement that needs none; see `super::replicas`).
    pub decision: u64,
}

impl Placed {
    /// What the routing step's decision `routed` charged, as decision number `decision`.
    pub fn from_routed(routed: &Routed, decision: u64) -> Self {
        Self {
            worker: routed.worker,
            prefill_tokens: routed.prefill_tokens,
            ticket: routed.ticket,
            decision,
        }
    }
}

/// Decides where requests go and keeps the load accounting that decision needs.
pub trait Placement {
    /// Whether it wants the workers' KV events (the engines then emit them, which costs
    /// the simulator its coalesced decode runs).
    fn wants_events(&self) -> bool;
    /// Choose a worker for a prompt with these block hashes and length, at time `now`
    /// (seconds, never decreasing), and count it in flight there.
    fn place(&mut self, block_hashes: &[u64], prompt_tokens: usize, now: f64) -> Placed;
    /// The request placed as `placed` produced its first token (its prefill is done).
    fn first_token(&mut self, placed: Placed);
    /// The request placed as `placed` finished at `now`.
    fn finished(&mut self, placed: Placed, now: f64);
    /// KV events worker `worker` published at the end of a step ending at `now`.
    fn apply_events(&mut self, worker: usize, events: &[KvCacheEvent], now: f64);
    /// Whether it takes the workers' KV events as [`HashEvents`] (hashes only, far cheaper
    /// for the engines to emit) through [`Placement::apply_hash_events`] instead: only a
    /// placement whose index trusts the engines' hashes; none by default.
    fn wants_hash_events(&self) -> bool {
        false
    }
    /// KV events worker `worker` published at the end of a step ending at `now`, as hash
    /// events (called instead of `apply_events` only when `wants_hash_events`).
    fn apply_hash_events(&mut self, _worker: usize, _events: &HashEvents, _now: f64) {}
    /// [`Placement::place`] with the prompt's tokens (its shared head, then the rest: the
    /// simulator never joins them), output budget and LoRA adapter
    /// (`kvroute_core::policies::adapter_id`; None: the base model), for a placement that keeps more
    /// than hashes (retention's refresh prompts, the workers' LoRA slots).
    fn place_request(
        &mut self,
        block_hashes: &[u64],
        prompt_head: &[u32],
        prompt_tail: &[u32],
        _output_tokens: usize,
        _adapter: Option<u64>,
        now: f64,
    ) -> Placed {
        self.place(block_hashes, prompt_head.len() + prompt_tail.len(), now)
    }
    /// Refreshes to send now (see `kvroute_core::retention`), appended to `out`; none by default.
    fn refreshes(&mut self, _now: f64, _out: &mut Vec<Refresh>) {}
}

/// A routing step with its index and policy, borrowed as the [`Placement`] the simulator's
/// native loop drives (simulated worker `i` is the step's slot `i`). Borrowed, not owned, so
/// a driver that keeps them between runs (the Python `kvroute.sim.Simulation`) can look at
/// them afterwards.
pub struct StepPlacement<'a> {
    /// The step (load accounting, journal).
    pub step: &'a mut RoutingStep,
    /// The router's index (None: the policy needs none and events are not wanted).
    pub index: Option<&'a mut KvIndex>,
    /// The policy.
    pub policy: &'a mut dyn Choose,
}

impl StepPlacement<'_> {
    /// The step's decision for a request under `adapter`.
    fn route(
        &mut self,
        block_hashes: &[u64],
        prompt_tokens: usize,
        adapter: Option<u64>,
        now: f64,
    ) -> Placed {
        let r = self.step.route(
            self.index.as_deref_mut(),
            self.policy,
            block_hashes,
            prompt_tokens,
            adapter,
            None,
            now,
        );
        Placed::from_routed(&r, 0)
    }
}

impl Placement for StepPlacement<'_> {
    fn wants_events(&self) -> bool {
        self.index.is_some()
    }

    fn place(&mut self, block_hashes: &[u64], prompt_tokens: usize, now: f64) -> Placed {
        self.route(block_hashes, prompt_tokens, None, now)
    }

    fn place_request(
        &mut self,
        block_hashes: &[u64],
        prompt_head: &[u32],
        prompt_tail: &[u32],
        _output_tokens: usize,
        adapter: Option<u64>,
        now: f64,
    ) -> Placed {
        let prompt_tokens = prompt_head.len() + prompt_tail.len();
        self.route(block_hashes, prompt_tokens, adapter, now)
    }

    fn first_token(&mut self, placed: Placed) {
        self.step.first_token(placed.worker, placed.prefill_tokens);
    }

    fn finished(&mut self, placed: Placed, now: f64) {
        self.step.finished(placed.worker, placed.ticket, now);
    }

    fn apply_events(&mut self, worker: usize, events: &[KvCacheEvent], now: f64) {
        if let Some(index) = self.index.as_deref_mut() {
            self.step.apply_events(index, worker, events, now);
        }
    }

    /// Hash events when the index trusts the engines' hashes, unless the step keeps a
    /// journal (which records full events).
    fn wants_hash_events(&self) -> bool {
        !self.step.is_journaling() && self.index.as_deref().is_some_and(trusts_engine_hashes)
    }

    fn apply_hash_events(&mut self, worker: usize, events: &HashEvents, _now: f64) {
        if let Some(index) = self.index.as_deref_mut() {
            let id = index.ensure_worker(&self.step.state(worker).name);
            apply_hash_events(index, id, events);
        }
    }
}

/// A routing step's placement with retention beside it: the simulator's hook. Every request
/// is routed by the step (as [`StepPlacement`] does); before it is forwarded, the retention
/// is asked which of the chosen worker's prefixes that request's new blocks would push out,
/// and those refreshes are handed to the driver first ([`Placement::refreshes`]), so they
/// reach a busy engine just ahead of the request and ride in its next step; and when a
/// worker's last request finishes, it is asked again ([`Retention::poll_idle`]).
pub struct RetainingPlacement<'a> {
    /// The routing step, its index and policy.
    pub placement: StepPlacement<'a>,
    /// The retention state machine.
    pub retention: &'a mut Retention,
    pending: Vec<Refresh>,
}

impl<'a> RetainingPlacement<'a> {
    /// `placement` with `retention` beside it.
    pub fn new(placement: StepPlacement<'a>, retention: &'a mut Retention) -> Self {
        Self {
            placement,
            retention,
            pending: Vec::new(),
        }
    }
}

impl Placement for RetainingPlacement<'_> {
    fn wants_events(&self) -> bool {
        self.placement.wants_events()
    }

    fn place(&mut self, block_hashes: &[u64], prompt_tokens: usize, now: f64) -> Placed {
        self.placement.place(block_hashes, prompt_tokens, now)
    }

    fn place_request(
        &mut self,
        block_hashes: &[u64],
        prompt_head: &[u32],
        prompt_tail: &[u32],
        output_tokens: usize,
        adapter: Option<u64>,
        now: f64,
    ) -> Placed {
        // The model keeps prefix tokens for refresh prompts: the whole prompt, joined here
        // (only with retention on; the simulator otherwise never copies a shared prefix).
        let prompt = [prompt_head, prompt_tail].concat();
        let r = route_retaining(
            &mut self.placement,
            self.retention,
            |_| true,
            block_hashes,
            &prompt,
            output_tokens,
            adapter,
            now,
            &mut self.pending,
        );
        Placed::from_routed(&r, 0)
    }

    fn first_token(&mut self, placed: Placed) {
        self.placement.first_token(placed);
    }

    fn finished(&mut self, placed: Placed, now: f64) {
        self.placement.finished(placed, now);
        let p = &mut self.placement;
        self.retention.poll_idle(
            p.step,
            p.index.as_deref_mut(),
            placed.worker,
            now,
            &mut self.pending,
        );
    }

    fn apply_events(&mut self, worker: usize, events: &[KvCacheEvent], now: f64) {
        self.placement.apply_events(worker, events, now);
    }

    fn wants_hash_events(&self) -> bool {
        self.placement.wants_hash_events()
    }

    fn apply_hash_events(&mut self, worker: usize, events: &HashEvents, now: f64) {
        self.placement.apply_hash_events(worker, events, now);
    }

    fn refreshes(&mut self, _now: f64, out: &mut Vec<Refresh>) {
        out.append(&mut self.pending);
    }
}

/// Route one request with retention beside the step: a prompt cached nowhere goes where
/// retention makes room for it (`Retention::room_for`), any other as the policy chooses; then,
/// when this router sends the chosen worker's refreshes, the refreshes the request's
/// new blocks call for are appended to `refreshes`, and the retention model learns of it.
/// `owns` says whether this router sends a worker's (slot's) refreshes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn route_retaining(
    p: &mut StepPlacement<'_>,
    retention: &mut Retention,
    owns: impl Fn(usize) -> bool,
    block_hashes: &[u64],
    prompt: &[u32],
    output_tokens: usize,
    adapter: Option<u64>,
    now: f64,
    refreshes: &mut Vec<Refresh>,
) -> Routed {
    let bs = retention.config().block_size;
    let live = p.step.live_slots();
    let r = match retention.room_for(
        p.step,
        p.index.as_deref_mut(),
        live,
        block_hashes,
        adapter,
        now,
    ) {
        Some(worker) => p.step.route_to(
            p.index.as_deref_mut(),
            worker,
            block_hashes,
            prompt.len(),
            adapter,
            now,
        ),
        None => p.step.route(
            p.index.as_deref_mut(),
            p.policy,
            block_hashes,
            prompt.len(),
            adapter,
            None,
            now,
        ),
    };
    if owns(r.worker) {
        let incoming = (prompt.len() + output_tokens)
            .div_ceil(bs)
            .saturating_sub(r.overlap);
        retention.poll_step(
            p.step,
            p.index.as_deref_mut(),
            r.worker,
            incoming,
            now,
            refreshes,
        );
    }
    retention.routed(
        r.worker,
        block_hashes,
        prompt,
        r.overlap,
        output_tokens,
        now,
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::blocks::{BlockHasher, DEFAULT_HASH_SEED};
    use kvroute_core::policies::{KvAware, KvAwareConfig, Policy};
    use kvroute_core::pyrandom::PyRandom;

    #[test]
    fn load_accounting_follows_the_overlap() {
        let hasher = BlockHasher::new(16, DEFAULT_HASH_SEED).unwrap();
        let mut index = KvIndex::new(hasher, Some(2.0), None, None).unwrap();
        let mut policy = Policy::KvAware(Box::new(
            KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(0)).unwrap(),
        ));
        let mut step = RoutingStep::new(16);
        for i in 0..3 {
            step.add_worker(&format!("w{i}"));
        }
        let mut p = StepPlacement {
            step: &mut step,
            index: Some(&mut index),
            policy: &mut policy,
        };
        let tokens: Vec<u32> = (0..100).collect();
        let hashes = hasher.hash_blocks(&tokens, None, 0, None);
        let first = p.place(&hashes, 100, 0.0);
        assert_eq!(first.prefill_tokens, 100);
        p.first_token(first);
        p.finished(first, 0.0);
        // The prediction credits the same worker with the 6 blocks: 100 − 96 = 4 to prefill.
        let second = p.place(&hashes, 100, 0.1);
        assert_eq!(
            second,
            Placed {
                worker: first.worker,
                prefill_tokens: 4,
                ticket: None,
                decision: 0,
            }
        );
        assert_eq!(p.step.state(first.worker).in_flight_tokens, 4);
        p.step.remove_worker("w1");
        assert_eq!(p.step.live_slots(), &[0, 2]);
    }
}
