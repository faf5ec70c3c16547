"""The router's index fed by emulated workers' KV events: kv-aware routing follows the events,
evictions remove blocks, and each subscriber condition acts on the index as documented."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from kvroute.blocks import BlockHasher
from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.engine import BlockStored
from kvroute.engine.events import EventBatch
from kvroute.kvevents import EngineRestarted, EventsReceived, GapDetected, MalformedPayload, ReplayFailed
from kvroute.kvevents.wire import decode_native, encode_batch
from kvroute.proxy import WORKER_HEADER, EventsSettings, EventsSource, RouterConfig, start_router
from kvroute.proxy.metrics import RouterMetrics
from kvroute.proxy.pool import WorkerPool

BS = 16
EVENTS = json.dumps({
    "enable_kv_cache_events": True, "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
})


def events_for(workers) -> EventsSettings:
    return EventsSettings(per_worker={
        w.url: EventsSource(w.kv_events_endpoint, w.kv_events_replay_endpoint) for w in workers
    })


async def until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int = 1) -> str:
    async with session.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers[WORKER_HEADER]


async def test_kv_aware_sends_a_repeated_prefix_where_the_events_put_it():
    config = EmulatorConfig.for_model("qwen3-0.6b", timing="instant", max_model_len=1024, kv_events_config=EVENTS)
    workers = await start_workers(config, 3)
    try:
        # TTL 0: predicted entries never count, so only the events can steer the requests.
        router_config = RouterConfig(
            workers=[w.url for w in workers], events=events_for(workers), predicted_ttl_s=0.0
        )
        async with start_router(router_config) as router, aiohttp.ClientSession() as s:
            await asyncio.sleep(0.2)  # let the SUB sockets connect
            prefix = list(range(1000, 1000 + 10 * BS))
            hashes = BlockHasher(BS).hash_blocks(prefix)
            owner = await complete(s, router.url, prefix + [7, 8, 9])
            names = list(router.pool.workers)
            await until(lambda: router.index.overlaps(hashes, names, time.monotonic())[names.index(owner)] == 10)
            for i in range(5):
                assert await complete(s, router.url, prefix + [20 + i] * 5) == owner
            # A prompt sharing nothing is free to go elsewhere (the emptiest cache wins ties).
            assert await complete(s, router.url, list(range(5000, 5000 + 4 * BS))) != owner
            assert router.metrics.events.labels(owner)._value.get() > 0
    finally:
        await asyncio.gather(*(w.close() for w in workers))


async def test_a_router_started_beside_idle_workers_knows_their_caches_at_once():
    """Restart the router after a worker cached a prefix: the replay at subscription tells
    the index, with no new event from the (idle) worker, and the prefix goes to its owner."""
    config = EmulatorConfig.for_model("qwen3-0.6b", timing="instant", max_model_len=1024, kv_events_config=EVENTS)
    workers = await start_workers(config, 3)
    try:
        prefix = list(range(1000, 1000 + 10 * BS))
        hashes = BlockHasher(BS).hash_blocks(prefix)
        async with aiohttp.ClientSession() as s:
            direct = {"prompt": prefix + [7, 8, 9], "max_tokens": 1}
            async with s.post(f"{workers[2].url}/v1/completions", json=direct) as r:  # no router yet
                assert r.status == 200
            router_config = RouterConfig(
                workers=[w.url for w in workers], events=events_for(workers), predicted_ttl_s=0.0
            )
            async with start_router(router_config) as router:
                names = list(router.pool.workers)
                await until(lambda: router.index.overlaps(hashes, names, time.monotonic()) == [0, 0, 10])
                assert await complete(s, router.url, prefix + [20] * 5) == workers[2].url
    finally:
        await asyncio.gather(*(w.close() for w in workers))


async def test_index_holds_reported_blocks_and_evictions_remove_them():
    # 12 blocks (11 usable): a second and third distinct prompt evict the first one's blocks.
    config = EmulatorConfig.for_model(
        "qwen3-0.6b", timing="instant", max_model_len=128, num_gpu_blocks_override=12, kv_events_config=EVENTS
    )
    (worker,) = await start_workers(config, 1)
    try:
        router_config = RouterConfig(workers=[worker.url], events=events_for([worker]), predicted_ttl_s=0.0)
        async with start_router(router_config) as router, aiohttp.ClientSession() as s:
            await asyncio.sleep(0.2)
            hasher = BlockHasher(BS)
            prompts = [list(range(base, base + 6 * BS)) for base in (100, 300, 500)]
            first = hasher.hash_blocks(prompts[0])

            def held() -> int:
                return router.index.overlaps(first, [worker.url], time.monotonic())[0]

            await complete(s, router.url, prompts[0])
            await until(lambda: held() == 6)
            for prompt in prompts[1:]:
                await complete(s, router.url, prompt)
            await until(lambda: held() < 6)
            last = hasher.hash_blocks(prompts[-1])
            await until(lambda: router.index.overlaps(last, [worker.url], time.monotonic())[0] == 6)
            assert router.index.stats().blocks <= 11
            async with s.get(f"{router.url}/metrics") as r:
                text = await r.text()
            assert f'kvroute_router_kv_events_total{{worker="{worker.url}"}}' in text
    finally:
        await worker.close()


async def test_predicted_mode_keeps_a_prefix_on_one_worker_without_events():
    config = EmulatorConfig.for_model("qwen3-0.6b", timing="instant", max_model_len=1024)
    workers = await start_workers(config, 3)
    try:
        async with start_router(RouterConfig(workers=[w.url for w in workers])) as router, \
                aiohttp.ClientSession() as s:
            prefix = list(range(2000, 2000 + 8 * BS))
            chosen = {await complete(s, router.url, prefix + [i] * 3) for i in range(6)}
            assert len(chosen) == 1
            assert router.index.stats().blocks == 0  # nothing event-backed
    finally:
        await asyncio.gather(*(w.close() for w in workers))


def native_batch(events, ts: float = 0.0):
    """The batch a native subscriber yields for these events (encoded as vLLM would)."""
    return decode_native(encode_batch(EventBatch(ts, events)))


class RecordingIndex:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def apply_native(self, worker, batch):
        self.calls.append(("apply", worker, len(batch)))

    def reset_worker(self, worker):
        self.calls.append(("reset", worker))

    def remove_worker(self, worker):
        self.calls.append(("remove", worker))


@pytest.mark.parametrize(
    "item, expected, counter",
    [
        (EventsReceived(0, native_batch([BlockStored([1], None, list(range(16)), 16)])), ("apply", "w", 1), "events"),
        (GapDetected(3, 9), None, "event_gaps"),
        (ReplayFailed(3, 9, "buffer starts at 5"), ("reset", "w"), "replay_failures"),
        (EngineRestarted(41, 0), ("reset", "w"), "engine_restarts"),
        (MalformedPayload(4, "bad msgpack"), ("reset", "w"), "events_malformed"),
    ],
)
async def test_subscriber_conditions_act_on_the_index(item, expected, counter):
    from kvroute.proxy.discovery import Endpoint

    index = RecordingIndex()
    metrics = RouterMetrics()
    async with aiohttp.ClientSession() as session:
        pool = WorkerPool(index, metrics, session, EventsSettings(), "kv-aware", health_interval_s=0)
        pool.update([Endpoint("http://127.0.0.1:9", "w")])
        pool._on_event_item(pool.workers["w"], item)
    assert index.calls == ([expected] if expected else [])
    assert getattr(metrics, counter).labels("w")._value.get() == 1
