"""Retention live (issue 19): ``kvroute serve --retention`` sends its refreshes to the workers.

A router with retention in front of emulated workers whose caches hold fewer prefixes' worth of
blocks than the clients cycle through: the refreshes (prefix + 1 token, ``max_tokens`` 1) reach
the worker's engine, are counted in ``kvroute_retention_*``, and are not client requests
(neither in the router's request counters nor in a bench's records). A worker that fails them
has the failures counted, and client requests are untouched."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from support.waiting import until

from kvroute.bench.router_metrics import RouterRefreshes, read_router, router_metrics_url
from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.router import RouterConfig, start_router
from kvroute.router.server import native_config
from kvroute.tokens import SyntheticTokenizer

MODEL = "Qwen/Qwen3-0.6B"
#: 64 usable blocks of 16 tokens: 4 prefixes of 10 blocks and their requests' own blocks do
#: not fit, so the LRU would evict a prefix idle for a few requests.
BLOCKS = 65


def metric(text: str, name: str) -> float:
    """Sum of a metric's samples (all label sets) in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.split()[-1])
    return total


def _prefixes(rng, tokens: int = 160) -> list[np.ndarray]:
    """The 4 prefixes of ``tokens`` tokens (160: 10 blocks) the clients cycle through."""
    return [rng.integers(1000, 30000, tokens) for _ in range(4)]


def _router_config(url: str, mode: str = "on", blocks: int = BLOCKS, **more) -> RouterConfig:
    """A kv-aware router with retention ``mode`` in front of the one worker ``url``."""
    return RouterConfig(workers=[url], policy="kv-aware", retention=mode,
                        kv_capacity_blocks=blocks - 1, health_interval_s=0, **more)


@contextlib.asynccontextmanager
async def _emulated_worker(blocks: int = BLOCKS):
    """One emulated worker (instant timing) with ``blocks`` blocks; closed on exit."""
    config = EmulatorConfig.for_model(
        "qwen3-0.6b", timing="instant", max_model_len=1024, num_gpu_blocks_override=blocks,
        enable_prompt_tokens_details=True,
    )
    (worker,) = await start_workers(config, 1)
    try:
        yield worker
    finally:
        await worker.close()


async def _drive(url: str, n: int, prefixes: list[np.ndarray], rng, form: str = "ids",
                 between: Callable[[], Awaitable[None]] | None = None) -> None:
    """``n`` requests, each a prefix (in turn) and 40 random tokens, sent as token ids, or as
    the synthetic tokenizer's ``text`` or a one-message ``chat`` of that text; ``between``
    is awaited after each answer."""
    tokenizer = SyntheticTokenizer()
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            prompt = np.concatenate([prefixes[i % len(prefixes)], rng.integers(1000, 30000, 40)])
            path, body = "/v1/completions", {"prompt": prompt.tolist()}
            if form == "text":
                body = {"prompt": tokenizer.decode(prompt.tolist())}
            elif form == "chat":
                path = "/v1/chat/completions"
                body = {"messages": [{"role": "user", "content": tokenizer.decode(prompt.tolist())}]}
            async with s.post(f"{url}{path}", json={"model": MODEL, "max_tokens": 8, **body}) as r:
                assert r.status == 200, await r.text()
                await r.read()
            if between is not None:
                await between()


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        return await r.text()


def _completion(body: dict, tokens: int) -> web.Response:
    """A worker's answer to a completion body: ``tokens`` generated."""
    payload = {"id": "c", "object": "text_completion", "created": 0, "model": MODEL,
               "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
               "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": tokens,
                         "total_tokens": len(body["prompt"]) + tokens}}
    return web.Response(text=json.dumps(payload), content_type="application/json")


async def _fake_worker(handler) -> tuple[web.AppRunner, str]:
    """A worker on 127.0.0.1 whose ``/v1/completions`` is ``handler``: its runner and URL."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _settle(router) -> None:
    """Wait for the refreshes still open, and for those issued when a request ended (sent
    from a task of their own) to be sent or dropped."""

    def settled() -> bool:
        text = router.metrics_text()
        handled = (metric(text, "kvroute_retention_refreshes_total")
                   + metric(text, "kvroute_retention_refreshes_dropped_total"))
        issued = router.retention_stats()["refreshes"]
        return metric(text, "kvroute_retention_refreshes_open") == 0 and handled == issued

    await until(settled)


@pytest.mark.parametrize("mode", ["on", "off"])
async def test_refreshes_reach_the_worker_and_are_counted_apart_from_client_requests(mode):
    rng = np.random.default_rng(0)
    prefixes = _prefixes(rng)
    async with _emulated_worker() as worker:
        rc = _router_config(worker.url, mode)
        async with start_router(rc) as router:
            await _drive(router.url, 40, prefixes, rng)
            if mode == "off":
                assert router.retention_stats() is None
                text = await _metrics(router.url)
                assert "kvroute_retention_refreshes" not in text
                assert worker.worker.engine.stats.requests == 40
                assert (await read_router(router_metrics_url(router.url))).refreshes == RouterRefreshes()
                return
            await _settle(router)
            text = await _metrics(router.url)
            sent = metric(text, "kvroute_retention_refreshes_total")
            assert sent > 0, "4 prefixes of 10 blocks and their requests overflow 64 blocks"
            assert metric(text, "kvroute_retention_refresh_errors_total") == 0
            assert metric(text, "kvroute_retention_refresh_prompt_tokens_total") >= sent * 33
            assert f'kvroute_retention_refreshes_total{{worker="{worker.url}"}}' in text
            # The router answered 40 client requests; the worker's engine ran them and the
            # refreshes besides.
            assert metric(text, "kvroute_router_requests_total") == 40
            assert worker.worker.engine.stats.requests == 40 + sent
            assert router.retention_stats()["refreshes"] == sent
            # Every client request went after its refreshes were on their connections.
            assert metric(text, "kvroute_retention_refreshes_late_total") == 0
            # What the bench reads as a trial's refreshes; a worker's own /metrics has none.
            refreshes = (await read_router(router_metrics_url(router.url + "/v1"))).refreshes
            assert refreshes.sent == sent and refreshes.open == 0
            # Every refresh came back with its usage, mostly cached (what the bench takes out
            # of the workers' counters).
            assert refreshes.answered_prompt_tokens == refreshes.prompt_tokens
            assert refreshes.prompt_tokens - sent <= refreshes.cached_tokens < refreshes.prompt_tokens
            assert await read_router(router_metrics_url(worker.url)) is None


@pytest.mark.parametrize("form", ["text", "chat"])
async def test_text_and_chat_prompts_are_refreshed_from_the_ids_the_router_encoded(form):
    """A client sending text (or chat messages) gets retention too: the router refreshes the
    prefix as the token ids it encoded (that those ids hash as the engine's is
    tests/serve/test_router_prompts.py's)."""
    rng = np.random.default_rng(0)
    prefixes = _prefixes(rng)
    async with _emulated_worker() as worker:
        rc = _router_config(worker.url)
        async with start_router(rc) as router:
            await _drive(router.url, 40, prefixes, rng, form)
            await _settle(router)
            text = await _metrics(router.url)
            sent = metric(text, "kvroute_retention_refreshes_total")
            assert sent > 0, "4 prefixes of 10 blocks and their requests overflow 64 blocks"
            assert metric(text, "kvroute_retention_refresh_errors_total") == 0
            assert worker.worker.engine.stats.requests == 40 + sent
            # Each refresh is its prefix's full blocks (at least 2 of 16 tokens) + 1 token.
            assert metric(text, "kvroute_retention_refresh_prompt_tokens_total") >= sent * 33


async def test_refresh_failures_are_counted_not_retried_and_clients_are_served():
    seen = {"refresh": 0, "client": 0}

    async def handler(request: web.Request) -> web.Response:
        body = await request.json()
        if body["max_tokens"] == 1:
            seen["refresh"] += 1
            return web.Response(status=500, text="no")
        seen["client"] += 1
        return _completion(body, 8)

    runner, url = await _fake_worker(handler)
    rng = np.random.default_rng(1)
    prefixes = _prefixes(rng)
    try:
        rc = _router_config(url, eject_after_failures=0)
        async with start_router(rc) as router:
            await _drive(router.url, 40, prefixes, rng)
            await _settle(router)
            text = await _metrics(router.url)
            sent = metric(text, "kvroute_retention_refreshes_total")
            assert sent > 0
            assert metric(text, "kvroute_retention_refresh_errors_total") == sent == seen["refresh"]
            assert seen["client"] == 40
    finally:
        await runner.cleanup()


async def test_refreshes_reach_the_worker_before_the_request_they_are_sent_ahead_of():
    """Arriving after its request, a refresh finds the prefix already pushed out of the LRU by
    that request's blocks: each refresh must reach the worker before the client request that
    was routed when it was sent. The client is sequential, so when the worker sees a client
    request every refresh sent so far was sent ahead of it, and must have arrived.

    The router forwards the client request once hyper has taken its refreshes' bodies to
    write, on kept-alive connections of their own. That orders them at the worker on a
    connection the worker has accepted; on a new one the worker may still read the client's
    established connection first. So each refresh connection's first request may be
    overtaken, and no other: 4 of these 107 refreshes were, each the first on its connection."""
    arrived = 0
    connections: set[tuple] = set()  # the refreshes' connections, by the router's address
    first_on_connection: list[bool] = []  # per refresh, in arrival order
    behind: list[tuple[int, float]] = []  # (refreshes arrived, refreshes sent) where they differ
    router = None

    async def handler(request: web.Request) -> web.Response:
        nonlocal arrived
        body = await request.json()
        if body["max_tokens"] == 1:
            arrived += 1
            peer = request.transport.get_extra_info("peername")
            first_on_connection.append(peer not in connections)
            connections.add(peer)
        else:
            sent = router.metric("kvroute_retention_refreshes_total", worker=url)
            if sent != arrived:
                behind.append((arrived, sent))
        return _completion(body, 1)

    runner, url = await _fake_worker(handler)
    rng = np.random.default_rng(2)
    prefixes = _prefixes(rng)
    try:
        rc = _router_config(url)
        async with start_router(rc) as router:
            await _drive(router.url, 40, prefixes, rng)
            await _settle(router)
            assert router.metric("kvroute_retention_refreshes_total", worker=url) == arrived > 0
            assert len(connections) <= 4  # kept alive and reused: at most 4 open per worker
            assert all(sent - seen == 1 and first_on_connection[seen] for seen, sent in behind)
    finally:
        await runner.cleanup()


async def test_auto_sends_nothing_ahead_of_a_request_to_an_idle_worker_but_once_it_is_idle():
    """A sequential client that waits for the refreshes of each request before its next: every
    request finds its worker idle, where a refresh written ahead of it would make a step of its
    own for the request to wait out. ``auto`` holds those back and sends them when the worker's
    request ends, and the worker answers every one. Its prefixes are 4 times longer than the
    other tests' (40 blocks, on 4 × 40 + 25): ``auto`` refreshes only prefixes worth more than
    a refresh costs."""
    rng = np.random.default_rng(0)
    prefixes = _prefixes(rng, 640)
    async with _emulated_worker(185) as worker:
        async with start_router(_router_config(worker.url, "auto", 185)) as router:
            await _drive(router.url, 40, prefixes, rng, between=lambda: _settle(router))
            stats = router.retention_stats()
            text = await _metrics(router.url)
            sent = metric(text, "kvroute_retention_refreshes_total")
            dropped = metric(text, "kvroute_retention_refreshes_dropped_total")
            assert stats["deferred_idle"] > 0
            # All sent: the client waits for each request's refreshes before its next, so none
            # finds the worker still answering MAX_REFRESHES_OPEN others (however loaded the
            # machine, which would otherwise decide how many overlap the next request).
            assert sent == stats["refreshes"] > 0 and dropped == 0
            assert metric(text, "kvroute_retention_refresh_errors_total") == 0
            assert worker.worker.engine.stats.requests == 40 + sent


@pytest.mark.parametrize(("policy", "retention", "runs"), [
    ("kv-aware", None, "auto"), ("kv-aware", "off", "off"), ("kv-aware", "on", "on"),
    ("round-robin", None, "off"), ("round-robin", "auto", "auto")])
async def test_kv_aware_retains_by_default_and_the_other_policies_only_when_asked(
        policy, retention, runs):
    """``kvroute serve`` with no ``--retention`` runs ``auto`` with kv-aware, ``off`` with the
    other policies (whose placement retention would override)."""
    async with _emulated_worker() as worker:
        config = RouterConfig(workers=[worker.url], policy=policy, retention=retention,
                              health_interval_s=0)
        assert native_config(config, [])["retention"] == runs
        async with start_router(config) as router:
            assert (router.retention_stats() is not None) == (runs != "off")
