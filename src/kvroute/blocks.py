"""Chained per-block hashing of token ids (native: ``kvroute-core``'s ``blocks`` module).

Every part of kvroute that needs to say "these tokens are the same cached block" uses this
module: the engine model (as its block identity), the router's index (over the token ids that
vLLM's KV events carry) and the router's prompt matcher. vLLM's own hashes depend on its
``--prefix-caching-hash-algo`` and a seed, so kvroute never tries to reproduce them; it hashes
token ids itself, the same way everywhere.

A block's hash chains its parent's: ``h[i] = xxh3_64(tokens[i] as little-endian uint32,
seed=h[i-1])`` with ``h[-1] = root seed``. Only full blocks are hashed (vLLM caches only full
blocks). :class:`BlockHasher` is the native implementation; it hashes the same bytes the
earlier Python one did, so recorded hashes stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvroute._native import DEFAULT_HASH_SEED, GPU_BLOCK_SIZE, BlockHasher

__all__ = ["DEFAULT_HASH_SEED", "GPU_BLOCK_SIZE", "BlockHasher", "as_token_array"]

_TOKEN_DTYPE = np.dtype("<u4")


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Return token ids as a contiguous little-endian uint32 array (no copy when possible)."""
    return np.ascontiguousarray(token_ids, dtype=_TOKEN_DTYPE)
