"""Routing: balancing policies shared by the simulator and the live router
(``kvroute.routing.policies``) and the router-side index of which worker holds which KV block
(``kvroute.routing.index``)."""

from kvroute.routing.index import IndexStats, KvIndex
from kvroute.routing.policies import (
    POLICIES,
    KvAwarePolicy,
    Policy,
    RequestView,
    WorkerState,
    make_policy,
)

__all__ = ["POLICIES", "IndexStats", "KvAwarePolicy", "KvIndex", "Policy", "RequestView", "WorkerState", "make_policy"]
