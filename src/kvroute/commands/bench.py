"""``kvroute bench``: the reference experiment against any OpenAI-compatible endpoint."""

from __future__ import annotations

import argparse
import os
import time
from argparse import Namespace
from pathlib import Path

from rich.console import Console

from kvroute import aio
from kvroute.bench.client import check_bench_url, openai_base_url
from kvroute.bench.progress import ProgressHooks
from kvroute.bench.prompts import (
    PROMPT_FORMATS,
    BenchWorkload,
    PromptEncoder,
    SessionSpec,
    reference_workload,
    session_workload,
    trace_workload,
)
from kvroute.bench.report_html import tables_as_html
from kvroute.bench.router_metrics import read_router, router_metrics_url
from kvroute.bench.runner import (
    BenchOptions,
    BenchRunner,
    BenchTarget,
    capacity_for,
    discover_model,
    server_cache_config,
    simulate_points,
)
from kvroute.bench.writer import ResultsWriter
from kvroute.commands._common import (
    add_trace_window_arguments,
    add_worker_arguments,
    add_workload_arguments,
    kv_geometry,
    workload_spec,
)
from kvroute.engine import PRESETS
from kvroute.errors import UserError
from kvroute.progress import sweep_progress
from kvroute.records import Point
from kvroute.report import output_console, print_tables, print_trace_tables
from kvroute.trace.format import missing_trace, trace_path
from kvroute.workload import LengthDist, parse_int_list

NAME = "bench"
HELP = "run the reference experiment against an OpenAI-compatible endpoint (vLLM, emulator, router)"
DESCRIPTION = """\
Send the reference experiment's seeded requests to URL and measure prefix-cache hits two
ways: per request (usage.prompt_tokens_details.cached_tokens, which vLLM reports only with
--enable-prompt-tokens-details) and per worker (Prometheus counter deltas, when each worker's
--metrics-url is given). Every request opens a new TCP connection, as a Kubernetes Service
needs to balance it; the warmup (one request per prefix) is not measured; the order is fixed
by --seed, identical across trials and topologies.

Behind a kvroute router, the router's retention refreshes (requests it sends to keep prefixes
cached) are read from its /metrics around each trial, taken out of the workers' counters and
reported per client request. With router replicas behind a balancer give every replica with
--router-metrics-url: read through the balancer, /metrics comes from one replica or another,
and the bench then says so and leaves refreshes uncounted.

Writes records.jsonl (one line per request), summary.json (the `kvroute sim --json` point
format), points.csv, PNG plots and report.html to --out. Ctrl-C saves what was measured.

examples:
  kvroute bench --url http://127.0.0.1:8000 --metrics-url http://w0:8001 --metrics-url http://w1:8001
  kvroute bench --url http://svc:8000 --workers 6 -K 2,12 -c 8 --trials 1 --compare-sim
  kvroute bench --url http://127.0.0.1:8000 --rate 20 -K 12 --tokenizer ./qwen3-tokenizer
  kvroute bench --url http://svc:8000 --router-metrics-url http://r0:8000 --router-metrics-url http://r1:8000
  kvroute bench --url http://127.0.0.1:8000 --sessions 50 --turns 4 --prompt-format chat
  kvroute bench --url http://127.0.0.1:8000 --trace requests.jsonl
  kvroute bench --url http://127.0.0.1:8000 --trace synthetic_trace.jsonl --duration 120 --time-scale 10

A trace's requests that a server refuses for its max-model-len (HTTP 400, "maximum context
length") are counted and reported, never dropped: they stay in records.jsonl as failures.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    t = parser.add_argument_group("target")
    t.add_argument("--url", required=True, help="OpenAI-compatible base URL (balancer, router or worker)")
    t.add_argument("--metrics-url", action="append", default=[], metavar="WORKER_URL",
                   help="a worker's base or /metrics URL; repeat (or comma-separate) for each worker")
    t.add_argument("--router-metrics-url", action="append", default=[], metavar="ROUTER_URL",
                   help="a kvroute router replica's base or /metrics URL; repeat (or comma-separate) for "
                        "every replica behind --url: their retention refreshes are summed (default: "
                        "--url's own, counted only when one router answers there)")
    t.add_argument("--model", default=None, help="served model name (default: the first of GET /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None, metavar="KEY",
                   help="bearer token for a server started with --api-key (default: $OPENAI_API_KEY, "
                        "as vLLM's own clients read it); sent to --url only, never saved")
    t.add_argument("--workers", "-W", type=int, default=None,
                   help="workers behind URL, for labels and the formula (default: number of --metrics-url)")
    t.add_argument("--label", default=None,
                   help="topology name in the reports, e.g. service or router (default: router when "
                        "URL is a kvroute router, which its /metrics tells, else service)")

    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", "-c", default="4,8,16", metavar="C[,C...]",
                      help="closed-loop clients; a comma list sweeps (default %(default)s)")
    load.add_argument("--rate", type=float, default=None, metavar="REQ_PER_S",
                      help="open loop: Poisson arrivals at this rate instead of --concurrency")
    load.add_argument("--trials", type=int, default=3, help="trials per point; medians reported (default %(default)s)")
    load.add_argument("--keep-alive", action="store_true",
                      help="reuse connections (NOT the reference: a per-connection balancer then pins the client)")
    load.add_argument("--no-reset", action="store_true",
                      help="do not POST /reset_prefix_cache to the workers before each trial")
    load.add_argument("--timeout", type=float, default=600.0, metavar="S", help="per request (default %(default)s)")

    add_workload_arguments(parser, prefixes_default="2,7,12,24")
    w = parser.add_argument_group("prompts, sessions and traces")
    w.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="local Hugging Face tokenizer: prompts are sent as text that re-tokenizes exactly")
    w.add_argument("--prompt-format", choices=PROMPT_FORMATS, default=None,
                   help="ids: token ids on /v1/completions (default without --tokenizer); text: decoded "
                        "text (default with it); chat: /v1/chat/completions with the chat template (without "
                        "--tokenizer, lengths are counted with kvroute's built-in tokenizer, the emulator's)")
    w.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (non-vLLM servers)")
    w.add_argument("--sessions", type=int, default=None,
                   help="multi-turn conversations instead of single requests (each turn extends the last)")
    w.add_argument("--turns", type=int, default=4, help="turns per session (default %(default)s)")
    w.add_argument("--turn-tokens", default="64", metavar="N|LO:HI|A,B",
                   help="tokens of each later user message (default %(default)s)")
    w.add_argument("--trace", type=trace_path, default=None, metavar="JSONL|synthetic",
                   help="replay a trace, open loop by its timestamps: Mooncake's format (hash_ids; prompts "
                        "synthesized as token ids) or kvroute's (timestamp, prompt or token ids, output "
                        "tokens, optional session id), auto-detected; `synthetic`: Mooncake's synthetic trace, shipped with kvroute")
    w.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="the workers run X times faster than real time (kvroute emulate --time-scale X): "
                        "a trace is sent X times faster and measured times are multiplied by X")
    w.add_argument("--closed-loop", action="store_true",
                   help="with --trace: ignore its timestamps; --concurrency clients send it in order")
    add_trace_window_arguments(w)

    add_worker_arguments(
        parser,
        "formula's capacity C (only without --metrics-url; with it, the workers' "
        "vllm:cache_config_info is used)",
        model_flag="--kv-model",
    )

    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, default=None, help="results folder (default ./kvroute-results/<timestamp>)")
    out.add_argument("--allow-missing-cached-tokens", action="store_true",
                     help="measure even when no response reports cached_tokens (all count as misses)")
    out.add_argument("--compare-sim", action="store_true",
                     help="also run `kvroute sim` for the same configuration and show it beside the measurement")
    out.add_argument("--sim-timing", default="reference-gpu", choices=sorted(PRESETS),
                     help="timing preset of that simulation (default %(default)s)")


def _metrics_urls(values: list[str]) -> tuple[str, ...]:
    urls = [u.strip() for v in values for u in v.split(",") if u.strip()]
    if len(set(urls)) != len(urls):
        raise UserError("a --metrics-url is given twice: each worker's counters would count double")
    return tuple(urls)


def _options(args: Namespace) -> BenchOptions:
    concurrency = tuple(parse_int_list(args.concurrency, "--concurrency"))
    return BenchOptions(
        concurrency=concurrency,
        rate=args.rate,
        trials=args.trials,
        seed=args.seed,
        keep_alive=args.keep_alive,
        reset=not args.no_reset,
        timeout_s=args.timeout,
        allow_missing_cached_tokens=args.allow_missing_cached_tokens,
        time_scale=args.time_scale,
        open_loop=args.trace is not None and not args.closed_loop and args.rate is None,
    )


def _workloads(args: Namespace, encoder: PromptEncoder, vocab) -> list[BenchWorkload]:
    if args.trace is not None:
        return [trace_workload(args.trace, encoder, args.output_tokens, time_scale=args.time_scale,
                               start_s=args.start, duration_s=args.duration, max_requests=args.max_requests,
                               cut_sessions=args.cut_sessions,
                               closed_loop=args.closed_loop or args.rate is not None, vocab=vocab)]
    prefixes = parse_int_list(args.prefixes, "--prefixes")
    if args.sessions is not None:
        sessions = SessionSpec(args.sessions, args.turns, LengthDist.parse(args.turn_tokens))
        return [session_workload(workload_spec(args, k), sessions, encoder, vocab) for k in prefixes]
    return [reference_workload(workload_spec(args, k), encoder, vocab) for k in prefixes]


def _check_workload_flags(args: Namespace) -> None:
    """Refuse bad workload flags before any network traffic."""
    if args.time_scale <= 0:
        raise UserError(f"--time-scale must be > 0, got {args.time_scale}")
    tenants = args.adapters or args.salted
    if tenants and (args.trace is not None or args.sessions is not None):
        raise UserError("--adapters and --salted shape the reference workload; drop --trace and --sessions")
    if args.trace is not None:
        if not args.trace.is_file():
            raise missing_trace(args.trace)
        return
    if (args.closed_loop or args.start or args.duration is not None or args.max_requests is not None
            or args.cut_sessions):
        raise UserError("--closed-loop, --start, --duration, --max-requests and --cut-sessions are for --trace")
    for k in parse_int_list(args.prefixes, "--prefixes"):
        workload_spec(args, k)
    if args.sessions is not None:
        SessionSpec(args.sessions, args.turns, LengthDist.parse(args.turn_tokens))


def _geometry(args: Namespace, configs: list[tuple[int, int]], console: Console) -> tuple[int, int, str]:
    """(num_blocks, block_size, where from): the workers' own cache config when scraped."""
    if configs:
        if len(set(configs)) > 1:
            console.print(f"[yellow]warning:[/yellow] workers differ in cache size {sorted(set(configs))}; "
                          "the formula uses the smallest")
        blocks, block_size = min(configs)
        return blocks, block_size, "vllm:cache_config_info"
    blocks, block_size, _ = kv_geometry(args)
    return blocks, block_size, "worker KV flags"


def run(args: Namespace) -> int:
    check_bench_url(args.url)
    args.url = openai_base_url(args.url)
    metrics_urls = _metrics_urls(args.metrics_url)
    router_metrics_urls = tuple(u.strip() for v in args.router_metrics_url for u in v.split(",") if u.strip())
    options = _options(args)
    if args.workers is not None and args.workers < 1:
        raise UserError("--workers must be >= 1")
    if args.trace is not None and args.sessions is not None:
        raise UserError("--trace and --sessions are alternatives: a trace carries its own sessions")
    _check_workload_flags(args)
    prompt_format = args.prompt_format or ("text" if args.tokenizer else "ids")
    out = args.out or Path("kvroute-results") / time.strftime("%Y%m%d-%H%M%S")
    console = output_console()

    setup: dict = {}
    runner_box: list[BenchRunner] = []
    writer = ResultsWriter(out)

    async def main() -> list[Point]:
        model = args.model or await discover_model(args.url, api_key=args.api_key)
        configs = await server_cache_config(metrics_urls)  # also checks the metrics URLs answer
        blocks, block_size, geometry_source = _geometry(args, configs, console)
        tokenizer = None
        vocab = None
        if args.tokenizer or prompt_format != "ids":
            from kvroute.tokens import load_tokenizer, safe_vocabulary

            tokenizer = load_tokenizer(args.tokenizer)
            vocab = safe_vocabulary(tokenizer)
        encoder = PromptEncoder(prompt_format, model, tokenizer, ignore_eos=not args.no_ignore_eos)
        workloads = _workloads(args, encoder, vocab)
        is_router = router_metrics_urls or await read_router(router_metrics_url(args.url), args.api_key) is not None
        label = args.label or ("router" if is_router else "service")
        target = BenchTarget(args.url, metrics_urls, model, label, args.workers, args.api_key,
                             router_metrics_urls=router_metrics_urls)
        setup.update(model=model, blocks=blocks, block_size=block_size, geometry=geometry_source,
                     workloads=workloads, target=target)
        total = len(workloads) * len(options.load_levels) * options.trials
        with sweep_progress(console, "bench") as progress:
            hooks = ProgressHooks(progress, console, total)
            runner = BenchRunner(target, options, writer, hooks)
            runner_box.append(runner)
            points = await runner.run(workloads)
            hooks.finish()
        setup.update(failed=hooks.failed, refused_max_model_len=hooks.refused_too_long)
        if hooks.failed:
            console.print(f"[red]{hooks.failed} requests failed[/red] (counted as misses; see records.jsonl)")
        if hooks.refused_too_long:
            longest = max((r.prompt_tokens for w in workloads for r in w.requests), default=0)
            console.print(
                f"[red]{hooks.refused_too_long} of them refused by the server's max-model-len[/red] "
                f"(longest prompt sent: {longest:,} tokens); counted, kept in records.jsonl as failures"
            )
        return points

    interrupted = False
    try:
        points = aio.run(main())
    except KeyboardInterrupt:
        interrupted = True
        if not runner_box:
            raise
        runner = runner_box[0]
        partial = runner.interrupted_trial()
        if partial is not None:
            writer.trial_done(partial)
            _attach_partial(runner.points, partial)
        points = [p for p in runner.points if p.trials]
    _report(args, options, setup, points, writer, console, interrupted)
    if interrupted:
        console.print(f"[yellow]interrupted[/yellow]: saved what was measured to {out}")
        return 130
    return 0


def _attach_partial(points: list[Point], partial) -> None:
    for p in points:
        if (p.prefixes, p.concurrency) == (partial.prefixes, partial.concurrency):
            p.trials.append(partial.stats)
            return


def _report(args, options: BenchOptions, setup: dict, points: list[Point], writer: ResultsWriter,
            console: Console, interrupted: bool) -> None:
    if not points:
        console.print("no points measured")
        return
    workloads = setup["workloads"]
    capacity = capacity_for(workloads[0], setup["blocks"], setup["block_size"])
    reference = None
    if args.compare_sim:
        reference = simulate_points(points, workloads, setup["blocks"], setup["block_size"],
                                    args.sim_timing, options.trials, args.seed)
        if not reference:
            console.print("[yellow]warning:[/yellow] --compare-sim needs the reference workload "
                          "(not sessions, traces or --rate); nothing simulated")
            reference = None

    def render(c: Console) -> None:
        if workloads[0].trace is not None and not options.rate and all(p.concurrency == 0 for p in points):
            print_trace_tables(points, c)
        else:
            print_tables(points, capacity, c, reference=reference, zipf_alpha=args.zipf)

    render(console)
    if any(p.concurrency == 0 for p in points):
        console.print(f"(c=0: open loop at {options.rate:g} requests/s)" if options.rate else "(c=0: trace replay)")
    target: BenchTarget = setup["target"]
    meta = {
        "command": "bench",
        "url": args.url,
        "label": target.label,
        "model": setup["model"],
        "workers": target.num_workers,
        "metrics_urls": list(target.metrics_urls),
        "router_metrics_urls": list(target.router_metrics_urls),
        "concurrency": list(options.concurrency) if options.rate is None else [],
        "rate_rps": options.rate,
        "trials": options.trials,
        "seed": args.seed,
        "keep_alive": options.keep_alive,
        "reset_between_trials": options.reset,
        "prompt_format": args.prompt_format or ("text" if args.tokenizer else "ids"),
        "capacity_requests": capacity,
        "num_blocks": setup["blocks"],
        "block_size": setup["block_size"],
        "capacity_from": setup["geometry"],
        "partial": interrupted,
        "time_scale": options.time_scale,
        "failed_requests": setup.get("failed"),
        "refused_max_model_len": setup.get("refused_max_model_len"),
    }
    trace = workloads[0].trace
    if trace is not None:
        meta["trace"] = {**trace.summary(), "start_s": args.start, "duration_s_window": args.duration,
                         "max_requests": args.max_requests, "closed_loop": args.closed_loop,
                         "cut_sessions": args.cut_sessions}
    if reference:
        meta["sim"] = {"timing": args.sim_timing, "points": [p.to_json() for p in reference]}
    paths = writer.write_reports(points, meta, capacity, tables_as_html(render), reference)
    console.print(f"wrote {writer.out}/: {', '.join(p.name for p in [*paths, *writer.logs()])}")
