//! The seam between a driver that runs engines (the simulator) and whatever decides which
//! worker gets each request (`kvroute_core::routing::Router`, the routing operation the live
//! router runs too). The driver tells it about the life of each request, it answers where to
//! send it.

use kvroute_core::index::KvIndex;
use kvroute_core::kvevents::events::KvCacheEvent;
use kvroute_core::policies::Choose;
use kvroute_core::retention::Refresh;
use kvroute_core::routing::{Decision, Request, Router};

use crate::hash_events::{HashEvents, apply_hash_events, trusts_engine_hashes};

/// A routing decision as a placement made it (what it charged to the chosen worker's load,
/// and its admission ticket), with the placement's own number for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    /// The decision.
    pub decision: Decision,
    /// The placement's number for the decision, to find it again at its first token and end
    /// (0 for a placement that needs none; see `super::replicas`).
    pub serial: u64,
}

impl Placed {
    /// `decision`, unnumbered.
    pub fn new(decision: Decision) -> Self {
        Self {
            decision,
            serial: 0,
        }
    }

    /// The chosen worker's slot.
    pub fn worker(&self) -> usize {
        self.decision.worker
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
    /// A run ended: what the placement still holds in flight between its routers (the replica
    /// mesh's messages, `super::replicas`) is applied now, as if the time they take had
    /// passed, so that the next run over the same routers starts from a whole accounting;
    /// refreshes that calls for are not sent (their run is over). Nothing by default.
    fn settle(&mut self) {}
}

/// A router ([`Router`]: the routing step, its policy and retention) with its index,
/// borrowed as the [`Placement`] the simulator's native loop drives (simulated worker `i` is
/// the step's slot `i`). Borrowed, not owned, so that a driver that keeps them between runs
/// (the Python `kvroute.sim.Simulation`) can look at them afterwards.
///
/// With retention on, the refreshes a request's decision calls for are handed to the driver
/// before it is forwarded ([`Placement::refreshes`]), so they reach a busy engine just ahead
/// of the request and ride in its next step; so are those of a worker whose last request
/// finished.
pub struct RouterPlacement<'a, P> {
    /// The router.
    pub router: &'a mut Router<P>,
    /// The router's index (None: the policy needs none and events are not wanted).
    pub index: Option<&'a mut KvIndex>,
    pending: Vec<Refresh>,
}

impl<'a, P: Choose> RouterPlacement<'a, P> {
    /// `router` with `index`.
    pub fn new(router: &'a mut Router<P>, index: Option<&'a mut KvIndex>) -> Self {
        Self {
            router,
            index,
            pending: Vec::new(),
        }
    }

    /// The router's decision for `request` among all the workers, its refreshes kept for
    /// the driver.
    fn route(&mut self, request: &Request<'_>, now: f64) -> Placed {
        let decision = self.router.route(
            self.index.as_deref_mut(),
            request,
            None,
            now,
            &mut self.pending,
        );
        Placed::new(decision)
    }
}

impl<P: Choose> Placement for RouterPlacement<'_, P> {
    fn wants_events(&self) -> bool {
        self.index.is_some()
    }

    fn place(&mut self, block_hashes: &[u64], prompt_tokens: usize, now: f64) -> Placed {
        let request = Request {
            block_hashes,
            prompt_tokens,
            ..Request::default()
        };
        self.route(&request, now)
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
        let prompt = joined_for(self.router, prompt_head, prompt_tail);
        let request = Request {
            block_hashes,
            prompt: &prompt,
            prompt_tokens: prompt_head.len() + prompt_tail.len(),
            output_tokens,
            adapter,
        };
        self.route(&request, now)
    }

    fn first_token(&mut self, placed: Placed) {
        self.router
            .first_token(placed.worker(), placed.decision.prefill_tokens);
    }

    fn finished(&mut self, placed: Placed, now: f64) {
        if let Some(poll) = self
            .router
            .finished(placed.worker(), placed.decision.ticket, now)
        {
            self.router
                .poll_idle(self.index.as_deref_mut(), poll, &mut self.pending);
        }
    }

    fn apply_events(&mut self, worker: usize, events: &[KvCacheEvent], now: f64) {
        if let Some(index) = self.index.as_deref_mut() {
            self.router.apply_events(index, worker, events, now);
        }
    }

    /// Hash events when the index trusts the engines' hashes, unless the step keeps a
    /// journal (which records full events).
    fn wants_hash_events(&self) -> bool {
        !self.router.step().is_journaling()
            && self.index.as_deref().is_some_and(trusts_engine_hashes)
    }

    fn apply_hash_events(&mut self, worker: usize, events: &HashEvents, _now: f64) {
        if let Some(index) = self.index.as_deref_mut() {
            let id = index.ensure_worker(&self.router.step().state(worker).name);
            apply_hash_events(index, id, events);
        }
    }

    fn refreshes(&mut self, _now: f64, out: &mut Vec<Refresh>) {
        out.append(&mut self.pending);
    }
}

/// A prompt's tokens (its shared head, then the rest) as `router` needs them: joined when its
/// retention keeps prefix tokens for refresh prompts, else none (the simulator otherwise never
/// copies a shared prefix).
pub(crate) fn joined_for<P: Choose>(
    router: &Router<P>,
    prompt_head: &[u32],
    prompt_tail: &[u32],
) -> Vec<u32> {
    if router.retention().is_some() {
        [prompt_head, prompt_tail].concat()
    } else {
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::blocks::{BlockHasher, DEFAULT_HASH_SEED};
    use kvroute_core::policies::{KvAware, KvAwareConfig, Policy};
    use kvroute_core::pyrandom::PyRandom;
    use kvroute_core::routing::RoutingStep;

    #[test]
    fn load_accounting_follows_the_overlap() {
        let hasher = BlockHasher::new(16, DEFAULT_HASH_SEED).unwrap();
        let mut index = KvIndex::new(hasher, Some(2.0), None, None).unwrap();
        let policy = Policy::KvAware(Box::new(
            KvAware::new(KvAwareConfig::default(), PyRandom::from_seed(0)).unwrap(),
        ));
        let mut step = RoutingStep::new(16);
        for i in 0..3 {
            step.add_worker(&format!("w{i}"));
        }
        let mut router = Router::new(step, policy, None);
        let mut p = RouterPlacement::new(&mut router, Some(&mut index));
        let tokens: Vec<u32> = (0..100).collect();
        let hashes = hasher.hash_blocks(&tokens, None, 0, None);
        let first = p.place(&hashes, 100, 0.0);
        assert_eq!(first.decision.prefill_tokens, 100);
        p.first_token(first);
        p.finished(first, 0.0);
        // The prediction credits the same worker with the 6 blocks: 100 − 96 = 4 to prefill.
        let second = p.place(&hashes, 100, 0.1);
        assert_eq!(
            second,
            Placed::new(Decision {
                worker: first.worker(),
                overlap: 6,
                prefill_tokens: 4,
                ticket: None,
            })
        );
        assert_eq!(p.router.step().state(first.worker()).in_flight_tokens, 4);
        p.router.step_mut().remove_worker("w1");
        assert_eq!(p.router.step().live_slots(), &[0, 2]);
    }
}
