"""Real request traces: parse, window, synthesize prompts, replay, and measure their reuse.

* ``kvroute.trace.format`` reads a JSONL trace in Mooncake's format (FAST'25: ``timestamp`` in
  ms, ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks) or kvroute's own
  (``timestamp`` in s, the prompt as token ids or text), auto-detected per file; cuts windows
  and samples that keep sessions whole; synthesizes prompt tokens per hash id; and turns a
  trace into the open-loop request list a simulator or the bench replays.
* ``kvroute.trace.reuse`` measures the trace's own reuse with no engine: infinite-cache hit
  ratios, the exact LRU hit ratio at every capacity (one stack-distance pass), and a fleet of W
  workers under random balancing, prefix-affine routing and one pooled cache.
* ``kvroute.trace.plots`` draws those curves.
"""

from kvroute.trace.format import (
    BLOCK_TOKENS,
    ReplayRequest,
    Trace,
    TraceRequest,
    block_tokens,
    load_trace,
    parse_trace,
)

__all__ = [
    "BLOCK_TOKENS",
    "ReplayRequest",
    "Trace",
    "TraceRequest",
    "block_tokens",
    "load_trace",
    "parse_trace",
]
