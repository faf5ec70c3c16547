"""Flags shared by several subcommands: workload shape, worker KV geometry and sweeps."""

from __future__ import annotations

import argparse

from kvroute.analytic import (
    MODEL_PRESETS,
    ModelShape,
    dtype_bytes,
    kv_bytes_per_token,
    num_kv_blocks,
)
from kvroute.errors import UserError
from kvroute.units import parse_bytes, parse_tokens
from kvroute.workload import LengthDist, WorkloadSpec


def add_workload_arguments(parser: argparse.ArgumentParser, prefixes_default: str | None,
                           prefixes_preset: str | None = None) -> None:
    """The workload's shape. ``prefixes_default`` None leaves ``--prefixes`` to the command's
    preset, which ``prefixes_preset`` names in the help (e.g. "reference: 2,7,12,24")."""
    g = parser.add_argument_group("workload (the reference experiment's by default)")
    shown = prefixes_preset if prefixes_default is None else "default %(default)s"
    g.add_argument("--prefixes", "-K", default=prefixes_default, metavar="K[,K...]",
                   help=f"number of distinct shared prefixes; a comma list sweeps ({shown})")
    g.add_argument("--prefix-tokens", default="2032", metavar="N|LO:HI|A,B",
                   help="prefix length: fixed, uniform range, or choices (default %(default)s)")
    g.add_argument("--suffix-tokens", default="339", metavar="N|LO:HI|A,B",
                   help="unique suffix length per request (default %(default)s; mean prompt 2,371)")
    g.add_argument("--output-tokens", type=int, default=64, help="tokens generated per request (default %(default)s)")
    g.add_argument("--requests", type=int, default=None,
                   help="measured requests per point (default max(200, 20·K))")
    g.add_argument("--zipf", type=float, default=0.0, metavar="ALPHA",
                   help="Zipf popularity exponent over prefixes; 0 = each prefix equally often")
    g.add_argument("--seed", type=int, default=0, help="fixes tokens, order and random choices (default %(default)s)")
    g.add_argument("--adapters", type=int, default=0, metavar="N",
                   help="tenants on N LoRA adapters: each prefix belongs to one adapter and its "
                        "requests name it as model (workers kvroute starts serve them); 0: none")
    g.add_argument("--adapter-zipf", type=float, default=0.0, metavar="ALPHA",
                   help="popularity skew of the adapters over the prefixes (default 0: even)")
    g.add_argument("--salted", action="store_true",
                   help="each tenant (adapter, or prefix without adapters) sends its own cache_salt")


def workload_spec(args: argparse.Namespace, prefixes: int) -> WorkloadSpec:
    for flag, value in (("--requests", args.requests), ("--output-tokens", args.output_tokens)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    return WorkloadSpec(
        prefixes=prefixes,
        prefix_tokens=LengthDist.parse(args.prefix_tokens),
        suffix_tokens=LengthDist.parse(args.suffix_tokens),
        output_tokens=args.output_tokens,
        requests=args.requests,
        zipf_alpha=args.zipf,
        seed=args.seed,
        adapters=args.adapters,
        adapter_zipf=args.adapter_zipf,
        salted=args.salted,
    )


def add_worker_arguments(
    parser: argparse.ArgumentParser,
    title: str = "worker KV cache (the reference: Qwen3-0.6B bf16, 1 GiB, block 16)",
    model_flag: str = "--model",
) -> None:
    """KV memory, model geometry and block size of a worker. ``model_flag`` names the preset
    flag (``kvroute bench`` uses ``--kv-model``: its ``--model`` is the served model name)."""
    g = parser.add_argument_group(title)
    size = g.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-memory-bytes", default="1GiB", metavar="SIZE",
                      help="KV memory per worker, as vLLM's flag (default %(default)s)")
    size.add_argument("--kv-capacity-tokens", default=None, metavar="N",
                      help="KV capacity per worker in tokens instead: 3M, 500k (decimal); "
                           "blocks = N / block size, plus vLLM's null block")
    g.add_argument(model_flag, dest="kv_model", default="qwen3-0.6b", choices=sorted(MODEL_PRESETS),
                   help="model preset giving KV bytes per token (default %(default)s)")
    g.add_argument("--model-shape", default=None, metavar="LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]",
                   help="model KV geometry instead of a preset, e.g. 28,8,128,bfloat16")
    g.add_argument("--kv-bytes-per-token", type=int, default=None, help="KV bytes per token, overriding the model")
    g.add_argument("--block-size", type=int, default=None,
                   help="KV block size in tokens (default: the model preset's, 16 on GPU)")


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The model's KV geometry: ``--model-shape`` when given, else the ``--model`` preset."""
    if not args.model_shape:
        return MODEL_PRESETS[args.kv_model]
    text = args.model_shape
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (3, 4):
        raise UserError(f"bad --model-shape {text!r}: expected LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]")
    try:
        layers, heads, dim = (int(p) for p in parts[:3])
        shape = ModelShape(text, layers, heads, dim, parts[3] if len(parts) == 4 else "bfloat16")
        _ = shape.kv_bytes_per_token  # checks sizes and the dtype name
    except ValueError as exc:
        raise UserError(f"bad --model-shape {text!r}: {exc}") from None
    return shape


def kv_geometry(args: argparse.Namespace) -> tuple[int, int, int]:
    """(num_blocks incl. the null block, block_size, bytes per token) from the worker flags."""
    shape = model_shape(args)
    try:
        per_token = args.kv_bytes_per_token or kv_bytes_per_token(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype_bytes(shape.dtype)
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    block_size = args.block_size or shape.block_size
    if block_size < 1 or per_token < 1:
        raise UserError("block size and KV bytes per token must be >= 1")
    if getattr(args, "kv_capacity_tokens", None) is not None:
        blocks = parse_tokens(args.kv_capacity_tokens) // block_size + 1  # the null block holds none
    else:
        blocks = num_kv_blocks(parse_bytes(args.kv_cache_memory_bytes), per_token, block_size)
    if blocks < 2:
        raise UserError(
            f"--kv-cache-memory-bytes {args.kv_cache_memory_bytes} holds {blocks} blocks of "
            f"{block_size} tokens × {per_token} B: too small for even one block besides the null block"
        )
    return blocks, block_size, per_token


def name_list(text: str, choices: list[str], what: str) -> list[str]:
    names = [n.strip() for n in str(text).split(",") if n.strip()]
    bad = [n for n in names if n not in choices]
    if not names or bad:
        raise UserError(f"bad {what} {text!r}: choose from {', '.join(choices)}")
    return names


def add_policy_option_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup, help_text: str) -> None:
    parser.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE", help=help_text)


def parse_policy_options(specs: list[str]) -> dict[str, object]:
    """``--policy-option KEY=VALUE`` flags as keyword options for ``make_policy``: keys with
    dashes or underscores; values as None, booleans, integers, floats or else text.

    Raises:
        UserError: a flag without ``=`` or a key, or a key given twice.
    """
    options: dict[str, object] = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise UserError(f"bad --policy-option {spec!r}: expected KEY=VALUE")
        if key in options:
            raise UserError(f"--policy-option {key} is given twice")
        options[key] = _option_value(value.strip())
    return options


def _option_value(text: str) -> object:
    lowered = text.lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def add_trace_window_arguments(group: argparse._ArgumentGroup) -> None:
    """``--start``, ``--duration``, ``--max-requests`` and ``--cut-sessions``: which part of a
    ``--trace`` a command uses (``kvroute.trace.Trace.select``), the same for every command."""
    group.add_argument("--start", type=float, default=0.0, metavar="S",
                       help="with --trace: sessions starting S seconds after its first request (default 0)")
    group.add_argument("--duration", type=float, default=None, metavar="S",
                       help="with --trace: a window of S seconds; sessions starting in it come whole")
    group.add_argument("--max-requests", type=int, default=None, metavar="N",
                       help="with --trace: at most N requests, whole sessions in order of first arrival")
    group.add_argument("--cut-sessions", action="store_true",
                       help="with --trace: a plain time window, only the requests arriving in it")
