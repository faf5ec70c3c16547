"""The live router (``kvroute serve``): an OpenAI-compatible proxy that sends each request to
the worker holding most of its prefix, fed by the workers' KV events or by its own predictions.

* :mod:`.app` — ``RouterConfig``, ``Router``, ``start_router`` (HTTP routes, forwarding, drain).
* :mod:`.pool` — worker membership, health checks, load accounting, the native KV event consumer.
* :mod:`.discovery` — ``Endpoint`` and the ``Discovery`` sources (static, file, DNS).
* :mod:`.prompts` — request body to token ids to block hashes, exactly as the engine tokenizes.
* :mod:`.metrics` — the router's Prometheus metrics.
"""

from kvroute.kvevents import EventsSettings, EventsSource
from kvroute.proxy.app import WORKER_HEADER, Router, RouterConfig, start_router
from kvroute.proxy.discovery import DnsDiscovery, Endpoint, FileDiscovery, StaticDiscovery

__all__ = [
    "DnsDiscovery",
    "Endpoint",
    "EventsSettings",
    "EventsSource",
    "FileDiscovery",
    "Router",
    "RouterConfig",
    "StaticDiscovery",
    "WORKER_HEADER",
    "start_router",
]
