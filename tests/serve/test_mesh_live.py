"""The replica mesh live (issue 44): two routers that hear each other's decisions.

Two real routers (``kvroute serve``'s native router, each with its mesh socket) in front of
one worker that holds its answers until told: a request routed by one replica is, on the
other, load on the worker (in flight) and a prediction in its index while it runs, and
released when it ends; each replica's ``/metrics`` counts the messages and its live peer. A
replica that stops is forgotten by the other (at once when its connection closes, else within
the liveness window), and what it had routed is released there. A replica that starts takes
the decisions its peer has in flight from the peer's snapshot."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web

from kvroute.errors import UserError
from kvroute.router import RouterConfig, start_router
from kvroute.router.server import Router

MODEL = "m"


def metric(text: str, name: str) -> float:
    """Sum of a metric's samples (all label sets) in a Prometheus text page."""
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


class HeldWorker:
    """A worker whose completions wait for :attr:`release` (counted in :attr:`arrived`)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.arrived = 0

    async def complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.arrived += 1
        await self.release.wait()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
                 "total_tokens": len(body["prompt"]) + 1}
        return web.Response(text=json.dumps({"id": "c", "object": "text_completion", "model": MODEL,
                                             "choices": [{"index": 0, "text": "x"}], "usage": usage}),
                            content_type="application/json")


@contextlib.asynccontextmanager
async def _worker():
    held = HeldWorker()
    app = web.Application()
    app.router.add_post("/v1/completions", held.complete)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield held, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        held.release.set()
        await runner.cleanup()


async def _until(check, limit_s: float = 5.0) -> None:
    """Wait until ``check()`` is true (a failed test after ``limit_s``)."""
    for _ in range(int(limit_s / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("not within the limit")


def _config(worker_url: str) -> RouterConfig:
    return RouterConfig(workers=[worker_url], policy="kv-aware", retention="off", health_interval_s=0,
                        mesh_bind="127.0.0.1:0")


async def test_a_peers_decision_is_load_and_a_prediction_here_until_it_ends():
    async with _worker() as (held, url):
        async with start_router(_config(url)) as a, start_router(_config(url)) as b:
            a.set_peers([b.mesh_address])
            b.set_peers([a.mesh_address])
            await _until(lambda: metric(a.metrics_text(), "kvroute_mesh_peers_live") == 1
                         and metric(b.metrics_text(), "kvroute_mesh_peers_live") == 1)
            assert metric(b.metrics_text(), "kvroute_router_index_predicted_entries") == 0
            async with aiohttp.ClientSession() as s:
                sent = asyncio.ensure_future(s.post(f"{a.url}/v1/completions",
                                                    json={"model": MODEL, "prompt": list(range(1000, 1064)),
                                                          "max_tokens": 1}))
                await _until(lambda: held.arrived == 1)
                # b routed nothing, yet counts the request a routed as in flight on the worker,
                # and predicts its 4 blocks (16 tokens each) cached there.
                await _until(lambda: b.native.workers()[0]["in_flight"] == 1)
                assert metric(b.metrics_text(), "kvroute_router_index_predicted_entries") == 4
                assert metric(b.metrics_text(), "kvroute_mesh_decisions_open") == 1
                held.release.set()
                response = await sent
                assert response.status == 200
                response.release()
            await _until(lambda: b.native.workers()[0]["in_flight"] == 0)
            text = b.metrics_text()
            assert metric(text, "kvroute_mesh_decisions_open") == 0
            assert metric(text, "kvroute_mesh_messages_received_total") >= 3  # routed, first token, end
            assert metric(text, "kvroute_mesh_messages_lost_total") == 0
            assert metric(text, "kvroute_router_decisions_total") == 0
            assert metric(a.metrics_text(), "kvroute_mesh_messages_sent_total") >= 3


async def test_a_replica_that_stops_is_forgotten_and_its_decisions_released():
    async with _worker() as (held, url):
        async with start_router(_config(url)) as b:
            a = await start_router(_config(url))
            try:
                a.set_peers([b.mesh_address])
                b.set_peers([a.mesh_address])
                await _until(lambda: metric(b.metrics_text(), "kvroute_mesh_peers_live") == 1)
                async with aiohttp.ClientSession() as s:
                    sent = asyncio.ensure_future(s.post(f"{a.url}/v1/completions",
                                                        json={"model": MODEL, "prompt": list(range(64)),
                                                              "max_tokens": 1}))
                    await _until(lambda: b.native.workers()[0]["in_flight"] == 1)
                    # a goes without a word about its request: b releases it when its
                    # connection to a closes (or a falls silent, 3 s), not at the decision's TTL.
                    a.native.close()
                    with contextlib.suppress(aiohttp.ClientError):
                        (await sent).release()
            finally:
                await a.close()
            await _until(lambda: metric(b.metrics_text(), "kvroute_mesh_peers_live") == 0, 6.0)
            await _until(lambda: b.native.workers()[0]["in_flight"] == 0, 1.0)
            assert metric(b.metrics_text(), "kvroute_mesh_decisions_expired_total") == 1


async def test_a_replica_that_starts_takes_the_decisions_its_peer_has_in_flight():
    async with _worker() as (held, url), start_router(_config(url)) as a, aiohttp.ClientSession() as s:
        sent = asyncio.ensure_future(s.post(f"{a.url}/v1/completions",
                                            json={"model": MODEL, "prompt": list(range(2000, 2064)),
                                                  "max_tokens": 1}))
        await _until(lambda: held.arrived == 1)
        # b starts after a routed the request: it never hears that decision, only a's snapshot.
        async with start_router(_config(url)) as b:
            a.set_peers([b.mesh_address])
            b.set_peers([a.mesh_address])
            await _until(lambda: metric(b.metrics_text(), "kvroute_mesh_snapshots_adopted_total") == 1)
            text = b.metrics_text()
            assert metric(text, "kvroute_mesh_snapshot_decisions_total") == 1
            assert metric(text, "kvroute_mesh_decisions_open") == 1
            assert b.native.workers()[0]["in_flight"] == 1
            # No first token yet: the snapshot carried the prompt's 4 blocks for the prediction.
            assert metric(text, "kvroute_router_index_predicted_entries") == 4
            assert 0 <= metric(text, "kvroute_mesh_snapshot_adopted_seconds") < 5
            assert metric(a.metrics_text(), "kvroute_mesh_snapshots_sent_total") >= 1
            assert metric(a.metrics_text(), "kvroute_mesh_snapshots_adopted_total") == 0
            held.release.set()
            response = await sent
            assert response.status == 200
            response.release()
            # a's end releases it on b as on a peer decision b had heard itself.
            await _until(lambda: b.native.workers()[0]["in_flight"] == 0)
            assert metric(b.metrics_text(), "kvroute_mesh_decisions_open") == 0


def test_peers_without_a_mesh_address_are_refused():
    with pytest.raises(UserError, match="mesh"):
        Router(RouterConfig(workers=["http://127.0.0.1:9"], peers=("127.0.0.1:5600",)))
