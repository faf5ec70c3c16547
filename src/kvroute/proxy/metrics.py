"""The router's Prometheus metrics, in a registry of its own.

A registry per router (not prometheus_client's global one) lets several routers live in one
process (tests, ``kvroute experiment``) without their counters mixing or names colliding.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: Overlap in blocks: fine near zero (first contacts), coarse up to long prompts.
_OVERLAP_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: Routing overhead in seconds: 10 µs .. 100 ms.
_OVERHEAD_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class RouterMetrics:
    """Every metric the router exports (all names start with ``kvroute_router_``)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.decisions = Counter(
            "kvroute_router_decisions", "Routing decisions", ["policy", "worker"], registry=r
        )
        self.overlap_blocks = Histogram(
            "kvroute_router_overlap_blocks",
            "Leading prompt blocks the chosen worker already held (index view) per decision",
            buckets=_OVERLAP_BUCKETS, registry=r,
        )
        self.prompt_blocks = Histogram(
            "kvroute_router_prompt_blocks", "Full blocks of each routed prompt",
            buckets=_OVERLAP_BUCKETS, registry=r,
        )
        self.routing_seconds = Histogram(
            "kvroute_router_routing_seconds",
            "Router work per request before forwarding: parse, tokenize, hash, index, choose",
            buckets=_OVERHEAD_BUCKETS, registry=r,
        )
        self.requests = Counter(
            "kvroute_router_requests", "Requests answered, by route and status", ["route", "status"],
            registry=r,
        )
        self._requests_by_key: dict[tuple[str, int], Counter] = {}
        self.index_blocks = Gauge(
            "kvroute_router_index_blocks", "Event-backed (worker, block) entries in the index", registry=r
        )
        self.index_predicted = Gauge(
            "kvroute_router_index_predicted_entries", "Predicted (routed, not yet confirmed) entries",
            registry=r,
        )
        self.index_evicted = Gauge(
            "kvroute_router_index_evicted_blocks",
            "Event-backed entries the index dropped to stay within --index-max-bytes (cumulative)",
            registry=r,
        )
        self.index_workers = Gauge("kvroute_router_index_workers", "Workers known to the index", registry=r)
        self.workers_available = Gauge(
            "kvroute_router_workers_available", "Workers healthy, ready and not draining", registry=r
        )
        self.events = Counter(
            "kvroute_router_kv_events", "KV cache events applied to the index", ["worker"], registry=r
        )
        self.events_malformed = Counter(
            "kvroute_router_kv_events_malformed", "KV event batches that could not be decoded",
            ["worker"], registry=r,
        )
        self.events_unknown = Counter(
            "kvroute_router_kv_events_unknown",
            "KV events of a type this router does not know (skipped; the rest of the batch applied)",
            ["worker"], registry=r,
        )
        self.event_gaps = Counter(
            "kvroute_router_kv_event_gaps", "Sequence gaps seen on a worker's event stream",
            ["worker"], registry=r,
        )
        self.replay_failures = Counter(
            "kvroute_router_kv_event_replay_failures",
            "Gaps that replay could not fill (the worker's index entries were dropped)",
            ["worker"], registry=r,
        )
        self.engine_restarts = Counter(
            "kvroute_router_engine_restarts", "Event sequence restarts (new engine process)",
            ["worker"], registry=r,
        )
        self.upstream_errors = Counter(
            "kvroute_router_upstream_errors",
            "Failures talking to a worker (connect, first_byte_timeout: before the first byte, "
            "retried; body, stream: after it)",
            ["worker", "kind"], registry=r,
        )
        self.client_disconnects = Counter(
            "kvroute_router_client_disconnects",
            "Streams whose client left before the router had written all of them",
            ["worker"], registry=r,
        )
        self.retries = Counter(
            "kvroute_router_retries", "Requests sent again to another worker before any response byte",
            registry=r,
        )
        self.ejections = Counter(
            "kvroute_router_ejections",
            "Workers taken out after consecutive failed requests (outlier ejection)",
            ["worker"], registry=r,
        )
        self.client_timeouts = Counter(
            "kvroute_router_client_timeouts",
            "Client connections closed for being too slow: header (no whole request head within "
            "--header-timeout), body (--body-timeout, answered 408), idle (kept alive past "
            "--keepalive-timeout), shed (the oldest unfinished head, closed at --max-connections "
            "to admit a new connection)",
            ["kind"], registry=r,
        )
        self.connections = Gauge(
            "kvroute_router_client_connections", "Open client connections", registry=r
        )
        self.connections_refused = Counter(
            "kvroute_router_connections_refused",
            "Client connections answered 503 and closed at --max-connections",
            registry=r,
        )
        self.rejected_requests = Counter(
            "kvroute_router_rejected_requests",
            "Requests refused before routing: body_too_large (413, --max-body-bytes), "
            "content_encoding (415), json_too_deep (400)",
            ["reason"], registry=r,
        )
        self.offloaded_requests = Counter(
            "kvroute_router_offloaded_requests",
            "Requests whose parsing, tokenization and hashing ran off the event loop "
            "(bodies over --offload-bytes)",
            registry=r,
        )
        self.untokenized_prompts = Gauge(
            "kvroute_router_untokenized_prompts",
            "Prompts routed without tokenizing (no prefix match) for being longer in text than "
            "any prompt the engine accepts (cumulative)",
            registry=r,
        )
        self.prompt_cache_bytes = Gauge(
            "kvroute_router_prompt_cache_bytes",
            "Bytes held by the tokenization caches (bounded by --prompt-cache-bytes)",
            registry=r,
        )
        self.prompt_cache_evictions = Gauge(
            "kvroute_router_prompt_cache_evictions",
            "Entries the tokenization caches dropped to stay within --prompt-cache-bytes (cumulative)",
            registry=r,
        )
        self.health_failures = Counter(
            "kvroute_router_health_check_failures", "Failed /health checks", ["worker"], registry=r
        )

    def count_request(self, route: str, status: int) -> None:
        """One answered request of ``route`` (a route's canonical path, never a client's raw
        path) with ``status``. The labelled children are kept by (route, status), which stays
        small (routes times statuses), so no request pays prometheus_client's label lookup."""
        child = self._requests_by_key.get((route, status))
        if child is None:
            child = self._requests_by_key[(route, status)] = self.requests.labels(route, str(status))
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
