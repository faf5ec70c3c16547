//! How the policies rank workers and break ties: rendezvous weights, and the least loaded
//! worker at random among equals.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::view::WorkerState;
use crate::pyrandom::PyRandom;

/// `xxh3_64(name, seed)`: the rendezvous weight of a worker for a key.
pub(super) fn weight(name: &str, seed: u64) -> u64 {
    xxh3_64_with_seed(name.as_bytes(), seed)
}

/// Index of a worker with the fewest requests in flight among `among`; ties broken at random
/// so equal workers share new work.
pub fn least_loaded(workers: &[&WorkerState], rng: &mut PyRandom, among: &[usize]) -> usize {
    let low = among
        .iter()
        .map(|&i| workers[i].in_flight)
        .min()
        .expect("candidates");
    let tied: Vec<usize> = among
        .iter()
        .copied()
        .filter(|&i| workers[i].in_flight == low)
        .collect();
    rng.choice(&tied)
}
