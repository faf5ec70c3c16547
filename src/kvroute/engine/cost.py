"""Cost model: how long one engine step takes, and the fixed front-end time of a request.

A vLLM step runs one forward pass over a batch that mixes prefill chunks and decodes. On the
small models and short contexts of the reference experiment its time is close to linear in the
prefill tokens and in the number of decoding sequences:

    step_s = step_base_s + prefill_token_s * prefill_tokens + decode_seq_s * decode_seqs

A request also pays ``frontend_s`` once before it reaches the engine (HTTP, tokenization,
detokenizer start), which is why a fully cached prompt still sees tens of milliseconds of TTFT.

Presets (calibration in the docstring of each; check with ``benchmarks/calibration.py``):

* ``reference-gpu`` — the reference experiment's Qwen3-0.6B on shared 8–24 GB GPUs, chosen so
  that the simulator at concurrency 4 on 6 workers gives TTFT p50 ≈ 40 ms on a hit
  (339 uncached tokens) and ≈ 105–113 ms on a miss (2,371 tokens), as measured there.
* ``cpu-tiny`` — vLLM on this 2-core machine with the tiny Qwen3-style model (VLLM.md):
  miss TTFT ~450–500 ms and hit ~110–130 ms for a ~2.3k-token prompt (1,920 tokens cached at
  block size 128), decode ~160–210 tokens/s for one stream.
* ``instant`` — every step takes zero time; for protocol tests and router soak runs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    """Linear step-time model; all times in seconds."""

    name: str
    step_base_s: float
    prefill_token_s: float
    decode_seq_s: float
    frontend_s: float
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256

    def step_time(self, prefill_tokens: int, decode_seqs: int) -> float:
        if prefill_tokens == 0 and decode_seqs == 0:
            return 0.0
        return (
            self.step_base_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
        )

    def scaled(self, factor: float) -> CostModel:
        """The same model running ``factor`` times faster (emulator time scaling)."""
        if factor <= 0:
            raise ValueError(f"time scale must be positive, got {factor}")
        return CostModel(
            name=self.name,
            step_base_s=self.step_base_s / factor,
            prefill_token_s=self.prefill_token_s / factor,
            decode_seq_s=self.decode_seq_s / factor,
            frontend_s=self.frontend_s / factor,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
        )


#: Hit: 22.6 + 6 + 339·0.0334 ≈ 40 ms; miss: 22.6 + 6 + 2,371·0.0334 ≈ 108 ms (unloaded).
REFERENCE_GPU = CostModel(
    name="reference-gpu",
    step_base_s=0.006,
    prefill_token_s=0.0000334,
    decode_seq_s=0.0002,
    frontend_s=0.0226,
)

#: Hit (451 uncached tokens): 30 + 5.5 + 451·0.185 ≈ 119 ms; miss (2,371): ≈ 474 ms;
#: one decoding stream: 1 / (5.5 + 0.2) ms ≈ 175 tokens/s.
CPU_TINY = CostModel(
    name="cpu-tiny",
    step_base_s=0.0055,
    prefill_token_s=0.000185,
    decode_seq_s=0.0002,
    frontend_s=0.030,
    max_num_batched_tokens=4096,
)

INSTANT = CostModel(
    name="instant", step_base_s=0.0, prefill_token_s=0.0, decode_seq_s=0.0, frontend_s=0.0
)

PRESETS: dict[str, CostModel] = {m.name: m for m in (REFERENCE_GPU, CPU_TINY, INSTANT)}


def get_preset(name: str) -> CostModel:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown timing preset {name!r}; choose one of: {', '.join(PRESETS)}"
        ) from None
