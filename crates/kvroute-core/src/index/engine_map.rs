//! The router's stores' shared half: per worker, engine hash → own hash. The engines' block
//! hashes depend on `--prefix-caching-hash-algo` and a seed the router cannot know, so the
//! index hashes the stored tokens itself with its [`BlockHasher`] and keeps this map for the
//! `BlockRemoved` events, which carry engine hashes only.

use std::collections::hash_map::Entry;

use super::WorkerId;
use super::holdings::Holdings;
use super::store::slot;
use crate::blocks::BlockHasher;
use crate::hash_keyed::HashKeyed;
use crate::kvevents::events::BlockStored;

/// An engine hash's entry: the own hash of its tokens and its stored copies.
#[derive(Clone, Copy, Debug)]
pub(super) struct EngineEntry {
    pub(super) own: u64,
    pub(super) copies: u32,
}

/// Per worker, engine hash → own hash, and the hasher that names the tokens.
#[derive(Debug)]
pub(super) struct EngineMaps {
    hasher: BlockHasher,
    maps: Vec<HashKeyed<EngineEntry>>,
    /// The own hashes of the event being stored (kept for its buffer).
    own_hashes: Vec<u64>,
}

impl EngineMaps {
    pub(super) fn new(hasher: BlockHasher) -> Self {
        Self {
            hasher,
            maps: Vec::new(),
            own_hashes: Vec::new(),
        }
    }

    /// Worker `id`'s map.
    #[inline]
    pub(super) fn of(&mut self, id: WorkerId) -> &mut HashKeyed<EngineEntry> {
        slot(&mut self.maps, id)
    }

    /// The own hashes of `event`'s blocks stored by worker `id` under `keys`, in a buffer to
    /// hand back with [`EngineMaps::done`]; None (counted in `holdings`) when its parent is
    /// unknown to the worker (an orphan: an own hash chains every token before it) or its ids
    /// are not token ids.
    pub(super) fn own_hashes(
        &mut self,
        holdings: &mut Holdings,
        id: WorkerId,
        event: &BlockStored,
        keys: &[Vec<u8>],
    ) -> Option<Vec<u64>> {
        let n = event.block_hashes.len();
        let bs = self.hasher.block_size();
        let parent_own = match event.parent_block_hash {
            None => None,
            Some(p) => match self.of(id).get(&p) {
                Some(e) => Some(e.own),
                None => {
                    holdings.count_orphans(n);
                    return None;
                }
            },
        };
        // Any id outside u32, here or in a trailing partial block, means these are not token
        // ids: nothing to hash. The blocks' ids are checked as they are hashed.
        let trailing = event.token_ids[n * bs..]
            .iter()
            .fold(0u64, |high, &t| high | (t as u64) >> 32);
        let mut own_hashes = std::mem::take(&mut self.own_hashes);
        own_hashes.clear();
        if trailing != 0
            || !self.hasher.extend_chain_ids_keyed(
                &event.token_ids[..n * bs],
                parent_own,
                keys,
                &mut own_hashes,
            )
        {
            self.own_hashes = own_hashes;
            holdings.count_skipped(n);
            return None;
        }
        self.of(id).reserve(n);
        Some(own_hashes)
    }

    /// Hand back the buffer [`EngineMaps::own_hashes`] lent.
    pub(super) fn done(&mut self, own_hashes: Vec<u64>) {
        self.own_hashes = own_hashes;
    }

    /// Worker `id` stored engine hash `eh` of own hash `oh`: true when `eh` is new to it,
    /// false when it is another copy of a stored one (counted, nothing else changes).
    #[inline]
    pub(super) fn map(&mut self, id: WorkerId, eh: u64, oh: u64) -> bool {
        match self.of(id).entry(eh) {
            Entry::Occupied(mut e) => {
                e.get_mut().copies += 1;
                false
            }
            Entry::Vacant(v) => {
                v.insert(EngineEntry { own: oh, copies: 1 });
                true
            }
        }
    }

    /// A `BlockRemoved` of engine hash `eh` by worker `id`: the own hash it stood for once
    /// its last stored copy goes (its entry leaves the map), None while another copy is stored
    /// or when `eh` is unknown (counted in `holdings`).
    #[inline]
    pub(super) fn forget(&mut self, holdings: &mut Holdings, id: WorkerId, eh: u64) -> Option<u64> {
        match self.of(id).entry(eh) {
            Entry::Vacant(_) => {
                holdings.count_unknown_removal();
                None
            }
            Entry::Occupied(mut e) => {
                if e.get().copies > 1 {
                    e.get_mut().copies -= 1; // another copy of this engine block is stored
                    return None;
                }
                Some(e.remove().own)
            }
        }
    }

    /// Engine-hash entries over all workers.
    pub(super) fn entries(&self) -> usize {
        self.maps.iter().map(|m| m.len()).sum()
    }

    /// Stored copies of engine blocks beyond the first.
    pub(super) fn duplicate_copies(&self) -> usize {
        self.maps
            .iter()
            .flat_map(|m| m.values())
            .map(|e| e.copies as usize - 1)
            .sum()
    }
}
