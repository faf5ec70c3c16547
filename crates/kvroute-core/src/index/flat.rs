//! The router's store without a memory bound ([`FlatStore`]): an entry needs no LRU slot, so
//! a worker's entries are its held bits in the [`Holdings`] alone, beside the engine → own
//! map, their duplicates counted apart: one table fewer per stored and removed block than
//! the bounded store.

use std::any::Any;
use std::collections::hash_map::Entry;

use super::WorkerId;
use super::engine_map::EngineMaps;
use super::holdings::Holdings;
use super::store::{EventStore, slot};
use crate::blocks::BlockHasher;
use crate::hash_keyed::HashKeyed;
use crate::kvevents::events::{BlockRemoved, BlockStored};

/// Engine hashes mapped to own hashes, each held (worker, block) one held bit.
#[derive(Debug)]
pub(super) struct FlatStore {
    maps: EngineMaps,
    /// Per worker: own hash → stored copies beyond the first (rare: several engine hashes
    /// naming the same tokens, a GPU and a CPU copy).
    copies: Vec<HashKeyed<u32>>,
}

impl FlatStore {
    pub(super) fn new(hasher: BlockHasher) -> Self {
        Self {
            maps: EngineMaps::new(hasher),
            copies: Vec::new(),
        }
    }
}

impl EventStore for FlatStore {
    fn store(
        &mut self,
        holdings: &mut Holdings,
        id: WorkerId,
        event: &BlockStored,
        keys: &[Vec<u8>],
    ) {
        let Some(own_hashes) = self.maps.own_hashes(holdings, id, event, keys) else {
            return;
        };
        for (&eh, &oh) in event.block_hashes.iter().zip(&own_hashes) {
            if self.maps.map(id, eh, oh) && !holdings.hold(id, oh) {
                // Another engine hash of the same tokens: a copy, counted, not touched.
                *slot(&mut self.copies, id).entry(oh).or_insert(0) += 1;
            }
        }
        self.maps.done(own_hashes);
    }

    fn remove(&mut self, holdings: &mut Holdings, id: WorkerId, event: &BlockRemoved) {
        for &eh in &event.block_hashes {
            let Some(oh) = self.maps.forget(holdings, id, eh) else {
                continue;
            };
            let copies = slot(&mut self.copies, id);
            if !copies.is_empty()
                && let Entry::Occupied(mut extra) = copies.entry(oh)
            {
                // Another stored copy still vouches for these tokens.
                if *extra.get() > 1 {
                    *extra.get_mut() -= 1;
                } else {
                    extra.remove();
                }
                continue;
            }
            let released = holdings.release(id, oh);
            debug_assert!(released, "an engine entry has its held bit");
        }
    }

    fn clear(&mut self, holdings: &mut Holdings, id: WorkerId) {
        // Each held block has an engine hash mapped to it.
        for (_, e) in self.maps.of(id).drain() {
            holdings.release(id, e.own);
        }
        slot(&mut self.copies, id).clear();
    }

    fn touch(&mut self, _id: WorkerId, _oh: u64) {}

    fn engine_entries(&self) -> usize {
        self.maps.entries()
    }

    fn duplicate_copies(&self) -> usize {
        self.maps.duplicate_copies()
            + self
                .copies
                .iter()
                .flat_map(|c| c.values())
                .map(|&c| c as usize)
                .sum::<usize>()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
