"""The router's index fed by emulated workers' KV events: kv-aware routing follows the events,
evictions remove blocks, and each stream condition acts on the index as documented (the
router's native event consumer against pyzmq sockets)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import zmq
import zmq.asyncio
from support.kv_events import EVENTS, events_for
from support.waiting import until

from kvroute.blocks import BlockHasher
from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.engine import BlockStored
from kvroute.engine.events import EventBatch
from kvroute.kvevents.wire import END_SEQ, encode_batch, encode_seq
from kvroute.router import WORKER_HEADER, EventsSettings, EventsSource, RouterConfig, start_router

BS = 16



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
            names = list(router.worker_statuses())
            await until(lambda: router.index.overlaps(hashes, names, time.monotonic())[names.index(owner)] == 10)
            for i in range(5):
                assert await complete(s, router.url, prefix + [20 + i] * 5) == owner
            # A prompt sharing nothing is free to go elsewhere (the emptiest cache wins ties).
            assert await complete(s, router.url, list(range(5000, 5000 + 4 * BS))) != owner
            assert router.metric("kvroute_router_kv_events_total", worker=owner) > 0
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
                names = list(router.worker_statuses())
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


class ScriptedEngine:
    """An engine's KV event sockets, driven by hand: XPUB (the test knows when the router has
    subscribed) and a ROUTER replay socket answering from ``buffer`` (seq -> payload), in
    current vLLM's framing. A pyzmq (libzmq) peer, as vLLM's and the emulator's are."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind("tcp://127.0.0.1:*")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, bytes] = {}
        self.answered = asyncio.Event()
        self.task = asyncio.ensure_future(self.serve_replay())

    async def subscribed(self) -> None:
        """Subscribed, and the catch-up replay answered: what is sent now arrives live."""
        assert (await asyncio.wait_for(self.pub.recv(), 5.0))[0] == 1
        await asyncio.wait_for(self.answered.wait(), 5.0)

    async def send(self, seq: int, payload: bytes, live: bool = True) -> None:
        self.buffer[seq] = payload
        if live:
            await self.pub.send_multipart([b"", encode_seq(seq), payload])

    async def serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq in sorted(s for s in self.buffer if s >= int.from_bytes(start, "big")):
                await self.router.send_multipart([client, b"", b"", encode_seq(seq), self.buffer[seq]])
            await self.router.send_multipart([client, b"", b"", END_SEQ, b""])
            self.answered.set()

    def close(self) -> None:
        self.task.cancel()
        self.ctx.destroy(linger=0)


def stored_batch(tokens: list[int], first_hash: int, parent: int | None = None) -> bytes:
    n = len(tokens) // BS
    return encode_batch(EventBatch(0.0, [BlockStored(list(range(first_hash, first_hash + n)), parent, tokens, BS)]))


A = list(range(100, 100 + 2 * BS))
B = list(range(500, 500 + 2 * BS))
C = list(range(900, 900 + 3 * BS))


@pytest.mark.parametrize(
    "condition, counter, resets",
    [
        ("in-order", "kv_events", False),
        ("gap-filled", "kv_event_gaps", False),
        ("replay-failed", "kv_event_replay_failures", True),
        ("restart", "engine_restarts", True),
        ("malformed", "kv_events_malformed", True),
    ],
)
async def test_each_stream_condition_acts_on_the_index(condition, counter, resets):
    """The router's native consumer against a pyzmq engine: batches reach the index; a gap is
    filled by replay; a replay that cannot fill it, a restart and a malformed batch reset the
    worker (what it held before is unknown), and each is counted under its metric."""
    engine = ScriptedEngine()
    url = "http://127.0.0.1:9"
    events = EventsSettings(per_worker={url: EventsSource(engine.endpoint, engine.replay_endpoint)})
    config = RouterConfig(workers=[url], events=events, health_interval_s=0)
    hasher = BlockHasher(BS)
    try:
        async with start_router(config) as router:

            def held(tokens: list[int]) -> int:
                return router.index.overlaps(hasher.hash_blocks(tokens), [url], time.monotonic())[0]

            await engine.subscribed()
            await engine.send(0, stored_batch(A, 1000))
            await until(lambda: held(A) == 2)
            if condition == "gap-filled":
                await engine.send(1, stored_batch(B, 2000), live=False)  # dropped on the way
                await engine.send(2, stored_batch(C, 3000))
            elif condition == "replay-failed":
                await engine.send(2, stored_batch(C, 3000))  # 1 is in no buffer: lost for good
            elif condition == "restart":
                await engine.send(0, stored_batch(C, 3000))  # a new engine counting from 0 again
            elif condition == "malformed":
                await engine.send(1, b"\xc1 not msgpack")
                await engine.send(2, stored_batch(C, 3000))
            if condition != "in-order":
                await until(lambda: held(C) == 3)
            assert held(A) == (0 if resets else 2)
            if condition == "gap-filled":
                assert held(B) == 2
            await until(lambda: router.metric(f"kvroute_router_{counter}_total", worker=url) == 1)
    finally:
        engine.close()
