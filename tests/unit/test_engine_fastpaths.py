"""The native BlockPool equals the straightforward one (property tests).

``ReferencePool`` below is the plain per-block pool (an ``OrderedDict`` free queue and explicit
counts, as vLLM's ``block_pool.py`` reads); random operation sequences must give the native
``BlockPool`` the same blocks, lookups, counts, holders and events. An engine driven through
random requests must keep every free block carrying exactly the hash the lookup table says.
"""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.blocks import BlockHasher
from kvroute.engine import (
    BlockPool,
    BlockRemoved,
    BlockStored,
    CostModel,
    Engine,
    EngineRequest,
)


class ReferencePool:
    """The straightforward BlockPool: one Python step per block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self.cached: dict[int, list[int]] = {}
        self.events: list = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def find_longest_hit(self, block_hashes: list[int], max_blocks: int) -> list[int]:
        hit = []
        for h in block_hashes[:max_blocks]:
            if not self.cached.get(h):
                break
            hit.append(self.cached[h][0])
        return hit

    def num_evictable(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if self.ref_cnt[b] == 0)

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def get_new_blocks(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            b = self.free_queue.popitem(last=False)[0]
            h = self.block_hash[b]
            if h is not None:
                self.block_hash[b] = None
                self.cached[h].remove(b)
                if not self.cached[h]:
                    del self.cached[h]
                self.events.append(("removed", h))
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def cache_full_blocks(self, blocks, block_hashes, num_cached, num_full) -> None:
        for i in range(num_cached, num_full):
            self.block_hash[blocks[i]] = block_hashes[i]
            self.cached.setdefault(block_hashes[i], []).append(blocks[i])
        if num_full > num_cached:
            self.events.append(("stored", tuple(block_hashes[num_cached:num_full])))

    def free_blocks(self, ordered_blocks: list[int]) -> None:
        """vLLM 0.32's ``free_blocks``: cached blocks to the queue's tail, blocks holding no
        hash to its head (reused first), each group in the order given."""
        uncached = []
        for b in ordered_blocks:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is None:
                    uncached.append(b)
                else:
                    self.free_queue[b] = None
        for b in reversed(uncached):
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)

    def reset_prefix_cache(self) -> bool:
        if len(self.free_queue) != len(self.ref_cnt) - 1:
            return False
        self.cached.clear()
        self.block_hash = [None] * len(self.ref_cnt)
        return True


def _events(pool: BlockPool) -> list:
    out = []
    for e in pool.take_events():
        if isinstance(e, BlockRemoved):
            out += [("removed", h) for h in e.block_hashes]
        elif isinstance(e, BlockStored):
            out.append(("stored", tuple(e.block_hashes)))
    return out


# A request's hash chain: drawn from a few shared chains so that hits, shared blocks, and
# identical blocks cached twice all happen; a small hash alphabet adds repeats within a chain.
# Chains long enough that both the few-block loops and the bulk paths (above 8 blocks) run.
_CHAINS = [[1000 * c + i for i in range(20)] for c in range(3)]
_TOKENS = list(range(20 * 4))  # BlockStored needs tokens; their values do not matter here

pool_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "extend", "finish", "finish", "reset"]),
        st.integers(0, 2),  # chain
        st.integers(1, 20),  # prompt blocks
        st.integers(0, 1000),  # which request / a free choice
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(2, 60),
    ops=pool_ops,
    repeat_hash=st.booleans(),
    emit_events=st.booleans(),
)
def test_block_pool_matches_the_straightforward_pool(num_blocks, ops, repeat_hash, emit_events):
    _run_pool_ops(num_blocks, ops, repeat_hash, emit_events)


@pytest.mark.parametrize("seed", range(4))
def test_block_pool_matches_the_straightforward_pool_on_long_runs(seed):
    """Long seeded runs reach what short examples rarely do: long free queues whose cached
    blocks are touched out of the middle, and hashes cached twice within one run."""
    rng = random.Random(seed)
    kinds = ["admit", "admit", "admit", "extend", "finish", "finish", "reset"]
    ops = [
        (rng.choice(kinds), rng.randrange(3), rng.randint(1, 20), rng.randrange(1000))
        for _ in range(1500)
    ]
    _run_pool_ops(rng.randint(20, 60), ops, rng.random() < 0.5, emit_events=seed % 2 == 0)


def _run_pool_ops(num_blocks, ops, repeat_hash, emit_events):
    """Apply ``ops`` to a BlockPool and a ReferencePool; after each, compare all their state."""
    fast = BlockPool(num_blocks, 4, emit_events=emit_events)
    ref = ReferencePool(num_blocks, 4)
    running: list[tuple[list[int], list[int], int]] = []  # blocks, hashes, cached blocks
    for op, chain, length, pick in ops:
        if op == "admit":
            hashes = list(_CHAINS[chain][:length])
            if repeat_hash and length > 2:
                hashes[-1] = hashes[0]  # a hash repeated within one chain
            hit = fast.find_longest_hit(hashes, length - 1)
            assert hit == ref.find_longest_hit(hashes, length - 1)
            assert fast.num_evictable(hit) == ref.num_evictable(hit)
            need = length - len(hit)
            if need > fast.num_free_blocks - fast.num_evictable(hit):
                continue
            fast.touch(hit)
            ref.touch(hit)
            new = fast.get_new_blocks(need)
            assert new == ref.get_new_blocks(need)
            blocks = hit + new
            cached = len(hit) + (pick % (need + 1))  # cache some or all of the new blocks
            fast.cache_full_blocks(blocks, hashes, len(hit), cached, _TOKENS)
            ref.cache_full_blocks(blocks, hashes, len(hit), cached)
            running.append((blocks, hashes, cached))
        elif op == "extend" and running:
            blocks, hashes, cached = running[pick % len(running)]
            if cached < len(blocks):
                fast.cache_full_blocks(blocks, hashes, cached, cached + 1, _TOKENS)
                ref.cache_full_blocks(blocks, hashes, cached, cached + 1)
                running[pick % len(running)] = (blocks, hashes, cached + 1)
        elif op == "reset":
            assert fast.reset_prefix_cache() == ref.reset_prefix_cache()
            fast.take_events()  # AllBlocksCleared, which the reference does not model
        elif op == "finish" and running:
            blocks, hashes, cached = running.pop(pick % len(running))
            fast.free_blocks(blocks[::-1])
            ref.free_blocks(blocks[::-1])
        assert fast.num_free_blocks == ref.num_free_blocks
        free_queue = fast.free_queue
        assert list(free_queue) == list(ref.free_queue)
        assert fast.ref_cnt == ref.ref_cnt
        assert {h: fast.get_cached_block(h) for h in ref.cached} == {
            h: bs[0] for h, bs in ref.cached.items()
        }
        cached = fast.cached
        assert len(cached) == len(ref.cached)
        # Every holder of every hash, oldest first (who takes over when a holder is evicted).
        more = fast._more_holders
        assert {h: [b, *more.get(h, ())] for h, b in cached.items()} == ref.cached
        # Free blocks carry the hash they hold (what taking them evicts).
        assert list(free_queue.items()) == [(b, ref.block_hash[b]) for b in ref.free_queue]
        if emit_events:
            assert _events(fast) == ref.events
        else:
            assert fast.take_events() == []
        ref.events.clear()


# -- the engine's pool stays consistent ----------------------------------------------------

BS = 4
_rng = np.random.default_rng(7)
_PREFIXES = [_rng.integers(1, 500, 40) for _ in range(3)]

engine_requests = st.lists(
    st.tuples(
        st.integers(0, 30),  # arrival step
        st.integers(0, 2),  # prefix
        st.integers(0, 40),  # prefix tokens used
        st.integers(0, 14),  # own tokens
        st.integers(1, 40),  # output tokens
    ),
    min_size=1,
    max_size=12,
)


def _assert_free_blocks_carry_their_hashes(pool) -> None:
    """Every free block carries exactly the hash the lookup table says it holds."""
    more = pool._more_holders
    cached = pool.cached
    holds = {b: h for h, first in cached.items() for b in [first, *more.get(h, ())]}
    assert len(holds) == len(cached) + sum(map(len, more.values()))
    free_queue = pool.free_queue
    assert {b: h for b, h in free_queue.items() if h is not None} == {
        b: h for b, h in holds.items() if b in free_queue
    }


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.tuples(st.integers(12, 40), st.sampled_from([8, 16, 64, 8192]), st.sampled_from([2, 3, 256])),
    requests=engine_requests,
)
def test_engine_keeps_its_pool_consistent(config, requests):
    num_blocks, budget, max_seqs = config
    longest = max(used + own + out for _, _, used, own, out in requests)
    if -(-(longest + 1) // BS) > num_blocks - 1:
        return  # cannot fit an empty worker (the simulator rejects such workloads)
    cost = CostModel("t", 1.0, 0.0, 0.0, 0.0, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    engine = Engine(num_blocks, BS, cost, BlockHasher(BS))
    pending = []
    for i, (arrive, prefix, used, own, out) in enumerate(requests):
        prompt = np.concatenate([_PREFIXES[prefix][:used], np.arange(600 + 20 * i, 600 + 20 * i + own)])
        if len(prompt) == 0:
            prompt = np.array([1])
        pending.append((arrive, EngineRequest(str(i), prompt, np.arange(900, 900 + out), 0.0)))
    pending.sort(key=lambda x: x[0])
    step = 0
    finished = set()
    while pending or engine.has_work:
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        if not engine.has_work:
            step = pending[0][0]
            continue
        result = engine.step(float(step))
        step += 1
        finished |= {o.request.request_id for o in result.outputs if o.finished}
        assert step < 100_000, "engine stalled"
        _assert_free_blocks_carry_their_hashes(engine.pool)
    assert finished == {str(i) for i in range(len(requests))}
    assert engine.pool.num_free_blocks == num_blocks - 1
