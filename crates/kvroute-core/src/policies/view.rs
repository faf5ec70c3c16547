//! What a policy may know: the request ([`RequestView`]) and each candidate worker
//! ([`WorkerState`], the router's own load accounting), and the id a LoRA adapter is known by.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// What a policy may know about a request.
#[derive(Clone, Copy, Debug)]
pub struct RequestView<'a> {
    /// Chained hashes of the prompt's full blocks.
    pub block_hashes: &'a [u64],
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Leading blocks of the prompt each worker holds, aligned with the workers; filled only
    /// for policies that need it (None or empty: unknown, counted as 0).
    pub overlap_blocks: Option<&'a [usize]>,
    /// How long the request would wait for KV blocks on each worker, aligned with the
    /// workers (`crate::admission`: 0 when it fits now, else a fraction of a typical
    /// request's duration); filled only for policies that [`super::Choose::needs_admission`] and
    /// a step that knows the workers' capacity.
    pub admission_wait: Option<&'a [f64]>,
    /// The LoRA adapter the request runs under ([`adapter_id`] of its name), when the step
    /// models the workers' LoRA slots (`WorkerState::adapters`); None for a request of a base
    /// model, or when the slots are not modelled.
    pub adapter: Option<u64>,
}

/// The id the router knows a LoRA adapter by: `xxh3_64` of its name (the request's `model`),
/// the same on every replica and in the simulator.
pub fn adapter_id(name: &str) -> u64 {
    xxh3_64_with_seed(name.as_bytes(), 0)
}

impl RequestView<'_> {
    /// Prompt tokens worker `worker` would still compute: those after its cached overlap,
    /// and at least one (vLLM recomputes the last token of a fully cached prompt).
    pub fn tokens_to_prefill(&self, worker: usize, block_size: usize) -> usize {
        let cached = match self.overlap_blocks {
            Some(o) if !o.is_empty() => o[worker] * block_size,
            _ => 0,
        };
        self.prompt_tokens.saturating_sub(cached).max(1)
    }
}

/// What a policy may know about a worker: its name and the router's own load accounting.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerState {
    /// The worker's stable name (the index's key, and the rendezvous hash's input).
    pub name: String,
    /// Requests sent and not finished.
    pub in_flight: i64,
    /// Prompt tokens of those requests still to prefill (added on sending, subtracted at
    /// the first token).
    pub in_flight_tokens: i64,
    /// Blocks the index attributes to the worker (0 when unknown).
    pub cached_blocks: i64,
    /// The router's model of the adapters in the worker's LoRA slots ([`adapter_id`]s, least
    /// recently routed first): the last `lora_slots` distinct adapters sent there, as vLLM
    /// keeps the adapters it last scheduled (empty when the slots are not modelled).
    pub adapters: Vec<u64>,
    /// The worker's LoRA slots (vLLM's `--max-loras`; 0: not modelled).
    pub lora_slots: usize,
}

impl WorkerState {
    /// An idle worker named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }

    /// Whether the router's model has `adapter` in the worker's LoRA slots.
    pub fn has_adapter(&self, adapter: u64) -> bool {
        self.adapters.contains(&adapter)
    }

    /// Whether a request under `adapter` would take a slot another adapter holds: it is not
    /// in the slots, and they are full (vLLM then runs it only once that adapter's requests
    /// have left the batch, and loads it).
    pub fn displaces_adapter(&self, adapter: u64) -> bool {
        !self.has_adapter(adapter) && self.adapters.len() >= self.lora_slots
    }

    /// A request under `adapter` was sent to the worker: it becomes the most recent, the
    /// least recent leaves when the slots are full.
    pub fn use_adapter(&mut self, adapter: u64) {
        if let Some(i) = self.adapters.iter().position(|&a| a == adapter) {
            self.adapters.remove(i);
        } else if self.adapters.len() >= self.lora_slots.max(1) {
            self.adapters.remove(0);
        }
        self.adapters.push(adapter);
    }
}

/// `n` idle workers named `w0`, `w1`, …: the fleet the policies' tests decide over.
#[cfg(test)]
pub(crate) fn idle_fleet(n: usize) -> Vec<WorkerState> {
    (0..n).map(|i| WorkerState::new(format!("w{i}"))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_lora_slots_keep_the_last_adapters_sent_there() {
        let mut w = WorkerState::new("w");
        w.lora_slots = 2;
        w.use_adapter(adapter_id("a"));
        // A free slot: `b` displaces nothing.
        assert!(!w.displaces_adapter(adapter_id("b")));
        for name in ["b", "a", "c"] {
            w.use_adapter(adapter_id(name));
        }
        // `b` was the least recently used of the two when `c` came.
        assert_eq!(w.adapters, vec![adapter_id("a"), adapter_id("c")]);
        assert!(w.displaces_adapter(adapter_id("b")));
        assert!(!w.displaces_adapter(adapter_id("a")));
    }
}
