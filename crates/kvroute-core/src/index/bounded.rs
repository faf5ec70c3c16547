//! The router's store under a memory bound ([`BoundedStore`]): beyond the bound the least
//! recently touched event-backed (worker, block) entries are dropped, as if evicted. An entry
//! is touched when it is stored and when a prompt holding it is routed to its worker, the
//! same accesses that keep it in vLLM's own LRU; so each entry has its LRU slot, found by own
//! hash.

use std::any::Any;
use std::collections::hash_map::Entry;

use super::WorkerId;
use super::engine_map::EngineMaps;
use super::holdings::Holdings;
use super::lru::LruList;
use super::store::{EventStore, slot};
use crate::blocks::BlockHasher;
use crate::hash_keyed::HashKeyed;
use crate::kvevents::events::{BlockRemoved, BlockStored};

/// A (worker, own hash) entry: engine hashes vouching for it and its LRU slot.
#[derive(Clone, Copy, Debug)]
struct OwnEntry {
    refs: u32,
    lru: u32,
    /// One engine hash mapped to it (the others are found by a scan, only when the memory
    /// bound drops an entry several engine hashes vouch for).
    engine: u64,
}

/// Engine hashes mapped to own hashes, each held (worker, block) an entry in LRU order.
#[derive(Debug)]
pub(super) struct BoundedStore {
    maps: EngineMaps,
    /// Per worker: its event-backed entries.
    own: Vec<HashKeyed<OwnEntry>>,
    /// Every worker's entries in touch order.
    lru: LruList<(WorkerId, u64)>,
    /// The bound, in entries.
    limit: usize,
}

impl BoundedStore {
    pub(super) fn new(hasher: BlockHasher, limit: usize) -> Self {
        Self {
            maps: EngineMaps::new(hasher),
            own: Vec::new(),
            lru: LruList::new(),
            limit,
        }
    }

    /// Engine hash `eh` now vouches for `(id, oh)`: a new entry, or one more reference
    /// (touched).
    #[inline]
    fn hold(&mut self, holdings: &mut Holdings, id: WorkerId, eh: u64, oh: u64) {
        match slot(&mut self.own, id).entry(oh) {
            Entry::Occupied(mut own) => {
                let own = own.get_mut();
                own.refs += 1;
                self.lru.move_to_back(own.lru);
            }
            Entry::Vacant(v) => {
                v.insert(OwnEntry {
                    refs: 1,
                    lru: self.lru.push_back((id, oh)),
                    engine: eh,
                });
                holdings.hold(id, oh);
            }
        }
    }

    /// Engine hash `eh` stops vouching for `(id, oh)`: the entry leaves when none is left.
    /// False when `(id, oh)` is not held.
    fn release(&mut self, holdings: &mut Holdings, id: WorkerId, oh: u64, eh: u64) -> bool {
        let Entry::Occupied(mut own) = slot(&mut self.own, id).entry(oh) else {
            return false;
        };
        if own.get().refs > 1 {
            // Another engine hash still vouches for these tokens.
            let own = own.get_mut();
            own.refs -= 1;
            if own.engine == eh {
                own.engine = self
                    .maps
                    .of(id)
                    .iter()
                    .find(|(_, e)| e.own == oh)
                    .map_or(0, |(k, _)| *k);
            }
            return true;
        }
        self.lru.remove(own.remove().lru);
        holdings.release(id, oh)
    }

    /// Drop the least recently touched entries beyond the bound.
    fn enforce_bound(&mut self, holdings: &mut Holdings) {
        while holdings.blocks() > self.limit {
            let Some(at) = self.lru.front() else { break };
            let (id, oh) = self.lru.remove(at);
            let own = self.own[id].remove(&oh).expect("an LRU entry is held");
            let engine = self.maps.of(id);
            if own.refs > 1 {
                engine.retain(|_, e| e.own != oh);
            } else {
                engine.remove(&own.engine);
            }
            holdings.release(id, oh);
            holdings.count_evicted();
        }
    }
}

impl EventStore for BoundedStore {
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
            // Another copy of a stored engine block is counted, not touched.
            if self.maps.map(id, eh, oh) {
                self.hold(holdings, id, eh, oh);
            }
        }
        self.maps.done(own_hashes);
        self.enforce_bound(holdings);
    }

    fn remove(&mut self, holdings: &mut Holdings, id: WorkerId, event: &BlockRemoved) {
        for &eh in &event.block_hashes {
            if let Some(oh) = self.maps.forget(holdings, id, eh) {
                let released = self.release(holdings, id, oh, eh);
                debug_assert!(released, "an engine entry has its own entry");
            }
        }
    }

    fn clear(&mut self, holdings: &mut Holdings, id: WorkerId) {
        for (oh, entry) in slot(&mut self.own, id).drain() {
            holdings.release(id, oh);
            self.lru.remove(entry.lru);
        }
        self.maps.of(id).clear();
    }

    fn touch(&mut self, id: WorkerId, oh: u64) {
        let own = slot(&mut self.own, id)
            .get(&oh)
            .expect("a held bit has its entry");
        self.lru.move_to_back(own.lru);
    }

    fn engine_entries(&self) -> usize {
        self.maps.entries()
    }

    fn duplicate_copies(&self) -> usize {
        self.maps.duplicate_copies()
            + self
                .own
                .iter()
                .flat_map(|o| o.values())
                .map(|o| o.refs as usize - 1)
                .sum::<usize>()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
