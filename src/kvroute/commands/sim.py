"""``kvroute sim``: the reference experiment on simulated workers, in seconds."""

from __future__ import annotations

import argparse
from pathlib import Path

from kvroute.analytic import capacity_for_mean_lengths
from kvroute.commands import _trace_sim as trace_sim
from kvroute.commands._common import (
    add_policy_option_argument,
    add_worker_arguments,
    add_workload_arguments,
    kv_geometry,
    name_list,
    parse_policy_options,
    workload_spec,
)
from kvroute.engine import PRESETS, get_preset
from kvroute.errors import UserError
from kvroute.progress import sweep_progress
from kvroute.records import Point, write_points_json
from kvroute.report import output_console, print_tables
from kvroute.router.config import RETENTION_MODES
from kvroute.routing.policies import POLICIES, policy_parameters
from kvroute.sim import DEFAULT_MESH_LAG_S, WorkerConfig, run_point, sweep_points
from kvroute.workload import Workload, generate, parse_int_list

NAME = "sim"
HELP = "simulate the reference experiment (or any sweep) on modelled vLLM workers"
DESCRIPTION = """\
Run a sweep of the reference experiment on simulated vLLM workers: the same cache and
scheduler model as the emulator, on a virtual clock, so the whole sweep takes seconds.

With no flags it reproduces docs/experiment.md: 6 and 3 workers behind random balancing (what a
Kubernetes Service does with a new connection per request), K in 2,7,12,24 prefixes,
concurrency 4,8,16, 3 trials each (medians), 1 GiB of KV per worker for Qwen3-0.6B.
Flags given explicitly override the preset's values.

examples:
  kvroute sim                                   # the reference sweep, four tables
  kvroute sim --workers 6 --prefixes 24 --concurrency 8 --policy random,prefix-hash
  kvroute sim -W 6 -K 24 -c 8,16 --policy random,kv-aware   # the KV-aware router vs a Service
  kvroute sim -W 6 -K 2 -c 8 --policy kv-aware --policy-option share_factor=0.5   # tune its guard
  kvroute sim -W 6 -K 24 -c 8,16 --policy kv-aware --router-replicas 1,2,3             # with the mesh
  kvroute sim -W 6 -K 24 -c 8,16 --policy kv-aware --router-replicas 2,3 --no-mesh     # each alone
  kvroute sim --prefixes 64 --zipf 1.2 --json zipf.json
  kvroute sim -W 6 -K 24 -c 8 --policy kv-aware --adapters 8 --adapter-zipf 1 --salted --max-loras 4   # tenants
  kvroute sim --kv-cache-memory-bytes 2GiB --prefix-tokens 1000:3600
  kvroute sim --trace conversation_trace.jsonl -W 8 --policy random,kv-aware --kv-capacity-tokens 3M --max-model-len 200000
  kvroute sim --trace synthetic_trace.jsonl --duration 300 --max-model-len 200000   # a 5-minute window
"""

#: ``vllm serve --max-model-len`` and ``kvroute emulate``'s default.
DEFAULT_MAX_MODEL_LEN = 4096

PRESET_VALUES = {
    "reference": {"workers": "6,3", "prefixes": "2,7,12,24", "concurrency": "4,8,16", "trials": 3, "policy": "random"},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESET_VALUES), default="reference",
                        help="starting values for the sweep (default %(default)s)")
    parser.add_argument("--workers", "-W", default=None, metavar="W[,W...]",
                        help="workers per fleet; comma list sweeps (reference: 6,3)")
    parser.add_argument("--concurrency", "-c", default=None, metavar="C[,C...]",
                        help="closed-loop clients (reference: 4,8,16)")
    parser.add_argument("--trials", type=int, default=None, help="trials per point, medians reported (reference: 3)")
    parser.add_argument("--policy", default=None, metavar="P[,P...]",
                        help=f"balancing policies: {', '.join(POLICIES)} (reference: random)")
    parser.add_argument("--load-factor", type=float, default=None, metavar="EPS",
                        help="prefix-hash and kv-aware: spill when the owner exceeds (1+EPS)·mean "
                             "in-flight requests (default: prefix-hash never spills, kv-aware 1.5)")
    add_policy_option_argument(
        parser, "a policy parameter, as kvroute serve takes it (e.g. share_factor=0.5); each "
        "goes to the swept policies that take it; repeatable"
    )
    parser.add_argument("--retention", default=None, metavar="MODE[,MODE...]",
                        help="the router refreshes the prefixes each worker's LRU would evict "
                             "(a prefix-only request, max_tokens 1): off, on, or auto (only with "
                             "slack, only where it pays); a comma list sweeps. Default: what kvroute "
                             "serve runs with each policy, so the simulation predicts the router as "
                             "shipped: auto with kv-aware, off with the others; --retention off "
                             "simulates placement alone")
    parser.add_argument("--router-replicas", default="1", metavar="N[,N...]",
                        help="router replicas behind a Service-like balancer (a random replica per "
                             "request), each with its own index, load accounting, policy state and "
                             "retention model; a comma list sweeps (default %(default)s)")
    mesh = parser.add_mutually_exclusive_group()
    mesh.add_argument("--mesh-lag", type=float, default=None, metavar="SECONDS",
                      help="with several replicas: the replica mesh delivers each decision, first "
                           "token, end and refresh to the other replicas this long after it "
                           f"(default {DEFAULT_MESH_LAG_S * 1000:g} ms), and one replica per worker "
                           "sends its refreshes, as kvroute serve --peer does")
    mesh.add_argument("--no-mesh", action="store_true",
                      help="with several replicas: no mesh, each replica knows only its own "
                           "decisions and refreshes (replicas run without --peer)")
    parser.add_argument("--timing", default="reference-gpu", choices=sorted(PRESETS),
                        help="cost-model preset for step times (default %(default)s)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="write every point (medians and per-trial values) as JSON")
    add_workload_arguments(parser, prefixes_default=None, prefixes_preset="reference: 2,7,12,24")
    add_worker_arguments(parser)
    trace_sim.add_arguments(parser)
    parser.add_argument("--max-loras", type=int, default=1, metavar="N",
                        help="with --adapters: adapters one batch of a worker may hold, as vLLM's "
                             "flag; a request of another waits (default %(default)s, vLLM's)")
    parser.add_argument("--lora-load-time", type=float, default=0.02, metavar="SECONDS",
                        help="with --adapters: how much longer a step takes for each adapter it "
                             "loads into one of --max-loras slots, as the emulator's flag "
                             "(default %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN, metavar="TOKENS",
                        help="context length of a worker, as vLLM's flag: every prompt plus its "
                             "output must fit, or the engine refuses it (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    preset = PRESET_VALUES[args.preset]
    workers = parse_int_list(args.workers or preset["workers"], "--workers")
    prefixes = parse_int_list(args.prefixes or preset["prefixes"], "--prefixes")
    concurrency = parse_int_list(args.concurrency or preset["concurrency"], "--concurrency")
    policies = name_list(args.policy or preset["policy"], list(POLICIES), "--policy")
    trials = args.trials if args.trials is not None else preset["trials"]
    if trials < 1:
        raise UserError("--trials must be >= 1")
    if args.load_factor is not None and args.load_factor < 0:
        raise UserError("--load-factor must be >= 0")
    options = sweep_policy_options(args, policies)
    retention = None if args.retention is None else name_list(args.retention, list(RETENTION_MODES), "--retention")
    replicas = parse_int_list(args.router_replicas, "--router-replicas")
    if args.mesh_lag is not None and not 0 <= args.mesh_lag < 60:
        raise UserError(f"--mesh-lag must be between 0 and 60 seconds, got {args.mesh_lag}")
    mesh_lag = None if args.no_mesh else (DEFAULT_MESH_LAG_S if args.mesh_lag is None else args.mesh_lag)
    if args.trace is not None:
        if args.adapters or args.salted:
            raise UserError("--adapters and --salted shape the reference workload; drop --trace")
        if replicas != [1]:
            raise UserError("--router-replicas simulates the reference workload; drop it with --trace")
        return trace_sim.run(args, policies, options, kv_geometry, retention)
    num_blocks, block_size, _ = kv_geometry(args)
    if args.max_loras < 1 or not args.lora_load_time >= 0:
        raise UserError("--max-loras must be >= 1 and --lora-load-time >= 0")
    config = WorkerConfig(num_blocks, block_size, get_preset(args.timing),
                          max_loras=args.max_loras if args.adapters else None,
                          lora_load_s=args.lora_load_time)

    workloads = {k: generate(workload_spec(args, k)) for k in prefixes}
    for wl in workloads.values():
        check_max_model_len(wl, args.max_model_len)
        config.check_fits(wl)
    points = sweep_points(workers, prefixes, concurrency, policies, retention, replicas, mesh_lag)
    console = output_console()
    results: list[Point] = []
    with sweep_progress(console, "sim") as progress:
        task = progress.add_task("", total=len(points) * trials)
        for point in points:
            progress.update(task, description=f"W={point.workers} K={point.prefixes} c={point.concurrency} {point.label}")
            results.append(
                run_point(point, workloads[point.prefixes], config, trials, args.seed, options[point.policy],
                          on_trial=lambda: progress.advance(task))
            )
    spec = workloads[prefixes[0]].spec
    capacity = capacity_for_mean_lengths(
        spec.prefix_tokens.mean, spec.suffix_tokens.mean, spec.output_tokens, num_blocks, block_size
    )
    print_tables(results, capacity, console, zipf_alpha=args.zipf)
    if any(p.retention != "off" for p in points):
        print_refreshes(results, console)
    if args.json:
        write_points_json(args.json, results, {"command": "sim", "capacity_requests": capacity,
                                               "num_blocks": num_blocks, "block_size": block_size,
                                               "timing": args.timing, "seed": args.seed})
        console.print(f"wrote {args.json}")
    return 0


def print_refreshes(results: list[Point], console) -> None:
    """What retention cost: refresh requests and engine milliseconds per measured request
    (medians of trials), beside the hit rate and TTFT p99 they bought."""
    from rich.table import Table

    table = Table(title="5. Retention: refreshes per request, engine ms per request (median of trials)")
    for col in ("topology", "W", "K", "c", "hit rate", "TTFT p99 ms", "refreshes/req", "engine ms/req"):
        table.add_column(col, justify="left" if col == "topology" else "right")
    for p in results:
        per = [(t.refreshes / t.requests, 1000 * t.refresh_engine_s / t.requests) for t in p.trials if t.requests]
        refreshes = sorted(r for r, _ in per)
        engine = sorted(e for _, e in per)
        mid = len(per) // 2
        table.add_row(
            p.policy, str(p.workers), str(p.prefixes), str(p.concurrency),
            f"{p.median('request_hit_rate'):.3f}", f"{p.median('ttft_p99_ms'):.0f}",
            f"{refreshes[mid]:.2f}" if per else "-", f"{engine[mid]:.2f}" if per else "-",
        )
    console.print(table)


def check_max_model_len(workload: Workload, max_model_len: int) -> None:
    """Refuse a workload the engine would refuse: vLLM (and the emulator) answer 400 to a
    prompt of ``max_model_len`` tokens or more and cut the output of a longer request to
    what the context leaves, so a simulated one would not be the request that runs.

    Raises:
        UserError: the longest prompt plus the output tokens exceed ``max_model_len``.
    """
    if max_model_len < 1:
        raise UserError(f"--max-model-len must be >= 1, got {max_model_len}")
    longest = max(r.prompt_tokens for r in workload.warmup + workload.requests)
    output = workload.spec.output_tokens
    if longest + output > max_model_len:
        raise UserError(
            f"a request of {longest:,} prompt + {output} output tokens is longer than "
            f"--max-model-len {max_model_len}, which the engine refuses: shorten the prompts "
            "(--prefix-tokens, --suffix-tokens) or raise --max-model-len"
        )


def sweep_policy_options(args: argparse.Namespace, policies: list[str]) -> dict[str, dict[str, object]]:
    """Each swept policy's options: ``--load-factor`` and every ``--policy-option`` it takes.

    Raises:
        UserError: an option no swept policy takes, or load_factor given both ways.
    """
    given = parse_policy_options(args.policy_option)
    if args.load_factor is not None:
        if "load_factor" in given:
            raise UserError("give the load factor once: --load-factor or --policy-option load_factor=...")
        given["load_factor"] = args.load_factor
    per_policy = {p: {k: v for k, v in given.items() if k in policy_parameters(p)} for p in policies}
    unused = sorted(set(given) - {k for options in per_policy.values() for k in options})
    if unused:
        takes = {p: sorted(policy_parameters(p)) for p in policies}
        raise UserError(
            f"no swept policy takes {', '.join(unused)} ("
            + "; ".join(f"{p}: {', '.join(t) or 'nothing'}" for p, t in takes.items()) + ")"
        )
    return per_policy
