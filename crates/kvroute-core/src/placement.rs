//! The seam between a driver that runs engines (the simulator) and whatever decides which
//! worker gets each request (`crate::routing::RoutingStep`, the step the live router runs
//! too). The driver tells it about the life of each request, it answers where to send it.

use crate::kvevents::events::{HashEvents, KvCacheEvent};
use crate::retention::Refresh;

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
    /// simulator never joins them) and output budget, for a placement that keeps more than
    /// hashes (retention's refresh prompts).
    fn place_request(
        &mut self,
        block_hashes: &[u64],
        prompt_head: &[u32],
        prompt_tail: &[u32],
        _output_tokens: usize,
        now: f64,
    ) -> Placed {
        self.place(block_hashes, prompt_head.len() + prompt_tail.len(), now)
    }
    /// Refreshes to send now (see `crate::retention`), appended to `out`; none by default.
    fn refreshes(&mut self, _now: f64, _out: &mut Vec<Refresh>) {}
}
