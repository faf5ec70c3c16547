"""Configuration of emulated vLLM workers.

The KV capacity follows vLLM's rule for ``--kv-cache-memory-bytes``: the number of blocks is
``memory // (block_size * kv_bytes_per_token)``. Bytes per token come from a model preset
(the reference experiment's Qwen3-0.6B in bf16, or the tiny CPU model of docs/vllm.md) unless given
explicitly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvroute import analytic
from kvroute.engine.cost import CostModel, get_preset
from kvroute.errors import UserError


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """What the emulator needs to know about a model: its KV footprint and the block size
    vLLM uses for it on its usual device."""

    name: str
    served_model_name: str
    kv_bytes_per_token: int
    block_size: int
    timing: str


def _preset(name: str, served_model_name: str, timing: str) -> ModelPreset:
    shape = analytic.MODEL_PRESETS[name]
    return ModelPreset(name, served_model_name, shape.kv_bytes_per_token, shape.block_size, timing)


#: Qwen3-0.6B in bf16 (114,688 B/token, block 16) and the tiny random Qwen3-style model that
#: vLLM serves on CPU in this project's tests (512 B/token, block 128); see kvroute.analytic.
MODEL_PRESETS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        _preset("qwen3-0.6b", "Qwen/Qwen3-0.6B", "reference-gpu"),
        _preset("tiny-cpu", "tiny-cpu", "cpu-tiny"),
    )
}

#: ``--max-model-len`` of an emulated worker unless told otherwise.
DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """One emulated worker's settings (shared by all workers of a ``--workers N`` group).

    Attributes:
        served_model_name: the names the server answers to; the first one is used in
            responses and metric labels (as in vLLM).
        max_model_len: longest prompt plus output, in tokens.
        block_size: tokens per KV block.
        kv_cache_memory_bytes: KV cache size; with ``kv_bytes_per_token`` it sets the number
            of blocks, unless ``num_gpu_blocks_override`` is given.
        timing: cost-model preset (``reference-gpu``, ``cpu-tiny``, ``instant``).
        time_scale: run that many times faster than real time (ratios are kept).
        max_num_seqs / max_num_batched_tokens: scheduler limits (default: the preset's).
        enable_prompt_tokens_details: report ``usage.prompt_tokens_details.cached_tokens``.
        enable_scale_out: serve the render routes (``/v1/completions/render``,
            ``/v1/chat/completions/render``: a prompt's token ids, vllm-router's input for
            ``kv_aware``), as ``vllm serve --enable-scale-out``; without it every scale-out
            route answers 403, as vLLM's default does.
        kv_events_config: vLLM's ``--kv-events-config`` JSON, or None.
        kv_events_wire_format: ``map`` (current vLLM) or ``array`` (older, positional).
        tokenizer: a local Hugging Face tokenizer directory, or None for the built-in one.
        enable_lora: serve LoRA adapters (``--enable-lora``).
        lora_modules: ``--lora-modules NAME=PATH ...`` as (name, path) pairs; a request whose
            ``model`` is a name runs under that adapter (the path is listed, never read).
        max_loras: adapters a batch may hold at once (vLLM's ``--max-loras``, default 1).
        lora_load_s: seconds a step takes longer for each adapter it brings into one of the
            ``max_loras`` slots (an assumption of the emulator, in real seconds: scaled
            with ``time_scale``).
    """

    served_model_name: tuple[str, ...] = ("Qwen/Qwen3-0.6B",)
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    kv_bytes_per_token: int = analytic.MODEL_PRESETS["qwen3-0.6b"].kv_bytes_per_token
    num_gpu_blocks_override: int | None = None
    timing: str = "reference-gpu"
    time_scale: float = 1.0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_prompt_tokens_details: bool = False
    enable_scale_out: bool = False
    kv_events_config: str | None = None
    kv_events_wire_format: str = "map"
    tokenizer: str | None = None
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    lora_load_s: float = 0.02

    @classmethod
    def for_model(cls, preset: str = "qwen3-0.6b", **overrides) -> EmulatorConfig:
        """A config with a model preset's name, bytes per token, block size and timing;
        ``overrides`` replace any field."""
        try:
            model = MODEL_PRESETS[preset]
        except KeyError:
            raise UserError(
                f"unknown model preset {preset!r}; choose one of: {', '.join(MODEL_PRESETS)}"
            ) from None
        base = cls(
            served_model_name=(model.served_model_name,),
            block_size=model.block_size,
            kv_bytes_per_token=model.kv_bytes_per_token,
            timing=model.timing,
        )
        return dataclasses.replace(base, **overrides)

    @property
    def model_name(self) -> str:
        return self.served_model_name[0]

    @property
    def num_gpu_blocks(self) -> int:
        """KV blocks, the null block included (what vLLM reports as ``num_gpu_blocks``)."""
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        return analytic.num_kv_blocks(
            self.kv_cache_memory_bytes, self.kv_bytes_per_token, self.block_size
        )

    @property
    def cost(self) -> CostModel:
        """The timing preset, scaled and with the scheduler limits applied."""
        try:
            model = get_preset(self.timing)
        except ValueError as exc:
            raise UserError(str(exc)) from None
        limits = {}
        if self.max_num_seqs is not None:
            limits["max_num_seqs"] = self.max_num_seqs
        if self.max_num_batched_tokens is not None:
            limits["max_num_batched_tokens"] = self.max_num_batched_tokens
        model = dataclasses.replace(model, **limits)
        try:
            return model.scaled(self.time_scale) if self.time_scale != 1.0 else model
        except ValueError as exc:
            raise UserError(str(exc)) from None

    def validate(self) -> None:
        """Refuse settings a vLLM would refuse at start-up (raises UserError)."""
        if not self.served_model_name or not all(self.served_model_name):
            raise UserError("--served-model-name needs at least one non-empty name")
        for name, value in (
            ("--max-model-len", self.max_model_len),
            ("--block-size", self.block_size),
            ("--kv-bytes-per-token", self.kv_bytes_per_token),
        ):
            if value <= 0:
                raise UserError(f"{name} must be positive, got {value}")
        if self.lora_modules and not self.enable_lora:
            raise UserError("--lora-modules needs --enable-lora")
        if self.max_loras < 1:
            raise UserError(f"--max-loras must be positive, got {self.max_loras}")
        if not self.lora_load_s >= 0:
            raise UserError(f"--lora-load-time must be non-negative, got {self.lora_load_s}")
        names = [name for name, _ in self.lora_modules]
        for name in names:
            if not name or name in self.served_model_name or names.count(name) > 1:
                raise UserError(
                    f"--lora-modules: {name!r} must be a non-empty name, unique, and not a "
                    "served model name"
                )
        if self.kv_events_wire_format not in ("map", "array"):
            raise UserError(
                f"--kv-events-wire-format must be map or array, got {self.kv_events_wire_format!r}"
            )
        cost = self.cost
        if cost.max_num_seqs < 1 or cost.max_num_batched_tokens < 1:
            raise UserError("--max-num-seqs and --max-num-batched-tokens must be positive")
        blocks = self.num_gpu_blocks
        # vLLM refuses to start when one request of max_model_len cannot fit in the cache;
        # the emulator must too, or such a request would wait forever.
        usable_tokens = analytic.usable_blocks(blocks) * self.block_size
        if blocks < 2 or usable_tokens < self.max_model_len:
            need = -(-self.max_model_len // self.block_size) + 1
            raise UserError(
                f"the KV cache has {blocks} blocks of {self.block_size} tokens "
                f"({max(usable_tokens, 0)} tokens usable) but --max-model-len "
                f"{self.max_model_len} needs {need} blocks; raise --kv-cache-memory-bytes "
                f"(now {self.kv_cache_memory_bytes} bytes at {self.kv_bytes_per_token} "
                "bytes/token) or lower --max-model-len"
            )
