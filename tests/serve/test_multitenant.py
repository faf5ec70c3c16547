"""Fleets with many tenants: LoRA adapters and cache salts in the emulator (vLLM's block-hash
keys, KV events and /v1/models), and through the native router (hashes under the same keys,
routing only among the workers that serve a model, vLLM's 404 for an unknown one)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from support.kv_events import EVENTS, events_for
from support.waiting import until

from kvroute.blocks import BlockHasher
from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.engine import BlockStored
from kvroute.router import WORKER_HEADER, RouterConfig, start_router

BS = 16
ADAPTERS = (("sql", "/adapters/sql"), ("chat", "/adapters/chat"))


def lora_config(**overrides) -> EmulatorConfig:
    base = dict(
        timing="instant", max_model_len=1024, enable_prompt_tokens_details=True,
        enable_lora=True, lora_modules=ADAPTERS, max_loras=2,
    )
    return EmulatorConfig.for_model("qwen3-0.6b", **(base | overrides))


async def post(session, url: str, body: dict, route: str = "/v1/completions") -> tuple[int, dict, str | None]:
    async with session.post(f"{url}{route}", json=body) as r:
        return r.status, await r.json(), r.headers.get(WORKER_HEADER)


def cached(answer: dict) -> int:
    details = answer["usage"]["prompt_tokens_details"]  # None when nothing was cached, as vLLM's
    return details["cached_tokens"] if details else 0


PROMPT = list(range(1000, 1000 + 4 * BS + 3))


async def test_the_emulator_lists_adapters_and_keys_its_cache_by_adapter_and_salt():
    (worker,) = await start_workers(lora_config(), 1)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{worker.url}/v1/models") as r:
                cards = {c["id"]: c for c in (await r.json())["data"]}
            base = worker.worker.config.model_name
            assert cards[base]["parent"] is None
            assert (cards["sql"]["parent"], cards["sql"]["root"]) == (base, "/adapters/sql")

            async def run(**fields) -> int:
                status, answer, _ = await post(s, worker.url, {"prompt": PROMPT, "max_tokens": 1, **fields})
                assert status == 200, answer
                return cached(answer)

            assert await run(cache_salt="t1") == 0
            assert await run(cache_salt="t1") == 4 * BS
            assert await run(cache_salt="t2") == 0  # another tenant's salt
            assert await run() == 0  # no salt: the salted copies are not this prompt's
            assert await run(model="sql") == 0  # an adapter's blocks are its own
            assert await run(model="sql") == 4 * BS
            assert await run(model="chat") == 0
            _, answer, _ = await post(s, worker.url, {"prompt": PROMPT, "max_tokens": 1, "model": "sql"})
            assert answer["model"] == "sql"
            for bad in ("", 3):
                status, answer, _ = await post(s, worker.url, {"prompt": PROMPT, "cache_salt": bad})
                assert status == 400 and answer["error"]["param"] == "cache_salt"
            status, answer, _ = await post(s, worker.url, {"prompt": PROMPT, "model": "nope"})
            assert (status, answer["error"]["type"]) == (404, "NotFoundError")
    finally:
        await worker.close()


def test_lora_settings_are_checked_as_vllm_checks_them():
    from kvroute.errors import UserError

    with pytest.raises(UserError, match="--enable-lora"):
        lora_config(enable_lora=False).validate()
    with pytest.raises(UserError, match="--max-loras"):
        lora_config(max_loras=0).validate()
    with pytest.raises(UserError, match="--lora-modules"):
        lora_config(lora_modules=(("sql", "/a"), ("sql", "/b"))).validate()


async def test_the_engine_publishes_vllms_lora_fields_and_extra_keys():
    from kvroute.engine import Engine, EngineRequest
    from kvroute.engine.cost import get_preset

    engine = Engine(64, BS, get_preset("instant"), emit_events=True)
    request = EngineRequest(
        "r", PROMPT, [7], 0.0, lora_name="sql", lora_id=1, cache_salt="t1",
    )
    engine.add_request(request)
    stored: list[BlockStored] = []
    while engine.has_work:
        result = engine.step(0.0)
        if result.events is not None:
            stored += [e for e in result.events.events if isinstance(e, BlockStored)]
    (event,) = stored
    assert (event.lora_id, event.lora_name) == (1, "sql")
    assert event.extra_keys == [("sql", "t1"), ("sql",), ("sql",), ("sql",)]
    own = BlockHasher(BS).hash_blocks(PROMPT, lora_name="sql", cache_salt="t1")
    assert event.block_hashes == own  # the engine model's hashes are kvroute's own


async def test_max_loras_makes_another_adapter_wait_for_a_slot():
    from kvroute.engine import Engine, EngineRequest
    from kvroute.engine.cost import get_preset

    engine = Engine(64, BS, get_preset("instant"))
    engine.set_lora_slots(1, 0.25)
    for i, name in enumerate(("sql", "chat")):
        engine.add_request(EngineRequest(name, PROMPT, [7, 8], 0.0, lora_name=name, lora_id=i + 1))
    first = engine.step(0.0)
    assert [o.request.request_id for o in first.outputs] == ["sql"]
    assert first.end == 0.25
    now = first.end
    while engine.has_work:
        now = engine.step(now).end
    assert (engine.lora_loads, now) == (2, 0.5)



async def test_the_router_routes_salted_and_adapter_traffic_on_the_hits_it_can_get():
    """Two tenants send the same prompt with their own salts, under an adapter: each
    tenant's repeats go where its own copy is, and the router's hashes match the events."""
    workers = await start_workers(lora_config(kv_events_config=EVENTS), 3)
    try:
        config = RouterConfig(
            workers=[w.url for w in workers], predicted_ttl_s=0.0, health_interval_s=0.1,
            events=events_for(workers),
        )
        async with start_router(config) as router, aiohttp.ClientSession() as s:
            names = list(router.worker_statuses())
            hasher = BlockHasher(BS)
            # The router learns which names are adapters from /v1/models.
            await asyncio.sleep(0.5)
            owners = {}
            for tenant in ("t1", "t2"):
                body = {"prompt": PROMPT, "max_tokens": 1, "model": "sql", "cache_salt": tenant}
                status, answer, owner = await post(s, router.url, body)
                assert status == 200, answer
                owners[tenant] = owner
                mine = hasher.hash_blocks(PROMPT, lora_name="sql", cache_salt=tenant)
                await until(lambda m=mine, o=owner: router.index.overlaps(m, names, time.monotonic())[names.index(o)] == 4)
            assert router.index.stats().skipped_blocks == 0
            for tenant in ("t1", "t2"):
                for _ in range(3):
                    body = {"prompt": PROMPT, "max_tokens": 1, "model": "sql", "cache_salt": tenant}
                    status, answer, worker = await post(s, router.url, body)
                    assert (worker, cached(answer)) == (owners[tenant], 4 * BS)
    finally:
        await asyncio.gather(*(w.close() for w in workers))


async def test_a_model_goes_only_to_the_workers_that_serve_it():
    """Six workers, two of them serving model B: no request for B goes elsewhere, and a
    model no worker serves gets vLLM's 404."""
    base = EmulatorConfig.for_model("qwen3-0.6b", timing="instant", max_model_len=1024)
    serving_b = EmulatorConfig.for_model(
        "qwen3-0.6b", timing="instant", max_model_len=1024, served_model_name=("B",)
    )
    workers = await start_workers(base, 4) + await start_workers(serving_b, 2)
    try:
        config = RouterConfig(workers=[w.url for w in workers], health_interval_s=0.1)
        async with start_router(config) as router, aiohttp.ClientSession() as s:
            await asyncio.sleep(0.6)  # a health round: the router reads every /v1/models
            b_names = set(list(router.worker_statuses())[4:])
            seen = set()
            for i in range(30):
                body = {"prompt": [i, *PROMPT], "max_tokens": 1, "model": "B"}
                status, answer, worker = await post(s, router.url, body)
                assert status == 200, answer
                assert worker in b_names
                seen.add(worker)
            assert seen == b_names
            status, answer, _ = await post(s, router.url, {"prompt": PROMPT, "model": "C"})
            assert status == 404
            assert answer["error"] == {
                "message": "The model `C` does not exist.", "type": "NotFoundError",
                "param": "model", "code": 404,
            }
    finally:
        await asyncio.gather(*(w.close() for w in workers))


def test_emulated_workers_serve_the_workloads_adapters_in_their_slots():
    import argparse

    from kvroute.commands import emulate
    from kvroute.workload import adapter_name, emulated_lora_args

    assert emulated_lora_args(0, 4) == []
    parser = argparse.ArgumentParser()
    emulate.add_arguments(parser)
    config = emulate.config_from_args(parser.parse_args(emulated_lora_args(2, 3)))
    assert (config.enable_lora, config.max_loras) == (True, 3)
    assert [name for name, _ in config.lora_modules] == [adapter_name(0), adapter_name(1)]


def test_a_tenant_workload_is_the_same_prompts_under_each_prefixs_adapter_and_salt():
    import msgspec

    from kvroute.bench.prompts import PromptEncoder, reference_workload
    from kvroute.workload import WorkloadSpec

    plain = WorkloadSpec(prefixes=24, requests=100, seed=3)
    tenants = WorkloadSpec(prefixes=24, requests=100, seed=3, adapters=8, adapter_zipf=1.0, salted=True)
    adapters = tenants.adapter_of_prefix()
    assert adapters == tenants.adapter_of_prefix()  # seeded
    assert len(set(adapters)) > 1 and adapters.count(0) >= adapters.count(7)  # skewed to rank 1
    encoder = PromptEncoder("ids", "base")
    a, b = reference_workload(plain, encoder), reference_workload(tenants, encoder)
    for x, y in zip(a.requests, b.requests, strict=True):
        bx, by = msgspec.json.decode(x.body), msgspec.json.decode(y.body)
        assert bx["prompt"] == by["prompt"] and bx["model"] == "base" and "cache_salt" not in bx
        adapter = adapters[y.prefix_id]
        assert (by["model"], by["cache_salt"]) == (f"adapter-{adapter}", f"tenant-{adapter}")


async def test_retention_refreshes_each_prefix_under_its_own_tenant():
    """Prefixes of two tenants (an adapter and a salt each) in turn on one worker too small for
    them all: retention's refreshes name the adapter and salt of the prefix they keep, so they
    hit its cache (under another tenant's keys they would compute it all again)."""
    import numpy as np

    from kvroute.bench.router_metrics import read_router, router_metrics_url

    blocks = 65  # 64 usable: 4 prefixes of 10 blocks and their requests' own blocks overflow
    config = lora_config(num_gpu_blocks_override=blocks)
    (worker,) = await start_workers(config, 1)
    try:
        rc = RouterConfig(workers=[worker.url], policy="kv-aware", retention="on",
                          kv_capacity_blocks=blocks - 1, health_interval_s=0.1)
        async with start_router(rc) as router, aiohttp.ClientSession() as s:
            await asyncio.sleep(0.3)  # the router reads the worker's adapters
            rng = np.random.default_rng(0)
            prefixes = [rng.integers(1000, 30000, 10 * BS) for _ in range(4)]
            tenants = [("sql", "t0"), ("chat", "t1")]
            for i in range(40):
                model, salt = tenants[i % 4 % 2]
                prompt = np.concatenate([prefixes[i % 4], rng.integers(1000, 30000, 40)]).tolist()
                body = {"prompt": prompt, "max_tokens": 8, "model": model, "cache_salt": salt}
                status, answer, _ = await post(s, router.url, body)
                assert status == 200, answer
            await asyncio.sleep(0.3)  # let the last refreshes come back
            refreshes = (await read_router(router_metrics_url(router.url))).refreshes
            assert refreshes.sent > 0 and refreshes.open == 0
            assert refreshes.prompt_tokens - refreshes.sent <= refreshes.cached_tokens
    finally:
        await worker.close()
