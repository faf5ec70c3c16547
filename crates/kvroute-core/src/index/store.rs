//! The one interface behind which the index keeps its event-backed entries
//! ([`EventStore`]), and the rule deciding which stored blocks kvroute can name at all.
//!
//! The index ([`super::KvIndex`]) owns the workers, the predictions and the look-ups; a store
//! turns one worker's `BlockStored`, `BlockRemoved` and `AllBlocksCleared` into held bits in
//! the [`Holdings`], keeping whatever it needs to apply the next event (engine hash → own
//! hash, stored copies, an LRU order under a memory bound). The router's two stores are in
//! this module's `flat` (no memory bound) and `bounded` files; a caller whose engines hash
//! as the index does may install its own ([`super::KvIndex::use_store`]).

use std::any::Any;
use std::fmt::Debug;

use super::WorkerId;
use super::holdings::Holdings;
use crate::blocks::encode_extra_keys;
use crate::kvevents::codec::text_extra_keys;
use crate::kvevents::events::{BlockRemoved, BlockStored};

/// How the index keeps its event-backed entries: one implementation per storage mode.
///
/// Every call concerns a worker the index knows (`id`); the index calls
/// [`EventStore::store`] only with blocks kvroute can name (the index's rules) and counts the
/// others itself.
pub trait EventStore: Debug + Send + Sync + Any {
    /// Worker `id` stored `event`'s blocks, whose encoded extra keys are `keys` (one per
    /// block, or empty: none has any).
    fn store(
        &mut self,
        holdings: &mut Holdings,
        id: WorkerId,
        event: &BlockStored,
        keys: &[Vec<u8>],
    );
    /// Worker `id` evicted `event`'s blocks.
    fn remove(&mut self, holdings: &mut Holdings, id: WorkerId, event: &BlockRemoved);
    /// Worker `id` holds nothing any more (its predictions are the index's to forget).
    fn clear(&mut self, holdings: &mut Holdings, id: WorkerId);
    /// A prompt routed to worker `id` met its held block `oh`: the access that keeps the
    /// block in vLLM's LRU, for a store that orders its entries by it. Called only under a
    /// memory bound.
    fn touch(&mut self, id: WorkerId, oh: u64);
    /// Engine-hash entries over all workers (a store keeping no engine → own map: 0).
    fn engine_entries(&self) -> usize;
    /// Stored copies beyond the first of each held (worker, block).
    fn duplicate_copies(&self) -> usize;
    /// The store, to be found again by its type ([`super::KvIndex::store_mut`]).
    fn as_any(&self) -> &dyn Any;
    /// [`EventStore::as_any`], mutably.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// The encoded extra keys of each block of `event` (empty: none has any), or None when kvroute
/// cannot hash them (see the index's module docs): a key that is not a tuple of strings, or
/// an adapter named without per-block keys.
pub(super) fn block_keys(event: &BlockStored) -> Option<Vec<Vec<u8>>> {
    let Some(keys) = event
        .extra_keys
        .as_ref()
        .filter(|keys| keys.iter().any(Option::is_some))
    else {
        return (event.lora_id.is_none() && event.lora_name.is_none()).then(Vec::new);
    };
    keys.iter()
        .map(|key| match key {
            None => Some(Vec::new()),
            Some(raw) => text_extra_keys(raw).map(|k| encode_extra_keys(&k)),
        })
        .collect()
}

/// A worker's entry in a per-worker table indexed by [`WorkerId`], made on first use.
pub(super) fn slot<T: Default>(table: &mut Vec<T>, id: WorkerId) -> &mut T {
    if table.len() <= id {
        table.resize_with(id + 1, T::default);
    }
    &mut table[id]
}
