"""The router's KvIndex: own hashes over events' tokens, per-(worker, block) counts, resets,
predicted entries (TTL, LRU bound), and agreement with the engine model's real cache."""

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.blocks import BlockHasher
from kvroute.engine import INSTANT, AllBlocksCleared, BlockRemoved, BlockStored, Engine, EngineRequest
from kvroute.routing.index import KvIndex

BS = 4
OWN = BlockHasher(BS)
#: The engine's hashes are not the router's: a different seed stands for vLLM's own algorithm.
ENGINE = BlockHasher(BS, seed=987654321)


def tokens(n_blocks: int, start: int = 100) -> list[int]:
    return list(range(start, start + n_blocks * BS))


def stored(toks: list[int], first: int = 0, stop: int | None = None) -> BlockStored:
    """The BlockStored an engine sends for blocks [first, stop) of ``toks``."""
    hashes = ENGINE.hash_blocks(toks)
    stop = len(hashes) if stop is None else stop
    return BlockStored(
        block_hashes=hashes[first:stop],
        parent_block_hash=hashes[first - 1] if first else None,
        token_ids=toks[first * BS : stop * BS],
        block_size=BS,
    )


def removed(toks: list[int], *blocks: int) -> BlockRemoved:
    hashes = ENGINE.hash_blocks(toks)
    return BlockRemoved(block_hashes=[hashes[b] for b in blocks])


def test_lookup_uses_own_hashes_of_the_events_tokens():
    index = KvIndex(OWN)
    prompt = tokens(6)
    index.apply("a", [stored(prompt, 0, 2), stored(prompt, 2, 5)])  # chunked prefill
    index.apply("b", [stored(prompt, 0, 3)])
    assert index.overlaps(OWN.hash_blocks(prompt), ["a", "b", "c"], 0.0) == [5, 3, 0]
    assert index.overlaps(ENGINE.hash_blocks(prompt), ["a", "b"], 0.0) == [0, 0]
    other = tokens(6, start=5000)
    assert index.overlaps(OWN.hash_blocks(other), ["a", "b"], 0.0) == [0, 0]
    assert index.stats().blocks == 8


def test_lookup_stops_at_the_first_block_a_worker_lacks():
    index = KvIndex(OWN)
    prompt = tokens(5)
    index.apply("a", [stored(prompt), removed(prompt, 2)])
    assert index.overlaps(OWN.hash_blocks(prompt), ["a"], 0.0) == [2]


def test_duplicate_store_needs_two_removals():
    index = KvIndex(OWN)
    prompt = tokens(3)
    own = OWN.hash_blocks(prompt)
    index.apply("a", [stored(prompt), stored(prompt)])  # vLLM does not deduplicate
    index.apply("a", [removed(prompt, 2, 1, 0)])
    assert index.overlaps(own, ["a"], 0.0) == [3]
    index.apply("a", [removed(prompt, 2)])
    assert index.overlaps(own, ["a"], 0.0) == [2]
    index.apply("a", [removed(prompt, 1, 0)])
    assert index.overlaps(own, ["a"], 0.0) == [0]
    assert index.stats().blocks == 0 and index.stats().unknown_removals == 0


def test_two_engine_hashes_for_the_same_tokens_count_separately():
    # e.g. a GPU and a CPU copy reported under different engine hashes: the tokens (own
    # hash) stay held until both are gone.
    index = KvIndex(OWN)
    prompt = tokens(1)
    own = OWN.hash_blocks(prompt)
    index.apply("a", [BlockStored([11], None, prompt, BS), BlockStored([22], None, prompt, BS)])
    index.apply("a", [BlockRemoved([11])])
    assert index.overlaps(own, ["a"], 0.0) == [1]
    index.apply("a", [BlockRemoved([22])])
    assert index.overlaps(own, ["a"], 0.0) == [0]


def test_unknown_removal_is_ignored_and_counted():
    index = KvIndex(OWN)
    prompt = tokens(2)
    index.apply("a", [stored(prompt), BlockRemoved([123456789])])
    assert index.overlaps(OWN.hash_blocks(prompt), ["a"], 0.0) == [2]
    assert index.stats().unknown_removals == 1


def test_orphan_blocks_are_skipped_not_guessed():
    index = KvIndex(OWN)
    prompt = tokens(4)
    index.apply("a", [stored(prompt, 2, 4)])  # its parent (block 1) was never seen
    assert index.overlaps(OWN.hash_blocks(prompt), ["a"], 0.0) == [0]
    assert index.stats().orphan_blocks == 2 and index.stats().blocks == 0
    index.apply("a", [removed(prompt, 3)])
    assert index.stats().unknown_removals == 1


@pytest.mark.parametrize(
    "event",
    [
        BlockStored(ENGINE.hash_blocks(tokens(2)), None, tokens(2), BS, lora_id=3),
        BlockStored(ENGINE.hash_blocks(tokens(2)), None, tokens(2), BS, lora_name="adapter"),
        # A multimodal key (an image's identifier and offset): no prompt kvroute hashes has it.
        BlockStored(ENGINE.hash_blocks(tokens(2)), None, tokens(2), BS, extra_keys=[("img", 0), None]),
        BlockStored([1], None, tokens(2), 2 * BS),  # another block size (a CPU tier)
        BlockStored(ENGINE.hash_blocks(tokens(2)), None, tokens(1), BS),  # too few tokens
    ],
)
def test_blocks_a_token_hash_cannot_name_are_skipped(event):
    index = KvIndex(OWN)
    index.apply("a", [event])
    assert index.overlaps(OWN.hash_blocks(tokens(2)), ["a"], 0.0) == [0]
    assert index.stats().skipped_blocks == len(event.block_hashes)


def test_blocks_keyed_by_an_adapter_and_a_salt_are_indexed_under_those_keys():
    index = KvIndex(OWN)
    toks = tokens(3)
    keys = [("sql", "tenant-1"), ("sql",), ("sql",)]  # vLLM's: the salt on block 0 only
    event = BlockStored(
        ENGINE.hash_blocks(toks, lora_name="sql", cache_salt="tenant-1"), None, toks, BS,
        lora_id=1, lora_name="sql", extra_keys=keys,
    )
    index.apply("a", [event])
    assert index.stats().skipped_blocks == 0
    mine = OWN.hash_blocks(toks, lora_name="sql", cache_salt="tenant-1")
    assert index.overlaps(mine, ["a"], 0.0) == [3]
    for other in (
        OWN.hash_blocks(toks),
        OWN.hash_blocks(toks, lora_name="sql"),
        OWN.hash_blocks(toks, lora_name="sql", cache_salt="tenant-2"),
        OWN.hash_blocks(toks, lora_name="chat", cache_salt="tenant-1"),
    ):
        assert index.overlaps(other, ["a"], 0.0) == [0]


def test_extra_keys_all_none_is_a_plain_block():
    index = KvIndex(OWN)
    event = stored(tokens(2))
    event.extra_keys = [None, None]
    index.apply("a", [event])
    assert index.overlaps(OWN.hash_blocks(tokens(2)), ["a"], 0.0) == [2]


def test_all_blocks_cleared_resets_only_that_worker():
    index = KvIndex(OWN)
    prompt = tokens(3)
    own = OWN.hash_blocks(prompt)
    for w in ("a", "b"):
        index.apply(w, [stored(prompt)])
    index.record_routed("a", OWN.hash_blocks(tokens(3, start=900)), 0.0)
    index.apply("a", [AllBlocksCleared()])
    assert index.overlaps(own, ["a", "b"], 0.0) == [0, 3]
    assert index.stats().predicted == 0
    index.apply("a", [removed(prompt, 2)])  # removals of forgotten blocks are harmless
    index.apply("a", [stored(prompt, 0, 1)])  # and the worker starts over
    assert index.overlaps(own, ["a", "b"], 0.0) == [1, 3]


def test_reset_worker_keeps_it_known_remove_worker_frees_its_bit():
    index = KvIndex(OWN)
    prompt = tokens(3)
    own = OWN.hash_blocks(prompt)
    for w in ("a", "b"):
        index.apply(w, [stored(prompt)])
    index.reset_worker("a")
    assert index.overlaps(own, ["a", "b"], 0.0) == [0, 3]
    assert index.stats().workers == 2
    index.remove_worker("b")
    assert index.stats().workers == 1 and index.stats().blocks == 0
    index.apply("c", [stored(tokens(1, start=7))])  # reuses b's bit: must not inherit b's blocks
    assert index.overlaps(own, ["a", "b", "c"], 0.0) == [0, 0, 0]
    index.remove_worker("nobody")
    index.reset_worker("nobody")


def test_predicted_entries_bridge_until_ttl_and_events_replace_them():
    index = KvIndex(OWN, predicted_ttl=2.0)
    prompt = tokens(4)
    own = OWN.hash_blocks(prompt)
    index.record_routed("a", own, now=10.0)
    assert index.overlaps(own, ["a", "b"], 10.5) == [4, 0]
    assert index.worker_blocks("a") == 4
    assert index.overlaps(own, ["a", "b"], 12.0) == [0, 0]  # expired
    assert index.stats().predicted == 0

    index.record_routed("a", own, now=20.0)
    index.apply("a", [stored(prompt, 0, 3)])  # the event vouches for 3 of them now
    assert index.stats().predicted == 1 and index.stats().blocks == 3
    index.apply("a", [removed(prompt, 2, 1)])  # evicted for real: no prediction keeps them
    assert index.overlaps(own, ["a"], 20.1) == [1]


def test_predicted_refresh_extends_the_ttl():
    index = KvIndex(OWN, predicted_ttl=2.0)
    own = OWN.hash_blocks(tokens(2))
    index.record_routed("a", own, now=0.0)
    index.record_routed("a", own, now=1.5)
    assert index.overlaps(own, ["a"], 3.0) == [2]
    assert index.overlaps(own, ["a"], 3.5) == [0]


def test_predicted_capacity_evicts_least_recently_routed_tail_first():
    index = KvIndex(OWN, predicted_ttl=None, predicted_capacity_blocks=6)
    first = OWN.hash_blocks(tokens(4, start=0))
    second = OWN.hash_blocks(tokens(4, start=1000))
    index.record_routed("a", first, 0.0)
    index.record_routed("a", second, 1.0)
    # 8 entries for a capacity of 6: the first prompt's two TAIL blocks went, as vLLM evicts.
    assert index.overlaps(first, ["a"], 2.0) == [2]
    assert index.overlaps(second, ["a"], 2.0) == [4]
    index.record_routed("a", first, 3.0)  # touched again: now the second prompt is older
    assert index.overlaps(second, ["a"], 4.0) == [2]


def test_churning_keys_keep_memory_bounded():
    ttl_index = KvIndex(OWN, predicted_ttl=1.0)
    lru_index = KvIndex(OWN, predicted_ttl=None, predicted_capacity_blocks=100)
    rng = random.Random(0)
    for step in range(3000):
        prompt = OWN.hash_blocks(tokens(8, start=rng.randrange(10**9)))
        for index in (ttl_index, lru_index):
            index.record_routed(f"w{step % 4}", prompt, now=step * 0.01)
            index.record_routed(f"w{step % 4}", prompt, now=step * 0.01)  # refreshes pile up stale items
    # TTL 1 s at 100 prompts/s of 8 blocks: ~800 alive; the expiry queue stays proportional.
    assert ttl_index.stats().predicted <= 8 * 101
    ttl_tables, lru_tables = ttl_index.table_sizes(), lru_index.table_sizes()
    assert ttl_tables["expiry_queue"] <= 4 * 8 * 101 + 1024
    assert ttl_tables["predicted_keys"] <= 8 * 101
    assert lru_index.stats().predicted == 4 * 100
    assert lru_tables["predicted_keys"] <= 400 and not lru_tables["expiry_queue"]


def test_event_churn_leaves_nothing_behind():
    index = KvIndex(OWN)
    for i in range(50):
        prompt = tokens(5, start=i * 1000)
        index.apply("a", [stored(prompt), stored(prompt, 0, 2), removed(prompt, 4, 3, 2, 1, 0, 1, 0)])
    assert index.stats().blocks == 0
    tables = index.table_sizes()
    assert tables["held_keys"] == 0 and tables["engine_entries"] == 0
    assert tables["duplicate_copies"] == 0


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError):
        KvIndex(OWN, predicted_ttl=None, predicted_capacity_blocks=None)
    with pytest.raises(ValueError):
        KvIndex(OWN, predicted_ttl=-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("sr"), st.integers(0, 5), st.integers(1, 4)), max_size=40))
def test_counts_match_a_multiset_model(ops):
    """Random stores and removals of block chains against a plain multiset of copies."""
    index = KvIndex(OWN)
    prompts = [tokens(4, start=100 + 1000 * i) for i in range(6)]
    copies: dict[tuple[int, int], int] = {}
    for op, p, n in ops:
        if op == "s":
            index.apply("a", [stored(prompts[p], 0, n)])
            for b in range(n):
                copies[(p, b)] = copies.get((p, b), 0) + 1
        else:
            index.apply("a", [removed(prompts[p], n - 1)])
            if copies.get((p, n - 1)):
                copies[(p, n - 1)] -= 1
    for p, prompt in enumerate(prompts):
        expect = 0
        while expect < 4 and copies.get((p, expect)):
            expect += 1
        assert index.overlaps(OWN.hash_blocks(prompt), ["a"], 0.0) == [expect]


def test_index_fed_by_the_engine_model_matches_its_cache():
    """Drive real engine models (own hash seed differs from the router's) through eviction,
    duplicates and chunked prefill; the index must predict every engine's real longest hit."""
    block = 4
    engine_hasher = BlockHasher(block, seed=42)
    router_hasher = BlockHasher(block)
    index = KvIndex(router_hasher)
    rng = np.random.default_rng(3)
    prefixes = [rng.integers(1, 1000, size=block * 6) for _ in range(5)]
    engines = {
        f"w{i}": Engine(40, block, INSTANT, engine_hasher, emit_events=True) for i in range(3)
    }
    names = list(engines)
    checked = 0
    for step in range(120):
        for name, engine in engines.items():
            for n in range(int(rng.integers(0, 3))):
                suffix = rng.integers(1, 1000, size=int(rng.integers(1, 9)))
                prompt = np.concatenate([prefixes[int(rng.integers(5))], suffix])
                engine.add_request(EngineRequest(f"{name}-{step}-{n}", prompt, np.arange(3) + 5, 0.0))
            if engine.has_work:
                result = engine.step(0.0)
                if result.events:
                    index.apply(name, result.events.events)
        for p in prefixes:
            query = np.concatenate([p, [7] * block])
            got = index.overlaps(router_hasher.hash_blocks(query), names, 0.0)
            want = [
                len(e.pool.find_longest_hit(engine_hasher.hash_blocks(query), 10**6)) for e in engines.values()
            ]
            assert got == want
            checked += sum(want)
    assert checked > 100  # the comparison saw real hits, not only empty caches
    assert index.stats().orphan_blocks == 0 and index.stats().unknown_removals == 0


def test_token_ids_that_are_not_uint32_are_skipped_not_fatal():
    index = KvIndex(OWN)
    index.apply("a", [BlockStored([1], None, [-1, 2, 3, 4], BS), stored(tokens(1))])
    assert index.stats().skipped_blocks == 1 and index.stats().blocks == 1
