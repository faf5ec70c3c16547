//! Retention: the router decides what each worker's prefix cache keeps, not only where each
//! request goes.
//!
//! vLLM's prefix cache is an LRU free queue (`FreeKVCacheBlockQueue`): a finished request
//! frees its blocks to the tail, new blocks are taken from the head. Every finished request
//! leaves its own suffix and output blocks in that queue, and those blocks are *newer* than a
//! shared prefix that sat idle for a few requests, so the LRU evicts the prefix — worth a
//! 2,000-token prefill on its next use — and keeps blocks nobody will ask for again. No
//! placement can fix that; the router can: a **refresh** is a minimal request (the prefix's
//! tokens plus one, `max_tokens` 1) that makes the engine touch the prefix's blocks (a full
//! hit, one token computed) and free them again to the MRU tail, behind the garbage.
//!
//! [`Retention`] is a pure state machine (time passed in, effects returned as data) fed with
//! what a live router knows and nothing else:
//!
//! * its own routing ([`Retention::routed`]): which worker got which prompt, how much of it the
//!   index credited (the overlap: the shared prefix), and its output budget;
//! * the worker's load as the routing step counts it
//!   ([`WorkerState`](crate::policies::WorkerState): requests in flight, prompt tokens still
//!   to prefill);
//! * the index (events and predictions), asked through a callback whether a prefix is still
//!   held before a refresh is sent ([`Retention::poll`]).
//!
//! From these it keeps, per worker, a model of the free queue's order as segments (a tracked
//! prefix, or "garbage": a request's own blocks), allocating each routed request's new blocks
//! from the head and freeing its blocks to the tail (garbage first, then the prefix, as vLLM's
//! reverse free order does). A prefix is *retained* when its demand (one use every so many of
//! the worker's requests) ranks it among those that fit the worker's capacity after a reserve
//! for the running requests' own blocks; a retained prefix whose distance to the head falls
//! under a margin of allocations (or that went `refresh_after_requests` of the worker's requests
//! untouched while the modelled cache is full) is refreshed; one whose tail the index says is
//! gone is refreshed as far as it is held. The model allocates at routing time (before the
//! engine does) and counts running requests' blocks as freed, so it errs early: a refresh
//! comes before the eviction, not after.
//!
//! Placement counts the model too ([`Retention::room_for`], used by the routing operation,
//! `crate::routing::Router`, which the simulator and the live router run): a prompt cached nowhere (its prefix new, or evicted everywhere) is
//! sent to the worker that is home to the fewest prefix families, among those running at most
//! `room_slack_requests` above the mean, so that a re-computed prefix lands where it displaces
//! the least.
//! Left to the policy it goes to the least loaded worker, which may already keep its share
//! of prefixes: the new copy evicts one of them, whose next request misses and is re-placed
//! in turn, a cascade.
//!
//! When a refresh goes matters as much as which: an engine steps as soon as anything
//! arrives, so a refresh written ahead of a request to an *idle* worker makes a step of its
//! own, which the request then waits out. The router polls at two moments: when it routes a
//! request ([`Retention::poll_step`]: the refreshes go ahead of it, and on a busy worker both
//! join its next step), and when a worker's last request finishes ([`Retention::poll_idle`]:
//! the refreshes find the engine idle, and nobody waits unless a request comes within that
//! one short step); `auto` sends nothing ahead of a request to an idle worker. `on` keeps to
//! the first moment.
//!
//! Modes ([`RetentionMode`]): `off` never refreshes; `on` refreshes a retained prefix as soon
//! as it is in danger; `auto` refreshes only when the worker has slack (no prompt waiting for
//! its prefill in the router's accounting, so the refresh's one token rides in a decode step
//! or an idle one), when the prefix's expected saving outweighs the refresh's cost, when no
//! other worker holds as much of it (a copy's loss costs no miss), and while refreshes pay as
//! measured. For that each worker's model has a twin, the same queue with no refresh ever sent
//! (the worker's plain LRU, fed the same requests): at each use of a tracked prefix the blocks
//! the request found held that the twin had evicted count as *saved*, the blocks the twin had
//! evicted as *pressure*; fleet-wide over about the last 256 requests, `auto` refreshes only
//! while the pressure is at least [`RetentionConfig::pressure_tokens`] a use and the refreshes
//! saved at least [`RetentionConfig::min_payoff_tokens`] each. Where the prefixes fit beside
//! the garbage the model may still put them near the head (its margin is wide), but the twin
//! loses none, so `auto` stops; where the LRU loses prefixes the refreshes cannot keep (a
//! conversation's turns, each reused once), nothing is saved and it stops too.
//!
//! The parts: `config` (the mode and the knobs), `free_queue` (a worker's modelled free queue,
//! its plain-LRU twin and the prefixes it reused), `payoff` (what the refreshes bought),
//! `homes` (where each prefix family lives, for placement) and `machine` (the state machine
//! that ties them to the router's routing and index).

mod config;
mod free_queue;
mod homes;
mod machine;
mod payoff;

pub use config::{RetentionConfig, RetentionMode};
pub use machine::{Refresh, Retention, RetentionStats};
