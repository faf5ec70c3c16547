//! `BlockPool`: the KV block allocator and prefix cache of one vLLM v1 worker.
//!
//! Follows `vllm/v1/core/block_pool.py` and its `FreeKVCacheBlockQueue`:
//!
//! * Block 0 is the null block: taken at start-up and never handed out, so usable capacity is
//!   `num_blocks - 1`.
//! * Free blocks (ref count 0) sit in an LRU queue. A finished request frees its blocks in
//!   reverse, its tail first. Of the blocks freed together, those holding a cached hash are
//!   appended to the queue's tail in that order (the shared head of a prompt survives
//!   longest); those holding none (a partial last block, or any block without prefix caching)
//!   are put at the queue's head, in that order, to be reused first: they can never serve a
//!   hit, and reusing them spares a cached block (vLLM 0.32's `free_blocks`: "LIFO reuse of
//!   non-cached blocks").
//! * New blocks come from the head of the free queue. A block that still holds a cached hash
//!   is evicted only then, when its memory is reused (`BlockRemoved`), never when its request
//!   ends.
//! * A prefix-cache hit "touches" blocks: ref count +1, and a block at ref count 0 leaves the
//!   free queue (it can no longer be evicted while in use). The queue is a doubly linked list
//!   threaded through two arrays indexed by block id, so leaving it from the middle is O(1),
//!   as in vLLM.
//! * Identical content is not deduplicated: two blocks can carry the same hash (one per
//!   request that computed it), and each is stored and later removed with its own event. A
//!   lookup answers the oldest holder.
//!
//! Events are collected as data (`kvroute_core::kvevents::events`) when `emit_events` is on, for the
//! engine to hand out per step: full [`KvCacheEvent`]s, or, for the simulator's own index
//! ([`BlockPool::set_hash_events`]), the same events as [`HashEvents`] (hashes only).

use std::collections::VecDeque;

use kvroute_core::blocks::{BlockKeys, usable_blocks};
use kvroute_core::hash_keyed::HashKeyed;
use kvroute_core::kvevents::codec::encode_text_extra_keys;
use kvroute_core::kvevents::events::{BlockRemoved, BlockStored, KvCacheEvent};

use crate::hash_events::HashEvents;

/// A KV block's id: its index in the pool.
pub type BlockId = u32;

/// The reserved null block.
pub const NULL_BLOCK: BlockId = 0;

/// End of the free queue's links, and an empty slot of the hash table.
const NIL: u32 = u32::MAX;

/// One block's state, packed: everything a take, a free, a touch or an eviction reads or
/// writes of a block sits in one 24-byte record (a cache line holds more than two), where
/// six parallel arrays made each block visited in a scrambled free queue cost six cache
/// misses. The pools of a 64-worker simulation then stay in the core's L2.
#[derive(Clone, Copy, Debug)]
struct BlockMeta {
    /// The hash the block holds while cached (valid only when `HAS_HASH` is set).
    hash: u64,
    /// Free-queue links (NIL at the ends; meaningless outside the queue).
    prev: u32,
    next: u32,
    /// vLLM's `KVCacheBlock.ref_cnt`.
    ref_cnt: u32,
    /// How many times the block was taken from the free queue, truncated: a block whose
    /// count is unchanged has held the same hash all along (see `find_longest_hit_memo`;
    /// wrapping after 2³² takes of one block cannot fool a memo, which is dropped long before).
    generation: u32,
}

impl BlockMeta {
    const FREE: Self = Self {
        hash: 0,
        prev: NIL,
        next: NIL,
        ref_cnt: 0,
        generation: 0,
    };
}

/// The prefix cache's table: block hash → the oldest block holding it.
///
/// Open addressing with linear probing, deleted by backward shift (no tombstones). A slot is
/// 8 bytes: the block, and 32 bits of its hash's fingerprint (the high half of the hash times
/// an odd constant, which also gives the slot a hash probes first). The full hash is the
/// block's own (`BlockMeta::hash`, set while the block is in the table), so a fingerprint
/// match is confirmed there: the answer stays exact with half the bytes per slot of a table
/// of `(hash, block)` pairs.
///
/// A pool caches at most one hash per block, so the table never holds more than `num_blocks`
/// entries and is sized once: no rehash ever. A miss evicts ~150 hashes and caches ~150
/// others, and those table operations are most of a 64-worker simulation's time, paid in
/// probe runs (a longer run is more slots read and more mispredicted exits) more than in
/// bytes: hence 8-byte slots kept at most 1/6 full (`examples/sim_speed.rs` times it).
#[derive(Clone, Debug)]
struct HashTable {
    /// (fingerprint, block); `block == NIL` is an empty slot.
    slots: Vec<(u32, BlockId)>,
    /// `fingerprint >> shift` is the first slot probed.
    shift: u32,
    len: usize,
}

impl HashTable {
    fn with_room_for(entries: usize) -> Self {
        // Six slots per block: at most 1/6 full (see above).
        let capacity = (entries * 6).max(8).next_power_of_two();
        Self {
            slots: vec![(0, NIL); capacity],
            shift: 32 - capacity.trailing_zeros(),
            len: 0,
        }
    }

    /// The hash's fingerprint (multiply-shift: the high bits of the product, so small test
    /// hashes spread too). Multiplying by an odd constant is a bijection, so distinct hashes
    /// share a fingerprint only by chance (2⁻³²), and then their blocks' hashes tell them apart.
    #[inline]
    fn fingerprint(h: u64) -> u32 {
        (h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
    }

    /// The slot a fingerprint probes first.
    #[inline]
    fn home(&self, fp: u32) -> usize {
        (fp >> self.shift) as usize
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// The block holding `h` per the table (`meta`: the pool's block records).
    #[inline]
    fn get(&self, h: u64, meta: &[BlockMeta]) -> Option<BlockId> {
        let fp = Self::fingerprint(h);
        let mask = self.mask();
        let mut i = self.home(fp);
        loop {
            let (f, b) = self.slots[i];
            if b == NIL {
                return None;
            }
            if f == fp && meta[b as usize].hash == h {
                return Some(b);
            }
            i = (i + 1) & mask;
        }
    }

    /// The slot of `block`'s entry, which is in the table under `h`.
    #[inline]
    fn slot_of(&self, h: u64, block: BlockId) -> usize {
        let mask = self.mask();
        let mut i = self.home(Self::fingerprint(h));
        while self.slots[i].1 != block {
            debug_assert!(self.slots[i].1 != NIL, "the block is in the table");
            i = (i + 1) & mask;
        }
        i
    }

    /// Insert `h → b` unless `h` is present; returns the present block then. `meta[b].hash`
    /// must be `h` already.
    #[inline]
    fn insert_if_absent(&mut self, h: u64, b: BlockId, meta: &[BlockMeta]) -> Option<BlockId> {
        let fp = Self::fingerprint(h);
        let mask = self.mask();
        let mut i = self.home(fp);
        loop {
            let (f, old) = self.slots[i];
            if old == NIL {
                debug_assert!(
                    self.len < self.slots.len() - 1,
                    "the table is sized for every block"
                );
                self.slots[i] = (fp, b);
                self.len += 1;
                return None;
            }
            if f == fp && meta[old as usize].hash == h {
                return Some(old);
            }
            i = (i + 1) & mask;
        }
    }

    /// Point the entry of `h`, now `old`'s, at `new` (whose hash is `h` too).
    fn replace(&mut self, h: u64, old: BlockId, new: BlockId) {
        let i = self.slot_of(h, old);
        self.slots[i].1 = new;
    }

    /// Remove `block`'s entry (it holds `h`), shifting back the entries of its probe run that
    /// would no longer be reachable.
    #[inline]
    fn remove(&mut self, h: u64, block: BlockId) {
        let mut hole = self.slot_of(h, block);
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let (f, b) = self.slots[j];
            if b == NIL {
                break;
            }
            // Entry j stays unless the hole lies cyclically between its home and j.
            let home = self.home(f);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = (f, b);
                hole = j;
            }
        }
        self.slots[hole] = (0, NIL);
        self.len -= 1;
    }

    fn clear(&mut self) {
        self.slots.fill((0, NIL));
        self.len = 0;
    }

    /// The blocks in the table (one per cached hash).
    fn blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.slots.iter().map(|&(_, b)| b).filter(|&b| b != NIL)
    }
}

/// Tokens of a request's sequence (prompt then generated tokens), read by `BlockStored`.
///
/// The prompt comes in two parts, a head shared with other requests (a simulator's common
/// prefix, held once) and the request's own tokens: the pool reads them as one sequence and
/// never needs them joined.
#[derive(Clone, Copy, Debug)]
pub struct TokenSeq<'a> {
    /// The prompt's shared head.
    pub prompt_head: &'a [u32],
    /// The rest of the prompt.
    pub prompt: &'a [u32],
    /// The tokens generated after it (only as many as the sequence has reached matter).
    pub output: &'a [u32],
    /// The request's LoRA adapter and cache salt, for the event's `lora_name` and
    /// `extra_keys`.
    pub keys: &'a BlockKeys,
    /// The adapter's id, for the event's `lora_id`.
    pub lora_id: Option<i64>,
}

impl TokenSeq<'_> {
    /// A sequence of one prompt slice and its output.
    pub fn new<'a>(prompt: &'a [u32], output: &'a [u32]) -> TokenSeq<'a> {
        TokenSeq {
            prompt_head: &[],
            prompt,
            output,
            keys: &BlockKeys::PLAIN,
            lora_id: None,
        }
    }

    /// Tokens `[lo, hi)` of the sequence, as the event carries them.
    pub fn range(&self, lo: usize, hi: usize) -> Vec<i64> {
        let mut out = Vec::with_capacity(hi - lo);
        let mut at = 0;
        for part in [self.prompt_head, self.prompt, self.output] {
            let end = at + part.len();
            if lo < end && hi > at {
                let (a, b) = (lo.max(at) - at, hi.min(end) - at);
                out.extend(part[a..b].iter().map(|&t| i64::from(t)));
            }
            at = end;
        }
        out
    }
}

/// Not enough free blocks for a request for `wanted` (only `free` are).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutOfBlocks {
    /// Blocks asked for.
    pub wanted: usize,
    /// Blocks free.
    pub free: usize,
}

impl std::fmt::Display for OutOfBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "cannot get {} free blocks, only {} free",
            self.wanted, self.free
        )
    }
}

impl std::error::Error for OutOfBlocks {}

/// The KV blocks of one worker: ref counts, the LRU free queue and the prefix cache.
#[derive(Clone, Debug)]
pub struct BlockPool {
    num_blocks: usize,
    block_size: usize,
    enable_caching: bool,
    emit_events: bool,
    /// Per block id: its links, ref count, hash and generation.
    meta: Vec<BlockMeta>,
    /// Per block id: whether it holds a cached hash (in use or free), and whether it is in
    /// the free queue. Kept beside `meta` as bit flags, one byte per block.
    flags: Vec<u8>,
    head: u32,
    tail: u32,
    num_free: usize,
    /// hash -> the oldest block holding it (what a lookup returns).
    cached: HashTable,
    /// hash -> younger holders of the same hash, oldest first (rare: vLLM does not dedup).
    more_holders: HashKeyed<VecDeque<BlockId>>,
    pending_events: Vec<KvCacheEvent>,
    /// Events are collected as `hash_events` instead of `pending_events`.
    hash_only: bool,
    hash_events: HashEvents,
    version: u64,
    /// The last hit found for a chain, by the chain's first hash: its blocks and their
    /// generations then. Bounded; any entry may be dropped.
    hit_memo: HashKeyed<Vec<(BlockId, u32)>>,
    /// Scratch for `free_blocks`: the freed blocks that hold no hash, kept to spare an
    /// allocation per call.
    freed_uncached: Vec<BlockId>,
}

/// `flags` bit: the block holds a cached hash.
const HAS_HASH: u8 = 1;
/// `flags` bit: the block is in the free queue.
const IN_FREE: u8 = 2;

impl BlockPool {
    /// A pool of `num_blocks` blocks (the null block included, so at least 2) of
    /// `block_size` tokens; `enable_caching` false is `--no-enable-prefix-caching`;
    /// `emit_events` collects KV events for a publisher.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        enable_caching: bool,
        emit_events: bool,
    ) -> Self {
        assert!(
            num_blocks >= 2,
            "need at least 2 KV blocks (one is the null block)"
        );
        assert!(num_blocks < NIL as usize, "too many blocks");
        let mut pool = Self {
            num_blocks,
            block_size,
            enable_caching,
            emit_events,
            meta: vec![BlockMeta::FREE; num_blocks],
            flags: vec![0; num_blocks],
            head: NIL,
            tail: NIL,
            num_free: 0,
            cached: HashTable::with_room_for(num_blocks),
            more_holders: HashKeyed::default(),
            pending_events: Vec::new(),
            hash_only: false,
            hash_events: HashEvents::default(),
            version: 0,
            hit_memo: HashKeyed::default(),
            freed_uncached: Vec::new(),
        };
        for b in 1..num_blocks as u32 {
            pool.push_free(b);
        }
        pool
    }

    // -- queries ---------------------------------------------------------------------------

    /// Total blocks, the null block included.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Whether prefix caching is on.
    pub fn enable_caching(&self) -> bool {
        self.enable_caching
    }

    /// Whether KV events are collected.
    pub fn emit_events(&self) -> bool {
        self.emit_events
    }

    /// Blocks in the free queue (cached or not).
    pub fn num_free_blocks(&self) -> usize {
        self.num_free
    }

    /// Bumped whenever a change could let a waiting request in: a block returns to the free
    /// queue, blocks become cached, or the cache is reset. (Taking blocks or evicting them
    /// only ever makes admission harder.) The scheduler skips re-trying a blocked head while
    /// it is unchanged.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Ref count of `block`, as vLLM's `KVCacheBlock.ref_cnt`.
    pub fn ref_cnt(&self, block: BlockId) -> u32 {
        self.meta[block as usize].ref_cnt
    }

    /// The hash `block` holds (cached, in use or free), if any.
    pub fn block_hash(&self, block: BlockId) -> Option<u64> {
        let i = block as usize;
        (self.flags[i] & HAS_HASH != 0).then_some(self.meta[i].hash)
    }

    /// Fraction of usable blocks held by requests (vLLM's `kv_cache_usage_perc`): cached but
    /// free blocks do not count, so an idle worker reads 0 even with a full cache.
    pub fn usage(&self) -> f64 {
        1.0 - self.num_free as f64 / usable_blocks(self.num_blocks) as f64
    }

    /// The oldest block holding `block_hash`, if any.
    pub fn get_cached_block(&self, block_hash: u64) -> Option<BlockId> {
        self.cached.get(block_hash, &self.meta)
    }

    /// Every holder of `block_hash`, oldest first.
    pub fn holders(&self, block_hash: u64) -> Vec<BlockId> {
        let mut out: Vec<BlockId> = self.get_cached_block(block_hash).into_iter().collect();
        if let Some(more) = self.more_holders.get(&block_hash) {
            out.extend(more.iter().copied());
        }
        out
    }

    /// Cached hashes (each once, however many blocks hold it), in no particular order.
    pub fn cached_hashes(&self) -> impl Iterator<Item = u64> + '_ {
        self.cached.blocks().map(|b| self.meta[b as usize].hash)
    }

    /// The free queue from head (evicted first) to tail.
    pub fn free_queue(&self) -> FreeQueueIter<'_> {
        FreeQueueIter {
            pool: self,
            at: self.head,
        }
    }

    /// Blocks of the longest cached prefix of `block_hashes` (at most `max_blocks`).
    pub fn find_longest_hit(&self, block_hashes: &[u64], max_blocks: usize) -> Vec<BlockId> {
        let mut hit = Vec::new();
        if !self.enable_caching {
            return hit;
        }
        for &h in &block_hashes[..max_blocks.min(block_hashes.len())] {
            match self.cached.get(h, &self.meta) {
                Some(b) => hit.push(b),
                None => break,
            }
        }
        hit
    }

    /// `find_longest_hit`, answered mostly from the last hit found for the same first hash.
    ///
    /// A remembered block still answers the lookup of its position while its generation is
    /// unchanged (it was never taken, so it held that hash all along and no holder older than
    /// it can have appeared: new holders are always younger) and the hash at that position is
    /// the one it holds. Checking that reads one packed record instead of probing the hash
    /// table (a waiting request is looked up again at each step until admitted, and requests
    /// sharing a prefix look up the same chain). Past the remembered part, the table answers.
    pub fn find_longest_hit_memo(
        &mut self,
        block_hashes: &[u64],
        max_blocks: usize,
    ) -> Vec<BlockId> {
        let limit = max_blocks.min(block_hashes.len());
        if !self.enable_caching || limit == 0 {
            return Vec::new();
        }
        if self.cached.get(block_hashes[0], &self.meta).is_none() {
            // The usual miss: nothing to remember, nothing to look up further.
            self.hit_memo.remove(&block_hashes[0]);
            return Vec::new();
        }
        let mut memo = self.hit_memo.remove(&block_hashes[0]).unwrap_or_default();
        let mut n = 0;
        while n < memo.len().min(limit) {
            let (b, g) = memo[n];
            let m = &self.meta[b as usize];
            if m.generation != g
                || self.flags[b as usize] & HAS_HASH == 0
                || m.hash != block_hashes[n]
            {
                break;
            }
            n += 1;
        }
        memo.truncate(n);
        while n < limit {
            match self.cached.get(block_hashes[n], &self.meta) {
                Some(b) => memo.push((b, self.meta[b as usize].generation)),
                None => break,
            }
            n += 1;
        }
        let hit: Vec<BlockId> = memo.iter().map(|&(b, _)| b).collect();
        if !memo.is_empty() {
            if self.hit_memo.len() >= 4 * self.num_blocks {
                self.hit_memo.clear();
            }
            self.hit_memo.insert(block_hashes[0], memo);
        }
        hit
    }

    /// How many of `blocks` sit in the free queue (a touch would take them out of it).
    pub fn num_evictable(&self, blocks: &[BlockId]) -> usize {
        blocks
            .iter()
            .filter(|&&b| self.flags[b as usize] & IN_FREE != 0)
            .count()
    }

    // -- mutations -------------------------------------------------------------------------

    /// Take hit blocks into use: ref count +1, out of the free queue if they were free.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if self.flags[b as usize] & IN_FREE != 0 {
                self.unlink(b);
            }
            self.meta[b as usize].ref_cnt += 1;
        }
    }

    /// Take `n` blocks from the head of the free queue, evicting the hashes they hold.
    pub fn get_new_blocks(&mut self, n: usize) -> Result<Vec<BlockId>, OutOfBlocks> {
        if n > self.num_free {
            return Err(OutOfBlocks {
                wanted: n,
                free: self.num_free,
            });
        }
        let mut out = Vec::with_capacity(n);
        self.take_into(n, &mut out);
        Ok(out)
    }

    /// `get_new_blocks` appending to `out`; the caller has checked there are `n` free.
    ///
    /// The `n` blocks at the head of the free queue leave it together: one walk down its
    /// links, the new head's back link set once (unlinking them one by one rewrote the link
    /// of a block about to leave too, for every block: a miss takes ~150).
    pub(crate) fn take_into(&mut self, n: usize, out: &mut Vec<BlockId>) {
        debug_assert!(n <= self.num_free);
        if n == 0 {
            return;
        }
        let mut b = self.head;
        for _ in 0..n {
            let i = b as usize;
            let m = &mut self.meta[i];
            m.ref_cnt = 1;
            m.generation = m.generation.wrapping_add(1);
            let (h, next) = (m.hash, m.next);
            let flags = self.flags[i];
            self.flags[i] = flags & !(IN_FREE | HAS_HASH);
            if flags & HAS_HASH != 0 {
                self.forget_holder(b, h);
                if self.emit_events {
                    if self.hash_only {
                        self.hash_events.push_removed(h);
                    } else {
                        self.pending_events
                            .push(KvCacheEvent::Removed(BlockRemoved::plain(vec![h])));
                    }
                }
            }
            out.push(b);
            b = next;
        }
        self.head = b;
        if b == NIL {
            self.tail = NIL;
        } else {
            self.meta[b as usize].prev = NIL;
        }
        self.num_free -= n;
    }

    fn forget_holder(&mut self, block: BlockId, block_hash: u64) {
        if self.more_holders.is_empty() {
            // The usual case: every cached hash has exactly one holder.
            self.cached.remove(block_hash, block);
            return;
        }
        let Some(more) = self.more_holders.get_mut(&block_hash) else {
            self.cached.remove(block_hash, block);
            return;
        };
        if self.cached.get(block_hash, &self.meta) == Some(block) {
            let next = more.pop_front().expect("younger holders are never empty");
            self.cached.replace(block_hash, block, next);
        } else if let Some(i) = more.iter().position(|&b| b == block) {
            more.remove(i);
        }
        if more.is_empty() {
            self.more_holders.remove(&block_hash);
        }
    }

    /// Register blocks `[num_cached, num_full)` of a request as cached.
    ///
    /// `blocks` and `block_hashes` are the request's (at least `num_full` of each);
    /// `num_cached` of its blocks are cached already (hits or earlier steps); `tokens` is its
    /// sequence, for the `BlockStored` event.
    pub fn cache_full_blocks(
        &mut self,
        blocks: &[BlockId],
        block_hashes: &[u64],
        num_cached: usize,
        num_full: usize,
        tokens: TokenSeq<'_>,
    ) {
        if !self.enable_caching || num_cached >= num_full {
            return;
        }
        self.version += 1;
        for i in num_cached..num_full {
            let (b, h) = (blocks[i], block_hashes[i]);
            self.meta[b as usize].hash = h;
            self.flags[b as usize] |= HAS_HASH;
            if self.cached.insert_if_absent(h, b, &self.meta).is_some() {
                self.more_holders.entry(h).or_default().push_back(b);
            }
        }
        if self.emit_events {
            let parent = (num_cached > 0).then(|| block_hashes[num_cached - 1]);
            if self.hash_only {
                self.hash_events
                    .push_stored(parent, &block_hashes[num_cached..num_full]);
                return;
            }
            let bs = self.block_size;
            let mut event = BlockStored::plain(
                block_hashes[num_cached..num_full].to_vec(),
                parent,
                tokens.range(num_cached * bs, num_full * bs),
                bs,
            );
            if !tokens.keys.is_plain() {
                // As vLLM's `BlockPool.cache_full_blocks`: the adapter's id and name, and
                // each block's key tuple (None where a block has none).
                event.lora_id = tokens.lora_id;
                event.lora_name = tokens.keys.lora_name.clone();
                event.extra_keys = Some(
                    (num_cached..num_full)
                        .map(|i| {
                            let keys = tokens.keys.for_block(i);
                            (!keys.is_empty()).then(|| encode_text_extra_keys(&keys))
                        })
                        .collect(),
                );
            }
            self.pending_events.push(KvCacheEvent::Stored(event));
        }
    }

    /// Drop one reference from each block, given in eviction order (callers pass a request's
    /// blocks reversed: tail first). Those reaching 0 that hold a cached hash join the free
    /// queue's tail in that order and keep their hash until reused; those that hold none go to
    /// the queue's head, in that order, to be reused before any cached block.
    pub fn free_blocks(&mut self, ordered_blocks: impl IntoIterator<Item = BlockId>) {
        self.version += 1;
        let mut uncached = std::mem::take(&mut self.freed_uncached);
        for b in ordered_blocks {
            let r = &mut self.meta[b as usize].ref_cnt;
            debug_assert!(*r > 0, "freeing a free block");
            *r -= 1;
            if *r == 0 {
                if self.enable_caching && self.flags[b as usize] & HAS_HASH != 0 {
                    self.push_free(b);
                } else {
                    uncached.push(b);
                }
            }
        }
        for &b in uncached.iter().rev() {
            self.push_free_front(b);
        }
        uncached.clear();
        self.freed_uncached = uncached;
    }

    /// Forget every cached hash, as `/reset_prefix_cache` does. Like vLLM, refuses (returns
    /// false) while any request holds blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free != usable_blocks(self.num_blocks) {
            return false;
        }
        self.cached.clear();
        self.more_holders.clear();
        for f in &mut self.flags {
            *f &= !HAS_HASH;
        }
        self.version += 1;
        if self.emit_events {
            if self.hash_only {
                self.hash_events.push_cleared();
            } else {
                self.pending_events.push(KvCacheEvent::AllCleared);
            }
        }
        true
    }

    /// The events collected since the last call.
    pub fn take_events(&mut self) -> Vec<KvCacheEvent> {
        std::mem::take(&mut self.pending_events)
    }

    /// Whether any events are waiting to be taken.
    pub fn has_events(&self) -> bool {
        !self.pending_events.is_empty() || !self.hash_events.is_empty()
    }

    /// Collect events as [`HashEvents`] (`on`) or as full [`KvCacheEvent`]s (the default),
    /// when events are collected at all. For the simulator, whose index takes its engines'
    /// hashes as its own and reads nothing else of an event. Events pending are carried
    /// over: full ones become hash events exactly; hash events pending when switching back
    /// (none between a simulation's steps) cannot regain their tokens and are dropped.
    pub fn set_hash_events(&mut self, on: bool) {
        if on == self.hash_only {
            return;
        }
        self.hash_only = on;
        if on {
            let full = std::mem::take(&mut self.pending_events);
            self.hash_events = HashEvents::from_events(&full);
        } else {
            self.hash_events.clear();
        }
    }

    /// Whether events are collected as [`HashEvents`].
    pub fn hash_events_on(&self) -> bool {
        self.hash_only
    }

    /// Move the hash events collected since the last call into `out` (cleared first; the
    /// two swap buffers, so neither allocates once warm).
    pub fn take_hash_events_into(&mut self, out: &mut HashEvents) {
        out.clear();
        std::mem::swap(out, &mut self.hash_events);
    }

    // -- the free queue ----------------------------------------------------------------------

    fn push_free(&mut self, b: BlockId) {
        let i = b as usize;
        self.meta[i].prev = self.tail;
        self.meta[i].next = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.meta[self.tail as usize].next = b;
        }
        self.tail = b;
        self.flags[i] |= IN_FREE;
        self.num_free += 1;
    }

    fn push_free_front(&mut self, b: BlockId) {
        let i = b as usize;
        self.meta[i].prev = NIL;
        self.meta[i].next = self.head;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.meta[self.head as usize].prev = b;
        }
        self.head = b;
        self.flags[i] |= IN_FREE;
        self.num_free += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let i = b as usize;
        let (p, n) = (self.meta[i].prev, self.meta[i].next);
        if p == NIL {
            self.head = n;
        } else {
            self.meta[p as usize].next = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.meta[n as usize].prev = p;
        }
        self.flags[i] &= !IN_FREE;
        self.num_free -= 1;
    }
}

/// The free queue, head first: each block with the hash it holds.
pub struct FreeQueueIter<'a> {
    pool: &'a BlockPool,
    at: u32,
}

impl Iterator for FreeQueueIter<'_> {
    type Item = (BlockId, Option<u64>);
    fn next(&mut self) -> Option<Self::Item> {
        if self.at == NIL {
            return None;
        }
        let b = self.at;
        self.at = self.pool.meta[b as usize].next;
        Some((b, self.pool.block_hash(b)))
    }
}

#[cfg(test)]
mod tests {
    //! One test per rule of vLLM's block pool (as tests/unit/test_engine_pool.py).
    use std::collections::HashMap;

    use super::*;

    const BS: usize = 4;

    fn toks(n: usize) -> Vec<u32> {
        (0..n as u32).collect()
    }

    fn seq(t: &[u32]) -> TokenSeq<'_> {
        TokenSeq::new(t, &[])
    }

    fn removed(pool: &mut BlockPool) -> Vec<u64> {
        pool.take_events()
            .into_iter()
            .flat_map(|e| match e {
                KvCacheEvent::Removed(r) => r.block_hashes,
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[test]
    fn null_block_is_reserved() {
        let mut pool = BlockPool::new(5, BS, true, false);
        assert_eq!(pool.num_free_blocks(), 4);
        let taken = pool.get_new_blocks(4).unwrap();
        assert!(!taken.contains(&NULL_BLOCK));
        assert_eq!(
            pool.get_new_blocks(1),
            Err(OutOfBlocks { wanted: 1, free: 0 })
        );
    }

    #[test]
    fn new_blocks_come_from_the_head_of_the_free_queue() {
        let mut pool = BlockPool::new(6, BS, true, false);
        assert_eq!(pool.get_new_blocks(2).unwrap(), vec![1, 2]);
        let t = toks(8);
        pool.cache_full_blocks(&[1, 2], &[11, 12], 0, 2, seq(&t));
        pool.free_blocks([2, 1]);
        assert_eq!(pool.get_new_blocks(5).unwrap(), vec![3, 4, 5, 2, 1]);
    }

    #[test]
    fn freed_blocks_without_a_hash_are_reused_before_any_cached_block() {
        // A request of two full blocks and a partial third frees [3, 2, 1]: the partial block
        // goes to the head of the queue, the cached ones to its tail, so the next allocation
        // takes the partial block and then the never-used 4 and 5, evicting nothing.
        let mut pool = BlockPool::new(6, BS, true, true);
        let blocks = pool.get_new_blocks(3).unwrap();
        let t = toks(10);
        pool.cache_full_blocks(&blocks, &[11, 12], 0, 2, seq(&t));
        pool.take_events();
        pool.free_blocks(blocks.iter().rev().copied());
        assert_eq!(pool.get_new_blocks(3).unwrap(), vec![3, 4, 5]);
        assert!(!pool.has_events());
        assert_eq!(pool.get_new_blocks(1).unwrap(), vec![2]);
        assert_eq!(removed(&mut pool), vec![12]);
    }

    #[test]
    fn without_prefix_caching_freed_blocks_are_reused_last_in_first_out() {
        let mut pool = BlockPool::new(6, BS, false, false);
        assert_eq!(pool.get_new_blocks(2).unwrap(), vec![1, 2]);
        pool.free_blocks([2, 1]);
        assert_eq!(pool.get_new_blocks(2).unwrap(), vec![2, 1]);
    }

    #[test]
    fn finished_request_frees_tail_first_so_its_tail_is_evicted_first() {
        let mut pool = BlockPool::new(4, BS, true, true);
        let blocks = pool.get_new_blocks(3).unwrap();
        let t = toks(12);
        pool.cache_full_blocks(&blocks, &[11, 12, 13], 0, 3, seq(&t));
        pool.take_events();
        pool.free_blocks(blocks.iter().rev().copied());
        pool.get_new_blocks(1).unwrap();
        assert_eq!(removed(&mut pool), vec![13]);
        assert!(pool.get_cached_block(11).is_some() && pool.get_cached_block(13).is_none());
    }

    #[test]
    fn touch_on_hit_takes_blocks_out_of_the_free_queue_and_counts_refs() {
        let mut pool = BlockPool::new(4, BS, true, false);
        let blocks = pool.get_new_blocks(2).unwrap();
        pool.cache_full_blocks(&blocks, &[21, 22], 0, 2, seq(&[]));
        pool.free_blocks(blocks.iter().rev().copied());
        assert_eq!(pool.num_free_blocks(), 3);
        let hit = pool.find_longest_hit(&[21, 22, 99], 3);
        assert_eq!(hit, blocks);
        pool.touch(&hit);
        assert_eq!(pool.num_free_blocks(), 1);
        pool.touch(&hit);
        assert_eq!(
            hit.iter().map(|&b| pool.ref_cnt(b)).collect::<Vec<_>>(),
            vec![2, 2]
        );
        pool.free_blocks(hit.iter().rev().copied());
        assert_eq!(pool.num_free_blocks(), 1);
        pool.free_blocks(hit.iter().rev().copied());
        assert_eq!(pool.num_free_blocks(), 3);
    }

    #[test]
    fn touching_a_block_in_the_middle_of_the_free_queue_keeps_the_rest_in_order() {
        let mut pool = BlockPool::new(6, BS, true, false);
        let blocks = pool.get_new_blocks(5).unwrap();
        pool.cache_full_blocks(&blocks, &[1, 2, 3, 4, 5], 0, 5, seq(&[]));
        pool.free_blocks(blocks.iter().copied());
        pool.touch(&[3]);
        let queue: Vec<_> = pool.free_queue().map(|(b, _)| b).collect();
        assert_eq!(queue, vec![1, 2, 4, 5]);
        pool.free_blocks([3]);
        let queue: Vec<_> = pool.free_queue().collect();
        assert_eq!(
            queue,
            vec![
                (1, Some(1)),
                (2, Some(2)),
                (4, Some(4)),
                (5, Some(5)),
                (3, Some(3))
            ]
        );
    }

    #[test]
    fn cached_blocks_are_evicted_only_when_reused_not_when_freed() {
        let mut pool = BlockPool::new(3, BS, true, true);
        let blocks = pool.get_new_blocks(2).unwrap();
        let t = toks(8);
        pool.cache_full_blocks(&blocks, &[31, 32], 0, 2, seq(&t));
        pool.free_blocks(blocks.iter().rev().copied());
        assert!(matches!(pool.take_events()[..], [KvCacheEvent::Stored(_)]));
        assert_eq!(pool.find_longest_hit(&[31, 32], 2), blocks);
        pool.get_new_blocks(2).unwrap();
        assert_eq!(removed(&mut pool), vec![32, 31]);
        assert!(pool.find_longest_hit(&[31, 32], 2).is_empty());
    }

    #[test]
    fn identical_blocks_are_not_deduplicated() {
        let mut pool = BlockPool::new(4, BS, true, true);
        let a = pool.get_new_blocks(1).unwrap();
        let b = pool.get_new_blocks(1).unwrap();
        let t = toks(4);
        pool.cache_full_blocks(&a, &[41], 0, 1, seq(&t));
        pool.cache_full_blocks(&b, &[41], 0, 1, seq(&t));
        assert_eq!(pool.take_events().len(), 2);
        assert_eq!(pool.get_cached_block(41), Some(a[0]));
        assert_eq!(pool.holders(41), vec![a[0], b[0]]);
        pool.free_blocks([a[0], b[0]]);
        pool.get_new_blocks(3).unwrap();
        assert_eq!(removed(&mut pool), vec![41, 41]);
        assert_eq!(pool.get_cached_block(41), None);
    }

    #[test]
    fn a_younger_holder_takes_over_when_the_oldest_is_evicted() {
        let mut pool = BlockPool::new(4, BS, true, false);
        let a = pool.get_new_blocks(1).unwrap();
        let b = pool.get_new_blocks(1).unwrap();
        pool.cache_full_blocks(&a, &[7], 0, 1, seq(&[]));
        pool.cache_full_blocks(&b, &[7], 0, 1, seq(&[]));
        pool.free_blocks([a[0]]);
        pool.get_new_blocks(2).unwrap(); // block 3 (never used), then a
        assert_eq!(pool.get_cached_block(7), Some(b[0]));
    }

    #[test]
    fn block_stored_carries_tokens_and_parent() {
        let mut pool = BlockPool::new(5, BS, true, true);
        let blocks = pool.get_new_blocks(3).unwrap();
        let prompt: Vec<u32> = (100..106).collect();
        let output: Vec<u32> = (106..112).collect();
        let t = TokenSeq::new(&prompt, &output);
        pool.cache_full_blocks(&blocks, &[51, 52, 53], 0, 1, t);
        pool.cache_full_blocks(&blocks, &[51, 52, 53], 1, 3, t);
        let ev = pool.take_events();
        assert_eq!(
            ev[0],
            KvCacheEvent::Stored(BlockStored::plain(vec![51], None, (100..104).collect(), BS))
        );
        assert_eq!(
            ev[1],
            KvCacheEvent::Stored(BlockStored::plain(
                vec![52, 53],
                Some(51),
                (104..112).collect(),
                BS
            ))
        );
    }

    #[test]
    fn reset_clears_cache_only_when_nothing_is_in_use() {
        let mut pool = BlockPool::new(4, BS, true, true);
        let blocks = pool.get_new_blocks(1).unwrap();
        pool.cache_full_blocks(&blocks, &[61], 0, 1, seq(&toks(4)));
        pool.take_events();
        assert!(!pool.reset_prefix_cache());
        pool.free_blocks(blocks.iter().copied());
        assert!(pool.reset_prefix_cache());
        assert_eq!(pool.take_events(), vec![KvCacheEvent::AllCleared]);
        assert!(pool.find_longest_hit(&[61], 1).is_empty());
        pool.get_new_blocks(3).unwrap();
        assert!(pool.take_events().is_empty());
    }

    #[test]
    fn usage_counts_only_blocks_held_by_requests() {
        let mut pool = BlockPool::new(5, BS, true, false);
        let blocks = pool.get_new_blocks(2).unwrap();
        assert_eq!(pool.usage(), 0.5);
        pool.cache_full_blocks(&blocks, &[71, 72], 0, 2, seq(&[]));
        pool.free_blocks(blocks.iter().copied());
        assert_eq!(pool.usage(), 0.0);
    }

    #[test]
    fn without_caching_nothing_is_cached_or_found() {
        let mut pool = BlockPool::new(5, BS, false, true);
        let blocks = pool.get_new_blocks(2).unwrap();
        pool.cache_full_blocks(&blocks, &[81, 82], 0, 2, seq(&toks(8)));
        assert!(pool.take_events().is_empty());
        assert!(pool.find_longest_hit(&[81], 1).is_empty());
    }

    #[test]
    fn the_memoized_lookup_answers_as_the_table_does() {
        // Random admissions (hits touched, new blocks taken, some cached), frees and resets
        // over a few shared chains with repeats; after each, both lookups of every chain agree.
        let mut x = 0x1234_5678_9ABC_DEF0u64;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let chains: Vec<Vec<u64>> = (0..4u64)
            .map(|c| {
                (0..24)
                    .map(|i| {
                        if i > 0 && i % 7 == 0 {
                            1000 * c
                        } else {
                            1000 * c + i
                        }
                    })
                    .collect()
            })
            .collect();
        for num_blocks in [8usize, 20, 40] {
            let mut pool = BlockPool::new(num_blocks, BS, true, false);
            let mut running: Vec<Vec<BlockId>> = vec![];
            for _ in 0..3000 {
                match rnd(6) {
                    0..=2 => {
                        let chain = &chains[rnd(4) as usize];
                        let len = 1 + rnd(chain.len() as u64) as usize;
                        let hit = pool.find_longest_hit_memo(&chain[..len], len - 1);
                        let need = len - hit.len();
                        if need > pool.num_free_blocks() - pool.num_evictable(&hit) {
                            continue;
                        }
                        pool.touch(&hit);
                        let mut blocks = hit.clone();
                        blocks.extend(pool.get_new_blocks(need).unwrap());
                        let upto = hit.len() + rnd(need as u64 + 1) as usize;
                        pool.cache_full_blocks(&blocks, chain, hit.len(), upto, seq(&[]));
                        running.push(blocks);
                    }
                    3 | 4 if !running.is_empty() => {
                        let blocks = running.swap_remove(rnd(running.len() as u64) as usize);
                        pool.free_blocks(blocks.into_iter().rev());
                    }
                    _ => {
                        pool.reset_prefix_cache();
                    }
                }
                for chain in &chains {
                    for len in [1, 5, 12, 24] {
                        assert_eq!(
                            pool.find_longest_hit_memo(&chain[..len], len),
                            pool.find_longest_hit(&chain[..len], len)
                        );
                    }
                }
            }
        }
    }
    #[test]
    fn lookups_answer_the_oldest_holder_through_many_evictions() {
        // Many evictions of fresh and repeated hashes (every table slot reused many times
        // over, younger holders taking over): after each step every hash answers its oldest
        // holder, and only held hashes are listed as cached.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let num_blocks = 12;
        let mut pool = BlockPool::new(num_blocks, BS, true, false);
        let mut cached_at: HashMap<BlockId, u64> = HashMap::new();
        let mut running: Vec<Vec<BlockId>> = vec![];
        let mut seen: Vec<u64> = vec![];
        let mut clock = 0u64;
        for round in 0..20_000u64 {
            if running.len() == 3 || (rnd(3) == 0 && !running.is_empty()) {
                let blocks = running.remove(0);
                pool.free_blocks(blocks.into_iter().rev());
            }
            let need = 1 + rnd(3) as usize;
            if need > pool.num_free_blocks() {
                continue;
            }
            let blocks = pool.get_new_blocks(need).unwrap();
            // A few hashes recur (duplicates, re-cached after eviction), most are fresh.
            let hashes: Vec<u64> = (0..need)
                .map(|i| {
                    if rnd(4) == 0 {
                        rnd(6)
                    } else {
                        1000 + 4 * round + i as u64
                    }
                })
                .collect();
            pool.cache_full_blocks(&blocks, &hashes, 0, need, seq(&[]));
            for &b in &blocks {
                clock += 1;
                cached_at.insert(b, clock);
            }
            seen.extend(&hashes);
            running.push(blocks);
            let held: Vec<(BlockId, u64)> = (1..num_blocks as BlockId)
                .filter_map(|b| pool.block_hash(b).map(|h| (b, h)))
                .collect();
            for &h in seen.iter().rev().take(64).chain(&[0, 1, 2, 3, 4, 5]) {
                let mut holders: Vec<BlockId> = held
                    .iter()
                    .filter(|&&(_, k)| k == h)
                    .map(|&(b, _)| b)
                    .collect();
                holders.sort_by_key(|b| cached_at[b]);
                assert_eq!(
                    pool.get_cached_block(h),
                    holders.first().copied(),
                    "hash {h}"
                );
                assert_eq!(pool.holders(h).len(), holders.len());
            }
            let mut listed: Vec<u64> = pool.cached_hashes().collect();
            let mut expected: Vec<u64> = held.iter().map(|&(_, h)| h).collect();
            listed.sort_unstable();
            expected.sort_unstable();
            expected.dedup();
            assert_eq!(listed, expected);
        }
    }
    #[test]
    fn the_free_queue_keeps_its_order_through_hits_and_frees_anywhere() {
        // Hits taken from anywhere in a long queue, freed blocks rejoining at either end
        // (with or without a hash), misses taken from the head: the queue always reads as a
        // plain list would.
        let n = 400;
        let mut pool = BlockPool::new(n + 1, BS, true, false);
        let blocks = pool.get_new_blocks(n).unwrap();
        let hashes: Vec<u64> = (0..n as u64).map(|h| h + 7).collect();
        pool.cache_full_blocks(&blocks, &hashes, 0, n, seq(&[]));
        pool.free_blocks(blocks.iter().rev().copied());
        let mut model: Vec<BlockId> = blocks.iter().rev().copied().collect();
        let mut x = 12345u64;
        let mut held: Vec<BlockId> = vec![];
        for round in 0..3000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if !model.is_empty() && (x >> 33) % 3 != 0 {
                // A hit on a free block anywhere in the queue.
                let b = model.remove((x >> 40) as usize % model.len());
                pool.touch(&[b]);
                held.push(b);
            } else if !held.is_empty() {
                let b = held.swap_remove((x >> 40) as usize % held.len());
                pool.free_blocks([b]);
                if pool.block_hash(b).is_some() {
                    model.push(b);
                } else {
                    model.insert(0, b);
                }
            }
            if round % 97 == 0 && !model.is_empty() {
                let k = 1 + (x >> 50) as usize % model.len().min(5);
                let taken = pool.get_new_blocks(k).unwrap();
                assert_eq!(taken, model.drain(..k).collect::<Vec<_>>());
                // Taken and freed again, hashes gone: back at the head, in order.
                pool.free_blocks(taken.iter().copied());
                model.splice(0..0, taken);
            }
            let queue: Vec<BlockId> = pool.free_queue().map(|(b, _)| b).collect();
            assert_eq!(queue, model);
            assert_eq!(pool.num_free_blocks(), model.len());
        }
    }
}
