"""The router's index: which worker holds which KV block, keyed by kvroute's own block hashes.

Two sources feed it:

* **Events** (authoritative). Each worker's KV cache events (``kvroute.engine.events``, decoded
  from vLLM's ZMQ stream by ``kvroute.kvevents`` or emitted by the engine model) say exactly
  which blocks it stored and evicted. The index never trusts the engine's block hashes as keys:
  they depend on ``--prefix-caching-hash-algo`` and a seed the router cannot know. It hashes
  the events' ``token_ids`` itself with :class:`kvroute.blocks.BlockHasher` (the same function
  the router applies to prompts) and keeps, per worker, a map engine hash → own hash so that a
  ``BlockRemoved``, which carries engine hashes only, can be applied.
* **Predictions** (a bridge). When the router sends a prompt to a worker it records the
  prompt's blocks there at once (:meth:`KvIndex.record_routed`): the worker will hold them a
  few milliseconds later, but its ``BlockStored`` arrives only after the prefill step. Without
  the bridge a burst of requests for a new prefix would be spread over every worker before the
  first event lands. A predicted entry lives ``predicted_ttl`` seconds (events replace it
  sooner) and each worker keeps at most ``predicted_capacity_blocks`` of them, least recently
  routed evicted first (for engines without events: set it to the worker's KV blocks and the
  TTL to None, and the index models the worker's LRU cache).

Rules, and why:

* **Counts per (worker, block).** vLLM does not deduplicate: two requests computing the same
  block at once both store it, and each copy is removed with its own event. A block leaves a
  worker only when its count returns to zero.
* **Orphans are skipped.** A ``BlockStored`` whose ``parent_block_hash`` this worker never
  stored (the index joined the stream late, a replay gap was lost, or the parent was itself
  skipped) cannot be given own hashes: a block's own hash chains every token before it, and the
  event carries only its own blocks' tokens. Those blocks are counted in
  ``IndexStats.orphan_blocks`` and left out, so they cost a missed opportunity, never a false
  hit. Their later removals are unknown engine hashes and are ignored
  (``IndexStats.unknown_removals``).
* **Blocks a token-only hash cannot name are skipped** (``IndexStats.skipped_blocks``): blocks of
  another block size (a CPU offload tier), of a LoRA adapter, or with extra keys (multimodal
  inputs, cache salt): a plain prompt hashed by the router never matches them in the engine.
  Malformed ones (fewer tokens than blocks, ids that are not uint32) are skipped the same way.
* ``AllBlocksCleared`` (and :meth:`reset_worker`, for restarts and failed replays) forgets
  everything known about that worker, predicted entries included.

* **A memory bound** (``max_blocks`` or ``max_bytes`` for the whole index): beyond it the
  least recently touched event-backed (worker, block) entries are dropped, counted in
  ``IndexStats.evicted_blocks`` (the router exports it). Stored and routed-to blocks count as
  touched, the accesses that keep a block in vLLM's own LRU.

Lookup speed: every block maps to one 64-bit mask per 64 workers. :meth:`overlaps` ANDs the
masks along the prompt's chain and stops as soon as no worker is left
(``benchmarks/index_speed.py``).

The implementation is native (``kvroute_core::index``, exposed as ``kvroute._native.KvIndex``);
this module names it where it always was.

``now`` arguments are seconds on one monotonic clock (``time.monotonic()`` in the router,
virtual time in the simulator) and must not go backwards.
"""

from __future__ import annotations

from kvroute._native import INDEX_ENTRY_BYTES, IndexStats, KvIndex

__all__ = ["INDEX_ENTRY_BYTES", "IndexStats", "KvIndex"]
