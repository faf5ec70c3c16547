"""The router under faults: a worker SIGKILLed and restarted mid-run (nothing lost or
duplicated, counted at the workers), KV event streams that drop, corrupt or change shape,
workers that accept and never answer, and SIGTERM while streams are in flight."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time

import aiohttp
import msgspec
import numpy as np
import zmq
import zmq.asyncio
from aiohttp import web
from support.fake_worker import FakeWorker, ok_completion
from support.machine import slowest_answer
from support.paths import ROOT
from support.waiting import until

from kvroute.blocks import BlockHasher
from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.engine.events import BlockStored, EventBatch
from kvroute.kvevents.wire import END_SEQ, encode_batch, encode_seq
from kvroute.router import (
    WORKER_HEADER,
    EventsSettings,
    EventsSource,
    RouterConfig,
    start_router,
)

_PATH = ROOT / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak_bench", _PATH)
soak = importlib.util.module_from_spec(_spec)
sys.modules["soak_bench"] = soak  # dataclasses resolve their module by name
_spec.loader.exec_module(soak)

BS = 16



# --- worker death --------------------------------------------------------------------------


async def test_sigkilled_worker_loses_nothing_and_wins_its_prefixes_back_after_restart():
    """The fast version of ``benchmarks/soak.py worker-death`` (3 workers, 1,000 requests)."""
    result = await soak.run_worker_death(
        requests=1000, concurrency=16, workers=3, prefixes=12, kill_at=0.15, down_s=0.3,
        health_interval_s=0.25,
    )
    soak.print_death(result)
    assert result.outcomes["bad"] == 0, result.bad_details
    assert sum(result.outcomes.values()) == 1000
    # Survivors and the restarted worker: every answer the client got was served exactly once.
    for name, (ok, served) in result.counts.items():
        assert ok == served, name
    first_ok, scraped = result.victim_first_life
    assert first_ok >= scraped
    # The restart was seen (sequence back to 0), its cache rebuilt from events and used.
    assert result.engine_restarts == 1
    assert result.victim_index_blocks > 0
    assert result.first_event_to_kv_hit_s is not None and result.first_event_to_kv_hit_s <= 1.0
    assert result.victim_share_after > 0.05


# --- KV event faults -------------------------------------------------------------------------


class FakePublisher:
    """An engine's KV event sockets, scripted: XPUB (so the test knows when the router has
    subscribed), and a ROUTER replay socket answering from everything "published", including
    batches the test chose not to send live (dropped messages)."""

    def __init__(self, replay: bool = True) -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.replay = None
        self.replay_endpoint = None
        self._task = None
        self._answered = asyncio.Event()
        if replay:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.bind("tcp://127.0.0.1:*")
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.ensure_future(self._serve_replay())

    async def subscribed(self) -> None:
        """The router's SUB socket is connected, and its first replay request (the catch-up
        it asks for on subscribing) answered: what is published from now on arrives live."""
        await asyncio.wait_for(self.pub.recv(), 10)
        if self.replay is not None:
            await asyncio.wait_for(self._answered.wait(), 10)

    async def publish(self, seq: int, payload: bytes, live: bool = True) -> None:
        self.buffer.append((seq, payload))
        if live:
            await self.pub.send_multipart([b"", encode_seq(seq), payload])

    async def send_frames(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.replay.send_multipart([client, b"", b"", encode_seq(seq), payload])
            await self.replay.send_multipart([client, b"", b"", END_SEQ, b""])
            self._answered.set()

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.ctx.destroy(linger=0)


def stored(tokens: list[int], first_engine_hash: int, parent: int | None = None) -> BlockStored:
    n = len(tokens) // BS
    return BlockStored(list(range(first_engine_hash, first_engine_hash + n)), parent, tokens, BS)


def batch(*events, shape: str = "map") -> bytes:
    return encode_batch(EventBatch(time.time(), list(events)), shape)


def overlap(router, tokens: list[int], worker: str) -> int:
    hashes = BlockHasher(BS).hash_blocks(tokens)
    return router.index.overlaps(hashes, [worker], time.monotonic())[0]


def counter(router, metric: str, worker: str) -> float:
    """The router's ``kvroute_router_<metric>_total`` for ``worker``, as ``/metrics`` shows it."""
    return router.metric(f"kvroute_router_{metric}_total", worker=worker)


A = list(range(100, 100 + 2 * BS))
A_MORE = list(range(500, 500 + 2 * BS))
B = list(range(900, 900 + 3 * BS))


async def test_dropped_messages_are_replayed_and_both_wire_shapes_mix():
    publisher = FakePublisher()
    try:
        async with FakeWorker() as url:
            events = EventsSettings(per_worker={url: EventsSource(publisher.endpoint, publisher.replay_endpoint)})
            config = RouterConfig(workers=[url], events=events, predicted_ttl_s=0.0, health_interval_s=0)
            async with start_router(config) as router:
                await publisher.subscribed()
                # seq 0 in the older positional shape, seq 1 (map shape) dropped on the way,
                # seq 2 positional again: the gap is filled from the replay socket.
                await publisher.publish(0, batch(stored(A, 1000), shape="array"))
                await publisher.publish(1, batch(stored(A_MORE, 1002, parent=1001)), live=False)
                await publisher.publish(2, batch(stored(B, 2000), shape="array"))
                await until(lambda: overlap(router, B, url) == 3)
                assert overlap(router, A + A_MORE, url) == 4  # the replayed batch chained onto seq 0
                assert counter(router, "kv_event_gaps", url) == 1
                assert counter(router, "kv_event_replay_failures", url) == 0
                assert counter(router, "kv_events", url) == 3
    finally:
        publisher.close()


async def test_replay_endpoint_down_drops_the_workers_entries_and_predictions_bridge():
    publisher = FakePublisher(replay=False)
    try:
        async with FakeWorker() as url:
            # A replay socket nobody serves: the request times out (1 s) and the gap is lost.
            dead_replay = f"ipc:///tmp/kvroute-no-replay-{os.getpid()}"
            events = EventsSettings(per_worker={url: EventsSource(publisher.endpoint, dead_replay)})
            config = RouterConfig(workers=[url], events=events, predicted_ttl_s=30.0, health_interval_s=0)
            async with start_router(config) as router, aiohttp.ClientSession() as s:
                await publisher.subscribed()
                await publisher.publish(0, batch(stored(A, 1000)))
                await until(lambda: overlap(router, A, url) == 2)
                await publisher.publish(2, batch(stored(B, 2000)))  # seq 1 lost for good
                await until(lambda: counter(router, "kv_event_replay_failures", url) == 1)
                await until(lambda: overlap(router, B, url) == 3)
                # What the worker held before the lost batch is unknown now: dropped.
                assert overlap(router, A, url) == 0
                # Routing keeps working, and its predictions bridge until events return.
                prompt = list(range(3000, 3000 + 4 * BS))
                async with s.post(f"{router.url}/v1/completions", json={"prompt": prompt}) as r:
                    assert r.status == 200 and r.headers[WORKER_HEADER] == url
                assert overlap(router, prompt, url) == 4
                assert router.index.stats().predicted >= 4
    finally:
        publisher.close()


async def test_malformed_payloads_and_unknown_event_types_are_counted_and_skipped():
    publisher = FakePublisher()
    try:
        async with FakeWorker() as url:
            events = EventsSettings(per_worker={url: EventsSource(publisher.endpoint, publisher.replay_endpoint)})
            config = RouterConfig(workers=[url], events=events, predicted_ttl_s=0.0, health_interval_s=0)
            async with start_router(config) as router, aiohttp.ClientSession() as s:
                await publisher.subscribed()
                await publisher.publish(0, batch(stored(A, 1000)))
                await publisher.publish(1, b"\xc1\xc1 not msgpack")
                await publisher.publish(2, msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]))
                await publisher.send_frames([b"", b"short"])  # framing: not [topic, seq, payload]
                # A newer engine's event type inside an otherwise good batch (positional shape).
                good = msgspec.msgpack.decode(batch(stored(B, 2000), shape="array"))
                good[1].insert(0, ["BlockMigrated", [7, 8], "CPU"])
                good[1].append({"type": "CacheResized", "blocks": 99})
                await publisher.publish(3, msgspec.msgpack.encode(good))
                await until(lambda: overlap(router, B, url) == 3)
                assert counter(router, "kv_events_malformed", url) == 3
                assert counter(router, "kv_events_unknown", url) == 2
                # Malformed batches may have stored or removed anything: the worker was reset.
                assert overlap(router, A, url) == 0
                # The subscriber is still running and the router still serves.
                await publisher.publish(4, batch(stored(A, 3000)))
                await until(lambda: overlap(router, A, url) == 2)
                async with s.post(f"{router.url}/v1/completions", json={"prompt": [1, 2, 3]}) as r:
                    assert r.status == 200
                async with s.get(f"{router.url}/metrics") as r:
                    text = await r.text()
                assert f'kvroute_router_kv_events_unknown_total{{worker="{url}"}} 2.0' in text
    finally:
        publisher.close()


# --- slow and stuck workers ------------------------------------------------------------------


class StuckServer:
    """Accepts TCP connections and reads forever, never answering a byte."""

    async def __aenter__(self) -> str:
        self.connections: list[asyncio.StreamWriter] = []

        async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections.append(writer)
            while await reader.read(65536):
                pass

        self.server = await asyncio.start_server(swallow, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{self.port}"

    async def __aexit__(self, *exc) -> None:
        if self.server.is_serving():
            self.server.close()
            for w in self.connections:
                w.transport.abort()
            await self.server.wait_closed()


async def test_a_stuck_worker_costs_at_most_the_first_byte_timeout_and_returns_when_healthy():
    config = EmulatorConfig.for_model("qwen3-0.6b", timing="instant", max_model_len=1024)
    workers = await start_workers(config, 2)
    stuck = StuckServer()
    stuck_url = await stuck.__aenter__()
    revived = None
    try:
        async with aiohttp.ClientSession() as s:
            # The first-byte timeout: 0.3 s, or ten times what a wave of this test's requests
            # takes on this machine now if that is longer (a loaded machine).
            wave = await slowest_answer(s, f"{workers[0].url}/v1/completions",
                                        {"prompt": list(range(40)), "max_tokens": 2}, concurrency=8)
            timeout = max(0.3, 10 * wave)
        router_config = RouterConfig(
            workers=[w.url for w in workers] + [stuck_url], policy="round-robin",
            first_byte_timeout_s=timeout, health_interval_s=timeout * 2 / 3,
            health_timeout_s=timeout * 2 / 3, eject_base_s=timeout * 5 / 3,
        )
        async with start_router(router_config) as router, aiohttp.ClientSession() as s:

            async def timed(i: int) -> tuple[float, int, str]:
                t0 = time.monotonic()
                async with s.post(f"{router.url}/v1/completions",
                                  json={"prompt": list(range(i, i + 40)), "max_tokens": 2}) as r:
                    await r.read()
                    return time.monotonic() - t0, r.status, r.headers.get(WORKER_HEADER, "")

            results = []
            for wave in range(10):
                results += await asyncio.gather(*(timed(wave * 8 + i) for i in range(8)))
            latencies = np.array([r[0] for r in results])
            print(f"\nstuck worker, round-robin, first-byte timeout {timeout:.2f} s: latency p50 "
                  f"{np.median(latencies) * 1e3:.0f} ms, p99 {np.percentile(latencies, 99) * 1e3:.0f} ms, "
                  f"max {latencies.max() * 1e3:.0f} ms, retries {router.metric('kvroute_router_retries_total'):.0f}")
            assert all(status == 200 for _, status, _ in results)
            assert stuck_url not in {w for _, _, w in results}
            # Only requests first sent to the stuck worker waited, never much past the
            # timeout, and the timeouts plus the failing health check took it out.
            assert router.metric("kvroute_router_retries_total") >= 1
            assert np.percentile(latencies, 99) < timeout * 8 / 3
            # Most requests never waited for the timeout (a bound on the router's own latency
            # would measure the machine's load, not the ejection).
            assert np.median(latencies) < timeout
            assert stuck_url not in router.available_workers()
            # It comes back healthy on the same port: it rejoins and gets requests again.
            await stuck.__aexit__()
            (revived,) = await start_workers(config, 1, base_port=stuck.port)
            await until(lambda: stuck_url in router.available_workers())
            served = {(await timed(1000 + i))[2] for i in range(6)}
            assert stuck_url in served
    finally:
        await stuck.__aexit__()
        await asyncio.gather(*(w.close() for w in workers + ([revived] if revived else [])))


async def test_hanging_generations_eject_a_worker_whose_health_check_passes():
    """/health answers but generations hang (a wedged engine behind a live API server): the
    health check would bring it straight back, so ejection holds it out for its period."""
    release = asyncio.Event()

    async def hangs(request: web.Request) -> web.Response:
        await request.read()
        await release.wait()
        return await ok_completion(request)

    async with FakeWorker(hangs) as wedged, FakeWorker() as good, aiohttp.ClientSession() as s:
        # Every wait below is in units of the first-byte timeout: 0.1 s, or ten times what a
        # request to the good worker takes on this machine now if that is longer (a loaded
        # machine, where the good worker's answers must still come in time).
        unit = max(0.1, 10 * await slowest_answer(s, f"{good}/v1/completions", {"prompt": [1, 2, 3]}))
        config = RouterConfig(
            workers=[wedged, good], policy="round-robin", first_byte_timeout_s=unit,
            health_interval_s=unit / 2, eject_after_failures=2, eject_base_s=10 * unit,
        )
        async with start_router(config) as router:

            async def send() -> str:
                async with s.post(f"{router.url}/v1/completions", json={"prompt": [1, 2, 3]}) as r:
                    assert r.status == 200
                    return r.headers[WORKER_HEADER]

            # Two first-byte timeouts eject it: not before two units from here.
            before_ejection = time.monotonic() + 2 * unit
            for _ in range(4):
                assert await send() == good
            assert counter(router, "ejections", wedged) == 1

            def names() -> list[str]:
                return router.available_workers()

            await asyncio.sleep(5 * unit)  # ten passing health checks later: still out
            assert wedged not in names()
            release.set()  # the engine recovers
            await until(lambda: wedged in names(), timeout=max(5.0, 20 * unit))
            assert time.monotonic() - before_ejection >= 10 * unit
            assert {await send() for _ in range(4)} == {wedged, good}


# --- graceful shutdown -----------------------------------------------------------------------


async def test_sigterm_finishes_streams_refuses_new_requests_with_503_and_exits():
    async def slow_stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(12):
            await asyncio.sleep(0.05)
            await response.write(b'data: {"n": %d}\n\n' % i)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async with FakeWorker(slow_stream) as url:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvroute", "serve", "--port", "0", "--worker", url,
            "--policy", "round-robin", stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        )
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            router_url = line.split("listening on ")[1].split(",")[0]
            async with aiohttp.ClientSession() as s:

                async def stream() -> bytes:
                    async with s.post(f"{router_url}/v1/completions", json={"prompt": [1], "stream": True}) as r:
                        return await r.read()

                streams = [asyncio.ensure_future(stream()) for _ in range(3)]
                await asyncio.sleep(0.2)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.15)
                async with s.post(f"{router_url}/v1/completions", json={"prompt": [1]}) as r:
                    assert r.status == 503
                    assert (await r.json())["error"]["code"] == 503
                async with s.get(f"{router_url}/health") as r:
                    assert r.status == 503
                bodies = await asyncio.gather(*streams)
            assert all(b.endswith(b"data: [DONE]\n\n") and b.count(b'"n"') == 12 for b in bodies)
            assert await asyncio.wait_for(proc.wait(), 15) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
