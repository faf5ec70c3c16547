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

__all__ = ["DEFAULT_HASH_SEED", "GPU_BLOCK_SIZE", "BlockHasher", "PrefixHashCache", "as_token_array"]

_TOKEN_DTYPE = np.dtype("<u4")


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Return token ids as a contiguous little-endian uint32 array (no copy when possible)."""
    return np.ascontiguousarray(token_ids, dtype=_TOKEN_DTYPE)


class PrefixHashCache:
    """Memoizes the block hashes of shared prefixes, so a workload with a few long shared
    prefixes and many short unique suffixes hashes each prefix once.

    The first ``len(prefix) // block_size`` blocks of a prompt depend only on the prefix; the
    blocks after that (including the block that straddles the prefix/suffix boundary) are hashed
    per prompt.
    """

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        self._by_key: dict[object, list[int]] = {}

    def prompt_hashes(
        self, key: object, prefix_len: int, token_ids: Sequence[int] | np.ndarray
    ) -> list[int]:
        """Block hashes of ``token_ids`` whose first ``prefix_len`` tokens are the prefix
        identified by ``key``."""
        shared = self._by_key.get(key)
        if shared is None:
            shared = self.hasher.hash_blocks(token_ids, stop_block=prefix_len // self.hasher.block_size)
            self._by_key[key] = shared
        return self.hasher.extend(list(shared), token_ids)
