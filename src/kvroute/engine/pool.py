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

Blocks are plain integers with parallel arrays for ref counts and hashes; the free queue is an
``OrderedDict`` so a touch can remove a block from the middle in O(1).
"""

from __future__ import annotations

from collections import OrderedDict

from kvroute.engine.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

NULL_BLOCK = 0


class BlockPool:
    """Args:
        num_blocks: total KV blocks, the null block included.
        block_size: tokens per block.
        enable_caching: when False, nothing is cached or looked up (``--no-enable-prefix-caching``).
        emit_events: collect KV events for a publisher; off in the simulator for speed.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        emit_events: bool = False,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.emit_events = emit_events
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        # hash -> blocks holding it, oldest first; a lookup returns the first.
        self.cached: dict[int, list[int]] = {}
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
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's ``kv_cache_usage_perc``): cached
        but free blocks do not count, so an idle worker reads 0 even with a full cache."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: int) -> int | None:
        blocks = self.cached.get(block_hash)
        return blocks[0] if blocks else None

    def find_longest_hit(self, block_hashes: list[int], max_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix of ``block_hashes`` (at most ``max_blocks``)."""
        hit: list[int] = []
        if not self.enable_caching:
            return hit
        cached = self.cached
        for h in block_hashes[:max_blocks]:
            blocks = cached.get(h)
            if not blocks:
                break
            hit.append(blocks[0])
        return hit

    def num_evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a touch would take them out of it)."""
        ref = self.ref_cnt
        return sum(1 for b in blocks if ref[b] == 0)

    # -- mutations -------------------------------------------------------------------------

    def touch(self, blocks: list[int]) -> None:
        """Take hit blocks into use: ref count +1, out of the free queue if they were free."""
        ref = self.ref_cnt
        free = self.free_queue
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached hashes."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot get {n} free blocks, only {len(self.free_queue)} free")
        out = []
        popitem = self.free_queue.popitem
        ref = self.ref_cnt
        block_hash = self.block_hash
        cached = self.cached
        for _ in range(n):
            b = popitem(last=False)[0]
            h = block_hash[b]
            if h is not None:  # evict: the block's memory is reused now
                block_hash[b] = None
                holders = cached[h]
                if len(holders) == 1:
                    del cached[h]
                else:
                    holders.remove(b)
                if self.emit_events:
                    self.pending_events.append(BlockRemoved(block_hashes=[h]))
            ref[b] = 1
            out.append(b)
        return out

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
        for i in range(num_cached, num_full):
            b = blocks[i]
            h = block_hashes[i]
            self.block_hash[b] = h
            lst = self.cached.get(h)
            if lst is None:
                self.cached[h] = [b]
            else:
                lst.append(b)
        if self.emit_events:
            bs = self.block_size
            self.pending_events.append(
                BlockStored(
                    block_hashes=list(block_hashes[num_cached:num_full]),
                    parent_block_hash=block_hashes[num_cached - 1] if num_cached else None,
                    token_ids=[int(t) for t in token_ids[num_cached * bs : num_full * bs]],
                    block_size=bs,
                )
            )

    def free_blocks(self, ordered_blocks: list[int]) -> None:
        """Drop one reference from each block; those reaching 0 join the free queue's tail in
        the given order (callers pass a request's blocks reversed: tail evicted first)."""
        ref = self.ref_cnt
        free = self.free_queue
        self.version += 1
        for b in ordered_blocks:
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, as ``/reset_prefix_cache`` does.

        Like vLLM, refuses (returns False) while any request holds blocks.
        """
        if len(self.free_queue) != self.num_blocks - 1:
            return False
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.version += 1
        if self.emit_events:
            self.pending_events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self.pending_events = self.pending_events, []
        return events
