"""How much time does the emulator add on top of the engine model it emulates?

Six emulated workers (reference-gpu timing, real time) run in this one process, and a client
in the same process keeps 16 streams in flight over the reference workload (K prefixes of
2,032 tokens + 339-token suffixes, 64 output tokens), picking a worker at random per request
with a new connection each time, as a Kubernetes Service would.

For every request two TTFTs are recorded:

* model: what the engine model scheduled, ``frontend_s + (first token - arrival)`` on the
  engine's own clock, i.e. what the simulator would report for the same schedule;
* client: send to first SSE data byte, on the wall clock.

The difference is the emulator's overhead (HTTP, JSON, event-loop lateness, all on the same
CPU as the client). The target is under 5 ms at p50. Prints figures; not a timed test.

    python benchmarks/emulator_overhead.py [--prefixes 7] [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import aiohttp
import numpy as np

from kvroute.emulator import EmulatorConfig, start_workers
from kvroute.workload import WorkloadSpec, generate


def _instrument(running) -> dict:
    """Remember each request's engine stream, keyed by request id (for its model TTFT)."""
    streams: dict = {}
    for rw in running:
        worker = rw.worker
        original = worker.generate

        async def generate(*args, _original=original, **kwargs):
            stream = await _original(*args, **kwargs)
            streams[stream.request_id] = stream
            return stream

        worker.generate = generate
    return streams


async def _one(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[str, float, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    # A new connection per request (docs/experiment.md, rule 1).
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        start = time.perf_counter()
        async with s.post(f"{url}/v1/completions", json=body) as r:
            first = await r.content.readuntil(b"\n\n")
            ttft = time.perf_counter() - start
            rest = await r.read()
    request_id = json.loads(first[6:])["id"]
    usage = json.loads(rest.split(b"\n\n")[-3][6:])["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return request_id, ttft, cached


async def main(args: argparse.Namespace) -> None:
    config = EmulatorConfig.for_model(
        "qwen3-0.6b", timing="reference-gpu", time_scale=args.time_scale,
        enable_prompt_tokens_details=True,
    )
    running = await start_workers(config, args.workers)
    streams = _instrument(running)
    model = config.model_name
    work = generate(WorkloadSpec(prefixes=args.prefixes, requests=args.requests, seed=1))
    rnd = random.Random(1)
    try:
        for spec in work.warmup:
            await _one(rnd.choice(running).url, model, spec.prompt_token_ids.tolist(), spec.output_tokens)
        queue = list(work.requests)
        results = []

        async def client():
            while queue:
                spec = queue.pop(0)
                url = rnd.choice(running).url
                results.append(await _one(url, model, spec.prompt_token_ids.tolist(), spec.output_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        elapsed = time.perf_counter() - t0
    finally:
        for rw in running:
            await rw.close()

    frontend = config.cost.frontend_s
    client_ttft, model_ttft, hit = [], [], []
    for request_id, ttft, cached in results:
        request = streams[request_id].request
        client_ttft.append(ttft)
        model_ttft.append(frontend + request.first_token_time - request.arrival_time)
        hit.append(cached > 0)
    client_ttft, model_ttft, hit = map(np.asarray, (client_ttft, model_ttft, hit))
    overhead = client_ttft - model_ttft

    def ms(x) -> str:
        return f"{1000 * x:7.2f}"

    print(f"{args.workers} workers, concurrency {args.concurrency}, K={args.prefixes}, "
          f"{len(results)} requests in {elapsed:.1f} s ({len(results) / elapsed:.1f} req/s), "
          f"time scale {args.time_scale:g}, request hit rate {hit.mean():.3f}")
    print("                      p50      p90      p99   (ms)")
    for name, values in (("model TTFT", model_ttft), ("client TTFT", client_ttft),
                         ("overhead", overhead)):
        print(f"  {name:14s} {ms(np.percentile(values, 50))} {ms(np.percentile(values, 90))} "
              f"{ms(np.percentile(values, 99))}")
    for name, mask in (("hits", hit), ("misses", ~hit)):
        if mask.any():
            print(f"  {name:6s} n={int(mask.sum()):4d}  model p50 {ms(np.median(model_ttft[mask]))}  "
                  f"client p50 {ms(np.median(client_ttft[mask]))}")
    added = np.median(client_ttft) - np.median(model_ttft)
    print(f"p50 TTFT added by the emulator: {1000 * added:.2f} ms "
          f"({'under' if added < 0.005 else 'OVER'} the 5 ms target)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prefixes", type=int, default=7)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--time-scale", type=float, default=1.0)
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(main(args))
    except ImportError:
        asyncio.run(main(args))
