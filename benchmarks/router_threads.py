"""One router replica, many cores: throughput and CPU per request against ``kvroute serve
--threads`` 1, 2, 4, …, and where the routing step's locks make threads wait.

Emulated workers (``instant`` timing: answers take no model time, so what is measured is the
router's HTTP, JSON, hashing and routing) publish KV events to the router as a real fleet does;
the reference workload's prompts (K = 24 shared prefixes, ~2,400 tokens) go as token ids on
keep-alive connections. The load comes from ``--clients`` separate client processes (this
script in client mode), so the generator is not one Python thread competing with the router:
their CPU is reported beside the router's, and a row where the clients use about as many
cores as the machine has left is a row where the generator, not the router, set the pace. The
emulated workers' CPU is reported too: they are one Python process (one core at most), so on
a small machine they, not the router, may cap the rate.

Per ``--threads`` value: requests/s; the router's CPU per request (user + system of its
process, from /proc) and the cores it kept busy; and, from the router's own counters
(``kvroute_router_lock_*``), how often a request's thread found the fleet's lock (the routing
step: policy, load accounting, retention) or the index's lock (shared with the KV-event
consumer's thread) held by another, and how long it waited, per request.

    python benchmarks/router_threads.py [--threads 1,2,4] [--requests 3000] [--clients 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import time

import aiohttp

from kvroute.bench.prompts import PromptEncoder, reference_workload
from kvroute.workers import cpu_seconds, launch_emulated
from kvroute.workload import WorkloadSpec

MODEL = "Qwen/Qwen3-0.6B"


def workload_bodies(requests: int, seed: int) -> list[tuple[str, bytes]]:
    """The reference workload's measured requests as (path, body), the same in every process."""
    spec = WorkloadSpec(prefixes=24, requests=requests, output_tokens=1, seed=seed)
    workload = reference_workload(spec, PromptEncoder("ids", MODEL))
    return [(r.path, r.body) for r in workload.warmup + workload.requests]


async def client(url: str, requests: int, concurrency: int, seed: int, part: int, parts: int) -> None:
    """Client mode: send this process's share of the requests, ``concurrency`` at a time."""
    bodies = workload_bodies(requests, seed)[part::parts]
    queue = list(reversed(bodies))
    failed = 0

    async def user(s: aiohttp.ClientSession) -> None:
        nonlocal failed
        while queue:
            path, body = queue.pop()
            async with s.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                failed += r.status != 200

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await asyncio.gather(*(user(s) for _ in range(concurrency)))
    print(json.dumps({"failed": failed}))


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


def lock_figures(text: str) -> dict[str, dict[str, float]]:
    """``{lock: {acquired, contended, wait_s}}`` from the router's ``kvroute_router_lock_*``."""
    out: dict[str, dict[str, float]] = {}
    for key, metric in (("acquired", "acquisitions"), ("contended", "contentions"), ("wait_s", "wait_seconds")):
        for lock, value in re.findall(rf'^kvroute_router_lock_{metric}_total{{lock="(\w+)"}} (\S+)', text, re.M):
            out.setdefault(lock, {})[key] = float(value)
    return out


async def measure(args, threads: int, urls_events, workers_pid: int) -> dict:
    cmd = [sys.executable, "-m", "kvroute", "serve", "--port", "0", "--threads", str(threads),
           "--health-interval", "5"]
    for url, events, replay in urls_events:
        cmd += ["--worker", url, "--kv-events", f"{url}={events},{replay}"]
    router = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(router.stdout.readline(), 30)).decode()
        url = line.split("listening on ")[1].split(",")[0]
        await asyncio.sleep(0.3)  # subscriptions
        # Warm up: every prefix once and the connections' first requests.
        await asyncio.to_thread(run_clients, args, url, min(args.requests, 200))
        before = lock_figures(await scrape(url))
        cpu0, t0, wcpu0 = cpu_seconds(router.pid), time.perf_counter(), cpu_seconds(workers_pid)
        client_cpu = await asyncio.to_thread(run_clients, args, url, args.requests)
        elapsed, cpu = time.perf_counter() - t0, cpu_seconds(router.pid) - cpu0
        workers_cpu = cpu_seconds(workers_pid) - wcpu0
        after = lock_figures(await scrape(url))
    finally:
        router.terminate()
        await router.wait()
    n = args.requests + 24  # the workload's warmup requests are sent too
    row = {"threads": threads, "requests": n, "req_per_s": n / elapsed,
           "router_cpu_us_per_request": 1e6 * cpu / n, "router_cores": cpu / elapsed,
           "client_cores": client_cpu / elapsed, "worker_cores": workers_cpu / elapsed}
    for lock in ("fleet", "index"):
        a, b = after.get(lock, {}), before.get(lock, {})
        acquired = a.get("acquired", 0) - b.get("acquired", 0)
        row[f"{lock}_contended_share"] = (a.get("contended", 0) - b.get("contended", 0)) / max(acquired, 1)
        row[f"{lock}_wait_us_per_request"] = 1e6 * (a.get("wait_s", 0) - b.get("wait_s", 0)) / n
    return row


def run_clients(args, url: str, requests: int) -> float:
    """Run ``--clients`` client processes to the end; their CPU seconds."""
    per = max(1, args.concurrency // args.clients)
    children_cpu()  # count from here
    procs = [subprocess.Popen([sys.executable, __file__, "--client", url, "--requests", str(requests),
                               "--concurrency", str(per), "--part", str(i), "--parts", str(args.clients)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(args.clients)]
    for p in procs:
        out, err = p.communicate(timeout=600)
        lines = out.decode().strip().splitlines()
        if p.returncode != 0 or not lines or json.loads(lines[-1])["failed"]:
            raise RuntimeError(f"a client failed: {err.decode()[-500:]} {out.decode()[-200:]}")
    return children_cpu()


_children_total = [0.0]


def children_cpu() -> float:
    """CPU seconds of the children reaped since the previous call (the clients; the router
    and the workers are reaped only at the end)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    delta, _children_total[0] = total - _children_total[0], total
    return delta


def machine() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return f"{os.cpu_count()} CPUs (lscpu unavailable)"
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    pick = [f"{k.strip()}: {fields[k].strip()}" for k in ("Model name", "CPU(s)", "Thread(s) per core") if k in fields]
    return "; ".join(pick)


def mistake(args: argparse.Namespace) -> str | None:
    """What is wrong with the options, in one line (None: nothing)."""
    for flag, value in (("--workers", args.workers), ("--requests", args.requests), ("--clients", args.clients)):
        if value < 1:
            return f"{flag} must be >= 1, got {value}"
    if args.concurrency < args.clients:
        return f"--concurrency ({args.concurrency}) must be at least --clients ({args.clients}): streams per client"
    threads = args.threads.split(",")
    if not all(t.strip().isdigit() and int(t) >= 1 for t in threads):
        return f"--threads takes a comma list of counts >= 1, got {args.threads!r}"
    return None


async def main(args: argparse.Namespace) -> None:
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
    fleet = await launch_emulated(args.workers, ["--timing", "instant", "--kv-events-config", events])
    try:
        urls_events = [(url, *events) for url, events in zip(fleet.urls, fleet.kv_events)]
        rows = []
        for threads in [int(t) for t in args.threads.split(",")]:
            rows.append(await measure(args, threads, urls_events, fleet.process.pid))
            print(f"  --threads {threads}: {rows[-1]['req_per_s']:.0f} req/s", file=sys.stderr)
    finally:
        await fleet.close()
    print(f"machine: {machine()}")
    print(f"router threads: {args.workers} instant workers with KV events, K=24 reference prompts as token ids, "
          f"1 output token, keep-alive, {args.clients} client processes × {args.concurrency // args.clients} "
          f"streams, {args.requests} requests per row")
    print(f"{'threads':>7s} {'req/s':>7s} {'CPU/req':>9s} {'router cores':>12s} {'client cores':>12s} "
          f"{'worker cores':>12s} "
          f"{'fleet lock: contended':>22s} {'wait/req':>9s} {'index lock: contended':>22s} {'wait/req':>9s}")
    for r in rows:
        print(f"{r['threads']:7d} {r['req_per_s']:7.0f} {r['router_cpu_us_per_request']:6.0f} µs "
              f"{r['router_cores']:12.2f} {r['client_cores']:12.2f} {r['worker_cores']:12.2f} "
              f"{100 * r['fleet_contended_share']:21.2f}% {r['fleet_wait_us_per_request']:6.1f} µs "
              f"{100 * r['index_contended_share']:21.2f}% {r['index_wait_us_per_request']:6.1f} µs")
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2,4", help="kvroute serve --threads values (default %(default)s)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=3000, help="measured requests per row")
    parser.add_argument("--concurrency", type=int, default=64, help="streams over all client processes")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    parser.add_argument("--client", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--part", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--parts", type=int, default=1, help=argparse.SUPPRESS)
    from kvroute import aio

    parsed = parser.parse_args()
    if parsed.client:
        aio.run(client(parsed.client, parsed.requests, parsed.concurrency, parsed.seed, parsed.part, parsed.parts))
    elif (why := mistake(parsed)) is not None:
        sys.stderr.write(f"error: {why}\n")
        sys.exit(2)
    else:
        aio.run(main(parsed))
