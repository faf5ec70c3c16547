"""The simulator: engine models on a virtual clock, driven by a closed-loop client.

One trial = fresh workers, the warmup (one request per prefix, sent one at a time through the
same policy, not measured), then the measured requests in their seeded order from
``concurrency`` closed-loop clients: each client sends its next request when its previous one
completes. A request reaches its worker's engine ``frontend_s`` after it is sent; TTFT is from
send to the end of the step that produced the first token.

Routing is the live router's own step (:class:`kvroute.routing.RoutingStep`: look-up, policy,
prediction, load accounting). A policy that ``needs_overlap`` (kv-aware) routes with a
router-side ``KvIndex``, fed as the live router's is: each engine's KV events (engines then emit
them) at the end of the step that produced them, and a
predicted entry for every prompt when it is routed. A request is in flight from its send to its
completion, and its tokens still to prefill count until its first token.

The simulator shares everything that matters with the live system: the ``Engine`` (cache and
scheduler), the policy objects of ``kvroute.routing.policies``, the workload and the records,
so its tables line up with a bench run's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from kvroute import _native
from kvroute.blocks import BlockHasher, as_token_array
from kvroute.engine import CostModel, Engine, PrefixCacheStats
from kvroute.engine.pool import usable_blocks
from kvroute.errors import UserError
from kvroute.records import Point, RequestRecord, TrialStats, summarize
from kvroute.router.config import default_retention
from kvroute.routing import RoutingStep
from kvroute.routing.index import KvIndex
from kvroute.routing.policies import Policy, WorkerState, make_policy, policy_parameters
from kvroute.workload import RequestSpec, Workload, gc_paused


@dataclass(frozen=True)
class WorkerConfig:
    """One simulated worker: KV blocks (null block included), block size and timing, and
    its LoRA slots: ``max_loras`` (vLLM's ``--max-loras``; None: adapters are not modelled)
    adapters a batch may hold, each taking ``lora_load_s`` to load into a slot, as the
    emulator's ``--max-loras`` and ``--lora-load-time``."""

    num_blocks: int
    block_size: int
    cost: CostModel
    enable_caching: bool = True
    max_loras: int | None = None
    lora_load_s: float = 0.02

    def check_fits(self, workload: Workload) -> None:
        """A request whose prompt and output cannot fit in an empty cache would wait forever
        (vLLM refuses to start with such a max-model-len); say so instead."""
        longest = max(r.prompt_tokens for r in workload.warmup + workload.requests)
        need = -(-(longest + workload.spec.output_tokens) // self.block_size)
        if need > usable_blocks(self.num_blocks):
            raise UserError(
                f"a request of {longest} + {workload.spec.output_tokens} tokens needs {need} KV "
                f"blocks but a worker has only {usable_blocks(self.num_blocks)}: give workers more KV memory"
            )


@dataclass
class TrialResult:
    records: list[RequestRecord]
    duration_s: float
    #: Per worker prefix-cache counters over the measured window (warmup excluded).
    window_stats: list[PrefixCacheStats] = field(default_factory=list)
    #: Retention's refreshes in the measured window: requests, engine seconds they added.
    refreshes: int = 0
    refresh_engine_s: float = 0.0

    @property
    def metrics_token_hit_rate(self) -> float | None:
        queries = sum(s.queries for s in self.window_stats)
        return sum(s.hits for s in self.window_stats) / queries if queries else None

    def stats(self) -> TrialStats:
        # The workers' counters count retention's refreshes like any request; the simulator
        # has no per-refresh prompt counts to take them out, so such a trial has no second measure.
        counters = self.metrics_token_hit_rate if not self.refreshes else None
        stats = summarize(self.records, self.duration_s, counters)
        stats.refreshes = self.refreshes
        stats.refresh_engine_s = self.refresh_engine_s
        return stats


class Simulation:
    """Workers, a routing step and a virtual clock; each :meth:`run` is the native event loop
    (``kvroute_sim::sim``) over these engines and this step, which keep their state between
    runs (a warmup, then the measured requests).

    Args:
        workers: number of workers W.
        config: each worker's configuration.
        policy: the balancing policy (fresh per trial: it holds state); a native one from
            ``make_policy`` runs entirely in Rust, one written in Python (a test's oracle) is
            called back per request.
        index: the router's index; by default a fresh one when the policy ``needs_overlap``
            or retention is on, and none otherwise. Pass one to inspect it afterwards or to
            observe its events.
        retention: ``off``, ``on`` or ``auto`` (see ``kvroute_core::retention``): the router
            refreshes the prefixes each worker's LRU would evict; the refreshes run on the
            engines as requests and are counted in ``refresh_stats``, not in the records.
        replica_policies: the policies of router replicas 2..N (``kvroute_sim::sim::replicas``):
            ``policy`` is replica 1's; each replica gets its own routing step, index and
            retention model, and a balancer draws a replica per request (seeded with
            ``balancer_seed``), as the Service in front of live replicas does. Empty: one router.
        mesh_lag: with replicas, the replica mesh's delivery lag in seconds (None: no mesh, each
            replica knows only its own decisions).
        balancer_seed: the seed of the balancer's draws.
    """

    def __init__(
        self,
        workers: int,
        config: WorkerConfig,
        policy: Policy,
        index: KvIndex | None = None,
        retention: str = "off",
        replica_policies: list[Policy] | None = None,
        mesh_lag: float | None = None,
        balancer_seed: int = 0,
    ) -> None:
        self.config = config
        self.policy = policy
        self.hasher = BlockHasher(config.block_size)
        replica_policies = list(replica_policies or [])
        if replica_policies and index is not None:
            raise ValueError("router replicas each keep their own index: pass none")
        if mesh_lag is not None and mesh_lag < 0:
            raise ValueError("the mesh lag must be >= 0 seconds")
        if index is None and (policy.needs_overlap or retention != "off"):
            index = KvIndex(self.hasher)
        self.index = index
        self.engines = [
            Engine(
                config.num_blocks, config.block_size, config.cost, self.hasher,
                config.enable_caching, emit_events=index is not None,
            )
            for _ in range(workers)
        ]
        if config.max_loras is not None:
            for engine in self.engines:
                engine.set_lora_slots(config.max_loras, config.lora_load_s)
        #: The routing step (the live router's): its slots are the workers' indices. It keeps
        #: the KV-admission model (each worker's usable blocks) for a policy that reads it.
        #: With adapters modelled, it models each worker's LoRA slots as the engines have them.
        self.routing = RoutingStep(policy, index, config.block_size, usable_blocks(config.num_blocks),
                                   max_loras=config.max_loras)
        self.names = [f"worker-{i}" for i in range(workers)]
        for name in self.names:
            self.routing.add_worker(name)
        self.now = 0.0
        #: The retention state machine (None when off).
        self.retention = (
            None if retention == "off"
            else _native.Retention(retention, config.block_size, usable_blocks(config.num_blocks))
        )
        #: Router replicas 2..N: their routing steps (each with its own index) and retention.
        self.replicas = [self._replica(p, retention) for p in replica_policies]
        self.mesh_lag = mesh_lag
        self.balancer_seed = balancer_seed
        #: Refreshes sent so far: requests, prompt tokens computed, engine seconds added.
        self.refresh_stats = {"requests": 0, "computed_tokens": 0, "engine_s": 0.0}

    def _replica(self, policy: Policy, retention: str) -> tuple[RoutingStep, _native.Retention | None]:
        """One more router replica: its own routing step and index over the same workers, and
        its own retention model."""
        index = KvIndex(self.hasher) if policy.needs_overlap or retention != "off" else None
        step = RoutingStep(policy, index, self.config.block_size, usable_blocks(self.config.num_blocks),
                           max_loras=self.config.max_loras)
        for name in self.names:
            step.add_worker(name)
        capacity = usable_blocks(self.config.num_blocks)
        return step, None if retention == "off" else _native.Retention(retention, self.config.block_size, capacity)

    def _routing_arguments(self) -> dict:
        """How ``_native.simulate`` is told the routers: one step, or every replica's."""
        if not self.replicas:
            return {"retention": self.retention}
        return {
            "replicas": [self.routing] + [step for step, _ in self.replicas],
            "replica_retention": None if self.retention is None else [self.retention] + [r for _, r in self.replicas],
            "mesh_lag": self.mesh_lag,
            "balancer_seed": self.balancer_seed,
        }

    @property
    def states(self) -> list[WorkerState]:
        """Each worker's load accounting now (snapshots)."""
        return [self.routing.state(i) for i in range(len(self.names))]

    def run(
        self,
        requests: list[RequestSpec],
        concurrency: int,
        output_token_ids,
        send_times: list[float] | None = None,
        tenants: list[Tenant] | None = None,
    ) -> list[RequestRecord]:
        """Send ``requests`` from ``concurrency`` closed-loop clients (or each at its
        ``send_times`` entry, seconds on this simulation's clock: open loop); return their
        records in request order. Every request generates the first tokens of
        ``output_token_ids``; a request of prefix ``p`` runs under ``tenants[p]`` (see
        :func:`workload_tenants`; None: every request plain)."""
        if not requests:
            return []
        return self._records(
            _native.simulate(
                self.engines, self.routing, self.now, _prefix_table(requests), *_request_arrays(requests),
                as_token_array(output_token_ids),
                concurrency=None if send_times is not None else concurrency,
                send_times=send_times,
                tenants=tenants,
                **self._routing_arguments(),
            ),
            [r.index for r in requests], [r.prefix_id for r in requests],
        )

    def trial(
        self,
        warmup: list[RequestSpec],
        requests: list[RequestSpec],
        concurrency: int,
        output_token_ids,
        tenants: list[Tenant] | None = None,
    ) -> TrialResult:
        """One trial on these workers (the native ``Simulation::run_trial``): ``warmup`` sent
        one at a time, unmeasured, then ``requests`` from ``concurrency`` closed-loop clients
        (``output_token_ids`` and ``tenants`` as in :meth:`run`); their records, the measured
        window's duration, and the workers' counters and the refreshes over that window."""
        out = _native.simulate(
            self.engines, self.routing, self.now, _prefix_table(warmup + requests), *_request_arrays(requests),
            as_token_array(output_token_ids),
            concurrency=concurrency,
            tenants=tenants,
            warmup=_request_arrays(warmup),
            **self._routing_arguments(),
        )
        records = self._records(out, [r.index for r in requests], [r.prefix_id for r in requests])
        return TrialResult(
            records, out["duration_s"], out["window_stats"],
            out["window_refresh_requests"], out["window_refresh_engine_s"],
        )

    def replay(
        self,
        prompts: _native.PromptTable,
        indices: list[int],
        output_tokens: np.ndarray,
        output_token_ids,
        send_times: list[float],
    ) -> list[RequestRecord]:
        """Send each prompt of ``prompts`` (shared with other replays, not copied) at its
        ``send_times`` entry, generating its ``output_tokens`` entry of ``output_token_ids``;
        return the records (``index`` from ``indices``, prefix id 0: a replay's prompts are
        not drawn from shared prefixes) in order."""
        n = len(prompts)
        if not n:
            return []
        out = _native.simulate(
            self.engines, self.routing, self.now, prompts, np.arange(n, dtype=np.uint32),
            _EMPTY, np.zeros(n + 1, dtype=np.uint64), np.asarray(output_tokens, dtype=np.uint32),
            as_token_array(output_token_ids), send_times=send_times,
            **self._routing_arguments(),
        )
        return self._records(out, indices, [0] * n)

    def _records(self, out: dict, indices: list[int], prefix_ids: list[int]) -> list[RequestRecord]:
        """The records of one ``_native.simulate`` run (its request order), counting its
        refreshes and advancing the clock."""
        self.now = out["now"]
        self.refresh_stats["requests"] += out["refresh_requests"]
        self.refresh_stats["computed_tokens"] += out["refresh_computed_tokens"]
        self.refresh_stats["engine_s"] += out["refresh_engine_s"]
        names = self.names
        with gc_paused():
            # Positional: RequestRecord(index, prefix_id, send_time, prompt_tokens,
            # cached_tokens, ttft_s, e2e_s, output_tokens, status, error, worker).
            return [
                RequestRecord(index, prefix_id, send, prompt, cached, ttft, e2e, n_out, 200, None, names[w])
                for index, prefix_id, w, cached, prompt, send, ttft, e2e, n_out in zip(
                    indices, prefix_ids, out["worker"], out["cached_tokens"], out["prompt_tokens"],
                    out["send_time"], out["ttft_s"], out["e2e_s"], out["output_tokens"],
                )
            ]


_EMPTY = np.zeros(0, dtype=np.uint32)


def _prefix_table(requests: list[RequestSpec]) -> list[np.ndarray]:
    """The shared prefixes of ``requests`` by prefix id, as ``_native.simulate`` takes them
    (an id none of them uses: empty)."""
    prefixes: dict[int, np.ndarray] = {}
    for r in requests:
        prefixes.setdefault(r.prefix_id, r.prefix)
    return [prefixes.get(i, _EMPTY) for i in range(max(prefixes, default=-1) + 1)]


def _request_arrays(requests: list[RequestSpec]) -> tuple:
    """``requests`` as ``_native.simulate`` takes them: prefix ids, suffixes, suffix offsets,
    output lengths."""
    n = len(requests)
    suffixes = [r.suffix for r in requests]
    offsets = np.zeros(n + 1, dtype=np.uint64)
    np.cumsum(np.fromiter(map(len, suffixes), dtype=np.uint64, count=n), out=offsets[1:])
    return (
        np.fromiter((r.prefix_id for r in requests), dtype=np.uint32, count=n),
        suffixes,
        offsets,
        np.fromiter((r.output_tokens for r in requests), dtype=np.uint32, count=n),
    )

#: A prefix's tenant as the native simulator takes it: ``(lora_name, lora_id, cache_salt)``.
Tenant = tuple[str | None, int | None, str | None]


def workload_tenants(workload: Workload) -> list[Tenant] | None:
    """Each prefix's tenant in ``workload`` (by prefix id), as bench sends its requests
    (``WorkloadSpec.tenant_of``): the adapter named as the model, its id as the emulator and
    vLLM number ``--lora-modules adapter-0 adapter-1 ...`` (position + 1), and the salt. None
    when the workload has neither adapters nor salts."""
    spec = workload.spec
    if not spec.adapters and not spec.salted:
        return None
    adapters = spec.adapter_of_prefix()
    tenants: list[Tenant] = []
    for prefix_id in range(spec.prefixes):
        model, salt = spec.tenant_of(prefix_id, adapters)
        adapter = adapters[prefix_id]
        tenants.append((model, None if adapter is None else adapter + 1, salt))
    return tenants


def run_trial(
    workload: Workload,
    workers: int,
    concurrency: int,
    config: WorkerConfig,
    policy: Policy,
    index: KvIndex | None = None,
    retention: str = "off",
    replica_policies: list[Policy] | None = None,
    mesh_lag: float | None = None,
    balancer_seed: int = 0,
) -> TrialResult:
    """One trial: fresh workers, warmup one at a time, then the measured requests
    (``index``, ``retention``, the replicas: see ``Simulation``)."""
    config.check_fits(workload)
    sim = Simulation(workers, config, policy, index, retention, replica_policies, mesh_lag, balancer_seed)
    output = workload.vocab[: workload.spec.output_tokens]
    return sim.trial(workload.warmup, workload.requests, concurrency, output, workload_tenants(workload))


#: The replica mesh's delivery lag the simulator assumes unless told (``kvroute sim
#: --mesh-lag``): the mean lag from a replica's publishing a message to a peer's applying it,
#: as ``benchmarks/mesh_lag.py`` measures it live under the reference load (docs/results.md).
DEFAULT_MESH_LAG_S = 0.0004


@dataclass(frozen=True)
class SweepPoint:
    workers: int
    prefixes: int
    concurrency: int
    policy: str
    #: Retention mode (``off``, ``on``, ``auto``).
    retention: str = "off"
    #: Router replicas behind the balancer, and the mesh's lag between them (None: no mesh).
    router_replicas: int = 1
    mesh_lag: float | None = None

    @property
    def label(self) -> str:
        """The topology's name in tables: the policy, the retention mode unless off, and the
        router replicas unless one (with or without the mesh)."""
        label = self.policy if self.retention == "off" else f"{self.policy}+retain-{self.retention}"
        if self.router_replicas > 1:
            mesh = "no mesh" if self.mesh_lag is None else f"mesh {self.mesh_lag * 1000:g} ms"
            label += f" ×{self.router_replicas} replicas, {mesh}"
        return label


def trial_seed(seed: int, trial: int) -> int:
    """The seed of a policy's random choices in trial ``trial`` of a point. ``kvroute
    experiment`` reseeds its Service balancer with it, so the measured and the simulated random
    baseline draw the same choices."""
    return seed * 1_000_003 + trial


def run_point(
    point: SweepPoint,
    workload: Workload,
    config: WorkerConfig,
    trials: int,
    seed: int,
    policy_options: dict | None = None,
    on_trial: Callable[[], None] | None = None,
) -> Point:
    """All trials of one point. The request order is the same in every trial; the policy's
    random choices are seeded per trial (``seed`` + trial), so trials differ only there. A
    policy that takes a block size gets the workers' unless ``policy_options`` set it (as
    ``kvroute serve`` does)."""
    result = Point(point.workers, point.prefixes, point.concurrency, point.label, source="sim")
    options = dict(policy_options or {})
    if "block_size" in policy_parameters(point.policy):
        options.setdefault("block_size", config.block_size)
    for trial in range(trials):
        rng = random.Random(trial_seed(seed, trial))
        policy = make_policy(point.policy, rng=rng, **options)
        # Each further replica's policy draws its own choices (replica 1's are one router's).
        replicas = [
            make_policy(point.policy, rng=random.Random(f"{trial_seed(seed, trial)}/{r}"), **options)
            for r in range(1, point.router_replicas)
        ]
        result.trials.append(
            run_trial(
                workload, point.workers, point.concurrency, config, policy, retention=point.retention,
                replica_policies=replicas, mesh_lag=point.mesh_lag, balancer_seed=trial_seed(seed, trial),
            ).stats()
        )
        if on_trial:
            on_trial()
    return result


def retention_modes(policy: str, retention: Iterable[str] | None) -> list[str]:
    """The retention modes to simulate ``policy`` with: ``retention`` as given, or (None) what
    ``kvroute serve`` runs with that policy (:func:`kvroute.router.config.default_retention`),
    so that a plain simulation predicts the router as shipped."""
    return [default_retention(policy)] if retention is None else list(retention)


def sweep_points(
    workers: Iterable[int], prefixes: Iterable[int], concurrency: Iterable[int], policies: Iterable[str],
    retention: Iterable[str] | None = ("off",),
    router_replicas: Iterable[int] = (1,),
    mesh_lag: float | None = None,
) -> list[SweepPoint]:
    """Every (policy, retention, router replicas, workers, prefixes, concurrency) point;
    ``retention`` None gives each policy ``kvroute serve``'s mode for it (see
    :func:`retention_modes`), as ``kvroute sim`` does without ``--retention``; ``mesh_lag``
    (None: no mesh) applies to the points of more than one replica."""
    retention = None if retention is None else list(retention)
    return [
        SweepPoint(w, k, c, p, r, n, mesh_lag if n > 1 else None)
        for p in policies
        for r in retention_modes(p, retention)
        for n in router_replicas
        for w in workers
        for k in prefixes
        for c in concurrency
    ]
