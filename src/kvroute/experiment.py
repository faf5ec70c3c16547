"""The reference experiment end to end: workers, the Service baseline, the bench, the tables.

For each fleet size W the experiment starts (or takes) W workers, puts ``TcpBalancer`` in front
of them (random backend per connection, like kube-proxy), and runs the bench's sweep with the
fair-measurement rules through it: a new connection per request, the same seeded requests in
the same order for every topology, warmup excluded, caches reset between trials, hits counted
from ``cached_tokens`` and from the workers' counters. The simulator predicts every measured
point for the same configuration, and the report shows measured, predicted and the formula side
by side.

Emulated workers run faster than real time by ``time_scale``; every measured time is scaled
back (multiplied by ``time_scale``) so the tables read in the reference GPUs' milliseconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.bench.files import ResultsWriter
from kvroute.bench.prompts import BenchWorkload, PromptEncoder, reference_workload
from kvroute.bench.runner import (
    BenchOptions,
    BenchRunner,
    BenchTarget,
    SweepHooks,
    capacity_for,
    discover_model,
    server_cache_config,
    simulate_points,
)
from kvroute.errors import UserError
from kvroute.fleet import Fleet
from kvroute.records import Point
from kvroute.service import TcpBalancer
from kvroute.workload import WorkloadSpec

TOPOLOGIES = ("service",)


@dataclass(frozen=True)
class ExperimentPlan:
    """What to run.

    Args:
        workers: fleet sizes, one fleet each (the reference: 6 and 3).
        specs: one workload per K.
        concurrency: closed-loop levels.
        trials: per point (medians reported).
        topologies: balancers to measure (``service``).
        timing: the workers' cost-model preset (for the simulator's prediction).
        time_scale: how much faster than real time emulated workers run.
    """

    workers: tuple[int, ...]
    specs: tuple[WorkloadSpec, ...]
    concurrency: tuple[int, ...]
    trials: int
    topologies: tuple[str, ...] = TOPOLOGIES
    timing: str = "reference-gpu"
    time_scale: float = 1.0
    seed: int = 0

    @property
    def total_trials(self) -> int:
        return len(self.workers) * len(self.specs) * len(self.concurrency) * self.trials * len(self.topologies)


@dataclass
class ExperimentResult:
    measured: list[Point] = field(default_factory=list)
    predicted: list[Point] = field(default_factory=list)
    capacity: float | None = None
    geometry: tuple[int, int] | None = None


async def run_experiment(
    plan: ExperimentPlan,
    start_fleet: Callable[[int], object],
    writer: ResultsWriter,
    hooks: SweepHooks,
    result: ExperimentResult,
) -> ExperimentResult:
    """Measure every fleet size and topology, filling ``result`` as points finish (so an
    interrupted run still has what was measured), then predict them with the simulator.

    Args:
        start_fleet: ``await start_fleet(W)`` gives a running ``Fleet`` of W workers.
    """
    options = BenchOptions(concurrency=plan.concurrency, trials=plan.trials, seed=plan.seed,
                           time_scale=plan.time_scale)
    workloads: list[BenchWorkload] | None = None
    for w in plan.workers:
        fleet: Fleet = await start_fleet(w)
        try:
            if result.geometry is None:
                configs = await server_cache_config([f"{u}/metrics" for u in fleet.urls])
                if not configs:
                    raise UserError("the workers expose no vllm:cache_config_info; cannot size the formula")
                result.geometry = configs[0]
            if workloads is None:
                model = await discover_model(fleet.urls[0])
                encoder = PromptEncoder("ids", model)
                workloads = [reference_workload(spec, encoder) for spec in plan.specs]
                result.capacity = capacity_for(workloads[0], *result.geometry)
            for topology in plan.topologies:
                await _measure(topology, fleet, w, workloads, options, writer, hooks, result)
        finally:
            await fleet.close()
    if workloads and result.geometry:
        result.predicted = simulate_points(
            result.measured, workloads, *result.geometry, plan.timing, plan.trials, plan.seed
        )
    return result


async def _measure(
    topology: str,
    fleet: Fleet,
    workers: int,
    workloads: list[BenchWorkload],
    options: BenchOptions,
    writer: ResultsWriter,
    hooks: SweepHooks,
    result: ExperimentResult,
) -> None:
    if topology != "service":
        raise UserError(f"unknown topology {topology!r}; available: {', '.join(TOPOLOGIES)}")
    balancer = TcpBalancer(fleet.addresses)
    await balancer.start()
    try:
        target = BenchTarget(
            url=f"http://127.0.0.1:{balancer.port}",
            metrics_urls=tuple(f"{u}/metrics" for u in fleet.urls),
            label=topology,
            workers=workers,
        )
        runner = BenchRunner(target, options, writer, hooks)
        sweep = asyncio.ensure_future(runner.run(workloads))
        crash = asyncio.ensure_future(fleet.wait_crash())
        try:
            done, _ = await asyncio.wait({sweep, crash}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sweep, crash):
                task.cancel()
            # Points with at least one finished trial, also when interrupted.
            result.measured.extend(p for p in runner.points if p.trials)
        if sweep not in done:
            raise UserError(
                f"a worker process exited (status {crash.result()}) during the {topology} sweep; "
                "what was measured before is saved"
            )
        sweep.result()
    finally:
        await balancer.close()
