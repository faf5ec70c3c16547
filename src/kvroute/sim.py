"""The simulator: engine models on a virtual clock, driven by a closed-loop client.

One trial = fresh workers, the warmup (one request per prefix, sent one at a time through the
same policy, not measured), then the measured requests in their seeded order from
``concurrency`` closed-loop clients: each client sends its next request when its previous one
completes. A request reaches its worker's engine ``frontend_s`` after it is sent; TTFT is from
send to the end of the step that produced the first token.

Routing is the live router's own step (:class:`kvroute.routing.RoutingStep`: look-up, policy,
prediction, load accounting). A policy that ``needs_overlap`` (kv-aware) routes with a
router-side ``KvIndex``, fed as the live router's is: each engine's KV events (engines then emit
them, which turns off coalesced decode runs) at the end of the step that produced them, and a
predicted entry for every prompt when it is routed. A request is in flight from its send to its
completion, and its tokens still to prefill count until its first token.

The simulator shares everything that matters with the live system: the ``Engine`` (cache and
scheduler), the policy objects of ``kvroute.routing.policies``, the workload and the records,
so its tables line up with a bench run's.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvroute.blocks import BlockHasher, PrefixHashCache
from kvroute.engine import CostModel, Engine, EngineRequest, PrefixCacheStats
from kvroute.errors import UserError
from kvroute.records import Point, RequestRecord, TrialStats, summarize
from kvroute.routing import RoutingStep
from kvroute.routing.index import KvIndex
from kvroute.routing.policies import Policy, WorkerState, make_policy, policy_parameters
from kvroute.workload import RequestSpec, Workload


@dataclass(frozen=True)
class WorkerConfig:
    """One simulated worker: KV blocks (null block included), block size and timing."""

    num_blocks: int
    block_size: int
    cost: CostModel
    enable_caching: bool = True

    def check_fits(self, workload: Workload) -> None:
        """A request whose prompt and output cannot fit in an empty cache would wait forever
        (vLLM refuses to start with such a max-model-len); say so instead."""
        longest = max(r.prompt_tokens for r in workload.warmup + workload.requests)
        need = -(-(longest + workload.spec.output_tokens) // self.block_size)
        if need > self.num_blocks - 1:
            raise UserError(
                f"a request of {longest} + {workload.spec.output_tokens} tokens needs {need} KV "
                f"blocks but a worker has only {self.num_blocks - 1}: give workers more KV memory"
            )


@dataclass
class TrialResult:
    records: list[RequestRecord]
    duration_s: float
    #: Per worker prefix-cache counters over the measured window (warmup excluded).
    window_stats: list[PrefixCacheStats] = field(default_factory=list)

    @property
    def metrics_token_hit_rate(self) -> float | None:
        queries = sum(s.queries for s in self.window_stats)
        return sum(s.hits for s in self.window_stats) / queries if queries else None

    def stats(self) -> TrialStats:
        return summarize(self.records, self.duration_s, self.metrics_token_hit_rate)


_ARRIVE, _STEP_END, _RUN_END = 0, 1, 2


class Simulation:
    """Workers, a policy and a virtual clock.

    Args:
        workers: number of workers W.
        config: each worker's configuration.
        policy: the balancing policy (fresh per trial: it may hold state).
        index: the router's index; by default a fresh one when the policy ``needs_overlap``
            and none otherwise. Pass one to inspect it afterwards or to observe its events.
    """

    def __init__(
        self,
        workers: int,
        config: WorkerConfig,
        policy: Policy,
        coalesce: bool = True,
        index: KvIndex | None = None,
    ) -> None:
        self.config = config
        self.coalesce = coalesce
        self.policy = policy
        self.hasher = BlockHasher(config.block_size)
        if index is None and policy.needs_overlap:
            index = KvIndex(self.hasher)
        self.index = index
        self.engines = [
            Engine(
                config.num_blocks, config.block_size, config.cost, self.hasher,
                config.enable_caching, emit_events=index is not None,
            )
            for _ in range(workers)
        ]
        #: The routing step (the live router's): its slots are the workers' indices.
        self.routing = RoutingStep(policy, index, config.block_size)
        self.names = [f"worker-{i}" for i in range(workers)]
        for name in self.names:
            self.routing.add_worker(name)
        self.busy = [False] * workers
        # A worker in a coalesced decode run: (start, its steps' end times, run id). Runs are cut
        # short when a request arrives for that worker mid-run (see _interrupt_run).
        self.runs: list[tuple[float, list[float], int] | None] = [None] * workers
        self.now = 0.0
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0

    @property
    def states(self) -> list[WorkerState]:
        """Each worker's load accounting now (snapshots)."""
        return [self.routing.state(i) for i in range(len(self.names))]

    def _push(self, t: float, kind: int, data: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, data))

    def _start_step(self, w: int) -> None:
        engine = self.engines[w]
        self.busy[w] = True
        steps = engine.decode_run_length() if self.coalesce else 0
        if steps:
            ends = engine.decode_step_ends(self.now, steps)
            self._seq += 1
            self.runs[w] = (self.now, ends, self._seq)
            heapq.heappush(self._heap, (ends[-1], self._seq, _RUN_END, (w, self._seq)))
            return
        result = engine.step(self.now)
        self._push(result.end, _STEP_END, (w, result))

    def _interrupt_run(self, w: int, sent_at: float) -> None:
        """A request (sent at ``sent_at``) arrives at worker ``w`` during a coalesced run: the
        steps that started before now run without it; the run ends after them so the next
        step can admit it. Decided as single steps would be: the step in flight is the first
        whose end is after now; at an exact tie with a step's end, the arrival goes first
        (joins the next step) only if it was sent before that step began (its event is the
        older one in the heap)."""
        start, ends, run_id = self.runs[w]
        steps = len(ends)
        if ends[-1] == start:
            return  # zero-time steps (the instant preset): the whole run is one instant
        done = bisect.bisect_left(ends, self.now) + 1
        if done <= steps and ends[done - 1] == self.now:
            if sent_at > (ends[done - 2] if done >= 2 else start):
                done += 1
        if done >= steps:
            return  # the last step of the run had started already
        self.runs[w] = None
        result = self.engines[w].run_decode_steps(start, done)
        self._push(result.end, _STEP_END, (w, result))

    def run(
        self,
        requests: list[RequestSpec],
        concurrency: int,
        prefix_hashes: PrefixHashCache,
        output_token_ids,
    ) -> list[RequestRecord]:
        """Send ``requests`` from ``concurrency`` closed-loop clients; return their records in
        request order."""
        records: list[RequestRecord | None] = [None] * len(requests)
        start = self.now
        pending = iter(enumerate(requests))
        sent: dict[str, tuple[int, RequestSpec, float, int, int]] = {}
        frontend = self.config.cost.frontend_s
        index = self.index
        routing = self.routing

        def send() -> None:
            item = next(pending, None)
            if item is None:
                return
            pos, spec = item
            prompt = spec.prompt_token_ids
            hashes = prefix_hashes.prompt_hashes(spec.prefix_id, spec.prefix_len, prompt)
            w, _, prefill = routing.route(hashes, len(prompt), self.now)
            rid = f"{pos}"
            request = EngineRequest(
                rid,
                prompt,
                output_token_ids[: spec.output_tokens],
                self.now + frontend,
                block_hashes=hashes,
            )
            sent[rid] = (pos, spec, self.now, w, prefill)
            self._push(self.now + frontend, _ARRIVE, (w, request))

        for _ in range(concurrency):
            send()
        while self._heap:
            t, _, kind, data = heapq.heappop(self._heap)
            self.now = t
            if kind == _RUN_END:
                w, run_id = data
                run = self.runs[w]
                if run is None or run[2] != run_id:
                    continue  # cut short by an arrival
                self.runs[w] = None
                kind, data = _STEP_END, (w, self.engines[w].run_decode_steps(run[0], len(run[1])))
            if kind == _ARRIVE:
                w, request = data
                if self.runs[w] is not None and not self.engines[w].waiting:
                    # (With a queue, the run was offered only because its head stays
                    # blocked in every step, and a newcomer waits behind the head.)
                    self._interrupt_run(w, sent[request.request_id][2])
                self.engines[w].add_request(request)
                if not self.busy[w]:
                    self._start_step(w)
                continue
            w, result = data
            self.busy[w] = False
            if index is not None and result.events is not None:
                routing.apply(w, result.events.events, self.now)
            for out in result.outputs:
                if out.first_token:
                    # Prefill done: what the live router learns from the first response byte.
                    routing.first_token(w, sent[out.request.request_id][4])
                if not out.finished:
                    continue
                req = out.request
                pos, spec, t_sent, w_sent, _ = sent.pop(req.request_id)
                routing.finished(w_sent)
                records[pos] = RequestRecord(
                    index=spec.index,
                    prefix_id=spec.prefix_id,
                    send_time=t_sent - start,
                    prompt_tokens=spec.prompt_tokens,
                    cached_tokens=req.num_cached_tokens,
                    ttft_s=req.first_token_time - t_sent,
                    e2e_s=req.finish_time - t_sent,
                    output_tokens=req.num_output,
                    worker=self.names[w_sent],
                )
                send()
            if self.engines[w].has_work:
                self._start_step(w)
        missing = [i for i, r in enumerate(records) if r is None]
        if missing:  # an engine stalled with work it could never admit
            raise RuntimeError(f"simulation ended with {len(missing)} requests unfinished")
        return records  # type: ignore[return-value]


def run_trial(
    workload: Workload,
    workers: int,
    concurrency: int,
    config: WorkerConfig,
    policy: Policy,
    coalesce: bool = True,
    index: KvIndex | None = None,
) -> TrialResult:
    """One trial: fresh workers, warmup one at a time, then the measured requests.

    ``coalesce`` runs stretches of identical decode steps at once (same results, faster);
    ``index`` is the router's index (see ``Simulation``)."""
    config.check_fits(workload)
    sim = Simulation(workers, config, policy, coalesce, index)
    prefix_hashes = PrefixHashCache(sim.hasher)
    output = workload.vocab[: workload.spec.output_tokens]
    sim.run(workload.warmup, 1, prefix_hashes, output)
    before = [_copy_stats(e.stats) for e in sim.engines]
    t0 = sim.now
    records = sim.run(workload.requests, concurrency, prefix_hashes, output)
    window = [_delta(e.stats, b) for e, b in zip(sim.engines, before)]
    return TrialResult(records, sim.now - t0, window)


def _copy_stats(s: PrefixCacheStats) -> PrefixCacheStats:
    return PrefixCacheStats(s.requests, s.queries, s.hits, s.preempted_requests, s.preempted_queries, s.preempted_hits)


def _delta(after: PrefixCacheStats, before: PrefixCacheStats) -> PrefixCacheStats:
    return PrefixCacheStats(
        after.requests - before.requests,
        after.queries - before.queries,
        after.hits - before.hits,
        after.preempted_requests - before.preempted_requests,
        after.preempted_queries - before.preempted_queries,
        after.preempted_hits - before.preempted_hits,
    )


@dataclass(frozen=True)
class SweepPoint:
    workers: int
    prefixes: int
    concurrency: int
    policy: str


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
    result = Point(point.workers, point.prefixes, point.concurrency, point.policy, source="sim")
    options = dict(policy_options or {})
    if "block_size" in policy_parameters(point.policy):
        options.setdefault("block_size", config.block_size)
    for trial in range(trials):
        rng = random.Random(trial_seed(seed, trial))
        policy = make_policy(point.policy, rng=rng, **options)
        result.trials.append(run_trial(workload, point.workers, point.concurrency, config, policy).stats())
        if on_trial:
            on_trial()
    return result


def sweep_points(
    workers: Iterable[int], prefixes: Iterable[int], concurrency: Iterable[int], policies: Iterable[str]
) -> list[SweepPoint]:
    return [
        SweepPoint(w, k, c, p)
        for p in policies
        for w in workers
        for k in prefixes
        for c in concurrency
    ]
