"""BlockPool: the KV block allocator and prefix cache of one vLLM v1 worker.

Follows ``vllm/v1/core/block_pool.py`` and ``FreeKVCacheBlockQueue``:

* Block 0 is the null block: taken at start-up and never handed out, so usable capacity is
  ``num_blocks - 1``.
* Free blocks (ref count 0) sit in an LRU queue. Blocks freed together are appended in the
  order given; a finished request frees its blocks in reverse, so its tail is evicted first
  and the shared head of a prompt survives longest.
* New blocks come from the head of the free queue. A block that still holds a cached hash is
  evicted only then, when its memory is reused (BlockRemoved), never when its request ends.
* A prefix-cache hit "touches" blocks: ref count +1, and a block at ref count 0 leaves the
  free queue (it can no longer be evicted while in use).
* Identical content is not deduplicated: two blocks can carry the same hash (one per request
  that computed it), and each is stored and later removed with its own event.

Blocks are plain integers. A simulation moves whole requests' worth of blocks at a time (a
miss takes ~150 blocks at once, evicting as many hashes, and frees them together when it
finishes), so the state is kept in plain dicts that C-level bulk operations (``update``,
``map``, ``islice``) can change a run of blocks at once: ref counts, the cached hash's first
holder, and the free queue itself (a dict keeps insertion order, so its keys are the LRU queue,
and deleting a touched block from the middle is O(1)). The free queue's values are the hashes
its blocks hold, so taking blocks reads what they evict in the same sweep. A block in use keeps
its hash in ``block_hash`` until it is freed, unless the caller says it will pass the hashes
back itself (``track_block_hashes=False``: the engine knows which of a request's blocks hold
which hash, and skipping that table saves two dict operations per block, a large share of a
many-worker simulation whose tables no longer fit the CPU cache). Per-block Python loops remain
only for the rare cases: identical blocks cached twice, and frees or touches of shared blocks.
"""

from __future__ import annotations

from collections import deque
from itertools import islice, repeat

from kvroute.engine.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

NULL_BLOCK = 0

#: Block ids as shared int objects. Ids above 256 are separate objects per ``range``; a
#: simulation of many workers would give each pool its own copies, and every dict operation
#: on a block reads its id object (to hash it) and updates its reference count. Sharing one
#: set keeps those objects few and hot in the CPU cache, which measurably speeds up the
#: per-block work of a many-worker simulation.
_BLOCK_IDS: list[int] = []


def _block_ids(num_blocks: int) -> list[int]:
    if len(_BLOCK_IDS) < num_blocks:
        _BLOCK_IDS.extend(range(len(_BLOCK_IDS), num_blocks))
    return _BLOCK_IDS[:num_blocks]


#: Up to this many blocks, taking or caching them runs a plain loop (decode steps); above
#: it, C-level bulk operations (a prefill's blocks).
_FEW = 8


def _consume(iterator) -> None:
    """Run an iterator of side effects (``map(d.pop, keys)``) to its end at C speed."""
    deque(iterator, maxlen=0)


class BlockPool:
    """Args:
        num_blocks: total KV blocks, the null block included.
        block_size: tokens per block.
        enable_caching: when False, nothing is cached or looked up (``--no-enable-prefix-caching``).
        emit_events: collect KV events for a publisher; off in the simulator for speed.
        track_block_hashes: keep the hash of every cached block in use, so that
            ``free_blocks`` needs only the blocks. False when the caller passes each freed
            block's hash to ``free_blocks`` itself (faster; the engine does).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        emit_events: bool = False,
        track_block_hashes: bool = True,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.emit_events = emit_events
        #: Ref counts, kept implicitly: a block in the free queue (or the null block) has 0,
        #: any other 1 plus its entry here. Only shared blocks (prefix hits) get an entry, so
        #: taking and freeing a request's own blocks never touches a count.
        self._extra_refs: dict[int, int] = {}
        self.track_block_hashes = track_block_hashes
        #: block -> the hash it holds, for cached blocks in use (free ones keep theirs in the
        #: free queue); empty unless ``track_block_hashes``.
        self.block_hash: dict[int, int] = {}
        #: The LRU free queue: keys in eviction order, each with the hash the block holds
        #: (None when it holds none).
        self.free_queue: dict[int, int | None] = dict.fromkeys(
            islice(_block_ids(num_blocks), 1, None)
        )
        #: hash -> the oldest block holding it (what a lookup returns).
        self.cached: dict[int, int] = {}
        #: hash -> younger blocks holding the same hash, oldest first. vLLM does not
        #: deduplicate, so a hash can be held twice (e.g. by two requests that computed it in
        #: the same step); rare, so kept apart from the hot path.
        self._more_holders: dict[int, list[int]] = {}
        self.pending_events: list[KVCacheEvent] = []
        #: Bumped whenever a change could let a waiting request in: a block returns to the
        #: free queue, blocks become cached, or the cache is reset. (Taking blocks or
        #: evicting them only ever makes admission harder.)
        self.version = 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def ref_cnt(self) -> _RefCounts:
        """Ref count by block (``pool.ref_cnt[b]``), as vLLM's ``KVCacheBlock.ref_cnt``."""
        return _RefCounts(self)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's ``kv_cache_usage_perc``): cached
        but free blocks do not count, so an idle worker reads 0 even with a full cache."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def find_longest_hit(self, block_hashes: list[int], max_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix of ``block_hashes`` (at most ``max_blocks``)."""
        if not self.enable_caching or max_blocks <= 0 or not block_hashes:
            return []
        get = self.cached.get
        if get(block_hashes[0]) is None:
            return []  # the common miss: no need to look further
        hit = list(map(get, block_hashes[:max_blocks]))
        try:
            return hit[: hit.index(None)]
        except ValueError:
            return hit

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a touch would take them out of it)."""
        return sum(map(self.free_queue.__contains__, blocks))

    # -- mutations -------------------------------------------------------------------------

    def touch(self, blocks: list[int]) -> None:
        """Take hit blocks into use: ref count +1, out of the free queue if they were free."""
        free = self.free_queue
        extra = self._extra_refs
        block_hash = self.block_hash if self.track_block_hashes else None
        for b in blocks:
            if b in free:
                h = free.pop(b)
                if block_hash is not None:
                    block_hash[b] = h
            else:
                extra[b] = extra.get(b, 0) + 1

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached hashes."""
        free = self.free_queue
        if n > len(free):
            raise ValueError(f"cannot get {n} free blocks, only {len(free)} free")
        if n <= 0:
            return []
        out = list(islice(free, n))
        if n <= _FEW:
            # A decode step's new blocks: a plain loop beats the bulk machinery's set-up.
            cached = self.cached
            for b in out:
                h = free.pop(b)
                if h is not None:
                    if self._more_holders:
                        self._forget_holder(b, h)
                    else:
                        del cached[h]
                    if self.emit_events:
                        self.pending_events.append(BlockRemoved(block_hashes=[h]))
            return out
        if 3 * n >= 2 * len(free):
            # Most of the queue goes: rebuilding it from the blocks that stay is cheaper
            # than deleting the taken ones (a miss on a full cache takes nearly all of it).
            held = list(islice(free.values(), n))
            self.free_queue = dict(islice(free.items(), n, None))
        else:
            held = list(map(free.pop, out))
        # Evict: the blocks' memory is reused now.
        if held.count(None) == n:
            return out
        if self._more_holders:
            for b, h in zip(out, held):
                if h is not None:
                    self._forget_holder(b, h)
        else:
            # Every cached hash has exactly one holder, so each evicted hash simply leaves the
            # lookup table (uncached blocks hold None, which is never a key).
            _consume(map(self.cached.pop, held, repeat(None)))
        if self.emit_events:
            self.pending_events.extend(BlockRemoved(block_hashes=[h]) for h in held if h is not None)
        return out

    def _forget_holder(self, block: int, block_hash: int) -> None:
        more = self._more_holders.get(block_hash)
        if more is None:
            del self.cached[block_hash]
            return
        if self.cached[block_hash] == block:
            self.cached[block_hash] = more.pop(0)
        else:
            more.remove(block)
        if not more:
            del self._more_holders[block_hash]

    def cache_full_blocks(
        self,
        blocks: list[int],
        block_hashes: list[int],
        num_cached: int,
        num_full: int,
        token_ids,
    ) -> None:
        """Register blocks ``[num_cached, num_full)`` of a request as cached.

        Args:
            blocks: the request's blocks, in order.
            block_hashes: the request's block hashes (at least ``num_full``).
            num_cached: blocks of this request already cached (hits or earlier steps).
            num_full: full blocks the request has now.
            token_ids: the request's tokens (prompt then output), for the BlockStored event.
        """
        if not self.enable_caching or num_cached >= num_full:
            return
        self.version += 1
        if num_full - num_cached <= _FEW and not self.emit_events:
            # Decode steps filled a few blocks: the common case, in a plain loop. (A new block
            # holds no hash yet, so ``setdefault`` answers a block other than ``b`` exactly
            # when the hash is already held.)
            cached = self.cached
            block_hash = self.block_hash if self.track_block_hashes else None
            for i in range(num_cached, num_full):
                b = blocks[i]
                h = block_hashes[i]
                if block_hash is not None:
                    block_hash[b] = h
                if cached.setdefault(h, b) is not b:
                    self._more_holders.setdefault(h, []).append(b)
            return
        new_blocks = blocks[num_cached:num_full]
        new_hashes = block_hashes[num_cached:num_full]
        if self.track_block_hashes:
            self.block_hash.update(zip(new_blocks, new_hashes))
        # One pass: each hash not cached yet gets its block; ``setdefault`` answers the
        # holder already there otherwise. A new block holds no hash before this call, so a
        # lookup table value can equal it only where it was just inserted: any difference
        # from ``new_blocks`` marks a hash that is now held twice (already cached, or repeated
        # within the run), whose block joins the younger holders in order.
        holders = list(map(self.cached.setdefault, new_hashes, new_blocks))
        if holders != new_blocks:
            more = self._more_holders
            for b, h, first in zip(new_blocks, new_hashes, holders):
                if first != b:
                    more.setdefault(h, []).append(b)
        if self.emit_events:
            bs = self.block_size
            self.pending_events.append(
                BlockStored(
                    block_hashes=list(new_hashes),
                    parent_block_hash=block_hashes[num_cached - 1] if num_cached else None,
                    token_ids=[int(t) for t in token_ids[num_cached * bs : num_full * bs]],
                    block_size=bs,
                )
            )

    def free_blocks(
        self, ordered_blocks: list[int], held_hashes: list[int | None] | None = None
    ) -> None:
        """Drop one reference from each block; those reaching 0 join the free queue's tail in
        the given order (callers pass a request's blocks reversed: tail evicted first).

        Args:
            held_hashes: with ``track_block_hashes=False``, the hash each block holds (None
                for an uncached block), aligned with ``ordered_blocks``; ignored otherwise.
        """
        self.version += 1
        if self.track_block_hashes:
            held_hashes = map(self.block_hash.pop, ordered_blocks, repeat(None))
        elif held_hashes is None:
            raise ValueError("this pool does not track block hashes: pass held_hashes")
        extra = self._extra_refs
        if not extra or extra.keys().isdisjoint(ordered_blocks):
            # The usual case: nobody else holds them, so all of them are free now.
            self.free_queue.update(zip(ordered_blocks, held_hashes))
            return
        free = self.free_queue
        for b, h in zip(ordered_blocks, held_hashes):
            n = extra.get(b)
            if n is None:
                free[b] = h
            else:
                if self.track_block_hashes and h is not None:
                    self.block_hash[b] = h  # still in use by another request
                if n == 1:
                    del extra[b]
                else:
                    extra[b] = n - 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, as ``/reset_prefix_cache`` does.

        Like vLLM, refuses (returns False) while any request holds blocks.
        """
        if len(self.free_queue) != self.num_blocks - 1:
            return False
        self.cached.clear()
        self._more_holders.clear()
        self.block_hash.clear()
        self.free_queue = dict.fromkeys(self.free_queue)
        self.version += 1
        if self.emit_events:
            self.pending_events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self.pending_events = self.pending_events, []
        return events


class _RefCounts:
    """Read-only ``block -> ref count`` view of a BlockPool's implicit counts."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __getitem__(self, block: int) -> int:
        pool = self._pool
        if block == NULL_BLOCK or block in pool.free_queue:
            return 0
        return 1 + pool._extra_refs.get(block, 0)
