"""Request records and per-point statistics shared by the simulator, the bench and reports.

A simulated, an emulated and a real run all produce ``RequestRecord`` lists; ``summarize``
turns one trial's records into ``TrialStats``; ``Point`` gathers the trials of one sweep point
(workers × prefixes × concurrency × policy) and reports medians. The JSON form of a point
(``Point.to_json``) is the contract that ``kvroute sim --json`` and ``kvroute bench`` share.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvroute.errors import UserError


@dataclass(slots=True)
class RequestRecord:
    """One measured request.

    Times are seconds; ``send_time`` is relative to the start of the measured window.
    ``cached_tokens`` is None when the server did not report it.
    ``status`` is the HTTP status, 0 when no response arrived (connection error, timeout).
    """

    index: int
    prefix_id: int | None
    send_time: float
    prompt_tokens: int
    cached_tokens: int | None
    ttft_s: float | None
    e2e_s: float | None
    output_tokens: int
    status: int = 200
    error: str | None = None
    worker: str | None = None
    session_id: str | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def hit(self) -> bool:
        return bool(self.cached_tokens)

    def to_json(self) -> dict:
        return asdict(self)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values), q))


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


@dataclass(slots=True)
class TrialStats:
    """Statistics of one trial (one pass of the seeded requests through one topology).

    Hit rates use every attempted request as the denominator: a failed request counts as a
    miss, never silently disappears.
    """

    requests: int
    failed: int
    hits: int
    request_hit_rate: float
    token_hit_rate: float
    ttft_hit_p50_ms: float | None
    ttft_hit_p90_ms: float | None
    ttft_miss_p50_ms: float | None
    ttft_miss_p90_ms: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    throughput_rps: float
    duration_s: float
    metrics_token_hit_rate: float | None = None
    worker_requests: dict[str, int] = field(default_factory=dict)
    #: Retention's refresh requests sent in the measured window, and the engine seconds they
    #: added (simulator: per step, its time less its time without them).
    refreshes: int = 0
    refresh_engine_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def busiest_share(stats: TrialStats, workers: int) -> float:
    """Requests of the busiest worker ÷ the mean per worker over ``workers`` (idle ones count;
    1.0: perfectly even), from the trial's per-worker counts; 0.0 when none were recorded."""
    served = stats.worker_requests
    return max(served.values()) * workers / sum(served.values()) if served else 0.0


def summarize(
    records: list[RequestRecord],
    duration_s: float | None = None,
    metrics_token_hit_rate: float | None = None,
) -> TrialStats:
    """Statistics of one trial's measured (non-warmup) records.

    Args:
        records: the trial's records.
        duration_s: wall (or virtual) length of the measured window; default: from the first
            send to the last completion.
        metrics_token_hit_rate: the same ratio from the workers' Prometheus counters, if scraped.
    """
    n = len(records)
    ok = [r for r in records if r.ok]
    hits = [r for r in ok if r.hit]
    misses = [r for r in ok if not r.hit]
    prompt = sum(r.prompt_tokens for r in records)
    cached = sum(r.cached_tokens or 0 for r in ok)
    if duration_s is None:
        ends = [r.send_time + r.e2e_s for r in ok if r.e2e_s is not None]
        start = min((r.send_time for r in records), default=0.0)
        duration_s = (max(ends) - start) if ends else 0.0
    workers: dict[str, int] = {}
    for r in ok:
        if r.worker is not None:
            workers[r.worker] = workers.get(r.worker, 0) + 1
    ttft = lambda rs: [r.ttft_s for r in rs if r.ttft_s is not None]  # noqa: E731
    return TrialStats(
        requests=n,
        failed=n - len(ok),
        hits=len(hits),
        request_hit_rate=len(hits) / n if n else 0.0,
        token_hit_rate=cached / prompt if prompt else 0.0,
        ttft_hit_p50_ms=_ms(_pct(ttft(hits), 50)),
        ttft_hit_p90_ms=_ms(_pct(ttft(hits), 90)),
        ttft_miss_p50_ms=_ms(_pct(ttft(misses), 50)),
        ttft_miss_p90_ms=_ms(_pct(ttft(misses), 90)),
        ttft_p50_ms=_ms(_pct(ttft(ok), 50)),
        ttft_p99_ms=_ms(_pct(ttft(ok), 99)),
        throughput_rps=len(ok) / duration_s if duration_s > 0 else 0.0,
        duration_s=duration_s,
        metrics_token_hit_rate=metrics_token_hit_rate,
        worker_requests=dict(sorted(workers.items())),
    )


#: Fields of TrialStats reported as medians over trials in a point's JSON.
MEDIAN_FIELDS = (
    "request_hit_rate",
    "token_hit_rate",
    "ttft_hit_p50_ms",
    "ttft_hit_p90_ms",
    "ttft_miss_p50_ms",
    "ttft_miss_p90_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "throughput_rps",
    "metrics_token_hit_rate",
    "hits",
    "failed",
    "requests",
    "refreshes",
    "refresh_engine_s",
)


def median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


@dataclass(slots=True)
class Point:
    """One sweep point and its trials.

    ``policy`` names the topology: a simulator policy (``random``, ``prefix-hash``…) or a bench
    topology (``service``, ``router``…).
    """

    workers: int
    prefixes: int
    concurrency: int
    policy: str
    trials: list[TrialStats] = field(default_factory=list)
    source: str = "sim"

    def median(self, name: str) -> float | None:
        return median_or_none([getattr(t, name) for t in self.trials])

    def to_json(self) -> dict:
        out: dict = {
            "workers": self.workers,
            "prefixes": self.prefixes,
            "concurrency": self.concurrency,
            "policy": self.policy,
            "source": self.source,
            "trials": len(self.trials),
        }
        for name in MEDIAN_FIELDS:
            out[name] = self.median(name)
        out["per_trial"] = [t.to_json() for t in self.trials]
        return out


def write_points_json(path: Path, points: list[Point], meta: dict) -> None:
    """``{"meta": meta, "points": [...]}``: the point contract of ``kvroute sim --json`` and of a
    bench or experiment run's ``summary.json``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"meta": meta, "points": [p.to_json() for p in points]}, indent=2))
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
