"""The BlockPool follows vLLM v1's block_pool.py / FreeKVCacheBlockQueue rules, one test each."""

import numpy as np
import pytest

from kvroute.blocks import BlockHasher
from kvroute.engine import (
    INSTANT,
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    Engine,
    EngineRequest,
)

BS = 4


def hashes(n: int, base: int = 0) -> list[int]:
    return [base + i + 1 for i in range(n)]


def test_null_block_is_reserved():
    pool = BlockPool(num_blocks=5, block_size=BS)
    assert pool.num_free_blocks == 4
    taken = pool.get_new_blocks(4)
    assert 0 not in taken
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_new_blocks_come_from_the_head_of_the_free_queue():
    pool = BlockPool(num_blocks=6, block_size=BS)
    assert pool.get_new_blocks(2) == [1, 2]
    pool.cache_full_blocks([1, 2], [11, 12], 0, 2, list(range(8)))
    pool.free_blocks([2, 1])
    # 3, 4, 5 were never used and are older in the queue than the freed (cached) 2 and 1.
    assert pool.get_new_blocks(5) == [3, 4, 5, 2, 1]


def test_freed_blocks_without_a_hash_are_reused_before_any_cached_block():
    # vLLM 0.32: a finished request's partial last block goes to the head of the free queue,
    # its cached blocks to the tail; the next allocation takes the partial block first.
    pool = BlockPool(num_blocks=6, block_size=BS, emit_events=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [11, 12], 0, 2, list(range(10)))
    pool.take_events()
    pool.free_blocks(blocks[::-1])
    assert pool.get_new_blocks(3) == [3, 4, 5]
    assert pool.take_events() == []


def test_finished_request_frees_tail_first_so_its_tail_is_evicted_first():
    pool = BlockPool(num_blocks=4, block_size=BS, emit_events=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [11, 12, 13], 0, 3, list(range(12)))
    pool.take_events()
    pool.free_blocks(blocks[::-1])  # what Engine does for a finished request
    pool.get_new_blocks(1)
    assert pool.take_events() == [BlockRemoved(block_hashes=[13])]
    assert pool.get_cached_block(11) is not None and pool.get_cached_block(13) is None


def test_touch_on_hit_takes_blocks_out_of_the_free_queue_and_counts_refs():
    pool = BlockPool(num_blocks=4, block_size=BS)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [21, 22], 0, 2, None)
    pool.free_blocks(blocks[::-1])
    assert pool.num_free_blocks == 3
    hit = pool.find_longest_hit([21, 22, 99], max_blocks=3)
    assert hit == blocks
    pool.touch(hit)
    assert pool.num_free_blocks == 1
    pool.touch(hit)  # a second request sharing the prefix
    assert [pool.ref_cnt[b] for b in hit] == [2, 2]
    pool.free_blocks(hit[::-1])
    assert pool.num_free_blocks == 1  # still held by the first
    pool.free_blocks(hit[::-1])
    assert pool.num_free_blocks == 3


def test_cached_blocks_are_evicted_only_when_reused_not_when_freed():
    pool = BlockPool(num_blocks=3, block_size=BS, emit_events=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [31, 32], 0, 2, list(range(8)))
    pool.free_blocks(blocks[::-1])
    assert [type(e) for e in pool.take_events()] == [BlockStored]
    assert pool.find_longest_hit([31, 32], 2) == blocks  # still cached while free
    pool.get_new_blocks(2)
    assert pool.take_events() == [BlockRemoved([32]), BlockRemoved([31])]
    assert pool.find_longest_hit([31, 32], 2) == []


def test_identical_blocks_are_not_deduplicated():
    pool = BlockPool(num_blocks=4, block_size=BS, emit_events=True)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [41], 0, 1, list(range(4)))
    pool.cache_full_blocks(b, [41], 0, 1, list(range(4)))
    stored = pool.take_events()
    assert len(stored) == 2 and all(e.block_hashes == [41] for e in stored)
    assert pool.get_cached_block(41) == a[0]  # the first stored is found first
    pool.free_blocks(a + b)
    pool.get_new_blocks(3)
    assert pool.take_events() == [BlockRemoved([41]), BlockRemoved([41])]


def test_block_stored_carries_tokens_and_parent():
    pool = BlockPool(num_blocks=5, block_size=BS, emit_events=True)
    blocks = pool.get_new_blocks(3)
    tokens = list(range(100, 112))
    pool.cache_full_blocks(blocks, [51, 52, 53], 0, 1, tokens)
    pool.cache_full_blocks(blocks, [51, 52, 53], 1, 3, tokens)
    first, rest = pool.take_events()
    assert first == BlockStored([51], None, tokens[:4], BS)
    assert rest.parent_block_hash == 51 and rest.token_ids == tokens[4:12]


def test_reset_clears_cache_only_when_nothing_is_in_use():
    pool = BlockPool(num_blocks=4, block_size=BS, emit_events=True)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [61], 0, 1, list(range(4)))
    pool.take_events()
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.find_longest_hit([61], 1) == []
    pool.get_new_blocks(3)
    assert pool.take_events() == []  # nothing cached any more, so nothing evicted


def test_usage_counts_only_blocks_held_by_requests():
    pool = BlockPool(num_blocks=5, block_size=BS)
    blocks = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.5)
    pool.cache_full_blocks(blocks, [71, 72], 0, 2, None)
    pool.free_blocks(blocks)
    assert pool.usage == 0.0  # a full cache of free blocks reads as idle, like vLLM


def _engine(num_blocks: int = 64, events: bool = True) -> Engine:
    return Engine(num_blocks, BS, INSTANT, BlockHasher(BS), emit_events=events)


def _run(engine: Engine, now: float = 0.0) -> list:
    outputs = []
    while engine.has_work:
        outputs += engine.step(now).outputs
    return outputs


def test_engine_hits_whole_blocks_and_recomputes_last_token_of_full_hit():
    engine = _engine()
    prompt = np.arange(1, 13)  # 12 tokens = 3 full blocks
    engine.add_request(EngineRequest("a", prompt, [7, 8], 0.0))
    _run(engine)
    again = EngineRequest("b", prompt, [7, 8], 0.0)
    engine.add_request(again)
    _run(engine)
    # 11 tokens may hit at most (the last is recomputed), i.e. 2 whole blocks.
    assert again.num_cached_tokens == 8
    longer = EngineRequest("c", np.arange(1, 16), [9], 0.0)
    engine.add_request(longer)
    _run(engine)
    assert longer.num_cached_tokens == 12
    assert engine.stats.queries == 12 + 12 + 15 and engine.stats.hits == 8 + 12


def test_generated_tokens_fill_and_cache_blocks():
    engine = _engine()
    engine.add_request(EngineRequest("a", np.arange(1, 7), np.arange(100, 106), 0.0))
    stored = []
    while engine.has_work:
        result = engine.step(0.0)
        if result.events:
            stored += [e for e in result.events.events if isinstance(e, BlockStored)]
    tokens = [t for e in stored for t in e.token_ids]
    # 6 prompt + 6 generated = 12 tokens, but the last sampled token is never computed:
    # 11 computed tokens → 2 full blocks, the second holding generated tokens.
    assert tokens == [1, 2, 3, 4, 5, 6, 100, 101]


def test_waiting_request_is_admitted_when_blocks_free_up():
    engine = _engine(num_blocks=5)  # 4 usable blocks = 16 tokens
    engine.add_request(EngineRequest("a", np.arange(1, 13), [1, 2, 3], 0.0))
    engine.add_request(EngineRequest("b", np.arange(50, 62), [1, 2, 3], 0.0))
    first = engine.step(0.0)
    assert [o.request.request_id for o in first.outputs] == ["a"]
    assert engine.num_waiting == 1 and engine.num_running == 1
    outputs = _run(engine)
    assert {o.request.request_id for o in outputs if o.finished} == {"a", "b"}
    assert engine.stats.requests == 2  # the failed admission attempt was not counted


def test_preemption_frees_the_last_admitted_request():
    engine = _engine(num_blocks=7)  # 6 usable blocks
    engine.add_request(EngineRequest("a", np.arange(1, 9), np.arange(10, 20), 0.0))
    engine.add_request(EngineRequest("b", np.arange(50, 58), np.arange(10, 20), 0.0))
    outputs = _run(engine)
    assert engine.num_preemptions >= 1
    assert {o.request.request_id for o in outputs if o.finished} == {"a", "b"}
    assert all(len(o.request.blocks) == 0 for o in outputs if o.finished)
    assert engine.pool.num_free_blocks == 6
    # A preempted request's re-admission is not counted as a new query (vLLM's rule).
    assert engine.stats.requests == 2
    assert engine.stats.preempted_requests == engine.num_preemptions


def test_abort_frees_blocks():
    engine = _engine()
    engine.add_request(EngineRequest("a", np.arange(1, 9), np.arange(10, 20), 0.0))
    engine.step(0.0)
    assert engine.abort_request("a")
    assert engine.pool.num_free_blocks == 63 and not engine.has_work
