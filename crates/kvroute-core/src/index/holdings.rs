//! What the index answers from and every event store writes into ([`Holdings`]): per group
//! of 64 workers, each block's holders, one bit per worker (held by events, or predicted);
//! per worker, its count of event-backed entries and its predictions; the index's counters.

use std::collections::hash_map::Entry;

use super::WorkerId;
use super::lru::LruList;
use crate::hash_keyed::HashKeyed;

/// A block's holders among one group of 64 workers, one bit per worker: those whose events
/// vouch for it, and those it is predicted at (a worker's bit is in one at most).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Holders {
    pub(super) held: u64,
    pub(super) predicted: u64,
}

/// What the index keeps about one worker whatever its store: its name and its predictions.
#[derive(Debug)]
pub(super) struct Worker {
    pub(super) name: String,
    /// Distinguishes this worker from a later one in the same slot (expiry queue items).
    pub(super) generation: u64,
    /// Event-backed entries it has (its held bits).
    pub(super) held: usize,
    /// own hash → LRU slot of `(own hash, expiry)`, least recently routed first.
    pub(super) predicted: HashKeyed<u32>,
    pub(super) predicted_order: LruList<(u64, f64)>,
}

impl Worker {
    pub(super) fn new(name: &str, generation: u64) -> Self {
        Self {
            name: name.to_owned(),
            generation,
            held: 0,
            predicted: HashKeyed::default(),
            predicted_order: LruList::new(),
        }
    }
}

/// The blocks' holders and the index's counters: an [`super::EventStore`] marks here which
/// worker holds which own hash (one held bit per (worker, block), however many engine
/// hashes or stored copies vouch for it: the store counts those), and counts what it could
/// not apply.
#[derive(Debug, Default)]
pub struct Holdings {
    /// Per group of 64 workers: own hash → its event-backed and predicted holders (one
    /// table for both, so that a look-up, a store replacing a prediction and a prediction
    /// meeting a held block each read one entry).
    pub(super) masks: Vec<HashKeyed<Holders>>,
    pub(super) workers: Vec<Option<Worker>>,
    pub(super) blocks: usize,
    pub(super) predicted: usize,
    pub(super) orphan_blocks: u64,
    pub(super) skipped_blocks: u64,
    pub(super) unknown_removals: u64,
    pub(super) evicted_blocks: u64,
}

impl Holdings {
    /// Mark worker `id` as holding own hash `oh` on an event's word, retiring a prediction of
    /// it (the event now vouches for the block: the prediction has served its purpose).
    /// False when it held `oh` already (nothing changes).
    #[inline]
    pub fn hold(&mut self, id: WorkerId, oh: u64) -> bool {
        let bit = 1u64 << (id % 64);
        let holders = self.masks[id / 64].entry(oh).or_default();
        if holders.held & bit != 0 {
            return false;
        }
        holders.held |= bit;
        self.blocks += 1;
        let w = self.workers[id].as_mut().expect("known worker");
        w.held += 1;
        if holders.predicted & bit != 0 {
            holders.predicted &= !bit;
            let slot = w
                .predicted
                .remove(&oh)
                .expect("a predicted bit has its entry");
            w.predicted_order.remove(slot);
            self.predicted -= 1;
        }
        true
    }

    /// Worker `id` no longer holds own hash `oh`. False when it did not.
    #[inline]
    pub fn release(&mut self, id: WorkerId, oh: u64) -> bool {
        let bit = 1u64 << (id % 64);
        let Entry::Occupied(mut holders) = self.masks[id / 64].entry(oh) else {
            return false;
        };
        let e = holders.get_mut();
        if e.held & bit == 0 {
            return false;
        }
        e.held &= !bit;
        if e.held == 0 && e.predicted == 0 {
            holders.remove();
        }
        self.workers[id].as_mut().expect("known worker").held -= 1;
        self.blocks -= 1;
        true
    }

    /// Whether worker `id` holds own hash `oh` (on its events' word).
    #[inline]
    pub fn holds(&self, id: WorkerId, oh: u64) -> bool {
        self.masks[id / 64]
            .get(&oh)
            .is_some_and(|e| e.held & (1u64 << (id % 64)) != 0)
    }

    /// Worker `id` holds nothing any more, found by a scan of its group's table (for a store
    /// that keeps no per-worker table naming its entries).
    pub fn release_all(&mut self, id: WorkerId) {
        let bit = 1u64 << (id % 64);
        let mut released = 0;
        self.masks[id / 64].retain(|_, e| {
            if e.held & bit != 0 {
                e.held &= !bit;
                released += 1;
            }
            e.held != 0 || e.predicted != 0
        });
        self.workers[id].as_mut().expect("known worker").held -= released;
        self.blocks -= released;
    }

    /// Event-backed (worker, block) entries over all workers.
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// `n` blocks were stored under a parent the worker was not known to hold.
    pub fn count_orphans(&mut self, n: usize) {
        self.orphan_blocks += n as u64;
    }

    /// `n` blocks could not be named by a token-only hash.
    pub fn count_skipped(&mut self, n: usize) {
        self.skipped_blocks += n as u64;
    }

    /// A removal named an engine hash the store did not know.
    pub fn count_unknown_removal(&mut self) {
        self.unknown_removals += 1;
    }

    /// An entry was dropped by the memory bound (after [`Holdings::release`]).
    pub fn count_evicted(&mut self) {
        self.evicted_blocks += 1;
    }

    /// Forget worker `id`'s predicted entries.
    pub(super) fn forget_predictions(&mut self, id: WorkerId) {
        let bit = 1u64 << (id % 64);
        let w = self.workers[id].as_mut().expect("known worker");
        let masks = &mut self.masks[id / 64];
        for (oh, _) in w.predicted.drain() {
            drop_predicted(masks, oh, bit);
        }
        self.predicted -= w.predicted_order.len();
        w.predicted_order.clear();
    }
}

/// Clear the predicted `bit` of `h`'s holders, forgetting `h` once it has none.
pub(super) fn drop_predicted(table: &mut HashKeyed<Holders>, h: u64, bit: u64) {
    if let Entry::Occupied(mut m) = table.entry(h) {
        let e = m.get_mut();
        e.predicted &= !bit;
        if e.held == 0 && e.predicted == 0 {
            m.remove();
        }
    }
}
