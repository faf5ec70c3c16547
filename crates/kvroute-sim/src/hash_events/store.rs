//! [`EngineHashes`]: an index store taking every engine block hash as the index's own hash
//! of the same tokens, for engines known to hash exactly as the index does.

use std::any::Any;
use std::collections::hash_map::Entry;

use kvroute_core::hash_keyed::HashKeyed;
use kvroute_core::index::{EventStore, Holdings, KvIndex, WorkerId};
use kvroute_core::kvevents::events::{BlockRemoved, BlockStored, KvCacheEvent};

use super::{HashEvent, HashEvents};

/// An index store whose own hashes are the engines' block hashes. Without a memory bound
/// (the only index it serves) a block's held bit is its entry: one table probe per stored or
/// removed block, and no per-worker table beside the duplicates.
#[derive(Debug, Default)]
pub struct EngineHashes {
    /// Per worker: block hash → stored copies beyond the first (vLLM duplicates).
    copies: Vec<HashKeyed<u32>>,
}

impl EngineHashes {
    fn copies(&mut self, id: WorkerId) -> &mut HashKeyed<u32> {
        if self.copies.len() <= id {
            self.copies.resize_with(id + 1, HashKeyed::default);
        }
        &mut self.copies[id]
    }

    /// Blocks `hashes`, in chain order after `parent`, stored by worker `id`.
    fn stored(
        &mut self,
        holdings: &mut Holdings,
        id: WorkerId,
        parent: Option<u64>,
        hashes: &[u64],
    ) {
        if let Some(p) = parent
            && !holdings.holds(id, p)
        {
            holdings.count_orphans(hashes.len());
            return;
        }
        for &h in hashes {
            if !holdings.hold(id, h) {
                // Another stored copy of the same block: counted, not touched.
                *self.copies(id).entry(h).or_insert(0) += 1;
            }
        }
    }

    /// Blocks `hashes` evicted by worker `id`, in order.
    fn removed(&mut self, holdings: &mut Holdings, id: WorkerId, hashes: &[u64]) {
        for &h in hashes {
            let copies = self.copies(id);
            if !copies.is_empty()
                && let Entry::Occupied(mut extra) = copies.entry(h)
            {
                // Another stored copy still vouches for these tokens.
                if *extra.get() > 1 {
                    *extra.get_mut() -= 1;
                } else {
                    extra.remove();
                }
                continue;
            }
            if !holdings.release(id, h) {
                holdings.count_unknown_removal();
            }
        }
    }
}

impl EventStore for EngineHashes {
    fn store(
        &mut self,
        holdings: &mut Holdings,
        id: WorkerId,
        event: &BlockStored,
        _keys: &[Vec<u8>],
    ) {
        // The engine's hashes carry the blocks' keys already.
        self.stored(holdings, id, event.parent_block_hash, &event.block_hashes);
    }

    fn remove(&mut self, holdings: &mut Holdings, id: WorkerId, event: &BlockRemoved) {
        self.removed(holdings, id, &event.block_hashes);
    }

    fn clear(&mut self, holdings: &mut Holdings, id: WorkerId) {
        // No per-worker table names the held blocks: the holdings are scanned.
        holdings.release_all(id);
        self.copies(id).clear();
    }

    fn touch(&mut self, _id: WorkerId, _oh: u64) {}

    fn engine_entries(&self) -> usize {
        0
    }

    fn duplicate_copies(&self) -> usize {
        self.copies
            .iter()
            .flat_map(|c| c.values())
            .map(|&c| c as usize)
            .sum()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// Take every engine block hash as `index`'s own hash of the same tokens, from now on: for
/// engines known to hash exactly as the index does (the engine model built with the index's
/// hasher). Only an index without a memory bound that holds nothing can switch (its earlier
/// entries were mapped; under a bound the router's store keeps the LRU order); returns
/// whether it takes them.
pub fn trust_engine_hashes(index: &mut KvIndex) -> bool {
    trusts_engine_hashes(index)
        || (index.bound_blocks().is_none() && index.use_store(Box::new(EngineHashes::default())))
}

/// Whether `index` takes engine hashes as its own ([`trust_engine_hashes`]).
pub fn trusts_engine_hashes(index: &KvIndex) -> bool {
    index.store::<EngineHashes>().is_some()
}

/// Apply worker `id`'s KV events given as hash events, in order: what
/// [`KvIndex::apply_to`] does with the full events they were reduced from
/// ([`HashEvents::from_events`]), for an index that trusts the engine hashes (panics
/// otherwise: the router's store must hash the tokens, which hash events do not carry) and
/// engines that emit plain blocks of its block size (the engine model's), the only ones whose
/// events it would keep.
pub fn apply_hash_events(index: &mut KvIndex, id: WorkerId, events: &HashEvents) {
    for event in events.iter() {
        match event {
            HashEvent::Stored { parent, hashes } => {
                let (store, holdings) = trusted(index);
                store.stored(holdings, id, parent, hashes);
            }
            HashEvent::Removed(hashes) => {
                let (store, holdings) = trusted(index);
                store.removed(holdings, id, hashes);
            }
            HashEvent::AllCleared => index.apply_to(id, &[KvCacheEvent::AllCleared]),
        }
    }
}

/// `index`'s [`EngineHashes`] store and its holdings.
fn trusted(index: &mut KvIndex) -> (&mut EngineHashes, &mut Holdings) {
    index
        .store_mut::<EngineHashes>()
        .expect("hash events need an index that trusts the engine hashes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_core::blocks::{BlockHasher, DEFAULT_HASH_SEED};
    use kvroute_core::index::MemoryBound;
    use kvroute_core::pyrandom::PyRandom;

    const BS: usize = 4;

    fn own() -> BlockHasher {
        BlockHasher::new(BS, DEFAULT_HASH_SEED).unwrap()
    }

    fn index(bound: Option<MemoryBound>) -> KvIndex {
        KvIndex::new(own(), Some(2.0), None, bound).unwrap()
    }

    fn tokens(blocks: usize, start: u32) -> Vec<u32> {
        (start..start + (blocks * BS) as u32).collect()
    }

    /// Events from engines hashing with the index's own hasher, applied to an index that maps
    /// them, to one that trusts them and, reduced to hash events, to another that trusts
    /// them: the same answers and counts after every event.
    #[test]
    fn trusted_engine_hashes_answer_as_mapped_ones() {
        let mut mapped = index(None);
        let mut trusted = index(None);
        assert!(trust_engine_hashes(&mut trusted));
        let mut hashed = index(None);
        assert!(trust_engine_hashes(&mut hashed));
        let ids = [hashed.ensure_worker("a"), hashed.ensure_worker("b")];
        assert_eq!(
            ids,
            [trusted.ensure_worker("a"), trusted.ensure_worker("b")]
        );
        let mut rng = PyRandom::from_seed(7);
        let prompts: Vec<Vec<u32>> = (0..4).map(|i| tokens(5, 100 * i)).collect();
        let hashes: Vec<Vec<u64>> = prompts
            .iter()
            .map(|p| own().hash_blocks(p, None, 0, None))
            .collect();
        for _ in 0..400 {
            let k = rng.randrange(prompts.len());
            let (p, h) = (&prompts[k], &hashes[k]);
            let w = rng.randrange(2);
            let worker = ["a", "b"][w];
            let first = rng.randrange(5);
            let stop = first + 1 + rng.randrange(5 - first);
            let event = if rng.random() < 0.03 {
                KvCacheEvent::AllCleared
            } else if rng.random() < 0.6 {
                KvCacheEvent::Stored(BlockStored::plain(
                    h[first..stop].to_vec(),
                    first.checked_sub(1).map(|b| h[b]),
                    p[first * BS..stop * BS].iter().map(|&t| t as i64).collect(),
                    BS,
                ))
            } else {
                KvCacheEvent::Removed(BlockRemoved::plain(h[first..stop].to_vec()))
            };
            mapped.apply(worker, std::slice::from_ref(&event));
            trusted.apply(worker, std::slice::from_ref(&event));
            apply_hash_events(&mut hashed, ids[w], &HashEvents::from_events(&[event]));
            for h in &hashes {
                let want = mapped.overlaps(h, &["a", "b"], 0.0);
                assert_eq!(want, trusted.overlaps(h, &["a", "b"], 0.0));
                assert_eq!(want, hashed.overlaps(h, &["a", "b"], 0.0));
            }
            assert_eq!(trusted.stats(), hashed.stats());
            let sizes = |ix: &KvIndex| {
                let t = ix.table_sizes();
                (
                    t.held_keys,
                    t.duplicate_copies,
                    ix.worker_blocks("a"),
                    ix.worker_blocks("b"),
                )
            };
            assert_eq!(sizes(&mapped), sizes(&trusted));
            assert_eq!(sizes(&mapped), sizes(&hashed));
            let (m, t) = (mapped.stats(), trusted.stats());
            assert_eq!(
                (
                    m.blocks,
                    m.orphan_blocks,
                    m.unknown_removals,
                    m.evicted_blocks
                ),
                (
                    t.blocks,
                    t.orphan_blocks,
                    t.unknown_removals,
                    t.evicted_blocks
                )
            );
        }
        assert_eq!(trusted.table_sizes().engine_entries, 0);
        // Only an empty index without a memory bound switches.
        let mut ix = index(None);
        let p = tokens(2, 0);
        let h = own().hash_blocks(&p, None, 0, None);
        let stored = BlockStored::plain(h, None, p.iter().map(|&t| t as i64).collect(), BS);
        ix.apply("a", &[KvCacheEvent::Stored(stored)]);
        assert!(!trust_engine_hashes(&mut ix));
        assert!(!trust_engine_hashes(&mut index(Some(MemoryBound::Blocks(
            12
        )))));
    }
}
