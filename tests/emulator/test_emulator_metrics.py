"""The emulator's /metrics and hit accounting: vLLM's names read by prometheus_client's own
parser, counters that agree exactly with per-request usage, cache behaviour identical to the
engine model driven directly, and TTFT matching the cost model.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.emulator.worker import make_output_generator
from kvroute.engine import Engine, EngineRequest
from kvroute.tokens import load_tokenizer

MODEL = "metrics-model"


async def scrape(url: str) -> dict[str, list]:
    """``/metrics`` parsed by prometheus_client: family name -> samples."""
    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(metrics: dict, sample_name: str, **labels) -> float:
    family = sample_name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    samples = [
        s for s in metrics[family]
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(samples) == 1, (sample_name, labels, metrics.get(family))
    return samples[0].value


async def complete(url: str, prompt: list[int], max_tokens: int = 4, stream: bool = False) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            if not stream:
                return await r.json()
            chunks = [json.loads(line[6:]) for line in (await r.text()).split("\n\n") if line.startswith("data: {")]
            return chunks[-1]


def cached(response: dict) -> int:
    details = response["usage"].get("prompt_tokens_details")
    return details["cached_tokens"] if details else 0


def workload(seed: int, n: int, block_size: int) -> list[list[int]]:
    """Prompts over a few shared prefixes of different lengths, with unique suffixes: hits,
    partial hits and (with a small cache) evictions."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(1000, 8000, size=k * block_size + 3).tolist() for k in (2, 5, 8, 11)]
    prompts = []
    for _ in range(n):
        prefix = prefixes[int(rng.integers(len(prefixes)))]
        prompts.append(prefix + rng.integers(1000, 8000, size=int(rng.integers(1, 40))).tolist())
    return prompts


def config(**overrides) -> EmulatorConfig:
    settings = dict(
        served_model_name=(MODEL,),
        timing="instant",
        max_model_len=512,
        enable_prompt_tokens_details=True,
    )
    return EmulatorConfig.for_model("qwen3-0.6b", **{**settings, **overrides})


async def test_metrics_have_vllm_names_labels_and_types():
    cfg = config(num_gpu_blocks_override=100)
    (w,) = await start_workers(cfg, 1)
    try:
        await complete(w.url, list(range(1000, 1040)))
        m = await scrape(w.url)
    finally:
        await w.close()
    labels = {"model_name": MODEL, "engine": "0"}
    for counter in (
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
        "vllm:prompt_tokens", "vllm:prompt_tokens_cached", "vllm:generation_tokens",
    ):
        assert value(m, f"{counter}_total", **labels) >= 0, counter
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(m, gauge, **labels) == 0, gauge
    assert value(m, "vllm:prompt_tokens_total", **labels) == 40
    assert value(m, "vllm:generation_tokens_total", **labels) == 4
    assert value(m, "vllm:request_success_total", finished_reason="length", **labels) == 1
    assert value(m, "vllm:time_to_first_token_seconds_count", **labels) == 1
    buckets = [s for s in m["vllm:time_to_first_token_seconds"] if s.name.endswith("_bucket")]
    assert [s.labels["le"] for s in buckets][:3] == ["0.001", "0.005", "0.01"]
    assert buckets[-1].labels["le"] == "+Inf" and len(buckets) == 23
    (info,) = m["vllm:cache_config_info"]
    assert info.value == 1
    assert info.labels["block_size"] == "16"
    assert info.labels["num_gpu_blocks"] == "100"
    assert info.labels["enable_prefix_caching"] == "True"
    assert info.labels["engine"] == "0"
    assert "prefix_caching_hash_algo" in info.labels


async def test_num_gpu_blocks_follow_kv_cache_memory_bytes():
    cfg = EmulatorConfig.for_model("qwen3-0.6b", timing="instant")
    assert cfg.num_gpu_blocks == 585  # 1 GiB at 114,688 B/token, block 16
    tiny = EmulatorConfig.for_model("tiny-cpu", timing="instant", kv_cache_memory_bytes=4 << 20)
    assert (tiny.block_size, tiny.num_gpu_blocks) == (128, 64)  # docs/vllm.md: 4M -> 64 blocks
    (w,) = await start_workers(tiny, 1)
    try:
        (info,) = (await scrape(w.url))["vllm:cache_config_info"]
    finally:
        await w.close()
    assert info.labels["num_gpu_blocks"] == "64" and info.labels["block_size"] == "128"


@pytest.mark.parametrize("stream", [False, True])
async def test_cached_tokens_sum_equals_hits_counter_delta(stream):
    # A small cache (40 blocks of 16) so the window sees hits, partial hits and evictions.
    (w,) = await start_workers(config(num_gpu_blocks_override=40), 1)
    try:
        for prompt in workload(7, 5, 16):  # traffic before the window
            await complete(w.url, prompt)
        before = await scrape(w.url)
        responses = [await complete(w.url, p, stream=stream) for p in workload(8, 40, 16)]
        after = await scrape(w.url)
    finally:
        await w.close()

    def delta(name):
        return value(after, name) - value(before, name)

    cached_sum = sum(cached(r) for r in responses)
    prompt_sum = sum(r["usage"]["prompt_tokens"] for r in responses)
    assert 0 < cached_sum < prompt_sum
    assert delta("vllm:prefix_cache_hits_total") == cached_sum
    assert delta("vllm:prompt_tokens_cached_total") == cached_sum
    assert delta("vllm:prefix_cache_queries_total") == prompt_sum
    assert delta("vllm:prompt_tokens_total") == prompt_sum


async def test_emulator_cached_tokens_equal_the_engine_model():
    cfg = config(num_gpu_blocks_override=40)
    prompts = workload(11, 60, cfg.block_size)
    max_tokens = 20
    (w,) = await start_workers(cfg, 1)
    try:
        emulated = [cached(await complete(w.url, p, max_tokens)) for p in prompts]
    finally:
        await w.close()

    # The same requests, one at a time, through the engine model with no clock at all.
    textgen = make_output_generator(load_tokenizer(None))
    engine = Engine(cfg.num_gpu_blocks, cfg.block_size, cfg.cost)
    modelled = []
    for i, prompt in enumerate(prompts):
        request = EngineRequest(str(i), prompt, textgen.tokens(prompt, max_tokens), 0.0)
        engine.add_request(request)
        while engine.has_work:
            engine.step(0.0)
        modelled.append(request.num_cached_tokens)
    assert emulated == modelled
    assert any(emulated) and not all(emulated)  # the workload has both hits and misses


async def test_gauges_show_running_waiting_and_kv_usage():
    # One sequence at a time, real time: the second request waits while the first decodes.
    cfg = config(timing="reference-gpu", max_num_seqs=1)
    (w,) = await start_workers(cfg, 1)
    try:
        tasks = [asyncio.create_task(complete(w.url, list(range(2000 + i, 2100 + i)), 30)) for i in range(2)]
        await asyncio.sleep(0.1)  # front end 23 ms + prefill ~9 ms: first one is decoding
        busy = await scrape(w.url)
        await asyncio.gather(*tasks)
        idle = await scrape(w.url)
    finally:
        await w.close()
    assert value(busy, "vllm:num_requests_running") == 1
    assert value(busy, "vllm:num_requests_waiting") == 1
    assert value(busy, "vllm:kv_cache_usage_perc") > 0
    # vLLM counts only blocks held by running requests: idle reads 0 with a warm cache.
    assert value(idle, "vllm:kv_cache_usage_perc") == 0
    assert value(idle, "vllm:num_requests_running") == value(idle, "vllm:num_requests_waiting") == 0


async def _ttft(url: str, prompt: list[int]) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "stream": True}
    async with aiohttp.ClientSession() as s:
        start = time.perf_counter()
        async with s.post(f"{url}/v1/completions", json=body) as r:
            await r.content.readuntil(b"\n\n")
            ttft = time.perf_counter() - start
            await r.read()
    return ttft


async def _machine_delay(rng, tokens: int) -> float:
    """What this machine adds to a TTFT now, beyond the model's time, which a loaded machine
    makes longer: serving the request (the fastest TTFT of three requests of ``tokens``
    distinct tokens to a worker whose model takes no time: HTTP, parsing, hashing), and waking
    the worker's loop from its two sleeps, the front end's and the step's (the slowest
    overshoot of ten short sleeps, twice)."""
    (w,) = await start_workers(config(timing="instant", max_model_len=4096), 1)
    try:
        await _ttft(w.url, list(range(1000, 1016)))  # warm the connection path
        serving = min([await _ttft(w.url, rng.integers(1000, 8000, size=tokens).tolist()) for _ in range(3)])
    finally:
        await w.close()
    overshoot = 0.0
    for _ in range(10):
        start = time.perf_counter()
        await asyncio.sleep(0.005)
        overshoot = max(overshoot, time.perf_counter() - start - 0.005)
    return serving + 2 * overshoot


async def test_ttft_matches_the_cost_model_at_low_load():
    # The reference request, at real time: 2,032 shared tokens (127 blocks) + 339 unique.
    cfg = config(timing="reference-gpu", max_model_len=4096)
    cost = cfg.cost
    rng = np.random.default_rng(3)
    prefix = rng.integers(1000, 8000, size=2032).tolist()
    (w,) = await start_workers(cfg, 1)
    try:
        await _ttft(w.url, list(range(1000, 1016)))  # warm the connection path
        misses, hits = [], []
        for _ in range(4):
            misses.append(await _ttft(w.url, rng.integers(1000, 8000, size=2371).tolist()))
            hits.append(await _ttft(w.url, prefix + rng.integers(1000, 8000, size=339).tolist()))
        metrics = await scrape(w.url)
    finally:
        await w.close()
    delay = await _machine_delay(rng, 2371)
    predicted_miss = cost.frontend_s + cost.step_time(2371, 0)
    predicted_hit = cost.frontend_s + cost.step_time(339, 0)
    # The first "hit" computed the prefix: it is a miss; the rest hit. The fastest sample is
    # the estimate: a busy machine only ever adds delay to the model's time, at most what it
    # adds to a request now.
    miss_ttft = min(misses + hits[:1])
    hit_ttft = min(hits[1:])
    assert predicted_miss * 0.8 <= miss_ttft <= predicted_miss * 1.2 + delay, (miss_ttft, predicted_miss, delay)
    assert predicted_hit * 0.8 <= hit_ttft <= predicted_hit * 1.2 + delay, (hit_ttft, predicted_hit, delay)
    assert value(metrics, "vllm:time_to_first_token_seconds_count") == 9


async def test_time_scale_keeps_ratios():
    cfg = config(timing="reference-gpu", time_scale=4.0, max_model_len=4096)
    base = config(timing="reference-gpu", max_model_len=4096).cost
    assert cfg.cost.step_time(2371, 0) == pytest.approx(base.step_time(2371, 0) / 4)
    assert cfg.cost.frontend_s == pytest.approx(base.frontend_s / 4)
    rng = np.random.default_rng(9)
    (w,) = await start_workers(cfg, 1)
    try:
        # Three distinct prompts (all misses); the fastest is the estimate, as above.
        ttft = min([await _ttft(w.url, rng.integers(1000, 8000, size=2371).tolist()) for _ in range(3)])
    finally:
        await w.close()
    delay = await _machine_delay(rng, 2371)
    predicted = cfg.cost.frontend_s + cfg.cost.step_time(2371, 0)
    # Unscaled, the model's time alone would be 4 × predicted.
    assert predicted * 0.8 <= ttft <= predicted * 1.2 + delay, (ttft, predicted, delay)
