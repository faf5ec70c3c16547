"""KV cache events as plain data.

These mirror vLLM's ``vllm.distributed.kv_events`` (BlockStored, BlockRemoved, AllBlocksCleared)
field for field, so the emulator's publisher can put them on the wire unchanged and the router's
index can consume the same objects decoded from a real vLLM. The engine model emits them; it
never serializes or sends anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockStored:
    """Full blocks newly cached, in chain order.

    ``token_ids`` holds every token of those blocks (``len(block_hashes) * block_size``),
    generated tokens included. ``parent_block_hash`` is the hash of the block before the first
    one, or None when the first block starts the prompt.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    extra_keys: list | None = None
    group_idx: int = 0
    kv_cache_spec_kind: str | None = "full_attention"


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks evicted because their memory was reused (not when a request finishes)."""

    block_hashes: list[int]
    medium: str | None = "GPU"
    group_idx: int = 0


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """Events produced by one engine step, stamped with the step's time (seconds)."""

    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None
