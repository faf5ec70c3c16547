//! kvroute's pure core: everything that decides what a vLLM prefix cache holds and where a
//! request should go, with no clock, no sockets and no async runtime (the sans-I/O style of
//! h11). Time is passed in; effects are returned as data.
//!
//! * [`blocks`]: chained per-block hashes of token ids (kvroute's own block identity).
//! * [`engine`]: the vLLM v1 worker model: `BlockPool`, scheduler, cost model.
//! * [`index`]: the router's index of which worker holds which block; [`hash_keyed`]: the
//!   maps keyed by hashes it and the engine model share.
//! * [`policies`] and [`routing`]: the balancing policies and the one routing step around
//!   them, shared by the simulator and the live router.
//! * [`kvevents`]: vLLM's KV events, their wire codec and the subscriber's sequence tracker.
//! * [`mesh`]: router replicas telling each other their decisions and refreshes.
//! * [`retention`]: the router managing what each worker's LRU keeps (refreshes).
//! * [`sim`]: the simulator's event loop on virtual time, and its placements (the seam
//!   between its engines and the routing step, with or without retention). The simulator
//!   depends on routing and retention, never the reverse.
//! * [`pyrandom`]: CPython's `random.Random`, so seeded draws match the Python side.
//! * [`trace`]: the prompt tokens of a published trace, synthesized per hash id.
//!
//! The Python package (`kvroute._native`, crate `kvroute-py`) wraps these types; the Python
//! tests therefore guard this code.

pub mod admission;
pub mod blocks;
pub mod engine;
pub mod hash_keyed;
pub mod index;
pub mod kvevents;
pub mod mesh;
pub mod policies;
pub mod pyrandom;
pub mod retention;
pub mod routing;
pub mod sim;
pub mod trace;
