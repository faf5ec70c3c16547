//! kvroute's pure core: everything that decides what a vLLM prefix cache holds and where a
//! request should go, with no clock, no sockets and no async runtime (the sans-I/O style of
//! h11). Time is passed in; effects are returned as data.
//!
//! * [`blocks`]: chained per-block hashes of token ids (kvroute's own block identity).
//! * [`index`]: the router's index of which worker holds which block; [`hash_keyed`]: the
//!   maps keyed by hashes it and the engine model share.
//! * [`policies`] and [`routing`]: the balancing policies and the one routing step around
//!   them, shared by the simulator and the live router.
//! * [`kvevents`]: vLLM's KV events, their wire codec and the subscriber's sequence tracker.
//! * [`mesh`]: router replicas telling each other their decisions and refreshes.
//! * [`retention`]: the router managing what each worker's LRU keeps (refreshes).
//! * [`pyrandom`]: CPython's `random.Random`, so seeded draws match the Python side.
//!
//! The simulator and the engine model are the `kvroute-sim` crate, which depends on this one
//! (never the reverse). The Python package (`kvroute._native`, crate `kvroute-py`) wraps the
//! types of both; the Python tests therefore guard this code.

pub mod admission;
pub mod blocks;
pub mod hash_keyed;
pub mod index;
pub mod kvevents;
pub mod mesh;
pub mod policies;
pub mod pyrandom;
pub mod retention;
pub mod routing;
