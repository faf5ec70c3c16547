"""The live router's Python face: the native router that sends each request to the worker
holding most of its prefix, fed by the workers' KV events or by its own predictions, started as
an OpenAI-compatible proxy (``kvroute serve``) or as a gateway's Endpoint Picker (``kvroute epp``).

* :mod:`.server` — ``Router``, ``start_router``: the native data plane, started and inspected.
* :mod:`.config` — ``RouterConfig``: every setting, its default, the derived body limit.
* :mod:`.discovery` — ``Endpoint`` and the ``Discovery`` sources (static, file, DNS);
  :mod:`.k8s` — Kubernetes EndpointSlices and InferencePools.
* :mod:`.resources` — the process's descriptor limit and malloc, set before serving.
* :mod:`.status` — a worker's state and a metric's value, as the router reports them.
"""

from kvroute.kvevents import EventsSettings, EventsSource
from kvroute.router.config import RouterConfig
from kvroute.router.discovery import DnsDiscovery, Endpoint, FileDiscovery, StaticDiscovery
from kvroute.router.server import WORKER_HEADER, Router, start_router

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
