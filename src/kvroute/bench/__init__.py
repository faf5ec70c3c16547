"""The benchmark: the reference experiment against any OpenAI-compatible endpoint.

Embeddable (``kvroute experiment`` runs it per topology over the same seeded requests)::

    model = await discover_model(url)
    encoder = PromptEncoder("ids", model)
    workloads = [reference_workload(WorkloadSpec(prefixes=k), encoder) for k in (2, 7, 12, 24)]
    target = BenchTarget(url, metrics_urls=tuple(worker_urls), model=model, label="service")
    points = await run_sweep(target, workloads, BenchOptions(concurrency=(4, 8, 16), trials=3),
                             sink=ResultsWriter(out_dir))

Modules: ``prompts`` (requests to send), ``client`` (streaming client, load generators),
``scrape`` (Prometheus counters), ``runner`` (trials and sweeps), ``files`` (outputs).
"""

from kvroute.bench.client import WORKER_HEADER, BenchClient, run_closed_loop, run_open_loop
from kvroute.bench.files import ResultsWriter
from kvroute.bench.prompts import (
    BenchRequest,
    BenchWorkload,
    PromptEncoder,
    SessionSpec,
    reference_workload,
    session_workload,
    trace_workload,
)
from kvroute.bench.runner import (
    BenchOptions,
    BenchRunner,
    BenchTarget,
    SweepHooks,
    TrialResult,
    TrialSink,
    capacity_for,
    discover_model,
    run_sweep,
    server_cache_config,
    simulate_points,
)

__all__ = [
    "WORKER_HEADER",
    "BenchClient",
    "BenchOptions",
    "BenchRequest",
    "BenchRunner",
    "BenchTarget",
    "BenchWorkload",
    "PromptEncoder",
    "ResultsWriter",
    "SessionSpec",
    "SweepHooks",
    "TrialResult",
    "TrialSink",
    "capacity_for",
    "discover_model",
    "reference_workload",
    "run_closed_loop",
    "run_open_loop",
    "run_sweep",
    "server_cache_config",
    "session_workload",
    "simulate_points",
    "trace_workload",
]
