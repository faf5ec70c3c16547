"""Prometheus metrics of one emulated worker, named and labelled as vLLM's.

Names, types, label names and histogram buckets follow vLLM's ``PrometheusStatLogger``
(``vllm/v1/metrics/loggers.py``): labels ``model_name`` (the first served name) and
``engine`` (``"0"``: one engine per server); prefix-cache counters count tokens; the
``vllm:cache_config_info`` gauge is 1 with the cache settings as labels (and no
``model_name``, as in vLLM).

Counters and gauges are read from the engine model at scrape time by a custom collector, so
there is one source of truth (``Engine.stats`` and friends) and no double bookkeeping; only
what the engine does not keep (latency histograms, finished requests by reason) is recorded
here as requests finish. Each worker has its own ``CollectorRegistry`` so that several
workers can live in one process.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvroute.emulator.config import EmulatorConfig
    from kvroute.engine import Engine

LABEL_NAMES = ("model_name", "engine")

#: vLLM's ``vllm:time_to_first_token_seconds`` buckets.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
#: vLLM's request latency buckets (``vllm:e2e_request_latency_seconds`` and friends).
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
#: vLLM's FinishReason strings; every one is exported (at 0 until it happens), as vLLM does.
FINISH_REASONS = ("stop", "length", "abort", "error")
#: Sources of ``vllm:prompt_tokens_by_source`` (vLLM's PromptTokenStats.ALL_SOURCES).
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class _EngineCollector(Collector):
    """Reads the engine's counters and gauges whenever the registry is scraped."""

    def __init__(self, engine: Engine, labels: list[str], created: float) -> None:
        self.engine = engine
        self.labels = labels
        self.created = created

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABEL_NAMES)
        family.add_metric(self.labels, value, created=self.created)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABEL_NAMES)
        family.add_metric(self.labels, value)
        return family

    def collect(self):
        engine = self.engine
        stats = engine.stats
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            engine.num_running,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            engine.num_waiting,
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            engine.pool.usage,
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            stats.queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            stats.hits,
        )
        yield self._counter(
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            engine.num_preemptions,
        )
        yield self._counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            engine.prompt_tokens_total,
        )
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=(*LABEL_NAMES, "source"),
        )
        # A request's cached tokens are its hit at first admission (what stats.hits adds up).
        for source, value in zip(
            PROMPT_TOKEN_SOURCES, (engine.prompt_tokens_total - stats.hits, stats.hits, 0)
        ):
            by_source.add_metric([*self.labels, source], value, created=self.created)
        yield by_source
        yield self._counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            stats.hits,
        )
        yield self._counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            engine.generation_tokens_total,
        )


class WorkerMetrics:
    """The ``/metrics`` registry of one emulated worker.

    Args:
        engine: the worker's engine model (read at scrape time).
        config: the worker's settings (model name, cache config labels).
    """

    def __init__(self, engine: Engine, config: EmulatorConfig) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.created = time.time()
        labels = [config.model_name, "0"]
        self.registry.register(_EngineCollector(engine, labels, self.created))

        ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labelnames=LABEL_NAMES,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._ttft = ttft.labels(*labels)
        e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            labelnames=LABEL_NAMES,
            buckets=REQUEST_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._e2e = e2e.labels(*labels)
        self._success = dict.fromkeys(FINISH_REASONS, 0)
        self._labels = labels
        self.registry.register(_SuccessCollector(self))
        self.registry.register(_CacheConfigCollector(config))

    def observe_first_token(self, ttft_s: float) -> None:
        self._ttft.observe(ttft_s)

    def observe_finished(self, e2e_s: float, reason: str = "length") -> None:
        self._e2e.observe(e2e_s)
        self._success[reason] += 1

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4, like vLLM's ``/metrics``)."""
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST


class _SuccessCollector(Collector):
    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        family = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=(*LABEL_NAMES, "finished_reason"),
        )
        for reason, value in m._success.items():
            family.add_metric([*m._labels, reason], value, created=m.created)
        yield family


class _CacheConfigCollector(Collector):
    """``vllm:cache_config_info``: vLLM exports every CacheConfig field as a label (values
    stringified the Python way: ``True``, ``None``); the emulator exports the ones that
    describe its cache, with vLLM's defaults for the rest."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.labels = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "calculate_kv_scales": "False",
            "cpu_offload_gb": "0",
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "engine": "0",
            "gpu_memory_utilization": "0.9",
            "is_attention_free": "False",
            "kv_cache_memory_bytes": str(config.kv_cache_memory_bytes),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(config.num_gpu_blocks),
            "num_gpu_blocks_override": str(config.num_gpu_blocks_override),
            # The emulator's block hashes are xxh3-64 chains (kvroute.blocks).
            "prefix_caching_hash_algo": "xxhash",
            "sliding_window": "None",
        }

    def collect(self):
        family = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=tuple(self.labels),
        )
        family.add_metric(list(self.labels.values()), 1.0)
        yield family
