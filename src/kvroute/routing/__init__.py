"""Routing: balancing policies shared by the simulator and the live router
(``kvroute.routing.policies``), the router-side index of which worker holds which KV block
(``kvroute.routing.index``) and the one routing step around them (:class:`RoutingStep`:
look-up, policy, prediction and load accounting, used by ``kvroute.sim`` and
``kvroute.router``). All three are native (``kvroute_core``)."""

from kvroute._native import RoutingStep
from kvroute.routing.index import IndexStats, KvIndex
from kvroute.routing.policies import (
    POLICIES,
    KvAwarePolicy,
    Policy,
    RequestView,
    WorkerState,
    make_policy,
)

__all__ = [
    "POLICIES", "IndexStats", "KvAwarePolicy", "KvIndex", "Policy", "RequestView", "RoutingStep", "WorkerState",
    "make_policy",
]
