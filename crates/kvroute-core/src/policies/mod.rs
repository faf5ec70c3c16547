//! Balancing policies: one pure interface shared by the simulator and the live router.
//!
//! A policy sees a [`RequestView`] (what the router knows about the request: its block hashes,
//! and for policies that [`Choose::needs_overlap`] each worker's cached overlap from the index)
//! and the [`WorkerState`] of every candidate worker (the router's own load accounting), and
//! returns the index of the worker to use. Policies hold no clock and do no I/O.
//!
//! * `random`: uniform per request (a Kubernetes Service with a new connection per request).
//! * `round-robin`: cycle through the workers.
//! * `least-loaded`: fewest requests in flight, ties at random.
//! * `prefix-hash`: rendezvous hashing of the prompt's key block over worker names (owners
//!   move only for the prefixes of workers that come or go), with an optional bounded-load
//!   spill to the next worker in the prefix's order.
//! * `kv-aware`: the worker that leaves the least work, under a bounded-load and a
//!   bounded-share guard; see [`KvAware`].
//!
//! Every random draw goes through [`PyRandom`] in the order the former Python policies drew,
//! and every float is computed in the same order of operations (Python 3.11's left-to-right
//! `sum`), so a seed names the same decisions it always did.
//!
//! One concept per file: [`view`] (what a policy sees), [`choose`] (the trait), [`ties`]
//! (rankings and tie-breaks the kinds share), [`prefix_hash`] and [`kv_aware`]; this module
//! names them all ([`Policy`], [`POLICY_NAMES`]).

pub mod choose;
pub mod kv_aware;
pub mod prefix_hash;
pub mod ties;
pub mod view;

pub use choose::{Choose, PolicyError};
pub use kv_aware::{ADAPTER_WEIGHT, KvAware, KvAwareConfig};
pub use prefix_hash::{PrefixHash, PrefixHashConfig};
pub use ties::least_loaded;
pub use view::{RequestView, WorkerState, adapter_id};

use crate::pyrandom::PyRandom;

/// Every native policy, by kind.
#[derive(Clone, Debug)]
pub enum Policy {
    /// Uniform per request.
    Random(PyRandom),
    /// Cycle through the workers; holds the next position.
    RoundRobin(usize),
    /// Fewest in flight, ties at random.
    LeastLoaded(PyRandom),
    /// Rendezvous hashing of the prompt's key block.
    PrefixHash(PrefixHash),
    /// Least work left, under the load and share guards.
    KvAware(Box<KvAware>),
}

/// The names of the native policies, in the order `kvroute serve --help` lists them.
pub const POLICY_NAMES: [&str; 5] = [
    "random",
    "round-robin",
    "least-loaded",
    "prefix-hash",
    "kv-aware",
];

impl Policy {
    /// The policy called `name` (one of [`POLICY_NAMES`]) with these options (each kind reads
    /// its own: kv-aware `kv_aware`, prefix-hash `prefix_hash`) and random draws from `rng`.
    pub fn from_name(
        name: &str,
        rng: PyRandom,
        kv_aware: KvAwareConfig,
        prefix_hash: PrefixHashConfig,
    ) -> Result<Self, PolicyError> {
        Ok(match name {
            "random" => Policy::Random(rng),
            "round-robin" => Policy::RoundRobin(0),
            "least-loaded" => Policy::LeastLoaded(rng),
            "prefix-hash" => {
                if prefix_hash.key_blocks < 1 {
                    return Err(PolicyError(format!(
                        "key blocks must be >= 1, got {}",
                        prefix_hash.key_blocks
                    )));
                }
                Policy::PrefixHash(PrefixHash {
                    config: prefix_hash,
                    rng,
                })
            }
            "kv-aware" => Policy::KvAware(Box::new(KvAware::new(kv_aware, rng)?)),
            other => return Err(PolicyError(format!("unknown policy {other:?}"))),
        })
    }
}

impl Choose for Policy {
    fn name(&self) -> &str {
        match self {
            Policy::Random(_) => "random",
            Policy::RoundRobin(_) => "round-robin",
            Policy::LeastLoaded(_) => "least-loaded",
            Policy::PrefixHash(p) => p.name(),
            Policy::KvAware(p) => p.name(),
        }
    }
    fn needs_overlap(&self) -> bool {
        matches!(self, Policy::KvAware(_))
    }
    fn needs_admission(&self) -> bool {
        match self {
            Policy::KvAware(p) => p.needs_admission(),
            _ => false,
        }
    }
    fn choose(&mut self, request: &RequestView<'_>, workers: &[&WorkerState]) -> usize {
        match self {
            Policy::Random(rng) => rng.randrange(workers.len()),
            Policy::RoundRobin(next) => {
                let i = *next % workers.len();
                *next = i + 1;
                i
            }
            Policy::LeastLoaded(rng) => {
                let all: Vec<usize> = (0..workers.len()).collect();
                least_loaded(workers, rng, &all)
            }
            Policy::PrefixHash(p) => p.choose(request, workers),
            Policy::KvAware(p) => p.choose(request, workers),
        }
    }
    fn observe(&mut self, workers: &[&WorkerState], chosen: usize) {
        if let Policy::KvAware(p) = self {
            p.observe(workers, chosen);
        }
    }
}
