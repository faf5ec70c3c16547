"""The engine model caches exactly as a real vLLM does: the same seeded requests, sent one at
a time to one real worker and to the engine model with that worker's geometry, find the same
number of cached tokens, request for request (the ``vllm`` tier).

At concurrency 1 the only thing that decides a request's cached tokens is the cache the
requests before it left behind: which blocks are full, which are evicted first (the tail of
the least recently used request), and that the last prompt token is recomputed. The output
tokens' content does not matter (no later prompt contains them), only how many blocks they
fill. A small cache (47 usable blocks of 128 tokens) against these prompts makes
eviction decide most answers (prompts of 12–16 blocks).
"""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from kvroute.bench.runner import server_cache_config
from kvroute.engine import INSTANT, Engine, EngineRequest
from kvroute.workload import LengthDist, WorkloadSpec, generate

pytestmark = pytest.mark.vllm

#: Token ids the tiny model's vocabulary holds, clear of its special tokens.
VOCAB = np.arange(1000, 8000, dtype=np.uint32)
OUTPUT_TOKENS = 16


def engine_cached_tokens(prompts: list[np.ndarray], num_blocks: int, block_size: int) -> list[int]:
    """The engine model's cached tokens per prompt, sent one at a time under the base model."""
    return engine_cached_tokens_keyed(prompts, [(None, None)] * len(prompts), num_blocks, block_size)


async def test_engine_model_finds_the_cached_tokens_real_vllm_finds(vllm_fleet):
    server = vllm_fleet.servers[0]
    [(num_blocks, block_size)] = await server_cache_config([server.url + "/metrics"])
    workload = generate(
        WorkloadSpec(prefixes=5, prefix_tokens=LengthDist.parse("1400:1800"), suffix_tokens=LengthDist.parse("20:200"),
                     output_tokens=OUTPUT_TOKENS, requests=30, seed=11),
        vocab=VOCAB,
    )
    prompts = [r.prompt_token_ids for r in workload.warmup + workload.requests]
    # Every prompt and its output fit the tier's max-model-len (vLLM shortens max_tokens else).
    assert max(len(p) for p in prompts) + OUTPUT_TOKENS <= vllm_fleet.max_model_len
    real = []
    async with aiohttp.ClientSession() as session:
        async with session.post(server.url + "/reset_prefix_cache") as r:
            assert r.status == 200
        for prompt in prompts:
            body = {"model": vllm_fleet.model, "prompt": prompt.tolist(), "max_tokens": OUTPUT_TOKENS,
                    "ignore_eos": True}
            async with session.post(server.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                usage = (await r.json())["usage"]
            assert usage["completion_tokens"] == OUTPUT_TOKENS
            real.append(usage["prompt_tokens_details"]["cached_tokens"])
    model = engine_cached_tokens(prompts, num_blocks, block_size)
    hits = sum(1 for c in real if c)
    print(f"\n{len(prompts)} requests at concurrency 1 on one real worker ({num_blocks} blocks of {block_size}): "
          f"{hits} hits, {sum(real)} cached tokens; engine model {sum(model)} cached tokens; "
          f"requests that differ: {sum(a != b for a, b in zip(real, model))}")
    assert model == real


#: Tenants of the sequence with adapters and salts: (LoRA module, cache salt); None: none.
TENANTS = ((None, None), ("adapter-0", "t1"), ("adapter-1", None), (None, "t1"))


@pytest.fixture(scope="module")
def lora_server(vllm_fleet):
    """One real vLLM worker of the tier's geometry (``vllm_fleet``'s) serving two LoRA
    adapters of the tiny model (``kvroute make-tiny-model --lora-adapters``' layout), started
    for this module."""
    import asyncio
    import tempfile
    from pathlib import Path

    from kvroute.tinymodel import build_tiny_lora
    from kvroute.workers import VllmServeOptions, start_vllm_servers, terminate_servers, wait_healthy

    install = vllm_fleet.install
    work = Path(tempfile.mkdtemp(prefix="kvroute-vllm-lora-"))
    modules = []
    for i in range(2):
        build_tiny_lora(work / "lora" / f"adapter-{i}", str(install.model_dir), seed=0, index=i)
        modules.append(f"adapter-{i}={work / 'lora' / f'adapter-{i}'}")
    options = VllmServeOptions(
        model_dir=install.model_dir, served_model_names=(vllm_fleet.model,),
        max_model_len=vllm_fleet.max_model_len, kv_cache_memory_bytes=vllm_fleet.kv_cache_memory_bytes,
        enforce_eager=True,
        extra_args=("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", *modules),
    )
    servers = start_vllm_servers(1, install.vllm, options, work, first_index=20)
    try:
        asyncio.run(wait_healthy(servers))
        yield servers[0]
    finally:
        terminate_servers(servers)


def engine_cached_tokens_keyed(
    prompts: list[np.ndarray], tenants: list[tuple[str | None, str | None]], num_blocks: int, block_size: int
) -> list[int]:
    engine = Engine(num_blocks, block_size, INSTANT)
    cached = []
    for i, (prompt, (lora, salt)) in enumerate(zip(prompts, tenants, strict=True)):
        lora_id = None if lora is None else int(lora.rsplit("-", 1)[1]) + 1
        request = EngineRequest(str(i), prompt, VOCAB[:OUTPUT_TOKENS], 0.0,
                                lora_name=lora, lora_id=lora_id, cache_salt=salt)
        engine.add_request(request)
        now = 0.0
        while engine.has_work:
            now = engine.step(now).end
        cached.append(request.num_cached_tokens)
    return cached


async def test_engine_model_finds_real_vllms_cached_tokens_under_adapters_and_salts(lora_server, vllm_fleet):
    """The same prompts under LoRA adapters and cache salts: vLLM keys its blocks by adapter
    (every block) and salt (the first), and so does the engine model, request for request."""
    [(num_blocks, block_size)] = await server_cache_config([lora_server.url + "/metrics"])
    workload = generate(
        WorkloadSpec(prefixes=3, prefix_tokens=LengthDist.parse("1000:1400"), suffix_tokens=LengthDist.parse("20:200"),
                     output_tokens=OUTPUT_TOKENS, requests=30, seed=12),
        vocab=VOCAB,
    )
    requests = workload.warmup + workload.requests
    prompts = [r.prompt_token_ids for r in requests]
    rng = np.random.default_rng(12)
    tenants = [TENANTS[int(t)] for t in rng.integers(0, len(TENANTS), len(prompts))]
    real = []
    async with aiohttp.ClientSession() as session:
        async with session.get(lora_server.url + "/v1/models") as r:
            cards = {c["id"]: c["parent"] for c in (await r.json())["data"]}
        assert cards["adapter-0"] == cards["adapter-1"] == vllm_fleet.model
        for prompt, (lora, salt) in zip(prompts, tenants, strict=True):
            body = {"model": lora or vllm_fleet.model, "prompt": prompt.tolist(), "max_tokens": OUTPUT_TOKENS,
                    "ignore_eos": True}
            if salt is not None:
                body["cache_salt"] = salt
            async with session.post(lora_server.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                usage = (await r.json())["usage"]
            details = usage.get("prompt_tokens_details")
            real.append(details["cached_tokens"] if details else 0)
    model = engine_cached_tokens_keyed(prompts, tenants, num_blocks, block_size)
    print(f"\n{len(prompts)} requests under {len(TENANTS)} tenants on one real worker: {sum(1 for c in real if c)} hits, "
          f"{sum(real)} cached tokens; engine model {sum(model)}; requests that differ: "
          f"{sum(a != b for a, b in zip(real, model))}")
    assert model == real
    assert any(real), "some (prompt, tenant) pairs repeat: there are hits"


async def test_a_router_indexes_real_vllms_adapter_and_salt_blocks_under_their_keys(lora_server, vllm_fleet):
    """vLLM's KV events for a request under an adapter and a salt (its lora_name, and per block
    the extra keys) land in the router's index under kvroute's keyed hashes: the request's own
    hashes find every full block, and the same prompt under other keys finds none."""
    import time

    from kvroute.blocks import BlockHasher
    from kvroute.kvevents import EventsSettings, EventsSource
    from kvroute.router import RouterConfig, start_router

    server = lora_server
    config = RouterConfig(
        workers=[server.url], block_size=vllm_fleet.block_size, predicted_ttl_s=0.0, health_interval_s=0.2,
        events=EventsSettings(per_worker={server.url: EventsSource(server.events_endpoint, server.replay_endpoint)}),
    )
    prompt = VOCAB[100 : 100 + 5 * vllm_fleet.block_size + 7].tolist()
    hasher = BlockHasher(vllm_fleet.block_size)
    async with start_router(config) as router, aiohttp.ClientSession() as session:
        (name,) = router.worker_statuses()
        await asyncio.sleep(1.0)  # the SUB socket connects; the router reads /v1/models
        body = {"model": "adapter-1", "prompt": prompt, "max_tokens": 1, "cache_salt": "t9", "ignore_eos": True}
        async with session.post(router.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        mine = hasher.hash_blocks(prompt, lora_name="adapter-1", cache_salt="t9")
        deadline = time.monotonic() + 10
        while router.index.overlaps(mine, [name], time.monotonic()) != [5]:
            assert time.monotonic() < deadline, router.index.stats()
            await asyncio.sleep(0.05)
        assert router.index.stats().skipped_blocks == 0
        for other in (hasher.hash_blocks(prompt), hasher.hash_blocks(prompt, lora_name="adapter-1"),
                      hasher.hash_blocks(prompt, lora_name="adapter-0", cache_salt="t9")):
            assert router.index.overlaps(other, [name], time.monotonic()) == [0]
