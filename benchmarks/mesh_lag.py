"""How late does a replica hear its peers? The replica mesh's lag, live, under the reference load.

Runs ``kvroute experiment``'s router topology (emulated workers at the reference GPU timing,
``--time-scale`` faster, N ``kvroute serve`` replicas meshed behind the Service balancer, the
reference workload) once per replica count and concurrency, reads every replica's
``kvroute_mesh_apply_lag_seconds`` histogram (each peer message from its sending, on the
sender's wall clock, to its being applied to the receiver's routing state) while it runs, and
prints the lag's mean, p50 and p99 over all replicas' messages (quantiles interpolated within
the histogram's buckets), beside the run's request hit rate. The simulator's ``--mesh-lag``
models the same delay (``kvroute sim --router-replicas N --mesh-lag S``).

    python benchmarks/mesh_lag.py [--replicas 2,3] [-c 8,16] [-K 24] [-W 6] [--out DIR]

The figures depend on the machine's load: give its load average with them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import aiohttp

from kvroute.bench.runner import BenchTarget, BenchWorkload, SweepHooks
from kvroute.bench.writer import ResultsWriter
from kvroute.commands.experiment import EMULATED_KV_EVENTS
from kvroute.errors import UserError
from kvroute.experiment import ExperimentPlan, ExperimentResult, run_experiment
from kvroute.workers import launch_emulated
from kvroute.workload import WorkloadSpec, parse_int_list

LAG = "kvroute_mesh_apply_lag_seconds"
#: How often the replicas' histograms are read while the experiment runs (its routers stop
#: with it, so the last read before they do is the run's figure).
POLL_S = 0.25


def parse_histogram(text: str, name: str = LAG) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets as (upper bound, count), sum, count) of histogram ``name``."""
    buckets, total, count = [], 0.0, 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if bound == "+Inf" else float(bound), float(line.rsplit(None, 1)[-1])))
        elif line.startswith(f"{name}_sum "):
            total = float(line.rsplit(None, 1)[-1])
        elif line.startswith(f"{name}_count "):
            count = float(line.rsplit(None, 1)[-1])
    return buckets, total, count


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The ``q`` quantile of a cumulative histogram, linear within its bucket (the last finite
    bound when it falls in +Inf)."""
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        lower, below = bound, cumulative
    return lower


class _LagReader(SweepHooks):
    """Learns the replicas' URLs as the first trial starts and reads their lag histograms every
    :data:`POLL_S` until cancelled, keeping each replica's last page."""

    def __init__(self) -> None:
        self.urls: tuple[str, ...] = ()
        self.pages: dict[str, str] = {}
        self._task: asyncio.Task | None = None

    def trial_started(self, target: BenchTarget, workload: BenchWorkload, concurrency: int, trial: int) -> None:
        if self._task is None:
            self.urls = target.router_metrics_urls
            self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            while True:
                for url in self.urls:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        async with s.get(f"{url}/metrics") as r:
                            if r.status == 200:
                                self.pages[url] = await r.text()
                await asyncio.sleep(POLL_S)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def lag(self) -> dict:
        """The lag over every replica's messages (seconds), and how many."""
        merged: dict[float, float] = {}
        total = count = 0.0
        for page in self.pages.values():
            buckets, s, n = parse_histogram(page)
            for bound, c in buckets:
                merged[bound] = merged.get(bound, 0.0) + c
            total, count = total + s, count + n
        if not count:
            raise RuntimeError("the replicas applied no peer message (is the mesh on?)")
        buckets = sorted(merged.items())
        return {"messages": int(count), "mean_s": total / count,
                "p50_s": quantile(buckets, 0.5), "p99_s": quantile(buckets, 0.99)}


async def measure(args: argparse.Namespace, replicas: int, concurrency: int, out: Path) -> dict:
    plan = ExperimentPlan(
        workers=(args.workers,),
        specs=(WorkloadSpec(prefixes=args.prefixes, requests=args.requests),),
        concurrency=(concurrency,),
        trials=1,
        topologies=("router",),
        time_scale=args.time_scale,
        router_replicas=replicas,
    )
    emulate = ["--timing", plan.timing, "--time-scale", f"{plan.time_scale:g}", "--kv-events-config", EMULATED_KV_EVENTS]

    async def start_fleet(workers: int):
        return await launch_emulated(workers, emulate)

    reader = _LagReader()
    result = ExperimentResult()
    try:
        await run_experiment(plan, start_fleet, ResultsWriter(out / f"r{replicas}-c{concurrency}"), reader, result)
    finally:
        reader.stop()
    point = result.measured[0]
    return {"replicas": replicas, "concurrency": concurrency, "hit_rate": point.median("request_hit_rate"),
            "ttft_p99_ms": point.median("ttft_p99_ms"), **reader.lag()}


async def main(args: argparse.Namespace) -> None:
    replicas = parse_int_list(args.replicas, "--replicas")
    concurrency = parse_int_list(args.concurrency, "-c")
    if any(n < 2 for n in replicas):
        raise UserError("--replicas: a mesh needs at least 2 replicas")
    for flag, value in (("-K", args.prefixes), ("-W", args.workers), ("--requests", args.requests or 1)):
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    if not args.time_scale > 0:
        raise UserError(f"--time-scale must be > 0, got {args.time_scale}")
    out = args.out or Path("kvroute-results") / time.strftime("mesh-lag-%Y%m%d-%H%M%S")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; W={args.workers} K={args.prefixes}, "
          f"{args.requests or 'default'} requests, ×{args.time_scale:g}", flush=True)
    print(f"{'replicas':>8} {'c':>4} {'messages':>9} {'mean ms':>8} {'p50 ms':>7} {'p99 ms':>7} {'hit rate':>9} "
          f"{'TTFT p99':>9}", flush=True)
    rows = []
    for n in replicas:
        for c in concurrency:
            row = await measure(args, n, c, out)
            rows.append(row)
            print(f"{n:>8} {c:>4} {row['messages']:>9} {row['mean_s'] * 1e3:>8.3f} {row['p50_s'] * 1e3:>7.3f} "
                  f"{row['p99_s'] * 1e3:>7.3f} {row['hit_rate']:>9.3f} {row['ttft_p99_ms']:>9.0f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mesh_lag.json").write_text(json.dumps(rows, indent=1))
    print(f"results: {out / 'mesh_lag.json'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="2,3", help="replica counts, a comma list (default %(default)s)")
    parser.add_argument("-c", "--concurrency", default="8,16", help="closed-loop levels (default %(default)s)")
    parser.add_argument("-K", "--prefixes", type=int, default=24, help="shared prefixes (default %(default)s)")
    parser.add_argument("-W", "--workers", type=int, default=6, help="emulated workers (default %(default)s)")
    parser.add_argument("--requests", type=int, default=None, help="measured requests (default: the reference's)")
    parser.add_argument("--time-scale", type=float, default=4.0, help="workers run this much faster (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default kvroute-results/mesh-lag-<time>)")
    try:
        asyncio.run(main(parser.parse_args()))
    except UserError as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(2)
