"""kvroute against a real vLLM (the ``vllm`` tier; the fleet is conftest.py's ``vllm_fleet``).

At the tier's small scale (2 workers, K = 4 prefixes of 14 blocks against 47 usable blocks per
worker, 40 requests, 1 trial) these check what kvroute assumes about the real engine:

* the tokenizer path is exact: kvroute's block hashes of a chat prompt, tokenized with the tiny
  model's tokenizer and chat template, are those of the blocks vLLM reports storing for it;
* the bench's two hit measures (per-request ``cached_tokens`` and the workers' Prometheus
  counters) agree, through the experiment's Service topology;
* every KV event vLLM published during the session decodes (live and replayed), events of all
  three kinds included.

Run with ``python -m pytest -q -m vllm`` after ``kvroute setup-vllm``; each test prints what it
measured (``-s`` shows it).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

import aiohttp
import numpy as np
import pytest

from kvroute.bench.runner import SweepHooks
from kvroute.bench.writer import ResultsWriter
from kvroute.blocks import BlockHasher
from kvroute.engine.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.experiment import ExperimentResult, run_experiment
from kvroute.kvevents.subscriber import (
    EngineRestarted,
    EventsReceived,
    GapDetected,
    KVEventSubscriber,
    MalformedPayload,
    ReplayFailed,
    SubscriberItem,
)
from kvroute.tokens import HFTokenizer
from kvroute.workers import VllmServer, external

pytestmark = pytest.mark.vllm

TOPIC = "kv-events"
#: How long a ZMQ SUB needs to finish connecting before it sees anything ("slow joiner").
SUBSCRIBE_SETTLE_S = 0.5


async def _post(url: str, path: str, body: dict | None = None) -> dict:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json() if r.content_type == "application/json" else {}


async def _collect(
    subscriber: KVEventSubscriber, done: Callable[[list[SubscriberItem]], bool], timeout_s: float = 20.0
) -> list[SubscriberItem]:
    """Items from ``subscriber`` until ``done(items)`` (fails after ``timeout_s``)."""
    items: list[SubscriberItem] = []
    deadline = time.monotonic() + timeout_s
    while not done(items):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; got {len(items)} items, last {items[-3:]}"
        try:
            items.append(await asyncio.wait_for(subscriber.__anext__(), left))
        except TimeoutError:
            pytest.fail(f"no KV events within {timeout_s:.0f} s; got {len(items)} items")
    return items


def _stored(items: list[SubscriberItem]) -> list[BlockStored]:
    return [e for i in items if isinstance(i, EventsReceived) for e in i.batch.events if isinstance(e, BlockStored)]


def _own_hashes(stored: list[BlockStored], hasher: BlockHasher) -> dict[int, tuple[int, list[int]]]:
    """kvroute's hash of every block vLLM reported, by vLLM's hash: ``{engine: (own, tokens)}``.

    A router does exactly this: it hashes the events' ``token_ids`` with its own chained hash,
    following ``parent_block_hash`` through the blocks it already knows.
    """
    own: dict[int, tuple[int, list[int]]] = {}
    for event in stored:
        parent = None if event.parent_block_hash is None else own[event.parent_block_hash][0]
        hashes = hasher.hash_blocks(event.token_ids, parent_hash=parent)
        assert len(hashes) == len(event.block_hashes)
        bs = hasher.block_size
        for i, (engine_hash, h) in enumerate(zip(event.block_hashes, hashes)):
            own[engine_hash] = (h, event.token_ids[i * bs : (i + 1) * bs])
    return own


async def test_kvroute_block_hashes_equal_those_of_the_blocks_vllm_stored(vllm_fleet):
    server = vllm_fleet.servers[0]
    tokenizer = HFTokenizer.from_dir(vllm_fleet.install.model_dir)
    hasher = BlockHasher(vllm_fleet.block_size)
    # Fresh words each run, so every block of this prompt is stored now (none is a hit).
    words = np.random.default_rng().integers(0, 10**6, size=150)
    messages = [
        {"role": "system", "content": " ".join(f"w{w}" for w in words)},
        {"role": "user", "content": "Which of these words is the longest?"},
    ]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                           add_special_tokens=False)
    expected = hasher.hash_blocks(ids)
    assert len(expected) >= 3, "the prompt should span several blocks"

    async with KVEventSubscriber(server.events_endpoint, server.replay_endpoint, TOPIC) as sub:
        await asyncio.sleep(SUBSCRIBE_SETTLE_S)
        done = await _post(server.url, "/v1/chat/completions",
                           {"model": vllm_fleet.model, "messages": messages, "max_tokens": 1})

        def all_stored(items: list[SubscriberItem]) -> bool:
            own = {h for h, _ in _own_hashes(_stored(items), hasher).values()}
            return set(expected) <= own

        items = await _collect(sub, all_stored)

    assert done["usage"]["prompt_tokens"] == len(ids)  # the same number of tokens…
    by_own = {h: tokens for h, tokens in _own_hashes(_stored(items), hasher).values()}
    bs = vllm_fleet.block_size
    # …and the same tokens, block by block, in the same chain.
    assert [by_own[h] for h in expected] == [ids[i * bs : (i + 1) * bs] for i in range(len(expected))]
    print(f"\ntokenizer path: {len(ids)} prompt tokens, {len(expected)} full blocks, "
          f"all {len(expected)} kvroute hashes found among the blocks vLLM stored")


async def test_bench_hit_measures_agree_through_the_service(vllm_fleet, tier_plan, tmp_path):
    plan = tier_plan()

    async def shared_fleet(workers: int):
        # The session owns the servers: hand the experiment a fleet whose close() stops nothing.
        return external(vllm_fleet.fleet.urls)

    result = ExperimentResult()
    await run_experiment(plan, shared_fleet, ResultsWriter(tmp_path), SweepHooks(), result)

    (point,) = result.measured
    (trial,) = point.trials
    assert trial.requests == 40 and trial.failed == 0
    assert result.geometry == (vllm_fleet.kv_cache_memory_bytes // (vllm_fleet.block_size * 512), vllm_fleet.block_size)
    assert trial.metrics_token_hit_rate is not None
    # Pressure: some requests hit, some miss (K = 4 prefixes, C ≈ 3.1 per worker).
    assert 0 < trial.hits < trial.requests
    assert abs(trial.token_hit_rate - trial.metrics_token_hit_rate) <= 0.001
    (predicted,) = result.predicted
    print(f"\nbench on real vLLM (W=2, K=4, c=2, 40 requests): token hit rate from cached_tokens "
          f"{trial.token_hit_rate:.6f}, from /metrics counters {trial.metrics_token_hit_rate:.6f} "
          f"(|Δ| = {abs(trial.token_hit_rate - trial.metrics_token_hit_rate):.2e}); request hit rate "
          f"{trial.request_hit_rate:.3f}; simulator {predicted.median('token_hit_rate'):.3f}; C = "
          f"{result.capacity:.2f}; geometry {result.geometry}")


async def _evict(server: VllmServer, model: str, block_size: int, blocks: int) -> None:
    """Clear the cache, then send fresh prompts whose blocks add up to more than ``blocks``,
    so vLLM must evict: AllBlocksCleared, BlockStored and BlockRemoved all occur."""
    await _post(server.url, "/reset_prefix_cache")
    rng = np.random.default_rng()
    per_prompt = 14
    for _ in range(blocks // per_prompt + 2):
        prompt = rng.integers(1000, 8000, size=per_prompt * block_size).tolist()
        await _post(server.url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})


async def test_every_kv_event_of_the_session_decodes(vllm_fleet):
    """Replays each worker's whole event history (from seq 0) and decodes every batch."""
    usable_blocks = vllm_fleet.kv_cache_memory_bytes // (vllm_fleet.block_size * 512) - 1
    report = []
    for server in vllm_fleet.servers:
        await _evict(server, vllm_fleet.model, vllm_fleet.block_size, usable_blocks)
        async with KVEventSubscriber(server.events_endpoint, server.replay_endpoint, TOPIC) as sub:
            await asyncio.sleep(SUBSCRIBE_SETTLE_S)
            # A new live batch: the subscriber sees it start past 0 and replays everything before.
            prompt = np.random.default_rng().integers(1000, 8000, size=2 * vllm_fleet.block_size).tolist()
            await _post(server.url, "/v1/completions", {"model": vllm_fleet.model, "prompt": prompt, "max_tokens": 1})
            items = await _collect(
                sub, lambda got: any(isinstance(i, EventsReceived) and not i.replayed for i in got)
            )
        problems = [i for i in items if isinstance(i, (MalformedPayload, ReplayFailed, EngineRestarted))]
        assert problems == []
        gaps = [i for i in items if isinstance(i, GapDetected)]
        assert all(g.expected == 0 for g in gaps)
        batches = [i for i in items if isinstance(i, EventsReceived)]
        assert [b.seq for b in batches] == list(range(len(batches)))  # the whole history, in order
        assert all(b.batch.unknown_events == 0 for b in batches)
        kinds = Counter(type(e).__name__ for b in batches for e in b.batch.events)
        assert kinds[BlockStored.__name__] and kinds[BlockRemoved.__name__] and kinds[AllBlocksCleared.__name__]
        stored = _stored(items)
        assert all(len(e.token_ids) == len(e.block_hashes) * e.block_size for e in stored)
        assert all(e.block_size == vllm_fleet.block_size for e in stored)
        report.append(f"worker {server.index}: {len(batches)} batches "
                      f"({sum(b.replayed for b in batches)} replayed), {dict(kinds)}")
    print("\nKV events, all decoded: " + "; ".join(report))
