//! The router's index: which worker holds which KV block, keyed by kvroute's own block hashes.
//!
//! Two sources feed it:
//!
//! * **Events** (authoritative). Each worker's KV cache events (`crate::kvevents::events`,
//!   decoded from vLLM's ZMQ stream or emitted by the engine model) say exactly which blocks it
//!   stored and evicted. The index never trusts the engine's block hashes as keys: they depend
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
//! `now` arguments are seconds on one monotonic clock and must not go backwards.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};

use crate::blocks::{BlockHasher, encode_extra_keys};
pub use crate::hash_keyed::HashKeyed;
use crate::kvevents::codec::text_extra_keys;
use crate::kvevents::events::{BlockRemoved, BlockStored, HashEvent, HashEvents, KvCacheEvent};

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

/// A doubly linked list over a slab: O(1) push to the back, unlink and move to the back by
/// slot, the least recent item at the front.
#[derive(Clone, Debug)]
struct LruList<T> {
    nodes: Vec<LruNode<T>>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

#[derive(Clone, Debug)]
struct LruNode<T> {
    item: T,
    prev: u32,
    next: u32,
}

const NIL: u32 = u32::MAX;

impl<T: Copy> LruList<T> {
    fn new() -> Self {
        Self {
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    fn push_back(&mut self, item: T) -> u32 {
        let node = LruNode {
            item,
            prev: self.tail,
            next: NIL,
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.nodes[s as usize] = node;
                s
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        if self.tail != NIL {
            self.nodes[self.tail as usize].next = slot;
        } else {
            self.head = slot;
        }
        self.tail = slot;
        self.len += 1;
        slot
    }

    fn detach(&mut self, slot: u32) {
        let (prev, next) = {
            let n = &self.nodes[slot as usize];
            (n.prev, n.next)
        };
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        } else {
            self.head = next;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        } else {
            self.tail = prev;
        }
    }

    fn remove(&mut self, slot: u32) -> T {
        self.detach(slot);
        self.free.push(slot);
        self.len -= 1;
        self.nodes[slot as usize].item
    }

    fn move_to_back(&mut self, slot: u32) {
        if self.tail == slot {
            return;
        }
        self.detach(slot);
        let n = &mut self.nodes[slot as usize];
        n.prev = self.tail;
        n.next = NIL;
        self.nodes[self.tail as usize].next = slot;
        self.tail = slot;
    }

    fn get_mut(&mut self, slot: u32) -> &mut T {
        &mut self.nodes[slot as usize].item
    }

    fn front(&self) -> Option<u32> {
        (self.head != NIL).then_some(self.head)
    }

    fn clear(&mut self) {
        self.nodes.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
        self.len = 0;
    }

    fn iter(&self) -> impl Iterator<Item = T> + '_ {
        let mut at = self.head;
        std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let n = &self.nodes[at as usize];
            at = n.next;
            Some(n.item)
        })
    }
}

/// An engine hash's entry: the own hash of its tokens and its stored copies.
#[derive(Clone, Copy, Debug)]
struct EngineEntry {
    own: u64,
    copies: u32,
}

/// A (worker, own hash) event-backed entry: engine hashes vouching for it and its LRU slot.
#[derive(Clone, Copy, Debug)]
struct OwnEntry {
    refs: u32,
    lru: u32,
    /// One engine hash mapped to it (the others are found by a scan, only when the memory
    /// bound drops an entry several engine hashes vouch for).
    engine: u64,
}

/// A block's holders among one group of 64 workers, one bit per worker: those whose events
/// vouch for it, and those it is predicted at (a worker's bit is in one at most).
#[derive(Clone, Copy, Debug, Default)]
struct Holders {
    held: u64,
    predicted: u64,
}

/// Everything the index knows about one worker.
#[derive(Debug)]
struct Worker {
    name: String,
    /// Distinguishes this worker from a later one in the same slot (expiry queue items).
    generation: u64,
    engine: HashKeyed<EngineEntry>,
    /// Its event-backed entries (empty in a flat index, see `KvIndex::flat`: its held bits
    /// are its entries then, and `copies` counts their extra copies).
    own: HashKeyed<OwnEntry>,
    /// Flat index only: own hash → stored copies beyond the first (rare: vLLM duplicates
    /// of a trusted hash, or several engine hashes naming the same tokens).
    copies: HashKeyed<u32>,
    /// Event-backed entries it has (`own.len()` when not flat).
    held: usize,
    /// own hash → LRU slot of `(own hash, expiry)`, least recently routed first.
    predicted: HashKeyed<u32>,
    predicted_order: LruList<(u64, f64)>,
}

/// Mark worker `w` (its `bit` in `holders`, the masks-table entry of own hash `oh`) as holding
/// the block on an event's word, retiring a prediction of it (the event now vouches for the
/// block: the prediction has served its purpose). Returns whether a prediction was retired.
#[inline]
fn set_held(holders: &mut Holders, w: &mut Worker, oh: u64, bit: u64) -> bool {
    holders.held |= bit;
    w.held += 1;
    if holders.predicted & bit == 0 {
        return false;
    }
    holders.predicted &= !bit;
    let slot = w
        .predicted
        .remove(&oh)
        .expect("a predicted bit has its entry");
    w.predicted_order.remove(slot);
    true
}

/// Which worker holds which block, keyed by kvroute's own chained block hashes.
#[derive(Debug)]
pub struct KvIndex {
    hasher: BlockHasher,
    predicted_ttl: Option<f64>,
    predicted_capacity: Option<usize>,
    bound: Option<usize>,
    workers: Vec<Option<Worker>>,
    by_name: HashMap<String, WorkerId>,
    free_slots: Vec<WorkerId>,
    next_generation: u64,
    /// Per group of 64 workers: own hash → its event-backed and predicted holders (one
    /// table for both, so that a look-up, a store replacing a prediction and a prediction
    /// meeting a held block each read one entry).
    masks: Vec<HashKeyed<Holders>>,
    /// (expiry, worker, generation, own hash) in expiry order; stale items are skipped.
    expiry: VecDeque<(f64, WorkerId, u64, u64)>,
    /// Event-backed entries in touch order (only with a memory bound).
    lru: LruList<(WorkerId, u64)>,
    blocks: usize,
    predicted: usize,
    epoch: u64,
    orphan_blocks: u64,
    skipped_blocks: u64,
    unknown_removals: u64,
    evicted_blocks: u64,
    own_hashes: Vec<u64>,
    /// The engines hash blocks exactly as this index does (see
    /// [`KvIndex::trust_engine_hashes`]): an engine hash is the own hash.
    engine_hashes_are_own: bool,
    /// No memory bound: an entry needs no LRU slot, so a worker's entries are its bits in
    /// `masks` alone (beside the engine map when hashes are mapped), its duplicates counted
    /// apart in `Worker::copies`: one table fewer per stored and removed block. With a bound
    /// each entry needs its LRU slot, found by own hash (a routed prompt touches it), hence
    /// `Worker::own`.
    flat: bool,
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
        Ok(Self {
            hasher,
            predicted_ttl,
            predicted_capacity,
            bound: bound.map(MemoryBound::blocks),
            workers: Vec::new(),
            by_name: HashMap::new(),
            free_slots: Vec::new(),
            next_generation: 0,
            masks: Vec::new(),
            expiry: VecDeque::new(),
            lru: LruList::new(),
            blocks: 0,
            predicted: 0,
            epoch: 0,
            orphan_blocks: 0,
            skipped_blocks: 0,
            unknown_removals: 0,
            evicted_blocks: 0,
            own_hashes: Vec::new(),
            engine_hashes_are_own: false,
            flat: bound.is_none(),
        })
    }

    /// Take every engine block hash as this index's own hash of the same tokens, from now on:
    /// for engines known to hash exactly as the index does (the simulator's engine model
    /// built with the index's hasher), whose events then need neither re-hashing nor an
    /// engine → own map: the same entries and answers for half the table work per event.
    /// Without a memory bound the index then keeps no per-worker entry either (no LRU slot
    /// to keep): a block's held bit is the entry, one table probe per stored or removed
    /// block.
    /// Only an index that holds nothing can switch (its earlier entries were mapped); returns
    /// whether it is on.
    pub fn trust_engine_hashes(&mut self) -> bool {
        if !self.engine_hashes_are_own
            && self.blocks == 0
            && self.workers.iter().flatten().all(|w| w.engine.is_empty())
        {
            self.engine_hashes_are_own = true;
        }
        self.engine_hashes_are_own
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
        let id = self.free_slots.pop().unwrap_or_else(|| {
            self.workers.push(None);
            self.workers.len() - 1
        });
        let word = id / 64;
        while self.masks.len() <= word {
            self.masks.push(HashKeyed::default());
        }
        self.next_generation += 1;
        self.workers[id] = Some(Worker {
            name: name.to_owned(),
            generation: self.next_generation,
            engine: HashKeyed::default(),
            own: HashKeyed::default(),
            copies: HashKeyed::default(),
            held: 0,
            predicted: HashKeyed::default(),
            predicted_order: LruList::new(),
        });
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
            self.workers[id] = None;
            self.free_slots.push(id);
            self.epoch += 1;
        }
    }

    fn clear(&mut self, id: WorkerId) {
        let (word, bit) = (id / 64, 1u64 << (id % 64));
        let w = self.workers[id].as_mut().expect("known worker");
        self.blocks -= w.held;
        let masks = &mut self.masks[word];
        if self.flat && w.held > 0 {
            if self.engine_hashes_are_own {
                // No per-worker table names them: the word's table is scanned.
                masks.retain(|_, e| {
                    e.held &= !bit;
                    e.held != 0 || e.predicted != 0
                });
            } else {
                // Each held block has an engine hash mapped to it.
                for e in w.engine.values() {
                    drop_bits(masks, e.own, bit, 0);
                }
            }
        }
        w.held = 0;
        w.copies.clear();
        for (oh, entry) in w.own.drain() {
            drop_bits(masks, oh, bit, 0);
            if self.bound.is_some() {
                self.lru.remove(entry.lru);
            }
        }
        for (oh, _) in w.predicted.drain() {
            drop_bits(masks, oh, 0, bit);
        }
        self.predicted -= w.predicted_order.len;
        w.predicted_order.clear();
        w.engine.clear();
    }

    // -- events ---------------------------------------------------------------------------

    /// Apply one worker's KV cache events, in the order the engine emitted them.
    pub fn apply(&mut self, worker: &str, events: &[KvCacheEvent]) {
        let id = self.ensure_worker(worker);
        self.apply_to(id, events);
    }

    /// [`KvIndex::apply`] by id.
    pub fn apply_to(&mut self, id: WorkerId, events: &[KvCacheEvent]) {
        for event in events {
            match event {
                KvCacheEvent::Stored(stored) => self.store(id, stored),
                KvCacheEvent::Removed(removed) => self.remove(id, removed),
                KvCacheEvent::AllCleared => self.clear(id),
            }
        }
    }

    fn remove(&mut self, id: WorkerId, event: &BlockRemoved) {
        if self.engine_hashes_are_own {
            self.remove_hashes(id, &event.block_hashes);
            return;
        }
        if self.flat {
            self.remove_flat(id, &event.block_hashes);
            return;
        }
        for &eh in &event.block_hashes {
            let w = self.workers[id].as_mut().expect("known worker");
            let Some(oh) = forget_engine_hash(&mut w.engine, eh, &mut self.unknown_removals) else {
                continue;
            };
            let released = self.release(id, oh, eh);
            debug_assert!(released, "an engine entry has its own entry");
        }
    }

    /// Removals of mapped engine hashes in a flat index: [`KvIndex::release`]'s flat case
    /// for each, the worker and its masks word borrowed once for the event (vLLM sends one
    /// `BlockRemoved` per evicted block: this is half of all block events).
    fn remove_flat(&mut self, id: WorkerId, hashes: &[u64]) {
        let bit = 1u64 << (id % 64);
        let w = self.workers[id].as_mut().expect("known worker");
        let masks = &mut self.masks[id / 64];
        for &eh in hashes {
            let Some(oh) = forget_engine_hash(&mut w.engine, eh, &mut self.unknown_removals) else {
                continue;
            };
            let released = release_flat(masks, w, oh, bit, &mut self.blocks);
            debug_assert!(released, "an engine entry has its held bit");
        }
    }

    /// Removals of trusted engine hashes (each the own hash), in order.
    fn remove_hashes(&mut self, id: WorkerId, hashes: &[u64]) {
        for &h in hashes {
            if !self.release(id, h, h) {
                self.unknown_removals += 1;
            }
        }
    }

    /// One engine hash `eh` stops vouching for `(id, oh)`: the entry leaves when none is
    /// left. False when `(id, oh)` is not held.
    #[inline]
    fn release(&mut self, id: WorkerId, oh: u64, eh: u64) -> bool {
        let (word, bit) = (id / 64, 1u64 << (id % 64));
        let w = self.workers[id].as_mut().expect("known worker");
        if self.flat {
            return release_flat(&mut self.masks[word], w, oh, bit, &mut self.blocks);
        }
        let Entry::Occupied(mut own) = w.own.entry(oh) else {
            return false;
        };
        if own.get().refs > 1 {
            let own = own.get_mut();
            // Another engine hash (trusted hashes: another copy) still vouches for these tokens.
            own.refs -= 1;
            if !self.engine_hashes_are_own && own.engine == eh {
                own.engine = w
                    .engine
                    .iter()
                    .find(|(_, e)| e.own == oh)
                    .map_or(0, |(k, _)| *k);
            }
            return true;
        }
        let lru = own.remove().lru;
        if self.bound.is_some() {
            self.lru.remove(lru);
        }
        w.held -= 1;
        self.blocks -= 1;
        drop_bits(&mut self.masks[word], oh, bit, 0);
        true
    }

    fn store(&mut self, id: WorkerId, event: &BlockStored) {
        let n = event.block_hashes.len();
        let bs = self.hasher.block_size();
        let keys = match (event.block_size == bs && event.token_ids.len() >= n * bs)
            .then(|| block_keys(event))
            .flatten()
        {
            Some(keys) => keys,
            None => {
                self.skipped_blocks += n as u64;
                return;
            }
        };
        if self.engine_hashes_are_own {
            self.store_hashes(id, event.parent_block_hash, &event.block_hashes);
            return;
        }
        let w = self.workers[id].as_mut().expect("known worker");
        let parent_own = match event.parent_block_hash {
            None => None,
            Some(p) => match w.engine.get(&p) {
                Some(e) => Some(e.own),
                None => {
                    self.orphan_blocks += n as u64;
                    return;
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
                &keys,
                &mut own_hashes,
            )
        {
            self.own_hashes = own_hashes;
            self.skipped_blocks += n as u64;
            return;
        }
        w.engine.reserve(n);
        if self.flat {
            self.store_flat(id, &event.block_hashes, &own_hashes);
            self.own_hashes = own_hashes;
            return;
        }
        for (&eh, &oh) in event.block_hashes.iter().zip(&own_hashes) {
            let w = self.workers[id].as_mut().expect("known worker");
            match w.engine.entry(eh) {
                Entry::Occupied(mut e) => {
                    e.get_mut().copies += 1;
                    continue;
                }
                Entry::Vacant(v) => {
                    v.insert(EngineEntry { own: oh, copies: 1 });
                }
            }
            self.hold(id, eh, oh, true);
        }
        self.own_hashes = own_hashes;
        self.enforce_bound();
    }

    /// The blocks of a mapped `BlockStored` in a flat index (no bound to enforce): each engine
    /// hash new to the worker vouches for its own hash ([`KvIndex::hold`]'s flat case), the
    /// worker and its masks word borrowed once for the event.
    fn store_flat(&mut self, id: WorkerId, engine_hashes: &[u64], own_hashes: &[u64]) {
        let bit = 1u64 << (id % 64);
        let w = self.workers[id].as_mut().expect("known worker");
        let masks = &mut self.masks[id / 64];
        for (&eh, &oh) in engine_hashes.iter().zip(own_hashes) {
            match w.engine.entry(eh) {
                Entry::Occupied(mut e) => {
                    e.get_mut().copies += 1; // another copy, counted, not touched
                    continue;
                }
                Entry::Vacant(v) => {
                    v.insert(EngineEntry { own: oh, copies: 1 });
                }
            }
            hold_flat(masks, w, oh, bit, &mut self.blocks, &mut self.predicted);
        }
    }

    /// A `BlockStored` of trusted engine hashes (each the own hash) after `parent`.
    fn store_hashes(&mut self, id: WorkerId, parent: Option<u64>, hashes: &[u64]) {
        if let Some(p) = parent {
            let w = self.workers[id].as_ref().expect("known worker");
            let held = if self.flat {
                self.masks[id / 64]
                    .get(&p)
                    .is_some_and(|e| e.held & (1u64 << (id % 64)) != 0)
            } else {
                w.own.contains_key(&p)
            };
            if !held {
                self.orphan_blocks += hashes.len() as u64;
                return;
            }
        }
        for &h in hashes {
            // Another stored copy of the same engine block is counted and not touched, as
            // the engine map's copies are.
            self.hold(id, h, h, false);
        }
        self.enforce_bound();
    }

    /// Engine hash `eh` now vouches for `(id, oh)`: a new entry, or one more reference
    /// (touched when `touch_held`).
    #[inline]
    fn hold(&mut self, id: WorkerId, eh: u64, oh: u64, touch_held: bool) {
        let (word, bit) = (id / 64, 1u64 << (id % 64));
        let bounded = self.bound.is_some();
        let w = self.workers[id].as_mut().expect("known worker");
        if self.flat {
            hold_flat(
                &mut self.masks[word],
                w,
                oh,
                bit,
                &mut self.blocks,
                &mut self.predicted,
            );
            return;
        }
        match w.own.entry(oh) {
            Entry::Occupied(mut own) => {
                let own = own.get_mut();
                own.refs += 1;
                if bounded && touch_held {
                    self.lru.move_to_back(own.lru);
                }
                return;
            }
            Entry::Vacant(v) => {
                let lru = if bounded {
                    self.lru.push_back((id, oh))
                } else {
                    NIL
                };
                v.insert(OwnEntry {
                    refs: 1,
                    lru,
                    engine: eh,
                });
            }
        }
        self.blocks += 1;
        if set_held(self.masks[word].entry(oh).or_default(), w, oh, bit) {
            self.predicted -= 1;
        }
    }

    /// Apply one worker's KV events given as hash events, in order: what [`KvIndex::apply_to`]
    /// does with the full events they were reduced from (`HashEvents::from_events`), for an
    /// index that trusts the engines' hashes (panics otherwise: an untrusted index must hash
    /// the tokens, which hash events do not carry) and engines that emit plain blocks of its
    /// block size (the engine model's), the only ones whose events it would keep.
    pub fn apply_hash_events(&mut self, id: WorkerId, events: &HashEvents) {
        assert!(
            self.engine_hashes_are_own,
            "hash events need an index that trusts the engine hashes"
        );
        for event in events.iter() {
            match event {
                HashEvent::Stored { parent, hashes } => self.store_hashes(id, parent, hashes),
                HashEvent::Removed(hashes) => self.remove_hashes(id, hashes),
                HashEvent::AllCleared => self.clear(id),
            }
        }
    }

    /// Whether engine hashes are taken as own hashes ([`KvIndex::trust_engine_hashes`]).
    pub fn trusts_engine_hashes(&self) -> bool {
        self.engine_hashes_are_own
    }

    /// Drop the least recently touched entries beyond the memory bound.
    fn enforce_bound(&mut self) {
        let Some(limit) = self.bound else { return };
        while self.blocks > limit {
            let Some(slot) = self.lru.front() else { break };
            let (id, oh) = self.lru.remove(slot);
            let (word, bit) = (id / 64, 1u64 << (id % 64));
            let w = self.workers[id]
                .as_mut()
                .expect("an LRU entry's worker is known");
            let own = w.own.remove(&oh).expect("an LRU entry is held");
            w.held -= 1;
            if own.refs > 1 {
                w.engine.retain(|_, e| e.own != oh);
            } else {
                w.engine.remove(&own.engine);
            }
            drop_bits(&mut self.masks[word], oh, bit, 0);
            self.blocks -= 1;
            self.evicted_blocks += 1;
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
        let w = self.workers[id].as_mut().expect("known worker");
        let masks = &mut self.masks[word];
        // Tail first: vLLM frees a finished request's blocks in reverse so its tail is
        // evicted first; inserting in that order makes the LRU below evict the same way.
        for &h in block_hashes.iter().rev() {
            // Never left empty: either bit is set below, or the entry was there already.
            let holders = masks.entry(h).or_default();
            if holders.held & bit != 0 {
                if bounded {
                    let own = w.own.get(&h).expect("a held bit has its entry");
                    self.lru.move_to_back(own.lru); // a hit touches the block in vLLM too
                }
                continue; // events already vouch for it
            }
            if holders.predicted & bit != 0 {
                let slot = *w.predicted.get(&h).expect("a predicted bit has its entry");
                w.predicted_order.move_to_back(slot);
                w.predicted_order.get_mut(slot).1 = expires;
            } else {
                holders.predicted |= bit;
                let slot = w.predicted_order.push_back((h, expires));
                w.predicted.insert(h, slot);
                self.predicted += 1;
            }
            if track {
                self.expiry.push_back((expires, id, w.generation, h));
            }
        }
        if let Some(cap) = self.predicted_capacity {
            while w.predicted.len() > cap {
                let slot = w.predicted_order.front().expect("non-empty");
                let (h, _) = w.predicted_order.remove(slot);
                w.predicted.remove(&h);
                self.predicted -= 1;
                drop_bits(masks, h, 0, bit);
            }
        }
        if track && self.expiry.len() > 1024 && self.expiry.len() > 2 * self.predicted {
            self.compact_expiry();
        }
    }

    fn expire(&mut self, now: f64) {
        while let Some(&(expires, id, generation, h)) = self.expiry.front() {
            if expires > now {
                break;
            }
            self.expiry.pop_front();
            let Some(w) = self.workers[id].as_mut() else {
                continue;
            };
            if w.generation != generation {
                continue;
            }
            if let Some(&slot) = w.predicted.get(&h)
                && w.predicted_order.nodes[slot as usize].item.1 == expires
            {
                w.predicted.remove(&h);
                w.predicted_order.remove(slot);
                self.predicted -= 1;
                drop_bits(&mut self.masks[id / 64], h, 0, 1u64 << (id % 64));
            }
        }
    }

    /// Rebuild the expiry queue from the live entries (refreshes leave stale items behind;
    /// this keeps its memory proportional to the entries alive).
    fn compact_expiry(&mut self) {
        let mut live: Vec<(f64, WorkerId, u64, u64)> = Vec::with_capacity(self.predicted);
        for (id, w) in self.workers.iter().enumerate() {
            if let Some(w) = w {
                live.extend(
                    w.predicted_order
                        .iter()
                        .map(|(h, exp)| (exp, id, w.generation, h)),
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
        let words = self.masks.len();
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
            let masks = &self.masks[word];
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
        self.workers[id]
            .as_ref()
            .map_or(0, |w| w.held + w.predicted.len())
    }

    /// Size and health.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            workers: self.by_name.len(),
            blocks: self.blocks,
            predicted: self.predicted,
            orphan_blocks: self.orphan_blocks,
            skipped_blocks: self.skipped_blocks,
            unknown_removals: self.unknown_removals,
            evicted_blocks: self.evicted_blocks,
        }
    }

    /// Sizes of the internal tables.
    pub fn table_sizes(&self) -> TableSizes {
        let workers = self.workers.iter().flatten();
        TableSizes {
            held_keys: self
                .masks
                .iter()
                .flat_map(HashMap::values)
                .filter(|e| e.held != 0)
                .count(),
            predicted_keys: self
                .masks
                .iter()
                .flat_map(HashMap::values)
                .filter(|e| e.predicted != 0)
                .count(),
            expiry_queue: self.expiry.len(),
            engine_entries: workers.clone().map(|w| w.engine.len()).sum(),
            duplicate_copies: workers
                .map(|w| {
                    w.engine
                        .values()
                        .map(|e| e.copies as usize - 1)
                        .sum::<usize>()
                        + w.own.values().map(|o| o.refs as usize - 1).sum::<usize>()
                        + w.copies.values().map(|&c| c as usize).sum::<usize>()
                })
                .sum(),
        }
    }

    /// Names of the known workers.
    pub fn worker_names(&self) -> impl Iterator<Item = &str> {
        self.workers.iter().flatten().map(|w| w.name.as_str())
    }
}

/// A flat index's entry of own hash `oh` for worker `w` (its `bit` in the word's `masks`),
/// vouched for once more: its held bit set (and a prediction of it retired), or, already
/// held, one more copy counted in `Worker::copies`. `blocks` and `predicted` are the index's
/// totals.
#[inline]
fn hold_flat(
    masks: &mut HashKeyed<Holders>,
    w: &mut Worker,
    oh: u64,
    bit: u64,
    blocks: &mut usize,
    predicted: &mut usize,
) {
    let holders = masks.entry(oh).or_default();
    if holders.held & bit != 0 {
        *w.copies.entry(oh).or_insert(0) += 1; // another copy, counted, not touched
        return;
    }
    *blocks += 1;
    if set_held(holders, w, oh, bit) {
        *predicted -= 1;
    }
}

/// [`hold_flat`] undone: one copy fewer, or the held bit cleared once none is left (`blocks`
/// the index's total). False when `w` does not hold `oh`.
#[inline]
fn release_flat(
    masks: &mut HashKeyed<Holders>,
    w: &mut Worker,
    oh: u64,
    bit: u64,
    blocks: &mut usize,
) -> bool {
    let Entry::Occupied(mut holders) = masks.entry(oh) else {
        return false;
    };
    if holders.get().held & bit == 0 {
        return false;
    }
    if !w.copies.is_empty()
        && let Entry::Occupied(mut extra) = w.copies.entry(oh)
    {
        // Another stored copy still vouches for these tokens.
        if *extra.get() > 1 {
            *extra.get_mut() -= 1;
        } else {
            extra.remove();
        }
        return true;
    }
    let e = holders.get_mut();
    e.held &= !bit;
    if e.predicted == 0 && e.held == 0 {
        holders.remove();
    }
    w.held -= 1;
    *blocks -= 1;
    true
}

/// Clear `held` and `predicted` bits of `h`'s holders, forgetting `h` once it has none.
fn drop_bits(table: &mut HashKeyed<Holders>, h: u64, held: u64, predicted: u64) {
    if let Entry::Occupied(mut m) = table.entry(h) {
        let e = m.get_mut();
        e.held &= !held;
        e.predicted &= !predicted;
        if e.held == 0 && e.predicted == 0 {
            m.remove();
        }
    }
}

fn assign(out: &mut [usize], position: &[u32; 64], mut bits: u64, depth: usize) {
    while bits != 0 {
        let b = bits.trailing_zeros() as usize;
        out[position[b] as usize] = depth;
        bits &= bits - 1;
    }
}

/// A `BlockRemoved` of engine hash `eh`: the own hash it stood for once its last stored copy
/// goes (its entry leaves the map), None while another copy is stored or when `eh` is unknown
/// (counted in `unknown`).
fn forget_engine_hash(
    engine: &mut HashKeyed<EngineEntry>,
    eh: u64,
    unknown: &mut u64,
) -> Option<u64> {
    match engine.entry(eh) {
        Entry::Vacant(_) => {
            *unknown += 1;
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

/// The encoded extra keys of each block of `event` (empty: none has any), or None when kvroute
/// cannot hash them (see the module docs): a key that is not a tuple of strings, or an
/// adapter named without per-block keys.
fn block_keys(event: &BlockStored) -> Option<Vec<Vec<u8>>> {
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

#[cfg(test)]
mod tests {
    use super::*;

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

    /// Events from engines hashing with the index's own hasher, applied to an index that maps
    /// them, to one that trusts them and, reduced to hash events, to another that trusts
    /// them: the same answers and counts after every event.
    #[test]
    fn trusted_engine_hashes_answer_as_mapped_ones() {
        for bound in [None, Some(MemoryBound::Blocks(12))] {
            let mut mapped = index(bound);
            let mut trusted = index(bound);
            assert!(trusted.trust_engine_hashes());
            let mut hashed = index(bound);
            assert!(hashed.trust_engine_hashes());
            let ids = [hashed.ensure_worker("a"), hashed.ensure_worker("b")];
            assert_eq!(
                ids,
                [trusted.ensure_worker("a"), trusted.ensure_worker("b")]
            );
            let mut rng = crate::pyrandom::PyRandom::from_seed(7);
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
                hashed.apply_hash_events(ids[w], &HashEvents::from_events(&[event]));
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
        }
        // Only an empty index switches.
        let mut ix = index(None);
        let p = tokens(2, 0);
        ix.apply("a", &[stored(&p, 0, 2)]);
        assert!(!ix.trust_engine_hashes());
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
