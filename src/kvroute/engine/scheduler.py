"""The engine model: a vLLM v1 scheduler over a BlockPool, with a cost model for time.

Native (``kvroute-sim``'s ``engine::scheduler``, which documents the scheduling rules it
follows from vLLM's ``scheduler.py``); this module is its Python face. Pure by design: no
clock, no sockets. A driver hands it requests and the current time and asks it to run a step;
it answers what happened and how long the step took. The simulator drives it on virtual time,
the emulator on the wall clock.
"""

from __future__ import annotations

from kvroute import _native
from kvroute._native import EngineRequest, PrefixCacheStats, RequestOutput, StepResult

__all__ = ["Engine", "EngineRequest", "PrefixCacheStats", "RequestOutput", "StepResult"]


class Engine(_native.Engine):
    """One vLLM worker: a BlockPool, a scheduler and a cost model.

    Args:
        num_blocks: KV blocks including the null block.
        block_size: tokens per block.
        cost: the step-time model (``CostModel``).
        hasher: the block hasher (default ``BlockHasher(block_size)``).
        enable_caching: prefix caching on (vLLM's default in v1).
        emit_events: collect KV events per step (the emulator publishes them).
    """

    __slots__ = ()
