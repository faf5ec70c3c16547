"""The router's HTTP edges that cost or save round trips: ``Expect: 100-continue`` is
answered before the body is sent, and a streamed answer relays whole whatever its packets."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from kvroute.router import WORKER_HEADER, RouterConfig, start_router


async def _ok(request: web.Request) -> web.Response:
    return web.Response()


async def test_expect_100_continue_is_answered_before_the_body() -> None:
    async with start_router(RouterConfig(workers=["http://127.0.0.1:9"], health_interval_s=0)) as router:
        host, port = router.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps({"model": "m", "prompt": "hello"}).encode()
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        await writer.drain()
        # curl waits a second for this line before sending the body anyway.
        line = await asyncio.wait_for(reader.readline(), 0.5)
        assert line == b"HTTP/1.1 100 Continue\r\n"
        writer.close()


def worker_app(handler) -> web.Application:
    """A worker whose /v1/completions is ``handler`` (and whose /health answers)."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    app.router.add_get("/health", _ok)
    return app


#: A streamed completion request, by token ids (no tokenizer needed).
STREAM_BODY = {"model": "m", "prompt": [1, 2, 3], "stream": True}


@contextlib.asynccontextmanager
async def router_in_front_of(serve_app, handler, **config) -> AsyncIterator:
    """A router (health checks off, ``config`` on top) in front of one worker whose
    /v1/completions is ``handler``."""
    async with (
        serve_app(worker_app(handler)) as worker,
        start_router(RouterConfig(workers=[worker], health_interval_s=0, **config)) as router,
    ):
        yield router


async def test_streams_relay_every_event_however_the_worker_splits_them(serve_app) -> None:
    events = [b'data: {"n": %d}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(0.05)  # headers alone first: the router holds them for the first event
        await response.write(events[0][:7])  # half an event
        await asyncio.sleep(0.01)
        await response.write(events[0][7:] + events[1])
        for event in events[2:-1]:
            await response.write(event)
        await response.write_eof(events[-1])  # the last event with the end of the stream
        return response

    async with (
        router_in_front_of(serve_app, handler) as router,
        aiohttp.ClientSession() as session,
        session.post(router.url + "/v1/completions", json=STREAM_BODY) as response,
    ):
        assert response.status == 200
        assert response.headers[WORKER_HEADER]
        assert await response.read() == b"".join(events)


async def test_a_client_leaving_mid_stream_is_counted_not_logged_as_an_error(caplog, serve_app) -> None:
    """A bench closes once it has read ``[DONE]``, a user closes a tab: the router's next
    write finds the connection gone. It must end the relay quietly (no 'Error handling
    request' traceback), count it, and drop the worker's stream."""
    worker_cut = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(200):
                await response.write(b'data: {"n": %d}\n\n' % i)
                await asyncio.sleep(0.01)
            await response.write_eof(b"data: [DONE]\n\n")
        except ConnectionResetError:
            worker_cut.set()
        return response

    async with serve_app(worker_app(handler)) as worker:
        async with start_router(RouterConfig(workers=[worker], health_interval_s=0)) as router:
            host, port = router.url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            body = json.dumps({"model": "m", "prompt": [1, 2, 3], "stream": True}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200")
            name = next(line.split(b": ", 1)[1].decode() for line in head.split(b"\r\n")
                        if line.lower().startswith(WORKER_HEADER.encode()))
            assert b'"n": 0' in await reader.readuntil(b"\n\n")
            writer.close()  # gone after the first event
            await asyncio.wait_for(worker_cut.wait(), 5)
            assert router.metric("kvroute_router_client_disconnects_total", worker=name) == 1
    # (Only the router's and aiohttp's own records: an earlier test's client may be collected
    # here and log its own complaint.)
    errors = [r for r in caplog.records if r.levelname == "ERROR" and r.name.startswith(("aiohttp", "kvroute"))]
    assert not errors, caplog.text


async def test_a_worker_silent_mid_stream_ends_it_with_an_error_event_and_a_strike(serve_app) -> None:
    """Past ``stream_idle_timeout_s`` without a byte, the client gets what was relayed, then an
    error event instead of a hang, and the worker a strike towards ejection."""
    release = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"n": 0}\n\n')
        await release.wait()  # then nothing: a wedged engine
        return response

    async with (
        router_in_front_of(serve_app, handler, stream_idle_timeout_s=0.3) as router,
        aiohttp.ClientSession() as session,
    ):
        started = asyncio.get_running_loop().time()
        async with session.post(router.url + "/v1/completions", json=STREAM_BODY) as response:
            text = (await asyncio.wait_for(response.read(), 5.0)).decode()
        waited = asyncio.get_running_loop().time() - started
        release.set()
        name = response.headers[WORKER_HEADER]
        assert router.metric("kvroute_router_upstream_errors_total", worker=name, kind="stream") == 1
        assert router.worker_statuses()[name].consecutive_failures == 1
    assert text.startswith('data: {"n": 0}\n\n')
    error = json.loads(text.split("\n\n")[1].removeprefix("data: "))["error"]
    assert "silent for 0.3s" in error["message"] and error["type"] == "UpstreamError"
    assert text.count("\n\n") == 2  # the relayed event, then the error event
    assert 0.3 <= waited < 2.0


async def test_a_client_slow_to_read_is_not_a_silent_worker(serve_app) -> None:
    """Only waits for the worker count towards the idle timeout: while the client leaves the
    relayed bytes unread (the router blocked writing them), the stream must not time out."""
    chunk = b"data: " + b"x" * (64 * 1024) + b"\n\n"
    chunks = 400  # ~26 MB: more than the loopback socket buffers hold

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(chunks):
            await response.write(chunk)
        await response.write_eof(b"data: [DONE]\n\n")
        return response

    async with (
        router_in_front_of(serve_app, handler, stream_idle_timeout_s=0.2) as router,
        aiohttp.ClientSession() as session,
        session.post(router.url + "/v1/completions", json=STREAM_BODY) as response,
    ):
        await asyncio.sleep(1.0)  # read nothing: the buffers fill, the router's writes wait
        data = await response.read()
    assert len(data) == chunks * len(chunk) + len(b"data: [DONE]\n\n")
    assert b"failed mid-stream" not in data
