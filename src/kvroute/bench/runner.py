"""Trials and sweeps against one target, returning the same ``Point`` records as the simulator.

``BenchRunner`` is the embeddable core of ``kvroute bench``: ``kvroute experiment`` runs it once
per topology over the same seeded requests. One *trial* is:

1. reset every worker's prefix cache (``POST /reset_prefix_cache``), so trials and points do
   not inherit each other's cache state (skippable, with a warning);
2. the warmup, one request per prefix, one at a time, not measured (rule 3);
3. a scrape of each worker's counters, the measured window (closed loop at a concurrency, or
   open loop on a fixed schedule), another scrape (rule 4);
4. ``records.summarize`` over the window's records, with the counters' token hit ratio beside.

The sweep is K × load level × trials; every trial of every point sends the same requests in the
same order (the workload is built once per K, from the seed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from kvroute.analytic import capacity_for_mean_lengths
from kvroute.bench.client import BenchClient, run_closed_loop, run_open_loop, run_sequential
from kvroute.bench.prompts import BenchRequest, BenchWorkload, poisson_schedule
from kvroute.bench.router_metrics import RouterMetricsReader, RouterRefreshes
from kvroute.bench.scrape import (
    CacheDelta,
    MetricsScraper,
    deltas,
    window_token_hit_rate,
)
from kvroute.errors import UserError
from kvroute.records import Point, RequestRecord, TrialStats, summarize

logger = logging.getLogger(__name__)

PROMPT_DETAILS_HINT = (
    "no response reported usage.prompt_tokens_details.cached_tokens although the workers' "
    "counters show {hits:.0f} cached tokens in the window: start vLLM with "
    "--enable-prompt-tokens-details (or pass --allow-missing-cached-tokens to measure anyway; "
    "every request then counts as a miss)"
)
PROMPT_DETAILS_UNKNOWN = (
    "no response reported usage.prompt_tokens_details.cached_tokens: either the server runs "
    "without --enable-prompt-tokens-details (then every request looks like a miss) or every "
    "request missed; give --metrics-url for each worker so the two can be told apart, or pass "
    "--allow-missing-cached-tokens"
)


@dataclass(frozen=True)
class BenchTarget:
    """Where to send requests, and how to label the results.

    Args:
        url: the OpenAI-compatible base URL (a balancer, a router or one worker).
        metrics_urls: each worker's base or ``/metrics`` URL, for counters and cache resets.
        model: served model name; discovered from ``GET /v1/models`` when None.
        label: the topology's name in reports (``point.policy``): ``service``, ``router``...
        workers: W, for labels and the formula; default: the number of metrics URLs.
        api_key: bearer token for ``url`` (a server started with ``--api-key``); never
            written to the results.
        router_metrics_urls: each router replica's base or ``/metrics`` URL, whose retention
            refreshes are summed (:mod:`kvroute.bench.router_metrics`); empty: ``url``'s.
    """

    url: str
    metrics_urls: tuple[str, ...] = ()
    model: str | None = None
    label: str = "service"
    workers: int | None = None
    api_key: str | None = field(default=None, repr=False)
    router_metrics_urls: tuple[str, ...] = ()

    @property
    def num_workers(self) -> int:
        return self.workers or len(self.metrics_urls) or 1


@dataclass(frozen=True)
class BenchOptions:
    """How to load the target.

    Args:
        concurrency: closed-loop levels (one point per level).
        rate: open-loop Poisson arrivals per second instead (points get concurrency 0).
        trials: trials per point; reports show medians.
        seed: fixes the open-loop schedule (the requests themselves come from the workload).
        keep_alive: pool connections instead of one new connection per request.
        reset: reset the workers' prefix caches before every trial.
        timeout_s: limit per request.
        allow_missing_cached_tokens: measure on even if no response reports cached tokens.
        warmup: send the workload's warmup requests before each trial's window.
        time_scale: the workers run this many times faster than real time (a time-scaled
            emulator); every measured time is multiplied by it, so results read in model time.
        open_loop: send each request at its own ``at_s`` (a trace's timestamps) in one open-loop
            point instead of one closed-loop point per ``concurrency``.
    """

    concurrency: tuple[int, ...] = (8,)
    rate: float | None = None
    trials: int = 1
    seed: int = 0
    keep_alive: bool = False
    reset: bool = True
    timeout_s: float = 600.0
    allow_missing_cached_tokens: bool = False
    warmup: bool = True
    time_scale: float = 1.0
    open_loop: bool = False

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise UserError("--trials must be >= 1")
        if self.rate is None and not self.open_loop and (not self.concurrency or min(self.concurrency) < 1):
            raise UserError("--concurrency must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise UserError(f"--rate must be > 0, got {self.rate}")
        if self.timeout_s <= 0:
            raise UserError("--timeout must be > 0")
        if self.time_scale <= 0:
            raise UserError("the time scale must be > 0")

    @property
    def load_levels(self) -> tuple[int, ...]:
        """Point concurrency values: the closed-loop levels, or 0 for the open loop."""
        return (0,) if self.rate is not None or self.open_loop else self.concurrency


class SweepHooks:
    """Progress callbacks; the default does nothing. ``kvroute bench`` shows rich bars."""

    def trial_started(self, target: BenchTarget, workload: BenchWorkload, concurrency: int, trial: int) -> None:
        pass

    def phase(self, description: str, total: int) -> None:
        pass

    def request_done(self, record: RequestRecord) -> None:
        pass

    def warning(self, message: str) -> None:
        logger.warning(message)


@dataclass
class TrialResult:
    """One trial's outcome, as handed to a ``TrialSink``."""

    target: BenchTarget
    prefixes: int
    concurrency: int
    trial: int
    warmup: list[RequestRecord]
    records: list[RequestRecord]
    window: list[CacheDelta]
    stats: TrialStats
    partial: bool = False


class TrialSink:
    """Receives every finished trial (``writer.ResultsWriter`` writes them to disk)."""

    def trial_done(self, result: TrialResult) -> None:
        pass


@dataclass
class _Current:
    """The trial in progress, kept so Ctrl-C can still save what it measured."""

    prefixes: int
    concurrency: int
    trial: int
    warmup: list[RequestRecord] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    measuring: bool = False


async def discover_model(url: str, timeout_s: float = 10.0, api_key: str | None = None) -> str:
    """The first model that ``GET {url}/v1/models`` lists; checks the target is reachable
    (and, with ``api_key``, that it accepts the key).

    Raises:
        UserError: unreachable, not an OpenAI-compatible server, a key missing or refused, or
            no model served.
    """
    target = url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.get(target, headers=headers) as resp:
                if resp.status == 401:
                    what = "refused the API key" if api_key else "wants an API key"
                    raise UserError(f"GET {target} answered HTTP 401: the server {what} "
                                    "(--api-key, or the OPENAI_API_KEY environment variable)")
                if resp.status != 200:
                    raise UserError(f"GET {target} answered HTTP {resp.status}: is this an OpenAI-compatible server?")
                body = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        reason = str(exc) or type(exc).__name__
        raise UserError(f"cannot reach {url}: {reason}") from None
    except ValueError:
        raise UserError(f"GET {target} did not return JSON: is this an OpenAI-compatible server?") from None
    models = body.get("data") if isinstance(body, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise UserError(f"GET {target} lists no model; pass --model")
    return str(models[0]["id"])


class BenchRunner:
    """Runs sweeps against one target and keeps what it measured.

    Args:
        target: where to send, how to label.
        options: load shape and trial count.
        sink: receives each finished trial (to write records as the sweep goes).
        hooks: progress and warnings.

    ``points`` holds every finished trial grouped into points, also after an interruption;
    ``interrupted_trial`` returns the trial that was cut short, summarized over what arrived.
    """

    def __init__(
        self,
        target: BenchTarget,
        options: BenchOptions,
        sink: TrialSink | None = None,
        hooks: SweepHooks | None = None,
    ) -> None:
        self.target = target
        self.options = options
        self.sink = sink or TrialSink()
        self.hooks = hooks or SweepHooks()
        self.points: list[Point] = []
        self._current: _Current | None = None
        self._checked_cached_tokens = options.allow_missing_cached_tokens
        self._warned_reset = False
        #: Whether the target is a kvroute router whose refreshes to count (None: not asked
        #: yet; False: it is not, so its /metrics is not read again).
        self._router_metrics = RouterMetricsReader(target.router_metrics_urls, target.url, target.api_key,
                                                   self.hooks.warning)
        self._warned_refreshes = False

    async def run(self, workloads: Sequence[BenchWorkload]) -> list[Point]:
        """Every (K, load level) point, ``options.trials`` trials each. Returns the points
        of this call (``self.points`` accumulates over calls)."""
        scraper = MetricsScraper(list(self.target.metrics_urls)) if self.target.metrics_urls else None
        if scraper is None and self.options.reset:
            self._warn_reset("no --metrics-url given, so worker caches cannot be reset between trials")
        # Asked before the first trial, not inside it: behind a Service this GET is a
        # connection, which takes one of the balancer's random draws, and the trial's draws
        # must be the simulator's (the experiment reseeds as each trial starts).
        await self._router_metrics.prepare()
        done: list[Point] = []
        try:
            for workload in workloads:
                for level in self.options.load_levels:
                    point = Point(self.target.num_workers, workload.prefixes, level, self.target.label, source="bench")
                    self.points.append(point)
                    done.append(point)
                    for trial in range(self.options.trials):
                        self.hooks.trial_started(self.target, workload, level, trial)
                        point.trials.append(await self._trial(workload, level, trial, scraper))
        finally:
            if scraper is not None:
                await scraper.close()
        return done

    def interrupted_trial(self) -> TrialResult | None:
        """The trial in progress when the sweep was interrupted, over the records that arrived
        (None when none had)."""
        cur = self._current
        if cur is None or not cur.measuring or not cur.records:
            return None
        records = sorted(cur.records, key=lambda r: r.index)
        return TrialResult(self.target, cur.prefixes, cur.concurrency, cur.trial, cur.warmup, records, [],
                           summarize(records), partial=True)

    def _warn_reset(self, reason: str) -> None:
        if not self._warned_reset:
            self._warned_reset = True
            self.hooks.warning(f"{reason}: later trials and points inherit earlier cache state")

    async def _trial(
        self, workload: BenchWorkload, concurrency: int, trial: int, scraper: MetricsScraper | None
    ) -> TrialStats:
        opts = self.options
        cur = self._current = _Current(workload.prefixes, concurrency, trial)
        if scraper is not None and opts.reset:
            failures = await scraper.reset_prefix_caches()
            if failures:
                self._warn_reset(
                    "cannot reset prefix caches (" + "; ".join(failures) + "; a real vLLM needs "
                    "VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache)"
                )
        async with BenchClient(self.target.url, opts.keep_alive, opts.timeout_s, self.target.api_key) as client:
            if opts.warmup and workload.warmup:
                self.hooks.phase("warmup", len(workload.warmup))
                await run_sequential(client, workload.warmup, self._on_warmup)
                if all(not r.ok for r in cur.warmup):
                    raise UserError(f"every warmup request failed; the first: {cur.warmup[0].error}")
            refreshes_before = await self._router_metrics.read()
            before = await scraper.scrape() if scraper else None
            self.hooks.phase("measure", len(workload.requests))
            cur.measuring = True
            offsets = self._offsets(workload.requests)
            if offsets is None:
                await run_closed_loop(client, workload.requests, concurrency, self._on_record)
            else:
                await run_open_loop(client, workload.requests, offsets, self._on_record)
            refreshes_after = await self._router_metrics.read()
            after = await scraper.scrape() if scraper else None
        window = deltas(before, after) if before is not None and after is not None else []
        records = sorted(cur.records, key=lambda r: r.index)
        counted = self._router_metrics.window(refreshes_before, refreshes_after)
        refreshed = counted or RouterRefreshes()
        if refreshed.answered_prompt_tokens < refreshed.prompt_tokens:
            self._warn_unmeasured_refreshes()
        stats = summarize(records, metrics_token_hit_rate=window_token_hit_rate(
            window, refreshed.answered_prompt_tokens, refreshed.cached_tokens))
        if counted is not None:
            stats.refreshes = int(refreshed.sent)
        result = TrialResult(self.target, workload.prefixes, concurrency, trial, cur.warmup, records, window, stats)
        self.sink.trial_done(result)
        self._current = None
        if records and all(not r.ok for r in records):
            raise UserError(f"every request of the trial failed; the first: {records[0].error}")
        self._check_cached_tokens(cur.warmup + records, window)
        return stats

    def _warn_unmeasured_refreshes(self) -> None:
        if not self._warned_refreshes:
            self._warned_refreshes = True
            self.hooks.warning(
                "some of the router's refreshes failed or were answered without their usage: the "
                "workers' counters, which count the refreshes too, may differ from the requests' "
                "own cached_tokens")

    def _offsets(self, requests: Sequence[BenchRequest]) -> list[float] | None:
        if self.options.rate is not None:
            return poisson_schedule(len(requests), self.options.rate, self.options.seed).tolist()
        if requests and all(r.at_s is not None for r in requests):
            return [r.at_s for r in requests]  # a trace: its own timestamps
        return None

    def _to_model_time(self, record: RequestRecord) -> RequestRecord:
        scale = self.options.time_scale
        if scale != 1.0:
            record.send_time *= scale
            record.ttft_s = None if record.ttft_s is None else record.ttft_s * scale
            record.e2e_s = None if record.e2e_s is None else record.e2e_s * scale
            record.itl_s = [t * scale for t in record.itl_s]
        return record

    def _on_warmup(self, record: RequestRecord) -> None:
        self._current.warmup.append(self._to_model_time(record))
        self.hooks.request_done(record)

    def _on_record(self, record: RequestRecord) -> None:
        self._current.records.append(self._to_model_time(record))
        self.hooks.request_done(record)

    def _check_cached_tokens(self, records: list[RequestRecord], window: list[CacheDelta]) -> None:
        """The classic pitfall (docs/experiment.md rule 5): vLLM omits ``prompt_tokens_details``
        without ``--enable-prompt-tokens-details`` *and* whenever nothing was cached, so a
        run where no response carries it is ambiguous. The counters decide: hits there mean
        the field is missing; no hits mean every request really missed."""
        if self._checked_cached_tokens:
            return
        if any(r.cached_tokens is not None for r in records if r.ok):
            self._checked_cached_tokens = True
            return
        if window:
            hits = sum(d.hits for d in window)
            if hits > 0:
                raise UserError(PROMPT_DETAILS_HINT.format(hits=hits))
            return  # the counters agree: nothing was cached; check again next trial
        raise UserError(PROMPT_DETAILS_UNKNOWN)


async def run_sweep(
    target: BenchTarget,
    workloads: Sequence[BenchWorkload],
    options: BenchOptions,
    sink: TrialSink | None = None,
    hooks: SweepHooks | None = None,
) -> list[Point]:
    """Convenience wrapper: one ``BenchRunner`` over ``workloads``; returns its points."""
    return await BenchRunner(target, options, sink, hooks).run(workloads)


# -- what to compare against ---------------------------------------------------------------


async def server_cache_config(metrics_urls: Sequence[str]) -> list[tuple[int, int]]:
    """``(num_gpu_blocks, block_size)`` of every worker that exposes ``vllm:cache_config_info``."""
    if not metrics_urls:
        return []
    scraper = MetricsScraper(list(metrics_urls))
    try:
        samples = await scraper.scrape()
    finally:
        await scraper.close()
    return [(s.num_gpu_blocks, s.block_size) for s in samples if s.num_gpu_blocks and s.block_size]


def capacity_for(workload: BenchWorkload, num_blocks: int, block_size: int) -> float:
    """C of the formula: requests' worth of KV blocks one worker holds, from the workload's
    mean lengths (as ``kvroute sim`` computes it)."""
    return capacity_for_mean_lengths(
        workload.prefix_tokens, workload.suffix_tokens, workload.output_tokens, num_blocks, block_size
    )


def simulate_points(
    measured: Sequence[Point],
    workloads: Sequence[BenchWorkload],
    num_blocks: int,
    block_size: int,
    timing: str,
    trials: int,
    seed: int,
    policies: dict[str, str] | None = None,
    retention: dict[str, str] | None = None,
) -> list[Point]:
    """The simulator's prediction for each measured closed-loop point: the same W workers, the
    same seeded requests and concurrency, balanced by ``policies[label]`` (the sim policy
    standing for the measured topology; random when the label is not there) with
    ``retention[label]`` (off when not there). Labelled with the measured topology's name so
    the report shows them side by side."""
    from kvroute.engine import get_preset
    from kvroute.sim import SweepPoint, WorkerConfig, run_point

    config = WorkerConfig(num_blocks, block_size, get_preset(timing))
    by_k = {w.prefixes: w for w in workloads}
    out = []
    for p in measured:
        wl = by_k.get(p.prefixes)
        if wl is None or wl.source is None or wl.spec is None or p.concurrency < 1:
            continue
        config.check_fits(wl.source)
        policy = (policies or {}).get(p.policy, "random")
        mode = (retention or {}).get(p.policy, "off")
        point = run_point(SweepPoint(p.workers, p.prefixes, p.concurrency, policy, mode), wl.source, config, trials, seed)
        point.policy = p.policy
        out.append(point)
    return out


def simulate_trace_points(
    measured: Sequence[Point],
    workload: BenchWorkload,
    num_blocks: int,
    block_size: int,
    timing: str,
    seed: int,
    max_model_len: int,
    policies: dict[str, str] | None = None,
    retention: dict[str, str] | None = None,
) -> tuple[list[Point], dict[tuple[int, str], list[RequestRecord]]]:
    """The simulator's prediction for each measured trace replay (open loop): the same W
    workers and the same window of the trace at its own timestamps, balanced by
    ``policies[label]`` (random when the label is not there) with ``retention[label]`` (off
    when not there), refusing what
    ``max_model_len`` refuses. Returns the points, labelled as the measured topologies, and
    each replay's records for the plots over time."""
    from kvroute.engine import get_preset
    from kvroute.sim import WorkerConfig
    from kvroute.trace.simulate import simulate_trace, trace_policy

    config = WorkerConfig(num_blocks, block_size, get_preset(timing))
    points, timelines = [], {}
    for p in measured:
        if p.concurrency != 0 or workload.trace is None:
            continue
        policy = trace_policy((policies or {}).get(p.policy, "random"), seed, block_size)
        run = simulate_trace(workload.trace, p.workers, config, policy, max_model_len,
                             retention=(retention or {}).get(p.policy, "off"))
        points.append(Point(p.workers, p.prefixes, 0, p.policy, [run.stats()]))
        timelines[(p.workers, p.policy)] = run.records
    return points, timelines
