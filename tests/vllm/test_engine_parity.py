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
    engine = Engine(num_blocks, block_size, INSTANT)
    cached = []
    for i, prompt in enumerate(prompts):
        request = EngineRequest(str(i), prompt, VOCAB[:OUTPUT_TOKENS], 0.0)
        engine.add_request(request)
        now = 0.0
        while engine.has_work:
            now = engine.step(now).end
        cached.append(request.num_cached_tokens)
    return cached


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
