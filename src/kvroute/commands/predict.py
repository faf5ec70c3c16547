"""``kvroute predict``: the analytic model's hit rates for a fleet, without running anything.

A thin layer over ``kvroute.analytic``: parse flags, build the workload shape and the KV capacity,
call ``predict`` for every (policy, W, K) point, print one table and the notes on where each
estimate holds, and optionally write the predictions as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from rich import box
from rich.table import Table

from kvroute import analytic as model
from kvroute.commands import _trace_predict as trace
from kvroute.commands._common import model_shape
from kvroute.errors import UserError
from kvroute.report import output_console
from kvroute.units import parse_bytes, parse_tokens
from kvroute.workload import parse_int_list

NAME = "predict"
HELP = "predict prefix-cache hit rates from KV capacity and workload shape (no servers)"
DESCRIPTION = """\
Predict prefix-cache hit rates of W vLLM workers behind a balancer, from the model's KV size,
--kv-cache-memory-bytes and the workload's shape. Nothing is started or sent.

Reference experiment (docs/experiment.md): Qwen3-0.6B, 114,688 B of KV per token; 1 GiB per worker
at block size 16 is 585 blocks (584 usable); a request of 2,032 prefix + 339 suffix tokens and
64 output tokens leaves 152 blocks cached, so C = 584/152 = 3.84 requests fit per worker.

  kvroute predict --workers 6,3 --prefixes 2,7,12,24

Columns:
  C          requests whose cached blocks fit in one worker (usable blocks / blocks each).
  C/K        min(1, C/K): random balancing, LRU, uniform popularity, equal lengths, K >> 1.
             W does not appear: every worker stores every prefix.
  W*C/K      min(1, W*C/K): the bound for routing each prefix to one owner.
  first      exact where every prefix fits on every worker: W*K - K first-contact misses
  contact    after a one-per-prefix warmup (6 workers, K=2, 200 requests: 190 hits = 0.950;
             3 workers: 196 = 0.980); 0 under prefix-hash. "—" where prefixes are evicted.
  Che        Che's approximation of LRU (skew, mixed lengths), steady state.
  pred hit   Che over the measured window, first contacts included.
  pred tokens  the same in tokens, as vLLM's prefix_cache_hits / prefix_cache_queries count:
             190 hits of 200 → 190*2,032 / (200*2,371) = 0.814.

More:
  kvroute predict --prefixes 24 --zipf 1.0 --policy random,prefix-hash
  kvroute predict --prefixes 12 --prefix-tokens 512,2032,4000     (mixed lengths, in turn)
  kvroute predict --model tiny-cpu --kv-cache-memory-bytes 4M     (vLLM on CPU: 64 blocks of 128)
  kvroute predict --model-shape 32,8,128,bf16 --kv-cache-memory-bytes 20G --json out.json
  kvroute predict --kv-capacity-tokens 100k                      (capacity in tokens, not bytes)

A trace instead of a workload shape (Mooncake's JSONL or kvroute's own, auto-detected): the
trace's own reuse with no engine — the infinite-cache token and block hit ratios, the LRU hit
ratio against one cache's capacity (10^4 to 10^8 tokens, exact: one stack-distance pass), and
for W workers of X tokens each: random balancing, prefix-affine routing and one pooled cache
of W·X. Tables, two PNG plots and summary.json in --out.

  kvroute predict --trace synthetic_trace.jsonl                   (W = 8, X = 3M tokens)
  kvroute predict --trace conversation_trace.jsonl --workers 4,8,16 --kv-capacity-tokens 1M
  kvroute predict --trace conversation_trace.jsonl --start 600 --duration 120
"""


def _non_negative_float(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise UserError(f"bad {what} {text!r}: expected a number") from None
    if value < 0 or not math.isfinite(value):
        raise UserError(f"bad {what} {text!r}: must be a finite number >= 0")
    return value


def _model_shape(args: argparse.Namespace) -> tuple[str, int, int]:
    """(description, KV bytes per token, default block size) from the model flags."""
    if args.kv_bytes_per_token is not None:
        if args.kv_bytes_per_token < 1:
            raise UserError(f"--kv-bytes-per-token must be >= 1, got {args.kv_bytes_per_token}")
        return f"{args.kv_bytes_per_token:,} B/token", args.kv_bytes_per_token, 16
    shape = model_shape(args)
    if args.model_shape is not None:
        described = f"{shape.num_layers} layers x {shape.num_kv_heads} KV heads x {shape.head_dim} ({shape.dtype})"
        return described, shape.kv_bytes_per_token, shape.block_size
    return shape.name, shape.kv_bytes_per_token, shape.block_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers", default=None, help="W, or a comma list (default 6,3; 8 with --trace)"
    )
    parser.add_argument(
        "--prefixes", default="2,7,12,24", help="K, or a comma list (default 2,7,12,24)"
    )
    parser.add_argument(
        "--prefix-tokens",
        default="2032",
        help="prefix length; a comma list gives prefixes these lengths in turn (default 2032)",
    )
    parser.add_argument("--suffix-tokens", default="339", help="mean unique suffix (default 339)")
    parser.add_argument("--output-tokens", default="64", help="mean output tokens (default 64)")
    parser.add_argument(
        "--requests", type=int, default=None, help="measured requests (default max(200, 20*K))"
    )
    parser.add_argument(
        "--zipf", default="0", metavar="ALPHA", help="Zipf popularity exponent; 0 = uniform"
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="no unmeasured request per prefix before the window",
    )
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument(
        "--model",
        dest="kv_model",
        choices=sorted(model.MODEL_PRESETS),
        default="qwen3-0.6b",
        help="model preset (default qwen3-0.6b; tiny-cpu is vLLM on CPU with block size 128)",
    )
    shape.add_argument("--kv-bytes-per-token", type=int, default=None, metavar="N",
                       help="KV bytes per token instead of a model (block size 16 unless --block-size)")
    shape.add_argument(
        "--model-shape", default=None, metavar="LAYERS,KV_HEADS,HEAD_DIM[,DTYPE]",
        help="the model's KV geometry instead of a preset, e.g. 28,8,128,bfloat16 (Qwen3-0.6B)",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--kv-cache-memory-bytes",
        default=None,
        metavar="SIZE",
        help="KV memory per worker: bytes, 1G/64M (binary, as vLLM), 1GiB (default 1GiB)",
    )
    size.add_argument(
        "--kv-capacity-tokens",
        default=None,
        metavar="N",
        help="KV capacity per worker in tokens instead: 3M, 500k, 1.5G (decimal; default 3M "
        "with --trace)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (default: the preset's, 16 on GPU, 128 for tiny-cpu)",
    )
    parser.add_argument(
        "--policy",
        default="random",
        help="random (a Service), prefix-hash (one owner per prefix), or both: random,prefix-hash",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="write predictions")
    trace.add_arguments(parser)


def _kv_blocks(args: argparse.Namespace, bytes_per_token: int, block_size: int) -> tuple[int, int]:
    """(bytes, blocks incl. the null block) from --kv-cache-memory-bytes or --kv-capacity-tokens."""
    if args.kv_capacity_tokens is not None:
        tokens = parse_tokens(args.kv_capacity_tokens)
        blocks = tokens // block_size + 1  # the null block holds no tokens
        return blocks * block_size * bytes_per_token, blocks
    memory = parse_bytes(args.kv_cache_memory_bytes or "1GiB")
    return memory, model.num_kv_blocks(memory, bytes_per_token, block_size)


def run(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return trace.run(args, _trace_capacity_tokens)
    workers = parse_int_list(args.workers or "6,3", "--workers")
    prefixes = parse_int_list(args.prefixes, "--prefixes")
    prefix_tokens = parse_int_list(args.prefix_tokens, "--prefix-tokens")
    suffix = _non_negative_float(args.suffix_tokens, "--suffix-tokens")
    output = _non_negative_float(args.output_tokens, "--output-tokens")
    alpha = _non_negative_float(args.zipf, "--zipf")
    policies = [p.strip() for p in args.policy.split(",")]
    for p in policies:
        if p not in model.POLICIES:
            raise UserError(f"unknown policy {p!r}; choose from {', '.join(model.POLICIES)}")
    if args.requests is not None and args.requests < 1:
        raise UserError(f"--requests must be >= 1, got {args.requests}")
    described, bytes_per_token, default_block = _model_shape(args)
    block_size = args.block_size if args.block_size is not None else default_block
    if block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {block_size}")
    memory, blocks = _kv_blocks(args, bytes_per_token, block_size)
    if blocks < 2:
        raise UserError(
            f"{memory:,} bytes hold {blocks} blocks of {block_size} tokens at "
            f"{bytes_per_token:,} B/token; a worker needs at least 2 (one is the null block)"
        )

    predictions: list[model.Prediction] = []
    try:
        for k in prefixes:
            shape = model.WorkloadShape.reference(
                k, prefix_tokens, suffix, output, alpha, args.requests, not args.no_warmup
            )
            for policy in policies:
                for w in workers:
                    predictions.append(model.predict(shape, w, blocks, block_size, policy))
    except ValueError as exc:
        raise UserError(str(exc)) from None

    console = output_console()
    usable = model.usable_blocks(blocks)
    console.print(
        f"[bold]{described}[/]: {bytes_per_token:,} B of KV per token; "
        f"{memory:,} B per worker = {blocks:,} blocks of {block_size} tokens "
        f"({usable:,} usable, the null block excluded)"
    )
    mixed = "mixed prefixes " + ",".join(map(str, prefix_tokens)) if len(prefix_tokens) > 1 else (
        f"{prefix_tokens[0]:,}-token prefix"
    )
    console.print(
        f"Request: {mixed} + {suffix:g} suffix tokens, {output:g} output tokens; "
        f"popularity {'uniform' if alpha == 0 else f'Zipf({alpha:g})'}"
        f"{'' if not args.no_warmup else '; no warmup'}"
    )
    footprints = {round(p.blocks_per_request, 6) for p in predictions}
    if len(footprints) == 1:
        p = predictions[0]
        per_request = (
            f"{p.blocks_per_request:g}"
            if p.blocks_per_request == int(p.blocks_per_request)
            else f"{p.blocks_per_request:.1f}"
        )
        console.print(
            f"Each request leaves {per_request} blocks cached (prompt and output, full "
            f"blocks), so C = {p.usable_blocks} / {per_request} = {p.capacity_requests:.2f} "
            "requests fit per worker"
        )
    else:
        console.print("C varies by point (mixed lengths or skew): the mean blocks per request")
    console.print(_table(predictions))
    console.print(
        "pred hit: Che over the measured window, first contacts included; pred tokens: the "
        "same as cached / prompt tokens (vLLM's prefix_cache_hits / prefix_cache_queries)",
        highlight=False,
    )
    console.print("[bold]Where each estimate holds[/]")
    for note in _notes(predictions):
        console.print(f"- {note}", highlight=False)

    if args.json is not None:
        payload = {
            "model": described,
            "kv_bytes_per_token": bytes_per_token,
            "kv_cache_memory_bytes": memory,
            "block_size": block_size,
            "num_blocks": blocks,
            "prefix_tokens": prefix_tokens,
            "suffix_tokens": suffix,
            "output_tokens": output,
            "zipf_alpha": alpha,
            "warmup": not args.no_warmup,
            "points": [p.to_json() for p in predictions],
        }
        try:
            args.json.write_text(json.dumps(payload, indent=2) + "\n")
        except OSError as exc:
            raise UserError(f"cannot write {args.json}: {exc.strerror}") from None
        console.print(f"wrote {args.json}")
    return 0


def _trace_capacity_tokens(args: argparse.Namespace) -> tuple[int, str]:
    """Per-worker capacity X in tokens for --trace, and where it came from."""
    if args.kv_capacity_tokens is not None:
        return parse_tokens(args.kv_capacity_tokens), "--kv-capacity-tokens"
    if args.kv_cache_memory_bytes is None:
        return 3_000_000, "default: the paper's 3M-token local cache"
    described, bytes_per_token, default_block = _model_shape(args)
    block_size = args.block_size if args.block_size is not None else default_block
    memory, blocks = _kv_blocks(args, bytes_per_token, block_size)
    usable = model.usable_blocks(blocks)
    if usable < 1:
        raise UserError(f"--kv-cache-memory-bytes {args.kv_cache_memory_bytes} holds no usable block")
    return usable * block_size, (
        f"{memory:,} B / {bytes_per_token:,} B per token ({described}) = {usable:,} blocks of {block_size}"
    )


def _table(predictions: list[model.Prediction]) -> Table:
    """One row per point, hit rates as fractions."""
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    for name in ("policy", "W", "K", "N", "C", "C/K", "W*C/K", "first\ncontact", "Che"):
        table.add_column(name, justify="left" if name == "policy" else "right", no_wrap=True)
    table.add_column("pred\nhit", justify="right", no_wrap=True)
    table.add_column("pred\ntokens", justify="right", no_wrap=True)
    for p in predictions:
        first = "—" if p.first_contact_hit is None else f"{p.first_contact_hit:.3f}"
        table.add_row(
            p.policy,
            str(p.workers),
            str(p.prefixes),
            str(p.requests),
            f"{p.capacity_requests:.2f}",
            f"{p.formula_hit:.3f}",
            f"{p.bound_hit:.3f}",
            first,
            f"{p.che_hit:.3f}",
            f"{p.request_hit_rate:.3f}",
            f"{p.token_hit_rate:.3f}",
        )
    return table

#: The order notes are printed in; notes particular to one point go after the general ones.
_NOTE_ORDER = (
    model.NOTE_FORMULA,
    model.NOTE_SKEW,
    model.NOTE_MIXED,
    model.NOTE_BOUND,
    model.NOTE_FIRST_CONTACT,
    model.NOTE_NO_FIRST_CONTACT,
    model.NOTE_CHE,
    model.NOTE_WINDOW,
)


def _notes(predictions: list[model.Prediction]) -> list[str]:
    """Every distinct note of the points, general ones first in a fixed order."""
    seen: list[str] = []
    for p in predictions:
        seen.extend(n for n in p.notes if n not in seen)
    rank = {note: i for i, note in enumerate(_NOTE_ORDER)}
    return sorted(seen, key=lambda n: rank.get(n, len(_NOTE_ORDER)))
