//! The router's index: which worker holds which KV block, keyed by kvroute's own block hashes.
//!
//! Two sources feed it:
//!
//! * **Events** (authoritative). Each worker's KV cache events (`crate::kvevents::events`,
//!   decoded from vLLM's ZMQ stream or emitted by the engine model) say exactly which blocks it
//!   stored and evicted. The router's index never trusts the engine's block hashes as keys: they depend
//!   on `--prefix-caching-hash-algo` and a seed the router cannot know. It hashes the events'
//!   `token_ids` itself with [`BlockHasher`] (the function the router applies to prompts) and
//!   keeps, per worker, a map engine hash → own hash so that a `BlockRemoved`, which carries
//!   engine hashes only, can be applied.
//! * **Predictions** (a bridge). When the router sends a prompt to a worker it records the
//!   prompt's blocks there at once ([`KvIndex::record_routed`]): the worker holds them a few
//!   milliseconds later, but its `BlockStored` arrives only after the prefill step. A predicted
//!   entry lives `predicted_ttl` seconds (events replace it sooner) and each worker keeps at
//!   most `predicted_capacity_blocks` of them, least recently routed evicted first (for engines
//!   without events: set it to the worker's KV blocks and the TTL to None, and the index models
//!   the worker's LRU cache).
//!
//! Rules, and why:
//!
//! * **Counts per (worker, block).** vLLM does not deduplicate: two requests computing the same
//!   block at once both store it, and each copy is removed with its own event. A block leaves a
//!   worker only when its count returns to zero. Two engine hashes may also name the same
//!   tokens (a GPU and a CPU copy); the tokens stay held until both are gone.
//! * **Orphans are skipped.** A `BlockStored` whose parent this worker never stored (the index
//!   joined late, a replay gap was lost, the parent was skipped or evicted from the index)
//!   cannot be given own hashes: an own hash chains every token before it. Those blocks are
//!   counted (`IndexStats::orphan_blocks`) and left out, costing a missed opportunity, never a
//!   false hit. Their later removals are unknown engine hashes (`unknown_removals`).
//! * **Extra keys are hashed as vLLM hashes them.** A block stored under a LoRA adapter or a
//!   `cache_salt` carries its key tuple in `extra_keys`; the own hash mixes it in
//!   ([`crate::blocks::BlockKeys`]), exactly as the router mixes a request's adapter and salt
//!   into its prompt's hashes, so such a block matches only requests under the same keys.
//! * **Blocks kvroute cannot name are skipped** (`skipped_blocks`): another block size (a CPU
//!   offload tier), keys that are not text (multimodal inputs, prompt embeddings), an adapter
//!   without per-block keys (a vLLM too old to send them: its salt would be unknown), and
//!   malformed blocks (fewer tokens than blocks, ids that are not `u32`).
//! * `AllCleared` (and [`KvIndex::reset_worker`], for restarts and failed replays) forgets
//!   everything known about that worker, predicted entries included.
//! * **A memory bound** ([`MemoryBound`], blocks or bytes for the whole index): beyond it the
//!   least recently touched event-backed (worker, block) entries are dropped, as if evicted
//!   (counted in `IndexStats::evicted_blocks`, which the router exports). An entry is touched
//!   when it is stored and when a prompt holding it is routed to its worker, the same accesses
//!   that keep it in vLLM's own LRU. Predicted entries are bounded by their TTL and capacity.
//!
//! Look-up speed: each block maps to one entry per group of 64 workers, two `u64` masks (one
//! bit per worker: held by events, predicted). [`KvIndex::overlaps_into`] ANDs the masks along the prompt's chain and stops as
//! soon as no worker is left, so a look-up costs one map read per matched block
//! whatever the number of workers. Maps are keyed by hashes already uniform, with a cheap
//! mixer instead of SipHash.
//!
//! Storage: [`KvIndex`] owns the workers, the predictions and the look-ups; an
//! [`EventStore`] keeps the event-backed entries, one per storage mode and file: `flat` (no
//! memory bound: a held bit is the entry) and `bounded` (each entry in an LRU order), both
//! over `engine_map` (engine hash → own hash). A caller whose engines hash as the index does
//! may install a store of its own ([`KvIndex::use_store`]; the simulator does, in
//! `kvroute-sim`). `lru` is the slab list under both LRU orders, `holdings` the bits and
//! counters every store writes into.
//!
//! `now` arguments are seconds on one monotonic clock and must not go backwards.

mod bounded;
mod engine_map;
mod flat;
mod holdings;
mod lru;
mod store;

use std::collections::{HashMap, VecDeque};

use self::bounded::BoundedStore;
use self::flat::FlatStore;
pub use self::holdings::Holdings;
use self::holdings::{Worker, drop_predicted};
pub use self::store::EventStore;
use self::store::block_keys;
use crate::blocks::BlockHasher;
pub use crate::hash_keyed::HashKeyed;
use crate::kvevents::events::KvCacheEvent;

/// Estimated bytes one event-backed (worker, block) entry costs across the index's tables
/// (engine-hash entry, own-hash entry, its share of the worker mask, the LRU node, with the
/// hash tables' spare capacity): what [`MemoryBound::Bytes`] divides by.
pub const ENTRY_BYTES: usize = 128;

/// The index's own handle on a worker (stable while the worker is known; reused after
/// [`KvIndex::remove_worker`]).
pub type WorkerId = usize;

/// How much the index may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryBound {
    /// At most this many event-backed (worker, block) entries.
    Blocks(usize),
    /// At most about this many bytes ([`ENTRY_BYTES`] per entry).
    Bytes(usize),
}

impl MemoryBound {
    /// The bound in entries.
    pub fn blocks(self) -> usize {
        match self {
            MemoryBound::Blocks(n) => n,
            MemoryBound::Bytes(b) => b / ENTRY_BYTES,
        }
    }
}

/// Size and health of the index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Workers known.
    pub workers: usize,
    /// Event-backed (worker, block) pairs.
    pub blocks: usize,
    /// Predicted (worker, block) entries alive at the last call given a `now`.
    pub predicted: usize,
    /// Blocks stored under a parent the worker was not known to hold (cumulative).
    pub orphan_blocks: u64,
    /// Blocks a token-only hash cannot name (cumulative).
    pub skipped_blocks: u64,
    /// Removals of engine hashes the index did not know (cumulative).
    pub unknown_removals: u64,
    /// Entries dropped by the memory bound (cumulative).
    pub evicted_blocks: u64,
}

/// Sizes of the internal tables, to check that nothing is left behind (tests, debugging).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TableSizes {
    /// Own hashes with a mask of event-backed holders.
    pub held_keys: usize,
    /// Own hashes with a mask of predicted holders.
    pub predicted_keys: usize,
    /// Items in the predicted entries' expiry queue (stale ones included).
    pub expiry_queue: usize,
    /// Engine-hash entries over all workers.
    pub engine_entries: usize,
    /// Extra stored copies (vLLM duplicates, several engine hashes per own hash).
    pub duplicate_copies: usize,
}

/// Which worker holds which block, keyed by kvroute's own chained block hashes.
#[derive(Debug)]
pub struct KvIndex {
    hasher: BlockHasher,
    predicted_ttl: Option<f64>,
    predicted_capacity: Option<usize>,
    bound: Option<usize>,
    holdings: Holdings,
    store: Box<dyn EventStore>,
    by_name: HashMap<String, WorkerId>,
    free_slots: Vec<WorkerId>,
    next_generation: u64,
    /// (expiry, worker, generation, own hash) in expiry order; stale items are skipped.
    expiry: VecDeque<(f64, WorkerId, u64, u64)>,
    epoch: u64,
}

/// A configuration the index refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexConfigError(pub String);

impl std::fmt::Display for IndexConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for IndexConfigError {}

impl KvIndex {
    /// An empty index. `hasher` must be the one prompts are hashed with, its block size the
    /// engines'. `predicted_ttl`: seconds a predicted entry lives (None: until capacity evicts
    /// it); `predicted_capacity`: predicted entries per worker (None: the TTL bounds them);
    /// `bound`: the memory bound over event-backed entries (None: unbounded).
    pub fn new(
        hasher: BlockHasher,
        predicted_ttl: Option<f64>,
        predicted_capacity: Option<usize>,
        bound: Option<MemoryBound>,
    ) -> Result<Self, IndexConfigError> {
        if predicted_ttl.is_none() && predicted_capacity.is_none() {
            return Err(IndexConfigError(
                "predicted entries need a TTL or a per-worker capacity (else they grow without bound)".into(),
            ));
        }
        if let Some(ttl) = predicted_ttl
            && ttl < 0.0
        {
            return Err(IndexConfigError(format!(
                "predicted_ttl must be >= 0, got {ttl}"
            )));
        }
        if let Some(MemoryBound::Bytes(b)) = bound
            && b < ENTRY_BYTES
        {
            // A bound in bytes that holds no entry would forget every event at once.
            return Err(IndexConfigError(format!(
                "a memory bound of {b} bytes holds no entry ({ENTRY_BYTES} bytes each)"
            )));
        }
        let bound = bound.map(MemoryBound::blocks);
        let store: Box<dyn EventStore> = match bound {
            Some(limit) => Box::new(BoundedStore::new(hasher, limit)),
            None => Box::new(FlatStore::new(hasher)),
        };
        Ok(Self {
            hasher,
            predicted_ttl,
            predicted_capacity,
            bound,
            holdings: Holdings::default(),
            store,
            by_name: HashMap::new(),
            free_slots: Vec::new(),
            next_generation: 0,
            expiry: VecDeque::new(),
            epoch: 0,
        })
    }

    /// Keep event-backed entries in `store` from now on instead of the router's own (for
    /// engines known to name blocks as this index does; the simulator's store takes their
    /// block hashes as own hashes). Only an index that holds no event-backed entry can switch
    /// (its entries live in its store); returns whether it switched.
    pub fn use_store(&mut self, store: Box<dyn EventStore>) -> bool {
        if self.holdings.blocks != 0 || self.store.engine_entries() != 0 {
            return false;
        }
        self.store = store;
        true
    }

    /// The store, when it is an `S`.
    pub fn store<S: EventStore>(&self) -> Option<&S> {
        self.store.as_any().downcast_ref()
    }

    /// The store, when it is an `S`, with the holdings it writes into (for a caller applying
    /// events its store reads beside [`KvIndex::apply_to`]'s).
    pub fn store_mut<S: EventStore>(&mut self) -> Option<(&mut S, &mut Holdings)> {
        let store = self.store.as_any_mut().downcast_mut()?;
        Some((store, &mut self.holdings))
    }

    /// The hasher prompts must be hashed with.
    pub fn hasher(&self) -> BlockHasher {
        self.hasher
    }

    /// Seconds a predicted entry lives (None: until evicted by capacity).
    pub fn predicted_ttl(&self) -> Option<f64> {
        self.predicted_ttl
    }

    /// Predicted entries per worker (None: unbounded).
    pub fn predicted_capacity(&self) -> Option<usize> {
        self.predicted_capacity
    }

    /// The memory bound in entries (None: unbounded).
    pub fn bound_blocks(&self) -> Option<usize> {
        self.bound
    }

    /// Changes whenever a worker becomes known or is removed: a caller caching
    /// [`KvIndex::worker_id`] answers re-resolves when it moves.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    // -- workers --------------------------------------------------------------------------

    /// The id of a known worker.
    pub fn worker_id(&self, name: &str) -> Option<WorkerId> {
        self.by_name.get(name).copied()
    }

    /// The id of `name`, making it known (empty) if it was not.
    pub fn ensure_worker(&mut self, name: &str) -> WorkerId {
        if let Some(&id) = self.by_name.get(name) {
            return id;
        }
        let h = &mut self.holdings;
        let id = self.free_slots.pop().unwrap_or_else(|| {
            h.workers.push(None);
            h.workers.len() - 1
        });
        let word = id / 64;
        while h.masks.len() <= word {
            h.masks.push(HashKeyed::default());
        }
        self.next_generation += 1;
        h.workers[id] = Some(Worker::new(name, self.next_generation));
        self.by_name.insert(name.to_owned(), id);
        self.epoch += 1;
        id
    }

    /// Forget what `worker` holds (engine restart, AllBlocksCleared, lost events); it stays
    /// known and starts again from an empty cache.
    pub fn reset_worker(&mut self, worker: &str) {
        if let Some(id) = self.worker_id(worker) {
            self.clear(id);
        }
    }

    /// Forget `worker` entirely (it left the pool); its slot is reused by a later worker.
    pub fn remove_worker(&mut self, worker: &str) {
        if let Some(id) = self.by_name.remove(worker) {
            self.clear(id);
            self.holdings.workers[id] = None;
            self.free_slots.push(id);
            self.epoch += 1;
        }
    }

    fn clear(&mut self, id: WorkerId) {
        self.store.clear(&mut self.holdings, id);
        debug_assert_eq!(self.holdings.workers[id].as_ref().map(|w| w.held), Some(0));
        self.holdings.forget_predictions(id);
    }

    // -- events ---------------------------------------------------------------------------

    /// Apply one worker's KV cache events, in the order the engine emitted them.
    pub fn apply(&mut self, worker: &str, events: &[KvCacheEvent]) {
        let id = self.ensure_worker(worker);
        self.apply_to(id, events);
    }

    /// [`KvIndex::apply`] by id.
    pub fn apply_to(&mut self, id: WorkerId, events: &[KvCacheEvent]) {
        let bs = self.hasher.block_size();
        for event in events {
            match event {
                KvCacheEvent::Stored(stored) => {
                    let n = stored.block_hashes.len();
                    match (stored.block_size == bs && stored.token_ids.len() >= n * bs)
                        .then(|| block_keys(stored))
                        .flatten()
                    {
                        Some(keys) => self.store.store(&mut self.holdings, id, stored, &keys),
                        None => self.holdings.count_skipped(n),
                    }
                }
                KvCacheEvent::Removed(removed) => {
                    self.store.remove(&mut self.holdings, id, removed)
                }
                KvCacheEvent::AllCleared => self.clear(id),
            }
        }
    }

    // -- predictions ----------------------------------------------------------------------

    /// The router sent a prompt with these own block hashes to `worker` at `now`.
    pub fn record_routed(&mut self, worker: &str, block_hashes: &[u64], now: f64) {
        let id = self.ensure_worker(worker);
        self.record_routed_to(id, block_hashes, now);
    }

    /// [`KvIndex::record_routed`] by id.
    pub fn record_routed_to(&mut self, id: WorkerId, block_hashes: &[u64], now: f64) {
        self.expire(now);
        let expires = self.predicted_ttl.map_or(f64::INFINITY, |t| now + t);
        let track = self.predicted_ttl.is_some();
        let bounded = self.bound.is_some();
        let (word, bit) = (id / 64, 1u64 << (id % 64));
        let h = &mut self.holdings;
        let w = h.workers[id].as_mut().expect("known worker");
        let masks = &mut h.masks[word];
        // Tail first: vLLM frees a finished request's blocks in reverse so its tail is
        // evicted first; inserting in that order makes the LRU below evict the same way.
        for &oh in block_hashes.iter().rev() {
            // Never left empty: either bit is set below, or the entry was there already.
            let holders = masks.entry(oh).or_default();
            if holders.held & bit != 0 {
                if bounded {
                    self.store.touch(id, oh); // a hit touches the block in vLLM too
                }
                continue; // events already vouch for it
            }
            if holders.predicted & bit != 0 {
                let slot = *w.predicted.get(&oh).expect("a predicted bit has its entry");
                w.predicted_order.move_to_back(slot);
                w.predicted_order.get_mut(slot).1 = expires;
            } else {
                holders.predicted |= bit;
                let slot = w.predicted_order.push_back((oh, expires));
                w.predicted.insert(oh, slot);
                h.predicted += 1;
            }
            if track {
                self.expiry.push_back((expires, id, w.generation, oh));
            }
        }
        if let Some(cap) = self.predicted_capacity {
            while w.predicted.len() > cap {
                let slot = w.predicted_order.front().expect("non-empty");
                let (oh, _) = w.predicted_order.remove(slot);
                w.predicted.remove(&oh);
                h.predicted -= 1;
                drop_predicted(masks, oh, bit);
            }
        }
        if track && self.expiry.len() > 1024 && self.expiry.len() > 2 * h.predicted {
            self.compact_expiry();
        }
    }

    fn expire(&mut self, now: f64) {
        let h = &mut self.holdings;
        while let Some(&(expires, id, generation, oh)) = self.expiry.front() {
            if expires > now {
                break;
            }
            self.expiry.pop_front();
            let Some(w) = h.workers[id].as_mut() else {
                continue;
            };
            if w.generation != generation {
                continue;
            }
            if let Some(&slot) = w.predicted.get(&oh)
                && w.predicted_order.get(slot).1 == expires
            {
                w.predicted.remove(&oh);
                w.predicted_order.remove(slot);
                h.predicted -= 1;
                drop_predicted(&mut h.masks[id / 64], oh, 1u64 << (id % 64));
            }
        }
    }

    /// Rebuild the expiry queue from the live entries (refreshes leave stale items behind;
    /// this keeps its memory proportional to the entries alive).
    fn compact_expiry(&mut self) {
        let mut live: Vec<(f64, WorkerId, u64, u64)> = Vec::with_capacity(self.holdings.predicted);
        for (id, w) in self.holdings.workers.iter().enumerate() {
            if let Some(w) = w {
                live.extend(
                    w.predicted_order
                        .iter()
                        .map(|(oh, exp)| (exp, id, w.generation, oh)),
                );
            }
        }
        live.sort_by(|a, b| a.0.total_cmp(&b.0));
        self.expiry = live.into();
    }

    // -- queries --------------------------------------------------------------------------

    /// Number of leading blocks of the prompt each worker holds, aligned with `workers`
    /// (distinct names; a worker never heard of holds nothing).
    pub fn overlaps(&mut self, block_hashes: &[u64], workers: &[&str], now: f64) -> Vec<usize> {
        let ids: Vec<Option<WorkerId>> = workers.iter().map(|n| self.worker_id(n)).collect();
        let mut out = Vec::new();
        self.overlaps_into(block_hashes, &ids, now, &mut out);
        out
    }

    /// [`KvIndex::overlaps`] by id (None: unknown), written into `out`.
    pub fn overlaps_into(
        &mut self,
        block_hashes: &[u64],
        workers: &[Option<WorkerId>],
        now: f64,
        out: &mut Vec<usize>,
    ) {
        self.expire(now);
        out.clear();
        out.resize(workers.len(), 0);
        let words = self.holdings.masks.len();
        for word in 0..words {
            let mut alive = 0u64;
            let mut position = [0u32; 64];
            for (i, id) in workers.iter().enumerate() {
                if let Some(id) = *id
                    && id / 64 == word
                {
                    alive |= 1 << (id % 64);
                    position[id % 64] = i as u32;
                }
            }
            if alive == 0 {
                continue;
            }
            let masks = &self.holdings.masks[word];
            let mut depth = 0usize;
            for h in block_hashes {
                let m = masks.get(h).map_or(0, |e| e.held | e.predicted) & alive;
                if m != alive {
                    assign(out, &position, alive & !m, depth);
                    alive = m;
                    if alive == 0 {
                        break;
                    }
                }
                depth += 1;
            }
            assign(out, &position, alive, depth);
        }
    }

    /// Blocks the index attributes to `worker` (event-backed plus predicted).
    pub fn worker_blocks(&self, worker: &str) -> usize {
        self.worker_id(worker)
            .map_or(0, |id| self.worker_blocks_of(id))
    }

    /// [`KvIndex::worker_blocks`] by id.
    pub fn worker_blocks_of(&self, id: WorkerId) -> usize {
        self.holdings.workers[id]
            .as_ref()
            .map_or(0, |w| w.held + w.predicted.len())
    }

    /// Size and health.
    pub fn stats(&self) -> IndexStats {
        let h = &self.holdings;
        IndexStats {
            workers: self.by_name.len(),
            blocks: h.blocks,
            predicted: h.predicted,
            orphan_blocks: h.orphan_blocks,
            skipped_blocks: h.skipped_blocks,
            unknown_removals: h.unknown_removals,
            evicted_blocks: h.evicted_blocks,
        }
    }

    /// Sizes of the internal tables.
    pub fn table_sizes(&self) -> TableSizes {
        let holders = || self.holdings.masks.iter().flat_map(HashMap::values);
        TableSizes {
            held_keys: holders().filter(|e| e.held != 0).count(),
            predicted_keys: holders().filter(|e| e.predicted != 0).count(),
            expiry_queue: self.expiry.len(),
            engine_entries: self.store.engine_entries(),
            duplicate_copies: self.store.duplicate_copies(),
        }
    }

    /// Names of the known workers.
    pub fn worker_names(&self) -> impl Iterator<Item = &str> {
        self.holdings
            .workers
            .iter()
            .flatten()
            .map(|w| w.name.as_str())
    }
}

fn assign(out: &mut [usize], position: &[u32; 64], mut bits: u64, depth: usize) {
    while bits != 0 {
        let b = bits.trailing_zeros() as usize;
        out[position[b] as usize] = depth;
        bits &= bits - 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvevents::events::{BlockRemoved, BlockStored};

    const BS: usize = 4;

    fn own() -> BlockHasher {
        BlockHasher::new(BS, crate::blocks::DEFAULT_HASH_SEED).unwrap()
    }

    fn engine() -> BlockHasher {
        BlockHasher::new(BS, 987_654_321).unwrap()
    }

    fn tokens(blocks: usize, start: u32) -> Vec<u32> {
        (start..start + (blocks * BS) as u32).collect()
    }

    fn stored(toks: &[u32], first: usize, stop: usize) -> KvCacheEvent {
        let hashes = engine().hash_blocks(toks, None, 0, None);
        KvCacheEvent::Stored(BlockStored::plain(
            hashes[first..stop].to_vec(),
            first.checked_sub(1).map(|p| hashes[p]),
            toks[first * BS..stop * BS]
                .iter()
                .map(|&t| t as i64)
                .collect(),
            BS,
        ))
    }

    fn removed(toks: &[u32], blocks: &[usize]) -> KvCacheEvent {
        let hashes = engine().hash_blocks(toks, None, 0, None);
        KvCacheEvent::Removed(BlockRemoved::plain(
            blocks.iter().map(|&b| hashes[b]).collect(),
        ))
    }

    fn index(bound: Option<MemoryBound>) -> KvIndex {
        KvIndex::new(own(), Some(2.0), None, bound).unwrap()
    }

    #[test]
    fn own_hashes_counts_and_orphans() {
        let mut ix = index(None);
        let p = tokens(5, 100);
        let oh = own().hash_blocks(&p, None, 0, None);
        ix.apply("a", &[stored(&p, 0, 2), stored(&p, 2, 5), stored(&p, 0, 5)]);
        ix.apply("b", &[stored(&p, 3, 5)]);
        assert_eq!(ix.overlaps(&oh, &["a", "b", "c"], 0.0), vec![5, 0, 0]);
        assert_eq!(ix.stats().orphan_blocks, 2);
        ix.apply("a", &[removed(&p, &[2])]);
        assert_eq!(ix.overlaps(&oh, &["a"], 0.0), vec![5]);
        ix.apply("a", &[removed(&p, &[2])]);
        assert_eq!(ix.overlaps(&oh, &["a"], 0.0), vec![2]);
        ix.apply("a", &[KvCacheEvent::AllCleared]);
        assert_eq!(ix.stats().blocks, 0);
        assert_eq!(ix.table_sizes(), TableSizes::default());
    }

    #[test]
    fn predictions_expire_and_events_replace_them() {
        let mut ix = index(None);
        let p = tokens(4, 0);
        let oh = own().hash_blocks(&p, None, 0, None);
        ix.record_routed("a", &oh, 10.0);
        assert_eq!(ix.overlaps(&oh, &["a", "b"], 10.5), vec![4, 0]);
        assert_eq!(ix.overlaps(&oh, &["a"], 12.0), vec![0]);
        ix.record_routed("a", &oh, 20.0);
        ix.apply("a", &[stored(&p, 0, 3)]);
        assert_eq!((ix.stats().predicted, ix.stats().blocks), (1, 3));
    }

    #[test]
    fn the_memory_bound_drops_the_least_recently_touched() {
        let mut ix = index(Some(MemoryBound::Blocks(6)));
        let a = tokens(4, 0);
        let b = tokens(4, 1000);
        ix.apply("w", &[stored(&a, 0, 4)]);
        ix.apply("w", &[stored(&b, 0, 4)]);
        assert_eq!(ix.stats().blocks, 6);
        assert_eq!(ix.stats().evicted_blocks, 2);
        let oa = own().hash_blocks(&a, None, 0, None);
        let ob = own().hash_blocks(&b, None, 0, None);
        // a's first two blocks went first (oldest); a then misses from its first block.
        assert_eq!(ix.overlaps(&oa, &["w"], 0.0), vec![0]);
        assert_eq!(ix.overlaps(&ob, &["w"], 0.0), vec![4]);
        // Routing b touches it, so the next store evicts what is left of a.
        ix.record_routed("w", &ob, 0.0);
        ix.apply("w", &[stored(&tokens(2, 5000), 0, 2)]);
        assert_eq!(ix.overlaps(&ob, &["w"], 0.0), vec![4]);
        assert_eq!(ix.stats().evicted_blocks, 4);
        // A removal of an evicted block is an unknown one, never an error.
        ix.apply("w", &[removed(&a, &[0])]);
        assert_eq!(ix.stats().unknown_removals, 1);
        assert_eq!(MemoryBound::Bytes(ENTRY_BYTES * 3).blocks(), 3);
        let bound = Some(MemoryBound::Bytes(ENTRY_BYTES - 1));
        assert!(KvIndex::new(own(), Some(2.0), None, bound).is_err());
    }

    #[test]
    fn many_workers_span_several_mask_words() {
        let mut ix = index(None);
        let p = tokens(3, 7);
        let oh = own().hash_blocks(&p, None, 0, None);
        let names: Vec<String> = (0..150).map(|i| format!("w{i}")).collect();
        for (i, n) in names.iter().enumerate() {
            ix.apply(n, &[stored(&p, 0, 1 + i % 3)]);
        }
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let got = ix.overlaps(&oh, &refs, 0.0);
        assert!(got.iter().enumerate().all(|(i, &o)| o == 1 + i % 3));
        ix.remove_worker("w0");
        assert_eq!(ix.overlaps(&oh, &["w0", "w1"], 0.0), vec![0, 2]);
    }
}
