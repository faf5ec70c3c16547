"""Chained per-block hashing of token ids.

Every part of kvroute that needs to say "these tokens are the same cached block" uses this
module: the engine model (as its block identity), the router's index (over the token ids that
vLLM's KV events carry) and the router's prompt matcher. vLLM's own hashes depend on its
``--prefix-caching-hash-algo`` and a seed, so kvroute never tries to reproduce them; it hashes
token ids itself, the same way everywhere.

A block's hash chains its parent's: ``h[i] = xxh3_64(tokens[i] as little-endian uint32,
seed=h[i-1])`` with ``h[-1] = root seed``. Only full blocks are hashed (vLLM caches only full
blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

#: Root of every chain ("kvroute" in ASCII); any fixed value works, it only has to be shared.
DEFAULT_HASH_SEED = 0x6B76726F757465

#: vLLM's KV block size on GPU and on CPU.
GPU_BLOCK_SIZE = 16
CPU_BLOCK_SIZE = 128

_TOKEN_DTYPE = np.dtype("<u4")
_xxh3 = xxhash.xxh3_64_intdigest


def as_token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Return token ids as a contiguous little-endian uint32 array (no copy when possible)."""
    return np.ascontiguousarray(token_ids, dtype=_TOKEN_DTYPE)


class BlockHasher:
    """Hashes token sequences into chained per-block hashes.

    Args:
        block_size: tokens per KV block (vLLM: 16 on GPU, 128 on CPU).
        seed: root of the chain; two hashers agree only if block size and seed agree.
    """

    def __init__(self, block_size: int, seed: int = DEFAULT_HASH_SEED) -> None:
        if block_size <= 0:
            raise ValueError(f"block size must be positive, got {block_size}")
        self.block_size = block_size
        self.seed = seed & 0xFFFFFFFFFFFFFFFF

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size

    def hash_blocks(
        self,
        token_ids: Sequence[int] | np.ndarray,
        parent_hash: int | None = None,
        start_block: int = 0,
        stop_block: int | None = None,
    ) -> list[int]:
        """Hash the full blocks of ``token_ids``.

        Args:
            token_ids: the whole token sequence (from the start of the prompt).
            parent_hash: hash of block ``start_block - 1`` (None at the start of a chain).
            start_block: first block to hash; lets callers extend a chain they already have.
            stop_block: one past the last block to hash (default: every full block).

        Returns:
            One hash per full block in ``[start_block, stop_block)``.
        """
        tokens = as_token_array(token_ids)
        bs = self.block_size
        full = len(tokens) // bs
        stop = full if stop_block is None else min(stop_block, full)
        if stop <= start_block:
            return []
        # Only the bytes of the blocks asked for (a caller extending a long chain by one
        # block should not pay for viewing the whole sequence).
        buf = memoryview(tokens[start_block * bs : stop * bs]).cast("B")
        step = bs * 4
        h = self.seed if parent_hash is None else parent_hash
        out = []
        append = out.append
        for offset in range(0, len(buf), step):
            h = _xxh3(buf[offset : offset + step], h)
            append(h)
        return out

    def extend(self, hashes: list[int], token_ids: Sequence[int] | np.ndarray) -> list[int]:
        """Append to ``hashes`` the hashes of the full blocks of ``token_ids`` it lacks."""
        n = len(hashes)
        hashes.extend(
            self.hash_blocks(token_ids, parent_hash=hashes[-1] if n else None, start_block=n)
        )
        return hashes


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
