"""BlockPool: the KV block allocator and prefix cache of one vLLM v1 worker (native:
``kvroute-sim``'s ``engine::pool``, which documents vLLM's rules it follows: null block 0,
LRU free queue with tail-first freeing and uncached blocks reused first, touch on hit, eviction on reuse, no dedup).

``BlockPool`` here is a standalone pool (tests, benchmarks); an ``Engine`` owns its own and
shows it read-only as ``engine.pool``.
"""

from __future__ import annotations

from kvroute._native import NULL_BLOCK, BlockPool, usable_blocks

__all__ = ["NULL_BLOCK", "BlockPool", "usable_blocks"]
