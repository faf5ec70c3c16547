"""The live router end to end on loopback: proxying (streamed and not) through the openai
client, the x-kvroute-worker header, retries before the first byte only, a worker dying
mid-answer, draining, and client mistakes answered with 4xx (never 500)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest
from aiohttp import web
from support.fake_worker import FakeWorker, ok

from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.router import WORKER_HEADER, RouterConfig, start_router
from kvroute.workers import free_ports

MODEL = "Qwen/Qwen3-0.6B"


def emulator_config(**overrides) -> EmulatorConfig:
    return EmulatorConfig.for_model("qwen3-0.6b", timing="instant", max_model_len=1024, **overrides)


@pytest.fixture
async def workers() -> AsyncIterator[list]:
    running = await start_workers(emulator_config(), 2)
    yield running
    await asyncio.gather(*(w.close() for w in running))


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def refused_url() -> str:
    """A loopback URL nothing listens on (the port was just bound and released)."""
    (port,) = free_ports(1)
    return f"http://127.0.0.1:{port}"


def sse(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


CHUNK = {"id": "c", "object": "text_completion", "created": 0, "model": MODEL,
         "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}


async def test_completion_non_stream_through_openai_client_names_the_worker(workers):
    urls = [w.url for w in workers]
    async with start_router(RouterConfig(workers=urls, policy="round-robin")) as router:
        raw = await client(router.url).completions.with_raw_response.create(
            model=MODEL, prompt=list(range(100, 180)), max_tokens=5
        )
        completion = raw.parse()
        assert raw.headers[WORKER_HEADER] in urls
        assert completion.usage.completion_tokens == 5
        assert completion.usage.prompt_tokens == 80


async def test_streams_pass_through_chunk_by_chunk(workers):
    urls = [w.url for w in workers]
    async with start_router(RouterConfig(workers=urls)) as router:
        c = client(router.url)
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=6,
            stream=True, stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        # The role chunk, one per token (instant timing still yields per step), the usage.
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage.completion_tokens == 6
        assert len(chunks) >= 3
        # Raw stream: the header and the closing [DONE].
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{router.url}/v1/completions",
                              json={"prompt": "a b c", "max_tokens": 3, "stream": True}) as r:
                body = await r.read()
                assert r.headers[WORKER_HEADER] in urls
                assert r.headers["Content-Type"].startswith("text/event-stream")
        assert body.endswith(b"data: [DONE]\n\n")


async def test_load_accounting_returns_to_zero(workers):
    async with start_router(RouterConfig(workers=[w.url for w in workers])) as router:
        c = client(router.url)
        await asyncio.gather(*(
            c.completions.create(model=MODEL, prompt=list(range(i, i + 40)), max_tokens=3, stream=s)
            for i, s in zip(range(6), [True, False] * 3)
        ))
        states = router.worker_statuses().values()
        assert sum(s.in_flight for s in states) == 0
        assert sum(s.in_flight_tokens for s in states) == 0
        assert router.in_flight == 0


async def test_refused_connection_is_retried_on_another_worker(workers):
    dead = refused_url()
    live = workers[0].url
    # round-robin starts with the first worker: the dead one.
    config = RouterConfig(workers=[dead, live], policy="round-robin", health_interval_s=0)
    async with start_router(config) as router:
        raw = await client(router.url).completions.with_raw_response.create(
            model=MODEL, prompt=list(range(50)), max_tokens=2
        )
        assert raw.headers[WORKER_HEADER] == live
        assert router.metric("kvroute_router_retries_total") == 1
        assert not router.worker_statuses()[dead].healthy
        assert router.available_workers() == [live]


async def test_no_worker_accepting_is_a_502_and_none_available_a_503():
    config = RouterConfig(workers=[refused_url()], health_interval_s=0)
    async with start_router(config) as router, aiohttp.ClientSession() as s:
        async with s.post(f"{router.url}/v1/completions", json={"prompt": [1, 2, 3]}) as r:
            assert r.status == 502
            assert "no worker accepted" in (await r.json())["error"]["message"]
        # The refusal took the only worker out.
        async with s.post(f"{router.url}/v1/completions", json={"prompt": [1, 2, 3]}) as r:
            assert r.status == 503
        async with s.get(f"{router.url}/health") as r:
            assert r.status == 503


async def test_worker_dying_mid_stream_ends_with_an_error_event_not_a_truncation():
    async def dies(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(sse(CHUNK))
        await response.write(b'data: {"id": "half-wr')  # then the process dies
        await asyncio.sleep(0.05)
        request.transport.abort()
        return response

    async with FakeWorker(dies) as url, start_router(RouterConfig(workers=[url])) as router:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{router.url}/v1/completions",
                              json={"prompt": [1, 2], "stream": True}) as r:
                assert r.status == 200
                body = await r.read()
        events = [e for e in body.split(b"\n\n") if e]
        # The complete event arrives, the half-written one does not, the error closes it.
        assert len(events) == 2 and events[0] == sse(CHUNK).strip()
        error = json.loads(events[-1].removeprefix(b"data: "))
        assert error["error"]["code"] == 502 and url in error["error"]["message"]
        assert b"[DONE]" not in body
        # The openai client raises on it instead of ending quietly.
        stream = await client(router.url).completions.create(model=MODEL, prompt=[1, 2], stream=True)
        with pytest.raises(openai.APIError):
            async for _ in stream:
                pass


def dies_mid_answer(length: int, sent: bytes):
    """A worker handler that declares a JSON answer of ``length`` bytes, sends ``sent`` of it
    and dies."""
    async def dies(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": str(length)})
        await response.prepare(request)
        await response.write(sent)
        await asyncio.sleep(0.05)
        request.transport.abort()
        return response

    return dies


async def test_worker_dying_mid_body_is_a_502_json():
    async with FakeWorker(dies_mid_answer(500, b'{"id": "cmpl-')) as url, \
            start_router(RouterConfig(workers=[url])) as router:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{router.url}/v1/completions", json={"prompt": [1, 2]}) as r:
                assert r.status == 502
                assert r.headers[WORKER_HEADER] == url
                assert "failed while answering" in (await r.json())["error"]["message"]
        assert router.metric("kvroute_router_retries_total") == 0



def long_answer(size: int) -> bytes:
    """A completion answer of about ``size`` bytes (as logprobs of a long generation make)."""
    return json.dumps({"id": "cmpl-long", "object": "text_completion",
                       "choices": [{"index": 0, "text": "y" * size}]}).encode()


async def test_a_long_whole_answer_is_relayed_exact_with_its_length():
    """An answer longer than the router holds (64 KiB) is relayed as it comes: the client gets
    every byte, framed by Content-Length as the worker's was."""
    answer = long_answer(3 << 20)

    async def long(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    async with FakeWorker(long) as url, start_router(RouterConfig(workers=[url])) as router:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{router.url}/v1/completions", json={"prompt": [1, 2]}) as r:
                assert r.status == 200 and r.headers[WORKER_HEADER] == url
                assert r.headers["Content-Length"] == str(len(answer))
                assert await r.read() == answer


async def test_worker_dying_in_a_long_whole_answer_aborts_the_clients_connection():
    """Past what the router holds, the answer's head is already the client's: a worker dying
    after it leaves the client an answer short of its Content-Length (an error, never a
    quietly truncated answer), counted as the worker's body error, and not retried."""
    async with FakeWorker(dies_mid_answer(1 << 20, b'{"id": "cmpl-' + b"y" * (200 << 10))) as url, \
            start_router(RouterConfig(workers=[url])) as router:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{router.url}/v1/completions", json={"prompt": [1, 2]}) as r:
                assert r.status == 200
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
        assert router.metric("kvroute_router_upstream_errors_total", worker=url, kind="body") == 1
        assert router.metric("kvroute_router_retries_total") == 0


async def test_clients_not_reading_long_answers_do_not_hold_them_in_the_router():
    """16 clients that ask for 16 MB answers and read none of them: the router (its own
    process) holds about a megabyte each, not the answers (256 MB before it relayed them)."""
    answer = long_answer(16 << 20)

    async def long(request: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    def rss_mb(pid: int) -> float:
        with open(f"/proc/{pid}/status") as status:
            kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        return kb / 1024

    async with FakeWorker(long) as url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvroute", "serve", "--port", "0", "--worker", url,
            "--policy", "round-robin", stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        clients: list[asyncio.StreamWriter] = []
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
            host, port = line.split("listening on http://")[1].split(",")[0].rsplit(":", 1)
            before = rss_mb(proc.pid)
            request = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 13\r\n\r\n{\"prompt\": 1}")
            for _ in range(16):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.transport.pause_reading()  # the client reads nothing
                writer.write(request)
                clients.append(writer)
            await asyncio.sleep(2)
            held = rss_mb(proc.pid) - before
            assert held < 64, f"the router grew by {held:.0f} MB"
        finally:
            for writer in clients:
                writer.close()
            proc.terminate()
            await proc.wait()

def slow_stream_worker(chunks: int, delay: float):
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(chunks):
            await asyncio.sleep(delay)
            await response.write(sse(CHUNK))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    return FakeWorker(handler)


async def test_drain_finishes_in_flight_streams_and_refuses_new_requests():
    async with slow_stream_worker(chunks=8, delay=0.05) as url, \
            start_router(RouterConfig(workers=[url])) as router, aiohttp.ClientSession() as s:

        async def stream() -> bytes:
            async with s.post(f"{router.url}/v1/completions", json={"prompt": [1], "stream": True}) as r:
                return await r.read()

        in_flight = asyncio.ensure_future(stream())
        while router.in_flight == 0:
            await asyncio.sleep(0.01)
        drain = asyncio.ensure_future(router.drain(timeout_s=5))
        await asyncio.sleep(0.05)
        async with s.post(f"{router.url}/v1/completions", json={"prompt": [1]}) as r:
            assert r.status == 503
        async with s.get(f"{router.url}/health") as r:
            assert r.status == 503
        assert not drain.done()
        body = await in_flight
        assert body.endswith(b"data: [DONE]\n\n") and body.count(b'"hi"') == 8
        assert await drain is True


@pytest.mark.parametrize(
    "body, content_type, status",
    [
        (b"{not json", "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        (b'{"max_tokens": 3}', "application/json", 400),
        (b'{"prompt": 5}', "application/json", 400),
        (b'{"prompt": [1, "x"]}', "application/json", 400),
        (b'{"prompt": [-1, 2]}', "application/json", 400),
        (b'{"prompt": "\x80"}', "application/json", 400),  # a string that is not UTF-8
        (b'{"prompt": "hi"}', "text/plain", 400),
        (b'{"prompt": "' + b"x" * 5000 + b'"}', "application/json", 413),
    ],
)
async def test_client_mistakes_are_4xx_json(workers, body, content_type, status):
    config = RouterConfig(workers=[workers[0].url], max_body_bytes=4096)
    async with start_router(config) as router, aiohttp.ClientSession() as s:
        async with s.post(f"{router.url}/v1/completions", data=body,
                          headers={"Content-Type": content_type}) as r:
            assert r.status == status
            assert (await r.json())["error"]["code"] == status
        # The router still serves afterwards.
        async with s.post(f"{router.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}) as r:
            assert r.status == 200


async def test_chat_without_messages_is_400_and_unknown_path_404(workers):
    async with start_router(RouterConfig(workers=[workers[0].url])) as router, aiohttp.ClientSession() as s:
        async with s.post(f"{router.url}/v1/chat/completions", json={"messages": "hi"}) as r:
            assert r.status == 400
        async with s.get(f"{router.url}/v1/nothing") as r:
            assert r.status == 404
            assert (await r.json())["error"]["code"] == 404


async def test_worker_errors_pass_through(workers):
    async with start_router(RouterConfig(workers=[workers[0].url])) as router:
        with pytest.raises(openai.NotFoundError):
            await client(router.url).completions.create(model="no-such-model", prompt=[1, 2], max_tokens=1)


async def test_models_health_and_metrics(workers):
    urls = [w.url for w in workers]
    async with start_router(RouterConfig(workers=urls, policy="random", seed=1)) as router, \
            aiohttp.ClientSession() as s:
        models = await client(router.url).models.list()
        assert [m.id for m in models.data] == [MODEL]
        async with s.get(f"{router.url}/health") as r:
            assert r.status == 200
        for _ in range(4):
            await client(router.url).completions.create(model=MODEL, prompt=list(range(40)), max_tokens=1)
        async with s.get(f"{router.url}/metrics") as r:
            text = await r.text()
        decisions = [line for line in text.splitlines() if line.startswith("kvroute_router_decisions_total{")]
        assert sum(float(line.split()[-1]) for line in decisions) == 4
        assert 'policy="random"' in decisions[0]
        assert "kvroute_router_routing_seconds_count 4.0" in text
        assert "kvroute_router_overlap_blocks_count 4.0" in text


async def test_failed_health_check_takes_a_worker_out_and_drops_its_index_entries():
    states = {"ok": True}

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if states["ok"] else 500)

    async with FakeWorker(ok, health) as url, start_router(RouterConfig(workers=[url], health_interval_s=0.05)) as router:
        router.index.record_routed(url, [1, 2, 3], 0.0)
        assert router.index.worker_blocks(url) == 3
        states["ok"] = False
        for _ in range(100):
            if not router.available_workers():
                break
            await asyncio.sleep(0.02)
        assert not router.available_workers()
        assert router.index.worker_blocks(url) == 0
        states["ok"] = True
        for _ in range(100):
            if router.available_workers():
                break
            await asyncio.sleep(0.02)
        assert router.available_workers()
