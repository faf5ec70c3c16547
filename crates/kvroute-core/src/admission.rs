//! KV admission: how much of each worker's KV cache the requests in flight pin, and so whether
//! a new request would start at once or wait there for blocks.
//!
//! vLLM's scheduler admits a waiting request only when `allocate_slots` finds free blocks for
//! its uncached tokens plus the cached blocks it is about to reuse that sit in the free queue
//! (`vllm/v1/core/kv_cache_manager.py`); otherwise the request waits, and so does every
//! request behind it. Blocks that running requests hold cannot be evicted; running requests
//! that share a prefix share its blocks. So a worker's room for a request is its capacity less
//! the *distinct* blocks its running requests pin, and a request that does not fit waits until
//! one of them ends. At high concurrency that wait, not compute, makes the tail: with 2,000-token
//! prefixes only three different ones fit a 585-block worker at once, and a hit for a fourth
//! waits out a whole request (hundreds of milliseconds) where a miss elsewhere costs one
//! prefill.
//!
//! [`Admission`] keeps, per routing slot, the block hashes of the router's requests in flight
//! there (reference-counted: a shared prefix counts once) and when each was routed, and
//! answers for a new prompt how many blocks it would add on each worker and, if it does not
//! fit, how soon one of that worker's requests is expected to end, as a fraction of a typical
//! request's duration (an exponential average of routed → finished times). The prompt's own
//! blocks are counted, not its output's: vLLM allocates those as it generates, and admission
//! needs only the prompt's. Pure: time is passed in, and it sees only the router's own routing.

use std::collections::{HashMap, VecDeque};

/// Weight of each finished request in the typical duration's exponential average.
const DURATION_SMOOTHING: f64 = 0.05;

/// One request in flight, by its ticket.
#[derive(Clone, Debug)]
struct InFlight {
    slot: usize,
    block_hashes: Vec<u64>,
    /// Blocks beyond its full ones (its prompt's partial last block).
    tail_blocks: usize,
    routed_at: f64,
}

/// What a worker's requests in flight pin.
#[derive(Clone, Debug, Default)]
struct Pins {
    /// Full prompt blocks by hash, with the number of requests in flight holding each.
    blocks: HashMap<u64, u32>,
    /// Partial blocks, one per request that has one (never shared).
    tail_blocks: usize,
    /// Its requests in flight as (ticket, routed at), oldest first.
    routed: VecDeque<(u64, f64)>,
    /// Its usable KV blocks, where known (vLLM's `num_gpu_blocks` less the null block).
    capacity: Option<usize>,
}

/// The router's model of each worker's KV blocks pinned by its requests in flight.
#[derive(Clone, Debug)]
pub struct Admission {
    block_size: usize,
    /// Usable KV blocks of a worker whose own capacity is not known.
    default_capacity: Option<usize>,
    pins: Vec<Pins>,
    in_flight: HashMap<u64, InFlight>,
    next_ticket: u64,
    /// Typical seconds from routing to finish (0 until a request finished).
    typical_s: f64,
}

impl Admission {
    /// A model of workers with KV blocks of `block_size` tokens, `default_capacity` usable
    /// blocks each unless [`Admission::set_capacity`] says otherwise (None: unknown, and a
    /// worker of unknown capacity is never judged full).
    pub fn new(block_size: usize, default_capacity: Option<usize>) -> Self {
        Self {
            block_size: block_size.max(1),
            default_capacity,
            pins: Vec::new(),
            in_flight: HashMap::new(),
            next_ticket: 0,
            typical_s: 0.0,
        }
    }

    /// `slot`'s usable KV blocks, if known.
    pub fn capacity(&self, slot: usize) -> Option<usize> {
        self.pins
            .get(slot)
            .and_then(|p| p.capacity)
            .or(self.default_capacity)
    }

    /// Set `slot`'s usable KV blocks (what its engine reported).
    pub fn set_capacity(&mut self, slot: usize, blocks: usize) {
        self.slot_mut(slot).capacity = Some(blocks);
    }

    /// Distinct blocks the requests in flight on `slot` pin.
    pub fn pinned_blocks(&self, slot: usize) -> usize {
        self.pins
            .get(slot)
            .map_or(0, |p| p.blocks.len() + p.tail_blocks)
    }

    /// Requests in flight the model tracks (all workers).
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Blocks a prompt of `prompt_tokens` tokens with these full-block hashes would add to
    /// what `slot`'s requests in flight pin: those after the leading ones they already hold
    /// (hashes are chained, so the shared part is a leading run), and its partial block.
    pub fn new_blocks(&self, slot: usize, block_hashes: &[u64], prompt_tokens: usize) -> usize {
        let shared = self.pins.get(slot).map_or(0, |p| {
            block_hashes
                .iter()
                .take_while(|h| p.blocks.contains_key(h))
                .count()
        });
        block_hashes.len() - shared + self.tail_blocks(block_hashes, prompt_tokens)
    }

    /// How long the prompt would wait on `slot` for blocks: 0 when it fits now, else the time
    /// until the soonest-ending of the slot's requests in flight is expected to end, as a
    /// fraction of a typical request's duration (1 before any finished: a whole one).
    pub fn expected_wait(
        &self,
        slot: usize,
        block_hashes: &[u64],
        prompt_tokens: usize,
        now: f64,
    ) -> f64 {
        let Some(capacity) = self.capacity(slot) else {
            return 0.0;
        };
        let need = self.new_blocks(slot, block_hashes, prompt_tokens);
        if self.pinned_blocks(slot) + need <= capacity {
            return 0.0;
        }
        if self.typical_s <= 0.0 {
            return 1.0;
        }
        let Some(&(_, oldest)) = self.pins.get(slot).and_then(|p| p.routed.front()) else {
            return 0.0; // nothing in flight: the prompt alone exceeds the capacity
        };
        ((self.typical_s - (now - oldest)) / self.typical_s).max(0.0)
    }

    /// Count a request routed to `slot` at `now`; returns its ticket for [`Admission::finished`].
    pub fn routed(
        &mut self,
        slot: usize,
        block_hashes: &[u64],
        prompt_tokens: usize,
        now: f64,
    ) -> u64 {
        let tail_blocks = self.tail_blocks(block_hashes, prompt_tokens);
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let pins = self.slot_mut(slot);
        for &h in block_hashes {
            *pins.blocks.entry(h).or_insert(0) += 1;
        }
        pins.tail_blocks += tail_blocks;
        pins.routed.push_back((ticket, now));
        self.in_flight.insert(
            ticket,
            InFlight {
                slot,
                block_hashes: block_hashes.to_vec(),
                tail_blocks,
                routed_at: now,
            },
        );
        ticket
    }

    /// The request with `ticket` finished at `now` (answered, failed or abandoned): its blocks
    /// are no longer pinned, and its duration moves the typical one. An unknown ticket (already
    /// finished) changes nothing.
    pub fn finished(&mut self, ticket: u64, now: f64) {
        let Some(r) = self.in_flight.remove(&ticket) else {
            return;
        };
        let pins = &mut self.pins[r.slot];
        for h in &r.block_hashes {
            if let Some(n) = pins.blocks.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    pins.blocks.remove(h);
                }
            }
        }
        pins.tail_blocks -= r.tail_blocks;
        if let Some(i) = pins.routed.iter().position(|&(t, _)| t == ticket) {
            pins.routed.remove(i);
        }
        let took = (now - r.routed_at).max(0.0);
        self.typical_s = if self.typical_s > 0.0 {
            (1.0 - DURATION_SMOOTHING) * self.typical_s + DURATION_SMOOTHING * took
        } else {
            took
        };
    }

    fn slot_mut(&mut self, slot: usize) -> &mut Pins {
        if self.pins.len() <= slot {
            self.pins.resize_with(slot + 1, Pins::default);
        }
        &mut self.pins[slot]
    }

    /// The prompt's blocks after its full ones (0 or 1).
    fn tail_blocks(&self, block_hashes: &[u64], prompt_tokens: usize) -> usize {
        prompt_tokens
            .div_ceil(self.block_size)
            .saturating_sub(block_hashes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(first: u64, n: usize) -> Vec<u64> {
        (0..n as u64).map(|i| first * 1000 + i).collect()
    }

    #[test]
    fn a_shared_prefix_is_pinned_once() {
        let mut a = Admission::new(16, Some(100));
        let p = chain(1, 40);
        let t1 = a.routed(0, &p, 40 * 16 + 5, 0.0);
        assert_eq!(a.pinned_blocks(0), 41);
        // The same prefix and a different suffix: only the suffix and its tail are new.
        let mut q = p[..30].to_vec();
        q.extend(chain(2, 5));
        assert_eq!(a.new_blocks(0, &q, 35 * 16 + 1), 6);
        let t2 = a.routed(0, &q, 35 * 16 + 1, 0.1);
        assert_eq!(a.pinned_blocks(0), 41 + 6);
        assert_eq!(a.pinned_blocks(1), 0);
        a.finished(t1, 1.0);
        assert_eq!(a.pinned_blocks(0), 36);
        a.finished(t2, 1.1);
        a.finished(t2, 1.2); // twice: nothing more
        assert_eq!(a.pinned_blocks(0), 0);
        assert_eq!(a.in_flight(), 0);
    }

    #[test]
    fn the_wait_is_the_soonest_expected_end_as_a_fraction_of_a_typical_request() {
        let mut a = Admission::new(16, Some(100));
        // Before any request finished, a prompt that does not fit waits a whole request.
        let t = a.routed(0, &chain(1, 60), 60 * 16, 0.0);
        assert_eq!(a.expected_wait(0, &chain(2, 30), 30 * 16, 0.0), 0.0);
        assert_eq!(a.expected_wait(0, &chain(2, 50), 50 * 16, 0.0), 1.0);
        a.finished(t, 2.0); // typical: 2 s
        a.routed(0, &chain(1, 60), 60 * 16, 10.0);
        a.routed(0, &chain(3, 10), 10 * 16, 11.0);
        // The oldest, routed at 10 s, is expected to end at 12 s: at 11.5 s a quarter is left.
        assert_eq!(a.expected_wait(0, &chain(2, 50), 50 * 16, 11.5), 0.25);
        assert_eq!(a.expected_wait(0, &chain(2, 50), 50 * 16, 13.0), 0.0);
        // Another worker has room.
        assert_eq!(a.expected_wait(1, &chain(2, 50), 50 * 16, 11.5), 0.0);
        // One that reported a larger cache has room too.
        a.set_capacity(0, 200);
        assert_eq!(a.expected_wait(0, &chain(2, 50), 50 * 16, 11.5), 0.0);
    }

    #[test]
    fn a_worker_of_unknown_capacity_is_never_full() {
        let mut a = Admission::new(16, None);
        a.routed(0, &chain(1, 1000), 1000 * 16, 0.0);
        assert_eq!(a.expected_wait(0, &chain(2, 1000), 1000 * 16, 0.0), 0.0);
        a.set_capacity(0, 1500);
        assert_eq!(a.expected_wait(0, &chain(2, 1000), 1000 * 16, 0.0), 1.0);
    }
}
