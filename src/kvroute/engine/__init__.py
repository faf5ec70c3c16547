"""The pure engine model of a vLLM v1 worker: BlockPool, scheduler, cost model, events."""

from kvroute.engine.cost import CPU_TINY, INSTANT, PRESETS, REFERENCE_GPU, CostModel, get_preset
from kvroute.engine.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)
from kvroute.engine.pool import BlockPool
from kvroute.engine.scheduler import Engine, EngineRequest, PrefixCacheStats, RequestOutput, StepResult

__all__ = [
    "AllBlocksCleared",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CPU_TINY",
    "CostModel",
    "Engine",
    "EngineRequest",
    "EventBatch",
    "INSTANT",
    "KVCacheEvent",
    "PRESETS",
    "PrefixCacheStats",
    "REFERENCE_GPU",
    "RequestOutput",
    "StepResult",
    "get_preset",
]
