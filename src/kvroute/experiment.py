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

Real vLLM on CPU (``--engine vllm``) serves the tiny model with 128-token blocks and 512 bytes of
KV per token, so the reference's 1 GiB would hold far more requests than on the reference GPUs.
:func:`cpu_kv_cache_bytes` sizes the KV memory instead so that a worker holds as many of the
workload's requests (the formula's C) as the reference worker does: the same pressure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

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
from kvroute.model import (
    MODEL_PRESETS,
    ModelShape,
    capacity_for_mean_lengths,
    num_kv_blocks,
)
from kvroute.records import Point
from kvroute.service import TcpBalancer
from kvroute.workload import WorkloadSpec

TOPOLOGIES = ("service",)

#: The reference worker's ``--kv-cache-memory-bytes`` (with Qwen3-0.6B, GPU blocks of 16).
REFERENCE_KV_CACHE_BYTES = 2**30
#: Smallest token id drawn for prompts; tokenizers reserve the low ids for special tokens.
FIRST_PROMPT_TOKEN_ID = 1000


def cpu_kv_cache_bytes(
    spec: WorkloadSpec,
    reference: ModelShape = MODEL_PRESETS["qwen3-0.6b"],
    reference_bytes: int = REFERENCE_KV_CACHE_BYTES,
    cpu: ModelShape = MODEL_PRESETS["tiny-cpu"],
) -> int:
    """KV memory for a CPU vLLM worker that puts ``spec`` under the reference's pressure.

    The formula's C (requests' worth of KV blocks per worker) is computed for the reference
    worker and the workload's mean lengths; the CPU worker gets the whole number of its blocks
    whose C is closest (ties: the larger).
    """
    lengths = (spec.prefix_tokens.mean, spec.suffix_tokens.mean, spec.output_tokens)
    ref_blocks = num_kv_blocks(reference_bytes, reference.kv_bytes_per_token, reference.block_size)
    target = capacity_for_mean_lengths(*lengths, ref_blocks, reference.block_size)
    per_request = capacity_for_mean_lengths(*lengths, 2, cpu.block_size)  # C of 1 usable block
    # C grows linearly in usable blocks (num_blocks - 1, the null block excluded).
    blocks = 1 + max(1, round(target / per_request))
    return blocks * cpu.block_size * cpu.kv_bytes_per_token


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
        vocab_size: the served model's vocabulary; prompts then draw token ids below it
            (the default range reaches 30,000, past the tiny CPU model's 8,192).
    """

    workers: tuple[int, ...]
    specs: tuple[WorkloadSpec, ...]
    concurrency: tuple[int, ...]
    trials: int
    topologies: tuple[str, ...] = TOPOLOGIES
    timing: str = "reference-gpu"
    time_scale: float = 1.0
    seed: int = 0
    vocab_size: int | None = None

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
                vocab = None
                if plan.vocab_size is not None:
                    vocab = np.arange(FIRST_PROMPT_TOKEN_ID, plan.vocab_size, dtype=np.uint32)
                workloads = [reference_workload(spec, encoder, vocab) for spec in plan.specs]
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
