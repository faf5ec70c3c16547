"""kv-aware's admission guard live: with it on (``--policy-option admission_wait=0.2``) or
retention on, ``kvroute serve`` reads each worker's KV capacity from its engine's ``/metrics``
(``vllm:cache_config_info``'s ``num_gpu_blocks``, less the null block); with the guard it
counts the blocks its requests in flight pin there; both are exported. A configured capacity
takes the place of what the engines say, and a router with neither asks nothing."""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np

from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.router import RouterConfig, start_router

MODEL = "Qwen/Qwen3-0.6B"


def samples(text: str, name: str) -> dict[str, float]:
    """A per-worker metric's samples by worker name."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels.split('worker="', 1)[1].split('"', 1)[0]] = float(value)
    return out


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200
        return await r.text()


async def _capacities(url: str, want: int) -> dict[str, float]:
    """The router's per-worker capacity gauge once it lists ``want`` workers (10 s at most)."""
    for _ in range(200):
        found = samples(await _metrics(url), "kvroute_router_worker_kv_capacity_blocks")
        if len(found) == want:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"capacities never known: {found}")


async def _workers(blocks: list[int]):
    config = [
        EmulatorConfig.for_model("qwen3-0.6b", timing="instant", max_model_len=1024,
                                 num_gpu_blocks_override=b)
        for b in blocks
    ]
    return [(await start_workers(c, 1))[0] for c in config]


def test_the_router_reads_each_workers_capacity_and_counts_what_its_requests_pin():
    async def main():
        workers = await _workers([120, 300])
        router = await start_router(RouterConfig(workers=[w.url for w in workers], policy="kv-aware",
                                                 policy_options={"admission_wait": 0.2}))
        try:
            capacity = await _capacities(router.url, 2)
            assert sorted(capacity.values()) == [119.0, 299.0]
            rng = np.random.default_rng(0)
            async with aiohttp.ClientSession() as s:
                async def one():
                    prompt = rng.integers(1000, 30000, 200).tolist()
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
                    async with s.post(f"{router.url}/v1/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                await asyncio.gather(*(one() for _ in range(8)))
            text = await _metrics(router.url)
            # Every request ended: nothing pinned, and the guard had no reason to move any.
            assert set(samples(text, "kvroute_router_worker_pinned_blocks").values()) == {0.0}
            assert "kvroute_router_admission_diversions_total 0.0" in text
        finally:
            await router.close()
            for w in workers:
                await w.close()

    asyncio.run(main())


def test_retention_reads_the_capacity_too_a_configured_one_wins_and_neither_asks_nothing():
    async def main():
        workers = await _workers([120])
        url = workers[0].url
        retaining = await start_router(RouterConfig(workers=[url], retention="auto"))
        configured = await start_router(RouterConfig(workers=[url], kv_capacity_blocks=500,
                                                     policy_options={"admission_wait": 0.2}))
        plain = await start_router(RouterConfig(workers=[url], retention="off"))
        try:
            assert await _capacities(retaining.url, 1) == {url: 119.0}
            assert "kvroute_router_admission_diversions" not in await _metrics(retaining.url)
            assert await _capacities(configured.url, 1) == {url: 500.0}
            await asyncio.sleep(0.6)  # two of the capacity loop's ticks
            text = await _metrics(plain.url)
            assert not samples(text, "kvroute_router_worker_kv_capacity_blocks")
            assert "kvroute_router_admission_diversions" not in text
        finally:
            for r in (retaining, configured, plain):
                await r.close()
            await workers[0].close()

    asyncio.run(main())
