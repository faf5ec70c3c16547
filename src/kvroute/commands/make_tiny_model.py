"""``kvroute make-tiny-model``: write a tiny random Qwen3-style model that vLLM can serve."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvroute.errors import UserError
from kvroute.tinymodel import LORA_FILES, TinyModelConfig, build_tiny_lora, build_tiny_model, parameter_count
from kvroute.workload import adapter_name

NAME = "make-tiny-model"
HELP = "write a tiny random Qwen3-style model + BPE tokenizer for running real vLLM offline"
DESCRIPTION = """\
Write a model directory that vLLM can load and serve without downloading anything: a
Qwen3ForCausalLM config (hidden size 128, 2 layers, 4 query heads, 2 KV heads of size 32,
8192 positions), random bf16 weights in model.safetensors, and a byte-level BPE tokenizer
trained on generated text, with ChatML special tokens (<|endoftext|>, <|im_start|>,
<|im_end|>) and a ChatML chat template.

The model says nothing sensible (its weights are random), but vLLM tokenizes, schedules,
caches and evicts KV blocks for it exactly as for a real model, which is all that prefix-cache
measurements need. Send "ignore_eos": true so replies have the length you ask for. On CPU a
token of this model's KV cache costs 512 bytes (128-token blocks: 64 KiB each).

Everything depends only on --seed: the same seed writes byte-identical files, so a router
and its workers can each build the same tokenizer. The same directory is also a tokenizer
for kvroute itself (--tokenizer DIR).

Example:

  kvroute make-tiny-model /tmp/tiny-qwen3 --seed 0
  vllm serve /tmp/tiny-qwen3 --served-model-name tiny --max-model-len 4096 \\
      --enable-prefix-caching --kv-cache-memory-bytes 64M
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="directory to write the model into")
    parser.add_argument(
        "--seed", type=int, default=0, help="randomness of the tokenizer and weights (default 0)"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=TinyModelConfig.vocab_size,
        help="ids in the tokenizer and rows in the embedding, special tokens included "
        f"(default {TinyModelConfig.vocab_size})",
    )
    parser.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        metavar="N",
        help="also write N LoRA adapters for it (PEFT layout, random weights, rank 8 on "
        "q_proj and v_proj) into DIR/lora/adapter-<i>, for vllm serve --enable-lora "
        "--lora-modules adapter-<i>=DIR/lora/adapter-<i>",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty directory, replacing the model files in it",
    )


def run(args: argparse.Namespace) -> int:
    config = TinyModelConfig(vocab_size=args.vocab_size)
    started = time.perf_counter()
    if args.lora_adapters < 0:
        raise UserError(f"--lora-adapters must be >= 0, got {args.lora_adapters}")
    written = build_tiny_model(args.directory, seed=args.seed, config=config, force=args.force)
    for i in range(args.lora_adapters):
        lora_dir = Path(args.directory) / "lora" / adapter_name(i)
        if lora_dir.is_dir() and args.force:
            for name in LORA_FILES:
                (lora_dir / name).unlink(missing_ok=True)
        base = str(Path(args.directory).resolve())
        written += build_tiny_lora(lora_dir, base, args.seed, i, config)
    elapsed = time.perf_counter() - started
    for path in written:
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    print(
        f"Qwen3ForCausalLM, {parameter_count(config):,} parameters, vocab {config.vocab_size}, "
        f"seed {args.seed}, built in {elapsed:.1f} s"
    )
    return 0
