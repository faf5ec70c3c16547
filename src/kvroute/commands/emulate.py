"""``kvroute emulate``: serve emulated vLLM workers (OpenAI API, /metrics, KV events)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import sys

from kvroute import aio
from kvroute.emulator.config import DEFAULT_MAX_MODEL_LEN, MODEL_PRESETS, EmulatorConfig
from kvroute.engine.cost import PRESETS
from kvroute.errors import UserError
from kvroute.kvevents import KVEventsConfig
from kvroute.units import parse_bytes, parse_tokens

NAME = "emulate"
HELP = "serve emulated vLLM workers: OpenAI API, Prometheus metrics and KV events"
DESCRIPTION = """\
Serve one or more emulated vLLM workers. Each speaks vLLM's OpenAI-compatible API
(/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /health,
/reset_prefix_cache; with --enable-scale-out also /v1/completions/render and
/v1/chat/completions/render, 403 without, as vLLM), exposes vLLM's Prometheus metrics on
/metrics and, with --kv-events-config, publishes vLLM's KV cache events over ZeroMQ. Its prefix cache and
scheduler are kvroute's engine model; time comes from a cost-model preset, optionally run
faster than real time with --time-scale (all ratios kept).

The KV cache size follows vLLM: blocks = --kv-cache-memory-bytes // (block size x KV bytes
per token). The default model preset (Qwen3-0.6B, bf16: 114,688 B/token, block 16) with
1 GiB gives 585 blocks, as in the reference experiment. --kv-capacity-tokens sizes it in
tokens instead (--kv-capacity-tokens 3M: 187,500 blocks of 16, plus the null block).

Flags named like vLLM's mean the same thing. --workers N serves N independent workers on
consecutive ports from --port (each with its own cache and metrics; KV event endpoints move
by one port per worker too).

Example: six workers like the reference experiment, KV events on ports 5557-5562:

  kvroute emulate --workers 6 --port 8001 --enable-prompt-tokens-details \\
      --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq",
                           "endpoint":"tcp://*:5557","topic":"kv-events"}'

Example: a fast worker for tests (no model time at all):

  kvroute emulate --port 8000 --timing instant
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve = parser.add_argument_group("serving (as vLLM)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    serve.add_argument(
        "--port", type=int, default=8000,
        help="port of the first worker; 0 picks free ports (default: %(default)s)",
    )
    serve.add_argument(
        "--served-model-name", nargs="+", metavar="NAME",
        help="model name(s) the server answers to; the first is used in responses and "
        "metrics (default: the model preset's name)",
    )
    serve.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN,
                       help="context length (default: %(default)s)")
    serve.add_argument(
        "--block-size", type=int,
        help="tokens per KV block (default: the model preset's: 16, or 128 for tiny-cpu)",
    )
    serve.add_argument(
        "--kv-cache-memory-bytes", default="1G",
        help="KV cache size per worker; suffixes as vLLM: 64M, 1G binary, 1g decimal "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--num-gpu-blocks-override", type=int, metavar="N",
        help="use exactly N KV blocks (null block included), ignoring the memory size",
    )
    serve.add_argument(
        "--kv-capacity-tokens", metavar="N",
        help="KV capacity per worker in tokens instead (3M, 500k; decimal): N / block size "
        "blocks plus the null block, ignoring the memory size",
    )
    serve.add_argument("--max-num-seqs", type=int, help="most requests running at once (default: the timing preset's)")
    serve.add_argument(
        "--max-num-batched-tokens", type=int,
        help="token budget of one step (default: the timing preset's)",
    )
    serve.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="automatic prefix caching (default: on)",
    )
    serve.add_argument(
        "--enable-prompt-tokens-details", action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    serve.add_argument(
        "--enable-scale-out", action="store_true",
        help="serve /v1/completions/render and /v1/chat/completions/render (a prompt's token "
        "ids; vllm-router's kv_aware asks them); without it the scale-out routes answer 403",
    )
    serve.add_argument(
        "--kv-events-config", metavar="JSON",
        help="vLLM's KV events JSON, e.g. "
        '\'{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}\'',
    )
    serve.add_argument(
        "--enable-lora", action="store_true",
        help="serve LoRA adapters: a request whose model is a --lora-modules name runs under "
        "that adapter, whose name keys its block hashes and KV events as vLLM's",
    )
    serve.add_argument(
        "--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
        help="LoRA adapters, listed in /v1/models with the base model as parent (the emulator "
        "never reads PATH)",
    )
    serve.add_argument(
        "--max-loras", type=int, default=1,
        help="adapters one batch may hold at once; a request for another waits, and an adapter "
        "that is not loaded costs its load time in the step that loads it (default: %(default)s)",
    )
    serve.add_argument(
        "--tokenizer", metavar="DIR",
        help="local Hugging Face tokenizer directory (default: kvroute's built-in tokenizer)",
    )

    own = parser.add_argument_group("emulation (kvroute)")
    own.add_argument("--workers", type=int, default=1, help="number of workers (default: %(default)s)")
    own.add_argument(
        "--model-preset", choices=sorted(MODEL_PRESETS), default="qwen3-0.6b",
        help="model whose KV size, block size, timing and name are the defaults (default: %(default)s)",
    )
    own.add_argument(
        "--kv-bytes-per-token", type=int,
        help="KV cache bytes per token (default: the model preset's)",
    )
    own.add_argument(
        "--timing", choices=sorted(PRESETS),
        help="cost-model preset for step times (default: the model preset's: reference-gpu, "
        "or cpu-tiny for tiny-cpu)",
    )
    own.add_argument(
        "--time-scale", type=float, default=1.0,
        help="run this many times faster than real time (default: %(default)s)",
    )
    own.add_argument(
        "--lora-load-time", type=float, default=0.02, metavar="SECONDS",
        help="with --enable-lora: how much longer a step takes for each adapter it loads into "
        "one of --max-loras slots (default: %(default)s, scaled by --time-scale)",
    )
    own.add_argument(
        "--kv-events-wire-format", choices=("map", "array"), default="map",
        help="KV event encoding: map (current vLLM) or array (older, positional) (default: %(default)s)",
    )


def _lora_module(spec: str) -> tuple[str, str]:
    """One ``--lora-modules`` item, ``NAME=PATH``."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise UserError(f"--lora-modules: expected NAME=PATH, got {spec!r}")
    return name, path


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    overrides = {
        "max_model_len": args.max_model_len,
        "kv_cache_memory_bytes": parse_bytes(args.kv_cache_memory_bytes),
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "time_scale": args.time_scale,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
        "enable_scale_out": args.enable_scale_out,
        "kv_events_config": args.kv_events_config,
        "kv_events_wire_format": args.kv_events_wire_format,
        "tokenizer": args.tokenizer,
        "enable_lora": args.enable_lora,
        "lora_modules": tuple(_lora_module(m) for m in args.lora_modules),
        "max_loras": args.max_loras,
        "lora_load_s": args.lora_load_time,
    }
    optional = {
        "served_model_name": tuple(args.served_model_name) if args.served_model_name else None,
        "block_size": args.block_size,
        "kv_bytes_per_token": args.kv_bytes_per_token,
        "timing": args.timing,
    }
    overrides.update({k: v for k, v in optional.items() if v is not None})
    config = EmulatorConfig.for_model(args.model_preset, **overrides)
    if args.kv_capacity_tokens is not None:
        if args.num_gpu_blocks_override is not None:
            raise UserError("--kv-capacity-tokens and --num-gpu-blocks-override are alternatives; give one")
        blocks = parse_tokens(args.kv_capacity_tokens) // config.block_size + 1  # the null block holds none
        config = dataclasses.replace(config, num_gpu_blocks_override=blocks)
    config.validate()
    return config


def check_own_ports(config: EmulatorConfig, workers: int, port: int) -> None:
    """Refuse a ``--workers N`` group whose workers would take each other's ports: worker i
    serves HTTP on ``port + i`` and moves every KV-event port by i too, so with events on P
    and replay on P + 1 (vLLM's 5557/5558 pattern) worker 1's events land on worker 0's
    replay socket. Ephemeral ports (0, ``*``) and ipc endpoints never clash.

    Raises:
        UserError: naming both workers, the sockets and a way out.
    """
    if workers < 2:
        return
    taken: dict[int, str] = {}

    def take(number: int | None, what: str) -> None:
        if not number:
            return
        if number in taken:
            raise UserError(
                f"{what} is port {number}, which {taken[number]} already uses: --workers {workers} "
                "moves the HTTP port and every KV-event port by one a worker, so keep the ports "
                f"you give at least {workers} apart (e.g. events on 5557, replay on {5557 + workers + 8})"
            )
        taken[number] = what

    events = KVEventsConfig.from_json(config.kv_events_config) if config.kv_events_config else None
    for i in range(workers):
        take(port + i if port else None, f"worker {i}'s HTTP port")
        if events is None or not events.publishes:
            continue
        moved = events.with_port_offset(i)
        take(_tcp_port(moved.endpoint), f"worker {i}'s KV-event endpoint {moved.endpoint}")
        if moved.replay_endpoint:
            take(_tcp_port(moved.replay_endpoint), f"worker {i}'s replay endpoint {moved.replay_endpoint}")


def _tcp_port(endpoint: str) -> int | None:
    """A tcp endpoint's fixed port; None for an ephemeral one and for ipc/inproc."""
    if not endpoint.startswith("tcp://"):
        return None
    port = endpoint.rpartition(":")[2]
    return int(port) if port.isdigit() else None


def events_line(endpoint: str, replay: str | None, binds: bool) -> str:
    """A worker's event sockets and how its PUB socket meets subscribers, as vLLM decides it
    (a wildcard or ipc binds, a concrete host connects). Scripts read the endpoints from the
    ``kv-events ENDPOINT (replay REPLAY)`` part (``kvroute.workers``)."""
    line = f"kv-events {endpoint}" + (f" (replay {replay})" if replay else "")
    return line + (" — binds" if binds else " — connects to it (a concrete host connects, as in vLLM)")


async def _serve(config: EmulatorConfig, workers: int, host: str, port: int) -> None:
    from kvroute.emulator.server import start_workers

    if port and port + workers - 1 > 65535:
        raise UserError(f"--port {port} with --workers {workers} runs past port 65535")
    check_own_ports(config, workers, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    running = await start_workers(config, workers, host, port)
    try:
        blocks = config.num_gpu_blocks
        print(
            f"kvroute emulate: {workers} worker(s), model {config.model_name}, "
            f"{blocks} KV blocks of {config.block_size} tokens, timing {config.timing}"
            + (f" x{config.time_scale:g}" if config.time_scale != 1.0 else ""),
            flush=True,
        )
        connecting = []
        for i, w in enumerate(running):
            line = f"  worker {i}: {w.url}/v1"
            if w.kv_events_endpoint:
                binds = w.worker.publisher.binds
                line += "  " + events_line(w.kv_events_endpoint, w.kv_events_replay_endpoint, binds)
                if not binds:
                    connecting.append(w.kv_events_endpoint)
            print(line, flush=True)
        if connecting:
            print(
                f"kvroute emulate: warning: the KV-event sockets connect to {', '.join(connecting)}: "
                "a concrete host makes the publisher connect (vLLM's rule; a wildcard such as "
                "tcp://*:5557 binds), so a subscriber must bind there. kvroute serve connects to "
                "its workers' sockets and gets no events from these: use tcp://*:PORT",
                file=sys.stderr, flush=True,
            )
        await stop.wait()
    finally:
        await asyncio.gather(*(w.close() for w in running), return_exceptions=True)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    aio.run(_serve(config, args.workers, args.host, args.port))
    print("kvroute emulate: stopped", file=sys.stderr, flush=True)
    return 0
