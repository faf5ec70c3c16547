//! `prefix-hash`: rendezvous hashing of the prompt's key block over the workers' names.

use super::choose::Choose;
use super::ties::weight;
use super::view::{RequestView, WorkerState};
use crate::pyrandom::PyRandom;

/// Options of [`PrefixHash`] (read by serde by their field names, absent ones as in
/// `Default`: `kvroute serve --policy-option` and the Python policies name them so).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefixHashConfig {
    /// How many leading blocks identify a prefix.
    pub key_blocks: usize,
    /// ε of bounded-load hashing; None never spills.
    pub load_factor: Option<f64>,
}

impl Default for PrefixHashConfig {
    fn default() -> Self {
        Self {
            key_blocks: 1,
            load_factor: None,
        }
    }
}

/// Rendezvous hashing of the prompt's key block, with an optional bounded-load spill.
#[derive(Clone, Debug)]
pub struct PrefixHash {
    /// The options.
    pub config: PrefixHashConfig,
    /// Orders the workers of a prompt without a full block.
    pub rng: PyRandom,
}

impl PrefixHash {
    /// Workers in this request's rendezvous order (owner first).
    pub fn ranking(&mut self, request: &RequestView<'_>, workers: &[&WorkerState]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..workers.len()).collect();
        let hashes = request.block_hashes;
        if hashes.is_empty() {
            let keys: Vec<f64> = (0..workers.len()).map(|_| self.rng.random()).collect();
            order.sort_by(|&a, &b| keys[a].total_cmp(&keys[b]));
            return order;
        }
        let key = hashes[self.config.key_blocks.min(hashes.len()).max(1) - 1];
        let weights: Vec<u64> = workers.iter().map(|w| weight(&w.name, key)).collect();
        // Stable and descending, as Python's sorted(reverse=True).
        order.sort_by(|&a, &b| weights[b].cmp(&weights[a]));
        order
    }
}

impl Choose for PrefixHash {
    fn name(&self) -> &str {
        "prefix-hash"
    }
    fn needs_overlap(&self) -> bool {
        false
    }
    fn choose(&mut self, request: &RequestView<'_>, workers: &[&WorkerState]) -> usize {
        let order = self.ranking(request, workers);
        let Some(lf) = self.config.load_factor else {
            return order[0];
        };
        // +1 counts the request being placed, so an idle fleet never spills.
        let total: i64 = workers.iter().map(|w| w.in_flight).sum();
        let mean = (total + 1) as f64 / workers.len() as f64;
        let limit = (1.0 + lf) * mean;
        order
            .iter()
            .copied()
            .find(|&i| ((workers[i].in_flight + 1) as f64) <= limit)
            .unwrap_or(order[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policies::view::idle_fleet;

    #[test]
    fn prefix_hash_spills_to_the_next_in_its_order() {
        let mut p = PrefixHash {
            config: PrefixHashConfig {
                key_blocks: 1,
                load_factor: Some(0.25),
            },
            rng: PyRandom::from_seed(0),
        };
        let mut w = idle_fleet(4);
        let view = RequestView {
            block_hashes: &[42, 43],
            prompt_tokens: 32,
            overlap_blocks: None,
            admission_wait: None,
            adapter: None,
        };
        let owner = p.choose(&view, &w.iter().collect::<Vec<_>>());
        w[owner].in_flight = 6;
        let refs: Vec<&WorkerState> = w.iter().collect();
        let order = p.ranking(&view, &refs);
        assert_eq!(order[0], owner);
        assert_eq!(p.choose(&view, &refs), order[1]);
    }
}
