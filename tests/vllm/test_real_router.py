"""kvroute's live router in front of real vLLM (the ``vllm`` tier; conftest.py's ``vllm_fleet``).

What the router assumes about the real engine, checked on the tier's two workers:

* it consumes real KV events: after a prompt is served, the router's index holds for the
  serving worker exactly the leading blocks vLLM reported storing for it, and after enough other
  prompts push them out of that worker's KV budget, the index drops them (``BlockRemoved``).
  The reference is a :class:`CacheMirror`, rebuilt from a raw ``KVEventSubscriber`` by a few
  lines written here, independently of ``KvIndex``;
* its kv-aware policy beats random balancing (the Service topology) on request hit rate, for
  the same seeded requests through the experiment's two topologies;
* the tokenizer path is exact for chat requests: the router's block hashes of a chat prompt
  (its native tokenizer and chat-template renderer, with their caches) are the hashes of the token
  ids vLLM reported in ``BlockStored`` for it.

The routers here run with ``predicted_ttl_s=0``: a routing decision is forgotten at once, so
whatever the index says about a worker comes from that worker's events.

Run with ``python -m pytest -q -m vllm -rP``; each test prints what it measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable

import aiohttp
import numpy as np
import pytest

from kvroute.bench.runner import SweepHooks, server_cache_config
from kvroute.bench.writer import ResultsWriter
from kvroute.blocks import BlockHasher
from kvroute.engine.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.experiment import ExperimentResult, run_experiment
from kvroute.kvevents.subscriber import (
    EngineRestarted,
    EventsReceived,
    KVEventSubscriber,
    MalformedPayload,
    ReplayFailed,
    SubscriberItem,
)
from kvroute.router import (
    WORKER_HEADER,
    EventsSettings,
    EventsSource,
    Router,
    RouterConfig,
    start_router,
)
from kvroute.tokens import flatten_message_content, load_tokenizer
from kvroute.workers import VllmServer, Workers

pytestmark = pytest.mark.vllm

TOPIC = "kv-events"
#: How long a ZMQ SUB needs to finish connecting before it sees anything ("slow joiner").
SUBSCRIBE_SETTLE_S = 0.5
#: How long events may take from the engine to the router's index (or the mirror).
EVENTS_TIMEOUT_S = 20.0
#: Blocks per test prompt: like the tier's workload (a 1,792-token prefix + a suffix), so a few
#: prompts exceed a worker's 47 usable blocks.
PROMPT_BLOCKS = 14


class CacheMirror:
    """What one vLLM worker's prefix cache holds, rebuilt from its raw KV event stream.

    Written apart from ``KvIndex`` on purpose, as the reference it is compared with: every
    block's own hash is kvroute's chained hash of the event's ``token_ids`` (the parent's own
    hash found through the engine hash the event names), and an engine hash is held while its
    stored copies outnumber its removals (vLLM does not deduplicate).
    """

    def __init__(self, hasher: BlockHasher) -> None:
        self.hasher = hasher
        #: engine hash -> own hash, for the blocks held now.
        self.own: dict[int, int] = {}
        #: engine hash -> stored copies not yet removed.
        self.copies: Counter[int] = Counter()
        self.kinds: Counter[str] = Counter()
        self.orphans = 0
        self.problems: list[SubscriberItem] = []

    def feed(self, item: SubscriberItem) -> None:
        if isinstance(item, (ReplayFailed, EngineRestarted, MalformedPayload)):
            self.problems.append(item)  # the stream is incomplete: no exact reference any more
        if not isinstance(item, EventsReceived):
            return
        for event in item.batch.events:
            self.kinds[type(event).__name__] += 1
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                for engine_hash in event.block_hashes:
                    if self.copies[engine_hash] > 1:
                        self.copies[engine_hash] -= 1
                    elif engine_hash in self.own:
                        del self.copies[engine_hash], self.own[engine_hash]
            elif isinstance(event, AllBlocksCleared):
                self.own.clear()
                self.copies.clear()

    def _store(self, event: BlockStored) -> None:
        parent = None
        if event.parent_block_hash is not None:
            parent = self.own.get(event.parent_block_hash)
            if parent is None:
                self.orphans += len(event.block_hashes)
                return
        own = self.hasher.hash_blocks(event.token_ids, parent_hash=parent)
        assert len(own) == len(event.block_hashes), "BlockStored with tokens for another block count"
        for engine_hash, own_hash in zip(event.block_hashes, own):
            self.own.setdefault(engine_hash, own_hash)
            self.copies[engine_hash] += 1

    def held(self) -> set[int]:
        """Own hashes of the blocks the worker holds now."""
        return set(self.own.values())

    def leading(self, block_hashes: list[int]) -> int:
        """How many leading blocks of a prompt the worker holds."""
        held = self.held()
        n = 0
        while n < len(block_hashes) and block_hashes[n] in held:
            n += 1
        return n


@contextlib.asynccontextmanager
async def _mirrors(servers: list[VllmServer], block_size: int) -> AsyncIterator[dict[str, CacheMirror]]:
    """A live :class:`CacheMirror` per server, by URL (the router's worker names)."""
    mirrors = {s.url: CacheMirror(BlockHasher(block_size)) for s in servers}

    async def pump(subscriber: KVEventSubscriber, mirror: CacheMirror) -> None:
        async for item in subscriber:
            mirror.feed(item)

    async with contextlib.AsyncExitStack() as stack:
        tasks = []
        for server in servers:
            subscriber = await stack.enter_async_context(
                KVEventSubscriber(server.events_endpoint, server.replay_endpoint, TOPIC)
            )
            tasks.append(asyncio.ensure_future(pump(subscriber, mirrors[server.url])))
        await asyncio.sleep(SUBSCRIBE_SETTLE_S)
        try:
            yield mirrors
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


def _router_config(fleet, **overrides) -> RouterConfig:
    """A kv-aware router over the tier's workers, fed by their KV events."""
    per_worker = {s.url: EventsSource(s.events_endpoint, s.replay_endpoint) for s in fleet.servers}
    options = {
        "workers": [s.url for s in fleet.servers],
        "policy": "kv-aware",
        "seed": 0,
        "block_size": fleet.block_size,
        "tokenizer": str(fleet.install.model_dir),
        "events": EventsSettings(per_worker=per_worker, topic=TOPIC),
        "predicted_ttl_s": 0.0,
        **overrides,
    }
    return RouterConfig(**options)


async def _post(url: str, path: str, body: dict | None = None) -> tuple[dict, str | None]:
    """POST ``body``; the JSON answer and the worker that served it (router only)."""
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        answer = await r.json() if r.content_type == "application/json" else {}
        return answer, r.headers.get(WORKER_HEADER)


async def _eventually(check: Callable[[], bool], what: Callable[[], str], timeout_s: float = EVENTS_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s:.0f} s: {what()}")
        await asyncio.sleep(0.05)


def _router_view(router: Router, block_hashes: list[int], workers: list[str]) -> list[int]:
    return router.index.overlaps(block_hashes, workers, time.monotonic())


def _cached_tokens(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def _await_all_stored(router: Router, mirror: CacheMirror, worker: str, block_hashes: list[int]) -> None:
    """Wait until vLLM reported storing every block of a prompt hashed by the router, and the
    router's index holds them all for ``worker``.

    Chained hashes: the router's hash of block i is among the hashes of what vLLM stored only if
    vLLM stored the very same tokens in blocks 0..i.
    """
    n = len(block_hashes)
    await _eventually(lambda: mirror.leading(block_hashes) == n,
                      lambda: f"{mirror.leading(block_hashes)}/{n} of the router's hashes among the blocks vLLM stored")
    await _eventually(lambda: _router_view(router, block_hashes, [worker])[0] == n,
                      lambda: f"index overlap {_router_view(router, block_hashes, [worker])[0]}/{n}")


async def test_router_index_follows_real_kv_events(vllm_fleet):
    bs = vllm_fleet.block_size
    usable_blocks = vllm_fleet.kv_cache_memory_bytes // (bs * 512) - 1
    hasher = BlockHasher(bs)
    rng = np.random.default_rng()

    def fresh_prompt() -> list[int]:
        # A partial last block: the prompt's PROMPT_BLOCKS full blocks are all cacheable.
        return rng.integers(1000, 8000, size=PROMPT_BLOCKS * bs + 50).tolist()

    # Known free space on both workers, so the eviction below happens when computed.
    for server in vllm_fleet.servers:
        await _post(server.url, "/reset_prefix_cache")
    async with _mirrors(vllm_fleet.servers, bs) as mirrors, start_router(_router_config(vllm_fleet)) as router:
        workers = list(mirrors)
        prompt = fresh_prompt()
        hashes = hasher.hash_blocks(prompt)
        body = {"model": vllm_fleet.model, "prompt": prompt, "max_tokens": 1}
        _, serving = await _post(router.url, "/v1/completions", body)
        assert serving in workers
        other = next(w for w in workers if w != serving)
        mirror = mirrors[serving]

        # 1. The blocks vLLM reported storing for the prompt, and nothing else, in the index.
        await _eventually(lambda: mirror.leading(hashes) == len(hashes),
                          lambda: f"vLLM stored {mirror.leading(hashes)}/{len(hashes)} blocks of the prompt")
        await _eventually(
            lambda: router.index.worker_blocks(serving) == len(mirror.held())
            and _router_view(router, hashes, [serving, other]) == [len(hashes), 0],
            lambda: f"index: overlaps {_router_view(router, hashes, [serving, other])}, "
                    f"{router.index.worker_blocks(serving)} blocks; vLLM: {mirror.leading(hashes)} "
                    f"leading blocks, {len(mirror.held())} held",
        )
        held_after_store = len(mirror.held())

        # The policy routes the same prompt back by those event-backed entries: a real hit.
        answer, again = await _post(router.url, "/v1/completions", body)
        assert again == serving
        assert _cached_tokens(answer) == len(hashes) * bs

        # 2. Fill the worker past its KV budget with other prompts (sent to it directly: the
        # index must follow what the worker does, whoever sent the traffic).
        fillers = [fresh_prompt() for _ in range(usable_blocks // PROMPT_BLOCKS + 2)]
        for filler in fillers:
            await _post(serving, "/v1/completions", {"model": vllm_fleet.model, "prompt": filler, "max_tokens": 1})
        last = hasher.hash_blocks(fillers[-1])
        await _eventually(lambda: mirror.leading(hashes) == 0 and mirror.leading(last) == len(last),
                          lambda: f"vLLM still holds {mirror.leading(hashes)} blocks of the first prompt")
        await _eventually(
            lambda: router.index.worker_blocks(serving) == len(mirror.held())
            and _router_view(router, hashes, [serving])[0] == 0
            and _router_view(router, last, [serving])[0] == len(last),
            lambda: f"index: first prompt {_router_view(router, hashes, [serving])[0]} blocks, last "
                    f"filler {_router_view(router, last, [serving])[0]}/{len(last)}, "
                    f"{router.index.worker_blocks(serving)} blocks; vLLM holds {len(mirror.held())}",
        )
        assert len(mirror.held()) <= usable_blocks
        assert mirror.problems == [] and mirror.orphans == 0
        stats = router.index.stats()
        print(f"\nrouter index on real KV events ({serving}): after the prompt "
              f"{len(hashes)}/{len(hashes)} leading blocks indexed = stored by vLLM "
              f"({held_after_store} blocks held, the same in the index); re-sent, routed back with "
              f"cached_tokens {len(hashes) * bs}; after {len(fillers)} fillers of {PROMPT_BLOCKS} blocks "
              f"(budget {usable_blocks}): overlap 0, index {router.index.worker_blocks(serving)} blocks "
              f"= vLLM {len(mirror.held())}; vLLM events seen {dict(mirror.kinds)}; index stats {stats}")


async def test_router_reads_each_real_workers_kv_capacity(vllm_fleet):
    """With kv-aware's admission guard on, the router counts each worker's cache by the
    ``num_gpu_blocks`` real vLLM exports on ``/metrics`` (``vllm:cache_config_info``), less the
    null block: no flag written for another fleet."""
    reported = await server_cache_config([s.url + "/metrics" for s in vllm_fleet.servers])
    want = {s.url: float(blocks - 1) for s, (blocks, _) in zip(vllm_fleet.servers, reported)}
    config = _router_config(vllm_fleet, policy_options={"admission_wait": 0.2})

    async with start_router(config) as router:
        def capacities() -> dict[str, float]:
            return {url: router.metric("kvroute_router_worker_kv_capacity_blocks", worker=url)
                    for url in want}

        await _eventually(lambda: capacities() == want,
                          lambda: f"router: {capacities()}, vLLM: {want}", timeout_s=10)
    print(f"\nrouter read each worker's usable KV blocks from vLLM's /metrics: {want}")


async def test_kv_aware_router_beats_random_on_real_vllm(vllm_fleet, tier_plan, tmp_path):
    plan = tier_plan(topologies=("service", "router"), router_policy="kv-aware")
    servers = vllm_fleet.servers

    async def shared_fleet(workers: int) -> Workers:
        # The session owns the servers: a fleet that launched nothing stops nothing on close(),
        # and names each worker's KV event sockets for the router topology.
        return Workers(urls=[s.url for s in servers],
                     kv_events=[(s.events_endpoint, s.replay_endpoint) for s in servers])

    result = ExperimentResult()
    await run_experiment(plan, shared_fleet, ResultsWriter(tmp_path), SweepHooks(), result)

    by_topology = {p.policy: p for p in result.measured}
    assert set(by_topology) == {"service", "router"}
    (service,) = by_topology["service"].trials
    (router,) = by_topology["router"].trials
    for trial in (service, router):
        assert trial.requests == 40 and trial.failed == 0
    # Every request through the router names its worker; both workers take a share.
    assert sum(router.worker_requests.values()) == 40 and len(router.worker_requests) == 2
    assert router.request_hit_rate > service.request_hit_rate
    predicted = {p.policy: p.median("request_hit_rate") for p in result.predicted}
    print(f"\nsame 40 seeded requests (W=2, K=4, c=2, C = {result.capacity:.2f}): request hit rate "
          f"random (Service) {service.request_hit_rate:.3f} vs kv-aware router "
          f"{router.request_hit_rate:.3f}; token hit rate {service.token_hit_rate:.3f} vs "
          f"{router.token_hit_rate:.3f} (from /metrics {service.metrics_token_hit_rate:.3f} vs "
          f"{router.metrics_token_hit_rate:.3f}); router's requests per worker "
          f"{router.worker_requests}; simulator predicts {predicted}")


async def test_router_chat_hashes_equal_the_blocks_vllm_stored(vllm_fleet):
    bs = vllm_fleet.block_size
    words = np.random.default_rng().integers(0, 10**6, size=200)
    system = {"role": "system", "content": " ".join(f"w{w}" for w in words)}

    def chat(question: str | list[dict]) -> dict:
        return {"model": vllm_fleet.model, "max_tokens": 1,
                "messages": [system, {"role": "user", "content": question}]}

    tokenizer = load_tokenizer(str(vllm_fleet.install.model_dir))
    hasher = BlockHasher(bs)

    def engine_prompt(body: dict) -> list[int]:
        """The chat's tokens as vLLM computes them: content parts joined, template applied."""
        text = tokenizer.apply_chat_template(flatten_message_content(body["messages"]))
        return tokenizer.encode(text, add_special_tokens=False)

    async with _mirrors(vllm_fleet.servers, bs) as mirrors, start_router(_router_config(vllm_fleet)) as router:
        report = []
        previous: list[int] = []
        serving_first = None
        # The second question reuses the system prompt: the router's segment and prefix caches
        # answer for it, and vLLM hits the blocks they share. It comes as OpenAI content parts,
        # which vLLM joins with newlines for this ("string" content format) template.
        questions = (
            "Which of these words is the longest?",
            [{"type": "text", "text": "And which one"}, {"type": "text", "text": "comes first in order?"}],
        )
        for question in questions:
            body = chat(question)
            answer, serving = await _post(router.url, "/v1/chat/completions", body)
            ids = engine_prompt(body)
            block_hashes = hasher.hash_blocks(ids)
            assert answer["usage"]["prompt_tokens"] == len(ids)
            assert len(block_hashes) >= 3, "the prompt should span several blocks"
            await _await_all_stored(router, mirrors[serving], serving, block_hashes)
            shared = 0
            while shared < min(len(previous), len(block_hashes)) and previous[shared] == block_hashes[shared]:
                shared += 1
            if serving_first is None:
                serving_first = serving
            else:
                # Routed to the worker holding the shared system prompt, which hits exactly there.
                assert serving == serving_first
                assert shared >= 1 and _cached_tokens(answer) == shared * bs
            report.append(f"{len(ids)} tokens, {len(block_hashes)} blocks, all stored by "
                          f"vLLM under the engine tokens' hashes, {shared} shared, cached_tokens "
                          f"{_cached_tokens(answer)}")
            previous = block_hashes
    print("\nchat tokenizer path via the router: " + "; ".join(report))
