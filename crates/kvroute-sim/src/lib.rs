//! kvroute's simulator: a fleet of vLLM workers on a virtual clock, routed by the router's own
//! routing step (`kvroute_core::routing`), so what it predicts is what the live router does.
//!
//! * [`engine`]: the vLLM v1 worker model: `BlockPool`, scheduler, cost model.
//! * [`sim`]: the event loop on virtual time, and its placements (the seam between its engines
//!   and the routing step, with or without retention).
//! * [`trace`]: the prompt tokens of a published trace, synthesized per hash id.
//! * [`hash_events`]: the engine model's KV events as hashes only, and the index store that
//!   takes them (the engines hash blocks as the index does), the simulator's fast path.
//!
//! This crate depends on `kvroute-core`; the router's crates (`kvroute-core`, `kvroute-serve`,
//! `kvroute-epp`) never depend on it. The Python package (`kvroute._native`, crate
//! `kvroute-py`) wraps its types.

pub mod engine;
pub mod hash_events;
pub mod sim;
pub mod trace;
