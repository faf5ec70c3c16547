"""``kvroute sim --trace``: a trace replayed open loop through the simulator, for each policy
and fleet size (see :mod:`kvroute.trace.simulate`).

The flags (``add_arguments``) and the run (``run``) for ``kvroute.commands.sim``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from rich import box
from rich.table import Table

from kvroute.bench.plots import write_plots
from kvroute.bench.samples import PointSamples, Timelines
from kvroute.commands._common import add_trace_window_arguments
from kvroute.engine import get_preset
from kvroute.engine.pool import usable_blocks
from kvroute.errors import UserError
from kvroute.plotting import pyplot
from kvroute.records import Point, busiest_share, write_points_json
from kvroute.report import output_console
from kvroute.sim import WorkerConfig, retention_modes
from kvroute.trace import load_trace
from kvroute.trace.format import trace_path
from kvroute.trace.simulate import simulate_trace, trace_inputs, trace_policy
from kvroute.workload import parse_int_list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("trace (instead of a workload shape)")
    g.add_argument("--trace", type=trace_path, default=None, metavar="JSONL|synthetic",
                   help="replay a trace by its timestamps: Mooncake's format (hash_ids) or kvroute's, "
                        "auto-detected; prompts are synthesized per hash id; `synthetic`: Mooncake's synthetic trace, shipped with kvroute")
    g.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="send the trace X times faster than recorded (default 1)")
    g.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="with --trace: folder for summary.json and the plots (hit rate and each worker's "
                        "load over time, TTFT by hit and miss) (default kvroute-results/sim-trace-<time>)")
    add_trace_window_arguments(g)


def run(args: argparse.Namespace, policies: list[str], options: dict[str, dict], kv_geometry,
        retention: list[str] | None = None) -> int:
    if args.time_scale <= 0:
        raise UserError("--time-scale must be > 0")
    workers = parse_int_list(args.workers or "8", "--workers")
    num_blocks, block_size, _ = kv_geometry(args)
    config = WorkerConfig(num_blocks, block_size, get_preset(args.timing))
    trace = load_trace(args.trace).select(args.start, args.duration, args.max_requests, args.cut_sessions)
    if not len(trace):
        raise UserError(f"{args.trace}: no request in the selected window")
    console = output_console()
    usable = usable_blocks(num_blocks)
    table = Table(title=f"{args.trace.name}: {len(trace)} requests, {usable} KV blocks of "
                        f"{block_size} per worker ({usable * block_size:,} tokens), "
                        f"timing {args.timing}, time scale {args.time_scale:g}",
                  box=box.SIMPLE_HEAVY)
    for column in ("W", "policy", "simulated", "refused", "request hit", "token hit",
                   "TTFT p50 ms", "TTFT p99 ms", "busiest ÷ mean", "refreshes/req", "sim s"):
        table.add_column(column, justify="right" if column not in ("policy",) else "left")
    points = []
    report_points: list[Point] = []
    samples: dict[tuple[int, int, int, str], PointSamples] = {}
    timelines: Timelines = {}
    # (workers, policy, retention mode) per replay; a mode other than off names the row. No
    # mode given: each policy's as kvroute serve runs it.
    jobs = [(w, base, mode) for w in workers for base in policies for mode in retention_modes(base, retention)]
    with console.status(f"simulating {len(jobs)} replays…"):
        inputs = trace_inputs(trace, args.max_model_len, args.time_scale)
        runs = {job: trace_policy(job[1], args.seed, block_size, options[job[1]]) for job in jobs}

        def replay(job: tuple[int, str, str]):
            try:
                return simulate_trace(trace, job[0], config, runs[job], args.max_model_len, args.time_scale, inputs,
                                      job[2])
            except ValueError as exc:  # a request larger than a worker's whole cache
                raise UserError(str(exc)) from None

        # The replays are independent trials and each runs natively without the interpreter
        # lock: side by side, one per core. The slowest start first (a policy that reads the
        # KV index takes in every engine's events, several times the work), so that the others
        # fill the remaining cores meanwhile instead of delaying it.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        order = sorted(jobs, key=lambda job: (not runs[job].needs_overlap, -job[0]))
        with ThreadPoolExecutor(max_workers=max(1, min(cores, len(jobs)))) as pool:
            futures = {pool.submit(replay, job): job for job in order}
            for _ in as_completed(futures):
                if sum(not f.done() for f in futures) < cores:
                    # A core is idle while the slowest replays finish: import the plotting
                    # library on it now rather than after them.
                    pyplot()
                    break
            done = {job: future.result() for future, job in futures.items()}
        results = [done[job] for job in jobs]
    for (w, base, mode), result in zip(jobs, results):
        name = base if mode == "off" else f"{base}+retain-{mode}"
        stats = result.stats()
        busiest = busiest_share(stats, w)
        points.append({"workers": w, "policy": name, "refused_max_model_len": result.refused,
                       "busiest_over_mean": busiest, **stats.to_json()})
        report_points.append(Point(w, 0, 0, name, [stats]))
        timelines[(w, name)] = result.records
        samples.setdefault((w, 0, 0, name), PointSamples()).add(result.records)
        table.add_row(
            str(w), name, f"{stats.requests:,}", f"{result.refused:,}",
            f"{stats.request_hit_rate:.1%}", f"{stats.token_hit_rate:.1%}",
            _ms(stats.ttft_p50_ms), _ms(stats.ttft_p99_ms), f"{busiest:.2f}",
            f"{stats.refreshes / max(1, stats.requests):.2f}", f"{result.duration_s:,.0f}",
        )
    console.print(table)
    if any(p["refused_max_model_len"] for p in points):
        console.print(f"refused: requests whose prompt and output exceed --max-model-len {args.max_model_len} "
                      "(raise it to simulate them)")
    meta = {"command": "sim --trace", "trace": str(args.trace), "requests": len(trace), "num_blocks": num_blocks,
            "block_size": block_size, "timing": args.timing, "time_scale": args.time_scale}
    out = args.out or Path("kvroute-results") / time.strftime("sim-trace-%Y%m%d-%H%M%S")
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_points_json(out / "summary.json", report_points, meta)
        pngs = write_plots(out, report_points, samples, None, timelines=timelines, timelines_source="simulated")
        if args.json:
            args.json.write_text(json.dumps({**meta, "points": points}, indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write {exc.filename or out}: {exc.strerror or exc}") from None
    console.print(f"wrote {out}/: summary.json, {', '.join(p.name for p in pngs)}"
                  + (f"; {args.json}" if args.json else ""))
    return 0


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"
