"""The router against hostile clients: fuzzed bodies, headers and request lines (hypothesis,
raw sockets) are answered 2xx/4xx, never 5xx, and never crash it; bodies over the limit get
413; no header can be injected into the request a worker sees; only configured workers are
ever contacted (a trap server whose URL the fuzzer plants everywhere must see nothing);
bearer-token auth, and the client's Authorization header forwarded only when configured.

Examples per fuzz test: ``KVROUTE_FUZZ_EXAMPLES`` (default 400; four fuzz tests). The issue's
10,000-case run: ``KVROUTE_FUZZ_EXAMPLES=2500 python -m pytest -q tests/serve/test_hostile_input.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import threading
from collections import Counter
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.commands import serve
from kvroute.errors import UserError
from kvroute.router import RouterConfig, start_router

EXAMPLES = int(os.environ.get("KVROUTE_FUZZ_EXAMPLES", "400"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MAX_BODY = 4096
API_KEY = "s3cret-key"
ROUTE_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/models"}
#: What a worker may see: the forwarded headers plus those aiohttp's client writes itself.
#: Status codes the fuzz cases got (printed at the end with ``-s``).
STATUSES: Counter[int] = Counter()
ALLOWED_UPSTREAM_HEADERS = {
    "host", "content-type", "content-length", "x-request-id", "traceparent", "tracestate",
    "accept", "accept-encoding", "user-agent", "authorization",
}


class Upstream:
    """A fake worker (or the trap) that records every request it gets."""

    def __init__(self, status: int = 200, location: str | None = None) -> None:
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.status = status
        self.location = location
        self.app = web.Application(client_max_size=2**30)
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.seen.append((request.method, request.path, dict(request.headers), body))
        if request.path == "/health":
            return web.Response()
        headers = {"Location": self.location} if self.location else None
        return web.json_response({"id": "x", "object": "text_completion", "choices": []},
                                 status=self.status, headers=headers)

    async def start(self) -> str:
        self.runner = web.AppRunner(self.app, shutdown_timeout=0.1)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self.url

    def requests(self) -> list[tuple[str, str, dict[str, str], bytes]]:
        """What it got but the router's own probes (``/health``; ``/metrics``, where the
        admission guard reads the engine's KV capacity)."""
        return [r for r in self.seen if r[1] not in ("/health", "/metrics")]


class Stack:
    """A trap server, a fake worker and routers in front of it, on an event loop in a thread
    (hypothesis drives a synchronous test; the client is a raw socket)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.trap = Upstream()
        self.worker = Upstream()
        self.call(self._start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    async def _start(self) -> None:
        await self.trap.start()
        await self.worker.start()
        base = {"workers": [self.worker.url], "max_body_bytes": MAX_BODY, "health_interval_s": 0}
        self.open = await start_router(RouterConfig(**base))
        self.locked = await start_router(RouterConfig(**base, api_key=API_KEY))
        self.forwarding = await start_router(RouterConfig(**base, forward_authorization=True))

    async def _stop(self) -> None:
        for router in (self.open, self.locked, self.forwarding):
            await router.close()
        await self.trap.runner.cleanup()
        await self.worker.runner.cleanup()

    def close(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack()
    yield s
    # After every fuzz case: the trap saw nothing, the worker only the router's own paths and
    # headers, and each router still serves.
    try:
        assert s.trap.seen == []
        for _method, path, headers, _ in s.worker.requests():
            assert path in ROUTE_PATHS, path
            assert {h.lower() for h in headers} <= ALLOWED_UPSTREAM_HEADERS, headers
        for router in (s.open, s.locked):
            assert raw(router.url, http_request(b"GET", b"/health", [], b""))[0] == 200
        if STATUSES:
            print(f"\nfuzz cases: {sum(STATUSES.values())}, statuses: {dict(sorted(STATUSES.items()))}, "
                  f"requests the worker got: {len(s.worker.requests())}")
            # Not vacuous: some fuzzed requests were routed, some refused.
            assert STATUSES[200] > 0 and sum(v for k, v in STATUSES.items() if 400 <= k < 500) > 0
    finally:
        s.close()


def raw(url: str, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` as is; return the status and body of the answer (0: no answer)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    while data.startswith(b"HTTP/1.1 100 "):  # an interim answer to Expect: 100-continue
        data = data.partition(b"\r\n\r\n")[2]
    if not data.startswith(b"HTTP/"):  # aiohttp echoes the request's version, even a bogus one
        return 0, data
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def http_request(method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    lines = [method + b" " + target + b" HTTP/1.1", b"Host: router", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def assert_client_error_at_worst(status: int, body: bytes) -> None:
    STATUSES[status] += 1
    assert status != 0, f"no HTTP answer: {body[:200]!r}"
    assert status < 500, body[:300]


# --- fuzzing -----------------------------------------------------------------------------------

TRAP_PLACEHOLDER = "http://TRAP"
_keys = st.sampled_from([
    "prompt", "messages", "model", "max_tokens", "stream", "stream_options", "role", "content",
    "url", "base_url", "api_base", "worker", "host", "upstream", "x-kvroute-worker", "n",
]) | st.text(max_size=8)
_scalars = (
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40)
    | st.just(TRAP_PLACEHOLDER) | st.just("<|im_start|>") | st.just("\u0000\ud7ff\U0010ffff")
)
_json = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(_keys, inner, max_size=6),
    max_leaves=30,
)
_token_ids = st.lists(st.integers(min_value=-5, max_value=2**33), max_size=80)
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "bogus"]) | st.text(max_size=5)},
        optional={"content": _json, "name": _json},
    ),
    max_size=5,
)
_body_objects = st.fixed_dictionaries(
    {},
    optional={"prompt": _json | _token_ids | st.lists(_token_ids, max_size=3), "messages": _messages | _json,
              "max_tokens": _json, "stream": _json, "model": _json, "base_url": st.just(TRAP_PLACEHOLDER)},
)


def plant_trap(value, trap: str):
    """Replace the placeholder by the trap's URL wherever the fuzzer put it."""
    if value == TRAP_PLACEHOLDER:
        return trap
    if isinstance(value, list):
        return [plant_trap(v, trap) for v in value]
    if isinstance(value, dict):
        return {k: plant_trap(v, trap) for k, v in value.items()}
    return value


@FUZZ
@given(
    body=_body_objects | _json,
    path=st.sampled_from([b"/v1/completions", b"/v1/chat/completions"]),
    content_type=st.sampled_from([b"application/json", b"application/json; charset=utf-8", b"text/plain"]),
)
def test_fuzzed_json_bodies_get_4xx_never_5xx(stack, body, path, content_type):
    payload = json.dumps(plant_trap(body, stack.trap.url), allow_nan=True).encode("utf-8", "surrogatepass")
    status, answer = raw(stack.open.url, http_request(b"POST", path, [(b"Content-Type", content_type)], payload))
    if len(payload) > MAX_BODY:
        assert status == 413
    assert_client_error_at_worst(status, answer)


@FUZZ
@given(data=st.binary(max_size=MAX_BODY + 512), path=st.sampled_from([b"/v1/completions", b"/v1/chat/completions"]))
def test_fuzzed_raw_bodies_get_4xx_never_5xx(stack, data, path):
    status, answer = raw(stack.open.url, http_request(b"POST", path, [(b"Content-Type", b"application/json")], data))
    assert_client_error_at_worst(status, answer)
    if len(data) > MAX_BODY:
        assert status == 413


_header_names = st.sampled_from([
    b"Host", b"X-Forwarded-Host", b"Forwarded", b"X-Request-Id", b"traceparent", b"Authorization",
    b"Content-Type", b"Transfer-Encoding", b"Connection", b"Upgrade", b"Expect", b"X-Kvroute-Worker",
    b"Proxy-Authorization", b"Cookie",
]) | st.binary(min_size=1, max_size=12)
_header_values = st.binary(max_size=60) | st.sampled_from([
    b"TRAP", b"a\r\nX-Injected: 1", b"a\nX-Injected: 1", b"a\rX-Injected: 1", b"x\x00y",
    b"\r\n\r\nPOST /v1/completions HTTP/1.1", b"chunked", b"100-continue", b"Bearer " + API_KEY.encode(),
])


@FUZZ
@given(headers=st.lists(st.tuples(_header_names, _header_values), max_size=6),
       locked=st.booleans())
def test_fuzzed_headers_cannot_inject_redirect_or_break_the_router(stack, headers, locked):
    trap_host = stack.trap.url.removeprefix("http://").encode()
    headers = [(n, v.replace(b"TRAP", trap_host)) for n, v in headers]
    router = stack.locked if locked else stack.open
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1}).encode()
    before = len(stack.worker.requests())
    status, answer = raw(router.url, http_request(b"POST", b"/v1/completions", headers, body))
    assert_client_error_at_worst(status, answer)
    for _, _, seen, _ in stack.worker.requests()[before:]:
        assert not any("injected" in k.lower() for k in seen)
        assert all("\r" not in v and "\n" not in v for v in seen.values())
        assert "Authorization" not in seen  # never forwarded unless configured
    if locked:
        authorized = [v for n, v in headers if n.lower() == b"authorization"]
        if status not in (400, 413, 417) and (len(authorized) != 1 or authorized[0].split(b" ", 1)[-1].strip() != API_KEY.encode()):
            assert status == 401


_methods = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"HEAD", b"PATCH", b"TRACE", b"CONNECT"])
_targets = st.one_of(
    st.binary(min_size=1, max_size=80).map(lambda b: b"/" + b),
    st.sampled_from([
        b"/v1/completions", b"/v1/chat/completions", b"/v1/models", b"/health", b"/metrics",
        b"//TRAP/v1/completions", b"http://TRAP/v1/completions", b"TRAP:80", b"*",
        b"/v1/../v1/completions", b"/v1/%2e%2e/health", b"/v1/completions?url=http://TRAP",
        b"/v1/completions/../../TRAP", b"/v1//completions", b"/V1/COMPLETIONS", b"/v1/completions%00",
    ]),
)


@FUZZ
@given(method=_methods, target=_targets, body=st.sampled_from([b"", b'{"prompt": [1, 2]}', b"{}"]))
def test_fuzzed_request_lines_reach_only_the_routers_own_paths(stack, method, target, body):
    target = target.replace(b"TRAP", stack.trap.url.removeprefix("http://").encode())
    headers = [(b"Content-Type", b"application/json")]
    status, answer = raw(stack.open.url, http_request(method, target, headers, body))
    assert_client_error_at_worst(status, answer)


# --- targeted cases ----------------------------------------------------------------------------


def test_body_over_the_limit_is_413_with_or_without_content_length(stack):
    big = b'{"prompt": "' + b"x" * MAX_BODY + b'"}'
    status, _ = raw(stack.open.url, http_request(b"POST", b"/v1/completions", [(b"Content-Type", b"application/json")], big))
    assert status == 413
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\n"
               b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
               + f"{len(big):x}".encode() + b"\r\n" + big + b"\r\n0\r\n\r\n")
    status, body = raw(stack.open.url, chunked)
    assert status == 413 and json.loads(body)["error"]["code"] == 413


def test_api_key_guards_everything_but_health(stack):
    url = stack.locked.url

    def get(path: bytes, auth: bytes | None = None) -> int:
        headers = [(b"Authorization", auth)] if auth is not None else []
        return raw(url, http_request(b"GET", path, headers, b""))[0]

    def post(auth: bytes | None) -> int:
        headers = [(b"Content-Type", b"application/json")]
        if auth is not None:
            headers.append((b"Authorization", auth))
        return raw(url, http_request(b"POST", b"/v1/completions", headers, b'{"prompt": [1, 2]}'))[0]

    good = b"Bearer " + API_KEY.encode()
    assert get(b"/health") == 200
    assert get(b"/metrics") == 401 and get(b"/metrics", good) == 200
    assert get(b"/v1/models") == 401 and get(b"/v1/models", good) == 200
    assert post(None) == 401
    assert post(b"Bearer " + API_KEY.encode()[:-1]) == 401
    assert post(b"Basic " + API_KEY.encode()) == 401
    assert post(b"Bearer \xff\xfe") == 401
    assert post(good) == 200
    assert post(b"bearer  " + API_KEY.encode()) == 200  # scheme case-insensitive (RFC 7235)
    # Expect: 100-continue is answered 401 before the body is uploaded.
    headers = [(b"Content-Type", b"application/json"), (b"Expect", b"100-continue")]
    status, _ = raw(url, http_request(b"POST", b"/v1/completions", headers, b'{"prompt": [1]}'))
    assert status == 401
    status, _ = raw(url, http_request(b"POST", b"/v1/completions", headers + [(b"Authorization", good)], b'{"prompt": [1]}'))
    assert status == 200
    assert raw(url, http_request(b"POST", b"/v1/completions", [(b"Expect", b"\xff")], b""))[0] == 417


async def test_public_metrics_and_authorization_forwarding():
    worker = Upstream()
    await worker.start()
    try:
        config = RouterConfig(workers=[worker.url], api_key="k", metrics_public=True, health_interval_s=0)
        async with start_router(config) as router, aiohttp.ClientSession() as s:
            async with s.get(f"{router.url}/metrics") as r:
                assert r.status == 200
            async with s.post(f"{router.url}/v1/completions", json={"prompt": [1]},
                              headers={"Authorization": "Bearer k"}) as r:
                assert r.status == 200
        assert "Authorization" not in worker.requests()[-1][2]  # the router's key stays here
        config = RouterConfig(workers=[worker.url], forward_authorization=True, health_interval_s=0)
        async with start_router(config) as router, aiohttp.ClientSession() as s:
            async with s.post(f"{router.url}/v1/completions", json={"prompt": [1]},
                              headers={"Authorization": "Bearer client"}) as r:
                assert r.status == 200
        assert worker.requests()[-1][2]["Authorization"] == "Bearer client"
        config = RouterConfig(workers=[worker.url], forward_authorization=True, worker_api_key="w",
                              health_interval_s=0)
        async with start_router(config) as router, aiohttp.ClientSession() as s:
            async with s.post(f"{router.url}/v1/completions", json={"prompt": [1]},
                              headers={"Authorization": "Bearer client"}) as r:
                assert r.status == 200
        assert worker.requests()[-1][2]["Authorization"] == "Bearer w"
    finally:
        await worker.runner.cleanup()


async def test_request_bodies_held_at_once_stay_within_the_budget():
    """A client that holds a large body partly sent takes its share of --max-buffered-body-bytes
    (what has arrived, rounded up to its declared length): a body that would pass the budget
    meanwhile gets 503 (declared or chunked), one that fits is served, and once the first is
    gone the budget is whole again."""
    worker = Upstream()
    await worker.start()
    limit, budget = 96 * 1024, 128 * 1024
    config = RouterConfig(workers=[worker.url], health_interval_s=0, max_body_bytes=limit,
                          max_buffered_body_bytes=budget)

    def body(size: int) -> bytes:
        return b'{"prompt": "' + b"x" * (size - 14) + b'"}'

    def chunked(data: bytes) -> bytes:
        return (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"".join(f"{len(c):x}".encode() + b"\r\n" + c + b"\r\n"
                           for c in (data[i:i + 8192] for i in range(0, len(data), 8192)))
                + b"0\r\n\r\n")

    json_header = [(b"Content-Type", b"application/json")]
    try:
        async with start_router(config) as router, aiohttp.ClientSession() as s:
            host, port = router.url.removeprefix("http://").rsplit(":", 1)
            held = http_request(b"POST", b"/v1/completions", json_header, body(90 * 1024))
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(held[: 3 * len(held) // 4])  # the head and most of the body: it waits
            await writer.drain()
            await asyncio.sleep(0.2)
            async with s.get(f"{router.url}/metrics") as r:
                metrics = await r.text()
            assert "kvroute_router_buffered_body_bytes 92160" in metrics, metrics
            def send(request: bytes) -> int:
                return raw(router.url, request)[0]
            over = http_request(b"POST", b"/v1/completions", json_header, body(50 * 1024))
            assert await asyncio.to_thread(send, over) == 503
            assert await asyncio.to_thread(send, chunked(body(50 * 1024))) == 503
            fits = http_request(b"POST", b"/v1/completions", json_header, body(20 * 1024))
            assert await asyncio.to_thread(send, fits) == 200
            assert await asyncio.to_thread(send, chunked(body(20 * 1024))) == 200
            writer.write(held[3 * len(held) // 4:])
            await writer.drain()
            assert (await reader.read()).startswith(b"HTTP/1.1 200")
            writer.close()
            assert await asyncio.to_thread(send, over) == 200
            assert await asyncio.to_thread(send, chunked(body(90 * 1024))) == 200
            async with s.get(f"{router.url}/metrics") as r:
                metrics = await r.text()
            assert 'kvroute_router_rejected_requests_total{reason="body_budget"} 2' in metrics
            assert "kvroute_router_buffered_body_bytes 0" in metrics
    finally:
        await worker.runner.cleanup()


async def test_clients_sending_large_bodies_slowly_do_not_stall_another_large_body():
    """Large bodies (over --offload-bytes) are parsed two at a time, but a body waits for a
    parse slot only once it has arrived: three clients holding large bodies half sent cannot
    keep a fourth, whole one waiting (before, they held both slots while sending)."""
    worker = Upstream()
    await worker.start()
    config = RouterConfig(workers=[worker.url], health_interval_s=0, offload_bytes=1024, body_timeout_s=30.0)
    body = b'{"prompt": "' + b"x" * 20_000 + b'"}'
    request = http_request(b"POST", b"/v1/completions", [(b"Content-Type", b"application/json")], body)
    try:
        async with start_router(config) as router:
            host, port = router.url.removeprefix("http://").rsplit(":", 1)
            slow = []
            for _ in range(3):
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(request[: len(request) // 2])
                await writer.drain()
                slow.append((reader, writer))
            await asyncio.sleep(0.2)
            started = asyncio.get_running_loop().time()
            status = await asyncio.wait_for(asyncio.to_thread(lambda: raw(router.url, request)[0]), 10)
            assert status == 200 and asyncio.get_running_loop().time() - started < 5
            for reader, writer in slow:
                writer.write(request[len(request) // 2:])
                await writer.drain()
                assert (await reader.read()).startswith(b"HTTP/1.1 200")
                writer.close()
    finally:
        await worker.runner.cleanup()


async def test_a_budget_below_the_body_limit_is_refused():
    config = RouterConfig(workers=["http://127.0.0.1:9"], max_body_bytes=1 << 20,
                          max_buffered_body_bytes=1 << 19, health_interval_s=0)
    with pytest.raises(UserError, match="below the body limit"):
        async with start_router(config):
            pass


async def test_a_worker_redirect_is_not_followed():
    trap = Upstream()
    await trap.start()
    worker = Upstream(status=307, location=f"{trap.url}/v1/completions")
    await worker.start()
    try:
        config = RouterConfig(workers=[worker.url], health_interval_s=0)
        async with start_router(config) as router, aiohttp.ClientSession() as s:
            async with s.post(f"{router.url}/v1/completions", json={"prompt": [1]},
                              allow_redirects=False) as r:
                assert r.status == 307
            async with s.get(f"{router.url}/v1/models", allow_redirects=False) as r:
                assert r.status == 307
        assert trap.seen == []
        assert len(worker.requests()) == 2
    finally:
        await worker.runner.cleanup()
        await trap.runner.cleanup()


def test_malformed_requests_cannot_flood_the_log(stack, caplog):
    with caplog.at_level("DEBUG", logger="aiohttp.server"):
        for line in (b"GET /v1/\x00models HTTP/1.1", b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1",
                     b"GET / HTTP/1.1\r\nbad header"):
            status, _ = raw(stack.open.url, line + b"\r\nHost: r\r\nConnection: close\r\n\r\n")
            assert status == 400
    assert not [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= 30]


def serve_config(argv: list[str]) -> RouterConfig:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return serve.config_from_args(parser.parse_args(["--worker", "http://127.0.0.1:9", *argv]))


def test_serve_flags_for_timeouts_ejection_and_auth(monkeypatch):
    config = serve_config([])
    assert (config.api_key, config.forward_authorization) == (None, False)
    # Timeouts are on by default, long enough for a 130k-token prefill; 0 turns them off.
    assert (config.first_byte_timeout_s, config.stream_idle_timeout_s, config.send_timeout_s) == (600.0, 300.0, 60.0)
    config = serve_config(["--first-byte-timeout", "0", "--stream-idle-timeout", "0", "--send-timeout", "0"])
    assert (config.first_byte_timeout_s, config.stream_idle_timeout_s, config.send_timeout_s) == (None, None, None)
    config = serve_config(["--api-key", "k", "--public-metrics", "--forward-authorization",
                           "--first-byte-timeout", "2.5", "--stream-idle-timeout", "30",
                           "--eject-after", "5", "--eject-base", "10"])
    assert (config.api_key, config.metrics_public, config.forward_authorization) == ("k", True, True)
    assert (config.first_byte_timeout_s, config.stream_idle_timeout_s) == (2.5, 30.0)
    assert (config.eject_after_failures, config.eject_base_s) == (5, 10.0)
    # Keys from the environment stay out of the process list.
    monkeypatch.setenv("KVROUTE_API_KEY", "from-env")
    monkeypatch.setenv("KVROUTE_WORKER_API_KEY", "worker-env")
    config = serve_config([])
    assert (config.api_key, config.worker_api_key) == ("from-env", "worker-env")
    for bad, message in (
            (["--first-byte-timeout", "-1"], "--first-byte-timeout must be positive (0: no limit), got -1"),
            (["--stream-idle-timeout", "-1"], "--stream-idle-timeout must be positive"),
            (["--send-timeout", "-1"], "--send-timeout must be positive"),
            (["--eject-after", "-1"], "--eject-after must be a whole number >= 0"),
            (["--eject-base", "-2"], "--eject-base must be a number of seconds >= 0, got -2"),
            (["--api-key", " "], "--api-key must not be empty"),
            (["--header-timeout", "0"], "--header-timeout must be positive, got 0"),
            (["--max-connections", "0"], "--max-connections must be >= 1, got 0"),
            (["--max-attempts", "0"], "--max-attempts must be >= 1, got 0"),
            (["--max-loras", "0"], "--max-loras must be >= 1, got 0"),
            (["--block-size", "0"], "--block-size must be >= 1, got 0"),
            (["--policy-option", "speed=1"], "--policy-option kv-aware: unknown field `speed`"),
            (["--policy-option", "load_factor=-1"], "--policy-option"),
    ):
        with pytest.raises(UserError) as refused:
            serve_config(bad)
        assert str(refused.value).startswith(message), (bad, str(refused.value))


def test_every_setting_the_router_refuses_is_named_by_a_flag_serve_has():
    """``CONFIG_FLAGS`` names a flag of ``kvroute serve`` for settings of ``RouterConfig``,
    and every field with a flag that the data plane checks maps to one."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    assert set(serve.CONFIG_FLAGS.values()) <= flags
    assert set(serve.CONFIG_FLAGS) <= {f.name for f in dataclasses.fields(RouterConfig)}
    checked = {"threads", "block_size", "max_attempts", "max_connections", "max_body_bytes",
               "kv_capacity_blocks", "max_loras", "header_timeout_s", "keepalive_timeout_s",
               "body_timeout_s", "send_timeout_s", "first_byte_timeout_s", "stream_idle_timeout_s",
               "api_key", "workers", "policy", "worker_api_key", "max_buffered_body_bytes", "mesh_bind"}
    assert checked <= set(serve.CONFIG_FLAGS)


def test_serve_kv_events_take_tcp_or_ipc_endpoints():
    config = serve_config(["--kv-events", "http://127.0.0.1:9=ipc:///tmp/kv-0,ipc:///tmp/kv-0-replay"])
    (source,) = config.events.per_worker.values()
    assert (source.endpoint, source.replay_endpoint) == ("ipc:///tmp/kv-0", "ipc:///tmp/kv-0-replay")
    config = serve_config(["--kv-events", "http://127.0.0.1:9=tcp://127.0.0.1:5557"])
    assert [s.endpoint for s in config.events.per_worker.values()] == ["tcp://127.0.0.1:5557"]
    for bad in ("http://127.0.0.1:9=udp://x", "http://127.0.0.1:9", "http://127.0.0.1:9=tcp://a:1,http://b"):
        with pytest.raises(UserError, match="bad --kv-events"):
            serve_config(["--kv-events", bad])


def test_serve_refuses_a_worker_file_it_cannot_read(tmp_path):
    # One line and exit, not a traceback and a router serving "workers: none yet" forever.
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(UserError, match="cannot read worker file .*nope"):
        serve.config_from_args(parser.parse_args(["--worker-file", str(tmp_path / "nope")]))
    (tmp_path / "workers").write_text("http://127.0.0.1:9\nnot-a-url\n")
    with pytest.raises(UserError, match=r"workers:2: bad worker URL"):
        serve.config_from_args(parser.parse_args(["--worker-file", str(tmp_path / "workers")]))
    (tmp_path / "workers").write_text("http://127.0.0.1:9\n")
    assert serve.config_from_args(parser.parse_args(["--worker-file", str(tmp_path / "workers")]))
