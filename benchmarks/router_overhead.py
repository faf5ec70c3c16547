"""What does the router cost? Added latency versus calling a worker directly, and router CPU
per request, with the reference workload's 2,371-token prompts.

Emulated workers (``instant`` timing: answers take no model time, so every microsecond
measured is HTTP, JSON and routing) run in one child process, ``kvroute serve`` in another,
the client here. The workers get the same local tokenizer as the router (a tiny byte-level
BPE model written on the fly), so matching is exact for every prompt format:

* ``chat``: system = the 2,032-token shared prefix, user = the 339-token suffix; the router
  renders the chat template and tokenizes (segment cache: the shared system prompt once);
* ``ids``: the prompt as token ids (no tokenization anywhere);
* ``text``: the prompt as one string (cut between words where the tokenizer provably cuts,
  pieces cached: the shared prefix once, see the ``kvroute-tokenize`` crate).

Phase 1 (latency): requests one at a time, alternating direct-to-a-worker and through the
router; added latency = router − direct, whole request (stream read to ``[DONE]``).
Phase 2 (CPU): ``--concurrency`` streams through the router; router CPU = the router
process's user+system CPU time over the phase (from /proc) / requests. The router's own
``kvroute_router_routing_seconds`` (parse → tokenize → hash → index → choose) is reported
beside it.

    python benchmarks/router_overhead.py [--formats chat,ids,text] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
import time

import aiohttp
import numpy as np

from kvroute.bench.prompts import PromptEncoder, reference_workload
from kvroute.tinymodel import build_tiny_model
from kvroute.tokens import HFTokenizer, safe_vocabulary
from kvroute.workers import cpu_seconds, launch_emulated
from kvroute.workload import WorkloadSpec


async def start_router(args, urls_events: list[tuple[str, str, str]], tokenizer_dir: str):
    cmd = [sys.executable, "-m", "kvroute", "serve", "--port", "0", "--policy", args.policy,
           "--tokenizer", tokenizer_dir, "--health-interval", "5"]
    for url, events, replay in urls_events:
        cmd += ["--worker", url]
        if args.events:
            cmd += ["--kv-events", f"{url}={events},{replay}"]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
    return proc, line.split("listening on ")[1].split(",")[0]


async def one(session: aiohttp.ClientSession, url: str, path: str, body: bytes) -> float:
    start = time.perf_counter()
    async with session.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
        data = await r.read()
        if r.status != 200 or not data.endswith(b"data: [DONE]\n\n"):
            raise RuntimeError(f"{url}: {r.status} {data[-200:]!r}")
    return time.perf_counter() - start


def session(args) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=args.new_connections, limit=0))


async def scrape_routing_seconds(url: str) -> tuple[float, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    total = float(re.search(r"^kvroute_router_routing_seconds_sum (\S+)", text, re.M).group(1))
    count = float(re.search(r"^kvroute_router_routing_seconds_count (\S+)", text, re.M).group(1))
    return total, count


async def measure(args, fmt: str, tokenizer: HFTokenizer, urls: list[str], router_url: str, router_pid: int) -> dict:
    encoder = PromptEncoder(fmt, "Qwen/Qwen3-0.6B", tokenizer)
    spec = WorkloadSpec(prefixes=args.prefixes, requests=args.requests, output_tokens=args.output_tokens, seed=3)
    workload = reference_workload(spec, encoder, safe_vocabulary(tokenizer))
    # Disjoint requests for the two phases: a repeated prompt would be served from the
    # router's tokenization caches and understate the CPU.
    latency_requests = workload.requests[: args.latency_requests]
    requests = workload.requests[args.latency_requests :]
    async with session(args) as s:
        for r in workload.warmup:  # each prefix once: warm the caches and the index
            await one(s, router_url, r.path, r.body)
        # Phase 1: one at a time, direct and routed interleaved (same requests both ways).
        direct, routed = [], []
        for i, r in enumerate(latency_requests):
            direct.append(await one(s, urls[i % len(urls)], r.path, r.body))
            routed.append(await one(s, router_url, r.path, r.body))
        # Phase 2: throughput through the router, its CPU time measured around it.
        queue = list(requests)
        sum0, count0 = await scrape_routing_seconds(router_url)
        cpu0, t0 = cpu_seconds(router_pid), time.perf_counter()

        async def user() -> None:
            while queue:
                r = queue.pop()
                await one(s, router_url, r.path, r.body)

        await asyncio.gather(*(user() for _ in range(args.concurrency)))
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds(router_pid) - cpu0
        sum1, count1 = await scrape_routing_seconds(router_url)
    n = len(requests)
    added = np.array(routed) - np.array(direct)
    return {
        "format": fmt,
        "prompt_tokens": float(np.mean([r.prompt_tokens for r in workload.requests])),
        "direct_p50_ms": 1e3 * float(np.percentile(direct, 50)),
        "routed_p50_ms": 1e3 * float(np.percentile(routed, 50)),
        "added_p50_ms": 1e3 * float(np.percentile(routed, 50) - np.percentile(direct, 50)),
        "added_p99_ms": 1e3 * float(np.percentile(routed, 99) - np.percentile(direct, 99)),
        "added_pairwise_p50_ms": 1e3 * float(np.percentile(added, 50)),
        "requests": n,
        "req_per_s": n / elapsed,
        "router_cpu_us_per_request": 1e6 * cpu / n,
        "routing_us_per_request": 1e6 * (sum1 - sum0) / max(count1 - count0, 1),
    }


def mistake(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, in one line (None: nothing)."""
    for flag, value in (("--workers", args.workers), ("--prefixes", args.prefixes),
                        ("--latency-requests", args.latency_requests), ("--concurrency", args.concurrency)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.requests <= args.latency_requests:
        return (f"--requests ({args.requests}) must exceed --latency-requests ({args.latency_requests}): the "
                "first are the latency pairs, the rest measure the router's CPU")
    return None


def added(ms: float) -> str:
    """An added latency for the table: a figure, or "noise" where the percentile through the
    router came out below the direct one (a difference of two noisy percentiles, not a gain)."""
    return f"{ms:7.2f}ms" if ms >= 0 else f"{'noise':>9s}"


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_model(tmp)
        tokenizer = HFTokenizer.from_dir(tmp)
        events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                             "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
        fleet = await launch_emulated(args.workers, ["--timing", "instant", "--tokenizer", tmp,
                                                     "--kv-events-config", events])
        router = None
        try:
            urls_events = [(url, *events) for url, events in zip(fleet.urls, fleet.kv_events)]
            router, router_url = await start_router(args, urls_events, tmp)
            await asyncio.sleep(0.3)  # subscriptions
            rows = [await measure(args, fmt, tokenizer, fleet.urls, router_url, router.pid)
                    for fmt in args.formats.split(",")]
        finally:
            if router is not None:
                router.terminate()
                await router.wait()
            await fleet.close()
    conn = "new connection per request" if args.new_connections else "keep-alive connections"
    print(f"router overhead: policy {args.policy}, KV events {'on' if args.events else 'off'}, "
          f"{args.workers} instant workers, K={args.prefixes}, "
          f"{args.output_tokens} output tokens, {conn}; latency at c=1 "
          f"({args.latency_requests} pairs), CPU at c={args.concurrency}")
    print(f"{'format':6s} {'prompt':>7s} {'direct p50':>10s} {'added p50':>9s} {'added p99':>9s} "
          f"{'req/s':>7s} {'router CPU/req':>14s} {'routing/req':>11s}")
    for r in rows:
        print(f"{r['format']:6s} {r['prompt_tokens']:7.0f} {r['direct_p50_ms']:8.2f}ms "
              f"{added(r['added_p50_ms'])} {added(r['added_p99_ms'])} {r['req_per_s']:7.1f} "
              f"{r['router_cpu_us_per_request']:11.0f} µs {r['routing_us_per_request']:8.0f} µs")
    if any(min(r["added_p50_ms"], r["added_p99_ms"]) < 0 for r in rows):
        print("noise: the percentile through the router came out below the direct one; the router's "
              "cost is smaller than what this many pairs resolve (raise --latency-requests)")
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="chat,ids,text", help="prompt formats to measure (default %(default)s)")
    parser.add_argument("--policy", default="kv-aware")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--prefixes", type=int, default=24)
    parser.add_argument("--requests", type=int, default=500,
                        help="measured requests per format: the latency pairs, then the CPU phase")
    parser.add_argument("--latency-requests", type=int, default=100, help="direct/routed pairs at c=1")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--new-connections", action="store_true", help="a new TCP connection per request")
    parser.add_argument("--events", action=argparse.BooleanOptionalAction, default=True,
                        help="feed the router the workers' KV events (default: on; off = predicted mode)")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    from kvroute import aio

    parsed = parser.parse_args()
    if (why := mistake(parsed)) is not None:
        sys.stderr.write(f"error: {why}\n")
        sys.exit(2)
    aio.run(main(parsed))
