"""The reference experiment end to end: workers, the Service baseline, the bench, the tables.

For each fleet size W the experiment starts (or takes) W workers and, for each topology, puts a
balancer in front of them — ``service``: ``TcpBalancer`` (random backend per connection, like
kube-proxy); ``router``: kvroute's KV-aware router (``kvroute serve``) fed by the workers' KV
events; ``gateway``: a real Envoy configured as a Gateway API Inference Extension gateway
(``kvroute.gateway``) asking the same router as an Endpoint Picker (``kvroute epp``) — and runs the bench's sweep with the fair-measurement rules through it: a new connection per request, the same seeded requests in
the same order for every topology, warmup excluded, caches reset between trials, hits counted
from ``cached_tokens`` and from the workers' counters. The simulator predicts every measured
point for the same configuration (random balancing for the service, the router's policy for the
router), and the report shows measured, predicted and the formula side by side.

Common random numbers: the Service balancer is reseeded at the start of every trial with the
seed the simulator's random policy uses for that trial (``seed * 1_000_003 + trial``) and draws
once per connection, as the simulator draws once per request, so prediction and measurement see
the same random choices wherever connections arrive in the order the client sends them. The
comparison then tests the engine model, not the luck of one draw.

Emulated workers run faster than real time by ``time_scale``; every measured time is scaled
back (multiplied by ``time_scale``) so the tables read in the reference GPUs' milliseconds.

Real vLLM on CPU (``--engine vllm``) serves the tiny model with 128-token blocks and 512 bytes of
KV per token, so the reference's 1 GiB would hold far more requests than on the reference GPUs.
:func:`cpu_kv_cache_bytes` sizes the KV memory instead so that a worker holds as many of the
workload's requests (the formula's C) as the reference worker does: the same pressure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvroute.analytic import (
    MODEL_PRESETS,
    ModelShape,
    capacity_for_mean_lengths,
    num_kv_blocks,
)
from kvroute.bench.prompts import BenchWorkload, PromptEncoder, reference_workload, trace_workload
from kvroute.bench.runner import (
    BenchOptions,
    BenchRunner,
    BenchTarget,
    SweepHooks,
    capacity_for,
    discover_model,
    server_cache_config,
    simulate_points,
    simulate_trace_points,
)
from kvroute.bench.samples import Timelines
from kvroute.bench.writer import ResultsWriter
from kvroute.errors import UserError
from kvroute.gateway import run_envoy
from kvroute.kvevents import EventsSettings, EventsSource
from kvroute.records import Point, RequestRecord
from kvroute.router import RouterConfig, start_router
from kvroute.router.config import default_retention
from kvroute.service import TcpBalancer
from kvroute.sim import trial_seed
from kvroute.workers import Workers
from kvroute.workload import WorkloadSpec

TOPOLOGIES = ("service", "router", "gateway")
#: The router topology's policy (``kvroute serve --policy``), also simulated for its prediction.
ROUTER_POLICY = "kv-aware"

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
class TraceWindow:
    """A trace to replay instead of the reference workload, and which part of it
    (``kvroute.trace.Trace.select``)."""

    path: Path
    start_s: float = 0.0
    duration_s: float | None = None
    max_requests: int | None = None
    cut_sessions: bool = False


@dataclass(frozen=True)
class ExperimentPlan:
    """What to run.

    Args:
        workers: fleet sizes, one fleet each (the reference: 6 and 3).
        specs: one workload per K.
        concurrency: closed-loop levels.
        trials: per point (medians reported).
        topologies: balancers to measure (``service``, ``router``).
        router_policy: the router topology's policy.
        router_retention: the router topology's retention mode (None: ``kvroute serve``'s
            default for ``router_policy``), also simulated for its prediction.
        timing: the workers' cost-model preset (for the simulator's prediction).
        time_scale: how much faster than real time emulated workers run.
        vocab_size: the served model's vocabulary; prompts then draw token ids below it
            (the default range reaches 30,000, past the tiny CPU model's 8,192).
        trace: replay this trace by its timestamps (one open-loop point per fleet and
            topology) instead of ``specs`` at each ``concurrency``.
        max_model_len: the workers' context length; the trace's prediction refuses what
            they refuse.
        router_replicas: the router topology as this many ``kvroute serve`` replicas with
            the same flags behind the Service balancer (``TcpBalancer``), as a Kubernetes
            Deployment of routers behind its Service runs them; the bench reads every
            replica's ``/metrics`` for the refreshes.
        router_mesh: whether those replicas share their decisions and refreshes (the replica
            mesh, ``kvroute serve --mesh-bind/--peer``); off, each sees only its own.
        max_loras: the emulated workers' LoRA slots (``--max-loras``) when the workload has
            adapters, told to the router too (``kvroute serve --max-loras``).
    """

    workers: tuple[int, ...]
    specs: tuple[WorkloadSpec, ...]
    concurrency: tuple[int, ...]
    trials: int
    topologies: tuple[str, ...] = ("service",)
    router_policy: str = ROUTER_POLICY
    router_retention: str | None = None
    timing: str = "reference-gpu"
    time_scale: float = 1.0
    seed: int = 0
    vocab_size: int | None = None
    trace: TraceWindow | None = None
    max_model_len: int = 4096
    router_replicas: int = 1
    router_mesh: bool = True
    max_loras: int = 4

    @property
    def retention(self) -> str:
        """The router topology's retention mode."""
        return self.router_retention or default_retention(self.router_policy)

    @property
    def total_trials(self) -> int:
        loads = 1 if self.trace is not None else len(self.specs) * len(self.concurrency)
        return len(self.workers) * loads * self.trials * len(self.topologies)


@dataclass
class ExperimentResult:
    measured: list[Point] = field(default_factory=list)
    predicted: list[Point] = field(default_factory=list)
    capacity: float | None = None
    geometry: tuple[int, int] | None = None
    #: A trace's prediction: each simulated replay's records, for the plots over time.
    predicted_timelines: Timelines = field(default_factory=dict)


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
        start_fleet: ``await start_fleet(W)`` gives a running ``Workers`` of W workers.
    """
    options = BenchOptions(concurrency=plan.concurrency, trials=plan.trials, seed=plan.seed,
                           time_scale=plan.time_scale, open_loop=plan.trace is not None)
    workloads: list[BenchWorkload] | None = None
    for w in plan.workers:
        fleet: Workers = await start_fleet(w)
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
                if plan.trace is not None:
                    t = plan.trace
                    workloads = [trace_workload(t.path, encoder, time_scale=plan.time_scale, start_s=t.start_s,
                                                duration_s=t.duration_s, max_requests=t.max_requests,
                                                cut_sessions=t.cut_sessions, vocab=vocab)]
                else:
                    workloads = [reference_workload(spec, encoder, vocab) for spec in plan.specs]
                result.capacity = capacity_for(workloads[0], *result.geometry)
            for topology in plan.topologies:
                await _measure(topology, plan, fleet, w, workloads, options, writer, hooks, result)
        finally:
            await fleet.close()
    policies = {"service": "random", "router": plan.router_policy, "gateway": plan.router_policy}
    retention = {"router": plan.retention, "gateway": plan.retention}
    if workloads and result.geometry and plan.trace is not None:
        result.predicted, result.predicted_timelines = simulate_trace_points(
            result.measured, workloads[0], *result.geometry, plan.timing, plan.seed, plan.max_model_len,
            policies, retention,
        )
    elif workloads and result.geometry:
        result.predicted = simulate_points(
            result.measured, workloads, *result.geometry, plan.timing, plan.trials, plan.seed,
            policies, retention,
        )
    return result


async def _measure(
    topology: str,
    plan: ExperimentPlan,
    fleet: Workers,
    workers: int,
    workloads: list[BenchWorkload],
    options: BenchOptions,
    writer: ResultsWriter,
    hooks: SweepHooks,
    result: ExperimentResult,
) -> None:
    async with _balancer(topology, plan, fleet, result.geometry) as (url, trial_hooks, routers):
        target = BenchTarget(
            url=url,
            metrics_urls=tuple(f"{u}/metrics" for u in fleet.urls),
            label=topology,
            workers=workers,
            router_metrics_urls=routers,
        )
        runner = BenchRunner(target, options, writer, trial_hooks(hooks))
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


@contextlib.asynccontextmanager
async def _balancer(
    topology: str, plan: ExperimentPlan, fleet: Workers, geometry: tuple[int, int] | None
) -> AsyncIterator[tuple[str, Callable[[SweepHooks], SweepHooks], tuple[str, ...]]]:
    """Start ``topology`` in front of ``fleet``; yield its URL, how to wrap the bench's
    hooks for it (the Service's per-trial reseeding) and the URLs of the kvroute routers
    deciding its routes: the router replicas, or the gateway's Endpoint Picker (none for the
    service)."""
    if topology == "service":
        balancer = TcpBalancer(fleet.addresses)
        await balancer.start()
        try:
            yield f"http://127.0.0.1:{balancer.port}", lambda hooks: _ReseedPerTrial(hooks, balancer, plan.seed), ()
        finally:
            await balancer.close()
    elif topology in ("router", "gateway"):
        num_blocks, block_size = geometry if geometry else (None, None)
        per_worker = {
            url: EventsSource(*events) for url, events in zip(fleet.urls, fleet.kv_events) if events
        }
        config = RouterConfig(
            workers=fleet.urls,
            policy=plan.router_policy,
            retention=plan.retention,
            seed=plan.seed,
            block_size=block_size or RouterConfig.block_size,
            events=EventsSettings(per_worker=per_worker) if per_worker else None,
            # Without events the router models each worker's LRU cache with its real size.
            predicted_capacity_blocks=None if per_worker else num_blocks,
            threads=os.cpu_count() or 1,
            # The gateway: the same router as an Endpoint Picker behind Envoy.
            grpc_port=0 if topology == "gateway" else None,
            max_loras=plan.max_loras,
        )
        if topology == "gateway":
            async with start_router(config) as router:
                epp_port = int(router.grpc_address.rpartition(":")[2])
                async with run_envoy(epp_port) as envoy:
                    yield envoy.url, lambda hooks: hooks, (router.url,)
            return
        if plan.router_replicas > 1 and plan.router_mesh:
            config = dataclasses.replace(config, mesh_bind="127.0.0.1:0")
        async with _router_replicas(config, plan.router_replicas) as (url, routers):
            yield url, lambda hooks: hooks, routers
    else:
        raise UserError(f"unknown topology {topology!r}; available: {', '.join(TOPOLOGIES)}")


@contextlib.asynccontextmanager
async def _router_replicas(config: RouterConfig, replicas: int) -> AsyncIterator[tuple[str, tuple[str, ...]]]:
    """``replicas`` routers with ``config`` (each on its own port), behind the Service
    balancer when there are several; yields the URL to send to and each replica's URL."""
    async with contextlib.AsyncExitStack() as stack:
        routers = [await stack.enter_async_context(start_router(config)) for _ in range(replicas)]
        urls = tuple(r.url for r in routers)
        if config.mesh_bind is not None:
            meshes = [r.mesh_address for r in routers]
            for i, router in enumerate(routers):
                router.set_peers([m for j, m in enumerate(meshes) if j != i])
        if replicas == 1:
            yield urls[0], urls
            return
        balancer = TcpBalancer([("127.0.0.1", r.native.port) for r in routers])
        await balancer.start()
        stack.push_async_callback(balancer.close)
        yield f"http://127.0.0.1:{balancer.port}", urls


class _ReseedPerTrial(SweepHooks):
    """Passes every hook on, and reseeds the Service balancer as each trial starts (before its
    cache reset and warmup) with the simulator's seed for that trial."""

    def __init__(self, inner: SweepHooks, balancer: TcpBalancer, seed: int) -> None:
        self._inner = inner
        self._balancer = balancer
        self._seed = seed

    def trial_started(self, target: BenchTarget, workload: BenchWorkload, concurrency: int, trial: int) -> None:
        self._balancer.reseed(trial_seed(self._seed, trial))
        self._inner.trial_started(target, workload, concurrency, trial)

    def phase(self, description: str, total: int) -> None:
        self._inner.phase(description, total)

    def request_done(self, record: RequestRecord) -> None:
        self._inner.request_done(record)

    def warning(self, message: str) -> None:
        self._inner.warning(message)
