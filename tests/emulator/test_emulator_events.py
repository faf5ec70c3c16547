"""The emulator's KV cache events, read off the wire with plain ZeroMQ sockets as a router
would read a real vLLM's: BlockStored with token ids, BlockRemoved on eviction,
AllBlocksCleared on reset, replay, both wire formats, and seq restarting at 0 with the process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvroute.emulator import EmulatorConfig, RunningWorker, start_workers
from kvroute.engine import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.kvevents import decode_batch
from kvroute.workers import free_ports

BS = 16
EPHEMERAL = "tcp://127.0.0.1:*"
TOPIC = "kv-events"


def events_config(endpoint: str = EPHEMERAL, replay: str | None = EPHEMERAL) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": endpoint,
            "replay_endpoint": replay,
            "topic": TOPIC,
        }
    )


class Subscriber:
    """A SUB socket collecting ``(seq, DecodedBatch, raw payload)``.

    PUB/SUB drops whatever is published before the connection's handshake is done (and the
    subscription has travelled), so tests wait for :meth:`connected` before sending work.
    """

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, bind: bool = False) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
        self.monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        (self.sock.bind if bind else self.sock.connect)(endpoint)

    async def connected(self, timeout: float = 5.0) -> None:
        """Wait for the next completed handshake with a publisher."""
        frames = await asyncio.wait_for(self.monitor.recv_multipart(), timeout)
        assert parse_monitor_message(frames)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        # The subscription goes out right after the handshake; give it a moment to land.
        await asyncio.sleep(0.05)

    async def next(self, timeout: float = 3.0):
        topic, seq, payload = await asyncio.wait_for(self.sock.recv_multipart(), timeout)
        assert topic == TOPIC.encode()
        assert len(seq) == 8
        return int.from_bytes(seq, "big"), decode_batch(payload), payload

    async def until(self, predicate, timeout: float = 3.0) -> list:
        """Batches received until one has an event matching ``predicate`` (inclusive)."""
        got = []
        deadline = time.monotonic() + timeout
        while True:
            item = await self.next(max(deadline - time.monotonic(), 0.01))
            got.append(item)
            if any(predicate(e) for e in item[1].events):
                return got

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close()
        self.sock.close()


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


async def _start(blocks: int | None = None, wire_format: str = "map") -> RunningWorker:
    config = EmulatorConfig.for_model(
        "qwen3-0.6b",
        timing="instant",
        max_model_len=256,
        num_gpu_blocks_override=blocks,
        kv_events_config=events_config(),
        kv_events_wire_format=wire_format,
    )
    (worker,) = await start_workers(config, 1)
    return worker


async def _complete(url: str, prompt: list[int], max_tokens: int = 1) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


async def _subscribe(zctx, worker: RunningWorker) -> Subscriber:
    sub = Subscriber(zctx, worker.kv_events_endpoint)
    await sub.connected()
    return sub


def _ids(rng, n: int) -> list[int]:
    return rng.integers(1000, 8000, size=n).tolist()


async def test_block_stored_carries_token_ids_in_chain_order(zctx):
    worker = await _start()
    sub = await _subscribe(zctx, worker)
    try:
        rng = np.random.default_rng(1)
        prompt = _ids(rng, 3 * BS + 5)
        max_tokens = 20
        await _complete(worker.url, prompt, max_tokens)
        output = worker.worker.textgen.tokens(prompt, max_tokens).tolist()
        # Prompt + output = 73 tokens; the last generated token is never computed, so 72 have
        # KV and 4 blocks fill: 3 at prefill, the 4th during decoding.
        stored: list[BlockStored] = []
        while sum(len(e.block_hashes) for e in stored) < 4:
            _, batch, _ = await sub.next()
            stored += [e for e in batch.events if isinstance(e, BlockStored)]
        assert [len(e.block_hashes) for e in stored] == [3, 1]
        first, second = stored
        assert first.parent_block_hash is None
        assert second.parent_block_hash == first.block_hashes[-1]
        assert all(e.block_size == BS for e in stored)
        assert first.token_ids == prompt[: 3 * BS]
        assert second.token_ids == (prompt + output)[3 * BS : 4 * BS]
        assert len(set(first.block_hashes + second.block_hashes)) == 4
    finally:
        sub.close()
        await worker.close()


async def test_eviction_publishes_block_removed_for_stored_blocks(zctx):
    # 20 blocks, 19 usable. The first prompt takes 10; freed, they queue behind the 9 never
    # used, so a second prompt of 12 blocks reuses (evicts) two of them, tail first.
    worker = await _start(blocks=20)
    sub = await _subscribe(zctx, worker)
    try:
        rng = np.random.default_rng(2)
        first = _ids(rng, 10 * BS - 1)  # 9 full blocks cached, + 1 partial
        await _complete(worker.url, first)
        await _complete(worker.url, _ids(rng, 12 * BS - 1))
        got = await sub.until(lambda e: isinstance(e, BlockRemoved))
        events = [e for _, batch, _ in got for e in batch.events]
        stored_first = events[0]
        assert isinstance(stored_first, BlockStored) and stored_first.token_ids == first[: 9 * BS]
        removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert removed == stored_first.block_hashes[-1:-3:-1]
    finally:
        sub.close()
        await worker.close()


async def test_reset_prefix_cache_publishes_all_blocks_cleared(zctx):
    worker = await _start()
    sub = await _subscribe(zctx, worker)
    try:
        await _complete(worker.url, _ids(np.random.default_rng(3), 2 * BS + 1))
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{worker.url}/reset_prefix_cache") as r:
                assert r.status == 200
        got = await sub.until(lambda e: isinstance(e, AllBlocksCleared))
        assert isinstance(got[-1][1].events[-1], AllBlocksCleared)
        assert not worker.worker.engine.pool.cached
    finally:
        sub.close()
        await worker.close()


async def test_replay_returns_buffered_batches_then_end_marker(zctx):
    worker = await _start()
    sub = await _subscribe(zctx, worker)
    try:
        rng = np.random.default_rng(4)
        for _ in range(3):
            await _complete(worker.url, _ids(rng, 2 * BS + 3))
        live = [await sub.next() for _ in range(3)]
        assert [seq for seq, _, _ in live] == [0, 1, 2]

        dealer = zctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(worker.kv_events_replay_endpoint)
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replayed = []
        while True:
            empty, *frames = await asyncio.wait_for(dealer.recv_multipart(), 3)
            assert empty == b""
            if len(frames) == 2:  # older vLLM: [seq, payload] without the topic
                frames = [TOPIC.encode(), *frames]
            _, seq, payload = frames
            if int.from_bytes(seq, "big", signed=True) == -1:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        dealer.close()
        assert replayed == [(seq, payload) for seq, _, payload in live[1:]]
    finally:
        sub.close()
        await worker.close()


async def test_array_wire_format_sends_positional_events(zctx):
    worker = await _start(wire_format="array")
    sub = await _subscribe(zctx, worker)
    try:
        prompt = _ids(np.random.default_rng(5), 2 * BS)
        await _complete(worker.url, prompt)
        _, batch, payload = await sub.next()
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3
        assert isinstance(raw[1][0], list) and raw[1][0][0] == "BlockStored"
        assert batch.events[0].token_ids == prompt
    finally:
        sub.close()
        await worker.close()


# -- the process ------------------------------------------------------------------------------


def _launch(http_port: int, events: str, replay: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "kvroute", "emulate", "--port", str(http_port), "--timing", "instant",
        "--max-model-len", "512", "--kv-events-config", events_config(events, replay),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return proc


async def _wait_ready(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 20
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            try:
                async with s.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("emulator did not become healthy")


async def test_killed_and_restarted_worker_restarts_seq_at_0(zctx):
    http_port, events_port, replay_port = free_ports(3)
    url = f"http://127.0.0.1:{http_port}"
    # An explicit host makes the publisher connect (vLLM's rule), so this subscriber binds
    # once and sees both lives of the worker.
    endpoint = f"tcp://127.0.0.1:{events_port}"
    sub = Subscriber(zctx, endpoint, bind=True)
    rng = np.random.default_rng(6)
    procs = []
    try:
        seqs_per_life = []
        for life in range(2):
            proc = _launch(http_port, endpoint, f"tcp://127.0.0.1:{replay_port}")
            procs.append(proc)
            await _wait_ready(proc, url)
            await sub.connected()
            # The first batches may still be dropped while the subscription travels to the
            # publisher, so each request's batch is recognized by its tokens: the batch of
            # the k-th request this process served must carry seq k.
            received = []
            for k in range(50):
                prompt = _ids(rng, 2 * BS + 1)
                await _complete(url, prompt)
                try:
                    seq, batch, _ = await sub.next(timeout=0.5)
                except TimeoutError:
                    continue
                assert batch.events[0].token_ids == prompt[: 2 * BS]
                received.append((k, seq))
                if len(received) == 3:
                    break
            assert len(received) == 3
            assert all(k == seq for k, seq in received), received
            seqs_per_life.append([seq for _, seq in received])
            if life == 0:
                proc.kill()
                proc.wait(timeout=5)
        # The new process counts from 0 again, below where the old one had got to.
        assert seqs_per_life[1][0] <= seqs_per_life[0][-1]

        # SIGTERM stops cleanly: exit status 0, ports released.
        procs[-1].send_signal(signal.SIGTERM)
        assert procs[-1].wait(timeout=10) == 0
        assert "stopped" in procs[-1].stderr.read()
        with socket.socket() as s:
            s.bind(("127.0.0.1", http_port))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        sub.close()
