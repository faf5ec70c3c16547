"""The router's bounded defaults against slow and hostile clients (``crates/kvroute-serve``'s edge):
head and body timeouts, the connection limit's 503, body limits checked before reading, no
decompression, bounded JSON depth, byte-bounded prompt caches, health checks that never
follow redirects, stream timeouts on by default. Servers on 127.0.0.1, ephemeral ports."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import subprocess
import sys
import time
import zlib

import aiohttp
import pytest
from aiohttp import web

from kvroute._native import DEFAULT_MAX_BODY_BYTES
from kvroute.router import RouterConfig, start_router
from kvroute.router.config import DEFAULT_FIRST_BYTE_TIMEOUT_S, DEFAULT_STREAM_IDLE_TIMEOUT_S
from kvroute.router.resources import default_max_connections


async def _worker(app_routes=None) -> tuple[web.AppRunner, str, list[bytes]]:
    """A fake worker: ``app_routes`` (method, path, handler) first, so they take the place of
    its own completions and health routes."""
    seen: list[bytes] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.json_response({"id": "x", "choices": []})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application(client_max_size=2**30)
    for method, path, handler in app_routes or ():
        app.router.add_route(method, path, handler)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", seen


async def _raw(url: str, data: bytes, read_timeout: float = 5.0) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), read_timeout)
    finally:
        writer.close()


def _post(path: bytes, body: bytes, *headers: bytes) -> bytes:
    head = [b"POST " + path + b" HTTP/1.1", b"Host: r", b"Connection: close", b"Content-Type: application/json",
            b"Content-Length: " + str(len(body)).encode(), *headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0


async def test_a_slow_head_is_closed_after_the_header_timeout_and_counted():
    runner, url, _ = await _worker()
    try:
        config = RouterConfig(workers=[url], health_interval_s=0, header_timeout_s=0.3)
        async with start_router(config) as router:
            host, port = router.url.removeprefix("http://").rsplit(":", 1)
            started = time.monotonic()
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n")  # never finished
            answer = await asyncio.wait_for(reader.read(), 5)
            held = time.monotonic() - started
            writer.close()
            assert _status(answer) == 408 and 0.25 < held < 2
            # A silent connection is closed too (no answer: it sent nothing).
            reader, writer = await asyncio.open_connection(host, int(port))
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            # A kept-alive connection: served, then its next head is timed from its first byte.
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.4)  # idle past the head timeout: fine (keep-alive covers it)
            writer.write(b"GET /hea")
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            assert _status(answer) == 408
            assert router.metric("kvroute_router_client_timeouts_total", kind="header") == 3
    finally:
        await runner.cleanup()


async def test_an_idle_kept_alive_connection_is_closed_after_the_keepalive_timeout():
    runner, url, _ = await _worker()
    try:
        config = RouterConfig(workers=[url], health_interval_s=0, keepalive_timeout_s=0.3)
        async with start_router(config) as router:
            host, port = router.url.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(0)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the router
            writer.close()
            assert router.metric("kvroute_router_client_timeouts_total", kind="idle") == 1
    finally:
        await runner.cleanup()



async def test_a_client_that_reads_none_of_its_answer_is_closed_after_the_send_timeout():
    """A client that takes no byte of a long answer for --send-timeout is closed (counted
    `send`); one that reads slowly but steadily gets all of it, however long that takes."""
    answer = json.dumps({"id": "x", "choices": [{"text": "y" * (8 << 20)}]}).encode()

    async def long(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    runner, url, _ = await _worker([("POST", "/v1/chat/completions", long)])
    try:
        config = RouterConfig(workers=[url], health_interval_s=0, send_timeout_s=0.5)
        async with start_router(config) as router:
            host, port = router.url.removeprefix("http://").rsplit(":", 1)
            request = _post(b"/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')
            sock = socket.create_connection((host, int(port)))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the router's buffers fill
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.transport.pause_reading()
            writer.write(request)
            await asyncio.sleep(1.5)  # reads nothing
            assert router.metric("kvroute_router_client_timeouts_total", kind="send") == 1
            # The router let go of it (the client still holds its end).
            assert router.metric("kvroute_router_client_connections") == 0
            writer.close()

            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(request)
            got = 0
            while chunk := await asyncio.wait_for(reader.read(256 << 10), 5):
                got += len(chunk)
                await asyncio.sleep(0.05)  # about 5 MB/s: 2 s for the answer, 4 send timeouts
            writer.close()
            assert got > len(answer)  # the head and all of the answer
            assert router.metric("kvroute_router_client_timeouts_total", kind="send") == 1
    finally:
        await runner.cleanup()


def _send_all_then_read(url: str, request: bytes) -> bytes:
    """What a simple client does: send the whole request, then read the answer (b"" when the
    connection was reset instead)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(request)
            return sock.recv(4096)
        except OSError:
            return b""


async def test_a_client_still_sending_a_refused_body_gets_the_answer_not_a_reset():
    """A client that sends all of a 16 MB body over the limit before it reads gets its 413:
    the router reads and discards the rest before it closes (closing on unread bytes resets
    the connection, and the client would see a broken pipe instead)."""
    runner, url, seen = await _worker()
    try:
        config = RouterConfig(workers=[url], health_interval_s=0, max_body_bytes=1 << 20)
        async with start_router(config) as router:
            request = _post(b"/v1/completions", b'{"prompt": "' + b"x" * (16 << 20) + b'"}')
            for _ in range(3):
                answer = await asyncio.to_thread(_send_all_then_read, router.url, request)
                assert _status(answer) == 413, answer[:100]
        assert seen == []
    finally:
        await runner.cleanup()

async def test_a_slow_body_gets_408():
    runner, url, seen = await _worker()
    try:
        config = RouterConfig(workers=[url], health_interval_s=0, body_timeout_s=0.3)
        async with start_router(config) as router:
            host, port = router.url.removeprefix("http://").rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(_post(b"/v1/completions", b'{"prompt": [1, 2, 3]}')[:-5])  # body cut short
            answer = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            assert _status(answer) == 408
            assert router.metric("kvroute_router_client_timeouts_total", kind="body") == 1
        assert seen == []
    finally:
        await runner.cleanup()


async def test_at_the_connection_limit_slow_heads_are_shed_and_otherwise_503_not_silence():
    runner, url, _ = await _worker()
    try:
        config = RouterConfig(workers=[url], health_interval_s=0, max_connections=5)
        async with start_router(config) as router:
            host, port = router.url.removeprefix("http://").rsplit(":", 1)
            # Five slow heads: a sixth connection sheds the oldest of them and is served.
            slow = []
            for _ in range(5):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(b"GET /hea")
                slow.append((reader, writer))
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            answer = await _raw(router.url, b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n")
            assert _status(answer) == 200
            assert await asyncio.wait_for(slow[0][0].read(), 2) == b""  # the oldest was closed
            assert router.metric("kvroute_router_client_timeouts_total", kind="shed") == 1
            for _, writer in slow:
                writer.close()
            await asyncio.sleep(0.1)
            # Five kept-alive connections (each served once): nothing to shed, so 503.
            held = []
            for _ in range(5):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
                await reader.readuntil(b"\r\n\r\n")
                held.append((reader, writer))
            answer = await _raw(router.url, b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            assert _status(answer) == 503 and b"too many connections" in answer
            assert router.metric("kvroute_router_connections_refused_total") == 1
            for _, writer in held:
                writer.close()
            await asyncio.sleep(0.1)
            answer = await _raw(router.url, b"GET /health HTTP/1.1\r\nHost: r\r\nConnection: close\r\n\r\n")
            assert _status(answer) == 200  # slots freed
    finally:
        await runner.cleanup()


def test_the_default_connection_limit_leaves_a_descriptor_per_upstream():
    assert default_max_connections(1024) == 448
    assert default_max_connections(100) == 16


async def test_bodies_over_the_limit_413_before_reading_and_compressed_ones_415():
    runner, url, seen = await _worker()
    try:
        config = RouterConfig(workers=[url], health_interval_s=0, max_body_bytes=1000)
        async with start_router(config) as router:
            # Declared too large: refused without waiting for the body (none is sent).
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 50000000\r\n\r\n")
            answer = await _raw(router.url, head, read_timeout=2)
            assert _status(answer) == 413
            # Whatever type it claims: the size is refused first (none of it is read).
            answer = await _raw(router.url, head.replace(b"application/json", b"text/plain"), read_timeout=2)
            assert _status(answer) == 413
            plain = json.dumps({"prompt": [1, 2, 3]}).encode()
            for encoding, body in ((b"gzip", plain), (b"gzip", gzip.compress(plain)),
                                   (b"deflate", zlib.compress(b'{"prompt": "' + b"a" * 60_000 + b'"}')),
                                   (b"br", plain)):
                answer = await _raw(router.url, _post(b"/v1/completions", body, b"Content-Encoding: " + encoding))
                assert _status(answer) == 415, answer[:200]
            answer = await _raw(router.url, _post(b"/v1/completions", plain, b"Content-Encoding: identity"))
            assert _status(answer) == 200
            assert router.metric("kvroute_router_rejected_requests_total", reason="content_encoding") == 4
            assert router.metric("kvroute_router_rejected_requests_total", reason="body_too_large") == 2
        assert seen == [plain]  # nothing compressed or oversized was forwarded
    finally:
        await runner.cleanup()


async def test_the_body_limit_is_derived_from_the_tokenizers_max_length(tiny_model_dir):
    """N tokens of the longest vocabulary entry, \\u-escaped (three times its bytes) or as ids
    (12 bytes each), plus 1 MiB for the rest of the body."""

    async def limit(**options) -> tuple[int, str]:
        config = RouterConfig(workers=["http://127.0.0.1:9"], health_interval_s=0, **options)
        async with start_router(config) as router:
            return router.max_body_bytes, router.max_body_source

    max_length = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())["model_max_length"]
    tokenizer = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    vocab = [*tokenizer["model"]["vocab"], *(t["content"] for t in tokenizer["added_tokens"])]
    longest = max(len(token.encode()) for token in vocab)
    derived, source = await limit(tokenizer=str(tiny_model_dir))
    assert derived == max_length * max(3 * longest, 12) + 2**20 < DEFAULT_MAX_BODY_BYTES
    assert source.startswith(f"derived: {max_length} tokens")
    assert await limit() == (DEFAULT_MAX_BODY_BYTES, "default: the tokenizer states no maximum length")
    assert await limit(tokenizer=str(tiny_model_dir), max_body_bytes=5) == (5, "--max-body-bytes")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from kvroute.tinymodel import build_tiny_model

    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model(str(path))
    return path


async def test_deep_json_is_400_at_any_depth_and_never_5xx():
    runner, url, seen = await _worker()
    try:
        config = RouterConfig(workers=[url], health_interval_s=0)
        async with start_router(config) as router:
            for depth in (65, 500, 981, 5000, 100_000):
                for shape in ("[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth):
                    body = ('{"prompt": [1], "x": ' + shape + "}").encode()
                    answer = await _raw(router.url, _post(b"/v1/completions", body))
                    assert _status(answer) == 400, (depth, answer[:300])
                    assert b"nested deeper" in answer
            # Brackets inside strings are text, not nesting.
            body = json.dumps({"prompt": "[" * 5000 + "{" * 5000}).encode()
            assert _status(await _raw(router.url, _post(b"/v1/completions", body))) == 200
            shallow = json.dumps({"prompt": [1], "x": [[[[[[1]]]]]]}).encode()
            assert _status(await _raw(router.url, _post(b"/v1/completions", shallow))) == 200
        assert len(seen) == 2
    finally:
        await runner.cleanup()


async def test_a_large_body_is_parsed_on_a_blocking_thread_and_health_stays_fast():
    runner, url, seen = await _worker()
    try:
        config = RouterConfig(workers=[url], health_interval_s=0, offload_bytes=1024)
        async with start_router(config) as router, aiohttp.ClientSession() as s:
            words = " ".join(f"w{i}" for i in range(400_000))
            body = {"messages": [{"role": "user", "content": words}]}
            big = asyncio.ensure_future(s.post(f"{router.url}/v1/chat/completions", json=body))
            latencies = []
            while not big.done():
                t = time.perf_counter()
                async with s.get(f"{router.url}/health") as r:
                    assert r.status == 200
                latencies.append(time.perf_counter() - t)
                await asyncio.sleep(0.005)
            assert (await big).status == 200
            assert router.metric("kvroute_router_offloaded_requests_total") == 1
            # Health was answered while the big one was parsed (the native data plane parses it
            # in milliseconds, so there may be only one check then), and never slowly.
            assert latencies and max(latencies) < 1.0
        assert len(seen) == 1
    finally:
        await runner.cleanup()


async def test_a_redirecting_health_check_is_unhealthy_and_not_followed():
    trap_hits = []

    async def trap(request):
        trap_hits.append(request.path)
        return web.Response()

    trap_runner, trap_url, _ = await _worker([("GET", "/target", trap)])

    async def redirect(request):
        raise web.HTTPFound(f"{trap_url}/target")

    runner = web.AppRunner(web.Application(), shutdown_timeout=0.1)
    runner.app.router.add_get("/health", redirect)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    worker_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        config = RouterConfig(workers=[worker_url], health_interval_s=0.05, health_timeout_s=0.5)
        async with start_router(config) as router:
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not router.available_workers():
                    break
            assert router.available_workers() == []
            assert router.metric("kvroute_router_health_check_failures_total", worker=worker_url) >= 1
        assert trap_hits == []
    finally:
        await runner.cleanup()
        await trap_runner.cleanup()


async def test_stream_timeouts_are_on_by_default():
    config = RouterConfig()
    assert (config.first_byte_timeout_s, config.stream_idle_timeout_s) == (
        DEFAULT_FIRST_BYTE_TIMEOUT_S, DEFAULT_STREAM_IDLE_TIMEOUT_S)
    assert DEFAULT_STREAM_IDLE_TIMEOUT_S >= 180  # a 130k-token prefill on a small GPU


def test_serve_with_a_missing_worker_file_exits_2_with_one_line():
    result = subprocess.run([sys.executable, "-m", "kvroute", "serve", "--worker-file", "/nonexistent/w"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "cannot read worker file" in result.stderr
    assert "Traceback" not in result.stderr


async def test_a_large_bad_id_prompt_is_still_a_400():
    runner, url, seen = await _worker()
    try:
        config = RouterConfig(workers=[url], health_interval_s=0, offload_bytes=100)
        async with start_router(config) as router:
            for prompt, status in (([1] * 100 + [-1], 400), ([1] * 100 + [2**40], 400), ([5] * 100, 200)):
                body = json.dumps({"prompt": prompt}).encode()
                assert _status(await _raw(router.url, _post(b"/v1/completions", body))) == status
            assert router.metric("kvroute_router_offloaded_requests_total") == 3
        assert len(seen) == 1
    finally:
        await runner.cleanup()


