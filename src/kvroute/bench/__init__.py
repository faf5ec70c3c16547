"""The benchmark: the reference experiment against any OpenAI-compatible endpoint.

Embeddable (``kvroute experiment`` runs it per topology over the same seeded requests)::

    model = await discover_model(url)
    encoder = PromptEncoder("ids", model)
    workloads = [reference_workload(WorkloadSpec(prefixes=k), encoder) for k in (2, 7, 12, 24)]
    target = BenchTarget(url, metrics_urls=tuple(worker_urls), model=model, label="service")
    points = await run_sweep(target, workloads, BenchOptions(concurrency=(4, 8, 16), trials=3),
                             sink=ResultsWriter(out_dir))

Modules: ``prompts`` (requests to send), ``client`` (streaming client, load generators),
``scrape`` (Prometheus counters), ``runner`` (trials and sweeps), ``writer`` (the output
folder), ``plots``, ``report_html`` (the HTML report) and ``samples`` (what the plots draw).
"""

#: Where each of the package's names lives: imported on first use (PEP 562), so that a
#: command needing one module (``kvroute sim`` writes its plots with ``plots``) does not
#: import the HTTP client (aiohttp: ~0.4 s) with it.
_LAZY = {
    "BenchClient": "client",
    "BenchOptions": "runner",
    "BenchRequest": "prompts",
    "BenchRunner": "runner",
    "BenchTarget": "runner",
    "BenchWorkload": "prompts",
    "PromptEncoder": "prompts",
    "ResultsWriter": "writer",
    "SessionSpec": "prompts",
    "SweepHooks": "runner",
    "TrialResult": "runner",
    "TrialSink": "runner",
    "WORKER_HEADER": "client",
    "capacity_for": "runner",
    "discover_model": "runner",
    "reference_workload": "prompts",
    "run_closed_loop": "client",
    "run_open_loop": "client",
    "run_sweep": "runner",
    "server_cache_config": "runner",
    "session_workload": "prompts",
    "simulate_points": "runner",
    "trace_workload": "prompts",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
