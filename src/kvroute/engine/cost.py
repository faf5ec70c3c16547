"""Cost model: how long one engine step takes, and the fixed front-end time of a request.

The model itself is native (``kvroute-sim``'s ``engine::cost``, which documents the formula
and calibrates the presets); this module is its Python face. ``CostModel`` stays a frozen
dataclass of the parameters, so configuration code can ``dataclasses.replace`` it, and the
engine reads those fields. Presets:

* ``reference-gpu`` — the reference experiment's Qwen3-0.6B on shared GPUs (TTFT p50 ≈ 40 ms
  on a hit, ≈ 105–113 ms on a miss at concurrency 4 on 6 workers, as measured there).
* ``cpu-tiny`` — vLLM on a 2-core machine with the tiny Qwen3-style model (docs/vllm.md).
* ``instant`` — every step takes zero time; for protocol tests and router soak runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute import _native


@dataclass(frozen=True, slots=True)
class CostModel:
    """Linear step-time model; all times in seconds:
    ``step_s = step_base_s + prefill_token_s·prefill_tokens + decode_seq_s·decode_seqs``
    (0 for an empty step), plus ``frontend_s`` once per request before the engine."""

    name: str
    step_base_s: float
    prefill_token_s: float
    decode_seq_s: float
    frontend_s: float
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256

    def step_time(self, prefill_tokens: int, decode_seqs: int) -> float:
        return _native.cost_step_time(self, prefill_tokens, decode_seqs)

    def scaled(self, factor: float) -> CostModel:
        """The same model running ``factor`` times faster (emulator time scaling)."""
        return CostModel(*_native.cost_scaled(self, factor))


PRESETS: dict[str, CostModel] = {m[0]: CostModel(*m) for m in _native.cost_presets()}
REFERENCE_GPU = PRESETS["reference-gpu"]
CPU_TINY = PRESETS["cpu-tiny"]
INSTANT = PRESETS["instant"]


def get_preset(name: str) -> CostModel:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown timing preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None
